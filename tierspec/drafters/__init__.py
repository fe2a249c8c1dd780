"""Drafters: each proposes a block of tokens for the verification rule to check."""

from .base import Drafter, NoDrafter
from .model import DrafterMismatchError, ModelDrafter, check_vocabularies
from .ngram import NgramDrafter

__all__ = [
    "Drafter",
    "DrafterMismatchError",
    "ModelDrafter",
    "NgramDrafter",
    "NoDrafter",
    "check_vocabularies",
]
