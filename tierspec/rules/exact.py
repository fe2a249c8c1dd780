"""Exact (lossless) speculative decoding (Leviathan et al. 2023; Chen et al. 2023),
docs/algorithms.md §Exact speculative decoding, over a chain of drafts or a token tree
(docs/algorithms.md §Token trees), with two sampling rules that both give the target's
distribution exactly (the walks themselves are in ``tierspec.walks``):

``coupled`` (the default): the target's token at position t is y_t = argmax_v(log q_t(v) + g_t(v)),
g_t the Gumbel noise keyed by (seed, t) (``sampling.Noise``), an exact draw from q_t. A drafted x_t
is kept iff x_t = y_t; the first mismatch is replaced by y_t, a fully kept block gets y_{t+k}. The
emitted tokens are therefore y_t whatever was drafted: plain decoding's tokens for the same seed,
exactly like greedy mode. A drafter with a distribution p drafts with the same noise (argmax(log p +
g_t)), so it is kept whenever the two perturbed maxima agree; an n-gram draft is kept with
probability q(x), as under the residual rule. Exact at every position: the tokens before t are y_<t,
a function of g_<t alone, so g_t is independent of them and y_t is an exact draw from q_t given the
text so far, whatever the drafter or the draft-length policy did (a policy that chooses a length
from the drafted tokens biases the residual rule, not this one). A tree is verified alike: follow
the child equal to y at its depth (siblings sit at one position, so they share its noise).

``residual``: accept x with probability min(1, q(x)/p(x)) (its own coin); on rejection draw from
norm(max(0, q − p)) (its own noise). The emitted token is distributed exactly as q. A drafter
with no distribution (n-gram) counts as one-hot p, so x is accepted with probability q(x). It
accepts a drafter with a distribution more often (1 − TV(p, q) against P(maxima agree); measured
in docs/history.md), but its text depends on what was drafted. Over a tree it is SpecInfer's
multi-draft rule (``walks.multi_draft_walk``).

Greedy (either rule): accept iff x = argmax q; the replacement is argmax q.
"""

from __future__ import annotations

from typing import ClassVar

from ..proposal import DRAFTER, TARGET, Proposal, Scores, Shape, Verdict, Walk
from ..sampling import BlockNoise, SamplingConfig
from ..walks import check_sampling_rule, exact_walk
from .base import ScoreRule


class ExactRule(ScoreRule):
    """Lossless verification against the full target, of a chain or a tree (with an empty draft:
    plain decoding, whose sampled tokens are the same under both sampling rules: the bonus draw
    uses the token noise)."""

    name = "exact"
    accepts: ClassVar[frozenset[Shape]] = frozenset({Shape.CHAIN, Shape.TREE})

    def __init__(self, sampling_rule: str = "coupled"):
        self.sampling_rule = check_sampling_rule(sampling_rule)

    def decide(self, proposal: Proposal, scores: Scores, sampling: SamplingConfig, noise: BlockNoise | None) -> Verdict:
        return self.verdict(exact_walk(proposal, scores.logits, sampling, noise, self.sampling_rule))

    def walks_by_target_tokens(self, proposal: Proposal, sampling: SamplingConfig) -> bool:
        return proposal.is_chain and self.emits_target_tokens(sampling)

    def emits_target_tokens(self, sampling: SamplingConfig) -> bool:
        """Whether every text at ``sampling`` is the target's own whatever was drafted (greedy, or
        the coupled rule); under the residual rule a sampled text follows the drafts."""
        return sampling.greedy or self.sampling_rule == "coupled"

    def verdict(self, walk: Walk) -> Verdict:
        return Verdict(walk.path, walk.next_token, [DRAFTER] * walk.accepted + [TARGET])

    @property
    def lossless(self) -> bool:
        return True
