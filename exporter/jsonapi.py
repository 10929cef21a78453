"""JSON rendering of the analysis (``/api/v1/analysis``, ``kvhit replay --json/--save-fit``).

Schema (``schema_version`` 1; every number in base units, null = unknown)::

    {"schema_version": 1, "timestamp": unix s, "engine": str, "engine_reason": str,
     "target": str, "up": bool, "target_hit_ratio": float|null,
     "withdrawn": str (why "models" is empty although models were analysed: their values are
                  stale; "" when not),
     "models": {"<model_name>": {
        "window_seconds": s, "window_steps": int, "hit_ratio": {"all"|"device"|"loaded": ratio},
        "unknown": {"signal": "reason"}, "warnings": {"warning": "reason"}, "isl": tokens, "osl": tokens,
        "observed_ttft_seconds": s,
        "tpm_observed": {"delivered_instance": tokens/min, ...}, "tpm_target": {the same at target_hit_ratio},
        "fits": {"chip_time"|"miss_slope"|"overlap"|"load_aware": {"status", "reason", "samples", "r2",
                 "params": {"name": {"value" (null unless that parameter's status is ok; a fit that is not ok
                 passes its status and reason to each parameter it has; one that never solved has none),
                 "stderr", "status", "reason"}}, "extra": {...}}},
        "miss_slope_derived": {"tps0": {...}, "a": {...}},
        "fit": FittedModel fields (or null) — what ``kvhit predict`` loads,
        "predictions": {"current"|"target": Prediction fields},
        "bathtubs": {"linear"|"chip_time": BathtubCurve fields},
        "valley_form": "chip_time"|"linear"|null, "load_bandwidth": {"value", "source"}|null,
        "kv_bytes_per_token": bytes|null, "contention": ratio|null, "anomalies": int,
        "anomaly_times": [unix s], "tpot_source": "request"|"itl"|null,
        "p95_seconds": {"ttft"|"tpot_request"|"itl": s},
        "slo": {"pass_lower", "pass_upper", "ttft_share": [lower, upper], "tpot_share": [lower, upper],
                "output_tokens_per_second", "cost_lower", "cost_upper", "effective_cost_lower",
                "effective_cost_upper"}|null,
        "prefill_share": {"window"|"history": ratio}, "prefix_cache_speedup": {"window"|"history": x},
        "prefix_cache_verdict": {"state": str|null (null: undecidable, "reason" says why), "reason",
                                 "provisional", "history_seconds", "history_hit_ratio",
                                 "history_prefill_share", "recent_hit_ratio", "jitter", "kv_usage_max"},
        "kv_capacity_tokens", "max_concurrency", "kv_peak_bytes", "recommended_max_num_seqs",
        "capacity_bound_tokens_per_second": {"current"|"target": tokens/s}, "load_compute_ratio"}}}

``/api/v1/predict`` answers ``{"model_name", "prediction": Prediction fields}``.
"""
from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, fields

from exporter.analyzer import Analysis, ModelAnalysis
from exporter.collector import Health
from exporter.config import FileTooLarge, bounded, number, read_bounded
from fitters.model import max_hit_ratio
from fitters.result import Estimate, FitResult
from fitters.whatif import MAX_STEPS_PER_REQUEST, NULLABLE, STRUCTURED, FittedModel, finite_number

SCHEMA_VERSION = 1


def read_doc(path: str) -> object:
    """The JSON value in the file at ``path``.

    Raises:
        OSError: it cannot be read. ValueError: not JSON (json.JSONDecodeError), or
            :class:`~exporter.config.FileTooLarge`. RecursionError: nested too deep.
    """
    return json.loads(read_bounded(path))


def why_unread(exc: BaseException) -> str:
    """What :func:`read_doc` raised, in a message's words: the exception's type (a JSON error's
    text quotes the file), or how large the file is."""
    return f"{exc}: no kvhit analysis is that large" if isinstance(exc, FileTooLarge) else type(exc).__name__


def withdrawn(doc: dict) -> str:
    """Why an analysis document's models were withdrawn as stale ("" when they were not, or the
    document does not say: ``withdrawn`` missing or not a string)."""
    why = doc.get("withdrawn")
    return why if isinstance(why, str) else ""


def _clean(x):
    """JSON-safe: non-finite floats → None, tuples → lists, enums → values."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "value") and x.__class__.__module__ == "fitters.result":
        return x.value
    return x


def fit_to_dict(r: FitResult) -> dict:
    return _clean({
        "status": r.status.value, "reason": r.reason, "samples": r.samples, "r2": r.r2,
        "params": {k: _param_to_dict(r, e) for k, e in r.params.items()},
        "extra": r.extra,
    })


def _param_to_dict(r: FitResult, e: Estimate) -> dict:
    # a parameter that is not ok has no value (a dropped term's 0 is a placeholder, not a fit),
    # nor has one of a fit that is not ok: it takes the fit's status (FitResult.value); nor its
    # stderr, whose value can be recomputed from it
    says = e if r.ok or not e.ok else r
    ok = e.ok and r.ok
    return {"value": e.value if ok else None, "stderr": e.stderr if ok else None, "status": says.status.value,
            "reason": says.reason}


def model_to_dict(m: ModelAnalysis) -> dict:
    return _clean({
        "window_seconds": m.window_seconds, "window_steps": m.window_steps,
        "hit_ratio": m.hit_ratio, "unknown": m.unknown, "warnings": m.warnings, "isl": m.isl, "osl": m.osl,
        "observed_ttft_seconds": m.observed_ttft,
        "tpm_observed": {f"{k}_{p}": v for (k, p), v in m.tpm_observed.items()},
        "tpm_target": {f"{k}_{p}": v for (k, p), v in m.tpm_target.items()},
        "fits": {k: fit_to_dict(v) for k, v in m.fits.items()},
        "miss_slope_derived": {k: {"value": e.value, "stderr": e.stderr} for k, e in m.miss_slope_derived.items()},
        "fit": m.fitted.to_dict() if m.fitted else None,
        "predictions": {k: asdict(p) for k, p in m.predictions.items()},
        "bathtubs": {k: asdict(b) for k, b in m.bathtubs.items()},
        "valley_form": m.valley_form,
        "load_bandwidth": {"value": m.load_bandwidth[0], "source": m.load_bandwidth[1]} if m.load_bandwidth else None,
        "kv_bytes_per_token": m.kv_bytes_per_token, "contention": m.contention, "anomalies": m.anomalies,
        **_seed3_to_dict(m),
    })


def _seed3_to_dict(m: ModelAnalysis) -> dict:
    """Seed 003 cost / caching / batch size, KV sizing and the first-order bound."""
    c = m.slo_cost
    slo = None if c is None else {
        "pass_lower": c.pass_lower, "pass_upper": c.pass_upper, "ttft_share": [c.ttft.lower, c.ttft.upper],
        "tpot_share": [c.tpot.lower, c.tpot.upper], "output_tokens_per_second": c.output_tps,
        "cost_lower": c.cost_lower, "cost_upper": c.cost_upper,
        "effective_cost_lower": c.effective_lower, "effective_cost_upper": c.effective_upper}
    return {
        "anomaly_times": list(m.anomaly_times), "tpot_source": m.tpot_source, "p95_seconds": m.p95, "slo": slo,
        "prefill_share": m.prefill_share, "prefix_cache_speedup": m.caching_speedup,
        "prefix_cache_verdict": asdict(m.caching) if m.caching is not None else None,
        "kv_capacity_tokens": m.kv_capacity_tokens, "max_concurrency": m.max_concurrency,
        "kv_peak_bytes": m.kv_peak_bytes, "recommended_max_num_seqs": m.recommended_max_num_seqs,
        "capacity_bound_tokens_per_second": m.capacity_bound, "load_compute_ratio": m.load_compute_ratio,
    }


def analysis_to_dict(a: Analysis, health: Health) -> dict:
    return _clean({
        "schema_version": SCHEMA_VERSION, "timestamp": a.timestamp, "engine": a.engine,
        "engine_reason": a.engine_reason, "target": health.target, "up": health.up,
        "target_hit_ratio": a.target_hit_ratio, "withdrawn": a.withdrawn,
        "models": {name: model_to_dict(m) for name, m in a.models.items()},
    })


MAX_TOKENS = 10_000_000  # ISL/OSL bound of a what-if [tokens], see :func:`what_if`
# A what-if request's share of the engine steps, engine steps per finished request (T_fixed =
# T_step x this, MODEL.md §7; below 1 when a batch larger than a request's steps shares each step,
# as the analysis measures it): an argparse type (``kvhit predict --steps-per-request``), its error
# a 400 over HTTP.
STEPS_PER_REQUEST = bounded(0.0, MAX_STEPS_PER_REQUEST, open_low=True)


def what_if(hit_ratio, isl, osl) -> tuple[float, float, float]:
    """Check the arguments of a what-if prediction; returns them as floats (h, ISL, OSL).

    ISL and OSL are tokens per request, means allowed (the analysis' defaults are window means),
    in [1, MAX_TOKENS]: a prompt and an answer have at least one token, and 10M tokens is the
    longest context window served today — the chip-time model, fitted at the ISLs the server saw,
    would be extrapolated by orders of magnitude beyond it. h is in [0, 1 − 1/ISL]: the last
    prompt token is always computed, for its logits (fitters/model.py ``max_hit_ratio``, the
    chip-time bathtub's grid).

    Raises:
        ValueError: one line naming the argument, its value and the allowed range.
    """
    out = []
    for name, v in (("hit_ratio", hit_ratio), ("isl", isl), ("osl", osl)):
        try:
            x = math.nan if isinstance(v, bool) else number(v) if isinstance(v, str) else float(v)
        except (TypeError, ValueError):
            x = math.nan
        if not math.isfinite(x):
            raise ValueError(f"{name} must be a finite number, got {str(v)[:40]!r}")
        out.append(x + 0.0)  # -0 → 0: "hit_ratio": -0.0 in the answer
    h, n_in, n_out = out
    for name, x in (("isl", n_in), ("osl", n_out)):
        if not 1 <= x <= MAX_TOKENS:
            raise ValueError(f"{name} must be in [1, {MAX_TOKENS}] tokens, got {x:g}")
    if not 0 <= h <= max_hit_ratio(n_in):
        raise ValueError(f"hit_ratio must be in [0, 1 - 1/isl] = [0, {max_hit_ratio(n_in):.6g}] (the last prompt token "
                         f"is always computed), got {h!r}")
    return h, n_in, n_out


def check_analysis_doc(doc) -> dict:
    """``doc`` (any parsed JSON value) when it is an analysis document (``/api/v1/analysis``:
    a JSON object with ``schema_version`` 1 and a ``models`` object whose ``isl`` and ``osl`` are
    numbers ≥ 0 or null). Raises ValueError, one line."""
    if not isinstance(doc, dict) or doc.get("schema_version") != SCHEMA_VERSION or not isinstance(doc.get("models"), dict):
        if isinstance(doc, dict) and {"parameters", "leave_one_phase_out", "analysis"} <= doc.keys():
            raise ValueError("a kvhit calibrate report, not an analysis document: give the fit.json written beside "
                             "it (kvhit calibrate prints its path)")
        if isinstance(doc, dict) and {"steps", "phases", "analysis"} <= doc.keys():
            raise ValueError("a kvhit replay --json report, not an analysis document: write one with kvhit replay "
                             "--save-fit FILE")
        raise ValueError("not a kvhit analysis document (a JSON object with schema_version 1 and a models object)")
    for name, m in doc["models"].items():
        for k in ("isl", "osl"):
            v = m.get(k) if isinstance(m, dict) else None
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0):
                raise ValueError(f"model {name!r}: {k} must be a number of tokens ≥ 0 or null, got {str(v)[:40]!r}")
    return doc


def load_fit(doc, model_name: str | None = None, choose: str = "--model") -> tuple[str, FittedModel, dict]:
    """The FittedModel of one model from an analysis document (``/api/v1/analysis`` JSON).

    Args:
        doc: the parsed JSON (any JSON value: its shape is checked here).
        model_name: the model to load; None when the document must hold exactly one.
        choose: how the caller's user names a model (``--model``, ``the model_name= query
            parameter``), quoted when the document holds several.
    Returns (model_name, FittedModel, the model's dict).
    Raises:
        ValueError: one line saying what is wrong in the document: not an analysis (schema 1
            with a ``models`` object), its models withdrawn as stale (``withdrawn``), no model or
            several and no ``model_name``, a model that
            is not an object, no usable fit, a fit with a missing or non-numeric field.
    """
    models = check_analysis_doc(doc)["models"]
    if not models and withdrawn(doc):
        raise ValueError(f"no current analysis: {withdrawn(doc)}")  # not "no model yet": the data is old
    if model_name is None:
        if not models:
            raise ValueError("no model analysed yet (a model appears once two scrapes have shown it)")
        if len(models) > 1:
            raise ValueError(f"{len(models)} models analysed; choose one with {choose}: {sorted(models)}")
        model_name = next(iter(models))
    if model_name not in models:
        raise ValueError(f"model {model_name!r} not analysed: {sorted(models)}")
    m = models[model_name]
    if not isinstance(m, dict):
        raise ValueError(f"models.{model_name}: not an object")
    fit = m.get("fit")
    if not fit:
        chip = m.get("fits", {}).get("chip_time") if isinstance(m.get("fits"), dict) else None
        reason = (chip.get("reason") if isinstance(chip, dict) else None) or "no fitted chip-time model"
        raise ValueError(f"model {model_name!r} has no usable fit: {reason}")
    if not isinstance(fit, dict):
        raise ValueError(f"models.{model_name}.fit: not an object")
    _check_fit(fit, f"models.{model_name}.fit")
    return model_name, FittedModel.from_dict(fit), m


def _check_fit(fit: dict, where: str) -> None:
    """Every FittedModel field without a default present; every field but the ``STRUCTURED`` ones
    a finite number (or null where it may be unknown, ``NULLABLE``). Raises ValueError naming the
    fields."""
    missing = [f.name for f in fields(FittedModel) if f.default is MISSING and f.name not in fit]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    for f in fields(FittedModel):
        v = fit.get(f.name)
        if (v is None and f.name in NULLABLE) or f.name in STRUCTURED:  # from_dict checks them
            continue
        if f.name in fit and not finite_number(v):
            raise ValueError(f"{where}.{f.name}: must be a finite number, got {json.dumps(v)[:40]}")
