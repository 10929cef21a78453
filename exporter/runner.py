"""Drives the pipeline for one target: source → parse → analyzer, and keeps scrape health.

The runner is the only stateful glue: it records whether the last scrape worked, counts errors
by reason, backs off while the target is down, and hides every per-model value once the last
good snapshot is older than two scrape intervals — a frozen number must never look live.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from exporter.analyzer import Analysis, Analyzer
from exporter.collector import Health
from exporter.config import Config
from exporter.parse import ParseError, parse_exposition
from exporter.sources import LiveSource, ScrapeError

log = logging.getLogger("kvhit")
MAX_BACKOFF_FACTOR = 8  # at most 8 intervals between attempts while the target is down


class Runner:
    """One target's pipeline with health and staleness.

    Args:
        config: validated configuration.
        target: label value for ``target`` (the URL, or the trace path for replays).
        clock: returns "now" [unix s]; replays pass the trace clock so nothing is stale.
    """

    def __init__(self, config: Config, target: str, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.analyzer = Analyzer(config)
        self.clock = clock
        self._lock = threading.Lock()
        self._health = Health(target=target)
        self._failures = 0
        self._last_reason = ""

    # --- input -----------------------------------------------------------------------------

    def ingest_text(self, timestamp: float, text: str, duration: float | None = None) -> bool:
        """Parse one exposition and feed it to the analyzer. Returns True on success.

        A parse failure or an out-of-order timestamp counts as an error (reason "parse" /
        "out_of_order") and changes nothing else.
        """
        try:
            snap = parse_exposition(text, timestamp)
            with self._lock:
                self.analyzer.ingest(snap)
        except ParseError as exc:
            self._fail("parse", str(exc))
            return False
        except ValueError as exc:
            self._fail("out_of_order", str(exc))
            return False
        with self._lock:
            self._failures = 0
            self._last_reason = ""
            self._health = Health(self._health.target, True, duration, timestamp, self._health.errors)
        return True

    def poll(self, source: LiveSource) -> bool:
        """One live scrape; errors are counted by reason and logged once per change of reason."""
        start = time.monotonic()
        try:
            timestamp, text = source.fetch()
        except ScrapeError as exc:
            self._fail(exc.reason, str(exc))
            return False
        return self.ingest_text(timestamp, text, time.monotonic() - start)

    def _fail(self, reason: str, message: str) -> None:
        with self._lock:
            errors = dict(self._health.errors)
            errors[reason] = errors.get(reason, 0) + 1
            h = self._health
            self._health = Health(h.target, False, h.duration, h.last_success, errors)
            self._failures += 1
            changed = reason != self._last_reason
            self._last_reason = reason
        if changed:
            log.warning("scrape failed (%s): %s", reason, message)

    def next_delay(self) -> float:
        """Seconds until the next scrape: the interval, doubled per consecutive failure (capped)."""
        factor = min(2 ** self._failures, MAX_BACKOFF_FACTOR) if self._failures else 1
        return self.config.interval * factor

    # --- output ----------------------------------------------------------------------------

    def current(self) -> tuple[Analysis, Health]:
        """(analysis, health) to render now; per-model values removed when stale (> 2 intervals)."""
        with self._lock:
            analysis = self.analyzer.analysis()
            health = self._health
        if health.last_success is None or self.clock() - health.last_success > 2 * self.config.interval:
            analysis = analysis.without_models()
        return analysis, health

    def ready(self) -> bool:
        """A fresh successful scrape exists (what /readyz reports)."""
        _, health = self.current()
        return health.last_success is not None and self.clock() - health.last_success <= 2 * self.config.interval
