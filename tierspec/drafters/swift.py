"""SWIFT baseline (Xia et al. 2024): self-speculative drafting whose routing mask is optimised
on the fly, during generation, on the text generated so far.

Every ``opt_interval`` cycles one candidate mask (random, or every ``bayes_interval``-th a
Gaussian-process proposal) is scored by SWIFT's objective, the greedy agreement of the masked
model with the committed tokens over the last ``context_window`` positions; the best mask so
far drafts. Optimisation stops after ``max_opt_iter`` candidates, after ``max_tolerance_iter``
without improvement, or once the agreement reaches ``max_score``.

Candidates are scored through the loop's view of the target cache: the window is re-run
under the mask on top of the cached full-model KV before it, and the cache is restored
(``TargetDraftView.replay_window``) — no copy of the KV prefix.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import TierspecError
from ..layerskip.candidates import Evaluation, next_keep, random_keep
from ..layerskip.masks import RoutingMask
from .self_spec import SelfSpeculativeDrafter


class SwiftDrafter(SelfSpeculativeDrafter):
    def __init__(
        self,
        num_layers: int,
        ratio: float = 0.45,
        unit: str = "sublayer",
        opt_interval: int = 1,
        bayes_interval: int = 25,
        max_opt_iter: int = 1000,
        max_tolerance_iter: int = 300,
        max_score: float = 0.95,
        context_window: int = 32,
        seed: int = 0,
    ):
        if not 0.0 < ratio < 1.0:
            raise TierspecError(f"the SWIFT ratio must be in (0, 1), got {ratio}")
        self.eligible = RoutingMask.eligible_units(num_layers, unit)
        self.bypass = round(ratio * RoutingMask.total_units(num_layers, unit))
        self.num_layers, self.unit, self.ratio = num_layers, unit, ratio
        self.opt_interval, self.bayes_interval = opt_interval, bayes_interval
        self.max_opt_iter, self.max_tolerance_iter, self.max_score = max_opt_iter, max_tolerance_iter, max_score
        self.context_window, self.seed = context_window, seed
        super().__init__(RoutingMask(num_layers))
        self.optimisation_calls = 0

    def _mask(self, keep: list[int]) -> RoutingMask:
        return RoutingMask.from_units(self.num_layers, self.unit, [u for u, k in zip(self.eligible, keep) if not k])

    def start(self, prompt_ids, features=None, target_view=None) -> None:
        super().start(prompt_ids, features, target_view)
        self.rng = np.random.default_rng(self.seed)
        self.history: list[Evaluation] = []
        self.best: Evaluation | None = None
        self.since_best = 0
        self.cycle = 0
        self.optimising = True
        self.optimisation_calls = 0
        self.mask = self._mask(random_keep(self.rng, len(self.eligible), self.bypass))

    def _agreement(self, mask: RoutingMask, context: torch.Tensor) -> float:
        """Greedy agreement of the masked model with the last ``context_window`` committed
        tokens, reading the full model's KV for the text before the window."""
        end = min(len(context), self.view.length)
        start = max(1, end - self.context_window)
        if end - start < 2:
            return 0.0
        logits = self.view.replay_window(start - 1, context[start - 1 : end - 1], mask)
        self.optimisation_calls += 1
        return float((logits.argmax(-1) == context[start:end]).float().mean())

    def _optimise(self, context: torch.Tensor) -> None:
        step = len(self.history)
        keep, source = next_keep(self.history, "agreement", self.rng, len(self.eligible), self.bypass,
                                 use_bo=step > 0 and step % self.bayes_interval == 0, seed=self.seed)
        score = self._agreement(self._mask(keep), context)
        evaluation = Evaluation(keep, 0.0, score, source)
        self.history.append(evaluation)
        if self.best is None or score > self.best.agreement:
            self.best, self.since_best = evaluation, 0
            self.mask = self._mask(keep)
        else:
            self.since_best += 1
        if len(self.history) >= self.max_opt_iter or self.since_best >= self.max_tolerance_iter or self.best.agreement >= self.max_score:
            self.optimising = False

    def propose(self, context, request):
        calls = 0
        if self.optimising and self.cycle % self.opt_interval == 0:
            before = self.optimisation_calls
            self._optimise(torch.as_tensor(context))
            calls = self.optimisation_calls - before  # an optimisation pass is drafter work too
        self.cycle += 1
        proposal = super().propose(context, request)
        proposal.drafter_calls += calls
        return proposal
