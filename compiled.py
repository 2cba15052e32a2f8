"""--compile: the target's decode step as one compiled graph of fixed shapes (gpt-fast's design).

At batch 1 on a CPU most of an eager step is PyTorch's cost per small operation, not reading
weights. torch.compile removes that cost when it sees the whole step as one graph
(fullgraph=True) whose shapes never change, so nothing recompiles and every call runs the same
generated code. So a compiled step has:
  - a fixed number of new tokens: 1 for plain decoding, else a tree padded to one of a few sizes
    (`pad_inputs`);
  - a fixed cache width: a step attends over the first `cache_width(slots in use)` slots of
    the cache (a power of two), the slots nobody sees masked: a few widths, a graph each, and
    a short conversation does not pay for attending over the whole allocation;
  - the cache length as a tensor, not a Python int, so a growing prefix is data, not shape.
Prefills (more than the largest size of tokens) stay eager: they run once per prompt.

Exactness inside the compiled configuration: a token's row must get the same bits in a call of
one token and in a tree's call, as in eager decoding (attention.py explains why). `attend_fixed`
is attention.attend with its data-dependent gather made static: every query gathers a fixed
window of TAIL_BLOCKS blocks in its plain layout, the blocks before the window are shared, and
the blocks are added in one fixed order.

Dimensions: T new tokens (padded), S cache slots (the width), R window slots, B batch = 1.
"""
import torch
from torch import nn

from attention import SLOT_BLOCK, TAIL_BLOCKS, block_sums, whole_groups, with_ones
from model import KVCache, Llama, apply_rope

WINDOW = TAIL_BLOCKS * SLOT_BLOCK        # R: slots a query gathers in its plain layout
NARROWEST = 256                          # the smallest cache width attended


def cache_width(slots: int) -> int:
    """Slots rounded up to a power of two (at least NARROWEST): a few widths, a few graphs."""
    return max(NARROWEST, 1 << (slots - 1).bit_length())


def window(seen: torch.Tensor, start: torch.Tensor) -> tuple:
    """seen (T, S) bool -> the window every query gathers: first () the first block it covers
    (the block holding slot `start`), slots (T, R) the slots at positions first * SLOT_BLOCK +
    0..R-1 of each query's plain layout (its visible slots in slot order), valid (T, R) whether
    that position exists. Slots before the window are the committed prefix, seen by every query
    in slot order: their blocks are shared."""
    T, S = seen.shape
    first = start // SLOT_BLOCK
    span = first * SLOT_BLOCK + torch.arange(WINDOW, device=seen.device)       # (R,)
    inside = span < S
    span = span.clamp(max=S - 1)
    visible = seen.gather(1, span.expand(T, WINDOW)) & inside                   # (T, R)
    order = torch.sort((~visible).to(torch.uint8), dim=1, stable=True).indices  # seen first
    return first, span[order], visible.gather(1, order)


def attend_fixed(q, keys, values, seen, win):
    """attention.attend for fixed shapes: q (B, T, H, D), keys (B, K, S, D), values (B, K, S,
    D + 1) with their column of ones, seen (T, S) bool, win from `window` -> (B, T, H, D).

    A query's result: the blocks of SLOT_BLOCK positions of its plain layout, each one small
    matmul, added in order; the blocks before the window come from the shared slot-order
    matmul (the same numbers: there the plain layout is the slot order), the window's from its
    gathered slots, the shared blocks from the window on counted as zero."""
    B, T, H, D = q.shape
    K, S = keys.shape[1], keys.shape[2]
    G, E = H // K, D + 1
    first, slots, valid = win
    q = (q * D ** -0.5).to(keys.dtype).transpose(1, 2).reshape(B, K, G * T, D)
    scores = (whole_groups(q) @ keys.transpose(-1, -2))[:, :, :G * T]  # (B, K, GT, S)
    scores = torch.where(seen, scores.view(B, K, G, T, S), float("-inf"))
    weights = (scores - scores.amax(-1, keepdim=True)).exp()           # (B, K, G, T, S)
    shared = block_sums(weights.reshape(B, K, G * T, S), values)       # (B, K, n, GT, E)
    before = torch.arange(S // SLOT_BLOCK, device=q.device) < first   # (n,)
    shared = torch.where(before[:, None, None], shared, 0.0)
    w = weights.gather(-1, slots.expand(B, K, G, T, WINDOW)) * valid   # (B, K, G, T, R)
    v = values.index_select(2, slots.flatten()).view(B, K, T, WINDOW, E)
    tail = block_sums(w.transpose(2, 3), v)                            # (B, K, T, m, G, E)
    tail = tail.permute(0, 1, 3, 4, 2, 5).reshape(B, K, TAIL_BLOCKS, G * T, E)
    parts = torch.cat([shared, tail], dim=2)                           # (B, K, n + m, GT, E)
    total = parts[:, :, 0]
    for b in range(1, parts.shape[2]):          # in order: one sum, the same for every query
        total = total + parts[:, :, b]
    y = total[..., :D] / total[..., D:]                                 # (B, K, GT, D)
    return y.view(B, H, T, D).transpose(1, 2)                           # (B, T, H, D)


def step(model: Llama, tokens, positions, k, v, start, mask):
    """One decode step of fixed shapes, the graph torch.compile sees: tokens, positions (1, T)
    long, k and v each layer's cache, (1, K, S, D) and (1, K, S, D + 1) (written in place at
    slots start..start + T - 1), start () long, mask (T, T) bool among the new tokens ->
    logits (1, T, V), final hidden (1, T, C)."""
    B, T = tokens.shape
    S = k[0].shape[2]
    H, K = model.config.num_heads, model.config.num_kv_heads
    at = start + torch.arange(T, device=tokens.device)                 # (T,) their slots
    rel = torch.arange(S, device=tokens.device) - start                # (S,) slot - start
    new = mask[:, rel.clamp(0, T - 1)] & (rel >= 0) & (rel < T)         # (T, S) among the new
    seen = new | (rel < 0)                                              # and the whole prefix
    win = window(seen, start)                                           # once for all layers
    x = model.embed(tokens)                                             # (B, T, C)
    cos, sin = model.rope(positions, x.dtype)
    for i, layer in enumerate(model.layers):
        a = layer.attn
        qkv = a.wqkv(layer.attn_norm(x)).view(B, T, H + 2 * K, -1)      # (B, T, H + 2K, D)
        qk = apply_rope(qkv[:, :, :H + K], cos, sin)
        k[i][:, :, at] = qk[:, :, H:].transpose(1, 2).to(k[i].dtype)     # (B, K, T, D)
        v[i][:, :, at] = with_ones(qkv[:, :, H + K:].transpose(1, 2).to(v[i].dtype))
        y = attend_fixed(qk[:, :, :H], k[i], v[i], seen, win)          # (B, T, H, D)
        x = x + a.wo(y.to(x.dtype).reshape(B, T, -1))
        x = x + layer.mlp(layer.mlp_norm(x))
    hidden = model.norm(x)
    return model.lm_head(hidden), hidden


class Compiled(nn.Module):
    """A target (model.Llama's interface) whose steps run compiled: one graph per step size in
    `sizes` (1 for plain decoding, a method's tree size; a smaller call is padded to it) and
    width attended (`cache_width` of the slots in use); prefills run eager. Its caches are `slots` slots wide (a run's most), or wider where
    asked (a graph more per width then)."""

    def __init__(self, model: Llama, sizes=(1,), slots: int = NARROWEST):
        super().__init__()
        self.model, self.sizes, self.slots = model, sorted(set(sizes)), slots
        self.config, self.embed = model.config, model.embed     # what decoding reads of a target
        cuda = model.embed.weight.device.type == "cuda"
        # a graph per (size, width), and every method of a bench shares them
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # on a GPU the same graphs replay as CUDA graphs (no launch per kernel either).
        # emulate_precision_casts: round every intermediate as eager does; else a fused kernel
        # may skip a bfloat16 rounding, and the graphs of 1 and N tokens (fused differently
        # from a few layers on) would give a row different bits
        self.graph = torch.compile(step, fullgraph=True, dynamic=False,
                                   options={"emulate_precision_casts": True,
                                            "triton.cudagraphs": cuda})

    def widths(self) -> list:
        """The widths its caches attend over as they fill: a graph each."""
        return [w for w in (NARROWEST << i for i in range(32)) if w <= cache_width(self.slots)]

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile now every graph (size, width) its caches can need, so that no step of a run
        stops to compile (minutes each the first time, seconds from torch's on-disk cache)."""
        cache, device = self.new_cache(), self.embed.weight.device
        for width in self.widths():
            for size in self.sizes:
                cache.length = width - size                 # a step that fills the width
                self(torch.zeros(1, size, dtype=torch.long, device=device),
                     torch.arange(width - size, width, device=device)[None], cache)

    def new_cache(self, batch: int = 1, slots: int | None = None) -> KVCache:
        # every cache as wide: a graph's input strides (and so the graph) depend on it too
        return self.model.new_cache(batch, cache_width(max(slots or 0, self.slots)))

    def forward(self, tokens, positions, cache, mask=None, last_only=False):
        n, start = tokens.shape[1], cache.length
        size = next((s for s in self.sizes if s >= n), None)
        if size is None:                                            # a prefill
            return self.model(tokens, positions, cache, mask, last_only)
        tree = (torch.ones(n, n, dtype=torch.bool).tril() if mask is None
                else mask[:, start:].cpu())                         # (n, n) among new tokens
        tokens, positions, tree = pad_inputs(tokens[0], positions[0], tree, size)
        device, width = tokens.device, min(cache_width(start + size), cache.slots)
        # each layer's cache a separate input, its first `width` slots (a view: written in
        # place); a write into a slice of one stacked tensor would copy the whole cache
        keys = [k[:, :, :width] for k in cache.k.unbind(0)]              # (1, K, width, D)
        values = [v[:, :, :width] for v in cache.v.unbind(0)]            # (1, K, width, D + 1)
        logits, hidden = self.graph(self.model, tokens[None], positions[None], keys, values,
                                    torch.tensor(start, device=device), tree.to(device))
        cache.length = start + n
        logits = logits[:, n - 1:n] if last_only else logits[:, :n]
        return logits, hidden[:, :n]                 # the pads' slots go with the rejected


class CompileError(ValueError):
    """torch cannot compile here; the message says why and that eager decoding works."""


def check_compiler() -> None:
    """Compile a one-line function, so that a machine that cannot (no C++ compiler, no backend
    for the device) is told in one line before a model is loaded; never inductor's traceback."""
    try:
        torch.compile(lambda x: x * 2 + 1, fullgraph=True)(torch.ones(8))
    except Exception as e:                      # inductor raises many kinds; all mean the same
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise CompileError(f"--compile: torch cannot compile on this machine ({reason}); "
                           f"run without --compile: eager decoding works") from None


def pad_inputs(tokens, pos, mask, size: int) -> tuple:
    """A tree's tokens (N,), positions (N,) and mask (N, N) padded to `size` nodes, for a
    fixed-shape (compiled) forward. A pad node repeats the root at its position and sees every
    node before it; no real node sees it, so the first N outputs are unchanged and the pad's
    cache slots are dropped with every other rejected node."""
    n = tokens.shape[0]
    if n > size:
        raise ValueError(f"a tree of {n} nodes does not fit the padded size {size}")
    full = torch.ones(size, size, dtype=torch.bool).tril()             # (size, size)
    full[:n, :n] = mask
    return (torch.cat([tokens, tokens[:1].expand(size - n)]),
            torch.cat([pos, pos[:1].expand(size - n)]), full)
