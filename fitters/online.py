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
  refit's f_scale). So the published solution depends on the rows and the last refit only,
  never on how often it was read.

Weighted least squares with frozen weights is :func:`frozen_wls` (normal equations, O(n·p²), no
iteration); :func:`soft_l1_weight` is the IRLS weight of scipy's soft_l1 loss.
"""
from __future__ import annotations

from typing import Generic, TypeVar

import numpy as np

# K: rows between robust refits. Measured on the bundled 0.32 trace (one model, 370 scrapes): a
# refit costs 0.7-2.4 ms per fitter, an exact step 0.2-0.4 ms; the fit step per cycle costs
# 4.3 ms at K = 1, 1.09 at 8, 0.87 at 16, 0.81 at 32: past 16 the exact steps dominate, and a
# frozen weight is at most 16 rows (80 s of 5-s scrapes) old.
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

    def append(self, row) -> None:
        """Store one row (array-like of ``width`` floats), dropping the oldest beyond capacity."""
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


def soft_l1_weight(r: np.ndarray, f_scale: float) -> np.ndarray:
    """IRLS weight ρ'(z) = 1/√(1 + z), z = (r/f_scale)², of scipy's soft_l1 loss ρ(z) = 2(√(1+z) − 1):
    at a soft_l1 minimum with no bound active, the weighted least squares with these weights has
    the same solution. r: residuals, shape (n,); returns shape (n,), in (0, 1]."""
    return 1.0 / np.sqrt(1.0 + (r / f_scale) ** 2)


def frozen_wls(a: np.ndarray, b: np.ndarray, w: np.ndarray, fixed: np.ndarray, theta_fixed: np.ndarray,
               lower: np.ndarray, upper: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Weighted least squares min Σ w·(a·θ − b)² with the parameters in ``fixed`` held at
    ``theta_fixed`` (the bounds active at the last refit) and the others free, from the normal
    equations (no iteration).

    Args:
        a: design, shape (n, p); b: targets, shape (n,); w: weights ≥ 0, shape (n,).
        fixed: bool mask, shape (p,); theta_fixed: values of the fixed parameters, shape (p,)
            (entries of free parameters are ignored); lower, upper: bounds, shape (p,).
    Returns:
        (θ, shape (p,); inverse of the free parameters' normal matrix (a_freeᵀ·W·a_free)⁻¹,
        shape (p_free, p_free)), or None when the normal matrix is singular or a free parameter
        leaves [lower, upper] (the caller then refits).
    """
    free = ~fixed
    theta = np.where(fixed, theta_fixed, 0.0)
    af = a[:, free]
    rhs = b - a[:, fixed] @ theta[fixed] if fixed.any() else b
    aw = af * w[:, None]
    try:
        inv = np.linalg.inv(aw.T @ af)
    except np.linalg.LinAlgError:
        return None
    theta[free] = inv @ (aw.T @ rhs)
    if not (np.all(np.isfinite(theta)) and np.all(theta >= lower) and np.all(theta <= upper)):
        return None
    return theta, inv


class AmortizedFit(Generic[S, R]):
    """A fitter's rows plus the refit policy of this module (MODEL.md §6).

    Rows are ``width`` floats; the buffer holds one more column, each row's frozen weight (nan
    until weighed). A subclass supplies three hooks over the buffered rows ``x`` (shape
    (n, width), oldest first) and ``key`` (extra inputs of the fit, compared by value, e.g. the
    chip-time coefficients of the latency fit; None when there are none):

    * ``_refit(x, key, previous) -> (result, state, weights)``: the robust fit, warm-started from
      ``previous`` (the last refit's state, or None); ``state`` is what it froze (None when the fit
      is not ok: then every read with new rows refits), ``weights`` shape (n,) the frozen weights.
    * ``_weigh(x_new, key, state) -> weights``: the weight of rows that arrived since the refit,
      under the refit's estimate.
    * ``_exact(x, w, key, state) -> result | None``: the exact solution with frozen weights ``w``;
      None when it cannot stand (solution out of bounds, data changed otherwise): refit.

    :meth:`solve` returns the current result, cached until a row arrives or ``key`` changes.
    ``refits`` counts robust refits (a diagnostic). Raises ValueError for every < 1.
    """

    def __init__(self, capacity: int, width: int, every: int = REFIT_EVERY) -> None:
        if every < 1:
            raise ValueError("every must be ≥ 1")
        self.rows = RowBuffer(capacity, width + 1)
        self.every = every
        self.refits = 0
        self._state: S | None = None
        self._refit_at = 0  # rows.appended at the last refit
        self._cache: tuple[int, object, R] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def append(self, row) -> None:
        """Store one row of ``width`` floats (unweighed)."""
        self.rows.append((*row, np.nan))

    def solve(self, key: object = None) -> R:
        """The fit of the buffered rows under ``key``: an exact step or a robust refit (module docstring)."""
        appended = self.rows.appended
        if self._cache is not None and self._cache[0] == appended and self._cache[1] == key:
            return self._cache[2]
        data = self.rows.view()
        x, w = data[:, :-1], data[:, -1]
        out = None
        if self._state is not None and appended - self._refit_at < self.every:
            new = np.isnan(w)
            if new.any():
                w[new] = self._weigh(x[new], key, self._state)
            out = self._exact(x, w, key, self._state)
        if out is None:
            out, self._state, data[:, -1] = self._refit(x, key, self._state)
            self._refit_at = appended
            self.refits += 1
        self._cache = (appended, key, out)
        return out

    def _refit(self, x: np.ndarray, key: object, previous: S | None) -> tuple[R, S | None, np.ndarray]:
        raise NotImplementedError

    def _weigh(self, x: np.ndarray, key: object, state: S) -> np.ndarray:
        raise NotImplementedError

    def _exact(self, x: np.ndarray, w: np.ndarray, key: object, state: S) -> R | None:
        raise NotImplementedError
