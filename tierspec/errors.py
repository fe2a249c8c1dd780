"""The error every user-facing validation failure raises.

The command line prints a ``TierspecError`` as one line (it says what to do); anything else is a
bug and prints its traceback. ``TierspecError`` is a ``ValueError`` so that callers of the
library can keep catching ``ValueError``.
"""

from __future__ import annotations


class TierspecError(ValueError):
    """Bad input or settings, a missing or damaged file: the message says what to do."""


class ModelLoadError(TierspecError):
    """A model spec could not be resolved or loaded; the message says what to do."""


class PromptError(TierspecError):
    """The prompt cannot be decoded (empty, batched, ids outside the vocabulary, or longer than
    the model's context), or a generation setting is out of range."""
