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



def random_keep(rng: np.random.Generator, units: int, bypass: int) -> list[int]:
    """A keep-vector over ``units`` eligible units with exactly ``bypass`` zeros, uniformly at random."""
    keep = np.ones(units, dtype=int)
    keep[rng.choice(units, size=bypass, replace=False)] = 0
    return keep.tolist()


def neighbours(keep: list[int], rng: np.random.Generator, count: int) -> list[list[int]]:
    """Masks one swap away (bypass a kept unit instead of a bypassed one)."""
    keep_arr = np.array(keep)
    kept, dropped = np.flatnonzero(keep_arr == 1), np.flatnonzero(keep_arr == 0)
    out = []
    for _ in range(count):
        if not len(kept) or not len(dropped):
            break
        new = keep_arr.copy()
        new[rng.choice(dropped)] = 1
        new[rng.choice(kept)] = 0
        out.append(new.tolist())
    return out


def bo_proposal(evaluations: list[Evaluation], objective: str, rng: np.random.Generator, bypass: int,
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
    for e in best_first[:5]:
        pool.extend(neighbours(e.keep, rng, candidates // 10))
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
