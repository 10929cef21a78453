"""Measure the kvhit sidecar's memory and CPU against a replayed vLLM (sizes its resources).

    python deploy/measure_sidecar.py                       # real time: 5 s scrapes for 300 s
    python deploy/measure_sidecar.py --speedup 10 --seconds 400   # fill the fit buffers faster

A fake vLLM on 127.0.0.1 serves the bundled recording of a real vLLM 0.32 server
(exporter/data/vllm-cpu-0.32-sweep-ab.tar.gz, 372 snapshots) one snapshot per scrape, looping with
every counter and histogram carried on so it stays monotonic (one idle step at each wrap).
``kvhit run`` runs with the example's configuration
(deploy/kustomize/examples/vllm-with-kvhit/kvhit-config/config.yaml) while a client plays
Prometheus (GET /metrics every 15 s) and the kubelet (/readyz every 10 s, /healthz every 20 s).
The kvhit process is sampled from /proc every second: VmRSS, VmHWM (peak RSS) and utime+stime.

``--speedup N`` divides the scrape interval, the publish window and the client periods by N, so
the fitters' ring buffers (720 busy steps) fill N times sooner; the CPU per scrape cycle it reports
is then what a 5 s interval pays per scrape with full buffers. The last line is JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from exporter.simulate import send_exposition  # noqa: E402
TRACE = ROOT / "exporter" / "data" / "vllm-cpu-0.32-sweep-ab.tar.gz"
CONFIG = ROOT / "deploy" / "kustomize" / "examples" / "vllm-with-kvhit" / "kvhit-config" / "config.yaml"
_SAMPLE = re.compile(r"^(?P<series>[^\s{#]+(?:\{.*\})?)\s+(?P<value>\S+)(?P<rest>(?:\s+\S+)?)$")
_TYPE = re.compile(r"^# TYPE (\S+) (counter|histogram)\s*$")


def trace_texts(path: Path = TRACE) -> list[str]:
    """The trace's expositions in time order."""
    files = {}
    with tarfile.open(path, "r:gz") as tar:
        for m in tar:
            if m.isfile() and m.name.endswith(".prom"):
                files[int(Path(m.name).stem)] = tar.extractfile(m).read().decode()
    return [files[k] for k in sorted(files)]


class LoopingTrace:
    """Serves snapshot i of the trace at request i; after the last one it starts again with every
    counter and histogram sample raised by its increase over the whole trace, so counters never
    go down (``_created`` samples are left alone: a changed one would mean a restart)."""

    def __init__(self, texts: list[str]) -> None:
        self.snaps = [self._parse(t) for t in texts]
        first, last = self.snaps[0], self.snaps[-1]
        base = {k: v for kind, k, v in first if kind == "c"}
        self.loop_increase = {k: v - base.get(k, 0.0) for kind, k, v in last if kind == "c"}
        self.count = 0
        self.lock = threading.Lock()

    @staticmethod
    def _parse(text: str) -> list[tuple[str, str, float | None]]:
        counters: set[str] = set()
        out: list[tuple[str, str, float | None]] = []
        for line in text.splitlines():
            t = _TYPE.match(line)
            if t:
                name, kind = t.groups()
                bare = name[:-6] if name.endswith("_total") else name
                counters.update({bare, bare + "_total"} if kind == "counter"
                                else {name + "_bucket", name + "_sum", name + "_count"})
            m = _SAMPLE.match(line) if not line.startswith("#") else None
            series = m and m.group("series")
            metric = series.split("{", 1)[0] if series else None
            if m and metric in counters and not m.group("rest"):
                out.append(("c", series, float(m.group("value"))))
            else:
                out.append(("l", line, None))
        return out

    def next_text(self) -> str:
        with self.lock:
            i, self.count = self.count, self.count + 1
        loop, snap = divmod(i, len(self.snaps))
        lines = []
        for kind, key, value in self.snaps[snap]:
            if kind == "c":
                lines.append(f"{key} {value + loop * self.loop_increase.get(key, 0.0)!r}")
            else:
                lines.append(key)
        return "\n".join(lines) + "\n"


class FakeVllm:
    """vLLM's /metrics on 127.0.0.1 from a :class:`LoopingTrace` (or fixed texts)."""

    def __init__(self, trace: LoopingTrace) -> None:
        self.trace = trace
        self.aborted = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                if not send_exposition(self, owner.trace.next_text().encode()):  # kvhit gave up (its timeout)
                    owner.aborted += 1

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_sample(pid: int) -> tuple[float, float, float]:
    """(VmRSS MiB, VmHWM MiB, CPU seconds user+system) of a process."""
    status = Path(f"/proc/{pid}/status").read_text()
    kib = {k: float(v.split()[0]) for k, v in (ln.split(":", 1) for ln in status.splitlines() if ":" in ln)
           if k in ("VmRSS", "VmHWM")}
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return kib["VmRSS"] / 1024, kib["VmHWM"] / 1024, (int(fields[11]) + int(fields[12])) / ticks


def _poll(url: str, every: float, stop: threading.Event) -> None:
    while not stop.wait(every):
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                r.read()
        except OSError:
            pass


def measure(seconds: float, interval: float = 5.0, speedup: float = 1.0, kvhit: str | None = None) -> dict:
    kvhit = kvhit or shutil.which("kvhit")
    if kvhit is None:
        raise RuntimeError("kvhit is not installed (pip install -e .)")
    fake = FakeVllm(LoopingTrace(trace_texts()))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVHIT_")}
    env["KVHIT_WINDOW_SECONDS"] = str(60.0 / speedup)
    cmd = [kvhit, "run", f"--target={fake.url}", f"--listen=127.0.0.1:{port}", f"--config={CONFIG}",
           f"--interval={interval / speedup}"]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        stop = threading.Event()
        base = f"http://127.0.0.1:{port}"
        for path, every in (("/metrics", 15.0), ("/readyz", 10.0), ("/healthz", 20.0)):
            threading.Thread(target=_poll, args=(base + path, every / speedup, stop), daemon=True).start()
        samples = []
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < seconds:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"kvhit exited {proc.returncode}: {log.read().decode()[-2000:]}")
                samples.append((time.monotonic() - t0, *proc_sample(proc.pid), fake.trace.count))
                time.sleep(1.0)
        finally:
            stop.set()
            proc.terminate()
            proc.wait(10)
            fake.stop()
    t_end, rss_end, hwm, cpu_end, cycles = samples[-1]
    last = [s for s in samples if s[0] >= t_end - 60.0]
    # CPU per scrape late in the run (buffers fullest): kvhit's CPU over the last 60 s (serving
    # /metrics and the probes included) divided by the scrapes of the fake vLLM meanwhile.
    per_cycle = (last[-1][3] - last[0][3]) / max(1, last[-1][4] - last[0][4])
    return {
        "seconds": round(t_end, 1), "interval_s": interval, "speedup": speedup,
        "scrapes": cycles, "scrapes_aborted": fake.aborted,
        "rss_mib_end": round(rss_end, 1), "rss_mib_peak": round(hwm, 1),
        "cpu_seconds_total": round(cpu_end, 2),
        "cpu_millicores_mean": round(1000 * cpu_end / t_end, 1),
        "cpu_millicores_last_60s": round(1000 * (last[-1][3] - last[0][3]) / max(1e-9, last[-1][0] - last[0][0]), 1),
        "cpu_seconds_per_scrape_late": round(per_cycle, 4),
        "cpu_millicores_at_interval_late": round(1000 * per_cycle / interval, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--interval", type=float, default=5.0, help="kvhit's scrape interval being sized [s]")
    ap.add_argument("--speedup", type=float, default=1.0)
    args = ap.parse_args(argv)
    result = measure(args.seconds, args.interval, args.speedup)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
