"""What every drafter gives the decode loop: a block of proposed tokens and, when it has one,
the distribution each was drawn from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import SamplingConfig, logits_to_probs, sample


@dataclass
class Proposal:
    """A drafted block.

    tokens:      [k] int64, the drafted token ids (k may be 0: plain decoding this cycle).
    draft_probs: [k, V] the distribution each token was drawn from (after the sampling
                 transforms), or None for a drafter with no distribution (n-gram lookup),
                 which rules treat as one-hot.
    draft_logits: [k, V] raw logits when the drafter has them (rules whose deferral bits are
                 taken at temperature 1 need them), else None.
    """

    tokens: torch.Tensor
    draft_probs: torch.Tensor | None = None
    draft_logits: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def empty() -> "Proposal":
        return Proposal(torch.empty(0, dtype=torch.long))


class Drafter:
    """Base class: proposes up to ``num_tokens`` tokens continuing the committed ``context``.

    The loop calls ``start`` once with the prompt and the generation's verifiers (a drafter
    that reads the target's KV cache, like the self-speculative one, keeps them), then per
    cycle ``propose`` and, after the verdict is committed, ``commit`` with the new committed
    length so the drafter can roll its own state back (DESIGN §2 invariant).
    """

    #: the drafter's own model forward passes, reported in the statistics
    calls: int = 0

    def start(self, prompt_ids: torch.Tensor, verifiers) -> None:
        self.calls = 0

    def propose(
        self,
        context: torch.Tensor,
        num_tokens: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
    ) -> Proposal:
        raise NotImplementedError

    def commit(self, committed_length: int) -> None:
        pass

    def observe(self, cycle) -> None:
        """Called with each cycle's statistics (CycleStats) after the commit; drafters that
        adapt (e.g. their draft length) learn from it."""


class NoDrafter(Drafter):
    """Proposes nothing: with any rule the loop then emits one target token per cycle,
    i.e. plain autoregressive decoding."""

    def propose(self, context, num_tokens, sampling, generator) -> Proposal:
        return Proposal.empty()


def draft_autoregressively(
    next_logits,
    pending: torch.Tensor,
    num_tokens: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None,
    confidence_threshold: float = 0.0,
) -> Proposal:
    """Draft up to ``num_tokens`` tokens one at a time.

    ``next_logits(tokens)`` feeds ``tokens`` [n] to the drafting model and returns the logits
    [V] after the last of them. Drafting stops early when the next token's top probability at
    temperature 1 is below ``confidence_threshold`` (0 = never).
    """
    tokens, probs, logits_rows = [], [], []
    for _ in range(num_tokens):
        logits = next_logits(pending)
        if confidence_threshold > 0 and float(logits.softmax(-1).max()) < confidence_threshold:
            break
        step_probs = logits_to_probs(logits, sampling)
        token = int(logits.argmax()) if sampling.greedy else sample(step_probs, generator)
        tokens.append(token)
        probs.append(step_probs)
        logits_rows.append(logits)
        pending = torch.tensor([token])
    if not tokens:
        return Proposal.empty()
    return Proposal(torch.tensor(tokens), torch.stack(probs), torch.stack(logits_rows))
