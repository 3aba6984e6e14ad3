"""How fast a recommender recovers from an interest drift: from a CTR curve per time window,
the CTR before the drift and the time after it until CTR is back to a share of that. Pure.

A curve is a list of windows ``{"from_s", "impressions", "clicks", "ctr"}`` (the closed loop's
``CtrWindows.curve``). The level before the drift is the CTR pooled over the ``before``
windows that end at or before the drift (impressions-weighted, so a thin window weighs
little). Recovery is the end of the first window after the drift whose CTR is at least
``share`` of that level, counted from the drift: the time a user waited until their
recommendations were good again.

>>> curve = [window(0, 100, 20), window(10, 100, 20), window(20, 100, 6), window(30, 100, 17)]
>>> level_before(curve, drift_s=20, span_s=10)
0.2
>>> recovery_s(curve, drift_s=20, span_s=10)
20.0
>>> recovery_s(curve[:3], drift_s=20, span_s=10) is None   # never back to 80% of 20%
True
"""

from __future__ import annotations

from dataclasses import dataclass


def window(from_s: float, impressions: int, clicks: int) -> dict:
    """One window of a curve (for tests and docs)."""
    return {
        "from_s": float(from_s),
        "impressions": impressions,
        "clicks": clicks,
        "ctr": round(clicks / impressions, 4) if impressions else None,
    }


def level_before(curve: list[dict], drift_s: float, span_s: float, before: int = 3) -> float | None:
    """CTR pooled over the last ``before`` windows that end by ``drift_s``; None without
    impressions there."""
    windows = [c for c in curve if c["from_s"] + span_s <= drift_s + 1e-9][-before:]
    imps = sum(c["impressions"] for c in windows)
    return sum(c["clicks"] for c in windows) / imps if imps else None


def recovery_s(
    curve: list[dict], drift_s: float, span_s: float, share: float = 0.8, before: int = 3
) -> float | None:
    """Seconds from ``drift_s`` to the end of the first window starting at or after it whose
    CTR reaches ``share`` × the level before; None when no window does (or there is no level
    to reach)."""
    if not 0 < share <= 1:
        raise ValueError("share must be in (0, 1]")
    level = level_before(curve, drift_s, span_s, before)
    if level is None:
        return None
    for c in curve:
        if c["from_s"] >= drift_s - 1e-9 and c["ctr"] is not None and c["ctr"] >= share * level:
            return round(c["from_s"] + span_s - drift_s, 3)
    return None


@dataclass(frozen=True)
class Recovery:
    """Two arms through the same drift: how much sooner the learner recovered."""

    learner_s: float | None
    reference_s: float | None

    @property
    def speedup(self) -> float | None:
        """reference / learner; infinite when only the learner recovered; None when the
        learner did not.

        >>> Recovery(10.0, 40.0).speedup, Recovery(10.0, None).speedup, Recovery(None, 5.0).speedup
        (4.0, inf, None)
        """
        if self.learner_s is None:
            return None
        if self.reference_s is None:
            return float("inf")
        return self.reference_s / self.learner_s
