"""Draft trees as plain data, and the small pure functions that derive masks and paths from them.

Dimensions: N tree nodes (node 0 is the root), L leaves, M max depth + 1.

The root is the last token the target produced: it is not in the KV cache yet, so the verify pass
feeds it together with the drafted nodes. A node's children are candidates for the token after it.
"""
from dataclasses import dataclass

import torch


@dataclass
class Tree:
    tokens: torch.Tensor    # (N,) long, token of each node; node 0 is the root
    parents: torch.Tensor   # (N,) long, parent index (< own index), -1 for the root
    depths: torch.Tensor    # (N,) long, 0 for the root
    scores: torch.Tensor    # (N,) float, the draft's cumulative log-probability; 0 at the root
                            # and where the draft gives none (chains, static trees)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


def make_tree(tokens, parents, scores=None) -> Tree:
    """A tree from tokens and parent indices (parents before children); depths are derived."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    parents = torch.as_tensor(parents, dtype=torch.long, device=tokens.device)
    depths = torch.zeros_like(parents)
    for n in range(1, parents.shape[0]):          # a parent comes before its children
        depths[n] = depths[parents[n]] + 1
    return Tree(tokens, parents, depths,
                torch.zeros(tokens.shape[0], device=tokens.device) if scores is None else scores)


def chain(root: int, tokens) -> Tree:
    """The tree of a chain draft: root -> tokens[0] -> tokens[1] -> ..."""
    tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    n = tokens.shape[0]
    return Tree(torch.cat([torch.tensor([root]), tokens]), torch.arange(-1, n),
                torch.arange(0, n + 1), torch.zeros(n + 1))


def ancestor_mask(parents: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """(N,) parents -> (N, N) bool: row n is True at n and at each ancestor of n.

    One vectorized step per depth level, walking every node's ancestor chain at once."""
    N = parents.shape[0]
    mask = torch.eye(N, dtype=torch.bool, device=parents.device)
    rows = torch.arange(N, device=parents.device)
    anc = parents.clone()
    for _ in range(int(depths.max()) if N > 1 else 0):
        has = anc >= 0
        mask[rows[has], anc[has]] = True
        anc = torch.where(has, parents[anc.clamp(min=0)], anc)
    return mask


def positions(depths: torch.Tensor, start: int) -> torch.Tensor:
    """Absolute positions of the nodes: a node sits `depth` places after the root at `start`."""
    return depths + start


def retrieve_indices(mask: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """(L, M) long: each root-to-leaf path as node indices by depth, padded with -1."""
    is_leaf = mask.sum(0) == 1                      # a leaf is nobody's ancestor but its own
    leaves = is_leaf.nonzero().squeeze(1)
    M = int(depths.max()) + 1
    out = torch.full((leaves.shape[0], M), -1, dtype=torch.long, device=mask.device)
    leaf_row, node = mask[leaves].nonzero(as_tuple=True)   # node is on the path to leaves[leaf_row]
    out[leaf_row, depths[node]] = node
    return out


@dataclass
class StaticTree:
    """A tree shape without tokens, from a Medusa-style path list.

    Each node is reached by the child rank it takes at each depth: [[0], [0, 0], [1]] is the root's
    best child, that child's best child, and the root's second child."""
    parents: torch.Tensor   # (N,) long
    depths: torch.Tensor    # (N,) long
    ranks: torch.Tensor     # (N,) long, the node's rank among its parent's candidates (0 = root)


def static_tree(paths: list) -> StaticTree:
    """Build a static tree from a path list; missing prefixes of a path are added."""
    nodes = {()} | {tuple(p[:i]) for p in paths for i in range(1, len(p) + 1)}
    order = sorted(nodes, key=lambda p: (len(p), p))   # parents before children
    index = {p: i for i, p in enumerate(order)}
    parents = torch.tensor([index[p[:-1]] if p else -1 for p in order])
    depths = torch.tensor([len(p) for p in order])
    ranks = torch.tensor([p[-1] if p else 0 for p in order])
    return StaticTree(parents, depths, ranks)


def grow_tree(expand, root: int, depth: int, top_k: int, total: int, vocab_ids=None,
              keep_growing=None) -> Tree:
    """EAGLE-2's dynamic draft tree (Li et al. 2024, arXiv 2406.16858, Sec. 4).

    For `depth` rounds, expand the `top_k` nodes of the newest layer with the highest cumulative
    log-probability, each by its `top_k` most likely children (one batched `expand` per round);
    then keep the `total` best nodes of everything drafted, a connected subtree (`best_nodes`).

    expand(frontier (F,) node indices, tree so far) -> (F, V) log-probabilities of their children,
    or (F, R) over a reduced draft vocabulary whose target ids are vocab_ids (R,).
    keep_growing(scores of all drafted nodes (M,), of the next frontier (F,), the frontier's
    depth) -> bool, asked before every round after the first: False stops drafting early (see
    proposers.SizeRule); scores are cumulative log-probabilities.
    Returns the kept Tree (parents before children)."""
    tree = Tree(torch.tensor([root]), torch.tensor([-1]), torch.tensor([0]), torch.zeros(1))
    frontier = torch.tensor([0])
    for step in range(depth):
        if step and keep_growing and not keep_growing(tree.scores[1:], tree.scores[frontier], step):
            break
        logp = expand(frontier, tree)                                  # (F, V)
        top_logp, top_tok = (t.cpu() for t in logp.float().topk(top_k, dim=-1))   # (F, k)
        # the tree is CPU data; a draft on a GPU hands back device tensors, and vocab_ids
        # (CPU) cannot be indexed by those
        top_tok = top_tok if vocab_ids is None else vocab_ids[top_tok]
        cand = (tree.scores[frontier, None] + top_logp).flatten()      # (F * k,)
        first = tree.size
        tree = Tree(torch.cat([tree.tokens, top_tok.flatten()]),
                    torch.cat([tree.parents, frontier.repeat_interleave(top_k)]),
                    torch.cat([tree.depths, tree.depths[frontier].repeat_interleave(top_k) + 1]),
                    torch.cat([tree.scores, cand]))
        frontier = first + cand.topk(min(top_k, cand.numel())).indices.sort().values
    return best_nodes(tree, total)


def best_nodes(tree: Tree, n: int) -> Tree:
    """The root and the n nodes with the highest scores, as a Tree.

    A stable sort puts a parent before a child of equal score, and a child never scores above
    its parent (scores are cumulative log-probabilities), so the kept nodes form a subtree."""
    order = torch.sort(tree.scores[1:], descending=True, stable=True).indices[:n] + 1
    kept = torch.cat([torch.tensor([0]), order.sort().values])       # (n + 1,) parents first
    return subtree(tree, kept)


def subtree(tree: Tree, kept: torch.Tensor) -> Tree:
    """The nodes `kept` (closed under parents, each after its parent) of a tree, re-indexed."""
    new_index = torch.full((tree.size,), -1, dtype=torch.long)
    new_index[kept] = torch.arange(kept.shape[0])
    parents = tree.parents[kept]
    parents = torch.where(parents >= 0, new_index[parents.clamp(min=0)], parents)
    return Tree(tree.tokens[kept], parents, tree.depths[kept], tree.scores[kept])


def add_chain(tree: Tree, tokens: list) -> Tree:
    """The tree plus a chain of tokens from its root, sharing the prefix the tree already has
    (a trie insert), the chain's nodes first (see `path_first`). No node gets two children
    with the same token: the sampling rule draws one token per node and descends into THE
    child equal to it."""
    toks, parents = tree.tokens.tolist(), tree.parents.tolist()
    node, i = 0, 0                          # down the prefix of the chain the tree already has
    while i < len(tokens):
        child = next((c for c in range(len(toks)) if parents[c] == node and toks[c] == tokens[i]),
                     None)
        if child is None:
            break
        node, i = child, i + 1
    if i < len(tokens):
        n = tree.size
        tree = make_tree(toks + list(tokens[i:]),
                         parents + [node] + list(range(n, n + len(tokens) - i - 1)),
                         torch.cat([tree.scores, tree.scores.new_zeros(len(tokens) - i)]))
        node = tree.size - 1                             # the chain's last node
    return path_first(tree, node)


def path_first(tree: Tree, node: int) -> Tree:
    """The same tree with the path root -> node as its first nodes, in depth order, the others
    after in their order (so the nodes are no longer in depth order). Not needed for correctness,
    a saving of the exact attention: the verify pass lays nodes out in this order, and a node
    whose ancestors are exactly the nodes before it reads them in place, where the others' are
    gathered for them (kernel.tail_slots)."""
    path = []
    while node > 0:
        path.append(node)
        node = int(tree.parents[node])
    order = [0] + path[::-1] + [n for n in range(1, tree.size) if n not in path]
    return subtree(tree, torch.tensor(order))


def render_tree(tree: Tree, label, accepted, bonus: int | None) -> str:
    """The tree as indented text: label(token id) -> str, probability exp(score) where scored,
    `*` on the accepted path, and the target's own next token (bonus; None where decoding
    stopped before it) after the last accepted node."""
    on_path = set(accepted)
    children = {}
    for i in range(1, tree.size):
        children.setdefault(int(tree.parents[i]), []).append(i)
    lines = [f"{label(int(tree.tokens[0]))!r} (root)"]

    def walk(node, prefix):
        kids = children.get(node, [])
        for n, c in enumerate(kids):
            last = n == len(kids) - 1
            p = f" {float(tree.scores[c].exp()):.2f}" if float(tree.scores[c]) != 0 else ""
            mark = " *" if c in on_path else ""
            tail = (f"  -> {label(bonus)!r}" if c == accepted[-1] and len(accepted) > 1
                    and bonus is not None else "")
            lines.append(f"{prefix}{'`-- ' if last else '|-- '}{label(int(tree.tokens[c]))!r}"
                         f"{p}{mark}{tail}")
            walk(c, prefix + ("    " if last else "|   "))

    walk(0, "")
    if tree.size == 1:           # EAGLE-2's per-step size: the draft was too unsure to verify
        lines.append(f"nothing drafted  -> {label(bonus)!r}")
    elif len(accepted) == 1:
        lines.append(f"nothing accepted  -> {label(bonus)!r}")
    return "\n".join(lines)
