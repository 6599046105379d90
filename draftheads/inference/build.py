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


def make_proposer(target, head: str | None = None, proposer: str | None = None, tree: str | None = None,
                  ngram_tokens: int = 4):
    """``target`` is a loaded :class:`~draftheads.targets.Target`. Returns None for plain decoding."""
    tree = tree or DEFAULT_TREE
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
