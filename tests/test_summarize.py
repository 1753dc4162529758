"""tools/summarize.py's interval arithmetic: the retention tables' 95 % intervals and seed counts."""

import math
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

import summarize  # noqa: E402


def test_mean_interval_is_students_t():
    mean, half = summarize.mean_interval([1, 2, 3, 4, 5])
    assert mean == 3
    assert half == pytest.approx(2.776 * math.sqrt(2.5) / math.sqrt(5), rel=1e-6)
    assert summarize.mean_interval([0.7]) == (0.7, 0.0)


def test_t95_takes_the_nearest_lower_entry_and_the_normal_far_out():
    assert summarize.t95(4) == 2.776
    assert summarize.t95(22) == summarize.T95[20]  # conservative: the larger t of fewer degrees
    assert summarize.t95(500) == 1.96


def test_ratio_interval_is_exact_when_jagg_is_a_fixed_share_of_exact():
    gains = [(0.1, 0.09), (0.3, 0.27), (0.2, 0.18)]
    ratio, half, sd = summarize.ratio_interval(gains)
    assert ratio == pytest.approx(0.9)
    assert half == pytest.approx(0.0, abs=1e-12) and sd == pytest.approx(0.0, abs=1e-12)


def test_ratio_interval_covers_the_true_ratio_95_percent_of_the_time():
    """Simulated tables of 10 seeds, exact's and JAGG's gains independent with JAGG's mean 0.9 of
    exact's: the interval holds 0.9 in 93-97 % of 2000 tables."""
    rng = random.Random(0)
    hits = 0
    for _ in range(2000):
        gains = [(rng.gauss(0.2, 0.04), rng.gauss(0.18, 0.04)) for _ in range(10)]
        ratio, half, _ = summarize.ratio_interval(gains)
        hits += abs(ratio - 0.9) <= half
    assert 0.93 <= hits / 2000 <= 0.97


@pytest.mark.parametrize("sd", [0.05, 0.2, 0.47])
def test_seeds_for_is_the_fewest_seeds_that_reach_the_half_width(sd):
    n = int(summarize.seeds_for(sd, 0.10))
    assert summarize.t95(n - 1) * sd / math.sqrt(n) <= 0.10
    assert summarize.t95(n - 2) * sd / math.sqrt(n - 1) > 0.10
    assert summarize.seeds_for(0.0, 0.10) == "-"
