"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the context's
last n tokens (Saxena 2023; transformers' ``prompt_lookup_num_tokens``). No model, no
distribution (rules treat the drafts as one-hot)."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import TierspecError
from ..proposal import DraftRequest, Proposal
from .base import Drafter


def suffix_matches(context: np.ndarray, n: int) -> np.ndarray:
    """The starts s (ascending) of every earlier occurrence of ``context``'s last ``n`` tokens:
    context[s : s + n] equals them and s + n ≤ len(context) − 1 (the suffix itself excluded).

    Candidates are the positions holding the last token, then filtered one token further back at
    a time: a few small array operations however long the context, where comparing every window
    of n tokens costs a pass over the whole context per n."""
    length = len(context)
    if n < 1 or length < n + 1:
        return context[:0].astype(np.int64)
    ends = np.flatnonzero(context[: length - 1] == context[length - 1])  # where a match would end
    ends = ends[ends >= n - 1]
    for back in range(1, n):
        if not ends.size:
            break
        ends = ends[context[ends - back] == context[length - 1 - back]]
    return ends - (n - 1)


#: New positions up to which ``NgramDrafter._indexed`` stores each n-gram in a Python loop (a cycle's
#: tokens: a block of 10 drafts accepted whole commits 11); more (a prompt, the text after a pause of
#: the lookup) are keyed by array operations and stored by the interpreter's C loops, whose set-up
#: costs a few microseconds but whose entries cost a fraction of the loop's. Measured warm with packed
#: keys on a Zen 4 (results/zen4/stop74/index_crossover.py): one position 2.4 µs by the loop, 7.3 by
#: the arrays; they cross at 14–16 positions (9.5–10.5 µs); 64 positions 39.2 → 20.1 µs.
BULK_INDEX = 14

#: Bits a token takes in a packed n-gram key (``ngram_key``). Ids below 2**21 (SmolLM2's vocabulary
#: has 49,152, Gemma 3's 262,144) pack three to an int64, so a prompt's keys are computed by numpy.
KEY_BITS = 21
_PACKABLE = 1 << KEY_BITS
#: The longest n-gram whose packed key fits an int64 (the array path; longer ones are packed in Python).
_ARRAY_SIZES = 63 // KEY_BITS


def ngram_key(gram, packed: bool = True):
    """The index's key of the n-gram ``gram`` (its tokens in order) — the definition the index's paths
    compute incrementally (``_index_each``, ``_index_bulk``, ``_latest_match``): its tokens packed into one int,
    the first in the highest ``KEY_BITS`` bits (``packed``: the text's every id is below 2**KEY_BITS),
    else the tuple of them. One n's keys are one size's dictionary: packing is one-to-one there.

    Why ints: a tuple is a container the garbage collector tracks, and the index of a generation's
    text holds one per position and size — on the default model at 8 sequences with tuples, 11 young
    collections and an older one (1.0 ms) came in 133 cycles, with packed ints 4 young ones
    (results/zen4/stop74/gc_collections.log) — while an int is not tracked, and hashes without
    reading its items."""
    if not packed:
        return tuple(gram)
    key = 0
    for token in gram:
        key = (key << KEY_BITS) | token
    return key


class NgramDrafter(Drafter):
    """Match the last ``ngram_size`` .. ``min_ngram_size`` tokens (longest first) against the
    earlier context; the most recent match wins, since nearby text repeats most reliably.

    Each drafted token is labelled ("ngram", n) with the size n of the match that produced it:
    a draft-length policy learns how often each match size is right."""

    has_distribution = False

    def __init__(self, ngram_size: int = 3, min_ngram_size: int = 1):
        if not 1 <= min_ngram_size <= ngram_size:
            raise TierspecError(f"need 1 <= min_ngram_size <= ngram_size, got {min_ngram_size}, {ngram_size}")
        self.ngram_size = ngram_size
        self.min_ngram_size = min_ngram_size
        self.source: np.ndarray | None = None  # an encoder–decoder generation's source tokens
        self._forget()

    def _forget(self) -> None:
        # The text searched (the source, then the committed tokens) and, per n-gram size n, where
        # each n-gram (its key: ``ngram_key``) last ended in it (positions before the text's last: a
        # suffix never matches itself). Grown by the tokens committed since the last proposal, so a
        # proposal is one dictionary read per size however long the context, where scanning every
        # earlier place of the last token walked hundreds of places of a common token in Python.
        self._text: list[int] = [] if self.source is None else self.source.tolist()
        self._last_end: list[dict] = [{} for _ in range(self.ngram_size)]
        self._ended = 0  # n-grams ending before this position are in ``_last_end``
        self._packed = self._packable(self._text)  # the keys are packed ints (else tuples)

    @staticmethod
    def _packable(tokens: list[int]) -> bool:
        return not tokens or (min(tokens) >= 0 and max(tokens) < _PACKABLE)

    def start(self, prompt_ids, features=None, target_view=None) -> None:
        self._forget()

    def set_source(self, source_ids: torch.Tensor | None) -> None:
        """Search the source too (encoder–decoder models): summaries and translations copy from
        it, and it is not part of the decoder's context."""
        self.source = None if source_ids is None else source_ids.numpy()
        self._forget()

    def _indexed(self, context: np.ndarray) -> list[int]:
        """The searched text for ``context`` (the committed tokens), its index brought up to it
        (the n-grams ending before its last token). A context that is not longer than the indexed
        text or whose token at the indexed text's end differs (a new generation begun without
        ``start``) is indexed afresh; one that keeps that token and changes earlier ones is taken
        as an extension — the decoding loop never passes one (a generation's committed tokens only
        grow, and a new one starts the drafter)."""
        offset = 0 if self.source is None else len(self.source)
        known = len(self._text) - offset
        ids = np.asarray(context)  # (a tensor too: tests and direct callers)
        tail = ids[max(known - 1, 0) :].tolist()  # the last indexed token, then the new ones
        if known > len(ids) or (known > 0 and tail[0] != self._text[-1]) or len(self._last_end) != self.ngram_size:
            self._forget()
            known, tail = 0, ids.tolist()
        new = tail[1:] if known > 0 else tail
        if self._packed and not self._packable(new):  # an id that does not pack: every key a tuple, indexed afresh
            self._last_end = [{} for _ in range(self.ngram_size)]
            self._ended, self._packed = 0, False
        text = self._text
        text.extend(new)
        stop = len(text) - 1  # n-grams end before the text's last token
        if stop - self._ended <= BULK_INDEX:
            self._index_each(text, stop)
        else:
            # the context's array is the searched text only where this call indexed it afresh (an
            # extension keeps the text it had: a context may change tokens before the indexed end)
            self._index_bulk(text, stop, ids if offset == 0 and known == 0 and ids.dtype == np.int64 else None)
        self._ended = max(self._ended, stop)
        return text

    def _index_each(self, text: list[int], stop: int) -> None:
        """A cycle's few new positions: each n-gram's key made and stored in turn (a longer n-gram's
        packed key is the shorter one's with the token before it in the bits above)."""
        packed, bits = self._packed, KEY_BITS
        for end in range(self._ended, stop):
            key = 0
            for n, last_end in enumerate(self._last_end, start=1):
                if end < n - 1:
                    break
                if packed:
                    key |= text[end - n + 1] << (bits * (n - 1))
                    last_end[key] = end
                else:
                    last_end[tuple(text[end - n + 1 : end + 1])] = end

    def _index_bulk(self, text: list[int], stop: int, ids: np.ndarray | None) -> None:
        """Many new positions: each size's keys for the n-grams ending at its first new end .. stop − 1
        made together, then stored in order (a later end overwrites an earlier one) by C loops.
        ``ids``: the context as int64, where it is the searched text itself (no source before it):
        the arrays' tokens are read from it, not converted from the list."""
        lowest = max(self._ended - self.ngram_size + 1, 0)
        tokens = None
        if self._packed and self.ngram_size > 1:
            tokens = ids[lowest:stop] if ids is not None else np.array(text[lowest:stop], dtype=np.int64)
        keys = None  # packed: the previous size's keys, as an array (sizes ≤ _ARRAY_SIZES) or a list
        for n, last_end in enumerate(self._last_end, start=1):
            first = max(self._ended, n - 1)
            if first >= stop:
                break
            ends = range(first, stop)
            if not self._packed:
                grams = zip(*(text[first - n + 1 + k : stop - n + 1 + k] for k in range(n)))
                last_end.update(zip(grams, ends))
                continue
            if n == 1:  # a token's key is the token: the list's own ints
                keys = text[first:stop]
                last_end.update(zip(keys, ends))
                if tokens is not None:
                    keys = tokens[first - lowest : stop - lowest]
                continue
            heads = tokens[first - n + 1 - lowest : stop - n + 1 - lowest]  # each n-gram's first token
            below = keys[len(keys) - len(heads) :]  # the (n − 1)-grams ending at the same ends
            if n <= _ARRAY_SIZES:
                keys = below | (heads << (KEY_BITS * (n - 1)))
            else:  # past an int64: Python's ints
                shift = KEY_BITS * (n - 1)
                keys = [low | (head << shift) for low, head in zip(below if isinstance(below, list) else below.tolist(),
                                                                    heads.tolist())]
            last_end.update(zip(keys.tolist() if isinstance(keys, np.ndarray) else keys, ends))

    def _latest_match(self, text: list[int], num_tokens: int) -> tuple[list[int], int]:
        """``lookup`` on the indexed ``text``: the latest earlier end of its last n tokens, longest n first."""
        length = len(text)
        longest = min(self.ngram_size, length - 1)
        if longest < self.min_ngram_size:
            return [], 0
        if self._packed:
            keys, key = [], 0
            for n in range(1, longest + 1):  # the suffix's keys, shortest first
                key |= text[length - n] << (KEY_BITS * (n - 1))
                keys.append(key)
        for n in range(longest, self.min_ngram_size - 1, -1):
            end = self._last_end[n - 1].get(keys[n - 1] if self._packed else tuple(text[length - n :]))
            if end is not None:
                return text[end + 1 : end + 1 + num_tokens], n
        return [], 0

    def lookup(self, context: np.ndarray, num_tokens: int) -> tuple[np.ndarray, int]:
        """(the continuation [≤ num_tokens] of the latest earlier match of a suffix of
        ``context``, the match's n-gram size; 0 when nothing matched)."""
        n_ctx = len(context)
        for n in range(min(self.ngram_size, n_ctx - 1), self.min_ngram_size - 1, -1):
            hits = suffix_matches(context, n)
            if hits.size:
                start = int(hits[-1]) + n
                return context[start : start + num_tokens], n
        return context[:0], 0

    def propose(self, context: np.ndarray, request: DraftRequest) -> Proposal:
        if request.budget <= 0:
            return Proposal.empty(source="ngram")
        # Source first, then the output: the output's own matches are the most recent and win.
        found, size = self._latest_match(self._indexed(context), request.budget)
        if not found:
            return Proposal.empty(source="ngram")
        return Proposal.chain(found, match_sizes=[size] * len(found), source="ngram")
