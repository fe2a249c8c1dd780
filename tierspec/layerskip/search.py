"""DIMR: the offline search for the slim verifier's routing mask (docs/algorithms.md §DIMR mask
search).

Cost of a mask z over a window of τ teacher-forced calibration positions, with the slim
model q'_z in the drafter role and the full target q as verifier (φ(x) = max(0, x)):

    R(q ‖ q'_z)|_t = Σ_v q'_z(v)·φ(log(1−α) + log q'_z(v) − log q(v))
                   + Σ_v q(v)·φ(log q(v) − log q'_z(v) − log β)
    C(z) = Σ_{t ∈ window} R(q ‖ q'_z)|_t

The search draws masks with exactly round(r·U) bypassed units (U = L layers, or 2L
sub-layers), never the first or last layer: random search, with a Bayesian optimisation step
every θ evaluations (a Gaussian process over the evaluated masks' keep-vectors, expected
improvement maximised over candidate masks: neighbours of the best masks and fresh random
ones). SWIFT's objective (greedy agreement of q'_z with q) can be optimised instead.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import TierspecError
from ..models import LoadedModel
from ..util import atomic_write_text, one_line
from .candidates import ComputeBudget, Evaluation, next_keep
from .masks import RoutingMask, apply_mask

OBJECTIVES = ("kl", "agreement")


def routing_cost(slim_logprobs: torch.Tensor, target_logprobs: torch.Tensor, alpha: float = 0.0, beta: float = 1.0) -> torch.Tensor:
    """R(q ‖ q') per position: slim/target log-probabilities [N, V] → [N].

    With α = 0, β = 1 it is Σ q'·φ(log q'/q) + Σ q·φ(log q/q'): zero iff q' = q.
    """
    if not 0.0 <= alpha < 1.0:
        raise TierspecError(f"alpha must be in [0, 1), got {alpha}")
    if not 0.0 < beta <= 1.0:
        raise TierspecError(f"beta must be in (0, 1], got {beta}")
    gap = slim_logprobs - target_logprobs  # log q'(v) − log q(v)
    over = (math.log1p(-alpha) + gap).clamp_min(0.0)  # where the slim model over-weights v
    under = (-gap - math.log(beta)).clamp_min(0.0)  # where it under-weights v
    return (slim_logprobs.exp() * over).sum(-1) + (target_logprobs.exp() * under).sum(-1)


@dataclass
class Calibration:
    """Teacher-forced text: sequences [B, W] whose last ``window`` tokens are the target's own
    greedy continuation; the target's log-probabilities there are computed once."""

    sequences: torch.Tensor  # [B, W] int64
    window: int  # τ: positions scored per sequence
    target_logprobs: torch.Tensor = field(repr=False, default=None)  # [B·τ, V]
    target_argmax: torch.Tensor = field(repr=False, default=None)  # [B·τ]
    sources: list[torch.Tensor] | None = None  # an encoder–decoder target's B sources; sequences are decoder tokens

    @property
    def digest(self) -> str:
        sources = b"".join(s.numpy().tobytes() + b"|" for s in self.sources or ())
        return hashlib.sha256(self.sequences.numpy().tobytes() + str(self.window).encode() + sources).hexdigest()[:16]


def window_logits(model: torch.nn.Module, calibration: Calibration, mask: RoutingMask | None) -> torch.Tensor:
    """Logits [B·τ, V] predicting the window tokens, one cache-free batched pass."""
    if calibration.sources is not None:  # the decoder against each source (routing covers decoder units only)
        from ..seq2seq import window_logits as decoder_window_logits

        return decoder_window_logits(model, calibration.sources, calibration.sequences, calibration.window, mask)
    with torch.inference_mode(), apply_mask(model, mask):
        # Positions W−τ−1 .. W−2 predict the window tokens W−τ .. W−1.
        device = next(model.parameters()).device
        logits = model(input_ids=calibration.sequences.to(device), use_cache=False,
                       logits_to_keep=calibration.window + 1).logits
    return logits[:, :-1].reshape(-1, logits.shape[-1]).float().cpu()


def with_target_scores(model: torch.nn.Module, calibration: Calibration) -> Calibration:
    logits = window_logits(model, calibration, None)
    calibration.target_logprobs = logits.log_softmax(-1)
    calibration.target_argmax = logits.argmax(-1)
    return calibration


def evaluate_mask(model, calibration: Calibration, mask: RoutingMask, alpha: float = 0.0, beta: float = 1.0) -> tuple[float, float]:
    """(C(z) summed over the window, greedy agreement of q'_z with q) for one mask."""
    logits = window_logits(model, calibration, mask)
    cost = float(routing_cost(logits.log_softmax(-1), calibration.target_logprobs, alpha, beta).sum())
    agreement = float((logits.argmax(-1) == calibration.target_argmax).float().mean())
    return cost, agreement


@dataclass(frozen=True)
class SearchConfig:
    ratio: float = 0.45  # r: fraction of units bypassed (ratio_by "units") or of a pass's cost ("compute")
    unit: str = "sublayer"
    ratio_by: str = "units"  # "units": round(r·U) units; "compute": units whose measured cost sums to r of a pass
    budget: int = 100  # S: mask evaluations at most
    bo_every: int = 2  # θ: every θ-th evaluation is a Bayesian-optimisation proposal
    initial_random: int = 8  # random evaluations before the first BO step
    patience: int = 40  # stop when the best has not improved for this many evaluations
    objective: str = "kl"  # "kl" (DIMR) or "agreement" (SWIFT)
    strategy: str = "dimr"  # "dimr" or "random" (random search alone, for comparison)
    alpha: float = 0.0
    beta: float = 1.0
    candidates: int = 512  # masks scored by the acquisition per BO step
    seed: int = 0

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise TierspecError(f"objective must be one of {OBJECTIVES}, got '{self.objective}'")
        if self.strategy not in ("dimr", "random"):
            raise TierspecError(f"strategy must be 'dimr' or 'random', got '{self.strategy}'")
        if not 0.0 < self.ratio < 1.0:
            raise TierspecError(f"ratio must be in (0, 1), got {self.ratio}")
        if self.ratio_by not in ("units", "compute"):
            raise TierspecError(f"ratio_by must be 'units' or 'compute', got '{self.ratio_by}'")
        if self.budget < 1 or self.bo_every < 1:
            raise TierspecError("budget and bo_every must be >= 1")


@dataclass
class SearchResult:
    mask: RoutingMask
    best: Evaluation
    evaluations: list[Evaluation]
    seconds: float

    def random_only(self) -> list[Evaluation]:
        return [e for e in self.evaluations if e.source == "random"]

    def summary(self) -> dict:
        randoms = self.random_only()
        return {
            "best_cost": self.best.cost,
            "best_agreement": self.best.agreement,
            "evaluations": len(self.evaluations),
            "bo_evaluations": len(self.evaluations) - len(randoms),
            "random_best_cost": min(e.cost for e in randoms) if randoms else None,
            "random_mean_cost": float(np.mean([e.cost for e in randoms])) if randoms else None,
            "random_best_agreement": max(e.agreement for e in randoms) if randoms else None,
            "seconds": round(self.seconds, 2),
        }


def _signature(target: LoadedModel, calibration: Calibration, config: SearchConfig, budget=None,
               with_stops: bool = False) -> str:
    """What fixes the sequence of evaluations: not ``budget`` nor ``patience``, which only say when it
    stops (each evaluation is seeded by its position), so a rerun with a larger budget extends it.
    ``with_stops``: the signature progress files had before (both in it), still resumed."""
    weights = None if not isinstance(budget, ComputeBudget) else [round(w, 3) for w in budget.weights]
    settings = {key: value for key, value in asdict(config).items()
                if with_stops or key not in ("budget", "patience")}
    payload = json.dumps({"model": target.identity.to_dict(), "calibration": calibration.digest, "config": settings,
                          "weights": weights}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _resumed(checkpoint: Path, signatures: tuple[str, ...], units: int) -> tuple[list[Evaluation], float, str | None]:
    """The evaluations and seconds a search's progress file holds, and why it cannot be resumed
    (None: it can; then nothing was lost): damaged, or made with other settings (``signatures``:
    this search's, as this version and the one before write it)."""
    try:
        state = json.loads(checkpoint.read_text())
        if not isinstance(state, dict):
            raise ValueError("not a progress record")
        if state.get("signature") not in signatures:
            return [], 0.0, "its evaluations were made with other settings, model or calibration text"
        evaluations = [Evaluation(**e) for e in state["evaluations"]]
        if any(len(e.keep) != units or not set(e.keep) <= {0, 1} for e in evaluations):
            raise ValueError(f"a mask that is not {units} units kept or bypassed")
        return evaluations, float(state.get("seconds", 0.0)), None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
        return [], 0.0, f"damaged ({one_line(error)[:120] or type(error).__name__})"


def search_mask(
    target: LoadedModel,
    calibration: Calibration,
    config: SearchConfig,
    checkpoint: Path | None = None,
    progress: bool = True,
    evaluate: Callable[[RoutingMask], tuple[float, float]] | None = None,
    unit_costs=None,
) -> SearchResult:
    """Run DIMR (or random search) and return the best mask found.

    With ``checkpoint``, every evaluation is saved there (atomically) and a rerun with the same
    model, calibration and config resumes from it.
    """
    from tqdm.auto import tqdm

    num_layers = target.identity.num_layers
    eligible = RoutingMask.eligible_units(num_layers, config.unit)
    if config.ratio_by == "compute":
        # ``unit_costs`` (``costs.UnitCosts``): measured on this machine unless given (tests).
        if unit_costs is None:
            from ..costs import unit_costs as measured_unit_costs

            unit_costs = measured_unit_costs(target)
        weights = tuple(unit_costs.unit_share(kind) for kind, _ in eligible)
        if config.ratio > sum(weights):
            raise TierspecError(f"ratio {config.ratio} of the pass's cost is more than all bypassable units hold "
                                f"({sum(weights):.2f}: the first and last layers and the LM head always run)")
        bypass = ComputeBudget(weights, config.ratio, tolerance=min(weights) / 2)
    else:
        bypass = round(config.ratio * RoutingMask.total_units(num_layers, config.unit))
        if not 0 < bypass <= len(eligible):
            raise TierspecError(
                f"ratio {config.ratio} bypasses {bypass} of {len(eligible)} eligible {config.unit} units; choose another ratio"
            )

    def to_mask(keep: list[int]) -> RoutingMask:
        return RoutingMask.from_units(num_layers, config.unit, [u for u, k in zip(eligible, keep) if not k], model=target.identity)

    evaluate = evaluate or (lambda mask: evaluate_mask(target.model, calibration, mask, config.alpha, config.beta))
    signature = _signature(target, calibration, config, bypass)
    accepted = (signature, _signature(target, calibration, config, bypass, with_stops=True))
    evaluations: list[Evaluation] = []
    seconds_before = 0.0
    if checkpoint is not None and checkpoint.exists():
        evaluations, seconds_before, problem = _resumed(checkpoint, accepted, len(eligible))
        if problem is not None:
            print(f"tierspec: {checkpoint}: {problem}; the search starts over", file=sys.stderr)

    started = time.perf_counter()
    bar = tqdm(total=config.budget, initial=len(evaluations), desc=f"{config.strategy} r={config.ratio} {config.unit}", disable=not progress)
    # where an uninterrupted search would stand after these evaluations (its count without improvement too)
    since_best, best_score = 0, math.inf
    for evaluation in evaluations:
        score = evaluation.score(config.objective)
        best_score, since_best = (score, 0) if score < best_score - 1e-12 else (best_score, since_best + 1)
    while len(evaluations) < config.budget and since_best < config.patience:
        # Seeded by position, so a resumed search continues exactly as an uninterrupted one.
        rng = np.random.default_rng([config.seed, len(evaluations)])
        step = len(evaluations)
        use_bo = config.strategy == "dimr" and step >= config.initial_random and (step - config.initial_random) % config.bo_every == 0
        keep, source = next_keep(evaluations, config.objective, rng, len(eligible), bypass, use_bo, config.candidates,
                                 config.seed)
        cost, agreement = evaluate(to_mask(keep))
        evaluations.append(Evaluation(keep, cost, agreement, source))
        score = evaluations[-1].score(config.objective)
        if score < best_score - 1e-12:
            best_score, since_best = score, 0
        else:
            since_best += 1
        bar.update(1)
        bar.set_postfix(best_cost=f"{min(e.cost for e in evaluations):.3f}")
        if checkpoint is not None:
            state = {
                "signature": signature,
                "evaluations": [asdict(e) for e in evaluations],
                "seconds": seconds_before + time.perf_counter() - started,
            }
            atomic_write_text(checkpoint, json.dumps(state))
    bar.close()
    seconds = seconds_before + time.perf_counter() - started
    best = min(evaluations, key=lambda e: e.score(config.objective))
    mask = to_mask(best.keep)
    result = SearchResult(mask, best, evaluations, seconds)
    info = {
        "objective": config.objective,
        "strategy": config.strategy,
        "cost": best.cost,
        "agreement": best.agreement,
        "alpha": config.alpha,
        "beta": config.beta,
        "evaluations": len(evaluations),
        "seconds": round(seconds, 2),
        "calibration_hash": calibration.digest,
        "ratio_by": config.ratio_by,
        **({"compute_share": round(sum(w for w, k in zip(bypass.weights, best.keep) if not k), 4)}
           if isinstance(bypass, ComputeBudget) else {}),
        "window": calibration.window,
        "search": result.summary(),
    }
    result.mask = RoutingMask(mask.num_layers, mask.unit, mask.skip_attention, mask.skip_mlp, target.identity, info)
    return result
