"""Semantics across versions, time and state, and cardinality (issue 7), end to end.

Short expositions written here (shaped like the real samples they cite) go through
:meth:`Runner.ingest_text` and the collector; every expected value is worked by hand in the
comment next to it.
"""
from __future__ import annotations

import itertools
import logging
from pathlib import Path

import pytest

from exporter.collector import KvhitCollector
from exporter.config import Config
from exporter.parse import parse_exposition
from exporter.runner import Runner

SAMPLES = Path(__file__).parent / "data" / "samples"
T0 = 1_800_000_000.0


def run(*bodies: str, step: float = 5.0, **cfg) -> Runner:
    t = [T0]
    runner = Runner(Config(**cfg), "http://vllm:8000/metrics", clock=lambda: t[0])
    for i, body in enumerate(bodies):
        t[0] = T0 + i * step
        assert runner.ingest_text(t[0], body), i
    return runner


def published(runner: Runner) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in KvhitCollector(runner.current).collect():
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("target",))))] = s.value
    return out


def series(pub: dict, name: str) -> dict[tuple, float]:
    return {labels: v for (n, labels), v in pub.items() if n == name}


def info(pub: dict, name: str, key: str) -> dict[str, str]:
    """kvhit_unknown_info / kvhit_warning_info as {signal or warning: reason}."""
    return {dict(labels)[key]: dict(labels)["reason"] for labels in series(pub, name)}


# --- V0: a lifetime block-level gauge, -1 = no data ------------------------------------------


def test_v0_hit_rate_gauge_minus_one_is_no_data_never_a_ratio():
    body = next(SAMPLES.glob("02_*.prom")).read_text()
    # the same V0 body twice (prompt tokens 148 both times): the model has a window but no h
    pub = published(run(body, body))
    assert series(pub, "kvhit_hit_ratio") == {}
    reason = info(pub, "kvhit_unknown_info", "signal")["hit_ratio"]
    assert "lifetime block-level gauge" in reason and "-1 means no data" in reason


# --- 0.7–0.8 blocks vs 0.9+ tokens, told by HELP ---------------------------------------------

BLOCKS = """\
# HELP vllm:gpu_prefix_cache_queries_total GPU prefix cache queries, in terms of number of queried {unit}.
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{{model_name="m"}} {q}
# HELP vllm:gpu_prefix_cache_hits_total GPU prefix cache hits, in terms of number of cached {unit}.
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{{model_name="m"}} {k}
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",enable_prefix_caching="True",kv_offloading_size="None"}} 1.0
"""


def test_block_counters_say_so_and_scale_by_block_size():
    a = BLOCKS.format(unit="blocks", q=12.0, k=3.0)
    b = BLOCKS.format(unit="blocks", q=22.0, k=8.0)
    pub = published(run(a, b))
    # Δq = 22 − 12 = 10 blocks, Δk = 8 − 3 = 5 blocks → h = 5/10 = 0.5 (block-level)
    assert series(pub, "kvhit_hit_ratio")[(("model_name", "m"), ("source", "device"))] == pytest.approx(0.5)
    assert "block-level" in info(pub, "kvhit_warning_info", "warning")["hit_unit_blocks"]


def test_block_counters_without_a_block_size_say_why_h_is_unknown():
    # no cache_config_info: blocks cannot become tokens; h was withheld without a word
    no_config = lambda s: "".join(ln + "\n" for ln in s.splitlines() if "cache_config_info" not in ln)  # noqa: E731
    pub = published(run(no_config(BLOCKS.format(unit="blocks", q=12.0, k=3.0)),
                        no_config(BLOCKS.format(unit="blocks", q=22.0, k=8.0))))
    assert series(pub, "kvhit_hit_ratio") == {}
    assert info(pub, "kvhit_unknown_info", "signal")["hit_ratio"].startswith(
        "prefix_cache_queries/hits count KV blocks (vLLM 0.7-0.8) and no cache_config_info gives block_size")


def test_same_counters_with_token_help_have_no_block_warning():
    pub = published(run(BLOCKS.format(unit="tokens", q=12.0, k=3.0), BLOCKS.format(unit="tokens", q=22.0, k=8.0)))
    assert series(pub, "kvhit_hit_ratio")[(("model_name", "m"), ("source", "device"))] == pytest.approx(0.5)
    assert "hit_unit_blocks" not in info(pub, "kvhit_warning_info", "warning")


@pytest.mark.parametrize("unit, block_size, old_config", [("tokens", "16", True), ("blocks", "32", True),
                                                         ("tokens", "16", False)])
def test_a_window_across_a_change_of_hit_unit_withholds_h_until_it_leaves(unit, block_size, old_config):
    # A version audit: vLLM 0.8 (blocks of 16) restarted in place as 0.9 (tokens), or with
    # --block-size 32. Two block scrapes 5 s apart (12/3 then 22/8 blocks), then the restarted
    # engine from 8/3 (its counters fell below half: a reset, with no _created to tell) growing
    # 100/50 per 5 s. The window's raw sums (5 + 3)/(10 + 8) = 0.444 were scaled by the newest unit
    # alone; in tokens the hand sum is (80 + 3)/(160 + 8) = 0.494 (16-token blocks), or (80 + 96)/(160
    # + 256) = 0.423 (32): withheld while the 60-s window holds a step that ends at or before the
    # first new scrape (T0 + 10), then the new era's own 50/100 = 0.5. Without cache_config_info in
    # the old scrapes (blocks of an unknown size: a diff review) the raw sums were published as they
    # were.
    old = [BLOCKS.format(unit="blocks", q=12.0 + 10 * i, k=3.0 + 5 * i) for i in range(2)]
    if not old_config:
        old = ["".join(ln + "\n" for ln in body.splitlines() if "cache_config_info" not in ln) for body in old]
    new = [BLOCKS.format(unit=unit, q=8.0 + 100 * i, k=3.0 + 50 * i).replace('block_size="16"',
                                                                            f'block_size="{block_size}"')
           for i in range(13)]
    for n in (1, 12):  # the newest scrape at T0 + 10 and T0 + 65: windows from T0 and T0 + 5
        pub = published(run(*old, *new[:n]))
        assert series(pub, "kvhit_hit_ratio") == {}
        assert info(pub, "kvhit_unknown_info", "signal")["hit_ratio"].startswith(
            "the prefix-cache counters changed unit inside the publish window")
    pub = published(run(*old, *new))  # newest at T0 + 70: the window from T0 + 10 holds the new unit alone
    assert series(pub, "kvhit_hit_ratio")[(("model_name", "m"), ("source", "all"))] == pytest.approx(0.5)


def test_gpu_counters_without_help_have_an_unknown_unit():
    strip = lambda s: "".join(ln + "\n" for ln in s.splitlines() if not ln.startswith("# HELP"))  # noqa: E731
    pub = published(run(strip(BLOCKS.format(unit="", q=12.0, k=3.0)), strip(BLOCKS.format(unit="", q=22.0, k=8.0))))
    assert series(pub, "kvhit_hit_ratio") == {}
    assert "blocks (0.7-0.8) or tokens (0.9+) cannot be told" in info(pub, "kvhit_unknown_info", "signal")["hit_ratio"]


def test_prefix_caching_off_says_so_and_withdraws_the_verdict_of_before():
    # 13 scrapes 5 s apart with caching on, 750 of every 1000 queried tokens hit (h 0.75 over the
    # minute); then vLLM restarts with --no-enable-prefix-caching: its counters start at 0 and stay
    # there while it serves (a newcomer saw "no prefix-cache queries in the publish window (no data,
    # not 0 %)", as if idle, and the old verdict's history h 0.75 published for minutes)
    on = [BLOCKS.format(unit="tokens", q=1000.0 * i, k=750.0 * i) for i in range(13)]
    off = [BLOCKS.format(unit="tokens", q=0.0, k=0.0).replace('enable_prefix_caching="True"',
                                                            'enable_prefix_caching="False"')] * 3
    before = published(run(*on))
    assert series(before, "kvhit_prefix_cache_history_hit_ratio") == {(("model_name", "m"),): pytest.approx(0.75)}
    pub = published(run(*on, *off))
    reasons = info(pub, "kvhit_unknown_info", "signal")
    assert reasons["hit_ratio"] == ('prefix caching is off (cache_config_info enable_prefix_caching="False"): vLLM '
                                    "counts no prefix-cache query, so there is no hit ratio")
    assert reasons["prefix_cache_verdict"].startswith(reasons["hit_ratio"] + " now")
    assert series(pub, "kvhit_hit_ratio") == {} and series(pub, "kvhit_prefix_cache_history_hit_ratio") == {}
    assert not any(v for v in series(pub, "kvhit_prefix_cache_verdict").values())


# --- preemptions inflate hits before 0.11.1 --------------------------------------------------

V010 = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {q}
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {k}
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{{engine="0",model_name="m"}} {p}
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",engine="0",kv_offloading_size="None"}} 1.0
{extra}"""
EXTERNAL = """\
# TYPE vllm:external_prefix_cache_queries_total counter
vllm:external_prefix_cache_queries_total{{engine="0",model_name="m"}} {eq}
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{{engine="0",model_name="m"}} 0.0
"""


def test_preemptions_flag_the_window_before_0_11_1_only():
    # 0.10-shaped: 2 preemptions in the window → warning; h = (700 − 300)/(1000 − 200) = 0.5
    a = V010.format(q=200.0, k=300.0, p=5.0, extra="")
    b = V010.format(q=1000.0, k=700.0, p=7.0, extra="")
    pub = published(run(a, b))
    assert series(pub, "kvhit_hit_ratio")[(("model_name", "m"), ("source", "all"))] == pytest.approx(0.5)
    assert "inflated" in info(pub, "kvhit_warning_info", "warning")["preemptions"]
    # 0.11.1+ (external_prefix_cache_* exported): preempted requests are no longer counted
    a = V010.format(q=200.0, k=300.0, p=5.0, extra=EXTERNAL.format(eq=0.0))
    b = V010.format(q=1000.0, k=700.0, p=7.0, extra=EXTERNAL.format(eq=400.0))
    pub = published(run(a, b))
    assert "preemptions" not in info(pub, "kvhit_warning_info", "warning")
    # no preemption in the window (5 → 5): no warning either
    pub = published(run(V010.format(q=200.0, k=300.0, p=5.0, extra=""), V010.format(q=1000.0, k=700.0, p=5.0, extra="")))
    assert "preemptions" not in info(pub, "kvhit_warning_info", "warning")


# --- 0.20: waiting includes deferred requests ----------------------------------------------


def test_waiting_by_reason_capacity_is_used_when_present():
    body = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 3.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="deferred"} 4.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="m",reason="capacity"} 2.0
vllm:num_requests_waiting_by_reason{engine="1",model_name="m",reason="deferred"} 0.0
"""
    snap = parse_exposition(body, T0)
    # capacity-waiting summed over engines: 3 + 2 = 5 (not 7 + 2 = 9, which counts 4 deferred)
    assert snap.models["m"].gauges["waiting"] == 5.0
    assert snap.since == (0, 20, 0)
    # before 0.20 (no _by_reason) num_requests_waiting is the same quantity: 7 + 2 = 9
    plain = "".join(ln + "\n" for ln in body.splitlines() if "by_reason" not in ln)
    assert parse_exposition(plain, T0).models["m"].gauges["waiting"] == 9.0
    # engine 0 alone with a damaged capacity value (below 0; fleet mode renders a pod's so): unknown,
    # never the plain gauge's 7, which counts the 4 deferred (review)
    one = "".join(ln + "\n" for ln in body.splitlines() if 'engine="1"' not in ln)
    damaged = parse_exposition('vllm:prefix_cache_queries_total{engine="0",model_name="m"} 10\n'
                               + one.replace('reason="capacity"} 3.0', 'reason="capacity"} -3.0'), T0)
    assert "waiting" not in damaged.models["m"].gauges and damaged.quirks == {"negative": 1}


# --- h = 0 with prompts shorter than a block -------------------------------------------------

SHORT = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {q}
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} 0.0
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{{engine="0",model_name="m"}} 0.0
# TYPE vllm:request_prompt_tokens histogram
vllm:request_prompt_tokens_bucket{{engine="0",le="20.0",model_name="m"}} {n20}
vllm:request_prompt_tokens_bucket{{engine="0",le="50.0",model_name="m"}} {n}
vllm:request_prompt_tokens_bucket{{engine="0",le="+Inf",model_name="m"}} {n}
vllm:request_prompt_tokens_count{{engine="0",model_name="m"}} {n}
vllm:request_prompt_tokens_sum{{engine="0",model_name="m"}} {q}
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="32",engine="0",kv_offloading_size="None"}} 1.0
"""


def test_zero_hits_with_prompts_shorter_than_a_block_are_explained():
    # 10 identical 20-token prompts: 200 queried tokens, 0 hits; ISL = 200/10 = 20 ≤ block_size 32
    pub = published(run(SHORT.format(q=0.0, n=0.0, n20=0.0), SHORT.format(q=200.0, n=10.0, n20=10.0)))
    assert series(pub, "kvhit_hit_ratio")[(("model_name", "m"), ("source", "all"))] == 0.0
    assert series(pub, "kvhit_isl_tokens")[(("model_name", "m"),)] == pytest.approx(20.0)
    assert "cannot hit" in info(pub, "kvhit_warning_info", "warning")["short_prompts"]
    # 4 prompts of 50 tokens (ISL 50 > 32): a true 0, no explanation offered
    pub = published(run(SHORT.format(q=0.0, n=0.0, n20=0.0), SHORT.format(q=200.0, n=4.0, n20=0.0)))
    assert "short_prompts" not in info(pub, "kvhit_warning_info", "warning")


def test_isl_of_a_window_where_no_request_finished_is_unknown_not_the_last_seen_mean():
    # 10 prompts of 20 tokens finish in the first 5-s step (ISL = 200 / 10 = 20), then the counters
    # stand still for 24 more scrapes (120 s): the 60-s publish window holds no finished request
    idle = SHORT.format(q=200.0, n=10.0, n20=10.0)
    pub = published(run(SHORT.format(q=0.0, n=0.0, n20=0.0), *[idle] * 25))
    assert series(pub, "kvhit_isl_tokens") == {}  # never 20, the mean of requests of 2 minutes ago
    assert info(pub, "kvhit_unknown_info", "signal")["isl"] == \
        "no request finished in the publish window (no data, not 0)"
    # while the first step is still inside the window, its mean is published: 20 tokens
    pub = published(run(SHORT.format(q=0.0, n=0.0, n20=0.0), *[idle] * 5))
    assert series(pub, "kvhit_isl_tokens")[(("model_name", "m"),)] == pytest.approx(20.0)


# --- a missing hit metric is unknown, zero queries are no data -------------------------------

PROMPTS = """\
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{{engine="0",model_name="m"}} {p}
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{{engine="0",model_name="m"}} {g}
"""


def test_missing_hit_counters_are_unknown_never_zero():
    pub = published(run(PROMPTS.format(p=100.0, g=10.0), PROMPTS.format(p=400.0, g=40.0)))
    assert series(pub, "kvhit_hit_ratio") == {}
    assert info(pub, "kvhit_unknown_info", "signal")["hit_ratio"] == \
        "no usable prefix_cache_queries/hits counters (absent, or dropped as NaN, out of range, negative or " \
        "duplicated: see kvhit_input_quirks_total; fleet mode: not from every pod, e.g. pods of another vLLM version)"
    # delivered TPM is known: (300 + 30) tokens in 5 s → 330 · 60 / 5 = 3960 per minute
    tpm = series(pub, "kvhit_tpm_tokens_per_minute")
    assert tpm[(("basis", "observed"), ("kind", "delivered"), ("model_name", "m"), ("per", "instance"))] == \
        pytest.approx(3960.0)


def test_a_hit_counter_out_of_range_is_unknown_and_its_reason_says_so():
    # hits at 1e200 (past parse's ±1e18) are dropped as out_of_range: h unknown, never 0; the reason
    # listed NaN, negative and duplicated but not out of range (newcomer review)
    hits = PROMPTS + "# TYPE vllm:prefix_cache_queries_total counter\nvllm:prefix_cache_queries_total{{engine=\"0\",model_name=\"m\"}} {q}\n" \
        "# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total{{engine=\"0\",model_name=\"m\"}} 1e200\n"
    pub = published(run(hits.format(p=100.0, g=10.0, q=100.0), hits.format(p=400.0, g=40.0, q=400.0)))
    assert series(pub, "kvhit_hit_ratio") == {}
    assert "out of range" in info(pub, "kvhit_unknown_info", "signal")["hit_ratio"]
    assert series(pub, "kvhit_input_quirks_total")[(("quirk", "out_of_range"),)] == 2  # one per scrape


def test_an_engine_appearing_says_so_instead_of_blaming_a_cut_body():
    # engine 1 appears at the second scrape (DP scaled up): that step has no increases, so h is
    # unknown; the reason said "missing at a scrape … (a cut or bad body)", which no body was.
    line = 'vllm:prefix_cache_{kind}_total{{engine="{e}",model_name="m"}} {v}\n'

    def body(*engines: str) -> str:
        return "".join(line.format(kind=k, e=e, v=v) for e in engines for k, v in (("queries", 1000.0), ("hits", 500.0)))
    pub = published(run(body("0"), body("0", "1")))
    assert series(pub, "kvhit_hit_ratio") == {}
    reason = info(pub, "kvhit_unknown_info", "signal")["hit_ratio"]
    assert reason.startswith("the model's data-parallel engines changed inside the publish window"), reason


def test_physical_tpm_without_local_compute_counter_uses_the_window_hit_ratio():
    # vLLM < 0.16 (no prompt_tokens_by_source): the miss prompt tokens are prompt·(1 − h) of the
    # window (MODEL.md §3.4 physical). Δq = 1000, Δk = 400 (no connector: h_load 0) → h = 0.4;
    # Δprompt = 1000, Δgeneration = 100 over one 5-s step:
    #   delivered (1000 + 100)·60/5 = 13,200; physical (1000·0.6 + 100)·60/5 = 700·12 = 8,400
    a = V010.format(q=0.0, k=0.0, p=0.0, extra=PROMPTS.format(p=0.0, g=0.0))
    b = V010.format(q=1000.0, k=400.0, p=0.0, extra=PROMPTS.format(p=1000.0, g=100.0))
    pub = published(run(a, b))
    assert series(pub, "kvhit_hit_ratio")[(("model_name", "m"), ("source", "all"))] == pytest.approx(0.4)
    tpm = series(pub, "kvhit_tpm_tokens_per_minute")
    observed = {(dict(k)["kind"], dict(k)["per"]): v for k, v in tpm.items() if dict(k)["basis"] == "observed"}
    assert observed == pytest.approx({("delivered", "instance"): 13_200.0, ("physical", "instance"): 8_400.0,
                                      ("delivered", "gpu"): 13_200.0, ("physical", "gpu"): 8_400.0})


def test_zero_queries_in_the_window_is_no_data_not_zero_percent():
    body = SHORT.format(q=200.0, n=10.0, n20=10.0)
    pub = published(run(body, body))  # nothing happened: Δq = 0
    assert series(pub, "kvhit_hit_ratio") == {}
    unknown = info(pub, "kvhit_unknown_info", "signal")
    assert unknown["hit_ratio"] == "no prefix-cache queries in the publish window (no data, not 0 %)"
    # and no request finished: ISL unknown with its reason, not 0
    assert series(pub, "kvhit_isl_tokens") == {}
    assert unknown["isl"] == "no request finished in the publish window (no data, not 0)"


# --- restarts and histograms that lie ----------------------------------------------------------


def test_restart_inside_the_window_is_flagged_and_counted_from_zero():
    a = SHORT.format(q=5000.0, n=100.0, n20=100.0)
    b = SHORT.format(q=200.0, n=10.0, n20=10.0)  # restarted: 5000 → 200
    pub = published(run(a, b))
    assert "increase()" in info(pub, "kvhit_warning_info", "warning")["counter_reset"]
    # the increase is the current value: ISL = 200 / 10 = 20 (never (200 − 5000)/(10 − 100))
    assert series(pub, "kvhit_isl_tokens")[(("model_name", "m"),)] == pytest.approx(20.0)


TTFT = """\
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{le="0.001",model_name="m"}} {n}
vllm:time_to_first_token_seconds_bucket{{le="0.005",model_name="m"}} {n}
vllm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m"}} {n}
vllm:time_to_first_token_seconds_count{{model_name="m"}} {n}
vllm:time_to_first_token_seconds_sum{{model_name="m"}} {s}
"""


def test_ttft_sum_disagreeing_with_buckets_is_unknown_with_the_reason():
    # sample 01's shape (vLLM 0.5.1): every first token ≤ 1 ms by the buckets, but 208 more
    # observations added 104 s to _sum (mean 0.5 s, impossible under le=0.001)
    pub = published(run(TTFT.format(n=0.0, s=0.0), TTFT.format(n=208.0, s=104.0)))
    assert series(pub, "kvhit_observed_ttft_seconds") == {}
    assert info(pub, "kvhit_unknown_info", "signal")["observed_ttft"] == \
        "vllm:time_to_first_token_seconds: _sum disagrees with the buckets in the publish window"
    # nor is a P95 read from those buckets (0.95 ms was published beside a mean of 0.5 s), nor
    # the SLO pass ratio they would give (100 % under any TTFT SLO)
    assert not [k for k in series(pub, "kvhit_observed_p95_seconds") if ("quantity", "ttft") in k]
    assert info(pub, "kvhit_unknown_info", "signal")["observed_p95_ttft"] == \
        "vllm:time_to_first_token_seconds: _sum disagrees with the buckets in the publish window (which is wrong " \
        "cannot be told)"
    # a _sum the buckets allow (0.104 s ≤ 208 · 0.001): mean 0.104/208 = 0.0005 s
    pub = published(run(TTFT.format(n=0.0, s=0.0), TTFT.format(n=208.0, s=0.104)))
    assert series(pub, "kvhit_observed_ttft_seconds")[(("model_name", "m"),)] == pytest.approx(0.0005)


# --- cardinality --------------------------------------------------------------------------------


def models_body(names: list[str], engines: int = 2) -> str:
    lines = ["# TYPE vllm:prompt_tokens_total counter"]
    for name in names:
        for e in range(engines):
            lines.append(f'vllm:prompt_tokens_total{{engine="{e}",model_name="{name}"}} 10.0')
    return "\n".join(lines) + "\n"


def test_series_over_max_series_are_counted_logged_once_never_partial(caplog):
    body = models_body(["a", "b", "c", "d", "e"])  # 5 models × 2 engines = 10 (model, engine) series
    with caplog.at_level(logging.WARNING, logger="kvhit"):
        runner = run(body, body, body, max_series=5)
    # admitted by name while they fit: a (2), b (4); c would make 6 > 5 → c, d, e untracked: 6 series
    pub = published(runner)
    assert {dict(k)["model_name"] for k in series(pub, "kvhit_window_seconds")} == {"a", "b"}
    assert series(pub, "kvhit_untracked_series") == {(): 6.0}
    assert sum("max_series=5" in r.getMessage() for r in caplog.records) == 1  # logged once, 3 scrapes
    # a model keeps its slot; when "a" goes away its 2 series free room for "c"
    runner.ingest_text(T0 + 15, models_body(["b", "c", "d", "e"]))
    runner.ingest_text(T0 + 20, models_body(["b", "c", "d", "e"]))
    runner.clock = lambda: T0 + 20
    pub = published(runner)
    assert {dict(k)["model_name"] for k in series(pub, "kvhit_window_seconds")} == {"b", "c"}
    assert series(pub, "kvhit_untracked_series") == {(): 4.0}  # d and e: 2 × 2
    # default cap 64: 10 series are all analysed
    pub = published(run(body, body))
    assert series(pub, "kvhit_untracked_series") == {(): 0.0}
    assert len(series(pub, "kvhit_window_seconds")) == 5


# --- data-parallel engines in one exposition -----------------------------------------------------

DP = """\
# TYPE vllm:prompt_tokens_total counter
# TYPE vllm:generation_tokens_total counter
{lines}# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",engine="0",kv_offloading_size="None"}} 1.0
"""


def _dp(counts: dict[str, tuple[float, float]]) -> str:
    return DP.format(lines="".join(
        f'vllm:prompt_tokens_total{{engine="{e}",model_name="m"}} {p}\n'
        f'vllm:generation_tokens_total{{engine="{e}",model_name="m"}} {g}\n' for e, (p, g) in counts.items()))


def test_data_parallel_engines_divide_per_gpu_tpm_and_say_they_are_fitted_as_one_machine():
    # engine 0: +600 prompt, +60 generated; engine 1: +400, +40, in one 5-s step:
    # delivered TPM of the pod (1000 + 100)·60/5 = 13200; tp = pp = 1 and 2 engines → 2 GPUs: 6600 each
    pub = published(run(_dp({"0": (0.0, 0.0), "1": (0.0, 0.0)}), _dp({"0": (600.0, 60.0), "1": (400.0, 40.0)})))
    tpm = series(pub, "kvhit_tpm_tokens_per_minute")
    assert tpm[(("basis", "observed"), ("kind", "delivered"), ("model_name", "m"), ("per", "instance"))] \
        == pytest.approx(13200.0)
    assert tpm[(("basis", "observed"), ("kind", "delivered"), ("model_name", "m"), ("per", "gpu"))] \
        == pytest.approx(6600.0)
    assert info(pub, "kvhit_warning_info", "warning")["data_parallel"].startswith(
        "2 data-parallel engines in one exposition")
    # one engine doing all of it: the same pod TPM on 1 GPU, no warning
    pub = published(run(_dp({"0": (0.0, 0.0)}), _dp({"0": (1000.0, 100.0)})))
    tpm = series(pub, "kvhit_tpm_tokens_per_minute")
    assert tpm[(("basis", "observed"), ("kind", "delivered"), ("model_name", "m"), ("per", "gpu"))] \
        == pytest.approx(13200.0)
    assert "data_parallel" not in info(pub, "kvhit_warning_info", "warning")


def test_data_parallel_engines_divide_the_predicted_per_gpu_tpm_too():
    # The simulator's noise-free sweep served by two identical data-parallel engines (every
    # engine="0" series copied as engine="1"): the chip-time fit is ok and TPM is predicted.
    # MODEL.md §3.4: per GPU = per instance / (tp·pp × engines) = / (1·1·2), for the predicted
    # basis as for the observed one.
    from exporter.replay import TraceClock
    from exporter.simulate import generate, preset

    def two_engines(text: str) -> str:
        return text + "".join(ln.replace('engine="0"', 'engine="1"') + "\n" for ln in text.splitlines()
                              if 'engine="0"' in ln and not ln.startswith("vllm:cache_config_info"))

    sc = preset("sweep", noise=0.0)
    clock = TraceClock()
    runner = Runner(Config(interval=sc.interval), "sim", clock=clock)
    for t, text, _ in generate(sc):
        clock.t = t
        assert runner.ingest_text(t, two_engines(text))
    pub = published(runner)
    assert info(pub, "kvhit_warning_info", "warning")["data_parallel"].startswith("2 data-parallel engines")
    tpm = {(dict(k)["basis"], dict(k)["kind"], dict(k)["per"]): v
           for k, v in series(pub, "kvhit_tpm_tokens_per_minute").items()}
    for basis in ("observed", "predicted"):
        for kind in ("delivered", "physical"):
            assert tpm[(basis, kind, "instance")] > 0
            assert tpm[(basis, kind, "gpu")] == pytest.approx(tpm[(basis, kind, "instance")] / 2, rel=1e-12)



def _simulated_engines(scenario: str, engines: int, idle: int = 0, restart_at: float | None = None) -> Runner:
    """A runner fed the noise-free simulator ``scenario`` with every engine="0" sample line repeated
    for ``engines`` data-parallel engines, the last ``idle`` of them idle throughout (their first
    scrape's counters, no request running or waiting), the others identical; geometry and B_load
    the truth's. ``restart_at``: the engine restarts then [simulated s], one engine before it."""
    import re
    from dataclasses import replace

    from exporter.config import load_config
    from exporter.replay import TraceClock
    from exporter.simulate import SIM_GEOMETRY, Truth, generate, preset

    first: list[str] = []

    def body(text: str) -> str:
        lines = [ln for ln in text.splitlines() if 'engine="0"' in ln and not ln.startswith("vllm:cache_config_info")]
        first[:] = first or [re.sub(r"^(vllm:num_requests_(running|waiting)\{[^}]*\}) .*$", r"\1 0.0", ln)
                             for ln in lines]
        return text + "".join(ln.replace('engine="0"', f'engine="{e}"') + "\n" for e in range(1, engines)
                              for ln in (first if e >= engines - idle else lines))

    sc = preset(scenario, noise=0.0)
    if restart_at is not None:
        sc = replace(sc, restarts=(restart_at,))
    env = {f"KVHIT_MODEL_{k.upper()}": str(v) for k, v in SIM_GEOMETRY.items()}
    env["KVHIT_LOAD_BANDWIDTH_BYTES_PER_SECOND"] = str(Truth.load_bandwidth)
    runner = Runner(replace(load_config(None, environ=env), interval=sc.interval), "sim", clock=(clock := TraceClock()))
    restarted = restart_at is None
    for t, text, truth in generate(sc):
        clock.t = t
        restarted = restarted or (truth is not None and truth.restart)
        assert runner.ingest_text(t, body(text) if restarted else text)
    return runner


@pytest.mark.parametrize("idle", [0, 2])
def test_three_data_parallel_engines_give_one_engines_ttft_and_alpha(idle):
    # A request runs on one engine: its TTFT and the overlap α are one engine's, whatever E
    # (MODEL.md §3.2). The valley scenario ends held at h = 0.3 with the truth's ISL 2048,
    # h_load = 0.5·h, α = 0.5, S_kv 524288 B, B_load 12.5e9 B/s, T_step 1e-4 s, k_ffn 1e-4, k_attn
    # 1e-8: M = 1433.6, H = 614.4, T_compute = 1e-4·M + 1e-8·(M·H + M²/2) = 0.162444 s, T_load =
    # 0.15·2048·524288/12.5e9 = 0.012885 s; TTFT = T_step + T_compute + T_load − α·min = 0.168987 s.
    # At the target h = 0.9: M = 204.8, H = 1843.2, T_compute = 0.024465 s, T_load = 0.038655 s,
    # TTFT = 1e-4 + 0.024465 + 0.038655 − 0.5·0.024465 = 0.050987 s. (Before, the fit's coefficients
    # of the 3 engines as one machine, ⅓ of one's, gave α 0.64-0.84 and a TTFT ⅓-½ of these.)
    # With 2 of the 3 idle, the fit sees one busy engine: its coefficients are one engine's, as
    # they are (× 3 read α 0.31 and TTFTs 2x: review); the busy engines of each step decide.
    pub = published(_simulated_engines("valley", 3, idle))
    model = (("model_name", "sim-model"),)
    assert series(pub, "kvhit_overlap_ratio")[model] == pytest.approx(0.5, abs=0.01)
    ttft = series(pub, "kvhit_predicted_ttft_seconds")
    assert ttft[(("hit_ratio", "current"), ("kind", "service"), *model)] == pytest.approx(0.168987, rel=2e-3)
    assert ttft[(("hit_ratio", "target"), ("kind", "service"), *model)] == pytest.approx(0.050987, rel=2e-3)


def test_data_parallel_engines_keep_delta_and_the_capacity_counts_every_engine_busy_or_idle():
    # MODEL.md §3.3: δ = N·S_kv/(B_load·T0) is a ratio of one engine's times; with the truth's
    # N = 2048, S_kv = 32·32·128·2·2 = 524288 B, B_load = 12.5e9 B/s, T0 = k_ffn·N + k_attn·N²/2 =
    # 1e-4·2048 + 1e-8·2048²/2 = 0.22577 s: δ = 0.085899/0.22577 = 0.38047, one engine or two. Two
    # identical engines (each its own link) deliver twice: Θ(h) = Θ0/max(1 − h, δ·h_load) doubles.
    # (Before, T0 of the two as one machine, halved, met one link's B_load: δ read 2×, Θ's load bound ½×.)
    n = 2048.0
    delta = n * 524288.0 / (12.5e9 * (1e-4 * n + 1e-8 * n * n / 2.0))
    # Three engines, two idle throughout: the fit sees one busy engine, and the capacity at full
    # load is all three's: Θ and the predicted TPM 3× one engine's, per GPU one engine's, δ one
    # engine's (the busy engine's coefficients taken as the 3 engines' read δ/3, Θ and TPM 1×,
    # per-GPU TPM 1/3×: physics audit).
    bound, tpm, fixed, fitted = {}, {}, {}, {}
    for engines, idle in ((1, 0), (2, 0), (3, 2)):
        pub = published(runner := _simulated_engines("sweep", engines, idle))
        fitted[engines] = runner.current()[0].models["sim-model"]
        assert series(pub, "kvhit_load_compute_ratio")[(("model_name", "sim-model"),)] == pytest.approx(delta, rel=1e-3)
        bound[engines] = series(pub, "kvhit_capacity_bound_tokens_per_second")
        tpm[engines] = {k: v for k, v in series(pub, "kvhit_tpm_tokens_per_minute").items()
                        if ("basis", "predicted") in k}
        fixed[engines] = [series(pub, name)[(("model_name", "sim-model"),)]
                          for name in ("kvhit_fixed_time_seconds", "kvhit_fixed_time_stderr_seconds")]
    assert bound[1].keys() == bound[2].keys() == bound[3].keys() and len(bound[1]) == 2  # hit_ratio current, target
    for k, theta in bound[1].items():
        assert bound[2][k] == pytest.approx(2.0 * theta, rel=1e-6)
        assert bound[3][k] == pytest.approx(3.0 * theta, rel=1e-3)
    assert tpm[1].keys() == tpm[3].keys() and len(tpm[1]) >= 4  # delivered, physical × instance, gpu (× h)
    for k, v in tpm[1].items():
        assert tpm[3][k] == pytest.approx(v * (1.0 if ("per", "gpu") in k else 3.0), rel=1e-3), k
    # T_fixed of the 3 engines as one machine: a third of one engine's, its standard error too
    assert fixed[3] == pytest.approx([x / 3.0 for x in fixed[1]], rel=1e-3) and fixed[1][1] > 0
    # the fit's own coefficients (what the report's residuals predict busy steps with) are the one
    # busy engine's; calibrate's report gives T_fixed's error as published (it gave 3x)
    from exporter.calibrate import calibrated_parameters
    one, three = fitted[1].fitted, fitted[3].fitted
    assert three.fit_coefficients.as_tuple() == pytest.approx(one.coefficients.as_tuple(), rel=1e-3)
    assert calibrated_parameters(fitted[3])["t_fixed"]["stderr"] == pytest.approx(fixed[3][1], rel=1e-9)


def test_observed_tpm_is_carried_to_the_target_hit_ratio_by_the_hit_to_hit_correction():
    # MODEL.md §3.5: TPM_delivered(target) = TPM_delivered(h)·C(h)/C(target), C = P + D the chip
    # time per request; physical = delivered·(ISL·(1 − target) + OSL)/(ISL + OSL). By hand from the
    # simulator's truth (ISL 2048, OSL 128, k_ffn 1e-4, k_attn 1e-8, k_dec 1e-3): C(h) =
    # k_ffn·M + k_attn·(M·H + M²/2) + OSL·k_dec, M = (1 − h)·ISL, H = h·ISL; T_fixed (t_step 1e-4 × the
    # ~13 steps a request takes, < 1 % of C at both h) is left out of the hand value: rel 1 %.
    from dataclasses import replace

    from exporter.config import load_config
    from exporter.replay import TraceClock
    from exporter.simulate import generate, preset

    sc = preset("sweep", noise=0.0)
    runner = Runner(replace(load_config(None, environ={"KVHIT_TARGET_HIT_RATIO": "0.5"}), interval=sc.interval),
                    "sim", clock=(clock := TraceClock()))
    for t, text, _ in generate(sc):
        clock.t = t
        assert runner.ingest_text(t, text)
    pub = published(runner)
    tpm = {(dict(k)["basis"], dict(k)["kind"], dict(k)["per"]): v
           for k, v in series(pub, "kvhit_tpm_tokens_per_minute").items()}
    h = series(pub, "kvhit_hit_ratio")[(("model_name", "sim-model"), ("source", "all"))]
    assert h > 0.9  # the sweep ends in agentic traffic

    def chip(h: float) -> float:
        m, hit = (1 - h) * 2048.0, h * 2048.0
        return 1e-4 * m + 1e-8 * (m * hit + m * m / 2) + 128 * 1e-3

    delivered = tpm[("observed", "delivered", "instance")] * chip(h) / chip(0.5)
    assert tpm[("target", "delivered", "instance")] == pytest.approx(delivered, rel=1e-2)
    assert tpm[("target", "physical", "instance")] == pytest.approx(
        tpm[("target", "delivered", "instance")] * (2048 * 0.5 + 128) / (2048 + 128), rel=1e-12)
    assert tpm[("target", "delivered", "gpu")] == tpm[("target", "delivered", "instance")]  # tp = pp = 1, one engine

def test_lmcache_metrics_without_external_counters_make_loaded_hits_unknown_never_zero():
    # vLLM 0.10-shaped (no external_prefix_cache_*), cache_config_info without offloading, but
    # LMCache's own metrics in the body: a KV connector is in use, whose hits vLLM does not count.
    # Δq = 1000, Δk = 100: the device ratio 0.1 is known; loaded, and so the whole h, are not.
    lm = "# TYPE lmcache:num_hit_tokens_total counter\nlmcache:num_hit_tokens_total{{model_name=\"m\"}} {n}\n"
    a = V010.format(q=0.0, k=0.0, p=0.0, extra=lm.format(n=0.0))
    b = V010.format(q=1000.0, k=100.0, p=0.0, extra=lm.format(n=500.0))
    pub = published(run(a, b))
    h = series(pub, "kvhit_hit_ratio")
    assert h[(("model_name", "m"), ("source", "device"))] == pytest.approx(0.1)
    assert (("model_name", "m"), ("source", "all")) not in h and (("model_name", "m"), ("source", "loaded")) not in h
    assert info(pub, "kvhit_unknown_info", "signal")["hit_ratio_loaded"].startswith("LMCache metrics in the exposition")
    # the same body without LMCache: no connector, loaded hits are 0 and h = 0.1
    pub = published(run(V010.format(q=0.0, k=0.0, p=0.0, extra=""), V010.format(q=1000.0, k=100.0, p=0.0, extra="")))
    assert series(pub, "kvhit_hit_ratio")[(("model_name", "m"), ("source", "all"))] == pytest.approx(0.1)


def test_lmcache_metrics_naming_a_model_make_that_model_s_loaded_hits_unknown_not_the_others():
    # Two models of a vLLM 0.10 body, no offloading. LMCache's samples carry the model_name of the
    # model they serve (fleet mode renders them per model): only that model's loaded hits are
    # unknown, the other's are 0 (MODEL.md §2). LMCache naming none of vLLM's models (a path, as
    # LMCache names it in a pod) still says a connector serves the body: every model's are unknown.
    from exporter import parse
    two = V010.format(q=1000.0, k=100.0, p=0.0, extra="") + "\n".join(
        line.replace('model_name="m"', 'model_name="n"') for line in V010.format(q=1.0, k=0.0, p=0.0, extra="")
        .splitlines() if 'model_name="m"' in line) + "\n"
    lm = '# TYPE lmcache:num_hit_tokens counter\nlmcache:num_hit_tokens_total{{model_name="{m}",worker_id="0"}} 5.0\n'
    for named, unknown in (("n", {"n"}), ("/models/llama", {"m", "n"})):
        lines, truncated = parse._body_lines(two + lm.format(m=named))
        snaps = [parse._parse(lines, truncated, 0.0, read) for read in (parse._read_library, parse._read_lines)]
        assert repr(snaps[0]) == repr(snaps[1])  # both readers alike
        got = {m for m, sig in snaps[0].models.items() if "hit_ratio_loaded" in sig.unknown}
        assert got == unknown, (named, got)
        assert all(snaps[0].models[m].unknown["hit_ratio_loaded"].startswith("LMCache metrics") for m in unknown)


def test_fit_histories_of_churning_model_names_are_bounded_by_max_series():
    # names replaced every 2 scrapes, never more than 3 at once: each new name got its fitters'
    # preallocated buffers, kept 10 windows after it was gone (RSS 0.1 → 1.1 GB in the churn review)
    from exporter.analyzer import STATE_CAP_FACTOR
    runner = Runner(Config(max_series=4), "t", clock=lambda: 0.0)
    state = runner.analyzer._state

    def body(models, q):
        return "".join(f'vllm:prefix_cache_queries_total{{model_name="{m}"}} {q}\n'
                       f'vllm:prefix_cache_hits_total{{model_name="{m}"}} {q / 4}\n' for m in models)
    most = 0
    for i in range(60):
        churn = [f"lora-{i // 2}-{k}" for k in range(2)]
        assert runner.ingest_text(1000.0 + 5 * i, body(["base", *churn], 40.0 * (i + 1)))
        most = max(most, len(state))
    assert most == STATE_CAP_FACTOR * 4 == 8 and "base" in state
    # a model absent from one scrape keeps its history while the cap allows (a cut body)
    keep = state["base"]
    assert runner.ingest_text(1300.0, body(["other"], 10.0))
    assert runner.ingest_text(1305.0, body(["base", "other"], 40.0 * 62))
    assert state["base"] is keep


def test_a_fit_warming_up_keeps_one_unknown_info_series_while_its_count_moves_in_the_json():
    # kvhit_unknown_info's reason label leaves out what is measured this scrape (README): during
    # the chip-time fit's warm-up "N usable busy steps" grew by one per scrape, a new series each
    # (review: 10 per signal, 110 in 20 min). The count stays in /api/v1/analysis.
    from dataclasses import replace

    from exporter.config import load_config
    from exporter.replay import TraceClock
    from exporter.simulate import generate, preset

    sc = preset("sweep", noise=0.0)
    runner = Runner(replace(load_config(None, environ={}), interval=sc.interval), "sim", clock=(clock := TraceClock()))
    labels, reasons = set(), set()
    for t, text, _ in itertools.islice(generate(sc), 8):
        clock.t = t
        assert runner.ingest_text(t, text)
        labels |= {dict(k)["reason"] for k in series(published(runner), "kvhit_unknown_info") if
                   dict(k)["signal"] == "predicted_current"}
        model = runner.analyzer.analysis().models.get("sim-model")  # none at the first scrape: no step yet
        if model is not None:
            reasons.add(model.unknown["predicted_current"])
    assert labels == {"needs the chip-time fit, which is insufficient_data: too few usable busy steps, need at least 10"}
    assert len(reasons) >= 5 and all(r.endswith(" steps)") for r in reasons), reasons


def test_a_restart_into_more_engines_starts_the_fits_afresh():
    # One engine, then a restart as two identical data-parallel engines (a changed
    # --data-parallel-size): the one-engine steps are another machine's. Two identical engines
    # deliver twice one's at full load (the test above): the predicted TPM must be twice the
    # one-engine run's at the same h (it read 1.4x with the one-engine rows kept: a review).
    one = published(_simulated_engines("sweep", 1))
    both = published(runner := _simulated_engines("sweep", 2, restart_at=100.0))
    tpm = [{k: v for k, v in series(pub, "kvhit_tpm_tokens_per_minute").items()
            if ("basis", "predicted") in k and ("per", "instance") in k} for pub in (one, both)]
    assert tpm[0].keys() == tpm[1].keys() and len(tpm[0]) >= 2
    for k, v in tpm[0].items():
        assert tpm[1][k] == pytest.approx(2.0 * v, rel=1e-3), k
    # every row the chip-time fit holds is from after the restart: the trace's 420 s, 100 s before
    # it, at a 5 s interval hold at most 64 steps after it
    assert runner.analyzer._state["sim-model"].chip.result().samples <= (420 - 100) / 5


def test_output_grown_eightfold_withholds_the_old_direct_slope_and_keeps_the_derived_one():
    # The audit's engine: trained over h in [0, 0.95] at OSL 128 (a = 0.5), then its output grows
    # to 1024 tokens with h held at 0.6 (a = 0.855 by the simulator's true line at OSL 1024). The
    # old direct line stayed published as ok (0.51 ± 0.002) with every new step flagged a tail-chunk
    # dip; the new traffic's bucket cannot tell its own line at one h, so the direct slope is
    # withheld, and the derived one, the chip-time model's at the current ISL and OSL, is drawn
    # over the h range of the steps kvhit holds.
    from dataclasses import replace

    from exporter.config import Geometry, Prices
    from exporter.replay import TraceClock
    from exporter.simulate import Engine, Scenario, Segment, Truth, calibrate_truth, true_line

    before = calibrate_truth(replace(Truth(), alpha=0.5, load_share=0.5), 0.5)
    after = replace(before, osl=1024.0)
    levels = (0.0, 0.8, 0.2, 0.6, 0.4, 0.95, 0.1, 0.7, 0.3, 0.9, 0.5)
    train = tuple(Segment("step", 60.0, levels[i % len(levels)]) for i in range(30))
    sc = Scenario(truth=before, schedule=train + (Segment("step", 1260.0, 0.6),), noise=0.02, seed=1)
    cfg = Config(window_seconds=60, interval=5, model=Geometry(layers=32, kv_heads=32, head_dim=128),
                 load_bandwidth_bytes_per_second=before.load_bandwidth, prices=Prices(hit_price_ratio=0.1))
    clock = TraceClock()
    runner = Runner(cfg, "sim", clock=clock)
    engine = Engine(sc)
    clock.t = sc.start
    runner.ingest_text(sc.start, engine.exposition())
    for i in range(1, 30 * 12 + 20 * 12 + 1):  # 30 windows of training, 20 after the change
        if i == 30 * 12 + 1:
            engine.sc = replace(engine.sc, truth=after)
        st = engine.advance()
        clock.t = st.t
        runner.ingest_text(st.t, engine.exposition())
    pub = published(runner)
    slopes = {dict(k)["method"]: v for k, v in series(pub, "kvhit_miss_slope").items()}
    assert "direct" not in slopes
    assert slopes["derived"] == pytest.approx(true_line(after, 0.95)[1], abs=0.01)
    assert {dict(k)["fit"]: dict(k)["status"] for k, v in series(pub, "kvhit_fit_status").items()
            if v == 1}["miss_slope"] == "insufficient_variation"
    # no direct slope published: no bucket bounds; the derived line's h range is the training's
    assert not series(pub, "kvhit_miss_slope_osl_bucket_tokens")
    span = {dict(k)["bound"]: v for k, v in series(pub, "kvhit_miss_slope_hit_ratio").items()}
    assert span["lower"] == pytest.approx(0.0, abs=0.01) and span["upper"] == pytest.approx(0.95, abs=0.01)
