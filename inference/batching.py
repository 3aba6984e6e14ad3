"""The dynamic-batching decision: flush when ``max_batch`` requests wait, or when the oldest
has waited ``max_wait_ms``; requests past their deadline are dropped before any work; and how
many backlogged events to learn between two looks at the request queue. Pure.

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
    max_wait_ms: int = 0

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


@dataclass
class EventSlicer:
    """How many backlogged events to learn before looking at the request queue again: as
    many as fit in ``budget_ms`` at the cost per event seen so far (a moving average), between
    ``least`` and ``most``. A request that arrives while a slice is learnt waits for it, so
    the budget bounds that wait; within it, larger slices spread each slice's fixed costs
    (a Redis round trip for cold rows, the gradient message, numpy calls) over more events.
    A fixed count could not do both: 256 events took ~4 ms on a fast hour of the development
    machine and ~12 ms on a slow one, and slices of 1,000-2,000 events doubled the event
    path's throughput (docs/serving.md, "Requests before events").

    While no request has arrived for ``quiet_s`` (a worker catching up a backlog, or one
    whose requests go elsewhere), slices get ``idle_budget_ms``: only the first request after
    the quiet waits behind one.

    >>> s = EventSlicer(budget_ms=10, idle_budget_ms=40, least=64, most=8192, start=256)
    >>> s.size(now=0.0)
    256
    >>> s.observe(250, 0.0025)  # 10 µs an event: 4,000 fit in 40 ms
    >>> s.size(now=0.0)
    4000
    >>> s.request_seen(now=5.0)  # requests are flowing: 1,000 fit in 10 ms
    >>> s.size(now=5.5), s.size(now=6.5)
    (1000, 4000)
    """

    budget_ms: float = 10.0
    idle_budget_ms: float = 40.0
    least: int = 64
    most: int = 16384
    start: int = 256
    quiet_s: float = 1.0
    alpha: float = 0.3
    per_event_ms: float | None = None
    last_request_s: float = float("-inf")

    def __post_init__(self) -> None:
        if self.budget_ms <= 0 or self.idle_budget_ms <= 0:
            raise ValueError("budget_ms and idle_budget_ms must be > 0")
        if not 1 <= self.least <= self.start <= self.most:
            raise ValueError("1 <= least <= start <= most")

    def request_seen(self, now: float) -> None:
        """A request arrived at ``now`` (monotonic seconds)."""
        self.last_request_s = now

    def size(self, now: float) -> int:
        """The next slice's events, at ``now`` (monotonic seconds)."""
        if self.per_event_ms is None:
            return self.start
        quiet = now - self.last_request_s > self.quiet_s
        budget = self.idle_budget_ms if quiet else self.budget_ms
        return int(min(self.most, max(self.least, budget / self.per_event_ms)))

    def observe(self, events: int, seconds: float) -> None:
        """A slice of ``events`` took ``seconds`` (a failed or empty one is not observed)."""
        if events <= 0 or seconds <= 0:
            return
        cost = seconds * 1000 / events
        old = self.per_event_ms
        self.per_event_ms = cost if old is None else (1 - self.alpha) * old + self.alpha * cost


@dataclass
class PrefetchPurge:
    """When to pause the event partitions so that a request behind a backlog of events is
    read. The worker consumes only what its next slice will learn, so its own backlog stays
    under the pause mark while the events wait in the Kafka client's prefetched queue: a
    request fetched after them is read only once all of them are learnt (sent while a worker
    worked off 60,000 queued events, one was read when all of them were learnt; with this, at
    the first pause, ``tests/test_serving_e2e.py``). While consumes come back full (the
    client's queue held at least what was asked: events wait there, a backlog or traffic
    faster than the worker, not live traffic it keeps up with), every ``every_s`` the worker
    pauses its event partitions, which drops their prefetched events and leaves the next
    fetch to the request partitions, and resumes them after ``hold_s`` at least (resumed in
    the next loop round, a few milliseconds on, they were fetched again before the request
    partition had a fetch of its own) once its own backlog is worked down; the client
    fetches again from the next unread offset. The dropped events are fetched again, which
    costs the catch-up rate (on the embedded broker, pauses every 1 s took 10-18% off it,
    every 200 ms about half: docs/serving.md). A consume that is not full ends the run,
    unless it comes within ``refill_s`` of a resume: the queue the pause emptied is filling
    again (ended there, a loaded machine paused every 250 ms instead of every 100). Called
    only while the partitions are not paused. ``every_s`` 0: never.

    >>> p = PrefetchPurge(every_s=1.0, hold_s=0.02)
    >>> p.due(True, now=0.0), p.due(True, now=0.5), p.due(True, now=1.05)
    (False, False, True)
    >>> p.may_resume(now=1.06), p.may_resume(now=1.08)
    (False, True)
    >>> p.resumed(now=1.3)
    >>> p.due(False, now=1.4), p.due(True, now=2.1)  # refilling after the resume: still behind
    (False, True)
    >>> p.resumed(now=2.2)
    >>> p.due(False, now=2.5), p.due(True, now=2.6), p.due(True, now=3.2)  # drained: a new run
    (False, False, False)
    """

    every_s: float = 1.0
    hold_s: float = 0.02
    refill_s: float = 0.25
    since: float | None = None
    paused_at: float = float("-inf")
    resumed_at: float = float("-inf")

    def may_resume(self, now: float) -> bool:
        """Whether a pause this made has lasted ``hold_s`` (any other pause: always)."""
        return now - self.paused_at >= self.hold_s

    def resumed(self, now: float) -> None:
        """The event partitions were resumed at ``now`` (monotonic seconds)."""
        self.resumed_at = now

    def due(self, full: bool, now: float) -> bool:
        """Whether to pause the event partitions now, after a consume that came back
        ``full`` (or not) at ``now`` (monotonic seconds)."""
        if self.every_s <= 0:
            return False
        if not full:
            if now - self.resumed_at > self.refill_s:
                self.since = None
            return False
        if self.since is None:
            self.since = now
            return False
        if now - self.since < self.every_s:
            return False
        self.since = self.paused_at = now
        return True
