"""prometheus-client custom collector: renders the current :class:`Analysis` and scrape health.

Every ``collect()`` builds fresh metric families from what the provider returns now, so nothing
can go stale inside the collector; a value that is unknown, or comes from a fit that is not ok,
is simply not yielded (MODEL.md §6). Names, HELP and labels come from :mod:`exporter.names`.

Sample of the exposition (one model, chip-time fit ok)::

    kvhit_up{target="http://localhost:8000/metrics"} 1.0
    kvhit_hit_ratio{model_name="tiny",source="all",target="http://localhost:8000/metrics"} 0.906
    kvhit_fit_status{fit="chip_time",model_name="tiny",status="ok",target="..."} 1.0
    kvhit_miss_slope{method="direct",model_name="tiny",target="..."} 0.94
    kvhit_predicted_ttft_seconds{hit_ratio="current",kind="service",model_name="tiny",target="..."} 0.03
    kvhit_valley_active{form="chip_time",model_name="tiny",target="..."} 1.0
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from exporter import __version__, names as N
from exporter.analyzer import CACHING_STATES, CHIP_TERMS, FIT_STATUSES, LABEL_REASON, Analysis, ModelAnalysis


@dataclass(frozen=True)
class Health:
    """Scrape health of the target (rendered as-is).

    up: last scrape succeeded and parsed; duration [s] of the last scrape; analysis_duration [s]
    the last successful scrape's parse, windows and fit step took; last_success [unix s] or None;
    errors: reason → count since start; quirks: input quirk → occurrences since start (the
    runner lists every kind the parser knows, from 0); untracked_series: (model_name, engine)
    series of the last scrape over ``max_series``; age: now − last_success [s] when rendered; stale: the values shown do
    not come from the latest scrape attempt (it failed, or none succeeded for an interval);
    scope: "fleet" in fleet mode, added as label ``scope`` to every series; "" adds nothing;
    clock_offset: kvhit's clock minus the wall clock when rendered [s] (SteadyClock: nonzero once
    the wall clock stepped), taken off last_success so that ``time() - kvhit_last_success_…`` is the
    data age in Prometheus.
    """

    target: str
    up: bool = False
    duration: float | None = None
    analysis_duration: float | None = None
    last_success: float | None = None
    errors: dict[str, int] = field(default_factory=dict)
    quirks: dict[str, int] = field(default_factory=dict)
    untracked_series: int = 0
    age: float | None = None
    stale: bool = False
    scope: str = ""
    clock_offset: float = 0.0


def _described(metrics) -> list[Metric]:
    """Empty families of ``metrics`` (exporter.names), what a registry maps names to collectors
    with: without them, /metrics?name[]=kvhit_up (a Prometheus scrape's params) served nothing."""
    return [(CounterMetricFamily if m.type == "counter" else GaugeMetricFamily)(m.name, m.help) for m in metrics]


class _Families:
    """One family per metric in :mod:`exporter.names`, filled lazily; ``constant`` labels (fleet
    mode's scope) are appended to every series."""

    def __init__(self, constant: dict[str, str]) -> None:
        self._f: dict[str, Metric] = {}
        self._constant = constant

    def add(self, m: N.Metric, labels: dict[str, str], value: float | None) -> None:
        if value is None or not math.isfinite(value):
            return  # unknown is absent, never NaN/Inf (MODEL.md §6)
        fam = self._f.get(m.name)
        if fam is None:
            cls = CounterMetricFamily if m.type == "counter" else GaugeMetricFamily
            fam = self._f[m.name] = cls(m.name, m.help, labels=[*m.labels, *self._constant])
        fam.add_metric([*(labels[k] for k in m.labels), *self._constant.values()], float(value))

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._f.values())


class ConfigErrorCollector(Collector):
    """What ``kvhit run --on-config-error=serve`` publishes after its configuration was refused
    (exporter/server.py ``config_error_app``): the version, with the ``target`` label the flags,
    environment or file give (redacted; "" when none does), and kvhit_config_last_load_successful 0."""

    def __init__(self, target: str = "") -> None:
        self.target = target

    def describe(self) -> list[Metric]:
        return _described((N.BUILD_INFO, N.CONFIG_LOADED))

    def collect(self) -> Iterator[Metric]:
        f = _Families({})
        f.add(N.BUILD_INFO, {"target": self.target, "version": __version__}, 1.0)
        f.add(N.CONFIG_LOADED, {}, 0.0)
        yield from f


class KvhitCollector(Collector):
    """Renders ``provider()`` → (Analysis, Health) on every collect."""

    def __init__(self, provider: Callable[[], tuple[Analysis, Health]]) -> None:
        self.provider = provider

    def describe(self) -> list[Metric]:
        return _described(N.ALL)  # no collect() at registration

    def collect(self) -> Iterator[Metric]:
        analysis, health = self.provider()
        f = _Families({"scope": health.scope} if health.scope else {})
        t = {"target": health.target}
        f.add(N.BUILD_INFO, {**t, "version": __version__}, 1.0)
        f.add(N.CONFIG_LOADED, {}, 1.0)
        f.add(N.UP, t, 1.0 if health.up else 0.0)
        f.add(N.SCRAPE_DURATION, t, health.duration)
        f.add(N.ANALYSIS_DURATION, t, health.analysis_duration)
        f.add(N.LAST_SUCCESS, t, None if health.last_success is None else health.last_success - health.clock_offset)
        f.add(N.DATA_AGE, t, health.age)
        f.add(N.STALE, t, 1.0 if health.stale else 0.0)
        # every known reason from 0 on, so rate() and increase() see the first one (quirks: Health)
        reasons = N.SCRAPE_ERROR_REASONS + (N.FLEET_ERROR_REASONS if health.scope == "fleet" else ())
        for reason in sorted({*reasons, *health.errors}):
            f.add(N.SCRAPE_ERRORS, {**t, "reason": reason}, health.errors.get(reason, 0))
        for quirk, n in sorted(health.quirks.items()):
            f.add(N.INPUT_QUIRKS, {**t, "quirk": quirk}, n)
        f.add(N.UNTRACKED_SERIES, t, health.untracked_series)
        f.add(N.ENGINE_INFO, {**t, "engine": analysis.engine, "reason": analysis.engine_reason}, 1.0)
        for model in analysis.models.values():
            _model(f, {"model_name": model.model_name, **t}, model, analysis.target_hit_ratio, analysis.slo_seconds)
        yield from f


def _model(f: _Families, base: dict[str, str], m: ModelAnalysis, target_h: float | None,
           slo: dict[str, float]) -> None:
    for signal, reason in sorted(m.unknown.items()):
        f.add(N.UNKNOWN_INFO, {**base, "signal": signal, "reason": LABEL_REASON(reason)}, 1.0)
    for warning, reason in sorted(m.warnings.items()):
        f.add(N.WARNING_INFO, {**base, "warning": warning, "reason": LABEL_REASON(reason)}, 1.0)
    f.add(N.WINDOW, base, m.window_seconds)
    for source, value in m.hit_ratio.items():
        f.add(N.HIT_RATIO, {**base, "source": source}, value)
    f.add(N.ISL, base, m.isl)
    f.add(N.OSL, base, m.osl)
    f.add(N.OBSERVED_TTFT, base, m.observed_ttft)
    for basis, tpm in (("observed", m.tpm_observed), ("target", m.tpm_target)):
        for (kind, per), value in tpm.items():
            f.add(N.TPM, {**base, "kind": kind, "basis": basis, "per": per}, value)
    f.add(N.KV_BYTES, base, m.kv_bytes_per_token)
    if m.load_bandwidth is not None:
        f.add(N.LOAD_BANDWIDTH, {**base, "source": m.load_bandwidth[1]}, m.load_bandwidth[0])

    for fit, res in m.fits.items():
        for status in FIT_STATUSES:
            f.add(N.FIT_STATUS, {**base, "fit": fit, "status": status}, 1.0 if res.status.value == status else 0.0)
        f.add(N.FIT_SAMPLES, {**base, "fit": fit}, res.samples)
        if res.ok:
            f.add(N.FIT_R2, {**base, "fit": fit}, res.r2)

    chip = m.fits["chip_time"]
    for term in CHIP_TERMS:
        f.add(N.CHIP_COEF, {**base, "term": term}, chip.value(term))
        if chip.value(term) is not None:
            f.add(N.CHIP_COEF_STDERR, {**base, "term": term}, chip.params[term].stderr)
        elif chip.ok and term in chip.params:  # an ok fit's term it cannot tell: kvhit_fit_status does not say why
            f.add(N.UNKNOWN_INFO, {**base, "signal": f"chip_time_coefficient_{term}",
                                   "reason": LABEL_REASON(chip.params[term].reason)}, 1.0)
    slope = m.fits["miss_slope"]
    direct = {k: slope.params[k] for k in ("tps0", "a")} if slope.ok else {}
    for method, est in (("direct", direct), ("derived", m.miss_slope_derived)):
        if "a" in est:
            f.add(N.TPS0, {**base, "method": method}, est["tps0"].value)
            f.add(N.MISS_SLOPE, {**base, "method": method}, est["a"].value)
            f.add(N.MISS_SLOPE_STDERR, {**base, "method": method}, est["a"].stderr)
    for bound, h in zip(("lower", "upper"), m.miss_slope_h_range or ()):
        f.add(N.MISS_SLOPE_RANGE, {**base, "bound": bound}, h)
    if slope.ok:
        for bound, end in (("lower", "lo"), ("upper", "hi")):
            f.add(N.MISS_SLOPE_BUCKET, {**base, "bound": bound}, slope.extra.get(f"isl_bucket_{end}"))
            f.add(N.MISS_SLOPE_OSL_BUCKET, {**base, "bound": bound}, slope.extra.get(f"osl_bucket_{end}"))
        f.add(N.MISS_SLOPE_ANOMALIES, base, m.anomalies)
    overlap = m.fits["overlap"]
    f.add(N.OVERLAP, base, overlap.value("alpha"))
    if overlap.value("alpha") is not None:
        f.add(N.OVERLAP_STDERR, base, overlap.params["alpha"].stderr)
    f.add(N.CONTENTION, base, m.contention)
    if m.fitted is not None and "fixed_time" not in m.unknown:
        f.add(N.FIXED_TIME, base, m.fitted.t_fixed)
        f.add(N.FIXED_TIME_STDERR, base, m.fitted.t_fixed_stderr)  # the full-load machine's, as T_fixed

    f.add(N.TARGET_HIT_RATIO, base, target_h)
    for name, seconds in sorted(slo.items()):
        f.add(N.SLO, {**base, "slo": name}, seconds)
    for which, p in m.predictions.items():
        f.add(N.PREDICTED_TTFT, {**base, "hit_ratio": which, "kind": "service"}, p.ttft_service)
        f.add(N.PREDICTED_TTFT_STDERR, {**base, "hit_ratio": which, "kind": "service"}, p.ttft_service_stderr)
        f.add(N.PREDICTED_TTFT, {**base, "hit_ratio": which, "kind": "load_aware"}, p.ttft_load_aware)
    now = m.predictions.get("current")
    if now is not None:
        for kind, per, value in (("delivered", "instance", now.tpm_delivered), ("physical", "instance", now.tpm_physical),
                                 ("delivered", "gpu", now.tpm_delivered_per_gpu), ("physical", "gpu", now.tpm_physical_per_gpu)):
            f.add(N.TPM, {**base, "kind": kind, "basis": "predicted", "per": per}, value)

    for form, b in m.bathtubs.items():
        fl = {**base, "form": form}
        f.add(N.REVENUE, fl, b.revenue_now)
        f.add(N.REVENUE_SLOPE, fl, b.slope_now)
        if b.slope_ci is not None:
            f.add(N.REVENUE_SLOPE_BOUND, {**fl, "bound": "lower"}, b.slope_ci[0])
            f.add(N.REVENUE_SLOPE_BOUND, {**fl, "bound": "upper"}, b.slope_ci[1])
        f.add(N.VALLEY_BOTTOM, fl, b.h_star)
        f.add(N.VALLEY_BOTTOM_STDERR, fl, b.h_star_stderr)
        f.add(N.VALLEY_BREAKEVEN, fl, b.h_even)
        f.add(N.VALLEY_BREAKEVEN_STDERR, fl, b.h_even_stderr)
        f.add(N.VALLEY_EXIT, fl, None if b.exit is None else float(b.exit))
        for h, r in b.curve:
            f.add(N.BATHTUB, {**fl, "hit_ratio": f"{h:.2f}"}, r)
    if m.valley_form is not None:
        f.add(N.VALLEY_ACTIVE, {**base, "form": m.valley_form}, float(m.bathtubs[m.valley_form].valley_active))
    _seed3(f, base, m)


def _seed3(f: _Families, base: dict[str, str], m: ModelAnalysis) -> None:
    """Seed 003 cost / caching / batch size, KV sizing and the first-order bound (MODEL.md §3.3, §3.6, §5)."""
    for quantity, seconds in m.p95.items():
        f.add(N.OBSERVED_P95, {**base, "quantity": quantity}, seconds)
    c = m.slo_cost
    if c is not None:
        src = {"tpot_source": m.tpot_source or ""}
        for bound, p, cost, eff in (("lower", c.pass_lower, c.cost_lower, c.effective_lower),
                                    ("upper", c.pass_upper, c.cost_upper, c.effective_upper)):
            f.add(N.SLO_PASS, {**base, "bound": bound, **src}, p)
            f.add(N.SLO_COST, {**base, "bound": bound, **src}, cost)
            f.add(N.EFFECTIVE_COST, {**base, "bound": bound, **src}, eff)
    for span, share in m.prefill_share.items():
        f.add(N.PREFILL_SHARE, {**base, "span": span}, share)
    for span, x in m.caching_speedup.items():
        f.add(N.CACHING_SPEEDUP, {**base, "span": span}, x)
    v = m.caching
    if v is not None:
        if v.state is not None:
            prov = "true" if v.provisional else "false"
            for state in CACHING_STATES:
                f.add(N.VERDICT, {**base, "state": state, "provisional": prov}, 1.0 if state == v.state else 0.0)
        f.add(N.HISTORY_SECONDS, base, v.history_seconds)
        f.add(N.HISTORY_HIT_RATIO, base, v.history_hit_ratio)
        f.add(N.HIT_JITTER, base, v.jitter)
    f.add(N.KV_CAPACITY, base, m.kv_capacity_tokens)
    f.add(N.MAX_CONCURRENCY, base, m.max_concurrency)
    f.add(N.KV_PEAK, base, m.kv_peak_bytes)
    f.add(N.MAX_NUM_SEQS, base, m.recommended_max_num_seqs)
    for which, theta in m.capacity_bound.items():
        f.add(N.CAPACITY_BOUND, {**base, "hit_ratio": which}, theta)
    f.add(N.LOAD_COMPUTE, base, m.load_compute_ratio)

