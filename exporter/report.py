"""``kvhit report PATH|URL``: one HTML page with PNG plots, for capacity reviews.

Sources:

* PATH — a recorded trace (directory or ``.tar.gz`` of ``<unix_ms>.prom``, as ``kvhit replay``
  reads): replayed through the whole pipeline with the given configuration. The page then has
  every plot, including the observed per-step points and the fit diagnostics.
* PATH ending in ``.json`` — an analysis document (``kvhit replay --save-fit``, or saved from
  ``/api/v1/analysis``).
* URL — a running kvhit: its base address (``http://host:9471``) or its ``/api/v1/analysis``.
  The page shows the current analysis (model curves, operating point, the numbers); per-step
  points and diagnostics need the history a trace has, and the page says so.
  A vLLM ``/metrics`` URL is refused: one scrape has no history to fit — record a trace, or point
  kvhit at it and report on kvhit.

Plots per model (MODEL.md §3.2, §3.4, §4, §7): the bathtub R(h) of each form with its valley
shaded (h* to h_even, or to the right end when the valley has no exit) and the operating point;
TTFT against h (service and load-aware model, observed step means); delivered and physical TPM
against h (predicted capacity, observed steps); fit diagnostics (chip-time residuals per busy
step over time with the tail-chunk steps flagged by the miss-slope fit marked, and the miss
throughput against h with the direct line).

The page is self-contained (PNG images embedded as data URIs, also written next to it) and
marks ``<body data-images="loaded/total">`` once its images have loaded, which is what the
headless-browser test checks. matplotlib is the optional extra ``report``
(``pip install ".[report]"`` in a checkout: kvhit is not on PyPI).
"""
from __future__ import annotations

import base64
import hashlib
import html
import io
import math
import re
import socket
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import requests

from exporter.config import Config, ConfigError, redact_url
from exporter.jsonapi import analysis_to_dict, check_analysis_doc, load_fit, read_doc, why_unread, withdrawn
from exporter.replay import replay
from exporter.sources import caused_by, http_session, load_trace, write_atomic
from fitters.chiptime import design_row, predict_busy_time
from fitters.missslope import bucket_key, length_bucket
from fitters.model import max_hit_ratio
from fitters.observation import Observation
from fitters.whatif import FittedModel


class ReportError(ValueError):
    """The report cannot be made (message says why; exit code 1)."""


@dataclass
class ReportData:
    """What a report is drawn from: the analysis document and, for traces, every step."""

    source: str
    doc: dict
    steps: dict[str, list[Observation]] = field(default_factory=dict)


# --- sources --------------------------------------------------------------------------------


def is_url(source: str) -> bool:
    """A running kvhit's address (its analysis is fetched), not a path."""
    return re.match(r"https?://", source) is not None


def is_analysis(source: str) -> bool:
    """A source whose analysis is already made (a kvhit URL or a saved ``.json``), not a trace to
    replay with a configuration."""
    return is_url(source) or Path(source).suffix == ".json"


def load_source(source: str, config: Config, timeout: float = 10.0) -> ReportData:
    """Trace path, analysis JSON or kvhit URL → :class:`ReportData`.

    Raises:
        ConfigError: a vLLM /metrics URL (not a kvhit address).
        ReportError: unreachable URL, not an analysis document, unreadable trace.
    """
    if is_url(source):
        return ReportData(redact_url(source), _fetch(source, timeout))  # the page names it too
    path = Path(source)
    if path.suffix == ".json":
        try:
            doc = read_doc(source)
        except (OSError, ValueError, RecursionError) as exc:
            raise ReportError(f"{source}: cannot read a JSON analysis ({why_unread(exc)})") from None
        return ReportData(source, _check_doc(doc, source))
    try:
        trace = load_trace(path, config.max_body_bytes)
    except (OSError, ValueError) as exc:  # the message names the trace
        raise ReportError(str(exc)) from None
    result = replay(trace, config, source)
    analysis, health = result.runner.current()
    steps: dict[str, list[Observation]] = {}
    for model, obs in result.steps:
        steps.setdefault(model, []).append(obs)
    return ReportData(source, analysis_to_dict(analysis, health), steps)


def _fetch(url: str, timeout: float) -> dict:
    base = url.rstrip("/")
    if base.endswith("/metrics"):
        raise ConfigError(f"argument PATH|URL: {redact_url(url)} looks like a /metrics endpoint; give kvhit's base address "
                          "(http://host:9471) or a recorded trace")
    if not base.endswith("/api/v1/analysis"):
        base += "/api/v1/analysis"
    shown = redact_url(base)  # a user:password or ?token= in the URL stays out of messages
    try:
        with http_session() as session:
            resp = session.get(base, timeout=timeout)
    except requests.RequestException as exc:  # a bare "ConnectionError" said nothing (newcomer trial)
        why = ("connection refused: nothing listens on that port (kvhit serves on 9471 unless --listen says "
               "otherwise)" if caused_by(exc, ConnectionRefusedError)
               else "cannot resolve its host (DNS)" if caused_by(exc, socket.gaierror)
               else f"no answer within {timeout:g} s" if isinstance(exc, requests.Timeout) else type(exc).__name__)
        raise ReportError(f"cannot fetch {shown}: {why}") from None
    if resp.status_code != 200:
        # kvhit's own plain-text answer says why (a refused configuration: 503 for every path)
        said = resp.text.split("\n", 1)[0][:200] if resp.headers.get("Content-Type", "").startswith("text/plain") else ""
        said = "".join(c for c in said if c.isprintable()).strip()
        raise ReportError(f"HTTP {resp.status_code} from {shown}" + (f": {said}" if said else ""))
    try:
        doc = resp.json()
    except (ValueError, RecursionError):
        raise ReportError(f"{shown} did not answer JSON") from None
    return _check_doc(doc, shown)


def _check_doc(doc, where: str) -> dict:
    """``doc`` when it is an analysis document whose saved fits load as ``kvhit predict`` loads
    them (jsonapi.load_fit): an unusable fit (a NaN, a field out of range, another schema) is the
    file's error, never a report that calls the fit ok and drops its plots for another reason."""
    try:
        doc = check_analysis_doc(doc)
        for name, m in doc["models"].items():
            if isinstance(m, dict) and m.get("fit"):
                load_fit(doc, name)
    except ValueError as exc:
        raise ReportError(f"{where}: {exc}") from None
    return doc


# --- plots ----------------------------------------------------------------------------------


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ReportError('kvhit report needs matplotlib: pip install ".[report]" in the kvhit checkout') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _versus_h(plt, fig, ax, ylabel: str, title: str, legend_size: int = 8, grid: str = "major") -> bytes:
    """A plot against the token hit ratio finished (labels, grid, legend) as PNG bytes."""
    ax.set_xlabel("token hit ratio h")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, which=grid)
    _legend(ax, legend_size)
    return _png(plt, fig)


def _legend(ax, size: int = 8) -> None:
    """The axes' legend, when something on them is labelled (a legend of nothing warned on
    stderr: a two-scrape trace's diagnostics, before any fit)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=size)


def _png(plt, fig) -> bytes:
    """The figure as PNG bytes; the figure is closed (pyplot keeps every open figure alive)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _fitted(m: dict) -> FittedModel | None:
    return FittedModel.from_dict(m["fit"]) if m.get("fit") else None  # checked by load_source


def _predicting(m: dict) -> FittedModel | None:
    """The saved fit when it can draw a curve: None without one, or without its window's engine
    steps per request (a window no request finished in: FittedModel.unidentified)."""
    fitted = _fitted(m)
    return fitted if fitted is not None and fitted.steps_per_request is not None else None


def _h_grid(isl: float | None, n: int = 200) -> list[float]:
    h_max = min(0.995, max_hit_ratio(isl)) if isl and isl > 1 else 0.995
    return [h_max * i / (n - 1) for i in range(n)]


def _model_grid(fitted: FittedModel, isl: float, osl: float) -> list[float]:
    """The h of :func:`_h_grid` at which ``fitted`` can predict (FittedModel.unidentified)."""
    return [h for h in _h_grid(isl) if fitted.unidentified(h, isl, osl) is None]


COLORS = {"linear": "#1f77b4", "chip_time": "#d62728"}


def plot_bathtub(plt, m: dict) -> bytes | None:
    """R(h) per form from the published curve, valley shaded, operating point marked."""
    tubs = m.get("bathtubs") or {}
    if not tubs:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for form, b in tubs.items():
        color = COLORS.get(form, "k")
        curve = [(h, r) for h, r in b.get("curve") or [] if r is not None]
        if curve:
            ax.plot([h for h, _ in curve], [r for _, r in curve], "-", color=color, label=f"R(h), {form}")
        if b.get("h_star") is not None:
            # the dip below R(0): falling up to its bottom h* (R' < 0, more hits earn less: where
            # valley_active can fire), then climbing back to R(0) at h_even
            right = b["h_even"] if b.get("h_even") is not None else (curve[-1][0] if curve else 1.0)
            # from the curve's first point: a form published over part of [0, 1) says nothing before it
            ax.axvspan(curve[0][0] if curve else 0.0, b["h_star"], color=color, alpha=0.22,
                       label=f"valley {form}, falling: more hits earn less (h < h*={b['h_star']:.4g})")
            ax.axvspan(b["h_star"], right, color=color, alpha=0.08,
                       label=f"valley {form}, climbing back to R(0) (" + (
                           f"h_even={b['h_even']:.4g})" if b.get("h_even") is not None
                           else "no exit)" if b.get("exit") is False else "h_even not published: kvhit_unknown_info says why)"))
        if b.get("h_now") is not None and b.get("revenue_now") is not None:
            ax.plot([b["h_now"]], [b["revenue_now"]], "o", color=color, markersize=9, markeredgecolor="k",
                    label=f"now: h={b['h_now']:.3f}" + (" (valley active)" if b.get("valley_active") else ""))
    return _versus_h(plt, fig, ax, "revenue per machine-second R(h) [price/s]",
                     "Bathtub: revenue vs hit ratio (MODEL.md §4)")


def _isl_groups(steps: list[Observation], value) -> dict[str, tuple[list[float], list[float]]]:
    groups: dict[str, tuple[list[float], list[float]]] = {}
    for o in steps:
        h, y = o.hit_ratio, value(o)
        if h is None or y is None or o.isl is None or o.isl < 1 or not math.isfinite(y):
            continue
        lo, hi = length_bucket(o.isl)
        xs, ys = groups.setdefault(f"observed steps, ISL in [{lo}, {hi})", ([], []))
        xs.append(h)
        ys.append(y)
    return groups


def plot_ttft(plt, m: dict, steps: list[Observation]) -> bytes | None:
    """TTFT vs h: the model at the current ISL/OSL and the observed step means."""
    fitted, isl, osl = _predicting(m), m.get("isl"), m.get("osl")
    groups = _isl_groups(steps, lambda o: o.ttft_mean)
    if fitted is None and not groups:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    lengths = _isl_groups(steps, lambda o: o.isl)
    outs = _isl_groups(steps, lambda o: o.osl)
    for i, ((label, (xs, ys)), marker) in enumerate(zip(sorted(groups.items()), "o^sv<>")):
        color = f"C{i + 2}"
        ax.plot(xs, ys, marker, color=color, alpha=0.35, markersize=4, label=label)
        n, g = lengths.get(label, ([], []))[1], outs.get(label, ([], []))[1]
        if fitted is not None and n and g:
            mean_n, mean_g = sum(n) / len(n), sum(g) / len(g)
            hs = _model_grid(fitted, mean_n, mean_g)
            ttft = [fitted.predict(h, mean_n, mean_g).ttft_service for h in hs]
            if any(t is not None for t in ttft):
                ax.plot(hs, [math.nan if t is None else t for t in ttft], ":", color=color,
                        label=f"model, service at that group's ISL {mean_n:.0f}")
    if fitted is not None and isl and osl is not None and (hs := _model_grid(fitted, isl, osl)):
        preds = [fitted.predict(h, isl, osl) for h in hs]
        # each line only where it is predicted (a gap, nan, where withheld), and not in the legend
        # without a point: a newcomer read a service line the plot did not draw
        for kind, style, label in (("ttft_service", "-", f"model, service (window ISL {isl:.0f})"),
                                   ("ttft_load_aware", "--", "model, load-aware (window concurrency: queueing included)")):
            if any(getattr(p, kind) is not None for p in preds):
                ax.plot(hs, [math.nan if getattr(p, kind) is None else getattr(p, kind) for p in preds], style,
                        color="k", label=label)
        if all(p.ttft_service is None for p in preds):
            ax.text(0.02, 0.02, "\n".join(textwrap.wrap(f"model TTFT at the window's ISL {isl:.0f} withheld: "
                                                        f"{preds[0].unknown['ttft_service']}", 90)),
                    transform=ax.transAxes, fontsize=7, va="bottom")
    h_now = (m.get("hit_ratio") or {}).get("all")
    if h_now is not None and m.get("observed_ttft_seconds") is not None:
        ax.plot([h_now], [m["observed_ttft_seconds"]], "D", color="#d62728", markersize=9,
                label="observed, publish window")
    return _versus_h(plt, fig, ax, "TTFT [s]", "TTFT vs hit ratio: model and observed (MODEL.md §3.2, §7)")


def plot_tpm(plt, m: dict, steps: list[Observation]) -> bytes | None:
    """Delivered and physical TPM vs h: predicted capacity and observed steps."""
    fitted, isl, osl = _predicting(m), m.get("isl"), m.get("osl")

    def delivered(o: Observation):
        if o.queried_tokens is None or o.generation_tokens is None or o.dt <= 0:
            return None
        return (o.queried_tokens + o.generation_tokens) * 60.0 / o.dt

    def physical(o: Observation):
        if o.miss_tokens is None or o.generation_tokens is None or o.dt <= 0:
            return None
        return (o.miss_tokens + o.generation_tokens) * 60.0 / o.dt

    busy = [o for o in steps if o.busy]
    obs_d, obs_p = _isl_groups(busy, delivered), _isl_groups(busy, physical)
    if fitted is None and not obs_d:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    if fitted is not None and isl and osl is not None and (hs := _model_grid(fitted, isl, osl)):
        preds = [fitted.predict(h, isl, osl) for h in hs]
        # at the window's ISL: steps of longer prompts deliver more per minute (a newcomer read them
        # above "the" capacity)
        ax.plot(hs, [p.tpm_delivered for p in preds], "-", color="#2ca02c",
                label=f"predicted delivered (capacity at the window's ISL {isl:.0f})")
        ax.plot(hs, [p.tpm_physical for p in preds], "-", color="#9467bd",
                label=f"predicted physical (capacity at the window's ISL {isl:.0f})")
    for label, (xs, ys) in sorted(obs_d.items()):
        ax.plot(xs, ys, "o", color="#2ca02c", alpha=0.25, markersize=3, label=f"delivered, {label}")
    for label, (xs, ys) in sorted(obs_p.items()):
        ax.plot(xs, ys, "x", color="#9467bd", alpha=0.3, markersize=3, label=f"physical, {label}")
    ax.set_yscale("log")
    return _versus_h(plt, fig, ax, "TPM [tokens/min]", "Delivered vs physical TPM (MODEL.md §3.4)", legend_size=7,
                     grid="both")


def plot_diagnostics(plt, m: dict, steps: list[Observation]) -> bytes | None:
    """Chip-time residuals over time with flagged tail-chunk steps; miss throughput vs h."""
    fitted = _fitted(m)
    busy = [o for o in steps if design_row(o) is not None]
    if not busy:
        return None
    anomalies = set(round(t, 3) for t in m.get("anomaly_times") or [])
    t0 = steps[0].t - steps[0].dt
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7.5, 7.0))
    if fitted is not None:
        coef = fitted.fit_coefficients  # the busy engines' machine the steps ran on, not the full-load one
        ts, res = [], []
        for o in busy:
            try:
                pred = predict_busy_time(coef, o)
            except ValueError:
                continue
            ts.append(o.t - t0)
            res.append(100.0 * (o.dt - pred) / o.dt)
        ax1.plot(ts, res, ".", color="#1f77b4", label="busy step: (observed − predicted)/observed")
    else:
        ax1.text(0.5, 0.5, "no chip-time fit yet", ha="center", transform=ax1.transAxes)
    for i, o in enumerate(o for o in busy if round(o.t, 3) in anomalies):
        ax1.axvspan(o.t - o.dt - t0, o.t - t0, color="#d62728", alpha=0.25,
                    label="tail-chunk step (left out of the miss-slope fit)" if i == 0 else None)
    if not anomalies:
        ax1.text(0.01, 0.97, "no tail-chunk step flagged in the current ISL and OSL bucket", transform=ax1.transAxes,
                 va="top", fontsize=8, color="#555")
    ax1.axhline(0, color="k", linewidth=0.8)
    ax1.set_xlabel("time since the first scrape [s]")
    ax1.set_ylabel("chip-time residual [%]")
    ax1.set_title("Fit diagnostics: chip-time model residuals (MODEL.md §7)")
    ax1.grid(alpha=0.3)
    _legend(ax1)

    slope = (m.get("fits") or {}).get("miss_slope") or {}
    extra = slope.get("extra") or {}
    in_bucket, which = busy, ""
    if "isl_bucket_lo" in extra:  # the steps the fitter put in the published bucket (fitters/missslope.py)
        osl = (extra["osl_bucket_lo"], extra["osl_bucket_hi"]) if "osl_bucket_lo" in extra else None
        key = ((extra["isl_bucket_lo"], extra["isl_bucket_hi"]), osl)
        in_bucket = [o for o in busy if o.isl is not None and o.isl >= 1 and bucket_key(o.isl, o.osl) == key]
        which = f", busy steps with ISL in [{key[0][0]}, {key[0][1]})" + (
            " and OSL unknown" if osl is None else f" and OSL in [{osl[0]}, {osl[1]})")
    pts = [(o.hit_ratio, o.miss_tps, round(o.t, 3) in anomalies) for o in in_bucket
           if o.hit_ratio is not None and o.miss_tps is not None]
    ax2.plot([h for h, _, a in pts if not a], [y for _, y, a in pts if not a], "o", alpha=0.4, markersize=4,
             label="busy step TPS_miss")
    flagged = [(h, y) for h, y, a in pts if a]
    if flagged:
        ax2.plot([h for h, _ in flagged], [y for _, y in flagged], "x", color="#d62728", markersize=8,
                 label="flagged tail-chunk step")
    params = slope.get("params") or {}
    if slope.get("status") == "ok" and "tps0" in params and "a" in params:
        tps0, a = params["tps0"]["value"], params["a"]["value"]
        # over the h its steps spanned: a is a secant over them and says nothing beyond (a newcomer
        # read the line drawn to h = 1 as the fit's)
        lo, hi = extra.get("h_min", 0.0), extra.get("h_max", 1.0)
        ax2.plot([lo, hi], [tps0 * (1 - a * lo), tps0 * (1 - a * hi)], "-", color="k",
                 label=f"direct fit TPS0·(1−a·h), a={a:.3f}, over its steps' h")
    ax2.set_xlabel("token hit ratio h")
    ax2.set_ylabel("miss tokens per busy second [tokens/s]")
    ax2.set_title("Miss throughput vs h (MODEL.md §4)" + which)
    ax2.grid(alpha=0.3)
    _legend(ax2)
    fig.tight_layout()
    return _png(plt, fig)


# --- page -----------------------------------------------------------------------------------


def _fmt(x, spec: str = ".4g") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return format(x, spec) if isinstance(x, (int, float)) else html.escape(str(x))


def _summary_rows(m: dict) -> list[tuple[str, str]]:
    slo = m.get("slo") or {}
    verdict = m.get("prefix_cache_verdict") or {}
    rows = [
        ("hit ratio h (window: all / device / loaded)",
         " / ".join(_fmt((m.get("hit_ratio") or {}).get(k), ".4f") for k in ("all", "device", "loaded"))),
        ("ISL / OSL [tokens]", f"{_fmt(m.get('isl'), '.0f')} / {_fmt(m.get('osl'), '.0f')}"),
        ("observed TTFT mean / P95 [s]", f"{_fmt(m.get('observed_ttft_seconds'))} / "
                                         f"{_fmt((m.get('p95_seconds') or {}).get('ttft'))}"),
        ("TPOT P95 [s] (source)", f"{_fmt((m.get('p95_seconds') or {}).get('tpot_request', (m.get('p95_seconds') or {}).get('itl')))}"
                                  f" ({_fmt(m.get('tpot_source'))})"),
        ("SLO pass ratio [lower, upper]", f"[{_fmt(slo.get('pass_lower'), '.4f')}, {_fmt(slo.get('pass_upper'), '.4f')}]"),
        ("cost per 1M SLO-passing output tokens [lower, upper]",
         f"[{_fmt(slo.get('cost_lower'), '.4g')}, {_fmt(slo.get('cost_upper'), '.4g')}]"),
        ("effective cost (retries) [lower, upper]",
         f"[{_fmt(slo.get('effective_cost_lower'), '.4g')}, {_fmt(slo.get('effective_cost_upper'), '.4g')}]"),
        ("prefill share (window / history)", " / ".join(_fmt((m.get("prefill_share") or {}).get(k), ".3f")
                                                        for k in ("window", "history"))),
        ("prefix-caching verdict", f"{_fmt(verdict.get('state'))}"
                                   + (" (provisional: history " + _fmt(verdict.get("history_seconds"), ".0f") + " s)"
                                      if verdict.get("provisional") else "")),
        ("KV capacity [tokens] / concurrency ceiling", f"{_fmt(m.get('kv_capacity_tokens'), '.0f')} / "
                                                      f"{_fmt(m.get('max_concurrency'))}"),
        ("peak KV per GPU (sizing) [bytes]", _fmt(m.get("kv_peak_bytes"), ".4g")),
        ("recommended max-num-seqs (fit)", f"{_fmt(m.get('recommended_max_num_seqs'))} ("
                                           + _fit_text(((m.get("fits") or {}).get("max_num_seqs") or {})) + ")"),
        ("first-order capacity bound Θ(h) now / target [prompt tokens/s]",
         " / ".join(_fmt((m.get("capacity_bound_tokens_per_second") or {}).get(k), ".4g") for k in ("current", "target"))),
        ("chip-time fit", _fit_text(((m.get("fits") or {}).get("chip_time") or {}))),
        ("valley (form)", f"{_fmt(m.get('valley_form'))}"),
    ]
    return rows


def _fit_text(fit: dict) -> str:
    status = fit.get("status")
    if status is None:
        return "—"
    return html.escape(status + (f": {fit['reason']}" if fit.get("reason") else ""))


PLOTS = (("bathtub", "Bathtub curve", plot_bathtub), ("ttft", "TTFT vs hit ratio", plot_ttft),
         ("tpm", "Delivered / physical TPM", plot_tpm), ("diagnostics", "Fit diagnostics", plot_diagnostics))
_SCRIPT = """<script>
window.addEventListener('load', function () {
  var imgs = Array.prototype.slice.call(document.images);
  var ok = imgs.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.body.setAttribute('data-images', ok + '/' + imgs.length);
});
</script>"""


STEM_MAX = 100  # characters of a model's name kept in its plots' file names


def _slug(name: str, used: set[str]) -> str:
    """A file-name stem for ``name``: never a dotfile, and unique within one report (names that
    reduce to the same stem, e.g. "tiny" and "tiny!", get a short hash of the name appended, as
    names cut to STEM_MAX characters do: a file name has at most 255 bytes)."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_").lstrip(".") or "model"
    if stem in used or len(stem) > STEM_MAX:
        stem = f"{stem[:STEM_MAX]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    used.add(stem)
    return stem


def render(data: ReportData, out_dir: Path) -> Path:
    """Write ``report.html`` and the PNGs into ``out_dir``; returns the HTML path. The PNGs of a
    report written there before (named in its ``report.html``) that this one does not write are
    removed once it is written: a plot of another source must not lie beside this report, and a
    report that fails half-way leaves the one before whole. Raises ReportError when no model was analysed
    (the message carries the analysis' engine reason, e.g. no successful scrape yet)."""
    plt = _pyplot()
    if not data.doc.get("models"):  # a page without a model would look like a report of nothing wrong
        if withdrawn(data.doc):
            raise ReportError(f"{data.source}: no current analysis ({withdrawn(data.doc)}): nothing to report")
        why = data.doc.get("engine_reason") or "fewer than two scrapes of one model"
        raise ReportError(f"{data.source}: no model analysed ({why}): nothing to report")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "report.html"
    old = set(re.findall(r"data-file='([\w.-]+\.png)'", path.read_text(encoding="utf-8", errors="replace"))
              if path.is_file() else ())
    written: set[str] = set()
    doc = data.doc
    parts = [f"<h1>kvhit capacity report</h1><p>source <code>{html.escape(data.source)}</code> · engine "
             f"<code>{html.escape(str(doc.get('engine')))}</code>"
             + (f" ({html.escape(doc['engine_reason'])})" if doc.get("engine_reason") else "")
             + f" · analysis at unix {_fmt(doc.get('timestamp'), '.0f')}</p>"]
    used: set[str] = set()
    for name, m in sorted(doc.get("models", {}).items()):
        slug = _slug(name, used)
        steps = data.steps.get(name, [])
        parts.append(f"<h2>model <code>{html.escape(name)}</code></h2><table>")
        parts += [f"<tr><th>{html.escape(k)}</th><td>{v}</td></tr>" for k, v in _summary_rows(m)]
        parts.append("</table>")
        if m.get("unknown"):
            parts.append("<details><summary>unknown signals and why</summary><ul>")
            parts += [f"<li><code>{html.escape(k)}</code>: {html.escape(v)}</li>" for k, v in sorted(m["unknown"].items())]
            parts.append("</ul></details>")
        for key, title, fn in PLOTS:
            png = fn(plt, m) if key == "bathtub" else fn(plt, m, steps)
            if png is None:
                if key == "bathtub":  # drawn from the published curves alone: say why there are none
                    why = "no bathtub published: " + (m.get("unknown") or {}).get(
                        "bathtub_chip_time", "no miss-slope or chip-time fit is ok yet")
                elif not steps:
                    why = "needs per-step observations: report on a recorded trace"
                else:
                    why = "not enough data for this plot yet"
                parts.append(f"<h3>{title}</h3><p class='na'>{why}.</p>")
                continue
            fname = f"{slug}-{key}.png"
            write_atomic(out_dir / fname, png)
            written.add(fname)
            b64 = base64.b64encode(png).decode()
            parts.append(f"<h3>{title}</h3><img alt='{html.escape(title)}' data-file='{fname}' "
                         f"src='data:image/png;base64,{b64}'>")
    page = ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvhit report</title><style>"
            "body{font-family:sans-serif;max-width:1000px;margin:1em auto;color:#222}"
            "table{border-collapse:collapse}th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;"
            "font-size:90%}th{background:#f4f4f4;font-weight:normal}img{max-width:100%;display:block}"
            ".na{color:#888}</style></head><body>" + "\n".join(parts) + _SCRIPT + "</body></html>")
    write_atomic(path, page)
    for fname in old - written:
        (out_dir / fname).unlink(missing_ok=True)
    return path
