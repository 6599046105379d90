"""Candidate trees as data, and pure functions over them.

A tree is a parent array: node 0 is the root (the last emitted token, not yet in the target's
cache), ``parents[i] < i`` for every other node. A static tree *shape* is a list of paths of ranks
(Medusa "choices"): ``(a, b)`` is the rank-a candidate at depth 1 followed by the rank-b candidate
at depth 2.
"""

from __future__ import annotations

import functools
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
    scores: list[float] | None = None
    """Per node, the draft's cumulative log-probability of its path (the root: 0), what the acceptance
    model reads; for a node drawn from q it must not depend on the token drawn (a sampled tree is cut by
    it, and a cut chosen by the draws themselves would bias the rejection walk)."""

    def __post_init__(self):
        check_parents(self.parents)
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        if self.scores is not None and len(self.scores) != len(self.tokens):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.scores)} scores")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return max(depths(self.parents))

    def children(self) -> list[list[int]]:
        return children_of(self.parents)


def prune(tree: Tree, keep) -> Tree:
    """The subtree of the nodes in ``keep`` (node indices, closed under ancestors) and the root, in the
    original order; draft probabilities and scores carried over."""
    kept = sorted({0, *keep})
    where = {old: new for new, old in enumerate(kept)}
    for i in kept[1:]:
        if tree.parents[i] not in where:
            raise ValueError(f"node {i} is kept without its parent {tree.parents[i]}")
    pick = lambda xs: None if xs is None else [xs[i] for i in kept]  # noqa: E731
    return Tree([tree.tokens[i] for i in kept], [-1] + [where[tree.parents[i]] for i in kept[1:]],
                pick(tree.draft_probs), pick(tree.scores))


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


# ----------------------------------------------------------------------------- choosing drafted nodes


@dataclass
class Node:
    """A drafted candidate in a pool (list form, for proposers that draft one row at a time)."""

    token: int  # head-vocabulary index
    parent: int  # pool index, -1 = child of the root
    depth: int
    score: float  # cumulative log-probability along its path


def select_nodes(scores: torch.Tensor, depth: torch.Tensor, parents: torch.Tensor, keep: int):
    """The best ``keep`` drafted nodes of each row's pool as trees, with tensor ops only (no host sync).

    scores [R, P] cumulative log-probabilities, depth [R, P] (1 = child of the root), parents [R, P]
    (pool index, -1 = child of the root). Nodes are ranked by score, then depth, then pool index (EAGLE-2's
    rerank). A node's score never exceeds its parent's (log-probabilities are <= 0) and a parent is
    shallower, so a parent always ranks before its children and the kept set is closed under ancestors.

    Returns (nodes [R, n] pool indices in tree order: by depth, then pool index; tree_parents [R, n]
    tree indices with the root = 0 and the nodes at 1..n), n = min(keep, P).
    """
    r, p = scores.shape  # [R, P]
    n = min(keep, p)
    by_depth = torch.sort(depth, dim=1, stable=True).indices
    ranked = by_depth.gather(1, torch.sort(scores.gather(1, by_depth), dim=1, descending=True, stable=True).indices)
    kept = ranked[:, :n]  # [R, n]
    order = torch.sort(depth.gather(1, kept) * p + kept, dim=1).indices
    nodes = kept.gather(1, order)  # [R, n] by depth, then pool index
    where = torch.zeros(r, p, dtype=torch.long, device=scores.device)
    where.scatter_(1, nodes, torch.arange(1, n + 1, device=scores.device).expand(r, n))
    up = parents.gather(1, nodes)
    tree_parents = torch.where(up < 0, 0, where.gather(1, up.clamp(min=0)))
    return nodes, tree_parents


def select_tree(root: int, pool: list[Node], total_tokens: int, to_target_ids) -> Tree:
    """The best ``total_tokens - 1`` nodes of a list pool (:func:`select_nodes`) as a tree rooted at
    ``root``; ``to_target_ids`` maps head-vocabulary indices [n] to target ids."""
    scores = torch.tensor([[nd.score for nd in pool]], dtype=torch.float64)
    depth = torch.tensor([[nd.depth for nd in pool]])
    parents = torch.tensor([[nd.parent for nd in pool]])
    nodes, tree_parents = select_nodes(scores, depth, parents, total_tokens - 1)
    kept = nodes[0].tolist()
    ids = to_target_ids(torch.tensor([pool[j].token for j in kept], dtype=torch.long)).tolist()
    return Tree([root, *ids], [-1, *tree_parents[0].tolist()], scores=[0.0, *(pool[j].score for j in kept)])


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


# ----------------------------------------------------------------------------- tree options

MAX_TREE_TOKENS = 128
"""Largest tree (root included) the engine verifies in one step."""

TREE_PRESETS = {"small": (4, 3, 12), "medium": (5, 4, 24), "large": (6, 8, 48)}
"""Named trees: (depth, top_k, total tokens with the root). The same name is the same size for every head."""

DEFAULT_TREE = "auto"
"""``auto``: the engine's policy moves between plain decoding and the proposer's trees by measured speed."""


@dataclass(frozen=True)
class TreeSpec:
    """What one step drafts: a dynamic tree (EAGLE-2 style) or, from a file, a static shape of rank paths."""

    depth: int = 5
    """Maximum tree depth (drafting steps)."""
    top_k: int = 4
    """Children per expanded node, and nodes expanded per depth (1 = a chain)."""
    total_tokens: int = 24
    """Tree size including the root."""
    paths: tuple[tuple[int, ...], ...] | None = None
    """A static shape of rank paths (from a tree file); None = built from the numbers above."""
    name: str = ""

    def __post_init__(self):
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 2:
            raise DraftheadsError(
                f"tree needs depth >= 1, top_k >= 1, total_tokens >= 2 (got {self.depth}, {self.top_k}, "
                f"{self.total_tokens})"
            )
        if self.total_tokens > MAX_TREE_TOKENS:
            raise DraftheadsError(
                f"tree {self.name or ''} has {self.total_tokens} tokens, more than the {MAX_TREE_TOKENS} the engine "
                f"verifies in one step: use a smaller tree (e.g. chain{MAX_TREE_TOKENS - 1} at most)"
            )

    @property
    def is_chain(self) -> bool:
        return self.top_k == 1 and self.paths is None

    @property
    def label(self) -> str:
        return self.name or f"tree(depth={self.depth}, top_k={self.top_k}, tokens={self.total_tokens})"

    def shape(self, max_depth: int | None = None) -> list[tuple[int, ...]]:
        """Rank paths for a static drafter (Medusa); named trees are cut to ``max_depth`` at the same size."""
        if self.paths is not None:
            if max_depth is not None and max(len(p) for p in self.paths) > max_depth:
                raise DraftheadsError(
                    f"tree file {self.name} is {max(len(p) for p in self.paths)} deep but the head drafts "
                    f"{max_depth} positions: give a tree of depth <= {max_depth}"
                )
            return list(self.paths)
        depth = self.depth if max_depth is None else min(self.depth, max_depth)
        if self.is_chain:
            return [tuple([0] * k) for k in range(1, depth + 1)]
        return greedy_shape(default_rank_accept(depth, self.top_k), self.total_tokens - 1)


@functools.lru_cache(maxsize=64)
def static_tree(spec: TreeSpec, max_depth: int | None = None) -> tuple[list[int], list[tuple[int, ...]]]:
    """(parents, rank path of every node) of ``spec.shape(max_depth)``, computed once per tree."""
    return shape_from_paths(spec.shape(max_depth))


def parse_tree(spec: str | os.PathLike) -> TreeSpec:
    """A named tree (small, medium, large), ``chainK`` (K drafted tokens) or a JSON file of rank paths."""
    spec = str(spec)
    if spec in TREE_PRESETS:
        return TreeSpec(*TREE_PRESETS[spec], name=spec)
    if spec.startswith("chain") and spec[5:].isdigit():
        k = int(spec[5:])
        if k < 1:
            raise DraftheadsError(f"tree {spec!r}: a chain drafts at least one token (chain1, chain2, ...)")
        return TreeSpec(depth=k, top_k=1, total_tokens=k + 1, name=spec)
    if not os.path.isfile(spec):
        raise DraftheadsError(
            f"tree {spec!r} is neither a named tree ({', '.join(TREE_PRESETS)}, chainK) nor a file: "
            "give a JSON file holding a list of rank paths like [[0], [1], [0, 0]]"
        )
    try:
        paths = json.loads(open(spec, encoding="utf-8").read())
        if not isinstance(paths, list) or not paths or not all(
            isinstance(p, list) and p and all(isinstance(r, int) for r in p) for p in paths
        ):
            raise ValueError
    except (ValueError, UnicodeDecodeError):
        raise DraftheadsError(
            f"tree file {spec!r} is malformed: it must hold a non-empty JSON list of non-empty "
            "lists of ranks, like [[0], [1], [0, 0]]"
        ) from None
    parents, order = shape_from_paths(paths)  # validates, adds missing prefixes
    return TreeSpec(depth=max(len(p) for p in order[1:]), top_k=max(max(p) for p in order[1:]) + 1,
                    total_tokens=len(parents), paths=tuple(order[1:]), name=spec)


def expected_accept_length(paths, rank_accept) -> float:
    """Σ over nodes of the probability that the node is accepted (+1 for the bonus token)."""
    total = 1.0
    for p in paths:
        total += math.prod(rank_accept[d][r] if d < len(rank_accept) and r < len(rank_accept[d]) else 0.0
                           for d, r in enumerate(p))
    return total
