"""Step / window deltas → :class:`fitters.observation.Observation` (MODEL.md §2, §7).

The mapping from vLLM counters to the model's variables lives here, once:
Δq = Δqueries, Δk = Δhits, Δe = Δexternal hits; ΔM = Δq − Δk − Δe (computed prompt tokens);
ΔW_attn = n·(M̄·H̄ + M̄²/2) with n = Δq/ISL; ΔC_dec = ΔG·(ISL + OSL/2); busy when both scrapes
show running requests and the engine stepped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from exporter.window import Delta
from fitters.model import attention_work, decode_context_per_token, hits_exceed
from fitters.observation import Observation


@dataclass(frozen=True)
class Context:
    """What a delta alone does not say, from the snapshot and earlier steps.

    Attributes:
        hit_unit: "tokens" or "blocks" (0.7–0.8 counters); blocks are converted by block_size.
        block_size: tokens per KV block from ``cache_config_info`` (None when absent).
        unknown: signal → reason from the parser (e.g. "hit_ratio", "hit_ratio_loaded").
        isl, osl: latest known mean prompt/output length [tokens], used when no request
            finished inside the step.
        excludes_preempted: the exposition proves a vLLM whose prefix-cache counters leave
            resumed preempted requests out (parse.Snapshot.excludes_preempted of the model).
        unobserved: scrapes failed inside the step: whether the engine worked through all of its
            time is unknown (stopped, frozen, cut off), so it is never busy time (MODEL.md §7).
    """

    hit_unit: str = "tokens"
    block_size: float | None = None
    unknown: Mapping[str, str] | None = None
    isl: float | None = None
    osl: float | None = None
    excludes_preempted: bool = False
    unobserved: bool = False


ISL_HISTOGRAM = "request_prompt_tokens"
OSL_HISTOGRAM = "request_generation_tokens"


def request_isl(delta: Delta, ctx: Context) -> float | None:
    """ISL [tokens]: the mean prompt length of the requests finished in the delta; when none
    finished, Δprompt_tokens / Δcount of the TTFT histogram, the requests whose first token came
    in it (vLLM counts a prompt's tokens in the step of its first token, as it observes its TTFT);
    else ``ctx.isl`` (:func:`_mean_or_recent`). A burst of longer prompts read the ISL of the
    traffic before it until one of them finished, and so did a restarted engine's first steps."""
    started = None
    prompt, ttft = delta.counters.get("prompt_tokens"), delta.histograms.get("ttft")
    if prompt is not None and ttft is not None and ttft.count > 0 and prompt > 0:
        started = prompt / ttft.count
    return _mean_or_recent(delta, ISL_HISTOGRAM, started or ctx.isl)


def request_osl(delta: Delta, ctx: Context) -> float | None:
    """OSL [tokens]: the mean output length of the requests finished in the delta, else ``ctx.osl``
    (:func:`_mean_or_recent`)."""
    return _mean_or_recent(delta, OSL_HISTOGRAM, ctx.osl)


def _mean_or_recent(delta: Delta, hist: str, recent: float | None) -> float | None:
    """The mean of histogram ``hist`` over the delta; ``recent`` (the latest known mean) when no
    request finished in it; None when the histogram is missing or inconsistent there (dropped as
    NaN, cut from a body): a length kvhit can no longer read is unknown, not the last one it read,
    however old."""
    h = delta.histograms.get(hist)
    if h is None:
        return None
    return h.mean if h.count > 0 else recent


def histogram_mean(delta: Delta, hist: str) -> float | None:
    """Δsum/Δcount of histogram ``hist`` over the delta, the mean of the observations in it [the
    histogram's unit: tokens for request lengths, seconds for times]; None when unknown
    (:attr:`~exporter.window.HistogramDelta.mean`)."""
    h = delta.histograms.get(hist)
    return None if h is None else h.mean


def hit_tokens(delta: Delta, ctx: Context) -> tuple[float | None, float | None, float | None]:
    """(Δqueried, Δdevice hits, Δloaded hits) in tokens; None = unknown (MODEL.md §2).

    Loaded hits are 0 only when the engine has no connector/offload (no reason in
    ``ctx.unknown``); block counts are scaled by the block size, unknown without it.
    """
    q, k, e = _hit_tokens(delta, ctx)
    return (None, None, None) if _exceed(q, k, e) else (q, k, e)


def hit_sums(delta: Delta, ctx: Context) -> tuple[float, float] | None:
    """(Δqueried, Δhits device + loaded) [tokens] as read, hits above queries too (a torn read,
    which the 24 h rollup groups with its neighbours: fitters.caching.HitRollup); None when either
    is unknown (:func:`hit_tokens`' scaling and rules)."""
    q, k, e = _hit_tokens(delta, ctx)
    return None if q is None or k is None or e is None else (q, k + e)


def hit_problem(delta: Delta, ctx: Context) -> str:
    """Why the delta's hit counts, although present, cannot be used ("" when they can).

    Hits (device + loaded) above queries are impossible: a corrupted or mixed-up counter, never
    a hit ratio above 1 (issue 7).
    """
    if _exceed(*_hit_tokens(delta, ctx)):
        return "prefix-cache hits exceed queries over the interval (inconsistent counters): no hit ratio"
    return ""


def _exceed(q: float | None, k: float | None, e: float | None) -> bool:
    # q = 0 too: hits with no query (a glitched hit counter in an idle step) are no 0/0 to skip; they
    # reached the 24-h rollup as a hit ratio of 540,000 (a review)
    return q is not None and hits_exceed(q, (k or 0.0) + (e or 0.0))


def _hit_tokens(delta: Delta, ctx: Context) -> tuple[float | None, float | None, float | None]:
    unknown = ctx.unknown or {}
    if "hit_ratio" in unknown:
        return None, None, None
    q, k = delta.counters.get("queries"), delta.counters.get("hits")
    scale = 1.0
    if ctx.hit_unit == "blocks":
        if ctx.block_size is None:
            return None, None, None
        scale = ctx.block_size
    q = None if q is None else q * scale
    k = None if k is None else k * scale
    if "external_hits" in delta.counters:
        e = delta.counters["external_hits"]
    else:  # 0 only where the engine exports no such counter, never where one went missing
        e = None if "hit_ratio_loaded" in unknown or "external_hits" in delta.partial else 0.0
    return q, k, e


def observe(delta: Delta, ctx: Context) -> Observation:
    """Build the :class:`Observation` of one step (or window) delta (MODEL.md §7).

    ISL/OSL are the means of requests finished in the delta, else ``ctx.isl``/``ctx.osl`` when
    none finished (unknown when their histogram is missing: :func:`_mean_or_recent`).
    Raises nothing: unknown inputs become None fields.
    """
    q, k, e = hit_tokens(delta, ctx)
    isl = request_isl(delta, ctx)
    osl = request_osl(delta, ctx)
    g = delta.counters.get("generation_tokens")  # None = unknown, never 0
    steps_h = delta.histograms.get("iteration_tokens")
    steps = steps_h.count if steps_h is not None else None  # unknown, never 0 (physics review)

    miss = attn = None
    if q is not None and k is not None and e is not None:
        miss = max(0.0, q - k - e)
        if q == 0 and _decode_only(delta, k, e):  # no attention work, whatever the ISL (such a step,
            # which pins k_dec, k_ctx and T_step, was dropped from the chip-time fit)
            attn = 0.0
        elif q > 0 and isl:
            h = (k + e) / q
            attn = (q / isl) * attention_work(isl, h)
    elif "prompt_local_compute" in delta.counters:
        miss = delta.counters["prompt_local_compute"]
    ctx_tokens = None
    if g is not None and isl is not None and osl is not None:
        ctx_tokens = g * decode_context_per_token(isl, osl)

    r0, r1 = delta.start.get("running"), delta.end.get("running")
    busy = bool(r0 and r1 and r0 > 0 and r1 > 0 and steps and steps > 0 and delta.resets == 0 and not ctx.unobserved)
    prefill = delta.histograms.get("prefill_time")
    ttft = delta.histograms.get("ttft")
    hint = ""
    if delta.resets:
        hint = "counter reset"
    elif delta.counters.get("preemptions", 0.0) > 0 and not _excludes_preempted(delta, ctx):
        hint = "preemptions inflate prefix-cache hits before vLLM 0.11.1"
    return Observation(
        t=delta.t1,
        dt=delta.dt,
        busy=busy,
        steps=steps,
        queried_tokens=q,
        hit_tokens_device=k,
        hit_tokens_loaded=e,
        miss_tokens=miss,
        attention_work=attn,
        generation_tokens=g,
        decode_context_tokens=ctx_tokens,
        isl=isl,
        osl=osl,
        requests_finished=prefill.count if prefill is not None else 0.0,
        prefill_time_mean=histogram_mean(delta, "prefill_time"),
        queue_time_mean=histogram_mean(delta, "queue_time"),
        ttft_mean=histogram_mean(delta, "ttft"),
        ttft_count=ttft.count if ttft is not None else 0.0,
        running=None if delta.running_seconds is None or delta.dt <= 0 else delta.running_seconds / delta.dt,
        waiting=delta.end.get("waiting"),
        anomaly_hint=hint,
    )


def _decode_only(delta: Delta, k: float, e: float) -> bool:
    """Whether a step without prefix-cache queries did no prefill either: vLLM queries a request
    once, when first scheduled, so a chunked prefill's tail (prompt tokens and a first token),
    a resumed preempted request (≥ 0.11.1 leaves it out of the queries) and hits without queries
    all have Δq = 0 with prefill work in them (review). Needs prompt_tokens; TTFT and
    preemptions when exported (a preemption count unknown for the step: not decode-only)."""
    ttft = delta.histograms.get("ttft")
    return (k == 0 and e == 0 and delta.counters.get("prompt_tokens") == 0 and (ttft is None or ttft.count == 0)
            and delta.counters.get("preemptions", 0.0) == 0 and "preemptions" not in delta.partial)


def cache_config_number(cache_config: Mapping[str, str], key: str) -> float | None:
    """Label ``key`` of ``cache_config_info`` as a finite number > 0 (block_size, num_gpu_blocks,
    kv_cache_size_tokens); None when absent or anything else ("None", "auto", 0)."""
    try:
        v = float(cache_config.get(key, "None"))
    except ValueError:
        return None
    return v if math.isfinite(v) and v > 0 else None


def kv_capacity_tokens(cache_config: Mapping[str, str], gauges: Mapping[str, float]) -> float | None:
    """KV pool size [tokens] per data-parallel engine (MODEL.md §3.6, seed 004 §3.3).

    vLLM ``cache_config_info``: ``kv_cache_size_tokens`` where present (0.2x+), else
    ``num_gpu_blocks`` × ``block_size`` (labels of engine 0; llm-d-inference-sim exports only
    these two); SGLang: the ``max_total_num_tokens`` gauge. None when none is a number.
    """
    size = cache_config_number(cache_config, "kv_cache_size_tokens")
    if size is not None:
        return size
    blocks, block = cache_config_number(cache_config, "num_gpu_blocks"), cache_config_number(cache_config, "block_size")
    if blocks is not None and block is not None and math.isfinite(blocks * block):  # 1e200 × 1e200: no size
        return blocks * block
    cap = gauges.get("kv_capacity_tokens")
    return cap if cap is not None and math.isfinite(cap) and cap > 0 else None


def _excludes_preempted(delta: Delta, ctx: Context) -> bool:
    """vLLM ≥ 0.11.1 no longer counts resumed preempted requests as prefix-cache queries/hits
    (vllm PR #25787); its external-hit counters are newer still."""
    return "external_hits" in delta.counters or ctx.excludes_preempted


def window_notes(w: Delta, ctx: Context, hit: Mapping[str, float], isl: float | None) -> dict[str, str]:
    """Caveats of a publish window's values, and why its absent means are absent (issue 7).

    Returns warning → reason for values that are published but need a caveat
    (``kvhit_warning_info``): ``counter_reset`` (the engine restarted inside the window; increases
    count from zero), ``hit_unit_blocks`` (vLLM 0.7–0.8: block-level hit ratio),
    ``preemptions`` (before vLLM 0.11.1 resumed requests count again as hits: h inflated),
    ``short_prompts`` (h exactly 0 with mean ISL ≤ block_size: vLLM caches whole blocks and never
    the last prompt token, so such prompts cannot hit; ``isl``: the window's mean ISL [tokens]).
    """
    warnings: dict[str, str] = {}
    if w.resets:
        warnings["counter_reset"] = ("the engine restarted inside the publish window (every _created changed, or a "
                                     "counter went down where none is exported): increases count from zero, as "
                                     "Prometheus increase()")
    if hit and ctx.hit_unit == "blocks":
        warnings["hit_unit_blocks"] = ("vLLM 0.7-0.8 counts prefix-cache queries and hits in KV blocks (HELP text): "
                                       "the hit ratio is block-level, token counts are blocks x block_size")
    if hit and w.counters.get("preemptions", 0.0) > 0 and not _excludes_preempted(w, ctx):
        warnings["preemptions"] = ("preemptions in the publish window on vLLM < 0.11.1: resumed requests are "
                                   "counted again as prefix-cache queries and hits, the hit ratio is inflated")
    h = hit.get("all", hit.get("device"))
    if h == 0.0 and ctx.block_size and isl is not None and isl <= ctx.block_size:
        warnings["short_prompts"] = ("hit ratio 0 with prompts no longer than one KV block (mean ISL <= block_size "
                                     "of cache_config_info): vLLM caches whole blocks and never the last prompt "
                                     "token, so these prompts cannot hit")
    return warnings
