"""Service-level objectives and alert thresholds: one definition that the Prometheus rules
(``tools/prometheus_rules.py``), the built-in dashboard and ``freshrec top`` all read. Pure.

Freshness is the promise: 99% of events reach the rows a worker serves from (``served``)
within ``served_s``. The error budget is the 1% allowed to be slower; the burn rate is how
fast it is being spent: the share of events slower than the objective over that 1% (1.0
spends exactly the budget; 14.4 spends a 30-day budget in two days).

>>> slo = SloSettings()
>>> slo.served_s, slo.target
(1.0, 0.99)
>>> round(burn_rate(0.05, slo.target), 6)   # 5% of events late against a 1% budget
5.0
>>> SloSettings.from_env({"FRESHREC_SLO_SERVED_S": "2"}).served_s
2.0
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from freshcore.declare import SettingsError, declared, read_settings

# The lag histograms' bucket bounds an objective may sit on (``freshcore.metrics``): a share
# of observations above a bound is exact only at a bound.
LAG_BOUNDS_S = (0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class SloSettings:
    """Defaults from the measured figures (``docs/benchmarks.md``, 2026-12-01): served p99
    0.30 s at 5,000 events/s and 0.39 s in ``make run``; request p99 42 ms in ``make run``."""

    target: float = declared(
        "FRESHREC_SLO_TARGET",
        0.99,
        "Share of events (and of requests) that must meet their objective.",
        minimum=0,
    )
    served_s: float = declared(
        "FRESHREC_SLO_SERVED_S",
        1.0,
        "Event time → a broadcast row including it installed in a worker (p99 ~0.3–0.4 s).",
        minimum=0,
    )
    reply_s: float = declared(
        "FRESHREC_SLO_REPLY_S",
        30.0,
        "Event time → the first reply that used a row including it; includes the time until the user asks again, so it is as long as users' pauses.",
        minimum=0,
    )
    request_s: float = declared(
        "FRESHREC_SLO_REQUEST_S",
        0.5,
        "A request's total time in the worker (p99 42 ms in `make run`).",
        minimum=0,
    )
    timeout_share: float = declared(
        "FRESHREC_SLO_TIMEOUT_SHARE",
        0.01,
        "Requests that expired unanswered, as a share of those read, that alerts.",
        minimum=0,
    )
    degraded_share: float = declared(
        "FRESHREC_SLO_DEGRADED_SHARE",
        0.05,
        "Replies below the full tier or degraded, as a share of all, that alerts.",
        minimum=0,
    )
    dead_letters_per_s: float = declared(
        "FRESHREC_SLO_DEAD_LETTERS_PER_S",
        1.0,
        "Dead letters per second (all reasons) that alert.",
        minimum=0,
    )
    consumer_lag_messages: float = declared(
        "FRESHREC_SLO_CONSUMER_LAG_MESSAGES",
        100_000.0,
        "Messages behind a partition end, and growing, that alert.",
        minimum=0,
    )
    behind_s: float = declared(
        "FRESHREC_SLO_BEHIND_S",
        30.0,
        "Seconds of event time the parameter server's rows may trail the workers' learning.",
        minimum=0,
    )
    breaker_open_s: float = declared(
        "FRESHREC_SLO_BREAKER_OPEN_S",
        120.0,
        "How long a recall channel's breaker may stay open before it alerts.",
        minimum=0,
    )
    behind_warn_s: float = declared(
        "FRESHREC_SLO_BEHIND_WARN_S",
        10.0,
        "Seconds of event time behind that open a ticket before `behind_s` pages: seed A names a parameter server more than 10 s behind as the risk of asynchronous updates.",
        minimum=0,
    )
    tier_full_s: float = declared(
        "FRESHREC_SLO_TIER_FULL_S",
        0.3,
        "p99 of a request served by the full tier (seed B's daily traffic: P99 ≤ 300 ms).",
        minimum=0,
    )
    tier_cached_s: float = declared(
        "FRESHREC_SLO_TIER_CACHED_S",
        0.05,
        "p99 of a request served from the cache (seed B: under 50 ms).",
        minimum=0,
    )
    tier_light_s: float = declared(
        "FRESHREC_SLO_TIER_LIGHT_S",
        0.2,
        "p99 of a request served by the light model (seed B: under 200 ms).",
        minimum=0,
    )
    tier_hot_s: float = declared(
        "FRESHREC_SLO_TIER_HOT_S",
        0.01,
        "p99 of a request served from the hot list (seed B: under 10 ms).",
        minimum=0,
    )

    def tier_objectives(self) -> dict[str, float]:
        """Each serving tier's p99 objective, seconds."""
        return {
            "full": self.tier_full_s,
            "cached": self.tier_cached_s,
            "light": self.tier_light_s,
            "hot": self.tier_hot_s,
        }

    def __post_init__(self) -> None:
        if not 0 < self.target < 1:
            raise SettingsError("FRESHREC_SLO_TARGET must be in (0, 1)")
        for name in ("served_s", "reply_s"):
            if getattr(self, name) not in LAG_BOUNDS_S:
                raise SettingsError(
                    f"FRESHREC_SLO_{name.upper()} must be a lag histogram bound: {LAG_BOUNDS_S}"
                )

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SloSettings:
        """``FRESHREC_SLO_<FIELD>`` for each field, e.g. ``FRESHREC_SLO_SERVED_S``."""
        return read_settings(cls, env)


def burn_rate(late_share: float, target: float) -> float:
    """How many times faster than allowed the error budget is being spent."""
    return late_share / (1.0 - target)
