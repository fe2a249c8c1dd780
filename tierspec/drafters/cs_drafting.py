"""Cascade speculative drafting (CS Drafting, Chen et al. 2023), docs/algorithms.md §Cascade drafting.

The drafter is itself a cascade of ever cheaper drafters:

* vertical cascade: the drafter model generates its tokens by speculative decoding of its own,
  with n-gram prompt lookup (the cheapest level, a statistical model of the context) proposing
  and the drafter model reviewing them with the exact rule, so the model's tokens cost fewer
  model passes yet are distributed exactly as the model's;
* horizontal cascade: the drafter model proposes the first ``model_positions`` positions of
  the block, where acceptance matters most, and the n-gram level the later ones.

The target reviews the whole block with the exact rule (docs/algorithms.md §Exact speculative
decoding); n-gram positions carry one-hot distributions. The drafter model's own review uses the
coupled rule with the block's token noise: its tokens are exactly the drafter model's samples
(argmax(log p + g_t)), drawn with the noise the target's tokens are drawn with.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import TierspecError
from ..proposal import DraftRequest
from ..sampling import logits_to_probs, one_hot
from ..walks import exact_walk
from .base import Proposal
from .model import ModelDrafter
from .ngram import NgramDrafter


class CsDrafter(ModelDrafter):
    """A ``ModelDrafter`` (its cache, prefill and rollback) whose model drafts through the two
    cascades above."""

    def __init__(self, model: torch.nn.Module, vocab_size: int, ngram: NgramDrafter | None = None,
                 model_positions: int = 3, inner_draft: int = 3):
        if model_positions < 1 or inner_draft < 0:
            raise TierspecError("model_positions must be >= 1 and inner_draft >= 0")
        super().__init__(model, vocab_size)
        self.ngram = ngram or NgramDrafter(3)
        self.model_positions, self.inner_draft = model_positions, inner_draft

    def propose(self, context: np.ndarray, request: DraftRequest) -> Proposal:
        context = torch.as_tensor(context)
        num_tokens, sampling, noise = request.budget, request.sampling, request.noise
        calls, self._prefill_calls = self._prefill_calls, 0
        if num_tokens <= 0:
            return Proposal.empty(calls)
        wanted = min(num_tokens, self.model_positions)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        pending = context[self.runner.length :]
        while len(tokens) < wanted:
            sequence = torch.cat([context, torch.tensor(tokens, dtype=torch.long)])
            # Vertical: n-gram guesses, reviewed by the drafter model in one pass.
            found, _ = self.ngram.lookup(sequence.numpy(), min(self.inner_draft, wanted - len(tokens) - 1))
            guess = torch.from_numpy(found.copy()).long()
            logits = self.runner.forward(torch.cat([pending, guess]), logits_for=len(guess) + 1).logits[:, : self.vocab_size]
            calls += 1
            probs = logits_to_probs(logits, sampling)
            inner = None if noise is None else noise.shifted(len(tokens))  # the guesses start at draft i = len(tokens)
            walk = exact_walk(Proposal.chain(guess), logits, sampling, inner, "coupled")
            kept, nxt = walk.accepted, walk.next_token
            tokens.extend(guess[:kept].tolist() + [nxt])
            rows.extend(probs[: kept + 1])
            # The model has processed the pending tokens and the kept guesses, not ``nxt``.
            self.runner.rollback(self.runner.length - (len(guess) - kept))
            pending = torch.tensor([nxt])
        tokens, rows = tokens[:wanted], rows[:wanted]
        # Horizontal: the cheap level fills the later positions.
        if num_tokens > wanted:
            sequence = torch.cat([context, torch.tensor(tokens, dtype=torch.long)])
            tail, _ = self.ngram.lookup(sequence.numpy(), num_tokens - wanted)
            for token in tail.tolist():
                tokens.append(token)
                rows.append(one_hot(token, self.vocab_size))
        return Proposal.chain(tokens, torch.stack(rows), drafter_calls=calls, source="csd")

