"""The kernels: which cache slots each new token sees, attention over them, the linear layers'
calls, and the optional compiled step, each computing a row the same bits whatever else shares
the call (row invariance), and the check at start that this machine's libraries keep it.

Why exactness needs it: floating-point sums round differently in different orders, and the
libraries torch calls (MKL, oneDNN) choose their order by the shapes they are given, and by the
CPU (AVX2, AVX-512, AMX). Plain decoding computes a token in a call of one row; tree
verification computes the same token in a call of several. For speculative decoding to write
plain decoding's very text, both must give the row the same bits: attention sums in an order
fixed by the token's own visible slots (`attend`), linear layers send the library calls of a
fixed number of rows (`in_calls`; torch's int4 and int8 kernels compute every row with the same
instructions in the same order, so all rows go at once), the compiled step is the same layers
(`step`). What is left to a library is checked at start on the machine that runs
(`check_rows`, about 0.1 s): where a kernel fails, the run computes that kernel's rows alone,
exact by construction, and `--verbose` says so.

Dimensions: B batch, T new tokens (queries), H query heads, K key/value heads, G = H / K, D head
dim, W cache slots read (whole blocks of SLOT_BLOCK), M rows of a linear call, I its inputs.
"""
import itertools
import sys

import torch
import torch.nn.functional as F
from torch import nn

SLOT_BLOCK = 64          # caches hold, and attention reads, whole blocks of this many slots
ROW_GROUP = 4            # rows a CPU float matmul computes together (see whole_groups)
PREFILL_QUERIES = 128    # calls of more queries are prefills (see attend_prefill)
TAIL_BLOCKS = 4          # most blocks a call gathers per query (a tree: 73 nodes fit in 3)


def round_up(n: int, block: int = SLOT_BLOCK) -> int:
    return -(-n // block) * block


def with_ones(values: torch.Tensor) -> torch.Tensor:
    """(..., S, D) values -> (..., S, D + 1), a last column of ones beside them, as caches hold
    values for `attend`."""
    return torch.cat([values, values.new_ones(*values.shape[:-1], 1)], dim=-1)


def attention_mask(start: int, T: int, mask, width: int, device):
    """(T, width) or (B, 1, T, width) bool: which of the first `width` cache slots each of the T
    new tokens (written at slots start..start + T - 1) sees.

    mask None: causal; else (T, start + T) or (B, T, start + T) bool as the caller built it (a
    tree's ancestors with `with_prefix`, a draft's tree in its own cache, a batch with padding).
    Slots from start + T up to width are seen by no one: attention reads whole blocks of slots
    (SLOT_BLOCK), whatever stale keys they hold."""
    if mask is None:
        mask = torch.ones(T, start + T, dtype=torch.bool, device=device).tril(start)
    if tuple(mask.shape[-2:]) != (T, start + T) or mask.dim() > 3:
        raise ValueError(f"a mask of shape {tuple(mask.shape)} for {T} new tokens after {start}: "
                         f"expected ({T}, {start + T}) or (B, {T}, {start + T})")
    mask = mask.to(device)
    unseen = mask.new_zeros(*mask.shape[:-1], width - start - T)
    mask = torch.cat([mask, unseen], dim=-1)
    return mask if mask.dim() == 2 else mask[:, None]      # (B, 1, T, W): broadcast over heads


def with_prefix(mask: torch.Tensor, start: int) -> torch.Tensor:
    """(T, T) bool among new tokens -> (T, start + T): every new token also sees the committed
    prefix [0, start) (its tokens are every tree node's ancestors)."""
    prefix = torch.ones(mask.shape[0], start, dtype=torch.bool, device=mask.device)
    return torch.cat([prefix, mask], dim=1)


def attend(q, keys, values, mask, tail=None, alone=False):
    """q (B, T, H, D), keys (B, K, W, D), values (B, K, W, D + 1) with a last column of ones (as
    KVCache holds them), mask (T, W) or (B, 1, T, W) -> (B, T, H, D). alone: every query of a
    (T, W) mask computed alone (`attend_alone`), the safe route `check_rows` may choose.

    Softmax attention, softmax(q k^T / sqrt(D)) v over the slots each query sees (test_exact's
    oracle writes it so), summed in an order that gives a query plain decoding's bits whatever
    else shares the call. A query's visible slots, in slot order, are the sequence plain
    decoding attends over (its "plain layout"); the weighted sum over them is taken in blocks of
    SLOT_BLOCK positions of that layout, one small matmul a block, added in order.
    Blocks of slots that every query sees in slot order are shared; the rest of a tree node's
    sequence (its ancestors, scattered among other nodes' slots) is gathered per node: `tail`
    (see `tail_slots`). The max is exact in any order, and exp runs on whole rows. The query
    heads of one KV head are stacked into one matrix (grouped-query attention)."""
    B, T, H, D = q.shape
    if T > PREFILL_QUERIES and tail is None:
        return attend_prefill(q, keys, values, mask)
    if alone and T > 1 and mask.dim() == 2:
        return attend_alone(q, keys, values, mask)
    weights, values, parts = slot_order_sums(q, keys, values, mask)    # parts (B, K, n, GT, E)
    if tail is not None:                    # the queries whose slots are not their layout
        shared, rows, slots, seen = tail                               # (Q,), (Q, R), (Q, R)
        first, G = shared // SLOT_BLOCK, weights.shape[2]
        p = layout_sums(weights[:, :, :, rows], values, slots, seen)   # (B, K, m, GQ, E)
        p = F.pad(p, (0, 0, 0, 0, 0, parts.shape[2] - first - p.shape[2]))   # zero blocks after
        at = (torch.arange(G, device=rows.device)[:, None] * T + rows).flatten()  # their rows
        parts[:, :, first:] = parts[:, :, first:].index_copy(3, at, p)
    # the blocks in order: cumsum adds them one after the other, whatever their number
    total = parts.cumsum(2)[:, :, -1]                                   # (B, K, GT, D + 1)
    y = total[..., :D] / total[..., D:]
    return y.view(B, H, T, D).transpose(1, 2)                           # (B, T, H, D)


def slot_order_sums(q, keys, values, mask) -> tuple:
    """`attend`'s shared part: q (B, T, H, D), keys (B, K, W, D), values (B, K, W, E), mask
    (T, W) or (B, 1, T, W) -> the queries' softmax weights before division (B, K, G, T, W'),
    values (B, K, W', E), each block's weighted sums in slot order (B, K, n, GT, E), W' the
    slots rounded up to whole blocks: zero slots of weight 0, which count nothing (training's
    caches of other widths). The column of ones beside the values sums each block's weights."""
    B, T, H, D = q.shape
    K, W = keys.shape[1], keys.shape[2]
    G = H // K
    # the G query heads of each KV head stacked: (B, H, T, D) -> (B, K, G * T, D)
    q = (q * D ** -0.5).to(keys.dtype).transpose(1, 2).reshape(B, K, G * T, D)
    scores = (whole_groups(q) @ keys.transpose(-1, -2))[:, :, :G * T]  # (B, K, GT, W)
    scores = torch.where(mask.view(-1, 1, 1, T, W), scores.view(B, K, G, T, W), float("-inf"))
    weights = (scores - scores.amax(-1, keepdim=True)).exp()           # (B, K, G, T, W)
    if W % SLOT_BLOCK:
        weights = F.pad(weights, (0, -W % SLOT_BLOCK))                 # (B, K, G, T, W')
        values = F.pad(values, (0, 0, 0, -W % SLOT_BLOCK))             # (B, K, W', E)
    return weights, values, block_sums(weights.flatten(2, 3), values)


def layout_sums(w, values, slots, seen) -> torch.Tensor:
    """w (B, K, G, Q, W) some queries' weights, values (B, K, W, E), slots (Q, R) the slot at R
    positions of each query's plain layout, seen (Q, R) whether the position exists -> the
    weighted sums of each block of those positions (B, K, R / SLOT_BLOCK, G * Q, E)."""
    B, K, G, Q, _ = w.shape
    w = w.gather(-1, slots.expand(B, K, G, Q, -1)) * seen               # (B, K, G, Q, R)
    v = values.index_select(2, slots.flatten()).view(B, K, Q, -1, values.shape[-1])  # (.., R, E)
    p = block_sums(w.transpose(2, 3), v)                                # (B, K, Q, m, G, E)
    return p.permute(0, 1, 3, 4, 2, 5).flatten(3, 4)                    # (B, K, m, GQ, E)


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


def attend_alone(q, keys, values, mask):
    """`attend` with each query alone over its visible slots in slot order (its plain layout),
    in the call plain decoding makes for it: exact by construction. Shapes as `attend`."""
    rows = []
    for t in range(q.shape[1]):
        slots = mask[t].nonzero()[:, 0]                                 # (L,) in slot order
        L, W = slots.shape[0], round_up(slots.shape[0])
        k = F.pad(keys[:, :, slots], (0, 0, 0, W - L))                  # (B, K, W, D)
        v = F.pad(values[:, :, slots], (0, 0, 0, W - L))                # (B, K, W, D + 1)
        seen = torch.arange(W, device=mask.device)[None] < L            # (1, W)
        rows.append(attend(q[:, t:t + 1], k, v, seen))                  # (B, 1, H, D)
    return torch.cat(rows, 1)                                           # (B, T, H, D)


def block_sums(w, v) -> torch.Tensor:
    """w (..., M, L) weights, v (..., L, E) values, L a multiple of SLOT_BLOCK -> the weighted
    sums of each block of SLOT_BLOCK slots, (..., L / SLOT_BLOCK, M, E)."""
    M = w.shape[-2]
    blocks = whole_groups(w).unflatten(-1, (-1, SLOT_BLOCK))            # (..., M', n, SLOT_BLOCK)
    parts = blocks.transpose(-3, -2) @ v.unflatten(-2, (-1, SLOT_BLOCK))  # (..., n, M', E)
    return parts[..., :M, :]


def whole_groups(x: torch.Tensor) -> torch.Tensor:
    """(..., M, N) -> (..., M', N): M rounded up to whole groups of ROW_GROUP rows, zero rows: CPU
    float matmuls (MKL) compute a remainder of 1-3 rows another way, rounding differently."""
    extra = -x.shape[-2] % ROW_GROUP
    return x if extra == 0 else F.pad(x, (0, 0, 0, extra))


def tail_slots(mask: torch.Tensor, gather: bool = False):
    """What `attend` gathers for a (T, W) mask: None where every query's visible slots are the
    first ones (plain decoding, chains, prefill: the cache is their plain layout); where, not
    `gather`, the other queries see past the shared blocks only slots of the next block (a tree
    inside one block: its slots hold each node's plain layout in order, unseen slots between,
    whose zero weights add nothing to a sum taken in order; the check at start tries it); or
    where the gathered part would span more than TAIL_BLOCKS blocks (training's unrolled masks,
    which no other call must reproduce). Else (shared, rows, slots, seen): the first `shared`
    slots (whole blocks) every query sees in slot order; rows (Q,) the queries whose visible
    slots are not the first ones (a tree's nodes off its first path); slots (Q, R) the slot at
    each later position of their plain layouts, seen (Q, R) whether that position exists."""
    T, W = mask.shape
    count = mask.sum(1)                                                 # (T,) visible slots
    rows = (mask != (torch.arange(W, device=mask.device) < count[:, None])).any(1).nonzero()[:, 0]
    if rows.numel() == 0:
        return None
    shared = int(mask.all(0).long().cumprod(0).sum()) // SLOT_BLOCK * SLOT_BLOCK
    R = round_up(int(count[rows].max())) - shared
    if R > TAIL_BLOCKS * SLOT_BLOCK or not (gather or mask[rows, shared + SLOT_BLOCK:].any()):
        return None
    order = torch.sort((~mask[rows]).to(torch.uint8), dim=1, stable=True).indices  # seen first
    seen = torch.arange(shared, shared + R, device=mask.device) < count[rows, None]
    return shared, rows, order[:, shared:shared + R], seen


# ---------------------------------------------------------------- linear layers' calls, the check

class RowCalls(nn.Module):
    """A linear layer (quantize.py's forms) whose rows go to the library in calls of `rows` rows
    (`in_calls`; 0: all rows in one call). `check_rows` may set rows to 1. Each form defines
    kernel(x): (M, I) -> (M, O), a library call, and sizes(): (I, O, activations' dtype)."""
    rows = 0

    def forward(self, x):
        y = in_calls(self.kernel, x.reshape(-1, x.shape[-1]), self.rows)   # (M, O)
        return y.view(*x.shape[:-1], -1)


def in_calls(f, x: torch.Tensor, rows: int) -> torch.Tensor:
    """f over x (M, I) in calls of exactly `rows` rows, zero rows padding the last (0: one call):
    one shape whatever the step's row count (the module's docstring: why). A call of more than
    PREFILL_QUERIES rows is a prefill, whose rows no other call computes (as in `attend`): whole."""
    M = x.shape[0]
    if rows == 0 or M == rows or M > PREFILL_QUERIES:
        return f(x)
    padded = F.pad(x, (0, 0, 0, -M % rows))                             # (M', I)
    return torch.cat([f(part) for part in padded.split(rows)])[:M]      # (M, O)


# Row counts the check tries: remainders of every tile height seen in MKL's kernels (4 on AVX-512,
# 6 on AVX2) and calls past the sizes where it switches kernels (60 rows on its AVX2 path)
CHECK_SIZES = (3, 8, 13, 25, 41, 73)


@torch.no_grad()
def check_rows(model) -> list:
    """The check at start, on the machine that runs: each kernel the target uses (a linear layer
    of each form and shape, attention) computes random rows in calls of several sizes
    (CHECK_SIZES; a form with calls of fixed rows, one call) and a few of them alone. A linear
    form whose rows differ computes every row alone from then on (rows = 1), attention takes
    its fastest exact route (`attention_route`). -> a line per kernel rerouted, what and why."""
    g = torch.Generator().manual_seed(0)
    groups = {}
    for m in model.modules():
        if isinstance(m, RowCalls) and m.rows != 1:
            groups.setdefault((type(m).__name__, m.rows) + m.sizes(), []).append(m)
    notes = []
    for (kind, calls, I, O, dtype), layers in groups.items():
        sizes = (calls,) if calls else CHECK_SIZES      # calls of fixed rows: that one shape
        n = next((n for n in sizes if linear_differs(layers[0], n, g)), None)
        if n is not None:
            for m in layers:
                m.rows = 1
            notes.append(f"{kind} {I}x{O} in {str(dtype).removeprefix('torch.')}: a row among "
                         f"{n} differs from the row alone here; every row computed alone")
    c, k = model.config, model.new_cache(1, 1).k            # attention's dtype and device
    model.gather, model.alone, n = attention_route(c.num_heads, c.num_kv_heads, c.head_dim,
                                                   k.dtype, k.device)
    why = ("from its path alone here, gathered or not; every query alone" if model.alone else
           "ungathered inside one block (zero weights change a sum here); every tree gathered")
    notes += [f"attention in {str(k.dtype).removeprefix('torch.')}: a tree node among {n} "
              f"differs {why}"] if model.gather else []
    return notes


def attention_route(H, K, D, dtype, device="cpu") -> tuple:
    """-> (gather, alone, n): the fastest of attention's routes that gives every tree node its
    path's bits here at CHECK_SIZES after 70, 200 and 450 slots (one call, no gather inside a
    block; one call, every off-path node gathered; each query alone), and the size at which
    the faster one differed (None where the first holds)."""
    g, first = torch.Generator().manual_seed(1), None
    for gather in (False, True):
        n = next((n for n in CHECK_SIZES for prefix in (70, 200, 450) if attention_differs(
            H, K, D, dtype, n, prefix, g, device, gather)), None)
        if n is None:
            return gather, False, first
        first = first or n
    return True, True, first


def linear_differs(layer, n: int, g) -> bool:
    """Whether the layer gives some of n random rows other bits than the row alone."""
    I, _, dtype = layer.sizes()
    x = torch.randn(n, I, generator=g).to(dtype)
    together = layer(x)                                                 # (n, O)
    return not all(torch.equal(layer(x[r:r + 1]), together[r:r + 1])
                   for r in sorted({0, 1, n // 2, n - 1}))


def attention_differs(H, K, D, dtype, n, prefix, g, device="cpu", gather=False) -> bool:
    """Whether `attend` gives some node of a random n-node tree after `prefix` slots other bits
    than the node alone over its path (`attend_alone`), on the device (gather: `tail_slots`)."""
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)   # noqa: E731
    ancestors = torch.eye(n, dtype=torch.bool)                          # (n, n)
    for i in range(1, n):                               # a random parent among earlier nodes
        ancestors[i] |= ancestors[int(torch.randint(0, i, (), generator=g))]
    W = round_up(prefix + n)
    seen = torch.cat([torch.ones(n, prefix, dtype=torch.bool), ancestors,
                      torch.zeros(n, W - prefix - n, dtype=torch.bool)], 1).to(device)  # (n, W)
    q, keys, values = 3 * rand(1, n, H, D), rand(1, K, W, D), with_ones(rand(1, K, W, D))
    together = attend(q, keys, values, seen, tail_slots(seen, gather))  # (1, n, H, D)
    picks = torch.tensor(sorted({0, 1, n // 2, n - 1}), device=device)
    alone = attend_alone(q[:, picks], keys, values, seen[picks])
    return not torch.equal(alone, together[:, picks])


# ---------------------------------------------------------------- the compiled step (--compile)
# At batch 1 on a CPU most of an eager step is PyTorch's cost per small operation, not reading
# weights. torch.compile removes it when it sees the whole step as one graph (fullgraph=True,
# gpt-fast's design) whose shapes never change (see `Compiled`); prefills stay eager.
# Dimensions: T padded tokens, S slots, R window slots.

WINDOW = TAIL_BLOCKS * SLOT_BLOCK        # R: slots a query gathers in its plain layout
NARROWEST = 256                          # the smallest cache width attended


def cache_width(slots: int) -> int:
    """Slots rounded up to a power of two (at least NARROWEST): a few widths, a few graphs."""
    return max(NARROWEST, 1 << (slots - 1).bit_length())


def window(seen: torch.Tensor, start: torch.Tensor) -> tuple:
    """seen (T, S) bool -> the window every query gathers: first () the block holding slot
    `start` (the blocks before it, the committed prefix, are shared), slots (T, R) the slots at
    positions first * SLOT_BLOCK + 0..R-1 of each query's plain layout, valid (T, R) whether
    that position exists."""
    T, S = seen.shape
    first = start // SLOT_BLOCK
    span = first * SLOT_BLOCK + torch.arange(WINDOW, device=seen.device)       # (R,)
    inside = span < S
    span = span.clamp(max=S - 1)
    visible = seen.gather(1, span.expand(T, WINDOW)) & inside                   # (T, R)
    order = torch.sort((~visible).to(torch.uint8), dim=1, stable=True).indices  # seen first
    return first, span[order], visible.gather(1, order)


def attend_fixed(q, keys, values, seen, win):
    """`attend` for fixed shapes: seen (T, S) bool, win from `window`, or None where each
    query's plain layout is its slot order (zero-weight slots between); else the blocks before
    the window come from the slot-order sums (there the plain layout is the slot order), the
    window's from its gathered slots. Other shapes as `attend`'s."""
    B, T, H, D = q.shape
    weights, values, parts = slot_order_sums(q, keys, values, seen)    # parts (B, K, n, GT, E)
    if win is not None:
        first, slots, valid = win
        before = torch.arange(parts.shape[2], device=q.device) < first  # (n,)
        parts = torch.cat([torch.where(before[:, None, None], parts, 0.0),
                           layout_sums(weights, values, slots, valid)], dim=2)  # (.., n + m, ..)
    total = parts[:, :, 0]
    for b in range(1, parts.shape[2]):          # in order: one sum, the same for every query
        total = total + parts[:, :, b]
    y = total[..., :D] / total[..., D:]                                 # (B, K, GT, D)
    return y.view(B, H, T, D).transpose(1, 2)                           # (B, T, H, D)


def step(model: "Llama", tokens, positions, k, v, start, mask, gather: bool = True, taps=(),
         project: bool = True):
    """One decode step of fixed shapes, the graph torch.compile sees: tokens, positions (1, T)
    long, k and v each layer's cache, (1, K, S, D) and (1, K, S, D + 1) (written in place at
    slots start..start + T - 1), start () long, mask (T, T) bool among the new tokens, gather
    whether queries gather their window -> logits (1, T, V) (None if not project), final hidden
    (1, T, C), or the streams entering the layers `taps` names, as Llama.forward returns them."""
    B, T = tokens.shape
    S = k[0].shape[2]
    at = start + torch.arange(T, device=tokens.device)                 # (T,) their slots
    rel = torch.arange(S, device=tokens.device) - start                # (S,) slot - start
    new = mask[:, rel.clamp(0, T - 1)] & (rel >= 0) & (rel < T)         # (T, S) among the new
    seen = new | (rel < 0)                                              # and the whole prefix
    win = window(seen, start) if gather else None                       # once for all layers
    x, tapped = model.embed(tokens), []                                 # (B, T, C)
    cos, sin = model.rope(positions, x.dtype)
    for i, layer in enumerate(model.layers):
        tapped += [x] if i in taps else []
        q, new_k, new_v = layer.attn.project(layer.attn_norm(x), cos, sin)
        k[i][:, :, at] = new_k.to(k[i].dtype)                            # (B, K, T, D)
        v[i][:, :, at] = with_ones(new_v.to(v[i].dtype))
        y = attend_fixed(q, k[i], v[i], seen, win)                       # (B, T, H, D)
        x = x + layer.attn.wo(y.to(x.dtype).reshape(B, T, -1))
        x = x + layer.mlp(layer.mlp_norm(x))
    hidden = model.norm(x)
    tapped += [hidden] if len(model.layers) in taps else []
    return model.lm_head(hidden) if project else None, torch.cat(tapped, -1) if taps else hidden


class Compiled(nn.Module):
    """A target (model.Llama's interface) whose steps run compiled: a graph per width attended
    (`cache_width` of the slots in use) and step size of `sizes` (a chain takes the least that
    holds it, a tree the largest; trees: whether calls may be trees, which need a gathering
    graph too); prefills run eager. Caches are `slots` wide (a run's most; wider where asked: a
    graph more a width). taps and project: what calls ask of `step` (False: a draft's)."""

    def __init__(self, model: "Llama", sizes=(1,), slots: int = NARROWEST, taps=(),
                 project: bool = True, trees: bool = True):
        super().__init__()
        self.model, self.sizes, self.slots, self.taps = model, sorted(set(sizes)), slots, taps
        self.project, self.trees = project, trees
        self.config, self.embed, self.lm_head = model.config, model.embed, model.lm_head
        cuda = model.embed.weight.device.type == "cuda"
        # a graph per (size, width, gather), and every method of a bench shares them
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # on a GPU the graphs replay as CUDA graphs. emulate_precision_casts: round every
        # intermediate as eager does; else a fused kernel may skip a bfloat16 rounding, and the
        # graphs of 1 and N tokens (fused differently) would give a row different bits
        self.graph = torch.compile(step, fullgraph=True, dynamic=False,
                                   options={"emulate_precision_casts": True,
                                            "triton.cudagraphs": cuda})

    def widths(self) -> list:
        """The widths its caches attend over as they fill, up to the context's: a graph each."""
        most = min(cache_width(self.slots), cache_width(self.config.max_positions))
        return [w for w in (NARROWEST << i for i in range(32)) if w <= most]

    @torch.inference_mode()
    def warm_up(self, name: str = "the target") -> "Compiled":
        """Compile now every graph (size, width, gathering or not) its caches can need: no step
        of a run stops to compile (minutes the first time, seconds from torch's disk cache)."""
        print(f"Compiling {name}'s steps of {', '.join(map(str, self.sizes))} token"
              f"{'s' * (self.sizes != [1])} over {', '.join(map(str, self.widths()))} slots "
              f"(minutes the first time; torch keeps them for the next start)", file=sys.stderr)
        cache, device = self.new_cache(), self.embed.weight.device
        for width, size, gather in itertools.product(self.widths(), self.sizes, (False, True)):
            if not gather or self.trees and size == self.sizes[-1] > 2:  # 2 nodes: a chain
                cache.length = width - size
                positions = torch.arange(width - size, width, device=device)   # fills the width
                self.run(torch.zeros(size, dtype=torch.long, device=device), positions,
                         torch.ones(size, size, dtype=torch.bool).tril(), cache, gather,
                         tuple(self.taps), self.project)
        return self

    def new_cache(self, batch: int = 1, slots: int | None = None) -> "KVCache":
        # every cache as wide: a graph's input strides (and so the graph) depend on it too
        return self.model.new_cache(batch, cache_width(max(slots or 0, self.slots)))

    def forward(self, tokens, positions, cache, mask=None, last_only=False, taps=(), project=True):
        n, start = tokens.shape[1], cache.length
        if n > self.sizes[-1]:                                        # a prefill
            return self.model(tokens, positions, cache, mask, last_only, project, taps)
        tree = (torch.ones(n, n, dtype=torch.bool).tril() if mask is None
                else mask[:, start:].cpu())                         # (n, n) among new tokens
        chain = torch.equal(tree, torch.ones(n, n, dtype=torch.bool).tril())
        size = next(s for s in self.sizes if s >= n) if chain else self.sizes[-1]
        # a tree inside one block of slots needs no gather where the check at start found so
        gather = not chain and (self.model.gather or start % SLOT_BLOCK + n > SLOT_BLOCK)
        tokens, positions, tree = pad_inputs(tokens[0], positions[0], tree, size)
        logits, hidden = self.run(tokens, positions, tree, cache, gather, tuple(taps), project)
        cache.length = start + n
        if project:
            logits = logits[:, n - 1:n] if last_only else logits[:, :n]
        return logits, hidden[:, :n]                 # the pads' slots go with the rejected

    def run(self, tokens, positions, tree, cache, gather: bool, taps=(), project=True) -> tuple:
        """The graph of tokens' size on tokens, positions (N,), tree (N, N) at the cache's end
        (its length unchanged) -> logits (1, N, V), hidden (1, N, C)."""
        start, size, device = cache.length, tokens.shape[0], tokens.device
        width = min(cache_width(start + size), cache.slots)
        # each layer's cache a separate input, its first `width` slots (a view: written in
        # place); a write into a slice of one stacked tensor would copy the whole cache
        keys = [k[:, :, :width] for k in cache.k.unbind(0)]              # (1, K, width, D)
        values = [v[:, :, :width] for v in cache.v.unbind(0)]            # (1, K, width, D + 1)
        return self.graph(self.model, tokens[None], positions[None], keys, values,
                          torch.tensor(start, device=device), tree.to(device), gather, taps,
                          project)


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
