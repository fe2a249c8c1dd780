"""Few-row linears: the same function as nn.Linear (to rounding), on every path, in place."""

import pytest
import torch
import torch.nn.functional as F

from tierspec.kernels import FewRowLinear, use_few_row_linears
from tierspec.models import CachedModel


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
            torch.testing.assert_close(few_row.forward(chunk), linear.forward(chunk), rtol=1e-5, atol=1e-5)
