"""Many generations, one pass per cycle: continuous batching with speculative decoding.

``BatchDecoder`` runs several generations on one loaded model at once. Each keeps everything a
generation alone keeps — its method's drafter, policy and rule, its seed's noise, its cache, its
committed tokens and statistics (``decode._Sequence``) — and every cycle does, for all of them:
draft (each with its own drafter and policy, which costs its drafts as the batch's passes:
``policies.CostModel.verify``), cut the drafts to what pays for the batch (``batch_lengths``),
run **one** target pass over every sequence's new rows (``cached_model.batched_pass``: the products
over all rows at once, each sequence's attention over its own cache), then verify and commit each.
Generations join between cycles (the prompt's prefill is a pass of its own) and leave when done or
cancelled.

Every generation's tokens are exactly its solo tokens, whatever else shares the batch and whenever
it joined: a row's logits are bitwise those of its solo pass (row-independent products, attention
per sequence, tested), the noise is keyed by the generation's seed and position, and a lossless
rule's emitted token at each position is the target's own whatever was drafted — so the draft
lengths the batch chooses change the speed, not the text. Rules whose text depends on the drafts
(the lossy rules) and tiered rules (VIA-SD drives passes of its own) are refused by ``add``: they
would not keep their solo text in a batch.

Batch invariance needs the pass engine (a GGUF model on its blocks); docs/algorithms.md §The pass
engine says why its rows are independent.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

from .cached_model import BatchItem, batched_pass
from .decode import (DecodeConfig, DecodeMethod, GenerationStats, Step, TokenLogprob, _conclude, _propose, _Sequence,
                     start_sequence)
from .engine import runs_on_engine, threads_for
from .errors import TierspecError
from .models import LoadedModel
from .policies import CostAware
from .rules.base import ScoreRule


class BatchError(TierspecError):
    """A generation a batch cannot take (a method that would not keep its solo text, another model)."""


@dataclass
class BatchedRun:
    """One generation inside a ``BatchDecoder``: its statistics and tokens, filled as it runs."""

    key: Hashable
    sequence: _Sequence
    prompt_logprobs: list[TokenLogprob] | None
    stats: GenerationStats = field(default_factory=GenerationStats)
    finished: bool = False
    started: float = field(default_factory=time.perf_counter)

    @property
    def token_ids(self) -> list[int]:
        return self.sequence.committed.generated()


def check_batchable(method: DecodeMethod) -> None:
    """Refuse a method whose text in a batch could differ from its text alone (see the module doc)."""
    rule = method.rule
    if not isinstance(rule, ScoreRule):
        raise BatchError(f"the rule '{rule.name}' drives verifier passes of its own (VIA-SD's tiers): it runs one "
                         "request at a time, not in a batch")
    if not rule.lossless:
        raise BatchError(f"the rule '{rule.name}' is lossy: its text depends on the drafts, which a batch sizes by "
                         "what else runs; batch lossless methods only (ar, pld, adaptive-pld, eagle, hybrid, …)")


def batch_lengths(proposals: list, reaches: list[list[float] | None], pass_seconds) -> list[int]:
    """How many of each proposal's drafts the batch verifies this cycle: the lengths that maximise
    the batch's expected emitted tokens per second, from ``pass_seconds(rows)`` (the measured cost
    of a pass of that many rows) and each proposal's chance of reaching each of its drafts (its
    policy's learned acceptance, ``reaches[i][j]``: P(drafts 0..j all accepted); None: keep it whole).

    Greedy on marginal value: start every proposal at no draft (its one row), then repeatedly take
    the next draft of the proposal whose next draft adds the most expected tokens, while that raises
    the batch's expected tokens per second. A longer batch makes every row dearer, so drafts shrink
    as it grows; when a draft no longer pays, none is verified."""
    lengths = [len(p) if reach is None else 0 for p, reach in zip(proposals, reaches)]
    rows = len(proposals) + sum(lengths)
    expected = float(len(proposals)) + sum(len(p) for p, reach in zip(proposals, reaches) if reach is None)
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


def _reach(run: "BatchedRun", proposal) -> list[float] | None:
    """P(the first j + 1 drafts all accepted) for each draft of a chain ``proposal``, by the run's
    policy (None: a tree, or a policy that learns no acceptance — the proposal stays as drafted)."""
    policy = run.sequence.policy
    if not isinstance(policy, CostAware) or not proposal.is_chain or len(proposal) == 0:
        return None
    return policy.reach(proposal)


class BatchDecoder:
    """Continuous batching on one model (see the module doc). ``add`` a generation (it is
    prefilled at once), then ``step`` runs one cycle for every active one and returns their
    ``Step``s; finished generations leave the batch by themselves, ``cancel`` removes one early.
    ``max_batch``: generations at once (``add`` refuses more); ``max_rows``: at most that many
    rows per pass (drafts are cut to fit; every generation keeps at least its one row);
    ``shared_costs``: each policy costs its drafts as the batch's passes (False: as if alone)."""

    def __init__(self, target: LoadedModel, max_batch: int = 8, max_rows: int | None = None,
                 shared_costs: bool = True):
        if not runs_on_engine(target.model):
            raise BatchError("batched generation runs on the pass engine: load a GGUF model on its blocks "
                             "(--kernels gguf, the default for the default model)")
        if max_batch < 1:
            raise BatchError("max_batch must be at least 1")
        self.target = target
        self.max_batch = max_batch
        self.max_rows = max_rows
        self.shared_costs = shared_costs  # False: policies cost drafts as if alone (for comparison)
        self.runs: dict[Hashable, BatchedRun] = {}
        #: where the batch's cycles went (wall seconds): drafting (every generation's drafter and
        #: policy, and the batch's cut), the batched target pass, deciding and committing
        self.seconds = {"draft": 0.0, "pass": 0.0, "verify": 0.0}
        self.cycles = 0
        self.rows = 0  # rows of all batched passes
        self.sequences = 0  # generations over all cycles (mean batch = sequences / cycles)

    def __len__(self) -> int:
        return len(self.runs)

    def add(self, key: Hashable, method: DecodeMethod, prompt_ids: torch.Tensor, config: DecodeConfig,
            seed: int | torch.Generator | None = None) -> BatchedRun:
        """Start a generation under ``key``: checked, its prompt prefilled (one pass of its own),
        ready for the next ``step``."""
        if key in self.runs:
            raise BatchError(f"a generation with key {key!r} is already running")
        if len(self.runs) >= self.max_batch:
            raise BatchError(f"the batch is full ({self.max_batch} generations)")
        check_batchable(method)
        if config.max_new_tokens < 1:
            raise BatchError("a generation in a batch needs a budget of at least one token")
        with threads_for(self.target.model):
            sequence, prompt_logprobs = start_sequence(self.target, method, prompt_ids, config, seed)
        run = self.runs[key] = BatchedRun(key, sequence, prompt_logprobs)
        return run

    def run_all(self, prompts: list[torch.Tensor], method: Callable[[], DecodeMethod], config: DecodeConfig,
                seed: int | None = None) -> list[BatchedRun]:
        """Every prompt generated to its end, at most ``max_batch`` at a time, a finished
        generation's place taken by the next prompt (as the server admits requests); ``method()``
        builds each generation's method (its drafter and policy state are its own). The runs in
        prompt order."""
        runs: list[BatchedRun] = []
        while len(runs) < len(prompts) or len(self):
            while len(runs) < len(prompts) and len(self) < self.max_batch:
                runs.append(self.add(len(runs), method(), prompts[len(runs)], config, seed))
            self.step()
        return runs

    def cancel(self, key: Hashable) -> None:
        """Drop a generation (its cache goes with it)."""
        self.runs.pop(key, None)

    def step(self) -> list[tuple[BatchedRun, Step]]:
        """One cycle for every active generation: draft, one batched pass, verify and commit each.
        Returns each generation's ``Step`` (a finished one has left the batch afterwards)."""
        if not self.runs:
            return []
        runs = list(self.runs.values())
        for run in runs:  # each policy costs its drafts as this batch's passes (policies.CostModel.verify)
            run.sequence.policy.share_passes(len(runs) if self.shared_costs else 1)
        with threads_for(self.target.model), torch.inference_mode():
            began = time.perf_counter()
            drafted = [_propose(run.sequence) for run in runs]  # each with its own drafter and policy
            proposals = [d.proposal for d in drafted]
            lengths = batch_lengths(proposals, [_reach(run, p) for run, p in zip(runs, proposals)],
                                    self._pass_seconds(runs))
            if self.max_rows is not None:
                lengths = _fit_rows(lengths, self.max_rows)
            for d, length in zip(drafted, lengths):
                if length < len(d.proposal):
                    d.proposal = d.proposal.prefix(length)
            requests = [run.sequence.verifiers.target_request(d.proposal, with_hidden=run.sequence.rule.reads_hidden,
                                                              pad=False)
                        for run, d in zip(runs, drafted)]
            feature_layers = sorted({layer for run in runs for layer in run.sequence.verifiers.feature_layers})
            needs_hidden = any(r.with_hidden or run.sequence.verifiers.features is not None
                               for run, r in zip(runs, requests))
            items = [BatchItem(run.sequence.verifiers.runner, r.tokens, r.logits_for, r.offsets, r.attends)
                     for run, r in zip(runs, requests)]
            started = time.perf_counter()
            results = batched_pass(self.target.model, items, tuple(feature_layers) if needs_hidden else None)
            seconds = time.perf_counter() - started
            self.seconds["draft"] += started - began
            self.seconds["pass"] += seconds
            self.cycles += 1
            self.sequences += len(runs)
            self.rows += sum(len(item.token_ids) for item in items)
            out = []
            for run, d, request, result in zip(runs, drafted, requests, results):
                verifiers = run.sequence.verifiers
                verifiers.pass_seconds += seconds / len(runs)  # each pays its share of the pass
                result = _own_hidden(result, feature_layers, verifiers.feature_layers, verifiers.hidden_size)
                scores = verifiers.target_scores(request, result)
                verdict = run.sequence.rule.decide(d.proposal, scores, run.sequence.config.sampling, d.block)
                step = _conclude(run.sequence, d, verdict)
                step.prompt_logprobs, run.prompt_logprobs = run.prompt_logprobs, None
                run.stats.add(step.cycle)
                run.stats.wall_seconds = time.perf_counter() - run.started
                if step.finished or run.sequence.committed.generated_count >= run.sequence.config.max_new_tokens:
                    step.finished = run.finished = True
                    self.runs.pop(run.key, None)
                out.append((run, step))
            self.seconds["verify"] += time.perf_counter() - started - seconds
        return out

    def _pass_seconds(self, runs: list[BatchedRun]):
        """The cost of a pass by rows: the first run's policy's measured table (one target, one
        machine; ``ForwardCosts.cost`` extends it linearly past its end); a nearly flat line where
        no run measured one."""
        table = next((run.sequence.policy.pass_costs for run in runs if run.sequence.policy.pass_costs is not None), None)
        return (lambda rows: 1.0 + 0.01 * rows) if table is None else table.cost


def _fit_rows(budgets: list[int], max_rows: int) -> list[int]:
    """Draft counts cut, largest first, until every run's rows (one + its drafts) fit ``max_rows``."""
    budgets = list(budgets)
    while len(budgets) + sum(budgets) > max_rows and any(budgets):
        largest = max(range(len(budgets)), key=lambda i: budgets[i])
        budgets[largest] -= 1
    return budgets


def _own_hidden(result, captured: list[int], wanted: tuple[int, ...], hidden_size: int):
    """A batched pass's result with only the hidden-state blocks this sequence's verifiers read (the
    final states, then its feature layers in its own order), as its solo pass would return them."""
    if result.hidden is None or list(wanted) == captured:
        return result
    blocks = [result.hidden[:, :hidden_size]]
    for layer in wanted:
        at = 1 + captured.index(layer)
        blocks.append(result.hidden[:, at * hidden_size : (at + 1) * hidden_size])
    return type(result)(result.logits, torch.cat(blocks, dim=-1))
