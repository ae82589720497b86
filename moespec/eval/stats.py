"""Uncertainty of a task accuracy, and of the difference between two arms on the same items.

- 95 % confidence interval of a mean: percentile bootstrap over items (``BOOTSTRAP`` resamples, a
  fixed seed, so a report is reproducible).
- Δ of an arm vs exact on the same items: the mean paired difference, its percentile-bootstrap
  interval (items resampled together in both arms), and the exact McNemar test, a two-sided binomial
  test on the discordant items (right in one arm only): with scores of 0/1 nothing else changes Δ.
  For scores that are not 0/1 the p-value is a paired sign-flip permutation test instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

BOOTSTRAP = 10_000
SEED = 0


@dataclass(frozen=True)
class Interval:
    """A value and its 95 % interval."""

    value: float
    low: float
    high: float


@dataclass(frozen=True)
class Paired:
    """An arm vs exact on the same items: Δ (arm − exact) with its interval, McNemar's p, and the
    discordant counts (``gained``: right only in the arm; ``lost``: right only in exact)."""

    delta: Interval
    p_value: float
    gained: int
    lost: int


def _resample_means(values: torch.Tensor, seed: int = SEED) -> torch.Tensor:
    """Means of ``BOOTSTRAP`` resamples (with replacement) of ``values`` [N] (float64) -> [B]."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, values.numel(), (BOOTSTRAP, values.numel()), generator=g)  # [B, N]
    return values[idx].mean(dim=1)


def _percentiles(means: torch.Tensor) -> tuple[float, float]:
    q = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=means.dtype))
    return float(q[0]), float(q[1])


def mean_interval(scores: Sequence[float]) -> Interval:
    """Mean of per-item ``scores`` and its 95 % percentile-bootstrap interval (a point when n < 2)."""
    v = torch.tensor(list(scores), dtype=torch.float64)
    mean = float(v.mean())
    if v.numel() < 2:
        return Interval(mean, mean, mean)
    return Interval(mean, *_percentiles(_resample_means(v)))


def mcnemar_p(gained: int, lost: int) -> float:
    """Two-sided exact McNemar p-value: P(a split at least as uneven as gained:lost | n discordant, p = 1/2)."""
    n = gained + lost
    if n == 0:
        return 1.0
    k = min(gained, lost)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def _sign_flip_p(diff: torch.Tensor, seed: int = SEED) -> float:
    """Paired permutation test of mean(diff) = 0 by random sign flips (``BOOTSTRAP`` draws)."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (BOOTSTRAP, diff.numel()), generator=g, dtype=torch.float64) * 2 - 1  # [B, N]
    null = (signs * diff).mean(dim=1).abs()
    return float(((null >= abs(float(diff.mean())) - 1e-12).sum() + 1) / (BOOTSTRAP + 1))


def paired(arm: Sequence[float], exact: Sequence[float]) -> Paired:
    """Δ = mean(arm − exact) over the same items (equal lengths), its interval and p-value.

    Raises:
        ValueError: the two lists differ in length.
    """
    if len(arm) != len(exact):
        raise ValueError(f"paired scores need the same items: {len(arm)} vs {len(exact)}")
    a = torch.tensor(list(arm), dtype=torch.float64)
    b = torch.tensor(list(exact), dtype=torch.float64)
    diff = a - b  # [N]
    gained, lost = int((diff > 0).sum()), int((diff < 0).sum())
    delta = float(diff.mean()) if diff.numel() else 0.0
    interval = Interval(delta, *_percentiles(_resample_means(diff))) if diff.numel() > 1 else Interval(delta, delta, delta)
    binary = bool(((a == 0) | (a == 1)).all() and ((b == 0) | (b == 1)).all())
    p = mcnemar_p(gained, lost) if binary else _sign_flip_p(diff)
    return Paired(interval, p, gained, lost)
