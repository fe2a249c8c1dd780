"""Sampling modifiers on the target's logits: presence and frequency penalties and a logit bias
(OpenAI's ``presence_penalty``, ``frequency_penalty``, ``logit_bias``), as pure functions of the
logits and the generated tokens before each position (docs/DESIGN.md §9).

At position t the modified logits are

    z'_t(x) = z_t(x) + b(x) − α_f·c_t(x) − α_p·[c_t(x) > 0]

with c_t(x) the count of x among the tokens *generated* before t (the prompt does not count, as
in OpenAI's definition). A verification pass scores several positions at once: row i of a chain
pass comes after the committed text and drafts 1..i, exactly the text that exists if those
drafts are kept, so each row gets the counts of that text (``chain_counts``); a tree node's row
gets its ancestors' (``tree_counts``). ``modified_logits`` of those counts is the definition, over
the whole vocabulary (kept as the reference the tests hold the verifier's path to); the verifier
applies it where it changes a row (``TouchedCounts``). The rule then verifies against the modified target, and
the lossless methods emit what plain decoding under the same modifiers emits; a drafter may
ignore the modifiers (fewer drafts are kept, none wrongly).

The temperature, top-k and top-p apply after the modifiers (``sampling.logits_to_probs``)."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np
import torch

from .errors import TierspecError

#: OpenAI's ranges.
PENALTY_RANGE = (-2.0, 2.0)
BIAS_RANGE = (-100.0, 100.0)


@dataclass(frozen=True)
class LogitModifiers:
    """The modifiers of one generation. ``logit_bias``: (token id, bias) pairs, each id once."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                raise TierspecError(f"{name} must be a number in [{PENALTY_RANGE[0]}, {PENALTY_RANGE[1]}], got {value!r}")
        seen = set()
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise TierspecError(f"logit_bias: token ids are integers >= 0, got {token!r}")
            if token in seen:
                raise TierspecError(f"logit_bias: token id {token} is given twice")
            seen.add(token)
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not BIAS_RANGE[0] <= bias <= BIAS_RANGE[1]:
                raise TierspecError(f"logit_bias: the bias of token {token} must be in [{BIAS_RANGE[0]}, "
                                    f"{BIAS_RANGE[1]}], got {bias!r}")

    @property
    def active(self) -> bool:
        """Whether they change anything (all zero: the logits pass through untouched)."""
        return bool(self.presence_penalty or self.frequency_penalty or any(bias for _, bias in self.logit_bias))

    @property
    def penalised(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty)

    def check_vocabulary(self, vocab_size: int) -> None:
        for token, _ in self.logit_bias:
            if token >= vocab_size:
                raise TierspecError(f"logit_bias: token id {token} is outside the model's vocabulary "
                                    f"(0 .. {vocab_size - 1})")

    def bias_vector(self, vocab_size: int) -> torch.Tensor:
        """b [V] float32."""
        self.check_vocabulary(vocab_size)
        bias = torch.zeros(vocab_size)
        for token, value in self.logit_bias:
            bias[token] = float(value)
        return bias


def token_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """c [V] float32: how often each id occurs in ``tokens`` [n]."""
    return torch.bincount(torch.as_tensor(tokens, dtype=torch.long).reshape(-1), minlength=vocab_size)[:vocab_size].float()


def chain_counts(prior_counts: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """The counts before each row of a chain pass: prior_counts [V] (the generated tokens
    committed so far), drafts [k] → [k+1, V], row i = prior + the counts of drafts[:i]."""
    vocab_size = prior_counts.shape[-1]
    k = int(drafts.shape[0])
    steps = torch.zeros(k + 1, vocab_size)
    if k:
        steps[torch.arange(1, k + 1), drafts.long()] = 1.0
    return prior_counts + steps.cumsum(0)


def tree_counts(prior_counts: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """The counts before each row of a tree pass (``tree.TokenTree``'s tokens [m] and parents [m],
    −1 = the root): [1+m, V], row 0 = prior (after the root), row 1+i = prior + the counts of
    node i's path (its ancestors and itself)."""
    rows = [prior_counts]
    for token, parent in zip(tokens.tolist(), parents.tolist()):
        row = rows[parent + 1].clone()  # parent −1 → row 0; a parent precedes its children
        row[token] += 1.0
        rows.append(row)
    return torch.stack(rows)


class TouchedCounts:
    """A generation's modifiers applied where they change a row: its generated tokens' counts and its
    biased tokens, each in a slot of growing buffers (token ids, counts, biases), updated by ``add``
    at every commit. ``modify`` writes ``modified_logits`` of the rows' counts (``chain_counts``,
    ``tree_counts``) into the rows at those tokens only, with the same operations in the same order
    (the bias as float32, then the rows' dtype, as ``bias_vector``): every value is the dense
    formula's, but for the sign of a zero (an untouched −0 stays −0 where the formula adds +0).

    Why: the dense counts [r, V] and the operators over every row's whole vocabulary cost a sequence
    about 0.2 ms a cycle after the pass on a Zen 4 (docs/history.md, stop 71: verifying and committing a
    batch of 8 under two penalties, 2.4–2.8 → 0.9–1.2 ms a cycle); here a cycle's work is its
    rows' gather and scatter over the touched tokens and its drafts' few counts, however long the text —
    in numpy since stop 72 (``modify``: verifying a batch of 8, 0.76–0.97 → 0.38–0.62 ms a cycle)."""

    def __init__(self, modifiers: LogitModifiers, vocab_size: int, generated: list[int] = ()):
        modifiers.check_vocabulary(vocab_size)
        self.modifiers, self.vocab_size = modifiers, vocab_size
        self._slots: dict[int, int] = {}  # token → its slot in the buffers below
        self._ids = np.empty(64, dtype=np.int64)  # each slot's token, count and bias (float32, as ``bias_vector``)
        self._counts = np.zeros(64, dtype=np.float32)
        self._bias = np.zeros(64, dtype=np.float32)
        for token, value in modifiers.logit_bias:  # (ids checked above)
            slot = self._slot(token)  # (first: it may replace the buffers)
            self._bias[slot] = value
        self.add(generated)

    def _slot(self, token: int) -> int:
        """``token``'s slot, a new one for a token not seen (an id the caller checked); the buffers
        double when full."""
        slot = self._slots.get(token)
        if slot is None:
            slot = len(self._slots)
            if slot == len(self._ids):
                self._ids, self._counts, self._bias = (np.concatenate([buffer, np.zeros_like(buffer)])
                                                       for buffer in (self._ids, self._counts, self._bias))
            self._slots[token] = slot
            self._ids[slot] = token
        return slot

    def add(self, tokens) -> None:
        """Count committed generated ``tokens`` (ints): all of them, or none where one is not in the
        vocabulary."""
        tokens = [operator.index(token) for token in tokens]  # a tensor's elements would hash apart
        bad = next((token for token in tokens if not 0 <= token < self.vocab_size), None)
        if bad is not None:
            raise TierspecError(f"token id {bad} is not in the vocabulary (0 .. {self.vocab_size - 1})")
        for token in tokens:
            slot = self._slot(token)  # (first: it may replace the buffers)
            self._counts[slot] += 1.0

    def modify(self, rows: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """``rows`` [r, V] (float32 or float64; another dtype is made float32 first) under the
        modifiers, row i counting the generated tokens and ``paths[i]`` (the tokens drafted before it,
        ``TokenTree.row_paths``), written where they lie. Returns the rows.

        On the CPU through a numpy view of the rows: a few numpy calls on the touched columns, where the
        same steps as a dozen torch operators, each cold right after a pass, cost a sequence 0.04–0.05
        ms more a cycle in a batch of 8 (``benchmarks/batch_cycle.py`` under two penalties on a Zen 4,
        BENCHMARKS.md at 6a93e8c, stop 72). Rows that track gradients, and inference tensors outside inference
        mode, go through torch's operators instead (``_modify_on``): a write through numpy would pass
        by autograd's and inference mode's checks. The operations are the same ones in the same order (a
        float32 or float64 row's gather, + the float32 bias, − the penalty times the counts, the
        penalty cast to the rows' dtype as torch casts a scalar, then the scatter)."""
        if rows.dtype not in (torch.float32, torch.float64):
            rows = rows.float()
        if len(paths) != rows.shape[0] or rows.shape[-1] != self.vocab_size:
            raise TierspecError(f"rows {tuple(rows.shape)} need {rows.shape[0]} paths over a vocabulary of "
                                f"{self.vocab_size}, got {len(paths)} paths")
        known = len(self._slots)
        extra: dict[int, int] = {}  # drafted tokens not yet counted: slots of this call only
        steps_rows, steps_slots = [], []
        for row, path in enumerate(paths):
            for token in path:
                slot = self._slots.get(token)
                if slot is None:
                    if not 0 <= token < self.vocab_size:
                        raise TierspecError(f"drafted token id {token} is not in the vocabulary")
                    slot = known + extra.setdefault(token, len(extra))
                steps_rows.append(row)
                steps_slots.append(slot)
        width = known + len(extra)
        if not width:
            return rows
        ids, base, bias = self._ids[:known], self._counts[:known], self._bias[:known]
        if extra:
            ids = np.concatenate([ids, np.fromiter(extra, dtype=np.int64, count=len(extra))])
            base = np.concatenate([base, np.zeros(len(extra), dtype=np.float32)])
            bias = np.concatenate([bias, np.zeros(len(extra), dtype=np.float32)])
        counted = np.repeat(base[None, :], len(paths), axis=0)
        for row, slot in zip(steps_rows, steps_slots):
            counted[row, slot] += 1.0
        if rows.device.type != "cpu" or rows.requires_grad or (rows.is_inference() and not torch.is_inference_mode_enabled()):
            return self._modify_on(rows, torch.from_numpy(ids), torch.from_numpy(counted), torch.from_numpy(bias))
        table = rows.numpy()
        kind = table.dtype.type
        counted = counted.astype(table.dtype, copy=False)
        modifiers = self.modifiers
        touched = table[:, ids]
        if modifiers.logit_bias:
            touched = touched + bias.astype(table.dtype, copy=False)
        if modifiers.frequency_penalty:
            touched = touched - kind(modifiers.frequency_penalty) * counted
        if modifiers.presence_penalty:
            touched = touched - kind(modifiers.presence_penalty) * (counted > 0).astype(table.dtype)
        table[:, ids] = touched
        return rows

    def _modify_on(self, rows: torch.Tensor, ids: torch.Tensor, counted: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``modify`` by torch's operators (``modified_logits`` of the touched columns): rows off the CPU,
        rows tracking gradients, inference tensors outside inference mode (where torch refuses the
        write, as before)."""
        device = rows.device
        ids = ids.to(device)
        bias = bias.to(device) if self.modifiers.logit_bias else None
        rows[:, ids] = modified_logits(rows[:, ids], counted.to(device), self.modifiers, bias)
        return rows


def modified_logits(logits: torch.Tensor, counts: torch.Tensor, modifiers: LogitModifiers,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """z' = z + b − α_f·c − α_p·[c > 0]: logits [r, V], counts [r, V] (``chain_counts``,
    ``tree_counts``) → [r, V], float32 (float64 logits stay float64). ``bias``:
    ``modifiers.bias_vector`` when already built."""
    vocab_size = logits.shape[-1]
    result = logits if logits.dtype == torch.float64 else logits.float()
    if bias is None and modifiers.logit_bias:
        bias = modifiers.bias_vector(vocab_size)
    if bias is not None:
        result = result + bias.to(result.dtype)
    if modifiers.frequency_penalty:
        result = result - modifiers.frequency_penalty * counts.to(result.dtype)
    if modifiers.presence_penalty:
        result = result - modifiers.presence_penalty * (counts > 0).to(result.dtype)
    return result
