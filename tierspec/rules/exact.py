"""Exact (lossless) speculative decoding (Leviathan et al. 2023; Chen et al. 2023),
docs/algorithms.md §Exact speculative decoding, with two sampling rules that both give the
target's distribution exactly:

``coupled`` (the default): the target's token at position t is y_t = argmax_v(log q_t(v) + g_t(v)),
g_t the Gumbel noise keyed by (seed, t) (``sampling.Noise``), an exact draw from q_t. A drafted x_t
is kept iff x_t = y_t; the first mismatch is replaced by y_t, a fully kept block gets y_{t+k}. The
emitted tokens are therefore y_t whatever was drafted: plain decoding's tokens for the same seed,
exactly like greedy mode. A drafter with a distribution p drafts with the same noise (argmax(log p +
g_t)), so it is kept whenever the two perturbed maxima agree; an n-gram draft is kept with
probability q(x), as under the residual rule. Exact at every position: the tokens before t are y_<t,
a function of g_<t alone, so g_t is independent of them and y_t is an exact draw from q_t given the
text so far, whatever the drafter or the draft-length policy did (a policy that chooses a length
from the drafted tokens biases the residual rule, not this one). A token tree (docs/algorithms.md
§Token trees) is verified as in greedy mode: follow the child whose token equals y at its depth
(siblings sit at one position, so they share its noise).

``residual``: accept x with probability min(1, q(x)/p(x)) (its own coin); on rejection draw from
norm(max(0, q − p)) (its own noise). The emitted token is distributed exactly as q. A drafter
with no distribution (n-gram) counts as one-hot p, so x is accepted with probability q(x). It
accepts a drafter with a distribution more often (1 − TV(p, q) against P(maxima agree); the
draft head at temperature 1: 0.33 against 0.29 of its drafts, BENCHMARKS.md), but its text
depends on what was drafted.

Greedy (either rule): accept iff x = argmax q; the replacement is argmax q.
"""

from __future__ import annotations

import torch

from ..errors import TierspecError
from ..sampling import BlockNoise, SamplingConfig, gumbel_argmax, logits_to_probs, residual_distribution
from .base import DRAFTER, TARGET, Verdict, VerificationRule
from .common import acceptance_walk, draft_prob_of_tokens, draft_row

SAMPLING_RULES = ("coupled", "residual")


def acceptance_probability(draft_prob: torch.Tensor, target_prob: torch.Tensor) -> torch.Tensor:
    """min(1, q(x)/p(x)) elementwise; p(x) > 0 for any token the drafter drew."""
    return torch.clamp(target_prob / draft_prob, max=1.0)


def first_rejection(accept: torch.Tensor) -> int:
    """Index of the first False in the bool vector ``accept`` [k] (k when all are True)."""
    rejected = (~accept).nonzero()
    return int(rejected[0]) if rejected.numel() else int(accept.shape[0])


def match_walk(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> tuple[int, int]:
    """Keep drafts while they equal the target's tokens; then the target's token: drafts [k],
    target tokens [k+1] → (accepted, next token). Greedy mode (argmax) and the coupled rule
    (perturbed argmax) are this walk; a token tree follows the child equal to the target's token."""
    k = len(draft_tokens)
    accepted = first_rejection(draft_tokens == target_tokens[:k])
    return accepted, int(target_tokens[accepted])


def coupled_target_tokens(target_probs: torch.Tensor, noise: BlockNoise) -> torch.Tensor:
    """y_i = argmax(log q_i + g_i) for the block's rows q [k+1, V]: the target's sampled tokens."""
    return gumbel_argmax(target_probs, noise.gumbels(target_probs.shape[0]))


def check_sampling_rule(sampling_rule: str) -> str:
    if sampling_rule not in SAMPLING_RULES:
        raise TierspecError(f"unknown sampling rule '{sampling_rule}'; choose one of: {', '.join(SAMPLING_RULES)}")
    return sampling_rule


def exact_walk(proposal, target_logits: torch.Tensor, sampling: SamplingConfig, noise: BlockNoise | None,
               sampling_rule: str = "coupled") -> tuple[int, int]:
    """Rule 3.1 on target logits [k+1, V] → (accepted, next token)."""
    tokens = proposal.tokens
    k = len(tokens)
    vocab = target_logits.shape[-1]
    if sampling.greedy:
        return match_walk(tokens, target_logits.argmax(-1))
    q = logits_to_probs(target_logits, sampling)  # [k+1, V]
    if check_sampling_rule(sampling_rule) == "coupled":
        if noise is None:
            raise TierspecError("sampled verification needs the block's noise (sampling.BlockNoise); got None")
        return match_walk(tokens, coupled_target_tokens(q, noise))
    accept = acceptance_probability(draft_prob_of_tokens(proposal), q[torch.arange(k), tokens])
    return acceptance_walk(k, accept, lambda i, passed: residual_distribution(q[i], draft_row(proposal, i, vocab)),
                           lambda: q[k], noise)


class ExactRule(VerificationRule):
    """Lossless verification against the full target (with an empty draft: plain decoding, whose
    sampled tokens are the same under both sampling rules: the bonus draw uses the token noise)."""

    name = "exact"

    def __init__(self, sampling_rule: str = "coupled"):
        self.sampling_rule = check_sampling_rule(sampling_rule)

    def verify(self, verifiers, proposal, sampling: SamplingConfig, noise) -> Verdict:
        target_logits = verifiers.target_logits(proposal.tokens)  # [k+1, V]
        accepted, token = exact_walk(proposal, target_logits, sampling, noise, self.sampling_rule)
        return Verdict(accepted, token, [DRAFTER] * accepted + [TARGET])

    @property
    def lossless(self) -> bool:
        return True
