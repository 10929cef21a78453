"""Where exposition text comes from: a live ``/metrics`` scrape, a recorded trace, or a fleet's
signals read from the Prometheus HTTP API.

All yield ``(timestamp, text)`` pairs; parsing happens in :mod:`exporter.parse`.
A recorded trace is a directory (or a ``.tar.gz`` of one) of ``<unix_ms>.prom`` files, optionally
with ``phases.json`` (what a load driver did in each phase). Replay uses the file timestamps,
never the wall clock. :class:`PrometheusSource` (fleet mode) renders what it reads as a vLLM V1
exposition, so the rest of the pipeline runs unchanged.
"""
from __future__ import annotations

import http.client
import json
import logging
import math
import os
import posixpath
import re
import secrets
import socket
import stat
import sys
import tarfile
import threading
import time
import urllib.parse
import zlib
from collections import Counter, defaultdict
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import requests
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from requests.adapters import HTTPAdapter
from requests.auth import AuthBase
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import ProtocolError, ReadTimeoutError

from exporter import __version__
from exporter.config import METRICS_PATH_HINT, Config, read_bearer_token, redact_url

log = logging.getLogger("kvhit")

# Largest magnitude any stage reads as a value: parse drops a sample beyond it (out_of_range), and
# fleet mode never adds one to a running total. A glitched 1e200 counter would overflow every sum
# of squares downstream; 1e18 is an exabyte (a bytes counter at 10 GB/s gets there in 3 years).
MAX_VALUE = 1e18

DEFAULT_MAX_BYTES = Config.max_body_bytes
USER_AGENT = f"kvhit/{__version__}"  # what the target's access log (or a proxy, a simulator) sees
_EARLIEST_STAMP = 978307200.0  # 2001-01-01 [unix s]: an earlier stamp is a name in seconds read as ms
_LATEST_STAMP = 7258118400.0  # 2200-01-01 [unix s]: a later stamp is a name in µs (16 digits) read as ms
_PROM_FILE = re.compile(r"(?:^|/)(\d{10,})\.prom$")  # past 16 digits: refused (µs, ns), not skipped


def http_session() -> requests.Session:
    """A requests Session whose requests name kvhit and its version as their User-Agent."""
    s = requests.Session()
    s.headers["User-Agent"] = USER_AGENT
    return s


class ScrapeError(Exception):
    """A scrape failed; ``reason`` is a short label value for ``kvhit_scrape_errors_total``.

    The message names the URL (credentials removed) and the kind of failure, never the body.
    """

    def __init__(self, reason: str, message: str, costly: bool = True, unchanged: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        # False: the attempt cost the target nothing, so the next comes after an interval, not
        # backed off (nothing listened; a fleet poll found a pod not scraped yet: one small query)
        self.costly = costly
        # True: the source answered and holds nothing newer than the last snapshot yet (a fleet
        # poll between two of Prometheus' scrapes): no failure while no other is pending (Runner.poll)
        self.unchanged = unchanged


class _Authorization(AuthBase):
    """Sets the Authorization header. Passed as requests' ``auth``, it also keeps requests from
    replacing the header with a URL's user:password or a ~/.netrc entry."""

    def __init__(self, value: str) -> None:
        self.value = value

    def __call__(self, r: requests.PreparedRequest) -> requests.PreparedRequest:
        r.headers["Authorization"] = self.value
        return r


def shown(text: str) -> str:
    """``text`` for a log line: a character that is not printable (a NUL, an ESC, a newline that
    would start a forged line) as its escape, the rest as it is."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _error_type(body: bytes) -> str:
    """`` (Prometheus errorType X)`` of an HTTP API error answer, "" when it has none: the type
    only, as its ``error`` text may quote label values."""
    try:
        kind = json.loads(body).get("errorType")
    except (ValueError, AttributeError, RecursionError):
        return ""
    return f" (Prometheus errorType {kind})" if isinstance(kind, str) and kind.isidentifier() else ""


def caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    """Whether a ``kind`` error is somewhere in the chain urllib3 and requests wrap around a
    connection error (socket.gaierror: a host name that did not resolve; ConnectionRefusedError)."""
    seen, stack = set(), [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, kind):
            return True
        stack += [c for c in (e.__cause__, e.__context__, getattr(e, "reason", None), *getattr(e, "args", ()))
                  if isinstance(c, BaseException)]  # an SSLError's reason is a str
    return False


# time.monotonic() by which the request being sent in this context must have its status line and
# headers (LiveSource.read); None outside a read
_HEADERS_DEADLINE: ContextVar[float | None] = ContextVar("kvhit_headers_deadline", default=None)


class _Deadline:
    """Waits for the status line and headers under the read's deadline: requests' timeout bounds
    each socket read, so a target sending its headers a line at a time could hold a scrape for
    ever. A timer shuts the socket down at the deadline; the blocked read then fails."""

    def getresponse(self):
        deadline = _HEADERS_DEADLINE.get()
        if deadline is None or self.sock is None:
            return super().getresponse()
        timer = threading.Timer(max(0.0, deadline - time.monotonic()), shut_socket, (self.sock,))
        timer.daemon = True
        timer.start()
        try:
            return super().getresponse()
        finally:
            timer.cancel()


def shut_socket(sock: socket.socket) -> None:
    """Shut both directions of ``sock``: a read blocked on it returns at once (a timer's deadline,
    kvhit's server closing an idle connection)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed: the read is over


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = type("_DeadlineHTTPConnection", (_Deadline, HTTPConnection), {})


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = type("_DeadlineHTTPSConnection", (_Deadline, HTTPSConnection), {})


class _DeadlineAdapter(HTTPAdapter):
    """requests' adapter whose connections wait for headers under :data:`_HEADERS_DEADLINE`."""

    def init_poolmanager(self, *args, **kwargs) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}

    def proxy_manager_for(self, proxy, **kwargs):
        manager = super().proxy_manager_for(proxy, **kwargs)
        manager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}
        return manager


@dataclass
class LiveSource:
    """Scrapes a vLLM ``/metrics`` URL with requests.

    Failure kinds (the ``reason`` of :class:`ScrapeError`): ``refused`` (no connection: refused,
    name not resolved), ``no_answer`` (the connection was accepted, then closed or reset before
    an HTTP status line: not an HTTP server on that port, e.g. a TLS one, or a proxy without an
    upstream, or a server dying on the request; tried twice, the second time on a new
    connection, within the deadline), ``timeout`` (the whole scrape — connect, headers
    and body — did not finish within ``timeout``; a status line, headers or body trickling in a
    few bytes at a time counts: a timer shuts the socket down at the deadline while headers are
    awaited, and the body's deadline is checked after every socket read, each waiting at most
    the time left; a redirect's body too), ``http_<status>`` (any status but 200 after
    redirects), ``redirect`` (more than ``max_redirects``, or one kvhit cannot follow; every failure after a
    redirect names where it led), ``too_large`` (over ``max_bytes``, by Content-Length before reading or
    while reading, counted after gzip decoding so a gzip bomb is cut at the cap; or headers over
    http.client's limits: more than 100 lines, a line over 64 KiB), ``encoding``
    (a Content-Encoding other than gzip/deflate/identity, or a corrupt one), ``incomplete``
    (the connection broke inside the body), ``error`` (anything else).

    Args:
        url: the full /metrics URL (e.g. http://localhost:8000/metrics).
        timeout: deadline of one scrape [s].
        max_bytes: body-size cap [bytes] (after gzip decoding); larger bodies are an error.
        max_redirects: redirects followed (a 302 to the real path is fine).

    ``answer_delay`` [s]: how long after its request the last successful scrape's answer began
    (its headers): the body is generated then, so the runner stamps the snapshot there — an
    engine that stalled (SIGSTOP, a long GC pause) and answered late was stamped at the request,
    and the step after it had its increases over almost no time.
    """

    url: str
    timeout: float = 3.0
    max_bytes: int = DEFAULT_MAX_BYTES
    max_redirects: int = 5
    what: str = "vLLM"  # what serves ``url``, named where a refused connection is explained
    answer_delay: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self._session = http_session()
        for prefix in ("http://", "https://"):
            self._session.mount(prefix, _DeadlineAdapter())
        self._session.headers["Accept"] = "text/plain;version=0.0.4"
        self._session.headers["Accept-Encoding"] = "gzip"
        self._session.max_redirects = self.max_redirects
        self._session.hooks["response"].append(self._redirect_body)
        self._where = redact_url(self.url)
        self._at = _Where(self._where)  # the current request's, with where its redirects led

    def fetch(self) -> tuple[float, str]:
        """One scrape → (unix time its answer began: the request's + ``answer_delay``, body text;
        bytes that are not UTF-8 become U+FFFD).

        Raises:
            ScrapeError: reason as in the class docstring.
        """
        start = time.time()
        body = self.read()
        return start + self.answer_delay, body.decode("utf-8", errors="replace")

    def read(self, form: Mapping[str, str] | None = None, headers: Mapping[str, str] | None = None,
             authorization: str | None = None, deadline: float | None = None) -> bytes:
        """The body of one GET of ``url``, or of one POST of the ``form`` fields (the Prometheus
        query API), with ``headers`` added to the session's and ``authorization`` as the
        Authorization header (None: the URL's user:password, if any), under the deadline and size
        cap of the class docstring; ``deadline`` [time.monotonic()]: an earlier one shared with
        other reads (fleet mode's queries of one poll), None: the timeout from now.

        Raises:
            ScrapeError: reason as in the class docstring.
        """
        start = time.monotonic()
        deadline = start + self.timeout if deadline is None else deadline
        auth = None if authorization is None else _Authorization(authorization)
        token = _HEADERS_DEADLINE.set(deadline)
        try:
            try:
                body, answered = self._request(form, headers, auth, deadline)
            except ScrapeError as exc:
                if exc.reason != "no_answer" or time.monotonic() >= deadline:
                    raise
                # a kept-alive connection the target closed as the request went out (vLLM's
                # keep-alive timeout is 5 s, kvhit's interval too): once more on a new connection,
                # as Go's HTTP client, Prometheus' scraper, does
                body, answered = self._request(form, headers, auth, deadline)
            self.answer_delay = answered - start
            return body
        except ScrapeError as exc:
            if exc.reason in ("no_answer", "incomplete", "error") and time.monotonic() >= deadline:
                # the deadline's timer shut the socket (_Deadline): the read failed because it timed out
                raise ScrapeError("timeout", f"no complete answer within {self.timeout}s from {self._at}") from None
            raise
        finally:
            _HEADERS_DEADLINE.reset(token)

    def _request(self, form: Mapping[str, str] | None, headers: Mapping[str, str] | None, auth: AuthBase | None,
                 deadline: float) -> tuple[bytes, float]:
        """:meth:`read`'s request → (body, time.monotonic() when its headers had arrived), every
        failure a ScrapeError."""
        where = self._at = _Where(self._where)
        try:
            left = max(deadline - time.monotonic(), 0.001)  # a retry has less than the whole timeout
            if form is None:
                resp = self._session.get(self.url, timeout=left, stream=True, allow_redirects=True,
                                         headers=headers, auth=auth)
            else:
                # not followed: requests re-sends a POST redirected by 301/302/303 as a GET without
                # its query, which Prometheus refuses as a bad query (an http→https ingress does it)
                resp = self._session.post(self.url, data=form, timeout=left, stream=True, auth=auth,
                                          allow_redirects=False, headers={"Accept": "application/json", **(headers or {})})
            answered = time.monotonic()
            with resp:
                if form is not None and resp.is_redirect:
                    to = redact_url(urllib.parse.urljoin(self.url, resp.headers["Location"]))
                    api = "/api/v1/query"  # what PrometheusSource adds to the base URL, the only POST
                    hint = (f"use {to[:-len(api)]} as the {self.what} URL" if to.endswith(api) else
                            f"a proxy or a login page in front of {self.what}?")
                    raise ScrapeError("redirect", f"{where.url} redirects the query (HTTP {resp.status_code}) to {to}: "
                                                  f"{hint}")
                if resp.status_code != 200:
                    kind = ""
                    if form is not None:  # Prometheus' API answers a query it refuses with 400/422/503 and a type
                        try:
                            kind = _error_type(self._read(resp, deadline))
                        except ScrapeError:
                            pass
                    # where the request ended: a redirect from / to a /metrics that 404s needs no such hint (review)
                    if form is None and resp.status_code == 404 and urllib.parse.urlsplit(resp.url).path == "/":
                        kind = f": {METRICS_PATH_HINT}"  # the hint a URL without a path gets
                    raise ScrapeError(f"http_{resp.status_code}", f"HTTP {resp.status_code} from {where}{kind}")
                body = self._read(resp, deadline)
        except ScrapeError:
            raise
        except requests.TooManyRedirects:
            raise ScrapeError("redirect", f"more than {self.max_redirects} redirects from {where}") from None
        except requests.ConnectionError as exc:
            # ConnectTimeout is a ConnectionError, and a read timeout while streaming the body
            # surfaces as ConnectionError(urllib3 ReadTimeoutError): both are timeouts.
            timed_out = isinstance(exc, requests.Timeout) or any(isinstance(a, ReadTimeoutError) for a in exc.args)
            if timed_out:
                raise ScrapeError("timeout", f"no complete answer within {self.timeout}s from {where}") from None
            # urllib3 wraps a connection that was made and then lost in ProtocolError; a refused
            # or unresolvable one in MaxRetryError(NewConnectionError)
            if any(isinstance(a, ProtocolError) for a in exc.args):
                if "got more than" in str(exc):  # http.client's words for its header limits (LineTooLong too)
                    raise ScrapeError("too_large", f"{where} answered with headers over http.client's limits (100 "
                                                   "lines, 64 KiB a line): not a /metrics answer") from None
                raise ScrapeError("no_answer", f"{where} accepted the connection and closed it without an HTTP "
                                               "answer") from None
            # first: a proxy's own failure wraps a refused connection or an unresolved name, its own
            if isinstance(exc, requests.exceptions.ProxyError):
                raise ScrapeError("refused", f"cannot reach {where} through the proxy (HTTP_PROXY / HTTPS_PROXY; "
                                             "NO_PROXY bypasses it)") from None
            if isinstance(exc, requests.exceptions.SSLError):
                raise ScrapeError("refused", f"TLS with {where} failed: not a TLS server on that port, or a certificate "
                                             "this pod does not trust (REQUESTS_CA_BUNDLE)") from None
            if caused_by(exc, socket.gaierror):
                raise ScrapeError("refused", f"cannot resolve the host of {where} (DNS): a typo in the target, or a "
                                             "name this pod cannot resolve") from None
            if caused_by(exc, ConnectionRefusedError):
                raise ScrapeError("refused", f"connection to {where} refused: nothing listens on that port ({self.what} "
                                             "not started yet or restarting, or a wrong port)", costly=False) from None
            raise ScrapeError("refused", f"cannot reach {where}: {type(exc).__name__}") from None
        except (requests.Timeout, ReadTimeoutError, TimeoutError):
            raise ScrapeError("timeout", f"no complete answer within {self.timeout}s from {where}") from None
        except (ProtocolError, http.client.HTTPException, ConnectionError, requests.exceptions.ChunkedEncodingError):
            raise ScrapeError("incomplete", f"connection to {where} broke inside the body") from None
        except (requests.RequestException, OSError, ValueError) as exc:
            # a redirect requests cannot follow: another scheme, a bad port, a Location that is no URL
            if where.to and isinstance(exc, (requests.exceptions.InvalidSchema, requests.exceptions.InvalidURL,
                                             ValueError)):
                raise ScrapeError("redirect", f"{where}: kvhit cannot follow it ({type(exc).__name__})") from None
            raise ScrapeError("error", f"scrape of {where} failed: {type(exc).__name__}") from None
        return body, answered

    def _redirect_body(self, resp: requests.Response, **_) -> requests.Response:
        """Response hook: a redirect's body is read as a scrape's is, under the read's deadline and
        size cap, then requests follows the redirect on the same connection. requests read it whole
        itself, each socket read under the per-read timeout alone: a body trickling in held a 1-s
        scrape for 4 s (dropping it unread instead cost a new connection, a TLS handshake, per scrape)."""
        deadline = _HEADERS_DEADLINE.get()
        if resp.is_redirect and deadline is not None:
            # requests' own fields; the body is discarded, so it is read as sent, never decoded
            resp._content, resp._content_consumed = self._read(resp, deadline, decode=False), True
        location = resp.headers.get("Location", "") if resp.is_redirect else ""
        if location and resp.request.method == "GET":  # requests follows it next: failures are where it leads
            try:
                # the server's bytes go into a log line: a NUL or an ESC there is shown, not written
                self._at.to = shown(redact_url(urllib.parse.urljoin(resp.url, location)))
            except ValueError:  # requests refuses it next (ValueError: _request)
                self._at.to = "a Location that is no URL"
        return resp

    def _read(self, resp: requests.Response, deadline: float, decode: bool = True) -> bytes:
        """The body, read socket-read by socket-read against the deadline and the size cap, decoded
        per its Content-Encoding unless ``decode`` is False (the bytes as sent)."""
        where = self._at
        length = resp.headers.get("Content-Length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            raise ScrapeError("too_large", f"Content-Length {length} over {self.max_bytes} bytes from {where}")
        encoding = resp.headers.get("Content-Encoding", "identity").strip().lower() if decode else ""
        if encoding in ("", "identity"):
            decoder = None
        elif encoding in ("gzip", "x-gzip", "deflate"):
            decoder = zlib.decompressobj(47)  # 32 + 15: gzip or zlib header, detected
        else:
            raise ScrapeError("encoding", f"unsupported Content-Encoding {encoding[:20]!r} from {where}")
        raw = resp.raw
        sock = getattr(getattr(raw, "_connection", None), "sock", None)
        out = bytearray()
        received = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ScrapeError("timeout", f"body not complete within {self.timeout}s from {where}")
            if sock is not None:
                try:
                    sock.settimeout(left)
                except OSError:
                    sock = None
            chunk = raw.read1(65536, decode_content=False)
            if not chunk:
                break
            received += len(chunk)
            if received > self.max_bytes:
                raise ScrapeError("too_large", f"body over {self.max_bytes} bytes from {where}")
            if decoder is None:
                out += chunk
            while decoder is not None:
                try:
                    out += decoder.decompress(chunk, self.max_bytes + 1 - len(out))
                except zlib.error:
                    raise ScrapeError("encoding", f"corrupt {encoding} body from {where}") from None
                if decoder.unconsumed_tail:
                    raise ScrapeError("too_large", f"body over {self.max_bytes} bytes after {encoding} "
                                                   f"decoding from {where}")
                if not (decoder.eof and decoder.unused_data):
                    break
                if encoding == "deflate":
                    raise ScrapeError("encoding", f"data after the end of the deflate body from {where}")
                # a gzip body may be several members (RFC 1952 §2.2), read on as Prometheus' reader
                # does (the first alone lost every family after it); data that is no member is corrupt
                chunk, decoder = decoder.unused_data, zlib.decompressobj(31)
            if len(out) > self.max_bytes:
                raise ScrapeError("too_large", f"body over {self.max_bytes} bytes from {where}")
        if decoder is not None:
            if not decoder.eof:
                raise ScrapeError("incomplete", f"{encoding} body from {where} ends before its end marker")
            out += decoder.flush()
        return bytes(out)


@dataclass(frozen=True)
class Family:
    """A vLLM metric family fleet mode reads from Prometheus.

    Attributes:
        name: exposed name without the ``vllm:`` prefix, ``_total`` and the histogram suffixes,
            e.g. "prefix_cache_queries", "iteration_tokens_total", "num_requests_running".
        kind: "counter", "histogram", "gauge" or "info".
        labels: labels kept besides ``model_name`` (counter, gauge: the label of ``match``;
            info: the labels kvhit reads from it).
        match: (label, value) every series read must carry, e.g. ("source", "local_compute").
        agg: how a gauge combines over pods, "sum" or "max" (counters and histograms add up).
        lazy: the engine creates the series at its first use (vLLM's kv_offload_load_*, at an
            engine's first load): a pod without it counted 0, so its sum is whole over fewer pods.
        fallback: a gauge of the same signal that a pod without this one exports in its place (an
            older vLLM: num_requests_waiting before num_requests_waiting_by_reason{reason="capacity"},
            gpu_cache_usage_perc before kv_cache_usage_perc), taken per pod, for the models some pod
            exports this one of.
    """

    name: str
    kind: str
    labels: tuple[str, ...] = ()
    match: tuple[str, str] | None = None
    agg: str = "sum"
    lazy: bool = False
    fallback: str | None = None


_QUERY_LABEL = "kvhit_query"  # tags each subquery's rows in the one combined query
_PRICED_BY = "generation_tokens"  # the family whose pods a fleet's cost prices (PrometheusSource.counts["instances"])
_PREFIX = "vllm[:_]"  # every spelling parse reads (exporter/parse.py), as a regex
LOOKBACK_SECONDS = 300  # how far back a growth's end finds a pod's last sample (Prometheus' default lookback)
LOOKBACK = f"{LOOKBACK_SECONDS // 60}m"
DOWN_WAIT_SECONDS = 60.0  # how long polls wait for pods Prometheus cannot scrape before leaving them out
# A pod's latest sample younger than this, yet no newer than the last poll's range: Prometheus has not
# scraped it again yet (its scrape interval, ≤ 60 s in common setups, above kvhit's --interval)
FRESH_SAMPLE_SECONDS = 60.0
TOTALS_TTL_SECONDS = 3600.0  # fleet mode forgets a running total no answer held for an hour
# How far a pod's clock (its _created stamps) may be from Prometheus' (its sample times) for a new
# pod's whole value to be counted only once (PrometheusSource.fetch)
CREATED_SKEW_SECONDS = 60.0
_FLEET_HELP = "Over the selected pods, read from Prometheus by kvhit fleet mode."  # no unit words: parse reads HELP
_CONNECTOR = "l:"  # the query of each model's pods with LMCache's metrics, rendered as the family below
_AGE = "age:"  # the queries of each counter family's oldest last sample at the range's end (fetch)
_CONNECTOR_FAMILY = "lmcache:kvhit_fleet_pods"  # parse: an LMCache family naming the model (parse._connector)


class PrometheusSource:
    """Fleet mode: the signals kvhit reads from one pod (MODEL.md §2), for every pod a PromQL
    selector picks, summed per ``model_name``, from the Prometheus HTTP API (Thanos and Mimir serve
    the same API).

    Each :meth:`fetch` is one instant query (POST ``/api/v1/query``) evaluated at t (the pods'
    oldest latest sample, at most now − ``delay``: below), after the small query that finds it:
    one subquery per family, tagged with a ``kvhit_query`` label and joined by ``or``, so every
    family is read at the same t in one request. With d = t − (the previous fetch's t), or
    ``interval`` at the first fetch:

    * counters: ``sum by (model_name[, label]) (growth)`` where a series' growth is the
      difference of its last samples at or before t and t − d, or across a restart (a
      difference below 0) its growth before the restart plus its value since (:func:`_growth`;
      a restart it reads wrong, or a glitched sample, leaves the sum out: :meth:`_coverage`);
      histograms: the same of ``_bucket`` (``by le`` too) and ``_sum`` (``_count`` is the
      ``+Inf`` bucket). Anchored on
      samples, consecutive fetches tile every pod's samples exactly, nothing extrapolated: a
      Prometheus restart between two of a pod's samples (the growth across it, which
      ``increase()`` over ranges lost: it sees only the samples inside its range) is in the next
      difference. Each growth is added to a running total per series, rendered as a cumulative
      counter, which parse → window turn back into the same growths; the totals never go down.
      t is the oldest of the pods' latest counter samples (:meth:`_latest`), so the snapshot is
      stamped where the data ends; with no sample of some pod since the last fetch's t, the fetch
      fails ``catching_up`` (Prometheus has not scraped since it came back; a pod gone while
      Prometheus was down keeps its last sample for its 5-min lookback), ``unchanged`` (nothing new
      yet, no failure: Runner.poll) while that sample is under FRESH_SAMPLE_SECONDS old. A failed fetch does not
      move t: the next difference covers the gap. A pod new since the last fetch adds its whole
      value (a counter starts from 0) when its ``_created`` is after both the first fetch and the
      last fetch's t − 5 min + CREATED_SKEW_SECONDS (the pod's clock against Prometheus'; then
      none of its samples was counted, and none of its growth came before kvhit's baseline), and
      Prometheus still has counter samples of the selected pods within 5 min before the last
      fetch's t (it did not lose its history: a restart on empty storage, a fresh replica);
      without ``_created`` (Prometheus' created-timestamp-zero-ingestion drops it) it adds
      nothing until its second fetch. A series spelled both vllm: and vllm_ is read as vllm:
      (:func:`_preferred`).
      Each sum comes with the count of pods in it (:func:`_pods`; of ``_count`` for histograms):
      a sum over fewer pods than the model's best-covered family is left out (:meth:`_coverage`),
      as is one a pod still scraped no longer has in its latest scrape at either end, its growth
      read 0 there (:meth:`_unscraped`).
    * gauges, the value at t after ``max without (pid)`` (vLLM 0.9.2–0.11.0 repeats a gauge per
      API-server process: one value, never a sum), then combined over pods as MODEL.md §2
      combines data-parallel engines (``Family.agg``, parse's aggregation): summed for requests
      running and waiting (the fleet's requests in flight and queued add up, consistent with the
      summed step counts the fits see), the max for KV-cache usage and the other per-pool values
      (a fraction of one pod's pool does not add up, and an average would hide the full pool, the
      one that evicts).
    * ``cache_config_info``: per model, the set of labels kvhit reads that most of its pods report
      (vLLM's has no ``model_name``: each pod's row is joined to the models of its counters,
      ``pm:``, by ``job`` and ``instance``), rendered with the model's ``model_name``.

    A sample that is no value (NaN, ±Inf, beyond MAX_VALUE) or, for a counter or bucket, no
    increase (below 0) is rendered as it came and never added to a total (a total would keep it
    forever): parse counts and drops it (``non_finite``, ``out_of_range``, ``negative``) as in a
    pod's body, and the series is unknown for that fetch. A family Prometheus has no series for
    this fetch (never exported, or no pod with a sample at both ends) is absent from the text —
    unknown, never 0. A step's growth is its pods' growth between their samples, which lag t by
    up to one scrape interval: ``interval`` should be at least twice Prometheus's scrape interval
    of vLLM, so that a step's time is mostly the samples'. HELP texts are not carried (vLLM
    0.7–0.8's ``gpu_prefix_cache_*``, whose unit only the HELP text tells, then read as unit
    unknown).

    Args:
        url: base URL of the Prometheus API (``http://prometheus:9090``; Mimir: ``…/prometheus``).
        families: what to read (see :func:`exporter.cli.fleet_families`).
        matchers: PromQL label matchers merged into every family's selector, e.g.
            ``('namespace="llm"',)`` (:func:`exporter.config.selector_matchers`).
        interval: seconds of the first range [s].
        delay: seconds t lags behind now, for stores whose samples arrive late (remote write) [s].
        timeout, max_bytes: deadline [s] and body cap [bytes] of one query, as :class:`LiveSource`.
        headers: HTTP headers sent with every query (``X-Scope-OrgID`` for a Mimir tenant); an
            ``Authorization`` among them is sent as given (never a URL's user:password instead).
        bearer_token_file: a file whose token (:func:`read_bearer_token`) is sent as
            ``Authorization: Bearer``, read at every fetch (Kubernetes rotates projected
            service-account tokens).
        clock: unix time now [s].
    Errors (:class:`ScrapeError` reasons): ``credentials`` (the token file cannot be read, or
    holds no token: no query is sent); those of :class:`LiveSource` (``refused``, ``timeout``,
    ``http_<status>`` — Prometheus answers a bad query with 400/422 —, ``too_large``, …;
    ``redirect`` for any redirect, never followed: a POST redirected by 301-303 loses its query);
    ``query_error`` (a 200 answer with ``"status": "error"``; the message gives its
    ``errorType`` only, as its text may quote label values); ``bad_response`` (not JSON, or not
    an instant vector of ``[time, "value"]`` samples); ``catching_up`` (no sample of some pod since
    the last range: above; some pod's last sample at t FRESH_SAMPLE_SECONDS or more before t, whose
    next sample would bring the growth of all that time into the next step however short: the
    range waits for it; or a pod Prometheus cannot scrape now, ``up == 0``, for less than
    DOWN_WAIT_SECONDS, and the polls wait at most that long in a row, whichever pods they wait for,
    and only while the last range's end is at most ``interval`` plus the timeout old (a wait past it
    would see the analysis withdrawn before the next poll): then they go on without the pods still
    down until they are back; such a wait is ScrapeError.unchanged, no failure after a success, as
    the data held back is Prometheus' answer, not a lost one).
    """

    # a fleet snapshot is the query's time t, however late the answer: t − (the clock at the
    # query) ≤ 0, the last range's end behind the clock, the delay included (LiveSource's
    # answer_delay; the runner adds it to its stamp); lag: t − that less the delay, how far the
    # pods' samples end before the time asked for [s] (Runner.poll)
    answer_delay = 0.0
    lag = 0.0

    def __init__(self, url: str, families: Sequence[Family], matchers: Sequence[str] = (), interval: float = 5.0,
                 delay: float = 0.0, timeout: float = 3.0, max_bytes: int = DEFAULT_MAX_BYTES,
                 headers: Mapping[str, str] | None = None, bearer_token_file: str | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.families = tuple(families)
        self._headers = {k: v for k, v in (headers or {}).items() if k.lower() != "authorization"}
        self._authorization = next((v for k, v in (headers or {}).items() if k.lower() == "authorization"), None)
        self._token_file = bearer_token_file
        self.matchers = tuple(matchers)
        self.interval, self.delay, self.clock = interval, delay, clock
        self._http = LiveSource(url.rstrip("/") + "/api/v1/query", timeout=timeout, max_bytes=max_bytes,
                                what="Prometheus")
        self._where = redact_url(self._http.url)
        self._end: float | None = None  # t of the last successful fetch
        self._baseline: float | None = None  # t of the first successful fetch, or of the last that found
        # Prometheus' history lost (no pod created before it is counted whole)
        self._totals: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}  # (query id, labels) → total
        self._seen: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}  # the same → t it was last in an answer
        self._now = 0.0  # t of the answer being rendered (_render), what _add stamps a total with
        self._partial: set[tuple[str, str]] = set()  # (family, model) left out of the last fetch (_coverage)
        self._glitched: set[tuple[str, str]] = set()  # (family, model) with a glitched sample in the last fetch
        # (histogram, model) → (its +Inf bucket's total key, the edges its totals leave out: _ban_edges)
        self._banned: dict[tuple[str, str], tuple[tuple, set[str]]] = {}
        self._warned: set[str] = set()  # _latest's checks that found something at the last poll (_warn_on_change)
        self._down_since: dict[tuple[str, str], float] = {}  # (job, instance) down (up == 0) → t first seen so …
        self._left_out: dict[tuple[str, str], float] = {}  # … and those polls went on without → t last left out
        self._leaving_out = False  # the last poll went on without some pod (its return is logged)
        # the pods the next range leaves out → when a poll first saw each up again (inf: down at the last one)
        self._out: dict[tuple[str, str], float] = {}
        # pods waited for (down at a poll that waited), up again → when a poll first saw them up: a range
        # ending before then may end before their first sample back
        self._returning: dict[tuple[str, str], float] = {}
        self._gone: set[tuple[str, str]] = set()  # pods with counters in the lookback and no up at the last poll
        self._gone_at: float | None = None  # now at that poll
        self._waiting_since: float | None = None  # now at the first of the polls waiting in a row for down pods
        # what the last answer told of each model (model → count): "engines", pods × data-parallel
        # engines; "instances", pods (Prometheus targets) in its output tokens; "busy", pods × engines
        # running requests throughout the range; "active", at some sample of it
        self.counts: dict[str, dict[str, int]] = {}
        self._counters = tuple(f for f in self.families if f.kind == "counter")  # _latest's and e:'s families
        self._running = next((f for f in self.families if f.name == "num_requests_running"), None)  # busy:'s

    def fetch(self) -> tuple[float, str]:
        """One query → (t [unix s], vLLM V1 exposition of the fleet's totals and gauges at t).

        Raises:
            ScrapeError: reason as in the class docstring.
        """
        # Never past the wall clock: after it stepped back, a steady clock ahead of it would ask
        # Prometheus about the future (empty ranges) until kvhit restarts.
        now = min(self.clock(), time.time()) - self.delay
        deadline = time.monotonic() + self._http.timeout  # one for the poll's two queries
        latest, history, down, gone, seen = self._latest(now, deadline)
        # (kept across failed polls: a pod seen down or back by one must not be forgotten by the next)
        returned = dict.fromkeys(self._down_since.keys() - down - self._out.keys(), now)
        self._returning = {pod: since for pod, since in (returned | self._returning).items() if pod not in down}
        # a pod back in service discovery had no up while gone, so it was never seen down: each end of its
        # growth is its last real sample, at the range's start the last before it left, and its traffic
        # while gone would land in one step (a breaker: 1600 queries in a 3-s step). It is out as a pod
        # back from a time down is (below), from this poll on, whatever an earlier verdict said (one left
        # out while down, then gone: review); one that left the set past the lookback has no up: not back.
        back_in_sd = self._gone & seen
        if back_in_sd:
            log.info("fleet mode: %d pod(s) back in service discovery count from the first range that starts once "
                     "they are seen back (their growth while gone is in no step) (%s)", len(back_in_sd),
                     _some(shown(f"{job}/{instance}") for job, instance in sorted(back_in_sd)))
        self._out.update({pod: max(self._out.get(pod, now), now) for pod in back_in_sd})
        self._gone, self._gone_at = gone, now
        self._out.update(dict.fromkeys(down & self._out.keys(), math.inf))  # back, still out, down again
        self._down_since = {pod: self._down_since.get(pod, now) for pod in down}
        # each pod down is waited for DOWN_WAIT_SECONDS, then left out; one left out in the last
        # LOOKBACK is not waited for again (a crash-looping pod held every model back at each crash);
        # nor are the polls held back longer than that in a row by pods taking turns (a fleet breaker:
        # 300 pods failing 0.5 % of their scrapes each failed 14 polls of 22, every value withdrawn),
        # nor past where the analysis is withdrawn at the next poll (data two intervals plus the
        # timeout old, Runner.current): then the pods down are left out instead
        # (nor one out anyway: back in service discovery down, its growth is in no step before its return)
        unwaited = self._left_out.keys() | self._out.keys()
        waiting = [pod for pod in down if pod not in unwaited and now - self._down_since[pod] < DOWN_WAIT_SECONDS]
        since = now if self._waiting_since is None or not waiting else self._waiting_since
        fresh = self._end is None or now - self._end <= self.interval + self._http.timeout
        self._waiting_since = None
        if waiting and now - since < DOWN_WAIT_SECONDS and fresh:
            self._waiting_since = since
            raise ScrapeError("catching_up", f"{self._where}: {len(waiting)} pod(s) with vLLM counters in the last "
                              f"{LOOKBACK} are targets Prometheus cannot scrape now (up == 0): their growth since is "
                              "unseen, and would land in one later step; the next range will cover the wait (polls "
                              f"wait at most {DOWN_WAIT_SECONDS:.0f} s in a row, then leave such pods out)",
                              costly=False, unchanged=self._end is not None)
        new = [pod for pod in down if pod not in self._left_out]
        if new:
            log.warning("fleet mode: %d pod(s) Prometheus cannot scrape (up == 0) are left out of the sums (polls wait "
                        "%.0f s at most for down pods) until they are back (%s), and then count from the first range "
                        "that starts once they are seen back (their growth while out is in no step)", len(new),
                        DOWN_WAIT_SECONDS, _some(shown(f"{job}/{instance}") for job, instance in sorted(new)))
        elif self._leaving_out and not down:
            log.info("fleet mode: every pod left out is up again or down past the %s lookback (its series in no sum)",
                     LOOKBACK)
        self._leaving_out = bool(down)
        self._left_out = ({pod: t for pod, t in self._left_out.items() if t > now - LOOKBACK_SECONDS}
                          | dict.fromkeys(down, now))
        if latest is not None and self._end is not None and latest <= self._end:
            if self._end < now and now - latest < FRESH_SAMPLE_SECONDS:  # not a wall clock stepped back
                raise ScrapeError("catching_up", f"{self._where}: no new sample of some pod since the last poll (its "
                                  f"latest is {now - latest:.0f} s old): Prometheus scrapes it less often than "
                                  "--interval, which should be at least twice its scrape interval; the next range "
                                  "covers the wait", costly=False, unchanged=True)
            raise ScrapeError("catching_up", f"{self._where}: no new sample of some pod since the last range ended "
                              f"(its latest is {now - latest:.0f} s old): Prometheus has not scraped it since (it was "
                              "down or restarted?), the pod is gone, or the wall clock stepped back; the next range "
                              "will cover the wait",
                              costly=False)
        t = now if latest is None else min(now, latest)
        # A pod waited for and back: the range ends at the pods' oldest latest sample, which can be before
        # its first sample back; it would then read the pod's value from before it was down, and the growth
        # over the wait would land in the next, short step (review). Wait once more (the next range ends
        # past the poll that saw it up), or where that would withdraw the analysis, leave it out as a pod
        # left out is, until a range starts past that poll.
        late = {pod: since for pod, since in self._returning.items() if since > t}
        if late and self._end is not None:
            if fresh:
                raise ScrapeError("catching_up", f"{self._where}: {len(late)} pod(s) waited for are up again, but "
                                  "the range would end before their first sample back; the next range will cover "
                                  "the wait", costly=False, unchanged=True)
            self._out.update(late)
        # A clock that stepped back restarts the ranges instead of querying an empty one.
        start = self._end if self._end is not None and self._end < t else t - self.interval
        if self._baseline is None:
            query = self.promql(None)
        else:
            # a series created after both the baseline and start − LOOKBACK, without a sample at start, had
            # none at or before start (it would be within LOOKBACK): none of its value was counted — while
            # Prometheus still has the samples at start (history), not after it lost them
            born = max(self._baseline, start - LOOKBACK_SECONDS + CREATED_SKEW_SECONDS) if history else None
            # no series of a pod left out now (its stale series read as growth 0: a model whose pods were all
            # down was published idle, TPM 0, not unknown), nor of one left out at the range's start (its
            # growth since its last sample before that, the time out included, in one step: fleet TPM +50 %);
            # by the polls' own verdicts: up at t, before now, can be 0 for one failed scrape (review)
            query = self.promql(t - start, born, down | self._out.keys())
        rows = _vector(self._query(query, t, deadline), self._where)
        # the pods a fleet's cost is for (seed 003's price is per instance-hour): those whose
        # output tokens this range's sum holds (p:), not those with a sample at t
        queries = {"e:": "engines", "p:": "instances", "busy:": "busy", "active:": "active"}
        counts = {kind: {labels.get("model_name", ""): int(value) for labels, value in rows
                         if labels.get(_QUERY_LABEL) == qid and 1 <= value < math.inf}
                  for qid, kind in queries.items()}
        if self._baseline is not None and self._running is not None:  # busy: and active: were asked (promql):
            # a model neither lists had no engine running throughout the range (busy) or ever (active)
            for kind in ("busy", "active"):
                counts[kind] = {m: counts[kind].get(m, 0) for m in counts["engines"]}
        last = [v for labels, v in rows if labels.get(_QUERY_LABEL, "").startswith(_AGE) and math.isfinite(v)]
        if last and t - min(last) >= FRESH_SAMPLE_SECONDS:
            # the range stays: the next ends after that pod's next sample, and its growth falls in this
            # range's time, a step the windows leave out when it is a gap
            raise ScrapeError("catching_up", f"{self._where}: some pod's last sample at the range's end is "
                              f"{t - min(last):.0f} s older (Prometheus restarted or was down?): its next sample's "
                              "growth covers all that time, which a short step cannot hold; the next range will "
                              "end after it", costly=False)
        kept = dict(self._totals), dict(self._seen), self._partial, self._glitched, dict(self._banned)
        try:
            text = self._render([row for row in rows if row[0].get(_QUERY_LABEL) not in queries
                                 and not row[0].get(_QUERY_LABEL, "").startswith(_AGE)], t)
        except Exception as exc:  # an answer no Prometheus gives (a label that is no UTF-8 text): none of it stays
            self._totals, self._seen, self._partial, self._glitched, self._banned = kept
            raise ScrapeError("bad_response", f"{self._where}: an answer kvhit cannot render "
                                              f"({type(exc).__name__})") from None
        self.counts, self._returning = counts, {}
        # A pod back stays out until a range starts at or after the poll that saw it up (its first sample
        # back came no later): a range ends at the pods' oldest latest sample, which can be before that
        # sample, and the next range then read its start from before the pod was out: the time out in
        # one step (review)
        back = {pod: min(since, now) for pod, since in self._out.items() if pod not in down}
        self._out = {pod: since for pod, since in back.items() if since > t} | dict.fromkeys(down, math.inf)
        # the stamp is t (it was t + delay: every step dated a delay late, review)
        self._end, self.answer_delay, self.lag = t, t - (now + self.delay), now - t
        if self._baseline is None or not history:
            # after a loss a pod counted before may be scraped again only later, and look new then
            self._baseline = t
        return t, text

    def _latest(self, t: float, deadline: float) -> tuple[float | None, bool, set[tuple[str, str]],
                                                          set[tuple[str, str]], set[tuple[str, str]]]:
        """(the oldest of the pods' latest counter samples at ``t`` [unix s], None when there is none
        — one ``min(timestamp())`` per family: timestamp() drops the metric name, and two families'
        series of one pod would collide —; whether Prometheus has a counter sample of the selected
        pods within LOOKBACK before the last fetch's t: its history, which a restart on empty
        storage or a fresh replica lost; the pods, (job, instance), with counter samples within
        LOOKBACK whose target is down at t: ``up == 0`` and up within them, their series stale, which timestamp() does not see, while
        last_over_time() would read their growth as 0 and the whole gap's in one step when they
        return — a pod gone from service discovery has no ``up`` and is not counted); the pods with
        counter samples within LOOKBACK and no ``up`` the matchers select whose ``up`` went stale
        within the reach, or that were gone at the last poll (gone from service discovery); those
        gone at the last poll that have an ``up`` since it
        (back, not past LOOKBACK). Logs a warning
        when pods scraped now have no ``up`` the matchers select (their being down would go unseen)."""
        if not self._counters:
            return None, False, set(), set(), set()
        # a pod's newest sample time of either spelling (a downgrade's stale vllm: one held t back 5 min)
        queries = [(f.name, f'min({_newest("timestamp({})", self._selector(f, "(_total)?"))})')
                   for f in self._counters]
        # up with the selector's matchers too (_up; a matcher on a label up lacks finds no down pod)
        up, counters = self._up(), self._counters_selector()
        # the pods with counters in the lookback and no up == 1, down (up == 0) or gone (no up), told
        # apart by the targets with up == 0: one scan of the counters, not one each. The lookback of
        # the next range's start, the last one's end at the earliest (a pod past t's lookback but not
        # past that start's was no longer gone, and back before the next poll it counted from its last
        # sample before it left: review); past twice the lookback, t's and that start's lookbacks alone
        # (a scan of hours after an outage could time out every poll; one capped at 10 min lost a pod
        # gone before range queries failed for 6 min: review). A target is down when it was up within
        # the reach (one never up, a second Service's scrape at a wrong path, held its pod out for good:
        # review); a pod found twice by one job (twice:) with one target down is down.
        lag = max(0.0, t - self._end) if self._end is not None else FRESH_SAMPLE_SECONDS
        if lag <= LOOKBACK_SECONDS:
            scan = f"last_over_time({counters}[{round((LOOKBACK_SECONDS + lag) * 1000)}ms])"
        else:
            scan = (f"(last_over_time({counters}[{LOOKBACK}]) or "
                    f"last_over_time({counters}[{LOOKBACK}] offset {round(lag * 1000)}ms))")
        reach = f"{round((LOOKBACK_SECONDS + min(lag, LOOKBACK_SECONDS)) * 1000)}ms"
        was_up = f"({up} == 0 and max_over_time({up}[{reach}]) > 0)"
        queries.append(("notup:", f"count by (job, instance) ({scan}) "
                                   f"unless on (job, instance) ({up} == 1 unless on (job, instance) {was_up})"))
        queries.append(("down:", f"count by (job, instance) {was_up}"))
        # targets whose up went stale within the reach: gone from service discovery, not after a
        # Prometheus restart, which leaves no staleness marker (every pod not scraped again yet was gone,
        # then "back", and named in the range query: review). Over the reach, as the scan: over now's
        # lookback alone, a pod that left while kvhit did not poll (stalled, its queries failing, or
        # restarted: a first poll's range starts up to FRESH_SAMPLE_SECONDS before now) was not gone,
        # and back it counted from its last sample before it left (4150 in a 60-s step: review). The
        # instant one too: the subquery's 1-min steps can miss a pod that left seconds ago.
        stale = f"(last_over_time({up}[{LOOKBACK}]) unless {up})"
        queries.append(("left:", f"count by (job, instance) ({stale} or max_over_time({stale}[{reach}:1m]))"))
        # those gone at the last poll with an up since (the selector's matchers too: another cluster's
        # target at the same job and address is not back): back, also when gone again by now (review)
        since = f"{max(1, round((t - self._gone_at) * 1000))}ms" if self._gone_at is not None and self._gone_at < t else None
        if (gone_up := _up_of(self._gone, within=since, matchers=_target_matchers(self.matchers))) is not None:
            queries.append(("seen:", f"count by (job, instance) {gone_up}"))
        # pods scraped now whose up the matchers miss: their being down would go unseen
        queries.append(("unwatched:", f"count(count by (job, instance) ({counters}) "
                                      f"unless on (job, instance) {up})"))
        # targets Prometheus scrapes as several (two jobs: a ServiceMonitor and a PodMonitor; one job
        # that finds the pod twice: two Services): their growth is summed once per scrape. up counts
        # a job's duplicates (they share (job, instance)); the jobs are counted without it too (a
        # selector on a label up lacks finds no up)
        queries.append(("twice:", f"count((count by (instance) (count by (job, instance) ({counters})) > 1) or "
                                  f"(count by (instance) ({up} and on (job, instance) {counters}) > 1))"))
        if self._end is not None and self._end < t:
            queries.append(("history:", f"count(last_over_time({counters}[{LOOKBACK}] "
                                        f"offset {max(1, round((t - self._end) * 1000))}ms))"))
        rows = _vector(self._query(" or ".join(f'label_replace({e}, "{_QUERY_LABEL}", "{q}", "", "")'
                                               for q, e in queries), t, deadline), self._where)
        stamps = [v for labels, v in rows
                  if labels.get(_QUERY_LABEL) not in ("history:", "notup:", "down:", "left:", "seen:", "unwatched:", "twice:")
                  and math.isfinite(v)]
        history = any(labels.get(_QUERY_LABEL) == "history:" and v > 0 for labels, v in rows)
        notup, down, left, seen = ({(labels.get("job", ""), labels.get("instance", "")) for labels, _ in rows
                                    if labels.get(_QUERY_LABEL) == qid} for qid in ("notup:", "down:", "left:", "seen:"))
        self._warn_on_change(rows, "unwatched:", "fleet mode: %.0f pod(s) with vLLM counters have no up series the "
                             "selector's matchers select (a matcher on a label up lacks, other than model_name?): kvhit "
                             "cannot see when they are down, and a down pod's growth would land in one later step",
                             "fleet mode: every pod's up series is selected again")
        self._warn_on_change(rows, "twice:", "fleet mode: %.0f target(s) (instance) with vLLM counters are scraped "
                             "more than once (by two jobs, or found twice by one): their growth is summed once per "
                             "scrape (narrow --selector to one of them)",
                             "fleet mode: every target is scraped once again")
        # gone: its up went stale within the reach, or gone at the last poll and its counters still within it
        gone = notup - down
        return (min(stamps) if stamps else None), history, notup & down, gone & (left | self._gone), seen

    def _warn_on_change(self, rows: list[tuple[dict[str, str], float]], qid: str, warning: str, cleared: str) -> None:
        """Log ``warning`` (%-formatted with the count) when query ``qid``'s count in ``rows`` turns
        non-zero, ``cleared`` when it turns zero again: once per change, not at every poll."""
        count = sum(v for labels, v in rows if labels.get(_QUERY_LABEL) == qid and math.isfinite(v))
        if bool(count) != (qid in self._warned):
            self._warned ^= {qid}
            if count:
                log.warning(warning, count)
            else:
                log.info(cleared)

    def _counters_selector(self) -> str:
        """Every counter family's series, every spelling, with the selector's matchers."""
        names = "|".join(f.name for f in self._counters)
        return "{" + ", ".join((f'__name__=~"{_PREFIX}(?:{names})(_total)?"', *self.matchers)) + "}"

    def _query(self, query: str, t: float, deadline: float) -> bytes:
        """The answer's body of one instant query at ``t`` by ``deadline`` [time.monotonic()];
        ScrapeError as :class:`LiveSource`."""
        try:
            return self._http.read({"query": query, "time": f"{t:.3f}"}, self._headers, self._bearer(), deadline)
        except ScrapeError as exc:
            if exc.reason == "http_400":  # bad_data: kvhit's own PromQL parses, so the selector's values do not
                raise ScrapeError(exc.reason, f"{exc} (Prometheus refused the query: check the selector's "
                                  "values and regular expressions)") from None
            raise

    def _bearer(self) -> str | None:
        if self._token_file is None:
            return self._authorization
        try:
            return f"Bearer {read_bearer_token(self._token_file)}"
        except ValueError as exc:
            raise ScrapeError("credentials", str(exc)) from None

    def promql(self, seconds: float | None, born_after: float | None = None,
               out: Iterable[tuple[str, str]] = ()) -> str:
        """The combined query for growths over ``seconds`` [s] (rounded to whole milliseconds; None:
        the first fetch's baseline, 0 for every series — only differences are read, and a growth
        needs history the selected pods may not have yet), a series without a sample at the
        growth's start counted whole when its ``_created`` is after ``born_after`` [unix s]
        (:func:`_growth`), and per model the pods × ``engine`` labels with counters (``e:``,
        :attr:`counts` "engines"), the pods in the output tokens' growth (``p:``, "instances") and
        the pods × engines running requests at every sample of the range (``busy:``, "busy") and at
        some sample of it (``active:``, "active")."""
        r = None if seconds is None else f"{max(1, round(seconds * 1000))}ms"
        left_out = _up_of(out)
        queries = [(qid, expr) for f in self.families for qid, expr in self._queries(f, r, born_after, left_out)]
        # the counts leave out the pods the sums leave out (a pod back counted in e: while not in the
        # sums read per-GPU TPM n/(n+1) for a step)
        unless = "" if left_out is None else f" unless on (job, instance) {left_out}"
        if self._counters:
            # the engines each model's sums add up: per-GPU TPM divides by them
            queries.append(("e:", f"count by (model_name) (count by (model_name, job, instance, engine) "
                                  f"({self._counters_selector()}{unless}))"))
            queries.append((_CONNECTOR, _connected(f"{self._counters_selector()}{unless}", self.matchers)))
        if r is not None:
            # per counter family, the oldest of the pods' last samples at the range's end (fetch):
            # a pod whose last is long before it brings the growth of all that time with its next
            # sample, into the next step however short (a fleet breaker: h 0.43 for 0.15 after an outage)
            queries += [(f"{_AGE}{f.name}", f"min({_newest('timestamp({})', self._selector(f, '(_total)?'))}{unless})")
                        for f in self._counters]
        if r is not None and self._running is not None:
            # the engines busy throughout the step (MODEL.md §7, per engine: analyzer._busy_in_step),
            # whose machine the chip-time fit's coefficients are, and those running requests at some
            # point of it, which the per-engine concurrency (max-num-seqs) divides by
            for qid, fn in (("busy:", "min_over_time"), ("active:", "max_over_time")):
                running = _preferred(f"{fn}({{}}[{r}])", self._selector(self._running, ""))
                queries.append((qid, f"count by (model_name) (count by (model_name, job, instance, engine) "
                                      f"(({running} > 0){unless}))"))
        return " or ".join(f'label_replace({expr}, "{_QUERY_LABEL}", "{qid}", "", "")' for qid, expr in queries)

    def _queries(self, f: Family, r: str | None, born_after: float | None, out: str | None) -> list[tuple[str, str]]:
        by = ", ".join(("model_name",) + f.labels)
        born = None if born_after is None else (self._selector(f, "_created"), born_after)
        # a family's series some pod's latest scrape lacked (x:, _coverage); a lazy family's absence is its 0
        unscraped = [] if r is None or f.lazy else [
            (f"x:{f.name}", self._unscraped(self._selector(f, '(_total)?' if f.kind == "counter" else '_count'), r))]
        # the series whose growth the samples cannot tell: a glitch (z:, any of the family's series; a
        # histogram's buckets and sum apart, as with the name dropped its _sum and _count share their
        # labels), and, of a pod's plain counters (a restart is the pod's: all its series alike), a restart
        # _growth reads wrong (d:, _doubted)
        series = [self._selector(f, suffix) for suffix in (('(_total)?',) if f.kind == "counter" else ('_bucket', '_sum'))]
        doubted = [] if r is None else [(f"z:{f.name}", _glitched(series, r))] + (
            [(f"d:{f.name}", _doubted(series[0], r))] if f.kind == "counter" and f.match is None and not f.lazy else [])
        if f.kind == "counter":
            growth = _growth(self._selector(f, '(_total)?'), r, born, out)
            out = [(f"c:{f.name}", f"sum by ({by}) ({growth})"), (f"n:{f.name}", _pods(growth)), *unscraped, *doubted]
            if f.name == _PRICED_BY and r is not None:
                # the pods priced: in the tokens' sum with a real sample in the range (a gone pod's
                # growth reads 0 for the 5-min lookback; a staleness marker is no sample)
                present = _preferred(f"present_over_time({{}}[{r}])", self._selector(f, '(_total)?'))
                out.append(("p:", _pods(f"({growth} and {present})")))
            return out
        if f.kind == "histogram":
            # the pods with each bucket edge (k:), the sum (m:) and the count (j:) at t, which _coverage
            # and _render compare: series there, not growths (a growth's PromQL again doubled the query's cost)
            there = {suffix: _preferred("{}", self._selector(f, suffix)) for suffix in ("_bucket", "_sum", "_count")}
            return [(f"b:{f.name}", f"sum by (model_name, le) ({_growth(self._selector(f, '_bucket'), r, born, out)})"),
                    (f"s:{f.name}", f"sum by (model_name) ({_growth(self._selector(f, '_sum'), r, born, out)})"),
                    (f"n:{f.name}", _pods(_growth(self._selector(f, '_count'), r, born, out))),
                    (f"k:{f.name}", f"count by (model_name, le) (count by (model_name, le, job, instance) "
                                    f"({there['_bucket']}))"),
                    (f"m:{f.name}", _pods(there["_sum"])), (f"j:{f.name}", _pods(there["_count"])), *unscraped, *doubted]
        if f.kind == "gauge" and f.fallback is not None:
            # per pod (and engine), as the recording rule: a mixed fleet mid-upgrade summed only the
            # pods with the label, their queue alone (and took the most-used KV share of those with
            # the new name only, a fleet review)
            own = _preferred(f"max without ({', '.join(('pid',) + f.labels)}) ({{}})", self._selector(f, ""))
            plain = _preferred("max without (pid) ({})", self._selector(Family(f.fallback, "gauge"), ""))
            # only for models some pod has it of: its presence tells parse the vLLM version
            gauge = f"{_pods_gauge(f.agg, 'model_name', f'({own} or {plain})')} and on (model_name) count by (model_name) ({own})"
            return [(f"g:{f.name}", gauge if f.match is None else
                     f'label_replace({gauge}, "{f.match[0]}", "{f.match[1]}", "", "")')]
        if f.kind == "gauge":
            gauge = _preferred("max without (pid) ({})", self._selector(f, ""))
            return [(f"g:{f.name}", _pods_gauge(f.agg, by, gauge))]
        # per pod: each model's (_metrics) from its own pods, joined here by (job, instance) with the pods' models
        # (pm:) — vLLM's info has no model_name, and one fleet-wide row gave every model the most pods' config
        return [(f"i:{f.name}", f"count by (job, instance, {', '.join(f.labels)}) ({self._selector(f, '')})"),
                ("pm:", f"count by (job, instance, model_name) ({self._counters_selector()})")]

    def _unscraped(self, selector: str, offset: str) -> str:
        """PromQL: per model, the pods with series of ``selector`` within LOOKBACK none of which their
        latest scrape at t, or at t − ``offset`` (the range's start), held while it succeeded
        (``up == 1``): the family dropped (``metric_relabel_configs``) or no longer exposed. Such a
        series is marked stale, and a growth's ends, its last samples within LOOKBACK
        (:func:`_growth`), read its last value at both for 5 min: a growth of 0. A scrape's samples
        and its ``up`` share its time: no matter of scrape-interval jitter. Not counted: a pod whose
        latest scrape failed (``up`` 0: all its series stale, a restart's missed scrape; its last
        samples are its counters), one still holding some of the family's series of the model (an
        engine gone at a restart with fewer: the gone one's growth is 0), one whose scrape holds no
        counter of the model at all (it serves another model now, or a new pod took its address:
        its growth of the model is 0), a series in either spelling (:func:`_preferred`), one gone
        without a staleness marker (Prometheus restarted)."""
        up, counters, ends = self._up(), self._counters_selector(), []
        for at in ("", f" offset {offset}"):
            last = _preferred(f"last_over_time({{}}[{LOOKBACK}]{at})", selector)
            ends.append(f"(({last} and on (job, instance) ({up}{at} == 1) and on (job, instance, model_name) "
                        f"{counters}{at}) unless on (job, instance, model_name) {selector}{at})")
        return _pods(" or ".join(ends))

    def _up(self) -> str:
        """The pods' ``up`` series, with the selector's matchers but those on ``model_name`` (a
        series label ``up`` lacks; the pods are joined to the counters, which keep it): another
        cluster's target at the same job and address (Thanos) is none of the fleet's."""
        return "up{" + ", ".join(_target_matchers(self.matchers)) + "}"

    def _selector(self, f: Family, suffix: str) -> str:
        # vllm: or vllm_ prefix, counters with or without _total: every spelling parse reads; an
        # info family has no model_name (its pods are joined to the models of their counters, pm:)
        own = _target_matchers(self.matchers) if f.kind == "info" else self.matchers
        matchers = [f'__name__=~"{_PREFIX}{f.name}{suffix}"', *own]
        if f.match is not None:
            matchers.append(f'{f.match[0]}="{f.match[1]}"')
        return "{" + ", ".join(matchers) + "}"

    def _render(self, rows: list[tuple[dict[str, str], float]], t: float) -> str:
        """This fetch's rows at ``t`` → exposition: counter and histogram rows added to the totals
        first; a total no answer held for TOTALS_TTL_SECONDS is forgotten (model names churning
        stay bounded in memory, as the analyzer's histories do; one back after that starts again
        from its growth: parse reads its total going down, unknown until that step leaves the window)."""
        by_query: dict[str, list[tuple[dict[str, str], float]]] = {}
        # a fleet's bytes add up fast: past half the cap a model's totals start again from this answer
        # (no _created: the windows read its restart, the total past half the cap and most others
        # going down — else a glitch, a window unknown —, and its increases are then this answer's).
        # Per model: another model's total could go up, no restart read, its increase short by its
        # old total (a diff review's find)
        full = {dict(key[1]).get("model_name", "") for key, total in self._totals.items() if total > MAX_VALUE / 2}
        if full:
            for key in [k for k in self._totals if dict(k[1]).get("model_name", "") in full]:
                del self._totals[key]
        self._now = t
        for key in [k for k, seen in self._seen.items() if t - seen > TOTALS_TTL_SECONDS]:
            del self._seen[key]
            self._totals.pop(key, None)
        # a histogram's banned edges go with its totals (_ban_edges)
        self._banned = {k: v for k, v in self._banned.items() if v[0] in self._totals}
        for labels, value in rows:
            by_query.setdefault(labels.pop(_QUERY_LABEL, ""), []).append((labels, value))
        histograms = {f.name: _histogram_pods(f, by_query) for f in self.families if f.kind == "histogram"}
        self._partial = self._coverage(by_query, histograms)
        if self._counters:  # a model no counter grew for (its pods new to Prometheus, not counted whole) is left
            # out whole: its gauges alone made a snapshot whose next step had counters at one end only (h and
            # TPM unknown for a whole window, "a cut or bad body")
            counted = {labels.get("model_name", "") for qid, rows in by_query.items() if qid[:2] == "c:"
                       for labels, _ in rows}
            for qid in [q for q in by_query if q[:2] == "g:"]:
                by_query[qid] = [row for row in by_query[qid] if row[0].get("model_name", "") in counted]
        for qid, rows in by_query.items():  # a partial sum: its counter, bucket and sum rows
            if qid[:2] in ("c:", "b:", "s:"):
                by_query[qid] = [row for row in rows if (qid[2:], row[0].get("model_name", "")) not in self._partial]
        for name, pods in histograms.items():
            self._ban_edges(name, pods, by_query)
        connector = GaugeMetricFamily(_CONNECTOR_FAMILY, "Pods of the model with LMCache's metrics.",
                                      labels=("model_name",))
        for labels, pods in by_query.get(_CONNECTOR, []):
            connector.add_metric([labels.get("model_name", "")], pods)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Rendered([m for f in self.families for m in self._metrics(f, by_query)]
                                    + ([connector] if connector.samples else [])))
        # A successful answer without series is no data, not an empty body (a parse error)
        return generate_latest(registry).decode() or "# kvhit fleet mode: no series in this answer\n"

    def _coverage(self, by_query: Mapping[str, list[tuple[dict[str, str], float]]],
                  histograms: Mapping[str, Mapping[str, tuple[float | None, float | None, dict[str, float]]]]
                  ) -> set[tuple[str, str]]:
        """(family, model) pairs summed over fewer pods than the model's best-covered counter or
        histogram family (:attr:`Family.lazy` ones aside) this fetch (``n:`` rows: pods with a
        growth, i.e. a sample at both ends): pods without the family (another vLLM version, a name
        it does not export) or without its sample at one end; and pairs some pod's latest scrape at
        either end of the range lacked though the pod had them (``x:`` rows, :meth:`_unscraped`: their
        growth read 0, a fleet h of 0 where it is unknown); pairs with a glitched sample this fetch or
        the last (``z:``, :func:`_glitched`); every counter and histogram of a model with a restart
        :func:`_growth` reads wrong (``d:``, :func:`_doubted`); and histograms whose +Inf bucket or
        sum comes from other pods than their ``_count`` (``histograms``, :func:`_histogram_pods` of
        each histogram family: a pod whose buckets
        a relabel rule dropped put both pods' sum over one pod's +Inf, the count: a mean TTFT 4× too
        high, a fleet review; an edge only some pods have is :meth:`_ban_edges`'). Such a sum is not
        the fleet's (hits from some pods over queries from all): :meth:`_render` leaves it out,
        unknown for this fetch, never added to a total (a counter: rendered NaN for the model,
        :meth:`_metrics`); a change of the set is logged."""
        counts = {(f.name, labels.get("model_name", "")): value
                  for f in self.families if not f.lazy for labels, value in by_query.get(f"n:{f.name}", [])}
        unscraped = {(f.name, labels.get("model_name", "")): value for f in self.families if not f.lazy
                     for labels, value in by_query.get(f"x:{f.name}", []) if value > 0}
        glitched = {(f.name, labels.get("model_name", "")) for f in self.families
                    for labels, value in by_query.get(f"z:{f.name}", []) if value > 0}
        # a glitch inside a tile reads as a restart of its family too (its value went down): the glitch's
        restarted = {labels.get("model_name", "") for f in self.families for labels, value in by_query.get(f"d:{f.name}", [])
                     if value > 0 and (f.name, labels.get("model_name", "")) not in glitched}
        # a glitched sample may be the last of its range, the next range's start: that one is doubted too
        doubted = glitched | self._glitched | {(f.name, m) for f in self.families if f.kind in ("counter", "histogram")
                                               for m in restarted}
        for model in sorted(restarted):
            log.warning("fleet mode: model %r: a pod's counters went down this range in a way their growth cannot "
                        "be told from (two restarts, or the value since a restart past its value before): its "
                        "counters and histograms are left out of this poll, unknown", model)
        self._glitched = glitched
        uneven = {(name, model) for name, pods in histograms.items()
                  for model, (count, total, edges) in pods.items() if (total, edges.get("+Inf")) != (count, count)}
        most: dict[str, float] = {}
        for (_, model), n in counts.items():
            most[model] = max(most.get(model, 0.0), n)
        partial = {key for key, n in counts.items() if n < most[key[1]]} | set(unscraped) | doubted | uneven
        if partial != self._partial:
            for name, model in sorted(partial - self._partial):
                if (name, model) in glitched:
                    log.warning("fleet mode: %s of model %r: a pod's sample this range is no count (below 0 or above "
                                "1e18): left out of this poll and the next, unknown", name, model)
                if (name, model) in doubted:
                    continue
                if (name, model) in uneven:
                    log.warning("fleet mode: %s of model %r: its +Inf bucket or its _sum comes from other pods than its "
                                "_count (a pod whose buckets or sum a relabel rule dropped?): left out, unknown",
                                name, model)
                    continue
                if (name, model) in unscraped:
                    log.warning("fleet mode: %s of model %r is missing from the latest scrape of %d pod(s) Prometheus "
                                "scrapes, which had it (dropped by metric_relabel_configs, or no longer exposed?): "
                                "left out, unknown", name, model, unscraped[(name, model)])
                    continue
                log.warning("fleet mode: %s of model %r comes from %d of %d pods this range (pods of another vLLM "
                            "version or without it, or new since the last poll): left out, unknown",
                            name, model, counts[(name, model)], most[model])
            if self._partial and not partial:
                log.info("fleet mode: every family comes from every pod again")
        return partial

    def _ban_edges(self, name: str, pods: Mapping[str, tuple[float | None, float | None, dict[str, float]]],
                   by_query: dict[str, list[tuple[dict[str, str], float]]]) -> None:
        """Leave out of histogram ``name``'s bucket rows (``b:``) each edge that fewer pods than its
        ``_count``'s have (``pods``, :func:`_histogram_pods`: pods with another ``--max-model-len``,
        whose request_prompt_tokens edges follow it, or of another vLLM version; summed as if whole it
        gave a P95 past what the buckets allow, a fleet review), as one body's engines are summed
        over the edges they share (window._sum_hist_deltas); and, since a running total cannot take
        an edge up midway (its total, short of the others', would read a histogram that goes down
        with ``le``), each edge one poll left out or that came after the totals began, until the
        histogram's totals start again (its +Inf total gone: _render, TOTALS_TTL_SECONDS)."""
        qid = f"b:{name}"
        rows = by_query.get(qid, [])
        by_model: dict[str, list[tuple[str, tuple]]] = {}  # model → (le, its total's key) of each row
        for labels, _ in rows:
            by_model.setdefault(labels.get("model_name", ""), []).append(
                (labels.get("le", ""), (qid, tuple(sorted(labels.items())))))
        for model, here in by_model.items():
            inf = next((key for le, key in here if le == "+Inf"), None)
            before = self._banned.get((name, model), (None, set()))[1]
            started = inf in self._totals
            count, _, edges = pods.get(model, (None, None, {}))
            banned = (before if started else set()) | {
                le for le, key in here if le != "+Inf" and (edges.get(le) != count or started and key not in self._totals)}
            if banned - before:
                log.warning("fleet mode: %s of model %r: bucket edge(s) %s come from fewer pods than its _count, or "
                            "came after its running totals began (pods of another --max-model-len or vLLM version): "
                            "read without them", name, model, _some(sorted(banned - before)))
            self._banned[(name, model)] = (inf, banned)
        by_query[qid] = [row for row in rows if row[0].get("le", "") not in
                         self._banned.get((name, row[0].get("model_name", "")), (None, ()))[1]]

    def _add(self, qid: str, labels: Mapping[str, str], value: float, count: bool = True) -> float:
        """The running total after adding this increase, or ``value`` itself when it is no
        increase — NaN/±Inf, beyond parse's MAX_VALUE, or below 0 for a count (``count``: counters
        and buckets) — which a total would keep forever: rendered as it came, parse then counts and
        drops it as in a pod's body (``non_finite``, ``out_of_range``, ``negative``); NaN for an
        increase over half of MAX_VALUE in one poll, which no running total can show."""
        if not abs(value) <= MAX_VALUE or (count and value < 0):
            return value
        if abs(value) > MAX_VALUE / 2:
            # its total, started again at the next poll (_render), would not go down: parse would
            # read no restart and an increase of 0 (a TPM of 0); NaN: dropped, unknown
            return math.nan
        key = (qid, tuple(sorted(labels.items())))
        self._totals[key] = self._totals.get(key, 0.0) + value
        self._seen[key] = self._now
        return self._totals[key]

    def _metrics(self, f: Family, by_query: Mapping[str, list[tuple[dict[str, str], float]]]) -> list[Metric]:
        name, names = f"vllm:{f.name}", ("model_name",) + f.labels
        if f.kind == "counter":
            rows = by_query.get(f"c:{f.name}", [])
            fam = CounterMetricFamily(name, _FLEET_HELP, labels=names)
            for labels, value in rows:
                fam.add_metric([labels.get(k, "") for k in names], self._add(f"c:{f.name}", labels, value))
            # a sum left out (_coverage) is rendered NaN for its model: parse drops it (unknown) and
            # tells "exported, unusable" from "not exported" (external_prefix_cache_*: no KV
            # connector, 0 loaded hits), per model; a NaN proves no vLLM version (parse._since)
            partial = sorted(model for name, model in self._partial if name == f.name)
            for model in partial:
                fam.add_metric([model, *(f.match[1] if f.match and k == f.match[0] else "" for k in f.labels)], math.nan)
            return [fam] if rows or partial else []
        if f.kind == "histogram":
            return self._histogram(f, by_query)
        if f.kind == "gauge":
            rows = by_query.get(f"g:{f.name}", [])
            fam = GaugeMetricFamily(name, _FLEET_HELP, labels=names)
            for labels, value in rows:
                fam.add_metric([labels.get(k, "") for k in names], value)
            return [fam] if rows else []
        models: dict[tuple[str, str], list[str]] = {}  # (job, instance) → the models of its counters
        for labels, _ in by_query.get("pm:", []):
            models.setdefault((labels.get("job", ""), labels.get("instance", "")), []).append(labels.get("model_name", ""))
        pods: dict[str, Counter] = defaultdict(Counter)  # model → its pods' label sets → pods
        for labels, _ in by_query.get(f"i:{f.name}", []):
            config = tuple(sorted((k, v) for k, v in labels.items() if k not in ("job", "instance")))
            for model in models.get((labels.get("job", ""), labels.get("instance", "")), ()):
                pods[model][config] += 1
        fam = GaugeMetricFamily(name, _FLEET_HELP)
        for model, configs in sorted(pods.items()):
            config = max(configs, key=lambda c: (configs[c], c))  # the most pods', then by labels
            fam.add_sample(name, {"model_name": model, **dict(config)}, 1.0)
        return [fam] if fam.samples else []

    def _histogram(self, f: Family, by_query: Mapping[str, list[tuple[dict[str, str], float]]]) -> list[Metric]:
        """Buckets ascending by ``le`` ending at +Inf (whose total is ``_count``); a model without
        a +Inf bucket this fetch has no histogram, one without ``_sum`` none of its sum."""
        buckets: dict[str, list[tuple[float, str, float]]] = {}
        for labels, value in by_query.get(f"b:{f.name}", []):
            try:
                edge = float(labels.get("le", ""))
            except ValueError:
                continue
            total = self._add(f"b:{f.name}", labels, value)
            buckets.setdefault(labels.get("model_name", ""), []).append((edge, labels["le"], total))
        sums = {labels.get("model_name", ""): self._add(f"s:{f.name}", labels, value, count=False)
                for labels, value in by_query.get(f"s:{f.name}", [])}
        fam = HistogramMetricFamily(f"vllm:{f.name}", _FLEET_HELP, labels=("model_name",))
        for model, rows in sorted(buckets.items()):
            rows.sort()
            if rows[-1][0] == math.inf and _usable(rows[-1][2]):
                fam.add_metric([model], [(le, total) for _, le, total in rows], sums.get(model))
                continue
            # No usable +Inf bucket (_count): no histogram; only the rows no total took are
            # rendered, for parse to count
            for _, le, value in rows:
                if not _usable(value):
                    fam.add_sample(f"vllm:{f.name}_bucket", {"model_name": model, "le": le}, value)
            if model in sums and not math.isfinite(sums[model]):
                fam.add_sample(f"vllm:{f.name}_sum", {"model_name": model}, sums[model])
        return [fam] if fam.samples else []


def _growth(selector: str, offset: str | None, born: tuple[str, float] | None = None, out: str | None = None) -> str:
    """PromQL: per series, a counter's growth between its last sample at or before t − ``offset``
    and its last at or before t: the difference, or after a restart (a difference below 0) its
    value since plus its growth up to its last sample before the restart in the tile (a restart
    shorter than a poll: the tile's highest sample). Anchored on samples, not on a range's edges:
    consecutive fetches tile the samples exactly, however far apart they are (a Prometheus
    restart between two of a pod's samples), and nothing is extrapolated. Each end is the last real sample within LOOKBACK (``last_over_time``:
    a range skips the staleness marker a pod restart's missed scrape leaves, which would hide the
    pod at one end, and its growth with it). ``offset`` None: 0 for every series (a baseline).

    A series without a sample at t − offset within LOOKBACK (a new pod) adds its whole value at t
    unless its pod (``job``, ``instance``) and vLLM labels (``model_name``, ``engine``) had a series
    of the same process (a ``_created`` not earlier) there under other labels (its target labels
    changed: the series under the new labels count from the next tile on, and its growth from its
    last sample under the old ones to t is lost), and
    when ``born`` = (its ``_created`` selector, a time [unix s]), its ``_created`` is after that
    time (the caller's guarantee that none of its value was counted: a counter starts from 0 at
    its ``_created``; given only while Prometheus has samples at t − offset, not after it lost
    them with its storage: :meth:`PrometheusSource._latest`); else (no ``_created`` exported, or
    older) nothing.

    ``out``: a vector of the pods (``job``, ``instance``) whose series this growth leaves out
    (:meth:`PrometheusSource.fetch`: those left out now or at the range's start).
    """
    if offset is None:  # one spelling per label set here too: 0 * drops the name (HTTP 422 after an upgrade)
        return _preferred("(0 * {})", selector)
    # One series per label set, of its preferred spelling (_preferred): the arithmetic below refuses
    # two of one label set
    now = _preferred(f"last_over_time({{}}[{LOOKBACK}])", selector)
    then = _preferred(f"last_over_time({{}}[{LOOKBACK}] offset {offset})", selector)
    diff = f"({now} - {then})"
    # a restart inside the tile (a difference below 0; a series has it wherever it has a difference):
    # the growth up to the last sample before it (the tile's highest, when any came before it), plus
    # the value since
    restarted = f"(clamp_min({_preferred(f'max_over_time({{}}[{offset}])', selector)} - {then}, 0) + {now})"
    grown = f"(({diff} >= 0) or {restarted})"
    if born is not None:
        # new: created after born, and not the process its pod (job, instance) and vLLM labels had at
        # then under other labels: a pod whose target labels changed (a controller labelling it after
        # its start) counted whole had its traffic up to the change counted twice (a breaker: fleet TPM
        # +11 %); a new process at a reused address still counts whole (review). A histogram's one
        # _created has no le.
        ident = "job, instance, model_name, engine"
        created = f"last_over_time({born[0]}[{LOOKBACK}])"
        before = f"max by ({ident}) (last_over_time({born[0]}[{LOOKBACK}] offset {offset}))"
        new = (f"(({now} unless {then}) and ignoring(le) "
               f"(({created} > {born[1]:.3f}) unless ({created} <= on ({ident}) group_left {before})))")
        grown = f"({grown} or {new})"
    # an out pod's every series, also one without a sample at the range's start: a process restarted
    # while its scrapes failed has served since (review: counted whole, 1440 in a step of 1200); a new
    # pod at the address of one gone within the lookback is taken as that pod back
    return grown if out is None else f"({grown} unless on (job, instance) {out})"


def _doubted(selector: str, offset: str) -> str:
    """PromQL: per model, how many series of ``selector`` went down in the tile (t − ``offset``, t],
    counted from its start (then, the last sample at or before t − offset) on, in a way
    :func:`_growth` reads wrong. It reads a tile by its ends and its highest sample: right without a
    restart, and after one whose value since stayed below then (the highest sample is then the last
    before the restart, or the restart came before the tile's first sample). Two restarts, or one
    whose value since passed then, it reads wrong (a crash-looping pod: its growth read 14 % low,
    review). The drops are those of the samples from then on: ``resets`` over then's lookback and
    the tile less ``resets`` over then's lookback alone (a range of the tile alone misses a drop
    from then to the tile's first sample: a restart before it and one inside read as one). Two
    drops, or one with then ≤ the last sample: drops + (then ≤ last) > 1, the drops evaluated once."""
    ms = LOOKBACK_SECONDS * 1000 + int(offset.removesuffix("ms"))
    then = _preferred(f"last_over_time({{}}[{LOOKBACK}] offset {offset})", selector)
    last = _preferred(f"last_over_time({{}}[{offset}])", selector)
    drops = (f"({_preferred(f'resets({{}}[{ms}ms])', selector)} - "
             f"{_preferred(f'resets({{}}[{LOOKBACK}] offset {offset})', selector)})")
    return f"count by (model_name) (({drops} + ({then} <= bool {last})) > 1)"


def _glitched(selectors: Iterable[str], offset: str) -> str:
    """PromQL: per model, how many series of ``selectors`` (a counter's; a histogram's buckets and
    sum) have a sample in the tile (t − ``offset``, t] that is no count, below 0 or above MAX_VALUE
    (a -1 at a tile's end read as a restart added the pod's whole lifetime total: fleet h 0.025 for
    0.65, review); when it was the last, the next tile starts at it (the caller's)."""
    terms = [f"{_preferred(f'min_over_time({{}}[{offset}])', s)} < 0 or "
             f"{_preferred(f'max_over_time({{}}[{offset}])', s)} > {MAX_VALUE:g}" for s in selectors]
    return f"count by (model_name) ({' or '.join(terms)})"


def _preferred(fn: str, selector: str) -> str:
    """PromQL: ``fn`` (``{}`` for its selector) of ``selector``'s vllm: spelling, or of its vllm_
    spelling for the label sets without the former. prometheus_client writes vllm_ for
    Prometheus 2 and vllm: for 3 (the OpenMetrics escaping they negotiate), so an upgrade leaves
    both within the lookback (no staleness marker across the restart): two series of one label
    set, which arithmetic and name-dropping functions refuse (HTTP 422 at every poll, for ever
    once a growth's range spanned the change); and neither the larger value (a restart since
    the change: the old spelling's stale value counted again) nor a sum is the pod's. vllm: is
    the spelling an upgrade moves to."""
    a, b = _spellings(fn, selector)
    return f"({a} or {b})"


def _newest(fn: str, selector: str) -> str:
    """PromQL: ``fn`` (``{}`` for its selector; a sample time) of each spelling of ``selector``
    (:func:`_preferred`), the larger per label set: the newer sample."""
    a, b = _spellings(fn, selector)
    return f"(({a} >= {b}) or {b} or {a})"


def _spellings(fn: str, selector: str) -> tuple[str, str]:
    """``fn`` (``{}`` for its selector) of ``selector`` (built with _PREFIX) read as vllm: and as vllm_."""
    return fn.format(selector.replace(_PREFIX, "vllm:", 1)), fn.format(selector.replace(_PREFIX, "vllm_", 1))


class _Where:
    """A request's target (redacted URL) as its messages name it: with where its last redirect led
    (``to``, set by the response hook as requests follows it), so a failure there is not blamed on
    the target itself."""

    def __init__(self, url: str) -> None:
        self.url, self.to = url, ""

    def __str__(self) -> str:
        return f"{self.url} (redirected to {self.to})" if self.to else self.url


def _connected(counters: str, matchers: Sequence[str]) -> str:
    """PromQL: per model, its pods (job, instance) with a series of ``counters`` (a selector, or one
    less the pods the sums leave out) for it that also
    expose LMCache's metrics (a KV connector; ``lmcache:`` or OpenMetrics' ``lmcache_``, as the
    recording rule reads them) with the selector's ``matchers`` but those on ``model_name`` (LMCache
    names the model by its path: the pods are the counters'): before vLLM 0.11.1 nothing else
    tells that the model's loaded hits are uncounted (parse._connector)."""
    lmcache = "{" + ", ".join(('__name__=~"lmcache[:_].+"', *_target_matchers(matchers))) + "}"
    return f"count by (model_name) (count by (job, instance, model_name) ({counters}) and on (job, instance) {lmcache})"


def _pods_gauge(agg: str, by: str, gauge: str) -> str:
    """PromQL: ``agg`` (sum, max) ``by`` the labels ``by`` of the pods' ``gauge``; where some pod's
    reads below 0, the lowest such value instead: parse drops it as a damaged body's (quirk
    negative, unknown), as in a pod's own exposition, where a sum hid it (-3 running requests on
    one pod read 2 over two)."""
    return f"(({agg} by ({by}) ({gauge}) unless on ({by}) ({gauge} < 0)) or min by ({by}) ({gauge} < 0))"


def _target_matchers(matchers: Sequence[str]) -> list[str]:
    """The selector's ``matchers`` but those on ``model_name``: vLLM's series label, which a pod's
    ``up``, its ``cache_config_info`` and LMCache's metrics lack (a fleet kvhit per model, selected
    by ``{model_name="…"}``, found none of them: no KV capacity, down pods unseen, fleet review);
    each query joins their pods to the model's counters, which keep it."""
    return [m for m in matchers if not re.match(r"\s*model_name\s*[=!]", m)]


def _histogram_pods(f: Family, by_query: Mapping[str, list[tuple[dict[str, str], float]]]
                    ) -> dict[str, tuple[float | None, float | None, dict[str, float]]]:
    """Per model with series of histogram ``f`` at t: (the pods with its ``_count`` (``j:`` rows),
    with its ``_sum`` (``m:``), {``le``: the pods with that bucket edge} (``k:``)); None: no row."""
    out: dict[str, list] = {}
    for i, qid in enumerate(("j:", "m:", "k:")):
        for labels, pods in by_query.get(f"{qid}{f.name}", []):
            row = out.setdefault(labels.get("model_name", ""), [None, None, {}])
            if i < 2:
                row[i] = pods
            else:
                row[2][labels.get("le", "")] = pods
    return {model: (count, total, edges) for model, (count, total, edges) in out.items()}


def _pods(expr: str) -> str:
    """PromQL: per model, how many scrape targets (pods: Prometheus' ``job``, ``instance``) have
    series in ``expr`` — targets, not series: a pod's ``engine``s or a family's own labels
    (``transfer_type``) would count several times."""
    return f"count by (model_name) (count by (model_name, job, instance) ({expr}))"


def _usable(total: float) -> bool:
    """A count :meth:`PrometheusSource._add` took into its total (finite, not below 0)."""
    return math.isfinite(total) and total >= 0


class _Rendered:
    """The metric families of one fetch, for a private registry."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def _up_of(pods: Iterable[tuple[str, str]], within: str | None = LOOKBACK, matchers: Sequence[str] = ()) -> str | None:
    """PromQL: the ``up`` series of ``pods`` (job, instance), in parentheses (None: no pod), for
    :func:`_growth` to leave out: one selector per job, its instances one regex (a selector per
    pod, repeated in every growth, made 100 pods down a 674-KB query Prometheus took 12 s over: a
    fleet breaker). Each its last sample ``within`` (None: at the query's time): a pod back in
    service discovery and gone again by then has no ``up`` at it, and was left out of nothing
    (review: its time gone in one step). ``matchers``: more label matchers of every selector."""
    jobs: dict[str, list[str]] = {}
    for job, inst in sorted(pods):
        jobs.setdefault(job, []).append(_re2_literal(inst))
    if not jobs:
        return None
    selectors = ("up{" + ", ".join((f"job={json.dumps(job, ensure_ascii=False)}",
                                    f"instance=~{json.dumps('|'.join(insts), ensure_ascii=False)}", *matchers)) + "}"
                 for job, insts in jobs.items())
    return "(" + " or ".join(s if within is None else f"last_over_time({s}[{within}])" for s in selectors) + ")"


def _re2_literal(text: str) -> str:
    """``text`` as an RE2 pattern matching it alone (PromQL anchors label regexes): its
    metacharacters escaped, every other character (a newline, a NUL) itself."""
    return "".join("\\" + c if c in _RE2_META else c for c in text)


_RE2_META = frozenset("\\.+*?()|[]{}^$")


def _some(names: Iterable[str], most: int = 10) -> str:
    """The first ``most`` names, comma-separated, and how many more (a fleet breaker's 100 pods
    filled one log line)."""
    names = list(names)
    more = len(names) - most
    return ", ".join(names[:most]) + (f" and {more} more" if more > 0 else "")


def _vector(body: bytes, where: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of each sample of a Prometheus instant-vector answer.

    Raises:
        ScrapeError: ``query_error`` for ``"status": "error"``, ``bad_response`` for anything
            that is not an instant vector.
    """
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # nested deeper than the parser recurses: no answer of the API
        raise ScrapeError("bad_response", f"answer from {where} is not JSON") from None
    if isinstance(doc, dict) and doc.get("status") == "error":
        kind = shown(str(doc.get("errorType", "unknown"))[:40])  # an answer's bytes in a log line (fleet breaker)
        raise ScrapeError("query_error", f"query failed at {where} (errorType {kind})")
    # Thanos and Mimir answer "success" with a warning when a store did not answer: the sums then
    # miss its pods, and the range would move past increases never counted. Prometheus 2.x's
    # "PromQL info:" annotations say nothing is missing.
    warnings = doc.get("warnings") if isinstance(doc, dict) else None
    if warnings and not (isinstance(warnings, list)
                         and all(isinstance(w, str) and w.startswith("PromQL info:") for w in warnings)):
        n = len(warnings) if isinstance(warnings, list) else 1  # their text may quote label values: not logged
        raise ScrapeError("partial_response", f"answer from {where} carries {n} warning(s): a store or shard missing?")
    data = doc.get("data") if isinstance(doc, dict) and doc.get("status") == "success" else None
    if not isinstance(data, dict) or data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
        raise ScrapeError("bad_response", f"answer from {where} is not a successful instant vector")
    rows = []
    for sample in data["result"]:
        # the API's sample: {"metric": {label: "value"}, "value": [t, "value"]}; anything else (a
        # value "12" unpacked as "1", "2"; true; a null label) is no answer to read a number from
        try:
            pair, metric = sample["value"], sample["metric"]
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], str) and isinstance(metric, dict)
                    and all(isinstance(v, str) for v in metric.values())):
                raise TypeError
            rows.append((dict(metric), float(pair[1])))
        except (KeyError, TypeError, ValueError):
            raise ScrapeError("bad_response", f"answer from {where} has a malformed sample") from None
    return rows


@dataclass(frozen=True)
class Trace:
    """A recorded trace: snapshots sorted by time, plus the driver's phases (may be empty)."""

    snapshots: list[tuple[float, str]]
    phases: list[dict]
    meta: dict


STDOUT_PATHS = ("/dev/stdout", "/dev/fd/1", "/proc/self/fd/1")  # write_atomic: this process' stdout


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (str as UTF-8) to ``path`` whole or not at all: into a temporary file beside
    it, synced and renamed over it with the old file's mode, so a full disk or an interrupt never
    leaves a cut file in place of a good one, and a reader (kvhit replay of a recording in
    progress) never sees half a file. A symlink's target is written; ``/dev/stdout`` is written
    through this process' stdout, after what it printed; another path that is not a regular file
    (a FIFO, a device) is written directly.

    Raises:
        OSError: ``"cannot write PATH: why"``; ``path`` is then as it was before.
    """
    data = data.encode() if isinstance(data, str) else data
    if os.fspath(path) in STDOUT_PATHS:  # after what was printed (a pipe, `> file`), not in its place
        if sys.stdout is None:
            raise OSError(f"cannot write {path}: stdout is closed")
        # as text through sys.stdout: kvhit's pipe guard (cli._PipeSafe) sees a reader that left;
        # a record of its own line (the JSON ends without a newline)
        sys.stdout.write(data.decode("utf-8", errors="replace") + ("" if data.endswith(b"\n") else "\n"))
        sys.stdout.flush()
        return
    path = Path(os.path.realpath(path))  # a symlink's target is written, the link stays
    tmp = None
    try:
        try:
            old = path.stat()
        except FileNotFoundError:
            old = None
        if old is not None and not stat.S_ISREG(old.st_mode):  # a FIFO, a device: no file to replace
            with open(path, "wb") as f:
                f.write(data)
            return
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")  # unique across PID namespaces
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())  # whole on disk before it replaces the old one
        if old is not None:
            os.chmod(tmp, stat.S_IMODE(old.st_mode))
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise OSError(f"cannot write {path}: {exc.strerror or exc}") from None
        raise


def load_trace(path: str | os.PathLike, max_bytes: int = DEFAULT_MAX_BYTES) -> Trace:
    """Read a trace directory or ``.tar.gz`` (MODEL.md fixtures format).

    Files are ordered by the unix-ms timestamp in their names (out-of-order listing is fine);
    only regular files are read (a FIFO would block). ``max_bytes``: the size cap [bytes] of one
    file, as of one live scrape (``max_body_bytes``).
    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: not a readable directory or tar archive (a directory or file in it that cannot be
            read, cut short, even at a member's end, or a checksum of its
            compression that fails), no ``<unix_ms>.prom`` file in it, a stamp before 2001 (a name
            in seconds, not milliseconds) or after 2200 (in microseconds), two files with the same
            stamp, a file over ``max_bytes``, a path that is neither a regular file nor a
            directory, two ``phases.json`` or snapshots in two directories (two recordings), or a ``phases.json`` that is not UTF-8 JSON of an
            object with a ``phases`` list of objects with numeric ``start_ms`` < ``end_ms``, a string
            ``name`` and a ratio in [0, 1] or null ``intended_hit_ratio`` where given; every message
            starts with the trace's path (and names the file inside it).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: trace not found")
    files: dict[float, tuple[str, str]] = {}  # unix s → (file name, text)
    phases_doc: dict = {}
    try:
        _read_trace(p, files, phases_doc, max_bytes)
    except ValueError as exc:
        raise ValueError(f"{p}: {exc}") from None
    if not files:
        raise ValueError(f"{p}: no <unix_ms>.prom files in it")
    # normalised: one tar may name members "./1.prom" and "1.prom" alike (a review)
    folders = sorted({posixpath.dirname(posixpath.normpath(name.replace(os.sep, "/")).lstrip("/"))
                      for name, _ in files.values()})
    if len(folders) > 1:  # a recorder writes one flat directory: two recordings under one path, fitted as one
        shown = ", ".join(f or "." for f in folders[:3]) + (", …" if len(folders) > 3 else "")
        raise ValueError(f"{p}: snapshots in {len(folders)} directories ({shown}): one recording per trace; "
                         "replay each directory alone")
    snaps = sorted((t, text) for t, (_, text) in files.items())
    return Trace(snaps, list(phases_doc.get("phases", [])),
                 {k: v for k, v in phases_doc.items() if k not in ("phases", _PHASES_SEEN)})


def _read_trace(p: Path, files: dict, phases_doc: dict, max_bytes: int) -> None:
    if not (p.is_dir() or p.is_file()):  # /dev/zero read as an archive forever, a FIFO blocked
        raise ValueError("not a regular file or a directory")
    if p.suffix == ".prom" and p.is_file():  # read as an archive it said "(ReadError)" alone (a newcomer)
        raise ValueError("one scrape, not a trace: give the directory of <unix_ms>.prom scrapes, or a tar of it")
    if p.is_dir():
        def unreadable(exc: OSError) -> None:
            raise exc

        try:  # os.walk, not rglob: rglob passes over a folder it may not list, as if it were empty
            for root, _, names in os.walk(p, onerror=unreadable):
                for name in names:
                    f = Path(root, name)
                    if f.is_file():
                        _take(str(f.relative_to(p)), f.stat().st_size, f.read_bytes, files, phases_doc, max_bytes)
        except OSError as exc:
            where = os.path.relpath(exc.filename, p) if exc.filename else "."
            raise ValueError(f"cannot read {'it' if where == '.' else where} ({exc.strerror or type(exc).__name__})") \
                from None
    else:
        try:
            with tarfile.open(p, "r:*") as tar:
                for member in tar.getmembers():
                    if member.isfile():
                        _take(member.name, member.size, lambda m=member: tar.extractfile(m).read(), files, phases_doc,
                              max_bytes)
                # tarfile also ends quietly at the end of the data or at a block that is no header: a
                # trace cut at a member's end would be read as a shorter one
                tar.fileobj.seek(tar.offset)
                if (end := tar.fileobj.read(512)) != bytes(512):
                    raise tarfile.ReadError(f"no end-of-archive block at byte {tar.offset}: "
                                            + ("cut short" if len(end) < 512 else "not a tar header"))
                # the compression's checksum after it is read (and checked) only by reading on to the end
                while tar.fileobj.read(1 << 20):
                    pass
        except (tarfile.TarError, EOFError, zlib.error, OSError) as exc:  # not an archive, cut short, damaged
            why = f"{type(exc).__name__}: {exc}" if str(exc) and "\n" not in str(exc) else type(exc).__name__
            raise ValueError(f"not a readable trace directory or tar archive ({why})") from None


_PHASES_SEEN = "\0phases.json"  # phases_doc's key of the phases.json read (a "{}" one too), not a field


def trace_file(name: str) -> bool:
    """Whether :func:`load_trace` reads a file of this name (path) in a trace directory: a
    ``<unix_ms>.prom`` snapshot or a ``phases.json``."""
    return bool(_PROM_FILE.search(name)) or name.endswith("phases.json")


def _take(name: str, size: int, read, files: dict, phases_doc: dict, max_bytes: int) -> None:
    m = _PROM_FILE.search(name)
    if trace_file(name) and size > max_bytes:
        raise ValueError(f"{name}: {size} bytes, over the cap of {max_bytes} bytes per file (max_body_bytes)")
    if m:
        t = int(m.group(1)) / 1000.0 if len(m.group(1)) <= 16 else math.inf
        if t < _EARLIEST_STAMP:
            raise ValueError(f"{name}: {m.group(1)} ms is before 2001: trace files are named by unix time in "
                             "milliseconds (13 digits), not seconds")
        if t >= _LATEST_STAMP:
            raise ValueError(f"{name}: {m.group(1)[:24]} ms is after 2200: trace files are named by unix time in "
                             "milliseconds (13 digits), not microseconds or nanoseconds")
        if t in files:  # one of them would be lost, and which one depends on the listing order
            raise ValueError(f"two snapshots stamped {m.group(1)} ms in the trace ({files[t][0]} and {name}): "
                             "keep one")
        files[t] = (name, read().decode("utf-8", errors="replace"))
    elif name.endswith("phases.json"):
        if _PHASES_SEEN in phases_doc:  # two recordings (calibrate --out directories) under one path: fitted as one
            raise ValueError(f"{name}: a second phases.json: one recording per trace; replay each directory alone")
        try:
            doc = json.loads(read().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"{name} in the trace is not UTF-8 text (byte {exc.start})") from None
        except ValueError as exc:  # json's message names the line and column
            raise ValueError(f"{name} in the trace is not JSON: {exc}") from None
        except RecursionError:
            raise ValueError(f"{name} in the trace is not JSON: nested too deep") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("phases", []), list):
            raise ValueError(f'{name} in the trace is not an object with a "phases" list')
        for i, ph in enumerate(doc.get("phases", [])):
            ok = isinstance(ph, dict) and all(isinstance(ph.get(k), (int, float)) and not isinstance(ph.get(k), bool)
                                              and math.isfinite(ph[k]) for k in ("start_ms", "end_ms"))
            if not ok or not ph["start_ms"] < ph["end_ms"]:
                raise ValueError(f"{name} in the trace: phase {i} needs numeric start_ms < end_ms")
            if not isinstance(ph.get("name", ""), str):
                raise ValueError(f"{name} in the trace: phase {i}'s name must be a string")
            ratio = ph.get("intended_hit_ratio")
            if ratio is not None and not (isinstance(ratio, (int, float)) and not isinstance(ratio, bool)
                                          and 0.0 <= ratio <= 1.0):
                raise ValueError(f"{name} in the trace: phase {i}'s intended_hit_ratio must be a number in [0, 1] "
                                 "or null")
        phases_doc.update(doc)
        phases_doc[_PHASES_SEEN] = name
