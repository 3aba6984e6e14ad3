"""How many events are due at a steady rate: a pacing rule. Pure.

>>> p = Pacer(rate_per_s=100.0, start_s=10.0)
>>> p.due(10.5), p.due(12.0)
(50, 200)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pacer:
    """Events due by time ``now_s`` at ``rate_per_s`` since ``start_s``; never bursts to catch up
    more than ``max_backlog_s`` of rate, so a stall does not turn into a flood."""

    rate_per_s: float
    start_s: float
    max_backlog_s: float = 1.0

    def __post_init__(self) -> None:
        if self.rate_per_s <= 0:
            raise ValueError(f"rate must be positive, got {self.rate_per_s}")

    def due(self, now_s: float) -> int:
        return int(max(now_s - self.start_s, 0.0) * self.rate_per_s)

    def to_send(self, now_s: float, sent: int) -> int:
        """How many to send now, capped at ``max_backlog_s`` worth of events."""
        return max(0, min(self.due(now_s) - sent, int(self.rate_per_s * self.max_backlog_s) + 1))
