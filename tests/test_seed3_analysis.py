"""Seed 003 and sizing through the pipeline: two scrapes → Analyzer → collector exposition and JSON
(MODEL.md §3.3, §3.6, §5), plus the configuration keys they need.

The two expositions are written here so that every window delta is a round number; every
expected value is derived by hand in a comment.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter.analyzer import Analyzer
from exporter.collector import Health, KvhitCollector
from exporter.config import ConfigError, load_config
from exporter.jsonapi import analysis_to_dict
from exporter.parse import parse_exposition
from fitters.result import measured

L = 'engine="0",model_name="m"'


def _hist(name: str, buckets: list[tuple[str, int]], count: int, total: float) -> str:
    lines = [f'vllm:{name}_bucket{{{L},le="{le}"}} {c}' for le, c in buckets]
    return "\n".join(lines + [f"vllm:{name}_count{{{L}}} {count}", f"vllm:{name}_sum{{{L}}} {total}"])


def scrape(k: int, tpot: str = "request_time_per_output_token_seconds") -> str:
    """k = 0: nothing happened yet; k = 1: the window's requests (10 finished) are in."""
    return "\n".join([
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.",
        f"vllm:prefix_cache_queries_total{{{L}}} {10000 * k}",
        f"vllm:prefix_cache_hits_total{{{L}}} {8000 * k}",
        f"vllm:external_prefix_cache_hits_total{{{L}}} 0",
        f"vllm:prompt_tokens_total{{{L}}} {10000 * k}",
        f"vllm:generation_tokens_total{{{L}}} {1000 * k}",
        f"vllm:num_requests_running{{{L}}} 4",
        f"vllm:kv_cache_usage_perc{{{L}}} 0.5",
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000",kv_offloading_size="None"} 1',
        _hist("time_to_first_token_seconds", [("0.5", 6 * k), ("1.0", 9 * k), ("2.0", 10 * k), ("+Inf", 10 * k)],
              10 * k, 6.0 * k),
        _hist(tpot, [("0.02", 5 * k), ("0.05", 8 * k), ("0.1", 10 * k), ("+Inf", 10 * k)], 10 * k, 0.4 * k),
        _hist("request_prefill_time_seconds", [("+Inf", 10 * k)], 10 * k, 3.0 * k),
        _hist("request_decode_time_seconds", [("+Inf", 10 * k)], 10 * k, 7.0 * k),
        _hist("request_prompt_tokens", [("+Inf", 10 * k)], 10 * k, 10000 * k),
        _hist("request_generation_tokens", [("+Inf", 10 * k)], 10 * k, 1000 * k),
    ]) + "\n"


CONFIG = {"slo": {"ttft_seconds": 1.5, "tpot_seconds": 0.05}, "instance_hour_price": 36.0, "retry_rate": 0.1,
          "sizing": {"batch": 8, "max_len": 2048}, "model": {"layers": 32, "kv_heads": 8, "head_dim": 128}}


def _analysis(config=CONFIG, tpot: str = "request_time_per_output_token_seconds"):
    a = Analyzer(load_config(None, environ={}, flags=config))
    # two equal steps: the window's deltas are twice one step's (every ratio and rate the same), and
    # the fits and the 24 h rollup have the first (a step is fitted at the next scrape)
    for k in range(3):
        a.ingest(parse_exposition(scrape(k, tpot), 1000.0 + 10 * k))
    return a.analysis()


def _series(analysis) -> dict:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvhitCollector(lambda: (analysis, Health("t", up=True, last_success=1010.0))))
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "target")}
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def test_a_ttft_sum_the_buckets_cannot_hold_gives_no_p95_and_no_slo_pass_ratio():
    # 10 first tokens in the window: 6 ≤ 0.5 s, 3 ≤ 1 s, 1 ≤ 2 s, so Δsum ≤ 6·0.5 + 3·1 + 1·2 = 8 s;
    # a _sum of 60 s per 10 cannot be: the buckets gave P95 1.5 s and p_ttft ∈ [0.9, 1] anyway
    a = Analyzer(load_config(None, environ={}, flags=CONFIG))
    for k in range(3):
        text = scrape(k)
        line = next(ln for ln in text.splitlines() if ln.startswith("vllm:time_to_first_token_seconds_sum"))
        a.ingest(parse_exposition(text.replace(line, f"{line.rpartition(' ')[0]} {60.0 * k}"), 1000.0 + 10 * k))
    m = a.analysis().models["m"]
    assert "ttft" not in m.p95 and m.p95["tpot_request"] == pytest.approx(0.0875, rel=1e-12)
    assert "_sum disagrees with the buckets" in m.unknown["observed_p95_ttft"]
    assert m.slo_cost is None
    assert m.unknown["slo_pass_ratio"].startswith("the TTFT histogram's _sum disagrees with the buckets")


def test_a_tpot_sum_the_buckets_cannot_hold_feeds_no_max_num_seqs_level():
    # 10 TPOTs: 5 ≤ 0.02 s, 3 ≤ 0.05 s, 2 ≤ 0.1 s, so Δsum ≤ 0.45 s; a _sum of 40 s per 10 refutes the
    # buckets, whose P95 is withheld: the TPOT-vs-concurrency fit read them all the same
    def analysis(tpot_sum: float):
        a = Analyzer(load_config(None, environ={}, flags=CONFIG))
        for k in range(3):
            text = scrape(k)
            line = next(ln for ln in text.splitlines()
                        if ln.startswith("vllm:request_time_per_output_token_seconds_sum"))
            a.ingest(parse_exposition(text.replace(line, f"{line.rpartition(' ')[0]} {tpot_sum * k}"), 1000.0 + 10 * k))
        return a.analysis().models["m"]
    assert analysis(0.4).fits["max_num_seqs"].extra.get("tpot_source") == "request"  # the step was read
    m = analysis(40.0)
    assert "tpot_source" not in m.fits["max_num_seqs"].extra and "tpot_request" not in m.p95


def test_window_cost_pass_bounds_caching_and_sizing_by_hand():
    m = _analysis().models["m"]
    c = m.slo_cost
    # TTFT SLO 1.5 s lies between the edges 1.0 (9 of 10) and 2.0 (10 of 10) → p_ttft ∈ [0.9, 1.0]
    # TPOT SLO 0.05 s is an edge: 8 of 10 → p_tpot = 0.8
    assert (c.ttft.lower, c.ttft.upper, c.tpot.lower, c.tpot.upper) == (0.9, 1.0, 0.8, 0.8)
    # pass ∈ [max(0, 0.9 + 0.8 − 1), min(1.0, 0.8)] = [0.7, 0.8]
    assert (c.pass_lower, c.pass_upper) == pytest.approx((0.7, 0.8), abs=1e-12)
    # output: 1000 tokens in 10 s = 100 tokens/s
    assert c.output_tps == 100.0
    # lower cost at p = 0.8: 36·1e6/(0.8·100·3600) = 36e6/288000 = 125.0
    # upper cost at p = 0.7: 36e6/252000 = 142.857; effective /(1 − 0.1): 138.889, 158.730
    assert c.cost_lower == pytest.approx(125.0, rel=1e-12)
    assert c.cost_upper == pytest.approx(36e6 / 252_000, rel=1e-12)
    assert c.effective_lower == pytest.approx(125.0 / 0.9, rel=1e-12)
    assert c.effective_upper == pytest.approx(36e6 / 252_000 / 0.9, rel=1e-12)
    assert m.tpot_source == "request"
    # P95: TTFT rank 9.5 between 9 (1.0) and 10 (2.0) → 1.0 + 1.0·0.5/1 = 1.5 s;
    # TPOT rank 9.5 between 8 (0.05) and 10 (0.1) → 0.05 + 0.05·1.5/2 = 0.0875 s
    assert m.p95 == pytest.approx({"ttft": 1.5, "tpot_request": 0.0875}, rel=1e-12)
    # prefill share: mean prefill 3.0/10 = 0.3 s, decode 7.0/10 = 0.7 s → 0.3/(0.3 + 0.7) = 0.3
    assert m.prefill_share == pytest.approx({"window": 0.3, "history": 0.3}, rel=1e-12)
    # h = 8000/10000 = 0.8 → speedup 1/(1 − 0.8·0.3) = 1/0.76 = 1.315789
    assert m.caching_speedup == pytest.approx({"window": 1 / 0.76, "history": 1 / 0.76}, rel=1e-12)
    # verdict: h 0.8 > 0.60 but share 0.3 ≤ 0.40 (no pool), 0.8 ≤ 0.85 → linear; 10 s of history
    v = m.caching
    assert (v.state, v.provisional, v.history_seconds, v.history_hit_ratio) == ("linear", True, 10.0, 0.8)
    # KV: num_gpu_blocks 1000 × block_size 16 = 16,000 tokens; ISL 10000/10 = 1000, OSL 100
    # → ⌊16000/1100⌋ = 14 (14·1100 = 15,400 ≤ 16,000 < 16,500)
    assert (m.kv_capacity_tokens, m.max_concurrency) == (16000.0, 14)
    # S_kv = 2·32·8·128·2 = 131,072 bytes; peak = 8 · 2048 · 131,072 = 2,147,483,648 = 2 GiB
    assert m.kv_peak_bytes == 8 * 2048 * 131_072 == 2 * 2**30
    # one step at 4 running with 10 requests: below the 20 requests a concurrency level needs
    assert m.fits["max_num_seqs"].status.value == "insufficient_data"
    assert m.recommended_max_num_seqs is None
    # no chip-time fit from one step: the first-order bound says why it is absent
    assert m.capacity_bound == {} and "chip-time fit" in m.unknown["capacity_bound"]


def test_exposition_and_json_carry_the_hand_values():
    analysis = _analysis()
    s = _series(analysis)
    src = ("tpot_source", "request")
    assert s[("kvhit_slo_pass_ratio", (("bound", "lower"), src))] == pytest.approx(0.7)
    assert s[("kvhit_slo_pass_ratio", (("bound", "upper"), src))] == pytest.approx(0.8)
    assert s[("kvhit_cost_per_million_slo_output_tokens", (("bound", "lower"), src))] == pytest.approx(125.0)
    assert s[("kvhit_cost_per_million_slo_output_tokens", (("bound", "upper"), src))] == pytest.approx(36e6 / 252e3)
    assert s[("kvhit_effective_cost_per_million_slo_output_tokens", (("bound", "lower"), src))] == \
        pytest.approx(125.0 / 0.9)
    assert s[("kvhit_observed_p95_seconds", (("quantity", "ttft"),))] == pytest.approx(1.5)
    assert s[("kvhit_prefill_share_ratio", (("span", "window"),))] == pytest.approx(0.3)
    assert s[("kvhit_prefix_cache_speedup", (("span", "window"),))] == pytest.approx(1 / 0.76)
    # the verdict: 1 for the current state, 0 for the four others, provisional before 24 h
    verdict = {dict(k)["state"]: v for (name, k), v in s.items() if name == "kvhit_prefix_cache_verdict"}
    assert verdict == {"linear": 1.0, "not_paying": 0.0, "dedicated_pool_worth_it": 0.0,
                       "diminishing_returns": 0.0, "thrash_risk": 0.0}
    assert all(dict(k)["provisional"] == "true" for (name, k) in s if name == "kvhit_prefix_cache_verdict")
    assert s[("kvhit_kv_capacity_tokens", ())] == 16000.0
    assert s[("kvhit_max_concurrency", ())] == 14.0
    assert s[("kvhit_kv_peak_bytes", ())] == 2.0 * 2**30
    assert s[("kvhit_kv_bytes_per_token", ())] == 131072.0
    # unknown is absent, never 0: no recommended max-num-seqs, no capacity bound series
    assert not any(name in ("kvhit_recommended_max_num_seqs", "kvhit_capacity_bound_tokens_per_second")
                   for name, _ in s)
    assert s[("kvhit_fit_status", (("fit", "max_num_seqs"), ("status", "insufficient_data")))] == 1.0
    doc = analysis_to_dict(analysis, Health("t", up=True))["models"]["m"]
    assert doc["slo"]["pass_lower"] == pytest.approx(0.7) and doc["slo"]["ttft_share"] == [0.9, 1.0]
    assert doc["prefix_cache_verdict"]["state"] == "linear" and doc["max_concurrency"] == 14


def test_itl_stands_in_for_tpot_and_says_so():
    # vLLM < 0.11 has only the inter-token latency histogram: the same buckets as ITL
    m = _analysis(tpot="inter_token_latency_seconds").models["m"]
    assert m.tpot_source == "itl"
    assert (m.slo_cost.pass_lower, m.slo_cost.pass_upper) == pytest.approx((0.7, 0.8))
    assert m.p95 == pytest.approx({"ttft": 1.5, "itl": 0.0875})
    s = _series(_analysis(tpot="inter_token_latency_seconds"))
    assert ("kvhit_slo_pass_ratio", (("bound", "lower"), ("tpot_source", "itl"))) in s


def test_unconfigured_cost_and_sizing_are_unknown_with_reasons():
    m = _analysis(config={}).models["m"]
    assert m.slo_cost is None and "slo.ttft_seconds" in m.unknown["slo_pass_ratio"]
    assert m.kv_peak_bytes is None and "sizing.batch" in m.unknown["kv_peak_bytes"]
    # sizing set, no model geometry: S_kv unknown, and the peak says so (a review found it absent without why)
    m = _analysis(config={"sizing": {"batch": 8, "max_len": 2048}}).models["m"]
    assert m.kv_peak_bytes is None and "model geometry" in m.unknown["kv_peak_bytes"]
    # SLOs without a price: pass bounds known, cost unknown, named per bound
    m = _analysis(config={"slo": {"ttft_seconds": 1.5, "tpot_seconds": 0.05}}).models["m"]
    assert m.slo_cost.pass_upper == pytest.approx(0.8) and m.slo_cost.cost_lower is None
    assert m.unknown["cost_per_million_slo_output_tokens_lower"] == "instance_hour_price not configured"


def test_config_keys_validated_and_named():
    cfg = load_config(None, environ={"KVHIT_INSTANCE_HOUR_PRICE": "60", "KVHIT_RETRY_RATE": "0.05",
                                     "KVHIT_SIZING_BATCH": "32", "KVHIT_SIZING_MAX_LEN": "8192"})
    assert (cfg.instance_hour_price, cfg.retry_rate, cfg.sizing.batch, cfg.sizing.max_len) == (60.0, 0.05, 32, 8192)
    assert load_config(None, environ={}).retry_rate == 0.0
    for flags, key in (({"retry_rate": 1.0}, "retry_rate"), ({"instance_hour_price": 0}, "instance_hour_price"),
                       ({"sizing": {"batch": 0}}, "sizing.batch"), ({"sizing": {"max_len": 0}}, "sizing.max_len"),
                       ({"sizing": {"nope": 1}}, "sizing.nope")):
        with pytest.raises(ConfigError, match=key.replace(".", "\\.")):
            load_config(None, environ={}, flags=flags)


def test_b_load_is_measured_from_vllm_0_16_s_offload_counters_too():
    # vLLM 0.16-0.23 export the offloading connector's transfers both ways in one family,
    # kv_offload_total_bytes/_time{transfer_type} (0.24+: kv_offload_load_*): B_load = Δbytes/Δtime of
    # CPU_to_GPU alone = 2.5e9 B / 0.2 s = 12.5e9 B/s (GPU_to_CPU's 4e9 B / 0.5 s = 8e9 read otherwise).
    # Where both spellings are exported (0.24+ keeps the old one, deprecated), the new one is read.
    def offload(k: int, new: bool) -> str:
        lines = [f'vllm:kv_offload_total_bytes_total{{{L},transfer_type="CPU_to_GPU"}} {2.5e9 * k}',
                 f'vllm:kv_offload_total_bytes_total{{{L},transfer_type="GPU_to_CPU"}} {4e9 * k}',
                 f'vllm:kv_offload_total_time_total{{{L},transfer_type="CPU_to_GPU"}} {0.2 * k}',
                 f'vllm:kv_offload_total_time_total{{{L},transfer_type="GPU_to_CPU"}} {0.5 * k}']
        if new:  # 1e9 B in 0.1 s: 10e9 B/s
            lines += [f'vllm:kv_offload_load_bytes_total{{{L},transfer_type="CPU_to_GPU"}} {1e9 * k}',
                      f'vllm:kv_offload_load_time_total{{{L},transfer_type="CPU_to_GPU"}} {0.1 * k}']
        return "\n".join(lines) + "\n"
    for new, expected in ((False, 12.5e9), (True, 10e9)):
        a = Analyzer(load_config(None, environ={}, flags=CONFIG))
        for k in range(1, 3):
            a.ingest(parse_exposition(scrape(k) + offload(k, new), 1000.0 + 10 * k))
        m = a.analysis().models["m"]
        assert m.load_bandwidth == (pytest.approx(expected), "measured")
    # the new bytes NaN at the second scrape: unknown (no B_load configured here), never the old
    # spelling's total against the new one's seconds ((5e9 − 1e9)/0.1 = 4e10 B/s: review)
    a = Analyzer(load_config(None, environ={}, flags=CONFIG))
    for k in range(1, 3):
        text = scrape(k) + offload(k, True)
        a.ingest(parse_exposition(text.replace(f"}} {1e9 * k}", "} NaN") if k == 2 else text, 1000.0 + 10 * k))
    assert a.analysis().models["m"].load_bandwidth is None


def test_max_num_seqs_levels_are_per_engine_with_data_parallel_engines():
    # the same step on two data-parallel engines: num_requests_running 4 on each (8 summed), 10
    # requests each. --max-num-seqs is per engine, so the concurrency level is 4 with 20 requests;
    # TPOT buckets summed 10, 16, 20 at 0.02, 0.05, 0.1 s: P95 rank 19 → 0.05 + 0.05·(19 − 16)/4 = 0.0875 s
    def two(k: int) -> str:
        body = scrape(k)
        other = [ln.replace('engine="0"', 'engine="1"') for ln in body.splitlines()
                 if 'engine="0"' in ln and not ln.startswith("vllm:cache_config_info")]
        return body + "\n".join(other) + "\n"
    a = Analyzer(load_config(None, environ={}, flags=CONFIG))
    for k in range(3):  # the first step is fitted at the third scrape
        a.ingest(parse_exposition(two(k), 1000.0 + 10 * k))
    m = a.analysis().models["m"]
    assert m.fits["max_num_seqs"].extra["levels"] == [[4, pytest.approx(0.0875), 20.0]]


def test_max_num_seqs_levels_of_uneven_data_parallel_engines_are_each_engine_s_own():
    # two engines at different concurrency: engine 0 runs 2 requests and its 10 TPOTs a step fall
    # in (0, 0.02] s, engine 1 runs 6 and its 10 fall in (0.05, 0.1] s. Three steps fitted, 10 s
    # apart, each level n = 10·(1 + 2^(-10/3600) + 2^(-20/3600)) requests (1 h half-life), one
    # bucket each: level 2 P95 = 0.02·0.95 = 0.019 s; level 6 = 0.05 + 0.05·0.95 = 0.0975 s.
    # Merged they read level (2 + 6)/2 = 4 at the busier engine's tail: 0.05 + 0.05·0.9 = 0.095 s.
    def engine(e: int, k: int, running: int, buckets: tuple[int, int, int], total: float) -> list[str]:
        lines = [ln for ln in scrape(k).splitlines() if 'engine="0"' in ln and "cache_config_info" not in ln
                 and "request_time_per_output_token" not in ln]
        lines = [ln.replace(f"running{{{L}}} 4", f"running{{{L}}} {running}") for ln in lines]
        tpot = _hist("request_time_per_output_token_seconds",
                     [(le, c * k) for le, c in zip(("0.02", "0.05", "0.1", "+Inf"), (*buckets, 10))], 10 * k, total * k)
        return [ln.replace('engine="0"', f'engine="{e}"') for ln in [*lines, *tpot.splitlines()]]

    def two(k: int) -> str:
        return "\n".join([*engine(0, k, 2, (10, 10, 10), 0.15), *engine(1, k, 6, (0, 0, 10), 0.75)]) + "\n"
    a = Analyzer(load_config(None, environ={}, flags=CONFIG))
    for k in range(5):  # steps 0→1 to 2→3 fitted (a step is fitted at the next scrape)
        a.ingest(parse_exposition(two(k), 1000.0 + 10 * k))
    fit = a.analysis().models["m"].fits["max_num_seqs"]
    n = pytest.approx(10 * (1 + 2 ** (-10 / 3600) + 2 ** (-20 / 3600)))
    assert fit.extra["levels"] == [[2, pytest.approx(0.019), n], [6, pytest.approx(0.0975), n]]
    assert fit.samples == 3 * 2  # an observation per engine per step (kvhit_fit_samples' HELP)


def test_max_num_seqs_levels_count_the_busy_engines_only():
    # as above, plus a third engine idle throughout (scrape 0's zero counters, nothing running):
    # the busy two still run 4 each, level 4 (8 running over 3 engines read 2.7: physics audit)
    def three(k: int) -> str:
        engine0 = [ln for ln in scrape(k).splitlines() if 'engine="0"' in ln and "cache_config_info" not in ln]
        idle = [ln.replace(f"running{{{L}}} 4", f"running{{{L}}} 0").replace('engine="0"', 'engine="2"')
                for ln in scrape(0).splitlines() if 'engine="0"' in ln and "cache_config_info" not in ln]
        assert sum(ln.endswith(" 0") and "running" in ln for ln in idle) == 1
        return scrape(k) + "\n".join([*(ln.replace('engine="0"', 'engine="1"') for ln in engine0), *idle]) + "\n"
    a = Analyzer(load_config(None, environ={}, flags=CONFIG))
    for k in range(3):
        a.ingest(parse_exposition(three(k), 1000.0 + 10 * k))
    m = a.analysis().models["m"]
    assert m.fits["max_num_seqs"].extra["levels"] == [[4, pytest.approx(0.0875), 20.0]]


def test_max_num_seqs_levels_of_a_draining_step_count_the_engines_running_at_either_end():
    # two engines drain together: running 4 each, then 0 in the step from 1000 to 1010 s; its mean
    # running is (8 + 0)/2 = 4 over the 2 engines that ran, level 2 (over engines running at both
    # ends, none, it read 4: diff review)
    def two(k: int, running: int) -> str:
        body = scrape(k).replace(f"num_requests_running{{{L}}} 4", f"num_requests_running{{{L}}} {running}")
        return body + "\n".join(ln.replace('engine="0"', 'engine="1"') for ln in body.splitlines()
                                if 'engine="0"' in ln and "cache_config_info" not in ln) + "\n"
    a = Analyzer(load_config(None, environ={}, flags=CONFIG))
    for i, (k, running) in enumerate(((0, 4), (1, 0), (1, 0))):
        a.ingest(parse_exposition(two(k, running), 1000.0 + 10 * i))
    assert [level for level, *_ in a.analysis().models["m"].fits["max_num_seqs"].extra["levels"]] == [2]


def test_max_num_seqs_levels_in_fleet_mode_count_the_engines_the_source_saw_running():
    # fleet mode: the two engines of the test above are 2 of 4 engines summed, the 2 others idle
    # in the range (active: 2): 8 running over 2, level 4 (over all 4 it read 2: third review)
    def two(k: int) -> str:
        body = scrape(k)
        return body + "\n".join(ln.replace('engine="0"', 'engine="1"') for ln in body.splitlines()
                                if 'engine="0"' in ln and "cache_config_info" not in ln) + "\n"
    a = Analyzer(load_config(None, environ={}, flags=CONFIG))
    for k in range(3):
        snap = parse_exposition(two(k), 1000.0 + 10 * k)
        a.ingest(replace(snap, engine_counts={"m": 4}, busy_counts={"m": 2}, active_counts={"m": 2}))
    assert a.analysis().models["m"].fits["max_num_seqs"].extra["levels"] == [[4, pytest.approx(0.0875), 20.0]]


def test_an_absent_p95_and_jitter_say_why():
    # the scrapes export TTFT and the per-request TPOT histograms, no inter-token latency: the
    # ITL P95 is absent and kvhit_unknown_info says which histogram is missing; one 10-s window
    # gives no per-minute hit ratios yet, so the jitter is absent with its reason too
    m = _analysis().models["m"]
    assert set(m.p95) == {"ttft", "tpot_request"}
    assert m.unknown["observed_p95_itl"] == ("no vllm:inter_token_latency_seconds or vllm:time_per_output_token_seconds "
                                             "histogram with buckets in the publish window")
    assert "observed_p95_ttft" not in m.unknown and "observed_p95_tpot_request" not in m.unknown
    assert m.caching.jitter is None
    assert m.unknown["hit_ratio_jitter"].startswith("fewer than 3 of the last 15 minutes")
    # a window where no request finished: the histograms exist with count 0
    a = Analyzer(load_config(None, environ={}, flags=CONFIG))
    a.ingest(parse_exposition(scrape(1), 1000.0))
    a.ingest(parse_exposition(scrape(1), 1010.0))
    assert a.analysis().models["m"].unknown["observed_p95_ttft"] == \
        "no observation in the publish window (no data, not 0)"


def test_a_p95_above_every_finite_bucket_edge_says_so():
    # TTFT with only the +Inf bucket: 10 observations, no finite edge to interpolate to
    def only_inf(k: int) -> str:
        text = scrape(k)
        ttft = _hist("time_to_first_token_seconds", [("0.5", 6 * k), ("1.0", 9 * k), ("2.0", 10 * k), ("+Inf", 10 * k)],
                     10 * k, 6.0 * k)
        return text.replace(ttft, _hist("time_to_first_token_seconds", [("+Inf", 10 * k)], 10 * k, 6.0 * k))
    a = Analyzer(load_config(None, environ={}, flags=CONFIG))
    a.ingest(parse_exposition(only_inf(0), 1000.0))
    a.ingest(parse_exposition(only_inf(1), 1010.0))
    m = a.analysis().models["m"]
    assert "ttft" not in m.p95
    assert m.unknown["observed_p95_ttft"] == "vllm:time_to_first_token_seconds: the P95 lies above every finite bucket edge"


def test_a_p95_in_the_inf_bucket_is_withheld_not_read_as_the_last_edge():
    # A version audit: vLLM <= 0.8.4's TTFT buckets end at 10 s; a P95 above the last finite edge is
    # only bounded from below, where histogram_quantile answers with that edge (10 s for a true 15 s).
    # Here the window's 20 requests: 10 at 0.25 s (<= 0.5) and 10 at 15 s (+Inf bucket only): rank
    # 0.95 * 20 = 19 falls in +Inf, so P95 >= 2 s is all the buckets say; the mean stands,
    # (10 * 0.25 + 10 * 15) / 20 = 7.625 s.
    def slow(k: int) -> str:
        ttft = _hist("time_to_first_token_seconds", [("0.5", 6 * k), ("1.0", 9 * k), ("2.0", 10 * k), ("+Inf", 10 * k)],
                     10 * k, 6.0 * k)
        return scrape(k).replace(ttft, _hist("time_to_first_token_seconds",
                                             [("0.5", 10 * k), ("1.0", 10 * k), ("2.0", 10 * k), ("+Inf", 20 * k)],
                                             20 * k, 152.5 * k))
    a = Analyzer(load_config(None, environ={}, flags=CONFIG))
    a.ingest(parse_exposition(slow(0), 1000.0))
    a.ingest(parse_exposition(slow(1), 1010.0))
    m = a.analysis().models["m"]
    assert "ttft" not in m.p95 and m.observed_ttft == pytest.approx(7.625, rel=1e-12)
    assert m.unknown["observed_p95_ttft"] == ("vllm:time_to_first_token_seconds: the P95 lies above every finite "
                                              "bucket edge (measured: P95 ≥ 2 s)")


def _with_cache_dtype(dtype: str):
    """The analysis of scrape(0), scrape(1) with cache_config_info's cache_dtype set."""
    plain = 'vllm:cache_config_info{block_size="16",'
    a = Analyzer(load_config(None, environ={}, flags=CONFIG))
    for k, t in ((0, 1000.0), (1, 1010.0)):
        a.ingest(parse_exposition(scrape(k).replace(plain, f'{plain}cache_dtype="{dtype}",'), t))
    return a.analysis().models["m"]


def test_s_kv_follows_the_kv_cache_dtype_vllm_reports():
    # vLLM --kv-cache-dtype fp8 stores 1 byte per element: S_kv = 2·32·8·128·1 = 65,536 bytes, half
    # the 2-byte default; peak KV 8 · 2048 · 65,536 = 1 GiB
    m = _with_cache_dtype("fp8_e4m3")
    assert m.kv_bytes_per_token == 65_536.0 and m.kv_peak_bytes == 2**30
    assert "kv_cache_dtype" not in m.warnings  # nothing configured disagrees
    # "auto" stores the model's dtype: 2 bytes as served on GPUs
    assert _with_cache_dtype("auto").kv_bytes_per_token == 131_072.0
    # a format kvhit has no size for: the default, and a warning saying to set it
    m = _with_cache_dtype("fp8_ds_mla")
    assert m.kv_bytes_per_token == 131_072.0 and "set model.dtype_bytes" in m.warnings["kv_cache_dtype"]


def test_configured_dtype_bytes_that_disagrees_with_the_engine_is_overruled_and_said():
    config = {**CONFIG, "model": {**CONFIG["model"], "dtype_bytes": 2}}
    a = Analyzer(load_config(None, environ={}, flags=config))
    plain = 'vllm:cache_config_info{block_size="16",'
    for k, t in ((0, 1000.0), (1, 1010.0)):
        a.ingest(parse_exposition(scrape(k).replace(plain, f'{plain}cache_dtype="fp8",'), t))
    m = a.analysis().models["m"]
    assert m.kv_bytes_per_token == 65_536.0  # what vLLM stores: 1 byte
    assert m.warnings["kv_cache_dtype"].startswith("model.dtype_bytes is 2 but vLLM stores KV as fp8 (1 bytes")
    s = _series(a.analysis())
    assert s[("kvhit_warning_info", (("reason", m.warnings["kv_cache_dtype"]), ("warning", "kv_cache_dtype")))] == 1


def test_published_reasons_leave_out_the_values_measured_this_scrape():
    # kvhit_unknown_info / kvhit_warning_info carry a reason label: a reason printing this scrape's
    # h or ISL made a new series almost every scrape (305 for one signal in an hour: soak review)
    analysis = _analysis()
    m = analysis.models["m"]
    tail = measured("at h=0.3, ISL=2048 0.1 ± 0.2 s")
    m = replace(m, unknown={**m.unknown, "predicted_target": "not identifiable: why" + tail},
                warnings={**m.warnings, "load_aware_off": "off its observed TTFT" + tail})
    series = _series(replace(analysis, models={"m": m}))
    assert series[("kvhit_unknown_info", (("reason", "not identifiable: why"), ("signal", "predicted_target")))] == 1.0
    assert series[("kvhit_warning_info", (("reason", "off its observed TTFT"), ("warning", "load_aware_off")))] == 1.0
    assert not any("measured" in dict(labels).get("reason", "") for _, labels in series)


def test_a_kv_pool_beyond_a_float_is_unknown_not_an_overflow():
    # A review's cache_config_info: 1e200 blocks of 1e200 tokens, each finite, their product inf:
    # max_concurrency's int(inf) raised and the whole analysis was lost. The pool size is unknown.
    a = Analyzer(load_config(None, environ={}, flags=CONFIG))
    for k, t in ((0, 1000.0), (1, 1010.0)):
        a.ingest(parse_exposition(scrape(k).replace('block_size="16"', 'block_size="1e200"')
                                  .replace('num_gpu_blocks="1000"', 'num_gpu_blocks="1e200"'), t))
    m = a.analysis().models["m"]
    assert m.kv_capacity_tokens is None and m.max_concurrency is None and "kv_capacity_tokens" in m.unknown
    # the concurrency ceiling it bounds is absent with a reason too (a review: block_size="0" left none)
    assert "kv_capacity_tokens reason" in m.unknown["max_concurrency"]
    assert m.hit_ratio["device"] == 0.8  # 8000 hits of 10000 queries: the rest of the analysis stands


def test_torn_reads_of_a_hit_counter_leave_the_24_h_hit_ratio_unbiased():
    # A breaker's case: vLLM 0.32's real body, every cumulative counter grown by 0.2 % of its value
    # a second, so every step's h is the body's hits / queries, 4131168 / 5346304. Every 5th scrape
    # reads one counter 5000 tokens low for that scrape only (never below the scrape before): the
    # step into it or out of it has hits above queries. Left out alone, its neighbour's error went
    # in, always lowering h: the history read 0.693 (queries low) and 0.658 (hits low).
    import re
    from pathlib import Path

    from exporter.runner import Runner

    body = (Path(__file__).parent / "data" / "samples" / "25_vllm_v1_0.32_cpu_full_snapshot.prom").read_text()
    cumulative = re.compile(r"^(vllm:[a-z0-9_:]+?(?:_total|_count|_sum|_bucket))(\{[^}]*\})? (\S+)$", re.M)
    for dipped in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        config = load_config(None, environ={}, flags={"target": "http://127.0.0.1:1/metrics", "window_seconds": 10,
                                                      "interval": 1})
        runner = Runner(config, "synthetic")
        for i in range(60):
            def grown(m: re.Match, i: int = i) -> str:
                v = float(m.group(3)) * (1.0 + 0.002 * i) - (5000.0 if m.group(1) == dipped and i and i % 5 == 0 else 0.0)
                return f"{m.group(1)}{m.group(2) or ''} {v!r}"
            runner.clock = lambda i=i: 1.8e9 + i  # the scrape's time: nothing stale
            assert runner.ingest_text(1.8e9 + i, cumulative.sub(grown, body))
        caching = runner.analyzer.analysis().models["tiny"].caching
        assert caching.history_hit_ratio == pytest.approx(4131168 / 5346304, rel=1e-9), dipped
