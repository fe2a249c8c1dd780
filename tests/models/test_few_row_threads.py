"""Products over a few rows on one thread or on every thread (``costs.few_row_threads``): the
setting never changes a product's bits, a bad setting is refused and changes nothing, and the
choice is the faster setting of planted pass timings, made once per model and machine, cached,
and named in the other cost tables' keys (a table measured under one setting is not read under
the other)."""

from __future__ import annotations

import pytest
import torch

from gguf_models import write_tiny_gguf
from test_engine_kernels import qe
from tierspec import costs
from tierspec.gguf_llama import load_gguf_llama
from tierspec.models import LoadedModel, identity_of
from tierspec.quant import Q8_0, QuantWeight, numerics_for


@pytest.fixture
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture
def fresh_process(monkeypatch, tmp_path):
    """An empty cache folder and nothing measured or settled in this process."""
    monkeypatch.setenv("TIERSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(costs, "_MEASURED", {})
    monkeypatch.setattr(costs, "_SETTLED", costs.weakref.WeakKeyDictionary())

    def again():
        monkeypatch.setattr(costs, "_MEASURED", {})
        monkeypatch.setattr(costs, "_SETTLED", costs.weakref.WeakKeyDictionary())
    return again


def _weight(seed: int = 0, rows: int = 512, inputs: int = 256) -> QuantWeight:
    generator = torch.Generator().manual_seed(seed)
    return QuantWeight.quantize(torch.randn(rows, inputs, generator=generator), numerics_for(torch.int8), Q8_0)


def test_the_default_is_the_isas_and_none_restores_it():
    weight = _weight()
    avx512 = qe.isa() in ("avx512", "avx512vnni", "avx512bf16", "amx")
    assert weight.one_thread_rows is None
    assert qe.one_thread_rows(weight=weight.handle) == (2 if avx512 else 0)
    weight.one_thread_rows = 0
    assert qe.one_thread_rows(weight=weight.handle) == 0 and weight.one_thread_rows == 0
    weight.one_thread_rows = None
    assert qe.one_thread_rows(weight=weight.handle) == (2 if avx512 else 0)


@pytest.mark.parametrize("bad", [-1, 65])
def test_a_setting_outside_the_range_is_refused_and_changes_nothing(bad):
    weight = _weight()
    weight.one_thread_rows = 1
    with pytest.raises(ValueError, match="one-thread rows are 0 .. 64"):
        weight.one_thread_rows = bad
    assert weight.one_thread_rows == 1 and qe.one_thread_rows(weight=weight.handle) == 1
    with pytest.raises(TypeError):
        weight.one_thread_rows = "two"
    assert qe.one_thread_rows(weight=weight.handle) == 1


def test_the_threads_never_change_a_product(two_threads):
    """One thread or two, the same bits: each output is computed whole by one thread."""
    weight = _weight(seed=3)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    for rows in (1, 2, 3):
        results = []
        for setting in (None, 0, 1, 2, 3):
            weight.one_thread_rows = setting
            results.append(weight.multiply(x[:rows].contiguous()))
        assert all(torch.equal(r, results[0]) for r in results[1:]), rows


@pytest.mark.parametrize("seconds, chosen", [
    ({1: (5.0, 4.0), 2: (6.0, 5.0)}, 2),   # one thread faster at both
    ({1: (5.0, 4.0), 2: (6.0, 7.0)}, 1),   # at one row only
    ({1: (5.0, 6.0), 2: (6.0, 5.0)}, 0),   # one row decides first: a one-thread 2-row pass alone is never chosen
    ({1: (5.0, 5.0), 2: (6.0, 5.0)}, 0),   # a tie keeps every thread
])
def test_one_thread_rows_from_planted_timings(seconds, chosen):
    assert costs.one_thread_rows_from(seconds) == chosen


def _tiny_engine_target(tmp_path, seed: int = 2):
    """A tiny Llama on the engine (int8 rows), loaded from its file: every load new weights."""
    tiny = write_tiny_gguf(tmp_path / f"toy{seed}", seed=seed, layers=2, hidden=64, heads=4, kv_heads=2)
    model = load_gguf_llama(tiny.gguf, tiny.folder, numerics_for(torch.int8))
    return LoadedModel(model, None, identity_of(model, "toy", f"{seed:064x}"))


def test_the_measurement_chooses_the_faster_planted_setting(tmp_path, monkeypatch, two_threads):
    """Passes timed on a planted clock: with one-thread products a 1-row pass is faster, a 2-row
    pass slower; the measurement chooses one-thread products over 1 row and leaves the weights at
    the default (the spot checks of a cached choice run under it too)."""
    target = _tiny_engine_target(tmp_path)
    weights = costs._engine_weights(target.model)
    clock = [0.0]

    class PlantedRunner:
        vocab_size = 64

        def forward(self, tokens, logits_for=None):
            one = weights[0].one_thread_rows == costs.FEW_ROWS
            rows = int(tokens.numel())
            clock[0] += {1: (5e-3, 4e-3), 2: (6e-3, 7e-3)}.get(rows, (1e-2, 1e-2))[one]

        def rollback(self, length):
            pass

    monkeypatch.setattr(costs, "measuring_runner", lambda model: PlantedRunner())
    monkeypatch.setattr(costs.time, "perf_counter", lambda: clock[0])
    measured = costs.measure_few_row_threads(target.model)
    assert measured.one_thread_rows == 1
    assert {rows: pytest.approx(pair, rel=1e-9) for rows, pair in measured.seconds.items()} == {
        1: (5e-3, 4e-3), 2: (6e-3, 7e-3)}
    assert {w.one_thread_rows for w in weights} == {None}
    assert len(weights) >= 2 * 4 + 1  # every projection of both layers and the LM head


def test_settled_once_per_model_cached_and_named_in_the_tables_keys(tmp_path, monkeypatch, fresh_process, two_threads,
                                                                   capsys):
    monkeypatch.setattr(costs, "FEW_ROW_MIN_BYTES", 0)
    monkeypatch.setattr(costs, "_agrees", lambda table, now: True)  # the spot checks' timing is not under test
    target = _tiny_engine_target(tmp_path)
    measured = costs.few_row_threads(target)
    assert measured is not None and "measuring it once" in capsys.readouterr().err
    weights = costs._engine_weights(target.model)
    assert {w.one_thread_rows for w in weights} == {measured.one_thread_rows}
    assert costs._linear_kind(target.model).endswith(f":one-thread-rows{measured.one_thread_rows}")
    assert costs.few_row_threads(target) is measured  # settled: not measured again in this process
    files = sorted((tmp_path / "cache").glob("few-row-threads-*.json"))
    assert len(files) == 1
    fresh_process()  # another process, another load of the same file: the cached choice
    again = _tiny_engine_target(tmp_path)
    monkeypatch.setattr(costs, "measure_few_row_threads", lambda model: pytest.fail("measured again"))
    read = costs.few_row_threads(again)
    assert read == measured and "measuring" not in capsys.readouterr().err
    assert {w.one_thread_rows for w in costs._engine_weights(again.model)} == {measured.one_thread_rows}
    # a damaged file is measured again
    files[0].write_text("{not json")
    fresh_process()
    monkeypatch.setattr(costs, "measure_few_row_threads", lambda model: costs.FewRowThreads(0, {1: (1.0, 2.0),
                                                                                                 2: (1.0, 2.0)}))
    third = _tiny_engine_target(tmp_path)
    assert costs.few_row_threads(third).one_thread_rows == 0
    assert "damaged" in capsys.readouterr().err


def test_a_model_below_the_size_or_on_one_thread_is_left_alone(tmp_path, fresh_process, monkeypatch):
    target = _tiny_engine_target(tmp_path)  # kilobytes of weights: nothing to choose
    assert costs.few_row_threads(target) is None
    assert {w.one_thread_rows for w in costs._engine_weights(target.model)} == {None}
    fresh_process()
    monkeypatch.setattr(costs, "FEW_ROW_MIN_BYTES", 0)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # one engine thread: nothing to choose either
    try:
        assert costs.few_row_threads(_tiny_engine_target(tmp_path, seed=4)) is None
    finally:
        torch.set_num_threads(previous)
    assert not list((tmp_path / "cache").glob("few-row-threads-*.json"))


def test_two_threads_settle_a_model_once(tmp_path, monkeypatch, fresh_process, two_threads):
    """The server's threads may open generations at once: one measures, the other waits for it (a
    thread resetting the weights to the default mid-measurement would time the wrong setting)."""
    import threading

    monkeypatch.setattr(costs, "FEW_ROW_MIN_BYTES", 0)
    monkeypatch.setattr(costs, "_agrees", lambda table, now: True)
    target = _tiny_engine_target(tmp_path)
    entered, release, calls = threading.Event(), threading.Event(), []

    def measure(model):  # as the real one, it sets each setting in turn on the weights
        calls.append(model)
        for weight in costs._engine_weights(model):
            weight.one_thread_rows = costs.FEW_ROWS
        entered.set()
        release.wait()
        return costs.FewRowThreads(1, {1: (2.0, 1.0), 2: (1.0, 2.0)})

    monkeypatch.setattr(costs, "measure_few_row_threads", measure)
    results = []
    first = threading.Thread(target=lambda: results.append(costs.few_row_threads(target)), daemon=True)
    second = threading.Thread(target=lambda: results.append(costs.few_row_threads(target)), daemon=True)
    first.start()
    entered.wait()
    second.start()
    second.join(timeout=0.5)  # no timing asserted: a chance for the second to interfere
    during = {w.one_thread_rows for w in costs._engine_weights(target.model)}
    release.set()
    first.join()
    second.join()
    assert during == {costs.FEW_ROWS}  # the second did not reset the weights under the first's measurement
    assert len(calls) == 1 and len(results) == 2 and results[0] is results[1]
    assert {w.one_thread_rows for w in costs._engine_weights(target.model)} == {1}


def test_a_drafter_models_threads_are_settled_when_a_method_drafts_with_it(tmp_path, monkeypatch, fresh_process,
                                                                           two_threads):
    """The loop settles the target's; a drafter model's passes (mostly one row) are settled when a
    method is built to draft with it."""
    from tierspec.methods import build_method

    monkeypatch.setattr(costs, "FEW_ROW_MIN_BYTES", 0)
    monkeypatch.setattr(costs, "_agrees", lambda table, now: True)
    monkeypatch.setattr(costs, "measure_few_row_threads",
                        lambda model: costs.FewRowThreads(1, {1: (2.0, 1.0), 2: (1.0, 2.0)}))
    target, drafter = _tiny_engine_target(tmp_path), _tiny_engine_target(tmp_path, seed=3)
    build_method("sd", target, drafter)
    assert {w.one_thread_rows for w in costs._engine_weights(drafter.model)} == {1}
    assert {w.one_thread_rows for w in costs._engine_weights(target.model)} == {None}  # the loop's, at its first generation


def test_an_engine_draft_head_runs_on_the_targets_threads(tmp_path, monkeypatch, fresh_process, two_threads):
    """The head's steps follow the target's passes (which evict its weights): its products take
    the target's measured threads when a method takes the head, and its step's measurement is
    keyed by them."""
    from tierspec.heads.draft import DraftHead
    from tierspec.methods import MethodOptions, draft_head_for

    monkeypatch.setattr(costs, "FEW_ROW_MIN_BYTES", 0)
    monkeypatch.setattr(costs, "_agrees", lambda table, now: True)
    monkeypatch.setattr(costs, "measure_few_row_threads",
                        lambda model: costs.FewRowThreads(1, {1: (2.0, 1.0), 2: (1.0, 2.0)}))
    tiny = write_tiny_gguf(tmp_path / "headed", seed=11, heads=2, kv_heads=1)  # widths the engine head takes
    model = load_gguf_llama(tiny.gguf, tiny.folder, numerics_for(torch.int8))
    target = LoadedModel(model, None, identity_of(model, "toy", "11" * 32))
    head = DraftHead.for_target(target, torch.arange(0, 256, 2), seed=5).eval()
    assert head.engine is not None and {w.one_thread_rows for w in head.engine.weights} == {None}
    assert draft_head_for(target, MethodOptions(draft_head=head)) is head
    assert {w.one_thread_rows for w in head.engine.weights} == {1}
    assert len(head.engine.weights) >= 6  # W_fc, the layer's four products, the draft vocabulary's rows
