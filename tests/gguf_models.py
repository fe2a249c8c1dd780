"""Tiny random Llama models written as GGUF files (with gguf-py's writer and quantiser), beside a
float32 reference of exactly their de-quantised weights, for the pass engine's tests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from safetensors.torch import save_file

from tierspec.llama import LlamaLM, load_llama


@dataclass
class TinyGguf:
    gguf: Path      # the GGUF file
    folder: Path    # config.json (what the converted copy holds) + the float32 reference weights
    config: dict

    def reference(self) -> LlamaLM:
        """The same model in float32 on torch's operators: the file's weights de-quantised."""
        return load_llama(self.folder, torch.float32)


def _permute_for_gguf(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (what ``quant.unpermute_rows`` undoes)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(folder: Path, seed: int = 0, layers: int = 3, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                    intermediate: int = 96, vocab: int = 256, layer_type: str = "Q4_1", head_type: str = "Q8_0",
                    tied: bool = True, sharpness: float = 8.0) -> TinyGguf:
    """A random Llama (rows of whole 32-value blocks) as ``folder``/model.gguf, its config and a
    float32 safetensors copy of the de-quantised weights (the reference) in ``folder``."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    head_dim = hidden // heads
    kinds = {"layer": GGMLQuantizationType[layer_type], "head": GGMLQuantizationType[head_type]}
    writer = GGUFWriter(str(folder / "model.gguf"), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(vocab)])  # the vocabulary gguf_check compares with
    reference: dict[str, torch.Tensor] = {}

    def add(name: str, hf_name: str, weight: np.ndarray, kind, permute_heads: int | None = None):
        stored = weight if permute_heads is None else _permute_for_gguf(weight, permute_heads)
        if kind == GGMLQuantizationType.F32:
            data, values = stored.astype(np.float32), stored.astype(np.float32)
        else:
            data = quantize(stored.astype(np.float32), kind)
            values = dequantize(data, kind).reshape(stored.shape)
        writer.add_tensor(name, data, raw_dtype=kind)
        if permute_heads is not None:  # the reference is in transformers' order: undo the permutation
            values = values.reshape(permute_heads, values.shape[0] // permute_heads // 2, 2, -1).swapaxes(1, 2)
            values = values.reshape(weight.shape)
        reference[hf_name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def randn(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(np.float32)

    embedding = randn(vocab, hidden, scale=sharpness)
    add("token_embd.weight", "model.embed_tokens.weight", embedding, kinds["head"])
    for i in range(layers):
        p, hp = f"blk.{i}.", f"model.layers.{i}."
        add(p + "attn_q.weight", hp + "self_attn.q_proj.weight", randn(heads * head_dim, hidden), kinds["layer"], heads)
        add(p + "attn_k.weight", hp + "self_attn.k_proj.weight", randn(kv_heads * head_dim, hidden), kinds["layer"],
            kv_heads)
        add(p + "attn_v.weight", hp + "self_attn.v_proj.weight", randn(kv_heads * head_dim, hidden), kinds["layer"])
        add(p + "attn_output.weight", hp + "self_attn.o_proj.weight", randn(hidden, heads * head_dim), kinds["layer"])
        add(p + "ffn_gate.weight", hp + "mlp.gate_proj.weight", randn(intermediate, hidden), kinds["layer"])
        add(p + "ffn_up.weight", hp + "mlp.up_proj.weight", randn(intermediate, hidden), kinds["layer"])
        add(p + "ffn_down.weight", hp + "mlp.down_proj.weight", randn(hidden, intermediate), kinds["layer"])
        for part, hf in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            add(p + part + ".weight", hp + hf + ".weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32),
                GGMLQuantizationType.F32)
    add("output_norm.weight", "model.norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32),
        GGMLQuantizationType.F32)
    if not tied:
        add("output.weight", "lm_head.weight", randn(vocab, hidden, scale=sharpness), kinds["head"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "max_position_embeddings": 512, "tie_word_embeddings": tied, "hidden_act": "silu"}
    (folder / "config.json").write_text(json.dumps(config))
    save_file(reference, str(folder / "model.safetensors"))
    return TinyGguf(folder / "model.gguf", folder, config)
