"""Observed TPM (MODEL.md §3.4, basis="observed") on the real vLLM trace, checked by hand.

Physical TPM counts computed prompt tokens where vLLM counts prompt_tokens (at prefill
completion): prompt_tokens_by_source{source="local_compute"}. So physical never exceeds
delivered, even in windows where prefix_cache_* (counted at scheduling) run ahead.
"""
from __future__ import annotations

import re
from pathlib import Path

from exporter.config import Config
from exporter.replay import replay
from exporter.sources import load_trace

TRACE = Path(__file__).resolve().parents[1] / "exporter" / "data" / "vllm-cpu-0.32-sweep-ab.tar.gz"


def _value(text: str, pattern: str) -> float:
    return float(re.search(pattern + r" (\S+)", text, re.M).group(1))


def test_physical_never_exceeds_delivered_and_final_window_by_hand():
    trace = load_trace(TRACE)
    seen = []

    def check(i, t, obs):
        m = runner_box[0].current()[0].models.get("tiny")
        if m and ("physical", "instance") in m.tpm_observed:
            seen.append(m.tpm_observed[("physical", "instance")] <= m.tpm_observed[("delivered", "instance")] + 1e-9)

    runner_box = []
    result = replay(trace, Config(), "t", check, runner_box.append)
    assert seen and all(seen)

    # Final publish window: newest snapshot >= 60 s older than the last, to the last (MODEL.md §1).
    times = [t for t, _ in trace.snapshots]
    last_t, last = trace.snapshots[-1]
    base_t, base = [(t, x) for t, x in trace.snapshots if t <= last_t - 60][-1]
    label = r'\{engine="0",model_name="tiny"\}'
    d_prompt = _value(last, "^vllm:prompt_tokens_total" + label) - _value(base, "^vllm:prompt_tokens_total" + label)
    d_gen = _value(last, "^vllm:generation_tokens_total" + label) - _value(base, "^vllm:generation_tokens_total" + label)
    src = r'\{engine="0",model_name="tiny",source="local_compute"\}'
    d_miss = _value(last, "^vllm:prompt_tokens_by_source_total" + src) - _value(base, "^vllm:prompt_tokens_by_source_total" + src)
    dt = last_t - base_t
    m = result.runner.current()[0].models["tiny"]
    assert abs(m.tpm_observed[("delivered", "instance")] - (d_prompt + d_gen) * 60 / dt) < 1e-6
    assert abs(m.tpm_observed[("physical", "instance")] - (d_miss + d_gen) * 60 / dt) < 1e-6
    assert times == sorted(times)


def test_a_window_without_prompt_tokens_computed_none_and_an_unknown_h_says_why():
    # MODEL.md §3.4 physical TPM = (miss prompt + output tokens)·60/Δt: with Δprompt = 0 no
    # prompt token was computed whatever h (0 + 6 output tokens over 60 s = 6 tokens/min); with
    # prompt tokens, an unknown h and no prompt_tokens_by_source{local_compute}, it is unknown
    from exporter.analyzer import _observed_tpm
    from exporter.window import Delta
    unknown: dict[str, str] = {}
    idle = Delta(0.0, 60.0, {"prompt_tokens": 0.0, "generation_tokens": 6.0}, {}, {}, {})
    assert _observed_tpm(idle, None, 1, unknown, idle.counters)[("physical", "instance")] == 6.0 and not unknown
    busy = Delta(0.0, 60.0, {"prompt_tokens": 600.0, "generation_tokens": 6.0}, {}, {}, {})
    tpm = _observed_tpm(busy, None, 1, unknown, busy.counters)
    assert tpm == {("delivered", "instance"): 606.0, ("delivered", "gpu"): 606.0}
    assert unknown["tpm_observed_physical"].startswith("the publish window's hit ratio is unknown")
