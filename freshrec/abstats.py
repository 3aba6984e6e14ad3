"""Rates with confidence intervals and the two-proportion test of a variant against its
control, for experiment reports. Pure.

CTR is clicks over impressions, CVR conversions over clicks. The interval is Wilson's score
interval (it stays inside [0, 1] and behaves with few events, where the normal one does
not); the test is the two-sided pooled z-test of two proportions.

>>> lo, hi = wilson(30, 100)
>>> round(lo, 4), round(hi, 4)
(0.2189, 0.3958)
>>> t = two_proportions(60, 400, 40, 400)
>>> round(t.diff, 3), round(t.z, 3), round(t.p, 4)
(0.05, 2.138, 0.0325)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Z95 = 1.959963984540054


def wilson(successes: float, trials: float, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of ``successes`` in ``trials`` (NaNs without trials, or where
    the counts are not a proportion: more successes than trials, or fewer than none — counts
    any client can produce, since attribution counts whatever events name a reply).

    >>> wilson(5, 3)
    (nan, nan)
    """
    if trials <= 0 or not 0 <= successes <= trials:
        return math.nan, math.nan
    p = successes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class Test:
    diff: float
    """The variant's rate minus the control's."""
    z: float
    p: float
    """Two-sided p-value (NaN when either side has no trials or the pooled rate is 0 or 1)."""


def two_proportions(x1: float, n1: float, x0: float, n0: float) -> Test:
    """Pooled two-proportion z-test of x1/n1 (a variant) against x0/n0 (the control); NaNs
    where either side is not a proportion (no trials, or successes outside [0, trials])."""
    if n1 <= 0 or n0 <= 0 or not (0 <= x1 <= n1 and 0 <= x0 <= n0):
        return Test(math.nan, math.nan, math.nan)
    p1, p0 = x1 / n1, x0 / n0
    pooled = (x1 + x0) / (n1 + n0)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n1 + 1 / n0))
    if se == 0:
        return Test(p1 - p0, math.nan, math.nan)
    z = (p1 - p0) / se
    return Test(p1 - p0, z, math.erfc(abs(z) / math.sqrt(2)))
