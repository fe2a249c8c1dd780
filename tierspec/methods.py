"""Methods by name. A built ``Method`` is immutable and shared by every generation that runs it: what
it loads or measures (draft heads, masks, the pass-cost table) is made when it is built, and each
generation gets its own drafter, draft-length policy and rule from it (``Method.generation``, sized
by that generation's ``num_draft``), plus the verifier settings the method needs (a slim verifier's
mask and vocabulary).

Every method parameter and its default is declared once, in ``MethodOptions``; the command line
builds its flags from these fields (``cli``), and the bench parses method specs against them. A
parameter no part of the chosen method reads is refused (``build_method``'s ``strict``), so no flag
is ever silently ignored.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Callable

from .cached_model import SlimVocabulary
from .costs import ForwardCosts, few_row_threads, set_one_thread_rows
from .decode import FORCED_PER_CYCLE, GenerationParts
from .limits import check_num_draft
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
from .policies import TREE_DEPTH, ConfidenceStop, CostAware, CostModel, DraftPolicy, FixedLength, TreePolicy
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

    num_draft: int | None = _option(None, "the largest draft: γ of the fixed-length methods (default 5), the longest "
                                    "draft the cost-aware ones may choose (adaptive-*, eagle, hybrid; default 10), the "
                                    "deepest tree (eagle-tree, hybrid-tree; default 8); refused by ar and PEARL "
                                    "(--pearl-gamma)")
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
        check_num_draft(self.num_draft)
        for name in ("ngram_size", "csd_model_positions", "csd_inner_draft", "clasp_interval"):
            value = getattr(self, name)
            least = 0 if name == "csd_inner_draft" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise MethodOptionError(f"{name} must be an integer >= {least}, got {value!r}")
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


#: The largest draft of each kind of method when neither the generation nor the options name one
#: (a tree's: ``policies.TREE_DEPTH``).
FIXED_DRAFT = 5  # γ of the fixed-length and confidence-stopped methods (docs/DESIGN.md §1)
ADAPTIVE_DRAFT = 10  # the longest draft a cost-aware policy considers


@dataclass(frozen=True)
class Method:
    """A method for the decode loop (``decode.DecodeMethod``): immutable, built once and shared by
    every generation — its heads, pass-cost tables and masks are made when it is built — and the
    maker of each generation's own parts (``generation``: a fresh drafter and policy, the rule).

    ``rule``: the rule at the method's own settings (what a caller checks before generating: is it
    lossless, does it drive passes of its own). ``slim_mask``, ``slim_vocabulary``: VIA-SD's slim
    verifier."""

    name: str
    description: str
    rule: VerificationRule
    make: Callable[[int | None], GenerationParts]
    slim_mask: RoutingMask | None = None
    slim_vocabulary: SlimVocabulary | None = None

    def generation(self, num_draft: int | None = None) -> GenerationParts:
        """A generation's parts: a new drafter and policy (they keep its state), drafting at most
        ``num_draft`` tokens (None: the method's own; ``MethodOptions.num_draft`` says per method)."""
        check_num_draft(num_draft)
        return self.make(num_draft)

    @staticmethod
    def of(name: str, drafter: Drafter, rule: VerificationRule, policy: DraftPolicy, description: str = "",
           slim_mask: RoutingMask | None = None, slim_vocabulary: SlimVocabulary | None = None) -> "Method":
        """A method whose every generation runs on these very objects (a test or a probe holds
        them; each generation starts them afresh, one generation at a time). It takes no
        ``num_draft`` of its own: the policy is the one given."""

        def make(num_draft: int | None) -> GenerationParts:
            if num_draft is not None:
                raise MethodOptionError(f"method '{name}' runs with the policy it was given: num_draft does not apply")
            return GenerationParts(drafter, policy, rule)

        return Method(name, description, rule, make, slim_mask, slim_vocabulary)


def _method(name: str, description: str, rule: VerificationRule, parts: Callable[[int | None], tuple[Drafter, DraftPolicy]],
            slim_mask: RoutingMask | None = None, slim_vocabulary: SlimVocabulary | None = None) -> Method:
    """A built method: ``parts(num_draft)`` makes a generation's drafter and policy."""
    return Method(name, description, rule, lambda num_draft: GenerationParts(*parts(num_draft), rule), slim_mask,
                  slim_vocabulary)


def _draft_count(num_draft: int | None, options: MethodOptions, default: int) -> int:
    """The generation's largest draft: its own, else the options', else the method kind's ``default``."""
    if num_draft is not None:
        return num_draft
    return default if options.num_draft is None else options.num_draft


def _refuse_num_draft(name: str, options: MethodOptions, why: str) -> Callable[[int | None], None]:
    """For a method that takes no num_draft: refuses the options' now and a generation's when it
    starts, with ``why``."""
    def check(num_draft: int | None) -> None:
        if num_draft:
            raise MethodOptionError(f"method '{name}' takes no num_draft: {why}")

    check(options.num_draft)
    return check


def _ar(target, drafter_model, options) -> Method:
    refuse = _refuse_num_draft("ar", options, "plain decoding drafts nothing")

    def parts(num_draft):
        refuse(num_draft)
        return NoDrafter(), FixedLength(0)

    # Plain decoding's sampled tokens are the same under both sampling rules: none to choose.
    _moot(options, "sampling_rule", "plain decoding drafts nothing for a sampling rule to keep")
    return _method("ar", "plain autoregressive decoding", ExactRule(), parts)


def _forced(target, drafter_model, options) -> Method:
    refuse = _refuse_num_draft("forced", options, "its drafts are the constraint's forced tokens, as many as it forces")

    def parts(num_draft):
        refuse(num_draft)
        # Drafts nothing of its own; a policy that may draft lets the loop append the forced tokens.
        return NoDrafter(), FixedLength(FORCED_PER_CYCLE)

    _moot(options, "sampling_rule", "its only drafts are the constraint's forced tokens, which every rule keeps")
    return _method("forced", "plain decoding whose only drafts are a constraint's forced tokens (jump-forward "
                   "decoding); without a constraint it is ar", ExactRule(), parts)


def _model_drafter(target: LoadedModel, drafter_model: LoadedModel | None) -> Callable[[], ModelDrafter]:
    """A maker of the drafter model's drafters (each with its own cache), checked now."""
    if drafter_model is None:
        # The target drafting for itself always agrees: slow, but needs no second model.
        drafter_model = target
    check_vocabularies(target, drafter_model)
    if is_encoder_decoder(target.model) or is_encoder_decoder(drafter_model.model):
        check_same_family(target, drafter_model)
        return lambda: Seq2SeqModelDrafter(drafter_model.model, target.vocab_size)
    return lambda: ModelDrafter(drafter_model.model, target.vocab_size)


def _sd(target, drafter_model, options) -> Method:
    make = _model_drafter(target, drafter_model)
    return _method("sd", "lossless speculative decoding with a drafter model", ExactRule(options.sampling_rule),
                   lambda n: (make(), FixedLength(_draft_count(n, options, FIXED_DRAFT))))


def _pld(target, drafter_model, options) -> Method:
    return _method("pld", "lossless prompt-lookup (n-gram) decoding", ExactRule(options.sampling_rule),
                   lambda n: (NgramDrafter(options.ngram_size), FixedLength(_draft_count(n, options, FIXED_DRAFT))))


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


def _confidence_stop(num_draft: int | None, options: MethodOptions, threshold: float | None = None) -> ConfidenceStop:
    return ConfidenceStop(_draft_count(num_draft, options, FIXED_DRAFT),
                          options.confidence_threshold if threshold is None else threshold)


def _self(target, drafter_model, options) -> Method:
    mask = _require_mask("self", target, options)
    return _method("self", "lossless self-speculative decoding: the target drafts with a routing mask applied",
                   ExactRule(options.sampling_rule), lambda n: (SelfSpeculativeDrafter(mask), _confidence_stop(n, options)))


def _swift(target, drafter_model, options) -> Method:
    layers = target.identity.num_layers
    return _method("swift", "SWIFT: self-speculative decoding with the mask optimised on the fly",
                   ExactRule(options.sampling_rule),
                   lambda n: (SwiftDrafter(layers, options.swift_ratio, "sublayer"), _confidence_stop(n, options)))


def _clasp(target, drafter_model, options) -> Method:
    from .drafters.clasp import ClaspDrafter

    layers = target.identity.num_layers
    return _method("clasp", "CLaSP: self-speculative decoding with the skipped sub-layers re-chosen in context by "
                   "dynamic programming", ExactRule(options.sampling_rule),
                   lambda n: (ClaspDrafter(layers, options.clasp_ratio, "sublayer", options.clasp_interval),
                              _confidence_stop(n, options)))


def _pearl_drafter(name: str, target: LoadedModel, drafter_model: LoadedModel | None, mask: RoutingMask | None,
                   options: MethodOptions) -> Callable[[int | None], tuple[Drafter, DraftPolicy]]:
    """A maker of PEARL's drafters: around the drafter model when given, else the target under
    ``mask`` as a second module tree over the same weights (``layerskip.masks.masked_copy``: it
    must run while the target runs; made once, shared by the generations, each drafting with a
    cache of its own). ``gamma`` defaults to PEARL's speed ratio (a target pass over a draft step,
    taken as their weight bytes: docs/algorithms.md §Compute-weighted routing, a CPU pass costs
    what it streams) less one, since the thread drafts γ + 1 tokens per pass. PEARL's block length
    is ``pearl_gamma``: it takes no num_draft."""
    from .drafters.pearl import PearlDrafter
    from .layerskip.masks import masked_copy

    refuse = _refuse_num_draft(name, options, "PEARL's block length adapts by itself up to --pearl-gamma")
    if drafter_model is not None:
        check_vocabularies(target, drafter_model)
        model = drafter_model.model
    else:
        if mask is None:
            raise MissingMaskError(f"method '{name}' drafts with a drafter model (--drafter) or with the target under a "
                                   "routing mask: pass --draft-mask mask.json (from `tierspec route`)"
                                   + ("" if name == "via-pearl" else " or --mask mask.json"))
        mask.check_model(target.identity)
        model = masked_copy(target.model, mask)
    gamma = options.pearl_gamma
    if gamma is None:  # the thread drafts γ + 1 steps per target pass (PearlDrafter)
        gamma = max(1, round(streamed_weights(target.model) / streamed_weights(model)) - 1)

    def parts(num_draft):
        refuse(num_draft)
        return PearlDrafter(ModelDrafter(model, target.vocab_size), gamma, options.pearl_threads), FixedLength(gamma + 1)

    return parts


def _pearl(target, drafter_model, options) -> Method:
    parts = _pearl_drafter("pearl", target, drafter_model, options.draft_mask or options.mask, options)
    return _method("pearl", "PEARL: lossless; the drafter drafts the next block while the target verifies this one",
                   ExactRule(options.sampling_rule), parts)


def _via_pearl(target, drafter_model, options) -> Method:
    mask = _require_mask("via-pearl", target, options)
    parts = _pearl_drafter("via-pearl", target, drafter_model, options.draft_mask, options)
    return _method("via-pearl", "VIA-SD + PEARL: PEARL's parallel drafting, verified by the slim verifier and the full "
                   "target when unsure", _via_rule(options, None), parts, slim_mask=mask,
                   slim_vocabulary=_slim_vocabulary(target, options))


def draft_head_for(target: LoadedModel, options: MethodOptions):
    """The draft head of ``options`` (checked against the target), else the one shipped for it."""
    from .heads.draft import DraftHeadError
    from .heads.shipped import shipped_head

    if options.draft_head is not None:
        head = options.draft_head
        if head.target_identity is not None and not head.target_identity.matches(target.identity):
            raise DraftHeadError(f"the draft head {head.target_identity.mismatch(target.identity)}")
        return _on_the_targets_threads(target, head)
    head = shipped_head(target)
    if head is None:
        raise DraftHeadError(
            f"no draft head is shipped for '{target.identity.name}': train one with `tierspec drafter build-data` and "
            "`tierspec drafter train`, then pass --draft-head head.safetensors"
        )
    return _on_the_targets_threads(target, head)


def _on_the_targets_threads(target: LoadedModel, head):
    """``head``, its engine weights' few-row products on the threads measured for the target
    (``costs.few_row_threads``); a float head as it is. Why the target's: the head's steps follow
    the target's passes, which evict its 10 MB from the caches, so its products stream from memory
    as the target's do (on a 2-core Zen 4 a step right after a pass took 0.87 ms with every-thread
    products, 1.05 with one; a warm step 0.37 and 0.42)."""
    engine_head = getattr(head, "engine", None)
    if engine_head is not None:
        measured = few_row_threads(target)
        set_one_thread_rows(engine_head.weights, None if measured is None else measured.one_thread_rows)
    return head


def _drafter(target: LoadedModel, drafter_model: LoadedModel | None, options: MethodOptions) -> Callable[[], Drafter]:
    """A maker of the drafters a lossy rule runs with (``options.drafter_kind``), checked now."""
    kind = options.drafter_kind
    if kind == "auto":
        kind = "model" if drafter_model is not None else "ngram"
    if kind == "ngram":
        return lambda: NgramDrafter(options.ngram_size)
    if kind == "eagle":
        from .drafters.eagle import EagleDrafter

        head = draft_head_for(target, options)
        return lambda: EagleDrafter(head)
    if kind == "self":
        mask = options.draft_mask
        if mask is None:
            raise MissingMaskError("a self-speculative drafter needs a routing mask: pass --draft-mask mask.json")
        mask.check_model(target.identity)
        return lambda: SelfSpeculativeDrafter(mask)
    return _model_drafter(target, drafter_model)


def _lossy_parts(make_drafter: Callable[[], Drafter], options: MethodOptions, target: LoadedModel,
                 stop: float | None = None) -> Callable[[int | None], tuple[Drafter, DraftPolicy]]:
    """A lossy rule's parts: its drafter and draft-length policy (a cost-aware one holds the
    pass-cost table the loop pads passes with).

    A stop threshold (BiLD's fallback: part of that method) or a self-drafter stops the block below
    a confidence; otherwise the trained draft head drafts with the cost-aware policy, as in
    ``eagle`` (it learns the acceptance of whatever rule verifies), and other drafters draft γ
    tokens. A drafter without a distribution (n-gram lookup) has no confidence to stop on:
    its fallback is moot (``_gated``)."""
    from .drafters.eagle import EagleDrafter

    probe = make_drafter()
    if (stop is not None and probe.has_distribution) or isinstance(probe, SelfSpeculativeDrafter):
        return lambda n: (make_drafter(), _confidence_stop(n, options, stop))
    if isinstance(probe, EagleDrafter):
        cost_aware = _cost_aware(target, options, probe)
        return lambda n: (make_drafter(), cost_aware(n))
    return lambda n: (make_drafter(), FixedLength(_draft_count(n, options, FIXED_DRAFT)))


def _moot(options: MethodOptions, name: str, why: str) -> None:
    """Note that option ``name`` cannot change this method, and ``why`` (``build_method`` refuses it,
    set, with that reason; a server's pooled options pass)."""
    if isinstance(options, _Reads):
        options.moot[name] = why


def _gated(options: MethodOptions, make_drafter: Callable[[], Drafter], gates: tuple[str, ...], why: str) -> tuple:
    """The values of a lossy rule's ``gates`` options: the options' where the method's drafter has a
    distribution, else their defaults — without one (n-gram lookup) the gates take one fixed branch
    whatever they are set to (``why``), so the options are moot (``_moot``)."""
    if make_drafter().has_distribution:
        return tuple(getattr(options, gate) for gate in gates)
    for gate in gates:
        _moot(options, gate, f"the drafter (n-gram lookup) has no distribution and {why}; draft with one that has "
                              "(--draft-with eagle, --draft-with self with --draft-mask, or --drafter MODEL)")
    return tuple(_DEFAULTS[gate] for gate in gates)


def _lossy(target, drafter_model, options) -> Method:
    parts = _lossy_parts(_drafter(target, drafter_model, options), options, target)
    return _method("lossy", "lossy speculative decoding with tolerance (α, β)", LossyRule(options.alpha, options.beta),
                   parts)


def _bild(target, drafter_model, options) -> Method:
    make = _drafter(target, drafter_model, options)
    (fallback,) = _gated(options, make, ("fallback",), "BiLD's fallback stops a block below the drafter's top probability")
    parts = _lossy_parts(make, options, target, stop=fallback)
    return _method("bild", "BiLD: fallback when the drafter is unsure, rollback on unlikely tokens",
                   BildRule(options.rollback), parts)


def _cascade(target, drafter_model, options) -> Method:
    make = _drafter(target, drafter_model, options)
    deferral, alpha = _gated(options, make, ("deferral", "alpha"), "without one every position defers (exact "
                             "speculative decoding)")
    if deferral == "always":  # α weighs what a deferral compares: nothing, here
        _moot(options, "alpha", "the deferral rule 'always' defers every position; choose --deferral chow, diff or opt")
        alpha = _DEFAULTS["alpha"]
    parts = _lossy_parts(make, options, target)
    return _method("cascade", "speculative cascades with a deferral rule", SpeculativeCascadeRule(deferral, alpha), parts)


def _csd(target, drafter_model, options) -> Method:
    if drafter_model is not None:
        check_vocabularies(target, drafter_model)
    model = drafter_model or target

    def parts(n):
        drafter = CsDrafter(model.model, target.vocab_size, NgramDrafter(options.ngram_size),
                            options.csd_model_positions, options.csd_inner_draft)
        return drafter, FixedLength(_draft_count(n, options, FIXED_DRAFT))

    return _method("csd", "cascade speculative drafting (vertical + horizontal cascade)", ExactRule(options.sampling_rule),
                   parts)


#: VIA-SD's default lag cap in blocks of γ drafts (docs/DESIGN.md §3.6: 4γ): the full target
#: catches up at least every few blocks the slim tier commits.
TARGET_LAG_BLOCKS = 4


def _via_rule(options: MethodOptions, num_draft: int | None, judge: JudgeHead | None = None,
              alpha1: float | None = None) -> ViaRule:
    """VIA-SD's rule; its lag cap defaults to ``TARGET_LAG_BLOCKS`` blocks of the generation's γ;
    ``alpha1`` (None: the options')."""
    gamma = _draft_count(num_draft, options, FIXED_DRAFT)
    lag = options.max_target_lag if options.max_target_lag is not None else TARGET_LAG_BLOCKS * max(gamma, 1)
    return ViaRule(options.alpha1 if alpha1 is None else alpha1, options.alpha2, lag, judge=judge,
                   judge_threshold=options.judge_threshold)


def _tiered(name: str, description: str, options: MethodOptions, parts, judge: JudgeHead | None, mask: RoutingMask,
            slim_vocabulary: SlimVocabulary | None, alpha1: float) -> Method:
    """A VIA-SD method: its rule's lag follows each generation's γ."""
    def make(num_draft):
        drafter, policy = parts(num_draft)
        return GenerationParts(drafter, policy, _via_rule(options, num_draft, judge, alpha1))

    return Method(name, description, _via_rule(options, None, judge, alpha1), make, mask, slim_vocabulary)


def _slim_vocabulary(target: LoadedModel, options: MethodOptions) -> SlimVocabulary | None:
    """The slim tier's vocabulary (None: all tokens); ``draft-head``: the draft head's K tokens."""
    if options.slim_vocabulary == "full":
        return None
    return SlimVocabulary(target.model, draft_head_for(target, options).draft_ids)


def _via_parts(target, drafter_model, options):
    """VIA-SD's drafter and policy maker, and its α1 (moot where the drafter has no distribution:
    δ1 reads the drafter's top probability)."""
    make = _drafter(target, drafter_model, options)
    (alpha1,) = _gated(options, make, ("alpha1",), "without one every draft goes to the slim verifier (δ1 = 1)")
    return _lossy_parts(make, options, target), alpha1


def _via(target, drafter_model, options) -> Method:
    mask = _require_mask("via", target, options)
    parts, alpha1 = _via_parts(target, drafter_model, options)
    return _tiered("via", "VIA-SD: drafter → slim verifier (routing mask) → full target when unsure", options, parts,
                   None, mask, _slim_vocabulary(target, options), alpha1)


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
    parts = _lossy_parts(_drafter(target, drafter_model, options), options, target)
    return _method("judge", "judge decoding: a linear head on the target's hidden states accepts correct drafts SD "
                   "rejects", JudgeRule(head, options.judge_threshold), parts)


def _via_judge(target, drafter_model, options) -> Method:
    head = _require_judge("via-judge", target, options)
    mask = _require_mask("via-judge", target, options)
    parts, alpha1 = _via_parts(target, drafter_model, options)
    return _tiered("via-judge", "VIA-SD with the judge at the full-verifier tier", options, parts, head, mask,
                   _slim_vocabulary(target, options), alpha1)


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


def _head_fractions(target: LoadedModel, head) -> dict[str, float]:
    """The draft head's step in units of the target's one-token pass, measured on this machine
    (``costs.draft_step_cost``: one self-fed step after ``costs.TABLE_CONTEXT`` cached positions, the
    pass table's context, right after a target pass, as a drafting cycle runs it; cached per target,
    head shape and machine)."""
    import torch

    from .costs import TABLE_CONTEXT, draft_step_cost
    from .heads.draft import HeadRunner, HeadStep

    config = head.config

    def make_step():
        runner, context = HeadRunner(head), TABLE_CONTEXT
        generator = torch.Generator().manual_seed(0)
        features = torch.randn(context, config.feature_width, generator=generator)
        tokens = torch.arange(context) * 7 % config.vocab_size
        with torch.inference_mode():
            last = runner.extend(features, tokens, from_target=True)[-1:]
        token = torch.tensor([11 % config.vocab_size])

        def step() -> None:
            runner.step(HeadStep(runner, last, token))
            runner.rollback(context)

        return step

    # the head's few-row threads name its measurement (a step measured on other threads is not read)
    threads = None if head.engine is None else head.engine.weights[0].one_thread_rows
    shape = {"head": asdict(config), "on_engine": head.engine is not None, "one_thread_rows": threads}
    return {"head": draft_step_cost(target, shape, make_step).fraction}


def _cost_aware(target: LoadedModel, options: MethodOptions, drafter: Drafter,
                fractions: dict[str, float] | None = None) -> Callable[[int | None], CostAware]:
    """A maker of the cost-aware policy for ``drafter``'s kind: the target's measured pass costs
    for the method's longest draft and its pending token (measured now; a generation that drafts
    longer costs the table's line past its end), and the drafter's steps as ``fractions`` of a
    one-token pass (default: costed by the weights they read)."""
    # one table for every method on the target (measured once however the methods' drafts are sized)
    table = _cost_table(target, max(_draft_count(None, options, ADAPTIVE_DRAFT), ADAPTIVE_DRAFT) + 1)
    if fractions is None:
        fractions = _draft_fractions(target, drafter.draft_step_weights())
    # one cost model for every generation of the method: what it derives by batch size and context
    # (``CostModel.variants``, a few microseconds a draft length) is derived once, not once a generation
    costs = CostModel(table, dict(fractions))
    return lambda n: CostAware(_draft_count(n, options, ADAPTIVE_DRAFT), cost=costs)


def _adaptive_pld(target, drafter_model, options) -> Method:
    policy = _cost_aware(target, options, NgramDrafter(options.ngram_size))
    return _method("adaptive-pld", "lossless prompt lookup with a cost-aware draft length (measured pass costs, "
                   "acceptance learned online)", ExactRule(options.sampling_rule),
                   lambda n: (NgramDrafter(options.ngram_size), policy(n)))


def _adaptive_sd(target, drafter_model, options) -> Method:
    make = _model_drafter(target, drafter_model)
    policy = _cost_aware(target, options, make())
    return _method("adaptive-sd", "lossless speculative decoding with a drafter model and a cost-aware draft length",
                   ExactRule(options.sampling_rule), lambda n: (make(), policy(n)))


def _eagle(target, drafter_model, options) -> Method:
    from .drafters.eagle import EagleDrafter

    head = draft_head_for(target, options)  # a missing head is refused before costs are measured
    policy = _cost_aware(target, options, EagleDrafter(head), _head_fractions(target, head))
    return _method("eagle", "lossless speculative decoding with the trained draft head and a cost-aware draft length",
                   ExactRule(options.sampling_rule), lambda n: (EagleDrafter(head), policy(n)))


def _hybrid(target, drafter_model, options) -> Method:
    from .drafters.eagle import EagleDrafter, HybridDrafter, ScheduleMemory

    head = draft_head_for(target, options)
    policy = _cost_aware(target, options, EagleDrafter(head), _head_fractions(target, head))
    rule = ExactRule(options.sampling_rule)
    memory = ScheduleMemory(rule.emits_target_tokens)  # how long to rest what does not pay, carried across generations
    return _method("hybrid", "lossless: n-gram lookup where the context offers a match expected to pay more, the draft "
                   "head otherwise", rule,
                   lambda n: (HybridDrafter(NgramDrafter(options.ngram_size), EagleDrafter(head), memory), policy(n)))


#: Tokens of the widest tree pass the tree policy costs (the pending token and up to 15 nodes): a
#: tree is wider than a chain, and 16 rows are four ``llama.ATTENTION_ROWS`` calls of a chain pass.
TREE_PASS_TOKENS = 4 * ATTENTION_ROWS


def _tree_policy(target: LoadedModel, drafter_weights: dict[str, int], options: MethodOptions
                 ) -> Callable[[int | None], TreePolicy]:
    """A maker of tree policies on the target's pass costs for up to ``TREE_PASS_TOKENS`` tokens:
    nodes per pass up to the table's size − 1 (the pending token takes a row), as deep as the
    generation's num_draft (default ``TREE_DEPTH``)."""
    from .costs import tree_call_seconds

    if not hasattr(target.model, "new_kv_cache"):
        raise MethodOptionError(f"token trees run on tierspec's own Llama forward only; '{target.identity.name}' runs on "
                                f"{type(target.model).__name__} (load it with implementation='tierspec')")
    table = _cost_table(target, TREE_PASS_TOKENS)
    fractions = _draft_fractions(target, drafter_weights)
    call = tree_call_seconds(target)
    costs = CostModel(table, dict(fractions))  # shared by the method's generations (``_cost_aware``)
    return lambda n: TreePolicy(max_nodes=table.max_tokens - 1, max_depth=_draft_count(n, options, TREE_DEPTH),
                                path_call_seconds=call, cost=costs)


def _eagle_tree(target, drafter_model, options) -> Method:
    from .drafters.eagle import EagleDrafter
    from .drafters.tree import EagleTreeDrafter

    head = draft_head_for(target, options)
    policy = _tree_policy(target, EagleDrafter(head).draft_step_weights(), options)
    return _method("eagle-tree", "lossless: the draft head's dynamic token tree (EAGLE-2 style), sized by measured pass "
                   "costs", ExactRule(options.sampling_rule), lambda n: (EagleTreeDrafter(head), policy(n)))


def _hybrid_tree(target, drafter_model, options) -> Method:
    from .drafters.eagle import EagleDrafter
    from .drafters.tree import EagleTreeDrafter, HybridTreeDrafter, NgramTreeDrafter

    head = draft_head_for(target, options)
    policy = _tree_policy(target, EagleDrafter(head).draft_step_weights(), options)
    return _method("hybrid-tree", "lossless: the n-gram trie of every match merged with the draft head's token tree",
                   ExactRule(options.sampling_rule),
                   lambda n: (HybridTreeDrafter(NgramTreeDrafter(options.ngram_size), EagleTreeDrafter(head)), policy(n)))


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
    "forced": _forced,
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

#: The fastest lossless method measured (BENCHMARKS.md; earlier runs in docs/history.md): the default
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


#: Methods whose drafts no num_draft sizes: plain decoding drafts nothing, PEARL's block length
#: adapts by itself up to ``pearl_gamma``. They refuse one.
WITHOUT_NUM_DRAFT = ("ar", "forced", "pearl", "via-pearl")


#: Methods that draft with a drafter model when one is given (the lossy rules' by --draft-with
#: model or auto: ``drafts_with_model``).
DRAFTER_MODEL_METHODS = ("sd", "adaptive-sd", "csd", "pearl", "via-pearl")
LOSSY_RULE_METHODS = ("lossy", "bild", "cascade", "via", "judge", "via-judge")


def drafts_with_model(name: str, options: MethodOptions = MethodOptions()) -> bool:
    """Whether method ``name`` with ``options`` drafts with a drafter model it is given (the others
    refuse one: ``build_method``)."""
    return name in DRAFTER_MODEL_METHODS or (name in LOSSY_RULE_METHODS and options.drafter_kind in ("auto", "model"))


def takes_num_draft(name: str) -> bool:
    """Whether method ``name`` takes a num_draft (the others refuse one: ``WITHOUT_NUM_DRAFT``)."""
    return name not in WITHOUT_NUM_DRAFT


def method_names() -> list[str]:
    return list(_BUILDERS)


class UnknownMethodError(TierspecError):
    pass


def check_method_name(name: str) -> None:
    if name not in _BUILDERS:
        raise UnknownMethodError(f"unknown method '{name}'; choose one of: {', '.join(method_names())}")


class _Reads:
    """An object seen through, recording which of its attributes are read (``build_method``: an
    option no part of a method reads, or a drafter model it never touches, would change nothing)."""

    __slots__ = ("_seen", "read", "moot")

    def __init__(self, seen):
        object.__setattr__(self, "_seen", seen)
        object.__setattr__(self, "read", set())
        object.__setattr__(self, "moot", {})  # option → why it cannot change the method (``_moot``)

    def __getattr__(self, name: str):
        self.read.add(name)
        return getattr(self._seen, name)


#: each option's default (what "set" is measured against)
_DEFAULTS = {option.name: option.default for option in fields(MethodOptions)}


def _flag(name: str) -> str:
    option = next(f for f in fields(MethodOptions) if f.name == name)
    return option.metadata.get("flag") or "--" + name.replace("_", "-")


def build_method(
    name: str,
    target: LoadedModel,
    drafter: LoadedModel | None = None,
    options: MethodOptions = MethodOptions(),
    strict: bool = True,
) -> Method:
    """The method called ``name``; a drafter model is checked against the target.

    ``strict``: refuse what the method would not use — an option given a value other than its
    default that no part of the method reads, or a drafter model it never drafts with (each would
    otherwise change nothing, silently). A server builds with ``strict=False``: its options are
    meant for whichever method a request names."""
    check_method_name(name)
    if is_encoder_decoder(target.model):
        check_seq2seq_method(name, options)
    if not strict:  # the pooled num_draft sizes the methods that take one
        method = _BUILDERS[name](target, drafter, options if takes_num_draft(name) else replace(options, num_draft=None))
        return _with_drafter_threads(method, drafter)
    seen_options, seen_drafter = _Reads(options), None if drafter is None else _Reads(drafter)
    method = _BUILDERS[name](target, seen_drafter, seen_options)
    method.generation()  # what a generation reads counts too
    unread = [f.name for f in fields(MethodOptions) if getattr(options, f.name) != f.default
              and (f.name not in seen_options.read or f.name in seen_options.moot)]
    if unread:
        given = ", ".join(f"{option} ({_flag(option)})" + (f" here: {seen_options.moot[option]}" if option in
                                                             seen_options.moot else "") for option in unread)
        raise MethodOptionError(f"method '{name}' does not use {given}: {'it' if len(unread) == 1 else 'they'} would "
                                "change nothing; leave it out or choose a method that uses it (tierspec generate --help "
                                "says which)")
    if seen_drafter is not None and not seen_drafter.read:
        raise MethodOptionError(f"method '{name}' drafts without a drafter model: the drafter '{drafter.identity.name}' "
                                "would change nothing; use sd, adaptive-sd, csd, pearl or a lossy rule's "
                                "--draft-with model")
    return _with_drafter_threads(method, drafter)


def _with_drafter_threads(method: Method, drafter: LoadedModel | None) -> Method:
    """``method``, its drafter model's few-row products settled on their threads (the target's are
    settled by the loop): a drafter model's passes are mostly of one row."""
    if drafter is not None:
        few_row_threads(drafter)
    return method
