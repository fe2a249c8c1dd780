"""What a verification rule is: the shapes it verifies, and how it meets the verifier passes.

Most rules are functions of tensors (``ScoreRule``): the loop runs the one verifier pass over the
proposal and hands the rule its rows (``proposal.Scores``: logits, and hidden states where the
rule declares it reads them); the rule returns a ``Verdict`` and runs nothing. A rule that needs
passes of its own — VIA-SD's slim tier before the full target, and the full target only when the
walk gets where the slim tier is unsure — is a ``TieredRule`` and drives them through
``VerifierTiers``, the typed interface the loop's verifiers offer it.

Every random number a rule uses comes from ``noise``, the block's keyed noise (draft token i and
the token after the drafts sit at block positions i; None in greedy mode, where a rule draws
nothing), so a rule's verdict is a function of the distributions, the drafts and the seed. Rules
never commit anything: the loop does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Protocol

from ..proposal import Proposal, Scores, Shape, Verdict, Walk
from ..sampling import BlockNoise, SamplingConfig


class VerificationRule(ABC):
    """Base class: ``name``; ``accepts``, the proposal shapes the rule verifies (the loop refuses
    a drafter proposing another shape before it starts); ``lossless``, whether the rule's output is
    exactly the target's."""

    name: ClassVar[str] = "rule"
    accepts: ClassVar[frozenset[Shape]] = frozenset({Shape.CHAIN})

    @property
    def lossless(self) -> bool:
        return False


class ScoreRule(VerificationRule):
    """A rule that is a function of the target's scores of the proposal. ``reads_hidden``: the
    pass also returns the rows' final hidden states (``Scores.hidden``)."""

    reads_hidden: ClassVar[bool] = False

    @abstractmethod
    def decide(self, proposal: Proposal, scores: Scores, sampling: SamplingConfig, noise: BlockNoise | None) -> Verdict:
        """The verdict on ``proposal`` from the target's ``scores`` of it (rows by node)."""

    def walks_by_target_tokens(self, proposal: Proposal, sampling: SamplingConfig) -> bool:
        """Whether the verdict on ``proposal`` is the walk that keeps drafts while they equal the
        target's own tokens (``walks.match_walk``), so a cycle may decide it beside other
        sequences' in one step (``walks.chain_batch_walks``) and hand it to ``verdict``."""
        return False

    def verdict(self, walk: Walk) -> Verdict:
        """The verdict of a walk decided by the target's own tokens (``walks_by_target_tokens``)."""
        raise NotImplementedError(f"the rule '{self.name}' does not decide by the target's tokens")


class VerifierTiers(Protocol):
    """The passes a ``TieredRule`` may ask of the loop's verifiers, each over the committed tokens
    the tier has not run yet and the proposal (a chain), all on the one target cache."""

    @property
    def target_lag(self) -> int:
        """Committed tokens (before the pending last one) the full target has not processed."""
        ...

    def slim(self, proposal: Proposal) -> Scores:
        """The slim verifier's rows (the target under the method's routing mask)."""
        ...

    def target(self, proposal: Proposal, with_hidden: bool = False) -> Scores:
        """The full target's rows (and hidden states ``with_hidden``); it catches up first."""
        ...


class TieredRule(VerificationRule):
    """A rule that runs the verifier tiers it needs itself (VIA-SD)."""

    @abstractmethod
    def verify(self, tiers: VerifierTiers, proposal: Proposal, sampling: SamplingConfig,
               noise: BlockNoise | None) -> Verdict:
        """The verdict on ``proposal``, calling whichever of ``tiers``' passes it needs."""
