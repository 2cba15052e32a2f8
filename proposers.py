"""Proposers: they draft a tree of candidate tokens; the target verifies it in one pass.

Dimensions: N tree nodes, J drafted chain tokens, V vocab, P pending tokens, C features.
Every proposer follows the `Proposer` protocol, which decode.generate_spec drives.
"""
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from heads import projection
from model import Llama
from tree import Tree, add_chain, ancestor_mask, best_nodes, chain, grow_tree
from verification import target_probs, sample


class Proposer(Protocol):
    """What decode.generate_spec needs of a way of drafting."""
    max_nodes: int       # most tree nodes one proposal verifies, root included (cache room;
                         # also bounds how far past the root it looks: no deeper than this)

    def start(self, prompt_ids: list, hidden: torch.Tensor | None) -> None:
        """Before the first step; hidden (P, C): the target's final features of the prompt."""

    def propose(self, root: int, gen, generator) -> tuple:
        """gen: the decode.GenConfig (temperature, top-p); generator: the torch.Generator of
        drafts that sample. -> (Tree rooted at the target's last token, q): q (J, V) the
        draft's distributions when its chain was sampled from them (Leviathan's rule verifies
        it), else None."""

    def commit(self, tree: Tree, accepted: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """After verification: accepted node indices (root first); hidden (N, C) the target's
        features of all tree nodes."""


@dataclass
class SizeRule:
    """EAGLE-2's tree size chosen per step from the draft's own confidence, at prices learned on
    this machine (costs.py).

    A drafted node's probability of being accepted is about exp(its cumulative log-probability)
    (measured, an earlier EAGLE head, MT-bench: nodes scored 0.3-0.4 were accepted 30% of the time,
    0.5-0.6 53%, 0.9-1.0 96%), so verifying the n best nodes is expected to yield
    1 + p_1 + ... + p_n tokens. Each step takes the n that maximizes that minus the verify
    pass's price, rate x verify_ms(n + 1 + riders): a millisecond is worth `rate` tokens, the rate the method
    reaches (maximizing gain minus rate x cost per step is what maximizes the long-run rate,
    Dinkelbach's rule). Confident steps verify big trees, unsure ones small ones, down to the
    root alone (the cheap 1-token pass). A round is drafted only when it pays for itself: its
    nodes, predicted before it as each frontier node's probability times the head's measured
    accuracy by rank at their depth, must raise that best gain minus price by more than
    rate x round_ms."""
    most: int                # most drafted nodes a step verifies
    accuracy: list = field(default_factory=list)  # [depth][rank] P(rank r right | parent right)
    verify_ms: Callable = lambda k: 0.0   # ms of a target forward over k tokens
    rate: float = 0.0        # tokens per ms
    round_ms: float = 0.0    # ms of one drafting round

    def size(self, probs: torch.Tensor, riders: int = 0) -> int:
        """probs (M,) the drafted nodes' acceptance estimates, best first -> how many to verify.
        riders: tokens verified beside the tree (a lookup chain)."""
        return int(self.objective(probs, riders).argmax())

    def objective(self, probs: torch.Tensor, riders: int = 0) -> torch.Tensor:
        """(M,) estimates, best first -> (min(M, most) + 1,) expected tokens gained by verifying
        the best n, less their verify pass's price, for n = 0, 1, ..."""
        M = min(probs.shape[0], self.most)
        gain = torch.cat([probs.new_zeros(1), probs[:M].cumsum(0)])      # (M + 1,)
        price = self.rate * torch.tensor([self.verify_ms(n + 1 + riders) for n in range(M + 1)])
        return gain - price.to(gain.dtype)

    def keep_growing(self, drafted_logp, frontier_logp, depth: int, riders: int = 0) -> bool:
        """drafted_logp (M,) the scores of every node drafted so far, frontier_logp (F,) those
        of the nodes the next round would expand, at `depth` -> whether that round pays."""
        def best(logp):
            return float(self.objective(logp.sort(descending=True).values.exp(), riders).max())
        acc = torch.tensor(self.accuracy[min(depth, len(self.accuracy) - 1)])      # (k,)
        children = (frontier_logp[:, None] + acc.clamp(min=1e-9).log()[None]).flatten()
        return best(torch.cat([drafted_logp, children])) - best(drafted_logp) > \
            self.rate * self.round_ms


@dataclass
class DraftConfig:
    depth: int = 4           # tokens drafted along each path (--num-speculative-tokens)
    top_k: int = 1           # children per expanded node; 1 drafts a chain (--draft-top-k)
    total: int = 0           # nodes kept in a tree (with `rule`: at most); 0 means depth * top_k
    rule: SizeRule | None = None   # EAGLE-2: choose the size per step (--tree-size auto)

    def __post_init__(self):
        if self.depth < 1 or self.top_k < 1 or self.total < 0:
            raise ValueError(f"draft depth and top-k must be >= 1 and tree size >= 0, got "
                             f"depth {self.depth}, top-k {self.top_k}, size {self.total}")
        self.total = self.total or self.depth * self.top_k

    @property
    def grown_nodes(self) -> int:
        """A bound on the nodes grow_tree creates, with room to spare: it makes the root, k
        children, then k * k a round, 1 + k + (depth - 1) k^2 in all."""
        return 2 + self.depth * self.top_k * self.top_k


def node_mask(tree: Tree, frontier: torch.Tensor, node_slot: torch.Tensor, root_slot: int,
              length: int) -> torch.Tensor:
    """(F, length + F) bool: new frontier nodes see the committed prefix up to the root's slot,
    their ancestors already in the draft's cache (node_slot >= 0) and themselves."""
    F = frontier.shape[0]
    anc = ancestor_mask(tree.parents, tree.depths)[frontier]                 # (F, N)
    fed = (node_slot[:tree.size] >= 0).nonzero().squeeze(1)
    mask = torch.zeros(F, length + F, dtype=torch.bool)
    mask[:, :root_slot + 1] = True
    mask[:, node_slot[fed]] = anc[:, fed]
    mask[:, length:] = torch.eye(F, dtype=torch.bool)
    return mask


class DraftModelProposer:
    """A smaller Llama with the same tokenizer drafts a chain of `depth` tokens (Leviathan et al.):
    its own greedy tokens, or, when sampling, draws from its own distributions q, which
    Leviathan's rule then verifies.

    A parallel draft (PARD, An et al. 2025; `mask_id` given) drafts the whole chain in ONE
    forward: after the root it reads depth - 1 mask tokens at the next positions, and the
    output at the root and at each mask is its guess of the token 1, 2, ... places ahead. Each
    token is drawn from its own q without seeing the drafts before it, which Leviathan's rule
    allows (q may be any function of the context). The masks' cache entries are dropped after.

    Its KV cache holds the committed tokens; tokens the target accepted that the draft never fed
    itself (the last of a chain accepted whole; every accepted one of a parallel chain) wait in
    `pending` and go in with the next proposal."""

    def __init__(self, model: Llama, depth: int, slots: int, vocab_ids=None, proj=None,
                 mask_id: int | None = None):
        """slots: the draft cache's size (the committed tokens plus a chain). vocab_ids (R,):
        greedy drafts choose among these target ids only, projecting onto R of the lm_head's V
        rows (on a small draft the projection is most of a forward's cost) with `proj` (a module
        C -> R; default heads.projection of the draft); None: all V. A sampled chain always
        draws from the whole distribution. mask_id: the token a parallel draft reads in place
        of the tokens it drafts (None: a chain, a forward a token)."""
        if depth < 1:
            raise ValueError(f"a draft chain needs at least 1 token, got {depth}")
        self.model, self.depth, self.slots, self.mask_id = model, depth, slots, mask_id
        self.fed = 1 if mask_id is not None else depth   # chain tokens a proposal leaves fed
        self.device = model.embed.weight.device
        self.max_nodes = depth + 1                   # verified nodes per step, root included
        self.vocab_ids = None if vocab_ids is None else vocab_ids.cpu()
        self.proj = (None if vocab_ids is None else                          # C -> R
                     proj if proj is not None else projection(model, vocab_ids))
        self.cache = None            # made by start: the committed tokens' keys and values
        self.pending = []            # accepted tokens the draft has not fed itself yet
        self.base = 0                # cache length when the proposal began

    def start(self, prompt_ids: list, hidden=None) -> None:
        self.cache = self.model.new_cache(1, self.slots)
        self.pending = list(prompt_ids)

    def next_logits(self, ids: list, full: bool, rows: int = 1) -> torch.Tensor:
        """Feed ids causally into the draft's cache -> the last `rows` ones' (rows, V) logits,
        or (rows, R) over the reduced vocabulary where there is one, unless full."""
        start = self.cache.length
        tokens = torch.tensor([ids], device=self.device)                       # (1, T)
        pos = torch.arange(start, start + len(ids), device=self.device)[None]
        _, hidden = self.model(tokens, pos, self.cache, project=False)         # (1, T, C)
        head = self.model.lm_head if self.vocab_ids is None or full else self.proj
        return head(hidden[0, -rows:])

    def propose(self, root: int, gen, generator) -> tuple:
        sampled = gen.temperature > 0
        self.base = self.cache.length
        ids, tokens, qs = self.pending + [root], [], []
        if self.mask_id is not None:                 # one forward: the root, then the masks
            logits = self.next_logits(ids + [self.mask_id] * (self.depth - 1), sampled,
                                      self.depth)                              # (depth, V or R)
            self.cache.length = self.base + len(ids)           # the masks' entries dropped
        for j in range(self.depth):                  # a chain feeds all but the last token
            if self.mask_id is None:
                logits = self.next_logits(ids, full=sampled)                   # (1, V or R)
            row = logits[j if self.mask_id is not None else 0]
            if sampled:
                qs.append(target_probs(row, gen.temperature, gen.top_p))           # (V,)
                token = int(sample(qs[-1], generator))
            else:
                best = int(row.argmax())
                token = best if self.vocab_ids is None else int(self.vocab_ids[best])
            tokens.append(token)
            ids = [token]
        return chain(root, tokens), torch.stack(qs) if sampled else None      # q (J, V)

    def commit(self, tree: Tree, accepted: torch.Tensor, hidden=None) -> None:
        """Keep the pending tokens, the root and the accepted drafts the draft fed; those it did
        not feed (a chain's last, a parallel chain's all) wait for the next proposal."""
        fed = min(len(accepted), self.fed)           # the root and up to fed - 1 drafts
        self.cache.keep(self.base, torch.arange(len(self.pending) + fed))
        self.pending = tree.tokens[accepted[fed:].cpu()].tolist()


class PromptLookupProposer:
    """Prompt lookup: propose what followed the latest earlier occurrence of the last n tokens.

    No weights and no model: strong where the output copies its input (summaries, retrieval,
    code edits). The chain is deterministic, so sampling verifies it with the tree rule."""

    def __init__(self, depth: int = 6, max_ngram: int = 3):
        """A match of n tokens drafts depth * n / max_ngram of them: a chain after a 3-token
        match is accepted deeper than one after a single matching token, which is more often a
        coincidence (chain lengths measured: docs/RESULTS.md)."""
        if depth < 1 or max_ngram < 1:
            raise ValueError(f"prompt lookup needs depth >= 1 and n >= 1, got {depth}, {max_ngram}")
        self.depth, self.max_ngram = depth, max_ngram
        self.max_nodes = depth + 1
        self.context = torch.zeros(0, dtype=torch.long)   # the committed tokens

    def start(self, prompt_ids: list, hidden=None) -> None:
        self.context = torch.tensor(prompt_ids, dtype=torch.long)

    def propose(self, root: int, gen, generator) -> tuple:
        return chain(root, self.continuation(root)[0]), None

    def continuation(self, root: int) -> tuple:
        """-> (the drafted tokens (up to depth) after the committed context plus the root,
        how many tokens the match that found them spans: 0 for none, at most max_ngram)."""
        return self.match(torch.cat([self.context, torch.tensor([root])]))

    def match(self, ctx: torch.Tensor) -> tuple:
        """-> (the continuation (up to depth tokens) of the latest earlier match of ctx's last n
        tokens, longest n first; that n, 0 when nothing matched)."""
        for n in range(min(self.max_ngram, ctx.shape[0] - 1), 0, -1):
            windows = ctx[:-1].unfold(0, n, 1)                    # (len - n, n), all but the tail
            hits = (windows == ctx[-n:]).all(1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return ctx[start:start + self.depth * n // self.max_ngram], n
        return ctx[:0], 0

    def commit(self, tree: Tree, accepted: torch.Tensor, hidden=None) -> None:
        self.context = torch.cat([self.context, tree.tokens[accepted.cpu()]])


class EagleProposer:
    """EAGLE / EAGLE-2: the head drafts from the target's features (Li et al. 2024).

    The head's cache holds one entry per committed position t: (target feature at t, token at
    t + 1). Tree nodes are fed with the head's own predicted feature of their parent instead, and
    dropped after verification: the accepted ones come back with the target's true features.
    EAGLE-2 (static=None) grows the tree with tree.grow_tree; EAGLE uses a fixed StaticTree.

    For a prompt a b c whose next token the target chose to be r (the root): start keeps the
    target's features f_a f_b f_c and the tokens b c; propose feeds (f_a, b) (f_b, c) (f_c, r),
    the last at `root_slot`, then the tree's nodes after it; commit cuts the cache back to
    root_slot + 1 and keeps, for accepted drafts x y, the target's f_r f_x f_y and the tokens
    x y, so that the next propose, with the target's new token s as its root, feeds (f_r, x)
    (f_x, y) (f_y, s)."""

    def __init__(self, target: Llama, head, config: DraftConfig, slots: int, static=None,
                 proj=None, mask_id: int | None = None):
        """proj: the projection onto the draft vocabulary, a module C -> R (default
        heads.projection; spec.py may pass a quantized one). mask_id: a block head's mask token:
        it drafts a chain of config.depth tokens in one forward (`block`)."""
        self.target, self.head, self.config, self.static = target, head, config, static
        self.slots, self.device, self.mask_id = slots, target.embed.weight.device, mask_id
        self.proj = proj if proj is not None else projection(target, head.vocab_ids)
        self.vocab_ids = head.vocab_ids.cpu()
        self.taps = getattr(head, "taps", ())       # the target's features it reads (EAGLE-3)
        # EAGLE-2 feeds `depth` rounds before it keeps `total` nodes: room for the deeper
        self.max_nodes = (static.parents.shape[0] if static is not None else
                          max(config.total, config.depth) + 1)
        self.cache = None                       # made by start: the head's own KV cache
        self.pending_feats, self.pending_tokens = None, []   # accepted, not yet fed to the head
        self.root_slot = 0
        self.node_out = self.node_slot = None   # per tree node: predicted feature, cache slot

    def start(self, prompt_ids: list, hidden=None) -> None:
        self.cache = self.head.new_cache(self.slots)
        self.pending_feats, self.pending_tokens = hidden, list(prompt_ids[1:])

    def logp(self, feats: torch.Tensor) -> torch.Tensor:
        """(F, C) predicted features -> (F, R) log-probabilities over the draft vocabulary."""
        return torch.log_softmax(self.proj(feats).float(), dim=-1)

    def feed(self, feats, tokens, positions, mask=None) -> torch.Tensor:
        """(T, C) features, (T,) tokens and positions -> (T, C) predicted next features."""
        embeds = self.target.embed(tokens.to(self.device))[None]            # (1, T, C)
        return self.head(feats[None], embeds, positions[None].to(self.device), self.cache, mask)[0]

    def propose(self, root: int, gen, generator, riders: int = 0,
                depth: int | None = None) -> tuple:
        """riders: tokens verified beside this tree (a lookup chain), priced by config.rule;
        depth: drafting rounds for this step, at most config.depth, which the node buffers
        are sized for (None: config.depth)."""
        start, P = self.cache.length, self.pending_feats.shape[0]
        tokens = torch.tensor(self.pending_tokens + [root])                  # (P,)
        if self.mask_id is not None:
            return self.block(root, tokens, start), None
        out = self.feed(self.pending_feats, tokens, torch.arange(start, start + P))   # (P, C)
        # the last entry fed: (feature before the root, root); its output predicts the root's
        self.root_slot = self.cache.length - 1
        n = self.config.grown_nodes if self.static is None else self.static.parents.shape[0]
        self.node_out = out.new_zeros(n, out.shape[1])                      # (nodes, C)
        self.node_out[0] = out[-1]
        self.node_slot = torch.full((n,), -1, dtype=torch.long)
        self.node_slot[0] = self.root_slot
        if self.static is not None:
            return self.static_tree(root), None
        rule = self.config.rule
        depth = self.config.depth if depth is None else min(depth, self.config.depth)
        grows = rule and (lambda drafted, frontier, d: rule.keep_growing(drafted, frontier, d,
                                                                          riders))
        tree = grow_tree(self.expand, root, depth, self.config.top_k, self.config.total,
                         self.vocab_ids, grows)
        if rule is not None:
            n = rule.size(tree.scores[1:].sort(descending=True).values.exp(), riders)
            tree = best_nodes(tree, n)
        return tree, None

    def block(self, root: int, tokens: torch.Tensor, start: int) -> Tree:
        """A block head (DFlash's idea on EAGLE-3's layer): the pending rows, then depth - 1
        masks, each reading the last row's taps and the mask token, in ONE forward; the root's
        output and each mask's guess the tokens 1, 2, ... places after the root, none seeing
        the drafts before it. The masks' entries are dropped. With config.rule (--tree-size
        auto) the chain is cut per step where its places' probabilities stop paying their rows
        (EAGLE-2's rule on the chain: a place right only if those before it are)."""
        m = self.config.depth - 1
        feats = torch.cat([self.pending_feats, self.pending_feats[-1:].expand(m, -1)])  # (P+m, 3C)
        tokens = torch.cat([tokens, torch.full((m,), self.mask_id)])                  # (P + m,)
        out = self.feed(feats, tokens, torch.arange(start, start + len(tokens)))      # (P+m, C)
        self.root_slot = start + len(tokens) - m - 1
        self.cache.length = self.root_slot + 1
        logp, best = self.logp(out[-m - 1:]).max(-1)                             # (depth,)
        rule, drafts = self.config.rule, self.vocab_ids[best.cpu()].tolist()
        return chain(root, drafts[:rule.size(logp.cumsum(0).exp())] if rule else drafts)

    def expand(self, frontier: torch.Tensor, tree: Tree) -> torch.Tensor:
        """Feed the frontier nodes (each seeing its ancestors); (F, R) log-probs of their children."""
        new = frontier[self.node_slot[frontier] < 0]          # all but the root, fed already
        if new.numel():
            mask = node_mask(tree, new, self.node_slot, self.root_slot, self.cache.length)
            pos = self.root_slot + tree.depths[new]
            self.node_slot[new] = torch.arange(self.cache.length, self.cache.length + len(new))
            self.node_out[new] = self.feed(self.node_out[tree.parents[new]], tree.tokens[new],
                                           pos, mask.to(self.device))
        return self.logp(self.node_out[frontier])

    def static_tree(self, root: int) -> Tree:
        """Fill a StaticTree depth by depth: node = its parent's rank-th most likely child."""
        st = self.static
        tokens = torch.full_like(st.parents, root)              # filled in place, level by level
        tree = Tree(tokens, st.parents, st.depths, torch.zeros(len(tokens)))
        for d in range(int(st.depths.max())):
            children = (st.depths == d + 1).nonzero().squeeze(1)
            frontier = st.parents[children].unique()                         # sorted
            top = self.expand(frontier, tree).topk(int(st.ranks.max()) + 1).indices.cpu()
            row = torch.searchsorted(frontier, st.parents[children])
            tokens[children] = self.vocab_ids[top[row, st.ranks[children]]]
        return tree

    def commit(self, tree: Tree, accepted: torch.Tensor, hidden=None) -> None:
        self.cache.length = self.root_slot + 1
        self.pending_feats = hidden[accepted.to(hidden.device)]              # (n, C)
        self.pending_tokens = tree.tokens[accepted[1:].cpu()].tolist()


class MedusaProposer:
    """Medusa: M heads read the target's feature of the last accepted token at once; the static
    tree's node at depth d and rank r is head d - 1's r-th most likely token (Cai et al. 2024)."""

    def __init__(self, target: Llama, head, static, proj=None, compile: bool = False):
        """proj: the shared projection onto the draft vocabulary, a module C -> R (default
        heads.projection); compile: the heads and it as one graph (of one shape: --compile)."""
        self.head, self.static = head, static
        self.proj = proj if proj is not None else projection(target, head.vocab_ids)
        self.draft = torch.nn.Sequential(head, self.proj)                      # (C,) -> (M, R)
        if compile:          # rounding every intermediate as eager does (see kernel.Compiled)
            self.draft = torch.compile(self.draft, fullgraph=True, dynamic=False,
                                       options={"emulate_precision_casts": True})
        self.vocab_ids = head.vocab_ids.cpu()
        self.max_nodes = static.parents.shape[0]
        if int(static.depths.max()) > len(head.blocks):
            raise ValueError(f"tree depth {int(static.depths.max())} > {len(head.blocks)} heads")
        self.feature = None                           # (C,) the last accepted token's feature

    def start(self, prompt_ids: list, hidden=None) -> None:
        self.feature = hidden[-1]                                           # (C,)

    def propose(self, root: int, gen, generator) -> tuple:
        st = self.static
        logits = self.draft(self.feature)                                   # (M, R)
        top = logits.topk(int(st.ranks.max()) + 1).indices.cpu()            # (M, ranks)
        tokens = self.vocab_ids[top[(st.depths - 1).clamp(min=0), st.ranks]]
        tokens[0] = root
        return Tree(tokens, st.parents, st.depths, torch.zeros(len(tokens))), None

    def commit(self, tree: Tree, accepted: torch.Tensor, hidden=None) -> None:
        self.feature = hidden[accepted[-1].to(hidden.device)]


class LookupEagleProposer:
    """EAGLE-2's tree plus prompt lookup's chain as one more branch from the root, checked by the
    same verify pass: lookup is strong exactly where the head is weak (copying from the input),
    and a few more tokens cost little to verify."""

    # After a chain that matched all lookup.max_ngram tokens the head drafts one round only:
    # such a chain's first token is accepted in 75-80% of MT-bench's steps, while the head's
    # nodes off it add ~0.4 tokens a step; one round still offers the root's alternatives for
    # when the chain is wrong (docs/TRAINING.md).
    FULL_MATCH_ROUNDS = 1

    def __init__(self, eagle: EagleProposer, lookup: PromptLookupProposer):
        self.eagle, self.lookup, self.taps = eagle, lookup, eagle.taps
        self.max_nodes = eagle.max_nodes + lookup.depth

    def start(self, prompt_ids: list, hidden=None) -> None:
        self.eagle.start(prompt_ids, hidden)
        self.lookup.start(prompt_ids)

    def propose(self, root: int, gen, generator) -> tuple:
        lookup, n = self.lookup.continuation(root)
        full = n == self.lookup.max_ngram
        tree, _ = self.eagle.propose(root, gen, generator, riders=len(lookup),
                                     depth=self.FULL_MATCH_ROUNDS if full else None)
        return add_chain(tree, lookup.tolist()), None

    def commit(self, tree: Tree, accepted: torch.Tensor, hidden=None) -> None:
        self.eagle.commit(tree, accepted, hidden)             # both read only the accepted path
        self.lookup.commit(tree, accepted, hidden)
