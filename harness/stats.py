"""Figures over samples, the one definition every test, demo and benchmark uses.

A leaf with no dependency beyond the standard library.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The nearest-rank percentile: the smallest value with at least ``q`` of the values at or
    below it, that is the ``ceil(q * n)``-th smallest of ``n`` (the first for ``q`` = 0);
    ``q`` in 0..1, NaN for no values. Always one of the values, never an interpolation.
    ``q * n`` is rounded to 9 decimals before its ceiling, so that a product that is a whole
    number on paper stays one in floating point (``0.07 * 100`` is ``7.000000000000001``).

    >>> percentile([15, 20, 35, 40, 50], 0.4)  # ceil(0.4 x 5) = the 2nd smallest
    20
    >>> percentile([15, 20, 35, 40, 50], 0.5)  # ceil(2.5) = the 3rd
    35
    >>> percentile(range(1, 101), 0.99)  # of 100 values, p99 is the 99th, not the largest
    99
    >>> percentile(range(1, 101), 0.07)  # the 7th, though 0.07 * 100 > 7 in floating point
    7
    >>> percentile([3.0, 1.0, 2.0], 0.0), percentile([3.0, 1.0, 2.0], 1.0)
    (1.0, 3.0)
    >>> percentile([], 0.5)
    nan
    """
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = max(1, math.ceil(round(q * len(ordered), 9)))
    return ordered[min(rank, len(ordered)) - 1]


def median(values: Iterable[float]) -> float:
    """The median of the values that are not NaN; NaN when none is.

    >>> median([3.0, float("nan"), 1.0, 2.0])
    2.0
    """
    data = [v for v in values if not math.isnan(v)]
    return statistics.median(data) if data else math.nan
