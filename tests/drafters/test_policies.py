"""Draft-length policies: the choice rule on hand-computed cases, the cost model, the acceptance
estimates learned from per-position verdicts, and losslessness of every policy."""

import json

import pytest
import torch
from conftest import as_method, run_ids

from tierspec.drafters import ModelDrafter, NgramDrafter, NoDrafter
from tierspec.drafters.base import Drafter
from tierspec.proposal import Proposal, Verdict
from tierspec.policies import (
    AcceptanceEstimate,
    ConfidenceStop,
    CostAware,
    CostModel,
    ConfidenceKey,
    CycleOutcome,
    DraftPolicyError,
    FixedLength,
    MatchKey,
    SourceKey,
    best_length,
    expected_emitted,
)


def cost(k, source=""):  # a straight-line verification cost, ms (docs/algorithms.md §Draft-length policies)
    return 46 + 7 * k


def test_expected_emitted_adds_the_reach_of_each_position():
    assert expected_emitted([]) == [1.0]
    assert expected_emitted([0.5, 0.25]) == [1.0, 1.5, 1.75]


@pytest.mark.parametrize("alpha, expected", [(0.1, 0), (0.3, 1), (0.6, 2), (0.8, 5), (0.95, 10)])
def test_best_length_under_the_design_cost_model(alpha, expected):
    reach = [alpha ** (i + 1) for i in range(10)]  # geometric acceptance
    # brute force over the same objective, written out: E(k) = Σ_{i=0..k} α^i
    rates = [sum(alpha**i for i in range(k + 1)) / cost(k) for k in range(11)]
    assert best_length(reach, cost) == rates.index(max(rates)) == expected


def test_best_length_uses_per_position_acceptance():
    # A high first-token acceptance and a collapse after it: one draft, not a long block.
    assert best_length([0.9, 0.9 * 0.05, 0.9 * 0.05**2], cost) == 1


def test_cost_model_costs_draft_steps_as_fractions_of_a_one_token_pass():
    from tierspec.costs import ForwardCosts

    table = ForwardCosts({1: 0.030, 2: 0.031, 3: 0.040, 4: 0.041, 5: 0.045, 6: 0.060})
    model = CostModel(table, {"head": 0.05, "model": 1.0})
    assert model(4, "head") == pytest.approx(0.045 + 4 * 0.05 * 0.030)
    assert model(4, "model") == pytest.approx(0.045 + 4 * 0.030)  # a drafter as large as the target
    assert model(4, "ngram") == pytest.approx(0.045)  # lookup is free
    assert CostModel()(2) == pytest.approx(0.046 + 0.007 * 2)  # no table: the straight line


def test_a_pass_is_costed_at_the_context_its_rows_attend_to():
    """Each size's measured cost per further cached position (``per_position``) moves its cost
    linearly from the table's context, never below half the table's; beyond the table the rows'
    slopes extend linearly; a table without slopes costs every context alike."""
    from tierspec.costs import ForwardCosts

    table = ForwardCosts({1: 0.010, 2: 0.011, 3: 0.012}, context=256, per_position={1: 1e-6, 2: 2e-6, 3: 3e-6})
    assert table.cost(2) == table.cost(2, 256) == pytest.approx(0.011)
    assert table.cost(2, 1256) == pytest.approx(0.011 + 1000 * 2e-6)
    assert table.cost(1, 0) == pytest.approx(0.010 - 256e-6)
    assert table.cost(3, 10**9) == pytest.approx(0.012 + (10**9 - 256) * 3e-6)
    assert ForwardCosts({1: 0.010}, 256, {1: 1e-3}).cost(1, 0) == pytest.approx(0.005)  # the floor
    assert table.cost(5, 1256) == pytest.approx(0.012 + 2 * 0.001 + 1000 * 5e-6)  # 2 rows past the table
    assert ForwardCosts({1: 0.010, 2: 0.011}).cost(2, 5000) == pytest.approx(0.011)


def test_a_cost_models_batch_and_context_variants_are_made_once_and_cost_as_new_ones():
    """A batch's size moving 8 → 7 → 8 and a context moving on and back give the same model objects
    again (their caches kept), each costing what a model made afresh for its batch and context costs."""
    from tierspec.costs import ForwardCosts

    table = ForwardCosts({1: 0.010, 2: 0.011, 3: 0.013, 8: 0.020, 9: 0.021, 10: 0.023}, context=256,
                         per_position={n: 1e-6 * n for n in (1, 2, 3, 8, 9, 10)})
    root = CostModel(table, {"head": 0.1})
    eight = root.in_batch(8)
    assert eight.in_batch(7).in_batch(8) is eight and eight.in_batch(1) is root
    near = eight.at_context(300)  # the table's own context, in steps of 64
    far = near.at_context(1000)
    assert far.at_context(300) is near and near.at_context(1000) is far and far.in_batch(7).in_batch(8) is far
    for model, sequences, context in ((near, 8, 256), (far, 8, 960), (far.in_batch(7), 7, 960), (eight, 8, None)):
        fresh = CostModel(table, {"head": 0.1}, sequences, context)
        assert (model.sequences, model.context) == (sequences, context)
        for k in range(3):
            assert model(k, "head") == fresh(k, "head") and model.verify(k + 1) == fresh.verify(k + 1)


@pytest.mark.parametrize("name", ["adaptive-pld", "hybrid", "eagle-tree"])
def test_a_methods_generations_share_one_cost_model_and_move_apart_from_it(tiny_target, sampling_own_target, name):
    """``methods``: every generation's policy starts from the method's one ``CostModel`` (its batch and
    context variants made once for them all); a generation moving to a batch of 8 and a long context
    moves its own policy only — the next generation starts from the shared model, alone."""
    from tierspec.heads.draft import DraftHead
    from tierspec.methods import MethodOptions, build_method

    target = sampling_own_target if name.endswith("-tree") else tiny_target  # trees: tierspec's own forward
    head = DraftHead.for_target(target, torch.arange(0, target.vocab_size, 2), seed=5).eval()
    method = build_method(name, target, None, MethodOptions(draft_head=head if name != "adaptive-pld" else None))
    first, second = method.generation().policy, method.generation().policy
    assert first is not second and isinstance(first.cost, CostModel) and first.cost is second.cost
    shared = first.cost
    first.share_passes(8)
    first.at_context(1000)
    assert (first.cost.sequences, first.cost.context) == (8, 960) and first.cost.variants is shared.variants
    third = method.generation().policy
    assert third.cost is shared and (shared.sequences, shared.context) == (1, None)
    third.share_passes(8)
    third.at_context(1000)
    assert third.cost is first.cost  # the variant made once


def test_a_draft_that_pays_after_few_positions_does_not_after_many():
    """Planted: a 2-row pass costs 1.1× one row after 256 positions, and each row adds as much
    attention per position, so after 4,096 positions 2 rows cost 1.35× one: a one-token draft
    accepted 25% of the time pays at the first (1.25 tokens for 1.1) and not at the second. The
    head's step is charged at the table's context (where its fraction was measured)."""
    from tierspec.costs import ForwardCosts
    from tierspec.proposal import Proposal

    table = ForwardCosts({1: 0.010, 2: 0.011}, context=256, per_position={1: 1e-6, 2: 2e-6})
    policy = CostAware(1, forward_costs=table, draft_fractions={"head": 0.1})
    proposal = Proposal.chain(torch.tensor([7]), source="ngram")
    policy.keys = lambda proposal, count: [None] * count
    policy._reach = lambda keys: [0.25] * len(keys)
    policy.at_context(300)
    assert policy.cost.context == 256 and policy.trim(proposal) == 1
    policy.at_context(4096 + 30)
    assert policy.cost.context == 4096 and policy.trim(proposal) == 0
    assert policy.cost(1, "ngram") == pytest.approx(0.011 + 3840 * 2e-6)
    assert policy.cost.draft_step("head") == pytest.approx(0.1 * 0.010)
    policy.share_passes(3)
    assert policy.cost.context == 4096 and policy.cost.sequences == 3  # batching keeps the context


def test_the_cost_aware_policy_has_nothing_to_learn_from_the_clock():
    """The loop reports verdicts, not timings: a stall of a shared machine cannot choose the
    next draft lengths (a seed fixes them)."""
    from dataclasses import fields

    assert not {"draft_seconds", "verify_seconds"} & {f.name for f in fields(CycleOutcome)}
    policy = CostAware(6, draft_fractions={"head": 0.05})
    assert policy.cost(3, "head") == CostModel(None, {"head": 0.05})(3, "head")


def test_acceptance_estimate_learns_and_forgets():
    estimate = AcceptanceEstimate(prior=0.5)
    assert estimate.probability == 0.5
    for _ in range(10):
        estimate.update(4, 0, decay=1.0)
    assert estimate.probability > 0.95
    for _ in range(200):
        estimate.shrink(0.95)
    assert abs(estimate.probability - 0.5) < 0.05  # back to the prior


def test_cost_aware_learns_from_each_evaluated_position_only():
    policy = CostAware(6, cost=cost)
    proposal = Proposal.chain(torch.tensor([1, 2, 3, 4]), match_sizes=[3] * 4, source="ngram")
    keys = policy.keys(proposal, 4)
    assert keys == [MatchKey("ngram", 3, False)] * 4
    # 2 accepted, the 3rd rejected, the 4th never evaluated: 2 successes, 1 failure.
    policy.observe(CycleOutcome(proposal, proposal, Verdict.chain(2, 9, [])))
    estimate = policy.acceptance[MatchKey("ngram", 3, False)]
    assert (estimate.successes, estimate.failures) == (2.0, 1.0)
    assert policy.streak is False
    two = proposal.prefix(2)
    policy.observe(CycleOutcome(two, two, Verdict.chain(2, 9, [])))
    assert policy.streak is True


def test_the_first_token_cut_off_is_scored_by_the_bonus_token():
    """After a fully accepted block the target's bonus token tells whether the first drafted token
    the policy cut would have been kept: counted for its key (here: the same match size)."""
    policy = CostAware(6, cost=cost)
    drafted = Proposal.chain(torch.tensor([1, 2, 3]), match_sizes=[3] * 3, source="ngram")
    policy.observe(CycleOutcome(drafted, drafted.prefix(1), Verdict.chain(1, 2, [])))  # bonus 2 = the cut draft
    cold = policy.acceptance[MatchKey("ngram", 3, False)]
    assert (cold.successes, cold.failures) == (2.0, 0.0) and policy.streak  # the kept draft and the cut one
    policy.observe(CycleOutcome(drafted, drafted.prefix(1), Verdict.chain(1, 7, [])))  # bonus 7: it would have failed
    warm = policy.acceptance[MatchKey("ngram", 3, True)]  # the block before was accepted whole
    assert (warm.successes, warm.failures) == (1.0, 1.0)
    policy.observe(CycleOutcome(drafted, drafted.prefix(1), Verdict.chain(0, 7, [])))  # rejected: the cut tells nothing
    assert (warm.successes, warm.failures) == (pytest.approx(policy.decay), pytest.approx(policy.decay + 1))
    assert (cold.successes, cold.failures) == (2.0, 0.0) and not policy.streak


def test_trim_only_chooses_and_observe_learns():
    """The choice of a length changes nothing the policy believes; the verdict does: the block's
    expected rate, and a first key the policy chose not to verify drifting back to its prior."""
    policy = CostAware(4, cost=cost)
    key = MatchKey("ngram", 3, False)
    policy._estimate(key).update(0, 10, 1.0)
    proposal = Proposal.chain(torch.tensor([1, 2]), match_sizes=[3, 3], source="ngram")
    assert policy.trim(proposal) == policy.trim(proposal) == 0  # rarely accepted: not worth a draft
    assert (policy.acceptance[key].successes, policy.acceptance[key].failures) == (0.0, 10.0)
    assert policy.source_rate("ngram") is None
    # nothing verified; the target's token (9) is not the first draft (1): the cut one would have failed
    policy.observe(CycleOutcome(proposal, proposal.prefix(0), Verdict.chain(0, 9, [])))
    assert policy.acceptance[key].failures == pytest.approx(10 * policy.idle_decay * policy.decay + 1)
    assert policy.source_rate("ngram") == 1 / cost(0)


def test_the_ceiling_rate_is_the_best_length_of_certain_drafts():
    """(1 + k) / cost(k) at its best k ≤ max_draft: with cost 1 + 0.5 k it grows with k (4 / 2.5 at
    k = 3); with a step dearer than a pass (cost 1 + 1.5 k) k = 1 is best (2 / 2.5); no drafts
    allowed, no rate."""
    assert CostAware(3, cost=lambda k, source="": 1 + 0.5 * k).ceiling_rate("head") == pytest.approx(1.6)
    assert CostAware(3, cost=lambda k, source="": 1 + 1.5 * k).ceiling_rate("head") == pytest.approx(0.8)
    assert CostAware(0, cost=cost).ceiling_rate("head") == 0.0


def test_in_a_batch_a_head_step_that_a_pass_row_does_not_cover_cannot_pay():
    """The measured table's shape where a batch shares its passes (``CostModel.verify``): alone a
    head draft accepted for certain pays well beyond a head step; in a batch of 8, where a
    sequence's share of the pass is an eighth and its ninth row pads the pass to 16 rows, not even
    certain drafts beat drafting nothing by one head step."""
    from tierspec.costs import ForwardCosts

    table = ForwardCosts({1: 0.010, 2: 0.0105, 4: 0.011, 8: 0.016, 16: 0.030})
    policy = CostAware(6, forward_costs=table, draft_fractions={"head": 0.2})

    def pays() -> bool:
        worth = policy.plain_rate() * (1 + policy.draft_step_fraction("head"))
        bar = policy.draft_bar("head")  # the same, made once per cost model
        assert bar == (pytest.approx(worth), policy.ceiling_rate("head") <= worth)
        assert policy.draft_bar("head") is bar
        return policy.ceiling_rate("head") > worth

    assert pays()
    policy.share_passes(8)
    assert not pays()
    policy.share_passes(1)
    assert pays()
    # a cost function of a test's: the same definition, from its own rates
    planted = CostAware(3, cost=lambda k, source="": 1 + 0.5 * k)
    assert planted.draft_bar("head") == (pytest.approx(1.0), False)
    assert CostAware(3, cost=lambda k, source="": 1 + 1.5 * k).draft_bar("head") == (pytest.approx(1.0), True)


def test_keys_are_typed_by_what_the_drafter_knew():
    policy = CostAware(4, cost=cost)
    sampled = Proposal.chain(torch.tensor([1, 2]), confidence=[0.97, 0.5], source="head")
    assert policy.keys(sampled, 2) == [ConfidenceKey("head", 5, True), ConfidenceKey("head", 2, False)]
    assert ConfidenceKey("head", 5, True).prior == pytest.approx(0.975) and MatchKey("ngram", 2, True).prior == 0.5
    assert policy.keys(Proposal.chain(torch.tensor([4]), source="model"), 1) == [SourceKey("model", False)]


def test_keep_drafting_stops_when_no_longer_draft_can_pay():
    policy = CostAware(8, cost=cost)
    assert policy.keep_drafting([0.999, 0.999], "head")  # confident: longer drafts pay
    assert not policy.keep_drafting([0.999, 0.02], "head")  # the chain is all but dead
    assert not policy.keep_drafting([0.999] * 8, "head")  # the cap


@pytest.mark.parametrize("later_successes, later_failures, keeps", [(9, 1, True), (1, 9, False)])
def test_keep_drafting_scores_unseen_tokens_at_the_pooled_later_acceptance(later_successes, later_failures, keeps):
    """After a first token at confidence 0.5, a second pays (under 46 + 7k ms) only if later
    tokens are accepted with probability > 0.396; the evidence of later positions decides,
    whatever the bin those tokens fell in."""
    policy = CostAware(8, cost=cost)
    policy._estimate(ConfidenceKey("head", 5, False)).update(later_successes, later_failures, 1.0)
    assert policy.keep_drafting([0.5], "head") is keeps
    assert policy.keep_drafting([0.5], "other-source")  # no later evidence: the first token's 0.5 stands in


def test_a_forced_run_after_a_draft_is_counted_certain_and_planned_around():
    """Under a constraint the trim knows how many forced tokens follow each draft length: a model
    draft accepted with p = 0.3 does not pay alone, (1 + 0.3) / (53 + 23 ms) < 1 / 46, but leading
    into 6 forced tokens (certain once it is accepted, 7 ms of pass rows each, no draft step) it
    does, (1 + 0.3 + 0.3 · 6) / (76 + 42) > 1 / 46; and drafts the constraint refuses are never
    verified."""
    model = CostModel(None, {"model": 0.5})  # verify(n) = 46 + 7 (n − 1) ms; a draft step half a 1-row pass
    assert model(1, "model") == pytest.approx(0.046 + 0.007 + 0.023)
    policy = CostAware(4, cost=model)
    policy.acceptance[SourceKey("model", False)] = AcceptanceEstimate(prior=0.3)  # no evidence: p = 0.3
    proposal = Proposal.chain(torch.tensor([5, 6, 7]), source="model")
    assert policy.trim(proposal) == 0
    assert (1 + 0.3) / 0.076 < 1 / 0.046 < (1 + 0.3 + 0.3 * 6) / (0.076 + 6 * 0.007)
    assert policy.trim(proposal, [0, 6, 0, 0]) == 1
    assert policy.trim(proposal, [0]) == 0  # the constraint refuses the first draft
    policy.acceptance[SourceKey("model", False)] = AcceptanceEstimate(prior=0.99)
    # planted between two cycles: the next cycle's block (a proposal is scored once between verdicts)
    proposal = Proposal.chain(torch.tensor([5, 6, 7]), source="model")
    assert policy.trim(proposal) == 3 and policy.trim(proposal, [0, 0]) == 1  # it takes one draft only


def test_a_block_is_scored_once_between_verdicts_and_again_after_one():
    """The hybrid's choice, the trim and the verdict read one block's reach and rates, made once
    while the estimates and the cost model stand (``CostAware._block``); a verdict, or another cost
    model (a new context step, another batch size), scores it again."""
    from tierspec.costs import ForwardCosts

    table = ForwardCosts({1: 0.010, 2: 0.011, 3: 0.012}, context=256, per_position={1: 1e-6, 2: 2e-6, 3: 3e-6})
    policy = CostAware(2, forward_costs=table)
    proposal = Proposal.chain(torch.tensor([5, 6]), match_sizes=[3, 3], source="ngram")
    asked = []
    reach_of = policy._reach
    policy._reach = lambda keys: asked.append(len(keys)) or reach_of(keys)
    rate = policy.expected_rate(proposal)
    assert policy.trim(proposal) == 2 and policy.reach(proposal) == pytest.approx([0.5, 0.25]) and asked == [2]
    assert rate == pytest.approx(max(e / policy.cost(k, "ngram") for k, e in enumerate([1.0, 1.5, 1.75])))
    policy.at_context(4096)  # another cost model: scored again
    policy.trim(proposal)
    assert asked == [2, 2]
    policy.observe(CycleOutcome(proposal, proposal, Verdict([], 9, ["target"])))  # both rejected: learned
    assert policy.reach(proposal)[0] < 0.5 and asked == [2, 2, 2]


def test_confidence_stop_cuts_before_the_first_unsure_token():
    policy = ConfidenceStop(5, 0.5)
    proposal = Proposal.chain(torch.tensor([1, 2, 3]), confidence=[0.9, 0.4, 0.95])
    assert policy.trim(proposal) == 1
    assert policy.keep_drafting([0.9]) and not policy.keep_drafting([0.9, 0.4])


@pytest.mark.parametrize("bad", [-2, 1.5, True])
def test_policies_refuse_bad_lengths(bad):
    with pytest.raises(DraftPolicyError):
        FixedLength(bad)
    with pytest.raises(DraftPolicyError):
        CostAware(bad)


def test_cost_aware_pld_is_lossless(tiny_target, prompt_ids):
    reference = run_ids(tiny_target, as_method(NoDrafter()), prompt_ids, 60)
    method = as_method(NgramDrafter(3), policy=CostAware(8))
    for _ in range(3):
        assert run_ids(tiny_target, method, prompt_ids, 60) == reference


def test_cost_aware_drafts_long_where_drafts_keep_being_right(tiny_target, prompt_ids):
    """The target drafting for itself is always right: the draft length grows to the cap
    (under the straight-line cost model: timing a shared test machine would test the machine)."""
    lengths, caps, emitted = [], [], [0]

    def on_step(step):
        assert step.cycle.accepted == step.cycle.drafted
        lengths.append(step.cycle.drafted)
        caps.append(min(6, 200 - emitted[0] - 1))  # the loop never drafts past the token budget
        emitted[0] += step.cycle.emitted

    run_ids(tiny_target, as_method(ModelDrafter(tiny_target.model), policy=CostAware(6, cost=cost)), prompt_ids, 200,
            on_step=on_step)
    assert lengths[-8:] == caps[-8:] and lengths[0] < 6  # learned, from priors that start lower


class Wrong(Drafter):
    def propose(self, context, request):
        return Proposal.chain(torch.full((request.budget,), 63, dtype=torch.long))


def test_cost_aware_stops_drafting_where_drafts_are_always_wrong(tiny_target, prompt_ids):
    """A drafter whose proposals are always rejected ends up drafting nothing but a rare
    one-token probe (estimates drift back toward the prior while idle, by design)."""
    lengths = []
    run_ids(tiny_target, as_method(Wrong(), policy=CostAware(6, cost=cost)), prompt_ids, 60,
            on_step=lambda step: lengths.append(step.cycle.drafted))
    assert sum(lengths[-20:]) <= 2 and max(lengths[-20:]) <= 1


def test_a_new_generation_starts_from_the_priors():
    """What one generation taught must not choose the next one's drafts (a server's method
    serves every request; the same seed must give the same text whatever ran before)."""
    policy = CostAware(4, cost=cost)
    policy._estimate(MatchKey("ngram", 3, False)).update(4, 0, 1.0)
    matched = Proposal.chain(torch.tensor([1, 2]), match_sizes=[3, 3], source="ngram")
    policy.observe(CycleOutcome(matched, matched, Verdict.chain(2, 9, [])))
    assert policy.acceptance and policy.streak and policy.source_rate("ngram") is not None
    policy.start()
    assert policy.acceptance == {} and not policy.streak and policy.source_rate("ngram") is None


def test_padded_verification_is_lossless_and_keeps_the_cache_invariant(tiny_target, prompt_ids):
    """Passes padded to a cheaper size (here 2–5 tokens → 6; on the default model 2–3 → 4+)
    give the same greedy text, and the padding never survives a commit."""
    from tierspec.costs import ForwardCosts

    table = ForwardCosts({1: 0.057, 2: 0.092, 3: 0.116, 4: 0.088, 5: 0.090, 6: 0.085})
    assert [table.padded_size(n) for n in range(1, 8)] == [1, 6, 6, 6, 6, 6, 7]  # 6 rows are the cheapest
    assert table.cost(2) == 0.085 and table.cost(7) > table.cost(6)
    reference = run_ids(tiny_target, as_method(NoDrafter()), prompt_ids, 60)

    def inspect(verifiers, drafter):
        committed = len(verifiers.context)
        assert verifiers.runner.length == committed - 1 and set(verifiers.runner.layer_lengths()) == {committed - 1}

    method = as_method(NgramDrafter(3), num_draft=3, pass_costs=table)
    assert run_ids(tiny_target, method, prompt_ids, 60, inspect=inspect) == reference


def test_forward_cost_table_is_measured_once_and_cached(tiny_target, tmp_path, monkeypatch):
    from tierspec import costs

    monkeypatch.setenv("TIERSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(costs, "_MEASURED", {})
    measured, tables = [], []
    real = costs.measure_forward_costs

    def measure(model, max_tokens, **kwargs):
        measured.append(max_tokens)
        tables.append(real(model, max_tokens, context=8, repeats=1))
        return tables[-1]

    def new_process():
        monkeypatch.setattr(costs, "_MEASURED", {})

    monkeypatch.setattr(costs, "measure_forward_costs", measure)
    # The spot check is pinned to the last measurement and nothing below compares a time with a
    # number: timing a shared machine would make the test flaky, not stronger (issue 22, item 10).
    monkeypatch.setattr(costs, "spot_check", lambda model: tables[-1].seconds[1])
    first = costs.forward_costs(tiny_target, max_tokens=4)
    assert costs.forward_costs(tiny_target, max_tokens=4) is first  # once per process
    new_process()
    second = costs.forward_costs(tiny_target, max_tokens=4)
    assert measured == [4] and first.seconds == second.seconds and sorted(first.seconds) == [1, 2, 3, 4]
    table = next(tmp_path.glob("forward-costs-*.json"))
    # a damaged cache file is measured again rather than trusted ...
    table.write_text("{broken")
    new_process()
    costs.forward_costs(tiny_target, max_tokens=4)
    assert measured == [4, 4]
    # ... and so is valid JSON of the wrong shape
    table.write_text(json.dumps({"seconds": {"1": "fast"}}))
    new_process()
    costs.forward_costs(tiny_target, max_tokens=4)
    assert measured == [4, 4, 4]
    # a table measured on a busy machine (a 1-token pass 10x slower than now) is re-measured
    data = json.loads(table.read_text())
    data["seconds"] = {n: 10 * v + 0.5 for n, v in data["seconds"].items()}
    table.write_text(json.dumps(data))
    new_process()
    refreshed = costs.forward_costs(tiny_target, max_tokens=4)
    assert measured == [4, 4, 4, 4] and refreshed is tables[-1]
    assert {int(n): v for n, v in json.loads(table.read_text())["seconds"].items()} == refreshed.seconds  # kept


def test_the_draft_heads_step_is_costed_as_measured_beside_a_target_pass(tiny_target, tmp_path, monkeypatch):
    """The head methods' policies charge a draft-head step at its measured share of a one-token pass
    (``costs.draft_step_cost``), not at its weight bytes' share: measured once, kept in a file keyed
    by the head's shape, read back by the next process, and measured again when the file is damaged."""
    from tierspec import costs
    from tierspec.heads.draft import DraftHead
    from tierspec.methods import MethodOptions, build_method

    monkeypatch.setenv("TIERSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(costs, "_MEASURED", {})
    timed = []
    real = costs.measure_draft_step

    def measure(model, step, **kwargs):
        made = real(model, step, context=8, repeats=2)
        timed.append(made)
        # the step's time is what it took; the pass's is pinned so that its share is known exactly
        return costs.DraftStepCost(made.step_seconds, 4 * made.step_seconds)

    monkeypatch.setattr(costs, "measure_draft_step", measure)
    monkeypatch.setattr(costs, "spot_check", lambda model: 4 * timed[-1].step_seconds)
    head = DraftHead.for_target(tiny_target, torch.arange(0, 64, 2), seed=3).eval()
    for name in ("eagle", "hybrid"):
        policy = build_method(name, tiny_target, options=MethodOptions(draft_head=head)).generation().policy
        assert policy.cost.draft_fractions == {"head": pytest.approx(0.25)}
    assert len(timed) == 1 and timed[0].step_seconds > 0  # one head shape, one measurement a process
    kept = next(tmp_path.glob("draft-step-*.json"))
    assert json.loads(kept.read_text())["key"]["drafter"]["head"]["draft_vocab_size"] == 32
    monkeypatch.setattr(costs, "_MEASURED", {})  # a new process reads the file
    build_method("eagle", tiny_target, options=MethodOptions(draft_head=head))
    assert len(timed) == 1
    kept.write_text("{broken")  # a damaged file is measured again
    monkeypatch.setattr(costs, "_MEASURED", {})
    build_method("eagle", tiny_target, options=MethodOptions(draft_head=head))
    assert len(timed) == 2
    # other code (an upgrade, another checkout) measures again beside the first's file, not reading it
    monkeypatch.setattr(costs, "_MEASURED", {})
    monkeypatch.setattr(costs, "_FINGERPRINT", ["another-code"])
    build_method("eagle", tiny_target, options=MethodOptions(draft_head=head))
    assert len(timed) == 3 and len(list(tmp_path.glob("draft-step-*.json"))) == 2


def test_the_code_fingerprint_follows_the_packages_files(tmp_path, monkeypatch):
    """``costs.code_fingerprint`` digests every module of the package: a changed byte changes it."""
    from tierspec import costs

    package = tmp_path / "tierspec"
    package.mkdir()
    (package / "costs.py").write_text("x = 1\n")
    (package / "deep").mkdir()
    (package / "deep" / "mod.py").write_text("y = 2\n")
    (package / "notes.txt").write_text("not code")
    prints = []
    for change in (None, "notes.txt", "deep/mod.py"):
        if change is not None:
            (package / change).write_text((package / change).read_text() + "# changed\n")
        monkeypatch.setattr(costs, "__file__", str(package / "costs.py"))
        monkeypatch.setattr(costs, "_FINGERPRINT", [])
        prints.append(costs.code_fingerprint())
    assert prints[0] == prints[1] != prints[2]  # only code counts


def test_a_lookups_keys_are_one_object_a_match_size_and_its_reach_the_product_of_their_estimates():
    """``CostAware.keys`` for a chain with match sizes: the ``MatchKey`` of each token's size and the
    streak (equal ones one object), and ``reach`` the running product of their estimates'
    probabilities, written out."""
    from tierspec.policies import CostAware, MatchKey
    from tierspec.proposal import Proposal

    policy = CostAware(max_draft=8, cost=lambda k, source: 1.0 + 0.1 * k)
    sizes = [3, 3, 2, 2, 2, 3, 1]
    for size, (successes, failures) in zip((1, 2, 3), ((1.0, 4.0), (3.0, 1.0), (7.0, 2.0))):
        estimate = policy._estimate(MatchKey("ngram", size, policy.streak))
        estimate.successes, estimate.failures = successes, failures
    proposal = Proposal.chain(torch.arange(7), match_sizes=sizes, source="ngram")
    keys = policy.keys(proposal, 7)
    assert keys == [MatchKey("ngram", size, policy.streak) for size in sizes]
    assert keys[0] is keys[1] is keys[5] and keys[2] is keys[3] is keys[4] and keys[0] is not keys[2]
    expected, alive = [], 1.0
    for size in sizes:
        alive *= policy.acceptance[MatchKey("ngram", size, policy.streak)].probability
        expected.append(alive)
    assert policy.reach(proposal) == expected
