"""A fitted model frozen into plain numbers, and what-if predictions from it.

:class:`FittedModel` is what ``/api/v1/analysis`` exports and ``kvhit predict --fit FILE`` loads:
the §7 chip-time coefficients, the load-aware layer (contention, queue), α and the geometry
needed for T_load, and the prices. :meth:`FittedModel.predict` answers "what if h, ISL, OSL
were …" with the same functions the live analyzer uses (MODEL.md §3.2, §3.4, §4, §7).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields

from fitters.latency import load_and_compute, predict_prefill_latency, service_ttft, service_ttft_gradient
from fitters.model import (CHIP_TIME_REGRESSOR_WORDS, CHIP_TIME_TERMS, ChipTimeCoefficients, chip_time_regressor_slopes,
                           chip_time_regressors, load_link_rate, relation_text, revenue_chip_time, steps_fixed_time, tpm_delivered, tpm_physical)
from fitters.result import measured

SCHEMA_VERSION = 2  # 2: "collinear" relations replace version 1's "prefill_mix_tokens"
# How far off (relative) a prediction may be where the fit could not tell terms apart
# (unidentified_terms): the kept terms carry a dropped term's time within that share.
COLLINEAR_TOLERANCE = 0.05
# Largest standard error of a prefill's chip time, relative to it, at which a TTFT is predicted: a
# fit of traffic that never varied apart (one h, ISL and OSL: steps, miss and decode tokens in one
# ratio) can split its time anyhow (a real vLLM: 39 µs ± 9 ms for a 0.3-s prefill, published).
PREFILL_REL_STDERR = 0.5
LOAD_SHARE_UNKNOWN = ("the loaded share h_load/h is unknown: no prefix-cache hit in the publish window while a KV "
                      "connector was asked for some (external_prefix_cache_queries), so T_load at another h is unknown")
STEPS_UNKNOWN = ("engine steps per request unknown in the publish window the fit comes from (no request finished in "
                 "it, or no iteration_tokens / request_prefill_time histogram), so T_fixed = T_step x steps is; give "
                 "the what-if's steps per request")


def link_excess(tpm: float | None, isl: float, osl: float, feed: float | None) -> str | None:
    """"<rate> vs <feed> prompt tokens/s" when a TPM [tokens/min] of requests of ``isl``, ``osl``
    [tokens] needs more prompt tokens per second, TPM/60 × ISL/(ISL + OSL), than ``feed`` (a
    KV-load link's, :meth:`FittedModel.link_feed`); None when it does not, or either is None."""
    if tpm is None or feed is None:
        return None
    rate = tpm / 60.0 * isl / (isl + osl)
    return f"{rate:.4g} vs {feed:.4g} prompt tokens/s" if rate > feed else None


@dataclass(frozen=True)
class Prediction:
    """What-if outputs at one (h, ISL, OSL); None = cannot be predicted, ``unknown`` says why.

    ttft_service / ttft_load_aware [s]; ttft_service_stderr [s]: the service TTFT's standard error
    from the chip-time fit's covariance (α's own error not in it; None without the covariance or
    the TTFT); tpm_* [tokens/min] per instance and per GPU;
    revenue [price/s per machine] (chip_time form); t_chip [s per request]: these six None
    together when the request's chip time is not identifiable while its prefill is (MODEL.md §6:
    the TTFTs stand); unknown: output name → why it is None; extrapolated: why every output reads
    the chip-time fit beyond the h, ISL or OSL of its steps (None inside them): its standard
    errors do not count that; kv_load_bound: why the TPMs and revenue read high, their prompt
    tokens/s past what the KV-load link can feed (:meth:`FittedModel.link_feed`), None below it
    or without a bound (MODEL.md §3.4).
    """

    hit_ratio: float
    isl: float
    osl: float
    t_chip: float | None
    ttft_service: float | None
    ttft_load_aware: float | None
    tpm_delivered: float | None
    tpm_physical: float | None
    tpm_delivered_per_gpu: float | None
    tpm_physical_per_gpu: float | None
    revenue: float | None
    unknown: dict[str, str] = field(default_factory=dict)
    extrapolated: str | None = None
    ttft_service_stderr: float | None = None
    kv_load_bound: str | None = None


# The outputs of a Prediction that read a request's whole chip time (FittedModel.predict)
_PER_REQUEST = ("t_chip", "tpm_delivered", "tpm_physical", "tpm_delivered_per_gpu", "tpm_physical_per_gpu", "revenue")


# Most engine steps per request a what-if takes (kvhit predict, /api/v1/predict and a saved fit alike).
MAX_STEPS_PER_REQUEST = 1e7
# from_dict's checks: (field, accepts, what it must be); NULLABLE fields may also be None (unknown).
_FIELD_RANGES = (
    *((n, lambda v: v >= 0, "a finite number >= 0") for n in ("t_step", "k_ffn", "k_attn", "k_dec", "k_ctx",
                                                             "c0", "c1", "running", "queue_time", "p_miss",
                                                             "p_hit", "p_out", "alpha_stderr")),
    # a request's share of the engine steps, > 0: every prefill takes part in a step
    ("steps_per_request", lambda v: 0 < v <= MAX_STEPS_PER_REQUEST, "a number in (0, 1e7]"),
    *((n, lambda v: 0 <= v <= 1, "a number in [0, 1]") for n in ("alpha", "hit_load_share")),
    *((n, lambda v: v > 0, "a finite number > 0") for n in ("kv_bytes_per_token", "load_bandwidth")),
    ("gpus", lambda v: v >= 1 and float(v).is_integer(), "a whole number >= 1"),
    ("engines", lambda v: v >= 1, "a number >= 1"),
    ("busy_engines", lambda v: v >= 1, "a number >= 1"),
)


def finite_number(v: object) -> bool:
    """Whether a saved fit's value is a finite number: an int or a float, not a bool (JSON's true)."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


# fields of other shapes (mappings, lists), each checked by from_dict itself
STRUCTURED = ("collinear", "chip_covariance", "isl_range", "osl_range", "h_range", "alpha_chip_gradient")
NULLABLE = {"steps_per_request", "c0", "c1", "running", "queue_time", "alpha", "kv_bytes_per_token", "load_bandwidth",
            "hit_load_share", "busy_engines", "alpha_stderr"}


def unidentified_terms(collinear: dict[str, dict[str, float]] | None, coef: ChipTimeCoefficients,
                       z: Sequence[float], what: str, where: str = "") -> str | None:
    """Why the chip time of some work is not identifiable, or None (MODEL.md §6: collinear
    regressors give the combined prediction only).

    ``collinear`` is the chip-time fit's extra "collinear" ({dropped term: {kept term: c}}; None
    or empty when every term was identified): a dropped term j's time β_j·x_j is carried by the
    kept terms as β_j·Σ c × their regressors, so work whose own x_j differs from that sum by g is
    off by β_j·g. β_j is bounded by the kept coefficients (``coef``) it inflated: a kept k with
    c_k > 0 was fitted as k_true + c_k·β_j with k_true ≥ 0, so β_j ≤ coef_k / c_k; and the work's
    predicted time Σ coef × z = Σ k_true·z + β_j·(Σ c × z) holds β_j times the carried sum, so
    β_j ≤ predicted / carried when that sum is > 0 (at the fitted traffic itself the gap is then
    a tiny share of the time, however loose the first bound). The work is refused when the
    smallest bound × g exceeds COLLINEAR_TOLERANCE of its predicted time.
    Without either bound (no c > 0 with its coefficient > 0, a carried sum ≤ 0, or a column never seen), the gap
    itself must stay within COLLINEAR_TOLERANCE of the larger of x_j and the sum. ``z``: the
    work's regressors in CHIP_TIME_TERMS order (:func:`~fitters.model.chip_time_regressors` of a
    request or of its prefill alone, or a window's totals); ``what`` names it in the message and
    ``where`` (e.g. "at h=0.3, ISL=2048") says where it is among the measured values
    (fitters/result.py ``measured``: a Prometheus label leaves them out).
    E.g. attention work dropped with miss tokens as its partner (one h and ISL seen): c =
    ISL·(1+h)/2 of the steps seen, and a what-if at another mix is off by up to k_ffn·M·Δh.
    """
    words = CHIP_TIME_REGRESSOR_WORDS
    k, z = dict(zip(CHIP_TIME_TERMS, coef.as_tuple())), dict(zip(CHIP_TIME_TERMS, z))
    predicted = sum(k[t] * z[t] for t in CHIP_TIME_TERMS)
    for term, relation in (collinear or {}).items():
        carried = sum(c * z[t] for t, c in relation.items())
        gap = abs(z[term] - carried)
        bounds = [k[t] / c for t, c in relation.items() if c > 0 and k[t] > 0]
        if carried > 0 and predicted > 0:
            bounds.append(predicted / carried)
        if bounds:
            off = min(bounds) * gap / predicted if predicted > 0 else math.inf
            size = (f"its chip time could be off by up to {min(bounds) * gap:.3g} s of its {predicted:.3g} s "
                    f"({off:.1%})")
        else:
            off = gap / max(abs(z[term]), abs(carried), math.ulp(0.0))
            size = f"{off:.0%} apart, and the fit has no bound on what that costs"
        if off <= COLLINEAR_TOLERANCE:
            continue
        partners = " from " + " + ".join(words[t] for t in relation) if relation else ""
        seen = relation_text(relation)
        return (f"not identifiable: the chip-time fit could not tell {words[term]} apart{partners}, and {what} is "
                f"off the relation its steps followed beyond the {COLLINEAR_TOLERANCE:.0%} tolerance; ask about "
                "traffic closer to the fitted one, or fit on traffic that varies them apart"
                + measured(f"in its steps {words[term]} ≈ {seen}; {(where + ' ') if where else ''}{what} has "
                           f"{z[term]:.6g} {words[term]} where that relation gives {carried:.6g}: {size}"))
    return None


@dataclass(frozen=True)
class FittedModel:
    """Everything needed to predict, as plain numbers (JSON-serialisable).

    Attributes:
        t_step, k_ffn, k_attn, k_dec, k_ctx: chip-time coefficients (MODEL.md §7).
        steps_per_request: engine steps per request observed in the publish window; T_fixed =
            t_step × steps_per_request [steps]. None when no request finished in it: a what-if
            then needs it given (:data:`STEPS_UNKNOWN`).
        c0, c1: contention factor c = c0 + c1·running (None when the load-aware fit is not ok).
        running: num_requests_running at which load-aware predictions are made [1].
        queue_time: mean queue time of the publish window [s] (None when unknown).
        alpha: overlap α (None when not identifiable); alpha_stderr: its standard error (None: not
            known, as in fits saved before it was); alpha_chip_gradient: ∂α/∂(t_step, k_ffn,
            k_attn) of one engine's coefficients (the overlap fit's extra, fitters/latency.py),
            so that a TTFT's error counts α's moving with the coefficients (None: taken as
            independent, as in fits saved before it was).
        hit_load_share: h_load / h at the current operating point (scales a what-if h; a window
            without prefix-cache queries: the latest step's that told it) [1]; None
            when unknown (no hit in the window while a KV connector counts them): a what-if at
            h > 0 then has no TTFT (T_load unknown).
        kv_bytes_per_token: per-GPU S_kv [bytes]; load_bandwidth: B_load [bytes/s].
        gpus: tp × pp (× engines); p_miss, p_hit, p_out: prices per token.
        engines: E ≥ 1, the engines the chip-time coefficients describe as one machine
            (data-parallel engines, a fleet's pods; MODEL.md §7; kvhit gives all of them at full
            load): throughput (TPM, revenue) is the machine's, a request's latency (TTFT) one
            engine's, with the coefficients × E (:meth:`ChipTimeCoefficients.per_engine`).
        busy_engines: the engines busy in the chip-time fit's steps (their harmonic mean), whose
            machine its own coefficients describe (:attr:`fit_coefficients`); None: ``engines``.
        collinear: the chip-time fit's terms it could not tell apart, {dropped term: {kept term:
            c}} (its extra "collinear"; None when it identified every term): predictions hold only
            where a request keeps those relations (:meth:`unidentified`).
        chip_covariance: the chip-time coefficients' covariance, 5×5 in CHIP_TIME_TERMS order
            (None: not known, as in fits saved before it was): a prefill whose chip time it leaves
            uncertain beyond PREFILL_REL_STDERR has no TTFT (:meth:`unidentified_prefill`).
        isl_range, osl_range, h_range: [min, max] of the chip-time fit's steps' mean ISL and OSL
            [tokens] and h [1] (:meth:`ChipTimeFitter.ranges`; None: not known, as in fits saved
            before them): a what-if beyond them says so (``Prediction.extrapolated``).
    """

    t_step: float
    k_ffn: float
    k_attn: float
    k_dec: float
    k_ctx: float
    steps_per_request: float | None
    c0: float | None = None
    c1: float | None = None
    running: float | None = None
    queue_time: float | None = None
    alpha: float | None = None
    hit_load_share: float | None = 0.0
    kv_bytes_per_token: float | None = None
    load_bandwidth: float | None = None
    gpus: int = 1
    p_miss: float = 1e-6
    p_hit: float = 1e-7
    p_out: float = 0.0
    collinear: dict[str, dict[str, float]] | None = None
    chip_covariance: list[list[float]] | None = None
    engines: float = 1.0
    busy_engines: float | None = None
    isl_range: list[float] | None = None
    osl_range: list[float] | None = None
    h_range: list[float] | None = None
    alpha_stderr: float | None = None
    alpha_chip_gradient: list[float] | None = None

    @property
    def coefficients(self) -> ChipTimeCoefficients:
        return ChipTimeCoefficients(self.t_step, self.k_ffn, self.k_attn, self.k_dec, self.k_ctx)

    def link_feed(self, hit_ratio: float) -> float | None:
        """B_load·E/(S_kv·h_load) [prompt tokens/s] at ``hit_ratio`` (h_load = h × hit_load_share):
        the most prompt tokens per second the E engines' KV-load links can feed, Θ's load term
        (MODEL.md §3.3); None without a loaded hit or with S_kv or B_load unknown (no bound)."""
        h_load = hit_ratio * (self.hit_load_share or 0.0)
        if not (h_load > 0 and self.kv_bytes_per_token and self.load_bandwidth):
            return None
        return load_link_rate(self.load_bandwidth * self.engines, self.kv_bytes_per_token, h_load)

    @property
    def t_fixed(self) -> float | None:
        """T_fixed = T_step × steps per request [s] (MODEL.md §7); None when the steps are unknown."""
        return None if self.steps_per_request is None else steps_fixed_time(self.t_step, self.steps_per_request)

    @property
    def fit_coefficients(self) -> ChipTimeCoefficients:
        """The chip-time fit's own coefficients, the engines busy in its steps as one machine
        (MODEL.md §7): what a step's busy time is predicted with; the full-load ones × engines /
        busy_engines."""
        busy = self.engines if self.busy_engines is None else self.busy_engines
        return self.coefficients.per_engine(self.engines / busy)

    @property
    def t_fixed_stderr(self) -> float | None:
        """Standard error of T_fixed [s]: T_step's (``chip_covariance``) × steps per request, the
        steps counted, not fitted; None when either is unknown."""
        if self.steps_per_request is None or not self.chip_covariance:
            return None
        i = CHIP_TIME_TERMS.index("t_step")
        return self.steps_per_request * math.sqrt(max(self.chip_covariance[i][i], 0.0))

    def unidentified(self, hit_ratio: float, isl: float, osl: float,
                     seen: Sequence[float] | None = None) -> str | None:
        """Why a request's chip time at (h, ISL, OSL) is not identifiable, or None
        (:func:`unidentified_terms`; ``steps_per_request`` engine steps). ``seen``: the regressor
        totals of the traffic the request stands for (the publish window's, CHIP_TIME_TERMS
        order), checked instead: a mean request of mixed traffic is no request that ran.
        :data:`STEPS_UNKNOWN` when ``steps_per_request`` is None."""
        if self.steps_per_request is None:
            return STEPS_UNKNOWN
        if seen is not None:
            return unidentified_terms(self.collinear, self.coefficients, seen, "the publish window's traffic")
        return unidentified_terms(self.collinear, self.coefficients,
                                  chip_time_regressors(isl, osl, hit_ratio, self.steps_per_request), "a request",
                                  f"at h={hit_ratio:g}, ISL={isl:g}, OSL={osl:g}, {self.steps_per_request:.3g} engine "
                                  "steps,")

    def unidentified_slope(self, hit_ratio: float, isl: float) -> str | None:
        """Why t_chip'(h), the slope in h of a request's chip time at (h, ISL), is not identifiable,
        or None: :func:`unidentified_terms` on −∂z/∂h (:func:`~fitters.model.chip_time_regressor_slopes`).
        A fit whose steps spanned a narrow h range (agentic traffic at 0.85-0.99) cannot tell
        attention work from miss tokens over [0, 1) but can tell their slope near its steps'
        h: R'(h) there, the valley's test, is known where R(0) is not."""
        return unidentified_terms(self.collinear, self.coefficients, chip_time_regressor_slopes(isl, hit_ratio),
                                  "the slope in h of a request's chip time", f"at h={hit_ratio:g}, ISL={isl:g}")

    def unidentified_prefill(self, hit_ratio: float, isl: float) -> str | None:
        """Why the prefill of a request at (h, ISL) — one engine step and its compute, no decode:
        what the TTFTs count — is not identifiable, or None: :func:`unidentified_terms`, or its
        chip time z·β with a standard error √(zᵀΣz) (``chip_covariance``) over PREFILL_REL_STDERR
        of it."""
        z = chip_time_regressors(isl, 0.0, hit_ratio, 1.0)
        problem = unidentified_terms(self.collinear, self.coefficients, z, "a prefill", f"at h={hit_ratio:g}, ISL={isl:g}")
        if problem or self.chip_covariance is None:
            return problem
        chip = sum(k * x for k, x in zip(self.coefficients.as_tuple(), z))
        stderr = self._chip_stderr(z)
        if stderr <= PREFILL_REL_STDERR * chip:
            return None
        # the cause is not known here: traffic at one h, ISL and OSL, or steps too few or noisy for
        # the ranges they span (a real vLLM's at h 0-0.97, ISL 1024-2795 had been told the first)
        spans = "".join(f"; its steps' {what} [{r[0]:.4g}, {r[1]:.4g}]"
                        for what, r in (("h", self.h_range), ("ISL", self.isl_range), ("OSL", self.osl_range)) if r)
        return (f"not identifiable: the chip-time fit leaves a prefill's chip time uncertain by more than "
                f"{PREFILL_REL_STDERR:.0%} of it: its steps do not tell a prefill's work from the rest of their "
                "time (traffic at one h, ISL and OSL, or steps too few or too noisy for the ranges they span); "
                "more steps, over more varied traffic, tell it"
                + measured(f"at h={hit_ratio:g}, ISL={isl:g} {chip:.4g} ± {stderr:.4g} s of chip time{spans}"))

    def _with_alpha(self, chip_se: float, g: Sequence[float], d_alpha: float) -> float:
        """Standard error of g·β + d_alpha·α [s]: the chip part's ``chip_se`` (g over one engine's
        coefficients, CHIP_TIME_TERMS order), α's ``alpha_stderr`` and, with
        ``alpha_chip_gradient`` G, their covariance E²·gᵀΣ[:, :3]·G (α was fitted under one
        engine's coefficients, the fit's × E: fitters/latency.py's two-step delta method). On the
        simulator α's error ran against the chip time's (correlation -0.4 to -0.7): added as
        independent, the TTFT's 95 % interval at loaded hits h ≥ 0.5 was up to 1.7× wider (z-scores'
        RMS 0.3-0.8). A saved fit whose G disagrees with α's error (a variance ≤ 0) gets the
        independent sum."""
        var = chip_se * chip_se + (d_alpha * self.alpha_stderr) ** 2
        if self.alpha_chip_gradient is not None:
            # G pairs with Σ's first 3 columns, (t_step, k_ffn, k_attn)
            cross = self._chip_form(g, self.alpha_chip_gradient)
            with_cross = var + 2.0 * d_alpha * self.engines * self.engines * cross
            # α's variance holds G·Σ·Gᵀ (fitters/latency.py), so this stays > 0 unless a saved fit's
            # G and errors disagree (a review's G = (0, 1e5, 0) with α ± 0.01 gave 0): then without it
            var = with_cross if with_cross > 0.0 else var
        return math.sqrt(var)

    def _chip_form(self, a: Sequence[float], b: Sequence[float]) -> float:
        """aᵀΣb over ``chip_covariance`` Σ (not None; CHIP_TIME_TERMS order; a shorter b pairs with
        Σ's first columns)."""
        return sum(x * c * y for x, row in zip(a, self.chip_covariance) for c, y in zip(row, b))

    def _chip_stderr(self, g: Sequence[float]) -> float:
        """Standard error √(gᵀΣg) of g·β, a linear function of the chip-time coefficients
        (CHIP_TIME_TERMS order; Σ ``chip_covariance``, not None) [its unit]."""
        var = self._chip_form(g, g)
        # a sum that overflowed (inf - inf, a hand-edited covariance of 1e308s) is no bound at all
        return math.inf if math.isnan(var) else math.sqrt(max(var, 0.0))

    def ttft_unknown(self, hit_ratio: float, isl: float) -> str | None:
        """Why the TTFTs at (h, ISL) cannot be predicted, or None: the prefill is not identifiable
        (:meth:`unidentified_prefill`), or h > 0 while the loaded share is unknown (T_load)."""
        return self.unidentified_prefill(hit_ratio, isl) or (
            LOAD_SHARE_UNKNOWN if hit_ratio > 0 and self.hit_load_share is None else None)

    def predict(self, hit_ratio: float, isl: float, osl: float, seen: Sequence[float] | None = None) -> Prediction:
        """Predict at (h, ISL, OSL); a TTFT is None with the reason in ``Prediction.unknown`` (the
        prefill not identifiable or T_load unknown: :meth:`ttft_unknown`, α, S_kv or B_load
        unknown with loaded hits; load-aware: no contention fit or window inputs).

        A request whose chip time is not identifiable (:meth:`unidentified` with ``seen``: e.g.
        decode context told from decode tokens by no step, asked at another ISL) has no t_chip,
        TPM or revenue, with why; its TTFTs stand where its prefill is identifiable.

        Raises:
            ValueError: h outside [0, 1) or non-positive ISL / negative OSL; a fit whose chip
                time per request is 0 or not finite, or any output not finite (coefficients or
                prices far out of any real range);
                a request whose chip time is not identifiable and whose TTFT is unknown too
                (nothing to predict; the message says why).
        """
        if not (0.0 <= hit_ratio < 1.0) or not isl > 0 or osl < 0:
            raise ValueError("need 0 <= hit_ratio < 1, isl > 0, osl >= 0")
        problem = self.unidentified(hit_ratio, isl, osl, seen)
        coef = self.coefficients
        ttft_s = ttft_l = bound = None
        why = self.ttft_unknown(hit_ratio, isl)
        h_load = hit_ratio * self.hit_load_share if self.hit_load_share is not None else 0.0
        one = coef.per_engine(self.engines)  # a request's latency is one engine's
        ttft_se = None
        if why is None:
            ttft_s = service_ttft(one, isl, hit_ratio, h_load, self.alpha, self.kv_bytes_per_token,
                                  self.load_bandwidth)
            if ttft_s is not None and self.chip_covariance is not None:
                # one engine's coefficients are the fit's × engines: their errors too
                gradient = service_ttft_gradient(one, isl, hit_ratio, h_load, self.alpha, self.kv_bytes_per_token,
                                                 self.load_bandwidth)
                ttft_se = self.engines * self._chip_stderr(gradient)
                if h_load > 0 and self.alpha_stderr is not None:
                    # and α's, fitted apart: ∂TTFT/∂α = -min(T_load, T_compute) (MODEL.md §3.2). Left
                    # out, a soak's target TTFT was 8-16 % off, 30 of these σ (α 0.15 ± 0.22)
                    times = load_and_compute(one, isl, hit_ratio, h_load, self.kv_bytes_per_token, self.load_bandwidth)
                    ttft_se = self._with_alpha(ttft_se, gradient, -min(times))
            if ttft_s is None:
                why = ("hits are loaded from host memory (h_load > 0) and α, kv_bytes_per_token or the load "
                       "bandwidth is unknown, so T_load and its overlap are")
        unknown = {} if why is None else {"ttft_service": why, "ttft_load_aware": why}
        if why is None and None in (self.c0, self.c1, self.running, self.queue_time):
            missing = [what for what, absent in (("the load-aware fit's c0 and c1", None in (self.c0, self.c1)),
                                                 ("the publish window's num_requests_running", self.running is None),
                                                 ("the publish window's queue time", self.queue_time is None)) if absent]
            unknown["ttft_load_aware"] = f"needs {', '.join(missing)}, which kvhit does not have"
        elif why is None:
            ttft_l = self.queue_time + predict_prefill_latency(
                one, self.c0, self.c1, self.running, isl, hit_ratio, h_load, self.alpha, self.kv_bytes_per_token,
                self.load_bandwidth)
        if problem:
            if ttft_s is None:
                raise ValueError(f"{problem}; its TTFT is unknown too: {why}")
            per_request: dict[str, float | None] = dict.fromkeys(_PER_REQUEST)
            unknown.update(dict.fromkeys(_PER_REQUEST[1:], "reads the request's chip time: unknown (t_chip says why)"),
                           t_chip=problem)
        else:
            t_chip = coef.t_chip(isl, osl, hit_ratio, self.t_fixed)
            if not (t_chip > 0 and math.isfinite(t_chip)):
                raise ValueError(f"the fit gives a chip time of {t_chip!r} s per request: not a usable fit")
            delivered, physical = tpm_delivered(isl, osl, t_chip), tpm_physical(isl, osl, hit_ratio, t_chip)
            per_request = dict(
                t_chip=t_chip, tpm_delivered=delivered, tpm_physical=physical,
                tpm_delivered_per_gpu=delivered / self.gpus, tpm_physical_per_gpu=physical / self.gpus,
                revenue=revenue_chip_time(hit_ratio, isl, osl, coef, self.t_fixed, self.p_miss, self.p_hit, self.p_out))
            over = link_excess(delivered, isl, osl, self.link_feed(hit_ratio))
            if over:
                bound = (f"the TPMs and revenue read high: their prompt tokens/s pass what the KV-load link can "
                         f"feed, B_load x E / (S_kv x h_load), and chip time cannot see an asynchronous load "
                         f"(MODEL.md §3.4){measured(over)}")
        if ttft_se is not None and not math.isfinite(ttft_se):  # a covariance that overflowed: no error bar
            ttft_se = None
        for name, v in (("ttft_service", ttft_s), ("ttft_load_aware", ttft_l), *per_request.items()):
            if v is not None and not math.isfinite(v):  # a hand-edited fit: JSON has no Infinity
                raise ValueError(f"the fit gives {name} = {v!r}: not a usable fit (values far out of any real range)")
        ranges = (("h", hit_ratio, self.h_range, ""), ("ISL", isl, self.isl_range, " tokens"),
                  ("OSL", osl, self.osl_range, " tokens"))
        beyond = [f"{what} {x:g} outside the [{r[0]:g}, {r[1]:g}]{unit}"
                  for what, x, r, unit in ranges if r is not None and not r[0] <= x <= r[1]]
        # no range recorded is no answer: null would read "inside them" (a fit saved before kvhit kept them)
        untold = [what for what, _, r, _ in ranges if r is None]
        extrapolated = [f"{' and '.join(beyond)} of the chip-time fit's steps: the prediction extrapolates its "
                        "coefficients, and its standard errors do not count that (MODEL.md §7: another recording's "
                        "lengths erred up to 15 %; on the bundled CPU trace a fit over h <= 0.3 gave half the chip "
                        "time at h 0.96 that its first sweep's (to h 0.97) did)"] if beyond else []
        if untold:
            extrapolated.append(f"unknown for {' and '.join(untold)} whether this what-if lies inside the chip-time "
                                "fit's steps: the fit records no range of them (no step told them, or a fit saved by an "
                                "older kvhit, which kept none: save it again with kvhit replay --save-fit)")
        return Prediction(
            hit_ratio=hit_ratio, isl=isl, osl=osl, **per_request,
            ttft_service=ttft_s, ttft_load_aware=ttft_l, ttft_service_stderr=ttft_se,
            unknown=unknown, kv_load_bound=bound, extrapolated="; ".join(extrapolated) or None,
        )

    def to_dict(self) -> dict:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> "FittedModel":
        """Load from :meth:`to_dict` output.

        Raises:
            ValueError: wrong schema version, missing fields, or a field out of its range (the
                message names it): coefficients, running, queue time and prices finite and ≥ 0,
                steps per request in (0, 1e7], c0/c1 ≥ 0, α and the loaded share in [0, 1], S_kv and
                B_load > 0, gpus a whole number ≥ 1, collinear a mapping of chip-time terms,
                isl_range and osl_range [min, max] with 0 ≤ min ≤ max, h_range with 0 ≤ min ≤ max ≤ 1.
        """
        if data.get("schema_version") != SCHEMA_VERSION:
            version = data.get("schema_version")
            newer = isinstance(version, (int, float)) and not isinstance(version, bool) and version > SCHEMA_VERSION
            raise ValueError(f"fit schema_version must be {SCHEMA_VERSION} " + (
                "(a fit saved by a newer kvhit: read it with that kvhit)" if newer else
                "(a fit saved by an older kvhit: save it again with kvhit replay --save-fit)"))
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        try:
            model = cls(**kwargs)
        except TypeError as exc:
            raise ValueError(f"fit is missing fields: {exc}") from None
        for name, ok, what in _FIELD_RANGES:
            v = getattr(model, name)
            if v is None and name in NULLABLE:
                continue
            if not finite_number(v) or not ok(v):
                raise ValueError(f"fit field {name} must be {what}")
        relations = model.collinear or {}
        if not (isinstance(relations, dict) and all(
                t in CHIP_TIME_TERMS and isinstance(r, dict) and all(
                    k in CHIP_TIME_TERMS and finite_number(c) for k, c in r.items()) for t, r in relations.items())):
            raise ValueError("fit field collinear must map chip-time terms to {term: finite number}")
        cov = model.chip_covariance
        if cov is not None and not (isinstance(cov, list) and len(cov) == len(CHIP_TIME_TERMS) and all(
                isinstance(row, list) and len(row) == len(CHIP_TIME_TERMS) and all(map(finite_number, row))
                for row in cov) and all(cov[i][i] >= 0 for i in range(len(cov)))):
            raise ValueError("fit field chip_covariance must be null or 5 rows of 5 finite numbers, variances >= 0")
        grad = model.alpha_chip_gradient
        if grad is not None and not (isinstance(grad, list) and len(grad) == 3 and all(map(finite_number, grad))):
            raise ValueError("fit field alpha_chip_gradient must be null or 3 finite numbers")
        for name, top in (("isl_range", math.inf), ("osl_range", math.inf), ("h_range", 1.0)):
            r = getattr(model, name)
            if r is not None and not (isinstance(r, list) and len(r) == 2 and all(map(finite_number, r))
                                      and 0 <= r[0] <= r[1] <= top):
                raise ValueError(f"fit field {name} must be null or [min, max], finite numbers 0 <= min <= max"
                                 + (f" <= {top:g}" if top < math.inf else ""))
        return model
