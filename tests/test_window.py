"""exporter/window.py (steps, publish windows, Prometheus-increase()-like resets; MODEL.md §1) and
exporter/observe.py (delta → Observation; MODEL.md §2, §7), against values worked by hand.

Snapshots are built from ModelSignals directly or by parsing short expositions written here.
Every expected value is derived in a comment; none is copied from the code's output.
"""
from __future__ import annotations

import math
import time

import pytest

from exporter.analyzer import Analyzer
from exporter.config import Config
from exporter.observe import Context, observe
from exporter.parse import Histogram, ModelSignals, Snapshot, parse_exposition
from exporter.runner import Runner
from exporter.window import Delta, HistogramDelta, Windows, add_deltas, step_delta


def sig(counters=None, histograms=None, gauges=None, created=None, unknown=None, hit_unit="tokens"):
    return ModelSignals(counters=dict(counters or {}), histograms=dict(histograms or {}),
                        gauges=dict(gauges or {}), created=dict(created or {}),
                        hit_unit=hit_unit, unknown=dict(unknown or {}))


def snap(t, **models):
    return Snapshot(timestamp=float(t), engine="vllm_v1", reason="", models=models)


# --- step_delta ----------------------------------------------------------------------------


def test_a_url_flipping_between_two_young_pods_reads_one_restart_then_another_process():
    # A load-balanced URL right after a rollout: pods A (series created at 1000) and B (1010)
    # answer in turn; both were created within CREATED_SKEW_SECONDS (60 s) of every scrape, so each
    # flip changed every _created to a time after the previous scrape less the skew: a restart,
    # whose increases are the other pod's lifetime totals (review: TPM 25x for a minute). B is new at
    # its first answer (as a restart's process would be: its totals are its increases then); each
    # later flip returns to a process already seen: another process's counters, no increase.
    key = 'prefix_cache_queries{engine="0"}'
    a = lambda q: sig({"queries": q}, created={key: 1000.0})  # noqa: E731
    b = lambda q: sig({"queries": q}, created={key: 1010.0})  # noqa: E731
    w = Windows(60.0)
    w.push(snap(1020.0, m=a(5000.0)))
    steps = [w.push(snap(t, m=s))["m"] for t, s in ((1025.0, b(3000.0)), (1030.0, a(5600.0)), (1035.0, b(3500.0)),
                                                     (1040.0, a(6100.0)))]
    assert (steps[0].resets, steps[0].counters) == (1, {"queries": 3000.0})
    for d in steps[1:]:
        assert (d.foreign, d.resets, d.counters) == (1, 0, {})
    # a real restart later still reads as one: a third process, never seen
    d = w.push(snap(1045.0, m=sig({"queries": 40.0}, created={key: 1042.0})))["m"]
    assert (d.resets, d.counters) == (1, {"queries": 40.0})


def test_plain_increase():
    prev = sig({"queries": 100.0, "hits": 40.0}, gauges={"running": 2.0})
    cur = sig({"queries": 160.0, "hits": 70.0}, gauges={"running": 5.0})
    d = step_delta(prev, cur, 10.0, 12.0)
    # 160 − 100 = 60; 70 − 40 = 30
    assert dict(d.counters) == {"queries": 60.0, "hits": 30.0}
    assert (d.t0, d.t1, d.dt, d.resets, d.steps) == (10.0, 12.0, 2.0, 0, 1)
    assert d.start == {"running": 2.0} and d.end == {"running": 5.0}


def test_counter_down_is_restart_for_the_whole_model():
    # Without _created, every counter went down, queries 1000 → 120 below half: the engine
    # restarted. As Prometheus increase() counts a reset, each increase is the current value: 120,
    # 30 and 600, never 30 − 400 or 600 − 5000.
    prev = sig({"queries": 1000.0, "hits": 400.0, "generation_tokens": 5000.0, "num_preemptions": 0.0})
    cur = sig({"queries": 120.0, "hits": 30.0, "generation_tokens": 600.0, "num_preemptions": 0.0})
    d = step_delta(prev, cur, 0.0, 5.0)
    assert dict(d.counters) == {"queries": 120.0, "hits": 30.0, "generation_tokens": 600.0, "num_preemptions": 0.0}
    assert d.resets == 1
    # queries read 120 while hits and generation grew is no new process (it counts every counter
    # from 0): one counter read low, a glitch. Taken for a restart, the others' lifetimes were one
    # step's increase (adversarial test: TPM 2.2x for a window); the step has no increases instead
    d = step_delta(prev, sig({"queries": 120.0, "hits": 430.0, "generation_tokens": 5100.0}), 0.0, 5.0)
    assert d.counters == {} and (d.glitches, d.resets) == (1, 0)


def test_changed_created_is_restart_even_when_value_went_up():
    key = 'prefix_cache_queries{engine="0"}'
    prev = sig({"queries": 100.0}, created={key: 1000.0})
    cur = sig({"queries": 150.0}, created={key: 2000.0})
    d = step_delta(prev, cur, 0.0, 5.0)
    # restarted at 2000 and counted 150 since: increase 150, not 150 − 100 = 50
    assert d.counters == {"queries": 150.0}
    assert d.resets == 1
    # unchanged created → plain increase 50
    same = step_delta(prev, sig({"queries": 150.0}, created={key: 1000.0}), 0.0, 5.0)
    assert same.counters == {"queries": 50.0} and same.resets == 0



def test_value_down_with_created_unchanged_is_a_glitch_not_a_restart():
    # hits 500 → 450 at one scrape while every _created stayed 1000: the same process, no restart.
    # Counting a restart took every counter's lifetime total as the step's increase (queries 1040,
    # hits 450: h 0.43 for a window whose true h is 0.5); the step has no increases instead, and
    # the window skips such a scrape once (below).
    key = 'prefix_cache_queries{engine="0"}'
    prev = sig({"queries": 1000.0, "hits": 500.0}, created={key: 1000.0})
    cur = sig({"queries": 1040.0, "hits": 450.0}, created={key: 1000.0})
    d = step_delta(prev, cur, 2000.0, 2005.0)
    assert d.counters == {} and (d.glitches, d.resets, d.foreign) == (1, 0, 0)
    # without _created (prometheus_client's multiprocess mode) the values decide: a new process counts
    # from 0, so a restart takes most values down, some below half its last (1000 → 120, 500 → 40); hits
    # 500 → 450 while queries rose is the same process read low (an adversarial test's torn read
    # counted both lifetimes, 1040 and 450, as the step: h 0.67 for 0.81), a glitch
    d = step_delta(sig({"queries": 1000.0, "hits": 500.0}), sig({"queries": 1040.0, "hits": 450.0}), 2000.0, 2005.0)
    assert d.counters == {} and (d.glitches, d.resets) == (1, 0)
    d = step_delta(sig({"queries": 1000.0, "hits": 500.0}), sig({"queries": 120.0, "hits": 40.0}), 2000.0, 2005.0)
    assert d.counters == {"queries": 120.0, "hits": 40.0} and d.resets == 1
    # below half while most counters grew is no new process either: a glitch (1 of 3 went down);
    # a young process whose one rare counter passed the old one's is (2 of 3 down: review, a crash
    # loop read as a glitch and held against the old totals published TPM 180 for 4680)
    before = sig({"queries": 1000.0, "hits": 500.0, "num_preemptions": 1.0})
    d = step_delta(before, sig({"queries": 1040.0, "hits": 249.0, "num_preemptions": 1.0}), 2000.0, 2005.0)
    assert d.counters == {} and d.glitches == 1
    d = step_delta(before, sig({"queries": 120.0, "hits": 40.0, "num_preemptions": 2.0}), 2000.0, 2005.0)
    assert d.counters == {"queries": 120.0, "hits": 40.0, "num_preemptions": 2.0} and d.resets == 1
    # exactly half down is no majority: hits read 0 while queries grew (review: as a restart, the
    # lifetimes counted twice, at the "restart" and at the return, TPM 2.8x)
    d = step_delta(sig({"queries": 1000.0, "hits": 500.0}), sig({"queries": 1040.0, "hits": 0.0}), 2000.0, 2005.0)
    assert d.counters == {} and d.glitches == 1
    # exactly half is no restart (one of two multiprocess files missing from a sum halves it)
    d = step_delta(sig({"queries": 1000.0, "hits": 500.0}), sig({"queries": 1040.0, "hits": 250.0}), 2000.0, 2005.0)
    assert d.counters == {} and d.glitches == 1

    def analysed(scrapes):
        a = Analyzer(Config())
        for t, q, h in scrapes:
            a.ingest(snap(t, m=sig({"queries": q, "hits": h}, created={key: 1000.0})))
        return a
    # a scrape that read low is skipped: the next step is taken from the one before it, and the
    # window [2000, 2010] holds queries 1080 − 1000 = 80, hits 540 − 500 = 40, h = 0.5
    a = analysed([(2000.0, 1000.0, 500.0), (2005.0, 1040.0, 450.0), (2010.0, 1080.0, 540.0)])
    assert a.windows.skipped == 1 and a.windows.window("m").counters == {"queries": 80.0, "hits": 40.0}
    assert a.analysis().models["m"].hit_ratio["device"] == 0.5
    # one that read high (hits 600 at 2005) is seen at the next scrape, which is skipped; still
    # down at 2015 (560 < 600), that step [2005, 2015] has no increases and the window says why
    a = analysed([(2000.0, 1000.0, 500.0), (2005.0, 1040.0, 600.0), (2010.0, 1080.0, 540.0),
                  (2015.0, 1120.0, 560.0)])
    assert a.windows.skipped == 1 and a.windows.window("m").glitches == 1
    m = a.analysis().models["m"]
    assert m.hit_ratio == {}  # unknown, never a number
    assert m.unknown["hit_ratio"].startswith("a counter went down inside the publish window while its _created stamps")
    # skipped after an outage (2015 → 2040, 25 s > 2 intervals + timeout = 13 s): the window that
    # ended at 2015 is not published as the 2040 scrape's (it was, with up 1 and data age 0)
    a = analysed([(2000.0, 1000.0, 500.0), (2005.0, 1040.0, 520.0), (2010.0, 1080.0, 540.0),
                  (2015.0, 1120.0, 560.0), (2040.0, 1100.0, 550.0)])
    assert a.windows.skipped == 1 and "m" not in a.analysis().models
    # the next scrape gives a step again: [2015, 2045], queries 1240 − 1120, hits 620 − 560
    a.ingest(snap(2045.0, m=sig({"queries": 1240.0, "hits": 620.0}, created={key: 1000.0})))
    assert a.analysis().models["m"].hit_ratio["device"] == 0.5



def test_a_counter_read_0_for_three_scrapes_costs_nothing_when_it_comes_back():
    # True growth: queries +100, hits +50 per 5-s scrape (h 0.5). Queries read 0 at 2015, 2020 and
    # 2025 (_created unchanged), back at 2030. Skipping one scrape took the step [2020, 2025] from 0
    # as the new base, and the step back counted queries' whole lifetime (1600) in 5 s: fitted, it
    # raised the spike guard's peak 16x for good, and h read 50/1600 (an adversarial test). Up to
    # GLITCH_HOLD_SCRAPES scrapes below half are skipped: the step back is [2010, 2030], queries
    # 1600 − 1200 = 400, hits 800 − 600 = 200, h 0.5; the peak stays the true 20 queries/s.
    key = 'prefix_cache_queries{engine="0"}'
    a = Analyzer(Config())
    reads = [(2000.0 + 5 * i, 1000.0 + 100 * i, 500.0 + 50 * i) for i in range(9)]
    for t, q, h in reads:
        a.ingest(snap(t, m=sig({"queries": 0.0 if 2015.0 <= t <= 2025.0 else q, "hits": h}, created={key: 1000.0})))
    d = a.windows.window("m")
    assert a.windows.skipped == 3 and d.glitches == 0 and d.resets == 0
    assert (d.t0, d.t1) == (2000.0, 2040.0) and d.counters == {"queries": 800.0, "hits": 400.0}
    assert a.analysis().models["m"].hit_ratio["device"] == 0.5
    assert a._state["m"].peak["queries"] == pytest.approx(20.0)
    # still down at the fourth scrape, that step has no increases and starts afresh, as before
    b = Analyzer(Config())
    for t, q, h in reads:
        b.ingest(snap(t, m=sig({"queries": 0.0 if t >= 2015.0 else q, "hits": h}, created={key: 1000.0})))
    assert b.windows.skipped == 3 and b.windows.window("m").glitches == 1


def test_a_counter_read_0_past_the_hold_does_not_count_what_it_missed_when_it_comes_back():
    # True growth: queries +100, hits +50 per 5-s scrape (h 0.5). Queries read 0 at 2015-2030,
    # one scrape past the 3 held: [2010, 2030] is a glitch step (no increases), and counting
    # started afresh from 0, so the step back [2030, 2035] counted 1700 − 0 (the scrapes' misses
    # with it) in 5 s: once the glitch step left the window, [2030, 2090] published h
    # 600 / (1700 + 11 × 100) = 0.214, and the spike guard's peak rose 17x (adversarial test). The
    # step back rose by at least what the counter fell (1200 → 0): it has no increases either, so
    # that window is unknown; [2035, 2095] holds 12 × 100 queries, 12 × 50 hits: h 0.5.
    key = 'prefix_cache_queries{engine="0"}'
    a = Analyzer(Config())
    for i in range(19):
        t = 2000.0 + 5 * i
        q = 0.0 if 2015.0 <= t <= 2030.0 else 1000.0 + 100 * i
        a.ingest(snap(t, m=sig({"queries": q, "hits": 500.0 + 50 * i}, created={key: 1000.0})))
    d = a.windows.window("m")
    assert (d.t0, d.t1, d.glitches) == (2030.0, 2090.0, 1)
    assert a.analysis().models["m"].hit_ratio == {}
    assert a._state["m"].peak["queries"] == pytest.approx(20.0)
    a.ingest(snap(2095.0, m=sig({"queries": 1000.0 + 100 * 19, "hits": 500.0 + 50 * 19}, created={key: 1000.0})))
    d = a.windows.window("m")
    assert (d.t0, d.glitches, d.counters) == (2035.0, 0, {"queries": 1200.0, "hits": 600.0})
    assert a.analysis().models["m"].hit_ratio["device"] == 0.5


def test_two_counters_read_0_in_turn_past_the_hold_each_come_back_without_what_they_missed():
    # True growth: queries +1000, hits +50 per 5-s scrape (h 0.05). Queries read 0 at 2015-2030,
    # hits at 2025-2040. The glitch step [2010, 2030] saw both fall (queries by 12000, hits by 600);
    # the queries' return voids [2030, 2035], and forgetting the hits' fall with it made the step
    # [2040, 2045] count their lifetime, 950: [2040, 2100] published 1500 / 12000 = 0.125 (review).
    # Each value is watched until it is back: [2040, 2045] has no increases either, so that window
    # is unknown, and [2045, 2105] holds 12 x 1000 queries, 12 x 50 hits: h 0.05.
    key = 'prefix_cache_queries{engine="0"}'
    a = Analyzer(Config())

    def scrape(i):
        t = 2000.0 + 5 * i
        q = 0.0 if 2015.0 <= t <= 2030.0 else 10000.0 + 1000 * i
        k = 0.0 if 2025.0 <= t <= 2040.0 else 500.0 + 50 * i
        a.ingest(snap(t, m=sig({"queries": q, "hits": k}, created={key: 1000.0})))
    for i in range(21):
        scrape(i)
    d = a.windows.window("m")
    assert (d.t0, d.t1) == (2040.0, 2100.0) and d.glitches == 1 and a.analysis().models["m"].hit_ratio == {}
    scrape(21)
    d = a.windows.window("m")
    assert (d.t0, d.glitches, d.counters) == (2045.0, 0, {"queries": 12000.0, "hits": 600.0})
    assert a.analysis().models["m"].hit_ratio["device"] == 0.05


def test_a_fall_at_a_glitch_step_is_watched_for_ten_windows_or_while_the_value_has_not_grown():
    # True growth: queries +100, hits +50 per 5 s. Hits read 300 high at 2005 (850 for 550): 2010
    # (600) is skipped, and [2005, 2015] is a glitch step, at which hits fell 850 → 650, by 200. A
    # burst step (queries +2000, hits +1000) rises by more: within 10 publish windows (600 s) of
    # 2015 it is taken for low reads' return (no increases); 605 s on (review: a legitimate burst
    # an hour later was voided) it is a plain step.
    key = 'prefix_cache_queries{engine="0"}'

    def burst(at):
        w, q, k = Windows(60.0), 1000.0, 500.0
        times = [2000.0 + 5 * i for i in range(int((at - 2000.0) / 5))] + [at]
        for t in times[:-1]:
            w.push(snap(t, m=sig({"queries": q, "hits": k + (300.0 if t == 2005.0 else 0.0)}, created={key: 1000.0})))
            q, k = q + 100.0, k + 50.0
        return w.push(snap(times[-1], m=sig({"queries": q + 1900.0, "hits": k + 950.0}, created={key: 1000.0})))["m"]
    within = burst(2300.0)
    assert within.counters == {} and within.glitches == 1
    assert burst(2620.0).glitches == 0 and burst(2620.0).counters == {"queries": 2000.0, "hits": 1000.0}
    # a value still not grown since the glitch step is watched past 10 windows, and across a gap:
    # hits read 0 from 2015 (the glitch step at 2030, after the hold) and are back at 2645, 615 s on,
    # or at 2775 after a 130-s gap: the return step (the last) has no increases (review: it counted
    # the hits' lifetime, once the watch had expired or a gap had dropped it)
    for gap in (False, True):
        w, t = Windows(60.0), 2000.0
        for i in range(130):
            reads_0 = 2015.0 <= t < 2645.0 + (130.0 if gap else 0.0)
            last = w.push(snap(t, m=sig({"queries": 1000.0 + 100 * i, "hits": 0.0 if reads_0 else 500.0 + 50 * i},
                                        created={key: 1000.0})))
            t += 135.0 if gap and i == 60 else 5.0
        assert not reads_0 and last["m"].counters == {} and last["m"].glitches == 1


def test_one_engine_of_two_read_0_for_three_scrapes_is_held_as_one_engine_would_be():
    # Data parallel, two engines: engine 0 grows queries +1000, hits +500 per 5-s scrape; engine 1
    # +100, +50. Engine 1's queries read 0 at 2015, 2020 and 2025 (_created unchanged), back at 2030.
    # The model's sum (13000 at 2015 against 13400) did not fall below half, so the hold judged on
    # sums skipped one scrape: [2010, 2020] became a step without increases, engine 1's 0 the base,
    # and [2025, 2030] counted its lifetime queries (1600) in 5 s. Judged per engine, the three
    # scrapes are held: the window [2000, 2040] holds queries 8 x 1000 + 8 x 100 = 8800, hits
    # 8 x 500 + 8 x 50 = 4400.
    keys = {e: f'prefix_cache_queries{{engine="{e}"}}' for e in "01"}

    def model(i, t):
        q1 = 0.0 if 2015.0 <= t <= 2025.0 else 1000.0 + 100 * i
        engines = {"0": sig({"queries": 10000.0 + 1000 * i, "hits": 5000.0 + 500 * i}, created={keys["0"]: 1000.0}),
                   "1": sig({"queries": q1, "hits": 500.0 + 50 * i}, created={keys["1"]: 1000.0})}
        total = sig({n: engines["0"].counters[n] + engines["1"].counters[n] for n in ("queries", "hits")},
                    created={k: 1000.0 for k in keys.values()})
        return ModelSignals(total.counters, {}, {}, total.created, "tokens", {}, engines)
    w = Windows(60.0)
    for i in range(9):
        w.push(snap(2000.0 + 5 * i, m=model(i, 2000.0 + 5 * i)))
    d = w.window("m")
    assert w.skipped == 3 and d.glitches == 0 and d.resets == 0
    assert (d.t0, d.t1) == (2000.0, 2040.0) and d.counters == {"queries": 8800.0, "hits": 4400.0}


def test_a_dip_after_a_step_without_increases_keeps_the_window_unknown():
    # True growth: queries +100, hits +50 per 5-s scrape (h 0.5). 2005 reads queries 1400 (true
    # 1100): the step [2000, 2005] reads h = 50 / 400 = 0.125. 2010 (1200) and 2015 (1300) read
    # below it: 2010 is skipped, [2005, 2015] is a glitch step, the window unknown. 2020 reads 0
    # (a dip): the glitch step is in doubt, and the window that ended before it ended at the bad
    # step, publishing h 0.125 again. A step without increases overstates nothing: it stays.
    key = 'prefix_cache_queries{engine="0"}'
    a = Analyzer(Config())
    for t, q, h in ((2000.0, 1000.0, 500.0), (2005.0, 1400.0, 550.0), (2010.0, 1200.0, 600.0),
                    (2015.0, 1300.0, 650.0), (2020.0, 0.0, 700.0)):
        a.ingest(snap(t, m=sig({"queries": q, "hits": h}, created={key: 1000.0})))
        if t >= 2015.0:
            m = a.analysis().models["m"]
            assert m.hit_ratio == {} and m.unknown["hit_ratio"].startswith("a counter went down"), t
    assert a.windows.skipped == 2 and a.windows.window("m").glitches == 1
    # the same with a step from another process (its _created moved to before the last scrape, 900):
    # a dip after it ended the window before it, and the other process's h 0.5 was published
    b = Analyzer(Config())
    for t, q, h, created in ((2000.0, 1000.0, 500.0, 1000.0), (2005.0, 1100.0, 550.0, 1000.0),
                             (2010.0, 1200.0, 600.0, 1000.0), (2015.0, 5000.0, 1000.0, 900.0),
                             (2020.0, 0.0, 1050.0, 900.0)):
        b.ingest(snap(t, m=sig({"queries": q, "hits": h}, created={key: created})))
        if t >= 2015.0:
            m = b.analysis().models["m"]
            assert m.hit_ratio == {} and m.unknown["hit_ratio"].startswith("scrapes from two processes"), t
    assert b.windows.skipped == 1 and b.windows.window("m").foreign == 1

EXPO = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {q}
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{{engine="0",model_name="m"}} {created}
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_created gauge
vllm:spec_decode_num_accepted_tokens_per_pos_created{{engine="0",model_name="m",position="0"}} {created}
"""


def test_created_from_parsed_expositions():
    a = parse_exposition(EXPO.format(q=100.0, created=1000.0), 0.0).models["m"]
    b = parse_exposition(EXPO.format(q=150.0, created=2000.0), 5.0).models["m"]
    d = step_delta(a, b, 0.0, 5.0)
    assert d.counters == {"queries": 150.0} and d.resets == 1  # created 1000 → 2000: restart


def test_series_created_later_is_not_a_restart():
    # a labelled series that appears later (here position="3", created at 1500) has a later
    # _created than its family's first series; nothing restarted: plain increase 150 − 100 = 50
    a = parse_exposition(EXPO.format(q=100.0, created=1000.0), 0.0).models["m"]
    later = ('vllm:spec_decode_num_accepted_tokens_per_pos_created'
             '{engine="0",model_name="m",position="3"} 1500.0\n')
    b = parse_exposition(EXPO.format(q=150.0, created=1000.0) + later, 5.0).models["m"]
    d = step_delta(a, b, 0.0, 5.0)
    assert d.counters == {"queries": 50.0} and d.resets == 0



def test_one_stamp_moving_alone_is_no_restart():
    # A review moved one family's _created (mm_cache_queries, unread) to "now" while every counter
    # kept rising: read as a restart, each counter's lifetime total counted as the step's increase.
    # A new process stamps every series anew; here the others stayed at 1000: plain increase 50.
    moved = 'vllm:mm_cache_queries_created{{engine="0",model_name="m"}} {}\n'
    a = parse_exposition(EXPO.format(q=100.0, created=1000.0) + moved.format(1000.0), 0.0).models["m"]
    b = parse_exposition(EXPO.format(q=150.0, created=1000.0) + moved.format(1004.0), 5.0).models["m"]
    d = step_delta(a, b, 0.0, 5.0)
    assert d.counters == {"queries": 50.0} and (d.resets, d.glitches) == (0, 0)
    # a read counter's own stamp moving alone while its value fell: the same process (the other
    # stamps stayed), so its lifetime total is no increase: a glitch, no increases
    b = parse_exposition(EXPO.format(q=40.0, created=1000.0).replace(
        'prefix_cache_queries_created{engine="0",model_name="m"} 1000.0',
        'prefix_cache_queries_created{engine="0",model_name="m"} 1004.0') + moved.format(1000.0), 5.0).models["m"]
    d = step_delta(a, b, 0.0, 5.0)
    assert d.counters == {} and (d.resets, d.glitches) == (0, 1)

def test_a_restart_after_the_wall_clock_stepped_back_is_a_restart_not_another_process():
    # kvhit's stamps never step (SteadyClock); the engine's _created is on the wall clock, here set
    # back 120 s after kvhit started. The engine restarted at stamp 1003 = wall 883: against the
    # stamp 1000 of the scrape before, 883 < 1000 − 60 read as another process (no increases, h
    # unknown); on the wall clock that scrape was at 880, so 883 is after it: a restart.
    def at(t, q, created, offset):
        return Snapshot(float(t), "vllm_v1", "", {"m": parse_exposition(EXPO.format(q=q, created=created), t).models["m"]},
                        clock_offset=offset)
    w = Windows(60.0)
    w.push(at(1000.0, 900.0, 500.0, 0.0))
    d = w.push(at(1005.0, 40.0, 883.0, 120.0))["m"]
    assert (d.resets, d.foreign) == (1, 0) and d.counters == {"queries": 40.0}  # restarted: all 40 since
    # a _created from before the previous scrape on the wall clock too is still another process
    w = Windows(60.0)
    w.push(at(1000.0, 900.0, 500.0, 0.0))
    d = w.push(at(1005.0, 40.0, 700.0, 120.0))["m"]
    assert (d.resets, d.foreign) == (0, 1) and d.counters == {}
    # signals built by hand (one engine, no per-engine map) read the offset alike
    key = 'prefix_cache_queries{engine="0"}'
    d = step_delta(sig({"queries": 900.0}, created={key: 500.0}), sig({"queries": 40.0}, created={key: 883.0}),
                   1000.0, 1005.0, clock_offset=120.0)
    assert (d.resets, d.foreign) == (1, 0) and d.counters == {"queries": 40.0}


def test_the_runner_stamps_live_scrapes_with_the_wall_clock_offset():
    class Bodies:  # a source answering the given bodies (Runner.poll's interface)
        answer_delay = 0.0

        def __init__(self, *texts):
            self.texts = iter(texts)

        def fetch(self):
            return 0.0, next(self.texts)

    runner = Runner(Config(interval=5.0), "t")
    runner.clock._wall0 += 120.0  # the wall clock stepped back 120 s after kvhit started: its clock is ahead
    now = time.time()
    # a process up for an hour, then one restarted a second ago (both _created on the wall clock)
    assert runner.poll(Bodies(EXPO.format(q=900.0, created=now - 3600.0)))
    time.sleep(0.01)
    assert runner.poll(Bodies(EXPO.format(q=40.0, created=time.time() - 0.005)))
    assert runner.analyzer.windows.last.clock_offset == pytest.approx(120.0, abs=0.5)
    d = runner.analyzer.windows._models["m"].steps[-1]
    assert (d.resets, d.foreign) == (1, 0) and d.counters == {"queries": 40.0}


def test_fleet_data_a_steady_minute_behind_is_logged_not_only_withdrawn(caplog):
    # a fleet breaker: Prometheus' newest samples 90 s behind the time asked for, every poll ok, every
    # value withdrawn as stale, and no line said why (the withdrawal's text pointed at failures)
    import logging

    class Lagging:  # a fleet source whose data ends 90 s before the time asked for (Runner.poll's interface)
        answer_delay, lag = -90.0, 90.0  # as PrometheusSource sets them: the data's t is 90 s before the poll

        def __init__(self):
            self.q = 0.0

        def fetch(self):
            self.q += 100.0
            return 0.0, EXPO.format(q=self.q, created=1.0)

    now = [2000.0]
    runner, source = Runner(Config(interval=5.0), "t", clock=lambda: now[0]), Lagging()
    with caplog.at_level(logging.WARNING, logger="kvhit"):
        for _ in range(3):
            assert runner.poll(source)
            now[0] += 5.0
    told = [r.getMessage() for r in caplog.records if "newest samples in Prometheus end" in r.getMessage()]
    assert told == ["fleet mode: the pods' newest samples in Prometheus end 90 s before the time asked for: the "
                    "analysis is that old (stale past an interval plus the timeout, withdrawn past two). Prometheus not "
                    "scraping them now, or late samples (remote write: set prometheus_delay to the lag), or kvhit's "
                    "clock ahead of Prometheus'"]  # once per 10 min
    analysis, health = runner.current()
    assert health.up and health.age == pytest.approx(95.0)  # the last poll's data: asked at 2010, ended at 1920
    assert analysis.models == {} and analysis.withdrawn == (
        "the last successful scrape is 95 s old, more than two scrape intervals plus the timeout (see kvhit_up and "
        "kvhit_scrape_errors_total; in fleet mode also polls that found nothing newer, and data ending that long "
        "before the poll, both logged)")


def test_histogram_bucket_deltas():
    prev = sig(histograms={"prefill_time": Histogram.of(3.0, 6.0, ((0.1, 2.0), (1.0, 5.0), (math.inf, 6.0)))})
    cur = sig(histograms={"prefill_time": Histogram.of(7.5, 11.0, ((0.1, 3.0), (0.5, 7.0), (1.0, 9.0),
                                                                 (math.inf, 11.0)))})
    h = step_delta(prev, cur, 0.0, 2.0).histograms["prefill_time"]
    # Δsum 7.5 − 3 = 4.5; Δcount 11 − 6 = 5; buckets 3−2 = 1, 9−5 = 4, 11−6 = 5;
    # le=0.5 exists only in the later scrape → no delta for it
    assert h == HistogramDelta.of(4.5, 5.0, ((0.1, 1.0), (1.0, 4.0), (math.inf, 5.0)))
    # mean of the 5 new observations: 4.5 / 5 = 0.9
    assert h.mean == pytest.approx(0.9)


def test_histogram_count_down_is_restart():
    prev = sig({"queries": 10.0}, histograms={"ttft": Histogram.of(40.0, 100.0, ((1.0, 90.0), (math.inf, 100.0)))})
    cur = sig({"queries": 4.0}, histograms={"ttft": Histogram.of(1.5, 3.0, ((1.0, 2.0), (math.inf, 3.0)))})
    d = step_delta(prev, cur, 0.0, 5.0)
    # count 100 → 3 and queries 10 → 4: restart → histogram increase = current (1.5, 3, buckets
    # 2, 3) and the counter's its current value 4
    assert d.histograms["ttft"] == HistogramDelta.of(1.5, 3.0, ((1.0, 2.0), (math.inf, 3.0)))
    assert d.counters == {"queries": 4.0}
    assert d.resets == 1


def test_signal_in_one_snapshot_only_is_absent_not_zero():
    prev = sig({"queries": 10.0, "hits": 4.0}, histograms={"ttft": Histogram(1.0, 2.0)})
    cur = sig({"queries": 30.0, "external_hits": 5.0}, histograms={"prefill_time": Histogram(1.0, 2.0)})
    d = step_delta(prev, cur, 0.0, 5.0)
    # hits only before, external_hits only after → unknown (absent); queries 30 − 10 = 20
    assert d.counters == {"queries": 20.0}
    assert d.histograms == {}


# --- HistogramDelta, add_deltas --------------------------------------------------------------


def test_histogram_delta_mean():
    h = HistogramDelta.of(4.0, 10.0, ((0.1, 2.0), (0.5, 6.0), (1.0, 9.0), (math.inf, 10.0)))
    assert h.mean == pytest.approx(0.4)  # 4.0 / 10
    empty = HistogramDelta.of(0.0, 0.0, ((1.0, 0.0),))
    assert empty.mean is None
    assert HistogramDelta(math.nan, 3.0).mean is None


def test_add_deltas_sums():
    a = Delta(0.0, 10.0, {"queries": 10.0, "hits": 4.0},
              {"ttft": HistogramDelta.of(1.0, 2.0, ((0.5, 1.0), (1.0, 2.0), (math.inf, 2.0)))},
              start={"running": 1.0}, end={"running": 2.0})
    b = Delta(10.0, 20.0, {"queries": 5.0},
              {"ttft": HistogramDelta.of(3.0, 4.0, ((1.0, 3.0), (math.inf, 4.0)))},
              start={"running": 2.0}, end={"running": 7.0}, resets=1)
    s = add_deltas([a, b])
    # queries 10 + 5 = 15; hits missing in b → unknown over the whole interval
    assert s.counters == {"queries": 15.0}
    # ttft: sum 1 + 3 = 4, count 2 + 4 = 6, edges common to both: 1.0 → 2 + 3 = 5, +Inf → 2 + 4 = 6
    assert s.histograms["ttft"] == HistogramDelta.of(4.0, 6.0, ((1.0, 5.0), (math.inf, 6.0)))
    assert (s.t0, s.t1, s.dt, s.steps, s.resets) == (0.0, 20.0, 20.0, 2, 1)
    assert s.start == {"running": 1.0} and s.end == {"running": 7.0}



def test_window_running_is_the_time_average_not_the_two_ends():
    # num_requests_running 1, 4, 4, 0 at t = 0, 10, 20, 40: the trapezoid of each step is
    # (1+4)/2·10 = 25, (4+4)/2·10 = 40, (4+0)/2·20 = 40 request·s; 105 over 40 s is 2.625 running
    # on average, where the window's two ends alone give (1 + 0)/2 = 0.5.
    w = Windows(window_seconds=60.0)
    for t, r in ((0, 1.0), (10, 4.0), (20, 4.0), (40, 0.0)):
        w.push(snap(t, m=sig({"queries": 10.0 * t}, gauges={"running": r})))
    total = w.window("m")
    assert total.running_seconds == pytest.approx(105.0)
    assert observe(total, Context()).running == pytest.approx(2.625)
    # one step: the mean of its two scrapes, (4 + 0)/2 = 2
    assert observe(w._models["m"].steps[-1], Context()).running == pytest.approx(2.0)
    # a scrape without the gauge makes the window's mean unknown, not the mean of the rest
    w.push(snap(50, m=sig({"queries": 500.0})))
    assert w.window("m").running_seconds is None and observe(w.window("m"), Context()).running is None


# --- Windows ------------------------------------------------------------------------------


def counter_snap(t, q):
    return snap(t, m=sig({"queries": float(q)}))


def test_publish_window_base_is_newest_snapshot_at_least_window_older():
    w = Windows(30.0)
    for t in range(0, 101, 10):
        w.push(counter_snap(t, 10 * t))  # queries = 10·t
    d = w.window("m")
    # latest 100; newest snapshot ≤ 100 − 30 = 70 is t=70 → covers 70..100, 3 steps,
    # queries 1000 − 700 = 300
    assert (d.t0, d.t1, d.dt, d.steps) == (70.0, 100.0, 30.0, 3)
    assert d.counters == {"queries": 300.0}


def test_window_irregular_intervals():
    w = Windows(30.0)
    for t in (0, 25, 50, 65, 100):
        w.push(counter_snap(t, t))
    d = w.window("m")
    # newest snapshot ≤ 100 − 30 = 70 is t=65 → 65..100 (35 s, one step), queries 100 − 65 = 35
    assert (d.t0, d.t1, d.steps) == (65.0, 100.0, 1)
    assert d.counters == {"queries": 35.0}


def test_window_before_full_history_uses_the_span_there_is():
    w = Windows(30.0)
    assert w.push(counter_snap(0, 0)) == {}
    assert w.window("m") is None  # one snapshot: no interval yet
    w.push(counter_snap(10, 5))
    d = w.window("m")
    assert (d.t0, d.t1, d.dt, d.counters) == (0.0, 10.0, 10.0, {"queries": 5.0})
    w.push(counter_snap(20, 12))
    d = w.window("m")
    assert (d.t0, d.t1, d.steps, d.counters) == (0.0, 20.0, 2, {"queries": 12.0})  # 12 − 0
    w.push(counter_snap(30, 20))
    # latest 30: newest ≤ 0 is t=0 → still 0..30
    assert (w.window("m").t0, w.window("m").counters) == (0.0, {"queries": 20.0})
    w.push(counter_snap(40, 31))
    # latest 40: newest ≤ 10 is t=10 → 10..40, 31 − 5 = 26
    assert (w.window("m").t0, w.window("m").counters) == (10.0, {"queries": 26.0})


def test_window_counts_a_reset_like_prometheus_increase():
    w = Windows(30.0)
    # queries: 0, 100, 200, then restart → 50, then 150
    for t, q in ((0, 0), (10, 100), (20, 200), (30, 50), (40, 150)):
        w.push(counter_snap(t, q))
    d = w.window("m")
    # window 10..40: (200 − 100) + 50 (reset: current value) + (150 − 50) = 100 + 50 + 100 = 250
    assert (d.t0, d.t1) == (10.0, 40.0)
    assert d.counters == {"queries": 250.0}
    assert d.resets == 1


def test_push_returns_step_deltas():
    w = Windows(60.0)
    w.push(counter_snap(0, 10))
    out = w.push(counter_snap(2, 25))
    assert set(out) == {"m"}
    assert (out["m"].t0, out["m"].t1, out["m"].counters) == (0.0, 2.0, {"queries": 15.0})  # 25 − 10


def test_model_appearing_and_disappearing():
    w = Windows(60.0)
    a, b = sig({"queries": 1.0}), sig({"queries": 2.0})
    w.push(snap(0, a=a))
    out = w.push(snap(10, a=a, b=b))
    # b is new at t=10: no step for it yet
    assert set(out) == {"a"} and w.models() == ["a"] and w.window("b") is None
    out = w.push(snap(20, a=a, b=b))
    assert set(out) == {"a", "b"} and w.models() == ["a", "b"]
    assert (w.window("b").t0, w.window("b").t1) == (10.0, 20.0)
    # a disappears at t=30: its window is over
    w.push(snap(30, b=b))
    assert w.models() == ["b"] and w.window("a") is None
    # a comes back at t=40: a new history starts, nothing from before t=30 is reused
    assert set(w.push(snap(40, a=a, b=b))) == {"b"}
    w.push(snap(50, a=a, b=b))
    assert (w.window("a").t0, w.window("a").t1, w.window("a").steps) == (40.0, 50.0, 1)


def test_out_of_order_snapshot_rejected_and_changes_nothing():
    w = Windows(30.0)
    for t in (0, 10, 20, 30):
        w.push(counter_snap(t, t))
    before = w.window("m")
    with pytest.raises(ValueError):
        w.push(counter_snap(25, 999))  # older
    with pytest.raises(ValueError):
        w.push(counter_snap(30, 999))  # duplicate time
    assert w.last.timestamp == 30.0
    assert w.window("m") == before
    # the next valid snapshot steps from t=30 (value 30): 40 − 30 = 10
    out = w.push(counter_snap(40, 40))
    assert (out["m"].t0, out["m"].counters) == (30.0, {"queries": 10.0})


def test_memory_bounded():
    w = Windows(30.0)
    interval = 10.0
    for i in range(2000):
        w.push(counter_snap(i * interval, i))
        d = w.window("m")
        if d is not None:
            assert d.steps <= 30.0 / interval + 1  # steps kept ≤ window/interval + 1
    assert w.window("m").steps == 3  # 19960..19990: exactly window/interval


def test_window_seconds_must_be_positive():
    with pytest.raises(ValueError):
        Windows(0.0)


# --- observe -------------------------------------------------------------------------------


def _busy_delta(**over):
    kw = dict(
        t0=100.0, t1=102.0,
        counters={"queries": 4000.0, "hits": 2400.0, "external_hits": 600.0, "generation_tokens": 100.0},
        histograms={
            "request_prompt_tokens": HistogramDelta(4000.0, 4.0),
            "request_generation_tokens": HistogramDelta(200.0, 4.0),
            "iteration_tokens": HistogramDelta(4100.0, 50.0),
            "prefill_time": HistogramDelta(2.0, 4.0),
            "queue_time": HistogramDelta(0.4, 4.0),
            "ttft": HistogramDelta(3.0, 4.0),
        },
        start={"running": 3.0, "waiting": 0.0}, end={"running": 5.0, "waiting": 1.0},
        running_seconds=(3.0 + 5.0) / 2 * 2.0,  # as step_delta forms it: the trapezoid over the 2 s
    )
    kw.update(over)
    return Delta(**kw)


def test_observe_by_hand():
    o = observe(_busy_delta(), Context())
    # ΔM = Δq − Δk − Δe = 4000 − 2400 − 600 = 1000
    assert (o.queried_tokens, o.hit_tokens_device, o.hit_tokens_loaded) == (4000.0, 2400.0, 600.0)
    assert o.miss_tokens == 1000.0
    # ISL = 4000 / 4 = 1000; OSL = 200 / 4 = 50
    assert (o.isl, o.osl) == (1000.0, 50.0)
    # h = (2400 + 600) / 4000 = 0.75; n = Δq / ISL = 4; M̄ = 0.25·1000 = 250, H̄ = 750
    # ΔW_attn = n·(M̄·H̄ + M̄²/2) = 4·(187,500 + 31,250) = 4·218,750 = 875,000
    assert o.attention_work == pytest.approx(875_000.0)
    # ΔC_dec = ΔG·(ISL + OSL/2) = 100·(1000 + 25) = 102,500
    assert o.decode_context_tokens == pytest.approx(102_500.0)
    assert o.generation_tokens == 100.0
    # busy: running 3 and 5 > 0, Δsteps = 50 > 0
    assert o.busy and o.steps == 50.0
    assert (o.t, o.dt) == (102.0, 2.0)
    assert o.running == 4.0 and o.waiting == 1.0  # (3 + 5)/2; waiting at the later scrape
    assert o.requests_finished == 4.0
    # means: 2.0/4 = 0.5, 0.4/4 = 0.1, 3.0/4 = 0.75
    assert (o.prefill_time_mean, o.queue_time_mean, o.ttft_mean) == pytest.approx((0.5, 0.1, 0.75))
    # h_dev = 2400/4000 = 0.6, h_load = 600/4000 = 0.15, h = 0.75; TPS_miss = 1000 / 2 = 500
    assert (o.hit_ratio_device, o.hit_ratio_loaded, o.hit_ratio) == pytest.approx((0.6, 0.15, 0.75))
    assert o.miss_tps == pytest.approx(500.0)
    assert o.anomaly_hint == ""


def test_a_decode_only_step_is_a_chip_time_row_with_no_prefill_work():
    # No prompt token queried (Δq = Δk = Δe = 0) while 3–5 requests decode: ΔM = 0 and ΔW_attn = 0
    # (Σ over no prefilled request), not unknown: the row (50, 0, 0, 100, 102,500) pins k_dec, k_ctx
    # and T_step (physics review: attention_work None dropped every such step from the fit).
    # ISL and OSL: the recent ones (no request finished); ΔC_dec = 100·(1000 + 50/2) = 102,500
    from fitters.chiptime import design_row
    hists = {"iteration_tokens": HistogramDelta(100.0, 50.0), "request_prompt_tokens": HistogramDelta(0.0, 0.0),
             "request_generation_tokens": HistogramDelta(0.0, 0.0)}
    decode = {"queries": 0.0, "hits": 0.0, "external_hits": 0.0, "prompt_tokens": 0.0, "generation_tokens": 100.0,
              "preemptions": 0.0}
    hists["ttft"] = HistogramDelta(0.0, 0.0)
    d = _busy_delta(counters=decode, histograms=hists)
    o = observe(d, Context(isl=1000.0, osl=50.0))
    assert o.busy and (o.miss_tokens, o.attention_work) == (0.0, 0.0)
    assert design_row(o).tolist() == [50.0, 0.0, 0.0, 100.0, 102_500.0]
    # unknown ISL: no prefill, still no attention work; the decode context is unknown then
    o = observe(d, Context())
    assert o.attention_work == 0.0 and o.decode_context_tokens is None and design_row(o) is None
    # queries without an ISL: the attention work of those prefills is unknown
    d = _busy_delta(counters={**decode, "queries": 10.0}, histograms=hists)
    assert observe(d, Context()).attention_work is None
    # Δq = 0 with prefill work in the step (diff review): vLLM queries a request once, when first
    # scheduled. A chunked prefill's tail (16,384 prompt tokens, a first token), a resumed
    # preempted request, hits without queries, or no prompt_tokens to tell: unknown, as before
    tail = {"ttft": HistogramDelta(3.0, 1.0)}
    for counters, more in (({**decode, "prompt_tokens": 16384.0}, tail), ({**decode, "preemptions": 3.0}, {}),
                           ({**decode, "hits": 4096.0}, {}),
                           ({k: v for k, v in decode.items() if k != "prompt_tokens"}, {})):
        o = observe(_busy_delta(counters=counters, histograms={**hists, **more}), Context(isl=1000.0, osl=50.0))
        assert o.attention_work is None and design_row(o) is None, counters
    # preemptions exported at one scrape of the step only: unknown there, not 0 (review)
    o = observe(_busy_delta(counters={k: v for k, v in decode.items() if k != "preemptions"}, histograms=hists,
                            partial=frozenset({"preemptions"})), Context(isl=1000.0, osl=50.0))
    assert o.attention_work is None


def test_a_step_where_no_request_finished_takes_its_isl_from_the_first_tokens_in_it():
    # A burst of 2048-token prompts after traffic of 1024: no request finished in the step, 4 got
    # their first token. ISL was the recent 1024 (live-vLLM review: the burst's busy steps went into
    # the fits as ISL 1024). vLLM counts prompt tokens with the first token: 8192 / 4 = 2048.
    # h = 0: n = 4, M̄ = 2048, ΔW_attn = 4·2048²/2 = 8,388,608
    hists = {"iteration_tokens": HistogramDelta(8300.0, 40.0), "request_prompt_tokens": HistogramDelta(0.0, 0.0),
             "request_generation_tokens": HistogramDelta(0.0, 0.0), "ttft": HistogramDelta(10.0, 4.0)}
    counters = {"queries": 8192.0, "hits": 0.0, "external_hits": 0.0, "prompt_tokens": 8192.0,
                "generation_tokens": 4.0}
    o = observe(_busy_delta(counters=counters, histograms=hists), Context(isl=1024.0, osl=50.0))
    assert o.isl == 2048.0 and o.attention_work == 8_388_608.0
    # a finished request's mean comes first (the step's means, as MODEL.md §2 reads them)
    hists["request_prompt_tokens"] = HistogramDelta(3000.0, 2.0)
    assert observe(_busy_delta(counters=counters, histograms=hists), Context(isl=1024.0)).isl == 1500.0
    # no first token either: the recent ISL
    hists.update(request_prompt_tokens=HistogramDelta(0.0, 0.0), ttft=HistogramDelta(0.0, 0.0))
    assert observe(_busy_delta(counters=counters, histograms=hists), Context(isl=1024.0)).isl == 1024.0


@pytest.mark.parametrize("start,end,steps", [
    ({"running": 0.0}, {"running": 5.0}, 50.0),  # idle at the first scrape
    ({"running": 3.0}, {"running": 0.0}, 50.0),  # idle at the second
    ({"running": 3.0}, {"running": 5.0}, 0.0),   # engine did not step
    ({}, {"running": 5.0}, 50.0),                # running unknown at one end
])
def test_busy_needs_running_at_both_scrapes_and_steps(start, end, steps):
    hists = dict(_busy_delta().histograms)
    hists["iteration_tokens"] = HistogramDelta(100.0, steps)
    o = observe(_busy_delta(start=start, end=end, histograms=hists), Context())
    assert not o.busy
    assert o.miss_tps is None


def test_no_iteration_histogram_is_not_busy_and_its_steps_unknown():
    hists = {k: v for k, v in _busy_delta().histograms.items() if k != "iteration_tokens"}
    o = observe(_busy_delta(histograms=hists), Context())
    assert o.steps is None and not o.busy  # unknown, never 0 (a physics review)


def test_blocks_scaled_by_block_size():
    d = _busy_delta(counters={"queries": 10.0, "hits": 4.0})
    o = observe(d, Context(hit_unit="blocks", block_size=16.0))
    # 10 blocks · 16 = 160 tokens queried, 4 · 16 = 64 hit; no connector reason → loaded 0
    assert (o.queried_tokens, o.hit_tokens_device, o.hit_tokens_loaded) == (160.0, 64.0, 0.0)
    assert o.miss_tokens == 96.0  # 160 − 64 − 0
    # without a block size, blocks cannot be turned into tokens: unknown, not 10 or 0
    o = observe(d, Context(hit_unit="blocks", block_size=None))
    assert (o.queried_tokens, o.hit_tokens_device, o.miss_tokens) == (None, None, None)


def test_loaded_hits_unknown_when_parser_gave_a_reason():
    d = _busy_delta(counters={"queries": 4000.0, "hits": 2400.0, "generation_tokens": 100.0})
    o = observe(d, Context(unknown={"hit_ratio_loaded": "no external_prefix_cache_* counters"}))
    assert o.hit_tokens_loaded is None
    assert o.hit_ratio_device == pytest.approx(0.6)  # 2400 / 4000, still known
    assert o.hit_ratio_loaded is None and o.hit_ratio is None
    # ΔM = Δq − Δk − Δe cannot be formed; no prompt_tokens_by_source fallback in this delta
    assert o.miss_tokens is None and o.attention_work is None
    # without the reason, no external counter means no connector: loaded hits 0 (MODEL.md §2)
    o = observe(d, Context(unknown={}))
    assert o.hit_tokens_loaded == 0.0 and o.miss_tokens == 1600.0  # 4000 − 2400 − 0


def test_loaded_hits_that_went_missing_at_a_scrape_are_unknown_not_0():
    # external_prefix_cache_hits dropped (NaN) at one scrape of an engine that had it: the steps on
    # either side of that scrape, and every window holding them, have no loaded hits — unknown,
    # never the 0 of an engine without a KV connector (an adversarial review saw h_loaded 0 and
    # h 0.30 published for a true 0.6, physical TPM 254k -> 418k)
    had = sig(counters={"queries": 1000.0, "hits": 300.0, "external_hits": 300.0})
    lost = sig(counters={"queries": 2000.0, "hits": 600.0})
    back = sig(counters={"queries": 3000.0, "hits": 900.0, "external_hits": 900.0})
    d1, d2 = step_delta(had, lost, 100.0, 105.0), step_delta(lost, back, 105.0, 110.0)
    assert d1.partial == d2.partial == frozenset({"external_hits"})
    w = add_deltas([d1, d2])
    assert "external_hits" not in w.counters and w.partial == frozenset({"external_hits"})
    o = observe(w, Context())
    assert o.hit_tokens_loaded is None and o.hit_ratio is None and o.miss_tokens is None
    assert o.hit_ratio_device == pytest.approx(600 / 2000)
    # an engine that never had the counter: no connector, loaded hits 0 (MODEL.md §2)
    never = add_deltas([step_delta(lost, sig(counters={"queries": 3000.0, "hits": 900.0}), 105.0, 110.0)])
    assert never.partial == frozenset() and observe(never, Context()).hit_tokens_loaded == 0.0


def test_miss_from_local_compute_when_hits_unknown():
    d = _busy_delta(counters={"prompt_local_compute": 700.0, "generation_tokens": 100.0})
    o = observe(d, Context(unknown={"hit_ratio": "no prefix_cache_queries/hits counters"}))
    assert o.queried_tokens is None and o.miss_tokens == 700.0


def test_reset_step_carries_anomaly_hint():
    prev = sig({"queries": 1000.0, "hits": 500.0}, gauges={"running": 2.0},
               histograms={"iteration_tokens": Histogram(900.0, 300.0)})
    cur = sig({"queries": 40.0, "hits": 10.0}, gauges={"running": 2.0},
              histograms={"iteration_tokens": Histogram(60.0, 20.0)})
    d = step_delta(prev, cur, 0.0, 2.0)
    o = observe(d, Context())
    assert d.resets == 1
    assert o.anomaly_hint != ""
    # restart: increases are the current values, 40 and 10
    assert (o.queried_tokens, o.hit_tokens_device) == (40.0, 10.0)
    assert not o.busy  # a reset step is not used as busy time


# --- bad days at the window level (issue 7): per-engine restarts, cut bodies, gaps ------------

DP_COUNTERS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {q0}
vllm:prefix_cache_queries_total{{engine="1",model_name="m"}} {q1}
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {k0}
vllm:prefix_cache_hits_total{{engine="1",model_name="m"}} {k1}
"""


def dp(t, q0, q1, k0, k1):
    return parse_exposition(DP_COUNTERS.format(q0=q0, q1=q1, k0=k0, k1=k1), float(t)).models["m"]


def test_one_series_missing_from_an_engine_leaves_it_an_engine():
    # Two engines, four counters each. A NaN hits line on engine 1 is dropped (parse): engine 1 still
    # exports 3 of the 4 counters, so the model still has two engines (per-GPU values divide by 2;
    # counted as 1, a NaN for one scrape doubled them and restarted every fit); a stray line of an
    # engine "2" (1 family, under half of each engine's 5) is no engine. The step sums only the
    # counters both engines have: queries 2·(150 − 100) = 100, prompt 2·(120 − 100) = 40; hits
    # unknown, not engine 0's alone.
    # The stray line stays out of the sums (summed in, its coming changed the engine set, a step
    # without increases, and its staying left the model only hits, 2·(70 − 60) + (9 − 7) = 22:
    # adversarial test): every counter 2 × its growth, hits 2·10 = 20, at both steps.
    names = ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens")

    def scrape(t, v, hits1=None, stray=""):
        text = "".join(f"# TYPE vllm:{n}_total counter\n" + "".join(
            f'vllm:{n}_total{{engine="{e}",model_name="m"}} '
            f'{hits1 if (n, e) == ("prefix_cache_hits", 1) and hits1 else v[n]}\n' for e in (0, 1)) for n in names)
        text += "# TYPE vllm:num_requests_running gauge\n" + "".join(
            f'vllm:num_requests_running{{engine="{e}",model_name="m"}} 3\n' for e in (0, 1))
        return parse_exposition(text + stray, float(t)).models["m"]
    before = scrape(0, {"prefix_cache_queries": 100, "prefix_cache_hits": 50, "prompt_tokens": 100,
                        "generation_tokens": 10})
    after = {"prefix_cache_queries": 150, "prefix_cache_hits": 60, "prompt_tokens": 120, "generation_tokens": 20}
    nan = scrape(5, after, hits1="NaN")
    assert "prefix_cache_hits" not in nan.engines["1"].counters
    assert set(before.engines) == set(nan.engines) == {"0", "1"}
    d = step_delta(before, nan, 0.0, 5.0)
    assert d.counters == {"queries": 100.0, "prompt_tokens": 40.0, "generation_tokens": 20.0}
    stray = scrape(5, after, stray='vllm:prefix_cache_hits_total{engine="2",model_name="m"} 7\n')
    # parse leaves it out: the model's sums and gauges are the two engines' (summed in, every signal
    # but hits was unknown for the model, "missing for some data-parallel engines")
    assert set(stray.engines) == {"0", "1"} and "hit_ratio" not in stray.unknown
    assert stray.counters == {"queries": 300.0, "hits": 120.0, "prompt_tokens": 240.0, "generation_tokens": 40.0}
    assert stray.gauges["running"] == 6.0
    # a body cut after engine 0's first counter: engine 1 has its gauges (3 families, engine 0 4), an
    # engine; its running is summed, 3 + 5 = 8, and the queries of engine 0 alone are no sum
    # (counted by counters alone, engine 1 was a stray: running 3, queries engine 0's: review)
    gauges = "".join(f'# TYPE vllm:{n} gauge\n' + "".join(f'vllm:{n}{{engine="{e}",model_name="m"}} {v}\n'
                                                          for e, v in ((0, a), (1, b)))
                     for n, a, b in (("num_requests_running", 3, 5), ("num_requests_waiting", 1, 4),
                                     ("kv_cache_usage_perc", 0.3, 0.95)))
    queries0 = 'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000\n'
    cut = parse_exposition(gauges + '# TYPE vllm:prefix_cache_queries_total counter\n' + queries0, 5.0).models["m"]
    assert set(cut.engines) == {"0", "1"} and "queries" not in cut.counters
    assert (cut.gauges["running"], cut.gauges["waiting"], cut.gauges["kv_usage"]) == (8.0, 5.0, 0.95)
    # cut inside engine 0's request_prompt_tokens histogram (14 edges: 17 lines), after both engines'
    # gauges and queries: engines are told by families (5 and 4), not series (22 and 4: counted so,
    # engine 1 was dropped and engine 0's running 3 and queries 1000 published: review); running
    # 3 + 5, queries 1000 + 3000, the histogram unknown
    edges = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
    body = gauges + '# TYPE vllm:prefix_cache_queries_total counter\n' + queries0 + (
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 3000\n'
        '# TYPE vllm:request_prompt_tokens histogram\n')
    body += "".join(f'vllm:request_prompt_tokens_bucket{{engine="0",le="{le}.0",model_name="m"}} 7\n' for le in edges)
    body += ('vllm:request_prompt_tokens_bucket{engine="0",le="+Inf",model_name="m"} 7\n'
             'vllm:request_prompt_tokens_sum{engine="0",model_name="m"} 700\n'
             'vllm:request_prompt_tokens_count{engine="0",model_name="m"} 7\n')
    cut = parse_exposition(body, 5.0).models["m"]
    assert set(cut.engines) == {"0", "1"} and cut.gauges["running"] == 8.0 and cut.counters["queries"] == 4000.0
    assert "request_prompt_tokens" not in cut.histograms
    later = scrape(10, {"prefix_cache_queries": 200, "prefix_cache_hits": 70, "prompt_tokens": 140,
                        "generation_tokens": 30}, stray='vllm:prefix_cache_hits_total{engine="2",model_name="m"} 9\n')
    for a, b in ((before, stray), (stray, later)):  # the stray line appears, then stays
        d = step_delta(a, b, 0.0, 5.0)
        assert d.counters == {"queries": 100.0, "hits": 20.0, "prompt_tokens": 40.0, "generation_tokens": 20.0}


def test_one_engine_restarts_sum_goes_down():
    # engine 0: queries 1000 → 1500, hits 400 → 700; engine 1 restarted: 800 → 50, 300 → 20.
    # Model sum 1800 → 1550 went down. Per engine: 1500 − 1000 = 500 plus engine 1's current 50
    # = 550 queries; hits 300 + 20 = 320. (A whole-model reset would count 1550 and 720.)
    d = step_delta(dp(0, 1000, 800, 400, 300), dp(5, 1500, 50, 700, 20), 0.0, 5.0)
    assert d.counters == {"queries": 550.0, "hits": 320.0}
    assert d.resets == 1


def test_one_engine_restarts_sum_goes_up():
    # engine 0: 1000 → 2000 (hits 400 → 900); engine 1 restarted 800 → 50 (hits 300 → 20).
    # Model sum 1800 → 2050 went UP: the summed value alone hides the restart (250 would be an
    # undercount). Per engine: 1000 + 50 = 1050 queries, 500 + 20 = 520 hits.
    d = step_delta(dp(0, 1000, 800, 400, 300), dp(5, 2000, 50, 900, 20), 0.0, 5.0)
    assert d.counters == {"queries": 1050.0, "hits": 520.0}
    assert d.resets == 1


def test_engine_set_changed_step_has_no_increases():
    one = parse_exposition('vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0\n', 0.0).models["m"]
    two = dp(5, 150, 900, 0, 0)
    # engine 1 appears with a lifetime total of 900: adding it would inflate the step by 900
    d = step_delta(one, two, 0.0, 5.0)
    assert d.counters == {} and d.histograms == {} and d.resets == 0 and d.rescaled == 1


def test_cut_body_is_neither_a_restart_nor_a_partial_sum():
    full = dp(0, 1000, 800, 400, 300)
    # the body was cut inside engine 1's hits line: "...} 31" of "310.0", no final newline
    cut = DP_COUNTERS.format(q0=1200, q1=900, k0=500, k1=310.0)
    cut = cut[: cut.rindex("310.0") + 2]
    snap = parse_exposition(cut, 5.0)
    assert snap.quirks == {"truncated": 1, "engine_incomplete": 1}
    cur = snap.models["m"]
    # engine 1's hits are gone: the model's hits are unknown (not 500, not 531);
    # queries complete: 1200 − 1000 + 900 − 800 = 300; nothing went down, no restart
    assert "hits" not in cur.counters
    d = step_delta(full, cur, 0.0, 5.0)
    assert d.counters == {"queries": 300.0}
    assert d.resets == 0


def test_histogram_sum_down_or_bucket_down_is_unknown_not_clamped():
    prev = sig(histograms={"ttft": Histogram.of(10.0, 4.0, ((0.5, 2.0), (math.inf, 4.0)))})
    # _count 4 → 6 (no reset) but _sum 10 → 9: Δsum unknown, the mean too (not −0.5)
    cur = sig(histograms={"ttft": Histogram.of(9.0, 6.0, ((0.5, 3.0), (math.inf, 6.0)))})
    h = step_delta(prev, cur, 0.0, 5.0).histograms["ttft"]
    assert math.isnan(h.sum) and h.count == 2.0 and h.mean is None
    assert h.buckets == ((0.5, 1.0), (math.inf, 2.0))  # 3 − 2, 6 − 4
    # a bucket going 2 → 1 while _count grows: the bucket deltas are unknown (not 0)
    cur = sig(histograms={"ttft": Histogram.of(12.0, 6.0, ((0.5, 1.0), (math.inf, 6.0)))})
    h = step_delta(prev, cur, 0.0, 5.0).histograms["ttft"]
    assert h.buckets == () and h.count == 2.0 and h.mean == pytest.approx(1.0)  # (12 − 10) / 2


def test_sum_disagreeing_with_buckets_makes_the_mean_unknown():
    # sample 01 (vLLM 0.5.1): every TTFT observation in the first bucket, le=0.001. Here 208 of
    # them over a step, with a _sum of 104 s: the buckets allow at most 208 · 0.001 = 0.208 s.
    h = HistogramDelta.of(104.0, 208.0, ((0.001, 208.0), (0.005, 208.0), (math.inf, 208.0)))
    assert h.problem == "_sum disagrees with the buckets"
    assert h.mean is None
    # a _sum of 0.15 s fits (≤ 0.208): mean 0.15 / 208
    ok = HistogramDelta.of(0.15, 208.0, ((0.001, 208.0), (0.005, 208.0), (math.inf, 208.0)))
    assert ok.problem == "" and ok.mean == pytest.approx(0.15 / 208)
    # lower bound: 2 observations in (1, 2] and 1 above 2 (+Inf bucket): Δsum ≥ 2·1 + 1·2 = 4
    low = HistogramDelta.of(3.0, 3.0, ((1.0, 0.0), (2.0, 2.0), (math.inf, 3.0)))
    assert low.problem and low.mean is None
    assert HistogramDelta.of(4.5, 3.0, ((1.0, 0.0), (2.0, 2.0), (math.inf, 3.0))).mean == pytest.approx(1.5)
    # custom edges without +Inf (a paste): observations beyond the last edge → no upper bound
    assert HistogramDelta.of(50.0, 2.0, ((1.0, 1.0),)).mean == pytest.approx(25.0)
    # no buckets at all (only _sum/_count): nothing to check against
    assert HistogramDelta(50.0, 2.0).mean == pytest.approx(25.0)


def test_empty_buckets_no_observation_no_mean():
    # an idle interval: every bucket delta 0, Δcount 0 → no data, not a mean of 0
    h = HistogramDelta.of(0.0, 0.0, ((0.1, 0.0), (1.0, 0.0), (math.inf, 0.0)))
    assert h.mean is None and h.problem == "no observation in the interval"


def test_scrape_gap_restarts_the_window():
    w = Windows(30.0)  # gaps: steps longer than 2 × 30 = 60 s
    for t in (0, 10, 20):
        w.push(counter_snap(t, t))
    # target unreachable from t=20 to t=200: the 180 s step is a gap, not a step
    assert w.push(counter_snap(200, 500)) == {}
    assert w.gaps == 1 and w.window("m") is None and w.models() == []
    # the next step starts the window again: 210..., queries 520 − 500 = 20
    out = w.push(counter_snap(210, 520))
    assert out["m"].counters == {"queries": 20.0}
    assert (w.window("m").t0, w.window("m").t1, w.window("m").steps) == (200.0, 210.0, 1)
    # a step of exactly 2 × window is still a step (60 s ≤ 60 s)
    out = w.push(counter_snap(270, 580))
    assert out["m"].counters == {"queries": 60.0} and w.gaps == 1


def test_hits_above_queries_are_unknown_not_a_ratio_above_one():
    # a corrupted hit counter (found by the property test on sample 05): queries 32 → 64,
    # hits 0 → 33 over a step; 33 hits of 32 queries is impossible → unknown, never h = 1.03
    from exporter.observe import hit_problem, hit_tokens
    d = Delta(0.0, 2.0, {"queries": 32.0, "hits": 33.0}, {}, {}, {})
    assert hit_problem(d, Context()) != ""
    assert hit_tokens(d, Context()) == (None, None, None)
    o = observe(d, Context())
    assert o.hit_ratio is None and o.miss_tokens is None
    # equal is fine: every queried token a hit (h = 1 exactly, 32 / 32)
    ok = Delta(0.0, 2.0, {"queries": 32.0, "hits": 32.0}, {}, {}, {})
    assert hit_problem(ok, Context()) == "" and observe(ok, Context()).hit_ratio == 1.0
    # hits in a step without any query (a glitched hit counter while idle) are as impossible
    idle = Delta(0.0, 2.0, {"queries": 0.0, "hits": 1e12}, {}, {}, {})
    assert hit_problem(idle, Context()) != "" and hit_tokens(idle, Context()) == (None, None, None)
    quiet = Delta(0.0, 2.0, {"queries": 0.0, "hits": 0.0}, {}, {}, {})  # idle: no problem, no ratio (0/0)
    assert hit_problem(quiet, Context()) == "" and observe(quiet, Context()).hit_ratio is None


def test_configured_gap_seconds_reaches_the_analyzer_windows():
    a = Analyzer(Config(window_seconds=60.0, gap_seconds=25.0))
    for t, q in ((0, 0), (10, 10), (40, 40)):  # the 30-s step is longer than 25 s: a gap, not a step
        a.ingest(counter_snap(t, q))
    assert a.windows.gaps == 1 and a.windows.window("m") is None


def test_an_interval_longer_than_the_publish_window_is_not_a_gap_by_default():
    a = Analyzer(Config(interval=130.0, window_seconds=60.0))  # default gap: 2 × 130 s, not 2 × 60 s
    for t, q in ((0, 0), (130, 13), (260, 26)):
        a.ingest(counter_snap(t, q))
    assert a.windows.gaps == 0 and a.windows.window("m").counters == {"queries": 13.0}


def test_replay_takes_its_interval_from_the_trace():
    from exporter.replay import replay
    from exporter.sources import Trace
    body = 'vllm:prefix_cache_queries_total{{model_name="m"}} {q}\nvllm:prefix_cache_hits_total{{model_name="m"}} {h}\n'
    snaps = [(1.7e9 + 130.0 * i, body.format(q=100.0 * i, h=25.0 * i)) for i in range(4)]  # a scrape every 130 s
    r = replay(Trace(snaps, [], {}), Config(), "t").runner
    assert r.analyzer.windows.gaps == 0
    assert r.current()[0].models["m"].hit_ratio["device"] == 0.25  # 25 hits per 100 queries, every step


def test_a_scrape_without_hit_counters_inside_the_window_gives_a_reason_not_silence():
    from exporter.replay import TraceClock
    from exporter.runner import Runner
    clock = TraceClock()
    r = Runner(Config(window_seconds=60.0), "t", clock=clock)
    full = 'vllm:prefix_cache_queries_total{{model_name="m"}} {q}\nvllm:prefix_cache_hits_total{{model_name="m"}} {h}\n'
    cut = 'vllm:prefix_cache_hits_total{{model_name="m"}} {h}\n'  # queries lost at the window's first scrape
    for t, body in ((0.0, cut.format(h=0.0)), (5.0, full.format(q=40.0, h=10.0)), (10.0, full.format(q=80.0, h=20.0))):
        clock.t = t
        assert r.ingest_text(t, body)
    m = r.current()[0].models["m"]
    assert "device" not in m.hit_ratio and "missing at a scrape inside the publish window" in m.unknown["hit_ratio"]


def test_a_scrape_without_token_counters_inside_the_window_gives_the_tpm_a_reason_not_silence():
    # a breaker (fleet mode, two restarts in one poll: the family left out): the observed TPM was
    # absent with no kvhit_unknown_info, where h, ISL and the rest said why
    from exporter.replay import TraceClock
    from exporter.runner import Runner
    clock = TraceClock()
    r = Runner(Config(window_seconds=60.0), "t", clock=clock)
    full = ('vllm:prompt_tokens_total{{model_name="m"}} {p}\nvllm:generation_tokens_total{{model_name="m"}} {g}\n'
            'vllm:prefix_cache_queries_total{{model_name="m"}} {p}\n')
    cut = 'vllm:prefix_cache_queries_total{{model_name="m"}} {p}\n'  # token counters lost at one scrape
    for t, body in ((0.0, full.format(p=0.0, g=0.0)), (5.0, cut.format(p=40.0)), (10.0, full.format(p=80.0, g=8.0))):
        clock.t = t
        assert r.ingest_text(t, body)
    m = r.current()[0].models["m"]
    assert not m.tpm_observed
    assert m.unknown["tpm_observed"].startswith("prompt_tokens and generation_tokens missing at a scrape inside the "
                                                "publish window")


def test_a_token_counter_gone_from_the_latest_scrape_is_told_absent_not_to_wait_for_the_window():
    # a breaker: generation_tokens_total dropped from every scrape read "missing at a scrape inside
    # the publish window … unknown until that scrape leaves the window": the latest scrape never leaves
    from exporter.replay import TraceClock
    from exporter.runner import Runner
    clock = TraceClock()
    r = Runner(Config(window_seconds=60.0), "t", clock=clock)
    body = 'vllm:prompt_tokens_total{{model_name="m"}} {p}\nvllm:prefix_cache_queries_total{{model_name="m"}} {p}\n'
    for t in (0.0, 5.0, 10.0):
        clock.t = t
        assert r.ingest_text(t, body.format(p=8.0 * t))
    m = r.current()[0].models["m"]
    assert not m.tpm_observed
    assert m.unknown["tpm_observed"].startswith("generation_tokens absent from the latest scrape (not exported")


def test_a_chip_time_fit_without_the_running_gauge_says_so():
    # a breaker: num_requests_running absent, the fit read only "too few usable busy steps" (a step is
    # busy when requests run at both of its ends: observe.py), the gauge never named
    from exporter.replay import TraceClock
    from exporter.runner import Runner
    clock = TraceClock()
    r = Runner(Config(window_seconds=60.0), "t", clock=clock)
    body = ('vllm:prompt_tokens_total{{model_name="m"}} {p}\nvllm:generation_tokens_total{{model_name="m"}} {p}\n'
            'vllm:prefix_cache_queries_total{{model_name="m"}} {p}\nvllm:prefix_cache_hits_total{{model_name="m"}} 0\n')
    for t in (0.0, 5.0, 10.0):
        clock.t = t
        assert r.ingest_text(t, body.format(p=8.0 * t))
    chip = r.current()[0].models["m"].fits["chip_time"]
    assert not chip.ok and chip.reason.endswith(": vllm:num_requests_running is absent from the latest scrape, so no "
                                                "step can be told busy")
    clock.t = 15.0
    assert r.ingest_text(15.0, body.format(p=120.0) + 'vllm:num_requests_running{model_name="m"} 2\n')
    assert "num_requests_running" not in r.current()[0].models["m"].fits["chip_time"].reason


@pytest.mark.parametrize("scope", ["", "fleet"])
def test_an_analysis_that_fails_on_read_is_counted_once_per_snapshot_and_is_no_failed_scrape(scope):
    # Before, every read (a /readyz probe, a Prometheus scrape of kvhit) counted one more internal
    # error and set kvhit_up 0, so the count and the scrape backoff depended on who was reading.
    # Its reason is kvhit's own in fleet mode too: it read "no vLLM series matched the selector"
    # (a consistency review: KvhitTargetNotAnalysable's runbook sent on-call to the selector)
    from exporter.replay import TraceClock
    from exporter.runner import Runner
    clock = TraceClock()
    r = Runner(Config(window_seconds=60.0), "t", clock=clock, scope=scope)
    body = 'vllm:prefix_cache_queries_total{{model_name="m"}} {q}\nvllm:prefix_cache_hits_total{{model_name="m"}} {h}\n'
    for t, q in ((0.0, 0.0), (5.0, 40.0)):
        clock.t = t
        assert r.ingest_text(t, body.format(q=q, h=q / 4))

    def broken():
        raise ZeroDivisionError
    r.analyzer.analysis = broken
    for _ in range(5):
        analysis, health = r.current()
        assert analysis.models == {} and analysis.engine_reason == "analysis failed"
    assert health.errors == {"internal": 1} and health.up and r.next_delay() == 5.0
    clock.t = 10.0
    assert r.ingest_text(10.0, body.format(q=80.0, h=20.0))  # the next snapshot: one more, once
    for _ in range(3):
        health = r.current()[1]
    assert health.errors == {"internal": 2}



def test_one_models_failed_analysis_leaves_the_others_and_is_counted_once(monkeypatch, caplog):
    # A review's absurd cache_config_info (1e200 blocks of 1e200 tokens) raised OverflowError in one
    # model's sizing, and every model's values went with it while kvhit read up, fresh and ready.
    import logging

    from exporter.replay import TraceClock
    from exporter.runner import Runner
    clock = TraceClock()
    r = Runner(Config(window_seconds=60.0), "t", clock=clock)
    body = "".join(f'vllm:prefix_cache_queries_total{{{{model_name="{m}"}}}} {{q}}\n'
                   f'vllm:prefix_cache_hits_total{{{{model_name="{m}"}}}} {{h}}\n' for m in ("a", "b"))
    for t, q in ((0.0, 0.0), (5.0, 40.0)):
        clock.t = t
        assert r.ingest_text(t, body.format(q=q, h=q / 4))
    analysed = Analyzer._model_analysis

    def fails_for_b(self, snap, model, w):
        if model == "b":
            raise OverflowError("cannot convert float infinity to integer")
        return analysed(self, snap, model, w)
    monkeypatch.setattr(Analyzer, "_model_analysis", fails_for_b)
    r.analyzer._cache = None
    with caplog.at_level(logging.WARNING, logger="kvhit"):
        for _ in range(3):
            analysis, health = r.current()
            assert set(analysis.models) == {"a"} and analysis.failed == {"b": "OverflowError"}
            assert analysis.models["a"].hit_ratio["device"] == 0.25  # 10 hits of 40 queries
    assert health.errors == {"internal": 1} and health.up  # once per snapshot, and no failed scrape
    assert sum("analysis of one model" in rec.getMessage() for rec in caplog.records) == 1

def test_restarts_glitches_and_another_process_are_logged(caplog):
    # an operator reading the log saw no line for a restart or a skipped scrape (soak review)
    import logging
    runner = Runner(Config(interval=5.0), "t", clock=lambda: 0.0)
    bodies = [(100.0, 1000.0), (150.0, 1000.0), (20.0, 1002.0),  # restarted at 1002: 20 since
              (10.0, 1002.0),  # lower, _created unchanged: skipped
              (40.0, 1002.0), (70.0, 500.0)]  # _created 500, before the scrape at 1025: another process
    with caplog.at_level(logging.INFO, logger="kvhit"):
        for i, (q, created) in enumerate(bodies):
            assert runner.ingest_text(1000.0 + 5 * i, EXPO.format(q=q, created=created))
    from exporter.runner import _STEP_NOTES, STEP_NOTE_FORMAT  # restart, glitch, another process: each once, in that order
    assert [r.args[0] for r in caplog.records if r.msg == STEP_NOTE_FORMAT] == list(_STEP_NOTES[:3])
    # each with its scrape's time (a replay logged at the wall clock only): 1000 + 5·2 s, 1015 (skipped), 1025
    assert [r.args[1] for r in caplog.records if r.msg == STEP_NOTE_FORMAT] == [
        "1970-01-01 00:16:50", "1970-01-01 00:16:55", "1970-01-01 00:17:05"]
    # another process again at the next scrape (a load-balanced URL): not logged again for 10 minutes
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvhit"):
        assert runner.ingest_text(1030.0, EXPO.format(q=90.0, created=400.0))
    assert runner.analyzer.windows.foreign == 2 and not [r for r in caplog.records if r.msg == STEP_NOTE_FORMAT]
    # 10 minutes on (scrapes every 5 s, same process), another process once more: logged, saying the
    # one held back at 1030 (a breaker saw a second restart within 10 min leave no line at all)
    for i in range(1, 119):  # up to 1620
        assert runner.ingest_text(1030.0 + 5 * i, EXPO.format(q=90.0 + i, created=400.0))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvhit"):
        assert runner.ingest_text(1625.0, EXPO.format(q=500.0, created=300.0))  # 600 s after the line at 1025
    assert runner.analyzer.windows.foreign == 3
    assert [r.args for r in caplog.records if r.msg == STEP_NOTE_FORMAT] == [
        (_STEP_NOTES[2], "1970-01-01 00:27:05", "; 1 more scrape(s) after the one at 1970-01-01 00:17:05 UTC told it too")]


def test_restarts_held_back_by_the_rate_limit_are_said_with_no_next_one(caplog):
    # two models restart at scrape 1100 and again at 1200 and 1300, then none: the first is logged;
    # the two scrapes after it, within 10 min, are said once 10 min have passed since it, at the
    # scrape at 1700, counted per scrape (each told both models' restarts at once): the count once
    # waited for a next restart that never came, and added model steps (review)
    import logging

    from exporter.runner import _STEP_NOTES, HELD_NOTE_FORMAT, STEP_NOTE_FORMAT
    two = "".join(line + "\n" + (line.replace('model_name="m"', 'model_name="n"') + "\n" if "{{" in line else "")
                  for line in EXPO.splitlines())  # each sample line again for model n, beside it
    runner = Runner(Config(interval=5.0), "t", clock=lambda: 0.0)
    created, q, said = 1000.0, 0.0, {}
    with caplog.at_level(logging.INFO, logger="kvhit"):
        for t in range(1000, 2005, 5):
            if t in (1100, 1200, 1300):
                created, q = t - 1.0, 0.0  # restarted a second before the scrape: counts from 0
            q += 10.0
            caplog.clear()
            assert runner.ingest_text(float(t), two.format(q=q, created=created))
            said.update({t: (r.msg, r.args) for r in caplog.records if r.msg in (STEP_NOTE_FORMAT, HELD_NOTE_FORMAT)})
    assert runner.analyzer.windows.unusual_steps[0] == 6  # 3 scrapes × 2 models
    assert said == {1100: (STEP_NOTE_FORMAT, (_STEP_NOTES[0], "1970-01-01 00:18:20", "")),
                    1700: (HELD_NOTE_FORMAT, (2, "1970-01-01 00:18:20", _STEP_NOTES[0]))}


def test_a_restart_is_logged_when_the_fit_step_then_fails(caplog):
    # the restart step is in the windows whatever the fits did after it; its note was skipped
    import logging
    runner = Runner(Config(interval=5.0), "t", clock=lambda: 0.0)
    assert runner.ingest_text(1000.0, EXPO.format(q=100.0, created=1000.0))

    def broken():
        raise ZeroDivisionError
    runner.analyzer.fit_step = broken
    with caplog.at_level(logging.INFO, logger="kvhit"):
        assert not runner.ingest_text(1005.0, EXPO.format(q=20.0, created=1002.0))  # restarted at 1002
    from exporter.runner import _STEP_NOTES, STEP_NOTE_FORMAT
    assert runner.analyzer.windows.unusual_steps[0] == 1
    assert [r.args[0] for r in caplog.records if r.msg == STEP_NOTE_FORMAT] == [_STEP_NOTES[0]]
    assert runner.current()[1].errors == {"internal": 1}


def test_a_failed_analysis_of_a_scrape_is_a_failed_scrape():
    # README (Failure modes): kvhit_up 0 and the scrape backoff, as when the target is down, which
    # is why KvhitTargetDown leaves a reason="internal" error to KvhitAnalysisFailing
    runner = Runner(Config(interval=5.0), "t", clock=lambda: 1010.0)
    assert runner.ingest_text(1000.0, EXPO.format(q=100.0, created=900.0))

    def broken():
        raise ZeroDivisionError
    runner.analyzer.fit_step = broken
    for t in (1005.0, 1010.0):
        assert not runner.ingest_text(t, EXPO.format(q=100.0 + t - 1000.0, created=900.0))
    health = runner.current()[1]
    assert not health.up and health.errors == {"internal": 2} and health.last_success == 1000.0
    assert runner.next_delay() == 10.0  # the second failure in a row: 2 intervals (1, 2, 4, 8)


def test_a_source_that_raises_what_it_does_not_classify_is_kvhit_s_bug():
    # counted "error" before, so KvhitTargetDown blamed the target (diff review): "internal" now,
    # which KvhitAnalysisFailing reads
    class Broken:
        def fetch(self):
            raise KeyError("x")
    runner = Runner(Config(interval=5.0), "t", clock=lambda: 1000.0)
    assert not runner.poll(Broken())
    assert runner.current()[1].errors == {"internal": 1}
