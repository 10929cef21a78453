"""Snapshots → step observations → online fitters → :class:`Analysis` (the pipeline's middle).

For every model in the target's exposition the analyzer keeps a publish window and three
online fitters: chip time (MODEL.md §7), miss slope (§4 ``linear``) and prefill latency (the
load-aware layer of §7 with α of §3.2). :meth:`Analyzer.analysis` assembles what the collector
renders: observed window values, fit results, predictions at the current and target hit
ratio, and both bathtubs. Nothing here formats or serves; nothing downstream computes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from exporter.config import Config
from exporter.observe import Context, hit_tokens, observe
from exporter.parse import Snapshot
from exporter.window import Delta, Windows
from fitters.bathtub import BathtubCurve, bathtub_chip_time, bathtub_linear, derived_miss_slope
from fitters.chiptime import ChipTimeFitter
from fitters.latency import LatencyFitter
from fitters.missslope import MissSlopeFitter
from fitters.model import ChipTimeCoefficients, tpm_delivered, tpm_physical
from fitters.observation import Observation
from fitters.result import Estimate, FitResult, Status
from fitters.whatif import FittedModel, Prediction


# Hit ratios at which the bathtub curves are published (stable label values for dashboards).
BATHTUB_GRID = tuple(i / 20 for i in range(20)) + (0.97, 0.99)


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
        fits: "chip_time" | "miss_slope" | "overlap" | "load_aware" → FitResult.
        miss_slope_derived: ("tps0", "a") Estimates from the chip-time model (§4), or {}.
        fitted: the frozen model for predictions (None until the chip-time fit is ok).
        predictions: "current" | "target" → Prediction.
        bathtubs: "linear" | "chip_time" → BathtubCurve.
        valley_form: which bathtub drives ``kvhit_valley_active`` (None when neither is ok).
        load_bandwidth: (value [bytes/s], "measured" | "configured") or None.
        kv_bytes_per_token: S_kv per GPU [bytes] or None.
        contention: c(running) at the current concurrency [1] or None.
        anomalies: busy steps flagged as tail-chunk anomalies in the current ISL bucket.
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
    miss_slope_derived: dict[str, Estimate] = field(default_factory=dict)
    fitted: FittedModel | None = None
    predictions: dict[str, Prediction] = field(default_factory=dict)
    bathtubs: dict[str, BathtubCurve] = field(default_factory=dict)
    valley_form: str | None = None
    load_bandwidth: tuple[float, str] | None = None
    kv_bytes_per_token: float | None = None
    contention: float | None = None
    anomalies: int = 0


@dataclass(frozen=True)
class Analysis:
    """The analysis of one target at one moment (what the collector renders).

    Attributes:
        timestamp: time of the latest snapshot [unix s] (None before the first one).
        engine, engine_reason: from the latest snapshot (parse.Snapshot).
        models: model_name → ModelAnalysis.
        target_hit_ratio: the configured what-if hit ratio (None = not configured).
        slo_seconds: the configured latency SLOs, "ttft" / "tpot" → seconds (unset ones absent).
    """

    timestamp: float | None
    engine: str
    engine_reason: str
    models: dict[str, ModelAnalysis]
    target_hit_ratio: float | None = None
    slo_seconds: dict[str, float] = field(default_factory=dict)

    def without_models(self) -> "Analysis":
        """The same analysis with every per-model value removed (stale data is never shown)."""
        return replace(self, models={})


@dataclass
class _ModelState:
    chip: ChipTimeFitter = field(default_factory=ChipTimeFitter)
    slope: MissSlopeFitter = field(default_factory=MissSlopeFitter)
    latency: LatencyFitter = field(default_factory=LatencyFitter)
    isl: float | None = None
    osl: float | None = None


class Analyzer:
    """Online analysis of one target (bounded memory: windows and fitters' ring buffers).

    ``ingest`` consumes snapshots in time order and returns the new step observations;
    ``analysis`` builds the current :class:`Analysis` (cached until the next ingest).
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self.windows = Windows(config.window_seconds)
        self._state: dict[str, _ModelState] = {}
        self._cache: Analysis | None = None
        self._last: Snapshot | None = None
        self.last_observations: dict[str, Observation] = {}  # the latest ingest's steps

    def ingest(self, snap: Snapshot) -> dict[str, Observation]:
        """Add one snapshot. Returns model → the step's Observation (also kept in
        ``last_observations``).

        Raises:
            ValueError: the snapshot is not newer than the previous one (nothing changes).
        """
        self.last_observations: dict[str, Observation] = {}
        deltas = self.windows.push(snap)
        self._last = snap
        self._cache = None
        out: dict[str, Observation] = {}
        for model, delta in deltas.items():
            st = self._state.setdefault(model, _ModelState())
            obs = observe(delta, self._context(snap, model, st))
            st.isl, st.osl = obs.isl or st.isl, obs.osl or st.osl
            st.chip.update(obs)
            st.slope.update(obs)
            st.latency.update(obs)
            out[model] = obs
        self.last_observations = out
        for model in list(self._state):
            if model not in snap.models:
                del self._state[model]
        return out

    def _context(self, snap: Snapshot, model: str, st: _ModelState) -> Context:
        sig = snap.models[model]
        block = snap.cache_config.get("block_size")
        return Context(hit_unit=sig.hit_unit or "tokens",
                       block_size=float(block) if block and block.replace(".", "", 1).isdigit() else None,
                       unknown=sig.unknown, isl=st.isl, osl=st.osl)

    def analysis(self) -> Analysis:
        if self._cache is not None:
            return self._cache
        snap = self._last
        if snap is None:
            return Analysis(None, "unknown", "no scrape yet", {}, self.config.target_hit_ratio, self._slo())
        models = {}
        for model in self.windows.models():
            w = self.windows.window(model)
            if w is not None and model in snap.models:
                models[model] = self._model_analysis(snap, model, w)
        self._cache = Analysis(snap.timestamp, snap.engine, snap.reason, models, self.config.target_hit_ratio,
                               self._slo())
        return self._cache

    def _slo(self) -> dict[str, float]:
        slo = self.config.slo
        return {k: v for k, v in (("ttft", slo.ttft_seconds), ("tpot", slo.tpot_seconds)) if v is not None}

    # --- assembly ------------------------------------------------------------------------

    def _model_analysis(self, snap: Snapshot, model: str, w: Delta) -> ModelAnalysis:
        cfg = self.config
        st = self._state[model]
        ctx = self._context(snap, model, st)
        wobs = observe(w, ctx)
        unknown = dict(snap.models[model].unknown)
        hit = _window_hits(w, ctx, unknown)
        isl, osl = wobs.isl, wobs.osl
        tpm = _observed_tpm(w, wobs, cfg.model.gpus)
        kv = cfg.model.kv_bytes_per_token()
        if kv is None:
            unknown.setdefault("kv_bytes_per_token", "model geometry (model.layers, kv_heads, head_dim or "
                                                     "model.hf_config) not configured")
        bandwidth = _bandwidth(w, cfg.load_bandwidth_bytes_per_second)

        chip = st.chip.result()
        coef = st.chip.coefficients()
        slope = st.slope.result(isl) if isl is not None and isl >= 1 else st.slope.result()
        if coef is not None:
            load_aware, overlap = st.latency.result(coef, kv, bandwidth[0] if bandwidth else None)
        else:
            waiting = FitResult.failed(Status.INSUFFICIENT_DATA, "waiting for the chip-time fit")
            load_aware = overlap = waiting
        fits = {"chip_time": chip, "miss_slope": slope, "overlap": overlap, "load_aware": load_aware}

        out = ModelAnalysis(
            model_name=model, window_seconds=w.dt, window_steps=w.steps, hit_ratio=hit, unknown=unknown,
            isl=isl, osl=osl, observed_ttft=wobs.ttft_mean, tpm_observed=tpm, fits=fits,
            load_bandwidth=bandwidth, kv_bytes_per_token=kv,
            anomalies=int(slope.extra.get("anomalies", 0)),
        )
        h_now = hit.get("all")
        steps_per_request = _steps_per_request(w)
        linear = self._linear_bathtub(slope, h_now)
        if coef is None or h_now is None or isl is None or osl is None or steps_per_request is None:
            return replace(out, bathtubs=linear, valley_form=_valley_form(None, linear))
        fitted = self._fitted(coef, steps_per_request, fits, wobs, hit, kv, bandwidth)
        preds = {"current": fitted.predict(h_now, isl, osl)}
        if cfg.target_hit_ratio is not None:
            preds["target"] = fitted.predict(cfg.target_hit_ratio, isl, osl)
        bathtubs = dict(linear)
        h_max = 1 - 1 / isl  # the last prompt token is never a hit
        bathtubs["chip_time"] = bathtub_chip_time(
            coef, chip.covariance, fitted.t_fixed, isl, osl, min(h_now, h_max),
            cfg.prices.p_miss, cfg.prices.p_hit, cfg.prices.p_out, grid=[h for h in BATHTUB_GRID if h <= h_max])
        derived = {}
        lo, hi = slope.extra.get("h_min"), slope.extra.get("h_max")
        if isinstance(lo, float) and isinstance(hi, float) and hi - lo >= st.slope.min_h_span:
            tps0_d, a_d, a_se = derived_miss_slope(coef, chip.covariance, fitted.t_fixed, isl, osl, lo, hi)
            derived = {"tps0": Estimate(tps0_d), "a": Estimate(a_d, a_se)}
        contention = None
        if fitted.c0 is not None and fitted.c1 is not None and fitted.running is not None:
            contention = fitted.c0 + fitted.c1 * fitted.running
        return replace(out, fitted=fitted, predictions=preds, bathtubs=bathtubs, miss_slope_derived=derived,
                       valley_form=_valley_form(chip, bathtubs), contention=contention)

    def _linear_bathtub(self, slope: FitResult, h_now: float | None) -> dict[str, BathtubCurve]:
        tps0, a = slope.value("tps0"), slope.value("a")
        if tps0 is None or a is None or h_now is None or h_now >= 1:
            return {}
        p = self.config.prices
        return {"linear": bathtub_linear(tps0, a, slope.covariance, h_now, p.p_miss, p.hit_price_ratio,
                                         grid=BATHTUB_GRID)}

    def _fitted(self, coef: ChipTimeCoefficients, steps_per_request: float, fits: dict[str, FitResult],
                wobs: Observation, hit: dict[str, float], kv: float | None,
                bandwidth: tuple[float, str] | None) -> FittedModel:
        cfg = self.config
        la = fits["load_aware"]
        h_all, h_load = hit.get("all"), hit.get("loaded")
        running = wobs.running
        return FittedModel(
            *coef.as_tuple(), steps_per_request=steps_per_request,
            c0=la.value("c0"), c1=la.value("c1") if la.value("c1") is not None else (0.0 if la.ok else None),
            running=running, queue_time=wobs.queue_time_mean, alpha=fits["overlap"].value("alpha"),
            hit_load_share=(h_load / h_all) if h_all and h_load is not None else 0.0,
            kv_bytes_per_token=kv, load_bandwidth=bandwidth[0] if bandwidth else None,
            gpus=cfg.model.gpus, p_miss=cfg.prices.p_miss, p_hit=cfg.prices.p_hit, p_out=cfg.prices.p_out)


def _valley_form(chip: FitResult | None, bathtubs: dict[str, BathtubCurve]) -> str | None:
    """MODEL.md §4: the valley alert follows chip_time when its fit is ok, else linear."""
    if chip is not None and chip.ok and "chip_time" in bathtubs:
        return "chip_time"
    return "linear" if "linear" in bathtubs else None


def _window_hits(w: Delta, ctx: Context, unknown: dict[str, str]) -> dict[str, float]:
    q, k, e = hit_tokens(w, ctx)
    out: dict[str, float] = {}
    if q is None or q <= 0:
        if q is not None:
            unknown.setdefault("hit_ratio", "no prefix-cache queries in the publish window (no data, not 0 %)")
        return out
    if k is not None:
        out["device"] = k / q
    if e is not None:
        out["loaded"] = e / q
    if k is not None and e is not None:
        out["all"] = (k + e) / q
    return out


def _observed_tpm(w: Delta, wobs: Observation, gpus: int) -> dict[tuple[str, str], float]:
    """Observed TPM over the window (MODEL.md §3.4 basis="observed")."""
    prompt, gen = w.counters.get("prompt_tokens"), w.counters.get("generation_tokens")
    if prompt is None or gen is None or w.dt <= 0:
        return {}
    out = {("delivered", "instance"): (prompt + gen) * 60.0 / w.dt}
    if wobs.miss_tokens is not None:
        out[("physical", "instance")] = (wobs.miss_tokens + gen) * 60.0 / w.dt
    for kind in ("delivered", "physical"):
        if (kind, "instance") in out:
            out[(kind, "gpu")] = out[(kind, "instance")] / gpus
    return out


def _steps_per_request(w: Delta) -> float | None:
    """Engine steps per finished request over the window (T_fixed share, MODEL.md §7)."""
    steps, done = w.histograms.get("iteration_tokens"), w.histograms.get("prefill_time")
    if steps is None or done is None or done.count <= 0:
        return None
    return steps.count / done.count


def _bandwidth(w: Delta, configured: float | None) -> tuple[float, str] | None:
    """B_load: measured from vLLM's KV-offload load counters when exported, else configured (§3.2)."""
    b, s = w.counters.get("kv_offload_load_bytes"), w.counters.get("kv_offload_load_seconds")
    if b and s and b > 0 and s > 0 and math.isfinite(b / s):
        return b / s, "measured"
    return (configured, "configured") if configured else None

