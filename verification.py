"""The verification rules, in plain torch: which drafted tokens the target keeps.

Dimensions: N tree nodes, L leaves, M max depth + 1, J drafted chain tokens, V vocab; "..." is
any number of leading batch dimensions (the statistical tests verify 1e5 drafts in one call).

Names for probabilities, used everywhere in this project:
  p  the TARGET's distribution (after temperature and top-p), the one the output must follow;
  q  the DRAFT's distribution, from which a sampled draft token was drawn.
"""
import torch


def target_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature and top-p."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)   # ties: one order
    outside = sorted_p.cumsum(-1) - sorted_p >= top_p      # mass before it already reaches top_p
    sorted_p = sorted_p.masked_fill(outside, 0.0)
    probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return probs / probs.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """(..., V) probabilities -> (...) long, one draw per row (from the generator's stream)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) keyed on (seed, position): splitmix64 of the pair, top 53 bits.

    Why keyed, not drawn from a stream: the target's token at position t is then the same
    function of (p, seed, t) in plain decoding and at every tree node that predicts position
    t, so with exact kernels every method with deterministic drafts samples plain decoding's
    very text, whatever the tree shapes and however many draws went before."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) % 2**64
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x = ((x ^ (x >> shift)) * mult) % 2**64
    x ^= x >> 31
    return (x >> 11) / 2**53


def sample_at(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(..., V) probabilities, (...) uniforms -> (...) long: the inverse CDF of each row at u.

    A token of probability 0 is never drawn: the CDF is flat across it."""
    cdf = probs.double().cumsum(-1)                                     # (..., V)
    x = (u.to(cdf) * cdf[..., -1]).unsqueeze(-1)                         # (..., 1)
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def next_tokens(logits, temperature: float, top_p: float, u=None) -> torch.Tensor:
    """(..., V) -> (...) the target's choice: argmax at temperature 0, else the draw from p at
    the uniforms u (...) (see `uniform`)."""
    if temperature == 0:
        # Widened to float32 (never narrowed: float64 stays): the same values and ties, but
        # torch's CPU argmax over bf16 is several times slower than casting first.
        return logits.to(torch.promote_types(logits.dtype, torch.float32)).argmax(-1)
    return sample_at(target_probs(logits, temperature, top_p), u)


def accept_tree(tokens, retrieve, choice):
    """Walk the tree along the target's own choices.

    tokens (N,) drafted tokens, retrieve (L, M) root-to-leaf paths padded with -1, choice (..., N)
    the token the target picks after each node (argmax, or one sample from p at that node).
    Returns path (..., M) node indices of the best path, n (...) how many drafted nodes on it are
    accepted, and bonus (...) the target's token after the last accepted node.

    Greedy: this is the longest path that equals the target's argmax. Sampling, for drafts whose
    children are distinct deterministic tokens (top-k, as EAGLE-2 and Medusa propose): visiting the
    children in order, accepting child x with probability p(x), else zeroing p(x), renormalizing
    and going on, emits each token with probability exactly p(x) (a child x after rejections of
    c1..cj: prod(1 - p(ci)/(1 - ...)) * p(x)/(1 - sum p(ci)) = p(x)). That is the same law as
    drawing one y from p and descending into the child whose token is y, if any; so one sample per
    node, drawn in one vectorized call, decides the whole tree."""
    valid = retrieve >= 0
    nodes = retrieve.clamp(min=0)                                  # (L, M)
    parent_choice = choice[..., nodes[:, :-1]]                     # (..., L, M-1)
    match = (tokens[nodes[:, 1:]] == parent_choice) & valid[:, 1:]
    accepted = match.long().cumprod(-1).sum(-1)                    # (..., L)
    n, best = accepted.max(-1)                                     # (...), (...)
    path = retrieve[best]                                          # (..., M)
    last = path.gather(-1, n.unsqueeze(-1))                        # (..., 1)
    bonus = choice.gather(-1, last).squeeze(-1)
    return path, n, bonus


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)): what to sample from after a draft token drawn from q is rejected."""
    r = (p - q).clamp(min=0)
    total = r.sum(-1, keepdim=True)
    # p == q exactly leaves nothing; rejection then has probability 0, so any row is fine.
    return torch.where(total > 0, r / total.clamp(min=1e-30), p)


def accept_chain_sampled(draft, p, q, generator, residual_fn=residual):
    """Leviathan et al. 2023, Alg. 1, for a chain drawn from the draft's q.

    draft (..., J) tokens, p (..., J + 1, V) target probabilities at the root and after each draft
    token, q (..., J, V) the draft's probabilities each token was drawn from.
    Accept token i with probability min(1, p(x)/q(x)); at the first rejection sample from
    norm(max(p - q, 0)); if all J are accepted, the bonus comes from p after the last.
    residual_fn: the residual's formula, a parameter so that a test can pass a wrong one (the
    negative control) whatever the body computes.
    Returns n (...) accepted tokens and bonus (...)."""
    J = draft.shape[-1]
    px = p[..., :J, :].gather(-1, draft.unsqueeze(-1)).squeeze(-1)   # (..., J)
    qx = q.gather(-1, draft.unsqueeze(-1)).squeeze(-1)               # (..., J)
    u = torch.rand(px.shape, generator=generator, device=px.device)
    ok = u * qx < px                                                 # u < p/q without dividing
    n = ok.long().cumprod(-1).sum(-1)                                # (...)
    fallback = torch.cat([residual_fn(p[..., :J, :], q), p[..., J:, :]], dim=-2)  # (..., J+1, V)
    row = fallback.gather(-2, n[..., None, None].expand(*n.shape, 1, p.shape[-1])).squeeze(-2)
    return n, sample(row, generator)
