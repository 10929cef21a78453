"""JSON rendering of the analysis (``/api/v1/analysis``, ``kvhit replay --json/--save-fit``).

Schema (``schema_version`` 1; every number in base units, null = unknown)::

    {"schema_version": 1, "timestamp": unix s, "engine": str, "engine_reason": str,
     "target": str, "up": bool, "target_hit_ratio": float|null,
     "models": {"<model_name>": {
        "window_seconds": s, "window_steps": int, "hit_ratio": {"all"|"device"|"loaded": ratio},
        "unknown": {"signal": "reason"}, "isl": tokens, "osl": tokens, "observed_ttft_seconds": s,
        "tpm_observed": {"delivered_instance": tokens/min, ...},
        "fits": {"chip_time"|"miss_slope"|"overlap"|"load_aware": {"status", "reason", "samples", "r2",
                 "params": {"name": {"value", "stderr", "status", "reason"}}, "extra": {...}}},
        "miss_slope_derived": {"tps0": {...}, "a": {...}},
        "fit": FittedModel fields (or null) — what ``kvhit predict`` loads,
        "predictions": {"current"|"target": Prediction fields},
        "bathtubs": {"linear"|"chip_time": BathtubCurve fields},
        "valley_form": "chip_time"|"linear"|null, "load_bandwidth": {"value", "source"}|null,
        "kv_bytes_per_token": bytes|null, "contention": ratio|null, "anomalies": int}}}

``/api/v1/predict`` answers ``{"model_name", "prediction": Prediction fields}``.
"""
from __future__ import annotations

import math
from dataclasses import asdict

from exporter.analyzer import Analysis, ModelAnalysis
from exporter.collector import Health
from fitters.result import FitResult
from fitters.whatif import FittedModel

SCHEMA_VERSION = 1


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
        "params": {k: {"value": e.value, "stderr": e.stderr, "status": e.status.value, "reason": e.reason}
                   for k, e in r.params.items()},
        "extra": r.extra,
    })


def model_to_dict(m: ModelAnalysis) -> dict:
    return _clean({
        "window_seconds": m.window_seconds, "window_steps": m.window_steps,
        "hit_ratio": m.hit_ratio, "unknown": m.unknown, "isl": m.isl, "osl": m.osl,
        "observed_ttft_seconds": m.observed_ttft,
        "tpm_observed": {f"{k}_{p}": v for (k, p), v in m.tpm_observed.items()},
        "fits": {k: fit_to_dict(v) for k, v in m.fits.items()},
        "miss_slope_derived": {k: {"value": e.value, "stderr": e.stderr} for k, e in m.miss_slope_derived.items()},
        "fit": m.fitted.to_dict() if m.fitted else None,
        "predictions": {k: asdict(p) for k, p in m.predictions.items()},
        "bathtubs": {k: asdict(b) for k, b in m.bathtubs.items()},
        "valley_form": m.valley_form,
        "load_bandwidth": {"value": m.load_bandwidth[0], "source": m.load_bandwidth[1]} if m.load_bandwidth else None,
        "kv_bytes_per_token": m.kv_bytes_per_token, "contention": m.contention, "anomalies": m.anomalies,
    })


def analysis_to_dict(a: Analysis, health: Health) -> dict:
    return _clean({
        "schema_version": SCHEMA_VERSION, "timestamp": a.timestamp, "engine": a.engine,
        "engine_reason": a.engine_reason, "target": health.target, "up": health.up,
        "target_hit_ratio": a.target_hit_ratio,
        "models": {name: model_to_dict(m) for name, m in a.models.items()},
    })


def load_fit(doc: dict, model_name: str | None = None) -> tuple[str, FittedModel, dict]:
    """The FittedModel of one model from an analysis document (``/api/v1/analysis`` JSON).

    Returns (model_name, FittedModel, the model's dict). Raises ValueError with a clear message
    when the document has no fitted model, several models and no ``model_name``, or a bad fit.
    """
    if doc.get("schema_version") != SCHEMA_VERSION or not isinstance(doc.get("models"), dict):
        raise ValueError("not a kvhit analysis document (schema_version 1 with models)")
    models = doc["models"]
    if model_name is None:
        if len(models) != 1:
            raise ValueError(f"the document has {len(models)} models; choose one with --model: {sorted(models)}")
        model_name = next(iter(models))
    if model_name not in models:
        raise ValueError(f"model {model_name!r} not in the document: {sorted(models)}")
    m = models[model_name]
    if not m.get("fit"):
        reason = m.get("fits", {}).get("chip_time", {}).get("reason") or "no fitted chip-time model"
        raise ValueError(f"model {model_name!r} has no usable fit: {reason}")
    return model_name, FittedModel.from_dict(m["fit"]), m
