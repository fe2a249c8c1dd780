"""Methods by name: each is a (drafter, verification rule) pair for the one decode loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .drafters import Drafter, ModelDrafter, NgramDrafter, NoDrafter, check_vocabularies
from .drafters.adaptive import CostAwareDrafter
from .drafters.cascade import CascadeDrafter
from .drafters.self_spec import SelfSpeculativeDrafter
from .drafters.swift import SwiftDrafter
from .models import LoadedModel
from .routing import RoutingMask
from .rules import ExactRule, VerificationRule
from .rules.bild import BildRule
from .rules.cascade import CascadeRule
from .rules.lossy import LossyRule
from .rules.via import ViaRule

DRAFTER_KINDS = ("auto", "model", "ngram", "self")


@dataclass(frozen=True)
class MethodOptions:
    """Method parameters that are not sampling settings (CLI flags map onto these)."""

    ngram_size: int = 3  # prompt lookup: longest suffix n-gram matched
    mask: RoutingMask | None = None  # routing mask (self-speculative drafter, VIA-SD slim verifier)
    confidence_threshold: float = 0.8  # self/swift drafters stop below this top probability
    swift_ratio: float = 0.45  # SWIFT: fraction of sub-layers skipped
    drafter_kind: str = "auto"  # lossy rules: auto = the --drafter model if given, else n-gram lookup
    draft_mask: RoutingMask | None = None  # routing mask of a self-speculative drafter under a lossy rule
    num_draft: int = 5  # γ (VIA-SD's default lag cap is 4γ)
    alpha: float = 0.1  # lossy tolerance α; cascade deferral α
    beta: float | None = None  # lossy residual β (default 1 − α)
    fallback: float = 0.35  # BiLD: drafter stops below this top probability
    rollback: float = 3.0  # BiLD: reject a draft token with −log q above this (nats)
    deferral: str = "opt"  # cascade deferral rule: chow, diff, opt, always
    alpha1: float = 0.5  # VIA-SD drafter-confidence threshold
    alpha2: float = 0.3  # VIA-SD slim-verifier-confidence threshold
    max_target_lag: int | None = None  # VIA-SD lag cap (default 4γ)
    csd_model_positions: int = 3  # CS Drafting: positions drafted by the model (horizontal cascade)
    csd_inner_draft: int = 3  # CS Drafting: n-gram guesses the drafter model reviews per pass
    adaptive_max_draft: int = 10  # adaptive-*: the longest draft considered
    judge_head: object | None = None  # a JudgeHead (judge, via-judge)
    judge_threshold: float | None = None  # δ (default: the head's own threshold)


@dataclass
class Method:
    name: str
    drafter: Drafter
    rule: VerificationRule
    description: str
    slim_mask: RoutingMask | None = None  # VIA-SD's slim verifier
    forward_costs: object | None = None  # costs.ForwardCosts: pad verification passes to cheap sizes
    num_draft: int | None = None  # the method's own cap on the draft length (adaptive methods)


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


def _drafter(target: LoadedModel, drafter_model: LoadedModel | None, options: MethodOptions,
             confidence_threshold: float = 0.0) -> Drafter:
    """The drafter a lossy rule runs with (``options.drafter_kind``)."""
    kind = options.drafter_kind
    if kind not in DRAFTER_KINDS:
        raise ValueError(f"unknown drafter kind '{kind}'; choose one of: {', '.join(DRAFTER_KINDS)}")
    if kind == "auto":
        kind = "model" if drafter_model is not None else "ngram"
    if kind == "ngram":
        return NgramDrafter(options.ngram_size)
    if kind == "self":
        mask = options.draft_mask
        if mask is None:
            raise MissingMaskError("a self-speculative drafter needs a routing mask: pass --draft-mask mask.json")
        mask.check_model(target.identity)
        return SelfSpeculativeDrafter(mask, confidence_threshold or options.confidence_threshold)
    model = drafter_model or target
    if drafter_model is not None:
        check_vocabularies(target, drafter_model)
    return ModelDrafter(model.model, target.vocab_size, confidence_threshold)


def _lossy(target, drafter_model, options) -> Method:
    return Method("lossy", _drafter(target, drafter_model, options), LossyRule(options.alpha, options.beta),
                  "lossy speculative decoding with tolerance (α, β)")


def _bild(target, drafter_model, options) -> Method:
    return Method("bild", _drafter(target, drafter_model, options, options.fallback), BildRule(options.rollback),
                  "BiLD: fallback when the drafter is unsure, rollback on unlikely tokens")


def _cascade(target, drafter_model, options) -> Method:
    return Method("cascade", _drafter(target, drafter_model, options), CascadeRule(options.deferral, options.alpha),
                  "speculative cascades with a deferral rule")


def _csd(target, drafter_model, options) -> Method:
    model = drafter_model or target
    if drafter_model is not None:
        check_vocabularies(target, drafter_model)
    drafter = CascadeDrafter(model.model, target.vocab_size, NgramDrafter(options.ngram_size),
                             options.csd_model_positions, options.csd_inner_draft)
    return Method("csd", drafter, ExactRule(), "cascade speculative drafting (vertical + horizontal cascade)")


def _via(target, drafter_model, options) -> Method:
    mask = _require_mask("via", target, options)
    lag = options.max_target_lag if options.max_target_lag is not None else 4 * max(options.num_draft, 1)
    rule = ViaRule(options.alpha1, options.alpha2, lag)
    return Method("via", _drafter(target, drafter_model, options), rule,
                  "VIA-SD: drafter → slim verifier (routing mask) → full target when unsure", slim_mask=mask)


def _require_judge(name: str, target: LoadedModel, options: MethodOptions):
    if options.judge_head is None:
        raise ValueError(f"method '{name}' needs a judge head: train one with `tierspec judge train` and pass --judge-head")
    head = options.judge_head
    if head.model is not None and not head.model.matches(target.identity):
        raise ValueError(f"the judge head was trained on '{head.model.name}', not on '{target.identity.name}'")
    return head


def _judge(target, drafter_model, options) -> Method:
    from .rules.judge import JudgeRule

    head = _require_judge("judge", target, options)
    return Method("judge", _drafter(target, drafter_model, options), JudgeRule(head, options.judge_threshold),
                  "judge decoding: a linear head on the target's hidden states accepts correct drafts SD rejects")


def _via_judge(target, drafter_model, options) -> Method:
    head = _require_judge("via-judge", target, options)
    method = _via(target, drafter_model, options)
    rule = method.rule
    method.rule = ViaRule(rule.alpha1, rule.alpha2, rule.max_target_lag, judge=head, judge_threshold=options.judge_threshold)
    method.name = "via-judge"
    return method


def _adaptive(name: str, inner: Drafter, target: LoadedModel, options: MethodOptions, description: str) -> Method:
    from .costs import forward_costs

    cap = max(options.adaptive_max_draft, 1)
    table = forward_costs(target, max_tokens=cap + 1)
    return Method(name, CostAwareDrafter(inner, cap, forward_costs=table), ExactRule(), description,
                  forward_costs=table, num_draft=cap)


def _adaptive_pld(target, drafter_model, options) -> Method:
    return _adaptive("adaptive-pld", NgramDrafter(options.ngram_size), target, options,
                     "lossless prompt lookup with a cost-aware draft length (measured pass costs, acceptance learned online)")


def _adaptive_sd(target, drafter_model, options) -> Method:
    return _adaptive("adaptive-sd", _sd(target, drafter_model, options).drafter, target, options,
                     "lossless speculative decoding with a drafter model and a cost-aware draft length")


_BUILDERS: dict[str, Callable[[LoadedModel, LoadedModel | None, MethodOptions], Method]] = {
    "ar": _ar,
    "sd": _sd,
    "pld": _pld,
    "adaptive-pld": _adaptive_pld,
    "adaptive-sd": _adaptive_sd,
    "self": _self,
    "swift": _swift,
    "lossy": _lossy,
    "bild": _bild,
    "cascade": _cascade,
    "csd": _csd,
    "via": _via,
    "judge": _judge,
    "via-judge": _via_judge,
}

#: The fastest lossless method available; the CLI's default.
DEFAULT_METHOD = "adaptive-pld"


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
