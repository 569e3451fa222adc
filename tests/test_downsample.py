import math

import pytest

from gradwatch.server.downsample import min_max_indices


def test_short_series_is_returned_whole():
    assert min_max_indices([3.0, 1.0, 2.0], 10) == [0, 1, 2]


def test_keeps_every_bucket_extreme_and_the_single_spike():
    values = [0.0] * 100_000
    values[77_777] = 1e6
    values[12_345] = -5.0
    kept = min_max_indices(values, 200)
    assert len(kept) <= 200
    assert 77_777 in kept and 12_345 in kept
    assert kept == sorted(kept)


def test_non_finite_points_survive():
    values = [float(i) for i in range(10_000)]
    values[5_000] = math.nan
    values[9_000] = math.inf
    kept = min_max_indices(values, 100)
    assert 5_000 in kept and 9_000 in kept


def test_rejects_too_small_budget():
    with pytest.raises(ValueError, match="max_points must be at least 2"):
        min_max_indices([1.0, 2.0, 3.0], 1)
