"""fitters/bathtub.py against MODEL.md §4 worked by hand.

Oracles are closed forms derived in the comments (never the code's own output). For the chip-time
form with k_attn > 0 write, at fixed N = ISL (M = (1-h)N, W = M·H + M²/2 = N²(1-h²)/2):
    R(h) = (A - B·h) / (C - E·h - F·h²)
    A = P_miss·N + P_out·OSL, B = (P_miss - P_hit)·N, E = k_ffn·N, F = k_attn·N²/2,
    C = T_fixed + E + F + D, D = OSL·(k_dec + k_ctx·(N + OSL/2))
Then
    R(h) = R(0)  ⇔ C(A - Bh) = A(C - Eh - Fh²) ⇔ A·F·h² = (B·C - A·E)·h ⇔ h_even = (BC - AE)/(AF)
    R'(h)·den² = -B(C - Eh - Fh²) + (A - Bh)(E + 2Fh) = (AE - BC) + 2AF·h - BF·h²
    → bottom h* = (A - sqrt(A² - B(BC - AE)/F)) / B   (smaller root of the quadratic)
"""
import math

import numpy as np
import pytest

from fitters.bathtub import BathtubCurve, bathtub_chip_time, bathtub_linear, derived_miss_slope
from fitters.model import ChipTimeCoefficients

Z95 = 1.959963984540054

# --- linear form ---------------------------------------------------------------------------
# R/(TPS0·P_miss) with s = 1-h, b = 1-ρ: (1-a)ρ/s + (1-a)b + aρ + ab·s
# R'(h) = TPS0·P_miss·((1-a)ρ/s² - a·b)
# ∂R'/∂TPS0 = P_miss·((1-a)ρ/s² - a·b);  ∂R'/∂a = TPS0·P_miss·(-ρ/s² - b)
TPS0, A_, P_MISS, RHO = 1000.0, 0.5, 2e-6, 0.1
TINY_LIN = [[1e-6, 0.0], [0.0, 1e-12]]


def _lin_slope(h):
    s = 1 - h
    return TPS0 * P_MISS * ((1 - A_) * RHO / s**2 - A_ * (1 - RHO))


def test_linear_worked_example():
    b = bathtub_linear(TPS0, A_, TINY_LIN, 0.3, P_MISS, RHO)
    assert isinstance(b, BathtubCurve) and b.form == "linear"
    # h* = 2/3, h_even = 8/9 (a=0.5, ρ=0.1; MODEL.md §4 example)
    assert b.h_star == pytest.approx(2 / 3, rel=1e-12)
    assert b.h_even == pytest.approx(8 / 9, rel=1e-12)
    assert b.exit is True
    # R(0) = 1000·2e-6 = 2e-3; R(0.3) = 2e-3·(1-0.15)(1-0.27)/0.7 = 2e-3·0.6205/0.7 = 1.772857e-3
    assert b.revenue_zero == pytest.approx(2e-3)
    assert b.revenue_now == pytest.approx(2e-3 * 0.85 * 0.73 / 0.7)
    # R'(0.3) = 2e-3·(0.05/0.49 - 0.45) = 2e-3·(-0.3479592) = -6.959184e-4
    assert b.slope_now == pytest.approx(2e-3 * (0.05 / 0.49 - 0.45))
    assert b.valley_active is True
    # curve starts at (0, R(0))
    assert b.curve[0] == (0.0, pytest.approx(2e-3))


def test_linear_slope_ci_delta_method_by_hand():
    # cov of (TPS0, a) with a correlation term; at h=0.3 (s=0.7, s²=0.49):
    # g1 = 2e-6·(0.05/0.49 - 0.45) = -6.959184e-7
    # g2 = 1000·2e-6·(-0.1/0.49 - 0.9) = 2e-3·(-1.1040816) = -2.2081633e-3
    # var = g1²·100 + 2·g1·g2·0.5 + g2²·0.01 ≈ 4.843e-11 + 1.5367e-9 + 4.8760e-8 = 5.0345e-8
    cov = [[100.0, 0.5], [0.5, 0.01]]
    g1 = P_MISS * (0.05 / 0.49 - 0.45)
    g2 = TPS0 * P_MISS * (-0.1 / 0.49 - 0.9)
    var = g1 * g1 * 100 + 2 * g1 * g2 * 0.5 + g2 * g2 * 0.01
    half = Z95 * math.sqrt(var)  # ≈ 1.96·2.2438e-4 ≈ 4.398e-4
    b = bathtub_linear(TPS0, A_, cov, 0.3, P_MISS, RHO)
    slope = _lin_slope(0.3)
    assert b.slope_ci[0] == pytest.approx(slope - half, rel=1e-6)
    assert b.slope_ci[1] == pytest.approx(slope + half, rel=1e-6)
    # upper end ≈ -6.96e-4 + 4.40e-4 < 0 → active
    assert b.valley_active is True


def test_linear_valley_active_depends_on_h_and_uncertainty():
    # tiny covariance, h=0.3: R' ≈ -6.96e-4, interval width ~1e-8 → active
    assert bathtub_linear(TPS0, A_, TINY_LIN, 0.3, P_MISS, RHO).valley_active is True
    # h=0.9 (past h*=2/3): R' = 2e-3·(0.05/0.01 - 0.45) = 2e-3·4.55 > 0 → inactive
    b = bathtub_linear(TPS0, A_, TINY_LIN, 0.9, P_MISS, RHO)
    assert b.slope_now == pytest.approx(2e-3 * 4.55)
    assert b.valley_active is False
    # huge covariance (σ_a = 1): half width ≈ 1.96·2.2e-3 ≈ 4.3e-3 > 6.96e-4 → not active
    b = bathtub_linear(TPS0, A_, [[1e6, 0.0], [0.0, 1.0]], 0.3, P_MISS, RHO)
    assert b.slope_now < 0 and b.slope_ci[1] > 0
    assert b.valley_active is False
    # no covariance → no interval → never active
    b = bathtub_linear(TPS0, A_, None, 0.3, P_MISS, RHO)
    assert b.slope_ci is None and b.valley_active is False


@pytest.mark.parametrize("a, rho", [(0.1, 0.25), (0.2, 0.2)])
def test_linear_no_valley(a, rho):
    # a ≤ ρ → R'(0) = TPS0·P_miss·(ρ-a) ≥ 0: no valley
    b = bathtub_linear(TPS0, a, TINY_LIN, 0.3, P_MISS, rho)
    assert b.h_star is None and b.h_even is None and b.exit is None
    assert b.valley_active is False
    # R'(0.3) = 2e-3·((1-a)ρ/0.49 - a(1-ρ)), e.g. a=0.1, ρ=0.25: 2e-3·(0.225/0.49 - 0.075) > 0
    assert b.slope_now == pytest.approx(2e-3 * ((1 - a) * rho / 0.49 - a * (1 - rho)))


def test_linear_rejects_bad_input():
    with pytest.raises(ValueError):
        bathtub_linear(TPS0, A_, None, 1.0, P_MISS, RHO)
    with pytest.raises(ValueError):
        bathtub_linear(TPS0, A_, np.eye(3), 0.3, P_MISS, RHO)
    # a NaN or a non-positive TPS0·P_miss gave a valley bottom of 2/3 with R'(0) > 0 or NaN
    for tps0, a, p_miss, rho in ((math.nan, A_, P_MISS, RHO), (TPS0, math.nan, P_MISS, RHO),
                                 (TPS0, A_, 0.0, RHO), (-TPS0, A_, P_MISS, RHO), (TPS0, A_, P_MISS, math.nan)):
        with pytest.raises(ValueError):
            bathtub_linear(tps0, a, None, 0.3, p_miss, rho)
    for grid in ([0.0, 0.5, 1.0], [-0.1, 0.5]):  # h = 1 divided by 0; h < 0 is no hit ratio
        with pytest.raises(ValueError, match="grid points"):
            bathtub_linear(TPS0, A_, None, 0.3, P_MISS, RHO, grid=grid)


# --- chip-time form: no exit, linear-over-linear --------------------------------------------
# k_attn=0, OSL=0 (no decode): R(h) = (P_miss(1-h)N + P_hit·hN)/(T_fixed + k_ffn(1-h)N)
# N=1000, T_fixed=0.1, k_ffn=1e-4, P_miss=1e-6, P_hit=1e-7.
FFN_ONLY = ChipTimeCoefficients(t_step=0.0, k_ffn=1e-4, k_attn=0.0, k_dec=0.0, k_ctx=0.0)


def test_chip_time_no_exit_by_hand():
    b = bathtub_chip_time(FFN_ONLY, None, 0.1, 1000, 0, 0.3, 1e-6, 1e-7, 0.0)
    assert b.form == "chip_time"
    # R(0) = 1e-6·1000 / (0.1 + 0.1) = 1e-3/0.2 = 5e-3
    assert b.revenue_zero == pytest.approx(5e-3)
    # h_max = 1 - 1/1000 = 0.999: num = 1e-6·1 + 1e-7·999 = 1.009e-4, den = 0.1 + 1e-4·1 = 0.1001
    # R(h_max) = 1.009e-4/0.1001 = 1.00799e-3 < R(0) → the valley has no exit
    assert b.curve[-1][0] == pytest.approx(0.999)
    assert b.curve[-1][1] == pytest.approx(1.009e-4 / 0.1001)
    assert b.exit is False and b.h_even is None
    # R' numerator = AE - BC = 1e-3·0.1 - 9e-4·0.2 = -8e-5 < 0 for every h (F=0): R falls all the
    # way, so the bottom is the wall h_max = 0.999
    assert b.h_star == pytest.approx(0.999, abs=1e-6)
    # R(0.3): num = 1e-6·700 + 1e-7·300 = 7.3e-4; den = 0.1 + 0.07 = 0.17 → 4.294118e-3
    assert b.revenue_now == pytest.approx(7.3e-4 / 0.17)
    assert b.slope_ci is None and b.valley_active is False


def test_chip_time_slope_at_zero_quotient_rule_by_hand():
    # R'(0) = (num'·den - num·den')/den², num = 1e-3, num' = (P_hit - P_miss)·N = -9e-4,
    # den = 0.2, den' = -k_ffn·N = -0.1 → (-9e-4·0.2 + 1e-3·0.1)/0.04 = -8e-5/0.04 = -2e-3
    b = bathtub_chip_time(FFN_ONLY, None, 0.1, 1000, 0, 0.0, 1e-6, 1e-7, 0.0)
    assert b.slope_now == pytest.approx(-2e-3, rel=1e-12)
    # at h=0.3: num = 7.3e-4, den = 0.17 → (-9e-4·0.17 + 7.3e-4·0.1)/0.0289 = -8e-5/0.0289
    b = bathtub_chip_time(FFN_ONLY, None, 0.1, 1000, 0, 0.3, 1e-6, 1e-7, 0.0)
    assert b.slope_now == pytest.approx(-8e-5 / 0.0289, rel=1e-12)


def test_chip_time_attention_only_exit_at_point_nine():
    # T_fixed=0, k_ffn=0, no decode, k_attn=2e-7, N=1000: t = 2e-7·1e6(1-h²)/2 = 0.1(1-h²)
    # R(0) = 1e-6·1000/0.1 = 1e-2; R(h)/R(0) = (1 - 0.9h)/(1 - h²)
    # R = R(0) ⇔ 1 - 0.9h = 1 - h² ⇔ h = 0.9 (exit);
    # bottom: 0.9h² - 2h + 0.9 = 0 → h* = (2 - sqrt(4 - 3.24))/1.8 = (2 - 0.8717798)/1.8 = 0.626789
    k = ChipTimeCoefficients(0.0, 0.0, 2e-7, 0.0, 0.0)
    b = bathtub_chip_time(k, None, 0.0, 1000, 0, 0.5, 1e-6, 1e-7, 0.0)
    assert b.revenue_zero == pytest.approx(1e-2)
    assert b.exit is True
    assert b.h_even == pytest.approx(0.9, rel=1e-9)
    assert b.h_star == pytest.approx((2 - math.sqrt(0.76)) / 1.8, rel=1e-6)
    # R(0.5)/R(0) = 0.55/0.75 = 0.7333…
    assert b.revenue_now == pytest.approx(1e-2 * 0.55 / 0.75)


# --- chip-time form: every term -------------------------------------------------------------
# N=8000, OSL=100, T_fixed=0.02, k_ffn=5e-5, k_attn=2e-8, k_ctx=1e-8, P = (1e-6, 1e-7, 4e-6):
# A = 8e-3 + 4e-4 = 8.4e-3, B = 0.9e-6·8000 = 7.2e-3, E = 0.4, F = 2e-8·6.4e7/2 = 0.64
# k_dec=1e-3: D = 100·(1e-3 + 1e-8·8050) = 0.10805, C = 0.02+0.4+0.64+0.10805 = 1.16805
#   h_even = (7.2e-3·1.16805 - 8.4e-3·0.4)/(8.4e-3·0.64) = 5.04996e-3/5.376e-3 = 0.939353 < h_max
#   h* = (8.4e-3 - sqrt(7.056e-5 - 7.2e-3·5.04996e-3/0.64))/7.2e-3 = (8.4e-3 - 3.70782e-3)/7.2e-3
#      = 0.651692
# k_dec=2e-3: D = 0.20805, C = 1.26805 → BC - AE = 5.76996e-3, formal h_even = 1.0733 > 1: no exit;
#   h* = (8.4e-3 - sqrt(7.056e-5 - 6.4912e-5))/7.2e-3 = (8.4e-3 - 2.37655e-3)/7.2e-3 = 0.836590
N, OSL, TF = 8000.0, 100.0, 0.02
PM, PH, PO = 1e-6, 1e-7, 4e-6


def _coef(k_dec):
    return ChipTimeCoefficients(t_step=0.003, k_ffn=5e-5, k_attn=2e-8, k_dec=k_dec, k_ctx=1e-8)


def _abcef(k_dec):
    a = PM * N + PO * OSL
    b = (PM - PH) * N
    e = 5e-5 * N
    f = 2e-8 * N * N / 2
    d = OSL * (k_dec + 1e-8 * (N + OSL / 2))
    return a, b, TF + e + f + d, e, f


@pytest.mark.parametrize("k_dec, exits, h_star_hand", [(1e-3, True, 0.651692), (2e-3, False, 0.836590)])
def test_chip_time_general_bottom_and_exit(k_dec, exits, h_star_hand):
    a, b, c, e, f = _abcef(k_dec)
    h_star = (a - math.sqrt(a * a - b * (b * c - a * e) / f)) / b
    assert h_star == pytest.approx(h_star_hand, rel=1e-5)  # the hand numbers above
    h_even = (b * c - a * e) / (a * f)
    b_ = bathtub_chip_time(_coef(k_dec), None, TF, N, OSL, 0.3, PM, PH, PO)
    assert b_.revenue_zero == pytest.approx(a / c)  # 8.4e-3/1.16805 = 7.19147e-3 for k_dec=1e-3
    assert b_.h_star == pytest.approx(h_star, rel=1e-6)
    assert b_.exit is exits
    if exits:
        assert h_even == pytest.approx(0.939353, rel=1e-5)  # the hand number above
        assert b_.h_even == pytest.approx(h_even, rel=1e-9)
    else:
        assert h_even > 1 and b_.h_even is None
    # R'(0) = (AE - BC)/C², e.g. -5.04996e-3/1.16805² = -3.70137e-3 for k_dec=1e-3
    b0 = bathtub_chip_time(_coef(k_dec), None, TF, N, OSL, 0.0, PM, PH, PO)
    assert b0.slope_now == pytest.approx((a * e - b * c) / c**2, rel=1e-12)
    # h_max defaults to 1 - 1/8000
    assert b_.curve[-1][0] == pytest.approx(1 - 1 / 8000)


@pytest.mark.parametrize("fixed_steps", [0.0, TF / 0.003])
def test_chip_time_slope_ci_delta_method_by_hand(fixed_steps):
    # R'(h) = (num'·den - num·den')/den²; with regressors x = (S, M, W, OSL, OSL(N+OSL/2)) and their
    # h-derivatives x' = (0, -N, -N²h, 0, 0): ∂den/∂c_j = x_j, ∂den'/∂c_j = x'_j, so
    # ∂R'/∂c_j = (num'·x_j - num·x'_j)/den² - 2·R'·x_j/den. S: the steps T_fixed = t_step·S counts
    # (TF = 0.003 s × 6.67 steps); with S = 0 T_fixed is exact and t_step's σ does not enter.
    h = 0.3
    a, b, c, e, f = _abcef(1e-3)
    num, dnum = a - b * h, -b
    den, dden = c - e * h - f * h * h, -e - 2 * f * h
    slope = (dnum * den - num * dden) / den**2
    assert slope == pytest.approx(((a * e - b * c) + 2 * a * f * h - b * f * h * h) / den**2)
    m_, w_ = (1 - h) * N, N * N * (1 - h * h) / 2
    x = np.array([fixed_steps, m_, w_, OSL, OSL * (N + OSL / 2)])
    xp = np.array([0.0, -N, -N * N * h, 0.0, 0.0])
    g = (dnum * x - num * xp) / den**2 - 2 * slope * x / den
    sd = np.array([1e-3, 2e-6, 2e-9, 1e-4, 1e-9])
    half = Z95 * math.sqrt(float(g @ np.diag(sd**2) @ g))
    bt = bathtub_chip_time(_coef(1e-3), np.diag(sd**2), TF, N, OSL, h, PM, PH, PO, fixed_steps=fixed_steps)
    assert bt.slope_now == pytest.approx(slope, rel=1e-12)
    assert bt.slope_ci[0] == pytest.approx(slope - half, rel=1e-6)
    assert bt.slope_ci[1] == pytest.approx(slope + half, rel=1e-6)


def test_linear_edge_stderrs_by_hand():
    # a = 0.5, ρ = 0.1, σ_a = 0.01. h* = 1 - √(q(1-a)/a), q = ρ/(1-ρ) = 1/9: dh*/da =
    # q/(2a²·√(q(1-a)/a)) = (1/9)/(2·0.25·(1/3)) = 2/3, so σ(h*) = 0.00667. h_even = (1 - ρ/a)/(1-ρ):
    # dh_even/da = ρ/(a²(1-ρ)) = 0.1/(0.25·0.9) = 0.4444, so σ(h_even) = 0.00444. TPS0's variance
    # and its covariance with a move neither (the closed forms do not hold TPS0).
    b = bathtub_linear(TPS0, A_, [[100.0, 0.5], [0.5, 1e-4]], 0.3, P_MISS, RHO)
    assert b.h_star_stderr == pytest.approx(2 / 3 * 0.01, rel=1e-6)
    assert b.h_even_stderr == pytest.approx(0.1 / (0.25 * 0.9) * 0.01, rel=1e-6)
    assert bathtub_linear(TPS0, A_, None, 0.3, P_MISS, RHO).h_star_stderr is None  # no covariance
    assert bathtub_linear(TPS0, 0.05, [[1.0, 0.0], [0.0, 1e-4]], 0.3, P_MISS, RHO).h_star_stderr is None  # no valley


def test_chip_time_edge_stderrs_against_the_edges_refound_at_moved_coefficients():
    # The delta method through R'(h*) = 0 and R(h_even) = R(0), checked against the closed forms
    # of h* and h_even (module header: A, B, C, E, F) at each coefficient moved by ±1e-4 relative:
    # g_j = Δh/Δc_j, σ = √(gᵀΣg) with Σ the diagonal below; at least the edges' moves, over 1.96,
    # by the closed forms at the coefficients moved by ±1.96 σ along δ = Σg/σ (the step along
    # which each edge moves most): here k_ffn at 4 % and k_attn at 10 % take h* 0.0415 up and
    # 0.0316 down, not the delta method's ±0.0359.
    def edges(x):  # (h*, h_even) by the closed forms, T_fixed = TF (t_step does not enter)
        a, b = PM * N + PO * OSL, (PM - PH) * N
        e, f = x[1] * N, x[2] * N * N / 2
        c = TF + e + f + OSL * (x[3] + x[4] * (N + OSL / 2))
        return (a - math.sqrt(a * a - b * (b * c - a * e) / f)) / b, (b * c - a * e) / (a * f)

    coef = _coef(1e-3)  # exits: h* 0.6517, h_even 0.9394 (test above)
    x0 = np.array(coef.as_tuple())
    assert edges(x0) == pytest.approx((0.651692, 0.939353), rel=1e-5)  # the hand numbers above
    sd = np.array([1e-3, 2e-6, 2e-9, 1e-4, 1e-9])
    bt = bathtub_chip_time(coef, np.diag(sd**2), TF, N, OSL, 0.3, PM, PH, PO)
    g = np.zeros((2, 5))
    for j in range(5):
        step = np.eye(5)[j] * 1e-4 * x0[j]
        g[:, j] = (np.array(edges(x0 + step)) - np.array(edges(x0 - step))) / (2 * 1e-4 * x0[j])
    for i, (name, got) in enumerate((("h_star", bt.h_star_stderr), ("h_even", bt.h_even_stderr))):
        sigma = math.sqrt(g[i] @ np.diag(sd**2) @ g[i])
        delta = sd**2 * g[i] / sigma
        moved = [edges(x0 + sign * 1.96 * delta)[i] for sign in (1, -1)]
        expected = max(sigma, *(abs(h - edges(x0)[i]) / 1.96 for h in moved))
        assert expected > 1.1 * sigma  # the moves, not the delta method, set it here
        assert got == pytest.approx(expected, rel=1e-3), name
    # a coefficient of infinite variance: no bound at all (a move along it is no number)
    inf = bathtub_chip_time(coef, np.diag([1e-6, 1e-12, np.inf, 1e-8, 1e-18]), TF, N, OSL, 0.3, PM, PH, PO)
    assert inf.h_star_stderr == math.inf and inf.h_even_stderr == math.inf
    wall = bathtub_chip_time(_coef(2e-3), np.diag(sd**2), TF, N, OSL, 0.3, PM, PH, PO)
    assert wall.exit is False and wall.h_even_stderr is None and wall.h_star_stderr is not None  # h* inside


def test_chip_time_edge_intervals_hold_the_true_edges_while_the_coefficients_are_uncertain():
    # Early windows: k_attn known to 60 %, k_ffn to 10 %. Coefficients drawn about the truth with
    # that (diagonal) covariance, clipped at 0, each the fit's estimate: the 95 % intervals of
    # h* and h_even (value ± 1.96 stderr) must hold the true edges (0.6517, 0.9394; test above)
    # in 95 % of the draws. The delta method alone missed 12 % and 13 % (h* moves nonlinearly with
    # k_attn); ≤ 8 %: 5 % plus two binomial sd of ~230 draws.
    coef = _coef(1e-3)
    x0 = np.array(coef.as_tuple())
    sd = x0 * np.array([0.05, 0.1, 0.6, 0.05, 0.3])
    rng = np.random.default_rng(1)
    miss = {"h_star": [], "h_even": []}
    for _ in range(300):
        b = bathtub_chip_time(ChipTimeCoefficients(*np.maximum(rng.normal(x0, sd), 0.0)), np.diag(sd**2), TF, N, OSL,
                              0.3, PM, PH, PO)
        for name, truth in (("h_star", 0.651692), ("h_even", 0.939353)):
            value, se = getattr(b, name), getattr(b, f"{name}_stderr")
            if value is not None and se is not None:
                miss[name].append(abs(value - truth) > 1.96 * se)
    assert all(len(m) > 200 and sum(m) / len(m) <= 0.08 for m in miss.values()), {k: sum(m) / len(m) for k, m in miss.items()}


def test_no_valley_active_at_h_zero():
    # At h = 0, R(h) = R(0) (MODEL.md §4): R'(0) < 0 says more hits would lose, but nothing is lost
    # yet; the gauge said 1 there, and the fleet rule counted pods without hits as in the valley
    # (a physics review). Linear: R'(0) = TPS0·P_miss·(ρ - a) = 2e-3·(0.1 - 0.5) = -8e-4.
    b = bathtub_linear(TPS0, A_, TINY_LIN, 0.0, P_MISS, RHO)
    assert b.slope_now == pytest.approx(2e-3 * (0.1 - 0.5)) and b.slope_ci[1] < 0
    assert b.valley_active is False
    # chip time (module docstring): R'(0)·C² = AE - BC < 0 here, as its h* ≈ 0.652 > 0 says
    b = bathtub_chip_time(_coef(1e-3), np.diag([0.0, 1e-16, 1e-24, 1e-12, 1e-24]), TF, N, OSL, 0.0, PM, PH, PO)
    assert b.slope_now < 0 and b.slope_ci[1] < 0 and b.valley_active is False


def test_chip_time_valley_active():
    tiny = np.diag([0.0, 1e-16, 1e-24, 1e-12, 1e-24])
    # h=0.3 < h* ≈ 0.652: R' < 0 and a tiny interval → active
    assert bathtub_chip_time(_coef(1e-3), tiny, TF, N, OSL, 0.3, PM, PH, PO).valley_active is True
    # h=0.95 > h*: R' > 0 → inactive
    b = bathtub_chip_time(_coef(1e-3), tiny, TF, N, OSL, 0.95, PM, PH, PO)
    assert b.slope_now > 0 and b.valley_active is False
    # 100 % σ on k_ffn (5e-5) and k_attn (2e-8). From the gradient formula of the previous test at
    # h=0.3: R' = -2.2825e-3, ∂R'/∂k_ffn = 35.60, ∂R'/∂k_attn = 4.2615e4 → sd = sqrt(1.780e-3² +
    # 8.523e-4²) = 1.974e-3, half width 1.96·1.974e-3 = 3.87e-3 > 2.28e-3: straddles 0 → inactive
    huge = np.diag([0.0, 2.5e-9, 4e-16, 1e-12, 1e-24])
    b = bathtub_chip_time(_coef(1e-3), huge, TF, N, OSL, 0.3, PM, PH, PO)
    assert b.slope_now < 0 < b.slope_ci[1] and b.valley_active is False


def test_chip_time_no_valley():
    # P_hit = P_miss, no attention: num = P·N constant, den falls with h → R rises, R'(0) > 0
    b = bathtub_chip_time(FFN_ONLY, None, 0.1, 1000, 0, 0.3, 1e-6, 1e-6, 0.0)
    assert b.slope_now > 0
    assert b.h_star is None and b.h_even is None and b.exit is None


def test_chip_time_rejects_bad_input():
    with pytest.raises(ValueError):  # cov must be 5×5
        bathtub_chip_time(FFN_ONLY, np.eye(2), 0.1, 1000, 0, 0.3, 1e-6, 1e-7, 0.0)
    with pytest.raises(ValueError):  # h_now beyond h_max = 0.999
        bathtub_chip_time(FFN_ONLY, None, 0.1, 1000, 0, 0.9995, 1e-6, 1e-7, 0.0)
    with pytest.raises(ValueError):  # t_chip = 0 at h=1 (nothing but miss work)
        bathtub_chip_time(FFN_ONLY, None, 0.0, 1000, 0, 0.3, 1e-6, 1e-7, 0.0, h_max=1.0)
    with pytest.raises(ValueError, match="finite"):
        bathtub_chip_time(FFN_ONLY, None, 0.1, 1000, 0, 0.3, math.nan, 1e-7, 0.0)
    with pytest.raises(ValueError, match="≥ 0"):  # a negative k_attn breaks the unimodal R the bottom's search needs
        bathtub_chip_time(ChipTimeCoefficients(0.0, 1e-4, -1e-9, 0.0, 0.0), None, 0.1, 1000, 0, 0.3, 1e-6, 1e-7, 0.0)
    with pytest.raises(ValueError, match="grid points"):  # h = 1.5 read R = −0.91
        bathtub_chip_time(FFN_ONLY, None, 0.1, 1000, 0, 0.3, 1e-6, 1e-7, 0.0, grid=[0.0, 1.5])


# --- derived a ------------------------------------------------------------------------------


def test_derived_constant_throughput():
    # T_fixed=0, k_attn=0, OSL=0: TPS = (1-h)N/(k_ffn(1-h)N) = 1/k_ffn = 1e4 for every h → a = 0
    tps0, a, se = derived_miss_slope(FFN_ONLY, None, 0.0, 1000, 0, 0.1, 0.8)
    assert tps0 == pytest.approx(1e4, rel=1e-12)
    assert a == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(se)
    # a ≡ 0 whatever k_ffn is, so variance in k_ffn alone gives a_stderr = 0
    _, _, se = derived_miss_slope(FFN_ONLY, np.diag([0, 1e-10, 0, 0, 0]), 0.0, 1000, 0, 0.1, 0.8)
    assert se == pytest.approx(0.0, abs=1e-9)


# T_fixed=0.05, k_ffn=1e-4, k_attn=2e-7, N=1000, no decode:
#   h=0:    t = 0.05 + 0.1 + 2e-7·500,000 = 0.25,          TPS = 1000/0.25 = 4000
#   h=0.25: t = 0.05 + 0.075 + 2e-7·468,750 = 0.21875,     TPS = 750/0.21875 = 24000/7
#   h=0.5:  t = 0.05 + 0.05 + 2e-7·375,000 = 0.175,       TPS = 500/0.175 = 20000/7
# The three points are collinear: slope = (20000/7 - 4000)/0.5 = -16000/7, intercept 4000,
# a = (16000/7)/4000 = 4/7.
ATT = ChipTimeCoefficients(t_step=0.0, k_ffn=1e-4, k_attn=2e-7, k_dec=0.0, k_ctx=0.0)


@pytest.mark.parametrize("n", [2, 3])
def test_derived_few_points_by_hand(n):
    tps0, a, _ = derived_miss_slope(ATT, None, 0.05, 1000, 0, 0.0, 0.5, n=n)
    assert tps0 == pytest.approx(4000, rel=1e-12)
    assert a == pytest.approx(4 / 7, rel=1e-12)


def test_derived_stderr_two_points_by_hand():
    # n=2 on {0, 0.5}: a = (1 - y2/y1)/0.5, y = M/t → y2/y1 = (M2/M1)(t1/t2) = 0.5·t1/t2
    # ∂a/∂c = -(1/0.5)·0.5·(x(0)·t2 - t1·x(0.5))/t2² = -(x(0)·t2 - t1·x(0.5))/t2²
    #   k_ffn:  x = M:  -(1000·0.175 - 0.25·500)/0.030625 = -50/0.030625 = -1632.653
    #   k_attn: x = W:  -(500,000·0.175 - 0.25·375,000)/0.030625 = 6250/0.030625 = 204,081.6
    # σ = (1e-6, 1e-9): var = 1.632653e-3² + 2.040816e-4² = 2.665556e-6 + 4.164931e-8
    #   = 2.707205e-6 → a_stderr = 1.645359e-3
    g_ffn = -50 / 0.030625
    g_attn = 6250 / 0.030625
    expected = math.sqrt((g_ffn * 1e-6) ** 2 + (g_attn * 1e-9) ** 2)
    assert expected == pytest.approx(1.645359e-3, rel=1e-6)
    cov = np.diag([1e-4, 1e-12, 1e-18, 0.0, 0.0])  # t_step's variance must not matter …
    _, _, se = derived_miss_slope(ATT, cov, 0.05, 1000, 0, 0.0, 0.5, n=2)
    assert se == pytest.approx(expected, rel=1e-6)
    # … unless T_fixed = t_step × 10 steps: x = 10 at both h, ∂a/∂t_step = -10·(t2 - t1)/t2²
    #   = -10·(0.175 - 0.25)/0.030625 = 24.4898; σ 1e-2 adds (0.244898)² to the variance
    g_step = -10 * (0.175 - 0.25) / 0.030625
    _, _, se = derived_miss_slope(ATT, cov, 0.05, 1000, 0, 0.0, 0.5, n=2, fixed_steps=10.0)
    assert se == pytest.approx(math.sqrt(expected**2 + (g_step * 1e-2) ** 2), rel=1e-6)


def _continuous_line(tps, lo: float, hi: float, n: int = 200_001) -> tuple[float, float]:
    """(TPS0, a) of the least-squares line through tps(h) on [lo, hi] with every stretch of h counted
    by its width, ∫(y − b0 − b1·h)² dh: the normal equations' integrals by the trapezoid rule on a
    grid fine enough to be the integral (written out here, not polyfit)."""
    hs = np.linspace(lo, hi, n)
    w = np.full(n, (hi - lo) / (n - 1))
    w[[0, -1]] /= 2
    y = tps(hs)
    s0, s1, s2, t0, t1 = w.sum(), w @ hs, w @ hs**2, w @ y, w @ (hs * y)
    b1 = (s0 * t1 - s1 * t0) / (s0 * s2 - s1**2)
    b0 = (t0 - b1 * s1) / s0
    return b0, -b1 / b0


def test_derived_is_the_continuous_line_through_the_curve():
    # every term on, default 41 points on [0.2, 0.9]; TPS written out from MODEL.md §7
    k = ChipTimeCoefficients(t_step=0.0, k_ffn=5e-5, k_attn=2e-8, k_dec=1e-3, k_ctx=1e-8)
    n_, o_, tf = 8000.0, 100.0, 0.02

    def tps(hs):
        t = tf + 5e-5 * (1 - hs) * n_ + 2e-8 * n_**2 * (1 - hs**2) / 2 + o_ * (1e-3 + 1e-8 * (n_ + o_ / 2))
        return (1 - hs) * n_ / t
    icept, a_cont = _continuous_line(tps, 0.2, 0.9)
    tps0, a, _ = derived_miss_slope(k, None, tf, n_, o_, 0.2, 0.9)
    assert tps0 == pytest.approx(icept, rel=1e-4)
    assert a == pytest.approx(a_cont, abs=2e-4)
    assert 0 < a < 1  # falling miss throughput, as seed 002 measured


def test_derived_follows_the_steep_end_near_h_1_without_tilting():
    # The range kvhit fits over on agentic traffic reaches h = 0.99, where TPS_miss falls steeply
    # to 0. 41 equally weighted points gave the end points a whole step each: a 0.300 for a
    # continuous 0.270 (review). With 5 % of the chip time per request fixed (t_fixed) the curve
    # bends hardest there; Simpson's weights keep 41 points within 1e-4 of the integral.
    k = ChipTimeCoefficients(t_step=0.0, k_ffn=5e-5, k_attn=2e-8, k_dec=2e-4, k_ctx=0.0)
    n_, o_, tf = 4000.0, 200.0, 0.01

    def tps(hs):
        return (1 - hs) * n_ / (tf + 5e-5 * (1 - hs) * n_ + 2e-8 * n_**2 * (1 - hs**2) / 2 + o_ * 2e-4)
    _, a_cont = _continuous_line(tps, 0.0, 0.99)
    _, a, _ = derived_miss_slope(k, None, tf, n_, o_, 0.0, 0.99)
    assert a == pytest.approx(a_cont, abs=1e-4)
    hs = np.linspace(0.0, 0.99, 41)
    slope, icept = np.polyfit(hs, tps(hs), 1)  # the equal weights of before
    assert abs(-slope / icept - a_cont) > 5e-3


@pytest.mark.parametrize("lo, hi", [(0.5, 0.5), (0.6, 0.2)])
def test_derived_rejects_empty_range(lo, hi):
    with pytest.raises(ValueError):
        derived_miss_slope(ATT, None, 0.05, 1000, 0, lo, hi)


@pytest.mark.parametrize("a,h_max,exit_", [
    (1.2, 0.5, None),   # a ≥ 1: the line reaches TPS_miss 0 at h = 1/1.2; "no exit" reads it up to h = 1: withheld
    (1.2, 1.0, False),  # a line fitted up to h = 1 says so itself
    (0.5, 0.95, True),  # ρ = 0.1: h_even = (0.5 − 0.1)/(0.5·0.9) = 8/9 inside [0, 0.95]: exit
])
def test_the_analyzer_publishes_the_linear_exit_only_as_far_as_the_line_was_fitted(a, h_max, exit_):
    # physics review: with a ≥ 1 kvhit published kvhit_valley_exit 0 ("R never climbs back to R(0)
    # before h = 1") from a line fitted over h 0–0.5, while withholding h* and h_even beyond that range
    from exporter.analyzer import Analyzer
    from exporter.config import Config
    from fitters.result import Estimate, FitResult, Status
    slope = FitResult(Status.OK, params={"tps0": Estimate(1000.0, 1.0), "a": Estimate(a, 0.01)},
                      extra={"h_min": 0.0, "h_max": h_max})
    unknown: dict[str, str] = {}
    b = Analyzer(Config())._linear_bathtub(slope, 0.3, unknown)["linear"]  # ρ = 0.1 (the default)
    assert b.exit is exit_
    assert ("valley_exit_linear" in unknown) == (exit_ is None)
    if exit_ is None:
        assert unknown["valley_exit_linear"].startswith("beyond the h range the direct miss slope was fitted on")


@pytest.mark.parametrize("h_min, published", [(0.85, False), (0.005, True)])
def test_the_linear_breakeven_and_exit_need_the_line_fitted_down_to_h_0(h_min, published):
    # SRE breaker: agentic traffic (h 0.85-0.99, no valley: R' > 0 there) fitted a = 0.663, and the
    # line's h_even = (a − ρ)/(a(1 − ρ)) = 0.563/0.5967 = 0.943, inside that range, was published
    # with an exit, both comparing with an R(0) the line never saw
    from exporter.analyzer import Analyzer
    from exporter.config import Config
    from fitters.result import Estimate, FitResult, Status
    slope = FitResult(Status.OK, params={"tps0": Estimate(1000.0, 1.0), "a": Estimate(0.663, 0.01)},
                      extra={"h_min": h_min, "h_max": 0.99})
    unknown: dict[str, str] = {}
    b = Analyzer(Config())._linear_bathtub(slope, 0.9, unknown)["linear"]  # ρ = 0.1 (the default)
    if published:
        assert b.h_even == pytest.approx(0.563 / (0.663 * 0.9)) and b.exit is True
        assert "valley_breakeven_linear" not in unknown and "valley_exit_linear" not in unknown
    else:
        assert b.h_even is None and b.h_even_stderr is None and b.exit is None
        for signal in ("valley_breakeven_linear", "valley_exit_linear"):
            assert unknown[signal] == ("they compare with R(0), at h = 0, below the h range the direct miss slope was "
                                       "fitted on: its line says nothing there (measured: h range [0.850, 0.990])")


@pytest.mark.parametrize("a,rho,why", [
    (1.05, 0.1, "the direct slope a >= 1"),   # R ∝ (1 − 1.05h)(1 − 0.9h)/(1 − h) falls to 0 at h = 1/1.05
    (0.5, 0.0, "hits are free"),              # R ∝ 1 − 0.5h: falls all the way to h = 1
])
def test_a_linear_valley_without_a_bottom_says_why(a, rho, why):
    # physics review: with a ≥ 1 the valley was active but kvhit_valley_bottom_hit_ratio{form="linear"}
    # was absent with no kvhit_unknown_info saying why (MODEL.md §6: absent, and the status says why)
    from dataclasses import replace
    from exporter.analyzer import Analyzer
    from exporter.config import Config
    from fitters.result import Estimate, FitResult, Status
    slope = FitResult(Status.OK, params={"tps0": Estimate(1000.0, 1.0), "a": Estimate(a, 0.01)},
                      extra={"h_min": 0.0, "h_max": 0.95})
    cfg = Config()
    cfg = replace(cfg, prices=replace(cfg.prices, hit_price_ratio=rho))
    unknown: dict[str, str] = {}
    b = Analyzer(cfg)._linear_bathtub(slope, 0.3, unknown)["linear"]
    # R'(0) = TPS0·P_miss·(ρ − a) < 0: a valley; R' at 0.3 < 0 too (R falls all the way)
    assert b.slope_now < 0 and b.h_star is None
    assert unknown["valley_bottom_linear"].startswith(why)


def test_a_linear_valley_with_a_bottom_has_no_such_reason():
    from exporter.analyzer import Analyzer
    from exporter.config import Config
    from fitters.result import Estimate, FitResult, Status
    slope = FitResult(Status.OK, params={"tps0": Estimate(1000.0, 1.0), "a": Estimate(0.5, 0.01)},
                      extra={"h_min": 0.0, "h_max": 0.95})
    unknown: dict[str, str] = {}
    b = Analyzer(Config())._linear_bathtub(slope, 0.3, unknown)["linear"]
    assert b.h_star == pytest.approx(2 / 3)  # MODEL.md §4's example: a = 0.5, ρ = 0.1
    assert "valley_bottom_linear" not in unknown


def test_a_valley_within_rounding_of_r0_has_its_exit_at_its_bottom():
    # R'(0) = −4.3e-12, a hair below 0 (R'(0) ≈ P_miss·… within 3e-9 of it), and R(h_max) > R(0):
    # a valley of zero width at h = 0 with an exit. The bounded search's bottom came out 2e-8, a
    # rounding above R(0), and brentq raised (same sign at both ends): the model was dropped (audit)
    coef = ChipTimeCoefficients(0.023, 1.2e-4, 5.3e-8, 0.035, 7.5e-8)
    b = bathtub_chip_time(coef, None, 0.013, 14072, 91, 0.0, 1e-6, 8.328066938842936e-07, 2e-6)
    assert b.slope_now < 0 and b.exit is True
    assert b.h_star == pytest.approx(0.0, abs=1e-6) and b.h_even == pytest.approx(0.0, abs=1e-6)


class _Identified:
    """A collinear fit's two identification checks (FittedModel.unidentified, .unidentified_slope):
    the chip time is unidentified at the h in ``bad`` (h → why), the slope everywhere identified."""

    def __init__(self, bad: dict[float, str]):
        self.bad = bad

    def unidentified(self, h: float, isl: float, osl: float) -> str | None:
        return self.bad.get(h)

    def unidentified_slope(self, h: float, isl: float) -> str | None:
        return None


def _valley(exit_: bool, h_even: float | None) -> BathtubCurve:
    # a valley whose bottom is at 0.6; the curve's last point is h_max 0.95
    return BathtubCurve("chip_time", h_now=0.5, revenue_now=0.9, revenue_zero=1.0, slope_now=-0.1,
                        slope_ci=(-0.2, -0.05), h_star=0.6, h_even=h_even, exit=exit_, valley_active=True,
                        curve=((0.0, 1.0), (0.5, 0.9), (0.6, 0.85), (0.8, 1.0), (0.95, 0.97)),
                        h_star_stderr=0.01, h_even_stderr=0.02 if h_even is not None else None)


def test_no_exit_is_withheld_where_h_max_is_unidentified_and_r0_stays():
    from exporter.analyzer import _local_bathtub
    unknown: dict[str, str] = {}
    b = _local_bathtub(_valley(False, None), _Identified({0.95: "off at h_max"}), 1000.0, 100.0, 0.95, unknown)
    # "no exit" claims R < R(0) all the way to h_max: unread there, it is unknown (None), not False
    assert b.exit is None and b.h_even is None
    assert unknown == {"valley_breakeven_chip_time": "off at h_max", "valley_exit_chip_time": "off at h_max"}
    # h = 0 and the bottom are identified: R(0) and h* stand; the curve drops h_max's point only
    assert b.revenue_zero == 1.0 and b.h_star == 0.6 and b.h_star_stderr == 0.01
    assert [h for h, _ in b.curve] == [0.0, 0.5, 0.6, 0.8]


def test_an_exit_identified_where_it_is_stands_when_only_h_max_is_unidentified():
    from exporter.analyzer import _local_bathtub
    unknown: dict[str, str] = {}
    b = _local_bathtub(_valley(True, 0.8), _Identified({0.95: "off at h_max"}), 1000.0, 100.0, 0.95, unknown)
    # R climbs back to R(0) at 0.8, read where the chip time is identified: h_max plays no part
    assert (b.exit, b.h_even, b.h_even_stderr, b.revenue_zero, b.h_star) == (True, 0.8, 0.02, 1.0, 0.6)
    assert unknown == {}
    assert [h for h, _ in b.curve] == [0.0, 0.5, 0.6, 0.8]


def test_no_exit_stands_where_h_max_is_identified():
    from exporter.analyzer import _local_bathtub
    unknown: dict[str, str] = {}
    b = _local_bathtub(_valley(False, None), _Identified({0.5: "off at 0.5"}), 1000.0, 100.0, 0.95, unknown)
    assert b.exit is False and b.revenue_zero == 1.0 and unknown == {}
    assert [h for h, _ in b.curve] == [0.0, 0.6, 0.8, 0.95]
