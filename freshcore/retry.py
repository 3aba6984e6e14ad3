"""Delivery retry, written once: a policy (attempts, back-off) and a queue of what waits for
its next attempt. Pure: time is passed in.

A producer's delivery callback runs inside ``poll``; it must not produce again from there.
So a failed delivery that may pass on its own (``freshcore.kafka.delivery_retriable``) goes
into a ``RetryQueue``, and the service's loop produces what is ``due``. The policy says how
many attempts a message gets (``None``: until it is delivered or taken back) and how long it
waits before each next one.

>>> q = RetryQueue(RetryPolicy(attempts=3, first_wait_s=1.0))
>>> q.add("reply", attempt=1, now=0.0), q.add("reply", attempt=3, now=0.0)
(True, False)
>>> q.due(0.5), q.due(1.0)
([], [('reply', 2)])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int | None = 3
    """Attempts in all, the first included (None: no limit)."""
    first_wait_s: float = 0.0
    """Wait before the second attempt; each later one waits twice the one before."""
    max_wait_s: float = 30.0

    def may_retry(self, attempt: int) -> bool:
        """Whether a message whose ``attempt``-th delivery failed gets another."""
        return self.attempts is None or attempt < self.attempts

    def wait_s(self, attempt: int) -> float:
        """The wait after the ``attempt``-th failed delivery.

        >>> [RetryPolicy(None, 2.0).wait_s(a) for a in (1, 2, 3, 6)]
        [2.0, 4.0, 8.0, 30.0]
        """
        return min(self.max_wait_s, self.first_wait_s * 2.0 ** (attempt - 1))


class RetryQueue(Generic[T]):
    """Messages whose delivery failed, each with its next attempt's number and time."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self._waiting: list[tuple[float, T, int]] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, item: T, attempt: int, now: float) -> bool:
        """The ``attempt``-th delivery of ``item`` failed: queued for the next, unless the
        policy's attempts are spent (False: the caller reports it undeliverable)."""
        if not self.policy.may_retry(attempt):
            return False
        self._waiting.append((now + self.policy.wait_s(attempt), item, attempt + 1))
        return True

    def due(self, now: float) -> list[tuple[T, int]]:
        """What is due by ``now`` (with the number of the attempt to make), taken out."""
        if not self._waiting:
            return []
        due = [(item, attempt) for at, item, attempt in self._waiting if at <= now]
        if due:
            self._waiting = [w for w in self._waiting if w[0] > now]
        return due

    def drain(self) -> list[tuple[T, int]]:
        """Everything waiting, taken out (a revoke takes the messages back)."""
        out = [(item, attempt) for _, item, attempt in self._waiting]
        self._waiting = []
        return out
