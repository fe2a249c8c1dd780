"""Routing masks: applying them equals a manual computation of the pruned network."""

import copy

import pytest
import torch

from tierspec.cached_model import CachedModel
from tierspec.drafters import NoDrafter
from tierspec.drafters.self_spec import SelfSpeculativeDrafter
from tierspec.identity import ModelIdentity
from tierspec.layerskip.masks import RoutingMask, RoutingMaskError, apply_mask

IDS = torch.tensor([[3, 17, 42, 8, 8, 19, 60, 1, 5, 33]])


def logits(model, mask=None):
    with torch.inference_mode(), apply_mask(model, mask):
        return model(input_ids=IDS, use_cache=False).logits


def test_empty_mask_reproduces_the_target_exactly(tiny_target):
    model = tiny_target.model
    assert torch.equal(logits(model, RoutingMask(4)), logits(model))


@pytest.mark.parametrize("layer", [1, 2])
def test_bypassing_a_layer_equals_the_network_without_it(tiny_target, layer):
    model = tiny_target.model
    pruned = copy.deepcopy(model)
    del pruned.model.layers[layer]
    pruned.config.num_hidden_layers -= 1
    mask = RoutingMask(4, "layer", {layer}, {layer})
    assert torch.equal(logits(model, mask), logits(pruned))
    assert not torch.allclose(logits(model, mask), logits(model))
    # the model is restored afterwards
    assert len(model.model.layers) == 4 and type(model.model.layers[layer]).__name__ == "LlamaDecoderLayer"


@pytest.mark.parametrize("sublayer, weight", [("attn", "self_attn.o_proj"), ("mlp", "mlp.down_proj")])
def test_bypassing_a_sublayer_equals_zeroing_its_output_projection(tiny_target, sublayer, weight):
    model = tiny_target.model
    manual = copy.deepcopy(model)
    module = manual.model.layers[2].get_submodule(weight)
    with torch.no_grad():
        module.weight.zero_()
    mask = RoutingMask.from_units(4, "sublayer", [(sublayer, 2)])
    assert torch.allclose(logits(model, mask), logits(manual), atol=1e-12, rtol=0)


def test_masked_incremental_decoding_matches_a_full_masked_pass(tiny_target):
    """Positions are passed explicitly and bypassed layers (holding fewer KV) still line up."""
    mask = RoutingMask.from_units(4, "sublayer", [("attn", 1), ("mlp", 2), ("attn", 2)])
    runner = CachedModel(tiny_target.model)
    with torch.inference_mode():
        first = runner.forward(IDS[0, :6], mask=mask).logits
        second = runner.forward(IDS[0, 6:], mask=mask).logits
    full = logits(tiny_target.model, mask)[0].float()
    assert torch.allclose(torch.cat([first, second]), full, atol=1e-10)
    assert runner.layer_lengths() == [10, 0, 0, 10]  # layers 1 and 2 wrote no KV: attention bypassed
    runner.rollback(4)
    assert runner.layer_lengths() == [4, 0, 0, 4]


def test_first_and_last_layer_are_never_bypassed():
    with pytest.raises(RoutingMaskError, match="only layers 1..2 of 4"):
        RoutingMask(4, "layer", {0}, {0})
    with pytest.raises(RoutingMaskError, match="only layers 1..2 of 4"):
        RoutingMask.from_units(4, "sublayer", [("mlp", 3)])


def test_mask_file_round_trip_and_refusal_of_another_model(tmp_path, tiny_target):
    mask = RoutingMask(4, "layer", {1}, {1}, tiny_target.identity, {"objective": "kl", "cost": 1.5})
    path = tmp_path / "mask.json"
    mask.save(path)
    loaded = RoutingMask.load(path, tiny_target.identity)
    assert loaded == mask and loaded.info["cost"] == 1.5 and loaded.ratio == 0.25
    other = ModelIdentity("smollm2-135m", 30, 576, 49152, "f" * 64)
    with pytest.raises(RoutingMaskError, match="this mask is for a model with 4 layers; 'smollm2-135m' has 30"):
        RoutingMask.load(path, other)
    same_shape = ModelIdentity("other-tiny", 4, 32, 64, "e" * 64)
    with pytest.raises(RoutingMaskError, match="made for model 'tiny-llama-1'"):
        RoutingMask.load(path, same_shape)


@pytest.mark.parametrize("content, message", [("{not json", "not valid JSON"), ('{"a": 1}', "not a tierspec routing mask"),
                                              ('{"format": "tierspec-routing-mask"}', "malformed")])
def test_corrupted_mask_files_are_clear_errors(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(RoutingMaskError, match=message):
        RoutingMask.load(path)


@pytest.mark.parametrize("skip_attention, num_layers", [
    ("13", 4),  # was read as layers {1, 3}
    ([1.7], 4),  # was layer 1
    ([True], 4),  # was layer 1
    ([1], "4"),
    ([1], True),
])
def test_a_mask_is_lists_of_layer_indices_never_coerced(tmp_path, skip_attention, num_layers):
    import json

    path = tmp_path / "mask.json"
    path.write_text(json.dumps({"format": "tierspec-routing-mask", "version": 1, "num_layers": num_layers,
                                "unit": "sublayer", "skip_attention": skip_attention, "skip_mlp": []}))
    with pytest.raises(RoutingMaskError, match="malformed: (skip_attention must be a list of layer indices|num_layers)"):
        RoutingMask.load(path)


def test_a_mask_nested_too_deeply_is_a_clear_error(tmp_path):
    path = tmp_path / "mask.json"
    path.write_text("[" * 100_000 + "]" * 100_000)  # was a RecursionError
    with pytest.raises(RoutingMaskError, match="not valid JSON"):
        RoutingMask.load(path)


@pytest.mark.parametrize("num_draft", [1, 3, 6])
@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_self_speculative_greedy_equals_ar(tiny_target, prompt_ids, num_draft, threshold):
    from conftest import as_method, run_ids

    from tierspec.policies import ConfidenceStop

    def inspect(verifiers, drafter):
        runner = verifiers.runner
        assert runner.layer_lengths() == [runner.length] * 4  # the draft's KV was dropped

    def tokens(drafter):
        method = as_method(drafter, policy=ConfidenceStop(num_draft, threshold))
        return run_ids(tiny_target, method, prompt_ids, 40, inspect=inspect)

    mask = RoutingMask.from_units(4, "sublayer", [("mlp", 1), ("attn", 2)])
    assert tokens(SelfSpeculativeDrafter(mask)) == tokens(NoDrafter())
