"""kvhit's Grafana dashboards as code (Grafana Foundation SDK), committed as JSON.

    python grafana/dashboards.py            # (re)write grafana/dashboards/*.json
    python grafana/dashboards.py --check    # exit 1 when the committed JSON differs

Two dashboards, both with the variables datasource, namespace, model_name (a single namespace and
model on kvhit-model) and pod (the pods serving the selected models):

- ``kvhit-model`` (kvhit / model): one model on selected pods — the token hit ratio with the
  valley band (0, h*) and h_even, the bathtub R(h) with the current operating point, R'(h) with its 95 %
  interval, predicted vs observed TTFT, Delivered vs Physical TPM, queue depth and KV usage, cost per
  1M SLO-passing output tokens, a and α with their error bands, fit status and quality, chip-time
  coefficients, sidecar health and the remaining model internals, and the firing kvhit alerts.
  The panels with bands (fillBelowTo) repeat once per selected pod: see ``band``.
- ``kvhit-fleet`` (kvhit / fleet): per model across pods, from the recording rules in
  ``rules/kvhit-recording.yml``.

Every panel sets a unit (custom units are Grafana's ``suffix:<text>``). Series are selected by the
labels a Kubernetes scrape adds (namespace, pod) plus vLLM's model_name; kvhit and its vLLM share the
pod. Expressions that combine kvhit series rely on both sides carrying the same scrape labels.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import barchart, stat, table, timeseries
from grafana_foundation_sdk.builders.common import (GraphThresholdsStyleConfig, ReduceDataOptions, VizLegendOptions,
                                                    VizTooltipOptions)
from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, QueryVariable, Row, ThresholdsConfig
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (BigValueColorMode, BigValueGraphMode,
                                                  GraphTresholdsStyleMode, LegendDisplayMode, LegendPlacement,
                                                  SortOrder, TableCellHeight, TooltipDisplayMode)
from grafana_foundation_sdk.models.dashboard import (DataSourceRef, DataTransformerConfig, DynamicConfigValue,
                                                     Threshold, ThresholdsMode, ValueMap, ValueMappingResult,
                                                     VariableOption, VariableRefresh, VariableSort)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

HERE = Path(__file__).resolve().parent
OUT = HERE / "dashboards"
sys.path.insert(0, str(HERE.parent))
from exporter.analyzer import BATHTUB_GRID  # noqa: E402  (the h grid of kvhit_bathtub_revenue_per_second)
from fitters.caching import THRASH_KV_USAGE  # noqa: E402  (the thrash verdict's KV usage, KvhitCacheThrash)

DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
# Label selectors: a model's series on the selected pods (kvhit and vLLM alike), kvhit's health series
# (no model_name), and the recording rules' per-model series (no pod). A fleet-mode kvhit is one more
# pod, in its own namespace (README "Fleet mode").
# kvhit-model's model is one value, which Grafana does not regex-escape: matched exactly (under =~,
# "Qwen2.5+ft" would match "Qwen2.5ft", not itself). Multi-value variables are escaped. (A name with
# a ' may match nothing: Grafana's escaping of a single-value variable puts a backslash before it.)
THE_MODEL = 'model_name="$model_name"'  # kvhit-model's one model
ANY_MODEL = 'model_name=~"$model_name"'  # kvhit-fleet's selected models
HEALTH = 'namespace=~"$namespace", pod=~"$pod"'
SEL = f"{HEALTH}, {THE_MODEL}"
VLLM_SERIES = "namespace_model_name:vllm_prefix_cache_hit_ratio:rate5m"  # a recording rule: vLLM's namespaces and models
MODEL = f'namespace=~"$namespace", {ANY_MODEL}'
ONE_MODEL = f'namespace=~"$namespace", {THE_MODEL}'  # MODEL on kvhit-model
RI = "$__rate_interval"
Z95 = 1.96  # two-sided 95 % normal quantile for the ±σ bands

# Units (Grafana unit ids; ``suffix:`` for the ones Grafana has no id for).
PRICE_S = "suffix: price/s"
SLOPE = "suffix: price/s per unit h"
TPM = "suffix: tokens/min"
TPS = "suffix: tokens/s"
TOKENS = "suffix: tokens"
REQUESTS = "suffix: requests"
PODS = "suffix: pods"
COST = "suffix: price/1M tokens"
SCRAPES = "suffix: errors/s"
SPEEDUP = "suffix: ×"


class Ids:
    """Stable panel ids in layout order."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> int:
        self.n += 1
        return self.n


def q(ref: str, expr: str, legend: str = "", *, instant: bool = False) -> Dataquery:
    """A Prometheus query; instant ones come back as a table (one row per series)."""
    d = Dataquery().ref_id(ref).expr(expr).datasource(DS)
    if legend:
        d = d.legend_format(legend)
    if instant:
        d = d.instant().format(PromQueryFormat.TABLE)
    return d


def now(ref: str, expr: str, legend: str = "") -> Dataquery:
    """The value now (an instant query, time series format): a stat shows what kvhit serves, and a
    series it withdrew is gone (a range query reduced to its last value showed it for hours)."""
    return q(ref, expr, legend).instant()


def prop(pid: str, value) -> DynamicConfigValue:
    return DynamicConfigValue(id_val=pid, value=value)


def thresholds(*steps: tuple[float | None, str]) -> ThresholdsConfig:
    return ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps([Threshold(value=v, color=c) for v, c in steps])


def ts(ids: Ids, title: str, unit: str, description: str, *, w: int = 12, h: int = 8) -> timeseries.Panel:
    return (timeseries.Panel().id(ids()).title(title).description(description).unit(unit).datasource(DS)
            .span(w).height(h).line_width(1).fill_opacity(0)
            .legend(VizLegendOptions().display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM)
                    .show_legend(True))
            .tooltip(VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.DESCENDING)))


# Table columns that only repeat the scrape: the target URL, and what a PodMonitor adds besides namespace
# and pod (instance stays: without Kubernetes labels it is the only one naming the pod)
HIDDEN_COLUMNS = {"Time": True, "job": True, "target": True, "container": True, "endpoint": True}


def table_panel(ids: Ids, title: str, unit: str, description: str, *, w: int = 12, h: int = 8) -> table.Panel:
    return (table.Panel().id(ids()).title(title).description(description).unit(unit).datasource(DS).span(w).height(h)
            .show_header(True).cell_height(TableCellHeight.SM))


def stat_panel(ids: Ids, title: str, unit: str, description: str, *, w: int = 12, h: int = 6) -> stat.Panel:
    return (stat.Panel().id(ids()).title(title).description(description).unit(unit).datasource(DS).span(w).height(h)
            .graph_mode(BigValueGraphMode.NONE).color_mode(BigValueColorMode.VALUE)
            .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False)))


def per_pod(panel):
    """One copy of the panel per selected pod (Grafana's panel repeat, stacked vertically), so that
    its queries' ``pod=~"$pod"`` selects one pod; the title says which."""
    return panel.repeat("pod").repeat_direction("v")


def band(panel, upper: str, lower: str, color: str):
    """Fill between two series (by display name): Grafana's fillBelowTo.

    fillBelowTo names one series by its display name, exactly (no pattern, no variables), so the
    names of the pair must be fixed and the pair unique in the panel. Two pods in one panel would
    give their series one name each and Grafana would join whichever it finds first; per-pod legends
    (``{{pod}}``) could not be named by a fixed fillBelowTo. So band panels are ``per_pod`` and the
    model dashboard shows one namespace (a pod name is unique only within its namespace); every other
    label of a band series is fixed by its query (tests/test_dashboards.py checks).
    """
    return (panel.override_by_name(upper, [prop("custom.fillBelowTo", lower), prop("custom.fillOpacity", 15),
                                           prop("color", {"mode": "fixed", "fixedColor": color}),
                                           prop("custom.lineStyle", {"fill": "dash", "dash": [4, 4]})])
            .override_by_name(lower, [prop("color", {"mode": "fixed", "fixedColor": color}),
                                      prop("custom.lineStyle", {"fill": "dash", "dash": [4, 4]})]))


# --- variables ---------------------------------------------------------------------------------


def variables(one_model: bool = False) -> list:
    """datasource, namespace, model_name (a single namespace and model when ``one_model``: the
    bathtub of two models averaged is no model's, and a pod is named uniquely only in its namespace),
    and the pods serving the selected models."""
    model = THE_MODEL if one_model else ANY_MODEL

    def label_var(name: str, label: str, query: str, multi: bool = True, regex: str = "") -> QueryVariable:
        v = (QueryVariable(name).label(label).datasource(DS).query(query).refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
             .sort(VariableSort.ALPHABETICAL_ASC).regex(regex))
        if not multi:  # Grafana selects the first value
            return v.multi(False).include_all(False)
        return (v.multi(True).include_all(True).all_value(".*")
                .current(VariableOption(selected=True, text=["All"], value=["$__all"])))

    out = [
        DatasourceVariable("datasource").label("Data source").type("prometheus"),
        # kvhit's namespaces (build_info: every kvhit, a refused config too) and vLLM's (a fleet kvhit
        # lives in its own: its vLLM's namespace could not be picked)
        label_var("namespace", "Namespace", f'label_values({{__name__=~"kvhit_build_info|{VLLM_SERIES}"}}, namespace)',
                  multi=not one_model),
        label_var("model_name", "Model", f'label_values({{__name__=~"kvhit_window_seconds|{VLLM_SERIES}", '
                  'namespace=~"$namespace"}, model_name)', multi=not one_model),
        # the pods analysing the selected models, and the kvhit pods analysing none (a target down or
        # never up, a config refused): the health panels the runbooks point to. By namespace too: a
        # StatefulSet's vllm-0 in two namespaces is two pods
        label_var("pod", "Pod" if one_model else "Pod (Pods in the valley)",
                  'query_result(max by (namespace, pod) (kvhit_window_seconds{namespace=~"$namespace", '
                  f'{model}}}) or (max by (namespace, pod) (kvhit_build_info{{namespace=~"$namespace"}}) '
                  'unless on (namespace, pod) max by (namespace, pod) (kvhit_window_seconds{namespace=~"$namespace"})))',
                  regex='/pod="([^"]+)"/'),
    ]
    return out


# --- kvhit / model -----------------------------------------------------------------------------


def operating_point() -> str:
    """R at the bathtub grid point nearest the current h (one bar of the curve), in PromQL.

    Each grid point h_i owns [midpoint to h_{i-1}, midpoint to h_{i+1}); the current h
    (kvhit_hit_ratio{source="all"}) selects the curve sample of its bin. The grid is kvhit's own.
    """
    grid = list(BATHTUB_GRID)
    terms = []
    for i, g in enumerate(grid):
        lo = 0.0 if i == 0 else (grid[i - 1] + g) / 2
        hi = 1.0 if i == len(grid) - 1 else (g + grid[i + 1]) / 2
        upper = f"<= {hi:g}" if i == len(grid) - 1 else f"< {hi:g}"
        terms.append(
            f'(kvhit_bathtub_revenue_per_second{{hit_ratio="{g:.2f}", {SEL}}} and ignoring(hit_ratio) kvhit_valley_active{{{SEL}}})'
            f' and ignoring(form, hit_ratio, source) (kvhit_hit_ratio{{source="all", {SEL}}} >= {lo:g} {upper})')
    return _union("avg by (hit_ratio)", terms)


def _union(aggregation: str, terms: list[str]) -> str:
    """PromQL: ``aggregation`` over the union (``or``) of ``terms``, one per line."""
    return f"{aggregation} (\n  " + "\n  or\n  ".join(terms) + "\n)"


def curve_start() -> str:
    """The lowest h of the published bathtub curve per form, in PromQL: 0 when R(0) is published; a
    curve published only where its fit speaks (the chip-time one near the current h in agentic
    traffic, the linear one over the miss slope's h range) starts at its first grid point."""
    terms = [f'kvhit_bathtub_revenue_per_second{{hit_ratio="{g:.2f}", {SEL}}} * 0 + {g:g}' for g in BATHTUB_GRID]
    return _union("min without (hit_ratio)", terms)


def valley_start(valley: str) -> str:
    """The valley band's lower edge, in PromQL, where ``valley`` (h* of the form the alert follows)
    is: the curve's start, or the current h when below it (R'(h_now) < 0 is known while the valley
    is active, so h_now < h*; the grid's rounding up of where the fit speaks could put the curve's
    start past h*, and the band on the wrong side of it)."""
    start = f"({curve_start()})\nand\n({valley})"
    now = f'kvhit_hit_ratio{{source="all", {SEL}}}'
    return f"({start})\n<= ignoring(form, source)\n{now}\nor ignoring(form, source)\n({now} and ignoring(form, source) ({start}))"


def model_dashboard() -> Dashboard:
    ids = Ids()
    d = (Dashboard("kvhit / model").uid("kvhit-model")
         .description("One model on selected pods: kvhit's hit-ratio economics (MODEL.md §4), latency and "
                      "throughput predictions, fits, and the sidecar's health. Generated by grafana/dashboards.py.")
         .tags(["kvhit", "vllm"]).refresh("30s").time("now-3h", "now").timezone("browser").editable()
         .variables(variables(one_model=True)))

    # --- economics -------------------------------------------------------------------------------
    d = d.with_row(Row("Economics: hit ratio and the bathtub (MODEL.md §4)").id(ids()))
    valley = f"kvhit_valley_bottom_hit_ratio{{{SEL}}} and kvhit_valley_active{{{SEL}}}"
    hit = (ts(ids, "Token hit ratio and the valley band ($pod)", "percentunit",
              "Token-level prefix-cache hit ratio h over kvhit's publish window (this pod) and over 5 min from "
              "vLLM's counters (the model, all pods). The band is where more hits earn less, in the form the valley "
              "alert follows: from the bathtub curve's first h (0, or where a curve published only where its fit "
              "speaks starts, or the current h when below that) to the valley bottom h*, where R'(h) < 0 "
              "(KvhitValley fires while h, above 0, sits "
              "in it and the 95 % interval of R'(h) is below 0). Past h* R(h) climbs again and reaches R(0) at "
              "h_even (dashed; 1 when the valley has no exit): h in (0, h_even) earns less than no caching. In the "
              "linear form an h* beyond the h range the miss slope was fitted on is withheld (kvhit_unknown_info "
              "says why): then no band, while the alert may fire (an h_even beyond it: no dashed line). One panel "
              "per selected pod.")
           .min(0).max(1)
           .with_target(q("A", f'kvhit_hit_ratio{{source="all", {SEL}}}', "h {{pod}}"))
           .with_target(q("B", valley, "valley bottom h*"))
           .with_target(q("E", valley_start(valley), "valley start"))
           .with_target(q("C", f"(kvhit_valley_breakeven_hit_ratio{{{SEL}}} or (kvhit_valley_exit{{{SEL}}} == 0) * 0 + 1)"
                               f" and kvhit_valley_active{{{SEL}}}", "break-even h_even"))
           .with_target(q("D", f"namespace_model_name:vllm_prefix_cache_hit_ratio:rate5m{{{ONE_MODEL}}}",
                          "h of {{model_name}}, vLLM counters (5m)"))
           .override_by_name("break-even h_even", [prop("color", {"mode": "fixed", "fixedColor": "orange"}),
                                                   prop("custom.lineStyle", {"fill": "dash", "dash": [4, 4]})]))
    d = d.with_panel(per_pod(band(hit, "valley bottom h*", "valley start", "red")))

    d = d.with_panel(per_pod(
        barchart.Panel().id(ids()).title("Bathtub R(h) and the current operating point ($pod)")
        .description("kvhit_bathtub_revenue_per_second: revenue per machine-second R(h) at kvhit's fixed h grid, "
                     "in the form the valley alert follows. One panel per selected pod: pods' curves (and "
                     "forms) are never averaged. The orange bar is the grid point nearest the current h (none when the curve has no point there).")
        .unit(PRICE_S).datasource(DS).span(12).height(8).x_field("hit_ratio")
        .legend(VizLegendOptions().display_mode(LegendDisplayMode.LIST).placement(LegendPlacement.BOTTOM).show_legend(True))
        .tooltip(VizTooltipOptions().mode(TooltipDisplayMode.MULTI).sort(SortOrder.NONE))
        .with_target(q("A", f"avg by (hit_ratio) (kvhit_bathtub_revenue_per_second{{{SEL}}}"
                            f" and ignoring(hit_ratio) kvhit_valley_active{{{SEL}}})", instant=True))
        .with_target(q("B", operating_point(), instant=True))
        .with_transformation(DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(DataTransformerConfig(id_val="organize", options={
            "excludeByName": {"Time": True}, "renameByName": {"Value #A": "R(h)", "Value #B": "current h"}}))
        .with_transformation(DataTransformerConfig(id_val="sortBy", options={"sort": [{"field": "hit_ratio"}]}))
        .override_by_name("R(h)", [prop("color", {"mode": "fixed", "fixedColor": "blue"})])
        .override_by_name("current h", [prop("color", {"mode": "fixed", "fixedColor": "orange"})])))

    slope = (ts(ids, "Revenue slope R'(h) with its 95 % interval ($pod)", SLOPE,
                "dR/dh at the current hit ratio per form; below 0 more hits earn less. The valley alert needs "
                "the whole 95 % interval below 0. One panel per selected pod.")
             .thresholds_style(GraphThresholdsStyleConfig().mode(GraphTresholdsStyleMode.LINE))
             .thresholds(thresholds((None, "red"), (0, "green")))
             .with_target(q("A", f"kvhit_revenue_slope{{{SEL}}}", "R'(h) {{form}} {{pod}}"))
             .with_target(q("B", f'kvhit_revenue_slope_bound{{bound="lower", form="chip_time", {SEL}}}', "chip_time lower"))
             .with_target(q("C", f'kvhit_revenue_slope_bound{{bound="upper", form="chip_time", {SEL}}}', "chip_time upper"))
             .with_target(q("D", f'kvhit_revenue_slope_bound{{bound="lower", form="linear", {SEL}}}', "linear lower"))
             .with_target(q("E", f'kvhit_revenue_slope_bound{{bound="upper", form="linear", {SEL}}}', "linear upper")))
    slope = per_pod(band(band(slope, "chip_time upper", "chip_time lower", "purple"), "linear upper", "linear lower",
                         "blue"))
    d = d.with_panel(slope)

    d = d.with_panel(
        ts(ids, "Revenue per machine-second R(h) vs the zero-hit baseline R(0)", PRICE_S,
           "R at the current hit ratio per form, against R(0) of the same form (the hit_ratio=0.00 point of the "
           "curve). R(h) < R(0) with h > 0 is KvhitRevenueBelowZeroHitBaseline.")
        .with_target(q("A", f"kvhit_revenue_per_second{{{SEL}}}", "R(h) {{form}} {{pod}}"))
        .with_target(q("B", f'kvhit_bathtub_revenue_per_second{{hit_ratio="0.00", {SEL}}}', "R(0) {{form}} {{pod}}")))

    d = d.with_panel(
        ts(ids, "Valley edges and their standard errors", "percentunit",
           "The valley bottom h* and break-even h_even per form and their standard errors (the delta method from the fit's "
           "covariance, through R'(h*) = 0 and R(h_even) = R(0)): an edge is an estimate, h* ± 2σ is where the "
           "bottom may be. Absent with its edge (kvhit_unknown_info says why); σ(h*) also when h* sits at the h "
           "grid's end, where R still falls.")
        .min(0)
        .with_target(q("A", f"kvhit_valley_bottom_hit_ratio{{{SEL}}}", "h* {{form}} {{pod}}"))
        .with_target(q("B", f"kvhit_valley_bottom_hit_ratio_stderr{{{SEL}}}", "σ(h*) {{form}} {{pod}}"))
        .with_target(q("D", f"kvhit_valley_breakeven_hit_ratio{{{SEL}}}", "h_even {{form}} {{pod}}"))
        .with_target(q("C", f"kvhit_valley_breakeven_hit_ratio_stderr{{{SEL}}}", "σ(h_even) {{form}} {{pod}}")))

    d = d.with_panel(
        stat_panel(ids, "Valley", "none",
                   "kvhit_valley_active of the form the alert follows; kvhit_valley_exit: whether R(h) climbs back "
                   "to R(0) before h = 1.", w=12, h=8)
        .mappings([ValueMap(options={"0": ValueMappingResult(text="no", color="green", index=0),
                                     "1": ValueMappingResult(text="ACTIVE", color="red", index=1)})])
        .with_target(now("A", f"kvhit_valley_active{{{SEL}}}", "valley {{form}} {{pod}}"))
        .with_target(now("B", f"kvhit_valley_exit{{{SEL}}}", "exit {{form}} {{pod}}"))
        .override_by_query("B", [prop("mappings", [{"type": "value", "options": {
            "0": {"text": "no exit", "color": "red", "index": 0}, "1": {"text": "exits", "color": "green", "index": 1}}}])]))
    # the caveats kvhit publishes beside these values (a no-exit read beyond the h the fit saw was
    # shown as fact: an SRE review's find)
    d = d.with_panel(
        table_panel(ids, "Caveats on these values", "none",
                    "kvhit_warning_info: what to keep in mind reading this model's values now (bathtub_extrapolated: "
                    "the chip-time bathtub's h*, h_even or no-exit read beyond the h its fit's steps saw; "
                    "load_aware_off, kv_load_bound, counter_reset, data_parallel, ...), with the reason. Empty: none.",
                    w=12, h=8)
        .with_target(q("A", f"kvhit_warning_info{{{SEL}}}", instant=True))
        .with_transformation(DataTransformerConfig(id_val="organize", options={
            "excludeByName": {**HIDDEN_COLUMNS, "Value": True, "__name__": True, "instance": True},
            "indexByName": {"namespace": 0, "pod": 1, "model_name": 2, "warning": 3, "reason": 4}})))

    # --- latency and throughput -----------------------------------------------------------------
    d = d.with_row(Row("Latency and throughput (MODEL.md §3, §7)").id(ids()))
    d = d.with_panel(
        ts(ids, "TTFT: predicted vs observed", "s",
           "kvhit's predicted TTFT (service = unloaded chip time, load_aware = with queueing and contention) at the "
           "current and target hit ratio, with the service TTFT's standard error from the chip-time fit, against the "
           "observed mean TTFT (kvhit's window and vLLM's histogram) and the configured TTFT SLO.")
        .with_target(q("A", f"kvhit_predicted_ttft_seconds{{{SEL}}}", "predicted {{kind}} at {{hit_ratio}} h {{pod}}"))
        .with_target(q("E", f"kvhit_predicted_ttft_stderr_seconds{{{SEL}}}",
                       "stderr of predicted {{kind}} at {{hit_ratio}} h {{pod}}"))
        .with_target(q("B", f"kvhit_observed_ttft_seconds{{{SEL}}}", "observed mean, kvhit window {{pod}}"))
        .with_target(q("C", f"sum by (pod) (rate(vllm:time_to_first_token_seconds_sum{{{SEL}}}[{RI}]))"
                            f" / (sum by (pod) (rate(vllm:time_to_first_token_seconds_count{{{SEL}}}[{RI}])) > 0)",
                       "observed mean, vLLM {{pod}}"))
        .with_target(q("D", f'kvhit_slo_seconds{{slo="ttft", {SEL}}}', "TTFT SLO {{pod}}"))
        .override_by_regexp("^TTFT SLO", [prop("color", {"mode": "fixed", "fixedColor": "red"}),
                                       prop("custom.lineStyle", {"fill": "dash", "dash": [10, 10]})]))
    d = d.with_panel(
        ts(ids, "Delivered vs physical TPM", TPM,
           "Delivered TPM counts cached input, physical TPM only computed tokens (MODEL.md §3.4); observed from "
           "counters over kvhit's window, predicted = capacity from the chip-time model at the current h, "
           "target = the observed TPM carried to the configured target_hit_ratio (MODEL.md §3.5: a what-if, "
           "not a goal).")
        .with_target(q("A", f'kvhit_tpm_tokens_per_minute{{per="instance", {SEL}}}', "{{kind}} {{basis}} {{pod}}"))
        .with_target(q("B", f'kvhit_tpm_tokens_per_minute{{per="gpu", {SEL}}}', "{{kind}} {{basis}} per GPU {{pod}}")))
    d = d.with_panel(
        ts(ids, "Queue depth", REQUESTS,
           "vLLM's requests waiting for capacity, running, and deferred (vLLM 0.20+: waiting on something other "
           "than a batch slot, which num_requests_waiting also counts) per pod, summed over engines.")
        .with_target(q("A", f'sum by (pod) (max without (pid, reason) (vllm:num_requests_waiting_by_reason{{reason="capacity", {SEL}}}) '
                            f"or max without (pid) (vllm:num_requests_waiting{{{SEL}}}))", "waiting {{pod}}"))
        .with_target(q("B", f"sum by (pod) (max without (pid) (vllm:num_requests_running{{{SEL}}}))", "running {{pod}}"))
        .with_target(q("C", f'sum by (pod) (max without (pid) (vllm:num_requests_waiting_by_reason{{reason="deferred", {SEL}}}))',
                       "deferred {{pod}}")))
    d = d.with_panel(
        ts(ids, "KV cache usage", "percentunit",
           f"vLLM's KV-cache usage per pod (max over engines); at {THRASH_KV_USAGE:.0%} or above with a jittering "
           "hit ratio the cache thrashes (KvhitCacheThrash).")
        .min(0).max(1).thresholds_style(GraphThresholdsStyleConfig().mode(GraphTresholdsStyleMode.LINE))
        .thresholds(thresholds((None, "green"), (THRASH_KV_USAGE, "red")))
        .with_target(q("A", f"max by (pod) (vllm:kv_cache_usage_perc{{{SEL}}})", "KV usage {{pod}}")))
    # --- seed 003 ----------------------------------------------------------------------------------
    d = d.with_row(Row("SLO cost, caching economics and sizing (MODEL.md §5, §3.3, §3.6)").id(ids()))
    d = d.with_panel(
        ts(ids, "Cost per 1M SLO-passing output tokens", COST,
           "Seed 003: instance_hour_price x 1e6 / (SLO-passing output tokens/s x 3600) over kvhit's window (fleet "
           "mode: the price x the pods whose tokens the sum holds, time-averaged over the window), from "
           "the pass-rate bounds of vLLM's marginal TTFT and TPOT histograms (the lower cost uses the upper pass "
           "bound); effective = divided by (1 - retry_rate). Where available: kvhit needs instance_hour_price "
           "and both SLOs configured, and a bound is absent while its pass bound is 0.")
        .with_target(q("A", f"kvhit_cost_per_million_slo_output_tokens{{{SEL}}}",
                       "cost, {{bound}} bound ({{tpot_source}} TPOT) {{pod}}"))
        .with_target(q("B", f"kvhit_effective_cost_per_million_slo_output_tokens{{{SEL}}}",
                       "effective cost, {{bound}} bound ({{tpot_source}} TPOT) {{pod}}")))
    d = d.with_panel(
        ts(ids, "SLO pass ratio bounds", "percentunit",
           "Share of requests meeting both the TTFT and the TPOT SLO: lower = max(0, p_ttft + p_tpot - 1), "
           "upper = min(p_ttft, p_tpot) from the marginal histograms.")
        .min(0).max(1)
        .with_target(q("A", f"kvhit_slo_pass_ratio{{{SEL}}}", "{{bound}} ({{tpot_source}} TPOT) {{pod}}")))
    d = d.with_panel(
        ts(ids, "Latency P95 vs SLO", "s",
           "P95 over kvhit's window from histogram bucket deltas: TTFT, per-request TPOT (vLLM 0.11+) and "
           "inter-token latency, against the configured SLOs.")
        .with_target(q("A", f"kvhit_observed_p95_seconds{{{SEL}}}", "P95 {{quantity}} {{pod}}"))
        .with_target(q("B", f"kvhit_slo_seconds{{{SEL}}}", "{{slo}} SLO {{pod}}"))
        .override_by_regexp("^[a-z]+ SLO", [prop("custom.lineStyle", {"fill": "dash", "dash": [10, 10]})]))
    d = d.with_panel(
        table_panel(ids, "Prefix-caching verdict", "none",
                    "Seed 003's verdict: not_paying (h < 0.25 over the history), linear, dedicated_pool_worth_it "
                    "(h > 0.60 and prefill share > 0.40), diminishing_returns (h > 0.85), thrash_risk; provisional "
                    "until the history covers 24 h.")
        .with_target(q("A", f"kvhit_prefix_cache_verdict{{{SEL}}} == 1", instant=True))
        .with_transformation(DataTransformerConfig(id_val="organize", options={
            "excludeByName": {**HIDDEN_COLUMNS, "Value": True, "__name__": True},
            "indexByName": {"namespace": 0, "pod": 1, "model_name": 2, "state": 3, "provisional": 4}})))
    d = d.with_panel(
        ts(ids, "Caching economics", "percentunit",
           "The verdict's inputs: hit ratio over its history (up to 24 h), per-minute hit-ratio jitter over "
           "15 min (thrash signal), prefill share P/(P+D) and the speedup 1/(1 - h x prefill share) over the "
           "window and the history; the history's length on the right axis.")
        .with_target(q("A", f"kvhit_prefix_cache_history_hit_ratio{{{SEL}}}", "h over the history {{pod}}"))
        .with_target(q("B", f"kvhit_hit_ratio_jitter{{{SEL}}}", "h jitter (15 min) {{pod}}"))
        .with_target(q("C", f"kvhit_prefill_share_ratio{{{SEL}}}", "prefill share ({{span}}) {{pod}}"))
        .with_target(q("D", f"kvhit_prefix_cache_speedup{{{SEL}}}", "speedup ({{span}}) {{pod}}"))
        .with_target(q("E", f"kvhit_prefix_cache_history_seconds{{{SEL}}}", "history length {{pod}}"))
        .override_by_query("D", [prop("unit", SPEEDUP), prop("custom.axisPlacement", "right")])
        .override_by_query("E", [prop("unit", "s"), prop("custom.axisPlacement", "right")]))
    d = d.with_panel(
        stat_panel(ids, "Capacity and sizing", "none",
                   "KV capacity per engine and the concurrency it holds at the window's ISL+OSL, peak KV per GPU "
                   "for the configured sizing, the economic max-num-seqs (TPOT P95 at 80 % of the TPOT SLO), the "
                   "first-order capacity bound at the current and target h, and δ (KV load vs compute).", w=12, h=8)
        .with_target(now("A", f"kvhit_kv_capacity_tokens{{{SEL}}}", "KV capacity {{pod}}"))
        .with_target(now("B", f"kvhit_max_concurrency{{{SEL}}}", "max concurrency {{pod}}"))
        .with_target(now("C", f"kvhit_kv_peak_bytes{{{SEL}}}", "peak KV per GPU {{pod}}"))
        .with_target(now("D", f"kvhit_recommended_max_num_seqs{{{SEL}}}", "recommended max-num-seqs {{pod}}"))
        .with_target(now("E", f"kvhit_capacity_bound_tokens_per_second{{{SEL}}}", "capacity bound at {{hit_ratio}} h {{pod}}"))
        .with_target(now("F", f"kvhit_load_compute_ratio{{{SEL}}}", "δ load/compute {{pod}}"))
        .override_by_query("A", [prop("unit", TOKENS)])
        .override_by_query("B", [prop("unit", REQUESTS)])
        .override_by_query("C", [prop("unit", "bytes")])
        .override_by_query("D", [prop("unit", REQUESTS)])
        .override_by_query("E", [prop("unit", TPS)]))

    # --- fits ---------------------------------------------------------------------------------------
    d = d.with_row(Row("Fits (MODEL.md §4, §6, §7)").id(ids()))
    ab = (ts(ids, "Miss slope a and overlap α with 95 % bands ($pod)", "none",
             "a of TPS_miss(h) = TPS0(1 - a h), direct and derived (never averaged), and the overlap α, each with "
             "±1.96 standard errors. Both a are secants over the h range the busy steps spanned (Model internals: "
             "a's h range): the bands cover the noise, not h outside it. α is absent (not identifiable) without "
             "hits loaded from host memory. One panel per selected pod.")
          .with_target(q("A", f"kvhit_miss_slope{{{SEL}}}", "a {{method}}"))
          .with_target(q("B", f'kvhit_miss_slope{{method="direct", {SEL}}} - {Z95} * kvhit_miss_slope_stderr{{method="direct", {SEL}}}', "a direct -1.96σ"))
          .with_target(q("C", f'kvhit_miss_slope{{method="direct", {SEL}}} + {Z95} * kvhit_miss_slope_stderr{{method="direct", {SEL}}}', "a direct +1.96σ"))
          .with_target(q("D", f'kvhit_miss_slope{{method="derived", {SEL}}} - {Z95} * kvhit_miss_slope_stderr{{method="derived", {SEL}}}', "a derived -1.96σ"))
          .with_target(q("E", f'kvhit_miss_slope{{method="derived", {SEL}}} + {Z95} * kvhit_miss_slope_stderr{{method="derived", {SEL}}}', "a derived +1.96σ"))
          .with_target(q("F", f"kvhit_overlap_ratio{{{SEL}}}", "α"))
          # α is bounded to [0, 1] (MODEL.md §1): so is its band (at a bound, 1 ± 0.1 read as α up to 1.1)
          .with_target(q("G", f"clamp(kvhit_overlap_ratio{{{SEL}}} - {Z95} * kvhit_overlap_ratio_stderr{{{SEL}}}, 0, 1)", "α -1.96σ"))
          .with_target(q("H", f"clamp(kvhit_overlap_ratio{{{SEL}}} + {Z95} * kvhit_overlap_ratio_stderr{{{SEL}}}, 0, 1)", "α +1.96σ")))
    ab = per_pod(band(band(band(ab, "a direct +1.96σ", "a direct -1.96σ", "blue"), "a derived +1.96σ",
                           "a derived -1.96σ", "purple"), "α +1.96σ", "α -1.96σ", "orange"))
    d = d.with_panel(ab)
    d = d.with_panel(
        table_panel(ids, "Fit status", "none",
                    "The current status of each fit (ok, insufficient_data, insufficient_variation, not_identifiable); "
                    "values of a fit that is not ok are absent. KvhitFitNotOk fires after an hour for a model with "
                    "traffic, but never for max_num_seqs, nor for overlap while not_identifiable (no loaded hits); "
                    "overlap and load_aware only once chip_time is ok, miss_slope only while the chip-time bathtub "
                    "is not published.")
        .with_target(q("A", f"kvhit_fit_status{{{SEL}}} == 1", instant=True))
        .with_transformation(DataTransformerConfig(id_val="organize", options={
            "excludeByName": {**HIDDEN_COLUMNS, "Value": True, "__name__": True},
            "indexByName": {"namespace": 0, "pod": 1, "model_name": 2, "fit": 3, "status": 4}})))
    d = d.with_panel(
        ts(ids, "Fit quality", "none", "R² of each fit (chip_time uncentred) and the observations (steps) it used.")
        .with_target(q("A", f"kvhit_fit_r2{{{SEL}}}", "R² {{fit}} {{pod}}"))
        .with_target(q("B", f"kvhit_fit_samples{{{SEL}}}", "samples {{fit}} {{pod}}"))
        .override_by_query("B", [prop("unit", "suffix: steps"), prop("custom.axisPlacement", "right")]))
    d = d.with_panel(
        table_panel(ids, "Chip-time coefficients", "s",
                    "Robust NNLS on busy steps (MODEL.md §7), seconds per unit of each term, with standard errors.")
        # max without (): the same labels less __name__, which Grafana's merge would join rows on
        .with_target(q("A", f"max without () (kvhit_chip_time_coefficient_seconds{{{SEL}}})", instant=True))
        .with_target(q("B", f"max without () (kvhit_chip_time_coefficient_stderr_seconds{{{SEL}}})", instant=True))
        .with_transformation(DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(DataTransformerConfig(id_val="organize", options={
            "excludeByName": HIDDEN_COLUMNS,
            "renameByName": {"Value #A": "coefficient", "Value #B": "stderr"}})))
    d = d.with_panel(
        ts(ids, "Miss throughput TPS0", TPS, "TPS0 of TPS_miss(h) = TPS0(1 - a h), direct and derived (MODEL.md §4).")
        .with_target(q("A", f"kvhit_miss_tps0_tokens_per_second{{{SEL}}}", "TPS0 {{method}} {{pod}}")))

    # --- alerts -------------------------------------------------------------------------------------
    d = d.with_row(Row("Alerts").id(ids()))
    d = d.with_panel(firing_alerts(ids, one_model=True))

    # --- sidecar and internals ------------------------------------------------------------------------
    d = d.with_row(Row("Sidecar health and model internals").id(ids()))
    d = d.with_panel(
        ts(ids, "Sidecar health", "s",
           "kvhit's scrape of vLLM: age of the last successful scrape (kvhit's data age), duration of the "
           "last one and the time kvhit took to analyse the last successful one (parse, windows, fits: near "
           "the interval, kvhit falls behind); kvhit_up (right axis) is 0 while the target is down "
           "(KvhitTargetDown) or kvhit cannot analyse what it answers (KvhitAnalysisFailing), kvhit_stale 1 while the values shown are not from the latest attempt, "
           "kvhit_config_last_load_successful 0 while its configuration is refused (KvhitConfigInvalid: it analyses "
           "nothing).")
        .with_target(q("B", f"kvhit_scrape_duration_seconds{{{HEALTH}}}", "scrape duration {{pod}}"))
        .with_target(q("C", f"kvhit_up{{{HEALTH}}}", "up {{pod}}"))
        .with_target(q("D", f"kvhit_data_age_seconds{{{HEALTH}}}", "data age {{pod}}"))
        .with_target(q("E", f"kvhit_stale{{{HEALTH}}}", "stale {{pod}}"))
        .with_target(q("F", f"kvhit_analysis_duration_seconds{{{HEALTH}}}", "analysis duration {{pod}}"))
        .with_target(q("G", f"kvhit_config_last_load_successful{{{HEALTH}}}", "config loaded {{pod}}"))
        .override_by_query("C", [prop("unit", "none"), prop("custom.axisPlacement", "right"), prop("min", 0),
                                 prop("max", 1)])
        .override_by_query("E", [prop("unit", "none"), prop("custom.axisPlacement", "right"), prop("min", 0),
                                 prop("max", 1)])
        .override_by_query("G", [prop("unit", "none"), prop("custom.axisPlacement", "right"), prop("min", 0),
                                 prop("max", 1)]))
    d = d.with_panel(
        ts(ids, "Scrape errors", SCRAPES, "Failed scrapes of vLLM per second by reason (refused, timeout, http_<code>, ...).")
        .with_target(q("A", f"sum by (pod, reason) (rate(kvhit_scrape_errors_total{{{HEALTH}}}[{RI}]))", "{{reason}} {{pod}}")))
    d = d.with_panel(
        ts(ids, "Input quirks and untracked series", "suffix: lines/s",
           "Lines or series of vLLM's exposition kvhit handled as a quirk (truncated, malformed, non-UTF-8, ...), "
           "per second by quirk; (model_name, engine) series left unanalysed at max_series (right axis).")
        .with_target(q("A", f"sum by (pod, quirk) (rate(kvhit_input_quirks_total{{{HEALTH}}}[{RI}]))", "{{quirk}} {{pod}}"))
        .with_target(q("B", f"kvhit_untracked_series{{{HEALTH}}}", "untracked series {{pod}}"))
        .override_by_query("B", [prop("unit", "suffix: series"), prop("custom.axisPlacement", "right")]))
    d = d.with_panel(
        table_panel(ids, "Engine and unknown signals", "none",
                    "The engine kvhit detected (and why it is unsupported, if it is) and every signal kvhit cannot know, "
                    "with the reason; those signals' own series are absent.", w=12)
        .with_target(q("A", f"kvhit_engine_info{{{HEALTH}}}", instant=True))
        .with_target(q("B", f"kvhit_unknown_info{{{SEL}}}", instant=True))
        .with_transformation(DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(DataTransformerConfig(id_val="organize", options={
            "excludeByName": {"Time": True, "Value #A": True, "Value #B": True, "__name__": True, "job": True}})))
    d = d.with_panel(
        ts(ids, "Window and request shape", TOKENS,
           "Mean prompt (ISL) and output (OSL) length of requests finished in kvhit's publish window, and the "
           "window's length (right axis).")
        .with_target(q("A", f"kvhit_isl_tokens{{{SEL}}}", "ISL {{pod}}"))
        .with_target(q("B", f"kvhit_osl_tokens{{{SEL}}}", "OSL {{pod}}"))
        .with_target(q("C", f"kvhit_window_seconds{{{SEL}}}", "window {{pod}}"))
        .override_by_query("C", [prop("unit", "s"), prop("custom.axisPlacement", "right")]))
    internals = (
        stat_panel(ids, "Model internals", "none",
                   "T_fixed ± its standard error (absent while T_step is not its own term: see Engine and unknown "
                   "signals), the contention "
                   "factor c(running), S_kv, B_load (measured or configured), the h range a "
                   "is fitted over, the direct miss slope's ISL and OSL buckets and its anomalous (tail-chunk) steps, and the "
                   "configured target hit ratio.", w=12, h=8)
        .with_target(now("A", f"kvhit_fixed_time_seconds{{{SEL}}}", "T_fixed {{pod}}"))
        .with_target(now("B", f"kvhit_contention_factor{{{SEL}}}", "c(running) {{pod}}"))
        .with_target(now("C", f"kvhit_kv_bytes_per_token{{{SEL}}}", "S_kv {{pod}}"))
        .with_target(now("D", f"kvhit_load_bandwidth_bytes_per_second{{{SEL}}}", "B_load {{source}} {{pod}}"))
        .with_target(now("E", f"kvhit_miss_slope_isl_bucket_tokens{{{SEL}}}", "ISL bucket {{bound}} {{pod}}"))
        .with_target(now("F", f"kvhit_miss_slope_anomalous_steps{{{SEL}}}", "anomalous steps {{pod}}"))
        .with_target(now("G", f"kvhit_target_hit_ratio{{{SEL}}}", "target h {{pod}}"))
        .with_target(now("H", f"kvhit_miss_slope_hit_ratio{{{SEL}}}", "a's h range {{bound}} {{pod}}"))
        .with_target(now("I", f"kvhit_fixed_time_stderr_seconds{{{SEL}}}", "T_fixed stderr {{pod}}"))
        .with_target(now("J", f"kvhit_miss_slope_osl_bucket_tokens{{{SEL}}}", "OSL bucket {{bound}} {{pod}}"))
        .override_by_query("A", [prop("unit", "s")])
        .override_by_query("I", [prop("unit", "s")])
        .override_by_query("C", [prop("unit", "bytes")])
        .override_by_query("D", [prop("unit", "Bps")])
        .override_by_query("E", [prop("unit", TOKENS)])
        .override_by_query("J", [prop("unit", TOKENS)])
        .override_by_query("F", [prop("unit", "suffix: steps")])
        .override_by_query("G", [prop("unit", "percentunit")])
        .override_by_query("H", [prop("unit", "percentunit")]))
    d = d.with_panel(internals)
    return d


def firing_alerts(ids: Ids, one_model: bool = False) -> table.Panel:
    alerts = 'ALERTS{alertname=~"Kvhit.*", alertstate="firing", namespace=~"$namespace|", pod=~"$pod|", '
    # alerts without the label (no pod: a per-model rule or KvhitAbsent's absent()) belong to every selection
    query = (f'{alerts}{THE_MODEL}}} or {alerts}model_name=""}}' if one_model
             else f'{alerts}model_name=~"$model_name|"}}')
    return (table_panel(ids, "Firing kvhit alerts", "none",
                        "Prometheus's ALERTS series of the kvhit rules (rules/kvhit-alerts.yml) that are firing; "
                        "runbooks in docs/runbooks.md.", w=24, h=6)
            .with_target(q("A", query, instant=True))
            .with_transformation(DataTransformerConfig(id_val="organize", options={
                "excludeByName": {"Time": True, "Value": True, "__name__": True, "alertstate": True},
                "indexByName": {"alertname": 0, "severity": 1, "namespace": 2, "pod": 3, "model_name": 4}})))


# --- kvhit / fleet -----------------------------------------------------------------------------


def fleet_dashboard() -> Dashboard:
    ids = Ids()
    d = (Dashboard("kvhit / fleet").uid("kvhit-fleet")
         .description("Per model across pods, from kvhit's recording rules (rules/kvhit-recording.yml): rates from "
                      "vLLM's counters and kvhit's gauges aggregated by namespace and model_name. Generated by "
                      "grafana/dashboards.py.")
         .tags(["kvhit", "vllm"]).refresh("1m").time("now-24h", "now").timezone("browser").editable()
         .variables(variables()))
    d = d.with_row(Row("Per model").id(ids()))
    d = d.with_panel(
        ts(ids, "Token hit ratio per model", "percentunit",
           "(hits + external hits) / queries from vLLM's counters summed over pods, over 5 min and 24 h (over "
           "the data there is, less on the first day). Below 25 % over 24 h caching does not pay "
           "(KvhitPrefixCachingNotPaying, which waits for a full day of data).")
        .min(0).max(1).thresholds_style(GraphThresholdsStyleConfig().mode(GraphTresholdsStyleMode.LINE))
        .thresholds(thresholds((None, "red"), (0.25, "green")))
        .with_target(q("A", f"namespace_model_name:vllm_prefix_cache_hit_ratio:rate5m{{{MODEL}}}", "{{namespace}}/{{model_name}} 5m"))
        .with_target(q("B", f"namespace_model_name:vllm_prefix_cache_hit_ratio:rate24h{{{MODEL}}}", "{{namespace}}/{{model_name}} 24h")))
    d = d.with_panel(
        ts(ids, "Delivered vs physical TPM per model", TPM,
           "Observed from vLLM's counters (5 min) and kvhit's predicted capacity summed over the pods whose fit "
           "is ok (how many: 'Pods analysed, in the valley, in the sums'): while few fits are ok it reads below "
           "the delivered TPM of all pods without any overload.")
        .with_target(q("A", f"namespace_model_name:vllm_tpm_delivered:rate5m{{{MODEL}}}", "{{namespace}}/{{model_name}} delivered"))
        .with_target(q("B", f"namespace_model_name:vllm_tpm_physical:rate5m{{{MODEL}}}", "{{namespace}}/{{model_name}} physical"))
        .with_target(q("C", f'namespace_model_name:kvhit_tpm_tokens_per_minute:sum{{basis="predicted", {MODEL}}}',
                       "{{namespace}}/{{model_name}} {{kind}} capacity (kvhit)")))
    d = d.with_panel(
        ts(ids, "Pods analysed, in the valley, in the sums", PODS,
           "Pods whose kvhit reports the valley, of the pods with a live kvhit analysis; and how many pods the "
           "revenue and predicted-capacity sums hold (only pods whose fit is ok publish them).")
        .with_target(q("A", f"namespace_model_name:kvhit_valley_active:sum{{{MODEL}}}", "{{namespace}}/{{model_name}} in the valley"))
        .with_target(q("B", f"namespace_model_name:kvhit_window_seconds:count{{{MODEL}}}", "{{namespace}}/{{model_name}} analysed"))
        .with_target(q("C", f"namespace_model_name:kvhit_revenue_per_second:count{{{MODEL}}}",
                       "{{namespace}}/{{model_name}} in the {{form}} revenue sum"))
        .with_target(q("D", f'namespace_model_name:kvhit_tpm_tokens_per_minute:count{{basis="predicted", {MODEL}}}',
                       "{{namespace}}/{{model_name}} in the {{kind}} capacity sum")))
    d = d.with_panel(
        ts(ids, "Revenue per second per model", PRICE_S,
           "R(h) at each pod's current hit ratio, summed over the pods whose fit is ok (how many: 'Pods analysed, "
           "in the valley, in the sums').")
        .with_target(q("A", f"namespace_model_name:kvhit_revenue_per_second:sum{{{MODEL}}}", "{{namespace}}/{{model_name}} {{form}}")))
    d = d.with_panel(
        ts(ids, "TTFT per model", "s", "Observed mean TTFT from vLLM's histogram (5 min) and the worst pod's prediction.")
        .with_target(q("A", f"namespace_model_name:vllm_time_to_first_token_seconds:mean5m{{{MODEL}}}", "{{namespace}}/{{model_name}} observed"))
        .with_target(q("B", f'namespace_model_name:kvhit_predicted_ttft_seconds:max{{kind="load_aware", {MODEL}}}',
                       "{{namespace}}/{{model_name}} predicted at {{hit_ratio}} h")))
    d = d.with_panel(
        ts(ids, "Queue depth per model", REQUESTS,
           "Requests waiting for capacity (vLLM 0.20+: deferred ones left out) and running, summed over pods.")
        .with_target(q("A", f"namespace_model_name:vllm_num_requests_waiting:sum{{{MODEL}}}", "{{namespace}}/{{model_name}} waiting"))
        .with_target(q("B", f"namespace_model_name:vllm_num_requests_running:sum{{{MODEL}}}", "{{namespace}}/{{model_name}} running")))
    d = d.with_panel(
        ts(ids, "KV cache usage per model", "percentunit", "The fullest pod's KV-cache usage.")
        .min(0).max(1).with_target(q("A", f"namespace_model_name:vllm_kv_cache_usage:max{{{MODEL}}}", "{{namespace}}/{{model_name}}")))
    d = d.with_panel(
        table_panel(ids, "Fits across pods", PODS, "Pods per fit and status.")
        .with_target(q("A", f"namespace_model_name:kvhit_fit_status:count{{{MODEL}}}", instant=True))
        .with_transformation(DataTransformerConfig(id_val="organize", options={
            "excludeByName": {"Time": True, "__name__": True}, "renameByName": {"Value": "pods"}})))
    d = d.with_panel(
        table_panel(ids, "Pods in the valley", "none", "The pods whose kvhit reports the valley now (a fleet-mode "
                    "kvhit's own verdict, scope=\"fleet\", is no pod's).", w=24, h=6)
        .with_target(q("A", f'kvhit_valley_active{{scope!="fleet", {HEALTH}, {ANY_MODEL}}} == 1', instant=True))
        .with_transformation(DataTransformerConfig(id_val="organize", options={
            "excludeByName": {"Time": True, "Value": True, "__name__": True}})))
    d = d.with_row(Row("Alerts").id(ids()))
    d = d.with_panel(firing_alerts(ids))
    return d


DASHBOARDS = {"kvhit-model": model_dashboard, "kvhit-fleet": fleet_dashboard}


def render() -> dict[str, str]:
    """File name → JSON text of every dashboard."""
    enc = JSONEncoder(sort_keys=True, indent=2)
    return {f"{uid}.json": enc.encode(build().build()) + "\n" for uid, build in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed JSON instead of writing")
    args = ap.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = OUT / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            OUT.mkdir(exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(HERE.parent)}")
    if stale:
        print(f"out of date: {', '.join(stale)} (run python grafana/dashboards.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
