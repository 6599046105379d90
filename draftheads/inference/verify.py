"""Verification of a candidate tree against the target's outputs at every node.

* Greedy: follow the child equal to the target's argmax at each node, as deep as it goes; the
  target's argmax at the last accepted node is the bonus token. Output is token-identical to plain
  greedy decoding.
* Sampling, deterministic drafts (no q): at each node draw x ~ p_target(node); if a child carries x,
  accept it and continue, else emit x and stop. Every emitted token is a draw from the target's
  distribution, so the output distribution is exactly the target's.
* Sampling, drafts with known q (children drawn independently from q): recursive rejection sampling
  over the siblings -- accept child i with min(1, p'(x_i)/q_i(x_i)); on rejection
  p' <- norm(max(p' - q_i, 0)) and try the next sibling; if all are rejected, emit x ~ p'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftheads.inference.tree import Tree


@dataclass
class VerifyResult:
    accepted: list[int]  # accepted drafted nodes, by tree index, root excluded, in depth order
    tokens: list[int]  # emitted tokens: the accepted drafts followed by the bonus token

    @property
    def path(self) -> list[int]:
        """Root plus accepted nodes (what the KV cache keeps)."""
        return [0, *self.accepted]


def verify_greedy(tree: Tree, argmax: list[int]) -> VerifyResult:
    """``argmax[i]`` = target's greedy token after node i."""
    kids = tree.children()
    cur, accepted, tokens = 0, [], []
    while True:
        want = argmax[cur]
        nxt = next((c for c in kids[cur] if tree.tokens[c] == want), None)
        tokens.append(want)
        if nxt is None:
            return VerifyResult(accepted, tokens)
        accepted.append(nxt)
        cur = nxt


def _sample(p: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=gen))


def inverse_cdf(p: torch.Tensor, u: float) -> int:
    """The token whose cumulative probability interval holds ``u`` (u in [0, 1))."""
    c = torch.cumsum(p.double(), 0)
    return int(min(int(torch.searchsorted(c, torch.tensor(u * float(c[-1]), dtype=torch.float64), right=True)),
                   p.numel() - 1))


def verify_sampled_uniforms(tree: Tree, probs: torch.Tensor, uniforms: list[float]) -> VerifyResult:
    """Deterministic-draft sampling walk with given uniforms (``uniforms[d]`` draws at depth d) --
    the same walk as :func:`verify_sampled`, in the form the Triton kernel reproduces."""
    kids = tree.children()
    cur, accepted, tokens = 0, [], []
    for u in uniforms:
        x = inverse_cdf(probs[cur], u)
        tokens.append(x)
        nxt = next((c for c in kids[cur] if tree.tokens[c] == x), None)
        if nxt is None:
            return VerifyResult(accepted, tokens)
        accepted.append(nxt)
        cur = nxt
    raise ValueError(f"{len(uniforms)} uniforms cannot cover a walk through a tree of depth {tree.depth}")


def verify_sampled(tree: Tree, probs: torch.Tensor, gen: torch.Generator | None = None) -> VerifyResult:
    """``probs`` [N, V]: the target's distribution after each node (already temperature/top-p'd)."""
    kids = tree.children()
    qs = tree.draft_probs
    cur, accepted, tokens = 0, [], []
    while True:
        children = kids[cur]
        nxt = None
        if qs is None or all(qs[c] is None for c in children):
            x = _sample(probs[cur], gen)
            for c in children:
                if tree.tokens[c] == x:
                    nxt = c
                    break
        else:
            p = probs[cur]
            for c in children:
                q, x = qs[c], tree.tokens[c]
                px, qx = float(p[x]), float(q[x])
                u = float(torch.rand((), generator=gen, dtype=torch.float64))
                if qx > 0 and u * qx < px:  # u < min(1, px / qx)
                    nxt = c
                    break
                resid = torch.clamp(p - q, min=0)
                total = float(resid.sum())
                if total > 0:
                    p = resid / total
            if nxt is None:
                x = _sample(p, gen)
        if nxt is None:
            tokens.append(x)
            return VerifyResult(accepted, tokens)
        tokens.append(tree.tokens[nxt])
        accepted.append(nxt)
        cur = nxt
