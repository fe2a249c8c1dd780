"""Methods by name: each is a (drafter, verification rule) pair for the one decode loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .drafters import Drafter, ModelDrafter, NgramDrafter, NoDrafter, check_vocabularies
from .drafters.self_spec import SelfSpeculativeDrafter
from .drafters.swift import SwiftDrafter
from .models import LoadedModel
from .routing import RoutingMask
from .rules import ExactRule, VerificationRule


@dataclass(frozen=True)
class MethodOptions:
    """Method parameters that are not sampling settings (CLI flags map onto these)."""

    ngram_size: int = 3  # prompt lookup: longest suffix n-gram matched
    mask: RoutingMask | None = None  # routing mask (self-speculative drafter, VIA-SD slim verifier)
    confidence_threshold: float = 0.8  # self/swift drafters stop below this top probability
    swift_ratio: float = 0.45  # SWIFT: fraction of sub-layers skipped


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


class MissingMaskError(ValueError):
    pass


def _require_mask(name: str, target: LoadedModel, options: MethodOptions) -> RoutingMask:
    if options.mask is None:
        raise MissingMaskError(
            f"method '{name}' needs a routing mask: make one with `tierspec route --target ... --out mask.json` "
            "and pass --mask mask.json"
        )
    options.mask.check_model(target.identity)
    return options.mask


def _self(target, drafter_model, options) -> Method:
    mask = _require_mask("self", target, options)
    return Method("self", SelfSpeculativeDrafter(mask, options.confidence_threshold), ExactRule(),
                  "lossless self-speculative decoding: the target drafts with a routing mask applied")


def _swift(target, drafter_model, options) -> Method:
    drafter = SwiftDrafter(target.identity.num_layers, options.swift_ratio, "sublayer", options.confidence_threshold)
    return Method("swift", drafter, ExactRule(), "SWIFT: self-speculative decoding with the mask optimised on the fly")


_BUILDERS: dict[str, Callable[[LoadedModel, LoadedModel | None, MethodOptions], Method]] = {
    "ar": _ar,
    "sd": _sd,
    "pld": _pld,
    "self": _self,
    "swift": _swift,
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
