"""rules/ and grafana/ against a real Prometheus and Alertmanager (Debian's packages).

The stack, all on 127.0.0.1 with free ports, stopped by PID at the end:
- two ``kvhit demo --loop`` processes replaying the bundled real vLLM trace and then serving the
  final analysis: "valley" (default prices, ρ = 0.1: the final state sits in the valley) and "flat"
  (ρ = 1: hits pay as much as misses, R grows with h, no valley can exist);
- ``kvhit run`` against a port where nothing listens (its target is down);
- ``kvhit run`` scraping the fake vLLM below every second: the sidecar's live path ("live"; what its
  young fits say is not asserted, only that its series exist; it starts with the fake vLLM's loop
  and Prometheus, after the replays). Its copy of the exposition carries one malformed line, which
  kvhit counts as an input quirk and drops;
- a scrape target where nothing listens (kvhit itself absent);
- a fake vLLM: the trace's own /metrics snapshots of phases A0–A1 (h 0 → 0.3), one per second, looped
  with every counter carried on across loops so that rates stay real; Prometheus reads ns-live's
  with ``vllm_`` for ``vllm:``, as vLLM's prometheus_client writes for Prometheus 2, through the
  PodMonitor's metricRelabelings (deploy/kustomize/monitoring/podmonitor.yaml);
- Prometheus (1-s scrapes and rule evaluations) loading a copy of rules/ whose `for:` durations are
  shortened to 3 s and whose history requirements (`offset 23h`: KvhitPrefixCachingNotPaying waits
  for a day of counters) to 1 s (labels and annotations unchanged: the shipped `for:` and offsets are
  tested at their boundary by promtool in tests/test_rules.py);
- Alertmanager with deploy/alertmanager.yml's route tree (receiver URLs pointed at a local webhook,
  group waits shortened) and that webhook, which records what it receives.
Each target gets namespace/pod labels as Kubernetes service discovery would; the sidecar and the fake
vLLM of one scenario share them.
"""
from __future__ import annotations

import json
import math
import re
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from exporter import names
from exporter.sources import load_trace
from local_servers import Processes, free_port, http_ok, prometheus_query, reply, serve, start_prometheus, wait_for
from observability import (ALERTMANAGER_EXAMPLE, BUILTIN, PODMONITOR, RULES, TRACE, alert_rules, dashboard_targets, dashboards,
                           dashboard_variables, metric_names_of_exposition, recording_rules, substitute, tool)
from promql_selectors import selectors

SHORT_FOR = "3s"
SHORT_OFFSET = "1s"
MODEL = "tiny"  # model_name of the bundled trace
DEADLINE = 180.0  # seconds for everything expected to fire (a few seconds on a quiet machine)
# What each scenario must show (independently of kvhit's output: from the configs below and the
# trace's design — the valley replay ends at h ≈ 0.008 with a = 0.94 > ρ = 0.1; the flat one has ρ = 1;
# the fake vLLM plays h = 0 then 0.3, below seed 003's 25 %).
EXPECT_FIRING = {
    ("KvhitValley", "ns-valley"),
    ("KvhitRevenueBelowZeroHitBaseline", "ns-valley"),
    ("KvhitPredictedTTFTAboveSLO", "ns-valley"),  # load-aware TTFT at the current h ≈ 0.39 s > SLO 0.2 s
    # the trace's last minute: 1 of 117 TTFTs in a bucket up to 0.25 s (the edge above the SLO 0.2 s)
    ("KvhitSLOMissed", "ns-valley"),
    ("KvhitPrefixCachingNotPaying", "ns-valley"),
    ("KvhitPrefixCachingNotPaying", "ns-flat"),
    ("KvhitPrefixCachingNotPaying", "ns-live"),
    ("KvhitTargetNeverUp", "ns-down"),  # its target never answered (KvhitTargetDown needs an earlier success)
    ("KvhitTargetNotAnalysable", "ns-notvllm"),  # its target answers with another kvhit's metrics, no vLLM
    ("KvhitAbsent", "ns-gone"),
}
NEVER = {  # (alert, namespace or None for any): must stay inactive (neither pending nor firing)
    ("KvhitValley", "ns-flat"), ("KvhitRevenueBelowZeroHitBaseline", "ns-flat"),
    ("KvhitPredictedTTFTAboveSLO", "ns-flat"),  # SLO 1 s there
    # the trace's last minute: every TTFT ≤ 1 s (SLO 1 s), every request TPOT ≤ 0.05 s (SLO 0.05 s)
    ("KvhitSLOMissed", "ns-flat"),
    ("KvhitCacheThrash", None),  # h < 0.85 and the KV cache nearly empty everywhere
    # chip_time, miss_slope, load_aware ok; overlap not_identifiable (no loaded hits): not alerted
    ("KvhitFitNotOk", "ns-valley"), ("KvhitFitNotOk", "ns-flat"),
    ("KvhitAnalysisFailing", None),  # no kvhit bug hit: its target down (ns-down) is KvhitTargetNeverUp's
}
YOUNG = 'kvhit_unknown_info{namespace="ns-live", signal="bathtub_chip_time"}'
UNDETERMINED = {"ns-live"}  # the live sidecar's young analysis: its alerts are neither expected nor excluded
# Every optional input set (B_load, instance price, sizing) so that the series needing them exist.
COMMON_CONFIG = {"load_bandwidth_bytes_per_second": 25.0e9, "instance_hour_price": 2.0,
                 "sizing": {"batch": 8, "max_len": 4096}}
VALLEY_CONFIG = {"prices": {"hit_price_ratio": 0.1}, "slo": {"ttft_seconds": 0.2, "tpot_seconds": 0.05}, **COMMON_CONFIG}
FLAT_CONFIG = {"prices": {"hit_price_ratio": 1.0}, "slo": {"ttft_seconds": 1.0, "tpot_seconds": 0.05}, **COMMON_CONFIG}
# Dashboard variables: All for the label variables (Grafana's allValue .*), but kvhit-model's model,
# one value with no All (matched exactly: grafana/dashboards.py SEL); every replay serves MODEL.
VARIABLES = {"namespace": ".*", "model_name": ".*", "pod": ".*", "__rate_interval": "1m", "datasource": "prometheus"}
VARIABLES_OF = {"kvhit-model": dict(VARIABLES, model_name=MODEL), "kvhit-fleet": VARIABLES}
# kvhit series that are absent by design in this replay, with the series saying why: α needs hits loaded
# from host memory (the trace has none); the economic max-num-seqs needs TPOT P95 to rise with
# concurrency over >= 3 levels, which the trace's TPOT does not show beyond noise; T_fixed needs
# T_step as its own term, and the trace's T_step carries decode context's time.
ABSENT_BY_DESIGN = {
    "kvhit_fixed_time_seconds": 'kvhit_unknown_info{signal="fixed_time"} == 1',
    "kvhit_fixed_time_stderr_seconds": 'kvhit_unknown_info{signal="fixed_time"} == 1',
    "kvhit_overlap_ratio": 'kvhit_fit_status{fit="overlap", status="not_identifiable"} == 1',
    "kvhit_overlap_ratio_stderr": 'kvhit_fit_status{fit="overlap", status="not_identifiable"} == 1',
    "kvhit_recommended_max_num_seqs": 'kvhit_fit_status{fit="max_num_seqs", status="not_identifiable"} == 1',
}

# Referenced by a dashboard (with a fallback there) and absent from every exposition of this stack,
# with the series saying why: the trace's linear h_even (0.970) lies just past the h range its direct
# line was fitted on (up to 0.969), and its chip_time valley has no exit (kvhit_valley_exit 0).
ABSENT_HERE = {
    "kvhit_valley_breakeven_hit_ratio": 'kvhit_unknown_info{signal="valley_breakeven_linear"} == 1',
    "kvhit_valley_breakeven_hit_ratio_stderr": 'kvhit_unknown_info{signal="valley_breakeven_linear"} == 1',
}

# Referenced by a dashboard and absent from the replays' final analyses because kvhit has no caveat
# on them (their /api/v1/analysis says so: every model's "warnings" empty); the live sidecar's young
# analysis may have one (UNDETERMINED).
NO_CAVEAT_HERE = {"kvhit_warning_info"}


def no_caveat(stack) -> bool:
    """Whether every model of the replays' final analyses has no warning (why kvhit_warning_info is absent)."""
    docs = [json.load(urllib.request.urlopen(f"{stack.url(name)}/api/v1/analysis", timeout=10)) for name in ("valley", "flat")]
    return all(doc["models"] for doc in docs) and not any(m["warnings"] for doc in docs for m in doc["models"].values())


def short_history(expr: str) -> str:
    """An alert expression with the history it requires (``offset d``) cut to SHORT_OFFSET: this
    stack lives for seconds, not for the day KvhitPrefixCachingNotPaying waits for."""
    return re.sub(r"\boffset\s+\w+", f"offset {SHORT_OFFSET}", expr)


# --- small servers in the test process -------------------------------------------------------------


class FakeVllm:
    """Serves recorded vLLM /metrics snapshots, one per ``step`` seconds of wall time, looped.

    Counter-like samples (``_total``, ``_count``, ``_sum``, ``_bucket``) are offset by the loop number
    times their increase over the segment, so they never go down; ``_created`` series are dropped
    (they would restart nothing, but they would lie about the offsets); HELP/TYPE lines are kept.
    """

    def __init__(self, snapshots: list[str], step: float = 1.0) -> None:
        self.frames: list[list[tuple[str, float | None]]] = []
        for text in snapshots:
            frame: list[tuple[str, float | None]] = []
            for line in text.splitlines():
                if line.startswith("#"):
                    frame.append((line, None))
                    continue
                if not line:
                    continue
                key, value = line.rsplit(" ", 1)
                if key.split("{", 1)[0].endswith("_created"):
                    continue
                frame.append((key, float(value)))
            self.frames.append(frame)
        first = {k: v for k, v in self.frames[0] if v is not None}
        last = {k: v for k, v in self.frames[-1] if v is not None}
        self.delta = {k: last[k] - first.get(k, 0.0) for k in last
                      if k.split("{", 1)[0].endswith(("_total", "_count", "_sum", "_bucket"))}
        self.step, self.t0 = step, time.time()

    def render(self) -> str:
        i = int((time.time() - self.t0) / self.step)
        loop, j = divmod(i, len(self.frames))
        return "".join(f"{k}\n" if v is None else f"{k} {v + loop * self.delta.get(k, 0.0)!r}\n"
                       for k, v in self.frames[j])


def fake_vllm_handler(fake: FakeVllm) -> type:
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            text = fake.render()
            if self.path.startswith("/quirky/"):  # one line that is not text exposition
                text += "vllm:num_requests_running{model_name=tiny 1\n"
            elif self.path.startswith("/prometheus2/"):  # what vLLM's prometheus_client writes for Prometheus 2
                text = text.replace("vllm:", "vllm_")
            reply(self, 200, text.encode())

        def log_message(self, *a):
            pass
    return H


def webhook_handler(received: list, lock: threading.Lock) -> type:
    class H(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                received.append((self.path, body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass
    return H


# --- the stack -------------------------------------------------------------------------------------


class Stack:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs = Processes(tmp)
        self.servers: list[ThreadingHTTPServer] = []
        self.received: list[tuple[str, dict]] = []
        self.lock = threading.Lock()
        self.ports = {k: free_port() for k in ("valley", "flat", "down", "live", "gone", "notvllm", "dead_vllm", "vllm",
                                               "webhook", "prometheus", "alertmanager")}
        self.alerts_seen: list[dict] = []  # every /api/v1/alerts entry observed while polling

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def spawn(self, name: str, argv: list[str]):
        return self.procs.spawn(name, argv)

    def stop(self) -> None:
        self.procs.stop()  # by PID, each one we started
        for s in self.servers:
            s.shutdown()
            s.server_close()

    # -- start ------------------------------------------------------------------------------------

    def start(self) -> None:
        alertmanager = tool("prometheus-alertmanager", "alertmanager")
        trace = load_trace(TRACE)
        phases = {p["name"]: p for p in trace.phases}
        lo, hi = phases["A0_hit0.0"]["start_ms"] / 1000 - 4, phases["A1_hit0.3"]["end_ms"] / 1000
        segment = [text for t, text in trace.snapshots if lo <= t <= hi]
        self.servers.append(serve(webhook_handler(self.received, self.lock), self.ports["webhook"]))

        for scenario, cfg in (("valley", VALLEY_CONFIG), ("flat", FLAT_CONFIG)):
            path = self.tmp / f"{scenario}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            self.spawn(f"kvhit-{scenario}", [sys.executable, "-m", "exporter.cli", "demo", "--speed", "1000", "--loop",
                                             "--listen", f"127.0.0.1:{self.ports[scenario]}", "--config", str(path)])
        self.spawn("kvhit-down", [sys.executable, "-m", "exporter.cli", "run", "--interval", "1",
                                  "--target", f"{self.url('dead_vllm')}/metrics",
                                  "--listen", f"127.0.0.1:{self.ports['down']}"])
        self.spawn("kvhit-notvllm", [sys.executable, "-m", "exporter.cli", "run", "--interval", "1",
                                     "--target", f"{self.url('flat')}/metrics",  # an exporter, not vLLM
                                     "--listen", f"127.0.0.1:{self.ports['notvllm']}"])
        # Prometheus must only ever see the final analyses: wait until both replays are done.
        for scenario in ("valley", "flat"):
            p = next(p for p in self.procs.procs if p.log_path.name == f"kvhit-{scenario}.log")
            wait_for(lambda: "serving the final analysis" in p.log_path.read_text() or p.poll() is not None,
                     120, f"kvhit demo ({scenario}) to finish its replay")
            assert p.poll() is None, p.log_path.read_text()[-3000:]

        self.write_rules()
        self.write_alertmanager_config()
        am = self.spawn("alertmanager", [alertmanager, f"--config.file={self.tmp / 'alertmanager.yml'}",
                                         f"--storage.path={self.tmp / 'am-data'}",
                                         f"--web.listen-address=127.0.0.1:{self.ports['alertmanager']}",
                                         "--cluster.listen-address=", "--log.level=warn"])
        # The fake vLLM's loop, the live sidecar and Prometheus start together, however long the replays
        # took: both see h = 0 first (A0, 37 s), so the live sidecar's young analysis (chip_time ok, a
        # bathtub not yet known: one h in its buffer) is scraped, and the 24-h hit ratio stays below 25 %
        # from the first scrape (A1 adds 69312 hits to 182272 + 233472 queries: 0.17).
        self.servers.append(serve(fake_vllm_handler(FakeVllm(segment)), self.ports["vllm"]))
        live = self.spawn("kvhit-live", [sys.executable, "-m", "exporter.cli", "run", "--interval", "1",
                                         "--target", f"{self.url('vllm')}/quirky/metrics",
                                         "--listen", f"127.0.0.1:{self.ports['live']}"])
        wait_for(lambda: http_ok(f"{self.url('live')}/healthz"), 60, "the live sidecar up", live)
        start_prometheus(self.procs, self.prometheus_config(), self.ports["prometheus"])
        wait_for(lambda: http_ok(f"{self.url('alertmanager')}/-/ready"), 60, "alertmanager ready", am)

    def write_rules(self) -> None:
        """rules/ with every alert's `for:` shortened to SHORT_FOR and its offsets to SHORT_OFFSET."""
        (self.tmp / "rules").mkdir()
        for path in RULES:
            doc = yaml.safe_load(path.read_text())
            for g in doc["groups"]:
                for r in g["rules"]:
                    if "alert" in r:
                        r["for"] = SHORT_FOR
                        r["expr"] = short_history(r["expr"])
            (self.tmp / "rules" / path.name).write_text(yaml.safe_dump(doc, sort_keys=False))

    def write_alertmanager_config(self) -> None:
        """deploy/alertmanager.yml with the receivers' URLs pointed at the local webhook
        (path = receiver name) and the group timings shortened."""
        cfg = yaml.safe_load(ALERTMANAGER_EXAMPLE.read_text())
        for rx in cfg["receivers"]:
            for w in rx.get("webhook_configs", []):
                w["url"] = f"{self.url('webhook')}/{rx['name']}"

        def shorten(route: dict) -> None:
            route.update({k: "1s" for k in ("group_wait", "group_interval") if k in route or route is cfg["route"]})
            if "repeat_interval" in route:
                route["repeat_interval"] = "1h"
            for child in route.get("routes", []):
                shorten(child)
        shorten(cfg["route"])
        (self.tmp / "alertmanager.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    def prometheus_config(self) -> dict:
        def target(port: str, ns: str, pod: str, path: str = "/metrics") -> dict:
            return {"targets": [f"127.0.0.1:{self.ports[port]}"],
                    "labels": {"namespace": ns, "pod": pod, "__metrics_path__": path}}

        # the PodMonitor's vLLM endpoint's metricRelabelings, in Prometheus' own spelling
        (vllm,) = (e for e in yaml.safe_load(PODMONITOR.read_text())["spec"]["podMetricsEndpoints"] if "portNumber" in e)
        spelling = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
        relabel = [{spelling.get(k, k): v for k, v in r.items()} for r in vllm["metricRelabelings"]]
        cfg = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(self.tmp / "rules" / "*.yml")],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{self.ports['alertmanager']}"]}]}]},
            "scrape_configs": [
                {"job_name": "kvhit", "static_configs": [
                    target("valley", "ns-valley", "vllm-valley-0"), target("flat", "ns-flat", "vllm-flat-0"),
                    target("down", "ns-down", "vllm-down-0"), target("live", "ns-live", "vllm-live-0"),
                    target("gone", "ns-gone", "vllm-gone-0"), target("notvllm", "ns-notvllm", "vllm-notvllm-0")]},
                {"job_name": "vllm", "metric_relabel_configs": relabel, "static_configs": [
                    target("vllm", "ns-valley", "vllm-valley-0"), target("vllm", "ns-flat", "vllm-flat-0"),
                    target("vllm", "ns-live", "vllm-live-0", "/prometheus2/metrics")]},
            ],
        }
        return cfg

    # -- queries ----------------------------------------------------------------------------------

    def query(self, expr: str) -> list[dict]:
        return prometheus_query(self.url("prometheus"), expr)

    def alerts(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.url('prometheus')}/api/v1/alerts", timeout=10) as r:
            doc = json.load(r)
        self.alerts_seen.extend(doc["data"]["alerts"])
        return doc["data"]["alerts"]

    def firing(self) -> set[tuple[str, str]]:
        return {(a["labels"]["alertname"], a["labels"].get("namespace", "")) for a in self.alerts()
                if a["state"] == "firing"}

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"{self.url('prometheus')}{path}", timeout=10) as r:
            return json.load(r)["data"]

    def diagnosis(self) -> str:
        """What is missing from EXPECT_FIRING and why it may be: the expected alerts' states, the rules
        that are not healthy or did not match, the targets that are down, Prometheus' clock against
        ours, and the tail of Prometheus' log (for a failure on a machine where it cannot be rerun)."""
        alerts = self.alerts()
        missing = sorted(EXPECT_FIRING - self.firing())
        lines = [f"alerts {missing} to fire", "their states now:"]
        lines += [f"  {a['labels']['alertname']} {a['labels'].get('namespace', '')} {a['state']} since {a['activeAt']}"
                  for a in alerts if (a["labels"]["alertname"], a["labels"].get("namespace", "")) in missing]
        for g in self.get("/api/v1/rules")["groups"]:
            lines.append(f"group {g['name']}: last evaluation {g.get('lastEvaluation')} took {g.get('evaluationTime')} s")
            lines += [f"  {r['name']}: {r['health']} {r.get('lastError', '')}" for r in g["rules"]
                      if r["health"] != "ok" or any(r["name"] == a for a, _ in missing)]
        lines += [f"target {t['labels'].get('job')} {t['labels'].get('namespace')} {t['scrapeUrl']}: {t['health']} "
                  f"{t.get('lastError', '')} (last scrape {t.get('lastScrape')})"
                  for t in self.get("/api/v1/targets")["activeTargets"] if t["health"] != "up"]
        inputs = self.query('{__name__=~"kvhit_up|kvhit_engine_info|kvhit_valley_active|kvhit_last_success_timestamp_seconds'
                            '|namespace_model_name:vllm_prefix_cache_hit_ratio:rate24h"}'
                            ' or kvhit_predicted_ttft_seconds{kind="load_aware", hit_ratio="current"}')
        lines += ["their inputs now:"] + sorted(f"  {r['metric']} {r['value'][1]}" for r in inputs)
        # A starved machine shows here: failed or slow scrapes (a failure marks the target's series
        # stale, which resets its alerts' `for:`).
        health = self.query('label_replace(count_over_time(up[3m]) - sum_over_time(up[3m]), "what", "failed scrapes", "", "")'
                            ' or label_replace(max_over_time(scrape_duration_seconds[3m]), "what", "slowest scrape", "", "")')
        lines += ["over the last 3 min:"] + sorted(
            f"  {r['metric']['what']} {r['metric']['job']} {r['metric']['namespace']}: {float(r['value'][1]):.3g}"
            for r in health)
        lines.append(f"Prometheus time() {_value(self.query('vector(time())')):.1f}, the test's {time.time():.1f}")
        log = next(p for p in self.procs.procs if p.log_path.name == "prometheus.log").log_path.read_text()
        return "\n".join(lines) + f"\nprometheus.log:\n{log[-3000:]}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("prometheus-live"))
    try:
        s.start()
        # Everything expected fires (with `for:` 3 s and 1-s evaluations this takes a few seconds).
        wait_for(lambda: EXPECT_FIRING <= s.firing(), DEADLINE, s.diagnosis)
        # The live sidecar's young analysis is scraped (~15 s after its start: chip_time ok, the bathtub
        # not yet known), so that its series are in Prometheus' history too.
        wait_for(lambda: s.query(f"last_over_time({YOUNG}[1h])"), DEADLINE, f"{YOUNG} scraped")
        # Alertmanager delivers them (group_wait 1 s).
        wait_for(lambda: {a for a, _ in EXPECT_FIRING} <= {al["labels"]["alertname"] for _, b in s.received
                                                          for al in b["alerts"]},
                 30, "Alertmanager to deliver every firing alert to the webhook")
        for _ in range(6):  # keep watching for alerts that must never appear
            s.alerts()
            time.sleep(0.5)
        yield s
    finally:
        s.stop()


# --- the tests -------------------------------------------------------------------------------------


def _value(result: list[dict]) -> float:
    (sample,) = result
    return float(sample["value"][1])


def test_valley_alert_fires_for_the_valley_replay_and_stays_inactive_for_the_flat_one(stack):
    valley = [a for a in stack.alerts() if a["labels"]["alertname"] == "KvhitValley"
              and a["labels"]["namespace"] not in UNDETERMINED]
    assert {(a["labels"]["namespace"], a["state"]) for a in valley} == {("ns-valley", "firing")}
    (a,) = valley
    assert a["labels"]["model_name"] == MODEL and a["labels"]["severity"] == "warning"
    # the chip-time fit is ok on this trace, so the alert follows it; the form is in the description
    # (a query at evaluation), not the labels: a switch of form must not restart for:
    assert "form" not in a["labels"] and "(chip_time form;" in a["annotations"]["description"]
    # The flat replay is live and analysed, and says "no valley": inactive for a reason, not for lack of data.
    assert _value(stack.query('kvhit_valley_active{namespace="ns-flat"}')) == 0
    assert _value(stack.query('kvhit_valley_active{namespace="ns-valley"}')) == 1
    assert _value(stack.query('kvhit_revenue_slope{namespace="ns-flat", form="chip_time"}')) > 0
    # Its value is R'(h) (< 0), the description shows it.
    slope = _value(stack.query('kvhit_revenue_slope{namespace="ns-valley", form="chip_time"}'))
    assert slope < 0 and math.isclose(float(a["value"]), slope, rel_tol=1e-9)
    assert f"R'(h) = {slope:.3g} price/s" in a["annotations"]["description"]
    assert a["annotations"]["runbook_url"] == "docs/runbooks.md#kvhitvalley"
    # h* with its standard error when the followed form publishes one (here h* sits at the wall: none)
    assert "<error" not in a["annotations"]["description"]
    se = stack.query('kvhit_valley_bottom_hit_ratio_stderr{namespace="ns-valley", form="chip_time"}')
    assert ("(one standard error)" in a["annotations"]["description"]) == bool(se)


def test_expected_alerts_fire_and_the_others_never_became_active(stack):
    firing = stack.firing()
    assert EXPECT_FIRING <= firing
    ttft = [a for a in stack.alerts() if a["labels"]["alertname"] == "KvhitPredictedTTFTAboveSLO"
            and a["labels"]["namespace"] == "ns-valley"]
    # Only at the current hit ratio: at the target h = 0.9 the predicted TTFT is below 0.2 s.
    assert {a["labels"]["hit_ratio"] for a in ttft} == {"current"}
    for a in stack.alerts_seen:
        key = (a["labels"]["alertname"], a["labels"].get("namespace"))
        assert key not in NEVER and (key[0], None) not in NEVER, f"{key} became {a['state']}: {a}"
    unexpected = {k for k in firing if k not in EXPECT_FIRING and k[1] not in UNDETERMINED}
    assert not unexpected, unexpected


def test_webhook_receives_the_valley_notification_with_labels_and_annotations_intact(stack):
    prom = next(a for a in stack.alerts() if a["labels"]["alertname"] == "KvhitValley"
                and a["labels"]["namespace"] == "ns-valley")
    with stack.lock:
        got = [(path, body, al) for path, body in stack.received for al in body["alerts"]
               if al["labels"]["alertname"] == "KvhitValley" and al["labels"]["namespace"] == "ns-valley"]
    assert got, "no KvhitValley notification reached the webhook"
    path, body, al = got[0]
    assert path == "/kvhit-chat"  # deploy/alertmanager.yml: severity=warning → kvhit-chat
    assert body["receiver"] == "kvhit-chat" and body["status"] == "firing" and al["status"] == "firing"
    assert body["groupLabels"] == {"alertname": "KvhitValley", "namespace": "ns-valley", "model_name": MODEL}
    assert al["labels"] == prom["labels"]
    assert al["annotations"] == prom["annotations"]
    assert set(al["annotations"]) == {"summary", "description", "runbook_url"}


def test_alertmanager_routes_every_alert_by_severity(stack):
    receiver = {"critical": "/kvhit-page", "warning": "/kvhit-chat", "info": "/kvhit-ticket"}
    with stack.lock:
        got = [(path, al) for path, body in stack.received for al in body["alerts"]]
    assert {al["labels"]["alertname"] for _, al in got} >= {a for a, _ in EXPECT_FIRING}
    for path, al in got:
        assert path == receiver[al["labels"]["severity"]], (path, al["labels"])


def test_the_podmonitors_relabeling_gives_the_rules_vllm_names_from_a_prometheus_2_scrape(stack):
    # ns-live's vLLM body says vllm_ throughout (tests: fake_vllm_handler); its recording rules
    # (read by KvhitPrefixCachingNotPaying, expected firing there) need vllm: names
    assert not stack.query('{__name__=~"vllm_.+"}')
    assert stack.query('vllm:prefix_cache_queries_total{namespace="ns-live"}')
    assert stack.query('namespace_model_name:vllm_prefix_cache_hit_ratio:rate24h{namespace="ns-live"}')


def test_every_rule_expression_returns_data(stack):
    firing = {a for a, _ in EXPECT_FIRING}
    for r in recording_rules():
        assert stack.query(r["expr"]), f"recording rule {r['record']}: empty"
        assert stack.query(r["record"]), f"{r['record']}: not recorded"
    for r in alert_rules():
        for s in selectors(r["expr"]):  # published at some time in this stack (the live sidecar's young
            # analysis has series, such as kvhit_unknown_info{signal="bathtub_chip_time"}, that it drops as it learns)
            assert stack.query(f"last_over_time({s.promql()}[1h])"), f"{r['alert']}: selector {s.promql()} never had data"
        result = stack.query(short_history(r["expr"]))
        if r["alert"] in firing:
            assert result, f"{r['alert']}: expected to hold in this stack, empty"
        else:  # thrash, fit not ok: the data is there, the condition does not hold
            result = [x for x in result if x["metric"].get("namespace") not in UNDETERMINED]
            assert not result, f"{r['alert']}: {result}"


def test_every_dashboard_expression_returns_data(stack):
    for uid, d in dashboards().items():
        assert set(dashboard_variables(d)) == set(VARIABLES) - {"__rate_interval"}, uid
    for uid, title, ref, expr in dashboard_targets():
        result = stack.query(substitute(expr, VARIABLES_OF[uid]))
        names_in = {s.name for s in selectors(expr)}
        absent = names_in & set(ABSENT_BY_DESIGN)
        if absent:
            assert not result, f"{uid} / {title} / {ref}: {absent} are expected absent here"
            for name in absent:
                assert stack.query(ABSENT_BY_DESIGN[name]), f"{name} absent without its reason"
            continue
        if names_in <= set(ABSENT_HERE):  # only what this stack cannot show, with the series saying why
            assert not result and all(stack.query(ABSENT_HERE[name]) for name in names_in), (uid, title, ref)
            continue
        if names_in <= NO_CAVEAT_HERE:
            assert all(x["metric"].get("namespace") in UNDETERMINED for x in result) and no_caveat(stack), (uid, title)
            continue
        assert result, f"{uid} / {title} / {ref}: empty: {substitute(expr, VARIABLES_OF[uid])[:300]}"
        for sample in result:
            assert math.isfinite(float(sample["value"][1])) or title == "Firing kvhit alerts", (title, ref, sample)


def test_the_pod_variable_lists_the_sidecars_that_analyse_nothing(stack):
    """The runbooks of KvhitTargetDown/NeverUp/NotAnalysable send on-call to the Sidecar health
    panels of the pod: the Pod variable must list a sidecar without any analysis (ns-down: its target
    never answered; ns-notvllm: not vLLM), and in a namespace with an analysis, that pod."""
    for uid, d in dashboards().items():
        var = dashboard_variables(d)["pod"]
        expr = re.fullmatch(r"query_result\((.*)\)", var["query"], flags=re.S).group(1)
        pick = re.compile(var["regex"].strip("/"))
        for ns, pods in {"ns-down": {"vllm-down-0"}, "ns-notvllm": {"vllm-notvllm-0"},
                         "ns-valley": {"vllm-valley-0"}}.items():
            result = stack.query(substitute(expr, {"namespace": ns, "model_name": VARIABLES_OF[uid]["model_name"]}))
            found = {pick.search("{" + ", ".join(f'{k}="{v}"' for k, v in r["metric"].items()) + "}").group(1)
                     for r in result}
            assert found == pods, (uid, ns, found)


def test_the_operating_point_is_the_grid_bar_nearest_the_current_hit_ratio(stack):
    """Worked by hand: the valley replay ends at h ≈ 0.008 (< 0.025), so the bar is hit_ratio="0.00"."""
    h = _value(stack.query('kvhit_hit_ratio{namespace="ns-valley", source="all"}'))
    assert 0 < h < 0.025
    expr = next(e for _, t, ref, e in dashboard_targets()
                if t == "Bathtub R(h) and the current operating point ($pod)" and ref == "B")
    result = stack.query(substitute(expr, dict(VARIABLES_OF["kvhit-model"], namespace="ns-valley")))
    assert [r["metric"] for r in result] == [{"hit_ratio": "0.00"}]


def test_every_referenced_metric_is_published_live(stack):
    """Checked against what kvhit and the (recorded) vLLM actually expose, scraped now."""
    live = set()
    for name in ("valley", "flat", "down", "live", "vllm"):
        with urllib.request.urlopen(f"{stack.url(name)}/metrics", timeout=10) as r:
            live |= metric_names_of_exposition(r.read().decode())
    recorded = {r["record"] for r in recording_rules()}
    from observability import referenced_metrics
    for metric, where in referenced_metrics().items():
        if not metric:  # {__name__=~"lmcache:.+"}: a KV connector's family, none runs here (test_rules pins it)
            continue
        if metric in ABSENT_BY_DESIGN:
            assert metric in names.BY_NAME
            continue
        if metric in NO_CAVEAT_HERE and metric not in live:
            assert metric in names.BY_NAME and no_caveat(stack), metric
            continue
        if metric in ABSENT_HERE:
            assert metric in names.BY_NAME and metric not in live and stack.query(ABSENT_HERE[metric]), metric
            continue
        assert metric in live | recorded | BUILTIN, f"{metric} (in {sorted(where)[:3]}) is not published"
