"""kvhit against a real vLLM engine, end to end (issue 3). Runs on every CI run; never skipped.

One scenario (module fixture ``live``), then checks on what it recorded:

1. Build a tiny random-weight Llama + tokenizer (tests/e2e/tiny_model.py) with the vLLM venv
   (tests/e2e/vllm_env.sh, cached in ~/.cache/kvhit/vllm-venv) and serve it with vLLM
   (``--enable-prefix-caching --block-size 32``, 127.0.0.1).
2. Start ``kvhit run`` as its own process, scraping vLLM over HTTP through a recording proxy (the
   test keeps every body kvhit ingested, so it can recompute each window from the same scrapes).
3. Run ``kvhit calibrate`` (5 designed hit ratios) as another process.
4. SIGKILL vLLM (counters reset), restart it, drive some load, and let kvhit recover by itself.
5. Stop everything by PID (process groups), also when something fails.

Every expected number is derived here from vLLM's own /metrics or by hand, never copied from
kvhit's output.
"""
from __future__ import annotations

import bisect
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

from live_harness import (Heartbeat, KvhitSample, Poller, Proc, Record, RecordingProxy, drive_load, free_port,
                          paused_within, remove_leaked_shm, shm_entries, vllm_counter, wait_http)

pytestmark = pytest.mark.e2e

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MODEL = "tiny"
BLOCK = 32
ISL, OSL, CONCURRENCY = 1024, 64, 16
HIT_LEVELS = (0.0, 0.3, 0.6, 0.8, 0.95)
PHASE_SECONDS = 25.0
INTERVAL = 2.0  # kvhit run
# The calibration recorder: at h = 0.95 the engine idles between lockstep batches while the API
# server (2 shared cores) turns requests around, so only ~1/3 of steps have requests running at both
# scrapes (MODEL.md §7's busy step): 12 steps of 2 s fell under 3 busy ones about one run in five
# (binomial, p = 1/3); 1-s scrapes double the steps
CAL_INTERVAL = 1.0
# vLLM's API server shares 2 cores with its engine and this test: its /metrics can take seconds
# under load. Timeouts (proxy < kvhit) leave room for that.
PROXY_TIMEOUT, KVHIT_TIMEOUT = 7.0, 9.0
STALL_TIMEOUTS = 3  # kvhit scrape timeouts tolerated while vLLM is up (a starved CI machine)
MAX_MODEL_LEN = 4096
AFTER_RESTART_REQUESTS = 10  # requests served after the restart, at least
BUDGET_SECONDS = 600.0  # the whole scenario, on 2 cores
HIT_TOLERANCE = 0.03
QUERIES, HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"

SUMMARY: list[str] = []  # printed by conftest's terminal summary


@dataclass
class Live:
    out: Path
    records: list[Record] = field(default_factory=list)
    attempts: list[tuple[float, float]] = field(default_factory=list)  # the proxy's upstream requests: (t, seconds)
    samples: list[KvhitSample] = field(default_factory=list)
    poll_failures: list[str] = field(default_factory=list)
    pauses: list[tuple[float, float]] = field(default_factory=list)  # of this test process (Heartbeat)
    calibrate: subprocess.CompletedProcess | None = None
    report: dict = field(default_factory=dict)
    phases: list[dict] = field(default_factory=list)
    before_kill: KvhitSample | None = None
    t_kill: float = 0.0
    t_down_seen: float = 0.0
    t_restarted: float = 0.0
    t_recovered: float = 0.0
    after_restart_requests: int = 0
    kvhit_exit: int | None = None
    shm_removed: list[str] = field(default_factory=list)  # left in /dev/shm by the killed vLLM
    durations: dict[str, float] = field(default_factory=dict)


def _vllm_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


def _start_vllm(py: Path, model_dir: Path, port: int, log: Path) -> Proc:
    # `vllm serve` looks up a distribution named "vllm" (this one is "vllm-cpu"): use the module.
    # float32, not the weights' bf16: on a CPU without native bf16 (AVX2 only, as on CI's EPYC)
    # oneDNN refuses the bf16 matmul and torch emulates it, 4x slower (16 requests at h = 0 took
    # 43 s against 10.5 s), and a 25-s phase then finishes one wave of requests.
    argv = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port),
            "--enable-prefix-caching", "--block-size", str(BLOCK), "--max-model-len", str(MAX_MODEL_LEN),
            "--dtype", "float32"]
    return Proc("vllm", argv, log, env=_vllm_env())


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    """The vLLM venv's interpreter; the script creates the venv only when it is missing."""
    done = subprocess.run(["bash", str(HERE / "vllm_env.sh")], capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, f"vllm_env.sh failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    venv = Path(os.environ.get("E2E_VLLM_VENV", Path.home() / ".cache" / "kvhit" / "vllm-venv"))
    return venv / "bin" / "python"


@pytest.fixture(scope="module")
def live(vllm_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Live:
    # E2E_OUT_DIR keeps the artefacts (logs, recording, report) where pytest's tmp rotation won't.
    out = Path(os.environ["E2E_OUT_DIR"]) if os.environ.get("E2E_OUT_DIR") else tmp_path_factory.mktemp("kvhit-e2e")
    out.mkdir(parents=True, exist_ok=True)
    res = Live(out=out)
    procs: list[Proc] = []
    proxy = poller = None
    shm_before = shm_entries()
    t0 = time.monotonic()
    heartbeat = Heartbeat()
    heartbeat.start()
    try:
        model_dir = out / "model"
        subprocess.run([str(vllm_python), str(HERE / "tiny_model.py"), str(model_dir)], check=True,
                       capture_output=True, timeout=300, env=_vllm_env())
        res.durations["model_build"] = time.monotonic() - t0

        vport, kport = free_port(), free_port()
        base = f"http://127.0.0.1:{vport}"
        vllm = _start_vllm(vllm_python, model_dir, vport, out / "vllm.log")
        procs.append(vllm)
        res.durations["vllm_start"] = wait_http(base + "/health", 300, vllm)

        proxy = RecordingProxy(base + "/metrics", upstream_timeout=PROXY_TIMEOUT)
        proxy.start()
        kvhit = Proc("kvhit", [sys.executable, "-m", "exporter.cli", "run", "--target", proxy.url,
                               "--interval", str(INTERVAL), "--listen", f"127.0.0.1:{kport}"],
                     out / "kvhit.log", env={**os.environ, "KVHIT_TIMEOUT": f"{KVHIT_TIMEOUT:g}"}, cwd=str(ROOT))
        procs.append(kvhit)
        wait_http(f"http://127.0.0.1:{kport}/healthz", 60, kvhit)
        poller = Poller(f"http://127.0.0.1:{kport}/metrics", MODEL)
        poller.start()
        poller.wait_for(lambda s: s.up == 1.0, 30, "kvhit_up 1")

        t_cal = time.monotonic()
        cal_out = out / "calibration"
        shutil.rmtree(cal_out, ignore_errors=True)  # a reused E2E_OUT_DIR: no stale scrapes
        res.calibrate = subprocess.run(
            [sys.executable, "-m", "exporter.cli", "calibrate", "--endpoint", base, "--model", MODEL,
             "--isl", str(ISL), "--osl", str(OSL), "--concurrency", str(CONCURRENCY),
             "--hit-ratios", ",".join(f"{h:g}" for h in HIT_LEVELS), "--phase-seconds", str(PHASE_SECONDS),
             "--interval", str(CAL_INTERVAL), "--out", str(cal_out), "--report", str(cal_out / "report.json")],
            capture_output=True, text=True, timeout=420, cwd=str(ROOT))
        res.durations["calibrate"] = time.monotonic() - t_cal
        assert res.calibrate.returncode == 0, f"calibrate failed:\n{res.calibrate.stdout}\n{res.calibrate.stderr}"
        res.report = json.loads((cal_out / "report.json").read_text())
        res.phases = json.loads((cal_out / "phases.json").read_text())["phases"]
        sweep_end = time.time()
        res.before_kill = poller.wait_for(lambda s: s.up == 1.0 and (s.last_success or 0) > sweep_end, 60,
                                          "a scrape after the sweep")  # it sees the sweep's end

        # A crash: SIGKILL the whole vLLM process group, then a fresh server (counters from 0).
        res.t_kill = time.time()
        vllm.kill()
        res.t_down_seen = poller.wait_for(lambda s: s.up == 0.0, 30, "kvhit_up 0 after the kill").t
        t_restart = time.monotonic()
        vllm2 = _start_vllm(vllm_python, model_dir, vport, out / "vllm-restart.log")
        procs.append(vllm2)
        res.durations["vllm_restart"] = wait_http(base + "/health", 300, vllm2)
        res.t_restarted = time.time()
        rng = random.Random(7)
        prefix = [rng.randrange(1000, 8000) for _ in range(ISL // 2)]
        # the sweep's lengths: the fits carry on for the same traffic (another OSL is another miss-slope
        # bucket, withheld until its own steps span h)
        res.after_restart_requests = drive_load(base + "/v1/completions", MODEL, 16.0, 4, ISL, prefix, OSL,
                                                at_least=AFTER_RESTART_REQUESTS)
        t_load_end = time.time()
        recovered = poller.wait_for(
            lambda s: s.up == 1.0 and "all" in s.hit_ratio and (s.last_success or 0) > t_load_end + INTERVAL,
            60, "a fresh hit ratio after the restart")
        res.t_recovered = recovered.t
        time.sleep(4 * INTERVAL)  # kvhit keeps serving fresh windows after the recovery
        res.durations["after_restart"] = time.monotonic() - t_restart
    finally:
        if poller is not None:
            poller.stop()
            res.samples, res.poll_failures = list(poller.samples), poller.read_failures
        for p in reversed(procs):
            code = p.stop()
            if p.name == "kvhit":
                res.kvhit_exit = code
        if proxy is not None:
            proxy.stop()
            res.records, res.attempts = proxy.snapshot(), list(proxy.attempts)
        res.shm_removed = remove_leaked_shm(shm_before)
        heartbeat.stop()
        res.pauses = list(heartbeat.pauses)
        res.durations["total"] = time.monotonic() - t0
        _summarise(res)
        _dump(res)
    return res


def _summarise(res: Live) -> None:
    SUMMARY.append(f"kvhit live-vLLM e2e: {res.durations.get('total', 0):.0f}s total "
                   + ", ".join(f"{k} {v:.0f}s" for k, v in res.durations.items() if k != "total")
                   + f"; artefacts in {res.out}")
    if res.calibrate is not None:
        SUMMARY.extend(line for line in res.calibrate.stdout.splitlines() if line.strip())
    SUMMARY.append(_stalls(res))


def _stalls(res: Live) -> str:
    """Where a busy machine stalled, before the kill: the proxy's handlers (the longest gap between
    kvhit's recorded scrapes), vLLM's /metrics (its slowest answer), this test's poller, this test
    process as a whole (its heartbeat)."""
    def gap(ts: list[float]) -> float:
        return max((b - a for a, b in zip(ts, ts[1:])), default=0.0)
    recs = [r for r in res.records if r.t < res.t_kill]
    return (f"stalls before the kill: kvhit scrapes at the proxy {gap([r.t for r in recs]):.1f}s apart at most "
            f"(interval {INTERVAL:g}s), slowest vLLM /metrics {max((r.upstream_seconds for r in recs), default=0):.1f}s, "
            f"test poller {gap([s.t for s in res.samples if s.t < res.t_kill]):.1f}s apart at most, "
            f"test process paused {max((b - a for a, b in res.pauses), default=0):.1f}s at most")


def _dump(res: Live) -> None:
    """scenario.json in the artefacts: what the checks below read, without the exposition bodies."""
    doc = {"durations": res.durations, "shm_removed": res.shm_removed, "t_kill": res.t_kill, "t_restarted": res.t_restarted,
           "t_recovered": res.t_recovered, "poll_failures": res.poll_failures, "pauses": res.pauses,
           "attempts": res.attempts, "records": [(r.t, vllm_counter(r.body, QUERIES, MODEL), vllm_counter(r.body, HITS, MODEL))
                       for r in res.records],
           "samples": [asdict(s) for s in res.samples]}
    (res.out / "scenario.json").write_text(json.dumps(doc))


# --- independent arithmetic on vLLM's own exposition -----------------------------------------


def _scrapes_from(records: list[Record], t: float, took: dict[float, float]) -> list[int]:
    """Indices of the records that can be kvhit's successful scrape stamped ``t``. kvhit sends one
    scrape at a time (exporter/cli.py ``poll_loop``) and stamps it when its answer began
    (exporter/runner.py ``poll``: the request's time plus the time to the answer's headers), so
    the proxy's handler started at or before t, after the request: no earlier than t minus the
    scrape's kvhit_scrape_duration_seconds (``took``: stamp → duration of the successful scrapes
    the test saw; it covers the whole scrape from the request) or, unseen, KVHIT_TIMEOUT, and
    after kvhit's previous successful stamp, however long either process was starved in between.
    A handler of an earlier, abandoned scrape can start in that span too, so this is a set. (10 ms:
    clocks of two processes; t may be a difference of stamps, rounded.)"""
    stamps = sorted(took)
    i = bisect.bisect_left(stamps, t - 0.01)
    seen = i < len(stamps) and stamps[i] <= t + 0.01
    lo = t - (took[stamps[i]] if seen else KVHIT_TIMEOUT) - 0.01
    if i > 0:
        lo = max(lo, stamps[i - 1])
    return [j for j, r in enumerate(records) if lo <= r.t <= t + 0.01]


def _increase(records: list[Record], i0: int, i1: int, name: str, t_kill: float) -> float:
    """Prometheus increase() of counter ``name`` from record i0 to i1, the vLLM kill at ``t_kill``
    its one reset. Inside one vLLM lifetime the differences add up to last − first even when
    handlers started together (after a pause) got their bodies from vLLM in another order."""
    total, prev_t, prev = 0.0, records[i0].t, vllm_counter(records[i0].body, name, MODEL)
    for r in records[i0 + 1:i1 + 1]:
        cur = vllm_counter(r.body, name, MODEL)
        total += cur if prev_t < t_kill <= r.t else cur - prev
        prev_t, prev = r.t, cur
    return total


def _designed(h: float, n: int, b: int) -> tuple[int, float]:
    """By hand: prefix = round(h·N/B)·B capped at floor((N−1)/B)·B; vLLM hits whole cached
    blocks and never the last prompt token, so the token hit ratio is prefix/N."""
    cap = (n - 1) // b * b
    prefix = min(int(math.floor(h * n / b + 0.5)) * b, cap)
    return prefix, prefix / n


# --- checks -------------------------------------------------------------------------------


def test_scenario_fits_the_time_budget(live: Live):
    assert live.durations["total"] <= BUDGET_SECONDS, live.durations


MIN_WINDOWS = 20  # checked at the least, however starved the machine


def _stalled(live: Live, t0: float, t1: float) -> float:
    """Seconds of [t0, t1] in which this test process was paused or vLLM held one of kvhit's
    scrapes past INTERVAL, answered or not (kvhit scrapes one at a time and starts them INTERVAL
    apart, so only a longer one delays the next; CI once saw vLLM's /metrics take 14 s). A lower
    bound: kvhit's own time around the request is not in it."""
    overruns = [(t + INTERVAL, t + took) for t, took in live.attempts if took > INTERVAL]
    return paused_within(live.pauses + overruns, t0, t1)


def _expected_windows(live: Live) -> int:
    """Windows the poller must have seen: half of one per INTERVAL while vLLM was up, this test
    process ran (a machine-wide stall pauses kvhit, the poller and the heartbeat alike; CI once
    lost 26 s at a time) and vLLM did not hold one of kvhit's scrapes past INTERVAL (:func:`_stalled`),
    and never fewer than MIN_WINDOWS."""
    t_up = min((s.t for s in live.samples if s.up == 1.0), default=live.t_kill)
    t_end = max((s.t for s in live.samples), default=live.t_restarted)
    spans = [(t_up, live.t_kill), (live.t_restarted, t_end)]
    running = sum(max(0.0, b - a) - _stalled(live, a, b) for a, b in spans)
    return max(MIN_WINDOWS, int(0.5 * running / INTERVAL))


def test_every_published_window_equals_vllm_counter_deltas(live: Live):
    """kvhit_hit_ratio == Δhits/Δqueries of vLLM's own counters over the window's two scrapes."""
    windows = {}
    for s in live.samples:
        if s.last_success is not None and s.window is not None and "all" in s.hit_ratio:
            windows[s.last_success] = s
    expected = _expected_windows(live)
    assert len(windows) >= expected, f"only {len(windows)} windows seen, {expected} expected"
    took = {s.last_success: s.duration for s in live.samples if s.up == 1.0 and s.last_success is not None}
    checked = resets = 0
    for t_last, s in sorted(windows.items()):
        ends, starts = _scrapes_from(live.records, t_last, took), _scrapes_from(live.records, t_last - s.window, took)
        assert ends and starts, (f"window {t_last - s.window}..{t_last} has no recorded scrape: records near it "
                                 f"{[r.t for r in live.records if t_last - s.window - 5 < r.t < t_last + 5]}")
        # Under load the counters move between any two scrapes, so only the window's own two
        # scrapes can give kvhit's ratio to 1e-9.
        found = []
        for i0 in starts:
            for i1 in ends:
                q = _increase(live.records, i0, i1, QUERIES, live.t_kill)
                k = _increase(live.records, i0, i1, HITS, live.t_kill)
                if i0 < i1 and q > 0 and abs(s.hit_ratio["all"] - k / q) <= 1e-9:
                    found.append((i0, i1, k, q))
        assert found, (t_last, s.window, s.hit_ratio, starts, ends)
        i0, i1, k, q = found[0]
        resets += live.records[i0].t < live.t_kill <= live.records[i1].t
        assert s.hit_ratio["device"] == pytest.approx(k / q, abs=1e-9)
        checked += 1
    assert resets >= 1, "no window spanned the vLLM restart"
    SUMMARY.append(f"windows checked against vLLM's counters: {checked} ({resets} across the restart)")


def _phase_increase(records: list[Record], phase: dict) -> tuple[float, float] | None:
    """(Δqueries, Δhits) between the first and last record inside the phase, or None when fewer
    than two records span at least half of it."""
    inside = [r for r in records if phase["start_ms"] / 1000 <= r.t <= phase["end_ms"] / 1000]
    if len(inside) < 2 or inside[-1].t - inside[0].t < PHASE_SECONDS / 2:
        return None
    return tuple(vllm_counter(inside[-1].body, n, MODEL) - vllm_counter(inside[0].body, n, MODEL)
                 for n in (QUERIES, HITS))


def test_each_phase_hits_its_designed_ratio(live: Live):
    """Each phase's Δhits/Δqueries from vLLM's own counters, twice: in the scrapes kvhit ingested
    (the proxy's records) and in calibrate's recording (its own scrapes, another process). A phase
    the proxy missed because this test process itself was paused (its heartbeat says so) is
    checked on the recording alone; a gap kvhit or the proxy caused fails."""
    assert [p["name"] for p in live.phases] == [p["name"] for p in live.report["phases"]]
    assert len(live.phases) == len(HIT_LEVELS)
    recording = sorted((Record(int(f.stem) / 1000, f.read_text()) for f in Path(live.report["trace_dir"]).glob("*.prom")),
                       key=lambda r: r.t)
    for phase, h in zip(live.phases, HIT_LEVELS):
        prefix, expected = _designed(h, ISL, BLOCK)
        assert phase["intended_hit_ratio"] == h
        assert phase["shared_prefix_tokens"] == prefix and phase["prompt_tokens"] == ISL
        assert phase["expected_token_hit_ratio"] == pytest.approx(expected, abs=1e-12)
        assert phase["requests_completed"] >= 20 and phase["requests_failed"] == 0
        for source, records in (("proxy", live.records), ("recording", recording)):
            inc = _phase_increase(records, phase)
            if inc is None:
                paused = paused_within(live.pauses, phase["start_ms"] / 1000, phase["end_ms"] / 1000)
                assert source == "proxy" and paused >= PHASE_SECONDS / 4, \
                    (phase["name"], source, [r.t for r in records], f"test process paused {paused:.1f}s")
                SUMMARY.append(f"{phase['name']}: this test process was paused {paused:.1f}s of it, "
                               "so the proxy kept too few of kvhit's scrapes; h checked on calibrate's recording")
                continue
            q, k = inc
            assert q >= 10 * ISL, (phase["name"], source, q)
            assert abs(k / q - expected) <= HIT_TOLERANCE, (phase["name"], source, k / q, expected)
        # calibrate's own computation from its recording agrees too
        row = next(r for r in live.report["phases"] if r["name"] == phase["name"])
        assert abs(row["measured_hit_ratio"] - expected) <= HIT_TOLERANCE, row


def test_health_and_fit_status_before_the_restart(live: Live):
    first_up = next(i for i, s in enumerate(live.samples) if s.up == 1.0)
    before = [s for s in live.samples[first_up:] if s.t < live.t_kill]
    assert len(before) > 100
    # Only a starved machine may cost a scrape: a timeout, a few times at most, plus one per
    # KVHIT_TIMEOUT begun while this test process (the proxy) was paused long enough to make a
    # scrape time out by itself; never a parse error, a refused connection or a bad answer from
    # a healthy vLLM.
    b = live.before_kill
    errors = {reason: n for reason, n in b.errors.items() if n}
    allowed = STALL_TIMEOUTS + sum(math.ceil((z - a) / KVHIT_TIMEOUT) for a, z in live.pauses
                                   if a < live.t_kill and z - a > KVHIT_TIMEOUT - PROXY_TIMEOUT)
    assert set(errors) <= {"timeout"} and errors.get("timeout", 0) <= allowed, \
        ("scrape errors while vLLM was up", errors, allowed, _stalls(live))
    assert all(s.up == 1.0 for s in before) or errors, "kvhit_up dropped while vLLM was up"
    assert b.up == 1.0
    assert b.fit_status.get("chip_time") == "ok", b.fit_status
    assert b.fit_status.get("miss_slope") == "ok", b.fit_status
    assert b.fit_status.get("overlap") == "not_identifiable", b.fit_status
    assert not live.poll_failures, live.poll_failures


def test_restart_yields_no_absurd_window_and_kvhit_recovers(live: Live):
    assert live.after_restart_requests >= AFTER_RESTART_REQUESTS
    for s in live.samples:
        for v in s.hit_ratio.values():
            assert 0.0 <= v <= 1.0, s
        if s.window is not None:
            stalled = _stalled(live, s.last_success - s.window, s.last_success)
            assert 0 < s.window <= 60 + (live.t_restarted - live.t_kill) + 8 * INTERVAL + 5 + stalled, s
        if s.isl is not None:
            assert 1 <= s.isl <= MAX_MODEL_LEN, s
        if s.osl is not None:
            assert 1 <= s.osl <= OSL, s
        if s.ttft is not None:
            assert 0 <= s.ttft < 60, s
        for key, v in s.tpm.items():
            assert math.isfinite(v) and 0 <= v < 1e8, (key, s)
    after = [s for s in live.samples if s.t > live.t_recovered]
    assert after and all(s.up == 1.0 for s in after)
    # recovered by itself within the back-off cap (8 intervals) after vLLM answered again: kvhit's
    # own stamp of its first good scrape after the kill, not when this test happened to read it;
    # the time a starved machine stalled in between is not kvhit's
    first_up_again = min(s.last_success for s in live.samples if s.up == 1.0 and s.last_success > live.t_kill)
    assert first_up_again - live.t_restarted - _stalled(live, live.t_restarted, first_up_again) <= 8 * INTERVAL + 5
    last = live.samples[-1]
    # every reason is exported from 0 on: the ones counted are those of a restarting vLLM
    assert {r for r, n in last.errors.items() if n} <= {"http_502", "timeout", "refused"}, last.errors
    assert last.fit_status.get("chip_time") == "ok" and last.fit_status.get("miss_slope") == "ok"
    assert last.fit_status.get("overlap") == "not_identifiable"
    assert live.kvhit_exit == 0  # SIGTERM: clean shutdown


def test_calibration_report_is_complete_and_honest(live: Live):
    rep = live.report
    out = live.calibrate.stdout
    assert "calibrated model" in out and "leave-one-phase-out busy (chip) time" in out
    assert rep["fits"]["chip_time"]["status"] == "ok" and rep["fits"]["miss_slope"]["status"] == "ok"
    params = rep["parameters"]
    for name in ("tps0_direct", "a_direct", "t_fixed", "k_ffn", "k_attn"):
        p = params[name]
        assert p["status"] in ("ok", "not_identifiable"), (name, p)
        if p["status"] == "ok":
            assert p["value"] is not None and p["value"] >= 0 and p["stderr"] is not None, (name, p)
    assert params["tps0_direct"]["status"] == "ok" and params["a_direct"]["status"] == "ok"
    assert params["alpha"]["status"] == "not_identifiable" and params["alpha"]["value"] is None
    lopo = rep["leave_one_phase_out"]
    assert lopo["busy_time"]["phases"] == len(HIT_LEVELS)
    assert lopo["ttft_load_aware"]["phases"] >= len(HIT_LEVELS) - 1
    for row in rep["phases"]:
        assert row["busy_steps"] >= 3, row
        assert row["busy_error"] is not None and math.isfinite(row["busy_error"]), row
    # The recording replays unchanged through `kvhit replay` (same per-phase summary).
    done = subprocess.run([sys.executable, "-m", "exporter.cli", "replay", rep["trace_dir"], "--quiet"],
                          capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert done.returncode == 0, done.stderr
    for row in rep["phases"]:
        assert row["name"][:12] in done.stdout
    SUMMARY.append(f"leave-one-phase-out errors: busy max {100 * lopo['busy_time']['max_abs_error']:.1f}% "
                   f"(median {100 * lopo['busy_time']['median_abs_error']:.1f}%), load-aware TTFT max "
                   f"{100 * lopo['ttft_load_aware']['max_abs_error']:.1f}% "
                   f"(median {100 * lopo['ttft_load_aware']['median_abs_error']:.1f}%); "
                   f"report {Path(rep['trace_dir']) / 'report.json'}")
