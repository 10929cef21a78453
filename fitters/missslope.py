"""Direct estimator of seed 002's miss slope, the bathtub's ``linear`` form (MODEL.md §4, §6).

    TPS_miss(h) = TPS0·(1 - a·h)

Per busy step TPS_miss = ΔM/Δt_busy (miss tokens per busy second, :attr:`Observation.miss_tps`)
against h (:attr:`Observation.hit_ratio`), fitted separately per log2 ISL bucket because a
depends on N. Tail-chunk steps (the last prefill chunk is tiny, TPS_miss dips 20–70 % below the
line, seed 002) are flagged as anomalies and excluded, so they never bend the line.
"""
from __future__ import annotations

import dataclasses
import math
from collections import deque

import numpy as np
from scipy.optimize import least_squares

from .chiptime import robust_sigma
from .observation import Observation
from .result import Estimate, FitResult, Status

# A residual below -ANOMALY_SIGMAS robust σ is a tail-chunk dip (one-sided: only dips are known
# to be structural; a high point is left to the robust loss).
ANOMALY_SIGMAS = 3.5
_MAX_ROUNDS = 10

Bucket = tuple[int, int]


def isl_bucket(isl: float) -> Bucket:
    """The log2 bucket [2^k, 2^(k+1)) holding ``isl`` [tokens] (MODEL.md §4).

    Raises ValueError when isl is not finite or < 1.
    """
    if not (math.isfinite(isl) and isl >= 1):
        raise ValueError(f"isl must be a finite number of tokens ≥ 1, got {isl!r}")
    _, exp = math.frexp(isl)  # isl = m·2^exp with 0.5 ≤ m < 1, exact at powers of two
    return 1 << (exp - 1), 1 << exp


def fit_miss_slope(h: np.ndarray, tps: np.ndarray, min_samples: int = 8, min_h_span: float = 0.1) -> FitResult:
    """Robust line TPS_miss = TPS0·(1 - a·h) through busy steps (MODEL.md §4 ``linear``, §6). Pure.

    Args:
        h: hit ratio per step, shape (n,) [1].
        tps: miss tokens per busy second per step, shape (n,) [tokens/s]. Pairs with a
            non-finite value are ignored.
    Returns a FitResult with params "tps0" [tokens/s] and "a" [1] (a = -b1/b0 of the line
    b0 + b1·h; its stderr by the delta method), covariance 2×2 of (tps0, a) from s²·(JᵀJ)⁻¹ of
    the weighted fit, ``samples`` and (centred, unweighted) ``r2`` over the points kept after
    anomaly exclusion, extra "anomalies" (count), "h_min", "h_max" (over all finite points).
    Method: residuals are relative to the line, (TPS - line)/line, since throughput noise and
    tail-chunk dips are fractions of it. OLS start; then, until the flagged set is stable,
    ``least_squares`` with a soft_l1 loss (f_scale = MAD σ of the kept residuals) on the kept
    points, and every point whose relative residual is below -ANOMALY_SIGMAS·σ is flagged a
    tail-chunk anomaly and excluded.
    Status insufficient_data below ``min_samples`` points (before or after exclusion),
    insufficient_variation when the h span is below ``min_h_span``, else ok.
    Raises ValueError when h and tps differ in shape or are not 1-D.
    """
    return _fit(np.asarray(h, dtype=float), np.asarray(tps, dtype=float), min_samples, min_h_span)[0]


def _fit(h: np.ndarray, tps: np.ndarray, min_samples: int, min_h_span: float) -> tuple[FitResult, np.ndarray]:
    """:func:`fit_miss_slope` plus the anomaly mask over the input points, shape (n,)."""
    if h.ndim != 1 or h.shape != tps.shape:
        raise ValueError(f"h and tps must be 1-D of equal length, got {h.shape} and {tps.shape}")
    anomalies = np.zeros(h.shape, dtype=bool)
    finite = np.isfinite(h) & np.isfinite(tps)
    hf, yf = h[finite], tps[finite]
    checked = _check(hf, min_samples, min_h_span, "")
    if checked is not None:
        return checked, anomalies

    # Median-scaled so the floors below are relative.
    y_scale = float(np.median(np.abs(yf))) or 1.0
    ys = yf / y_scale
    design = np.column_stack([np.ones_like(hf), hf])
    b, *_ = np.linalg.lstsq(design, ys, rcond=None)
    keep = np.ones(hf.shape, dtype=bool)
    for _ in range(_MAX_ROUNDS):
        b = _robust_line(design[keep], ys[keep], b)
        rel = _relative_residuals(design, ys, b)
        flagged = rel < -ANOMALY_SIGMAS * robust_sigma(rel[keep])
        if np.array_equal(flagged, ~keep):
            break
        keep = ~flagged
        if keep.sum() < max(min_samples, 3):
            break  # too few points left to fit a line: reported insufficient_data below
    else:
        b = _robust_line(design[keep], ys[keep], b)  # no fixed point: the line of the last kept set
    anomalies[np.flatnonzero(finite)[~keep]] = True
    n_anom = int((~keep).sum())
    extra = {"anomalies": n_anom, "h_min": float(hf.min()), "h_max": float(hf.max())}

    hk = hf[keep]
    checked = _check(hk, min_samples, min_h_span, f" after excluding {n_anom} tail-chunk anomalies")
    if checked is not None:
        return dataclasses.replace(checked, extra=extra), anomalies
    b0, b1 = b * y_scale
    if b0 <= 0:
        return FitResult(
            Status.NOT_IDENTIFIABLE, "intercept TPS0 ≤ 0: a = -b1/b0 undefined", samples=len(hk), extra=extra
        ), anomalies

    # Weighted LS covariance s²·(JᵀJ)⁻¹ with J the relative-residual Jacobian, in tokens/s units.
    d_k = design[keep]
    jac_w = d_k / _line_floor(d_k @ b)[:, None]
    rel_k = _relative_residuals(d_k, ys[keep], b)
    dof = len(hk) - 2
    s2 = float(rel_k @ rel_k) / dof if dof > 0 else math.nan
    cov_b = s2 * np.linalg.inv(jac_w.T @ jac_w) * y_scale**2
    a = -b1 / b0
    # Delta method for (tps0, a) = (b0, -b1/b0).
    jac = np.array([[1.0, 0.0], [b1 / b0**2, -1.0 / b0]])
    cov = jac @ cov_b @ jac.T
    y_k = yf[keep]
    resid = y_k - (b0 + b1 * hk)
    ss_tot = float(np.sum((y_k - y_k.mean()) ** 2))
    r2 = 1.0 - float(resid @ resid) / ss_tot if ss_tot > 0 else math.nan
    return FitResult(
        status=Status.OK,
        params={
            "tps0": Estimate(value=float(b0), stderr=math.sqrt(max(float(cov[0, 0]), 0.0))),
            "a": Estimate(value=float(a), stderr=math.sqrt(max(float(cov[1, 1]), 0.0))),
        },
        samples=len(hk),
        r2=r2,
        covariance=tuple(tuple(float(v) for v in row) for row in cov),
        extra=extra,
    ), anomalies


def _line_floor(line: np.ndarray) -> np.ndarray:
    """The fitted line (median-scaled), floored so a line crossing 0 cannot blow up a weight."""
    return np.maximum(line, 0.05)


def _relative_residuals(design: np.ndarray, y: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(y - line)/line [1]: throughput noise and tail-chunk dips are fractions of the line."""
    line = _line_floor(design @ b)
    return (y - line) / line


def _robust_line(design: np.ndarray, y: np.ndarray, start: np.ndarray) -> np.ndarray:
    """(b0, b1) of a soft_l1 fit of relative residuals, weights and f_scale (MAD σ) taken at ``start``."""
    w = 1.0 / _line_floor(design @ start)
    dw, yw = design * w[:, None], y * w
    sigma = robust_sigma(dw @ start - yw)
    return least_squares(lambda p: dw @ p - yw, start, jac=lambda p: dw, loss="soft_l1", f_scale=sigma).x


def _check(h: np.ndarray, min_samples: int, min_h_span: float, suffix: str) -> FitResult | None:
    """A failed FitResult when ``h`` is too few or too narrow to fit a line, else None."""
    if len(h) < max(min_samples, 3):
        return FitResult.failed(
            Status.INSUFFICIENT_DATA, f"{len(h)} usable busy steps{suffix}, need at least {min_samples}", len(h)
        )
    span = float(h.max() - h.min())
    if span < min_h_span:
        return FitResult.failed(
            Status.INSUFFICIENT_VARIATION,
            f"h barely moved{suffix}: span {span:.3f} < {min_h_span:.3f}",
            len(h),
        )
    return None


class MissSlopeFitter:
    """Online direct estimator of (TPS0, a) per log2 ISL bucket (MODEL.md §4 ``linear``, §6).

    Memory bound: one ring buffer (``collections.deque(maxlen=capacity_per_bucket)``) of
    (t, h, TPS_miss) per ISL bucket met so far; log2 buckets keep their number small (≤ 24 for
    ISL < 16 Mi tokens), so at most 24 × capacity_per_bucket × 3 floats. Each bucket's fit is
    cached and refitted only when that bucket got new data. Nothing is learned at construction.
    """

    def __init__(self, capacity_per_bucket: int = 512, min_samples: int = 8, min_h_span: float = 0.1) -> None:
        if capacity_per_bucket < 1:
            raise ValueError("capacity_per_bucket must be ≥ 1")
        self.capacity_per_bucket = capacity_per_bucket
        self.min_samples = min_samples
        self.min_h_span = min_h_span
        self._buffers: dict[Bucket, deque[tuple[float, float, float]]] = {}
        self._cache: dict[Bucket, tuple[FitResult, np.ndarray]] = {}
        self._current: Bucket | None = None

    def update(self, obs: Observation) -> bool:
        """Buffer one step; True if usable: busy, no ``anomaly_hint``, h in [0, 1], TPS_miss and
        ISL (≥ 1 token) known and finite."""
        h, tps, isl = obs.hit_ratio, obs.miss_tps, obs.isl
        if not obs.busy or obs.anomaly_hint or h is None or tps is None or isl is None:
            return False
        if not (0.0 <= h <= 1.0 and math.isfinite(tps) and tps >= 0 and math.isfinite(isl) and isl >= 1):
            return False
        bucket = isl_bucket(isl)
        buf = self._buffers.get(bucket)
        if buf is None:
            buf = self._buffers[bucket] = deque(maxlen=self.capacity_per_bucket)
        buf.append((obs.t, h, tps))
        self._cache.pop(bucket, None)
        self._current = bucket
        return True

    def _fitted(self, bucket: Bucket) -> tuple[FitResult, np.ndarray]:
        """(fit, anomaly mask over the bucket's buffer) of one bucket, cached until it gets data."""
        cached = self._cache.get(bucket)
        if cached is not None:
            return cached
        buf = self._buffers.get(bucket)
        if buf:
            data = np.array(buf)
            res, mask = _fit(data[:, 1], data[:, 2], self.min_samples, self.min_h_span)
        else:
            lo, hi = bucket
            res = FitResult.failed(Status.INSUFFICIENT_DATA, f"no usable busy step with ISL in [{lo}, {hi})")
            mask = np.zeros(0, dtype=bool)
        res = dataclasses.replace(res, extra={**res.extra, "isl_bucket_lo": bucket[0], "isl_bucket_hi": bucket[1]})
        self._cache[bucket] = (res, mask)
        return res, mask

    def result(self, isl: float | None = None) -> FitResult:
        """Fit of the ISL bucket of ``isl`` [tokens] (default: the bucket of the latest usable
        step); extra includes "isl_bucket_lo"/"isl_bucket_hi". Raises ValueError for isl < 1."""
        bucket = isl_bucket(isl) if isl is not None else self._current
        if bucket is None:
            return FitResult.failed(Status.INSUFFICIENT_DATA, "no usable busy step yet")
        return self._fitted(bucket)[0]

    def buckets(self) -> dict[Bucket, FitResult]:
        """Fit of every ISL bucket with data, keyed by (lo, hi), ascending."""
        return {b: self._fitted(b)[0] for b in sorted(self._buffers)}

    def anomaly_times(self) -> list[float]:
        """Times ``obs.t`` [s] of the steps flagged as tail-chunk anomalies in the current bucket."""
        if self._current is None:
            return []
        mask = self._fitted(self._current)[1]
        return [t for (t, _, _), flagged in zip(self._buffers[self._current], mask) if flagged]
