"""Decoder architectures read from a GGUF file's metadata and tensor names: what each layer
computes beyond plain Llama, and what of it the pass engine covers today.

A GGUF file names its architecture (``general.architecture``) and carries the hyper-parameters
under that prefix (``qwen2.block_count`` …); some features show only in the tensor set (Qwen2's
``attn_q.bias``, Qwen3's ``attn_q_norm``, Llama 3's ``rope_freqs``) and some are fixed by the
architecture in llama.cpp rather than stored (Gemma 3's sliding-window pattern of 6 and local
rotary base 10000). ``read_architecture`` turns that into one ``Architecture``: everything
``tierspec.llama``'s modules need to build and run the model, and nothing about how its weights
are stored. The conventions followed are llama.cpp's (what wrote the file) and, where they agree
with it, transformers' (the reference the tests compare against); docs/models.md lists them.

Covered: llama (with Llama 3's frequency factors and linear rope scaling; Mistral files are
"llama" files), qwen2, qwen3, gemma3, phi3. ``UnsupportedArchitecture`` says in one line why
another file is not (the caller runs it on transformers' modules instead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import ModelLoadError

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3", "phi3")

# The layer features beyond plain Llama's layer (RMSNorm·w, rotate-half rotary from the pass's cos/sin
# table, causal grouped-query attention scaled by 1/sqrt(head_dim), SwiGLU). Each is a line of
# docs/models.md §What the engine's layer computes; ``engine_gaps`` names those a model uses that the
# engine's layer does not compute.
FEATURES = {
    "qkv_bias": "a bias added to the q, k and v projections' outputs",
    "qk_norm": "an RMSNorm over each head's q and k (weight [head_dim]) before the rotation",
    "post_norms": "RMSNorms on the attention and MLP outputs before each residual add (Gemma's sandwich)",
    "gelu_tanh": "GELU (tanh approximation) on the gate instead of SiLU",
    "sliding_window": "sliding-window attention: a query sees only the keys of the last `window` positions",
    "layer_rope": "a rotary table per layer kind (Gemma 3: local layers base 10000, global layers the file's base)",
    "partial_rotary": "rotary positions on the first `rotary_dims` dimensions of each head only",
    "attention_scale": "an attention scale other than 1/sqrt(head_dim) (Gemma's query_pre_attn_scalar)",
    "attention_softcap": "soft-capped attention scores, cap·tanh(s/cap), before the softmax",
    "embedding_scale": "the embedding rows multiplied by a constant (Gemma: sqrt(hidden))",
}
# Features that need nothing of the engine's layer call: applied in Python before it.
OUTSIDE_THE_LAYER = {"embedding_scale"}
# The layer features the engine's layer call computes (tierspec/csrc/engine.h's layer_desc, told by
# ``gguf_llama.FusedLayer``): a model needing none beyond these runs each layer as one engine call.
ENGINE_FEATURES = {"qkv_bias", "qk_norm", "post_norms", "gelu_tanh", "sliding_window", "layer_rope", "partial_rotary",
                   "attention_scale", "attention_softcap"}


class UnsupportedArchitecture(ModelLoadError):
    """A GGUF file whose architecture or features tierspec's own forward does not cover."""


@dataclass(frozen=True)
class Rotary:
    """One rotary table: base ``theta``; ``linear`` divides every position by a factor (linear rope
    scaling); ``frequency_factors`` [rotary_dims / 2] divides each frequency (Llama 3's scaling as
    llama.cpp stores it: the tensor ``rope_freqs.weight``)."""

    theta: float
    linear: float = 1.0
    frequency_factors: tuple[float, ...] | None = None


@dataclass(frozen=True)
class Architecture:
    """A decoder-only model's shape and per-layer features (see the module docstring).

    ``layer_kinds[i]`` names the rotary table (``rotaries``) and ``windows[i]`` the sliding window
    (None: global attention) of layer i. ``permuted_qk``: the file stores q/k rows in llama.cpp's
    interleaved rotary order (llama only), undone at load. ``fused_qkv`` / ``fused_gate_up``: the
    file stores those projections as one tensor (Phi-3)."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    context_length: int
    tied_embeddings: bool
    rotaries: dict[str, Rotary]
    layer_kinds: tuple[str, ...]
    windows: tuple[int | None, ...]
    rotary_dims: int
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    activation: str = "silu"
    attention_scale: float | None = None  # None: 1/sqrt(head_dim)
    attention_softcap: float | None = None
    embedding_scale: float | None = None
    permuted_qk: bool = False
    fused_qkv: bool = False
    fused_gate_up: bool = False
    notes: tuple[str, ...] = field(default=())  # one line each, printed at load

    @property
    def features(self) -> list[str]:
        """The ``FEATURES`` this model uses (empty: a plain Llama layer)."""
        used = {
            "qkv_bias": self.qkv_bias,
            "qk_norm": self.qk_norm,
            "post_norms": self.post_norms,
            "gelu_tanh": self.activation == "gelu_tanh",
            "sliding_window": any(w is not None and w < self.context_length for w in self.windows),
            "layer_rope": len(set(self.layer_kinds)) > 1,
            "partial_rotary": self.rotary_dims != self.head_dim,
            "attention_scale": self.attention_scale is not None
            and not math.isclose(self.attention_scale, self.head_dim ** -0.5, rel_tol=1e-6),
            "attention_softcap": self.attention_softcap is not None,
            "embedding_scale": self.embedding_scale is not None,
        }
        return [name for name, on in used.items() if on]

    def engine_gaps(self) -> list[str]:
        """The layer features the engine's layer call lacks for this model (empty: every layer can
        run as one engine call; the rotary tables, whatever their base, scaling or frequency factors,
        are the pass's cos/sin tables, which the engine reads as given)."""
        return [name for name in self.features if name not in OUTSIDE_THE_LAYER and name not in ENGINE_FEATURES]

    def engine_note(self) -> str | None:
        """One line saying why the layers run on torch's operators (None: they need nothing new)."""
        gaps = self.engine_gaps()
        if not gaps:
            return None
        return (f"tierspec: {self.name} layers run on torch's operators, not the pass engine: the engine's layer lacks "
                f"{', '.join(gaps)} (docs/models.md)")

    def config(self) -> dict:
        """The model's config in transformers' names (what ``tierspec.llama``'s modules and the rest of
        tierspec read: sizes, ``tie_word_embeddings``), plus ``architecture``: this object."""
        return {
            "model_type": self.name, "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.context_length,
            "tie_word_embeddings": self.tied_embeddings, "hidden_act": self.activation,
            "rope_theta": self.rotaries[self.layer_kinds[0]].theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rotaries[self.layer_kinds[0]].theta},
            "architecture": self,
        }


def _field(fields: dict, arch: str, key: str, default=None, required: bool = False):
    value = fields.get(f"{arch}.{key}")
    if value is None:
        if required:
            raise UnsupportedArchitecture(f"the GGUF file has no {arch}.{key} (a scalar) in its header")
        return default
    return value


def read_architecture(fields: dict, tensors: dict) -> Architecture:
    """The ``Architecture`` of a GGUF file from its header ``fields`` (scalars and strings, as
    ``quant.read_gguf_tensors`` returns them: arrays are absent) and its ``tensors`` by name (only
    names and shapes are read). Raises UnsupportedArchitecture with the reason."""
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitecture(f"architecture {arch!r} is not one of tierspec's ({', '.join(ARCHITECTURES)})")
    hidden = int(_field(fields, arch, "embedding_length", required=True))
    layers = int(_field(fields, arch, "block_count", required=True))
    heads = int(_field(fields, arch, "attention.head_count", required=True))
    kv_heads = int(_field(fields, arch, "attention.head_count_kv", heads))
    head_dim = int(_field(fields, arch, "attention.key_length", hidden // heads))
    value_dim = int(_field(fields, arch, "attention.value_length", head_dim))
    if value_dim != head_dim:
        raise UnsupportedArchitecture(f"keys of {head_dim} and values of {value_dim} dimensions per head")
    if heads % kv_heads:
        raise UnsupportedArchitecture(f"{heads} query heads do not share {kv_heads} key/value heads evenly")
    rotary_dims = int(_field(fields, arch, "rope.dimension_count", head_dim))
    if rotary_dims % 2 or not 0 < rotary_dims <= head_dim:
        raise UnsupportedArchitecture(f"rotary dimensions {rotary_dims} for heads of {head_dim}")
    embedding = tensors.get("token_embd.weight")
    if embedding is None:
        raise UnsupportedArchitecture("the GGUF file has no token_embd.weight")
    vocab = int(_field(fields, arch, "vocab_size", embedding.shape[0]))
    intermediate = int(_field(fields, arch, "feed_forward_length", required=True))
    theta = float(_field(fields, arch, "rope.freq_base", 10000.0))
    scaling = _field(fields, arch, "rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise UnsupportedArchitecture(f"rope scaling {scaling!r} (only linear scaling and Llama 3's frequency factors)")
    linear = float(_field(fields, arch, "rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
    linear = linear or 1.0  # a factor of 0 is no scaling (llama.cpp's reading)
    if any(name.startswith("rope_factors_") for name in tensors):
        raise UnsupportedArchitecture("LongRoPE frequency factors (rope_factors_long/short)")
    factors = None
    if "rope_freqs.weight" in tensors:  # Llama 3.1's scaling: each frequency divided by its factor
        factors = tuple(float(v) for v in tensors["rope_freqs.weight"].dequantized().reshape(-1).tolist())
        if len(factors) != rotary_dims // 2:
            raise UnsupportedArchitecture(f"rope_freqs.weight holds {len(factors)} factors, the rotation {rotary_dims // 2}")
    block = lambda part: f"blk.0.{part}"  # noqa: E731  (features are read from the first layer's tensors)
    common = dict(
        name=arch, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        intermediate_size=intermediate, vocab_size=vocab,
        rms_norm_eps=float(_field(fields, arch, "attention.layer_norm_rms_epsilon", 1e-6)),
        context_length=int(_field(fields, arch, "context_length", 4096)),
        tied_embeddings="output.weight" not in tensors, rotary_dims=rotary_dims,
        qkv_bias=f"{block('attn_q')}.bias" in tensors or f"{block('attn_qkv')}.bias" in tensors,
        qk_norm=f"{block('attn_q_norm')}.weight" in tensors,
        attention_softcap=_field(fields, arch, "attn_logit_softcapping"),
    )
    if _field(fields, arch, "final_logit_softcapping") is not None:
        # the LM head's rows are read directly (slim vocabularies, draft heads): a cap after it would be missed
        raise UnsupportedArchitecture("final logit soft-capping (Gemma 2's) is not covered")
    window = _field(fields, arch, "attention.sliding_window") or None  # 0: no window (Phi-4's files)
    global_rotary = Rotary(theta, linear, factors)
    if arch == "gemma3":
        return _gemma3(common, fields, global_rotary, window)
    if arch == "phi3":
        return _phi3(common, fields, tensors, global_rotary, window)
    if arch == "llama":  # Mistral's files are "llama" files; a window, where one is stored, is kept
        kinds, windows = ("global",) * layers, (None if window is None else int(window),) * layers
        notes = ("llama.cpp ignores the sliding window of llama files; tierspec applies it, as transformers' Mistral "
                 "does",) if window else ()
        return Architecture(**common, rotaries={"global": global_rotary}, layer_kinds=kinds, windows=windows,
                            permuted_qk=True, notes=notes)
    # qwen2, qwen3: llama.cpp reads no window for them (Qwen2's use_sliding_window is off in its releases)
    notes = ("the file's sliding window is ignored, as llama.cpp does for this architecture",) if window else ()
    return Architecture(**common, rotaries={"global": global_rotary}, layer_kinds=("global",) * layers,
                        windows=(None,) * layers, notes=notes)


# Gemma 3 as llama.cpp reads it (llama-model.cpp, LLM_ARCH_GEMMA3): every sixth layer global, the others
# sliding with a rotary base of 10000 and no scaling; the attention scale 1/sqrt(head_dim), except for
# the 62-layer 27B model, whose query_pre_attn_scalar is hidden / heads.
GEMMA3_PATTERN = 6
GEMMA3_LOCAL_THETA = 10000.0
GEMMA3_27B_LAYERS = 62


def _gemma3(common: dict, fields: dict, global_rotary: Rotary, window) -> Architecture:
    layers, hidden = common["num_layers"], common["hidden_size"]
    if window is None:
        raise UnsupportedArchitecture("a gemma3 file without gemma3.attention.sliding_window")
    local = [i % GEMMA3_PATTERN < GEMMA3_PATTERN - 1 for i in range(layers)]
    scalar = hidden / common["num_heads"] if layers == GEMMA3_27B_LAYERS else common["head_dim"]
    return Architecture(
        **common, rotaries={"local": Rotary(GEMMA3_LOCAL_THETA), "global": global_rotary},
        layer_kinds=tuple("local" if is_local else "global" for is_local in local),
        windows=tuple(int(window) if is_local else None for is_local in local),
        post_norms=True, activation="gelu_tanh", attention_scale=float(scalar) ** -0.5,
        embedding_scale=math.sqrt(hidden))


def _phi3(common: dict, fields: dict, tensors: dict, global_rotary: Rotary, window) -> Architecture:
    # llama.cpp disables Phi-3's sliding window ("Phi SWA is currently disabled", its PR 13676: the
    # converters store no reliable window) and transformers' GGUF reader sets none: full attention here too.
    notes = ("the file's sliding window is ignored, as llama.cpp does for phi3",) if window else ()
    return Architecture(**common, rotaries={"global": global_rotary}, layer_kinds=("global",) * common["num_layers"],
                        windows=(None,) * common["num_layers"], fused_qkv="blk.0.attn_qkv.weight" in tensors,
                        fused_gate_up="blk.0.ffn_gate.weight" not in tensors, notes=notes)
