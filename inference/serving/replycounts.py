"""What a serving batch's replies are counted by: replies per tier and mode, each stage's
latency, degradations, and once a batch (each ``labels`` takes a lock and builds a key) the
serving cost and the items listed, new ones apart.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from freshcore import metrics as m
from inference.serving.degrade import FULL, reason_label


@dataclass
class ReplyCounts:
    """One batch's replies, counted as they are made (``reply``) and summed once
    (``close``)."""

    mode: str
    """The serving mode the batch was served in."""
    new_names: frozenset[str]
    """The catalogue's new items (``freshrec_reply_items_total{new}``)."""
    cost_ms: float = 0.0
    listed: int = 0
    fresh: int = 0

    def reply(
        self,
        tier: str,
        reason: str,
        degraded: list[str],
        items: list,
        timings: dict[str, float],
    ) -> None:
        """A reply of ``tier`` listing ``items`` (item, score, channels), with its
        ``timings`` (ms) and the batch's ``degraded`` notes."""
        m.REPLIES.labels(tier, self.mode).inc()
        self.cost_ms += timings["cost"]
        self.listed += len(items)
        self.fresh += sum(1 for i in items if i[0] in self.new_names)
        for stage, value in timings.items():
            _stage_histogram(stage, tier, self.mode).observe(value / 1000)
        if tier != FULL or degraded:
            m.DEGRADED.labels(tier, reason_label(reason, degraded)).inc()

    def close(self) -> None:
        """The batch's serving cost and listed items, counted once."""
        m.SERVING_COST.labels(self.mode).inc(self.cost_ms / 1000)
        m.REPLY_ITEMS.labels("true").inc(self.fresh)
        m.REPLY_ITEMS.labels("false").inc(self.listed - self.fresh)


@functools.cache
def _stage_histogram(stage: str, tier: str, mode: str):
    """The labelled child, looked up once (``labels`` takes a lock and builds a key each
    call: five stages a request)."""
    return m.REQUEST_SECONDS.labels(stage, tier, mode)
