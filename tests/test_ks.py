"""The exact two-sample KS test used by the timing audits, against values worked by hand."""

from __future__ import annotations

import random
from math import comb

import pytest

from tests.ks import ks_two_sample


def test_samples_entirely_apart_have_d_1_and_the_smallest_p() -> None:
    d, p = ks_two_sample([1, 2, 3], [4, 5, 6])
    assert d == 1.0 and p == pytest.approx(2 / comb(6, 3))
    d, p = ks_two_sample(list(range(20)), list(range(100, 120)))
    assert d == 1.0 and p == pytest.approx(2 / comb(40, 20)) and p < 1e-6


def test_interleaved_samples_are_not_told_apart() -> None:
    d, p = ks_two_sample([1, 3, 5], [2, 4, 6])
    assert d == pytest.approx(1 / 3) and p == 1.0


def test_one_step_apart_matches_the_hand_count() -> None:
    # x = 1, 2, 4; y = 3, 5, 6: D = 2/3. Of the 20 orders, the 8 that never lead by two (each
    # pair of draws one x and one y) stay inside: p = 12/20.
    d, p = ks_two_sample([1, 2, 4], [3, 5, 6])
    assert d == pytest.approx(2 / 3) and p == pytest.approx(12 / 20)


def test_samples_from_one_distribution_rarely_reject() -> None:
    rng = random.Random(3)
    p_values = [ks_two_sample([rng.random() for _ in range(20)],
                              [rng.random() for _ in range(20)])[1] for _ in range(200)]
    assert sum(p < 0.05 for p in p_values) <= 20  # about 5 % expected
