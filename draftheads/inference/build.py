"""Build a proposer from a head directory or a name, and an engine around it with a tree option."""

from __future__ import annotations

import os

from draftheads.errors import DraftheadsError
from draftheads.heads import check_head_fits_target, load_head
from draftheads.inference.engine import Engine, EngineConfig
from draftheads.inference.policy import AutoPolicy
from draftheads.inference.tree import DEFAULT_TREE

PROPOSERS = ("ngram",)
"""Proposers that need no trained head (``--proposer NAME``)."""


def check_drafter(head: str | None = None, proposer: str | None = None):
    """Check ``--head`` / ``--proposer`` before the target is loaded: the loaded head module (its config,
    names and shapes checked), or None for a named proposer or plain decoding."""
    if head and proposer:
        raise DraftheadsError("give either --head DIR or --proposer NAME, not both")
    if proposer and proposer not in PROPOSERS:
        raise DraftheadsError(f"--proposer {proposer!r} is unknown: use ngram (or --head DIR for a trained head)")
    return load_head(head)[0] if head else None


def make_proposer(target, head=None, proposer: str | None = None, options: dict | None = None):
    """``target`` is a loaded :class:`~draftheads.targets.Target`; ``head`` a head directory or a module from
    :func:`check_drafter`; ``options``: keyword arguments of the head family's proposer. Returns None for
    plain decoding."""
    module = check_drafter(head, proposer) if head is None or isinstance(head, (str, os.PathLike)) else head
    if proposer:
        from draftheads.inference.proposers.ngram import NGramProposer

        return NGramProposer()
    if module is None:
        return None
    check_head_fits_target(module, target.info)
    # the draft runs in the target's device and dtype, as vLLM runs its draft model: a float32 head beside a
    # bf16 target would read twice the bytes in every draft forward
    weight = target.model.get_output_embeddings().weight
    module = module.to(device=weight.device, dtype=weight.dtype)
    from draftheads.inference.proposers import proposer_for

    return proposer_for(module.head_type)(module, target.model, **(options or {}))


def make_engine(target, proposer, tree: str | None = None, config: EngineConfig | None = None) -> Engine:
    """An engine over ``target`` drafting with ``proposer`` (None = plain decoding). ``tree``: ``auto``
    (default), a tree name or a tree file. ``auto`` starts from the verify curve of ``draftheads
    profile`` when one was measured for this target, device and dtype."""
    tree = tree or DEFAULT_TREE
    policy = None
    if proposer is not None and tree == "auto":
        from draftheads.inference.profile import load_profile

        policy = AutoPolicy.for_proposer(proposer)
        curve = load_profile(target.info.name, target.model)
        if curve:
            policy.curve.seed(curve)
    return Engine(target.model, target.tokenizer, proposer, config=config, tree=tree, policy=policy)
