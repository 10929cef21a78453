"""The seed formulas as pure functions (MODEL.md §3–§5, seeds 000, 002, 003, 004).

No state, no I/O, no fitting: every function maps numbers to numbers and cites its section.
Units: tokens, seconds, bytes, prices in currency units per token unless a name says otherwise.
Hit ratios are fractions in [0, 1].
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# --- §3.1 / §3.2: hit-ratio correction of prefill work ------------------------------------


def max_hit_ratio(isl: float) -> float:
    """h_max = 1 − 1/ISL [1], the highest token hit ratio of an ISL-token prompt: vLLM always
    computes its last token (it needs its logits), so it is never a hit. ``isl`` > 0 [tokens]."""
    return 1.0 - 1.0 / isl


def hits_exceed(queried: float, hits: float) -> bool:
    """Whether ``hits`` [tokens] exceed ``queried`` [tokens] beyond float rounding: impossible for
    one engine's counters over one interval (MODEL.md §1, h ≤ 1), a corrupted or torn read."""
    return hits > queried * (1 + 1e-9)


def attention_work(isl: float, h: float) -> float:
    """Causal attention work of a prefill with a cached prefix: W = M·H + M²/2 [tokens²].

    M = (1-h)·N miss tokens attend to the H = h·N cached prefix and to each other.
    W / (N²/2) = 1 - h² (MODEL.md §3.1, seed 000 §2).
    """
    m = (1.0 - h) * isl
    return m * (h * isl) + m * m / 2.0


def attention_ratio(h: float) -> float:
    """W_hit / W_0 = 1 - h² (MODEL.md §3.1)."""
    return 1.0 - h * h


def ffn_ratio(h: float) -> float:
    """FFN/GEMM work ratio 1 - h (MODEL.md §3.1)."""
    return 1.0 - h


def compute_time_seed(h: float, t_attn0: float, t_ffn0: float) -> float:
    """T_compute(h) = T_attn,0·(1-h²) + T_ffn,0·(1-h) [s] (MODEL.md §3.2, seed 000 §4)."""
    return t_attn0 * attention_ratio(h) + t_ffn0 * ffn_ratio(h)


def load_time(h_load: float, isl: float, kv_bytes_per_token: float, load_bandwidth: float) -> float:
    """T_load = h_load·N·S_kv / B_load [s] (MODEL.md §3.2).

    ``kv_bytes_per_token`` must be the per-GPU shard (§3.6); ``load_bandwidth`` in bytes/s per GPU.
    Raises ValueError for a bandwidth that is not a number > 0.
    """
    if not load_bandwidth > 0:  # NaN too: no T_load from an unknown bandwidth
        raise ValueError("load_bandwidth must be > 0 bytes/s")
    return h_load * isl * kv_bytes_per_token / load_bandwidth


def overlap_time(overlap: float, t_load: float, t_compute: float) -> float:
    """T_overlap = α·min(T_load, T_compute) [s] (MODEL.md §3.2). Raises ValueError for α outside
    [0, 1] (MODEL.md §1: more overlap than the shorter part is no overlap, NaN no α)."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap α must be in [0, 1], got {overlap!r}")
    return overlap * min(t_load, t_compute)


def ttft_unified(t_fixed: float, t_load: float, t_compute: float, overlap: float) -> float:
    """TTFT = T_fixed + T_load + T_compute - α·min(T_load, T_compute) [s] (MODEL.md §3.2).

    α = 0 gives the sum, α = 1 gives T_fixed + max(T_load, T_compute). Raises ValueError for α
    outside [0, 1] (:func:`overlap_time`).
    """
    return t_fixed + t_load + t_compute - overlap_time(overlap, t_load, t_compute)


# --- §3.3: first-order capacity ----------------------------------------------------------


def load_compute_ratio(isl: float, kv_bytes_per_token: float, load_bandwidth: float, t0: float) -> float:
    """δ = N·S_kv / (B_load·T0) [1] (MODEL.md §1, §3.3): loading all N tokens vs computing them."""
    return isl * kv_bytes_per_token / (load_bandwidth * t0)


def capacity_first_order(theta0: float, h: float, h_load: float, delta: float) -> float:
    """Θ(h) = Θ0 / max(1-h, δ·h_load) (MODEL.md §3.3; the seed's δ·h assumes every hit is loaded).

    Same unit as ``theta0``. Raises ZeroDivisionError only at h = 1 with no loaded hits.
    """
    return theta0 / max(1.0 - h, delta * h_load)


def load_link_rate(load_bandwidth: float, kv_bytes_per_token: float, h_load: float) -> float:
    """B_load / (S_kv·h_load) [prompt tokens/s] (MODEL.md §3.3): the most prompt tokens per second
    a KV-load link can feed when a share ``h_load`` of them is loaded, Θ's load term Θ0/(δ·h_load).
    Raises ZeroDivisionError with no loaded hits (h_load = 0: no bound)."""
    return load_bandwidth / (kv_bytes_per_token * h_load)


# --- §3.6: KV sizes ---------------------------------------------------------------------


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: float, tp: int = 1) -> float:
    """Per-token, per-GPU KV bytes S_kv = 2·L·max(1, n_kv/n_tp)·d_head·b [bytes] (MODEL.md §3.6).

    KV heads are split across TP ranks and replicated when tp > kv_heads.
    """
    return 2.0 * layers * max(1.0, kv_heads / tp) * head_dim * dtype_bytes


def kv_bytes_per_token_mla(layers: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype_bytes: float) -> float:
    """MLA latent cache: L·(kv_lora_rank + qk_rope_head_dim)·b [bytes/token], same on every TP rank
    (MODEL.md §3.6, DeepSeek-V2/V3)."""
    return float(layers) * (kv_lora_rank + qk_rope_head_dim) * dtype_bytes


# --- §7: chip-time model ----------------------------------------------------------------

CHIP_TIME_TERMS: tuple[str, ...] = ("t_step", "k_ffn", "k_attn", "k_dec", "k_ctx")
# What each term's coefficient multiplies, in words (reasons, messages).
CHIP_TIME_REGRESSOR_WORDS = {
    "t_step": "engine steps",
    "k_ffn": "miss tokens",
    "k_attn": "attention work",
    "k_dec": "decode tokens",
    "k_ctx": "decode context",
}


def relation_text(relation: dict[str, float]) -> str:
    """A collinear relation {term: c} as ``-4018 × engine steps + 3100 × decode tokens`` (signs
    between the terms, CHIP_TIME_REGRESSOR_WORDS); "0" when it has none."""
    parts = [f"{c:.4g} × {CHIP_TIME_REGRESSOR_WORDS[t]}" if i == 0
             else f"{'-' if c < 0 else '+'} {abs(c):.4g} × {CHIP_TIME_REGRESSOR_WORDS[t]}"
             for i, (t, c) in enumerate(relation.items())]
    return " ".join(parts) or "0"


def chip_time_regressors(isl: float, osl: float, h: float, steps: float) -> tuple[float, ...]:
    """One request's regressors in CHIP_TIME_TERMS order (MODEL.md §7): engine steps, miss tokens
    M = (1-h)·ISL, attention work M·H + M²/2 [tokens²], decode tokens OSL and decode context
    OSL·(ISL + OSL/2) [tokens²]; t_chip = Σ coefficient × regressor."""
    return (steps, (1.0 - h) * isl, attention_work(isl, h), osl, osl * decode_context_per_token(isl, osl))


def chip_time_regressor_slopes(isl: float, h: float) -> tuple[float, ...]:
    """−∂/∂h of one request's regressors (:func:`chip_time_regressors`) in CHIP_TIME_TERMS order:
    0, ISL, h·ISL² (W = ISL²·(1 − h²)/2), 0, 0; −t_chip'(h) = Σ coefficient × these [s per unit h]
    (the chip-time bathtub's R'(h) needs t_chip'(h), MODEL.md §4)."""
    return (0.0, isl, h * isl * isl, 0.0, 0.0)


@dataclass(frozen=True)
class ChipTimeCoefficients:
    """Coefficients of Δt_busy ≈ T_step·Δsteps + k_ffn·ΔM + k_attn·ΔW + k_dec·ΔG + k_ctx·ΔC (MODEL.md §7).

    Units: t_step [s/step], k_ffn [s/token], k_attn [s/token²], k_dec [s/token],
    k_ctx [s/(generated token · KV token read)].
    """

    t_step: float
    k_ffn: float
    k_attn: float
    k_dec: float
    k_ctx: float

    def as_tuple(self) -> tuple[float, ...]:
        return (self.t_step, self.k_ffn, self.k_attn, self.k_dec, self.k_ctx)

    def check(self, *names: str) -> None:
        """Raises ValueError unless each named coefficient (CHIP_TIME_TERMS) is finite and ≥ 0, as
        the chip-time fit's bounds make them."""
        for name in names:
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"chip-time coefficient {name} must be finite and ≥ 0, got {v!r}")

    def per_engine(self, engines: float) -> "ChipTimeCoefficients":
        """One engine's coefficients when these were fitted on ``engines`` busy engines summed as
        one machine (their summed steps and tokens against wall-clock busy time, §7): every term × E,
        exact when the busy engines share the load evenly. A request runs on one engine, so its
        latencies (TTFT, the overlap α) need these, and the machine's throughput the summed ones."""
        return ChipTimeCoefficients(*(engines * c for c in self.as_tuple()))

    def compute_time(self, isl: float, h: float) -> float:
        """Hit-dependent prefill chip time k_ffn·M + k_attn·(M·H + M²/2) [s] (§3.2 in §7 units)."""
        return self.k_ffn * (1.0 - h) * isl + self.k_attn * attention_work(isl, h)

    def decode_time(self, isl: float, osl: float) -> float:
        """Decode chip time OSL·(k_dec + k_ctx·(ISL + OSL/2)) [s] (MODEL.md §7)."""
        return osl * (self.k_dec + self.k_ctx * decode_context_per_token(isl, osl))

    def t_chip(self, isl: float, osl: float, h: float, t_fixed: float) -> float:
        """Per-request chip time t_chip(h) = T_fixed + compute + decode [s] (MODEL.md §7, §3.4)."""
        return t_fixed + self.compute_time(isl, h) + self.decode_time(isl, osl)

    def d_t_chip_dh(self, isl: float, h: float) -> float:
        """∂t_chip/∂h = -k_ffn·N - k_attn·N²·h [s] (T_fixed and decode do not depend on h)."""
        return -self.k_ffn * isl - self.k_attn * isl * isl * h


def decode_context_per_token(isl: float, osl: float) -> float:
    """Mean KV tokens read per generated token, ISL + OSL/2 [tokens] (MODEL.md §7)."""
    return isl + osl / 2.0


def steps_fixed_time(t_step: float, steps_per_request: float) -> float:
    """T_fixed = T_step × the request's share of engine steps [s] (MODEL.md §7)."""
    return t_step * steps_per_request


# --- §3.4 / §3.5: TPM --------------------------------------------------------------------


def _per_request_chip_time(t_chip: float) -> None:
    if not 0.0 < t_chip < math.inf:
        raise ValueError(f"t_chip must be a finite time > 0 s per request, got {t_chip!r}")


def tpm_delivered(isl: float, osl: float, t_chip: float) -> float:
    """Delivered TPM = (ISL + OSL)·60 / t_chip [tokens/min]; cached input counts (MODEL.md §3.4).
    Raises ValueError unless 0 < t_chip < ∞."""
    _per_request_chip_time(t_chip)
    return (isl + osl) * 60.0 / t_chip


def tpm_physical(isl: float, osl: float, h: float, t_chip: float) -> float:
    """Physical TPM = (ISL·(1-h) + OSL)·60 / t_chip [tokens/min]: what the hardware computed (§3.4).
    Raises ValueError unless 0 < t_chip < ∞ and 0 ≤ h ≤ 1."""
    _per_request_chip_time(t_chip)
    if not 0.0 <= h <= 1.0:
        raise ValueError(f"h must be in [0, 1], got {h!r}")
    return (isl * (1.0 - h) + osl) * 60.0 / t_chip


def tpm_hit_correction(
    tpm_delivered_measured: float, c_measured: float, c_target: float, isl: float, osl: float, h_target: float
) -> tuple[float, float]:
    """Hit→hit correction (MODEL.md §3.5, seed 000 §8).

    Returns (delivered, physical) TPM at h_target from the delivered TPM measured at a hit ratio
    whose per-request chip time is ``c_measured``; ``c_target`` is C(h_target) = P + D [s].
    """
    delivered = tpm_delivered_measured * c_measured / c_target
    physical = delivered * (isl * (1.0 - h_target) + osl) / (isl + osl)
    return delivered, physical


# --- §4: the bathtub, linear form ---------------------------------------------------------


def miss_tps_linear(h: float, tps0: float, a: float) -> float:
    """TPS_miss(h) = TPS0·(1 - a·h) [tokens/s] (MODEL.md §4, seed 002 §3.2)."""
    return tps0 * (1.0 - a * h)


def hit_tps_linear(h: float, tps0: float, a: float) -> float:
    """TPS_hit(h) = h/(1-h)·TPS_miss(h) [tokens/s] (MODEL.md §4); h < 1."""
    return h / (1.0 - h) * miss_tps_linear(h, tps0, a)


def revenue_linear(h: float, tps0: float, a: float, p_miss: float, rho: float) -> float:
    """R(h) = TPS0·P_miss·(1-a·h)·(1-(1-ρ)·h)/(1-h) [price/s] (MODEL.md §4); h < 1."""
    return tps0 * p_miss * (1.0 - a * h) * (1.0 - (1.0 - rho) * h) / (1.0 - h)


def revenue_slope_linear(h: float, tps0: float, a: float, p_miss: float, rho: float) -> float:
    """dR/dh of :func:`revenue_linear` [price/s per unit h]; R'(0) = TPS0·P_miss·(ρ - a) (MODEL.md §4).

    With u = (1-a·h)(1-(1-ρ)h): R' = TPS0·P_miss·(u'(1-h) + u)/(1-h)².
    """
    b = 1.0 - rho
    u = (1.0 - a * h) * (1.0 - b * h)
    du = -a * (1.0 - b * h) - b * (1.0 - a * h)
    return tps0 * p_miss * (du * (1.0 - h) + u) / (1.0 - h) ** 2


def valley_bottom_linear(a: float, rho: float) -> float | None:
    """h* = 1 - sqrt(ρ(1-a)/(a(1-ρ))), the bottom of the bathtub; None unless 0 < ρ < a < 1 (MODEL.md §4)."""
    if not (0.0 < rho < a < 1.0):
        return None
    return 1.0 - math.sqrt(rho * (1.0 - a) / (a * (1.0 - rho)))


def breakeven_linear(a: float, rho: float) -> float | None:
    """h_even = (a-ρ)/(a(1-ρ)), where R climbs back to R(0); None unless 0 < ρ < a < 1 (MODEL.md §4)."""
    if not (0.0 < rho < a < 1.0):
        return None
    return (a - rho) / (a * (1.0 - rho))


# --- §4: the bathtub, chip-time form ------------------------------------------------------


def revenue_chip_time(
    h: float,
    isl: float,
    osl: float,
    coef: ChipTimeCoefficients,
    t_fixed: float,
    p_miss: float,
    p_hit: float,
    p_out: float,
) -> float:
    """R(h) = (P_miss·M + P_hit·H + P_out·OSL) / t_chip(h) [price/s] per machine-second (MODEL.md §4)."""
    return revenue_per_request(h, isl, osl, p_miss, p_hit, p_out) / coef.t_chip(isl, osl, h, t_fixed)


def revenue_per_request(h: float, isl: float, osl: float, p_miss: float, p_hit: float, p_out: float) -> float:
    """Revenue of one request P_miss·M + P_hit·H + P_out·OSL [price] (MODEL.md §4)."""
    return p_miss * (1.0 - h) * isl + p_hit * h * isl + p_out * osl


def revenue_slope_chip_time(
    h: float,
    isl: float,
    osl: float,
    coef: ChipTimeCoefficients,
    t_fixed: float,
    p_miss: float,
    p_hit: float,
    p_out: float,
) -> float:
    """dR/dh of :func:`revenue_chip_time` by the quotient rule [price/s per unit h] (MODEL.md §4)."""
    num = revenue_per_request(h, isl, osl, p_miss, p_hit, p_out)
    den = coef.t_chip(isl, osl, h, t_fixed)
    dnum = (p_hit - p_miss) * isl
    return (dnum * den - num * coef.d_t_chip_dh(isl, h)) / (den * den)


# --- §5: seed 003, cost and switches ------------------------------------------------------


def unit_cost_per_million(instance_hour_price: float, slo_output_tps: float) -> float:
    """Cost per 1M SLO-passing output tokens = price/h × 1e6 / (tokens/s × 3600) (MODEL.md §5)."""
    return instance_hour_price * 1e6 / (slo_output_tps * 3600.0)


def effective_cost(unit_cost: float, retry_rate: float) -> float:
    """Effective cost = unit cost / (1 - retry rate) (MODEL.md §5); retry_rate in [0, 1)."""
    return unit_cost / (1.0 - retry_rate)


def slo_pass_bounds(p_ttft: float, p_tpot: float) -> tuple[float, float]:
    """Fréchet bounds on the joint SLO pass rate: (max(0, p1+p2-1), min(p1, p2)) (MODEL.md §5)."""
    return max(0.0, p_ttft + p_tpot - 1.0), min(p_ttft, p_tpot)


def prefill_share(prefill_time: float, decode_time: float) -> float:
    """P̄ / (P̄ + D̄) [1] (MODEL.md §5)."""
    return prefill_time / (prefill_time + decode_time)


def caching_speedup(h: float, share: float) -> float:
    """Speedup from prefix caching ≈ 1 / (1 - h·prefill_share) (MODEL.md §5, seed 003)."""
    return 1.0 / (1.0 - h * share)
