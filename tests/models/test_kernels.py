"""Few-row linears: the same function as nn.Linear (to rounding), on every path, in place."""

import pytest
import torch
import torch.nn.functional as F

from tierspec.cached_model import CachedModel
from tierspec.kernels import FewRowLinear, use_few_row_linears


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 10, 11, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_few_row_linear_matches_linear(rows, bias):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(48, 80, bias=bias)
    x = torch.randn(1, rows, 48)
    expected = F.linear(x, layer.weight, layer.bias)
    use_few_row_linears(layer)
    assert isinstance(layer, FewRowLinear)
    got = layer(x)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_non_contiguous_and_flat_inputs():
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    weight, bias = layer.weight.clone(), layer.bias.clone()
    use_few_row_linears(layer)
    x = torch.randn(16, 3).t()  # [3, 16], strides (1, 3)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias))
    v = torch.randn(16)  # a single vector, no batch dimension
    torch.testing.assert_close(layer(v), F.linear(v, weight, bias))
    empty = torch.randn(0, 16)
    assert layer(empty).shape == (0, 8)


def test_switch_shares_weights_and_skips_subclasses():
    class Custom(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Custom(4, 4))
    weight = model[0].weight
    assert use_few_row_linears(model) == 1
    assert model[0].weight is weight and type(model[1]) is Custom


def test_loaded_models_decode_like_plain_linears(tiny_target):
    """A model built in-process gets few-row linears at wrap time; its cached passes (1 and several
    new tokens) agree with the same weights under nn.Linear."""
    import copy

    assert any(isinstance(m, FewRowLinear) for m in tiny_target.model.modules())
    plain = copy.deepcopy(tiny_target.model)
    for module in plain.modules():
        if type(module) is FewRowLinear:
            module.__class__ = torch.nn.Linear
    ids = torch.tensor([3, 9, 4, 1, 7, 2, 5])
    with torch.inference_mode():
        few_row, linear = CachedModel(tiny_target.model), CachedModel(plain)
        for chunk in (ids[:4], ids[4:5], ids[5:]):
            torch.testing.assert_close(few_row.forward(chunk).logits, linear.forward(chunk).logits, rtol=1e-5, atol=1e-5)


# ---- packed (oneDNN) linears -------------------------------------------------------------------

from tierspec.kernels import (PackedLinear, packing_available, resolve_kernels,  # noqa: E402
                              unpacked_copy, use_packed_linears)

needs_packing = pytest.mark.skipif(not packing_available(), reason="this torch build cannot pack for oneDNN")


def force_emulated_bfloat16(monkeypatch):
    """Take the path of a CPU without native bfloat16 (``kernels.compute_dtype``) on any machine."""
    from tierspec import kernels

    monkeypatch.setattr(kernels, "native_bfloat16", lambda: False)


@pytest.fixture(params=["float32", "bfloat16", "bfloat16-emulated"])
def packed_dtype(request, monkeypatch):
    """float32; bfloat16 on this CPU's path (native where it has bfloat16 products, else emulated);
    bfloat16 emulated in float32 whatever the CPU."""
    if request.param == "bfloat16-emulated":
        force_emulated_bfloat16(monkeypatch)
    return torch.float32 if request.param == "float32" else torch.bfloat16


@needs_packing
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(packed_dtype, rows, bias):
    dtype = packed_dtype
    torch.manual_seed(rows)
    layer = torch.nn.Linear(48, 80, bias=bias).to(dtype)
    x = torch.randn(1, rows, 48).to(dtype)
    packed = PackedLinear(layer.weight, layer.bias)
    got = packed(x)
    assert got.dtype == dtype and got.shape == (1, rows, 80)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), F.linear(x.float(), layer.weight.float(), None if layer.bias is None
                                                     else layer.bias.float()), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(packed(x.float()), got)  # inputs in another dtype are cast to the weight's


@needs_packing
@pytest.mark.parametrize("shape", [(80, 48), (576, 1536), (192, 576)])
def test_a_row_is_the_same_alone_and_inside_wider_products(packed_dtype, shape):
    """The property the decode loop relies on: a row's output does not depend on the other rows
    of its call (bitwise), for one row too (K = 1536 takes another path for a single row in
    oneDNN; the layer computes one row as two)."""
    dtype = packed_dtype
    torch.manual_seed(0)
    packed = PackedLinear((torch.randn(*shape) * 0.05).to(dtype))
    rows = (torch.randn(16, shape[1]) * 3).to(dtype)
    together = packed(rows)
    for width in (1, 2, 3, 5, 8, 13):
        for start in range(0, 16 - width + 1, width):
            assert torch.equal(packed(rows[start : start + width]), together[start : start + width]), (width, start)


@needs_packing
def test_packed_layers_save_load_copy_and_unpack_like_linear():
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 4, bias=False))
    plain = copy.deepcopy(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert use_packed_linears(model) == 2 and all(isinstance(model[i], PackedLinear) for i in (0, 2))
    assert not any(isinstance(p, torch.Tensor) and p.dim() == 2 for p in model.parameters())  # no plain copy kept
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    x = torch.randn(5, 8)
    torch.testing.assert_close(model(x), plain(x), rtol=1e-5, atol=1e-6)
    clone = copy.deepcopy(model)
    assert torch.equal(clone(x), model(x))
    doubled = {k: 2 * v for k, v in state.items()}
    clone.load_state_dict(doubled)  # repacks
    assert torch.equal(clone.state_dict()["2.weight"], doubled["2.weight"])
    with pytest.raises(RuntimeError, match="size mismatch"):
        clone.load_state_dict({**doubled, "2.weight": torch.zeros(3, 6)})
    unpacked = unpacked_copy(model)
    assert type(unpacked[0]) is torch.nn.Linear and torch.equal(unpacked[2].weight, state["2.weight"])
    assert isinstance(model[0], PackedLinear)  # the original is left packed


@needs_packing
def test_emulated_bfloat16_is_the_float32_product_of_the_bfloat16_values(monkeypatch):
    """Without native bfloat16 a bfloat16 layer multiplies the bfloat16 weights and rows widened to
    float32 (exact) on the packed float32 path and rounds the result to bfloat16: bitwise that."""
    force_emulated_bfloat16(monkeypatch)
    torch.manual_seed(0)
    weight, bias = (torch.randn(80, 48) * 0.1).bfloat16(), torch.randn(80).bfloat16()
    layer = PackedLinear(weight, bias)
    assert layer.dtype == torch.bfloat16 and layer.compute_dtype == torch.float32 and "computed in" in repr(layer)
    assert torch.equal(layer.weight, weight)  # the weight reads back in its own dtype, unchanged
    x = torch.randn(6, 48)  # float32 rows are rounded to bfloat16 first, as the native layer does
    expected = PackedLinear(weight.float(), bias.float())(x.bfloat16().float()).bfloat16()
    assert torch.equal(layer(x), expected) and layer(x).dtype == torch.bfloat16
    doubled = PackedLinear(2 * weight.float(), 2 * bias.float())(x.bfloat16().float()).bfloat16()
    layer.load_state_dict({"weight": 2 * weight.float(), "bias": 2 * bias})  # repacks and widens the new bias
    assert torch.equal(layer(x), doubled)


@needs_packing
@pytest.mark.parametrize("emulated", [False, True])
def test_a_bfloat16_model_keeps_a_float32_head_and_its_unpacked_copy_its_dtypes(tiny_target, emulated, monkeypatch):
    if emulated:
        force_emulated_bfloat16(monkeypatch)
    import copy

    model = copy.deepcopy(tiny_target.model).to(torch.bfloat16)  # a float64 model: few-row layers, unpacked
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    use_packed_linears(model)
    assert model.lm_head.dtype == torch.float32 and model.lm_head.source_dtype == torch.bfloat16
    assert model.model.layers[0].mlp.down_proj.dtype == torch.bfloat16
    with torch.inference_mode():
        assert model(torch.tensor([[3, 4, 5]])).logits.dtype == torch.float32
    stock = unpacked_copy(model)
    assert stock.lm_head.weight.dtype == torch.bfloat16 and type(stock.lm_head) is torch.nn.Linear


def test_auto_kernels_follow_the_device_and_dtype():
    cpu = torch.device("cpu")
    expected = "packed" if packing_available() else "few-row"
    assert resolve_kernels("auto", cpu, torch.float32) == expected
    assert resolve_kernels("auto", cpu, torch.bfloat16) == expected  # natively or emulated
    assert resolve_kernels("auto", cpu, torch.float64) == "few-row"
    assert resolve_kernels("auto", torch.device("cuda"), torch.float32) == "stock"
    assert resolve_kernels("few-row", cpu, torch.float32) == "few-row"
