"""Engine-specific name maps: other engines' ``/metrics`` in vLLM's vocabulary (MODEL.md §2).

:mod:`exporter.parse` reads vLLM. For an engine listed in :data:`TRANSLATED` it keeps that
engine's samples raw and hands them to :func:`translate`, which renames them onto the vLLM
names parse already reads and returns exposition text; parse reads that text as usual and
replaces the unknown reasons by :func:`unknown_reasons`. One signal, one meaning, whatever the
engine (reference vllm-metrics.md §6).

SGLang (``sglang:`` or, re-exported by the smg sidecar, ``sglang_``):

* Token hits — never the ``cache_hit_rate`` gauge (the last prefill batch only, and a percent in
  one unreleased build: a value > 1 is divided by 100 before it is kept as the informational
  gauge ``batch_hit_rate``). In order of preference:
  1. ``realtime_tokens_total{mode}``: hits = ``prefill_cache``, queries = ``prefill_cache`` +
     ``prefill_compute`` (both modes must be exported for the model);
  2. ``cached_tokens_total`` (``cache_source="total"`` or unlabelled) against
     ``prompt_tokens_total`` (both counted per finished request).
  With HiCache (any ``hicache_*``, ``load_back_tokens``, ``prefetched_tokens``,
  ``backuped_tokens`` family, or a host/storage ``cache_source``) some hits were loaded from
  host memory: only ``cached_tokens_total{cache_source}`` splits them (device → hits,
  host + ``storage_<backend>`` (L3) → external hits, queries = prompt tokens); without that
  split the hit ratio is unknown rather than mislabelled. Without HiCache SGLang loads nothing:
  h_load = 0.
* Model label ``model_name``, or ``name`` (0.3.x). Ranks that share one batch (``tp_rank``,
  ``pp_rank``, ``moe_ep_rank``) export the same values: one is kept (max), never summed;
  ``dp_rank`` becomes vLLM's ``engine`` (data-parallel, summed like vLLM engines) where every
  family kvhit reads carries it; where only the scheduler's do (``--dp-size`` > 1: the tokenizer's
  prompt and generation tokens and latencies count every rank's requests without it), the ranks
  are summed into one series set, usage ratios and KV pool sizes their max, read as that many engines
  (``pooled_ranks``: parse.Snapshot.engine_counts).
* Gauges: ``num_running_reqs`` (old ``num_requests_running``) → running; ``num_queue_reqs``
  (old ``num_requests_waiting``, WIP ``queue_req``) → waiting; ``token_usage`` → KV usage;
  ``max_total_num_tokens`` → KV capacity [tokens]. A series by ``priority`` is its total
  ``priority=""`` where SGLang writes one beside the breakdown (per label set otherwise the
  same). Histograms: TTFT, inter-token latency (old ``time_per_output_token_seconds``; ITL,
  SGLang has no per-request TPOT), e2e latency, ``queue_time_seconds``, prompt and output
  lengths (``prompt_tokens_histogram``, ``generation_tokens_histogram``: vLLM's
  request_prompt_tokens, request_generation_tokens).
  SGLang has no prefill/decode time histograms and no engine-step counter: the prefill share and
  the chip-time fit stay unknown.

llm-d-inference-sim uses vLLM names (counters once without ``_total``): parse reads it as vLLM.
LMCache is not translated (its counters describe the connector, not the engine's cache).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

TRANSLATED = ("sglang",)
_DISPLAY = {"sglang": "SGLang"}

# vLLM exposed gauge name → SGLang names in preference order (first present per model wins).
SGLANG_GAUGES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("num_running_reqs", "num_requests_running"),
    "num_requests_waiting": ("num_queue_reqs", "num_requests_waiting", "queue_req"),
    "kv_cache_usage_perc": ("token_usage",),
    "max_total_num_tokens": ("max_total_num_tokens",),
    "batch_cache_hit_rate": ("cache_hit_rate",),
}
# vLLM counter base → SGLang counter bases (without ``_total``).
SGLANG_COUNTERS: dict[str, tuple[str, ...]] = {
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
}
# vLLM histogram base → SGLang histogram bases in preference order.
SGLANG_HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("queue_time_seconds",),
    # per request, at its finish, as vLLM's (--collect-tokens-histogram, or always in newer builds)
    "request_prompt_tokens": ("prompt_tokens_histogram",),
    "request_generation_tokens": ("generation_tokens_histogram",),
}
REPLICA_LABELS = ("tp_rank", "pp_rank", "moe_ep_rank")
DATA_PARALLEL_LABEL = "dp_rank"
HICACHE_FAMILIES = ("hicache_host_used_tokens", "hicache_host_total_tokens", "load_back_tokens",
                    "prefetched_tokens", "backuped_tokens")
_HIST_SUFFIXES = ("_bucket", "_sum", "_count", "_created")
# the SGLang families kvhit reads (what decides whether data-parallel ranks are pooled: _pooled)
_READ = frozenset(s for table in (SGLANG_GAUGES, SGLANG_COUNTERS, SGLANG_HISTOGRAMS) for v in table.values() for s in v) \
    | {"realtime_tokens", "cached_tokens"}
# translated gauges whose pooled ranks take the max, not the sum: ratios of each rank's own pool, and
# its size (kvhit_kv_capacity_tokens is per data-parallel engine)
_MAX_OVER_RANKS = ("kv_cache_usage_perc", "batch_cache_hit_rate", "max_total_num_tokens")
BATCH_GAUGE_NOTE = ("the cache_hit_rate gauge covers only the last prefill batch and is never used as the "
                    "token hit ratio")

Sample = tuple[str, Mapping[str, str], float]


def _base(name: str) -> tuple[str, str]:
    """(base, suffix) with suffix one of "_total", "_created", histogram suffixes or ""."""
    for suffix in _HIST_SUFFIXES + ("_total",):
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix
    return name, ""


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def model_of(labels: Mapping[str, str]) -> str:
    """The model a translated engine's sample is of: its ``model_name`` label, or ``name`` (SGLang 0.3.x)."""
    return labels.get("model_name", labels.get("name", ""))


def _canonical_labels(labels: Mapping[str, str]) -> dict[str, str]:
    out = {}
    for k, v in labels.items():
        if k in REPLICA_LABELS or k == "name":
            continue
        out["engine" if k == DATA_PARALLEL_LABEL else k] = v
    out["model_name"] = model_of(labels)
    return out


class _Out:
    """Translated series, deduplicated (max) after the replica labels are dropped. For a model in
    ``pooled`` (:func:`_pooled`) the data-parallel rank is dropped too, its ranks' values added
    (usage ratios and ``_created`` stamps: the max)."""

    def __init__(self) -> None:
        self.series: dict[tuple[str, tuple], dict[str, float]] = {}  # → {rank: value}
        self.pooled: set[str] = set()

    def add(self, name: str, labels: Mapping[str, str], value: float, **extra: str) -> None:
        canon = {**_canonical_labels(labels), **extra}
        rank = canon.pop("engine", "") if canon["model_name"] in self.pooled else ""
        per = self.series.setdefault((name, tuple(sorted(canon.items()))), {})
        per[rank] = max(per.get(rank, -math.inf), value)

    def busy_ranks(self, model: str) -> int:
        """Of a pooled ``model``'s data-parallel ranks, those running requests (num_requests_running > 0)."""
        return len({rank for (name, labels), per in self.series.items()
                    if name == "num_requests_running" and ("model_name", model) in labels
                    for rank, value in per.items() if value > 0})

    def text(self) -> str:
        lines = []
        for (name, labels), per in sorted(self.series.items()):
            value = max(per.values()) if name in _MAX_OVER_RANKS or name.endswith("_created") else math.fsum(per.values())
            body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
            lines.append(f"vllm:{name}{{{body}}} {value!r}")
        return "\n".join(lines) + ("\n" if lines else "")


def translate(engine: str, samples: Iterable[Sample]) -> tuple[str, dict[str, dict[str, object]]]:
    """Rename ``engine``'s samples (name without the engine prefix, labels, value) to vLLM's
    vocabulary. Returns (exposition text with ``vllm:`` names, per-model notes) — notes:
    "hit_source" ("realtime_tokens" | "cached_tokens" | "cached_tokens_split" | ""),
    "hicache" (bool), "realtime_partial" (only one prefill mode exported), "pooled_ranks" (the
    data-parallel ranks summed into one series set, :func:`_pooled`; 0 when none were) and, where
    they were, "busy_ranks" (those of them running requests at this scrape).

    Raises ValueError for an engine not in :data:`TRANSLATED`.
    """
    if engine not in TRANSLATED:
        raise ValueError(f"no translation for engine {engine!r}")
    by_model: dict[str, list[tuple[str, str, Mapping[str, str], float]]] = {}
    for name, labels, value in samples:
        base, suffix = _base(name)
        by_model.setdefault(model_of(labels), []).append((base, suffix, labels, value))
    out = _Out()
    notes: dict[str, dict[str, object]] = {}
    for model, rows in by_model.items():
        ranks = _pooled(rows)
        if ranks:
            out.pooled.add(model)
        notes[model] = {**_translate_model(rows, out), "pooled_ranks": ranks}
    for model in out.pooled:
        notes[model]["busy_ranks"] = out.busy_ranks(model)
    return out.text(), notes


def _pooled(rows: list[tuple[str, str, Mapping[str, str], float]]) -> int:
    """How many data-parallel ranks a model's series are read as one (summed) because only some of
    the families kvhit reads carry ``dp_rank``: SGLang puts it on the scheduler's (running, queue,
    token usage, realtime tokens), never on the tokenizer's (prompt and generation tokens, TTFT),
    which count every rank's requests. Per-rank series beside rankless ones would be a rank each
    short of the model's total (parse's engine_incomplete: no analysis at all with --dp-size 2).
    0 when every such series carries it (per-rank engines) or none does."""
    read = [labels for base, suffix, labels, _ in rows if base in _READ and suffix != "_created"]
    ranked = {labels[DATA_PARALLEL_LABEL] for labels in read if DATA_PARALLEL_LABEL in labels}
    return len(ranked) if ranked and any(DATA_PARALLEL_LABEL not in labels for labels in read) else 0


def _translate_model(rows: list[tuple[str, str, Mapping[str, str], float]], out: _Out) -> dict[str, object]:
    bases = {base for base, _, _, _ in rows}
    rows = _totals(rows)
    for target, sources in SGLANG_GAUGES.items():
        src = next((s for s in sources if s in bases), None)
        for base, suffix, labels, value in rows:
            if base == src and suffix == "":
                if target == "batch_cache_hit_rate" and value > 1.0:
                    value = value / 100.0  # a percent (sglang WIP PR #1461), never a ratio > 1
                out.add(target, labels, value)
    for target, sources in SGLANG_COUNTERS.items():
        for base, suffix, labels, value in rows:
            if base in sources and suffix in ("", "_total", "_created"):
                out.add(target + ("_created" if suffix == "_created" else "_total"), labels, value)
    for target, sources in SGLANG_HISTOGRAMS.items():
        src = next((s for s in sources if s in bases), None)
        for base, suffix, labels, value in rows:
            if base == src and suffix in _HIST_SUFFIXES:
                out.add(target + suffix, labels, value)

    def rows_of(base_name: str, suffixes=("", "_total")):
        return [(labels, value, suffix) for base, suffix, labels, value in rows if base == base_name
                and suffix in suffixes + ("_created",)]

    realtime = [r for r in rows_of("realtime_tokens") if r[0].get("mode") in ("prefill_cache", "prefill_compute")]
    modes = {labels.get("mode") for labels, _, suffix in realtime if suffix != "_created"}
    cached = rows_of("cached_tokens")
    sources = {labels.get("cache_source", "total") for labels, _, _ in cached}
    hicache = bool(bases & set(HICACHE_FAMILIES)) or any(map(_loaded_source, sources))
    prompt = any(base == "prompt_tokens" for base, _, _, _ in rows)
    note: dict[str, object] = {"hit_source": "", "hicache": hicache,
                               "realtime_partial": len(modes) == 1}

    def emit(target: str, labels: Mapping[str, str], value: float, suffix: str) -> None:
        out.add(target + ("_created" if suffix == "_created" else "_total"), labels, value)

    if hicache:
        if "device" in sources and prompt:
            note["hit_source"] = "cached_tokens_split"
            for labels, value, suffix in cached:
                src = labels.get("cache_source")
                if src == "device":
                    emit("prefix_cache_hits", labels, value, suffix)
                elif _loaded_source(src):
                    emit("external_prefix_cache_hits", labels, value, suffix)
            _queries_from_prompt(rows, out)
    elif modes == {"prefill_cache", "prefill_compute"}:
        note["hit_source"] = "realtime_tokens"
        for labels, value, suffix in realtime:
            emit("prefix_cache_queries", labels, value, suffix)
            if labels.get("mode") == "prefill_cache":
                emit("prefix_cache_hits", labels, value, suffix)
    elif cached and prompt:
        note["hit_source"] = "cached_tokens"
        keep = "total" if "total" in sources else None
        for labels, value, suffix in cached:
            if keep is None or labels.get("cache_source", "total") == keep:
                emit("prefix_cache_hits", labels, value, suffix)
        _queries_from_prompt(rows, out)
    return note


def _totals(rows: list[tuple[str, str, Mapping[str, str], float]]) -> list[tuple[str, str, Mapping[str, str], float]]:
    """``rows`` without a breakdown by ``priority`` where its total is there too: SGLang writes a
    series' total under ``priority=""`` beside one series per priority value (queue counts, running
    10 read for 5: an audit), per label set otherwise the same; without a total the breakdown stays
    (summed like any label)."""
    def key(base: str, suffix: str, labels: Mapping[str, str]) -> tuple:
        return base, suffix, tuple(sorted((k, v) for k, v in labels.items() if k != "priority"))
    totals = {key(base, suffix, labels) for base, suffix, labels, _ in rows if labels.get("priority") == ""}
    if not totals:
        return rows
    return [r for r in rows if r[2].get("priority", "") == "" or key(r[0], r[1], r[2]) not in totals]


def _loaded_source(source: str | None) -> bool:
    """Whether a ``cached_tokens_total`` ``cache_source`` is HiCache's host memory or an L3 storage
    backend (``storage_<backend>``, e.g. storage_mooncake: hits loaded from outside the GPU)."""
    return source is not None and (source == "host" or source.startswith("storage"))


def _queries_from_prompt(rows, out: _Out) -> None:
    for base, suffix, labels, value in rows:
        if base == "prompt_tokens" and suffix in ("", "_total", "_created"):
            out.add("prefix_cache_queries" + ("_created" if suffix == "_created" else "_total"), labels, value)


def exposed_names(engine: str, prefix: str, names: Iterable[str]) -> tuple[str, ...]:
    """The families ``engine``'s own exposition has for the vLLM family bases ``names`` (exposed
    names without the prefix, e.g. "time_to_first_token_seconds"), each behind ``prefix``, the
    engine's prefix as its exposition writes it ("vllm:", "sglang:", "sglang_" from SGLang's model
    gateway; empty tuple when it has none of them): what reasons name, so that an SGLang user is
    not sent looking for a vLLM metric."""
    if engine not in TRANSLATED:
        return tuple(prefix + n for n in names)
    return tuple(dict.fromkeys(prefix + m for n in names for m in SGLANG_HISTOGRAMS.get(n, ())))


def missing_histogram(engine: str, prefix: str, names: Iterable[str], why: str) -> str:
    """``why`` (a reason) with its first ``{}`` replaced by the histogram families ``engine``
    exposes for the vLLM bases ``names`` behind ``prefix`` (:func:`exposed_names`, joined by
    " or "), or "<engine> exports no <first base> histogram" when it has none."""
    names = tuple(names)
    exposed = exposed_names(engine, prefix, names)
    if not exposed:
        return f"{_DISPLAY.get(engine, engine)} exports no {names[0]} histogram"
    return why.replace("{}", " or ".join(exposed), 1)


def unknown_reasons(engine: str, counters: Mapping[str, float], note: Mapping[str, object]) -> dict[str, str]:
    """Signal → reason it is unknown, for a translated engine's model (MODEL.md §2)."""
    reasons: dict[str, str] = {}
    if "queries" in counters and "hits" in counters:
        return reasons
    if note.get("hicache"):
        why = ("SGLang HiCache is on: realtime_tokens_total{mode=\"prefill_cache\"} mixes device and host hits; "
               "the token hit ratio needs cached_tokens_total{cache_source} and prompt_tokens_total")
    elif note.get("realtime_partial"):
        why = ("realtime_tokens_total exports only one of mode=\"prefill_cache\" / \"prefill_compute\" for this "
               "model: the token hit ratio needs both")
    else:
        why = (f"no {_DISPLAY.get(engine, engine)} token-level cache counters (realtime_tokens_total{{mode}}, "
               "or cached_tokens_total with prompt_tokens_total)")
    reasons["hit_ratio"] = f"{why}; {BATCH_GAUGE_NOTE}"
    return reasons
