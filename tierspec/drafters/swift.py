"""SWIFT baseline (Xia et al. 2024): self-speculative drafting whose routing mask is optimised
on the fly, during generation, on the text generated so far.

Every ``opt_interval`` cycles one candidate mask (random, or every ``bayes_interval``-th a
Gaussian-process proposal) is scored by SWIFT's objective, the greedy agreement of the masked
model with the committed tokens over the last ``context_window`` positions; the best mask so
far drafts. Optimisation stops after ``max_opt_iter`` candidates, after ``max_tolerance_iter``
without improvement, or once the agreement reaches ``max_score``.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache

from ..routing import RoutingMask, apply_mask
from ..search import Evaluation, SearchConfig, _bo_proposal, _random_keep
from .self_spec import SelfSpeculativeDrafter


class SwiftDrafter(SelfSpeculativeDrafter):
    def __init__(
        self,
        num_layers: int,
        ratio: float = 0.45,
        unit: str = "sublayer",
        confidence_threshold: float = 0.8,
        opt_interval: int = 1,
        bayes_interval: int = 25,
        max_opt_iter: int = 1000,
        max_tolerance_iter: int = 300,
        max_score: float = 0.95,
        context_window: int = 32,
        seed: int = 0,
    ):
        self.eligible = RoutingMask.eligible_units(num_layers, unit)
        self.bypass = round(ratio * RoutingMask.total_units(num_layers, unit))
        self.num_layers, self.unit, self.ratio = num_layers, unit, ratio
        self.opt_interval, self.bayes_interval = opt_interval, bayes_interval
        self.max_opt_iter, self.max_tolerance_iter, self.max_score = max_opt_iter, max_tolerance_iter, max_score
        self.context_window, self.seed = context_window, seed
        super().__init__(RoutingMask(num_layers), confidence_threshold)
        self.optimisation_calls = 0

    def _mask(self, keep: list[int]) -> RoutingMask:
        return RoutingMask.from_units(self.num_layers, self.unit, [u for u, k in zip(self.eligible, keep) if not k])

    def start(self, prompt_ids, verifiers) -> None:
        super().start(prompt_ids, verifiers)
        self.rng = np.random.default_rng(self.seed)
        self.history: list[Evaluation] = []
        self.best: Evaluation | None = None
        self.since_best = 0
        self.cycle = 0
        self.optimising = True
        self.optimisation_calls = 0
        self.mask = self._mask(_random_keep(self.rng, len(self.eligible), self.bypass))

    def _agreement(self, mask: RoutingMask, context: torch.Tensor) -> float:
        """Greedy agreement of the masked model with the last ``context_window`` committed
        tokens, reading the full model's KV for the text before the window."""
        runner = self.target
        end = min(len(context), runner.length)
        start = max(1, end - self.context_window)
        if end - start < 2:
            return 0.0
        prefix = DynamicCache(config=runner.model.config)
        for index, layer in enumerate(runner.cache.layers):
            if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4:
                prefix.update(layer.keys[..., : start - 1, :], layer.values[..., : start - 1, :], index)
        positions = torch.arange(start - 1, end - 1).unsqueeze(0)
        with apply_mask(runner.model, mask):
            logits = runner.model(
                input_ids=context[start - 1 : end - 1].unsqueeze(0), position_ids=positions, cache=prefix, use_cache=True
            ).logits[0]
        self.optimisation_calls += 1
        self.calls += 1  # an optimisation pass is drafter work too
        return float((logits.argmax(-1) == context[start:end]).float().mean())

    def _optimise(self, context: torch.Tensor) -> None:
        step = len(self.history)
        keep = None
        bayesian = step > 0 and step % self.bayes_interval == 0
        if bayesian:
            keep = _bo_proposal(self.history, SearchConfig(ratio=self.ratio, unit=self.unit, objective="agreement", seed=self.seed), self.rng, self.bypass)
        if keep is None:
            keep = _random_keep(self.rng, len(self.eligible), self.bypass)
        score = self._agreement(self._mask(keep), context)
        evaluation = Evaluation(keep, 0.0, score, "bo" if bayesian else "random")
        self.history.append(evaluation)
        if self.best is None or score > self.best.agreement:
            self.best, self.since_best = evaluation, 0
            self.mask = self._mask(keep)
        else:
            self.since_best += 1
        if len(self.history) >= self.max_opt_iter or self.since_best >= self.max_tolerance_iter or self.best.agreement >= self.max_score:
            self.optimising = False

    def propose(self, context, num_tokens, sampling, generator):
        if self.optimising and self.cycle % self.opt_interval == 0:
            self._optimise(context)
        self.cycle += 1
        return super().propose(context, num_tokens, sampling, generator)
