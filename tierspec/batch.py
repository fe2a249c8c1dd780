"""Many generations, one pass per cycle: continuous batching with speculative decoding.

``BatchDecoder`` holds the generations running on one loaded model (each a ``decode.Sequence``:
its method's drafter, policy and rule, its seed's noise, its cache, committed tokens and
statistics) and runs ``decode.cycle`` over them: every generation whose text cannot depend on what
shares its cycles (a lossless rule verifying one pass's scores: ``Sequence.batchable``) in **one**
cycle — their drafts cut to what pays for the batch, one pass over all their rows on the pass
engine — and each other generation (a lossy rule, whose text depends on its drafts; VIA-SD's tiers,
which drive passes of their own) in a cycle of its own, exactly as it runs alone. Generations join
at any cycle: on the engine their prompts are prefilled in chunks inside the cycles (the rows the
decoding generations leave), so a long prompt does not stall the others; they leave when done or
cancelled.

Every generation's tokens are exactly its solo tokens, whatever else shares the batch and whenever
it joined: a row's logits are bitwise those of its solo pass (row-independent products, attention
per sequence, tested), the noise is keyed by the generation's seed and position, and a lossless
rule's emitted token at each position is the target's own whatever was drafted — so the draft
lengths the batch chooses change the speed, not the text. docs/algorithms.md §Batched generation says
why the engine's rows are independent.
"""

from __future__ import annotations

from typing import Hashable

import torch

from .decode import CycleTimes, DecodeConfig, DecodeMethod, Sequence, Step, cycle, open_sequence
from .engine import threads_for
from .errors import TierspecError
from .models import LoadedModel
from .passes import pass_backend


class BatchError(TierspecError):
    """A generation a batch cannot take (a full batch, a key already running)."""


class BatchDecoder:
    """Continuous batching on one model (see the module doc). ``add`` a generation, then ``step``
    runs one cycle for every active one and returns their ``Step``s; finished generations leave the
    batch by themselves, ``cancel`` removes one early. ``max_batch``: generations at once (``add``
    refuses more); ``max_rows``: at most that many rows per batched pass (drafts are cut to fit;
    every generation keeps at least its one row; a joining prompt takes the rows left);
    ``shared_costs``: each policy costs its drafts as the batch's passes (False: as if alone).
    ``lone_prefill``: the rows a prompt prefilled alone takes a cycle (None: all; ``decode.cycle``).
    ``times``: where the cycles' time went (``decode.CycleTimes``)."""

    def __init__(self, target: LoadedModel, max_batch: int = 8, max_rows: int | None = None,
                 shared_costs: bool = True, lone_prefill: int | None = None):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise BatchError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < max_batch):
            raise BatchError(f"max_rows must leave every generation of a full batch its row (an integer >= max_batch "
                             f"= {max_batch}), got {max_rows!r}")
        self.target = target
        self.max_batch = max_batch
        self.max_rows = max_rows
        self.shared_costs = shared_costs  # False: policies cost drafts as if alone (for comparison)
        if lone_prefill is not None and (isinstance(lone_prefill, bool) or not isinstance(lone_prefill, int)
                                         or lone_prefill < 1):
            raise BatchError(f"lone_prefill must be an integer >= 1 or None, got {lone_prefill!r}")
        self.lone_prefill = lone_prefill
        self.passes = pass_backend(target.model)
        self.sequences: dict[Hashable, Sequence] = {}
        self.failed: list[Sequence] = []  # ended by their own error, not yet taken (``take_failed``)
        self.times = CycleTimes()

    def __len__(self) -> int:
        return len(self.sequences)

    def add(self, key: Hashable, method: DecodeMethod, prompt_ids: torch.Tensor, config: DecodeConfig,
            seed: int | torch.Generator | None = None) -> Sequence:
        """Start a generation under ``key``: checked and ready for the next ``step`` (on the pass
        engine its prompt is prefilled by the coming cycles; elsewhere now, in a pass of its own,
        which is what keeps its text its solo text there)."""
        if key in self.sequences:
            raise BatchError(f"a generation with key {key!r} is already running")
        if len(self.sequences) >= self.max_batch:
            raise BatchError(f"the batch is full ({self.max_batch} generations)")
        with threads_for(self.target.model):
            sequence = open_sequence(self.target, method, prompt_ids, config, seed, key=key,
                                     prefill=not self.passes.shares_passes)
        self.sequences[key] = sequence
        return sequence

    def run_all(self, prompts: list[torch.Tensor], method: DecodeMethod, config: DecodeConfig,
                seed: int | None = None) -> list[Sequence]:
        """Every prompt generated to its end, at most ``max_batch`` at a time, a finished
        generation's place taken by the next prompt (as the server admits requests). The
        generations in prompt order."""
        done: list[Sequence] = []
        while len(done) < len(prompts) or len(self):
            while len(done) < len(prompts) and len(self) < self.max_batch:
                done.append(self.add(len(done), method, prompts[len(done)], config, seed))
            self.step()
            for failed in self.take_failed():
                raise failed.error
        return done

    def cancel(self, key: Hashable) -> None:
        """Drop a generation (its cache goes with it)."""
        self.sequences.pop(key, None)

    def step(self) -> list[tuple[Sequence, Step]]:
        """One cycle for every active generation: the batchable ones (and every prompt still
        prefilling) together, each other one alone. Returns each decoding generation's ``Step``
        (a finished one has left the batch afterwards)."""
        if not self.sequences:
            return []
        live = list(self.sequences.values())
        together = [s for s in live if s.batchable or not s.ready]
        groups = [together] if together else []
        groups += [[s] for s in live if s.ready and not s.batchable]
        out: list[tuple[Sequence, Step]] = []
        with threads_for(self.target.model), torch.inference_mode():
            for group in groups:
                steps, times = cycle(group, self.passes, self.max_rows, self.shared_costs, self.lone_prefill)
                self.times.add(times)
                out += steps
        for sequence, _ in out:
            if sequence.finished:
                self.sequences.pop(sequence.key, None)
        for sequence in live:  # ended by an error of its own (``Sequence.error``): no step, out of the batch
            if sequence.error is not None and self.sequences.pop(sequence.key, None) is not None:
                self.failed.append(sequence)
        return out

    def take_failed(self) -> list[Sequence]:
        """The generations an error of their own ended since the last call (``Sequence.error``:
        a constraint's dead end); the others went on."""
        failed, self.failed = self.failed, []
        return failed

