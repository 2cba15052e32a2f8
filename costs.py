"""--tree-size auto's prices, learned from the steps decoding runs: the ms of a verify pass over
k tokens and of a proposal, and the tree size they make fastest. Nothing is kept between runs
(a bench keeps learning across its prompts). Sizes never change a token, only the speed.

    proposer = Priced(EagleProposer(...), Sizer(...))     # drives as the proposer it wraps
"""
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from heads import best_paths, choose_tree_size, expected_length
from proposers import SizeRule
from tree import static_tree

AUTO_MAX = 48        # largest tree --tree-size auto considers
PRIOR_SLOPE = 0.15   # until two sizes are timed: each token past the first adds this fraction
                     # of a one-token pass (a CPU's weight-only matmuls are compute-bound past a
                     # few rows); the line is fitted to the timings as soon as there are two
RESIZE = 8           # steps between two choices of the size
RECENT = 16          # timings kept per size: the latest, so that a change of load shows


@dataclass
class Prices:
    """Recent timings, by the number of tokens verified and of nodes drafted."""
    verify: dict = field(default_factory=dict)      # {k: deque of ms of a pass over k tokens}
    draft: dict = field(default_factory=dict)       # {n: deque of ms of drafting n nodes}

    def add(self, table: dict, key: int, ms: float) -> None:
        table.setdefault(key, deque(maxlen=RECENT)).append(ms)

    def line(self) -> tuple:
        """(a, b): verify ms ~ a + b k, least squares over the sizes timed (their medians)."""
        ks = sorted(self.verify)
        ms = [statistics.median(self.verify[k]) for k in ks]
        if not ks:                                # nothing timed: the prior at unit scale
            return 1.0, PRIOR_SLOPE
        if len(ks) == 1:                          # one point: the prior's slope through it
            a = ms[0] / (1 + PRIOR_SLOPE * ks[0])
            return a, PRIOR_SLOPE * a
        b = max(statistics.linear_regression(ks, ms).slope, 0.0)   # noise: bigger never cheaper
        return max(statistics.fmean(ms) - b * statistics.fmean(ks), 1e-3), b

    def verify_ms(self, k: int) -> float:
        a, b = self.line()
        return a + b * k

    def draft_ms(self, n: int) -> float:
        """Median ms of drafting at size n, else at the size timed last; 0 before any."""
        times = self.draft.get(n) or (next(reversed(self.draft.values())) if self.draft else [0.0])
        return statistics.median(times)


class Priced:
    """A proposer whose tree size `sizer` chooses from prices learned while it runs: it times
    each proposal, and the verify pass after it (from the end of one proposal to the start of
    the next: the target's pass, acceptance and commit), and lets the sizer choose again every
    RESIZE steps."""

    def __init__(self, proposer, sizer):
        self.proposer, self.sizer, self.prices = proposer, sizer, Prices()
        self.max_nodes, self.taps = proposer.max_nodes, getattr(proposer, "taps", ())
        self.steps, self.since, self.k = 0, None, 0

    def start(self, prompt_ids: list, hidden=None) -> None:
        self.since = None                         # the time between two runs is no pass
        self.proposer.start(prompt_ids, hidden)

    def propose(self, root: int, gen, generator) -> tuple:
        t = time.perf_counter()
        if self.since is not None:
            self.prices.add(self.prices.verify, self.k, 1000 * (t - self.since))
        if self.steps % RESIZE == 0:
            self.sizer.resize(self.proposer, self.prices)
            t = time.perf_counter()               # choosing is not drafting
        tree, q = self.proposer.propose(root, gen, generator)
        self.since = time.perf_counter()
        self.prices.add(self.prices.draft, self.sizer.size, 1000 * (self.since - t))
        self.k, self.steps = tree.size, self.steps + 1
        return tree, q

    def commit(self, tree, accepted, hidden=None) -> None:
        self.proposer.commit(tree, accepted, hidden)


@dataclass
class Sizer:
    """Chooses the tree size with the most expected tokens per ms: the head's measured
    accuracies give the expected tokens of each size (as Medusa's tree search does), the prices
    the ms. A static tree (eagle, medusa) is rebuilt at that size; EAGLE-2's SizeRule gets the
    prices and the rate, and sizes each step itself."""
    method: str
    accuracy: list           # [depth][rank] measured P(rank r right | path right)
    depth: int               # EAGLE-2's rounds per step (its drafting is priced per round)
    extra: int = 0           # tokens verified beside the tree every step (a lookup chain)
    rule: SizeRule | None = None   # EAGLE-2's per-step rule, which the prices are given to
    verbose: bool = False    # say each new choice on stderr
    most: int = AUTO_MAX     # the largest size (compiled: the one the verifier is padded to)
    size: int = 0            # the size chosen last (0: none yet)

    def __post_init__(self):
        self.expected = {n: expected_length(self.accuracy, n) for n in range(1, self.most + 1)}

    def choose(self, prices: Prices) -> tuple:
        """-> (size, predicted tokens per ms). While one size has been timed, another is
        chosen, so that the line through the verify timings gets its slope."""
        drafting = draft_costs(self.method, self.accuracy, prices.draft_ms(self.size or 1),
                               self.size or 1, self.expected)
        _, speed = choose_tree_size(self.expected, prices.verify_ms, drafting, self.extra)
        timed = list(prices.verify)
        if len(timed) == 1:
            speed = {n: s for n, s in speed.items() if n + 1 + self.extra != timed[0]}
        size = max(speed, key=speed.get)
        return size, speed[size] / 1000

    def resize(self, proposer, prices: Prices) -> None:
        size, rate = self.choose(prices)
        if self.rule is not None:                             # EAGLE-2: priced per step
            self.rule.verify_ms, self.rule.rate = prices.verify_ms, rate
            self.rule.round_ms = prices.draft_ms(self.size or 1) / self.depth
        elif size != self.size:
            proposer.static = static_tree(best_paths(self.accuracy, size))
        if self.verbose and size != self.size:
            a, b = prices.line()
            what = (f"per step, {rate:.3f} tokens/ms" if self.rule else
                    f"{size} nodes, {self.expected[size]:.2f} tokens expected")
            print(f"tree size auto ({self.method}): {what}; verify {a:.1f} + {b:.2f} k ms, "
                  f"drafting {prices.draft_ms(self.size or 1):.1f} ms", file=sys.stderr)
        self.size = size


def draft_costs(method: str, accuracy: list, measured_ms: float, measured_size: int, sizes) -> dict:
    """{n: ms of drafting a tree of n nodes}, from the time measured at one size. EAGLE's
    static tree feeds the head once per depth level, so its drafting grows with the depth of
    the tree chosen for n; Medusa drafts every depth in one pass and EAGLE-2 runs its rounds
    whatever it keeps, so theirs does not depend on n."""
    if method != "eagle":
        return {n: measured_ms for n in sizes}
    levels = {n: max(map(len, best_paths(accuracy, n))) for n in [*sizes, measured_size]}
    return {n: measured_ms * levels[n] / levels[measured_size] for n in sizes}


@torch.inference_mode()                 # timed as decoding runs: without autograd's bookkeeping
def forward_costs(model, sizes, batch: int = 1, prefix: int = 128, repeats: int = 5) -> dict:
    """{k: median ms} of one forward over k new tokens per row (batch rows) after a prefix
    (--verify-curve and the bench's plot).

    The sizes take turns, one forward each per round: a burst of load on this shared machine
    then slows one round of every size, not all repeats of one."""
    device = model.embed.weight.device
    cache = model.new_cache(batch, prefix + max(sizes))
    pos = torch.arange(prefix, device=device)[None]
    model((pos % model.config.vocab_size).expand(batch, prefix), pos, cache)
    times = {k: [] for k in sizes}
    for _ in range(repeats):
        for k in sizes:
            cache.length = prefix
            new = torch.arange(k, device=device)[None]
            t0 = time.perf_counter()
            model((new % model.config.vocab_size).expand(batch, k), new + prefix, cache)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[k].append(time.perf_counter() - t0)
    return {k: round(statistics.median(t) * 1000, 3) for k, t in times.items()}
