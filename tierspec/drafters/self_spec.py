"""Self-speculative drafting: the target drafts for itself with a routing mask applied
(layer skipping, as in Draft & Verify and SWIFT), reading the full model's KV for the
committed prefix. No second model in memory.

The masked passes append KV (on kept layers only) for the drafted positions; ``propose``
trims them off again before returning, so verification sees the cache exactly as the last
commit left it.
"""

from __future__ import annotations

import torch

from ..routing import RoutingMask
from ..sampling import SamplingConfig
from .base import Drafter, Proposal, draft_autoregressively


class SelfSpeculativeDrafter(Drafter):
    """Drafts with the target under ``mask``; stops early when the draft's top probability
    (at temperature 1) falls below ``confidence_threshold`` — a token the slim model is unsure
    of is likely rejected, and each drafted token costs a masked forward."""

    def __init__(self, mask: RoutingMask, confidence_threshold: float = 0.8):
        if not 0.0 <= confidence_threshold <= 1.0:
            raise ValueError(f"confidence_threshold must be in [0, 1], got {confidence_threshold}")
        self.mask = mask
        self.confidence_threshold = confidence_threshold
        self.target = None
        self.calls = 0

    def start(self, prompt_ids: torch.Tensor, verifiers) -> None:
        self.verifiers = verifiers
        self.target = verifiers.target
        self.calls = 0

    def propose(self, context, num_tokens, sampling: SamplingConfig, generator) -> Proposal:
        if num_tokens <= 0:
            return Proposal.empty()
        runner = self.target
        # Draft on top of full-model KV only: slim-verifier KV (another mask) is dropped first.
        self.verifiers.drop_slim_cache()
        base = runner.length
        pending = context[base:]

        def next_logits(tokens: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return runner.forward(tokens, logits_for=1, mask=self.mask)[-1]

        try:
            return draft_autoregressively(next_logits, pending, num_tokens, sampling, generator, self.confidence_threshold)
        finally:
            runner.rollback(base)  # drop the draft's KV from the kept layers
