"""The one decode loop (docs/algorithms.md §The decode loop). Every method is a drafter, a
draft-length policy and a verification rule passed in. Who owns what: ``Verifiers`` the target's
cache, its passes and padding, the committed sequence and the feature log; the drafter its own
state; ``DecodeRun`` a generation's ``GenerationStats`` and wall clock.

    verifiers.prefill(prompt)                       # the target's cache (and the drafter's)
    while not done:
        proposal = drafter.propose(ctx, budget)     # tokens [k], draft_probs [k, V] or None
        proposal = proposal[: policy.trim(...)]     # the draft-length policy decides k
        verdict  = rule.verify(verifiers, proposal) # runs whichever tiers the rule needs
        ctx = verifiers.commit(tokens)              # accepted prefix + 1 correction/bonus token;
                                                    # every cache rolled back to the committed length
        drafter.commit(len(ctx))
        policy.observe(per-position acceptance)
        yield the new tokens and the cycle's statistics

Randomness: one ``sampling.Noise`` per generation, keyed by (seed, position, purpose); each
cycle hands its block's view to the drafter and the rule. Nothing else a cycle decides reads the
clock or carries over from another generation (the policies start afresh), so a seed fixes the
tokens (README: "Same seed, same text").

Streaming is iterating over ``decode``; ``DecodeRun`` adds up the statistics as it iterates, and
``tierspec.api`` (``generate``, ``stream``), the bench and the benchmarks run generations through it.
Inference mode is entered for each cycle's computation only, never across a ``yield``, so a
suspended generation does not leak it into the caller's code.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .cached_model import CachedModel, PassResult
from .drafters.base import Drafter, FeatureLog, Proposal, TargetDraftView
from .errors import PromptError, TierspecError
from .modifiers import LogitModifiers, chain_counts, modified_logits, token_counts, tree_counts
from .models import LoadedModel
from .policies import CycleOutcome, DraftPolicy
from .rules.base import VerificationRule
from .sampling import Noise, SamplingConfig, reported_logprobs
from .seq2seq import decoder_start, is_encoder_decoder, runner_for


#: Most alternatives a token's log-probability record lists (OpenAI's ``top_logprobs`` limit).
MAX_TOP_LOGPROBS = 20
#: Prompt tokens per pass of a prefill that returns its logits (``echo``): 512 rows of the default
#: model's 49,152-token vocabulary are 100 MB of float32.
SCORED_PREFILL_CHUNK = 512


@dataclass(frozen=True)
class DecodeConfig:
    """Run-time settings of one generation (separate from statistics and model state).

    ``modifiers``: penalties and logit bias on the target's logits (``tierspec.modifiers``).
    ``logprobs``: None, or record each emitted token's log-probability under the target with the
    ``logprobs`` most likely alternatives (0 .. MAX_TOP_LOGPROBS), read from the verification pass
    that scored the token (``sampling.reported_logprobs``). ``score_prompt``: also record the
    prompt tokens' (from the prefill; needs ``logprobs``)."""

    max_new_tokens: int = 128
    sampling: SamplingConfig = SamplingConfig()
    eos_token_ids: tuple[int, ...] = ()
    modifiers: LogitModifiers = LogitModifiers()
    logprobs: int | None = None
    score_prompt: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise PromptError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise PromptError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] or None, got {self.logprobs!r}")
        if self.score_prompt and self.logprobs is None:
            raise PromptError("score_prompt records log-probabilities: give logprobs too")


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
    pass_seconds: float = 0.0  # of which verifier passes (full target and slim), the forward calls alone
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
            "pass_seconds": round(self.pass_seconds, 4),
            "wall_seconds": round(self.wall_seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "accepted_per_cycle": round(self.accepted_per_cycle, 4),
            **({"tree": self.tree_summary()} if self.tree_cycles else {}),
        }


class Verifiers:
    """The verifier tiers of one generation and everything they own: the target's cache and
    passes, the padding of each pass, the committed sequence, rollback, and the feature log.

    ``context`` is the committed sequence; only ``prefill`` and ``commit`` change it (the loop
    calls ``commit`` with each cycle's tokens). The full target runs on ``runner`` (a
    CachedModel); a rule with a slim verifier (VIA-SD) gets it as the same model and cache under
    ``slim_mask`` (no second model in memory).

    Cache bookkeeping: every layer holds full-model KV for the first ``full_length`` positions;
    the kept layers of the slim mask may hold slim KV beyond that, up to ``runner.length``, for
    committed tokens that only the slim verifier has processed (the full target lags,
    docs/algorithms.md §VIA-SD). A full pass first drops that slim KV and re-processes those
    tokens in one go.

    With ``record_features`` every pass writes the LM head's inputs f_t of the positions it ran
    into ``features`` (a ``FeatureLog``, the one copy a draft head reads; no extra pass).
    """

    def __init__(self, target: LoadedModel, positions: int, slim_mask=None, forward_costs=None,
                 record_features: bool = False, feature_layers: tuple[int, ...] = (), slim_vocabulary=None,
                 source=None, modifiers: LogitModifiers = LogitModifiers()):
        """``positions``: every position this generation's passes can reach (the prompt, the
        token budget and a last pass's draft and padding); the KV buffer and the feature log
        are allocated for them once. ``forward_costs`` (a ``costs.ForwardCosts``): pad each pass
        to the cheapest measured size at least as long (extra rows repeat the last token; their
        outputs are dropped and their KV rolled back with the rest of the uncommitted block).
        ``slim_vocabulary`` (a ``cached_model.SlimVocabulary``): the slim tier scores only
        those tokens. ``source`` [S]: an encoder–decoder target's encoder input (``seq2seq``);
        the cache is then its decoder's. ``modifiers``: applied to every row of every pass the
        rules read (target and slim), each row with the counts of the generated text before it."""
        self.runner = runner_for(target.model, source)
        self.runner.reserve(positions)  # a longer pass than foreseen still grows the KV buffer
        self.slim_mask = slim_mask
        self.slim_vocabulary = slim_vocabulary
        self.forward_costs = forward_costs
        self.feature_layers = tuple(feature_layers)  # decoder layers recorded beside f (a fused draft head)
        self.hidden_size = int(target.identity.hidden_size)
        self.features = FeatureLog(positions, self.hidden_size * (1 + len(self.feature_layers))) if record_features else None
        self._context = torch.empty(0, dtype=torch.long)
        self.full_length = 0
        self.target_calls = 0
        self.slim_calls = 0
        self.pass_seconds = 0.0  # time in verifier passes (``_forward``): where a cycle's time goes
        self._tree_pass = None  # (start, pending tokens, their and the nodes' features) of a tree pass awaiting its path
        self.modifiers = modifiers if modifiers.active else None
        self._generated_from = 0  # the first position that counts for the penalties (after the prompt)
        self._generated_counts: torch.Tensor | None = None  # c [V] of the committed generated tokens
        self._bias: torch.Tensor | None = None  # b [V]
        # The target's logits rows of the last full pass (modifiers applied) and the position the
        # first of them predicts: what the logprobs of the tokens committed after it are read from.
        self._scored: tuple[int, torch.Tensor] | None = None

    @property
    def context(self) -> torch.Tensor:
        """The committed sequence [n] (read-only: ``commit`` extends it)."""
        return self._context

    @property
    def target_lag(self) -> int:
        """Committed tokens (before the pending last one) the full target has not processed."""
        return len(self._context) - 1 - self.full_length

    # -- passes ------------------------------------------------------------------------------
    def _forward(self, tokens: torch.Tensor, logits_for: int, with_hidden: bool = False, **kwargs) -> PassResult:
        """A pass on the target's cache, with the hidden states the feature log needs (and
        those asked for)."""
        recording = self.features is not None
        started = time.perf_counter()
        result = self.runner.forward(tokens, logits_for=logits_for, with_hidden=with_hidden or recording,
                                     hidden_layers=self.feature_layers if recording else (), **kwargs)
        self.pass_seconds += time.perf_counter() - started
        return result

    def _record(self, start: int, hidden: torch.Tensor | None) -> None:
        if self.features is not None:
            self.features.write(start, hidden)

    def _modified(self, logits: torch.Tensor, counts: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``logits`` [r, V] under the modifiers; ``counts(prior [V])`` gives each row's counts [r, V]."""
        if self.modifiers is None:
            return logits
        vocab_size = logits.shape[-1]
        if self._generated_counts is None or self._generated_counts.shape[0] != vocab_size:
            self._generated_counts = token_counts(self._context[self._generated_from:], vocab_size)
            self._bias = self.modifiers.bias_vector(vocab_size) if self.modifiers.logit_bias else None
        return modified_logits(logits, counts(self._generated_counts), self.modifiers, self._bias)

    def prefill(self, prompt_ids: torch.Tensor, score: bool = False) -> torch.Tensor | None:
        """Commit the prompt. The target processes all but its last token, which is fed with the
        first draft (so every verification pass is "pending committed tokens + draft").

        ``score``: return the logits [n−1, V] (modifiers applied) of the same pass's rows, row j
        before prompt token j+1 (the first token has none): what ``echo`` reports. Long prompts
        run in chunks of ``SCORED_PREFILL_CHUNK`` tokens then, so the rows' memory stays bounded."""
        self._context = prompt_ids.clone()
        self._generated_from = len(prompt_ids)
        rows = []
        if len(prompt_ids) > 1:
            pending = prompt_ids[:-1]
            step = SCORED_PREFILL_CHUNK if score else len(pending)
            for start in range(0, len(pending), step):
                chunk = pending[start : start + step]
                result = self._forward(chunk, logits_for=len(chunk) if score else 1)
                self._record(start, result.hidden)
                if score:
                    rows.append(self._modified(result.logits, lambda prior: prior.expand(len(chunk), -1)))
        self.full_length = self.runner.length
        if self.features is not None:
            self.features.commit(self.full_length)
        if not score:
            return None
        return torch.cat(rows) if rows else torch.empty(0, 0)

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
        k = int(draft_tokens.shape[0])
        tokens, pad = self._padded(torch.cat([self._context[start:], draft_tokens]))
        result = self._forward(tokens, logits_for=k + 1 + pad, with_hidden=with_hidden)
        self.target_calls += 1
        self.full_length = self.runner.length
        real = len(tokens) - pad
        if self.features is not None:
            self._record(start, result.hidden[:real])
        hidden = result.hidden[real - (k + 1) : real, : self.hidden_size] if with_hidden else None
        logits = self._modified(result.logits[: k + 1], lambda prior: chain_counts(prior, draft_tokens))
        self._scored = (len(self._context), logits)  # row 0 predicts the token after the committed text
        return PassResult(logits, hidden)

    def target_tree_logits(self, tree) -> torch.Tensor:
        """Full-target logits [1 + m, V] of a token tree (``tree.TokenTree``, docs/algorithms.md
        §Token trees) in one pass: row 0 after the last committed token (the root), row 1 + i
        after node i. The nodes' KV stays in the cache after the committed tokens until
        ``commit`` keeps the accepted path's."""
        from .tree import tree_pass

        if self.runner.length > self.full_length:
            self.runner.rollback(self.full_length)
        start = self.full_length
        pending = self._context[start:]
        m = len(tree)
        layout = tree_pass(pending, tree, self._pad_count(len(pending) + m))
        result = self._forward(layout.tokens, logits_for=m + 1 + layout.padding, offsets=layout.offsets,
                               attends=layout.attends)
        self.target_calls += 1
        hidden = result.hidden[: layout.pending + m] if self.features is not None else None
        self._tree_pass = (start, layout.pending, hidden)
        logits = self._modified(result.logits[: m + 1], lambda prior: tree_counts(prior, tree.tokens, tree.parents))
        self._scored = (len(self._context), logits)  # rows by node: ``scored_rows`` follows the path
        return logits

    def slim_logits(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        """Slim-verifier logits [k+1, V] (the target under ``slim_mask``), same layout."""
        if self.slim_mask is None:
            raise ValueError("this generation has no slim verifier (no routing mask was given)")
        start = self.runner.length
        k = int(draft_tokens.shape[0])
        tokens, pad = self._padded(torch.cat([self._context[start:], draft_tokens]))
        result = self._forward(tokens, logits_for=k + 1 + pad, mask=self.slim_mask, vocabulary=self.slim_vocabulary)
        self.slim_calls += 1
        if self.features is not None:  # the slim model's features, until a full pass rewrites them
            self._record(start, result.hidden[: len(tokens) - pad])
        return self._modified(result.logits[: k + 1], lambda prior: chain_counts(prior, draft_tokens))

    def scored_rows(self, new_tokens: list[int], tree_path: list[int] | None = None) -> torch.Tensor:
        """The target's logits rows [len(new_tokens), V] that scored ``new_tokens`` (to be committed
        next; after a tree pass, along the accepted ``tree_path``), from the last full pass: the
        logprobs come from the rows the rule verified against, with no pass of their own."""
        if self._scored is None or self._scored[0] != len(self._context):
            raise TierspecError("log-probabilities need the target's scores of every emitted token; "
                                "this cycle committed tokens no target pass scored")
        first, logits = self._scored
        if tree_path is not None:
            return logits[torch.tensor([0] + [1 + node for node in tree_path[: len(new_tokens) - 1]], dtype=torch.long)]
        rows = logits[: len(new_tokens)]
        if rows.shape[0] < len(new_tokens):
            raise TierspecError("log-probabilities need the target's scores of every emitted token; "
                                "this cycle committed tokens no target pass scored")
        return rows

    def _pad_count(self, n: int) -> int:
        """Rows to add to an n-token pass (a one-token pass is never padded)."""
        return self.forward_costs.padded_size(n) - n if self.forward_costs is not None and n > 1 else 0

    def _padded(self, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
        pad = self._pad_count(len(tokens))
        return (torch.cat([tokens, tokens[-1:].expand(pad)]), pad) if pad else (tokens, 0)

    # -- commit and rollback --------------------------------------------------------------------
    def commit(self, new_tokens: list[int], tree_path: list[int] | None = None) -> torch.Tensor:
        """Append a cycle's ``new_tokens`` to the committed sequence and roll every cache back to
        the committed tokens it has processed; returns the new committed sequence.

        After a tree pass, ``tree_path`` (the accepted nodes, root first) says whose KV and
        features to keep as the positions after the committed tokens (``CachedModel.compact``)
        before the rollback.

        Invariant afterwards: full_length ≤ runner.length ≤ committed − 1, every layer holds KV
        for exactly the positions the model has processed, and the feature log's committed
        rows are those positions' features."""
        if (self._tree_pass is None) != (tree_path is None):
            raise ValueError("a tree pass's verdict is committed with its path, and only a tree pass's")
        if tree_path is not None:
            self._keep_tree_path(tree_path)
        self._context = torch.cat([self._context, torch.tensor(new_tokens, dtype=torch.long)])
        if self._generated_counts is not None:
            self._generated_counts = self._generated_counts + token_counts(torch.tensor(new_tokens, dtype=torch.long),
                                                                           self._generated_counts.shape[0])
        keep = len(self._context) - 1  # the last committed token is fed with the next draft
        self.runner.rollback(min(self.runner.length, keep))
        self.full_length = min(self.full_length, keep)
        if self.features is not None:
            self.features.commit(self.runner.length)
        self._scored = None  # its rows scored this cycle's tokens only
        return self._context

    def _keep_tree_path(self, path: list[int]) -> None:
        start, pending, hidden = self._tree_pass
        committed = start + pending
        self.runner.compact(committed, committed + torch.tensor(path, dtype=torch.long))
        self.full_length = self.runner.length
        if hidden is not None:
            self._record(start, hidden[:pending])
            if path:
                self._record(committed, hidden[pending + torch.tensor(path)])
        self._tree_pass = None

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

    def full_model_cache(self) -> CachedModel:
        verifiers = self.verifiers
        if verifiers.runner.length > verifiers.full_length:
            verifiers.runner.rollback(verifiers.full_length)
        return verifiers.runner

    def replay_window(self, start: int, tokens: torch.Tensor, mask) -> torch.Tensor:
        verifiers = self.verifiers
        if verifiers.runner.length > verifiers.full_length:
            verifiers.runner.rollback(verifiers.full_length)
        return verifiers.runner.replay(start, tokens, mask)


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


@dataclass
class Step:
    """What the loop yields after each commit. With ``DecodeConfig.logprobs``: ``logprobs``, one
    record per new token; the first step also carries ``prompt_logprobs`` with
    ``DecodeConfig.score_prompt`` (None for the first prompt token, which nothing scores)."""

    new_tokens: list[int]
    cycle: CycleStats
    finished: bool
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


def check_logprobs_method(method, config: DecodeConfig) -> None:
    """Refuse log-probabilities where tokens are committed that no target pass scored: VIA-SD's
    slim tier commits tokens before the full target sees them."""
    if config.logprobs is not None and getattr(method, "slim_mask", None) is not None:
        raise TierspecError(f"method '{method.name}' cannot report log-probabilities: its slim verifier commits "
                            "tokens the full target has not scored; use a method without a slim tier (e.g. hybrid, "
                            "eagle, pld, ar)")


def prompt_records(prompt_ids: torch.Tensor, rows: torch.Tensor, config: DecodeConfig) -> list[TokenLogprob]:
    """The echo records of ``prompt_ids`` [n] from the prefill's ``rows`` [n−1, V] (the first
    token's logprob is None)."""
    first = TokenLogprob(int(prompt_ids[0]), None)
    return [first] + token_logprobs(rows, prompt_ids[1:].tolist(), config.sampling, config.logprobs)


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
    check_logprobs_method(method, config)
    max_positions = getattr(target.model.config, "max_position_embeddings", None)
    prompt_ids = check_prompt(prompt_ids, max_positions, config.max_new_tokens, target.vocab_size)
    source = None
    if is_encoder_decoder(target.model):  # the prompt is the encoder's; the loop decodes the decoder's sequence
        if config.score_prompt:
            raise TierspecError("an encoder-decoder model reads the prompt with its encoder: there are no prompt "
                                "log-probabilities to report (echo)")
        source, prompt_ids = prompt_ids, decoder_start(target.model)
    drafter.set_source(source)
    # Every position this generation can reach: the prompt, the budget, and the last verification
    # pass's draft and padding past the budget.
    positions = len(prompt_ids) + config.max_new_tokens + 64
    verifiers = Verifiers(target, positions, slim_mask=method.slim_mask, forward_costs=method.forward_costs,
                          record_features=drafter.needs_target_features,
                          feature_layers=getattr(drafter, "feature_layers", ()),
                          slim_vocabulary=getattr(method, "slim_vocabulary", None), source=source,
                          modifiers=config.modifiers)
    config.modifiers.check_vocabulary(target.vocab_size)
    eos = set(config.eos_token_ids)
    noise = Noise(seed, target.vocab_size)

    with torch.inference_mode():
        prompt_rows = verifiers.prefill(prompt_ids, score=config.score_prompt)
        prompt_logprobs = None if prompt_rows is None else prompt_records(prompt_ids, prompt_rows, config)
        del prompt_rows
        drafter.start(prompt_ids, verifiers.features, verifiers.draft_view() if drafter.uses_target_cache else None)
        policy.start()
    emitted_total = 0
    cycle = _tree_cycle if getattr(drafter, "proposes_trees", False) else _cycle
    while emitted_total < config.max_new_tokens:
        with torch.inference_mode():
            step = cycle(verifiers, drafter, rule, policy, config, emitted_total, eos, noise)
        step.prompt_logprobs, prompt_logprobs = prompt_logprobs, None
        emitted_total += len(step.new_tokens)
        if inspect is not None:
            inspect(verifiers, drafter)
        yield step
        if step.finished:
            return


class DecodeRun:
    """One generation, iterated step by step, with the totals every caller reads: the one place
    a generation's ``GenerationStats`` is built and its wall clock read.

    Iterating runs ``decode`` (same arguments) and yields its ``Step``s; meanwhile each cycle is
    added to ``stats`` and the committed tokens to ``token_ids``. ``stats.wall_seconds`` runs from
    the first step asked for (the prefill is in it) to the latest step handed out, or to the end
    of the generation once it is exhausted (docs/metrics.md §Generation statistics). ``finish()``
    runs it to the end; ``close()`` stops it early."""

    def __init__(self, target: LoadedModel, method, prompt_ids: torch.Tensor, config: DecodeConfig,
                 seed: int | torch.Generator | None = None, inspect: Callable[[Verifiers, Drafter], None] | None = None):
        self._steps = decode(target, method, prompt_ids, config, seed, inspect)
        self.stats = GenerationStats()
        self.token_ids: list[int] = []
        self._started: float | None = None

    def __iter__(self) -> DecodeRun:
        return self

    def __next__(self) -> Step:
        if self._started is None:
            self._started = time.perf_counter()
        try:
            step = next(self._steps)
        finally:
            self.stats.wall_seconds = time.perf_counter() - self._started
        self.stats.add(step.cycle)
        self.token_ids.extend(step.new_tokens)
        return step

    def finish(self) -> DecodeRun:
        """Run the generation to its end; returns this run (``token_ids`` and ``stats`` complete)."""
        for _ in self:
            pass
        return self

    def close(self) -> None:
        """Stop the generation (a suspended one holds the target's cache until closed)."""
        self._steps.close()


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


def _cycle(verifiers: Verifiers, drafter: Drafter, rule: VerificationRule, policy: DraftPolicy,
           config: DecodeConfig, emitted_total: int, eos: set[int], noise: Noise) -> Step:
    started = time.perf_counter()
    context = verifiers.context
    target_calls, slim_calls, pass_seconds = verifiers.target_calls, verifiers.slim_calls, verifiers.pass_seconds
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
    new_tokens, finished, records = _commit(emitted, verifiers, drafter, config, emitted_total, eos, noise)

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
        pass_seconds=verifiers.pass_seconds - pass_seconds,
        deciders=verdict.deciders[: len(new_tokens)],
    )
    return Step(new_tokens, cycle, finished, records)


def _commit(new_tokens: list[int], verifiers: Verifiers, drafter: Drafter, config: DecodeConfig, emitted_total: int,
            eos: set[int], noise: Noise, tree_path: list[int] | None = None
            ) -> tuple[list[int], bool, list[TokenLogprob] | None]:
    """Commit a cycle's tokens (accepted drafts + the correction/bonus token; after a tree pass,
    ``tree_path`` the accepted nodes), cut after an EOS and at the token budget: the verifiers
    extend the committed sequence and roll their caches back, the drafter rolls its state back
    to the new length. Returns (the tokens committed, whether generation is finished, their
    logprob records when the config asks for them)."""
    finished = False
    for i, token in enumerate(new_tokens):
        if token in eos:
            new_tokens = new_tokens[: i + 1]
            finished = True
            break
    new_tokens = new_tokens[: config.max_new_tokens - emitted_total]
    records = None
    if config.logprobs is not None:
        records = token_logprobs(verifiers.scored_rows(new_tokens, tree_path), new_tokens, config.sampling, config.logprobs)
    committed = len(verifiers.commit(new_tokens, tree_path))
    noise.forget_before(committed)
    finished = finished or emitted_total + len(new_tokens) >= config.max_new_tokens
    drafter.commit(committed)
    return new_tokens, finished, records


def _tree_cycle(verifiers: Verifiers, drafter: Drafter, rule, policy: DraftPolicy, config: DecodeConfig,
                emitted_total: int, eos: set[int], noise: Noise) -> Step:
    """``_cycle`` for a tree drafter (docs/algorithms.md §Token trees): the drafter proposes a token tree no deeper than
    the tokens left allow, the rule walks it after one target pass, the loop keeps the accepted
    path's KV and commits path + next token. ``policy.observe_tree`` sees every verdict."""
    started = time.perf_counter()
    context = verifiers.context
    target_calls, pass_seconds = verifiers.target_calls, verifiers.pass_seconds
    remaining = config.max_new_tokens - emitted_total
    block = None if config.sampling.greedy else noise.block(len(context))
    proposal = drafter.propose_tree(context, max(0, remaining - 1), config.sampling, block)
    drafted_at = time.perf_counter()
    tree = proposal.tree
    verdict = rule.verify_tree(verifiers, tree, config.sampling, block)

    emitted = tree.tokens[verdict.path].tolist() + [verdict.next_token]
    new_tokens, finished, records = _commit(emitted, verifiers, drafter, config, emitted_total, eos, noise, verdict.path)
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
        pass_seconds=verifiers.pass_seconds - pass_seconds,
        deciders=verdict.deciders[: len(new_tokens)],
        tree_depth=tree.depth,
    )
    return Step(new_tokens, cycle, finished, records)
