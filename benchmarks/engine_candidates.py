"""Which engine should compute a cached pass of the default model? Every candidate measured on the
same machine, file and thread count (issue 29, item 3).

    python benchmarks/engine_candidates.py [--only NAME,...] [--rounds 9] [--redo NAME,...|all]
                                           [--skip-timing] [--summary-only]

Candidates (``CANDIDATES``; each one's construction is in its builder below):

* ``engine``: tierspec's default load (``load_model("smollm2-135m", dtype="auto")``: the file's Q4_1 /
  Q8_0 blocks on the compiled pass engine) behind ``CachedModel``; ``packed-bf16``: the previous
  default (``dtype="bfloat16", kernels="packed"``: oneDNN-packed bfloat16 layers, float32 LM head).
* ``int4pack`` / ``int8pack``: tierspec's own Llama forward (``load_model(dtype="bfloat16",
  kernels="stock")``) with its projections swapped for modules calling torch's weight-only packs —
  ``_weight_int4pack_mm_for_cpu`` on the file's own Q4_1 values (group 32; scale d and zero point
  m + 8·d rounded to bfloat16), ``_weight_int8pack_mm`` per output channel (symmetric, from the
  de-quantised float32 weights) — and the LM head as a bfloat16 oneDNN-packed layer (see HEAD).
* ``inductor*`` / ``aoti``: ``StaticPass`` — tierspec's layers (the same bfloat16 weights, float32
  residual stream, norms, rotary and attention) as one traceable function of fixed shapes per pass
  width: the KV cache a fixed buffer of ``CAPACITY`` slots passed in, visibility a mask passed in
  (rollback = a shorter mask; a token tree = its own mask), the pass's new keys/values returned and
  written into the buffer by the caller. tierspec's own forward does not trace as one graph (the
  ``inductor-asis`` probe records why), hence this re-expression. Compiled by torch.compile /
  inductor (``inductor``: default options; ``-freeze``: ``freezing=True``; ``-autotune``:
  ``mode="max-autotune"``; ``-cpp``: ``cpp_wrapper=True``; ``-dynamic``: one graph for every width;
  ``-int4``: StaticPass over the int4-pack modules) with its on-disk caches in a folder of its own,
  and by AOTInductor (``aoti``: one package per width, built once, loaded by ``aoti_load_package``).
  The LM head runs outside the graph (HEAD).
* ``ov-*``: the same StaticPass (float32 de-quantised weights, the head inside) converted by
  ``openvino.convert_model`` (one model, dynamic pass width) and compiled for OpenVINO's CPU plugin
  with ``INFERENCE_NUM_THREADS`` = torch's thread count: ``ov-f32`` (precision hint f32), ``ov-bf16``,
  and the bfloat16 model with nncf weight compression (``ov-int8``: INT8_ASYM per channel,
  ``ov-int4``: INT4_ASYM group 32, ratio 1). The converted IR is saved once (as tierspec caches its
  GGUF conversion) and the compiled blob cached by the plugin (``CACHE_DIR``).
* References (not candidates): ``llamacpp`` (llama-cpp-python's cached passes on the same file, as
  ``benchmarks/pass_cost.py --llamacpp``) in the pass table, and OpenVINO GenAI's end-to-end greedy
  generation on the GGUF (``ovgenai``) as tokens per second.

What is measured, per candidate:

* **Pass cost**: a cached pass of k = 1, 2, 4, 8, 16 new tokens at a ``CONTEXT``-token context,
  logits for every new token (float32 [k, V] on the CPU), the cache rolled back after each; median of
  3 after one warm-up per round; candidates interleaved round by round in one process (``--rounds``),
  the table the median over rounds.
* **Start-up**: wall seconds from spawning a fresh process to "every pass width has run once after
  a 256-token prefill" (so a compiled candidate has compiled, or loaded, all its graphs). *First*: no
  caches at all (a fresh ``$TIERSPEC_CACHE`` — the GGUF conversion included — and a fresh compiler
  cache folder); *cached*: a second process over the caches the first left.
* **Exactness**: a real text's 256 tokens, then the next 16 tokens' logits computed one per pass
  and in passes of 2, 4, 8 and 16: the largest |difference| of a token's logits between its pass
  widths (0 = bitwise: a token's logits do not depend on the other rows of its pass), and each
  token's one-per-pass logits against the float32 reference (transformers' ``LlamaForCausalLM`` on
  the de-quantised float32 weights, ``implementation="transformers"``): largest |difference|, mean
  |difference|, and how many of the 16 argmaxes agree.
* **Features**: rollback (a pass after rollback equals the same pass before it), hidden states (the
  final hidden states of every new token, as the draft head and the judge read them), routing masks
  (a pass with a layer's attention and another's MLP bypassed), token-tree passes (a tree pass's
  path equals the chain pass of that path: largest |difference|). Tested where the candidate offers
  the feature; where it cannot, the reason is recorded (``features`` in each builder).

Each candidate's start-up and exactness run in child processes of their own (a failure is recorded
as one line; ``--redo`` re-runs); the raw numbers go to ``results/engine_candidates/raw.json``
after every step (re-running the script resumes), progress to ``results/engine_candidates/log.txt``,
the table to ``results/engine_candidates/summary.md``. Compiler caches, IR files and packages live
under ``results/engine_candidates/work/`` (not committed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "results" / "engine_candidates"
WORK = OUT / "work"
RAW = OUT / "raw.json"
LOG = OUT / "log.txt"

CONTEXT = 256
WIDTHS = (1, 2, 4, 8, 16)
PROBE = 16  # tokens after the context whose logits the exactness check compares
CAPACITY = 512  # the static graphs' KV slots (tierspec's KEY_BLOCK: a generation's prompt + budget)
PREFILL_CHUNK = 16  # static graphs prefill in passes of their widest width
# HEAD: every torch candidate but packed-bf16 scores the vocabulary with the bfloat16 tied
# embedding in one oneDNN-packed product outside any graph (bfloat16 logits, widened to float32):
# a float32 head costs 2.1 ms a pass on oneDNN and 9.9 ms inside an inductor graph (measured while
# choosing: inductor's frozen float32 linear takes MKL's path), which would swamp the layers'
# differences. packed-bf16 keeps its float32 head (it is the previous default as it was).

TEXT = (
    "The history of the lighthouse is a history of coasts, trade and patience. Long before electric lamps, "
    "keepers climbed narrow stairs every evening to trim the wicks of oil lamps and polish the lenses that "
    "threw their light across the water. A ship's captain approaching an unfamiliar harbour at night relied "
    "on these lights to know where the rocks lay and where the channel ran deep enough for the hull. Each "
    "lighthouse had its own signature: a pattern of flashes, a colour, or a period between beams, printed in "
    "the lists that every navigator kept beside the charts. In the nineteenth century, the Fresnel lens changed "
    "everything. By arranging rings of glass prisms around a single flame, the French physicist Augustin-Jean "
    "Fresnel found a way to gather light that would otherwise escape upwards or downwards and bend it into a "
    "narrow horizontal beam. A lamp that had been visible for a few miles could now be seen from more than "
    "twenty. Governments built hundreds of new towers, and the keepers' families often lived in small houses "
    "at the foot of them, far from the nearest town, with a garden, a few goats and a boat for supplies. Life "
    "was regular and demanding. The lamp had to be lit at sunset and put out at sunrise; the glass had to be "
    "cleaned of soot; the clockwork that turned the lens had to be wound every few hours through the night. "
    "In fog, a horn or a bell sounded at fixed intervals, and the keeper recorded the weather, the passing "
    "ships and any wreck in a logbook that inspectors read on their annual visits. Today most lighthouses are "
    "automated. Solar panels charge batteries that feed bright, efficient lamps, and satellite navigation tells "
    "a ship its position to within a few metres. Yet many towers still stand, some turned into museums or "
    "guest houses, and sailors say that the sight of a familiar light after a long passage remains one of the "
    "most welcome things at sea. Engineers who maintain the remaining lights explain that the work has changed "
    "less than one might expect: salt, wind and damp still attack every metal part, and a light that fails on "
    "a stormy night can still cost lives."
)

FEATURES = ("rollback", "hidden", "routing", "tree")


# ---- small helpers ------------------------------------------------------------------------------

def log(message: str) -> None:
    line = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}"
    print(line, file=sys.stderr, flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    with open(LOG, "a") as handle:
        handle.write(line + "\n")


def one_line(error: BaseException) -> str:
    """The error's first line, and where in tierspec's code it arose when the message says (dynamo's
    'from user code' frames)."""
    text = f"{type(error).__name__}: {error}".strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0] if lines else type(error).__name__
    frames = [line for line in lines if line.startswith("File ") and "tierspec/" in line]
    if frames:
        where = frames[-1].replace('"', "")
        first += f" [at {where[where.index('tierspec/'):]}]"
    return first[:500]


def load_raw() -> dict:
    return json.loads(RAW.read_text()) if RAW.exists() else {}


def save_raw(raw: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    temporary = RAW.with_suffix(".tmp")
    temporary.write_text(json.dumps(raw, indent=1, sort_keys=True))
    temporary.replace(RAW)


def probe_ids() -> torch.Tensor:
    """CONTEXT + PROBE token ids of TEXT (the default model's tokenizer)."""
    from tierspec.models import load_model

    tokenizer = load_model("smollm2-135m", dtype="float32", kernels="stock").tokenizer
    ids = tokenizer.encode(TEXT) if hasattr(tokenizer, "encode") else tokenizer(TEXT)["input_ids"]
    ids = list(ids)
    while len(ids) < CONTEXT + PROBE:
        ids = ids + ids
    return torch.tensor(ids[: CONTEXT + PROBE], dtype=torch.long)


# ---- torch's weight-only packs ------------------------------------------------------------------

class Int4Linear(torch.nn.Module):
    """y = x·Wᵀ with W = d·q + m from a GGUF Q4_1 tensor's own blocks (q the file's 4-bit values),
    through ``_weight_int4pack_mm_for_cpu`` (group 32, which computes (q − 8)·scale + zero: scale = d,
    zero = m + 8·d, both rounded to bfloat16 — the one place the weights leave the file's values).
    Rows are rounded to bfloat16 (the op's vectorised path); the output is bfloat16."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = int(q.shape[0]), int(q.shape[1])
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1))
        scales_zeros = torch.stack([d.t(), (m + 8 * d).t()], dim=-1).to(torch.bfloat16).contiguous()  # [K/32, N, 2]
        self.register_buffer("scales_zeros", scales_zeros)
        self.weight = torch.empty(0, dtype=torch.bfloat16)  # tierspec reads .weight.dtype in places

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, 32, self.scales_zeros)
        return out.view(*x.shape[:-1], self.out_features)


class Int8Linear(torch.nn.Module):
    """y = x·Wᵀ with W ≈ s·q, q int8 per output channel (symmetric, s = max|w|/127 in bfloat16),
    through ``_weight_int8pack_mm`` (bfloat16 rows and output)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        weight = weight.float()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        scale = (weight.abs().amax(dim=1) / 127).clamp_min(1e-12).to(torch.bfloat16)
        q = torch.round(weight / scale.float().unsqueeze(1)).clamp(-127, 127).to(torch.int8)
        self.register_buffer("q", q.contiguous())
        self.register_buffer("scale", scale)
        self.weight = torch.empty(0, dtype=torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        out = torch.ops.aten._weight_int8pack_mm(flat, self.q, self.scale)
        return out.view(*x.shape[:-1], self.out_features)


def q4_1_blocks(rows: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1 tensor's raw rows uint8 [N, K/32·20] → q uint8 [N, K], d and m float32 [N, K/32]."""
    blocks = rows.reshape(rows.shape[0], in_features // 32, 20)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    qs = blocks[..., 4:20]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(rows.shape[0], in_features)
    return q, d, m


def int4_projections() -> list[dict[str, Int4Linear]]:
    """Per decoder layer, tierspec's four fused projections as Int4Linear from the GGUF's Q4_1 blocks
    (q/k rows put back in transformers' order as tierspec's loader does)."""
    from tierspec.models import default_model_file
    from tierspec.quant import Q4_1, read_gguf_tensors, unpermute_rows

    tensors, _ = read_gguf_tensors(default_model_file())
    heads, kv_heads = 9, 3
    layers = []
    for i in range(30):
        def raw(part, permute=None):
            tensor = tensors[f"blk.{i}.{part}.weight"]
            if tensor.ggml_type != Q4_1:
                raise RuntimeError(f"blk.{i}.{part} is ggml type {tensor.ggml_type}, not Q4_1")
            rows = tensor.raw_rows()
            return (unpermute_rows(rows, permute) if permute else rows), int(tensor.shape[1])

        def linear(parts):
            pieces = [q4_1_blocks(*raw(*part)) for part in parts]
            return Int4Linear(*(torch.cat([p[j] for p in pieces]) for j in range(3)))

        layers.append({"qkv_proj": linear([("attn_q", heads), ("attn_k", kv_heads), ("attn_v",)]),
                       "o_proj": linear([("attn_output",)]),
                       "gate_up_proj": linear([("ffn_gate",), ("ffn_up",)]),
                       "down_proj": linear([("ffn_down",)])})
    return layers


def bf16_head(model) -> torch.nn.Module:
    """The LM head as one bfloat16 oneDNN-packed product (bfloat16 logits; HEAD)."""
    from tierspec.kernels import PackedLinear

    weight = model.get_input_embeddings().weight.detach()
    return PackedLinear(weight.to(torch.bfloat16).contiguous())


def swap_projections(model, kind: str) -> None:
    """Replace tierspec's projections in place: ``int4`` (from the file's Q4_1 blocks) or ``int8``
    (per channel, from the model's de-quantised weights, which must be float32)."""
    layers = int4_projections() if kind == "int4" else None
    for i, layer in enumerate(model.model.layers):
        for owner, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                            (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            if kind == "int4":
                setattr(owner, name, layers[i][name])
            else:
                setattr(owner, name, Int8Linear(getattr(owner, name).weight.detach()))


# ---- runners: one interface over every candidate -----------------------------------------------

class CachedRunner:
    """A tierspec model behind ``CachedModel`` (engine, packed, the packs on tierspec's forward)."""

    kind = "cached"

    def __init__(self, model, features: dict):
        from tierspec.cached_model import CachedModel

        self.cached = CachedModel(model)
        self.cached.reserve(CAPACITY)
        self.features = features

    @property
    def length(self) -> int:
        return self.cached.length

    def prefill(self, ids: torch.Tensor) -> None:
        self.cached.forward(ids, logits_for=1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.cached.forward(tokens).logits

    def rollback(self, length: int) -> None:
        self.cached.rollback(length)

    def tree_forward(self, tokens, offsets, attends) -> torch.Tensor:
        return self.cached.forward(tokens, offsets=offsets, attends=attends).logits

    def hidden_forward(self, tokens) -> tuple[torch.Tensor, torch.Tensor]:
        result = self.cached.forward(tokens, with_hidden=True)
        return result.logits, result.hidden

    def masked_forward(self, tokens, mask) -> torch.Tensor:
        return self.cached.forward(tokens, mask=mask).logits


class StaticPass(torch.nn.Module):
    """tierspec's decoder (``tierspec.llama``: float32 residual stream and norms, rotary, grouped-
    query attention in float32, SwiGLU; projections in the model's dtype) as a function of fixed
    shapes per pass width k:

        (ids [k], positions [k], keys [L, kv, T, D], values [L, kv, T, D], past_mask [k, T],
         new_mask [k, k]) → (hidden [k, H] float32, new_keys [L, kv, k, D], new_values [L, kv, k, D])
        (+ logits [k, V] float32 first, with ``head``)

    The cache buffer is an input (T = CAPACITY slots, never written by the graph): attention scores
    the T cached slots and the k new keys separately (masks additive: 0 / −inf) and softmaxes them
    together, so nothing of the cache is copied; the caller writes the returned keys/values at
    their slots. Rollback is the caller's: a shorter ``past_mask``."""

    def __init__(self, lm, head: torch.nn.Module | None = None, projections: list[dict] | None = None):
        super().__init__()
        cfg = lm.config
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.hidden_size, self.intermediate, self.eps = cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps
        decoder = lm.model
        self.embed = decoder.embed_tokens
        layers = decoder.layers

        def part(i, owner, name):
            return projections[i][name] if projections else getattr(getattr(layers[i], owner), name)

        self.qkv = torch.nn.ModuleList(part(i, "self_attn", "qkv_proj") for i in range(len(layers)))
        self.o = torch.nn.ModuleList(part(i, "self_attn", "o_proj") for i in range(len(layers)))
        self.gate_up = torch.nn.ModuleList(part(i, "mlp", "gate_up_proj") for i in range(len(layers)))
        self.down = torch.nn.ModuleList(part(i, "mlp", "down_proj") for i in range(len(layers)))
        self.norm1 = torch.nn.ParameterList(layer.input_layernorm.weight for layer in layers)
        self.norm2 = torch.nn.ParameterList(layer.post_attention_layernorm.weight for layer in layers)
        self.final_norm = decoder.norm.weight
        self.dtype = torch.bfloat16 if projections else layers[0].self_attn.qkv_proj.weight.dtype
        self.head = head
        cos, sin = decoder.rotary.factors(torch.arange(4 * CAPACITY), torch.float32)
        self.register_buffer("cos", cos[:, 0].contiguous())
        self.register_buffer("sin", sin[:, 0].contiguous())

    def forward(self, ids, positions, keys, values, past_mask, new_mask):
        k = ids.shape[0]
        h, kv, d, H = self.heads, self.kv_heads, self.head_dim, self.hidden_size
        group = h // kv
        x = self.embed(ids).float()
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        past_mask, new_mask = past_mask.unsqueeze(0), new_mask.unsqueeze(0)  # over the kv heads
        scale = d ** -0.5
        new_keys, new_values = [], []
        for i in range(len(self.qkv)):
            a = F.rms_norm(x, (H,), self.norm1[i], self.eps).to(self.dtype)
            qkv = self.qkv[i](a).view(k, h + 2 * kv, d).float()
            r = qkv[:, : h + kv]
            r = r * cos + r.roll(d // 2, dims=-1) * sin
            # queries grouped by their kv head: [kv, group·k, D] (row = g·k + token)
            # (scaled here, not the scores: a scale on the scores is moved onto the cache input by
            # OpenVINO's optimiser, which then multiplies all 30 layers' keys in every layer)
            q = r[:, :h].reshape(k, kv, group, d).permute(1, 2, 0, 3).reshape(kv, group * k, d) * scale
            key = r[:, h:].transpose(0, 1)  # [kv, k, D]
            value = qkv[:, h + kv:].transpose(0, 1)
            new_keys.append(key)
            new_values.append(value)
            past = torch.matmul(q, keys[i].float().transpose(1, 2))  # [kv, group·k, T]
            own = torch.matmul(q, key.transpose(1, 2))  # [kv, group·k, k]
            past = (past.view(kv, group, k, -1) + past_mask.unsqueeze(1)).view(kv, group * k, -1)
            own = (own.view(kv, group, k, k) + new_mask.unsqueeze(1)).view(kv, group * k, k)
            p = torch.softmax(torch.cat((past, own), dim=-1), dim=-1)
            T = past.shape[-1]
            att = torch.matmul(p[..., :T], values[i].float()) + torch.matmul(p[..., T:], value)  # [kv, group·k, D]
            att = att.view(kv, group, k, d).permute(2, 0, 1, 3).reshape(k, h * d)
            x = x + self.o[i](att.to(self.dtype))
            m = F.rms_norm(x, (H,), self.norm2[i], self.eps).to(self.dtype)
            g = self.gate_up[i](m)
            x = x + self.down[i](F.silu(g[:, : self.intermediate]) * g[:, self.intermediate:])
        x = F.rms_norm(x, (H,), self.final_norm, self.eps)
        out = (x, torch.stack(new_keys), torch.stack(new_values))
        if self.head is not None:
            return (self.head(x).float(),) + out
        return out


class StaticRunner:
    """A StaticPass-shaped callable (compiled, exported or converted) behind the runner interface:
    the KV buffer [L, kv, CAPACITY, D] float32 and its length are kept here; ``head`` (None when the
    callable returns logits) scores the hidden states outside the graph."""

    kind = "static"

    def __init__(self, call, head, features: dict, layers=30, kv_heads=3, head_dim=64, widths=WIDTHS,
                 kv_dtype=torch.float32):
        self.call, self.head, self.features = call, head, features
        self.keys = torch.zeros(layers, kv_heads, CAPACITY, head_dim, dtype=kv_dtype)
        self.values = torch.zeros(layers, kv_heads, CAPACITY, head_dim, dtype=kv_dtype)
        self.length = 0
        self.widths = widths
        self.slots = torch.arange(CAPACITY)
        self.causal = {}

    def _pass(self, tokens, positions, past_visible, new_mask):
        k = int(tokens.shape[0])
        past_mask = torch.zeros(k, CAPACITY).masked_fill_(~past_visible, float("-inf"))
        outputs = self.call(tokens, positions, self.keys, self.values, past_mask, new_mask)
        if self.head is None:
            logits, hidden, new_keys, new_values = outputs
        else:
            hidden, new_keys, new_values = outputs
            logits = self.head(hidden).float()
        self.keys[:, :, self.length : self.length + k] = new_keys
        self.values[:, :, self.length : self.length + k] = new_values
        self.length += k
        self._hidden = hidden
        return logits

    def _causal(self, k):
        if k not in self.causal:
            self.causal[k] = torch.zeros(k, k).masked_fill_(torch.ones(k, k, dtype=torch.bool).triu(1), float("-inf"))
        return self.causal[k]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        k = int(tokens.shape[0])
        if self.length + k > CAPACITY:
            raise RuntimeError(f"the static cache holds {CAPACITY} slots")
        positions = torch.arange(self.length, self.length + k)
        visible = (self.slots < self.length).unsqueeze(0).expand(k, CAPACITY)
        return self._pass(tokens, positions, visible, self._causal(k))

    def prefill(self, ids: torch.Tensor) -> None:
        chunk = max(self.widths)
        for start in range(0, int(ids.shape[0]), chunk):
            self.forward(ids[start : start + chunk])

    def rollback(self, length: int) -> None:
        self.length = length

    def tree_forward(self, tokens, offsets, attends) -> torch.Tensor:
        k = int(tokens.shape[0])
        positions = self.length + offsets
        visible = (self.slots < self.length).unsqueeze(0).expand(k, CAPACITY)
        new_mask = torch.zeros(k, k).masked_fill_(~attends.bool(), float("-inf"))
        return self._pass(tokens, positions, visible, new_mask)

    def hidden_forward(self, tokens):
        logits = self.forward(tokens)
        return logits, self._hidden.float()


# ---- candidates ------------------------------------------------------------------------------------

NOT_IN_GRAPH = {
    "hidden": "final hidden states: an output of the graph (tested); a decoder layer's own output (the draft head's "
              "extra layers, CLaSP) only as a further output of a graph built for that set of layers",
    "routing": "not tested: a bypassed attention/MLP unit changes the graph, so one graph (compile, package or IR) per "
               "routing mask, or per-unit gate inputs that still compute the bypassed unit (no saving); a bypassed "
               "attention unit must also write no KV (the caller's buffer handles that)",
}


def features_cached(note: str = "") -> dict:
    return {"rollback": "tested", "hidden": "tested (forward hooks; CachedModel with_hidden)",
            "routing": "tested (routing.apply_mask swaps modules)", "tree": "tested (CachedModel attends)",
            **({"note": note} if note else {})}


def features_static(extra: str) -> dict:
    return {"rollback": "tested: the cache is a fixed buffer passed in and visibility a mask passed in, so a rollback "
                        "is a shorter mask (nothing re-sliced, no recompilation)",
            "hidden": NOT_IN_GRAPH["hidden"], "routing": NOT_IN_GRAPH["routing"],
            "tree": "tested: the new tokens' mask and positions are inputs (one graph per pass width serves any tree)",
            "note": extra}


def build_engine(cache: Path):
    from tierspec.models import load_model

    loaded = load_model("smollm2-135m", dtype="auto")
    return CachedRunner(loaded.model, features_cached("the file's Q4_1/Q8_0 blocks, rows rounded to bfloat16, float32 logits"))


def build_engine_f32(cache: Path):
    from tierspec.models import load_model

    loaded = load_model("smollm2-135m", dtype="float32", kernels="gguf")
    return CachedRunner(loaded.model, features_cached("the file's Q4_1/Q8_0 blocks, float32 rows and FMAs, float32 logits"))


def build_packed(cache: Path):
    from tierspec.models import load_model

    loaded = load_model("smollm2-135m", dtype="bfloat16", kernels="packed")
    return CachedRunner(loaded.model, features_cached("bfloat16 layers (the file's values re-rounded), float32 head"))


def build_pack(kind: str):
    def build(cache: Path):
        from tierspec.models import load_model

        # int8 quantises the de-quantised float32 weights; int4 reads the file's blocks itself
        loaded = load_model("smollm2-135m", dtype="float32" if kind == "int8" else "bfloat16", kernels="stock")
        model = loaded.model
        head = bf16_head(model)
        if kind == "int8":
            for layer in model.model.layers:
                for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                    norm.output_dtype = torch.bfloat16
        swap_projections(model, kind)
        model.lm_head = head
        if kind == "int8":  # the embedding lookup as the bfloat16 model has it
            model.model.embed_tokens.weight.data = model.model.embed_tokens.weight.data.to(torch.bfloat16)
        note = ("layers: the file's Q4_1 values, scale and zero point rounded to bfloat16 (group 32)" if kind == "int4"
                else "layers: int8 per output channel from the de-quantised weights") + "; bfloat16 head and logits"
        return CachedRunner(model, features_cached(note))

    return build


def static_source(dtype: str):
    """tierspec's model in ``dtype`` (stock kernels: plain nn.Linear) for StaticPass."""
    from tierspec.models import load_model

    return load_model("smollm2-135m", dtype=dtype, kernels="stock").model


def inductor_options(variant: str) -> tuple[dict, str | None, bool]:
    options = {}
    if "freeze" in variant:
        options["freezing"] = True
    if "cpp" in variant:
        options["cpp_wrapper"] = True
    mode = "max-autotune" if "autotune" in variant else None
    if mode:
        options["max_autotune"] = True  # torch.compile takes mode or options: the mode's two settings spelled out
        options["max_autotune_gemm_backends"] = "CPP,ATEN"
    return options, mode, "dynamic" in variant


def own_code(module: torch.nn.Module, tag: str) -> torch.nn.Module:
    """``module`` with a forward of its own code object: dynamo keeps its compiled graphs per code
    object, so the variants timed in one process would otherwise share (and exhaust) one cache."""
    import types

    code = StaticPass.forward.__code__.replace(co_name=f"forward_{tag.replace('-', '_')}")
    module.forward = types.MethodType(types.FunctionType(code, StaticPass.forward.__globals__, code.co_name,
                                                         StaticPass.forward.__defaults__, StaticPass.forward.__closure__),
                                      module)
    return module


def build_inductor(variant: str):
    def build(cache: Path):
        import torch._dynamo

        lm = static_source("bfloat16")
        head = bf16_head(lm)
        projections = int4_projections() if "int4" in variant else None
        module = own_code(StaticPass(lm, projections=projections).eval(), variant)
        options, _, dynamic = inductor_options(variant)
        for limit in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, limit):
                setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 64))
        # The bound forward, not the module: compiling a module compiles nn.Module's shared call
        # wrapper, whose one recompile budget the variants timed in one process would exhaust.
        compiled = torch.compile(module.forward, fullgraph=True, dynamic=dynamic, options=options or None)
        shapes = "one graph for every width (dynamic=True)" if dynamic else "one graph per pass width"
        return StaticRunner(compiled, head, features_static(f"StaticPass compiled by inductor ({options or 'defaults'}), "
                                                             f"{shapes}; bfloat16 head outside the graph"))

    return build


def build_asis(cache: Path):
    """torch.compile of tierspec's own cached forward, unchanged (fullgraph=True): does it trace?"""
    from tierspec.models import load_model

    loaded = load_model("smollm2-135m", dtype="bfloat16", kernels="stock")
    model = loaded.model
    model.forward = torch.compile(model.forward, fullgraph=True, options={"freezing": True})
    return CachedRunner(model, features_cached("tierspec's forward under torch.compile(fullgraph=True)"))


def example_inputs(k: int, kv_dtype=torch.float32) -> tuple:
    past_mask = torch.zeros(k, CAPACITY)
    past_mask[:, CONTEXT:] = float("-inf")
    new_mask = torch.zeros(k, k).masked_fill_(torch.ones(k, k, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.arange(k) * 7 + 11, torch.arange(CONTEXT, CONTEXT + k), torch.zeros(30, 3, CAPACITY, 64, dtype=kv_dtype),
            torch.zeros(30, 3, CAPACITY, 64, dtype=kv_dtype), past_mask, new_mask)


def build_aoti(cache: Path):
    """One AOTInductor package per pass width, built once into ``cache`` (freezing on), loaded with
    ``aoti_load_package``; a second process only loads."""
    import torch._inductor

    folder = cache / "aoti"
    folder.mkdir(parents=True, exist_ok=True)
    lm = static_source("bfloat16")
    head = bf16_head(lm)
    module = None
    loaded, timings = {}, {}
    for k in WIDTHS:
        path = folder / f"pass_k{k}.pt2"
        if not path.exists():
            if module is None:
                module = StaticPass(lm).eval()
            started = time.perf_counter()
            with torch.no_grad():
                program = torch.export.export(module, example_inputs(k), strict=False)
                torch._inductor.aoti_compile_and_package(program, package_path=str(path),
                                                         inductor_configs={"freezing": True})
            timings[f"package_k{k}_s"] = time.perf_counter() - started
        timings[f"package_k{k}_mb"] = path.stat().st_size / 1e6
        started = time.perf_counter()
        loaded[k] = torch._inductor.aoti_load_package(str(path))
        timings[f"load_k{k}_s"] = time.perf_counter() - started

    def call(ids, positions, keys, values, past_mask, new_mask):
        return loaded[int(ids.shape[0])](ids, positions, keys, values, past_mask, new_mask)

    runner = StaticRunner(call, head, features_static("StaticPass exported (torch.export) and packaged by AOTInductor "
                                                      "(freezing), one package per pass width; bfloat16 head outside"))
    runner.build_info = timings
    return runner


def build_openvino(variant: str):
    # the KV buffer in bfloat16 where the plugin computes in bfloat16 (it would convert a float32
    # cache input to bfloat16 in every pass: measured 14.3 ms a k=1 pass with a float32 buffer)
    kv_dtype = torch.float32 if variant == "f32" else torch.bfloat16

    def build(cache: Path):
        import numpy as np
        import openvino as ov

        folder = cache / "ov"
        folder.mkdir(parents=True, exist_ok=True)
        xml = folder / "pass.xml"
        timings = {}
        core = ov.Core()
        if not xml.exists():
            started = time.perf_counter()
            lm = static_source("float32")
            module = StaticPass(lm, head=lm.lm_head).eval()
            inputs = [ov.PartialShape([-1]), ov.PartialShape([-1]), ov.PartialShape([30, 3, CAPACITY, 64]),
                      ov.PartialShape([30, 3, CAPACITY, 64]), ov.PartialShape([-1, CAPACITY]), ov.PartialShape([-1, -1])]
            kv_type = ov.Type.f32 if kv_dtype == torch.float32 else ov.Type.bf16
            types = [ov.Type.i64, ov.Type.i64, kv_type, kv_type, ov.Type.f32, ov.Type.f32]
            with torch.no_grad():
                model = ov.convert_model(module, example_input=example_inputs(4, kv_dtype), input=list(zip(inputs, types)))
            timings["convert_s"] = time.perf_counter() - started
            del module, lm
            if variant in ("int8", "int4"):
                import nncf

                started = time.perf_counter()
                if variant == "int8":
                    model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)
                else:
                    model = nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT4_ASYM, group_size=32, ratio=1.0)
                timings["compress_s"] = time.perf_counter() - started
            started = time.perf_counter()
            ov.save_model(model, str(xml), compress_to_fp16=False)
            timings["save_s"] = time.perf_counter() - started
        started = time.perf_counter()
        model = core.read_model(str(xml))
        timings["read_s"] = time.perf_counter() - started
        config = {"INFERENCE_NUM_THREADS": torch.get_num_threads(), "CACHE_DIR": str(folder / "blobs"),
                  "PERFORMANCE_HINT": "LATENCY",
                  "INFERENCE_PRECISION_HINT": "f32" if variant == "f32" else "bf16"}
        started = time.perf_counter()
        compiled = core.compile_model(model, "CPU", config)
        timings["compile_s"] = time.perf_counter() - started
        request = compiled.create_infer_request()

        bound = {}

        def call(ids, positions, keys, values, past_mask, new_mask):
            # the cache buffers are bound once (OpenVINO tensors over the same memory); each pass
            # passes only its ids, positions and masks
            if bound.get("buffers") != (keys.data_ptr(), values.data_ptr()):
                for index, buffer in ((2, keys), (3, values)):
                    array = buffer.numpy() if buffer.dtype == torch.float32 else buffer.view(torch.int16).numpy()
                    tensor = ov.Tensor(array, ov.Shape(list(buffer.shape)),
                                       ov.Type.f32 if buffer.dtype == torch.float32 else ov.Type.bf16)
                    request.set_input_tensor(index, tensor)
                    bound[index] = (tensor, array)
                bound["buffers"] = (keys.data_ptr(), values.data_ptr())
            results = request.infer({0: ids.numpy(), 1: positions.numpy(), 4: np.ascontiguousarray(past_mask.numpy()),
                                     5: np.ascontiguousarray(new_mask.numpy())}, share_inputs=True, share_outputs=True)
            # logits and hidden states copied (the request's output buffers are reused by the next
            # pass); the new keys/values are written into the cache by the caller right away
            return (torch.from_numpy(np.array(results[0])), torch.from_numpy(np.array(results[1])),
                    torch.from_numpy(np.asarray(results[2])), torch.from_numpy(np.asarray(results[3])))

        precision = str(compiled.get_property("INFERENCE_PRECISION_HINT")).replace("<Type: ", "").strip(">'")
        timings["ir_mb"] = (xml.with_suffix(".bin")).stat().st_size / 1e6
        try:  # OpenVINO's CPU plugin may quantise activations of compressed-weight layers on the fly
            timings["dynamic_quantization_group_size"] = int(compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE"))
        except (RuntimeError, TypeError, ValueError):
            pass
        note = {"f32": "float32 weights and activations", "bf16": "bfloat16 weights and activations",
                "int8": "nncf INT8_ASYM weights (per channel), bfloat16 activations",
                "int4": "nncf INT4_ASYM weights (group 32, ratio 1; nncf's default keeps the embedding/head int8), "
                        "bfloat16 activations"}[variant]
        runner = StaticRunner(call, None, features_static(
            f"StaticPass (float32 de-quantised weights, head inside) via openvino.convert_model, one model for every "
            f"pass width (dynamic k); {note}; plugin precision {precision}; KV buffer {str(kv_dtype)[6:]}"),
            kv_dtype=kv_dtype)
        runner.build_info = timings
        return runner

    return build


CANDIDATES = {
    "engine": build_engine,
    "engine-f32": build_engine_f32,
    "packed-bf16": build_packed,
    "int4pack": build_pack("int4"),
    "int8pack": build_pack("int8"),
    "inductor-asis": build_asis,
    "inductor": build_inductor("inductor"),
    "inductor-freeze": build_inductor("freeze"),
    "inductor-freeze-cpp": build_inductor("freeze-cpp"),
    "inductor-freeze-dynamic": build_inductor("freeze-dynamic"),
    "inductor-freeze-int4": build_inductor("freeze-int4"),
    "inductor-freeze-autotune": build_inductor("freeze-autotune"),
    "aoti": build_aoti,
    "ov-f32": build_openvino("f32"),
    "ov-bf16": build_openvino("bf16"),
    "ov-int8": build_openvino("int8"),
    "ov-int4": build_openvino("int4"),
}
LABELS = {
    "engine": "tierspec engine (default: Q4_1/Q8_0 blocks)",
    "engine-f32": "tierspec engine, dtype=float32 (float32 rows)",
    "packed-bf16": "previous default: bfloat16 oneDNN-packed, float32 head",
    "int4pack": "torch int4 pack (g32) on tierspec's forward",
    "int8pack": "torch int8 pack (per channel) on tierspec's forward",
    "inductor-asis": "torch.compile of tierspec's forward as is",
    "inductor": "inductor, defaults (StaticPass)",
    "inductor-freeze": "inductor, freezing",
    "inductor-freeze-cpp": "inductor, freezing + cpp_wrapper",
    "inductor-freeze-dynamic": "inductor, freezing, dynamic=True",
    "inductor-freeze-int4": "inductor, freezing, int4-pack layers",
    "inductor-freeze-autotune": "inductor, freezing + max-autotune",
    "aoti": "AOTInductor packages (freezing)",
    "ov-f32": "OpenVINO CPU, f32",
    "ov-bf16": "OpenVINO CPU, bf16",
    "ov-int8": "OpenVINO CPU, nncf int8 weights",
    "ov-int4": "OpenVINO CPU, nncf int4 weights (g32)",
    "llamacpp": "llama.cpp passes, same file (reference)",
}
TIMEOUTS = {"inductor-freeze-autotune": 3600}  # seconds for a first (cold) process; others DEFAULT_TIMEOUT
DEFAULT_TIMEOUT = 1500


# ---- child: start-up, exactness, features -------------------------------------------------------

def ready(runner, ids: torch.Tensor) -> dict:
    """Prefill CONTEXT tokens, then one pass of every width (rolled back): seconds of each."""
    times = {}
    started = time.perf_counter()
    with torch.inference_mode():
        runner.prefill(ids[:CONTEXT])
        times["prefill_s"] = time.perf_counter() - started
        for k in WIDTHS:
            started = time.perf_counter()
            runner.forward(ids[CONTEXT : CONTEXT + k])
            times[f"first_k{k}_s"] = time.perf_counter() - started
            runner.rollback(CONTEXT)
    return times


def exactness(runner, ids: torch.Tensor, reference: torch.Tensor) -> dict:
    """Row dependence across pass widths and the difference from the float32 reference."""
    probe = ids[CONTEXT:]
    with torch.inference_mode():
        solo = []
        for j in range(PROBE):
            solo.append(runner.forward(probe[j : j + 1]))
        solo = torch.cat(solo)
        runner.rollback(CONTEXT)
        by_width = {}
        for k in WIDTHS[1:]:
            parts = []
            for start in range(0, PROBE, k):
                parts.append(runner.forward(probe[start : start + k]))
            runner.rollback(CONTEXT)
            by_width[k] = torch.cat(parts)
    widths = {str(k): float((logits - solo).abs().max()) for k, logits in by_width.items()}
    diff = (solo - reference).abs()
    return {"row_dependence_max": max(widths.values()), "row_dependence_by_width": widths,
            "bitwise_across_widths": all(torch.equal(logits, solo) for logits in by_width.values()),
            "ref_max_abs": float(diff.max()), "ref_mean_abs": float(diff.mean()),
            "ref_argmax_agree": int((solo.argmax(-1) == reference.argmax(-1)).sum()), "probe": PROBE,
            "ref_logit_scale": float(reference.abs().max())}


def feature_tests(runner, ids: torch.Tensor) -> dict:
    """Run each feature the candidate offers; record what happened (one line each)."""
    from tierspec.tree import TokenTree, tree_pass

    probe = ids[CONTEXT:]
    out = {}
    with torch.inference_mode():
        chain = runner.forward(probe[:4])
        runner.rollback(CONTEXT)
        # rollback: the same pass after a rollback, and after a longer pass rolled back
        runner.forward(probe[:8])
        runner.rollback(CONTEXT)
        again = runner.forward(probe[:4])
        runner.rollback(CONTEXT)
        out["rollback"] = "ok: bitwise" if torch.equal(chain, again) else f"DIFFERS: {float((chain - again).abs().max()):.3g}"
        # tree: pending probe[0]; nodes X, probe[1], Y(X), probe[2], probe[3] (the real path interleaved), padded to 8
        try:
            x, y = int(probe[5]), int(probe[6])
            tree = TokenTree(torch.tensor([x, int(probe[1]), y, int(probe[2]), int(probe[3])]),
                             torch.tensor([-1, -1, 0, 1, 3]))
            layout = tree_pass(probe[:1], tree, padding=2)
            logits = runner.tree_forward(layout.tokens, layout.offsets, layout.attends)
            runner.rollback(CONTEXT)
            path = logits[[0, 2, 4, 5]]
            gap = float((path - chain).abs().max())
            out["tree"] = "ok: bitwise equal to the chain pass" if gap == 0 else f"ok: path vs chain max |diff| {gap:.3g}"
        except Exception as error:  # noqa: BLE001 - record, don't stop
            runner.rollback(CONTEXT)
            out["tree"] = f"FAILED: {one_line(error)}"
        try:
            logits, hidden = runner.hidden_forward(probe[:4])
            runner.rollback(CONTEXT)
            out["hidden"] = f"ok: final hidden states {list(hidden.shape)}" + \
                ("" if torch.equal(logits, chain) else f" (logits vs plain pass {float((logits - chain).abs().max()):.3g})")
        except Exception as error:  # noqa: BLE001
            runner.rollback(CONTEXT)
            out["hidden"] = f"FAILED: {one_line(error)}"
        if hasattr(runner, "masked_forward"):
            from tierspec.layerskip.masks import RoutingMask

            try:
                mask = RoutingMask(num_layers=30, unit="sublayer", skip_attention=frozenset({7}), skip_mlp=frozenset({12}))
                masked = runner.masked_forward(probe[:4], mask)
                runner.rollback(CONTEXT)
                after = runner.forward(probe[:4])
                runner.rollback(CONTEXT)
                out["routing"] = (f"ok: masked pass differs from the full one by {float((masked - chain).abs().max()):.3g}; "
                                  f"the full pass after it {'bitwise as before' if torch.equal(after, chain) else 'CHANGED'}")
            except Exception as error:  # noqa: BLE001
                runner.rollback(CONTEXT)
                out["routing"] = f"FAILED: {one_line(error)}"
    return out


def child_prepare(name: str, cache: Path, phase: str, spawned: float) -> dict:
    result = {"phase": phase}
    imported = time.time()
    result["python_start_s"] = imported - spawned
    started = time.perf_counter()
    runner = CANDIDATES[name](cache)
    result["build_s"] = time.perf_counter() - started
    result["build_info"] = getattr(runner, "build_info", {})
    ids = torch.load(WORK / "reference.pt")["ids"]
    result.update(ready(runner, ids))
    result["startup_s"] = time.time() - spawned
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["features_declared"] = runner.features
    if phase == "second":
        reference = torch.load(WORK / "reference.pt")["logits"]
        result["exactness"] = exactness(runner, ids, reference)
        result["features_tested"] = feature_tests(runner, ids)
    return result


def child_reference() -> dict:
    """The float32 reference: transformers' LlamaForCausalLM on the de-quantised float32 weights."""
    from tierspec.models import load_model

    ids = probe_ids()
    loaded = load_model("smollm2-135m", dtype="float32", kernels="stock", implementation="transformers")
    with torch.inference_mode():
        logits = loaded.model(input_ids=ids.unsqueeze(0)).logits[0, CONTEXT:].float()
    WORK.mkdir(parents=True, exist_ok=True)
    torch.save({"ids": ids, "logits": logits}, WORK / "reference.pt")
    return {"model": type(loaded.model).__name__, "ids": len(ids)}


def child_genai() -> dict:
    """OpenVINO GenAI's end-to-end greedy generation on the GGUF (a reference, not a pass)."""
    import numpy as np
    import openvino
    import openvino_genai

    from tierspec.models import default_model_file

    ids = torch.load(WORK / "reference.pt")["ids"][:CONTEXT]
    started = time.perf_counter()
    pipeline = openvino_genai.LLMPipeline(str(default_model_file()), "CPU", INFERENCE_NUM_THREADS=torch.get_num_threads())
    load_s = time.perf_counter() - started
    array = np.asarray([ids.tolist()], dtype=np.int64)
    inputs = openvino_genai.TokenizedInputs(openvino.Tensor(array), openvino.Tensor(np.ones_like(array)))
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens, config.do_sample, config.min_new_tokens = 128, False, 128
    pipeline.generate(inputs, config)  # warm-up
    runs = []
    for _ in range(3):
        started = time.perf_counter()
        result = pipeline.generate(inputs, config)
        seconds = time.perf_counter() - started
        runs.append({"tokens": len(result.tokens[0]), "seconds": seconds})
    tps = [run["tokens"] / run["seconds"] for run in runs]
    return {"load_s": load_s, "runs": runs, "tokens_per_s_median": statistics.median(tps),
            "prompt_tokens": CONTEXT, "version": openvino_genai.__version__}


# ---- child: interleaved pass timings ------------------------------------------------------------

def time_widths(runner, tokens: dict, repeats: int = 3) -> dict[int, float]:
    out = {}
    for k in WIDTHS:
        samples = []
        for i in range(repeats + 1):
            started = time.perf_counter()
            runner.forward(tokens[k])
            elapsed = time.perf_counter() - started
            runner.rollback(CONTEXT)
            if i:
                samples.append(elapsed)
        out[k] = statistics.median(samples)
    return out


class LlamaCppRunner:
    def __init__(self):
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from pass_cost import LlamaCppPasses

        self.passes = LlamaCppPasses(CONTEXT)


def child_time(names: list[str], rounds: int, cache_root: Path) -> dict:
    runners = {}
    failures = {}
    ids = torch.load(WORK / "reference.pt")["ids"]
    for name in names:
        log(f"  timing child: building {name}")
        try:
            if name == "llamacpp":
                runners[name] = LlamaCppRunner()
                continue
            # each candidate's own compiler cache (inductor reads the variable when it looks a graph up)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root / name / "inductor")
            started = time.perf_counter()
            runner = CANDIDATES[name](cache_root / name)
            ready(runner, ids)
            log(f"  timing child: {name} ready in {time.perf_counter() - started:.1f} s")
            runners[name] = runner
        except Exception as error:  # noqa: BLE001
            failures[name] = one_line(error)
            log(f"  timing child: {name} failed: {failures[name]}")
    tokens = {k: (torch.arange(k) * 7 + 11) % 49152 for k in WIDTHS}
    samples = {name: {k: [] for k in WIDTHS} for name in runners}
    load = [os.getloadavg()]
    with torch.inference_mode():
        for index in range(rounds):
            for name, runner in runners.items():
                if name == "llamacpp":
                    times = runner.passes.time_passes(WIDTHS)
                else:
                    times = time_widths(runner, tokens)
                for k, seconds in times.items():
                    samples[name][k].append(seconds)
            load.append(os.getloadavg())
            log(f"  timing round {index + 1}/{rounds} (load {load[-1][0]:.2f})")
    return {"samples_s": {name: {str(k): v for k, v in per.items()} for name, per in samples.items()},
            "median_ms": {name: {str(k): 1e3 * statistics.median(v) for k, v in per.items()} for name, per in samples.items()},
            "failures": failures, "loadavg": load, "rounds": rounds, "threads": torch.get_num_threads()}


# ---- driver -----------------------------------------------------------------------------------------

def run_child(arguments: list[str], env_extra: dict, timeout: int) -> dict:
    env = dict(os.environ, **env_extra, EC_SPAWNED=repr(time.time()))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    result_file = WORK / f"child-{os.getpid()}.json"
    result_file.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--child", *arguments, "--result", str(result_file)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if result_file.exists():
        result = json.loads(result_file.read_text())
        result_file.unlink()
        return result
    tail = [line for line in (done.stderr or "").splitlines() if line.strip()]
    return {"error": f"child exited {done.returncode}: {tail[-1] if tail else 'no output'}"[:400]}


def candidate_env(name: str, cache: Path, tierspec_cache: Path) -> dict:
    return {"TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TIERSPEC_CACHE": str(tierspec_cache)}


def prepare(name: str, raw: dict) -> None:
    cache = WORK / "cache" / name
    shutil.rmtree(cache, ignore_errors=True)
    fresh_tierspec = WORK / "tierspec-cache-fresh" / name
    shutil.rmtree(fresh_tierspec, ignore_errors=True)
    log(f"{name}: first process (no caches)")
    first = run_child(["prepare", name, "--phase", "first", "--cache", str(cache)],
                      candidate_env(name, cache, fresh_tierspec), TIMEOUTS.get(name, DEFAULT_TIMEOUT))
    entry = {"first": first}
    if "error" not in first:
        log(f"{name}: first {first['startup_s']:.1f} s; second process (cached)")
        second = run_child(["prepare", name, "--phase", "second", "--cache", str(cache)],
                           candidate_env(name, cache, fresh_tierspec), DEFAULT_TIMEOUT)
        entry["second"] = second
        log(f"{name}: second {second.get('startup_s', float('nan')):.1f} s {second.get('error', '')}")
    else:
        log(f"{name}: FAILED {first['error']}")
    shutil.rmtree(fresh_tierspec, ignore_errors=True)
    raw.setdefault("prepare", {})[name] = entry
    save_raw(raw)


def working(raw: dict, names: list[str]) -> list[str]:
    good = []
    for name in names:
        entry = raw.get("prepare", {}).get(name, {})
        if "error" not in entry.get("first", {"error": 1}) and "error" not in entry.get("second", {"error": 1}):
            good.append(name)
    return good


def fmt(value, digits=1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def summary(raw: dict) -> str:
    timing = raw.get("timing", {})
    medians = timing.get("median_ms", {})
    prepared = raw.get("prepare", {})
    names = [name for name in list(CANDIDATES) + ["llamacpp"] if name in prepared or name in medians]
    lines = ["## Pass engines measured", "",
             f"`{raw.get('command', 'python benchmarks/engine_candidates.py')}` at commit {raw.get('commit', '?')}; "
             f"{timing.get('threads', '?')} threads; cached pass of k new tokens at a {CONTEXT}-token context, logits for "
             f"every new token, ms, median of {timing.get('rounds', '?')} rounds interleaved in one process (3 passes each "
             f"after a warm-up). Load average (1 min) during the timing: "
             + (f"{min(l[0] for l in timing['loadavg']):.2f}–{max(l[0] for l in timing['loadavg']):.2f}"
                if timing.get("loadavg") else "?") + f"; before/after the whole run: {raw.get('load_before', '?')} / "
             f"{raw.get('load_after', '?')}.", "",
             "| candidate | k=1 | 2 | 4 | 8 | 16 | 16/1 | start-up first s | cached s | peak RSS MiB | row dependence (max \\|Δlogit\\| "
             "across widths) | vs float32 ref: max / mean \\|Δ\\|, argmax agree |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in names:
        entry = prepared.get(name, {})
        first, second = entry.get("first", {}), entry.get("second", {})
        row = medians.get(name)
        cells = [fmt(row.get(str(k))) if row else "—" for k in WIDTHS]
        ratio = fmt(row["16"] / row["1"], 2) if row else "—"
        if name == "llamacpp":
            lines.append(f"| {LABELS[name]} | {' | '.join(cells)} | {ratio} | — | — | — | — | — |")
            continue
        if "error" in first or "error" in second:
            error = first.get("error") or second.get("error")
            lines.append(f"| {LABELS.get(name, name)} | failed: {error} | | | | | | | | | | |")
            continue
        exact = second.get("exactness", {})
        dependence = ("0 (bitwise)" if exact.get("bitwise_across_widths") else f"{exact.get('row_dependence_max', float('nan')):.3g}") \
            if exact else "—"
        reference = (f"{exact['ref_max_abs']:.3g} / {exact['ref_mean_abs']:.3g}, {exact['ref_argmax_agree']}/{exact['probe']}"
                     if exact else "—")
        lines.append(f"| {LABELS.get(name, name)} | {' | '.join(cells)} | {ratio} | {fmt(first.get('startup_s'))} | "
                     f"{fmt(second.get('startup_s'))} | {fmt(second.get('peak_rss_mib'), 0)} | {dependence} | {reference} |")
    lines += ["", "Features (tested where the candidate offers them; otherwise why not):", "",
              "| candidate | KV rollback | hidden states | routing masks | token trees |", "|---|---|---|---|---|"]
    for name in names:
        second = prepared.get(name, {}).get("second", {})
        if name == "llamacpp" or "features_declared" not in second:
            continue
        declared, tested = second["features_declared"], second.get("features_tested", {})
        cells = []
        for feature in FEATURES:
            result = tested.get(feature)
            cells.append(f"{result} ({declared[feature]})" if result and not declared[feature].startswith("tested")
                         else (result or declared[feature]))
        lines.append(f"| {LABELS.get(name, name)} | {' | '.join(c.replace('|', '/') for c in cells)} |")
    lines += ["", "Start-up phases (seconds; first / cached process):", ""]
    for name in names:
        entry = prepared.get(name, {})
        if name == "llamacpp" or "error" in entry.get("first", {"error": 1}):
            continue
        parts = []
        for phase in ("first", "second"):
            data = entry.get(phase, {})
            if "build_s" not in data:
                continue
            firsts = "/".join(f"{data.get(f'first_k{k}_s', 0):.2f}" for k in WIDTHS)
            info = ", ".join(f"{key} {value:.1f}" for key, value in data.get("build_info", {}).items())
            parts.append(f"{phase}: python {data['python_start_s']:.1f}, build {data['build_s']:.1f}"
                         + (f" ({info})" if info else "") + f", prefill {data['prefill_s']:.1f}, first pass k=1/2/4/8/16 {firsts}")
        note = entry.get("second", {}).get("features_declared", {}).get("note", "")
        lines.append(f"- **{LABELS.get(name, name)}** ({note}): " + "; ".join(parts))
    failures = {name: entry["first"].get("error") or entry.get("second", {}).get("error")
                for name, entry in prepared.items()
                if "error" in entry.get("first", {}) or "error" in entry.get("second", {})}
    failures.update({name: f"timing process: {error}" for name, error in timing.get("failures", {}).items()})
    if failures:
        lines += ["", "Failures (one line each, as raised):", ""]
        lines += [f"- `{name}`: {error}" for name, error in failures.items()]
    genai = raw.get("ovgenai")
    if genai:
        if "error" in genai:
            lines += ["", f"OpenVINO GenAI greedy on the GGUF: failed: {genai['error']}"]
        else:
            lines += ["", f"OpenVINO GenAI {genai['version']} greedy on the GGUF (reference, end to end): "
                          f"{genai['tokens_per_s_median']:.1f} tok/s (128 new tokens after a {genai['prompt_tokens']}-token "
                          f"prompt, prefill included, median of 3; pipeline load {genai['load_s']:.1f} s)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="comma-separated candidates (default: all)")
    parser.add_argument("--redo", default="", help="comma-separated candidates to prepare again ('all')")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--summary-only", action="store_true")
    parser.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--phase", default="first", help=argparse.SUPPRESS)
    parser.add_argument("--cache", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        spawned = float(os.environ.get("EC_SPAWNED", time.time()))
        what = args.child[0]
        try:
            if what == "prepare":
                result = child_prepare(args.child[1], args.cache, args.phase, spawned)
            elif what == "reference":
                result = child_reference()
            elif what == "genai":
                result = child_genai()
            elif what == "time":
                result = child_time(args.child[1:], args.rounds, WORK / "cache")
            else:
                raise SystemExit(f"unknown child {what}")
        except Exception as error:  # noqa: BLE001 - the driver records it
            traceback.print_exc()
            result = {"error": one_line(error)}
        args.result.write_text(json.dumps(result))
        return

    raw = load_raw()
    if args.summary_only:
        (OUT / "summary.md").write_text(summary(raw))
        print(summary(raw))
        return
    names = args.only.split(",") if args.only else list(CANDIDATES)
    unknown = [n for n in names if n not in CANDIDATES and n != "llamacpp"]
    if unknown:
        raise SystemExit(f"unknown candidates {unknown}; known: {', '.join(CANDIDATES)}")
    redo = set(names if args.redo == "all" else filter(None, args.redo.split(",")))
    raw["command"] = "python " + " ".join([str(Path(sys.argv[0]).relative_to(ROOT)) if Path(sys.argv[0]).is_absolute()
                                           else sys.argv[0]] + sys.argv[1:])
    raw["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                   text=True).stdout.strip()
    raw["load_before"] = open("/proc/loadavg").read().split()[0]
    WORK.mkdir(parents=True, exist_ok=True)
    if not (WORK / "reference.pt").exists():
        log("float32 reference (transformers)")
        reference = run_child(["reference"], {}, DEFAULT_TIMEOUT)
        if "error" in reference:
            raise SystemExit(f"the reference failed: {reference['error']}")
        raw["reference"] = reference
    save_raw(raw)
    # the slowest compile last: the others' numbers are in raw.json before it starts
    for name in sorted(names, key=lambda n: n == "inductor-freeze-autotune"):
        if name == "llamacpp":
            continue
        if name in raw.get("prepare", {}) and name not in redo:
            log(f"{name}: prepared before (--redo {name} to measure again)")
            continue
        prepare(name, raw)
    if "ovgenai" not in raw or "ovgenai" in redo:
        log("OpenVINO GenAI greedy reference")
        raw["ovgenai"] = run_child(["genai"], {}, DEFAULT_TIMEOUT)
        save_raw(raw)
    if not args.skip_timing:
        timed = working(raw, names) + ["llamacpp"]
        log(f"interleaved timing of {', '.join(timed)}")
        result = run_child(["time", *timed, "--rounds", str(args.rounds)], {}, 4 * DEFAULT_TIMEOUT)
        if "error" in result:
            log(f"timing failed: {result['error']}")
        else:
            raw["timing"] = result
    raw["load_after"] = open("/proc/loadavg").read().split()[0]
    save_raw(raw)
    (OUT / "summary.md").write_text(summary(raw))
    log(f"wrote {OUT / 'summary.md'}")


if __name__ == "__main__":
    main()
