"""The one decode loop (DESIGN §2). Every method is a (drafter, verification rule) pair passed in.

    prefill(prompt)                              # target and drafter caches
    while not done:
        proposal = drafter.propose(ctx, γ)       # tokens [k], draft_probs [k, V] or None
        verdict  = rule.verify(verifiers, proposal)
        ctx      = commit(ctx, verdict)          # accepted prefix + 1 correction/bonus token
        rollback every cache to the committed length
        yield the new tokens and the cycle's statistics

Streaming is iterating over ``decode``; ``generate`` in ``tierspec.api`` collects it.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .drafters.base import Drafter
from .models import CachedModel
from .rules.base import VerificationRule
from .sampling import SamplingConfig


@dataclass(frozen=True)
class DecodeConfig:
    """Run-time settings of one generation (separate from statistics and model state)."""

    max_new_tokens: int = 128
    num_draft: int = 5  # γ: tokens drafted per cycle
    sampling: SamplingConfig = SamplingConfig()
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_draft < 0:
            raise ValueError(f"num_draft must be >= 0, got {self.num_draft}")


@dataclass
class CycleStats:
    """What one draft–verify–commit cycle did."""

    drafted: int  # tokens the drafter proposed
    evaluated: int  # draft tokens up to and including the first rejection
    accepted: int  # draft tokens kept
    emitted: int  # tokens committed this cycle (after EOS / max_new_tokens truncation)
    target_calls: int  # full-target forward passes
    slim_calls: int  # slim-verifier forward passes
    drafter_calls: int  # drafter model forward passes
    seconds: float
    deciders: list[str] = field(default_factory=list)  # tier that decided each emitted token


@dataclass
class GenerationStats:
    """Totals over one generation (DESIGN §5 definitions)."""

    drafted: int = 0
    evaluated: int = 0
    accepted: int = 0
    emitted: int = 0
    target_calls: int = 0
    slim_calls: int = 0
    drafter_calls: int = 0
    cycles: int = 0
    wall_seconds: float = 0.0
    decided_by: Counter = field(default_factory=Counter)

    def add(self, cycle: CycleStats) -> None:
        self.drafted += cycle.drafted
        self.evaluated += cycle.evaluated
        self.accepted += cycle.accepted
        self.emitted += cycle.emitted
        self.target_calls += cycle.target_calls
        self.slim_calls += cycle.slim_calls
        self.drafter_calls += cycle.drafter_calls
        self.cycles += 1
        self.decided_by.update(cycle.deciders)

    @property
    def rejection_rate(self) -> float:
        """Rejected / evaluated draft tokens (the VIA-SD paper's metric)."""
        return (self.evaluated - self.accepted) / self.evaluated if self.evaluated else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """τ = emitted tokens per full-target call (plain decoding: 1.0)."""
        return self.emitted / self.target_calls if self.target_calls else float(self.emitted)

    @property
    def tokens_per_second(self) -> float:
        return self.emitted / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def tier_fractions(self) -> dict[str, float]:
        total = sum(self.decided_by.values())
        return {tier: count / total for tier, count in sorted(self.decided_by.items())} if total else {}

    def to_dict(self) -> dict:
        return {
            "drafted": self.drafted,
            "evaluated": self.evaluated,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "rejection_rate": round(self.rejection_rate, 4),
            "mean_accepted_tokens": round(self.mean_accepted_tokens, 4),
            "target_calls": self.target_calls,
            "slim_calls": self.slim_calls,
            "drafter_calls": self.drafter_calls,
            "cycles": self.cycles,
            "tier_fractions": {k: round(v, 4) for k, v in self.tier_fractions().items()},
            "wall_seconds": round(self.wall_seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
        }


class Verifiers:
    """The verifier tiers of one generation, shared by the loop, the rule and the drafter.

    ``context`` is the committed sequence. The full target is ``target`` (a CachedModel); a
    rule with a slim verifier (VIA-SD) passes its routing mask as ``slim_mask``: the slim
    verifier is the same model and cache with the mask applied (no second model in memory).

    Cache bookkeeping: every layer holds full-model KV for the first ``full_length`` positions;
    the kept layers of the slim mask may hold slim KV beyond that, up to ``target.length``, for
    committed tokens that only the slim verifier has processed (the full target lags, DESIGN
    §3.6). A full pass first drops that slim KV and re-processes those tokens in one go.
    """

    def __init__(self, target: CachedModel, slim_mask=None, forward_costs=None):
        """``forward_costs`` (a ``costs.ForwardCosts``): pad each pass to the cheapest measured
        size at least as long (extra rows repeat the last token; their outputs are dropped and
        their KV rolled back with the rest of the uncommitted block)."""
        self.target = target
        self.slim_mask = slim_mask
        self.forward_costs = forward_costs
        self.context = torch.empty(0, dtype=torch.long)
        self.vocab_size = target.vocab_size
        self.full_length = 0
        self.slim_calls = 0

    def reset(self) -> None:
        self.target.reset()
        self.full_length = 0
        self.slim_calls = 0

    def prefill(self, prompt_ids: torch.Tensor) -> None:
        """The target processes all but the last prompt token, which is fed with the first
        draft (so every verification pass is "pending committed tokens + draft")."""
        if len(prompt_ids) > 1:
            self.target.forward(prompt_ids[:-1], logits_for=1)
        self.full_length = self.target.length

    @property
    def target_lag(self) -> int:
        """Committed tokens (before the pending last one) the full target has not processed."""
        return len(self.context) - 1 - self.full_length

    def target_logits(self, draft_tokens: torch.Tensor, with_hidden: bool = False):
        """Full-target logits [k+1, V]: row i scores draft token i, row k gives the bonus token.

        ``with_hidden`` also returns the final hidden states [k+1, H] of the same pass: row i
        (i ≥ 1) is the state at draft token i's own position (what a judge head reads).
        """
        if self.target.length > self.full_length:
            self.target.rollback(self.full_length)  # drop slim-only KV; recomputed in this pass
        pending = self.context[self.full_length :]
        k = int(draft_tokens.shape[0])
        tokens, pad = self._padded(torch.cat([pending, draft_tokens]))
        result = self.target.forward(tokens, logits_for=k + 1 + pad, with_hidden=with_hidden)
        self.full_length = self.target.length
        if pad:
            result = tuple(r[: k + 1] for r in result) if with_hidden else result[: k + 1]
        return result

    def _padded(self, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
        if self.forward_costs is None or len(tokens) < 2:
            return tokens, 0
        pad = self.forward_costs.padded_size(len(tokens)) - len(tokens)
        return (torch.cat([tokens, tokens[-1:].expand(pad)]), pad) if pad else (tokens, 0)

    def slim_logits(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        """Slim-verifier logits [k+1, V] (the target under ``slim_mask``), same layout."""
        if self.slim_mask is None:
            raise ValueError("this generation has no slim verifier (no routing mask was given)")
        pending = self.context[self.target.length :]
        k = int(draft_tokens.shape[0])
        tokens, pad = self._padded(torch.cat([pending, draft_tokens]))
        logits = self.target.forward(tokens, logits_for=k + 1 + pad, mask=self.slim_mask)
        self.slim_calls += 1
        return logits[: k + 1]

    def rollback(self, committed_length: int) -> None:
        """Trim every cache to the committed tokens it has processed (the last committed token
        is fed with the next draft)."""
        keep = committed_length - 1
        self.target.rollback(min(self.target.length, keep))
        self.full_length = min(self.full_length, keep)

    def drop_slim_cache(self) -> None:
        """Forget slim-only KV (before a pass under another mask, e.g. a self-drafter's)."""
        if self.target.length > self.full_length:
            self.target.rollback(self.full_length)


class PromptError(ValueError):
    """The prompt cannot be decoded (empty, batched, or longer than the model's context)."""


def check_prompt(prompt_ids: torch.Tensor, max_positions: int | None, max_new_tokens: int) -> torch.Tensor:
    """Validate and flatten a prompt to [n] int64 (batch size 1 only)."""
    prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.long)
    if prompt_ids.dim() == 2:
        if prompt_ids.shape[0] != 1:
            raise PromptError(
                f"batch size {prompt_ids.shape[0]} is not supported: speculative decoding here runs one sequence at a time"
            )
        prompt_ids = prompt_ids[0]
    if prompt_ids.dim() != 1:
        raise PromptError(f"prompt ids must be [n] or [1, n], got shape {tuple(prompt_ids.shape)}")
    if prompt_ids.numel() == 0:
        raise PromptError("the prompt is empty: give at least one token")
    if max_positions is not None and prompt_ids.numel() + max_new_tokens > max_positions:
        raise PromptError(
            f"prompt of {prompt_ids.numel()} tokens + max_new_tokens {max_new_tokens} exceeds the model's context "
            f"of {max_positions} positions"
        )
    return prompt_ids


@dataclass
class Step:
    """What the loop yields after each commit."""

    new_tokens: list[int]
    cycle: CycleStats
    finished: bool


def decode(
    target: CachedModel,
    drafter: Drafter,
    rule: VerificationRule,
    prompt_ids: torch.Tensor,
    config: DecodeConfig,
    generator: torch.Generator | None = None,
    verifiers: Verifiers | None = None,
) -> Iterator[Step]:
    """Generate after ``prompt_ids`` [n], yielding a ``Step`` per cycle.

    ``verifiers`` lets a rule bring extra tiers (a slim verifier); by default only the target.
    """
    max_positions = getattr(target.model.config, "max_position_embeddings", None)
    prompt_ids = check_prompt(prompt_ids, max_positions, config.max_new_tokens)
    verifiers = verifiers or Verifiers(target)
    eos = set(config.eos_token_ids)

    with torch.inference_mode():
        verifiers.reset()
        verifiers.prefill(prompt_ids)
        drafter.start(prompt_ids, verifiers)
        context = prompt_ids.clone()
        verifiers.context = context
        emitted_total = 0
        while emitted_total < config.max_new_tokens:
            started = time.perf_counter()
            target_calls, slim_calls = target.calls, verifiers.slim_calls
            drafter_calls = drafter.calls
            remaining = config.max_new_tokens - emitted_total
            # Never draft past the budget: the cycle emits at most k + 1 tokens.
            proposal = drafter.propose(context, min(config.num_draft, remaining - 1), config.sampling, generator)
            verdict = rule.verify(verifiers, proposal, config.sampling, generator)

            # Commit: accepted prefix + the correction/bonus token, cut at EOS and the budget.
            new_tokens = proposal.tokens[: verdict.accepted].tolist() + [verdict.next_token]
            finished = False
            for i, token in enumerate(new_tokens):
                if token in eos:
                    new_tokens = new_tokens[: i + 1]
                    finished = True
                    break
            new_tokens = new_tokens[:remaining]
            context = torch.cat([context, torch.tensor(new_tokens, dtype=torch.long)])
            verifiers.context = context
            emitted_total += len(new_tokens)
            finished = finished or emitted_total >= config.max_new_tokens

            # Rollback: every cache keeps exactly the committed tokens it has processed.
            verifiers.rollback(len(context))
            drafter.commit(len(context))

            k = len(proposal)
            cycle = CycleStats(
                drafted=k,
                evaluated=verdict.accepted + (1 if verdict.accepted < k else 0),
                accepted=verdict.accepted,
                emitted=len(new_tokens),
                target_calls=target.calls - target_calls,
                slim_calls=verifiers.slim_calls - slim_calls,
                drafter_calls=drafter.calls - drafter_calls,
                seconds=time.perf_counter() - started,
                deciders=verdict.deciders[: len(new_tokens)],
            )
            drafter.observe(cycle)
            yield Step(new_tokens, cycle, finished)
            if finished:
                return
