"""Continuous batching (``tierspec.batch``: the one cycle over many sequences): every generation's
tokens equal its solo tokens whatever shares the batch and whenever it joined, greedy and seeded,
prompts prefilled in chunks inside the cycles; methods that cannot share a pass run alone in the
same executor; the batch's draft lengths; the draft head's steps of several sequences in one
engine pass; the vectorised decisions against one sequence at a time."""

from __future__ import annotations

import pytest
import torch

from gguf_models import write_tiny_gguf
from tierspec.batch import BatchDecoder, BatchError
from tierspec.cached_model import CachedModel
from tierspec.decode import DecodeConfig, DecodeRun, batch_lengths
from tierspec.gguf_llama import load_gguf_llama
from tierspec.methods import MethodOptions, build_method
from tierspec.models import wrap_model
from tierspec.quant import numerics_for
from tierspec.sampling import SamplingConfig

pytestmark = pytest.mark.usefixtures("pinned_pass_costs")  # tests/conftest.py


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # two heads of 32 dimensions: widths the draft head's engine step takes (``heads.engine_head``)
    tiny = write_tiny_gguf(tmp_path_factory.mktemp("batch-gguf"), seed=11, heads=2, kv_heads=1, sharpness=12.0)
    dtype = torch.bfloat16 if numerics_for(torch.bfloat16).layout == 0 else torch.float32
    return wrap_model(load_gguf_llama(tiny.gguf, tiny.folder, numerics_for(dtype)), name="tiny-gguf")


@pytest.fixture(scope="module")
def head(target):
    from tierspec.heads.draft import DraftHead

    head = DraftHead.for_target(target, torch.arange(0, 256, 2), seed=5).eval()
    assert head.engine is not None  # drafting on the engine: the batched head steps are exercised
    return head


# repetitive prompts, so that n-gram lookup drafts (and is sometimes right); the last is long enough to
# be prefilled in several chunks beside the others
PROMPTS = [torch.tensor([5, 9, 13, 5, 9, 13, 7, 21, 5, 9, 13]), torch.tensor([40, 41, 42, 40, 41, 42, 40]),
           torch.tensor([100, 7, 200, 7, 100, 7]), torch.tensor([3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]),
           torch.tensor([250, 1, 250, 1, 250]), (torch.arange(150) * 37 + 11) % 256]
BUDGETS = [20, 7, 15, 25, 1, 12]


def _method(target, name: str, head=None):
    return build_method(name, target, None, MethodOptions(num_draft=None if name == "ar" else 4,
                                                          draft_head=head if name in ("eagle", "hybrid") else None))


def _solo(target, method, temperature: float, prompts=PROMPTS, budgets=BUDGETS) -> list[list[int]]:
    out = []
    for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
        config = DecodeConfig(max_new_tokens=budget, sampling=SamplingConfig(temperature=temperature))
        out.append(DecodeRun(target, method, prompt, config, seed=1000 + i).finish().token_ids)
    return out


def _batched(target, method, temperature: float, joins, max_rows=None, prompts=PROMPTS, budgets=BUDGETS):
    """``joins[i]``: the cycle generation i joins at."""
    batch = BatchDecoder(target, max_batch=len(prompts), max_rows=max_rows)
    runs, cycle = {}, 0
    while len(runs) < len(prompts) or len(batch):
        for i, join in enumerate(joins):
            if join == cycle and i not in runs:
                config = DecodeConfig(max_new_tokens=budgets[i], sampling=SamplingConfig(temperature=temperature))
                runs[i] = batch.add(i, method, prompts[i], config, seed=1000 + i)
        batch.step()
        cycle += 1
    return [runs[i] for i in range(len(prompts))], batch


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", ["ar", "pld", "adaptive-pld", "eagle", "hybrid"])
@pytest.mark.parametrize("joins", [[0, 0, 0, 0, 0, 0], [0, 1, 1, 3, 5, 2], [2, 0, 4, 1, 0, 0]])
def test_every_generation_gets_its_solo_tokens(target, head, name, temperature, joins):
    """Planted interleavings (all at once, one by one, out of order); the budgets differ, so
    generations also leave at different cycles; the long prompt is prefilled in chunks beside
    the others' decoding."""
    method = _method(target, name, head)
    expected = _solo(target, method, temperature)
    runs, batch = _batched(target, method, temperature, joins)
    assert [run.token_ids for run in runs] == expected
    assert all(run.finished for run in runs) and all(run.stats.emitted == len(run.token_ids) for run in runs)
    assert batch.times.rows > batch.times.cycles  # passes carried several sequences' rows


def test_a_row_budget_cuts_drafts_and_prefill_chunks_not_the_text(target, head):
    method = _method(target, "hybrid", head)
    expected = _solo(target, method, 0.0)
    runs, batch = _batched(target, method, 0.0, [0, 0, 0, 0, 0, 0], max_rows=8)
    assert [run.token_ids for run in runs] == expected
    assert batch.times.rows <= 8 * batch.times.cycles


def test_a_long_prompt_joining_is_prefilled_in_chunks_while_the_others_decode(target):
    """The 150-token prompt joins a decoding generation: the cycles that prefill it still give the
    other its next tokens (one per cycle here, ``ar``), so the other is not stalled for the prompt."""
    method = _method(target, "ar")
    batch = BatchDecoder(target, max_batch=2, max_rows=40)
    first = batch.add("first", method, PROMPTS[0], DecodeConfig(max_new_tokens=20))
    batch.step()
    batch.add("long", method, PROMPTS[5], DecodeConfig(max_new_tokens=4))
    stepped = []
    while not batch.sequences["long"].ready:
        stepped.append([s.key for s, _ in batch.step()])
    assert len(stepped) >= 3 and all(keys == ["first"] for keys in stepped)  # 149 rows in chunks of ≤ 39
    while len(batch):
        batch.step()
    assert first.token_ids == _solo(target, method, 0.0, PROMPTS[:1], [20])[0]


def test_a_prompt_alone_is_prefilled_in_lone_prefill_chunks_and_a_joiner_waits_one(target):
    """A server's long prompt alone went in one pass: a request that joined waited all of it (38 s for
    8,000 tokens). With ``lone_prefill`` the prompt goes 64 rows a cycle and a joiner starts at the next."""
    method = _method(target, "ar")
    batch = BatchDecoder(target, max_batch=2, lone_prefill=64)
    long = batch.add("long", method, PROMPTS[5], DecodeConfig(max_new_tokens=4))
    batch.step()
    assert long.verifiers.prefill_left == 149 - 64 and not long.ready  # 64 of its 149 prefill rows
    short = batch.add("short", method, PROMPTS[0], DecodeConfig(max_new_tokens=6))
    batch.step()
    assert short.ready and not long.ready  # the joiner's prompt went in the next pass, beside a chunk of the long one
    while len(batch):
        batch.step()
    assert long.token_ids == _solo(target, method, 0.0, PROMPTS[5:], [4])[0]
    assert short.token_ids == _solo(target, method, 0.0, PROMPTS[:1], [6])[0]
    with pytest.raises(BatchError, match="lone_prefill"):
        BatchDecoder(target, lone_prefill=0)


def test_a_cancelled_generation_leaves_the_others_as_they_were(target):
    method = _method(target, "pld")
    expected = _solo(target, method, 0.0)
    batch = BatchDecoder(target, max_batch=3)
    runs = {i: batch.add(i, method, PROMPTS[i], DecodeConfig(max_new_tokens=BUDGETS[i]), seed=1000 + i)
            for i in (0, 1, 3)}
    batch.step()
    batch.step()
    batch.cancel(1)
    while len(batch):
        batch.step()
    assert runs[0].token_ids == expected[0] and runs[3].token_ids == expected[3]
    assert not runs[1].finished


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_method_that_cannot_share_a_pass_runs_alone_beside_the_batch_with_its_solo_text(target, temperature):
    """A lossy rule's text depends on its drafts, which a batch would size by what else runs: in
    the batch's executor it cycles alone, beside batched lossless generations."""
    lossy = build_method("lossy", target, None, MethodOptions(drafter_kind="ngram", num_draft=3))
    ar = _method(target, "ar")
    config = DecodeConfig(max_new_tokens=15, sampling=SamplingConfig(temperature=temperature))
    alone = [DecodeRun(target, m, PROMPTS[i], config, seed=7).finish().token_ids for i, m in enumerate((lossy, ar, ar))]
    batch = BatchDecoder(target, max_batch=3)
    runs = [batch.add(i, m, PROMPTS[i], config, seed=7) for i, m in enumerate((lossy, ar, ar))]
    while len(batch):
        batch.step()
    assert [run.token_ids for run in runs] == alone


def test_the_batch_refuses_what_it_cannot_take(target):
    config = DecodeConfig(max_new_tokens=4)
    batch = BatchDecoder(target, max_batch=1)
    batch.add("a", _method(target, "ar"), PROMPTS[0], config)
    with pytest.raises(BatchError, match="full"):
        batch.add("b", _method(target, "ar"), PROMPTS[1], config)
    wider = BatchDecoder(target, max_batch=2)
    wider.add("a", _method(target, "ar"), PROMPTS[0], config)
    with pytest.raises(BatchError, match="already running"):
        wider.add("a", _method(target, "ar"), PROMPTS[1], config)
    with pytest.raises(BatchError, match="max_rows"):
        BatchDecoder(target, max_batch=4, max_rows=3)
    with pytest.raises(BatchError, match="max_batch"):
        BatchDecoder(target, max_batch=0)


def test_the_head_steps_of_several_sequences_in_one_engine_pass_are_each_ones_own(target, head):
    """``heads.draft.run_head_steps`` over several runners (catch-ups of different lengths, self-fed
    steps, a score-only step) gives each exactly what its own ``HeadRunner.step`` gives."""
    from tierspec.heads.draft import HeadRunner, HeadStep, run_head_steps

    features = []
    for prompt in PROMPTS[:3]:
        features.append(CachedModel(target.model).forward(prompt, with_hidden=True).hidden)
    with torch.inference_mode():
        solo, shared = [HeadRunner(head) for _ in range(3)], [HeadRunner(head) for _ in range(3)]

        def steps(runners, last):
            return [HeadStep(runners[0], features[0][:-1], PROMPTS[0][1:], from_target=True),
                    HeadStep(runners[1], features[1][:4], PROMPTS[1][1:5], from_target=True),
                    HeadStep(runners[2], None, last=last)]

        last = torch.randn(1, head.config.hidden_size)
        expected = [runner.step(step) for runner, step in zip(solo, steps(solo, last))]
        got = run_head_steps(steps(shared, last))
        for e, g in zip(expected, got):
            assert torch.equal(e.last, g.last) and torch.equal(e.logits, g.logits)
        # self-fed steps on the outputs just made
        expected = [solo[i].step(HeadStep(solo[i], expected[i].last, torch.tensor([i + 3]))) for i in range(2)]
        got = run_head_steps([HeadStep(shared[i], got[i].last, torch.tensor([i + 3])) for i in range(2)])
    for e, g in zip(expected, got):
        assert torch.equal(e.last, g.last) and torch.equal(e.logits, g.logits)
    assert [r.length for r in solo] == [r.length for r in shared]


def test_the_engine_heads_step_reads_embeddings_norms_and_rotary_factors_as_the_modules_do(target, head):
    """``EngineHead``'s shortcuts: a quantised table's rows read directly are the module's
    (``quant.embedded_rows``; a hooked table is called, so its hook runs), the engine's norm is the
    module's to float32 rounding, a chain's rotary factors as views of the table are the gathered
    ones bitwise, and a step given no positions is the step given its chain's positions."""
    from tierspec.heads.draft import HeadRunner
    from tierspec.quant import embedded_rows

    engine = head.engine
    tokens = torch.tensor([3, 200, 3, 77])
    expected = head.embedding(tokens).float()
    seen = []
    hook = head.embedding.register_forward_hook(lambda module, args, out: seen.append(args[0].tolist()))
    try:
        assert torch.equal(embedded_rows(head.embedding, tokens), expected)
        assert seen == [tokens.tolist()]  # the module ran, its hook with it
    finally:
        hook.remove()
    assert torch.equal(embedded_rows(head.embedding, tokens), expected)  # no hook: the rows read directly
    rows = torch.randn(5, head.config.hidden_size) * 3
    torch.testing.assert_close(engine.norm(rows), head.norm(rows), rtol=2e-6, atol=2e-6)
    for start, count in ((0, 1), (7, 5), (600, 3)):  # 600: past the first table block, which grows
        spans = head.rotary.span(start, count, torch.float32)
        gathered = head.rotary.factors(torch.arange(start, start + count), torch.float32)
        assert all(torch.equal(a, b.reshape(count, -1)) and a.is_contiguous() for a, b in zip(spans, gathered))
    inputs, next_tokens = torch.randn(4, head.config.hidden_size), torch.tensor([9, 8, 7, 6])
    with torch.inference_mode():
        chains = [HeadRunner(head) for _ in range(2)]
        for runner in chains:
            runner.extend(torch.randn(3, head.config.hidden_size, generator=torch.Generator().manual_seed(1)),
                          torch.tensor([1, 2, 3]))
        plain = chains[0].extend(inputs, next_tokens)
        placed = chains[1].extend(inputs, next_tokens, positions=torch.arange(3, 7))
    assert torch.equal(plain, placed)


@pytest.mark.parametrize("name", ["eagle", "hybrid"])
def test_features_a_pass_writes_in_place_are_those_a_copy_would_commit(target, head, name, monkeypatch):
    """A chain's pass writes its features into the generation's feature log (``FeatureLog.rows_at``,
    ``PassRequest.hidden_into``): after every commit the log's readable rows are bitwise those the
    copying commit leaves (the same pass, ``rows_at`` refused), and every cycle's drafts and
    confidences are the same — so a wrong offset, a clobbered row or a skipped copy would show."""
    from tierspec.drafters.base import FeatureLog

    def run():
        logs = []

        def inspect(verifiers, drafter):
            features = verifiers.features
            logs.append((features.start, features.length, features.read(features.start, features.length).clone()))

        config = DecodeConfig(max_new_tokens=30, sampling=SamplingConfig(temperature=0.0))
        steps = list(DecodeRun(target, _method(target, name, head), PROMPTS[0], config, seed=3, inspect=inspect))
        drafts = [(s.proposal.token_list, s.proposal.confidence) for s in steps]
        return logs, drafts, [token for s in steps for token in s.new_tokens]

    handed = []
    rows_at = FeatureLog.rows_at
    monkeypatch.setattr(FeatureLog, "rows_at", lambda self, start, count: handed.append(start) or rows_at(self, start, count))
    in_place = run()
    assert handed  # the in-place path ran
    monkeypatch.setattr(FeatureLog, "rows_at", lambda self, start, count: None)
    copied = run()
    assert in_place[1] == copied[1] and in_place[2] == copied[2] and len(in_place[0]) == len(copied[0])
    assert any(length > start for start, length, _ in in_place[0])
    for (start, length, rows), (start_copied, length_copied, rows_copied) in zip(in_place[0], copied[0]):
        assert (start, length) == (start_copied, length_copied) and torch.equal(rows, rows_copied)


@pytest.mark.parametrize("name", ["eagle", "hybrid"])
def test_a_prompts_chunks_write_their_features_in_place_as_a_copy_would(target, head, name, monkeypatch):
    """A prompt prefilled in chunks inside a batch's cycles: each logged chunk's pass writes its
    features into the generation's feature log (``Verifiers.prefill_request``'s ``hidden_into``) and
    its result copies none — the chunk that straddles the first logged position too (its earlier
    rows written, never read). After every cycle each generation's readable rows, its log's bounds
    and its drafts are bitwise those of the same batch whose chunks are copied (``rows_at`` refused)."""
    from tierspec.drafters.base import FeatureLog
    from tierspec.drafters.eagle import FIRST_CATCH_UP
    from tierspec.verifiers import Verifiers

    prompts = [PROMPTS[1], PROMPTS[5]]  # the long one's logged positions begin inside a chunk of 24 rows

    def run():
        logs, placed = [], []
        prefill_result = Verifiers.prefill_result

        def spy(self, chunk, result):
            if chunk.request.hidden_layers is not None:
                placed.append((chunk.start, chunk.request.rows, result.hidden is chunk.request.hidden_into))
            return prefill_result(self, chunk, result)

        monkeypatch.setattr(Verifiers, "prefill_result", spy)
        batch = BatchDecoder(target, max_batch=2, max_rows=24)
        method = _method(target, name, head)
        for key, prompt in enumerate(prompts):
            batch.add(key, method, prompt, DecodeConfig(max_new_tokens=12, sampling=SamplingConfig(0.0)), seed=key)
        while len(batch):
            for sequence, step in batch.step():
                log = sequence.verifiers.features
                logs.append((sequence.key, log.start, log.length, log.read(log.start, log.length).clone(),
                             step.proposal.token_list))
        return logs, placed

    in_place, placed = run()
    first_logged = len(prompts[1]) - 1 - FIRST_CATCH_UP  # ``EagleDrafter.feature_history``: the positions a head reads
    assert all(done for _, _, done in placed)
    assert any(start < first_logged < start + rows for start, rows, _ in placed)  # a straddling chunk, in place
    monkeypatch.setattr(FeatureLog, "rows_at", lambda self, start, count: None)
    copied, placed = run()
    assert placed and not any(done for _, _, done in placed)
    assert len(in_place) == len(copied) and any(length > start for _, start, length, _, _ in in_place)
    for (key, start, length, rows, drafts), (key_c, start_c, length_c, rows_c, drafts_c) in zip(in_place, copied):
        assert (key, start, length, drafts) == (key_c, start_c, length_c, drafts_c) and torch.equal(rows, rows_c)


def test_batch_lengths_take_the_drafts_that_pay():
    class P(list):  # a proposal of n drafts
        pass

    def flat(rows):  # rows cost nothing: every draft with any chance pays
        return 1.0

    def steep(rows):  # each row costs a whole token: no draft pays
        return float(rows)

    def affine(rows):  # a pass of r rows costs 1 + 0.25 (r - 1)
        return 1.0 + 0.25 * (rows - 1)

    assert batch_lengths([P([1, 2, 3]), P([1, 2])], [[0.9, 0.5, 0.1], [0.8, 0.01]], flat) == [3, 2]
    assert batch_lengths([P([1, 2, 3]), P([1])], [[0.9, 0.8, 0.7], [0.95]], steep) == [0, 0]
    # drafts worth more than 0.25 of a token... while the rate rises
    assert batch_lengths([P([1, 2, 3])], [[0.9, 0.6, 0.2]], affine) == [2]
    # the best next draft first: the second proposal's 0.8 before the first's 0.3
    assert batch_lengths([P([1, 2]), P([1])], [[0.9, 0.3], [0.8]], lambda rows: 1.0 + 0.2 * rows) == [1, 1]
    assert batch_lengths([P([1, 2])], [None], steep) == [2]  # no learned acceptance: as drafted
    # sequences that drafted nothing make every row dearer: a draft kept 0.3 of the time pays alone
    # (1.3 / 1.25 > 1 / 1), not beside 8 one-row sequences (9.3 / 3.25 < 9 / 3), counted or listed
    assert batch_lengths([P([1])], [[0.3]], affine) == [1]
    assert batch_lengths([P([1])], [[0.3]], affine, others=8) == [0]
    assert batch_lengths([P([1])] + [P([])] * 8, [[0.3]] + [None] * 8, affine) == [0] * 9


def test_a_policy_in_a_batch_costs_its_drafts_as_the_batch_passes():
    """``CostModel.verify`` in a batch of B: the share pass(B) / B of the base pass plus what the
    generation's extra rows add; a draft step keeps its own cost. So a head draft that pays alone
    (a row costs 0.8 of a one-token pass there) stops paying in a batch of 8, where the row is cheap
    but the generation's share of the pass is too; free n-gram drafts still pay, fewer of them."""
    from tierspec.costs import ForwardCosts
    from tierspec.policies import CostAware, CostModel
    from tierspec.proposal import Proposal

    # ms: one row 4, then +0.4 per row (flat passes: 8 rows cost 6.8)
    table = ForwardCosts({n: (4.0 + 0.4 * (n - 1)) / 1000 for n in range(1, 17)})
    alone = CostModel(table, {"head": 0.25})
    assert alone.in_batch(1) is alone and alone.verify(3) == table.cost(3)
    shared = alone.in_batch(8)
    assert shared.verify(1) == pytest.approx(table.cost(8) / 8)
    assert shared.verify(3) == pytest.approx(table.cost(8) / 8 + table.cost(10) - table.cost(8))
    assert shared.draft_step("head") == alone.draft_step("head") == pytest.approx(0.25 * table.cost(1))

    head = Proposal.chain(torch.tensor([5, 6]), confidence=[0.7, 0.7], source="head")
    ngram = Proposal.chain(torch.tensor([5, 6]), match_sizes=[3, 3], source="ngram")
    policy = CostAware(8, table, draft_fractions={"head": 0.25})
    assert policy.trim(head) == 2 and policy.trim(ngram) == 2
    policy.share_passes(8)
    # the head drafts nothing; free drafts shrink (a row now adds half of the generation's share)
    assert policy.trim(head) == 0 and policy.trim(ngram) == 1
    policy.share_passes(1)  # alone again: as before
    assert policy.trim(head) == 2


def test_rows_of_one_buffer_are_decided_in_place_and_others_copied_together():
    """``rows_together``: parts lying one after another in one buffer (a batched pass's logits) give
    a view of it (no copy); parts with a gap, of other storages (even adjacent in memory), another
    dtype or width, or not contiguous are copied together; every result equals ``torch.cat``."""
    import numpy as np

    from tierspec.decode import rows_together

    buffer = torch.randn(9, 5)
    parts = [buffer[0:2], buffer[2:3], buffer[3:7]]
    together = rows_together(parts)
    assert together.data_ptr() == buffer.data_ptr() and torch.equal(together, torch.cat(parts))
    assert rows_together(parts[1:]).data_ptr() == parts[1].data_ptr()
    assert rows_together([parts[0]]) is parts[0]
    memory = np.random.default_rng(0).standard_normal((8, 5)).astype(np.float32)
    apart = [torch.from_numpy(memory[0:3]), torch.from_numpy(memory[3:8])]  # adjacent, but two storages
    others = [
        [buffer[0:2], buffer[3:5]],  # a gap
        [buffer[0:2], torch.randn(2, 5)],  # another buffer
        [buffer[0:2], buffer[2:4].double()],  # another dtype
        [buffer[0:2, :4], buffer[2:4, :4]],  # rows of a wider buffer: not contiguous
        apart,
    ]
    for case in others:
        together = rows_together(case)
        assert torch.equal(together, torch.cat(case)), case
        assert together.data_ptr() not in (p.data_ptr() for p in case)


def test_a_greedy_walk_reads_the_passs_maxima_only_where_the_rule_scores_the_passs_own_rows(target, monkeypatch):
    """On the engine the LM head's product brings each row's first maximum (``Scores.first_maxima``):
    a greedy walk reads those, and no logits, where the rows are the pass's own; under a logit bias
    the rows are not, and the walk takes the modified rows' maxima — a bias of +100 on token 7 makes
    every greedy token 7, where the pass's own maxima would have given the unbiased text."""
    import sys

    from tierspec.modifiers import LogitModifiers

    decode_module = sys.modules["tierspec.decode"]
    walks, seen = decode_module.chain_batch_walks, []

    def spy(batch):
        seen.append((batch.row_maxima is not None, batch.target_logits is None))
        return walks(batch)

    monkeypatch.setattr(decode_module, "chain_batch_walks", spy)
    ar = build_method("ar", target)
    plain = DecodeRun(target, ar, PROMPTS[0], DecodeConfig(max_new_tokens=12), seed=0).finish().token_ids
    assert len(seen) >= 12 and set(seen) == {(True, True)}
    seen.clear()
    biased = DecodeConfig(max_new_tokens=12, modifiers=LogitModifiers(logit_bias=((7, 100.0),)))
    tokens = DecodeRun(target, ar, PROMPTS[0], biased, seed=0).finish().token_ids
    assert tokens == [7] * 12 != plain and set(seen) == {(False, False)}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sequences_with_their_own_penalties_share_a_pass_and_keep_their_solo_texts(flat_target, temperature):
    """The modifiers are written into each sequence's own rows of the batch's logits (``modifiers.TouchedCounts``):
    sequences with different penalties, a bias and none at all, in one batch, each give their solo text, and the
    penalties change the text (the test sees them)."""
    from tierspec.modifiers import LogitModifiers

    target = flat_target
    settings = [LogitModifiers(presence_penalty=1.5, frequency_penalty=0.8), LogitModifiers(),
                LogitModifiers(logit_bias=((7, 3.0), (2, -2.0))), LogitModifiers(frequency_penalty=-0.6)]
    for name in ("ar", "pld"):
        method = _method(target, name)
        configs = [DecodeConfig(max_new_tokens=16, sampling=SamplingConfig(temperature), modifiers=m) for m in settings]
        solo = [DecodeRun(target, method, PROMPTS[i % len(PROMPTS)], config, seed=40 + i).finish().token_ids
                for i, config in enumerate(configs)]
        batch = BatchDecoder(target, max_batch=len(configs))
        runs = [batch.add(i, method, PROMPTS[i % len(PROMPTS)], config, seed=40 + i) for i, config in enumerate(configs)]
        while len(batch):
            batch.step()
        assert [run.token_ids for run in runs] == solo, name
        plain = [DecodeRun(target, method, PROMPTS[i % len(PROMPTS)],
                           DecodeConfig(max_new_tokens=16, sampling=SamplingConfig(temperature)), seed=40 + i).finish().token_ids
                 for i in range(len(configs))]
        assert solo[1] == plain[1] and sum(a != b for a, b in zip(solo, plain)) >= 2, name  # the modifiers show


@pytest.fixture(scope="module")
def flat_target(tmp_path_factory):
    """A tiny model whose distributions are broad, so that a wrong key would change the sampled text."""
    tiny = write_tiny_gguf(tmp_path_factory.mktemp("flat-gguf"), seed=12, heads=2, kv_heads=1, sharpness=1.0)
    dtype = torch.bfloat16 if numerics_for(torch.bfloat16).layout == 0 else torch.float32
    return wrap_model(load_gguf_llama(tiny.gguf, tiny.folder, numerics_for(dtype)), name="tiny-flat-gguf")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_walks_take_the_passs_draws_and_keep_their_text(flat_target, monkeypatch, temperature):
    """On the engine a sampled chain's rows are drawn inside the LM head's product (``cached_model.RowDraws``):
    the walks read those draws (``ChainBatch.row_draws``), and every text — alone and in a batch, `ar` and the
    n-gram drafts of `pld` — is the text the rows drawn after the pass give (the draws switched off). Where
    the rows are not the pass's own (a logit bias) the pass draws nothing. Under top-k or top-p it draws the
    unfiltered rows, which the walk checks against the filters (``sampling.keyed_allowed_tokens``): the text
    is the text without the pass's draws, alone and in a batch. A top-k of the whole vocabulary cuts nothing:
    the text is plain sampling's."""
    import sys

    from tierspec.modifiers import LogitModifiers
    from tierspec.sampling import NOT_DRAWN

    decode_module, sampling_module = sys.modules["tierspec.decode"], sys.modules["tierspec.sampling"]
    walks, seen = decode_module.chain_batch_walks, []

    def spy(batch):
        seen.append(batch.row_draws is not None and any(token != NOT_DRAWN for token in batch.row_draws))
        return walks(batch)

    monkeypatch.setattr(decode_module, "chain_batch_walks", spy)
    target = flat_target
    for name in ("ar", "pld"):
        method = _method(target, name)
        seen.clear()
        drawn_solo = _solo(target, method, temperature)
        drawn_batch = [run.token_ids for run in _batched(target, method, temperature, [0, 1, 1, 3, 5, 2])[0]]
        assert seen and all(seen), name
        with monkeypatch.context() as off:
            off.setattr(decode_module, "_row_draws", lambda drafted: None)
            seen.clear()
            assert _solo(target, method, temperature) == drawn_solo == drawn_batch, name
            assert not any(seen)
    ar = build_method("ar", target)
    seen.clear()
    DecodeRun(target, ar, PROMPTS[0], DecodeConfig(max_new_tokens=8, sampling=SamplingConfig(temperature),
                                                   modifiers=LogitModifiers(logit_bias=((7, 2.0),))), seed=0).finish()
    assert seen and not any(seen)
    for sampling in (SamplingConfig(temperature, top_k=5), SamplingConfig(temperature, top_p=0.6),
                     SamplingConfig(temperature, top_k=9, top_p=0.8)):
        for name in ("ar", "pld"):
            method = _method(target, name)
            config = DecodeConfig(max_new_tokens=12, sampling=sampling)
            seen.clear()
            drawn_solo = [DecodeRun(target, method, prompt, config, seed=7 + i).finish().token_ids
                          for i, prompt in enumerate(PROMPTS[:3])]
            batch = BatchDecoder(target, max_batch=3)
            runs = [batch.add(i, method, prompt, config, seed=7 + i) for i, prompt in enumerate(PROMPTS[:3])]
            while len(batch):
                batch.step()
            checked = sampling_module.CHECKS_UNFILTERED_DRAWS  # the pass draws filtered rows where they are checked
            assert seen and (all(seen) if checked else not any(seen)), (sampling, name)
            with monkeypatch.context() as off:
                off.setattr(decode_module, "_row_draws", lambda drafted: None)
                alone = [DecodeRun(target, method, prompt, config, seed=7 + i).finish().token_ids
                         for i, prompt in enumerate(PROMPTS[:3])]
            assert drawn_solo == [run.token_ids for run in runs] == alone, (sampling, name)
    vocab = CachedModel(target.model).vocab_size
    plain = DecodeRun(target, ar, PROMPTS[0], DecodeConfig(max_new_tokens=8, sampling=SamplingConfig(temperature)),
                      seed=0).finish().token_ids
    seen.clear()
    whole = DecodeRun(target, ar, PROMPTS[0], DecodeConfig(max_new_tokens=8, sampling=SamplingConfig(temperature, top_k=vocab)),
                      seed=0).finish().token_ids
    assert seen and all(seen), "a top-k of the whole vocabulary kept the pass from drawing its rows"
    assert whole == plain


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_run_held_gives_finishs_steps_and_restores_torchs_modes_after(target, head, temperature):
    """``DecodeRun.held`` (``generate`` and the CLI iterate inside it): the same tokens and cycles as
    ``finish``, the steps inside one entry of the thread arrangement and inference mode (between
    steps too), both restored when the block ends — and when the caller's code raises inside it."""
    method = _method(target, "hybrid", head)
    config = DecodeConfig(max_new_tokens=20, sampling=SamplingConfig(temperature=temperature))
    finished = DecodeRun(target, method, PROMPTS[0], config, seed=4).finish()
    threads, inference = torch.get_num_threads(), torch.is_inference_mode_enabled()
    run = DecodeRun(target, method, PROMPTS[0], config, seed=4)
    between = []
    with run.held():
        for step in run:
            between.append((torch.get_num_threads(), torch.is_inference_mode_enabled()))
    assert run.token_ids == finished.token_ids and run.stats.cycles == finished.stats.cycles
    assert (threads, inference) != (1, True) and set(between) == {(1, True)}  # (not as they were outside)
    assert (torch.get_num_threads(), torch.is_inference_mode_enabled()) == (threads, inference)
    broken = DecodeRun(target, method, PROMPTS[0], config, seed=4)
    with pytest.raises(RuntimeError, match="stop here"):
        with broken.held():
            next(broken)
            raise RuntimeError("stop here")
    assert (torch.get_num_threads(), torch.is_inference_mode_enabled()) == (threads, inference)
