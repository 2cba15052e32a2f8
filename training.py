"""The heads' losses, the training loop with its checkpoints, and the measurements of a trained
head (top-k accuracy by depth, tau of the real decoding loop), for train_heads.py.

Dimensions: B batch, T tokens, S cache slots, C hidden size, V vocab, R reduced draft vocab,
J unrolled draft steps (EAGLE-3's training-time test).
"""
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from tqdm import tqdm

from kernel import with_ones
from checkpoint import save_tensors
from decode import GenConfig, generate_spec
from features import Batch, batches, make_batch
from heads import Eagle3Head, best_paths, projection_rows
from model import KVCache
from proposers import DraftConfig, EagleProposer, MedusaProposer
from tree import static_tree


# ---------------------------------------------------------------- losses

def teacher(target_feats, proj) -> torch.Tensor:
    """(n, C) target features -> (n,) what the head learns there, for F.cross_entropy: the index
    of the target's greedy token in the draft vocab.

    The argmax, not the target's distribution: at temperature 0 a node is accepted when it is
    the target's argmax, so a head trained on argmax labels estimates its own acceptance
    probability (what EAGLE-2's tree and size rule read); the distribution measured no better
    (docs/TRAINING.md)."""
    return (target_feats @ proj.T).argmax(-1)                          # (n, R) -> (n,)


def scorer(head, proj):
    """The head's scores over its draft vocabulary, (..., C) -> (..., R): an EAGLE-3 head's own
    lm_head after its norm, else the target's rows `proj` (R, C)."""
    return head.projection() if isinstance(head, Eagle3Head) else (lambda out: out @ proj.T)


def eagle3_batch(b: Batch, C: int) -> Batch:
    """An EAGLE-3 head's batch from shards of [its three taps; the final hidden] (4C) a token:
    it reads the taps, and learns the target's greedy token from the next final hidden."""
    return replace(b, feats=b.feats[..., :-C], target=b.target[..., -C:])


def ttt_mask(L: int, j: int, device="cpu") -> torch.Tensor:
    """(L, (j + 1) L) bool for unrolled step j (EAGLE-3's training-time test).

    Entry i at step j drafts depth j + 1 from the root at i - j: it sees the true entries up to
    i - j and, at each step m = 1..j, the entry of its own path at i - j + m (the one it extends),
    exactly what a tree node sees in the head's cache at inference."""
    i = torch.arange(L, device=device)[:, None]
    s = torch.arange(L, device=device)[None, :]
    parts = [s <= i - j] + [s == i - j + m for m in range(1, j + 1)]
    return torch.cat(parts, dim=1)


def eagle_unroll(head, embed, b: Batch, steps: int) -> list:
    """The head's outputs (B, L, C) at each of `steps` unrolled drafting steps."""
    B, L = b.feats.shape[:2]
    embeds = embed(b.next_tok)                                         # (B, L, C)
    pos = torch.arange(L, device=b.feats.device)[None].expand(B, L)
    cache, feats, outs = head.new_cache(0, B), b.feats, []
    for j in range(steps):
        # fresh tensors every step (a list stands in for the cache's stacked layer): autograd
        # keeps each step's keys for the backward pass, and a later step writing into the same
        # tensor would invalidate them
        cache = KVCache([widen(k, L) for k in cache.k], [widen(v, L, ones=True) for v in cache.v],
                        j * L)
        outs.append(head(feats, embeds, pos, cache, ttt_mask(L, j, pos.device)))  # (B, L, C)
        feats = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], 1)   # g_{i-1}
    return outs


def widen(x: torch.Tensor, L: int, ones: bool = False) -> torch.Tensor:
    """One layer's (B, K, S, E) -> (B, K, S + L, E), the new slots zero; ones: values, whose
    new slots get the column of ones a cache holds (kernel.with_ones)."""
    new = x.new_zeros(*x.shape[:2], L, x.shape[3] - ones)
    return torch.cat([x, with_ones(new) if ones else new], dim=2)


# EAGLE's training-time test unrolls UNROLL drafting steps (5 measured no better: tau 2.28 ->
# 2.26); the smooth-L1 feature loss weighs FEATURE_WEIGHT (0 measured no better: 2.28 -> 2.30,
# within noise); docs/TRAINING.md
UNROLL = 3
FEATURE_WEIGHT = 0.1


def eagle_loss(head, embed, proj, b: Batch, steps: int = UNROLL,
               feature_weight: float = FEATURE_WEIGHT) -> tuple:
    """Cross-entropy (+ smooth L1 on the feature) at every unrolled step; -> (loss, [ce])."""
    teach, score = teacher(b.target[b.loss_mask], proj), scorer(head, proj)   # loss rows
    col = b.loss_mask.nonzero()[:, 1]                                  # their positions
    total, ces = 0.0, []
    for j, out in enumerate(eagle_unroll(head, embed, b, steps)):
        mask = b.loss_mask.clone()
        mask[:, :j] = False                                            # no root before the start
        out = out[mask]                                                # (n, C): loss rows only
        ce = torch.nn.functional.cross_entropy(score(out).float(), teach[col >= j])
        fl = feature_weight and torch.nn.functional.smooth_l1_loss(out.float(), b.target[mask])
        total, ces = total + ce + feature_weight * fl, ces + [float(ce.detach())]
    return total / steps, ces


def medusa_loss(heads, proj, b: Batch) -> tuple:
    """Head m on the feature at i predicts token i + 2 + m, the target's greedy token there."""
    logits = heads(b.feats) @ proj.T               # (B, L, M, R)
    total, ces = 0.0, []
    for m in range(logits.shape[2]):
        L = b.feats.shape[1] - m
        mask = b.loss_mask[:, m:]                                      # token i + 2 + m is known
        teach = teacher(b.target[:, m:][mask], proj)                   # from the feature at i + 1 + m
        ce = torch.nn.functional.cross_entropy(logits[:, :L, m][mask].float(), teach)
        total, ces = total + ce, ces + [float(ce.detach())]
    return total / logits.shape[2], ces


def draft_batch(seqs: list, device="cpu") -> tuple:
    """-> tokens (B, L), the target's features there (B, L, C), loss mask (B, L): entry i reads
    token i and predicts token i + 1, an answer token."""
    L, at = max(len(s.hidden) for s in seqs), {"device": seqs[0].hidden.device}
    tokens = torch.zeros(len(seqs), L, dtype=torch.long, **at)
    feats = torch.zeros(len(seqs), L, seqs[0].hidden.shape[1], **at)
    mask = torch.zeros(len(seqs), L, dtype=torch.bool, **at)
    for r, s in enumerate(seqs):
        n = len(s.hidden)
        tokens[r, :n], feats[r, :n] = s.tokens[:n], s.hidden.float()
        mask[r, s.prompt_len - 1:n] = True
    return tokens.to(device), feats.to(device), mask.to(device)


def block_rows(loss: torch.Tensor, k: int) -> tuple:
    """Blocks of k - 1 mask rows after the L rows of a batch (PARD's, An et al. 2025; DFlash's),
    each after an anchor a drawn among the rows with a loss whose next row has one too, at
    positions a + 1 .. a + k - 1: a block's masks see the rows up to a and the masks before
    them in it, exactly what the masks after a root see at inference, and the mask at position
    p learns what row p learns. Enough anchors that the masks are about as many as the rows.
    loss (B, L) bool -> a mask's anchor and position (B, M), its loss mask (B, M), and who sees
    whom among the L + M rows (B, L + M, L + M) bool."""
    B, L = loss.shape
    device = loss.device
    anchor_ok = loss & torch.cat([loss[:, 1:], torch.zeros_like(loss[:, :1])], 1)  # one after
    A = -(-int(anchor_ok.sum(1).max()) // (k - 1))                   # anchors a row
    draw = torch.rand(B, L, device=device).masked_fill(~anchor_ok, 2.0)
    pick = draw.topk(A, dim=1, largest=False)                        # (B, A): random valid ones
    j = torch.arange(k - 1, device=device).repeat(A)                 # (M,) a mask's place
    anchor = pick.indices.repeat_interleave(k - 1, 1)                # (B, M)
    at = anchor + 1 + j                                              # (B, M): its position
    block_loss = (loss.gather(1, at.clamp(max=L - 1)) & (at < L)
                  & (pick.values < 2.0).repeat_interleave(k - 1, 1))
    block = torch.arange(A, device=device).repeat_interleave(k - 1)  # (M,) a mask's block
    sees_rows = torch.arange(L, device=device) <= anchor[:, :, None]             # (B, M, L)
    sees_masks = (block[:, None] == block[None]) & (j[None] <= j[:, None])        # (M, M)
    causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    seen = torch.cat([torch.cat([causal, causal.new_zeros(L, len(block))], 1).expand(B, -1, -1),
                      torch.cat([sees_rows, sees_masks.expand(B, -1, -1)], 2)], 1)
    return anchor, at, block_loss, seen


def rows_at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B, L, E), index (B, M) -> (B, M, E): each batch row's entries at those indices."""
    return x.gather(1, index.clamp(max=x.shape[1] - 1)[..., None].expand(-1, -1, x.shape[2]))


def pard_batch(seqs: list, k: int, mask_id: int, device="cpu") -> tuple:
    """PARD's training rows for drafts of k tokens a forward: draft_batch's, then block_rows'
    mask tokens; the mask at position p learns the target's distribution at p (the token j + 2
    places after its anchor, mask j). -> tokens, positions (B, T), mask (B, T, T) bool, the
    target's features (B, T, C) and loss mask (B, T) of every row."""
    tokens, feats, loss = draft_batch(seqs, device)                  # (B, L), (B, L, C), (B, L)
    _, at, block_loss, seen = block_rows(loss, k)
    positions = torch.cat([torch.arange(tokens.shape[1], device=device).expand_as(tokens), at], 1)
    return (torch.cat([tokens, torch.full_like(at, mask_id)], 1), positions, seen,
            torch.cat([feats, rows_at(feats, at)], 1), torch.cat([loss, block_loss], 1))


def block_batch(b: Batch, k: int, mask_id: int) -> tuple:
    """An EAGLE-3 block head's training rows (b: eagle3_batch's): b's, then block_rows' masks,
    each reading its anchor's taps and the mask token and learning the target's greedy token
    at its place. -> taps (B, T, 3C), tokens (B, T), the target's features (B, T, C), loss
    mask, positions (B, T) and who sees whom (B, T, T)."""
    B, L = b.loss_mask.shape
    anchor, at, mask_loss, seen = block_rows(b.loss_mask, k)
    return (torch.cat([b.feats, rows_at(b.feats, anchor)], 1),
            torch.cat([b.next_tok, torch.full_like(at, mask_id)], 1),
            torch.cat([b.target, rows_at(b.target, at)], 1), torch.cat([b.loss_mask, mask_loss], 1),
            torch.cat([torch.arange(L, device=at.device).expand(B, L), at], 1), seen)


def block_forward(head, embed, feats, tokens, positions, seen) -> torch.Tensor:
    """One head forward over block_batch's rows, in a fresh cache of their number -> (B, T, C)."""
    B, T = tokens.shape
    empty = head.new_cache(0, B)
    cache = KVCache([widen(x, T) for x in empty.k], [widen(x, T, ones=True) for x in empty.v])
    return head(feats, embed(tokens), positions, cache, seen)


def block_loss(head, embed, proj, b: Batch, k: int, mask_id: int) -> tuple:
    """A block head's cross-entropy on block_batch's rows -> (loss, [ce on the rows, ce on
    the masks]). No unroll: a block head never reads its own features."""
    feats, tokens, target, loss, pos, seen = block_batch(b, k, mask_id)
    out = block_forward(head, embed, feats, tokens, pos, seen)[loss]             # (n, C)
    ce = torch.nn.functional.cross_entropy(scorer(head, proj)(out).float(),
                                           teacher(target[loss], proj), reduction="none")
    column = torch.arange(tokens.shape[1], device=ce.device).expand_as(loss)[loss]   # (n,)
    real, parts = column < b.loss_mask.shape[1], ce.detach()
    return ce.mean(), [float(parts[real].mean()), float(parts[~real].mean())]


def draft_hidden(draft, tokens, positions=None, mask=None) -> torch.Tensor:
    """Llama.forward for training: tokens (B, T) at positions (B, T) (None: 0, 1, ...) seeing
    what mask (B, T, T) says (None: causal) -> final features (B, T, C). Each layer gets fresh
    K/V buffers: in one shared cache tensor a later layer's write would bump the version of
    what earlier layers saved for backward, and autograd refuses that."""
    B, T = tokens.shape
    c = draft.config
    k = [draft.embed.weight.new_zeros(B, c.num_kv_heads, T, c.head_dim) for _ in draft.layers]
    cache = KVCache(k, [with_ones(torch.zeros_like(x)) for x in k])        # (B, K, T, D) each
    positions = torch.arange(T, device=tokens.device)[None] if positions is None else positions
    return draft(tokens, positions, cache, mask, project=False)[1]


def draft_loss(draft, seqs: list, k: int = 1, mask_id: int | None = None) -> tuple:
    """KL(target || draft) over the full vocabulary at every answer position, and with k > 1
    at PARD's mask positions too (pard_batch); -> (loss, [kl, top-1 agreement on the tokens,
    on the masks where k > 1]). The target's distribution is its lm_head over the cached
    feature."""
    device = draft.lm_head.weight.device
    if k > 1:
        tokens, positions, seen, feats, mask = pard_batch(seqs, k, mask_id, device)
    else:
        (tokens, feats, mask), positions, seen = draft_batch(seqs, device), None, None
    hidden = draft_hidden(draft, tokens, positions, seen)                      # (B, T, C)
    W = draft.lm_head.weight                                                   # (V, C) frozen
    log_q = (hidden[mask] @ W.T).float().log_softmax(-1)                       # (n, V)
    with torch.no_grad():
        log_p = (feats[mask] @ W.T).float().log_softmax(-1)                    # (n, V)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    agree = log_q.argmax(-1) == log_p.argmax(-1)                               # (n,)
    L = max(len(s.hidden) for s in seqs)                                       # then masks
    real = torch.arange(mask.shape[1], device=device).expand_as(mask)[mask] < L   # (n,)
    parts = [agree[real]] + ([agree[~real]] if k > 1 else [])
    return kl, [float(kl.detach())] + [float(a.float().mean()) for a in parts]


# ---------------------------------------------------------------- the training loop

@dataclass
class TrainConfig:
    epochs: float = 1.0            # passes over the training sequences
    minutes: float = 0.0           # stop (and save) after this wall time; 0: no limit
    lr: float = 1e-3
    tokens_per_batch: int = 4096   # padded tokens per optimizer step
    seed: int = 0


def train(head, loss_fn, seqs: list, tc: TrainConfig, out: str) -> dict:
    """AdamW, linear warm-up and decay; resumes from the checkpoint in OUT; -> training record.

    loss_fn(list of Seq) -> (loss, [numbers to log]); only parameters that require grad learn."""
    g = torch.Generator().manual_seed(tc.seed)
    device = next(head.parameters()).device
    per_epoch = len(batches(seqs, tc.tokens_per_batch, g))
    total = max(int(per_epoch * tc.epochs), 1)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=tc.lr)
    warm = min(100, total // 10 + 1)
    state = {"step": 0, "seconds": 0.0, "losses": []}
    os.makedirs(out, exist_ok=True)
    if os.path.exists(os.path.join(out, CHECKPOINT)):
        state.update(load_checkpoint(out, head, opt))
        print(f"resumed at step {state['step']} of {total}", file=sys.stderr)
    t0, last_save = time.time() - state["seconds"], time.time()
    bar = tqdm(total=total, initial=state["step"], desc="train", unit="step")
    while state["step"] < total:
        # linear warm-up, then linear decay to 5% over the steps or the time limit, whichever
        # comes first: a CPU run cut short by --minutes still ends at a low learning rate
        done = max(state["step"] / total, state["seconds"] / (tc.minutes * 60) if tc.minutes else 0)
        for group in opt.param_groups:
            group["lr"] = tc.lr * min((state["step"] + 1) / warm, max(0.05, 1 - done))
        epoch, index = divmod(state["step"], per_epoch)
        order = batches(seqs, tc.tokens_per_batch, torch.Generator().manual_seed(tc.seed + epoch))
        with torch.autocast(device.type, torch.bfloat16):   # matmuls ~2x faster on CPUs
            loss, ces = loss_fn([seqs[i] for i in order[index]])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step(), opt.zero_grad()
        state["step"] += 1
        state["seconds"] = time.time() - t0
        state["losses"].append([round(c, 4) for c in ces])
        bar.update(1)
        bar.set_postfix(ce=" ".join(f"{c:.2f}" for c in ces))
        over = tc.minutes and state["seconds"] > tc.minutes * 60
        if over or state["step"] == total or time.time() - last_save > 300:
            save_checkpoint(out, head, opt, state)
            last_save = time.time()
        if over:
            print(f"time limit: stopped at step {state['step']} of {total}", file=sys.stderr)
            break
    bar.close()
    return state | {"total_steps": total}


CHECKPOINT = "checkpoint.safetensors"


def save_checkpoint(out: str, head, opt, state: dict) -> None:
    """The head's and the optimizer's tensors, and as JSON metadata the training state, in one
    safetensors file written atomically: no pickle, so loading it cannot run code."""
    sd = opt.state_dict()
    tensors = {f"head.{k}": v.detach().cpu().clone() for k, v in head.state_dict().items()}
    tensors |= {f"opt.{i}.{k}": v.detach().cpu().clone() for i, s in sd["state"].items()
                for k, v in s.items()}
    meta = {"state": json.dumps(state), "param_groups": json.dumps(sd["param_groups"])}
    save_tensors(tensors, os.path.join(out, CHECKPOINT), meta)


def load_checkpoint(out: str, head, opt) -> dict:
    """Restores what save_checkpoint wrote into head and opt -> the training state."""
    path = os.path.join(out, CHECKPOINT)
    try:
        with safe_open(path, "pt") as f:
            meta = {k: json.loads(v) for k, v in f.metadata().items()}
        tensors = load_file(path)
        head.load_state_dict({k.removeprefix("head."): v for k, v in tensors.items()
                              if k.startswith("head.")})
        state = {}
        for k, v in tensors.items():
            if k.startswith("opt."):
                _, i, name = k.split(".", 2)
                state.setdefault(int(i), {})[name] = v
        opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    except (SafetensorError, KeyError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path}: not a checkpoint of this run ({e}); delete it to start "
                         "again") from None
    return meta["state"]


# ---------------------------------------------------------------- measuring the result

@torch.inference_mode()
def measure_tau(target, proposer, seqs: list, max_new: int, stop_ids) -> float:
    """Tokens per target forward of the real decoding loop on held-out prompts."""
    new = forwards = 0
    for s in tqdm(seqs, desc="tau", unit="prompt"):
        r = generate_spec(target, proposer, s.tokens[:s.prompt_len].tolist(), GenConfig(max_new),
                          stop_ids)
        new, forwards = new + len(r.token_ids), forwards + r.target_forwards
    return new / max(forwards, 1)


@torch.no_grad()
def accuracy_table(target, head, kind: str, seqs: list, depth: int, ranks: int = 10) -> list:
    """[depth][rank]: how often the target's greedy token is the head's rank-r candidate at
    that depth, the path so far being right (teacher-forced): what best_paths needs."""
    proj = projection_rows(target, head.vocab_ids).float()                 # (R, C)
    hits, count = torch.zeros(depth, ranks, device=proj.device), 0
    for i in range(0, len(seqs), 16):
        b = make_batch(seqs[i:i + 16]).to(proj.device)
        b = eagle3_batch(b, proj.shape[1]) if kind == "eagle3" else b
        label = target.lm_head(b.target.to(target.lm_head.weight.dtype)).argmax(-1)   # (B, L)
        if kind != "medusa":
            score = scorer(head, proj)
            outs = [score(o).float() for o in eagle_unroll(head, target.embed, b, depth)]
        else:
            logits = head(b.feats.to(proj.dtype)) @ proj.T      # (B, L, M, R)
            outs = [logits[:, :, m].float() for m in range(logits.shape[2])]
        for d, logits in enumerate(outs[:depth]):
            shift = d if kind == "medusa" else 0
            L = b.feats.shape[1] - shift
            # an unrolled depth d has no root before position d (Medusa's shift: none cut)
            mask = b.loss_mask[:, shift:] & (torch.arange(L, device=proj.device) >= d - shift)
            logits = logits[:, :L]                                                # (B, L, R)
            lab = label[:, shift:].contiguous()                                   # (B, L)
            where = torch.searchsorted(head.vocab_ids, lab).clamp(max=len(head.vocab_ids) - 1)
            inside = head.vocab_ids[where] == lab
            mine = logits.gather(-1, where[..., None]).squeeze(-1)
            rank = (logits > mine[..., None]).sum(-1)                             # (B, L)
            ok = mask & inside
            hits[d] += torch.bincount(rank[ok].clamp(max=ranks), minlength=ranks + 1)[:ranks]
            if d == 0:
                count += int(mask.sum())
    return (hits / max(count, 1)).tolist()


def held_out_tau(args, target, head, config, held: list, tokenizer) -> dict:
    """tau of the real decoding loop (float32 target) on the first held-out prompts; {} with
    --tau-prompts 0 (nothing measured, rather than a tau of 0)."""
    seqs = held[:args.tau_prompts]
    if not seqs:
        return {}
    if args.method == "medusa":
        proposer = MedusaProposer(target, head, static_tree(best_paths(config.accuracy, 16)))
        return {"medusa_16": round(measure_tau(target, proposer, seqs, 64, tokenizer.stop_ids), 3)}
    proj = head.projection() if isinstance(head, Eagle3Head) else None     # default: the target's
    runs = {"eagle2_d5_k4_16": EagleProposer(target, head, DraftConfig(5, 4, 16), 512, proj=proj),
            "chain_5": EagleProposer(target, head, DraftConfig(5, 1), 512, proj=proj)}
    if config.mask_token is not None:                    # a block head: its block, one forward
        runs[f"block_{config.block}"] = EagleProposer(target, head, DraftConfig(config.block),
                                                      512, proj=proj, mask_id=config.mask_token)
    return {name: round(measure_tau(target, p, seqs, 64, tokenizer.stop_ids), 3)
            for name, p in runs.items()}


def git_commit() -> str:
    """HEAD's hash, with "-dirty" when tracked files differ from it (the code that ran is then
    not exactly that commit's)."""
    here = os.path.dirname(os.path.abspath(__file__))

    def run(*cmd):
        done = subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=here)
        return done.stdout.strip()
    try:
        head = run("rev-parse", "HEAD")
        return head + ("-dirty" if head and run("status", "--porcelain", "--untracked-files=no")
                       else "")
    except OSError:
        return ""


def record_fields(record: dict) -> dict:
    return {"steps": record["step"], "total_steps": record["total_steps"],
            "wall_seconds": round(record["seconds"]),
            "final_ce": [round(sum(x) / len(x), 4) for x in zip(*record["losses"][-50:])],
            "commit": git_commit()}
