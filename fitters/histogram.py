"""Quantiles and threshold shares from cumulative histogram buckets (MODEL.md §2, §5). Pure.

Input everywhere: ``buckets`` = ((le, cumulative count), …) ascending by ``le`` (a bucket delta
over a window, as :class:`exporter.window.HistogramDelta` holds), and ``count`` = Δ``_count``,
the number of observations. Buckets may be partial (a pasted exposition, an edge missing in
one step): every function says what it does when the answer is not in the buckets.

Choices (MODEL.md is silent):
- :func:`quantile` interpolates linearly inside the bucket that holds the rank, like
  Prometheus ``histogram_quantile``: the first bucket starts at 0 (latencies are ≥ 0). A rank
  that falls in the +Inf bucket gives None, where ``histogram_quantile`` answers with the
  highest finite edge: only a lower bound, which read as the quantile hid a P95 of 15 s
  behind vLLM ≤ 0.8.4's last TTFT edge, 10 s (a version audit).
- :func:`share_at_most` does NOT interpolate: it brackets the share of observations ≤ a
  threshold between the cumulative count at the largest edge ≤ threshold (a lower bound) and
  at the smallest edge ≥ threshold (an upper bound). When the threshold is a bucket edge both
  are equal and exact. The SLO pass-rate bounds are built from these brackets, so they stay
  true bounds whatever the bucket layout.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

Buckets = Sequence[tuple[float, float]]
P95 = 0.95  # the quantile kvhit publishes (observed latencies) and sizes max-num-seqs by (seed 003)


def quantile(buckets: Buckets, count: float, q: float) -> float | None:
    """The q-quantile of the observations [unit of ``le``], interpolated inside its bucket.

    Returns None without observations (count ≤ 0), without buckets, or when the rank lies
    above the highest finite edge (in the +Inf bucket, or beyond a partial histogram's last
    edge): the buckets then bound the quantile from below only.
    Raises ValueError unless 0 ≤ q ≤ 1.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q!r}")
    if count <= 0 or not buckets:
        return None
    i = rank_index(buckets, count, q)
    if i is None:
        return None
    le, c = buckets[i]
    prev_le, prev_c = buckets[i - 1] if i else (0.0, 0.0)
    if math.isinf(le):
        return None
    lower = prev_le if prev_le < le else 0.0
    width = c - prev_c
    if width <= 0:
        return le
    return lower + (le - lower) * (q * count - prev_c) / width


def rank_index(buckets: Buckets, count: float, q: float) -> int | None:
    """Index into ``buckets`` of the bucket that holds the q-quantile's rank q·``count`` (the first
    whose cumulative count reaches it, and is > 0), None when none does (a partial histogram)."""
    rank = q * count
    return next((i for i, (_, c) in enumerate(buckets) if c >= rank and c > 0), None)


def share_at_most(buckets: Buckets, count: float, threshold: float) -> tuple[float, float] | None:
    """(lower, upper) bounds of the share of observations ≤ ``threshold`` [1].

    lower = cumulative count at the largest edge ≤ threshold (0 when the threshold is below
    the first edge: observations are ≥ 0, so none is known to be ≤ it) / count;
    upper = cumulative count at the smallest edge ≥ threshold / count (1 when no known edge
    is ≥ threshold: a partial histogram without +Inf). Both are clipped to [0, 1] (a bucket
    delta can exceed Δcount by a scrape race). None without observations or buckets.
    """
    if count <= 0 or not buckets:
        return None
    below = [c for le, c in buckets if le <= threshold]
    above = [c for le, c in buckets if le >= threshold]
    lower = below[-1] / count if below else 0.0
    upper = above[0] / count if above else 1.0
    lower, upper = min(max(lower, 0.0), 1.0), min(max(upper, 0.0), 1.0)
    return min(lower, upper), upper
