"""What one step measured, in the model's own terms (MODEL.md §1, §2, §7).

A *step* is the interval between two consecutive scrapes. ``exporter`` builds one
:class:`Observation` per step from two snapshots; the fitters consume them. All token counts
are deltas over the step (summed over data-parallel engines, MODEL.md §2); times in seconds.
``None`` means *unknown* (e.g. no hit counter exported), never zero.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Observation:
    """One scrape-to-scrape step of one model.

    Attributes:
        t: unix time of the step's later scrape [s].
        dt: wall-clock length of the step [s].
        busy: both scrapes show running requests and the engine stepped (MODEL.md §7); then
            ``dt`` is chip (busy) time.
        steps: Δ engine steps (Δcount of ``vllm:iteration_tokens_total``) [1] (None = unknown:
            then no step is busy, §7's test needs it).
        queried_tokens: Δ``prefix_cache_queries_total`` [tokens] (None = unknown).
        hit_tokens_device: Δ``prefix_cache_hits_total`` [tokens] (None = unknown).
        hit_tokens_loaded: Δ``external_prefix_cache_hits_total`` [tokens]; 0 when the engine
            has no connector/offload; None = unknown (MODEL.md §2).
        miss_tokens: ΔM, prompt tokens computed = queried − device hits − loaded hits [tokens].
        attention_work: ΔW_attn = Σ(M·H + M²/2) over the step's requests [tokens²] (§7).
        generation_tokens: ΔG [tokens] (None = unknown).
        decode_context_tokens: ΔC_dec ≈ ΔG·(ISL + OSL/2), KV tokens read by decode [tokens].
        isl, osl: mean prompt / output length per request in the step (or the latest known) [tokens].
        requests_finished: Δcount of finished requests (prefill-time histogram) [1].
        prefill_time_mean: mean ``request_prefill_time_seconds`` of requests finished in the step [s].
        queue_time_mean: mean ``request_queue_time_seconds`` of those requests [s].
        ttft_mean: mean ``time_to_first_token_seconds`` observed in the step [s].
        ttft_count: Δcount of ``time_to_first_token_seconds``: first tokens in the step [1].
        running: time-averaged ``num_requests_running`` over the interval (the trapezoid of its
            scrapes; of a step: the mean of its two scrapes) [1].
        waiting: ``num_requests_waiting`` at the later scrape [1].
        anomaly_hint: set by exporter when the step is suspect (counter reset, preemptions on
            engines whose hits they inflate); fitters skip such steps.
    """

    t: float
    dt: float
    busy: bool
    steps: float | None
    queried_tokens: float | None
    hit_tokens_device: float | None
    hit_tokens_loaded: float | None
    miss_tokens: float | None
    attention_work: float | None
    generation_tokens: float | None
    decode_context_tokens: float | None
    isl: float | None
    osl: float | None
    requests_finished: float = 0.0
    prefill_time_mean: float | None = None
    queue_time_mean: float | None = None
    ttft_mean: float | None = None
    ttft_count: float = 0.0
    running: float | None = None
    waiting: float | None = None
    anomaly_hint: str = ""

    @property
    def hit_ratio_device(self) -> float | None:
        """h_dev = Δhits / Δqueries [1]; None when unknown or no queries (no data, not 0 %)."""
        return _ratio(self.hit_tokens_device, self.queried_tokens)

    @property
    def hit_ratio_loaded(self) -> float | None:
        """h_load = Δexternal hits / Δqueries [1]; None when unknown or no queries."""
        return _ratio(self.hit_tokens_loaded, self.queried_tokens)

    @property
    def hit_ratio(self) -> float | None:
        """h = h_dev + h_load = (Δhits + Δexternal hits) / Δqueries [1] (MODEL.md §1); None when
        either part is unknown or no queries."""
        if self.hit_tokens_device is None or self.hit_tokens_loaded is None:
            return None
        return _ratio(self.hit_tokens_device + self.hit_tokens_loaded, self.queried_tokens)

    @property
    def miss_tps(self) -> float | None:
        """TPS_miss = ΔM / Δt_busy [tokens/s] on a busy step (MODEL.md §4 direct estimator)."""
        if not self.busy or self.miss_tokens is None or self.dt <= 0:
            return None
        return self.miss_tokens / self.dt


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den
