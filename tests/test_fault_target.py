"""Target failures against a local misbehaving HTTP target (issue 7), with a fake clock.

A small threaded ``http.server`` on 127.0.0.1 serves snapshots of the bundled real vLLM 0.32
trace; the test switches what it does next: refuse (the listener closed), answer after the
timeout, trickle the body, 500, 404, a 302 to the real path, gzip, a body over the size cap, a
gzip bomb, a body cut off mid-way, a hang-up without an answer. Each kind is checked for its
reason and its outcome; then the target flaps for 10 minutes of fake time (the real HTTP round trips take milliseconds): kvhit
recovers without restart, never shows a per-model value older than two intervals plus the timeout, and its
error counters equal the faults the target actually served.

Expected values come from the test's own bookkeeping of what the server did, never from kvhit.
"""
from __future__ import annotations

import gzip
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from importlib.metadata import version

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from local_servers import StallMeter, reply

from exporter.collector import KvhitCollector
from exporter.config import Config
from exporter.runner import MAX_BACKOFF_FACTOR, Runner
from exporter.sources import LiveSource, ScrapeError, load_trace

TRACE = str(resources.files("exporter") / "data" / "vllm-cpu-0.32-sweep-ab.tar.gz")
SECRET = "SECRET-BODY-MARKER"
TIMEOUT = 1.0  # scrape deadline [s] (real time: the slow modes really are slow; roomy for a loaded CI box)
CAP = 256 * 1024  # body cap for the test [bytes]; the trace snapshots are ~51 KB
LATE = 0.6  # mode "late": seconds before the answer begins, under TIMEOUT
BOMB = gzip.compress(b"\n" * (16 << 20))  # 16 MiB of newlines in ~16 KiB


@pytest.fixture(scope="module")
def snapshots() -> list[str]:
    return [text for _, text in load_trace(TRACE).snapshots]


class Target:
    """The misbehaving target. ``mode`` says what the next /metrics request gets."""

    def __init__(self, snapshots: list[str]) -> None:
        self.snapshots = snapshots
        self.next = 0  # index of the snapshot the next good answer serves
        self.mode = "ok"
        self.served: list[str] = []  # mode of every request to /metrics (redirect targets too)
        self.agents: list[str] = []  # User-Agent of every request
        self.server: ThreadingHTTPServer | None = None
        self.port = 0
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def start(self) -> None:
        target = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                target.agents.append(self.headers.get("User-Agent", ""))
                if self.path == "/real-metrics":
                    return target.good(self)
                mode = target.mode
                target.served.append(mode)
                return getattr(target, "mode_" + mode)(self)

        class Server(ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # kvhit hanging up on a slow answer is the point, not an error

        self.server = Server(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        """Close the listener: connections are refused until start()."""
        self.server.shutdown()
        self.server.server_close()

    def body(self) -> bytes:
        text = self.snapshots[self.next % len(self.snapshots)]
        self.next += 1
        return text.encode()

    send = staticmethod(reply)

    def good(self, h) -> None:
        self.send(h, 200, self.body())

    mode_ok = good

    def mode_gzip(self, h) -> None:
        self.send(h, 200, gzip.compress(self.body()), {"Content-Encoding": "gzip"})

    def mode_redirect(self, h) -> None:
        self.send(h, 302, b"", {"Location": "/real-metrics"})

    def mode_gzip_members(self, h) -> None:  # one gzip body of three members (RFC 1952 §2.2)
        body = self.body()
        cuts = (0, 1000, len(body) // 2, len(body))
        self.send(h, 200, b"".join(gzip.compress(body[a:b]) for a, b in zip(cuts, cuts[1:])),
                  {"Content-Encoding": "gzip"})

    def mode_gzip_junk(self, h) -> None:  # a gzip member, then bytes that are none
        self.send(h, 200, gzip.compress(self.body()) + b"junk after it", {"Content-Encoding": "gzip"})

    def mode_root_to_missing(self, h) -> None:  # / redirects to a /metrics that is not there
        if h.path == "/":
            return self.send(h, 302, b"", {"Location": "/metrics"})
        self.send(h, 404, b"not found\n")

    def mode_redirect_drip(self, h) -> None:  # a 302 whose body trickles in: requests read it whole
        # before following, with its per-read timeout only
        body = b"moved" * 40
        h.send_response(302)
        h.send_header("Location", "/real-metrics")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        try:
            for byte in body:
                h.wfile.write(bytes([byte]))
                h.wfile.flush()
                time.sleep(0.1)
        except OSError:
            pass  # kvhit hung up at its deadline

    def mode_redirect_br(self, h) -> None:  # an encoding kvhit does not decode, on a body it discards
        self.send(h, 302, b"\x0b\x02\x80moved\x03", {"Location": "/real-metrics", "Content-Encoding": "br"})

    def mode_redirect_bad_gzip(self, h) -> None:
        self.send(h, 302, b"moved", {"Location": "/real-metrics", "Content-Encoding": "gzip"})

    def mode_redirect_loop(self, h) -> None:
        self.send(h, 302, b"", {"Location": "/metrics"})

    def mode_redirect_ftp(self, h) -> None:  # a scheme requests cannot follow
        self.send(h, 302, b"", {"Location": "ftp://127.0.0.1/metrics"})

    def mode_redirect_control(self, h) -> None:  # an ESC sequence, which would colour the log's terminal
        self.send(h, 302, b"", {"Location": "ftp://127.0.0.1/met\x1b[31mrics"})

    def mode_redirect_tls(self, h) -> None:  # to https on this plain-HTTP port
        self.send(h, 302, b"", {"Location": f"https://127.0.0.1:{self.port}/real-metrics"})

    def mode_redirect_big(self, h) -> None:  # the redirect's own body over the cap: never followed
        self.send(h, 302, b"x" * (CAP + 1), {"Location": "/real-metrics"})

    def mode_redirect_empty(self, h) -> None:  # requests does not follow an empty Location
        self.send(h, 302, b"", {"Location": ""})

    def mode_redirect_no_url(self, h) -> None:
        self.send(h, 302, b"", {"Location": "http://[::1/metrics"})

    def mode_http500(self, h) -> None:
        self.send(h, 500, f"Traceback ... {SECRET}\n".encode())

    def mode_http404(self, h) -> None:
        self.send(h, 404, f"<html>{SECRET} not found</html>\n".encode())

    def mode_late(self, h) -> None:
        time.sleep(LATE)  # a stalled engine (SIGSTOP, a GC pause) answering within the deadline
        self.good(h)

    def mode_slow(self, h) -> None:
        body = self.body()
        time.sleep(TIMEOUT + 0.5)  # no answer before the deadline
        try:
            self.send(h, 200, body)
        except OSError:
            pass  # kvhit hung up at its deadline

    def mode_trickle(self, h) -> None:
        body = self.body()
        h.send_response(200)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        try:
            for i in range(0, len(body), 64):  # 64 bytes every 50 ms: each read is quick, the whole is not
                h.wfile.write(body[i:i + 64])
                h.wfile.flush()
                time.sleep(0.05)
        except OSError:
            pass  # kvhit hung up at its deadline

    def mode_drip_headers(self, h) -> None:  # each header line quick, all of them not (requests'
        # timeout is per socket read)
        h.send_response(200)
        try:
            for i in range(int(4 * TIMEOUT / 0.1)):
                h.send_header(f"X-Drip-{i}", "1")
                h.flush_headers()
                time.sleep(0.1)
            h.end_headers()
        except OSError:
            pass  # kvhit hung up at its deadline

    def mode_drip_status(self, h) -> None:  # the status line itself, one byte at a time
        try:
            for byte in b"HTTP/1.1 200 OK":
                h.wfile.write(bytes([byte]))
                h.wfile.flush()
                time.sleep(0.2)
        except OSError:
            pass
        h.close_connection = True

    def mode_many_headers(self, h) -> None:  # over http.client's 100 header lines
        h.send_response(200)
        for i in range(101):
            h.send_header(f"X-Many-{i}", "1")
        h.end_headers()

    def mode_long_header(self, h) -> None:  # one header line over http.client's 64 KiB
        h.send_response(200)
        h.send_header("X-Long", "x" * 70000)
        h.end_headers()

    def mode_oversize(self, h) -> None:
        line = f'vllm:num_requests_running{{engine="0",model_name="{SECRET}"}} 1.0\n'.encode()
        self.send(h, 200, line * (CAP // len(line) + 10))

    def mode_oversize_chunked(self, h) -> None:  # no Content-Length: the cap applies while reading
        h.send_response(200)
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        chunk = b"# " + b"x" * 8190 + b"\n"
        try:
            for _ in range(CAP // len(chunk) + 5):
                h.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            h.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass

    def mode_gzip_bomb(self, h) -> None:
        self.send(h, 200, BOMB, {"Content-Encoding": "gzip"})

    def mode_cut(self, h) -> None:  # Content-Length says more than is sent, then the connection closes
        body = self.body()
        self.send(h, 200, body[: len(body) // 2], {"Content-Length": str(len(body))})
        h.close_connection = True

    def mode_hangup(self, h) -> None:  # the connection accepted, then closed without a status line
        h.close_connection = True

    def mode_brotli(self, h) -> None:
        self.send(h, 200, b"\x8b\x00\x80garbage", {"Content-Encoding": "br"})

    def mode_html(self, h) -> None:  # a proxy's login page with status 200
        self.send(h, 200, f"<html>\n<body>\n{SECRET}\n</body>\n</html>\n".encode())


@pytest.fixture
def target(snapshots):
    t = Target(snapshots)
    yield t
    try:
        t.stop()
    except Exception:
        pass


def test_healthy_target_plain_gzip_and_redirect(target):
    src = LiveSource(target.url, timeout=TIMEOUT, max_bytes=CAP)
    _, plain = src.fetch()
    assert plain == target.snapshots[0]
    target.mode = "gzip"
    _, unzipped = src.fetch()
    assert unzipped == target.snapshots[1]  # decoded, byte for byte the served snapshot
    target.mode = "redirect"
    _, redirected = src.fetch()
    assert redirected == target.snapshots[2]  # the 302 was followed to /real-metrics
    assert target.served == ["ok", "gzip", "redirect"]
    # every request (the redirect's too) names kvhit and its installed version, not python-requests
    assert target.agents == [f"kvhit/{version('kvhit')}"] * 4


def test_a_gzip_body_of_several_members_is_read_whole_and_junk_after_one_is_corrupt(target):
    # Only the first member was decoded (1275 of 23219 bytes in a review), with up=1 and no error:
    # every family after it silently gone. Prometheus reads every member, and fails junk after one.
    src = LiveSource(target.url, timeout=TIMEOUT, max_bytes=CAP)
    target.mode = "gzip_members"
    assert src.fetch()[1] == target.snapshots[0]
    target.mode = "gzip_junk"
    with pytest.raises(ScrapeError) as info:
        src.fetch()
    assert info.value.reason == "encoding"


@pytest.mark.parametrize("mode", ["redirect_br", "redirect_bad_gzip"])
def test_a_redirect_body_is_discarded_as_sent_not_decoded(target, mode):
    # a 302's body is thrown away: its Content-Encoding (unsupported, or a body that is not what
    # it claims) must not fail the scrape it redirects
    target.mode = mode
    _, body = LiveSource(target.url, timeout=TIMEOUT, max_bytes=CAP).fetch()
    assert body == target.snapshots[0] and target.served == [mode]


def test_a_redirect_whose_body_trickles_times_out_at_the_deadline(target):
    # requests reads a redirect's body before following it, each read under the per-read timeout
    # only: 40 bytes at 0.1 s held a 1-s scrape for 4 s; now it is read under the deadline
    target.mode = "redirect_drip"
    src = LiveSource(target.url, timeout=TIMEOUT, max_bytes=CAP)
    with StallMeter() as stall:  # this process paused (a starved machine) is not the drip's time
        started = time.monotonic()
        with pytest.raises(ScrapeError) as info:
            src.fetch()
        took = time.monotonic() - started
    assert info.value.reason == "timeout" and took < TIMEOUT + 0.5 + stall.stalled, (took, stall.stalled)


def test_a_redirect_every_scrape_reuses_one_connection():
    # vLLM behind a path that redirects (/metrics → /metrics/, 307) is followed every scrape: its
    # body is read, so the keep-alive connection serves the next request (dropping the body unread
    # cost a new connection, a TLS handshake over https, per scrape)
    connections = []

    class KeepAlive(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            connections.append(self.client_address)

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            if self.path == "/metrics":
                reply(self, 307, b"moved to /metrics/\n", {"Location": "/metrics/"})
            else:
                reply(self, 200, b"# HELP x y\n# TYPE x gauge\nx 1\n")

    assert _scrapes(KeepAlive, 5) == ["# HELP x y\n# TYPE x gauge\nx 1\n"] * 5 and len(connections) == 1


def _scrapes(handler: type[BaseHTTPRequestHandler], n: int) -> list[str]:
    """The bodies of ``n`` scrapes by one LiveSource of a local server answering with ``handler``."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        src = LiveSource(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=TIMEOUT)
        return [src.fetch()[1] for _ in range(n)]
    finally:
        server.shutdown()
        server.server_close()


def test_a_kept_alive_connection_closed_as_the_next_scrape_goes_out_is_retried_on_a_new_one():
    # vLLM (uvicorn) closes a kept-alive connection after 5 s idle, kvhit's default interval: a
    # request sent as it closes is read by nobody. The first connection here answers one request,
    # then closes on the next one unanswered; the scrape gets its body from a second connection.
    connections, body = [], b"# HELP x y\n# TYPE x gauge\nx 1\n"

    class ClosesOnSecondRequest(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            connections.append(0)
            self.index = len(connections) - 1

        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            connections[self.index] += 1
            if self.index == 0 and connections[0] == 2:
                self.close_connection = True
                return
            reply(self, 200, body)

    assert _scrapes(ClosesOnSecondRequest, 2) == [body.decode()] * 2 and connections == [2, 1]


def test_the_retry_on_a_new_connection_stays_within_the_scrape_deadline():
    # the target holds the request 1.8 s of a 2-s deadline, its accept queue fills, then it closes
    # unanswered: the retry's connection waits for the 0.2 s left, not a whole timeout again
    timeout, listener, fillers = 2.0, socket.socket(), []
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]

    def hold_then_hang_up() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        time.sleep(1.8)
        for _ in range(3):  # a full accept queue: new connections get no SYN-ACK
            f = socket.socket()
            f.setblocking(False)
            try:
                f.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            fillers.append(f)
        time.sleep(0.1)
        conn.close()

    threading.Thread(target=hold_then_hang_up, daemon=True).start()
    try:
        with StallMeter() as stall:
            started = time.monotonic()
            with pytest.raises(ScrapeError) as info:
                LiveSource(f"http://127.0.0.1:{port}/metrics", timeout=timeout).fetch()
            took = time.monotonic() - started
    finally:
        for f in fillers:
            f.close()
        listener.close()
    assert info.value.reason == "timeout" and took < timeout + 0.8 + stall.stalled, (took, stall.stalled)


@pytest.mark.parametrize("proxy", ["http://127.0.0.1:9", "http://proxy.invalid:3128"])  # refusing, unresolvable
def test_a_refusing_proxy_is_named_not_the_target(monkeypatch, proxy):
    monkeypatch.setenv("HTTP_PROXY", proxy)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with pytest.raises(ScrapeError) as info:
        LiveSource("http://vllm.internal:8000/metrics", timeout=TIMEOUT).fetch()
    assert info.value.reason == "refused"
    assert str(info.value) == ("cannot reach http://vllm.internal:8000/metrics through the proxy (HTTP_PROXY / "
                               "HTTPS_PROXY; NO_PROXY bypasses it)")


@pytest.mark.parametrize("mode, reason, said", [
    ("redirect_ftp", "redirect", "{url} (redirected to ftp://127.0.0.1/metrics): kvhit cannot follow it (InvalidSchema)"),
    ("redirect_tls", "refused", "TLS with {url} (redirected to https://127.0.0.1:{port}/real-metrics) failed"),
    # the server's bytes in a log line: shown escaped (a fault breaker's NUL made grep call the log binary)
    ("redirect_control", "redirect", "{url} (redirected to ftp://127.0.0.1/met\\x1b[31mrics): kvhit cannot follow it"),
    ("redirect_no_url", "redirect", "{url} (redirected to a Location that is no URL): kvhit cannot follow it"),
    # failures before requests follows anything are the target's own (review)
    ("redirect_big", "too_large", "from {url}"),
    ("redirect_empty", "http_302", "HTTP 302 from {url}"),
])
def test_a_failure_after_a_redirect_names_where_it_led(target, mode, reason, said):
    # a 302 to https on a plain port was logged as "TLS with http://…/metrics failed", the target's
    # own URL, and one to ftp:// as a generic error (review): the reason and the line say where it led
    target.mode = mode
    with pytest.raises(ScrapeError) as info:
        LiveSource(target.url, timeout=TIMEOUT, max_bytes=CAP).fetch()
    assert info.value.reason == reason
    assert said.format(url=target.url, port=target.port) in str(info.value), str(info.value)
    if mode in ("redirect_big", "redirect_empty"):
        assert "redirected" not in str(info.value) and str(info.value).endswith(target.url)


# mode → the reason kvhit must report
FAULTS = {
    "http500": "http_500",
    "http404": "http_404",
    "redirect_loop": "redirect",
    "slow": "timeout",
    "trickle": "timeout",
    "drip_headers": "timeout",
    "drip_status": "timeout",
    "oversize": "too_large",
    "oversize_chunked": "too_large",
    "gzip_bomb": "too_large",
    "many_headers": "too_large",  # was no_answer: "closed it without an HTTP answer"
    "long_header": "too_large",
    "cut": "incomplete",
    "hangup": "no_answer",
    "brotli": "encoding",
}


@pytest.mark.parametrize("mode", sorted(FAULTS))
def test_each_failure_kind_has_its_reason_and_never_echoes_the_body(target, mode, caplog):
    target.mode = mode
    src = LiveSource(target.url, timeout=TIMEOUT, max_bytes=CAP)
    with StallMeter() as stall:  # pauses of this process (a starved machine), measured: not the target's time
        started = time.monotonic()
        with pytest.raises(ScrapeError) as info:
            src.fetch()
        took = time.monotonic() - started
    # and through the runner: up 0, the error counted, the message logged without the body
    runner = Runner(Config(interval=5.0, timeout=TIMEOUT), target.url, clock=lambda: 1000.0)
    with StallMeter() as polled, caplog.at_level(logging.DEBUG, logger="kvhit"):
        assert runner.poll(src) is False
    assert info.value.reason == FAULTS[mode]
    assert SECRET not in str(info.value)
    # the whole scrape is bounded by the deadline (plus slack for a loaded CI machine); the
    # trickle would take 51 KB / 64 B × 50 ms ≈ 40 s without it
    assert took < TIMEOUT + 1.5 + stall.stalled, (took, stall.stalled)
    analysis, health = runner.current()
    assert health.up is False and health.errors == {FAULTS[mode]: 1}
    assert caplog.records and all(SECRET not in r.getMessage() for r in caplog.records)
    # the failed scrape's own duration is published, and the engine line says why nothing is read
    assert health.duration is not None and 0 <= health.duration < TIMEOUT + 1.5 + polled.stalled
    if mode == "slow":
        assert health.duration >= TIMEOUT  # it waited for the deadline
    assert analysis.engine_reason == f"no successful scrape yet (last attempt: {FAULTS[mode]})"


@pytest.mark.parametrize("path, said", [
    # a trailing slash is the likeliest typo of a URL without /metrics, which config refuses with
    # this hint; accepted (a proxy may serve metrics at /), its 404 gave no hint (a newcomer's find)
    ("/", "HTTP 404 from http://127.0.0.1:{port}/: vLLM serves /metrics, add it to the URL"),
    ("/metrics", "HTTP 404 from http://127.0.0.1:{port}/metrics"),
])
def test_a_404_at_the_root_path_says_to_add_metrics(target, path, said):
    target.mode = "http404"
    with pytest.raises(ScrapeError) as info:
        LiveSource(f"http://127.0.0.1:{target.port}{path}", timeout=TIMEOUT, max_bytes=CAP).fetch()
    assert info.value.reason == "http_404" and str(info.value) == said.format(port=target.port)


def test_a_404_after_a_redirect_from_the_root_to_metrics_gives_no_hint_to_add_it(target):
    # the hint read the configured URL's path, not where the request ended (review)
    target.mode = "root_to_missing"
    url = f"http://127.0.0.1:{target.port}/"
    with pytest.raises(ScrapeError) as info:
        LiveSource(url, timeout=TIMEOUT, max_bytes=CAP).fetch()
    assert info.value.reason == "http_404"
    assert str(info.value) == f"HTTP 404 from {url} (redirected to http://127.0.0.1:{target.port}/metrics)"


def test_a_late_answer_is_stamped_when_it_began_not_at_the_request(target):
    # The body is generated when the answer begins: stamped at the request instead, the step after
    # a stalled engine's late answer had its increases over LATE seconds too little time.
    src = LiveSource(target.url, timeout=TIMEOUT, max_bytes=CAP)
    runner = Runner(Config(interval=5.0, timeout=TIMEOUT), target.url)
    stamps, stalls = [], []
    for mode in ("ok", "late", "ok"):
        target.mode = mode
        with StallMeter() as stall:  # a pause of this process delays an answer's start past its slack
            before = runner.clock()
            assert runner.poll(src)
        stamps.append(runner.analyzer.windows.last.timestamp - before)
        stalls.append(stall.stalled)
    assert LATE <= stamps[1] < LATE + 0.25 + stalls[1], (stamps, stalls)
    assert stamps[0] < 0.25 + stalls[0] and stamps[2] < 0.25 + stalls[2], (stamps, stalls)


def test_refused_when_the_listener_is_closed(target):
    src = LiveSource(target.url, timeout=TIMEOUT, max_bytes=CAP)
    target.stop()
    with pytest.raises(ScrapeError) as info:
        src.fetch()
    assert info.value.reason == "refused"
    assert str(info.value) == f"connection to {target.url} refused: nothing listens on that port (vLLM not started " \
                              "yet or restarting, or a wrong port)"
    target.start()  # same port
    assert src.fetch()[1] == target.snapshots[0]


def test_https_to_a_plain_http_port_is_refused_and_says_tls(target):
    # the TLS handshake fails: an SSLError, whose reason is a str (it raised AttributeError in
    # the DNS check and was counted as an internal error; calibrate crashed on it)
    with pytest.raises(ScrapeError) as info:
        LiveSource(target.url.replace("http://", "https://"), timeout=TIMEOUT, max_bytes=CAP).fetch()
    assert info.value.reason == "refused" and "TLS with https://127.0.0.1:" in str(info.value)



def test_only_a_refused_connection_skips_the_back_off(target):
    # a connection refused costs the target nothing: the next attempt one interval later; a TLS
    # handshake the target answered (reason refused too) costs it one: 1, 2, 4 intervals
    interval = 5.0
    for url, waits in ((target.url.replace("http://", "https://"), [1, 2, 4]), (target.url, [1, 1, 1])):
        if waits == [1, 1, 1]:
            target.stop()
        runner = Runner(Config(interval=interval, timeout=TIMEOUT), url, clock=lambda: 1000.0)
        src = LiveSource(url, timeout=TIMEOUT, max_bytes=CAP)
        got = []
        for _ in waits:
            assert runner.poll(src) is False
            got.append(runner.next_delay() / interval)
        assert runner.current()[1].errors["refused"] == 3 and got == waits


def test_the_back_off_is_at_most_five_minutes_and_never_under_an_interval():
    # fleet mode's example polls every 120 s: 8 intervals held kvhit_up 0 for up to 16 min after
    # Prometheus was back (SRE review). 120, 240, then 300 s; at 5 s, 5-40 s as before; at 400 s, 400 s
    for interval, waits in ((120.0, [120.0, 240.0, 300.0, 300.0]), (5.0, [5.0, 10.0, 20.0, 40.0, 40.0]),
                            (400.0, [400.0, 400.0])):
        runner = Runner(Config(interval=interval, timeout=TIMEOUT), "http://127.0.0.1:1/metrics", clock=lambda: 1000.0)
        got = []
        for _ in waits:
            runner.record_failure("timeout", "no answer")
            got.append(runner.next_delay())
        assert got == waits, interval


def test_a_host_name_that_does_not_resolve_is_refused_and_says_dns(monkeypatch):
    def no_such_host(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    monkeypatch.setattr(socket, "getaddrinfo", no_such_host)  # no resolver needed: the lookup fails
    with pytest.raises(ScrapeError) as info:
        LiveSource("http://vllm.typo.invalid:8000/metrics", timeout=TIMEOUT, max_bytes=CAP).fetch()
    assert info.value.reason == "refused" and "cannot resolve the host" in str(info.value)
    assert "(DNS)" in str(info.value)


def test_html_page_with_status_200_is_a_parse_error_not_a_crash(target, caplog):
    target.mode = "html"
    runner = Runner(Config(interval=5.0, timeout=TIMEOUT), target.url, clock=lambda: 1000.0)
    with caplog.at_level(logging.DEBUG, logger="kvhit"):
        assert runner.poll(LiveSource(target.url, timeout=TIMEOUT, max_bytes=CAP)) is False
    assert runner.current()[1].errors == {"parse": 1}
    assert all(SECRET not in r.getMessage() for r in caplog.records)


def test_a_parse_failure_of_another_kind_is_logged_the_same_counts_again_are_not(caplog):
    # every failure here has the reason "parse": an empty body, then bodies of malformed lines
    # (3 of 4, then 4 of 5: the same failure with other counts), then an empty body again
    runner = Runner(Config(interval=5.0, timeout=TIMEOUT), "http://vllm:8000/metrics", clock=lambda: 1000.0)
    line = 'vllm:num_requests_running{{model_name="m",engine="{}"}} {}\n'
    bad = [line.format(0, 1)] + [line.format(e, "x") for e in range(1, 5)]
    bodies = ["", "".join(bad[:4]), "".join(bad), ""]
    with caplog.at_level(logging.WARNING, logger="kvhit"):
        for i, body in enumerate(bodies):
            assert runner.ingest_text(1000.0 + 5 * i, body) is False
    assert runner.current()[1].errors == {"parse": 4}
    assert [r.getMessage() for r in caplog.records] == [
        "scrape failed (parse): empty body: nothing to read (not even a comment line)",
        "scrape failed (parse): not Prometheus text exposition: 3 of 4 sample lines are malformed",
        "scrape failed (parse): empty body: nothing to read (not even a comment line)"]


def test_credentials_in_the_url_never_reach_labels_or_logs(target, caplog):
    url = target.url.replace("http://", "http://alice:s3cret@")
    runner = Runner(Config(interval=5.0, timeout=TIMEOUT), url, clock=lambda: 1000.0)
    target.mode = "http500"
    with caplog.at_level(logging.DEBUG, logger="kvhit"):
        runner.poll(LiveSource(url, timeout=TIMEOUT, max_bytes=CAP))
    _, health = runner.current()
    assert "s3cret" not in health.target and health.target.startswith("http://<redacted>@127.0.0.1:")
    assert all("s3cret" not in r.getMessage() for r in caplog.records)


# --- the 10-minute flap ----------------------------------------------------------------------


def test_a_slow_analysis_is_logged_again_within_the_rate_limit_only_when_over_twice_as_slow(snapshots, caplog,
                                                                                          monkeypatch):
    # the "falls behind" line is told at most once per 10 min of scrapes: a 1.5-s one hid a 170-s
    # stall after it (adversarial review). Within those 10 min, an analysis over twice the last one
    # told is told too. The analysis time is the runner's monotonic clock, scripted here per scrape.
    import types

    from exporter import runner as runner_module
    took = iter([0.0, 0.0,  # the first scrape (no step yet): not slow
                 0.0, 1.5, 0.0, 2.9, 0.0, 3.1, 0.0, 7.0, 0.0, 2.0, 0.0, 2.0])  # began, ended of each next one
    now = [0.0]

    def monotonic() -> float:
        now[0] += next(took, 0.0)
        return now[0]
    monkeypatch.setattr(runner_module, "time", types.SimpleNamespace(monotonic=monotonic, strftime=time.strftime,
                                                                    gmtime=time.gmtime))
    runner = Runner(Config(interval=1.0), "http://127.0.0.1:9/metrics", clock=lambda: 0.0)
    with caplog.at_level(logging.WARNING, logger="kvhit"):
        for i, t in enumerate((0.0, 1.0, 2.0, 3.0, 4.0, 5.0)):
            assert runner.ingest_text(1000.0 + t, snapshots[i], duration=0.01)
        # a scrape 10 min after the last line told is told whatever its time
        assert runner.ingest_text(1000.0 + 4.0 + 600.0, snapshots[6], duration=0.01)
    told = [r.getMessage().split(" s,")[0] for r in caplog.records if "falls behind" in r.getMessage()]
    # 1.5 told; 2.9 is under 2 x 1.5; 3.1 is over it; 7.0 over 2 x 3.1; 2.0 not (a minute later);
    # 2.0 again 10 min after 7.0 was told
    assert told == ["analysing a scrape took 1.5", "analysing a scrape took 3.1", "analysing a scrape took 7.0",
                    "analysing a scrape took 2.0"]


class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def exposition(runner: Runner) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvhitCollector(runner.current))
    out = {}
    for fam in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def per_model(expo: dict) -> list:
    return [k for k in expo if ("model_name", "tiny") in k[1]]


def value(expo: dict, name: str, **labels) -> float | None:
    for (n, ls), v in expo.items():
        if n == name and all(dict(ls).get(k) == val for k, val in labels.items()):
            return v
    return None


# The flap: 30 s up, 30 s down, for 600 s; each down phase uses the next failure kind.
DOWN_MODES = ["refused", "http500", "slow", "trickle", "http404", "oversize", "cut", "redirect_loop",
              "gzip_bomb", "brotli"]
REASON = dict(FAULTS, refused="refused")
UP_MODES = ["ok", "gzip", "redirect"]  # healthy answers in three shapes


# A poll counts only if this process ran through it: a pause of half the deadline or more (a starved
# 2-core box) can turn a healthy answer, or a 500, into a timeout that no target caused.
VOIDING_STALL = 0.5 * TIMEOUT


def test_ten_minute_flap_recovers_never_stale_errors_match(target):
    for _ in range(3):
        if _flap(target):
            return
    raise AssertionError("three runs voided by pauses of this process during a poll")


def _flap(target) -> bool:
    """One run of the test above: False when a poll came out otherwise than its mode says while
    this process was stopped VOIDING_STALL or longer (StallMeter): the run is void."""
    interval = 5.0
    cfg = Config(interval=interval, timeout=TIMEOUT, max_body_bytes=CAP)
    t0 = 2_000_000_000.0
    clock = FakeClock(t0)
    runner = Runner(cfg, target.url, clock=clock)
    src = LiveSource(target.url, timeout=TIMEOUT, max_bytes=CAP)
    expected_errors: dict[str, int] = {}
    last_ok: float | None = None
    listening = True
    consecutive_failures = costly_failures = 0
    recoveries = 0
    polls = successes = 0
    while clock.t < t0 + 600:
        phase = int((clock.t - t0) // 30)
        down = phase % 2 == 1
        mode = DOWN_MODES[(phase // 2) % len(DOWN_MODES)] if down else UP_MODES[(phase // 2) % len(UP_MODES)]
        if mode == "refused" and listening:
            target.stop()
            listening = False
        elif mode != "refused" and not listening:
            target.start()
            listening = True
        if mode != "refused":
            target.mode = mode
        before = runner.current()[1].errors
        with StallMeter() as stall:
            ok = runner.poll(src)
        counted = [r for r, n in runner.current()[1].errors.items() if n != before.get(r, 0)]
        want = [REASON[mode]] if down else []  # the reason counted (a healthy mode has none)
        if ok == down or counted != want:
            if stall.stalled >= VOIDING_STALL:
                print(f"{mode} came out {counted or 'ok'} after a {stall.stalled:.1f}-s pause: the run is void")
                if not listening:
                    target.start()
                return False
            assert ok == (not down), (clock.t - t0, mode)
            assert counted == want, (clock.t - t0, mode, counted)
        polls += 1
        if ok:
            if consecutive_failures:
                recoveries += 1
            consecutive_failures = costly_failures = 0
            last_ok = clock.t + src.answer_delay  # stamped when the answer began (the fake clock stood still)
            successes += 1
        else:
            consecutive_failures += 1
            costly_failures += mode != "refused"
            expected_errors[REASON[mode]] = expected_errors.get(REASON[mode], 0) + 1
        delay = runner.next_delay()
        # back-off: one interval after the first failure, then doubled per further one that cost
        # the target, at most 8 (5 min is more here); a refused connection costs it nothing: one interval
        assert delay == interval * (min(2 ** (costly_failures - 1), MAX_BACKOFF_FACTOR)
                                    if costly_failures and mode != "refused" else 1)
        # look at kvhit's /metrics every second until the next scrape (fake time)
        for dt in range(0, int(delay)):
            clock.t += 1.0 if dt else 0.0
            expo = exposition(runner)
            assert value(expo, "kvhit_up") == (1.0 if ok else 0.0), (clock.t - t0, mode, ok, dt, delay)
            age = None if last_ok is None else max(0.0, clock.t - last_ok)
            if age is not None:
                assert value(expo, "kvhit_data_age_seconds") == pytest.approx(age)
            if per_model(expo):
                # a per-model value is on show only while its scrape is at most 2 intervals + timeout old
                assert age is not None and age <= 2 * interval + TIMEOUT
            if age is not None and age > 2 * interval + TIMEOUT:
                assert per_model(expo) == []
            if successes >= 2 and (ok or consecutive_failures == 1):
                # one failed scrape never withdraws them: the retry is due within 2 intervals + timeout
                assert per_model(expo), (clock.t - t0, mode, dt)
            # stale as soon as the latest attempt failed (or nothing fresh for interval + timeout)
            want_stale = (not ok) or age is None or age > interval + TIMEOUT
            assert value(expo, "kvhit_stale") == (1.0 if want_stale else 0.0)
        clock.t += 1.0
    # every failure kind was served once per down phase, and counted exactly
    expo = exposition(runner)
    got = {dict(ls)["reason"]: v for (n, ls), v in expo.items() if n == "kvhit_scrape_errors_total"}
    assert {r: v for r, v in got.items() if v} == expected_errors
    assert set(expected_errors) == {REASON[m] for m in DOWN_MODES}
    # every down phase but the last (570–600 s, recovered below) ended in a recovery, no restart
    assert recoveries == 9
    # recovered: up, and per-model values back after two good scrapes
    if not listening:
        target.start()
    target.mode = "ok"
    for _ in range(2):
        clock.t += interval
        assert runner.poll(src)
    expo = exposition(runner)
    assert value(expo, "kvhit_up") == 1.0 and value(expo, "kvhit_stale") == 0.0
    assert value(expo, "kvhit_hit_ratio", source="device") is not None
    assert polls > 60
    return True


def test_system_clock_steps_change_no_stamp(target, monkeypatch):
    # kvhit stamps live scrapes with its steady clock: the wall clock read once at start, then
    # monotonic time. A wall clock stepped back an hour (NTP) or forward two (VM resume) must
    # neither reject a scrape as out of order nor open a gap or make the data look stale.
    import exporter.runner as runner_module
    wall = [2_000_000_000.0]
    monkeypatch.setattr(runner_module.time, "time", lambda: wall[0])
    runner = Runner(Config(interval=5.0, timeout=TIMEOUT), target.url)  # default: SteadyClock
    src = LiveSource(target.url, timeout=TIMEOUT, max_bytes=CAP)
    stamps = []
    for jump in (0.0, -3600.0, +7200.0):
        wall[0] += jump
        time.sleep(0.02)
        assert runner.poll(src)
        stamps.append(runner.analyzer.windows.last.timestamp)
    _, health = runner.current()
    assert health.errors == {}
    # stamps start at the wall clock of the start and advance by real (monotonic) time only
    assert stamps[0] >= 2_000_000_000.0 and all(0 < b - a < 5.0 for a, b in zip(stamps, stamps[1:]))
    assert 0 <= health.age < 5.0 and health.stale is False


def test_a_slow_target_within_the_timeout_never_looks_stale(snapshots):
    # vLLM answers every scrape in 2.8 s of fake time, under the 3-s timeout: every attempt succeeds,
    # so kvhit's values must stay fresh. A snapshot is stamped when its answer began (2.8 s after
    # the request) and attempts start 5 s apart (the interval), so a value is at most 5 s old when
    # the next scrape lands: below interval + timeout = 8 s (stale) and 2 × 5 = 10 s (per-model
    # values removed, /readyz 503). Waiting a full interval after each scrape instead spaced
    # attempts 7.8 s apart.
    from exporter.cli import poll_loop

    interval, answer = 5.0, 2.8
    clock = FakeClock(2_000_000_000.0)
    runner = Runner(Config(interval=interval, timeout=3.0), "http://vllm:8000/metrics", clock=clock)
    seen = []  # (age, stale, per-model series shown, ready) at every 0.1 s of fake time

    def look(seconds: float) -> None:
        for _ in range(round(seconds * 10)):
            clock.t += 0.1
            _, health = runner.current()
            if health.age is not None:
                seen.append((health.age, health.stale, bool(per_model(exposition(runner))), runner.ready()))

    class SlowSource:
        answer_delay = answer

        def __init__(self) -> None:
            self.i = 0

        def fetch(self) -> tuple[float, str]:
            look(answer)  # the previous values are on show while vLLM takes its time
            self.i += 1
            return clock.t, snapshots[self.i]

    class Stop:
        def __init__(self) -> None:
            self.waits = 0

        def is_set(self) -> bool:
            return self.waits >= 12

        def wait(self, seconds: float) -> bool:
            self.waits += 1
            look(seconds)
            return self.is_set()

    poll_loop(runner, SlowSource(), Stop(), clock=clock)
    assert runner.current()[1].up
    after_first = seen[round(answer * 10):]  # once the first scrape has landed and a step exists
    assert max(age for age, *_ in seen) == pytest.approx(interval, abs=0.11)
    assert not any(stale for _, stale, _, _ in after_first)
    assert all(ready for *_, ready in after_first)
    assert all(shown for _, _, shown, _ in seen[seen.index(next(s for s in seen if s[2])):])


def test_error_and_quirk_counters_exist_at_zero_before_the_first_one(snapshots):
    # A counter series born at its first error hides that error from rate() and increase() (the
    # dashboards' error panels): the kinds kvhit knows are exported at 0 before any scrape, and the
    # first timeout then moves its series 0 → 1.
    import re
    from pathlib import Path
    clock = FakeClock(2_000_000_000.0)
    runner = Runner(Config(), "http://vllm:8000/metrics", clock=clock)
    expo = exposition(runner)
    for reason in ("refused", "timeout", "parse", "out_of_order", "internal"):
        assert value(expo, "kvhit_scrape_errors_total", reason=reason) == 0.0
    for quirk in ("truncated", "non_finite", "negative", "duplicate_series"):
        assert value(expo, "kvhit_input_quirks_total", quirk=quirk) == 0.0
    assert value(expo, "kvhit_scrape_errors_total", reason="query_error") is None  # fleet mode only
    assert value(exposition(Runner(Config(), "http://prom:9090", scope="fleet", clock=clock)),
                 "kvhit_scrape_errors_total", reason="query_error", scope="fleet") == 0.0

    class Timeout:
        def fetch(self):
            raise ScrapeError("timeout", "no complete answer within 3s from vllm")
    runner.poll(Timeout())
    assert value(exposition(runner), "kvhit_scrape_errors_total", reason="timeout") == 1.0
    # every reason the code can count is among those exported from the start (http_<code> aside)
    from exporter import names
    src = "".join(p.read_text() for p in Path(names.__file__).parent.glob("*.py"))
    raised = set(re.findall(r'(?:ScrapeError|record_failure)\(\s*"([a-z_]+)"', src))
    assert raised and raised <= set(names.SCRAPE_ERROR_REASONS) | set(names.FLEET_ERROR_REASONS)


def test_one_failed_scrape_never_withdraws_the_series_while_its_retry_runs(target):
    """A Prometheus scrape of kvhit while the retry after a single blip is still running must find
    the per-model series (else every pending alert's for: restarts); two failures withdraw them."""
    interval = 5.0
    runner = Runner(Config(interval=interval, timeout=TIMEOUT, max_body_bytes=CAP), target.url,
                    clock=(clock := FakeClock(2_000_000_000.0)))
    src = LiveSource(target.url, timeout=TIMEOUT, max_bytes=CAP)
    for _ in range(2):
        assert runner.poll(src)
        clock.t += interval
    # the last success is stamped when its answer began: the fake clock's time plus the real
    # src.answer_delay (the target thread's, a starved machine's: 0.1 s of it was the margin below)
    last = runner.current()[1].last_success
    target.mode = "http500"
    assert not runner.poll(src)  # the blip, one interval after the last success
    clock.t += runner.next_delay()  # the retry starts two intervals after the last success …
    assert clock.t <= last + 2 * interval
    clock.t = last + 2 * interval + 0.9 * TIMEOUT  # … and is still running (a slow /metrics under load)
    assert per_model(exposition(runner))
    clock.t += 0.2 * TIMEOUT  # two intervals plus the timeout, and no success
    assert per_model(exposition(runner)) == []


def test_healthz_fails_only_when_the_scrape_loop_stops_making_progress(target):
    import requests as rq
    from exporter.runner import MAX_BACKOFF_FACTOR
    from exporter.server import serve
    interval = 5.0
    runner = Runner(Config(interval=interval, timeout=TIMEOUT, max_body_bytes=CAP), target.url,
                    clock=(clock := FakeClock(2_000_000_000.0)))
    server, _ = serve(runner, "127.0.0.1:0")
    url = f"http://127.0.0.1:{server.server_port}/healthz"
    try:
        assert rq.get(url, timeout=5).status_code == 200  # never polled (a replay): alive
        target.stop()  # a dead target is vLLM's problem, not a reason to restart kvhit
        assert not runner.poll(LiveSource(target.url, timeout=TIMEOUT, max_bytes=CAP))
        clock.t += MAX_BACKOFF_FACTOR * interval + TIMEOUT + 60.0  # the longest wait, then some
        assert rq.get(url, timeout=5).status_code == 200
        clock.t += 1.0  # no attempt finished for longer than any back-off: the loop is stuck
        r = rq.get(url, timeout=5)
        assert r.status_code == 503 and "restart kvhit" in r.text
    finally:
        server.shutdown()
        target.start()


def test_a_reader_never_sees_the_analysis_of_one_scrape_with_the_health_of_another(snapshots):
    # /metrics and /api/v1/analysis render (analysis, health) while the poll thread ingests: the
    # window's end (analysis.timestamp) must be the scrape kvhit_last_success_timestamp_seconds
    # names, or a dashboard pairs a window with the wrong scrape time. A tiny switch interval makes
    # the threads interleave inside ingest and current.
    import sys
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        clock = FakeClock(2_000_000_000.0)
        runner = Runner(Config(interval=5.0), "http://vllm:8000/metrics", clock=clock)
        done = threading.Event()

        def ingest() -> None:
            for i, text in enumerate(snapshots[:60]):
                clock.t = 2_000_000_000.0 + 5.0 * i
                assert runner.ingest_text(clock.t, text)
            done.set()

        thread = threading.Thread(target=ingest)
        thread.start()
        torn, reads = [], 0
        while not done.is_set():
            analysis, health = runner.current()
            reads += 1
            if analysis.timestamp is not None and analysis.timestamp != health.last_success:
                torn.append((analysis.timestamp, health.last_success))
        thread.join()
    finally:
        sys.setswitchinterval(old)
    assert reads > 100 and not torn, (reads, torn[:3])


def test_a_target_that_is_not_vllm_is_logged_once_and_when_it_becomes_vllm(snapshots, caplog):
    # kvhit_up is 1 for any exposition: the log must say the body cannot be analysed (once, not per
    # scrape), and say so again when it changes (a node-exporter-like body, then vLLM's)
    runner = Runner(Config(), "http://vllm:8000/metrics", clock=FakeClock(2_000_000_000.0))
    other = "# TYPE node_load1 gauge\nnode_load1 0.5\n"
    with caplog.at_level(logging.INFO, logger="kvhit"):
        for i in range(3):
            assert runner.ingest_text(2_000_000_000.0 + 5 * i, other)
        assert runner.ingest_text(2_000_000_015.0, snapshots[0])
    said = [r.getMessage() for r in caplog.records]
    assert said.count("the target answers but cannot be analysed: no vLLM metrics in the exposition") == 1, said
    assert "the target's body is analysable (engine vllm_v1)" in said, said


def test_the_last_success_timestamp_stays_on_the_wall_clock_after_it_steps(snapshots, monkeypatch):
    # kvhit's clock never steps (SteadyClock); Prometheus's time() does. An NTP step of +3600 s
    # after a scrape must not make time() - kvhit_last_success_timestamp_seconds read an hour:
    # the published stamp is the scrape's time on the wall clock as it reads now, so the
    # difference stays the data age.
    wall = [2_000_000_000.0]
    mono = [100.0]
    monkeypatch.setattr(time, "time", lambda: wall[0])
    monkeypatch.setattr(time, "monotonic", lambda: mono[0])
    runner = Runner(Config(interval=5.0), "http://vllm:8000/metrics")  # default: SteadyClock
    assert runner.ingest_text(runner.clock(), snapshots[0])  # the scrape at wall 2e9
    mono[0] += 2.0
    wall[0] += 2.0 + 3600.0  # 2 s later, and the wall clock stepped an hour ahead
    expo = exposition(runner)
    assert value(expo, "kvhit_data_age_seconds") == pytest.approx(2.0)
    assert value(expo, "kvhit_last_success_timestamp_seconds") == pytest.approx(2_000_000_000.0 + 3600.0)
    assert wall[0] - value(expo, "kvhit_last_success_timestamp_seconds") == pytest.approx(2.0)


def test_the_last_success_timestamp_holds_still_between_successes(snapshots, monkeypatch):
    # the two clocks read one after the other differ by microseconds each time: the published
    # stamp moved at every render while no scrape succeeded (changes() counted 86 in 4 minutes)
    wall, mono = [2_000_000_000.0], [100.0]
    monkeypatch.setattr(time, "time", lambda: wall[0])
    monkeypatch.setattr(time, "monotonic", lambda: mono[0])
    runner = Runner(Config(interval=5.0), "http://vllm:8000/metrics")  # default: SteadyClock
    assert runner.ingest_text(runner.clock(), snapshots[0])
    seen = set()
    for jitter in (3e-6, -2e-6, 5e-6, 0.0, -4e-6):
        mono[0] += 1.0
        wall[0] += 1.0 + jitter
        seen.add(value(exposition(runner), "kvhit_last_success_timestamp_seconds"))
    assert seen == {2_000_000_000.0}


def test_the_analysis_time_is_published_apart_from_the_scrape_and_logged_when_over_the_interval(snapshots,
                                                                                                 caplog):
    # A body that takes longer to analyse than to fetch: the parser is slowed by 0.3 s of real time
    # (a huge body), the fetch took 0.01 s. kvhit_scrape_duration_seconds is the fetch alone, the
    # analysis time covers the 0.3 s; over a 0.2-s interval it is logged once per 600 s of scrapes.
    clock = FakeClock(2_000_000_000.0)
    runner = Runner(Config(interval=0.2, timeout=0.1), "http://vllm:8000/metrics", clock=clock)
    parse = runner.parser.parse

    def slow_parse(text, t):
        time.sleep(0.3)
        return parse(text, t)

    runner.parser.parse = slow_parse
    assert value(exposition(runner), "kvhit_analysis_duration_seconds") is None  # nothing analysed yet
    with caplog.at_level(logging.WARNING, logger="kvhit"):
        for i in range(3):
            assert runner.ingest_text(clock.t + i, snapshots[i], duration=0.01)
    expo = exposition(runner)
    assert value(expo, "kvhit_scrape_duration_seconds") == 0.01
    assert 0.3 <= value(expo, "kvhit_analysis_duration_seconds") < 5.0
    slow = [r.getMessage() for r in caplog.records if "over the 0.2-s interval" in r.getMessage()]
    assert len(slow) == 1 and f"a body of {len(snapshots[0])} characters" in slow[0], slow
