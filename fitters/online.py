"""Amortized robust fits: a robust refit every few rows, the exact solution in between (MODEL.md §6).

MODEL.md §6: "Online = bounded memory … A robust refit may run every few steps if the update in
between is exact." Every online fitter (chip time §7, miss slope §4, latency §3.2/§7) keeps its
rows in a :class:`RowBuffer` and derives from :class:`AmortizedFit`, which decides when to refit:

* a robust refit (the fitter's scipy fit, warm-started from the previous solution) when there is
  no usable previous refit, when ``every`` rows arrived since the last one, or when the fitter's
  exact step declines (its solution leaves the bounds, or the data changed in a way frozen
  weights cannot follow: a new regressor, other chip-time coefficients, …);
* otherwise the EXACT solution of all current rows with the robust weights frozen at the last
  refit: each row keeps the weight the refit gave it, and a row that arrived since is weighted
  under the refit's estimate (for a robust loss, the loss's IRLS weight at its residual with the
  refit's f_scale). So the published solution depends on the rows and the last refit only;
  and as the analyzer solves after every new snapshot (exporter/analyzer.py
  ``Analyzer.fit_step``), the refits fall on the same rows however often the analysis is read.

The exact step never revisits the rows: :class:`GramSums` keeps Σ w·v·vᵀ of each row's basis
vector v (the fitter's design and target, under the refit's frozen state) per group, added when a
row is weighed, subtracted when the buffer evicts it and rebuilt from the rows at every refit (so
rounding drift spans at most ``every`` rows); a fitter maps it to its p×p normal equations
(p ≤ 5) and :func:`solve_normal` solves them. Statistics only the analysis reads (covariance,
stderr, R², outliers, MAPE, condition number) are a :class:`LazyFitResult`: computed from a copy
of the rows and the solution the first time a field is read, by the same code as the pure fit, so
the values are those an eager computation would have published.

Weighted least squares with frozen weights on rows is :func:`frozen_wls`; :func:`soft_l1_weight`
is the IRLS weight of scipy's soft_l1 loss.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import numpy as np
from scipy.linalg.lapack import dposv

from .result import FitResult

# K: rows between robust refits. Measured on the bundled 0.32 trace (one model, 369 cycles): a
# refit costs 0.8 ms (chip time), 1.0 ms (latency), ~2.3 ms (miss slope: its reference curve, a
# nonlinear scipy least_squares), an exact step 0.04-0.1 ms. At K = 64 without more the frozen
# weights get old enough to move the real-trace direct â (0.76 → 0.81); K = 128 with refits gated
# on drift (the residuals' shift, rows the refit would call outliers, h beyond the reference's
# range) kept every accuracy bar but still moved sweep A's direct â (0.479 → 0.463) and α̂ at 10 %
# noise (by up to 0.17): not adopted.
REFIT_EVERY = 16

R = TypeVar("R")
S = TypeVar("S")


class RowBuffer:
    """The last ``capacity`` rows of ``width`` floats, oldest first (bounded memory, MODEL.md §6).

    Storage is 2·capacity rows: appends go to the end and, when it is full, the newest
    capacity − 1 rows move to the front, so :meth:`view` is always one contiguous slice (no copy)
    and an append costs O(width) amortized. ``appended`` counts every row ever appended.
    Raises ValueError for capacity < 1 or width < 1.
    """

    def __init__(self, capacity: int, width: int) -> None:
        if capacity < 1 or width < 1:
            raise ValueError("capacity and width must be ≥ 1")
        self.capacity = capacity
        self._data = np.empty((2 * capacity, width))
        self._end = 0
        self._len = 0
        self.appended = 0

    def __len__(self) -> int:
        return self._len

    def append(self, row, evict: int = 0) -> None:
        """Store one row (array-like of ``width`` floats), dropping row ``evict`` of :meth:`view`
        (0: the oldest) beyond capacity; the rows older than it move up one, in order."""
        if self._len == self.capacity and evict:
            start = self._end - self._len
            self._data[start + 1:start + evict + 1] = self._data[start:start + evict]  # numpy copes with the overlap
        if self._end == len(self._data):
            keep = self.capacity - 1
            self._data[:keep] = self._data[self._end - keep:self._end]
            self._end = keep
        self._data[self._end] = row
        self._end += 1
        self._len = min(self._len + 1, self.capacity)
        self.appended += 1

    def view(self) -> np.ndarray:
        """The stored rows, shape (len, width), oldest first; a writable view into the buffer."""
        return self._data[self._end - self._len:self._end]


_EPS = float(np.finfo(float).eps)


def soft_l1_weight(r: np.ndarray, f_scale: float) -> np.ndarray:
    """IRLS weight ρ'(z) = 1/√(1 + z), z = (r/f_scale)², of scipy's soft_l1 loss ρ(z) = 2(√(1+z) − 1):
    at a soft_l1 minimum with no bound active, the weighted least squares with these weights has
    the same solution. r: residuals, shape (n,); returns shape (n,), in (0, 1]."""
    return 1.0 / np.sqrt(1.0 + (r / f_scale) ** 2)


def _spd_solve(m: np.ndarray, rhs: np.ndarray) -> np.ndarray | None:
    """x with m·x = rhs for a symmetric positive semi-definite m (a normal matrix), or None when
    m is singular (the caller refits or falls back). m is scaled to unit diagonal first (the
    columns' units span orders of magnitude); LAPACK dposv, a Cholesky solve without numpy's
    per-call overhead."""
    if not len(rhs):  # every parameter held: nothing to solve
        return rhs.copy()
    diag = m.diagonal().tolist()  # plain floats: numpy's per-call cost exceeds p ≤ 5 comparisons
    if min(diag) <= 0.0:  # a zero column, or rounding's negative after rows all of weight 0 were removed
        return None
    d = np.sqrt(m.diagonal())
    _, x, info = dposv(m / (d[:, None] * d), rhs / d)
    return None if info else x / d


def median(x: np.ndarray) -> float:
    """np.median of a 1-D array, bit for bit (nan when x holds one), without its per-call overhead
    (~10 µs, 4 % of a 64-model cycle: the refits take several medians each); nan for an empty x
    (without np.median's warning)."""
    n = len(x)
    if not n:
        return math.nan
    k = n // 2
    # -1 too: NaN sorts last, so a NaN anywhere lands there
    part = np.partition(x, (k, n - 1) if n % 2 else (k - 1, k, n - 1))
    if part[-1] != part[-1]:
        return math.nan
    return float(part[k]) if n % 2 else float((part[k - 1] + part[k]) / 2.0)


_MAD_TO_SIGMA = 1.4826


def robust_sigma(r: np.ndarray) -> float:
    """1.4826·MAD of relative residuals r, shape (n,) [1]; floored at 1e-9 so a noiseless fit
    still has a positive scale (f_scale of a robust loss, outlier threshold)."""
    mad = median(np.abs(r - median(r)))
    return max(_MAD_TO_SIGMA * mad, 1e-9)


@dataclasses.dataclass(frozen=True)
class Shift:
    """How far a fit's newest rows moved off it, as :meth:`ShiftTest.compare` found it [1, relative;
    + is a measured time grown: +0.5 is 1.5× the fit's]: ``shift``, the median over the last
    ``steps`` rows (what passed the test); ``size``, over the newest ``steps // 4`` (the changed
    engine's alone, its best estimate); ``what`` names the rows."""
    shift: float
    size: float
    steps: int
    what: str

    def text(self) -> str:
        """Both, as logged and warned (one alone read as below the threshold when the newest were, review)."""
        return (f"{self.shift:+.0%} (the median over its last {self.steps} {self.what}), "
                f"{self.size:+.0%} in its newest {self.steps // 4}")


class ShiftTest:
    """Whether what a fit describes changed under it (an engine's speed, its load/compute overlap):
    a fit over hours of rows follows a change only as its old rows leave, while it publishes its
    old value as ok (MODEL.md §6: bounded memory; the chip-time and latency fits).

    :meth:`arrived` takes each new row's relative residual under the last refit, r = (predicted −
    measured)/predicted, into the last ``steps``; when half of them are beyond ``threshold`` on one
    side and so is their median (at most every ``steps // 4`` rows: a misfit the traffic always had
    passes this for many rows in a row), :meth:`compare` is due, over every stored row. Each of the
    last ``steps`` rows with ≥ ``references`` earlier rows of its traffic gives a shift: its
    residual less the median of theirs (a misfit the traffic always had, tail-chunk dips or a
    concurrency the linear model fits less well, is no change). A change is a median shift, over at
    least half of them, beyond ``threshold`` and beyond ``sigmas`` standard errors of that median
    under the newest and the earlier rows' scatter (a robust σ): a noisy engine's own spread (20 %
    per step) read as a change once every ~3 h at a fixed 15 % (review)."""

    def __init__(self, threshold: float, what: str, steps: int = 32, references: int = 8, sigmas: float = 6.0,
                 span: float = 0.05) -> None:
        self.threshold, self.what, self.steps, self.references, self.sigmas = threshold, what, steps, references, sigmas
        self.span = span  # the widest h range of one row's references [1] (compare with h)
        self._arrived: deque[float] = deque(maxlen=steps)
        self._above = self._below = 0  # … of them above threshold, below -threshold
        self._compared = -steps  # rows appended when compare was last due

    def arrived(self, r: float, appended: int) -> bool:
        """Take a new row's relative residual ``r`` [1]; ``appended``: rows appended so far. True
        when :meth:`compare` is due."""
        if len(self._arrived) == self.steps:
            gone = self._arrived[0]
            self._above -= gone > self.threshold
            self._below -= gone < -self.threshold
        self._arrived.append(r)
        self._above += r > self.threshold
        self._below += r < -self.threshold
        # a median beyond ±threshold needs half of them beyond it on one side: only then is it taken
        if (len(self._arrived) == self.steps and max(self._above, self._below) >= self.steps // 2
                and appended - self._compared >= self.steps // 4
                and abs(median(np.array(self._arrived))) > self.threshold):
            self._compared = appended
            return True
        return False

    def compare(self, r: np.ndarray, traffic: np.ndarray, h: np.ndarray | None = None) -> Shift | None:
        """The change (:class:`Shift`) told by every stored row's relative residual under the last
        refit, ``r`` shape (n,), oldest first, and its traffic, ``traffic`` shape (n, k) (rows
        equal in every column are the same traffic); None when the last ``steps`` rows do not say
        it changed. With ``h`` (n,), a row's references are the ``references`` earlier rows of its
        traffic that bracket it most closely in h, within ``span``: a misfit that moves with h
        cancels to first order (against every earlier row of an h cell, traffic drifting slowly
        through h read a misfit as a 5–8 % change once an hour, review); a row beyond the h its
        traffic saw has none."""
        n, k = len(r) - self.steps, self.references
        if n < k:
            return None
        # one id per traffic; a row with a nan (unknown) is its own (equal to none)
        ids = np.unique(traffic, axis=0, return_inverse=True)[1].ravel()
        ids = np.where(np.isnan(traffic).any(axis=1), -1 - np.arange(len(r)), ids)
        earlier: dict[int, np.ndarray] = {}  # id → its earlier rows (by h when h is given)
        medians: dict[tuple[int, int], float] = {}  # (id, first reference) → the references' median r
        share = np.zeros(n)  # each earlier row's weight in the shifts' references, summed over the shifts
        shifts = []
        for i in range(n, len(r)):
            if (g := int(ids[i])) not in earlier:
                rows = np.flatnonzero(ids[:n] == g)
                earlier[g] = rows if h is None else rows[np.argsort(h[rows], kind="stable")]
            rows, start = earlier[g], 0
            if len(rows) < k:
                continue
            if h is not None:
                hs = h[rows]
                centre = np.searchsorted(hs, h[i], "left") + np.searchsorted(hs, h[i], "right")
                start = min(max((centre - k) // 2, 0), len(rows) - k)
                if not (hs[start] <= h[i] <= hs[start + k - 1] and hs[start + k - 1] - hs[start] <= self.span):
                    continue
                rows = rows[start:start + k]
            if (g, start) not in medians:
                medians[g, start] = median(r[rows])
            shifts.append(r[i] - medians[g, start])
            share[rows] += 1.0 / len(rows)
        if 2 * len(shifts) < self.steps:
            return None
        # a median's standard error ≈ 1.25 σ/√m, of the shifts' own (the newest rows' σ) and of their
        # references' (the earlier rows' σ over m = 1/Σ c², c the rows' shares of the shifts' mean
        # reference: the references of two traffics are independent; counted as one traffic's, 10 %
        # noise on 26 traffics passed for 1.43x its real spread, and counted as their union, 3 shifts
        # on 600 rows beside 29 on 8 for 0.6x, reviews); the newest rows' σ at least the references':
        # an engine grown noisier at the same speed (3 % → 12 %) passed 8 % against its quieter
        # past's σ alone, and 32 rows taken when half of them are past the threshold read 10 % noise
        # as 6 % (a false change of speed in 395 h of the simulator; reviews). The references' σ is
        # their own rows' (all earlier rows' counts a misfit across h as noise)
        c = share / len(shifts)
        ref = robust_sigma(r[:n][share > 0])
        stderr = 1.25 * math.sqrt(max(robust_sigma(r[n:]), ref) ** 2 / len(shifts) + ref ** 2 * float(c @ c))
        shift = median(np.array(shifts))
        if not abs(shift) > max(self.threshold, self.sigmas * stderr):
            return None
        # found once most of the window is the changed engine's: its newest rows tell the size
        return Shift(-shift, -median(np.array(shifts[-(self.steps // 4):])), self.steps, self.what)


def bounded_lsq(a: np.ndarray, b: np.ndarray, x0: np.ndarray, lower: np.ndarray | float, upper: np.ndarray | float,
                f_scale: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The minimum of a bounded linear least squares, what scipy's ``least_squares(lambda x: a·x − b,
    x0, bounds=(lower, upper), loss=..., f_scale=f)`` solves: with ``f_scale`` the soft_l1 loss
    Σ 2·f²·(√(1 + ((a·x − b)/f)²) − 1), without it the plain Σ (a·x − b)².

    Both losses are convex in the residuals, so (a of full column rank) the minimum is unique:
    this finds it by Newton steps on the free parameters (soft_l1: gradient Σ ρ'·r·a, Hessian
    Σ (1 + z)^-3/2·a·aᵀ, z = (r/f)²), Armijo backtracking, as an active-set method: a parameter a
    step stops at is held at its bound (also when the Newton step overshoots so far that the
    bound is a tiny fraction of it away); at the free parameters' minimum (Newton decrement ≤ 1e-15
    of the loss, or below what the residuals' rounding can resolve) it takes that last Newton step
    and, with the gradient there, releases the held one whose KKT multiplier has the wrong sign by
    most (beyond rounding), and it stops there when none has. The loss it compares is
    Σ (√(1 + z) − 1) (soft_l1, computed as Σ z/(√(1 + z) + 1)) or Σ r²/2, without the constant
    n that Σ √(1 + z) carries: relative to n, a loss much smaller than n (f_scale much larger
    than the residuals) would pass any relative threshold far from its minimum. For p ≤ 6 that
    is a few steps of tens of µs where ``least_squares`` spends ~0.3 ms per iteration in overhead
    (the robust refits of fitters/online.py). When it cannot certify a minimum (a singular
    Hessian, 50 steps, a line search that cannot descend, non-finite values) it returns
    ``least_squares``'s solution from ``x0`` (which raises on non-finite inputs).
    tests/test_online.py checks it against ``least_squares`` run to 1e-15.

    Args:
        a: design, shape (n, p); b: targets, shape (n,); x0: start, shape (p,), clipped into the
            bounds; lower, upper: bounds, scalars or shape (p,); f_scale > 0 or None.
    Returns:
        (x, shape (p,); bool mask of the parameters held at a bound, shape (p,)).
    Raises:
        ValueError: f_scale ≤ 0 (or nan), a lower bound above its upper bound, non-finite input
            (from ``least_squares``).
    """
    p = a.shape[1]
    lo, hi = np.broadcast_to(lower, (p,)).astype(float), np.broadcast_to(upper, (p,)).astype(float)
    if f_scale is not None and not f_scale > 0:
        raise ValueError(f"f_scale must be > 0, got {f_scale}")
    if not (lo <= hi).all():
        raise ValueError(f"every lower bound must be ≤ its upper bound, got {lo} and {hi}")
    x = np.clip(np.asarray(x0, dtype=float), lo, hi)
    held = (x <= lo) | (x >= hi)
    robust = f_scale is not None
    inv_f2 = 1.0 / (f_scale * f_scale) if robust else 1.0
    eps, norms = _EPS, None

    # rounding: a residual is known to ε·s, s = |a|·|x| + |b| (‖s‖ ≤ Σ |x_j|·‖a_j‖ + ‖b‖)
    def spread(q: np.ndarray) -> np.ndarray:  # s at q, shape (n,)
        return np.abs(a) @ np.abs(q) + np.abs(b)

    def cost(q: np.ndarray) -> float:  # soft_l1: Σ (√(1 + z) − 1) = Σ z/(√(1 + z) + 1), plain: Σ r²/2
        r = a @ q - b
        if robust:
            z = r * r * inv_f2
            return float((z / (np.sqrt(1.0 + z) + 1.0)).sum())
        return 0.5 * float(r @ r)

    for _ in range(50):
        r = a @ x - b
        if robust:
            z = r * r * inv_f2
            root = np.sqrt(1.0 + z)
            w1 = 1.0 / root
            w3, c0 = w1 * w1 * w1, float((z / (root + 1.0)).sum())
        else:
            w1 = w3 = np.ones(len(r))
            c0 = 0.5 * float(r @ r)
        if not math.isfinite(c0):
            break  # least_squares raises on non-finite residuals
        wr = w1 * r
        g = a.T @ wr
        free = np.flatnonzero(~held)
        step = np.zeros(0)
        if len(free):
            af = a if len(free) == p else a[:, free]
            step = _spd_solve((af * w3[:, None]).T @ af, g[free])
            if step is None:
                break
        xf, decrement = x[free], float(g[free] @ step) * inv_f2
        bound = np.where(step > 0, lo[free], hi[free])  # the longest step inside the bounds
        room = np.divide(xf - bound, step, out=np.full(len(free), np.inf), where=step != 0.0)
        t_max = float(room.min(initial=np.inf))
        # the free parameters' minimum: a decrement ≤ 1e-15 of the loss, or below what the
        # residuals' rounding (ε·s) lets a line search see: the loss moves by up to
        # ε·‖ρ'·r‖·‖s‖ (residuals much smaller than the targets), the gradient by ~ε·‖s‖
        # ((nearly) noiseless data); from there the last Newton step is taken unchecked
        converged = t_max >= 1.0 and decrement <= 1e-15 * c0
        if t_max >= 1.0 and not converged:
            if norms is None:
                norms = np.sqrt((a * a).sum(axis=0)), math.sqrt(float(b @ b))
            spread_norm = float(np.abs(x) @ norms[0]) + norms[1]
            converged = decrement <= (2.0 * eps * math.sqrt(float(wr @ wr)) + (4.0 * eps) ** 2 * spread_norm) \
                * spread_norm * inv_f2
        if converged:
            x[free] = np.minimum(np.maximum(xf - step, lo[free]), hi[free])
            if held.any():
                # KKT with the gradient at this x (the one before the step is stale by H·step):
                # a held parameter whose gradient points into the interior by more than its
                # rounding is released, the largest violation first (then the Newton step moves
                # it inside)
                r = a @ x - b
                w1 = 1.0 / np.sqrt(1.0 + r * r * inv_f2) if robust else 1.0
                g = a.T @ (w1 * r)
                push = np.where(held & (x <= lo), -g, 0.0) + np.where(held & (x >= hi), g, 0.0)
                if push.max() > 0.0:
                    push -= 4.0 * eps * (np.abs(a).T @ (w1 * w1 * w1 * spread(x) + np.abs(w1 * r)))
                if push.max() > 0.0:
                    held[int(np.argmax(push))] = False
                    continue
                if not np.isfinite(push).all():
                    break
            return x, held | (x <= lo) | (x >= hi)
        # Armijo backtracking from the full step or the step to the nearest bound, however
        # short (a Newton step far longer than the room, a free parameter already on its bound:
        # t_max 0), so that bound is held. Far from the minimum (residuals ≫ f_scale) the
        # soft_l1 Newton step overshoots by orders of magnitude: the step shrinks by up to 10×
        # (quadratic interpolation), and only gives up (fallback) once it moves no residual by
        # more than rounding.
        t, t_min, trial, accepted = min(1.0, t_max), -1.0, x.copy(), False
        for _ in range(200):
            trial[free] = xf - t * step
            c1 = cost(trial)
            if c1 <= c0 - 1e-4 * t * decrement and (c1 < c0 or t == t_max):  # (a step to a bound holds it)
                accepted = True
                break
            if t < 1e-12:
                if t_min < 0.0:
                    moved = np.abs(af) @ np.abs(step)
                    s = spread(x)
                    t_min = eps * float(np.min(s[moved > 0] / moved[moved > 0], initial=np.inf))
                if t <= t_min or t < 1e-300:
                    break
            t *= max(0.1, min(0.5, 0.5 * t * decrement / (c1 - c0 + t * decrement)))
        if not accepted:
            break
        x = np.minimum(np.maximum(trial, lo), hi)  # a parameter within rounding of its bound stays inside
        if t == t_max:  # stopped at a bound: hold the parameters that reached it
            blocked = room <= t_max
            x[free[blocked]] = bound[blocked]
            held[free[blocked]] = True
    from scipy.optimize import least_squares  # no certified minimum: the reference solver
    fit = least_squares(lambda q: a @ q - b, np.clip(np.asarray(x0, dtype=float), lo, hi), jac=lambda q: a,
                        bounds=(lo, hi), loss="soft_l1" if robust else "linear", f_scale=f_scale or 1.0)
    return fit.x, fit.active_mask != 0


def frozen_wls(a: np.ndarray, b: np.ndarray, w: np.ndarray, fixed: np.ndarray, theta_fixed: np.ndarray,
               lower: np.ndarray, upper: np.ndarray) -> np.ndarray | None:
    """Weighted least squares min Σ w·(a·θ − b)² with the parameters in ``fixed`` held at
    ``theta_fixed`` (the bounds active at the last refit) and the others free: :func:`solve_normal`
    of the rows' normal equations.

    Args:
        a: design, shape (n, p); b: targets, shape (n,); w: weights ≥ 0, shape (n,).
        fixed, theta_fixed, lower, upper: as :func:`solve_normal`.
    Returns:
        as :func:`solve_normal`.
    """
    aw = a * w[:, None]
    return solve_normal(aw.T @ a, aw.T @ b, fixed, theta_fixed, lower, upper)


def solve_normal(ata: np.ndarray, atb: np.ndarray, fixed: np.ndarray, theta_fixed: np.ndarray,
                 lower: np.ndarray, upper: np.ndarray) -> np.ndarray | None:
    """The solution of the normal equations AᵀWA·θ = AᵀWb with the parameters in ``fixed`` held at
    ``theta_fixed`` and the others free (no iteration).

    Args:
        ata: AᵀWA, shape (p, p); atb: AᵀWb, shape (p,).
        fixed: bool mask, shape (p,); theta_fixed: values of the fixed parameters, shape (p,)
            (entries of free parameters are ignored); lower, upper: bounds, shape (p,).
    Returns:
        θ, shape (p,), or None when the free parameters' normal matrix is singular or a free
        parameter leaves [lower, upper] (the caller then refits); solved by :func:`_spd_solve`.
    """
    if fixed.any():
        free = ~fixed
        theta = np.where(fixed, theta_fixed, 0.0)
        rhs = atb[free] - ata[free][:, fixed] @ theta[fixed]
        m = ata[free][:, free]
    else:
        free, theta, rhs, m = slice(None), np.empty(len(atb)), atb, ata
    sol = _spd_solve(m, rhs)
    if sol is None:
        return None
    theta[free] = sol
    # finite and within the bounds, in plain floats (p ≤ 5: numpy's per-call cost dominates)
    if not all(math.isfinite(t) and lo <= t <= hi for t, lo, hi in zip(theta.tolist(), lower.tolist(), upper.tolist())):
        return None
    return theta


class GramSums:
    """Σ w·v·vᵀ over weighted basis rows v (width q) in ``groups`` groups: ``g``, shape
    (groups, q, q), updated and downdated row by row in O(q²) (fitters/online.py module docstring).
    Raises ValueError for width < 1 or groups < 1."""

    def __init__(self, width: int, groups: int = 1) -> None:
        if width < 1 or groups < 1:
            raise ValueError("width and groups must be ≥ 1")
        self.g = np.zeros((groups, width, width))

    def add(self, v: np.ndarray, w: np.ndarray, group: np.ndarray | None = None) -> None:
        """Add rows v, shape (n, q), with weights w, shape (n,) (negative: remove), to their group
        (int array, shape (n,); None: group 0)."""
        if len(v) == 1:  # the exact step's one new row: no (n, q, q) temporary
            self.g[0 if group is None else group[0]] += (v[0] * w[0])[:, None] * v[0]  # np.outer's products
            return
        vw = v * w[:, None]
        if group is None:
            self.g[0] += vw.T @ v
        else:
            np.add.at(self.g, group, np.einsum("ni,nj->nij", vw, v))

    def reset(self, v: np.ndarray, w: np.ndarray, group: np.ndarray | None = None) -> None:
        """The sums of exactly these rows (as :meth:`add`)."""
        self.g[:] = 0.0
        self.add(v, w, group)


class LazyFitResult(FitResult):
    """A :class:`~fitters.result.FitResult` whose fields are computed by ``build()`` when one is
    first read (then kept): the exact step's statistics cost an O(n) pass the fit step itself does
    not need. ``build`` must own copies of its inputs (the row buffer moves on)."""

    def __init__(self, build: Callable[[], FitResult]) -> None:  # noqa: super().__init__ would set the fields
        object.__setattr__(self, "_build", build)
        object.__setattr__(self, "_full", None)

    def resolve(self) -> FitResult:
        """The built FitResult."""
        if self._full is None:
            object.__setattr__(self, "_full", self._build())
            object.__setattr__(self, "_build", None)
        return self._full

    def __eq__(self, other: object) -> bool:
        return self.resolve() == (other.resolve() if isinstance(other, LazyFitResult) else other)

    __hash__ = None  # type: ignore[assignment]  (as FitResult: eq without frozen hash of dicts)


for _f in dataclasses.fields(FitResult):
    setattr(LazyFitResult, _f.name, property(lambda self, _n=_f.name: getattr(self.resolve(), _n)))


def shared(build: Callable[[], tuple]) -> Callable[[], tuple]:
    """``build`` run once, on the first call (several LazyFitResults built by one pass)."""
    box: list = []

    def once() -> tuple:
        if not box:
            box.append(build())
        return box[0]
    return once


class AmortizedFit(Generic[S, R]):
    """A fitter's rows plus the refit policy of this module (MODEL.md §6).

    Rows are ``width`` floats; the buffer holds one more column, each row's frozen weight (nan
    until weighed). A subclass supplies four hooks over the buffered rows ``x`` (shape
    (n, width), oldest first) and ``key`` (extra inputs of the fit, compared by value, e.g. the
    chip-time coefficients of the latency fit; None when there are none):

    * ``_refit(x, key, previous) -> (result, state, weights)``: the robust fit, warm-started from
      ``previous`` (the last refit's state, or None); ``state`` is what it froze (None when the fit
      is not ok: then every read with new rows refits), ``weights`` shape (n,) the frozen weights.
    * ``_basis(x, state) -> (v, scale, group)``: each row's basis vector, shape (n, q), the factor
      (shape (n,) or a scalar) that makes a row's frozen weight its weight in :attr:`sums`, and its
      group (int, shape (n,)) or None — fixed from a refit to the next, so the sums can be added
      to and subtracted from.
    * ``_weigh(x_new, v_new, key, state) -> weights``: the weight of rows that arrived since the
      refit, under the refit's estimate (``v_new``: their basis, built once for both hooks).
    * ``_exact(x, w, key, state) -> result | None``: the exact solution with frozen weights ``w``,
      from :attr:`sums` (the sums of every buffered row's basis); None when it cannot stand
      (solution out of bounds, data changed otherwise): refit.

    :meth:`solve` returns the current result, cached until a row arrives or ``key`` changes.
    ``refits`` counts robust refits and ``refit_seconds`` sums their wall time [s] (diagnostics,
    benchmarks/performance.py). Raises ValueError for every < 1.
    """

    def __init__(self, capacity: int, width: int, every: int = REFIT_EVERY, basis_width: int = 1,
                 groups: int = 1) -> None:
        if every < 1:
            raise ValueError("every must be ≥ 1")
        self.rows = RowBuffer(capacity, width + 1)
        self.sums = GramSums(basis_width, groups)
        self.every = every
        self.refits = 0
        self.refit_seconds = 0.0
        self._state: S | None = None
        self._refit_at = 0  # rows.appended at the last refit
        self._weighed = 0  # rows.appended when rows were last weighed into the sums
        self._cache: tuple[int, object, R] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def append(self, row) -> int:
        """Store one row of ``width`` floats (unweighed); beyond capacity the row :meth:`_evict`
        names goes (a weighed one leaves the sums). Returns its index in the rows before (0: the
        oldest), so that a subclass's rows kept beside these drop the same one."""
        k = 0
        if len(self.rows) == self.rows.capacity:
            data = self.rows.view()
            k = self._evict()
            old = data[k:k + 1]
            if k >= len(data) - min(self.rows.appended - self._weighed, len(data)):
                # one of the newest rows, not weighed yet (solve() weighs them by position, the last
                # appended − _weighed): as many are left to weigh after this append
                self._weighed += 1
            elif self._state is not None and not np.isnan(old[0, -1]):
                v, scale, group = self._basis(old[:, :-1], self._state)
                self.sums.add(v, -old[:, -1] * scale, group)
        self.rows.append((*row, np.nan), k)
        return k

    def _evict(self) -> int:
        """Index of the row to drop when the buffer is full (0, the oldest, unless overridden)."""
        return 0

    def keep_newest(self, k: int) -> None:
        """Drop every row but the newest ``k`` (the older ones describe what changed, :class:`ShiftTest`):
        the next :meth:`solve` refits from them alone, cold (the last refit's state was theirs too).
        For a fitter that keeps nothing beside its rows (the latency fit; not the chip-time fit's tags)."""
        newest = self.rows.view()[max(len(self.rows) - k, 0):, :-1].copy()
        self.rows = RowBuffer(self.rows.capacity, newest.shape[1] + 1)
        for row in newest:
            self.rows.append((*row, np.nan))
        self._state = self._cache = None
        self._refit_at = self._weighed = 0

    def solve(self, key: object = None) -> R:
        """The fit of the buffered rows under ``key``: an exact step or a robust refit (module docstring)."""
        appended = self.rows.appended
        if self._cache is not None and self._cache[0] == appended and self._cache[1] == key:
            return self._cache[2]
        data = self.rows.view()
        x, w = data[:, :-1], data[:, -1]
        out = None
        if self._state is not None and appended - self._refit_at < self.every:
            new = slice(len(x) - min(appended - self._weighed, len(x)), None)  # the rows since then
            if new.start < len(x):
                v, scale, group = self._basis(x[new], self._state)
                w[new] = self._weigh(x[new], v, key, self._state)
                self.sums.add(v, w[new] * scale, group)
            # marked at once: a hook that raises below must not leave these rows to be added again
            self._weighed = appended
            out = self._exact(x, w, key, self._state)
        if out is None:
            start = time.perf_counter()
            out, self._state, data[:, -1] = self._refit(x, key, self._state)
            if self._state is not None:
                v, scale, group = self._basis(x, self._state)
                self.sums.reset(v, data[:, -1] * scale, group)
            self._refit_at = self._weighed = appended
            self.refits += 1
            self.refit_seconds += time.perf_counter() - start
        self._cache = (appended, key, out)
        return out

    def _refit(self, x: np.ndarray, key: object, previous: S | None) -> tuple[R, S | None, np.ndarray]:
        raise NotImplementedError

    def _weigh(self, x: np.ndarray, v: np.ndarray, key: object, state: S) -> np.ndarray:
        raise NotImplementedError

    def _basis(self, x: np.ndarray, state: S) -> tuple[np.ndarray, np.ndarray | float, np.ndarray | None]:
        raise NotImplementedError

    def _exact(self, x: np.ndarray, w: np.ndarray, key: object, state: S) -> R | None:
        raise NotImplementedError
