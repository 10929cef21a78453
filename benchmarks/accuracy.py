"""Accuracy of kvhit against the ground-truth simulator and the recorded real vLLM trace (issue 6).

For each ground truth of the matrix (a, ρ, α, noise) the simulator (exporter/simulate.py) feeds
its expositions straight into a :class:`exporter.runner.Runner` on simulated time (no sleeping),
exactly what a live sidecar parses. Measured, per row:

* windows to converge: the first publish window (60 s, 12 scrapes of 5 s) from which the direct
  miss slope â (and α̂) stays within the bar (|â − a| ≤ 0.02, |α̂ − α| ≤ 0.05) with an ok fit until
  the end of the training run (30 windows); "—" = never. The bar: ≤ 20 windows at 2 % noise.
  The true a is the slope of the least-squares line through the true TPS_miss(h) = M/t_chip(h)
  (MODEL.md §7, at the reference concurrency) over [0, 0.95], the training range, as an integral
  (exporter/simulate.py ``true_line``: the trapezoid rule on 201 evenly spaced h): MODEL.md §4's
  line, a property of the engine (``calibrate_truth`` picks k_dec so that it is the row's a).
  The derived â is that line through the fitted chip-time curve; the direct â weights each
  stretch of observed h by its width, so it measures the same line whatever the time spent at
  each h.
* errors after 20 windows: â direct and derived (MODEL.md §4: the chip-time model's line), α̂.
* TTFT MAPE at hit ratios the fit never saw (training h ∈ {0, 0.1, …, 0.9, 0.95}; tested at
  0.05, 0.35, 0.55, 0.85, 0.97): the load-aware TTFT of the fitted model, at the truth's mean
  concurrency and queue time, against the truth's mean TTFT. Bar ≤ 5 %.
* valley-detection delay: after training, 3 windows outside the true (chip-time) valley then
  h steps inside it; windows from that entry until ``valley_active`` (counting the window in
  which the publish window first lies wholly inside). Bar ≤ 3. Truths without a valley report
  false alarms instead.
* real vLLM: leave-one-phase-out busy-time and load-aware TTFT errors per phase of the bundled
  trace (exporter/replay.py ``summarise_phases``), and the direct and derived â at the end of each
  sweep of one prompt length.
* tail chunks (full mode only; not part of issue 6's matrix, so not checked): runs of α 0.5 at
  2 % and 10 % noise with the simulator's tail-chunk dips at seed 002's hit ratios 0.2, 0.4 and
  0.7 (depths 20, 40 and 70 % of the step's work: our choice, the seed gives none). Training
  visits all three.

``--quick`` runs a reduced matrix (CI); ``--check`` exits 1 when a 2 %-noise row misses a bar by
more than the stated noise margin (``MARGIN``). Writes benchmarks/results/accuracy-{quick,full}.md.
"""
from __future__ import annotations

import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import finish, missed, parser  # noqa: E402
from exporter.config import Config, Geometry, Prices  # noqa: E402
from exporter.replay import TraceClock, replay  # noqa: E402
from exporter.runner import Runner  # noqa: E402
from exporter.simulate import Scenario, Segment, Truth, calibrate_truth, generate  # noqa: E402
from exporter.sources import load_trace  # noqa: E402

INTERVAL, WINDOW = 5.0, 60.0
DIPS = ((0.2, 0.2), (0.4, 0.4), (0.7, 0.7))  # (h, share of the step's work lost)
TRAIN_WINDOWS, BAR_WINDOWS = 30, 20
TRAIN_LEVELS = (0.0, 0.8, 0.2, 0.6, 0.4, 0.95, 0.1, 0.7, 0.3, 0.9, 0.5)
UNSEEN = (0.05, 0.35, 0.55, 0.85, 0.97)
RUNNING_REF = 10.0
BARS = {"a": 0.02, "alpha": 0.05, "ttft_mape": 0.05, "valley_windows": 3}
# Noise margin of --check: a bar missed by less than this is within run-to-run noise (seeded runs
# are deterministic on one machine; this covers BLAS/scipy differences across machines).
MARGIN = {"a": 0.005, "alpha": 0.01, "ttft_mape": 0.005, "valley_windows": 0}
GEOMETRY = Geometry(layers=32, kv_heads=32, head_dim=128)  # S_kv = 524,288 B (Llama-2-7B fp16)


@dataclass(frozen=True)
class Row:
    a: float
    rho: float
    alpha: float
    noise: float
    dips: bool = False  # the simulator's tail-chunk dips at DIPS
    a_windows: int | None = None
    a_err: float = math.nan
    a_derived_windows: int | None = None
    a_derived_err: float = math.nan
    alpha_windows: int | None = None
    alpha_err: float = math.nan
    ttft_mape: float = math.nan
    valley: str = ""  # truth: "none", "entry" (h steps into it), "everywhere" (R' < 0 for every h)
    valley_delay: int | None = None
    false_alarms: int = 0
    seconds: float = 0.0


def _valley(truth: Truth, rho: float) -> tuple[str, float | None, float | None]:
    """The true chip-time bathtub at the reference concurrency: ("none" | "entry" | "everywhere",
    h outside the valley's falling side, h inside it). R'(h) < 0 is where valley_active is true."""
    def slope(h: float) -> float:
        e = 1e-4
        return (truth.revenue(h + e, RUNNING_REF, 1e-6, rho) - truth.revenue(h - e, RUNNING_REF, 1e-6, rho)) / (2 * e)
    grid = [i / 100 for i in range(1, 98)]
    falling = [h for h in grid if slope(h) < 0]
    if not falling:
        return "none", None, None
    if len(falling) == len(grid):
        return "everywhere", None, 0.3
    h_star = max(falling)
    return "entry", min(0.97, (h_star + 0.97) / 2), min(0.3, h_star / 2)


def run_row(row: Row, seed: int = 1) -> Row:
    t0 = time.perf_counter()
    truth = calibrate_truth(replace(Truth(), alpha=row.alpha, load_share=0.5), row.a)
    train = tuple(Segment("step", WINDOW, TRAIN_LEVELS[i % len(TRAIN_LEVELS)]) for i in range(TRAIN_WINDOWS))
    kind, h_out, h_in = _valley(truth, row.rho)
    tail = (Segment("step", 3 * WINDOW, h_out if h_out is not None else 0.5),
            Segment("step", 6 * WINDOW, h_in if h_in is not None else 0.3))
    sc = Scenario(truth=truth, schedule=train + tail, interval=INTERVAL, noise=row.noise, seed=seed,
                  dips=DIPS if row.dips else ())
    cfg = Config(window_seconds=WINDOW, interval=INTERVAL, model=GEOMETRY,
                 load_bandwidth_bytes_per_second=truth.load_bandwidth,
                 prices=Prices(hit_price_ratio=row.rho))
    clock = TraceClock()
    runner = Runner(cfg, "sim", clock=clock)
    per_window = int(WINDOW / INTERVAL)
    a_ok, d_ok, alpha_ok = [], [], []
    a_err = a_d_err = al_err = mape = math.nan
    entry = TRAIN_WINDOWS + 3  # window index of the valley entry (tail)
    w_ok = None  # first window with the chip-time fit ok
    delay = None
    alarms = 0
    for i, (t, text, _) in enumerate(generate(sc)):
        clock.t = t
        runner.ingest_text(t, text)
        if i == 0 or i % per_window:
            continue
        w = i // per_window  # windows elapsed
        m = runner.current()[0].models.get(sc.model_name)
        if m is None:
            continue
        if w_ok is None and m.fits["chip_time"].ok:
            w_ok = w
        form = m.valley_form
        active = bool(form and m.bathtubs[form].valley_active)
        if kind == "none" and w_ok is not None:
            alarms += active
        elif kind == "everywhere" and w_ok is not None and active and delay is None:
            delay = w - w_ok
        elif kind == "entry" and w > entry and active and delay is None:
            delay = w - entry
        if w > TRAIN_WINDOWS:
            continue
        slope = m.fits["miss_slope"]
        a_hat = slope.value("a") if slope.ok else None
        a_ok.append(a_hat is not None and abs(a_hat - row.a) <= BARS["a"])
        d = m.miss_slope_derived.get("a")
        d_hat = d.value if d is not None and d.ok else None
        d_ok.append(d_hat is not None and abs(d_hat - row.a) <= BARS["a"])
        al = m.fits["overlap"]
        al_hat = al.value("alpha") if al.ok else None
        alpha_ok.append(al_hat is not None and abs(al_hat - row.alpha) <= BARS["alpha"])
        if w == BAR_WINDOWS:
            a_err = abs(a_hat - row.a) if a_hat is not None else math.nan
            a_d_err = abs(d_hat - row.a) if d_hat is not None else math.nan
            al_err = abs(al_hat - row.alpha) if al_hat is not None else math.nan
            if m.fitted is not None:
                f = replace(m.fitted, running=RUNNING_REF, queue_time=truth.queue_seconds,
                            hit_load_share=truth.load_share)
                errs = []
                for h in UNSEEN:
                    p = f.predict(h, truth.isl, truth.osl).ttft_load_aware
                    errs.append(abs(p / truth.ttft(h, RUNNING_REF) - 1) if p is not None else math.inf)
                mape = sum(errs) / len(errs)
    return replace(row, a_windows=_converged(a_ok), a_err=a_err, a_derived_windows=_converged(d_ok),
                   a_derived_err=a_d_err, alpha_windows=_converged(alpha_ok), alpha_err=al_err, ttft_mape=mape,
                   valley=kind, valley_delay=delay, false_alarms=alarms, seconds=time.perf_counter() - t0)


def _converged(ok: list[bool]) -> int | None:
    """First window (1-based) from which every later window is within the bar."""
    if not ok or not ok[-1]:
        return None
    i = len(ok)
    while i > 0 and ok[i - 1]:
        i -= 1
    return i + 1


def real_vllm() -> tuple[list[tuple[str, float | None, float | None, float | None]], list[tuple]]:
    """On the bundled trace: (phase, measured h, busy-time error, load-aware TTFT error) leave-one-phase-out;
    and (last phase, ISL bucket, direct â, its stderr, derived â, its stderr, flagged steps) at the end of
    each sweep of one prompt length (no true a on a real engine: the two estimators cross-check)."""
    from exporter.cli import DEMO_GEOMETRY, DEMO_TRACE
    cfg = Config(model=replace(Geometry(), **{k: getattr(DEMO_GEOMETRY, k) for k in ("layers", "kv_heads", "head_dim")}))
    with resources.as_file(resources.files("exporter") / "data" / DEMO_TRACE) as path:
        trace = load_trace(path)
    phases = trace.phases
    sweep_ends = [p for p, q in zip(phases, phases[1:] + [None]) if q is None or q["prompt_tokens"] != p["prompt_tokens"]]
    last_index = {max(i for i, (t, _) in enumerate(trace.snapshots) if t <= p["end_ms"] / 1000): p["name"]
                  for p in sweep_ends}
    runners, slopes = [], []

    def at_sweep_end(i: int, t: float, obs) -> None:
        if i not in last_index:
            return
        for m in runners[0].current()[0].models.values():
            direct, derived = m.fits["miss_slope"], m.miss_slope_derived.get("a")
            slopes.append((last_index[i], direct.extra.get("isl_bucket_lo"), direct.value("a"),
                           direct.params["a"].stderr if direct.ok else None,
                           derived.value if derived else None, derived.stderr if derived else None,
                           direct.extra.get("anomalies")))

    result = replay(trace, cfg, "real", on_step=at_sweep_end, on_start=runners.append)
    out = []
    for summaries in result.phases.values():
        for p in summaries:
            out.append((p.name, p.hit_ratio, p.busy_error, p.ttft_error))
    return out, slopes


def matrix(quick: bool) -> list[Row]:
    if quick:
        return [Row(a, rho, al, n) for a, rho in ((0.2, 0.25), (0.5, 0.1), (0.8, 0.1))
                for al in (0.0, 1.0) for n in (0.02, 0.10)]
    return ([Row(a, rho, al, n) for a in (0.2, 0.5, 0.8) for rho in (0.1, 0.25) for al in (0.0, 0.5, 1.0)
             for n in (0.02, 0.10)]
            + [Row(a, rho, 0.5, n, dips=True) for a, rho in ((0.2, 0.25), (0.5, 0.1), (0.8, 0.1))
               for n in (0.02, 0.10)])


def _f(x: float | None, spec: str = ".3f") -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def misses(rows: list[Row]) -> list[str]:
    """Bars missed by a 2 %-noise row beyond the noise margin."""
    out = []
    for r in rows:
        if r.noise > 0.02:
            continue
        tag = f"a={r.a} ρ={r.rho} α={r.alpha}"
        for method, win, err in (("direct", r.a_windows, r.a_err), ("derived", r.a_derived_windows, r.a_derived_err)):
            if (win is None or win > BAR_WINDOWS) and not (err <= BARS["a"] + MARGIN["a"]):
                out.append(f"{tag}: â {method} not within {BARS['a']} from window {BAR_WINDOWS} on "
                           f"(error at {BAR_WINDOWS}: {_f(err)})")
        if r.alpha_windows is None or r.alpha_windows > BAR_WINDOWS:
            if not (r.alpha_err <= BARS["alpha"] + MARGIN["alpha"]):
                out.append(f"{tag}: α̂ not within {BARS['alpha']} by window {BAR_WINDOWS} (error {_f(r.alpha_err)})")
        if not (r.ttft_mape <= BARS["ttft_mape"] + MARGIN["ttft_mape"]):
            out.append(f"{tag}: TTFT MAPE {_f(100 * r.ttft_mape, '.1f')} % > 5 %")
        if r.valley != "none" and (r.valley_delay is None or r.valley_delay > BARS["valley_windows"]):
            out.append(f"{tag}: valley detected after {_f(r.valley_delay, 'd')} windows (bar 3)")
        if r.valley == "none" and r.false_alarms:
            out.append(f"{tag}: {r.false_alarms} false valley alarms")
    return out


def _table(rows: list[Row]) -> list[str]:
    lines = [
        "| a | ρ | α | noise | windows â direct | \\|â−a\\| direct @20 | windows â derived | \\|â−a\\| derived @20 | "
        "windows α̂ | \\|α̂−α\\| @20 | TTFT MAPE unseen h | true valley | delay [windows] |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        valley = (_f(r.valley_delay, "d") if r.valley != "none" else f"{r.false_alarms} false alarms")
        lines.append(f"| {r.a} | {r.rho} | {r.alpha} | {r.noise:.0%} | {_f(r.a_windows, 'd')} | {_f(r.a_err)} | "
                     f"{_f(r.a_derived_windows, 'd')} | {_f(r.a_derived_err)} | {_f(r.alpha_windows, 'd')} | {_f(r.alpha_err)} | "
                     f"{_f(100 * r.ttft_mape, '.1f')} % | {r.valley} | {valley} |")
    return lines


def markdown(rows: list[Row], real: list, slopes: list, quick: bool, elapsed: float) -> str:
    matrix_rows = [r for r in rows if not r.dips]
    dip_rows = [r for r in rows if r.dips]
    lines = [
        f"# kvhit accuracy ({'quick' if quick else 'full'} matrix; {elapsed:.0f} s; benchmarks/accuracy.py)",
        "",
        "Simulator: exporter/simulate.py (MODEL.md §3.2, §4, §7 with known parameters), 5-s scrapes, "
        "60-s windows, 30 training windows. Bars (2 % noise): |â−a| ≤ 0.02 and |α̂−α| ≤ 0.05 within "
        "20 windows, TTFT MAPE ≤ 5 % at unseen h, valley entry detected within 3 windows. "
        f"--check noise margins: {MARGIN}.",
        "",
        *_table(matrix_rows),
    ]
    if dip_rows:
        miss = misses(dip_rows)
        lines += ["", "With tail-chunk dips at h = 0.2, 0.4, 0.7 (depths 20, 40, 70 % of the step's work; "
                  "not part of issue 6's matrix, not checked):", "", *_table(dip_rows), "",
                  "Missed with tail-chunk dips: " + ("none" if not miss else ""), *[f"- {m}" for m in miss]]
    lines += ["", "Real vLLM 0.32 (bundled trace, leave-one-phase-out, exporter/replay.py):", "",
              "| phase | h | busy-time error | load-aware TTFT error |", "|---|---|---|---|"]
    for name, h, be, te in real:
        lines.append(f"| {name} | {_f(h)} | {_f(None if be is None else 100 * be, '+.1f')} % | "
                     f"{_f(None if te is None else 100 * te, '+.1f')} % |")
    be = [abs(x[2]) for x in real if x[2] is not None]
    te = [abs(x[3]) for x in real if x[3] is not None]
    if be:
        lines.append(f"| **max / median \\|error\\|** | | {100 * max(be):.1f} / {100 * statistics.median(be):.1f} % | "
                     + (f"{100 * max(te):.1f} / {100 * statistics.median(te):.1f} % |" if te else "— |"))
    lines += ["", "Miss slope on the same trace at the end of each sweep (no true a on a real engine: the direct "
              "line through measured TPS_miss and the derived line through the chip-time curve cross-check):", "",
              "| after phase | ISL bucket | â direct ± stderr | â derived ± stderr | flagged tail-chunk steps |",
              "|---|---|---|---|---|"]
    for name, lo, a, a_se, d, d_se, n_anom in slopes:
        lines.append(f"| {name} | [{lo}, {2 * lo}) | {_f(a)} ± {_f(a_se)} | {_f(d)} ± {_f(d_se)} | {_f(n_anom, 'd')} |")
    miss = misses(matrix_rows)
    lines += missed("Bars missed (2 % noise rows)", miss)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, "accuracy")
    p.add_argument("--jobs", type=int, default=2)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    rows = matrix(args.quick)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(run_row, rows))
    real, slopes = real_vllm()
    text = markdown(rows, real, slopes, args.quick, time.perf_counter() - t0)
    return finish("accuracy", args, text, misses([r for r in rows if not r.dips]))


if __name__ == "__main__":
    sys.exit(main())
