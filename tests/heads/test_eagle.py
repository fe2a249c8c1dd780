"""The trained draft head (docs/algorithms.md §Draft head): the unrolled training forward equals
drafting, the drafter is lossless (greedy and sampled, over a reduced vocabulary), files are
checked, and training on a tiny model lowers the validation loss."""

import pytest
import numpy as np
import torch
from conftest import as_method, char_tokenizer, run_ids, tiny_llama

from tierspec.decode import DecodeConfig, decode
from tierspec.drafters import NgramDrafter, NoDrafter
from tierspec.drafters.eagle import EagleDrafter, HybridDrafter
from tierspec.heads.draft import DraftHead, DraftHeadError, HeadRunner
from tierspec.training.draft_train import (
    Sequence,
    TrainConfig,
    chain_mask,
    collate,
    draft_vocabulary,
    fit_head,
    unrolled_forward,
    validate,
    vocabulary_coverage,
)
from tierspec.policies import CostAware
from tierspec.sampling import SamplingConfig


@pytest.fixture(scope="module")
def target32():
    return tiny_llama(seed=5, sharpness=20.0, dtype=torch.float32)


def random_head(target, vocab=None, seed=3):
    draft_ids = torch.arange(target.vocab_size) if vocab is None else vocab
    return DraftHead.for_target(target, draft_ids, seed=seed).eval()


def test_chain_mask_on_a_hand_built_case():
    # step 3, position 4: step-1 keys ≤ 2 (the chain's origin), the step-2 key at 3, itself (step 3) at 4
    mask = chain_mask(6, 3)
    assert mask[4, :6].tolist() == [True, True, True, False, False, False]
    assert mask[4, 6:12].tolist() == [False, False, False, True, False, False]
    assert mask[4, 12:].tolist() == [False, False, False, False, True, False]
    assert chain_mask(4, 1).tolist() == torch.ones(4, 4).tril().bool().tolist()  # step 1: causal


def test_unrolled_training_forward_equals_incremental_drafting(target32):
    """Step j of the unrolled forward at position p is exactly what drafting computes for draft
    j of the chain that starts at p − j + 1 when drafts 1..j−1 were the text's tokens."""
    head = random_head(target32)
    torch.manual_seed(0)
    T = 12
    features, tokens = torch.randn(T, 32), torch.randint(0, 64, (T,))
    batch = collate([Sequence(tokens, features.half(), 2, "own-greedy")])
    f = batch["features"][0]
    with torch.no_grad():
        outputs = unrolled_forward(head, batch, 3)
        for origin in range(T - 4):
            runner = HeadRunner(head)
            h = runner.extend(f[: origin + 1], tokens[1 : origin + 2])[-1:]
            assert torch.allclose(h[0], outputs[0][0, origin], atol=1e-5)
            for j in (2, 3):
                p = origin + j - 1
                h = runner.extend(h, tokens[p + 1 : p + 2])
                assert torch.allclose(h[0], outputs[j - 1][0, p], atol=1e-5)


@pytest.mark.parametrize("vocab", [None, "half"])
@pytest.mark.parametrize("policy", ["fixed", "cost-aware"])
def test_eagle_greedy_equals_ar(target32, prompt_ids, vocab, policy):
    ids = None if vocab is None else torch.arange(0, 64, 2)  # tokens outside V_K are never drafted
    drafter = EagleDrafter(random_head(target32, ids))
    reference = run_ids(target32, as_method(NoDrafter()), prompt_ids, 40)
    chosen = CostAware(6, cost=lambda k, source="": 46 + 7 * k) if policy == "cost-aware" else None
    seen = []

    def inspect(verifiers, d):
        # the head holds exactly the committed positions the target has features for
        assert d.runner.length <= len(verifiers.context) - 1
        seen.append(d.runner.length)

    assert run_ids(target32, as_method(drafter, policy=chosen, num_draft=4), prompt_ids, 40, inspect=inspect) == reference
    assert len(seen) > 2


def test_the_head_reads_the_loops_one_feature_log(target32, prompt_ids):
    """The draft head keeps no copy of the target's features: it reads the log the verifiers
    write, whose rows are allocated once for the generation."""
    drafter = EagleDrafter(random_head(target32))
    rows = []

    def inspect(verifiers, d):
        assert d.features is verifiers.features and d.features.length == verifiers.runner.length
        rows.append(verifiers.features._rows.data_ptr())

    run_ids(target32, as_method(drafter, num_draft=4), prompt_ids, 40, inspect=inspect)
    assert len(rows) > 2 and len(set(rows)) == 1


def test_eagle_after_a_one_token_prompt_equals_ar(target32):
    """A one-token prompt leaves the prefill nothing to process: the head starts from no features
    (a server's completion of "Hello" hit this)."""
    one = torch.tensor([5])
    reference = run_ids(target32, as_method(NoDrafter()), one, 20)
    assert run_ids(target32, as_method(EagleDrafter(random_head(target32)), num_draft=3), one, 20) == reference


def test_a_head_that_is_the_target_is_accepted_throughout(prompt_ids):
    """A planted perfect head: for a 1-layer target whose last layer the head copies, with W_fc
    passing the feature through, drafts are not the target's — so instead check the converse:
    a drafter fed the target's own greedy tokens (hybrid's n-gram side on a repeating prompt)
    keeps the output identical."""
    target = tiny_llama(seed=5, sharpness=20.0, dtype=torch.float32)
    policy = CostAware(6, cost=lambda k, source="": 46 + 7 * k)
    hybrid = HybridDrafter(NgramDrafter(3), EagleDrafter(random_head(target)))
    reference = run_ids(target, as_method(NoDrafter()), prompt_ids, 40)
    assert run_ids(target, as_method(hybrid, policy=policy), prompt_ids, 40) == reference


def _hybrid_head_runs(target, head_rates, ceilings=None, wants: list | None = None, saved=None,
                      looked: list | None = None, memory=None, sampling=SamplingConfig(0.0),
                      lookup_wins: list[bool] | None = None) -> list[bool]:
    """Which cycles ran the hybrid's head, one cycle per entry of ``head_rates`` (the head's learned
    rate that cycle; None: not tried yet), under planted rates: drafting nothing pays 1 token per
    unit time, a head step costs 0.1 of a pass, n-gram lookup finds nothing, and certain drafts
    would pay ``ceilings[i]`` (default 2: the head could pay); the n-gram drafts saved ``saved[i]``
    a cycle of late (default None: no evidence yet). ``wants``: gets the hybrid's
    ``wants_features`` after each cycle's drafting; ``looked``: whether each cycle ran the n-gram
    lookup. ``memory``: the method's ``ScheduleMemory`` (one generation at ``sampling`` each call,
    every cycle committed). ``lookup_wins[i]``: the lookup finds a chain expected to pay more than the
    head that cycle."""
    from tierspec.proposal import DraftRequest, Proposal

    rate = [None]
    ceiling = [2.0]
    saving = [None]
    wins = [False]

    class Rates:
        def source_rate(self, source):
            return rate[0]

        def plain_rate(self):
            return 1.0

        def ceiling_rate(self, source):
            assert source == "head"
            return ceiling[0]

        def draft_step_fraction(self, source):
            return 0.1

        def draft_bar(self, source):
            worth = self.plain_rate() * (1 + self.draft_step_fraction(source))
            return worth, self.ceiling_rate(source) <= worth

        def expected_rate(self, proposal):
            return 10.0 if wins[0] else 0.0

        def saved_seconds(self, source):
            assert source == "ngram"
            return saving[0]

    eagle = EagleDrafter(random_head(target))
    calls = []
    def drafting(context, request):  # the head's steps: none, an empty block
        calls.append(1)
        yield from ()
        return Proposal.empty(source="head")

    eagle.drafting = drafting
    ngram = NgramDrafter(3)
    lookups = [0]
    lookup = ngram.propose
    found = Proposal.chain(torch.tensor([1, 2]), match_sizes=[1, 1], source="ngram")
    ngram.propose = lambda *args: lookups.__setitem__(0, lookups[0] + 1) or (found if wins[0] else lookup(*args))
    hybrid = HybridDrafter(ngram, eagle, memory)
    context = np.arange(40, 60)  # no repeated n-gram: lookup finds nothing
    hybrid.start(context[:10])
    request = DraftRequest(budget=4, sampling=sampling, noise=None, policy=Rates())
    ran = []
    for i, head_rate in enumerate(head_rates):
        rate[0] = head_rate
        ceiling[0] = 2.0 if ceilings is None else ceilings[i]
        saving[0] = None if saved is None else saved[i]
        wins[0] = lookup_wins is not None and lookup_wins[i]
        before, looked_before = len(calls), lookups[0]
        hybrid.propose(context, request)
        hybrid.commit(len(context))
        if looked is not None:
            looked.append(lookups[0] > looked_before)
        ran.append(len(calls) > before)
        if wants is not None:
            wants.append(hybrid.wants_features())
    return ran


@pytest.mark.parametrize("head_rate", [None, 1.2])
def test_the_hybrid_runs_a_head_that_pays_or_is_untried_every_cycle(target32, head_rate):
    assert all(_hybrid_head_runs(target32, [head_rate] * 40))


def test_the_hybrid_leaves_a_head_that_does_not_pay_idle_and_tries_it_ever_more_rarely(target32):
    """A head whose learned rate (1.05) does not beat drafting nothing by one head step (0.1) is
    left idle — no head call, not even its catch-up — for ``HEAD_RETRY_CYCLES`` cycles, then tried;
    each try after which it still does not pay doubles the wait, up to ``HEAD_RETRY_MAX_CYCLES``."""
    from tierspec.drafters.eagle import HEAD_RETRY_CYCLES, HEAD_RETRY_MAX_CYCLES

    ran = _hybrid_head_runs(target32, [1.05] * 400)
    tries = [i for i, r in enumerate(ran) if r]
    waits = [b - a - 1 for a, b in zip([-1] + tries, tries)]
    assert HEAD_RETRY_CYCLES == 8 and HEAD_RETRY_MAX_CYCLES == 64
    assert waits == [8, 16, 32, 64, 64, 64, 64, 64]  # tries at cycles 8, 25, 58, 123, 188, 253, 318, 383


def test_a_head_that_pays_again_after_a_try_starts_the_wait_over(target32):
    """Idle 8 cycles, a try, idle 16, a try after which the head pays (1.2): it runs every cycle;
    when it stops paying again the first wait is 8 cycles again, not 32."""
    rates = [1.05] * 9 + [1.05] * 17 + [1.2] * 5 + [1.05] * 20
    ran = _hybrid_head_runs(target32, rates)
    tries = [i for i, r in enumerate(ran) if r]
    assert tries == [8, 25, 26, 27, 28, 29, 30, 39]


def test_the_hybrid_never_tries_a_head_that_even_certain_drafts_would_not_pay_for(target32):
    """Where drafts accepted for certain would not beat drafting nothing by a head step (ceiling
    1.1 ≤ 1.0 · (1 + 0.1)), the head is not run — not even untried, whose first try would catch it
    up over the whole prompt — and its idle count stands still: once the ceiling rises an untried
    head is tried at once, and a head that does not pay keeps its place in its wait."""
    assert not any(_hybrid_head_runs(target32, [None] * 20 + [1.2] * 20, [1.1] * 40))
    assert _hybrid_head_runs(target32, [None] * 3, [1.1, 1.1, 1.11]) == [False, False, True]
    ran = _hybrid_head_runs(target32, [1.05] * 30, [1.1] * 10 + [2.0] * 20)
    assert [i for i, r in enumerate(ran) if r] == [18]  # idle 8 counted from cycle 10 on


def test_the_hybrid_goes_dormant_where_its_drafts_do_not_pay_for_its_own_work(target32):
    """A head that does not pay (1.05) and n-gram drafts that saved less than the hybrid's own work
    in a cycle (``DRAFTING_CYCLE_SECONDS``, whatever a pass costs): after
    ``DORMANT_CYCLES`` cycles of that evidence the hybrid runs no lookup for ``DORMANT_CYCLES``
    cycles, then looks again, each pause twice the last while the drafts still do not pay; the
    head's tries come as they would without the pauses. Drafts that pay (saved above the threshold)
    end it, and a hybrid without evidence yet never pauses."""
    from tierspec.drafters.eagle import DORMANT_CYCLES, DORMANT_MAX_CYCLES, DRAFTING_CYCLE_SECONDS

    assert DORMANT_CYCLES == 8 and DORMANT_MAX_CYCLES == 64
    below, above = 0.5 * DRAFTING_CYCLE_SECONDS, 2 * DRAFTING_CYCLE_SECONDS
    looked = []
    ran = _hybrid_head_runs(target32, [1.05] * 120, saved=[below] * 120, looked=looked)
    # looks 0-7 (the head idle), a pause of 8 (8-15) with the head's first try at 8 (its wait of 8 over), looks 16-23,
    # a pause of 16 (24-39) with its second try at 25, looks 40-47, a pause of 32 (48-79) with its third at 58, ...
    assert [i for i, seen in enumerate(looked) if not seen] == (list(range(8, 16)) + list(range(24, 40))
                                                                 + list(range(48, 80)) + list(range(88, 120)))
    assert [i for i, r in enumerate(ran) if r] == [8, 25, 58]  # the head's schedule without pauses: 8, 25, 58, 123
    assert [i for i, r in enumerate(ran) if r] == [i for i, r in enumerate(_hybrid_head_runs(target32, [1.05] * 120)) if r]
    # drafts that pay: never dormant, and a pause that ends in paying drafts starts the waits over
    looked = []
    _hybrid_head_runs(target32, [1.05] * 60, saved=[above] * 60, looked=looked)
    assert all(looked)
    looked = []
    _hybrid_head_runs(target32, [1.05] * 60, saved=[below] * 20 + [above] * 10 + [below] * 30, looked=looked)
    assert [i for i, seen in enumerate(looked) if not seen] == list(range(8, 16)) + list(range(38, 46)) + list(range(54, 60))
    looked = []
    _hybrid_head_runs(target32, [1.05] * 40, saved=None, looked=looked)
    assert all(looked)


def test_a_generation_waits_as_long_as_the_last_at_its_settings_had_learned_to(target32):
    """With the method's ``ScheduleMemory`` a generation still tries the head at its first cycle (a
    fresh policy knows no rate: untried), but where it does not pay the wait before the next try is
    the one the latest generation at its sampling settings had reached, not 8 again; a head that
    pays starts the waits over; another temperature, or no memory, starts from 8. Where the wait
    had reached its longest (64: the last four tries did not pay) in a generation whose head paid
    nowhere, the rest itself goes on: no first try, the next when the idle cycles counted across the
    generations reach 64, and no features recorded until the two cycles before it; a generation
    whose head paid somewhere lets the next try at once."""
    from tierspec.drafters.eagle import HEAD_RETRY_MAX_CYCLES, HEAD_WARMUP_CYCLES, HybridSchedule, ScheduleMemory

    hot, greedy = SamplingConfig(1.0), SamplingConfig(0.0)
    memory = ScheduleMemory(lambda sampling: True)
    tries = lambda ran: [i for i, r in enumerate(ran) if r]
    assert tries(_hybrid_head_runs(target32, [None] + [1.05] * 99, memory=memory, sampling=hot)) == [0, 9, 26, 59]
    assert memory.recall(hot).wait == HEAD_RETRY_MAX_CYCLES and memory.recall(hot).idle == 40  # cycles 60-99
    assert memory.recall(greedy) is None
    wants = []
    # idle 40 carried: 24 more idle cycles (0-23), untried; the try at 24, then 64 idle (25-88), a try at 89
    ran = _hybrid_head_runs(target32, [None] * 25 + [1.05] * 75, memory=memory, sampling=hot, wants=wants)
    assert tries(ran) == [24, 89]
    assert HEAD_WARMUP_CYCLES == 2 and [i for i, w in enumerate(wants[:60]) if w] == [22, 23, 24]
    assert memory.recall(hot).idle == 10
    # a last cycle the lookup's chain won (the head idle, not resting on it) carries the idle count too
    wins = [False] * 20 + [True]
    assert tries(_hybrid_head_runs(target32, [1.05] * 21, memory=memory, sampling=hot, lookup_wins=wins)) == []
    assert memory.recall(hot).wait == HEAD_RETRY_MAX_CYCLES and memory.recall(hot).idle == 30
    assert tries(_hybrid_head_runs(target32, [None] + [1.05] * 30, memory=memory, sampling=greedy)) == [0, 9, 26]
    assert tries(_hybrid_head_runs(target32, [None] + [1.05] * 30, sampling=hot)) == [0, 9, 26]  # no memory
    # a wait short of the longest carries no rest: the next generation tries at once, then waits 32
    memory = ScheduleMemory(lambda sampling: True)
    assert tries(_hybrid_head_runs(target32, [None] + [1.05] * 30, memory=memory, sampling=hot)) == [0, 9, 26]
    assert memory.recall(hot).wait == 32 and memory.recall(hot).idle is None
    assert tries(_hybrid_head_runs(target32, [None] + [1.05] * 40, memory=memory, sampling=hot)) == [0, 33]
    assert memory.recall(hot).wait == HEAD_RETRY_MAX_CYCLES  # the try at 33 did not pay either
    # a head that paid (cycle 1), then four tries that did not: the wait at 64, but the next generation tries at once
    memory = ScheduleMemory(lambda sampling: True)
    assert tries(_hybrid_head_runs(target32, [None, 1.2] + [1.05] * 130, memory=memory, sampling=hot)) == \
        [0, 1, 10, 27, 60, 125]
    assert memory.recall(hot).wait == HEAD_RETRY_MAX_CYCLES and memory.recall(hot).idle is None
    assert tries(_hybrid_head_runs(target32, [None] + [1.05] * 10, memory=memory, sampling=hot)) == [0]
    assert memory.recall(hot).idle is None  # no try of its own that did not pay (nor a rest carried in): no evidence
    assert tries(_hybrid_head_runs(target32, [None] + [1.05] * 69, memory=memory, sampling=hot)) == [0, 65]
    assert memory.recall(hot).idle == 4  # its try at 65 did not pay: cycles 66-69 carried on
    # a head whose rate beats its bar where the lookup's chain beats it: paid, so the next generation tries at once
    ran = _hybrid_head_runs(target32, [1.2] * 3, memory=memory, sampling=hot, lookup_wins=[True] * 3)
    assert tries(ran) == [] and memory.recall(hot).idle is None
    # a generation whose head is ruled out throughout (a large batch) has no evidence: what the memory held stays
    for held in (None, 7):
        memory.keep(hot, HybridSchedule(HEAD_RETRY_MAX_CYCLES, 8, held))
        assert tries(_hybrid_head_runs(target32, [1.05] * 5, [1.1] * 5, memory=memory, sampling=hot)) == []
        assert memory.recall(hot).idle == held
    # a head that pays at its first try: the wait once it stops paying is 8 again, and so is the one kept
    memory.keep(hot, HybridSchedule(32, 8))
    assert tries(_hybrid_head_runs(target32, [None, 1.2, 1.2] + [1.05] * 20, memory=memory, sampling=hot)) == [0, 1, 2, 11]
    assert memory.recall(hot).wait == 16


def test_the_schedule_memory_keeps_by_settings_where_it_applies_and_the_latest_wins():
    """``ScheduleMemory``: a generation's slot (asked once) and ``keep`` write the one schedule its
    settings recall; settings where the memory does not apply get no slot and keep nothing; two
    generations at one setting share its slot, the latest write wins."""
    from tierspec.drafters.eagle import HybridSchedule, ScheduleMemory

    greedy, hot = SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0)
    memory = ScheduleMemory(lambda sampling: sampling.greedy)
    assert memory.recall(greedy) is None and memory.slot(hot) is None
    memory.keep(hot, HybridSchedule(16, 8, 3))
    assert memory.recall(hot) is None and memory.slot(hot) is None
    first, second = memory.slot(greedy), memory.slot(SamplingConfig(temperature=0.0))
    assert first is second and first == [None] and memory.recall(greedy) is None
    first[0] = (32, 16, None)
    assert memory.recall(greedy) == HybridSchedule(32, 16, None)
    memory.keep(greedy, HybridSchedule(64, 8, 5))
    assert first[0] == (64, 8, 5) and memory.recall(greedy) == HybridSchedule(64, 8, 5)


def test_the_built_hybrids_generations_share_one_memory_and_keep_the_targets_text(target32, prompt_ids):
    """``build_method("hybrid")``: every generation's drafter holds the method's one memory; generations
    that start from the longest rests a run can leave still sample the target's own text for their
    seed; under the residual rule nothing sampled is kept (tests/loop/test_seed.py: a seed fixes the
    text whatever ran before). Whether a given run's waits move is the schedule's business (the
    planted tests above), not this test's."""
    from tierspec.drafters.eagle import DORMANT_MAX_CYCLES, HEAD_RETRY_MAX_CYCLES, HybridSchedule
    from tierspec.methods import MethodOptions, build_method

    method = build_method("hybrid", target32, None, MethodOptions(draft_head=random_head(target32)))
    memory = method.generation().drafter.memory
    assert memory is not None and method.generation().drafter.memory is memory
    hot, greedy = SamplingConfig(1.0), SamplingConfig(0.0)
    longest = HybridSchedule(HEAD_RETRY_MAX_CYCLES, DORMANT_MAX_CYCLES)
    ar = build_method("ar", target32)
    # the longest rests, carried on: a try two cycles in (its drafts then verified), none in 30 tokens; and not carried
    for rest in (HybridSchedule(HEAD_RETRY_MAX_CYCLES, DORMANT_MAX_CYCLES, HEAD_RETRY_MAX_CYCLES - 2),
                 HybridSchedule(HEAD_RETRY_MAX_CYCLES, DORMANT_MAX_CYCLES, 0), longest):
        for seed in (4, 5):
            memory.keep(hot, rest)
            assert run_ids(target32, method, prompt_ids, 30, hot, generator=seed) == \
                run_ids(target32, ar, prompt_ids, 30, hot, generator=seed)
    residual = build_method("hybrid", target32, None, MethodOptions(draft_head=random_head(target32), sampling_rule="residual"))
    memory = residual.generation().drafter.memory
    memory.keep(hot, longest)
    memory.keep(greedy, longest)
    assert memory.recall(hot) is None and memory.recall(greedy) == longest


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_hybrid_rolls_its_heads_cache_back_only_after_cycles_the_head_ran_in(target32, prompt_ids, monkeypatch,
                                                                                  temperature):
    """``HybridDrafter.commit`` asks the head to roll back (``EagleDrafter.commit``) once after each
    cycle the head ran in (its ``drafting`` began) and after no other; after every cycle the head
    holds no position past the committed ones, through cycles it ran in and cycles it rested or
    looked up in; the text is the target's own."""
    from tierspec.decode import DecodeRun
    from tierspec.methods import MethodOptions, build_method

    calls = []
    drafting, commit = EagleDrafter.drafting, EagleDrafter.commit
    monkeypatch.setattr(EagleDrafter, "drafting", lambda self, context, request: calls.append("ran") or
                        drafting(self, context, request))
    monkeypatch.setattr(EagleDrafter, "commit", lambda self, length: calls.append("commit") or commit(self, length))
    method = build_method("hybrid", target32, None, MethodOptions(draft_head=random_head(target32)))
    cycles = []

    def inspect(verifiers, drafter):
        head = drafter.eagle
        assert head.runner.length <= max(verifiers.committed.length - 1 - head._first, 0)
        cycles.append(list(calls))
        calls.clear()

    config = DecodeConfig(max_new_tokens=40, sampling=SamplingConfig(temperature))
    steps = list(DecodeRun(target32, method, prompt_ids, config, seed=5, inspect=inspect))
    assert all(cycle in ([], ["ran", "commit"]) for cycle in cycles)
    assert [] in cycles and ["ran", "commit"] in cycles
    assert [t for s in steps for t in s.new_tokens] == run_ids(target32, build_method("ar", target32), prompt_ids, 40,
                                                             SamplingConfig(temperature), generator=5)


def test_a_generations_first_lookup_pause_is_as_long_as_the_last_ones(target32):
    """The n-gram lookup's pauses carry over as the head's waits do: a generation looks up from its
    first cycle (its prompt may offer what the last one's did not), and where its drafts do not pay
    its first pause is as long as the next pause the latest generation at its settings would have made."""
    from tierspec.drafters.eagle import DRAFTING_CYCLE_SECONDS, ScheduleMemory

    below = 0.5 * DRAFTING_CYCLE_SECONDS
    hot, memory = SamplingConfig(1.0), ScheduleMemory(lambda sampling: True)
    looked = []
    _hybrid_head_runs(target32, [1.05] * 30, saved=[below] * 30, looked=looked, memory=memory, sampling=hot)
    # looks 0-7, pauses 8-15, looks 16-23, pauses 24-39 (16 cycles): the next pause would be 32
    assert [i for i, seen in enumerate(looked) if not seen] == list(range(8, 16)) + list(range(24, 30))
    looked = []
    _hybrid_head_runs(target32, [1.05] * 60, saved=[below] * 60, looked=looked, memory=memory, sampling=hot)
    assert [i for i, seen in enumerate(looked) if not seen] == list(range(8, 40)) + list(range(48, 60))  # 32, then 64


def test_what_a_sources_drafts_saved_is_measured_by_the_verdicts():
    """``CostAware.saved_seconds``: per cycle a source proposed in, accepted · cost(0) less what its
    verified drafts added to the cycle (cost(k) − cost(0)), 0 where nothing was verified; a running
    mean (``SAVED_MEMORY``); a cycle with nothing proposed by any source teaches nothing."""
    from tierspec.policies import SAVED_MEMORY, CostAware, CycleOutcome
    from tierspec.proposal import Proposal, Verdict

    policy = CostAware(max_draft=4, cost=lambda k, source: 1.0 + 0.25 * k)
    drafted = Proposal.chain(torch.tensor([5, 6, 7]), match_sizes=[2, 2, 2], source="ngram")
    policy.observe(CycleOutcome(drafted, drafted, Verdict([0], 9, ["drafter", "target"])))
    assert policy.saved_seconds("ngram") == pytest.approx(1 * 1.0 - 0.75)
    policy.observe(CycleOutcome(drafted, drafted.prefix(0), Verdict([], 9, ["target"])))
    assert policy.saved_seconds("ngram") == pytest.approx(SAVED_MEMORY * 0.25)
    policy.observe(CycleOutcome(Proposal.empty(), Proposal.empty(), Verdict([], 9, ["target"])))
    assert policy.saved_seconds("ngram") == pytest.approx(SAVED_MEMORY * 0.25) and policy.saved_seconds("") is None
    assert policy.saved_seconds("head") is None


def test_the_hybrid_wants_features_only_where_its_head_may_run_soon(target32):
    """The passes record the head's features while it runs, is untried or pays, and in the last
    ``HEAD_WARMUP_CYCLES`` cycles before a try; not while it rests longer, nor while the cost model
    rules it out."""
    from tierspec.drafters.eagle import HEAD_WARMUP_CYCLES

    assert HEAD_WARMUP_CYCLES == 2
    for rate in (None, 1.2):
        wants = []
        _hybrid_head_runs(target32, [rate] * 20, wants=wants)
        assert all(wants)
    wants = []
    ran = _hybrid_head_runs(target32, [1.05] * 30, wants=wants)
    assert [i for i, r in enumerate(ran) if r] == [8, 25]  # tries after waits of 8 and 16
    assert [i for i, w in enumerate(wants) if w] == [6, 7, 8, 23, 24, 25]  # two cycles before each try, and the try
    wants = []
    _hybrid_head_runs(target32, [None] * 10, [1.1] * 5 + [2.0] * 5, wants=wants)
    assert wants == [False] * 5 + [True] * 5


def _planted_catch_up(target, seed: int):
    """A random head, a 41-token context, a feature row per position and a greedy 3-draft request
    that drafts every token: what the catch-up tests feed a head by hand."""
    from tierspec.drafters.base import DraftEverything
    from tierspec.proposal import DraftRequest

    head = random_head(target)
    generator = torch.Generator().manual_seed(seed)
    context = torch.randint(0, 32, (41,), generator=generator).numpy()  # as the cycle hands it (Drafter.propose)
    rows = torch.randn(41, head.config.feature_width, generator=generator)
    return head, context, rows, DraftRequest(budget=3, sampling=SamplingConfig(0.0), noise=None, policy=DraftEverything())


@torch.no_grad()
def test_a_head_whose_features_have_a_gap_starts_over_after_it(target32):
    """Positions committed without features (cycles that did not want them): the head empties its
    cache and starts at the log's first row, drafting exactly what a head started there drafts."""
    from tierspec.drafters.base import FeatureLog

    head, context, rows, request = _planted_catch_up(target32, seed=8)

    gapped, log = EagleDrafter(head), FeatureLog(64, rows.shape[1])
    gapped.start(context[:12], log)
    log.write(0, rows[:11])
    log.commit(11)
    first = gapped.propose(context[:12], request)  # caught up over positions 0..10
    assert len(first) == 3 and gapped.runner.length == 11
    gapped.commit(20)
    log.commit(19, written=False)  # positions 11..18 committed without features
    log.write(19, rows[19:40])
    log.commit(40)
    after = gapped.propose(context, request)

    fresh, fresh_log = EagleDrafter(head), FeatureLog(64, rows.shape[1])
    fresh_log.write(19, rows[19:40])
    fresh_log.commit(19, written=False)
    fresh_log.commit(40)
    fresh.start(context[:20], fresh_log)
    expected = fresh.propose(context, request)
    assert torch.equal(after.tokens, expected.tokens) and len(after) == 3
    assert gapped.runner.length == fresh.runner.length == 21  # slot 0 is position 19


@torch.no_grad()
def test_a_first_catch_up_feeds_only_the_latest_positions(target32, monkeypatch):
    """A head with an empty cache catches up on at most ``FIRST_CATCH_UP`` committed positions,
    the latest: it drafts exactly what a head whose log began there drafts, and later catch-ups
    go on from there; a prompt within the window is fed whole."""
    from tierspec.drafters import eagle
    from tierspec.drafters.base import FeatureLog

    monkeypatch.setattr(eagle, "FIRST_CATCH_UP", 8)
    head, context, rows, request = _planted_catch_up(target32, seed=9)

    windowed, log = EagleDrafter(head), FeatureLog(64, rows.shape[1])
    windowed.start(context[:31], log)
    log.write(0, rows[:30])
    log.commit(30)
    first = windowed.propose(context[:31], request)  # positions 22..29 fed
    assert len(first) == 3 and windowed.runner.length == 8

    fresh, fresh_log = EagleDrafter(head), FeatureLog(64, rows.shape[1])
    fresh_log.commit(22, written=False)
    fresh_log.write(22, rows[22:30])
    fresh_log.commit(30)
    fresh.start(context[:31], fresh_log)
    assert torch.equal(fresh.propose(context[:31], request).tokens, first.tokens)

    windowed.commit(31)
    log.write(30, rows[30:40])
    log.commit(40)
    later = windowed.propose(context, request)  # 30..39 fed after the window: 18 in its cache
    assert windowed.runner.length == 18 and len(later) == 3

    short, short_log = EagleDrafter(head), FeatureLog(64, rows.shape[1])
    short.start(context[:9], short_log)
    short_log.write(0, rows[:8])
    short_log.commit(8)
    short.propose(context[:9], request)
    assert short.runner.length == 8 and short._first == 0  # within the window: the whole prompt


@torch.no_grad()
@pytest.mark.parametrize("chunk", [None, 7])
def test_the_prefill_logs_the_features_of_the_prompts_last_positions_only(target32, chunk):
    """With a ``feature_history`` the prefill logs the features of the prompt's last that many
    positions: the log's readable rows begin there and equal a full log's rows bit for bit; a chunk
    before them asks its pass for no hidden states (the batch's chunked prefill), one across them
    logs its later rows only."""
    from tierspec.passes import pass_backend
    from tierspec.verifiers import Verifiers

    prompt = torch.randint(0, target32.vocab_size, (30,), generator=torch.Generator().manual_seed(4))
    backend = pass_backend(target32.model)

    def prefilled(history):
        verifiers = Verifiers(target32, 40, record_features=True, feature_layers=(0,), feature_history=history)
        verifiers.begin_prefill(prompt)
        asked = []
        while verifiers.prefilling:
            part = verifiers.prefill_request(chunk)
            asked.append(part.request.hidden_layers)
            verifiers.prefill_result(part, backend.run([part.request])[0])
        return verifiers.features, asked

    full, _ = prefilled(None)
    log, asked = prefilled(8)
    assert (full.start, full.length, log.start, log.length) == (0, 29, 21, 29)  # 29 positions run, the last 8 logged
    assert torch.equal(log.read(21, 29), full.read(21, 29))
    with pytest.raises(ValueError, match="not committed rows"):
        log.read(20, 29)
    assert asked == ([(0,)] if chunk is None else [None, None, None, (0,), (0,)])  # chunks from 0, 7, 14, 21, 28
    short, _ = prefilled(40)  # a prompt within the history: every position
    assert (short.start, short.length) == (0, 29)


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(1.0)])
def test_a_head_drafts_the_same_from_a_prefill_that_logs_only_what_it_reads(target32, monkeypatch, sampling):
    """Through the loop, a prompt longer than ``FIRST_CATCH_UP``: the head's drafts, cycle by
    cycle, and the text are those of a run whose prefill logged every prompt position."""
    from tierspec.drafters import eagle

    monkeypatch.setattr(eagle, "FIRST_CATCH_UP", 8)
    prompt = torch.randint(0, target32.vocab_size, (30,), generator=torch.Generator().manual_seed(6))

    class Everything(EagleDrafter):
        feature_history = None

    def drafts(drafter):
        seen = []
        tokens = run_ids(target32, as_method(drafter, num_draft=3), prompt, 24, sampling=sampling, generator=3,
                         on_step=lambda step: seen.append((step.proposal.token_list, step.proposal.confidence)))
        return tokens, seen

    (text, drafted), (every_text, every_drafted) = drafts(EagleDrafter(random_head(target32))), \
        drafts(Everything(random_head(target32)))
    assert text == every_text and [t for t, _ in drafted] == [t for t, _ in every_drafted]
    confidences = [(c, d) for (_, c), (_, d) in zip(drafted, every_drafted) if c is not None or d is not None]
    assert len(confidences) > 3 and all(c == d for c, d in confidences)  # the head's own numbers


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(1.0)])
def test_passes_skip_the_features_the_drafter_does_not_want_and_the_text_stays_the_targets(
        target32, prompt_ids, monkeypatch, sampling):
    """Through the loop: a cycle whose drafter does not want features runs its pass without them
    (no hidden layers asked for) and commits its positions without rows; the head, drafting again
    after such cycles, starts over after them; the text is plain decoding's, greedy and seeded."""
    from tierspec.verifiers import Verifiers

    pattern = [False, False, True, False, True, True, False]  # which cycles want features, in turn

    class Gapped(HybridDrafter):
        cycles = 0

        def wants_features(self):
            Gapped.cycles += 1
            return pattern[Gapped.cycles % len(pattern)]

    asked, real = [], Verifiers.target_request

    def target_request(self, proposal, *args, record_features=True, **kwargs):
        target_pass = real(self, proposal, *args, record_features=record_features, **kwargs)
        asked.append((record_features, target_pass.request.hidden_layers))
        return target_pass

    monkeypatch.setattr(Verifiers, "target_request", target_request)
    restarts, catch_up = [], EagleDrafter._catch_up

    def counted_catch_up(self, context):
        first = self._first
        step = catch_up(self, context)
        restarts.append(self._first != first)
        return step

    monkeypatch.setattr(EagleDrafter, "_catch_up", counted_catch_up)
    policy = CostAware(6, cost=lambda k, source="": 46 + 7 * k)
    hybrid = Gapped(NgramDrafter(3), EagleDrafter(random_head(target32)))
    reference = run_ids(target32, as_method(NoDrafter()), prompt_ids, 40, sampling=sampling, generator=5)
    assert run_ids(target32, as_method(hybrid, policy=policy), prompt_ids, 40, sampling=sampling,
                   generator=5) == reference
    assert {wanted for wanted, _ in asked} == {False, True}
    assert all((layers is None) == (not wanted) for wanted, layers in asked)
    assert all(layers == hybrid.feature_layers for wanted, layers in asked if wanted)
    assert any(restarts)  # the head ran after positions without features, from the first row after them


def test_sampled_eagle_first_token_matches_the_target(prompt_ids):
    """Exactness with the reduced vocabulary: the first emitted token is distributed as q even
    though the drafter puts no mass outside V_K (chi-square against the exact q)."""
    from scipy.stats import chi2

    target = tiny_llama(seed=11, vocab_size=12, layers=2, hidden=16, sharpness=10.0, dtype=torch.float32)
    head = random_head(target, torch.tensor([0, 2, 3, 5, 7, 8]))
    prompt = torch.tensor([1, 2, 3, 4])
    with torch.inference_mode():
        q = target.model(prompt[None]).logits[0, -1].double().softmax(-1)
    counts = torch.zeros(12)
    method = as_method(EagleDrafter(head), num_draft=2)
    config = DecodeConfig(max_new_tokens=2, sampling=SamplingConfig(1.0))
    for seed in range(1500):
        counts[next(decode(target, method, prompt, config, seed)).new_tokens[0]] += 1
    expected = q * counts.sum()
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert chi2.sf(stat, 11) > 1e-3
    # the same counts condemn the drafter's own distribution (it differs from q)
    assert counts[[1, 4, 6, 9, 10, 11]].sum() > 0  # tokens outside V_K still appear (residual)


@pytest.mark.parametrize("sampling", [SamplingConfig(0.7, top_k=10), SamplingConfig(1.0, top_p=0.8)])
def test_eagle_samples_with_top_k_and_top_p(target32, prompt_ids, sampling):
    out = run_ids(target32, as_method(EagleDrafter(random_head(target32)), num_draft=3), prompt_ids, 30, sampling,
                  generator=torch.Generator().manual_seed(0))
    assert len(out) == 30


def test_vocabulary_map_round_trips_and_files_are_checked(target32, tmp_path):
    ids = torch.tensor([0, 3, 5, 9, 40, 63])
    head = random_head(target32, ids)
    path = tmp_path / "head.safetensors"
    head.save(path, {"note": "test"}, dtype=torch.float32)
    loaded = DraftHead.load(path, target32)
    assert loaded.draft_ids.tolist() == ids.tolist()
    assert torch.equal(loaded.lm_rows, target32.model.get_output_embeddings().weight[ids])
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    # another model (same shapes, other weights' hash) is refused
    other = tiny_llama(seed=6, sharpness=20.0, dtype=torch.float32)
    other.identity.__dict__  # frozen dataclass: build a differing identity instead
    from dataclasses import replace

    other.identity = replace(target32.identity, name="other", content_hash="ab" * 32)
    loaded.target_identity = replace(target32.identity, content_hash="cd" * 32)
    with pytest.raises(DraftHeadError, match="trained for"):
        loaded.attach(other)
    # damaged files
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(DraftHeadError, match="damaged"):
        DraftHead.load(path, target32)
    with pytest.raises(DraftHeadError, match="does not exist"):
        DraftHead.load(tmp_path / "missing.safetensors", target32)


FILE_WEIGHTS = {"fc.weight", "fc.bias", "q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                "gate_proj.weight", "up_proj.weight", "down_proj.weight", "input_norm", "post_attention_norm",
                "final_norm", "draft_ids"}


def test_a_saved_head_names_its_weights_as_the_shipped_file_does(target32, tmp_path):
    """The head's layer is ``llama``'s (q/k/v and gate/up fused), but its file keeps the names
    heads have always been saved with, so the shipped head and heads users trained still load."""
    from safetensors import safe_open

    head = DraftHead.for_target(target32, torch.arange(64), seed=3, feature_layers=(1,))
    path = tmp_path / "head.safetensors"
    head.save(path, dtype=torch.float32)
    with safe_open(str(path), "pt") as handle:
        saved = {key: handle.get_tensor(key) for key in handle.keys()}
    assert set(saved) == FILE_WEIGHTS | {"aux_proj.weight"}
    layer = target32.model.model.layers[-1]  # copied from the target's last layer, by name
    assert torch.equal(saved["k_proj.weight"], layer.self_attn.k_proj.weight)
    assert torch.equal(saved["up_proj.weight"], layer.mlp.up_proj.weight)
    assert torch.equal(saved["post_attention_norm"], layer.post_attention_layernorm.weight)


def test_the_shipped_file_loads_into_the_layer_and_writes_back_bitwise():
    """The shipped head's tensors, read into the module and written out under the file's names
    again, are exactly the file's (no weight renamed, reshaped, dropped or left over)."""
    import json

    from safetensors import safe_open

    from tierspec.heads.draft import HeadConfig
    from tierspec.heads.shipped import HEADS_DIR

    with safe_open(str(HEADS_DIR / "smollm2-135m.safetensors"), "pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        config = HeadConfig(**json.loads(handle.metadata()["info"])["config"])
    assert set(tensors) == FILE_WEIGHTS | {"aux_proj.weight"}
    head = DraftHead(config, tensors["draft_ids"]).to(torch.bfloat16)
    head.load_state_dict(head.from_file_names(tensors), strict=True)
    written = head.to_file_names()
    assert written.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(written[name], tensor), name


def test_a_head_for_another_shape_is_refused(target32, tmp_path):
    head = random_head(target32)
    path = tmp_path / "head.safetensors"
    head.save(path)
    wider = tiny_llama(seed=5, hidden=48, sharpness=20.0, dtype=torch.float32)
    with pytest.raises(DraftHeadError):
        DraftHead.load(path, wider)


def teacher_forced_sequences(target, count, length, seed):
    """Greedy continuations of random prompts by the tiny target, with its features."""
    from tierspec.cached_model import CachedModel

    generator = torch.Generator().manual_seed(seed)
    sequences = []
    for _ in range(count):
        prompt = torch.randint(0, 64, (6,), generator=generator)
        method = as_method(NoDrafter())
        answer = run_ids(target, method, prompt, length)
        tokens = torch.cat([prompt, torch.tensor(answer)])
        with torch.inference_mode():
            hidden = CachedModel(target.model).forward(tokens, with_hidden=True).hidden
        sequences.append(Sequence(tokens[:-1], hidden[:-1].half(), 6, "own-greedy"))
    return sequences


def test_training_on_a_tiny_model_lowers_the_validation_loss(target32):
    sequences = teacher_forced_sequences(target32, 60, 24, seed=0)
    config = TrainConfig(draft_vocab_size=48, epochs=10, batch_tokens=512, lr=1e-2, warmup_steps=5, val_fraction=0.2,
                         ttt_steps=2, bf16=False, checkpoint_every=1000)
    from tierspec.training.draft_train import split_sequences, validation_loss

    _, val = split_sequences(sequences, config.val_fraction, config.seed)
    untrained = DraftHead.for_target(target32, draft_vocabulary(split_sequences(sequences, 0.2, 0)[0], 48, 64), config.seed)
    before = validation_loss(untrained, val, config)
    accepted_before = validate(untrained, val, 3)["acceptance_by_position"][0]
    head, metrics = fit_head(target32, sequences, config, progress=False, log=lambda message: None)
    after = metrics["history"][-1]
    assert after["val_loss"] < 0.7 * before
    assert after["acceptance_by_position"][0] > accepted_before + 0.2
    ids = draft_vocabulary(sequences, 48, 64)
    assert len(ids) == 48 and vocabulary_coverage(sequences, ids, 64) > 0.9


def test_validation_counts_acceptance_given_earlier_acceptance(target32):
    """A head whose drafts are always right (planted via its output) has acceptance 1 at every
    position; validate() reads the chains' real next tokens."""
    sequences = teacher_forced_sequences(target32, 4, 16, seed=1)
    head = random_head(target32)
    metrics = validate(head, sequences, 3)
    assert metrics["chains"] > 0 and all(0.0 <= a <= 1.0 for a in metrics["acceptance_by_position"])
    assert 1.0 <= metrics["tau_fixed_draft"] <= 4.0


def test_a_head_reading_several_target_layers_drafts_as_it_trains(target32, prompt_ids):
    """With fused layers (EAGLE-3), the unrolled forward still equals incremental drafting, the
    loop hands the drafter f and the layers' outputs, and greedy output equals ar."""
    head = DraftHead.for_target(target32, torch.arange(64), seed=3, feature_layers=(1, 2)).eval()
    with torch.no_grad():
        head.aux_proj.weight.normal_(0, 0.1)  # a trained head's correction, planted
    assert head.config.feature_width == 96
    torch.manual_seed(0)
    T = 10
    features, tokens = torch.randn(T, 96), torch.randint(0, 64, (T,))
    batch = collate([Sequence(tokens, features.half(), 2, "own-greedy")])
    with torch.no_grad():
        outputs = unrolled_forward(head, batch, 2)
        runner = HeadRunner(head)
        h = runner.extend(batch["features"][0, :4], tokens[1:5], from_target=True)[-1:]
        assert torch.allclose(h[0], outputs[0][0, 3], atol=1e-5)
        h = runner.extend(h, tokens[5:6])
        assert torch.allclose(h[0], outputs[1][0, 4], atol=1e-5)
    reference = run_ids(target32, as_method(NoDrafter()), prompt_ids, 30)
    seen = []

    class Watching(EagleDrafter):
        def _catch_up(self, context):  # the width of the features the head reads from the loop's log
            if self.features.length > self.runner.length:
                seen.append(self.features.read(self.runner.length, self.features.length).shape[-1])
            return super()._catch_up(context)

    assert run_ids(target32, as_method(Watching(head), num_draft=3), prompt_ids, 30) == reference
    assert seen and set(seen) == {96}


def test_drafter_commands_build_data_train_and_generate_on_a_tiny_model(tmp_path, training_data_dir, capsys):
    """`tierspec drafter build-data` → `tierspec drafter train` → `tierspec generate --method eagle`,
    end to end on a tiny model folder; a rerun of build-data resumes (nothing left to do); the
    head is refused for another model."""
    import json

    from tierspec.cli import main

    model = tiny_llama(seed=4, vocab_size=56, layers=4, sharpness=20.0, dtype=torch.float32).model
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    data = tmp_path / "draft-data"
    build = ["drafter", "build-data", "--target", str(folder), "--out", str(data), "--own-prompts", "8",
             "--reference-items", "6", "--batch-size", "4", "--max-new-tokens", "12", "--max-prompt-tokens", "120",
             "--data-dir", str(training_data_dir), "--no-progress"]
    assert main(build) == 0, capsys.readouterr().err
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["shards_done"] == manifest["shards_planned"] > 0 and manifest["answer_tokens"] > 0
    shards = sorted(p.name for p in data.glob("shard-*.safetensors"))
    first = json.loads((data / "plan.json").read_text())["dtype"]  # auto: bfloat16 where native, else float32
    other = "float32" if first == "bfloat16" else "bfloat16"
    assert main(build + ["--dtype", other]) == 2  # other numbers than the shards' so far: refused
    assert "planned with other settings" in capsys.readouterr().err
    plan = json.loads((data / "plan.json").read_text())
    (data / "plan.json").write_text(json.dumps({k: v for k, v in plan.items() if k != "dtype"}))
    assert main(build) == 0  # a plan made before the dtype was recorded resumes (and so does this one)
    assert sorted(p.name for p in data.glob("shard-*.safetensors")) == shards
    head_path = tmp_path / "head.safetensors"
    assert main(["drafter", "train", "--target", str(folder), "--data", str(data), "--out", str(head_path),
                 "--epochs", "1", "--batch-tokens", "256", "--draft-vocab", "40", "--no-progress"]) == 0
    info = json.loads(head_path.with_suffix(".json").read_text())
    assert info["format"] == "tierspec-draft-head" and info["config"]["draft_vocab_size"] == 40
    assert info["config"]["feature_layers"] == [1, 2]  # the layers build-data stored for 4 layers
    # continued training: the starting head's vocabulary (not --draft-vocab) and a record of it
    import hashlib

    continued = tmp_path / "continued.safetensors"
    assert main(["drafter", "train", "--target", str(folder), "--data", str(data), "--out", str(continued),
                 "--epochs", "1", "--batch-tokens", "256", "--draft-vocab", "30", "--init-head", str(head_path),
                 "--no-progress"]) == 2  # it was taken and ignored
    assert "--draft-vocab would change nothing" in capsys.readouterr().err
    assert main(["drafter", "train", "--target", str(folder), "--data", str(data), "--out", str(continued),
                 "--epochs", "1", "--batch-tokens", "256", "--init-head", str(head_path), "--no-progress"]) == 0
    more = json.loads(continued.with_suffix(".json").read_text())
    assert more["draft_vocab_sha256"] == info["draft_vocab_sha256"] and more["config"] == info["config"]
    assert more["continued_from"]["sha256"] == hashlib.sha256(head_path.read_bytes()).hexdigest()
    assert more["continued_from"]["path"] == str(head_path)  # as given on the command line
    assert [entry["epoch"] for entry in more["training"]["history"]] == [0.0, 1.0]
    assert main(["drafter", "train", "--target", str(folder), "--data", str(data), "--out", str(continued),
                 "--init-head", str(head_path), "--feature-layers", "1"]) == 2
    assert "fuses target layers [1, 2]" in capsys.readouterr().err
    capsys.readouterr()
    assert main(["generate", "tom has 3 apples", "--target", str(folder), "--method", "eagle", "--draft-head",
                 str(head_path), "--max-new-tokens", "10", "--no-chat-template", "--stats"]) == 0
    stats = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert stats["method"] == "eagle" and stats["emitted"] == 10
    other = tmp_path / "other"
    tiny_llama(seed=9, vocab_size=56, layers=4, sharpness=20.0, dtype=torch.float32).model.save_pretrained(other)
    char_tokenizer().save_pretrained(other)
    assert main(["generate", "hi", "--target", str(other), "--method", "eagle", "--draft-head", str(head_path)]) == 2
    assert "trained for" in capsys.readouterr().err


# ---- a head whose forward pass overflows (issue 23, finding 8) ------------------------------------

def overflowing_head(target):
    """Finite weights (|w| ≤ 1e25) whose MLP overflows to inf, and the final norm to NaN: every
    output of the head is NaN, though every weight passes a finiteness check."""
    head = random_head(target)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            getattr(head.layer.mlp, name).weight.mul_(1e25)
    assert all(torch.isfinite(p).all() for p in head.parameters())
    return head


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_head_whose_outputs_overflow_drafts_nothing_and_the_output_is_the_targets(target32, prompt_ids, temperature):
    """Once loaded (the load check is the other guard), such a head made generation crash: an
    empty max() over confidence bins at temperature 0, inf/NaN probabilities at 1. A draft
    distribution that is not finite ends the draft: the target decides every token."""
    sampling = SamplingConfig(temperature)
    reference = run_ids(target32, as_method(NoDrafter()), prompt_ids, 20, sampling, generator=torch.Generator().manual_seed(0))
    drafter = EagleDrafter(overflowing_head(target32))
    proposals = []

    def watch(step):
        proposals.append(step.cycle.drafted)

    for policy in (None, CostAware(6)):
        out = run_ids(target32, as_method(drafter, policy=policy, num_draft=4), prompt_ids, 20, sampling,
                      generator=torch.Generator().manual_seed(0), on_step=watch)
        assert out == reference
    assert proposals and set(proposals) == {0}


def test_a_head_whose_outputs_overflow_is_refused_at_load(target32, tmp_path):
    path = tmp_path / "huge.safetensors"
    overflowing_head(target32).save(path, dtype=torch.float32)
    with pytest.raises(DraftHeadError, match="huge.safetensors gives non-finite outputs on the target's features"):
        DraftHead.load(path, target32)


# ---- training checkpoints (issue 23, findings 6 and 12) -------------------------------------------

class Planted:
    """Unpickling this runs ``Path.touch(marker)``: what a planted checkpoint could run instead."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        from pathlib import Path

        return Path.touch, (Path(self.marker),)


def small_training(target, tmp_path):
    sequences = teacher_forced_sequences(target, 24, 14, seed=2)
    config = TrainConfig(draft_vocab_size=40, epochs=2, batch_tokens=64, lr=1e-2, warmup_steps=2, val_fraction=0.2,
                         ttt_steps=2, bf16=False, checkpoint_every=3, max_val_sequences=4)
    return sequences, config


def test_a_planted_checkpoint_runs_no_code_and_is_refused(target32, tmp_path):
    from tierspec.training.draft_data import DraftDataError

    sequences, config = small_training(target32, tmp_path)
    checkpoint = tmp_path / "head.safetensors.checkpoint.pt"
    marker = tmp_path / "code-ran"
    torch.save({"fingerprint": Planted(str(marker)), "step": 1}, checkpoint)
    with pytest.raises(DraftDataError, match="is not a training checkpoint tierspec can read"):
        fit_head(target32, sequences, config, checkpoint, progress=False, log=lambda message: None)
    assert not marker.exists()
    # a readable file that is not a checkpoint of this training: refused before anything is used
    torch.save({"step": "three"}, checkpoint)
    with pytest.raises(DraftDataError, match="made with other settings or data"):
        fit_head(target32, sequences, config, checkpoint, progress=False, log=lambda message: None)


def test_interrupted_and_resumed_training_gives_the_uninterrupted_head_exactly(target32, tmp_path, monkeypatch):
    """The noise generator's state is saved and restored (it was re-seeded on resume: another
    head), and so is the window of losses the next history entry averages."""
    from tierspec.training import draft_train as train_module

    sequences, config = small_training(target32, tmp_path)
    whole, whole_metrics = fit_head(target32, sequences, config, tmp_path / "whole.pt", progress=False,
                                    log=lambda message: None)
    save = train_module._save_checkpoint
    saves = []

    def interrupted(path, state):
        save(path, state)
        saves.append(state["step"])
        if len(saves) == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "_save_checkpoint", interrupted)
    checkpoint = tmp_path / "parted.pt"
    with pytest.raises(KeyboardInterrupt):
        fit_head(target32, sequences, config, checkpoint, progress=False, log=lambda message: None)
    steps_per_epoch = len(train_module._epoch_order(train_module.split_sequences(sequences, 0.2, 0)[0], config, 0))
    assert saves[0] % steps_per_epoch != 0  # interrupted inside an epoch, not at its end
    resumed, resumed_metrics = fit_head(target32, sequences, config, checkpoint, progress=False, log=lambda message: None)
    for name, tensor in whole.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), name
    without_time = lambda history: [{k: v for k, v in entry.items() if k != "seconds"} for entry in history]  # noqa: E731
    assert without_time(resumed_metrics["history"]) == without_time(whole_metrics["history"])


def test_a_resumed_training_counts_the_seconds_of_the_runs_before(target32, tmp_path, monkeypatch):
    """train_seconds counted the last run only: a job killed near its end and resumed read seconds."""
    from tierspec.training import draft_train as train_module

    sequences, config = small_training(target32, tmp_path)
    save = train_module._save_checkpoint

    def interrupted(path, state):
        save(path, {**state, "seconds": 1000.0})  # as if the run before had trained 1,000 s to here
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "_save_checkpoint", interrupted)
    checkpoint = tmp_path / "parted.pt"
    with pytest.raises(KeyboardInterrupt):
        fit_head(target32, sequences, config, checkpoint, progress=False, log=lambda message: None)
    monkeypatch.setattr(train_module, "_save_checkpoint", save)
    _, metrics = fit_head(target32, sequences, config, checkpoint, progress=False, log=lambda message: None)
    assert 1000.0 < metrics["train_seconds"] < 1000.0 + 600
    assert all(entry["seconds"] > 1000.0 for entry in metrics["history"][1:])


def test_continued_training_starts_from_the_head_and_scores_it_first(target32, tmp_path):
    """``init_head``: the history's epoch 0 is the starting head's validation on the same chains;
    training continues from its weights (the starting head itself is left as it was) with its
    draft vocabulary; a checkpoint made from another starting head is not resumed."""
    from tierspec.training import draft_train as train_module
    from tierspec.training.draft_data import DraftDataError

    sequences, config = small_training(target32, tmp_path)
    start, _ = fit_head(target32, sequences, config, progress=False, log=lambda message: None)
    before = {name: tensor.clone() for name, tensor in start.state_dict().items()}
    more = teacher_forced_sequences(target32, 24, 14, seed=7)
    wider = train_module.replace(config, draft_vocab_size=50)  # ignored: the head's vocabulary stays
    checkpoint = tmp_path / "continued.pt"
    head, metrics = fit_head(target32, more, wider, checkpoint, progress=False, log=lambda message: None,
                             init_head=start)
    _, val = train_module.split_sequences(more, config.val_fraction, config.seed)
    first = metrics["history"][0]
    assert first["epoch"] == 0.0 and first["step"] == 0
    assert {k: first[k] for k in ("acceptance_by_position", "tau_fixed_draft", "chains")} == validate(start, val[:4], config.val_steps)
    assert torch.equal(head.draft_ids, start.draft_ids) and metrics["draft_vocab_size"] == 40
    assert all(torch.equal(before[name], tensor) for name, tensor in start.state_dict().items())
    assert any(not torch.equal(before[name], tensor) for name, tensor in head.state_dict().items()
               if name != "draft_ids")
    # the same settings and data continued from another head: the checkpoint is refused
    assert checkpoint.exists()  # (fit_head leaves it; the command deletes it once the head is saved)
    other = random_head(target32, vocab=start.draft_ids, seed=11)
    with pytest.raises(DraftDataError, match="other settings or data"):
        fit_head(target32, more, wider, checkpoint, progress=False, log=lambda message: None, init_head=other)


@pytest.mark.parametrize("name", ["eagle", "hybrid", "lossy"])
def test_a_method_needing_a_head_refuses_a_target_without_one_before_measuring_costs(name, target32, monkeypatch):
    """Measuring the cost table takes seconds on a real model: the missing head is reported first."""
    from tierspec import costs
    from tierspec.methods import MethodOptions, build_method

    measured = []
    monkeypatch.setattr(costs, "measure_forward_costs", lambda *a, **k: measured.append(1))
    monkeypatch.setattr(costs, "_MEASURED", {}, raising=False)
    with pytest.raises(DraftHeadError, match="no draft head is shipped"):
        build_method(name, target32, None, MethodOptions(drafter_kind="eagle"))
    assert measured == []


def test_build_data_runs_with_the_largest_seed(tmp_path, training_data_dir):
    """Each shard's generation is seeded from the run's seed and the shard's index: for seeds
    near 2**63 that sum overflowed torch's 64-bit seed (a traceback)."""
    from tierspec.training.draft_data import DataConfig, build_data
    from tierspec.models import wrap_model

    model = tiny_llama(seed=4, vocab_size=56, layers=4, sharpness=20.0, dtype=torch.float32).model
    target = wrap_model(model, char_tokenizer(), name="tiny-char")
    config = DataConfig(own_prompts=4, reference_items=0, batch_size=2, max_new_tokens=4, max_prompt_tokens=120,
                        seed=2**63 - 1)
    build_data(target, tmp_path / "data", config, training_data_dir, progress=False, max_shards=1)
    assert len(list((tmp_path / "data").glob("shard-*.safetensors"))) == 1


def test_a_resumed_data_job_counts_the_seconds_of_the_runs_before(tmp_path, training_data_dir, monkeypatch):
    """seconds_total read the last manifest, which a killed run never wrote: its time was lost."""
    import json

    from tierspec.training import draft_data
    from tierspec.models import wrap_model

    model = tiny_llama(seed=4, vocab_size=56, layers=4, sharpness=20.0, dtype=torch.float32).model
    target = wrap_model(model, char_tokenizer(), name="tiny-char")
    config = draft_data.DataConfig(own_prompts=6, reference_items=0, batch_size=2, max_new_tokens=4,
                                   max_prompt_tokens=120)
    write = draft_data._write_shard

    written = []

    def killed(path, data):  # killed as the second shard is written
        written.append(path)
        if len(written) == 2:
            raise KeyboardInterrupt
        write(path, data)

    monkeypatch.setattr(draft_data, "_write_shard", killed)
    out = tmp_path / "data"
    with pytest.raises(KeyboardInterrupt):
        draft_data.build_data(target, out, config, training_data_dir, progress=False)
    clock = out / ".seconds.json"
    assert json.loads(clock.read_text())["seconds_total"] > 0
    clock.write_text(json.dumps({"seconds_total": 1000.0}))  # as if the killed run had worked 1,000 s
    monkeypatch.setattr(draft_data, "_write_shard", write)
    manifest = draft_data.build_data(target, out, config, training_data_dir, progress=False)
    assert manifest["shards_done"] == manifest["shards_planned"] > 1
    assert 1000.0 <= manifest["seconds_total"] < 1000.0 + 600 and not clock.exists()
    again = draft_data.build_data(target, out, config, training_data_dir, progress=False)  # nothing left to do
    assert manifest["seconds_total"] <= again["seconds_total"] < manifest["seconds_total"] + 60
