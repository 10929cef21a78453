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
* NaN/±Inf samples (``non_finite``) and negative counters / histogram counts (``negative``) are
  ignored; the same series twice keeps the larger value (``duplicate_series``); a gauge duplicated
  per API-server ``pid`` (vLLM 0.9.2–0.11.0 multiprocess bug) is one value (max), never a sum
  (``pid_duplicate``).
* Counters and histograms are summed over data-parallel ``engine`` labels, running/waiting
  summed, KV usage max over engines — only when EVERY engine of the model has the signal: a signal
  missing for one engine (a cut body, a partial paste) is unknown, never a partial sum
  (``engine_incomplete``). Per-engine values are kept (:attr:`ModelSignals.engines`) so that steps
  detect a restart per engine.
* A histogram whose cumulative buckets decrease, exceed ``_count``, or whose ``+Inf`` bucket is
  not ``_count`` is left out (``histogram_inconsistent``); bucket edges are read from the scrape
  (custom, CUDA-graph, 1-2-5 edges all work; no edge is assumed).
* ``prefix_cache_*`` wins over the deprecated ``gpu_prefix_cache_*`` (0.10); the latter counted
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
for a valid name and counted, which keeps a 600-line vLLM 0.32 body at about a millisecond.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

from prometheus_client.parser import text_string_to_metric_families

from exporter import engines

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
# Counters kept per label value: canonical name → (exposed base, label, value).
LABELLED_COUNTERS: dict[str, tuple[str, str, str]] = {
    "prompt_local_compute": ("prompt_tokens_by_source", "source", "local_compute"),
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
# Lowest vLLM version proven by a declared family (reference §4, §5); "engine label" = 0.8.3.
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
_HIST_SUFFIXES = ("_bucket", "_sum", "_count")

QUIRKS = ("truncated", "malformed_line", "non_utf8", "non_finite", "negative", "duplicate_series",
          "pid_duplicate", "engine_incomplete", "histogram_inconsistent")


class ParseError(ValueError):
    """The body is not Prometheus text exposition (message names the problem, never the body)."""


@dataclass(frozen=True)
class Histogram:
    """Cumulative histogram summed over engines: ``buckets`` are (le, cumulative count), ascending."""

    sum: float
    count: float
    buckets: tuple[tuple[float, float], ...] = ()


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
        cache_config: labels of ``vllm:cache_config_info`` (first engine), {} when absent.
        quirks: quirk (see :data:`QUIRKS`) → how many lines/series it affected in this body.
        since: lowest vLLM version the declared families prove, () when none does.
    """

    timestamp: float
    engine: str
    reason: str
    models: Mapping[str, ModelSignals]
    cache_config: Mapping[str, str] = field(default_factory=dict)
    quirks: Mapping[str, int] = field(default_factory=dict)
    since: tuple[int, ...] = ()

    @property
    def supported(self) -> bool:
        return self.engine.startswith("vllm") or self.engine in engines.TRANSLATED


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
        self.samples = 0
        self.families: dict[str, set[str]] = {}  # engine prefix → family names
        self.cache_config: dict[str, str] = {}
        self.quirks: dict[str, int] = {}
        self.other: list[tuple[str, dict[str, str], float]] = []  # samples of a translated engine

    def quirk(self, kind: str, n: int = 1) -> None:
        self.quirks[kind] = self.quirks.get(kind, 0) + n

    def declare(self, name: str) -> None:
        base = _hist_base(_counter_base(name[:-8] if name.endswith("_created") else name))
        self.declared.update((name, _counter_base(name), _hist_base(name), base))

    def add(self, kind: str, base: str, part: str, labels: Mapping[str, str], value: float) -> None:
        if not math.isfinite(value):
            self.quirk("non_finite")  # NaN/±Inf samples carry no usable count
            return
        if value < 0 and (kind == "counter" or (kind == "hist" and part != "sum")):
            self.quirk("negative")  # a counter or an observation count is never below zero
            return
        key = tuple(sorted((k, v) for k, v in labels.items() if k != "pid"))
        slot = self.series.setdefault((kind, base, part), {})
        if key in slot:
            self.quirk("pid_duplicate" if "pid" in labels else "duplicate_series")
            slot[key] = max(slot[key], value)
        else:
            slot[key] = value


def parse_exposition(text: str, timestamp: float) -> Snapshot:
    """Parse Prometheus text exposition into a :class:`Snapshot` (MODEL.md §2).

    The body is read with prometheus-client's parser (the reference). When that parser rejects
    the body as a whole (one malformed or cut line is enough), kvhit's tolerant line reader
    takes over: malformed lines are dropped and counted, the rest is kept. Both feed the same
    assembly, and tests/test_parse_reference.py proves they give identical Snapshots.

    Args:
        text: exposition body (str; decode bytes as UTF-8 with replacement first).
        timestamp: scrape time [unix s].
    Raises:
        ParseError: the body is not text exposition: more than half of its sample lines are
            malformed (message without the body).
    """
    lines, truncated = _body_lines(text)
    try:
        return _parse(lines, truncated, timestamp, _read_library)
    except _Rejected:
        return _parse(lines, truncated, timestamp, _read_lines)


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


def _parse(lines: list[str], truncated: bool, timestamp: float, read) -> Snapshot:
    b = _Builder()
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
        if not _sample(b, line):
            bad += 1
    if bad:
        b.quirk("malformed_line", bad)
        if 2 * bad > total:
            raise ParseError(f"not Prometheus text exposition: {bad} of {total} sample lines are malformed") from None


def _read_library(b: _Builder, lines: list[str]) -> None:
    """prometheus-client's parser (the reference); raises _Rejected when it refuses the body."""
    for line in lines:  # HELP/TYPE as written (the library renames counter families)
        if line[0] == "#":
            _comment(b, line)
    try:
        families = list(text_string_to_metric_families("\n".join(lines) + "\n"))
    except Exception:  # the library raises ValueError/IndexError/… on any malformed line
        raise _Rejected from None
    for fam in families:
        for s in fam.samples:
            if not _take(b, s.name, dict(s.labels), float(s.value)):
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
        if engine == "vllm":
            b.samples += 1
            b.declared.update(declared)
            if "engine label" not in b.declared and _ENGINE_LABEL.search(line, end):
                b.declared.add("engine label")
        return end < len(line)
    m = _SAMPLE.match(line)
    if m is None:
        return False
    labels = _labels(m.group(2))
    value = _value(m.group(3))
    if labels is None or value is None:
        return False
    return _take(b, line[:end], labels, value)


def _take(b: _Builder, full: str, labels: dict[str, str], value: float) -> bool:
    """Record one parsed sample (name as exposed, labels, value); False when malformed."""
    info = _name_info(full)
    if info is None:
        return False
    engine, name, family, declared, what, created = info
    if engine:
        b.families.setdefault(engine, set()).add(family)
    if engine in engines.TRANSLATED:
        b.other.append((name, labels, value))
        return True
    if engine != "vllm":
        return True
    b.samples += 1
    b.declared.update(declared)
    if "engine" in labels:
        b.declared.add("engine label")
    if created:
        b.add("created", name[: -len("_created")], "", labels, value)
        return True
    if what is None:
        return True
    kind, base, part = what
    if kind == "info":
        if not b.cache_config or labels.get("engine", "0") == "0":
            b.cache_config = dict(labels)
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
        # model → engines seen on any signal kvhit reads (the data-parallel set to aggregate over)
        self.engines: dict[str, set[str]] = {}
        for (kind, _, _), slot in b.series.items():
            if kind in ("counter", "gauge", "hist"):
                for model, per in _split(slot).items():
                    self.engines.setdefault(model, set()).update(per)
        self.model: dict[str, dict[str, dict]] = {}  # model → field → canonical → value
        self.engine: dict[str, dict[str, dict[str, dict]]] = {}  # model → engine → field → ...
        self.incomplete: dict[str, set[str]] = {}

    def put(self, field_: str, canon: str, model: str, per_engine: Mapping[str, object], combine) -> None:
        for e, v in per_engine.items():
            self.engine.setdefault(model, {}).setdefault(e, {}).setdefault(field_, {})[canon] = v
        if set(per_engine) >= self.engines.get(model, set()):
            value = combine(list(per_engine.values()))
            if value is not None:
                self.model.setdefault(model, {}).setdefault(field_, {})[canon] = value
        else:
            self.b.quirk("engine_incomplete")
            self.incomplete.setdefault(model, set()).add(canon)


def _assemble(b: _Builder, timestamp: float) -> Snapshot:
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
    for canon, names in COUNTERS.items():
        done: set[str] = set()
        for exposed in names:  # first exposed name present for the model wins
            slot = b.series.get(("counter", exposed, ""))
            if not slot:
                continue
            for model, per in _split(slot).items():
                if model in done:
                    continue
                done.add(model)
                acc.put("counters", canon, model, {e: math.fsum(v for _, v in rows) for e, rows in per.items()},
                        math.fsum)
                if canon == "queries":
                    hit_unit[model] = _hit_unit(b, exposed)
    for canon, (exposed, label, value) in LABELLED_COUNTERS.items():
        for model, per in _split(b.series.get(("counter", exposed, ""), {}), {label: value}).items():
            acc.put("counters", canon, model, {e: math.fsum(v for _, v in rows) for e, rows in per.items()}, math.fsum)

    for canon, (names, agg) in GAUGES.items():
        fn = math.fsum if agg == "sum" else max
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
                acc.put("gauges", canon, model, {e: fn([v for _, v in rows]) for e, rows in per.items()}, fn)

    for canon, names in HISTOGRAMS.items():
        done = set()
        for exposed in names:
            for model, per in _histograms(b, exposed).items():
                if model in done:
                    continue
                done.add(model)
                acc.put("histograms", canon, model, per, _sum_histograms)

    # Per series, not per family: a labelled series created later (a new label value appearing,
    # e.g. a new ``transfer_type``) would otherwise change the family's max and fake a restart.
    created: dict[str, dict[str, dict[str, float]]] = {}  # model → engine → key → ts
    for (kind, base, _), slot in b.series.items():
        if kind != "created":
            continue
        for key, value in slot.items():
            labels = dict(key)
            model = labels.get("model_name", "")
            rest = ",".join(f'{k}="{v}"' for k, v in labels.items() if k != "model_name")
            created.setdefault(model, {}).setdefault(labels.get("engine", ""), {})[f"{base}{{{rest}}}"] = value

    models = {}
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
                counters=MappingProxyType(f.get("counters", {})),
                histograms=MappingProxyType(f.get("histograms", {})),
                gauges=MappingProxyType(f.get("gauges", {})),
                created=MappingProxyType(created.get(model, {}).get(e, {})),
                hit_unit=hit_unit.get(model, ""))
        unit = hit_unit.get(model, "")
        unknown = _unknown_reasons(era, since, counters, gauges, unit, acc.incomplete.get(model, set()),
                                   b.cache_config)
        models[model] = ModelSignals(
            counters=MappingProxyType(counters),
            histograms=MappingProxyType(hists),
            gauges=MappingProxyType(gauges),
            created=MappingProxyType({k: v for per in created.get(model, {}).values() for k, v in per.items()}),
            hit_unit=unit,
            unknown=MappingProxyType(unknown),
            engines=MappingProxyType(per_engine),
        )
    reason = ""
    if not models:
        reason = ("vLLM samples present but none of the signals kvhit reads (prefix-cache and token counters, "
                  "scheduler gauges, request histograms with a _count)")
        if acc.incomplete or b.quirks.get("histogram_inconsistent"):
            reason += " complete for every data-parallel engine"
    return Snapshot(timestamp, era, reason, MappingProxyType(models), MappingProxyType(b.cache_config),
                    MappingProxyType(dict(b.quirks)), since)


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
    return replace(snap, engine=engine, reason=reason, models=MappingProxyType(models),
                   quirks=MappingProxyType(quirks), since=())


def _hit_unit(b: _Builder, exposed: str) -> str:
    """Unit of the prefix-cache counters: the HELP text says it; else what the version implies."""
    doc = b.docs.get(exposed, "").lower()
    if "block" in doc:
        return "blocks"
    if "token" in doc or exposed == "prefix_cache_queries" or _since(b) >= (0, 9, 2):
        return "tokens"
    return "unknown"  # gpu_prefix_cache_* without HELP: 0.7–0.8 counted blocks, 0.9+ tokens


def _era(b: _Builder) -> str:
    running_help = b.docs.get("num_requests_running", "")
    if any(m in b.declared for m in _V0_MARKERS) or "on GPU" in running_help:
        return "vllm_v0"
    if any(m in b.declared for m in _V1_MARKERS) or "execution batches" in running_help:
        return "vllm_v1"
    return "vllm"  # a partial exposition that names no era


def _since(b: _Builder) -> tuple[int, ...]:
    proven = [v for name, v in _SINCE.items() if name in b.declared]
    return max(proven) if proven else ()


def _histograms(b: _Builder, exposed: str) -> dict[str, dict[str, Histogram]]:
    """model → engine → :class:`Histogram`, summed over the engine's series that have a ``_count``.

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
    out: dict[str, dict[str, Histogram]] = {}
    for (model, engine), keys in groups.items():
        count = math.fsum(counts[k] for k in keys)
        total = math.fsum(sums[k] for k in keys) if all(k in sums for k in keys) else math.nan
        if total < 0:
            b.quirk("negative")  # vLLM histograms observe times and token counts, never below zero
            total = math.nan
        buckets = sorted((le, math.fsum(slot[k] for k in keys)) for le, slot in edges if all(k in slot for k in keys))
        if not _consistent(buckets, count):
            b.quirk("histogram_inconsistent")
            continue
        out.setdefault(model, {})[engine] = Histogram(sum=total, count=count, buckets=tuple(buckets))
    return out


def _consistent(buckets: list[tuple[float, float]], count: float) -> bool:
    previous = 0.0
    for le, c in buckets:
        if c < previous or c > count * (1 + 1e-9):
            return False
        if math.isinf(le) and le > 0 and abs(c - count) > 1e-9 * max(1.0, count):
            return False
        previous = c
    return True


def _sum_histograms(parts: list[Histogram]) -> Histogram:
    edges = set(le for le, _ in parts[0].buckets).intersection(*({le for le, _ in p.buckets} for p in parts[1:]))
    buckets = tuple((le, math.fsum(dict(p.buckets)[le] for p in parts)) for le in sorted(edges))
    total = math.fsum(p.sum for p in parts) if all(math.isfinite(p.sum) for p in parts) else math.nan
    return Histogram(sum=total, count=math.fsum(p.count for p in parts), buckets=buckets)


def offload_configured(cache_config: Mapping[str, str]) -> bool | None:
    """Whether ``cache_config_info`` shows KV offloading (None when the info metric is absent).

    ``kv_offloading_size`` is a size in GiB when offloading is on and "None"/"0" when off
    (vLLM ≥ 0.11; reference §4.1). Older versions without that label have no native offload.
    """
    if not cache_config:
        return None
    size = cache_config.get("kv_offloading_size", "None")
    try:
        return float(size) > 0
    except ValueError:
        return False


def _unknown_reasons(era: str, since: tuple[int, ...], counters: Mapping[str, float], gauges: Mapping[str, float],
                     hit_unit: str, incomplete: set[str], cache_config: Mapping[str, str]) -> dict[str, str]:
    reasons: dict[str, str] = {}
    if era == "vllm_v0":
        reasons["hit_ratio"] = ("vLLM V0 exports only gpu_prefix_cache_hit_rate, a lifetime block-level "
                                "gauge: the token hit ratio cannot be windowed")
        if gauges.get("v0_hit_rate") == -1.0:
            reasons["hit_ratio"] += " (its value -1 means no data: prefix caching off or no query yet)"
    elif incomplete & {"queries", "hits"}:
        reasons["hit_ratio"] = ("prefix_cache_queries/hits missing for some data-parallel engines of this model "
                                "(cut or partial body): a partial sum would be wrong")
    elif "queries" not in counters or "hits" not in counters:
        reasons["hit_ratio"] = "no prefix_cache_queries/hits counters in the exposition"
    elif hit_unit == "unknown":
        reasons["hit_ratio"] = ("gpu_prefix_cache_* without HELP text and no sign of vLLM >= 0.9: counted in "
                                "blocks (0.7-0.8) or tokens (0.9+) cannot be told")
    if "external_hits" not in counters and era != "vllm_v0":
        offload = offload_configured(cache_config)
        if "external_hits" in incomplete:
            reasons["hit_ratio_loaded"] = "external_prefix_cache_hits missing for some data-parallel engines"
        elif offload is None:
            reasons["hit_ratio_loaded"] = ("no external_prefix_cache_* counters (vLLM < 0.11.1) and no "
                                           "cache_config_info to rule out a KV connector")
        elif offload:
            reasons["hit_ratio_loaded"] = "KV offloading is configured but no external_prefix_cache_* counters"
    return reasons
