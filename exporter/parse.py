"""Exposition text → :class:`Snapshot` of canonical signals per ``model_name`` (MODEL.md §2).

Parsing uses prometheus-client's text parser. Engine eras and their quirks are recognised here
(reference: vllm-metrics.md §1, §2, §7):

* ``vllm:`` and ``vllm_`` prefixes; counters with or without ``_total``; ``*_created`` is not data.
* counters and histograms are summed over data-parallel ``engine`` labels; running/waiting summed;
  KV usage is the max over engines; a series duplicated per API-server ``pid`` is one value (max).
* ``prefix_cache_*`` wins over the deprecated ``gpu_prefix_cache_*`` (0.10); the latter counted
  BLOCKS in 0.7–0.8 (HELP says "blocks"), TOKENS from 0.9.
* V0 only has a lifetime, block-level hit-rate gauge: the token hit ratio is then unknown.
* SGLang / LMCache expositions parse, but are reported as an unsupported engine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

from prometheus_client.parser import text_string_to_metric_families

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
}
# Families only V0 (or the pre-prometheus_client 0.2.x server) ever declared (reference §3, §5).
_V0_MARKERS = ("gpu_prefix_cache_hit_rate", "num_requests_swapped", "cpu_cache_usage_perc",
               "cpu_prefix_cache_hit_rate", "avg_prompt_throughput_toks_per_s",
               "avg_generation_throughput_toks_per_s", "time_in_queue_requests")
# Evidence of the V1 engine: the engine label (0.8.3+), V1-only counters, V1's HELP text.
_V1_MARKERS = ("engine label", "prefix_cache_queries", "gpu_prefix_cache_queries", "external_prefix_cache_queries")
_OTHER_ENGINES = ("sglang", "lmcache")
_HIST_SUFFIXES = ("_bucket", "_sum", "_count")


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
        hit_unit: "tokens" or "blocks" (0.7–0.8 ``gpu_prefix_cache_*``), "" when no hit counter.
        unknown: signal → reason it is unknown (e.g. "hit_ratio").
    """

    counters: Mapping[str, float]
    histograms: Mapping[str, Histogram]
    gauges: Mapping[str, float]
    created: Mapping[str, float] = field(default_factory=dict)
    hit_unit: str = ""
    unknown: Mapping[str, str] = field(default_factory=dict)


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
    """

    timestamp: float
    engine: str
    reason: str
    models: Mapping[str, ModelSignals]
    cache_config: Mapping[str, str] = field(default_factory=dict)

    @property
    def supported(self) -> bool:
        return self.engine.startswith("vllm")


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


def _dedupe_key(labels: Mapping[str, str], drop: tuple[str, ...]) -> tuple:
    return tuple(sorted((k, v) for k, v in labels.items() if k not in drop))


class _Builder:
    """Collects raw series of one exposition before aggregation."""

    def __init__(self) -> None:
        # (kind, exposed base, part) → series key → value; series key excludes ``pid`` so
        # per-pid duplicates collapse to one value (max), never a sum.
        self.series: dict[tuple[str, str, str], dict[tuple, float]] = {}
        self.docs: dict[str, str] = {}
        self.declared: set[str] = set()  # vLLM family names seen (with or without samples)
        self.samples = 0
        self.prefixes: dict[str, int] = {}
        self.cache_config: dict[str, str] = {}

    def add(self, kind: str, base: str, part: str, labels: Mapping[str, str], value: float) -> None:
        if not math.isfinite(value):
            return  # NaN/±Inf samples carry no usable count
        key = _dedupe_key(labels, ("pid",))
        slot = self.series.setdefault((kind, base, part), {})
        slot[key] = max(slot.get(key, -math.inf), value)


def parse_exposition(text: str, timestamp: float) -> Snapshot:
    """Parse Prometheus text exposition into a :class:`Snapshot` (MODEL.md §2).

    Args:
        text: exposition body (str; decode bytes as UTF-8 with replacement first).
        timestamp: scrape time [unix s].
    Raises:
        ParseError: the text is not valid exposition (message without the body).
    """
    b = _Builder()
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises ValueError/IndexError/… on malformed lines
        raise ParseError(f"malformed exposition: {type(exc).__name__}") from None
    for fam in families:
        engine, fam_name = _strip_prefix(fam.name)
        if engine:
            b.prefixes[engine] = b.prefixes.get(engine, 0) + 1
        if engine == "vllm":
            b.declared.add(fam_name)
            if fam.documentation:
                b.docs.setdefault(_counter_base(fam_name), fam.documentation)
        for s in fam.samples:
            engine, name = _strip_prefix(s.name)
            if engine != "vllm":
                continue
            b.samples += 1
            b.declared.add(_hist_base(name))
            if "engine" in s.labels:
                b.declared.add("engine label")
            if name.endswith("_created"):
                b.add("created", name[: -len("_created")], "", s.labels, float(s.value))
            else:
                _classify(b, name, s.labels, float(s.value))
    return _assemble(b, timestamp)


def _classify(b: _Builder, name: str, labels: Mapping[str, str], value: float) -> None:
    if name == "cache_config_info":
        if not b.cache_config or labels.get("engine", "0") == "0":
            b.cache_config = dict(labels)
        return
    for suffix in _HIST_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in _HIST_NAMES:
            base = name[: -len(suffix)]
            if suffix == "_bucket":
                le = labels.get("le")
                rest = {k: v for k, v in labels.items() if k != "le"}
                b.add("hist", base, f"le={le}", rest, value)
            else:
                b.add("hist", base, suffix[1:], labels, value)
            return
    base = _counter_base(name)
    if base in _COUNTER_NAMES:
        b.add("counter", base, "", labels, value)
    elif name in _GAUGE_NAMES:
        b.add("gauge", name, "", labels, value)


_HIST_NAMES = {n for names in HISTOGRAMS.values() for n in names}
_COUNTER_NAMES = {n for names in COUNTERS.values() for n in names} | {
    base for base, _, _ in LABELLED_COUNTERS.values()}
_GAUGE_NAMES = {n for names, _ in GAUGES.values() for n in names}


def _by_model(slot: Mapping[tuple, float], where: Mapping[str, str] | None = None) -> dict[str, list[tuple[dict, float]]]:
    out: dict[str, list[tuple[dict, float]]] = {}
    for key, value in slot.items():
        labels = dict(key)
        if where and any(labels.get(k) != v for k, v in where.items()):
            continue
        out.setdefault(labels.get("model_name", ""), []).append((labels, value))
    return out


def _assemble(b: _Builder, timestamp: float) -> Snapshot:
    if not b.prefixes:
        return Snapshot(timestamp, "unknown", "no vLLM metrics in the exposition", {})
    if "vllm" not in b.prefixes:
        other = max(b.prefixes, key=b.prefixes.get)
        return Snapshot(timestamp, other, f"unsupported engine: {other}", {})
    era = _era(b)
    if not b.samples:
        return Snapshot(timestamp, era, "vLLM metric families declared but no samples yet (the engine has not logged)", {})

    counters: dict[str, dict[str, float]] = {}
    hit_unit: dict[str, str] = {}
    for canon, names in COUNTERS.items():
        for exposed in names:
            slot = b.series.get(("counter", exposed, ""))
            if not slot:
                continue
            for model, rows in _by_model(slot).items():
                if canon in counters.setdefault(model, {}):
                    continue
                counters[model][canon] = sum(v for _, v in rows)
                if canon == "queries":
                    doc = b.docs.get(exposed, "")
                    hit_unit[model] = "blocks" if "blocks" in doc else "tokens"
    for canon, (exposed, label, value) in LABELLED_COUNTERS.items():
        slot = b.series.get(("counter", exposed, ""), {})
        for model, rows in _by_model(slot, {label: value}).items():
            counters.setdefault(model, {})[canon] = sum(v for _, v in rows)

    gauges: dict[str, dict[str, float]] = {}
    for canon, (names, agg) in GAUGES.items():
        for exposed in names:
            slot = b.series.get(("gauge", exposed, ""))
            if not slot:
                continue
            for model, rows in _by_model(slot).items():
                if canon not in gauges.setdefault(model, {}):
                    values = [v for _, v in rows if math.isfinite(v)]
                    if values:
                        gauges[model][canon] = sum(values) if agg == "sum" else max(values)

    hists: dict[str, dict[str, Histogram]] = {}
    for canon, names in HISTOGRAMS.items():
        for exposed in names:
            h = _histograms(b, exposed)
            for model, hist in h.items():
                hists.setdefault(model, {}).setdefault(canon, hist)

    # Per series, not per family: a labelled series created later (a new label value appearing,
    # e.g. a new ``transfer_type``) would otherwise change the family's max and fake a restart.
    created: dict[str, dict[str, float]] = {}
    for (kind, base, _), slot in b.series.items():
        if kind != "created":
            continue
        for model, rows in _by_model(slot).items():
            for labels, value in rows:
                rest = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "model_name")
                created.setdefault(model, {})[f"{base}{{{rest}}}"] = value

    models = {}
    for model in set(counters) | set(gauges) | set(hists):
        if model == "" and (counters.get("") is None and hists.get("") is None):
            continue  # e.g. label-less info gauges only
        unknown = _unknown_reasons(era, counters.get(model, {}), b.cache_config)
        models[model] = ModelSignals(
            counters=MappingProxyType(counters.get(model, {})),
            histograms=MappingProxyType(hists.get(model, {})),
            gauges=MappingProxyType(gauges.get(model, {})),
            created=MappingProxyType(created.get(model, {})),
            hit_unit=hit_unit.get(model, ""),
            unknown=MappingProxyType(unknown),
        )
    reason = "" if models else ("vLLM samples present but none of the signals kvhit reads (prefix-cache and "
                                "token counters, scheduler gauges, request histograms with a _count)")
    return Snapshot(timestamp, era, reason, MappingProxyType(models), MappingProxyType(b.cache_config))


def _era(b: _Builder) -> str:
    running_help = b.docs.get("num_requests_running", "")
    if any(m in b.declared for m in _V0_MARKERS) or "on GPU" in running_help:
        return "vllm_v0"
    if any(m in b.declared for m in _V1_MARKERS) or "execution batches" in running_help:
        return "vllm_v1"
    return "vllm"  # a partial exposition that names no era


def _histograms(b: _Builder, exposed: str) -> dict[str, Histogram]:
    """Histograms per model, summed over the series (engines) that have a ``_count``.

    Sum and buckets add up over exactly those series: a ``_sum`` missing for one of them makes
    the sum unknown (NaN), a bucket edge missing for one of them is left out — never a sum of
    one engine's count with another engine's buckets.
    """
    parts = {part: slot for (kind, base, part), slot in b.series.items() if kind == "hist" and base == exposed}
    counts = parts.get("count")
    if not counts:
        return {}
    sums = parts.get("sum", {})
    edges = [(float(part[3:]), slot) for part, slot in parts.items() if part.startswith("le=")]
    series: dict[str, list[tuple]] = {}  # model → keys of its series with a _count
    for key in counts:
        series.setdefault(dict(key).get("model_name", ""), []).append(key)
    out: dict[str, Histogram] = {}
    for model, keys in series.items():
        total = math.fsum(sums[k] for k in keys) if all(k in sums for k in keys) else math.nan
        buckets = sorted((le, math.fsum(slot[k] for k in keys)) for le, slot in edges if all(k in slot for k in keys))
        out[model] = Histogram(sum=total, count=math.fsum(counts[k] for k in keys), buckets=tuple(buckets))
    return out


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


def _unknown_reasons(era: str, counters: Mapping[str, float], cache_config: Mapping[str, str]) -> dict[str, str]:
    reasons: dict[str, str] = {}
    if era == "vllm_v0":
        reasons["hit_ratio"] = ("vLLM V0 exports only gpu_prefix_cache_hit_rate, a lifetime block-level "
                                "gauge: the token hit ratio cannot be windowed")
    elif "queries" not in counters or "hits" not in counters:
        reasons["hit_ratio"] = "no prefix_cache_queries/hits counters in the exposition"
    if "external_hits" not in counters and era != "vllm_v0":
        offload = offload_configured(cache_config)
        if offload is None:
            reasons["hit_ratio_loaded"] = ("no external_prefix_cache_* counters (vLLM < 0.11.1) and no "
                                           "cache_config_info to rule out a KV connector")
        elif offload:
            reasons["hit_ratio_loaded"] = "KV offloading is configured but no external_prefix_cache_* counters"
    return reasons
