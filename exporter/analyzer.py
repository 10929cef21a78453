"""Snapshots → step observations → online fitters → :class:`Analysis` (the pipeline's middle).

For every model in the target's exposition the analyzer keeps a publish window and three
online fitters: chip time (MODEL.md §7), miss slope (§4 ``linear``) and prefill latency (the
load-aware layer of §7 with α of §3.2). :meth:`Analyzer.analysis` assembles what the collector
renders: observed window values, fit results, predictions at the current and target hit
ratio, and both bathtubs. Nothing here formats or serves; nothing downstream computes.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from exporter.config import Config
from exporter.engines import TRANSLATED, missing_histogram
from exporter.observe import (ISL_HISTOGRAM, OSL_HISTOGRAM, Context, cache_config_number, histogram_mean, hit_problem,
                              hit_sums, kv_capacity_tokens, observe, request_isl, request_osl, window_notes)
from exporter.parse import DROPPED, HISTOGRAMS, PREFIX_CACHING_OFF, Snapshot, prefix_caching_off
from exporter.window import SUM_DISAGREES, Delta, HistogramDelta, Windows
from fitters.bathtub import BathtubCurve, bathtub_chip_time, bathtub_linear, derived_miss_slope
from fitters.caching import JITTER_MIN_MINUTES, RECENT_MINUTES, STATES, CachingVerdict, HitRollup, speedup, verdict
from fitters.chiptime import CELL_H, DRIFT_REASON, ChipTimeFitter, observed_regressors
from fitters.cost import SloCost, slo_cost, slo_shares
from fitters.histogram import P95, quantile
from fitters.latency import SHIFT_REASON, LatencyFitter, contention
from fitters.missslope import H_RESOLUTION, MissSlopeFitter
from fitters.model import (CHIP_TIME_REGRESSOR_WORDS, CHIP_TIME_TERMS, ChipTimeCoefficients, chip_time_regressors,
                           max_hit_ratio, prefill_share, tpm_delivered, tpm_hit_correction)
from fitters.observation import Observation
from fitters.online import Shift
from fitters.result import STATUSES, Estimate, FitResult, Status, label_reason, measured
from fitters.sizing import TpotConcurrencyFitter, first_order_capacity, max_concurrency, peak_kv_bytes
from fitters.whatif import STEPS_UNKNOWN, FittedModel, Prediction, link_excess, unidentified_terms

log = logging.getLogger("kvhit")

# A publish window across a change of what one hit count stands for (vLLM 0.8 counted KV blocks,
# 0.9 tokens; another --block-size): its sums mix units, h 0.58 for 0.40 (a version audit).
HIT_UNIT_CHANGED = ("the prefix-cache counters changed unit inside the publish window (KV blocks to tokens, or "
                    "another block_size: vLLM restarted as another version or with another --block-size): its sums "
                    "mix units, so the hit ratio is unknown until that step leaves the window")

# Label values the collector publishes each of (1 for the current one, 0 for the others), a
# reason as a label value (without the values measured this scrape, fitters/result.py), and the
# chip-time terms (MODEL.md §1 symbols: kvhit_chip_time_coefficient_seconds{term}).
CACHING_STATES, FIT_STATUSES, LABEL_REASON, CHIP_TERMS = STATES, STATUSES, label_reason, CHIP_TIME_TERMS
# A model absent from the scrapes this many publish windows loses its fitters' history.
STATE_TTL_WINDOWS = 10
# A step whose rate of some volume counter (SPIKE_COUNTERS: tokens queried, prompted, generated;
# hits are bounded by queries, exporter/observe.py hit_problem) is SPIKE_FACTOR times both the next
# step's and the highest rate of the model's fitted steps is a glitch, never fitted: a counter
# that jumped once and stayed up (vLLM's counters cannot; a mixed-up scrape can), which the next
# step cannot tell (nothing goes back). A review's prefix_cache_queries + 1e7 bent the chip-time
# fit (k_ffn 1.2e-4 → 3e-8 s) and the 24 h rollup (h 0.74 → 0.13, caching verdict not_paying)
# for a day. The peak never decays (a review: decaying through idle hours, every sparse request
# after them was dropped), and a spike raises it by SPIKE_LEARN at most: traffic whose bursts are
# 1000x its lull loses a few bursts, then they are its peak; a second jump of the same size is
# still caught. A step over SPIKE_FACTOR times the peak is suspect from its own scrape on: the
# publish windows holding it say why their hit ratio and TPM are unknown until the next scrape
# tells a jump (then until it leaves them) from traffic.
SPIKE_COUNTERS = ("queries", "external_queries", "prompt_tokens", "generation_tokens")
SPIKE_FACTOR = 100.0
SPIKE_LEARN = 2.0
SPIKE_IN_WINDOW = (f"a token counter rose over {SPIKE_FACTOR:g}x its peak in a step inside the publish window: a jump "
                   "that stays up (kept from the fits) or traffic, which the next scrape tells; unknown until then, "
                   "and for a jump until that step leaves the window")
# cache_config_info labels that memory profiling sets at each start (vLLM's KV pool in blocks, bytes and
# tokens, and the concurrency it holds): a restart of one configuration moves them a little, another
# GPU memory size or memory share by more than this fraction
PROFILED_LABELS = ("num_gpu_blocks", "num_cpu_blocks", "kv_cache_size_tokens", "kv_cache_memory_bytes",
                   "kv_cache_max_concurrency")
PROFILED_CHANGE = 0.1
# cache_config_info labels every vLLM sets to a number > 0: any other value is a damaged body
# (block_size="0", "abc"), unknown, not another engine
POSITIVE_LABELS = ("block_size", "num_gpu_blocks")
STATE_CAP_FACTOR = 2  # fit histories kept: those of the analysed models, and as many of models gone
BANDWIDTH_COUNTERS = ("kv_offload_load_bytes", "kv_offload_load_seconds")  # B_load = Δbytes/Δseconds
# Hit ratios at which the bathtub curves are published (stable label values for dashboards).
BATHTUB_GRID = tuple(i / 20 for i in range(20)) + (0.97, 0.99)
# How long kvhit_warning_info{warning="engine_speed_changed"} stays after the chip-time fit found
# the engine's speed changed and the fits started afresh (and prefill_latency_changed after the
# latency fit found its latency layer changed) [s]: long enough for a 15-min alert's eyes.
CHANGED_NOTE_SECONDS = 3600.0
# why a counter of every scrape is not in a window (Delta.counters holds those at every scrape)
MISSING_IN_WINDOW = ("missing at a scrape inside the publish window (a cut or bad body, or in fleet mode a family left "
                     "out of a poll, logged): unknown until that scrape leaves the window")
ABSENT_NOW = f"absent from the latest scrape (not exported, or {DROPPED}; fleet mode: not from every pod)"


@dataclass(frozen=True)
class ModelAnalysis:
    """Everything kvhit knows about one ``model_name`` now. None = unknown (see ``unknown``).

    Attributes:
        model_name: opaque vLLM ``model_name`` label value.
        window_seconds: span of the publish window [s]; window_steps: steps in it.
        hit_ratio: {"all", "device", "loaded"} → h over the window [1] (missing key = unknown).
        unknown: signal → reason it is unknown.
        isl, osl: window means [tokens]; observed_ttft: window-mean TTFT [s].
        tpm_observed: {("delivered"|"physical", "instance"|"gpu")} → tokens/min (§3.4 observed).
        tpm_target: the same carried to the target hit ratio by the hit→hit correction (§3.5).
        fits: "chip_time" | "miss_slope" | "overlap" | "load_aware" | "max_num_seqs" → FitResult.
        miss_slope_derived: ("tps0", "a") Estimates from the chip-time model (§4), or {}.
        miss_slope_h_range: (lower, upper) h the published miss slopes span: the direct fit's busy
            steps, or, when those of its bucket span less than its minimum, those of every bucket,
            over which the derived line is drawn; None when neither slope is published.
        fitted: the frozen model for predictions (None until the chip-time fit is ok).
        predictions: "current" | "target" → Prediction.
        bathtubs: "linear" | "chip_time" → BathtubCurve.
        valley_form: which bathtub drives ``kvhit_valley_active`` (None when neither is ok).
        load_bandwidth: (value [bytes/s], "measured" | "configured") or None.
        kv_bytes_per_token: S_kv per GPU [bytes] or None.
        contention: c(running) at the window's time-averaged concurrency [1] or None.
        anomalies: busy steps flagged as tail-chunk anomalies in the published miss slope's ISL and OSL bucket.
        anomaly_times: end times [unix s] of those steps (the report marks them).
        warnings: warning → reason, a caveat on published values (observe.window_notes).
        slo_cost: pass-rate bounds and cost per 1M SLO-passing output tokens (MODEL.md §5).
        tpot_source: "request" (request_time_per_output_token_seconds) or "itl" (inter-token
            latency, per token gap) — the histogram TPOT shares and P95 came from.
        p95: "ttft" | "tpot_request" | "itl" → P95 of the publish window [s].
        prefill_share, caching_speedup: "window" | "history" → P̄/(P̄+D̄) and 1/(1−h·share) [1].
        caching: the seed-003 prefix-caching verdict (history up to 24 h).
        kv_capacity_tokens: KV pool size per data-parallel engine [tokens];
        max_concurrency: ⌊capacity/(ISL+OSL)⌋ [requests]; kv_peak_bytes: B·N_max·S_kv [bytes/GPU].
        recommended_max_num_seqs: ⌊running*⌋ where TPOT P95 = 80 % of the TPOT SLO [requests].
        capacity_bound: "current" | "target" → first-order Θ(h) [prompt tokens/s] (§3.3);
        load_compute_ratio: δ [1].
    """

    model_name: str
    window_seconds: float
    window_steps: int
    hit_ratio: dict[str, float]
    unknown: dict[str, str]
    isl: float | None
    osl: float | None
    observed_ttft: float | None
    tpm_observed: dict[tuple[str, str], float]
    fits: dict[str, FitResult]
    tpm_target: dict[tuple[str, str], float] = field(default_factory=dict)
    miss_slope_derived: dict[str, Estimate] = field(default_factory=dict)
    miss_slope_h_range: tuple[float, float] | None = None
    fitted: FittedModel | None = None
    predictions: dict[str, Prediction] = field(default_factory=dict)
    bathtubs: dict[str, BathtubCurve] = field(default_factory=dict)
    valley_form: str | None = None
    load_bandwidth: tuple[float, str] | None = None
    kv_bytes_per_token: float | None = None
    contention: float | None = None
    anomalies: int = 0
    anomaly_times: tuple[float, ...] = ()
    warnings: dict[str, str] = field(default_factory=dict)
    slo_cost: SloCost | None = None
    tpot_source: str | None = None
    p95: dict[str, float] = field(default_factory=dict)
    prefill_share: dict[str, float] = field(default_factory=dict)
    caching_speedup: dict[str, float] = field(default_factory=dict)
    caching: CachingVerdict | None = None
    kv_capacity_tokens: float | None = None
    max_concurrency: int | None = None
    kv_peak_bytes: float | None = None
    recommended_max_num_seqs: int | None = None
    capacity_bound: dict[str, float] = field(default_factory=dict)
    load_compute_ratio: float | None = None


@dataclass(frozen=True)
class Analysis:
    """The analysis of one target at one moment (what the collector renders).

    Attributes:
        timestamp: time of the latest snapshot [unix s] (None before the first one).
        engine, engine_reason: from the latest snapshot (parse.Snapshot).
        models: model_name → ModelAnalysis.
        target_hit_ratio: the configured what-if hit ratio (None = not configured).
        slo_seconds: the configured latency SLOs, "ttft" / "tpot" → seconds (unset ones absent).
        failed: model_name → the exception type its analysis raised (logged; the model is left
            out, the others stand).
        withdrawn: why every per-model value was removed as stale ("" when none was:
            :meth:`without_models`).
    """

    timestamp: float | None
    engine: str
    engine_reason: str
    models: dict[str, ModelAnalysis]
    target_hit_ratio: float | None = None
    slo_seconds: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    withdrawn: str = ""

    def without_models(self, why: str) -> "Analysis":
        """The same analysis with every per-model value removed, ``why`` (stale data is never shown)."""
        return replace(self, models={}, withdrawn=why)


@dataclass(frozen=True)
class ModelFits:
    """The online fits of one model at one moment (:meth:`Analyzer.fits`; MODEL.md §3.2, §4, §7).

    Attributes:
        chip_time: the §7 chip-time fit; coefficients: its coefficients when ok, else None.
        miss_slope: the direct (TPS0, a) fit of one ISL and OSL bucket (§4 ``linear``).
        load_aware, overlap: the load-aware latency fit (c0, c1) and α (§3.2, §7); both
            insufficient_data "waiting for the chip-time fit" while coefficients is None.
        anomaly_times: end times [unix s] of the tail-chunk anomalies flagged in miss_slope's bucket.
    """

    chip_time: FitResult
    coefficients: ChipTimeCoefficients | None
    miss_slope: FitResult
    load_aware: FitResult
    overlap: FitResult
    anomaly_times: tuple[float, ...] = ()


@dataclass
class _ModelState:
    chip: ChipTimeFitter = field(default_factory=ChipTimeFitter)
    slope: MissSlopeFitter = field(default_factory=MissSlopeFitter)
    latency: LatencyFitter = field(default_factory=LatencyFitter)
    rollup: HitRollup = field(default_factory=HitRollup)
    tpot: TpotConcurrencyFitter = field(default_factory=TpotConcurrencyFitter)
    tpot_source: str | None = None
    isl: float | None = None
    osl: float | None = None
    load_share: float | None = None  # h_load/h of the latest step with queries that told it
    # The latest step, fitted only once the next one confirms it (_confirms): a scrape that read
    # high (a glitch) shows only when the one after it is skipped and the step after that is
    # still down (exporter/window.py)
    pending: _Pending | None = None
    peak: dict[str, float] = field(default_factory=dict)  # counter → highest rate of its fitted steps (SPIKE_FACTOR)
    identity: "_Identity | None" = None  # the engine of the latest steps
    candidate: "_Identity | None" = None  # another one seen at the latest step alone (_Identity.changed)
    changed: tuple[float, Shift] | None = None  # (when, how much) the engine last changed speed (ChipTimeFitter.drift)
    latency_changed: tuple[float, Shift] | None = None  # … its prefill latency under that speed (LatencyFitter.shift)
    # ((hit unit, block_size where it counts blocks), end of the step across which it last changed,
    # to or from unknown too): a publish window that starts before then sums counts of two units
    # (HIT_UNIT_CHANGED)
    hit_scale: tuple[tuple[str, float | None], float | None] | None = None

    def another_engine(self, identity: "_Identity") -> str | None:
        """Why the engine of this step (``identity``) is another than the one fitted so far, when it
        is at this step and the one before (:meth:`_Identity.changed`), else None; remembers both."""
        if self.identity is None:
            self.identity = identity
        elif (why := self.identity.changed(identity)) is None:
            if identity.config:  # else the same engines, and the config known before stays
                self.identity = identity
            self.candidate = None
        elif self.candidate is None or self.candidate.changed(identity) is not None:
            self.candidate = identity  # another engine once: a cut body's engines, or one odd scrape
        else:
            return why
        return None

    def afresh(self, identity: "_Identity") -> "_ModelState":
        """Fitters emptied for another engine, ``identity`` (:meth:`another_engine`); the traffic's
        state kept: the 24 h hit rollup, ISL/OSL, the load share and the spike peaks are the
        traffic's, not the engine's; and the changes found before, each warned for its hour."""
        return _ModelState(rollup=self.rollup, isl=self.isl, osl=self.osl, load_share=self.load_share, peak=self.peak,
                           identity=identity, hit_scale=self.hit_scale, changed=self.changed,
                           latency_changed=self.latency_changed)


@dataclass(frozen=True)
class _Identity:
    """What vLLM exports of the configuration of the engine serving a model: its data-parallel
    engines in one exposition (not a fleet's pods, which come and go), and its ``cache_config_info``
    labels ({} when the scrape lacked them, or in fleet mode, whose majority of pods' labels moves
    with scaling in a mixed fleet: unknown, not changed; parse leaves out its ``engine`` label).
    The analyzer starts a model's fits afresh when two steps in a row show another engine (one is
    a cut body, or a scrape of another pod)."""

    engines: int
    config: Mapping[str, str]

    def changed(self, new: "_Identity") -> str | None:
        """Why ``new`` is another engine than this one (its fitted physics no longer hold), or None:
        a crash restart from the same container spec keeps its fits. Another data-parallel size, or a
        changed ``cache_config_info`` label (set at start: block size, KV dtype, memory share, a vLLM
        upgrade's new labels, …; the KV pool sizes of PROFILED_LABELS by more than PROFILED_CHANGE,
        as memory profiling moves them a little between runs of one configuration; a label of
        POSITIVE_LABELS that is not a number > 0 at either end is unknown, not changed)."""
        if new.engines != self.engines:
            return f"data-parallel engines {self.engines} → {new.engines}"
        old, cur = self.config, new.config
        if not cur or not old or cur is old:  # unknown at either end: not changed
            return None
        changed = [k for k in sorted(set(old) | set(cur)) if _label_changed(k, old, cur)]
        if changed:
            return "cache_config_info " + ", ".join(f"{k} {old.get(k, '(none)')} → {cur.get(k, '(none)')}" for k in changed)
        return None


def _label_changed(key: str, old: Mapping[str, str], cur: Mapping[str, str]) -> bool:
    """Whether ``cache_config_info`` label ``key`` tells another engine (:meth:`_Identity.changed`)."""
    if old.get(key) == cur.get(key):
        return False
    a, b = cache_config_number(old, key), cache_config_number(cur, key)
    if key in POSITIVE_LABELS and None in (a, b):  # a damaged body: unknown, not changed
        return False
    return not (key in PROFILED_LABELS and _near(a, b))


def _near(a: float | None, b: float | None) -> bool:
    """Two profiled pool sizes within PROFILED_CHANGE of each other (both known)."""
    return a is not None and b is not None and abs(b - a) <= PROFILED_CHANGE * a


@dataclass(frozen=True)
class _Pending:
    """A step waiting for the next one to vouch for it (:func:`_confirms`).

    went_back: a histogram's ``_sum`` or a bucket went down at this step (:func:`_went_back`):
        the scrape before it read high, or its own read low. doubtful: the step before this one
        went back, so this one may start at a scrape that read low (window.py skips a scrape only
        for counters and ``_count``): its increases are not trusted either.
    """

    delta: Delta
    obs: Observation
    busy: int  # engines busy in the step (_busy_in_step)
    running: int  # engines running requests at either end of it (_busy_in_step, either)
    went_back: bool
    doubtful: bool
    rates: dict[str, float]  # _rates(delta)
    suspect: bool  # over SPIKE_FACTOR times the peak on arrival: marked in its window (Windows.mark_spike)
    hits: tuple[float, float] | None  # its (Δqueried, Δhits) as read, for the 24 h rollup (observe.hit_sums)


class Analyzer:
    """Online analysis of one target (bounded memory: windows and fitters' ring buffers).

    ``ingest`` consumes snapshots in time order and returns the new step observations;
    ``analysis`` builds the current :class:`Analysis` (cached until the next ingest).
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        # default gap: two publish windows, and never less than two scrape intervals (an interval
        # longer than the window must not make every step a gap)
        gap = config.gap_seconds or 2.0 * max(config.window_seconds, config.interval)
        self.windows = Windows(config.window_seconds, gap)
        self._state: dict[str, _ModelState] = {}
        self._seen: dict[str, float] = {}  # model → time of the last snapshot that had it
        self._cache: Analysis | None = None
        # model → the fit step's fits at the latest snapshot, and the window's B_load they used
        self._fits: dict[str, tuple[ModelFits, tuple[float, str] | None]] = {}
        self._last: Snapshot | None = None
        self.last_observations: dict[str, Observation] = {}  # the latest ingest's steps
        self.last_dropped: dict[str, Observation] = {}  # steps the latest ingest kept from the fits
        self.spikes = 0  # steps kept from the fits as spikes (_spike), counted so far

    def ingest(self, snap: Snapshot, unobserved: bool = False) -> dict[str, Observation]:
        """Add one snapshot. Returns model → the step's Observation (also kept in
        ``last_observations``). ``unobserved``: scrapes failed since the previous snapshot, so its
        steps are no busy time (observe.Context).

        Raises:
            ValueError: the snapshot is not newer than the previous one (nothing changes).
        """
        self.last_observations: dict[str, Observation] = {}
        self.last_dropped: dict[str, Observation] = {}
        deltas = self.windows.push(snap)
        prev, self._last = self._last, snap
        self._cache = None
        self._fits = {}
        out: dict[str, Observation] = {}
        for model, delta in deltas.items():
            st = self._state.get(model)
            if st is None:  # not setdefault: a _ModelState is every fitter's buffers, built once per model
                st = self._state[model] = _ModelState()
            # a fleet's (engines counted by its source) is its pods' mix, which scaling and rollouts move
            identity = _Identity(len(snap.models[model].engines),
                                 {} if model in snap.engine_counts else snap.cache_config_of(model))
            if (why := st.another_engine(identity)) is not None:
                log.info("model %r is served by another engine now (%s): its fits start afresh", model, why)
                st = self._state[model] = st.afresh(identity)
            if delta.resets:
                st.chip.restarted()
            ctx = self._context(snap, model, st, unobserved)
            scale = (ctx.hit_unit, ctx.block_size if ctx.hit_unit == "blocks" else None)
            if st.hit_scale is None or st.hit_scale[0] != scale:
                st.hit_scale = (scale, None if st.hit_scale is None else delta.t1)
            obs = observe(delta, ctx)
            st.isl, st.osl = obs.isl or st.isl, obs.osl or st.osl
            share = _load_share(delta, obs.hit_ratio, obs.hit_ratio_loaded) if obs.queried_tokens else None
            if share is not None:
                st.load_share = share
            p = st.pending
            went_back = p is not None and any(_went_back(h, delta.histograms[n]) for n, h in p.delta.histograms.items()
                                              if n in delta.histograms)
            rates = _rates(delta)
            if p is not None:
                # told only by a step from the pending one's end (after a gap there is none)
                learned = _spike(p.rates, rates, st.peak) if delta.t0 == p.delta.t1 else None
                if learned is not None:
                    self.spikes += 1
                    _raise_peak(st.peak, learned)
                if p.suspect or learned is not None:
                    self.windows.mark_spike(model, p.delta.t1, learned is not None)
                if learned is None and not (p.doubtful or went_back) and _confirms(delta, p.delta):
                    _fit_step_rows(st, p)
                    _raise_peak(st.peak, p.rates)
                    # the engine's speed first: its latency, fitted under the old chip time, moved with it
                    if (size := st.chip.drift) is not None:  # its fitted steps no longer describe the engine
                        log.warning("model %r: %s: its fits start afresh%s", model, DRIFT_REASON, measured(size.text()))
                        st = self._state[model] = st.afresh(st.identity)
                        st.changed = (p.delta.t1, size)
                    elif (shift := st.latency.shift) is not None:  # the latency fit kept its newest steps only
                        st.latency.shift = None
                        log.warning("model %r: %s: the latency fit starts again from its newest steps%s", model,
                                    SHIFT_REASON, measured(shift.text()))
                        st.latency_changed = (p.delta.t1, shift)
                else:
                    self.last_dropped[model] = p.obs
            suspect = _spike(rates, {}, st.peak) is not None
            if suspect:
                self.windows.mark_spike(model, delta.t1)
            engines = _engine_count(snap, model)
            st.pending = _Pending(delta, obs, _busy_in_step(prev, snap, model, engines),
                                  _busy_in_step(prev, snap, model, engines, either=True), went_back,
                                  p is not None and p.went_back,
                                  rates, suspect, hit_sums(delta, ctx))
            out[model] = obs
        self.last_observations = out
        # A model missing from one scrape (a cut body) keeps its fit history; one gone for
        # STATE_TTL_WINDOWS publish windows is forgotten, and so are the longest gone past
        # STATE_CAP_FACTOR × max_series histories (each holds the fitters' preallocated buffers:
        # names churning every few scrapes grew RSS 0.1 → 1.1 GB within the TTL)
        for model in snap.models:
            self._seen[model] = snap.timestamp
        excess = len(self._seen) - STATE_CAP_FACTOR * self.config.max_series
        gone = sorted((t, model) for model, t in self._seen.items() if model not in snap.models)
        for k, (t, model) in enumerate(gone):
            if k < excess or snap.timestamp - t > STATE_TTL_WINDOWS * self.config.window_seconds:
                self._state.pop(model, None)
                del self._seen[model]
        return out

    def _context(self, snap: Snapshot, model: str, st: _ModelState, unobserved: bool = False) -> Context:
        sig = snap.models[model]
        return Context(hit_unit=sig.hit_unit or "tokens", block_size=cache_config_number(snap.cache_config_of(model), "block_size"),
                       unknown=sig.unknown, isl=st.isl, osl=st.osl, excludes_preempted=snap.excludes_preempted(model),
                       unobserved=unobserved)

    def analysis(self) -> Analysis:
        """The analysis at the latest snapshot (cached until the next ingest). A model whose latest
        step ends more than two intervals plus the timeout before it is left out, as the runner
        leaves out every model of a scrape that old: its scrape was skipped (exporter/window.py: a
        value went down, ``_created`` unchanged), and after an outage that step ended before it. A
        publish window that ends a step earlier, before a step in doubt, is as fresh as that step."""
        if self._cache is not None:
            return self._cache
        snap = self._last
        if snap is None:
            return Analysis(None, "unknown", "no scrape yet", {}, self.config.target_hit_ratio, self._slo())
        models, failed = {}, {}
        oldest = snap.timestamp - self.config.max_value_age
        for model in self.windows.models():
            w = self.windows.window(model)
            if w is not None and model in snap.models and self.windows.end(model) >= oldest:
                try:
                    models[model] = self._model_analysis(snap, model, w)
                except Exception as exc:  # one model's failure (a bug, an absurd input) costs no other model
                    # the type only in the message: its text may quote a label value from the body
                    log.warning("analysis of one model at %s failed: %s", snap.timestamp, type(exc).__name__,
                                exc_info=True)
                    failed[model] = type(exc).__name__
        self._cache = Analysis(snap.timestamp, snap.engine, snap.reason, models, self.config.target_hit_ratio,
                               self._slo(), failed)
        return self._cache

    def _slo(self) -> dict[str, float]:
        slo = self.config.slo
        return {k: v for k, v in (("ttft", slo.ttft_seconds), ("tpot", slo.tpot_seconds)) if v is not None}

    def fit_step(self) -> None:
        """The fit step of an analysis cycle, run after every :meth:`ingest` (exporter/runner.py):
        every model's fits (:meth:`fits`) with the inputs the analysis publishes them for, the
        publish window's mean ISL and measured B_load. So the fitters' robust refits fall on the
        same snapshots however often the analysis is read, and every published fit depends on the
        snapshots alone (fitters/online.py); :meth:`analysis` publishes the fits of this step."""
        for model in self.windows.models():
            self._window_fits(model)

    def _window_fits(self, model: str) -> tuple[ModelFits, tuple[float, str] | None] | None:
        """(fits, B_load) at the latest snapshot (cached until the next ingest): :meth:`fits` with
        the window's ISL, OSL and B_load (:func:`_bandwidth`) read from only the signals they need,
        not the whole window."""
        out = self._fits.get(model)
        snap = self._last
        if out is not None or snap is None or model not in snap.models:
            return out
        w = self.windows.window(model, counters=BANDWIDTH_COUNTERS, histograms=(ISL_HISTOGRAM, OSL_HISTOGRAM))
        if w is None:
            return None
        bandwidth = _bandwidth(w, self.config.load_bandwidth_bytes_per_second)
        ctx = self._context(snap, model, self._state[model])
        out = self._fits[model] = (self.fits(model, request_isl(w, ctx), bandwidth[0] if bandwidth else None,
                                             self._state[model].chip.busy_engines(_engine_count(snap, model)),
                                             request_osl(w, ctx)), bandwidth)
        return out

    def fits(self, model: str, isl: float | None = None, load_bandwidth: float | None = None,
             engines: float = 1.0, osl: float | None = None) -> ModelFits:
        """The online fitters' results for ``model`` now with these inputs (MODEL.md §6: robust
        refits every few new steps, exact updates in between, fitters/online.py); :meth:`fit_step`
        calls it with the publish window's ISL, OSL and B_load, and :meth:`analysis` publishes that.

        Args:
            isl, osl: the ISL and OSL [tokens] whose miss-slope bucket to return (the publish
                window's means; OSL None: the bucket of unknown OSL); ISL None or < 1: the bucket
                of the latest usable step.
            load_bandwidth: B_load [bytes/s] for the overlap fit (measured over the publish window);
                None: the configured value (None when not configured).
            engines: E, the engines busy in the chip-time fit's steps (:meth:`~fitters.chiptime.ChipTimeFitter.busy_engines`):
                the latency fit is per request, so it is given one engine's coefficients, × E
                (ChipTimeCoefficients.per_engine), and their covariance × E².
        Each fitter works only when it got new steps (or, for the latency fit, new chip-time
        coefficients or B_load) since it was last asked; otherwise its cached result is returned.
        Raises KeyError for a model without fitter state.
        """
        st = self._state[model]
        chip = st.chip.result()
        coef = st.chip.coefficients()
        bucket = (isl, osl) if isl is not None and isl >= 1 else ()
        slope = st.slope.result(*bucket)
        if coef is not None:
            bandwidth = load_bandwidth if load_bandwidth is not None else self.config.load_bandwidth_bytes_per_second
            # the latency layer is fitted under these coefficients: its errors include theirs (read
            # when its statistics are built: the chip-time fit's own are lazy between refits)
            load_aware, overlap = st.latency.result(coef.per_engine(engines), self._kv_bytes_per_token(model), bandwidth,
                                                    lambda: _prefill_covariance(chip, engines))
        else:
            load_aware = overlap = FitResult.failed(Status.INSUFFICIENT_DATA, "waiting for the chip-time fit")
        return ModelFits(chip, coef, slope, load_aware, overlap, tuple(st.slope.anomaly_times(*bucket)))

    def _kv_bytes_per_token(self, model: str) -> float | None:
        """S_kv [bytes/token] of the configured geometry stored as the latest snapshot's engine of
        ``model`` stores KV (cache_config_info cache_dtype, :meth:`~exporter.config.Geometry.element_bytes`)."""
        last = self._last
        return self.config.model.kv_bytes_per_token(None if last is None else last.cache_config_of(model).get("cache_dtype"))

    # --- assembly ------------------------------------------------------------------------

    def _model_analysis(self, snap: Snapshot, model: str, w: Delta) -> ModelAnalysis:
        cfg = self.config
        st = self._state[model]
        ctx = self._context(snap, model, st)
        unknown = dict(snap.models[model].unknown)
        if st.hit_scale is not None and st.hit_scale[1] is not None and w.t0 < st.hit_scale[1]:
            unknown.setdefault("hit_ratio", HIT_UNIT_CHANGED)
            ctx = replace(ctx, unknown={**(ctx.unknown or {}), "hit_ratio": HIT_UNIT_CHANGED})
        wobs = observe(w, ctx)
        hit = _window_hits(w, ctx, wobs, unknown)
        # predictions use the latest known means (when no request finished in the window, wobs's
        # ISL is its first tokens' or the last step's, observe.request_isl); what is published as
        # the window's means is the window's
        # own, never that fallback (MODEL.md §2: window deltas; absent = no data)
        isl, osl = wobs.isl, wobs.osl
        isl_w, osl_w = histogram_mean(w, ISL_HISTOGRAM), histogram_mean(w, OSL_HISTOGRAM)
        engines = _engine_count(snap, model)
        tpm = _observed_tpm(w, hit.get("all"), cfg.model.gpus * engines, unknown, snap.models[model].counters)
        kv = self._kv_bytes_per_token(model)
        if kv is None:
            unknown.setdefault("kv_bytes_per_token", "model geometry (model.layers, kv_heads, head_dim or "
                                                     "model.hf_config) not configured")
        mf, bandwidth = self._window_fits(model)  # the fit step's: the same window ISL and B_load
        chip, coef, slope = mf.chip_time, mf.coefficients, mf.miss_slope
        # the fit's coefficients are the engines busy in its steps as one machine; what is predicted
        # from them is the capacity at full load, all ``engines`` busy: × busy / engines (engines
        # idle in the fit's steps, a fleet scaled up since: the busy ones' read as all engines')
        busy = st.chip.busy_engines(engines)
        full = busy / engines
        coef = None if coef is None else coef.per_engine(full)
        cov = None if chip.covariance is None else tuple(tuple(full * full * c for c in row) for row in chip.covariance)
        if not chip.ok and "running" not in snap.models[model].gauges:  # the fit cannot say why it has no steps
            chip = replace(chip, reason=f"{chip.reason}: vllm:num_requests_running is absent from the latest scrape, "
                                        "so no step can be told busy")
        fits = {"chip_time": chip, "miss_slope": slope, "overlap": _overlap_identified(mf.overlap, chip),
                "load_aware": mf.load_aware}
        seed3 = _seed3(cfg, snap, model, w, st, hit, unknown, isl_w, osl_w, kv, bandwidth, coef, fits, engines)

        warnings = window_notes(w, ctx, hit, isl_w)
        _absent_means(snap, w, unknown, {"isl": isl_w, "osl": osl_w, "observed_ttft": wobs.ttft_mean})
        if note := cfg.model.dtype_note(snap.cache_config_of(model).get("cache_dtype")):
            warnings["kv_cache_dtype"] = note
        for key, why, then, changed in (
                ("engine_speed_changed", DRIFT_REASON, "the fits started afresh", st.changed),
                ("prefill_latency_changed", SHIFT_REASON, "the latency fit (α, load-aware TTFT) started again from its "
                 "newest steps", st.latency_changed)):
            if changed is not None and w.t1 - changed[0] <= CHANGED_NOTE_SECONDS:
                warnings[key] = (f"{why}: {then} (published for an hour)"
                                 + measured(f"{changed[1].text()}, {w.t1 - changed[0]:.0f} s ago"))
        if engines > 1:
            # a translated engine's counts are its data-parallel ranks summed in one exposition (engines.py)
            what = ("engines (pods x data-parallel engines) summed over the fleet's pods"
                    if model in snap.engine_counts and snap.engine not in TRANSLATED
                    else "data-parallel engines in one exposition")
            warnings["data_parallel"] = (
                f"{engines} {what}: the chip-time fit sees the busy ones' summed work per wall-clock second, so "
                f"its coefficients describe the engines busy in its steps as one machine (exact when they share "
                f"the load evenly); T_fixed, the predicted TPM, the bathtub and the capacity bound are of the "
                f"{engines} engines as one machine at full load, all busy (the coefficients x busy / {engines}), "
                f"the capacity bound and delta with {engines} x B_load (a link each); a request runs on one "
                f"engine, so the TTFTs and the overlap alpha take one engine's coefficients, the fitted ones x the "
                f"engines busy in the fit's steps; per-GPU TPM counts tp x pp x {engines} GPUs")
        out = ModelAnalysis(
            model_name=model, window_seconds=w.dt, window_steps=w.steps, hit_ratio=hit, unknown=unknown,
            warnings=warnings,
            isl=isl_w, osl=osl_w, observed_ttft=wobs.ttft_mean, tpm_observed=tpm, fits=fits,
            load_bandwidth=bandwidth, kv_bytes_per_token=kv,
            anomalies=int(slope.extra.get("anomalies", 0)), anomaly_times=mf.anomaly_times,
            miss_slope_h_range=(slope.extra["h_min"], slope.extra["h_max"]) if slope.ok else None,
            **seed3,
        )
        h_now = hit.get("all")
        steps_per_request = _steps_per_request(w)
        linear = self._linear_bathtub(slope, h_now, unknown)
        if coef is None:
            _predictions_unknown(unknown, cfg, f"needs the chip-time fit, which is {chip.status.value}: {chip.reason}",
                                 "fixed_time")
            return replace(out, bathtubs=linear, valley_form=_valley_form(None, linear))
        # a window without queries says nothing of the loaded share: the latest step's that told it
        share = st.load_share if wobs.queried_tokens == 0 else _load_share(w, hit.get("all"), hit.get("loaded"))
        fitted = self._fitted(coef, cov, steps_per_request, fits, wobs, share, kv, bandwidth, engines, busy,
                              st.chip.ranges())
        if (fits["load_aware"].ok or fits["overlap"].ok) and (
                problem := _prefill_unidentified(fitted, st.latency.extreme_points())):
            if fits["load_aware"].ok:
                why = f"c0 and c1 scale the prefill's chip time, which is {problem}"
                fits = {**fits, "load_aware": FitResult.failed(Status.NOT_IDENTIFIABLE, why, fits["load_aware"].samples)}
                fitted = replace(fitted, c0=None, c1=None)
                unknown.setdefault("contention_factor", why)
            if fits["overlap"].ok:
                why = f"α is fitted against the loaded steps' prefill chip time, which is {problem}"
                fits = {**fits, "overlap": FitResult.failed(Status.NOT_IDENTIFIABLE, why, fits["overlap"].samples)}
                fitted = replace(fitted, alpha=None, alpha_stderr=None, alpha_chip_gradient=None)
        out = replace(out, fits=fits, fitted=fitted)
        if steps_per_request is None:
            unknown.setdefault("fixed_time", STEPS_UNKNOWN)
        elif not (step := fits["chip_time"].params["t_step"]).ok:  # dropped (0), or carrying another term's time
            unknown.setdefault("fixed_time", f"T_fixed = T_step x engine steps per request, and T_step is not "
                                             f"identifiable: {step.reason}")
        # the fit stands without the window's traffic (a what-if gives its own); what is predicted
        # at the window's traffic waits for it, and says so
        traffic = {"h": h_now, "ISL": isl, "OSL": osl, "engine steps per request": steps_per_request}
        idle = [(name, keys, fallback) for name, keys, fallback in _IDLE_REASONS if traffic[name] is None]
        if idle:
            # each points at its own reason where there is one
            causes = [next((f"{name}: see {k}" for k in keys if k in unknown), f"{name}: {fallback}")
                      for name, keys, fallback in idle]
            why = (f"{', '.join(name for name, _, _ in idle)} of the publish window unknown ({'; '.join(causes)}): "
                   "no traffic to predict at; kvhit predict and /api/v1/predict answer for traffic given")
            _predictions_unknown(unknown, cfg, why)
            return replace(out, bathtubs=linear, valley_form=_valley_form(None, linear))
        # Terms the chip-time fit could not tell apart are carried by the kept ones only where a
        # request keeps the relation the data followed: a what-if elsewhere, a chip_time bathtub
        # over h in [0, 1) (a slope with an exact-looking interval) or a derived miss slope beyond
        # the observed h range would mean nothing (fitters/whatif.py unidentified_terms)
        preds = {}
        # the current point is the window's own traffic (its mean request may be no request that ran)
        totals = observed_regressors(wobs)
        for which, h, seen in (("current", h_now, None if None in totals else totals),
                               ("target", cfg.target_hit_ratio, None)):
            if h is None:
                continue
            if which == "target" and h > max_hit_ratio(isl):  # kvhit predict and /api/v1/predict refuse it too
                # (the window's own h may pass it: queries count a preempted prompt again)
                unknown.setdefault(f"predicted_{which}", _above_h_max(h, isl))
                continue
            try:  # a request whose chip time is not identifiable keeps its TTFTs where its prefill is
                p = preds[which] = fitted.predict(h, isl, osl, seen)
            except ValueError as exc:  # neither its chip time nor its TTFT (fitters/whatif.py)
                unknown.setdefault(f"predicted_{which}", str(exc))
                continue
            if "t_chip" in p.unknown:
                unknown.setdefault(f"predicted_{which}", p.unknown["t_chip"])
            if "ttft_service" in p.unknown:
                unknown.setdefault(f"predicted_ttft_{which}", p.unknown["ttft_service"])
            elif "ttft_load_aware" in p.unknown:
                unknown.setdefault(f"predicted_ttft_load_aware_{which}", p.unknown["ttft_load_aware"])
        bathtubs = dict(linear)
        derived, h_range = {}, out.miss_slope_h_range
        h_max = max_hit_ratio(isl)
        h_at = min(h_now, h_max)
        # its chip time or its slope unidentified at h_now: no R(h_now), R'(h_now) or valley test to publish
        # (a fit that told every term apart identifies every request: nothing to check)
        local = fitted.collinear and (fitted.unidentified(h_at, isl, osl) or fitted.unidentified_slope(h_at, isl))
        if h_max <= 0:  # health probes of one token: nothing to reuse, so no curve over h
            unknown.setdefault("bathtub_chip_time", "the window's mean prompt is one token (ISL 1): the last prompt "
                                                    "token is never a hit, so h can only be 0; no bathtub over h")
        elif local:
            unknown.setdefault("bathtub_chip_time", local)
        else:
            b = bathtub_chip_time(coef, cov, fitted.t_fixed, isl, osl, h_at, cfg.prices.p_miss, cfg.prices.p_hit,
                                  cfg.prices.p_out, h_max=h_max, grid=[h for h in BATHTUB_GRID if h <= h_max],
                                  fixed_steps=steps_per_request)
            bathtubs["chip_time"] = _local_bathtub(b, fitted, isl, osl, h_max, unknown) if fitted.collinear else b
        def spans(lo: object, hi: object) -> bool:  # an h range the direct fit would draw a line over
            return isinstance(lo, float) and isinstance(hi, float) and hi - lo >= st.slope.min_h_span
        lo, hi = slope.extra.get("h_min"), slope.extra.get("h_max")
        if not spans(lo, hi):
            # the current bucket's traffic has not spanned h (yet): the h range of the steps of all
            # buckets, where the workload has been (traffic whose OSL grew keeps its derived line)
            lo, hi = st.slope.h_range() or (lo, hi)
        if not spans(lo, hi) and fitted.h_range is not None:
            # nor have the miss slope's newest steps (512 per bucket, 43 min at 5 s: a daily cycle of h
            # moves less in that time, and no slope was drawn all day, a soak): the chip-time fit's, whose
            # coefficients the derived line reads, over the h its steps saw
            lo, hi = fitted.h_range
        if spans(lo, hi):
            problem = fitted.unidentified(lo, isl, osl) or fitted.unidentified(hi, isl, osl)
            if problem:
                unknown.setdefault("miss_slope_derived", problem)
            else:
                tps0_d, a_d, a_se = derived_miss_slope(coef, cov, fitted.t_fixed, isl, osl, lo, hi,
                                                       fixed_steps=steps_per_request)
                derived = {"tps0": Estimate(tps0_d), "a": Estimate(a_d, a_se)}
                h_range = (lo, hi)
        else:  # drawn over the direct line's h range, else that of the steps of every bucket
            unknown.setdefault("miss_slope_derived", "no h range to draw it over: the direct miss slope's busy steps "
                                                     "(of the current ISL and OSL bucket, or of all) and the chip-time "
                                                     "fit's are too few or span less than its minimum h span"
                               + (measured(f"h {lo:.3f} to {hi:.3f}") if isinstance(lo, float) and
                                  isinstance(hi, float) else ""))
        factor = None
        if fitted.c0 is not None and fitted.c1 is not None and fitted.running is not None:
            # c is prefill latency over the prefill's chip time: unknown where that chip time is
            problem = fitted.unidentified_prefill(h_now, isl)
            if problem:
                unknown.setdefault("contention_factor", problem)
            else:
                factor = contention(fitted.c0, fitted.c1, fitted.running)
        elif fitted.c0 is not None and fitted.c1 is not None:
            unknown.setdefault("contention_factor", "no num_requests_running in the publish window to evaluate "
                                                    "c0 + c1·running at")
        else:
            la = fits["load_aware"]
            unknown.setdefault("contention_factor", f"the load-aware fit (c0, c1) is {la.status.value}: {la.reason}")
        tpm_target = _tpm_target(out.tpm_observed, preds, cfg.target_hit_ratio, isl, osl, cfg.model.gpus * engines,
                                 unknown)
        return replace(out, predictions=preds, tpm_target=tpm_target,
                       bathtubs=bathtubs, miss_slope_derived=derived, miss_slope_h_range=h_range,
                       valley_form=_valley_form(chip, bathtubs), contention=factor,
                       warnings={**out.warnings, **_load_aware_note(preds.get("current"), wobs.ttft_mean),
                                 **_load_bound_note(preds, fitted, tpm_target.get(("delivered", "instance")),
                                                    cfg.target_hit_ratio, isl, osl,
                                                    getattr(bathtubs.get("chip_time"), "h_even", None)),
                                 **_bathtub_extrapolated(bathtubs.get("chip_time"), fitted.h_range, h_max)})

    def _linear_bathtub(self, slope: FitResult, h_now: float | None, unknown: dict[str, str]) -> dict[str, BathtubCurve]:
        """The seed's linear bathtub of the direct slope; its h*, h_even (and exit) and curve
        points only inside the h range the slope was fitted on (a secant says nothing beyond it: on
        the simulator's sweep a line over h 0-0.25 put h* at 0.62 and h_even at 0.86, 0.83 and 0.97
        over 0-0.99), else absent with why in ``unknown``; h_even and the exit, which compare with
        R(0), only when that range starts at h = 0 (within H_RESOLUTION)."""
        tps0, a = slope.value("tps0"), slope.value("a")
        if tps0 is None or a is None or h_now is None or h_now >= 1:
            return {}
        p = self.config.prices
        b = bathtub_linear(tps0, a, slope.covariance, h_now, p.p_miss, p.hit_price_ratio, grid=BATHTUB_GRID)
        lo, hi = slope.extra.get("h_min"), slope.extra.get("h_max")
        beyond: dict[str, object] = {"curve": tuple((h, r) for h, r in b.curve if lo <= h <= hi)}
        rho = p.hit_price_ratio
        if a > rho and b.h_star is None:  # a valley (R'(0) < 0) outside the closed form's ρ < a < 1
            unknown.setdefault("valley_bottom_linear", (
                "the direct slope a >= 1: the seed's line TPS0*(1 - a*h) reaches zero miss throughput at h = 1/a, "
                "so R(h) falls all the way there and has no bottom" if a >= 1 else
                "hits are free (hit_price_ratio 0): R(h) = TPS0*P_miss*(1 - a*h) falls all the way to h = 1, "
                "no bottom before it") + measured(f"a {a:.3f}, rho {rho:g}"))
        for key, signal, h in (("h_star", "valley_bottom_linear", b.h_star),
                               ("h_even", "valley_breakeven_linear", b.h_even)):
            if h is not None and not lo <= h <= hi:
                unknown.setdefault(signal, "beyond the h range the direct miss slope was fitted on: its line says "
                                           "nothing there" + measured(f"h {h:.3f} outside [{lo:.3f}, {hi:.3f}]"))
                beyond[key] = beyond[f"{key}_stderr"] = None
        if lo > H_RESOLUTION:  # h_even and the exit compare with R(0): agentic traffic (h 0.85-0.99) put
            # an h_even and an exit where R' > 0 all along (SRE breaker)
            for signal in ("valley_breakeven_linear", "valley_exit_linear"):
                unknown.setdefault(signal, "they compare with R(0), at h = 0, below the h range the direct miss slope "
                                           "was fitted on: its line says nothing there" + measured(f"h range [{lo:.3f}, {hi:.3f}]"))
            beyond.update(h_even=None, h_even_stderr=None, exit=None)
        elif "h_even" in beyond:  # whether R climbs back to R(0) is read at h_even (a review saw exit 1 without it)
            unknown.setdefault("valley_exit_linear", unknown["valley_breakeven_linear"])
            beyond["exit"] = None
        elif b.exit is False and hi < 1.0:  # "no exit" (a ≥ 1 or ρ = 0) reads the line up to h = 1
            unknown.setdefault("valley_exit_linear", "beyond the h range the direct miss slope was fitted on: "
                                                     "whether R climbs back to R(0) is read up to h = 1"
                               + measured(f"h range [{lo:.3f}, {hi:.3f}]"))
            beyond["exit"] = None
        return {"linear": replace(b, **beyond)}

    def _fitted(self, coef: ChipTimeCoefficients, cov: tuple[tuple[float, ...], ...] | None,
                steps_per_request: float | None, fits: dict[str, FitResult], wobs: Observation,
                load_share: float | None, kv: float | None, bandwidth: tuple[float, str] | None,
                engines: int, busy: float,
                ranges: tuple[tuple[float, float] | None, tuple[float, float], tuple[float, float]] | None
                ) -> FittedModel:
        cfg = self.config
        la, chip = fits["load_aware"], fits["chip_time"]
        running = wobs.running
        h_range, isl_range, osl_range = (None if r is None else list(r) for r in ranges or (None,) * 3)
        alpha = fits["overlap"].value("alpha")
        alpha_se = getattr(fits["overlap"].params.get("alpha"), "stderr", math.nan)
        return FittedModel(
            *coef.as_tuple(), steps_per_request=steps_per_request,
            c0=la.value("c0"), c1=la.value("c1") if la.value("c1") is not None else (0.0 if la.ok else None),
            running=running, queue_time=wobs.queue_time_mean, alpha=alpha,
            alpha_stderr=alpha_se if alpha is not None and math.isfinite(alpha_se) else None,
            alpha_chip_gradient=fits["overlap"].extra.get("alpha_chip_gradient") if alpha is not None else None,
            hit_load_share=load_share,
            kv_bytes_per_token=kv, load_bandwidth=bandwidth[0] if bandwidth else None,
            gpus=cfg.model.gpus * engines, engines=engines, busy_engines=busy, p_miss=cfg.prices.p_miss,
            p_hit=cfg.prices.p_hit,
            p_out=cfg.prices.p_out,
            collinear=chip.extra.get("collinear"),
            chip_covariance=[list(row) for row in cov] if cov else None,
            h_range=h_range, isl_range=isl_range, osl_range=osl_range)


def _above_h_max(h: float, isl: float) -> str:
    """Why a prediction at hit ratio ``h`` above h_max = 1 − 1/ISL is withheld (fitters/model.py)."""
    return (f"h {h:g} is above 1 - 1/ISL = {max_hit_ratio(isl):.6g} at the window's mean ISL {isl:.0f}: the last "
            "prompt token is always computed")


def _local_bathtub(b: BathtubCurve, fitted: FittedModel, isl: float, osl: float, h_max: float,
                   unknown: dict[str, str]) -> BathtubCurve:
    """The chip-time bathtub ``b`` of a fit that could not tell some terms apart (its chip time and
    its slope identified at h_now: R(h_now), R'(h_now) with its interval and valley_active stand,
    MODEL.md §4's test is local) with only what the fit identifies elsewhere, the rest withheld with
    why in ``unknown``: curve points where the chip time is identified; h* where it and its slope
    are (and "no valley" only where R'(0) is); R(0) where h = 0 is; h_even and the exit, which
    compare with R(0), only then, h_even where its chip time is, "no exit" (R below R(0) up to
    h_max) where h_max's is. Agentic traffic (h 0.85-0.99) had its whole bathtub withheld and the
    valley follow the linear form, whose line through the curve's steep end put a bottom at h 0.94
    where R still fell (R' of the wrong sign, no page); traffic at h ≈ 0 passed a check at h = 0
    and h_max alone, and its curve at h 0.5 (24 % off) was published as good."""
    def unidentified(h: float) -> str | None:
        return fitted.unidentified(h, isl, osl)

    h_star = b.h_star
    problem = ((unidentified(h_star) or fitted.unidentified_slope(h_star, isl)) if h_star is not None
               else unidentified(0.0) or fitted.unidentified_slope(0.0, isl))  # none found rests on R'(0) ≥ 0
    if problem:
        unknown.setdefault("valley_bottom_chip_time", problem)
        h_star = None
    at_zero = unidentified(0.0)
    h_even, exit_ = b.h_even, b.exit
    if at_zero:
        problem = "they compare with R(0), at h = 0, where the chip time is " + at_zero
    elif exit_ is False:
        problem = unidentified(h_max)  # no exit: R below R(0) all the way to h_max
    else:
        problem = h_even is not None and unidentified(h_even)
    if problem:
        for signal in ("valley_breakeven_chip_time", "valley_exit_chip_time"):
            unknown.setdefault(signal, problem)
        h_even, exit_ = None, None
    return replace(b, h_star=h_star, h_star_stderr=b.h_star_stderr if h_star is not None else None, h_even=h_even,
                   h_even_stderr=b.h_even_stderr if h_even is not None else None, exit=exit_,
                   revenue_zero=math.nan if at_zero else b.revenue_zero,
                   curve=tuple((h, r) for h, r in b.curve if unidentified(h) is None))


def _bathtub_extrapolated(b: BathtubCurve | None, h_range: list[float] | None, h_max: float) -> dict[str, str]:
    """{"bathtub_extrapolated": why} when the chip-time bathtub's h* or h_even lies beyond the h
    of its fit's steps (``h_range``), or its "no exit" (R below R(0) up to ``h_max``) is read more
    than one chip-time cell (CELL_H) beyond them, else {}: there it reads coefficients
    extrapolated in h, an error their standard errors do not count (MODEL.md §7). A bottom at the
    wall (h_max: R still falls there) is where h ends, no point located. Published, not withheld:
    the chip-time form is §7's physics, and where the valley lies ahead of the traffic is what it
    is for."""
    if b is None or h_range is None:
        return {}
    lo, hi = h_range
    # (what the label names, the h it reads at): the numbers move every scrape, so they go in measured()
    beyond = [(name, name, h) for name, h in (("h*", None if b.h_star == h_max else b.h_star), ("h_even", b.h_even))
              if h is not None and not lo <= h <= hi]
    if b.exit is False and hi < h_max - CELL_H:
        beyond.append(("no exit (R below R(0) up to h_max)", "h_max", h_max))
    if not beyond:
        return {}
    return {"bathtub_extrapolated": f"the chip-time bathtub reads {', '.join(name for name, _, _ in beyond)} beyond the h "
                                    "its fit's steps saw: coefficients extrapolated in h, whose standard errors do not "
                                    "count that (on the bundled CPU trace a fit over h <= 0.3 put h* at 0.33 for the 0.53 "
                                    "it read once its sweep reached h 0.97); traffic at those h tells"
                                    + measured(", ".join(f"{at} {h:.4g}" for _, at, h in beyond)
                                               + f"; its steps' h [{lo:.3f}, {hi:.3f}]")}


def _valley_form(chip: FitResult | None, bathtubs: dict[str, BathtubCurve]) -> str | None:
    """MODEL.md §4: the valley alert follows chip_time when its fit is ok (and its bathtub was
    published: not withheld as unidentifiable at h_now, :func:`_local_bathtub`), else linear."""
    if chip is not None and chip.ok and "chip_time" in bathtubs:
        return "chip_time"
    return "linear" if "linear" in bathtubs else None


# the window's traffic a prediction needs (Analyzer, ``traffic``), in the order a reason names it →
# the unknown signals that say why it is unknown, and why otherwise
_IDLE_REASONS = (("h", ("hit_ratio", "hit_ratio_loaded"), "no prefix-cache query"),
                 ("ISL", ("isl",), "no request finished in it"), ("OSL", ("osl",), "no request finished in it"),
                 ("engine steps per request", ("fixed_time",), "no request finished in it"))


def _window_hits(w: Delta, ctx: Context, wobs: Observation, unknown: dict[str, str]) -> dict[str, float]:
    """{"device", "loaded", "all"} → the window's h (``wobs``: ``observe(w, ctx)``), each only when
    known; why not goes into ``unknown["hit_ratio"]`` (MODEL.md §1, §2)."""
    q = wobs.queried_tokens
    out: dict[str, float] = {}
    problem = hit_problem(w, ctx)
    if problem:
        unknown.setdefault("hit_ratio", problem)
        return out
    if ctx.hit_unit == "blocks" and ctx.block_size is None:
        unknown.setdefault("hit_ratio", "prefix_cache_queries/hits count KV blocks (vLLM 0.7-0.8) and no cache_config_info "
                                        "gives block_size: the tokens they stand for cannot be counted")
        return out
    why = _counts_off(w)
    if why:
        unknown.setdefault("hit_ratio", why)
        return out
    if "hit_ratio" not in unknown and not {"queries", "hits"} <= set(w.counters):
        unknown["hit_ratio"] = f"prefix_cache_queries/hits {MISSING_IN_WINDOW}"
        return out
    if q is None or q <= 0:
        if q is not None:
            unknown.setdefault("hit_ratio", "no prefix-cache queries in the publish window (no data, not 0 %)")
        return out
    if "external_hits" in w.partial:
        unknown.setdefault("hit_ratio_loaded", "external_prefix_cache_hits missing at a scrape inside the publish window "
                                               f"({DROPPED}; or cut from a body): the loaded hits are "
                                               "unknown until that scrape leaves the window")
    for key, h in (("device", wobs.hit_ratio_device), ("loaded", wobs.hit_ratio_loaded), ("all", wobs.hit_ratio)):
        if h is not None:
            out[key] = h
    if "all" not in out and "hit_ratio_loaded" in unknown:  # the device's h alone is no h to predict at
        unknown["hit_ratio_loaded"] += "; h over all sources (source=\"all\") and what is predicted at it are unknown too"
    return out


def _no_increases(w: Delta) -> str | None:
    """Why a step inside the publish window ``w`` has no increases at all, so that every sum over
    the window is unknown (window.step_delta); None when every step has them."""
    if w.foreign:
        return ("scrapes from two processes inside the publish window (_created moved to before the previous "
                "scrape: does the target URL reach several pods?): unknown until that step leaves the window")
    if w.glitches:
        return ("a counter went down inside the publish window while its _created stamps did not all change (a "
                "glitched scrape, not a restart): unknown until that step leaves the window")
    if w.rescaled:
        return ("the model's data-parallel engines changed inside the publish window (an engine label appeared or "
                "went: DP scaled, or one body lacked an engine): no increases across that step, unknown until it "
                "leaves the window")
    return None


def _counts_off(w: Delta) -> str | None:
    """Why the token counts over the publish window ``w`` cannot be trusted (a spike, a step
    without increases), None when they can."""
    return SPIKE_IN_WINDOW if w.spikes else _no_increases(w)


def _observed_tpm(w: Delta, h_all: float | None, gpus: int, unknown: dict[str, str],
                  latest: Mapping[str, float]) -> dict[tuple[str, str], float]:
    """Observed TPM over the window (MODEL.md §3.4 basis="observed"); why it, or physical TPM, is
    not known goes into ``unknown["tpm_observed"]``, ``unknown["tpm_observed_physical"]``
    (``latest``: the latest scrape's counters, which tell a family gone from one it lacks)."""
    prompt, gen = w.counters.get("prompt_tokens"), w.counters.get("generation_tokens")
    why = _counts_off(w)
    if why:
        unknown.setdefault("tpm_observed", why)
        return {}
    if prompt is None or gen is None:  # a breaker (fleet mode, two restarts in a poll): absent without a word
        missing = [name for name, v in (("prompt_tokens", prompt), ("generation_tokens", gen)) if v is None]
        gone = [name for name in missing if name not in latest]  # "until it leaves the window" would wait for nothing
        unknown.setdefault("tpm_observed", f"{' and '.join(gone)} {ABSENT_NOW}" if gone else
                           f"{' and '.join(missing)} {MISSING_IN_WINDOW}")
        return {}
    if w.dt <= 0:
        return {}
    out = {("delivered", "instance"): (prompt + gen) * 60.0 / w.dt}
    # Miss prompt tokens counted where prompt_tokens is (at prefill completion), so physical ≤
    # delivered: prompt_tokens_by_source{local_compute} (0.16+), else prompt·(1-h) of the window
    # (prefix_cache_* count at scheduling and can run ahead of prompt_tokens in short windows);
    # no prompt token in the window: none computed, whatever h
    miss = w.counters.get("prompt_local_compute")
    if miss is None and (h_all is not None or prompt == 0):
        miss = prompt * (1.0 - (h_all or 0.0))
    if miss is not None:
        out[("physical", "instance")] = (miss + gen) * 60.0 / w.dt
    else:
        unknown.setdefault("tpm_observed_physical", "the publish window's hit ratio is unknown and this vLLM exports no "
                                                    "prompt_tokens_by_source{source=\"local_compute\"} (0.16+): its "
                                                    "computed prompt tokens are unknown")
    return _with_per_gpu(out, gpus)


def _with_per_gpu(tpm: dict[tuple[str, str], float], gpus: int) -> dict[tuple[str, str], float]:
    """``tpm`` ((kind, "instance") → tokens/min) with each kind's (kind, "gpu") = per instance / ``gpus``."""
    for kind in ("delivered", "physical"):
        if (kind, "instance") in tpm:
            tpm[(kind, "gpu")] = tpm[(kind, "instance")] / gpus
    return tpm


def _tpm_target(observed: Mapping[tuple[str, str], float], preds: Mapping[str, Prediction], target_h: float | None,
                isl: float, osl: float, gpus: int, unknown: dict[str, str]) -> dict[tuple[str, str], float]:
    """The observed delivered TPM carried to the target hit ratio (MODEL.md §3.5, seed 000 §8):
    × C(h)/C(target), C = P + D the chip time per request of the window's mean request (ISL, OSL)
    at each h; physical = delivered × (ISL·(1 − target) + OSL)/(ISL + OSL). Keys as
    ``tpm_observed``; {} with why in ``unknown["tpm_target"]`` when an input is unknown (no
    ``target_h`` configured: {} alone)."""
    if target_h is None:
        return {}
    now, target, measured_tpm = preds.get("current"), preds.get("target"), observed.get(("delivered", "instance"))
    c_now, c_target = (None if p is None else p.t_chip for p in (now, target))
    if c_now is None or c_target is None or measured_tpm is None:
        missing = [what for what, absent in (("the observed delivered TPM", measured_tpm is None),
                                             ("the chip time per request at the current h", c_now is None),
                                             ("the chip time per request at the target h", c_target is None)) if absent]
        unknown.setdefault("tpm_target", f"needs {' and '.join(missing)} (see tpm_observed, predicted_current, "
                                         "predicted_target)")
        return {}
    delivered, physical = tpm_hit_correction(measured_tpm, c_now, c_target, isl, osl, target.hit_ratio)
    return _with_per_gpu({("delivered", "instance"): delivered, ("physical", "instance"): physical}, gpus)


def _load_share(w: Delta, h_all: float | None, h_load: float | None) -> float | None:
    """h_load/h of the publish window [1], what a what-if at another h assumes; None when unknown:
    h_load unknown, or no hit in the window while a connector was asked for some (0/0: external
    prefix-cache queries in the window; without that counter, external hits counted at all). 0
    with no hit and no connector asked (MODEL.md §2: h_load is then known to be 0; vLLM 0.32
    exports external_prefix_cache_* at 0 without a connector)."""
    if h_all is None or h_load is None:
        return None
    if h_all > 0:
        return h_load / h_all
    if "external_queries" in w.counters:
        return None if w.counters["external_queries"] > 0 else 0.0
    return None if "external_hits" in w.counters else 0.0


def _steps_per_request(w: Delta) -> float | None:
    """Engine steps per finished request over the window (T_fixed share, MODEL.md §7); None when
    unknown, also when requests finished in no counted step (a request's share is > 0)."""
    steps, done = w.histograms.get("iteration_tokens"), w.histograms.get("prefill_time")
    if steps is None or done is None or done.count <= 0 or steps.count <= 0:
        return None
    return steps.count / done.count


def _bandwidth(w: Delta, configured: float | None) -> tuple[float, str] | None:
    """B_load: measured from vLLM's KV-offload load counters when exported, else configured (§3.2)."""
    b, s = (w.counters.get(name) for name in BANDWIDTH_COUNTERS)
    if b and s and b > 0 and s > 0 and math.isfinite(b / s):
        return b / s, "measured"
    return (configured, "configured") if configured else None



# The terms of a prefill step's time P = T_step + T_compute, which α is fitted against (MODEL.md §3.2, §7).
PREFILL_TERMS = ("t_step", "k_ffn", "k_attn")
_PREFILL_INDEX = tuple(CHIP_TIME_TERMS.index(t) for t in PREFILL_TERMS)  # in the chip-time fit's covariance


# Relative miss of the load-aware TTFT on the window's own traffic beyond which it is flagged.
LOAD_AWARE_TOLERANCE = 0.25


def _load_aware_note(current: Prediction | None, observed: float | None) -> dict[str, str]:
    """{"load_aware_off": why} when the load-aware TTFT predicted for the publish window's own
    traffic misses the window's observed mean TTFT by more than LOAD_AWARE_TOLERANCE, else {}:
    the fit may be ok and still not describe this engine's latency (on real vLLM it read 28-69 %
    low: README, "Calibrate")."""
    pred = None if current is None else current.ttft_load_aware
    if pred is None or not observed or abs(pred / observed - 1) <= LOAD_AWARE_TOLERANCE:
        return {}
    return {"load_aware_off": f"the load-aware TTFT predicted for the window's own traffic is more than "
                              f"{LOAD_AWARE_TOLERANCE:.0%} off its observed mean TTFT: queue time + c(running) x "
                              "prefill chip time + visible load does not hold this engine's TTFT (what else it spends: "
                              "README, Calibrate); read the load-aware TTFTs as a trend"
                              + measured(f"{pred:.3g} s predicted, {observed:.3g} s observed, {pred / observed - 1:+.0%}")}


def _load_bound_note(preds: Mapping[str, Prediction], fitted: FittedModel, target_tpm: float | None,
                     target_h: float | None, isl: float | None, osl: float | None,
                     h_even: float | None = None) -> dict[str, str]:
    """{"kv_load_bound": why} when a TPM's prompt-token rate exceeds what the KV-load link can feed
    at its h (:meth:`FittedModel.link_feed`, :func:`~fitters.whatif.link_excess`), else {}: the
    chip-time capacity at the current or target point (MODEL.md §3.4, ``preds``) or at the chip-time
    bathtub's break-even ``h_even`` (its R(h_even) = R(0) reads that capacity: past the link, the
    valley may have no exit), or the observed TPM carried to the target ``target_h`` (§3.5,
    ``target_tpm`` [tokens/min] of requests of ``isl``, ``osl``). Chip time cannot see an
    asynchronous load, so a TPM past the link's B_load/(S_kv·h_load) is throughput the engine
    cannot deliver (the numbers auditor's find: 1.65× at h 0.98, half the hits loaded). Θ's compute
    term is no physical limit of a mixed workload's means, so it is not checked (diff review)."""
    points = [(f"predicted at the {which} h {p.hit_ratio:.3g}", p.tpm_delivered, p.isl, p.osl, p.hit_ratio)
              for which, p in preds.items()]
    if isl and osl is not None:
        if target_h is not None:
            points.append(("carried to the target h", target_tpm, isl, osl, target_h))
        if h_even is not None and fitted.t_fixed is not None:
            t_chip = fitted.coefficients.t_chip(isl, osl, h_even, fitted.t_fixed)
            points.append((f"the chip-time bathtub's break-even h_even {h_even:.3g}", tpm_delivered(isl, osl, t_chip),
                           isl, osl, h_even))
    over = [f"{what}: {excess}" for what, tpm, n, out, h in points
            if (excess := link_excess(tpm, n, out, fitted.link_feed(h)))]
    if not over:
        return {}
    return {"kv_load_bound": "a TPM exceeds what the KV-load link can feed, B_load x E / (S_kv x h_load) (the load term "
                             "of kvhit_capacity_bound_tokens_per_second): chip time cannot see an asynchronous load, "
                             "so the link limits throughput there, and the TPMs and the chip-time bathtub from that "
                             "h up read high (or B_load or S_kv is set wrong: kvhit_load_bandwidth_bytes_per_second, "
                             "kvhit_kv_bytes_per_token)" + measured("; ".join(over))}


def _prefill_covariance(chip: FitResult, engines: float) -> tuple[tuple[float, ...], ...] | None:
    """The covariance of one engine's (t_step, k_ffn, k_attn), 3×3 — the chip-time fit's × E²
    (ChipTimeCoefficients.per_engine) — or None when it has none."""
    cov = chip.covariance
    e2 = engines * engines
    return None if cov is None else tuple(tuple(e2 * cov[i][j] for j in _PREFILL_INDEX) for i in _PREFILL_INDEX)


def _predictions_unknown(unknown: dict[str, str], cfg: Config, why: str, *more: str) -> None:
    """``why`` for every value predicted from the chip-time fit at the window's traffic (and ``more``)."""
    for signal in ("predicted_current", "bathtub_chip_time", "miss_slope_derived", "contention_factor", *more) + (
            ("predicted_target", "tpm_target") if cfg.target_hit_ratio is not None else ()):
        unknown.setdefault(signal, why)


def _prefill_unidentified(fitted: FittedModel, points: tuple[tuple[float, float], ...]) -> str | None:
    """Why the prefill's chip time is not identified at some edge of the traffic the latency fit is
    on (``points``: (h, ISL), :meth:`~fitters.latency.LatencyFitter.extreme_points`;
    :meth:`~fitters.whatif.FittedModel.unidentified_prefill`), or None. The latency fit's c0, c1
    (c = prefill latency / that chip time) and α (the loaded steps' overlap against it) then take up
    the error: on the simulator's sweep c0 0.65 ± 0.05 and c1 0.028 ± 0.003 for a true 1.0 and 0.05
    while its first phase (h = 0) could not tell a prefill's work from decode's (MODEL.md §7); at a
    constant concurrency, where decode tokens grow exactly with engine steps and t_step carries
    k_dec, α 0.87 ± 0.015 for a true 0.5 (review)."""
    for h, isl in points:
        if problem := fitted.unidentified_prefill(h, isl):
            return problem
    return None


def _overlap_identified(overlap: FitResult, chip: FitResult) -> FitResult:
    """α as fitted, or not identifiable while the chip-time fit has dropped a prefill term (its
    extra "collinear"): the loaded steps' T_compute, which α's overlap term min(T_load, T_compute)
    reads from the chip-time coefficients, is then not identified at their h (MODEL.md §6), and α
    takes up the error (on the simulator's sweep: α 0.08 and 0.12 for a true 0.5 while attention
    was not yet told apart from miss tokens)."""
    dropped = [t for t in PREFILL_TERMS if t in ((chip.extra or {}).get("collinear") or {})]
    if not overlap.ok or not dropped:
        return overlap
    words = ", ".join(CHIP_TIME_REGRESSOR_WORDS[t] for t in dropped)
    return FitResult.failed(Status.NOT_IDENTIFIABLE, f"α is fitted against the loaded steps' prefill time, and the "
                            f"chip-time fit cannot yet tell {words} apart from its other terms", overlap.samples)


# --- seed 003 and sizing: cost, caching verdict, KV sizing, max-num-seqs, first-order Θ ----------


_TPOT_SOURCES = {"request": "request_tpot", "itl": "itl"}  # source → its canonical histogram, preferred first


def _tpot_histogram(d: Delta):
    """(TPOT histogram delta, source): per-request TPOT (vLLM ≥ 0.11) else inter-token latency."""
    return next(((d.histograms[name], source) for source, name in _TPOT_SOURCES.items() if name in d.histograms),
                (None, None))


def _busy_in_step(prev: Snapshot | None, snap: Snapshot, model: str, engines: int,
                  either: bool = False) -> int:
    """Engines of ``model`` running requests at both ends of the step from ``prev`` to ``snap``
    (MODEL.md §7's busy step, per engine), or at ``either`` end (the engines a step's mean
    running requests are on), at least 1: fleet mode's as the source told (at every sample of the
    range; ``either``: at some sample); ``engines`` (all of them) when nothing tells them apart
    (fleet mode's sums without a count of them, one engine)."""
    if model in snap.engine_counts:
        told = snap.active_counts if either else snap.busy_counts
        return max(1, min(engines, told.get(model, engines)))
    now = snap.models[model].engines
    before = {} if prev is None or model not in prev.models else prev.models[model].engines
    if len(now) < 2:
        return engines
    ends = any if either else all
    busy = sum(1 for e, sig in now.items()
               if ends((sig.gauges.get("running", 0.0) > 0, e in before and before[e].gauges.get("running", 0.0) > 0)))
    return max(1, busy)


def _engine_count(snap: Snapshot, model: str) -> int:
    """Data-parallel engines ``model``'s signals sum: as the source told (fleet mode: pods ×
    engines), else in one exposition (vLLM's ``engine`` label, SGLang's ``dp_rank``; those with at
    least half as many families as the engine with the most: parse's _Models.settle); 1 for
    signals built by hand."""
    return snap.engine_counts.get(model) or max(1, len(snap.models[model].engines))


def _confirms(d: Delta, pending: Delta) -> bool:
    """Whether step ``d`` vouches for the step before it, its histograms' sums and buckets aside
    (:func:`_went_back`, checked by the caller): it starts at that step's end scrape (none lost in
    between: a gap, a body without the model), compares every counter and histogram that step
    increased, and none of them went back (a glitch: that scrape read high), restarted or came
    from another process. Otherwise the step before is not fitted (a good step lost now and then
    costs nothing; a high read fitted bends every fit for hours)."""
    return (d.t0 == pending.t1 and not (d.glitches or d.foreign or d.resets)
            and pending.counters.keys() <= d.counters.keys() and pending.histograms.keys() <= d.histograms.keys())


def _went_back(before: HistogramDelta, after: HistogramDelta) -> bool:
    """Whether a histogram's ``_sum`` or a bucket went down (or a bucket went missing) at the step
    ``after`` while the step ``before`` had them (exporter/window.py makes that step's Δsum NaN,
    drops its buckets or keeps only the edges both scrapes share): ``_count`` alone tells no
    glitch of the sum or the buckets."""
    return ((math.isfinite(before.sum) and not math.isfinite(after.sum))
            or (before.edges is not after.edges and not set(before.edges) <= set(after.edges)))  # `is`: the plan's one tuple


def _rates(d: Delta) -> dict[str, float]:
    """Increase per second over step ``d`` of each SPIKE_COUNTERS counter it has (rare counters
    such as preemptions burst for real; so does one long queue time in queue_time's sum)."""
    return {name: d.counters[name] / d.dt for name in SPIKE_COUNTERS if name in d.counters} if d.dt > 0 else {}


def _spike(pending: Mapping[str, float], after: Mapping[str, float],
           peak: Mapping[str, float]) -> dict[str, float] | None:
    """None unless a rate of the pending step is SPIKE_FACTOR times its reference, the higher of
    the step after it and the model's peak (a counter with neither above 0 has none); then the
    pending step's rates capped at SPIKE_LEARN times their reference, what the peak learns."""
    learned, spiked = {}, False
    for name, rate in pending.items():
        ref = max(after.get(name, 0.0), peak.get(name, 0.0))
        spiked = spiked or (ref > 0 and rate > SPIKE_FACTOR * ref)
        learned[name] = min(rate, SPIKE_LEARN * ref) if ref > 0 else rate
    return learned if spiked else None


def _raise_peak(peak: dict[str, float], rates: Mapping[str, float]) -> None:
    """Raise the model's peaks to these rates where they are higher."""
    for name, rate in rates.items():
        if rate > peak.get(name, 0.0):
            peak[name] = rate


def _fit_step_rows(st: _ModelState, p: _Pending) -> None:
    """Feed one step to every fitter of the model (one scrape after it was taken: ``pending``)."""
    st.chip.update(p.obs, p.busy)
    st.slope.update(p.obs)
    st.latency.update(p.obs)
    _update_seed3(st, p.delta, p.obs, p.running, p.hits)


def _update_seed3(st: _ModelState, d: Delta, obs: Observation, engines: int, hits: tuple[float, float] | None) -> None:
    """Feed one step to the 24 h hit rollup (``hits``: its (Δqueried, Δhits) as read, or None)
    and the TPOT-vs-concurrency fitter (MODEL.md §5);
    the fitter's concurrency is per engine (``--max-num-seqs`` is): each data-parallel engine's
    TPOTs at its own mean running (:attr:`Delta.engine_steps`), else the step's at running /
    ``engines``, those running requests at either end of the step (an idle one decodes none)."""
    pre, dec = d.histograms.get("prefill_time"), d.histograms.get("decode_time")
    both = pre is not None and dec is not None
    queried, hit = (obs.queried_tokens, None) if hits is None else hits
    st.rollup.update(d.t0, d.t1, queried, hit, (pre.sum, pre.count) if both else None,
                     (dec.sum, dec.count) if both else None, d.end.get("kv_usage"))
    tpot, source = _tpot_histogram(d)
    if tpot is None or tpot.problem == SUM_DISAGREES or obs.anomaly_hint:  # buckets _sum refutes: no P95
        return
    # data-parallel engines: each one's TPOTs at its own concurrency (merged, the busier engine's
    # TPOTs read at the mean level: 18 for 26 on two uneven engines, review)
    parts = [(e.running, e.histograms[_TPOT_SOURCES[source]]) for e in d.engine_steps]
    if not parts or any(r is None or h.problem == SUM_DISAGREES for r, h in parts):
        parts = [(None if obs.running is None else obs.running / engines, tpot)]
    if any([st.tpot.update(obs.t, running, h.buckets, h.count) for running, h in parts]):
        st.tpot_source = source


# Histogram behind each published window mean: signal → (canonical histogram, what a zero Δcount means).
_MEANS = {
    "isl": (ISL_HISTOGRAM, "no request finished"),
    "osl": (OSL_HISTOGRAM, "no request finished"),
    "observed_ttft": ("ttft", "no first token"),
}


def _absent_means(snap: Snapshot, w: Delta, unknown: dict[str, str], published: dict[str, float | None]) -> None:
    """Adds to ``unknown`` why each window mean in ``published`` that is None (isl, osl,
    observed_ttft) is absent, naming the histogram as ``snap``'s engine exposes it (issue 7)."""
    no_increases = _no_increases(w)  # a step without increases: every histogram is absent from w
    for signal, (canon, none) in _MEANS.items():
        if signal in published and published[signal] is None:
            hd = w.histograms.get(canon)
            unknown.setdefault(signal, f"{none} in the publish window (no data, not 0)" if hd is not None and hd.count <= 0
                               else no_increases if hd is None and no_increases
                               else missing_histogram(snap.engine, snap.name_prefix, HISTOGRAMS[canon],
                                                      "no complete {} histogram at both ends of the publish window"
                                                      if hd is None else "{}: " + hd.problem + " in the publish window"))


def _seed3(cfg: Config, snap: Snapshot, model: str, w: Delta, st: _ModelState, hit: dict[str, float],
           unknown: dict[str, str], isl: float | None, osl: float | None, kv: float | None,
           bandwidth: tuple[float, str] | None, coef: ChipTimeCoefficients | None,
           fits: dict[str, FitResult], engines: int) -> dict:
    """The ModelAnalysis fields of MODEL.md §3.3, §3.6 and §5; reasons go to ``unknown`` and the
    max-num-seqs fit to ``fits``; ``engines``: the data-parallel engines the signals sum
    (:func:`_engine_count`). Choices are documented in fitters/cost.py, caching.py, sizing.py."""
    out: dict = {}
    # P95 and SLO pass-rate bounds, cost (§5)
    tpot, source = _tpot_histogram(w)
    out["tpot_source"] = source
    p95 = {}
    no_increases = _no_increases(w)  # a step without increases: every histogram is absent from w
    for key, family in (("ttft", "ttft"), ("tpot_request", "request_tpot"), ("itl", "itl")):
        h = w.histograms.get(family)
        # buckets that disagree with _sum (vLLM 0.5.1's TTFT: all in le=0.001, a mean of 1.5 s) give no quantile
        q = None if h is None or h.problem == SUM_DISAGREES else quantile(h.buckets, h.count, P95)
        if q is not None:
            p95[key] = q
        else:
            top = None if h is None else max((le for le, _ in h.buckets if math.isfinite(le)), default=None)
            unknown.setdefault(f"observed_p95_{key}", no_increases if h is None and no_increases else missing_histogram(
                snap.engine, snap.name_prefix, HISTOGRAMS[family],
                "no {} histogram with buckets in the publish window" if h is None or not h.buckets
                else "no observation in the publish window (no data, not 0)" if h.count <= 0
                else "{}: " + SUM_DISAGREES + " in the publish window (which is wrong cannot be told)"
                if h.problem == SUM_DISAGREES
                else "{}: the P95 lies above every finite bucket edge" + ("" if top is None else
                                                                          measured(f"P95 ≥ {top:g} s"))))
    out["p95"] = p95
    ttft_slo, tpot_slo = cfg.slo.ttft_seconds, cfg.slo.tpot_seconds
    ttft = w.histograms.get("ttft")
    if ttft_slo is None or tpot_slo is None:
        unknown.setdefault("slo_pass_ratio", "slo.ttft_seconds and slo.tpot_seconds must both be configured")
    elif (ttft is None or tpot is None) and no_increases:
        unknown.setdefault("slo_pass_ratio", no_increases)
    elif ttft is None or tpot is None:
        unknown.setdefault("slo_pass_ratio", "no " + " and no ".join(
            what for what, absent in (("time_to_first_token", ttft is None),
                                      ("request TPOT or inter-token latency", tpot is None)) if absent)
            + " histogram with buckets in the publish window")
    elif SUM_DISAGREES in (ttft.problem, tpot.problem):
        unknown.setdefault("slo_pass_ratio", f"the {'TTFT' if ttft.problem == SUM_DISAGREES else 'TPOT'} histogram's "
                                             f"{SUM_DISAGREES} in the publish window (which is wrong cannot be told)")
    else:
        a, b = slo_shares(ttft.buckets, ttft.count, ttft_slo), slo_shares(tpot.buckets, tpot.count, tpot_slo)
        if a is None or b is None:
            unknown.setdefault("slo_pass_ratio", "no request finished in the publish window")
        else:
            gen = w.counters.get("generation_tokens")
            tps = gen / w.dt if gen is not None and w.dt > 0 else None
            # the price of the instances the tokens come from: fleet mode sums pods (a review read a
            # 4-pod fleet's cost 4x too low), time-averaged over the window as they scale
            if not cfg.prometheus:
                instances = 1.0
            else:
                instances = w.instance_seconds / w.dt if w.instance_seconds is not None and w.dt > 0 else None
            price = None if cfg.instance_hour_price is None or instances is None else cfg.instance_hour_price * instances
            cost = slo_cost(a, b, tps, price, cfg.retry_rate)
            out["slo_cost"] = cost
            for key, why in (cost.reasons or {}).items():
                signal = "cost_per_million_slo_output_tokens" + ("_upper" if key == "cost_upper" else "_lower")
                if instances is None and cfg.instance_hour_price is not None and tps is not None:
                    why = ("fleet mode: the pods the model's output tokens come from are unknown for a poll in the "
                           "publish window")
                unknown.setdefault(signal, why)

    # prefill share, speedup, verdict (§5)
    pre, dec = w.histograms.get("prefill_time"), w.histograms.get("decode_time")
    share = {}
    if pre is not None and dec is not None and pre.mean is not None and dec.mean is not None \
            and pre.mean + dec.mean > 0:
        share["window"] = prefill_share(pre.mean, dec.mean)
    hist_share = st.rollup.prefill_share()
    if hist_share is not None:
        share["history"] = hist_share
    if "window" not in share:
        unknown.setdefault("prefill_share", "no request finished in the publish window" if pre is not None
                           and dec is not None else no_increases or "no request_prefill_time/request_decode_time "
                           "histograms" + (" (SGLang exports neither)" if snap.engine == "sglang" else ""))
    out["prefill_share"] = share
    v = verdict(st.rollup)
    if prefix_caching_off(snap.cache_config_of(model)):  # a history of hits from before it was turned off is no verdict now
        v = replace(v, state=None, reason=f"{PREFIX_CACHING_OFF} now: no verdict and no hit-ratio history until it "
                                          "is on again", history_hit_ratio=None, recent_hit_ratio=None, jitter=None)
        unknown.setdefault("hit_ratio_jitter", PREFIX_CACHING_OFF)
    out["caching"] = v
    if v.state is None:
        unknown.setdefault("prefix_cache_verdict", v.reason)
    if v.jitter is None:
        unknown.setdefault("hit_ratio_jitter", f"fewer than {JITTER_MIN_MINUTES} of the last {RECENT_MINUTES} "
                                               "minutes had prefix-cache queries with a known hit ratio")
    sp = {}
    for span, h in (("window", hit.get("all")), ("history", v.history_hit_ratio)):
        x = speedup(h, share.get(span))
        if x is not None:
            sp[span] = x
    out["caching_speedup"] = sp

    # KV capacity, concurrency ceiling, peak KV (§3.6)
    cap = kv_capacity_tokens(snap.cache_config_of(model), snap.models[model].gauges)
    if cap is None:
        unknown.setdefault("kv_capacity_tokens", "no cache_config_info (num_gpu_blocks, block_size or "
                                                 "kv_cache_size_tokens) or SGLang max_total_num_tokens")
        unknown.setdefault("max_concurrency", "KV capacity unknown (the kv_capacity_tokens reason says why)")
    else:
        out["kv_capacity_tokens"] = cap
        if isl is not None and osl is not None and isl + osl > 0:
            out["max_concurrency"] = max_concurrency(cap, isl + osl)
        else:
            unknown.setdefault("max_concurrency", "ISL/OSL unknown: no request finished in the publish window, or "
                                                  "no request_prompt/generation_tokens histograms (the isl and osl "
                                                  "reasons say which)")
    if cfg.sizing.batch is None or cfg.sizing.max_len is None:
        unknown.setdefault("kv_peak_bytes", "sizing.batch and sizing.max_len not configured")
    elif kv is not None:
        out["kv_peak_bytes"] = peak_kv_bytes(cfg.sizing.batch, cfg.sizing.max_len, kv)
    else:
        unknown.setdefault("kv_peak_bytes", f"B x N_max x S_kv, and S_kv is unknown: {unknown['kv_bytes_per_token']}")

    # economic max-num-seqs (§5)
    res = st.tpot.result(tpot_slo)
    if st.tpot_source:
        res = replace(res, extra={**res.extra, "tpot_source": st.tpot_source})
    fits["max_num_seqs"] = res
    x = res.value("concurrency_at_target")
    if x is not None and x >= 1:
        out["recommended_max_num_seqs"] = int(math.floor(x))
    elif x is not None:
        unknown.setdefault("recommended_max_num_seqs", "TPOT P95 exceeds 80 % of the TPOT SLO even at one running "
                                                       "request (fitted line)")

    # first-order capacity bound Θ(h) (§3.3)
    h_all, h_load = hit.get("all"), hit.get("loaded")
    t0 = coef.compute_time(isl, 0.0) if coef is not None and isl else None
    # T0 is prefill compute alone (no engine step, no decode)
    problem = unidentified_terms(fits["chip_time"].extra.get("collinear"), coef, chip_time_regressors(isl, 0.0, 0.0, 0.0),
                                 "a prefill's compute", f"at h=0, ISL={isl:g}") if t0 else None
    if t0 is None or not t0 > 0 or h_all is None:
        unknown.setdefault("capacity_bound", "needs the chip-time fit (T0 = k_ffn·N + k_attn·N²/2), ISL and h")
    elif problem:
        unknown.setdefault("capacity_bound", f"T0 (h = 0): {problem}")
    else:
        # T0 is the E engines' as one machine at full load (_model_analysis), so its link is E
        # links: B_load (per GPU, each engine's GPUs load in parallel) × E keeps δ each engine's
        # and Θ's load bound the E engines' together, as Θ0 is
        fo = first_order_capacity(isl, t0, kv, bandwidth[0] * engines if bandwidth else None)
        out["load_compute_ratio"] = fo.delta
        bound, points = {}, [("current", h_all, h_load)]
        if cfg.target_hit_ratio is not None:
            load_share = _load_share(w, h_all, h_load)
            points.append(("target", cfg.target_hit_ratio,
                           None if load_share is None else cfg.target_hit_ratio * load_share))
        for which, h, hl in points:
            if which == "target" and h > max_hit_ratio(isl):
                unknown.setdefault(f"capacity_bound_{which}", _above_h_max(h, isl))
                continue
            theta = fo.theta(h, hl)
            if theta is not None:
                bound[which] = theta
            elif fo.delta is None:  # needed: hits loaded, or their loaded share unknown (all taken as loaded)
                unknown.setdefault(f"capacity_bound_{which}", (
                    "Theta(h) = Theta0 / max(1-h, delta x h_load) needs delta = ISL x S_kv / (B_load x T0) for the loaded "
                    f"hits ({'h_load unknown: every hit taken as loaded' if hl is None else 'some hits loaded'}), and S_kv "
                    "or B_load is unknown (kv_bytes_per_token, load_bandwidth)"
                    + measured(f"h {h:g}" + ("" if hl is None else f", h_load {hl:.3g}"))))
            else:
                unknown.setdefault(f"capacity_bound_{which}", "unbounded at h = 1 without loaded hits (1-h = 0)")
        out["capacity_bound"] = bound
    return out
