"""Candidate trees as data, and pure functions over them.

A tree is a parent array: node 0 is the root (the last emitted token, not yet in the target's
cache), ``parents[i] < i`` for every other node. A static tree *shape* is a list of paths of ranks
(Medusa "choices"): ``(a, b)`` is the rank-a candidate at depth 1 followed by the rank-b candidate
at depth 2.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch

from draftheads.errors import DraftheadsError


@dataclass
class Tree:
    """Tokens and parents of a candidate tree (node 0 = root)."""

    tokens: list[int]
    parents: list[int]
    draft_probs: list[torch.Tensor | None] | None = None  # per node: q(. | parent) it was sampled from

    def __post_init__(self):
        check_parents(self.parents)
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return max(depths(self.parents))

    def children(self) -> list[list[int]]:
        return children_of(self.parents)


def check_parents(parents) -> None:
    if not parents or parents[0] != -1:
        raise DraftheadsError(f"tree parents {list(parents)[:8]} must start with -1 (the root)")
    for i, p in enumerate(parents[1:], 1):
        if not 0 <= p < i:
            raise DraftheadsError(f"tree node {i} has parent {p}: each parent must be an earlier node")


def depths(parents) -> list[int]:
    d = [0] * len(parents)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return d


def children_of(parents) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents[1:], 1):
        kids[p].append(i)
    return kids


def ancestor_mask(parents) -> torch.Tensor:
    """[N, N] bool: True at (i, j) when j is i or an ancestor of i."""
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        m[i, i] = True
        if i:
            m[i] |= m[parents[i]]
    return m


def position_ids(parents, start: int) -> torch.Tensor:
    """Position of each node: ``start`` + depth."""
    return torch.tensor(depths(parents), dtype=torch.long) + start


def retrieve_paths(parents) -> list[list[int]]:
    """Root-to-leaf node-index paths."""
    kids = children_of(parents)
    out = []
    for leaf in (i for i in range(len(parents)) if not kids[i]):
        path = [leaf]
        while parents[path[-1]] != -1:
            path.append(parents[path[-1]])
        out.append(path[::-1])
    return out


def chain_parents(n: int) -> list[int]:
    """A chain of ``n`` drafted tokens after the root."""
    return [-1] + list(range(n))


# ----------------------------------------------------------------------------- static shapes


def shape_from_paths(paths) -> tuple[list[int], list[tuple[int, ...]]]:
    """Rank paths -> (parents, rank path of every node); prefixes are added when missing."""
    nodes = {(): 0}
    order = [()]
    for path in sorted({tuple(p) for p in paths} | {tuple(p[:k]) for p in paths for k in range(1, len(p))},
                       key=lambda p: (len(p), p)):
        if not path:
            continue
        if any(r < 0 for r in path):
            raise DraftheadsError(f"tree path {list(path)} has a negative rank")
        nodes[path] = len(order)
        order.append(path)
    parents = [-1] + [nodes[p[:-1]] for p in order[1:]]
    return parents, order


def greedy_shape(rank_accept: list[list[float]], num_nodes: int) -> list[tuple[int, ...]]:
    """Static tree of ``num_nodes`` drafted nodes maximising expected accepted length.

    ``rank_accept[d][r]`` = probability that the rank-r candidate at depth d+1 is the target's token
    (Medusa's construction): a node's value is the product along its path; nodes are added greedily.
    """
    chosen: list[tuple[int, ...]] = []
    frontier = {(r,): rank_accept[0][r] for r in range(len(rank_accept[0]))}
    while frontier and len(chosen) < num_nodes:
        path = max(frontier, key=lambda p: (frontier[p], -len(p)))
        value = frontier.pop(path)
        chosen.append(path)
        d = len(path)
        if d < len(rank_accept):
            for r in range(len(rank_accept[d])):
                frontier[path + (r,)] = value * rank_accept[d][r]
    return chosen


def default_rank_accept(depth: int, top_k: int, first: float = 0.6, decay: float = 0.75) -> list[list[float]]:
    """A prior of per-depth, per-rank acceptance: ``first * decay**d`` for rank 0, halving per rank."""
    return [[first * decay**d * 0.5**r for r in range(top_k)] for d in range(depth)]


NAMED_SHAPES = {
    "chain4": [tuple([0] * k) for k in range(1, 5)],
    "small": greedy_shape(default_rank_accept(4, 4), 15),
    "medium": greedy_shape(default_rank_accept(4, 8), 31),
    "large": greedy_shape(default_rank_accept(5, 10), 63),
}


def load_shape(spec: str | os.PathLike) -> list[tuple[int, ...]]:
    """A named shape (chain4, small, medium, large, chainK) or a JSON file with a list of rank paths."""
    spec = str(spec)
    if spec in NAMED_SHAPES:
        return NAMED_SHAPES[spec]
    if spec.startswith("chain") and spec[5:].isdigit():
        return [tuple([0] * k) for k in range(1, int(spec[5:]) + 1)]
    if not os.path.isfile(spec):
        raise DraftheadsError(
            f"tree {spec!r} is neither a named tree ({', '.join(NAMED_SHAPES)}, chainK) nor a file: "
            "give a JSON file holding a list of rank paths like [[0], [1], [0, 0]]"
        )
    try:
        paths = json.loads(open(spec).read())
        if not isinstance(paths, list) or not paths or not all(
            isinstance(p, list) and p and all(isinstance(r, int) for r in p) for p in paths
        ):
            raise ValueError
    except (ValueError, json.JSONDecodeError):
        raise DraftheadsError(
            f"tree file {spec!r} is malformed: it must hold a non-empty JSON list of non-empty "
            "lists of ranks, like [[0], [1], [0, 0]]"
        ) from None
    shape_from_paths(paths)  # validates
    return [tuple(p) for p in paths]


def expected_accept_length(paths, rank_accept) -> float:
    """Σ over nodes of the probability that the node is accepted (+1 for the bonus token)."""
    total = 1.0
    for p in paths:
        total += math.prod(rank_accept[d][r] if d < len(rank_accept) and r < len(rank_accept[d]) else 0.0
                           for d, r in enumerate(p))
    return total
