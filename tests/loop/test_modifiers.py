"""Sampling modifiers (presence / frequency penalty, logit bias) and log-probabilities under
speculation (issue 33, items 1 and 2; docs/DESIGN.md §9).

The penalty math is checked on hand-built rows; plain decoding (``ar``) under the modifiers
against a reference that recomputes the whole sequence with transformers at every step and
counts the generated tokens in Python; every lossless method against ``ar`` (greedy and seeded
at temperature 1), tokens exactly and logprobs to ``LOGPROB_TOLERANCE``."""

import importlib

import pytest
import torch
from conftest import shared_fixture

from tierspec.decode import DecodeConfig, DecodeRun, TokenLogprob, token_logprobs
from tierspec.drafters.eagle import EagleDrafter  # noqa: F401  (the head's drafter must import)
from tierspec.heads.draft import DraftHead
from tierspec.errors import TierspecError
from tierspec.methods import WITHOUT_NUM_DRAFT, MethodOptions, build_method
from tierspec.modifiers import LogitModifiers, chain_counts, modified_logits, token_counts, tree_counts
from tierspec.layerskip.masks import RoutingMask
from tierspec.sampling import Noise, SamplingConfig, logits_to_probs, reported_logprobs, sampling_logits

PROMPT = torch.tensor([5, 9, 13, 5, 9, 13, 7, 21, 5, 9, 13, 7, 3, 30, 41])
MODIFIERS = LogitModifiers(presence_penalty=0.6, frequency_penalty=0.9, logit_bias=((5, 2.5), (9, -3.0), (13, 1.0)))
#: A lossless method's logprob and ar's for the same token are read from passes of different
#: sizes, whose float32 logits differ in the last bits (README, "Same seed, same text").
LOGPROB_TOLERANCE = 1e-4
GREEDY, SAMPLED = SamplingConfig(), SamplingConfig(1.0)


# ---- the pure functions -----------------------------------------------------------------------


def test_token_counts_count_each_id():
    assert token_counts(torch.tensor([2, 0, 2, 2]), 4).tolist() == [1.0, 0.0, 3.0, 0.0]


def test_chain_counts_row_i_adds_the_drafts_before_it():
    prior = torch.tensor([0.0, 1.0, 0.0, 0.0])  # token 1 generated once already
    counts = chain_counts(prior, torch.tensor([2, 1, 2]))
    assert counts.tolist() == [[0, 1, 0, 0],   # after the committed text
                               [0, 1, 1, 0],   # + draft 1 (token 2)
                               [0, 2, 1, 0],   # + draft 2 (token 1)
                               [0, 2, 2, 0]]   # + draft 3 (token 2): the bonus row


def test_tree_counts_follow_each_nodes_path():
    # root → node 0 (token 3) → node 2 (token 3); root → node 1 (token 1)
    counts = tree_counts(torch.zeros(4), torch.tensor([3, 1, 3]), torch.tensor([-1, -1, 0]))
    assert counts.tolist() == [[0, 0, 0, 0], [0, 0, 0, 1], [0, 1, 0, 0], [0, 0, 0, 2]]


def test_modified_logits_subtract_the_penalties_and_add_the_bias():
    logits = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])
    counts = torch.tensor([[0.0, 0.0, 2.0], [1.0, 0.0, 0.0]])
    modifiers = LogitModifiers(presence_penalty=0.5, frequency_penalty=0.25, logit_bias=((1, -1.0),))
    out = modified_logits(logits, counts, modifiers)
    # token 2 seen twice: 3 − 0.25·2 − 0.5 = 2.0; token 1 biased: 2 − 1 = 1.0
    assert out.tolist() == [[1.0, 1.0, 2.0], [0.25, 1.0, 3.0]]


@pytest.mark.parametrize("modifiers", [MODIFIERS, LogitModifiers(presence_penalty=-1.5),
                                       LogitModifiers(frequency_penalty=-0.7, logit_bias=((3, 100.0), (0, -100.0), (8, 0.1))),
                                       LogitModifiers(logit_bias=((61, 0.25),))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_touched_tokens_alone_give_the_dense_rows(modifiers, dtype):
    """``TouchedCounts`` (the verifier's path: only the counted and biased tokens written) gives the dense
    reference's values (``modified_logits`` of ``chain_counts`` / ``tree_counts``; equal as values, a zero's
    sign aside) as the generation goes on — drafts that repeat themselves and the history, a tree, tokens drafted
    before they are ever generated, a bias on tokens counted and not (0.1: not a float32 number), negative
    penalties, float64 and bfloat16 rows — in place on float32 and float64 rows; ids outside the vocabulary
    are refused."""
    from tierspec.modifiers import TouchedCounts
    from tierspec.tree import TokenTree

    generator = torch.Generator().manual_seed(3)
    vocab = 64
    history = torch.randint(vocab, (40,), generator=generator).tolist()
    touched = TouchedCounts(modifiers, vocab, history[:10])
    dense_bias = modifiers.bias_vector(vocab) if modifiers.logit_bias else None
    generated = list(history[:10])
    for step in range(4):
        dense_prior = token_counts(torch.tensor(generated, dtype=torch.long), vocab)
        chain = TokenTree.chain([generated[0], 7, 7, 61 - step, generated[5]])
        tree = TokenTree([7, 3, 7, 61, 3], [-1, -1, 0, 2, 1])
        for shape in (chain, tree, TokenTree.chain([])):
            rows = (torch.randn(len(shape) + 1, vocab, generator=generator) * 4).to(dtype)
            rows[0, 9] = float("-inf")
            counts = chain_counts(dense_prior, shape.tokens) if shape.is_chain else tree_counts(dense_prior, shape.tokens,
                                                                                               shape.parents)
            expected = modified_logits(rows, counts, modifiers, dense_bias)
            given = rows.clone()
            got = touched.modify(given, shape.row_paths())
            assert got.dtype == expected.dtype and torch.equal(got, expected)
            assert (got is given) == (dtype != torch.bfloat16)  # written where the rows lie
        new = history[10 + 7 * step : 17 + 7 * step] + [50 + step]  # a committed cycle's tokens, one never seen
        touched.add(new)
        generated += new
    with pytest.raises(TierspecError, match="not in the vocabulary"):
        TouchedCounts(MODIFIERS, vocab, [vocab])
    before = touched.modify(torch.zeros(1, vocab), [[]]).clone()
    with pytest.raises(TierspecError, match="not in the vocabulary"):
        touched.add([4, 5, vocab, 6])  # nothing counted
    touched.add(torch.tensor([7, 7]))  # a tensor's elements count as the ints they hold
    after = touched.modify(torch.zeros(1, vocab), [[]])
    dense = token_counts(torch.tensor(generated + [7, 7], dtype=torch.long), vocab)
    assert torch.equal(after, modified_logits(torch.zeros(1, vocab), dense[None], modifiers, dense_bias))
    assert torch.equal(before, modified_logits(torch.zeros(1, vocab), token_counts(torch.tensor(generated), vocab)[None],
                                               modifiers, dense_bias))
    with pytest.raises(TierspecError, match="not in the vocabulary"):
        touched.modify(torch.zeros(2, vocab), [[], [vocab + 3]])
    with pytest.raises(TierspecError, match="outside the model's vocabulary"):
        TouchedCounts(LogitModifiers(logit_bias=((vocab, 1.0),)), vocab)
    plain = torch.randn(2, vocab)
    assert torch.equal(TouchedCounts(LogitModifiers(presence_penalty=0.5), vocab).modify(plain.clone(), [[], []]), plain)


def test_the_touched_tokens_past_the_first_buffers_and_through_torchs_operators_give_the_dense_rows():
    """Past 64 distinct tokens (the buffers grow, twice), and for rows that track gradients (torch's
    operators, ``_modify_on``, where a write through numpy would pass by autograd): the dense values."""
    from tierspec.modifiers import TouchedCounts

    generator = torch.Generator().manual_seed(8)
    vocab = 5000
    modifiers = LogitModifiers(presence_penalty=0.3, frequency_penalty=-0.45, logit_bias=((17, 0.1), (4999, -3.0)))
    touched = TouchedCounts(modifiers, vocab)
    generated: list[int] = []
    for step in range(30):
        new = torch.randint(vocab, (9,), generator=generator).tolist()
        touched.add(new)
        generated += new
        drafts = [generated[-1], int(torch.randint(vocab, ()).item()), generated[0]]
        counts = chain_counts(token_counts(torch.tensor(generated), vocab), torch.tensor(drafts))
        paths = [drafts[:i] for i in range(len(drafts) + 1)]
        for dtype in (torch.float32, torch.float64):
            rows = torch.randn(len(drafts) + 1, vocab, generator=generator, dtype=dtype) * 4
            expected = modified_logits(rows, counts, modifiers, modifiers.bias_vector(vocab))
            assert torch.equal(touched.modify(rows.clone(), paths), expected)
            tracked = rows.clone().requires_grad_() * 1.0  # not a leaf: written in place by torch, as before
            assert torch.equal(touched.modify(tracked, paths).detach(), expected)
    assert len(touched._slots) > 128 and len(touched._ids) >= 256  # grown past 64 and 128 slots
    many = LogitModifiers(frequency_penalty=0.7, logit_bias=tuple((3 * i, 0.1 * i - 4) for i in range(70)))
    rows = torch.randn(2, vocab, generator=generator) * 4  # 70 biased tokens: grown while the biases are written
    expected = modified_logits(rows, chain_counts(token_counts(torch.tensor(generated), vocab), torch.tensor([5])), many,
                               many.bias_vector(vocab))
    assert torch.equal(TouchedCounts(many, vocab, generated).modify(rows.clone(), [[], [5]]), expected)


def test_a_trees_row_paths_are_each_nodes_path():
    from tierspec.tree import TokenTree

    assert TokenTree.chain([4, 2, 4]).row_paths() == [[], [4], [4, 2], [4, 2, 4]]
    assert TokenTree([3, 1, 3, 5], [-1, -1, 0, 2]).row_paths() == [[], [3], [1], [3, 3], [3, 3, 5]]


def test_a_penalty_turns_greedy_away_from_a_repeated_token():
    logits = torch.tensor([[2.0, 1.9]])
    assert modified_logits(logits, torch.tensor([[1.0, 0.0]]), LogitModifiers(frequency_penalty=0.2)).argmax() == 1  # rejects 0
    assert modified_logits(logits, torch.tensor([[1.0, 0.0]]), LogitModifiers(frequency_penalty=0.05)).argmax() == 0  # keeps 0


@pytest.mark.parametrize("kwargs, message", [
    ({"presence_penalty": 2.5}, "presence_penalty must be a number in"),
    ({"frequency_penalty": -3}, "frequency_penalty must be a number in"),
    ({"logit_bias": ((1, 101.0),)}, "the bias of token 1 must be in"),
    ({"logit_bias": ((-1, 1.0),)}, "token ids are integers >= 0"),
    ({"logit_bias": ((1, 1.0), (1, 2.0))}, "token id 1 is given twice"),
])
def test_modifiers_out_of_range_are_refused(kwargs, message):
    with pytest.raises(TierspecError, match=message):
        LogitModifiers(**kwargs)


def test_all_zero_modifiers_are_inactive():
    assert not LogitModifiers(logit_bias=((3, 0.0),)).active and LogitModifiers(presence_penalty=0.1).active


def test_reported_logprobs_are_after_temperature_and_model_logprobs_when_greedy():
    logits = torch.tensor([[0.0, 1.0, 3.0]])
    assert torch.allclose(reported_logprobs(logits, GREEDY), logits.log_softmax(-1))
    assert torch.allclose(reported_logprobs(logits, SamplingConfig(0.5)), (logits / 0.5).log_softmax(-1))
    top1 = reported_logprobs(logits, SamplingConfig(1.0, top_k=1))
    assert top1[0, 2] == 0.0 and top1[0, :2].tolist() == [float("-inf")] * 2  # outside top-k: −inf


def test_token_logprobs_record_the_token_and_its_alternatives():
    logits = torch.tensor([[0.0, 2.0, 1.0]]).log_softmax(-1)
    (record,) = token_logprobs(logits, [2], GREEDY, top=2)
    assert record.token == 2 and record.logprob == pytest.approx(float(logits[0, 2]))
    assert [token for token, _ in record.top] == [1, 2]


# ---- the loop: ar against a reference, every lossless method against ar -----------------------


pytestmark = pytest.mark.usefixtures("pinned_pass_costs")  # tests/conftest.py


target = shared_fixture("target", "sampling_target")
own_target = shared_fixture("own_target", "sampling_own_target")
drafter = shared_fixture("drafter", "sampling_drafter")


def options_for(name: str, target) -> MethodOptions:
    values = {"num_draft": None if name in WITHOUT_NUM_DRAFT else 4,
              "draft_head": DraftHead.for_target(target, torch.arange(0, 64, 2), seed=3).eval()}
    if name == "self":
        values["mask"] = RoutingMask.from_units(4, "sublayer", [("mlp", 1), ("attn", 2)])
    return MethodOptions(**values)


def run(target, method, sampling, seed, modifiers=MODIFIERS, max_new=40, logprobs=3, score_prompt=False):
    config = DecodeConfig(max_new_tokens=max_new, sampling=sampling, modifiers=modifiers, logprobs=logprobs,
                          score_prompt=score_prompt)
    generation = DecodeRun(target, method, PROMPT, config, seed)
    steps = list(generation)
    records = [record for step in steps for record in step.logprobs] if logprobs is not None else None
    return generation.token_ids, records, steps


def reference_tokens(target, sampling, seed, modifiers=MODIFIERS, max_new=40):
    """Plain decoding recomputed from scratch: the whole sequence through transformers at every
    step, the modifiers applied with counts taken in Python, the token drawn with the seed's
    noise at its position (an exact draw from the modified distribution)."""
    ids = PROMPT.tolist()
    noise = Noise(seed, target.vocab_size)
    bias = dict(modifiers.logit_bias)
    generated: list[int] = []
    rows = []
    with torch.no_grad():
        for _ in range(max_new):
            logits = target.model(torch.tensor([ids])).logits[0, -1].double()
            for token in range(logits.shape[0]):
                count = generated.count(token)
                logits[token] += bias.get(token, 0.0) - modifiers.frequency_penalty * count \
                    - modifiers.presence_penalty * (count > 0)
            rows.append(logits)
            if sampling.greedy:
                token = int(logits.argmax())
            else:
                token = int((sampling_logits(logits, sampling) + noise.gumbel(len(ids))).argmax())  # the target's draw
            ids.append(token)
            generated.append(token)
    return generated, torch.stack(rows)


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "t1"])
def test_ar_under_the_modifiers_is_the_recomputed_reference(target, sampling):
    ar = build_method("ar", target)
    for seed in range(3):
        expected, rows = reference_tokens(target, sampling, seed)
        tokens, records, _ = run(target, ar, sampling, seed)
        assert tokens == expected
        assert tokens != run(target, ar, sampling, seed, modifiers=LogitModifiers(), logprobs=None)[0]  # they bite
        reported = reported_logprobs(rows, sampling)
        for record, row, token in zip(records, reported, tokens):
            assert record.logprob == pytest.approx(float(row[token]), abs=LOGPROB_TOLERANCE)
            assert [t for t, _ in record.top] == row.topk(3).indices.tolist()


LOSSLESS = ["sd", "pld", "adaptive-pld", "adaptive-sd", "eagle", "hybrid", "self", "swift", "csd", "pearl",
            "eagle-tree", "hybrid-tree", "clasp"]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "t1"])
@pytest.mark.parametrize("name", LOSSLESS)
def test_every_lossless_method_stays_ars_under_the_modifiers_with_ars_logprobs(name, sampling, target, own_target,
                                                                                drafter):
    """The rule verifies each drafted position against the modified target (its counts include
    the drafts before it): the tokens are ar's exactly, the logprobs ar's to the tolerance, and
    drafts were verified on the way (kept ones and rejected ones)."""
    model = own_target if name.endswith("-tree") or name == "clasp" else target
    ar = build_method("ar", model)
    method = build_method(name, model, drafter, options_for(name, model), strict=False)  # a superset of parts
    drafted = kept = 0
    for seed in range(3):
        expected, expected_records, _ = run(model, ar, sampling, seed)
        tokens, records, steps = run(model, method, sampling, seed)
        assert tokens == expected
        assert len(records) == len(tokens)
        for record, reference in zip(records, expected_records):
            assert record.token == reference.token
            assert record.logprob == pytest.approx(reference.logprob, abs=LOGPROB_TOLERANCE)
            assert [t for t, _ in record.top] == [t for t, _ in reference.top]
        drafted += sum(step.cycle.drafted for step in steps)
        kept += sum(step.cycle.accepted for step in steps)
    # Drafts were verified and some rejected (the cost-aware and confidence-stopped drafters may
    # give up drafting on a random tiny model whose drafts the penalties keep rejecting).
    if name not in ("self", "swift", "clasp", "adaptive-sd", "eagle"):
        assert drafted > kept
    if name in ("sd", "csd", "pearl") or (name.endswith("-tree") and not sampling.greedy):
        assert kept > 0  # and some kept: their rows' counts included the drafts before them


def test_the_target_drafting_for_itself_without_the_modifiers_is_corrected_to_ars_text(target):
    """A drafter that ignores the modifiers (the target drafting for itself) proposes the
    unmodified text: the rule keeps what the modified target agrees with and corrects the rest."""
    ar = build_method("ar", target)
    sd = build_method("sd", target, target, MethodOptions(num_draft=4))
    for sampling in (GREEDY, SAMPLED):
        tokens, _, steps = run(target, sd, sampling, 1)
        assert tokens == run(target, ar, sampling, 1)[0]
        kept, drafted = sum(s.cycle.accepted for s in steps), sum(s.cycle.drafted for s in steps)
        assert 0 < kept < drafted


def test_echo_scores_the_prompt_with_the_prefill(target):
    """The prompt's records come from the prefill's rows: token 0 has none, token j the target's
    log-probability after tokens 0..j−1 (only the bias applies: nothing is generated yet)."""
    _, _, steps = run(target, build_method("ar", target), GREEDY, 0, score_prompt=True, logprobs=2)
    records = steps[0].prompt_logprobs
    assert records[0] == TokenLogprob(int(PROMPT[0]), None) and len(records) == len(PROMPT)
    assert all(step.prompt_logprobs is None for step in steps[1:])
    with torch.no_grad():
        logits = target.model(PROMPT[None]).logits[0, :-1].double()
    logits[:, 5] += 2.5
    logits[:, 9] -= 3.0
    logits[:, 13] += 1.0
    expected = logits.log_softmax(-1)
    for j, record in enumerate(records[1:], start=1):
        assert isinstance(record, TokenLogprob) and record.token == int(PROMPT[j])
        assert record.logprob == pytest.approx(float(expected[j - 1, PROMPT[j]]), abs=LOGPROB_TOLERANCE)


def test_a_long_echoed_prompt_is_scored_in_chunks_with_the_same_values(target, monkeypatch):
    verifiers_module = importlib.import_module("tierspec.verifiers")
    ar = build_method("ar", target)
    whole = run(target, ar, GREEDY, 0, score_prompt=True, max_new=2)[2][0].prompt_logprobs
    monkeypatch.setattr(verifiers_module, "SCORED_PREFILL_CHUNK", 4)
    chunked = run(target, ar, GREEDY, 0, score_prompt=True, max_new=2)[2][0].prompt_logprobs
    assert [r.token for r in chunked[1:]] == [r.token for r in whole[1:]]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(chunked[1:], whole[1:])) < LOGPROB_TOLERANCE


def test_logprobs_are_refused_where_a_slim_tier_commits_unscored_tokens(target):
    mask = RoutingMask.from_units(4, "sublayer", [("mlp", 1), ("attn", 2)])
    method = build_method("via", target, options=MethodOptions(mask=mask))
    with pytest.raises(TierspecError, match="cannot report log-probabilities: its slim verifier"):
        run(target, method, GREEDY, 0)


def test_a_bias_outside_the_vocabulary_is_refused(target):
    with pytest.raises(TierspecError, match="token id 64 is outside the model's vocabulary"):
        run(target, build_method("ar", target), GREEDY, 0, modifiers=LogitModifiers(logit_bias=((64, 1.0),)))
