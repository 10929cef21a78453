"""SGLang and llm-d-inference-sim read onto kvhit's signals (exporter/engines.py, MODEL.md §2;
reference vllm-metrics.md §6.1, §6.3).

The SGLang samples in tests/data/samples/ are single scrapes; a token hit ratio is a ratio of
counter increases, so each test takes a real sample as the first scrape and the same text with
known increments (written out here) as the second. Expected ratios are worked by hand.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from exporter.analyzer import Analyzer
from exporter.config import Config
from exporter.parse import parse_exposition

SAMPLES = Path(__file__).parent / "data" / "samples"
T0, T1 = 1_700_000_000.0, 1_700_000_010.0


def _text(prefix: str) -> str:
    (path,) = SAMPLES.glob(f"{prefix}_*.prom")
    return path.read_text(encoding="utf-8")


def _window(first: str, second: str):
    """Analysis of the model(s) after two scrapes 10 s apart (default configuration)."""
    a = Analyzer(Config())
    a.ingest(parse_exposition(first, T0))
    a.ingest(parse_exposition(second, T1))
    return a.analysis()


SMG = ('engine_type="unified",mode="{mode}",model_name="meta-llama/Llama-3.1-8B-Instruct",moe_ep_rank="0",'
       'pp_rank="0",tp_rank="0",worker_addr="grpc://127.0.0.1:8001"')


def test_15_smg_realtime_tokens_hit_ratio_and_batch_gauge_ignored():
    base = _text("15")
    # sample 15 exports realtime_tokens_total{mode="prefill_compute"} 55 only (the paste ends there)
    # → alone it says nothing about hits
    alone = parse_exposition(base, T0).models["meta-llama/Llama-3.1-8B-Instruct"]
    assert "prefill_cache" in alone.unknown["hit_ratio"] and "cache_hit_rate" in alone.unknown["hit_ratio"]
    # first scrape: + prefill_cache 165; second: compute 55 → 100 (+45), cache 165 → 320 (+155),
    # and the per-batch gauge jumps from 0 to 1 (100 %)
    first = base + f"sglang_realtime_tokens_total{{{SMG.format(mode='prefill_cache')}}} 165\n"
    second = (base.replace("} 55", "} 100").replace("sglang_cache_hit_rate{", "sglang_cache_hit_rate_x{")
              + f"sglang_realtime_tokens_total{{{SMG.format(mode='prefill_cache')}}} 320\n"
              + 'sglang_cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1\n')
    analysis = _window(first, second)
    assert analysis.engine == "sglang" and analysis.engine_reason == ""
    m = analysis.models["meta-llama/Llama-3.1-8B-Instruct"]
    # Δqueries = 45 + 155 = 200, Δhits = 155 → h = 155/200 = 0.775 (the gauge's 1.0 is not used);
    # no HiCache family → nothing is loaded: h_load = 0, h = h_dev
    assert m.hit_ratio == pytest.approx({"device": 0.775, "loaded": 0.0, "all": 0.775}, rel=1e-12)
    assert "hit_ratio" not in m.unknown


def test_unknown_reasons_name_sglang_families_not_vllm_ones():
    # SGLang's histograms (vllm-metrics.md §6.1): time_to_first_token_seconds,
    # inter_token_latency_seconds (old name time_per_output_token_seconds), e2e, queue_time, and the
    # prompt and output lengths (prompt_tokens_histogram, generation_tokens_histogram); no per-request
    # TPOT. Sample 14 exports none of them: a reason names what SGLang would export, or says SGLang
    # exports no such histogram, never a vllm: family
    text = _text("14")
    m = next(iter(_window(text, text).models.values()))
    assert m.unknown["observed_p95_ttft"] == "no sglang:time_to_first_token_seconds histogram with buckets in the publish window"
    assert m.unknown["observed_p95_itl"] == ("no sglang:inter_token_latency_seconds or sglang:time_per_output_token_seconds "
                                             "histogram with buckets in the publish window")
    assert m.unknown["observed_p95_tpot_request"] == "SGLang exports no request_time_per_output_token_seconds histogram"
    assert m.unknown["isl"] == "no complete sglang:prompt_tokens_histogram histogram at both ends of the publish window"
    assert m.unknown["osl"] == ("no complete sglang:generation_tokens_histogram histogram at both ends of the publish "
                                "window")
    assert m.unknown["observed_ttft"] == ("no complete sglang:time_to_first_token_seconds histogram at both ends of "
                                          "the publish window")
    assert not [r for r in m.unknown.values() if "vllm" in r.lower()]


def test_unknown_reasons_name_the_families_as_the_gateway_writes_them():
    # sample 15 is SGLang's model gateway, whose names start "sglang_", not "sglang:": the name a
    # user greps for is the one the exposition has
    text = _text("15")
    assert not [line for line in text.splitlines() if line.startswith("sglang:")]
    m = next(iter(_window(text, text).models.values()))
    assert m.unknown["observed_p95_ttft"] == "no sglang_time_to_first_token_seconds histogram with buckets in the publish window"
    assert m.unknown["observed_ttft"] == ("no complete sglang_time_to_first_token_seconds histogram at both ends of "
                                          "the publish window")


def test_14_tp_replicas_counted_once_dp_ranks_summed():
    # sample 14's label set with DP attention on (every series gains dp_rank; dp 1 is a copy of
    # the file's dp 0 on tp_rank 2) and the counters SGLang 0.5 exports: tp_rank 0 and 1 of one
    # DP rank report the same batch; dp_rank 0 and 1 serve different requests
    sample = _text("14")
    both = (sample.replace('pp_rank="0",tp_rank="0"', 'dp_rank="0",pp_rank="0",tp_rank="0"')
          + "".join(line.replace('pp_rank="0",tp_rank="0"', 'dp_rank="1",pp_rank="0",tp_rank="2"') + "\n"
                    for line in sample.splitlines() if not line.startswith("#")))

    def scrape(c0: int, p0: int, c1: int, p1: int) -> str:
        lines = [both]
        for dp, tps, cache, comp in (("0", ("0", "1"), c0, p0), ("1", ("2", "3"), c1, p1)):
            for tp in tps:
                for mode, v in (("prefill_cache", cache), ("prefill_compute", comp)):
                    lines.append(f'sglang:realtime_tokens_total{{dp_rank="{dp}",engine_type="unified",mode="{mode}",'
                                 f'model_name="Qwen-32B",pp_rank="0",tp_rank="{tp}"}} {v}.0')
        return "\n".join(lines) + "\n"

    snap = parse_exposition(scrape(900, 100, 800, 200), T0)
    sig = snap.models["Qwen-32B"]
    # hits = 900 (dp 0) + 800 (dp 1), each once although two TP ranks export it = 1700
    # queries = (900 + 100) + (800 + 200) = 2000
    assert dict(sig.counters) == {"hits": 1700.0, "queries": 2000.0}
    assert set(sig.engines) == {"0", "1"}  # dp_rank became vLLM's data-parallel engine label
    # second scrape: dp 0 cache +100 (1000), dp 1 compute +100 (300): Δhits 100, Δqueries 200 → 0.5
    m = _window(scrape(900, 100, 800, 200), scrape(1000, 100, 800, 300)).models["Qwen-32B"]
    assert m.hit_ratio["all"] == pytest.approx(100 / 200, rel=1e-12)
    # running: num_running_reqs 1.0 per DP rank, summed = 2.0; token_usage 0.0 on both → max 0.0
    assert dict(snap.models["Qwen-32B"].gauges) == {"running": 2.0, "kv_usage": 0.0}


def test_11_name_label_cached_tokens_against_prompt_tokens():
    base = _text("11")
    label = 'name="/models/meta-llama/Llama-3.2-3B/"'
    first = base + f"sglang:cached_tokens_total{{{label}}} 1000.0\n"
    # prompt_tokens_total 230794 → 234794 (+4000), cached 1000 → 4000 (+3000): h = 3000/4000 = 0.75
    second = base.replace("230794.0", "234794.0") + f"sglang:cached_tokens_total{{{label}}} 4000.0\n"
    m = _window(first, second).models["/models/meta-llama/Llama-3.2-3B/"]
    assert m.hit_ratio == pytest.approx({"device": 0.75, "loaded": 0.0, "all": 0.75}, rel=1e-12)
    # the file's own signals: prompt tokens and the KV pool size max_total_num_tokens 570979
    sig = parse_exposition(base, T0).models["/models/meta-llama/Llama-3.2-3B/"]
    assert dict(sig.counters) == {"prompt_tokens": 230794.0}
    assert dict(sig.gauges) == {"kv_capacity_tokens": 570979.0}


def test_12_percent_gauge_normalised_but_never_the_hit_ratio():
    sig = parse_exposition(_text("12"), T0).models["google/gemma-2-9b-it"]
    # sglang:cache_hit_rate 87.58777633289988 > 1 → a percent → 0.8758777633289988; kept only as
    # the last batch's rate; num_requests_running 0.0, num_requests_waiting 0.0 (preferred over
    # queue_req 0.0), token_usage 0.0
    assert sig.gauges["batch_hit_rate"] == pytest.approx(0.8758777633289988, rel=1e-15)
    assert dict(sig.gauges) == pytest.approx({"running": 0.0, "waiting": 0.0, "kv_usage": 0.0,
                                              "batch_hit_rate": 0.8758777633289988})
    # cached_token / new_token are per-batch gauges of that build: no token counter → unknown
    assert sig.counters == {}
    assert "cache_hit_rate gauge" in sig.unknown["hit_ratio"]


HICACHE = 'sglang:hicache_host_used_tokens{model_name="m"} 5.0\nsglang:num_running_reqs{model_name="m"} 1.0\n'


def test_hicache_needs_the_cache_source_split():
    rt = ('sglang:realtime_tokens_total{{mode="prefill_cache",model_name="m"}} {0}\n'
          'sglang:realtime_tokens_total{{mode="prefill_compute",model_name="m"}} {1}\n')
    sig = parse_exposition(HICACHE + rt.format(10, 10), T0).models["m"]
    assert "HiCache" in sig.unknown["hit_ratio"]  # host hits hide inside prefill_cache

    def split(device: int, host: int, prompt: int) -> str:
        return (HICACHE + rt.format(1, 1)
                + f'sglang:cached_tokens_total{{cache_source="device",model_name="m"}} {device}\n'
                + f'sglang:cached_tokens_total{{cache_source="host",model_name="m"}} {host}\n'
                + f'sglang:cached_tokens_total{{cache_source="total",model_name="m"}} {device + host}\n'
                + f'sglang:prompt_tokens_total{{model_name="m"}} {prompt}\n')

    # Δdevice 600, Δhost 200, Δprompt 1000 → h_dev 0.6, h_load 0.2, h 0.8
    m = _window(split(100, 0, 1000), split(700, 200, 2000)).models["m"]
    assert m.hit_ratio == pytest.approx({"device": 0.6, "loaded": 0.2, "all": 0.8}, rel=1e-12)


SIM = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits{{model_name="sim"}} {hits}
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries{{model_name="sim"}} {queries}
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{model_name="sim"}} {queries}
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="sim"}} 2
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{model_name="sim"}} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",num_gpu_blocks="1000"}} 1
"""


def test_llm_d_inference_sim_counters_without_total():
    # llm-d-inference-sim (Mar–Aug 2026): vllm:prefix_cache_hits / _queries without _total,
    # model_name only, cache_config_info with block_size and num_gpu_blocks only, and V0's HELP
    # for num_requests_running ("… running on GPU.", its docs/metrics.md)
    snap = parse_exposition(SIM.format(hits=300, queries=1000), T0)
    assert snap.engine == "vllm_v1"  # prefix_cache_queries proves V1
    assert dict(snap.models["sim"].counters) == {"hits": 300.0, "queries": 1000.0, "prompt_tokens": 1000.0}
    # Δhits 450, Δqueries 600 → h = 0.75; cache_config_info has no kv_offloading_size → no
    # offload → h_load = 0
    m = _window(SIM.format(hits=300, queries=1000), SIM.format(hits=750, queries=1600)).models["sim"]
    assert m.hit_ratio == pytest.approx({"device": 0.75, "loaded": 0.0, "all": 0.75}, rel=1e-12)


def test_lmcache_stays_unsupported():
    snap = parse_exposition(_text("16"), T0)
    assert (snap.engine, snap.models) == ("lmcache", {})
    assert snap.reason == "unsupported engine: lmcache"


def test_hicache_storage_backend_hits_are_loaded_hits():
    # A SGLang audit: HiCache's L3 hits are labelled cache_source="storage_<backend>"
    # (sglang observability/metrics_collector.py: report_cache_source(f"storage_{backend}", ...)),
    # not "storage": they were dropped. Δprompt 1000, Δdevice 400, Δhost 100, Δstorage_mooncake 300
    # -> h_dev 0.4, h_load (100 + 300)/1000 = 0.4, h 0.8; without any hicache_* family the storage
    # source alone tells HiCache is on.
    def split(device: int, host: int, storage: int, prompt: int, gauges: str = HICACHE) -> str:
        return (gauges
                + f'sglang:cached_tokens_total{{cache_source="device",model_name="m"}} {device}\n'
                + (f'sglang:cached_tokens_total{{cache_source="host",model_name="m"}} {host}\n' if host >= 0 else "")
                + f'sglang:cached_tokens_total{{cache_source="storage_mooncake",model_name="m"}} {storage}\n'
                + f'sglang:prompt_tokens_total{{model_name="m"}} {prompt}\n')

    m = _window(split(100, 50, 100, 1000), split(500, 150, 400, 2000)).models["m"]
    assert m.hit_ratio == pytest.approx({"device": 0.4, "loaded": 0.4, "all": 0.8}, rel=1e-12)
    # device 400 and storage 300 of 1000, no host series, no hicache_* family: h_load 0.3, h 0.7
    running = 'sglang:num_running_reqs{model_name="m"} 1.0\n'
    m = _window(split(100, -1, 100, 1000, running), split(500, -1, 400, 2000, running)).models["m"]
    assert m.hit_ratio == pytest.approx({"device": 0.4, "loaded": 0.3, "all": 0.7}, rel=1e-12)


def test_queue_gauges_by_priority_are_counted_once():
    # A SGLang audit: _log_gauge_queue_count writes the total under priority="" beside a breakdown
    # by priority value; running read 5 + 2 + 3 = 10 for 5. Without the total, the breakdown adds up.
    def body(*rows: tuple[str, float]) -> str:
        return "".join(f'sglang:num_running_reqs{{model_name="m",priority="{p}",tp_rank="0"}} {v}\n'
                       f'sglang:num_queue_reqs{{model_name="m",priority="{p}",tp_rank="0"}} {v / 2}\n' for p, v in rows)

    gauges = parse_exposition(body(("", 5.0), ("0", 2.0), ("1", 3.0)), T0).models["m"].gauges
    assert (gauges["running"], gauges["waiting"]) == (5.0, 2.5)
    gauges = parse_exposition(body(("0", 2.0), ("1", 3.0)), T0).models["m"].gauges
    assert (gauges["running"], gauges["waiting"]) == (5.0, 2.5)
    # per label set (a diff review): the total on dp rank 0 alone leaves rank 1's breakdown summed:
    # 5 + (2 + 3) = 10; and a counter's total (realtime tokens carry priority="" in newer SGLang)
    # counts once: cache 300 of 300 + 100 queried -> its series 300 and 100, never the breakdown too
    ranked = (body(("", 5.0), ("0", 2.0), ("1", 3.0)).replace('model_name="m"', 'dp_rank="0",model_name="m"')
              + body(("0", 2.0), ("1", 3.0)).replace('model_name="m"', 'dp_rank="1",model_name="m"'))
    assert parse_exposition(ranked, T0).models["m"].gauges["running"] == 10.0
    rt = "".join(f'sglang:realtime_tokens_total{{mode="{mode}",model_name="m",priority="{p}"}} {v}\n'
                 for mode, total in (("prefill_cache", 300.0), ("prefill_compute", 100.0))
                 for p, v in (("", total), ("0", total / 3), ("1", 2 * total / 3)))
    assert dict(parse_exposition(rt, T0).models["m"].counters) == {"hits": 300.0, "queries": 400.0}


def test_prompt_and_generation_length_histograms_give_isl_and_osl():
    # A SGLang audit: sglang:prompt_tokens_histogram / generation_tokens_histogram ("Histogram of
    # prompt token length", per finished request) are vLLM's request_prompt_tokens /
    # request_generation_tokens; ISL was withheld as "SGLang exports no request_prompt_tokens
    # histogram". Window: 4 requests, prompts summing 8000 - 2000 = 6000 tokens -> ISL 1500; outputs
    # 1000 - 600 = 400 -> OSL 100.
    def body(n: int, prompt: float, gen: float) -> str:
        out = 'sglang:num_running_reqs{model_name="m"} 1.0\n'
        for name, total in (("prompt_tokens_histogram", prompt), ("generation_tokens_histogram", gen)):
            out += (f'sglang:{name}_bucket{{le="4096.0",model_name="m"}} {n}\n'
                    f'sglang:{name}_bucket{{le="+Inf",model_name="m"}} {n}\n'
                    f'sglang:{name}_count{{model_name="m"}} {n}\n'
                    f'sglang:{name}_sum{{model_name="m"}} {total}\n')
        return out

    m = _window(body(2, 2000.0, 600.0), body(6, 8000.0, 1000.0)).models["m"]
    assert (m.isl, m.osl) == (pytest.approx(1500.0, rel=1e-12), pytest.approx(100.0, rel=1e-12))
    assert "isl" not in m.unknown and "osl" not in m.unknown


def test_dp_ranks_on_the_scheduler_series_alone_are_summed_into_one_machine():
    # A SGLang audit: with --dp-size 2 the scheduler's series carry dp_rank, the tokenizer's never do
    # (tokenizer_manager.py builds its labels without it): each rank's series read as an engine short
    # of the rankless ones, and nothing at all was analysed. The ranks are summed: running 3 + 4 = 7,
    # waiting 1 + 2 = 3, KV usage max(0.2, 0.3) = 0.3, KV capacity per engine one rank's 100,000 tokens
    # (max_total_num_tokens); realtime tokens: Δcache 600 + 600, Δcompute
    # 400 + 400 -> h = 1200 / 2000 = 0.6; prompt tokens from the tokenizer: Δ2000 in 10 s plus
    # Δ900 generation -> delivered TPM (2000 + 900) * 6 = 17,400 per minute; two engines as one machine.
    def body(k: int) -> str:
        out = ""
        for dp in (0, 1):
            s = f'dp_rank="{dp}",model_name="m",tp_rank="0"'
            out += (f"sglang:num_running_reqs{{{s}}} {3 + dp}.0\nsglang:num_queue_reqs{{{s}}} {1 + dp}.0\n"
                    f"sglang:token_usage{{{s}}} 0.{2 + dp}\nsglang:max_total_num_tokens{{{s}}} 100000.0\n"
                    f'sglang:realtime_tokens_total{{{s},mode="prefill_compute"}} {1000 + 400 * k}.0\n'
                    f'sglang:realtime_tokens_total{{{s},mode="prefill_cache"}} {3000 + 600 * k}.0\n')
        return (out + f'sglang:prompt_tokens_total{{model_name="m"}} {4000 + 2000 * k}.0\n'
                + f'sglang:generation_tokens_total{{model_name="m"}} {500 + 900 * k}.0\n')

    snap = parse_exposition(body(0), T0)
    assert snap.reason == "" and dict(snap.models["m"].gauges) == {"running": 7.0, "waiting": 3.0, "kv_usage": 0.3,
                                                                   "kv_capacity_tokens": 100000.0}
    assert snap.engine_counts == {"m": 2} and snap.busy_counts == snap.active_counts == {"m": 2}
    # a diff review: rank 1 idle is no busy rank (all were taken as busy, each step's concurrency
    # per engine halved): running 3 + 0 on 2 ranks, 1 of them busy
    idle = parse_exposition(body(0).replace('sglang:num_running_reqs{dp_rank="1",model_name="m",tp_rank="0"} 4.0',
                                            'sglang:num_running_reqs{dp_rank="1",model_name="m",tp_rank="0"} 0.0'), T0)
    assert idle.models["m"].gauges["running"] == 3.0 and idle.busy_counts == idle.active_counts == {"m": 1}
    m = _window(body(0), body(1)).models["m"]
    assert m.hit_ratio["all"] == pytest.approx(0.6, rel=1e-12)
    assert m.tpm_observed[("delivered", "instance")] == pytest.approx(17400.0, rel=1e-12)
    assert m.warnings["data_parallel"].startswith("2 data-parallel engines in one exposition")
    # the same through the sidecar's runner after a wall-clock step (a clock offset): the ranks stay
    # counted (the runner set the source's counts, none here, over parse's)
    from exporter.runner import Runner
    runner = Runner(Config(), "http://sglang:30000/metrics", clock=lambda: T1)
    assert runner.ingest_text(T0, body(0), clock_offset=0.5) and runner.ingest_text(T1, body(1), clock_offset=0.5)
    assert runner.current()[0].models["m"].warnings["data_parallel"].startswith("2 data-parallel engines")
