"""Load-aware prefill latency and the load/compute overlap α (MODEL.md §3.2, §6, §7 last paragraph).

Chip time (§7) is what the hardware spends on a request; latency is a second layer on top of it.
Per request, the prefill latency under load is modelled as

    L_prefill(h) = c(running)·P_chip(h) + T_load − α·min(T_load, T_compute)

with
    P_chip(h)   = T_fixed_prefill + T_compute(h)                 unloaded prefill chip time [s]
    T_fixed_prefill = coef.t_step                                  one engine step [s]
    T_compute(h) = k_ffn·M + k_attn·(M·H + M²/2)                   coef.compute_time(isl, h) [s]
    c(running)  = c0 + c1·running                                  contention factor, c0, c1 ≥ 0 [1]
    T_load      = h_load·ISL·S_kv / B_load                         model.load_time [s]
    α ∈ [0, 1]                                                     share of min(T_load, T_compute)
                                                                   hidden by overlap [1]

The loaded KV transfer is not multiplied by c: it runs on the host→HBM link, not on the shared
chip. Only (1−α)·T_load is visible in latency (busy time cannot see an asynchronous load), so α
is fitted here, on window-mean ``request_prefill_time_seconds`` in steps with h_load > 0
(MODEL.md §3.2) and is conditional on the B_load passed in — the caller publishes whether that
bandwidth was measured or configured.

The model is linear in (c0, c1, α):

    y − T_load = c0·P + c1·P·r − α·m,    y = prefill_time_mean, r = running, m = min(T_load, T_compute)

and is fitted by soft-L1 least squares (bounds c0, c1 ≥ 0, 0 ≤ α ≤ 1; the minimum
``scipy.optimize.least_squares`` finds, found by :func:`fitters.online.bounded_lsq`), each step
weighted by its number of finished requests (the variance of a window mean falls like 1/n). The chip-time coefficients are inputs, not fitted here: they come from the chip-time
fit (fitters/chiptime.py) and change as it converges, so :class:`LatencyFitter` keeps the raw
samples and refits from them with whichever coefficients it is given. Their errors are not
this fit's to ignore: given their covariance, the standard errors of (c0, c1, α) add what it
moves them by (:func:`_first_stage`; on the simulator's sweep, α's first published value was
0.35 ± 0.035 for a true 0.5 without it, 0.35 ± 0.12 with it).

Two published TTFTs come out of this module (MODEL.md §7):
- ``kind="service"``: :func:`service_ttft`, the seed's unloaded TTFT from chip time (c ≡ 1).
- ``kind="load_aware"``: :func:`predict_prefill_latency` (add the observed queue time for TTFT).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from fitters.chiptime import octaves
from fitters.model import (ChipTimeCoefficients, attention_work, chip_time_regressors, load_time, overlap_time,
                           ttft_unified)
from fitters.observation import Observation
from fitters.online import (REFIT_EVERY, AmortizedFit, LazyFitResult, Shift, ShiftTest, bounded_lsq, frozen_wls,
                            median, shared, soft_l1_weight, solve_normal)
from fitters.result import Z95, Estimate, FitResult, Status, measured

__all__ = [
    "LatencySample",
    "LatencyFitter",
    "fit_latency",
    "predict_prefill_latency",
    "service_ttft",
    "service_ttft_gradient",
    "REASON_NO_LOADED_HITS",
    "SHIFT_REASON",
]

REASON_NO_LOADED_HITS = "no loaded hits (h_load = 0 in every step): α cannot be seen"

# 1 − R² of a regressor against the others (columns scaled to unit norm) below which it is
# treated as collinear: its coefficient would be pure noise.
_COLLINEAR_TOL = 1e-10
# Relative spread of num_requests_running below which it "never varied".
_RUNNING_TOL = 1e-9


# --- samples ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LatencySample:
    """The numbers of one step that the latency fit needs (MODEL.md §2, §3.2, §7).

    Attributes:
        t: unix time of the step's later scrape [s].
        y: mean ``request_prefill_time_seconds`` of the requests finished in the step [s].
        isl: mean prompt length N in the step [tokens].
        h: token-level hit ratio h = h_dev + h_load [1].
        h_load: loaded (connector/offload) hit ratio, a fraction of queried tokens [1].
        running: mean ``num_requests_running`` of the step's two scrapes [1].
        weight: requests finished in the step (> 0), the weight of its mean [1].
    """

    t: float
    y: float
    isl: float
    h: float
    h_load: float
    running: float
    weight: float

    @classmethod
    def from_observation(cls, obs: Observation) -> "LatencySample | None":
        """Build a sample from one step, or None when the step cannot inform the fit.

        None unless ``requests_finished`` > 0 and ``prefill_time_mean``, ``hit_ratio``,
        ``hit_ratio_loaded``, ``isl`` and ``running`` are all known and finite, and the step
        carries no ``anomaly_hint``. Physically impossible values are also rejected rather than
        clipped: y < 0, isl ≤ 0, h outside [0, 1], h_load outside [0, h], running < 0.
        """
        if obs.anomaly_hint:
            return None
        n = obs.requests_finished
        if n is None or not math.isfinite(n) or n <= 0:
            return None
        y, h, h_load, isl, running = (
            obs.prefill_time_mean,
            obs.hit_ratio,
            obs.hit_ratio_loaded,
            obs.isl,
            obs.running,
        )
        values = (y, h, h_load, isl, running)
        if any(v is None or not math.isfinite(v) for v in values):
            return None
        assert y is not None and h is not None and h_load is not None  # narrowed above
        assert isl is not None and running is not None
        if y < 0 or isl <= 0 or not (0.0 <= h <= 1.0) or not (0.0 <= h_load <= h) or running < 0:
            return None
        return cls(t=obs.t, y=y, isl=isl, h=h, h_load=h_load, running=running, weight=float(n))


# --- prediction ---------------------------------------------------------------------------


def _check_hits(isl: float, h: float, h_load: float) -> None:
    if not (isl >= 0 and math.isfinite(isl)):
        raise ValueError(f"isl must be a finite number ≥ 0 tokens, got {isl!r}")
    if not (0.0 <= h <= 1.0):
        raise ValueError(f"hit ratio h must be in [0, 1], got {h!r}")
    if not (0.0 <= h_load <= h):
        raise ValueError(f"h_load must be in [0, h] = [0, {h}], got {h_load!r}")


def load_and_compute(
    coef: ChipTimeCoefficients,
    isl: float,
    h: float,
    h_load: float,
    kv_bytes_per_token: float | None,
    load_bandwidth: float | None,
) -> tuple[float, float] | None:
    """(T_load, T_compute) [s] of a request's prefill (MODEL.md §3.2); None when loaded hits exist but
    S_kv or B_load is unknown. Raises ValueError for B_load not a number > 0 with loaded hits."""
    t_compute = coef.compute_time(isl, h)
    if h_load <= 0:
        return 0.0, t_compute
    if kv_bytes_per_token is None or load_bandwidth is None:
        return None
    return load_time(h_load, isl, kv_bytes_per_token, load_bandwidth), t_compute


def _load_compute_alpha(
    coef: ChipTimeCoefficients,
    isl: float,
    h: float,
    h_load: float,
    alpha: float | None,
    kv_bytes_per_token: float | None,
    load_bandwidth: float | None,
) -> tuple[float, float, float] | None:
    """(T_load, T_compute, α to apply) shared by both TTFT layers; None when loaded hits need an
    unknown α, S_kv or B_load. Raises ValueError as :func:`service_ttft`."""
    _check_hits(isl, h, h_load)
    lc = load_and_compute(coef, isl, h, h_load, kv_bytes_per_token, load_bandwidth)
    if lc is None:
        return None
    t_load, t_compute = lc
    if t_load > 0 and alpha is None:
        return None
    a = 0.0 if alpha is None else alpha
    if not (0.0 <= a <= 1.0):
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    return t_load, t_compute, a


def service_ttft(
    coef: ChipTimeCoefficients,
    isl: float,
    h: float,
    h_load: float = 0.0,
    alpha: float | None = 0.0,
    kv_bytes_per_token: float | None = None,
    load_bandwidth: float | None = None,
) -> float | None:
    """The seed's unloaded TTFT from chip time, ``kind="service"`` [s] (MODEL.md §3.2, §7).

    TTFT = T_fixed + T_load + T_compute − α·min(T_load, T_compute) via
    :func:`fitters.model.ttft_unified`, with T_fixed = ``coef.t_step`` (one engine step: an
    unloaded prefill of one request runs in one step when it fits the token budget) and
    T_compute = ``coef.compute_time(isl, h)``. No queueing, no contention.

    Args:
        isl: prompt length N [tokens]; h: total hit ratio [1]; h_load: loaded share [1], ≤ h.
        alpha: overlap α in [0, 1]; kv_bytes_per_token: per-GPU S_kv [bytes];
            load_bandwidth: B_load [bytes/s].
    Returns:
        seconds, or None when h_load > 0 and α, S_kv or B_load is unknown (None).
    Raises:
        ValueError: ISL < 0, h outside [0, 1], h_load outside [0, h], α outside [0, 1], B_load ≤ 0
            (or not a number) when h_load > 0.
    """
    parts = _load_compute_alpha(coef, isl, h, h_load, alpha, kv_bytes_per_token, load_bandwidth)
    if parts is None:
        return None
    t_load, t_compute, a = parts
    return ttft_unified(coef.t_step, t_load, t_compute, a)


def service_ttft_gradient(
    coef: ChipTimeCoefficients,
    isl: float,
    h: float,
    h_load: float = 0.0,
    alpha: float | None = 0.0,
    kv_bytes_per_token: float | None = None,
    load_bandwidth: float | None = None,
) -> tuple[float, float, float, float, float] | None:
    """∂TTFT/∂(t_step, k_ffn, k_attn, k_dec, k_ctx) of :func:`service_ttft` at these inputs [s per
    unit of each coefficient] (MODEL.md §3.2, §7): 1 for T_step; for k_ffn and k_attn T_compute's
    regressors M = (1-h)·ISL and M·H + M²/2, × (1 − α) where T_compute < T_load (the overlap then
    hides α of T_compute), else × 1 (it hides α of T_load, which no coefficient moves; at a tie,
    the derivative as T_compute grows, the one way coefficients at 0 move: both 0 without loaded
    hits); 0 for the decode terms. Arguments, None and errors as :func:`service_ttft`."""
    parts = _load_compute_alpha(coef, isl, h, h_load, alpha, kv_bytes_per_token, load_bandwidth)
    if parts is None:
        return None
    t_load, t_compute, a = parts
    share = 1.0 - a if t_compute < t_load else 1.0
    _, miss, attention, _, _ = chip_time_regressors(isl, 0.0, h, 1.0)
    return 1.0, share * miss, share * attention, 0.0, 0.0


def predict_prefill_latency(
    coef: ChipTimeCoefficients,
    c0: float,
    c1: float,
    running: float,
    isl: float,
    h: float,
    h_load: float = 0.0,
    alpha: float | None = None,
    kv_bytes_per_token: float | None = None,
    load_bandwidth: float | None = None,
) -> float | None:
    """Load-aware prefill latency of one request, ``kind="load_aware"`` [s] (MODEL.md §7, §3.2).

    L = (c0 + c1·running)·(t_step + T_compute) + T_load − α·min(T_load, T_compute).
    For the load-aware TTFT add the observed queue time (``request_queue_time_seconds``).

    Args:
        c0, c1: fitted contention factor c = c0 + c1·running [1, 1/request].
        running: ``num_requests_running`` at which to predict [1].
        isl, h, h_load, alpha, kv_bytes_per_token, load_bandwidth: as in :func:`service_ttft`.
    Returns:
        seconds, or None when h_load > 0 and α, S_kv or B_load is unknown (None).
    Raises:
        ValueError: as :func:`service_ttft`.
    """
    parts = _load_compute_alpha(coef, isl, h, h_load, alpha, kv_bytes_per_token, load_bandwidth)
    if parts is None:
        return None
    t_load, t_compute, a = parts
    return contention(c0, c1, running) * (coef.t_step + t_compute) + t_load - overlap_time(a, t_load, t_compute)


def contention(c0: float, c1: float, running: float) -> float:
    """Contention factor c(running) = c0 + c1·running [1] (MODEL.md §7's load-aware layer)."""
    return c0 + c1 * running


# --- fitting ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Solution:
    values: np.ndarray
    covariance: np.ndarray
    predicted: np.ndarray  # of z = y − T_load
    f_scale: float
    active: np.ndarray  # parameters at a bound (bool)
    weights: np.ndarray  # each row's soft_l1 IRLS weight at the solution (fitters/online.py)


def _normalised(design: np.ndarray, z: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(design, z) with each row multiplied by √(w/mean w): weights normalised so that f_scale is
    per typical step."""
    sw = np.sqrt(w / w.mean())
    return design * sw[:, None], z * sw


def _solve(design: np.ndarray, z: np.ndarray, w: np.ndarray, lower: np.ndarray, upper: np.ndarray,
           start: np.ndarray | None = None) -> _Solution:
    """Weighted, bounded, robust linear least squares  z ≈ design·θ.

    Two passes: plain least squares gives the residual scale (1.4826·MAD of the weighted
    residuals) and the start, then soft-L1 with that f_scale so a few outlier steps cannot bend
    the fit. The plain pass is the normal equations when their solution is inside the bounds
    (then it is the bounded solution), else :func:`~fitters.online.bounded_lsq`. Both problems
    are convex: ``start`` (e.g. the previous solution) only changes where the iterations begin. Covariance:
    :func:`_robust_covariance`.
    """
    a, b = _normalised(design, z, w)
    x0 = np.clip(np.ones(design.shape[1]) * 0.5 if start is None else start, lower, upper)
    p = design.shape[1]
    plain = frozen_wls(a, b, np.ones(len(b)), np.zeros(p, dtype=bool), x0, lower, upper)
    first = bounded_lsq(a, b, x0, lower, upper)[0] if plain is None else plain
    res0 = a @ first - b
    mad = median(np.abs(res0 - median(res0)))
    floor = 1e-9 * median(np.abs(b)) + 1e-15  # noiseless data: keep f_scale > 0
    f_scale = max(1.4826 * mad, floor)
    theta, active = bounded_lsq(a, b, first if start is None else x0, lower, upper, f_scale)
    return _Solution(theta, _robust_covariance(a, b, theta, f_scale), design @ theta, f_scale, active,
                     soft_l1_weight(a @ theta - b, f_scale))


def _robust_covariance(a: np.ndarray, b: np.ndarray, theta: np.ndarray, f_scale: float) -> np.ndarray:
    """Covariance of θ after a soft_l1 least squares, shape (p, p): a C at least each of two
    estimates in the matrix order (C − M and C − S both positive semidefinite; a minimal one: S's
    eigenvalues in M's whitened coordinates raised to 1), so that every standard error is at
    least the larger of the conventional and the robust one (Angrist & Pischke, Mostly Harmless
    Econometrics §8.1):
    M = s²·(JᵀJ)⁻¹ as scipy's curve_fit computes it: s² = 2·cost/(n − p), J the loss-modified
    Jacobian (rows of a scaled by √ψ' = (1 + z)^(-3/4), z = (r/f_scale)², as scipy scales them),
    cost = f_scale²·Σ(√(1 + z) − 1); right when the request weights give every row its true
    variance.
    S = (JᵀJ)⁻¹·Σ ψ²/(1 − l)²·aaᵀ·(JᵀJ)⁻¹, the HC3 sandwich (ψ = r·(1 + z)^(-1/2), l the
    row's leverage in J): right whatever each row's variance is. The noise of a prefill time grows
    with it (longer prompts, more contention) and need not fall as 1/requests: under M alone α's
    95 % interval left the truth out 17 % of the time at 60 steps with ISL 1000–8000 and
    relative noise, 10 % at 600 (z-scores' RMS 1.3–1.8); S alone, 9–11 % at 16 steps.
    inf when J is rank deficient. a: (n, p), b: (n,), θ: (p,)."""
    r = a @ theta - b
    z = (r / f_scale) ** 2
    jac = a * np.maximum((1.0 + z) ** -1.5, np.finfo(float).eps)[:, None] ** 0.5
    cost = f_scale**2 * float(np.sum(z / (np.sqrt(1.0 + z) + 1.0)))  # √(1 + z) − 1 without cancellation
    n, p = a.shape
    u, s, vt = np.linalg.svd(jac, full_matrices=False)
    threshold = np.finfo(float).eps * max(jac.shape) * s[0] if s.size else 0.0
    if s.size < p or np.any(s <= threshold) or n <= p:
        return np.full((p, p), np.inf)
    scale = math.sqrt(2.0 * cost / (n - p))
    root = vt.T * (scale / s)  # M = root·rootᵀ
    if scale == 0.0:  # no residual at all: both are 0
        return root @ root.T
    # a row near leverage 1 (its partner down-weighted as an outlier) alone decides a parameter:
    # capped, its HC3 term is at most 10⁴× its HC0 one (1 − 1e-12 put α's stderr at 1.8e5, review)
    leverage = np.minimum(np.sum(u * u, axis=1), 0.99)
    scores = a * (r / np.sqrt(1.0 + z) / (1.0 - leverage))[:, None]
    # S whitened by M, root⁻¹·S·root⁻ᵀ = KᵀK with K = scores·(JᵀJ)⁻¹·root⁻ᵀ = scores·V/(s·scale);
    # raising its eigenvalues below 1 to 1 gives a minimal C above both
    k = (scores @ vt.T) / (s * scale)
    lam, v = np.linalg.eigh(k.T @ k)
    grown = root @ v
    return (grown * np.maximum(lam, 1.0)) @ grown.T


def _collinear(design: np.ndarray, w: np.ndarray, j: int) -> bool:
    """True when column j of the weighted design is (numerically) a combination of the others."""
    a = design * np.sqrt(w)[:, None]
    norms = np.linalg.norm(a, axis=0)
    if norms[j] == 0 or not np.isfinite(norms[j]):
        return True
    a = a / np.where(norms > 0, norms, 1.0)
    others = np.delete(a, j, axis=1)
    if others.shape[1] == 0:
        return False
    coef, *_ = np.linalg.lstsq(others, a[:, j], rcond=None)
    resid = a[:, j] - others @ coef
    return float(resid @ resid) < _COLLINEAR_TOL


def _weighted_r2(y: np.ndarray, yhat: np.ndarray, w: np.ndarray) -> float:
    if y.size < 2:
        return math.nan
    mean = float(np.average(y, weights=w))
    ss_tot = float(np.sum(w * (y - mean) ** 2))
    if ss_tot <= 0:
        return math.nan
    return 1.0 - float(np.sum(w * (y - yhat) ** 2)) / ss_tot


def _running_varies(r: np.ndarray) -> bool:
    """Whether num_requests_running r, shape (n ≥ 1,), spread by more than _RUNNING_TOL relative
    (to max(1, max |r|)); from one max and one min: ptp = max − min, max |r| = max(max, −min)."""
    hi, lo = float(r.max()), float(r.min())
    return hi - lo > _RUNNING_TOL * max(1.0, hi, -lo)


def _stderr(cov: np.ndarray, i: int) -> float:
    v = float(cov[i, i])
    return math.sqrt(v) if math.isfinite(v) and v >= 0 else math.nan


def _check_inputs(coef: ChipTimeCoefficients, kv: float | None, bw: float | None) -> None:
    coef.check("t_step", "k_ffn", "k_attn")
    if kv is not None and not (math.isfinite(kv) and kv > 0):
        raise ValueError(f"kv_bytes_per_token must be finite and > 0 bytes, got {kv!r}")
    if bw is not None and not (math.isfinite(bw) and bw > 0):
        raise ValueError(f"load_bandwidth must be finite and > 0 bytes/s, got {bw!r}")


def _missing_reason(kv: float | None, bw: float | None) -> str:
    missing = [
        name
        for name, v in (("kv_bytes_per_token (S_kv)", kv), ("load_bandwidth (B_load)", bw))
        if v is None
    ]
    return (
        f"T_load unknown: {' and '.join(missing)} not known while steps have loaded hits "
        "(h_load > 0): α cannot be fitted"
    )


def fit_latency(
    samples: Iterable[LatencySample],
    coef: ChipTimeCoefficients,
    kv_bytes_per_token: float | None,
    load_bandwidth: float | None,
    min_samples: int = 8,
    coef_covariance: np.ndarray | None = None,
) -> tuple[FitResult, FitResult]:
    """Fit the load-aware prefill latency layer and the overlap α (MODEL.md §3.2, §6, §7).

    Model (module docstring): y − T_load = c0·P + c1·P·running − α·min(T_load, T_compute),
    soft-L1 least squares with bounds c0, c1 ≥ 0, 0 ≤ α ≤ 1, weights = requests finished.

    Args:
        samples: per-step :class:`LatencySample` (any order).
        coef: chip-time coefficients (t_step, k_ffn, k_attn used) from the §7 fit.
        kv_bytes_per_token: per-GPU S_kv [bytes], None = unknown.
        load_bandwidth: B_load [bytes/s] (measured if exported, else configured), None = unknown.
        min_samples: fewest steps for either fit.
        coef_covariance: covariance of ``coef``'s (t_step, k_ffn, k_attn), shape (3, 3), from the
            chip-time fit; None: taken as exact. Given, every stderr and covariance below adds
            the part of it that moves (c0, c1, α) (:func:`_first_stage`).

    Returns:
        ``(load_aware, overlap)``.

        load_aware: params "c0" [1] and "c1" [1/request] with stderr; covariance 2×2 in that
        order; r2 = weighted R² of predicted vs observed prefill latency on the steps used;
        samples = steps used. insufficient_data below ``min_samples`` steps. When
        ``num_requests_running`` never varied, c1 is not_identifiable with value 0 (fixed, its
        covariance row/column 0) and c0 alone absorbs the contention at that concurrency.
        extra: "alpha_fitted" ("yes"/"no"), "loaded_steps", "running_min", "running_max", "f_scale".

        overlap: param "alpha" [1] with stderr, covariance 1×1; samples = steps with
        h_load > 0; r2 on those steps; extra "samples_total" (steps fitted) and, with
        ``coef_covariance``, "alpha_chip_gradient": ∂α/∂(t_step, k_ffn, k_attn) [1/s, token/s,
        token²/s], 3 floats (:func:`_first_stage`), what a prediction reading both α and the
        coefficients needs for their covariance Σ·gradient. Status:
        not_identifiable (:data:`REASON_NO_LOADED_HITS`) when no step has h_load > 0;
        not_identifiable naming what is missing when S_kv or B_load is None while loaded hits
        exist; not_identifiable when min(T_load, T_compute) is zero or collinear with the
        chip-time regressors; insufficient_data when fewer than ``min_samples`` steps have
        h_load > 0 (α is then still fitted jointly, as a nuisance, so those steps inform c0/c1);
        not_identifiable when α's 95 % interval covers all of [0, 1] (T_load within the noise of
        the prefill time: fitted, its value meaningless); else ok. Whenever α is not_identifiable,
        (c0, c1) are fitted on the h_load = 0 steps only (their load term is 0).

    Raises:
        ValueError: negative or non-finite chip-time coefficients, or a given S_kv / B_load
            that is not finite and > 0.
    """
    matrix = np.array([(s.t, s.y, s.isl, s.h, s.h_load, s.running, s.weight) for s in samples], dtype=float)
    out = _fit_matrix(matrix.reshape(-1, len(_COLUMNS)), coef, kv_bytes_per_token, load_bandwidth, min_samples,
                      lambda design, z, w, lower, upper, names, rows: _solve(design, z, w, lower, upper),
                      coef_covariance=None if coef_covariance is None else lambda: coef_covariance)
    assert out is not None  # _solve always answers
    return out[0]


# LatencySample fields in the order of a row of :func:`_fit_matrix`'s matrix.
_COLUMNS = ("t", "y", "isl", "h", "h_load", "running", "weight")
_BOUNDS = {"c0": (0.0, np.inf), "c1": (0.0, np.inf), "alpha": (0.0, 1.0)}
Solver = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str], np.ndarray],
                  "_Solution | None"]


@dataclass(frozen=True)
class _Fitted:
    """How :func:`_fit_matrix` reached its solution: parameter names, the solution, and which rows
    (bool, over the matrix) entered the fit."""

    names: list[str]
    solution: _Solution
    rows: np.ndarray


def _fit_matrix(x: np.ndarray, coef: ChipTimeCoefficients, kv: float | None, bw: float | None, min_samples: int,
                solver: Solver, frozen: list[str] | None = None,
                coef_covariance: Callable[[], np.ndarray | None] | None = None
                ) -> tuple[tuple[FitResult, FitResult], _Fitted | None] | None:
    """:func:`fit_latency` on a matrix of samples, shape (n, 7) in _COLUMNS order, with the linear
    problem solved by ``solver(design, z, w, lower, upper, names, rows)`` (rows: bool mask of the
    fit set over x); None when the solver returns None. The _Fitted is None when the fit failed
    before solving. ``frozen``: the parameter names of the last refit, whose collinearity
    verdicts (α, c0) stand instead of being checked again (the exact step between refits).
    ``coef_covariance``: returns :func:`fit_latency`'s (or None), called only once the solution
    stands (its source may be a lazy result)."""
    _check_inputs(coef, kv, bw)
    loaded_rows = x[:, 4] > 0
    n_loaded = int(loaded_rows.sum())

    alpha_fail: tuple[Status, str] | None = None
    alpha_weak: tuple[Status, str] | None = None  # fitted, but not publishable
    if not n_loaded:
        alpha_fail = (Status.NOT_IDENTIFIABLE, REASON_NO_LOADED_HITS)
    elif kv is None or bw is None:
        alpha_fail = (Status.NOT_IDENTIFIABLE, _missing_reason(kv, bw))
    elif n_loaded < min_samples:
        alpha_weak = (
            Status.INSUFFICIENT_DATA,
            f"too few steps with loaded hits (h_load > 0), need ≥ {min_samples}" + measured(f"{n_loaded} steps"),
        )

    if alpha_fail is None:
        if frozen is None:
            arrays = _arrays(x, coef, kv, bw)
            design, names = _design(arrays, with_alpha=True)
        if frozen is not None and "alpha" not in frozen or frozen is None and _collinear(
                design, arrays["w"], names.index("alpha")):
            alpha_fail = (
                Status.NOT_IDENTIFIABLE,
                "min(T_load, T_compute) is zero or collinear with the chip-time regressors in "
                "the loaded steps: α cannot be separated from the contention factor",
            )
    rows = np.ones(len(x), dtype=bool) if alpha_fail is None else ~loaded_rows
    n_fit = int(rows.sum())
    with_alpha = alpha_fail is None

    def overlap_failed(default_reason: str) -> FitResult:
        status, reason = alpha_fail or alpha_weak or (Status.INSUFFICIENT_DATA, default_reason)
        return FitResult.failed(status, reason, samples=n_loaded)

    if n_fit < max(min_samples, 1):
        which = "steps" if with_alpha else "steps without loaded hits (h_load = 0)"
        reason = f"too few {which} with finished requests, need ≥ {min_samples}" + measured(f"{n_fit} steps")
        return (
            FitResult.failed(Status.INSUFFICIENT_DATA, reason, samples=n_fit),
            overlap_failed("load-aware fit has insufficient data"),
        ), None

    arrays = _arrays(x[rows], coef, kv, bw)
    r = arrays["r"]
    running_varies = _running_varies(r)
    design, names = _design(arrays, with_alpha=with_alpha, with_c1=running_varies)
    if frozen is None and _collinear(design, arrays["w"], names.index("c0")):
        reason = "prefill chip time t_step + T_compute is 0 in every step: c0 cannot be fitted"
        return (
            FitResult.failed(Status.NOT_IDENTIFIABLE, reason, samples=n_fit),
            overlap_failed("load-aware fit not identifiable"),
        ), None
    lower, upper = _bounds(tuple(names))
    sol = solver(design, arrays["z"], arrays["w"], lower, upper, names, rows)
    if sol is None:
        return None
    idx = {n: i for i, n in enumerate(names)}
    cov = sol.covariance
    sigma = None if coef_covariance is None else coef_covariance()
    g = None
    if sigma is not None:
        g = _first_stage(_basis_rows(x[rows], (coef, kv, bw))[0], arrays, design, names, sol)
        cov = cov + g @ np.asarray(sigma, dtype=float) @ g.T

    y_hat = sol.predicted + arrays["t_load"]
    params = {"c0": Estimate(float(sol.values[idx["c0"]]), _stderr(cov, idx["c0"]))}
    cov2 = np.zeros((2, 2))
    cov2[0, 0] = cov[idx["c0"], idx["c0"]]
    if running_varies:
        params["c1"] = Estimate(float(sol.values[idx["c1"]]), _stderr(cov, idx["c1"]))
        cov2[0, 1] = cov2[1, 0] = cov[idx["c0"], idx["c1"]]
        cov2[1, 1] = cov[idx["c1"], idx["c1"]]
    else:
        params["c1"] = Estimate(
            0.0,
            math.nan,
            Status.NOT_IDENTIFIABLE,
            f"num_requests_running never varied (always {float(r[0]):g}): the contention slope "
            "cannot be seen; c0 is the contention factor at that concurrency",
        )
    load_aware = FitResult(
        status=Status.OK,
        params=params,
        samples=n_fit,
        r2=_weighted_r2(arrays["y"], y_hat, arrays["w"]),
        covariance=tuple(tuple(float(v) for v in row) for row in cov2),
        extra={
            "alpha_fitted": "yes" if with_alpha else "no",
            "loaded_steps": float(n_loaded),
            "running_min": float(np.min(r)),
            "running_max": float(np.max(r)),
            "f_scale": float(sol.f_scale),
        },
    )
    fitted = _Fitted(names, sol, rows)
    if not with_alpha:
        return (load_aware, overlap_failed("")), fitted
    ia = idx["alpha"]
    mask = arrays["h_load"] > 0
    alpha_est = Estimate(float(sol.values[ia]), _stderr(cov, ia))
    status, reason = alpha_weak or _alpha_identified(alpha_est)
    overlap = FitResult(
        status=status,
        reason=reason,
        params={"alpha": alpha_est},
        samples=n_loaded,
        r2=_weighted_r2(arrays["y"][mask], y_hat[mask], arrays["w"][mask]),
        covariance=((float(cov[ia, ia]),),),
        extra={"samples_total": float(n_fit),
               # ∂α/∂(t_step, k_ffn, k_attn): α's error runs against the coefficients' (a TTFT's cross term)
               **({"alpha_chip_gradient": g[ia].tolist()} if g is not None and np.isfinite(g[ia]).all() else {})},
    )
    return (load_aware, overlap), fitted


def _alpha_identified(alpha: Estimate) -> tuple[Status, str]:
    """(ok, "") when α's 95 % interval leaves out some of [0, 1] (MODEL.md §6); else
    not_identifiable: the data allow every overlap, e.g. the loaded steps' T_load is within the
    noise of their prefill time (a stderr of 10.9 was published as ok)."""
    half = Z95 * alpha.stderr
    if alpha.value - half > 0.0 or alpha.value + half < 1.0:  # a nan stderr compares False
        return Status.OK, ""
    return Status.NOT_IDENTIFIABLE, ("α's 95 % interval covers all of [0, 1]: the loaded steps' load time T_load is "
                                     "within the noise of their prefill time" + measured(
                                         f"α = {alpha.value:.3f} ± {half:.3g}"))


def _arrays(x: np.ndarray, coef: ChipTimeCoefficients, kv: float | None, bw: float | None) -> dict[str, np.ndarray]:
    """Per-step arrays of a sample matrix (n, 7): y, w, r, h_load, P = t_step + T_compute,
    T_load, m, z = y − T_load."""
    y, isl, h, h_load = x[:, 1], x[:, 2], x[:, 3], x[:, 4]
    t_compute = coef.compute_time(isl, h)
    # only h_load = 0 steps reach here without S_kv and B_load
    t_load = np.zeros_like(y) if kv is None or bw is None else load_time(h_load, isl, kv, bw)
    return {
        "y": y,
        "w": x[:, 6],
        "r": x[:, 5],
        "h_load": h_load,
        "p": coef.t_step + t_compute,
        "t_load": t_load,
        "m": np.minimum(t_load, t_compute),
        "z": y - t_load,
    }


def _first_stage(u: np.ndarray, arrays: dict[str, np.ndarray], design: np.ndarray, names: list[str],
                 sol: "_Solution") -> np.ndarray:
    """G = ∂θ/∂(t_step, k_ffn, k_attn), shape (p, 3): how the fitted θ = (c0[, c1][, α]) move
    with the chip-time coefficients they are fitted under, so that G·Σ·Gᵀ is the part of the
    chip-time fit's covariance Σ they inherit (the delta method for a two-step estimate, the two
    fits' noise taken as independent). The soft_l1 solution is stationary, Σ n·ψ(r)·∂r/∂θ = 0
    (r = D·θ − z per normalised row, n the request weights, ψ(r)/r = ω the IRLS weight);
    differentiating it in c_j, with ψ' = ω³ (the loss-modified Jacobian's weight, as
    :func:`_robust_covariance`): (Dᵀ·n·ψ'·D)·∂θ = ∂Dᵀ·n·ω·e − Dᵀ·n·ψ'·∂D·θ (e = z − D·θ), over
    every parameter, those at a bound too, as :func:`_robust_covariance` treats them: a bound
    parameter does not move under an infinitesimal change of the coefficients, but under one of
    their standard error it may leave the bound; a 0 here published α = 1 ± 0.13 (ok) where the
    free α's error with this term was 0.22–0.86 (simulator, true α 0.5 at 10 % noise, early
    windows: 0.5 was 2.6–5.1 published stderrs away). u: ∂P/∂(t_step, k_ffn, k_attn)
    of the fitted rows (n, 3), :func:`_basis_rows`; design: D (n, p), columns ``names`` as
    :func:`_design` builds them."""
    on_compute = arrays["m"] < arrays["t_load"]  # min() is T_compute = (0, k_ffn, k_attn)·u there
    irls = arrays["w"] * sol.weights
    hess = arrays["w"] * sol.weights ** 3
    e = arrays["z"] - design @ sol.values
    g = np.zeros((len(names), 3))
    gram = design.T @ (design * hess[:, None])
    for j in range(3):
        dm = u[:, j] * on_compute if j else np.zeros(len(u))  # T_compute has no t_step
        dd = np.column_stack([{"c0": u[:, j], "c1": u[:, j] * arrays["r"], "alpha": -dm}[n] for n in names])
        rhs = dd.T @ (irls * e) - design.T @ (hess * (dd @ sol.values))
        try:
            g[:, j] = np.linalg.solve(gram, rhs)
        except np.linalg.LinAlgError:
            g[:, j] = np.nan  # the fit's own covariance is inf there already
    return g


def _design(arrays: dict[str, np.ndarray], with_alpha: bool, with_c1: bool = True) -> tuple[np.ndarray, list[str]]:
    cols, names = [arrays["p"]], ["c0"]
    if with_c1:
        cols.append(arrays["p"] * arrays["r"])
        names.append("c1")
    if with_alpha:
        cols.append(-arrays["m"])
        names.append("alpha")
    return np.column_stack(cols), names


# --- online -------------------------------------------------------------------------------


# Relative move of a step's prefill chip time P (plus T_load) under new chip-time coefficients (or
# S_kv, B_load) beyond which the frozen robust weights no longer describe the residuals: refit.
COEF_TOL = 0.05
# A change of the latency layer under unchanged chip time (α: another offload or KV-connector
# setting, a busier host link; the contention c): the fit over 2 h of steps followed it only as
# they left (α 0.5 → 0.95 read 0.52 ± 0.02 five minutes on, 0.58 after fifteen, status ok; 40 min
# to come within 0.05, hostile-traffic review). ShiftTest over the steps it fits, against earlier
# steps of the same traffic; 5 %: the TTFT accuracy bar (issue 6), a change the fit's TTFT would
# publish as that far off. At 2 % noise α 0.5 → 0.95 moves the simulator's prefill 7.5 % at h 0.6.
SHIFT = 0.05
SHIFT_STEPS = 32
SHIFT_REASON = (f"the engine's prefill latency changed against its chip time and earlier steps of the same traffic (h, "
                f"ISL, concurrency, loaded hits): the median of its last {SHIFT_STEPS} steps with finished requests "
                f"by more than {SHIFT:.0%}, as after another KV offload or connector setting (the overlap α), a change "
                f"of contention, or of the engine's speed by less than the chip-time fit tells")

Key = tuple[ChipTimeCoefficients, "float | None", "float | None"]


@dataclass(frozen=True)
class _Frozen:
    """What a robust refit fixes until the next one (fitters/online.py)."""

    key: Key  # (coef, S_kv, B_load) of the refit
    names: list[str]
    theta: np.ndarray
    f_scale: float
    active: np.ndarray  # parameters at a bound (bool)
    w_mean: float  # mean weight of the fitted steps, the residuals' normalisation
    alpha_collinear: bool  # α left out as collinear with the chip-time regressors

    @functools.cached_property
    def residual_map(self) -> np.ndarray:
        """r, shape (12,): a row's design·θ − z under the refit is r·v (v: its basis, _transform)."""
        t = _transform(self.key, self.names)
        return self.theta @ t[:-1] - t[-1]


@functools.lru_cache(maxsize=16)
def _bounds(names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) bounds of the fitted parameters ``names`` (_BOUNDS), shape (p,) each; shared
    read-only arrays."""
    lower, upper = np.array([_BOUNDS[n][0] for n in names]), np.array([_BOUNDS[n][1] for n in names])
    lower.flags.writeable = upper.flags.writeable = False
    return lower, upper


def _load_scale(key: Key) -> float:
    """S_kv/B_load [s/token] of ``key``, T_load = scale·h_load·ISL (0 when either is unknown)."""
    _, kv, bw = key
    return 0.0 if kv is None or bw is None else kv / bw


def _basis_rows(x: np.ndarray, key: Key) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sample row of x (n, 7): u = (1, M, W) with P = (t_step, k_ffn, k_attn)·u and T_compute =
    (0, k_ffn, k_attn)·u (M = (1 − h)·ISL, W = attention_work, MODEL.md §7), shape (n, 3);
    q = h_load·ISL, T_load = _load_scale·q, shape (n,); and whether min(T_load, T_compute) is
    T_load under ``key``'s coefficients (bool, (n,))."""
    isl, h = x[:, 2], x[:, 3]
    u = np.empty((len(x), 3))  # filled column by column: column_stack's per-call cost on one row
    u[:, 0] = 1.0
    u[:, 1] = (1.0 - h) * isl
    u[:, 2] = attention_work(isl, h)
    q = x[:, 4] * isl
    coef = key[0]
    return u, q, _load_scale(key) * q <= u[:, 1] * coef.k_ffn + u[:, 2] * coef.k_attn


def _transform(key: Key, names: list[str]) -> np.ndarray:
    """T, shape (p + 1, 12): (design columns in ``names`` order, z) = T·v for a row's basis v of
    :meth:`LatencyFitter._basis`, under ``key``."""
    coef = key[0]
    g = _load_scale(key)
    t = np.zeros((len(names) + 1, 12))
    for i, name in enumerate(names):
        if name == "c0":
            t[i, 0:3] = coef.t_step, coef.k_ffn, coef.k_attn
        elif name == "c1":
            t[i, 3:6] = coef.t_step, coef.k_ffn, coef.k_attn
        else:
            t[i, 6:10] = -g, 0.0, -coef.k_ffn, -coef.k_attn
    t[-1, 10:12] = 1.0, -g
    return t


def _shift_test() -> ShiftTest:
    """The latency fit's change test (SHIFT), afresh."""
    return ShiftTest(SHIFT, "steps with finished requests", SHIFT_STEPS)


class LatencyFitter(AmortizedFit[_Frozen, tuple[FitResult, FitResult]]):
    """Online load-aware latency / overlap fitter over a bounded ring buffer (MODEL.md §6, §7;
    fitters/online.py).

    Memory: a :class:`~fitters.online.RowBuffer` of at most ``capacity`` samples (default 720 =
    2 h of 10-s steps), 8 floats each (the 7 fields of :class:`LatencySample`, a frozen weight),
    2·capacity rows of storage; the oldest is dropped first. Nothing is fitted in :meth:`update`.
    :meth:`result` is :func:`fit_latency` (warm-started) when no ok refit exists, ``every``
    samples arrived since the last one, or the chip-time coefficients, S_kv or B_load moved the
    prefill chip time (plus T_load) of some stored step by more than COEF_TOL relative; in
    between, the exact weighted least squares of all stored steps under the given coefficients
    with the refit's soft_l1 IRLS weights frozen (a new step: the weight at its residual under
    the refit's solution, coefficients and f_scale) and the parameters it held at a bound fixed
    there, solved from running sums: the design is linear in the coefficients and S_kv/B_load
    (P = (t_step, k_ffn, k_attn)·u, T_load = (S_kv/B_load)·q), so the Gram matrix of each step's
    basis v (12 numbers: u, u·running, the loaded share of the min() branch, y, q; weighted by
    frozen weight × requests) gives the normal equations under any coefficients by a 12×12
    transform; covariance, R² and statuses are computed as in :func:`fit_latency` at that solution
    when the result is first read (:class:`~fitters.online.LazyFitResult`), with the refit's
    collinearity verdicts. It refits instead when a free parameter leaves its bounds, the fit's
    structure changes (which parameters are fitted, which steps enter) or a loaded step's
    min(T_load, T_compute) changes branch under the new coefficients. The result is cached while the samples,
    ``coef``, ``kv_bytes_per_token`` and ``load_bandwidth`` are unchanged (compared by value) and
    ``coef_covariance`` is the same callable.
    Raises ValueError for capacity < 1, min_samples < 1 or every < 1.
    """

    def __init__(self, capacity: int = 720, min_samples: int = 8, every: int = REFIT_EVERY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be ≥ 1")
        if min_samples < 1:
            raise ValueError("min_samples must be ≥ 1")
        super().__init__(capacity, len(_COLUMNS), every, basis_width=12)
        self.capacity = capacity
        self.min_samples = min_samples
        self._watch = _shift_test()
        self.shift: Shift | None = None  # the latest change found (:meth:`update`, SHIFT_REASON)

    def extreme_points(self) -> tuple[tuple[float, float], ...]:
        """(h [1], ISL [tokens]) of the stored steps with the lowest and highest h and ISL: the
        edges of the traffic the fit is on (≤ 4 distinct pairs, () when none is stored)."""
        x = self.rows.view()
        if not len(x):
            return ()
        h, isl = x[:, 3], x[:, 2]
        picks = {int(np.argmin(h)), int(np.argmax(h)), int(np.argmin(isl)), int(np.argmax(isl))}
        return tuple(dict.fromkeys((float(h[i]), float(isl[i])) for i in sorted(picks)))

    @property
    def samples(self) -> tuple[LatencySample, ...]:
        """The stored samples, oldest first."""
        return tuple(LatencySample(*map(float, row[:-1])) for row in self.rows.view())

    def update(self, obs: Observation) -> bool:
        """Store the step's sample; False when the step is unusable (see LatencySample.from_observation).
        When the latency layer changed under it (SHIFT, SHIFT_REASON; a step the last refit fits,
        its relative residual under it), sets :attr:`shift` and keeps the newest SHIFT_STEPS // 4
        steps only (:meth:`~fitters.online.AmortizedFit.keep_newest`), the changed engine's."""
        sample = LatencySample.from_observation(obs)
        if sample is None:
            return False
        self.append(tuple(getattr(sample, c) for c in _COLUMNS))
        state = self._state
        if state is None:
            return True
        r, fitted = self._relative(self.rows.view()[-1:, :-1], state)
        if fitted[0] and self._watch.arrived(float(r[0]), self.rows.appended) and (
                shift := self._changed(state)) is not None:
            self.shift = shift
            self.keep_newest(SHIFT_STEPS // 4)
            self._watch = _shift_test()
        return True

    def _relative(self, x: np.ndarray, state: _Frozen) -> tuple[np.ndarray, np.ndarray]:
        """(relative residuals (predicted − measured)/predicted of sample rows x (n, 7) under a
        refit, shape (n,); whether the refit fits each, bool (n,))."""
        v, w, _ = self._basis(x, state)
        resid = v @ state.residual_map  # predicted − measured [s]
        predicted = x[:, 1] + resid
        fitted = (w > 0) & (predicted > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(fitted, resid / predicted, 0.0), fitted

    def _changed(self, state: _Frozen) -> Shift | None:
        """The change of the latency layer its stored steps tell (:class:`~fitters.online.ShiftTest`;
        the traffic: ISL and concurrency by octave, loaded hits or not; references bracketing each
        step in h), or None."""
        x = self.rows.view()[:, :-1]
        r, fitted = self._relative(x, state)
        x = x[fitted]
        traffic = np.column_stack([octaves(np.maximum(x[:, 2], 1.0)), octaves(x[:, 5]), x[:, 4] > 0])
        return self._watch.compare(r[fitted], traffic, x[:, 3])

    def result(
        self,
        coef: ChipTimeCoefficients,
        kv_bytes_per_token: float | None,
        load_bandwidth: float | None,
        coef_covariance: Callable[[], object] | None = None,
    ) -> tuple[FitResult, FitResult]:
        """``(load_aware, overlap)`` on the stored samples (class docstring); ``coef_covariance``
        returns the 3×3 covariance over (t_step, k_ffn, k_attn) of :func:`fit_latency` (or None),
        called only when the statistics are built: the exact step's are lazy, and so may be the
        chip-time fit's that give it (compared by identity: a new one means a new result). Raises ValueError as
        :func:`fit_latency`."""
        return self.solve(((coef, kv_bytes_per_token, load_bandwidth), coef_covariance))

    def _refit(self, x: np.ndarray, key: tuple[Key, tuple | None],
               previous: _Frozen | None) -> tuple[tuple[FitResult, FitResult], _Frozen | None, np.ndarray]:
        def solver(design, z, w, lower, upper, names, rows):
            warm = previous is not None and previous.names == names
            return _solve(design, z, w, lower, upper, previous.theta if warm else None)

        key, coef_covariance = key
        out, fitted = _fit_matrix(x, *key, self.min_samples, solver, coef_covariance=coef_covariance)
        weights = np.ones(len(x))
        if fitted is None:
            return out, None, weights
        sol = fitted.solution
        weights[fitted.rows] = sol.weights
        w_mean = float(x[fitted.rows, 6].mean())
        collinear = "alpha" not in fitted.names and bool(np.any(x[:, 4] > 0)) and _load_scale(key) > 0
        return out, _Frozen(key, fitted.names, sol.values, sol.f_scale, sol.active, w_mean, collinear), weights

    def _weigh(self, x: np.ndarray, v: np.ndarray, key: object, state: _Frozen) -> np.ndarray:
        resid = (v @ state.residual_map) * np.sqrt(x[:, 6] / state.w_mean)
        return soft_l1_weight(resid, state.f_scale)

    def _basis(self, x: np.ndarray, state: _Frozen) -> tuple[np.ndarray, np.ndarray, None]:
        u, q, load_branch = _basis_rows(x, state.key)
        loaded = q > 0
        v = np.empty((len(x), 12))  # (u, u·running, loaded q on the load branch, loaded u off it, y, q)
        v[:, 0:3] = u
        v[:, 3:6] = u * x[:, 5:6]
        v[:, 6] = q * (loaded & load_branch)
        v[:, 7:10] = u * (loaded & ~load_branch)[:, None]
        v[:, 10] = x[:, 1]
        v[:, 11] = q
        in_fit = np.ones(len(x), dtype=bool) if "alpha" in state.names else ~loaded
        return v, x[:, 6] * in_fit, None

    def _moved(self, x: np.ndarray, key: Key, state: _Frozen) -> bool:
        """Whether ``key`` moves some stored step's P + T_load by more than COEF_TOL relative to
        the refit's. max_j |Δc_j|/c_j over (t_step, k_ffn, k_attn) bounds it from above (u ≥ 0),
        so the O(n) check runs only when that bound does not settle it."""
        now, then = key[0], state.key[0]
        same_load = _load_scale(key) == _load_scale(state.key)
        if same_load and then.t_step > 0:
            bound = 0.0
            for a, b in ((now.t_step, then.t_step), (now.k_ffn, then.k_ffn), (now.k_attn, then.k_attn)):
                if a != b:
                    bound = max(bound, abs(a - b) / b if b > 0 else math.inf)
            if bound <= COEF_TOL:
                return False
        if same_load:  # T_load is the same: only P = (t_step, k_ffn, k_attn)·u moves
            c = np.array([[then.t_step, now.t_step - then.t_step], [then.k_ffn, now.k_ffn - then.k_ffn],
                          [then.k_attn, now.k_attn - then.k_attn]])
            p_then, dp = (_basis_rows(x, key)[0] @ c).T
            return not bool(((np.abs(dp) <= COEF_TOL * p_then) & (p_then > 0)).all())  # P = 0 counts as moved
        arr_now, arr_then = _arrays(x, *key), _arrays(x, *state.key)
        with np.errstate(divide="ignore", invalid="ignore"):
            moved = (np.abs(arr_now["p"] - arr_then["p"]) + np.abs(arr_now["t_load"] - arr_then["t_load"])) \
                / arr_then["p"]
        return not float(np.max(moved)) <= COEF_TOL  # nan (P = 0) counts as moved

    def _exact(self, x: np.ndarray, w: np.ndarray, key: tuple[Key, tuple | None],
               state: _Frozen) -> tuple[FitResult, FitResult] | None:
        key, coef_covariance = key
        coef, kv, bw = key
        _check_inputs(coef, kv, bw)
        if key != state.key and self._moved(x, key, state):
            return None
        # the structure _fit_matrix would find (with the refit's collinearity verdicts), else refit
        loaded = x[:, 4] > 0
        with_alpha = bool(loaded.any()) and kv is not None and bw is not None and not state.alpha_collinear
        if with_alpha != ("alpha" in state.names):
            return None
        r = x[:, 5] if with_alpha else x[~loaded, 5]
        if len(r) < self.min_samples or _running_varies(r) != ("c1" in state.names):
            return None
        if with_alpha and key != state.key and not np.array_equal(_basis_rows(x, key)[2][loaded],
                                                                  _basis_rows(x, state.key)[2][loaded]):
            return None  # min(T_load, T_compute) changed branch: the basis no longer holds
        t = _transform(key, state.names)
        m = t @ self.sums.g[0] @ t.T
        names = state.names
        sol = solve_normal(m[:-1, :-1], m[:-1, -1], state.active, state.theta, *_bounds(tuple(names)))
        if sol is None:
            return None
        theta, xc, wc = sol, x.copy(), w.copy()

        def solver(design, z, sw, lower, upper, names, rows):
            a, b = _normalised(design, z, sw)
            return _Solution(theta, _robust_covariance(a, b, theta, state.f_scale), design @ theta, state.f_scale,
                             state.active, wc[rows])

        both = shared(lambda: _fit_matrix(xc, coef, kv, bw, self.min_samples, solver, names, coef_covariance)[0])
        return LazyFitResult(lambda: both()[0]), LazyFitResult(lambda: both()[1])
