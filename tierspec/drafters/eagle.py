"""The trained draft head as drafter (EAGLE-style, docs/algorithms.md §Draft head), and the hybrid
drafter that chooses per cycle between it and n-gram lookup.

The head reads the target's features f_t of committed positions from the generation's
``FeatureLog``, written by the verification passes that computed them (no extra target pass;
the drafter keeps no copy).
Each cycle it first catches up on newly committed positions (inputs (f_t, x_{t+1})), whose
last output predicts the feature of the pending token and so the first draft token; every
further draft token costs one head step on the head's own predicted feature. The drafted
positions are dropped from the head's cache at the end of ``propose``: next cycle they are
recomputed from the target's real features.
"""

from __future__ import annotations

import torch

from ..heads.draft import DraftHead, HeadRunner
from ..proposal import DraftRequest, RateView
from .base import Drafter, FeatureLog, Proposal, draft_autoregressively
from .ngram import NgramDrafter


class EagleDrafter(Drafter):
    """Drafts with a trained ``DraftHead`` over its reduced vocabulary V_K; the proposal's
    distributions are over the full vocabulary with p(v) = 0 outside V_K."""

    needs_target_features = True

    def __init__(self, head: DraftHead):
        self.head = head
        self.feature_layers = head.config.feature_layers
        self.runner = HeadRunner(head)
        self.vocab_size = head.config.vocab_size
        self._draft_ids = head.draft_ids.cpu()  # [K] target ids of the head's vocabulary
        self._input_dtype = head.fc.weight.dtype  # the features are cast to it
        self.features: FeatureLog | None = None  # the generation's, owned by the loop's verifiers
        self._last_output: torch.Tensor | None = None

    def start(self, prompt_ids, features: FeatureLog | None = None, target_view=None) -> None:
        self.runner.reset()
        self.features = features
        self._last_output = None

    def _catch_up(self, context: torch.Tensor) -> torch.Tensor | None:
        """Feed every committed position the head has not seen (its feature read from the log);
        return the head's output at the last one (≈ the pending token's feature), or None when
        the head cannot draft yet."""
        start = self.runner.length
        end = 0 if self.features is None else self.features.length
        pending_position = len(context) - 1  # the last committed token, not yet run by the target
        if end != pending_position or start >= end:
            if start == end == pending_position and self._last_output is not None:
                return self._last_output
            return None
        values = self.features.read(start, end)
        if values.dtype != self._input_dtype:
            values = values.to(self._input_dtype)
        h = self.runner.extend(values, context[start + 1 : end + 1], from_target=True)
        self._last_output = h[-1:]
        return self._last_output

    def propose(self, context: torch.Tensor, request: DraftRequest) -> Proposal:
        if request.budget <= 0:
            return Proposal.empty()
        h = self._catch_up(context)
        if h is None:
            return Proposal.empty(source="head")
        committed = self.runner.length

        def next_logits(tokens: torch.Tensor) -> torch.Tensor:
            """Logits [K] after feeding ``tokens``: none at the first draft (the catch-up's output
            predicts it), then each draft token with the head's own output as its input."""
            nonlocal h
            if len(tokens):
                h = self.runner.extend(h, tokens)
            return self.runner.logits(h)[0]

        try:
            return draft_autoregressively(next_logits, torch.empty(0, dtype=torch.long), request, "head", self._draft_ids,
                                          self.vocab_size)
        finally:
            self.runner.rollback(committed)  # drafted positions are recomputed from real features

    def draft_step_weights(self) -> dict[str, int]:
        # A self-fed step runs W_fc, the decoder layer and the K LM-head rows (aux_proj reads only
        # the target's features, once per committed position).
        if self.head.engine is not None:
            return {"head": self.head.engine.step_bytes}
        fed = sum(p.numel() * p.element_size() for name, p in self.head.named_parameters()
                   if not name.startswith("aux_proj."))
        return {"head": fed + self.head.lm_rows.numel() * self.head.lm_rows.element_size()}

    def commit(self, committed_length: int) -> None:
        # The head's cache holds only committed positions (drafts were dropped in propose).
        if self.runner.length > committed_length - 1:
            self.runner.rollback(committed_length - 1)


#: Cycles the hybrid drafts without the head once the head stopped paying (below), before it
#: tries the head again: counted, not timed, so that a seed fixes which cycles try it.
HEAD_RETRY_CYCLES = 8


class HybridDrafter(Drafter):
    """N-gram lookup where the context offers a match expected to pay more, the draft head
    otherwise: each cycle compares the expected emitted tokens per second of the n-gram
    candidate (from the policy's acceptance estimates for its match size and the measured
    verification costs) with the draft head's (the policy's running estimate for head drafts,
    which also pay the head's steps), both read through the request's ``RateView`` (the method's
    ``policies.CostAware``). Both stay lossless under the exact rule.

    The head also costs a fixed amount each cycle it runs (its catch-up on the newly committed
    positions and its first draft's logits, about one head step), which the head's rate does not
    charge: a cycle's drafts are chosen after it is spent. So where the head's rate is no better
    than drafting nothing by more than one head step (``RateView.plain_rate`` and
    ``draft_step_fraction``: at temperature 1 on a cheap pass the head's drafts stop paying), the
    hybrid leaves the head idle — n-gram lookup or no draft, the head's catch-up deferred to the
    next cycle it runs, in one call — and tries it again after ``HEAD_RETRY_CYCLES`` cycles."""

    needs_target_features = True

    def __init__(self, ngram: NgramDrafter, eagle: EagleDrafter):
        self.ngram, self.eagle = ngram, eagle
        self.feature_layers = eagle.feature_layers
        self._idle = 0  # cycles since the head last ran while it did not pay

    def start(self, prompt_ids, features=None, target_view=None) -> None:
        self.ngram.start(prompt_ids, features, target_view)
        self.eagle.start(prompt_ids, features, target_view)
        self._idle = 0

    def propose(self, context: torch.Tensor, request: DraftRequest) -> Proposal:
        if request.budget <= 0:
            return Proposal.empty()
        rates: RateView = request.policy  # methods pairs this drafter with a CostAware policy
        candidate = self.ngram.propose(context, request)
        head_rate = rates.source_rate("head")  # None until the head has drafted: try it first
        if len(candidate) and head_rate is not None and rates.expected_rate(candidate) > head_rate:
            return candidate  # the head catches up when it next runs
        if head_rate is not None and self._idle < HEAD_RETRY_CYCLES:
            if head_rate <= rates.plain_rate() * (1.0 + rates.draft_step_fraction("head")):
                self._idle += 1
                return candidate  # the n-gram candidate (possibly empty): the head is not worth its cycle
        self._idle = 0
        return self.eagle.propose(context, request)

    def commit(self, committed_length: int) -> None:
        self.eagle.commit(committed_length)
