"""Draft heads that read the target's features (Medusa, EAGLE, EAGLE-3), static trees from
measured accuracies, and the expected speed of a tree size (--tree-size auto); their files are
checkpoint.py's.

All predict over a reduced draft vocabulary: the R most frequent tokens of the target's own
answers (EAGLE-3's trick), `vocab_ids` (R,) mapping them back to target ids. Medusa's and
EAGLE's projection is the target's own lm_head restricted to those rows, shared and frozen, so a
head file holds only what the head adds; an EAGLE-3 head has an lm_head of its own.

Dimensions: B batch, T tokens, C hidden size, V target vocab, R draft vocab, M Medusa heads.
"""
import heapq
import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from kernel import attention_mask, round_up
from model import MLP, Attention, Block, KVCache, LlamaConfig, RMSNorm, Rope


@dataclass
class HeadConfig:
    kind: str                    # "eagle", "eagle3" or "medusa"
    hidden_size: int             # C of the target the head was trained for
    vocab_size: int              # V of that target
    draft_vocab: int             # R, rows of the shared projection the head predicts over
    num_heads: int = 4           # Medusa: M heads, head i predicts i + 2 tokens ahead
    layer: dict = field(default_factory=dict)     # EAGLE: LlamaConfig fields of its decoder layer
    accuracy: list = field(default_factory=list)  # [depth][rank] measured P(correct | path so far)
    taps: list = field(default_factory=list)      # EAGLE-3: the target layers whose input it
                                 # reads (hidden_states indices); [] the default 2, N/2, N - 3
    block: int = 0               # EAGLE-3 block head: tokens it learned to draft in one forward
    mask_token: int | None = None   # the token its mask rows read (a block head's)


class EagleHead(nn.Module):
    """EAGLE (Li et al. 2024, arXiv 2401.15077): fc over [embedding of the next token; feature],
    one Llama decoder layer with its own KV cache, output = predicted next feature.

    The layout is the EAGLE authors' (eagle/model/cnets.py): fc with a bias, no RMS norm before
    the layer's attention, the predicted feature projected by the target's lm_head as it is;
    so a head exports to their format (export.py)."""

    def __init__(self, layer: LlamaConfig, vocab_ids: torch.Tensor):
        super().__init__()
        C = layer.hidden_size
        self.layer_config = layer
        self.fc = nn.Linear(2 * C, C)
        self.layers = nn.ModuleList([Block(layer, input_norm=False)])      # "layers.0."
        self.register_buffer("vocab_ids", vocab_ids.long())              # (R,)
        self.rope = Rope(layer)

    def forward(self, feats, embeds, positions, cache: KVCache, mask=None):
        """feats, embeds (B, T, C), positions (B, T) -> predicted next features (B, T, C).

        Entry t reads the feature at position t and the token at t + 1; it is written to cache
        slots [cache.length, + T) and sees the prefix plus `mask` as in Llama.forward."""
        B, T, _ = feats.shape
        start = cache.length
        seen = attention_mask(start, T, mask, min(round_up(start + T), cache.slots), feats.device)
        cos, sin = self.rope(positions.expand(B, T), feats.dtype)
        x = self.fc(torch.cat([embeds, feats], dim=-1))                   # (B, T, C)
        # a draft: no tail (see attend)
        x = self.layers[0](x, cos, sin, cache.k[0], cache.v[0], start, seen)   # (B, T, C)
        cache.length = start + T
        return x

    def new_cache(self, slots: int, batch: int = 1) -> KVCache:
        # a norm's weight or a bias: float in every weight form
        return KVCache.allocate(self.layer_config, batch, slots, next(self.parameters()))


class Eagle3Head(nn.Module):
    """EAGLE-3 (Li et al. 2025, arXiv 2503.01840) in its authors' layout (SpecForge's
    LlamaForCausalLMEagle3, whose names it keeps): fc fuses three of the target's features (the
    residual stream entering three layers: Llama.forward's taps), 3C -> C; one decoder layer
    whose attention reads [norm(embedding of the next token); norm(feature)] (2C) and whose
    residual stream is the feature; its output g is the predicted next feature, fed back as it
    is at later depths, and lm_head(norm(g)) scores its own draft vocabulary: draft id i is
    target id vocab_ids[i] (i + the file's d2t[i])."""

    def __init__(self, layer: LlamaConfig, vocab_ids: torch.Tensor, taps=()):
        super().__init__()
        C, eps = layer.hidden_size, layer.rms_eps
        self.layer_config, self.taps = layer, tuple(taps)
        self.fc = nn.Linear(3 * C, C, bias=False)
        self.midlayer = m = nn.Module()
        m.input_layernorm, m.hidden_norm = RMSNorm(C, eps), RMSNorm(C, eps)
        m.self_attn, m.mlp = Attention(layer, 2 * C), MLP(layer)
        m.post_attention_layernorm = RMSNorm(C, eps)
        self.norm = RMSNorm(C, eps)
        self.lm_head = nn.Linear(C, vocab_ids.shape[0], bias=False)
        self.register_buffer("vocab_ids", vocab_ids.long())              # (R,)
        self.rope = Rope(layer)

    def forward(self, feats, embeds, positions, cache: KVCache, mask=None):
        """feats (B, T, 3C) the target's taps, or (B, T, C) features the head predicted; the
        rest as EagleHead's -> predicted next features (B, T, C)."""
        B, T, C = embeds.shape
        m, start = self.midlayer, cache.length
        seen = attention_mask(start, T, mask, min(round_up(start + T), cache.slots), feats.device)
        cos, sin = self.rope(positions.expand(B, T), feats.dtype)
        g = self.fc(feats) if feats.shape[-1] != C else feats              # (B, T, C)
        x = torch.cat([m.input_layernorm(embeds), m.hidden_norm(g)], -1)   # (B, T, 2C)
        g = g + m.self_attn(x, cos, sin, cache.k[0], cache.v[0], start, seen)
        cache.length = start + T
        return g + m.mlp(m.post_attention_layernorm(g))

    def projection(self) -> nn.Module:
        """Its own scores over the draft vocabulary: a module C -> R."""
        return nn.Sequential(self.norm, self.lm_head)

    new_cache = EagleHead.new_cache


class MedusaHeads(nn.Module):
    """Medusa (Cai et al. 2024): M residual blocks x + SiLU(W x) on the target's final feature;
    zero-initialized, so each starts as the target's own next-token head."""

    def __init__(self, hidden_size: int, num_heads: int, vocab_ids: torch.Tensor):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for b in self.blocks:
            nn.init.zeros_(b.weight), nn.init.zeros_(b.bias)
        self.register_buffer("vocab_ids", vocab_ids.long())              # (R,)

    def forward(self, hidden):
        """hidden (..., C) -> (..., M, C): one feature per head, for the shared projection."""
        return torch.stack([hidden + nn.functional.silu(b(hidden)) for b in self.blocks], -2)


def projection_rows(target, vocab_ids: torch.Tensor) -> torch.Tensor:
    """(R, C): the target's lm_head rows of the draft vocabulary (a copy, R/V of its size)."""
    w = target.embed.weight if target.config.tie_embeddings else target.lm_head.weight
    return w.detach()[vocab_ids.to(w.device)].clone()


def projection(target, vocab_ids: torch.Tensor) -> nn.Linear:
    """The target's lm_head restricted to the draft vocabulary: a module C -> R."""
    rows = projection_rows(target, vocab_ids)                           # (R, C)
    proj = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
    proj.weight = nn.Parameter(rows, requires_grad=False)
    return proj


def eagle3_taps(num_layers: int) -> list:
    """EAGLE-3's taps of a target of N layers: the stream entering layers 2, N/2 and N - 3."""
    return [2, num_layers // 2, num_layers - 3]


def build_head(config: HeadConfig, vocab_ids: torch.Tensor) -> nn.Module:
    if config.kind == "eagle3":
        return Eagle3Head(LlamaConfig(**config.layer), vocab_ids, config.taps)
    if config.kind == "eagle":
        return EagleHead(LlamaConfig(**config.layer), vocab_ids)
    return MedusaHeads(config.hidden_size, config.num_heads, vocab_ids)


# The EAGLE authors' head layer builds its RoPE with base 10,000 whatever the target's theta
# (cnets.LlamaRotaryEmbedding's default); a head trained with that base computes the same there
# and in engines that read the exported config's rope_theta.
EAGLE_ROPE_THETA = 10000.0


def eagle_layer_config(target: LlamaConfig) -> dict:
    """The head's decoder layer: the target's layer shape, one layer, EAGLE's plain RoPE."""
    return asdict(target) | {"num_layers": 1, "rope_theta": EAGLE_ROPE_THETA, "rope_scaling": None}


# ---------------------------------------------------------------- static trees

def best_paths(accuracy: list, size: int) -> list:
    """The `size` paths (tuples of ranks) with the highest probability of being accepted.

    Medusa (Cai et al. 2024, Sec. 3.3.1): with accuracy[d][r] the measured probability that the
    rank-r candidate at depth d + 1 is right given the path so far, a path is accepted with the
    product of its accuracies, and the expected acceptance length is their sum: greedy picks are
    optimal. Picking a node offers its first child and its next sibling, so the set stays a tree."""
    heap, paths = [(-accuracy[0][0], (0,), 1.0)], []     # (-P(path), path, P(parent path))
    while heap and len(paths) < size:
        neg, path, parent = heapq.heappop(heap)
        paths.append(path)
        d, r = len(path) - 1, path[-1]
        if d + 1 < len(accuracy):
            heapq.heappush(heap, (neg * accuracy[d + 1][0], path + (0,), -neg))
        if r + 1 < len(accuracy[d]):
            heapq.heappush(heap, (-parent * accuracy[d][r + 1], path[:-1] + (r + 1,), parent))
    return paths


def expected_length(accuracy: list, size: int) -> float:
    """Expected tokens per step (accepted drafts + the target's own token) of the best static
    tree with `size` drafted nodes: 1 + the sum of its paths' acceptance probabilities."""
    return sum((math.prod(accuracy[d][r] for d, r in enumerate(path))
                for path in best_paths(accuracy, size)), 1.0)


def choose_tree_size(expected: dict, verify_ms, draft_ms: dict, extra: int = 0) -> tuple:
    """The size n maximizing expected tokens per second, expected[n] / (draft_ms[n] +
    verify_ms(n + 1 + extra)). verify_ms(k): ms of a forward over k tokens; draft_ms {n: ms of
    drafting n nodes}; extra: tokens that ride along in every verify pass (eagle2+ngram's
    lookup chain). -> (n, {n: predicted tokens per second})."""
    speed = {n: 1000 * e / (draft_ms[n] + verify_ms(n + 1 + extra)) for n, e in expected.items()}
    return max(speed, key=speed.get), speed
