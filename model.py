"""A Llama-style transformer of our own, its preallocated KV cache, and a loader for HF checkpoints.

Dimensions: B batch, T new tokens, S cache slots, C hidden, H query heads, K key/value heads,
D head dim, V vocab, F intermediate (MLP) size.

The KV cache is written by absolute slot. A forward pass appends T tokens that see the whole cached
prefix plus an arbitrary (T, T) boolean mask among themselves; plain decoding passes the causal
mask, tree verification passes the tree's ancestor mask. Afterwards `KVCache.keep` keeps a chosen
subset of the new slots (the accepted path) and moves the length: that is the whole rollback.
"""
import copy
import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import attention_mask


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

    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaConfig":
        """Read a Hugging Face config.json dict; refuse what this model cannot run."""
        arch = hf.get("architectures") or ["LlamaForCausalLM"]
        if hf.get("model_type", "llama") != "llama" or arch[0] != "LlamaForCausalLM":
            raise LoadError(f"unsupported architecture {arch[0]!r} (model_type "
                            f"{hf.get('model_type')!r}): only LlamaForCausalLM is supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise LoadError(f"unsupported hidden_act {hf['hidden_act']!r}: only silu")
        if hf.get("mlp_bias", False):
            raise LoadError("unsupported config: mlp_bias=true")
        # transformers 4 writes rope_theta and rope_scaling; transformers 5 one rope_parameters.
        rs = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        theta = rs.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = None
        if rs:
            kind = rs.get("rope_type", rs.get("type", "default"))
            if kind == "llama3":
                scaling = RopeScaling(rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"],
                                      rs["original_max_position_embeddings"])
            elif kind != "default":
                raise LoadError(f"unsupported rope_scaling type {kind!r}: only 'llama3' and none")
        try:
            return cls(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                       intermediate_size=hf["intermediate_size"],
                       num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
                       num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
                       head_dim=hf.get("head_dim") or 0, rms_eps=hf.get("rms_norm_eps", 1e-6),
                       rope_theta=theta, rope_scaling=scaling,
                       max_positions=hf.get("max_position_embeddings", 2048),
                       tie_embeddings=hf.get("tie_word_embeddings", False),
                       attention_bias=hf.get("attention_bias", False))
        except KeyError as e:
            raise LoadError(f"config.json lacks the field {e.args[0]!r}") from None


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """(D/2,) float32 inverse frequencies, with Llama 3 scaling applied when configured."""
    D = config.head_dim
    inv = 1.0 / config.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D)
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


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype) -> tuple:
    """positions (B, T) -> cos, sin of shape (B, T, 1, D), HF's half-split layout."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq     # (B, T, D/2)
    angles = torch.cat([freqs, freqs], dim=-1)[:, :, None]        # (B, T, 1, D)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, heads, D). Math: x * e^(i * pos * freq) on pairs (x[j], x[j + D/2])."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalized in float32, in the reference's (HF's) order of roundings."""
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Not F.rms_norm: it rounds once where the reference rounds before the weight, and its
        # bf16 kernel took 0.9-1.0 ms for 300 rows on these CPUs, alone (this: 0.12-0.17 ms;
        # ~2 us more at 1-6 rows).
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))         # bf16 squares lose too much
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def cache_dtype(dtype: torch.dtype, device) -> torch.dtype:
    """The KV cache's dtype for a model in `dtype`: float32 for 16-bit models on CPU.

    Why: there attention runs faster in float32 than in 16 bits, and a float32 cache spares
    casting every cached key and value on every forward. Measured per layer (2 cores, bf16
    model): one query over 300 / 1200 keys 172 / 576 us in bf16, 31 / 95 us in float32. With
    the cache in bf16, one query paid those casts and trees stayed in bf16; with it in float32
    (and RMSNorm's change), old and new code alternating: a 6-token forward after 300 cached
    tokens 24.7 -> 23.8 ms, a 1-token one 17.8 -> 17.7 ms. The cost is twice the cache memory
    (46 MB for 1,000 tokens here)."""
    if torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


@dataclass
class KVCache:
    """Preallocated keys and values for every layer, written by absolute slot."""
    k: torch.Tensor          # (layers, B, K, S, D)
    v: torch.Tensor          # (layers, B, K, S, D)
    length: int = 0          # slots [0, length) hold the committed prefix

    @classmethod
    def allocate(cls, config: LlamaConfig, batch: int, slots: int, dtype, device) -> "KVCache":
        shape = (config.num_layers, batch, config.num_kv_heads, slots, config.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device))

    @property
    def slots(self) -> int:
        return self.k.shape[3]

    def keep(self, start: int, idx: torch.Tensor) -> None:
        """Keep slots start + idx (in that order) at start, start + 1, ...; drop the rest.

        idx (n,) long, relative to start. One gather-and-copy per tensor for all layers."""
        n = idx.shape[0]
        src = idx.to(self.k.device) + start
        self.k[:, :, :, start:start + n] = self.k.index_select(3, src)
        self.v[:, :, :, start:start + n] = self.v.index_select(3, src)
        self.length = start + n


class Linear(nn.Linear):
    """nn.Linear that can also hold a oneDNN-prepacked copy of its weight (see `prepack`)."""
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.packed = None              # derived from weight by prepack(); not saved
        self.int8 = None                # derived from weight by quantize_int8(); not saved

    def forward(self, x):
        return linear(x, self.weight, self.bias, self.packed, self.int8)


def linear(x, weight, bias=None, packed=None, int8=None):
    """F.linear, through the int8 copy of the weight when there is one (drafts only, see
    `quantize_int8`), else through the prepacked weight when there is one and oneDNN is on (see
    `prepack`; `Llama.forward` switches oneDNN off for the few-row forwards that ATen's kernel
    runs faster)."""
    if int8 is not None:
        q, scales = int8
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), q, scales)
        y = y.view(*x.shape[:-1], -1)
        return y if bias is None else y + bias
    if packed is None or not torch.backends.mkldnn.enabled or torch.compiler.is_compiling():
        # (torch.compile cannot trace oneDNN's opaque packed tensors; it picks its own kernels)
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, -1), packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], -1)


def pack(weight: torch.Tensor, rows_hint: int = 16):
    """weight (out, in) -> its oneDNN-blocked copy, or None where that does not apply."""
    if not (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)


def int8_weights(weight: torch.Tensor):
    """weight (out, in) -> (int8 (out, in), scales (out,)): symmetric per-row quantization, for
    torch's weight-only int8 kernel; None where that kernel does not apply (CPU, 16/32-bit)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16,
                                                            torch.float16):
        return None
    w = weight.detach().float()
    scales = w.abs().amax(1).clamp(min=1e-12) / 127                     # (out,)
    q = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scales.to(weight.dtype)


def quantize_int8(module: nn.Module) -> int:
    """Give every Linear in module an int8 copy of its weight, used instead of it from then on.

    For DRAFTS only: a draft decides what is proposed, never what is accepted, so its rounding
    can cost acceptance but never correctness; the target stays exact. Why: a draft head's
    matrices are small and cold (the target's pass evicts them), and reading them is most of a
    drafting round; int8 halves the bytes. Returns the number of bytes added (0 where the
    kernel does not apply)."""
    added = 0
    for layer in module.modules():
        if isinstance(layer, Linear):
            layer.int8 = int8_weights(layer.weight)
            if layer.int8 is not None:
                layer.packed = None                  # not used any more: free it
                added += layer.weight.numel() + layer.int8[1].numel() * layer.weight.element_size()
    return added


def prepack(module: nn.Module) -> int:
    """Give every Linear in module a oneDNN-blocked copy of its weight for forwards of 3+ rows.

    Why: a plain bf16 weight is re-laid-out by oneDNN on every call, so a 9-token tree
    verification streamed the weights at ~9 GB/s; prepacked they stream at ~16 GB/s, close to
    the 1-token kernel (~22 GB/s). Measured on the default model (2 cores, AVX512-BF16): a
    9-token forward 37.7 -> 29.2 ms, 1 token unchanged at 22 ms. The cost is a second copy of
    the weights. Only for CPU bf16 (elsewhere a no-op); call again after changing weights.
    Returns the number of bytes added."""
    added = 0
    for layer in module.modules():
        if isinstance(layer, Linear):
            layer.packed = pack(layer.weight)
            if layer.packed is not None:
                added += layer.weight.numel() * layer.weight.element_size()
    return added


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.c = c
        qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        # q, k and v fused into one matmul: at batch 1 every kernel launch costs.
        self.wqkv = Linear(c.hidden_size, qkv, bias=c.attention_bias)
        self.wo = Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)

    def forward(self, x, cos, sin, k_cache, v_cache, start, mask):
        """x (B, T, C); k_cache, v_cache (B, K, S, D); mask (T, start + T) bool or None (all)."""
        B, T, _ = x.shape
        H, K = self.c.num_heads, self.c.num_kv_heads
        qkv = self.wqkv(x).view(B, T, H + 2 * K, -1)                   # (B, T, H + 2K, D)
        qk = apply_rope(qkv[:, :, :H + K], cos, sin)                    # q and k in one go
        q = qk[:, :, :H].transpose(1, 2)                                # (B, H, T, D)
        k = qk[:, :, H:].transpose(1, 2)                                # (B, K, T, D)
        v = qkv[:, :, H + K:].transpose(1, 2)                           # (B, K, T, D)
        k_cache[:, :, start:start + T] = k                              # 16 -> 32 bits on CPU
        v_cache[:, :, start:start + T] = v
        keys, values = k_cache[:, :, :start + T], v_cache[:, :, :start + T]   # (B, K, start+T, D)
        q = q.to(keys.dtype)                        # attend in the cache's dtype (cache_dtype)
        if B > 1:
            y = grouped_attention(q, keys, values, mask)
        else:
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.wo(y.to(x.dtype).transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


def grouped_attention(q, keys, values, mask):
    """q (B, H, T, D), keys/values (B, K, S, D), mask (T, S) or (B, 1, T, S) or None -> (B, H, T, D).

    Two matmuls with the query heads of one KV head stacked, instead of SDPA, for batches: on
    these CPUs in bf16 SDPA's flash kernel takes 5.0 ms for a batch of 32 one-token queries over
    300 keys (this: 0.9), while SDPA wins at batch 1."""
    B, H, T, D = q.shape
    K, S = keys.shape[1], keys.shape[2]
    scores = q.reshape(B, K, H // K * T, D) @ keys.transpose(-1, -2)    # (B, K, G*T, S)
    scores = scores.view(B, K, H // K, T, S) * D ** -0.5                # (B, K, G, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask.view(-1, 1, 1, T, S), float("-inf"))
    wide = torch.promote_types(q.dtype, torch.float32)                  # softmax in >= fp32
    probs = scores.to(wide).softmax(-1).to(q.dtype).view(B, K, -1, S)   # (B, K, G*T, S)
    return (probs @ values).view(B, H, T, D)


class MLP(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.w13 = Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)  # gate, up fused
        self.w2 = Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.attn = Attention(c)
        self.mlp_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, k_cache, v_cache, start, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, k_cache, v_cache, start, mask)
        return x + self.mlp(self.mlp_norm(x))


def has_kernel_choice(device, dtype) -> bool:
    """Whether few-row forwards can run on either ATen's or oneDNN's matrix kernels (see
    `Llama.aten_rows`): 16-bit models on CPU. Elsewhere one kernel serves all."""
    return torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16)


@contextmanager
def onednn(enabled: bool):
    """Switch torch's oneDNN (mkldnn) CPU kernels on or off for the duration of a block.

    Which is faster for few rows depends on the CPU (see `Llama.aten_rows`). Measured, all of
    the default model's matrices in bf16, on 2 cores of an AMD EPYC (AVX512-BF16, no AMX): for
    1 token ATen's own kernel takes 9.9 ms and oneDNN 22.4; for 2 tokens 15.5 vs 22.3; for 4
    tokens 29.9 vs 22.7, and oneDNN wins by more from there on. On 2 cores of an Intel Xeon
    with AMX, whole forwards: 1 token 26.3 ms (ATen) vs 23.7 (oneDNN, prepacked), 2 tokens 34.7
    vs 24.7."""
    old = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = enabled
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = old


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        # Forwards of up to this many rows (batch x tokens) run ATen's own matrix kernels with
        # oneDNN off, in 16 bits on CPU, where that is faster than oneDNN's (prepacked) ones: 2 on
        # an AMD EPYC, 0 on an Intel Xeon with AMX. spec.py measures it once per machine.
        self.aten_rows = 2

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
        full_mask = attention_mask(start, T, mask, tokens.device)
        cos, sin = rope_cos_sin(self.inv_freq, positions.expand(B, T), self.embed.weight.dtype)
        x = self.embed(tokens)                                          # (B, T, C)
        few = B * T <= self.aten_rows and has_kernel_choice(x.device, x.dtype)
        tapped = []
        with onednn(enabled=not few):
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, cache.k[i], cache.v[i], start, full_mask)
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


def compiled(module: nn.Module, few_rows: int | None = None) -> nn.Module:
    """A copy of module that shares its weights and runs its decoder Blocks through torch.compile.

    The module itself stays eager, so a benchmark can time both in one run. Every Block is one
    graph with its weights as inputs, so the 30 layers of the default model compile once
    (seconds), not 30 times. Shapes are symbolic (dynamic=True): the cached prefix grows every
    step. Forwards that prepacked weights serve (CPU bf16: more rows than the model's
    `aten_rows`) stay eager: inductor cannot use the packed copies, and its own kernels measured
    slower there (see CompiledBlock). few_rows: that threshold for a module that is no Llama
    (an EAGLE head): the target's."""
    rows = getattr(module, "aten_rows", 2) if few_rows is None else few_rows
    return shallow_copy(module, lambda m: CompiledBlock(m, rows) if isinstance(m, Block) else None)


def compiles_trees(module: nn.Module) -> bool:
    """Whether compiled(module) runs forwards of 3+ rows (trees) compiled: only where no weight
    is prepacked. Callers pad trees to one shape for the compiler only then."""
    return all(m.packed is None for m in module.modules() if isinstance(m, Linear))


class CompiledBlock(nn.Module):
    """A Block through torch.compile, except forwards that prepacked weights serve faster.

    Measured on the default model (2 cores, bf16, MT-bench bench): compiled one-token decoding
    1.18x faster than eager (fused norms, RoPE and residuals, less per-op overhead), but a
    compiled 5-9 token verify ~1.3x slower than the eager one with prepacked oneDNN weights.
    On an Intel Xeon with AMX, where prepacked weights serve even one token (aten_rows 0),
    compiled one-token decoding measured 0.78x eager, so there nothing runs compiled.
    Build it after prepack(): whether trees run compiled is decided here, once.
    few_rows: forwards of up to this many rows run compiled where weights are prepacked."""

    def __init__(self, block: Block, few_rows: int = 2):
        super().__init__()
        self.block, self.trees, self.few_rows = block, compiles_trees(block), few_rows
        plain = shallow_copy(block)       # same weights, no packed copies: one set of guards
        for m in plain.modules():
            if isinstance(m, Linear):
                m.packed = None
        self.fast = torch.compile(plain, dynamic=True)

    def forward(self, x, *args):
        B, T, _ = x.shape
        return (self.fast if self.trees or B * T <= self.few_rows else self.block)(x, *args)


def shallow_copy(module: nn.Module, stand_in=lambda m: None) -> nn.Module:
    """A copy of module and its submodules that shares their parameters and buffers;
    stand_in(m) may return a replacement for a submodule m (then it is not copied)."""
    replaced = stand_in(module)
    if replaced is not None:
        return replaced
    view = copy.copy(module)
    view._modules = {name: shallow_copy(child, stand_in) for name, child in module._modules.items()}
    return view


# ---------------------------------------------------------------- random weights of a known shape

# Shapes for timing without a checkpoint (`--model random:NAME`): where no weights can be
# downloaded, the cost of a forward still depends only on the shape.
SHAPES = {
    "smollm2-135m": LlamaConfig(),
    "llama3.2-1b": LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                               num_layers=16, num_heads=32, num_kv_heads=8, rope_theta=500000.0,
                               rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192)),
    "llama3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, rope_theta=500000.0,
                             rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), tie_embeddings=False),
    # The default model's 30 layers and sequence of operations, with matrices too small to cost:
    # its forward times what a forward costs besides reading weights (per-operation overhead).
    "smollm2-135m-thin": LlamaConfig(vocab_size=512, hidden_size=96, intermediate_size=256,
                                     num_heads=3, num_kv_heads=1),
}


def random_model(name: str, dtype=torch.float32, device="cpu") -> Llama:
    """A Llama of a known shape (SHAPES) with nn's default random init, built on the device."""
    if name not in SHAPES:
        raise LoadError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)          # built in dtype: 8B in fp32 first would need 32 GB
    try:
        with torch.device(device):
            model = Llama(copy.deepcopy(SHAPES[name]))
    finally:
        torch.set_default_dtype(default)
    model.inv_freq = rope_inv_freq(model.config).to(device)
    return model.eval()


# ---------------------------------------------------------------- loading HF checkpoints

def hf_tensor_shapes(c: LlamaConfig) -> dict:
    """The tensors a HF Llama checkpoint must hold for this config, name -> shape."""
    C, D = c.hidden_size, c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, C), "model.norm.weight": (C,)}
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, C)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (C,), p + "post_attention_layernorm.weight": (C,),
                   p + "self_attn.q_proj.weight": (c.num_heads * D, C),
                   p + "self_attn.k_proj.weight": (c.num_kv_heads * D, C),
                   p + "self_attn.v_proj.weight": (c.num_kv_heads * D, C),
                   p + "self_attn.o_proj.weight": (C, c.num_heads * D),
                   p + "mlp.gate_proj.weight": (c.intermediate_size, C),
                   p + "mlp.up_proj.weight": (c.intermediate_size, C),
                   p + "mlp.down_proj.weight": (C, c.intermediate_size)}
        if c.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (c.num_heads * D,),
                       p + "self_attn.k_proj.bias": (c.num_kv_heads * D,),
                       p + "self_attn.v_proj.bias": (c.num_kv_heads * D,)}
    return shapes


def to_our_names(hf: dict, c: LlamaConfig) -> dict:
    """Rename HF tensors to this model's names, fusing q/k/v and gate/up."""
    sd = {"embed.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    sd["lm_head.weight"] = hf["model.embed_tokens.weight" if c.tie_embeddings else "lm_head.weight"]
    for i in range(c.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        a = p + "self_attn."
        sd[o + "attn_norm.weight"] = hf[p + "input_layernorm.weight"]
        sd[o + "mlp_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
        sd[o + "attn.wqkv.weight"] = torch.cat([hf[a + n + "_proj.weight"] for n in "qkv"])
        if c.attention_bias:
            sd[o + "attn.wqkv.bias"] = torch.cat([hf[a + n + "_proj.bias"] for n in "qkv"])
        sd[o + "attn.wo.weight"] = hf[a + "o_proj.weight"]
        if c.attention_bias:
            zero = hf[a + "o_proj.weight"].new_zeros(c.hidden_size)
            sd[o + "attn.wo.bias"] = hf.get(a + "o_proj.bias", zero)
        sd[o + "mlp.w13.weight"] = torch.cat([hf[p + "mlp.gate_proj.weight"],
                                              hf[p + "mlp.up_proj.weight"]])
        sd[o + "mlp.w2.weight"] = hf[p + "mlp.down_proj.weight"]
    return sd



def to_hf_names(sd: dict, c: LlamaConfig) -> dict:
    """Inverse of to_our_names: this model's tensors -> HF Llama names (for saving drafts)."""
    D = c.head_dim
    q, kv = c.num_heads * D, c.num_kv_heads * D
    hf = {"model.embed_tokens.weight": sd["embed.weight"], "model.norm.weight": sd["norm.weight"]}
    if not c.tie_embeddings:
        hf["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(c.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        a = p + "self_attn."
        hf[p + "input_layernorm.weight"] = sd[o + "attn_norm.weight"]
        hf[p + "post_attention_layernorm.weight"] = sd[o + "mlp_norm.weight"]
        for name, part in zip("qkv", sd[o + "attn.wqkv.weight"].split([q, kv, kv])):
            hf[a + name + "_proj.weight"] = part
        if c.attention_bias:
            for name, part in zip("qkv", sd[o + "attn.wqkv.bias"].split([q, kv, kv])):
                hf[a + name + "_proj.bias"] = part
            hf[a + "o_proj.bias"] = sd[o + "attn.wo.bias"]
        hf[a + "o_proj.weight"] = sd[o + "attn.wo.weight"]
        gate, up = sd[o + "mlp.w13.weight"].split([c.intermediate_size] * 2)
        hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"] = gate, up
        hf[p + "mlp.down_proj.weight"] = sd[o + "mlp.w2.weight"]
    return {k: v.contiguous() for k, v in hf.items()}

def read_json(path: str, what: str) -> dict:
    if not os.path.isfile(path):
        raise LoadError(f"{what} not found: {path}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise LoadError(f"{path} is not valid JSON: {e}") from None


def safetensors_files(folder: str) -> list:
    """The weight files of a HF folder: one model.safetensors, or the shards its index names."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        names = sorted(set(read_json(index, "shard index")["weight_map"].values()))
        return [os.path.join(folder, n) for n in names]
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise LoadError(f"no model.safetensors or model.safetensors.index.json in {folder}")


def read_safetensors(files: list, dtype) -> dict:
    """All tensors of the files, cast to dtype; a truncated or corrupt file names itself."""
    from safetensors import SafetensorError, safe_open
    tensors = {}
    for path in files:
        if not os.path.isfile(path):
            raise LoadError(f"weight file not found: {path}")
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name).to(dtype)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise LoadError(f"cannot read {path} (truncated or corrupt?): {e}") from None
    return tensors


def check_tensors(tensors: dict, c: LlamaConfig) -> None:
    """Every expected tensor present with its shape, nothing unexpected: else one clear error."""
    expected = hf_tensor_shapes(c)
    tolerated = {"lm_head.weight"} if c.tie_embeddings else set()   # some tied checkpoints keep it
    if c.attention_bias:                                             # optional: absent means zero
        tolerated |= {f"model.layers.{i}.self_attn.o_proj.bias" for i in range(c.num_layers)}
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(n for n in set(tensors) - set(expected) - tolerated
                   if not n.endswith("rotary_emb.inv_freq"))
    if missing:
        raise LoadError(f"checkpoint lacks tensor {missing[0]}" +
                        (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if extra:
        raise LoadError(f"checkpoint has unexpected tensor {extra[0]}" +
                        (f" (and {len(extra) - 1} more)" if len(extra) > 1 else "") +
                        ": not a plain Llama for this config.json?")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise LoadError(f"tensor {name} has shape {tuple(tensors[name].shape)}, "
                            f"config.json implies {shape}")


def load_model(folder: str, dtype=torch.float32, device="cpu") -> Llama:
    """Load a Hugging Face Llama folder (config.json + safetensors, sharded or not)."""
    if not os.path.isdir(folder):
        raise LoadError(f"model folder not found: {folder}")
    config = LlamaConfig.from_hf(read_json(os.path.join(folder, "config.json"), "config.json"))
    tensors = read_safetensors(safetensors_files(folder), dtype)
    check_tensors(tensors, config)
    with torch.device("meta"):
        model = Llama(config)
    model.load_state_dict(to_our_names(tensors, config), assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.inv_freq = rope_inv_freq(config)
    return model.to(device).eval()
