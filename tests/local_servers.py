"""What the live tests start, all on 127.0.0.1 (shared by the real-Prometheus and fleet tests):
free ports, a request-handler class served in a thread, subprocesses logged to files and stopped
by PID, Prometheus itself (Debian's binary, found by :func:`observability.tool`: missing fails,
never skips) with its query API, and a fake of that API with canned answers."""
from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

from observability import tool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(handler_cls: type, port: int = 0) -> ThreadingHTTPServer:
    """``handler_cls`` served on 127.0.0.1:``port`` (0: a free one, see ``server_address``) in a
    daemon thread; ``shutdown()`` and ``server_close()`` stop it."""
    server = ThreadingHTTPServer(("127.0.0.1", port), handler_cls)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def reply(handler: BaseHTTPRequestHandler, status: int, body: bytes, headers: dict | None = None,
          content_type: str = "text/plain; version=0.0.4; charset=utf-8") -> None:
    """Answer one request: status, Content-Type, ``headers``, Content-Length (unless given), body."""
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    for k, v in (headers or {}).items():
        handler.send_header(k, v)
    if "Content-Length" not in (headers or {}):
        handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def http_get(url: str) -> tuple[int, str]:
    """(status, body) of a GET of ``url``; (0, "") when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def wait_for(cond, timeout: float, what, proc: subprocess.Popen | None = None) -> None:
    """Poll ``cond()`` every 0.5 s; fail with ``what`` (and the tail of ``proc``'s log when it
    exited or on timeout). ``what`` is a string or a function returning one, called at the
    failure, so that it can say what the state was then rather than when the wait began.
    ``cond()`` is asked once more at the deadline: this process may have been paused (a starved
    machine) past it while the awaited state came."""
    end = time.monotonic() + timeout
    while True:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{_text(what)}: process exited {proc.returncode}: {proc.log_path.read_text()[-3000:]}")
        if time.monotonic() >= end:
            break
        time.sleep(min(0.5, max(0.0, end - time.monotonic())))
    log = f"\n{proc.log_path.read_text()[-3000:]}" if proc is not None else ""
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {_text(what)}{log}")


class StallMeter:
    """How long this process was stopped while the block ran, as a thread waking every ``tick``
    sees it: the sum of its oversleeps beyond ``grace`` (SIGSTOP, a starved CPU, a paused VM —
    CI has seen 14-26 s pauses). The code under test running slowly does not count: it holds the
    GIL at most the switch interval (5 ms) at a time. A latency bound is then ``bound + stalled``:
    what the deadline did not cause, measured, instead of a slack guessed larger."""

    def __init__(self, tick: float = 0.01, grace: float = 0.05) -> None:
        self.tick, self.grace, self.stalled = tick, grace, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.tick):
            now = time.monotonic()
            self.stalled += max(0.0, now - last - self.tick - self.grace)
            last = now
        self.stalled += max(0.0, time.monotonic() - last - self.tick - self.grace)

    def __enter__(self) -> "StallMeter":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _text(what) -> str:
    return what() if callable(what) else what


class Processes:
    """Subprocesses a test starts, each logging to ``<log_dir>/<name>.log`` (``proc.log_path``)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             cwd=self.log_dir, env=env)
        p.log_path = self.log_dir / f"{name}.log"  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def stop(self) -> None:
        """SIGTERM each process started here (by PID), SIGKILL what is still running 10 s later."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def start_prometheus(procs: Processes, config: dict, port: int) -> subprocess.Popen:
    """Prometheus on 127.0.0.1:``port`` with ``config`` (written to ``<log_dir>/prometheus.yml``,
    TSDB in ``<log_dir>/prom-data``); returns once ``/-/ready`` answers 200 (60 s at most)."""
    path = procs.log_dir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    p = procs.spawn("prometheus", [tool("prometheus"), f"--config.file={path}",
                                   f"--storage.tsdb.path={procs.log_dir / 'prom-data'}",
                                   f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"])
    wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/-/ready"), 60, "prometheus ready", p)
    return p


def prometheus_query(base_url: str, expr: str, at: float | None = None) -> list[dict]:
    """``data.result`` of an instant query (POST /api/v1/query) at ``at`` [unix s] or now."""
    form = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
    with urllib.request.urlopen(f"{base_url}/api/v1/query", data=urllib.parse.urlencode(form).encode(),
                                timeout=10) as r:
        doc = json.load(r)
    assert doc["status"] == "success", (expr, doc)
    return doc["data"]["result"]


class FakePrometheus:
    """``POST /api/v1/query`` answered with the next queued (status, body), an empty instant
    vector when none is queued; ``forms`` and ``headers`` record every request's form fields and
    HTTP headers. The latest-sample query fleet mode sends before each range query (it has
    ``timestamp(``, which the range query has only in its ``age:`` parts) is answered from ``latest`` instead (an empty vector when none is queued: no
    sample time known) and recorded in ``latest_forms``. A queued 3xx answer redirects to
    ``redirect_to``."""

    def __init__(self) -> None:
        self.answers: list[tuple[int, bytes]] = []
        self.forms: list[dict[str, str]] = []
        self.headers: list[dict[str, str]] = []
        self.latest: list[tuple[int, bytes]] = []
        self.latest_forms: list[dict[str, str]] = []
        self.redirect_to = "/moved"  # the Location of a 3xx answer
        self.delay = 0.0  # seconds before each answer
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server API)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                form = {k: v[0] for k, v in urllib.parse.parse_qs(body.decode()).items()}
                query = form.get("query", "")
                queue, forms = (fake.latest, fake.latest_forms) if "timestamp(" in query and '"age:' not in query \
                    else (fake.answers, fake.forms)
                forms.append(form)
                fake.headers.append(dict(self.headers))
                status, answer = queue.pop(0) if queue else (200, fake.vector([]))
                time.sleep(fake.delay)
                moved = {"Location": fake.redirect_to} if 300 <= status < 400 else None
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # kvhit gave up (a delay)
                    reply(self, status, answer, moved, content_type="application/json")

            def log_message(self, *a):
                pass

        self.server = serve(Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    @staticmethod
    def vector(rows: list[tuple[dict[str, str], str]]) -> bytes:
        """A successful instant-vector answer of (labels, value) rows."""
        result = [{"metric": labels, "value": [1000.0, value]} for labels, value in rows]
        return json.dumps({"status": "success", "data": {"resultType": "vector", "result": result}}).encode()

    def answer(self, rows: list[tuple[dict[str, str], str]]) -> None:
        self.answers.append((200, self.vector(rows)))

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
