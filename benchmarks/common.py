"""What both benchmarks share: their command line, the "Bars missed" block that tests/test_benchmarks.py
reads, and writing the markdown result (benchmarks/results/<name>-quick.md or <name>-full.md)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def parser(doc: str, name: str) -> argparse.ArgumentParser:
    """--quick (the CI mode), --check (exit 1 on a bar missed beyond its noise margin), --out."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="reduced run (CI)")
    p.add_argument("--check", action="store_true", help="exit 1 when a bar is missed beyond its noise margin")
    p.add_argument("--out", help=f"markdown file (default benchmarks/results/{name}-{{quick,full}}.md)")
    return p


def missed(title: str, miss: list[str]) -> list[str]:
    """The markdown lines listing the missed bars (one "- " line each)."""
    return ["", f"{title}: " + ("none" if not miss else ""), *[f"- {m}" for m in miss], ""]


def finish(name: str, args: argparse.Namespace, text: str, miss: list[str]) -> int:
    """Write and print the result; the exit code --check asks for."""
    out = Path(args.out) if args.out else RESULTS / f"{name}-{'quick' if args.quick else 'full'}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    if args.check and miss:
        print(f"{name}: {len(miss)} bar(s) missed beyond the noise margin", file=sys.stderr)
        return 1
    return 0
