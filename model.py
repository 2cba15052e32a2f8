"""A Llama-style transformer of our own and its preallocated KV cache (checkpoint.py loads one).

Dimensions: B batch, T new tokens, S cache slots, C hidden, H query heads, K key/value heads,
D head dim, V vocab, F intermediate (MLP) size.

The KV cache is written by absolute slot. A forward pass appends T tokens that see the whole cached
prefix plus an arbitrary (T, T) boolean mask among themselves; plain decoding passes the causal
mask, tree verification passes the tree's ancestor mask. Afterwards `KVCache.keep` keeps a chosen
subset of the new slots (the accepted path) and moves the length: that is the whole rollback.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F



class LoadError(ValueError):
    """A checkpoint or config that cannot be loaded; the message names the file or tensor."""


@dataclass
class RopeScaling:
    """Llama 3.1/3.2 frequency-dependent RoPE scaling (HF rope_type "llama3")."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_positions: int


@dataclass
class LlamaConfig:
    vocab_size: int = 49152
    hidden_size: int = 576             # C
    intermediate_size: int = 1536      # F
    num_layers: int = 30
    num_heads: int = 9                 # H
    num_kv_heads: int = 3              # K (GQA: each K head serves H/K query heads)
    head_dim: int = 0                  # D; 0 means hidden_size // num_heads
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_positions: int = 8192
    tie_embeddings: bool = True
    attention_bias: bool = False       # q/k/v/o biases; a checkpoint may omit o's (then zero)

    def __post_init__(self):
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise LoadError(f"num_attention_heads={self.num_heads} is not a multiple of "
                            f"num_key_value_heads={self.num_kv_heads}")


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """(D/2,) float32 inverse frequencies, with Llama 3 scaling applied when configured."""
    D = config.head_dim
    inv = 1.0 / config.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32, device="cpu") / D)
    s = config.rope_scaling
    if s is None:
        return inv
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    wavelen = 2 * math.pi / inv
    low_wl = s.original_max_positions / s.low_freq_factor
    high_wl = s.original_max_positions / s.high_freq_factor
    scaled = torch.where(wavelen > low_wl, inv / s.factor, inv)
    smooth = (s.original_max_positions / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return torch.where(medium, blended, scaled)


def rope_tables(inv_freq: torch.Tensor, positions: int) -> tuple:
    """(positions, D) cos and signed sin of every position, HF's half-split layout, float32:
    cos = [cos f, cos f], sin = [-sin f, sin f] (the sign of rotate_half folded in).

    A table, not cos/sin per forward: a vectorized cos and the scalar one that handles a
    tensor's tail can round differently, so a position's angle would depend on how many
    tokens share the call; looked up, it is the same number in every call."""
    pos = torch.arange(positions, dtype=torch.float32, device=inv_freq.device)       # (P,)
    freqs = pos[:, None] * inv_freq                                                 # (P, D/2)
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)         # (P, D) each


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, heads, D), cos/sin (B, T, 1, D) from rope_tables. Math: x * e^(i * pos * freq)
    on pairs (x[j], x[j + D/2]): HF's x * cos + rotate_half(x) * sin, bit for bit."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalized in float32, in the reference's (HF's) order of roundings."""
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalized in >= float32 (bf16 squares lose too much), rounded, then weighted: as the
        # reference rounds (a fused weight would round once)
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        return self.weight * F.rms_norm(x32, x.shape[-1:], eps=self.eps).to(x.dtype)


SLOT_BLOCK = 64          # caches hold, and attention reads, whole blocks of this many slots
ROW_GROUP = 4            # rows a CPU float matmul computes together (see whole_groups)
PREFILL_QUERIES = 128    # calls of more queries are prefills (see attend_prefill)
TAIL_BLOCKS = 4          # most blocks a call gathers per query (a tree: 73 nodes fit in 3)


def cache_dtype(dtype: torch.dtype, device) -> torch.dtype:
    """The dtype of the KV cache and of attention for a model in `dtype`: float32 for 16-bit
    models on CPU, where attention's small matmuls run faster in float32 than in 16 bits, and a
    float32 cache spares casting every cached key and value on every forward."""
    if torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


def round_up(n: int, block: int = SLOT_BLOCK) -> int:
    return -(-n // block) * block


@dataclass
class KVCache:
    """Preallocated keys and values for every layer, written by absolute slot. Each value
    carries a last column of ones (`with_ones`), with which attention's weighted sums also sum
    the weights (`attend`): kept in the cache, it is not concatenated on every forward."""
    k: torch.Tensor          # (layers, B, K, S, D)
    v: torch.Tensor          # (layers, B, K, S, D + 1)
    length: int = 0          # slots [0, length) hold the committed prefix

    @classmethod
    def allocate(cls, config: LlamaConfig, batch: int, slots: int, dtype, device) -> "KVCache":
        """At least `slots` slots, rounded up to whole blocks (attention reads whole blocks)."""
        shape = (config.num_layers, batch, config.num_kv_heads, round_up(slots), config.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   with_ones(torch.zeros(shape, dtype=dtype, device=device)))

    @property
    def slots(self) -> int:
        return self.k[0].shape[-2]          # k may also be a list of (B, K, S, D), in training

    def keep(self, start: int, idx: torch.Tensor) -> None:
        """Keep slots start + idx (in that order) at start, start + 1, ...; drop the rest.

        idx (n,) long, relative to start. One gather-and-copy per tensor for all layers."""
        n = idx.shape[0]
        src = idx.to(self.k.device) + start
        self.k[:, :, :, start:start + n] = self.k.index_select(3, src)
        self.v[:, :, :, start:start + n] = self.v.index_select(3, src)
        self.length = start + n


def with_ones(values: torch.Tensor) -> torch.Tensor:
    """(..., S, D) values -> (..., S, D + 1), a last column of ones beside them, as caches hold
    values for `attend`."""
    return torch.cat([values, values.new_ones(*values.shape[:-1], 1)], dim=-1)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.c = c
        qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        # q, k and v fused into one matmul: at batch 1 every kernel launch costs.
        self.wqkv = nn.Linear(c.hidden_size, qkv, bias=c.attention_bias)
        self.wo = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)

    def forward(self, x, cos, sin, k_cache, v_cache, start, mask, tail=None):
        """x (B, T, C); k_cache (B, K, S, D), v_cache (B, K, S, D + 1) (see KVCache); mask (T, W)
        or (B, 1, T, W) bool: which of the first W cache slots each new token sees; tail: see
        `tail_slots`."""
        B, T, _ = x.shape
        H, K = self.c.num_heads, self.c.num_kv_heads
        qkv = self.wqkv(x).view(B, T, H + 2 * K, -1)                   # (B, T, H + 2K, D)
        qk = apply_rope(qkv[:, :, :H + K], cos, sin)                    # q and k in one go
        k_cache[:, :, start:start + T] = qk[:, :, H:].transpose(1, 2)  # (B, K, T, D)
        v_cache[:, :, start:start + T, :-1] = qkv[:, :, H + K:].transpose(1, 2)   # ones stay
        W = mask.shape[-1]
        y = attend(qk[:, :, :H], k_cache[:, :, :W], v_cache[:, :, :W], mask, tail)  # (B, T, H, D)
        return self.wo(y.to(x.dtype).reshape(B, T, -1))                 # (B, T, C)


def attend_reference(q, keys, values, mask):
    """What `attend` computes, written directly: softmax(q k^T / sqrt(D)) v over the slots each
    query sees, the G = H / K query heads of a KV head sharing it. Shapes as `attend`, but
    values (B, K, W, D), without the column of ones."""
    G = q.shape[2] // keys.shape[1]
    k, v = keys.repeat_interleave(G, 1), values.repeat_interleave(G, 1)    # (B, H, W, D)
    scores = q.transpose(1, 2) @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # (B, H, T, W)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (weights @ v).transpose(1, 2)                                # (B, T, H, D)


def attend(q, keys, values, mask, tail=None):
    """q (B, T, H, D), keys (B, K, W, D), values (B, K, W, D + 1) with a last column of ones (as
    KVCache holds them), mask (T, W) or (B, 1, T, W) -> (B, T, H, D).

    `attend_reference`'s softmax attention, computed in an order that gives a query the bits
    plain decoding gives it, whatever else shares the call. A query's visible slots, in slot
    order, are the sequence plain decoding attends over (its "plain layout"); the weighted sum
    over them is taken in blocks of SLOT_BLOCK positions of that layout, one small matmul a
    block, and the blocks are added in order.
    Blocks of slots that every query sees in slot order are shared; the rest of a tree node's
    sequence (its ancestors, scattered among other nodes' slots) is gathered per node: `tail`
    (see `tail_slots`). The max is exact in any order, and exp runs on whole rows. The query
    heads of one KV head are stacked into one matrix (grouped-query attention)."""
    B, T, H, D = q.shape
    K, W = keys.shape[1], keys.shape[2]
    G = H // K
    if T > PREFILL_QUERIES and tail is None:
        return attend_prefill(q, keys, values, mask)
    # the G query heads of each KV head stacked: (B, H, T, D) -> (B, K, G * T, D)
    q = (q * D ** -0.5).to(keys.dtype).transpose(1, 2).reshape(B, K, G * T, D)
    scores = (whole_groups(q) @ keys.transpose(-1, -2))[:, :, :G * T]  # (B, K, GT, W)
    scores = torch.where(mask.view(-1, 1, 1, T, W), scores.view(B, K, G, T, W), float("-inf"))
    weights = (scores - scores.amax(-1, keepdim=True)).exp()           # (B, K, G, T, W)
    if W % SLOT_BLOCK:      # a cache of another width (training): zero slots of weight 0, whose
        weights = F.pad(weights, (0, -W % SLOT_BLOCK))   # missing ones therefore count nothing
        values = F.pad(values, (0, 0, 0, -W % SLOT_BLOCK))
        W = weights.shape[-1]
    # the column of ones beside the values: each block's matmul also sums its weights
    parts = block_sums(weights.reshape(B, K, G * T, W), values)        # (B, K, n, GT, D + 1)
    if tail is not None:                    # the queries whose slots are not their layout
        shared, rows, slots, seen = tail                               # (Q,), (Q, R), (Q, R)
        Q, first = rows.shape[0], shared // SLOT_BLOCK
        w = weights[:, :, :, rows].gather(-1, slots.expand(B, K, G, Q, -1)) * seen   # (B,K,G,Q,R)
        v = values.index_select(2, slots.flatten()).view(B, K, Q, -1, D + 1)    # (B, K, Q, R, D+1)
        p = block_sums(w.transpose(2, 3), v)                           # (B, K, Q, m, G, D + 1)
        p = p.permute(0, 1, 3, 4, 2, 5).reshape(B, K, -1, G * Q, D + 1)  # (B, K, m, GQ, D + 1)
        p = F.pad(p, (0, 0, 0, 0, 0, parts.shape[2] - first - p.shape[2]))   # zero blocks after
        at = (torch.arange(G, device=rows.device)[:, None] * T + rows).flatten()  # their rows
        parts[:, :, first:] = parts[:, :, first:].index_copy(3, at, p)
    # the blocks in order: cumsum adds them one after the other, whatever their number
    total = parts.cumsum(2)[:, :, -1]                                   # (B, K, GT, D + 1)
    y = total[..., :D] / total[..., D:]
    return y.view(B, H, T, D).transpose(1, 2)                           # (B, T, H, D)


def attend_prefill(q, keys, values, mask):
    """attend for a call of more than PREFILL_QUERIES queries: a prefill (a prompt, or a whole
    conversation), whose rows no other call computes (verification never has that many), so
    the fastest kernel serves: SDPA, which `attend`'s per-block sums would take several times
    as long as on a long prompt. Same shapes in and out as `attend`."""
    T = q.shape[1]
    q = q.transpose(1, 2).to(keys.dtype)                                # (B, H, T, D)
    values = values[..., :-1].contiguous()          # as SDPA's kernels expect: rows D apart
    causal = torch.ones(T, T, dtype=torch.bool, device=mask.device).tril()
    if mask.dim() == 2 and torch.equal(mask[:, :T], causal) and not mask[:, T:].any():
        # a prompt from slot 0: SDPA skips the masked half without a mask
        y = F.scaled_dot_product_attention(q, keys[:, :, :T], values[:, :, :T], is_causal=True,
                                           enable_gqa=True)
    else:
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    return y.transpose(1, 2)                                            # (B, T, H, D)


def block_sums(w, v) -> torch.Tensor:
    """w (..., M, L) weights, v (..., L, E) values, L a multiple of SLOT_BLOCK -> the weighted
    sums of each block of SLOT_BLOCK slots, (..., L / SLOT_BLOCK, M, E)."""
    M = w.shape[-2]
    blocks = whole_groups(w).unflatten(-1, (-1, SLOT_BLOCK))            # (..., M', n, SLOT_BLOCK)
    parts = blocks.transpose(-3, -2) @ v.unflatten(-2, (-1, SLOT_BLOCK))  # (..., n, M', E)
    return parts[..., :M, :]


def whole_groups(x: torch.Tensor) -> torch.Tensor:
    """(..., M, N) -> (..., M', N): M rounded up to whole groups of ROW_GROUP rows, the new rows
    zero. CPU float matmuls (MKL) compute rows in groups of 4 and a remainder of 1-3 rows
    another way, which rounds differently (tested)."""
    extra = -x.shape[-2] % ROW_GROUP
    return x if extra == 0 else F.pad(x, (0, 0, 0, extra))


def tail_slots(mask: torch.Tensor):
    """What `attend` gathers for a (T, W) mask: None where every query's visible slots are the
    first ones (plain decoding, chains, prefill: the cache is their plain layout), or where the
    gathered part would span more than TAIL_BLOCKS blocks (training's unrolled masks, which no
    other call must reproduce); else (shared, rows, slots, seen): the first `shared` slots
    (whole blocks) every query sees in slot order; rows (Q,) the queries whose visible slots
    are not the first ones (a tree's nodes off its first path); slots (Q, R) the slot at each
    later position of their plain layouts, seen (Q, R) whether that position exists."""
    T, W = mask.shape
    count = mask.sum(1)                                                 # (T,) visible slots
    rows = (mask != (torch.arange(W, device=mask.device) < count[:, None])).any(1).nonzero()[:, 0]
    if rows.numel() == 0:
        return None
    shared = int(mask.all(0).long().cumprod(0).sum()) // SLOT_BLOCK * SLOT_BLOCK
    R = round_up(int(count[rows].max())) - shared
    if R > TAIL_BLOCKS * SLOT_BLOCK:
        return None
    order = torch.sort((~mask[rows]).to(torch.uint8), dim=1, stable=True).indices  # seen first
    seen = torch.arange(shared, shared + R, device=mask.device) < count[rows, None]
    return shared, rows, order[:, shared:shared + R], seen


class MLP(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.w13 = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)  # gate, up fused
        self.w2 = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, c: LlamaConfig, input_norm: bool = True):
        """input_norm=False: no RMS norm before attention (EAGLE's head layer, whose input is
        already a mix of normed embeddings and features)."""
        super().__init__()
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_eps) if input_norm else nn.Identity()
        self.attn = Attention(c)
        self.mlp_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, k_cache, v_cache, start, mask, tail=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, k_cache, v_cache, start, mask, tail)
        return x + self.mlp(self.mlp_norm(x))


def attention_mask(start: int, T: int, mask, width: int, device):
    """(T, width) bool: which of the first `width` cache slots each of the T new tokens sees.

    mask None: causal among the new tokens. mask (T, T): among the new tokens, each sees the whole
    prefix [0, start) (the committed tokens are everyone's ancestors). mask (T, start + T) or
    (B, 1, T, start + T): used as given (a draft that keeps a growing tree in its own cache; a
    batch with padding). Slots from start + T up to width are seen by no one: attention reads
    whole blocks of slots (SLOT_BLOCK), whatever stale keys they hold."""
    if mask is None:
        mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    mask = mask.to(device)
    if mask.shape[-1] != start + T:
        prefix = torch.ones(T, start, dtype=torch.bool, device=device)
        mask = torch.cat([prefix, mask], dim=1)                         # (T, start + T)
    unseen = mask.new_zeros(*mask.shape[:-1], width - start - T)
    return torch.cat([mask, unseen], dim=-1)



class Llama(nn.Module):
    def __init__(self, config: LlamaConfig, init: bool = True):
        """init=False leaves the embedding undrawn, for a model whose weights are all assigned
        next (load_model): drawing it on the meta device imports half of torch.compile."""
        super().__init__()
        self.config = config
        undrawn = None if init else torch.empty(config.vocab_size, config.hidden_size)
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size, _weight=undrawn)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope = Rope(config)

    def forward(self, tokens, positions, cache: KVCache, mask=None, last_only=False, taps=(),
                project=True):
        """tokens, positions (B, T) long -> logits (B, T or 1, V), final hidden (B, T, C).

        The T tokens are written to cache slots [cache.length, cache.length + T) and the length
        moves past them. `mask` (T, T) bool says which new tokens each new token sees (None:
        causal), all of them seeing the whole prefix; or (T, length + T) says it for every slot.
        Positions are absolute, so a tree node's position is prefix length + depth, not its slot.
        taps: indices of layers whose outputs (the residual stream after them) come back too,
        before the final feature: hidden is then (B, T, (len(taps) + 1) C), the low and middle
        features EAGLE-3 fuses with the final one. project=False skips the vocabulary projection
        (logits None), for a caller that projects onto a reduced vocabulary itself."""
        B, T = tokens.shape
        start = cache.length
        if start + T > cache.slots:
            raise ValueError(f"KV cache full: {start} + {T} tokens > {cache.slots} slots")
        seen = attention_mask(start, T, mask, min(round_up(start + T), cache.slots), tokens.device)
        tail = tail_slots(seen) if seen.dim() == 2 else None            # once for all layers
        x = self.embed(tokens)                                          # (B, T, C)
        cos, sin = self.rope(positions.expand(B, T), x.dtype)
        tapped = []
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], start, seen, tail)
            if i in taps:
                tapped.append(x)
        hidden = self.norm(x)
        logits = (self.lm_head(hidden[:, -1:] if last_only else hidden)  # (B, T or 1, V)
                  if project else None)
        cache.length = start + T
        return logits, torch.cat(tapped + [hidden], dim=-1) if taps else hidden

    def new_cache(self, batch: int = 1, slots: int | None = None) -> KVCache:
        w = self.embed.weight
        return KVCache.allocate(self.config, batch, slots or self.config.max_positions,
                                cache_dtype(w.dtype, w.device), w.device)


class Rope(nn.Module):
    """RoPE's cos and signed sin by position, looked up in tables built once (`rope_tables`),
    on the CPU whatever device is current (a model built on the meta device to be loaded gets
    real tables; .to(device) moves them)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        cos, sin = rope_tables(rope_inv_freq(config), config.max_positions)
        self.register_buffer("cos", cos, persistent=False)            # (P, D) float32
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions, dtype) -> tuple:
        """positions (B, T) -> cos, sin (B, T, 1, D) in dtype."""
        return self.cos[positions, None].to(dtype), self.sin[positions, None].to(dtype)
