"""fitters/histogram.py, fitters/cost.py and fitters/sizing.py against values worked by hand
(MODEL.md §3.3, §3.6, §5; seeds 000 §6.1/§7, 003, 004 §3.3).

Every expected value is derived in a comment; none is copied from the code's output.
Real buckets come from tests/data/samples/25_vllm_v1_0.32_cpu_full_snapshot.prom (one scrape of
a vLLM 0.32 server after a sweep: its lifetime histogram is the increase since the start).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from exporter.parse import parse_exposition
from fitters.cost import SloShares, pass_bounds, slo_cost, slo_shares
from fitters.histogram import quantile, share_at_most
from fitters.model import kv_bytes_per_token
from fitters.result import Status
from fitters.sizing import (TpotConcurrencyFitter, concurrency_from_memory, first_order_capacity,
                            max_concurrency, peak_kv_bytes)

MiB, GiB = 2**20, 2**30
SAMPLE_25 = Path(__file__).parent / "data" / "samples" / "25_vllm_v1_0.32_cpu_full_snapshot.prom"


@pytest.fixture(scope="module")
def tiny():
    return parse_exposition(SAMPLE_25.read_text(), 1.0).models["tiny"]


# --- histogram quantile / share (real buckets of sample 25) --------------------------------


def test_p95_from_real_buckets(tiny):
    ttft = tiny.histograms["ttft"]
    # TTFT: count 3242, rank 0.95·3242 = 3079.9; cumulative 2843 at le=0.75 and 3082 at le=1.0
    # → 0.75 + 0.25·(3079.9 − 2843)/(3082 − 2843) = 0.75 + 0.25·236.9/239 = 0.997803 s
    assert quantile(ttft.buckets, ttft.count, 0.95) == pytest.approx(0.75 + 0.25 * 236.9 / 239, rel=1e-12)
    tpot = tiny.histograms["request_tpot"]
    # request TPOT: rank 3079.9; 2917 at le=0.025 and 3209 at le=0.05
    # → 0.025 + 0.025·(3079.9 − 2917)/(3209 − 2917) = 0.025 + 0.025·162.9/292 = 0.0389469 s
    assert quantile(tpot.buckets, tpot.count, 0.95) == pytest.approx(0.025 + 0.025 * 162.9 / 292, rel=1e-12)


def test_quantile_edge_cases():
    # rank in the first bucket: interpolated from 0 → 0 + 2·(0.5·10)/10 = 1.0
    assert quantile(((2.0, 10.0), (math.inf, 10.0)), 10, 0.5) == 1.0
    # rank 9.5 lands in +Inf: only ≥ 1.0 is known → None (histogram_quantile would answer 1.0)
    assert quantile(((1.0, 5.0), (math.inf, 10.0)), 10, 0.95) is None
    # partial paste: the rank 9.5 is above the last known edge (3 observations ≤ 1.0) → unknown
    assert quantile(((1.0, 3.0),), 10, 0.95) is None
    assert quantile((), 10, 0.5) is None and quantile(((1.0, 0.0),), 0, 0.5) is None
    with pytest.raises(ValueError):
        quantile(((1.0, 1.0),), 1, 1.5)


def test_share_at_most_brackets_between_edges(tiny):
    ttft = tiny.histograms["ttft"]
    # exactly on an edge: 2047 of 3242 at le=0.25 → both bounds 2047/3242
    assert share_at_most(ttft.buckets, ttft.count, 0.25) == (2047 / 3242, 2047 / 3242)
    # 0.3 s between 0.25 (2047) and 0.5 (2713) → [2047/3242, 2713/3242]
    assert share_at_most(ttft.buckets, ttft.count, 0.3) == (2047 / 3242, 2713 / 3242)
    # below the first edge (0.001): none known ≤ it; upper = 0 at le=0.001 → [0, 0]
    assert share_at_most(ttft.buckets, ttft.count, 0.0005) == (0.0, 0.0)
    # a partial histogram: 3 of 10 at le=1.0, nothing known above → [0.3, 1.0]
    assert share_at_most(((1.0, 3.0),), 10, 2.0) == (0.3, 1.0)


def test_pass_bounds_from_real_buckets(tiny):
    ttft, tpot = tiny.histograms["ttft"], tiny.histograms["request_tpot"]
    # SLOs on edges: TTFT ≤ 0.25 s → 2047/3242; TPOT ≤ 0.025 s → 2917/3242
    # lower = max(0, (2047 + 2917)/3242 − 1) = (4964 − 3242)/3242 = 1722/3242 = 0.531153
    # upper = min(2047, 2917)/3242 = 2047/3242 = 0.631401
    lo, hi = pass_bounds(slo_shares(ttft.buckets, ttft.count, 0.25), slo_shares(tpot.buckets, tpot.count, 0.025))
    assert lo == pytest.approx(1722 / 3242, rel=1e-12)
    assert hi == pytest.approx(2047 / 3242, rel=1e-12)
    # SLOs between edges: TTFT 0.3 → [2047, 2713]/3242; TPOT 0.03 → [2917 (0.025), 3209 (0.05)]/3242
    # lower = (2047 + 2917 − 3242)/3242 = 1722/3242; upper = min(2713, 3209)/3242 = 2713/3242
    lo, hi = pass_bounds(slo_shares(ttft.buckets, ttft.count, 0.3), slo_shares(tpot.buckets, tpot.count, 0.03))
    assert lo == pytest.approx(1722 / 3242, rel=1e-12)
    assert hi == pytest.approx(2713 / 3242, rel=1e-12)


# --- seed 003 cost, worked example -----------------------------------------------------------


def test_seed003_worked_example_cost_bounds_contain_the_joint_cost():
    # Seed 003's bench: SLO_TTFT 1500 ms, SLO_TPOT 80 ms, card hour 60 (CNY). Four requests in
    # 1 s of wall time, (ttft ms, tpot ms, output tokens):
    #   (1200, 70, 100) pass · (1600, 60, 100) ttft fails · (900, 90, 100) tpot fails · (1000, 50, 100) pass
    # seed's report(): tps = 200 passing tokens/s → 60·1e6/(200·3600) = 83.33 per 1M.
    # From marginal histograms (edges TTFT 1.0/1.5/2.0 s, TPOT 0.05/0.08/0.1 s, SLOs on edges):
    #   p_ttft = 3/4 (900, 1000, 1200 ≤ 1500), p_tpot = 3/4 (50, 60, 70 ≤ 80)
    #   bounds: max(0, 3/4 + 3/4 − 1) = 0.5 ≤ p ≤ min(3/4, 3/4) = 0.75 (the true p is 2/4)
    ttft_b = ((1.0, 2.0), (1.5, 3.0), (2.0, 4.0), (math.inf, 4.0))
    tpot_b = ((0.05, 1.0), (0.08, 3.0), (0.1, 4.0), (math.inf, 4.0))
    ttft, tpot = slo_shares(ttft_b, 4, 1.5), slo_shares(tpot_b, 4, 0.08)
    assert (ttft.lower, ttft.upper, tpot.lower, tpot.upper) == (0.75, 0.75, 0.75, 0.75)
    c = slo_cost(ttft, tpot, output_tps=400.0, instance_hour_price=60.0, retry_rate=0.05)
    assert (c.pass_lower, c.pass_upper) == (0.5, 0.75)
    # cost at the lower pass bound = the seed's number: 60e6/(0.5·400·3600) = 60e6/720000 = 83.333
    assert c.cost_upper == pytest.approx(60e6 / 720_000, rel=1e-12)
    assert round(c.cost_upper, 2) == 83.33
    # cost at the upper pass bound: 60e6/(0.75·400·3600) = 60e6/1.08e6 = 55.556
    assert c.cost_lower == pytest.approx(60e6 / 1.08e6, rel=1e-12)
    # effective = unit/(1 − 0.05): 83.333/0.95 = 87.719, 55.556/0.95 = 58.480
    assert c.effective_upper == pytest.approx(60e6 / 720_000 / 0.95, rel=1e-12)
    assert c.effective_lower == pytest.approx(60e6 / 1.08e6 / 0.95, rel=1e-12)
    assert c.reasons is None


def test_cost_unknown_or_unbounded_says_why():
    s = SloShares(0.4, 0.4)
    # pass lower bound max(0, 0.4 + 0.4 − 1) = 0 → the upper cost is unbounded, the lower one
    # at p = 0.4: 10·1e6/(0.4·100·3600) = 1e7/144000 = 69.444
    c = slo_cost(s, s, output_tps=100.0, instance_hour_price=10.0)
    assert c.pass_lower == 0.0 and c.cost_upper is None and "0" in c.reasons["cost_upper"]
    assert c.cost_lower == pytest.approx(1e7 / 144_000, rel=1e-12)
    assert slo_cost(s, s, 100.0, None).reasons["cost_lower"] == "instance_hour_price not configured"
    assert "no output tokens" in slo_cost(s, s, 0.0, 10.0).reasons["cost_lower"]
    with pytest.raises(ValueError):
        slo_cost(s, s, 1.0, 1.0, retry_rate=1.0)


# --- KV sizing (seed 004 §3.3, seed 000 §7) ---------------------------------------------------


def test_seed004_llama2_7b_and_a100_concurrency():
    s = kv_bytes_per_token(32, 32, 128, 2)  # 2·32·32·128·2 = 524,288 bytes/token
    # one request of 1024 tokens: 1 · 1024 · 524,288 = 536,870,912 = 512 MiB
    assert peak_kv_bytes(1, 1024, s) == 512 * MiB
    # A100-80GB, 40 GB (GiB) left for KV: 40·2^30 / (512·2^20) = 80 requests
    assert concurrency_from_memory(40 * GiB, s, 1024) == 80
    # 39.9 GiB no longer holds 80: ⌊39.9/0.5⌋ = 79
    assert concurrency_from_memory(39.9 * GiB, s, 1024) == 79


def test_peak_kv_qwen72b_tp4_and_capacity_ceiling():
    # MODEL.md §3.6: 81,920 bytes/token/GPU; batch 32 × 8192 → 32·8192·81,920 = 20 GiB per GPU
    assert peak_kv_bytes(32, 8192, kv_bytes_per_token(80, 8, 128, 2, tp=4)) == 20 * GiB
    # the bundled trace: kv_cache_size_tokens 2,097,152, ISL 2048 + OSL 32 = 2080 tokens/request
    # → 2,097,152/2080 = 1008.25 → 1008 (1008·2080 = 2,096,640 ≤ 2,097,152 < 1009·2080)
    assert max_concurrency(2_097_152, 2080) == 1008
    assert max_concurrency(4096, 1024) == 4  # exact division stays exact
    with pytest.raises(ValueError):
        max_concurrency(1, 0)


# --- first-order capacity (MODEL.md §3.3, seed 000 §6.1) --------------------------------------


def test_first_order_capacity_by_hand():
    # N = 1000 tokens, T0 = 0.5 s → Θ0 = 2000 tokens/s
    # δ = N·S_kv/(B·T0) = 1000·524,288/(25e9·0.5) = 524,288,000/12.5e9 = 0.04194304
    cap = first_order_capacity(1000, 0.5, 524_288, 25e9)
    assert cap.theta0 == 2000.0
    assert cap.delta == pytest.approx(0.04194304, rel=1e-12)
    # h = 0.5, no loaded hits: 2000/max(0.5, 0) = 4000
    assert cap.theta(0.5, 0.0) == 4000.0
    # h = 0.99 all loaded: max(0.01, 0.04194304·0.99 = 0.0415236096) → 2000/0.0415236096 = 48165.39
    assert cap.theta(0.99, 0.99) == pytest.approx(2000 / 0.0415236096, rel=1e-12)
    # loaded share unknown → seed's δ·h: the same as all loaded
    assert cap.theta(0.99, None) == cap.theta(0.99, 0.99)
    # without S_kv/B_load: δ unknown; no loaded hits still gives 2000/(1 − 0.9) = 20000
    bare = first_order_capacity(1000, 0.5, None, None)
    assert bare.delta is None
    assert bare.theta(0.9, 0.0) == pytest.approx(20000.0, rel=1e-12)
    assert bare.theta(0.9, 0.3) is None and bare.theta(0.9, None) is None
    assert bare.theta(1.0, 0.0) is None  # unbounded at h = 1 without loads
    # h = 0: h_load ≤ h = 0 whatever its share, so Θ(0) = Θ0/max(1, δ·0) = 2000 without δ
    assert bare.theta(0.0, None) == 2000.0


# --- economic max-num-seqs (seed 003 §3) --------------------------------------------------------

EDGES = (0.01, 0.02, 0.03, 0.04, 0.05, 0.06, math.inf)


def _step(le_90: float, n: float = 100.0) -> tuple[tuple[float, float], ...]:
    """Bucket delta: 90 % of n requests ≤ le_90 (and ≥ the edge below), all n ≤ le_90 + 0.01."""
    return tuple((le, 0.0 if le < le_90 - 1e-12 else (0.9 * n if abs(le - le_90) < 1e-12 else n)) for le in EDGES)


def test_tpot_fitter_solves_for_80_percent_of_slo():
    f = TpotConcurrencyFitter(min_requests=20)
    # P95 per level from buckets: rank 95 of 100, 90 at le_90 and 100 one edge (0.01) higher
    # → le_90 + 0.01·(95 − 90)/10 = le_90 + 0.005
    #   running 2: 0.02 → 0.025 · running 4: 0.03 → 0.035 · running 8: 0.05 → 0.055
    # line through (2, .025), (4, .035), (8, .055): b1 = 0.005 s/request, b0 = 0.015 s
    t = 0.0
    for running, le in ((2, 0.02), (4, 0.03), (8, 0.05)):
        for _ in range(3):  # three steps per level; running 1.6 and 2.4 round to 2 as well
            t += 2.0
            assert f.update(t, running + (0.4 if _ == 1 else 0.0), _step(le), 100.0)
    r = f.result(tpot_slo=0.08)
    assert r.status is Status.OK
    assert [lv[:2] for lv in r.extra["levels"]] == [[2, pytest.approx(0.025)], [4, pytest.approx(0.035)],
                                                    [8, pytest.approx(0.055)]]
    assert r.value("p95_at_zero") == pytest.approx(0.015, abs=1e-12)
    assert r.value("p95_per_request") == pytest.approx(0.005, abs=1e-12)
    # target 0.8·0.08 = 0.064 s → running* = (0.064 − 0.015)/0.005 = 9.8, beyond level 8
    assert r.extra["target_seconds"] == pytest.approx(0.064)
    assert r.value("concurrency_at_target") == pytest.approx(9.8, rel=1e-9)
    assert r.extra["extrapolated"] is True
    assert r.samples == 9 and r.r2 == pytest.approx(1.0)


def test_tpot_fitter_noise_is_not_a_recommendation():
    f = TpotConcurrencyFitter(min_requests=20)
    # P95 0.035 (2), 0.025 (4), 0.045 (8), equal weights: x̄ = 14/3, Sxx = 18.667,
    # Sxy = (−0.667)(−0.01) + (3.333)(0.01) = 0.04 → b1 = 0.04/18.667 = 0.00214 s/request;
    # residuals 0.00571, −0.00857, 0.00286 → SSR 1.143e-4 (1 dof) → se(b1) = √(1.143e-4/18.667)
    # = 0.00247: b1 < 2·se → not identifiable, no max-num-seqs
    for t, (running, le) in enumerate(((2, 0.03), (4, 0.02), (8, 0.04))):
        f.update(float(t), running, _step(le), 100.0)
    r = f.result(0.08)
    assert r.status is Status.NOT_IDENTIFIABLE and "does not rise" in r.reason
    assert "one TPOT bucket" not in r.reason  # P95s in (0.02, 0.03], (0.03, 0.04] and (0.04, 0.05]


def test_tpot_fitter_says_when_every_p95_falls_in_one_bucket():
    # the numbers auditor's find: TPOT rose 13 → 23 ms over levels 7–13, every request inside vLLM's
    # (0.01, 0.025] bucket, so every level's P95 was interpolated to the same 0.02425 and the reason
    # said TPOT does not rise. Here all of each level's 100 requests are ≤ 0.02 (bucket (0.01, 0.02]):
    # P95 = 0.01 + 0.01·95/100 = 0.0195 at every level, a slope of 0
    f = TpotConcurrencyFitter(min_requests=20)
    for t, running in enumerate((2, 4, 8)):
        f.update(float(t), running, tuple((le, 0.0 if le < 0.02 else 100.0) for le in EDGES), 100.0)
    assert [lv[1] for lv in f.levels()] == [pytest.approx(0.0195)] * 3
    r = f.result(0.08)
    assert r.status is Status.NOT_IDENTIFIABLE
    assert r.reason.endswith("s per request): every level's P95 falls in one TPOT bucket, (0.01, 0.02] s, inside "
                             "which a rise is not seen: no concurrency-limited max-num-seqs"), r.reason
    # every request above the highest finite edge: the P95 reads 0.06 (Prometheus' answer there), its
    # bucket is (0.06, inf], not (0.05, 0.06] (diff review)
    f = TpotConcurrencyFitter(min_requests=20)
    for t, running in enumerate((2, 4, 8)):
        f.update(float(t), running, tuple((le, 100.0 if math.isinf(le) else 0.0) for le in EDGES), 100.0)
    assert [lv[1] for lv in f.levels()] == [0.06] * 3
    assert "one TPOT bucket, (0.06, inf] s," in f.result(0.08).reason


def test_tpot_fitter_statuses_and_bound():
    f = TpotConcurrencyFitter(min_requests=20, max_levels=3)
    assert f.result(0.08).status is Status.INSUFFICIENT_DATA  # nothing yet
    f.update(1.0, 4.0, _step(0.03), 100.0)
    assert f.result(None).status is Status.INSUFFICIENT_DATA  # no SLO configured
    assert f.result(0.08).status is Status.INSUFFICIENT_VARIATION  # one level only
    f.update(2.0, 8.0, _step(0.02), 100.0)
    assert f.result(0.08).status is Status.INSUFFICIENT_VARIATION  # two levels are not a curve
    f.update(2.5, 16.0, _step(0.01), 100.0)  # P95 0.035, 0.025, 0.015: falls as concurrency rises
    assert f.result(0.08).status is Status.NOT_IDENTIFIABLE
    for i, running in enumerate((1.0, 32.0)):
        f.update(3.0 + i, running, _step(0.02), 100.0)
    assert len(f) == 3  # at most max_levels; the least recently seen (4, then 8) dropped
    assert sorted(k for k, _, _ in f.levels()) == [1, 16, 32]
    assert not f.update(9.0, 0.2, _step(0.02), 100.0)  # idle engine: no level
    assert not f.update(9.0, 3.0, _step(0.02), 0.0)  # no finished request
