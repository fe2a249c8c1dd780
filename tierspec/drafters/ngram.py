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
#: the lookup) go through zipped slices, whose set-up costs a few microseconds a size but whose
#: entries cost a third of the loop's. Warm, 3 sizes, on a Zen 4: one new position 4.1 µs by the loop,
#: 11.2 by zips; they cross at 11–12 positions (19–20 µs); 24 positions 39 → 25 µs; a 500-token
#: prompt 488 → 118 µs.
BULK_INDEX = 11


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
        # each n-gram last ended in it (positions before the text's last: a suffix never matches
        # itself). Grown by the tokens committed since the last proposal, so a proposal is one
        # dictionary read per size however long the context, where scanning every earlier place
        # of the last token walked hundreds of places of a common token in Python.
        self._text: list[int] = [] if self.source is None else self.source.tolist()
        self._last_end: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.ngram_size)]
        self._ended = 0  # n-grams ending before this position are in ``_last_end``

    def start(self, prompt_ids, features=None, target_view=None) -> None:
        self._forget()

    def set_source(self, source_ids: torch.Tensor | None) -> None:
        """Search the source too (encoder–decoder models): summaries and translations copy from
        it, and it is not part of the decoder's context."""
        self.source = None if source_ids is None else source_ids.numpy()
        self._forget()

    def _indexed(self, context: np.ndarray) -> list[int]:
        """The searched text for ``context`` (the committed tokens), its index brought up to it
        (the n-grams ending before its last token). A context that does not extend the indexed one
        (a new generation begun without ``start``) is indexed afresh."""
        offset = 0 if self.source is None else len(self.source)
        known = len(self._text) - offset
        ids = np.asarray(context)  # (a tensor too: tests and direct callers)
        tail = ids[max(known - 1, 0) :].tolist()  # the last indexed token, then the new ones
        if known > len(ids) or (known > 0 and tail[0] != self._text[-1]) or len(self._last_end) != self.ngram_size:
            self._forget()
            known, tail = 0, ids.tolist()
        text = self._text
        text.extend(tail[1:] if known > 0 else tail)
        stop = len(text) - 1  # n-grams end before the text's last token
        if stop - self._ended <= BULK_INDEX:  # a cycle's few tokens: a tuple and a store each
            for end in range(self._ended, stop):
                for n, last_end in enumerate(self._last_end, start=1):
                    if end < n - 1:
                        break
                    last_end[tuple(text[end - n + 1 : end + 1])] = end
        else:
            for n, last_end in enumerate(self._last_end, start=1):
                first = max(self._ended, n - 1)
                if first < stop:
                    # The n-grams ending at first .. stop − 1, in order (a later end overwrites an
                    # earlier one): zipped and stored by the interpreter's C loops.
                    grams = zip(*(text[first - n + 1 + k : stop - n + 1 + k] for k in range(n)))
                    last_end.update(zip(grams, range(first, stop)))
        self._ended = max(self._ended, stop)
        return text

    def _latest_match(self, text: list[int], num_tokens: int) -> tuple[list[int], int]:
        """``lookup`` on the indexed ``text``: the latest earlier end of its last n tokens, longest n first."""
        length = len(text)
        for n in range(min(self.ngram_size, length - 1), self.min_ngram_size - 1, -1):
            end = self._last_end[n - 1].get(tuple(text[length - n :]))
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
