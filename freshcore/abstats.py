"""A/B statistics at the level of the randomised unit, the user. Pure.

Users, not impressions, are assigned to variants: one user's impressions share that user's
taste and moment, so counting them as independent draws makes intervals too narrow (a user
who makes 5% of the requests moves a variant's CTR alone). The workers and the streams app
therefore count per *analysis bucket*: each user falls in one of ``ANALYSIS_BUCKETS`` buckets
by a hash independent of the variant assignment, so within a variant the buckets are
independent, identically distributed clusters of users. A rate's interval is the ratio
estimator's cluster-robust (delta-method) interval over those buckets — what a
bootstrap over users gives with far fewer counters — and a variant is compared with the
control on the relative difference of the rates (log ratio, delta method):

- **superiority**: the 95% interval of (variant / control − 1) above zero;
- **non-inferiority** with a declared margin δ (default 3%): its lower end above −δ.

>>> c = ratio([10, 12, 9, 11], [100, 100, 100, 100])
>>> round(c.value, 3), round(c.se, 5)
(0.105, 0.00645)
>>> v = ratio([12, 13, 12, 14], [100, 100, 100, 100])
>>> g = compare(v, c, cost=1.0, control_cost=1.0, min_buckets=4)
>>> g.verdict, round(g.relative, 3)
('better', 0.214)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from schemas.hashing import salted_bucket

Z95 = 1.959963984540054
ANALYSIS_BUCKETS = 64
"""Clusters of users per variant the counts are kept in (``bucket_of``): enough for a variance
estimate with 63 degrees of freedom, few enough that a variant's counts are a few hundred
Redis hash fields."""
NON_INFERIORITY_MARGIN = 0.03
"""The relative CTR a variant may lose and still be "not worse" (seed B's 3%)."""
MIN_SAVING = 0.05
"""A variant is cheaper when it costs at least this share less per request than the control:
measured serving time moves by a few percent between identical runs."""
MIN_BUCKETS = 32
"""Fewer buckets with impressions than this on either side: not enough data for a verdict."""

VERDICTS = ("better", "not worse and cheaper", "not worse, not cheaper", "worse", "not enough data")


def bucket_of(user_id: str) -> int:
    """The user's analysis bucket: the same in every worker and streams process, and
    independent of the variant assignment (another key than any experiment's salt).

    >>> bucket_of("u1") == bucket_of("u1"), 0 <= bucket_of("u2") < ANALYSIS_BUCKETS
    (True, True)
    """
    return salted_bucket("freshrec-analysis", user_id, ANALYSIS_BUCKETS)


@dataclass(frozen=True)
class Ratio:
    value: float
    """Σ successes / Σ trials (NaN without trials)."""
    se: float
    """The cluster-robust standard error over the buckets (NaN when it cannot be had)."""
    buckets: int
    """Buckets with trials."""

    def interval(self, z: float = Z95) -> tuple[float, float]:
        if math.isnan(self.se):
            return math.nan, math.nan
        return max(0.0, self.value - z * self.se), self.value + z * self.se


def ratio(successes: Sequence[float], trials: Sequence[float]) -> Ratio:
    """The ratio Σx/Σn of per-bucket counts and its standard error: the linearised variance
    of the ratio estimator over B clusters, B/(B−1) · Σ(x_b − R n_b)² / (Σn)². Counts that are
    not proportions (more successes than trials overall) give NaNs.

    >>> r = ratio([1, 3], [10, 10])   # R = 0.2, residuals -1 and +1
    >>> round(r.se, 4)                # √(2/1 · 2) / 20
    0.1
    """
    if len(successes) != len(trials):
        raise ValueError("successes and trials must have one count per bucket")
    x, n = float(sum(successes)), float(sum(trials))
    used = sum(1 for t in trials if t > 0)
    if n <= 0 or not 0 <= x <= n:
        return Ratio(math.nan, math.nan, used)
    r = x / n
    b = len(trials)
    if b < 2:
        return Ratio(r, math.nan, used)
    ss = sum((xi - r * ni) ** 2 for xi, ni in zip(successes, trials, strict=True))
    return Ratio(r, math.sqrt(b / (b - 1) * ss) / n, used)


@dataclass(frozen=True)
class Guard:
    diff: float
    """The variant's rate minus the control's."""
    diff_ci: tuple[float, float]
    relative: float
    """variant / control − 1."""
    relative_ci: tuple[float, float]
    non_inferior: bool | None
    """The relative interval's lower end above −margin (None: no interval)."""
    cheaper: bool | None
    """At least ``MIN_SAVING`` less serving time per request (None: a cost is missing)."""
    verdict: str


def compare(
    variant: Ratio,
    control: Ratio,
    cost: float | None,
    control_cost: float | None,
    margin: float = NON_INFERIORITY_MARGIN,
    min_saving: float = MIN_SAVING,
    min_buckets: int = MIN_BUCKETS,
    z: float = Z95,
) -> Guard:
    """The variant against the control: the difference and the relative difference with
    95% intervals (independent groups of users), and the verdict —

    - ``better``: the relative interval above 0;
    - ``not worse and cheaper``: its lower end above −margin and cheaper by ``min_saving``;
    - ``worse``: the interval below 0, unless within the margin and cheaper;
    - ``not worse, not cheaper``: within the margin, no saving;
    - ``not enough data``: none of those is shown, or either side has impressions in fewer
      than ``min_buckets`` buckets.

    >>> c = ratio([10] * 40, [100] * 40)
    >>> compare(ratio([10] * 40, [100] * 40), c, cost=0.5, control_cost=1.0).verdict
    'not worse and cheaper'
    >>> compare(ratio([10] * 8, [100] * 8), c, cost=0.5, control_cost=1.0).verdict
    'not enough data'
    """
    cheaper = None
    if cost is not None and control_cost is not None and control_cost > 0:
        cheaper = cost <= control_cost * (1 - min_saving)
    nan2 = (math.nan, math.nan)
    if not (variant.value > 0 and control.value > 0) or math.isnan(variant.se + control.se):
        diff = variant.value - control.value
        return Guard(diff, nan2, math.nan, nan2, None, cheaper, "not enough data")
    diff = variant.value - control.value
    half = z * math.hypot(variant.se, control.se)
    log_ratio = math.log(variant.value / control.value)
    log_se = math.hypot(variant.se / variant.value, control.se / control.value)
    rel_ci = (math.expm1(log_ratio - z * log_se), math.expm1(log_ratio + z * log_se))
    non_inferior = rel_ci[0] > -margin
    if min(variant.buckets, control.buckets) < min_buckets:
        verdict = "not enough data"
    elif rel_ci[0] > 0:
        verdict = "better"
    elif non_inferior and cheaper:
        verdict = "not worse and cheaper"
    elif rel_ci[1] < 0:
        verdict = "worse"
    elif non_inferior:
        verdict = "not worse, not cheaper"
    else:
        verdict = "not enough data"
    return Guard(
        diff,
        (diff - half, diff + half),
        math.expm1(log_ratio),
        rel_ci,
        non_inferior,
        cheaper,
        verdict,
    )
