"""Lossy and multi-tier rules: exact one-step output distributions, neutral settings, VIA-SD tiers."""


import pytest
import torch
from conftest import as_method, run_ids
from scipy.stats import chi2

from tierspec.cached_model import CachedModel
from tierspec.decode import DecodeConfig, decode
from tierspec.drafters import ModelDrafter, NgramDrafter, NoDrafter
from tierspec.drafters.self_spec import SelfSpeculativeDrafter
from tierspec.layerskip.masks import RoutingMask
from tierspec.proposal import Proposal, Scores
from tierspec.rules import ExactRule, ScoreRule
from tierspec.rules.bild import BildRule, bild_keep
from tierspec.rules.lossy import LossyRule, lossy_acceptance
from tierspec.rules.speculative_cascades import SpeculativeCascadeRule, deferral_bits, mixture
from tierspec.rules.via import ViaRule, via_mixture
from tierspec.sampling import Noise, SamplingConfig, residual_distribution
from tierspec.walks import acceptance_probability

P = torch.tensor([0.6, 0.25, 0.1, 0.05], dtype=torch.float64)  # drafter
Q_SLIM = torch.tensor([0.3, 0.5, 0.15, 0.05], dtype=torch.float64)  # slim verifier
Q = torch.tensor([0.1, 0.3, 0.2, 0.4], dtype=torch.float64)  # target


def enumerate_output(p, accept, residual):
    """Σ_x p(x)·[a(x)·1{v=x} + (1−a(x))·residual(v)] — every accept/reject outcome of one step."""
    return p * accept + (p * (1 - accept)).sum() * residual


# ---- exact one-step distributions -------------------------------------------------------------

@pytest.mark.parametrize("alpha, beta", [(0.0, 1.0), (0.2, 0.8), (0.5, 0.5), (0.3, 1.0)])
def test_lossy_one_step_distribution_is_the_section_3_2_formula(alpha, beta):
    got = enumerate_output(P, lossy_acceptance(P, Q, alpha), residual_distribution(Q, P, beta))
    # docs/algorithms.md §Lossy speculative decoding written out independently: keep
    # min(p, q/(1−α)); the rest goes to norm(max(0, q − βp)).
    kept = torch.minimum(P, Q / (1 - alpha))
    residual = (Q - beta * P).clamp_min(0)
    expected = kept + (1 - kept.sum()) * residual / residual.sum()
    assert torch.allclose(got, expected, atol=1e-12)
    if alpha == 0 and beta == 1:
        assert torch.allclose(got, Q, atol=1e-12)


@pytest.mark.parametrize("rollback", [0.5, 1.3, 2.5, 10.0])
def test_bild_one_step_distribution(rollback):
    keep = bild_keep(Q, rollback).double()
    got = enumerate_output(P, keep, Q)
    expected = torch.where(-torch.log(Q) <= rollback, P, torch.zeros_like(P)) + (P * (-torch.log(Q) > rollback)).sum() * Q
    assert torch.allclose(got, expected, atol=1e-12)


@pytest.mark.parametrize("deferral, alpha", [("chow", 0.3), ("chow", 0.5), ("diff", 0.0), ("opt", 0.1), ("opt", 2.0), ("always", 0.0)])
def test_cascade_one_step_distribution_is_the_mixture(deferral, alpha):
    defer = deferral_bits(P[None], Q[None], deferral, alpha)
    pi = mixture(P[None], Q[None], defer)[0]
    got = enumerate_output(P, acceptance_probability(P, pi), residual_distribution(pi, P))
    assert torch.allclose(got, pi, atol=1e-12)


def test_deferral_rules_on_hand_built_cases():
    p = torch.tensor([[0.6, 0.4], [0.9, 0.1]])
    q = torch.tensor([[0.95, 0.05], [0.5, 0.5]])
    assert deferral_bits(p, q, "chow", 0.2).tolist() == [True, False]  # max p < 0.8?
    assert deferral_bits(p, q, "diff", 0.1).tolist() == [True, False]  # 0.6 < 0.85; 0.9 < 0.4 no
    # opt: TV = 0.35 and 0.4 → thresholds 0.95 − 0.35α, 0.5 − 0.4α
    assert deferral_bits(p, q, "opt", 1.0).tolist() == [False, False]
    assert deferral_bits(p, q, "opt", 0.5).tolist() == [True, False]
    assert deferral_bits(None, q, "chow", 0.2).tolist() == [True, True]  # no distribution: always defer


@pytest.mark.parametrize("delta1", [False, True])
@pytest.mark.parametrize("delta2", [False, True])
def test_via_one_step_distribution_is_pi(delta1, delta2):
    pi = via_mixture(P, Q_SLIM, Q, delta1, delta2)
    # π of docs/algorithms.md §VIA-SD
    expected = (1 - delta2) * ((1 - delta1) * P + delta1 * Q_SLIM) + delta2 * Q
    assert torch.allclose(pi, expected)
    got = enumerate_output(P, acceptance_probability(P, pi), residual_distribution(pi, P))
    assert torch.allclose(got, expected, atol=1e-12)


# ---- the rules' own sampling code, driven by fixed distributions ---------------------------------

class StubVerifiers:
    """Verifier tiers (``rules.base.VerifierTiers``) serving fixed target / slim distributions for
    a one-token block."""

    def __init__(self, target, slim=None):
        self.target_rows, self.slim_rows = target, slim
        self.target_lag = 0
        self.full_calls = 0

    def target(self, proposal, with_hidden=False):
        self.full_calls += 1
        return Scores(torch.log(self.target_rows).float())

    def slim(self, proposal):
        return Scores(torch.log(self.slim_rows).float())


def verdict_of(rule, tiers, proposal, sampling, noise):
    """What the loop does with a rule: hand a rule of scores the target's rows, let a tiered rule
    call its tiers."""
    if isinstance(rule, ScoreRule):
        return rule.decide(proposal, tiers.target(proposal, rule.reads_hidden), sampling, noise)
    return rule.verify(tiers, proposal, sampling, noise)


def sampled_first_tokens(rule, p, target_rows, slim_rows=None, runs=20000, seed=0):
    """The drafts come from a generator of their own, the rule's draws from the keyed noise of
    seeds 0 .. runs − 1 (independent of the drafts, as in the loop)."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[-1])
    sampling = SamplingConfig(temperature=1.0)
    for run in range(runs):
        x = torch.multinomial(p.float(), 1, generator=generator)
        proposal = Proposal.chain(x, p.float()[None], torch.log(p.float())[None])
        noise = Noise(run, p.shape[-1]).block(0)
        verdict = verdict_of(rule, StubVerifiers(target_rows, slim_rows), proposal, sampling, noise)
        counts[int(x) if verdict.accepted else verdict.next_token] += 1
    return counts


def chi_square_p(counts, probs):
    expected = probs.double() * counts.sum()
    return float(chi2.sf(float(((counts - expected) ** 2 / expected).sum()), len(probs) - 1))


@pytest.mark.parametrize(
    "rule, expected",
    [
        (LossyRule(0.2, 0.8), None),
        (SpeculativeCascadeRule("chow", 0.5), None),  # max p = 0.6 < 0.5? no: δ = 0 → π = p
        (SpeculativeCascadeRule("diff", -0.7), None),  # 0.6 < 0.4 + 0.7: δ = 1 → π = q
        (ViaRule(alpha1=0.2, alpha2=0.6, max_target_lag=100), None),  # δ1 = 1 (0.6 < 0.8), δ2 = 0 (0.5 ≥ 0.4): π = q'
        (ViaRule(alpha1=0.5, alpha2=0.3, max_target_lag=100), None),  # δ1 = 0, δ2 = 1: π = q
    ],
)
def test_rule_sampling_matches_its_one_step_distribution(rule, expected):
    target_rows = torch.stack([Q, Q]).float()
    slim_rows = torch.stack([Q_SLIM, Q_SLIM]).float()
    if isinstance(rule, LossyRule):
        kept = torch.minimum(P, Q / 0.8)
        residual = (Q - 0.8 * P).clamp_min(0)
        expected = kept + (1 - kept.sum()) * residual / residual.sum()
    elif isinstance(rule, SpeculativeCascadeRule):
        defer = deferral_bits(P[None], Q[None], rule.deferral, rule.alpha)
        expected = mixture(P[None], Q[None], defer)[0]
    else:
        delta1 = bool(P.max() < 1 - rule.alpha1)
        delta2 = bool(Q_SLIM.max() < 1 - rule.alpha2)
        expected = via_mixture(P, Q_SLIM, Q, delta1, delta2)
    counts = sampled_first_tokens(rule, P, target_rows, slim_rows)
    assert chi_square_p(counts, expected) > 1e-3
    # and the test can tell the target q from the rule's distribution where they differ
    if not torch.allclose(expected, Q):
        assert chi_square_p(counts, Q) < 1e-6


def test_via_skips_the_target_when_slim_is_confident():
    rule = ViaRule(alpha1=0.2, alpha2=0.6, max_target_lag=100)
    stub = StubVerifiers(torch.stack([Q, Q]).float(), torch.stack([Q_SLIM, Q_SLIM]).float())
    rule.verify(stub, Proposal.chain(torch.tensor([1]), P.float()[None], torch.log(P.float())[None]),
                SamplingConfig(1.0), Noise(0, 4).block(0))
    assert stub.full_calls == 0


# ---- neutral settings reproduce plain greedy decoding -------------------------------------------

MASK = RoutingMask.from_units(4, "sublayer", [("mlp", 1), ("attn", 2)])


def greedy_tokens(target, drafter, rule, prompt, slim_mask=None, max_new=40, num_draft=4, check=None):
    state = {}
    method = as_method(drafter, rule, num_draft=num_draft, slim_mask=slim_mask)
    return run_ids(target, method, prompt, max_new, inspect=lambda verifiers, d: state.update(verifiers=verifiers),
                   on_step=(lambda step: check(step, state["verifiers"])) if check else None)


def drafters(target, other):
    return {
        "self-model": lambda: ModelDrafter(target.model),  # always agrees
        "other-model": lambda: ModelDrafter(other.model),
        "ngram": lambda: NgramDrafter(3),
        "self-spec": lambda: SelfSpeculativeDrafter(MASK),
    }


@pytest.mark.parametrize("kind", ["self-model", "other-model", "ngram", "self-spec"])
@pytest.mark.parametrize(
    "rule",
    [
        LossyRule(0.0, 1.0),
        SpeculativeCascadeRule("always"),
        ViaRule(0.0, 0.0, max_target_lag=20, force_full=True),
        BildRule(rollback=0.0),
    ],
    ids=["lossy-a0-b1", "cascade-always", "via-forced-full", "bild-rb0"],
)
def test_neutral_settings_give_ar_greedy_output(tiny_target, tiny_drafter, prompt_ids, kind, rule):
    reference = greedy_tokens(tiny_target, NoDrafter(), ExactRule(), prompt_ids)
    drafter = drafters(tiny_target, tiny_drafter)[kind]()
    slim = MASK if isinstance(rule, ViaRule) else None
    assert greedy_tokens(tiny_target, drafter, rule, prompt_ids, slim) == reference


def test_via_with_confident_tiers_never_calls_the_target_until_the_lag_cap(tiny_target, prompt_ids):
    """α2 = 1: δ2 = 0 everywhere (planted), so the full target runs only when the lag cap forces it."""
    lag_cap = 12
    full_calls = []

    def check(step, verifiers):
        full_calls.append(step.cycle.target_calls)
        assert verifiers.target_lag <= lag_cap

    drafter = ModelDrafter(tiny_target.model)
    greedy_tokens(tiny_target, drafter, ViaRule(0.5, 1.0, max_target_lag=lag_cap), prompt_ids, MASK, 60, 3, check)
    # blocks emit ≤ 4 tokens, so the cap forces a catch-up at most every 3 cycles; never two calls a cycle
    assert 0 < sum(full_calls) < len(full_calls) and max(full_calls) == 1
    assert full_calls[:2] == [0, 0]


def test_via_calls_the_target_where_the_slim_verifier_is_unsure(tiny_target, prompt_ids):
    """α2 = 0: δ2 = 1 wherever max q' < 1, i.e. everywhere: one full call per block."""
    calls = []
    greedy_tokens(tiny_target, ModelDrafter(tiny_target.model), ViaRule(0.5, 0.0, 100), prompt_ids, MASK, 30, 3,
                  lambda step, v: calls.append((step.cycle.target_calls, step.cycle.slim_calls)))
    assert all(c == (1, 1) for c in calls)


# ---- every drafter with every rule, end to end --------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("kind", ["other-model", "ngram", "self-spec"])
@pytest.mark.parametrize(
    "rule", [ExactRule(), LossyRule(0.3), BildRule(2.0), SpeculativeCascadeRule("opt", 0.2), SpeculativeCascadeRule("chow", 0.3), ViaRule(0.5, 0.3, 8)],
    ids=["exact", "lossy", "bild", "cascade-opt", "cascade-chow", "via"],
)
def test_drafter_rule_matrix_replays_every_verdict_from_fresh_passes(tiny_target, tiny_drafter, prompt_ids, kind, rule,
                                                                      temperature):
    """Every cycle of every (drafter, rule) pair, replayed: the rule's verdict on the cycle's
    proposal from passes of a fresh cache (the target over the whole committed text and the drafts;
    VIA's slim tier over the same cache state the loop had: full-model KV up to the full target's
    length, slim KV after it) equals the loop's, the committed tokens are the verdict's, the
    statistics count them, and the caches keep their invariant. A lossless rule also gives ar's
    tokens for the seed."""
    sampling, seed = SamplingConfig(temperature, top_k=40), 0
    drafter = drafters(tiny_target, tiny_drafter)[kind]()
    mask = MASK if isinstance(rule, ViaRule) else None
    states = []  # (committed tokens, full target's length, cache length) at the start of each cycle

    def inspect(verifiers, drafter):
        assert verifiers.full_length <= verifiers.runner.length <= len(verifiers.context) - 1
        states.append((verifiers.context.clone(), verifiers.full_length, verifiers.runner.length))

    class FreshTiers:
        """The tiers recomputed from scratch for one cycle."""

        def __init__(self, context, full_length, length):
            self.context, self.full_length, self.length = context, full_length, length
            self.target_lag = len(context) - 1 - full_length
            self.calls = {"target": 0, "slim": 0}

        def target(self, proposal, with_hidden=False):
            self.calls["target"] += 1
            tokens = torch.cat([self.context, proposal.tokens])
            return Scores(CachedModel(tiny_target.model).forward(tokens).logits[-(len(proposal) + 1):])

        def slim(self, proposal):
            self.calls["slim"] += 1
            runner = CachedModel(tiny_target.model)
            runner.forward(self.context[: self.full_length])
            if self.length > self.full_length:
                runner.forward(self.context[self.full_length : self.length], mask=mask)
            rows = runner.forward(torch.cat([self.context[self.length :], proposal.tokens]), mask=mask).logits
            return Scores(rows[-(len(proposal) + 1):])

    states.append((prompt_ids, len(prompt_ids) - 1, len(prompt_ids) - 1))  # after the prefill
    steps = []
    method = as_method(drafter, rule, num_draft=4, slim_mask=mask)
    out = run_ids(tiny_target, method, prompt_ids, 24, sampling, generator=torch.Generator().manual_seed(seed),
                  inspect=inspect, on_step=steps.append)
    assert len(out) == 24
    replayed = 0
    for step, (context, full_length, length) in zip(steps, states):
        tiers = FreshTiers(context, full_length, length)
        noise = None if sampling.greedy else Noise(seed, tiny_target.vocab_size).block(len(context))
        with torch.inference_mode():
            verdict = verdict_of(rule, tiers, step.proposal, sampling, noise)
        assert (verdict.path, verdict.next_token) == (step.verdict.path, step.verdict.next_token)
        emitted = step.proposal.tokens[verdict.path].tolist() + [verdict.next_token]
        assert step.new_tokens == emitted[: len(step.new_tokens)] and step.cycle.accepted == verdict.accepted
        assert (step.cycle.target_calls, step.cycle.slim_calls) == (tiers.calls["target"], tiers.calls["slim"])
        assert step.cycle.drafted == len(step.proposal) and step.cycle.drafted <= 4
        replayed += step.cycle.drafted
    assert replayed > 0  # drafts were verified, not only plain steps
    if rule.lossless:
        reference = run_ids(tiny_target, as_method(NoDrafter()), prompt_ids, 24, sampling,
                            generator=torch.Generator().manual_seed(seed))
        assert out == reference


def test_cascade_drafter_greedy_equals_ar(tiny_target, tiny_drafter, prompt_ids):
    from tierspec.drafters.cs_drafting import CsDrafter

    reference = greedy_tokens(tiny_target, NoDrafter(), ExactRule(), prompt_ids)
    for model in (tiny_target, tiny_drafter):
        for positions in (1, 3, 5):
            drafter = CsDrafter(model.model, 64, NgramDrafter(2), model_positions=positions, inner_draft=2)
            assert greedy_tokens(tiny_target, drafter, ExactRule(), prompt_ids, num_draft=5) == reference


def test_cascade_drafter_matches_its_model_greedy_drafts(tiny_target, prompt_ids):
    """With the target as the drafter model, the vertical cascade's drafts are the target's own
    greedy tokens, so every model-drafted position is accepted."""
    from tierspec.drafters.cs_drafting import CsDrafter

    drafter = CsDrafter(tiny_target.model, 64, NgramDrafter(3), model_positions=4, inner_draft=3)
    for step in decode(tiny_target, as_method(drafter, num_draft=4), prompt_ids, DecodeConfig(max_new_tokens=30)):
        assert step.cycle.accepted == step.cycle.drafted
