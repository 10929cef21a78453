"""Exposition text → :class:`Snapshot` of canonical signals per ``model_name`` (MODEL.md §2).

Real ``/metrics`` bodies are messier than the spec; each quirk is handled here as a kind and
counted in :attr:`Snapshot.quirks` (reference vllm-metrics.md §1, §2, §7):

* ``vllm:`` and ``vllm_`` prefixes; counters with or without ``_total``; ``*_created`` is never
  data (kept per series to detect restarts); HELP/TYPE without samples; samples without TYPE;
  blank lines; optional sample timestamps (ignored: the scrape time is used).
* The body is read with prometheus-client's parser. That parser refuses a whole body for one bad
  line, so kvhit then reads it line by line: a line that is not text exposition is dropped
  (``malformed_line``) and the rest is kept; only a body that is mostly not exposition (an HTML
  error page) is a :class:`ParseError`. A body that does not end with a newline was cut: its
  unterminated last line is dropped (``truncated``), never read as a shorter number. Bytes that
  were not UTF-8 arrive as U+FFFD (``non_utf8``): a metric name containing one is malformed, a
  label value keeps it.
* NaN/±Inf samples (``non_finite``), values beyond ±1e18 (``out_of_range``: an exabyte; no token,
  request or byte count gets there, and a glitched 1e200 would overflow the fits' sums of
  squares) and negative counters, histogram counts and gauges (``negative``; V0's hit-rate -1 means
  no data) are ignored; the same series
  twice is dropped, unknown (``duplicate_series``: which value is right cannot be told, and a stuck copy must not win); a gauge duplicated per API-server ``pid`` (vLLM
  0.9.2–0.11.0 multiprocess bug) is one value (max), never a sum (``pid_duplicate``).
* Samples of model_name values past the first MAX_MODELS a body names are dropped before anything
  of them is read (``models_over_limit``): each model costs memory however few its series. A model
  whose samples name more than MAX_ENGINES ``engine`` labels is dropped whole (``engines_over_limit``):
  a part of its engines would be a partial sum.
* Counters and histograms are summed over data-parallel ``engine`` labels, running/waiting
  summed, KV usage max over engines — only when EVERY engine of the model has the signal: a signal
  missing for one engine (a cut body, a partial paste) is unknown, never a partial sum
  (``engine_incomplete``). An engine is one with at least half as many families of them as the
  engine with the most: a few series of another ``engine`` label (a stray copy) are left out,
  and counted as ``engine_incomplete`` too. Per-engine values are kept (:attr:`ModelSignals.engines`) so that
  steps detect a restart per engine.
* A histogram whose cumulative buckets decrease, exceed ``_count``, or whose ``+Inf`` bucket is
  not ``_count`` is left out (``histogram_inconsistent``); bucket edges are read from the scrape
  (custom, CUDA-graph, 1-2-5 edges all work; no edge is assumed).
* ``prefix_cache_*`` wins over the deprecated ``gpu_prefix_cache_*`` (0.10); hits of the other
  spelling than the queries' count only in the queries' unit (else no hits); the latter counted
  BLOCKS in 0.7–0.8 (HELP says "blocks"), TOKENS from 0.9 (HELP says "tokens"); without HELP and
  without other evidence of ≥ 0.9 the unit is ``unknown`` (and so is the hit ratio).
* ``num_requests_waiting`` includes deferred requests from 0.20: ``num_requests_waiting_by_reason
  {reason="capacity"}`` is used when present, so ``waiting`` means the same in every version.
* V0 only has a lifetime, block-level hit-rate gauge (−1 = no data): the token hit ratio is then
  unknown. :attr:`Snapshot.since` is the lowest vLLM version the families prove (e.g. (0, 11, 1)
  once ``external_prefix_cache_*`` exists), used to flag preemption-inflated hits before 0.11.1.
* SGLang is read through :mod:`exporter.engines` (its samples renamed onto the vLLM names below,
  then read as vLLM, with SGLang's own unknown reasons); LMCache expositions parse, but are
  reported as an unsupported engine.

Only the families kvhit reads are fully parsed (plus every ``_created``); other lines are checked
for a valid name and counted. A sidecar reads through :class:`Parser`: after the first clean
body, a body with the same layout (same lines, other numbers) skips both readers and the
assembly — its hot path, about 1.3× the cost of splitting the body and ``float()``-ing every
value (benchmarks/performance.py).
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field, replace
import operator
from operator import getitem, itemgetter
from types import MappingProxyType
from typing import Mapping

from prometheus_client.parser import text_string_to_metric_families

from exporter import engines
from exporter.sources import MAX_VALUE

# Canonical counter → exposed base names (without prefix and ``_total``), first present wins.
COUNTERS: dict[str, tuple[str, ...]] = {
    "queries": ("prefix_cache_queries", "gpu_prefix_cache_queries"),
    "hits": ("prefix_cache_hits", "gpu_prefix_cache_hits"),
    "external_queries": ("external_prefix_cache_queries",),
    "external_hits": ("external_prefix_cache_hits",),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "preemptions": ("num_preemptions",),
    "kv_offload_load_bytes": ("kv_offload_load_bytes",),
    "kv_offload_load_seconds": ("kv_offload_load_time",),
}
# Counters vLLM creates at first use (0.32 offloading/metrics.py: at an engine's first KV load), not
# at start: absent from a pod that has not loaded yet, where their value is 0.
LAZY_COUNTERS = ("kv_offload_load_bytes", "kv_offload_load_seconds")
# Counters kept per label value: canonical name → (exposed base, label, value); one COUNTERS has
# too is read from it for a model none of those names is present for (an older vLLM's spelling).
LABELLED_COUNTERS: dict[str, tuple[str, str, str]] = {
    "prompt_local_compute": ("prompt_tokens_by_source", "source", "local_compute"),
    # vLLM 0.16-0.23's offloading connector: both directions in one family (0.24+: kv_offload_load_*)
    "kv_offload_load_bytes": ("kv_offload_total_bytes", "transfer_type", "CPU_to_GPU"),
    "kv_offload_load_seconds": ("kv_offload_total_time", "transfer_type", "CPU_to_GPU"),
}
HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "iteration_tokens": ("iteration_tokens_total",),
    "prefill_time": ("request_prefill_time_seconds",),
    "decode_time": ("request_decode_time_seconds",),
    "queue_time": ("request_queue_time_seconds",),
    "ttft": ("time_to_first_token_seconds",),
    "request_tpot": ("request_time_per_output_token_seconds",),
    "itl": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "e2e": ("e2e_request_latency_seconds",),
    "request_prompt_tokens": ("request_prompt_tokens",),
    "request_generation_tokens": ("request_generation_tokens",),
    "prefill_kv_computed_tokens": ("request_prefill_kv_computed_tokens",),
}
# Gauges: canonical → (exposed names in preference order, aggregation over engines).
GAUGES: dict[str, tuple[tuple[str, ...], str]] = {
    "running": (("num_requests_running",), "sum"),
    "waiting": (("num_requests_waiting",), "sum"),
    "kv_usage": (("kv_cache_usage_perc", "gpu_cache_usage_perc"), "max"),
    "v0_hit_rate": (("gpu_prefix_cache_hit_rate",), "max"),
    # SGLang only, renamed by exporter/engines.py: KV pool size [tokens] and the last prefill
    # batch's hit rate (informational, never the token hit ratio).
    "kv_capacity_tokens": (("max_total_num_tokens",), "max"),
    "batch_hit_rate": (("batch_cache_hit_rate",), "max"),
}
# Gauges read from one label value; they win over the plain gauge of the same canonical name.
# 0.20+: num_requests_waiting = capacity + deferred; "capacity" is what waiting meant before.
LABELLED_GAUGES: dict[str, tuple[str, str, str]] = {
    "waiting": ("num_requests_waiting_by_reason", "reason", "capacity"),
}
# Families only V0 (or the pre-prometheus_client 0.2.x server) ever declared (reference §3, §5).
_V0_MARKERS = ("gpu_prefix_cache_hit_rate", "num_requests_swapped", "cpu_cache_usage_perc",
               "cpu_prefix_cache_hit_rate", "avg_prompt_throughput_toks_per_s",
               "avg_generation_throughput_toks_per_s", "time_in_queue_requests")
# Evidence of the V1 engine: the engine label (0.8.3+), V1-only counters, V1's HELP text.
_V1_MARKERS = ("engine label", "prefix_cache_queries", "gpu_prefix_cache_queries", "external_prefix_cache_queries")
# Lowest vLLM version proven by a family with a sample (reference §4, §5); "engine label" = 0.8.3.
_SINCE: dict[str, tuple[int, int, int]] = {
    "engine label": (0, 8, 3),
    "prefix_cache_queries": (0, 9, 2),
    "kv_cache_usage_perc": (0, 9, 2),
    "inter_token_latency_seconds": (0, 10, 2),
    "request_time_per_output_token_seconds": (0, 11, 0),
    "external_prefix_cache_queries": (0, 11, 1),
    "engine_sleep_state": (0, 11, 1),
    "mm_cache_queries": (0, 11, 1),
    "request_prefill_kv_computed_tokens": (0, 13, 0),
    "prompt_tokens_by_source": (0, 16, 0),
    "prompt_tokens_cached": (0, 16, 0),
    "num_requests_waiting_by_reason": (0, 20, 0),
}
# From this version preempted/resumed requests no longer count as prefix-cache queries and hits
# (vllm PR #25787); before it a window with preemptions has inflated hits.
PREEMPTION_FIX = (0, 11, 1)
_OTHER_ENGINES = ("sglang", "lmcache")
# Bodies longer than this are read by kvhit's line reader alone (parse_exposition): the 64-model
# body (2 MiB) still goes through the library, a body of junk series past it does not.
LIBRARY_MAX_CHARS = 4 * 1024 * 1024
# A body with a longer line too (vLLM's longest, cache_config_info, is 1-2 KiB): the library's label
# parser takes time quadratic in a line's escapes (a label value of 2M \" in a 4-MiB body: 220 s,
# the scrape loop stalled and the kubelet restarted kvhit; adversarial review; a 4-KiB line of them:
# 2 ms). kvhit's reader is linear.
LIBRARY_MAX_LINE = 4096
# A body of more lines gets no hot-path plan (Parser): the plan keeps every sample line's key and
# position, and building it held ~0.6 KiB per line (4 MiB of one-sample families: 325 MiB of RSS).
# The 64-model body has 24,000 lines.
PLAN_MAX_LINES = 50_000
# Samples of model_name values past this many in one body are dropped (``models_over_limit``): the
# first this many seen are read. Each model costs ~10 KiB of snapshots and plan however few its
# series, so 49,300 one-line models of a family kvhit reads (3.6 MB, under max_body_bytes) held
# 840 MiB, past the sidecar's 256 MiB limit (a deploy review's find), and 4,000 models of 8 such
# lines 224 MiB at a limit of 4,096; vLLM serves one model, a fleet's Prometheus a few dozen.
MAX_MODELS = 1024
# A model's samples that name more ``engine`` values than this drop the model (``engines_over_limit``):
# a body of 60,000 engines (3.7 MB) took 10 s to assemble, every scrape, and the model kvhit served
# came and went as its scrapes fell behind (a newcomer's find); data parallelism spans tens of engines.
MAX_ENGINES = 1024
_HIST_SUFFIXES = ("_bucket", "_sum", "_count")

QUIRKS = ("truncated", "malformed_line", "non_utf8", "non_finite", "out_of_range", "negative",
          "duplicate_series", "pid_duplicate", "engine_incomplete", "histogram_inconsistent", "models_over_limit",
          "engines_over_limit")


class ParseError(ValueError):
    """The body is not Prometheus text exposition (message names the problem, never the body)."""


class Buckets:
    """``buckets`` ((le, count), …, ascending le) of a histogram kept as two columns, ``edges`` and
    ``counts``: consecutive scrapes share one edges tuple and subtract counts column-wise, and no
    pair is built unless ``buckets`` is read. :meth:`of` builds one from pairs."""

    edges: tuple[float, ...]
    counts: tuple[float, ...]

    @functools.cached_property
    def buckets(self) -> tuple[tuple[float, float], ...]:
        return tuple(zip(self.edges, self.counts))

    @classmethod
    def of(cls, sum: float, count: float, buckets: tuple[tuple[float, float], ...] = ()):
        return cls(sum, count, tuple(le for le, _ in buckets), tuple(c for _, c in buckets))


@dataclass(frozen=True)
class Histogram(Buckets):
    """Cumulative histogram summed over engines: ``sum``, ``count``, and per bucket its ``le``
    (``edges``, ascending) and cumulative count (``counts``); ``buckets`` pairs them."""

    sum: float
    count: float
    edges: tuple[float, ...] = ()
    counts: tuple[float, ...] = ()


@dataclass(frozen=True)
class ModelSignals:
    """Canonical signals of one ``model_name`` at one scrape (MODEL.md §2).

    Attributes:
        counters: canonical counter name → value (see :data:`COUNTERS`).
        histograms: canonical histogram name → :class:`Histogram`.
        gauges: canonical gauge name → value (aggregated as in :data:`GAUGES`).
        created: ``_created`` timestamp [unix s] per series, keyed ``<exposed base>{<labels
            other than model_name and pid>}``, e.g. ``prefix_cache_queries{engine="0"}``; a series
            present at two scrapes whose timestamp changed means the engine restarted.
        hit_unit: "tokens", "blocks" (0.7–0.8 ``gpu_prefix_cache_*``), "unknown" (gpu_* without
            HELP and no evidence of ≥ 0.9), "" when no hit counter.
        unknown: signal → reason it is unknown (e.g. "hit_ratio").
        engines: ``engine`` label value ("" when absent) → that engine's own signals (same
            fields, no ``engines``); empty when built by hand. Steps use them so that a restart
            or a missing series of one engine is handled per engine.
    """

    counters: Mapping[str, float]
    histograms: Mapping[str, Histogram]
    gauges: Mapping[str, float]
    created: Mapping[str, float] = field(default_factory=dict)
    hit_unit: str = ""
    unknown: Mapping[str, str] = field(default_factory=dict)
    engines: Mapping[str, "ModelSignals"] = field(default_factory=dict)


@dataclass(frozen=True)
class Snapshot:
    """One scrape: time, engine and canonical signals per model.

    Attributes:
        timestamp: when the scrape was taken [unix s] (replay: the file's timestamp).
        engine: "vllm_v1", "vllm_v0", "vllm" (era not identifiable from a partial exposition),
            "sglang", "lmcache" or "unknown".
        reason: why the engine is unsupported / why nothing could be read ("" when fine).
        models: model_name → :class:`ModelSignals` (empty for unsupported engines).
        cache_config: labels of ``vllm:cache_config_info`` (engine 0's, else the first engine's; its
            ``engine`` label left out), {} when absent.
        model_cache_config: model_name → the labels of its own ``cache_config_info`` (one with a
            ``model_name`` label: fleet mode's, one per model from that model's pods); a model
            not in it has ``cache_config`` (:meth:`cache_config_of`).
        quirks: quirk (see :data:`QUIRKS`) → how many lines/series it affected in this body.
        since: lowest vLLM version the sampled families prove, () when none does.
        model_since: model_name → the lowest vLLM version its own samples prove (:meth:`since_of`):
            fleet mode's body holds every model's pods, each of its own version.
        clock_offset: ``timestamp`` minus the host's wall clock when it was stamped [s]: 0 until
            the wall clock steps (kvhit's live clock never steps, exporter/runner.py
            SteadyClock); the engine stamps ``_created`` on the wall clock (exporter/window.py).
        name_prefix: the engine's metric-name prefix as the exposition writes it: "vllm:", or for
            SGLang "sglang:" (its server) or "sglang_" (its model gateway).
        engine_counts: model_name → data-parallel engines its signals sum, when the source told
            it (fleet mode: pods × engines, exporter/sources.py PrometheusSource); {}: the
            exposition's own ``engine`` labels tell.
        instance_counts: model_name → instances (pods) its signals sum, when the source told it
            (fleet mode); {}: one.
        busy_counts, active_counts: model_name → of its ``engine_counts``, those running requests
            throughout the step that ends here, and at some point of it, when the source told it
            (fleet mode); absent: not told.
    """

    timestamp: float
    engine: str
    reason: str
    models: Mapping[str, ModelSignals]
    cache_config: Mapping[str, str] = field(default_factory=dict)
    quirks: Mapping[str, int] = field(default_factory=dict)
    since: tuple[int, ...] = ()
    model_cache_config: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    model_since: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    clock_offset: float = 0.0
    name_prefix: str = "vllm:"
    engine_counts: Mapping[str, int] = field(default_factory=dict)
    instance_counts: Mapping[str, int] = field(default_factory=dict)
    busy_counts: Mapping[str, int] = field(default_factory=dict)
    active_counts: Mapping[str, int] = field(default_factory=dict)

    def cache_config_of(self, model: str) -> Mapping[str, str]:
        """``model``'s ``cache_config_info`` labels (its own, else the exposition's), {} when absent."""
        return self.model_cache_config.get(model, self.cache_config)

    def since_of(self, model: str) -> tuple[int, ...]:
        """The lowest vLLM version ``model``'s samples (and the families kvhit does not read) prove."""
        return self.model_since.get(model, self.since)

    def excludes_preempted(self, model: str) -> bool:
        """Whether ``model``'s families prove a vLLM ≥ :data:`PREEMPTION_FIX`, whose prefix-cache
        counters leave resumed preempted requests out (the external-hit counters prove it too)."""
        return self.since_of(model) >= PREEMPTION_FIX


def _strip_prefix(name: str) -> tuple[str, str]:
    for prefix in ("vllm:", "vllm_"):
        if name.startswith(prefix):
            return "vllm", name[len(prefix):]
    for other in _OTHER_ENGINES:
        if name.startswith(other + ":") or name.startswith(other + "_"):
            return other, name[len(other) + 1:]
    return "", name


def _hist_base(name: str) -> str:
    for suffix in _HIST_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _counter_base(name: str) -> str:
    return name[:-6] if name.endswith("_total") else name


# --- line level ---------------------------------------------------------------------------

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_SAMPLE = re.compile(
    r'([a-zA-Z_:][a-zA-Z0-9_:]*)[ \t]*'
    r'(?:\{((?:[^"{}\\]|"(?:[^"\\]|\\.)*")*)\})?'
    r'[ \t]*([^ \t]+)(?:[ \t]+(-?[0-9]+))?[ \t]*\Z')
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(?:,|\Z)')
_ESCAPE = re.compile(r"\\(.)")
_UNESCAPE = {"n": "\n", "\\": "\\", '"': '"'}
_ENGINE_LABEL = re.compile(r'(?:^|[{,])[ \t]*engine[ \t]*=')


def _unescape(s: str) -> str:
    return _ESCAPE.sub(lambda m: _UNESCAPE.get(m.group(1), "\\" + m.group(1)), s) if "\\" in s else s


def _labels(text: str | None) -> dict[str, str] | None:
    """Label set of a sample, None when malformed."""
    out: dict[str, str] = {}
    if not text:
        return out
    pos, end = 0, len(text)
    while pos < end:
        m = _LABEL.match(text, pos)
        if m is None:
            return out if not text[pos:].strip() else None
        if m.group(1) in out:  # a label name twice: which value is the series'? (prometheus-client refuses it too)
            return None
        out[m.group(1)] = _unescape(m.group(2))
        pos = m.end()
    return out


def _value(text: str) -> float | None:
    if "_" in text:  # float() accepts 1_000; the text format does not
        return None
    try:
        return float(text)
    except ValueError:
        return None


def _read_kinds() -> dict[str, tuple[str, str, str]]:
    """Exposed sample name (without prefix) → (kind, exposed base, part) for what kvhit reads."""
    out: dict[str, tuple[str, str, str]] = {}
    for names in COUNTERS.values():
        for base in names:
            out[base] = out[base + "_total"] = ("counter", base, "")
    for base, _, _ in LABELLED_COUNTERS.values():
        out[base] = out[base + "_total"] = ("counter", base, "")
    for names in HISTOGRAMS.values():
        for base in names:
            for suffix in _HIST_SUFFIXES:
                out[base + suffix] = ("hist", base, suffix[1:])
    for names, _ in GAUGES.values():
        for base in names:
            out[base] = ("gauge", base, "")
    for base, _, _ in LABELLED_GAUGES.values():
        out[base] = ("gauge", base, "")
    out["cache_config_info"] = ("info", "cache_config_info", "")
    return out


_READ = _read_kinds()


class _Builder:
    """Collects raw series of one exposition before aggregation."""

    def __init__(self) -> None:
        # (kind, exposed base, part) → series key → value; the key excludes ``pid`` so per-pid
        # duplicates collapse to one value (max), never a sum.
        self.series: dict[tuple[str, str, str], dict[tuple, float]] = {}
        self.docs: dict[str, str] = {}
        self.declared: set[str] = set()  # vLLM family names seen (with or without samples)
        self.sampled: set[str] = set()  # … of them, those with a sample line (a version's proof: _since)
        self.model_samples: set[tuple[str, str]] = set()  # (exposed base, model) of every sample read, usable or not
        self.usable: set[tuple[str, str]] = set()  # (exposed base, model) read with a usable value
        self.models: set[str] = set()  # model_name values read, at most MAX_MODELS
        self.engines: dict[str, set[str]] = {}  # model → its engine labels read, at most MAX_ENGINES
        self.over: set[str] = set()  # models with more engines: dropped whole at assembly
        self.samples = 0
        self.families: dict[str, set[str]] = {}  # engine prefix → family names
        self.connector_models: set[str] = set()  # model_name labels of LMCache's samples (_connector)
        self.cache_config: dict[str, str] = {}
        self.model_cache_config: dict[str, dict[str, str]] = {}  # from cache_config_info with a model_name
        self.quirks: dict[str, int] = {}
        self.other: list[tuple[str, dict[str, str], float]] = []  # samples of a translated engine
        self.prefixes: dict[str, str] = {}  # translated engine → its prefix as first written
        # Series values are leaves (see _Sum): indices into ``values``, keyed by sample-line number
        # (``line``), so that a cached plan can refill them from a body of the same layout.
        self.values: dict[int, float] = {}
        self.line = -1
        self.ambiguous: set[tuple] = set()  # (slot, series key) given twice: dropped at assembly
        self.recipe: Snapshot | None = None  # the models as leaves, once assembled
        # _since's index of the samples read (built at assembly, when reading is done) and its answers
        self.read_bases: set[str] = set()
        self.usable_bases: dict[str, set[str]] | None = None  # model → bases read with a usable value
        self.since: dict[str | None, tuple[int, ...]] = {}

    def sample_line(self, declared: tuple[str, ...], engine_label: bool) -> None:
        """Count a vLLM sample line: its family names are declared and, by a sample, sampled."""
        self.samples += 1
        self.declared.update(declared)
        self.sampled.update(declared)
        if engine_label:
            self.declared.add("engine label")
            self.sampled.add("engine label")

    def quirk(self, kind: str, n: int = 1) -> None:
        self.quirks[kind] = self.quirks.get(kind, 0) + n

    def declare(self, name: str) -> None:
        base = _hist_base(_counter_base(name[:-8] if name.endswith("_created") else name))
        self.declared.update((name, _counter_base(name), _hist_base(name), base))

    def admit(self, model: str, engine: str | None = None) -> bool:
        """Whether a sample of ``model`` (of ``engine``: its label, None for none) is read: the first
        MAX_MODELS models seen are, while they name at most MAX_ENGINES engines; a sample of a
        later one, or of one past that, is dropped and counted (``models_over_limit``,
        ``engines_over_limit``)."""
        if model in self.over:
            self.quirk("engines_over_limit")
            return False
        if model and model not in self.models:  # no model_name (cache_config_info, …): no model's slot
            if len(self.models) >= MAX_MODELS:
                self.quirk("models_over_limit")
                return False
            self.models.add(model)
        if engine is not None:  # of a model read
            seen = self.engines.setdefault(model, set())
            seen.add(engine)
            if len(seen) > MAX_ENGINES:
                self.over.add(model)
                self.quirk("engines_over_limit")
                return False
        return True

    def add(self, kind: str, base: str, part: str, labels: Mapping[str, str], value: float) -> None:
        self.model_samples.add((base, labels.get("model_name", "")))
        if not math.isfinite(value):
            self.quirk("non_finite")  # NaN/±Inf samples carry no usable count
            return
        if abs(value) > MAX_VALUE:
            self.quirk("out_of_range")
            return
        if value < 0 and not (kind == "hist" and part == "sum") and base != "gpu_prefix_cache_hit_rate":
            # a counter, an observation count or a gauge kvhit reads (requests, KV usage, hit
            # rates) is never below zero: a -1000 running made a negative contention factor.
            # V0's hit-rate gauge writes -1 for "no data" (_assemble reads it as such).
            self.quirk("negative")
            return
        self.usable.add((base, labels.get("model_name", "")))
        key = tuple(sorted((k, v) for k, v in labels.items() if k != "pid"))
        slot = self.series.setdefault((kind, base, part), {})
        self.values[self.line] = value
        if key not in slot:
            slot[key] = self.line
        elif "pid" in labels:  # one gauge per API-server process (vLLM multiprocess bug): one value
            self.quirk("pid_duplicate")
            slot[key] = _max((slot[key], self.line))
        else:  # two values for one series: neither can be trusted (a stuck copy would win a max)
            self.quirk("duplicate_series")
            self.ambiguous.add(((kind, base, part), key))


def parse_exposition(text: str, timestamp: float) -> Snapshot:
    """Parse Prometheus text exposition into a :class:`Snapshot` (MODEL.md §2).

    The body is read with prometheus-client's parser (the reference). When that parser rejects
    the body as a whole (one malformed or cut line is enough), kvhit's tolerant line reader
    takes over: malformed lines are dropped and counted, the rest is kept. Both feed the same
    assembly, and tests/test_parse_reference.py proves they give identical Snapshots. A body over
    LIBRARY_MAX_CHARS goes to kvhit's reader directly: the library holds a family's samples as
    objects (~0.8 KiB per line), so a 4 MiB body of short lines took 120 MiB, and the sidecar's
    memory limit is 256 MiB. So does a body with a line over LIBRARY_MAX_LINE: the library's time
    grows with the square of a line's escaped characters.

    Args:
        text: exposition body (str; decode bytes as UTF-8 with replacement first).
        timestamp: scrape time [unix s].
    Raises:
        ParseError: the body is empty, gzip data (its magic bytes, decoded), or is not text
            exposition: more than half of its sample lines are malformed (message without the body).
    """
    if text.startswith("\x1f\ufffd\x08"):  # gzip's 1f 8b 08 as UTF-8 with replacement decodes it
        raise ParseError("gzip-compressed data where text exposition was expected (a proxy that compressed the "
                         "body without Content-Encoding: gzip, or compressed it twice?)")
    lines, truncated = _body_lines(text)
    if len(text) > LIBRARY_MAX_CHARS or max(map(len, lines), default=0) > LIBRARY_MAX_LINE:
        return _parse(lines, truncated, timestamp, _read_lines)
    try:
        return _parse(lines, truncated, timestamp, _read_library)
    except _Rejected:
        return _parse(lines, truncated, timestamp, _read_lines)


class Parser:
    """:func:`parse_exposition` with kvhit's hot path: one per target, it remembers the layout
    of the last clean body and reads a body with the same layout without parsing it again.

    A vLLM server exposes the same lines scrape after scrape; only the numbers move. A *plan*
    is kept when a body was clean (V1, no quirk, no blank or indented line, and kvhit's line
    reader gave exactly what prometheus-client's parser gave): its comment lines, the key of
    every sample line (all before the value), and the assembled signals as leaves pointing at
    the lines kvhit reads. A later body takes the hot path only when it has the same number of
    lines, identical comments, every sample line starts with the same key and has something
    after it, it has no U+FFFD, and every value kvhit reads is a finite number ≥ 0 (text-format
    syntax) whose histograms stay consistent; then only those values are converted and the
    leaves evaluated. Anything else — a new series, a quirk, a cut body, NaN — goes through
    :func:`parse_exposition` (and may become the new plan). Values of lines kvhit does not read
    are not converted: both readers ignore them. tests/test_parse_reference.py proves both paths
    identical on every sample, every snapshot of the real trace and fuzzed bodies.
    """

    def __init__(self) -> None:
        self._plan: _Plan | None = None
        self._misses = 0  # bodies in a row the plan did not read

    def parse(self, text: str, timestamp: float) -> Snapshot:
        """Same contract as :func:`parse_exposition` (raises ParseError likewise)."""
        plan = self._plan
        if plan is not None:
            snap = plan.read(text, timestamp)
            if snap is not None:
                self._misses = 0
                return snap
        self._misses += 1
        snap = parse_exposition(text, timestamp)
        if self._misses & (self._misses - 1) == 0:  # the 1st, 2nd, 4th, 8th… miss in a row: a layout
            # that changes every scrape is not planned again every scrape
            self._plan = _Plan.build(text, snap) or plan
        return snap


@dataclass(frozen=True)
class _Plan:
    """The layout of a clean body (see :class:`Parser`) and its signals as leaves.

    Positions are indices into ``text.split("\\n")``; a leaf's index is a sample-line number
    (the k-th non-comment line, as :func:`_read_lines` numbers them) when assembled, renumbered
    to the position among the lines read for the plan.
    """

    lines: int  # len(text.split("\n"))
    comment_at: itemgetter
    comments: tuple[str, ...]
    sample_at: itemgetter
    prefixes: tuple[str, ...]  # per sample line: its key and the space before the value
    unread: tuple[int, ...]  # positions of the sample lines whose values are not converted …
    unread_key_lengths: tuple[int, ...]  # … and len(key) of each
    needed_at: itemgetter  # the sample lines whose values the leaves read …
    cuts: tuple[slice, ...]  # … and where their value starts (leaves index this list)
    evaluate: object  # (values, timestamp) → (Snapshot, evaluated maps): see _compile
    engine_hists: tuple[int, ...]  # which evaluated maps are per-engine histograms

    @classmethod
    def build(cls, text: str, reference: Snapshot) -> "_Plan | None":
        """The plan of a body whose reference Snapshot (:func:`parse_exposition`) is ``reference``,
        None when the body is not clean or has more than PLAN_MAX_LINES lines."""
        if reference.quirks or reference.engine not in ("vllm_v1", "vllm") or not reference.models:
            return None  # a cut body is a quirk (truncated)
        if text.count("\n") > PLAN_MAX_LINES or "\t" in text:  # a tab: _sample_key splits at spaces
            return None
        lines, truncated = _body_lines(text)
        raw = text.split("\n")
        comment_pos = [i for i, line in enumerate(lines) if line[0] == "#"]
        sample_pos = [i for i, line in enumerate(lines) if line[0] != "#"]
        if len(raw) != len(lines) + 1 or any(raw[i] != lines[i] for i in sample_pos):
            return None  # blank or indented lines: positions would not match the reader's numbering
        b = _Builder()
        try:
            own = _parse(lines, truncated, reference.timestamp, _read_lines, b)
        except ParseError:  # a body the library reads and kvhit's reader refuses (OpenMetrics exemplars): no plan
            return None
        if repr(own) != repr(reference):
            return None
        keys = [_sample_key(lines[i]) for i in sample_pos]
        prefixes = [key + " " for key, _ in keys]
        # every value the readers check (non_finite, out_of_range, negative), whether or not a leaf
        # reads it: e.g. prompt_tokens_by_source{source="local_cache_hit"} is read and checked, never summed
        needed = sorted(b.values)
        if len(comment_pos) < 2 or len(needed) < 2 or "" in (p.strip() for p in prefixes):
            return None
        if any(keys[k][1] for k in needed):  # a value followed by a timestamp: the full path reads it
            return None
        # leaves renumbered to positions in ``needed``: the values are then a plain list
        position = {k: i for i, k in enumerate(needed)}
        unread = sorted(set(range(len(sample_pos))) - position.keys())
        return cls(len(raw), itemgetter(*comment_pos), tuple(raw[i] for i in comment_pos), itemgetter(*sample_pos),
                   tuple(prefixes), tuple(sample_pos[k] for k in unread), tuple(len(prefixes[k]) - 1 for k in unread),
                   itemgetter(*(sample_pos[k] for k in needed)),
                   tuple(slice(len(prefixes[k]), None) for k in needed),
                   *_compile(_map_leaves(b.recipe, position.__getitem__)))

    def read(self, text: str, timestamp: float) -> Snapshot | None:
        """The Snapshot of a body with this layout; None when it has another layout or when a
        value needs the full path (not a finite number ≥ 0, an inconsistent histogram)."""
        if "\ufffd" in text:  # counted as non_utf8 on any line (free on an ASCII body)
            return None
        lines = text.split("\n")
        if len(lines) != self.lines or lines[-1] or self.comment_at(lines) != self.comments:
            return None
        if not all(map(str.startswith, self.sample_at(lines), self.prefixes)):
            return None
        # something after every key (the readers drop a bare key as malformed, read or not); a
        # line whose value is converted below has it when float() reads it
        if not all(map(operator.gt, map(len, map(str.strip, map(lines.__getitem__, self.unread))),
                       self.unread_key_lengths)):
            return None
        strings = list(map(getitem, self.needed_at(lines), self.cuts))
        if "_" in "".join(strings):
            return None  # float() reads 1_000, the text format does not
        try:
            values = list(map(float, strings))
        except ValueError:
            return None
        # every value finite, ≥ 0 and ≤ MAX_VALUE (a NaN makes the sum NaN): none the reference would drop
        if not (min(values) >= 0 and max(values) <= MAX_VALUE and sum(values) < math.inf):
            return None
        snap, maps = self.evaluate(values, timestamp)
        for i in self.engine_hists:
            if not all(map(_consistent, maps[i].values())):
                return None
        return snap


def _sample_key(line: str) -> tuple[str, bool]:
    """(a clean sample line's key: its name and labels, whether a timestamp follows its value).
    The key ends at the labels' closing brace, or is a bare name without a space."""
    key = line.rpartition(" ")[0]
    if key.endswith("}") or " " not in key:
        return key, False
    return key.rpartition(" ")[0], True  # "key value timestamp": the value was cut as the timestamp


def _map_leaves(recipe: Snapshot, fn) -> Snapshot:
    """``recipe`` with every sample index i replaced by fn(i); shared maps stay shared."""
    memo: dict[int, dict] = {}

    def leaf(x):
        if x.__class__ is int:
            return fn(x)
        if x.__class__ is _HistRecipe:
            return _HistRecipe(None if x.sum is None else leaf(x.sum), leaf(x.count), x.edges, tuple(map(leaf, x.buckets)))
        return x.__class__(map(leaf, x))

    def mapping(m: Mapping[str, object]) -> dict:
        if id(m) not in memo:
            memo[id(m)] = {k: leaf(x) for k, x in m.items()}
        return memo[id(m)]

    def signals(r: ModelSignals) -> ModelSignals:
        return replace(r, counters=mapping(r.counters), histograms=mapping(r.histograms), gauges=mapping(r.gauges),
                       created=mapping(r.created), engines={e: signals(x) for e, x in r.engines.items()})

    return replace(recipe, models={m: signals(r) for m, r in recipe.models.items()})


class _Rejected(Exception):
    """prometheus-client's parser refused the body."""


def _body_lines(text: str) -> tuple[list[str], bool]:
    """Stripped non-empty lines, and whether the body was cut (no final newline: its
    unterminated last line is dropped, never read as a shorter number)."""
    lines = text.split("\n")
    truncated = False
    if lines and lines[-1] == "":
        lines.pop()
    elif lines and lines[-1].strip():
        lines.pop()
        truncated = True
    return [line for line in (raw.strip() for raw in lines) if line], truncated


def _parse(lines: list[str], truncated: bool, timestamp: float, read, b: _Builder | None = None) -> Snapshot:
    if not lines:  # a target answering 200 with nothing (a recorder killed mid-write) is not a scrape
        if truncated:  # one line and no newline: a JSON error, "Unauthorized", minified HTML, or cut
            raise ParseError("not Prometheus text exposition: one line without a final newline (an error "
                             "message or a page, not /metrics?)")
        raise ParseError("empty body: nothing to read (not even a comment line)")
    b = _Builder() if b is None else b
    if truncated:
        b.quirk("truncated")
    non_utf8 = sum("\ufffd" in line for line in lines)
    if non_utf8:
        b.quirk("non_utf8", non_utf8)
    read(b, lines)
    return _assemble(b, timestamp)


def _read_lines(b: _Builder, lines: list[str]) -> None:
    """kvhit's tolerant line reader (fallback): drops and counts malformed sample lines."""
    bad = total = 0
    for line in lines:
        if line[0] == "#":
            _comment(b, line)
            continue
        total += 1
        b.line += 1
        if not _sample(b, line):
            bad += 1
    if bad:
        b.quirk("malformed_line", bad)
        if 2 * bad > total:
            # what it looks like instead, so the URL gets checked (a newcomer saw a page counted in lines)
            looks = {"<": "; it looks like HTML or XML (a web page or a proxy's error page: check the URL)",
                     "{": "; it looks like JSON (an API's answer: check the URL's path)"}.get(lines[0][0], "")
            raise ParseError(f"not Prometheus text exposition: {bad} of {total} sample lines are malformed{looks}") from None


def _read_library(b: _Builder, lines: list[str]) -> None:
    """prometheus-client's parser (the reference); raises _Rejected when it refuses the body."""
    @functools.cache
    def written() -> frozenset[str]:  # the sample names as written, built only when asked
        return frozenset(line[:_HEAD.match(line).end()] for line in lines if line[0] != "#")

    for line in lines:  # HELP/TYPE as written (the library renames counter families)
        if line[0] == "#":
            _comment(b, line)
    families = text_string_to_metric_families("\n".join(lines) + "\n")
    while True:  # one family at a time in memory
        try:
            fam = next(families)
        except StopIteration:
            break
        except Exception:  # the library raises ValueError/IndexError/… on any malformed line
            raise _Rejected from None
        for s in fam.samples:
            b.line += 1
            name = s.name
            # the library names a counter's sample <family>_total, also when written without (a
            # gauge declared a counter); kvhit's reader reads it as written (a breaker: the running
            # gauge read or not by whether an unrelated line sent the body to the line reader)
            if fam.type == "counter" and name == fam.name + "_total" and fam.name in written():
                info = _name_info(name)
                name = name if info is None or info[4] or info[5] else fam.name
            if not _take(b, name, dict(s.labels), float(s.value)):
                raise _Rejected


def _comment(b: _Builder, line: str) -> None:
    parts = line[1:].split(None, 2)
    if len(parts) < 2 or parts[0] not in ("HELP", "TYPE") or not _NAME.match(parts[1]):
        return  # a plain comment, or a HELP/TYPE line too damaged to use
    engine, name = _strip_prefix(parts[1])
    if not engine:
        return
    b.families.setdefault(engine, set()).add(_hist_base(_counter_base(name)))
    if engine != "vllm":
        return
    b.declare(name)
    if parts[0] == "HELP" and len(parts) == 3:
        b.docs.setdefault(_counter_base(name), _unescape(parts[2]))


_HEAD = re.compile(r"[^{ \t]*")


@functools.lru_cache(maxsize=4096)
def _name_info(full: str) -> tuple | None:
    """(engine prefix, name without it, family, declared names, what kvhit reads, is _created) of a
    sample name; None when it is not a metric name. Cached: a body repeats few names many times."""
    if not _NAME.match(full):
        return None
    engine, name = _strip_prefix(full)
    family = _hist_base(_counter_base(name)) if engine else ""
    if engine != "vllm":
        return engine, name, family, (), None, False
    base = _hist_base(_counter_base(name[:-8] if name.endswith("_created") else name))
    what = _READ.get(name)
    created = what is None and name.endswith("_created")
    return engine, name, family, (name, _counter_base(name), _hist_base(name), base), what, created


def _sample(b: _Builder, line: str) -> bool:
    """Read one sample line; False when it is malformed."""
    end = _HEAD.match(line).end()
    info = _name_info(line[:end])
    if info is None:
        return False
    engine, name, family, declared, what, created = info
    if engine not in engines.TRANSLATED and (engine != "vllm" or (what is None and not created)):
        # Not read: a name and something after it is all that is checked.
        if engine:
            b.families.setdefault(engine, set()).add(family)
        if engine == "lmcache" and (m := _SAMPLE.match(line)) is not None:
            _lmcache_model(b, _labels(m.group(2)) or {})
        if engine == "vllm":
            b.sample_line(declared, "engine label" not in b.declared and bool(_ENGINE_LABEL.search(line, end)))
        return end < len(line)
    m = _SAMPLE.match(line)
    if m is None:
        return False
    labels = _labels(m.group(2))
    value = _value(m.group(3))
    if labels is None or value is None:
        return False
    return _take(b, line[:end], labels, value)


def _lmcache_model(b: _Builder, labels: Mapping[str, str]) -> None:
    if labels.get("model_name"):
        b.connector_models.add(labels["model_name"])


def _take(b: _Builder, full: str, labels: dict[str, str], value: float) -> bool:
    """Record one parsed sample (name as exposed, labels, value); False when malformed."""
    info = _name_info(full)
    if info is None:
        return False
    engine, name, family, declared, what, created = info
    if engine:
        b.families.setdefault(engine, set()).add(family)
    if engine == "lmcache":
        _lmcache_model(b, labels)
    if engine in engines.TRANSLATED:
        if not b.admit(engines.model_of(labels)):
            return True
        b.values[b.line] = value  # checked, as an info line's
        b.other.append((name, labels, value))
        b.prefixes.setdefault(engine, full[:len(engine) + 1])
        return True
    if engine != "vllm":
        return True
    if not b.admit(labels.get("model_name", ""), labels.get("engine")):  # before anything of it is counted, …
        return True
    b.sample_line(declared, "engine" in labels)
    if created:
        b.add("created", name[: -len("_created")], "", labels, value)
        return True
    if what is None:
        return True
    kind, base, part = what
    if kind == "info":
        # its value is checked (a line reading "abc" is malformed): the hot path converts it too,
        # or it took the labels of a line the reference drops (fuzzing)
        b.values[b.line] = value
        if "model_name" in labels:  # fleet mode: each model's pods' configuration (vLLM's own has none)
            b.model_cache_config[labels["model_name"]] = {k: v for k, v in labels.items() if k != "model_name"}
        elif not b.cache_config or labels.get("engine", "0") == "0":
            # engine 0's line, else the first: its engine label tells which line, no configuration (engine
            # 0's line missing, or the engines renumbered, read "engine 0 → 1": every fit afresh, adversarial test)
            b.cache_config = {k: v for k, v in labels.items() if k != "engine"}
    elif kind == "hist" and part == "bucket":
        le = labels.pop("le", None)
        edge = None if le is None else _value(le)
        if edge is None or math.isnan(edge):
            return False
        b.add("hist", base, f"le={edge!r}", labels, value)
    else:
        b.add(kind, base, part, labels, value)
    return True


# --- assembly -----------------------------------------------------------------------------


def _split(slot: Mapping[tuple, float], where: Mapping[str, str] | None = None
           ) -> dict[str, dict[str, list[tuple[tuple, float]]]]:
    """model → engine → [(key without model_name/engine, value)]."""
    out: dict[str, dict[str, list[tuple[tuple, float]]]] = {}
    for key, value in slot.items():
        labels = dict(key)
        if where and any(labels.get(k) != v for k, v in where.items()):
            continue
        model, engine = labels.pop("model_name", ""), labels.pop("engine", "")
        out.setdefault(model, {}).setdefault(engine, []).append((tuple(sorted(labels.items())), value))
    return out


class _Models:
    """Per-model, per-engine signals being assembled."""

    def __init__(self, b: _Builder) -> None:
        self.b = b
        self._families: dict[str, dict[str, set]] = {}  # model → engine → its families of the signals kvhit reads
        for (kind, base, _), slot in b.series.items():
            if kind in ("counter", "gauge", "hist"):
                for model, per in _split(slot).items():
                    families = self._families.setdefault(model, {})
                    for e in per:
                        families.setdefault(e, set()).add((kind, base))
        # model → engines seen on any of those signals (the data-parallel set to aggregate over; settle)
        self.engines: dict[str, set[str]] = {model: set(per) for model, per in self._families.items()}
        self.model: dict[str, dict[str, dict]] = {}  # model → field → canonical → value
        self.engine: dict[str, dict[str, dict[str, dict]]] = {}  # model → engine → field → ...
        self.incomplete: dict[str, set[str]] = {}
        self._put: list[tuple[str, str, str, Mapping[str, object], object]] = []  # summed in settle

    def put(self, field_: str, canon: str, model: str, per_engine: Mapping[str, object], combine) -> None:
        for e, v in per_engine.items():
            self.engine.setdefault(model, {}).setdefault(e, {}).setdefault(field_, {})[canon] = v
        self._put.append((field_, canon, model, per_engine, combine))

    def settle(self) -> None:
        """Keep each model's engines that have at least half as many families of the signals kvhit
        reads as its engine with the most, then form the model's values over them. A few series of
        another ``engine`` label (a stray copy, a partial paste) are no engine: summed in, one
        stray hits line left the model only hits, every other signal unknown (adversarial test).
        A series of a real engine dropped (a NaN), or a body cut inside one family (the engines
        list each family in turn), leaves it an engine: counted by its counters, a NaN hit counter
        on engine 1 of 2 had doubled the per-GPU TPM and restarted every fit (adversarial test),
        a body cut after engine 0's first counter left engine 1's gauges out of the sums, and
        counted by series, one cut inside engine 0's histogram, its buckets (reviews). A signal
        some kept engine lacks is unknown for the model, never a partial sum."""
        for model, seen in self.engines.items():
            families = self._families[model]
            top = max(map(len, families.values()))
            kept = {e for e in seen if 2 * len(families[e]) >= top}
            if kept != seen:
                self.b.quirk("engine_incomplete", len(seen - kept))
                self.engines[model] = kept
        for field_, canon, model, per_engine, combine in self._put:
            want = self.engines.get(model, set())
            if set(per_engine) >= want:
                value = combine([v for e, v in per_engine.items() if e in want])
                if value is not None:
                    self.model.setdefault(model, {}).setdefault(field_, {})[canon] = value
            elif canon not in LAZY_COUNTERS:  # those an engine creates at first use: one without has not used
                # it yet (no damage), and the model's total waits for every engine's (unknown until then)
                self.b.quirk("engine_incomplete")
                self.incomplete.setdefault(model, set()).add(canon)


def _assemble(b: _Builder, timestamp: float) -> Snapshot:
    for slot, key in b.ambiguous:
        b.series[slot].pop(key, None)
    if b.over:  # what was read of them before they named too many engines
        for slot in b.series.values():
            for key in [k for k in slot if dict(k).get("model_name", "") in b.over]:
                del slot[key]
                b.quirk("engines_over_limit")
    quirks = MappingProxyType(dict(b.quirks))
    if not b.families:
        return Snapshot(timestamp, "unknown", "no vLLM metrics in the exposition", {}, quirks=quirks)
    if "vllm" not in b.families:
        other = max(sorted(b.families), key=lambda e: len(b.families[e]))
        if other in engines.TRANSLATED:
            return _translated(b, other, timestamp)
        return Snapshot(timestamp, other, f"unsupported engine: {other}", {}, quirks=quirks)
    era, since = _era(b), _since(b)
    if not b.samples:
        return Snapshot(timestamp, era, "vLLM metric families declared but no samples yet (the engine has not logged)",
                        {}, quirks=quirks, since=since)

    acc = _Models(b)
    hit_unit: dict[str, str] = {}
    spelling: dict[str, int] = {}  # model → which of COUNTERS["queries"] its queries came from
    for canon, names in COUNTERS.items():
        done: set[str] = set()
        for i, exposed in enumerate(names):  # first exposed name present for the model wins
            slot = b.series.get(("counter", exposed, ""))
            if not slot:
                continue
            for model, per in _split(slot).items():
                if model in done:
                    continue
                if canon == "hits" and spelling.get(model, i) != i and _hit_unit(b, exposed, model) != hit_unit[model]:
                    # the other spelling than the queries' (one family missing) in another unit, or
                    # one not known (0.7–0.8 counted blocks): no hits, an unknown h
                    continue
                done.add(model)
                acc.put("counters", canon, model, {e: _sum(v for _, v in rows) for e, rows in per.items()}, _sum)
                if canon == "queries":
                    hit_unit[model], spelling[model] = _hit_unit(b, exposed, model), i
    for canon, (exposed, label, value) in LABELLED_COUNTERS.items():
        for model, per in _split(b.series.get(("counter", exposed, ""), {}), {label: value}).items():
            # the spelling by presence, usable or not: a NaN new one is unknown, never the old one's total
            if not any((name, model) in b.model_samples for name in COUNTERS.get(canon, ())):
                acc.put("counters", canon, model, {e: _sum(v for _, v in rows) for e, rows in per.items()}, _sum)

    for canon, (names, agg) in GAUGES.items():
        fn = _sum if agg == "sum" else _max
        sources: list[tuple[str, Mapping[str, str] | None]] = []
        if canon in LABELLED_GAUGES:
            exposed, label, value = LABELLED_GAUGES[canon]
            sources.append((exposed, {label: value}))
        sources += [(n, None) for n in names]
        done = set()
        for exposed, where in sources:
            for model, per in _split(b.series.get(("gauge", exposed, ""), {}), where).items():
                if model in done:
                    continue
                done.add(model)
                acc.put("gauges", canon, model, {e: fn(v for _, v in rows) for e, rows in per.items()}, fn)
            if where is not None:  # a labelled family exported (usable or not) is read alone: its
                # unusable value is unknown, never the plain gauge, which counts what it leaves out
                done |= {m for base, m in b.model_samples if base == exposed}

    for canon, names in HISTOGRAMS.items():
        done = set()
        for exposed in names:
            for model, per in _histograms(b, exposed).items():
                if model in done:
                    continue
                done.add(model)
                acc.put("histograms", canon, model, per, _sum_histograms)
    acc.settle()

    # Per series, not per family: a labelled series created later (a new label value appearing,
    # e.g. a new ``transfer_type``) would otherwise change the family's max and fake a restart.
    created: dict[str, dict[str, dict[str, object]]] = {}  # model → engine → key → ts (leaf)
    for (kind, base, _), slot in b.series.items():
        if kind != "created":
            continue
        for key, value in slot.items():
            labels = dict(key)
            model = labels.get("model_name", "")
            rest = ",".join(f'{k}="{v}"' for k, v in labels.items() if k != "model_name")
            created.setdefault(model, {}).setdefault(labels.get("engine", ""), {})[f"{base}{{{rest}}}"] = value

    models = {}
    since_of: dict[str, tuple[int, ...]] = {}  # model → what its own samples prove (Snapshot.model_since)
    for model, fields_ in acc.model.items():
        counters = fields_.get("counters", {})
        hists = fields_.get("histograms", {})
        gauges = fields_.get("gauges", {})
        if model == "" and not counters and not hists:
            continue  # e.g. label-less info gauges only
        if not (counters or hists or gauges):
            continue
        per_engine = {}
        for e in sorted(acc.engines.get(model, ())):
            f = acc.engine.get(model, {}).get(e, {})
            per_engine[e] = ModelSignals(
                counters=f.get("counters", {}), histograms=f.get("histograms", {}), gauges=f.get("gauges", {}),
                created=created.get(model, {}).get(e, {}), hit_unit=hit_unit.get(model, ""))
        unit = hit_unit.get(model, "")
        v0_no_data = "v0_hit_rate" in gauges and _ev(gauges["v0_hit_rate"], b.values) == -1.0
        since_of[model] = _since(b, model)
        unknown = _unknown_reasons(era, since_of[model], counters, v0_no_data, unit, acc.incomplete.get(model, set()),
                                   b.model_cache_config.get(model, b.cache_config), _connector(b, model, acc.model),
                                   _external_exposed(b, model))
        whole = {"counters": counters, "histograms": hists, "gauges": gauges,
                 "created": {k: v for e in per_engine for k, v in created.get(model, {}).get(e, {}).items()}}
        if len(per_engine) == 1:  # one engine: the model's maps are that engine's (evaluated once)
            (one,) = per_engine.values()
            whole = {k: getattr(one, k) if getattr(one, k) == m else m for k, m in whole.items()}
        models[model] = ModelSignals(**whole, hit_unit=unit, unknown=MappingProxyType(unknown),
                                     engines=per_engine)
    reason = ""
    if not models:
        reason = ("vLLM samples present but none of the signals kvhit reads (prefix-cache and token counters, "
                  "scheduler gauges, request histograms with a _count)")
        if acc.incomplete or b.quirks.get("histogram_inconsistent"):
            reason += " complete for every data-parallel engine"
    b.recipe = Snapshot(timestamp, era, reason, models, MappingProxyType(b.cache_config),
                        MappingProxyType(dict(b.quirks)), since,
                        model_cache_config=MappingProxyType({m: MappingProxyType(c) for m, c in b.model_cache_config.items()}),
                        model_since=MappingProxyType(since_of))
    return _compile(b.recipe)[0](b.values, timestamp)[0]


def _translated(b: _Builder, engine: str, timestamp: float) -> Snapshot:
    """An engine kvhit reads through exporter/engines.py: its samples renamed to vLLM's names,
    read as vLLM, then labelled with the engine and its own unknown reasons."""
    text, notes = engines.translate(engine, b.other)
    snap = parse_exposition(text, timestamp)
    models = {m: replace(sig, unknown=MappingProxyType(engines.unknown_reasons(engine, sig.counters, notes.get(m, {}))))
              for m, sig in snap.models.items()}
    quirks = dict(b.quirks)
    for k, v in snap.quirks.items():
        quirks[k] = quirks.get(k, 0) + v
    reason = "" if models else f"{engine} samples present but none of the signals kvhit reads"
    pooled = {m: n for m in models if (n := notes.get(m, {}).get("pooled_ranks"))}  # ranks summed in translation
    # those running requests at this scrape: busy at both ends of a step is not told apart (one scrape)
    busy = {m: notes[m]["busy_ranks"] for m in pooled}
    return replace(snap, engine=engine, reason=reason, models=MappingProxyType(models),
                   quirks=MappingProxyType(quirks), since=(), name_prefix=b.prefixes.get(engine, engine + ":"),
                   engine_counts=MappingProxyType(pooled), busy_counts=MappingProxyType(busy),
                   active_counts=MappingProxyType(busy))


def _hit_unit(b: _Builder, exposed: str, model: str) -> str:
    """Unit of ``model``'s prefix-cache counters: the HELP text says it; else what its version implies."""
    doc = b.docs.get(exposed, "").lower()
    if "block" in doc:
        return "blocks"
    if "token" in doc or exposed in ("prefix_cache_queries", "prefix_cache_hits") or _since(b, model) >= (0, 9, 2):
        return "tokens"
    return "unknown"  # gpu_prefix_cache_* without HELP: 0.7–0.8 counted blocks, 0.9+ tokens


_EXTERNAL = ("external_prefix_cache_hits", "external_prefix_cache_queries")


def _external_exposed(b: _Builder, model: str) -> bool:
    """Whether ``model``'s engine exports external_prefix_cache_*: a sample of it for the model,
    usable or not (fleet mode renders a sum not from every pod as NaN)."""
    return any((f, model) in b.model_samples for f in _EXTERNAL)


def _era(b: _Builder) -> str:
    running_help = b.docs.get("num_requests_running", "")
    if any(m in b.declared for m in _V0_MARKERS):
        return "vllm_v0"
    # V1's families before V0's HELP wording: llm-d-inference-sim keeps V0's "… running on GPU."
    # next to V1's token counters (its hit ratio was withheld as V0's, compatibility audit)
    if any(m in b.declared for m in _V1_MARKERS) or "execution batches" in running_help:
        return "vllm_v1"
    return "vllm_v0" if "on GPU" in running_help else "vllm"  # else a partial exposition that names no era


def _since(b: _Builder, model: str | None = None) -> tuple[int, ...]:
    # a family kvhit reads proves its version by a usable value only (fleet mode renders a family
    # it left out, some pods lacking it, as NaN), of ``model`` when given (fleet mode's body holds
    # every model's pods, each of its own version: one model's newer families proved every
    # model new); a family it does not read, by any sample line. Assembly asks once per model:
    # the samples are indexed once per body (per model, a pass over them all took 8 s at 4000 models)
    if b.usable_bases is None:
        b.read_bases = {base for base, _ in b.model_samples}
        b.usable_bases = {}
        for base, m in b.usable:
            b.usable_bases.setdefault(m, set()).add(base)
    if model not in b.since:
        usable = set().union(*b.usable_bases.values()) if model is None else b.usable_bases.get(model, set())
        proven = [v for name, v in _SINCE.items() if name in b.sampled and (name not in b.read_bases or name in usable)]
        b.since[model] = max(proven) if proven else ()
    return b.since[model]


def _histograms(b: _Builder, exposed: str) -> dict[str, dict[str, _HistRecipe]]:
    """model → engine → :class:`_HistRecipe`, summed over the engine's series that have a ``_count``.

    Sum and buckets add up over exactly those series: a ``_sum`` missing for one of them makes
    the sum unknown (NaN), a bucket edge missing for one of them is left out. A histogram whose
    cumulative counts decrease, exceed ``_count`` or whose +Inf bucket differs from ``_count``
    is inconsistent and left out (an engine with buckets but no ``_count`` has no histogram;
    the model's total is then incomplete, see :class:`_Models`).
    """
    parts = {part: slot for (kind, base, part), slot in b.series.items() if kind == "hist" and base == exposed}
    counts = parts.get("count")
    if not counts:
        return {}
    sums = parts.get("sum", {})
    edges = [(float(part[3:]), slot) for part, slot in parts.items() if part.startswith("le=")]
    groups: dict[tuple[str, str], list[tuple]] = {}
    for key in counts:
        labels = dict(key)
        groups.setdefault((labels.get("model_name", ""), labels.get("engine", "")), []).append(key)
    out: dict[str, dict[str, _HistRecipe]] = {}
    for (model, engine), keys in groups.items():
        count = _sum(counts[k] for k in keys)
        total = _sum(sums[k] for k in keys) if all(k in sums for k in keys) else None
        if total is not None and _ev(total, b.values) < 0:
            b.quirk("negative")  # vLLM histograms observe times and token counts, never below zero
            total = None
        buckets = sorted((le, _sum(slot[k] for k in keys)) for le, slot in edges if all(k in slot for k in keys))
        h = _HistRecipe(total, count, tuple(le for le, _ in buckets), tuple(x for _, x in buckets))
        if not _consistent(_ev_hist(h, b.values)):
            b.quirk("histogram_inconsistent")
            continue
        out.setdefault(model, {})[engine] = h
    return out


def _consistent(h: Histogram) -> bool:
    """Cumulative counts never decrease, never exceed ``_count``, and the +Inf bucket is ``_count``."""
    edges, counts = h.edges, h.counts
    if not counts:
        return True
    if counts[0] < 0 or not all(map(operator.le, counts, counts[1:])) or counts[-1] > h.count * (1 + 1e-9):
        return False
    return edges[-1] != math.inf or abs(counts[-1] - h.count) <= 1e-9 * max(1.0, h.count)


def _sum_histograms(parts: list[_HistRecipe]) -> _HistRecipe:
    edges = set(parts[0].edges).intersection(*(p.edges for p in parts[1:]))
    by_edge = [dict(zip(p.edges, p.buckets)) for p in parts]
    total = None if any(p.sum is None for p in parts) else _sum(p.sum for p in parts)
    return _HistRecipe(total, _sum(p.count for p in parts), tuple(sorted(edges)),
                       tuple(_sum(d[le] for d in by_edge) for le in sorted(edges)))


# --- leaves: the numbers of a Snapshot before evaluation ---------------------------------------
# A leaf is a sample-line index (int; its value is ``values[index]``), a _Sum or a _Max of leaves.
# Assembly works on leaves, so a body with the same layout as a cached one (same lines, other
# numbers) is evaluated again without being assembled again (:class:`Parser`).


class _Sum(tuple):
    """math.fsum of its leaves."""


class _Max(tuple):
    """max of its leaves (same series twice; gauges aggregated by max)."""


def _sum(leaves) -> object:
    leaves = tuple(leaves)
    return leaves[0] if len(leaves) == 1 else _Sum(leaves)


def _max(leaves) -> object:
    leaves = tuple(leaves)
    return leaves[0] if len(leaves) == 1 else _Max(leaves)


def _ev(leaf, values) -> float:
    if leaf.__class__ is int:
        return values[leaf]
    if leaf.__class__ is _Sum:
        return math.fsum(_ev(x, values) for x in leaf)
    return max(_ev(x, values) for x in leaf)


@dataclass(frozen=True)
class _HistRecipe:
    """A :class:`Histogram` as leaves: ``sum`` None when unknown (NaN), ``buckets`` per edge."""

    sum: object
    count: object
    edges: tuple[float, ...]
    buckets: tuple[object, ...]

    @functools.cached_property
    def counts(self):
        """values → bucket counts (one C call when every bucket is one sample)."""
        if len(self.buckets) >= 2 and all(x.__class__ is int for x in self.buckets):
            return itemgetter(*self.buckets)
        return lambda values: tuple(_ev(x, values) for x in self.buckets)


def _ev_hist(h: _HistRecipe, values) -> Histogram:
    return Histogram(math.nan if h.sum is None else _ev(h.sum, values), _ev(h.count, values), h.edges,
                     h.counts(values))


def _map_evaluator(m: Mapping[str, object]):
    """values → MappingProxyType of ``m`` (leaves or _HistRecipe) evaluated."""
    keys, leaves = tuple(m), tuple(m.values())
    if len(leaves) >= 2 and all(x.__class__ is int for x in leaves):
        get = itemgetter(*leaves)
        return lambda values: MappingProxyType(dict(zip(keys, get(values))))
    return lambda values: MappingProxyType({k: (_ev_hist if x.__class__ is _HistRecipe else _ev)(x, values)
                                            for k, x in zip(keys, leaves)})


def _compile(recipe: Snapshot):
    """(values, timestamp) → the Snapshot of ``recipe`` with those values, and the positions of
    the per-engine histogram maps in the evaluated maps (for consistency checks). A map shared
    by several ModelSignals of the recipe is evaluated once and shared in the result too."""
    slots: dict[int, int] = {}
    evaluators: list = []

    def slot(m: Mapping[str, object]) -> int:
        if id(m) not in slots:
            slots[id(m)] = len(evaluators)
            evaluators.append(_map_evaluator(m))
        return slots[id(m)]

    def shape(r: ModelSignals) -> tuple:
        return (slot(r.counters), slot(r.histograms), slot(r.gauges), slot(r.created), r.hit_unit, r.unknown,
                tuple((e, shape(x)) for e, x in r.engines.items()))

    shapes = tuple((name, shape(r)) for name, r in recipe.models.items())
    engine_hists = tuple({sh[1] for _, model in shapes for _, sh in model[6]})

    def signals(maps: list, sh: tuple) -> ModelSignals:
        c, h, g, cr, unit, unknown, per_engine = sh
        return ModelSignals(maps[c], maps[h], maps[g], maps[cr], unit, unknown,
                            MappingProxyType({e: signals(maps, x) for e, x in per_engine}))

    def run(values, timestamp: float) -> tuple[Snapshot, list]:
        maps = [f(values) for f in evaluators]
        models = MappingProxyType({name: signals(maps, sh) for name, sh in shapes})
        return replace(recipe, timestamp=timestamp, models=models), maps

    return run, engine_hists


# kv_offloading_size values that mean offloading is on: a decimal with a non-zero digit (RE2 and
# Python re alike; the recording rules use this very pattern, so kvhit and Prometheus agree).
OFFLOAD_SIZE_ON = r"[0-9.]*[1-9][0-9.]*(?:[eE][+-]?[0-9]+)?"


def offload_configured(cache_config: Mapping[str, str]) -> bool | None:
    """Whether ``cache_config_info`` shows KV offloading (None when the info metric is absent).

    ``kv_offloading_size`` is a size in GiB when offloading is on and "None"/"0" when off
    (vLLM ≥ 0.11; reference §4.1): on when it matches ``OFFLOAD_SIZE_ON``. Older versions
    without that label have no native offload.
    """
    if not cache_config:
        return None
    return re.fullmatch(OFFLOAD_SIZE_ON, cache_config.get("kv_offloading_size", "None")) is not None


def prefix_caching_off(cache_config: Mapping[str, str]) -> bool:
    """Whether ``cache_config_info`` says prefix caching is off (``enable_prefix_caching`` False):
    vLLM then counts no prefix-cache query, and a hit ratio is not 0 % but not defined."""
    return str(cache_config.get("enable_prefix_caching", "")).lower() == "false"


PREFIX_CACHING_OFF = ('prefix caching is off (cache_config_info enable_prefix_caching="False"): vLLM counts no '
                      "prefix-cache query, so there is no hit ratio")
# why a value a scrape shows is not read (the quirks counted in kvhit_input_quirks_total)
DROPPED = "dropped as NaN, out of range, negative or duplicated: see kvhit_input_quirks_total"


def _connector(b: _Builder, model: str, models: Mapping[str, object]) -> bool:
    """Whether LMCache (a KV connector) serves ``model``: its samples name it (``model_name``, as
    fleet mode renders them per model), or the exposition has LMCache metrics none of whose
    ``model_name`` is one of vLLM's ``models`` (a pod's LMCache names the model by its path, not
    by vLLM's served name: every model of the body)."""
    if "lmcache" not in b.families:
        return False
    return model in b.connector_models or not b.connector_models & models.keys()


def _unknown_reasons(era: str, since: tuple[int, ...], counters: Mapping[str, object], v0_no_data: bool,
                     hit_unit: str, incomplete: set[str], cache_config: Mapping[str, str],
                     connector: bool, external_exposed: bool) -> dict[str, str]:
    """Signal → why it is unknown, for one model. ``connector``: a KV connector's own metrics
    (``lmcache:``) are in the exposition, which cache_config_info never shows (MODEL.md §2: h_load
    is 0 only when no connector or offloading is in use). ``external_exposed``: the model's
    engine exports ``external_prefix_cache_*`` (:func:`_external_exposed`): vLLM ≥ 0.11.1 exports
    both at 0 without a connector, so hits that cannot be read from it are unknown, never 0; so are
    they when ``since`` proves such a vLLM and the body has neither (a review removed the family
    mid-run: the loaded hit ratio read 0, not unknown, once the drop left the window)."""
    reasons: dict[str, str] = {}
    if era == "vllm_v0":
        reasons["hit_ratio"] = ("vLLM V0 exports only gpu_prefix_cache_hit_rate, a lifetime block-level "
                                "gauge: the token hit ratio cannot be windowed")
        if v0_no_data:
            reasons["hit_ratio"] += " (its value -1 means no data: prefix caching off or no query yet)"
    elif prefix_caching_off(cache_config):
        reasons["hit_ratio"] = PREFIX_CACHING_OFF
    elif incomplete & {"queries", "hits"}:
        reasons["hit_ratio"] = ("prefix_cache_queries/hits missing for some data-parallel engines of this model "
                                "(cut or partial body): a partial sum would be wrong")
    elif "queries" not in counters or "hits" not in counters:
        reasons["hit_ratio"] = (f"no usable prefix_cache_queries/hits counters (absent, or {DROPPED}; fleet mode: "
                                "not from every pod, e.g. pods of another vLLM version)")
    elif hit_unit == "unknown":
        reasons["hit_ratio"] = ("gpu_prefix_cache_* without HELP text and no sign of vLLM >= 0.9: counted in "
                                "blocks (0.7-0.8) or tokens (0.9+) cannot be told")
    if "external_hits" not in counters and era != "vllm_v0":
        offload = offload_configured(cache_config)
        if "external_hits" in incomplete:
            reasons["hit_ratio_loaded"] = "external_prefix_cache_hits missing for some data-parallel engines"
        elif external_exposed:  # the engine counts a connector's hits, unreadable here
            reasons["hit_ratio_loaded"] = ("external_prefix_cache_* exposed without a usable external_prefix_cache_hits "
                                           f"(absent, or {DROPPED}; fleet mode: not from every pod): the loaded hits "
                                           "are unknown")
        elif since >= _SINCE["external_prefix_cache_queries"]:  # this vLLM exports them: cut from the body
            reasons["hit_ratio_loaded"] = (f"no external_prefix_cache_* counters from a vLLM >= "
                                           f"{'.'.join(map(str, since))} (its other families prove it), which exports "
                                           "them (at 0 without a KV connector): the loaded hits are unknown")
        elif offload is None:
            reasons["hit_ratio_loaded"] = ("no external_prefix_cache_* counters (vLLM < 0.11.1) and no "
                                           "cache_config_info to rule out a KV connector")
        elif offload:
            reasons["hit_ratio_loaded"] = "KV offloading is configured but no external_prefix_cache_* counters"
        elif connector:
            reasons["hit_ratio_loaded"] = ("LMCache metrics in the exposition (a KV connector) but no "
                                           "external_prefix_cache_* counters (vLLM < 0.11.1): its hits are not counted")
    return reasons
