"""The decoding loops: plain decoding, and speculative decoding's propose / verify / accept /
commit. They need a target (model.Llama, or kernel.Compiled around one) and, for speculative
decoding, a proposer (proposers.py); nothing here knows the command line.

Dimensions: T tokens, N tree nodes, V vocab."""
import time
from dataclasses import dataclass, field

import torch

from kernel import with_prefix
from tree import ancestor_mask, positions, retrieve_indices
from verification import accept_chain_sampled, accept_tree, next_tokens, target_probs, uniform


# A speculative step's phases, timed: propose, the tree's mask and positions, the target's
# forward, verification's walk, the cache's keep and the proposer's commit, the rest (streaming)
PHASES = ("draft", "tree", "forward", "accept", "commit", "other")


@dataclass
class GenConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0     # 0 means greedy
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Result:
    token_ids: list = field(default_factory=list)   # new tokens only
    target_forwards: int = 0                        # prefill included
    seconds: float = 0.0                            # prefill to last token
    accepted: list = field(default_factory=list)    # per step: drafted tokens accepted
    drafted: list = field(default_factory=list)     # per step: drafted tokens (tree nodes)
    depths: list = field(default_factory=list)      # per step: the tree's depth
    # per phase of a step (PHASES), per step: wall time, no sync added (a CPU waits anyway)
    phase_seconds: dict = field(default_factory=lambda: {p: [] for p in PHASES})

    @property
    def tau(self) -> float:
        """New tokens per target forward (the bonus token counts: plain decoding has 1.00)."""
        return len(self.token_ids) / max(self.target_forwards, 1)


def take(result: Result, new: list, drafted: list, stop_ids, limit: int, on_tokens) -> tuple:
    """Append new tokens up to a stop token or the limit, and stream the ones taken (never past
    the cut) -> (how many were taken, whether generation is over). drafted: per new token,
    whether it came from an accepted draft (--show-drafts marks those)."""
    taken, done = len(new), False
    for i, t in enumerate(new):
        result.token_ids.append(t)
        if t in stop_ids or len(result.token_ids) >= limit:
            taken, done = i + 1, True
            break
    if on_tokens:
        on_tokens(new[:taken], drafted[:taken])
    return taken, done


def draws(gen: GenConfig, positions) -> torch.Tensor | None:
    """The uniforms that decide the target's tokens at these absolute positions (None: greedy)."""
    return None if gen.temperature == 0 else torch.tensor(
        [uniform(gen.seed, int(t)) for t in positions], dtype=torch.float64)


def check_room(model, prompt_ids: list, gen: GenConfig, extra: int = 0) -> int:
    """Cache slots needed; a clear error when the prompt cannot fit the context."""
    n, ctx = len(prompt_ids), model.config.max_positions
    if n == 0:
        raise ValueError("the prompt is empty")
    if n + 1 > ctx:
        raise ValueError(f"prompt of {n} tokens is longer than the model's context of {ctx}")
    return min(n + gen.max_new_tokens + extra + 1, ctx + extra + 1)


def plain_step(model, ids, pos, cache, gen: GenConfig, taps=()) -> tuple:
    """One target forward over ids (1, T) at positions pos -> (the target's token after the
    last: its argmax, or its draw keyed on the position it will take; features (1, T, C))."""
    taken = cache.length + ids.shape[1]    # the position it takes: in plain decoding, its slot
    logits, hidden = model(ids, pos, cache, last_only=True, taps=taps)
    u = draws(gen, [taken])
    return int(next_tokens(logits[0, -1], gen.temperature, gen.top_p, u)), hidden


@torch.inference_mode()
def generate_ar(model, prompt_ids: list, gen: GenConfig, stop_ids=(), on_tokens=None) -> Result:
    """Plain decoding: one target forward per token."""
    device = model.embed.weight.device
    cache = model.new_cache(1, check_room(model, prompt_ids, gen))
    result, t0 = Result(), time.perf_counter()
    ids = torch.tensor([prompt_ids], device=device)
    pos = torch.arange(len(prompt_ids), device=device)[None]
    while True:
        token, _ = plain_step(model, ids, pos, cache, gen)
        result.target_forwards += 1
        _, done = take(result, [token], [False], stop_ids, gen.max_new_tokens, on_tokens)
        if done or cache.length >= model.config.max_positions:
            break
        ids = torch.tensor([[token]], device=device)
        pos = torch.tensor([[cache.length]], device=device)
    result.seconds = time.perf_counter() - t0
    return result


def verify(logits, tree, mask, pos, q, gen: GenConfig, generator) -> tuple:
    """Accepted node indices (root first) and the target's next token, from the tree pass.
    pos (N,): the nodes' positions; node n's choice is the target's token at pos[n] + 1."""
    if q is not None:                       # a chain sampled from the draft's q
        p = target_probs(logits, gen.temperature, gen.top_p)              # (J + 1, V)
        n, bonus = accept_chain_sampled(tree.tokens[1:].to(p.device), p, q.to(p.device), generator)
        return torch.arange(int(n) + 1), int(bonus)
    u = draws(gen, pos + 1)
    choice = next_tokens(logits, gen.temperature, gen.top_p, u).cpu()        # (N,)
    path, n, bonus = accept_tree(tree.tokens, retrieve_indices(mask, tree.depths), choice)
    return path[:int(n) + 1], int(bonus)


@torch.inference_mode()
def generate_spec(target, proposer, prompt_ids: list, gen: GenConfig, stop_ids=(),
                  on_tokens=None, on_step=None) -> Result:
    """Speculative decoding: prefill, then loop { propose, verify, accept, commit cache }.

    The generator serves only drafts that sample (and Leviathan's acceptance of them); the
    target's own draws are keyed on position (see `draws`)."""
    device = target.embed.weight.device
    generator = torch.Generator(device).manual_seed(gen.seed)
    max_nodes, ctx = proposer.max_nodes, target.config.max_positions
    cache = target.new_cache(1, check_room(target, prompt_ids, gen, max_nodes))
    # plain decoding's last token comes from the context's last position: no more here either
    limit = min(gen.max_new_tokens, ctx - len(prompt_ids) + 1)
    result, t0 = Result(), time.perf_counter()
    taps = getattr(proposer, "taps", ())       # the features an EAGLE-3 head reads
    root, hidden = plain_step(target, torch.tensor([prompt_ids], device=device),
                              torch.arange(len(prompt_ids), device=device)[None], cache, gen, taps)
    result.target_forwards = 1
    _, done = take(result, [root], [False], stop_ids, limit, on_tokens)
    proposer.start(prompt_ids, hidden[0])
    t = time.perf_counter()
    while not done and cache.length + max_nodes <= ctx:      # every node inside the context
        tree, q = proposer.propose(root, gen, generator)
        t = lap(result, "draft", t)
        mask = ancestor_mask(tree.parents, tree.depths)                   # (N, N)
        start = cache.length
        pos = positions(tree.depths, start)                                # (N,)
        seen = with_prefix(mask.to(device), start)
        t = lap(result, "tree", t)
        logits, hidden = target(tree.tokens[None].to(device), pos[None].to(device), cache, seen,
                                taps=taps)
        result.target_forwards += 1
        t = lap(result, "forward", t)
        accepted, bonus = verify(logits[0], tree, mask, pos, q, gen, generator)
        t = lap(result, "accept", t)
        cache.keep(start, accepted)                  # keep the accepted path's slots, in order
        proposer.commit(tree, accepted, hidden[0])
        t = lap(result, "commit", t)
        new = tree.tokens[accepted[1:]].tolist() + [bonus]
        result.accepted.append(len(new) - 1)
        result.drafted.append(tree.size - 1)
        result.depths.append(int(tree.depths.max()))  # not the last node's: see tree.path_first
        taken, done = take(result, new, [True] * (len(new) - 1) + [False], stop_ids, limit,
                           on_tokens)
        if on_step:                                  # --show-tree: the tokens taken
            on_step(tree, accepted[:1 + min(taken, len(new) - 1)].tolist(),
                    bonus if taken == len(new) else None)
        root = bonus                                 # the next step's tree grows from it
        t = lap(result, "other", t)
    while not done:                  # the context's last positions: too few for a whole tree
        root, _ = plain_step(target, torch.tensor([[root]], device=device),
                          torch.tensor([[cache.length]], device=device), cache, gen)
        result.target_forwards += 1
        _, done = take(result, [root], [False], stop_ids, limit, on_tokens)
    result.seconds = time.perf_counter() - t0
    return result


def lap(result: Result, phase: str, since: float) -> float:
    """Record the time since `since` as this step's `phase` -> now, the next phase's start."""
    now = time.perf_counter()
    result.phase_seconds[phase].append(now - since)
    return now


def acceptance_by_position(result: Result) -> list:
    """Fraction of steps in which draft position i (0-based along the path) was accepted, for
    every position some step drafted."""
    steps = max(len(result.accepted), 1)
    deepest = max(result.depths, default=max(result.accepted, default=0))  # peers': no depths
    return [sum(a > i for a in result.accepted) / steps for i in range(deepest)]
