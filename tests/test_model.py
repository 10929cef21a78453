"""fitters/model.py against numbers worked by hand from MODEL.md §3–§5 and the seeds.

Every expected value is derived in a comment; none is copied from the code's output.
"""

import math

import pytest

from fitters import model as m
from fitters.model import ChipTimeCoefficients

MiB = 2**20
GiB = 2**30


# --- §3.6 KV sizes -------------------------------------------------------------------------


def test_kv_llama2_7b():
    # 2·L·heads·d·b = 2·32·32·128·2 = 524,288 bytes/token (MODEL.md §3.6)
    s = m.kv_bytes_per_token(layers=32, kv_heads=32, head_dim=128, dtype_bytes=2, tp=1)
    assert s == 524_288
    # 1024 tokens · 524,288 = 536,870,912 bytes = 512·2^20 = 512 MiB
    assert s * 1024 == 512 * MiB


def test_kv_qwen25_72b_per_gpu():
    # 2·80·(8/4)·128·2 = 2·80·2·128·2 = 81,920 bytes/token/GPU (not the seed's 163,840)
    s = m.kv_bytes_per_token(layers=80, kv_heads=8, head_dim=128, dtype_bytes=2, tp=4)
    assert s == 81_920
    # 32·8192 = 262,144 tokens · 81,920 = 21,474,836,480 bytes = 20·2^30 = 20 GiB per GPU
    assert s * 32 * 8192 == 20 * GiB
    # whole model (tp=1): 2·80·8·128·2 = 327,680 bytes/token → ×262,144 = 80 GiB
    assert m.kv_bytes_per_token(80, 8, 128, 2, tp=1) * 32 * 8192 == 80 * GiB


def test_kv_heads_replicated_when_tp_exceeds_heads():
    # 8 KV heads on tp=16: each rank still holds max(1, 8/16) = 1 head → 2·80·1·128·2 = 40,960
    assert m.kv_bytes_per_token(80, 8, 128, 2, tp=16) == 40_960
    # same as tp=8 (exactly one head per rank): 2·80·(8/8)·128·2 = 40,960
    assert m.kv_bytes_per_token(80, 8, 128, 2, tp=8) == 40_960


def test_kv_mla():
    # DeepSeek-V3: L=61, kv_lora_rank=512, qk_rope_head_dim=64, bf16:
    # 61·(512+64)·2 = 61·576·2 = 70,272 bytes/token, on every TP rank
    assert m.kv_bytes_per_token_mla(61, 512, 64, 2) == 70_272


# --- §3.1 work ratios ----------------------------------------------------------------------


@pytest.mark.parametrize("h", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_attention_work_is_one_minus_h_squared(h):
    # W = M·H + M²/2 = N²(1-h)(h + (1-h)/2) = N²(1-h)(1+h)/2  →  W/(N²/2) = 1-h²
    n = 1000.0
    assert m.attention_work(n, h) / (n * n / 2) == pytest.approx(1 - h * h, abs=1e-12)
    assert m.attention_ratio(h) == pytest.approx(1 - h * h)
    assert m.ffn_ratio(h) == pytest.approx(1 - h)


def test_attention_work_by_hand():
    # N=1000, h=0.5: M=500, H=500 → 500·500 + 500²/2 = 250,000 + 125,000 = 375,000
    assert m.attention_work(1000, 0.5) == 375_000
    # N=1000, h=0.25: M=750, H=250 → 187,500 + 281,250 = 468,750
    assert m.attention_work(1000, 0.25) == 468_750


def test_regressor_slopes_by_hand():
    # −∂/∂h of (steps, M, W, OSL, C) at N = 1000, h = 0.5: M = (1-h)N falls by N = 1000 per unit h;
    # W = N²(1-h²)/2 falls by N²·h = 500,000 per unit h (from 375,000 at 0.5: 0.501 gives
    # 1000²·(1 - 0.251001)/2 = 374,499.5, 500.5 less per 0.001); the rest does not move with h
    assert m.chip_time_regressor_slopes(1000.0, 0.5) == (0.0, 1000.0, 500_000.0, 0.0, 0.0)
    assert m.attention_work(1000, 0.501) == pytest.approx(374_499.5)
    # at h = 0.25, where W ∝ 1 - h would fall by N²/2 = 500,000 too: N²·h = 250,000
    assert m.chip_time_regressor_slopes(1000.0, 0.25) == (0.0, 1000.0, 250_000.0, 0.0, 0.0)


def test_compute_time_seed():
    # T_attn,0=2 s, T_ffn,0=1 s, h=0.5: 2·(1-0.25) + 1·(1-0.5) = 1.5 + 0.5 = 2.0 s
    assert m.compute_time_seed(0.5, 2.0, 1.0) == pytest.approx(2.0)


# --- §3.2 TTFT -----------------------------------------------------------------------------


def test_load_time_by_hand():
    # h_load=0.5, N=8192, S_kv=81,920 B, B_load=25e9 B/s (Gen4 x16):
    # 0.5·8192·81,920 = 335,544,320 B → /25e9 = 0.0134217728 s
    assert m.load_time(0.5, 8192, 81_920, 25e9) == pytest.approx(0.0134217728, rel=1e-12)


@pytest.mark.parametrize("bw", [0.0, -1.0, math.nan])
def test_load_time_rejects_bad_bandwidth(bw):
    with pytest.raises(ValueError):
        m.load_time(0.5, 8192, 81_920, bw)


def test_ttft_overlap_extremes_and_middle():
    # T_fixed=0.1, T_load=0.3, T_compute=0.5
    # α=0: plain sum 0.1+0.3+0.5 = 0.9
    assert m.ttft_unified(0.1, 0.3, 0.5, 0.0) == pytest.approx(0.9)
    # α=1: 0.1 + max(0.3, 0.5) = 0.6
    assert m.ttft_unified(0.1, 0.3, 0.5, 1.0) == pytest.approx(0.6)
    # α=0.5: 0.9 - 0.5·min(0.3, 0.5) = 0.9 - 0.15 = 0.75
    assert m.ttft_unified(0.1, 0.3, 0.5, 0.5) == pytest.approx(0.75)
    # load-bound, α=1: 0.1 + max(0.8, 0.2) = 0.9
    assert m.ttft_unified(0.1, 0.8, 0.2, 1.0) == pytest.approx(0.9)
    # overlap term itself: 0.25·min(0.8, 0.2) = 0.05
    assert m.overlap_time(0.25, 0.8, 0.2) == pytest.approx(0.05)
    for alpha in (1.5, -0.1, math.nan):  # α = 1.5 read 0.6 − 0.15 = 0.45 s, below T_fixed + max = 0.6 s
        with pytest.raises(ValueError, match="α"):
            m.ttft_unified(0.1, 0.3, 0.5, alpha)


def test_tpm_rejects_a_chip_time_that_is_no_time_and_h_outside_0_1():
    for t_chip in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="t_chip"):
            m.tpm_delivered(1000, 100, t_chip)
    with pytest.raises(ValueError, match="h must be"):
        m.tpm_physical(1000, 100, 1.2, 0.5)


# --- §3.3 first-order capacity ------------------------------------------------------------


def test_load_compute_ratio_by_hand():
    # δ = N·S/(B·T0) = 8192·81,920 / (25e9·1.0) = 671,088,640 / 25e9 = 0.0268435456
    assert m.load_compute_ratio(8192, 81_920, 25e9, 1.0) == pytest.approx(0.0268435456, rel=1e-12)


def test_capacity_first_order():
    # compute-bound: Θ0=100, h=0.9, h_load=0.9, δ=0.0268435456 → max(0.1, 0.02416) = 0.1 → 1000
    assert m.capacity_first_order(100, 0.9, 0.9, 0.0268435456) == pytest.approx(1000)
    # load-bound: δ=2, h=0.8, h_load=0.5 → max(0.2, 1.0) = 1.0 → 100
    assert m.capacity_first_order(100, 0.8, 0.5, 2.0) == pytest.approx(100)
    # finite at h=1 when every hit is loaded: δ=0.05 → max(0, 0.05) → 100/0.05 = 2000
    assert m.capacity_first_order(100, 1.0, 1.0, 0.05) == pytest.approx(2000)


# --- §7 chip time (used by §3.4, §3.5, §4) --------------------------------------------------


def test_t_chip_by_hand():
    k = ChipTimeCoefficients(t_step=0.01, k_ffn=1e-4, k_attn=1e-8, k_dec=0.02, k_ctx=1e-6)
    # ISL=1000, OSL=100, h=0.5, T_fixed=0.05:
    # ffn 1e-4·500 = 0.05; attn 1e-8·375,000 = 0.00375
    # decode 100·(0.02 + 1e-6·(1000 + 50)) = 100·0.02105 = 2.105
    # total 0.05 + 0.05 + 0.00375 + 2.105 = 2.20875
    assert k.t_chip(1000, 100, 0.5, 0.05) == pytest.approx(2.20875, rel=1e-12)
    # ∂t/∂h = -k_ffn·N - k_attn·N²·h = -0.1 - 1e-8·1e6·0.5 = -0.105
    assert k.d_t_chip_dh(1000, 0.5) == pytest.approx(-0.105, rel=1e-12)
    # T_fixed = T_step·steps = 0.01·12 = 0.12
    assert m.steps_fixed_time(0.01, 12) == pytest.approx(0.12)


# --- §3.4 / §3.5 TPM ------------------------------------------------------------------------


def test_tpm_delivered_and_physical():
    # ISL=1000, OSL=200, t_chip=2 s: delivered (1000+200)·60/2 = 36,000 tokens/min
    assert m.tpm_delivered(1000, 200, 2.0) == pytest.approx(36_000)
    # h=0.75: physical (250+200)·60/2 = 13,500
    assert m.tpm_physical(1000, 200, 0.75, 2.0) == pytest.approx(13_500)


def test_tpm_hit_correction():
    # 36,000 measured at C=2.0 s, target C=1.5 s: 36,000·2/1.5 = 48,000 delivered
    # physical at h=0.9: 48,000·(1000·0.1 + 200)/(1000 + 200) = 48,000·300/1200 = 12,000
    d, p = m.tpm_hit_correction(36_000, 2.0, 1.5, 1000, 200, 0.9)
    assert d == pytest.approx(48_000)
    assert p == pytest.approx(12_000)


# --- §4 linear bathtub closed forms ---------------------------------------------------------
# With s = 1-h, b = 1-ρ: R/(TPS0·P_miss) = (1-a+a·s)(ρ+b·s)/s = (1-a)ρ/s + (1-a)b + aρ + ab·s,
# so dR/dh = -dR/ds = TPS0·P_miss·((1-a)ρ/s² - a·b).


def test_linear_closed_forms_worked_example():
    # a=0.5, ρ=0.1: s*² = ρ(1-a)/(a(1-ρ)) = 0.05/0.45 = 1/9 → h* = 1 - 1/3 = 2/3
    assert m.valley_bottom_linear(0.5, 0.1) == pytest.approx(2 / 3, rel=1e-12)
    # h_even = (a-ρ)/(a(1-ρ)) = 0.4/0.45 = 8/9
    assert m.breakeven_linear(0.5, 0.1) == pytest.approx(8 / 9, rel=1e-12)


def test_linear_revenue_values():
    tps0, p, a, rho = 1000.0, 2e-6, 0.5, 0.1
    # R(0) = TPS0·P_miss = 2e-3
    r0 = 2e-3
    assert m.revenue_linear(0.0, tps0, a, p, rho) == pytest.approx(r0)
    # R(2/3) = 2e-3·(1-1/3)(1-0.6)/(1/3) = 2e-3·(2/3)(0.4)(3) = 2e-3·0.8
    assert m.revenue_linear(2 / 3, tps0, a, p, rho) == pytest.approx(0.8 * r0)
    # R(8/9) = 2e-3·(5/9)(1-0.8)/(1/9) = 2e-3·(5/9)(0.2)(9) = 2e-3
    assert m.revenue_linear(8 / 9, tps0, a, p, rho) == pytest.approx(r0)
    # TPS_miss(0.5) = 1000·0.75 = 750; TPS_hit(0.5) = 0.5/0.5·750 = 750
    assert m.miss_tps_linear(0.5, tps0, a) == pytest.approx(750)
    assert m.hit_tps_linear(0.5, tps0, a) == pytest.approx(750)


def test_linear_slope_by_hand():
    tps0, p, a, rho = 1000.0, 2e-6, 0.5, 0.1
    # R'(0) = TPS0·P_miss·(ρ-a) = 2e-3·(-0.4) = -8e-4
    assert m.revenue_slope_linear(0.0, tps0, a, p, rho) == pytest.approx(-8e-4)
    # R'(0.5): s=0.5 → 2e-3·(0.05/0.25 - 0.45) = 2e-3·(-0.25) = -5e-4
    assert m.revenue_slope_linear(0.5, tps0, a, p, rho) == pytest.approx(-5e-4)
    # R'(h*) = 0: s² = 1/9 → 0.05·9 - 0.45 = 0
    assert m.revenue_slope_linear(2 / 3, tps0, a, p, rho) == pytest.approx(0.0, abs=1e-15)


@pytest.mark.parametrize("a, rho", [(0.1, 0.25), (0.2, 0.2), (0.0, 0.1)])
def test_linear_no_valley_when_a_le_rho(a, rho):
    assert m.valley_bottom_linear(a, rho) is None
    assert m.breakeven_linear(a, rho) is None
    # R'(0) = TPS0·P_miss·(ρ-a) ≥ 0, e.g. 1000·2e-6·(0.25-0.1) = 3e-4
    assert m.revenue_slope_linear(0.0, 1000, a, 2e-6, rho) == pytest.approx(2e-3 * (rho - a))
    assert m.revenue_slope_linear(0.0, 1000, a, 2e-6, rho) >= 0


# --- §4 chip-time revenue -------------------------------------------------------------------


def test_revenue_chip_time_by_hand():
    k = ChipTimeCoefficients(t_step=0.0, k_ffn=1e-4, k_attn=0.0, k_dec=0.0, k_ctx=0.0)
    # ISL=1000, OSL=0, T_fixed=0.1, P_miss=1e-6, P_hit=1e-7, h=0.5:
    # num = 1e-6·500 + 1e-7·500 = 5.5e-4; den = 0.1 + 1e-4·500 = 0.15 → R = 3.666…e-3
    assert m.revenue_chip_time(0.5, 1000, 0, k, 0.1, 1e-6, 1e-7, 0.0) == pytest.approx(5.5e-4 / 0.15)
    # per request with output: P_out=4e-6, OSL=100 → +4e-4: 5.5e-4 + 4e-4 = 9.5e-4
    assert m.revenue_per_request(0.5, 1000, 100, 1e-6, 1e-7, 4e-6) == pytest.approx(9.5e-4)


# --- §5 cost and switches -------------------------------------------------------------------


def test_unit_and_effective_cost():
    # 20 ¥/h, 500 SLO-passing tok/s: 20·1e6 / (500·3600) = 20e6/1.8e6 = 11.111… ¥ per 1M tokens
    u = m.unit_cost_per_million(20.0, 500.0)
    assert u == pytest.approx(100 / 9, rel=1e-12)
    # 5 % retries: (100/9)/0.95 = 100/8.55 = 11.6959…
    assert m.effective_cost(u, 0.05) == pytest.approx(100 / 8.55, rel=1e-12)


def test_frechet_bounds():
    # 0.9, 0.8: (max(0, 0.9+0.8-1), min) = (0.7, 0.8)
    lo, hi = m.slo_pass_bounds(0.9, 0.8)
    assert (lo, hi) == (pytest.approx(0.7), pytest.approx(0.8))
    # 0.3, 0.4: 0.3+0.4-1 = -0.3 → 0; min = 0.3
    lo, hi = m.slo_pass_bounds(0.3, 0.4)
    assert (lo, hi) == (0.0, pytest.approx(0.3))


def test_prefill_share_and_speedup():
    # P̄=0.3 s, D̄=0.7 s: 0.3/1.0 = 0.3
    assert m.prefill_share(0.3, 0.7) == pytest.approx(0.3)
    # h=0.8, share=0.5: 1/(1-0.4) = 1.6667
    assert m.caching_speedup(0.8, 0.5) == pytest.approx(5 / 3)
    # h=0.9, share=0.3: 1/(1-0.27) = 1/0.73 = 1.36986…
    assert m.caching_speedup(0.9, 0.3) == pytest.approx(1 / 0.73)
