"""``kvhit calibrate``: a controlled hit-ratio sweep against a live OpenAI-compatible endpoint.

The answer to "the hit ratio in production never moves enough to fit": minutes of active
calibration on a staging replica instead of hours of offline profiling. The driver sends
``/v1/completions`` requests whose prompts are token ids — a block-aligned prefix shared by
every request of a phase plus a random per-request suffix — so the token-level hit ratio of
each phase is set by design (MODEL.md §1, §2). A recorder scrapes the endpoint's ``/metrics``
every interval into the replay format (``<unix_ms>.prom`` files, ``phases.json``,
``requests.jsonl``); the recording is then replayed through the whole pipeline
(:func:`exporter.replay.replay`) and the calibrated model is printed and written as a JSON report:
TPS0 and a (MODEL.md §4), T_fixed, k_ffn, k_attn and the other §7 chip-time terms, the
load-aware layer and α (§3.2) where identifiable, each with its standard error, plus each
phase's leave-one-phase-out errors of busy (chip) time and of the load-aware mean TTFT.

Design of a phase with designed hit ratio h, prompt length N and KV block size B:

- shared prefix P = h·N rounded to the nearest whole block (halves up), at most floor((N−1)/B)·B
  tokens (vLLM never serves the last prompt token from cache, and caches whole blocks only);
- expected token hit ratio = min(floor(P/B)·B, floor((N−1)/B)·B) / N (= P/N, P being a multiple
  of B no larger than the cap);
- the prefix is fresh random tokens for every phase of every run (seeded from the OS), so no
  earlier phase or run can leak hits; one warm-up request (max_tokens=1) caches it just before
  the phase starts (outside the phase's window); the suffix is random per request, so it never
  hits.

A phase is [start, end]: requests are issued in a closed loop by ``concurrency`` workers until
``start + duration`` and the phase ends when the last one finished. The workers' first requests
are spaced by the previous phase's median latency / concurrency, so identical requests do not run
in lockstep (all admitted and finished in the same engine step, leaving the engine idle between
batches and ``num_requests_running`` at 0 at many scrapes). A step of the recording
belongs to a phase when both its scrapes fall inside (MODEL.md §7), as in
:func:`exporter.replay.phase_steps`.
"""
from __future__ import annotations

import argparse
import html
import json
import logging
import math
import os
import random
import re
import secrets
import shutil
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import requests

from exporter.analyzer import ModelAnalysis
from exporter.config import ConfigError, load_config
from exporter.jsonapi import analysis_to_dict
from exporter.parse import ParseError, parse_exposition, prefix_caching_off
from exporter.replay import PhaseSummary, fmt, phase_footnotes, replay
from exporter.sources import LiveSource, ScrapeError, http_session, load_trace, trace_file, write_atomic

log = logging.getLogger("kvhit")

REPORT_SCHEMA_VERSION = 1
DEFAULT_HIT_RATIOS = (0.0, 0.3, 0.5, 0.7, 0.9, 0.97)
# Token ids drawn for prompts: [lo, hi). Valid for any vocabulary of at least 8k entries and clear
# of the low ids where tokenizers keep their special tokens.
DEFAULT_TOKEN_RANGE = (1000, 8000)
# A phase's measured hit ratio further than this from its design is reported as suspect.
HIT_TOLERANCE = 0.03
# A phase with fewer busy steps is reported as resting on too little (its left-out error is one or
# two steps' noise).
MIN_BUSY_STEPS = 3


class CalibrationError(ValueError):
    """The sweep cannot go on (endpoint refuses requests, no metrics, …); message says why."""


# --- design ---------------------------------------------------------------------------------


def max_hit_tokens(isl: int, block_size: int) -> int:
    """Most prompt tokens a prefix cache can serve: whole blocks of the first N−1 tokens [tokens].

    vLLM always recomputes the last prompt token (it needs its logits) and caches full blocks.
    """
    if isl < 1 or block_size < 1:
        raise ValueError("isl and block_size must be ≥ 1")
    return ((isl - 1) // block_size) * block_size


def shared_prefix_tokens(hit_ratio: float, isl: int, block_size: int) -> int:
    """Block-aligned shared prefix for a designed hit ratio: h·N rounded to the nearest whole
    block (halves up), capped at :func:`max_hit_tokens` [tokens]."""
    if not (0.0 <= hit_ratio <= 1.0):
        raise ValueError(f"hit ratio must be in [0, 1], got {hit_ratio!r}")
    blocks = math.floor(hit_ratio * isl / block_size + 0.5)  # nearest block, halves up
    return max(0, min(blocks * block_size, max_hit_tokens(isl, block_size)))


def expected_hit_ratio(prefix_tokens: int, isl: int, block_size: int) -> float:
    """Token hit ratio a request with a cached ``prefix_tokens`` prefix gets (MODEL.md §1):
    min(floor(P/B)·B, floor((N−1)/B)·B) / N [1]."""
    hit = min((prefix_tokens // block_size) * block_size, max_hit_tokens(isl, block_size))
    return hit / isl


@dataclass(frozen=True)
class PhasePlan:
    """One phase of the sweep (fields as in the recorded trace's phases.json)."""

    name: str
    intended_hit_ratio: float
    shared_prefix_tokens: int
    expected_token_hit_ratio: float
    prompt_tokens: int
    output_tokens: int
    concurrency: int
    duration_s: float
    seed: int


def plan_phases(hit_ratios: list[float], isl: int, osl: int, concurrency: int, duration_s: float,
                block_size: int, seed_base: int) -> list[PhasePlan]:
    """The sweep's phases in the given order, named ``P<i>_hit<h>``."""
    plans = []
    for i, h in enumerate(hit_ratios):
        prefix = shared_prefix_tokens(h, isl, block_size)
        plans.append(PhasePlan(
            name=f"P{i}_hit{h:g}", intended_hit_ratio=h, shared_prefix_tokens=prefix,
            expected_token_hit_ratio=expected_hit_ratio(prefix, isl, block_size), prompt_tokens=isl,
            output_tokens=osl, concurrency=concurrency, duration_s=duration_s, seed=seed_base + i))
    return plans


class PromptFactory:
    """Prompts of one phase: the phase's shared prefix + a fresh random suffix per request.

    Thread-safe; the prefix is drawn once from ``seed``, suffixes from an independent stream.
    """

    def __init__(self, plan: PhasePlan, token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> None:
        lo, hi = token_range
        if not (0 <= lo < hi):
            raise ValueError(f"token range must satisfy 0 <= lo < hi, got {token_range}")
        self.plan, self.lo, self.hi = plan, lo, hi
        rng = random.Random(plan.seed)
        self.prefix = [rng.randrange(lo, hi) for _ in range(plan.shared_prefix_tokens)]
        self._rng = random.Random(rng.getrandbits(64))
        self._lock = threading.Lock()

    def prompt(self) -> list[int]:
        n = self.plan.prompt_tokens - len(self.prefix)
        with self._lock:
            suffix = [self._rng.randrange(self.lo, self.hi) for _ in range(n)]
        return self.prefix + suffix


# --- recording ------------------------------------------------------------------------------


class Recorder:
    """Scrapes ``url`` every ``interval`` seconds into ``<unix_ms>.prom`` files (replay format).

    Files are written under a temporary name and renamed, so a reader never sees half a file.
    Scrape failures are counted by reason (as kvhit_scrape_errors_total does) and skipped.
    """

    def __init__(self, url: str, out_dir: Path, interval: float, timeout: float = 3.0) -> None:
        self.source = LiveSource(url, timeout=timeout)
        self.out_dir, self.interval = out_dir, interval
        self.scrapes = 0
        self.errors: dict[str, int] = {}
        self.last_error = ""  # the message of the latest failed scrape
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvhit-recorder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def scrape_once(self) -> tuple[float, str] | None:
        try:
            t, text = self.source.fetch()
        except ScrapeError as exc:
            self.errors[exc.reason] = self.errors.get(exc.reason, 0) + 1
            self.last_error = str(exc)
            return None
        write_atomic(self.out_dir / f"{int(t * 1000)}.prom", text)
        self.scrapes += 1
        return t, text

    def _loop(self) -> None:
        # after a scrape_once (the caller's first recorded scrape) the next is one interval
        # later: two scrapes 20 ms apart would make a first step of 0.02 s
        due = time.monotonic() + (self.interval if self.scrapes else 0.0)
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            self.scrape_once()
            due += self.interval
            now = time.monotonic()
            if due < now:  # a slow scrape: skip the missed slots, keep the grid
                due += math.ceil((now - due) / self.interval) * self.interval


# --- driving --------------------------------------------------------------------------------


@dataclass
class Progress:
    """Progress bar on a stream: phase, its bar, time left in it and in the whole sweep.

    On a terminal the line is redrawn in place every second; otherwise a line is printed every
    ``plain_every`` seconds (CI logs).
    """

    plans: list[PhasePlan]
    stream: TextIO
    overhead_s: float = 3.0  # per phase: warm-up and the last requests' tail
    plain_every: float = 10.0
    index: int = 0
    start: float | None = None
    done: int = 0
    failed: int = 0
    _last_plain: float = field(default=-math.inf, repr=False)

    def line(self, now: float) -> str:
        plan = self.plans[self.index]
        phase_left = plan.duration_s if self.start is None else max(0.0, self.start + plan.duration_s - now)
        rest = sum(p.duration_s + self.overhead_s for p in self.plans[self.index + 1:])
        return progress_line(self.index, len(self.plans), plan.name, plan.duration_s, phase_left,
                             phase_left + rest, self.done, self.failed)

    def draw(self, final: bool = False) -> None:
        now = time.time()
        tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        if tty:
            self.stream.write("\r" + self.line(now) + ("\n" if final else ""))
            self.stream.flush()
        elif final or now - self._last_plain >= self.plain_every:
            self._last_plain = now
            self.stream.write(self.line(now) + "\n")
            self.stream.flush()


def progress_line(index: int, count: int, name: str, duration: float, phase_left: float, total_left: float,
                  done: int, failed: int, width: int = 24) -> str:
    """``[2/5] P1_hit0.5 [#########---------------]  31s left in phase, 2m05s left in sweep, 143 ok, 0 failed``."""
    frac = 0.0 if duration <= 0 else min(1.0, max(0.0, 1.0 - phase_left / duration))
    filled = int(round(frac * width))
    total = int(round(total_left))
    return (f"[{index + 1}/{count}] {name} [{'#' * filled}{'-' * (width - filled)}] "
            f"{phase_left:3.0f}s left in phase, {total // 60}m{total % 60:02d}s left in sweep, "
            f"{done} ok, {failed} failed")


class Driver:
    """Sends the phases' requests to ``/v1/completions`` and records what happened."""

    def __init__(self, completions_url: str, model: str, token_range: tuple[int, int],
                 request_timeout: float = 120.0, requests_log: TextIO | None = None,
                 progress: Progress | None = None) -> None:
        self.url, self.model, self.token_range = completions_url, model, token_range
        self.timeout = request_timeout
        self.requests_log = requests_log
        self.progress = progress
        self.abort = threading.Event()
        self._lock = threading.Lock()
        # Median request latency of the previous phase [s]: spaces the workers' first requests so
        # a closed loop of identical requests does not run in lockstep (all admitted, all finished
        # in the same engine step, the engine idle between batches).
        self.latency_estimate: float | None = None

    def _send(self, session: requests.Session, prompt: list[int], max_tokens: int) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0.0, "stream": False}
        t_send = time.time()
        try:
            resp = session.post(self.url, json=body, timeout=self.timeout)
        except requests.RequestException as exc:
            return {"t_send": t_send, "t_done": time.time(), "ok": False, "error": type(exc).__name__}
        t_done = time.time()
        if resp.status_code != 200:
            # one line of the body (vLLM's JSON error, a proxy's error page), for the log and the message
            text = resp.text
            if "html" in resp.headers.get("Content-Type", "") or text.lstrip().startswith("<"):
                text = html.unescape(re.sub(r"<[^>]*>", " ", text))  # a page's words, not its markup
            return {"t_send": t_send, "t_done": t_done, "ok": False, "error": f"HTTP {resp.status_code}",
                    "detail": " ".join(text.split())[:200]}
        try:
            usage = resp.json().get("usage")
        except ValueError:
            usage = None
        return {"t_send": t_send, "t_done": t_done, "latency_s": t_done - t_send, "ok": True, "usage": usage}

    def _log(self, phase: str, worker: int | str, rec: dict) -> None:
        with self._lock:
            if self.requests_log is not None and not self.requests_log.closed:  # closed: after Ctrl-C
                self.requests_log.write(json.dumps({"phase": phase, "worker": worker, **rec}) + "\n")
            if self.progress is not None and worker != "warmup":
                if rec["ok"]:
                    self.progress.done += 1
                else:
                    self.progress.failed += 1

    def _failed(self, what: str, rec: dict) -> CalibrationError:
        return CalibrationError(f"{what} to {self.url} failed: {rec['error']} {rec.get('detail', '')}".strip())

    def probe(self, prompt_tokens: int, output_tokens: int, seed: int) -> None:
        """One request shaped like the phases' (random tokens from both ends of the token range,
        shared with none of them), before anything is recorded: a wrong endpoint, model, token
        range or a max-model-len below ISL+OSL fails here, not after a phase's worth of load.

        Raises:
            CalibrationError: the request failed (the server's status and the start of its answer).
        """
        rng = random.Random(seed)
        lo, hi = self.token_range
        # both ends of the range for sure (a server checks the largest id against its vocabulary)
        prompt = ([lo, hi - 1] + [rng.randrange(lo, hi) for _ in range(prompt_tokens)])[:prompt_tokens]
        with http_session() as session:
            rec = self._send(session, prompt, output_tokens)
        if not rec["ok"]:
            if "Timeout" in rec["error"]:
                rec["detail"] = f"(no answer within --request-timeout {self.timeout:g} s)"
            elif rec["error"] in ("HTTP 404", "HTTP 405", "HTTP 501"):  # a server without POST there (a newcomer's find)
                rec["detail"] = ("(no OpenAI completions endpoint there: is --endpoint a vLLM OpenAI-compatible server? "
                                 f"kvhit simulate serves /metrics only) {rec.get('detail', '')}")
            raise self._failed("a first request", rec)

    def warm_up(self, plan: PhasePlan, prompts: PromptFactory) -> dict | None:
        """Cache the phase's prefix with one request (max_tokens=1); None when there is no prefix."""
        if plan.shared_prefix_tokens == 0:
            return None
        with http_session() as session:
            rec = self._send(session, prompts.prompt(), 1)
        self._log(plan.name, "warmup", rec)
        if not rec["ok"]:
            raise self._failed(f"warm-up request of {plan.name}", rec)
        return {"t_send": rec["t_send"], "t_done": rec["t_done"], "prompt_tokens": plan.prompt_tokens,
                "max_tokens": 1}

    def run_phase(self, plan: PhasePlan, prompts: PromptFactory, settle_s: float = 0.5) -> dict:
        """Warm up, then drive the phase; returns its phases.json record."""
        warm = self.warm_up(plan, prompts)
        if warm is not None:
            time.sleep(settle_s)  # the warm-up's counters land before the phase's first scrape
        start = time.time()
        deadline = start + plan.duration_s
        if self.progress is not None:
            self.progress.start = start
        counts = {"ok": 0, "failed": 0}
        errors: list[str] = []
        latencies: list[float] = []
        stagger = min(self.latency_estimate or 0.0, plan.duration_s / 2) / plan.concurrency

        failures: list[BaseException] = []

        def worker(i: int) -> None:
            try:
                if self.abort.wait(i * stagger):
                    return
                with http_session() as session:
                    while time.time() < deadline and not self.abort.is_set():
                        rec = self._send(session, prompts.prompt(), plan.output_tokens)
                        self._log(plan.name, i, rec)
                        with self._lock:
                            counts["ok" if rec["ok"] else "failed"] += 1
                            if rec["ok"]:
                                latencies.append(rec["latency_s"])
                            if not rec["ok"]:
                                errors.append(f"{rec['error']} {rec.get('detail', '')}".strip())
                                if counts["failed"] >= 5 and counts["failed"] > counts["ok"]:
                                    self.abort.set()
            except BaseException as exc:  # raised again in the caller's thread
                failures.append(exc)
                self.abort.set()

        # daemon threads: after Ctrl-C the caller goes on (and the process exits) without waiting
        # for the requests in flight, up to --request-timeout each (a pool's workers were joined
        # at exit, and a second Ctrl-C there ended in a traceback)
        threads = [threading.Thread(target=worker, args=(i,), name=f"kvhit-calibrate-{i}", daemon=True)
                   for i in range(plan.concurrency)]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        except BaseException:  # Ctrl-C: the workers stop after their current request, unwaited
            self.abort.set()
            raise
        if failures:
            raise failures[0]
        end = time.time()
        median = statistics.median(latencies) if latencies else None
        if median is not None:
            self.latency_estimate = median
        if self.abort.is_set() and counts["failed"] > counts["ok"]:
            raise CalibrationError(f"phase {plan.name}: {counts['failed']} of {counts['ok'] + counts['failed']} "
                                   f"requests failed (first: {errors[0] if errors else '?'})")
        return {
            "name": plan.name, "start_unix": start, "issue_deadline_unix": deadline, "end_unix": end,
            "start_ms": int(start * 1000), "end_ms": int(end * 1000),
            "intended_hit_ratio": plan.intended_hit_ratio, "shared_prefix_tokens": plan.shared_prefix_tokens,
            "expected_token_hit_ratio": plan.expected_token_hit_ratio, "prompt_tokens": plan.prompt_tokens,
            "output_tokens": plan.output_tokens, "concurrency": plan.concurrency, "duration_s": plan.duration_s,
            "requests_completed": counts["ok"], "requests_failed": counts["failed"], "warmup_request": warm,
            "median_latency_s": median,
            "worker_stagger_s": stagger, "seed": plan.seed,
        }


# --- analysis and report --------------------------------------------------------------------


def _est(value: float | None, stderr: float | None = None, status: str = "ok", reason: str = "",
         unit: str = "") -> dict:
    """One report parameter; the value (and its stderr) only when its status is ok (MODEL.md §6)."""
    ok = status == "ok" and value is not None and math.isfinite(value)
    return {"value": value if ok else None,
            "stderr": stderr if ok and stderr is not None and math.isfinite(stderr) else None,
            "status": status, "reason": "" if ok else reason, "unit": unit}


def calibrated_parameters(m: ModelAnalysis) -> dict[str, dict]:
    """The calibrated model as {name: {value, stderr, status, reason, unit}} (value None unless ok)."""
    out: dict[str, dict] = {}
    slope = m.fits["miss_slope"]
    for key, unit in (("tps0", "tokens/s"), ("a", "1")):
        e = slope.params.get(key)
        status = slope.status.value if not slope.ok else (e.status.value if e else "unknown")
        out[f"{key}_direct"] = _est(e.value if e else None, e.stderr if e else None, status,
                                    slope.reason or (e.reason if e else ""), unit)
    why = m.unknown.get("miss_slope_derived", "needs the chip-time fit and an h span")
    for key, unit in (("tps0", "tokens/s"), ("a", "1")):
        e = m.miss_slope_derived.get(key)
        out[f"{key}_derived"] = _est(e.value if e else None, e.stderr if e else None,
                                     "ok" if e else "unknown", "" if e else why, unit)
    chip = m.fits["chip_time"]
    units = {"t_step": "s/step", "k_ffn": "s/token", "k_attn": "s/token^2", "k_dec": "s/token",
             "k_ctx": "s/token^2"}
    for key, unit in units.items():
        e = chip.params.get(key)
        status = chip.status.value if not chip.ok else (e.status.value if e else "unknown")
        out[key] = _est(e.value if e else None, e.stderr if e else None, status,
                        chip.reason or (e.reason if e else ""), unit)
    if m.fitted is not None and chip.ok and "fixed_time" not in m.unknown:
        se = m.fitted.t_fixed_stderr  # the full-load machine's, as T_fixed
        out["t_fixed"] = _est(m.fitted.t_fixed, se if se is not None and math.isfinite(se) else None,
                              unit="s", reason=f"t_step of all engines at full load x "
                                                f"{m.fitted.steps_per_request:.2f} engine steps per request (last "
                                                f"publish window)")
    else:
        step = out["t_step"]["status"]  # withheld for T_step's status, or (T_step ok) for the steps
        out["t_fixed"] = _est(None, status="unknown" if step == "ok" else step,
                              reason=chip.reason or m.unknown.get("fixed_time", "no fit"), unit="s")
    la = m.fits["load_aware"]
    for key, unit in (("c0", "1"), ("c1", "1/request")):
        e = la.params.get(key)
        status = la.status.value if not la.ok else (e.status.value if e else "unknown")
        out[key] = _est(e.value if e else None, e.stderr if e else None, status,
                        la.reason or (e.reason if e else ""), unit)
    ov = m.fits["overlap"]
    e = ov.params.get("alpha")
    out["alpha"] = _est(e.value if e else None, e.stderr if e else None,
                        ov.status.value if not ov.ok else (e.status.value if e else "unknown"),
                        ov.reason or (e.reason if e else ""), "1")
    return out


def _abs_summary(errors: list[float | None]) -> dict:
    vals = [abs(e) for e in errors if e is not None and math.isfinite(e)]
    if not vals:
        return {"phases": 0, "max_abs_error": None, "median_abs_error": None, "mean_abs_error": None}
    return {"phases": len(vals), "max_abs_error": max(vals), "median_abs_error": statistics.median(vals),
            "mean_abs_error": sum(vals) / len(vals)}


def phase_rows(records: list[dict], summaries: list[PhaseSummary]) -> list[dict]:
    """Per-phase report rows: the driver's design next to what the recording measured."""
    by_name = {s.name: s for s in summaries}
    rows = []
    for rec in records:
        s = by_name.get(rec["name"])
        row = {k: rec[k] for k in ("name", "intended_hit_ratio", "shared_prefix_tokens", "expected_token_hit_ratio",
                                   "prompt_tokens", "output_tokens", "concurrency", "duration_s",
                                   "requests_completed", "requests_failed", "median_latency_s", "start_ms",
                                   "end_ms")}
        if s is not None:
            row.update({k: v for k, v in asdict(s).items() if k not in ("name", "designed_hit_ratio")})
            row["measured_hit_ratio"] = s.hit_ratio
            row["hit_ratio_error"] = None if s.hit_ratio is None else s.hit_ratio - rec["expected_token_hit_ratio"]
        rows.append(row)
    return rows


def print_report(report: dict, out: TextIO | None = None) -> None:
    """Human summary: per-phase table, the calibrated model, the leave-one-phase-out errors."""
    w = (sys.stdout if out is None else out).write
    w(f"\ncalibration of {report['model']} at {report['endpoint']} ({len(report['phases'])} phases, "
      f"ISL={report['settings']['isl']} OSL={report['settings']['osl']} "
      f"concurrency={report['settings']['concurrency']}, block {report['settings']['block_size']})\n")
    w(f"{'phase':12s} {'expect':>6s} {'h':>7s} {'reqs':>5s} {'busy':>4s} {'busy[s]':>8s} {'pred[s]':>8s} "
      f"{'err':>7s} {'TTFT[s]':>8s} {'pred[s]':>8s} {'err':>7s}\n")
    for p in report["phases"]:
        flag = " !" if p.get("hit_ratio_error") is not None and abs(p["hit_ratio_error"]) > HIT_TOLERANCE else ""
        w(f"{p['name'][:12]:12s} {p['expected_token_hit_ratio']:6.3f} {fmt(p.get('measured_hit_ratio'), '.4f'):>7s} "
          f"{p['requests_completed']:5d} {p.get('busy_steps', 0):4d} {p.get('busy_seconds', 0.0):8.1f} "
          f"{fmt(p.get('predicted_busy_seconds'), '.1f'):>8s} {_pct(p.get('busy_error')):>7s} "
          f"{fmt(p.get('ttft_seconds'), '.4f'):>8s} {fmt(p.get('predicted_ttft_seconds'), '.4f'):>8s} "
          f"{_pct(p.get('ttft_error')):>7s}{flag}\n")
    for line in phase_footnotes(report["phases"]):
        w(f"  {line}\n")
    w("(h measured = Δhits/Δqueries inside the phase; busy and TTFT predicted by models fitted without the phase)\n")
    w("\ncalibrated model (value ± standard error):\n")
    for name, e in report["parameters"].items():
        if e["value"] is not None:
            se = "" if e["stderr"] is None else f" ± {e['stderr']:.3g}"
            w(f"  {name:12s} {e['value']:.6g}{se} [{e['unit']}]\n")
        else:
            w(f"  {name:12s} {e['status']}: {e['reason']}\n")
    lopo = report["leave_one_phase_out"]
    for key, label in (("busy_time", "busy (chip) time"), ("ttft_load_aware", "mean TTFT, load-aware layer")):
        s = lopo[key]
        if s["phases"]:
            w(f"leave-one-phase-out {label}: max |err| {100 * s['max_abs_error']:.1f}%, median "
              f"{100 * s['median_abs_error']:.1f}% over {s['phases']} phases\n")
        else:
            w(f"leave-one-phase-out {label}: not computable\n")
    bad = [p["name"] for p in report["phases"]
           if p.get("hit_ratio_error") is None or abs(p["hit_ratio_error"]) > HIT_TOLERANCE]
    if bad:
        w(f"WARNING: measured hit ratio off the design by more than {HIT_TOLERANCE} (or unknown) in {', '.join(bad)}: "
          "is prefix caching on, the block size right, the KV cache large enough?\n")
    few = [f"{p['name']} ({p.get('busy_steps', 0)})" for p in report["phases"] if p.get("busy_steps", 0) < MIN_BUSY_STEPS]
    if few:
        w(f"WARNING: fewer than {MIN_BUSY_STEPS} busy steps (both scrapes with requests running, MODEL.md §7) in "
          f"{', '.join(few)}: the phase's chip time rests on too little; scrape more often (--interval) or "
          "run longer phases (--phase-seconds)\n")
    slow = [f"{p['name']} ({p['median_latency_s']:.3g} s of {p['duration_s']:g} s)" for p in report["phases"]
            if (p.get("median_latency_s") or 0.0) > p["duration_s"] / 2]
    if slow:
        w(f"WARNING: requests took over half the phase (median latency) in {', '.join(slow)}: each worker sent one "
          "or two, so the phase saw about one round of requests started together; run longer phases "
          "(--phase-seconds) or fewer requests in flight (--concurrency)\n")


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:+.1f}%"


# --- command --------------------------------------------------------------------------------


def _urls(endpoint: str, metrics_url: str | None) -> tuple[str, str]:
    base = endpoint.rstrip("/")
    if base.endswith("/v1/completions"):
        base = base[: -len("/v1/completions")]
    elif base.endswith("/v1"):
        base = base[: -len("/v1")]
    if not base.startswith(("http://", "https://")):
        raise ConfigError(f"--endpoint {endpoint}: must be an http(s) URL")
    if base.endswith("/metrics"):
        raise ConfigError(f"--endpoint {endpoint}: the OpenAI-compatible API's base URL (e.g. http://localhost:8000), "
                          "not its /metrics: calibrate sends /v1/completions there and reads <base>/metrics "
                          "(--metrics-url to read another)")
    return base + "/v1/completions", metrics_url or base + "/metrics"


def _hit_ratios(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--hit-ratios {text}: comma-separated numbers in [0, 1]") from None
    if len(values) < 2 or any(not (0.0 <= v <= 1.0) for v in values):
        raise ConfigError(f"--hit-ratios {text}: at least two values, each in [0, 1]")
    return values


def _token_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigError(f"--token-range {text}: LO:HI (integers)") from None
    if not 0 <= lo < hi:
        raise ConfigError(f"--token-range {text}: need 0 <= LO < HI")
    return lo, hi


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``calibrate`` subcommand's flags."""
    p.add_argument("--endpoint", required=True, help="base URL of the OpenAI-compatible server (e.g. http://127.0.0.1:8000)")
    p.add_argument("--model", required=True, help="served model name (the model_name label of its metrics)")
    p.add_argument("--metrics-url", dest="metrics_url", help="its /metrics (default ENDPOINT/metrics)")
    p.add_argument("--isl", type=int, default=2048, help="prompt tokens per request (default 2048)")
    p.add_argument("--osl", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight (default 4)")
    p.add_argument("--hit-ratios", dest="hit_ratios", default=",".join(f"{h:g}" for h in DEFAULT_HIT_RATIOS),
                   help="designed hit ratios, comma-separated, in sweep order (default %(default)s)")
    p.add_argument("--phase-seconds", dest="phase_seconds", type=float, default=60.0,
                   help="seconds of load per phase (default 60)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between /metrics scrapes (default 2)")
    p.add_argument("--block-size", dest="block_size", type=int,
                   help="KV block size in tokens (default: block_size of vllm:cache_config_info)")
    p.add_argument("--token-range", dest="token_range", default=f"{DEFAULT_TOKEN_RANGE[0]}:{DEFAULT_TOKEN_RANGE[1]}",
                   help="prompt token ids are drawn from [LO, HI) (default %(default)s; HI ≤ the vocabulary)")
    p.add_argument("--out", help="directory for the recording (default ./kvhit-calibrate-<unix time>)")
    p.add_argument("--report", help="JSON report path (default OUT/report.json)")
    p.add_argument("--request-timeout", dest="request_timeout", type=float, default=120.0,
                   help="seconds per request (default 120)")
    p.add_argument("--config", help="YAML config for the analysis (geometry, prices)")


def _validate(args: argparse.Namespace) -> None:
    for name, value, low in (("isl", args.isl, 2), ("osl", args.osl, 1), ("concurrency", args.concurrency, 1)):
        if value < low:
            raise ConfigError(f"--{name} {value}: must be ≥ {low}")
    for name, value in (("phase-seconds", args.phase_seconds), ("interval", args.interval),
                        ("request-timeout", args.request_timeout)):
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--{name} {value}: must be a finite number > 0")
    if args.phase_seconds < 3 * args.interval:
        raise ConfigError(f"--phase-seconds {args.phase_seconds}: at least 3 scrape intervals ({3 * args.interval:g} s)")
    if args.block_size is not None and args.block_size < 1:
        raise ConfigError(f"--block-size {args.block_size}: must be ≥ 1")


def cmd_calibrate(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the sweep, record, fit, print and write the report (stdout; progress on stderr).

    Returns 0 (130 after Ctrl-C, with the phases completed so far analysed). Raises ConfigError
    for bad arguments, CalibrationError when the endpoint cannot be driven or scraped.
    """
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    _validate(args)
    hit_ratios = _hit_ratios(args.hit_ratios)
    token_range = _token_range(args.token_range)
    completions_url, metrics_url = _urls(args.endpoint, args.metrics_url)
    cfg = load_config(getattr(args, "config", None), flags={"interval": args.interval})
    # output paths are checked before the sweep: found after it, they lost its report
    if args.report and Path(args.report).is_dir():
        raise ConfigError(f"--report {args.report}: is a directory, not a file")
    out_dir = Path(args.out or f"kvhit-calibrate-{int(time.time())}")
    if out_dir.is_dir() and any(out_dir.glob("*.prom")):
        raise ConfigError(f"--out {out_dir}: already holds a recording; choose a new directory")
    for flag, path, directory in (("--out", out_dir, out_dir), ("--report", args.report, Path(args.report or ".").parent)):
        if path is None:
            continue
        existing = next(a for a in (directory, *directory.parents) if a.exists())  # "." ends a relative path
        if not existing.is_dir() or not os.access(existing, os.W_OK):
            raise ConfigError(f"{flag} {path}: {existing} is not a writable directory")
    report_path = Path(args.report) if args.report else out_dir / "report.json"
    where, recording = report_path.resolve(), out_dir.resolve()
    if where == recording:  # --out not made yet: is_dir() above could not tell
        raise ConfigError(f"--report {args.report}: is the --out directory, not a file")
    if recording in where.parents and (trace_file(str(where)) or where.parent == recording
                                       and where.name in ("requests.jsonl", "fit.json")):
        raise ConfigError(f"--report {args.report}: is a file of the recording written to --out {out_dir}")

    # A first look at the endpoint, a probe, then the recording: a refusal leaves nothing behind,
    # and the probe's load falls before the recording's first scrape.
    recorder = Recorder(metrics_url, out_dir, args.interval, timeout=cfg.timeout)
    try:
        t_first, text = recorder.source.fetch()
        snap = parse_exposition(text, t_first)
    except ScrapeError as exc:
        raise CalibrationError(str(exc)) from None
    except ParseError as exc:
        raise CalibrationError(f"{metrics_url} is not Prometheus text: {exc}") from None
    if snap.models and args.model not in snap.models:  # vLLM labels its series with the served model's name
        raise ConfigError(f"--model {args.model}: the endpoint serves {sorted(snap.models)} (model_name in its /metrics)")
    block = args.block_size
    if block is None:
        raw = snap.cache_config.get("block_size")
        if not raw or not str(raw).isdigit():
            raise ConfigError("--block-size: required (the endpoint exports no cache_config_info block_size)")
        block = int(raw)
    if prefix_caching_off(snap.cache_config):
        raise CalibrationError(
            "the endpoint reports enable_prefix_caching=False: vLLM then counts no prefix-cache query, so no phase "
            "could measure a hit ratio; restart it with prefix caching on (the default) to calibrate")
    if args.isl - 1 < block:
        raise ConfigError(f"--isl {args.isl}: must exceed the block size {block} for any hit to be possible")
    seed_base = secrets.randbits(62)  # fresh prefixes every run: no earlier run can leak hits
    plans = plan_phases(hit_ratios, args.isl, args.osl, args.concurrency, args.phase_seconds, block, seed_base)
    # seed: none of the phases' (seed_base + i)
    Driver(completions_url, args.model, token_range, args.request_timeout).probe(args.isl, args.osl,
                                                                                 seed=seed_base + len(plans))
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        if recorder.scrape_once() is None:  # the endpoint went away since the first look
            raise CalibrationError(recorder.last_error)
    except BaseException:  # Ctrl-C included: no empty --out left behind
        if created:
            shutil.rmtree(out_dir, ignore_errors=True)
        raise

    progress = Progress(plans, stream=err)
    records: list[dict] = []
    started = time.time()
    print(f"kvhit calibrate: {len(plans)} phases of {args.phase_seconds:g}s against {completions_url} "
          f"(model {args.model}), recording {metrics_url} every {args.interval:g}s into {out_dir}", file=out, flush=True)
    with open(out_dir / "requests.jsonl", "w") as req_log:
        driver = Driver(completions_url, args.model, token_range, args.request_timeout, req_log, progress)
        stop_drawing = threading.Event()

        def draw() -> None:
            while not stop_drawing.wait(1.0):
                progress.draw()

        drawer = threading.Thread(target=draw, name="kvhit-progress", daemon=True)
        recorder.start()
        drawer.start()
        interrupted = False
        try:
            for i, plan in enumerate(plans):
                progress.index, progress.start = i, None
                records.append(driver.run_phase(plan, PromptFactory(plan, token_range)))
                _write_phases(out_dir, records, args, metrics_url, block, seed_base)
        except KeyboardInterrupt:
            interrupted = True
            driver.abort.set()
            print("\ninterrupted: analysing the phases completed so far", file=err)
        finally:
            try:
                _last_scrape_wait(args.interval)
            except KeyboardInterrupt:  # every phase recorded so far is still analysed
                interrupted = True
            recorder.stop()
            stop_drawing.set()
            drawer.join()
            progress.draw(final=True)
    _write_phases(out_dir, records, args, metrics_url, block, seed_base)
    if not records:
        if interrupted:  # Ctrl-C: 130, as after completed phases (README's exit codes), not a failure
            print(f"interrupted before any phase completed: nothing to analyse (the scrapes so far are in {out_dir})",
                  file=err)
            return 130
        raise CalibrationError("no phase completed")

    trace = load_trace(out_dir)
    result = replay(trace, cfg, metrics_url)
    analysis, health = result.runner.current()
    name = args.model if args.model in analysis.models else next(iter(analysis.models), None)
    if name is None:
        raise CalibrationError(f"no model analysed from {metrics_url}: {analysis.engine_reason or 'no data'}")
    m = analysis.models[name]
    rows = phase_rows(records, result.phases.get(name, []))
    report = {
        "schema_version": REPORT_SCHEMA_VERSION, "endpoint": args.endpoint, "metrics_url": metrics_url,
        "model": name, "trace_dir": str(out_dir), "started_unix": started, "finished_unix": time.time(),
        "interrupted": interrupted,
        "settings": {"isl": args.isl, "osl": args.osl, "concurrency": args.concurrency, "hit_ratios": hit_ratios,
                     "phase_seconds": args.phase_seconds, "interval": args.interval, "block_size": block,
                     "token_range": list(token_range), "seed_base": seed_base},
        "requests": {"completed": sum(r["requests_completed"] for r in records),
                     "failed": sum(r["requests_failed"] for r in records)},
        "scrapes": {"ok": recorder.scrapes, "errors": dict(recorder.errors)},
        "fits": {k: {"status": r.status.value, "reason": r.reason, "samples": r.samples,
                     "r2": r.r2 if math.isfinite(r.r2) else None} for k, r in m.fits.items()},
        "parameters": calibrated_parameters(m),
        "phases": rows,
        "leave_one_phase_out": {"busy_time": _abs_summary([r.get("busy_error") for r in rows]),
                                "ttft_load_aware": _abs_summary([r.get("ttft_error") for r in rows])},
        "analysis": analysis_to_dict(analysis, health),
    }
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report = _finite(report)
    write_atomic(report_path, json.dumps(report, indent=1, allow_nan=False))
    write_atomic(out_dir / "fit.json", json.dumps(report["analysis"], indent=1, allow_nan=False))
    print_report(report, out)
    print(f"\nreport: {report_path}   recording (kvhit replay): {out_dir}   fit (kvhit predict --fit): "
          f"{out_dir / 'fit.json'}", file=out, flush=True)
    return 130 if interrupted else 0


def _last_scrape_wait(interval: float) -> None:
    """Wait for one more scrape after the last phase's end."""
    time.sleep(interval * 1.5)


def _finite(o: object) -> object:
    """The document with every non-finite float replaced by None (JSON has no NaN)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def _write_phases(out_dir: Path, records: list[dict], args: argparse.Namespace, metrics_url: str, block: int,
                  seed_base: int) -> None:
    doc = {
        "server": {"url": args.endpoint, "metrics_url": metrics_url, "block_size": block, "model": args.model},
        "scrape_interval_s": args.interval,
        "prompt_kind": "token ids; shared random prefix (block aligned) + per-request random suffix",
        "note": ("each phase uses a fresh random prefix; one warm-up request (max_tokens=1) with that prefix is "
                 "sent just before start_unix and is outside the window"),
        "seed_base": seed_base,
        "phases": [{**r, "seed_base": seed_base} for r in records],
    }
    write_atomic(out_dir / "phases.json", json.dumps(doc, indent=1))

