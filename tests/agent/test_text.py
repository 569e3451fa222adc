"""The one power-of-two formatter that the alert titles, the diagnoses and the dashboard share."""

import math

import pytest

from gradwatch._text import power_of_two
from gradwatch.dashboard.figures import format_scale
from gradwatch.server.alerts.diagnosis_context import _power
from gradwatch.server.alerts.rules.base import _power_of_two


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (65536.0, "2^16"),
        (1, "2^0"),
        (0.125, "2^-3"),
        (2.0**-1074, "2^-1074"),  # the smallest subnormal
        (2.0**1023, "2^1023"),
        (2.0**53 + 2, None),  # log2 of it rounds to 53.0: read from the exponent, it is no power of two
        (3.0, None),
        (0.0, None),
        (-2.0, None),
        (math.inf, None),
        (math.nan, None),
        (True, None),
        ("2", None),
    ],
)
def test_power_of_two_is_exact(value, expected):
    assert power_of_two(value) == expected


def test_every_caller_says_the_same_for_a_power_of_two_and_its_own_thing_otherwise():
    assert _power_of_two(8192.0) == _power(8192.0) == format_scale(8192.0) == "2^13"
    assert _power_of_two(2.0**53 + 2) == _power(2.0**53 + 2) == "9.01e+15"  # was "2^53" (log2 rounds)
    assert format_scale(2.0**53 + 2) == "9.007e+15"
