"""Seed 003's cost per 1M SLO-passing output tokens from marginal histograms (MODEL.md §5). Pure.

    unit cost      = instance-hour price × 1e6 / (SLO-passing output tokens/s × 3600)
    effective cost = unit cost / (1 − retry rate)
    max(0, p_ttft + p_tpot − 1) ≤ p ≤ min(p_ttft, p_tpot)           (Fréchet bounds)

p_ttft / p_tpot are the shares of requests whose TTFT / TPOT is at most its SLO, read from the
bucket deltas of the publish window (TTFT: ``time_to_first_token_seconds``; TPOT:
``request_time_per_output_token_seconds`` when exported, vLLM ≥ 0.11, else the inter-token
latency histogram — per token gap, not per request, so the caller labels which one was used).

Choices where MODEL.md is silent:
- An SLO between two bucket edges: each share is bracketed by the edge below (lower) and the
  edge above (upper), :func:`fitters.histogram.share_at_most`; the joint lower bound uses both
  lower shares, the joint upper bound both upper shares, so [lower, upper] still contains p.
- SLO-passing output tokens/s = p × output tokens/s of the window: the histograms are marginal
  and carry no output length, so passing requests are assumed to have the window's mean
  output length.
- The cost at the *upper* pass bound is the *lower* cost and vice versa; a pass bound of 0
  makes that cost unbounded (None: nothing is guaranteed to pass).
"""
from __future__ import annotations

from dataclasses import dataclass

from .histogram import Buckets, share_at_most
from .model import effective_cost, slo_pass_bounds, unit_cost_per_million

@dataclass(frozen=True)
class SloShares:
    """Bracketed share of requests within one SLO [1] (lower ≤ true share ≤ upper)."""

    lower: float
    upper: float


@dataclass(frozen=True)
class SloCost:
    """Pass-rate bounds and the seed-003 cost at both bounds for one publish window.

    Attributes:
        ttft, tpot: bracketed per-SLO shares.
        pass_lower, pass_upper: Fréchet bounds of the joint pass rate [1].
        output_tps: output tokens per second of the window [tokens/s].
        cost_lower, cost_upper: cost per 1M SLO-passing output tokens at the upper / lower pass
            bound [price per 1M tokens]; None when unknown or unbounded (see ``reasons``).
        effective_lower, effective_upper: the same divided by (1 − retry rate).
        reasons: "cost_lower"/"cost_upper" → why that value is None.
    """

    ttft: SloShares
    tpot: SloShares
    pass_lower: float
    pass_upper: float
    output_tps: float | None = None
    cost_lower: float | None = None
    cost_upper: float | None = None
    effective_lower: float | None = None
    effective_upper: float | None = None
    reasons: dict[str, str] | None = None


def slo_shares(buckets: Buckets, count: float, slo: float) -> SloShares | None:
    """Share of requests with value ≤ ``slo`` (in the histogram's ``le`` unit, seconds for
    latencies) from bucket deltas, bracketed (None without data; fitters/histogram.py
    ``share_at_most``)."""
    got = share_at_most(buckets, count, slo)
    return None if got is None else SloShares(*got)


def pass_bounds(ttft: SloShares, tpot: SloShares) -> tuple[float, float]:
    """(lower, upper) joint pass rate: Fréchet lower bound of the lower shares, upper bound of
    the upper shares (MODEL.md §5, :func:`fitters.model.slo_pass_bounds`)."""
    lower = slo_pass_bounds(ttft.lower, tpot.lower)[0]
    upper = slo_pass_bounds(ttft.upper, tpot.upper)[1]
    return lower, upper


def slo_cost(ttft: SloShares, tpot: SloShares, output_tps: float | None,
             instance_hour_price: float | None, retry_rate: float = 0.0) -> SloCost:
    """Pass bounds and, with a price and output throughput, the cost at both bounds (MODEL.md §5).

    Args:
        output_tps: output (generated) tokens per second over the window [tokens/s]; None = unknown.
        instance_hour_price: price of one instance-hour [price]; None = not configured.
        retry_rate: share of requests retried, in [0, 1).
    Raises ValueError for a retry rate outside [0, 1) or a negative price / throughput.
    """
    if not 0.0 <= retry_rate < 1.0:
        raise ValueError(f"retry_rate must be in [0, 1), got {retry_rate!r}")
    if (instance_hour_price is not None and instance_hour_price < 0) or (output_tps is not None and output_tps < 0):
        raise ValueError("instance_hour_price and output_tps must be >= 0")
    lo, hi = pass_bounds(ttft, tpot)
    out = SloCost(ttft, tpot, lo, hi, output_tps)
    reasons: dict[str, str] = {}
    if instance_hour_price is None:
        reasons["cost_lower"] = reasons["cost_upper"] = "instance_hour_price not configured"
    elif output_tps is None:
        reasons["cost_lower"] = reasons["cost_upper"] = "output tokens per second unknown (no generation_tokens counter)"
    elif output_tps == 0:
        reasons["cost_lower"] = reasons["cost_upper"] = "no output tokens in the publish window"
    costs: dict[str, float | None] = {"cost_lower": None, "cost_upper": None}
    if not reasons:
        for key, p in (("cost_lower", hi), ("cost_upper", lo)):
            if p <= 0:
                reasons[key] = "the pass-rate bound is 0: no output token is guaranteed to meet the SLOs"
            else:
                costs[key] = unit_cost_per_million(instance_hour_price, p * output_tps)
    eff = {k: (None if v is None else effective_cost(v, retry_rate)) for k, v in costs.items()}
    return SloCost(out.ttft, out.tpot, lo, hi, output_tps, costs["cost_lower"], costs["cost_upper"],
                   eff["cost_lower"], eff["cost_upper"], reasons or None)
