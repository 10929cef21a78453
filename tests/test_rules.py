"""rules/: promtool check and unit tests, alert conventions, runbooks, metric references, the example
Alertmanager route. (The rules against a real Prometheus: tests/test_prometheus_live.py.)"""
from __future__ import annotations

import re
import subprocess

import yaml

from exporter import names
from observability import (ALERTMANAGER_EXAMPLE, BUILTIN, COUNTER_SUFFIXES, ROOT, RULE_TESTS, RULES, alert_rules,
                           all_exprs, recording_rules, referenced_metrics, rule_groups, runbook_anchors, tool,
                           vllm_trace_metric_names)
from promql_selectors import selectors

# The issue's alerts, and those a user of them needs (the target never up or not analysable, an invalid
# config, kvhit's own analysis failing, the SLO missed as observed: the predicted mean TTFT alone can sit
# under the SLO while requests miss it)
ALERTS = {"KvhitValley", "KvhitRevenueBelowZeroHitBaseline", "KvhitPredictedTTFTAboveSLO", "KvhitSLOMissed",
          "KvhitPrefixCachingNotPaying", "KvhitCacheThrash", "KvhitFitNotOk", "KvhitTargetDown", "KvhitTargetNeverUp",
          "KvhitTargetNotAnalysable", "KvhitAnalysisFailing", "KvhitConfigInvalid", "KvhitAbsent"}


def _duration(s: str) -> int:
    """Prometheus duration → seconds (the units the rule files use)."""
    total = 0
    for value, unit in re.findall(r"(\d+)(ms|s|m|h|d|w|y)", s):
        total += int(value) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}[unit]
    return int(total)


def test_promtool_check_rules():
    out = subprocess.run([tool("promtool"), "check", "rules", *map(str, RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("SUCCESS") == len(RULES)


def test_promtool_unit_tests_pass():
    assert RULE_TESTS, "no promtool unit tests in rules/tests/"
    out = subprocess.run([tool("promtool"), "test", "rules", *map(str, RULE_TESTS)], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAILED" not in out.stdout + out.stderr


def test_the_issue_s_alerts_and_nothing_else():
    assert {r["alert"] for r in alert_rules()} == ALERTS


def test_every_alert_has_for_severity_summary_live_description_and_runbook():
    anchors = runbook_anchors()
    for r in alert_rules():
        a = r["alert"]
        assert _duration(r["for"]) >= 300, f"{a}: a `for:` of at least 5 min (a real operating duration)"
        sev = r["labels"]["severity"]  # a template chooses among the three by label
        assert (set(re.findall(r'}}(\w+){{', sev)) if "{{" in sev else {sev}) <= {"critical", "warning", "info"}, a
        ann = r["annotations"]
        assert ann["summary"].strip() and "{{ $labels." in ann["summary"] or a == "KvhitAbsent", a
        assert "$value" in ann["description"], f"{a}: the description must show the live value"
        m = re.fullmatch(r"docs/runbooks\.md#([a-z0-9-]+)", ann["runbook_url"])
        assert m, f"{a}: runbook_url {ann['runbook_url']!r} is not a section of docs/runbooks.md"
        assert m.group(1) == a.lower() and m.group(1) in anchors, f"{a}: no section #{m.group(1)} in docs/runbooks.md"
        section = anchors[m.group(1)]
        assert "**Act.**" in section and "**Check.**" in section, f"{a}: the runbook must say what to check and do"


def test_valley_alert_is_the_model_s_condition_with_severity_warning():
    """MODEL.md §4: the valley alert is kvhit_valley_active (R'(h_now) < 0 with the 95 % upper bound
    below 0; 0 at h = 0, where nothing is lost: tests/test_bathtub.py), sustained, and not at h = 0
    (kvhit_hit_ratio: an older kvhit said 1 there); severity warning as the issue asks."""
    r = next(r for r in alert_rules() if r["alert"] == "KvhitValley")
    assert r["labels"]["severity"] == "warning"
    assert {s.name for s in selectors(r["expr"])} == {"kvhit_valley_active", "kvhit_revenue_slope", "kvhit_hit_ratio"}
    assert "== 1" in r["expr"]


def test_each_alert_has_a_for_boundary_unit_test():
    """For every alert some promtool test case has no alert one evaluation before the `for:` boundary
    and the alert firing at it. The boundary is `for:`, or `for:` + one evaluation when the expression
    needs two samples (a rate, a standard deviation) before it can be true at all; an alert that reads
    a recording rule (level:metric:operations) of another group sees it one evaluation later or not,
    as promtool evaluates groups in no fixed order, so its firing check may sit one evaluation later.
    An expression that requires history (a selector read at `offset d`: promtool's series start at 0)
    can first be true at d, so its boundary is d + `for:`."""
    for rule in alert_rules():
        a, need = rule["alert"], _duration(rule["for"])
        late = 1 if re.search(r"\b[a-z_]+:[a-z_]+:[a-z0-9_]+\b", rule["expr"]) else 0
        need += max((_duration(d) for d in re.findall(r"\boffset\s+(\w+)", rule["expr"])), default=0)
        boundary = False
        for path in RULE_TESTS:
            doc = yaml.safe_load(path.read_text())
            step = _duration(doc.get("evaluation_interval", "1m"))
            for case in doc["tests"]:
                evals = {_duration(t["eval_time"]): t["exp_alerts"] for t in case.get("alert_rule_test", [])
                         if t["alertname"] == a}
                firing_at = {need + k * step for k in range(2 + late)}
                boundary |= any(exp and t in firing_at and evals.get(t - (1 + late) * step) == []
                                for t, exp in evals.items())
        assert boundary, f"{a}: no promtool test of the `for:` boundary (silent at for-1, firing at for)"


def test_every_alert_has_a_case_where_it_stays_silent_past_its_for():
    """Non-firing series: besides the pods of each firing case that are absent from its exact
    exp_alerts list, every alert is checked silent on healthy series long past its `for:`."""
    need = {r["alert"]: _duration(r["for"]) for r in alert_rules()}
    seen = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for t in case.get("alert_rule_test", []):
                if t["exp_alerts"] == [] and _duration(t["eval_time"]) > need[t["alertname"]]:
                    seen.add(t["alertname"])
    assert seen == ALERTS


def test_every_referenced_metric_is_kvhit_s_vllm_s_or_a_recording_rule():
    kvhit = {m.name for m in names.ALL}
    vllm = vllm_trace_metric_names()
    recorded = {r["record"] for r in recording_rules()}
    for name, where in referenced_metrics().items():
        if name == "":  # {__name__=~…}: only a KV connector's own family (not in vLLM's exposition), in
            # both spellings: lmcache: and OpenMetrics' lmcache_ (Prometheus 2), as parse reads it
            names_ = {v for w, expr in all_exprs() if w in where for s in selectors(expr) if not s.name
                      for k, _, v in s.matchers if k == "__name__"}
            assert names_ == {"lmcache[:_].+"}, f"a selector without a metric name in {sorted(where)}: {names_}"
        elif name.startswith("kvhit_"):
            assert name in kvhit, f"{name} (in {sorted(where)}) is not a kvhit metric (exporter/names.py)"
        elif name.startswith("vllm:"):
            assert name in vllm, f"{name} (in {sorted(where)}) is not in vLLM 0.32's exposition"
        else:
            assert name in recorded | BUILTIN, f"{name} (in {sorted(where)}) is neither kvhit's, vLLM's nor recorded"


def test_counters_are_only_read_as_rates():
    """Rates from counters, never ratios of lifetime counters: every counter selector is a range."""
    counters = {m.name for m in names.ALL if m.type == "counter"}
    for g in rule_groups():
        for r in g["rules"]:
            for s in selectors(r["expr"]):
                if s.name.endswith(COUNTER_SUFFIXES) and (s.name.startswith("vllm:") or s.name in counters):
                    assert s.ranged, f"{r.get('alert') or r.get('record')}: counter {s.name} read without a range"


def test_recording_rules_aggregate_per_model_and_are_named_level_metric_operations():
    for r in recording_rules():
        level, metric, ops = r["record"].split(":")
        if level == "instance_model_name":  # per target (job, instance): a model's parts, summed next
            assert "by (namespace, job, instance, model_name)" in r["expr"] and metric and ops, r["record"]
            continue
        assert level == "namespace_model_name" and metric and ops, r["record"]
        assert re.search(r"by \(namespace, model_name(, [a-z_]+)*\)", r["expr"]) or \
            all(s.name.startswith("namespace_model_name:") for s in selectors(r["expr"])), r["record"]


def test_example_alertmanager_route_is_valid_and_routes_by_severity_grouping_by_model():
    out = subprocess.run([tool("amtool"), "check-config", str(ALERTMANAGER_EXAMPLE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    cfg = yaml.safe_load(ALERTMANAGER_EXAMPLE.read_text())
    assert "model_name" in cfg["route"]["group_by"]
    for severity in ("critical", "warning", "info"):
        out = subprocess.run([tool("amtool"), "config", "routes", "test", f"--config.file={ALERTMANAGER_EXAMPLE}",
                              "alertname=KvhitValley", f"severity={severity}", "model_name=m"],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        receiver = out.stdout.strip()
        assert receiver != cfg["route"]["receiver"], f"severity={severity} falls through to the default receiver"
        assert any(rx["name"] == receiver and rx.get("webhook_configs") for rx in cfg["receivers"]), receiver


def test_recording_rule_reads_offloading_as_the_parser_does():
    """The external-hits rule rules out a connector with the parser's own pattern, so a dashboard's h
    and kvhit's agree on which kv_offloading_size values mean offloading (MODEL.md §2)."""
    from exporter.parse import OFFLOAD_SIZE_ON
    exprs = [r["expr"] for r in recording_rules() if "kv_offloading_size" in r["expr"]]
    assert exprs and all(re.findall(r'kv_offloading_size=~"([^"]*)"', e) == [OFFLOAD_SIZE_ON] for e in exprs)
