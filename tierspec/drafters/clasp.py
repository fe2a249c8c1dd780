"""CLaSP (Chen et al. 2025): self-speculative drafting whose bypassed units are re-chosen during
decoding from the context itself (docs/algorithms.md §CLaSP).

Every ``interval`` verified tokens, before drafting, the dynamic programme of ``tierspec.layerskip.clasp``
picks the ``round(ratio · units)`` units whose bypass keeps the last verified token's state
closest (cosine) to the full model's, layer by layer; the new mask then drafts as a fixed mask
does (``SelfSpeculativeDrafter``: masked passes on top of the full model's cached KV). Where
SWIFT scores random candidate masks by their agreement over a window, one selection here costs
about one target pass over as many rows as the budget, and it needs no warm-up of evaluations.
"""

from __future__ import annotations

import time

from ..errors import TierspecError
from ..layerskip.masks import RoutingMask
from .self_spec import SelfSpeculativeDrafter


class ClaspDrafter(SelfSpeculativeDrafter):
    def __init__(self, num_layers: int, ratio: float = 0.45, unit: str = "sublayer", interval: int = 8):
        """``ratio``: the fraction of units bypassed (counted as ``SwiftDrafter`` counts it: over
        every unit, the first and last layers' included); ``interval``: verified tokens between
        two selections (the paper's "sparse persistence": the best set changes slowly)."""
        if not 0.0 < ratio < 1.0:
            raise TierspecError(f"the CLaSP ratio must be in (0, 1), got {ratio}")
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise TierspecError(f"the CLaSP interval must be an integer >= 1, got {interval!r}")
        self.budget = round(ratio * RoutingMask.total_units(num_layers, unit))
        eligible = len(RoutingMask.eligible_units(num_layers, unit))
        if self.budget > eligible:
            raise TierspecError(f"a ratio of {ratio} bypasses {self.budget} {unit} units; only {eligible} of this "
                                f"{num_layers}-layer model may be bypassed (never the first or last layer)")
        self.num_layers, self.unit, self.ratio, self.interval = num_layers, unit, ratio, interval
        super().__init__(RoutingMask(num_layers, unit))
        self.selections = 0
        self.selection_seconds = 0.0

    def start(self, prompt_ids, features=None, target_view=None) -> None:
        super().start(prompt_ids, features, target_view)
        self.mask = RoutingMask(self.num_layers, self.unit)  # until the first selection: the full model
        self.selected_at: int | None = None  # verified length at the last selection
        self.cosine: float | None = None
        self.selections = 0
        self.selection_seconds = 0.0

    def _select(self, context) -> bool:
        """Choose the mask anew when ``interval`` tokens were verified since the last choice."""
        from ..layerskip.clasp import select_in_context

        verified = self.view.length
        if verified < 1 or (self.selected_at is not None and verified - self.selected_at < self.interval):
            return False
        began = time.perf_counter()
        runner = self.view.full_model_cache()
        self.mask, self.cosine = select_in_context(runner, verified - 1, int(context[verified - 1]), self.unit, self.budget)
        self.selection_seconds += time.perf_counter() - began
        self.selected_at = verified
        self.selections += 1
        return True

    def propose(self, context, request):
        selected = request.budget > 0 and self._select(context)
        proposal = super().propose(context, request)
        proposal.drafter_calls += int(selected)  # a selection is one wide pass of drafter work
        return proposal
