"""Train draft heads (EAGLE, Medusa) and a distilled draft model on the target's own outputs.

    python train_heads.py --method eagle --data prompts.jsonl --out weights/smollm2-135m-eagle
    python train_heads.py --method draft --data prompts.jsonl --out my-draft   # a HF Llama folder

Two stages, both resumable:
  1. features: the target reads (or, for prompt-only lines, first writes) each conversation; its
     tokens and final hidden states go to FEATURES/shard_*.safetensors in 16-bit.
  2. training: the proposer learns from those shards (EAGLE and Medusa: cross-entropy against the
     target's greedy token; the draft model: KL to the target's full distribution, computed from
     the cached feature through the target's lm_head); checkpoints every few minutes.
At the end tau is measured with the real decoding loop on held-out prompts and written, with the
data, steps, wall time and losses, to OUT/training.json.

    python train_heads.py export my-eagle OUT --format eagle

writes a trained EAGLE head in the EAGLE authors' format, for serving engines (export.py).

Dimensions: B batch, T tokens, S cache slots, C hidden size, V vocab, R reduced draft vocab,
J unrolled draft steps (EAGLE-3's training-time test).
"""
import argparse
import copy
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields, replace

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from torch import nn
from tqdm import tqdm

from attention import attention_mask, with_ones
from bench import jsonl_rows
from checkpoint import load_model, save_tensors, to_hf_names, write_json
from decode import GenConfig, generate_spec
from default_model import cache_dir, default_model_path
from export import FORMATS, check_export, export_draft, export_head
from heads import (EAGLE_ROPE_THETA, HeadConfig, best_paths, build_head, eagle_layer_config,
                   load_head, projection_rows, read_head_config)
from methods import DRAFT_VOCAB, parse_flags
from model import KVCache, Llama, LlamaConfig
from proposers import DraftConfig, DraftModelProposer, EagleProposer, MedusaProposer
from tokenizer import load_tokenizer
from tree import static_tree


SHARD_LINES = 256            # data lines per feature shard: the unit of resumption


# ---------------------------------------------------------------- data

def read_conversations(path: str, sources=()) -> list:
    """JSONL -> [(user text, assistant text or None)]: `messages` pairs, or `prompt` alone (the
    target then writes the answer itself). sources: keep only lines whose `source` is one of
    them. A bad line names its number."""
    rows = []
    for number, row in jsonl_rows(path):
        if sources and row.get("source") not in sources:
            continue
        try:
            if "prompt" in row:
                rows.append((str(row["prompt"]), None))
                continue
            turns = {m["role"]: m["content"] for m in row["messages"]}
            rows.append((turns["user"], turns["assistant"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"{path}:{number}: expected 'prompt' or 'messages' with a user "
                             f"and an assistant turn ({e!r})") from None
    if not rows:
        raise ValueError(f"{path}: no training lines" + (f" from sources {', '.join(sources)}"
                                                         if sources else ""))
    return rows


def templated_prompts(rows: list, templates: list, seed: int) -> list:
    """Each prompt rewritten by one of the templates ("... {prompt} ..."), drawn at random; the
    answers are dropped, for the target to write. Turns short questions into requests for
    long answers, e.g. "Explain in detail: {prompt}"."""
    for t in templates:
        if "{prompt}" not in t:
            raise ValueError(f"--template {t!r}: it must contain {{prompt}}")
    rnd = random.Random(seed)
    return [(rnd.choice(templates).replace("{prompt}", q), None) for q, _ in rows]


# ---------------------------------------------------------------- the target writes and reads

@torch.inference_mode()
def teacher_forced(target: Llama, seqs: list, taps=()) -> list:
    """Run full sequences (right-padded: causal attention never looks right) -> hidden (L_i, C),
    or (L_i, (k + 1) C) with the k tapped layers' outputs first (Llama.forward's taps)."""
    L, device = max(len(s) for s in seqs), target.embed.weight.device
    ids = torch.tensor([s + [0] * (L - len(s)) for s in seqs], device=device)   # (B, L)
    cache = target.new_cache(len(seqs), L)
    _, hidden = target(ids, torch.arange(L, device=device)[None], cache, last_only=True,
                       taps=taps)
    return [hidden[b, :len(s)].to("cpu", copy=True) for b, s in enumerate(seqs)]  # own storage


@torch.inference_mode()
def batched_greedy(target: Llama, prompts: list, max_new: int, stop_ids) -> list:
    """Greedy answers for a batch of prompts -> [(tokens, hidden (len(tokens) - 1, C))].

    Prompts are left-padded; each row masks its padding and counts positions from its first real
    token, so every row decodes exactly as it would alone. Rows that finished leave the batch."""
    B, P = len(prompts), max(len(p) for p in prompts)
    device = target.embed.weight.device
    pad = torch.tensor([P - len(p) for p in prompts], device=device)       # (B,)
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts], device=device)   # (B, P)
    cache = target.new_cache(B, P + max_new)
    valid = torch.arange(P + max_new, device=device)[None] >= pad[:, None]   # (B, S) real slots
    causal = torch.ones(P, P, dtype=torch.bool, device=device).tril()
    # padding sees itself only: a query row that sees nothing would give NaN, and 0 * NaN
    # in a later attention product is still NaN
    mask = (causal[None] & valid[:, None, :P]) | torch.eye(P, dtype=torch.bool, device=device)
    mask = mask[:, None]                                                   # (B, 1, P, P)
    pos = (torch.arange(P, device=device)[None] - pad[:, None]).clamp(min=0)   # (B, P)
    logits, hidden = target(ids, pos, cache, mask, last_only=True)
    tokens = [list(p) for p in prompts]
    feats = [[hidden[b, P - len(p):]] for b, p in enumerate(prompts)]
    alive = list(range(B))                                                 # rows still writing
    for step in range(max_new):
        nxt = logits[:, -1].argmax(-1)                                     # (b,)
        chosen = nxt.tolist()                          # the one host sync a step: stop or not
        for b, t in zip(alive, chosen):
            tokens[b].append(t)
        keep = [i for i, t in enumerate(chosen) if t not in stop_ids]
        if step == max_new - 1 or not keep:
            break
        if len(keep) < len(alive):                                         # drop finished rows
            alive = [alive[i] for i in keep]
            rows = torch.tensor(keep, device=device)
            nxt, pad, valid = nxt[rows], pad[rows], valid[rows]
            cache = KVCache(cache.k[:, rows], cache.v[:, rows], cache.length)
        start = cache.length
        mask = valid[:, None, None, :start + 1]                            # (b, 1, 1, start + 1)
        pos = (start - pad)[:, None]                                       # (b, 1)
        logits, hidden = target(nxt[:, None], pos, cache, mask)
        for i, b in enumerate(alive):
            feats[b].append(hidden[i])
    return [(tokens[b], torch.cat(feats[b]).cpu()) for b in range(B)]


def save_shard(path: str, tokens: list, hidden: list, prompt_lens: list) -> None:
    """One shard: flat tokens and 16-bit hidden states with offsets; written atomically."""
    lengths = torch.tensor([len(t) for t in tokens])
    tensors = {"tokens": torch.tensor([t for s in tokens for t in s], dtype=torch.int32),
               "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
               "prompt_lens": torch.tensor(prompt_lens),
               # hidden state of every token but each sequence's last (never fed to the target)
               "hidden": torch.cat([h[:len(t) - 1] for t, h in zip(tokens, hidden)]).bfloat16()}
    save_tensors(tensors, path)


def extract_features(target: Llama, tokenizer, rows: list, out: str, batch: int,
                     max_new: int, max_prompt: int) -> None:
    """Write FEATURES/shard_*.safetensors; shards already there are kept (resumption)."""
    os.makedirs(out, exist_ok=True)
    shards = range(0, len(rows), SHARD_LINES)
    todo = [s for s in shards if not os.path.exists(f"{out}/shard_{s // SHARD_LINES:05d}.safetensors")]
    bar = tqdm(total=len(todo) * SHARD_LINES, desc="features", unit="conv", smoothing=0.05)
    for s in todo:
        tokens, hidden, prompt_lens = [], [], []
        encoded = [(tokenizer.chat_prompt(u), a) for u, a in rows[s:s + SHARD_LINES]]
        encoded = [(p, a) for p, a in encoded if len(p) <= max_prompt]
        # similar lengths share a batch; prompt-only lines and full conversations never mix
        encoded.sort(key=lambda pa: (pa[1] is not None, len(pa[0])))
        batches = [encoded[i:i + batch] for i in range(0, len(encoded), batch)]
        batches = [[x for x in part if (x[1] is None) == kind] for part in batches
                   for kind in (True, False)]
        for part in filter(None, batches):
            if part[0][1] is None:
                done = batched_greedy(target, [p for p, _ in part], max_new, tokenizer.stop_ids)
            else:
                seqs = [p + tokenizer.encode(a)[:max_new] + [tokenizer.stop_ids[0]] for p, a in part]
                done = list(zip(seqs, teacher_forced(target, seqs)))
            for (p, _), (t, h) in zip(part, done):
                tokens.append(t), hidden.append(h), prompt_lens.append(len(p))
            bar.update(len(part))
            bar.set_postfix(tokens=sum(map(len, tokens)))
        save_shard(f"{out}/shard_{s // SHARD_LINES:05d}.safetensors", tokens, hidden, prompt_lens)
    bar.close()


def taps_key(taps) -> str:
    return "taps_" + "_".join(map(str, taps))


def first_layers(target: Llama, layers: int) -> Llama:
    """The target's first `layers` blocks plus its final norm and head, sharing its weights:
    the tapped layers' outputs come from running only these (add_taps checks the range)."""
    config = LlamaConfig(**{**target.config.__dict__, "num_layers": layers})
    with torch.device("meta"):
        part = Llama(config, init=False)
    part.embed, part.norm, part.lm_head = target.embed, target.norm, target.lm_head
    part.layers = torch.nn.ModuleList(target.layers[:layers])
    part.rope = target.rope
    return part.eval()


def add_taps(target: Llama, folder: str, taps: tuple, batch: int) -> None:
    """Add the outputs of target layers `taps` to every shard of `folder` that lacks them,
    teacher-forced from the shard's own tokens (its answers stay the ones the target wrote).
    Only the layers up to the last tap run. Shard by shard, atomically: resumable."""
    if max(taps) >= target.config.num_layers:
        raise ValueError(f"--taps {list(taps)}: the target has layers 0..{target.config.num_layers - 1}")
    names = shard_names(folder)
    part, key = first_layers(target, max(taps) + 1), taps_key(taps)
    todo = [n for n in names if key not in shard_keys(os.path.join(folder, n))]
    for name in tqdm(todo, desc=f"layers {', '.join(map(str, taps))}", unit="shard"):
        t = load_file(os.path.join(folder, name))
        off = t["offsets"].tolist()
        seqs = [t["tokens"][off[i]:off[i + 1]].tolist() for i in range(len(off) - 1)]
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))     # little padding
        tapped = [None] * len(seqs)
        for i in range(0, len(order), batch):
            rows = order[i:i + batch]
            for r, h in zip(rows, teacher_forced(part, [seqs[r] for r in rows], taps)):
                tapped[r] = h[:-1, :-target.config.hidden_size]          # (n - 1, k C)
        t[key] = torch.cat(tapped).bfloat16()
        save_tensors(t, os.path.join(folder, name))


def shard_names(folder: str) -> list:
    return sorted(f for f in os.listdir(folder) if f.startswith("shard_") and f.endswith(".safetensors"))


def shard_keys(path: str) -> set:
    with safe_open(path, "pt") as f:
        return set(f.keys())


# ---------------------------------------------------------------- training data from the shards

@dataclass
class Seq:
    tokens: torch.Tensor     # (n,) long: prompt and answer
    hidden: torch.Tensor     # (n - 1, C) 16-bit: the target's final feature of every token but the last
    prompt_len: int
    tapped: torch.Tensor | None = None   # (n - 1, k C) 16-bit: the outputs of k tapped layers

    def features(self) -> torch.Tensor:
        """(n - 1, C) or (n - 1, (k + 1) C): what the head's fuse_features reads."""
        return self.hidden if self.tapped is None else torch.cat([self.tapped, self.hidden], -1)


def load_features(folder: str, taps=()) -> list:
    names = shard_names(folder) if os.path.isdir(folder) else []
    if not names:
        raise ValueError(f"{folder}: no feature shards; run with --stage features first")
    seqs = []
    for name in tqdm(names, desc="loading features", unit="shard"):
        t = load_file(os.path.join(folder, name))
        if taps and taps_key(taps) not in t:
            raise ValueError(f"{folder}/{name}: no outputs of layers {list(taps)}; run "
                             f"--stage features with the same --taps first")
        tapped = t.get(taps_key(taps)) if taps else None
        off, hoff = t["offsets"].tolist(), 0
        for i, p in enumerate(t["prompt_lens"].tolist()):
            n = off[i + 1] - off[i]
            rows = slice(hoff, hoff + n - 1)
            seqs.append(Seq(t["tokens"][off[i]:off[i + 1]].long(), t["hidden"][rows], p,
                            None if tapped is None else tapped[rows]))
            hoff += n - 1
    return seqs


def draft_vocabulary(seqs: list, size: int, always=()) -> torch.Tensor:
    """(R,) sorted target ids: the `size` most frequent answer tokens (stop tokens always in)."""
    counts = torch.zeros(int(max(int(s.tokens.max()) for s in seqs)) + 1)
    for s in seqs:
        counts += torch.bincount(s.tokens[s.prompt_len:], minlength=counts.shape[0])
    counts[list(always)] = float("inf")
    return counts.topk(min(size, int((counts > 0).sum()))).indices.sort().values


@dataclass
class Batch:
    feats: torch.Tensor      # (B, L, C) target feature at entry i ((B, L, (k + 1) C) with taps)
    next_tok: torch.Tensor   # (B, L) token i + 1, the token entry i reads
    target: torch.Tensor     # (B, L, C) target feature at i + 1, what entry i predicts
    loss_mask: torch.Tensor  # (B, L) bool: i + 1 has a feature and token i + 2 is an answer token

    def to(self, device) -> "Batch":
        return Batch(*(getattr(self, f.name).to(device) for f in fields(self)))


def make_batch(seqs: list) -> Batch:
    """Padded to the longest sequence, built where the shards were read (the CPU); a trainer
    on another device moves it there (Batch.to)."""
    L = max(len(s.hidden) for s in seqs)
    C = seqs[0].hidden.shape[1]
    W = C if seqs[0].tapped is None else C + seqs[0].tapped.shape[1]   # + the tapped layers
    B, at = len(seqs), {"device": seqs[0].hidden.device}
    b = Batch(torch.zeros(B, L, W, **at), torch.zeros(B, L, dtype=torch.long, **at),
              torch.zeros(B, L, C, **at), torch.zeros(B, L, dtype=torch.bool, **at))
    for r, s in enumerate(seqs):
        n = len(s.hidden)
        b.feats[r, :n] = s.features().float()
        b.next_tok[r, :n] = s.tokens[1:]
        b.target[r, :n - 1] = s.hidden[1:].float()
        b.loss_mask[r, max(s.prompt_len - 2, 0):n - 1] = True
    return b


def batches(seqs: list, tokens_per_batch: int, generator) -> list:
    """Similar lengths together (little padding), in a random order."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].hidden))
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * len(seqs[i].hidden) > tokens_per_batch:
            out.append(cur)
            cur = []
        cur.append(i)
    out.append(cur)
    return [out[i] for i in torch.randperm(len(out), generator=generator).tolist()]


# ---------------------------------------------------------------- losses

def teacher(target_feats, proj) -> torch.Tensor:
    """(n, C) target features -> (n,) what the head learns there, for F.cross_entropy: the index
    of the target's greedy token in the draft vocab.

    The argmax, not the target's distribution: at temperature 0 a node is accepted when it is
    the target's argmax, so a head trained on argmax labels estimates its own acceptance
    probability (what EAGLE-2's tree and size rule read); the distribution measured no better
    (docs/TRAINING.md)."""
    return (target_feats @ proj.T).argmax(-1)                          # (n, R) -> (n,)


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
    cache, feats, outs = head.new_cache(0, B), head.fuse_features(b.feats), []
    for j in range(steps):
        # fresh tensors every step (a list stands in for the cache's stacked layer): autograd
        # keeps each step's keys for the backward pass, and a later step writing into the same
        # tensor would invalidate them
        cache = KVCache([widen(k, L) for k in cache.k], [widen(v, L, ones=True) for v in cache.v],
                        j * L)
        outs.append(head(feats, embeds, pos, cache, ttt_mask(L, j, pos.device)))  # (B, L, C)
        feats = torch.cat([torch.zeros_like(feats[:, :1]), outs[-1][:, :-1]], dim=1)  # g_{i-1}
    return outs


def widen(x: torch.Tensor, L: int, ones: bool = False) -> torch.Tensor:
    """One layer's (B, K, S, E) -> (B, K, S + L, E), the new slots zero; ones: values, whose
    new slots get the column of ones a cache holds (attention.with_ones)."""
    new = x.new_zeros(*x.shape[:2], L, x.shape[3] - ones)
    return torch.cat([x, with_ones(new) if ones else new], dim=2)


def eagle_loss(head, embed, proj, b: Batch, steps: int, feature_weight: float) -> tuple:
    """Cross-entropy (+ smooth L1 on the feature) at every unrolled step; -> (loss, [ce])."""
    teach = teacher(b.target[b.loss_mask], proj)                       # loss rows, row-major
    col = b.loss_mask.nonzero()[:, 1]                                  # their positions
    total, ces = 0.0, []
    for j, out in enumerate(eagle_unroll(head, embed, b, steps)):
        mask = b.loss_mask.clone()
        mask[:, :j] = False                                            # no root before the start
        out = out[mask]                                                # (n, C): loss rows only
        ce = torch.nn.functional.cross_entropy((out @ proj.T).float(), teach[col >= j])
        fl = torch.nn.functional.smooth_l1_loss(out.float(), b.target[mask])
        total, ces = total + ce + feature_weight * fl, ces + [float(ce.detach())]
    return total / steps, ces


def medusa_loss(heads, proj, b: Batch) -> tuple:
    """Head m on the feature at i predicts token i + 2 + m, the target's greedy token there."""
    logits = heads.logits(b.feats, lambda f: f @ proj.T)               # (B, L, M, R)
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


def draft_hidden(draft, tokens) -> torch.Tensor:
    """Llama.forward for training: tokens (B, L) -> final features (B, L, C), causal. Each layer
    gets fresh K/V buffers: in one shared cache tensor a later layer's write would bump the
    version of what earlier layers saved for backward, and autograd refuses that."""
    B, L = tokens.shape
    c = draft.config
    pos = torch.arange(L, device=tokens.device)[None].expand(B, L)
    cos, sin = draft.rope(pos, torch.float32)
    mask = attention_mask(0, L, None, L, tokens.device)                        # (L, L) causal
    x = draft.embed(tokens)                                                    # (B, L, C)
    for layer in draft.layers:
        k = x.new_zeros(B, c.num_kv_heads, L, c.head_dim)
        v = with_ones(torch.zeros_like(k))                                    # as a cache holds
        x = layer(x, cos, sin, k, v, 0, mask)
    return draft.norm(x)


def draft_loss(draft, seqs: list) -> tuple:
    """KL(target || draft) over the full vocabulary at every answer position; -> (loss, [kl,
    top-1 agreement]). The target's distribution is its lm_head over the cached feature."""
    tokens, feats, mask = draft_batch(seqs, draft.lm_head.weight.device)
    hidden = draft_hidden(draft, tokens)                                       # (B, L, C)
    W = draft.lm_head.weight                                                   # (V, C) frozen
    log_q = (hidden[mask] @ W.T).float().log_softmax(-1)                       # (n, V)
    with torch.no_grad():
        log_p = (feats[mask] @ W.T).float().log_softmax(-1)                    # (n, V)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    agree = (log_q.argmax(-1) == log_p.argmax(-1)).float().mean()
    return kl, [float(kl.detach()), float(agree)]


# ---------------------------------------------------------------- the training loop

@dataclass
class TrainConfig:
    epochs: float = 1.0            # passes over the training sequences
    minutes: float = 0.0           # stop (and save) after this wall time; 0: no limit
    lr: float = 1e-3
    tokens_per_batch: int = 4096   # padded tokens per optimizer step
    steps: int = 4                 # EAGLE: unrolled drafting steps (training-time test)
    feature_weight: float = 0.1    # EAGLE: weight of the smooth-L1 feature loss
    bf16: bool = True              # autocast matmuls to bfloat16 (about 2x faster on these CPUs)
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
    if os.path.exists(os.path.join(out, "checkpoint.pt")):       # pickled, by older code
        raise ValueError(f"{out}/checkpoint.pt: a checkpoint of an older version, which this one "
                         "does not unpickle; delete it to train again from the start")
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
        with torch.autocast(device.type, torch.bfloat16, enabled=tc.bf16):
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
    proj = head_projection(target, head)                                   # (R, C)
    hits, count = torch.zeros(depth, ranks, device=proj.device), 0
    for i in range(0, len(seqs), 16):
        b = make_batch(seqs[i:i + 16]).to(proj.device)
        label = target.lm_head(b.target.to(target.lm_head.weight.dtype)).argmax(-1)   # (B, L)
        if kind == "eagle":
            outs = [o.float() @ proj.T for o in eagle_unroll(head, target.embed, b, depth)]
        else:
            logits = head.logits(b.feats.to(proj.dtype), lambda f: f @ proj.T)      # (B, L, M, R)
            outs = [logits[:, :, m].float() for m in range(logits.shape[2])]
        for d, logits in enumerate(outs[:depth]):
            shift = d if kind == "medusa" else 0
            L = b.feats.shape[1] - shift
            mask = b.loss_mask[:, shift:].clone()
            if kind == "eagle":
                mask[:, :d] = False
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
    # teacher-forced: each depth is measured with the path before it right, as best_paths assumes
    return (hits / max(count, 1)).tolist()


def head_projection(target, head) -> torch.Tensor:
    return projection_rows(target, head.vocab_ids).float()


# ---------------------------------------------------------------- command line

def layer_list(text: str) -> tuple:
    try:
        taps = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer indices like 1,14, got {text!r}")
    if any(t < 0 for t in taps) or len(set(taps)) != len(taps):
        raise argparse.ArgumentTypeError(f"layer indices must be distinct and >= 0, got {text!r}")
    return tuple(sorted(taps))


def parse_args(argv=None):
    return parse_flags(argv, __doc__, (data_flags, shape_flags, optimizer_flags), check_ranges)


def data_flags(p) -> None:
    """What to train, from which target and data, and where the features go."""
    p.add_argument("--method", choices=["eagle", "medusa", "draft"], required=True,
                   help="what to train: the EAGLE head (used by spec.py --method eagle and "
                        "eagle2), Medusa heads, or a distilled draft model (--method draft)")
    p.add_argument("--data", required=True,
                   help="JSONL with `prompt` (the target writes the answer) or `messages`")
    p.add_argument("--out", required=True, help="folder for the trained weights")
    p.add_argument("--model", help="target HF folder (default: the embedded default model)")
    p.add_argument("--cache-dir", help="where the default model lives (default ~/.cache/spec-decode)")
    p.add_argument("--features", help="feature cache folder (default: beside the target model, "
                                      "named after the data file); training reads a comma-"
                                      "separated list of them, holding out the last folder's last "
                                      "sequences")
    p.add_argument("--stage", choices=["features", "train", "all"], default="all",
                   help="stop after feature extraction, or only train from existing features")
    p.add_argument("--limit", type=int, default=0, help="use the first N data lines (0: all)")
    p.add_argument("--sources", type=lambda s: tuple(s.split(",")), default=(), metavar="A,B",
                   help="use only --data lines whose 'source' field is one of these")
    p.add_argument("--template", action="append", default=[], metavar="TEXT",
                   help="rewrite every prompt as TEXT with {prompt} replaced (given several "
                        "times: one drawn at random per prompt), for the target to answer; "
                        "features go to a folder of their own")
    p.add_argument("--batch", type=int, default=64, help="sequences per target forward")
    p.add_argument("--max-new-tokens", type=int, default=192,
                   help="longest answer the target writes (or that is kept of a dataset answer)")
    p.add_argument("--max-prompt-tokens", type=int, default=384, help="skip longer prompts")
    p.add_argument("--device", help="cpu, cuda, ... for the target, the head and the batches "
                                    "(default: the best available); the shards stay on disk")


def shape_flags(p) -> None:
    """The head or draft trained: its vocabulary, size, start and taps."""
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="R: the heads (and the draft model's greedy drafts) predict over the R most "
                        "frequent answer tokens")
    p.add_argument("--heads", type=int, default=4, help="Medusa: number of heads")
    p.add_argument("--layers", type=int, default=4,
                   help="draft: decoder layers, started from evenly spaced target layers")
    p.add_argument("--without-embeddings", action="store_true",
                   help="draft: leave the (frozen, target-equal) embedding matrix out of the "
                        "saved folder; spec.py rebuilds it from the target at first use. This "
                        "is how the shipped draft is stored")
    p.add_argument("--init", metavar="FOLDER",
                   help="EAGLE, Medusa: start from the head in FOLDER (written by this script) "
                        "instead of a fresh one, e.g. to train a shipped head on more data; its "
                        "shape and draft vocabulary are kept (--draft-vocab and --heads then "
                        "do not apply)")
    p.add_argument("--wise", type=float, default=1.0, metavar="ALPHA",
                   help="EAGLE, Medusa with --init: keep ALPHA of the way from the --init head "
                        "to the newly trained one, weight by weight (WiSE-FT; 1: the trained "
                        "head as is). Applied after training, before the measurements; a rerun "
                        "of a finished run applies it to the checkpoint's head")
    p.add_argument("--taps", type=layer_list, default=(), metavar="I,J",
                   help="EAGLE: also feed the head the outputs of these target layers (0-based), "
                        "fused with the final feature (EAGLE-3); e.g. 1,14. The features stage "
                        "adds them to existing shards. With --init, a head without taps gains "
                        "them, started as a pass-through of the final feature")


def optimizer_flags(p) -> None:
    """How long and how it learns, and what is held out to measure it."""
    d = TrainConfig()
    p.add_argument("--held-out", type=int, default=128,
                   help="sequences kept out of training to measure accuracy and tau")
    p.add_argument("--tau-prompts", type=int, default=10, help="held-out prompts decoded for tau")
    p.add_argument("--epochs", type=float, default=d.epochs, help="passes over the training data")
    p.add_argument("--minutes", type=float, default=d.minutes,
                   help="stop training after this many minutes (0: no limit); rerun to resume")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    p.add_argument("--tokens-per-batch", type=int, default=d.tokens_per_batch,
                   help="padded tokens per optimizer step")
    p.add_argument("--steps", type=int, default=d.steps,
                   help="EAGLE: drafting steps unrolled in training (EAGLE-3's training-time test)")
    p.add_argument("--feature-weight", type=float, default=d.feature_weight,
                   help="EAGLE: weight of the feature regression loss")
    p.add_argument("--seed", type=int, default=d.seed, help="shuffling and initialization seed")


def check_ranges(p, args) -> None:
    """Out-of-range numbers are named before any loading, not after minutes of extraction
    (or silently: --epochs 0 used to run a step)."""
    positive = ("epochs", "lr", "batch", "max_new_tokens", "max_prompt_tokens", "draft_vocab",
                "heads", "layers", "tokens_per_batch", "steps")
    at_least_0 = ("minutes", "limit", "held_out", "tau_prompts", "feature_weight")
    for name in positive + at_least_0:
        value = getattr(args, name)
        if value < 0 or (value == 0 and name in positive):
            flag = "--" + name.replace("_", "-")
            p.error(f"{flag} must be {'> 0' if name in positive else '>= 0'}, got {value}")


def default_features_dir(args) -> str:
    root = os.path.dirname(args.model.rstrip("/")) if args.model else \
        os.path.dirname(default_model_path(args.cache_dir))
    name = os.path.splitext(os.path.basename(args.data))[0]
    if args.sources or args.template:       # a different set of conversations: its own folder
        what = json.dumps([sorted(args.sources), args.template, args.seed]).encode()
        name += "-" + hashlib.sha1(what).hexdigest()[:8]
    return os.path.join(root, f"features-{name}")


def export_flags(p) -> None:
    """train_heads.py export HEAD_DIR OUT: a trained head in a serving engine's format."""
    p.prog = "train_heads.py export"
    p.add_argument("head", metavar="HEAD_DIR", help="a head (or distilled draft) folder written "
                                                     "by this script")
    p.add_argument("out", metavar="OUT", help="folder to write (new, or empty)")
    p.add_argument("--format", choices=FORMATS, required=True,
                   help="eagle: an EAGLE head in the EAGLE authors' layout (SGLang loads it); "
                        "hf: the distilled draft as a whole HF Llama folder")
    p.add_argument("--force", action="store_true", help="replace OUT if it is not empty")
    p.add_argument("--model", help="the target HF folder the head was trained for, whose "
                                   "embedding the export holds (default: the embedded model)")
    p.add_argument("--cache-dir", help="where the default model lives (default ~/.cache/spec-decode)")
    p.add_argument("--device", help=argparse.SUPPRESS)      # parse_flags resolves one; unused


def export_command(args) -> None:
    check_export(args.head, args.out, args.format, args.force)       # before the target loads
    model_path = args.model or default_model_path(args.cache_dir)
    if args.format == "hf":
        export_draft(args.head, model_path, args.out, args.force)
    else:
        export_head(args.head, load_model(model_path, torch.float32, "cpu"), args.out,
                    args.format, args.force)
    print(f"wrote {args.out} ({args.format} format)", file=sys.stderr)


def main(argv=None):
    """The command line: bad input is one `error:` line and exit code 2, Ctrl-C one line and
    130 (what a run finished stays: feature shards and checkpoints are whole files)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    exporting = argv[:1] == ["export"]
    args = (parse_flags(argv[1:], export_flags.__doc__, [export_flags], lambda p, a: None)
            if exporting else parse_args(argv))
    try:
        export_command(args) if exporting else train_command(args)
    except (ValueError, OSError) as e:       # bad data, a missing file, a head that does not fit
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)                          # spec.py's code for bad input too
    except KeyboardInterrupt:
        print("\ninterrupted: rerun the same command to resume", file=sys.stderr)
        sys.exit(130)


def train_command(args) -> None:
    if args.init and args.method == "draft":
        raise ValueError("--init continues an EAGLE or Medusa head; it does not apply to --method draft")
    if args.taps and args.method != "eagle":
        raise ValueError("--taps feeds an EAGLE head; it does not apply to --method " + args.method)
    if not 0 <= args.wise <= 1 or (args.wise < 1 and not args.init):
        raise ValueError(f"--wise {args.wise}: a weight in [0, 1] between an --init head and "
                         "the one trained from it; it needs --init")
    if args.init:                # read now, not after an hour of self-distillation
        init = read_head_config(args.init)
        if init.kind != args.method:
            raise ValueError(f"--init {args.init} holds {init.kind} heads; --method "
                             f"{args.method} trains {args.method} heads")
        if not args.taps and args.method == "eagle":                     # the head's own taps
            args.taps = tuple(init.taps)
    check_out(args.out)
    extracting = args.stage in ("features", "all")
    if extracting:               # the data first: a bad line is named before any loading
        rows = read_conversations(args.data, args.sources)
        rows = templated_prompts(rows, args.template, args.seed) if args.template else rows
        rows = rows[:args.limit] if args.limit else rows
    model_path = args.model or default_model_path(args.cache_dir)
    features = args.features or default_features_dir(args)
    tokenizer = load_tokenizer(model_path)
    if extracting:
        if "," in features:
            raise ValueError(f"--features {features}: the features stage writes one folder")
        target = load_model(model_path, torch.bfloat16, args.device)
        extract_features(target, tokenizer, rows, features, args.batch, args.max_new_tokens,
                         args.max_prompt_tokens)
        if args.taps:
            add_taps(target, features, args.taps, args.batch)
    if args.stage in ("train", "all"):
        train_and_save(args, model_path, features, tokenizer)


def check_out(out: str) -> None:
    """--out must take files: found now, not after an hour of feature extraction."""
    made = not os.path.exists(out)
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, ".write-test")
        open(probe, "w").close()
        os.remove(probe)
        if made:
            os.rmdir(out)                     # made again when there is something to write
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write there ({e.strerror})") from None


def train_and_save(args, model_path: str, features: str, tokenizer) -> None:
    torch.manual_seed(args.seed)
    target = load_model(model_path, torch.float32, args.device).requires_grad_(False)
    seqs = [s for folder in features.split(",")            # "~" after a comma: the shell keeps it
            for s in load_features(os.path.expanduser(folder), args.taps)]
    if len(seqs) <= args.held_out:
        raise ValueError(f"{len(seqs)} sequences in {features}: need more than --held-out "
                         f"{args.held_out}")
    train_seqs, held = seqs[:-args.held_out], seqs[-args.held_out:]
    os.makedirs(args.out, exist_ok=True)
    tc = TrainConfig(epochs=args.epochs, minutes=args.minutes, lr=args.lr,
                     tokens_per_batch=args.tokens_per_batch, steps=args.steps,
                     feature_weight=args.feature_weight, seed=args.seed)
    run = train_draft if args.method == "draft" else train_head
    info = {"method": args.method, "data": os.path.abspath(args.data), "features": features,
            "train_sequences": len(train_seqs), "held_out_sequences": len(held),
            "train_tokens": sum(len(s.tokens) for s in train_seqs), "config": vars(args)}
    info |= run(args, tc, target, model_path, train_seqs, held, tokenizer, info)
    print(json.dumps({k: info[k] for k in ("steps", "wall_seconds", "final_ce", "held_out_tau")}))


def record_fields(record: dict) -> dict:
    return {"steps": record["step"], "total_steps": record["total_steps"],
            "wall_seconds": round(record["seconds"]),
            "final_ce": [round(sum(x) / len(x), 4) for x in zip(*record["losses"][-50:])],
            "commit": git_commit()}


def train_head(args, tc, target, model_path, train_seqs, held, tokenizer, info) -> dict:
    head, config = (init_head(args, target, train_seqs) if args.init
                    else new_head(args, target, train_seqs, tokenizer.stop_ids))
    proj = projection_rows(target, head.vocab_ids)                         # (R, C)
    device = proj.device
    if args.init:                       # what the head had learned before: its own record
        info = info | {"init": {"folder": os.path.abspath(args.init),
                                "training": read_json(os.path.join(args.init, "training.json"))}}
    if args.method == "eagle":
        def loss_fn(seqs):
            return eagle_loss(head, target.embed, proj, make_batch(seqs).to(device), tc.steps,
                              tc.feature_weight)
    else:
        def loss_fn(seqs):
            return medusa_loss(head, proj, make_batch(seqs).to(device))
    record = train(head, loss_fn, train_seqs, tc, args.out)
    if args.init and args.wise < 1:
        interpolate(head, init_head(args, target, train_seqs)[0], args.wise)
    head.eval()
    depth = max(tc.steps, 6) if args.method == "eagle" else args.heads
    config.accuracy = [[round(a, 4) for a in row]
                       for row in accuracy_table(target, head, args.method, held, depth)]
    tau = held_out_tau(args, target, head, config, held, tokenizer)
    info = info | record_fields(record) | {"accuracy_depth_rank": config.accuracy,
                                           "held_out_tau": tau}
    save_head(head, config, args.out, info)
    return info


def new_head(args, target, train_seqs: list, stop_ids) -> tuple:
    """-> (head, HeadConfig): residual blocks that start as the identity (Medusa) or a fresh
    EAGLE layer, over the draft vocabulary of these sequences (or of the run being resumed)."""
    ckpt = os.path.join(args.out, CHECKPOINT)
    if os.path.exists(ckpt):                 # resuming: the vocabulary the run started with
        vocab = load_file(ckpt)["head.vocab_ids"]
    else:
        vocab = draft_vocabulary(train_seqs, args.draft_vocab, stop_ids)
    c = target.config
    config = HeadConfig(args.method, c.hidden_size, c.vocab_size, len(vocab), args.heads,
                        eagle_layer_config(c) if args.method == "eagle" else {},
                        taps=list(args.taps))
    return build_head(config, vocab).to(target.embed.weight.device), config


def interpolate(head, start, alpha: float) -> None:
    """head <- alpha x head + (1 - alpha) x start, weight by weight (WiSE-FT, Wortsman et al.
    2022). Why: training a head further on one kind of text gains there and forgets elsewhere;
    part of the way back keeps most of the gain (measured: the sixth EAGLE run, see README)."""
    theirs = start.state_dict()
    with torch.no_grad():
        for name, w in head.state_dict().items():
            if w.is_floating_point():
                w.lerp_(theirs[name].to(w), 1 - alpha)


def init_head(args, target, seqs: list) -> tuple:
    """-> (head, HeadConfig) of the trained head in --init, to train further: its shape and
    draft vocabulary are kept (--draft-vocab and --heads do not apply), but for the taps it
    gains (--taps) and an older EAGLE head's move to EAGLE's layout (`to_eagle_layout`)."""
    head, config = load_head(args.init, target, args.method)
    config.accuracy = []                                                   # measured again
    if config.input_norm:
        head, config = to_eagle_layout(head.float(), config, target.embed, seqs)
    if args.taps and tuple(config.taps) != args.taps:
        if config.taps:
            raise ValueError(f"{args.init}: its head reads layers {config.taps}, not --taps "
                             f"{','.join(map(str, args.taps))}")
        config.taps = list(args.taps)             # gains a fuse layer that passes the final feature
        grown = build_head(config, head.vocab_ids)
        missing = grown.load_state_dict(head.state_dict(), strict=False).missing_keys
        assert missing == ["fuse.weight"], missing
        head = grown
    return head.float().train().requires_grad_(True), config


@torch.no_grad()
def to_eagle_layout(head, config: HeadConfig, embed, seqs: list) -> tuple:
    """A head of the older layout (an RMS norm before attention, the target's RoPE base) as a
    start in EAGLE's (heads.EagleHead): the norm's weight w and the mean RMS r that its input
    has on these sequences fold into q, k and v (norm(x) ~ x * w / r), and RoPE takes EAGLE's
    base. An approximation, which the training that follows adapts to."""
    fc_out = []
    for s in seqs[:64]:
        feats = head.fuse_features((s.features() if head.taps else s.hidden)[None]
                                   .to(head.fc.weight))                     # (1, n - 1, C)
        tokens = s.tokens[None, 1:].to(embed.weight.device)
        x = head.fc(torch.cat([embed(tokens).to(feats), feats], -1))
        fc_out.append((x[0].pow(2).mean(-1) + config.layer["rms_eps"]).sqrt())   # (n - 1,)
    r = torch.cat(fc_out).mean()
    config = replace(config, input_norm=False,
                     layer=config.layer | {"rope_theta": EAGLE_ROPE_THETA})
    moved = build_head(config, head.vocab_ids).to(head.fc.weight)
    state = head.state_dict()
    w = state.pop("layers.0.attn_norm.weight") / r                          # (C,)
    state["layers.0.attn.wqkv.weight"] = state["layers.0.attn.wqkv.weight"] * w      # (3C', C)
    moved.load_state_dict(state)
    return moved, config


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja",
                   "generation_config.json")


def init_draft(target, layers: int):
    """A `layers`-deep Llama starting from evenly spaced target layers (first and last included).

    Embedding and output head are the target's own, shared and frozen: the draft learns only its
    blocks and final norm, and its file needs no embedding matrix of its own."""
    N = target.config.num_layers
    if not 1 <= layers <= N:
        raise ValueError(f"draft layers must be in 1..{N}, got {layers}")
    picks = [round(i * (N - 1) / max(layers - 1, 1)) for i in range(layers)]
    config = LlamaConfig(**{**asdict(target.config), "num_layers": layers})
    with torch.device("meta"):
        draft = Llama(config, init=False)
    draft.layers = nn.ModuleList(copy.deepcopy(target.layers[i]) for i in picks)
    draft.norm = copy.deepcopy(target.norm)
    draft.embed, draft.lm_head, draft.rope = target.embed, target.lm_head, target.rope
    draft.embed.requires_grad_(False), draft.lm_head.requires_grad_(False)
    draft.layers.requires_grad_(True), draft.norm.requires_grad_(True)
    return draft


def save_head(head: nn.Module, config: HeadConfig, folder: str, info: dict | None = None) -> None:
    """model.safetensors (16-bit) + config.json (+ training.json); written atomically."""
    os.makedirs(folder, exist_ok=True)
    tensors = {k: (v.bfloat16() if v.is_floating_point() else v).contiguous().cpu()
               for k, v in head.state_dict().items()}
    save_tensors(tensors, f"{folder}/model.safetensors")
    write_json(f"{folder}/config.json", asdict(config))
    if info is not None:
        write_json(f"{folder}/training.json", info)


def save_draft(draft, target_folder: str, out: str, info: dict | None = None,
               embeddings: bool = True, vocab_ids=None) -> None:
    """A standard HF Llama folder: config.json (the target's, fewer layers), model.safetensors
    (16-bit), the target's tokenizer files; written atomically. embeddings=False leaves the
    embedding matrix out (the shipped copy: draft_folder rebuilds it from the target).
    vocab_ids (R,): the reduced vocabulary greedy drafts choose from, in draft_vocab.json (other
    tools ignore it)."""
    c = draft.config
    tensors = to_hf_names({k: v.detach().cpu() for k, v in draft.state_dict().items()}, c)
    if not embeddings:
        tensors = {k: v for k, v in tensors.items()
                   if k not in ("model.embed_tokens.weight", "lm_head.weight")}
    os.makedirs(out, exist_ok=True)
    save_tensors({k: v.bfloat16() for k, v in tensors.items()}, f"{out}/model.safetensors",
                 {"format": "pt"})
    with open(f"{target_folder}/config.json") as f:
        hf = json.load(f)
    write_json(f"{out}/config.json", hf | {"num_hidden_layers": c.num_layers,
                                            "torch_dtype": "bfloat16"})
    for name in TOKENIZER_FILES:
        if os.path.isfile(f"{target_folder}/{name}"):
            shutil.copyfile(f"{target_folder}/{name}", f"{out}/{name}")
    if vocab_ids is not None:
        write_json(f"{out}/{DRAFT_VOCAB}", sorted(vocab_ids.tolist()), indent=None)
    if info is not None:
        write_json(f"{out}/training.json", info)


def train_draft(args, tc, target, model_path, train_seqs, held, tokenizer, info) -> dict:
    """The distilled draft: KL to the target from its cached features; a standard HF folder."""
    draft = init_draft(target, args.layers)
    vocab = draft_vocabulary(train_seqs, args.draft_vocab, tokenizer.stop_ids)
    record = train(draft, lambda seqs: draft_loss(draft, seqs), train_seqs, tc, args.out)
    draft.eval()
    with torch.no_grad():
        agree = [draft_loss(draft, held[i:i + 16])[1][1] for i in range(0, len(held), 16)]
    seqs = held[:args.tau_prompts]

    def chain_tau(depth: int) -> float:
        proposer = DraftModelProposer(draft, depth, 512, vocab)
        return round(measure_tau(target, proposer, seqs, 64, tokenizer.stop_ids), 3)
    tau = {f"chain_{d}": chain_tau(d) for d in (3, 5)} if seqs else {}   # {}: not measured
    info = info | record_fields(record) | {"held_out_top1_agreement": round(sum(agree) / len(agree), 4),
                                           "held_out_tau": tau}
    save_draft(draft, model_path, args.out, info, embeddings=not args.without_embeddings,
               vocab_ids=vocab)
    return info


def held_out_tau(args, target, head, config, held: list, tokenizer) -> dict:
    """tau of the real decoding loop (float32 target) on the first held-out prompts; {} with
    --tau-prompts 0 (nothing measured, rather than a tau of 0)."""
    seqs = held[:args.tau_prompts]
    if not seqs:
        return {}
    if args.method == "medusa":
        proposer = MedusaProposer(target, head, static_tree(best_paths(config.accuracy, 16)))
        return {"medusa_16": round(measure_tau(target, proposer, seqs, 64, tokenizer.stop_ids), 3)}
    eagle2 = EagleProposer(target, head, DraftConfig(5, 4, 16), 512)
    chain = EagleProposer(target, head, DraftConfig(5, 1), 512)
    return {"eagle2_d5_k4_16": round(measure_tau(target, eagle2, seqs, 64, tokenizer.stop_ids), 3),
            "chain_5": round(measure_tau(target, chain, seqs, 64, tokenizer.stop_ids), 3)}


def read_json(path: str):
    """The file's JSON, or None where it is missing."""
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


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


if __name__ == "__main__":
    main()
