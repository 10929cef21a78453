"""What-ifs from a frozen fit (fitters/whatif.py) where an input is unknown: values by hand from
MODEL.md §3.2 and §7, never read back from the code."""
from __future__ import annotations

from dataclasses import replace

import pytest

from exporter.analyzer import _load_bound_note, _load_share
from exporter.window import Delta
from fitters.result import label_reason
from fitters.whatif import LOAD_SHARE_UNKNOWN, FittedModel

# T_step 2 ms, k_ffn 0.2 ms/token, k_attn 60 ns/token², k_dec 0.8 ms/token, 10 steps per request;
# α 0.5, S_kv 1e5 bytes, B_load 1e10 bytes/s
FIT = dict(t_step=0.002, k_ffn=2e-4, k_attn=6e-8, k_dec=8e-4, k_ctx=0.0, steps_per_request=10.0,
           alpha=0.5, kv_bytes_per_token=1e5, load_bandwidth=1e10)


def test_an_unknown_loaded_share_leaves_ttft_unknown_at_h_above_0_and_chip_time_known():
    # ISL 1000, OSL 20, h 0.5: M = 500, H = 500, W = 500·500 + 500²/2 = 375,000
    # t_chip = 0.002·10 + 2e-4·500 + 6e-8·375,000 + 20·8e-4 = 0.02 + 0.1 + 0.0225 + 0.016 = 0.1585 s
    p = FittedModel(**FIT, hit_load_share=None).predict(0.5, 1000.0, 20.0)
    assert p.t_chip == pytest.approx(0.1585, rel=1e-12)
    assert p.tpm_delivered == pytest.approx(1020 * 60 / 0.1585, rel=1e-12)
    assert p.ttft_service is None and p.ttft_load_aware is None  # T_load needs h_load
    assert p.unknown == {"ttft_service": LOAD_SHARE_UNKNOWN, "ttft_load_aware": LOAD_SHARE_UNKNOWN}
    # h = 0: nothing is loaded whatever the share: TTFT = T_step + k_ffn·1000 + k_attn·1000²/2
    #   = 0.002 + 0.2 + 0.03 = 0.232 s
    at_0 = FittedModel(**FIT, hit_load_share=None).predict(0.0, 1000.0, 20.0)
    assert at_0.ttft_service == pytest.approx(0.232)
    # no contention fit in FIT (c0, c1 None): the load-aware TTFT alone is unknown, and says why
    assert at_0.ttft_load_aware is None and set(at_0.unknown) == {"ttft_load_aware"}
    assert "c0 and c1" in at_0.unknown["ttft_load_aware"]
    # a known share 0.2 at h 0.5: h_load = 0.1, T_load = 0.1·1000·1e5/1e10 = 1 ms, T_compute =
    # 0.1 + 0.0225 = 0.1225 s, TTFT = 0.002 + 0.001 + 0.1225 - 0.5·0.001 = 0.125 s
    assert FittedModel(**FIT, hit_load_share=0.2).predict(0.5, 1000.0, 20.0).ttft_service == pytest.approx(0.125)


def _window(counters: dict[str, float]) -> Delta:
    return Delta(t0=0.0, t1=60.0, counters=counters, histograms={}, start={}, end={})


def test_the_loaded_share_of_a_window_without_hits_is_unknown_only_where_a_connector_was_asked():
    # MODEL.md §2: h_load/h = Δe/(Δk + Δe); with no hit at all it is 0/0 when a connector was
    # asked (external queries = the 1000 tokens the local cache missed)
    with_connector = _window({"queries": 1000.0, "hits": 0.0, "external_queries": 1000.0, "external_hits": 0.0})
    assert _load_share(with_connector, 0.0, 0.0) is None
    # vLLM 0.32 without a connector exports the external counters at 0: nothing asked, share 0
    idle = _window({"queries": 1000.0, "hits": 0.0, "external_queries": 0.0, "external_hits": 0.0})
    assert _load_share(idle, 0.0, 0.0) == 0.0
    # external hits without the queries counter cannot tell: unknown
    assert _load_share(_window({"queries": 1000.0, "hits": 0.0, "external_hits": 0.0}), 0.0, 0.0) is None
    # no external counters and a connector ruled out (h_load known to be 0): the share is 0
    assert _load_share(_window({"queries": 1000.0, "hits": 0.0}), 0.0, 0.0) == 0.0
    # hits: Δk = 300, Δe = 100 of Δq = 1000 → h 0.4, h_load 0.1, share 0.25
    assert _load_share(_window({"queries": 1000.0, "hits": 300.0, "external_hits": 100.0}), 0.4, 0.1) == 0.25
    assert _load_share(with_connector, None, None) is None


def test_a_prefill_is_refused_when_decode_time_rides_on_prefill_terms():
    # Decode tokens dropped, seen as G = 0.0625·M (OSL 128 per ISL 2048 at h 0): decode time rides
    # on k_ffn. A request at h 0, ISL 2048, OSL 128 keeps the relation (128 = 0.0625·2048): its
    # t_chip = 0.002·10 + 2e-4·2048 + 6e-8·2048²/2 = 0.02 + 0.4096 + 0.12583 = 0.55543 s stands.
    # Its prefill has G = 0 against 0.0625·2048 = 128: k_dec ≤ k_ffn/0.0625 = 3.2e-3 s, up to
    # 0.4096 s of the prefill's 0.002 + 0.4096 + 0.12583 s: the TTFTs are unknown, with the reason.
    fit = FittedModel(**{**FIT, "k_dec": 0.0}, collinear={"k_dec": {"k_ffn": 0.0625}})
    p = fit.predict(0.0, 2048.0, 128.0)
    assert p.t_chip == pytest.approx(0.02 + 0.4096 + 0.1258291, rel=1e-6)
    assert p.ttft_service is None and p.ttft_load_aware is None
    assert "a prefill has 0 decode tokens where that relation gives 128" in fit.unidentified_prefill(0.0, 2048.0)
    # as a Prometheus label the reason leaves out what this request measured: the same at h 0 and
    # 0.5, ISL 2048 and 4096, while the whole reasons differ (kvhit_unknown_info churned a series a scrape)
    reasons = [fit.unidentified_prefill(h, isl) for h, isl in ((0.0, 2048.0), (0.5, 4096.0))]
    assert reasons[0] != reasons[1] and label_reason(reasons[0]) == label_reason(reasons[1])
    assert label_reason(reasons[0]) == ("not identifiable: the chip-time fit could not tell decode tokens apart from "
                                        "miss tokens, and a prefill is off the relation its steps followed beyond the "
                                        "5% tolerance; ask about traffic closer to the fitted one, or fit on traffic "
                                        "that varies them apart")


def test_a_what_if_at_the_calibrated_traffic_stands_however_loose_the_partner_bound():
    # kvhit calibrate's sweep at one ISL 2048 and OSL 64: decode context C = G·(2048 + 64/2) =
    # 2080·G in every step; dropped, seen as C ≈ 2079.9·G + 0.005596·M (step noise lands on k_ffn),
    # with k_dec held at 0. The partner bound k_ffn/0.005596 = 2e-4/0.005596 = 0.03574 s is loose.
    # A request at h 0.9, ISL 2048, OSL 64, 10 steps: M = 204.8, H = 1843.2,
    # W = 204.8·1843.2 + 204.8²/2 = 398,458.88; C = 64·2080 = 133,120; carried = 2079.9·64 +
    # 0.005596·204.8 = 133,113.6 + 1.1461 = 133,114.746, gap 5.254.
    # predicted = 0.002·10 + 2e-4·204.8 + 6e-8·398,458.88 = 0.02 + 0.04096 + 0.0239075328 = 0.0848675328 s;
    # the carried bound: k_ctx ≤ 0.0848675/133,114.746 = 6.3756e-7 s, × 5.254 = 3.35e-6 s (0.004 %):
    # stands (the partner bound alone gave 0.03574·5.254 = 0.188 s, 221 %)
    fit = FittedModel(**{**FIT, "k_dec": 0.0}, collinear={"k_ctx": {"k_dec": 2079.9, "k_ffn": 0.005596}})
    assert fit.unidentified(0.9, 2048.0, 64.0) is None
    assert fit.predict(0.9, 2048.0, 64.0).t_chip == pytest.approx(0.0848675328, rel=1e-12)
    # OSL 1024 at ISL 2048: C = 1024·2560 = 2,621,440, carried = 2,129,817.6 + 1.1461 = 2,129,818.7,
    # gap 491,621: off by up to gap/carried = 23.08 % of the predicted time: refused
    why = fit.unidentified(0.9, 2048.0, 1024.0)
    assert why is not None and "(23.1%)" in why


def test_a_prefill_stands_when_the_carried_time_is_bounded_small():
    # Decode context dropped, seen as C = -4000·steps + 3000·G (as on the bundled trace): k_ctx rode
    # on k_dec only (the steps' coefficient is negative: t_step_true = t_step + 4000·k_ctx ≥ 0 for
    # any k_ctx), so k_ctx ≤ k_dec/3000 = 8e-4/3000 = 2.667e-7. A prefill at h 0.5, ISL 1000 (one
    # step, C = G = 0) is 4000 off the relation: up to 1.07e-3 s of its 0.002 + 0.1225 = 0.1245 s
    # (0.9 %): the TTFT stands, 0.125 s as in the first test (share 0.2).
    fit = FittedModel(**FIT, hit_load_share=0.2, collinear={"k_ctx": {"t_step": -4000.0, "k_dec": 3000.0}})
    assert fit.unidentified_prefill(0.5, 1000.0) is None
    assert fit.predict(0.5, 1000.0, 20.0).ttft_service == pytest.approx(0.125)


def test_a_prefill_the_covariance_leaves_uncertain_has_no_ttft():
    # A real vLLM under one h, ISL and OSL: its fit split the busy time anyhow (T_step 39 µs ±
    # 9 ms) and a 39-µs service TTFT was published for a 0.3-s prefill. The prefill at h 0.5,
    # ISL 1000 is z = (1 step, M 500, W 375,000, 0, 0): chip time 0.002 + 2e-4·500 + 6e-8·375,000
    # = 0.1245 s. σ(k_ffn) 4e-4 alone gives √(zᵀΣz) = 500·4e-4 = 0.2 s > 0.5·0.1245: no TTFT;
    # σ(k_ffn) 1e-5 gives 0.005 s: the TTFT stands. The chip time per request is known either way.
    def cov(sd_ffn: float) -> list[list[float]]:
        c = [[0.0] * 5 for _ in range(5)]
        c[1][1] = sd_ffn ** 2
        return c

    wide = FittedModel(**FIT, hit_load_share=0.0, chip_covariance=cov(4e-4)).predict(0.5, 1000.0, 20.0)
    assert wide.ttft_service is None and wide.ttft_load_aware is None
    assert "0.1245 ± 0.2 s" in wide.unknown["ttft_service"]
    # the reason says what is measured, not a cause it cannot know (a real vLLM's steps spanned h 0-0.97
    # and ISL 1024-2795, and were told their traffic had one h, ISL and OSL)
    spread = FittedModel(**FIT, hit_load_share=0.0, chip_covariance=cov(4e-4), h_range=[0.0, 0.97],
                         isl_range=[1024.0, 2795.0], osl_range=[16.0, 16.0])
    assert spread.unidentified_prefill(0.5, 1000.0).endswith(
        "(measured: at h=0.5, ISL=1000 0.1245 ± 0.2 s of chip time; its steps' h [0, 0.97]; its steps' ISL "
        "[1024, 2795]; its steps' OSL [16, 16])")
    assert wide.t_chip == pytest.approx(0.1585)
    narrow = FittedModel(**FIT, hit_load_share=0.0, chip_covariance=cov(1e-5)).predict(0.5, 1000.0, 20.0)
    assert narrow.ttft_service == pytest.approx(0.1245) and "ttft_service" not in narrow.unknown
    with pytest.raises(ValueError, match="chip_covariance"):
        FittedModel.from_dict({**FittedModel(**FIT).to_dict(), "chip_covariance": [[1.0]]})


def test_a_fit_of_two_engines_as_one_machine_predicts_one_engines_ttft_and_the_machines_tpm():
    # Two engines fitted as one machine: every coefficient half of one engine's (FIT's), T_fixed
    # likewise. A request runs on one engine, so its service TTFT at h 0, ISL 1000 is FIT's:
    # T_step + k_ffn·1000 + k_attn·1000²/2 = 0.002 + 0.2 + 0.03 = 0.232 s; the machine's chip time
    # per request is half of FIT's 0.002·10 + 0.2 + 0.03 + 20·8e-4 = 0.266 s, so its TPM is twice
    # one engine's: 60·(1000 + 20)/0.133 = 460,150 tokens/min.
    half = {k: v / 2 if k in ("t_step", "k_ffn", "k_attn", "k_dec", "k_ctx") else v for k, v in FIT.items()}
    p = FittedModel(**half, hit_load_share=0.0, engines=2).predict(0.0, 1000.0, 20.0)
    assert p.ttft_service == pytest.approx(0.232, rel=1e-12)
    assert p.t_chip == pytest.approx(0.133, rel=1e-12)
    assert p.tpm_delivered == pytest.approx(60 * 1020 / 0.133, rel=1e-12)


def test_a_what_if_beyond_the_lengths_the_chip_time_fit_saw_says_it_extrapolates():
    # live-vLLM review: a fit on ISL 512–2048, OSL 32 predicted ISL 8192, OSL 512 with nothing said.
    # The numbers stand (same chip time as without the ranges); the prediction names what it reads
    # beyond. Inside (the bounds included) nothing is said.
    fit = FittedModel(**FIT, isl_range=[512.0, 2048.0], osl_range=[32.0, 32.0], h_range=[0.0, 0.9])
    far = fit.predict(0.5, 8192.0, 512.0)
    assert far.t_chip == FittedModel(**FIT).predict(0.5, 8192.0, 512.0).t_chip
    assert far.extrapolated.startswith("ISL 8192 outside the [512, 2048] tokens and OSL 512 outside the [32, 32] "
                                       "tokens of the chip-time fit's steps")
    assert fit.predict(0.5, 512.0, 32.0).extrapolated is None and fit.predict(0.5, 2048.0, 32.0).extrapolated is None
    assert fit.predict(0.5, 1000.0, 33.0).extrapolated.startswith("OSL 33 outside the [32, 32] tokens")
    # a fit saved without ranges (before kvhit kept them) said nothing, as if inside them (a newcomer's
    # find with a real fit of an older kvhit): unknown, and said so; a range it has still counts
    old = FittedModel(**FIT).predict(0.5, 8192.0, 512.0)
    assert old.t_chip == far.t_chip
    assert old.extrapolated.startswith("unknown for h and ISL and OSL whether this what-if lies inside the chip-time "
                                       "fit's steps: the fit records no range of them (no step told them, or a fit "
                                       "saved by an older kvhit")
    partial = FittedModel(**FIT, isl_range=[512.0, 2048.0], osl_range=[32.0, 32.0]).predict(0.5, 8192.0, 32.0)
    assert partial.extrapolated.startswith("ISL 8192 outside the [512, 2048] tokens of the chip-time fit's steps: ")
    assert "; unknown for h whether this what-if lies inside the chip-time fit's steps" in partial.extrapolated
    # a saved fit's ranges are checked as its other fields
    for bad in ([2048.0, 512.0], [1.0], ["1", 2.0], [float("nan"), 1.0], [True, 2.0]):
        with pytest.raises(ValueError, match="isl_range must be null or"):
            FittedModel.from_dict({**fit.to_dict(), "isl_range": bad})
    assert FittedModel.from_dict(fit.to_dict()) == fit


def test_a_what_if_beyond_the_hit_ratios_the_chip_time_fit_saw_says_it_extrapolates():
    # newcomer: the bundled trace's first 61 scrapes (h <= 0.3) gave half the chip time at h 0.96
    # that its first sweep, to h 0.97, did, with a tiny standard error and nothing said. Bounds in.
    fit = FittedModel(**FIT, h_range=[0.0, 0.3], isl_range=[1000.0, 1000.0], osl_range=[32.0, 32.0])
    assert fit.predict(0.96, 1000.0, 32.0).extrapolated.startswith("h 0.96 outside the [0, 0.3] of the chip-time "
                                                                   "fit's steps")
    assert "standard errors do not count that" in fit.predict(0.96, 1000.0, 32.0).extrapolated
    assert fit.predict(0.3, 1000.0, 32.0).extrapolated is None and fit.predict(0.0, 1000.0, 32.0).extrapolated is None
    for bad in ([0.5, 0.2], [0.0, 1.5], [-0.1, 0.5]):
        with pytest.raises(ValueError, match=r"h_range must be null or \[min, max\], finite numbers 0 <= min <= max <= 1"):
            FittedModel.from_dict({**fit.to_dict(), "h_range": bad})
    assert FittedModel.from_dict(fit.to_dict()) == fit


def test_a_covariance_whose_quadratic_form_overflows_bounds_nothing():
    # finite entries of 1e308 (a hand-edited fit.json): zᵀΣz overflows, inf − inf is nan, and the
    # reason read "0.1245 ± nan s" (review); the prefill's chip time is then unbounded, not nan
    big = [[1e308 * (1 if i == j else -1) for j in range(5)] for i in range(5)]
    pred = FittedModel(**FIT, hit_load_share=0.0, chip_covariance=big).predict(0.5, 1000.0, 20.0)
    assert pred.ttft_service is None and "0.1245 ± inf s" in pred.unknown["ttft_service"]


def test_a_window_whose_finished_requests_were_in_no_counted_step_has_no_steps_per_request():
    # Δcount(iteration_tokens) 0 with requests finished: the share is unknown (None, which a saved
    # fit takes), not 0, which T_fixed = T_step × 0 would read as no fixed time and from_dict refuses
    from types import SimpleNamespace as NS

    from exporter.analyzer import _steps_per_request
    assert _steps_per_request(NS(histograms={"iteration_tokens": NS(count=0.0), "prefill_time": NS(count=4.0)})) is None
    assert _steps_per_request(NS(histograms={"iteration_tokens": NS(count=30.0), "prefill_time": NS(count=4.0)})) == 7.5


def test_the_service_ttft_carries_its_standard_error_from_the_chip_time_covariance():
    # Delta method on TTFT = T_step + T_load + T_compute − α·min(T_load, T_compute) (MODEL.md §3.2),
    # by hand. Σ: σ(T_step) 1 ms, σ(k_ffn) 2e-5 s/token, cov(T_step, k_ffn) −1.5e-8 (they trade off).
    # h 0.5, ISL 1000, nothing loaded: g = (1, M 500, W 375,000, 0, 0), α moves nothing:
    # var = 1e-6 + 500²·4e-10 + 2·500·(−1.5e-8) = 1e-6 + 1e-4 − 1.5e-5 = 8.6e-5, stderr 9.2736e-3 s.
    cov = [[0.0] * 5 for _ in range(5)]
    cov[0][0], cov[1][1], cov[0][1], cov[1][0] = 1e-6, 4e-10, -1.5e-8, -1.5e-8
    p = FittedModel(**FIT, hit_load_share=0.0, chip_covariance=cov).predict(0.5, 1000.0, 20.0)
    assert p.ttft_service == pytest.approx(0.1245) and p.ttft_service_stderr == pytest.approx(8.6e-5 ** 0.5)
    # all of it loaded (share 1, h_load 0.5) on a slow link, B_load 1e8: T_load = 500·1e5/1e8 = 0.5 s
    # ≥ T_compute 0.1225 s, so α hides half of T_compute: g = (1, 0.5·500, 0.5·375,000, 0, 0),
    # var = 1e-6 + 250²·4e-10 + 2·250·(−1.5e-8) = 1e-6 + 2.5e-5 − 7.5e-6 = 1.85e-5
    slow = FittedModel(**{**FIT, "load_bandwidth": 1e8}, hit_load_share=1.0, chip_covariance=cov)
    assert slow.predict(0.5, 1000.0, 20.0).ttft_service_stderr == pytest.approx(1.85e-5 ** 0.5)
    # α 0.3 (where α and 1 - α differ): 1 - α = 0.7 of T_compute shows, TTFT = 0.002 + 0.5 + 0.7·0.1225
    # = 0.58775 s; g = (1, 0.7·500, 0.7·375,000, 0, 0), var = 1e-6 + 350²·4e-10 + 2·350·(−1.5e-8)
    # = 1e-6 + 4.9e-5 − 1.05e-5 = 3.95e-5
    p = FittedModel(**{**FIT, "load_bandwidth": 1e8, "alpha": 0.3}, hit_load_share=1.0,
                    chip_covariance=cov).predict(0.5, 1000.0, 20.0)
    assert p.ttft_service == pytest.approx(0.58775, rel=1e-12) and p.ttft_service_stderr == pytest.approx(3.95e-5 ** 0.5)
    # two data-parallel engines: a request's TTFT takes one engine's coefficients, the fit's × 2,
    # and its standard error with them: 2 × 9.2736e-3 s
    two = FittedModel(**FIT, hit_load_share=0.0, chip_covariance=cov, engines=2.0).predict(0.5, 1000.0, 20.0)
    assert two.ttft_service_stderr == pytest.approx(2 * 8.6e-5 ** 0.5)
    # no covariance (a fit saved before it was kept): no standard error, the TTFT stands
    assert FittedModel(**FIT, hit_load_share=0.0).predict(0.5, 1000.0, 20.0).ttft_service_stderr is None
    # α's own error, fitted apart, adds in quadrature: ∂TTFT/∂α = −min(T_load, T_compute). On the slow
    # link min = T_compute 0.1225 s; σ(α) 0.2: var = 1.85e-5 + (0.1225·0.2)² = 1.85e-5 + 6.0025e-4
    # (a soak: the target TTFT 8-16 % off, 30 of the chip-only σ, α 0.15 ± 0.22)
    with_alpha = FittedModel(**{**FIT, "load_bandwidth": 1e8}, hit_load_share=1.0, chip_covariance=cov, alpha_stderr=0.2)
    assert with_alpha.predict(0.5, 1000.0, 20.0).ttft_service_stderr == pytest.approx((1.85e-5 + 6.0025e-4) ** 0.5)
    # nothing loaded: α moves nothing, nor does its error
    alone = FittedModel(**FIT, hit_load_share=0.0, chip_covariance=cov, alpha_stderr=0.2).predict(0.5, 1000.0, 20.0)
    assert alone.ttft_service_stderr == pytest.approx(8.6e-5 ** 0.5)


def test_the_service_ttft_error_counts_alphas_moving_with_the_chip_time_coefficients():
    # α is fitted under the coefficients (two-step delta method): with G = ∂α/∂(t_step, k_ffn, k_attn)
    # = (0, 1000, 0), cov(g·β, α) = gᵀΣ[:, :3]·G. The slow link above (T_load 0.5 s ≥ T_compute
    # 0.1225 s, α 0.5, σ(α) 0.2): g = (1, 250, 187,500, 0, 0), Σ·G = (−1.5e-8·1000, 4e-10·1000, 0, …)
    # = (−1.5e-5, 4e-7, 0, …), gᵀΣG = −1.5e-5 + 250·4e-7 = 8.5e-5; ∂TTFT/∂α = −0.1225:
    # var = 1.85e-5 + 6.0025e-4 + 2·(−0.1225)·8.5e-5 = 1.85e-5 + 6.0025e-4 − 2.0825e-5 = 5.97925e-4
    cov = [[0.0] * 5 for _ in range(5)]
    cov[0][0], cov[1][1], cov[0][1], cov[1][0] = 1e-6, 4e-10, -1.5e-8, -1.5e-8
    slow = {**FIT, "load_bandwidth": 1e8}
    fit = FittedModel(**slow, hit_load_share=1.0, chip_covariance=cov, alpha_stderr=0.2,
                      alpha_chip_gradient=[0.0, 1000.0, 0.0])
    assert fit.predict(0.5, 1000.0, 20.0).ttft_service_stderr == pytest.approx(5.97925e-4 ** 0.5)
    # two engines: one engine's coefficients are the fit's × 2, T_compute 0.245 s (still < T_load), g
    # the same; the chip part and the cross term × 2² (G is per one engine's coefficients):
    # var = 4·1.85e-5 + (0.245·0.2)² + 2·(−0.245)·4·8.5e-5 = 7.4e-5 + 2.401e-3 − 1.666e-4 = 2.3084e-3
    two = replace(fit, engines=2.0)
    assert two.predict(0.5, 1000.0, 20.0).ttft_service_stderr == pytest.approx(2.3084e-3 ** 0.5)
    # nothing loaded: no α term, no cross term
    alone = replace(fit, hit_load_share=0.0).predict(0.5, 1000.0, 20.0)
    assert alone.ttft_service_stderr == pytest.approx(8.6e-5 ** 0.5)
    # a saved fit whose G disagrees with α's error (G·Σ·Gᵀ = 1e10·4e-10 = 4 ≫ 0.01²): the cross term
    # 2·(−0.1225)·(−1.5e-3 + 250·4e-5) = −2.0825e-3 would take the variance below 0; its errors are
    # then added as independent, 1.85e-5 + (0.1225·0.01)² = 2.0000625e-5, never a stderr of 0
    odd = replace(fit, alpha_stderr=0.01, alpha_chip_gradient=[0.0, 1e5, 0.0])
    assert odd.predict(0.5, 1000.0, 20.0).ttft_service_stderr == pytest.approx(2.0000625e-5 ** 0.5)
    # a saved fit keeps it, and a malformed one is refused by name
    assert FittedModel.from_dict(fit.to_dict()).alpha_chip_gradient == [0.0, 1000.0, 0.0]
    with pytest.raises(ValueError, match="alpha_chip_gradient"):
        FittedModel.from_dict({**fit.to_dict(), "alpha_chip_gradient": [0.0, float("nan"), 0.0]})
    # a fit saved before it was (no such field) loads, its errors taken as independent
    old = {k: v for k, v in fit.to_dict().items() if k != "alpha_chip_gradient"}
    assert FittedModel.from_dict(old).predict(0.5, 1000.0, 20.0).ttft_service_stderr == pytest.approx(
        (1.85e-5 + 6.0025e-4) ** 0.5)


def test_a_request_whose_chip_time_is_unknown_keeps_its_ttft_when_its_prefill_is_identified():
    # MODEL.md §6: decode context dropped, seen as C = 2080·G (ISL 2048, OSL 64: C = G·(2048 + 64/2)).
    # At ISL 8192, OSL 64 a request has C = 64·(8192 + 32) = 526,336 where the relation gives 133,120:
    # k_ctx ≤ k_dec/2080 = 3.85e-7 s, × 393,216 = 0.151 s of its t_chip 0.02 + 2e-4·4096 +
    # 6e-8·25,165,824 + 8e-4·64 = 2.400 s (6.3 % > 5 %): no chip time, TPM or revenue. Its prefill
    # (one step, C = G = 0) keeps the relation: at h 0.5, share 0.2, h_load 0.1, T_load = 0.1·8192·1e5/1e10
    # = 8.192 ms, T_compute = 0.8192 + 1.50994944 = 2.32914944 s, TTFT = 0.002 + 0.008192 + 2.32914944
    # - 0.5·0.008192 = 2.33524544 s (the helper's case: the whole what-if was refused)
    fit = FittedModel(**FIT, hit_load_share=0.2, collinear={"k_ctx": {"k_dec": 2080.0}})
    p = fit.predict(0.5, 8192.0, 64.0)
    assert p.ttft_service == pytest.approx(2.33524544, rel=1e-12)
    assert (p.t_chip, p.tpm_delivered, p.tpm_physical, p.tpm_delivered_per_gpu, p.tpm_physical_per_gpu,
            p.revenue) == (None,) * 6
    assert "decode context" in p.unknown["t_chip"] and p.unknown["t_chip"] == fit.unidentified(0.5, 8192.0, 64.0)
    assert {"tpm_delivered", "tpm_physical", "tpm_delivered_per_gpu", "tpm_physical_per_gpu", "revenue"} <= set(p.unknown)
    # at ISL 2048 the request keeps the relation: everything stands
    assert fit.predict(0.5, 2048.0, 64.0).t_chip is not None
    # the TTFT unknown too (the loaded share unknown at h > 0): nothing to predict, the chip time's reason raised
    with pytest.raises(ValueError, match="decode context") as refused:
        FittedModel(**FIT, hit_load_share=None, collinear={"k_ctx": {"k_dec": 2080.0}}).predict(0.5, 8192.0, 64.0)
    assert str(refused.value).endswith(f"its TTFT is unknown too: {LOAD_SHARE_UNKNOWN}")  # both reasons


def test_a_what_if_past_what_the_kv_load_link_can_feed_says_so():
    # kvhit predict and /api/v1/predict raised no kv_load_bound where the live analysis did (MODEL.md
    # §3.4; a physics review). FIT at ISL 1000, OSL 20, h 0.5: t_chip 0.1585 s (above), so the
    # request's prompt tokens/s at full load are 1000 / 0.1585 = 6309.1. Loaded share 0.2: h_load
    # 0.1, and a link of B_load 5e7 bytes/s feeds 5e7 / (1e5 · 0.1) = 5000 prompt tokens/s: past it.
    slow = FittedModel(**{**FIT, "load_bandwidth": 5e7}, hit_load_share=0.2)
    assert slow.link_feed(0.5) == pytest.approx(5000.0)
    p = slow.predict(0.5, 1000.0, 20.0)
    assert p.tpm_delivered == pytest.approx(1020 * 60 / 0.1585)  # flagged, not capped
    assert "6309 vs 5000 prompt tokens/s" in p.kv_load_bound
    # two engines' links feed twice that, 10,000: within it (the TPM is the machine's, both engines)
    two = FittedModel(**{**FIT, "load_bandwidth": 5e7}, hit_load_share=0.2, engines=2.0)
    assert two.link_feed(0.5) == pytest.approx(10000.0) and two.predict(0.5, 1000.0, 20.0).kv_load_bound is None
    # the fast link of FIT feeds 1e10 / (1e5 · 0.1) = 1e6: nothing to say; no hit loaded: no bound at all
    assert FittedModel(**FIT, hit_load_share=0.2).predict(0.5, 1000.0, 20.0).kv_load_bound is None
    assert slow.link_feed(0.0) is None and FittedModel(**FIT, hit_load_share=0.0).link_feed(0.5) is None


def test_a_break_even_past_what_the_kv_load_link_can_feed_is_flagged():
    # The chip-time bathtub's h_even is read from chip time alone: where its prompt tokens/s pass
    # the link, R climbs back to R(0) on throughput the link cannot feed, and the valley may have no
    # exit. The live warning checked the current and target points only (a physics review: h_even
    # 0.969 at 44.1k prompt tokens/s over a 24.6k link, unflagged). As above, at h 0.5: 6309.1 vs 5000.
    slow = FittedModel(**{**FIT, "load_bandwidth": 5e7}, hit_load_share=0.2)
    note = _load_bound_note({}, slow, None, None, 1000.0, 20.0, h_even=0.5)["kv_load_bound"]
    assert "the chip-time bathtub's break-even h_even 0.5: 6309 vs 5000 prompt tokens/s" in note
    assert _load_bound_note({}, slow, None, None, 1000.0, 20.0) == {}  # no h_even: nothing to check
    assert _load_bound_note({}, FittedModel(**FIT, hit_load_share=0.2), None, None, 1000.0, 20.0, h_even=0.5) == {}


def test_a_fit_of_another_schema_says_which_kvhit_to_use():
    # a fit from a newer kvhit was told to be saved again "by an older kvhit" (a newcomer's find)
    doc = FittedModel(**FIT).to_dict()
    with pytest.raises(ValueError, match=r"^fit schema_version must be 2 \(a fit saved by a newer kvhit: read it with "
                                         r"that kvhit\)$"):
        FittedModel.from_dict({**doc, "schema_version": 3})
    with pytest.raises(ValueError, match=r"\(a fit saved by a newer kvhit"):
        FittedModel.from_dict({**doc, "schema_version": 3.0})
    for old in (1, None, True, "2"):
        with pytest.raises(ValueError, match=r"\(a fit saved by an older kvhit: save it again with kvhit replay"):
            FittedModel.from_dict({**doc, "schema_version": old})
