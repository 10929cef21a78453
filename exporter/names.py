"""Every ``kvhit_*`` metric name, its HELP text and its label keys — defined once, here.

Convention (Prometheus naming): base units as suffix (``_seconds``, ``_bytes``, ``_ratio`` for
dimensionless ratios, 0–1 where a fraction: δ, ``kvhit_load_compute_ratio``, exceeds 1), ``_total``
only on counters, ``_info`` for value-1 label carriers; no ``_rate``.
TPM keeps the seeds' unit, tokens per minute (MODEL.md §3.4). Every series carries
``model_name`` and ``target`` unless it describes the scrape itself (``target`` only).
HELP states the unit and the estimator. Unknown values are absent, never 0 (MODEL.md §6).
README, rules and dashboards are checked against this module by tests.
"""
from __future__ import annotations

from dataclasses import dataclass

MODEL = ("model_name", "target")


@dataclass(frozen=True)
class Metric:
    name: str
    help: str
    labels: tuple[str, ...]
    type: str = "gauge"  # gauge | counter
    section: str = ""  # MODEL.md section the value comes from


_ALL: list[Metric] = []


def _m(name: str, help: str, labels: tuple[str, ...] = MODEL, type: str = "gauge", section: str = "") -> Metric:
    m = Metric(name, help, labels, type, section)
    _ALL.append(m)
    return m


# --- scrape health ---------------------------------------------------------------------
BUILD_INFO = _m("kvhit_build_info", "kvhit's version (label version; value 1): which kvhit a pod runs.",
                ("target", "version"))
CONFIG_LOADED = _m("kvhit_config_last_load_successful", "1 when kvhit started with a valid configuration "
                   "(file, KVHIT_* environment, flags); 0 when it did not and, run with --on-config-error=serve "
                   "(the sidecar manifests), analyses nothing and serves only this and kvhit_build_info until "
                   "restarted; its log says what is wrong [boolean].", ())
UP = _m("kvhit_up", "1 when the last scrape of the target succeeded and parsed, else 0.", ("target",))
SCRAPE_DURATION = _m("kvhit_scrape_duration_seconds", "Duration of the last scrape of the target [s].", ("target",))
ANALYSIS_DURATION = _m("kvhit_analysis_duration_seconds", "Time kvhit took to analyse the last successful scrape: "
                       "parsing its body, the windows and the fit step [s]; near the scrape interval the poll "
                       "loop falls behind (kvhit_stale).", ("target",))
# Label values of kvhit_scrape_errors_total exported at 0 from the start: a series born at its first
# error would hide that error from rate() and increase(). http_<code> series appear when met.
SCRAPE_ERROR_REASONS = ("refused", "no_answer", "timeout", "redirect", "too_large", "encoding", "incomplete",
                        "parse", "out_of_order", "internal", "error")
FLEET_ERROR_REASONS = ("query_error", "partial_response", "bad_response", "credentials", "catching_up")  # fleet mode only
SCRAPE_ERRORS = _m("kvhit_scrape_errors_total", "Failed scrapes of the target by reason "
                   f"({', '.join(SCRAPE_ERROR_REASONS)}, http_<code>; fleet mode also {', '.join(FLEET_ERROR_REASONS)}) "
                   "[scrapes].", ("target", "reason"), "counter")
LAST_SUCCESS = _m("kvhit_last_success_timestamp_seconds", "Unix time of the last successful scrape [s].", ("target",))
DATA_AGE = _m("kvhit_data_age_seconds", "Age of the last successful scrape, the one every per-model value comes "
              "from; per-model series are removed once it exceeds two scrape intervals plus the scrape timeout [s].", ("target",))
STALE = _m("kvhit_stale", "1 when the per-model values shown do not come from the latest scrape attempt (it "
           "failed, or no scrape succeeded for more than interval + timeout), 0 when they are fresh; the values "
           "are removed after two intervals plus the timeout [boolean].", ("target",))
INPUT_QUIRKS = _m("kvhit_input_quirks_total", "Lines or series of the target's expositions that kvhit handled "
                  "as a quirk, by quirk (truncated, malformed_line, non_utf8, non_finite, out_of_range, negative, "
                  "duplicate_series, pid_duplicate, engine_incomplete, histogram_inconsistent, models_over_limit, engines_over_limit) [lines].",
                  ("target", "quirk"), "counter")
UNTRACKED_SERIES = _m("kvhit_untracked_series", "(model_name, engine) series of the last scrape not analysed "
                      "because max_series was reached [series].", ("target",))
ENGINE_INFO = _m("kvhit_engine_info", "Engine detected in the last exposition kvhit read from the target (value "
                 "1; kept while scrapes fail: kvhit_up says whether it is current); reason says why it is unsupported "
                 "or empty.", ("target", "engine", "reason"))
UNKNOWN_INFO = _m("kvhit_unknown_info", "A signal kvhit cannot know for this model (value 1), with the reason; "
                  "the signal's own series is absent. The reason leaves out values measured this scrape (they are in "
                  "/api/v1/analysis), so the series stays one while they move.", MODEL + ("signal", "reason"))
WARNING_INFO = _m("kvhit_warning_info", "A caveat on this model's values published for the publish window (value "
                  "1): warning=counter_reset (engine restarted inside it), hit_unit_blocks (vLLM 0.7-0.8 block-level "
                  "hit ratio), preemptions (hits inflated before vLLM 0.11.1), short_prompts (h = 0 because prompts "
                  "are not longer than one KV block), data_parallel (several engines in one exposition, or a fleet's, "
                  "fitted as one machine), kv_cache_dtype (vLLM's KV cache dtype unknown to kvhit or not the configured "
                  "model.dtype_bytes), load_aware_off (the load-aware TTFT misses the window's observed one by more "
                  "than 25 %), engine_speed_changed (the engine's chip time per unit of work moved by more than 8 %: "
                  "the fits started afresh, for an hour after), prefill_latency_changed (its prefill latency under that "
                  "chip time moved by more than 5 %, as the overlap α does with another KV offload setting: the latency "
                  "fit started again from its newest steps, for an hour after), bathtub_extrapolated (the chip-time bathtub's h*, "
                  "h_even or no-exit read beyond the h its fit's steps saw), kv_load_bound (a predicted or target TPM, "
                  "or the chip-time bathtub's at its h_even, past what the KV-load link can feed, B_load/(S_kv h_load): the link, not chip time, limits it); reason explains.", MODEL + ("warning", "reason"))

# --- observed over the publish window (MODEL.md §1, §2) ----------------------------------
WINDOW = _m("kvhit_window_seconds", "Length of the publish window the observed values cover [s] "
            "(window_seconds once enough history exists).", section="§1")
HIT_RATIO = _m("kvhit_hit_ratio", "Token-level prefix-cache hit ratio over the publish window, "
               "Δhits/Δqueries; source=device (HBM), loaded (KV connector/offload), all = sum [ratio].",
               MODEL + ("source",), section="§2")
ISL = _m("kvhit_isl_tokens", "Mean prompt length (ISL) of requests finished in the publish window, "
         "Δsum/Δcount of vllm:request_prompt_tokens [tokens].", section="§2")
OSL = _m("kvhit_osl_tokens", "Mean output length (OSL) of requests finished in the publish window [tokens].", section="§2")
OBSERVED_TTFT = _m("kvhit_observed_ttft_seconds", "Mean TTFT (includes queueing) of the publish window, "
                   "Δsum/Δcount of vllm:time_to_first_token_seconds [s].", section="§2")
TPM = _m("kvhit_tpm_tokens_per_minute", "Delivered TPM counts cached input, physical TPM only computed tokens; "
         "basis=observed from counters over the publish window, predicted = the chip-time model's throughput "
         "of the engines at full load, all busy, at the current h, ISL, OSL and the observed engine steps per request (they fall "
         "as concurrency rises): a capacity estimate, within the chip-time fit's error of what the engine delivers; "
         "target = the observed TPM carried to target_hit_ratio by the hit-to-hit correction x C(h)/C(target), C = "
         "the chip time per request (MODEL.md 3.5); per=gpu divides by tp*pp*engines [tokens/min].",
         MODEL + ("kind", "basis", "per"), section="§3.4, §3.5")

# --- fits (MODEL.md §4, §6, §7, §3.2) -----------------------------------------------------
FIT_STATUS = _m("kvhit_fit_status", "1 for the current status of each fit (ok, insufficient_data, "
                "insufficient_variation, not_identifiable), 0 for the others.", MODEL + ("fit", "status"), section="§6")
FIT_SAMPLES = _m("kvhit_fit_samples", "Observations used by the last fit: steps (max_num_seqs: one per data-parallel "
                 "engine busy in a step, each engine's TPOTs at its own concurrency) [1].", MODEL + ("fit",),
                 section="§6")
FIT_R2 = _m("kvhit_fit_r2", "Coefficient of determination of the last fit (chip_time: uncentred, the model has "
            "no intercept) [1].", MODEL + ("fit",), section="§6")
CHIP_COEF = _m("kvhit_chip_time_coefficient_seconds", "Chip-time model coefficient (robust NNLS on busy steps), term as MODEL.md §7 names it: "
               "t_step = s per engine step, k_ffn = s per computed prompt token, k_attn = s per unit of "
               "M*H+M^2/2, k_dec = s per generated token, k_ctx = s per KV token read by decode "
               "[s per unit of the term]; a 0 is the bound (no coefficient is negative), a value within its "
               "kvhit_chip_time_coefficient_stderr_seconds, not a cost of exactly 0; absent for a term the traffic "
               "did not vary apart from the others, and for a kept one their time rides on (kvhit_unknown_info says which).",
               MODEL + ("term",), section="§7")
CHIP_COEF_STDERR = _m("kvhit_chip_time_coefficient_stderr_seconds", "Standard error of each chip-time coefficient "
                      "[s per unit of the term, as the coefficient].", MODEL + ("term",), section="§7")
FIXED_TIME = _m("kvhit_fixed_time_seconds", "T_fixed of the per-request chip time t_chip (TPM, chip_time bathtub): "
                "hit-independent chip time per request, T_step x observed engine steps per request in the publish "
                "window, prefill and decode steps, of all engines at full load as the predicted TPM (T_step x the "
                "engines busy in the fit's steps / all engines); the service TTFT counts the prefill's one step, T_step; absent while T_step "
                "is not identifiable as its own term (kvhit_unknown_info says why) [s].",
                section="§7")
FIXED_TIME_STDERR = _m("kvhit_fixed_time_stderr_seconds", "Standard error of T_fixed: T_step's x the observed engine "
                       "steps per request (counted, not fitted); published with kvhit_fixed_time_seconds: a T_fixed "
                       "of 0 (T_step at its bound) is a value within this error, not an exact one [s].", section="§7")
TPS0 = _m("kvhit_miss_tps0_tokens_per_second", "TPS0, miss-token throughput at h=0 of TPS_miss(h)=TPS0*(1-a*h); "
          "method=direct (robust line through busy-step miss tokens per busy second, current ISL and OSL bucket) or "
          "derived (line through the chip-time model's M/t_chip(h), of all engines at full load as the predicted TPM) "
          "[tokens/s].", MODEL + ("method",), section="§4")
MISS_SLOPE = _m("kvhit_miss_slope", "a in TPS_miss(h)=TPS0*(1-a*h); method=direct or derived (never averaged) [1].",
                MODEL + ("method",), section="§4")
MISS_SLOPE_STDERR = _m("kvhit_miss_slope_stderr", "Standard error of a [1].", MODEL + ("method",), section="§4")
MISS_SLOPE_BUCKET = _m("kvhit_miss_slope_isl_bucket_tokens", "ISL bucket [lower, upper) of the direct miss-slope "
                       "fit being published [tokens].", MODEL + ("bound",), section="§4")
MISS_SLOPE_OSL_BUCKET = _m("kvhit_miss_slope_osl_bucket_tokens", "OSL bucket [lower, upper) of the direct "
                           "miss-slope fit being published (a depends on the output length too: decode time per "
                           "request); absent when the OSL is unknown [tokens].", MODEL + ("bound",), section="§4")
MISS_SLOPE_RANGE = _m("kvhit_miss_slope_hit_ratio", "h range [lower, upper] of the busy steps the miss-slope fit saw "
                      "(dips and outliers included; of every ISL and OSL bucket when only the derived slope is "
                      "published, its bucket's steps spanning too little h; the chip-time fit's steps when those "
                      "span too little too): the derived slope's line spans it, the "
                      "direct line what its kept steps cover; a is a secant over it and says nothing beyond it "
                      "[ratio].", MODEL + ("bound",),
                      section="§4")
MISS_SLOPE_ANOMALIES = _m("kvhit_miss_slope_anomalous_steps", "Busy steps flagged as tail-chunk anomalies and left "
                          "out of the direct miss-slope fit [1].", section="§4")
OVERLAP = _m("kvhit_overlap_ratio", "alpha: share of min(T_load, T_compute) hidden by overlap, fitted on prefill "
             "latency in steps with loaded hits [ratio].", section="§3.2")
OVERLAP_STDERR = _m("kvhit_overlap_ratio_stderr", "Standard error of alpha [ratio].", section="§3.2")
LOAD_BANDWIDTH = _m("kvhit_load_bandwidth_bytes_per_second", "B_load used for T_load; source=measured (vLLM KV "
                    "offload load bytes/time) or configured [bytes/s].", MODEL + ("source",), section="§3.2")
KV_BYTES = _m("kvhit_kv_bytes_per_token", "S_kv, per-token per-GPU KV bytes from the configured geometry, stored "
              "as the engine's cache_dtype says [bytes].", section="§3.6")
CONTENTION = _m("kvhit_contention_factor", "c(running) = c0 + c1*running: prefill latency over unloaded prefill "
                "chip time at the publish window's time-averaged num_requests_running [1].", section="§7")

# --- predictions ------------------------------------------------------------------------
TARGET_HIT_RATIO = _m("kvhit_target_hit_ratio", "The configured what-if hit ratio used by the hit_ratio=\"target\" "
                      "series of kvhit_predicted_ttft_seconds and kvhit_capacity_bound_tokens_per_second and by "
                      "kvhit_tpm_tokens_per_minute{basis=\"target\"} [ratio].")
SLO = _m("kvhit_slo_seconds", "The configured latency SLO, slo=ttft (slo.ttft_seconds, time to first token) or "
         "tpot (slo.tpot_seconds, time per output token); absent when not configured [s].", MODEL + ("slo",),
         section="§5")
PREDICTED_TTFT = _m("kvhit_predicted_ttft_seconds", "Predicted TTFT at the current or target hit ratio: "
                    "kind=service is the unloaded chip-time TTFT of seed 000 (T_fixed+T_load+T_compute-T_overlap, "
                    "T_fixed = T_step, one engine step, not kvhit_fixed_time_seconds); "
                    "load_aware adds the window's mean queue time and contention at its time-averaged "
                    "concurrency (kvhit_warning_info{warning=\"load_aware_off\"} when it misses the window's "
                    "observed TTFT by more than 25 %) [s].",
                    MODEL + ("hit_ratio", "kind"), section="§3.2, §7")
PREDICTED_TTFT_STDERR = _m("kvhit_predicted_ttft_stderr_seconds", "Standard error of kvhit_predicted_ttft_seconds "
                           "kind=service from the chip-time fit's covariance and, with loaded hits, the overlap alpha's "
                           "standard error and its covariance with the chip-time coefficients it was fitted under "
                           "(delta method): a young or noisy fit's service TTFT "
                           "may be off by twice this; at an h, ISL or OSL beyond the fit's steps (the prediction's "
                           "extrapolated, /api/v1/analysis) it does not count the extrapolation's error [s].",
                           MODEL + ("hit_ratio", "kind"), section="§3.2, §7")
REVENUE = _m("kvhit_revenue_per_second", "R(h) at the current hit ratio, revenue per machine-second in configured "
             "price units (form=linear: seed 002 with the direct a; chip_time: from the §7 model) [price/s].",
             MODEL + ("form",), section="§4")
REVENUE_SLOPE = _m("kvhit_revenue_slope", "dR/dh at the current hit ratio [price/s per unit h]; negative = "
                   "more hits earn less.", MODEL + ("form",), section="§4")
REVENUE_SLOPE_BOUND = _m("kvhit_revenue_slope_bound", "95 % interval of dR/dh from the fit covariance "
                         "[price/s per unit h].", MODEL + ("form", "bound"), section="§4")
BATHTUB = _m("kvhit_bathtub_revenue_per_second", "The bathtub curve R(h) sampled at fixed hit ratios (label "
             "hit_ratio) for dashboards; form=linear only inside the direct slope's h range, chip_time only where its chip "
             "time is identified (a fit whose steps spanned a narrow h range: near them) [price/s].",
             MODEL + ("form", "hit_ratio"), section="§4")
VALLEY_BOTTOM = _m("kvhit_valley_bottom_hit_ratio", "h*, the hit ratio where R(h) is lowest; absent when "
                   "R'(0) >= 0 (no valley), and for form=linear outside the direct slope's h range, or when the "
                   "line has no bottom (a >= 1, or hit_price_ratio 0: R falls all the way); for chip_time where "
                   "its chip time or slope is not identified (R'(0) with it) [ratio].",
                   MODEL + ("form",), section="§4")
VALLEY_BREAKEVEN = _m("kvhit_valley_breakeven_hit_ratio", "h_even > h*, where R climbs back to R(0); absent "
                      "when there is no valley or no exit, for form=linear outside the direct slope's h range, and "
                      "for chip_time when R(0) is not identified (a fit whose steps spanned a narrow h range) "
                      "[ratio].", MODEL + ("form",), section="§4")
VALLEY_BOTTOM_STDERR = _m("kvhit_valley_bottom_hit_ratio_stderr", "Standard error of h* by the delta method from the "
                          "fit covariance, through R'(h*) = 0 (chip_time: at least h*'s moves, over 1.96, with the "
                          "coefficients 1.96 sigma either way along the step that moves it most); absent with h* and at "
                          "the wall (h* at the h grid's end, where R still falls) [ratio].", MODEL + ("form",),
                          section="§4")
VALLEY_BREAKEVEN_STDERR = _m("kvhit_valley_breakeven_hit_ratio_stderr", "Standard error of h_even by the delta method "
                             "from the fit covariance, through R(h_even) = R(0) (chip_time: at least h_even's moves, as "
                             "h*'s); absent with h_even [ratio].", MODEL + ("form",), section="§4")
VALLEY_EXIT = _m("kvhit_valley_exit", "1 when R(h) climbs back to R(0) before h=1 (chip_time form: "
                 "before h = 1 - 1/ISL, one token computed per request), 0 when the valley has no exit; absent without a valley, for form=linear when h_even (or, without one, h = 1) lies outside "
                 "the direct slope's h range, and for chip_time when R(0) is not identified.", MODEL + ("form",), section="§4")
VALLEY_ACTIVE = _m("kvhit_valley_active", "1 when h_now > 0 and R'(h_now) < 0 with the upper end of its 95 % interval "
                   "below 0, else 0 (at h = 0, R(h) = R(0): nothing is lost yet); uses the chip_time form when its fit is ok and its bathtub is published, else linear (label form).",
                   MODEL + ("form",), section="§4")

# --- seed 003: SLO cost, caching verdict, batch size; KV sizing; first-order capacity --------
OBSERVED_P95 = _m("kvhit_observed_p95_seconds", "P95 over the publish window from bucket deltas, interpolated "
                  "inside the bucket (Prometheus histogram_quantile): quantity=ttft, tpot_request "
                  "(vllm:request_time_per_output_token_seconds, per request, 0.11+) or itl (inter-token "
                  "latency, per token gap) [s]; absent above the highest finite bucket edge, which "
                  "histogram_quantile would answer and is only a lower bound (kvhit_unknown_info says so).", MODEL + ("quantity",), section="§2, §5")
SLO_PASS = _m("kvhit_slo_pass_ratio", "Bounds of the share of requests meeting both the TTFT and the TPOT SLO "
              "over the publish window: lower = max(0, p_ttft+p_tpot-1), upper = min(p_ttft, p_tpot) from "
              "marginal histograms; an SLO between bucket edges uses the edge below for lower, above for upper; "
              "tpot_source = request or itl (which histogram gave p_tpot) [ratio].",
              MODEL + ("bound", "tpot_source"), section="§5")
SLO_COST = _m("kvhit_cost_per_million_slo_output_tokens", "Seed 003 unit cost: instance_hour_price x 1e6 / "
              "(SLO-passing output tokens/s x 3600) (fleet mode: the price x the pods in the tokens, time-averaged over the window), SLO-passing tokens/s = pass ratio x output tokens/s of the "
              "publish window; bound=lower uses the upper pass bound, upper the lower one (absent when that "
              "bound is 0) [price per 1M output tokens].", MODEL + ("bound", "tpot_source"), section="§5")
EFFECTIVE_COST = _m("kvhit_effective_cost_per_million_slo_output_tokens", "Cost per 1M SLO-passing output tokens "
                    "divided by (1 - retry_rate) [price per 1M output tokens].", MODEL + ("bound", "tpot_source"),
                    section="§5")
PREFILL_SHARE = _m("kvhit_prefill_share_ratio", "Prefill share P/(P+D) of mean request_prefill_time over mean "
                   "prefill+decode time; span=window (publish window) or history (the verdict's rollup, up to "
                   "24 h) [ratio].", MODEL + ("span",), section="§5")
CACHING_SPEEDUP = _m("kvhit_prefix_cache_speedup", "Throughput gain from prefix caching 1/(1 - h x prefill share) "
                     "(seed 003), span=window or history [1].", MODEL + ("span",), section="§5")
VERDICT = _m("kvhit_prefix_cache_verdict", "Seed 003 prefix-caching verdict, value 1 for the current state and 0 "
             "for the others: not_paying (h < 0.25 over the history), linear, dedicated_pool_worth_it (h > 0.60 "
             "and prefill share > 0.40), diminishing_returns (h > 0.85), thrash_risk (last 15 min: h > 0.85, "
             "per-minute h jitter >= 0.05 and KV usage >= 0.90); provisional=true until the history covers "
             "24 h [1].", MODEL + ("state", "provisional"), section="§5")
HISTORY_SECONDS = _m("kvhit_prefix_cache_history_seconds", "Time covered by the verdict's per-minute rollup, "
                     "from its first step to its last, outages included: the part of a day it has seen (at most "
                     "24 h); a step enters it when the next scrape confirms it, one scrape after the publish window "
                     "[s].", section="§5")
HISTORY_HIT_RATIO = _m("kvhit_prefix_cache_history_hit_ratio", "Token hit ratio over the verdict's history, "
                       "sum of hits / sum of queries (up to 24 h) [ratio].", section="§5")
HIT_JITTER = _m("kvhit_hit_ratio_jitter", "Population standard deviation of the per-minute token hit ratio over "
                "the last 15 minutes (thrash signal) [ratio].", section="§5")
KV_CAPACITY = _m("kvhit_kv_capacity_tokens", "KV cache capacity per data-parallel engine: cache_config_info "
                 "kv_cache_size_tokens, else num_gpu_blocks x block_size (SGLang: max_total_num_tokens) "
                 "[tokens].", section="§3.6")
MAX_CONCURRENCY = _m("kvhit_max_concurrency", "Concurrency ceiling per data-parallel engine floor(KV capacity / "
                     "(ISL + OSL)) at the publish window's mean ISL and OSL, without prefix sharing [requests].", section="§3.6")
KV_PEAK = _m("kvhit_kv_peak_bytes", "Peak KV per GPU B x N_max x S_kv for the configured sizing.batch and "
             "sizing.max_len (seed 000 §7.1) [bytes].", section="§3.6")
MAX_NUM_SEQS = _m("kvhit_recommended_max_num_seqs", "Economic max-num-seqs (seed 003): floor of the running "
                  "concurrency where the fitted TPOT P95 (weighted line over concurrency levels, fit "
                  "max_num_seqs) reaches 80 % of slo.tpot_seconds [requests].", section="§5")
CAPACITY_BOUND = _m("kvhit_capacity_bound_tokens_per_second", "First-order capacity Theta(h) = Theta0 / "
                    "max(1-h, delta x h_load) with Theta0 = ISL/T0, T0 = the chip-time model's 0-hit prefill "
                    "compute time (full overlap, no fixed cost: an upper bound), of all data-parallel engines (a fleet's "
                    "pods) as one machine at full load; hit_ratio=current or target; h_load or its share "
                    "of the hits unknown: every hit taken as loaded, the seed's delta x h, which can be below the "
                    "bound [prompt tokens/s].", MODEL + ("hit_ratio",), section="§3.3")
LOAD_COMPUTE = _m("kvhit_load_compute_ratio", "delta = ISL x S_kv / (B_load x T0): loading every prompt token's "
                  "KV vs computing them at h=0, a ratio of two times: above 1 when loading is the slower; with E "
                  "engines summed (data-parallel, fleet pods) T0 is theirs as one machine at full load and B_load "
                  "is E x B_load [1].",
                  section="§3.3")

ALL: tuple[Metric, ...] = tuple(_ALL)
BY_NAME: dict[str, Metric] = {m.name: m for m in ALL}
