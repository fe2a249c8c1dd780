"""Routing masks: which units of the target a slim verifier or self-drafter bypasses.

A unit is a whole decoder layer, or (``unit="sublayer"``) a layer's attention block or its
MLP block separately, as SWIFT does. The first and last layers are never bypassed. A
bypassed unit contributes nothing to the residual stream; a bypassed attention block also
writes no KV, so the cache's layers can hold different lengths (``CachedModel.rollback``
trims each layer on its own).

A mask is applied to a model *instance* with ``apply_mask`` (a context manager): bypassed
modules are swapped for stand-ins on that instance and restored in ``finally``. No class is
patched, no code forked, and every weight stays shared with the full model.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from ..errors import TierspecError
from ..identity import ModelIdentity
from ..util import atomic_write_text

UNITS = ("layer", "sublayer")
MASK_FORMAT = "tierspec-routing-mask"


class RoutingMaskError(TierspecError):
    """A mask that does not fit the model, or a mask file that cannot be read."""


@dataclass(frozen=True)
class RoutingMask:
    """Bypassed units of a model with ``num_layers`` decoder layers.

    With ``unit="layer"`` a bypassed layer appears in both sets. ``ratio`` is the fraction of
    units bypassed (units: L layers, or 2L sub-layers).
    """

    num_layers: int
    unit: str = "layer"
    skip_attention: frozenset[int] = frozenset()
    skip_mlp: frozenset[int] = frozenset()
    model: ModelIdentity | None = None
    info: dict = field(default_factory=dict, compare=False, hash=False)  # objective, cost, …

    def __post_init__(self) -> None:
        if self.unit not in UNITS:
            raise RoutingMaskError(f"unit must be one of {UNITS}, got '{self.unit}'")
        object.__setattr__(self, "skip_attention", frozenset(int(i) for i in self.skip_attention))
        object.__setattr__(self, "skip_mlp", frozenset(int(i) for i in self.skip_mlp))
        for index in self.skip_attention | self.skip_mlp:
            if not 0 < index < self.num_layers - 1:
                raise RoutingMaskError(
                    f"layer {index} cannot be bypassed: only layers 1..{self.num_layers - 2} of "
                    f"{self.num_layers} may be (the first and last layers are always kept)"
                )
        if self.unit == "layer" and self.skip_attention != self.skip_mlp:
            raise RoutingMaskError("a layer-unit mask bypasses attention and MLP of the same layers")

    # -- units as a vector (the search works on these) ------------------------------------
    @staticmethod
    def eligible_units(num_layers: int, unit: str) -> list[tuple[str, int]]:
        """Units that may be bypassed, in a fixed order: ('layer', i) or ('attn'|'mlp', i)."""
        middle = range(1, num_layers - 1)
        if unit == "layer":
            return [("layer", i) for i in middle]
        return [("attn", i) for i in middle] + [("mlp", i) for i in middle]

    @staticmethod
    def total_units(num_layers: int, unit: str) -> int:
        return num_layers if unit == "layer" else 2 * num_layers

    @classmethod
    def from_units(cls, num_layers: int, unit: str, bypassed: list[tuple[str, int]], **kwargs) -> "RoutingMask":
        attention = {i for kind, i in bypassed if kind in ("layer", "attn")}
        mlp = {i for kind, i in bypassed if kind in ("layer", "mlp")}
        return cls(num_layers, unit, frozenset(attention), frozenset(mlp), **kwargs)

    def bypassed_units(self) -> list[tuple[str, int]]:
        if self.unit == "layer":
            return [("layer", i) for i in sorted(self.skip_attention)]
        return [("attn", i) for i in sorted(self.skip_attention)] + [("mlp", i) for i in sorted(self.skip_mlp)]

    @property
    def ratio(self) -> float:
        return len(self.bypassed_units()) / self.total_units(self.num_layers, self.unit)

    @property
    def empty(self) -> bool:
        return not (self.skip_attention or self.skip_mlp)

    # -- files -----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": MASK_FORMAT,
            "version": 1,
            "model": self.model.to_dict() if self.model else None,
            "num_layers": self.num_layers,
            "unit": self.unit,
            "ratio": round(self.ratio, 6),
            "skip_attention": sorted(self.skip_attention),
            "skip_mlp": sorted(self.skip_mlp),
            **self.info,
        }

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_text(Path(path), json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, path: str | os.PathLike, model: ModelIdentity | None = None) -> "RoutingMask":
        """Read a mask file; with ``model``, refuse a mask made for another model."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise RoutingMaskError(f"mask file {path} does not exist (make one with `tierspec route`)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
            raise RoutingMaskError(f"mask file {path} is not valid JSON: {_one_line(error)}") from None
        if not isinstance(data, dict) or data.get("format") != MASK_FORMAT:
            raise RoutingMaskError(f"{path} is not a tierspec routing mask (no '\"format\": \"{MASK_FORMAT}\"')")
        # Exactly lists of layer indices: "13" was read as layers {1, 3}, 13.7 as 13 and true as 1.
        for key in ("skip_attention", "skip_mlp"):
            layers = data.get(key)
            if not isinstance(layers, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in layers):
                raise RoutingMaskError(f"mask file {path} is malformed: {key} must be a list of layer indices "
                                       f"(integers), got {_one_line(repr(layers))[:80]}")
        if isinstance(data.get("num_layers"), bool) or not isinstance(data.get("num_layers"), int):
            raise RoutingMaskError(f"mask file {path} is malformed: num_layers must be an integer, got "
                                   f"{_one_line(repr(data.get('num_layers')))[:80]}")
        try:
            identity = ModelIdentity(**data["model"]) if data.get("model") else None
            info = {k: v for k, v in data.items() if k not in _MASK_KEYS}
            mask = cls(
                int(data["num_layers"]),
                data["unit"],
                frozenset(data["skip_attention"]),
                frozenset(data["skip_mlp"]),
                identity,
                info,
            )
        except (KeyError, TypeError, ValueError) as error:
            raise RoutingMaskError(f"mask file {path} is malformed: {error}") from None
        if model is not None:
            mask.check_model(model)
        return mask

    def check_model(self, model: ModelIdentity) -> None:
        """Raise unless this mask was made for ``model``."""
        if self.num_layers != model.num_layers:
            raise RoutingMaskError(
                f"this mask is for a model with {self.num_layers} layers; '{model.name}' has {model.num_layers}"
            )
        if self.model is not None and not self.model.matches(model):
            raise RoutingMaskError(f"this mask {self.model.mismatch(model)}; search one for it with `tierspec route`")


_MASK_KEYS = {"format", "version", "model", "num_layers", "unit", "ratio", "skip_attention", "skip_mlp"}


# -- applying a mask ------------------------------------------------------------------------


class _BypassedLayer(torch.nn.Module):
    """Stands in for a whole decoder layer: the residual stream passes through unchanged."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


class _BypassedAttention(torch.nn.Module):
    """Stands in for an attention block: adds nothing to the residual and writes no KV.
    (``bypassed`` tells a layer that knows it, like ``tierspec.llama``'s, to skip the block and
    its norm instead of adding zeros.)"""

    bypassed = True

    def forward(self, hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states), None


class _BypassedMLP(torch.nn.Module):
    bypassed = True

    def forward(self, hidden_states, *args, **kwargs):
        return torch.zeros_like(hidden_states)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's layer list of an HF causal LM (``model.model.layers`` for Llama-likes), or
    of an encoder–decoder model's decoder (``decoder_blocks``)."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return decoder_blocks(model)
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None) or getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise RoutingMaskError(
            f"cannot find the decoder layers of {type(model).__name__}: routing masks support decoder-only "
            "models whose layers are at model.model.layers"
        )
    return layers


_LOCKS: "weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock]" = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def model_lock(model: torch.nn.Module) -> threading.RLock:
    """The lock of one model instance. Every forward pass tierspec runs on a model holds it, and
    so does ``apply_mask`` for as long as modules are swapped: a mask applied in one thread is
    never seen by a pass of another thread on the same model."""
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


@contextmanager
def apply_mask(model: torch.nn.Module, mask: RoutingMask | None) -> Iterator[torch.nn.Module]:
    """Within the block, ``model`` runs with ``mask``'s units bypassed; restored on exit. The
    model's lock is held throughout (see ``model_lock``)."""
    if mask is None or mask.empty:
        yield model
        return
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        with apply_decoder_mask(model, mask):  # T5's blocks take other stand-ins
            yield model
        return
    with model_lock(model):
        with _masked(model, mask):
            yield model


@contextmanager
def _masked(model: torch.nn.Module, mask: RoutingMask) -> Iterator[None]:
    swapped = _swap_in(model, mask)
    try:
        yield
    finally:
        _swap_back(swapped)


def _swap_in(model: torch.nn.Module, mask: RoutingMask) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """Swap ``mask``'s bypassed modules of ``model`` for stand-ins; return (owner, name, original)
    for each swap, in order (a failure part-way puts the earlier swaps back before raising)."""
    layers = decoder_layers(model)
    if len(layers) != mask.num_layers:
        raise RoutingMaskError(f"mask is for {mask.num_layers} layers, the model has {len(layers)}")
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
    try:
        for index in range(mask.num_layers):
            attention, mlp = index in mask.skip_attention, index in mask.skip_mlp
            # a whole layer: an engine layer keeps its place with both units bypassed (the decoder
            # stays one engine call, and no torch attention reads the engine's float16 caches);
            # any other layer is swapped for a pass-through stand-in
            if attention and mlp and getattr(layers[index], "fused", None) is None:
                swapped.append((layers, str(index), layers[index]))
                layers[index] = _BypassedLayer()
                continue
            layer = layers[index]
            for skip, name, stand_in in ((attention, "self_attn", _BypassedAttention), (mlp, "mlp", _BypassedMLP)):
                if not skip:
                    continue
                if not hasattr(layer, name):
                    raise RoutingMaskError(
                        f"{type(layer).__name__} has no '{name}' sub-module; use unit='layer' for this model"
                    )
                swapped.append((layer, name, getattr(layer, name)))
                setattr(layer, name, stand_in())
    except BaseException:
        _swap_back(swapped)
        raise
    return swapped


def _swap_back(swapped: list[tuple[torch.nn.Module, str, torch.nn.Module]]) -> None:
    for owner, name, original in reversed(swapped):
        if isinstance(owner, torch.nn.ModuleList):
            owner[int(name)] = original
        else:
            setattr(owner, name, original)


def masked_copy(model: torch.nn.Module, mask: RoutingMask) -> torch.nn.Module:
    """A second module tree over the very same weights with ``mask``'s units bypassed for good:
    a self-drafter that must run *while* the target runs (PEARL, docs/algorithms.md §PEARL) cannot
    use ``apply_mask``, which swaps modules of the target's own instance under its lock.

    Every tensor the modules hold (parameters, buffers, packed weights kept as attributes) is
    shared, not copied; only the small module objects are new, so the copy costs no weight
    memory and has its own lock (``model_lock``)."""
    import copy

    shared: dict[int, object] = {}
    for module in model.modules():
        for value in (*module._parameters.values(), *module._buffers.values(), *vars(module).values()):
            if isinstance(value, torch.Tensor):
                shared[id(value)] = value
    twin = copy.deepcopy(model, shared)
    if mask is not None and not mask.empty:
        _swap_in(twin, mask)
    return twin


# ---- encoder–decoder models (``seq2seq``): routing over the decoder's units -----------------


def decoder_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's blocks of a T5-style model (``model.decoder.block``)."""
    blocks = getattr(model.get_decoder(), "block", None)
    if not isinstance(blocks, torch.nn.ModuleList):
        raise RoutingMaskError(f"cannot find the decoder blocks of {type(model).__name__}: routing masks support "
                               "T5-style encoder–decoder models whose decoder blocks are at model.decoder.block")
    return blocks


class _BypassedBlock(torch.nn.Module):
    """Stands in for a whole decoder block: the residual stream and the position biases (which
    the first block computes and every later one reuses) pass through unchanged."""

    def forward(self, hidden_states, attention_mask=None, position_bias=None, encoder_hidden_states=None,
                encoder_attention_mask=None, encoder_decoder_position_bias=None, *args, **kwargs):
        return hidden_states, position_bias, encoder_decoder_position_bias


class _BypassedSelfAttention(torch.nn.Module):
    """Stands in for a block's self-attention sub-layer: adds nothing, writes no KV."""

    def forward(self, hidden_states, attention_mask=None, position_bias=None, *args, **kwargs):
        return hidden_states, position_bias, None


class _BypassedFeedForward(torch.nn.Module):
    def forward(self, hidden_states):
        return hidden_states


@contextmanager
def apply_decoder_mask(model: torch.nn.Module, mask: RoutingMask | None) -> Iterator[None]:
    """Within the block, the decoder runs with ``mask``'s units bypassed (stand-ins swapped into
    this model instance, restored in ``finally``; the model's lock is held). The encoder is
    never routed."""
    if mask is None or mask.empty:
        yield
        return
    blocks = decoder_blocks(model)
    if len(blocks) != mask.num_layers:
        raise RoutingMaskError(f"mask is for {mask.num_layers} layers, the decoder has {len(blocks)}")
    swapped: list[tuple[torch.nn.ModuleList, int, torch.nn.Module]] = []
    with model_lock(model):
        try:
            for index in range(mask.num_layers):
                attention, feed_forward = index in mask.skip_attention, index in mask.skip_mlp
                if attention and feed_forward:
                    swapped.append((blocks, index, blocks[index]))
                    blocks[index] = _BypassedBlock()
                    continue
                sublayers = blocks[index].layer  # [self-attention, cross-attention, feed-forward]
                for skip, position, stand_in in ((attention, 0, _BypassedSelfAttention), (feed_forward, -1, _BypassedFeedForward)):
                    if skip:
                        position = position % len(sublayers)
                        swapped.append((sublayers, position, sublayers[position]))
                        sublayers[position] = stand_in()
            yield
        finally:
            for owner, position, original in reversed(swapped):
                owner[position] = original


def _one_line(value) -> str:
    """``value`` as text on one line (an error message quotes what a file held)."""
    return " ".join(str(value).split())
