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

The engine picks one :class:`Verifier` from its config (``VERIFIERS``): ``exact`` does the above per
request (greedy or sampled by its parameters), ``synthetic`` accepts drafted positions with given
probabilities whatever the tokens, for speed measurements on random-weight targets (vLLM's synthetic
rejection sampling), and ``reference`` walks as the greedy one does but along a given text, to time
modes on one text in reduced precision. All read the target's logits through :class:`NodeLogits`,
which projects the final hidden states through the lm_head only at the nodes a walk reaches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftheads.errors import DraftheadsError
from draftheads.inference.projection import vocab_logits
from draftheads.inference.sampling import SamplingParams, draw, inverse_cdf, target_probs, uniform
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


def verify_sampled_uniforms(tree: Tree, probs: torch.Tensor, uniforms: list[float]) -> VerifyResult:
    """Deterministic-draft sampling walk with given uniforms (``uniforms[d]`` draws at depth d) --
    the same walk as :func:`verify_sampled`, in the form the Triton kernel reproduces."""
    kids = tree.children()
    cur, accepted, tokens = 0, [], []
    for u in uniforms:
        x = int(inverse_cdf(probs[cur], u))
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
            x = draw(probs[cur], gen)
            for c in children:
                if tree.tokens[c] == x:
                    nxt = c
                    break
        else:
            p = probs[cur]
            for c in children:
                q, x = qs[c], tree.tokens[c]
                px, qx = float(p[x]), float(q[x])
                u = uniform(gen)
                if qx > 0 and u * qx < px:  # u < min(1, px / qx)
                    nxt = c
                    break
                resid = torch.clamp(p - q, min=0)
                total = float(resid.sum())
                if total > 0:
                    p = resid / total
            if nxt is None:
                x = draw(p, gen)
        if nxt is None:
            tokens.append(x)
            return VerifyResult(accepted, tokens)
        tokens.append(tree.tokens[nxt])
        accepted.append(nxt)
        cur = nxt


# ----------------------------------------------------------------------------- the engine's verifiers


class NodeLogits:
    """The target's logits at the query positions of one forward, projected on demand.

    ``hidden`` [T, H] are final (normed) hidden states and ``weight`` [V, H] the lm_head; or ``full``
    [T, V] logits computed by the model itself (targets whose head does more than a projection).
    ``projected`` counts the rows projected so far (what lazy projection saves is measurable).
    """

    def __init__(self, hidden: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                 full: torch.Tensor | None = None):
        if (full is None) == (hidden is None or weight is None):
            raise ValueError("NodeLogits needs hidden and weight, or full logits")
        self.hidden, self.weight, self.full = hidden, weight, full
        self.projected = 0

    def __len__(self) -> int:
        return (self.full if self.full is not None else self.hidden).shape[0]

    def rows(self, idx) -> torch.Tensor:
        """[len(idx), V] logits at flattened query positions ``idx``."""
        if self.full is not None:
            return self.full[idx]
        idx = torch.as_tensor(idx, dtype=torch.long, device=self.hidden.device)
        self.projected += idx.numel()
        return vocab_logits(self.hidden[idx], self.weight)

    def all(self) -> torch.Tensor:
        return self.rows(torch.arange(len(self)))

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows([i])[0]


class _RowProbs:
    """``probs[node]`` for one row: its target distribution after that node, projected when read."""

    def __init__(self, logits: NodeLogits, offset: int, params: SamplingParams):
        self.logits, self.offset, self.params = logits, offset, params

    def __getitem__(self, node: int) -> torch.Tensor:
        return target_probs(self.logits[self.offset + node], self.params)


class Verifier:
    """Turns one forward's logits over every row's tree into accepted nodes and emitted tokens."""

    name = "none"

    @classmethod
    def from_config(cls, config, on_device: bool = False, kernel: bool = False) -> Verifier:
        """Built from an :class:`~draftheads.inference.engine.EngineConfig`. ``on_device``: walk the trees
        on the device and read the results back once (where a host read costs a round trip);
        ``kernel``: with the Triton walk."""
        return cls()

    def verify(self, states, trees: list[Tree], logits: NodeLogits) -> list[VerifyResult]:  # pragma: no cover
        raise NotImplementedError


def _offsets(trees: list[Tree]) -> list[int]:
    out, off = [], 0
    for t in trees:
        out.append(off)
        off += len(t)
    return out


class ExactVerifier(Verifier):
    """Lossless verification. Greedy rows walk their trees together: on the host, depth by depth,
    projecting the nodes reached and ``ahead`` of their likeliest descendants (one lm_head call for the
    whole batch per depth the draft's choice missed; best on a CPU);
    or ``on_device``, over the argmax of every node with one read-back (:func:`device_greedy`).
    Sampled rows run the rejection walk, projecting each node they visit."""

    name = "exact"

    def __init__(self, on_device: bool = False, kernel: bool = False, ahead: int = 0):
        self.on_device, self.kernel, self.ahead = on_device, kernel, ahead

    @classmethod
    def from_config(cls, config, on_device: bool = False, kernel: bool = False) -> ExactVerifier:
        return cls(on_device=on_device, kernel=kernel, ahead=config.walk_ahead)

    def verify(self, states, trees, logits):
        offs = _offsets(trees)
        out: list[VerifyResult | None] = [None] * len(trees)
        greedy = [r for r, st in enumerate(states) if st.params.greedy]
        if greedy:
            g_trees, g_offs = [trees[r] for r in greedy], [offs[r] for r in greedy]
            if self.on_device and max(len(t) for t in g_trees) > 1:
                done = device_greedy(g_trees, logits, g_offs, self.kernel)
            else:
                done = _greedy_walk(g_trees, logits, g_offs, self.ahead)
            for r, res in zip(greedy, done):
                out[r] = res
        for r, st in enumerate(states):
            if out[r] is None:
                out[r] = verify_sampled(trees[r], _RowProbs(logits, offs[r], st.params), st.generator)
        return out


def _greedy_walk(trees: list[Tree], logits: NodeLogits, offs: list[int], ahead: int = 0,
                 follow: list[list[int] | None] | None = None, flips: list[int] | None = None) -> list[VerifyResult]:
    """The host walk, depth by depth for every row at once. Each lm_head call projects, per row, the node
    reached and up to ``ahead`` of its likeliest descendants (the best-scored child, then its own): where
    the target follows the draft's own choice, one call serves several depths (a projection reads the
    whole lm_head whatever its rows, so a few more rows cost little). ``follow`` (per row, or None): the
    tokens the walk emits in place of the argmax, while they last (:class:`ReferenceVerifier`), counting
    in ``flips[0]`` those that differ from it."""
    kids = [t.children() for t in trees]
    best = [_likeliest_children(t, k) for t, k in zip(trees, kids)]
    cur = [0] * len(trees)
    res = [VerifyResult([], []) for _ in trees]
    live = list(range(len(trees)))
    while live:
        chains = []
        for r in live:
            chain = [cur[r]]
            while len(chain) <= ahead and best[r][chain[-1]] >= 0:
                chain.append(best[r][chain[-1]])
            chains.append(chain)
        want = logits.rows([offs[r] + n for r, chain in zip(live, chains) for n in chain]).argmax(-1).tolist()
        still, at = [], 0
        for r, chain in zip(live, chains):
            for j in range(len(chain)):
                w = want[at + j]
                if follow is not None and follow[r] is not None and len(res[r].tokens) < len(follow[r]):
                    forced = follow[r][len(res[r].tokens)]
                    if flips is not None and forced != w:
                        flips[0] += 1
                    w = forced
                res[r].tokens.append(w)
                nxt = next((c for c in kids[r][cur[r]] if trees[r].tokens[c] == w), None)
                if nxt is None:
                    break
                res[r].accepted.append(nxt)
                cur[r] = nxt
                if j + 1 == len(chain) or chain[j + 1] != nxt:  # off the projected chain: project from here
                    still.append(r)
                    break
            at += len(chain)
        live = still
    return res


def _likeliest_children(tree: Tree, kids: list[list[int]]) -> list[int]:
    """Per node, its child with the best draft score (the first child where the tree has no scores; -1
    for a leaf)."""
    if tree.scores is None:
        return [k[0] if k else -1 for k in kids]
    return [max(k, key=lambda c: tree.scores[c]) if k else -1 for k in kids]


def greedy_walk(tokens: torch.Tensor, parents: torch.Tensor, argmax: torch.Tensor, depth: int):
    """The greedy walk of padded trees with tensor ops only (no host read): tokens/parents/argmax [R, W]
    (padding: token -1, parent -2), ``depth`` the deepest tree's depth -> (accepted [R, depth] node
    indices, -1 past the end; count [R]). At each node the child whose token is the target's argmax
    there (the lowest index among equals) is taken."""
    r, w = tokens.shape  # [R, W]
    cols = torch.arange(w, device=tokens.device)
    cur = torch.zeros(r, 1, dtype=torch.long, device=tokens.device)
    alive = torch.ones(r, 1, dtype=torch.bool, device=tokens.device)
    steps = []
    for _ in range(depth):
        match = (parents == cur) & (tokens == argmax.gather(1, cur)) & alive
        child = torch.where(match, cols, w).min(1, keepdim=True).values
        alive = child < w
        steps.append(torch.where(alive, child, -1))
        cur = torch.where(alive, child, cur)
    accepted = torch.cat(steps, 1) if steps else torch.zeros(r, 0, dtype=torch.long, device=tokens.device)
    return accepted, (accepted >= 0).sum(1)


def device_greedy(trees: list[Tree], logits: NodeLogits, offs: list[int], kernel: bool = False) -> list[VerifyResult]:
    """The greedy walk of every row on the device over the argmax of all nodes (the Triton kernel with
    ``kernel``, else :func:`greedy_walk`), with one read-back of the accepted nodes and bonus tokens."""
    device = logits.hidden.device if logits.full is None else logits.full.device
    rows, width = len(trees), max(len(t) for t in trees)
    tokens = torch.full((rows, width), -1, dtype=torch.long)
    parents = torch.full((rows, width), -2, dtype=torch.long)
    for r, t in enumerate(trees):
        tokens[r, : len(t)] = torch.tensor(t.tokens)
        parents[r, : len(t)] = torch.tensor(t.parents)
    where = torch.tensor([r * width + i for r, t in enumerate(trees) for i in range(len(t))], device=device)
    argmax = torch.full((rows * width,), -1, dtype=torch.long, device=device)
    argmax[where] = logits.rows([o + i for o, t in zip(offs, trees) for i in range(len(t))]).argmax(-1)
    argmax = argmax.view(rows, width)
    tokens, parents = tokens.to(device), parents.to(device)
    if kernel:
        from draftheads.kernels.verify import greedy_verify

        sizes = torch.tensor([len(t) for t in trees], dtype=torch.int32, device=device)
        accepted, count = greedy_verify(tokens.int(), parents.int(), argmax.int(), sizes)
        accepted, count = accepted.long(), count.long()
    else:
        accepted, count = greedy_walk(tokens, parents, argmax, max(t.depth for t in trees))
    last = torch.where(count > 0, accepted.gather(1, (count - 1).clamp(min=0)[:, None])[:, 0], 0)
    bonus = argmax.gather(1, last[:, None])
    host = torch.cat([count[:, None], bonus, accepted], 1).tolist()  # the walk's one read-back
    out = []
    for t, (n, b, *acc) in zip(trees, host):
        nodes = acc[:n]
        out.append(VerifyResult(nodes, [t.tokens[i] for i in nodes] + [b]))
    return out


class SyntheticVerifier(Verifier):
    """Accepts the drafted position d (along each node's first child) with probability ``rates[d]``
    given the positions before it were accepted, whatever the tokens; the bonus token is the target's
    argmax after the last accepted node. For speed measurements only: the text is meaningless."""

    name = "synthetic"

    def __init__(self, rates, seed: int = 0):
        rates = list(rates or ())
        if not rates or not all(0 <= r <= 1 for r in rates):
            raise DraftheadsError(f"synthetic acceptance rates {rates} must be a non-empty list in [0, 1]")
        self.rates = rates
        self.gen = torch.Generator().manual_seed(seed)

    @classmethod
    def from_config(cls, config, on_device: bool = False, kernel: bool = False) -> SyntheticVerifier:
        return cls(config.synthetic_rates)

    def verify(self, states, trees, logits):
        walks = []
        for tree in trees:  # the walks come from the host generator; the bonus tokens are read in one go
            kids = tree.children()
            cur, accepted = 0, []
            for rate in self.rates:
                if not kids[cur] or float(torch.rand((), generator=self.gen)) >= rate:
                    break
                cur = kids[cur][0]
                accepted.append(cur)
            walks.append(accepted)
        last = [off + (acc[-1] if acc else 0) for off, acc in zip(_offsets(trees), walks)]
        bonus = logits.rows(last).argmax(-1).tolist()
        return [VerifyResult(acc, [t.tokens[i] for i in acc] + [b]) for t, acc, b in zip(trees, walks, bonus)]


class ReferenceVerifier(ExactVerifier):
    """Greedy verification along given texts: the walk projects and reads the target's logits at the same
    nodes as the exact walk (the same work), but emits the text's next token where the argmax differs.
    For timing several modes on one text in reduced precision, where the argmax flips between near ties
    with the shape of the verify forward and each mode would otherwise decode, and be timed on, a text
    of its own. ``texts``: prompt tokens -> the continuation to follow (a prompt not in it decodes its own
    argmax); ``flips`` counts the tokens that differed from the argmax. Greedy requests only."""

    name = "reference"

    def __init__(self, ahead: int = 0):
        super().__init__(ahead=ahead)
        self.texts: dict[tuple[int, ...], list[int]] = {}
        self.flips = 0

    @classmethod
    def from_config(cls, config, on_device: bool = False, kernel: bool = False) -> ReferenceVerifier:
        return cls(ahead=config.walk_ahead)

    def verify(self, states, trees, logits):
        if not all(st.params.greedy for st in states):
            raise DraftheadsError("the reference verifier follows a greedy text: use temperature 0")
        follow = []
        for st in states:
            text = self.texts.get(tuple(st.tokens[: st.prompt_len]))
            follow.append(None if text is None else text[len(st.tokens) - st.prompt_len:])
        flips = [0]
        out = _greedy_walk(trees, logits, _offsets(trees), self.ahead, follow, flips)
        self.flips += flips[0]
        return out


VERIFIERS = {"exact": ExactVerifier, "synthetic": SyntheticVerifier, "reference": ReferenceVerifier}
