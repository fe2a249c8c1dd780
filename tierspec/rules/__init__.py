"""Verification rules: each decides which drafted tokens to keep and what comes next."""

from ..proposal import DRAFTER, JUDGE, SLIM, TARGET, Verdict
from .base import ScoreRule, TieredRule, VerificationRule, VerifierTiers
from .exact import ExactRule

__all__ = ["DRAFTER", "JUDGE", "SLIM", "TARGET", "ExactRule", "ScoreRule", "TieredRule", "Verdict", "VerificationRule",
           "VerifierTiers"]
