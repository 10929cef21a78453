"""A small PromQL lexer for tests: the vector selectors an expression reads.

Enough of PromQL for kvhit's rules and dashboards (and Grafana's ``$variables``): strings, numbers,
durations in ``[...]``, label matchers in ``{...}``, grouping label lists after by / without / on /
ignoring / group_left / group_right, ``offset``, and function calls. Not a full parser: it finds
the selectors and whether each is read over a range (``name{...}[5m]``), which is what the tests
check (metric names exist; counters are only read through rate-style range functions).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
            "offset", "inf", "nan", "atan2",
            # aggregation operators (``sum by (x) (...)`` puts a label list between name and call)
            "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
            "quantile"}
LABEL_LIST_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER = re.compile(r"0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_VAR = re.compile(r"\$(?:\{[^}]*\}|[A-Za-z_][A-Za-z0-9_]*)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`)\s*,?')


@dataclass(frozen=True)
class Selector:
    """``name{matchers}``; ``ranged`` when read as a range vector (``[...]`` follows)."""

    name: str
    matchers: tuple[tuple[str, str, str], ...]
    ranged: bool

    def promql(self) -> str:
        """The instant-vector selector itself (as PromQL)."""
        inner = ", ".join(f'{k}{op}"{v}"' for k, op, v in self.matchers)
        return f"{self.name}{{{inner}}}" if self.name else f"{{{inner}}}"


def _unquote(s: str) -> str:
    if s[0] == "`":
        return s[1:-1]
    return bytes(s[1:-1], "utf-8").decode("unicode_escape")


def selectors(expr: str) -> list[Selector]:
    """Every vector selector in ``expr``, in order of appearance."""
    out: list[Selector] = []
    i, n = 0, len(expr)
    skip_label_list = False
    last_end = -1  # index just after the latest selector
    while i < n:
        c = expr[i]
        if c.isspace():
            i += 1
            continue
        if c == "#":  # comment to end of line
            j = expr.find("\n", i)
            i = n if j < 0 else j + 1
            continue
        m = _STRING.match(expr, i)
        if m:
            i = m.end()
            continue
        m = _VAR.match(expr, i)
        if m:
            i = m.end()
            continue
        if c == "[":  # range or subquery: its duration is opaque; mark the selector right before it
            j = expr.index("]", i)
            if out and expr[last_end:i].strip() == "":
                last = out[-1]
                out[-1] = Selector(last.name, last.matchers, True)
            i = j + 1
            continue
        if c == "(" and skip_label_list:
            i = expr.index(")", i) + 1
            skip_label_list = False
            continue
        m = _NUMBER.match(expr, i)
        if m and not _IDENT.match(expr, i):
            i = m.end()
            continue
        m = _IDENT.match(expr, i)
        if m:
            word = m.group(0)
            j = m.end()
            k = j
            while k < n and expr[k].isspace():
                k += 1
            low = word.lower()
            if low in LABEL_LIST_KEYWORDS:
                skip_label_list = True
                i = j
                continue
            if low == "offset":
                i = j
                while i < n and expr[i].isspace():
                    i += 1
                i = re.compile(r"-?[0-9a-zA-Z]+").match(expr, i).end()
                continue
            if low in KEYWORDS or (k < n and expr[k] == "("):  # keyword or function call
                i = j
                continue
            matchers: tuple = ()
            if k < n and expr[k] == "{":
                matchers, j = _matchers(expr, k)
            out.append(Selector(word, matchers, False))
            last_end = i = j
            continue
        if c == "{":
            matchers, j = _matchers(expr, i)
            name = next((v for k2, op, v in matchers if k2 == "__name__" and op == "="), "")
            # a regex __name__ matcher stays (a family by name pattern), the exact one is the name
            out.append(Selector(name, tuple(mt for mt in matchers if mt[:2] != ("__name__", "=")), False))
            last_end = i = j
            continue
        i += 1
    return out


def _matchers(expr: str, i: int) -> tuple[tuple[tuple[str, str, str], ...], int]:
    """Parse ``{...}`` starting at ``i``; returns (matchers, index after ``}``)."""
    assert expr[i] == "{"
    j = i + 1
    out = []
    while True:
        while expr[j].isspace():
            j += 1
        if expr[j] == "}":
            return tuple(out), j + 1
        m = _MATCHER.match(expr, j)
        if not m:
            raise ValueError(f"cannot parse label matchers at {expr[j:j + 40]!r}")
        out.append((m.group(1), m.group(2), _unquote(m.group(3))))
        j = m.end()


def metric_names(expr: str) -> set[str]:
    return {s.name for s in selectors(expr) if s.name}
