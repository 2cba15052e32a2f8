"""Training data for the heads: the target reads (or, for prompt-only lines, first writes with
its batched greedy decoder) each conversation, and its tokens and final features go to 16-bit
safetensors shards of SHARD_LINES conversations, written whole; shards are read back as
sequences and batched by token count (train_heads.py drives it, training.py learns from it).

Dimensions: B batch, T tokens, C hidden size, V vocab, R reduced draft vocab.
"""
import os
import random
from dataclasses import dataclass, fields

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from bench import jsonl_rows
from checkpoint import save_tensors
from model import KVCache, Llama

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
    """Run full sequences (right-padded: causal attention never looks right) -> hidden (L_i, C)
    (taps: Llama.forward's, the features of an EAGLE-3 head and the final hidden)."""
    L, device = max(len(s) for s in seqs), target.embed.weight.device
    ids = torch.tensor([s + [0] * (L - len(s)) for s in seqs], device=device)   # (B, L)
    cache = target.new_cache(len(seqs), L)
    _, hidden = target(ids, torch.arange(L, device=device)[None], cache, last_only=True, taps=taps)
    return [hidden[b, :len(s)].to("cpu", copy=True) for b, s in enumerate(seqs)]  # own storage


@torch.inference_mode()
def batched_greedy(target: Llama, prompts: list, max_new: int, stop_ids, taps=()) -> list:
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
    # in a later attention product is still NaN; (B, P, P)
    mask = (causal[None] & valid[:, None, :P]) | torch.eye(P, dtype=torch.bool, device=device)
    pos = (torch.arange(P, device=device)[None] - pad[:, None]).clamp(min=0)   # (B, P)
    logits, hidden = target(ids, pos, cache, mask, last_only=True, taps=taps)
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
        mask = valid[:, None, :start + 1]                                  # (b, 1, start + 1)
        pos = (start - pad)[:, None]                                       # (b, 1)
        logits, hidden = target(nxt[:, None], pos, cache, mask, taps=taps)
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
                     max_new: int, max_prompt: int, taps=()) -> None:
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
                done = batched_greedy(target, [p for p, _ in part], max_new, tokenizer.stop_ids,
                                      taps)
            else:
                seqs = [p + tokenizer.encode(a)[:max_new] + [tokenizer.stop_ids[0]] for p, a in part]
                done = list(zip(seqs, teacher_forced(target, seqs, taps)))
            for (p, _), (t, h) in zip(part, done):
                tokens.append(t), hidden.append(h), prompt_lens.append(len(p))
            bar.update(len(part))
            bar.set_postfix(tokens=sum(map(len, tokens)))
        save_shard(f"{out}/shard_{s // SHARD_LINES:05d}.safetensors", tokens, hidden, prompt_lens)
    bar.close()


# ---------------------------------------------------------------- training data from the shards

@dataclass
class Seq:
    tokens: torch.Tensor     # (n,) long: prompt and answer
    hidden: torch.Tensor     # (n - 1, C) 16-bit: the target's final feature of every token but the last
    prompt_len: int


def load_features(folder: str) -> list:
    names = sorted(f for f in os.listdir(folder) if f.startswith("shard_")
                   and f.endswith(".safetensors")) if os.path.isdir(folder) else []
    if not names:
        raise ValueError(f"{folder}: no feature shards; run with --stage features first")
    seqs = []
    for name in tqdm(names, desc="loading features", unit="shard"):
        t = load_file(os.path.join(folder, name))
        off = t["offsets"].tolist()
        for i, p in enumerate(t["prompt_lens"].tolist()):    # n tokens, n - 1 hidden rows each
            seqs.append(Seq(t["tokens"][off[i]:off[i + 1]].long(),
                            t["hidden"][off[i] - i:off[i + 1] - i - 1], p))
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
    feats: torch.Tensor      # (B, L, C) target feature at entry i
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
    B, at = len(seqs), {"device": seqs[0].hidden.device}
    b = Batch(torch.zeros(B, L, C, **at), torch.zeros(B, L, dtype=torch.long, **at),
              torch.zeros(B, L, C, **at), torch.zeros(B, L, dtype=torch.bool, **at))
    for r, s in enumerate(seqs):
        n = len(s.hidden)
        b.feats[r, :n] = s.hidden.float()
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

