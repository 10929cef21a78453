"""kvhit's HTTP endpoints (WSGI, served by a threading wsgiref server).

- ``/metrics``: Prometheus exposition via prometheus-client (content negotiation, gzip).
- ``/healthz``: 200 while the process serves (liveness).
- ``/readyz``: 200 when a successful scrape is at most two intervals old, else 503.
- ``/api/v1/analysis``: the analysis as JSON (schema in :mod:`exporter.jsonapi`).
- ``/api/v1/predict?hit_ratio=H&isl=N&osl=N[&model_name=M]``: what-if from the current fit.
"""
from __future__ import annotations

import json
import threading
from dataclasses import asdict
from socketserver import ThreadingMixIn
from typing import Callable
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from exporter.collector import KvhitCollector
from exporter.jsonapi import analysis_to_dict, load_fit
from exporter.runner import Runner


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # access logs are noise in a sidecar
        pass


def _json(start_response: Callable, status: str, body: dict) -> list[bytes]:
    data = json.dumps(body, indent=1).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
    return [data]


def _text(start_response: Callable, status: str, body: str) -> list[bytes]:
    data = body.encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data)))])
    return [data]


def make_app(runner: Runner) -> Callable:
    """The WSGI application for one runner (a fresh registry holding kvhit's collector only)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvhitCollector(runner.current))
    metrics_app = make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable) -> list[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return metrics_app(environ, start_response)
        if path == "/healthz":
            return _text(start_response, "200 OK", "ok\n")
        if path == "/readyz":
            ok = runner.ready()
            return _text(start_response, "200 OK" if ok else "503 Service Unavailable",
                         "ready\n" if ok else "no fresh scrape of the target\n")
        if path == "/api/v1/analysis":
            analysis, health = runner.current()
            return _json(start_response, "200 OK", analysis_to_dict(analysis, health))
        if path == "/api/v1/predict":
            return _predict(runner, environ, start_response)
        return _text(start_response, "404 Not Found",
                     "kvhit: /metrics /healthz /readyz /api/v1/analysis /api/v1/predict\n")

    return app


def _predict(runner: Runner, environ: dict, start_response: Callable) -> list[bytes]:
    q = {k: v[-1] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}
    analysis, health = runner.current()
    try:
        name, fitted, m = load_fit(analysis_to_dict(analysis, health), q.get("model_name"))
        h = float(q["hit_ratio"])
        isl = float(q.get("isl", m.get("isl") or "nan"))
        osl = float(q.get("osl", m.get("osl") or "nan"))
        pred = fitted.predict(h, isl, osl)
    except KeyError:
        return _json(start_response, "400 Bad Request", {"error": "hit_ratio is required"})
    except ValueError as exc:
        return _json(start_response, "400 Bad Request", {"error": str(exc)})
    return _json(start_response, "200 OK", {"model_name": name, "prediction": asdict(pred)})


def serve(runner: Runner, listen: str) -> tuple[WSGIServer, threading.Thread]:
    """Start serving on ``listen`` ("host:port") in a daemon thread; returns (server, thread).

    Raises:
        OSError: the address cannot be bound.
    """
    host, _, port = listen.rpartition(":")
    server = make_server(host.strip("[]") or "0.0.0.0", int(port), make_app(runner),
                         server_class=_ThreadingServer, handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="kvhit-http", daemon=True)
    thread.start()
    return server, thread
