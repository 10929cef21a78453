"""Drives the pipeline for one target: source → parse → analyzer, and keeps scrape health.

The runner is the only stateful glue, and the place where a bad day ends up as a number instead
of a crash or a lie:

* **Never crashes**: a scrape failure, a body that is not exposition, an out-of-order snapshot
  and any exception inside the analysis are counted by reason (``kvhit_scrape_errors_total``),
  logged once per change of reason or of message (its numbers aside; never with the body), and
  change nothing else.
* **Never lies**: ``kvhit_up`` is 0 after a failed attempt; ``kvhit_stale`` is 1 as soon as the
  values shown are not from the latest attempt (it failed, or none succeeded for more than
  interval + timeout); every per-model value is removed once the last good scrape is older than
  two intervals plus the scrape timeout (``kvhit_data_age_seconds`` says how old it is). Nothing frozen looks live.
* **Loses nothing silently**: input quirks the parser handled are counted per kind
  (``kvhit_input_quirks_total``); (model_name, engine) series beyond ``max_series`` are counted
  (``kvhit_untracked_series``) and logged once.
* **Recovers by itself**: while the target is down the delay doubles per failure up to 8
  intervals; the first good scrape resets it.
* **Time**: live snapshots are stamped with a steady clock — the wall clock read at start,
  advanced by the monotonic clock — so a step of the system clock (NTP, VM resume) changes no
  rate, window or staleness. Fleet mode's query ranges end on the same clock (exporter/cli.py):
  a range's increases always span the step their snapshot closes. Replays and tests pass their
  own clock.
"""
from __future__ import annotations

import logging
import math
import re
import threading
import time
from dataclasses import replace
from types import MappingProxyType
from typing import Callable, Mapping

from exporter.analyzer import SPIKE_FACTOR, Analysis, Analyzer
from exporter.collector import Health
from exporter.config import Config, redact_url
from exporter.parse import QUIRKS, ParseError, Parser, Snapshot
from exporter.sources import FRESH_SAMPLE_SECONDS, LiveSource, PrometheusSource, ScrapeError

_DIGITS = re.compile(r"\d+")
log = logging.getLogger("kvhit")
# Logged when a scrape's step was one of these (Windows.unusual_steps, Analyzer.spikes): restart, glitch,
# two processes, a spike;
# each at most once per STEP_NOTE_SECONDS of snapshot time (a load-balanced URL would say it every scrape).
STEP_NOTE_SECONDS = 600.0
_STEP_NOTES = ("the engine restarted (every _created moved, or a counter went down without one): the step counts "
               "its values since",
               "a counter read lower than at the scrape before while some _created stayed: this scrape is skipped, "
               "the next step is taken from the one before it",
               "the counters now come from another process than at the scrape before (_created moved to before it: "
               "one target URL reaching several pods?): the step has no increases",
               f"a token counter rose over {SPIKE_FACTOR:g}x both the next step's rate and its peak (it jumped and "
               "stayed up): that step is kept from the fits and the 24 h rollup")
# a _STEP_NOTES line, the time of the scrape that told it (a jump is told a scrape after it), and
# how many scrapes told the same since the last such line, kept from the log by the rate limit
STEP_NOTE_FORMAT = "%s (told by the scrape at %s UTC)%s"
# the same count when no scrape told it again once the rate limit let it be said
HELD_NOTE_FORMAT = "%d more scrape(s) after the one at %s UTC told: %s"
MAX_BACKOFF_FACTOR = 8  # at most 8 intervals between attempts while the target is down,
# and at most 5 min (never under one interval): at fleet mode's 120-s interval, 8 intervals held
# kvhit_up at 0 for up to 16 min after Prometheus was back (SRE review)
MAX_BACKOFF_SECONDS = 300.0
DEFAULT_MAX_SERIES = 64
# a source's counts (PrometheusSource.counts) → the Snapshot field each sets
_COUNTS = {"engines": "engine_counts", "instances": "instance_counts", "busy": "busy_counts", "active": "active_counts"}


class SteadyClock:
    """Unix time that never steps: the wall clock at construction + monotonic time elapsed since."""

    STEP_SECONDS = 0.01  # a wall-clock step smaller than this is read as none (NTP slews both clocks alike)

    def __init__(self) -> None:
        self._wall0, self._mono0 = time.time(), time.monotonic()
        self._offset = 0.0

    def __call__(self) -> float:
        return self._wall0 + (time.monotonic() - self._mono0)

    def offset(self) -> float:
        """This clock minus the wall clock [s]: 0 until the wall clock steps (NTP, an operator), then
        the step, held until the next: the two clocks, read one after the other, differ by a few
        microseconds each time, and a time published with the offset taken off moved at every render
        (kvhit_last_success_timestamp_seconds: changes() counted 86 in an outage without a success)."""
        now = self() - time.time()
        if abs(now - self._offset) >= self.STEP_SECONDS:
            self._offset = now
        return self._offset


def _utc(t: float) -> str:
    """Unix time ``t`` [s] as a log line's UTC date and time."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


class Runner:
    """One target's pipeline with health and staleness.

    Args:
        config: validated configuration.
        target: label value for ``target`` (the URL — credentials removed — or the trace path).
        clock: returns "now" [unix s] for live snapshot stamps and staleness; default a
            :class:`SteadyClock`; replays pass the trace clock so nothing is stale.
        scope: "fleet" when the snapshots are a fleet's sums (:class:`PrometheusSource`): every
            published series then carries ``scope="fleet"``; "" (pod mode) adds no label.
    """

    def __init__(self, config: Config, target: str, clock: Callable[[], float] | None = None,
                 scope: str = "") -> None:
        self.config = config
        self.analyzer = Analyzer(config)
        self.parser = Parser()  # the hot path: remembers this target's layout
        self.clock = clock if clock is not None else SteadyClock()
        self._lock = threading.Lock()
        # every quirk kind from 0 on, so rate() and increase() see the first one
        self._health = Health(target=redact_url(target), scope=scope, quirks=dict.fromkeys(QUIRKS, 0))
        self._failures = 0
        self._backoff = 0  # consecutive failed attempts that cost the target (all but refused)
        self._costless = False  # the last failed attempt cost the target nothing
        self._last_reason = ""
        self._logged_failure = ""  # the last failure logged: reason and message, digits masked
        self._engine_reason = ""  # the last snapshot's reason (:meth:`_reason`), logged when it changes
        self._read_failed_at: object = ()  # the snapshot stamp whose analysis last failed on a read
        self._tracked: list[str] = []  # models analysed, in the order they were admitted
        self._cap_logged = False
        self._polled: float | None = None  # clock() when a poll last finished (None: never polled)
        self._noted: dict[str, float] = {}  # _STEP_NOTES line, "slow", "lag" or "unchanged" → time it was last logged
        self._slow_told = 0.0  # seconds of the analysis the last "slow" line told
        self._held: dict[str, int] = {}  # _STEP_NOTES line → scrapes that told it, not logged since it was

    # --- input -----------------------------------------------------------------------------

    def ingest_text(self, timestamp: float, text: str | bytes, duration: float | None = None,
                    clock_offset: float = 0.0, asked: float | None = None,
                    counts: Mapping[str, Mapping[str, int]] | None = None, missed: bool = False) -> bool:
        """Parse one exposition and feed it to the analyzer. Returns True on success; never raises.
        ``clock_offset``: ``timestamp`` minus the wall clock then (parse.Snapshot.clock_offset);
        ``counts``: what the source told of each model (model → count): "engines" and "instances"
        summed, "busy" and "active" engines (parse.Snapshot's ``engine_counts``, ``instance_counts``,
        ``busy_counts``, ``active_counts``; fleet mode: PrometheusSource.counts);
        ``asked``: when the scrape was asked for, its health's last success when later than
        ``timestamp`` (fleet mode dates data where it ends, before the query: no stale scrape);
        ``missed``: scrapes are missing since the previous one although none failed here (a
        replayed recording's gap), so the step is no busy time, as after failed scrapes.

        ``bytes`` are decoded as UTF-8 with replacement. A body that is not exposition, a
        timestamp not newer than the last snapshot, or an exception in the analysis counts as an
        error (reason "parse", "out_of_order", "internal") and changes nothing else.
        """
        began = time.monotonic()
        try:
            if isinstance(text, bytes):
                text = text.decode("utf-8", errors="replace")
            snap = self.parser.parse(text, timestamp)
            if clock_offset or counts:
                # counts without a source's (a translated engine's pooled ranks, parse) stay
                snap = replace(snap, clock_offset=clock_offset,
                               **{field: dict(counts.get(kind, {})) for kind, field in _COUNTS.items()} if counts else {})
        except ParseError as exc:
            self.record_failure("parse", str(exc), duration)
            return False
        except Exception as exc:  # a parser bug must not kill the sidecar
            self.record_failure("internal", f"parse failed: {type(exc).__name__}")
            return False
        last = self.analyzer.windows.last
        if last is not None and not timestamp > last.timestamp:
            self.record_failure("out_of_order", f"snapshot at {timestamp:.3f} is not newer than {last.timestamp:.3f}")
            self._count_quirks(snap)
            return False
        snap = self._cap(snap)
        ingested = False
        try:
            # one critical section with the health update: a reader sees a successful scrape's analysis
            # with its last_success (a fit_step that raises leaves the snapshot ingested, counted failed)
            with self._lock:
                seen = self._unusual_steps()
                self.analyzer.ingest(snap, unobserved=self._failures > 0 or missed)
                ingested = True
                self.analyzer.fit_step()
                failed, self._failures, self._backoff, self._costless = self._failures, 0, 0, False
                self._last_reason = self._logged_failure = ""
                took = time.monotonic() - began
                self._health = replace(self._health, up=True, duration=duration, analysis_duration=took,
                                       last_success=timestamp if asked is None else max(timestamp, asked))
        except Exception as exc:
            log.debug("analysis of a snapshot failed", exc_info=True)
            # the type only: an exception's text may quote a label value from the scraped body
            self.record_failure("internal", f"analysis failed: {type(exc).__name__}")
            if ingested:  # the step is in the windows: a restart there is news whatever the fits did
                self._note_steps(seen, timestamp)
            return False
        if failed:
            log.info("scrape ok again after %d failed attempt(s)", failed)
        # at most once per STEP_NOTE_SECONDS, as the step notes, unless it took over twice the last
        # one told: a 1.5-s line hid a 170-s stall after it (adversarial review)
        if (duration is not None and took > self.config.interval  # a live scrape: a replay falls behind nothing
                and (timestamp - self._noted.get("slow", -math.inf) >= STEP_NOTE_SECONDS or took > 2 * self._slow_told)):
            self._noted["slow"], self._slow_told = timestamp, took
            log.warning("analysing a scrape took %.1f s, over the %g-s interval: kvhit falls behind (a body of "
                        "%d characters)", took, self.config.interval, len(text))
        self._note_steps(seen, timestamp)
        reason = self._reason(snap.engine, snap.reason, bool(snap.models))
        if reason != self._engine_reason:  # kvhit_up 1 alone would not say the body is unusable
            self._engine_reason = reason
            if reason:
                log.warning("the target answers but cannot be analysed: %s", reason)
            else:
                log.info("the target's body is analysable (engine %s)", snap.engine)
        self._count_quirks(snap)
        return True

    def _unusual_steps(self) -> tuple[int, ...]:
        """Unusual steps counted so far, one count per _STEP_NOTES entry."""
        return (*self.analyzer.windows.unusual_steps, self.analyzer.spikes)

    def _note_steps(self, seen: tuple[int, ...], timestamp: float) -> None:
        """Log each kind of unusual step (_STEP_NOTES) counted since ``seen``, each at most once per
        STEP_NOTE_SECONDS of snapshot time."""
        # counted per scrape (one line tells all of a scrape's models), each count said once the rate
        # limit allows, by the next scrape that tells it or by none: a second restart within 10 min
        # left no line (breaker), and a count said only with the next such step never (review)
        for before, now, what in zip(seen, self._unusual_steps(), _STEP_NOTES):
            due = timestamp - self._noted.get(what, -math.inf) >= STEP_NOTE_SECONDS
            if now > before and not due:
                self._held[what] = self._held.get(what, 0) + 1
            elif now > before or (due and what in self._held):
                # scrapes' times: a replay logs at the wall clock of the replay, not of the trace
                last = _utc(self._noted.get(what, timestamp))
                self._noted[what] = timestamp
                held = self._held.pop(what, 0)
                if now > before:
                    log.info(STEP_NOTE_FORMAT, what, _utc(timestamp),
                             f"; {held} more scrape(s) after the one at {last} UTC told it too" if held else "")
                else:
                    log.info(HELD_NOTE_FORMAT, held, last, what)

    def poll(self, source: LiveSource | PrometheusSource) -> bool:
        """One live scrape (or fleet query) stamped with :attr:`clock` when its answer began
        (``source.answer_delay`` after the request; fleet mode: where its data ends, before the
        request, while the scrape's health is dated at the request); errors are counted by reason."""
        start = time.monotonic()  # before the stamp: the duration covers all the scrape took after it
        stamp = asked = self.clock()
        # the engine stamps _created on the wall clock, which may have stepped since kvhit started
        offset = self._clock_offset()
        try:
            _, text = source.fetch()
            stamp += source.answer_delay  # when the body was generated (LiveSource)
            if getattr(source, "lag", 0.0) > FRESH_SAMPLE_SECONDS:
                # fleet data ending a minute or more before the time asked for (the first poll after
                # Prometheus was down) is that old: health dated there, not at the poll (it read fresh)
                asked -= source.lag
                if self._due("lag", asked):
                    # a steady lag withdrew every value with nothing logged or counted (fleet breaker)
                    log.warning("fleet mode: the pods' newest samples in Prometheus end %.0f s before the time "
                                "asked for: the analysis is that old (stale past an interval plus the timeout, "
                                "withdrawn past two). Prometheus not scraping them now, or late samples (remote write: "
                                "set prometheus_delay to the lag), or kvhit's clock ahead of Prometheus'",
                                source.lag)
        except ScrapeError as exc:
            if exc.unchanged and not self._failures and self._health.last_success is not None:
                self._unchanged(str(exc), time.monotonic() - start, asked)
            else:
                self.record_failure(exc.reason, str(exc), time.monotonic() - start, costly=exc.costly)
            return False
        except Exception as exc:  # the source raised what it does not classify: kvhit's bug (KvhitAnalysisFailing)
            self.record_failure("internal", f"scrape failed inside kvhit: {type(exc).__name__}", time.monotonic() - start)
            return False
        finally:
            self._polled = self.clock()
        return self.ingest_text(stamp, text, time.monotonic() - start, offset, asked, getattr(source, "counts", None))

    def _unchanged(self, message: str, duration: float, asked: float) -> None:
        """A poll that found the source holding nothing newer (ScrapeError.unchanged) while every
        attempt before it succeeded: a success without a step, up. The analysis shown is of the
        newest data there is, dated where it is, at the last poll that brought some: past interval
        + timeout it reads stale, past two intervals + timeout its values go (fleet mode: a pod
        whose series ended without a staleness marker, its job removed from Prometheus'
        configuration, held every range at its last sample, and a minute-old analysis was
        published with a data age of 1 s, review). Logged at most once per STEP_NOTE_SECONDS."""
        with self._lock:
            self._health = replace(self._health, up=True, duration=duration)
        if self._due("unchanged", asked):
            log.info("nothing new to analyse (not counted as a failure): %s", message)

    def _due(self, what: str, t: float) -> bool:
        """Whether the line ``what`` may be logged at ``t`` [s], at most once per STEP_NOTE_SECONDS
        (then stamped as logged at ``t``)."""
        if t - self._noted.get(what, -math.inf) < STEP_NOTE_SECONDS:
            return False
        self._noted[what] = t
        return True

    def alive(self) -> bool:
        """Liveness (/healthz): False once a poll loop has run but finished no attempt for longer
        than the longest wait between attempts (MAX_BACKOFF_FACTOR intervals) plus the timeout plus
        a minute — the loop is stuck and only a restart helps; True before any poll (replays)."""
        polled = self._polled
        limit = MAX_BACKOFF_FACTOR * self.config.interval + self.config.timeout + 60.0
        return polled is None or self.clock() - polled <= limit

    def record_failure(self, reason: str, message: str, duration: float | None = None, costly: bool = True) -> None:
        """Count a failed attempt (``reason`` is the kvhit_scrape_errors_total label); ``duration``
        [s], when given, is what the failed scrape took (kvhit_scrape_duration_seconds);
        ``costly``: the attempt cost the target something (all but a refused connection and a
        fleet poll waiting for a pod: ScrapeError.costly), so the next one backs off (:meth:`next_delay`)."""
        with self._lock:
            errors = dict(self._health.errors)
            errors[reason] = errors.get(reason, 0) + 1
            h = self._health
            self._health = replace(h, up=False, errors=errors, duration=h.duration if duration is None else duration)
            self._failures += 1
            self._backoff += int(costly)
            self._costless = not costly
            # another message under the same reason (an empty body, then malformed lines) is news;
            # the same one with other counts (5 then 6 lines malformed) is not
            kind = f"{reason}: {_DIGITS.sub('#', message)}"
            changed, self._logged_failure = kind != self._logged_failure, kind
            self._last_reason = reason
        if changed:
            log.warning("scrape failed (%s): %s", reason, message)

    def _count_quirks(self, snap: Snapshot) -> None:
        if not snap.quirks:
            return
        with self._lock:
            quirks = dict(self._health.quirks)
            for kind, n in snap.quirks.items():
                quirks[kind] = quirks.get(kind, 0) + n
            self._health = replace(self._health, quirks=quirks)

    def _cap(self, snap: Snapshot) -> Snapshot:
        """At most ``max_series`` (model_name, engine) series are analysed.

        Models keep their slot in the order they were first seen (a model absent from a scrape
        frees it); new models are admitted by name while there is room; a model whose engines do
        not fit is left out whole (never a partial sum over some of its engines).
        """
        limit = getattr(self.config, "max_series", DEFAULT_MAX_SERIES)
        order = [m for m in self._tracked if m in snap.models]
        order += sorted(m for m in snap.models if m not in self._tracked)
        kept, used, over = [], 0, 0
        for m in order:
            n = max(1, len(snap.models[m].engines))
            if used + n <= limit:
                kept.append(m)
                used += n
            else:
                over += n
        self._tracked = kept
        with self._lock:
            self._health = replace(self._health, untracked_series=over)
        if not over:
            return snap
        if not self._cap_logged:
            self._cap_logged = True
            log.warning("%d (model_name, engine) series over max_series=%d are not analysed "
                        "(kvhit_untracked_series; logged once)", over, limit)
        return replace(snap, models=MappingProxyType({m: snap.models[m] for m in kept}))

    def next_delay(self) -> float:
        """Seconds until the next scrape: the interval after a success, after a first failure (a
        single blip must not hide the values: :meth:`fresh`) and after a refused connection (it
        costs the target nothing, and a restarting vLLM refuses until it listens: its first answer
        is read within an interval; so does a fleet poll waiting for a pod), else doubled per further
        consecutive failure that cost the target, at most MAX_BACKOFF_FACTOR intervals and
        MAX_BACKOFF_SECONDS (one interval when that is longer)."""
        interval = self.config.interval
        if self._costless or not self._backoff:
            return interval
        return min(interval * min(2 ** (self._backoff - 1), MAX_BACKOFF_FACTOR), max(interval, MAX_BACKOFF_SECONDS))

    # --- output ----------------------------------------------------------------------------

    def current(self) -> tuple[Analysis, Health]:
        """(analysis, health) to render now.

        Health carries the age of the last good scrape and ``stale``; per-model values are
        removed when that scrape is older than two intervals plus the timeout (:meth:`fresh`). An
        exception while assembling the analysis is counted ("internal") once per snapshot, however
        many read it, and shows no per-model value; one in a model's analysis only leaves that model
        out (:attr:`Analysis.failed`), counted alike. Neither is a failed scrape (``up`` and the
        backoff stay as they are).
        """
        read_failed = False
        try:
            with self._lock:  # one critical section: the analysis of the snapshot health dates
                analysis, health = self.analyzer.analysis(), self._health
                if analysis.failed:
                    health = self._count_read_failure(analysis.timestamp) or health
        except Exception as exc:
            with self._lock:
                last = self.analyzer.windows.last
                stamp = None if last is None else last.timestamp
                counted = self._count_read_failure(stamp)
                health = counted or self._health
            if counted:
                log.warning("analysis of the snapshot at %s failed: %s", stamp, type(exc).__name__, exc_info=True)
            analysis, read_failed = Analysis(stamp, "unknown", "analysis failed", {}), True
        now = self.clock()
        age = None if health.last_success is None else max(0.0, now - health.last_success)
        stale = age is None or not health.up or age > self.config.interval + self.config.timeout
        if not self.fresh(age):
            # no age: no successful scrape yet, which the engine reason says; else the models are
            # there, their values too old to show (one decimal under 10 s: 1.6 s read "2 s")
            analysis = analysis.without_models(
                "" if age is None or not analysis.models else f"the last successful scrape is {age:.{int(age < 10)}f} s old, more "
                "than two scrape intervals plus the timeout (see kvhit_up and kvhit_scrape_errors_total; in fleet "
                "mode also polls that found nothing newer, and data ending that long before the poll, both logged)")
        if analysis.timestamp is None and self._last_reason:
            analysis = replace(analysis, engine_reason=f"no successful scrape yet (last attempt: {self._last_reason})")
        elif analysis.timestamp is not None and not read_failed:  # kvhit's own failure says so, not the selector
            analysis = replace(analysis, engine_reason=self._reason(analysis.engine, analysis.engine_reason,
                                                                    bool(analysis.models)))
        return analysis, replace(health, age=age, stale=stale, clock_offset=self._clock_offset())

    def _clock_offset(self) -> float:
        """:attr:`clock` minus the wall clock now [s]: 0 but for a SteadyClock after a wall-clock step."""
        return self.clock.offset() if isinstance(self.clock, SteadyClock) else 0.0

    def _count_read_failure(self, stamp: float | None) -> Health | None:
        """Count an "internal" error for the analysis of the snapshot at ``stamp`` the first time
        it is read (the new Health), None when it was counted already. Call with the lock held."""
        if stamp == self._read_failed_at:
            return None
        self._read_failed_at = stamp
        errors = dict(self._health.errors)
        errors["internal"] = errors.get("internal", 0) + 1
        self._health = replace(self._health, errors=errors)
        return self._health

    def _reason(self, engine: str, reason: str, models: bool) -> str:
        """Why the target cannot be analysed, as a snapshot says, except for a fleet query that
        succeeded and returned nothing (then the selector, not an exposition, is at fault) or only
        the pods' info series (their counters are there but none grew yet)."""
        if self._health.scope == "fleet" and not models:
            if engine == "unknown":
                return (f"Prometheus answered but no vLLM series matched the selector {self.config.selector or '{}'} "
                        "(every selected pod down, or check --selector, and that Prometheus scrapes the vLLM pods)")
            if reason:  # its info series alone: the families are there, none grew (fleet mode renders no other)
                return ("Prometheus has the selected pods' vLLM series, but no counter of theirs grew over the poll's "
                        "range: each pod needs a sample at both ends of it (a Prometheus that just started, or pods "
                        "new since the last poll)")
        return reason

    def fresh(self, age: float | None) -> bool:
        """Whether a last successful scrape ``age`` seconds old (None: none yet) is fresh enough to
        publish per-model values from: at most two intervals plus the scrape timeout old, when the
        retry after a single failed attempt has completed at the latest (:meth:`next_delay`): one
        blip never withdraws the series (a Prometheus scrape in that gap would restart every pending
        alert's ``for:``), two consecutive failures do."""
        return age is not None and age <= self.config.max_value_age

    def ready(self) -> bool:
        """A fresh successful scrape exists (what /readyz reports)."""
        return self.fresh(self.current()[1].age)
