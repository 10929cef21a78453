"""Test-session policy: a skipped test counts as a missing test, so skips fail the run; a test
that installs signal handlers (a command run in-process, exporter.config.stop_event) leaves none
behind."""
from __future__ import annotations

import signal

import pytest

_skipped: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped:
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter) -> None:
    if _skipped:
        terminalreporter.write_line(f"FAILED: {len(_skipped)} skipped test(s) count as missing: {', '.join(_skipped)}",
                                    red=True)


@pytest.fixture(autouse=True)
def _signal_handlers():
    """Restore SIGINT, SIGTERM and SIGHUP after each test: stop_event's handler left by `kvhit
    simulate` run in-process turned a later test's Ctrl-C into a set event (test_calibrate's
    Ctrl-C test failed after test_simulate, by file order alone)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for sig, handler in saved.items():
        if handler is not None and signal.getsignal(sig) is not handler:  # None: not set from Python
            signal.signal(sig, handler)
