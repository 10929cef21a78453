"""When prefix caching pays: prefill share, speedup and the seed-003 verdict (MODEL.md §5). 

    prefill_share = P̄ / (P̄ + D̄)            speedup ≈ 1 / (1 − h · prefill_share)

Verdict states (seed 003 §2 and "落地建议" 2), first match wins:

=========================  ==================================================================
state                      rule
=========================  ==================================================================
thrash_risk                recent h > 0.85 and the per-minute h jitters (population σ ≥ 0.05
                           over the last 15 minutes) while KV usage nears full (max ≥ 0.90)
not_paying                 h < 0.25 over the history (24 h once that much exists)
dedicated_pool_worth_it    h > 0.60 and prefill share > 0.40 over the history
diminishing_returns        h > 0.85 over the history (the remaining suffix must be computed)
linear                     otherwise: throughput gain ≈ h × prefill share
=========================  ==================================================================

Choices where MODEL.md is silent: the 24-hour history is a per-minute rollup (bounded); until
24 hours are covered the verdict is *provisional* (label ``provisional="true"``) but still
given on the history there is. "Recent" is the last 15 minutes. The first rule is decided in
three values: while none of its terms is known to fail but one is unknown — the recent h (hits
unknown at some recent step with queries), the jitter (fewer than 3 recent minutes with
queries), the KV usage gauge (never read, or missing at some step, so its max is a lower bound)
— the verdict is unknown, never a later rule's.
``diminishing_returns`` is the seed's > 85 % zone when no other state applies (the issue's list
has four states; h = 0.95 with a small prefill share is not "linear").
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .model import caching_speedup, hits_exceed, prefill_share

STATES = ("not_paying", "linear", "dedicated_pool_worth_it", "diminishing_returns", "thrash_risk")
NOT_PAYING_H = 0.25
DEDICATED_H = 0.60
DEDICATED_SHARE = 0.40
THRASH_H = 0.85
THRASH_JITTER = 0.05
THRASH_KV_USAGE = 0.90
RECENT_MINUTES = 15
JITTER_MIN_MINUTES = 3  # minutes with queries before the per-minute h has a jitter
HISTORY_SECONDS = 24 * 3600.0
TORN_STEPS = 4  # steps a torn read's group takes after it while it exceeds, and before it (HitRollup)


@dataclass
class _Minute:
    minute: int
    first_t0: float
    queries: float = 0.0
    hits: float = 0.0
    prefill_sum: float = 0.0
    prefill_count: float = 0.0
    decode_sum: float = 0.0
    decode_count: float = 0.0
    kv_usage_max: float | None = None
    kv_usage_missing: bool = False  # a step ending in this minute had no usable KV usage
    hits_missing: bool = False  # a step ending in this minute had queries (or unknown ones) but unknown hits


@dataclass
class _Step:
    minute: _Minute  # where its increases went
    t1: float
    queried: float
    hits: float
    steps: int  # 1, or a group's


@dataclass
class _Group:
    """A torn read's steps (HitRollup): their minutes, end [s], summed increases, and the steps
    after it still to come before it may close."""
    minutes: list[_Minute] = field(default_factory=list)
    t1: float = math.nan
    queried: float = 0.0
    hits: float = 0.0
    waiting: int = 0

    def add(self, minute: _Minute, t1: float, queried: float, hits: float) -> None:
        self.minutes.append(minute)
        self.t1, self.queried, self.hits = t1, self.queried + queried, self.hits + hits

    def exceeds(self) -> bool:
        return hits_exceed(self.queried, self.hits)


class HitRollup:
    """Per-minute sums of Δqueries, Δhits (device + loaded), prefill/decode time sums and counts,
    and the max KV usage, over at most ``minutes`` minutes (default 1440 = 24 h).

    Memory bound: a ``deque(maxlen=minutes)``; minutes older than the newest minute − ``minutes``
    are also dropped when traffic had gaps. A step is attributed to the minute of its end.

    A step whose hits exceed its queries (a scrape read one counter lower than it was: a torn
    read) has the difference in a neighbour: the step after it when its end scrape read queries
    low, the step before it when its start read hits low (or further on when the read stayed low
    for scrapes). Its group is it and the step after it (and after each further step that exceeds,
    up to 2 × TORN_STEPS steps), and more steps after while the group exceeds, up to TORN_STEPS in
    all; then the step before it, taken back out of its minute, and more before while the group
    exceeds, up to TORN_STEPS steps taken back. A group within goes to the minute of its end: the
    counters' increase over all of it (left out alone, its neighbour's error went in, always the
    same way: a breaker's torn read in five scrapes took the 24 h h from 0.773 to 0.693). One that
    still exceeds (a hit counter that jumped and stayed), or that a step not starting at its end or
    with unknown hits breaks, is left out, its minutes partial (:meth:`hits_partial`). The price: a
    jump less than the misses of the steps grouped with it is taken.
    """

    def __init__(self, minutes: int = 1440, bucket_seconds: float = 60.0) -> None:
        if minutes < 1 or bucket_seconds <= 0:
            raise ValueError("need minutes >= 1 and bucket_seconds > 0")
        self.minutes = minutes
        self.bucket_seconds = bucket_seconds
        self._buf: deque[_Minute] = deque(maxlen=minutes)
        self._t: float | None = None
        # steps (or groups) added, the latest last: a torn read's group takes them back
        self._added: deque[_Step] = deque(maxlen=TORN_STEPS)
        self._open: _Group | None = None  # a torn read's group waiting for the step after it

    def __len__(self) -> int:
        return len(self._buf)

    def update(self, t0: float, t1: float, queried: float | None, hits: float | None,
               prefill: tuple[float, float] | None = None, decode: tuple[float, float] | None = None,
               kv_usage: float | None = None) -> None:
        """Add one step [t0, t1]: Δqueried and Δhits tokens (None = unknown, not added; hits above
        queries: grouped with its neighbours, class docstring), prefill / decode = (Δsum [s], Δcount)
        of the request time histograms, KV usage [0–1] at the step's end (outside [0, 1]: left out)."""
        minute = int(math.floor(t1 / self.bucket_seconds))
        if self._buf and minute < self._buf[-1].minute or self._t is not None and t1 <= self._t:
            return  # out of order: the rollup only moves forward
        if not self._buf or self._buf[-1].minute != minute:
            self._buf.append(_Minute(minute, t0))
        m = self._buf[-1]
        self._hits(m, t0, t1, queried, hits)
        if prefill is not None and decode is not None and all(map(math.isfinite, (*prefill, *decode))):
            m.prefill_sum += prefill[0]
            m.prefill_count += prefill[1]
            m.decode_sum += decode[0]
            m.decode_count += decode[1]
        # a fraction: outside [0, 1] (a percent scale, an engine bug; NaN) is no usage, never a thrash verdict
        if kv_usage is not None and 0.0 <= kv_usage <= 1.0:
            m.kv_usage_max = kv_usage if m.kv_usage_max is None else max(m.kv_usage_max, kv_usage)
        else:
            m.kv_usage_missing = True
        self._t = t1
        while self._buf and self._buf[0].minute <= minute - self.minutes:
            self._buf.popleft()

    def _hits(self, m: _Minute, t0: float, t1: float, queried: float | None, hits: float | None) -> None:
        """:meth:`update`'s Δqueried and Δhits of a step into minute ``m`` (torn reads: class docstring)."""
        g, added = self._open, self._added
        if (g.t1 if g is not None else added[-1].t1 if added else t0) != t0:  # a step lost in between
            self._drop()
            g = None
        if queried is None or hits is None or not (0 <= queried < math.inf and 0 <= hits < math.inf):
            self._drop()
            if queried is None or queried > 0:
                m.hits_missing = True
            return
        exceeds = hits_exceed(queried, hits)
        if g is None and not exceeds:
            m.queries += queried
            m.hits += hits
            added.append(_Step(m, t1, queried, hits, 1))
            return
        if g is None:
            g = self._open = _Group()
        g.add(m, t1, queried, hits)
        # the step after each that exceeds, and more while the group exceeds, up to TORN_STEPS in all
        g.waiting = 1 if exceeds or (g.exceeds() and len(g.minutes) < TORN_STEPS) else g.waiting - 1
        if g.waiting:
            if len(g.minutes) >= 2 * TORN_STEPS:  # exceeding step after step: no torn read
                self._drop()
            return
        self._open = None
        # the step before it too, within or not: a read of hits low put its difference there, and
        # left in its minute that minute's h and the group's were off as much (a false thrash
        # verdict's jitter, review); more while the group exceeds, up to TORN_STEPS steps
        taken = 0
        while (g.exceeds() or not taken) and added and taken < TORN_STEPS:
            before = added.pop()
            taken += before.steps
            x = before.minute
            x.queries, x.hits = x.queries - before.queried, max(x.hits - before.hits, 0.0)
            if x.queries <= 1e-9 * before.queried:  # all of it taken back: no rounding residue as an h
                x.queries = x.hits = 0.0
            g.add(x, g.t1, before.queried, before.hits)
        if g.exceeds():
            for x in g.minutes:
                x.hits_missing = True
            added.clear()
            return
        m.queries += g.queried
        m.hits += g.hits
        added.clear()
        added.append(_Step(m, t1, g.queried, g.hits, len(g.minutes)))

    def _drop(self) -> None:
        """An open group that no step after it can complete is left out; steps before a gap are
        taken back no more."""
        if self._open is not None:
            for x in self._open.minutes:
                x.hits_missing = True
        self._open = None
        self._added.clear()

    def _recent(self, minutes: int | None) -> list[_Minute]:
        if not self._buf:
            return []
        if minutes is None:
            return list(self._buf)
        last = self._buf[-1].minute
        return [m for m in self._buf if m.minute > last - minutes]

    def span_seconds(self) -> float:
        """Time the rollup covers [s] (0 when empty)."""
        if not self._buf or self._t is None:
            return 0.0
        return self._t - self._buf[0].first_t0

    def provisional(self) -> bool:
        """True until the rollup covers 24 h (less one bucket of slack)."""
        return self.span_seconds() < min(HISTORY_SECONDS, self.minutes * self.bucket_seconds) - self.bucket_seconds

    def hit_ratio(self, minutes: int | None = None) -> float | None:
        """Σhits / Σqueries over the last ``minutes`` (default all) [1]; None without queries."""
        ms = self._recent(minutes)
        q = math.fsum(m.queries for m in ms)
        return math.fsum(m.hits for m in ms) / q if q > 0 else None

    def prefill_share(self, minutes: int | None = None) -> float | None:
        """P̄/(P̄+D̄) from the summed request prefill / decode times [1]; None without requests."""
        ms = self._recent(minutes)
        pc, dc = math.fsum(m.prefill_count for m in ms), math.fsum(m.decode_count for m in ms)
        if pc <= 0 or dc <= 0:
            return None
        p, d = math.fsum(m.prefill_sum for m in ms) / pc, math.fsum(m.decode_sum for m in ms) / dc
        return prefill_share(p, d) if p + d > 0 else None

    def jitter(self, minutes: int = RECENT_MINUTES, min_minutes: int = JITTER_MIN_MINUTES) -> float | None:
        """Population σ of the per-minute h over the last ``minutes`` [1]; None with fewer than
        ``min_minutes`` minutes that had queries."""
        hs = [m.hits / m.queries for m in self._recent(minutes) if m.queries > 0]
        if len(hs) < min_minutes:
            return None
        mean = math.fsum(hs) / len(hs)
        return math.sqrt(math.fsum((h - mean) ** 2 for h in hs) / len(hs))

    def kv_usage_max(self, minutes: int = RECENT_MINUTES) -> float | None:
        """Max KV usage over the last ``minutes`` [0–1]; None when never known."""
        vals = [m.kv_usage_max for m in self._recent(minutes) if m.kv_usage_max is not None]
        return max(vals) if vals else None

    def kv_usage_partial(self, minutes: int = RECENT_MINUTES) -> bool:
        """True when a step of the last ``minutes`` had no usable KV usage (its max is a lower bound)."""
        return any(m.kv_usage_missing for m in self._recent(minutes))

    def hits_partial(self, minutes: int = RECENT_MINUTES) -> bool:
        """True when a step of the last ``minutes`` had queries whose hits are unknown (left out of
        :meth:`hit_ratio` and :meth:`jitter`, so theirs are of the other steps only)."""
        recent = self._recent(minutes)
        held = self._open.minutes if self._open is not None else []
        return any(m.hits_missing or any(m is x for x in held) for m in recent)


@dataclass(frozen=True)
class CachingVerdict:
    """The verdict and what it was decided on (every value None when unknown).

    Attributes:
        state: one of :data:`STATES`, or None when undecidable (``reason`` says why).
        provisional: the history covers less than 24 h.
        history_seconds: span of the history [s]; history_hit_ratio, history_prefill_share [1].
        recent_hit_ratio, jitter [1]; kv_usage_max [0–1] over the last 15 minutes.
    """

    state: str | None
    reason: str
    provisional: bool
    history_seconds: float
    history_hit_ratio: float | None
    history_prefill_share: float | None
    recent_hit_ratio: float | None
    jitter: float | None
    kv_usage_max: float | None


def _thrash(h_recent: float | None, jitter: float | None, kv_usage_max: float | None,
            kv_usage_partial: bool, hits_partial: bool = False) -> tuple[bool | None, str]:
    """The first rule in three values: False when one of its terms is known to fail (no recent
    query is no thrash), True when all hold, else None with the unknown terms named."""
    # with hits unknown at some recent step, h and its jitter are of the other steps only
    recent_high = None if hits_partial else h_recent is not None and h_recent > THRASH_H
    jitters = None if jitter is None or hits_partial else jitter >= THRASH_JITTER
    full = kv_usage_max is not None and kv_usage_max >= THRASH_KV_USAGE
    near_full = True if full else (None if kv_usage_max is None or kv_usage_partial else False)
    if False in (recent_high, jitters, near_full):
        return False, ""
    if recent_high and jitters and near_full:
        return True, ""
    unknown = [what for what, term in (
        ("the recent hit ratio (hits unknown at some recent steps)", recent_high),
        (f"the per-minute h jitter (fewer than {JITTER_MIN_MINUTES} recent minutes with queries, or hits unknown "
         "at some)", jitters),
        ("the KV cache usage (no usable kv_cache_usage_perc" + (" at some steps)" if kv_usage_max is not None
                                                                 else ")"), near_full)) if term is None]
    high = "" if recent_high is None else "recent h > 0.85, but "
    return None, f"{high}{' and '.join(unknown)} unknown: thrash can neither be asserted nor ruled out"


def decide(h_history: float | None, share_history: float | None, h_recent: float | None,
           jitter: float | None, kv_usage_max: float | None, kv_usage_partial: bool = False,
           hits_partial: bool = False, history_hits_partial: bool = False) -> tuple[str | None, str]:
    """(state, reason) by the rules in the module docstring. Pure. The first rule undecided (a
    term unknown: the recent h with hits unknown at some recent step, ``hits_partial``; the
    jitter with fewer than JITTER_MIN_MINUTES minutes of queries; the KV usage never read or,
    ``kv_usage_partial``, missing at some step so its max is a lower bound) leaves the verdict
    unknown: no later rule may answer. ``history_hits_partial``: hits unknown at some step of the
    history (its reason when the history's h is unknown)."""
    thrash, why = _thrash(h_recent, jitter, kv_usage_max, kv_usage_partial, hits_partial)
    if thrash is None:
        return None, why
    if thrash:
        return "thrash_risk", ""
    if h_history is None:
        if history_hits_partial:  # steps with queries whose hits are unknown
            return None, ("no prefix-cache query with known hits in the history (token hit ratio unknown; at some "
                          "steps the hits, device or loaded, are unknown: kvhit_unknown_info says why)")
        return None, "no prefix-cache queries in the history (token hit ratio unknown)"
    if h_history < NOT_PAYING_H:
        return "not_paying", ""
    if h_history > DEDICATED_H:
        if share_history is None:
            return None, ("h > 0.60 but the prefill share is unknown (no request_prefill/decode_time "
                          "histograms): cannot tell whether a dedicated pool pays")
        if share_history > DEDICATED_SHARE:
            return "dedicated_pool_worth_it", ""
    if h_history > THRASH_H:
        return "diminishing_returns", ""
    return "linear", ""


def verdict(rollup: HitRollup) -> CachingVerdict:
    """The current :class:`CachingVerdict` from a rollup (MODEL.md §5)."""
    h_hist, share = rollup.hit_ratio(), rollup.prefill_share()
    h_recent, jit, kv = rollup.hit_ratio(RECENT_MINUTES), rollup.jitter(), rollup.kv_usage_max()
    # the whole history scanned only when its h is unknown
    state, reason = decide(h_hist, share, h_recent, jit, kv, rollup.kv_usage_partial(), rollup.hits_partial(),
                           h_hist is None and rollup.hits_partial(None))
    if not len(rollup):  # an empty history is no history of zero queries
        reason = "no step in the history yet (a step enters it when the scrape after it confirms it)"
    return CachingVerdict(state, reason, rollup.provisional(), rollup.span_seconds(), h_hist, share,
                          h_recent, jit, kv)


def speedup(h: float | None, share: float | None) -> float | None:
    """1/(1 − h·share) (MODEL.md §5) or None when an input is unknown or h·share ≥ 1."""
    if h is None or share is None or h * share >= 1.0:
        return None
    return caching_speedup(h, share)
