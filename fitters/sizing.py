"""KV sizing, the first-order capacity bound and the economic max-num-seqs (MODEL.md §3.3, §3.6, §5).

Pure functions (seed 000 §6.1 and §7, seed 004 §3.3):

    concurrency ceiling  = ⌊KV capacity [tokens] / (ISL + OSL)⌋
    peak KV per GPU      = B · N_max · S_kv                        (seed 000 §7.1)
    Θ0 = N / T0,  δ = N·S_kv / (B_load·T0),  Θ(h) = Θ0 / max(1−h, δ·h_load)   (§3.3)

and one online fitter, :class:`TpotConcurrencyFitter`: TPOT P95 against running concurrency,
solved for the concurrency where TPOT P95 reaches 80 % of the TPOT SLO (seed 003 §3: the
economic ``--max-num-seqs``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .histogram import P95, quantile, rank_index
from .model import capacity_first_order, load_compute_ratio
from .result import Estimate, FitResult, Status, measured

# Seed 003: "把 TPOT P95 打到 SLO 的 80%" — the online pool's starting max-num-seqs.
TPOT_SLO_SHARE = 0.8


# --- KV sizes (MODEL.md §3.6, seed 000 §7, seed 004 §3.3) ----------------------------------


def max_concurrency(capacity_tokens: float, tokens_per_request: float) -> int:
    """Requests whose whole KV (ISL + OSL tokens each, no prefix sharing) fit at once [requests].

    ⌊capacity / tokens per request⌋: a conservative ceiling, since shared prefix blocks are
    stored once. Raises ValueError for a non-positive request size or negative capacity.
    """
    if tokens_per_request <= 0 or capacity_tokens < 0:
        raise ValueError("need tokens_per_request > 0 and capacity_tokens >= 0")
    return int(math.floor(capacity_tokens / tokens_per_request + 1e-9))


def concurrency_from_memory(kv_memory_bytes: float, kv_bytes_per_token: float, tokens_per_request: float) -> int:
    """Seed 004 §3.3: ⌊KV memory / (S_kv · tokens per request)⌋ [requests] (same GPU scope for
    memory and S_kv)."""
    if kv_bytes_per_token <= 0:
        raise ValueError("kv_bytes_per_token must be > 0")
    return max_concurrency(kv_memory_bytes / kv_bytes_per_token, tokens_per_request)


def peak_kv_bytes(batch: int, max_len: float, kv_bytes_per_token: float) -> float:
    """M_KV^peak = B · N_max · S_kv [bytes per GPU when S_kv is per GPU] (seed 000 §7.1): batch B
    [requests], max_len N_max [tokens], kv_bytes_per_token S_kv [bytes/token]. Raises ValueError
    when any is negative."""
    if batch < 0 or max_len < 0 or kv_bytes_per_token < 0:
        raise ValueError("batch, max_len and kv_bytes_per_token must be >= 0")
    return float(batch) * max_len * kv_bytes_per_token


# --- first-order capacity (MODEL.md §3.3, seed 000 §6.1) -----------------------------------


@dataclass(frozen=True)
class FirstOrderCapacity:
    """Θ(h) = Θ0 / max(1−h, δ·h_load) with Θ0 = N/T0 [prompt tokens/s] (MODEL.md §3.3).

    Attributes:
        isl: N [tokens]; t0: 0-hit prefill compute time of one request [s];
        delta: δ = N·S_kv/(B_load·T0) [1], None when S_kv or B_load is unknown.
    The bound assumes full load/compute overlap and no fixed cost: an upper bound of prefill
    capacity, which never grows like 1/(1−h) once hits must be loaded.
    """

    isl: float
    t0: float
    delta: float | None

    @property
    def theta0(self) -> float:
        """Θ0 = N / T0 [prompt tokens/s]."""
        return self.isl / self.t0

    def theta(self, h: float, h_load: float | None) -> float | None:
        """Θ(h) [prompt tokens/s]. ``h_load`` None (loaded share unknown) uses the seed's δ·h
        (every hit loaded — the conservative reading); None when δ would be needed (h_load > 0)
        but is unknown, or at h = 1 without loaded hits (unbounded)."""
        if h_load is None:
            h_load = h  # every hit loaded (at h = 0 none: no δ needed)
        if h_load > 0 and self.delta is None:
            return None
        delta = self.delta if self.delta is not None else 0.0
        if max(1.0 - h, delta * h_load) <= 0:
            return None
        return capacity_first_order(self.theta0, h, h_load, delta)


def first_order_capacity(isl: float, t0: float, kv_bytes_per_token: float | None,
                         load_bandwidth: float | None) -> FirstOrderCapacity:
    """Build the §3.3 model from N, T0 and (optionally) S_kv and B_load.

    Raises ValueError unless isl > 0 and t0 > 0.
    """
    if not (isl > 0 and t0 > 0):
        raise ValueError("need isl > 0 and t0 > 0")
    delta = None
    if kv_bytes_per_token is not None and load_bandwidth:
        delta = load_compute_ratio(isl, kv_bytes_per_token, load_bandwidth, t0)
    return FirstOrderCapacity(isl, t0, delta)


# --- economic max-num-seqs (MODEL.md §5, seed 003 §3) -------------------------------------


@dataclass
class _Level:
    edges: tuple[float, ...]
    counts: np.ndarray  # cumulative per edge, decayed
    total: float  # decayed Δcount
    steps: int
    last_t: float


class TpotConcurrencyFitter:
    """TPOT P95 against running concurrency; the concurrency where P95 = 80 % of the SLO.

    Each step's TPOT bucket deltas are added to the integer concurrency level nearest to the
    step's mean ``num_requests_running`` (requests finishing in a step ran at about that
    concurrency). Per level, P95 comes from the accumulated buckets (:func:`quantile`,
    interpolated inside the bucket; above every finite edge, that edge: a lower bound, which
    still shows TPOT rising where the buckets end). A weighted line P95 = b0 + b1·running (weights: requests
    per level) is solved for running* = (0.8·SLO − b0)/b1.

    Memory bound: at most ``max_levels`` levels (the least recently seen one is dropped), each
    one bucket vector; counts decay with ``half_life_seconds`` (exponential forgetting,
    MODEL.md §6), so the fit follows a changed deployment. A level whose bucket edges change
    (engine restarted with other buckets) restarts from the new step.
    """

    def __init__(self, half_life_seconds: float = 3600.0, max_levels: int = 256, min_requests: float = 20.0,
                 min_levels: int = 3) -> None:
        if half_life_seconds <= 0 or max_levels < 2 or min_requests <= 0 or min_levels < 2:
            raise ValueError("need half_life_seconds > 0, max_levels >= 2, min_requests > 0, min_levels >= 2")
        self.min_levels = min_levels
        self.half_life_seconds = half_life_seconds
        self.max_levels = max_levels
        self.min_requests = min_requests
        self._levels: dict[int, _Level] = {}
        self._t: float | None = None

    def __len__(self) -> int:
        return len(self._levels)

    def update(self, t: float, running: float | None, buckets: Sequence[tuple[float, float]], count: float) -> bool:
        """Add one step (of one engine: data-parallel engines are each one observation, at their
        own concurrency): ``running`` = mean num_requests_running of the step, ``buckets`` /
        ``count`` = the step's TPOT histogram delta. True if used (running ≥ 0.5, count > 0,
        buckets present and finite)."""
        if running is None or not math.isfinite(running) or running < 0.5 or not count > 0 or not buckets:
            return False
        if not all(math.isfinite(c) for _, c in buckets) or not math.isfinite(count):
            return False
        if self._t is not None and t > self._t:
            factor = 0.5 ** ((t - self._t) / self.half_life_seconds)
            for lv in self._levels.values():
                lv.counts *= factor
                lv.total *= factor
        self._t = t if self._t is None else max(self._t, t)
        key = int(math.floor(running + 0.5))
        edges = tuple(le for le, _ in buckets)
        counts = np.array([c for _, c in buckets], dtype=float)
        lv = self._levels.get(key)
        if lv is None or lv.edges != edges:
            self._levels[key] = _Level(edges, counts, float(count), 1, t)
        else:
            lv.counts += counts
            lv.total += float(count)
            lv.steps += 1
            lv.last_t = t
        if len(self._levels) > self.max_levels:
            oldest = min(self._levels, key=lambda k: self._levels[k].last_t)
            del self._levels[oldest]
        return True

    def levels(self) -> list[tuple[int, float, float]]:
        """(concurrency, TPOT P95 [s], requests) of every level with ≥ ``min_requests`` requests."""
        out = []
        for key in sorted(self._levels):
            lv = self._levels[key]
            if lv.total < self.min_requests:
                continue
            buckets = tuple(zip(lv.edges, lv.counts))
            p95 = quantile(buckets, lv.total, P95)
            if p95 is None and (i := rank_index(buckets, lv.total, P95)) and math.isinf(lv.edges[i]):
                p95 = lv.edges[i - 1]  # in the +Inf bucket: the highest finite edge, a lower bound
            if p95 is not None:
                out.append((key, p95, lv.total))
        return out

    def _bucket(self, level: int) -> tuple[float, float]:
        """(lower, upper] edges [s] of the bucket of ``level``'s histogram that holds its P95's rank
        (as :func:`~fitters.histogram.quantile` finds it; (highest finite edge, inf] where
        :meth:`levels` takes that edge)."""
        lv = self._levels[level]
        i = rank_index(tuple(zip(lv.edges, lv.counts)), lv.total, P95)  # not None: levels() has its P95
        return (lv.edges[i - 1] if i > 0 else 0.0), lv.edges[i]

    def result(self, tpot_slo: float | None, share: float = TPOT_SLO_SHARE) -> FitResult:
        """The fit and running* (MODEL.md §5, §6).

        Params: "p95_at_zero" b0 [s], "p95_per_request" b1 [s per running request],
        "concurrency_at_target" running* [requests]. Extra: "target_seconds" (share·SLO),
        "levels" ([[concurrency, P95, requests], …]), "extrapolated" (running* outside the
        observed levels). Status: insufficient_data (no level with enough requests, or no SLO),
        insufficient_variation (fewer than ``min_levels`` levels: a curve needs several points),
        not_identifiable (the slope is not above 0 by two standard errors: TPOT P95 does not
        visibly rise with concurrency, so no concurrency-limited answer), else ok.
        """
        levels = self.levels()
        steps = sum(self._levels[k].steps for k, _, _ in levels)
        if tpot_slo is None or not tpot_slo > 0:
            return FitResult.failed(Status.INSUFFICIENT_DATA, "slo.tpot_seconds not configured", steps)
        extra: dict[str, object] = {"target_seconds": share * tpot_slo,
                                    "levels": [[k, float(p), float(n)] for k, p, n in levels]}
        if not levels:
            return FitResult(Status.INSUFFICIENT_DATA, f"no concurrency level with {self.min_requests:g} finished "
                             "requests yet", samples=steps, extra=extra)
        if len(levels) < self.min_levels:
            return FitResult(Status.INSUFFICIENT_VARIATION, f"fewer than {self.min_levels} concurrency levels with "
                             f"{self.min_requests:g} finished requests: TPOT cannot be fitted against concurrency"
                             + measured(f"levels {', '.join(str(k) for k, _, _ in levels)}"), samples=steps,
                             extra=extra)
        x = np.array([k for k, _, _ in levels], dtype=float)
        y = np.array([p for _, p, _ in levels], dtype=float)
        w = np.array([n for _, _, n in levels], dtype=float)
        design = np.column_stack([np.ones_like(x), x])
        sw = np.sqrt(w)
        (b0, b1), *_ = np.linalg.lstsq(design * sw[:, None], y * sw, rcond=None)
        resid = y - (b0 + b1 * x)
        dof = len(x) - 2
        xtwx_inv = np.linalg.inv(design.T @ (design * w[:, None]))
        # WLS covariance σ̂²·(XᵀWX)⁻¹ with σ̂² = Σw·r²/(n−2) (invariant to the scale of w).
        s2 = float(np.sum(w * resid**2)) / dof if dof > 0 else math.nan
        cov = s2 * xtwx_inv if dof > 0 else np.full((2, 2), math.nan)
        ybar = float(np.sum(w * y) / w.sum())
        ss_tot = float(np.sum(w * (y - ybar) ** 2))
        r2 = 1.0 - float(np.sum(w * resid**2)) / ss_tot if ss_tot > 0 else math.nan
        se_b1 = math.sqrt(max(float(cov[1, 1]), 0.0)) if dof > 0 else math.nan
        if b1 <= 0 or (math.isfinite(se_b1) and b1 <= 2.0 * se_b1):
            # every P95 inside one bucket is interpolated there from counts alone: a rise inside it
            # is not seen (the numbers auditor's TPOT rose 13 → 23 ms inside vLLM's (0.01, 0.025])
            buckets = {self._bucket(k) for k, _, _ in levels}
            why = ""
            if len(buckets) == 1:
                lo, hi = buckets.pop()
                why = f": every level's P95 falls in one TPOT bucket, ({lo:g}, {hi:g}] s, inside which a rise is not seen"
            return FitResult(Status.NOT_IDENTIFIABLE, f"TPOT P95 does not rise with concurrency over levels "
                             f"{int(x.min())}–{int(x.max())} (slope {b1:.3g} ± {se_b1:.2g} s per request){why}: "
                             "no concurrency-limited max-num-seqs", samples=steps, r2=r2, extra=extra)
        target = share * tpot_slo
        xstar = (target - b0) / b1
        grad = np.array([-1.0 / b1, -xstar / b1])
        var = float(grad @ cov @ grad) if dof > 0 else math.nan
        extra["extrapolated"] = bool(xstar < x.min() or xstar > x.max())
        return FitResult(
            status=Status.OK,
            params={
                "p95_at_zero": Estimate(float(b0), math.sqrt(max(float(cov[0, 0]), 0.0)) if dof > 0 else math.nan),
                "p95_per_request": Estimate(float(b1), math.sqrt(max(float(cov[1, 1]), 0.0)) if dof > 0 else math.nan),
                "concurrency_at_target": Estimate(float(xstar), math.sqrt(max(var, 0.0)) if dof > 0 else math.nan),
            },
            samples=steps, r2=r2,
            covariance=tuple(tuple(float(v) for v in row) for row in cov) if dof > 0 else None,
            extra=extra,
        )
