"""The forward-cost cache (issue 23, finding 12): measured once per model and process, a cached
table checked again before it is replaced, and no table kept that the machine's load disturbed.
Measurements and spot checks are planted: the logic is tested, not this machine's timing."""

import threading

import pytest

from tierspec import costs


@pytest.fixture
def planted(monkeypatch, tmp_path):
    """An empty cache and process memo; ``measure`` returns a table whose 1-token pass takes
    ``state["table"]`` s, ``spot_check`` returns ``state["checks"]`` one by one (then the last)."""
    monkeypatch.setenv("TIERSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(costs, "_MEASURED", {}, raising=False)
    state = {"table": 0.01, "checks": [0.01], "measured": 0, "spot_checks": 0}

    def measure(model, max_tokens, **kwargs):
        state["measured"] += 1
        return costs.ForwardCosts({n: state["table"] * n for n in range(1, max_tokens + 1)})

    def spot_check(model, **kwargs):
        state["spot_checks"] += 1
        return state["checks"].pop(0) if len(state["checks"]) > 1 else state["checks"][0]

    monkeypatch.setattr(costs, "measure_forward_costs", measure)
    monkeypatch.setattr(costs, "spot_check", spot_check)
    state["new_process"] = lambda: monkeypatch.setattr(costs, "_MEASURED", {}, raising=False)
    state["files"] = lambda: sorted(tmp_path.glob("forward-costs-*.json"))
    return state


def test_two_threads_measure_once_and_a_process_measures_once(planted, tiny_target, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    measure = costs.measure_forward_costs

    def first_blocks(model, max_tokens, **kwargs):
        if planted["measured"] == 0:
            entered.set()
            release.wait()
        return measure(model, max_tokens, **kwargs)

    monkeypatch.setattr(costs, "measure_forward_costs", first_blocks)
    tables = []
    first = threading.Thread(target=lambda: tables.append(costs.forward_costs(tiny_target, max_tokens=4)))
    second = threading.Thread(target=lambda: tables.append(costs.forward_costs(tiny_target, max_tokens=4)))
    first.start()
    entered.wait()
    second.start()
    second.join(timeout=1.0)  # no timing asserted: only a chance for a second measurement to start
    release.set()
    first.join()
    second.join()
    assert planted["measured"] == 1 and len(tables) == 2 and tables[0] is tables[1]
    checks = planted["spot_checks"]
    assert costs.forward_costs(tiny_target, max_tokens=4) is tables[0]  # later calls: no spot check either
    assert planted["spot_checks"] == checks and planted["measured"] == 1


def test_one_slow_spot_check_does_not_replace_a_good_table(planted, tiny_target):
    costs.forward_costs(tiny_target, max_tokens=4)
    planted["new_process"]()
    planted["checks"] = [0.05, 0.01]  # a blip, then the table's speed again
    assert costs.forward_costs(tiny_target, max_tokens=4).seconds[1] == 0.01
    assert planted["measured"] == 1


def test_a_busy_machine_keeps_the_cached_table(planted, tiny_target, capsys):
    """Every spot check 5x slower: a table measured now would record the load; the cached one is used."""
    costs.forward_costs(tiny_target, max_tokens=4)
    planted["new_process"]()
    planted["checks"] = [0.05]
    planted["table"] = 0.05  # what a measurement now would record
    assert costs.forward_costs(tiny_target, max_tokens=4).seconds[1] == 0.01
    assert planted["measured"] == 1 and planted["spot_checks"] == 1 + costs.SPOT_CHECKS
    assert "the machine is busy; using the cached file" in capsys.readouterr().err


def test_a_table_measured_on_a_busy_machine_is_replaced_once_the_machine_is_quiet(planted, tiny_target):
    planted["table"] = planted["checks"][0] = 0.05
    costs.forward_costs(tiny_target, max_tokens=4)  # measured and checked on a uniformly busy machine
    planted["new_process"]()
    planted["table"], planted["checks"] = 0.01, [0.01]
    assert costs.forward_costs(tiny_target, max_tokens=4).seconds[1] == 0.01 and planted["measured"] == 2
    planted["new_process"]()
    assert costs.forward_costs(tiny_target, max_tokens=4).seconds[1] == 0.01 and planted["measured"] == 2


@pytest.mark.parametrize("table_over_now, measured_again", [(1.2, False), (1.5, True), (0.6, False)])
def test_a_table_made_on_a_busier_machine_is_measured_again(planted, tiny_target, table_over_now, measured_again):
    """A cached 1-token pass more than ``FASTER_NOW`` (1.3) times slower than the spot checks now
    was made under load (whose ratios the policies would choose by): measured again. Within it,
    or slower now (up to ``SLOWER_NOW``), the cached table is kept."""
    planted["table"] = planted["checks"][0] = 0.01 * table_over_now
    costs.forward_costs(tiny_target, max_tokens=4)
    planted["new_process"]()
    planted["table"], planted["checks"] = 0.01, [0.01]
    expected = 0.01 if measured_again else 0.01 * table_over_now
    assert costs.forward_costs(tiny_target, max_tokens=4).seconds[1] == pytest.approx(expected)
    assert planted["measured"] == 1 + measured_again


def test_a_table_the_load_disturbed_is_used_but_not_cached(planted, tiny_target, capsys):
    """Measured at 50 ms a pass while a spot check right after takes 10 ms: the process uses it,
    no file keeps it (the next process measures again instead of trusting it)."""
    planted["table"], planted["checks"] = 0.05, [0.01]
    assert costs.forward_costs(tiny_target, max_tokens=4).seconds[1] == 0.05
    assert planted["files"]() == []
    assert "no file keeps it" in capsys.readouterr().err
    planted["new_process"]()
    planted["table"] = 0.01
    assert costs.forward_costs(tiny_target, max_tokens=4).seconds[1] == 0.01
    assert len(planted["files"]()) == 1 and planted["measured"] == 2


def test_the_table_is_measured_at_two_contexts_and_kept_with_its_slopes(tiny_target, tmp_path):
    """Every size is timed after ``TABLE_CONTEXT`` and after ``LONG_CONTEXT`` cached positions
    (less the widest pass where the model holds fewer): the table keeps the first and each size's
    cost per further position, and reads back from its file as measured; a file whose slopes are
    damaged is not read (it is measured again)."""
    import json
    import math

    table = costs.measure_forward_costs(tiny_target.model, max_tokens=3, repeats=1)
    assert table.context == costs.TABLE_CONTEXT and sorted(table.per_position) == [1, 2, 3]
    assert all(math.isfinite(v) and v >= 0 for v in table.per_position.values())
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"seconds": table.seconds, "context": table.context, "per_position": table.per_position}))
    assert costs._read_table(path, 3) == table
    path.write_text(json.dumps({"seconds": table.seconds, "context": 256, "per_position": {"1": 0.0, "2": -1.0, "3": 0.0}}))
    assert costs._read_table(path, 3) is None
    path.write_text(json.dumps({"seconds": table.seconds}))  # a table from before the slopes: costs every context alike
    assert costs._read_table(path, 3).per_position is None


def test_a_model_too_short_for_the_long_context_keeps_no_slopes(tiny_target, monkeypatch):
    monkeypatch.setattr(tiny_target.model.config, "max_position_embeddings", costs.TABLE_CONTEXT + 8)
    table = costs.measure_forward_costs(tiny_target.model, max_tokens=3, repeats=1)
    assert table.per_position is None and sorted(table.seconds) == [1, 2, 3]


def test_a_spot_check_times_a_short_context_only(tiny_target, monkeypatch):
    """``spot_check`` (run for every cached measurement before a generation uses it) prefills its
    ``context`` and times one-token passes: no pass over the table's long context, whose prefill of
    ``LONG_CONTEXT`` tokens made the checks most of a cached `tierspec generate`'s start-up."""
    from tierspec.cached_model import CachedModel

    widths, forward = [], CachedModel.forward

    def counted(self, token_ids, *args, **kwargs):
        widths.append(int(token_ids.shape[0]))
        return forward(self, token_ids, *args, **kwargs)

    monkeypatch.setattr(CachedModel, "forward", counted)
    seconds = costs.spot_check(tiny_target.model, repeats=2, context=16)
    assert seconds > 0 and widths == [16] + [1] * 3


def test_paired_costs_read_each_size_against_its_rounds_first_pass():
    """Planted rounds: a machine whose speed drifts from round to round (every pass of a round scaled
    alike), ratios that differ from round to round (so that their median is neither their least nor their
    mean), and one round whose 1-token pass alone ran fast. The table is the fastest 1-token pass times
    each size's median ratio; each size's fastest pass on its own reads a 2-token pass 1.725× one."""
    drift = [1.0, 1.2, 0.9, 1.1, 1.3]
    ratios = {2: [1.10, 1.30, 1.15, 1.12, 1.40], 3: [1.30, 1.20, 1.25, 1.60, 1.40]}  # medians 1.15 and 1.30
    samples = {1: [0.01 * d for d in drift]}
    samples.update({n: [0.01 * d * r for d, r in zip(drift, row)] for n, row in ratios.items()})
    samples[1][4] = 0.01 * 0.6  # a blip: the last round's 1-token pass alone was fast (its ratios read high)
    seconds = costs.paired_costs(samples)
    assert seconds[1] == pytest.approx(0.006)  # the 1-token pass: its fastest
    # the blip's round reads 1.40 * 1.3 / 0.6 = 3.03 for both sizes, above their medians: these stay
    # 1.15 and 1.30, neither the least ratio (1.10, 1.20) nor the mean (1.74, 1.68)
    assert seconds[2] / seconds[1] == pytest.approx(1.15, rel=1e-12)
    assert seconds[3] / seconds[1] == pytest.approx(1.30, rel=1e-12)
    naive = {n: min(v) for n, v in samples.items()}
    assert naive[2] / naive[1] == pytest.approx(0.01035 / 0.006)  # what each size's fastest pass read: 1.725


def test_paired_costs_refuse_unpaired_rounds_and_take_one_size_alone():
    assert costs.paired_costs({1: [0.02, 0.01, 0.03]}) == {1: 0.01}
    with pytest.raises(ValueError, match="each round pairs one pass of every size"):
        costs.paired_costs({1: [0.01, 0.01], 2: [0.02]})


def test_timed_rounds_time_each_pass_after_a_warm_round(monkeypatch):
    """``_timed_rounds`` on a planted clock: a runner whose passes take what the planted list says; the first
    round only warms (its passes are a tenth as long and never read), each pass is rolled back to the context."""
    from types import SimpleNamespace

    clock = [0.0]
    monkeypatch.setattr(costs.time, "perf_counter", lambda: clock[0])
    planted = iter([0.001, 0.0012, 0.0014, 0.01, 0.012, 0.014, 0.02, 0.024, 0.028])  # warm round, then rounds

    def forward(tokens, logits_for):
        assert logits_for == len(tokens)
        clock[0] += next(planted)

    rolled = []
    runner = SimpleNamespace(vocab_size=50, forward=forward, rollback=rolled.append)
    samples = costs._timed_rounds(runner, [1, 2, 3], context=7, repeats=2)
    assert samples == {1: pytest.approx([0.01, 0.02]), 2: pytest.approx([0.012, 0.024]), 3: pytest.approx([0.014, 0.028])}
    assert rolled == [7] * 9


def test_a_table_is_paired_at_both_contexts_from_as_many_rounds(tiny_target, monkeypatch):
    """``measure_forward_costs`` reads the rounds of both contexts through ``paired_costs``, as many at each
    (a size's cost per further position is the difference of the two, whose 1-token passes are each the
    fastest of its rounds), and each size's slope is that difference over the positions between them:
    planted rounds."""
    import inspect

    planted = [{1: [0.010, 0.012, 0.011], 2: [0.013, 0.0144, 0.0132]},  # the table's context, then the longer one
               {1: [0.020, 0.016, 0.018], 2: [0.030, 0.0224, 0.0234]}]
    asked = []

    def rounds(runner, sizes, context, repeats):
        asked.append((context, repeats))
        return {n: list(planted[len(asked) - 1][n]) for n in sizes}

    monkeypatch.setattr(costs, "_timed_rounds", rounds)
    table = costs.measure_forward_costs(tiny_target.model, max_tokens=2, repeats=3)
    long_context = min(costs.LONG_CONTEXT, tiny_target.model.config.max_position_embeddings - 2)
    assert asked == [(costs.TABLE_CONTEXT, 3), (long_context, 3)]
    assert table.seconds[1] == pytest.approx(0.010)
    assert table.seconds[2] == pytest.approx(0.010 * 1.2)  # ratios 1.3, 1.2, 1.2: median 1.2
    span = long_context - costs.TABLE_CONTEXT
    assert table.per_position[1] == pytest.approx((0.016 - 0.010) / span)
    assert table.per_position[2] == pytest.approx((0.016 * 1.4 - 0.012) / span)  # ratios 1.5, 1.4, 1.3
    parameters = inspect.signature(costs.measure_forward_costs).parameters
    assert parameters["repeats"].default == costs.TABLE_ROUNDS
