"""Offline replay of a recorded trace through the whole pipeline, plus per-phase validation.

The trace's own timestamps drive windows and rates (never the wall clock). When the trace
has ``phases.json``, every phase is summarised: measured h = Δhits/Δqueries over the steps
inside the phase, busy steps and busy (chip) time, and the chip-time model refitted with that
phase's steps left out predicting the phase's total busy time (MODEL.md §7); likewise the
phase's mean TTFT predicted by the load-aware layer (MODEL.md §7: observed queue time +
c(running)·P_chip(h) + visible load) with the chip-time and latency fits made without it.
The summaries take the steps the online fits took: a step the next one did not confirm (a
scrape that read high: exporter/analyzer.py ``_confirms``) is left out of them too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

from exporter.config import Config, ConfigError
from exporter.runner import Runner
from exporter.sources import Trace
from fitters.chiptime import fit_chip_time, observed_regressors, predict_busy_time
from fitters.latency import LatencySample, fit_latency, predict_prefill_latency
from fitters.model import ChipTimeCoefficients
from fitters.observation import Observation

# A step this many median steps long lacks a scrape: a recorder scrapes on a fixed schedule and
# skips a failed scrape (one missing doubles the step); a late answer moves time by less.
MISSED_STEPS = 1.5


@dataclass(frozen=True)
class PhaseSummary:
    """One phase of a recorded trace (a step belongs to it when both scrapes fall inside).

    Attributes:
        name: phase name from phases.json; designed_hit_ratio: what the driver intended.
        steps, busy_steps: steps inside the phase / busy ones.
        hit_ratio: measured Δhits/Δqueries over the phase's steps (None without queries).
        busy_seconds: Σ Δt of busy steps [s].
        predicted_busy_seconds: Σ predicted Δt_busy from the fit without this phase [s], over
            the busy steps the model can read (all five regressors known: not the busy step
            before the first request finished, whose ISL is unknown).
        busy_error: predicted/observed − 1 over those same steps (None when not computable).
        predicted_steps, predicted_over_seconds: how many busy steps the prediction covers and
            their observed Σ Δt [s] (what ``busy_error`` compares with; below ``busy_steps`` /
            ``busy_seconds`` when some busy step cannot be read).
        unpredicted: why ``predicted_busy_seconds`` is None ("" when it is not).
        miss_tps: mean TPS_miss over busy steps [tokens/s].
        prefill_seconds: mean observed request_prefill_time_seconds of the phase [s].
        ttft_seconds: observed mean TTFT of the phase [s]: step means of
            time_to_first_token_seconds weighted by the step's finished requests, over the steps
            the prediction can use (see :func:`phase_ttft`).
        predicted_ttft_seconds: the same mean predicted by the load-aware layer fitted without
            the phase [s]; ttft_error: predicted/observed − 1.
    """

    name: str
    designed_hit_ratio: float | None
    steps: int
    busy_steps: int
    hit_ratio: float | None
    busy_seconds: float
    predicted_busy_seconds: float | None
    busy_error: float | None
    miss_tps: float | None
    prefill_seconds: float | None
    ttft_seconds: float | None = None
    predicted_ttft_seconds: float | None = None
    ttft_error: float | None = None
    predicted_steps: int = 0
    predicted_over_seconds: float = 0.0
    unpredicted: str = ""


_REGRESSOR = "a regressor: engine steps, h, ISL or OSL"  # what a busy step the chip-time model cannot read lacks


def phase_footnotes(rows: list[dict]) -> list[str]:
    """Lines under a phase table (``rows``: :class:`PhaseSummary` fields as a dict) for the
    phases whose ``pred[s]`` does not cover its ``busy[s]``: over fewer busy steps (and which
    seconds it compares with), or withheld (why)."""
    out = []
    for p in rows:
        if "busy_steps" not in p:  # a phase without a summary (calibrate: no step inside it)
            continue
        if p["predicted_busy_seconds"] is None:
            if p["unpredicted"]:
                out.append(f"{p['name']}: pred[s] - : {p['unpredicted']}")
        elif p["predicted_steps"] < p["busy_steps"]:
            out.append(f"{p['name']}: pred[s] and err over the {p['predicted_steps']} of {p['busy_steps']} busy steps "
                       f"the model can read ({p['predicted_over_seconds']:.1f} s of busy[s]; "
                       f"each other lacks {_REGRESSOR})")
    return out


@dataclass
class ReplayResult:
    runner: Runner
    steps: list[tuple[str, Observation]] = field(default_factory=list)  # every step, in order
    # ids of the steps the online fits left out (Analyzer.last_dropped: a scrape that read high)
    unfitted: set[int] = field(default_factory=set)
    phases: dict[str, list[PhaseSummary]] = field(default_factory=dict)  # model → summaries


def _missed(steps: list[float], k: int = 15) -> list[bool]:
    """Per step [s] of a recording: whether it lacks a scrape, at least MISSED_STEPS × the smaller
    of the lower medians of the k steps before it and of the k after it (one side at an end). The
    interval there, not the whole recording's: a recording whose interval grew from 2 s to 4 s
    had every step after the change taken for a missed scrape, never busy (a breaker); now the
    k/2 or so nearest the change on its long side are. A run of up to about k missed scrapes (a target failing every
    other one) stays flagged: one side's median is still the interval's (with the larger of the
    two, a run of 10 was not, review). The lower median: of two steps, a 2-s one and a gap of
    4 s, the gap must not set the scale."""
    def lower_median(xs: list[float]) -> float:
        xs = sorted(xs)
        return xs[(len(xs) - 1) // 2] if xs else math.inf
    refs = (min(lower_median(steps[max(0, i - k):i]), lower_median(steps[i + 1:i + 1 + k])) for i in range(len(steps)))
    return [ref < math.inf and dt >= MISSED_STEPS * ref for dt, ref in zip(steps, refs)]


class TraceClock:
    """"Now" for a replay: the timestamp of the snapshot being replayed (never the wall clock)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def replay(trace: Trace, config: Config, target: str,
           on_step: Callable[[int, float, dict[str, Observation]], None] | None = None,
           on_start: Callable[[Runner], None] | None = None) -> ReplayResult:
    """Feed every snapshot of ``trace`` through a :class:`Runner` on the trace's clock.

    ``on_start(runner)`` is called once before the first snapshot (e.g. to serve it);
    ``on_step(index, timestamp, observations)`` after each snapshot (printing / pacing).
    Returns the runner (for the final analysis), every step observation and per-phase
    summaries per model. ``config.interval`` is raised to the trace's median step, so that what
    follows the scrape interval (the default scrape-gap threshold, the age past which a model's
    window is too old to publish) follows the recording. A step of MISSED_STEPS × the recording's
    interval there or longer (:func:`_missed`) lacks a scrape (a recorder skips failed ones,
    exporter/calibrate.py): like a step across failed scrapes of a live run it is no busy time.

    Raises:
        ValueError: no snapshot of the trace could be read (one line: how many, and why).
        ConfigError: ``config.gap_seconds`` not above that interval (every step would be a gap).
    """
    # the trace's own scrape interval (median step): a recorder that scraped every 2 min must not
    # have every step taken for a scrape gap, nor a window one skipped scrape old for too old
    stamps = [t for t, _ in trace.snapshots]
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    if steps:
        config = replace(config, interval=max(config.interval, sorted(steps)[len(steps) // 2]))
    missed = _missed(steps)
    if config.gap_seconds is not None and config.gap_seconds <= config.interval:
        raise ConfigError(f"config key gap_seconds: {config.gap_seconds:g} s is not above the recording's scrape "
                          f"interval ({config.interval:g} s, its median step): every step would be a gap")
    clock = TraceClock()
    runner = Runner(config, target, clock=clock)
    if on_start is not None:
        on_start(runner)
    result = ReplayResult(runner)
    for i, (t, text) in enumerate(trace.snapshots):
        clock.t = t
        runner.ingest_text(t, text, missed=i > 0 and missed[i - 1])
        obs = runner.analyzer.last_observations
        result.steps.extend(obs.items())
        result.unfitted.update(id(o) for o in runner.analyzer.last_dropped.values())
        if on_step is not None:
            on_step(i, t, obs)
    health = runner.current()[1]
    if health.last_success is None:  # nothing was analysed: not a result to print as one
        reasons = ", ".join(f"{k} ×{n}" for k, n in sorted(health.errors.items()))
        raise ValueError(f"{target}: none of the {len(trace.snapshots)} scrapes could be read ({reasons})")
    if trace.phases:
        for model in sorted({m for m, _ in result.steps}):
            # the phase summaries' refits and sums take the steps the online fits took
            steps = [o for m, o in result.steps if m == model and id(o) not in result.unfitted]
            result.phases[model] = summarise_phases(steps, trace.phases)
    return result


def phase_steps(steps: list[Observation], phase: dict) -> list[Observation]:
    """Steps whose both scrapes fall inside [start_ms, end_ms] of the phase (MODEL.md §7)."""
    start, end = phase["start_ms"] / 1000.0, phase["end_ms"] / 1000.0
    return [o for o in steps if o.t - o.dt >= start and o.t <= end]


def summarise_phases(steps: list[Observation], phases: list[dict]) -> list[PhaseSummary]:
    """Per-phase summaries with leave-one-phase-out busy-time prediction."""
    out = []
    for phase in phases:
        inside = phase_steps(steps, phase)
        ids = {id(o) for o in inside}
        busy = [o for o in inside if o.busy]
        # over the steps whose queries and both hit counts are known: a step with its hits unknown
        # (a cut body, NaN) in the queries alone read h low (a physics review: 0.25 for 0.5)
        known = [o for o in inside if None not in (o.queried_tokens, o.hit_tokens_device, o.hit_tokens_loaded)]
        q = sum(o.queried_tokens for o in known)
        h = sum(o.hit_tokens_device + o.hit_tokens_loaded for o in known) / q if q > 0 else None
        busy_s = sum(o.dt for o in busy)
        fit = fit_chip_time([o for o in steps if id(o) not in ids])
        predicted = err = None
        coef = ChipTimeCoefficients(*(fit.params[k].value for k in fit.params)) if fit.ok else None
        readable = [o for o in busy if None not in observed_regressors(o)]
        seen = sum(o.dt for o in readable)
        if coef is None:
            why = f"the chip-time fit without the phase is {fit.status.value}" + (f" ({fit.reason})" if fit.reason else "")
        elif not readable:
            why = f"no busy step the model can read (each lacks {_REGRESSOR})" if busy else "no busy step"
        else:
            why = ""
            predicted = sum(predict_busy_time(coef, o) for o in readable)
            err = predicted / seen - 1.0 if seen > 0 else None
        others = [o for o in steps if id(o) not in ids]
        ttft, ttft_pred = phase_ttft(inside, others, coef)
        tps = [o.miss_tps for o in busy if o.miss_tps is not None]
        # means of the phase's requests, ΣΔsum / ΣΔcount (MODEL.md §2), not of its steps' means
        prefill = _weighted([(o.requests_finished, o.prefill_time_mean) for o in inside if o.prefill_time_mean is not None])
        out.append(PhaseSummary(
            name=phase.get("name", "?"), designed_hit_ratio=phase.get("intended_hit_ratio"),
            steps=len(inside), busy_steps=len(busy), hit_ratio=h, busy_seconds=busy_s,
            predicted_busy_seconds=predicted, busy_error=err,
            miss_tps=sum(tps) / len(tps) if tps else None,
            prefill_seconds=prefill,
            ttft_seconds=ttft, predicted_ttft_seconds=ttft_pred,
            ttft_error=ttft_pred / ttft - 1.0 if ttft_pred is not None and ttft else None,
            predicted_steps=len(readable) if predicted is not None else 0,
            predicted_over_seconds=seen if predicted is not None else 0.0, unpredicted=why,
        ))
    return out


def phase_ttft(inside: list[Observation], others: list[Observation],
               coef: ChipTimeCoefficients | None) -> tuple[float | None, float | None]:
    """(observed, predicted) mean TTFT of a phase [s], the prediction left-one-phase-out.

    Prediction per step (MODEL.md §7 load-aware layer, as the analyzer publishes it): observed
    mean queue time + c(running)·(t_step + T_compute(h)) + visible load, with c = c0 + c1·running
    fitted by :func:`fitters.latency.fit_latency` on ``others`` (the steps outside the phase)
    with ``coef`` (the chip-time fit without the phase). Both means are over the same steps —
    those with finished requests (a queue time), known TTFT, running, ISL and h and no anomaly —
    weighted by first tokens: the observed one is then ΣΔsum / ΣΔcount of the TTFT histogram over
    those steps (MODEL.md §2). When no prediction is possible (no chip-time fit, load-aware fit
    not ok, a step needs α), the observed mean is over the same steps but for running, ISL and h.
    """
    usable = [o for o in inside if o.requests_finished > 0 and o.ttft_mean is not None and not o.anomaly_hint]
    observed = _weighted([(o.ttft_count, o.ttft_mean) for o in usable])
    if coef is None:
        return observed, None
    la, _ = fit_latency([s for o in others if (s := LatencySample.from_observation(o)) is not None], coef, None, None)
    if not la.ok:
        return observed, None
    c0, c1 = la.params["c0"].value, la.params["c1"].value if la.params["c1"].ok else 0.0
    pairs = []
    for o in usable:
        if None in (o.queue_time_mean, o.running, o.isl, o.hit_ratio, o.hit_ratio_loaded):
            continue
        try:
            latency = predict_prefill_latency(coef, c0, c1, o.running, o.isl, o.hit_ratio, o.hit_ratio_loaded)
        except ValueError:
            latency = None
        if latency is None:
            return observed, None
        pairs.append((o.ttft_count, o.ttft_mean, o.queue_time_mean + latency))
    if not pairs:
        return observed, None
    return _weighted([(n, y) for n, y, _ in pairs]), _weighted([(n, p) for n, _, p in pairs])


def _weighted(pairs: list[tuple[float, float]]) -> float | None:
    total = sum(n for n, _ in pairs)
    return sum(n * v for n, v in pairs) / total if total > 0 else None


def fmt(x: float | None, spec: str = ".3f", unit: str = "") -> str:
    """Format a number for tables, ``unit`` appended; unknown → '-' (no unit)."""
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec) + unit
