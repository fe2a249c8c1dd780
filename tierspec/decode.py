"""The one decode loop (docs/algorithms.md §The decode loop). Every method is a drafter, a
draft-length policy and a verification rule passed in. Who owns what: ``Verifiers`` the target's
cache, its passes and padding, the committed sequence (``CommittedTokens``, the one copy) and the
feature log; the drafter its own state; the method the policy; ``DecodeRun`` a generation's
``GenerationStats`` and wall clock.

One cycle, for a chain of drafts and a token tree alike (a chain is a tree of one path):

    block    = noise.block(len(context))              # the keyed noise of the cycle's positions
    drafted  = drafter.propose(context, request)      # a Proposal: a token tree + per-node rows
    proposal = drafted.prefix(policy.trim(drafted))   # the policy decides how many nodes to verify
    scores   = verifiers.target(proposal)             # one pass over pending tokens + every node
    verdict  = rule.decide(proposal, scores, ...)     # the accepted path and the next token
                                                      # (VIA-SD: rule.verify drives its tiers)
    verifiers.commit(path tokens + next token, path)  # the path's KV kept, every cache rolled back
    drafter.commit(len(context)); policy.observe(...) # each rolls back / learns
    yield the new tokens and the cycle's statistics

The steps are the phases a batch of sequences would share (issue 31): drafting, one pass, a verdict
per sequence from its own rows (the rules are functions of tensors), a commit per sequence.

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
from typing import Callable, Iterator, Protocol

import numpy as np
import torch

from .cached_model import CachedModel, PassResult, SlimVocabulary
from .costs import ForwardCosts
from .drafters.base import Drafter, FeatureLog, TargetDraftView
from .errors import PromptError, TierspecError
from .layerskip.masks import RoutingMask
from .models import LoadedModel
from .modifiers import LogitModifiers, chain_counts, modified_logits, token_counts, tree_counts
from .policies import CycleOutcome, DraftPolicy
from .proposal import DraftRequest, Proposal, Scores, Shape, Verdict, walk_reached
from .engine import threads_for
from .rules.base import ScoreRule, VerificationRule
from .sampling import BlockNoise, Noise, SamplingConfig, reported_logprobs
from .seq2seq import decoder_start, is_encoder_decoder, runner_for
from .tree import TokenTree, tree_pass


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


class CommittedTokens:
    """The committed sequence of one generation — the prompt, then every generated token — held
    once: the verifiers extend it at each commit; drafters read ``context``, the run its
    ``generated`` tokens, the text stream its pieces. Allocated for every position the generation
    can reach; ``context`` is a view (committed tokens never change, so a view stays right)."""

    def __init__(self, prompt_ids: torch.Tensor, positions: int):
        # numpy owns the buffer (a short list of ints is written into it cheaply), torch views it
        self._buffer = np.empty(max(positions, len(prompt_ids)), dtype=np.int64)
        self._buffer[: len(prompt_ids)] = prompt_ids.cpu().numpy()
        self._ids = torch.from_numpy(self._buffer)
        self.length = self.prompt_length = len(prompt_ids)

    def __len__(self) -> int:
        return self.length

    @property
    def context(self) -> torch.Tensor:
        """The committed sequence [n] int64 (a view)."""
        return self._ids[: self.length]

    @property
    def generated_count(self) -> int:
        return self.length - self.prompt_length

    def pending(self, start: int) -> torch.Tensor:
        """Committed tokens ``start ..`` [n − start] (a view): what a pass from ``start`` runs first."""
        return self._ids[start : self.length]

    def generated(self, start: int = 0, end: int | None = None) -> list[int]:
        """Generated tokens ``start .. end`` (Python slice bounds over the generated tokens only)."""
        begin = self.prompt_length
        stop = self.length if end is None else begin + min(end, self.generated_count)
        return self._buffer[begin + start : stop].tolist() if begin + start < stop else []

    @property
    def generated_view(self) -> GeneratedTokens:
        """The generated tokens as a read-only sequence (slices are read from here, not copied)."""
        return GeneratedTokens(self)

    def extend(self, tokens: list[int]) -> None:
        end = self.length + len(tokens)
        if end > self._buffer.shape[0]:
            raise ValueError(f"{end} committed tokens do not fit the {self._buffer.shape[0]} positions reserved")
        self._buffer[self.length : end] = tokens
        self.length = end


class GeneratedTokens:
    """A read-only view of a generation's generated tokens: ``len`` and slices (lists of ids)."""

    def __init__(self, committed: CommittedTokens):
        self._committed = committed

    def __len__(self) -> int:
        return self._committed.generated_count

    def __getitem__(self, index: slice) -> list[int]:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("read generated tokens by contiguous slices")
        start, stop, _ = index.indices(len(self))
        return self._committed.generated(start, stop)


@dataclass
class PassRecord:
    """What the cycle's last verifier pass leaves for the commit to settle. The pass wrote cache
    positions from ``start``: first ``pending`` committed tokens, then the proposal's ``nodes`` in
    node order; a chain's nodes sit at their own positions already, a tree's accepted path is
    moved there at the commit (``CachedModel.compact``).

    hidden: [pending + m, W] the rows' features, when the feature log records them
    scored:  [1 + m, V] the full target's logits of the proposal (modifiers applied), which the
             committed tokens' log-probabilities are read from; None after a slim pass
    """

    start: int
    pending: int
    nodes: int
    chain: bool
    hidden: torch.Tensor | None = None
    scored: torch.Tensor | None = None


@dataclass
class TargetRequest:
    """A full-target pass before it runs (``Verifiers.target_request``): the ``tokens`` [n] (the
    ``pending`` committed tokens, the nodes, ``pad`` padding rows) written from cache position
    ``start``, the last ``logits_for`` rows scored, a tree's ``offsets``/``attends`` (None for a
    chain), and whether the rule reads the rows' hidden states."""

    proposal: Proposal
    start: int
    pending: int
    pad: int
    tokens: torch.Tensor
    logits_for: int
    offsets: torch.Tensor | None
    attends: torch.Tensor | None
    with_hidden: bool


class DecodeMethod(Protocol):
    """What the loop reads of a method (``methods.Method``): its parts and verifier settings."""

    name: str
    drafter: Drafter
    rule: VerificationRule
    policy: DraftPolicy
    slim_mask: RoutingMask | None  # VIA-SD's slim verifier: the target under this mask
    slim_vocabulary: SlimVocabulary | None  # the slim tier scores only these tokens


class Verifiers:
    """The verifier tiers of one generation and everything they own: the target's cache and
    passes, the padding of each pass, the committed sequence, rollback, and the feature log. The
    loop runs ``target`` (the one verifier pass) for a rule that is a function of its scores; a
    ``TieredRule`` (VIA-SD) calls ``slim`` and ``target`` itself (``rules.base.VerifierTiers``).

    The committed sequence is ``committed`` (``context`` its tokens); only ``prefill`` and
    ``commit`` change it. The full target runs on ``runner`` (a CachedModel); a rule with a slim
    verifier (VIA-SD) gets it as the same model and cache under ``slim_mask`` (no second model in
    memory).

    Cache bookkeeping: every layer holds full-model KV for the first ``full_length`` positions;
    the kept layers of the slim mask may hold slim KV beyond that, up to ``runner.length``, for
    committed tokens that only the slim verifier has processed (the full target lags,
    docs/algorithms.md §VIA-SD). A full pass, and every drafter's use of the cache, first drops
    that slim KV (``_full_model_kv_only``, the one rollback guard) and re-processes those tokens.

    With ``record_features`` every pass's LM-head inputs f_t reach ``features`` (a
    ``FeatureLog``, the one copy a draft head reads; no extra pass) for the positions it commits.
    """

    def __init__(self, target: LoadedModel, positions: int, slim_mask: RoutingMask | None = None,
                 pass_costs: ForwardCosts | None = None, record_features: bool = False,
                 feature_layers: tuple[int, ...] = (), slim_vocabulary: SlimVocabulary | None = None,
                 source: torch.Tensor | None = None, modifiers: LogitModifiers = LogitModifiers()):
        """``positions``: every position this generation's passes can reach (the prompt, the
        token budget and a last pass's draft and padding); the KV buffer, the committed sequence
        and the feature log are allocated for them once. ``pass_costs`` (a ``costs.ForwardCosts``,
        the policy's): pad each pass to the cheapest measured size at least as long (extra rows
        repeat the last token; their outputs are dropped and their KV rolled back with the rest
        of the uncommitted block). ``slim_vocabulary`` (a ``cached_model.SlimVocabulary``): the
        slim tier scores only those tokens. ``source`` [S]: an encoder–decoder target's encoder
        input (``seq2seq``); the cache is then its decoder's. ``modifiers``: applied to every row
        of every pass the rules read (target and slim), each row with the counts of the
        generated text before it."""
        self.runner = runner_for(target.model, source)
        self.runner.reserve(positions)  # a longer pass than foreseen still grows the KV buffer
        self.positions = positions
        self.slim_mask = slim_mask
        self.slim_vocabulary = slim_vocabulary
        self.pass_costs = pass_costs
        self._pads: dict[int, int] = {}  # rows added to an n-token pass, by n
        self.feature_layers = tuple(feature_layers)  # decoder layers recorded beside f (a fused draft head)
        self.hidden_size = int(target.identity.hidden_size)
        self.features = FeatureLog(positions, self.hidden_size * (1 + len(self.feature_layers))) if record_features else None
        self.committed = CommittedTokens(torch.empty(0, dtype=torch.long), positions)
        self.full_length = 0
        self.target_calls = 0
        self.slim_calls = 0
        self.pass_seconds = 0.0  # time in verifier passes (``_forward``): where a cycle's time goes
        self._pass: PassRecord | None = None  # the cycle's last verifier pass, until its commit
        self.modifiers = modifiers if modifiers.active else None
        self._generated_counts: torch.Tensor | None = None  # c [V] of the committed generated tokens
        self._bias: torch.Tensor | None = None  # b [V]

    @property
    def context(self) -> torch.Tensor:
        """The committed sequence [n] (read-only: ``commit`` extends it)."""
        return self.committed.context

    @property
    def target_lag(self) -> int:
        """Committed tokens (before the pending last one) the full target has not processed."""
        return len(self.committed) - 1 - self.full_length

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

    def _full_model_kv_only(self) -> None:
        """Drop the slim KV past ``full_length`` (the one rollback guard: a full pass recomputes
        those positions, a drafter reads full-model KV only)."""
        if self.runner.length > self.full_length:
            self.runner.rollback(self.full_length)

    def _modified(self, logits: torch.Tensor, counts: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``logits`` [r, V] under the modifiers; ``counts(prior [V])`` gives each row's counts [r, V]."""
        if self.modifiers is None:
            return logits
        vocab_size = logits.shape[-1]
        if self._generated_counts is None or self._generated_counts.shape[0] != vocab_size:
            self._generated_counts = token_counts(torch.tensor(self.committed.generated()), vocab_size)
            self._bias = self.modifiers.bias_vector(vocab_size) if self.modifiers.logit_bias else None
        return modified_logits(logits, counts(self._generated_counts), self.modifiers, self._bias)

    def _node_rows(self, logits: torch.Tensor, tree: TokenTree) -> torch.Tensor:
        """A pass's rows [1 + m, V] by node under the modifiers: row 1 + i with the counts of the
        generated text and node i's path."""
        if tree.is_chain:
            return self._modified(logits, lambda prior: chain_counts(prior, tree.tokens))
        return self._modified(logits, lambda prior: tree_counts(prior, tree.tokens, tree.parents))

    def prefill(self, prompt_ids: torch.Tensor, score: bool = False) -> torch.Tensor | None:
        """Commit the prompt. The target processes all but its last token, which is fed with the
        first draft (so every verification pass is "pending committed tokens + draft").

        ``score``: return the logits [n−1, V] (modifiers applied) of the same pass's rows, row j
        before prompt token j+1 (the first token has none): what ``echo`` reports. Long prompts
        run in chunks of ``SCORED_PREFILL_CHUNK`` tokens then, so the rows' memory stays bounded."""
        self.committed = CommittedTokens(prompt_ids, self.positions)
        rows = []
        if len(prompt_ids) > 1:
            pending = prompt_ids[:-1]
            step = SCORED_PREFILL_CHUNK if score else len(pending)
            for start in range(0, len(pending), step):
                chunk = pending[start : start + step]
                result = self._forward(chunk, logits_for=len(chunk) if score else 1)
                if self.features is not None:
                    self.features.write(start, result.hidden)
                if score:
                    rows.append(self._modified(result.logits, lambda prior: prior.expand(len(chunk), -1)))
        self.full_length = self.runner.length
        if self.features is not None:
            self.features.commit(self.full_length)
        if not score:
            return None
        return torch.cat(rows) if rows else torch.empty(0, 0)

    def target(self, proposal: Proposal, with_hidden: bool = False) -> Scores:
        """One full-target pass over the pending committed tokens and every node of ``proposal``:
        its ``Scores`` (logits [1 + m, V], row 0 after the last committed token, row 1 + i after
        node i; ``with_hidden``: the final hidden states [1 + m, H] of the same rows).

        A chain runs as a plain causal pass (the drafts at their own positions); any other tree
        as a tree pass (``tree.tree_pass``: node i at position n − 1 + depth_i, attending to its
        ancestors; its logits equal a chain pass of its path). The nodes' KV stays in the cache
        after the committed tokens until ``commit`` keeps the accepted path's."""
        request = self.target_request(proposal, with_hidden)
        started = time.perf_counter()
        result = self.runner.forward(request.tokens, logits_for=request.logits_for,
                                     with_hidden=request.with_hidden or self.features is not None,
                                     hidden_layers=self.feature_layers if self.features is not None else (),
                                     offsets=request.offsets, attends=request.attends)
        self.pass_seconds += time.perf_counter() - started
        return self.target_scores(request, result)

    def target_request(self, proposal: Proposal, with_hidden: bool = False, pad: bool = True) -> "TargetRequest":
        """The rows of ``target``'s pass for ``proposal``, before it runs (a batch runs many at once:
        ``batch.BatchDecoder``); ``pad=False``: no padding to a cheaper size (a batch pays by its total
        rows)."""
        self._full_model_kv_only()  # slim-only KV is recomputed in this pass
        start = self.full_length
        pending = self.committed.pending(start)
        tree = proposal.tree
        rows, m = len(pending), len(tree)
        extra = self._pad_count(rows + m) if pad else 0
        if tree.is_chain:
            return TargetRequest(proposal, start, rows, extra, _chain_rows(pending, tree.tokens, extra), m + 1 + extra,
                                 None, None, with_hidden)
        layout = tree_pass(pending, tree, extra)
        return TargetRequest(proposal, start, rows, extra, layout.tokens, m + 1 + extra, layout.offsets, layout.attends,
                             with_hidden)

    def target_scores(self, request: "TargetRequest", result: PassResult) -> Scores:
        """``target``'s ``Scores`` from the ``PassResult`` of ``request``'s pass (run solo or in a
        batch); records the pass for ``commit``."""
        tree = request.proposal.tree
        rows, m = request.pending, len(tree)
        self.target_calls += 1
        self.full_length = self.runner.length
        logits = self._node_rows(result.logits[: m + 1] if request.pad else result.logits, tree)
        recorded = result.hidden[: rows + m] if self.features is not None else None
        self._pass = PassRecord(request.start, rows, m, tree.is_chain, recorded, logits)
        hidden = result.hidden[rows - 1 : rows + m, : self.hidden_size] if request.with_hidden else None
        return Scores(logits, hidden)

    def slim(self, proposal: Proposal) -> Scores:
        """The slim verifier's rows [k + 1, V] for a chain ``proposal`` (the target under
        ``slim_mask``, on top of whatever the cache holds), laid out as ``target``'s."""
        if self.slim_mask is None:
            raise ValueError("this generation has no slim verifier (no routing mask was given)")
        if not proposal.is_chain:
            raise ValueError("the slim verifier scores chains only (VIA-SD verifies one chain of drafts)")
        start = self.runner.length
        pending = self.committed.pending(start)
        rows, k = len(pending), len(proposal)
        pad = self._pad_count(rows + k)
        result = self._forward(_chain_rows(pending, proposal.tokens, pad), logits_for=k + 1 + pad, mask=self.slim_mask,
                               vocabulary=self.slim_vocabulary)
        self.slim_calls += 1
        # the slim model's features, until a full pass rewrites them
        self._pass = PassRecord(start, rows, k, True, result.hidden[: rows + k] if self.features is not None else None)
        return Scores(self._node_rows(result.logits[: k + 1], proposal.tree))

    def scored_rows(self, new_tokens: list[int], path: list[int]) -> torch.Tensor:
        """The target's logits rows [len(new_tokens), V] that scored ``new_tokens`` (to be committed
        next, along the accepted ``path``), from this cycle's full pass: the logprobs come from the
        rows the rule verified against, with no pass of their own."""
        scored = None if self._pass is None else self._pass.scored
        if scored is None:
            raise TierspecError("log-probabilities need the target's scores of every emitted token; "
                                "this cycle committed tokens no target pass scored")
        return scored[torch.tensor([0] + [1 + node for node in path[: len(new_tokens) - 1]], dtype=torch.long)]

    def _pad_count(self, n: int) -> int:
        """Rows to add to an n-token pass (a one-token pass is never padded)."""
        if self.pass_costs is None or n < 2:
            return 0
        pad = self._pads.get(n)
        if pad is None:
            pad = self._pads[n] = self.pass_costs.padded_size(n) - n
        return pad

    # -- commit and rollback --------------------------------------------------------------------
    def commit(self, new_tokens: list[int], path: list[int]) -> int:
        """Append a cycle's ``new_tokens`` to the committed sequence, keep the KV and features of
        the accepted ``path`` (the proposal's nodes, depth 1 first) as the positions after the
        committed tokens, and roll every cache back to the committed tokens it has processed;
        returns the new committed length.

        Invariant afterwards: full_length ≤ runner.length ≤ committed − 1, every layer holds KV
        for exactly the positions the model has processed, and the feature log's committed
        rows are those positions' features."""
        record, self._pass = self._pass, None
        if record is None:
            raise ValueError("no verifier pass awaits a verdict: each cycle's pass is committed once")
        if len(path) > record.nodes or (path and max(path) >= record.nodes) or len(new_tokens) > len(path) + 1:
            raise ValueError(f"a verdict on {record.nodes} nodes commits a path of them and one token more; "
                             f"got path {path} and {len(new_tokens)} tokens")
        self._keep_path(record, path)
        self.committed.extend(new_tokens)
        if self._generated_counts is not None:
            self._generated_counts = self._generated_counts + token_counts(torch.tensor(new_tokens, dtype=torch.long),
                                                                           self._generated_counts.shape[0])
        keep = len(self.committed) - 1  # the last committed token is fed with the next draft
        self.runner.rollback(min(self.runner.length, keep))
        self.full_length = min(self.full_length, keep)
        if self.features is not None:
            self.features.commit(self.runner.length)
        return len(self.committed)

    def _keep_path(self, record: PassRecord, path: list[int]) -> None:
        """The accepted path's KV and features at the positions after the committed tokens: a
        chain's are there already; a tree's are moved there and the other nodes dropped."""
        committed = record.start + record.pending  # where depth 1 goes
        if not record.chain:
            self.runner.compact(committed, committed + torch.tensor(path, dtype=torch.long))
            self.full_length = min(self.full_length, self.runner.length)
        if record.hidden is None:
            return
        if record.chain:
            self.features.write(record.start, record.hidden[: record.pending + len(path)])
            return
        self.features.write(record.start, record.hidden[: record.pending])
        if path:
            self.features.write(committed, record.hidden[record.pending + torch.tensor(path, dtype=torch.long)])

    def draft_view(self) -> TargetDraftView:
        return _DraftView(self)


def _chain_rows(pending: torch.Tensor, drafts: torch.Tensor, pad: int) -> torch.Tensor:
    """The tokens of a chain pass: the pending committed tokens, the drafts, and ``pad`` copies
    of the last (padding rows: their outputs are dropped, their KV rolled back)."""
    if not len(drafts) and not pad:
        return pending
    parts = [pending, drafts] if len(drafts) else [pending]
    if pad:
        parts.append((drafts if len(drafts) else pending)[-1:].expand(pad))
    return torch.cat(parts)


class _DraftView(TargetDraftView):
    """A self-drafter's access to the target cache: masked passes on top of full-model KV."""

    def __init__(self, verifiers: Verifiers):
        self.verifiers = verifiers
        self._drafting = False  # masked positions appended since the last discard

    @property
    def length(self) -> int:
        return self.verifiers.full_length

    def forward(self, tokens: torch.Tensor, mask) -> torch.Tensor:
        if not self._drafting:
            self.verifiers._full_model_kv_only()  # draft on full-model KV only
            self._drafting = True
        return self.verifiers.runner.forward(tokens, logits_for=1, mask=mask).logits[-1]

    def discard(self) -> None:
        self._drafting = False
        verifiers = self.verifiers
        verifiers.runner.rollback(min(verifiers.runner.length, verifiers.full_length))

    def full_model_cache(self) -> CachedModel:
        self.verifiers._full_model_kv_only()
        return self.verifiers.runner

    def replay_window(self, start: int, tokens: torch.Tensor, mask) -> torch.Tensor:
        self.verifiers._full_model_kv_only()
        return self.verifiers.runner.replay(start, tokens, mask)


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


@dataclass
class _Sequence:
    """One generation's state across cycles (a batch of generations would hold one each)."""

    verifiers: Verifiers
    drafter: Drafter
    rule: VerificationRule
    policy: DraftPolicy
    config: DecodeConfig
    eos: frozenset[int]
    noise: Noise
    tree_stats: bool  # the drafter proposes trees: each cycle reports its tree's shape

    @property
    def committed(self) -> CommittedTokens:
        return self.verifiers.committed


def decode(
    target: LoadedModel,
    method: DecodeMethod,
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
    sequence, prompt_logprobs = start_sequence(target, method, prompt_ids, config, seed)
    while sequence.committed.generated_count < config.max_new_tokens:
        with torch.inference_mode():
            step = _cycle(sequence)
        step.prompt_logprobs, prompt_logprobs = prompt_logprobs, None
        if inspect is not None:
            inspect(sequence.verifiers, sequence.drafter)
        yield step
        if step.finished:
            return


def start_sequence(target: LoadedModel, method: DecodeMethod, prompt_ids: torch.Tensor, config: DecodeConfig,
                   seed: int | torch.Generator | None = None) -> tuple[_Sequence, list[TokenLogprob] | None]:
    """A generation set up to its first cycle: checked, its verifiers made, the prompt prefilled,
    the drafter and policy started. Returns it and the prompt's logprob records (``echo``)."""
    drafter, rule, policy = method.drafter, method.rule, method.policy
    check_shapes(drafter, rule)
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
    verifiers = Verifiers(target, reach(len(prompt_ids), config, policy), slim_mask=method.slim_mask,
                          pass_costs=policy.pass_costs, record_features=drafter.needs_target_features,
                          feature_layers=drafter.feature_layers, slim_vocabulary=method.slim_vocabulary, source=source,
                          modifiers=config.modifiers)
    config.modifiers.check_vocabulary(target.vocab_size)
    sequence = _Sequence(verifiers, drafter, rule, policy, config, frozenset(config.eos_token_ids),
                         Noise(seed, target.vocab_size), drafter.proposes is Shape.TREE)

    with torch.inference_mode():
        prompt_rows = verifiers.prefill(prompt_ids, score=config.score_prompt)
        prompt_logprobs = None if prompt_rows is None else prompt_records(prompt_ids, prompt_rows, config)
        del prompt_rows
        drafter.start(prompt_ids, verifiers.features, verifiers.draft_view() if drafter.uses_target_cache else None)
        policy.start()
    return sequence, prompt_logprobs


def _cycle(sequence: _Sequence) -> Step:
    """One draft–verify–commit cycle (module docstring), for a chain and a tree alike."""
    drafted = _propose(sequence)
    verdict = _verdict(sequence.verifiers, sequence.rule, drafted.proposal, sequence.config.sampling, drafted.block)
    return _conclude(sequence, drafted, verdict)


@dataclass
class _Drafted:
    """A cycle's first half (``_propose``): the drafter's proposal, the policy's cut of it, the
    block's noise and the counters and clock the cycle's statistics start from."""

    drafted: Proposal
    proposal: Proposal
    block: BlockNoise | None
    started: float
    drafted_at: float
    target_calls: int
    slim_calls: int
    pass_seconds: float


def _propose(sequence: _Sequence) -> _Drafted:
    """Draft and trim: the proposal this cycle verifies."""
    started = time.perf_counter()
    verifiers, drafter, policy, config = sequence.verifiers, sequence.drafter, sequence.policy, sequence.config
    context = verifiers.context
    # Never draft past the budget: the cycle emits at most (drafts on the path) + 1 tokens.
    budget = max(0, min(policy.max_draft, config.max_new_tokens - sequence.committed.generated_count - 1))
    # Draft token i (a node at depth i + 1) and the token after the drafts sit at position len(context) + i.
    block = None if config.sampling.greedy else sequence.noise.block(len(context))
    drafted = drafter.propose(context, DraftRequest(budget, config.sampling, block, policy))
    proposal = drafted.prefix(policy.trim(drafted))
    if proposal.tree.depth > budget:
        raise TierspecError(f"{type(drafter).__name__} drafted {proposal.tree.depth} tokens deep for a budget of {budget}")
    return _Drafted(drafted, proposal, block, started, time.perf_counter(), verifiers.target_calls, verifiers.slim_calls,
                    verifiers.pass_seconds)


def _conclude(sequence: _Sequence, drafted: _Drafted, verdict: Verdict) -> Step:
    """Commit the verdict and report the cycle: the accepted path + the correction/bonus token,
    cut at EOS and the budget; the policy learns from it."""
    verifiers, policy, proposal = sequence.verifiers, sequence.policy, drafted.proposal
    tokens = proposal.tokens.tolist()
    emitted = [tokens[node] for node in verdict.path] + [verdict.next_token]
    new_tokens, finished, records = _commit(sequence, emitted, verdict.path)
    policy.observe(CycleOutcome(drafted.drafted, proposal, verdict))
    ended = time.perf_counter()
    cycle = CycleStats(
        drafted=len(proposal),
        # A node is evaluated when its parent was reached: the accepted path's nodes and the child
        # tried below its end (the cycle's rejection; a chain's first rejected draft).
        evaluated=verdict.accepted + int(walk_reached(proposal.tree, verdict.path)),
        accepted=verdict.accepted,
        emitted=len(new_tokens),
        target_calls=verifiers.target_calls - drafted.target_calls,
        slim_calls=verifiers.slim_calls - drafted.slim_calls,
        drafter_calls=proposal.drafter_calls,
        seconds=ended - drafted.started,
        draft_seconds=drafted.drafted_at - drafted.started,
        pass_seconds=verifiers.pass_seconds - drafted.pass_seconds,
        deciders=verdict.deciders[: len(new_tokens)],
        tree_depth=proposal.tree.depth if sequence.tree_stats else None,
    )
    return Step(new_tokens, cycle, finished, records, committed=sequence.committed, proposal=proposal, verdict=verdict)


def _verdict(verifiers: Verifiers, rule: VerificationRule, proposal: Proposal, sampling: SamplingConfig,
             block: BlockNoise | None) -> Verdict:
    """The rule's verdict: the loop runs the one target pass for a rule of its scores; a tiered
    rule (VIA-SD) runs the passes it needs itself."""
    if isinstance(rule, ScoreRule):
        return rule.decide(proposal, verifiers.target(proposal, with_hidden=rule.reads_hidden), sampling, block)
    return rule.verify(verifiers, proposal, sampling, block)


def _commit(sequence: _Sequence, new_tokens: list[int], path: list[int]) -> tuple[list[int], bool, list[TokenLogprob] | None]:
    """Commit a cycle's tokens (the accepted path's + the correction/bonus token), cut after an
    EOS and at the token budget: the verifiers extend the committed sequence and roll their caches
    back, the drafter rolls its state back to the new length. Returns (the tokens committed,
    whether generation is finished, their logprob records when the config asks for them)."""
    config, verifiers = sequence.config, sequence.verifiers
    finished = False
    for i, token in enumerate(new_tokens):
        if token in sequence.eos:
            new_tokens = new_tokens[: i + 1]
            finished = True
            break
    new_tokens = new_tokens[: config.max_new_tokens - sequence.committed.generated_count]
    records = None
    if config.logprobs is not None:
        records = token_logprobs(verifiers.scored_rows(new_tokens, path), new_tokens, config.sampling, config.logprobs)
    committed = verifiers.commit(new_tokens, path)
    sequence.noise.forget_before(committed)
    finished = finished or sequence.committed.generated_count >= config.max_new_tokens
    sequence.drafter.commit(committed)
    return new_tokens, finished, records


class DecodeRun:
    """One generation, iterated step by step, with the totals every caller reads: the one place
    a generation's ``GenerationStats`` is built and its wall clock read.

    Iterating runs ``decode`` (same arguments) and yields its ``Step``s; meanwhile each cycle is
    added to ``stats``; ``token_ids`` reads the generated tokens from the generation's committed
    sequence. ``stats.wall_seconds`` runs from the first step asked for (the prefill is in it) to
    the latest step handed out, or to the end of the generation once it is exhausted
    (docs/metrics.md §Generation statistics). ``finish()`` runs it to the end; ``close()`` stops it
    early."""

    def __init__(self, target: LoadedModel, method: DecodeMethod, prompt_ids: torch.Tensor, config: DecodeConfig,
                 seed: int | torch.Generator | None = None, inspect: Callable[[Verifiers, Drafter], None] | None = None):
        self._steps = decode(target, method, prompt_ids, config, seed, inspect)
        self._target = target
        self.stats = GenerationStats()
        self.committed: CommittedTokens | None = None  # the generation's, from its first step
        self._started: float | None = None

    @property
    def token_ids(self) -> list[int]:
        """The tokens generated so far."""
        return [] if self.committed is None else self.committed.generated()

    def __iter__(self) -> DecodeRun:
        return self

    def __next__(self) -> Step:
        if self._started is None:
            self._started = time.perf_counter()
        try:
            with threads_for(self._target.model):  # torch's small operators on one thread, on the engine
                step = next(self._steps)
        finally:
            self.stats.wall_seconds = time.perf_counter() - self._started
        self.stats.add(step.cycle)
        self.committed = step.committed
        return step

    def finish(self) -> DecodeRun:
        """Run the generation to its end; returns this run (``token_ids`` and ``stats`` complete)."""
        for _ in self:
            pass
        return self

    def close(self) -> None:
        """Stop the generation (a suspended one holds the target's cache until closed)."""
        self._steps.close()
