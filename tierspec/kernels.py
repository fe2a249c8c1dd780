"""Linear kernels for decoding's passes on a CPU: weights packed once, so that a pass over
1-16 new tokens costs about what a pass over one costs.

Decoding runs the target over 1 (plain decoding) to ~16 (verification) new tokens per pass, so
every linear layer multiplies a few rows by a large weight, and the time goes into streaming
the weights from memory. ``torch.nn.functional.linear`` has the BLAS re-pack the weight on
every call; what that costs grows with the rows. Measured on the default model's matrices
(30 layers' projections plus the 49,152-row LM head, one call each, random weights of the
same shapes, 2 cores), milliseconds per pass of k rows:

    k                                   1      2      4      8     16
    float32 F.linear                  45.7   73.5   61.6   55.8   66.7
    float32 packed once (oneDNN)      25.6   27.8   22.9   25.9   34.5
    bfloat16 F.linear                 20.5   20.7   22.7   25.2   30.8
    bfloat16 packed once (oneDNN)     15.7   16.5   13.9   16.1   20.0

So ``PackedLinear`` reorders its weight once, at load, into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``) and runs ``torch.ops.mkldnn._linear_pointwise``:
the path torch's own inductor takes for frozen linear layers on a CPU, without compiling
anything (``torch.compile`` takes seconds to start, and tierspec's CLI must not). The packed
tensor replaces the plain weight: no second copy is kept (``weight`` unpacks on demand).

Two more properties matter for speculative decoding:

* **A row's result does not depend on the other rows of its pass** (its numerics are the same
  alone and inside a 2-16-row verification pass), so a lossless method's greedy output equals
  plain decoding's exactly. oneDNN's packed products have that property for 2+ rows; for one
  row some shapes take a different path (measured: K = 1536, the MLP's down projection, in
  float32 on random rows and in bfloat16 on the default model's activations), so passes of
  fewer than four rows are padded to four (``MIN_ROWS``: also the fastest width here). Tested
  bitwise.
* **The LM head's output is float32** whatever the model's dtype, so that near-ties among the
  logits are not rounded into ties or flips (bfloat16 logits are spaced 0.125 apart at 16).

``FewRowLinear`` (the previous kernel: (W·xᵀ)ᵀ, which streams the weight once on MKL) is kept
for CPUs or dtypes oneDNN does not pack fast (``--kernels few-row``). Its row results agree with
``nn.Linear`` to rounding (~1e-6 relative), not bitwise across pass widths.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

KERNELS = ("auto", "gguf", "packed", "few-row", "stock")


# ---- what this machine can do ---------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def packing_available() -> bool:
    """Whether torch can pack linear weights for oneDNN here (a CPU build with mkldnn)."""
    try:
        return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


@functools.lru_cache(maxsize=None)
def native_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 products natively (AVX512-BF16 or AMX), where
    bfloat16 weights halve a pass's memory traffic at no extra compute. Asked of torch's own
    CPU feature detection (``torch.cpu``), else read from the Linux CPU flags.
    ``TIERSPEC_ENGINE_ISA=avx2`` (or ``portable``) answers no, as an AVX2-only CPU would: with the
    pass engine capped the same way, the whole package then takes an AVX2 machine's paths (tests)."""
    import os

    if os.environ.get("TIERSPEC_ENGINE_ISA") in ("avx2", "portable"):
        return False
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        check = getattr(torch.cpu, probe, None)
        try:
            if check is not None and check():
                return True
        except RuntimeError:
            pass
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def packable_dtype(dtype: torch.dtype) -> bool:
    """Dtypes ``PackedLinear`` runs here: float32, and bfloat16 (natively where the CPU has
    bfloat16 products, else emulated in float32: see ``compute_dtype``)."""
    return dtype in (torch.float32, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a packed layer of ``dtype`` multiplies in. bfloat16 without native bfloat16
    (e.g. an AVX2-only CPU) is emulated: the bfloat16 weights and input rows, widened exactly to
    float32, multiplied on the packed float32 path, the output rounded to bfloat16. That is the
    native path's arithmetic up to the order of the float32 sums (a product of two bfloat16
    numbers is exact in float32, and oneDNN's bfloat16 kernels accumulate in float32), and it
    keeps the property the decode loop needs: a row's result does not depend on the other rows
    of its pass. Measured on a 2-core AVX2 CPU (2 threads, random weights of the default model's
    LM head shape, 576 → 49,152), torch's generic bfloat16 product costs 4.9 ms for one row and
    60 ms for 16, the packed float32 one 9.9 ms for 4 rows and 14 ms for 16; and the generic
    path's row results change with the pass width (the bfloat16 tests of a token alone and inside
    a wider pass failed on it). oneDNN refuses to pack bfloat16 there at all. The emulation keeps float32's bytes per pass,
    so ``--dtype auto`` stays float32 on such CPUs (``models.fastest_dtype``)."""
    if dtype == torch.bfloat16 and not native_bfloat16():
        return torch.float32
    return dtype


# ---- packed linears --------------------------------------------------------------------------


# Fewer rows are padded to this many. oneDNN's one-row path sums in another order for some shapes
# (a token's logits would then depend on whether it was computed alone), and its 1-3-row kernels
# run slower than the 4-row one on the packed layout (default model, in situ, ms per pass at
# k = 1: bfloat16 33.5 padded to 2 rows, 30.4 to 4; float32 46.1 and 40.0).
MIN_ROWS = 4


class PackedLinear(torch.nn.Module):
    """y = x·Wᵀ + b with W packed once for oneDNN (see the module doc).

    Inputs in another dtype are cast to the weight's (a bfloat16 layer reads the float32
    residual stream's normalised rows); the output is in the weight's dtype. ``weight`` returns
    an unpacked copy (for the rare readers: a draft head copying rows, a stock copy)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, source_dtype: torch.dtype | None = None):
        """``source_dtype``: the dtype the layer had before packing, when packing widened it (an
        LM head packed in float32 for a bfloat16 model); ``unpacked_copy`` restores it."""
        super().__init__()
        weight = weight.detach()
        self.source_dtype = source_dtype or weight.dtype
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        self.dtype = weight.dtype
        self.compute_dtype = compute_dtype(weight.dtype)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(self.compute_dtype).contiguous(), None)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().to(weight.dtype), requires_grad=False)
        self._widen_bias()

    def _widen_bias(self) -> None:
        """The emulated path's bias in the compute dtype (a plain tensor, not a parameter), made at
        packing and loading, not on every call; None on the native path, which reads ``bias``."""
        emulated = self.bias is not None and self.compute_dtype != self.dtype
        self.compute_bias = self.bias.detach().to(self.compute_dtype) if emulated else None

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype == self.dtype:
            return torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        # emulated (see compute_dtype): the rows and the bias hold bfloat16 values; widen, multiply, round
        out = torch.ops.mkldnn._linear_pointwise(rows.to(self.compute_dtype), self.packed, self.compute_bias, "none",
                                                 [], "")
        return out.to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != self.dtype:
            flat = flat.to(self.dtype)
        rows = flat.shape[0]
        if rows < MIN_ROWS:  # copies of the last row: see MIN_ROWS
            flat = torch.cat((flat, flat[-1:].expand(MIN_ROWS - rows, -1)))
        out = self._product(flat.contiguous())[:rows]
        return out.view(*shape[:-1], self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        return self.packed.to_dense().to(self.dtype)

    def __deepcopy__(self, memo) -> "PackedLinear":
        clone = memo[id(self)] = PackedLinear(self.weight, None if self.bias is None else self.bias.detach().clone(),
                                              self.source_dtype)
        return clone

    # A packed layer saves and loads like ``nn.Linear`` (its plain weight under ``weight``), so a
    # model tierspec packed in place can still be saved (``save_pretrained``) and loaded.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        name = prefix + "weight"
        if name not in state_dict:
            missing_keys.append(name)
        elif tuple(state_dict[name].shape) != (self.out_features, self.in_features):
            error_msgs.append(f"size mismatch for {name}: copying a param with shape {tuple(state_dict[name].shape)}, "
                              f"the packed layer has {(self.out_features, self.in_features)}")
        else:
            weight = state_dict[name].detach().to(self.dtype)  # rounded to the layer's dtype, then as in __init__
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(self.compute_dtype).contiguous(), None)
        if self.bias is not None and prefix + "bias" in state_dict:
            with torch.no_grad():
                self.bias.copy_(state_dict[prefix + "bias"])
            self._widen_bias()

    def extra_repr(self) -> str:
        emulated = f" (computed in {self.compute_dtype})" if self.compute_dtype != self.dtype else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.dtype}{emulated}, packed"


def use_packed_linears(model: torch.nn.Module) -> int:
    """Replace the model's CPU ``nn.Linear`` layers by ``PackedLinear`` (the plain weights are
    released: no second copy). The LM head is packed in float32 (its output must be float32).
    A head tied to the input embedding is the one exception to "no second copy": the embedding
    lookup keeps the plain table (the default model's is 113 MB in float32; a bfloat16 model keeps
    a bfloat16 table for the lookup). Layers in another dtype (float16, float64) stay as they
    are. Returns how many layers were packed."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    packed = 0
    for parent in list(model.modules()):
        for name, module in list(parent.named_children()):
            if type(module) not in (torch.nn.Linear, FewRowLinear) or module.weight.device.type != "cpu":
                continue
            weight = module.weight
            if module is head:
                weight = weight.float()
            elif not packable_dtype(weight.dtype):
                continue
            setattr(parent, name, PackedLinear(weight, module.bias, source_dtype=module.weight.dtype))
            # The list above still holds the plain module: drop its weight now, so that the plain
            # and the packed copies of the whole model never coexist (peak memory at load).
            module.weight = None
            del weight
            packed += 1
    return packed


def linear_output_features(module: torch.nn.Module) -> int | None:
    """Output width of a linear layer of any kernel kind (None: not a linear layer)."""
    from .quant import QuantLinear

    if isinstance(module, (torch.nn.Linear, PackedLinear, QuantLinear)):
        return module.out_features
    return None


def unpacked_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` with plain ``nn.Linear`` layers everywhere (what a user of
    transformers runs: the bench's ``-stock`` peers)."""
    import copy

    from .quant import QuantEmbedding, QuantLinear

    clone = copy.deepcopy(model)
    for parent in list(clone.modules()):
        for name, module in list(parent.named_children()):
            if isinstance(module, (QuantLinear, QuantEmbedding)):  # the file's weights, de-quantised exactly
                weight = torch.nn.Parameter(module.weight, requires_grad=False)
                if isinstance(module, QuantEmbedding):
                    plain = torch.nn.Embedding(module.num_embeddings, module.embedding_dim, _weight=weight)
                else:
                    plain = torch.nn.Linear(module.in_features, module.out_features, bias=False, device="meta")
                    plain.weight = weight
                setattr(parent, name, plain)
                for layer in getattr(clone, "model", clone).modules():
                    if getattr(layer, "fused", None) is not None and hasattr(layer, "self_attn"):
                        layer.fused = None
            elif isinstance(module, PackedLinear):
                plain = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                        device="meta")
                plain.weight = torch.nn.Parameter(module.weight.to(module.source_dtype), requires_grad=False)
                if module.bias is not None:
                    plain.bias = torch.nn.Parameter(module.bias.detach().to(module.source_dtype), requires_grad=False)
                setattr(parent, name, plain)
            elif type(module) is FewRowLinear:
                module.__class__ = torch.nn.Linear
    return clone


# ---- the few-row kernel ----------------------------------------------------------------------


class FewRowLinear(torch.nn.Linear):
    """``nn.Linear`` whose few-row products are computed as (W · xᵀ)ᵀ (see ``few_row_linear``)."""

    max_rows = 10

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return few_row_linear(x, self.weight, self.bias, self.max_rows)


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int = 10) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as (W · xᵀ)ᵀ when x has 1..max_rows rows.

    On a CPU, ``F.linear`` (x · Wᵀ) has the BLAS pack the large operand, the weight, on every
    call; (W · xᵀ)ᵀ packs only the small one and streams the weight once (measured on the
    default model's matrices: 24 vs 44 ms per pass at one row, 47 vs 57 at eight). A single row
    is run as two, because the BLAS routes a one-row product to a matrix-vector kernel as slow
    as the packing path. Above ``max_rows`` rows (a prefill) the usual ``linear`` is kept."""
    features = x.shape[-1]
    rows = x.numel() // features if features else 0
    if rows == 0 or rows > max_rows:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, features)
    if flat.dtype != weight.dtype:
        flat = flat.to(weight.dtype)
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


def resolve_kernels(kernels: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` → ``packed`` on a CPU where oneDNN packs this dtype fast, ``few-row`` on other
    CPUs, ``stock`` elsewhere (GPUs have their own fast paths)."""
    if kernels != "auto":
        return kernels
    if device.type != "cpu":
        return "stock"
    return "packed" if packing_available() and packable_dtype(dtype) else "few-row"
