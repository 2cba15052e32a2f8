"""A Llama-style transformer of our own and its preallocated KV cache (checkpoint.py loads one).

Dimensions: B batch, T new tokens, S cache slots, C hidden, H query heads, K key/value heads,
D head dim, V vocab, F intermediate (MLP) size.

The KV cache is written by absolute slot: a forward appends T tokens that see the cached prefix
and, among themselves, what a mask says (plain decoding: causal; a tree: each node's ancestors).
`KVCache.keep` then keeps the accepted path's slots and moves the length: the whole rollback.
Attention itself, exact whatever shares a call, is in kernel.py.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernel import attend, attention_mask, round_up, tail_slots, with_ones


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
        if isinstance(self.rope_scaling, dict):            # from asdict (a head's config)
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        self.head_dim = self.head_dim or self.hidden_size // self.num_heads
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
    """x / rms(x) * weight: normalized in >= float32 (bf16 squares lose too much), rounded, then
    weighted, as the reference (HF) rounds (a fused weight would round once)."""
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        return self.weight * F.rms_norm(x32, x.shape[-1:], eps=self.eps).to(x.dtype)


@dataclass
class KVCache:
    """Preallocated keys and values for every layer, written by absolute slot. Each value
    carries a last column of ones (`with_ones`), with which attention's weighted sums also sum
    the weights (`attend`): kept in the cache, it is not concatenated on every forward."""
    k: torch.Tensor          # (layers, B, K, S, D)
    v: torch.Tensor          # (layers, B, K, S, D + 1)
    length: int = 0          # slots [0, length) hold the committed prefix

    @classmethod
    def allocate(cls, config: LlamaConfig, batch: int, slots: int, like) -> "KVCache":
        """At least `slots` slots, rounded up to whole blocks (attention reads whole blocks), on
        the device of weights `like`, in their dtype; float32 for 16-bit weights on CPU, where
        attention's small matmuls run faster in float32 and a cached key is never cast again."""
        shape = (config.num_layers, batch, config.num_kv_heads, round_up(slots), config.head_dim)
        f32 = like.device.type == "cpu" and like.dtype in (torch.bfloat16, torch.float16)
        zeros = torch.zeros(shape, dtype=torch.float32 if f32 else like.dtype, device=like.device)
        return cls(zeros, with_ones(zeros))          # with_ones copies: no storage shared

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


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig, width: int = 0):
        """width: of its input, where not the hidden size (EAGLE-3's layer reads 2C)."""
        super().__init__()
        self.c = c
        qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        # q, k and v fused into one matmul: at batch 1 every kernel launch costs.
        self.wqkv = nn.Linear(width or c.hidden_size, qkv, bias=c.attention_bias)
        self.wo = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)

    def project(self, x, cos, sin) -> tuple:
        """x (B, T, C) -> q (B, T, H, D), k (B, K, T, D) rotated, v (B, K, T, D)."""
        B, T, _ = x.shape
        H, K = self.c.num_heads, self.c.num_kv_heads
        qkv = self.wqkv(x).view(B, T, H + 2 * K, -1)                   # (B, T, H + 2K, D)
        qk = apply_rope(qkv[:, :, :H + K], cos, sin)                    # q and k in one go
        return qk[:, :, :H], qk[:, :, H:].transpose(1, 2), qkv[:, :, H + K:].transpose(1, 2)

    def forward(self, x, cos, sin, k_cache, v_cache, start, mask, tail=None, alone=False):
        """x (B, T, C); k_cache (B, K, S, D), v_cache (B, K, S, D + 1) (see KVCache); mask (T, W)
        or (B, 1, T, W) bool: which of the first W cache slots each new token sees; tail and
        alone: see `tail_slots` and `attend`."""
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        k_cache[:, :, start:start + T] = k
        v_cache[:, :, start:start + T, :-1] = v                          # the ones stay
        W = mask.shape[-1]
        y = attend(q, k_cache[:, :, :W], v_cache[:, :, :W], mask, tail, alone)   # (B, T, H, D)
        return self.wo(y.to(x.dtype).reshape(B, T, -1))                 # (B, T, C)


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

    def forward(self, x, cos, sin, k_cache, v_cache, start, mask, tail=None, alone=False):
        x = x + self.attn(self.attn_norm(x), cos, sin, k_cache, v_cache, start, mask, tail, alone)
        return x + self.mlp(self.mlp_norm(x))


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
        # attention's route, as kernel.check_rows chose it for this machine: a tree's nodes
        # gathered even inside one block; each query attended alone
        self.gather, self.alone = False, False

    def forward(self, tokens, positions, cache: KVCache, mask=None, last_only=False,
                project=True, taps=()):
        """tokens, positions (B, T) long -> logits (B, T or 1, V), final hidden (B, T, C), or
        where `taps` names layers, the residual streams entering them side by side (B, T, 3C
        for EAGLE-3's three: a head's features), and the final hidden after them where it
        names N, the number of layers (training's labels).

        The T tokens are written to cache slots [cache.length, cache.length + T) and the length
        moves past them. `mask` (T, length + T) bool, or (B, T, length + T) for a batch, says which
        slots each new token sees (kernel.attention_mask; a tree passes its ancestor mask
        `with_prefix`); None: causal. Positions are absolute, so a tree node's position is
        prefix length + depth, not its slot. project=False skips the vocabulary projection
        (logits None), for a caller that projects onto a reduced vocabulary itself."""
        B, T = tokens.shape
        start = cache.length
        if start + T > cache.slots:
            raise ValueError(f"KV cache full: {start} + {T} tokens > {cache.slots} slots")
        seen = attention_mask(start, T, mask, min(round_up(start + T), cache.slots), tokens.device)
        tail = tail_slots(seen, self.gather) if seen.dim() == 2 else None   # once for all layers
        x = self.embed(tokens)                                          # (B, T, C)
        cos, sin = self.rope(positions.expand(B, T), x.dtype)
        tapped = []
        for i, layer in enumerate(self.layers):
            tapped += [x] if i in taps else []
            x = layer(x, cos, sin, cache.k[i], cache.v[i], start, seen, tail, self.alone)
        hidden = self.norm(x)
        logits = self.lm_head(hidden[:, -1:] if last_only else hidden) if project else None
        cache.length = start + T
        tapped += [hidden] if len(self.layers) in taps else []       # N: the final one too
        return logits, torch.cat(tapped, -1) if taps else hidden

    def new_cache(self, batch: int = 1, slots: int | None = None) -> KVCache:
        return KVCache.allocate(self.config, batch, slots or self.config.max_positions,
                                self.embed.weight)


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
