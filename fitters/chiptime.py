"""Online fit of the chip-time model (MODEL.md §7, fitting rules §6).

    Δt_busy ≈ T_step·Δsteps + k_ffn·ΔM + k_attn·ΔW_attn + k_dec·ΔG + k_ctx·ΔC_dec

One row per busy step (an :class:`~fitters.observation.Observation` with ``busy`` set). Units:
Δt_busy [s], Δsteps [1], ΔM, ΔG [tokens], ΔW_attn [tokens²], ΔC_dec [tokens·tokens]; the
coefficients carry the matching [s per unit] (see :class:`fitters.model.ChipTimeCoefficients`).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from .model import CHIP_TIME_REGRESSOR_WORDS, CHIP_TIME_TERMS, ChipTimeCoefficients, relation_text
from .observation import Observation
from .online import (REFIT_EVERY, AmortizedFit, LazyFitResult, RowBuffer, Shift, ShiftTest, bounded_lsq,
                     median, robust_sigma, soft_l1_weight, solve_normal)
from .result import Estimate, FitResult, Status, measured

# Keep-order when columns are collinear: the simpler term survives (MODEL.md §6).
_KEEP_ORDER = ("t_step", "k_ffn", "k_dec", "k_attn", "k_ctx")
# Why a known pair is collinear, appended to the reason so an operator knows what to vary.
_HINTS = {
    ("k_ctx", ("k_dec",)): "ISL and OSL did not vary enough to tell them apart",
    ("k_attn", ("k_ffn",)): "h and ISL did not vary enough to tell them apart",
    ("k_dec", ("t_step",)): "decode tokens per engine step did not vary enough to tell them apart",
}
# Uncentred R² of a column regressed on the kept ones above which it is not identifiable.
COLLINEAR_R2 = 0.999
# A kept term carrying under this share of a dropped column's RMS is step noise, not part of the
# column's relation (extra "collinear"): left in, it puts every what-if off the relation by its
# share (kvhit calibrate's one ISL and OSL: decode context ≈ 2080·G + 0.0056·M, and a prefill
# "had" 0 where the relation gave 1.1). Dropping it moves the relation by less than the 3 % scatter
# √(1 − COLLINEAR_R2) its rows may have.
RELATION_SHARE = 0.01
# Residuals beyond this many robust sigmas are outliers: left out of the fit (a tail-chunk dip
# does a fraction of a step's work in the step's time, MODEL.md §4: even soft_l1's bounded pull
# of a few of them bends the coefficients), of R² and of the covariance.
OUTLIER_SIGMAS = 3.5
# Rows are rejected as outliers only when REJECT_AFTER × min_samples inliers remain: on fewer, the
# residual σ of a 5-term fit is itself uncertain, and the rows that would correct an early misfit
# would be cut (the accuracy benchmark's valley delay doubled when rejecting from min_samples on).
REJECT_AFTER = 3
REJECT_ROUNDS = 4  # flag-and-refit rounds at most (two settle a seed-002 dip pattern)
# An engine that changed speed (a power or clock cap, a co-located job, flags changed at a
# restart): the last DRIFT_STEPS steps' relative residuals against the fit, less those of the
# earlier steps of the same traffic (ISL, OSL and concurrency per engine by octave, bracketing it
# in h: against an h cell, traffic crossing it slowly read a misfit with h, or tail-chunk dips at
# one h, as a change: 5 false restarts in 10-h runs of the simulator, review), have a median beyond DRIFT (most of them are the changed engine's). Kept (_evict keeps other h's steps), the earlier steps bend
# the fit to both engines: 1.5x slower, the bathtub's bottom read 0.60 for 0.30, a valley paged
# for 3 h where there was none (helper's repro). 8 %: the real trace's phases left out were
# predicted within 4.4 % (MODEL.md §7), a misfit the shift against earlier steps of the same
# traffic takes out anyway; noise is DRIFT_SIGMAS' guard. At 15 % a soak's +12 % was missed and
# the held fit published the TPM at h 0.9 15 % high for 8 h, status ok.
DRIFT = 0.08
DRIFT_STEPS = 32
DRIFT_REASON = (f"the engine's chip time per unit of work changed against earlier steps of the same traffic (h, ISL, "
                f"OSL and concurrency): the median of its last {DRIFT_STEPS} busy steps by more than {DRIFT:.0%}, as "
                "after a power or clock cap, a co-located job, or flags changed at a restart")
DRIFT_REFERENCE = 8  # earlier steps of a step's traffic it is compared with, at least
DRIFT_SIGMAS = 6.0  # standard errors of the median shift a change must pass too


def design_row(obs: Observation) -> np.ndarray | None:
    """Regressors of one step, shape (5,): [steps, miss_tokens, attention_work,
    generation_tokens, decode_context_tokens] in CHIP_TIME_TERMS order (MODEL.md §7).

    None unless the step is usable: busy, no ``anomaly_hint``, Δt > 0 and all five regressors
    known, finite and ≥ 0.
    """
    if not obs.busy or obs.anomaly_hint or not (math.isfinite(obs.dt) and obs.dt > 0):
        return None
    values = observed_regressors(obs)
    if any(v is None for v in values):
        return None
    row = np.array(values, dtype=float)
    if not np.all(np.isfinite(row)) or np.any(row < 0):
        return None
    return row


def observed_regressors(obs: Observation) -> tuple[float | None, ...]:
    """The five regressors of a step (or a window's totals) in CHIP_TIME_TERMS order (None where
    unknown)."""
    return (obs.steps, obs.miss_tokens, obs.attention_work, obs.generation_tokens, obs.decode_context_tokens)


def fit_chip_time(observations: Iterable[Observation], min_samples: int = 10) -> FitResult:
    """Robust non-negative fit of the §7 chip-time model to busy steps (MODEL.md §7, §6). Pure.

    Unusable steps (see :func:`design_row`) are skipped. Method: columns scaled to unit RMS;
    all-zero or (near-)collinear columns dropped (uncentred R² of the column regressed on the
    simpler kept columns > ``COLLINEAR_R2``; keep-order t_step, k_ffn, k_dec, k_attn, k_ctx);
    residuals relative to each step's size (busy-time noise grows with Δt); NNLS start;
    the soft_l1 least squares with bounds (0, ∞) (``least_squares``'s minimum, found by
    :func:`~fitters.online.bounded_lsq`) whose f_scale is the MAD of the NNLS residuals; then
    the rows beyond OUTLIER_SIGMAS robust σ of that solution's residuals
    are flagged as outliers (tail-chunk dips, MODEL.md §4) and the fit is repeated without them,
    flagging again at each new solution (σ of every row) until the set holds still, at most
    REJECT_ROUNDS times and only while REJECT_AFTER·``min_samples`` rows remain, so they do not
    bend it.

    Returns a FitResult with params in CHIP_TIME_TERMS order ("t_step" [s/step], "k_ffn"
    [s/token], "k_attn" [s/token²], "k_dec" [s/token], "k_ctx" [s/(token·token)]), all ≥ 0.
    A dropped term has value 0, stderr nan and status not_identifiable with a reason; the kept
    terms then carry the combined prediction, which stays valid. ``covariance`` is 5×5 in that
    order (rows/columns of dropped terms are 0: they are fixed at 0), from s²·(JᵀJ)⁻¹ over the
    inlier rows. ``samples`` = usable rows (outliers included); ``r2`` is the uncentred
    R² (1 - Σr²/Σy², the model has no intercept) over inliers;
    ``extra``: "outliers" (rows beyond OUTLIER_SIGMAS robust σ of the relative residual),
    "mape" (inlier mean |error|/Δt), "condition_number" (of the scaled kept design); when a term
    is dropped, "collinear": {dropped term: {kept term: c}}, the relation regressor ≈ Σ c × kept
    regressor its column follows in the rows that dropped it (uncentred least squares; {} for a
    column with no regressor at all): the kept terms carry the dropped one's time only where a
    request keeps that relation (fitters/whatif.py ``unidentified_terms``).
    Status insufficient_data below ``min_samples`` usable rows, else ok.
    """
    return _fit_rows([(r, o.dt) for o in observations if (r := design_row(o)) is not None], min_samples)


def _fit_rows(rows: Sequence[tuple[np.ndarray, float]], min_samples: int) -> FitResult:
    """The fit of :func:`fit_chip_time` on (design row (5,), Δt_busy [s]) pairs."""
    x = np.array([r for r, _ in rows]).reshape(len(rows), len(CHIP_TIME_TERMS))
    fit = _robust_fit(x, np.array([dt for _, dt in rows], dtype=float), min_samples)[0]
    return fit.resolve() if isinstance(fit, LazyFitResult) else fit


@dataclass(frozen=True)
class _Frozen:
    """What a robust refit fixes until the next one (fitters/online.py). Vectors are in
    CHIP_TIME_TERMS order, physical units."""

    kept: list[int]
    dropped: dict[int, str]
    relations: dict[str, dict[str, float]]  # extra["collinear"], over the refit's rows
    nonzero: np.ndarray  # columns with a regressor in some row (bool, (5,))
    start: np.ndarray  # the NNLS start: a row's size is its prediction under it
    floor: float  # 0.01·median Δt [s], the smallest size
    beta: np.ndarray  # the robust solution
    f_scale: float  # of the soft_l1 loss, relative residual units
    active: np.ndarray  # kept terms at their bound 0 (bool, (len(kept),))
    reject: float  # |relative residual| beyond which a row is an outlier (weight 0)

    @functools.cached_property
    def gram_index(self) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray]:
        """Indices of the kept terms' normal matrix and right-hand side in the Gram sums (6×6):
        built once per refit, not at every exact step."""
        kept = np.array(self.kept, dtype=np.intp)
        return np.ix_(kept, kept), kept


def _robust_fit(x: np.ndarray, y: np.ndarray, min_samples: int,
                previous: _Frozen | None = None) -> tuple[FitResult, _Frozen | None, np.ndarray]:
    """The robust fit of :func:`fit_chip_time` on design rows x, shape (n, 5), and Δt_busy y,
    shape (n,) [s]; the soft_l1 solve starts from ``previous``'s solution when it kept the same terms
    (same minimum: the soft_l1 problem is convex), else from NNLS.

    Returns (fit, what the refit froze or None when the fit is not ok, each row's IRLS weight at
    the solution, shape (n,)); an ok fit is a :class:`~fitters.online.LazyFitResult` (its
    statistics are computed when first read, from copies of x and y).
    """
    n = len(y)
    if n < max(min_samples, 1):
        failed = FitResult.failed(
            Status.INSUFFICIENT_DATA, f"too few usable busy steps, need at least {min_samples}"
            + measured(f"{n} steps"), samples=n
        )
        return failed, None, np.ones(n)
    # Unit-RMS columns: coefficients span ~8 orders of magnitude (k_attn vs T_step).
    x_scale = _rms(x)
    xs = x / np.where(x_scale > 0, x_scale, 1.0)

    kept, dropped = _identifiable_columns(xs, x_scale)
    if not kept:  # scipy's nnls aborts the process on a design without columns
        failed = FitResult.failed(Status.INSUFFICIENT_DATA, "no chip-time term to fit: " + "; ".join(
            dropped[j] for j in sorted(dropped)), samples=n)
        return failed, None, np.ones(n)
    if n <= len(kept):
        failed = FitResult.failed(
            Status.INSUFFICIENT_DATA, "no more usable busy steps than terms to fit"
            + measured(f"{n} steps for {len(kept)} terms"), samples=n
        )
        return failed, None, np.ones(n)
    a = xs[:, kept]
    # Relative residuals: busy-time noise grows with Δt (a 10-s step jitters more than a 1-s one),
    # so rows are divided by their size: by Δt for the NNLS start, then by the start's prediction
    # (weights that do not depend on the row's own noise).
    p0, _ = nnls(a / y[:, None], np.ones(n))
    floor = 0.01 * median(y)
    size = np.maximum(a @ p0, floor)
    aw, yw = a / size[:, None], y / size
    sigma0 = robust_sigma(aw @ p0 - yw)
    warm = previous is not None and previous.kept == kept

    def solve(rows: np.ndarray | slice, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return bounded_lsq(aw[rows], yw[rows], p, 0.0, np.inf, sigma0)
    fit, active = solve(slice(None), previous.beta[kept] * x_scale[kept] if warm else p0)
    resid = aw @ fit - yw
    inlier, reject = np.ones(n, dtype=bool), math.inf
    # Many dips at one h bend the first solution and widen the residuals' σ, so some of them pass:
    # flag, refit without the flagged rows, and flag again with σ of every row's residual at the
    # new solution, until the set holds still. (σ of the inliers alone would shrink round by
    # round and erode a real engine's tails.)
    for _ in range(REJECT_ROUNDS):
        # relative residuals below 1e-6 are rounding, never outliers (a noiseless simulator)
        bound = max(OUTLIER_SIGMAS * robust_sigma(resid), 1e-6)
        flagged = np.abs(resid) <= bound
        if int(flagged.sum()) < _reject_floor(min_samples, len(kept)):
            break  # too few rows left to call the others outliers
        reject = bound
        if np.array_equal(flagged, inlier):
            break
        inlier = flagged
        fit, active = solve(inlier, fit)
        resid = aw @ fit - yw
    start, beta = np.zeros(len(CHIP_TIME_TERMS)), np.zeros(len(CHIP_TIME_TERMS))
    start[kept], beta[kept] = p0 / x_scale[kept], fit / x_scale[kept]
    relations = _relations(x, x_scale, kept, dropped)
    frozen = _Frozen(kept, dropped, relations, x_scale > 0, start, floor, beta, sigma0, active, reject)
    weights = soft_l1_weight(resid, sigma0) * inlier
    x, y = x.copy(), y.copy()
    return (LazyFitResult(lambda: _publish(x, y, x_scale, size, kept, dropped, relations, fit, min_samples)), frozen,
            weights)


def _reject_floor(min_samples: int, kept: int) -> int:
    """Fewest inliers with which the other rows are called outliers (REJECT_AFTER·min_samples, and
    more than the ``kept`` terms)."""
    return max(REJECT_AFTER * min_samples, kept + 1)


def _inliers(resid: np.ndarray, min_samples: int, kept: int) -> np.ndarray | None:
    """The rows (bool, shape of ``resid``) within OUTLIER_SIGMAS robust σ of the relative
    residuals ``resid`` that :func:`_publish` counts; None when fewer than :func:`_reject_floor`."""
    inlier = np.abs(resid) <= OUTLIER_SIGMAS * robust_sigma(resid)
    return inlier if int(inlier.sum()) >= _reject_floor(min_samples, kept) else None


def _rms(x: np.ndarray) -> np.ndarray:
    """Root mean square of each column, shape (5,)."""
    return np.sqrt(np.einsum("ij,ij->j", x, x) / len(x))


def _publish(x: np.ndarray, y: np.ndarray, x_scale: np.ndarray, size: np.ndarray, kept: list[int],
             dropped: dict[int, str], relations: dict[str, dict[str, float]], p: np.ndarray,
             min_samples: int) -> FitResult:
    """The FitResult of :func:`fit_chip_time` for the solution ``p`` (kept terms, unit-RMS column
    units) on rows x (n, 5), y (n,) sized by ``size`` (n,): outliers, covariance over the inliers,
    R², MAPE and condition number all computed from ``p``; ``relations`` (:func:`_relations`)."""
    n = len(y)
    a = x[:, kept] / x_scale[kept]
    aw, yw = a / size[:, None], y / size
    resid = aw @ p - yw
    inlier = _inliers(resid, min_samples, len(kept))
    if inlier is None:
        # As in the fit: too few inliers to judge outliers at all (near-identical rows make the
        # robust σ ~0 and every row an "outlier"), so every row counts.
        inlier = np.ones(n, dtype=bool)
    n_in = int(inlier.sum())
    a_in = aw[inlier]
    dof = n_in - len(kept)
    s2 = float(resid[inlier] @ resid[inlier]) / dof if dof > 0 else math.nan
    cov_s = s2 * np.linalg.pinv(a_in.T @ a_in)

    # Back to physical units: β_j = p_j/x_scale_j.
    unscale = 1.0 / x_scale[kept]
    beta = p * unscale
    cov = cov_s * np.outer(unscale, unscale)

    full_cov = np.zeros((len(CHIP_TIME_TERMS), len(CHIP_TIME_TERMS)))
    full_cov[np.ix_(kept, kept)] = cov
    params: dict[str, Estimate] = {}
    for j, name in enumerate(CHIP_TIME_TERMS):
        if j in kept:
            i = kept.index(j)
            est = Estimate(value=float(beta[i]), stderr=math.sqrt(max(float(cov[i, i]), 0.0)))
            params[name] = _carrier(name, est, relations)
        else:
            params[name] = Estimate(value=0.0, status=Status.NOT_IDENTIFIABLE, reason=dropped[j])

    pred = x[inlier][:, kept] @ beta
    y_in = y[inlier]
    # Uncentred: no intercept, and Δt is mostly the fixed scrape interval, so a centred R² would
    # measure scrape jitter, not the model.
    ss = float(y_in @ y_in)
    r2 = 1.0 - float(np.sum((y_in - pred) ** 2)) / ss if ss > 0 else math.nan
    # cond(a) = √(λmax/λmin) of aᵀa: a p×p eigenproblem instead of an SVD of the n×p design.
    eig = np.linalg.eigvalsh(a.T @ a)
    extra = {
        "outliers": n - n_in,
        "mape": float(np.mean(np.abs(y_in - pred) / y_in)),
        "condition_number": math.sqrt(eig[-1] / eig[0]) if eig[0] > 0 else math.inf,
    }
    if relations:
        extra["collinear"] = relations
    return FitResult(
        status=Status.OK,
        params=params,
        samples=n,
        r2=r2,
        covariance=tuple(tuple(float(v) for v in row) for row in full_cov),
        extra=extra,
    )


def _carrier(name: str, est: Estimate, relations: dict[str, dict[str, float]]) -> Estimate:
    """``est`` of kept term ``name``, or not identifiable when a dropped term's relation runs
    through it: its coefficient is then the combined time of its own regressor and of the ones
    riding on it (on the sweep's h = 0 phase, k_ffn 1.74e-4 s = k_ffn + 1024·k_attn +
    0.0625·k_dec, for a true k_ffn of 1e-4), no longer what its name says; the fit and its
    predictions along the relation stand (extra "collinear")."""
    riding = {dropped: rel[name] for dropped, rel in relations.items() if name in rel}
    if not riding:
        return est
    words = CHIP_TIME_REGRESSOR_WORDS
    return Estimate(est.value, est.stderr, Status.NOT_IDENTIFIABLE,
                    f"carries the time of {' and '.join(words[d] for d in riding)} too, which its steps did not vary "
                    f"apart from {words[name]}: their combined time per unit of {words[name]}, not its own"
                    # the whole relation: one term of it alone, with a negative factor, reads as nonsense
                    + measured(f"{est.value:.4g} ± {est.stderr:.2g}; " + "; ".join(
                        f"{words[d]} ≈ {relation_text(relations[d])}" for d in riding)))


def _relations(x: np.ndarray, x_scale: np.ndarray, kept: list[int], dropped: dict[int, str]
               ) -> dict[str, dict[str, float]]:
    """``fit_chip_time``'s extra "collinear" over a refit's rows x, shape (n, 5): for each dropped
    term, the relation its regressor follows on the kept ones in these rows (uncentred least
    squares, physical units, on the kept terms that carry at least RELATION_SHARE of its RMS; {}
    for a column with no regressor). Kept until the next refit, like the decision to drop the term."""
    if not dropped:
        return {}
    out = {}
    for j in sorted(dropped):
        partners, coef = list(kept), ()
        while x[:, j].any() and partners:
            coef = np.linalg.lstsq(x[:, partners] / x_scale[partners], x[:, j], rcond=None)[0]
            big = [k for k, c in zip(partners, coef) if abs(c) >= RELATION_SHARE * x_scale[j]]
            if len(big) == len(partners):
                break
            partners, coef = big, ()
        out[CHIP_TIME_TERMS[j]] = {CHIP_TIME_TERMS[k]: float(c / x_scale[k]) for k, c in zip(partners, coef)}
    return out


def _identifiable_columns(xs: np.ndarray, x_scale: np.ndarray) -> tuple[list[int], dict[int, str]]:
    """Column indices to fit (ascending) and, for the others, why not (MODEL.md §6).

    Columns are admitted in _KEEP_ORDER; one whose uncentred R² on the admitted ones exceeds
    COLLINEAR_R2 is dropped (uncentred because the model has no intercept).
    """
    kept: list[int] = []
    dropped: dict[int, str] = {}
    for name in _KEEP_ORDER:
        j = CHIP_TIME_TERMS.index(name)
        if x_scale[j] == 0:
            dropped[j] = f"{name}: no {CHIP_TIME_REGRESSOR_WORDS[name]} in any usable step"
            continue
        col = xs[:, j]
        if kept:
            basis = xs[:, kept]
            coef, *_ = np.linalg.lstsq(basis, col, rcond=None)
            resid = col - basis @ coef
            r2 = 1.0 - float(resid @ resid) / float(col @ col)
            if r2 > COLLINEAR_R2:
                # Unit-RMS columns: |coef| is each partner's share of the explanation.
                big = np.abs(coef) >= 0.05 * np.max(np.abs(coef))
                partners = tuple(CHIP_TIME_TERMS[k] for k, b in zip(kept, big) if b)
                reason = (
                    f"{CHIP_TIME_REGRESSOR_WORDS[name]} collinear with "
                    f"{' + '.join(CHIP_TIME_REGRESSOR_WORDS[k] for k in partners)}"
                )
                hint = _HINTS.get((name, partners))
                # over the rows judged: between refits the online fit's exact steps carry the verdict
                dropped[j] = (f"{reason}: {hint}" if hint else reason) + measured(f"R² {r2:.5f} over {len(col)} steps")
                continue
        kept.append(j)
    return sorted(kept), dropped


def predict_busy_time(coef: ChipTimeCoefficients, obs: Observation) -> float:
    """Predicted Δt_busy [s] of one step from its five regressors (MODEL.md §7).

    A regressor may be unknown (None) only where its coefficient is 0 (e.g. a not-identifiable
    term). Raises ValueError otherwise.
    """
    total = 0.0
    for name, k, v in zip(CHIP_TIME_TERMS, coef.as_tuple(), observed_regressors(obs)):
        if k == 0.0:
            continue
        if v is None:
            raise ValueError(f"observation lacks the regressor of {name}")
        total += k * v
    return total


# The cells a full chip-time fit evicts from (ChipTimeFitter._evict): h in steps of CELL_H, ISL by octave
CELL_H = 0.05


def octave(x: float) -> float:
    """log2 x rounded; nan (no octave, equal to none) for x nan or ≤ 0. Per step: :func:`octaves`'
    numpy calls cost 10x more on one value."""
    return float(round(math.log2(x))) if x > 0.0 else math.nan


def octaves(x: np.ndarray) -> np.ndarray:
    """:func:`octave` of every element of x (an array of any shape)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(x > 0.0, np.round(np.log2(x)), np.nan)


def traffic_cell(h: float, isl: float) -> float:
    """The (h, ISL) cell of a step, as one float: h to CELL_H (unknown h, nan: a cell of its own), log2
    ISL rounded."""
    hb = math.floor(min(max(h, 0.0), 1.0) / CELL_H) if math.isfinite(h) else -1
    return float(hb * 256 + octave(max(isl, 1.0)))


class ChipTimeFitter(AmortizedFit[_Frozen, tuple[FitResult, "np.ndarray | None"]]):
    """Online §7 chip-time fit over up to ``capacity`` busy steps, the latest of each (h, ISL) cell
    (MODEL.md §7, §6; fitters/online.py).

    Memory bound: a :class:`~fitters.online.RowBuffer` of ``capacity`` usable steps (default 720
    rows = an hour of 5-s scrapes; beyond it a step replaces one from before the latest restart, or
    the oldest of the (h, ISL) cell holding the most, :meth:`_evict`), 7 floats each (5 regressors,
    Δt, frozen weight), 2·capacity rows of storage, and 5 floats beside each (ISL, OSL, cell, busy
    engines, restarts before it). :meth:`result` is :func:`fit_chip_time` (warm-started) on the
    buffered rows when no ok refit exists or ``every`` rows arrived since the last one; in
    between, the exact weighted least squares of all buffered rows in the relative residuals of
    that refit (each row divided by its size under the refit's NNLS start), with its soft_l1
    IRLS weights frozen (its outliers at 0; a new row: the weight at its residual under the
    refit's solution and f_scale, 0 beyond the refit's outlier threshold), its dropped terms
    dropped and the terms it held at 0 fixed at 0, solved from the running sums of the rows'
    normal equations (:class:`~fitters.online.GramSums` of (regressors, Δt)/size, 6×6);
    outliers, covariance, R² and the rest are computed from that solution as in
    :func:`fit_chip_time` when the result is first read (:class:`~fitters.online.LazyFitResult`).
    It refits instead when a free term would turn negative or a regressor column becomes
    (non-)zero. Cached until new data. Nothing is learned at construction. :attr:`drift` says
    when the engine changed speed (DRIFT): its steps are then no longer one engine's.
    Raises ValueError for capacity < 1 or every < 1.
    """

    def __init__(self, capacity: int = 720, min_samples: int = 10, every: int = REFIT_EVERY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be ≥ 1")
        super().__init__(capacity, len(CHIP_TIME_TERMS) + 1, every, basis_width=len(CHIP_TIME_TERMS) + 1)
        self.capacity = capacity
        self.min_samples = min_samples
        # each row's (ISL, OSL, cell, busy engines, epoch, concurrency octave, h), evicted with it; rows per cell
        self._tags = RowBuffer(capacity, 7)
        self._cells: dict[float, int] = {}
        self._epoch = 0.0  # engine restarts so far (restarted)
        self._multi = 0  # rows with other than one busy engine (busy_engines' mean is 1 without them)
        self._watch = ShiftTest(DRIFT, "busy steps", DRIFT_STEPS, DRIFT_REFERENCE, DRIFT_SIGMAS)
        self.drift: Shift | None = None  # how much the engine changed speed (:meth:`update`, DRIFT_REASON), once found

    def update(self, obs: Observation, engines: float = 1.0) -> bool:
        """Add one step; True if it was usable (see :func:`design_row`) and stored. ``engines``:
        the data-parallel engines busy in it (:meth:`busy_engines`). Sets :attr:`drift` (the
        relative change) when the engine's chip time per unit of work has changed (DRIFT,
        DRIFT_REASON): its earlier steps no longer describe it, and whoever owns the fitter starts
        afresh."""
        row = design_row(obs)
        if row is None:
            return False
        h = math.nan if obs.hit_ratio is None else obs.hit_ratio
        cell = traffic_cell(h, obs.isl)
        k = self.append((*row, obs.dt))
        if len(self._tags) == self.capacity:
            gone = self._tags.view()[k]
            self._cells[gone[2]] -= 1
            if not self._cells[gone[2]]:
                del self._cells[gone[2]]
            self._multi -= gone[3] != 1.0
        running = math.nan if obs.running is None else obs.running / engines
        # ISL, OSL known: ΔC_dec needs both
        self._tags.append((obs.isl, obs.osl, cell, engines, self._epoch, octave(running), h), k)
        self._cells[cell] = self._cells.get(cell, 0) + 1
        self._multi += engines != 1.0
        state = self._state
        if state is not None and self._watch.arrived(float(self._relative(row, obs.dt, engines, state)),
                                                     self.rows.appended):
            self.drift = self._changed(state)
        return True

    def _relative(self, x: np.ndarray, dt, engines, state: _Frozen) -> np.ndarray:
        """Relative residuals (n,) of rows x (n, 5) with busy times dt (n,) [s] (or of one row, (5,),
        and its dt and busy engines) under a refit: as
        :meth:`_weigh`'s, each Δt × its busy engines / :meth:`busy_engines`' mean (the work of more
        engines in the same wall time is no faster engine)."""
        if self._multi:
            dt = dt * engines / self.busy_engines(1.0)
        return (x @ state.beta - dt) / np.maximum(x @ state.start, state.floor)

    def _changed(self, state: _Frozen) -> Shift | None:
        """How much the engine's chip time per unit of work changed, or None when its last
        DRIFT_STEPS rows do not say so (:meth:`fitters.online.ShiftTest.compare`; the traffic: ISL,
        OSL and concurrency per engine by octave; references bracketing each step in h)."""
        tags = self._tags.view()
        x = self.rows.view()
        traffic = np.column_stack([octaves(np.maximum(tags[:, :2], 1.0)), tags[:, 5]])
        return self._watch.compare(self._relative(x[:, :5], x[:, 5], tags[:, 3], state), traffic, tags[:, 6])

    def restarted(self) -> None:
        """The engine restarted (as the same engine: its configuration unchanged): the steps
        before go first, oldest first, so that within ``capacity`` new steps none is left of an
        engine whose physics a restart may have changed unseen (flags vLLM does not export)."""
        self._epoch += 1.0

    def _evict(self) -> int:
        """The oldest row when it predates the latest restart (:meth:`restarted`), else the oldest
        of the (h, ISL) cell (:func:`traffic_cell`) holding the most: steady traffic replaces its own
        steps and keeps those of the other h and ISL it saw, which tell the prefill's terms apart
        (at one h and ISL, FFN and attention work grow alike: collinear, one term dropped, the
        chip-time bathtub withheld after 720 steps of it). Rows stay in time order, so the
        restart's older rows are the first."""
        tags = self._tags.view()
        if tags[0, 4] < self._epoch:
            return 0
        cell = max(self._cells, key=self._cells.__getitem__)
        return int(np.argmax(tags[:, 2] == cell))

    def busy_engines(self, default: float) -> float:
        """The harmonic mean of the busy engines over the buffered rows (``default`` without one):
        the fit sees the busy engines' summed work per wall second, so its coefficients are one
        engine's / E_i in row i, over the rows one engine's × the mean of 1/E_i, and one engine's
        are the fitted × this mean (exact when E_i is the same in every row): E of
        :meth:`ChipTimeCoefficients.per_engine`."""
        if not len(self._tags):
            return default
        return float(len(self._tags) / np.sum(1.0 / self._tags.view()[:, 3]))

    def ranges(self) -> tuple[tuple[float, float] | None, tuple[float, float], tuple[float, float]] | None:
        """((h min, max) [1], (ISL min, max), (OSL min, max) [tokens]) of the buffered steps' h
        and mean ISL and OSL (each step's, as its regressors took them): where the coefficients
        were fitted (beyond it a prediction extrapolates, MODEL.md §7: on the bundled CPU trace a
        fit over h ≤ 0.3 gave half the chip time at h 0.96 that its first sweep's, to h 0.97, did;
        a request of mixed traffic may be longer than every step's mean); h's None when no step
        told it; None without a step."""
        if not len(self._tags):
            return None
        tags = self._tags.view()
        h = tags[:, 6][np.isfinite(tags[:, 6])]
        lo, hi = tags[:, :2].min(axis=0).tolist(), tags[:, :2].max(axis=0).tolist()
        return (float(h.min()), float(h.max())) if h.size else None, (lo[0], hi[0]), (lo[1], hi[1])

    def result(self) -> FitResult:
        """The fit over the buffered rows (class docstring); cached until new data."""
        return self.solve()[0]

    def _refit(self, x: np.ndarray, key: object,
               previous: _Frozen | None) -> tuple[tuple[FitResult, np.ndarray | None], _Frozen | None, np.ndarray]:
        fit, frozen, weights = _robust_fit(x[:, :-1], x[:, -1], self.min_samples, previous)
        return (fit, None if frozen is None else frozen.beta), frozen, weights

    def _weigh(self, x: np.ndarray, v: np.ndarray, key: object, state: _Frozen) -> np.ndarray:
        resid = v[:, :-1] @ state.beta - v[:, -1]  # relative to the row's size (_basis)
        return soft_l1_weight(resid, state.f_scale) * (np.abs(resid) <= state.reject)

    def _basis(self, x: np.ndarray, state: _Frozen) -> tuple[np.ndarray, float, None]:
        # (regressors, Δt) divided by the row's size under the refit's start: the relative residuals
        return x / np.maximum(x[:, :-1] @ state.start, state.floor)[:, None], 1.0, None

    def _exact(self, x: np.ndarray, w: np.ndarray, key: object,
               state: _Frozen) -> tuple[FitResult, np.ndarray] | None:
        xr = x[:, :-1]
        if not np.array_equal(xr.any(axis=0), state.nonzero):  # regressors are ≥ 0
            return None
        kept, k = state.kept, len(state.kept)
        g = self.sums.g[0]
        square, column = state.gram_index
        sol = solve_normal(g[square], g[column, -1], state.active, np.zeros(k), np.zeros(k), np.full(k, np.inf))
        if sol is None:
            return None
        beta = np.zeros(len(CHIP_TIME_TERMS))
        beta[kept] = sol
        xr, y = xr.copy(), x[:, -1].copy()
        need = _reject_floor(self.min_samples, k)
        if state.reject == math.inf and need <= len(x) < 2 * need:
            # the refit had too few inliers to call any row an outlier, and the exact steps keep
            # every new row: once the published errors have enough inliers to judge outliers, refit
            # (past 2·need rows, more than half of them outliers, the schedule's refits do)
            if _inliers((xr @ beta - y) / np.maximum(xr @ state.start, state.floor), self.min_samples, k) is not None:
                return None

        def publish() -> FitResult:
            x_scale = _rms(xr)
            size = np.maximum(xr @ state.start, state.floor)
            return _publish(xr, y, x_scale, size, kept, state.dropped, state.relations, sol * x_scale[kept],
                            self.min_samples)
        return LazyFitResult(publish), beta

    def coefficients(self) -> ChipTimeCoefficients | None:
        """Fitted coefficients when the fit is ok (not-identifiable terms as 0), else None."""
        beta = self.solve()[1]
        return None if beta is None else ChipTimeCoefficients(*map(float, beta))
