"""A model with its own KV cache, the interface the decode loop runs every model through.

``CachedModel`` is what the loop, the drafters and the cost measurements call a model by: a
forward pass that appends to the cache and returns one ``PassResult``, and a rollback that
trims the cache back to a committed length. Its invariant (below) is what the loop's commit
step relies on. Another kind of model (an encoder–decoder, say) joins the loop by offering the
same members: ``length``, ``vocab_size``, ``device``, ``reserve``, ``forward`` (→
``PassResult``), ``rollback``, ``replay``, ``layer_lengths`` (and ``compact`` for token trees).

Also here: ``HiddenCapture`` (the one place hidden states are taken from a pass, by forward
hooks), the adapter that gives a transformers ``DynamicCache`` tierspec's in-place KV buffer,
and ``SlimVocabulary`` (VIA-SD's slim tier scoring only a draft head's vocabulary).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Iterator

import torch

from . import engine  # its functions read at the call: a test may wrap them
from .errors import ModelLoadError, TierspecError
from .models import output_vocabulary_size
from .quant import QuantLinear, embedded_rows
from .layerskip.masks import apply_mask, decoder_layers, model_lock


@dataclass(slots=True)
class PassResult:
    """What one forward pass returns.

    logits: [m, V] float32 on the CPU, the last m positions' (``logits_for``).
    hidden: [n, W] float32 on the CPU when the pass was asked for hidden states (None when not):
            the final hidden states (the LM head's input) of all n positions the pass ran,
            followed by the outputs of the decoder layers asked for (W = H·(1 + layers)).
    """

    logits: torch.Tensor
    hidden: torch.Tensor | None = None
    first_maxima: list[int] | None = None  # each logits row's ``sampling.first_maxima``, where the pass found them
    keyed_draws: list[int] | None = None  # each logits row's keyed draw (``RowDraws``), where the pass made them


@dataclass(slots=True)
class RowDraws:
    """The keyed draws a pass makes in its LM head's product for a sequence's scored rows: row i's
    token argmax_v(logits[i, v] / ``temperature`` + g_i(v)) under the Gumbel noise of ``keys[i]``
    (``sampling.keyed_tokens`` of ``sampling.sampling_logits`` without top-k or top-p, bit for bit:
    under them a candidate the walk checks, ``sampling.keyed_allowed_tokens``), drawn by the engine's
    threads from each chunk of the product while it is in their caches; rows past
    ``keys`` are not drawn. A backend that cannot draw (a solo pass, a head that is not quantised)
    returns none: the caller draws them itself."""

    keys: list[int]
    temperature: float


class HiddenCapture:
    """Forward hooks that collect, pass by pass, a model's final hidden states (its decoder's
    output, the LM head's input: [B, n, H]) and the outputs of decoder ``layers`` ([B, n, H]
    each). A context manager: the hooks are removed on leaving it (or by ``close``)."""

    def __init__(self, model: torch.nn.Module, layers=()):
        self.layers = tuple(layers)
        self.final: list[torch.Tensor] = []
        self.aux: dict[int, list[torch.Tensor]] = {i: [] for i in self.layers}
        self._handles = [model.get_decoder().register_forward_hook(self._on_decoder)]
        if self.layers:
            stack = decoder_layers(model)
            for index in self.aux:  # each layer hooked once, even if named twice
                self._handles.append(stack[index].register_forward_hook(self._on_layer(index)))

    def _on_decoder(self, module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        self.final.append(hidden.detach())

    def _on_layer(self, index: int):
        def hook(module, args, output):
            self.aux[index].append((output[0] if isinstance(output, tuple) else output).detach())

        hook.observes_only = True  # reads the output, returns nothing: the engine may capture it inside its call
        return hook

    def take(self) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Everything captured since the last call, concatenated along time, on the CPU:
        final [B, N, H] and {layer: [B, N, H]}."""
        final = torch.cat(self.final, dim=1).cpu()
        aux = {i: torch.cat(parts, dim=1).cpu() for i, parts in self.aux.items()}
        self.final.clear()
        for parts in self.aux.values():
            parts.clear()
        return final, aux

    def features(self) -> torch.Tensor:
        """What ``take`` holds for a batch of one, as one float32 row per position: the final
        hidden state, then each captured layer's output [N, H·(1 + len(layers))]."""
        final, aux = self.take()
        return torch.cat([final[0].float()] + [aux[i][0].float() for i in self.layers], dim=-1)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> "HiddenCapture":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@functools.lru_cache(maxsize=None)
def _growing_layer_class():
    from transformers.cache_utils import DynamicLayer

    from .llama import KVLayer

    class GrowingLayer(KVLayer, DynamicLayer):
        """A transformers cache layer with ``tierspec.llama.KVLayer``'s buffer (reserved ahead,
        reallocated in whole blocks past that): appending writes in place instead of concatenating
        the whole cache every step, and a rollback only moves the length."""

        def __init__(self):
            DynamicLayer.__init__(self)
            KVLayer.__init__(self)

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.device = key_states.device
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            return KVLayer.update(self, key_states, value_states)

        def reset(self) -> None:
            KVLayer.__init__(self)
            self.is_initialized = False

    return GrowingLayer


class SlimVocabulary:
    """The rows of a model's LM head that a slim pass scores (VIA-SD's slim tier over a draft
    head's vocabulary). The rows are copied once; a pass then costs K·H instead of V·H in its
    LM head. Tokens outside get logit −inf: the slim distribution is the target-under-mask's
    softmax renormalised over the K tokens (zero mass elsewhere)."""

    def __init__(self, model: torch.nn.Module, token_ids: torch.Tensor):
        weight = model.get_output_embeddings().weight.detach()
        self.token_ids = torch.as_tensor(token_ids, dtype=torch.long).cpu()
        if self.token_ids.numel() == 0 or int(self.token_ids.max()) >= weight.shape[0] or int(self.token_ids.min()) < 0:
            raise ModelLoadError(f"slim vocabulary ids must lie in 0..{weight.shape[0] - 1}")
        self.rows = weight[self.token_ids.to(weight.device)].contiguous()  # [K, H]
        self.vocab_size = int(weight.shape[0])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-width logits [m, V] (float32, CPU) from final hidden states [m, H]."""
        from .kernels import few_row_linear

        scores = few_row_linear(hidden, self.rows.to(hidden.dtype), None).float().cpu()
        out = torch.full((hidden.shape[0], self.vocab_size), float("-inf"))
        out[:, self.token_ids] = scores
        return out


class CachedModel:
    """A causal LM with its own KV cache and the number of committed tokens the cache holds.

    Invariant (docs/algorithms.md §The decode loop): after every commit the cache holds KV for exactly the committed
    tokens this model has processed, i.e. positions 0 .. ``length`` − 1 of the committed
    sequence. ``forward`` appends; ``rollback`` trims every layer back to a committed length.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.own_cache = hasattr(model, "new_kv_cache")  # a model on tierspec.llama: its ``KVCache``, else transformers'
        self.cache = self._new_cache()
        self.length = 0
        self.vocab_size = output_vocabulary_size(model)
        self.device = next(model.parameters()).device

    def _new_cache(self):
        """tierspec's own cache for models on ``tierspec.llama``; for transformers models a
        DynamicCache whose plain (non-sliding) layers append in place (see GrowingLayer)."""
        if self.own_cache:
            return self.model.new_kv_cache()
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache(config=self.model.config)
        if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
            cache.layers = [_growing_layer_class()() for _ in cache.layers]
        return cache

    def reset(self) -> None:
        self.cache = self._new_cache()
        self.length = 0

    def reserve(self, positions: int) -> None:
        """Allocate the cache for ``positions`` positions now (a generation knows its prompt and
        budget), so no pass has to grow it."""
        for layer in self.cache.layers:
            if hasattr(layer, "reserve"):
                layer.reserve(positions)

    def forward(self, token_ids: torch.Tensor, logits_for: int | None = None, mask=None, with_hidden: bool = False,
                hidden_layers: tuple[int, ...] = (), vocabulary: SlimVocabulary | None = None,
                offsets: torch.Tensor | None = None, attends: torch.Tensor | None = None) -> PassResult:
        """Run ``token_ids`` [n] at positions ``length ..``; the ``PassResult`` holds logits
        [m, V] (float32) and, with ``with_hidden``, hidden states.

        ``logits_for`` = m keeps only the last m positions' logits (None = all n); the LM head
        over a long prompt is a large share of a prefill on a small model. With a routing
        ``mask`` the pass runs with the mask's units bypassed (they write no KV). ``with_hidden``
        also returns the LM head's input (the final hidden states) of *all* n positions [n, H],
        captured from this very pass; with ``hidden_layers`` the outputs of those decoder layers
        follow it, concatenated: [n, H·(1 + len(hidden_layers))]. With a ``vocabulary`` the LM
        head scores only its rows (the others are −inf).

        The pass holds the model's lock (``layerskip.masks.model_lock``): a mask swaps modules of the
        shared model instance, so no other pass on it may run meanwhile (two generations on one
        loaded model in two threads are serialised pass by pass, each with its own cache).

        A token-tree pass (``tree.tree_pass``; tierspec's own Llama forward only) gives each token
        its position as ``length`` + ``offsets`` [n] and the mask ``attends`` [n, n] among the new
        tokens; they are written at slots ``length ..`` as any pass, and ``compact`` keeps the
        accepted path afterwards.
        """
        n = int(token_ids.shape[0])
        device = self.device
        if attends is not None and not hasattr(self.model, "new_kv_cache"):
            raise TierspecError(f"token-tree passes run on tierspec's own Llama forward only, not on {type(self.model).__name__} "
                                "(load the model with implementation='tierspec')")
        if offsets is None:
            positions = torch.arange(self.length, self.length + n, device=device).unsqueeze(0)
        else:
            positions = (self.length + offsets.to(device)).unsqueeze(0)
        tree_kwargs = {} if attends is None else {"attends": attends}
        token_ids = token_ids.to(device)
        kept = n if logits_for is None else logits_for
        # Hooks go on the modules of the masked model: a layer the mask bypasses outputs its
        # input (the stand-in's output), as the masked model computes it.
        with model_lock(self.model), apply_mask(self.model, mask):
            with HiddenCapture(self.model, hidden_layers) if with_hidden else contextlib.nullcontext() as capture:
                if vocabulary is None:
                    output = self.model(input_ids=token_ids.unsqueeze(0), position_ids=positions, cache=self.cache,
                                        use_cache=True, logits_to_keep=kept, **tree_kwargs)
                else:  # the decoder alone, then only the vocabulary's LM-head rows
                    states = self.model.get_decoder()(input_ids=token_ids.unsqueeze(0), position_ids=positions,
                                                      cache=self.cache, use_cache=True, **tree_kwargs).last_hidden_state[0]
        self.length += n
        # The loop's bookkeeping lives on the CPU: results cross back here, once per pass (which
        # also makes the loop's clocks honest on an asynchronous device).
        logits = output.logits[0].float().cpu() if vocabulary is None else vocabulary.logits(states[-kept:])
        return PassResult(logits, None if capture is None else capture.features())

    def replay(self, start: int, token_ids: torch.Tensor, mask=None) -> torch.Tensor:
        """Logits [n, V] of ``token_ids`` run at positions ``start ..`` (already processed ones),
        reading the cached KV before ``start``; afterwards the cache is exactly as before."""
        with self.set_aside(start):
            return self.forward(token_ids, mask=mask).logits

    @contextlib.contextmanager
    def set_aside(self, start: int) -> Iterator[None]:
        """Within the block the cache holds positions 0 .. ``start`` − 1 only; whatever runs there
        (a replay, CLaSP's layer selection) may append; on exit the cache is exactly as before.

        The KV of positions ``start .. length`` is set aside and put back (a rollback of a few
        positions, not a copy of the prefix)."""
        if not 0 <= start <= self.length:
            raise ValueError(f"cannot set aside the cache from {start}: it holds {self.length} positions")
        length = self.length
        saved = []
        for layer in self.cache.layers:
            keys = getattr(layer, "keys", None)
            if keys is None or keys.dim() != 4:
                saved.append(None)
            else:
                saved.append((keys[..., start:, :].clone(), layer.values[..., start:, :].clone()))
        self.rollback(start)
        try:
            yield
        finally:
            self.rollback(start)
            with torch.inference_mode():
                for layer, kept in zip(self.cache.layers, saved):
                    if kept is not None and kept[0].shape[-2]:
                        layer.update(kept[0], kept[1])
            self.length = length

    def rollback(self, length: int) -> None:
        """Trim every layer's KV to the first ``length`` positions (no-op where shorter).

        Layers are trimmed one by one because layers that a routing mask bypassed hold fewer
        positions than the others (DynamicCache.crop removes the same count from every layer).
        """
        if length > self.length:
            raise ValueError(f"cannot roll back to {length}: the cache holds only {self.length} positions")
        if length == self.length:  # no layer holds more than ``length``: nothing to trim
            return
        if self.own_cache:  # tierspec's own cache (``llama.KVCache``): every layer at once
            self.cache.trim(length)
            self.length = length
            return
        for layer in self.cache.layers:
            if hasattr(layer, "trim"):
                layer.trim(length)
                continue
            keys = getattr(layer, "keys", None)
            if keys is not None and keys.dim() == 4 and keys.shape[-2] > length:
                layer.keys = keys[..., :length, :]
                layer.values = layer.values[..., :length, :]
        self.length = length

    def compact(self, start: int, slots: torch.Tensor) -> None:
        """After a token-tree pass: keep the KV at cache ``slots`` [L] (increasing, in start ..
        length − 1: the accepted path's nodes) as positions start .. start + L − 1 and drop every
        other position after ``start``. Invariant afterwards: ``length`` = start + L, every layer
        holding exactly that many positions."""
        slots = torch.as_tensor(slots, dtype=torch.long).reshape(-1)
        if not 0 <= start <= self.length or (len(slots) and (int(slots.min()) < start or int(slots.max()) >= self.length
                                                              or not bool((slots[1:] > slots[:-1]).all()))):
            raise ValueError(f"cannot keep slots {slots.tolist()} from {start}: the cache holds {self.length} positions "
                             "and the slots must increase within start .. length − 1")
        for layer in self.cache.layers:
            if not hasattr(layer, "compact"):
                raise TierspecError("token-tree passes run on tierspec's own Llama forward only")
            if layer.length != self.length:  # a routing mask's bypassed layer: nothing of the tree there
                raise ValueError("cannot compact a cache whose layers hold different lengths (a masked pass ran last)")
            layer.compact(start, slots)
        self.length = start + len(slots)

    def layer_lengths(self) -> list[int]:
        """Positions held by each layer (for tests of the rollback invariant)."""
        lengths = []
        for layer in self.cache.layers:
            keys = getattr(layer, "keys", None)
            lengths.append(0 if keys is None or keys.dim() != 4 else int(keys.shape[-2]))
        return lengths


# ---- batched passes: several sequences' new rows in one pass -----------------------------------------


@dataclass(slots=True)
class BatchItem:
    """One sequence's part of a batched pass: its ``runner`` (a CachedModel on the shared model),
    its new ``token_ids`` [n] (int64, or a list of ints), the last ``logits_for`` rows to score (None: all), and for a token
    tree its position ``offsets`` [n] and ``attends`` [n, n] (as ``CachedModel.forward`` takes them);
    ``draws``: the keyed draws of its scored rows (``RowDraws``), where the LM head can make them;
    ``hidden_into``: float32 [n, H·(1 + captured layers)] contiguous, where its hidden states are
    written (its result's ``hidden`` is then this tensor), or None."""

    runner: CachedModel
    token_ids: torch.Tensor | list[int]
    logits_for: int | None = None
    offsets: torch.Tensor | None = None
    attends: torch.Tensor | None = None
    draws: RowDraws | None = None
    hidden_into: torch.Tensor | None = None


def run_stack_rows(stack, begin: int, end: int, hidden: torch.Tensor, segments: list, rotary: tuple,
                   flags: bytes) -> torch.Tensor:
    """Layers ``begin .. end − 1`` of an engine ``stack`` (its capsule) over the rows ``hidden``
    [R, H] (float32, contiguous) of several sequences, each over its own cache: ``segments`` one
    ``engine.Segment`` per sequence (its first row, rows, cache start, KV table, tree mask, positions);
    ``rotary`` the rows' rotary tables ((cos, sin) [R, rotary_dims] each, by the layers' table
    numbers: ``Decoder.engine_rotary``); ``flags`` one byte per layer (which units run). Returns the
    output rows [R, H]. The draft head's batched step comes here (the target's batched pass calls
    ``engine.run_stack`` itself, to copy the head's layers out inside the one call)."""
    out = torch.empty_like(hidden)
    engine.run_stack(stack, hidden, out, segments, rotary, flags, begin, end)
    return out


def batched_pass(model: torch.nn.Module, items: list[BatchItem],
                 hidden_layers: tuple[int, ...] | None = None) -> list[PassResult]:
    """Every item's pass in one: the products over all rows at once (a pass of R rows costs about
    what a pass of R rows of one sequence costs), attention per sequence over its own cache. Each
    item's ``PassResult`` is exactly (bitwise) what its own ``runner.forward`` would give: the
    products are row-independent and nothing of one sequence reaches another. With
    ``hidden_layers`` (None: no hidden states) every result carries the final hidden states and
    those layers' outputs, as ``CachedModel.forward(with_hidden=True)`` does. Each runner's cache
    advances by its rows (the same invariant as a solo pass). It runs no module's hooks
    (``runs_as_one_stack``)."""
    decoder = model.model
    if decoder.engine_stack is None:
        raise ValueError("batched passes run on the pass engine: every layer of the model must be fused")
    if not items:
        return []
    with model_lock(model):  # as every pass on the model: no mask of another thread's swaps its modules meanwhile
        return _batched_pass(model, decoder, items, hidden_layers)


def runs_as_one_stack(model: torch.nn.Module) -> bool:
    """Whether a pass of ``model`` may skip its modules' calls (``batched_pass``, one sequence or
    many): no forward hook, global or on the model, its decoder, embedding, final norm, LM head
    or a decoder layer, which a module call would run (a solo pass runs a hooked layer as a module
    call, ``llama.Decoder._engine_forward``; an observer such as ``HiddenCapture`` too). Looked at
    every pass: a hook may come and go between two."""
    from torch.nn.modules import module as modules

    if modules._global_forward_hooks or modules._global_forward_pre_hooks:
        return False
    decoder = model.model
    for part in (model, decoder, decoder.embed_tokens, decoder.norm, model.lm_head, *decoder.layers):
        state = part.__dict__
        if state["_forward_hooks"] or state["_forward_pre_hooks"]:
            return False
    return True


def _batched_pass(model: torch.nn.Module, decoder: torch.nn.Module, items: list[BatchItem],
                  hidden_layers: tuple[int, ...] | None) -> list[PassResult]:
    for item in items:
        if item.runner.model is not model:
            raise ValueError("every sequence of a batched pass must run on the same model")
    if len({id(item.runner) for item in items}) != len(items):
        raise ValueError("a sequence appears twice in one batched pass")
    first = decoder.layers[0].fused
    # One sequence's part of the pass at a time in Python only where it is its own (its cache's
    # start, KV table and invariant, its tokens); the rows' positions and rotary factors, the
    # rows kept for the LM head and the results are made for every row at once.
    rows, sequences, ids, positions = 0, [], [], []
    for item in items:
        runner, tokens = item.runner, item.token_ids
        if not isinstance(tokens, list):  # every sequence's ids joined as ints, one tensor made of them
            tokens = tokens.reshape(-1).tolist()
        n = len(tokens)
        if n < 1:
            raise ValueError("every sequence of a batched pass needs at least one new token")
        start = runner.length
        cache = runner.cache
        table = cache.engine_table(start + n, first.kv_heads, first.head_dim, first.kv_dtype)
        own, seen = None, None  # a chain's rows sit at start, start + 1, … (the engine's default)
        if item.offsets is None:
            positions.extend(range(start, start + n))
        else:
            own = (start + item.offsets.reshape(-1)).to("cpu", torch.int64).contiguous()
            positions.extend(own.tolist())
        if item.attends is not None:
            seen = item.attends.to("cpu", torch.uint8).contiguous()
            if tuple(seen.shape) != (n, n) or bool(seen.triu(1).any()):
                raise ValueError(f"a tree mask for {n} tokens has shape ({n}, {n}) and lets a token see earlier ones only")
        cache.check_start(start)
        sequences.append(engine.Segment(rows, n, start, table, seen, positions=own))
        ids += tokens
        rows += n
    if len(items) == 1 and items[0].offsets is None:  # a lone chain: its rows of each table, as views
        rotary = decoder.engine_rotary_chain(sequences[0].start, rows)
    else:  # each kind's table over every row
        rotary = decoder.engine_rotary(torch.tensor(positions, dtype=torch.int64))
    hidden = embedded_rows(decoder.embed_tokens, torch.tensor(ids, dtype=torch.long))  # [rows, H]
    width = int(hidden.shape[1]) * (1 + len(hidden_layers or ()))
    for item, segment in zip(items, sequences):  # checked before the pass: a bad one changes no cache
        into = item.hidden_into
        if into is not None and (hidden_layers is None or into.dtype != torch.float32 or not into.is_contiguous()
                                 or tuple(into.shape) != (segment.rows, width)):
            raise ValueError(f"a sequence's hidden states of {segment.rows} rows go into float32 ({segment.rows}, "
                             f"{width}) contiguous (with hidden layers asked for), not {into.dtype} {tuple(into.shape)}")
    flags = decoder.engine_stack.every_unit
    last = len(decoder.layers) - 1
    # The layers a draft head reads are copied out inside the one stack call (``run_stack``'s
    # captures). With a call per captured layer a featured pass of 8 sequences cost 1.5 ms more than
    # a plain one; in one call 0.7 (fastest of 40 each, alternating).
    captured = {layer: torch.empty_like(hidden) for layer in set(hidden_layers or ()) if layer != last}
    out = torch.empty_like(hidden)
    engine.run_stack(decoder.engine_stack.capsule, hidden, out, sequences, rotary, flags, 0, last + 1, captures=captured)
    hidden = captured[last] = out
    final = decoder.final_norm(hidden)  # [rows, H], as a solo pass normalises its rows
    picks, spans = [], []  # the rows each sequence keeps for the LM head, and where its logits lie
    keys, temperatures = None, None  # each kept row's draw, where a sequence asks for them
    for item, segment in zip(items, sequences):
        row0, n = segment.first_row, segment.rows
        item.runner.cache.advance(n)
        item.runner.length += n
        m = n if item.logits_for is None else item.logits_for
        if item.draws is not None and keys is None:
            keys, temperatures = [None] * len(picks), [1.0] * len(picks)
        if keys is not None:
            drawn = item.draws.keys[:m] if item.draws is not None else []
            keys += drawn + [None] * (m - len(drawn))
            temperatures += [item.draws.temperature if item.draws is not None else 1.0] * m
        spans.append((len(picks), m))
        picks.extend(range(row0 + n - m, row0 + n))
    logits, maxima, draws = _scored(model.lm_head, final if len(picks) == rows else final.index_select(0, torch.tensor(picks)),
                                    keys, temperatures)
    results = []
    for item, segment, (at, m) in zip(items, sequences, spans):
        hidden_states = None
        if hidden_layers is not None:
            row0, n = segment.first_row, segment.rows
            parts = [final[row0 : row0 + n]] + [captured[i][row0 : row0 + n] for i in hidden_layers]
            if item.hidden_into is None:
                hidden_states = torch.cat(parts, dim=-1)  # float32 as its parts
            else:  # where the caller keeps them (a generation's feature log): nothing to copy after the pass
                hidden_states = torch.cat(parts, dim=-1, out=item.hidden_into)
        if m == len(picks):
            results.append(PassResult(logits, hidden_states, maxima, draws))
        else:
            results.append(PassResult(logits[at : at + m], hidden_states, None if maxima is None else maxima[at : at + m],
                                      None if draws is None else draws[at : at + m]))
    return results


def _scored(lm_head: torch.nn.Module, final: torch.Tensor, keys: list[int | None] | None = None,
            temperatures: list[float] | None = None) -> tuple[torch.Tensor, list[int] | None, list[int] | None]:
    """The LM head's float32 logits of a batched pass's rows ``final`` [m, H], each row's first
    maximum where the engine found it in the product, and each keyed row's draw (``keys``: a key or
    None per row, None for no draws; ``RowDraws``): a quantised head's product called directly on
    float32 contiguous rows (the engine's norm gives them); any other head, or rows of another kind
    (a model's own norm module's), through its module (no maxima, no draws)."""
    if type(lm_head) is QuantLinear and final.dtype == torch.float32 and final.is_contiguous():
        if keys is None:
            return (*lm_head.qweight.multiply_with_maxima(final), None)
        return lm_head.qweight.multiply_with_draws(final, keys, temperatures)
    return lm_head(final).float(), None, None
