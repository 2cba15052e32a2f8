"""Draft heads that read the target's features (Medusa, EAGLE), their files, and static trees.

Both predict over a reduced draft vocabulary: the R most frequent tokens of the target's own
answers (EAGLE-3's trick), `vocab_ids` (R,) mapping them back to target ids. The projection is the
target's own lm_head restricted to those rows, shared and frozen, so a head file holds only what
the head adds.

Dimensions: B batch, T tokens, C hidden size, V target vocab, R draft vocab, M Medusa heads.
"""
import heapq
import json
import os
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from kernels import attention_mask
from model import Block, KVCache, LlamaConfig, LoadError, rope_cos_sin, rope_inv_freq


@dataclass
class HeadConfig:
    kind: str                    # "eagle" or "medusa"
    hidden_size: int             # C of the target the head was trained for
    vocab_size: int              # V of that target
    draft_vocab: int             # R, rows of the shared projection the head predicts over
    num_heads: int = 4           # Medusa: M heads, head i predicts i + 2 tokens ahead
    layer: dict = field(default_factory=dict)     # EAGLE: LlamaConfig fields of its decoder layer
    accuracy: list = field(default_factory=list)  # [depth][rank] measured P(correct | path so far)

    def check(self, target: LlamaConfig, folder: str) -> None:
        if (self.hidden_size, self.vocab_size) != (target.hidden_size, target.vocab_size):
            raise LoadError(f"{folder}: head trained for hidden size {self.hidden_size} and vocab "
                            f"{self.vocab_size}, but the target has {target.hidden_size} and "
                            f"{target.vocab_size}; train a head for this target")


class EagleHead(nn.Module):
    """EAGLE (Li et al. 2024, arXiv 2401.15077): fc over [embedding of the next token; feature],
    one Llama decoder layer with its own KV cache, output = predicted next feature."""

    def __init__(self, layer: LlamaConfig, vocab_ids: torch.Tensor):
        super().__init__()
        C = layer.hidden_size
        self.layer_config = layer
        self.fc = nn.Linear(2 * C, C)
        self.layer = Block(layer)
        self.register_buffer("vocab_ids", vocab_ids.long())              # (R,)
        self.register_buffer("inv_freq", rope_inv_freq(layer), persistent=False)

    def forward(self, feats, embeds, positions, cache: KVCache, mask=None):
        """feats, embeds (B, T, C), positions (B, T) -> predicted next features (B, T, C).

        Entry t reads the feature at position t and the token at t + 1; it is written to cache
        slots [cache.length, + T) and sees the prefix plus `mask` as in Llama.forward."""
        B, T, _ = feats.shape
        start = cache.length
        full_mask = attention_mask(start, T, mask, feats.device)
        cos, sin = rope_cos_sin(self.inv_freq, positions.expand(B, T), feats.dtype)
        x = self.fc(torch.cat([embeds, feats], dim=-1))                   # (B, T, C)
        x = self.layer(x, cos, sin, cache.k[0], cache.v[0], start, full_mask)
        cache.length = start + T
        return x

    def new_cache(self, slots: int, batch: int = 1) -> KVCache:
        w = self.fc.weight
        return KVCache.allocate(self.layer_config, batch, slots, w.dtype, w.device)


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


def projection(target, vocab_ids: torch.Tensor) -> torch.Tensor:
    """(R, C): the target's lm_head rows of the draft vocabulary (a copy, R/V of its size)."""
    return target.lm_head.weight.detach()[vocab_ids.to(target.lm_head.weight.device)].clone()


def build_head(config: HeadConfig, vocab_ids: torch.Tensor) -> nn.Module:
    if config.kind == "eagle":
        return EagleHead(LlamaConfig(**config.layer), vocab_ids)
    return MedusaHeads(config.hidden_size, config.num_heads, vocab_ids)


def eagle_layer_config(target: LlamaConfig) -> dict:
    """The head's decoder layer: the target's layer shape, one layer, no RoPE scaling."""
    fields = asdict(target) | {"num_layers": 1, "rope_scaling": None}
    return fields


# ---------------------------------------------------------------- files

def save_head(head: nn.Module, config: HeadConfig, folder: str, info: dict | None = None) -> None:
    """model.safetensors (16-bit) + config.json (+ training.json); written atomically."""
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    tensors = {k: (v.bfloat16() if v.is_floating_point() else v).contiguous()
               for k, v in head.state_dict().items()}
    save_file(tensors, f"{folder}/model.safetensors.tmp")
    os.replace(f"{folder}/model.safetensors.tmp", f"{folder}/model.safetensors")
    write_json(f"{folder}/config.json", asdict(config))
    if info is not None:
        write_json(f"{folder}/training.json", info)


def write_json(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def load_head(folder: str, target, kind: str) -> tuple:
    """-> (head in the target's dtype and device, HeadConfig); clear errors for a bad folder."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    for name in ("config.json", "model.safetensors"):
        if not os.path.isfile(f"{folder}/{name}"):
            raise LoadError(f"{folder}: no {name}; is this a folder written by train_heads.py?")
    with open(f"{folder}/config.json") as f:
        try:
            config = HeadConfig(**json.load(f))
        except (json.JSONDecodeError, TypeError) as e:
            raise LoadError(f"{folder}/config.json: not a head config ({e})") from None
    if config.kind != kind:
        raise LoadError(f"{folder}: holds a {config.kind} head, not {kind}")
    config.check(target.config, folder)
    try:
        tensors = load_file(f"{folder}/model.safetensors")
    except (SafetensorError, OSError) as e:
        raise LoadError(f"{folder}/model.safetensors: unreadable ({e})") from None
    head = build_head(config, tensors.get("vocab_ids", torch.zeros(config.draft_vocab)))
    try:
        head.load_state_dict(tensors)
    except RuntimeError as e:
        raise LoadError(f"{folder}/model.safetensors does not fit its config.json: {e}") from None
    w = target.embed.weight
    return head.to(w.device, w.dtype).eval(), config


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
