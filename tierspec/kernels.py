"""Faster linear layers for the few-row passes of decoding on a CPU.

Decoding runs the target over 1 (plain decoding) to ~11 (verification) new tokens per pass,
so every linear layer multiplies a few rows by a large weight. ``torch.nn.functional.linear``
computes that as x · Wᵀ, and on a CPU the BLAS (MKL) then packs the *large* operand, the
weight, on every call — for a small model most of a decoding pass. Measured on the default
model's shapes (30 layers plus the 49,152-row LM head, 2 cores, weights streamed from memory;
``python benchmarks/few_row_linear.py``), the matrix products of one pass cost, by rows:

    rows          1     2     3     4     5     8    11
    x · Wᵀ       44    71    91    62    54    57    79   ms
    (W · xᵀ)ᵀ    24    21    30    28    35    47    79   ms   (11: above max_rows, x · Wᵀ)

The second form packs only the small operand and streams the weight once. A single row is
run as two (a duplicate), because BLAS routes a one-row product to a matrix-vector kernel
that is as slow as the packing path. Above ``max_rows`` rows (a prefill) the usual
``linear`` is kept: there the packing cost is amortised and its kernel is faster.

The rewrite changes only the order of floating-point operations, not the function: outputs
agree with ``linear`` to rounding (tested). Every method, the transformers peers included,
runs on the same converted model, so comparisons between them stay like for like.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class FewRowLinear(torch.nn.Linear):
    """``nn.Linear`` whose few-row products are computed as (W · xᵀ)ᵀ (see the module doc)."""

    max_rows = 10

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return few_row_linear(x, self.weight, self.bias, self.max_rows)


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int = 10) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as (W · xᵀ)ᵀ when x has 1..max_rows rows.

    Called ~200 times per decoding step, so it keeps to a handful of tensor operations: a
    contiguous [rows, in] operand read transposed (the layout for which the BLAS picks its
    fast kernel; one row is doubled), and a contiguous result so later element-wise ops stay
    dense."""
    features = x.shape[-1]
    rows = x.numel() // features if features else 0
    if rows == 0 or rows > max_rows:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, features)
    if rows == 1:
        out = torch.mm(weight, torch.cat((flat, flat)).t())[:, :1]
    else:
        out = torch.mm(weight, flat.contiguous().t())
    out = out.t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], out.shape[-1])


def use_few_row_linears(model: torch.nn.Module, any_device: bool = False) -> int:
    """Switch every ``nn.Linear`` of a model to ``FewRowLinear`` in place (weights shared,
    nothing copied); returns how many were switched. Only CPU layers unless ``any_device`` (the
    measured gain is a CPU BLAS effect). Subclasses of ``nn.Linear`` with their own forward are
    left alone."""
    switched = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and (any_device or module.weight.device.type == "cpu"):
            module.__class__ = FewRowLinear
            switched += 1
    return switched
