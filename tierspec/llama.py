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

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import torch
import torch.nn.functional as F

from . import engine  # its functions read at the call: a test may wrap them


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

# A token's attention must come out the same whatever pass it is computed in (alone in plain
# decoding, or among the drafted tokens of a verification pass): then a lossless method's greedy
# text is exactly plain decoding's. torch's CPU attention kernel (scaled_dot_product_attention)
# walks the keys in blocks of 512 and its arithmetic depends on the block's length, on the number
# of queries in the call, and (float32) on how the call is split across threads. So a cached pass
# computes attention in float32 with fixed shapes: the keys padded to whole blocks of KEY_BLOCK
# slots (the slots past each token masked out) and the queries in calls of ATTENTION_ROWS (the
# last call padded with copies). Measured per layer at 512 keys (2 cores): 47 / 70 / 77 / 110 /
# 247 µs for 1 / 2 / 4 / 8 / 16 queries per call; four per call keeps plain decoding cheap and a
# 16-token pass at four calls. Tested bitwise: a token alone and inside 2-16-token passes.
KEY_BLOCK = 512
ATTENTION_ROWS = 4


class KVLayer:
    """One layer's keys and values [b, kv_heads, T, d] in a position-indexed buffer: a pass writes
    its new positions in place, a rollback only moves ``length`` (nothing is copied or freed).
    The target's layers (``KVCache``), the draft head's layer (``heads.draft.HeadRunner``) and
    transformers models' layers (``cached_model.CachedModel``) all keep their KV in it.

    The buffer holds ``reserve``'s positions (the decode loop reserves prompt + budget), allocated
    at the first write when the shapes are known, in whole ``KEY_BLOCK``s. A write past it (a
    cache nobody reserved, or a longer generation) reallocates it to the positions now needed,
    rounded up to a whole block: at most once per ``KEY_BLOCK`` positions, no doubling."""

    #: buffers allocated by every layer so far: while it has not moved, no layer's buffers have changed
    allocations = 0

    def __init__(self):
        self.length = 0
        self.reserved = 0
        self._keys = self._values = None
        self._finite = 0  # slots 0 .. _finite − 1 hold written entries or zeros; later ones anything
        self.keys = self.values = None

    @classmethod
    def for_cache(cls, count: int) -> list["KVLayer"]:
        """``count`` fresh layers for one ``KVCache``."""
        return [cls() for _ in range(count)]

    @property
    def capacity(self) -> int:
        """Positions the buffer holds now (0 before the first write)."""
        return 0 if self._keys is None else int(self._keys.shape[-2])

    def reserve(self, positions: int) -> None:
        """Hold at least ``positions`` positions without reallocating (allocated at the first
        write, when the shapes are known, or now if they are)."""
        self.reserved = max(self.reserved, positions)
        if self._keys is not None and self.capacity < positions:
            self._allocate(positions, self._keys, self._values)

    def _allocate(self, needed: int, like_keys: torch.Tensor, like_values: torch.Tensor) -> None:
        """A buffer of max(needed, reserved) positions rounded up to whole blocks, holding the
        ``length`` positions of the old one; the slots after them are left as the allocator gave
        them. Why not zero-filled: the pass engine reads only slots its rows see (written ones),
        and zeroing touched every page of a generation's 60 buffers when they were made (0.2–0.35
        ms a buffer in a batch's profile, fresh pages from the OS) where a generation writes only
        the slots it reaches, a page when a pass first writes it; a buffer the allocator hands
        back from a finished generation needs no writing at all. torch's attention, which reads
        whole key blocks with the slots past ``length`` masked out (a masked key must be finite,
        or 0 · value would not be 0), gets them zeroed as it reaches them (``window``)."""
        capacity = -(-max(needed, self.reserved) // KEY_BLOCK) * KEY_BLOCK
        KVLayer.allocations += 1  # an engine table naming the old buffers is stale now (``KVCache.engine_table``)
        keys = like_keys.new_empty(*like_keys.shape[:-2], capacity, like_keys.shape[-1])
        values = like_values.new_empty(*like_values.shape[:-2], capacity, like_values.shape[-1])
        if self.length:
            keys[..., : self.length, :] = self._keys[..., : self.length, :]
            values[..., : self.length, :] = self._values[..., : self.length, :]
        self._keys, self._values = keys, values
        self._finite = self.length

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write keys/values [b, kv_heads, n, d] at positions ``length ..``; return every cached
        position's [b, kv_heads, length + n, d] (views of the buffer)."""
        end = self.length + keys.shape[-2]
        if end > self.capacity:
            self._allocate(end, keys, values)
        self._keys[..., self.length : end, :] = keys
        self._values[..., self.length : end, :] = values
        self.length = end
        self._finite = max(self._finite, end)
        self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]
        return self.keys, self.values

    def window(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots 0 .. positions − 1 [b, kv_heads, positions, d], which may
        reach past ``length`` into slots that hold zeros or rolled-back entries (the caller masks
        them): slots never written are zeroed here, the first time a window reaches them."""
        if self.capacity < positions:
            self._allocate(positions, self._keys, self._values)
        if positions > self._finite:
            self._keys[..., self._finite : positions, :] = 0
            self._values[..., self._finite : positions, :] = 0
            self._finite = positions
        return self._keys[..., :positions, :], self._values[..., :positions, :]

    def get_seq_length(self) -> int:
        return self.length

    def slots(self, end: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value buffers [1, kv_heads, capacity, head_dim], holding at least
        ``end`` slots: the pass engine writes a pass's entries into them itself
        (``gguf_llama.FusedLayer``), then ``advance`` counts them. ``dtype`` (float32 or float16)
        is the buffers' when this call makes them; buffers already made keep theirs (the engine
        reads each cache's element size from its table, ``engine_row``)."""
        if self._keys is None:
            like = torch.zeros(1, kv_heads, 0, head_dim, dtype=dtype)
            self._allocate(end, like, like)
        elif self.capacity < end:
            self._allocate(end, self._keys, self._values)
        return self._keys, self._values

    def engine_row(self, end: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32) -> tuple[int, int, int, int]:
        """This layer's row of an engine KV table (``slots``' buffers): the key and value buffers'
        addresses, their capacity in slots and the bytes of one element (4: float32, 2: float16)."""
        keys, values = self.slots(end, kv_heads, head_dim, dtype)
        return keys.data_ptr(), values.data_ptr(), int(keys.shape[-2]), keys.element_size()

    def engine_table(self, end: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``engine_row`` as a one-layer engine KV table int64 [1, 4], made again only when the row
        changed (a step of the draft head's one layer reads it every call; a tensor made from Python
        is a few torch operators, cold after a target pass). Its content is the row, so a table
        kept is right whenever its row is."""
        row = self.engine_row(end, kv_heads, head_dim, dtype)
        held = self.__dict__.get("_row_table")
        if held is None or held[0] != row:
            held = self._row_table = (row, torch.tensor([row], dtype=torch.int64))
        return held[1]

    def advance(self, count: int) -> None:
        """Count ``count`` entries written after ``length`` into the buffers by the engine."""
        self.length += count
        self._finite = max(self._finite, self.length)
        self.keys, self.values = self._keys[..., : self.length, :], self._values[..., : self.length, :]

    def compact(self, start: int, slots: torch.Tensor) -> None:
        """Keep the positions at ``slots`` [L] (increasing, all in start .. length − 1) as
        positions start .. start + L − 1 and drop the rest after ``start``: a token tree's accepted
        path made contiguous (docs/algorithms.md §Token trees)."""
        count = int(slots.shape[0])
        if count:
            slots = slots.to(self._keys.device)
            self._keys[..., start : start + count, :] = self._keys[..., slots, :]  # the gather copies first
            self._values[..., start : start + count, :] = self._values[..., slots, :]
        self.length = start + count
        self.keys, self.values = self._keys[..., : self.length, :], self._values[..., : self.length, :]

    def trim(self, length: int) -> None:
        if length < self.length:
            self.length = length
            self.keys, self.values = self._keys[..., :length, :], self._values[..., :length, :]


def _shared_entry(name: str, doc: str) -> property:
    """A property reading and writing a layer's entry (``_index``) of the list its cache's layers share
    under attribute ``name`` (``ViewOnReadKVLayer``)."""

    def get(self) -> int:
        return self.__dict__[name][self._index]

    def put(self, value: int) -> None:
        self.__dict__[name][self._index] = value

    return property(get, put, doc=doc)


class ViewOnReadKVLayer(KVLayer):
    """A ``KVLayer`` of a model whose layers run on the pass engine. Its ``keys``/``values`` views of
    the first ``length`` positions are made when read, not after every write (the engine advances
    30 layers a pass, and two views a layer cost more than the rest of the bookkeeping; the
    assignments of ``KVLayer``'s own methods are ignored). Its ``length`` and written extent are
    entries of lists the cache's layers share (``for_cache``), so that a pass checks and advances,
    and a rollback trims, every layer of a sequence at once (``KVCache.check_start``, ``advance``,
    ``trim``) where a loop over 30 layers' methods ran twice a sequence a pass. Lists, not numpy
    arrays: right after a pass every cache holds the weights, and numpy's dispatch, cold, cost more
    than the interpreter's list operations it replaced."""

    keys = property(lambda self: None if self._keys is None else self._keys[..., : self.length, :],
                    lambda self, value: None)
    values = property(lambda self: None if self._values is None else self._values[..., : self.length, :],
                      lambda self, value: None)

    def __init__(self, lengths: list[int] | None = None, written: list[int] | None = None, index: int = 0):
        """``lengths`` and ``written`` shared by the cache's layers (``for_cache``), this layer's
        entries at ``index``; a layer of its own without them."""
        self._lengths = [0] if lengths is None else lengths
        self._written = [0] if written is None else written
        self._index = index
        super().__init__()

    @classmethod
    def for_cache(cls, count: int) -> list["ViewOnReadKVLayer"]:
        lengths, written = [0] * count, [0] * count
        return [cls(lengths, written, index) for index in range(count)]

    length = _shared_entry("_lengths", "positions the layer holds")
    _finite = _shared_entry("_written", "slots 0 .. _finite − 1 hold written entries or zeros")

    def advance(self, count: int) -> None:
        length = self.length + count
        self.length = length
        if length > self._finite:
            self._finite = length

    def trim(self, length: int) -> None:
        # only the length: the views are made when read (30 layers' two views cost 0.3 ms a rollback)
        if length < self.length:
            self.length = length


class KVCache:
    """The KV of every decoder layer; layers a routing mask bypassed may hold fewer positions.

    Layers that share their lengths (``ViewOnReadKVLayer.for_cache``: a model on the pass engine)
    are checked, advanced and trimmed together by ``check_start``, ``advance`` and ``trim``; other
    layers one by one."""

    def __init__(self, num_layers: int, layer_class: type = KVLayer):
        self.layers = layer_class.for_cache(num_layers)
        self._table: tuple | None = None  # engine_table's last answer: (allocations, buffers, capacity, table)
        # every layer's length and written extent, when ``for_cache`` made the layers share them (None: one by one)
        shared = getattr(self.layers[0], "_lengths", None) if self.layers else None
        self._lengths: list[int] | None = shared if shared is not None and len(shared) == num_layers else None
        self._written: list[int] | None = None if self._lengths is None else self.layers[0]._written

    def get_seq_length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def reserve(self, positions: int) -> None:
        for layer in self.layers:
            layer.reserve(positions)

    def check_start(self, start: int, attending: list[int] | None = None) -> None:
        """Raise unless every layer (``attending``: these layers) holds exactly ``start`` positions:
        the rollback invariant a pass from ``start`` needs."""
        lengths = self._lengths
        if lengths is not None and attending is None:
            if lengths.count(start) == len(lengths):
                return
        for index in range(len(self.layers)) if attending is None else attending:
            held = self.layers[index].length
            if held != start:
                raise RuntimeError(f"layer {index}'s cache holds {held} positions, the pass starts at {start}: "
                                   "the caller broke the rollback invariant")

    def advance(self, count: int, attending: list[int] | None = None) -> None:
        """Count ``count`` entries the engine wrote after each layer's length (``attending``: only in
        these layers)."""
        lengths, written = self._lengths, self._written
        if lengths is None or attending is not None:
            for index in range(len(self.layers)) if attending is None else attending:
                self.layers[index].advance(count)
            return
        lengths[:] = [length + count for length in lengths]
        written[:] = map(max, written, lengths)

    def trim(self, length: int) -> None:
        """Every layer holding more than ``length`` positions cut to ``length``."""
        lengths = self._lengths
        if lengths is not None:
            lengths[:] = [held if held < length else length for held in lengths]
            return
        for layer in self.layers:
            layer.trim(length)

    def engine_table(self, end: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """int64 [L, 4]: every layer's ``KVLayer.engine_row`` (its buffers' addresses, capacity and
        element size), each buffer holding at least ``end`` slots, made in ``dtype`` where new:
        what the pass engine's whole-stack call reads. Rebuilt only when a buffer was reallocated
        or is too small: while no layer anywhere has allocated since it was made
        (``KVLayer.allocations``), one comparison says so; after an allocation, the buffers it names."""
        cached = self._table
        if cached is not None and cached[2] >= end and (cached[0] == KVLayer.allocations or all(
                layer._keys is buffer for layer, buffer in zip(self.layers, cached[1]))):
            if cached[0] != KVLayer.allocations:
                self._table = (KVLayer.allocations,) + cached[1:]
            return cached[3]
        rows = [layer.engine_row(end, kv_heads, head_dim, dtype) for layer in self.layers]
        table = torch.tensor(rows, dtype=torch.int64)
        self._table = (KVLayer.allocations, [layer._keys for layer in self.layers], min(row[2] for row in rows), table)
        return table


# ---- the modules ------------------------------------------------------------------------------------


class _Linear(torch.nn.Linear):
    """nn.Linear (the CPU kernels replace it like any other) left uninitialised: its weights
    are loaded right after construction, and random initialisation of 135M parameters (or of a
    meta tensor, which imports torch's compiler) would cost more than the load."""

    def reset_parameters(self) -> None:
        pass


class _Embedding(torch.nn.Embedding):
    def reset_parameters(self) -> None:
        pass


class RMSNorm(torch.nn.Module):
    """x / rms(x) · w over the residual stream (float32, or float64 for a float64 model), its
    output in ``output_dtype``: the dtype of the layer that reads it (bfloat16 projections
    read bfloat16 rows; the LM head reads float32)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps
        self.output_dtype: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return out if self.output_dtype is None or out.dtype == self.output_dtype else out.to(self.output_dtype)


@dataclass
class PassLayout:
    """What every layer of one pass shares, computed once per pass: the rotary factors of the new
    positions and the attention mask.

    ``cos`` [n, 1, D] and ``signed_sin`` [n, 1, D] (the sine with its first half negated) rotate
    x as x·cos + roll(x, D/2)·signed_sin, which is Llama's rotate-half x·cos + rotate_half(x)·sin
    in three tensor operations; their dtype is the attention's (float32, or float64 for a float64
    model). ``start`` is the cache length before the pass: every layer that runs must hold
    exactly that many positions.

    Cached passes attend over ``keys`` slots (whole blocks of ``KEY_BLOCK``) with ``mask`` [r, keys]
    (``slot_mask``: r = n rounded up to ``ATTENTION_ROWS``, query i sees slots 0 .. start + i, the
    padding queries repeat the last one), in calls of ``rows_per_call`` queries. Uncached passes (a
    batch, e.g. the mask search) use one causal ``mask`` [n, n] (None for n = 1) and ``keys`` = 0.
    A token-tree pass has ``groups`` instead of ``mask`` (``TreeAttention``). The draft head's
    passes are cached passes too: its token trees bring their own ``slot_mask``, and its unrolled
    training (``training.draft_train``) a mask over every earlier step's keys with all rows in one call."""

    cos: torch.Tensor
    signed_sin: torch.Tensor
    mask: torch.Tensor | None
    start: int
    keys: int = 0
    tree: "TreeAttention | None" = None
    rows_per_call: int = ATTENTION_ROWS
    fused: bool = False  # the layers run as engine calls (``gguf_llama.FusedLayer``): no mask or plan built
    attends: torch.Tensor | None = None  # fused tree passes: uint8 [n, n], new token i sees new token j
    # fused passes: the rotary tables the engine's layers read (``Decoder.engine_rotary``: (cos, signed
    # sin) float32 [n, rotary_dims] each, by the layers' table numbers) and the rows' positions (int64
    # [n], which sliding-window layers read: a tree node sees the window before its own position)
    rotary: "tuple[tuple[torch.Tensor, torch.Tensor], ...] | None" = None
    positions: torch.Tensor | None = None
    # Layers of different kinds (``ArchDecoder``: their own rotary tables or sliding windows) read
    # the layout of their (rotary kind, window) key from here; None: every layer reads this one.
    variants: "dict[tuple[str, int | None], PassLayout] | None" = None


def slot_mask(start: int, n: int, dtype: torch.dtype, device: torch.device, sees: torch.Tensor | None = None,
              row_multiple: int = ATTENTION_ROWS, window: int | None = None) -> tuple[torch.Tensor, int]:
    """The attention mask [r, keys] of a cached pass of n new tokens written at slots start ..
    start + n − 1, and ``keys``: start + n rounded up to whole ``KEY_BLOCK``s. Query i sees slots
    0 .. start + i, or the slots ``sees`` [n, start + n] (bool) marks (the draft head's token
    trees); r is n rounded up to ``row_multiple``, the padding queries seeing what the last one
    does. Additive (0 / −inf): a boolean mask is converted on every call, which doubled the
    attention's time here (127 vs 67 µs for 4 queries over 512 keys). A sliding ``window`` (chain
    passes: slot = position) also hides from query i the slots start + i − window and before."""
    keys = -(-(start + n) // KEY_BLOCK) * KEY_BLOCK
    rows = -(-n // row_multiple) * row_multiple
    if sees is None:
        last = torch.arange(start, start + rows, device=device).clamp_(max=start + n - 1).unsqueeze(1)
        slots = torch.arange(keys, device=device)
        blocked = slots > last  # [rows, keys]
        if window is not None:
            blocked |= slots <= last - window
    else:
        if window is not None:
            raise ValueError("a slot mask with both ``sees`` and a sliding window is not defined")
        if tuple(sees.shape) != (n, start + n):
            raise ValueError(f"a slot mask for {n} tokens after {start} has shape ({n}, {start + n}), "
                             f"got {tuple(sees.shape)}")
        blocked = torch.ones(rows, keys, dtype=torch.bool, device=device)
        blocked[:n, : start + n] = ~sees.to(device=device, dtype=torch.bool)
        blocked[n:] = blocked[n - 1]
    return torch.zeros(rows, keys, dtype=dtype, device=device).masked_fill_(blocked, float("-inf")), keys


class RotaryTable(torch.nn.Module):
    """Llama's rotary factors by position, cos and signed sin [P, D] (see ``PassLayout``), computed
    once for positions 0 .. P − 1 and again, longer, when a pass reaches past P (P in whole
    ``KEY_BLOCK``s). The decoder and the draft head each keep one."""

    def __init__(self, head_dim: int, theta: float, linear: float = 1.0,
                 frequency_factors: tuple[float, ...] | None = None):
        """``head_dim``: the rotated dimensions (all of a head's, or the first ``rotary_dims`` of a
        partial rotation); ``linear`` divides the positions (linear rope scaling) and
        ``frequency_factors`` [head_dim / 2] each frequency (Llama 3's scaling, as GGUF files store it)."""
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if linear != 1.0:
            inv_freq = inv_freq / linear
        if frequency_factors is not None:
            inv_freq = inv_freq / torch.tensor(frequency_factors, dtype=torch.float32)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None

    def factors(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [n, 1, D] in ``dtype`` for integer ``positions`` [n]."""
        cos, sin = self.covering(int(positions.max()) + 1, dtype)
        positions = positions.to(cos.device)
        return cos.index_select(0, positions).unsqueeze(1), sin.index_select(0, positions).unsqueeze(1)

    def span(self, start: int, count: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The factors of positions ``start .. start + count − 1`` (a chain's) as the engine reads
        them, cos and signed sin [count, D]: views of the table's rows, no gather."""
        cos, sin = self.covering(start + count, dtype)
        return cos[start : start + count], sin[start : start + count]

    def covering(self, needed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The table (cos, signed sin) [P, D] in ``dtype`` with P ≥ ``needed``."""
        table = self._table
        if table is None or table[0].shape[0] < needed or table[0].dtype != dtype or table[0].device != self.inv_freq.device:
            size = -(-needed // KEY_BLOCK) * KEY_BLOCK
            angles = torch.arange(size, device=self.inv_freq.device).float().unsqueeze(1) * self.inv_freq.float().unsqueeze(0)
            half = angles.shape[1]
            angles = torch.cat((angles, angles), dim=-1)
            sin = angles.sin()
            sin[:, :half] = -sin[:, :half]
            table = self._table = (angles.cos().to(dtype), sin.to(dtype))
        return table


# ---- token-tree passes --------------------------------------------------------------------------

# A tree pass (``tierspec.tree``) must give each node exactly the logits a chain pass of its path
# gives, in float32 too (greedy output must equal plain decoding's, near-ties included). The keys a
# node sees are the same, but a tree spreads a path over the tree's slots, and the attention
# kernel's arithmetic depends on which slot a key sits in: torch's CPU flash attention adds the
# exp(scores) of a 512-key block in vector lanes by slot (slot mod 16 on AVX-512) before one
# horizontal sum, so a path's terms land in other lanes than in the chain pass and are added in
# another association (measured: ~3e-7 relative on the logits, float32). So a tree pass attends
# in *groups*: each group is one root-to-leaf path; before its queries run, the path's keys and
# values are written to the slots after the pending tokens, in depth order — exactly the slots a
# chain pass of that path fills — and every node of the path (with the pending tokens) is queried
# in calls of ATTENTION_ROWS as in a chain pass. Nothing is copied but the path's own entries, and
# the cache is put back in pass order afterwards (``CachedModel.compact`` reads it).


@dataclass
class AttentionGroup:
    """Queries ``rows`` [r] (pass rows, r a multiple of ATTENTION_ROWS: the last real row repeated)
    with ``mask`` [r, keys], after writing pass rows ``moved`` [L] to slots start + ``first`` ..
    (None: the slots already hold this group's path, as the earlier groups left them). ``real``
    rows are kept."""

    rows: torch.Tensor
    mask: torch.Tensor
    real: int
    first: int
    moved: torch.Tensor | None


@dataclass
class TreeAttention:
    """A tree pass's attention plan (``tree_attention_plan``): its ``groups``; ``restore`` (None:
    no group moved anything) is the first pass row whose slot a group overwrote; ``copies`` (dst,
    src) [c] pass rows whose output is another row's (same token, position and view: a padding row)."""

    groups: list[AttentionGroup]
    restore: int | None
    copies: tuple[torch.Tensor, torch.Tensor] | None


def tree_attention_plan(attends: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, start: int, keys: int,
                        dtype: torch.dtype, device: torch.device, window: int | None = None) -> TreeAttention:
    """The attention groups of a pass whose new token i sees new token j iff attends[i, j] (j ≤ i).
    Row i's *view* is the new tokens it sees, in pass order; a chain pass of exactly those tokens
    puts them at slots start .. start + len(view) − 1, and so does the group row i is queried in.
    Rows with the same token, position and view compute the same outputs: only the first is
    queried. Groups: the longest views, each also serving the rows whose view is a prefix of its
    own (a node's ancestors; the pending tokens), which join a group with room in its last call.
    A sliding ``window`` hides from each row the slots ``window`` or more before its own (a group
    puts every key of a path at the slot of its position)."""
    n = int(attends.shape[0])
    seen = attends.to("cpu", torch.bool)
    if bool(seen.triu(1).any()):
        raise ValueError("a tree mask lets a token see a later one: new token i may see new tokens j ≤ i only")
    views = [tuple(row.nonzero().flatten().tolist()) for row in seen]
    token_list, position_list = tokens.tolist(), positions.tolist()
    first_of: dict = {}
    copy_rows, copy_sources, distinct = [], [], []
    for i in range(n):
        key = (token_list[i], position_list[i], views[i])
        if key in first_of:
            copy_rows.append(i)
            copy_sources.append(first_of[key])
        else:
            first_of[key] = i
            distinct.append(i)
    plans: list[tuple[tuple[int, ...], list[int]]] = []
    for i in sorted(distinct, key=lambda i: (-len(views[i]), i)):
        view = views[i]
        fits = [plan for plan in plans if plan[0][: len(view)] == view]
        if fits:
            roomy = [plan for plan in fits if len(plan[1]) % ATTENTION_ROWS]
            (roomy or fits)[0][1].append(i)
        else:
            plans.append((view, [i]))
    groups, restore = [], None
    slots = torch.arange(keys, device=device)
    current = list(range(n))  # the pass row whose entries sit at slot start + k, as the groups run
    for view, rows in plans:
        first = next((k for k, row in enumerate(view) if row != current[k]), len(view))
        moved = None
        if first < len(view):
            moved = torch.tensor(view[first:], dtype=torch.long, device=device)
            current[first : len(view)] = view[first:]
            restore = first if restore is None else min(restore, first)
        rows = sorted(rows, key=lambda i: (len(views[i]), i))
        real = len(rows)
        rows = rows + [rows[-1]] * (-real % ATTENTION_ROWS)
        lengths = torch.tensor([len(views[i]) for i in rows], device=device)
        mask = torch.zeros(len(rows), keys, dtype=dtype, device=device)
        mask.masked_fill_(slots >= (start + lengths).unsqueeze(1), float("-inf"))
        if window is not None:
            mask.masked_fill_(slots <= (start + lengths - 1 - window).unsqueeze(1), float("-inf"))
        groups.append(AttentionGroup(torch.tensor(rows, dtype=torch.long, device=device), mask, real, first, moved))
    copies = None
    if copy_rows:
        copies = (torch.tensor(copy_rows, dtype=torch.long, device=device),
                  torch.tensor(copy_sources, dtype=torch.long, device=device))
    return TreeAttention(groups, restore, copies)


class Attention(torch.nn.Module):
    """Grouped-query self-attention with one fused q/k/v projection (one weight stream and one
    kernel call instead of three; ``fuse_projections`` builds it from transformers' q/k/v)."""

    bypassed = False  # a routing mask's stand-in says True (a class attribute: read on every pass)

    def __init__(self, config: SimpleNamespace):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        hidden = config.hidden_size
        self.qkv_proj = _Linear(hidden, (self.heads + 2 * self.kv_heads) * self.head_dim, bias=False)
        self.o_proj = _Linear(self.heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, layout: PassLayout, cache: KVLayer | None) -> torch.Tensor:
        """x [b, n, H] (normalised) → the attention output [b, n, H]; appends this pass's KV to
        ``cache`` (the target's cached passes have b = 1; a batch runs uncached, e.g. the mask
        search, or over the draft head's training cache, ``training.draft_train.StepKeys``).
        Attention runs in the layout's dtype (float32 for a bfloat16 model: see KEY_BLOCK)."""
        q, k, v = self.project(x, layout)
        return self.attend(x, q, k, v, layout, cache)

    def project(self, x: torch.Tensor, layout: PassLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [b, n, H] → q [b, heads, n, D], k and v [b, kv_heads, n, D], q and k rotated."""
        b, n = x.shape[0], x.shape[1]
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv_proj.forward(x).view(b, n, heads + 2 * kv_heads, d).to(layout.cos.dtype)
        rotated = rotate(qkv[:, :, : heads + kv_heads], layout.cos, layout.signed_sin)  # [b, n, heads + kv_heads, D]
        q = rotated[:, :, :heads].transpose(1, 2)  # [b, heads, n, D]
        k = rotated[:, :, heads:].transpose(1, 2)  # [b, kv_heads, n, D]
        v = qkv[:, :, heads + kv_heads :].transpose(1, 2)
        return q, k, v

    # softmax(q·kᵀ·scale + mask)·v; ``ArchAttention`` swaps in its scale and soft-capping
    kernel = staticmethod(F.scaled_dot_product_attention)

    def attend(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PassLayout,
               cache: KVLayer | None) -> torch.Tensor:
        """The attention of q over the cached keys and this pass's k, v, through ``o_proj`` [b, n, H]."""
        b, n = x.shape[0], x.shape[1]
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        gqa = kv_heads != heads
        attention = self.kernel
        if cache is None:
            out = attention(q, k, v, attn_mask=layout.mask, enable_gqa=gqa)
        else:
            if cache.length != layout.start:
                raise RuntimeError(f"a layer's cache holds {cache.length} positions, the pass starts at {layout.start}: "
                                   "the caller broke the rollback invariant")
            cache.update(k, v)
            keys, values = cache.window(layout.keys)
            if layout.tree is not None:
                out = tree_attention(q, k, v, keys, values, layout.start, layout.tree, gqa, attention)
                return self.o_proj.forward(out.transpose(1, 2).reshape(b, n, heads * d).to(x.dtype))
            rows, per_call = layout.mask.shape[0], layout.rows_per_call
            if rows > n:  # pad the queries to whole calls with copies of the last one
                q = torch.cat((q, q[:, :, -1:].expand(b, heads, rows - n, d)), dim=2)
            out = torch.cat([attention(q[:, :, i : i + per_call], keys, values,
                                       attn_mask=layout.mask[i : i + per_call], enable_gqa=gqa)
                             for i in range(0, rows, per_call)], dim=2)[:, :, :n] if rows > per_call else \
                attention(q, keys, values, attn_mask=layout.mask, enable_gqa=gqa)[:, :, :n]
        # Back to the projections' dtype (the input's): a bfloat16 o_proj takes bfloat16 rows.
        return self.o_proj.forward(out.transpose(1, 2).reshape(b, n, heads * d).to(x.dtype))


def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   start: int, plan: TreeAttention, gqa: bool,
                   attention=F.scaled_dot_product_attention) -> torch.Tensor:
    """A tree pass's attention [1, heads, n, D] by ``plan`` (see ``tree_attention_plan``): q [1, heads,
    n, D] and this pass's k, v [1, kv_heads, n, D], already written at slots start .. of the cache
    window ``keys``/``values`` (views of the buffer), which each group rearranges and which is put
    back in pass order at the end."""
    out = q.new_empty(q.shape)
    for group in plan.groups:
        if group.moved is not None:
            end = start + group.first + int(group.moved.shape[0])
            keys[:, :, start + group.first : end] = k.index_select(2, group.moved)
            values[:, :, start + group.first : end] = v.index_select(2, group.moved)
        queries = q.index_select(2, group.rows)
        result = torch.cat([attention(queries[:, :, i : i + ATTENTION_ROWS], keys, values,
                                      attn_mask=group.mask[i : i + ATTENTION_ROWS], enable_gqa=gqa)
                            for i in range(0, int(group.rows.shape[0]), ATTENTION_ROWS)], dim=2)
        out.index_copy_(2, group.rows[: group.real], result[:, :, : group.real])
    if plan.restore is not None:
        n = int(k.shape[2])
        keys[:, :, start + plan.restore : start + n] = k[:, :, plan.restore :]
        values[:, :, start + plan.restore : start + n] = v[:, :, plan.restore :]
    if plan.copies is not None:
        out.index_copy_(2, plan.copies[0], out.index_select(2, plan.copies[1]))
    return out


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [..., n, heads, D] rotated by position (see ``PassLayout``); cos/signed_sin [n, 1, D]."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


class MLP(torch.nn.Module):
    """SwiGLU with one fused gate/up projection."""

    bypassed = False  # as Attention.bypassed

    def __init__(self, config: SimpleNamespace):
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = _Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = _Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        return self.down_proj.forward(F.silu(gate_up[..., : self.intermediate]) * gate_up[..., self.intermediate :])


class DecoderLayer(torch.nn.Module):
    """A Llama decoder layer over the residual stream h [1, n, H] (float32, or the model's dtype
    if wider). A routing mask swaps ``self_attn`` or ``mlp`` for a stand-in marked ``bypassed``
    (``layerskip.masks.apply_mask``): that block, and the norm in front of it, are skipped.

    The layer's own parts are run through ``forward`` rather than called as modules: a module
    call costs a few µs of Python, and a pass makes ~270 of them (hooks on the layer and on the
    decoder, which tierspec uses, still run; hooks on a layer's parts would not)."""

    def __init__(self, config: SimpleNamespace):
        super().__init__()  # registered in transformers' order, so state_dict() lists weights alike
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    fused = None  # a gguf_llama.FusedLayer: the layer as one engine call (cached passes, layout.fused)

    def forward(self, hidden_states: torch.Tensor, layout: PassLayout, cache: KVLayer | None) -> torch.Tensor:
        attention = not getattr(self.self_attn, "bypassed", False)
        mlp = not getattr(self.mlp, "bypassed", False)
        if layout.fused:
            units = (1 if attention else 0) | (2 if mlp else 0)
            return self.fused.run(hidden_states, layout, cache, units) if units else hidden_states
        if attention:
            hidden_states = self.attention_block(hidden_states, layout, cache)
        if mlp:
            hidden_states = self.mlp_block(hidden_states)
        return hidden_states

    # The layer's two residual units, also run one at a time by CLaSP's layer selection
    # (``tierspec.clasp``), which bypasses each on its own.
    def attention_block(self, hidden_states: torch.Tensor, layout: PassLayout, cache: KVLayer | None) -> torch.Tensor:
        if layout.fused:
            return self.fused.run(hidden_states, layout, cache, 1)
        return hidden_states + self.self_attn.forward(self.input_layernorm.forward(hidden_states), layout, cache)

    def mlp_block(self, hidden_states: torch.Tensor, layout: PassLayout | None = None) -> torch.Tensor:
        if layout is not None and layout.fused:
            return self.fused.run(hidden_states, layout, None, 2)
        return hidden_states + self.mlp.forward(self.post_attention_layernorm.forward(hidden_states))


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
        self.rotary = RotaryTable(config.head_dim, config.rope_parameters["rope_theta"])
        self.residual_dtype = torch.float32

    @property
    def fused(self) -> bool:
        """Whether every layer runs as one engine call on cached passes (a GGUF model's layers)."""
        return bool(self.layers) and all(getattr(layer, "fused", None) is not None for layer in self.layers)

    def layout(self, position_ids: torch.Tensor, start: int, cached: bool, attends: torch.Tensor | None = None,
               tokens: torch.Tensor | None = None) -> PassLayout:
        """The pass's shared factors for new tokens at ``position_ids`` [n] written at cache slots
        ``start ..`` (see ``PassLayout``). ``attends`` [n, n] bool (a token tree, cached passes
        only, with the pass's ``tokens`` [n]): new token i sees new token j iff attends[i, j] (j ≤ i;
        default: every j ≤ i); it attends in groups (``tree_attention_plan``)."""
        n = int(position_ids.shape[0])
        if attends is not None and (not cached or tuple(attends.shape) != (n, n)):
            raise ValueError(f"a tree mask needs a cached pass and shape ({n}, {n}), got {tuple(attends.shape)}"
                             + ("" if cached else " on an uncached pass"))
        device = position_ids.device
        if cached and self.fused:
            # the engine attends in each query's logical key order: no mask, no groups
            seen = None if attends is None else attends.to("cpu", torch.uint8).contiguous()
            if seen is not None and bool(seen.triu(1).any()):
                raise ValueError("a tree mask lets a token see a later one: new token i may see new tokens j ≤ i only")
            rotary = self.engine_rotary(position_ids)
            return PassLayout(rotary[0][0].unsqueeze(1), rotary[0][1].unsqueeze(1), None, start, fused=True,
                              attends=seen, rotary=rotary, positions=position_ids.to("cpu", torch.int64).contiguous())
        cos, sin = self.rotary.factors(position_ids, self.residual_dtype)
        if not cached:
            mask = torch.ones(n, n, dtype=torch.bool, device=device).tril() if n > 1 else None
            return PassLayout(cos, sin, mask, start)
        if attends is not None:
            keys = -(-(start + n) // KEY_BLOCK) * KEY_BLOCK
            plan = tree_attention_plan(attends, tokens.to("cpu"), position_ids.to("cpu"), start, keys,
                                       self.residual_dtype, device)
            return PassLayout(cos, sin, None, start, keys, plan)
        mask, keys = slot_mask(start, n, self.residual_dtype, device)
        return PassLayout(cos, sin, mask, start, keys)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                cache: KVCache | None = None, use_cache: bool = True, attends: torch.Tensor | None = None,
                **unused) -> DecoderOutput:
        """input_ids [1, n] at ``position_ids`` [1, n] (default: after what ``cache`` holds);
        ``attends`` [n, n]: a tree pass's mask among the new tokens (see ``layout``)."""
        n = input_ids.shape[1]
        cached = cache is not None and use_cache
        start = cache.get_seq_length() if cached else 0
        if position_ids is None:
            position_ids = torch.arange(start, start + n, device=input_ids.device).unsqueeze(0)
        hidden = self.embed_tokens(input_ids).to(self.residual_dtype)
        layout = self.layout(position_ids[0], start, cached, attends, input_ids[0])
        if layout.fused and self.engine_stack is not None:
            return DecoderOutput(self.final_norm(self._engine_forward(hidden, layout, cache)))
        layers = cache.layers if cached else [None] * len(self.layers)
        for layer, layer_cache in zip(self.layers, layers):
            hidden = layer(hidden, layout, layer_cache)
        return DecoderOutput(self.norm(hidden))

    engine_stack = None  # a gguf_llama.EngineStack: every layer's engine description, when all are fused

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """``self.norm(hidden)`` after the engine's layers (a solo pass's and a batched pass's alike):
        by the engine's norm kernel where the norm is a plain float32 ``RMSNorm`` with no hooks
        (one call, ``engine.rms_norm``), else as the module."""
        norm = self.norm
        state = norm.__dict__
        if (type(norm) is RMSNorm and norm.output_dtype in (None, torch.float32) and hidden.dtype == torch.float32
                and state["_parameters"]["weight"].dtype == torch.float32 and not state["_forward_hooks"]
                and not state["_forward_pre_hooks"] and not torch.nn.modules.module._global_forward_hooks
                and not torch.nn.modules.module._global_forward_pre_hooks):
            return engine.rms_norm(hidden, norm.weight, norm.eps)
        return norm(hidden)

    def engine_rotary(self, positions: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """The rotary tables the engine's layers read for rows at ``positions`` [n]: (cos, signed sin)
        float32 [n, rotary_dims] each, by the layers' table numbers (``rotary_tables``; Llama: one)."""
        n = int(positions.shape[0])
        return tuple((cos.reshape(n, -1), sin.reshape(n, -1))
                     for cos, sin in (table.factors(positions, torch.float32) for table in self.rotary_tables))

    def engine_rotary_chain(self, start: int, count: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """``engine_rotary`` of a chain's positions ``start .. start + count − 1``: views of each
        table's rows, no gather (a lone sequence's pass)."""
        return tuple(table.span(start, count, torch.float32) for table in self.rotary_tables)

    @property
    def rotary_tables(self) -> tuple[RotaryTable, ...]:
        """The ``RotaryTable`` of each of the engine's rotary table numbers (Llama: one)."""
        return (self.rotary,)

    def _engine_forward(self, hidden: torch.Tensor, layout: PassLayout, cache: KVCache) -> torch.Tensor:
        """The layers as engine calls: runs of layers in one call each. A layer whose only hooks are
        observers (forward hooks marked ``observes_only``, as ``cached_model.HiddenCapture``'s: they
        read the output and return nothing) stays inside the call, which copies its input and
        output rows out (``run_stack``'s captures), and its hooks are called with them after the
        call, as a module call would call them; any other hooked layer runs as a module call."""
        layers = list(self.layers)
        observed: set[int] = set()
        hooked: set[int] = set()
        every_layer_hooked = bool(torch.nn.modules.module._global_forward_hooks
                                  or torch.nn.modules.module._global_forward_pre_hooks)
        flag_list = []
        # One pass over the layers' own dictionaries (not Module.__getattr__, ~70 lookups a pass): the
        # hooks each carries and which units a routing mask bypassed. Run every pass, so a hook or a
        # mask put on between two passes is always seen.
        for i, layer in enumerate(layers):
            state = layer.__dict__
            units = state["_modules"]
            flag_list.append((0 if units["self_attn"].bypassed else 1) | (0 if units["mlp"].bypassed else 2))
            if (every_layer_hooked or state["_forward_pre_hooks"] or state["_forward_hooks_with_kwargs"]
                    or state["_forward_hooks_always_called"]):
                hooked.add(i)
            elif state["_forward_hooks"]:
                observers = all(getattr(hook, "observes_only", False) for hook in state["_forward_hooks"].values())
                (observed if observers else hooked).add(i)
        flags = bytes(flag_list)
        every_attends = 0 not in flag_list and 2 not in flag_list  # no layer's attention bypassed (flag 1 unset)
        first = layers[0].fused
        n = int(hidden.shape[1])
        start = layout.start
        kv = cache.layers
        table = cache.engine_table(start + n, first.kv_heads, first.head_dim, first.kv_dtype)
        hidden = hidden.contiguous()
        segments = [engine.Segment(0, n, start, table, layout.attends, positions=layout.positions)]
        i = 0
        while i < len(layers):
            if i in hooked:
                hidden = layers[i](hidden, layout, kv[i])
                i += 1
                continue
            j = i
            while j < len(layers) and j not in hooked:
                j += 1
            # the layers of this call that attend (and write their KV): all of them unless a mask bypassed some
            attending = None if i == 0 and j == len(layers) and every_attends else [
                k for k in range(i, j) if flags[k] & 1]
            cache.check_start(start, attending)
            out = torch.empty_like(hidden)
            watched = [k for k in range(i, j) if k in observed]
            captures = {}
            for k in watched:  # each watched layer's input (the layer before's output) and output
                for layer in (k - 1, k):
                    if i <= layer < j - 1 and layer not in captures:
                        captures[layer] = torch.empty_like(hidden)
            engine.run_stack(self.engine_stack.capsule, hidden.view(n, -1), out.view(n, -1), segments, layout.rotary, flags, i, j,
                      captures={k: buffer.view(n, -1) for k, buffer in captures.items()})
            cache.advance(n, attending)
            for k in watched:
                given = hidden if k == i else captures[k - 1]
                output = out if k == j - 1 else captures[k]
                for hook in tuple(layers[k]._forward_hooks.values()):
                    if hook(layers[k], (given, layout, kv[k]), output) is not None:
                        raise RuntimeError(f"a forward hook marked observes_only on layer {k} returned a value")
            hidden, i = out, j
        return hidden


class LlamaLM(torch.nn.Module):
    """A Llama causal LM with transformers' module names; see the module docstring."""

    base_model_prefix = "model"

    def __init__(self, config: SimpleNamespace, generation_config: SimpleNamespace | None = None,
                 decoder: "Decoder | None" = None):
        """``decoder``: another architecture's decoder (``ArchDecoder``); default: Llama's."""
        super().__init__()
        self.config = config
        self.generation_config = generation_config or SimpleNamespace()
        self.model = decoder if decoder is not None else Decoder(config)
        self.lm_head = _Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the decoder's weights (the LM head and the residual stream may be wider); for
        a GGUF model's quantised layers, the dtype their rows are rounded to (``quant.Numerics``)."""
        embedding = self.model.embed_tokens
        quantised = getattr(embedding, "qweight", None)
        return quantised.numerics.dtype if quantised is not None else embedding.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def get_decoder(self) -> Decoder:
        return self.model

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    kv_layer_class: type = KVLayer  # a GGUF model's layers run on the engine: ViewOnReadKVLayer

    def new_kv_cache(self) -> KVCache:
        return KVCache(len(self.model.layers), self.kv_layer_class)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                use_cache: bool = True, logits_to_keep: int = 0, attends: torch.Tensor | None = None,
                **unused) -> CausalLMOutput:
        """Logits [1, m, V] of the last ``logits_to_keep`` = m positions (0: all); ``attends``: a
        tree pass (``Decoder.layout``)."""
        hidden = self.model(input_ids, position_ids, cache, use_cache, attends).last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return CausalLMOutput(self.lm_head(hidden))


# ---- architectures beyond plain Llama (``tierspec.architectures``) ------------------------------------
#
# Qwen2/2.5, Qwen3, Gemma 3, Mistral with a sliding window and Phi-3 run on the same modules with the
# features their ``Architecture`` names. The layers keep Llama's shape (a fused q/k/v projection, a
# fused gate/up projection, two residual units), so routing masks, hidden-state hooks, rollback and
# token trees work as on Llama; what differs is inside a unit (biases, q/k norms, the activation,
# Gemma's norms around each unit) or in the pass's layout (a rotary table and a mask per layer kind).


def softcapped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attn_mask: torch.Tensor | None = None,
                         enable_gqa: bool = False, *, scale: float, cap: float) -> torch.Tensor:
    """softmax(cap·tanh(q·kᵀ·scale / cap) + mask)·v (Gemma 2's soft-capped scores): q [b, heads, r, D],
    keys/values [b, kv_heads, T, D]; ``attn_mask`` [r, T], additive or boolean (True: attends)."""
    if enable_gqa:
        repeat = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return torch.matmul(torch.softmax(scores, dim=-1), values)


class ArchAttention(Attention):
    """``Attention`` with an architecture's features: a bias on the q/k/v outputs (Qwen2), an RMSNorm
    over each head's q and k before the rotation (Qwen3, Gemma 3), a rotation of the first
    ``rotary_dims`` dimensions only, another scale (Gemma's query_pre_attn_scalar) and soft-capped
    scores. A sliding window is the layout's mask (``ArchDecoder.layout``)."""

    def __init__(self, config: SimpleNamespace, arch):
        super().__init__(config)
        width = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.qkv_bias = torch.nn.Parameter(torch.zeros(width), requires_grad=False) if arch.qkv_bias else None
        if arch.qk_norm:  # transformers' names (q_norm, k_norm)
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary_dims = arch.rotary_dims
        scale = arch.attention_scale
        self.scale, self.softcap = scale, arch.attention_softcap  # what the engine's layer is told (None: its default)
        if arch.attention_softcap is not None:
            self.kernel = functools.partial(softcapped_attention, scale=scale or self.head_dim ** -0.5,
                                            cap=float(arch.attention_softcap))
        elif scale is not None:
            self.kernel = functools.partial(F.scaled_dot_product_attention, scale=scale)

    def project(self, x: torch.Tensor, layout: PassLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n = x.shape[0], x.shape[1]
        heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv_proj.forward(x)
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias.to(qkv.dtype)
        qkv = qkv.view(b, n, heads + 2 * kv_heads, d).to(layout.cos.dtype)
        q, k, v = qkv[:, :, :heads], qkv[:, :, heads : heads + kv_heads], qkv[:, :, heads + kv_heads :]
        if self.q_norm is not None:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        qk = torch.cat((q, k), dim=2)  # [b, n, heads + kv_heads, D]
        if self.rotary_dims == d:
            qk = rotate(qk, layout.cos, layout.signed_sin)
        else:  # the first rotary_dims dimensions rotate (rotate-half within them), the rest pass
            r = self.rotary_dims
            qk = torch.cat((rotate(qk[..., :r], layout.cos, layout.signed_sin), qk[..., r:]), dim=-1)
        return qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2), v.transpose(1, 2)


class GeluMLP(MLP):
    """The gated MLP with GELU (tanh approximation) on the gate: Gemma's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        gate = F.gelu(gate_up[..., : self.intermediate], approximate="tanh")
        return self.down_proj.forward(gate * gate_up[..., self.intermediate :])


class ArchDecoderLayer(DecoderLayer):
    """A decoder layer of an ``Architecture``: ``ArchAttention``, SiLU or GELU MLP, and with
    ``post_norms`` Gemma's four norms (transformers' names: ``input_layernorm`` before attention,
    ``post_attention_layernorm`` on its output, ``pre_feedforward_layernorm`` and
    ``post_feedforward_layernorm`` around the MLP); otherwise Llama's two. A bypassed unit skips its
    norms with it. ``layout_key`` picks the layer's layout among the pass's ``variants``."""

    def __init__(self, config: SimpleNamespace, arch, index: int):
        torch.nn.Module.__init__(self)  # registered in transformers' order
        self.self_attn = ArchAttention(config, arch)
        self.mlp = GeluMLP(config) if arch.activation == "gelu_tanh" else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_norms = arch.post_norms
        if arch.post_norms:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layout_key = (arch.layer_kinds[index], arch.windows[index])

    def attention_block(self, hidden_states: torch.Tensor, layout: PassLayout, cache: KVLayer | None) -> torch.Tensor:
        if layout.variants is not None:
            layout = layout.variants[self.layout_key]
        if layout.fused:
            return self.fused.run(hidden_states, layout, cache, 1)
        out = self.self_attn.forward(self.input_layernorm.forward(hidden_states), layout, cache)
        if self.post_norms:
            out = self.post_attention_layernorm.forward(out.to(hidden_states.dtype))
        return hidden_states + out

    def mlp_block(self, hidden_states: torch.Tensor, layout: PassLayout | None = None) -> torch.Tensor:
        if layout is not None and layout.fused:
            return self.fused.run(hidden_states, layout, None, 2)
        if not self.post_norms:
            return hidden_states + self.mlp.forward(self.post_attention_layernorm.forward(hidden_states))
        out = self.mlp.forward(self.pre_feedforward_layernorm.forward(hidden_states))
        return hidden_states + self.post_feedforward_layernorm.forward(out.to(hidden_states.dtype))


class ScaledEmbedding(torch.nn.Module):
    """An embedding whose rows are multiplied by ``scale`` (Gemma: sqrt(hidden), as transformers'
    Gemma3TextScaledWordEmbedding multiplies in float32); ``inner``'s table is shared, unscaled, with
    a tied LM head."""

    def __init__(self, inner: torch.nn.Module, scale: float):
        super().__init__()
        self.inner = inner
        self.register_buffer("scale", torch.tensor(scale, dtype=torch.float32), persistent=False)
        self.num_embeddings, self.embedding_dim = inner.num_embeddings, inner.embedding_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.inner(ids)
        return rows * self.scale.to(rows.dtype)

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    @property
    def qweight(self):
        """The quantised table of a GGUF model (``quant.QuantEmbedding``), else None."""
        return getattr(self.inner, "qweight", None)


class ArchDecoder(Decoder):
    """``Decoder`` for an ``Architecture`` whose layers are ``ArchDecoderLayer``s: a rotary table per
    layer kind, and each pass's layout made once per (kind, window) key in use."""

    def __init__(self, config: SimpleNamespace, arch):
        torch.nn.Module.__init__(self)
        self.embed_tokens = _Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(ArchDecoderLayer(config, arch, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotaries = torch.nn.ModuleDict({kind: RotaryTable(arch.rotary_dims, r.theta, r.linear, r.frequency_factors)
                                             for kind, r in arch.rotaries.items()})
        self.rotary = self.rotaries[arch.layer_kinds[0]]  # the first layer's
        self.rotary_kinds = tuple(arch.rotaries)  # the engine's rotary table numbers (``engine_rotary``)
        self.layout_keys = sorted(set(zip(arch.layer_kinds, arch.windows)), key=str)
        self.residual_dtype = torch.float32

    @property
    def rotary_tables(self) -> tuple[RotaryTable, ...]:
        """``Decoder.rotary_tables``: one per rotary kind, in ``rotary_kinds`` order."""
        return tuple(self.rotaries[kind] for kind in self.rotary_kinds)

    def layout(self, position_ids: torch.Tensor, start: int, cached: bool, attends: torch.Tensor | None = None,
               tokens: torch.Tensor | None = None) -> PassLayout:
        """As ``Decoder.layout``, for every (rotary kind, window) key; the first is the layout itself,
        all of them its ``variants`` (None with one key)."""
        if cached and self.fused:
            return super().layout(position_ids, start, cached, attends, tokens)
        n = int(position_ids.shape[0])
        if attends is not None and (not cached or tuple(attends.shape) != (n, n)):
            raise ValueError(f"a tree mask needs a cached pass and shape ({n}, {n}), got {tuple(attends.shape)}"
                             + ("" if cached else " on an uncached pass"))
        device, dtype = position_ids.device, self.residual_dtype
        masks: dict = {}
        layouts = {}
        for kind, window in self.layout_keys:
            cos, sin = self.rotaries[kind].factors(position_ids, dtype)
            if window not in masks:
                masks[window] = self._mask(position_ids, start, cached, attends, tokens, window)
            mask, keys, plan = masks[window]
            layouts[(kind, window)] = PassLayout(cos, sin, mask, start, keys, plan)
        first = layouts[self.layout_keys[0]]
        if len(layouts) > 1:
            first.variants = layouts
        return first

    def _mask(self, position_ids: torch.Tensor, start: int, cached: bool, attends: torch.Tensor | None,
              tokens: torch.Tensor | None, window: int | None) -> tuple[torch.Tensor | None, int, "TreeAttention | None"]:
        """(mask, keys, tree plan) of a pass for layers with sliding ``window`` (None: global)."""
        n, device, dtype = int(position_ids.shape[0]), position_ids.device, self.residual_dtype
        if not cached:  # query i sees keys i − window + 1 .. i (boolean: True attends)
            if n == 1:
                return None, 0, None
            mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()
            if window is not None:
                mask &= ~torch.ones(n, n, dtype=torch.bool, device=device).tril(-window)
            return mask, 0, None
        if attends is not None:
            keys = -(-(start + n) // KEY_BLOCK) * KEY_BLOCK
            plan = tree_attention_plan(attends, tokens.to("cpu"), position_ids.to("cpu"), start, keys, dtype, device,
                                       window)
            return None, keys, plan
        mask, keys = slot_mask(start, n, dtype, device, window=window)
        return mask, keys, None


def fuse_projections(state: dict[str, torch.Tensor], config: SimpleNamespace) -> dict[str, torch.Tensor]:
    """transformers' weight names → this module's: per layer q/k/v into ``qkv_proj`` and gate/up
    into ``gate_up_proj`` (concatenated along the output rows). Other names pass through. Raises
    ValueError for a part whose shape the config does not imply."""
    hidden, head_dim = config.hidden_size, config.head_dim
    rows = {"q_proj": config.num_attention_heads * head_dim, "k_proj": config.num_key_value_heads * head_dim,
            "v_proj": config.num_key_value_heads * head_dim, "gate_proj": config.intermediate_size,
            "up_proj": config.intermediate_size}
    for i in range(config.num_hidden_layers):
        for prefix, parts, fused in ((f"model.layers.{i}.self_attn.", ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                                     (f"model.layers.{i}.mlp.", ("gate_proj", "up_proj"), "gate_up_proj")):
            names = [f"{prefix}{part}.weight" for part in parts]
            for part, name in zip(parts, names):
                if name in state and tuple(state[name].shape) != (rows[part], hidden):
                    raise ValueError(f"weight {name} has shape {tuple(state[name].shape)}, "
                                     f"the config implies {(rows[part], hidden)}")
            if all(name in state for name in names):
                state[f"{prefix}{fused}.weight"] = torch.cat([state.pop(name) for name in names])
    return state


def has_projections(layer: torch.nn.Module) -> bool:
    """Whether a decoder layer has Llama's projections (fused as here, or as transformers' seven)."""
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    fused = (getattr(attention, "qkv_proj", None), getattr(attention, "o_proj", None),
             getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
    plain = [getattr(attention, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    plain += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return all(p is not None for p in fused) or all(p is not None for p in plain)


def projection_weights(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A decoder layer's projections by transformers' names (q/k/v/o/gate/up/down ``_proj``),
    for a layer of this module (split from the fused weights) or of transformers' Llama."""
    attention, mlp = layer.self_attn, layer.mlp
    if hasattr(attention, "qkv_proj"):
        q, k, v = attention.qkv_proj.weight.split(
            [attention.heads * attention.head_dim, attention.kv_heads * attention.head_dim,
             attention.kv_heads * attention.head_dim])
        gate, up = mlp.gate_up_proj.weight.split([mlp.intermediate, mlp.intermediate])
        return {"q_proj": q, "k_proj": k, "v_proj": v, "o_proj": attention.o_proj.weight,
                "gate_proj": gate, "up_proj": up, "down_proj": mlp.down_proj.weight}
    return {name: getattr(attention, name).weight for name in ("q_proj", "k_proj", "v_proj", "o_proj")} | \
           {name: getattr(mlp, name).weight for name in ("gate_proj", "up_proj", "down_proj")}


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in a .safetensors file, each read into memory of its own.

    Not memory-mapped on purpose: a tensor viewing a mapping keeps the whole file mapped, and
    every page read to pack the weights (``tierspec.kernels``) would stay in the process's
    resident memory beside the packed copy (measured: 1.56 GB peak for the float32 default
    model instead of 0.8). Raises ValueError for a file that is not a well-formed safetensors
    file of floating-point tensors."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        if not 0 < length <= size - 8:
            raise ValueError(f"{path} is not a safetensors file (header length {length}, file size {size})")
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"{path}: unreadable safetensors header ({error})") from None
        base = 8 + length
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
                start, end = (int(offset) for offset in entry["data_offsets"])
                shape = tuple(int(n) for n in entry["shape"])
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{path}: tensor {name!r} has an entry tierspec cannot read: {entry!r}") from None
            count = math.prod(shape)
            if end - start != count * dtype.itemsize or not 0 <= start <= end <= size - base:
                raise ValueError(f"{path}: tensor {name!r} does not fit the file (corrupted or truncated)")
            buffer = bytearray(end - start)
            handle.seek(base + start)
            if handle.readinto(buffer) != len(buffer):
                raise ValueError(f"{path}: tensor {name!r} is cut short (truncated file)")
            yield name, (torch.frombuffer(buffer, dtype=dtype) if buffer else torch.empty(0, dtype=dtype)).view(shape)


def load_llama(folder: Path, dtype: torch.dtype) -> LlamaLM:
    """The model in ``folder`` (config.json and *.safetensors, as transformers saves it) with its
    decoder weights in ``dtype``. The residual stream, the norms and the LM head stay float32
    (float64 for a float64 model): a bfloat16 model streams half the bytes through its layers but
    adds its layers' outputs into a float32 stream and scores the vocabulary in float32, so its
    logits are not rounded to bfloat16's spacing (0.125 at 16). Weights are converted tensor by
    tensor as they are read (no second full copy at any time).

    Raises ValueError when the files do not fit the architecture (missing or unexpected weights,
    wrong shapes); the caller says what to do."""
    config = json.loads((folder / "config.json").read_text())
    problem = supports(config)
    if problem:
        raise ValueError(f"not a plain Llama model: {problem}")
    generation_file = folder / "generation_config.json"
    generation = SimpleNamespace(**json.loads(generation_file.read_text())) if generation_file.exists() else None
    settings = model_config(config)
    wide = torch.promote_types(dtype, torch.float32)  # residual stream, norms, LM head
    model = LlamaLM(settings, generation)
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {folder}")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        for name, tensor in read_safetensors(path):
            if settings.tie_word_embeddings and name == "lm_head.weight":
                continue
            if name == "model.embed_tokens.weight" and settings.tie_word_embeddings and wide != dtype:
                state["lm_head.weight"] = tensor.to(wide)  # the head keeps the full-precision table
            keep_wide = name == "lm_head.weight" or name.endswith("norm.weight")
            state[name] = tensor.to(wide if keep_wide else dtype)
            del tensor
    state = fuse_projections(state, settings)
    if settings.tie_word_embeddings and wide == dtype:
        expected.pop("lm_head.weight", None)
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"weights do not fit a Llama model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, the config implies {expected[name]}")
    model.load_state_dict(state, strict=False, assign=True)
    if settings.tie_word_embeddings and wide == dtype:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.residual_dtype = wide
    for layer in model.model.layers:
        layer.input_layernorm.output_dtype = layer.post_attention_layernorm.output_dtype = dtype
    for module in model.modules():  # initialised now: plain torch classes from here on
        if type(module) is _Linear:
            module.__class__ = torch.nn.Linear
        elif type(module) is _Embedding:
            module.__class__ = torch.nn.Embedding
    return model.eval()
