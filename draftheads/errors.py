"""One exception type for bad input: its message is a single line naming the input and the fix."""

from __future__ import annotations


class DraftheadsError(ValueError):
    """Bad input or environment. CLIs print ``error: <message>`` and exit 2, without a traceback."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))
