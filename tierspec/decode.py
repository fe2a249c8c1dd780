"""The one decode loop (docs/algorithms.md §The decode loop). Every method is a drafter, a
draft-length policy and a verification rule passed in; the loop owns the target's cache and every
statistic.

    prefill(prompt)                                 # the target's cache (and the drafter's)
    while not done:
        proposal = drafter.propose(ctx, budget)     # tokens [k], draft_probs [k, V] or None
        proposal = proposal[: policy.trim(...)]     # the draft-length policy decides k
        verdict  = rule.verify(verifiers, proposal) # runs whichever tiers the rule needs
        ctx      = commit(ctx, verdict)             # accepted prefix + 1 correction/bonus token
        rollback every cache to the committed length
        policy.observe(per-position acceptance)
        yield the new tokens and the cycle's statistics

Randomness: one ``sampling.Noise`` per generation, keyed by (seed, position, purpose); each
cycle hands its block's view to the drafter and the rule. Nothing else a cycle decides reads the
clock or carries over from another generation (the policies start afresh), so a seed fixes the
tokens (README: "Same seed, same text").

Streaming is iterating over ``decode``; ``tierspec.api`` builds ``generate`` and ``stream`` on it.
Inference mode is entered for each cycle's computation only, never across a ``yield``, so a
suspended generation does not leak it into the caller's code.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .drafters.base import Drafter, Proposal, TargetDraftView, TargetFeatures
from .errors import TierspecError
from .cached_model import CachedModel, PassResult
from .models import LoadedModel
from .policies import CycleOutcome, DraftPolicy
from .rules.base import VerificationRule
from .sampling import Noise, SamplingConfig


@dataclass(frozen=True)
class DecodeConfig:
    """Run-time settings of one generation (separate from statistics and model state)."""

    max_new_tokens: int = 128
    sampling: SamplingConfig = SamplingConfig()
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise PromptError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")


@dataclass
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
        self.cycles += 1
        self.decided_by.update(cycle.deciders)
        # Positions 1..evaluated were evaluated given acceptance so far; the first `accepted` passed.
        while len(self.position_drafted) < cycle.evaluated:
            self.position_drafted.append(0)
            self.position_accepted.append(0)
        for i in range(cycle.evaluated):
            self.position_drafted[i] += 1
            self.position_accepted[i] += int(i < cycle.accepted)
        while len(self.accepted_lengths) <= cycle.accepted:
            self.accepted_lengths.append(0)
        self.accepted_lengths[cycle.accepted] += 1
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
            "wall_seconds": round(self.wall_seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "accepted_per_cycle": round(self.accepted_per_cycle, 4),
            **({"tree": self.tree_summary()} if self.tree_cycles else {}),
        }


class Verifiers:
    """The verifier tiers of one generation: the target's cache, owned by the loop.

    ``context`` is the committed sequence. The full target runs on ``runner`` (a CachedModel);
    a rule with a slim verifier (VIA-SD) gets it as the same model and cache under
    ``slim_mask`` (no second model in memory).

    Cache bookkeeping: every layer holds full-model KV for the first ``full_length`` positions;
    the kept layers of the slim mask may hold slim KV beyond that, up to ``runner.length``, for
    committed tokens that only the slim verifier has processed (the full target lags,
    docs/algorithms.md §VIA-SD). A full pass first drops that slim KV and re-processes those tokens in one go.

    With ``record_features`` every pass keeps the LM head's inputs f_t of the positions it ran,
    and ``take_features`` hands those of newly committed positions to the drafter (a draft
    head reads them; no extra pass).
    """

    def __init__(self, target: LoadedModel, slim_mask=None, forward_costs=None, record_features: bool = False,
                 feature_layers: tuple[int, ...] = (), slim_vocabulary=None):
        """``forward_costs`` (a ``costs.ForwardCosts``): pad each pass to the cheapest measured
        size at least as long (extra rows repeat the last token; their outputs are dropped and
        their KV rolled back with the rest of the uncommitted block). ``slim_vocabulary`` (a
        ``cached_model.SlimVocabulary``): the slim tier scores only those tokens."""
        self.runner = CachedModel(target.model)
        self.slim_mask = slim_mask
        self.slim_vocabulary = slim_vocabulary
        self.forward_costs = forward_costs
        self.record_features = record_features
        self.feature_layers = tuple(feature_layers)  # decoder layers recorded beside f (a fused draft head)
        self.hidden_size = int(target.identity.hidden_size)
        self.context = torch.empty(0, dtype=torch.long)
        self.vocab_size = target.vocab_size
        self.full_length = 0
        self.target_calls = 0
        self.slim_calls = 0
        self._features: torch.Tensor | None = None  # [capacity, H] by position
        self._approximate: set[int] = set()  # positions whose features came from a slim pass
        self._handed = 0  # features of positions < _handed went to the drafter
        self._tree_pass = None  # (start, pending tokens, their and the nodes' features) of a tree pass awaiting its path

    # -- passes ------------------------------------------------------------------------------
    def prefill(self, prompt_ids: torch.Tensor) -> TargetFeatures | None:
        """The target processes all but the last prompt token, which is fed with the first
        draft (so every verification pass is "pending committed tokens + draft"). Returns the
        features of the processed positions when recording."""
        if len(prompt_ids) > 1:
            result = self.runner.forward(prompt_ids[:-1], logits_for=1, with_hidden=self.record_features,
                                         hidden_layers=self.feature_layers if self.record_features else ())
            if self.record_features:
                self._store(0, result.hidden, approximate=False)
        self.full_length = self.runner.length
        if not self.record_features:
            return None
        self._handed = self.full_length
        return TargetFeatures(0, self._slice(0, self.full_length))

    @property
    def target_lag(self) -> int:
        """Committed tokens (before the pending last one) the full target has not processed."""
        return len(self.context) - 1 - self.full_length

    def target_logits(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        """``target_pass(draft_tokens).logits``: what most rules need."""
        return self.target_pass(draft_tokens).logits

    def target_pass(self, draft_tokens: torch.Tensor, with_hidden: bool = False) -> PassResult:
        """One full-target pass over the pending committed tokens and ``draft_tokens`` [k]:
        logits [k+1, V] (row i scores draft token i, row k gives the bonus token) and, with
        ``with_hidden``, the final hidden states [k+1, H] of the same rows (row i ≥ 1 is the
        state at draft token i's own position: what a judge head reads).
        """
        if self.runner.length > self.full_length:
            self.runner.rollback(self.full_length)  # drop slim-only KV; recomputed in this pass
        start = self.full_length
        pending = self.context[start:]
        k = int(draft_tokens.shape[0])
        tokens, pad = self._padded(torch.cat([pending, draft_tokens]))
        capture = with_hidden or self.record_features
        result = self.runner.forward(tokens, logits_for=k + 1 + pad, with_hidden=capture,
                                     hidden_layers=self.feature_layers if self.record_features else ())
        self.target_calls += 1
        self.full_length = self.runner.length
        real = len(tokens) - pad
        if self.record_features:
            self._store(start, result.hidden[:real], approximate=False)
        hidden = result.hidden[real - (k + 1) : real, : self.hidden_size] if with_hidden else None
        return PassResult(result.logits[: k + 1], hidden)

    def target_tree_logits(self, tree) -> torch.Tensor:
        """Full-target logits [1 + m, V] of a token tree (``tree.TokenTree``, docs/algorithms.md §Token trees) in one
        pass: row 0 after the last committed token (the root), row 1 + i after node i. The nodes'
        KV stays in the cache after the committed tokens until ``keep_tree_path`` keeps the
        accepted path's (the loop calls it after the verdict)."""
        from .tree import tree_pass

        if self.runner.length > self.full_length:
            self.runner.rollback(self.full_length)
        start = self.full_length
        pending = self.context[start:]
        m = len(tree)
        unpadded = len(pending) + m
        pad = self.forward_costs.padded_size(unpadded) - unpadded if self.forward_costs is not None and unpadded > 1 else 0
        layout = tree_pass(pending, tree, pad)
        result = self.runner.forward(layout.tokens, logits_for=m + 1 + pad, with_hidden=self.record_features,
                                     hidden_layers=self.feature_layers if self.record_features else (),
                                     offsets=layout.offsets, attends=layout.attends)
        self.target_calls += 1
        self._tree_pass = (start, layout.pending, result.hidden[: layout.pending + m] if self.record_features else None)
        return result.logits[: m + 1]

    def keep_tree_path(self, path: list[int]) -> None:
        """After a tree pass: keep the KV (and the features) of the accepted ``path``'s nodes as
        the positions after the committed tokens, drop the other nodes' (``CachedModel.compact``)."""
        start, pending, hidden = self._tree_pass
        committed = start + pending
        self.runner.compact(committed, committed + torch.tensor(path, dtype=torch.long))
        self.full_length = self.runner.length
        if hidden is not None:
            self._store(start, hidden[:pending], approximate=False)
            if path:
                self._store(committed, hidden[pending + torch.tensor(path)], approximate=False)
        self._tree_pass = None

    def slim_logits(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        """Slim-verifier logits [k+1, V] (the target under ``slim_mask``), same layout."""
        if self.slim_mask is None:
            raise ValueError("this generation has no slim verifier (no routing mask was given)")
        start = self.runner.length
        pending = self.context[start:]
        k = int(draft_tokens.shape[0])
        tokens, pad = self._padded(torch.cat([pending, draft_tokens]))
        result = self.runner.forward(tokens, logits_for=k + 1 + pad, mask=self.slim_mask, with_hidden=self.record_features,
                                     hidden_layers=self.feature_layers if self.record_features else (),
                                     vocabulary=self.slim_vocabulary)
        self.slim_calls += 1
        if self.record_features:
            self._store(start, result.hidden[: len(tokens) - pad], approximate=True)
        return result.logits[: k + 1]

    def _padded(self, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
        if self.forward_costs is None or len(tokens) < 2:
            return tokens, 0
        pad = self.forward_costs.padded_size(len(tokens)) - len(tokens)
        return (torch.cat([tokens, tokens[-1:].expand(pad)]), pad) if pad else (tokens, 0)

    # -- rollback ----------------------------------------------------------------------------
    def rollback(self, committed_length: int) -> None:
        """Trim the cache to the committed tokens it has processed (the last committed token is
        fed with the next draft). Invariant afterwards: full_length ≤ runner.length ≤ committed − 1,
        and every layer holds KV for exactly the positions the model has processed."""
        keep = committed_length - 1
        self.runner.rollback(min(self.runner.length, keep))
        self.full_length = min(self.full_length, keep)

    # -- features for a draft head -------------------------------------------------------------
    def _store(self, start: int, hidden: torch.Tensor, approximate: bool) -> None:
        end = start + int(hidden.shape[0])
        if self._features is None or self._features.shape[0] < end:
            capacity = max(256, end, 0 if self._features is None else 2 * self._features.shape[0])
            grown = hidden.new_empty(capacity, hidden.shape[-1])
            if self._features is not None:
                grown[: self._features.shape[0]] = self._features
            self._features = grown
        self._features[start:end] = hidden
        positions = range(start, end)
        if approximate:
            self._approximate.update(positions)
        else:
            self._approximate.difference_update(positions)

    def _slice(self, start: int, end: int) -> torch.Tensor:
        if self._features is None:  # nothing processed yet (a one-token prompt)
            width = self.hidden_size * (1 + len(self.feature_layers))
            return torch.empty(0, width)
        return self._features[start:end]

    def take_features(self) -> TargetFeatures | None:
        """Features of committed positions processed since the last call (None when none)."""
        if not self.record_features:
            return None
        end = self.runner.length  # committed positions processed by some pass
        start = min(self._handed, end)
        self._handed = end
        if end <= start:
            return None
        approximate = any(p in self._approximate for p in range(start, end))
        return TargetFeatures(start, self._slice(start, end).clone(), approximate)

    def draft_view(self) -> TargetDraftView:
        return _DraftView(self)


class _DraftView(TargetDraftView):
    """A self-drafter's access to the target cache: masked passes on top of full-model KV."""

    def __init__(self, verifiers: Verifiers):
        self.verifiers = verifiers

    @property
    def length(self) -> int:
        return self.verifiers.full_length

    def forward(self, tokens: torch.Tensor, mask) -> torch.Tensor:
        verifiers = self.verifiers
        if verifiers.runner.length > verifiers.full_length and not getattr(self, "_drafting", False):
            verifiers.runner.rollback(verifiers.full_length)  # draft on full-model KV only
        self._drafting = True
        return verifiers.runner.forward(tokens, logits_for=1, mask=mask).logits[-1]

    def discard(self) -> None:
        self._drafting = False
        self.verifiers.runner.rollback(min(self.verifiers.runner.length, self.verifiers.full_length))

    def replay_window(self, start: int, tokens: torch.Tensor, mask) -> torch.Tensor:
        verifiers = self.verifiers
        if verifiers.runner.length > verifiers.full_length:
            verifiers.runner.rollback(verifiers.full_length)
        return verifiers.runner.replay(start, tokens, mask)


class PromptError(TierspecError):
    """The prompt cannot be decoded (empty, batched, ids outside the vocabulary, or longer than
    the model's context)."""


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


@dataclass
class Step:
    """What the loop yields after each commit."""

    new_tokens: list[int]
    cycle: CycleStats
    finished: bool


def decode(
    target: LoadedModel,
    method,
    prompt_ids: torch.Tensor,
    config: DecodeConfig,
    seed: int | torch.Generator | None = None,
    inspect: Callable[[Verifiers, Drafter], None] | None = None,
) -> Iterator[Step]:
    """Generate after ``prompt_ids`` [n] with ``method`` (a ``methods.Method``: drafter, policy,
    rule, and the verifier settings it needs), yielding a ``Step`` per cycle.

    ``seed`` keys every random draw (``sampling.seed_of``: an integer; a ``torch.Generator``
    stands for the seed it was seeded with; None draws a fresh one). ``inspect(verifiers,
    drafter)`` is called after every commit (tests check the cache invariant with it).
    """
    drafter: Drafter = method.drafter
    rule: VerificationRule = method.rule
    policy: DraftPolicy = method.policy
    check_tree_rule(drafter, rule)
    max_positions = getattr(target.model.config, "max_position_embeddings", None)
    prompt_ids = check_prompt(prompt_ids, max_positions, config.max_new_tokens, target.vocab_size)
    verifiers = Verifiers(target, slim_mask=method.slim_mask, forward_costs=method.forward_costs,
                          record_features=drafter.needs_target_features,
                          feature_layers=getattr(drafter, "feature_layers", ()),
                          slim_vocabulary=getattr(method, "slim_vocabulary", None))
    eos = set(config.eos_token_ids)
    # The KV buffer for everything this generation can hold (the last verification pass may run a
    # draft and its padding past the budget); a longer pass still grows it.
    verifiers.runner.reserve(len(prompt_ids) + config.max_new_tokens + 64)
    noise = Noise(seed, target.vocab_size)

    with torch.inference_mode():
        features = verifiers.prefill(prompt_ids)
        drafter.start(prompt_ids, features, verifiers.draft_view() if drafter.uses_target_cache else None)
        policy.start()
    context = prompt_ids.clone()
    verifiers.context = context
    emitted_total = 0
    cycle = _tree_cycle if getattr(drafter, "proposes_trees", False) else _cycle
    while emitted_total < config.max_new_tokens:
        with torch.inference_mode():
            step, context = cycle(verifiers, drafter, rule, policy, context, config, emitted_total, eos, noise)
        emitted_total += len(step.new_tokens)
        if inspect is not None:
            inspect(verifiers, drafter)
        yield step
        if step.finished:
            return


def check_tree_rule(drafter: Drafter, rule) -> None:
    """Refuse a tree drafter with a rule that verifies chains only. Only the exact rule has a tree
    version (``rules.tree.TreeExactRule``: greedy, coupled, multi-draft residual; docs/algorithms.md §Token trees). The
    lossy rules (lossy, cascade, judge, VIA and via-judge) are defined over one chain of drafts: the
    lossy and cascade tests compare a draft with the target's distribution at its position, the
    judge head scores the drafts of a chain one by one, and VIA's slim verifier runs ahead of a
    lagging full target on one committed chain; none is built over a tree yet, so trees stay
    lossless-only and the lossy rules keep chain drafters."""
    if getattr(drafter, "proposes_trees", False) and not getattr(rule, "accepts_trees", False):
        raise TierspecError(f"the rule '{rule.name}' verifies chains only: a token tree needs the exact tree rule "
                            "(rules.tree.TreeExactRule, the methods eagle-tree and hybrid-tree, lossless). "
                            f"For '{rule.name}', use a chain drafter instead (methods eagle, hybrid, pld).")


def _cycle(verifiers: Verifiers, drafter: Drafter, rule: VerificationRule, policy: DraftPolicy, context: torch.Tensor,
           config: DecodeConfig, emitted_total: int, eos: set[int], noise: Noise) -> tuple[Step, torch.Tensor]:
    started = time.perf_counter()
    target_calls, slim_calls = verifiers.target_calls, verifiers.slim_calls
    remaining = config.max_new_tokens - emitted_total
    # Never draft past the budget: the cycle emits at most k + 1 tokens.
    budget = max(0, min(policy.max_draft, remaining - 1))
    # Draft token i and the token after the drafts sit at position len(context) + i.
    block = None if config.sampling.greedy else noise.block(len(context))
    drafted: Proposal = drafter.propose(context, budget, config.sampling, block, policy.keep_drafting)
    proposal = drafted.prefix(min(policy.trim(drafted), budget))
    drafted_at = time.perf_counter()
    verdict = rule.verify(verifiers, proposal, config.sampling, block)

    # Commit: accepted prefix + the correction/bonus token, cut at EOS and the budget.
    emitted = proposal.tokens[: verdict.accepted].tolist() + [verdict.next_token]
    new_tokens, context, finished = _commit(emitted, verifiers, drafter, context, config, emitted_total, eos, noise)

    k = len(proposal)
    ended = time.perf_counter()
    cut_key = cut_accepted = None
    if len(drafted) > k and verdict.accepted == k:  # the bonus token tells whether the cut one would have passed
        cut_key = policy.keys(drafted, k + 1)[k]
        cut_accepted = verdict.next_token == int(drafted.tokens[k])
    policy.observe(CycleOutcome(policy.keys(proposal, k), verdict.accepted, k, proposal.source, cut_key, cut_accepted))
    cycle = CycleStats(
        drafted=k,
        evaluated=verdict.accepted + (1 if verdict.accepted < k else 0),
        accepted=verdict.accepted,
        emitted=len(new_tokens),
        target_calls=verifiers.target_calls - target_calls,
        slim_calls=verifiers.slim_calls - slim_calls,
        drafter_calls=proposal.drafter_calls,
        seconds=ended - started,
        draft_seconds=drafted_at - started,
        deciders=verdict.deciders[: len(new_tokens)],
    )
    return Step(new_tokens, cycle, finished), context


def _commit(new_tokens: list[int], verifiers: Verifiers, drafter: Drafter, context: torch.Tensor,
            config: DecodeConfig, emitted_total: int, eos: set[int], noise: Noise) -> tuple[list[int], torch.Tensor, bool]:
    """Commit a cycle's tokens (accepted drafts + the correction/bonus token), cut after an EOS
    and at the token budget; then roll every cache back to exactly the committed tokens it has
    processed. Returns (the tokens committed, the new context, whether generation is finished)."""
    finished = False
    for i, token in enumerate(new_tokens):
        if token in eos:
            new_tokens = new_tokens[: i + 1]
            finished = True
            break
    new_tokens = new_tokens[: config.max_new_tokens - emitted_total]
    context = torch.cat([context, torch.tensor(new_tokens, dtype=torch.long)])
    verifiers.context = context
    noise.forget_before(len(context))
    finished = finished or emitted_total + len(new_tokens) >= config.max_new_tokens
    verifiers.rollback(len(context))
    drafter.commit(len(context), verifiers.take_features())
    return new_tokens, context, finished


def _tree_cycle(verifiers: Verifiers, drafter: Drafter, rule, policy: DraftPolicy, context: torch.Tensor,
                config: DecodeConfig, emitted_total: int, eos: set[int], noise: Noise) -> tuple[Step, torch.Tensor]:
    """``_cycle`` for a tree drafter (docs/algorithms.md §Token trees): the drafter proposes a token tree no deeper than
    the tokens left allow, the rule walks it after one target pass, the loop keeps the accepted
    path's KV and commits path + next token. ``policy.observe_tree`` sees every verdict."""
    started = time.perf_counter()
    target_calls = verifiers.target_calls
    remaining = config.max_new_tokens - emitted_total
    block = None if config.sampling.greedy else noise.block(len(context))
    proposal = drafter.propose_tree(context, max(0, remaining - 1), config.sampling, block)
    drafted_at = time.perf_counter()
    tree = proposal.tree
    verdict = rule.verify_tree(verifiers, tree, config.sampling, block)
    verifiers.keep_tree_path(verdict.path)

    emitted = tree.tokens[verdict.path].tolist() + [verdict.next_token]
    new_tokens, context, finished = _commit(emitted, verifiers, drafter, context, config, emitted_total, eos, noise)
    if hasattr(policy, "observe_tree"):
        policy.observe_tree(proposal, verdict)
    ended = time.perf_counter()
    # A node is evaluated when its parent was reached: the accepted path's nodes and the children
    # tried below its end (at most one counts as "the rejection" of the cycle, as for a chain).
    stopped_early = bool(tree.children(verdict.path[-1] if verdict.path else -1))
    cycle = CycleStats(
        drafted=len(tree),
        evaluated=verdict.accepted + int(stopped_early),
        accepted=verdict.accepted,
        emitted=len(new_tokens),
        target_calls=verifiers.target_calls - target_calls,
        slim_calls=0,
        drafter_calls=proposal.drafter_calls,
        seconds=ended - started,
        draft_seconds=drafted_at - started,
        deciders=verdict.deciders[: len(new_tokens)],
        tree_depth=tree.depth,
    )
    return Step(new_tokens, cycle, finished), context
