"""DIMR: the routing cost on hand-built distributions, and the search on planted layers."""

import json
import math

import pytest
import torch
from conftest import tiny_llama

from tierspec.layerskip.masks import RoutingMask
from tierspec.layerskip.search import Calibration, SearchConfig, routing_cost, search_mask, with_target_scores


def direct_cost(slim, target, alpha, beta):
    total = 0.0
    for qs, q in zip(slim.tolist(), target.tolist()):
        total += qs * max(0.0, math.log(1 - alpha) + math.log(qs) - math.log(q))
        total += q * max(0.0, math.log(q) - math.log(qs) - math.log(beta))
    return total


def test_cost_is_zero_when_slim_equals_target():
    q = torch.tensor([[0.5, 0.3, 0.2]]).log()
    assert routing_cost(q, q.clone(), 0.0, 1.0).item() == 0.0


@pytest.mark.parametrize("alpha, beta", [(0.0, 1.0), (0.3, 0.7), (0.1, 0.5)])
def test_cost_matches_a_direct_computation(alpha, beta):
    slim = torch.tensor([0.6, 0.1, 0.3], dtype=torch.float64)
    target = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    got = routing_cost(slim.log()[None], target.log()[None], alpha, beta).item()
    assert got == pytest.approx(direct_cost(slim, target, alpha, beta), abs=1e-12)
    assert got > 0


def test_alpha_forgives_over_weighting_and_beta_below_one_widens_the_residual_term():
    slim = torch.tensor([0.55, 0.45]).log()[None]
    target = torch.tensor([0.5, 0.5]).log()[None]
    exact = routing_cost(slim, target, 0.0, 1.0).item()
    # log(1-0.2) + log(0.55/0.5) < 0: the over-weighted token no longer counts
    assert routing_cost(slim, target, 0.2, 1.0).item() == pytest.approx(0.5 * math.log(0.5 / 0.45))
    assert routing_cost(slim, target, 0.2, 1.0).item() < exact
    assert routing_cost(slim, target, 0.0, 0.8).item() > exact


@pytest.fixture(scope="module")
def planted():
    """12 layers; layers 3, 6 and 9 are planted near-identity (tiny output projections)."""
    model = tiny_llama(seed=5, layers=12, sharpness=5.0)
    with torch.no_grad():
        for index in (3, 6, 9):
            layer = model.model.model.layers[index]
            layer.self_attn.o_proj.weight.mul_(1e-4)
            layer.mlp.down_proj.weight.mul_(1e-4)
    generator = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, 64, (4, 24), generator=generator)
    calibration = with_target_scores(model.model, Calibration(sequences, window=12))
    return model, calibration


def test_dimr_finds_the_planted_layers_and_beats_random_search(planted):
    model, calibration = planted
    base = dict(ratio=0.25, unit="layer", budget=30, patience=30, bo_every=2, initial_random=6, seed=1)
    dimr = search_mask(model, calibration, SearchConfig(**base), progress=False)
    random = search_mask(model, calibration, SearchConfig(**base, strategy="random"), progress=False)
    random_costs = [e.cost for e in random.evaluations]
    assert sorted(dimr.mask.skip_attention) == [3, 6, 9]
    assert dimr.best.cost < sum(random_costs) / len(random_costs)
    assert dimr.best.cost <= min(random_costs)
    assert dimr.best.cost < 1e-3 * (sum(random_costs) / len(random_costs))
    assert dimr.summary()["bo_evaluations"] > 0


def test_search_resumes_from_its_checkpoint(planted, tmp_path):
    model, calibration = planted
    checkpoint = tmp_path / "search.partial.json"
    config = SearchConfig(ratio=0.25, unit="layer", budget=12, patience=100, bo_every=2, initial_random=4, seed=3)
    calls = []

    def counting(mask):
        from tierspec.layerskip.search import evaluate_mask

        calls.append(mask)
        return evaluate_mask(model.model, calibration, mask)

    full = search_mask(model, calibration, config, progress=False)
    first = search_mask(model, calibration, SearchConfig(**{**config.__dict__, "budget": 7}), checkpoint=None, progress=False)
    assert [e.keep for e in first.evaluations] == [e.keep for e in full.evaluations[:7]]
    # interrupted after 7 evaluations: write those to the checkpoint by running with budget 12 and killing early
    interrupted = SearchConfig(**config.__dict__)
    evaluated = iter(range(100))

    def crash_after_seven(mask):
        if next(evaluated) == 7:
            raise KeyboardInterrupt
        return counting(mask)

    with pytest.raises(KeyboardInterrupt):
        search_mask(model, calibration, interrupted, checkpoint=checkpoint, progress=False, evaluate=crash_after_seven)
    calls.clear()
    resumed = search_mask(model, calibration, interrupted, checkpoint=checkpoint, progress=False, evaluate=counting)
    assert len(calls) == 5  # only the missing evaluations ran
    assert [e.keep for e in resumed.evaluations] == [e.keep for e in full.evaluations]


def test_a_resumed_search_stops_where_an_uninterrupted_one_does_and_a_larger_budget_extends_it(planted, tmp_path,
                                                                                                   capsys):
    """Its count of evaluations without improvement was restarted at 0 (a resumed search stopped
    later than an uninterrupted one); budget and patience only say when it stops, so a larger
    budget resumes the evaluations made instead of discarding them without a word."""
    model, calibration = planted
    checkpoint = tmp_path / "search.partial.json"
    config = SearchConfig(ratio=0.25, unit="layer", budget=40, patience=4, bo_every=2, initial_random=4, seed=3)
    full = search_mask(model, calibration, config, progress=False)
    assert len(full.evaluations) < 40  # stopped by its patience
    stop_at = len(full.evaluations) - 2
    evaluated = iter(range(100))

    def crash(mask):
        from tierspec.layerskip.search import evaluate_mask

        if next(evaluated) == stop_at:
            raise KeyboardInterrupt
        return evaluate_mask(model.model, calibration, mask)

    with pytest.raises(KeyboardInterrupt):
        search_mask(model, calibration, config, checkpoint=checkpoint, progress=False, evaluate=crash)
    resumed = search_mask(model, calibration, config, checkpoint=checkpoint, progress=False)
    assert [e.keep for e in resumed.evaluations] == [e.keep for e in full.evaluations]
    checkpoint = tmp_path / "extended.partial.json"
    short = SearchConfig(**{**config.__dict__, "budget": 3, "patience": 100})
    search_mask(model, calibration, short, checkpoint=checkpoint, progress=False)
    calls = []
    longer = SearchConfig(**{**config.__dict__, "budget": 6, "patience": 100})
    extended = search_mask(model, calibration, longer, checkpoint=checkpoint, progress=False,
                           evaluate=lambda mask: calls.append(mask) or (1.0, 0.0))
    assert len(calls) == 3 and len(extended.evaluations) == 6  # the first three kept
    assert "starts over" not in capsys.readouterr().err


def _resumed_after(planted, tmp_path, edit):
    """A 3-evaluation search saved to its progress file, the file's state changed by ``edit``, then
    the same search run again: the evaluations that rerun made."""
    import json

    model, calibration = planted
    checkpoint = tmp_path / "search.partial.json"
    config = SearchConfig(ratio=0.25, unit="layer", budget=3)
    search_mask(model, calibration, config, checkpoint=checkpoint, progress=False)
    state = json.loads(checkpoint.read_text())
    edit(state, config)
    checkpoint.write_text(json.dumps(state))
    calls = []
    search_mask(model, calibration, config, checkpoint=checkpoint, progress=False,
                evaluate=lambda mask: calls.append(mask) or (1.0, 0.0))
    return calls


def test_a_progress_file_of_the_previous_signature_resumes(planted, tmp_path, capsys):
    """Files written before budget and patience left the signature are resumed, not restarted."""
    from tierspec.layerskip.search import _signature

    model, calibration = planted

    def previous_signature(state, config):
        bypass = round(config.ratio * 12)  # layer units of the planted model: ``search_mask``'s own count
        assert state["signature"] == _signature(model, calibration, config, bypass)
        state["signature"] = _signature(model, calibration, config, bypass, with_stops=True)

    assert _resumed_after(planted, tmp_path, previous_signature) == []
    assert "starts over" not in capsys.readouterr().err


@pytest.mark.parametrize("content", ["[1]", '{"signature": "x"}', "{not json"])
def test_a_damaged_or_other_progress_file_is_said_and_the_search_starts_over(planted, tmp_path, capsys, content):
    model, calibration = planted
    checkpoint = tmp_path / "search.partial.json"
    checkpoint.write_text(content)  # "[1]" was an AttributeError
    result = search_mask(model, calibration, SearchConfig(ratio=0.25, unit="layer", budget=3), checkpoint=checkpoint,
                         progress=False)
    assert len(result.evaluations) == 3 and "the search starts over" in capsys.readouterr().err


def test_a_progress_file_with_a_mask_of_another_size_is_damaged(planted, tmp_path, capsys):
    def cut_a_mask(state, config):
        state["evaluations"][0]["keep"] = state["evaluations"][0]["keep"][:-1]  # was a numpy ValueError

    assert len(_resumed_after(planted, tmp_path, cut_a_mask)) == 3  # started over
    assert "damaged (a mask that is not" in capsys.readouterr().err


def test_search_refuses_an_impossible_ratio(planted):
    model, calibration = planted
    with pytest.raises(ValueError, match="bypasses 12 of 10 eligible layer units"):
        search_mask(model, calibration, SearchConfig(ratio=0.99, unit="layer", budget=2), progress=False)


def test_sublayer_masks_have_the_requested_count(planted):
    model, calibration = planted
    result = search_mask(model, calibration, SearchConfig(ratio=0.25, unit="sublayer", budget=5), progress=False)
    assert len(result.mask.bypassed_units()) == 6 and result.mask.unit == "sublayer"
    assert isinstance(result.mask, RoutingMask) and result.mask.info["evaluations"] == 5


def test_a_compute_budget_draws_and_swaps_within_its_cost_share():
    """Planted weights: 4 attention units of 0.01 and 4 MLP units of 0.05 of a pass; 0.12 ± 0.005
    is reachable only as 2 MLPs + 2 attentions, and a same-kind swap keeps the share exactly."""
    import numpy as np

    from tierspec.layerskip.candidates import ComputeBudget, neighbours, random_keep

    budget = ComputeBudget((0.01,) * 4 + (0.05,) * 4, share=0.12, tolerance=0.005)
    rng = np.random.default_rng(0)
    for _ in range(20):
        keep = random_keep(rng, 8, budget)
        assert budget.feasible(keep)
        assert keep[:4].count(0) == 2 and keep[4:].count(0) == 2
        assert all(budget.feasible(n) for n in neighbours(keep, rng, 10, budget.kinds()))
    with pytest.raises(ValueError, match="no mask bypasses"):
        random_keep(rng, 8, ComputeBudget((0.05,) * 4, share=0.12, tolerance=0.005))


def test_compute_weighted_search_keeps_every_mask_at_its_cost_share(planted):
    from tierspec.costs import UnitCosts

    model, calibration = planted
    costs = UnitCosts(full=1.0, attention=0.01, mlp=0.05, lm_head=0.2)  # a stand-in for the measured table
    config = SearchConfig(ratio=0.2, unit="sublayer", ratio_by="compute", budget=10, initial_random=4, bo_every=2)
    result = search_mask(model, calibration, config, progress=False, unit_costs=costs)
    for evaluation in result.evaluations:
        mask = RoutingMask.from_units(12, "sublayer", [u for u, k in zip(RoutingMask.eligible_units(12, "sublayer"),
                                                                           evaluation.keep) if not k])
        assert abs(costs.bypassed_share(mask) - 0.2) <= 0.005 + 1e-9
    assert abs(result.mask.info["compute_share"] - 0.2) <= 0.005 + 1e-9 and result.mask.info["ratio_by"] == "compute"
    with pytest.raises(ValueError, match="more than all bypassable units hold"):
        search_mask(model, calibration, SearchConfig(ratio=0.9, unit="sublayer", ratio_by="compute", budget=2),
                    progress=False, unit_costs=costs)


def test_measured_unit_costs_are_cached_and_checked(tmp_path, monkeypatch):
    from tierspec import costs

    model = tiny_llama(seed=5, layers=6, sharpness=5.0)
    monkeypatch.setenv("TIERSPEC_CACHE", str(tmp_path))
    measured, real, now = [], costs.measure_unit_costs, {}

    def measure(m):
        measured.append(1)
        result = real(m)
        now["full"] = result.full  # the machine's speed is what was just measured
        return result

    def new_process():
        monkeypatch.setattr(costs, "_MEASURED", {})

    new_process()
    monkeypatch.setattr(costs, "measure_unit_costs", measure)
    # the spot check is pinned: timing a shared machine would make the test flaky, not stronger
    monkeypatch.setattr(costs, "spot_check", lambda model: now["full"])
    first = costs.unit_costs(model)
    assert first.full > 0 and first.lm_head > 0  # what the units contribute: the planted test below
    path = next(tmp_path.glob("unit-costs-*.json"))
    new_process()
    assert costs.unit_costs(model) == first and len(measured) == 1  # read back, not re-measured
    path.write_text("{broken")
    new_process()
    assert costs.unit_costs(model).full > 0 and len(measured) == 2  # damaged: measured again
    now["full"] = json.loads(path.read_text())["costs"]["full"] / 10  # measured on a busy machine
    new_process()
    remeasured = costs.unit_costs(model)
    assert len(measured) == 3 and json.loads(path.read_text())["costs"]["full"] == remeasured.full


def test_unit_costs_are_the_differences_of_planted_pass_times(monkeypatch):
    """The per-unit costs are differences of timed 1-token passes: with a clock that planted passes
    advance (a full pass 10 ms, each bypassed attention sub-layer 0.5 ms less, each MLP 1 ms less,
    the LM head 2 ms), the measurement gives back exactly the planted costs; a pass that bypassing
    made slower (a noisy machine) counts as a unit that costs nothing, never a negative cost."""
    from tierspec import costs

    model = tiny_llama(seed=5, layers=6)
    planted = {"full": 0.010, "attention": 0.0005, "mlp": 0.001, "lm_head": 0.002}
    clock = [0.0]

    class PlantedRunner:
        vocab_size, device = 64, torch.device("cpu")

        def forward(self, tokens, logits_for=None, mask=None):
            if mask is not None:
                clock[0] -= len(mask.skip_attention) * planted["attention"] + len(mask.skip_mlp) * planted["mlp"]
            clock[0] += planted["full"]

        def rollback(self, length):
            pass

    class PlantedTime:
        @staticmethod
        def perf_counter():
            return clock[0]

    monkeypatch.setattr(costs, "measuring_runner", lambda m: PlantedRunner())
    monkeypatch.setattr(costs, "time", PlantedTime)
    hook = model.model.get_output_embeddings().register_forward_hook(
        lambda *args: clock.__setitem__(0, clock[0] + planted["lm_head"]))
    try:
        measured = costs.measure_unit_costs(model.model, context=8, repeats=3)
        assert measured.full == pytest.approx(0.010) and measured.lm_head == pytest.approx(0.002)
        assert measured.attention == pytest.approx(0.0005) and measured.mlp == pytest.approx(0.001)
        assert measured.unit_share("layer") == pytest.approx(0.15)  # (0.5 + 1) ms of a 10 ms pass
        planted["mlp"] = -0.001  # bypassing the MLPs made the pass slower
        assert costs.measure_unit_costs(model.model, context=8, repeats=3).mlp == 0.0
    finally:
        hook.remove()
