"""exporter/parse.py against the real /metrics samples in tests/data/samples/ (INDEX.md) and small
synthetic expositions written here (MODEL.md §2; reference vllm-metrics.md §1, §2, §4.2, §7).

Every expected value was read off the sample file by hand; the comment next to it says which
line(s) it comes from and how it was aggregated. None is copied from the parser's output.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from exporter.parse import MAX_ENGINES, MAX_MODELS, Histogram, ParseError, parse_exposition

SAMPLES = Path(__file__).parent / "data" / "samples"
T = 1_700_000_000.0  # scrape time handed to the parser; not in the files


def sample(prefix: str):
    (path,) = SAMPLES.glob(f"{prefix}_*.prom")
    return parse_exposition(path.read_text(encoding="utf-8"), T)


def _no_timestamp_as_data(snap) -> None:
    """No counter, gauge or histogram value looks like a unix timestamp (a `_created` or
    `lora_requests_info` value, ~1.7e9, read as data)."""
    for sig in snap.models.values():
        for v in list(sig.counters.values()) + list(sig.gauges.values()):
            assert v < 1e9
        for h in sig.histograms.values():
            assert h.count < 1e9 and not (h.sum >= 1e9)


# --- every file has an outcome -------------------------------------------------------------

# prefix → (engine, substring the reason must contain ("" = must be empty), model_names)
OUTCOMES = {
    # only a TTFT histogram (no era marker, no engine label); its _count was cut → nothing readable
    "01": ("vllm", "none of the signals", set()),
    # HELP "currently running on GPU", gpu_prefix_cache_hit_rate, num_requests_swapped → V0
    "02": ("vllm_v0", "", {"Qwen/Qwen2.5-Coder-1.5B-Instruct"}),
    # HELP "in model execution batches" + declared gpu_prefix_cache_queries_total → V1
    "03": ("vllm_v1", "", {"Qwen/Qwen2.5-Coder-32B-Instruct"}),
    # only request_params_max_tokens buckets, no engine label, no HELP → era unknown; not a signal
    "04": ("vllm", "none of the signals", set()),
    "05": ("vllm_v1", "", {"zai-org/GLM-4.5"}),
    # engine="0" label → V1; request_params_n is not a signal kvhit reads
    "06": ("vllm_v1", "none of the signals", set()),
    # every histogram of the paste misses its _count on one of the two engines → DP totals unknown
    "08": ("vllm_v1", "complete for every data-parallel engine", set()),
    # time_in_queue_requests (deprecated V0 family) → V0; only sql-lora's TTFT has a _count
    "09": ("vllm_v0", "", {"sql-lora"}),
    # SGLang is read through exporter/engines.py (tests/test_engines.py has the values):
    # 0.3.x label name= → the model; prompt_tokens_total and max_total_num_tokens are read
    "11": ("sglang", "", {"/models/meta-llama/Llama-3.2-3B/"}),
    # WIP build: num_requests_running/waiting, token_usage, cache_hit_rate (percent) gauges
    "12": ("sglang", "", {"google/gemma-2-9b-it"}),
    # 0.5.1: num_running_reqs / token_usage with tp_rank, pp_rank labels
    "14": ("sglang", "", {"Qwen-32B"}),
    # sglang_ prefix (smg sidecar): cache_hit_rate gauge and realtime_tokens_total{mode=prefill_compute}
    "15": ("sglang", "", {"meta-llama/Llama-3.1-8B-Instruct"}),
    "16": ("lmcache", "unsupported engine: lmcache", set()),
    "17": ("lmcache", "unsupported engine: lmcache", set()),
    # declares vllm:avg_generation_throughput_toks_per_s (0.2.x/V0 only) with no sample
    "19": ("vllm_v0", "no samples", set()),
    # HELP/TYPE only; HELP "currently running on GPU", gpu_prefix_cache_hit_rate declared → V0
    "20": ("vllm_v0", "no samples", set()),
    # HELP "in model execution batches" → V1
    "21": ("vllm_v1", "", {"meta-llama/Llama-3.1-8B-Instruct"}),
    "23": ("unknown", "no vLLM metrics", set()),
    # P/D decode node: num_running_reqs 0.0 (num_transfer_failed_reqs_total is not read)
    "24": ("sglang", "", {"/models/deepseek-ai__DeepSeek-R1"}),
    "25": ("vllm_v1", "", {"tiny"}),
}


def test_every_sample_file_has_an_outcome():
    prefixes = {p.name.split("_", 1)[0] for p in SAMPLES.glob("*.prom")}
    assert prefixes == set(OUTCOMES)


@pytest.mark.parametrize("prefix", sorted(OUTCOMES))
def test_sample_engine_reason_models(prefix):
    engine, reason, models = OUTCOMES[prefix]
    snap = sample(prefix)
    assert snap.timestamp == T
    assert snap.engine == engine
    if reason:
        assert reason in snap.reason
    else:
        assert snap.reason == ""
    assert set(snap.models) == models
    _no_timestamp_as_data(snap)


# --- vLLM files, value by value ------------------------------------------------------------


def test_02_v0_hit_rate_gauge_minus_one_and_hit_ratio_unknown():
    snap = sample("02")
    m = snap.models["Qwen/Qwen2.5-Coder-1.5B-Instruct"]
    # counters (no engine label, one series each): prompt 148.0, generation 955.0, preemptions 0.0
    assert dict(m.counters) == {"prompt_tokens": 148.0, "generation_tokens": 955.0, "preemptions": 0.0}
    # running 0.0, waiting 0.0, gpu_cache_usage_perc 0.0 (the V0 name of kv usage),
    # gpu_prefix_cache_hit_rate -1.0 (= no data) read as it is, not dropped or clamped
    assert dict(m.gauges) == {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0, "v0_hit_rate": -1.0}
    # iteration_tokens_total: _sum 1103 and buckets up to le=96, but no _count (cut) → unknown
    assert m.histograms == {}
    # V0: only the lifetime, block-level gauge → the token hit ratio cannot be windowed
    reason = m.unknown["hit_ratio"]
    assert "gpu_prefix_cache_hit_rate" in reason and "lifetime" in reason and "block" in reason
    assert m.hit_unit == ""  # no hit counter at all
    assert m.created == {}  # V0 disabled _created series
    # cache_config_info has no HELP line and no model_name; block_size="16"
    assert snap.cache_config["block_size"] == "16"
    assert snap.cache_config["enable_prefix_caching"] == "False"


def test_03_early_v1_gauges_without_engine_label_process_metrics_ignored():
    m = sample("03").models["Qwen/Qwen2.5-Coder-32B-Instruct"]
    # running 0.0, waiting 0.0, gpu_cache_usage_perc 0.0
    assert dict(m.gauges) == {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    # process_cpu_seconds_total 439.72 is not a vLLM counter; the gpu_prefix_cache_queries_total
    # value line was cut after its TYPE line → no counter, no hit unit, hit ratio unknown
    assert dict(m.counters) == {}
    assert m.hit_unit == ""
    assert "hit_ratio" in m.unknown


def test_05_created_kept_apart_from_data_queries_in_tokens():
    snap = sample("05")
    m = snap.models["zai-org/GLM-4.5"]
    # queries: vllm:prefix_cache_queries_total{engine="0"} 32.0 (the only engine)
    # hits: prefix_cache_hits_total is not in the excerpt; the deprecated
    #   gpu_prefix_cache_hits_total{engine="0"} 0.0 counts the same tokens in 0.10 → 0.0
    assert dict(m.counters) == {"queries": 32.0, "hits": 0.0}
    # HELP of prefix_cache_queries: "in terms of number of queried tokens"
    assert m.hit_unit == "tokens"
    # kv_cache_usage_perc 9.75010481363281e-06 (scientific notation)
    assert dict(m.gauges) == {"kv_usage": pytest.approx(9.75010481363281e-06, rel=1e-12)}
    # the two *_created gauges are not data but kept per series for restart detection
    assert dict(m.created) == {
        'gpu_prefix_cache_queries{engine="0"}': 1.7537953269352946e09,
        'gpu_prefix_cache_hits{engine="0"}': 1.7537953269353123e09,
    }
    # hits and queries known → hit ratio known; no external counters and no cache_config_info
    assert "hit_ratio" not in m.unknown
    assert "hit_ratio_loaded" in m.unknown


def test_prefix_cache_wins_over_deprecated_gpu_prefix_cache():
    # both families exposed with different values (0.10): only prefix_cache_* is used
    text = """\
# HELP vllm:gpu_prefix_cache_queries_total GPU prefix cache queries, in terms of number of queried blocks. DEPRECATED
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 999.0
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 555.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 32.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 16.0
"""
    m = parse_exposition(text, T).models["m"]
    assert dict(m.counters) == {"queries": 32.0, "hits": 16.0}
    assert m.hit_unit == "tokens"  # from prefix_cache_queries' HELP, not the deprecated one's
    # prefix_cache_hits dropped (a relabel, a cut body): the deprecated hits, in blocks by their
    # HELP here, over token queries made h 555/32 blocks per token; the hits are unknown instead
    # (in tokens by their HELP, as in 0.10's sample 05 above, they pair with the token queries)
    mixed = text.replace('vllm:prefix_cache_hits_total{engine="0",model_name="m"} 16.0\n', "")
    mixed = mixed.replace("# TYPE vllm:gpu_prefix_cache_hits_total counter",
                          "# HELP vllm:gpu_prefix_cache_hits_total GPU prefix cache hits, in terms of number of "
                          "cached blocks. DEPRECATED\n# TYPE vllm:gpu_prefix_cache_hits_total counter")
    assert "prefix_cache_hits_total{" in mixed and "\nvllm:prefix_cache_hits_total{" not in mixed
    assert dict(parse_exposition(mixed, T).models["m"].counters) == {"queries": 32.0}
    # the other way round: the deprecated queries and the new hits are no pair either
    swapped = text.replace('vllm:prefix_cache_queries_total{engine="0",model_name="m"} 32.0\n', "")
    assert dict(parse_exposition(swapped, T).models["m"].counters) == {"queries": 999.0, "hits": 555.0}


def test_06_histogram_created_recorded_never_data():
    snap = sample("06")
    # request_params_n (count 4, sum 4) is not a signal kvhit reads → no model at all
    assert snap.models == {}
    # with one counter kvhit reads added, the model exists and both _created gauges of the file
    # are kept per series, with their engine label
    extra = 'vllm:prefix_cache_queries_total{engine="0",model_name="zai-org/GLM-4.5"} 32.0\n'
    text = (next(SAMPLES.glob("06_*.prom")).read_text() + extra)
    m = parse_exposition(text, T).models["zai-org/GLM-4.5"]
    assert dict(m.counters) == {"queries": 32.0}
    assert dict(m.gauges) == {} and dict(m.histograms) == {}
    assert dict(m.created) == {
        'request_max_num_generation_tokens{engine="0"}': 1.7537953269356403e09,
        'request_params_n{engine="0"}': 1.753795326935825e09,
    }


def test_08_dp2_partial_paste_no_partial_sums():
    snap = sample("08")
    # request_generation_tokens: only engine 0 has a _count (3.0); engine 1's buckets (le 1…1000)
    # lost their _count in the paste. Engine 0's 3 requests are not the model's total (engine 1
    # finished at least 1: its le=500 bucket is 1.0), so the DP total is unknown, not 3.
    # TTFT and decode time: engine 1 buckets only, no _count → unknown, not 0.
    assert snap.models == {}
    # engine 0 has 3 series, engine 1 36 (its buckets): under half as many, engine 0 is taken for a
    # stray (1); request_generation_tokens is then incomplete (engine 1 lacks its _count: 1); TTFT
    # and decode time have no complete engine at all (nothing to sum, nothing reported)
    assert snap.quirks == {"engine_incomplete": 2}


DP2 = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="2000"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/models/qwen3-8b"} 3.0
vllm:num_requests_running{engine="1",model_name="/models/qwen3-8b"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="/models/qwen3-8b"} 2.0
vllm:num_requests_waiting{engine="1",model_name="/models/qwen3-8b"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="/models/qwen3-8b"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="/models/qwen3-8b"} 0.5
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="/models/qwen3-8b"} 300.0
vllm:prefix_cache_queries_total{engine="1",model_name="/models/qwen3-8b"} 100.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="/models/qwen3-8b"} 120.0
vllm:prefix_cache_hits_total{engine="1",model_name="/models/qwen3-8b"} 20.0
# TYPE vllm:request_generation_tokens histogram
vllm:request_generation_tokens_bucket{engine="0",le="100.0",model_name="/models/qwen3-8b"} 1.0
vllm:request_generation_tokens_bucket{engine="0",le="1000.0",model_name="/models/qwen3-8b"} 3.0
vllm:request_generation_tokens_bucket{engine="0",le="+Inf",model_name="/models/qwen3-8b"} 3.0
vllm:request_generation_tokens_count{engine="0",model_name="/models/qwen3-8b"} 3.0
vllm:request_generation_tokens_sum{engine="0",model_name="/models/qwen3-8b"} 1250.0
vllm:request_generation_tokens_bucket{engine="1",le="100.0",model_name="/models/qwen3-8b"} 0.0
vllm:request_generation_tokens_bucket{engine="1",le="1000.0",model_name="/models/qwen3-8b"} 1.0
vllm:request_generation_tokens_bucket{engine="1",le="+Inf",model_name="/models/qwen3-8b"} 1.0
vllm:request_generation_tokens_count{engine="1",model_name="/models/qwen3-8b"} 1.0
vllm:request_generation_tokens_sum{engine="1",model_name="/models/qwen3-8b"} 400.0
"""


def test_dp2_complete_series_summed_over_engines():
    # file 08's label set, with every engine's histogram complete
    snap = parse_exposition(DP2, T)
    assert snap.engine == "vllm_v1"
    m = snap.models["/models/qwen3-8b"]
    # counters summed: queries 300 + 100 = 400; hits 120 + 20 = 140
    assert dict(m.counters) == {"queries": 400.0, "hits": 140.0}
    # running 3 + 1 = 4, waiting 2 + 0 = 2 (summed); kv usage max(0.25, 0.5) = 0.5
    assert dict(m.gauges) == {"running": 4.0, "waiting": 2.0, "kv_usage": 0.5}
    # histogram: count 3 + 1 = 4, sum 1250 + 400 = 1650,
    # buckets le=100: 1 + 0 = 1; le=1000: 3 + 1 = 4; +Inf: 3 + 1 = 4
    h = m.histograms["request_generation_tokens"]
    assert h == Histogram.of(1650.0, 4.0, ((100.0, 1.0), (1000.0, 4.0), (math.inf, 4.0)))
    # cache_config_info: engine 0's labels even though engine 1's line comes first
    assert snap.cache_config["num_gpu_blocks"] == "2000"


def test_a_counter_an_engine_creates_at_first_use_is_no_damage_when_one_engine_lacks_it():
    # vLLM creates kv_offload_* per engine at its first transfer: engine 1 has stored (GPU_to_CPU)
    # but not loaded yet. Not engine_incomplete (a damaged body, which also took every later scrape
    # off the fast path: review); the model's load total waits for both engines' (unknown).
    from exporter.parse import Parser
    lines = ["# TYPE vllm:prefix_cache_queries counter", "# TYPE vllm:kv_offload_total_bytes counter"]
    for e in "01":
        lab = f'engine="{e}",model_name="m"'
        lines += [f"vllm:prefix_cache_queries_total{{{lab}}} 1000", f"vllm:prefix_cache_hits_total{{{lab}}} 400",
                  f'vllm:kv_offload_total_bytes_total{{{lab},transfer_type="GPU_to_CPU"}} 4e9']
    lines.append('vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="CPU_to_GPU"} 2.5e9')
    body = "\n".join(lines) + "\n"
    snap = parse_exposition(body, T)
    assert snap.quirks == {} and dict(snap.models["m"].counters) == {"queries": 2000.0, "hits": 800.0}
    p = Parser()
    p.parse(body, T)
    assert repr(p.parse(body.replace(" 1000", " 1100"), T + 1)) == repr(parse_exposition(body.replace(" 1000", " 1100"), T + 1))
    assert p._plan is not None  # the fast path reads it


def test_histogram_sum_unknown_when_one_engine_lacks_it():
    # engine 1's _sum line removed: 1250 + ? is unknown, not 1250
    text = DP2.replace('vllm:request_generation_tokens_sum{engine="1",model_name="/models/qwen3-8b"} 400.0\n', "")
    h = parse_exposition(text, T).models["/models/qwen3-8b"].histograms["request_generation_tokens"]
    assert h.count == 4.0 and math.isnan(h.sum)


def test_09_model_names_kept_apart():
    snap = sample("09")
    m = snap.models["sql-lora"]
    # sql-lora TTFT: buckets le 2.5, 5, 7.5, 10, +Inf all 1.0, _count 1.0, no _sum
    h = m.histograms["ttft"]
    assert h.count == 1.0
    assert math.isnan(h.sum)
    assert h.buckets == ((2.5, 1.0), (5.0, 1.0), (7.5, 1.0), (10.0, 1.0), (math.inf, 1.0))
    # the base model's TTFT buckets (le=0.04 → 2.0 …) have no _count and must not leak into
    # sql-lora; request_prompt_tokens has _sum 5 / 10 but no _count → unknown for both
    assert set(m.histograms) == {"ttft"}
    assert "meta-llama/Llama-2-7b-hf" not in snap.models
    assert "gpu_prefix_cache_hit_rate" in m.unknown["hit_ratio"]  # V0


def test_two_models_counters_kept_apart():
    text = """\
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="base"} 1000.0
vllm:prompt_tokens_total{model_name="sql-lora"} 7.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="base"} 2.0
vllm:num_requests_running{model_name="sql-lora"} 1.0
"""
    snap = parse_exposition(text, T)
    assert dict(snap.models["base"].counters) == {"prompt_tokens": 1000.0}
    assert dict(snap.models["sql-lora"].counters) == {"prompt_tokens": 7.0}
    assert snap.models["base"].gauges["running"] == 2.0
    assert snap.models["sql-lora"].gauges["running"] == 1.0


def test_21_docs_example_ttft_without_inf_bucket():
    m = sample("21").models["meta-llama/Llama-3.1-8B-Instruct"]
    # generation_tokens_total 27453.0; request_success_total is not read
    assert dict(m.counters) == {"generation_tokens": 27453.0}
    assert dict(m.gauges) == {"running": 8.0}
    # TTFT buckets as printed (no +Inf: elided by the doc), _count 140, no _sum
    h = m.histograms["ttft"]
    assert h.count == 140.0 and math.isnan(h.sum)
    assert h.buckets == ((0.001, 0.0), (0.005, 0.0), (0.01, 0.0), (0.02, 13.0), (0.04, 97.0),
                         (0.06, 123.0), (0.08, 138.0), (0.1, 140.0))
    assert "hit_ratio" in m.unknown


def test_25_vllm_032_full_snapshot():
    snap = sample("25")
    m = snap.models["tiny"]
    # one engine (engine="0" everywhere), so each value is the single series' value
    assert dict(m.counters) == {
        "queries": 5_346_304.0,            # prefix_cache_queries_total 5.346304e+06
        "hits": 4_131_168.0,               # prefix_cache_hits_total 4.131168e+06
        "external_queries": 0.0,           # external_prefix_cache_queries_total 0.0
        "external_hits": 0.0,              # external_prefix_cache_hits_total 0.0
        "prompt_tokens": 5_346_304.0,      # prompt_tokens_total 5.346304e+06
        "generation_tokens": 143_690.0,    # generation_tokens_total 143690.0
        "preemptions": 0.0,                # num_preemptions_total 0.0
        "prompt_local_compute": 1_215_136.0,  # prompt_tokens_by_source_total{source="local_compute"}
    }
    # cross-check of the file itself: local_compute + local_cache_hit + external_kv_transfer
    # = 1,215,136 + 4,131,168 + 0 = 5,346,304 = prompt tokens = queries
    assert 1_215_136 + 4_131_168 + 0 == 5_346_304
    # mm_cache_* (items), prompt_tokens_cached, estimated_* and http_* are not read (checked above)
    assert m.hit_unit == "tokens"
    assert dict(m.gauges) == {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}

    hs = m.histograms
    assert set(hs) == {"iteration_tokens", "prefill_time", "decode_time", "queue_time", "ttft",
                       "request_tpot", "itl", "e2e", "request_prompt_tokens",
                       "request_generation_tokens", "prefill_kv_computed_tokens"}
    # (count, sum) from each family's _count / _sum lines
    expected = {
        "iteration_tokens": (57301.0, 1_358_826.0),
        "prefill_time": (3242.0, 653.0443655060021),
        "decode_time": (3242.0, 1037.1640762029988),
        "queue_time": (3242.0, 25.125562603994013),
        "ttft": (3242.0, 942.6592826843262),
        "request_tpot": (3242.0, 27.675260010775695),
        "itl": (140_448.0, 1037.1640762029988),        # inter_token_latency_seconds
        "e2e": (3242.0, 1979.198920249939),
        "request_prompt_tokens": (3242.0, 5_346_304.0),  # = prompt_tokens_total
        "request_generation_tokens": (3242.0, 143_690.0),  # = generation_tokens_total
        "prefill_kv_computed_tokens": (3242.0, 1_215_136.0),  # = local_compute
    }
    for name, (count, total) in expected.items():
        assert (hs[name].count, hs[name].sum) == (count, total), name
    # iteration_tokens_total buckets: 1 → 775, 8 → 54892, 16 → 54892, 32 → 54892, 64 → 55234,
    # 128 → 55738, 256 → 56089, 512 → 56291, 1024 → 56776, 2048 → 57193, 4096/8192/16384/+Inf → 57301
    assert hs["iteration_tokens"].buckets == (
        (1.0, 775.0), (8.0, 54892.0), (16.0, 54892.0), (32.0, 54892.0), (64.0, 55234.0),
        (128.0, 55738.0), (256.0, 56089.0), (512.0, 56291.0), (1024.0, 56776.0),
        (2048.0, 57193.0), (4096.0, 57301.0), (8192.0, 57301.0), (16384.0, 57301.0),
        (math.inf, 57301.0))
    pf = dict(hs["prefill_time"].buckets)
    assert (pf[0.3], pf[0.5], pf[0.8], pf[1.0], pf[1.5], pf[math.inf]) == (2701.0, 2901.0, 3160.0, 3164.0,
                                                                           3242.0, 3242.0)
    assert dict(hs["request_prompt_tokens"].buckets)[2000.0] == 1263.0
    assert dict(hs["prefill_kv_computed_tokens"].buckets)[100.0] == 1511.0

    # cache_config_info: block_size "32", num_gpu_blocks 65536, 65536 · 32 = 2,097,152 tokens
    assert snap.cache_config["block_size"] == "32"
    assert snap.cache_config["kv_cache_size_tokens"] == "2097152"
    assert 65536 * 32 == int(snap.cache_config["kv_cache_size_tokens"])
    # external counters present (and kv_offloading_size="None") → h_load known (= 0), h known
    assert dict(m.unknown) == {}
    # _created kept per series, never as data
    assert m.created['prefix_cache_queries{engine="0"}'] == 1.795997200109768e09
    assert m.created['prompt_tokens_by_source{engine="0",source="local_compute"}'] == 1.7959972001099494e09


# --- synthetic cases -----------------------------------------------------------------------


def test_pid_duplicated_gauge_is_one_value_not_a_sum():
    # vLLM 0.9.2–0.11.0 multiprocess bug: one series per API-server pid
    text = """\
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m",pid="101"} 0.2
vllm:kv_cache_usage_perc{engine="0",model_name="m",pid="102"} 0.3
vllm:kv_cache_usage_perc{engine="1",model_name="m",pid="101"} 0.1
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m",pid="101"} 3.0
vllm:num_requests_running{engine="0",model_name="m",pid="102"} 3.0
vllm:num_requests_running{engine="1",model_name="m",pid="101"} 2.0
"""
    snap = parse_exposition(text, T)
    m = snap.models["m"]
    # kv usage: engine 0 = max over pids(0.2, 0.3) = 0.3 (not 0.5); max over engines(0.3, 0.1) = 0.3
    assert m.gauges["kv_usage"] == 0.3
    # running: engine 0 = max over pids(3, 3) = 3; summed over engines 3 + 2 = 5 (not 8)
    assert m.gauges["running"] == 5.0
    # duplicates collapsed: kv usage engine 0 (pid 102 after 101), running engine 0 (pid 102)
    assert snap.quirks == {"pid_duplicate": 2}


def test_underscore_prefix_and_counter_without_total():
    # llm-d-inference-sim style: Go integers, model_name before le, counters without _total;
    # plus the vllm_ spelling of the namespace
    text = """\
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries{model_name="sim"} 40
vllm:prefix_cache_hits{model_name="sim"} 8
vllm_generation_tokens_total{model_name="sim"} 12
vllm_num_requests_running{model_name="sim"} 2
vllm_request_prompt_tokens_bucket{model_name="sim",le="20"} 1
vllm_request_prompt_tokens_bucket{model_name="sim",le="+Inf"} 2
vllm_request_prompt_tokens_sum{model_name="sim"} 50
vllm_request_prompt_tokens_count{model_name="sim"} 2
"""
    snap = parse_exposition(text, T)
    assert snap.engine == "vllm_v1"  # prefix_cache_queries is a V1 family
    m = snap.models["sim"]
    assert dict(m.counters) == {"queries": 40.0, "hits": 8.0, "generation_tokens": 12.0}
    assert m.gauges["running"] == 2.0
    assert m.histograms["request_prompt_tokens"] == Histogram.of(50.0, 2.0, ((20.0, 1.0), (math.inf, 2.0)))


def test_help_queried_blocks_gives_block_unit():
    # vLLM 0.7–0.8: gpu_prefix_cache_* counted blocks; HELP says so
    text = """\
# HELP vllm:gpu_prefix_cache_queries_total GPU prefix cache queries, in terms of number of queried blocks.
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{model_name="m"} 12.0
# HELP vllm:gpu_prefix_cache_hits_total GPU prefix cache hits, in terms of number of cached blocks.
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{model_name="m"} 3.0
"""
    snap = parse_exposition(text, T)
    assert snap.engine == "vllm_v1"
    m = snap.models["m"]
    assert m.hit_unit == "blocks"
    assert dict(m.counters) == {"queries": 12.0, "hits": 3.0}


def test_nan_and_inf_samples_dropped():
    text = """\
vllm:kv_cache_usage_perc{engine="0",model_name="m"} NaN
vllm:num_requests_waiting{engine="0",model_name="m"} +Inf
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} +Inf
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 5.0
vllm:generation_tokens_total{engine="0",model_name="m"} -Inf
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} NaN
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 4.0
"""
    m = parse_exposition(text, T).models["m"]
    assert dict(m.gauges) == {"running": 2.0}  # NaN usage and +Inf waiting dropped
    assert dict(m.counters) == {"hits": 5.0}  # +Inf queries and -Inf generation dropped
    h = m.histograms["prefill_time"]
    assert h.count == 4.0 and math.isnan(h.sum)  # NaN sum → unknown
    assert "hit_ratio" in m.unknown  # queries unknown


def test_engine_label_alone_marks_v1():
    # a counter that exists in both eras, with the engine label (0.8.3+) → V1
    text = 'vllm:prompt_tokens_total{engine="0",model_name="m"} 5.0\n'
    assert parse_exposition(text, T).engine == "vllm_v1"
    # the same line without it names no era
    assert parse_exposition('vllm:prompt_tokens_total{model_name="m"} 5.0\n', T).engine == "vllm"


@pytest.mark.parametrize("body", [
    '<html><body>SECRET-BODY-MARKER login</body></html>\n',
    'vllm:num_requests_running{model_name="SECRET-BODY-MARKER"} not_a_number\n',
    'vllm:num_requests_running{model_name="SECRET-BODY-MARKER" 1.0\n',
])
def test_malformed_body_raises_parse_error_without_body(body):
    with pytest.raises(ParseError) as info:
        parse_exposition(body, T)
    assert isinstance(info.value, ValueError)
    assert "SECRET-BODY-MARKER" not in str(info.value)
    assert "SECRET-BODY-MARKER" not in repr(info.value)
    # the parser's own exception (which quotes the line) is not chained for a traceback to print
    assert info.value.__cause__ is None and info.value.__suppress_context__


@pytest.mark.parametrize("body,looks", [
    ("<!DOCTYPE html>\n<html>\n<body>Login</body>\n</html>\n", "; it looks like HTML or XML (a web page or a proxy's "
                                                             "error page: check the URL)"),
    ('{"status": "ok",\n "data": []}\n', "; it looks like JSON (an API's answer: check the URL's path)"),
    ("hello\nfoo\n", ""),  # bare names: malformed, and nothing they look like
])
def test_a_body_that_is_not_exposition_says_what_it_looks_like(body, looks):
    # a newcomer's HTML page read "1 of 1 sample lines are malformed", no hint to check the URL
    with pytest.raises(ParseError) as info:
        parse_exposition(body, T)
    assert str(info.value).endswith(" sample lines are malformed" + looks)


@pytest.mark.parametrize("body", ["", "\n", "  \n\n"])
def test_an_empty_body_is_a_parse_error_not_a_scrape_without_models(body):
    # a 200 with nothing (a recorder killed mid-write, a proxy's empty answer) must not replace the
    # last snapshot by "no vLLM metrics" and wipe every per-model series
    with pytest.raises(ParseError, match="empty body"):
        parse_exposition(body, T)


@pytest.mark.parametrize("body", ['{"error":"unauthorized"}', "Unauthorized", "<html><body>login</body></html>"])
def test_one_line_without_newline_is_not_called_an_empty_body(body):
    # the body is never logged, so the message is the operator's only clue: not "empty"
    with pytest.raises(ParseError, match="one line without a final newline") as info:
        parse_exposition(body, T)
    assert "empty" not in str(info.value) and body not in str(info.value)


def test_a_gzip_body_without_its_header_is_called_gzip():
    # a proxy that compresses /metrics and drops Content-Encoding: the body was called "10 of 10
    # sample lines are malformed" (a fault breaker); the sample body, compressed as such a proxy does
    import gzip
    raw = gzip.compress((SAMPLES / "08_vllm_v1_0.10.x_dp2_engine_label_histograms.prom").read_bytes())
    with pytest.raises(ParseError, match="gzip-compressed data where text exposition was expected"):
        parse_exposition(raw.decode("utf-8", errors="replace"), T)


def test_an_empty_body_keeps_the_runner_state():
    from exporter.config import Config
    from exporter.replay import TraceClock
    from exporter.runner import Runner
    clock = TraceClock()
    r = Runner(Config(), "t", clock=clock)
    body = 'vllm:prefix_cache_queries_total{{model_name="m"}} {q}\nvllm:prefix_cache_hits_total{{model_name="m"}} {h}\n'
    for t, q in ((100.0, 0.0), (105.0, 40.0)):
        clock.t = t
        assert r.ingest_text(t, body.format(q=q, h=q / 4))
    clock.t = 110.0
    assert r.ingest_text(110.0, "") is False
    analysis, health = r.current()
    assert analysis.models["m"].hit_ratio["device"] == 0.25  # the last good window, still published
    assert health.errors.get("parse") == 1


# --- issue 7: the shared fixtures, their quirks and version evidence ---------------------------

# SHA-256 of ../shared/fixtures/samples/*.prom, the fixtures the issue names: the repo's copies
# (tests/data/samples, so the project stands alone) are those very bytes.
SHARED_SHA256 = {
    "01": "83d904f72ccbfdc4881a587081c0a586c5b24ee13b6dcdd82153dee6942ab8f0",
    "02": "e59d3777d3310971a972f47e7ff90925f3216f72d6dcace12b394fcbcebcd015",
    "03": "b97225083edd12d15c01c62a4b82633da63eb7aeefdde72b132a857ec9f74747",
    "04": "fa9e234161814d5fe527638c40a10f73665f04a009f937ebec89dbe85bd42eb3",
    "05": "325d609fdcf77a4563ed4372ad6c6f500e695a124680fa699631f5196efafde2",
    "06": "94bdfea508bcd0f813340237e92fc6352b50c32a47657d9aca086dcd85c2f5a4",
    "08": "82ce0e8ab054d94dc32ea8c4c0ee7e71e755ff6988788f3c937ffa41360e96e3",
    "09": "159b4b4f27eefdfc23be0e7fdb3379b3cda6c4f27f9c3cb8e6c45b9503e784f9",
    "11": "f583a815f128dbc5ace2763eb87bae42503aa2b151058f0fed1b1817e8b23ba9",
    "12": "a3266c42d4dd7a035891ecf0b2f78003a7547aed0bd58360fc6bee05ed4580bf",
    "14": "043b9eb3d42d4b32916d91c4433f793cdb01f03feb9c190e4b4edadda62c617b",
    "15": "01c406fd6eaf3d2c64cf3a0d5d2d1188f90d68c5551c893b3f0ab0b8febb76f6",
    "16": "fd9bd8bab87bf8423bcc0d7138ad8beae16528ba91256183cfd8926e6822856f",
    "17": "adeb5de2d884edda464b7647fca52f6ff59d666aee1e5d5fa956faabce9e34ec",
    "19": "b3cf0ef5e6c4fbf9dafacf4813a39c663cb02944027e98dd43bef1f255337e71",
    "20": "471e1fdcb72ac25479de850a08c14da6a3d6931d96eecbd56778b4a374f49f04",
    "21": "55b051f83eae4b466e526ddb7a8a742a12ba9cae4ce176a2423bba6aa046b76d",
    "23": "fccefd365898ec307c0b672873eeb64cc612ebd7ac8c30c3f5f2b1d139ef0ba6",
    "24": "9bf730c4835ea776454b802660e058b34ab2332a1f74679cb757be457390bc85",
    "25": "d711ab6a4d53c497f67c070e4d4f444e3ee05c4853a39a70e5dc406c0789f67f",
}


def test_samples_are_the_shared_fixtures_byte_for_byte():
    import hashlib
    got = {p.name[:2]: hashlib.sha256(p.read_bytes()).hexdigest() for p in SAMPLES.glob("*.prom")}
    assert got == SHARED_SHA256


# Every file is well-formed text exposition (each ends with a newline, no NaN, no duplicate), so
# no quirk, except 08: its three excerpts lost engine 1's request_generation_tokens _count.
# Version evidence: 05 declares prefix_cache_queries (0.9.2+), 06/08 carry the engine label
# (0.8.3+), 25 exports num_requests_waiting_by_reason (0.20+); the others prove nothing.
QUIRKS = {"08": {"engine_incomplete": 2}}  # test_08_dp2_partial_paste_no_partial_sums
SINCE = {"05": (0, 9, 2), "06": (0, 8, 3), "08": (0, 8, 3), "25": (0, 20, 0)}


@pytest.mark.parametrize("prefix", sorted(OUTCOMES))
def test_sample_quirks_and_version_evidence(prefix):
    snap = sample(prefix)
    assert dict(snap.quirks) == QUIRKS.get(prefix, {})
    assert snap.since == SINCE.get(prefix, ())


def test_sample_cut_inside_a_line_drops_that_line_only():
    # sample 21 cut inside its last line ("..._count{...} 140.0" → "..._count{...} 14"): the cut
    # line is dropped, never read as 14 requests; the TTFT histogram then has no _count → unknown
    text = next(SAMPLES.glob("21_*.prom")).read_text()
    assert text.endswith(" 140.0\n")
    snap = parse_exposition(text[: -len("0.0\n")], T)
    assert snap.quirks == {"truncated": 1}
    m = snap.models["meta-llama/Llama-3.1-8B-Instruct"]
    assert "ttft" not in m.histograms
    assert dict(m.counters) == {"generation_tokens": 27453.0}  # the lines before the cut are kept


def test_non_utf8_bytes_in_a_label_value_and_a_name():
    # a model path with Latin-1 bytes (é = 0xE9) decoded with replacement: the label keeps U+FFFD,
    # the line is read; a metric name with a bad byte is malformed and dropped alone
    raw = (b'vllm:prompt_tokens_total{model_name="/models/caf\xe9"} 12.0\n'
           b'vllm:generation_tokens\xff_total{model_name="m"} 3.0\n'
           b'vllm:generation_tokens_total{model_name="m"} 3.0\n')
    snap = parse_exposition(raw.decode("utf-8", errors="replace"), T)
    assert snap.quirks == {"non_utf8": 2, "malformed_line": 1}
    assert dict(snap.models["/models/caf\ufffd"].counters) == {"prompt_tokens": 12.0}
    assert dict(snap.models["m"].counters) == {"generation_tokens": 3.0}


def test_negative_and_duplicate_series():
    text = """\
vllm:prompt_tokens_total{engine="0",model_name="m"} -5.0
vllm:generation_tokens_total{engine="0",model_name="m"} 10.0
vllm:generation_tokens_total{engine="0",model_name="m"} 12.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} -1000.0
"""
    snap = parse_exposition(text, T)
    # a counter or a gauge below zero is ignored (unknown: a -1000 running read as data made the
    # contention factor negative, review); a series given twice is ambiguous: dropped (unknown)
    assert snap.quirks == {"negative": 2, "duplicate_series": 1}
    assert dict(snap.models["m"].counters) == {}
    assert dict(snap.models["m"].gauges) == {"running": 3.0}


def test_a_label_name_given_twice_is_a_malformed_line_not_another_model():
    # model_name="m", model_name="x": a phantom model x took a max_series slot (review); the line is
    # malformed, as prometheus-client and Prometheus read it, and dropped alone
    text = """\
vllm:prefix_cache_hits_total{engine="0",model_name="m",model_name="x"} 3.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 10.0
"""
    snap = parse_exposition(text, T)
    assert snap.quirks == {"malformed_line": 1}
    assert list(snap.models) == ["m"] and dict(snap.models["m"].counters) == {"queries": 10.0}


def test_inconsistent_histogram_left_out():
    text = """\
vllm:request_prefill_time_seconds_bucket{engine="0",le="0.5",model_name="m"} 5.0
vllm:request_prefill_time_seconds_bucket{engine="0",le="1.0",model_name="m"} 4.0
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 6.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 6.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 3.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 6.0
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 7.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 1.0
vllm:request_decode_time_seconds_bucket{engine="0",le="1.0",model_name="m"} 2.0
vllm:request_decode_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 6.0
vllm:request_decode_time_seconds_count{engine="0",model_name="m"} 6.0
vllm:request_decode_time_seconds_sum{engine="0",model_name="m"} 9.0
"""
    snap = parse_exposition(text, T)
    # prefill: cumulative 5 → 4 decreases; queue: +Inf 6 ≠ _count 7 → both left out;
    # decode is consistent (2 ≤ 6, +Inf = _count = 6) and kept
    assert snap.quirks == {"histogram_inconsistent": 2}
    assert set(snap.models["m"].histograms) == {"decode_time"}


@pytest.mark.parametrize("size, on", [("None", False), ("0", False), ("0.0", False), ("0e5", False), ("", False),
                                      ("8.0", True), ("0.5", True), ("16", True), ("1e+16", True), ("2.5E-3", True)])
def test_offloading_is_on_for_a_size_with_a_non_zero_digit(size, on):
    """vLLM prints kv_offloading_size with str(float) ("None" when off): large sizes in exponent form."""
    from exporter.parse import offload_configured
    assert offload_configured({"kv_offloading_size": size}) is on
    assert offload_configured({}) is None


def test_a_vllm_032_body_without_its_external_prefix_cache_family_has_loaded_hits_unknown():
    # vLLM >= 0.11.1 exports external_prefix_cache_* (at 0 without a connector); this body's other
    # families prove 0.20 (num_requests_waiting_by_reason). A review cut the family mid-run: the
    # cache_config_info rule (no offloading: h_load 0) read the loaded hits as 0, never unknown.
    text = "".join(line for line in (SAMPLES / "25_vllm_v1_0.32_cpu_full_snapshot.prom").read_text(encoding="utf-8")
                   .splitlines(keepends=True) if "external_prefix_cache" not in line)
    snap = parse_exposition(text, T)
    m = snap.models["tiny"]
    assert snap.since == (0, 20, 0) and "external_hits" not in m.counters
    assert "from a vLLM >= 0.20.0" in m.unknown["hit_ratio_loaded"] and "hit_ratio" not in m.unknown
    # with the family, the same body's loaded hits are known: 0
    assert sample("25").models["tiny"].counters["external_hits"] == 0.0
    assert "hit_ratio_loaded" not in sample("25").models["tiny"].unknown


def test_model_names_past_max_models_are_dropped_and_counted():
    # a deploy review's find: 49,000 one-line models of a family kvhit reads held 840 MiB; the
    # first MAX_MODELS model_name values are read (the real model's series come first), the rest
    # dropped line by line: 5000 junk models, 1023 of them read beside "tiny", 3977 lines dropped
    (path,) = SAMPLES.glob("25_*.prom")
    text = path.read_text(encoding="utf-8")
    junk = "".join(f'vllm:num_requests_running{{engine="0",model_name="junk-{i:05d}"}} 1.0\n' for i in range(5000))
    snap = parse_exposition(text + junk, T)
    assert MAX_MODELS == 1024
    assert len(snap.models) == 1024 and "junk-01022" in snap.models and "junk-01023" not in snap.models
    assert snap.quirks["models_over_limit"] == 3977
    assert snap.models["tiny"].counters["hits"] == 4_131_168.0  # the real model read as without the junk

    # a dropped model proves nothing of the engine's version: its external counters (vLLM >= 0.11.1)
    # once told the kept model its hits excluded preempted prompts (diff review); read as if absent
    real = ('# TYPE vllm:prefix_cache_queries_total counter\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="real"} 100.0\n'
            '# TYPE vllm:prefix_cache_hits_total counter\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="real"} 50.0\n'
            '# TYPE vllm:num_requests_running gauge\n'
            + "".join(f'vllm:num_requests_running{{engine="0",model_name="j{i:04d}"}} 1.0\n' for i in range(MAX_MODELS - 1)))
    late = ('# TYPE vllm:external_prefix_cache_queries_total counter\n'
            'vllm:external_prefix_cache_queries_total{engine="0",model_name="late"} 5.0\n')
    without, dropped = parse_exposition(real, T), parse_exposition(real + late, T)
    assert "late" not in dropped.models and dropped.quirks["models_over_limit"] == 1
    assert dropped.since_of("real") == without.since_of("real")
    assert dropped.excludes_preempted("real") == without.excludes_preempted("real")
    assert dict(dropped.models["real"].unknown) == dict(without.models["real"].unknown)


def test_a_model_past_max_engines_is_dropped_whole_and_counted():
    # a newcomer's find: 60,000 engine labels of one model (3.7 MB) took 10 s per scrape to assemble;
    # past MAX_ENGINES its engines would be a partial sum, so the model goes whole: its 1025 lines
    # (1024 read, then removed, and the one past the cap) are counted, the real model read as without
    (path,) = SAMPLES.glob("25_*.prom")
    text = path.read_text(encoding="utf-8")

    def junk(n: int) -> str:
        return "".join(f'vllm:prefix_cache_hits_total{{engine="{e}",model_name="m"}} 5.0\n' for e in range(n))
    assert MAX_ENGINES == 1024
    kept = parse_exposition(text + junk(MAX_ENGINES), T)
    assert "m" in kept.models and "engines_over_limit" not in kept.quirks
    snap = parse_exposition(text + junk(MAX_ENGINES + 1), T)
    assert "m" not in snap.models and snap.quirks["engines_over_limit"] == 1025
    assert snap.models["tiny"].counters["hits"] == 4_131_168.0
    # a body without model_name (its model is ""): 1100 engines were 1024's partial sum (review)
    bare = "".join(f'vllm:prefix_cache_queries_total{{engine="{e}"}} 1.0\nvllm:prefix_cache_hits_total{{engine="{e}"}} 1.0\n'
                   for e in range(1100))
    snap = parse_exposition(bare, T)
    assert "" not in snap.models and snap.quirks["engines_over_limit"] == 2200


def test_a_translated_engines_models_past_max_models_are_dropped_in_body_order():
    # SGLang's samples are translated (sorted) then read as vLLM: the cap counted models in that
    # sorted order, so 5000 junk models named "A-…" ahead of "Qwen-32B" pushed the real one out
    # (diff review); now the first MAX_MODELS seen in the body are read, one quirk per line dropped
    (path,) = SAMPLES.glob("14_*.prom")
    text = path.read_text(encoding="utf-8")
    junk = "".join(f'sglang:cache_hit_rate{{model_name="A-{i:05d}"}} 0.5\n' for i in range(5000))
    snap = parse_exposition(text + junk, T)
    assert "Qwen-32B" in snap.models and len(snap.models) == MAX_MODELS
    assert snap.quirks["models_over_limit"] == 5000 - (MAX_MODELS - 1)
