"""Where exposition text comes from: a live ``/metrics`` scrape or a recorded trace.

Both yield ``(timestamp, text)`` pairs; parsing happens in :mod:`exporter.parse`.
A recorded trace is a directory (or a ``.tar.gz`` of one) of ``<unix_ms>.prom`` files, optionally
with ``phases.json`` (what a load driver did in each phase). Replay uses the file timestamps,
never the wall clock.
"""
from __future__ import annotations

import http.client
import json
import os
import re
import tarfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit, urlunsplit

import requests
from urllib3.exceptions import ProtocolError, ReadTimeoutError

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
_PROM_FILE = re.compile(r"(?:^|/)(\d{10,16})\.prom$")


class ScrapeError(Exception):
    """A scrape failed; ``reason`` is a short label value for ``kvhit_scrape_errors_total``.

    The message names the URL (credentials removed) and the kind of failure, never the body.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def redact_url(url: str) -> str:
    """The URL without ``user:password@`` (for logs, messages and the ``target`` label)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="<redacted>@" + parts.netloc.rpartition("@")[2]))


@dataclass
class LiveSource:
    """Scrapes a vLLM ``/metrics`` URL with requests.

    Failure kinds (the ``reason`` of :class:`ScrapeError`): ``refused`` (no connection: refused,
    reset before an answer, name not resolved), ``timeout`` (the whole scrape — connect, headers
    and body — did not finish within ``timeout``; a body trickling in a few bytes at a time
    counts, the deadline is checked after every socket read and each read waits at most the time
    left), ``http_<status>`` (any status but 200 after redirects), ``redirect`` (more than
    ``max_redirects``), ``too_large`` (over ``max_bytes``, by Content-Length before reading or
    while reading, counted after gzip decoding so a gzip bomb is cut at the cap), ``encoding``
    (a Content-Encoding other than gzip/deflate/identity, or a corrupt one), ``incomplete``
    (the connection broke inside the body), ``error`` (anything else).

    Args:
        url: the full /metrics URL (e.g. http://localhost:8000/metrics).
        timeout: deadline of one scrape [s].
        max_bytes: body-size cap [bytes] (after gzip decoding); larger bodies are an error.
        max_redirects: redirects followed (a 302 to the real path is fine).
    """

    url: str
    timeout: float = 3.0
    max_bytes: int = DEFAULT_MAX_BYTES
    max_redirects: int = 5

    def __post_init__(self) -> None:
        self._session = requests.Session()
        self._session.headers["Accept"] = "text/plain;version=0.0.4"
        self._session.headers["Accept-Encoding"] = "gzip"
        self._session.max_redirects = self.max_redirects
        self._where = redact_url(self.url)

    def fetch(self) -> tuple[float, str]:
        """One scrape → (unix time of the request, body text; bytes that are not UTF-8 become U+FFFD).

        Raises:
            ScrapeError: reason as in the class docstring.
        """
        start = time.time()
        deadline = time.monotonic() + self.timeout
        where = self._where
        try:
            with self._session.get(self.url, timeout=self.timeout, stream=True, allow_redirects=True) as resp:
                if resp.status_code != 200:
                    raise ScrapeError(f"http_{resp.status_code}", f"HTTP {resp.status_code} from {where}")
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
            raise ScrapeError("refused", f"cannot reach {where}: {type(exc).__name__}") from None
        except (requests.Timeout, ReadTimeoutError, TimeoutError):
            raise ScrapeError("timeout", f"no complete answer within {self.timeout}s from {where}") from None
        except (ProtocolError, http.client.HTTPException, ConnectionError, requests.exceptions.ChunkedEncodingError):
            raise ScrapeError("incomplete", f"connection to {where} broke inside the body") from None
        except (requests.RequestException, OSError) as exc:
            raise ScrapeError("error", f"scrape of {where} failed: {type(exc).__name__}") from None
        return start, body.decode("utf-8", errors="replace")

    def _read(self, resp: requests.Response, deadline: float) -> bytes:
        """The body, read socket-read by socket-read against the deadline and the size cap."""
        where = self._where
        length = resp.headers.get("Content-Length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            raise ScrapeError("too_large", f"Content-Length {length} over {self.max_bytes} bytes from {where}")
        encoding = resp.headers.get("Content-Encoding", "identity").strip().lower()
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
            else:
                try:
                    out += decoder.decompress(chunk, self.max_bytes + 1 - len(out))
                except zlib.error:
                    raise ScrapeError("encoding", f"corrupt {encoding} body from {where}") from None
                if decoder.unconsumed_tail:
                    raise ScrapeError("too_large", f"body over {self.max_bytes} bytes after {encoding} "
                                                   f"decoding from {where}")
            if len(out) > self.max_bytes:
                raise ScrapeError("too_large", f"body over {self.max_bytes} bytes from {where}")
        if decoder is not None:
            if not decoder.eof:
                raise ScrapeError("incomplete", f"{encoding} body from {where} ends before its end marker")
            out += decoder.flush()
        return bytes(out)


@dataclass(frozen=True)
class Trace:
    """A recorded trace: snapshots sorted by time, plus the driver's phases (may be empty)."""

    snapshots: list[tuple[float, str]]
    phases: list[dict]
    meta: dict


def load_trace(path: str | os.PathLike) -> Trace:
    """Read a trace directory or ``.tar.gz`` (MODEL.md fixtures format).

    Files are ordered by the unix-ms timestamp in their names (out-of-order listing is fine).
    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: no ``<unix_ms>.prom`` file in it.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"trace not found: {p}")
    files: dict[float, str] = {}
    phases_doc: dict = {}
    if p.is_dir():
        for f in p.rglob("*"):
            _take(str(f.relative_to(p)), lambda f=f: f.read_bytes(), files, phases_doc)
    else:
        with tarfile.open(p, "r:*") as tar:
            for member in tar.getmembers():
                if member.isfile():
                    _take(member.name, lambda m=member: tar.extractfile(m).read(), files, phases_doc)
    if not files:
        raise ValueError(f"no <unix_ms>.prom files in {p}")
    snaps = sorted(files.items())
    return Trace(snaps, list(phases_doc.get("phases", [])), {k: v for k, v in phases_doc.items() if k != "phases"})


def _take(name: str, read, files: dict, phases_doc: dict) -> None:
    m = _PROM_FILE.search(name)
    if m:
        files[int(m.group(1)) / 1000.0] = read().decode("utf-8", errors="replace")
    elif name.endswith("phases.json"):
        phases_doc.update(json.loads(read()))


def iter_replay(trace: Trace) -> Iterator[tuple[float, str]]:
    """Yield the trace's (timestamp, text) pairs in time order."""
    yield from trace.snapshots
