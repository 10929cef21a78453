"""Helpers of the live-vLLM end-to-end test: processes, a recording /metrics proxy, a poller.

Everything binds 127.0.0.1 and every process started here is stopped by its PID (its process
group, so vLLM's engine-core child goes too). Nothing here imports kvhit: the test checks kvhit
from the outside, with numbers it derives itself from vLLM's own /metrics.
"""
from __future__ import annotations

import math
import os
import re
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process in its own session; ``stop``/``kill`` signal its whole process group."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None,
                 cwd: str | None = None) -> None:
        self.name, self.argv, self.log_path = name, argv, log_path
        self._log = open(log_path, "wb")
        self.popen = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=env, cwd=cwd, start_new_session=True)
        self.pid = self.popen.pid  # = its process group id (start_new_session)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the whole group (a crash) and reap."""
        self._signal_group(signal.SIGKILL)
        self.popen.wait(timeout=30)
        self._wait_group_gone(30)
        self._log.close()

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM the leader (it shuts its own children down and frees their shared memory), then
        SIGTERM and finally SIGKILL whatever of its group is left; returns the exit code."""
        if self.alive():
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        if not self._wait_group_gone(5):
            self._signal_group(signal.SIGTERM)
            if not self._wait_group_gone(timeout):
                self._signal_group(signal.SIGKILL)
                self._wait_group_gone(10)
        if self.popen.poll() is None:
            self._signal_group(signal.SIGKILL)
            self.popen.wait(timeout=10)
        if not self._log.closed:
            self._log.close()
        return self.popen.returncode

    def _wait_group_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.group_alive():
                return True
            time.sleep(0.1)
        return not self.group_alive()

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def wait_http(url: str, timeout: float, proc: Proc | None = None) -> float:
    """Poll ``url`` until it answers 200; returns the seconds waited. Raises on timeout or death."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
        try:
            if requests.get(url, timeout=2).status_code == 200:
                return time.monotonic() - start
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not up within {timeout}s" + (f":\n{proc.tail()}" if proc else ""))


# --- shared memory a killed vLLM leaves behind ---------------------------------------------------

SHM = Path("/dev/shm")
_SHM_PREFIXES = ("psm_", "sem.mp-")  # Python multiprocessing shared memory and semaphores


def shm_entries() -> set[str]:
    return {p.name for p in SHM.iterdir()} if SHM.is_dir() else set()


def _shm_in_use() -> set[str]:
    used: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                used.update(line.split("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    used.add(target[len("/dev/shm/"):].split()[0])
        except OSError:
            continue
    return used


def remove_leaked_shm(before: set[str]) -> list[str]:
    """Unlink multiprocessing segments that appeared since ``before`` and that no process maps or
    holds open: what a SIGKILLed vLLM (the crash the test simulates) cannot clean up itself."""
    new = [n for n in shm_entries() - before if n.startswith(_SHM_PREFIXES)]
    if not new:
        return []
    used = _shm_in_use()
    removed = []
    for name in new:
        if name not in used:
            try:
                (SHM / name).unlink()
                removed.append(name)
            except OSError:
                pass
    return removed


# --- vLLM exposition, read by the test itself ------------------------------------------------

_SAMPLE = re.compile(r"^(vllm:[a-z_]+)\{([^}]*)\} (\S+)$", re.M)


def vllm_counter(text: str, name: str, model: str) -> float | None:
    """Sum of ``name`` over the series of ``model`` (all engines); None when absent."""
    values = [float(v) for n, labels, v in _SAMPLE.findall(text)
              if n == name and f'model_name="{model}"' in labels]
    return math.fsum(values) if values else None


@dataclass(frozen=True)
class Record:
    t: float  # unix time the proxy's handler started on the scrape
    body: str
    upstream_seconds: float = 0.0  # how long vLLM took to answer it


class RecordingProxy:
    """HTTP /metrics proxy in front of vLLM: kvhit scrapes through it; every successful upstream
    answer is recorded with the time its handler started, so the test sees exactly the bodies
    kvhit ingested. kvhit stamps a scrape when its answer began, after this handler had vLLM's
    body; on a starved machine the handler can start after kvhit's request by as long as the
    scrape took, kvhit_scrape_duration_seconds. An unreachable upstream answers 502
    (kvhit counts it as ``http_502``)."""

    def __init__(self, upstream: str, upstream_timeout: float = 2.5) -> None:
        self.upstream, self.upstream_timeout = upstream, upstream_timeout
        self.records: list[Record] = []
        self.failures = 0
        self.attempts: list[tuple[float, float]] = []  # every upstream request, answered or not: (t, seconds)
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                t = time.time()
                try:
                    resp = requests.get(proxy.upstream, timeout=proxy.upstream_timeout)
                    ok = resp.status_code == 200
                    body = resp.content
                except requests.RequestException:
                    ok, body = False, b"upstream unreachable\n"
                took = time.time() - t
                with proxy._lock:
                    proxy.attempts.append((t, took))
                    if ok:
                        proxy.records.append(Record(t, body.decode("utf-8", errors="replace"), took))
                    else:
                        proxy.failures += 1
                self.send_response(200 if ok else 502)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="metrics-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def snapshot(self) -> list[Record]:
        with self._lock:
            return sorted(self.records, key=lambda r: r.t)


class Heartbeat:
    """Ticks every ``period`` seconds in this test process and keeps every pause longer than
    ``min_pause`` as (wall start, wall end): a paused test process misses kvhit's scrapes at the
    proxy and its own polls, which is not kvhit's doing and must be told apart from it."""

    def __init__(self, period: float = 0.1, min_pause: float = 1.0) -> None:
        self.period, self.min_pause = period, min_pause
        self.pauses: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def _loop(self) -> None:
        last_mono, last_wall = time.monotonic(), time.time()
        while not self._stop.wait(self.period):
            mono, wall = time.monotonic(), time.time()
            if mono - last_mono > self.min_pause:
                self.pauses.append((last_wall, wall))
            last_mono, last_wall = mono, wall

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)



def paused_within(pauses: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Seconds of [t0, t1] (unix time) covered by any of ``pauses`` ((start, end) spans, unix
    time, e.g. Heartbeat.pauses); spans that overlap count once."""
    covered, end = 0.0, t0
    for a, b in sorted(pauses):
        a, b = max(a, end), min(b, t1)
        if b > a:
            covered, end = covered + b - a, b
    return covered


# --- kvhit's /metrics, polled -----------------------------------------------------------------


@dataclass(frozen=True)
class KvhitSample:
    t: float  # when the test read it
    up: float | None
    last_success: float | None
    duration: float | None  # kvhit_scrape_duration_seconds: of the last attempt (of last_success when up)
    errors: dict[str, float]
    window: float | None
    hit_ratio: dict[str, float]
    fit_status: dict[str, str]  # fit → the status whose series is 1
    isl: float | None
    osl: float | None
    ttft: float | None
    tpm: dict[str, float] = field(default_factory=dict)  # "kind/basis/per" → value


def read_kvhit(url: str, model: str, timeout: float = 5.0) -> KvhitSample:
    text = requests.get(url, timeout=timeout).text
    s: dict = {"up": None, "last_success": None, "duration": None, "errors": {}, "window": None, "hit_ratio": {}, "fit_status": {},
               "isl": None, "osl": None, "ttft": None, "tpm": {}}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            lab, v = smp.labels, smp.value
            if smp.name == "kvhit_up":
                s["up"] = v
            elif smp.name == "kvhit_last_success_timestamp_seconds":
                s["last_success"] = v
            elif smp.name == "kvhit_scrape_duration_seconds":
                s["duration"] = v
            elif smp.name == "kvhit_scrape_errors_total":
                s["errors"][lab["reason"]] = v
            elif lab.get("model_name") != model:
                continue
            elif smp.name == "kvhit_window_seconds":
                s["window"] = v
            elif smp.name == "kvhit_hit_ratio":
                s["hit_ratio"][lab["source"]] = v
            elif smp.name == "kvhit_fit_status" and v == 1.0:
                s["fit_status"][lab["fit"]] = lab["status"]
            elif smp.name == "kvhit_isl_tokens":
                s["isl"] = v
            elif smp.name == "kvhit_osl_tokens":
                s["osl"] = v
            elif smp.name == "kvhit_observed_ttft_seconds":
                s["ttft"] = v
            elif smp.name == "kvhit_tpm_tokens_per_minute":
                s["tpm"][f"{lab['kind']}/{lab['basis']}/{lab['per']}"] = v
    return KvhitSample(t=time.time(), **s)


READ_TIMEOUT = 30.0  # s, one read of kvhit's /metrics by the Poller


class Poller:
    """Reads kvhit's /metrics every ``period`` seconds (faster than kvhit scrapes, so every
    publish window is seen); failed reads are kept in ``read_failures``. A read waits up to
    ``READ_TIMEOUT``: kvhit starved for seconds on a shared CI machine is slow, not broken."""

    def __init__(self, url: str, model: str, period: float = 0.5) -> None:
        self.url, self.model, self.period = url, model, period
        self.samples: list[KvhitSample] = []
        self.read_failures: list[str] = []  # "unix time: exception" of reads that failed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvhit-poller", daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(read_kvhit(self.url, self.model, READ_TIMEOUT))
            except (requests.RequestException, ValueError) as exc:
                self.read_failures.append(f"{time.time():.1f}: {type(exc).__name__}: {exc}")
            self._stop.wait(self.period)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def latest(self) -> KvhitSample | None:
        return self.samples[-1] if self.samples else None

    def wait_for(self, predicate, timeout: float, what: str) -> KvhitSample:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.latest()
            if s is not None and predicate(s):
                return s
            time.sleep(0.2)
        raise AssertionError(f"kvhit never showed {what} within {timeout}s; last sample: {self.latest()}")


# --- load the test drives itself (after the restart) -------------------------------------------


def drive_load(completions_url: str, model: str, seconds: float, concurrency: int, isl: int, prefix: list[int],
               osl: int, token_range: tuple[int, int] = (1000, 8000), seed: int = 0, at_least: int = 0,
               cap: float = 120.0) -> int:
    """Closed-loop requests (shared ``prefix`` + random suffix) for ``seconds``, and on until
    ``at_least`` succeeded or ``cap`` seconds in all (a starved machine is slow, not broken);
    returns the count ok. A request that fails (an error status, a timeout) is not counted."""
    import random

    start = time.time()
    done = [0]
    lock = threading.Lock()

    def more() -> bool:
        elapsed = time.time() - start
        return elapsed < seconds or (done[0] < at_least and elapsed < cap)

    def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        with requests.Session() as s:
            while more():
                ids = prefix + [rng.randrange(*token_range) for _ in range(isl - len(prefix))]
                try:
                    r = s.post(completions_url, json={"model": model, "prompt": ids, "max_tokens": osl,
                                                      "min_tokens": osl, "ignore_eos": True, "temperature": 0.0},
                               timeout=60)
                except requests.RequestException:
                    r = None
                if r is not None and r.status_code == 200:
                    with lock:
                        done[0] += 1
                else:
                    time.sleep(0.5)  # a server not answering yet is not to be hammered for 120 s

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done[0]
