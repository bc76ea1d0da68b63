"""Bootstrap confidence intervals, drawn by ``scipy.stats.bootstrap`` (percentile method).

The unit of resampling is whatever the caller passes one row per: for quality, one row per
document (tokens inside a document share a topic and a growing context, so they are not
independent; separate pydoc topics are close enough to independent); for sampled generation,
one row per prompt (its seeds averaged inside the row); for timing, one row per repeat.

Statistics of the form sum(num) / sum(den) over units (mean NLL per token, mean KL per token,
top-1 agreement rate, perplexity = exp(mean NLL)) are bootstrapped exactly as they are
computed: each replicate draws units with replacement, and the ratio is taken of the sums over
the drawn units. The arrays of one statistic are resampled together (``paired=True``: the same
unit indices for num and den), and paired differences (a format against the reference on the
same documents) use the same draw for both sides, so document difficulty cancels. Draws depend
only on (number of units, n_boot, seed), so statistics computed with the same seed over the
same units share their replicates.

Intervals are percentile intervals (the 2.5th and 97.5th percentiles of the replicates for
95%, linearly interpolated); replicates that are not finite (a zero denominator) are left out
and ``CI.n_boot`` counts those kept.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class CI:
    point: float  # the statistic on the original sample
    lo: float
    hi: float
    level: float = 0.95
    n_units: int = 0
    n_boot: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def fmt(self, digits: int = 3, scale: float = 1.0, signed: bool = False, kind: str = "f") -> str:
        """'point [lo, hi]'; kind "f" (fixed) or "e" (scientific)."""
        s = "+" if signed else ""
        p, lo, hi = self.point * scale, self.lo * scale, self.hi * scale
        return f"{p:{s}.{digits}{kind}} [{lo:{s}.{digits}{kind}}, {hi:{s}.{digits}{kind}}]"


def resample_weights(n_units: int, n_boot: int = 2000, seed: int = 0) -> np.ndarray:
    """float64 [n_boot, n_units]: how many times each unit is drawn in each replicate.

    Explicit replicate counts for ``ratio_ci(weights=...)``; the intervals of this module
    draw their own replicates with ``scipy.stats.bootstrap`` and do not use these.
    """
    if n_units < 1:
        raise ValueError("need at least one unit to bootstrap")
    rng = np.random.default_rng(seed)
    return rng.multinomial(n_units, np.full(n_units, 1.0 / n_units), size=n_boot).astype(np.float64)


def _percentiles(point: float, reps: np.ndarray, level: float, n_units: int) -> CI:
    """Percentile interval of the finite replicates (numpy's linear quantiles, as scipy's)."""
    alpha = (1.0 - level) / 2.0
    reps = reps[np.isfinite(reps)]
    lo, hi = np.quantile(reps, [alpha, 1.0 - alpha]) if len(reps) else (np.nan, np.nan)
    return CI(float(point), float(lo), float(hi), level, n_units, int(len(reps)))


def _scipy_ci(data: tuple, statistic, point: float, n_boot: int, seed: int, level: float,
              vectorized: bool = True) -> CI:
    """Percentile bootstrap of statistic(*data) with the units (last axis) drawn jointly."""
    from scipy.stats import bootstrap  # imported here: the CLI's --help stays fast

    n = len(data[0])
    if n < 1:
        raise ValueError("need at least one unit to bootstrap")
    if n == 1:  # scipy wants two units; one unit resamples only to itself
        return CI(float(point), float(point), float(point), level, 1, n_boot)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        res = bootstrap(data, statistic, n_resamples=n_boot, paired=True, vectorized=vectorized,
                        confidence_level=level, method="percentile", rng=np.random.default_rng(seed))
    reps = np.asarray(res.bootstrap_distribution, np.float64)
    if np.isfinite(reps).all():
        ci = res.confidence_interval
        return CI(float(point), float(ci.low), float(ci.high), level, n, n_boot)
    return _percentiles(point, reps, level, n)


def ratio_ci(num, den, n_boot: int = 2000, seed: int = 0, level: float = 0.95,
             transform: Callable[[np.ndarray], np.ndarray] | None = None, weights: np.ndarray | None = None) -> CI:
    """CI of transform(sum(num) / sum(den)); num, den [n_units] (per-unit sums).

    weights: optional replicate counts [n_boot, n_units] (e.g. ``resample_weights``) to use
    instead of drawing; then n_boot and seed are ignored.
    """
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    if num.shape != den.shape or num.ndim != 1:
        raise ValueError(f"num and den must be 1-D of the same length, got {num.shape} and {den.shape}")
    if len(num) < 1:
        raise ValueError("need at least one unit to bootstrap")
    f = transform or (lambda x: x)
    point = float(f(num.sum() / den.sum()))
    if weights is not None:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return _percentiles(point, f((weights @ num) / (weights @ den)), level, len(num))

    def statistic(n, d, axis=-1):
        return f(n.sum(axis) / d.sum(axis))

    return _scipy_ci((num, den), statistic, point, n_boot, seed, level)


def mean_ci(x, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> CI:
    """CI of the mean of per-unit values x [n_units]."""
    x = np.asarray(x, np.float64)
    return ratio_ci(x, np.ones_like(x), n_boot, seed, level)


def paired_ratio_diff_ci(num_a, num_b, den, n_boot: int = 2000, seed: int = 0, level: float = 0.95,
                         transform: Callable[[np.ndarray], np.ndarray] | None = None) -> CI:
    """CI of transform(sum(num_a)/sum(den)) - transform(sum(num_b)/sum(den)), paired by unit.

    E.g. perplexity of a format minus perplexity of the reference on the same documents:
    num_a, num_b = per-document NLL sums, den = per-document token counts, transform = exp.
    """
    a, b, d = (np.asarray(x, np.float64) for x in (num_a, num_b, den))
    f = transform or (lambda x: x)

    def statistic(a, b, d, axis=-1):
        dd = d.sum(axis)
        return f(a.sum(axis) / dd) - f(b.sum(axis) / dd)

    point = float(f(a.sum() / d.sum()) - f(b.sum() / d.sum()))
    return _scipy_ci((a, b, d), statistic, point, n_boot, seed, level)


def bootstrap_ci(units, statistic: Callable[[np.ndarray], float], n_boot: int = 2000, seed: int = 0,
                 level: float = 0.95) -> CI:
    """Generic (slow) bootstrap: statistic(units[idx]) over resampled index sets; units [n, ...]."""
    units = np.asarray(units)
    return _scipy_ci((np.arange(len(units)),), lambda idx: statistic(units[idx]), float(statistic(units)),
                     n_boot, seed, level, vectorized=False)


__all__ = ["CI", "bootstrap_ci", "mean_ci", "paired_ratio_diff_ci", "ratio_ci", "resample_weights"]
