"""The dynamic-batching decision: flush when ``max_batch`` requests wait, or when the oldest
has waited ``max_wait_ms``; requests past their deadline are dropped before any work. Pure.

>>> p = BatchPolicy(max_batch=4, max_wait_ms=10)
>>> p.decide(queued=2, oldest_enqueued_ms=100, now_ms=105)
Decision(flush=False, wait_ms=5)
>>> p.decide(queued=2, oldest_enqueued_ms=100, now_ms=110)
Decision(flush=True, wait_ms=0)
>>> p.decide(queued=4, oldest_enqueued_ms=100, now_ms=101).flush
True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Decision:
    flush: bool
    wait_ms: int
    """How long the loop may wait for more requests before asking again."""


@dataclass(frozen=True)
class BatchPolicy:
    max_batch: int = 32
    max_wait_ms: int = 5

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_wait_ms < 0:
            raise ValueError("max_batch must be >= 1 and max_wait_ms >= 0")

    def decide(self, queued: int, oldest_enqueued_ms: int | None, now_ms: int) -> Decision:
        if queued == 0 or oldest_enqueued_ms is None:
            return Decision(False, self.max_wait_ms)
        if queued >= self.max_batch:
            return Decision(True, 0)
        waited = now_ms - oldest_enqueued_ms
        if waited >= self.max_wait_ms:
            return Decision(True, 0)
        return Decision(False, self.max_wait_ms - waited)


def split_expired(
    items: Sequence[T], deadline_of: Callable[[T], int | None], now_ms: int
) -> tuple[list[T], list[T]]:
    """(live, expired): an item whose deadline has passed is not worked on."""
    live, expired = [], []
    for item in items:
        d = deadline_of(item)
        (expired if d is not None and d <= now_ms else live).append(item)
    return live, expired
