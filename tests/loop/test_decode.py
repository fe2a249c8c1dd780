"""The one decode loop: lossless methods reproduce plain greedy decoding token for token."""

from dataclasses import fields

import pytest
import torch
from conftest import as_method, run_ids

from tierspec.cached_model import CachedModel, PassResult
from tierspec.decode import CycleTimes, DecodeConfig, DecodeRun, decode
from tierspec.errors import PromptError
from tierspec.drafters import Drafter, ModelDrafter, NgramDrafter, NoDrafter
from tierspec.proposal import Proposal
from tierspec.drafters.base import FeatureLog
from tierspec.layerskip.masks import RoutingMask, decoder_layers

MAX_NEW = 40


def run(target, drafter, prompt, num_draft=5, max_new=MAX_NEW, eos=()):
    return run_ids(target, as_method(drafter, num_draft=num_draft), prompt, max_new, eos=eos)


class NeverAgreeingDrafter(Drafter):
    """Proposes, at every position, a token other than the reference greedy token there."""

    def __init__(self, reference: list[int], prompt_length: int, vocab_size: int):
        self.reference, self.prompt_length, self.vocab_size = reference, prompt_length, vocab_size
        self.calls = 0

    def propose(self, context, request):
        start = len(context) - self.prompt_length
        end = min(start + request.budget, len(self.reference))
        wrong = [(self.reference[i] + 1) % self.vocab_size for i in range(start, end)]
        return Proposal.chain(torch.tensor(wrong, dtype=torch.long))


@pytest.fixture(scope="module")
def reference(tiny_target, prompt_ids):
    return run(tiny_target, NoDrafter(), prompt_ids)


def test_reference_is_not_degenerate(reference):
    assert len(reference) == MAX_NEW and len(set(reference)) > 5


@pytest.mark.parametrize("num_draft", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("kind", ["self", "other-model", "ngram", "never"])
def test_greedy_lossless_methods_equal_ar(tiny_target, tiny_drafter, prompt_ids, reference, kind, num_draft):
    drafter = {
        "self": lambda: ModelDrafter(tiny_target.model),
        "other-model": lambda: ModelDrafter(tiny_drafter.model),
        "ngram": lambda: NgramDrafter(3),
        "never": lambda: NeverAgreeingDrafter(reference, len(prompt_ids), tiny_target.vocab_size),
    }[kind]()
    assert run(tiny_target, drafter, prompt_ids, num_draft) == reference


def test_always_agreeing_drafter_accepts_everything(tiny_target, prompt_ids):
    config = DecodeConfig(max_new_tokens=MAX_NEW)
    steps = list(decode(tiny_target, as_method(ModelDrafter(tiny_target.model), num_draft=4), prompt_ids, config))
    assert all(s.cycle.accepted == s.cycle.drafted for s in steps)
    assert steps[0].cycle.emitted == 5  # 4 drafts + bonus per target call


def test_never_agreeing_drafter_rejects_first_token(tiny_target, prompt_ids, reference):
    config = DecodeConfig(max_new_tokens=MAX_NEW)
    drafter = NeverAgreeingDrafter(reference, len(prompt_ids), tiny_target.vocab_size)
    steps = list(decode(tiny_target, as_method(drafter, num_draft=4), prompt_ids, config))
    assert all(s.cycle.accepted == 0 and s.cycle.emitted == 1 for s in steps)


@pytest.mark.parametrize("eos_index", [0, 3, 7, 12])
@pytest.mark.parametrize("kind", ["ar", "self", "ngram"])
def test_eos_mid_block_stops_generation(tiny_target, prompt_ids, reference, eos_index, kind):
    eos = reference[eos_index]
    expected = reference[: reference.index(eos) + 1]
    drafter = {"ar": NoDrafter, "self": lambda: ModelDrafter(tiny_target.model), "ngram": lambda: NgramDrafter(3)}[kind]()
    assert run(tiny_target, drafter, prompt_ids, num_draft=5, eos=(eos,)) == expected


@pytest.mark.parametrize("max_new", [1, 2, 6, 11])
def test_max_new_tokens_is_exact(tiny_target, prompt_ids, reference, max_new):
    assert run(tiny_target, ModelDrafter(tiny_target.model), prompt_ids, 5, max_new) == reference[:max_new]


@pytest.mark.parametrize("kind", ["self", "other-model", "ngram"])
def test_every_cache_holds_exactly_the_committed_tokens(tiny_target, tiny_drafter, prompt_ids, kind):
    drafter = {
        "self": lambda: ModelDrafter(tiny_target.model),
        "other-model": lambda: ModelDrafter(tiny_drafter.model),
        "ngram": lambda: NgramDrafter(3),
    }[kind]()
    seen = []

    def inspect(verifiers, drafter):
        committed = len(verifiers.context)
        # The target has processed every committed token but the last (fed with the next draft).
        assert verifiers.runner.length == committed - 1
        assert verifiers.runner.layer_lengths() == [committed - 1] * tiny_target.identity.num_layers
        if isinstance(drafter, ModelDrafter):
            assert drafter.runner.length <= committed - 1
            assert set(drafter.runner.layer_lengths()) == {drafter.runner.length}
        seen.append(committed)

    run_ids(tiny_target, as_method(drafter, num_draft=4), prompt_ids, MAX_NEW, inspect=inspect)
    assert len(seen) > 3


def test_rollback_refuses_to_grow(tiny_target):
    runner = CachedModel(tiny_target.model)
    runner.forward(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="holds only 3"):
        runner.rollback(5)


def test_a_pass_returns_one_typed_result_and_leaves_no_hooks(tiny_target):
    runner = CachedModel(tiny_target.model)
    with torch.inference_mode():
        plain = runner.forward(torch.tensor([1, 2, 3]), logits_for=1)
        assert isinstance(plain, PassResult) and plain.hidden is None and plain.logits.shape == (1, 64)
        asked = runner.forward(torch.tensor([4, 5]), with_hidden=True, hidden_layers=(1, 2))
    assert asked.logits.shape == (2, 64) and asked.hidden.shape == (2, 32 * 3) and asked.hidden.dtype == torch.float32
    modules = [tiny_target.model.get_decoder(), *decoder_layers(tiny_target.model)]
    assert not any(module._forward_hooks for module in modules)


def test_the_output_of_a_layer_the_mask_bypasses_is_its_input(tiny_target):
    """A slim pass records the draft head's feature layers: a bypassed one passes its input on."""
    mask = RoutingMask(4, "layer", frozenset({2}), frozenset({2}))
    with torch.inference_mode():
        hidden = CachedModel(tiny_target.model).forward(torch.tensor([1, 2, 3]), mask=mask, with_hidden=True,
                                                        hidden_layers=(1, 2)).hidden  # [3, 32 · 3]
    assert torch.equal(hidden[:, 64:], hidden[:, 32:64]) and not torch.equal(hidden[:, 32:64], hidden[:, :32])


def test_the_verifiers_own_the_committed_sequence(tiny_target, prompt_ids):
    commits = []

    def inspect(verifiers, drafter):
        with pytest.raises(AttributeError):
            verifiers.context = verifiers.context[:1]  # the loop commits through verifiers.commit only
        with pytest.raises(ValueError, match="no verifier pass awaits a verdict"):
            verifiers.commit([1], [0])  # committed already: nothing awaits
        commits.append(verifiers.context.clone())

    tokens = run_ids(tiny_target, as_method(NgramDrafter(3), num_draft=4), prompt_ids, 12, inspect=inspect)
    assert torch.equal(commits[-1], torch.cat([prompt_ids, torch.tensor(tokens)]))


def test_the_feature_log_reads_committed_rows_only_and_never_grows():
    log = FeatureLog(6, 2)
    log.write(0, torch.ones(4, 2))  # positions 0..3 run, not yet committed
    with pytest.raises(ValueError, match="not committed rows"):
        log.read(0, 1)
    log.commit(3)
    assert torch.equal(log.read(1, 3), torch.ones(2, 2))
    with pytest.raises(ValueError, match="not committed rows"):
        log.read(2, 4)
    with pytest.raises(ValueError, match="do not fit the log's 6"):
        log.write(5, torch.ones(2, 2))


def test_positions_committed_without_features_leave_the_log_readable_after_them_only():
    """A cycle whose drafter wanted no features commits positions without rows: nothing before
    them is readable any more (a reader must start over after them); rows written from there on are."""
    log = FeatureLog(12, 2)
    log.write(0, torch.arange(8.0).reshape(4, 2))
    log.commit(4)
    assert log.start == 0 and torch.equal(log.read(0, 4), torch.arange(8.0).reshape(4, 2))
    log.commit(6, written=False)  # positions 4 and 5: no rows
    assert (log.start, log.length) == (6, 6)
    with pytest.raises(ValueError, match=r"not committed rows of the log \(it holds positions 6 <= p < 6\)"):
        log.read(3, 6)
    log.write(6, torch.full((3, 2), 7.0))
    log.commit(9)
    assert log.start == 6 and torch.equal(log.read(6, 9), torch.full((3, 2), 7.0))
    with pytest.raises(ValueError, match="not committed rows"):
        log.read(5, 9)
    log.commit(9, written=False)  # nothing new committed: the rows stay readable
    assert log.start == 6



def test_rows_a_pass_wrote_into_the_feature_log_are_its_rows():
    """``FeatureLog.rows_at`` hands a pass the log's own rows (a view, not a copy): what the pass
    writes there is what the log reads once committed, beside rows written by a copy; the log's
    own rows written elsewhere land there; rows past the reserved positions are not handed out."""
    log = FeatureLog(8, 2)
    rows = log.rows_at(1, 2)
    rows.copy_(torch.arange(4.0).reshape(2, 2))
    log.write(3, torch.full((1, 2), 9.0))
    log.commit(4)
    assert torch.equal(log.read(1, 4), torch.tensor([[0.0, 1.0], [2.0, 3.0], [9.0, 9.0]]))
    log.write(4, log.rows_at(1, 2))  # the log's own rows written elsewhere: copied there
    log.commit(6)
    assert torch.equal(log.read(4, 6), torch.tensor([[0.0, 1.0], [2.0, 3.0]]))
    assert log.rows_at(6, 2) is not None and log.rows_at(6, 3) is None

def test_a_decode_runs_clock_leaves_out_a_cost_measurement_made_in_its_first_step(tiny_target, prompt_ids,
                                                                                   monkeypatch):
    """A first run measured the model's costs inside its clock: --stats read 2.8 tok/s for ~15."""
    import importlib
    import time

    from tierspec import costs

    decode_module = importlib.import_module("tierspec.decode")  # the package's ``decode`` is the function

    opened = decode_module.open_sequence

    def measuring_first(*args, **kwargs):  # a measurement of 2 s as the generation opens
        time.sleep(2.0)
        costs._MEASURING_SECONDS[0] += 2.0
        return opened(*args, **kwargs)

    monkeypatch.setattr(decode_module, "open_sequence", measuring_first)
    run = DecodeRun(tiny_target, as_method(NgramDrafter(3), num_draft=4), prompt_ids, DecodeConfig(max_new_tokens=5))
    began = time.perf_counter()
    run.finish()
    assert time.perf_counter() - began >= 2.0 > run.stats.wall_seconds > 0


@pytest.mark.parametrize("stepped", [0, 2])
def test_a_decode_runs_clock_is_its_own_from_its_first_step_to_its_end(tiny_target, prompt_ids, monkeypatch, stepped):
    """The run's totals are its sequence's record, but its clock is the run's: from the first step
    asked for (a slow opening of the generation, not a measurement, counts), never the sequence's
    own from its opening — read mid-run by an ``inspect`` callback as at the end, after ``finish``
    alone or after a few steps drawn one by one first."""
    import importlib
    import time

    decode_module = importlib.import_module("tierspec.decode")
    opened = decode_module.open_sequence

    def slow_open(*args, **kwargs):
        time.sleep(0.3)
        return opened(*args, **kwargs)

    monkeypatch.setattr(decode_module, "open_sequence", slow_open)
    seen = []
    run = DecodeRun(tiny_target, as_method(NgramDrafter(3), num_draft=4), prompt_ids, DecodeConfig(max_new_tokens=12),
                    inspect=lambda verifiers, drafter: seen.append(run.stats.wall_seconds))
    for _ in range(stepped):
        next(run)
        assert run.stats.wall_seconds >= 0.3
    run.finish()
    # (inside the first step nothing was handed out yet: the clock reads 0 there)
    assert len(seen) == run.stats.cycles > stepped + 1 and min(seen[1:]) >= 0.3 and run.stats.wall_seconds >= max(seen)


def test_a_decode_run_adds_up_the_generation_once(tiny_target, prompt_ids):
    config = DecodeConfig(max_new_tokens=20)
    steps = []
    run = DecodeRun(tiny_target, as_method(NgramDrafter(3), num_draft=4), prompt_ids, config)
    for step in run:
        steps.append(step)
        assert run.stats.cycles == len(steps) and run.stats.wall_seconds > 0
    assert run.token_ids == [t for step in steps for t in step.new_tokens]
    assert run.stats.emitted == len(run.token_ids) == 20
    assert run.stats.target_calls == sum(step.cycle.target_calls for step in steps)
    assert run.stats.wall_seconds >= sum(step.cycle.seconds for step in steps)
    # each cycle's pass time is part of its time, one pass or more per cycle, and the totals add up
    assert all(0 < step.cycle.pass_seconds <= step.cycle.seconds - step.cycle.draft_seconds for step in steps)
    assert run.stats.pass_seconds == pytest.approx(sum(step.cycle.pass_seconds for step in steps))
    assert run.token_ids == run_ids(tiny_target, as_method(NgramDrafter(3), num_draft=4), prompt_ids, 20)
    assert run.sequence.stats is run.stats  # one record: the cycles were counted once (cycles == steps above)


def test_cycle_times_add_every_field():
    names = [f.name for f in fields(CycleTimes)]
    total = CycleTimes(**{name: i + 1 for i, name in enumerate(names)})
    total.add(CycleTimes(**{name: 10 * (i + 1) for i, name in enumerate(names)}))
    assert {name: getattr(total, name) for name in names} == {name: 11 * (i + 1) for i, name in enumerate(names)}


def test_sampled_generation_is_reproducible_with_a_seed(tiny_target, tiny_drafter, prompt_ids):
    from tierspec.sampling import SamplingConfig

    def sampled(seed):
        generator = torch.Generator().manual_seed(seed)
        return run_ids(tiny_target, as_method(ModelDrafter(tiny_drafter.model), num_draft=3), prompt_ids, 30,
                       SamplingConfig(1.0, top_k=20, top_p=0.9), generator=generator)

    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)


class TestBadInput:
    def test_empty_prompt(self, tiny_target):
        with pytest.raises(PromptError, match="the prompt is empty"):
            run(tiny_target, NoDrafter(), torch.tensor([], dtype=torch.long))

    def test_batch_larger_than_one(self, tiny_target):
        with pytest.raises(PromptError, match="batch size 2 is not supported"):
            run(tiny_target, NoDrafter(), torch.tensor([[1, 2], [3, 4]]))

    def test_prompt_longer_than_context(self, tiny_target):
        with pytest.raises(PromptError, match="exceeds the model's context of 512 positions"):
            run(tiny_target, NoDrafter(), torch.ones(500, dtype=torch.long), max_new=20)

    def test_mismatched_drafter_vocabulary(self, tiny_target):
        from conftest import tiny_llama

        from tierspec.methods import build_method

        other = tiny_llama(seed=3, vocab_size=80)
        with pytest.raises(ValueError, match="drafter vocabulary size 80 differs from the target's 64"):
            build_method("sd", tiny_target, other)

    def test_mismatched_tokenizers(self):
        from tierspec.drafters.model import check_vocabularies

        class Tok:
            def __init__(self, vocab):
                self.vocab = vocab

            def get_vocab(self):
                return self.vocab

        class M:
            def __init__(self, name, vocab):
                from tierspec.identity import ModelIdentity

                self.tokenizer = Tok(vocab)
                self.identity = ModelIdentity(name, 1, 1, len(vocab), "")
                self.vocab_size = len(vocab)

        with pytest.raises(ValueError, match="drafter 'd' has a different tokenizer from target 't'"):
            check_vocabularies(M("t", {"a": 0, "b": 1}), M("d", {"a": 1, "b": 0}))

    def test_unknown_method(self, tiny_target):
        from tierspec.methods import build_method

        with pytest.raises(ValueError, match="unknown method 'fast'; choose one of: ar, forced, sd, pld"):
            build_method("fast", tiny_target)

    def test_cli_unknown_method_is_a_clear_error(self, capsys):
        from tierspec.cli import main

        assert main(["generate", "hi", "--method", "warp"]) == 2
        assert "unknown method 'warp'" in capsys.readouterr().err


@pytest.mark.parametrize("padded", [False, True])
def test_a_chain_runs_as_the_plain_causal_pass_it_always_was(tiny_target, prompt_ids, padded):
    """The one verifier pass runs a chain of drafts exactly as a causal pass over the pending token
    and the drafts (no tree positions or masks), padded as the cost table says: bitwise the
    logits of that pass, row by node."""
    from tierspec.costs import ForwardCosts
    from tierspec.decode import Verifiers
    from tierspec.proposal import Proposal

    table = ForwardCosts({1: 1.0, 2: 3.0, 3: 3.0, 4: 3.0, 5: 3.0, 6: 2.0}) if padded else None  # 2-5 rows → 6
    drafts = torch.tensor([7, 11, 13])
    with torch.inference_mode():
        verifiers = Verifiers(tiny_target, 64, pass_costs=table)
        verifiers.prefill(prompt_ids)
        scores = verifiers.target(Proposal.chain(drafts))
        runner = CachedModel(tiny_target.model)
        runner.forward(prompt_ids[:-1], logits_for=1)
        rows = torch.cat([prompt_ids[-1:], drafts] + ([drafts[-1:].expand(2)] if padded else []))
        reference = runner.forward(rows, logits_for=len(rows)).logits[:4]
    assert torch.equal(scores.logits, reference) and scores.hidden is None
    assert verifiers.runner.length == runner.length == len(prompt_ids) - 1 + len(rows)
