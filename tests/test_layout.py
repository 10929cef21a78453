"""The pipeline's one-way data flow and the single source of metric names (STYLE, design card)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from exporter import names

ROOT = Path(__file__).resolve().parents[1]
# Pipeline order: a module may import only modules listed before it (config/names are leaves).
ORDER = ["names", "config", "simulate", "sources", "engines", "parse", "window", "observe", "analyzer", "collector", "jsonapi",
         "runner", "server", "replay", "calibrate", "report", "cli", "__main__"]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_fitters_import_nothing_from_exporter():
    for path in (ROOT / "fitters").glob("*.py"):
        bad = [m for m in _imports(path) if m == "exporter" or m.startswith("exporter.")]
        assert not bad, f"{path.name} imports {bad}"
        assert not any(m.startswith("prometheus_client") for m in _imports(path)), path.name


def test_exporter_stages_import_only_earlier_stages():
    for path in (ROOT / "exporter").glob("*.py"):
        if path.stem == "__init__":
            continue
        assert path.stem in ORDER, f"exporter/{path.name} has no place in the pipeline order"
        mine = ORDER.index(path.stem)
        for mod in _imports(path):
            if mod.startswith("exporter."):
                other = mod.split(".")[1]
                assert ORDER.index(other) < mine, f"exporter/{path.name} imports later stage {mod}"


def test_readme_lists_exactly_the_published_metrics():
    readme = (ROOT / "README.md").read_text()
    listed = set(re.findall(r"^\| `(kvhit_[a-z0-9_]+)` \|", readme, flags=re.M))
    assert listed == {m.name for m in names.ALL}
    # each row says what the HELP text says (a row may add a sentence after it)
    rows = dict(re.findall(r"^\| `(kvhit_[a-z0-9_]+)` \| [^|]*\| (.*?) \| [^|]* \|$", readme, flags=re.M))
    for m in names.ALL:
        assert rows[m.name].replace("\\|", "|").startswith(m.help), m.name


def test_metric_names_follow_prometheus_conventions():
    for m in names.ALL:
        assert m.name.startswith("kvhit_")
        assert m.name.endswith("_total") == (m.type == "counter"), m.name
        assert not m.name.endswith(("_rate", "_percent", "_ms", "_milliseconds")), m.name
        assert "[" in m.help and "]" in m.help or m.name.endswith(("_info", "_up", "_status", "_exit", "_active")), \
            f"{m.name}: HELP must state the unit"
