"""fitters/caching.py: the seed-003 prefix-caching verdict and its bounded 24-hour rollup
(MODEL.md §5). Expected values are worked by hand in the comments."""
from __future__ import annotations

import math

import pytest

from fitters.caching import HitRollup, decide, speedup, verdict


@pytest.mark.parametrize(
    "h_hist, share, h_recent, jitter, kv, state",
    [
        (0.20, 0.5, 0.20, 0.00, 0.5, "not_paying"),  # h < 0.25 over the history
        (0.50, 0.5, 0.50, 0.00, 0.5, "linear"),  # 0.25 ≤ h ≤ 0.60
        (0.70, 0.5, 0.70, 0.00, 0.5, "dedicated_pool_worth_it"),  # h > 0.60 and share > 0.40
        (0.70, 0.3, 0.70, 0.00, 0.5, "linear"),  # h > 0.60 but decode dominates
        (0.90, 0.3, 0.90, 0.00, 0.5, "diminishing_returns"),  # > 0.85, small share, no jitter
        (0.90, 0.5, 0.90, 0.00, 0.5, "dedicated_pool_worth_it"),  # > 0.85 but a pool pays
        (0.90, 0.5, 0.90, 0.06, 0.95, "thrash_risk"),  # jitter 0.06 ≥ 0.05 with KV 0.95 ≥ 0.90
        (0.90, 0.5, 0.90, 0.06, 0.50, "dedicated_pool_worth_it"),  # jitter but KV not near full
        (0.90, 0.5, 0.90, 0.00, None, "dedicated_pool_worth_it"),  # KV usage unknown, no jitter: no thrash
        (0.90, 0.5, 0.80, 0.06, None, "dedicated_pool_worth_it"),  # KV usage unknown, recent h ≤ 0.85
        (0.25, 0.5, 0.25, 0.00, 0.5, "linear"),  # 0.25 is not < 0.25
        # each of MODEL.md §5's edges from both sides: h > 0.60, share > 0.40, h > 0.85 (history and recent)
        (0.60, 0.5, 0.60, 0.00, 0.5, "linear"),
        (0.61, 0.5, 0.61, 0.00, 0.5, "dedicated_pool_worth_it"),
        (0.70, 0.40, 0.70, 0.00, 0.5, "linear"),
        (0.70, 0.41, 0.70, 0.00, 0.5, "dedicated_pool_worth_it"),
        (0.85, 0.3, 0.85, 0.00, 0.5, "linear"),
        (0.86, 0.3, 0.86, 0.00, 0.5, "diminishing_returns"),
        (0.90, 0.5, 0.85, 0.06, 0.95, "dedicated_pool_worth_it"),
        (0.90, 0.5, 0.86, 0.06, 0.95, "thrash_risk"),
        # kvhit's own edges (MODEL.md names no number): jitter ≥ 0.05, KV usage ≥ 0.90
        (0.90, 0.5, 0.90, 0.05, 0.90, "thrash_risk"),
        (0.90, 0.5, 0.90, 0.049, 0.95, "dedicated_pool_worth_it"),
        (0.90, 0.5, 0.90, 0.06, 0.899, "dedicated_pool_worth_it"),
    ],
)
def test_decide_table(h_hist, share, h_recent, jitter, kv, state):
    assert decide(h_hist, share, h_recent, jitter, kv) == (state, "")


def test_decide_unknowns_say_why():
    state, reason = decide(None, 0.5, None, None, None)
    assert state is None and "queries" in reason
    state, reason = decide(0.7, None, 0.7, None, None)  # a pool decision needs the prefill share
    assert state is None and "prefill share" in reason
    assert decide(0.1, None, 0.1, None, None) == ("not_paying", "")  # not_paying needs no share
    # recent h > 0.85 jittering with the KV usage unknown: thrash, the first rule, is undecided, so
    # no later rule may answer (an adversarial review saw dedicated_pool_worth_it published where
    # the same traffic with KV usage 0.95 reads thrash_risk)
    state, reason = decide(0.9, 0.5, 0.9, 0.06, None)
    assert state is None and "KV cache usage (no usable kv_cache_usage_perc) unknown" in reason


@pytest.mark.parametrize("jitter, kv, partial, state, unknown", [
    # a re-verification saw thrash ruled out (dedicated_pool_worth_it) on a jitter that could not
    # be computed yet, and on a KV usage max taken over the steps that had one
    (None, 0.95, False, None, ["jitter"]),  # KV near full, jitter unknown: undecided
    (None, None, False, None, ["jitter", "KV cache usage"]),
    (None, 0.50, False, "dedicated_pool_worth_it", []),  # KV known below 0.90 at every step: ruled out
    (0.06, 0.50, True, None, ["KV cache usage (no usable kv_cache_usage_perc at some steps)"]),  # a lower bound
    (0.06, 0.95, True, "thrash_risk", []),  # a lower bound already ≥ 0.90
    (0.00, 0.50, True, "dedicated_pool_worth_it", []),  # no jitter: ruled out whatever the KV usage
])
def test_thrash_is_undecided_while_a_term_is_unknown(jitter, kv, partial, state, unknown):
    got, reason = decide(0.9, 0.5, 0.9, jitter, kv, partial)
    assert got == state and all(u in reason for u in unknown) and (reason == "") == (not unknown), reason


def test_thrash_is_undecided_while_recent_hits_are_unknown():
    # a review: thrashing traffic (h 0.97/0.80 by minute, KV 0.996), then the loaded-hits counter
    # NaN: steps with queries added nothing to the rollup, read as "no recent query", and
    # diminishing_returns was published (KvhitCacheThrash could not fire)
    state, reason = decide(0.9, 0.5, None, None, 0.996, hits_partial=True)
    assert state is None and "the recent hit ratio (hits unknown at some recent steps)" in reason, reason
    state, reason = decide(0.9, 0.5, 0.82, 0.06, 0.996, hits_partial=True)  # h of the known minutes only
    assert state is None and "recent hit ratio" in reason
    # nor is a low jitter of the known minutes a term known to fail (a re-verification: loaded hits
    # NaN only in the 0.80 minutes left jitter 0.049 of the 0.97 ones, and diminishing_returns)
    state, reason = decide(0.9, 0.05, 0.9, 0.02, 0.99, hits_partial=True)
    assert state is None and "jitter" in reason and "recent hit ratio" in reason, reason
    # a term known to fail still rules thrash out: KV usage known below 0.90 at every step
    assert decide(0.9, 0.5, None, None, 0.5, hits_partial=True) == ("dedicated_pool_worth_it", "")


def test_rollup_knows_when_hits_were_unknown_at_a_step_with_queries():
    r = HitRollup()
    r.update(0.0, 60.0, 0.0, None, kv_usage=0.5)  # idle: no query, nothing unknown
    assert not r.hits_partial()
    r.update(60.0, 120.0, 1000.0, None, kv_usage=0.5)  # queries, hits unknown
    assert r.hits_partial() and r.hit_ratio() is None
    r2 = HitRollup()
    r2.update(0.0, 60.0, None, None, kv_usage=0.5)  # queries unknown too
    assert r2.hits_partial()


def _rollup(*steps: tuple[float, float | None], gap_after: int | None = None, seconds: float = 60.0) -> HitRollup:
    """A rollup fed steps of ``seconds`` with (Δqueries, Δhits); ``gap_after``: the step after that
    index starts a step later (a scrape lost between)."""
    r, t = HitRollup(), 0.0
    for i, (q, h) in enumerate(steps):
        r.update(t, t + seconds, q, h)
        t += seconds * (2 if i == gap_after else 1)
    return r


def test_a_torn_read_s_step_is_added_with_the_neighbour_that_carries_its_difference():
    # every step truly 1000 queried, 900 hits (h 0.9); by hand from the counters' increase
    # queries read 200 low at step 2's end: (800, 900), then (1200, 900): 2700 / 3000 (step 2
    # left out alone: 1800 / 2200 = 0.818)
    r = _rollup((1000.0, 900.0), (800.0, 900.0), (1200.0, 900.0))
    assert r.hit_ratio() == pytest.approx(0.9, abs=1e-12) and not r.hits_partial()
    # hits read 200 low at step 2's end: (1000, 700), then (1000, 1100) exceeds; with the step after
    # it (2000, 2000) it is within: 3600 / 4000 (step 3 left out: 2500 / 3000 = 0.833)
    r = _rollup((1000.0, 900.0), (1000.0, 700.0), (1000.0, 1100.0))
    assert r.hit_ratio() == pytest.approx(1600.0 / 2000.0) and r.hits_partial()  # waiting for the step after it
    r.update(180.0, 240.0, 1000.0, 900.0)
    assert r.hit_ratio() == pytest.approx(0.9, abs=1e-12) and not r.hits_partial()
    # the first step torn (nothing before it), and h 0.98: queries read 100 low at steps 2 and 4's
    # ends (a review); hits read 200 low at two scrapes in a row, steps 2-4 (780, 980, 1180: steps
    # 4-7 exceed, (4000, 4120), and so do steps 3-7, (5000, 5100); steps 2-7 do not, (6000, 5880)):
    # 0.98 in all
    assert _rollup((800.0, 900.0), (1200.0, 900.0)).hit_ratio() == pytest.approx(0.9, abs=1e-12)
    for steps in (((1000.0, 980.0), (900.0, 980.0), (1100.0, 980.0), (900.0, 980.0), (1100.0, 980.0), (1000.0, 980.0)),
                  ((1000.0, 980.0), (1000.0, 780.0), (1000.0, 980.0), (1000.0, 1180.0)) + ((1000.0, 980.0),) * 3):
        r = _rollup(*steps)
        assert r.hit_ratio() == pytest.approx(0.98, abs=1e-12) and not r.hits_partial(), steps


def test_a_torn_read_leaves_every_minute_s_h_as_it_was():
    # h 0.9 in every minute; hits read 200 low at step 4's end: steps 4 and 5 are (1000, 700) and
    # (1000, 1100). Step 5's group (5, 6) is within, (2000, 2000), and takes step 4 back too: the
    # three go to step 6's minute, (3000, 2700); left in its minute, step 4's 0.7 and the group's
    # 1.0 made the jitter 0.059 over 15 minutes of a true 0, a thrash verdict at KV usage 0.95
    # (review). Minutes 4 and 5 are empty (no h), every other 0.9: the jitter is 0
    r = _rollup(*((1000.0, 900.0),) * 3, (1000.0, 700.0), (1000.0, 1100.0), *((1000.0, 900.0),) * 10)
    assert r.jitter() == pytest.approx(0.0, abs=1e-12) and r.hit_ratio() == pytest.approx(0.9, abs=1e-12)
    assert not r.hits_partial()
    # increases that are no number are unknown, never an h
    r = _rollup((1000.0, 900.0), (math.nan, 900.0), (1000.0, math.inf))
    assert r.hit_ratio() == pytest.approx(0.9) and r.hits_partial()


def test_hits_that_still_exceed_with_their_neighbours_or_lose_them_are_left_out():
    # hits jumped by 5000 and stayed (no torn read): B to E (4000, 8600) exceed, with A too
    # (5000, 9500): the five left out, their minutes partial; F alone is 0.5 (with A: 0.7)
    r = _rollup((1000.0, 900.0), (1000.0, 5900.0), *((1000.0, 900.0),) * 3, (1000.0, 500.0))
    assert r.hit_ratio() == pytest.approx(0.5) and r.hits_partial()
    # a step that exceeds, then a scrape lost: the next starts elsewhere and carries no difference;
    # also with 10-s steps, the next in the same minute (a review: it was not said partial)
    for seconds in (60.0, 10.0):
        r = _rollup((1000.0, 900.0), (700.0, 900.0), (1300.0, 900.0), gap_after=1, seconds=seconds)
        assert r.hit_ratio() == pytest.approx(1800.0 / 2300.0) and r.hits_partial(), seconds
    # a step whose hits are unknown after one that exceeds: both left out
    r = _rollup((1000.0, 900.0), (700.0, 900.0), (1300.0, None))
    assert r.hit_ratio() == pytest.approx(0.9) and r.hits_partial()


def test_rollup_knows_when_the_kv_usage_was_missing_at_a_step():
    r = HitRollup()
    for i, kv in enumerate((0.5, None, 0.6, 1.7)):  # None: no gauge; 1.7: a percent scale, no usage
        r.update(60.0 * i, 60.0 * (i + 1), 1000.0, 900.0, kv_usage=kv)
        # max over the known values; partial from the first step without one on
        assert r.kv_usage_max() == (0.5 if i < 2 else 0.6) and r.kv_usage_partial() == (i >= 1)
    r2 = HitRollup()
    r2.update(0.0, 60.0, 1000.0, 900.0, kv_usage=0.5)
    assert not r2.kv_usage_partial()


def test_speedup_by_hand():
    # 1/(1 − 0.8·0.5) = 1/0.6 = 1.6667
    assert speedup(0.8, 0.5) == pytest.approx(1 / 0.6, rel=1e-12)
    assert speedup(None, 0.5) is None and speedup(1.0, 1.0) is None


def test_rollup_sums_jitter_share_and_kv():
    r = HitRollup()
    # 20 minutes, one 60-s step each; minute i: Δq = 1000, Δhits = 800 (even i) or 1000 (odd i)
    # prefill 0.2 s and decode 0.6 s per request, 10 requests per minute; KV usage 0.5, minute 19: 0.93
    for i in range(20):
        t1 = 60.0 * (i + 1)
        r.update(t1 - 60.0, t1, 1000.0, 800.0 if i % 2 == 0 else 1000.0, (2.0, 10.0), (6.0, 10.0),
                 0.93 if i == 19 else 0.5)
    # history h = (10·800 + 10·1000)/20000 = 0.9
    assert r.hit_ratio() == pytest.approx(0.9)
    # last 15 minutes = minutes 6..20 (step i=5..19): i odd 5,7,…,19 → 8 at 1.0, i even 6..18 → 7 at 0.8
    # h = (8·1000 + 7·800)/15000 = 13600/15000 = 0.906667
    assert r.hit_ratio(15) == pytest.approx(13600 / 15000)
    # per-minute h over those 15: mean 0.906667, σ = sqrt(8/15·(0.093333)² + 7/15·(0.106667)²)
    #   = sqrt(0.0046459 + 0.0053096) = sqrt(0.0099556) = 0.099778
    mean = 13600 / 15000
    sigma = (8 / 15 * (1 - mean) ** 2 + 7 / 15 * (0.8 - mean) ** 2) ** 0.5
    assert r.jitter() == pytest.approx(sigma, rel=1e-12)
    assert r.jitter() == pytest.approx(0.099778, abs=1e-6)
    # prefill share = 0.2/(0.2 + 0.6) = 0.25
    assert r.prefill_share() == pytest.approx(0.25)
    assert r.kv_usage_max() == 0.93
    # covered 0 … 1200 s; far from 24 h
    assert r.span_seconds() == 1200.0 and r.provisional()
    v = verdict(r)
    # recent h 0.907 > 0.85, σ 0.0998 ≥ 0.05, KV 0.93 ≥ 0.90 → thrash risk
    assert v.state == "thrash_risk" and v.provisional


def test_rollup_is_bounded_and_becomes_final_after_24h():
    r = HitRollup(minutes=10)
    for i in range(30):
        r.update(60.0 * i, 60.0 * (i + 1), 100.0, 10.0)
    assert len(r) == 10  # never more than `minutes` buckets
    # minutes 21..30 kept (steps i = 20..29): span from t0 = 1200 to t1 = 1800 → 600 s
    assert r.span_seconds() == 600.0
    assert r.hit_ratio() == pytest.approx(0.1)
    day = HitRollup()
    for i in range(1440):  # 24 h of 60-s steps
        day.update(60.0 * i, 60.0 * (i + 1), 100.0, 10.0)
    assert len(day) == 1440 and day.span_seconds() == 86400.0
    v = verdict(day)
    # h = 0.1 < 0.25 over 24 h: caching does not pay, and the verdict is final
    assert (v.state, v.provisional) == ("not_paying", False)


def test_a_kv_usage_outside_0_1_is_no_usage_never_a_thrash_verdict():
    # a fake Prometheus gave kv_cache_usage_perc 7 and the verdict took kv_usage_max 7.0 (fleet review)
    r = HitRollup()
    for i, kv in enumerate((7.0, 93.0, -0.5, float("nan"), float("inf"))):
        r.update(60.0 * i, 60.0 * i + 60.0, 1000.0, 950.0 if i % 2 else 800.0, kv_usage=kv)
    assert r.kv_usage_max() is None
    r.update(300.0, 360.0, 1000.0, 900.0, kv_usage=0.5)
    assert r.kv_usage_max() == 0.5


def test_an_empty_history_says_it_is_empty_not_without_queries():
    # two scrapes: the publish window has its step, the history not yet (the next scrape confirms
    # it); the verdict said "no prefix-cache queries in the history" beside a published h
    v = verdict(HitRollup())
    assert v.state is None and v.history_seconds == 0
    assert v.reason == "no step in the history yet (a step enters it when the scrape after it confirms it)"


def test_a_history_whose_hits_are_unknown_says_so_not_that_it_had_no_queries():
    # queries counted, hits missing at every step (the hit counter absent): the reason said "no
    # prefix-cache queries in the history" (newcomer helper)
    r = HitRollup()
    for i in range(5):  # KV usage half: no thrash whatever h is, so the verdict turns on the history's h
        r.update(60.0 * i, 60.0 * i + 60.0, 1000.0, None, kv_usage=0.5)
    v = verdict(r)
    assert v.state is None and v.history_hit_ratio is None
    assert v.reason.startswith("no prefix-cache query with known hits in the history"), v.reason
    # no query at all: as before
    r = HitRollup()
    r.update(0.0, 60.0, 0.0, 0.0, kv_usage=0.5)
    assert verdict(r).reason == "no prefix-cache queries in the history (token hit ratio unknown)"
