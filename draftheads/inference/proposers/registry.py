"""The proposer of each head family: a family's proposer registers itself under the family's name
(``@register("eagle3")``), so that a head directory's ``head_type`` finds the proposer that drafts with it."""

from __future__ import annotations

PROPOSERS: dict[str, type] = {}
"""Head family -> the proposer class that drafts with its heads."""


def register(family: str):
    """Class decorator: ``cls`` drafts with the heads of ``family``."""

    def add(cls: type) -> type:
        PROPOSERS[family] = cls
        return cls

    return add


def lookup(family: str) -> type | None:
    """The proposer registered for ``family``, or None."""
    return PROPOSERS.get(family)
