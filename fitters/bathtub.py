"""The bathtub: revenue per machine-second against hit ratio, both forms (MODEL.md §4, seed 002).

Pure math on already fitted parameters: no state, no I/O. ``linear`` is the seed's form
R(h) = TPS0·P_miss·(1-a·h)·(1-(1-ρ)·h)/(1-h) with closed-form bottom and break-even;
``chip_time`` is R(h) = (P_miss·M + P_hit·H + P_out·OSL) / t_chip(h) from the §7 chip-time model,
which tends to a finite value as h → 1, so its valley may have no exit.
Hit ratios are fractions in [0, 1]; prices are per token; revenue is price per machine-second.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq

from fitters.model import (
    CHIP_TIME_TERMS,
    ChipTimeCoefficients,
    breakeven_linear,
    chip_time_regressors,
    max_hit_ratio,
    revenue_chip_time,
    revenue_linear,
    revenue_slope_chip_time,
    revenue_slope_linear,
    valley_bottom_linear,
)
from fitters.result import Z95

LINEAR_H_MAX = 0.99  # right end of the linear form's default grid: R → ∞ as h → 1
_REL_STEP = 1e-5  # central-difference step, relative to the quantity it perturbs


@dataclass(frozen=True)
class BathtubCurve:
    """One bathtub evaluated at the current operating point (MODEL.md §4).

    Attributes:
        form: "linear" or "chip_time" (the metric label ``form``).
        h_now: current token-level hit ratio [1].
        revenue_now: R(h_now) [price/s per machine].
        revenue_zero: R(0) [price/s per machine]; nan where not identifiable (a chip-time fit
            whose steps never came near h = 0, published near h_now only).
        slope_now: dR/dh at h_now [price/s per unit h].
        slope_ci: (lo, hi) 95 % interval of slope_now by the delta method from the fit covariance;
            None when no covariance was given.
        h_star: valley bottom; None when there is no valley (R'(0) ≥ 0).
        h_even: the h > h_star where R climbs back to R(0); None when no valley or no exit.
        exit: when a valley exists, whether R climbs back to R(0) before h_max (the linear form: before
            h = 1, where its R grows without bound when ρ < a < 1, past its curve's last point); None otherwise.
        valley_active: h_now > 0, slope_now < 0 and the upper end of slope_ci < 0 (False when slope_ci
            is None; at h = 0, R(h) = R(0): nothing is lost yet).
        curve: ((h, R(h)), ...) on the grid, for dashboards.
        h_star_stderr, h_even_stderr: standard errors [1] of h_star and h_even by the delta method
            from the fit covariance, through the equations that define them (implicit function:
            R'(h*) = 0, R(h_even) = R(0)); the chip-time form's at least the edge's moves at
            coefficients 1.96 σ either way (:func:`_beyond_linear`); None with their edge, without a
            covariance, and for an h* at the wall (h_max, where R still falls: no equation holds there).
    """

    form: str
    h_now: float
    revenue_now: float
    revenue_zero: float
    slope_now: float
    slope_ci: tuple[float, float] | None
    h_star: float | None
    h_even: float | None
    exit: bool | None
    valley_active: bool
    curve: tuple[tuple[float, float], ...]
    h_star_stderr: float | None = None
    h_even_stderr: float | None = None


def _grid(grid: int | Sequence[float], h_max: float, below: float | None = None) -> np.ndarray:
    """An int means that many evenly spaced points on [0, h_max]; a sequence is used as given, each
    point in [0, h_max] (or in [0, ``below``) when given). Raises ValueError otherwise."""
    if isinstance(grid, (int, np.integer)):
        if grid < 2:
            raise ValueError("grid must have at least 2 points")
        return np.linspace(0.0, h_max, grid)
    hs = np.asarray(grid, dtype=float)
    inside = (hs >= 0.0) & ((hs < below) if below is not None else (hs <= h_max))
    if hs.ndim != 1 or not inside.all():
        raise ValueError(f"grid points must be hit ratios in [0, {h_max if below is None else below}"
                         f"{']' if below is None else ')'}")
    return hs


def _finite(**values: float) -> None:
    bad = [name for name, v in values.items() if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{', '.join(bad)} must be finite numbers")


def _cov(cov, n: int) -> np.ndarray | None:
    if cov is None:
        return None
    c = np.asarray(cov, dtype=float)
    if c.shape != (n, n):
        raise ValueError(f"cov must be {n}x{n}, got shape {c.shape}")
    return c


def _central_gradient(f: Callable[[np.ndarray], float], x: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """∂f/∂x_j by central differences; a zero step means f does not depend on x_j (gradient 0)."""
    g = np.zeros(len(x))
    for j, s in enumerate(steps):
        if s == 0.0:
            continue
        up, dn = x.copy(), x.copy()
        up[j] += s
        dn[j] -= s
        g[j] = (f(up) - f(dn)) / (2.0 * s)
    return g


def _interval(value: float, grad: np.ndarray, cov: np.ndarray | None) -> tuple[float, float] | None:
    """value ± Z95·sqrt(gᵀΣg) (delta method); a slightly non-PSD Σ is clipped to variance 0."""
    if cov is None:
        return None
    half = Z95 * math.sqrt(max(float(grad @ cov @ grad), 0.0))
    return float(value - half), float(value + half)


def _stderr(grad: np.ndarray, cov: np.ndarray, scale: float) -> float | None:
    """sqrt(gᵀΣg) / |scale| (delta method through an equation F(h, θ) = 0: dh/dθ = −∂F/∂θ / ∂F/∂h,
    ``grad`` = ∂F/∂θ, ``scale`` = ∂F/∂h); None when ∂F/∂h is 0 or not finite."""
    if not (math.isfinite(scale) and scale != 0.0):
        return None
    return math.sqrt(max(float(grad @ cov @ grad), 0.0)) / abs(scale)


def _beyond_linear(value: float, grad: np.ndarray, scale: float, cov: np.ndarray, x0: np.ndarray,
                   solve: Callable[[np.ndarray], float | None]) -> float | None:
    """The larger of the delta method's standard error se of a root h(θ) of F(h, θ) = 0
    (:func:`_stderr`: ``grad`` = ∂F/∂θ, shape (5,), ``scale`` = ∂F/∂h; ∂h/∂θ = −grad/scale) and
    its moves where the coefficients x0 ± Z95·δ (δ = Σ·∂h/∂θ/se, the 1-σ step along which h moves
    most, clipped at 0) put the root ``solve(x)`` (None: no root to read), over Z95. h* and
    h_even are strongly nonlinear in coefficients known to 20–60 % (early windows, 10 % noise):
    the delta method alone left the truth outside 95 % intervals 21–23 % of the time (a
    calibration audit of 200 simulated sweeps); moved by 1.96 σ, k_attn can take the bottom from
    0.3 to 0.6. None when se is (∂F/∂h 0 or not finite)."""
    se = _stderr(grad, cov, scale)
    if se is None or not 0.0 < se < math.inf or not np.all(np.isfinite(grad)):
        return se
    delta = cov @ (-grad / scale) / se
    moves = []
    for sign in (1.0, -1.0):
        try:
            h = solve(np.maximum(x0 + sign * Z95 * delta, 0.0))
        except ValueError:  # a root finder's ends of one sign: rounding at a limit
            h = None
        if h is not None:
            moves.append(abs(h - value) / Z95)
    return max([se, *moves])


def _active(h: float, slope: float, ci: tuple[float, float] | None) -> bool:
    # at h = 0, R(h) = R(0): R'(0) < 0 says more hits would lose, but none is lost yet (MODEL.md §4)
    return bool(h > 0.0 and ci is not None and slope < 0.0 and ci[1] < 0.0)


def bathtub_linear(
    tps0: float,
    a: float,
    cov,
    h_now: float,
    p_miss: float,
    rho: float,
    grid: int | Sequence[float] = 50,
) -> BathtubCurve:
    """The seed's linear bathtub at h_now (MODEL.md §4 ``linear`` form, seed 002 §3).

    Args:
        tps0: miss throughput at h = 0 [tokens/s]; a: miss slope [1] (TPS_miss = TPS0·(1-a·h)).
        cov: 2×2 covariance of (tps0, a), array-like (units (tokens/s)², tokens/s, 1), or None.
        h_now: current hit ratio, 0 ≤ h_now < 1. p_miss: miss-token price (TPS0·P_miss > 0 is
            assumed, so R'(0) < 0 ⇔ a > ρ); rho: P_hit / P_miss [1].
        grid: number of evenly spaced curve points on [0, LINEAR_H_MAX], or explicit h values (< 1).

    Bottom and break-even are the closed forms h* = 1 - sqrt(ρ(1-a)/(a(1-ρ))) and
    h_even = (a-ρ)/(a(1-ρ)); when ρ < a < 1 the valley always exits (R → ∞ as h → 1).
    Outside that range a valley (R'(0) < 0, i.e. a > ρ) can still exist when ρ ≤ 0 or a ≥ 1; R then
    never turns back up inside [0, 1), so h_star and h_even are None and exit is False.
    slope_ci: delta method with the exact gradient of R'(h_now) in (tps0, a) (R' is bilinear in them).

    Raises ValueError if h_now is outside [0, 1), tps0, a, p_miss or rho is not finite,
    TPS0·P_miss ≤ 0, a grid point is outside [0, 1), or cov is not 2×2.
    """
    if not 0.0 <= h_now < 1.0:
        raise ValueError("h_now must be in [0, 1) for the linear form")
    _finite(tps0=tps0, a=a, p_miss=p_miss, rho=rho)
    if not tps0 * p_miss > 0.0:  # the valley test below reads R'(0) < 0 as a > ρ
        raise ValueError("TPS0·P_miss must be > 0")
    c = _cov(cov, 2)

    def slope(x: np.ndarray) -> float:
        return revenue_slope_linear(h_now, x[0], x[1], p_miss, rho)

    slope_now = float(slope(np.array([tps0, a], dtype=float)))
    ci = None
    if c is not None:
        x = np.array([tps0, a], dtype=float)
        # R' is linear in each parameter, so central differences are exact up to rounding.
        g = _central_gradient(slope, x, np.array([max(abs(tps0), 1.0) * _REL_STEP, _REL_STEP]))
        ci = _interval(slope_now, g, c)

    h_star = h_even = exit_ = h_star_se = h_even_se = None
    if a > rho:  # R'(0) = TPS0·P_miss·(ρ - a) < 0, as TPS0·P_miss > 0
        h_star = valley_bottom_linear(a, rho)
        h_even = breakeven_linear(a, rho)
        exit_ = h_even is not None
        if h_star is not None and c is not None:  # both closed forms depend on a alone: |dh/da|·σ_a
            step, sd_a = min(_REL_STEP, (a - rho) / 2, (1.0 - a) / 2), math.sqrt(max(float(c[1, 1]), 0.0))
            h_star_se, h_even_se = (abs(edge(a + step, rho) - edge(a - step, rho)) / (2 * step) * sd_a
                                    for edge in (valley_bottom_linear, breakeven_linear))
    hs = _grid(grid, LINEAR_H_MAX, below=1.0)
    curve = tuple((float(h), float(revenue_linear(float(h), tps0, a, p_miss, rho))) for h in hs)
    return BathtubCurve(
        form="linear",
        h_now=float(h_now),
        revenue_now=float(revenue_linear(h_now, tps0, a, p_miss, rho)),
        revenue_zero=float(revenue_linear(0.0, tps0, a, p_miss, rho)),
        slope_now=slope_now,
        slope_ci=ci,
        h_star=h_star,
        h_even=h_even,
        exit=exit_,
        valley_active=_active(h_now, slope_now, ci),
        curve=curve,
        h_star_stderr=h_star_se,
        h_even_stderr=h_even_se,
    )


def _coef_steps(coef: ChipTimeCoefficients, t_fixed: float, isl: float, osl: float, fixed_steps: float) -> np.ndarray:
    """Central-difference steps for the 5 coefficients (CHIP_TIME_TERMS order).

    Each step moves t_chip(0) by _REL_STEP relative, so s/token and s/token² terms are resolved
    alike. A coefficient whose regressor is 0 gets step 0 (gradient 0): t_step when T_fixed is
    exact (``fixed_steps`` 0); k_dec and k_ctx when OSL = 0.
    """
    regressors = np.array(chip_time_regressors(isl, osl, 0.0, fixed_steps))
    t0 = coef.t_chip(isl, osl, 0.0, t_fixed)
    safe = np.where(regressors != 0.0, regressors, 1.0)
    return np.where(regressors != 0.0, _REL_STEP * t0 / safe, 0.0)


def _t_fixed_at(x: np.ndarray, x0: np.ndarray, t_fixed: float, fixed_steps: float) -> float:
    """T_fixed [s] at coefficients x: t_fixed at x0, moving with t_step (x[0]) × fixed_steps."""
    return t_fixed + (x[0] - x0[0]) * fixed_steps


def _check_chip(coef: ChipTimeCoefficients, t_fixed: float, isl: float, osl: float, hs: np.ndarray) -> None:
    if isl <= 0:
        raise ValueError("isl must be > 0 tokens")
    t = [coef.t_chip(isl, osl, float(h), t_fixed) for h in hs]
    if not all(v > 0.0 for v in t):
        raise ValueError("t_chip must be > 0 s on the whole h range")


def bathtub_chip_time(
    coef: ChipTimeCoefficients,
    cov,
    t_fixed: float,
    isl: float,
    osl: float,
    h_now: float,
    p_miss: float,
    p_hit: float,
    p_out: float,
    h_max: float | None = None,
    grid: int | Sequence[float] = 50,
    fixed_steps: float = 0.0,
) -> BathtubCurve:
    """The exact chip-time bathtub at the current ISL/OSL (MODEL.md §4 ``chip_time`` form, §7).

    R(h) = (P_miss·(1-h)·ISL + P_hit·h·ISL + P_out·OSL) / t_chip(h) [price/s], with
    t_chip(h) = T_fixed + k_ffn·M + k_attn·(M·H + M²/2) + OSL·(k_dec + k_ctx·(ISL + OSL/2)) [s].

    Args:
        coef: fitted chip-time coefficients (units in ChipTimeCoefficients).
        cov: 5×5 covariance of the coefficients in CHIP_TIME_TERMS order, array-like, or None.
        t_fixed: hit-independent chip time per request [s].
        isl, osl: current mean prompt / output length [tokens]; isl > 0.
        h_now: current hit ratio in [0, h_max]. p_miss, p_hit, p_out: prices per token.
        h_max: right end of the h range; default 1 - 1/ISL (the last prompt token is never a hit).
        grid: number of evenly spaced curve points on [0, h_max], or explicit h values.
        fixed_steps: the engine steps per request T_fixed counts, T_fixed = t_step × fixed_steps
            (MODEL.md §7): t_step's variance enters the interval through T_fixed; 0 treats
            t_fixed as exact.

    h_star: brentq on R'(h) = 0 over [0, h_max] when R'(0) < 0 (R is unimodal there: the
    numerator of R' is a quadratic increasing in h while revenue is positive); it equals h_max when
    R still falls at h_max. h_even: brentq on R(h) - R(0) over [h_star, h_max] when R(h_max) ≥ R(0);
    otherwise exit is False and h_even None ("the valley has no exit"). The same search finds the
    edges under the moved coefficients of their standard errors.
    slope_ci: delta method, numerical gradient of R'(h_now) in the 5 coefficients × cov.

    Raises ValueError if isl ≤ 0, h_max is not in (0, 1], h_now is not in [0, h_max], a price or
    coefficient is not a finite number ≥ 0 (the bottom's search needs R unimodal), a grid point is
    outside [0, h_max], cov is not 5×5, or t_chip ≤ 0 anywhere on [0, h_max].
    """
    _finite(p_miss=p_miss, p_hit=p_hit, p_out=p_out, t_fixed=t_fixed, osl=osl)
    if min(p_miss, p_hit, p_out) < 0.0:
        raise ValueError("prices must be ≥ 0")
    coef.check(*CHIP_TIME_TERMS)
    if isl <= 0:
        raise ValueError("isl must be > 0 tokens")
    if h_max is None:
        h_max = max_hit_ratio(isl)
    if not 0.0 < h_max <= 1.0:
        raise ValueError("h_max must be in (0, 1]")
    if not 0.0 <= h_now <= h_max:
        raise ValueError("h_now must be in [0, h_max]")
    c = _cov(cov, len(CHIP_TIME_TERMS))
    hs = _grid(grid, h_max)
    # t_chip is concave in h (k_attn ≥ 0), so its minimum on [0, h_max] is at an end.
    _check_chip(coef, t_fixed, isl, osl, np.array([0.0, h_max]))

    x0 = np.array(coef.as_tuple(), dtype=float)

    def under(k: ChipTimeCoefficients, tf: float, h: float, slope: bool = False) -> float:  # R(h) or R'(h)
        fn = revenue_slope_chip_time if slope else revenue_chip_time
        return fn(h, isl, osl, k, tf, p_miss, p_hit, p_out)

    def at(x: np.ndarray, h: float, slope: bool = False) -> float:  # under coefficients x
        return under(ChipTimeCoefficients(*x), _t_fixed_at(x, x0, t_fixed, fixed_steps), h, slope)

    def rev(h: float) -> float:
        return at(x0, h)

    slope_now = float(at(x0, h_now, True))
    ci = steps = None
    if c is not None:
        steps = _coef_steps(coef, t_fixed, isl, osl, fixed_steps)
        ci = _interval(slope_now, _central_gradient(lambda x: at(x, h_now, True), x0, steps), c)

    def edge(x: np.ndarray, even: bool, xtol: float = 1e-9) -> float | None:
        """h* (or h_even) under coefficients x ≥ 0 by root finding on R' (and R − R(0)), at its
        limit where it left [0, h_max] (no valley: 0; no exit: h_even = h_max); None where
        t_chip ≤ 0 (it falls with h: h_max tells)."""
        k, tf = ChipTimeCoefficients(*x), _t_fixed_at(x, x0, t_fixed, fixed_steps)
        if k.t_chip(isl, osl, h_max, tf) <= 0.0:
            return None
        r = functools.partial(under, k, tf)  # the coefficients built once for the root finders
        if r(0.0, True) >= 0.0:
            return 0.0
        if r(h_max, True) <= 0.0:
            return h_max
        r0x = r(0.0)
        if even and r(h_max) < r0x:  # no exit (R(bottom) ≤ R(h_max): the bottom is not needed)
            return h_max
        bottom = float(brentq(lambda h: r(h, True), 0.0, h_max, xtol=xtol))
        if not even or r(bottom) >= r0x:
            return bottom  # a bottom within rounding of R(0) (R'(0) a hair below 0): back at once
        return float(brentq(lambda h: r(h) - r0x, bottom, h_max, xtol=xtol))

    r0 = rev(0.0)
    h_star = h_even = exit_ = h_star_se = h_even_se = None
    if at(x0, 0.0, True) < 0.0:
        # the fitted coefficients' edges as the interval's moved ones (_beyond_linear), to 1e-12
        h_star = edge(x0, False, 1e-12)
        exit_ = bool(rev(h_max) >= r0)
        if exit_:
            h_even = edge(x0, True, 1e-12)
        if c is not None and h_star < h_max:
            # F = R'(h*) = 0: ∂F/∂h = R''(h*), by central differences of R' (e: within [0, h_max])
            e = min(1e-4, h_star, h_max - h_star)
            curvature = (at(x0, h_star + e, True) - at(x0, h_star - e, True)) / (2 * e) if e > 0 else math.nan
            grad = _central_gradient(lambda x: at(x, h_star, True), x0, steps)
            h_star_se = _beyond_linear(h_star, grad, curvature, c, x0, lambda x: edge(x, False))
        if c is not None and h_even is not None:  # F = R(h_even) − R(0) = 0: ∂F/∂h = R'(h_even)
            grad = _central_gradient(lambda x: at(x, h_even) - at(x, 0.0), x0, steps)
            h_even_se = _beyond_linear(h_even, grad, at(x0, h_even, True), c, x0, lambda x: edge(x, True))
    return BathtubCurve(
        form="chip_time",
        h_now=float(h_now),
        revenue_now=float(rev(h_now)),
        revenue_zero=float(r0),
        slope_now=slope_now,
        slope_ci=ci,
        h_star=h_star,
        h_even=h_even,
        exit=exit_,
        valley_active=_active(h_now, slope_now, ci),
        curve=tuple((float(h), float(rev(float(h)))) for h in hs),
        h_star_stderr=h_star_se,
        h_even_stderr=h_even_se,
    )


def derived_miss_slope(
    coef: ChipTimeCoefficients,
    cov,
    t_fixed: float,
    isl: float,
    osl: float,
    h_lo: float,
    h_hi: float,
    n: int = 41,
    fixed_steps: float = 0.0,
) -> tuple[float, float, float]:
    """The chip-time model's equivalent of seed 002's line ("derived a", MODEL.md §4, §7).

    Least-squares line through TPS_miss(h) = (1-h)·ISL / t_chip(h) [miss tokens per busy second,
    decode included] over [h_lo, h_hi] (use the h range of the direct data), every stretch of h
    counted by its width as the direct line counts them (fitters/missslope.py): the integral
    ∫(y − b0 − b1·h)² dh by Simpson's rule at n evenly spaced h (n odd; the trapezoid rule for n
    even). Equal weights gave the end points a whole step each, and the steep end near h = 1
    tilted the line by O(1/n): a 0.330 for a continuous 0.300 over [0, 0.99] at n = 41 (Simpson:
    within 1e-4).

    Args:
        coef, cov: chip-time coefficients and their 5×5 covariance (CHIP_TIME_TERMS order) or None.
        t_fixed: hit-independent chip time per request [s].
        isl, osl: current mean prompt / output length [tokens].
        h_lo, h_hi: the h range, 0 ≤ h_lo < h_hi ≤ 1. n: grid points, ≥ 2.
        fixed_steps: as in :func:`bathtub_chip_time` (t_step's variance enters a's stderr).

    Returns:
        (tps0, a, a_stderr): intercept [tokens/s], a = -slope/intercept [1], and the 1-sigma
        standard error of a by numerical gradient in the coefficients × cov (nan when cov is None).

    Raises ValueError if h_hi ≤ h_lo, the range leaves [0, 1], n < 2, isl ≤ 0, cov is not 5×5, or
    t_chip ≤ 0 somewhere on the grid.
    """
    if h_hi <= h_lo:
        raise ValueError("h_hi must be > h_lo")
    if h_lo < 0.0 or h_hi > 1.0:
        raise ValueError("h range must lie in [0, 1]")
    if n < 2:
        raise ValueError("n must be >= 2")
    c = _cov(cov, len(CHIP_TIME_TERMS))
    hs = np.linspace(h_lo, h_hi, n)
    _check_chip(coef, t_fixed, isl, osl, hs)
    # polyfit weighs residuals by w: √ of the quadrature weights (Simpson 1, 4, 2, …, 4, 1)
    weights = np.r_[1.0, np.tile([4.0, 2.0], (n - 3) // 2), 4.0, 1.0] if n % 2 else np.r_[0.5, np.ones(n - 2), 0.5]
    root_w = np.sqrt(weights)

    x0 = np.array(coef.as_tuple(), dtype=float)

    def fit(x: np.ndarray) -> tuple[float, float]:
        k, tf = ChipTimeCoefficients(*x), _t_fixed_at(x, x0, t_fixed, fixed_steps)
        tps = [(1.0 - h) * isl / k.t_chip(isl, osl, float(h), tf) for h in hs]
        slope, intercept = np.polyfit(hs, tps, 1, w=root_w)
        return float(intercept), float(-slope / intercept)

    tps0, a = fit(x0)
    a_stderr = math.nan
    if c is not None:
        g = _central_gradient(lambda x: fit(x)[1], x0, _coef_steps(coef, t_fixed, isl, osl, fixed_steps))
        a_stderr = math.sqrt(max(float(g @ c @ g), 0.0))
    return tps0, a, a_stderr
