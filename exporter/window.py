"""Steps and publish windows (MODEL.md §1): counter increases between snapshots.

A *step* is the interval between two consecutive snapshots; its :class:`Delta` holds the
increase of every counter and histogram series of one model. A counter that went down
(engine restart), or whose ``_created`` timestamp changed, restarted from zero: its increase is
its current value, as in Prometheus ``increase()``. The *publish window* sums the steps from the
newest snapshot at least ``window_seconds`` older than the latest one to the latest one; before
that much history exists it covers the span there is (≥ 2 snapshots).

Memory is bounded: only the steps inside the current publish window are kept.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Mapping

from exporter.parse import Histogram, ModelSignals, Snapshot


@dataclass(frozen=True)
class HistogramDelta:
    """Increase of one histogram: Δsum, Δcount and per-bucket Δcumulative counts."""

    sum: float
    count: float
    buckets: tuple[tuple[float, float], ...] = ()

    @property
    def mean(self) -> float | None:
        """Δsum/Δcount, the mean of the observations in the interval (None when none)."""
        if self.count <= 0 or not math.isfinite(self.sum):
            return None
        return self.sum / self.count

    def fraction_at_most(self, threshold: float) -> float | None:
        """Share of observations ≤ ``threshold`` from bucket deltas (None without a bucket edge
        at or below the threshold or without observations). Takes the largest edge ≤ threshold,
        so the share is a lower bound when the threshold falls between edges."""
        if self.count <= 0:
            return None
        below = [c for le, c in self.buckets if le <= threshold]
        return None if not below else below[-1] / self.count


@dataclass(frozen=True)
class Delta:
    """Increase of one model's signals over an interval [t0, t1].

    Attributes:
        t0, t1: bounds [unix s]; ``dt`` = t1 - t0.
        counters: canonical counter → increase (only counters present at both ends).
        histograms: canonical histogram → :class:`HistogramDelta`.
        start, end: gauges at the two ends (:attr:`ModelSignals.gauges`).
        resets: number of steps inside the interval in which the model's counters reset.
        steps: number of scrape-to-scrape steps summed.
    """

    t0: float
    t1: float
    counters: Mapping[str, float]
    histograms: Mapping[str, HistogramDelta]
    start: Mapping[str, float]
    end: Mapping[str, float]
    resets: int = 0
    steps: int = 1

    @property
    def dt(self) -> float:
        return self.t1 - self.t0


def _restarted(prev: ModelSignals, cur: ModelSignals) -> bool:
    """The engine restarted: a ``_created`` timestamp changed or any counter went down."""
    for name, b in cur.created.items():
        a = prev.created.get(name)
        if a is not None and b != a:
            return True
    if any(v < prev.counters[n] for n, v in cur.counters.items() if n in prev.counters):
        return True
    return any(h.count < prev.histograms[n].count for n, h in cur.histograms.items() if n in prev.histograms)


def step_delta(prev: ModelSignals, cur: ModelSignals, t0: float, t1: float) -> Delta:
    """The :class:`Delta` of one model between two consecutive snapshots (MODEL.md §1).

    A counter or histogram present in only one of the two is absent from the delta (unknown).
    A restart detected on any series of the model (value down, or ``_created`` changed) is
    applied to the whole model, so that ratios of its counters stay consistent: every increase
    is then the current value, as Prometheus ``increase()`` counts a reset.
    """
    restarted = _restarted(prev, cur)
    counters = {n: (v if restarted else v - prev.counters[n]) for n, v in cur.counters.items() if n in prev.counters}
    hists = {n: _hist_increase(prev.histograms[n], h, restarted)
             for n, h in cur.histograms.items() if n in prev.histograms}
    return Delta(t0, t1, counters, hists, prev.gauges, cur.gauges, resets=int(restarted))


def _hist_increase(p: Histogram, h: Histogram, reset: bool) -> HistogramDelta:
    if reset:
        return HistogramDelta(h.sum, h.count, h.buckets)
    prev = dict(p.buckets)
    buckets = tuple((le, max(0.0, c - prev[le])) for le, c in h.buckets if le in prev)
    return HistogramDelta(h.sum - p.sum, h.count - p.count, buckets)


def add_deltas(deltas: list[Delta]) -> Delta:
    """Sum consecutive step deltas into one interval delta (first.t0 .. last.t1).

    Only signals present in every step are summed; one missing step makes the total unknown.
    """
    first, last = deltas[0], deltas[-1]
    names = set(first.counters).intersection(*(d.counters for d in deltas[1:]))
    counters = {n: math.fsum(d.counters[n] for d in deltas) for n in names}
    hnames = set(first.histograms).intersection(*(d.histograms for d in deltas[1:]))
    hists = {}
    for n in hnames:
        parts = [d.histograms[n] for d in deltas]
        edges = set(le for le, _ in parts[0].buckets).intersection(*({le for le, _ in p.buckets} for p in parts[1:]))
        buckets = tuple((le, math.fsum(dict(p.buckets)[le] for p in parts)) for le in sorted(edges))
        hists[n] = HistogramDelta(math.fsum(p.sum for p in parts), math.fsum(p.count for p in parts), buckets)
    return Delta(first.t0, last.t1, counters, hists, first.start, last.end,
                 resets=sum(d.resets for d in deltas), steps=len(deltas))


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

    def total(self) -> Delta | None:
        """The publish-window delta, or None before two snapshots exist."""
        if not self.steps:
            return None
        return add_deltas(list(self.steps))


class Windows:
    """Turns a stream of snapshots into per-model step deltas and publish windows.

    ``push`` returns the new step deltas (model → Delta). A snapshot not newer than the last
    one (clock step back, duplicate replay file) is rejected with ValueError and changes nothing.
    """

    def __init__(self, window_seconds: float) -> None:
        if window_seconds <= 0:
            raise ValueError("window_seconds must be > 0")
        self.window_seconds = window_seconds
        self._last: Snapshot | None = None
        self._models: dict[str, ModelWindow] = {}

    @property
    def last(self) -> Snapshot | None:
        return self._last

    def push(self, snap: Snapshot) -> dict[str, Delta]:
        prev = self._last
        if prev is not None and snap.timestamp <= prev.timestamp:
            raise ValueError(f"snapshot at {snap.timestamp:.3f} is not newer than {prev.timestamp:.3f}")
        self._last = snap
        out: dict[str, Delta] = {}
        if prev is None:
            return out
        for model, cur in snap.models.items():
            before = prev.models.get(model)
            if before is None:
                continue
            d = step_delta(before, cur, prev.timestamp, snap.timestamp)
            self._models.setdefault(model, ModelWindow(self.window_seconds)).push(d)
            out[model] = d
        for model in list(self._models):
            if model not in snap.models:
                del self._models[model]  # the model disappeared: its window is over
        return out

    def window(self, model: str) -> Delta | None:
        """Publish-window delta of ``model`` (None when fewer than two snapshots exist)."""
        w = self._models.get(model)
        return None if w is None else w.total()

    def models(self) -> list[str]:
        return sorted(self._models)
