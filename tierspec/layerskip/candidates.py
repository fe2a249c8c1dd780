"""Proposing routing masks: uniformly random keep-vectors, and Gaussian-process Bayesian
optimisation over evaluated ones. Shared by the offline DIMR search (``search``) and SWIFT's
on-the-fly optimisation (``drafters.swift``); no model code here."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class Evaluation:
    keep: list[int]  # keep-vector over eligible units
    cost: float
    agreement: float
    source: str  # "random" or "bo"

    def score(self, objective: str) -> float:
        """Lower is better for the search, whatever the objective."""
        return self.cost if objective == "kl" else -self.agreement



@dataclass(frozen=True)
class ComputeBudget:
    """A mask bypasses a share of a full pass's *cost*, not a count of units: ``weights[u]`` is
    eligible unit u's share of a full pass (measured, ``costs.UnitCosts``); a mask is feasible
    when its bypassed weights sum to ``share`` ± ``tolerance``. Units of equal weight (one kind:
    attention, MLP) are interchangeable, so a swap within a kind keeps the share exactly."""

    weights: tuple[float, ...]
    share: float
    tolerance: float

    def feasible(self, keep: list[int]) -> bool:
        bypassed = sum(w for w, k in zip(self.weights, keep) if not k)
        return abs(bypassed - self.share) <= self.tolerance + 1e-12

    def draw(self, rng: np.random.Generator) -> list[int] | None:
        """A random feasible keep-vector: units in random order, each bypassed while the share
        stays under the upper bound, until it reaches the lower bound (None if it cannot)."""
        keep = [1] * len(self.weights)
        total = 0.0
        for unit in rng.permutation(len(self.weights)):
            if total + self.weights[unit] <= self.share + self.tolerance:
                keep[unit] = 0
                total += self.weights[unit]
            if total >= self.share - self.tolerance:
                return keep
        return None

    def kinds(self) -> list[float]:
        return [round(w, 9) for w in self.weights]


def random_keep(rng: np.random.Generator, units: int, bypass: "int | ComputeBudget") -> list[int]:
    """A keep-vector over ``units`` eligible units: with an int, exactly ``bypass`` zeros,
    uniformly at random; with a ``ComputeBudget``, a random mask of the budgeted cost share."""
    if isinstance(bypass, ComputeBudget):
        for _ in range(100):
            keep = bypass.draw(rng)
            if keep is not None:
                return keep
        raise ValueError(f"no mask bypasses {bypass.share:.3f} ± {bypass.tolerance:.3f} of the pass's cost")
    keep = np.ones(units, dtype=int)
    keep[rng.choice(units, size=bypass, replace=False)] = 0
    return keep.tolist()


def neighbours(keep: list[int], rng: np.random.Generator, count: int, kinds: list | None = None) -> list[list[int]]:
    """Masks one swap away (bypass a kept unit instead of a bypassed one); with ``kinds``, only
    swaps between units of the same kind (so a compute budget is kept exactly)."""
    keep_arr = np.array(keep)
    labels = np.zeros(len(keep)) if kinds is None else np.array(kinds)
    out = []
    for _ in range(count):
        dropped = np.flatnonzero(keep_arr == 0)
        if not len(dropped):
            break
        out_unit = rng.choice(dropped)
        kept = np.flatnonzero((keep_arr == 1) & (labels == labels[out_unit]))
        if not len(kept):
            continue
        new = keep_arr.copy()
        new[out_unit] = 1
        new[rng.choice(kept)] = 0
        out.append(new.tolist())
    return out


def bo_proposal(evaluations: list[Evaluation], objective: str, rng: np.random.Generator, bypass: "int | ComputeBudget",
                candidates: int = 512, seed: int = 0) -> list[int] | None:
    """The unevaluated candidate with the highest expected improvement under a GP fitted to
    the evaluated (keep-vector, score) pairs."""
    from scipy.stats import norm
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import ConstantKernel, DotProduct, Matern, WhiteKernel

    X = np.array([e.keep for e in evaluations], dtype=float)
    y = np.array([e.score(objective) for e in evaluations])
    units = X.shape[1]
    # A dot-product term models each unit's own contribution (costs are close to additive
    # over bypassed units); the Matérn term models interactions between units.
    kernel = (
        ConstantKernel(1.0) * DotProduct(sigma_0=1.0)
        + ConstantKernel(1.0) * Matern(length_scale=math.sqrt(units), nu=2.5)
        + WhiteKernel(1e-3)
    )
    gp = GaussianProcessRegressor(kernel=kernel, normalize_y=True, random_state=seed)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # convergence chatter on tiny data sets
        gp.fit(X, y)
    seen = {tuple(e.keep) for e in evaluations}
    best_first = sorted(evaluations, key=lambda e: e.score(objective))
    pool = []
    kinds = bypass.kinds() if isinstance(bypass, ComputeBudget) else None
    for e in best_first[:5]:
        pool.extend(neighbours(e.keep, rng, candidates // 10, kinds))
    while len(pool) < candidates:
        pool.append(random_keep(rng, units, bypass))
    pool = [c for c in {tuple(c): c for c in pool}.values() if tuple(c) not in seen]
    if not pool:
        return None
    mean, std = gp.predict(np.array(pool, dtype=float), return_std=True)
    best = y.min()
    std = np.maximum(std, 1e-9)
    z = (best - mean) / std
    expected_improvement = (best - mean) * norm.cdf(z) + std * norm.pdf(z)
    return pool[int(np.argmax(expected_improvement))]


def next_keep(evaluations: list[Evaluation], objective: str, rng: np.random.Generator, units: int,
              bypass: "int | ComputeBudget", use_bo: bool, candidates: int = 512, seed: int = 0) -> tuple[list[int], str]:
    """One step of a mask search (DIMR offline, SWIFT during decoding): the Bayesian proposal
    when ``use_bo`` and the GP has one, else a random keep-vector not evaluated before (up to 100
    draws). Returns (keep-vector, "bo" | "random")."""
    if use_bo:
        keep = bo_proposal(evaluations, objective, rng, bypass, candidates, seed)
        if keep is not None:
            return keep, "bo"
    seen = {tuple(e.keep) for e in evaluations}
    for _ in range(100):
        keep = random_keep(rng, units, bypass)
        if tuple(keep) not in seen:
            break
    return keep, "random"
