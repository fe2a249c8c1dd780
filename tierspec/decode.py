"""The one decode loop (docs/algorithms.md §The decode loop): one cycle over a list of sequences.
A single generation is a cycle over a list of one; a batch of generations (``batch``, the server)
is the same cycle over many. Every method is a drafter, a draft-length policy and a verification
rule (``GenerationParts``, made per generation by the method) passed in.

One cycle (``cycle``), for chains of drafts and token trees alike (a chain is a tree of one path):

    propose   every sequence's drafter proposes (the draft head's steps of all of them together:
              ``drafters.base.propose_all``) and its policy trims the proposal
    lengths   a batch cuts the drafts to what pays for the batch's pass (``batch_lengths``), within
              the row budget; a constraint cuts forbidden drafts and adds forced ones (``constraints``)
    pass      **one** pass over every sequence's new rows (``passes.PassBackend``), prompts that are
              still prefilling taking the rows left over in chunks
    decide    every sequence's verdict from its own rows: the chains verified by the target's own
              tokens (greedy, the coupled rule) in one step (``walks.chain_batch_walks``), the others
              by their rule
    commit    every sequence commits its accepted path and next token (cut at EOS and the budget),
              its caches roll back, its drafter and policy learn; a ``Step`` per sequence

A tiered rule (VIA-SD) drives passes of its own: its sequence cycles alone (``_tiered_cycle``).

Who owns what: a ``Sequence`` its ``Verifiers`` (the target's cache, the committed tokens, the
feature log), its drafter and policy, its noise, constraint state and statistics; ``cycle`` owns
nothing across calls. Randomness: one ``sampling.Noise`` per generation, keyed by (seed, position,
purpose); nothing else a cycle decides reads the clock or carries over from another generation
(the policies start afresh), so a seed fixes the tokens (README: "Same seed, same text"). A lossless
rule's emitted token at each position is the target's own whatever was drafted, and a row's logits
are bitwise those of its solo pass, so what shares a cycle changes the speed, not the text.

Streaming is iterating over ``decode``; ``DecodeRun`` adds up the statistics as it iterates, and
``tierspec.api`` (``generate``, ``stream``), the bench and the benchmarks run generations through it.
Inference mode is entered for each cycle's computation only, never across a ``yield``, so a
suspended generation does not leak it into the caller's code.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterator, Protocol

import numpy as np
import torch

from .cached_model import RowDraws, SlimVocabulary
from .constraints import Constraint, ConstraintDeadEnd, ConstraintError, ConstraintState, MaskBuffer, constrain_all
from .costs import few_row_threads, measuring_seconds
from .drafters.base import Drafter, propose_all
from .engine import threads_for
from .errors import PromptError, TierspecError
from .layerskip.masks import RoutingMask
from .limits import check_num_draft
from .models import LoadedModel
from .modifiers import LogitModifiers
from .passes import PassBackend, PassRequest, pass_backend
from .policies import CostAware, CycleOutcome, DraftPolicy
from .proposal import DraftRequest, Proposal, Scores, Shape, Verdict, walk_reached
from .rules.base import ScoreRule, VerificationRule
from .sampling import CHECKS_UNFILTERED_DRAWS, NOT_DRAWN, BlockNoise, Noise, SamplingConfig, filters, reported_logprobs
from .seq2seq import decoder_start, is_encoder_decoder
from .verifiers import CommittedTokens, GeneratedTokens, TargetPass, Verifiers
from .walks import ChainBatch, chain_batch_walks

__all__ = ["CommittedTokens", "CycleStats", "CycleTimes", "DecodeConfig", "DecodeRun", "GeneratedTokens",
           "GenerationParts", "GenerationStats", "Sequence", "Step", "TokenLogprob", "cycle", "decode", "open_sequence"]

#: Most alternatives a token's log-probability record lists (OpenAI's ``top_logprobs`` limit).
MAX_TOP_LOGPROBS = 20
#: Prompt tokens a cycle prefills beside sequences that decode, when the caller sets no row budget:
#: a joining prompt then costs the others a pass of about this many more rows per cycle.
PREFILL_CHUNK = 64
#: Tokens a constraint may force after a cycle's drafts when the caller sets no row budget (each is a
#: row of the pass, certain to be kept).
FORCED_PER_CYCLE = 16


@dataclass(frozen=True)
class DecodeConfig:
    """Run-time settings of one generation (separate from statistics and model state).

    ``modifiers``: penalties and logit bias on the target's logits (``tierspec.modifiers``).
    ``logprobs``: None, or record each emitted token's log-probability under the target with the
    ``logprobs`` most likely alternatives (0 .. MAX_TOP_LOGPROBS), read from the verification pass
    that scored the token (``sampling.reported_logprobs``). ``score_prompt``: also record the
    prompt tokens' (from the prefill; needs ``logprobs``). ``num_draft``: this generation's largest
    draft (the method's γ, or the longest draft its policy may choose; None: the method's own,
    ``methods.Method.generation``). ``constraint``: a stateful modifier the text must obey (a
    grammar: ``constraints.Constraint``), each generation moving its own state."""

    max_new_tokens: int = 128
    sampling: SamplingConfig = SamplingConfig()
    eos_token_ids: tuple[int, ...] = ()
    modifiers: LogitModifiers = LogitModifiers()
    logprobs: int | None = None
    score_prompt: bool = False
    num_draft: int | None = None
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise PromptError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise PromptError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] or None, got {self.logprobs!r}")
        if self.score_prompt and self.logprobs is None:
            raise PromptError("score_prompt records log-probabilities: give logprobs too")
        check_num_draft(self.num_draft)


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the target (``sampling.reported_logprobs``) and the
    ``top`` alternatives at its position, most likely first: (token id, log-probability) pairs.
    ``logprob`` is None for a prompt's first token, which nothing scores."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], sampling: SamplingConfig, top: int) -> list[TokenLogprob]:
    """The records of ``tokens`` [r] scored by ``logits`` [r, V] (row i is the target's logits
    before token i, modifiers applied): the reported log-probability of each and its ``top`` most
    likely alternatives."""
    if not tokens:
        return []
    logprobs = reported_logprobs(logits[: len(tokens)], sampling)  # [r, V]
    chosen = logprobs.gather(-1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].tolist()
    if top:
        values, ids = logprobs.topk(top, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(token, logprob, alternatives) for token, logprob, alternatives in zip(tokens, chosen, tops)]


@dataclass(slots=True)
class CycleStats:
    """What one draft–verify–commit cycle did."""

    drafted: int  # tokens sent to verification
    evaluated: int  # draft tokens up to and including the first rejection
    accepted: int  # draft tokens kept
    emitted: int  # tokens committed this cycle (after EOS / max_new_tokens truncation)
    target_calls: int  # full-target forward passes
    slim_calls: int  # slim-verifier forward passes
    drafter_calls: int  # drafter model forward passes
    seconds: float
    draft_seconds: float = 0.0  # of which drafting
    pass_seconds: float = 0.0  # of which verifier passes (full target and slim), the forward calls alone
    grammar_seconds: float = 0.0  # of which the constraint's own work (masks, forced tokens, cuts, advancing)
    deciders: list[str] = field(default_factory=list)  # tier that decided each emitted token
    tree_depth: int | None = None  # a token-tree cycle: the tree's depth (``drafted`` is its node count); None: a chain


@dataclass
class GenerationStats:
    """Totals over one generation (docs/metrics.md §Generation statistics, §Acceptance).

    ``position_drafted[i]`` counts cycles whose draft reached position i+1 *and* whose drafts
    1..i were all accepted; ``position_accepted[i]`` those of them whose draft i+1 was accepted:
    their ratio is the acceptance by draft position (docs/metrics.md §Acceptance). For a token tree (docs/algorithms.md §Token trees) the
    position is the depth: ``position_drafted[d]`` counts cycles whose walk reached depth d with a
    child to try below it, so the ratio is the acceptance by depth.

    Tree cycles also add up ``tree_nodes`` (nodes per pass), ``tree_depth`` and the depth of the
    deepest tree; ``accepted_lengths[L]`` counts the cycles (chain or tree) that accepted L drafts."""

    drafted: int = 0
    evaluated: int = 0
    accepted: int = 0
    emitted: int = 0
    target_calls: int = 0
    slim_calls: int = 0
    drafter_calls: int = 0
    cycles: int = 0
    wall_seconds: float = 0.0
    draft_seconds: float = 0.0
    pass_seconds: float = 0.0
    grammar_seconds: float = 0.0
    decided_by: Counter = field(default_factory=Counter)
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)
    tree_cycles: int = 0
    tree_nodes: int = 0
    tree_depth: int = 0
    tree_max_nodes: int = 0
    tree_max_depth: int = 0

    def add(self, cycle: CycleStats) -> None:
        self.drafted += cycle.drafted
        self.evaluated += cycle.evaluated
        self.accepted += cycle.accepted
        self.emitted += cycle.emitted
        self.target_calls += cycle.target_calls
        self.slim_calls += cycle.slim_calls
        self.drafter_calls += cycle.drafter_calls
        self.draft_seconds += cycle.draft_seconds
        self.pass_seconds += cycle.pass_seconds
        self.grammar_seconds += cycle.grammar_seconds
        self.cycles += 1
        for decider in cycle.deciders:  # not Counter.update: its isinstance(…, Mapping) is an ABC check a cycle
            self.decided_by[decider] += 1
        # Positions 1..evaluated were evaluated given acceptance so far; the first `accepted` passed.
        evaluated, accepted = cycle.evaluated, cycle.accepted
        if evaluated:
            drafted, kept = self.position_drafted, self.position_accepted
            if len(drafted) < evaluated:
                drafted += [0] * (evaluated - len(drafted))
                kept += [0] * (evaluated - len(kept))
            for i in range(evaluated):
                drafted[i] += 1
                kept[i] += i < accepted
        lengths = self.accepted_lengths
        if len(lengths) <= accepted:
            lengths += [0] * (accepted + 1 - len(lengths))
        lengths[accepted] += 1
        if cycle.tree_depth is not None:
            self.tree_cycles += 1
            self.tree_nodes += cycle.drafted
            self.tree_depth += cycle.tree_depth
            self.tree_max_nodes = max(self.tree_max_nodes, cycle.drafted)
            self.tree_max_depth = max(self.tree_max_depth, cycle.tree_depth)

    @property
    def rejection_rate(self) -> float:
        """Rejected / evaluated draft tokens (the VIA-SD paper's metric)."""
        return (self.evaluated - self.accepted) / self.evaluated if self.evaluated else 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        """τ = emitted tokens per full-target call (plain decoding: 1.0)."""
        return self.emitted / self.target_calls if self.target_calls else float(self.emitted)

    @property
    def tokens_per_second(self) -> float:
        """The one definition used everywhere: emitted tokens / wall seconds of the generation
        (prompt in to last token out, prefill included)."""
        return self.emitted / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.position_accepted, self.position_drafted)]

    @property
    def accepted_per_cycle(self) -> float:
        """Mean drafts accepted per cycle (a tree: the accepted path's length)."""
        return self.accepted / self.cycles if self.cycles else 0.0

    def tree_summary(self) -> dict | None:
        """A tree method's shape and yield (None when no cycle verified a tree): mean and largest
        nodes per pass and depth, accepted path length per cycle (mean and counts by length), and
        acceptance by depth (``acceptance_by_position`` read by depth)."""
        if not self.tree_cycles:
            return None
        return {
            "cycles": self.tree_cycles,
            "nodes_per_pass": round(self.tree_nodes / self.tree_cycles, 4),
            "max_nodes": self.tree_max_nodes,
            "depth_mean": round(self.tree_depth / self.tree_cycles, 4),
            "max_depth": self.tree_max_depth,
            "accepted_per_cycle": round(self.accepted_per_cycle, 4),
            "accepted_length_counts": list(self.accepted_lengths),
            "acceptance_by_depth": [round(a, 4) for a in self.acceptance_by_position()],
        }

    def tier_fractions(self) -> dict[str, float]:
        total = sum(self.decided_by.values())
        return {tier: count / total for tier, count in sorted(self.decided_by.items())} if total else {}

    def to_dict(self) -> dict:
        return {
            "drafted": self.drafted,
            "evaluated": self.evaluated,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "rejection_rate": round(self.rejection_rate, 4),
            "mean_accepted_tokens": round(self.mean_accepted_tokens, 4),
            "acceptance_by_position": [round(a, 4) for a in self.acceptance_by_position()],
            "target_calls": self.target_calls,
            "slim_calls": self.slim_calls,
            "drafter_calls": self.drafter_calls,
            "cycles": self.cycles,
            "tier_fractions": {k: round(v, 4) for k, v in self.tier_fractions().items()},
            "draft_seconds": round(self.draft_seconds, 4),
            "pass_seconds": round(self.pass_seconds, 4),
            "grammar_seconds": round(self.grammar_seconds, 4),
            "wall_seconds": round(self.wall_seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "accepted_per_cycle": round(self.accepted_per_cycle, 4),
            **({"tree": self.tree_summary()} if self.tree_cycles else {}),
        }



@dataclass(frozen=True)
class GenerationParts:
    """What one generation runs with, made for it by its method (``methods.Method.generation``):
    a drafter and a policy of its own (they keep per-generation state) and the rule."""

    drafter: Drafter
    policy: DraftPolicy
    rule: VerificationRule


class DecodeMethod(Protocol):
    """What the loop reads of a method (``methods.Method``): its name, the verifier settings it
    needs, and the parts it makes for each generation."""

    name: str
    slim_mask: RoutingMask | None  # VIA-SD's slim verifier: the target under this mask
    slim_vocabulary: SlimVocabulary | None  # the slim tier scores only these tokens

    def generation(self, num_draft: int | None = None) -> GenerationParts:
        ...


@dataclass(slots=True)
class Step:
    """What the loop yields after each commit: the cycle's new tokens, statistics, the proposal it
    verified and the verdict. With ``DecodeConfig.logprobs``: ``logprobs``, one record per new
    token; the first step also carries ``prompt_logprobs`` with ``DecodeConfig.score_prompt``
    (None for the first prompt token, which nothing scores)."""

    new_tokens: list[int]
    cycle: CycleStats
    finished: bool
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    committed: CommittedTokens | None = None  # the generation's committed sequence (read it, never change it)
    proposal: Proposal | None = None  # what this cycle verified
    verdict: Verdict | None = None


def check_logprobs_method(method: DecodeMethod, config: DecodeConfig) -> None:
    """Refuse log-probabilities where tokens are committed that no target pass scored: VIA-SD's
    slim tier commits tokens before the full target sees them."""
    if config.logprobs is not None and method.slim_mask is not None:
        raise TierspecError(f"method '{method.name}' cannot report log-probabilities: its slim verifier commits "
                            "tokens the full target has not scored; use a method without a slim tier (e.g. hybrid, "
                            "eagle, pld, ar)")


def check_constraint_method(method: DecodeMethod, rule: VerificationRule, config: DecodeConfig) -> None:
    """Refuse a constraint where a rule could emit what the constraint forbids (``check_constrainable``)."""
    if config.constraint is not None:
        check_constrainable(method, rule)


def check_constrainable(method: DecodeMethod, rule: VerificationRule) -> None:
    """Refuse a method whose rule could emit what a constraint forbids: only the exact rule
    verifies against the masked target alone (a lossy rule mixes in the drafter's unmasked
    distribution; VIA-SD's slim tier commits tokens before the full target scores them)."""
    if not (isinstance(rule, ScoreRule) and rule.lossless):
        raise TierspecError(f"method '{method.name}' cannot decode under a constraint (a grammar): its rule "
                            f"'{rule.name}' may emit tokens outside the constrained target's distribution; use a "
                            "lossless method (hybrid, eagle, pld, ar, …)")


def prompt_records(prompt_ids: torch.Tensor, rows: torch.Tensor, config: DecodeConfig) -> list[TokenLogprob]:
    """The echo records of ``prompt_ids`` [n] from the prefill's ``rows`` [n−1, V] (the first
    token's logprob is None)."""
    first = TokenLogprob(int(prompt_ids[0]), None)
    return [first] + token_logprobs(rows, prompt_ids[1:].tolist(), config.sampling, config.logprobs)


def check_shapes(drafter: Drafter, rule: VerificationRule) -> None:
    """Refuse a drafter whose proposals the rule cannot verify (``VerificationRule.accepts``).
    Only the exact rule verifies token trees (greedy, coupled, multi-draft residual;
    docs/algorithms.md §Token trees). The lossy rules (lossy, cascade, judge, VIA and via-judge)
    are defined over one chain of drafts: the lossy and cascade tests compare a draft with the
    target's distribution at its position, the judge head scores the drafts of a chain one by
    one, and VIA's slim verifier runs ahead of a lagging full target on one committed chain; none
    is built over a tree yet, so trees stay lossless-only and the lossy rules keep chain drafters."""
    if drafter.proposes not in rule.accepts:
        raise TierspecError(f"the rule '{rule.name}' verifies chains only: a token tree needs the exact rule "
                            "(rules.exact.ExactRule, the methods eagle-tree and hybrid-tree, lossless). "
                            f"For '{rule.name}', use a chain drafter instead (methods eagle, hybrid, pld).")


def reach(prompt_length: int, config: DecodeConfig, policy: DraftPolicy) -> int:
    """Every position a generation can reach: the prompt, the token budget, and the last
    verification pass's rows past the committed tokens — its draft rows, or the padded size of a
    pass when that is larger (a pass starts at most at the committed length)."""
    table = policy.pass_costs
    return prompt_length + config.max_new_tokens + max(policy.max_rows, 0 if table is None else table.max_tokens)


class Sequence:
    """One generation in the cycle: its ``verifiers`` (the target's cache, its committed tokens and
    feature log), its ``drafter``, ``policy`` and ``rule``, its run-time ``config``, its ``noise``
    (the seed), its ``constraint`` state (None: unconstrained) and its statistics. ``key`` names it
    to whoever runs several (a batch, the server). Made by ``open_sequence``; it decodes once its
    prompt is prefilled (``ready``) and until it is ``finished``.

    ``scored``: the rule is a function of one pass's scores (it joins the cycle's pass), else it
    drives passes of its own (VIA-SD's tiers). ``batchable``: the sequence keeps its solo text
    whatever shares its cycles — its rule is lossless and scored (the lossy rules' text depends on
    the drafts, which a batch sizes by what else runs; a tiered rule runs passes of its own)."""

    def __init__(self, key: Hashable, verifiers: Verifiers, parts: GenerationParts, config: DecodeConfig, noise: Noise,
                 prompt_ids: torch.Tensor, constraint: ConstraintState | None):
        self.key = key
        self.verifiers = verifiers
        self.drafter, self.policy, self.rule = parts.drafter, parts.policy, parts.rule
        self.config = config
        self.eos = frozenset(config.eos_token_ids)
        self.noise = noise
        self.constraint = constraint
        self.grammar_seconds = 0.0  # the constraint's own work so far (``CycleStats.grammar_seconds``)
        self.stats = GenerationStats()
        self.timed = True  # ``stats.wall_seconds`` read from ``started`` each cycle (False: its owner keeps the clock)
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self.finished = False
        #: why the generation ended early, where it did (``ConstraintDeadEnd``): its text is not complete
        self.error: TierspecError | None = None
        self.started = time.perf_counter()
        self.tree_stats = self.drafter.proposes is Shape.TREE  # each cycle reports its tree's shape
        self._prompt_ids = prompt_ids
        self._end = len(prompt_ids) + config.max_new_tokens  # the committed length it may reach (prompt: prefilled)
        self.ready = False  # the prompt is prefilled and the drafter and policy started
        # The rule is the generation's for good: what it is asked once, not every cycle.
        self.scored = isinstance(self.rule, ScoreRule)
        self.batchable = self.scored and self.rule.lossless
        # Whether the policy learns from verdicts (the base policy's ``observe`` does nothing: its
        # cycles make no outcome to tell it).
        self.learns = type(self.policy).observe is not DraftPolicy.observe

    @property
    def committed(self) -> CommittedTokens:
        return self.verifiers.committed

    @property
    def token_ids(self) -> list[int]:
        """The tokens generated so far."""
        return self.committed.generated()

    @property
    def tokens_left(self) -> int:
        return self._end - self.verifiers.committed.length

    def finish_reason(self) -> str | None:
        """Why the generation ended (None: it has not): ``"stop"`` at an end token or where its
        constraint's text was complete (the budget may end it after a closing brace, before the
        end token the grammar would force next), ``"error"`` where an error of its own ended it
        (``error``), else ``"length"``: the token budget cut it, and a constrained text is then
        incomplete (not valid under its constraint)."""
        if not self.finished:
            return None
        if self.error is not None:
            return "error"
        tokens = self.committed.generated(self.committed.generated_count - 1)
        if tokens and tokens[-1] in self.eos:
            return "stop"
        return "stop" if self.constraint is not None and self.constraint.accepting() else "length"

    def _begin_decoding(self) -> None:
        """The prompt is prefilled: its records kept (``echo``), the drafter and policy started."""
        verifiers = self.verifiers
        rows = verifiers.prompt_rows()
        if rows is not None:
            self.prompt_logprobs = prompt_records(self._prompt_ids, rows, self.config)
        self.drafter.start(self._prompt_ids, verifiers.features,
                           verifiers.draft_view() if self.drafter.uses_target_cache else None)
        self.policy.start()
        self.ready = True


def open_sequence(target: LoadedModel, method: DecodeMethod, prompt_ids: torch.Tensor, config: DecodeConfig,
                  seed: int | torch.Generator | None = None, key: Hashable = None, prefill: bool = True) -> Sequence:
    """A generation set up for its first cycle: checked, its parts made by ``method`` (with the
    config's ``num_draft``), its verifiers made. ``prefill``: its prompt prefilled now in a pass of
    its own (else the cycles prefill it in chunks beside other sequences' rows)."""
    parts = method.generation(config.num_draft)
    drafter, rule, policy = parts.drafter, parts.rule, parts.policy
    check_shapes(drafter, rule)
    check_logprobs_method(method, config)
    check_constraint_method(method, rule, config)
    max_positions = getattr(target.model.config, "max_position_embeddings", None)
    prompt_ids = check_prompt(prompt_ids, max_positions, config.max_new_tokens, target.vocab_size)
    source = None
    if is_encoder_decoder(target.model):  # the prompt is the encoder's; the loop decodes the decoder's sequence
        if config.score_prompt:
            raise TierspecError("an encoder-decoder model reads the prompt with its encoder: there are no prompt "
                                "log-probabilities to report (echo)")
        source, prompt_ids = prompt_ids, decoder_start(target.model)
    config.modifiers.check_vocabulary(target.vocab_size)
    few_row_threads(target)  # which threads few-row products run on here: settled once per model
    drafter.set_source(source)
    verifiers = Verifiers(target, reach(len(prompt_ids), config, policy), slim_mask=method.slim_mask,
                          pass_costs=policy.pass_costs, record_features=drafter.needs_target_features,
                          feature_layers=drafter.feature_layers, feature_history=drafter.feature_history,
                          slim_vocabulary=method.slim_vocabulary, source=source, modifiers=config.modifiers)
    constraint = None if config.constraint is None else config.constraint.start()
    sequence = Sequence(key, verifiers, parts, config, Noise(seed, target.vocab_size), prompt_ids, constraint)
    verifiers.begin_prefill(prompt_ids, score=config.score_prompt)
    if prefill:
        with torch.inference_mode():
            verifiers.run_prefill()
    if not verifiers.prefilling:
        with torch.inference_mode():
            sequence._begin_decoding()
    return sequence


# ---- the cycle -------------------------------------------------------------------------------------


@dataclass
class CycleTimes:
    """Where cycles' wall time went (seconds, added up over cycles): drafting (every drafter and
    policy, the batch's cut), the constraint's own work (its masks, cuts and forced tokens, and
    advancing it by the committed tokens: ``grammar``), the pass, deciding (the rules), committing
    (the commit, the policies learning, the statistics); ``rows`` the passes' rows."""

    draft: float = 0.0
    passes: float = 0.0
    verify: float = 0.0
    commit: float = 0.0
    grammar: float = 0.0
    rows: int = 0
    cycles: int = 0
    sequences: int = 0  # sequences over all cycles (mean batch = sequences / cycles)

    def add(self, other: "CycleTimes") -> None:
        # Every field is a sum over cycles, written out: a loop over the fields by name cost a lone
        # generation's cycle ~7 µs after its pass (py-spy samples, Zen 4); ``test_cycle_times_add_every_field``
        # checks it adds each.
        self.draft += other.draft
        self.passes += other.passes
        self.verify += other.verify
        self.commit += other.commit
        self.grammar += other.grammar
        self.rows += other.rows
        self.cycles += other.cycles
        self.sequences += other.sequences

    def to_dict(self) -> dict:
        return {"draft": self.draft, "grammar": self.grammar, "pass": self.passes, "verify": self.verify,
                "commit": self.commit}


@dataclass(slots=True)
class _Drafted:
    """A sequence's proposal on its way through the cycle: what its drafter proposed, what the
    cycle verifies, the block's noise, and the counters the cycle's statistics start from."""

    sequence: Sequence
    drafted: Proposal
    proposal: Proposal
    block: BlockNoise | None
    target_calls: int
    slim_calls: int
    pass_seconds: float
    grammar_seconds: float  # the sequence's ``grammar_seconds`` before this cycle
    masks: torch.Tensor | None = None
    by_target_tokens: bool = False  # the rule walks ``proposal`` by the target's own tokens (set before the pass)


def cycle(sequences: list[Sequence], passes: PassBackend, max_rows: int | None = None,
          shared_costs: bool = True, lone_prefill: int | None = None) -> tuple[list[tuple[Sequence, Step]], CycleTimes]:
    """One draft–verify–commit cycle for every sequence that is not finished (module docstring):
    the ready ones decode, the others prefill in chunks from the rows left. ``max_rows``: at most
    that many rows in the pass (drafts are cut to fit, every decoding sequence keeps its one row;
    None: a prefill takes ``PREFILL_CHUNK`` rows beside others, ``lone_prefill`` rows alone — None:
    its whole prompt, the fastest where nothing may join; a server bounds it, so that a request
    that joins, a cancel or a shutdown waits one chunk, not a long prompt's whole pass).
    ``shared_costs``: a batch's policies cost drafts as the batch's passes (False: as if alone).
    Returns a ``Step`` per decoding sequence and where the cycle's time went."""
    times = CycleTimes(cycles=1)
    began = time.perf_counter()
    live = [s for s in sequences if not s.finished]
    constrained = [s for s in live if s.constraint is not None]  # the only ones whose grammar time moves
    grammar_before = sum(s.grammar_seconds for s in constrained)
    out = [(s, _tiered_cycle(s)) for s in live if s.ready and not s.scored]
    decoding = [s for s in live if s.ready and s.scored]
    prefilling = [s for s in live if not s.ready]
    batch = len(decoding) + len(prefilling) > 1 and passes.shares_passes
    shared = len(decoding) if batch and shared_costs else 1
    for sequence in decoding:  # each policy costs its drafts as this cycle's passes (policies.CostModel.verify)
        policy = sequence.policy
        policy.share_passes(shared if sequence.batchable else 1)
        policy.at_context(sequence.verifiers.committed.length)
    drafted = _propose(decoding)
    if batch:
        _cut_to_the_batch(drafted, passes, max_rows)
    if any(d.sequence.constraint is not None for d in drafted):
        _constrain(drafted, max_rows)
        drafted = [d for d in drafted if d.sequence.error is None]  # a dead end ends its generation alone
    requests: list[PassRequest] = []
    target_passes: list[TargetPass] = []
    alone = len(drafted) + len(prefilling) == 1  # a lone pass is padded to the cheapest measured size
    rows = 0
    for d in drafted:
        sequence = d.sequence
        rule = sequence.rule
        d.by_target_tokens = rule.walks_by_target_tokens(d.proposal, sequence.config.sampling)
        target_pass = sequence.verifiers.target_request(
            d.proposal, with_hidden=rule.reads_hidden, pad=alone, masks=d.masks,
            record_features=sequence.drafter.wants_features(), draws=None if d.block is None else _row_draws(d))
        target_passes.append(target_pass)
        requests.append(target_pass.request)
        rows += target_pass.request.rows
    chunks = _prefill_chunks(prefilling, max_rows, rows, bool(drafted), lone_prefill)
    requests += [chunk.request for _, chunk in chunks]
    drafted_at = time.perf_counter()
    grammar_drafting = sum(s.grammar_seconds for s in constrained) - grammar_before
    times.draft = drafted_at - began - grammar_drafting
    if requests:
        results = passes.run(requests)
        passed_at = time.perf_counter()
        times.passes = passed_at - drafted_at
        times.rows = rows + sum(chunk.request.rows for _, chunk in chunks)
        share = times.passes / len(requests)
        for (sequence, chunk), result in zip(chunks, results[len(drafted):]):
            sequence.verifiers.pass_seconds += share
            sequence.verifiers.prefill_result(chunk, result)
            if not sequence.verifiers.prefilling:
                sequence._begin_decoding()
        scores = []
        for d, target_pass, result in zip(drafted, target_passes, results):
            d.sequence.verifiers.pass_seconds += share
            scores.append(d.sequence.verifiers.target_scores(target_pass, result))
        verdicts = _decide(drafted, scores)
        decided_at = time.perf_counter()
        times.verify = decided_at - passed_at
        per_sequence = (decided_at - began) / max(len(drafted), 1)
        for d, verdict in zip(drafted, verdicts):
            out.append((d.sequence, _conclude(d, verdict, times.draft / len(drafted), per_sequence)))
        times.commit = time.perf_counter() - decided_at
    times.grammar = sum(s.grammar_seconds for s in constrained) - grammar_before
    times.commit -= times.grammar - grammar_drafting  # advancing the constraints by the committed tokens
    times.sequences = len(out) + len(chunks)
    return out, times


def _propose(decoding: list[Sequence]) -> list[_Drafted]:
    """Every ready sequence's proposal, trimmed by its policy (the draft head's steps of all of
    them together: ``drafters.base.propose_all``)."""
    requests, blocks, contexts = [], [], []
    for sequence in decoding:
        committed, policy, sampling = sequence.verifiers.committed, sequence.policy, sequence.config.sampling
        contexts.append(committed.array)
        position = committed.length
        # Never draft past the budget: the cycle emits at most (drafts on the path) + 1 tokens.
        budget = max(0, min(policy.max_draft, sequence.tokens_left - 1))
        if budget and sequence.constraint is not None and _forced_next(sequence):
            budget = 0  # the constraint's forced tokens are this cycle's drafts (``_constrain``): no drafter steps
        # Draft token i (a node at depth i + 1) and the token after the drafts sit at position + i.
        block = None if sampling.greedy else sequence.noise.block(position)
        blocks.append(block)
        requests.append(DraftRequest(budget, sampling, block, policy))
    proposals = propose_all([s.drafter for s in decoding], contexts, requests)
    drafted = []
    for sequence, request, block, proposal in zip(decoding, requests, blocks, proposals):
        verified = proposal
        if len(proposal.tree):  # an empty proposal is its own trim (a policy's trim only chooses a length)
            verified = proposal.prefix(sequence.policy.trim(proposal, _forced_runs(sequence, proposal)))
            if verified.tree.depth > request.budget:
                raise TierspecError(f"{type(sequence.drafter).__name__} drafted {verified.tree.depth} tokens deep for "
                                    f"a budget of {request.budget}")
        verifiers = sequence.verifiers
        drafted.append(_Drafted(sequence, proposal, verified, block, verifiers.target_calls, verifiers.slim_calls,
                                verifiers.pass_seconds, sequence.grammar_seconds))
    return drafted


def _row_draws(d: _Drafted) -> RowDraws | None:
    """The keyed draws the pass may make for a sampled chain that the target's own tokens decide
    (``walks.chain_batch_walks``): every row's at the temperature, under the block's keys. Under top-k
    or top-p they are the unfiltered rows' draws, each the filtered row's where the filters surely
    keep it (``sampling.keyed_allowed_tokens``: the walk checks them) — none where the check does not
    run (``sampling.CHECKS_UNFILTERED_DRAWS``)."""
    sampling = d.sequence.config.sampling
    if d.block is None or not d.by_target_tokens or (not CHECKS_UNFILTERED_DRAWS
                                                      and filters(sampling, d.sequence.verifiers.runner.vocab_size)):
        return None
    return RowDraws(d.block.keys(len(d.proposal) + 1), sampling.temperature)


def _forced_runs(sequence: Sequence, proposal: Proposal) -> list[int] | None:
    """For the policy's trim, under a constraint and for a chain of drafts: entry j is how many
    forced tokens the constraint would append after the first j drafts (at most what
    ``_constrain`` appends without a row budget), for j up to the drafts it takes; None
    otherwise. The state is left at the committed tokens."""
    state = sequence.constraint
    if state is None or not proposal.is_chain or not len(proposal):
        return None
    began = time.perf_counter()
    limit = min(len(proposal), sequence.policy.max_draft)

    def run(drafts: int) -> int:
        return len(state.forced()[: max(0, min(FORCED_PER_CYCLE, sequence.tokens_left - 1 - drafts))])

    runs = [run(0)]
    for token in proposal.token_list[:limit]:
        if state.advance([token]) != 1:
            break
        runs.append(run(len(runs)))
    state.rollback(len(runs) - 1)
    sequence.grammar_seconds += time.perf_counter() - began
    return runs


def _forced_next(sequence: Sequence) -> bool:
    """Whether the sequence's constraint allows exactly one continuation after the committed
    tokens. Then the drafter is not asked this cycle: whatever it drafted would be cut where it
    leaves the forced tokens, and ``_constrain`` proposes those tokens free, each accepted with
    probability 1 (the masked target puts all its mass on it), so its steps could add nothing
    but the drafts after the forced run, which it would have to draft blind to that run."""
    began = time.perf_counter()
    forced = bool(sequence.constraint.forced())
    sequence.grammar_seconds += time.perf_counter() - began
    return forced


def _cut_to_the_batch(drafted: list[_Drafted], passes: PassBackend, max_rows: int | None) -> None:
    """Cut the batchable sequences' chains to what pays for the batch's pass (``batch_lengths``),
    then every proposal to the row budget (largest first). A sequence that keeps its solo text
    only with its own drafts (a lossy rule) keeps them."""
    # An empty proposal has nothing to cut: it is one row of the pass and one token, nothing to choose.
    drafting = [d for d in drafted if len(d.proposal.tree)]
    if not drafting:
        return
    others = len(drafted) - len(drafting)
    proposals = [d.proposal for d in drafting]
    reaches = [_reach(d) if d.sequence.batchable else None for d in drafting]
    lengths = batch_lengths(proposals, reaches, _pass_seconds(drafted), others)
    if max_rows is not None:
        lengths = _fit_rows(lengths, max_rows - others)
    for d, length in zip(drafting, lengths):
        if length < len(d.proposal):
            d.proposal = d.proposal.prefix(length)


def _constrain(drafted: list[_Drafted], max_rows: int | None) -> None:
    """Every constrained proposal under its sequence's state (``constraints.constrain``): forbidden
    drafts cut, forced tokens added after a drafting method's chain (within the token budget and
    the rows left, at most ``FORCED_PER_CYCLE`` without a row budget), the masks of all their rows filled into one
    buffer (a grammar's chains in one parallel call: ``constraints.constrain_all``)."""
    constrained = [d for d in drafted if d.sequence.constraint is not None]
    spare = None if max_rows is None else max(max_rows - sum(1 + len(d.proposal) for d in drafted), 0)
    rooms = []
    for d in constrained:
        room = len(d.proposal)
        # Forced tokens are drafts: a method that drafts (its policy may draft) takes them free;
        # plain decoding (``ar``: no drafts) emits one token a pass, as constrained decoding
        # without speculation does (llama.cpp's grammars, vLLM's structured output).
        if d.proposal.is_chain and d.sequence.policy.max_draft > 0:
            more = FORCED_PER_CYCLE if spare is None else spare
            room = max(room, min(d.sequence.tokens_left - 1, room + more))
            if spare is not None:
                spare -= room - len(d.proposal)
        rooms.append(room)
    began = time.perf_counter()
    buffer = MaskBuffer(sum(1 + room for room in rooms), constrained[0].sequence.verifiers.runner.vocab_size)
    results = constrain_all([d.sequence.constraint for d in constrained], [d.proposal for d in constrained], rooms,
                            buffer)
    share = (time.perf_counter() - began) / len(constrained)  # one parallel mask fill: an equal share each
    for d, result in zip(constrained, results):
        d.proposal, d.masks = result.proposal, result.masks
        d.sequence.grammar_seconds += share
        open_rows = result.masks.numpy().any(axis=1)  # (numpy: torch's reduction over 49,152 columns is ~10× slower)
        if not open_rows[0]:  # no token may come: the generation cannot go on
            why = getattr(d.sequence.constraint, "dead_end", None)
            d.sequence.error = ConstraintDeadEnd((why() if why is not None else None)
                                                 or "the constraint allows no token after the text so far")
            d.sequence.finished = True
        elif not open_rows.all():  # a node after which no token may come: verified, its row would be sampled
            first = int(np.flatnonzero(~open_rows)[0])  # from nothing; cut before it (the dead end is met at row 0)
            d.proposal, d.masks = d.proposal.prefix(first - 1), d.masks[:first]


def _prefill_chunks(prefilling: list[Sequence], max_rows: int | None, used: int, others: bool,
                    lone: int | None = None):
    """The prompt chunks this cycle's pass takes, first come first: the rows ``max_rows`` leaves
    after the decoding sequences' (at least one row each prompt; without a budget
    ``PREFILL_CHUNK`` beside decoding sequences, ``lone`` rows when nothing else runs — None: the
    whole prompt)."""
    chunks = []
    for sequence in prefilling:
        if max_rows is not None:
            rows = max(1, max_rows - used)
        else:
            rows = PREFILL_CHUNK if others or chunks else lone
        chunk = sequence.verifiers.prefill_request(rows)
        chunks.append((sequence, chunk))
        used += chunk.request.rows
    return chunks


def _decide(drafted: list[_Drafted], scores: list[Scores]) -> list[Verdict]:
    """Every sequence's verdict: the chains decided by the target's own tokens all at once
    (``walks.chain_batch_walks``), every other proposal by its rule."""
    verdicts: list[Verdict | None] = [None] * len(drafted)
    matched = [i for i, d in enumerate(drafted) if d.by_target_tokens]
    if matched:
        # The batch's lists in one sweep over the matched sequences: the draft tokens, each row's
        # maxima where the pass found every sequence's (a greedy walk then reads no logits) and the
        # draws the pass made for sampled chains (every row of the others marked as not drawn).
        tokens, num_drafts, samplings, blocks, maxima, drawn = [], [], [], [], [], []
        every_maximum, any_drawn, read = True, False, False
        for i in matched:
            d, score = drafted[i], scores[i]
            tokens += d.proposal.token_list
            num_drafts.append(len(d.proposal.tree))
            sampling = d.sequence.config.sampling
            samplings.append(sampling)
            blocks.append(d.block)
            if score.first_maxima is None:
                every_maximum = False
            elif every_maximum:
                maxima += score.first_maxima
            drawn.append(score.keyed_draws)
            if score.keyed_draws is not None:
                any_drawn = True
            if not sampling.greedy and (score.keyed_draws is None or sampling.top_k or sampling.top_p < 1.0):
                read = True  # a sampled walk draws the rows the pass did not, and checks its draws under top-k or top-p
        draws = None
        if any_drawn:
            draws = [token for k, rows in zip(num_drafts, drawn) for token in (rows or [NOT_DRAWN] * (k + 1))]
        # The logits are joined only where a walk reads them: a greedy one where the pass found no
        # maxima, a sampled one whose rows the pass did not draw or that top-k or top-p filters.
        read = read or (not every_maximum and any(sampling.greedy for sampling in samplings))
        batch = ChainBatch(tokens, num_drafts, rows_together([scores[i].logits for i in matched]) if read else None,
                           samplings, blocks, maxima if every_maximum else None, draws)
        for i, walk in zip(matched, chain_batch_walks(batch)):
            verdicts[i] = drafted[i].sequence.rule.verdict(walk)
    for i, d in enumerate(drafted):
        if verdicts[i] is None:
            verdicts[i] = d.sequence.rule.decide(d.proposal, scores[i], d.sequence.config.sampling, d.block)
    return verdicts


def rows_together(parts: list[torch.Tensor]) -> torch.Tensor:
    """``parts`` (rows [r_i, V] each) as one tensor [Σ r_i, V]: a view when they lie one after
    another in one buffer (a batched pass's logits), else copied together."""
    first = parts[0]
    if len(parts) == 1:
        return first
    # Adjacent by address and all within the first's storage: then the view reads the very bytes of
    # the parts (storages never overlap). One address a part: asking each part for its storage made a
    # Python object a part, every cycle.
    dtype, width, size = first.dtype, first.shape[1:], first.element_size()
    address, rows = first.data_ptr(), 0
    for part in parts:
        if part.data_ptr() != address or part.dtype != dtype or part.shape[1:] != width or not part.is_contiguous():
            return torch.cat(parts)
        address += part.numel() * size
        rows += part.shape[0]
    if (first.storage_offset() * size + address - first.data_ptr()) > first.untyped_storage().nbytes():
        return torch.cat(parts)
    return first.as_strided((rows, *width), first.stride())


def _conclude(d: _Drafted, verdict: Verdict, draft_seconds: float, seconds: float) -> Step:
    """Commit the verdict and report the cycle: the accepted path + the correction/bonus token,
    cut at EOS and the budget; the policy learns from the drafter's part of it."""
    sequence, proposal = d.sequence, d.proposal
    verifiers = sequence.verifiers
    path = verdict.path
    if path:  # the accepted drafts' tokens
        tokens = proposal.token_list
        emitted = [tokens[node] for node in path] + [verdict.next_token]
    else:
        emitted = [verdict.next_token]
    new_tokens, finished, records = _commit(sequence, emitted, path)
    if sequence.learns:
        sequence.policy.observe(_policy_outcome(d.drafted, proposal, verdict))
    drafted = len(proposal.tree)
    accepted = len(path)
    cycle_stats = CycleStats(
        drafted,
        # A node is evaluated when its parent was reached: the accepted path's nodes and the child
        # tried below its end (the cycle's rejection; a chain's first rejected draft).
        accepted + int(drafted > 0 and walk_reached(proposal.tree, path)),
        accepted,
        len(new_tokens),
        verifiers.target_calls - d.target_calls,
        verifiers.slim_calls - d.slim_calls,
        proposal.drafter_calls,
        seconds,
        draft_seconds,
        verifiers.pass_seconds - d.pass_seconds,
        sequence.grammar_seconds - d.grammar_seconds,
        verdict.deciders[: len(new_tokens)],
        proposal.tree.depth if sequence.tree_stats else None,
    )
    return _step(sequence, Step(new_tokens, cycle_stats, finished, records, committed=sequence.committed,
                                proposal=proposal, verdict=verdict))


def _policy_outcome(drafted: Proposal, verified: Proposal, verdict: Verdict) -> CycleOutcome:
    """What the policy learns from: the drafter's own nodes and the verdict on them (a
    constraint's forced nodes after them are certain, not the drafter's)."""
    if not verified.forced:
        return CycleOutcome(drafted, verified, verdict)
    own = verified.without_forced
    k = len(own)
    if verdict.accepted <= k:
        return CycleOutcome(drafted, own, verdict)
    path = verdict.path[:k]
    return CycleOutcome(drafted, own, Verdict(path, int(verified.tokens[verdict.path[k]]), verdict.deciders[: k + 1]))


def _step(sequence: Sequence, step: Step) -> Step:
    """``step`` with the sequence's statistics brought up to it (and its echo records, once)."""
    step.prompt_logprobs, sequence.prompt_logprobs = sequence.prompt_logprobs, None
    sequence.stats.add(step.cycle)
    if sequence.timed:
        sequence.stats.wall_seconds = time.perf_counter() - sequence.started
    if step.finished:
        sequence.finished = True
    return step


def _tiered_cycle(sequence: Sequence) -> Step:
    """The cycle of a sequence whose rule drives the verifier passes itself (VIA-SD's tiers): its
    proposal, the rule's passes and verdict, its commit — alone."""
    began = time.perf_counter()
    sequence.policy.share_passes(1)
    sequence.policy.at_context(len(sequence.verifiers.committed))
    (d,) = _propose([sequence])
    drafted_at = time.perf_counter()
    verdict = sequence.rule.verify(sequence.verifiers, d.proposal, sequence.config.sampling, d.block)
    return _conclude(d, verdict, drafted_at - began, time.perf_counter() - began)


def _commit(sequence: Sequence, new_tokens: list[int], path: list[int]) -> tuple[list[int], bool, list[TokenLogprob] | None]:
    """Commit a cycle's tokens (the accepted path's + the correction/bonus token), cut after an
    EOS and at the token budget: the verifiers extend the committed sequence and roll their caches
    back, the drafter rolls its state back to the new length, the constraint advances. Returns (the
    tokens committed, whether generation is finished, their logprob records when the config asks)."""
    config, verifiers = sequence.config, sequence.verifiers
    finished = False
    eos = sequence.eos
    for i, token in enumerate(new_tokens):
        if token in eos:
            new_tokens = new_tokens[: i + 1]
            finished = True
            break
    left = sequence.tokens_left
    if len(new_tokens) > left:
        new_tokens = new_tokens[:left]
    if sequence.constraint is not None:
        began = time.perf_counter()
        taken = sequence.constraint.advance(new_tokens)
        if taken < len(new_tokens):  # the walk went past the constraint's end: nothing may follow it
            if not sequence.constraint.finished():
                raise ConstraintError(f"the constraint refused committed token {new_tokens[taken]} (its mask allowed it)")
            new_tokens = new_tokens[:taken]
        finished = finished or sequence.constraint.finished()
        sequence.grammar_seconds += time.perf_counter() - began
    records = None
    if config.logprobs is not None:
        records = token_logprobs(verifiers.scored_rows(new_tokens, path), new_tokens, config.sampling, config.logprobs)
    length = verifiers.commit(new_tokens, path)
    sequence.noise.forget_before(length)
    finished = finished or sequence.tokens_left <= 0
    sequence.drafter.commit(length)
    return new_tokens, finished, records


# ---- a batch's draft lengths ---------------------------------------------------------------------


def batch_lengths(proposals: list[Proposal], reaches: list[list[float] | None], pass_seconds,
                  others: int = 0) -> list[int]:
    """How many of each proposal's drafts the batch verifies this cycle: the lengths that maximise
    the batch's expected emitted tokens per second, from ``pass_seconds(rows)`` (the measured cost
    of a pass of that many rows) and each proposal's chance of reaching each of its drafts (its
    policy's learned acceptance, ``reaches[i][j]``: P(drafts 0..j all accepted); None: keep it whole).
    ``others``: sequences of the pass with no drafts (a row and a token each).

    Greedy on marginal value: start every proposal at no draft (its one row), then repeatedly take
    the next draft of the proposal whose next draft adds the most expected tokens, while that raises
    the batch's expected tokens per second. A longer batch makes every row dearer, so drafts shrink
    as it grows; when a draft no longer pays, none is verified."""
    lengths = [len(p) if reach is None else 0 for p, reach in zip(proposals, reaches)]
    rows = len(proposals) + others + sum(lengths)
    expected = float(len(proposals) + others) + sum(len(p) for p, reach in zip(proposals, reaches) if reach is None)
    rate = expected / pass_seconds(rows)
    while True:
        best, gain = None, 0.0
        for index, reach in enumerate(reaches):
            if reach is not None and lengths[index] < len(reach) and reach[lengths[index]] > gain:
                best, gain = index, reach[lengths[index]]
        if best is None:
            return lengths
        candidate = (expected + gain) / pass_seconds(rows + 1)
        if candidate <= rate:
            return lengths
        lengths[best] += 1
        rows, expected, rate = rows + 1, expected + gain, candidate


def _reach(d: _Drafted) -> list[float] | None:
    """P(the first j + 1 drafts all accepted) for each draft of the chain ``d.proposal``, by the
    sequence's policy (None: a tree, or a policy that learns no acceptance — the proposal stays
    as drafted). Read from the drafter's whole proposal, whose trim ``d.proposal`` is (the policy
    scored it already: ``CostAware._block``; a prefix's reach is the whole one's prefix)."""
    policy, drafts = d.sequence.policy, len(d.proposal)
    if not isinstance(policy, CostAware) or not d.drafted.is_chain or drafts == 0:
        return None
    return policy.reach(d.drafted)[:drafts]


def _pass_seconds(drafted: list[_Drafted]) -> Callable[[int], float]:
    """The cost of a pass by rows: the first sequence's policy's measured table (one target, one
    machine; ``ForwardCosts.cost`` extends it linearly past its end); a nearly flat line where no
    policy measured one."""
    table = next((d.sequence.policy.pass_costs for d in drafted if d.sequence.policy.pass_costs is not None), None)
    return (lambda rows: 1.0 + 0.01 * rows) if table is None else table.cost


def _fit_rows(budgets: list[int], max_rows: int) -> list[int]:
    """Draft counts cut, largest first, until every sequence's rows (one + its drafts) fit ``max_rows``."""
    budgets = list(budgets)
    while len(budgets) + sum(budgets) > max_rows and any(budgets):
        largest = max(range(len(budgets)), key=lambda i: budgets[i])
        budgets[largest] -= 1
    return budgets


# ---- one generation --------------------------------------------------------------------------------


def decode(
    target: LoadedModel,
    method: DecodeMethod,
    prompt_ids: torch.Tensor,
    config: DecodeConfig,
    seed: int | torch.Generator | None = None,
    inspect: Callable[[Verifiers, Drafter], None] | None = None,
) -> Iterator[Step]:
    """Generate after ``prompt_ids`` [n] with ``method`` (a ``methods.Method``: it makes the
    generation's drafter, policy and rule), yielding a ``Step`` per cycle: the cycle over a batch
    of one.

    ``seed`` keys every random draw (``sampling.seed_of``: an integer; a ``torch.Generator``
    stands for the seed it was seeded with; None draws a fresh one). ``inspect(verifiers,
    drafter)`` is called after every commit (tests check the cache invariant with it).
    """
    yield from decode_sequence(target, open_sequence(target, method, prompt_ids, config, seed), inspect)


def decode_sequence(target: LoadedModel, sequence: Sequence, inspect: Callable[[Verifiers, Drafter], None] | None = None,
                    times: CycleTimes | None = None) -> Iterator[Step]:
    """The steps of an opened ``sequence`` (``open_sequence``), one cycle of its own each (their
    phases added to ``times`` when given)."""
    passes = pass_backend(target.model)
    inference = torch.inference_mode()  # entered once a cycle (the caller runs between steps), made once
    while not sequence.finished and sequence.tokens_left > 0:
        if torch.is_inference_mode_enabled():  # held by a caller that runs every step (``DecodeRun.finish``)
            steps, spent = cycle([sequence], passes)
        else:
            with inference:
                steps, spent = cycle([sequence], passes)
        if sequence.error is not None:
            raise sequence.error
        ((_, step),) = steps
        if times is not None:
            times.add(spent)
        if inspect is not None:
            inspect(sequence.verifiers, sequence.drafter)
        yield step


class DecodeRun:
    """One generation, iterated step by step, with the totals every caller reads: its
    ``GenerationStats`` (its sequence's own record, each cycle added as it ends) and the one place
    its wall clock is read.

    Iterating runs ``decode`` (same arguments) and yields its ``Step``s; meanwhile each cycle is
    added to ``stats``; ``token_ids`` reads the generated tokens from the generation's committed
    sequence. ``stats.wall_seconds`` runs from the first step asked for (the prefill is in it) to
    the latest step handed out (under ``finish``: to its end), or to the end of the generation once it is exhausted, less the
    one-time cost measurements made meanwhile (``costs.measuring_seconds``: a first run's would read
    a third of its true speed) (docs/metrics.md §Generation statistics). ``finish()`` runs it to the end; ``close()`` stops it
    early. ``sequence``: the generation's ``Sequence`` once its first step was asked for; ``times``:
    where its cycles' time went (``CycleTimes``)."""

    def __init__(self, target: LoadedModel, method: DecodeMethod, prompt_ids: torch.Tensor, config: DecodeConfig,
                 seed: int | torch.Generator | None = None, inspect: Callable[[Verifiers, Drafter], None] | None = None):
        self._target, self._method, self._prompt_ids, self._config, self._seed = target, method, prompt_ids, config, seed
        self._inspect = inspect
        self._threads = threads_for(target.model)  # torch's small operators on one thread, on the engine
        self._steps: Iterator[Step] | None = None
        self.sequence: Sequence | None = None
        self.stats = GenerationStats()
        self.times = CycleTimes()
        self.committed: CommittedTokens | None = None  # the generation's, from its first step
        self._started: float | None = None
        self._holding = False  # inside ``held``: the thread arrangement is entered already

    @property
    def token_ids(self) -> list[int]:
        """The tokens generated so far."""
        return [] if self.committed is None else self.committed.generated()

    @property
    def finish_reason(self) -> str | None:
        """``Sequence.finish_reason``: "stop", "length", or None before the end."""
        return None if self.sequence is None else self.sequence.finish_reason()

    def __iter__(self) -> DecodeRun:
        return self

    def __next__(self) -> Step:
        if self._started is None:
            self._started, self._measuring_before = time.perf_counter(), measuring_seconds()
        try:
            if self._holding:
                step = self._next_step()
            else:
                with self._threads:
                    step = self._next_step()
        finally:
            self._read_clock()
        self.committed = step.committed
        return step

    def _next_step(self) -> Step:
        if self._steps is None:
            self.sequence = open_sequence(self._target, self._method, self._prompt_ids, self._config, self._seed)
            # One record of the totals: each cycle adds itself to its sequence's (``_step``); the
            # clock is the run's (from the first step asked for, less the measurements)
            self.sequence.stats, self.sequence.timed = self.stats, False
            self._steps = decode_sequence(self._target, self.sequence, self._inspect, self.times)
        return next(self._steps)

    @contextmanager
    def held(self) -> Iterator[DecodeRun]:
        """A block in which the steps asked for run under one entry of the thread arrangement and of
        torch's inference mode (``finish``'s), not one a step: for a caller whose code between the
        steps uses no torch (a detokenizer, a write to a terminal), since inside the block torch makes
        inference tensors and, on the pass engine, runs its operators on one thread. Leaving and entering
        both at every step cost a streamed generation 30–50 µs a cycle on a Zen 4
        (``benchmarks/loop_time.py --entry generate``). The block is left on the thread that entered it,
        and blocks of several runs nest (each restores what it found: two left in the order they were
        entered would leave the first's settings behind). Not to be held across a ``yield`` to code that
        uses torch."""
        if self._holding:
            yield self
            return
        with self._threads, torch.inference_mode():
            self._holding = True
            try:
                yield self
            finally:
                self._holding = False

    def _read_clock(self) -> None:
        """The run's wall clock, not its sequence's: from the first step asked for, less measurements."""
        self.stats.wall_seconds = time.perf_counter() - self._started - (measuring_seconds() - self._measuring_before)

    def finish(self) -> DecodeRun:
        """Run the generation to its end; returns this run (``token_ids`` and ``stats`` complete).
        After its first step (the prompt's passes, as a stream runs them) every step runs under one
        entry of the thread arrangement and of torch's inference mode, not one a step as a stream's
        steps must (its caller runs between them): leaving and entering them again cost ``ar`` 40 µs
        a cycle on a Zen 4, whose caches each pass empties (``benchmarks/loop_time.py``: 0.232 →
        0.192 ms). An ``inspect`` callback then runs inside both too. The steps are drawn from the
        generator itself, not through ``__next__`` (its clock and bookkeeping, ~6 µs a step in py-spy
        samples on a Zen 4): ``committed`` is the generation's one record, set at the first step, and
        the clock is read once, at the end."""
        if self._steps is None and next(self, None) is None:
            return self
        try:
            with self._threads, torch.inference_mode():
                for _ in self._steps:
                    pass
        finally:
            self._read_clock()
        return self

    def close(self) -> None:
        """Stop the generation (a suspended one holds the target's cache until closed)."""
        if self._steps is not None:
            self._steps.close()


def check_prompt(prompt_ids, max_positions: int | None, max_new_tokens: int, vocab_size: int | None = None) -> torch.Tensor:
    """Validate and flatten a prompt to [n] int64 (batch size 1 only)."""
    try:
        prompt_ids = torch.as_tensor(prompt_ids)
    except (TypeError, ValueError, RuntimeError) as error:
        raise PromptError(f"prompt ids must be a list or tensor of integers: {error}") from None
    if prompt_ids.is_floating_point() or prompt_ids.is_complex() or prompt_ids.dtype == torch.bool:
        raise PromptError(f"prompt ids must be integers, got {prompt_ids.dtype}")
    prompt_ids = prompt_ids.long()
    if prompt_ids.dim() == 2:
        if prompt_ids.shape[0] != 1:
            raise PromptError(
                f"batch size {prompt_ids.shape[0]} is not supported: speculative decoding here runs one sequence at a time"
            )
        prompt_ids = prompt_ids[0]
    if prompt_ids.dim() != 1:
        raise PromptError(f"prompt ids must be [n] or [1, n], got shape {tuple(prompt_ids.shape)}")
    if prompt_ids.numel() == 0:
        raise PromptError("the prompt is empty: give at least one token")
    if vocab_size is not None and (int(prompt_ids.min()) < 0 or int(prompt_ids.max()) >= vocab_size):
        bad = prompt_ids[(prompt_ids < 0) | (prompt_ids >= vocab_size)][0]
        raise PromptError(f"token id {int(bad)} is outside the model's vocabulary (0 .. {vocab_size - 1})")
    if max_positions is not None and prompt_ids.numel() + max_new_tokens > max_positions:
        raise PromptError(
            f"prompt of {prompt_ids.numel()} tokens + max_new_tokens {max_new_tokens} exceeds the model's context "
            f"of {max_positions} positions"
        )
    return prompt_ids



def score_prompt(target: LoadedModel, prompt_ids: torch.Tensor, config: DecodeConfig) -> list[TokenLogprob]:
    """The prompt's logprob records (``echo`` with nothing to generate): one prefill, no decoding."""
    if is_encoder_decoder(target.model):
        raise TierspecError("an encoder-decoder model reads the prompt with its encoder: there are no prompt "
                            "log-probabilities to report (echo)")
    max_positions = getattr(target.model.config, "max_position_embeddings", None)
    prompt_ids = check_prompt(prompt_ids, max_positions, 0, target.vocab_size)
    config.modifiers.check_vocabulary(target.vocab_size)
    verifiers = Verifiers(target, len(prompt_ids) + 1, modifiers=config.modifiers)
    with torch.inference_mode():
        rows = verifiers.prefill(prompt_ids, score=True)
        return prompt_records(prompt_ids, rows, config)
