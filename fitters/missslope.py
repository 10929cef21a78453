"""Direct estimator of seed 002's miss slope, the bathtub's ``linear`` form (MODEL.md §4, §6).

    TPS_miss(h) = TPS0·(1 - a·h)

Per busy step TPS_miss = ΔM/Δt_busy (miss tokens per busy second, :attr:`Observation.miss_tps`)
against h (:attr:`Observation.hit_ratio`), fitted separately per log2 ISL bucket because a
depends on N, and per log2 OSL bucket because it depends on the decode time per request too
(MODEL.md §7: (T_fixed + decode)/((1-h)·N) per miss token): traffic whose output grew from 128 to
1024 tokens has a = 0.86 where it had 0.50, and in the old traffic's bucket its every step read
as a tail-chunk dip below the old line, which stayed published.

What the line is: TPS_miss(h) is a curve (MODEL.md §7: busy seconds per miss token are
k_ffn + k_attn·N(1+h)/2 + (T_fixed + decode)/((1-h)·N)), and seed 002's line is its linearisation.
a is the slope of the least-squares line through that curve over the observed h range with every
stretch of h counted by its width (MODEL.md §4: the derived a is the same line through the
chip-time curve on evenly spaced h), not by how long the traffic stayed there: the line is a
property of the engine, not of the traffic's h histogram.

Tail chunks (seed 002: at some hit ratios, 20 %, 40 % and 70 % in its measurement, the last
prefill chunk is tiny and TPS_miss is very low) are flagged as anomalies and excluded. They are
flagged against a reference that follows the curve, because against the line the steep end of a
curved TPS_miss(h) looks like a dip too. A tail chunk dips at its h every time: most of a bucket's
newest steps off the reference where its older steps stand on it is traffic that changed inside
the bucket (SHIFT_STEPS), and the bucket starts again from them. A step as far above the
reference and at least twice its throughput is excluded as an outlier (a glitched counter: no
engine serves miss tokens twice as fast as it does at that h; a real engine's steps scatter by
whole prefill chunks, ±20 % on the bundled CPU trace); the line's quadrature would give a lone
step at an h of its own a whole node's weight.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
from scipy.optimize import least_squares, nnls

from .observation import Observation
from .online import REFIT_EVERY, AmortizedFit, LazyFitResult, median, robust_sigma, solve_normal
from .result import Estimate, FitResult, Status, measured

# A step more than ANOMALY_SIGMAS robust σ below the reference curve is a tail-chunk dip; one as
# far above it and at least OUTLIER_RATIO times its throughput is an outlier (dips are structural,
# seed 002; a high point that far is a glitch, where σ of a chunk-quantised trace is tiny).
ANOMALY_SIGMAS = 3.5
OUTLIER_RATIO = 2.0
# The newest SHIFT_STEPS steps of a bucket, SHIFT_SHARE of them off its reference at h nodes where its
# older steps all stand on it: not tail chunks, which dip at their h every time (seed 002), nor a
# reference bent at some h (its older steps there are off too), but traffic that changed inside the
# bucket (OSL 96 → 176 in [91, 181): every new step a dip below the old line, published ok 62σ off
# it for 15 min; ISL 1500 → 2800 in [1448, 2896): every new step above it, kept, the line +23σ off:
# a hostile-traffic review). The bucket starts again from them.
SHIFT_STEPS = 16
SHIFT_SHARE = 0.75
# A line needs steps across its h range: with none over half of it (two tenants at h 0 and 0.8), the
# line is a secant through the steps on either side, a = 0.753 ± 0.001 for the curve's 0.683 (a
# hostile-traffic review), whose shape in the gap no step shows (MODEL.md §4).
MAX_GAP_SHARE = 0.5
# Steps whose h agree to this measure the same point of the curve (one node of the h quadrature).
H_RESOLUTION = 0.01
_NODES = round(1.0 / H_RESOLUTION) + 1  # node indices of h ∈ [0, 1]
_MAX_ROUNDS = 10
MAX_BUCKETS = 32  # ISL and OSL buckets kept per model (MissSlopeFitter): a few in any real traffic
_POLE_FLOOR = 1e-9  # keeps 1 - s·h > 0 at h = 1 (no miss token left: TPS_miss = 0)

Bucket = tuple[int, int]
Key = tuple[Bucket, "Bucket | None"]  # (ISL bucket, OSL bucket; None: OSL unknown)
# solve_normal's (fixed, theta_fixed, lower, upper) for the line (b0, b1): both free, unbounded
_LINE_FREE = (np.zeros(2, dtype=bool), np.zeros(2), np.full(2, -np.inf), np.full(2, np.inf))


def length_bucket(tokens: float) -> Bucket:
    """The bucket [lo, hi) holding a mean length (ISL or OSL) of ``tokens``: one octave centred on a power of two,
    edges round(2^(k ± ½)) (…, 724, 1448, 2896, 5793, …; the first [1, 3)) (MODEL.md §4 "e.g.
    log2 buckets"). Centred, because prompts are so often sized at a power of two: with edges AT
    2^k, traffic of ISL 2048 ± a few tokens split between two buckets, starving both, and its
    window mean flipped the published bucket (a review saw the direct slope withdrawn at a mean
    ISL of 2046.75 on the bundled trace).

    Raises ValueError when tokens is not finite, < 1 or ≥ 2^1000 (an edge beyond a float; parse
    drops values above 1e18).
    """
    if not (math.isfinite(tokens) and 1 <= tokens < 2.0 ** 1000):
        raise ValueError(f"a mean length must be a finite number of tokens in [1, 2^1000), got {tokens!r}")
    k = max(1, round(math.log2(tokens)))  # the nearest power of two; the integer edges decide below
    if tokens >= _edge(k):
        k += 1
    elif k > 1 and tokens < _edge(k - 1):
        k -= 1
    return (1 if k == 1 else _edge(k - 1)), _edge(k)


def _edge(k: int) -> int:
    """Upper edge of the bucket of 2^k: round(2^(k + ½)) tokens."""
    return round(2.0 ** (k + 0.5))


def bucket_key(isl: float, osl: float | None) -> Key:
    """(ISL bucket, OSL bucket) of traffic of mean lengths ``isl``, ``osl`` [tokens]
    (:func:`length_bucket`); the OSL bucket None when ``osl`` is unknown, not finite or below 1
    token. Raises ValueError as :func:`length_bucket` for ``isl``."""
    known = osl is not None and math.isfinite(osl) and 1 <= osl < 2.0 ** 1000
    return length_bucket(isl), (length_bucket(osl) if known else None)


def _key_extra(key: Key) -> dict[str, int]:
    """A bucket's bounds as FitResult extras: "isl_bucket_lo"/"_hi", "osl_bucket_lo"/"_hi" (OSL known)."""
    (lo, hi), osl = key
    return {"isl_bucket_lo": lo, "isl_bucket_hi": hi, **({} if osl is None else {"osl_bucket_lo": osl[0], "osl_bucket_hi": osl[1]})}


def fit_miss_slope(h: np.ndarray, tps: np.ndarray, min_samples: int = 8, min_h_span: float = 0.1) -> FitResult:
    """Line TPS_miss = TPS0·(1 - a·h) through busy steps (MODEL.md §4 ``linear``, §6). Pure.

    Args:
        h: hit ratio per step, shape (n,) [1].
        tps: miss tokens per busy second per step, shape (n,) [tokens/s]. Pairs with a
            non-finite value are ignored.
    Returns a FitResult with params "tps0" [tokens/s] and "a" [1] (a = -b1/b0 of the line
    b0 + b1·h; its stderr by the delta method), covariance 2×2 of (tps0, a), ``samples`` and
    (centred, unweighted) ``r2`` over the points kept after exclusion, extra "anomalies" (count
    of tail-chunk dips), "outliers" (count of points excluded above the reference), "h_min",
    "h_max" (over all finite points).

    Method, in two parts:

    1. Tail chunks. A reference curve that can follow TPS_miss(h) is fitted robustly:
       busy seconds per miss token 1/TPS_miss = B + C·h + A/(1 - s·h), A, B, C ≥ 0, 0 ≤ s ≤ 1.
       With s = 1 it is MODEL.md §7's curve (B: FFN and the h-independent attention per miss
       token, C·h: attention over the cached prefix, A/(1-h): per-request fixed and decode time
       spread over the miss tokens); s < 1 moves the pole past h = 1 so that seed 002's exact
       line (B = C = 0, s = a) is in the family too. Residuals are relative, TPS/curve - 1, since
       throughput noise and dips are fractions of it; soft_l1 loss with f_scale = the MAD σ of
       all points, started from the OLS line or the §7 curve, whichever has the smaller σ. Every
       point below -ANOMALY_SIGMAS·σ (a dip), or above both +ANOMALY_SIGMAS·σ and OUTLIER_RATIO
       times the curve (an outlier), is flagged and the curve refitted without the flagged
       points, until the flagged set is stable. σ is taken over all points, not over the kept
       ones: cutting the low tail would shrink σ round after round and flag ever more.
    2. The line: weighted least squares of TPS_miss on h over the kept points, weight = the h
       quadrature (trapezoid rule over the distinct h, to H_RESOLUTION, each node's width
       shared by its steps: every stretch of the observed h range counts by its width). No
       robust loss here: the line's residuals hold the curve's systematic bend, which is not
       noise, and a throughput is a mean (on a real engine a step's TPS_miss is quantised by
       whole prefills, and a robust loss would pull the line toward the most frequent value).
       Covariance: sandwich estimate with each step's scatter about the reference curve as its
       noise.

    Status insufficient_data below ``min_samples`` points (before or after exclusion),
    insufficient_variation when the h span is below ``min_h_span`` (or H_RESOLUTION), else ok.
    Raises ValueError when h and tps differ in shape or are not 1-D.
    """
    return _robust_fit(np.asarray(h, dtype=float), np.asarray(tps, dtype=float), min_samples, min_h_span)[0]


@dataclasses.dataclass(frozen=True)
class _Reference:
    """The reference curve of a fit (part 1 of :func:`fit_miss_slope`), what a refit freezes
    until the next one (fitters/online.py)."""

    p: np.ndarray  # (A, B, C, s) in units of y_scale
    sigma: float  # robust σ of the relative residuals that flagged the anomalies
    y_scale: float  # the median TPS the reference is scaled by [tokens/s]


def _robust_fit(h: np.ndarray, tps: np.ndarray, min_samples: int, min_h_span: float,
                previous: _Reference | None = None) -> tuple[FitResult, np.ndarray, _Reference | None]:
    """(fit, dip mask, excluded mask (dips and outliers), both shape (n,), and the reference it
    flagged with: None when the fit failed before or after it); ``previous``'s reference is one
    more start, taken when its σ is the smallest."""
    if h.ndim != 1 or h.shape != tps.shape:
        raise ValueError(f"h and tps must be 1-D of equal length, got {h.shape} and {tps.shape}")
    anomalies = np.zeros(h.shape, dtype=bool)
    finite = np.isfinite(h) & np.isfinite(tps)
    hf, yf = h[finite], tps[finite]
    checked = _check(hf, min_samples, min_h_span, "")
    if checked is not None:
        return checked, anomalies, anomalies.copy(), None

    # Median-scaled so that the reference's coefficients are O(1).
    y_scale = median(np.abs(yf)) or 1.0
    ys = yf / y_scale
    starts = _starts(hf, ys)
    if previous is not None:
        # A, B, C are busy seconds per miss token in units of 1/y_scale; s is a pure number.
        starts += (previous.p * np.array([*[y_scale / previous.y_scale] * 3, 1.0]),)
    start = min(starts, key=lambda q: _start_score(q, hf, ys))
    rel = _reference_residuals(start, hf, ys)
    sigma = robust_sigma(rel)
    # soft_l1 grows as √|r|: one point hundreds of times above the rest outweighs them all and
    # the fit slides under them, so the start's outliers above it are left out of the first fit
    first = ~(_flagged(rel, sigma, hf) & (rel > 0))
    if first.sum() < max(min_samples, 3):
        first[:] = True
    p = _fit_reference(hf[first], ys[first], start, sigma)
    keep = np.ones(hf.shape, dtype=bool)
    for _ in range(_MAX_ROUNDS):
        rel = _reference_residuals(p, hf, ys)
        sigma = robust_sigma(rel)
        flagged = _flagged(rel, sigma, hf)
        if np.array_equal(flagged, ~keep):
            break
        keep = ~flagged
        if keep.sum() < max(min_samples, 3):
            break  # too few points left to fit a line: reported insufficient_data below
        p = _fit_reference(hf[keep], ys[keep], p, sigma)
    ref = _Reference(p, sigma, y_scale)
    excluded = np.zeros(h.shape, dtype=bool)
    excluded[finite] = ~keep
    anomalies[finite] = _dips(hf, yf, ~keep, ref)
    res = _line(hf, yf, keep, ref, min_samples, min_h_span)
    # a line withheld for a gap in h keeps its reference: the steps that fill the gap are weighed
    # against it, not each a refit
    return res, anomalies, excluded, ref if res.ok or "gap" in res.extra else None


def _start_score(p: np.ndarray, h: np.ndarray, y: np.ndarray) -> tuple[bool, float]:
    """How a start (A, B, C, s) ranks (lowest first): one that leaves out most points is no
    reference — one glitch far above them pulls the NNLS curve under every other point, whose
    residuals are then ≈ -1 alike, a tiny σ — then the robust σ of its residuals."""
    rel = _reference_residuals(p, h, y)
    sigma = robust_sigma(rel)
    return bool(np.count_nonzero(_flagged(rel, sigma)) > len(rel) / 2), sigma


def _flagged(rel: np.ndarray, sigma: float, h: np.ndarray | None = None) -> np.ndarray:
    """Points (bool, shape of ``rel``) left out against a reference: relative residual below
    -ANOMALY_SIGMAS·σ (a dip), or above ANOMALY_SIGMAS·σ and OUTLIER_RATIO − 1 (an outlier).
    With the points' ``h`` (same shape), no outlier is one of an h node (H_RESOLUTION) of two or
    more points that are all outliers: a glitch is a point, and a whole node far above the
    reference is where the reference went wrong (a sweep cut short: h 0 and 0.25 fitted, 0.5 off
    it), not where the engine did. Dips stay: tail-chunk dips hit every step at their h."""
    high = rel > max(ANOMALY_SIGMAS * sigma, OUTLIER_RATIO - 1.0)
    if h is not None:
        high &= ~_whole_nodes(high, h)
    return (rel < -ANOMALY_SIGMAS * sigma) | high


def _whole_nodes(mask: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Points (bool, shape of ``mask``) of the h nodes of two or more points that ``mask`` holds
    every point of."""
    if not mask.any():
        return mask
    _, node, count = np.unique(_node(h), return_inverse=True, return_counts=True)
    return ((np.bincount(node, weights=mask) == count) & (count >= 2))[node]


def _dips(h: np.ndarray, y: np.ndarray, excluded: np.ndarray, ref: _Reference) -> np.ndarray:
    """The excluded points (bool, shape (n,)) below the reference: tail-chunk dips, not outliers."""
    return excluded & (_reference_residuals(ref.p, h, y / ref.y_scale) < 0)


def _line(h: np.ndarray, y: np.ndarray, keep: np.ndarray, ref: _Reference, min_samples: int,
          min_h_span: float) -> FitResult:
    """Part 2 of :func:`fit_miss_slope`: the line through the ``keep`` points of finite h, y
    (shape (n,)), its sandwich covariance from the scatter about ``ref``; no iteration."""
    n_anom = int(_dips(h, y, ~keep, ref).sum())
    n_out = int(len(keep) - keep.sum()) - n_anom
    extra = {"anomalies": n_anom, "outliers": n_out, "h_min": float(h.min()), "h_max": float(h.max())}
    hk = h[keep]
    # the counts among the measured values: a reason is a label value (kvhit_unknown_info), one series
    excluded = f"; {n_anom} tail-chunk anomalies and {n_out} outliers excluded"
    checked = _check(hk, min_samples, min_h_span, " after excluding tail-chunk anomalies and outliers", excluded)
    if checked is None and _gapped(node := np.unique(_node(hk))):
        k = int(np.argmax(np.diff(node)))
        checked = FitResult.failed(
            Status.INSUFFICIENT_VARIATION,
            "no step in a stretch of h over half its range after excluding tail-chunk anomalies and outliers: a "
            "line through the steps on either side is a secant, not the line through the curve over the range "
            "(MODEL.md §4), whose shape there is unseen"
            + measured(f"none between h {node[k] * H_RESOLUTION:.2f} and {node[k + 1] * H_RESOLUTION:.2f}{excluded}"),
            len(hk))
        extra["gap"] = [float(node[k] * H_RESOLUTION), float(node[k + 1] * H_RESOLUTION)]
    if checked is not None:
        return dataclasses.replace(checked, extra=extra)
    y_k = y[keep]
    w = _h_quadrature(hk)
    design = np.column_stack([np.ones_like(hk), hk])
    xtw_inv = np.linalg.inv(design.T @ (design * w[:, None]))
    b0, b1 = xtw_inv @ (design.T @ (w * y_k))
    if b0 <= 0:
        return FitResult(
            Status.NOT_IDENTIFIABLE, "intercept TPS0 ≤ 0: a = -b1/b0 undefined", samples=len(hk), extra=extra
        )

    # Sandwich covariance of (b0, b1): the noise is each step's scatter about the reference curve,
    # with the dof of the reference's 4 parameters.
    on_curve = ref.y_scale / _reference_cost(ref.p, hk)
    noise = y_k - on_curve
    dof = len(hk) - 4
    meat = design.T @ (design * ((w * noise) ** 2)[:, None])
    cov_b = xtw_inv @ meat @ xtw_inv * (len(hk) / dof if dof > 0 else math.nan)
    a = -b1 / b0
    # Delta method for (tps0, a) = (b0, -b1/b0).
    jac = np.array([[1.0, 0.0], [b1 / b0**2, -1.0 / b0]])
    cov = jac @ cov_b @ jac.T
    bias = _quadrature_bias(design, w, xtw_inv, on_curve, ref)
    if bias is not None:
        cov = cov + np.outer(bias, bias)
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
    )


def _quadrature_bias(design: np.ndarray, w: np.ndarray, xtw_inv: np.ndarray, on_curve: np.ndarray,
                     ref: _Reference) -> np.ndarray | None:
    """(ΔTPS0, Δa) of the line the steps' quadrature weights ``w`` (shape (n,)) give through the
    reference curve, less the line through it on 201 evenly spaced h over the same range (MODEL.md
    §4's line): the error of seeing the curve at these h alone, which the steps' scatter does not
    count; None where either line has TPS0 ≤ 0. ``design``: the steps' (1, h), shape (n, 2);
    ``xtw_inv``: the inverse of their weighted normal matrix (:func:`_line`'s); ``on_curve``: the
    reference curve at their h, shape (n,)."""
    h = design[:, 1]
    grid = np.linspace(h.min(), h.max(), 201)
    trap = np.full(201, grid[1] - grid[0])
    trap[[0, -1]] /= 2.0
    dense = np.column_stack([np.ones_like(grid), grid])
    curve = ref.y_scale / _reference_cost(ref.p, grid)
    out = []
    for b0, b1 in (xtw_inv @ (design.T @ (w * on_curve)),
                   np.linalg.solve(dense.T @ (dense * trap[:, None]), dense.T @ (trap * curve))):
        if not b0 > 0:
            return None
        out.append((b0, -b1 / b0))
    return np.subtract(*out)


def _reference_cost(p: np.ndarray, h: np.ndarray) -> np.ndarray:
    """The reference's busy time per miss token B + C·h + A/(1 - s·h) = 1/TPS, p = (A, B, C, s)."""
    a_, b_, c_, s = p
    return b_ + c_ * h + a_ / np.maximum(1.0 - s * h, _POLE_FLOOR)


def _reference_residuals(p: np.ndarray, h: np.ndarray, y: np.ndarray) -> np.ndarray:
    """TPS/curve - 1 [1] against the reference (linear in A, B, C)."""
    return y * _reference_cost(p, h) - 1.0


def _reference_jacobian(p: np.ndarray, h: np.ndarray, y: np.ndarray) -> np.ndarray:
    """∂ residual / ∂(A, B, C, s), shape (n, 4)."""
    a_, _, _, s = p
    d = np.maximum(1.0 - s * h, _POLE_FLOOR)
    return np.column_stack([y / d, y, y * h, y * a_ * h / d**2])


def _fit_reference(h: np.ndarray, y: np.ndarray, start: np.ndarray, sigma: float) -> np.ndarray:
    """(A, B, C, s) of a soft_l1 fit of the reference with f_scale = ``sigma``, from ``start``."""
    return least_squares(_reference_residuals, start, jac=_reference_jacobian, args=(h, y),
                         bounds=([0.0, 0.0, 0.0, 0.0], [np.inf, np.inf, np.inf, 1.0]),
                         loss="soft_l1", f_scale=sigma).x


def _starts(h: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Starting (A, B, C, s): seed 002's OLS line b0 + b1·h as A/(1 - s·h) with A = 1/b0,
    s = -b1/b0 (clipped to [0, 1]), through the points within 5 MADs of the median TPS (a glitch
    far above them, 200× the median, tilted it so that the fit from it slid under every other
    point); and MODEL.md §7's curve (s = 1) by NNLS."""
    dev = np.abs(y - median(y))
    mad = median(dev)
    near = dev <= 5.0 * mad
    # all points when that leaves one h node: more than half of them at one TPS (MAD 0), or one h
    if not (mad > 0 and np.ptp(h[near]) >= H_RESOLUTION):
        near[:] = True
    b1, b0 = np.polyfit(h[near], y[near], 1)
    b0 = max(float(b0), _POLE_FLOOR)
    line = np.array([1.0 / b0, 0.0, 0.0, min(max(-float(b1) / b0, 0.0), 1.0)])
    design = np.column_stack([1.0 / np.maximum(1.0 - h, _POLE_FLOOR), np.ones_like(h), h]) * y[:, None]
    curve = np.append(nnls(design, np.ones_like(h))[0], 1.0)
    return line, curve


def _node(h: np.ndarray) -> np.ndarray:
    """Index of each h's node of the quadrature (int, shape of ``h``): h rounded to H_RESOLUTION."""
    return np.floor(h / H_RESOLUTION + 0.5).astype(int)


def _h_quadrature(h: np.ndarray) -> np.ndarray:
    """Weight per step, shape (n,): the trapezoid rule over the distinct h (nodes H_RESOLUTION
    apart, at the mean h of their steps) gives each node half the h distance to each neighbour;
    its steps share it. Σ weights = h range spanned by the nodes."""
    _, inv, count = np.unique(_node(h), return_inverse=True, return_counts=True)
    centre = np.bincount(inv, weights=h) / count
    half_gap = np.diff(centre) / 2.0
    width = np.zeros(len(centre))
    width[:-1] += half_gap
    width[1:] += half_gap
    return (width / count)[inv]


def _check(h: np.ndarray, min_samples: int, min_h_span: float, suffix: str, note: str = "") -> FitResult | None:
    """A failed FitResult when ``h`` is too few or too narrow to fit a line, else None; ``suffix``
    ends the reason's words, ``note`` its measured values."""
    if len(h) < max(min_samples, 3):
        return FitResult.failed(
            Status.INSUFFICIENT_DATA, f"too few usable busy steps{suffix}, need at least {min_samples}"
            + measured(f"{len(h)} steps{note}"), len(h)
        )
    span = float(h.max() - h.min())
    need = max(min_h_span, H_RESOLUTION)  # two nodes of the h quadrature at least
    if span < need:
        return FitResult.failed(
            Status.INSUFFICIENT_VARIATION,
            f"h barely moved{suffix}: its span is below {need:.3f}" + measured(f"span {span:.3f}{note}"),
            len(h),
        )
    return None


def _gapped(node: np.ndarray) -> bool:
    """Whether ascending h nodes (:func:`_node`, ≥ 2 distinct) leave a gap over MAX_GAP_SHARE of their range."""
    return bool(np.max(np.diff(node)) > MAX_GAP_SHARE * (node[-1] - node[0]))


class _BucketFit(AmortizedFit[_Reference, tuple[FitResult, np.ndarray]]):
    """One ISL and OSL bucket's rows (t [s], h [1], TPS_miss [tokens/s]) and its amortized fit
    (fitters/online.py): a refit is :func:`_robust_fit`; the frozen weight of a row is 1 when it
    is kept, 0 when flagged against the refit's reference (a new row: flagged when more than
    ANOMALY_SIGMAS of the refit's σ below that reference, or above it and OUTLIER_RATIO times it);
    in between, the exact step is the line of :func:`fit_miss_slope` over the kept rows (it has no robust loss, so that is the whole
    fit) with the sandwich covariance about the frozen reference. The line comes from running
    sums per node of the h quadrature (:class:`~fitters.online.GramSums` of (1, h, TPS) over the
    kept rows, one group per node): a node's centre is Σh/count and its weight width/count, so the
    quadrature-weighted normal equations are Σ_node width/count·sums (O(nodes), not O(n)); the
    result's statistics are computed by :func:`_line` when first read
    (:class:`~fitters.online.LazyFitResult`)."""

    def __init__(self, key: Key, capacity: int, min_samples: int, min_h_span: float, every: int) -> None:
        super().__init__(capacity, 3, every, basis_width=3, groups=_NODES)
        self.min_samples, self.min_h_span = min_samples, min_h_span
        self._extra = _key_extra(key)
        self._shift_checked = -1  # rows.appended when shifted() last looked

    def _with_bucket(self, res: FitResult) -> FitResult:
        return dataclasses.replace(res, extra={**res.extra, **self._extra})

    def _refit(self, x: np.ndarray, key: object,
               previous: _Reference | None) -> tuple[tuple[FitResult, np.ndarray], _Reference | None, np.ndarray]:
        res, dips, excluded, ref = _robust_fit(x[:, 1], x[:, 2], self.min_samples, self.min_h_span, previous)
        return (self._with_bucket(res), dips), ref, (~excluded).astype(float)

    def _weigh(self, x: np.ndarray, v: np.ndarray, key: object, ref: _Reference) -> np.ndarray:
        rel = _reference_residuals(ref.p, x[:, 1], x[:, 2] / ref.y_scale)
        return (~_flagged(rel, ref.sigma)).astype(float)

    def _basis(self, x: np.ndarray, ref: _Reference) -> tuple[np.ndarray, float, np.ndarray]:
        h = x[:, 1]
        v = np.empty((len(x), 3))  # (1, h, TPS), filled in place: column_stack's per-call cost on one row
        v[:, 0] = 1.0
        v[:, 1:] = x[:, 1:3]
        return v, 1.0, _node(h)

    def _exact(self, x: np.ndarray, w: np.ndarray, key: object,
               ref: _Reference) -> tuple[FitResult, np.ndarray] | None:
        keep = w > 0.5
        if _check(x[keep, 1], self.min_samples, self.min_h_span, "") is not None:
            return None
        # New rows are weighed one by one against the frozen reference: a whole h node left out
        # above it, or two or more new steps left out at a node the refit left nothing out of, may
        # be where the reference went wrong (_flagged), which only a refit can tell from tail-chunk
        # dips; a dip node the refit saw stays out without another.
        h, y = x[:, 1].copy(), x[:, 2].copy()
        dips = np.zeros(len(x), dtype=bool)
        if not keep.all():
            dips = _dips(h, y, ~keep, ref)
            if _whole_nodes(~keep & ~dips, h).any():
                return None
            old = len(x) - min(self.rows.appended - self._refit_at, len(x))  # rows before: the refit's
            if np.count_nonzero(~keep[old:]) >= 2:
                node = _node(h)  # in [0, _NODES): update() takes 0 ≤ h ≤ 1 only
                fresh = np.bincount(node[old:][~keep[old:]], minlength=_NODES)
                if np.any((fresh >= 2) & (np.bincount(node[:old][~keep[:old]], minlength=_NODES) == 0)):
                    return None
        res = LazyFitResult(lambda: self._with_bucket(_line(h, y, keep, ref, self.min_samples, self.min_h_span)))
        g = self.sums.g
        nodes = np.flatnonzero(g[:, 0, 0] > 0.5)  # counts are exact integers
        if _gapped(nodes):
            return res, dips  # no line: _line says why, the frozen reference stands (no refit per row)
        sums, count = g[nodes], g[nodes, 0, 0]
        half_gap = np.diff(sums[:, 0, 1] / count) / 2.0  # between the nodes' mean h
        width = np.zeros(len(nodes))
        width[:-1] += half_gap
        width[1:] += half_gap
        # Σ_node width/count·sums: tensordot(…, axes=1)'s own dot, without its per-call cost
        m = np.dot((width / count)[None], sums.reshape(len(nodes), 9)).reshape(3, 3)
        sol = solve_normal(m[:2, :2], m[:2, 2], *_LINE_FREE)
        if sol is None or sol[0] <= 0:
            return None  # TPS0 ≤ 0: not identifiable, refit
        return res, dips

    def shifted(self) -> np.ndarray | None:
        """When SHIFT_SHARE of the newest SHIFT_STEPS rows are off the frozen reference (more than
        ANOMALY_SIGMAS of its σ below or above it) at h nodes where every older row is on it, the
        older rows on more h nodes than the reference has parameters (4): the
        rows (t, h, TPS_miss) from the first of those on, shape (k, 3) (the steps before it are the
        old traffic's); else None. Checked once per new row."""
        if self._shift_checked == self.rows.appended:
            return None
        self._shift_checked = self.rows.appended
        data, ref = self.rows.view(), self._state
        old = len(data) - SHIFT_STEPS
        if old < SHIFT_STEPS or ref is None:
            return None
        def off_reference(rows: slice) -> np.ndarray:  # a nan residual too
            return ~(np.abs(_reference_residuals(ref.p, data[rows, 1], data[rows, 2] / ref.y_scale))
                     <= ANOMALY_SIGMAS * ref.sigma)
        newest = off_reference(slice(old, None))
        if np.count_nonzero(newest) < SHIFT_SHARE * SHIFT_STEPS:  # the cheap test of every new row
            return None
        node = _node(data[:, 1])
        # on no more h nodes than the reference's 4 parameters, the curve runs through each node's
        # steps and its σ is their scatter alone: an engine's drift within a phase read as a change
        # (a live calibration's 25-s phases at h 0 and 0.31, then 0.31 and 0.59: the bucket kept
        # h 0.59-0.94 alone and withheld its line for the gap)
        if len(np.unique(node[:old])) <= len(ref.p):
            return None
        off = np.concatenate([off_reference(slice(None, old)), newest])
        clean = (np.bincount(node[:old][~off[:old]], minlength=_NODES) > 0) & \
            (np.bincount(node[:old][off[:old]], minlength=_NODES) == 0)
        changed = off[old:] & clean[node[old:]]
        if np.count_nonzero(changed) < SHIFT_SHARE * SHIFT_STEPS:
            return None
        return data[old + int(np.argmax(changed)):, :3].copy()


class MissSlopeFitter:
    """Online direct estimator of (TPS0, a) per log2 ISL and OSL bucket (MODEL.md §4 ``linear``, §6).

    Memory bound: one :class:`~fitters.online.RowBuffer` of the last ``capacity_per_bucket``
    (t, h, TPS_miss) rows per ISL and OSL bucket (:func:`bucket_key`) met so far (4 floats each
    with the frozen weight, 2·capacity rows of storage), for the MAX_BUCKETS buckets that got a
    step last (log2 buckets keep their number small; the one longest without a step goes first).
    Each bucket's fit is amortized (fitters/online.py, ``every`` rows between robust
    refits; :class:`_BucketFit`) and cached until that bucket gets data. Nothing is learned at
    construction. Raises ValueError for capacity_per_bucket < 1 or every < 1.
    """

    def __init__(self, capacity_per_bucket: int = 512, min_samples: int = 8, min_h_span: float = 0.1,
                 every: int = REFIT_EVERY) -> None:
        if capacity_per_bucket < 1:
            raise ValueError("capacity_per_bucket must be ≥ 1")
        if every < 1:
            raise ValueError("every must be ≥ 1")
        self.capacity_per_bucket = capacity_per_bucket
        self.min_samples = min_samples
        self.min_h_span = min_h_span
        self.every = every
        self._buckets: dict[Key, _BucketFit] = {}  # the one that got a step last, last
        self._current: Key | None = None

    def update(self, obs: Observation) -> bool:
        """Buffer one step; True if usable: busy, no ``anomaly_hint``, h in [0, 1], TPS_miss and
        ISL (≥ 1 token) known and finite (an OSL unknown or below 1 token: the bucket of unknown OSL)."""
        h, tps, isl = obs.hit_ratio, obs.miss_tps, obs.isl
        if not obs.busy or obs.anomaly_hint or h is None or tps is None or isl is None:
            return False
        if not (0.0 <= h <= 1.0 and math.isfinite(tps) and tps >= 0 and math.isfinite(isl) and isl >= 1):
            return False
        key = bucket_key(isl, obs.osl)
        fit = self._buckets.pop(key, None)
        if fit is None:
            fit = _BucketFit(key, self.capacity_per_bucket, self.min_samples, self.min_h_span, self.every)
            if len(self._buckets) >= MAX_BUCKETS:
                del self._buckets[next(iter(self._buckets))]
        self._buckets[key] = fit
        fit.append((obs.t, h, tps))
        self._current = key
        return True

    def _fitted(self, key: Key) -> tuple[FitResult, np.ndarray]:
        """(fit, anomaly mask over the bucket's buffer) of one bucket, cached until it gets data; a
        bucket whose traffic changed (:meth:`_BucketFit.shifted`) starts again from its newest steps."""
        fit = self._buckets.get(key)
        if fit is None:
            (lo, hi), osl = key
            res = FitResult.failed(Status.INSUFFICIENT_DATA, f"no usable busy step with ISL in [{lo}, {hi}) and "
                                   + ("OSL unknown" if osl is None else f"OSL in [{osl[0]}, {osl[1]})"))
            return dataclasses.replace(res, extra=_key_extra(key)), np.zeros(0, dtype=bool)
        out = fit.solve()
        newest = fit.shifted()
        if newest is None:
            return out
        fresh = self._buckets[key] = _BucketFit(key, self.capacity_per_bucket, self.min_samples, self.min_h_span,
                                                self.every)
        for row in newest.tolist():
            fresh.append(row)
        return fresh.solve()

    def result(self, isl: float | None = None, osl: float | None = None) -> FitResult:
        """Fit of the bucket of ``isl`` and ``osl`` [tokens] (:func:`bucket_key`; without ``isl``,
        or without a known ``osl`` when the latest usable step has this ISL bucket: the latest usable
        step's bucket); extra includes "isl_bucket_lo"/"isl_bucket_hi" and, where the OSL is known,
        "osl_bucket_lo"/"osl_bucket_hi". Raises ValueError for isl < 1."""
        key = self._key(isl, osl)
        if key is None:
            return FitResult.failed(Status.INSUFFICIENT_DATA, "no usable busy step yet")
        return self._fitted(key)[0]

    def _key(self, isl: float | None, osl: float | None) -> Key | None:
        """The bucket :meth:`result` reads for ``isl`` and ``osl``; None before a usable step."""
        key = bucket_key(isl, osl) if isl is not None else self._current
        if key is not None and key[1] is None and self._current is not None and self._current[0] == key[0]:
            key = self._current  # an OSL not known now (a window's histogram unreadable): the latest step's, of this ISL
        return key

    def buckets(self) -> dict[Key, FitResult]:
        """Fit of every bucket with data, keyed by (ISL (lo, hi), OSL (lo, hi) or None), ascending."""
        return {k: self._fitted(k)[0] for k in sorted(self._buckets, key=lambda k: (k[0], k[1] or (0, 0)))}

    def h_range(self) -> tuple[float, float] | None:
        """(lowest, highest) h [1] of the usable steps held in every bucket, None without one."""
        hs = [fit.rows.view()[:, 1] for fit in self._buckets.values() if len(fit)]
        return (float(min(h.min() for h in hs)), float(max(h.max() for h in hs))) if hs else None

    def anomaly_times(self, isl: float | None = None, osl: float | None = None) -> list[float]:
        """Times ``obs.t`` [s] of the steps flagged as tail-chunk anomalies in the bucket
        :meth:`result` reads for ``isl`` and ``osl`` [tokens] (the same defaults); [] for a
        bucket without data."""
        key = self._key(isl, osl)
        if key not in self._buckets:
            return []
        mask = self._fitted(key)[1]
        return self._buckets[key].rows.view()[mask, 0].tolist()
