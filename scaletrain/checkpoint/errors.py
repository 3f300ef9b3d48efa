"""The checkpoint package's error: at the bottom of its imports, so every module there can raise it."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names it and what to do."""
