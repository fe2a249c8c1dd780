"""Any covered architecture's model built straight from a GGUF file (``tierspec.architectures``
reads what it is; ``tierspec.llama``'s modules compute it).

Weights of a type the pass engine multiplies natively stay the file's blocks (``quant.QuantLinear``,
repacked once; Q5_0 blocks as Q8_0 blocks of the same values); others are de-quantised once at load into float weights (packed for oneDNN later,
as any). A model whose layers need nothing the engine's layer lacks (Llama, with any rotary
scaling: the engine reads the pass's cos/sin table as given) runs each layer as one engine call
(``gguf_llama.FusedLayer``); the others run their layers on torch's operators around the engine's
products, and say so at load in one line (``Architecture.engine_note``).

Plain Llama files keep ``gguf_llama.load_gguf_llama`` (the converted copy's config); this loader
takes every architecture's config from the GGUF header, so a Llama 3 file's rotary frequency
factors (``rope_freqs.weight``, which transformers' GGUF reader drops) are applied too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from .architectures import Architecture, read_architecture
from .errors import ModelLoadError
from .llama import ArchDecoder, LlamaLM, RotaryTable, ScaledEmbedding, ViewOnReadKVLayer
from .quant import (NATIVE_TYPES, Q8_0, GgufTensor, Numerics, QuantEmbedding, QuantLinear, QuantWeight,
                    unpermute_order)

# de-quantised weights that stay float32 whatever the layers' dtype: norms, biases, the LM head and
# the embedding table (tierspec.llama keeps the residual stream and the logits in float32)
_WIDE = torch.float32
Q5_0 = 6  # ggml's type id: re-encoded exactly as Q8_0 for the engine (``q8_0_rows_of_q5_0``)


class NotEnoughMemory(ModelLoadError):
    """The model would not fit in the memory this machine has available."""


def available_memory() -> int:
    """Bytes this machine can give a new model now (``MemAvailable`` of /proc/meminfo; without it,
    the physical memory)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_needed(tensors: dict[str, GgufTensor], numerics: Numerics | None, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of blocks kept, bytes of de-quantised weights) the model of ``tensors`` takes once
    loaded: native blocks repacked at about their size (Q5_0 as Q8_0; ``numerics`` None: nothing is
    kept as blocks), other matrices at ``dtype``'s size per value, vectors and the embedding in float32."""
    kept = dequantised = 0
    for name, tensor in tensors.items():
        values = tensor.shape[0] * (tensor.shape[1] if len(tensor.shape) == 2 else 1)
        if numerics is not None and tensor.ggml_type in NATIVE_TYPES and len(tensor.shape) == 2:
            kept += int(tensor.data.nbytes)
        elif numerics is not None and tensor.ggml_type == Q5_0 and len(tensor.shape) == 2:
            kept += values // 32 * 34  # as exact Q8_0 blocks (``q8_0_rows_of_q5_0``)
        elif len(tensor.shape) == 2 and name.startswith("blk."):
            dequantised += values * dtype.itemsize
        else:
            dequantised += values * _WIDE.itemsize
    return kept, dequantised


def refuse_if_too_large(gguf: Path, tensors: dict[str, GgufTensor], numerics: Numerics | None,
                        dtype: torch.dtype) -> None:
    """Raise NotEnoughMemory, with the sizes, before anything is loaded, where the model would not
    fit in the memory available (a load that swaps or is killed half-way helps nobody)."""
    kept, dequantised = memory_needed(tensors, numerics, dtype)
    available = available_memory()
    if kept + dequantised > available:
        raise NotEnoughMemory(
            f"{gguf.name} needs about {_size(kept + dequantised)} of memory ({_size(kept)} of blocks kept, "
            f"{_size(dequantised)} de-quantised to {str(dtype).replace('torch.', '')}), and this machine has "
            f"{_size(available)} available")


def _size(count: int) -> str:
    return f"{count / 1e9:.1f} GB" if count >= 1e9 else f"{count / 1e6:.1f} MB"


class _Weights:
    """The GGUF tensors of one model, read by name, each checked against the shape the
    architecture implies."""

    def __init__(self, tensors: dict[str, GgufTensor], path: Path):
        self.tensors, self.path = tensors, path

    def get(self, name: str, shape: tuple[int, ...]) -> GgufTensor:
        tensor = self.tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{self.path}: the GGUF file has no tensor {name!r}, which its architecture needs")
        if tuple(tensor.shape) != shape:
            raise ModelLoadError(f"{self.path}: tensor {name!r} has shape {list(tensor.shape)}, "
                                 f"its architecture implies {list(shape)}")
        return tensor

    def vector(self, name: str, size: int) -> torch.Tensor:
        return self.get(name, (size,)).dequantized().float()

    def has(self, name: str) -> bool:
        return name in self.tensors


def q8_0_rows_of_q5_0(tensor: GgufTensor):
    """A Q5_0 tensor's blocks re-encoded as Q8_0 blocks of exactly the same values: a Q5_0 value is
    d·(q − 16) with q of 5 bits and d the block's fp16 scale, a Q8_0 value d·q8 with q8 of 8 bits,
    so each block keeps its d and q8 = q − 16 (read back from gguf-py's de-quantised values, which
    are exact: a small integer times an fp16 scale). uint8 [N, K/32 · 34]; 1.55× the Q5_0 bytes, for
    the engine's Q8_0 kernel (K-quant mixes use Q5_0 where rows are not whole super-blocks: 81 of
    Gemma 3 270M's 127 matrices), where the other way is 4 bytes a weight de-quantised."""
    import numpy as np

    rows = tensor.shape[0]
    raw = np.asarray(tensor.block_rows()).reshape(-1, 22)  # Q5_0 block: fp16 d, 4 bytes of fifth bits, 16 of nibbles
    scales = raw[:, :2].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
    values = tensor.dequantized().numpy().reshape(-1, 32)
    with np.errstate(divide="ignore", invalid="ignore"):
        levels = np.where(scales == 0, 0, np.rint(values / scales)).astype(np.int8)
    out = np.empty((raw.shape[0], 34), dtype=np.uint8)
    out[:, :2] = raw[:, :2]
    out[:, 2:] = levels.view(np.uint8)
    return out.reshape(rows, -1)


def _engine_rows(tensor: GgufTensor) -> tuple[int, object] | None:
    """(native type, blocks) the engine can multiply ``tensor`` with exactly, or None."""
    if tensor.ggml_type in NATIVE_TYPES:
        return tensor.ggml_type, tensor.block_rows()  # straight from the file's mapping
    if tensor.ggml_type == Q5_0 and Q8_0 in NATIVE_TYPES:
        return Q8_0, q8_0_rows_of_q5_0(tensor)
    return None


def _projection(parts: list[tuple[GgufTensor, int | None]], in_features: int, numerics: Numerics | None,
                dtype: torch.dtype) -> torch.nn.Module:
    """One projection stacked from GGUF tensors along the output rows (each with the head count
    whose llama.cpp q/k row order to undo, or None): blocks the engine multiplies (``QuantLinear``:
    the file's, or Q5_0's exact Q8_0 copies; parts of different types, as a Q4_K_M file's q/k in Q4_K
    and v in Q6_K, stacked as one engine weight) when ``numerics`` is given and every part has them,
    else the de-quantised weights in ``dtype``."""
    engine_rows = [_engine_rows(tensor) for tensor, _ in parts] if numerics is not None else [None]
    if all(rows is not None for rows in engine_rows):
        blocks = [(rows, None if heads is None else unpermute_order(tensor.shape[0], heads), kind)
                  for (kind, rows), (tensor, heads) in zip(engine_rows, parts)]
        return QuantLinear(QuantWeight(None, engine_rows[0][0], in_features, numerics, parts=blocks))
    weights = []
    for tensor, heads in parts:
        values = tensor.dequantized()
        weights.append(values if heads is None else values.index_select(0, unpermute_order(values.shape[0], heads)))
    weight = torch.cat(weights).to(dtype)
    linear = torch.nn.Linear(in_features, int(weight.shape[0]), bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    return linear


def _validate_header(gguf: Path, arch: Architecture, tensors: dict[str, GgufTensor]) -> None:
    """The architecture's own check before any weight is read: no layer's tensor past the declared
    count. ``tierspec.gguf_check`` (run by ``quant.read_gguf_tensors`` on every load) has already
    checked every tensor's region, size and type and the tensor set and shapes against the
    metadata; each tensor's shape is checked again where it is read (``_Weights.get``)."""
    unknown = sorted(name for name in tensors if name.startswith("blk.") and not (
        name.split(".")[1].isdigit() and int(name.split(".")[1]) < arch.num_layers))
    if unknown:
        raise ModelLoadError(f"{gguf}: tensor {unknown[0]!r} belongs to a layer past the {arch.num_layers} "
                             "the header declares")


def build_gguf_model(gguf: Path, tensors: dict[str, GgufTensor], fields: dict, numerics: Numerics | None,
                     dtype: torch.dtype, generation: SimpleNamespace | None = None, quiet: bool = False) -> LlamaLM:
    """The model of ``gguf`` (its ``tensors`` and header ``fields``, as ``quant.read_gguf_tensors``
    reads them) with native blocks kept under ``numerics`` (None: every weight de-quantised to
    ``dtype``). Raises UnsupportedArchitecture for an architecture not covered, NotEnoughMemory
    before loading a model that would not fit, ModelLoadError for a file that does not fit its
    header."""
    from .gguf_llama import EngineStack, FusedLayer

    arch = read_architecture(fields, tensors)
    refuse_if_too_large(gguf, tensors, numerics, dtype)
    _validate_header(gguf, arch, tensors)
    if not quiet:
        for note in arch.notes:
            print(f"tierspec: {gguf.name}: {note}", file=sys.stderr)
    config = SimpleNamespace(**arch.config())
    gaps = arch.engine_gaps()
    model = LlamaLM(config, generation, ArchDecoder(config, arch) if gaps else None)
    decoder = model.model
    if not gaps:  # Llama's layers; the rotary table with the file's scaling
        rotary = arch.rotaries[arch.layer_kinds[0]]
        decoder.rotary = RotaryTable(arch.rotary_dims, rotary.theta, rotary.linear, rotary.frequency_factors)
    weights = _Weights(tensors, gguf)
    for i, layer in enumerate(decoder.layers):
        _load_layer(layer, weights, f"blk.{i}.", arch, numerics, dtype)
        if numerics is None and dtype != torch.float32:  # the de-quantised projections read rows of their dtype
            for norm in (layer.input_layernorm, getattr(layer, "pre_feedforward_layernorm", layer.post_attention_layernorm)):
                norm.output_dtype = dtype
    decoder.norm.weight = torch.nn.Parameter(weights.vector("output_norm.weight", arch.hidden_size), requires_grad=False)
    _load_embedding_and_head(model, weights, arch, numerics)
    decoder.residual_dtype = torch.float32
    for module in model.modules():  # constructed uninitialised; plain torch classes from here on
        if type(module).__name__ == "_Linear":
            module.__class__ = torch.nn.Linear
    if numerics is not None and not gaps:
        for layer in decoder.layers:
            try:
                layer.fused = FusedLayer(layer, config)
            except ValueError:
                layer.fused = None  # a layer with a de-quantised projection runs torch's operators
        if decoder.fused:
            decoder.engine_stack = EngineStack(decoder.layers)
            model.kv_layer_class = ViewOnReadKVLayer
    elif numerics is not None and not quiet:
        print(arch.engine_note(), file=sys.stderr)
    if not quiet:
        note = dequantised_note(gguf, tensors, numerics, dtype)
        if note:
            print(note, file=sys.stderr)
    return model.eval()


def dequantised_note(gguf: Path, tensors: dict[str, GgufTensor], numerics: Numerics | None,
                     dtype: torch.dtype) -> str | None:
    """One line naming the matrix types de-quantised at load (None: every matrix kept as blocks)."""
    from collections import Counter

    from gguf import GGMLQuantizationType

    matrices = [t for t in tensors.values() if len(t.shape) == 2]
    kept = {Q5_0, *NATIVE_TYPES} if numerics is not None else set()
    counts = Counter(GGMLQuantizationType(t.ggml_type).name for t in matrices if t.ggml_type not in kept)
    if not counts:
        return None
    listed = ", ".join(f"{count} {name}" for name, count in sorted(counts.items()))
    embedding = tensors.get("token_embd.weight")
    where = (f"; the embedding table {GGMLQuantizationType(embedding.ggml_type).name} de-quantised to float32"
             if embedding is not None and embedding.ggml_type not in kept else "")
    return (f"tierspec: {gguf.name}: {sum(counts.values())} of {len(matrices)} matrices de-quantised at load to "
            f"{str(dtype).replace('torch.', '')} ({listed}{where}): the engine multiplies "
            f"{', '.join(sorted(NATIVE_TYPES.values()))} (and Q5_0 as Q8_0) blocks only")


def _load_layer(layer, weights: _Weights, p: str, arch: Architecture, numerics: Numerics | None,
                dtype: torch.dtype) -> None:
    """Layer ``p`` ("blk.i.")'s projections, biases and norms from the file into ``layer``."""
    H, d, I = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q_rows, kv_rows = arch.num_heads * d, arch.num_kv_heads * d
    attention, mlp = layer.self_attn, layer.mlp
    if arch.fused_qkv:
        qkv = [(weights.get(p + "attn_qkv.weight", (q_rows + 2 * kv_rows, H)), None)]
    else:
        q_heads, kv_heads = (arch.num_heads, arch.num_kv_heads) if arch.permuted_qk else (None, None)
        qkv = [(weights.get(p + "attn_q.weight", (q_rows, H)), q_heads),
               (weights.get(p + "attn_k.weight", (kv_rows, H)), kv_heads),
               (weights.get(p + "attn_v.weight", (kv_rows, H)), None)]
    attention.qkv_proj = _projection(qkv, H, numerics, dtype)
    attention.o_proj = _projection([(weights.get(p + "attn_output.weight", (H, q_rows)), None)], q_rows, numerics, dtype)
    if arch.fused_gate_up:  # Phi-3: one tensor, the gate's rows first (llama.cpp splits it so)
        gate_up = [(weights.get(p + "ffn_up.weight", (2 * I, H)), None)]
    else:
        gate_up = [(weights.get(p + "ffn_gate.weight", (I, H)), None), (weights.get(p + "ffn_up.weight", (I, H)), None)]
    mlp.gate_up_proj = _projection(gate_up, H, numerics, dtype)
    mlp.down_proj = _projection([(weights.get(p + "ffn_down.weight", (H, I)), None)], I, numerics, dtype)
    if arch.qkv_bias:
        if arch.fused_qkv:
            bias = weights.vector(p + "attn_qkv.bias", q_rows + 2 * kv_rows)
        else:
            bias = torch.cat([weights.vector(p + "attn_q.bias", q_rows), weights.vector(p + "attn_k.bias", kv_rows),
                              weights.vector(p + "attn_v.bias", kv_rows)])
        attention.qkv_bias = torch.nn.Parameter(bias, requires_grad=False)
    if arch.qk_norm:
        attention.q_norm.weight = torch.nn.Parameter(weights.vector(p + "attn_q_norm.weight", d), requires_grad=False)
        attention.k_norm.weight = torch.nn.Parameter(weights.vector(p + "attn_k_norm.weight", d), requires_grad=False)
    # GGUF norms are the multipliers themselves (llama.cpp's converter stores Gemma's 1 + w): x/rms(x)·w
    norms = [(layer.input_layernorm, "attn_norm")]
    if arch.post_norms:
        norms += [(layer.post_attention_layernorm, "post_attention_norm"),
                  (layer.pre_feedforward_layernorm, "ffn_norm"), (layer.post_feedforward_layernorm, "post_ffw_norm")]
    else:
        norms += [(layer.post_attention_layernorm, "ffn_norm")]
    for norm, part in norms:
        norm.weight = torch.nn.Parameter(weights.vector(p + part + ".weight", H), requires_grad=False)


def _load_embedding_and_head(model: LlamaLM, weights: _Weights, arch: Architecture, numerics: Numerics | None) -> None:
    """The token embedding (scaled where the architecture scales it) and the LM head (the embedding's
    table where tied), both float32 or the file's blocks."""
    H, V = arch.hidden_size, arch.vocab_size
    decoder = model.model
    embedding = weights.get("token_embd.weight", (V, H))
    native = numerics is not None and embedding.native
    if native:
        table = QuantWeight(embedding.block_rows(), embedding.ggml_type, H, numerics)
        inner = QuantEmbedding(table)
    else:
        values = embedding.dequantized().float()
        inner = torch.nn.Embedding.from_pretrained(values, freeze=True)
    decoder.embed_tokens = inner if arch.embedding_scale is None else ScaledEmbedding(inner, arch.embedding_scale)
    if arch.tied_embeddings:
        if native:
            model.lm_head = QuantLinear(table)
        else:
            model.lm_head = torch.nn.Linear(H, V, bias=False, device="meta")
            model.lm_head.weight = inner.weight  # one float32 table for both
    else:
        model.lm_head = _projection([(weights.get("output.weight", (V, H)), None)], H, numerics, _WIDE)
    if isinstance(model.lm_head, torch.nn.Linear):
        model.lm_head.weight.data = model.lm_head.weight.data.float()  # the head's output must be float32


def load_gguf_model(gguf: Path, folder: Path, numerics: Numerics | None, dtype: torch.dtype,
                    parsed: tuple | None = None) -> LlamaLM:
    """``build_gguf_model`` of ``gguf`` with the generation settings of its converted ``folder``
    (generation_config.json, where there is one); ``parsed``: (tensors, fields) already read."""
    from .quant import read_gguf_tensors

    tensors, fields = parsed if parsed is not None else read_gguf_tensors(gguf)
    generation_file = folder / "generation_config.json"
    generation = SimpleNamespace(**json.loads(generation_file.read_text())) if generation_file.exists() else None
    return build_gguf_model(gguf, tensors, fields, numerics, dtype, generation)
