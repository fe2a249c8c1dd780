"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the context's
last n tokens (Saxena 2023; transformers' ``prompt_lookup_num_tokens``). No model, no
distribution (rules treat the drafts as one-hot)."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import TierspecError
from ..proposal import DraftRequest, Proposal
from .base import Drafter


class NgramDrafter(Drafter):
    """Match the last ``ngram_size`` .. ``min_ngram_size`` tokens (longest first) against the
    earlier context; the most recent match wins, since nearby text repeats most reliably.

    Each drafted token is labelled ("ngram", n) with the size n of the match that produced it:
    a draft-length policy learns how often each match size is right."""

    def __init__(self, ngram_size: int = 3, min_ngram_size: int = 1):
        if not 1 <= min_ngram_size <= ngram_size:
            raise TierspecError(f"need 1 <= min_ngram_size <= ngram_size, got {min_ngram_size}, {ngram_size}")
        self.ngram_size = ngram_size
        self.min_ngram_size = min_ngram_size
        self.source: np.ndarray | None = None  # an encoder–decoder generation's source tokens

    def set_source(self, source_ids: torch.Tensor | None) -> None:
        """Search the source too (encoder–decoder models): summaries and translations copy from
        it, and it is not part of the decoder's context."""
        self.source = None if source_ids is None else source_ids.numpy()

    def lookup(self, context: np.ndarray, num_tokens: int) -> tuple[np.ndarray, int]:
        """(the continuation [≤ num_tokens] of the latest earlier match of a suffix of
        ``context``, the match's n-gram size; 0 when nothing matched)."""
        n_ctx = len(context)
        for n in range(min(self.ngram_size, n_ctx - 1), self.min_ngram_size - 1, -1):
            suffix = context[n_ctx - n :]
            # Windows that start at 0 .. n_ctx - n - 1 (excluding the suffix itself).
            windows = np.lib.stride_tricks.sliding_window_view(context[: n_ctx - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return context[start : start + num_tokens], n
        return context[:0], 0

    def propose(self, context: torch.Tensor, request: DraftRequest) -> Proposal:
        if request.budget <= 0:
            return Proposal.empty(source="ngram")
        # Source first, then the output: the output's own matches are the most recent and win.
        text = context.numpy() if self.source is None else np.concatenate([self.source, context.numpy()])
        found, size = self.lookup(text, request.budget)
        return Proposal.chain(torch.from_numpy(found.copy()).long(), match_sizes=[size] * len(found), source="ngram")
