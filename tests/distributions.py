"""Chi-square checks of sampled tokens against an exact distribution, shared by the tests of every
rule that must give the target's law."""

from __future__ import annotations

import torch
from scipy.stats import chi2


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    if (counts[~keep] > 0).any():
        return 0.0
    stat = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    return float(chi2.sf(stat, int(keep.sum()) - 1))


def pooled_chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, least: float = 5.0) -> float:
    """``chi_square_p_value`` with the cells expecting fewer than ``least`` samples pooled into one
    (the test needs a few expected samples per cell)."""
    big = probs * counts.sum() >= least
    return chi_square_p_value(torch.cat([counts[big], counts[~big].sum()[None]]),
                              torch.cat([probs[big], probs[~big].sum()[None]]))
