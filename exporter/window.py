"""Steps and publish windows (MODEL.md §1): counter increases between snapshots.

A *step* is the interval between two consecutive snapshots; its :class:`Delta` holds the
increase of every counter and histogram series of one model. A counter that went down
(engine restart), or whose ``_created`` timestamp changed, restarted from zero: its increase is
its current value, as in Prometheus ``increase()``. The *publish window* sums the steps from the
newest snapshot at least ``window_seconds`` older than the latest one to the latest one; before
that much history exists it covers the span there is (≥ 2 snapshots).

Bad days, each handled as a kind:

* Restarts are detected per data-parallel engine (:attr:`ModelSignals.engines`): one engine's
  restart counts that engine's current values, the others' plain increases — never one
  engine's lifetime total as an increase, never a negative one.
* A step across which the model's engine set changed (DP scale, a cut body) has no increases:
  unknown, not a partial or inflated sum.
* A step whose ``_created`` stamps changed to a time before the previous scrape came from another
  process (one target URL load-balancing several pods): no increases either, never a pod's
  lifetime total taken for a restart's increase.
* A scrape in which a value went down while every ``_created`` stayed the same (a glitched read,
  not a restart) is skipped for that model: the next step is taken from the scrape before it, so
  a scrape that read low costs the fits nothing; the step ending at the scrape before is in doubt
  until the next scrape tells (``doubted``), and the publish window ends before it meanwhile
  (unless it is the window's only step, or one without increases: a glitch, another process, an
  engine set changed).
  Still down at the next scrape (the skipped one had read
  high), that step has no increases (``glitches``) and counting starts afresh from it; nor has
  a later step in which a value rises by at least what it fell then (the scrapes since read
  low: that step holds what they missed), within DEFICIT_WINDOWS publish windows, or while that
  value has not grown since.
* A histogram whose ``_sum`` goes down without a reset has an unknown Δsum; bucket deltas that
  go down are dropped, never clamped to 0; a Δsum outside what the bucket deltas allow
  (:attr:`HistogramDelta.problem`, e.g. all observations ≤ 1 ms but a mean of 0.5 s) makes the
  mean unknown.
* A scrape gap — a step longer than ``gap_seconds`` (default twice the publish window: target
  down, kvhit paused, the clock jumped forward) — is not a step: the publish window starts again
  after it, so no published value averages over the gap (:attr:`Windows.gaps` counts them).
* A snapshot not newer than the last one (clock stepped back, duplicate replay file) is
  rejected and changes nothing.

Memory is bounded: only the steps inside the current publish window are kept.
"""
from __future__ import annotations

import functools
import math
import operator
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Collection, Container, Mapping

from exporter.parse import Buckets, Histogram, ModelSignals, Snapshot

# Clock difference tolerated between kvhit's scrape time and the engine's ``_created`` stamps.
CREATED_SKEW_SECONDS = 60.0


@dataclass(frozen=True)
class HistogramDelta(Buckets):
    """Increase of one histogram: Δsum, Δcount and per bucket (``edges``) the increase of its
    cumulative count (``counts``); ``buckets`` pairs them."""

    sum: float
    count: float
    edges: tuple[float, ...] = ()
    counts: tuple[float, ...] = ()

    @functools.cached_property
    def mean(self) -> float | None:
        """Δsum/Δcount, the mean of the observations in the interval (None when none, when the
        sum is unknown, or when the sum disagrees with the buckets: see :attr:`problem`)."""
        if self.count <= 0 or not math.isfinite(self.sum) or self.problem:
            return None
        return self.sum / self.count

    @functools.cached_property
    def problem(self) -> str:
        """Why Δsum/Δcount cannot be trusted ("" when it can).

        vLLM's histograms observe non-negative quantities, so the Δcount observations, placed in
        their buckets (le_{i-1}, le_i] (the first from 0), bound Δsum: between Σ n_i·le_{i-1}
        and Σ n_i·le_i (+∞ with observations above the highest finite edge). A Δsum outside those
        bounds (relative tolerance 1e-6) means ``_sum`` and the buckets disagree (e.g. vLLM
        0.5.1's TTFT with every observation in the first bucket).
        """
        if self.count <= 0:
            return "no observation in the interval"
        if not math.isfinite(self.sum):
            return "no _sum, or _sum went down at a step without a restart (or one engine or step lacks it)"
        edges, counts = self.edges, self.counts
        if not counts:
            return ""
        k = len(edges) - (edges[-1] == math.inf)  # the finite edges
        n = tuple(map(operator.sub, counts[:k], (0.0, *counts[:max(k - 1, 0)])))  # observations per bucket
        lo = sum(map(operator.mul, n, (0.0, *edges[:max(k - 1, 0)])))  # each at its bucket's lower edge …
        hi = sum(map(operator.mul, n, edges[:k]))  # … or its upper edge
        prev_le, prev_c = (edges[k - 1], counts[k - 1]) if k else (0.0, 0.0)
        if k < len(edges):  # the +Inf bucket
            if counts[k] > prev_c:
                hi = math.inf
                lo += (counts[k] - prev_c) * prev_le
            prev_c = counts[k]
        rest = self.count - prev_c
        if rest > 0:  # observations above the highest edge listed
            lo += rest * prev_le
            hi = math.inf
        tol = 1e-6 * max(abs(self.sum), lo, 1e-12)
        if self.sum < lo - tol or self.sum > hi + tol:
            return SUM_DISAGREES
        return ""


@dataclass(frozen=True)
class EngineStep:
    """One data-parallel engine's part of a step: its mean ``num_requests_running`` over the step
    (the two scrapes'; None without the gauge at either end) [requests] and its histogram
    increases (canonical name → :class:`HistogramDelta`)."""

    running: float | None
    histograms: Mapping[str, HistogramDelta]


@dataclass(frozen=True)
class Delta:
    """Increase of one model's signals over an interval [t0, t1].

    Attributes:
        t0, t1: bounds [unix s]; ``dt`` = t1 - t0.
        counters: canonical counter → increase (only counters present at both ends).
        histograms: canonical histogram → :class:`HistogramDelta`.
        start, end: gauges at the two ends (:attr:`ModelSignals.gauges`).
        resets: number of steps inside the interval in which the model's counters reset.
        foreign: number of steps inside the interval whose two scrapes came from different
            processes (no increases: :func:`step_delta`).
        steps: number of scrape-to-scrape steps summed.
        glitches: number of steps inside the interval in which a value went down with every
            ``_created`` unchanged (no increases: :func:`step_delta`).
        running_seconds: ∫ num_requests_running dt over the interval [request·s], the trapezoid
            of each step's two scrapes summed (its mean is the interval's time-averaged
            concurrency, not the two ends'); None when a scrape inside lacks the gauge.
        partial: counters present at some scrape inside the interval but not at every one (a
            family dropped as NaN or cut from one body): absent from ``counters``, unknown over
            the interval — not a family the engine never exports.
        spikes: number of steps inside the interval in which a token counter rose over its peak
            by exporter/analyzer.py SPIKE_FACTOR (marked by the analyzer: :meth:`Windows.mark_spike`,
            on arrival, cleared when the next step shows traffic).
        rescaled: number of steps inside the interval across which the model's set of
            data-parallel engines changed (no increases: :func:`step_delta`).
        instance_seconds: Σ instances × step length over the interval [instance·s], each step's
            instances those its end snapshot's sums came from (:attr:`Snapshot.instance_counts`:
            fleet mode's pods); None when a step's snapshot did not tell them.
        doubted: 1 for a step whose end scrape the next one contradicted (a value went down
            after it: it read high, or the next one low, which the scrape after tells; marked by
            :meth:`Windows.push` until then): the publish window ends before it meanwhile.
        engine_steps: of a step with increases on two or more data-parallel engines, each
            engine's own part (:class:`EngineStep`; ``histograms`` adds them up): for what is per
            engine, as ``--max-num-seqs``; () for one engine and for an interval.
    """

    t0: float
    t1: float
    counters: Mapping[str, float]
    histograms: Mapping[str, HistogramDelta]
    start: Mapping[str, float]
    end: Mapping[str, float]
    resets: int = 0
    foreign: int = 0
    steps: int = 1
    glitches: int = 0
    running_seconds: float | None = None
    partial: frozenset[str] = frozenset()
    spikes: int = 0
    instance_seconds: float | None = None
    rescaled: int = 0
    doubted: int = 0
    engine_steps: tuple[EngineStep, ...] = ()

    @property
    def dt(self) -> float:
        return self.t1 - self.t0

    @property
    def void(self) -> bool:
        """Whether the interval holds a step without increases (``foreign``, ``glitches``,
        ``rescaled``): every sum over it is unknown."""
        return bool(self.foreign or self.glitches or self.rescaled)


def _process(sig: ModelSignals) -> float | None:
    """The process an engine's signals come from: its earliest ``_created`` stamp [unix s] (a
    process stamps its series from its start on; later families only later), None without one."""
    return min(sig.created.values()) if sig.created else None


def _step_kind(prev: ModelSignals, cur: ModelSignals, t0: float, known: Container[float] = ()) -> str:
    """How the step from ``prev`` to ``cur`` (``t0`` on the wall clock of the ``_created`` stamps:
    step_delta's clock_offset) began: "restart" (every ``_created`` timestamp both scrapes share
    changed — a new process stamps all its series anew —, or, where no ``_created`` tells, more
    than half the counters and observation counts above 0 went down, some below half its last
    value), "foreign" (they changed to a
    time before the previous scrape ``t0``, less CREATED_SKEW_SECONDS: a restarted engine creates
    its series after the old one was last scraped, so this is another process's series — a target
    URL reaching several pods), "glitch" (a value went down while some ``_created`` both scrapes
    share stayed put, or, without them, any other fall: the same process, so no restart, and
    its lifetime totals are no increase) or "" (plain increases). Some stamps changed and some not
    is no restart: one series recreated in a live process (a review moved one family's stamp
    alone, and its lifetime totals counted as one step: TPM read 5×, h 0.16 for 0.30, the caching
    verdict not_paying for 24 h); the values decide.
    ``known``: the processes (:func:`_process`) this engine's scrapes came from before: a change
    to one of them is "foreign" too (a load-balanced URL flipping between two young pods, each
    created within CREATED_SKEW_SECONDS, read a restart at every flip: 25× TPM, review)."""
    if cur.created != prev.created:  # the usual case, equal maps, compared in C
        shared = [(a, cur.created[name]) for name, a in prev.created.items() if name in cur.created]
        if shared and all(a != b for a, b in shared):
            new = min(b for _, b in shared) > t0 - CREATED_SKEW_SECONDS and _process(cur) not in known
            return "restart" if new else "foreign"
    pairs = _pairs(prev, cur)
    if not any(now < before for _, now, before in pairs):
        return ""
    if any(name in prev.created for name in cur.created):
        return "glitch"
    # no _created to tell (prometheus_client's multiprocess mode): a new process counts from 0, so
    # some value fell below half its last, and more than half of those above 0 went down (a young
    # process's rare counters may pass the old one's: preemptions 1 → 2). A smaller fall is the same process
    # read low (a torn read: hits × 0.9 counted every counter's lifetime as one step, h 0.67 for
    # 0.81), and so is one counter read 0 while the others grew (taken for a restart, their
    # lifetimes made the TPM 2.2x for a window: adversarial tests)
    above = [now < before for _, now, before in pairs if before > 0]
    from_zero = any(now < 0.5 * before for _, now, before in pairs) and 2 * sum(above) > len(above)
    return "restart" if from_zero else "glitch"


def _pairs(prev: ModelSignals, cur: ModelSignals) -> list[tuple[str, float, float]]:
    """(name, value at ``cur``, value at ``prev``) of each counter and histogram observation count
    present at both scrapes (one engine's signals)."""
    pairs = [(n, v, prev.counters[n]) for n, v in cur.counters.items() if n in prev.counters]
    pairs += [(n, h.count, prev.histograms[n].count) for n, h in cur.histograms.items() if n in prev.histograms]
    return pairs


def _halved(prev: ModelSignals, cur: ModelSignals) -> bool:
    """Whether some engine's counter or observation count fell below half its value at ``prev``
    (per engine where both have ``engines``: a model's sums hide one engine's fall)."""
    return any(now < 0.5 * then for _, _, now, then in _engine_pairs(prev, cur))


def step_delta(prev: ModelSignals, cur: ModelSignals, t0: float, t1: float, clock_offset: float = 0.0,
               known: Container[float] = ()) -> Delta:
    """The :class:`Delta` of one model between two consecutive snapshots (MODEL.md §1).

    A counter or histogram present in only one of the two is absent from the delta (unknown).
    A restart detected on any series of an engine (value down, or ``_created`` changed) is
    applied to all of that engine's signals, so that ratios of its counters stay consistent:
    every increase is then the current value, as Prometheus ``increase()`` counts a reset.
    A ``_created`` that changed to before ``t0`` is another process, not a restart (a target URL
    that reaches several pods): the step has no increases (``foreign``), never a pod's lifetime
    total counted as one step's increase. Nor has a step in which a value went down while the
    ``_created`` stamps stayed put (``glitches``: the same process, so no restart; Prometheus
    would count a reset of that series alone, and kvhit's ratios need all of them).
    With per-engine signals (parsed snapshots) increases are formed per engine and summed —
    only signals every engine has at both ends; when the engine set changed the step has no
    increases at all. Signals built by hand (no ``engines``) are one engine.
    ``clock_offset`` [s]: the step's stamps minus the wall clock the engine stamps ``_created``
    on (parse.Snapshot.clock_offset): t0 is compared with ``_created`` on that clock, so a wall
    clock stepped back reads a restart as a restart. ``known``: the processes the model's scrapes
    came from before (:func:`_step_kind`).
    """
    mean = _mean_running(prev, cur)
    running = None if mean is None else mean * (t1 - t0)
    if prev.engines and cur.engines:
        if set(prev.engines) != set(cur.engines):
            return Delta(t0, t1, {}, {}, prev.gauges, cur.gauges, rescaled=1, running_seconds=running)
        parts = [_engine_increase(prev.engines[e], cur.engines[e], t0 - clock_offset, known)
                 for e in sorted(cur.engines)]
    else:
        parts = [_engine_increase(prev, cur, t0 - clock_offset, known)]
    kinds = {k for _, _, k in parts}
    if kinds & {"foreign", "glitch"}:  # two processes' counters, or a value that went back: no increase
        return Delta(t0, t1, {}, {}, prev.gauges, cur.gauges, foreign=int("foreign" in kinds),
                     glitches=int("foreign" not in kinds), running_seconds=running)
    engine_steps: tuple[EngineStep, ...] = ()
    if len(parts) == 1:  # one engine: its increases (+ 0.0: as fsum of one value, -0.0 becomes 0.0)
        counters = {n: v + 0.0 for n, v in parts[0][0].items()}
        hists = parts[0][1]
    else:
        counters = {n: math.fsum(c[n] for c, _, _ in parts)
                    for n in set(parts[0][0]).intersection(*(c for c, _, _ in parts[1:]))}
        hists = {n: _sum_hist_deltas([h[n] for _, h, _ in parts])
                 for n in set(parts[0][1]).intersection(*(h for _, h, _ in parts[1:]))}
        engine_steps = tuple(EngineStep(_mean_running(prev.engines[e], cur.engines[e]), h)
                             for e, (_, h, _) in zip(sorted(cur.engines), parts))
    return Delta(t0, t1, counters, hists, prev.gauges, cur.gauges, resets=int("restart" in kinds),
                 running_seconds=running, partial=frozenset(prev.counters.keys() ^ cur.counters.keys()),
                 engine_steps=engine_steps)


def _mean_running(prev: ModelSignals, cur: ModelSignals) -> float | None:
    """Mean num_requests_running of a step [requests]: its two scrapes' (None without either)."""
    r0, r1 = prev.gauges.get("running"), cur.gauges.get("running")
    return None if r0 is None or r1 is None else (r0 + r1) / 2.0


def _engine_increase(prev: ModelSignals, cur: ModelSignals, wall_t0: float, known: Container[float]
                     ) -> tuple[dict[str, float], dict[str, HistogramDelta], str]:
    kind = _step_kind(prev, cur, wall_t0, known)
    if kind in ("foreign", "glitch"):
        return {}, {}, kind
    restarted = kind == "restart"
    counters = {n: (v if restarted else v - prev.counters[n]) for n, v in cur.counters.items() if n in prev.counters}
    hists = {n: _hist_increase(prev.histograms[n], h, restarted)
             for n, h in cur.histograms.items() if n in prev.histograms}
    return counters, hists, kind


def _hist_increase(p: Histogram, h: Histogram, reset: bool) -> HistogramDelta:
    if reset:
        return HistogramDelta(h.sum, h.count, h.edges, h.counts)
    edges: tuple[float, ...] = ()
    increases: tuple[float, ...] = ()
    if h.counts and p.counts:
        edges = h.edges
        if edges is p.edges or edges == p.edges:  # the usual case: the same edges at both scrapes
            increases = tuple(map(operator.sub, h.counts, p.counts))
        else:
            prev = dict(p.buckets)
            edges = tuple(le for le in edges if le in prev)
            increases = tuple(c - prev[le] for le, c in h.buckets if le in prev)
        if not increases or min(increases) < 0:
            # a bucket that went down while _count did not: the bucket deltas are unknown
            edges, increases = (), ()
    total = h.sum - p.sum
    if total < 0:
        total = math.nan  # _sum went down while _count did not: Δsum unknown, never negative
    return HistogramDelta(total, h.count - p.count, edges, increases)


def _sum_hist_deltas(parts: list[HistogramDelta]) -> HistogramDelta:
    """Sum of histogram deltas (engines of one step, or steps of one interval): the buckets of
    the edges every part has."""
    if len(parts) == 1:
        return parts[0]
    edges = parts[0].edges
    if all(p.edges is edges or p.edges == edges for p in parts[1:]):
        counts = tuple(map(math.fsum, zip(*(p.counts for p in parts))))
    else:
        edges = tuple(sorted(set(edges).intersection(*(p.edges for p in parts[1:]))))
        counts = tuple(math.fsum(dict(p.buckets)[le] for p in parts) for le in edges)
    return HistogramDelta(math.fsum(p.sum for p in parts), math.fsum(p.count for p in parts), edges, counts)


def add_deltas(deltas: list[Delta], counters: Collection[str] | None = None,
               histograms: Collection[str] | None = None) -> Delta:
    """Sum consecutive step deltas into one interval delta (first.t0 .. last.t1).

    Only signals present in every step are summed; one missing step makes the total unknown.
    ``counters`` / ``histograms``: sum only these (None: all), for a reader that needs a few.
    """
    first, last = deltas[0], deltas[-1]
    # names every step has (a few names: look them up, do not intersect whole maps)
    names = [n for n in (first.counters if counters is None else counters)
             if all(n in d.counters for d in deltas)]
    sums = {n: math.fsum(d.counters[n] for d in deltas) for n in names}
    hnames = [n for n in (first.histograms if histograms is None else histograms)
              if all(n in d.histograms for d in deltas)]
    hists = {n: _sum_hist_deltas([d.histograms[n] for d in deltas]) for n in hnames}
    running = [d.running_seconds for d in deltas]
    instances = [d.instance_seconds for d in deltas]
    return Delta(first.t0, last.t1, sums, hists, first.start, last.end,
                 resets=sum(d.resets for d in deltas), foreign=sum(d.foreign for d in deltas), steps=len(deltas),
                 glitches=sum(d.glitches for d in deltas), spikes=sum(d.spikes for d in deltas),
                 rescaled=sum(d.rescaled for d in deltas),
                 running_seconds=None if None in running else math.fsum(running),
                 instance_seconds=None if None in instances else math.fsum(instances),
                 # a counter's presence changes only across a step, which lists it
                 partial=frozenset().union(*(d.partial for d in deltas)))


@dataclass
class ModelWindow:
    """Step deltas of one model inside the publish window (bounded by ``window_seconds``)."""

    window_seconds: float
    steps: deque = field(default_factory=deque)

    def push(self, delta: Delta) -> None:
        self.steps.append(delta)
        # Keep the newest step that starts at or before latest - window (the window base).
        latest = delta.t1
        while len(self.steps) >= 2 and self.steps[1].t0 <= latest - self.window_seconds:
            self.steps.popleft()

    def total(self, counters: Collection[str] | None = None, histograms: Collection[str] | None = None) -> Delta | None:
        """The publish-window delta (of only ``counters`` / ``histograms`` when given, as
        :func:`add_deltas`), ending before a last step in doubt (:attr:`Delta.doubted`) unless it
        is the only one or has no increases (:attr:`Delta.void`: it overstates nothing, and it says
        why the window is unknown, e.g. that a step before it holds a scrape that read high); None
        before two snapshots exist."""
        steps = list(self.steps)
        if len(steps) > 1 and steps[-1].doubted and not steps[-1].void:
            steps.pop()  # its end scrape may have read high: the window ends before it
        if not steps:
            return None
        return add_deltas(steps, counters, histograms)


SUM_DISAGREES = "_sum disagrees with the buckets"  # HistogramDelta.problem: one of them is wrong, which is unknown
KNOWN_PROCESSES = 16  # processes remembered per model (_step_kind's known: a URL reaching several pods)
# Scrapes of a model skipped in a row while a value stays below half its value at the scrape before
# them (Windows.push; a smaller fall, which a high read before them also makes, one): a counter read
# 0 for 3 scrapes and back counted its whole lifetime as the step back, which was fitted and raised
# the spike guard's peak 25x for good (adversarial test), when one was skipped.
GLITCH_HOLD_SCRAPES = 3
# How long [publish windows] a value that fell at a glitch step and grew since is watched for its
# rise back: a burst an hour later, rising by as much, was taken for one (review). One that has not
# grown since (still read 0) is watched until it does.
DEFICIT_WINDOWS = 10


def _engine_pairs(prev: ModelSignals, cur: ModelSignals):
    """(engine label, name, value at ``cur``, value at ``prev``) over the engines both scrapes have
    (:func:`_pairs`; one engine, label "", without ``engines``)."""
    if not (prev.engines and cur.engines):
        return (("", n, now, then) for n, now, then in _pairs(prev, cur))
    return ((e, n, now, then) for e, sig in cur.engines.items() if e in prev.engines
            for n, now, then in _pairs(prev.engines[e], sig))


def _deficits(before: ModelSignals, cur: ModelSignals) -> dict[tuple[str, str], tuple[float, float]]:
    """(engine label, name) → (what each value that went down from ``before`` to ``cur`` fell by,
    its value at ``cur``)."""
    return {(e, n): (then - now, now) for e, n, now, then in _engine_pairs(before, cur) if now < then}


def _remember(known: dict[float, None], sig: ModelSignals) -> None:
    """Add the processes of ``sig``'s engines to ``known`` (the latest last, KNOWN_PROCESSES kept)."""
    for engine in (sig.engines.values() if sig.engines else (sig,)):
        p = _process(engine)
        if p is not None:
            known.pop(p, None)
            known[p] = None
    while len(known) > KNOWN_PROCESSES:
        del known[next(iter(known))]


class Windows:
    """Turns a stream of snapshots into per-model step deltas and publish windows.

    ``push`` returns the new step deltas (model → Delta). A snapshot not newer than the last
    one (clock step back, duplicate replay file) is rejected with ValueError and changes nothing.
    """

    def __init__(self, window_seconds: float, gap_seconds: float | None = None) -> None:
        if window_seconds <= 0:
            raise ValueError("window_seconds must be > 0")
        self.window_seconds = window_seconds
        self.gap_seconds = 2.0 * window_seconds if gap_seconds is None else gap_seconds
        self._last: Snapshot | None = None
        self._models: dict[str, ModelWindow] = {}
        self.gaps = 0  # steps longer than gap_seconds, not used (see the module doc)
        # model → (t, signals) before the skipped scrapes, and how many were skipped in a row
        self._held: dict[str, tuple[float, ModelSignals, int]] = {}
        self.skipped = 0  # scrapes of a model skipped as glitched (push)
        self.restarts = 0  # steps of a model across an engine restart (push)
        self.foreign = 0  # steps of a model between two processes' counters (push)
        self._processes: dict[str, dict[float, None]] = {}  # model → the latest KNOWN_PROCESSES processes seen
        # model → (t of its last glitch step taken, what its values fell by then and their values: _deficits),
        # each value until it rose back (DEFICIT_WINDOWS)
        self._deficit: dict[str, tuple[float, dict[tuple[str, str], tuple[float, float]]]] = {}

    @property
    def last(self) -> Snapshot | None:
        return self._last

    @property
    def unusual_steps(self) -> tuple[int, int, int]:
        """(restarts, skipped glitched scrapes, steps between two processes) counted so far."""
        return self.restarts, self.skipped, self.foreign

    def push(self, snap: Snapshot) -> dict[str, Delta]:
        """Add one snapshot; returns model → the new step's :class:`Delta` (models with no step:
        the first snapshot, a gap, a model new in this one, a glitched scrape skipped).

        Raises:
            ValueError: ``snap`` is not newer than the last snapshot (nothing changes).
        """
        prev = self._last
        if prev is not None and snap.timestamp <= prev.timestamp:
            raise ValueError(f"snapshot at {snap.timestamp:.3f} is not newer than {prev.timestamp:.3f}")
        self._last = snap
        out: dict[str, Delta] = {}
        if prev is None:
            return out
        held, self._held = self._held, {}
        if snap.timestamp - prev.timestamp > self.gap_seconds:
            self.gaps += 1
            self._models.clear()  # no window spans the gap; it starts again from this snapshot
            return out
        for model, cur in snap.models.items():
            t0, before, skipped = held.get(model) or (prev.timestamp, prev.models.get(model), 0)
            if before is None:
                continue
            known = self._processes.setdefault(model, {})
            if not known:
                _remember(known, before)
            d = step_delta(before, cur, t0, snap.timestamp, snap.clock_offset, known)
            if cur.created != before.created:  # (the model's map holds every engine's stamps)
                _remember(known, cur)
            if model in snap.instance_counts:
                d = replace(d, instance_seconds=snap.instance_counts[model] * d.dt)
            w = self._models.get(model)
            if d.glitches and skipped < (GLITCH_HOLD_SCRAPES if _halved(before, cur) else 1):
                # A value went down with _created unchanged: this scrape read low, or the last one
                # high. It is skipped: the next step is taken from before it, so a dip costs
                # nothing; still down then (below half: after GLITCH_HOLD_SCRAPES), that step (no
                # increases) starts afresh. Until a scrape tells, the step ending at the last one is
                # in doubt.
                self._held[model] = (t0, before, skipped + 1)
                self.skipped += 1
                if w is not None and w.steps:
                    w.steps[-1] = replace(w.steps[-1], doubted=1)
                continue
            if model in held and w is not None and w.steps:
                w.steps[-1] = replace(w.steps[-1], doubted=0)  # told: a glitch step follows it, or it stood
            d = self._watch(model, d, before, cur)
            if w is None:
                w = self._models[model] = ModelWindow(self.window_seconds)
            w.push(d)
            self.restarts += d.resets > 0
            self.foreign += d.foreign > 0
            out[model] = d
        for model in list(self._models):
            if model not in snap.models:
                del self._models[model]  # the model disappeared: its window is over
        for model in [m for m in self._processes if m not in snap.models]:
            del self._processes[model]
        for model in [m for m in self._deficit if m not in snap.models]:
            del self._deficit[model]
        return out

    def _watch(self, model: str, d: Delta, before: ModelSignals, cur: ModelSignals) -> Delta:
        """``d``, the step from ``before`` to ``cur``, taken: a glitch step starts watching what each
        value fell by (:func:`_deficits`); a later step in which a watched value rises back by at
        least that has no increases (the scrapes since read low, and it holds what they missed:
        read 0 for 4 scrapes and back, one step counted a lifetime, h 0.38 for 0.9 once the glitch
        step left the window, adversarial test). A value is watched for DEFICIT_WINDOWS publish
        windows, or while it has not grown since; a restart, another process or another engine set
        ends the watch."""
        if d.glitches:
            self._deficit[model] = (d.t1, _deficits(before, cur))
            return d
        if d.resets or d.foreign or d.rescaled:
            self._deficit.pop(model, None)
        if model not in self._deficit:
            return d
        since, deficit = self._deficit.pop(model)
        ends = {(e, n): (now, then) for e, n, now, then in _engine_pairs(before, cur) if (e, n) in deficit}
        watched = d.t1 - since <= DEFICIT_WINDOWS * self.window_seconds
        deficit = {k: v for k, v in deficit.items() if watched or (k in ends and ends[k][1] <= v[1])}
        back = {k for k, (now, then) in ends.items() if k in deficit and now - then >= deficit[k][0]}
        if back:
            d = replace(d, counters={}, histograms={}, engine_steps=(), glitches=1)
            deficit = {k: v for k, v in deficit.items() if k not in back}
        if deficit:
            self._deficit[model] = (since, deficit)
        return d

    def mark_spike(self, model: str, t1: float, spike: bool = True) -> None:
        """Mark ``model``'s step ending at ``t1`` as a spike (:attr:`Delta.spikes`), or clear the
        mark (``spike`` False), while it is in the publish window: the windows over a marked step
        say their counters are off."""
        w = self._models.get(model)
        steps = [] if w is None else w.steps
        for i, d in enumerate(steps):
            if d.t1 == t1:
                steps[i] = replace(d, spikes=int(spike))

    def window(self, model: str, counters: Collection[str] | None = None,
               histograms: Collection[str] | None = None) -> Delta | None:
        """Publish-window delta of ``model`` (of only ``counters`` / ``histograms`` when given; None
        when fewer than two snapshots exist): :meth:`ModelWindow.total`."""
        w = self._models.get(model)
        return None if w is None else w.total(counters, histograms)

    def end(self, model: str) -> float | None:
        """The end [unix s] of ``model``'s latest step, in doubt or not (how fresh its data is); None
        without one."""
        w = self._models.get(model)
        return w.steps[-1].t1 if w is not None and w.steps else None

    def models(self) -> list[str]:
        return sorted(self._models)
