"""tierspec's own forward pass for plain Llama models (the default model is one).

Why it exists: importing transformers' modelling code costs 2-3 s on a small CPU machine
(it pulls ``torch._dynamo``, ``torch.distributed.tensor`` and scipy), longer than generating a
short answer with a 135M model. This module needs only torch and safetensors.

What it computes is transformers' ``LlamaForCausalLM`` (tests pin the logits, the hidden
states, masked passes and cache rollback against it on random models): RMSNorm in float32,
rotary positions (rotate-half), grouped-query attention, SwiGLU MLP, a tied or separate LM
head. The modules carry transformers' names (``model.layers[i].self_attn.q_proj`` …) so the
same safetensors files load, routing masks swap the same sub-modules, forward hooks see the
same outputs, and a draft head or mask made with one implementation fits the other (the
model identity is the same).

Only the plain architecture is covered: ``model_type`` "llama", SiLU, default rotary
positions, no biases. Anything else is loaded through transformers (``supports`` says why not).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F


def supports(config: dict) -> str | None:
    """Why a model with this ``config.json`` cannot run on this module (None: it can)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    checks = {
        f"model_type is {config.get('model_type')!r}, not 'llama'": config.get("model_type") != "llama",
        f"activation {config.get('hidden_act')!r} is not SiLU": config.get("hidden_act", "silu") != "silu",
        f"rope type {rope_type!r} is not the default": rope_type != "default",
        "attention or MLP projections have biases": bool(config.get("attention_bias") or config.get("mlp_bias")),
        "pretraining_tp > 1": int(config.get("pretraining_tp", 1) or 1) != 1,
    }
    reasons = [reason for reason, failed in checks.items() if failed]
    return "; ".join(reasons) if reasons else None


def model_config(config: dict) -> SimpleNamespace:
    """The config as attributes, with the defaults transformers' LlamaConfig would fill in."""
    values = dict(config)
    heads = int(values["num_attention_heads"])
    values["num_key_value_heads"] = values.get("num_key_value_heads") or heads
    values["head_dim"] = values.get("head_dim") or int(values["hidden_size"]) // heads
    values.setdefault("rms_norm_eps", 1e-6)
    values.setdefault("tie_word_embeddings", False)
    values.setdefault("max_position_embeddings", 2048)
    rope = values.get("rope_parameters") or {}
    theta = (rope.get("rope_theta") if isinstance(rope, dict) else None) or values.get("rope_theta") or 10000.0
    values["rope_parameters"] = {"rope_type": "default", "rope_theta": float(theta)}
    values.setdefault("hidden_act", "silu")
    return SimpleNamespace(**values)


# ---- the KV cache ---------------------------------------------------------------------------------


class KVLayer:
    """One layer's keys and values [1, kv_heads, T, d] in a buffer grown by doubling: appending
    writes in place, a rollback only moves the length. ``models.CachedModel`` uses the same
    buffer inside transformers' cache for transformers models."""

    def __init__(self):
        self.length = 0
        self._keys = self._values = None
        self.keys = self.values = None

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + keys.shape[-2]
        capacity = 0 if self._keys is None else self._keys.shape[-2]
        if end > capacity:
            capacity = max(256, end, 2 * capacity)
            grown_keys = keys.new_empty(*keys.shape[:-2], capacity, keys.shape[-1])
            grown_values = values.new_empty(*values.shape[:-2], capacity, values.shape[-1])
            if self.length:
                grown_keys[..., : self.length, :] = self._keys[..., : self.length, :]
                grown_values[..., : self.length, :] = self._values[..., : self.length, :]
            self._keys, self._values = grown_keys, grown_values
        self._keys[..., self.length : end, :] = keys
        self._values[..., self.length : end, :] = values
        self.length = end
        self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def trim(self, length: int) -> None:
        if length < self.length:
            self.length = length
            self.keys, self.values = self._keys[..., :length, :], self._values[..., :length, :]


class KVCache:
    """The KV of every decoder layer; layers a routing mask bypassed may hold fewer positions."""

    def __init__(self, num_layers: int):
        self.layers = [KVLayer() for _ in range(num_layers)]

    def get_seq_length(self) -> int:
        return self.layers[0].length if self.layers else 0


# ---- the modules ------------------------------------------------------------------------------------


class _Linear(torch.nn.Linear):
    """nn.Linear (the few-row kernels replace it like any other) left uninitialised: its weights
    are loaded right after construction, and random initialisation of 135M parameters (or of a
    meta tensor, which imports torch's compiler) would cost more than the load."""

    def reset_parameters(self) -> None:
        pass


class _Embedding(torch.nn.Embedding):
    def reset_parameters(self) -> None:
        pass


class RMSNorm(torch.nn.Module):
    """x / rms(x) · w, computed in float32 and cast back before the weight (as transformers does)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm, computed in float32 and cast back (the draft head uses it too)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [..., T, D] by position (Llama's rotate-half convention); cos/sin [T, D]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Attention(torch.nn.Module):
    def __init__(self, config: SimpleNamespace):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        hidden = config.hidden_size
        self.q_proj = _Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = _Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = _Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = _Linear(self.heads * self.head_dim, hidden, bias=False)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVLayer | None):
        """hidden_states [1, n, H] → (output [1, n, H], None); appends this pass's KV to ``cache``."""
        b, n, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v)
        total = k.shape[-2]
        mask = None
        if n > 1:  # query i (at cache position total - n + i) sees keys 0 .. total - n + i
            rows = torch.arange(total - n, total, device=q.device).unsqueeze(1)
            mask = torch.arange(total, device=q.device).unsqueeze(0) <= rows
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1)), None


class MLP(torch.nn.Module):
    def __init__(self, config: SimpleNamespace):
        super().__init__()
        self.gate_proj = _Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = _Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = _Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(torch.nn.Module):
    def __init__(self, config: SimpleNamespace):
        super().__init__()  # registered in transformers' order, so state_dict() lists weights alike
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVLayer | None):
        attended = self.self_attn(self.input_layernorm(hidden_states), cos, sin, cache)[0]
        hidden_states = hidden_states + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


@dataclass
class DecoderOutput:
    last_hidden_state: torch.Tensor


@dataclass
class CausalLMOutput:
    logits: torch.Tensor


class Decoder(torch.nn.Module):
    """Embedding, the decoder layers and the final norm (transformers' ``LlamaModel``)."""

    def __init__(self, config: SimpleNamespace):
        super().__init__()
        self.embed_tokens = _Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = config.head_dim
        theta = config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                cache: KVCache | None = None, use_cache: bool = True, **unused) -> DecoderOutput:
        """input_ids [1, n] at ``position_ids`` [1, n] (default: after what ``cache`` holds)."""
        hidden = self.embed_tokens(input_ids)
        if position_ids is None:
            start = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(start, start + input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        angles = position_ids[0].float().unsqueeze(1) * self.inv_freq.float().unsqueeze(0)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().to(hidden.dtype), angles.sin().to(hidden.dtype)
        layers = cache.layers if (cache is not None and use_cache) else [None] * len(self.layers)
        for layer, layer_cache in zip(self.layers, layers):
            hidden = layer(hidden, cos, sin, layer_cache)
        return DecoderOutput(self.norm(hidden))


class LlamaLM(torch.nn.Module):
    """A Llama causal LM with transformers' module names; see the module docstring."""

    base_model_prefix = "model"

    def __init__(self, config: SimpleNamespace, generation_config: SimpleNamespace | None = None):
        super().__init__()
        self.config = config
        self.generation_config = generation_config or SimpleNamespace()
        self.model = Decoder(config)
        self.lm_head = _Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def get_decoder(self) -> Decoder:
        return self.model

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head

    def new_kv_cache(self) -> KVCache:
        return KVCache(len(self.model.layers))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                use_cache: bool = True, logits_to_keep: int = 0, **unused) -> CausalLMOutput:
        """Logits [1, m, V] of the last ``logits_to_keep`` = m positions (0: all)."""
        hidden = self.model(input_ids, position_ids, cache, use_cache).last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return CausalLMOutput(self.lm_head(hidden))


def load_llama(folder: Path, dtype: torch.dtype) -> LlamaLM:
    """The model in ``folder`` (config.json and *.safetensors, as transformers saves it) in
    ``dtype``. Raises ValueError when the files do not fit the architecture (missing or
    unexpected weights, wrong shapes); the caller says what to do."""
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text())
    problem = supports(config)
    if problem:
        raise ValueError(f"not a plain Llama model: {problem}")
    generation_file = folder / "generation_config.json"
    generation = SimpleNamespace(**json.loads(generation_file.read_text())) if generation_file.exists() else None
    settings = model_config(config)
    model = LlamaLM(settings, generation)
    expected = dict(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {folder}")
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                state[name] = handle.get_tensor(name)
    if settings.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"weights do not fit a Llama model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, the config implies {tuple(expected[name].shape)}")
        state[name] = tensor.to(dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if settings.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():  # initialised now: plain torch classes from here on
        if type(module) is _Linear:
            module.__class__ = torch.nn.Linear
        elif type(module) is _Embedding:
            module.__class__ = torch.nn.Embedding
    return model.eval()
