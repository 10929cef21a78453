"""kvhit_slo_seconds: the configured SLOs published per model (the TTFT alert compares against it)."""
from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter.collector import KvhitCollector
from exporter.config import load_config
from exporter.replay import replay
from exporter.sources import Trace, load_trace

TRACE = Path(__file__).resolve().parents[1] / "exporter" / "data" / "vllm-cpu-0.32-sweep-ab.tar.gz"


def _slo_samples(environ: dict[str, str]) -> dict[str, float]:
    full = load_trace(TRACE)
    trace = Trace(full.snapshots[:6], [], {})  # a few scrapes: enough for a model analysis
    result = replay(trace, load_config(environ=environ), "t")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvhitCollector(result.runner.current))
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            if s.name == "kvhit_slo_seconds":
                assert s.labels["model_name"] == "tiny" and s.labels["target"] == "t"
                out[s.labels["slo"]] = s.value
    return out


def test_configured_slos_are_published_in_seconds():
    assert _slo_samples({"KVHIT_SLO_TTFT_SECONDS": "0.25", "KVHIT_SLO_TPOT_SECONDS": "0.04"}) == \
        {"ttft": 0.25, "tpot": 0.04}


def test_unset_slo_is_absent_never_zero():
    assert _slo_samples({"KVHIT_SLO_TTFT_SECONDS": "2"}) == {"ttft": 2.0}
    assert _slo_samples({}) == {}
