"""The live-vLLM harness's own arithmetic (tests/e2e/live_harness.py), checked by hand: it decides how
many windows the live e2e expects, so a wrong sum there fails or passes that test for no reason."""
from __future__ import annotations

import pytest

from live_harness import paused_within


@pytest.mark.parametrize(("spans", "t0", "t1", "covered"), [
    ([(0, 1), (2, 4)], 0, 10, 3),  # disjoint: 1 + 2
    ([(0, 3), (2, 5)], 0, 10, 5),  # overlapping: [0, 5] once, not 3 + 3
    ([(0, 10), (2, 3)], 0, 20, 10),  # nested: the inner span adds nothing
    ([(0, 10), (2, 3), (9, 12)], 0, 20, 12),  # nested, then one overlapping the outer's end: [0, 12]
    ([(8, 15), (-5, 2)], 0, 10, 4),  # clipped at both ends ([0, 2] and [8, 10]), given out of order
    ([(11, 12), (-3, -1)], 0, 10, 0),  # wholly outside
])
def test_paused_within_counts_each_second_once_inside_the_span(spans, t0, t1, covered):
    assert paused_within(spans, t0, t1) == covered
