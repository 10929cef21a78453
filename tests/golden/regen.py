"""Regenerate the golden exposition ``tests/golden/replay_sweep_ab.prom``.

Usage (from anywhere)::

    python tests/golden/regen.py

It runs, from the repository root and with every ``KVHIT_*`` variable removed from the
environment (defaults only)::

    kvhit replay exporter/data/vllm-cpu-0.32-sweep-ab.tar.gz --quiet \
        --metrics-out tests/golden/replay_sweep_ab.prom

so the ``target`` label is the relative trace path. Regenerate when kvhit's output changes on
purpose, and review the text diff (``git diff tests/golden/``) before committing it:
tests/test_golden.py checks that the live replay has this file's series (names and labels; its
values are kvhit's own output, asserted nowhere).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TRACE = "exporter/data/vllm-cpu-0.32-sweep-ab.tar.gz"
GOLDEN = "tests/golden/replay_sweep_ab.prom"


def main() -> int:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVHIT_")}
    cmd = [sys.executable, "-m", "exporter.cli", "replay", TRACE, "--quiet", "--metrics-out", GOLDEN]
    done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    if done.returncode == 0:
        print(f"wrote {ROOT / GOLDEN}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
