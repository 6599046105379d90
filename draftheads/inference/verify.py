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
    return int(torch.multinomial(p, 1, generator=gen).item())


def verify_sampled(tree: Tree, probs: torch.Tensor, gen: torch.Generator | None = None) -> VerifyResult:
    """``probs`` [N, V]: the target's distribution after each node (already temperature/top-p'd)."""
    kids = tree.children()
    cur, accepted, tokens = 0, [], []
    while True:
        children = kids[cur]
        q_known = tree.draft_probs is not None and any(tree.draft_probs[c] is not None for c in children)
        if not q_known:
            x = _sample(probs[cur], gen)
            nxt = next((c for c in children if tree.tokens[c] == x), None)
        else:
            p = probs[cur].clone()
            nxt = None
            for c in children:
                q = tree.draft_probs[c]
                x = tree.tokens[c]
                u = torch.rand((), generator=gen, dtype=torch.float64).item()
                if q[x] > 0 and u < min(1.0, float(p[x]) / float(q[x])):
                    nxt = c
                    break
                resid = torch.clamp(p - q, min=0)
                total = resid.sum()
                p = resid / total if total > 0 else p
            if nxt is None:
                x = _sample(p, gen)
        tokens.append(x if nxt is None else tree.tokens[nxt])
        if nxt is None:
            return VerifyResult(accepted, tokens)
        accepted.append(nxt)
        cur = nxt
