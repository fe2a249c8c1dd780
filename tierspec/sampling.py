"""Pure functions from logits to the distributions that drafters and verifiers use.

Every probability a verification rule compares is taken *after* the same transforms
(temperature, top-k, top-p) for drafter and target, and every sampled token is drawn from
exactly that distribution (DESIGN §1): a rule that tests ``q(x)/p(x)`` against a ``p`` the
token was not drawn from is no longer lossless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import TierspecError


class SamplingError(TierspecError):
    """Sampling settings out of range."""


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen. ``temperature == 0`` means greedy (argmax) decoding."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter

    def __post_init__(self) -> None:
        # ``not x >= 0`` also refuses NaN, which compares false with everything.
        if not math.isfinite(self.temperature) or not self.temperature >= 0:
            raise SamplingError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def logits_to_probs(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """Sampling distribution(s) for ``logits`` [..., V] under ``config`` (float32, rows sum to 1).

    In greedy mode this is the one-hot of the argmax, so that a rule written for
    distributions gives the greedy rule when fed greedy "distributions".
    """
    logits = logits.float()
    if config.greedy:
        return one_hot_rows(logits.argmax(-1), logits.shape[-1])
    logits = logits / config.temperature
    if config.top_k and config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass *before* it already reaches top_p; the most likely
        # token always survives.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= config.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def temperature_one_probs(logits: torch.Tensor) -> torch.Tensor:
    """Plain softmax, used for confidence/deferral bits, which DESIGN §3.4 takes at T = 1."""
    return logits.float().softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from ``probs`` [V]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def uniforms(n: int, generator: torch.Generator | None) -> torch.Tensor:
    """``n`` independent U(0, 1) draws (the acceptance coins of one block)."""
    return torch.rand(n, generator=generator)


def residual_distribution(target: torch.Tensor, draft: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """norm(max(0, target − scale·draft)) [V]; falls back to ``target`` when that is all zero.

    ``scale = 1`` is the residual of exact speculative decoding (DESIGN §3.1); ``scale = β``
    is the lossy residual of §3.2. The fallback happens when target ≤ scale·draft everywhere
    (e.g. target == draft), where the residual is never needed with probability > 0 in the
    exact rule; drawing from the target keeps the lossy rule well defined.
    """
    residual = (target - scale * draft).clamp_min(0.0)
    total = residual.sum()
    if total <= 0:
        return target
    return residual / total


def one_hot(token: int, vocab_size: int) -> torch.Tensor:
    """The distribution of a drafter that has none (n-gram lookup): all mass on its token."""
    probs = torch.zeros(vocab_size)
    probs[token] = 1.0
    return probs


def one_hot_rows(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[k, V] float32: ``one_hot`` of each token of ``tokens`` [k]."""
    return torch.nn.functional.one_hot(tokens.long(), vocab_size).float()
