"""Bounds on numeric generation settings that every face (the Python API, the command line, the
server) checks at its boundary, so that a request for more than a method can use is refused with
its bound instead of being attempted (a γ of 10⁶ would draft for minutes before its first pass).
"""

from __future__ import annotations

from .errors import PromptError

#: γ, tokens drafted per cycle: a cycle's pass holds γ + 1 rows. The engine's pass-cost tables
#: (``costs.forward_costs``) measure passes of up to 16 new tokens and the adaptive methods draft at
#: most ``adaptive_max_draft`` (10); 64 leaves room for fixed drafts far past any measured use.
MAX_NUM_DRAFT = 64
#: ``logit_bias`` entries: each is added to its row on every pass; 1024 covers any ban list.
MAX_LOGIT_BIAS_ENTRIES = 1024


def check_num_draft(value: int | None, name: str = "num_draft") -> None:
    """Refuse a γ outside 0 .. ``MAX_NUM_DRAFT`` in one line naming the bound (None: the method's default)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_NUM_DRAFT:
        raise PromptError(f"{name} must be an integer from 0 to {MAX_NUM_DRAFT} (tokens drafted per cycle), "
                          f"got {value!r}")
