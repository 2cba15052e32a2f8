"""Attention over a cached prefix, computed so that a query's result is the same bits whatever
else shares the call: which slots each new token sees (`attention_mask`), the formula
(`attend_reference`), and the order of summation that makes it exact (`attend`) for every
call decoding makes: a prefill (more than PREFILL_QUERIES queries) is computed by SDPA, and
its rows no other call computes.

Why exactness needs an order: floating-point sums round differently in different orders, and
the kernels torch calls choose their order by the shapes they are given. Plain decoding
computes a token's attention in a call of one query; tree verification computes the same
token in a call of several. For speculative decoding to write plain decoding's very text,
both must give the same bits, so `attend` sums in an order fixed by the token's own visible
slots (blocks of SLOT_BLOCK), never by the call.

Dimensions: B batch, T new tokens (queries), H query heads, K key/value heads, G = H / K, D head
dim, W cache slots read (whole blocks of SLOT_BLOCK).
"""
import torch
import torch.nn.functional as F

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

    mask None: causal, each new token seeing the prefix [0, start) and the new tokens up to
    itself; else (T, start + T) or (B, T, start + T) bool as the caller built it (a tree's
    ancestors with `with_prefix`, a draft's tree in its own cache, a batch with padding).
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
