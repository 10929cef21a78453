"""Ground-truth simulator: a vLLM-V1-format ``/metrics`` whose counters follow MODEL.md with KNOWN
parameters (issue 6).

The engine simulated is exactly the contract kvhit fits, so every fitted number has a true value
to be compared with:

* Chip time (MODEL.md §7): the engine is busy the whole scrape interval; the work it does in
  Δt is ``n`` requests with Δt = n·t_chip(h)·(1 + ε_busy), where per request
  t_chip(h) = T_step·s + k_ffn·M + k_attn·(M·H + M²/2) + OSL·(k_dec + k_ctx·(ISL + OSL/2)),
  M = (1−h)·ISL, H = h·ISL, and s = OSL/running + 1 engine steps per request (each step decodes
  every running request once, plus one prefill step): T_fixed = T_step·s.
* Hits (MODEL.md §2): Δqueries = n·ISL, Δhits (device) = (h − h_load)·Δq, external hits
  (loaded, KV connector / offload) = h_load·Δq with h_load = ``load_share``·h; external queries
  cover what the local cache missed.
* Latency (MODEL.md §3.2 and the load-aware layer of §7): per request
  prefill = c(running)·(T_step + T_compute(h)) + T_load − α·min(T_load, T_compute),
  c = c0 + c1·running, T_load = h_load·ISL·S_kv / B_load; TTFT = queue + prefill; the window
  means carry multiplicative noise ε_lat.
* Tail-chunk dips (MODEL.md §4): at the listed hit ratios (±0.005) the step does ``depth`` less
  work — TPS_miss falls far below the line — and those steps are not the model (anomalies).
* Engine restarts: every counter and histogram restarts from 0 with a new ``_created``.

Measurement noise is Gaussian, relative (``noise`` = σ), seeded: the same :class:`Scenario` gives
the same texts. :func:`generate` yields ``(timestamp, text, truth)`` at simulated times (no
sleeping: benchmarks feed ``Runner.ingest_text`` directly); :func:`serve` serves the same
sequence on 127.0.0.1 in real time (``kvhit simulate``).

Choices where MODEL.md is silent: token counters are continuous (rendered with 6 significant
decimals), finished-request counts are integers (fractional requests carried to the next
scrape); every request of a step has the same ISL, OSL and h, so each histogram's observations
of a step fall into one bucket; num_requests_running is the schedule's concurrency, waiting is 0.
A request's decode is OSL engine steps of the batch; its inter-token latency (OSL − 1 per request)
and per-request TPOT are one such step, decode / OSL (vLLM ≥ 0.11 names, its bucket edges).
"""
from __future__ import annotations

import bisect
import math
import random
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterator

from exporter.config import (MAX_INTERVAL, MIN_INTERVAL, ConfigError, Prices, bounded, listen_address, listening,
                             stop_event)
from fitters.model import attention_work, decode_context_per_token, kv_bytes_per_token, max_hit_ratio

# Bucket edges as vLLM 0.32 exports them (tests/data/samples/25_*).
_TIME_EDGES = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
_TTFT_EDGES = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_EDGES = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0,
                50000.0, 100000.0)
_TPOT_EDGES = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITER_EDGES = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0)


# kvhit's model.* keys of the default truth's S_kv (Llama-2-7B fp16, tp 1).
SIM_GEOMETRY = {"layers": 32, "kv_heads": 32, "head_dim": 128, "dtype_bytes": 2}


@dataclass(frozen=True)
class Truth:
    """The simulated engine's known parameters (MODEL.md §1 symbols).

    t_step [s/step], k_ffn [s/token], k_attn [s/token²], k_dec [s/token], k_ctx [s/(token·token)];
    isl, osl [tokens]; c0, c1: contention c = c0 + c1·running [1, 1/request]; alpha [1];
    kv_bytes_per_token S_kv [bytes]; load_bandwidth B_load [bytes/s]; load_share: h_load/h [1];
    queue_seconds: mean queue time [s].
    """

    t_step: float = 0.0001
    k_ffn: float = 1.0e-4
    k_attn: float = 1.0e-8
    k_dec: float = 1.0e-3
    k_ctx: float = 0.0
    isl: float = 2048.0
    osl: float = 128.0
    c0: float = 1.0
    c1: float = 0.05
    alpha: float = 0.5
    kv_bytes_per_token: float = kv_bytes_per_token(**SIM_GEOMETRY, tp=1)  # Llama-2-7B fp16 (MODEL.md §3.6)
    load_bandwidth: float = 12.5e9
    load_share: float = 0.5
    queue_seconds: float = 0.05

    def steps_per_request(self, running: float) -> float:
        return self.osl / max(running, 1.0) + 1.0

    def t_fixed(self, running: float) -> float:
        """T_fixed = T_step × steps per request [s] (MODEL.md §7)."""
        return self.t_step * self.steps_per_request(running)

    def compute_time(self, h: float, isl: float | None = None) -> float:
        n = self.isl if isl is None else isl
        return self.k_ffn * (1.0 - h) * n + self.k_attn * attention_work(n, h)

    def decode_time(self) -> float:
        return self.osl * (self.k_dec + self.k_ctx * decode_context_per_token(self.isl, self.osl))

    def t_chip(self, h: float, running: float) -> float:
        """Per-request chip time t_chip(h) [s] (MODEL.md §7)."""
        return self.t_fixed(running) + self.compute_time(h) + self.decode_time()

    def miss_tps(self, h: float, running: float) -> float:
        """Noise-free TPS_miss(h) = M / t_chip(h) [tokens/s] (MODEL.md §4, chip_time form)."""
        return (1.0 - h) * self.isl / self.t_chip(h, running)

    def load_time(self, h: float) -> float:
        return self.load_share * h * self.isl * self.kv_bytes_per_token / self.load_bandwidth

    def prefill_latency(self, h: float, running: float) -> float:
        """Per-request prefill latency [s] (MODEL.md §3.2 with the §7 load-aware layer)."""
        t_load, t_comp = self.load_time(h), self.compute_time(h)
        return (self.c0 + self.c1 * running) * (self.t_step + t_comp) + t_load - self.alpha * min(t_load, t_comp)

    def ttft(self, h: float, running: float) -> float:
        """True mean TTFT [s]: queue + prefill latency."""
        return self.queue_seconds + self.prefill_latency(h, running)

    def revenue(self, h: float, running: float, p_miss: float, rho: float) -> float:
        """R(h) per machine-second, chip_time form with no output price (MODEL.md §4)."""
        return p_miss * self.isl * ((1.0 - h) + rho * h) / self.t_chip(h, running)


@dataclass(frozen=True)
class Segment:
    """One piece of the hit-ratio schedule.

    kind: "step" (h = h0), "ramp" (h0 → h1 linearly), "diurnal" (h0 + (h1−h0)·(1−cos 2πt/period)/2),
    "agentic" (h drawn in [h0, h1] per scrape: 90 %+ traffic jitter); duration [s].
    """

    kind: str
    duration: float
    h0: float
    h1: float | None = None
    period: float = 86400.0

    @property
    def h_end(self) -> float:
        """h1, or h0 for a segment that has none (a step)."""
        return self.h0 if self.h1 is None else self.h1


@dataclass(frozen=True)
class Scenario:
    """What to simulate: the truth, the schedule and the bad days.

    interval: seconds between scrapes; noise: relative σ of busy time and latency means;
    running: (low, high) concurrency, drawn per scrape; dips: ((h, depth), ...) tail-chunk dips;
    restarts: simulated seconds after start at which the engine restarts; seed: RNG seed;
    start: unix time of the first scrape; model_name, engine label.
    """

    truth: Truth = field(default_factory=Truth)
    schedule: tuple[Segment, ...] = (Segment("ramp", 600.0, 0.0, 0.95),)
    interval: float = 5.0
    noise: float = 0.02
    running: tuple[float, float] = (6.0, 14.0)
    dips: tuple[tuple[float, float], ...] = ()
    restarts: tuple[float, ...] = ()
    seed: int = 0
    start: float = 1_800_000_000.0
    model_name: str = "sim-model"
    engine: str = "0"

    @property
    def duration(self) -> float:
        return sum(s.duration for s in self.schedule)

    @property
    def h_max(self) -> float:
        """The highest scheduled h: kvhit fits its miss line over [h_min, h_max] (:func:`true_line`)."""
        return max(max(s.h0, s.h_end) for s in self.schedule)

    @property
    def h_min(self) -> float:
        """The lowest scheduled h (MODEL.md §4: a is the slope over the h range traffic spans)."""
        return min(min(s.h0, s.h_end) for s in self.schedule)

    def hit_ratio(self, t: float, rng: random.Random | None = None) -> float:
        """Scheduled h at ``t`` seconds after start."""
        for seg in self.schedule:
            if t < seg.duration or seg is self.schedule[-1]:
                h1 = seg.h_end
                u = min(1.0, max(0.0, t / seg.duration)) if seg.duration > 0 else 1.0
                if seg.kind == "step":
                    return seg.h0
                if seg.kind == "ramp":
                    return seg.h0 + (h1 - seg.h0) * u
                if seg.kind == "diurnal":
                    return seg.h0 + (h1 - seg.h0) * (1.0 - math.cos(2 * math.pi * t / seg.period)) / 2.0
                if seg.kind == "agentic":
                    return (rng or random).uniform(seg.h0, h1)
                raise ValueError(f"unknown segment kind {seg.kind!r}")
            t -= seg.duration
        return self.schedule[-1].h0


@dataclass(frozen=True)
class StepTruth:
    """What really happened between two scrapes (for benchmarks and tests)."""

    t: float
    dt: float
    h: float
    h_load: float
    running: float
    requests: float  # n, fractional
    miss_tps: float  # noise-free M/t_chip at this running
    dip: float  # tail-chunk depth applied (0 = none)
    restart: bool


class _Hist:
    def __init__(self, edges: tuple[float, ...]) -> None:
        self.edges = edges
        self.counts = [0] * (len(edges) + 1)
        self.sum = 0.0

    def observe(self, value: float, n: int) -> None:
        if n <= 0:
            return
        self.counts[bisect.bisect_left(self.edges, value)] += n
        self.sum += value * n

    def lines(self, name: str, labels: str) -> list[str]:
        out, cum = [], 0
        for le, c in zip(self.edges + (math.inf,), self.counts):
            cum += c
            edge = "+Inf" if math.isinf(le) else repr(float(le))
            out.append(f'{name}_bucket{{{labels},le="{edge}"}} {float(cum)!r}')
        out.append(f"{name}_count{{{labels}}} {float(cum)!r}")
        out.append(f"{name}_sum{{{labels}}} {self.sum!r}")
        return out


_COUNTERS = (
    ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    ("external_prefix_cache_queries", "External prefix cache queries from KV connector cross-instance cache "
                                      "sharing, in terms of number of queried tokens."),
    ("external_prefix_cache_hits", "External prefix cache hits from KV connector cross-instance cache sharing, "
                                   "in terms of number of cached tokens."),
    ("prompt_tokens", "Number of prefill tokens processed."),
    ("generation_tokens", "Number of generation tokens processed."),
    ("num_preemptions", "Cumulative number of preemption from the engine."),
    ("request_success", "Count of successfully processed requests."),
)
_HISTS = (
    ("iteration_tokens_total", "Histogram of number of tokens per engine_step.", _ITER_EDGES),
    ("request_prompt_tokens", "Number of prefill tokens processed.", _TOKEN_EDGES),
    ("request_generation_tokens", "Number of generation tokens processed.", _TOKEN_EDGES),
    ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", _TTFT_EDGES),
    ("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", _TIME_EDGES),
    ("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", _TIME_EDGES),
    ("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", _TIME_EDGES),
    ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", _TIME_EDGES),
    ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", _TPOT_EDGES),
    ("request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.", _TPOT_EDGES),
)


class Engine:
    """The simulated engine's state: cumulative counters and histograms (one model, one engine)."""

    def __init__(self, scenario: Scenario, wall: Callable[[], float] | None = None) -> None:
        self.sc = scenario
        self.rng = random.Random(scenario.seed)
        self.t = 0.0  # seconds since start
        self.running = self._draw_running()
        self._restart_at = sorted(scenario.restarts)
        # what stamps _created: the simulated clock, or (served live) the wall clock, as a real
        # engine's, whatever --speed is, so kvhit reads a start and each restart as one
        self._wall = wall
        self._reset(self._created_at(0.0))

    def _created_at(self, t: float) -> float:
        """The ``_created`` stamp of a (re)start ``t`` simulated seconds after the start [unix s]."""
        return self.sc.start + t if self._wall is None else self._wall()

    def _reset(self, now: float) -> None:
        self.created = now
        self.counters = {name: 0.0 for name, _ in _COUNTERS}
        self.hists = {name: _Hist(edges) for name, _, edges in _HISTS}
        self.carry = 0.0  # fractional finished requests not yet counted

    def _draw_running(self) -> float:
        lo, hi = self.sc.running
        return float(round(self.rng.uniform(lo, hi))) if hi > lo else float(lo)

    def advance(self) -> StepTruth:
        """Advance one scrape interval; returns what happened in it."""
        sc, tr, rng = self.sc, self.sc.truth, self.rng
        dt = sc.interval
        t_mid = self.t + dt / 2.0
        h = min(max(sc.hit_ratio(t_mid, rng), 0.0), max_hit_ratio(tr.isl))
        restart = bool(self._restart_at and self._restart_at[0] <= self.t + dt)
        if restart:
            self._restart_at.pop(0)
            self._reset(self._created_at(self.t + dt / 2.0))
            dt_work = dt / 2.0  # the engine came back half-way through the interval
        else:
            dt_work = dt
        r0, r1 = self.running, self._draw_running()
        running = (r0 + r1) / 2.0
        self.running = r1
        dip = next((d for hd, d in sc.dips if abs(h - hd) <= 0.005), 0.0)
        t_chip = tr.t_chip(h, running)
        eps = rng.gauss(0.0, sc.noise)
        n = dt_work / (t_chip * max(0.2, 1.0 + eps)) * (1.0 - dip)
        h_load = tr.load_share * h
        q = n * tr.isl
        c = self.counters
        c["prefix_cache_queries"] += q
        c["prefix_cache_hits"] += (h - h_load) * q
        c["external_prefix_cache_queries"] += (1.0 - (h - h_load)) * q
        c["external_prefix_cache_hits"] += h_load * q
        c["prompt_tokens"] += q
        g = n * tr.osl
        c["generation_tokens"] += g
        steps = n * tr.steps_per_request(running)
        # finished requests (integers) carry the latency observations
        self.carry += n
        done = int(self.carry)
        self.carry -= done
        c["request_success"] += done
        hs = self.hists
        tokens_per_step = (q * (1.0 - h) + g) / steps if steps > 0 else 0.0
        k = int(round(steps))
        hs["iteration_tokens_total"].observe(tokens_per_step, k)
        hs["request_prompt_tokens"].observe(tr.isl, done)
        hs["request_generation_tokens"].observe(tr.osl, done)
        if done:
            noise = max(0.2, 1.0 + rng.gauss(0.0, sc.noise))
            prefill = tr.prefill_latency(h, running) * noise
            queue = tr.queue_seconds * max(0.2, 1.0 + rng.gauss(0.0, sc.noise))
            # OSL engine steps of the batch, each its share of the chip time: the steps of a busy
            # second carry exactly that second (decode ≥ the request's own decode chip time)
            decode = tr.osl * t_chip / tr.steps_per_request(running)
            hs["request_prefill_time_seconds"].observe(prefill, done)
            hs["request_queue_time_seconds"].observe(queue, done)
            hs["time_to_first_token_seconds"].observe(queue + prefill, done)
            hs["request_decode_time_seconds"].observe(decode, done)
            hs["e2e_request_latency_seconds"].observe(queue + prefill + decode, done)
            # one engine step between two output tokens: OSL − 1 gaps per request, its mean TPOT the same
            hs["inter_token_latency_seconds"].observe(decode / tr.osl, done * max(int(round(tr.osl)) - 1, 0))
            hs["request_time_per_output_token_seconds"].observe(decode / tr.osl, done)
        self.t += dt
        return StepTruth(t=sc.start + self.t, dt=dt, h=h, h_load=h_load, running=running, requests=n,
                         miss_tps=tr.miss_tps(h, running), dip=dip, restart=restart)

    def exposition(self) -> str:
        """The current ``/metrics`` body (vLLM V1 ≥ 0.11.1 names, one engine)."""
        sc, tr = self.sc, self.sc.truth
        lab = f'engine="{sc.engine}",model_name="{sc.model_name}"'
        offload = "None" if tr.load_share <= 0 else "64"
        out = [
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",engine="{sc.engine}",'
            f'kv_offloading_size="{offload}",num_gpu_blocks="8192",prefix_caching_hash_algo="sha256"}} 1.0',
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{lab}}} {self.running!r}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{lab}}} 0.0",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{lab}}} {min(1.0, self.running * (tr.isl + tr.osl) / 131072.0)!r}",
        ]
        for name, help_ in _COUNTERS:
            out += [f"# HELP vllm:{name}_total {help_}", f"# TYPE vllm:{name}_total counter",
                    f"vllm:{name}_total{{{lab}}} {float(f'{self.counters[name]:.6f}')!r}",
                    f"# HELP vllm:{name}_created {help_}", f"# TYPE vllm:{name}_created gauge",
                    f"vllm:{name}_created{{{lab}}} {self.created!r}"]
        for name, help_, _ in _HISTS:
            out += [f"# HELP vllm:{name} {help_}", f"# TYPE vllm:{name} histogram"]
            out += self.hists[name].lines(f"vllm:{name}", lab)
            out += [f"# HELP vllm:{name}_created {help_}", f"# TYPE vllm:{name}_created gauge",
                    f"vllm:{name}_created{{{lab}}} {self.created!r}"]
        return "\n".join(out) + "\n"


def generate(scenario: Scenario) -> Iterator[tuple[float, str, StepTruth | None]]:
    """Deterministic ``(timestamp [unix s], exposition, truth of the step that ended)`` at simulated
    scrape times: the first scrape (truth None), then one per interval over the schedule."""
    engine = Engine(scenario)
    yield scenario.start, engine.exposition(), None
    steps = int(round(scenario.duration / scenario.interval))
    for _ in range(steps):
        truth = engine.advance()
        yield truth.t, engine.exposition(), truth


def true_miss_slope(steps: list[StepTruth]) -> tuple[float, float]:
    """(TPS0, a) of the least-squares line through the noise-free TPS_miss(h) of the given steps
    (dips and restarts left out) as MODEL.md §4's direct estimator defines it: over the h range
    they span, every stretch of h counted by its width (the trapezoid rule over their distinct h,
    a node's weight shared by its steps), not by how many steps sat there."""
    pts = [(s.h, s.miss_tps) for s in steps if not s.dip and not s.restart]
    nodes = sorted({h for h, _ in pts})
    if len(nodes) < 2:
        raise ValueError("need steps at two h at least")
    width = dict.fromkeys(nodes, 0.0)
    for lo, hi in zip(nodes, nodes[1:]):
        width[lo] += (hi - lo) / 2.0
        width[hi] += (hi - lo) / 2.0
    count = Counter(h for h, _ in pts)
    w = [width[h] / count[h] for h, _ in pts]
    total = sum(w)
    mx = sum(wi * h for wi, (h, _) in zip(w, pts)) / total
    my = sum(wi * y for wi, (_, y) in zip(w, pts)) / total
    sxx = sum(wi * (h - mx) ** 2 for wi, (h, _) in zip(w, pts))
    slope = sum(wi * (h - mx) * (y - my) for wi, (h, y) in zip(w, pts)) / sxx
    tps0 = my - slope * mx
    return tps0, -slope / tps0


def true_line(truth: Truth, h_max: float = 0.95, running: float = 10.0, h_min: float = 0.0) -> tuple[float, float]:
    """(TPS0 [tokens/s], a [1]) of the least-squares line through the truth's noise-free
    TPS_miss(h) over [``h_min``, ``h_max``] (:func:`true_miss_slope` at 201 evenly spaced h: the
    trapezoid rule within 1e-4 of the integral where TPS_miss falls steeply near h = 1) at
    concurrency ``running``: the true a of MODEL.md §4 the accuracy benchmark scores kvhit against."""
    grid = [h_min + (h_max - h_min) * i / 200 for i in range(201)]
    return true_miss_slope([StepTruth(0, 0, h, 0, running, 0, truth.miss_tps(h, running), 0, False) for h in grid])


def calibrate_truth(base: Truth, a: float, h_max: float = 0.95, running: float = 10.0, h_min: float = 0.0) -> Truth:
    """The ``base`` truth with k_dec chosen so that its :func:`true_line` over [``h_min``,
    ``h_max``] has slope ``a`` (bisection: a grows with the hit-independent time per request).

    Raises:
        ValueError: ``a`` is not reachable with k_dec in [0, 1] s/token."""

    def slope_of(k_dec: float) -> float:
        return true_line(replace(base, k_dec=k_dec), h_max, running, h_min)[1]

    lo, hi = 0.0, 1.0
    if not slope_of(lo) <= a <= slope_of(hi):
        # the bounds rounded inwards: to nearest, 0.999844 printed 0.99984 refusing a = 0.99984 (review)
        inner = math.ceil(slope_of(lo) * 1e5) / 1e5, math.floor(slope_of(hi) * 1e5) / 1e5
        raise ValueError(f"a={a} not reachable by k_dec with this base truth ({inner[0]:.5f}..{inner[1]:.5f})")
    for _ in range(80):
        mid = (lo + hi) / 2.0
        if slope_of(mid) < a:
            lo = mid
        else:
            hi = mid
    return replace(base, k_dec=(lo + hi) / 2.0)


# --- serving --------------------------------------------------------------------------------


def send_exposition(handler: BaseHTTPRequestHandler, body: bytes) -> bool:
    """Answer 200 with exposition ``body`` (UTF-8 text format 0.0.4); False when the scraper hung
    up first (its timeout): nothing to answer then, and nothing wrong on this side."""
    try:
        handler.send_response(200)
        handler.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
    except (BrokenPipeError, ConnectionResetError):
        return False
    return True


REPEATS_SEEN = 20  # a scraper's last scrapes over which repeated reads are counted (serve)
REPEATS_WARN = 5  # … and how many of them reading the state it read before warn (a phase drift repeats one now and then)


def serve(scenario: Scenario, host: str = "127.0.0.1", port: int = 0, speed: float = 1.0,
          loop: bool = False, on_ready: Callable[[int], None] | None = None,
          stop: threading.Event | None = None, on_fast_scraper: Callable[[str, int], None] | None = None) -> None:
    """Serve the scenario's expositions on http://HOST:PORT/metrics, advancing one interval every
    ``interval / speed`` wall seconds (each scrape sees the latest state). Blocks until the
    schedule ends (or forever with ``loop``: the schedule repeats, counters keep growing) or
    ``stop`` is set. ``on_ready(port)`` is called once listening. ``on_fast_scraper(user_agent,
    repeats)`` is called once per scraper (told apart by User-Agent) when ``repeats`` ≥ REPEATS_WARN of
    its last REPEATS_SEEN scrapes read the state its scrape before read: it scrapes more often than
    the state advances, so its steps alternate between no work and more than their length's worth."""
    stop = stop or threading.Event()
    state = {"text": "", "version": 0, "lock": threading.Lock()}
    scrapers: dict[str, tuple[int, deque]] = {}  # User-Agent → (version it read last, repeated or not per scrape)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            agent, repeats = self.headers.get("User-Agent", ""), 0
            with state["lock"]:
                body, version = state["text"].encode(), state["version"]
                last, seen = scrapers.get(agent, (-1, deque(maxlen=REPEATS_SEEN)))
                if seen is not None:
                    seen.append(version == last)
                    repeats = sum(seen)
                scrapers[agent] = version, (None if repeats >= REPEATS_WARN else seen)  # None: told once
            if repeats >= REPEATS_WARN and on_fast_scraper is not None:
                on_fast_scraper(agent, repeats)
            send_exposition(self, body)

        def log_message(self, *args) -> None:
            pass

    httpd = listening(lambda: ThreadingHTTPServer((host, port), Handler), f"{host}:{port}")
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        # _created on the wall clock (a simulator started again read as a glitched scrape, a restart
        # at --speed < 1 as another process)
        engine = Engine(scenario, wall=time.time)
        with state["lock"]:
            state["text"] = engine.exposition()
        if on_ready is not None:
            on_ready(httpd.server_address[1])
        steps = int(round(scenario.duration / scenario.interval))
        i = 0
        while not stop.wait(scenario.interval / speed):
            if i >= steps:
                if not loop:
                    break
                engine.t, i = 0.0, 0
            engine.advance()
            i += 1
            with state["lock"]:
                state["text"] = engine.exposition()
                state["version"] += 1
    finally:
        httpd.shutdown()
        httpd.server_close()


def preset(name: str, seed: int = 0, noise: float = 0.02) -> Scenario:
    """Named scenarios for ``kvhit simulate`` and the rule tests.

    ``sweep``: steps 0 → 0.95 then agentic 90 %+ (valley for the default prices);
    ``valley``: h held inside the chip-time valley after a sweep; ``no_valley``: a truth whose
    light attention (k_attn 2e-9 s/token²) and decode-light chip time (a = 0.08 over its h range
    [0, 0.95], the lowest k_dec ≥ 0 reaches with it is 0.076) have no valley at the default ρ = 0.1 (a < ρ),
    after a sweep to 0.95; ``diurnal``: a day
    in 10 minutes with a restart and tail-chunk dips.
    """
    sweep = tuple(Segment("step", 60.0, h) for h in (0.0, 0.25, 0.5, 0.75, 0.9)) + (Segment("agentic", 120.0, 0.9, 0.99),)
    if name == "sweep":
        return Scenario(schedule=sweep, seed=seed, noise=noise)
    if name == "valley":
        return Scenario(schedule=sweep + (Segment("step", 600.0, 0.3),), seed=seed, noise=noise)
    if name == "no_valley":
        # agentic traffic to 0.95 only: the miss line steepens towards h = 1, and a < ρ must hold
        # over the h range kvhit fits it on (Scenario.h_max)
        sc = Scenario(schedule=sweep[:-1] + (Segment("agentic", 120.0, 0.9, 0.95), Segment("step", 600.0, 0.3)),
                      seed=seed, noise=noise)
        return replace(sc, truth=calibrate_truth(Truth(k_attn=2e-9), 0.08, sc.h_max))
    if name == "diurnal":
        return Scenario(schedule=(Segment("diurnal", 600.0, 0.2, 0.95, period=600.0),), seed=seed, noise=noise,
                        dips=((0.4, 0.4), (0.7, 0.3)), restarts=(300.0,))
    raise ValueError(f"unknown scenario {name!r} (sweep, valley, no_valley, diurnal)")


PRESETS = ("sweep", "valley", "no_valley", "diurnal")


# --- command line (kvhit simulate) ----------------------------------------------------------


def add_arguments(p) -> None:
    """Arguments of ``kvhit simulate`` (an argparse parser)."""
    p.add_argument("--listen", default="127.0.0.1:9400", help="ADDR:PORT to serve /metrics on (default 127.0.0.1:9400)")
    p.add_argument("--scenario", default="sweep", choices=PRESETS, help="hit-ratio schedule and truth (default sweep)")
    p.add_argument("--miss-slope", type=bounded(0, 1, open_low=True), dest="miss_slope",
                   help="true a: k_dec chosen so the line through TPS_miss(h) over the scenario's h range has this slope")
    p.add_argument("--alpha", type=bounded(0, 1), help="true overlap α in [0, 1] (default 0.5)")
    p.add_argument("--noise", type=bounded(0, 1), default=0.02, help="relative measurement noise σ (default 0.02)")
    p.add_argument("--interval", type=bounded(MIN_INTERVAL, MAX_INTERVAL), default=5.0,
                   help="simulated seconds per scrape interval (default 5)")
    p.add_argument("--speed", type=bounded(1e-3, 1e6), default=1.0, help="simulated seconds per wall second (default 1)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the measurement noise and the schedule's draws (default 0)")
    p.add_argument("--loop", action="store_true", help="repeat the schedule forever (counters keep growing)")


def kvhit_run_command(truth: Truth, url: str, interval: float) -> str:
    """The ``kvhit run`` command line that analyses the simulator at ``url`` with its truth's S_kv
    and B_load (so α can be fitted) at its scrape interval; the geometry is :data:`SIM_GEOMETRY`
    when the truth keeps its default S_kv, else left out (α then needs it configured)."""
    env = {f"KVHIT_MODEL_{k.upper()}": str(v) for k, v in SIM_GEOMETRY.items()} \
        if truth.kv_bytes_per_token == Truth.kv_bytes_per_token else {}
    env["KVHIT_LOAD_BANDWIDTH_BYTES_PER_SECOND"] = f"{truth.load_bandwidth:g}"
    return " ".join([*(f"{k}={v}" for k, v in env.items()), "kvhit run", "--target", url,
                     "--interval", f"{interval:g}", "--listen", "127.0.0.1:9471"])


def cmd_simulate(args) -> int:
    """Serve the ground-truth simulator until the schedule ends (or forever with --loop)."""
    host, port = listen_address(args.listen, "--listen", any_port=True)
    if not host:  # the simulator binds where it is told, never every interface by default
        raise ConfigError(f"--listen: expected ADDR:PORT, got {args.listen!r}")
    sc = preset(args.scenario, seed=args.seed, noise=args.noise)
    truth = sc.truth
    if args.alpha is not None:
        truth = replace(truth, alpha=args.alpha)
    if args.miss_slope is not None:
        rho = Prices().hit_price_ratio  # the preset's: its a is below the default ρ
        if args.scenario == "no_valley" and args.miss_slope >= rho:
            raise ConfigError(f"--miss-slope: no_valley has no valley at ρ = {rho:g} because its a is below ρ; "
                              f"a = {args.miss_slope:g} would make one (use --scenario valley, or a < {rho:g})")
        try:
            truth = calibrate_truth(truth, args.miss_slope, sc.h_max, h_min=sc.h_min)
        except ValueError as exc:
            raise ConfigError(f"--miss-slope: {exc}") from None
    sc = replace(sc, truth=truth, interval=args.interval)

    tps0, a = true_line(truth, sc.h_max, h_min=sc.h_min)

    def ready(p: int) -> None:
        print(f"kvhit simulate: {args.scenario} on http://{host}:{p}/metrics "
              f"({sc.duration:.0f} simulated s, x{args.speed:g}); true miss line over h in [{sc.h_min:g}, {sc.h_max:g}] at "
              f"running 10: TPS0={tps0:.1f} tokens/s a={a:.4f}; truth: {truth}", flush=True)
        # kvhit scrapes once per served step: every interval / speed wall seconds (at least MIN_INTERVAL)
        every = min(max(sc.interval / args.speed, MIN_INTERVAL), MAX_INTERVAL)
        # the command alone on its line: it is pasted into a shell
        print(f"kvhit simulate: analyse it with: {kvhit_run_command(truth, f'http://{host}:{p}/metrics', every)}",
              flush=True)
        if args.speed != 1:
            print(f"kvhit simulate: chip times are fitted in wall seconds: at --speed {args.speed:g} they come out "
                  f"{args.speed:g}x too small, and the contention factor (latencies, in simulated seconds, over "
                  f"them) {args.speed:g}x too large", file=sys.stderr, flush=True)

    def fast(agent: str, repeats: int) -> None:
        every = min(max(sc.interval / args.speed, MIN_INTERVAL), MAX_INTERVAL)
        print(f"kvhit simulate: warning: a scraper ({agent or 'no User-Agent'}) read the same state in {repeats} of its "
              f"last {REPEATS_SEEN} scrapes: it scrapes more often than the simulator advances (every "
              f"{sc.interval / args.speed:g} wall s), so its steps alternate between no work and more than their "
              f"length's worth, and fits over them are wrong (TPS too high); scrape every {every:g} s (--interval). "
              "Several scrapers with one User-Agent (two kvhit processes) read as one: each alone may be right",
              file=sys.stderr, flush=True)  # a warning, apart from the lines a script reads (newcomer)

    stop = stop_event()  # Ctrl-C or SIGTERM: a clean stop, as kvhit run's
    serve(sc, host, port, speed=args.speed, loop=args.loop, on_ready=ready, stop=stop, on_fast_scraper=fast)
    if stop.is_set():
        print("kvhit simulate: stopped (signal received)", flush=True)
    else:
        print(f"kvhit simulate: the {args.scenario} schedule ended after {sc.duration:.0f} simulated s; stopped "
              "(--loop repeats it)", flush=True)
    return 0
