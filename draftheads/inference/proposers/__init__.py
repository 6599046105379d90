"""Proposers, one file each; each head family's registers itself with
:mod:`~draftheads.inference.proposers.registry`."""

from __future__ import annotations

from draftheads.errors import DraftheadsError
from draftheads.inference.proposers.registry import lookup, register

__all__ = ["proposer_for", "register"]


def proposer_for(family: str) -> type:
    """The proposer registered for ``family`` (the built-in families' register when this is first asked)."""
    from draftheads.inference.proposers.dflash import DFlashProposer  # noqa: F401
    from draftheads.inference.proposers.dspark import DSparkProposer  # noqa: F401
    from draftheads.inference.proposers.eagle import EagleProposer  # noqa: F401
    from draftheads.inference.proposers.eagle3 import Eagle3Proposer  # noqa: F401
    from draftheads.inference.proposers.medusa import MedusaProposer  # noqa: F401

    found = lookup(family)
    if found is None:
        raise DraftheadsError(f"no proposer drafts with {family!r} heads: register one with "
                              "draftheads.inference.proposers.register")
    return found
