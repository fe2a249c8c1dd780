"""Methods by name: each is a drafter, a draft-length policy and a verification rule for the one
decode loop, plus the verifier settings it needs (a slim verifier's mask, padded passes).

Every method parameter and its default is declared once, in ``MethodOptions``; the command line
builds its flags from these fields (``cli``), and the bench parses method specs against them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Callable

from .cached_model import SlimVocabulary
from .costs import ForwardCosts
from .drafters import Drafter, ModelDrafter, NgramDrafter, NoDrafter, check_vocabularies
from .drafters.base import streamed_weights
from .drafters.cs_drafting import CsDrafter
from .drafters.model import Seq2SeqModelDrafter, check_same_family
from .drafters.self_spec import SelfSpeculativeDrafter
from .drafters.swift import SwiftDrafter
from .errors import TierspecError
from .heads.draft import DraftHead
from .heads.judge import JudgeHead
from .layerskip.masks import RoutingMask
from .llama import ATTENTION_ROWS
from .models import LoadedModel
from .policies import ConfidenceStop, CostAware, DraftPolicy, FixedLength, TreePolicy
from .rules import ExactRule, VerificationRule
from .rules.bild import BildRule
from .rules.lossy import LossyRule
from .rules.speculative_cascades import DEFERRALS, SpeculativeCascadeRule
from .rules.via import ViaRule
from .seq2seq import Seq2SeqError, is_encoder_decoder
from .walks import SAMPLING_RULES

DRAFTER_KINDS = ("auto", "model", "ngram", "self", "eagle")
SLIM_VOCABULARIES = ("full", "draft-head")


def _option(default, help: str, flag: str | None = None, choices=None, kind: str | None = None):
    """A MethodOptions field: its default, its --help text, and how the CLI reads it."""
    metadata = {"help": help, "flag": flag, "choices": choices, "kind": kind}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class MethodOptions:
    """Method parameters that are not sampling settings (every one is a CLI flag)."""

    num_draft: int = _option(5, "γ: tokens drafted per cycle by the fixed-length methods")
    ngram_size: int = _option(3, "prompt lookup: longest n-gram matched")
    mask: RoutingMask | None = _option(None, "routing mask JSON from `tierspec route` (self; via's slim verifier)", kind="mask")
    confidence_threshold: float = _option(0.8, "self/swift drafters: stop drafting below this top probability")
    swift_ratio: float = _option(0.45, "SWIFT: fraction of sub-layers skipped while drafting")
    clasp_ratio: float = _option(0.45, "CLaSP: fraction of sub-layers skipped while drafting")
    clasp_interval: int = _option(8, "CLaSP: verified tokens between two layer selections")
    pearl_gamma: int | None = _option(None, "PEARL: block length while blocks are kept; γ + 1 tokens are drafted during "
                                      "each target pass (default: a target pass's weight bytes over a draft step's, "
                                      "PEARL's speed ratio, less 1)")
    pearl_threads: int | None = _option(1, "PEARL: intra-op threads of the drafter and of the target while both run "
                                        "(0: no overlap, the same drafts made before each target pass)")
    drafter_kind: str = _option("auto", "drafter of lossy/bild/cascade/via/judge: auto = --drafter model if given, "
                                "else n-gram lookup; eagle = the trained draft head", flag="--draft-with", choices=DRAFTER_KINDS)
    draft_mask: RoutingMask | None = _option(None, "routing mask of the self-speculative drafter (--draft-with self)", kind="mask")
    draft_head: DraftHead | None = _option(None, "draft head (.safetensors) from `tierspec drafter train` (eagle, hybrid, "
                                        "--draft-with eagle); default: the head shipped for the target", kind="draft_head")
    alpha: float = _option(0.1, "lossy tolerance α; cascade deferral α")
    beta: float | None = _option(None, "lossy residual β (default 1 − α)")
    fallback: float = _option(0.35, "BiLD: drafting stops below this top probability")
    rollback: float = _option(3.0, "BiLD: reject draft tokens with −log q above this (nats)")
    deferral: str = _option("opt", "cascade deferral rule", choices=DEFERRALS)
    alpha1: float = _option(0.5, "VIA-SD: defer to the slim verifier when max p < 1 − α1")
    alpha2: float = _option(0.3, "VIA-SD: defer to the full target when max q' < 1 − α2")
    max_target_lag: int | None = _option(None, "VIA-SD: most tokens the full target may lag (default 4γ)")
    csd_model_positions: int = _option(3, "CS Drafting: positions drafted by the drafter model (horizontal cascade)")
    csd_inner_draft: int = _option(3, "CS Drafting: n-gram guesses the drafter model reviews per pass")
    adaptive_max_draft: int = _option(10, "adaptive-*, eagle, hybrid: the longest draft considered")
    judge_head: JudgeHead | None = _option(None, "judge head (.safetensors) from `tierspec judge train` (judge, via-judge)",
                                        kind="judge_head")
    judge_threshold: float | None = _option(None, "judge accepts when sigmoid ≥ δ (default: the head's)")
    sampling_rule: str = _option("coupled", "lossless methods at temperature > 0: coupled = the target's token at each "
                                 "position is fixed by (seed, position) and a draft is kept iff it equals it (every "
                                 "lossless method then gives ar's text for a seed); residual = min(1, q/p) acceptance "
                                 "and a residual draw (keeps more drafts of a drafter with a distribution, but its text "
                                 "depends on the drafts)", choices=SAMPLING_RULES)
    slim_vocabulary: str = _option("full", "via, via-judge: tokens the slim verifier scores: full, or draft-head (the "
                                   "draft head's K tokens; the slim LM head then costs K/V of the full one, and the slim "
                                   "distribution is renormalised over those tokens)", choices=SLIM_VOCABULARIES)

    def __post_init__(self) -> None:
        for name in ("num_draft", "ngram_size", "csd_model_positions", "csd_inner_draft", "adaptive_max_draft",
                     "clasp_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name != "num_draft" and name != "csd_inner_draft" else 0):
                raise MethodOptionError(f"{name} must be an integer >= {0 if name in ('num_draft', 'csd_inner_draft') else 1}, "
                                        f"got {value!r}")
        if self.max_target_lag is not None and self.max_target_lag < 0:
            raise MethodOptionError(f"max_target_lag must be >= 0, got {self.max_target_lag}")
        if self.slim_vocabulary not in SLIM_VOCABULARIES:
            raise MethodOptionError(f"unknown slim vocabulary '{self.slim_vocabulary}'; choose one of: "
                                    f"{', '.join(SLIM_VOCABULARIES)}")
        if self.sampling_rule not in SAMPLING_RULES:
            raise MethodOptionError(f"unknown sampling rule '{self.sampling_rule}'; choose one of: "
                                    f"{', '.join(SAMPLING_RULES)}")
        if self.drafter_kind not in DRAFTER_KINDS:
            raise MethodOptionError(f"unknown drafter kind '{self.drafter_kind}'; choose one of: {', '.join(DRAFTER_KINDS)}")
        for name, least in (("pearl_gamma", 1), ("pearl_threads", 0)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise MethodOptionError(f"{name} must be an integer >= {least}, got {value!r}")
        if not 0.0 < self.clasp_ratio < 1.0:
            raise MethodOptionError(f"clasp_ratio must be in (0, 1), got {self.clasp_ratio}")
        for name in ("confidence_threshold", "fallback"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise MethodOptionError(f"{name} must be in [0, 1], got {value}")


def option_fields():
    """The fields of MethodOptions with their CLI metadata (for the CLI and the bench)."""
    return fields(MethodOptions)


class MethodOptionError(TierspecError):
    """A method parameter out of range."""


@dataclass
class Method:
    """A method for the decode loop (``decode.DecodeMethod``): its drafter, rule and policy (the
    policy holds the pass-cost table the loop pads passes with), and VIA-SD's slim verifier."""

    name: str
    drafter: Drafter
    rule: VerificationRule
    policy: DraftPolicy
    description: str
    slim_mask: RoutingMask | None = None  # VIA-SD's slim verifier
    slim_vocabulary: SlimVocabulary | None = None  # the slim tier scores only these tokens


def _fixed(options: MethodOptions) -> FixedLength:
    return FixedLength(options.num_draft)


def _ar(target, drafter_model, options) -> Method:
    return Method("ar", NoDrafter(), ExactRule(options.sampling_rule), FixedLength(0),
                  "plain autoregressive decoding")


def _model_drafter(target: LoadedModel, drafter_model: LoadedModel | None) -> ModelDrafter:
    if drafter_model is None:
        # The target drafting for itself always agrees: slow, but needs no second model.
        drafter_model = target
    check_vocabularies(target, drafter_model)
    if is_encoder_decoder(target.model) or is_encoder_decoder(drafter_model.model):
        check_same_family(target, drafter_model)
        return Seq2SeqModelDrafter(drafter_model.model, target.vocab_size)
    return ModelDrafter(drafter_model.model, target.vocab_size)


def _sd(target, drafter_model, options) -> Method:
    return Method("sd", _model_drafter(target, drafter_model), ExactRule(options.sampling_rule), _fixed(options),
                  "lossless speculative decoding with a drafter model")


def _pld(target, drafter_model, options) -> Method:
    return Method("pld", NgramDrafter(options.ngram_size), ExactRule(options.sampling_rule), _fixed(options),
                  "lossless prompt-lookup (n-gram) decoding")


class MissingMaskError(TierspecError):
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
    return Method("self", SelfSpeculativeDrafter(mask), ExactRule(options.sampling_rule),
                  ConfidenceStop(options.num_draft, options.confidence_threshold),
                  "lossless self-speculative decoding: the target drafts with a routing mask applied")


def _swift(target, drafter_model, options) -> Method:
    drafter = SwiftDrafter(target.identity.num_layers, options.swift_ratio, "sublayer")
    return Method("swift", drafter, ExactRule(options.sampling_rule),
                  ConfidenceStop(options.num_draft, options.confidence_threshold),
                  "SWIFT: self-speculative decoding with the mask optimised on the fly")


def _clasp(target, drafter_model, options) -> Method:
    from .drafters.clasp import ClaspDrafter

    drafter = ClaspDrafter(target.identity.num_layers, options.clasp_ratio, "sublayer", options.clasp_interval)
    return Method("clasp", drafter, ExactRule(options.sampling_rule),
                  ConfidenceStop(options.num_draft, options.confidence_threshold),
                  "CLaSP: self-speculative decoding with the skipped sub-layers re-chosen in context by dynamic programming")


def _pearl_drafter(name: str, target: LoadedModel, drafter_model: LoadedModel | None, mask: RoutingMask | None,
                   options: MethodOptions):
    """PEARL's drafter: the drafter model when given, else the target under ``mask`` as a second
    module tree over the same weights (``layerskip.masks.masked_copy``: it must run while the target runs).
    ``gamma`` defaults to PEARL's speed ratio (a target pass over a draft step, taken as their
    weight bytes: docs/algorithms.md §Compute-weighted routing, a CPU pass costs what it streams)
    less one, since the thread drafts γ + 1 tokens per pass."""
    from .drafters.pearl import PearlDrafter
    from .layerskip.masks import masked_copy

    if drafter_model is not None:
        check_vocabularies(target, drafter_model)
        inner = ModelDrafter(drafter_model.model, target.vocab_size)
    else:
        if mask is None:
            raise MissingMaskError(f"method '{name}' drafts with a drafter model (--drafter) or with the target under a "
                                   "routing mask: pass --draft-mask mask.json (from `tierspec route`)"
                                   + ("" if name == "via-pearl" else " or --mask mask.json"))
        mask.check_model(target.identity)
        inner = ModelDrafter(masked_copy(target.model, mask), target.vocab_size)
    gamma = options.pearl_gamma
    if gamma is None:  # the thread drafts γ + 1 steps per target pass (PearlDrafter)
        gamma = max(1, round(streamed_weights(target.model) / streamed_weights(inner.runner.model)) - 1)
    return PearlDrafter(inner, gamma, options.pearl_threads), FixedLength(gamma + 1)


def _pearl(target, drafter_model, options) -> Method:
    drafter, policy = _pearl_drafter("pearl", target, drafter_model, options.draft_mask or options.mask, options)
    return Method("pearl", drafter, ExactRule(options.sampling_rule), policy,
                  "PEARL: lossless; the drafter drafts the next block while the target verifies this one")


def _via_pearl(target, drafter_model, options) -> Method:
    mask = _require_mask("via-pearl", target, options)
    drafter, policy = _pearl_drafter("via-pearl", target, drafter_model, options.draft_mask, options)
    return Method("via-pearl", drafter, _via_rule(options), policy,
                  "VIA-SD + PEARL: PEARL's parallel drafting, verified by the slim verifier and the full target when unsure",
                  slim_mask=mask, slim_vocabulary=_slim_vocabulary(target, options))


def draft_head_for(target: LoadedModel, options: MethodOptions):
    """The draft head of ``options`` (checked against the target), else the one shipped for it."""
    from .heads.draft import DraftHeadError
    from .heads.shipped import shipped_head

    if options.draft_head is not None:
        head = options.draft_head
        if head.target_identity is not None and not head.target_identity.matches(target.identity):
            raise DraftHeadError(f"the draft head {head.target_identity.mismatch(target.identity)}")
        return head
    head = shipped_head(target)
    if head is None:
        raise DraftHeadError(
            f"no draft head is shipped for '{target.identity.name}': train one with `tierspec drafter build-data` and "
            "`tierspec drafter train`, then pass --draft-head head.safetensors"
        )
    return head


def _drafter(target: LoadedModel, drafter_model: LoadedModel | None, options: MethodOptions) -> Drafter:
    """The drafter a lossy rule runs with (``options.drafter_kind``)."""
    kind = options.drafter_kind
    if kind == "auto":
        kind = "model" if drafter_model is not None else "ngram"
    if kind == "ngram":
        return NgramDrafter(options.ngram_size)
    if kind == "eagle":
        from .drafters.eagle import EagleDrafter

        return EagleDrafter(draft_head_for(target, options))
    if kind == "self":
        mask = options.draft_mask
        if mask is None:
            raise MissingMaskError("a self-speculative drafter needs a routing mask: pass --draft-mask mask.json")
        mask.check_model(target.identity)
        return SelfSpeculativeDrafter(mask)
    return _model_drafter(target, drafter_model)


def _lossy_policy(drafter: Drafter, options: MethodOptions, target: LoadedModel,
                  stop: float | None = None) -> DraftPolicy:
    """The draft-length policy of a lossy rule (a cost-aware one holds the pass-cost table the
    loop pads passes with).

    The trained draft head drafts with the cost-aware policy, as in ``eagle`` (it learns the
    acceptance of whatever rule verifies); a stop threshold (BiLD's fallback: part of that
    method) or a self-drafter stops below a confidence; other drafters draft γ tokens."""
    from .drafters.eagle import EagleDrafter

    if stop is not None:
        return ConfidenceStop(options.num_draft, stop)
    if isinstance(drafter, SelfSpeculativeDrafter):
        return ConfidenceStop(options.num_draft, options.confidence_threshold)
    if isinstance(drafter, EagleDrafter):
        return _cost_aware(target, options, drafter)
    return _fixed(options)


def _lossy(target, drafter_model, options) -> Method:
    drafter = _drafter(target, drafter_model, options)
    policy = _lossy_policy(drafter, options, target)
    return Method("lossy", drafter, LossyRule(options.alpha, options.beta), policy,
                  "lossy speculative decoding with tolerance (α, β)")


def _bild(target, drafter_model, options) -> Method:
    drafter = _drafter(target, drafter_model, options)
    policy = _lossy_policy(drafter, options, target, stop=options.fallback)
    return Method("bild", drafter, BildRule(options.rollback), policy,
                  "BiLD: fallback when the drafter is unsure, rollback on unlikely tokens")


def _cascade(target, drafter_model, options) -> Method:
    drafter = _drafter(target, drafter_model, options)
    policy = _lossy_policy(drafter, options, target)
    return Method("cascade", drafter, SpeculativeCascadeRule(options.deferral, options.alpha), policy,
                  "speculative cascades with a deferral rule")


def _csd(target, drafter_model, options) -> Method:
    if drafter_model is not None:
        check_vocabularies(target, drafter_model)
    model = drafter_model or target
    drafter = CsDrafter(model.model, target.vocab_size, NgramDrafter(options.ngram_size),
                             options.csd_model_positions, options.csd_inner_draft)
    return Method("csd", drafter, ExactRule(options.sampling_rule), _fixed(options),
                  "cascade speculative drafting (vertical + horizontal cascade)")


#: VIA-SD's default lag cap in blocks of γ drafts (docs/DESIGN.md §3.6: 4γ): the full target
#: catches up at least every few blocks the slim tier commits.
TARGET_LAG_BLOCKS = 4


def _via_rule(options: MethodOptions, judge: JudgeHead | None = None) -> ViaRule:
    lag = options.max_target_lag if options.max_target_lag is not None else TARGET_LAG_BLOCKS * max(options.num_draft, 1)
    return ViaRule(options.alpha1, options.alpha2, lag, judge=judge, judge_threshold=options.judge_threshold)


def _slim_vocabulary(target: LoadedModel, options: MethodOptions) -> SlimVocabulary | None:
    """The slim tier's vocabulary (None: all tokens); ``draft-head``: the draft head's K tokens."""
    if options.slim_vocabulary == "full":
        return None
    return SlimVocabulary(target.model, draft_head_for(target, options).draft_ids)


def _via(target, drafter_model, options) -> Method:
    mask = _require_mask("via", target, options)
    drafter = _drafter(target, drafter_model, options)
    policy = _lossy_policy(drafter, options, target)
    return Method("via", drafter, _via_rule(options), policy,
                  "VIA-SD: drafter → slim verifier (routing mask) → full target when unsure", slim_mask=mask,
                  slim_vocabulary=_slim_vocabulary(target, options))


def _require_judge(name: str, target: LoadedModel, options: MethodOptions):
    from .heads.judge import JudgeHeadError

    if options.judge_head is None:
        raise JudgeHeadError(f"method '{name}' needs a judge head: train one with `tierspec judge train` and pass --judge-head")
    head = options.judge_head
    if head.model is not None and not head.model.matches(target.identity):
        raise JudgeHeadError(f"the judge head {head.model.mismatch(target.identity)}")
    return head


def _judge(target, drafter_model, options) -> Method:
    from .rules.judge import JudgeRule

    head = _require_judge("judge", target, options)
    drafter = _drafter(target, drafter_model, options)
    policy = _lossy_policy(drafter, options, target)
    return Method("judge", drafter, JudgeRule(head, options.judge_threshold), policy,
                  "judge decoding: a linear head on the target's hidden states accepts correct drafts SD rejects")


def _via_judge(target, drafter_model, options) -> Method:
    head = _require_judge("via-judge", target, options)
    mask = _require_mask("via-judge", target, options)
    drafter = _drafter(target, drafter_model, options)
    policy = _lossy_policy(drafter, options, target)
    return Method("via-judge", drafter, _via_rule(options, judge=head), policy,
                  "VIA-SD with the judge at the full-verifier tier", slim_mask=mask,
                  slim_vocabulary=_slim_vocabulary(target, options))


def _cost_table(target: LoadedModel, max_tokens: int) -> ForwardCosts:
    """The target's measured pass costs for 1 .. ``max_tokens`` new tokens: ``costs.forward_costs``
    measures (or reads and spot-checks) a table once per process and returns that one table to
    every later caller, so every method built on a model shares it; the policy built on it holds it."""
    from .costs import forward_costs

    return forward_costs(target, max_tokens=max_tokens)


def _draft_fractions(target: LoadedModel, weights: dict[str, int]) -> dict[str, float]:
    """Each drafting source's step costed as the weights it reads against a target pass's
    (docs/algorithms.md §Compute-weighted routing: on a CPU a decoding pass costs about what it
    streams)."""
    target_weights = streamed_weights(target.model)
    return {source: step / target_weights for source, step in weights.items()}


def _cost_aware(target: LoadedModel, options: MethodOptions, drafter: Drafter) -> CostAware:
    """The cost-aware policy for ``drafter``: the target's measured pass costs for the longest
    draft and its pending token, and the drafter's steps costed by the weights they read."""
    table = _cost_table(target, options.adaptive_max_draft + 1)
    return CostAware(options.adaptive_max_draft, forward_costs=table,
                     draft_fractions=_draft_fractions(target, drafter.draft_step_weights()))


def _adaptive_pld(target, drafter_model, options) -> Method:
    drafter = NgramDrafter(options.ngram_size)
    policy = _cost_aware(target, options, drafter)
    return Method("adaptive-pld", drafter, ExactRule(options.sampling_rule), policy,
                  "lossless prompt lookup with a cost-aware draft length (measured pass costs, acceptance learned online)")


def _adaptive_sd(target, drafter_model, options) -> Method:
    drafter = _model_drafter(target, drafter_model)
    policy = _cost_aware(target, options, drafter)
    return Method("adaptive-sd", drafter, ExactRule(options.sampling_rule), policy,
                  "lossless speculative decoding with a drafter model and a cost-aware draft length")


def _eagle(target, drafter_model, options) -> Method:
    from .drafters.eagle import EagleDrafter

    drafter = EagleDrafter(draft_head_for(target, options))  # a missing head is refused before costs are measured
    policy = _cost_aware(target, options, drafter)
    return Method("eagle", drafter, ExactRule(options.sampling_rule), policy,
                  "lossless speculative decoding with the trained draft head and a cost-aware draft length")


def _hybrid(target, drafter_model, options) -> Method:
    from .drafters.eagle import EagleDrafter, HybridDrafter

    ngram, eagle = NgramDrafter(options.ngram_size), EagleDrafter(draft_head_for(target, options))
    policy = _cost_aware(target, options, eagle)
    drafter = HybridDrafter(ngram, eagle)
    return Method("hybrid", drafter, ExactRule(options.sampling_rule), policy,
                  "lossless: n-gram lookup where the context offers a match expected to pay more, the draft head otherwise")


#: Tokens of the widest tree pass the tree policy costs (the pending token and up to 15 nodes): a
#: tree is wider than a chain, and 16 rows are four ``llama.ATTENTION_ROWS`` calls of a chain pass.
TREE_PASS_TOKENS = 4 * ATTENTION_ROWS


def _tree_policy(target: LoadedModel, drafter_weights: dict[str, int]) -> TreePolicy:
    """A tree policy on the target's pass costs for up to ``TREE_PASS_TOKENS`` tokens: nodes per
    pass up to the table's size − 1 (the pending token takes a row)."""
    from .costs import tree_call_seconds

    if not hasattr(target.model, "new_kv_cache"):
        raise MethodOptionError(f"token trees run on tierspec's own Llama forward only; '{target.identity.name}' runs on "
                                f"{type(target.model).__name__} (load it with implementation='tierspec')")
    table = _cost_table(target, TREE_PASS_TOKENS)
    return TreePolicy(max_nodes=table.max_tokens - 1, forward_costs=table,
                      draft_fractions=_draft_fractions(target, drafter_weights),
                      path_call_seconds=tree_call_seconds(target))


def _eagle_tree(target, drafter_model, options) -> Method:
    from .drafters.eagle import EagleDrafter
    from .drafters.tree import EagleTreeDrafter

    head = draft_head_for(target, options)
    policy = _tree_policy(target, EagleDrafter(head).draft_step_weights())
    return Method("eagle-tree", EagleTreeDrafter(head), ExactRule(options.sampling_rule), policy,
                  "lossless: the draft head's dynamic token tree (EAGLE-2 style), sized by measured pass costs")


def _hybrid_tree(target, drafter_model, options) -> Method:
    from .drafters.eagle import EagleDrafter
    from .drafters.tree import EagleTreeDrafter, HybridTreeDrafter, NgramTreeDrafter

    head = draft_head_for(target, options)
    policy = _tree_policy(target, EagleDrafter(head).draft_step_weights())
    drafter = HybridTreeDrafter(NgramTreeDrafter(options.ngram_size), EagleTreeDrafter(head))
    return Method("hybrid-tree", drafter, ExactRule(options.sampling_rule), policy,
                  "lossless: the n-gram trie of every match merged with the draft head's token tree")


#: Methods that run on an encoder–decoder target. The others need what such a model does not
#: have here: a draft head (eagle, hybrid, the trees, --draft-with eagle), a judge head trained on
#: it (judge, via-judge), or a decoder-only drafter cascade (csd).
SEQ2SEQ_METHODS = ("ar", "sd", "adaptive-sd", "pld", "adaptive-pld", "self", "swift", "lossy", "bild", "cascade", "via")


def check_seq2seq_method(name: str, options: MethodOptions) -> None:
    """Refuse a method (or drafter kind) that encoder–decoder targets do not support."""
    if name not in SEQ2SEQ_METHODS:
        raise Seq2SeqError(f"method '{name}' does not run on an encoder–decoder target; choose one of: "
                           f"{', '.join(SEQ2SEQ_METHODS)}")
    if options.drafter_kind == "eagle":
        raise Seq2SeqError("--draft-with eagle needs a draft head, which encoder–decoder targets do not have here; "
                           "use --draft-with model (with --drafter), ngram or self")


_BUILDERS: dict[str, Callable[[LoadedModel, LoadedModel | None, MethodOptions], Method]] = {
    "ar": _ar,
    "sd": _sd,
    "pld": _pld,
    "adaptive-pld": _adaptive_pld,
    "adaptive-sd": _adaptive_sd,
    "eagle": _eagle,
    "hybrid": _hybrid,
    "eagle-tree": _eagle_tree,
    "hybrid-tree": _hybrid_tree,
    "self": _self,
    "swift": _swift,
    "clasp": _clasp,
    "pearl": _pearl,
    "lossy": _lossy,
    "bild": _bild,
    "cascade": _cascade,
    "csd": _csd,
    "via": _via,
    "judge": _judge,
    "via-judge": _via_judge,
    "via-pearl": _via_pearl,
}

#: The fastest lossless method measured (BENCHMARKS.md: the draft-head report): the default
#: wherever a draft head exists for the target (shipped, or given as ``draft_head``).
DEFAULT_METHOD = "hybrid"
#: The default for a target without a draft head (the hybrid needs one): the fastest n-gram method.
DEFAULT_METHOD_WITHOUT_HEAD = "adaptive-pld"


def default_method(target: LoadedModel, options: MethodOptions = MethodOptions()) -> str:
    """The method used when none is named: ``DEFAULT_METHOD`` if a draft head exists for
    ``target``, else ``DEFAULT_METHOD_WITHOUT_HEAD``."""
    from .heads.shipped import shipped_head_path

    if options.draft_head is not None or shipped_head_path(target) is not None:
        return DEFAULT_METHOD
    return DEFAULT_METHOD_WITHOUT_HEAD


def method_names() -> list[str]:
    return list(_BUILDERS)


class UnknownMethodError(TierspecError):
    pass


def check_method_name(name: str) -> None:
    if name not in _BUILDERS:
        raise UnknownMethodError(f"unknown method '{name}'; choose one of: {', '.join(method_names())}")


def build_method(
    name: str,
    target: LoadedModel,
    drafter: LoadedModel | None = None,
    options: MethodOptions = MethodOptions(),
) -> Method:
    """The method called ``name``; a drafter model is checked against the target."""
    check_method_name(name)
    if is_encoder_decoder(target.model):
        check_seq2seq_method(name, options)
    return _BUILDERS[name](target, drafter, options)
