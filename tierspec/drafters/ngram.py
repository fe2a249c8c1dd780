"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the context's
last n tokens (Saxena 2023; transformers' ``prompt_lookup_num_tokens``). No model, no
distribution (rules treat the drafts as one-hot)."""

from __future__ import annotations

import numpy as np
import torch

from .base import Drafter, Proposal


class NgramDrafter(Drafter):
    """Match the last ``ngram_size`` .. ``min_ngram_size`` tokens (longest first) against the
    earlier context; the most recent match wins, since nearby text repeats most reliably."""

    def __init__(self, ngram_size: int = 3, min_ngram_size: int = 1, max_draft: int | None = None):
        if not 1 <= min_ngram_size <= ngram_size:
            raise ValueError(f"need 1 <= min_ngram_size <= ngram_size, got {min_ngram_size}, {ngram_size}")
        self.ngram_size = ngram_size
        self.min_ngram_size = min_ngram_size
        self.max_draft = max_draft
        self.calls = 0
        self.last_match_size = 0  # n-gram size of the latest lookup's match (0: none)

    def lookup(self, context: np.ndarray, num_tokens: int) -> np.ndarray:
        """The continuation [≤ num_tokens] of the latest earlier match of a suffix of ``context``."""
        n_ctx = len(context)
        for n in range(min(self.ngram_size, n_ctx - 1), self.min_ngram_size - 1, -1):
            suffix = context[n_ctx - n :]
            # Windows that start at 0 .. n_ctx - n - 1 (excluding the suffix itself).
            windows = np.lib.stride_tricks.sliding_window_view(context[: n_ctx - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                self.last_match_size = n
                return context[start : start + num_tokens]
        self.last_match_size = 0
        return context[:0]

    def propose(self, context, num_tokens, sampling, generator) -> Proposal:
        if self.max_draft is not None:
            num_tokens = min(num_tokens, self.max_draft)
        if num_tokens <= 0:
            return Proposal.empty()
        found = self.lookup(context.numpy(), num_tokens)
        return Proposal(torch.from_numpy(found.copy()).long())
