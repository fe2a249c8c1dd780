"""Continuous batching (``tierspec.batch``): every generation's tokens equal its solo tokens
whatever shares the batch and whenever it joined, greedy and seeded; the batch's draft lengths;
what a batch refuses."""

from __future__ import annotations

import pytest
import torch

from gguf_models import write_tiny_gguf
from tierspec.batch import BatchDecoder, BatchError, batch_lengths
from tierspec.decode import DecodeConfig, DecodeRun
from tierspec.gguf_llama import load_gguf_llama
from tierspec.methods import MethodOptions, build_method
from tierspec.models import wrap_model
from tierspec.quant import numerics_for
from tierspec.sampling import SamplingConfig


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    tiny = write_tiny_gguf(tmp_path_factory.mktemp("batch-gguf"), seed=11, sharpness=12.0)
    dtype = torch.bfloat16 if numerics_for(torch.bfloat16).layout == 0 else torch.float32
    return wrap_model(load_gguf_llama(tiny.gguf, tiny.folder, numerics_for(dtype)), name="tiny-gguf")


# repetitive prompts, so that n-gram lookup drafts (and is sometimes right)
PROMPTS = [torch.tensor([5, 9, 13, 5, 9, 13, 7, 21, 5, 9, 13]), torch.tensor([40, 41, 42, 40, 41, 42, 40]),
           torch.tensor([100, 7, 200, 7, 100, 7]), torch.tensor([3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]),
           torch.tensor([250, 1, 250, 1, 250])]
BUDGETS = [20, 7, 15, 25, 1]


def _method(target, name: str):
    return build_method(name, target, None, MethodOptions(num_draft=4))


def _solo(target, name: str, temperature: float) -> list[list[int]]:
    out = []
    for i, (prompt, budget) in enumerate(zip(PROMPTS, BUDGETS)):
        config = DecodeConfig(max_new_tokens=budget, sampling=SamplingConfig(temperature=temperature))
        out.append(DecodeRun(target, _method(target, name), prompt, config, seed=1000 + i).finish().token_ids)
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", ["ar", "pld", "adaptive-pld"])
@pytest.mark.parametrize("joins", [[0, 0, 0, 0, 0], [0, 1, 1, 3, 5], [2, 0, 4, 1, 0]])
def test_every_generation_gets_its_solo_tokens(target, name, temperature, joins):
    """``joins[i]``: the cycle generation i joins at (planted interleavings: all at once, one by
    one, out of order); the budgets differ, so generations also leave at different cycles."""
    expected = _solo(target, name, temperature)
    batch = BatchDecoder(target, max_batch=len(PROMPTS))
    runs, cycle = {}, 0
    while len(runs) < len(PROMPTS) or len(batch):
        for i, join in enumerate(joins):
            if join == cycle and i not in runs:
                config = DecodeConfig(max_new_tokens=BUDGETS[i], sampling=SamplingConfig(temperature=temperature))
                runs[i] = batch.add(i, _method(target, name), PROMPTS[i], config, seed=1000 + i)
        batch.step()
        cycle += 1
    assert [runs[i].token_ids for i in range(len(PROMPTS))] == expected
    assert all(run.finished for run in runs.values()) and all(run.stats.emitted == len(run.token_ids) for run in runs.values())


def test_a_cancelled_generation_leaves_the_others_as_they_were(target):
    expected = _solo(target, "pld", 0.0)
    batch = BatchDecoder(target, max_batch=3)
    runs = {i: batch.add(i, _method(target, "pld"), PROMPTS[i], DecodeConfig(max_new_tokens=BUDGETS[i]), seed=1000 + i)
            for i in (0, 1, 3)}
    batch.step()
    batch.cancel(1)
    while len(batch):
        batch.step()
    assert runs[0].token_ids == expected[0] and runs[3].token_ids == expected[3]
    assert not runs[1].finished


def test_the_batch_refuses_what_would_not_keep_its_solo_text(target):
    batch = BatchDecoder(target, max_batch=1)
    config = DecodeConfig(max_new_tokens=4)
    with pytest.raises(BatchError, match="lossy"):
        batch.add("a", build_method("lossy", target, None, MethodOptions(drafter_kind="ngram")), PROMPTS[0], config)
    batch.add("a", _method(target, "ar"), PROMPTS[0], config)
    with pytest.raises(BatchError, match="full"):
        batch.add("b", _method(target, "ar"), PROMPTS[1], config)
    wider = BatchDecoder(target, max_batch=2)
    wider.add("a", _method(target, "ar"), PROMPTS[0], config)
    with pytest.raises(BatchError, match="already running"):
        wider.add("a", _method(target, "ar"), PROMPTS[1], config)


def test_batch_lengths_take_the_drafts_that_pay():
    class P(list):  # a proposal of n drafts
        pass

    flat = lambda rows: 1.0  # noqa: E731  — rows cost nothing: every draft with any chance pays
    assert batch_lengths([P([1, 2, 3]), P([1, 2])], [[0.9, 0.5, 0.1], [0.8, 0.01]], flat) == [3, 2]
    steep = lambda rows: float(rows)  # noqa: E731  — each row costs a whole token: no draft pays
    assert batch_lengths([P([1, 2, 3]), P([1])], [[0.9, 0.8, 0.7], [0.95]], steep) == [0, 0]
    # a pass of r rows costs 1 + 0.25 (r - 1): drafts worth more than 0.25 of a token... while the rate rises
    affine = lambda rows: 1.0 + 0.25 * (rows - 1)  # noqa: E731
    assert batch_lengths([P([1, 2, 3])], [[0.9, 0.6, 0.2]], affine) == [2]
    # the best next draft first: the second proposal's 0.8 before the first's 0.3
    assert batch_lengths([P([1, 2]), P([1])], [[0.9, 0.3], [0.8]], lambda rows: 1.0 + 0.2 * rows) == [1, 1]
    assert batch_lengths([P([1, 2])], [None], steep) == [2]  # no learned acceptance: as drafted


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

    head = Proposal.chain(torch.tensor([5, 6]), confidence=torch.tensor([0.7, 0.7]), source="head")
    ngram = Proposal.chain(torch.tensor([5, 6]), match_sizes=[3, 3], source="ngram")
    policy = CostAware(8, table, draft_fractions={"head": 0.25})
    assert policy.trim(head) == 2 and policy.trim(ngram) == 2
    policy.share_passes(8)
    # the head drafts nothing; free drafts shrink (a row now adds half of the generation's share)
    assert policy.trim(head) == 0 and policy.trim(ngram) == 1
    policy.share_passes(1)  # alone again: as before
    assert policy.trim(head) == 2
