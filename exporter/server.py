"""kvhit's HTTP endpoints (WSGI, served by a threading wsgiref server).

- ``/``: what is served where (a landing page, as Prometheus exporters have).
- ``/metrics``: Prometheus exposition via prometheus-client (content negotiation, gzip).
- ``/healthz``: 200 while the scrape loop makes progress (liveness; ``Runner.alive``), else 503.
- ``/readyz``: 200 when a successful scrape is at most two intervals plus the timeout old, else 503.
- ``/api/v1/analysis``: the analysis as JSON (schema in :mod:`exporter.jsonapi`).
- ``/api/v1/predict?hit_ratio=H[&isl=N&osl=N&steps_per_request=S&model_name=M]``: what-if from the current fit.

Security (``listen``, ``web_config``; :class:`exporter.config.WebConfig`): the bind address is
configurable (``0.0.0.0:9471`` is the pod's sidecar port; ``127.0.0.1:…`` or ``[::1]:…`` keep it
local; IPv6 addresses in brackets). With ``tls_server_config`` every connection is TLS (≥ 1.2),
the handshake done in the connection's own thread under a 30-s socket timeout, so a client that
never finishes it blocks nobody. With ``basic_auth_users`` every path but ``/healthz`` and
``/readyz`` (no data, for the kubelet's probes) needs HTTP basic auth, verified against
PBKDF2-HMAC-SHA256 hashes in constant time; a good credential is remembered (keyed by an HMAC
under a per-process key), so Prometheus' scrapes do not pay the PBKDF2 cost each time; every
refusal costs the most iterations any user's hash has (none names a user). At most
MAX_CONNECTIONS connections are served at once (one more closes the oldest still sending its
headers), each request's headers read within REQUEST_TIMEOUT of accept and in HEADER_BYTES; GET
and HEAD only.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import http.client
import json
import logging
import os
import socket
import ssl
import sys
import threading
from collections import OrderedDict
from argparse import ArgumentTypeError
from dataclasses import asdict, replace
from socketserver import ThreadingMixIn
from typing import Callable, Mapping
from urllib.parse import parse_qs, urlsplit
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import choose_encoder

from exporter.collector import ConfigErrorCollector, KvhitCollector
from exporter.config import WebConfig, listen_address, listening
from exporter.jsonapi import STEPS_PER_REQUEST, analysis_to_dict, load_fit, what_if
from exporter.runner import Runner
from exporter.sources import shut_socket

log = logging.getLogger("kvhit")
SERVER = "kvhit"  # the Server header of every answer
REQUEST_TIMEOUT = 30.0  # seconds a connection may stay silent (TLS handshake included)
# Bytes a request's headers may take (nginx's default buffers; the request line has its own 64 KiB,
# else 414). http.server alone allows 100 headers of 64 KiB each, read before basic auth: 40
# connections held 250 MB, past the sidecar's memory limit.
HEADER_BYTES = 32 * 1024
# Connections served at once (a thread each). Without a cap, 3000 idle clients (one header line
# every 15 s) held 300 MB, past the sidecar's memory limit (a breaker). A connection past it
# closes the oldest one still sending its headers, or, when every one is being answered, itself:
# 64 idle connections kept every probe out until the kubelet restarted kvhit (adversarial review).
MAX_CONNECTIONS = 64
EVICTED_SECONDS = 1.0  # at most this long for the closed connection's slot to free
UNAUTHENTICATED = ("/healthz", "/readyz")


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    request_queue_size = 128  # listen backlog (socketserver's 5 dropped SYNs at 30 concurrent clients)
    ssl_context: ssl.SSLContext | None = None

    def server_activate(self) -> None:
        super().server_activate()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._waiting: dict = {}  # the connections whose headers are not in yet, oldest first
        self._waiting_lock = threading.Lock()

    def process_request(self, request, client_address) -> None:
        if not (self._slots.acquire(blocking=False)
                or self._close_oldest_waiting() and self._slots.acquire(timeout=EVICTED_SECONDS)):
            self.shutdown_request(request)  # every slot's request is being answered: closed, no thread
            return
        with self._waiting_lock:
            self._waiting[request] = None
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.headers_in(request)
            self._slots.release()
            raise

    def headers_in(self, request) -> None:
        """``request``'s headers are in (or it is over): no longer the oldest to close."""
        with self._waiting_lock:
            self._waiting.pop(request, None)

    def _close_oldest_waiting(self) -> bool:
        """Shut the connection waiting longest for its headers (its thread then ends and frees its
        slot); False when none is waiting."""
        with self._waiting_lock:
            if not self._waiting:
                return False
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
        shut_socket(oldest)
        return True

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.headers_in(request)  # a failed TLS handshake ends it before the handler's finish
            self._slots.release()

    def get_request(self):
        sock, addr = super().get_request()
        sock.settimeout(REQUEST_TIMEOUT)
        if self.ssl_context is not None:  # handshake later, in the connection's thread
            sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def handle_error(self, request, client_address) -> None:
        # a client that hangs up, times out or does not speak TLS is not kvhit's error
        log.debug("HTTP connection from %s failed", client_address[0] if client_address else "?", exc_info=True)


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class _HeaderBudget:
    """The connection's reader, whose readline raises LineTooLong once the lines after the
    request line (the headers) pass HEADER_BYTES in all: parse_request then answers 431."""

    def __init__(self, rfile) -> None:
        self._rfile, self._left = rfile, None  # None: the request line is next

    def readline(self, limit: int = -1) -> bytes:
        line = self._rfile.readline(limit)
        self._left = HEADER_BYTES if self._left is None else self._left - len(line)
        if self._left < 0:
            raise http.client.LineTooLong(f"request headers over {HEADER_BYTES} bytes")
        return line

    def __getattr__(self, name: str):
        return getattr(self._rfile, name)


class _QuietHandler(WSGIRequestHandler):
    """wsgiref's handler, quiet, with the header budget, and a deadline from accept to the end
    of the headers (TLS handshake and request line included): past REQUEST_TIMEOUT the socket is
    shut, whatever trickles in; a byte a second within a line held a slot for good (review).
    Its own error answers (400, 431) say ``Server: kvhit`` too."""

    def version_string(self) -> str:
        return SERVER

    def setup(self) -> None:
        self._deadline = threading.Timer(REQUEST_TIMEOUT, self._cut)
        self._deadline.daemon = True
        self._deadline.start()
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()
        super().setup()
        self.rfile = _HeaderBudget(self.rfile)

    def _cut(self) -> None:
        shut_socket(self.request)

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self._deadline.cancel()  # the headers are in: the answer has the socket timeout alone
        self.server.headers_in(self.request)
        return ok

    def finish(self) -> None:
        self._deadline.cancel()
        super().finish()

    def get_environ(self) -> dict:
        env = super().get_environ()
        if isinstance(self.request, ssl.SSLSocket):
            env["HTTPS"] = "on"
            env["wsgi.url_scheme"] = "https"
        return env

    def log_message(self, format: str, *args) -> None:  # access logs are noise in a sidecar
        pass


def hash_password(password: str, iterations: int = 600_000, salt: str | None = None) -> str:
    """A ``basic_auth_users`` entry: ``pbkdf2_sha256$<iterations>$<salt>$<base64 hash>`` (Django's
    format; PBKDF2-HMAC-SHA256, 32-byte key, the salt used as its UTF-8 bytes)."""
    salt = salt or base64.b64encode(os.urandom(12)).decode().replace("+", "a").replace("/", "b").rstrip("=")
    key = hashlib.pbkdf2_hmac("sha256", password.encode(), salt.encode(), iterations)
    return f"pbkdf2_sha256${iterations}${salt}${base64.b64encode(key).decode()}"


def verify_password(password: str, hashed: str) -> bool:
    """Constant-time check of ``password`` against a :func:`hash_password` entry."""
    try:
        algorithm, iterations, salt, expected = hashed.split("$", 3)
        want = base64.b64decode(expected, validate=True)
        rounds = int(iterations)
    except (ValueError, binascii.Error):
        return False
    if algorithm != "pbkdf2_sha256" or rounds < 1:
        return False
    got = hashlib.pbkdf2_hmac("sha256", password.encode(), salt.encode(), rounds, dklen=len(want) or None)
    return hmac.compare_digest(got, want)


def with_basic_auth(app: Callable, users: Mapping[str, str], cache_size: int = 64) -> Callable:
    """WSGI middleware: HTTP basic auth on every path but /healthz and /readyz."""
    secret = os.urandom(32)
    good: OrderedDict[bytes, str] = OrderedDict()  # HMAC of an accepted header → user
    lock = threading.Lock()
    # every check costs the most iterations any user's hash has: an unknown user's (checked against
    # the decoy) and a known user's whose hash has fewer (padded), else a fast 401 named a user
    rounds = {user: int(hashed.split("$")[1]) for user, hashed in users.items()}
    decoy = users[max(rounds, key=rounds.get)]
    most = max(rounds.values())

    def check(header: str) -> bool:
        if header[:6].lower() != "basic ":  # the scheme is case-insensitive (RFC 9110 §11.1)
            return False
        tag = hmac.new(secret, header.encode(errors="replace"), hashlib.sha256).digest()
        with lock:
            if tag in good:
                good.move_to_end(tag)
                return True
        try:
            user, sep, password = base64.b64decode(header[6:].strip(), validate=True).decode().partition(":")
        except (ValueError, binascii.Error, UnicodeDecodeError):
            return False
        ok = verify_password(password, users.get(user, decoy)) and sep == ":" and user in users
        if most > rounds.get(user, most):
            hashlib.pbkdf2_hmac("sha256", b"", b"", most - rounds[user])
        if ok:
            with lock:
                good[tag] = user
                while len(good) > cache_size:
                    good.popitem(last=False)
        return ok

    def wrapped(environ: dict, start_response: Callable) -> list[bytes]:
        if environ.get("PATH_INFO", "/") in UNAUTHENTICATED or check(environ.get("HTTP_AUTHORIZATION", "")):
            return app(environ, start_response)
        body = b"kvhit: authentication required\n"
        start_response("401 Unauthorized", [("WWW-Authenticate", 'Basic realm="kvhit", charset="UTF-8"'),
                                            ("Content-Type", "text/plain; charset=utf-8"),
                                            ("Content-Length", str(len(body)))])
        return [body]

    return wrapped


def _json(start_response: Callable, status: str, body: dict) -> list[bytes]:
    data = json.dumps(body, indent=1).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
    return [data]


def _text(start_response: Callable, status: str, body: str, exc_info=None) -> list[bytes]:
    data = body.encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data)))],
                   exc_info)
    return [data]


_LANDING = """kvhit: prefix-cache hit-ratio analysis of vLLM (a pod, or a fleet through Prometheus)
/metrics           Prometheus exposition of the analysis
/healthz           liveness
/readyz            200 while the last successful scrape is fresh
/api/v1/analysis   the analysis as JSON
/api/v1/predict    ?hit_ratio=H[&isl=N&osl=N&steps_per_request=S&model_name=M]: what-if from the current fit
"""


def make_app(runner: Runner) -> Callable:
    """The WSGI application for one runner (a fresh registry holding kvhit's collector only)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvhitCollector(runner.current))
    metrics_app = _exposition(registry)

    def app(environ: dict, start_response: Callable) -> list[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return metrics_app(environ, start_response)
        if path == "/healthz":
            ok = runner.alive()
            return _text(start_response, "200 OK" if ok else "503 Service Unavailable",
                         "ok\n" if ok else "the scrape loop finished no attempt for too long: restart kvhit\n")
        if path == "/readyz":
            ok = runner.ready()
            return _text(start_response, "200 OK" if ok else "503 Service Unavailable",
                         "ready\n" if ok else "no fresh scrape of the target\n")
        if path == "/api/v1/analysis":
            analysis, health = runner.current()
            return _json(start_response, "200 OK", analysis_to_dict(analysis, health))
        if path == "/api/v1/predict":
            return _predict(runner, environ, start_response)
        return _text(start_response, "200 OK" if path == "/" else "404 Not Found", _LANDING)

    return app


def _exposition(registry: CollectorRegistry) -> Callable:
    """prometheus-client's /metrics application, with an Accept header it cannot read (a quoted
    version, ``version=abc``: a TypeError, a 500 and a traceback per request, a breaker's find)
    answered in the text format, and gzip left out when Accept-Encoding gives it q=0."""
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable) -> list[bytes]:
        drop = set()
        for coding in environ.get("HTTP_ACCEPT_ENCODING", "").lower().split(","):
            name, _, params = coding.partition(";")
            q = params.replace(" ", "").partition("q=")[2]
            if name.strip() == "gzip" and q and _number(q) == 0:
                drop.add("HTTP_ACCEPT_ENCODING")
        try:
            choose_encoder(environ.get("HTTP_ACCEPT", ""))
        except (TypeError, ValueError):
            drop.add("HTTP_ACCEPT")
        return metrics_app({k: v for k, v in environ.items() if k not in drop}, start_response)
    return app


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _http(app: Callable) -> Callable:
    """The outer layer of every kvhit application (auth included): GET and HEAD only (else 405
    with Allow); HEAD answered as GET without the body (its Content-Length kept); a request line
    in absolute form (``GET http://host/metrics``, RFC 9112 §3.2.2) read as its path."""
    def outer(environ: dict, respond: Callable) -> list[bytes]:
        # "Server: kvhit": wsgiref's default names the Python version (a scanner's finding), as does
        # its own 500 for an application that raised: kvhit answers that itself
        def start_response(status: str, headers: list, exc_info=None):
            return respond(status, [*headers, ("Server", SERVER)], exc_info)
        try:
            return dispatch(environ, start_response)
        except Exception:
            log.warning("answering %s failed", environ.get("PATH_INFO", "/")[:200], exc_info=True)
            return _text(start_response, "500 Internal Server Error", "kvhit: internal error (its log says which)\n",
                         sys.exc_info())

    def dispatch(environ: dict, start_response: Callable) -> list[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path.lower().startswith(("http://", "https://")):
            environ = {**environ, "PATH_INFO": urlsplit(path).path or "/"}
        method = environ.get("REQUEST_METHOD")
        if method == "GET":
            return app(environ, start_response)
        if method != "HEAD":
            body = b"kvhit: GET or HEAD only\n"
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD"), ("Content-Type", "text/plain; charset=utf-8"),
                                                      ("Content-Length", str(len(body)))])
            return [body]
        got: list = []  # a probe (curl -I): GET's status and headers, its Content-Length, no body
        body = b"".join(app({**environ, "REQUEST_METHOD": "GET"}, lambda *a: got.extend(a[:2])))
        start_response(got[0], [(k, v) for k, v in got[1] if k.lower() != "content-length"]
                       + [("Content-Length", str(len(body)))])
        return []
    return outer


PREDICT_PARAMETERS = ("hit_ratio", "isl", "osl", "steps_per_request", "model_name")


def _predict(runner: Runner, environ: dict, start_response: Callable) -> list[bytes]:
    """``/api/v1/predict``: 200 with the prediction, or 400 with ``{"error": one line}`` when
    a parameter is unknown or repeated, hit_ratio is missing, the current analysis has no model
    (or several and no model_name=), no usable fit, the arguments are out of range (:func:`exporter.jsonapi.what_if`) or the fit
    can tell neither the request's chip time (``FittedModel.unidentified``) nor its TTFT (either
    alone: 200, :meth:`FittedModel.predict`)."""
    given = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)  # isl= is an error, not unset
    q = {k: v[0] for k, v in given.items()}
    analysis, health = runner.current()
    try:
        # a misspelt or repeated parameter would silently answer another question
        unknown = sorted(set(given) - set(PREDICT_PARAMETERS))
        if unknown:
            raise ValueError(f"unknown parameter {unknown[0][:40]!r} (known: {', '.join(PREDICT_PARAMETERS)})")
        repeated = sorted(k for k, v in given.items() if len(v) > 1)
        if repeated:
            raise ValueError(f"parameter {repeated[0]!r} given {len(given[repeated[0]])} times")
        if "hit_ratio" not in q:
            raise ValueError("hit_ratio is required")
        name, fitted, m = load_fit(analysis_to_dict(analysis, health), q.get("model_name"),
                                   choose="the model_name= query parameter")
        isl, osl = q.get("isl", m.get("isl")), q.get("osl", m.get("osl"))
        if isl is None or osl is None:
            raise ValueError("isl and osl are required (no request has finished in the publish window)")
        if "steps_per_request" in q:
            try:
                fitted = replace(fitted, steps_per_request=STEPS_PER_REQUEST(q["steps_per_request"]))
            except ArgumentTypeError as exc:
                raise ValueError(f"steps_per_request {exc}") from None
        pred = fitted.predict(*what_if(q["hit_ratio"], isl, osl))
    except ValueError as exc:
        return _json(start_response, "400 Bad Request", {"error": str(exc)})
    return _json(start_response, "200 OK", {"model_name": name, "prediction": asdict(pred)})


def config_error_app(target: str = "") -> Callable:
    """The WSGI application of ``kvhit run --on-config-error=serve`` after its configuration was
    refused: /metrics has kvhit_build_info and kvhit_config_last_load_successful 0, /healthz 200
    (restarting cannot fix a configuration), every other path 503. What was refused stays in the
    log: a configuration may hold secrets, and /readyz answers without authentication.
    ``target``: kvhit_build_info's ``target`` label, redacted by the caller."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ConfigErrorCollector(target))
    metrics_app = _exposition(registry)

    def app(environ: dict, start_response: Callable) -> list[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return metrics_app(environ, start_response)
        if path == "/healthz":
            return _text(start_response, "200 OK", "ok (configuration refused: kvhit analyses nothing)\n")
        return _text(start_response, "503 Service Unavailable",
                     "kvhit analyses nothing: its configuration was refused (kvhit's log says why)\n")
    return app


def serve(runner: Runner, listen: str, web: WebConfig | None = None) -> tuple[WSGIServer, threading.Thread]:
    """:func:`serve_app` of the runner's application (:func:`make_app`)."""
    return serve_app(make_app(runner), listen, web)


def serve_app(app: Callable, listen: str, web: WebConfig | None = None) -> tuple[WSGIServer, threading.Thread]:
    """Start serving ``app`` on ``listen`` ("host:port", "[v6 address]:port") in a daemon thread, with TLS
    and basic auth when ``web`` says so; returns (server, thread).

    Raises:
        ConfigError: ``listen`` is not ADDR:PORT (port 0: any free one).
        OSError: the address cannot be bound (the message names ``listen``).
        ssl.SSLError: the certificate or key cannot be loaded (load_config checked them already).
    """
    web = web or WebConfig()
    host, port = listen_address(listen, "listen", any_port=True)  # 0: any free port (tests, benchmarks)
    host = host or "0.0.0.0"
    app = _http(with_basic_auth(app, web.users) if web.users else app)
    context = web.context() if web.tls else None  # before binding: a failure leaves no socket open
    server = listening(lambda: make_server(host, port, app, handler_class=_QuietHandler,
                                           server_class=_ThreadingServer6 if ":" in host else _ThreadingServer), listen)
    server.ssl_context = context
    thread = threading.Thread(target=server.serve_forever, name="kvhit-http", daemon=True)
    thread.start()
    return server, thread
