"""Build a proposer from a head directory or a name, with a tree option."""

from __future__ import annotations

from draftheads.errors import DraftheadsError
from draftheads.heads import check_head_fits_target, load_head
from draftheads.inference.proposers.draft_tree import TreeSpec
from draftheads.inference.tree import load_shape

# dynamic-tree presets for EAGLE proposers: (depth, top_k, total_tokens)
TREE_PRESETS = {"small": (4, 3, 12), "medium": (5, 4, 24), "large": (6, 8, 48)}
DEFAULT_TREE = "medium"


def tree_spec(tree: str) -> TreeSpec:
    """Named dynamic tree (small, medium, large) or ``chainK`` (a chain of K drafted tokens)."""
    if tree in TREE_PRESETS:
        return TreeSpec(*TREE_PRESETS[tree])
    if tree.startswith("chain") and tree[5:].isdigit() and int(tree[5:]) >= 1:
        k = int(tree[5:])
        return TreeSpec(depth=k, top_k=1, total_tokens=k + 1)
    raise DraftheadsError(
        f"--tree {tree!r} is not a dynamic tree for EAGLE heads: use {', '.join(TREE_PRESETS)} or chainK"
    )


AUTO_ARMS = {"eagle": [None, "chain2", "small", "medium", "large"], "eagle3": [None, "chain2", "small", "medium", "large"],
             "medusa": [None, "chain2", "chain4", "small", "medium"], "ngram": [None, "chain2", "chain4", "chain8"]}


def make_policy(proposer, target_name: str | None = None, device: str = "cpu"):
    """``--tree auto``: an AutoTree over the proposer's trees and plain decoding, plus the
    per-request switch. The verify-cost curve from ``draftheads profile`` orders the exploration."""
    from draftheads.inference.policy import AutoTree, RequestSwitch
    from draftheads.inference.profile import load_profile

    arms = AUTO_ARMS[proposer.name]
    prior = {}
    curve = load_profile(target_name, device) if target_name else None
    if curve:
        def cost(n):
            k = min(curve, key=lambda c: abs(c - n))
            return curve[k]
        sizes = {None: 1, "chain2": 3, "chain4": 5, "chain8": 9}
        sizes.update({name: TREE_PRESETS[name][2] for name in TREE_PRESETS})
        depth = {None: 0, "chain2": 2, "chain4": 4, "chain8": 8, **{n: TREE_PRESETS[n][0] for n in TREE_PRESETS}}
        prior = {a: (1 + 0.5 * depth[a] ** 0.5) / cost(sizes[a]) for a in arms}  # rough tau guess / cost
    return AutoTree(arms, prior=prior), RequestSwitch()


def make_proposer(target, head: str | None = None, proposer: str | None = None, tree: str | None = None,
                  ngram_tokens: int = 4):
    """``target`` is a loaded :class:`~draftheads.targets.Target`. Returns None for plain decoding."""
    tree = tree or DEFAULT_TREE
    if tree == "auto":
        tree = DEFAULT_TREE  # the engine's AutoTree policy moves between trees from here
    if head and proposer:
        raise DraftheadsError("give either --head DIR or --proposer NAME, not both")
    if proposer:
        if proposer != "ngram":
            raise DraftheadsError(f"--proposer {proposer!r} is unknown: use ngram (or --head DIR for a trained head)")
        from draftheads.inference.proposers.ngram import NGramProposer

        k = int(tree[5:]) if tree.startswith("chain") and tree[5:].isdigit() else ngram_tokens
        return NGramProposer(num_tokens=k)
    if not head:
        return None
    module, _ = load_head(head)
    check_head_fits_target(module, target.info)
    module = module.to(target.model.device)
    if module.head_type == "medusa":
        from draftheads.inference.proposers.medusa import MedusaProposer

        shape = None if tree == DEFAULT_TREE else load_shape(tree)
        return MedusaProposer(module, target.model, shape)
    if module.head_type == "eagle":
        from draftheads.inference.proposers.eagle import EagleProposer

        return EagleProposer(module, target.model, tree_spec(tree))
    from draftheads.inference.proposers.eagle3 import Eagle3Proposer

    return Eagle3Proposer(module, target.model, tree_spec(tree))
