"""A Llama model built straight from a GGUF file's blocks: ``tierspec.llama``'s modules with
``quant.QuantLinear`` projections and LM head, a ``quant.QuantEmbedding``, and each decoder layer
run as one call of the pass engine (``FusedLayer``) on cached passes.

The config, tokenizer and generation settings come from the GGUF's converted folder
(``gguf_cache``), the weights from the GGUF file itself (mapped, repacked once, ~96 MB for the
default model instead of a 327 MB bfloat16 copy with a float32 head).

Why one call per layer: a decoder layer through torch's operators is ~25 operator calls (norms,
rotary, the cache writes, attention in fixed-shape chunks, SiLU, residuals), 5 ms per one-token pass
of the default model's 30 layers on 2 cores — as much as its 4-bit matrices cost. The engine runs
the same computation (float32 residual stream, norms, rotary, attention and SwiGLU) in one call;
the layer is still a module call, so forward hooks (hidden-state capture), routing masks (a
bypassed attention or MLP unit is skipped) and CLaSP's unit-by-unit runs keep working.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

from .errors import ModelLoadError
from .llama import GeluMLP, KVLayer, LlamaLM, PassLayout, ViewOnReadKVLayer, model_config, supports
from .engine import Segment, engine, run_stack
from .quant import (NATIVE_TYPES, GgufTensor, Numerics, QuantEmbedding, QuantLinear, QuantWeight, read_gguf_tensors,
                    unpermute_order, unpermute_rows)

ATTENTION_UNIT, MLP_UNIT = 1, 2  # the engine's flags: which residual units of a layer run
EVERY_SLOT = 4  # FusedLayer.run: the pass's attends lists every slot a row sees


class FusedLayer:
    """A decoder layer's engine description (its products' engine weights, copies of its norms and
    biases, its shapes and features: the engine keeps what it reads alive) and its call.

    ``layer`` is a ``llama.DecoderLayer`` or ``ArchDecoderLayer`` (or anything with their parts): what
    it computes beyond Llama's layer is read from its modules, so the engine computes exactly what
    its torch forward does (docs/models.md §What the engine's layer computes): ``self_attn.qkv_bias``,
    ``q_norm``/``k_norm``, ``rotary_dims``, ``scale``/``softcap``; Gemma's four norms where
    ``post_norms``; GELU-tanh where the MLP is a ``GeluMLP``; the sliding window of its
    ``layout_key``. ``rotary_table``: which of the pass's rotary tables it reads (its decoder's
    ``rotary_kinds`` index). Raises ValueError where the engine cannot run it (a projection not
    quantised, shapes the engine does not take)."""

    def __init__(self, layer, config: SimpleNamespace, rotary_table: int = 0, kv_dtype: torch.dtype | None = None):
        attention, mlp = layer.self_attn, layer.mlp
        parts = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(p, QuantLinear) for p in parts):
            raise ValueError("a fused layer needs all four projections quantised")
        numerics = {p.qweight.numerics for p in parts}
        if len(numerics) != 1:
            raise ValueError("a fused layer's projections must share their numerics")
        self.numerics: Numerics = numerics.pop()
        # the caches it makes (``KVLayer.slots``): its numerics' unless given
        self.kv_dtype = self.numerics.kv_dtype if kv_dtype is None else kv_dtype
        if self.kv_dtype not in (torch.float16, torch.float32):
            raise ValueError(f"the engine's KV caches are float16 or float32, not {self.kv_dtype}")
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.hidden = config.hidden_size
        qkv, o, gate_up, down = (part.qweight.handle for part in parts)

        def vector(module):  # a norm's weight as float32 values (copied by the engine), or None
            return None if module is None else module.weight.detach().float().contiguous().numpy()

        features = {}
        bias = getattr(attention, "qkv_bias", None)
        if bias is not None:
            features["qkv_bias"] = bias.detach().float().contiguous().numpy()
        if getattr(attention, "q_norm", None) is not None:
            features["q_norm"], features["k_norm"] = vector(attention.q_norm), vector(attention.k_norm)
        if getattr(layer, "post_norms", False):  # Gemma: norms in front of each unit and on each unit's output
            pre_mlp = layer.pre_feedforward_layernorm
            features["attention_out_norm"] = vector(layer.post_attention_layernorm)
            features["mlp_out_norm"] = vector(layer.post_feedforward_layernorm)
        else:
            pre_mlp = layer.post_attention_layernorm
        if isinstance(mlp, GeluMLP):
            features["activation"] = "gelu_tanh"
        window = getattr(layer, "layout_key", (None, None))[1]
        if window is not None:
            features["window"] = int(window)
        for name, value in (("rotary_dims", getattr(attention, "rotary_dims", self.head_dim)),
                            ("attention_scale", getattr(attention, "scale", None)),
                            ("softcap", getattr(attention, "softcap", None))):
            if value is not None:
                features[name] = value
        self.window = window
        self.capsule = engine().make_layer(qkv=qkv, o=o, gate_up=gate_up, down=down,
                                           norm_in=vector(layer.input_layernorm), norm_post=vector(pre_mlp),
                                           eps=float(config.rms_norm_eps), hidden=self.hidden, heads=self.heads,
                                           kv_heads=self.kv_heads, head_dim=self.head_dim,
                                           inter=config.intermediate_size, rotary_table=rotary_table, **features)
        self.stack = engine().make_stack((self.capsule,))  # the layer alone, for ``run``

    def __deepcopy__(self, memo) -> "FusedLayer":
        return self  # stateless over shared weights: a model's masked copy (layerskip.masks.masked_copy) shares it

    def run(self, hidden: torch.Tensor, layout: PassLayout, cache: KVLayer, units: int) -> torch.Tensor:
        """hidden [1, n, H] float32 → the layer's output [1, n, H] (a new tensor: hooks may keep the
        input), this pass's keys/values written at slots ``layout.start ..`` of ``cache``. ``units``:
        ATTENTION_UNIT | MLP_UNIT, and EVERY_SLOT when ``layout.attends`` [n, start + n] lists the
        slots each row sees (the draft head's trees) rather than [n, n] among the new rows. The
        rotary tables are ``layout.rotary`` (the decoder's, by table number), or its cos/sin alone."""
        n = int(hidden.shape[1])
        if units & ATTENTION_UNIT and cache.length != layout.start:
            raise RuntimeError(f"a layer's cache holds {cache.length} positions, the pass starts at {layout.start}: "
                               "the caller broke the rollback invariant")
        source = hidden if hidden.is_contiguous() and hidden.dtype == torch.float32 else hidden.float().contiguous()
        out = torch.empty_like(source)
        if units & ATTENTION_UNIT:
            table = cache.engine_table(layout.start + n, self.kv_heads, self.head_dim, self.kv_dtype)
        else:  # the MLP unit alone reads no cache
            table = torch.zeros(1, 4, dtype=torch.int64)
        segment = Segment(0, n, layout.start, table, layout.attends, bool(units & EVERY_SLOT), layout.positions)
        rotary = layout.rotary or ((layout.cos.reshape(n, -1), layout.signed_sin.reshape(n, -1)),)
        run_stack(self.stack, source.view(n, -1), out.view(n, -1), [segment], rotary,
                  bytes([units & (ATTENTION_UNIT | MLP_UNIT)]))
        if units & ATTENTION_UNIT:
            cache.advance(n)
        return out


class EngineStack:
    """Every decoder layer's engine description in one (``_qengine.make_stack``), for the whole-stack
    call ``llama.Decoder`` makes on cached passes. Shared, not copied, by a copy of the model."""

    def __init__(self, layers):
        self.capsule = engine().make_stack(tuple(layer.fused.capsule for layer in layers))
        self.every_unit = bytes([ATTENTION_UNIT | MLP_UNIT] * len(layers))  # the flags of a pass that runs them all

    def __deepcopy__(self, memo) -> "EngineStack":
        return self


def _tensor(tensors: dict[str, GgufTensor], name: str, path: Path) -> GgufTensor:
    if name not in tensors:
        raise ModelLoadError(f"{path}: the GGUF file has no tensor {name!r} (not a Llama model file?)")
    return tensors[name]


def _projection(parts: list[tuple[GgufTensor, int | None]], in_features: int, numerics: Numerics,
                path: Path) -> torch.nn.Module:
    """One fused projection from GGUF tensors stacked along the output rows (each with the head
    count to undo llama.cpp's q/k row order, or None): a QuantLinear when every part is of a native
    type (parts of different types, as a Q4_K_M file's q/k in Q4_K and v in Q6_K, stacked as one
    engine weight), else the de-quantised float weights in a plain ``nn.Linear`` (packed later as any)."""
    for tensor, _ in parts:
        if len(tensor.shape) != 2 or tensor.shape[1] != in_features:
            raise ModelLoadError(f"{path}: tensor {tensor.name!r} has shape {tensor.shape}, expected [*, {in_features}]")
    if all(tensor.ggml_type in NATIVE_TYPES for tensor, _ in parts):
        blocks = [(tensor.block_rows(), None if heads is None else unpermute_order(tensor.shape[0], heads),
                   tensor.ggml_type) for tensor, heads in parts]  # repacked straight from the file's mapping
        return QuantLinear(QuantWeight(None, parts[0][0].ggml_type, in_features, numerics, parts=blocks))
    weights = [tensor.dequantized() if heads is None else unpermute_rows(tensor.dequantized(), heads)
               for tensor, heads in parts]
    weight = torch.cat(weights)
    linear = torch.nn.Linear(in_features, int(weight.shape[0]), bias=False, device="meta")
    linear.weight = torch.nn.Parameter(weight.to(numerics.dtype), requires_grad=False)
    return linear


def load_gguf_llama(gguf: Path, folder: Path, numerics: Numerics, parsed: tuple | None = None) -> LlamaLM:
    """The Llama model of ``gguf`` with its native-type weights kept as blocks (see the module
    doc); ``folder``: its converted copy (config.json, generation_config.json). Raises
    ModelLoadError where the file does not fit the config."""
    config = json.loads((folder / "config.json").read_text())
    problem = supports(config)
    if problem:
        raise ModelLoadError(f"not a plain Llama model: {problem}")
    generation_file = folder / "generation_config.json"
    generation = SimpleNamespace(**json.loads(generation_file.read_text())) if generation_file.exists() else None
    settings = model_config(config)
    tensors, fields = parsed if parsed is not None else read_gguf_tensors(gguf)  # ``parsed``: read by the caller
    if fields.get("general.architecture") != "llama":
        raise ModelLoadError(f"{gguf}: architecture {fields.get('general.architecture')!r}, not 'llama'")
    model = LlamaLM(settings, generation)
    hidden, heads, kv_heads = settings.hidden_size, settings.num_attention_heads, settings.num_key_value_heads
    decoder = model.model
    for i, layer in enumerate(decoder.layers):
        t = lambda part: _tensor(tensors, f"blk.{i}.{part}.weight", gguf)  # noqa: E731
        attention, mlp = layer.self_attn, layer.mlp
        attention.qkv_proj = _projection([(t("attn_q"), heads), (t("attn_k"), kv_heads), (t("attn_v"), None)],
                                         hidden, numerics, gguf)
        attention.o_proj = _projection([(t("attn_output"), None)], heads * settings.head_dim, numerics, gguf)
        mlp.gate_up_proj = _projection([(t("ffn_gate"), None), (t("ffn_up"), None)], hidden, numerics, gguf)
        mlp.down_proj = _projection([(t("ffn_down"), None)], settings.intermediate_size, numerics, gguf)
        for norm, part in ((layer.input_layernorm, "attn_norm"), (layer.post_attention_layernorm, "ffn_norm")):
            norm.weight = torch.nn.Parameter(t(part).dequantized().reshape(hidden).float(), requires_grad=False)
    final_norm = _tensor(tensors, "output_norm.weight", gguf)
    decoder.norm.weight = torch.nn.Parameter(final_norm.dequantized().reshape(hidden).float(), requires_grad=False)
    embedding = _tensor(tensors, "token_embd.weight", gguf)
    head_tensor = tensors.get("output.weight")
    if embedding.native:
        table = QuantWeight(embedding.block_rows(), embedding.ggml_type, hidden, numerics)
        decoder.embed_tokens = QuantEmbedding(table)
    else:
        decoder.embed_tokens = torch.nn.Embedding.from_pretrained(embedding.dequantized(), freeze=True)
    if head_tensor is None:  # tied: the head is the embedding table
        model.lm_head = QuantLinear(table) if embedding.native else \
            _projection([(embedding, None)], hidden, Numerics(torch.float32, numerics.layout, False), gguf)
    else:
        model.lm_head = _projection([(head_tensor, None)], hidden, numerics, gguf)
    if isinstance(model.lm_head, torch.nn.Linear):
        model.lm_head.weight.data = model.lm_head.weight.data.float()  # the head's output must be float32
    vocab = settings.vocab_size
    rows = model.lm_head.out_features
    if rows != vocab:
        raise ModelLoadError(f"{gguf}: the LM head has {rows} rows, the config says a vocabulary of {vocab}")
    decoder.residual_dtype = torch.float32
    for module in model.modules():  # constructed uninitialised; plain torch classes from here on
        if type(module).__name__ == "_Linear":
            module.__class__ = torch.nn.Linear
    for layer in decoder.layers:
        try:
            layer.fused = FusedLayer(layer, settings)
        except ValueError:
            layer.fused = None  # a layer with a de-quantised projection runs torch's operators
    if decoder.fused:
        decoder.engine_stack = EngineStack(decoder.layers)
        model.kv_layer_class = ViewOnReadKVLayer
    return model.eval()
