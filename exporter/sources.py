"""Where exposition text comes from: a live ``/metrics`` scrape or a recorded trace.

Both yield ``(timestamp, text)`` pairs; parsing happens in :mod:`exporter.parse`.
A recorded trace is a directory (or a ``.tar.gz`` of one) of ``<unix_ms>.prom`` files, optionally
with ``phases.json`` (what a load driver did in each phase). Replay uses the file timestamps,
never the wall clock.
"""
from __future__ import annotations

import json
import os
import re
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import requests
from urllib3.exceptions import ReadTimeoutError

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
_PROM_FILE = re.compile(r"(?:^|/)(\d{10,16})\.prom$")


class ScrapeError(Exception):
    """A scrape failed; ``reason`` is a short label value for ``kvhit_scrape_errors_total``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class LiveSource:
    """Scrapes a vLLM ``/metrics`` URL with requests.

    Args:
        url: the full /metrics URL (e.g. http://localhost:8000/metrics).
        timeout: connect+read timeout per scrape [s].
        max_bytes: body-size cap [bytes] (after gzip decoding); larger bodies are an error.
    """

    url: str
    timeout: float = 3.0
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        self._session = requests.Session()
        self._session.headers["Accept"] = "text/plain;version=0.0.4"

    def fetch(self) -> tuple[float, str]:
        """One scrape → (unix time of the request, body text).

        Raises:
            ScrapeError: reason one of refused, timeout, http_<status>, too_large, error.
        """
        start = time.time()
        deadline = time.monotonic() + self.timeout
        try:
            with self._session.get(self.url, timeout=self.timeout, stream=True, allow_redirects=True) as resp:
                if resp.status_code != 200:
                    raise ScrapeError(f"http_{resp.status_code}", f"HTTP {resp.status_code} from {self.url}")
                chunks, size = [], 0
                for chunk in resp.iter_content(chunk_size=65536):
                    size += len(chunk)
                    if size > self.max_bytes:
                        raise ScrapeError("too_large", f"body over {self.max_bytes} bytes from {self.url}")
                    if time.monotonic() > deadline:
                        raise ScrapeError("timeout", f"body not complete within {self.timeout}s from {self.url}")
                    chunks.append(chunk)
        except requests.ConnectionError as exc:
            # ConnectTimeout is a ConnectionError, and a read timeout while streaming the body
            # surfaces as ConnectionError(urllib3 ReadTimeoutError): both are timeouts.
            timed_out = isinstance(exc, requests.Timeout) or any(isinstance(a, ReadTimeoutError) for a in exc.args)
            if timed_out:
                raise ScrapeError("timeout", f"no complete answer within {self.timeout}s from {self.url}") from None
            raise ScrapeError("refused", f"cannot reach {self.url}: {type(exc).__name__}") from None
        except requests.Timeout:
            raise ScrapeError("timeout", f"no answer within {self.timeout}s from {self.url}") from None
        except requests.RequestException as exc:
            raise ScrapeError("error", f"scrape of {self.url} failed: {type(exc).__name__}") from None
        return start, b"".join(chunks).decode("utf-8", errors="replace")


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
