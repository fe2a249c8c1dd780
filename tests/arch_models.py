"""Tiny random GGUF files of every covered architecture (written with gguf-py's writer) beside
transformers' float32 model of exactly their de-quantised weights: the reference for
tierspec.architectures, tierspec.gguf_model and the generalised tierspec.llama modules.

Matrices of every block type: Q4_0, Q4_1, Q5_0, Q8_0, F16 and BF16 quantised by gguf-py; Q4_K, Q5_K and
Q6_K (which gguf-py cannot quantise) as random valid blocks — random bytes with finite fp16 scales
sized so the weights are about 1/sqrt(K) — whose values are what gguf-py's ``dequantize`` makes of
them; and ``Q4_K_M``, llama.cpp's mix (``q4_k_m_type``): Q4_K, with attn_v and ffn_down Q6_K in its
"more bits" layers and the LM head (or the tied embedding) Q6_K, so one layer's q/k/v mix types.
Shapes are whole 256-value super-blocks (hidden 256, heads × head_dim 256, intermediate 512).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import dequantize, quantize

BLOCK_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "Q4_K_M"]
ARCHS = ["llama3", "mistral", "qwen2", "qwen3", "gemma3", "phi3"]

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 256, 4, 2, 64, 512, 256
WINDOW = 8  # small enough that a 20-token prompt reaches past it
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


@dataclass
class TinyArch:
    gguf: Path
    arch: str
    block_type: str
    reference_weights: dict[str, torch.Tensor]  # transformers' names → float32
    stored: dict[str, np.ndarray]               # GGUF name → the de-quantised values as stored

    def reference(self):
        """transformers' float32 model of the file's de-quantised weights."""
        model = _hf_model(self.arch, self.layers)
        missing, unexpected = model.load_state_dict(self.reference_weights, strict=False)
        assert not unexpected, unexpected
        assert all("rotary" in name or (name == "lm_head.weight" and model.config.tie_word_embeddings)
                   for name in missing), missing
        return model.eval()

    @property
    def layers(self) -> int:
        return 6 if self.arch == "gemma3" else 3


def _random_k_blocks(kind: GGMLQuantizationType, rows: int, width: int, scale: float,
                     rng: np.random.Generator) -> np.ndarray:
    """Random valid super-blocks: random bytes, then each fp16 scale set to a finite value that
    keeps the block's weights within about ±``scale``."""
    values, size = GGML_QUANT_SIZES[kind]
    blocks = width // values
    raw = rng.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    jitter = rng.uniform(0.5, 1.5, size=(rows, blocks)).astype(np.float32)
    if kind == GGMLQuantizationType.Q6_K:  # w = d · scale_int8 · (q − 32), d last
        raw[:, :, 208:210] = (jitter * scale / (128 * 32)).astype(np.float16)[..., None].view(np.uint8).reshape(rows, blocks, 2)
    else:  # Q4_K, Q5_K: w = d · sc · q − dmin · m, d then dmin first; sc, m 6-bit
        levels = 15 if kind == GGMLQuantizationType.Q4_K else 31
        d = (jitter * scale / (63 * levels)).astype(np.float16)
        dmin = (jitter * scale / (2 * 63)).astype(np.float16)
        raw[:, :, 0:2] = d[..., None].view(np.uint8).reshape(rows, blocks, 2)
        raw[:, :, 2:4] = dmin[..., None].view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, blocks * size)


K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def k_blocks(kind: str, rows: int, width: int, seed: int, extremes: bool = True) -> np.ndarray:
    """uint8 [rows, bytes per row] of random valid ``kind`` (a K-quant) super-blocks, weights about
    ±1; with ``extremes``, the first block of rows 0-3 (where there are as many) planted with extreme
    fp16 scales (d and dmin): the largest finite (65504), the smallest subnormal (2^-24), zero, and
    negative (-1)."""
    kind_id = GGMLQuantizationType[kind]
    raw = _random_k_blocks(kind_id, rows, width, 1.0, np.random.default_rng(seed))
    size = GGML_QUANT_SIZES[kind_id][1]
    at = (208,) if kind == "Q6_K" else (0, 2)
    if extremes:
        for row, bits in zip(range(rows), (0x7BFF, 0x0001, 0x0000, 0xBC00)):
            for offset in at:
                raw[row, offset : offset + 2] = np.array([bits], dtype=np.uint16).view(np.uint8)
    assert raw.shape[1] == width // 256 * size
    return raw


def q4_k_m_type(name: str, layers: int, tied: bool) -> str:
    """The type llama.cpp's Q4_K_M gives matrix ``name`` (benchmarks/scale.py: ``tensor_layout``):
    Q6_K for attn_v and ffn_down in the first and last eighth of the layers and every third between,
    and for the LM head (the embedding where tied); Q4_K elsewhere."""
    if name == "output.weight" or (name == "token_embd.weight" and tied):
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        i = int(name.split(".")[1])
        if i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2:
            return "Q6_K"
    return "Q4_K"


def _permute_for_gguf(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order for llama files (what ``quant.unpermute_order`` undoes)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _unpermute(values: np.ndarray, heads: int) -> np.ndarray:
    return values.reshape(heads, values.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(values.shape)


def llama3_frequency_factors() -> np.ndarray:
    """Llama 3's per-frequency divisors for LLAMA3_ROPE at HEAD_DIM, as llama.cpp's converter stores
    them (``rope_freqs.weight``): 1 for short wavelengths, the factor for long, smooth between."""
    theta, factor = LLAMA3_ROPE["rope_theta"], LLAMA3_ROPE["factor"]
    low, high, context = LLAMA3_ROPE["low_freq_factor"], LLAMA3_ROPE["high_freq_factor"], \
        LLAMA3_ROPE["original_max_position_embeddings"]
    out = []
    for i in range(0, HEAD_DIM, 2):
        wavelength = 2 * math.pi * theta ** (i / HEAD_DIM)
        if wavelength < context / high:
            out.append(1.0)
        elif wavelength > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_arch_gguf(folder: Path, arch: str, block_type: str, seed: int = 0, sharpness: float = 8.0,
                    tied: bool | None = None) -> TinyArch:
    """A random model of ``arch`` (one of ARCHS) with every matrix of ``block_type``, as
    ``folder``/``arch``-``block_type``.gguf, and its reference weights."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{arch}-{block_type}.gguf"
    gguf_arch = {"llama3": "llama", "mistral": "llama"}.get(arch, arch)
    layers = 6 if arch == "gemma3" else 3
    tied = arch != "phi3" if tied is None else tied
    writer = GGUFWriter(str(path), gguf_arch)
    writer.add_name({"mistral": "tiny mistral"}.get(arch, f"tiny {arch}"))
    writer.add_token_list([f"<t{i}>" for i in range(VOCAB)])  # the vocabulary gguf_check compares with (no tokenizer model: a model of token ids)
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6 if arch == "gemma3" else 10000.0)
    if arch in ("mistral", "gemma3"):
        writer.add_sliding_window(WINDOW)
    if arch == "gemma3":  # linear rope scaling of the global layers, as Gemma 3 4B+ files have
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)
    if arch == "phi3":
        writer.add_rope_dimension_count(HEAD_DIM // 2)  # a partial rotation, as Phi-4-mini's
    stored: dict[str, np.ndarray] = {}
    reference: dict[str, torch.Tensor] = {}

    def add(name: str, hf_name: str | None, weight_scale: float, shape: tuple[int, ...], permute: int | None = None,
            vector: np.ndarray | None = None):
        if vector is not None:  # norms, biases, rope factors: F32 as converters write them
            data = values = vector.astype(np.float32)
            writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType.F32)
        else:
            rows, width = shape
            kind = GGMLQuantizationType[q4_k_m_type(name, layers, tied) if block_type == "Q4_K_M" else block_type]
            if kind in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K):
                data = _random_k_blocks(kind, rows, width, 3 * weight_scale, rng)
            else:
                data = quantize((rng.standard_normal(shape) * weight_scale).astype(np.float32), kind)
            writer.add_tensor(name, data, raw_dtype=kind)
            values = dequantize(data, kind).reshape(shape).astype(np.float32)
        stored[name] = values
        if hf_name is None:
            return
        reference_values = values if permute is None else _unpermute(values, permute)
        if arch == "gemma3" and name.endswith("norm.weight"):
            reference_values = reference_values - 1  # transformers' Gemma norms multiply by 1 + w
        reference[hf_name] = torch.from_numpy(np.ascontiguousarray(reference_values, dtype=np.float32))

    def norm(size: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(size)).astype(np.float32)

    matrix = lambda width: 1 / math.sqrt(width)  # noqa: E731
    add("token_embd.weight", "model.embed_tokens.weight", sharpness * matrix(HIDDEN), (VOCAB, HIDDEN))
    if arch == "llama3":
        add("rope_freqs.weight", None, 0, (HEAD_DIM // 2,), vector=llama3_frequency_factors())
    q_rows, kv_rows = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    permuted = arch in ("llama3", "mistral")
    for i in range(layers):
        p, hp = f"blk.{i}.", f"model.layers.{i}."
        if arch == "phi3":
            add(p + "attn_qkv.weight", hp + "self_attn.qkv_proj.weight", matrix(HIDDEN), (q_rows + 2 * kv_rows, HIDDEN))
        else:
            add(p + "attn_q.weight", hp + "self_attn.q_proj.weight", matrix(HIDDEN), (q_rows, HIDDEN),
                HEADS if permuted else None)
            add(p + "attn_k.weight", hp + "self_attn.k_proj.weight", matrix(HIDDEN), (kv_rows, HIDDEN),
                KV_HEADS if permuted else None)
            add(p + "attn_v.weight", hp + "self_attn.v_proj.weight", matrix(HIDDEN), (kv_rows, HIDDEN))
        add(p + "attn_output.weight", hp + "self_attn.o_proj.weight", matrix(q_rows), (HIDDEN, q_rows))
        if arch == "qwen2":
            for part, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                add(f"{p}attn_{part}.bias", f"{hp}self_attn.{part}_proj.bias", 0, (rows,),
                    vector=0.5 * rng.standard_normal(rows))
        if arch in ("qwen3", "gemma3"):
            add(p + "attn_q_norm.weight", hp + "self_attn.q_norm.weight", 0, (HEAD_DIM,), vector=norm(HEAD_DIM))
            add(p + "attn_k_norm.weight", hp + "self_attn.k_norm.weight", 0, (HEAD_DIM,), vector=norm(HEAD_DIM))
        if arch == "phi3":
            add(p + "ffn_up.weight", hp + "mlp.gate_up_proj.weight", matrix(HIDDEN), (2 * INTERMEDIATE, HIDDEN))
        else:
            add(p + "ffn_gate.weight", hp + "mlp.gate_proj.weight", matrix(HIDDEN), (INTERMEDIATE, HIDDEN))
            add(p + "ffn_up.weight", hp + "mlp.up_proj.weight", matrix(HIDDEN), (INTERMEDIATE, HIDDEN))
        add(p + "ffn_down.weight", hp + "mlp.down_proj.weight", matrix(INTERMEDIATE), (HIDDEN, INTERMEDIATE))
        add(p + "attn_norm.weight", hp + "input_layernorm.weight", 0, (HIDDEN,), vector=norm(HIDDEN))
        if arch == "gemma3":
            add(p + "post_attention_norm.weight", hp + "post_attention_layernorm.weight", 0, (HIDDEN,), vector=norm(HIDDEN))
            add(p + "ffn_norm.weight", hp + "pre_feedforward_layernorm.weight", 0, (HIDDEN,), vector=norm(HIDDEN))
            add(p + "post_ffw_norm.weight", hp + "post_feedforward_layernorm.weight", 0, (HIDDEN,), vector=norm(HIDDEN))
        else:
            add(p + "ffn_norm.weight", hp + "post_attention_layernorm.weight", 0, (HIDDEN,), vector=norm(HIDDEN))
    add("output_norm.weight", "model.norm.weight", 0, (HIDDEN,), vector=norm(HIDDEN))
    if not tied:
        add("output.weight", "lm_head.weight", sharpness * matrix(HIDDEN), (VOCAB, HIDDEN))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyArch(path, arch, block_type, reference, stored)


def _hf_model(arch: str, layers: int):
    """transformers' model class for ``arch`` with the tiny files' config (uninitialised weights)."""
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=layers,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, rms_norm_eps=1e-6,
                  max_position_embeddings=512, tie_word_embeddings=arch != "phi3")
    default_rope = {"rope_type": "default", "rope_theta": 10000.0}
    if arch == "llama3":
        config = transformers.LlamaConfig(**common, head_dim=HEAD_DIM, rope_parameters=dict(LLAMA3_ROPE))
        cls = transformers.LlamaForCausalLM
    elif arch == "mistral":
        config = transformers.MistralConfig(**common, head_dim=HEAD_DIM, sliding_window=WINDOW,
                                            rope_parameters=default_rope)
        cls = transformers.MistralForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common, rope_parameters=default_rope, use_sliding_window=False)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**common, head_dim=HEAD_DIM, rope_parameters=default_rope,
                                          attention_bias=False, use_sliding_window=False)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "gemma3":
        kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
        config = transformers.Gemma3TextConfig(
            **common, head_dim=HEAD_DIM, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=HEAD_DIM,
            sliding_window=WINDOW, layer_types=kinds,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}})
        cls = transformers.Gemma3ForCausalLM
    elif arch == "phi3":
        config = transformers.Phi3Config(**common, sliding_window=None, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                         rope_parameters={**default_rope, "partial_rotary_factor": 0.5})
        cls = transformers.Phi3ForCausalLM
    else:
        raise ValueError(arch)
    config._attn_implementation = "eager"
    torch.manual_seed(0)  # tiny: initialising it costs nothing, and every weight is loaded over it
    return cls(config).float()
