"""Verification rules: each decides which drafted tokens to keep and what comes next."""

from .base import DRAFTER, SLIM, TARGET, Verdict, VerificationRule
from .exact import ExactRule

__all__ = ["DRAFTER", "SLIM", "TARGET", "ExactRule", "Verdict", "VerificationRule"]
