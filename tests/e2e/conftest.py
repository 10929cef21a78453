"""Prints the live-vLLM scenario's summary (durations, calibration table, leave-one-phase-out
errors) at the end of the pytest run, so CI logs show the measured numbers of every run."""
from __future__ import annotations

import sys


def pytest_terminal_summary(terminalreporter) -> None:
    mod = sys.modules.get("test_live_vllm")
    lines = getattr(mod, "SUMMARY", None)
    if lines:
        terminalreporter.section("kvhit on a live vLLM")
        for line in lines:
            terminalreporter.write_line(line)
