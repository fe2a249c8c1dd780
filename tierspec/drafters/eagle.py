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

import numpy as np
import torch

from dataclasses import dataclass
from typing import Callable, Generator

from ..heads.draft import DraftHead, HeadOutput, HeadRunner, HeadStep
from ..proposal import DraftRequest, RateView
from ..sampling import SamplingConfig
from .base import DraftFeeds, Drafter, FeatureLog, Proposal, drafting_autoregressively, run_steps
from .ngram import NgramDrafter

_NO_TOKENS = torch.empty(0, dtype=torch.long)  # the first draft feeds nothing: its logits are the catch-up's
#: The most committed positions a head with an empty cache feeds in one catch-up (a generation's
#: first try, over the prompt): it starts at the latest of them, as a head started over after a
#: rest starts at the few positions its warm-up cycles logged (``_catch_up``). A catch-up costs
#: about 0.1 ms a position on the default model's head (2-core Zen 3: 88 ms over a 768-token
#: prompt, a dozen target passes) whatever the temperature, while the head's drafts hardly read
#: that far back: on 12 Spec-Bench prompts (9 longer than 64 tokens, up to 1,487) the default
#: method's greedy tokens per cycle were 1.601 with the whole prompt and with its last 64
#: positions (1,042 and 1,047 tokens drafted), 1.166 and 1.168 at temperature 1, and the head's
#: catch-ups took 0.40 → 0.11 s and 0.56 → 0.14 s of 14–21 s of generation.
FIRST_CATCH_UP = 64


class EagleDrafter(Drafter):
    """Drafts with a trained ``DraftHead`` over its reduced vocabulary V_K; the proposal's
    distributions are over the full vocabulary with p(v) = 0 outside V_K."""

    needs_target_features = True
    drafts_in_head_steps = True

    def __init__(self, head: DraftHead):
        self.head = head
        self.feature_layers = head.config.feature_layers
        self.runner = HeadRunner(head)
        self.vocab_size = head.config.vocab_size
        self._draft_ids = head.draft_ids.cpu()  # [K] target ids of the head's vocabulary
        self._feeds = DraftFeeds()  # its drafts fed back to it (grown to the largest block asked for)
        self._input_dtype = head.fc.weight.dtype  # the features are cast to it
        self.features: FeatureLog | None = None  # the generation's, owned by the loop's verifiers
        self._last_output: torch.Tensor | None = None
        self._first = 0  # the target position of the head's cache slot 0

    @property
    def feature_history(self) -> int:
        return FIRST_CATCH_UP  # a first catch-up feeds no earlier position (``_catch_up``)

    def start(self, prompt_ids, features: FeatureLog | None = None, target_view=None) -> None:
        self.runner.reset()
        self.features = features
        self._last_output = None
        self._first = 0

    def _catch_up(self, context: np.ndarray) -> HeadStep | None:
        """The first step of a block: feed every committed position the head has not seen (its
        feature read from the log) and score the last (≈ the pending token's feature); with none
        new, score the head's last output again. None when the head cannot draft yet.

        Where the log has no rows for positions the head has not fed (cycles whose drafter wanted
        no features: ``FeatureLog.start``), the head starts over from the log's first row: its
        cache is emptied and slot 0 is that position. Its positions are then its own count, not
        the target's: the head's attention sees only differences of positions (rotary), so a head
        started at position p drafts as one whose context began there."""
        start = self._first + self.runner.length
        if self.features is not None and start < self.features.start:
            self.runner.rollback(0)
            self._first = start = self.features.start
            self._last_output = None
        end = 0 if self.features is None else self.features.length
        if self.runner.length == 0 and end - start > FIRST_CATCH_UP:  # a first catch-up: the latest positions
            self._first = start = end - FIRST_CATCH_UP
            self._last_output = None
        pending_position = len(context) - 1  # the last committed token, not yet run by the target
        if end != pending_position or start >= end:
            if start == end == pending_position and self._last_output is not None:
                return HeadStep(self.runner, None, last=self._last_output)
            return None
        values = self.features.read(start, end)
        if values.dtype != self._input_dtype:
            values = values.to(self._input_dtype)
        return HeadStep(self.runner, values, torch.as_tensor(context[start + 1 : end + 1]), from_target=True)

    def _caught_up(self, context: np.ndarray) -> torch.Tensor | None:
        """The catch-up alone (``_catch_up``'s positions fed, no logits): the head's output at the
        last committed position [1, H], or None when the head cannot draft yet (a tree drafter
        scores its outputs itself)."""
        step = self._catch_up(context)
        if step is not None and step.inputs is not None:
            self._last_output = self.runner.extend(step.inputs, step.next_tokens, from_target=True)[-1:]
        return None if step is None else self._last_output

    def drafting(self, context: np.ndarray, request: DraftRequest) -> Generator[HeadStep, HeadOutput, Proposal]:
        """The block as head steps (``heads.draft.HeadStep``, answered by whoever drives it: alone
        by ``propose``, beside other sequences' by the cycle): the catch-up and the first draft's
        logits in one step, then one step per further draft on the head's own output. The drafted
        positions are dropped from the head's cache at the end (recomputed from real features)."""
        if request.budget <= 0:
            return Proposal.empty()
        step = self._catch_up(context)
        if step is None:
            return Proposal.empty(source="head")
        out = yield step
        self._last_output = out.last
        committed = self.runner.length
        drafting = drafting_autoregressively(_NO_TOKENS, request, "head", self._draft_ids, self.vocab_size,
                                             self._feeds)
        try:
            next(drafting)  # the first draft's logits are the catch-up's
            while True:
                tokens = drafting.send(out.logits)
                out = yield HeadStep(self.runner, out.last, tokens)
        except StopIteration as done:
            return done.value
        finally:
            self.runner.rollback(committed)

    def propose(self, context: np.ndarray, request: DraftRequest) -> Proposal:
        return run_steps(self.drafting(context, request), self.runner.step)

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
        keep = max(committed_length - 1 - self._first, 0)
        if self.runner.length > keep:
            self.runner.rollback(keep)


#: Cycles the hybrid drafts without the head once the head stopped paying (below), before it
#: tries the head again: counted, not timed, so that a seed fixes which cycles try it. Each try
#: after which the head still does not pay doubles the wait, up to ``HEAD_RETRY_MAX_CYCLES``: a
#: try costs a catch-up and a draft that is mostly rejected (at temperature 1 on the default
#: model, with a try every 9 cycles, drafting — mostly those tries — took 5% of the generations'
#: time in a profile of 4 Spec-Bench prompts), so where the head
#: keeps not paying it is tried ever more rarely; once it pays again the wait starts over.
HEAD_RETRY_CYCLES = 8
HEAD_RETRY_MAX_CYCLES = 64
#: Cycles before the head's next try in which the verifier passes record its features again (none
#: while it rests longer or is ruled out): a try then starts the head over from them
#: (``EagleDrafter._catch_up``) with this much of the text behind it, where the features of every
#: resting cycle would cost each of those passes its copy-out (a two-token pass of the default
#: model 6.64 → 6.83 ms featured; a batched pass of 8 sequences × 2 rows 0.2–0.7 ms more in two runs).
HEAD_WARMUP_CYCLES = 2
#: The hybrid's own work in a cycle in which it drafts, in seconds: the n-gram lookup, the policy's
#: rates and trim, keying and learning from the verdict. Measured as the default method's loop time
#: less plain decoding's (``benchmarks/loop_time.py``): 0.19 ms at temperature 1 on a Zen 4
#: (results/zen4/int8/loop_time_after_pass.json), 0.27 greedy on a Zen 3 (docs/history.md); 0.08–0.09
#: on the Intel Xeon with AMX averaged over every cycle, drafting or not (results/xeon_amx/loop_time3.log).
#: Seconds, not a fraction of the pass: it is Python's work,
#: the same beside the default model's 3-ms pass as beside an 8B model's (as 0.03 of a pass it was
#: 0.08 ms on the Xeon's 2.7-ms pass and 4.5 ms beside Llama 3.1 8B's 149-ms int8 pass on a Zen 3,
#: results/scale/zen3/int8_passes.log). A constant, not the
#: clock's reading, so that a seed fixes which cycles draft.
DRAFTING_CYCLE_SECONDS = 0.19e-3
#: Cycles the hybrid runs no n-gram lookup (nor its candidate's rates, keying and learning) once
#: what those drafts saved of late no longer pays for its own work (``DRAFTING_CYCLE_SECONDS``),
#: before it looks again; each pause after which they still do not pay doubles the next, up to
#: ``DORMANT_MAX_CYCLES``. The head's schedule is its own. Counted, not timed.
DORMANT_CYCLES = 8
DORMANT_MAX_CYCLES = 64


@dataclass(frozen=True, slots=True)
class HybridSchedule:
    """How long a hybrid had learned to rest what does not pay, after its latest cycle: what the
    next generation of the same method at the same sampling settings starts from (``ScheduleMemory``).

    wait:         idle cycles before the head's next try, should it not pay
    dormant_wait: the n-gram lookup's next pause, should its drafts not pay
    idle:         the idle cycles since the head's last try, where its wait is at ``HEAD_RETRY_MAX_CYCLES``
                  and it paid nowhere in the generation: the rest the next generation carries on
                  (``ScheduleMemory``); None: the next generation tries the head at its first cycle
    """

    wait: int
    dormant_wait: int
    idle: int | None = None


class ScheduleMemory:
    """What one method's hybrid generations learned about how long to rest the head and the n-gram
    lookup where they do not pay, by sampling settings. Each generation looks up n-grams from its
    first cycle (a new prompt is new evidence: what a lookup finds is the prompt's), and tries the
    head at its first cycle (at temperature 0 carrying the rest itself into the next generation cost
    1.3% on Spec-Bench prompts) — but where they do not pay it waits as long as the latest
    generation at its settings had learned to, not 8, 16, 32 … cycles over again: at temperature 1
    on the default model the head pays almost nowhere, and every generation tried it four times
    (docs/algorithms.md §Draft-length policies). Where the latest generation's head paid at no cycle
    and its wait had reached its longest (``HEAD_RETRY_MAX_CYCLES``: its last four tries did not
    pay — at temperature 1 on the default model, every generation after the first few), the rest
    itself carries on: no first try, the next after the wait's idle cycles counted across
    generations (``HybridSchedule.idle``), so that the head is tried once every 64 cycles however
    short the generations. A generation whose head paid somewhere (greedy, on a prompt it drafts
    well) lets the next try it at once (but for a try in its very last cycle:
    ``HybridDrafter._carried_idle``).
    It changes which cycles draft, never a text (the hybrid's rule is lossless); a method's
    statistics (tokens per pass) then depend on what it generated before.

    Keyed by the ``SamplingConfig``: the head's acceptance moves with the temperature and the
    filters. Kept only at settings where ``applies`` (the rule's ``emits_target_tokens``: greedy, or
    the coupled rule): under the residual rule a sampled text follows the drafts, and a seed must
    fix the text whatever ran before. One memory per built method (``methods``); generations
    running side by side in a batch each leave their schedule after their cycles (the latest wins: the
    carried idle count is that of the sequence that committed last)."""

    def __init__(self, applies: Callable[[SamplingConfig], bool]):
        self.applies = applies
        # by settings, a one-item list holding the latest schedule as (wait, dormant_wait, idle): one
        # assignment a keep, no lock needed
        self._schedules: dict[SamplingConfig, list[tuple[int, int, int | None] | None]] = {}

    def recall(self, sampling: SamplingConfig) -> HybridSchedule | None:
        """The schedule the latest generation at ``sampling`` left (None: none yet, or none kept there)."""
        holder = self._schedules.get(sampling)
        return None if holder is None or holder[0] is None else HybridSchedule(*holder[0])

    def slot(self, sampling: SamplingConfig) -> list[tuple[int, int, int | None] | None] | None:
        """Where a generation at ``sampling`` keeps its schedule: a one-item list whose item, (wait,
        dormant_wait, idle), its commits replace (None where the memory does not apply there). Asked
        once a generation: a keep every cycle that hashed the settings and made a ``HybridSchedule``
        was 6% of the default method's loop at one sequence (a py-spy profile, Zen 4)."""
        if not self.applies(sampling):
            return None
        holder = self._schedules.get(sampling)
        return holder if holder is not None else self._schedules.setdefault(sampling, [None])

    def keep(self, sampling: SamplingConfig, schedule: HybridSchedule) -> None:
        """Keep ``schedule`` as the latest at ``sampling`` (where the memory applies): what a generation's
        commits write through its ``slot``, for a caller that holds none (tests plant schedules so)."""
        holder = self.slot(sampling)
        if holder is not None:
            holder[0] = (schedule.wait, schedule.dormant_wait, schedule.idle)


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
    next cycle it runs, in one call — and tries it again after ``HEAD_RETRY_CYCLES`` cycles, then
    after twice as many each time the try did not pay (``HEAD_RETRY_MAX_CYCLES`` at most). Where
    not even drafts certain to be accepted would beat that (``RateView.ceiling_rate``: in a batch
    of four or more on the default model a row is cheap beside the head's step, which a batch does
    not share), the head is not tried at all — no catch-up over the prompt for a try the cost model
    already rules out — and the idle count does not move.

    Where nothing pays, nothing is drafted: when the head is idle or ruled out and what the n-gram
    drafts saved of late (``RateView.saved_seconds``, measured by the verdicts) does not pay for
    the hybrid's own work in a cycle (``DRAFTING_CYCLE_SECONDS``) after as many
    cycles of such drafting as a dormancy lasts, the n-gram lookup goes dormant — ``DORMANT_CYCLES``
    cycles without it or its candidate's rates, keying and learning — then looks again, after twice
    as long each time its drafts still did not pay (``DORMANT_MAX_CYCLES`` at most). The head keeps
    its own schedule meanwhile (its tries come as they would: at temperature 0 a dormancy that held
    the head's tries back too cost τ 1.53 → 1.50 on Spec-Bench). At temperature 1 on the default
    model the n-gram drafts only pay for their rows (a first draft's chance 0.18–0.19, a row
    0.09–0.18 of a pass), and the hybrid's own work made it 2-5% slower than plain decoding in some
    categories.

    With a ``ScheduleMemory`` (the built method's, ``methods``) a generation's first wait and first
    pause are as long as the latest generation at its sampling settings had made them; where that
    wait had reached ``HEAD_RETRY_MAX_CYCLES`` in a generation whose head paid nowhere, the next makes no
    first try: the head's rest goes on, its idle cycles counted across generations (``_carried_idle``)."""

    needs_target_features = True
    drafts_in_head_steps = True

    def __init__(self, ngram: NgramDrafter, eagle: EagleDrafter, memory: ScheduleMemory | None = None):
        self.ngram, self.eagle = ngram, eagle
        self.memory = memory
        self._recalled = False  # the generation's first drafting cycle has read the memory (``_recall``)
        self._slot: list | None = None  # where the memory keeps this generation's schedule (``ScheduleMemory.slot``)
        self.feature_layers = eagle.feature_layers
        self._idle = 0  # cycles since the head last ran while it did not pay
        self._wait = HEAD_RETRY_CYCLES  # idle cycles before the next try
        self._resting = False  # the last cycle left the head idle because it did not pay
        self._paid = False  # the head's rate beat its bar at some cycle of this generation
        self._rest_earned = False  # this generation made a try that did not pay, or carried a rest in: its own evidence
        self._ruled_out = False  # the last cycle's cost model ruled the head out (not even certain drafts pay)
        self._head_ran = False  # the head ran (caught up or drafted) since the last commit
        self._dormant = 0  # cycles left without the n-gram lookup
        self._dormant_wait = DORMANT_CYCLES  # the next dormancy's length
        self._looked = 0  # cycles of n-gram drafting with the head idle that did not pay, since a pause or paying ones

    def start(self, prompt_ids, features=None, target_view=None) -> None:
        self.ngram.start(prompt_ids, features, target_view)
        self.eagle.start(prompt_ids, features, target_view)
        self._idle, self._wait = 0, HEAD_RETRY_CYCLES
        self._resting = self._ruled_out = self._paid = self._rest_earned = self._head_ran = False
        self._dormant, self._dormant_wait, self._looked = 0, DORMANT_CYCLES, 0
        self._recalled, self._slot = False, None

    def _recall(self, sampling: SamplingConfig) -> None:
        """The generation's first drafting cycle: its waits from the latest generation at the same
        settings (``ScheduleMemory``)."""
        self._recalled = True
        schedule = None if self.memory is None else self.memory.recall(sampling)
        if schedule is not None:
            self._wait, self._dormant_wait = schedule.wait, schedule.dormant_wait
            if schedule.idle is not None:  # the head paid nowhere in the last generation here: its rest goes on
                self._idle, self._resting = schedule.idle, True
                self._rest_earned = True
        self._slot = None if self.memory is None else self.memory.slot(sampling)

    def _carried_idle(self) -> int | None:
        """The idle count the memory keeps (``HybridSchedule.idle``): the rest's, where the wait is at its
        longest, this generation has evidence of its own (a try that did not pay, or the rest it
        carried in: not a generation whose head was ruled out throughout, as in a large batch) and
        the head's rate beat its bar at no cycle (0 after a try); else None. A generation whose head
        paid somewhere — greedy, on a prompt it drafts well — lets the next try it at once: at
        temperature 0 a head that stopped paying late in one prompt often pays from the start of the
        next. The one exception: a generation whose last cycle was a try that paid keeps 0 (that it
        paid is learned at the next drafting cycle, from its verdict's rates), and the next
        generation rests up to 64 cycles before its first try."""
        if self._wait >= HEAD_RETRY_MAX_CYCLES and self._rest_earned and not self._paid:
            return self._idle
        return None

    @property
    def feature_history(self) -> int:
        return self.eagle.feature_history

    def wants_features(self) -> bool:
        """No features while the head is ruled out, nor while it rests more than
        ``HEAD_WARMUP_CYCLES`` cycles before its next try (after this cycle's drafting: the try
        comes once ``_idle`` has reached ``_wait``)."""
        if self._ruled_out:
            return False
        return not self._resting or self._wait - self._idle < HEAD_WARMUP_CYCLES

    def drafting(self, context: np.ndarray, request: DraftRequest) -> Generator[HeadStep, HeadOutput, Proposal]:
        """The cycle's choice (class docstring): the n-gram candidate at once, or the head's block
        in steps (``EagleDrafter.drafting``)."""
        if request.budget <= 0:
            return Proposal.empty()
        if not self._recalled:  # the generation's first drafting cycle
            self._recall(request.sampling)
        rates: RateView = request.policy  # methods pairs this drafter with a CostAware policy
        looking = not self._dormant  # a dormant lookup: its drafts have not paid for the hybrid's work of late
        if looking:
            candidate = self.ngram.propose(context, request)
        else:
            self._dormant -= 1
            candidate = Proposal.empty()
        worth, self._ruled_out = rates.draft_bar("head")  # what a cycle's head must beat; whether nothing can
        if self._ruled_out:  # not even certain drafts would pay: no try, no catch-up
            if looking:
                self._weigh_lookup(rates)
            return candidate
        head_rate = rates.source_rate("head")  # None until the head has drafted: try it (unless a carried rest lasts)
        if len(candidate) and head_rate is not None and rates.expected_rate(candidate) > head_rate:
            self._resting = False
            self._paid = self._paid or head_rate > worth  # the head would pay: the lookup pays more
            return candidate  # the head catches up when it next runs
        # untried but resting: the rest the memory carried on (``ScheduleMemory``) lasts until its try
        if head_rate is not None and head_rate <= worth or head_rate is None and self._resting:
            if self._idle < self._wait:
                self._idle += 1
                self._resting = True
                if looking:
                    self._weigh_lookup(rates)
                return candidate  # the n-gram candidate (possibly empty): the head is not worth its cycle
            # A try: should the head still not pay after it, the next try waits twice as long.
            self._idle, self._wait, self._rest_earned = 0, min(2 * self._wait, HEAD_RETRY_MAX_CYCLES), True
        elif head_rate is not None:  # it pays: a wait once it stops starts short again
            self._idle, self._wait, self._paid = 0, HEAD_RETRY_CYCLES, True
        # (untried: the first wait, should it not pay, is the one recalled)
        self._resting = False
        self._head_ran = True
        return (yield from self.eagle.drafting(context, request))

    def _weigh_lookup(self, rates: RateView) -> None:
        """After a lookup in a cycle that leaves the head idle: where what the n-gram drafts saved
        of late does not pay for the hybrid's own work in a cycle, a dormancy begins (class
        docstring) — this cycle's candidate still verified, its verdict the last evidence before
        the pause."""
        saved = rates.saved_seconds("ngram")
        self._looked += 1
        if saved is not None and saved > DRAFTING_CYCLE_SECONDS:
            self._dormant_wait, self._looked = DORMANT_CYCLES, 0
        elif saved is not None and self._looked >= DORMANT_CYCLES:  # evidence of as many cycles as a pause
            self._dormant, self._looked = self._dormant_wait, 0
            self._dormant_wait = min(2 * self._dormant_wait, DORMANT_MAX_CYCLES)

    def propose(self, context: np.ndarray, request: DraftRequest) -> Proposal:
        return run_steps(self.drafting(context, request), self.eagle.runner.step)

    def commit(self, committed_length: int) -> None:
        # Only a head that ran since the last commit can hold positions past the committed ones: the
        # others' caches were rolled back then, and committed tokens only grow (a batch's idle heads
        # skip reading their caches' lengths, cold after the pass). After a block drafted to its end
        # the head holds committed positions only (``EagleDrafter.drafting`` drops its drafts): the
        # rollback is for a block left unfinished.
        if self._head_ran:
            self._head_ran = False
            self.eagle.commit(committed_length)
        if self._slot is not None:
            schedule = (self._wait, self._dormant_wait, self._carried_idle())
            # written where it differs from what the slot holds (a batch commits every sequence each
            # cycle; the slot is shared by the generations at these settings): every cycle while the head
            # rests at its longest wait, whose idle count the next generation carries on
            if schedule != self._slot[0]:
                self._slot[0] = schedule
