"""Exact speculative decoding (docs/algorithms.md §Exact speculative decoding): the output
distribution equals the target's, under both sampling rules (coupled and residual)."""

import math

import pytest
import torch
from distributions import chi_square_p_value, pooled_chi_square_p_value

from tierspec.decode import DecodeConfig, decode
from tierspec.drafters import ModelDrafter
from tierspec.proposal import Proposal, Scores, Walk
from tierspec.rules import ExactRule
from tierspec.sampling import Noise, SamplingConfig, logits_to_probs, residual_distribution
from tierspec.walks import acceptance_probability, acceptance_walk, exact_walk


def exact_one_step_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Enumerate draft outcomes: x ~ p is kept w.p. a(x), else the residual is drawn."""
    accept = acceptance_probability(p, q)  # a(x) for every x
    rejected_mass = (p * (1 - accept)).sum()
    return p * accept + rejected_mass * residual_distribution(q, p)


@pytest.mark.parametrize(
    "p, q",
    [
        ([0.7, 0.2, 0.1], [0.1, 0.3, 0.6]),
        ([0.25, 0.25, 0.25, 0.25], [0.97, 0.01, 0.01, 0.01]),
        ([0.0, 0.5, 0.5], [0.2, 0.0, 0.8]),
        ([1.0, 0.0, 0.0], [0.3, 0.3, 0.4]),  # one-hot drafter (n-gram)
        ([0.4, 0.6], [0.4, 0.6]),  # identical: everything accepted
    ],
)
def test_exact_rule_output_distribution_equals_target(p, q):
    p, q = torch.tensor(p, dtype=torch.float64), torch.tensor(q, dtype=torch.float64)
    assert torch.allclose(exact_one_step_distribution(p, q), q, atol=1e-12)


def test_acceptance_probability_cases():
    # accepts: q(x) >= p(x) -> 1
    assert acceptance_probability(torch.tensor(0.2), torch.tensor(0.5)) == 1.0
    # rejects sometimes: q(x) < p(x) -> q/p
    assert torch.isclose(acceptance_probability(torch.tensor(0.8), torch.tensor(0.2)), torch.tensor(0.25))


def greedy(draft, logits):
    return exact_walk(Proposal.chain(torch.tensor(draft, dtype=torch.long)), logits, SamplingConfig(), None)


def test_greedy_exact_walk_block_cases():
    logits = torch.tensor([[0, 5.0, 0], [5.0, 0, 0], [0, 0, 5.0], [0, 5.0, 0]])  # argmax 1, 0, 2, 1
    assert greedy([1, 0, 2], logits) == Walk([0, 1, 2], 1)  # accepts all, bonus argmax
    assert greedy([1, 2, 2], logits) == Walk([0], 0)  # rejects at 1, correction 0
    assert greedy([0, 0, 2], logits) == Walk([], 1)  # rejects first
    assert greedy([], logits[:1]) == Walk([], 1)  # empty draft = AR


@pytest.mark.parametrize("sampling_rule", ["coupled", "residual"])
def test_sampled_exact_walk_replaces_a_token_the_target_never_draws(sampling_rule):
    # q(x=0) = 0: the one-hot draft of token 0 is always rejected; the residual is q itself.
    logits = torch.log(torch.tensor([[1e-30, 0.5, 0.5], [1.0, 1e-30, 1e-30]]))
    seen = set()
    for seed in range(20):
        noise = Noise(seed, 3).block(0)
        walk = exact_walk(Proposal.chain(torch.tensor([0])), logits, SamplingConfig(1.0), noise, sampling_rule)
        assert walk.accepted == 0 and walk.next_token in (1, 2)
        seen.add(walk.next_token)
    assert seen == {1, 2}


def test_acceptance_walk_keeps_in_order_and_stops_at_the_first_rejection():
    calls = []
    walk = acceptance_walk(4, torch.tensor([1.0, 1.0, 0.0, 1.0]), lambda i, passed: calls.append(i) or 7, lambda: 9, None)
    assert walk == Walk([0, 1], 7) and calls == [2]  # accepts, accepts, rejects (replacement drawn there)
    assert acceptance_walk(2, torch.tensor([1.0, 1.0]), lambda i, passed: 7, lambda: 9, None) == Walk([0, 1], 9)  # bonus
    # a keep() override (Judge Decoding's OR) sees the coin's verdict
    assert acceptance_walk(3, torch.tensor([0.0, 0.0, 0.0]), lambda i, passed: 5, lambda: 9, None,
                           keep=lambda i, passed: i < 2) == Walk([0, 1], 5)


def first_token_counts(target, drafter, prompt, runs: int, sampling_rule: str) -> torch.Tensor:
    """Sample the first generated token with seeds 0 .. ``runs`` − 1 through the decode loop
    (one draft token)."""
    vocab = target.vocab_size
    counts = torch.zeros(vocab)
    from conftest import as_method

    config = DecodeConfig(max_new_tokens=2, sampling=SamplingConfig(temperature=1.0))
    method = as_method(ModelDrafter(drafter.model), ExactRule(sampling_rule), num_draft=1)
    for seed in range(runs):
        steps = decode(target, method, prompt, config, seed)
        counts[next(steps).new_tokens[0]] += 1
    return counts


@pytest.mark.parametrize("sampling_rule", ["coupled", "residual"])
def test_sampling_run_matches_target_first_token_distribution(sampling_rule):
    from conftest import tiny_llama

    # Small vocabulary and peaked, different distributions so that the residual carries mass.
    target = tiny_llama(seed=11, vocab_size=12, layers=2, hidden=16, sharpness=10.0)
    drafter = tiny_llama(seed=12, vocab_size=12, layers=1, hidden=16, sharpness=10.0)
    prompt = torch.tensor([1, 2, 3, 4])
    with torch.inference_mode():
        q = logits_to_probs(target.model(prompt[None]).logits[0, -1], SamplingConfig(1.0)).double()
        p = logits_to_probs(drafter.model(prompt[None]).logits[0, -1], SamplingConfig(1.0)).double()
    rejected_mass = float((p * (1 - acceptance_probability(p, q))).sum())
    assert rejected_mass > 0.2, "the test needs a drafter that disagrees often"

    counts = first_token_counts(target, drafter, prompt, runs=3000, sampling_rule=sampling_rule)
    assert chi_square_p_value(counts, q) > 1e-3

    # The same counts would condemn a wrong residual (drawing from q itself on rejection).
    accept = acceptance_probability(p, q)
    wrong = p * accept + rejected_mass * q
    assert torch.abs(wrong - q).sum() > 0.1
    assert chi_square_p_value(counts, wrong) < 1e-6


# ---- the coupled rule -----------------------------------------------------------------------

def gumbel_max_probability(pi: torch.Tensor, v: int) -> float:
    """P(argmax_w(log π_w + G_w) = v) for i.i.d. standard Gumbel G, by quadrature over G_v = t:
    ∫ f(t) Π_{w≠v} F(t + log π_v − log π_w) dt with F(t) = exp(−e^{−t}), f = F'."""
    from scipy.integrate import quad

    pi = pi.double()
    if pi[v] == 0:
        return 0.0
    shifts = [float(torch.log(pi[v] / pi[w])) for w in range(len(pi)) if w != v and pi[w] > 0]

    def integrand(t: float) -> float:
        log_value = -t - math.exp(-t)  # log f(t)
        for s in shifts:
            log_value -= math.exp(-(t + s))  # + log F(t + s)
        return math.exp(log_value)

    return quad(integrand, -10.0, 60.0, epsabs=1e-13, epsrel=1e-12, limit=400)[0]


@pytest.mark.parametrize("pi", [
    [0.1, 0.3, 0.2, 0.4],
    [0.97, 0.01, 0.01, 0.01],
    [0.0, 0.5, 0.0, 0.5],  # top-k / top-p leave zeros: never drawn
    [1e-9, 1 - 2e-9, 1e-9, 0.0],
])
def test_the_perturbed_argmax_is_an_exact_draw(pi):
    """The coupled rule emits argmax(log π + g_t) whatever was drafted (next test); with g_t
    standard Gumbel that token has law π exactly (integrated, not sampled)."""
    pi = torch.tensor(pi, dtype=torch.float64)
    got = torch.tensor([gumbel_max_probability(pi, v) for v in range(len(pi))], dtype=torch.float64)
    assert torch.allclose(got, pi, atol=1e-10, rtol=0)


def test_the_coupled_walk_emits_the_targets_perturbed_argmax_whatever_was_drafted():
    q = torch.tensor([[0.1, 0.3, 0.2, 0.4], [0.5, 0.2, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]])
    for seed in range(200):
        noise = Noise(seed, 4).block(0)
        y = (q.log() + noise.gumbels(4)).argmax(-1)  # the target's tokens, written out
        other = [(int(y[0]) + 1) % 4, 0, 0], [int(y[0]), (int(y[1]) + 1) % 4, 0]  # rejected first / second
        for draft in ([], y[:1].tolist(), y[:3].tolist(), *other):
            walk = exact_walk(Proposal.chain(torch.tensor(draft, dtype=torch.long)), q[: len(draft) + 1].log(),
                              SamplingConfig(1.0), noise, "coupled")
            accepted, emitted = walk.accepted, draft[: walk.accepted] + [walk.next_token]
            assert emitted == y[: len(emitted)].tolist()  # accepts exactly the drafts equal to y
            assert accepted == len(draft) or draft[accepted] != int(y[accepted])  # rejects the first that differs


@pytest.mark.parametrize("sampling_rule, lossless", [("coupled", True), ("residual", False)])
def test_a_policy_that_peeks_at_the_draft_cannot_bias_the_coupled_rule(sampling_rule, lossless):
    """A draft-length policy that looks at what was drafted (the cost-aware trim reads the
    confidence of every drafted token, which depends on the tokens before it) decides whether a
    position is verified from the draft itself. The coupled rule's token is the target's
    perturbed argmax whatever was verified, so its output stays q; the residual rule's is biased
    (planted: the draft is dropped exactly when it is token 0)."""
    p = torch.tensor([0.6, 0.25, 0.1, 0.05])
    q = torch.tensor([0.1, 0.3, 0.2, 0.4])
    rule = ExactRule(sampling_rule)
    counts = torch.zeros(4)
    for seed in range(20000):
        noise = Noise(seed, 4).block(0)
        x = noise.token(0, p)  # the drafter's draw, with the token noise as in the loop
        proposal = Proposal.chain(torch.tensor([x]), p[None]) if x != 0 else Proposal.empty()
        rows = torch.stack([q, q])[: len(proposal) + 1].log().float()  # the target's fixed rows
        verdict = rule.decide(proposal, Scores(rows), SamplingConfig(1.0), noise)
        counts[x if verdict.accepted else verdict.next_token] += 1
    assert (chi_square_p_value(counts, q.double()) > 1e-3) is lossless
    if not lossless:
        assert chi_square_p_value(counts, q.double()) < 1e-6


def test_two_tokens_of_the_coupled_loop_have_the_targets_joint_distribution():
    """Over positions: the committed tokens before t are a function of g_<t only, so the token
    at t is an exact draw from q_t given them (a drafter proposing both positions in one block
    shares g_t with the target). Chi-square of (y1, y2) over seeds against q(y1)·q(y2 | y1)."""
    from conftest import as_method, tiny_llama

    target = tiny_llama(seed=11, vocab_size=8, layers=2, hidden=16, sharpness=4.0)
    drafter = tiny_llama(seed=12, vocab_size=8, layers=1, hidden=16, sharpness=4.0)
    prompt = torch.tensor([1, 2, 3, 4])
    sampling = SamplingConfig(1.0)
    with torch.inference_mode():
        first = logits_to_probs(target.model(prompt[None]).logits[0, -1], sampling).double()
        second = torch.stack([logits_to_probs(target.model(torch.cat([prompt, torch.tensor([y])])[None]).logits[0, -1],
                                              sampling).double() for y in range(8)])
    joint = (first[:, None] * second).flatten()  # [64]
    method = as_method(ModelDrafter(drafter.model), ExactRule("coupled"), num_draft=2)
    counts = torch.zeros(64)
    accepted = 0
    for seed in range(4000):
        out = []
        for step in decode(target, method, prompt, DecodeConfig(max_new_tokens=2, sampling=sampling), seed):
            out.extend(step.new_tokens)
            accepted += step.cycle.accepted
        counts[out[0] * 8 + out[1]] += 1
    assert accepted > 1000  # drafts were kept (and where they were not, the target's token was emitted)
    assert pooled_chi_square_p_value(counts, joint) > 1e-3
