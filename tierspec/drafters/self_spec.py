"""Self-speculative drafting: the target drafts for itself with a routing mask applied
(layer skipping, as in Draft & Verify and SWIFT), reading the full model's KV for the
committed prefix. No second model in memory.

The drafter works through the ``TargetDraftView`` the loop hands it: masked passes append to
the target's cache on kept layers only, and ``discard`` drops them before verification, so
verification sees the cache exactly as the last commit left it.
"""

from __future__ import annotations

import numpy as np
import torch

from ..layerskip.masks import RoutingMask
from ..proposal import DraftRequest
from .base import Drafter, Proposal, TargetDraftView, draft_autoregressively


class SelfSpeculativeDrafter(Drafter):
    """Drafts with the target under ``mask``. Stopping early on unsure tokens is the policy's
    job (``policies.ConfidenceStop``)."""

    uses_target_cache = True

    def __init__(self, mask: RoutingMask):
        self.mask = mask
        self.view: TargetDraftView | None = None

    def start(self, prompt_ids, features=None, target_view=None) -> None:
        if target_view is None:
            raise ValueError("a self-speculative drafter needs the loop's view of the target cache")
        self.view = target_view

    def propose(self, context: np.ndarray, request: DraftRequest) -> Proposal:
        if request.budget <= 0:
            return Proposal.empty()
        pending = torch.as_tensor(context[self.view.length :])

        def next_logits(tokens: torch.Tensor) -> torch.Tensor:
            return self.view.forward(tokens, self.mask)

        try:
            return draft_autoregressively(next_logits, pending, request, "self")
        finally:
            self.view.discard()
