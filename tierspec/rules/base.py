"""What a verification rule returns, and the base class every rule implements."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..drafters.base import Proposal
from ..sampling import BlockNoise, SamplingConfig

# Which tier decided an emitted token (per-tier statistics, docs/metrics.md §Tiers).
DRAFTER = "drafter"  # a draft token kept
SLIM = "slim"  # a token regenerated (or bonus) from the slim verifier / lower-tier mixture
TARGET = "target"  # a token decided with the full target's distribution


@dataclass
class Verdict:
    """The outcome of verifying one block.

    accepted:   number of leading draft tokens kept (0 .. k)
    next_token: the token emitted after them: a correction when a draft token was rejected,
                a bonus token when the whole block was accepted
    deciders:   for each emitted token (accepted + 1), the tier that decided it
    """

    accepted: int
    next_token: int
    deciders: list[str] = field(default_factory=list)


class VerificationRule:
    """Decides which drafted tokens to keep. Rules call the verifiers they need through
    ``verifiers`` (the loop owns the models and caches) and never commit anything themselves.

    Every random number a rule uses comes from ``noise``, the block's keyed noise (draft token i
    and the token after the drafts sit at block positions i; None in greedy mode, where a rule
    draws nothing), so a rule's verdict is a function of the distributions, the drafts and the
    seed."""

    name = "rule"

    def verify(
        self,
        verifiers,
        proposal: Proposal,
        sampling: SamplingConfig,
        noise: BlockNoise | None,
    ) -> Verdict:
        raise NotImplementedError

    @property
    def lossless(self) -> bool:
        return False
