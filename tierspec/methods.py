"""Methods by name: each is a (drafter, verification rule) pair for the one decode loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .drafters import Drafter, ModelDrafter, NgramDrafter, NoDrafter, check_vocabularies
from .models import LoadedModel
from .rules import ExactRule, VerificationRule


@dataclass(frozen=True)
class MethodOptions:
    """Method parameters that are not sampling settings (CLI flags map onto these)."""

    ngram_size: int = 3  # prompt lookup: longest suffix n-gram matched


@dataclass
class Method:
    name: str
    drafter: Drafter
    rule: VerificationRule
    description: str


def _ar(target, drafter_model, options) -> Method:
    return Method("ar", NoDrafter(), ExactRule(), "plain autoregressive decoding")


def _sd(target, drafter_model, options) -> Method:
    if drafter_model is None:
        # The target drafting for itself always agrees: slow, but needs no second model.
        drafter = ModelDrafter(target.model, target.vocab_size)
    else:
        check_vocabularies(target, drafter_model)
        drafter = ModelDrafter(drafter_model.model, target.vocab_size)
    return Method("sd", drafter, ExactRule(), "lossless speculative decoding with a drafter model")


def _pld(target, drafter_model, options) -> Method:
    return Method("pld", NgramDrafter(options.ngram_size), ExactRule(), "lossless prompt-lookup (n-gram) decoding")


_BUILDERS: dict[str, Callable[[LoadedModel, LoadedModel | None, MethodOptions], Method]] = {
    "ar": _ar,
    "sd": _sd,
    "pld": _pld,
}

#: The fastest lossless method available; the CLI's default.
DEFAULT_METHOD = "pld"


def method_names() -> list[str]:
    return list(_BUILDERS)


class UnknownMethodError(ValueError):
    pass


def build_method(
    name: str,
    target: LoadedModel,
    drafter: LoadedModel | None = None,
    options: MethodOptions = MethodOptions(),
) -> Method:
    """The (drafter, rule) pair called ``name``; a drafter model is checked against the target."""
    if name not in _BUILDERS:
        raise UnknownMethodError(f"unknown method '{name}'; choose one of: {', '.join(method_names())}")
    return _BUILDERS[name](target, drafter, options)
