"""Waiting out a Redis outage: one rule for every service.

A service whose input waits safely in Kafka (nothing is committed past the work that needs
Redis) does not exit when Redis stops answering: it runs the operation again every
``wait_s`` until Redis takes it, says so once when it starts waiting and once when Redis is
back, and lets the caller keep its group membership alive meanwhile (``while_waiting``). The
operations are idempotent (a snapshot written again, a read), so running one twice is safe.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis

from freshcore import metrics as m
from schemas.errors import FreshRecError

T = TypeVar("T")
log = logging.getLogger("freshcore.outage")

REDIS_DOWN: tuple[type[BaseException], ...] = (redis.ConnectionError, redis.TimeoutError)
"""Errors that mean Redis did not answer (as opposed to refusing a command)."""


PASSING_REFUSALS = ("OOM", "CLUSTERDOWN", "TRYAGAIN", "LOADING", "BUSY", "MASTERDOWN", "READONLY")
"""Error replies that pass with time: memory at ``maxmemory`` (until keys expire or an operator
acts), a cluster without a quorum or in the middle of a resharding or failover, a server
loading its data set, running a script, or a replica not yet promoted."""


PASSING_TYPES: dict[type[BaseException], str] = {
    redis.exceptions.OutOfMemoryError: "oom",
    redis.exceptions.MasterDownError: "masterdown",
    redis.exceptions.ClusterDownError: "clusterdown",
    redis.exceptions.TryAgainError: "tryagain",
    redis.exceptions.ReadOnlyError: "readonly",
    redis.exceptions.BusyLoadingError: "loading",
}
"""The same refusals as redis-py raises them: its parser turns ``OOM …`` into an
``OutOfMemoryError`` whose text has lost the word ``OOM`` (a check of the text alone let a
service at ``maxmemory`` crash), and likewise for the others."""


def is_outage(exc: BaseException) -> bool:
    """Redis did not answer, refused for a reason that passes with time, or a FreshRec error
    says the same call may succeed later.

    >>> is_outage(redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."))
    True
    >>> is_outage(redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'"))
    True
    >>> is_outage(redis.ResponseError("WRONGTYPE Operation against a key"))
    False
    """
    if isinstance(exc, REDIS_DOWN) or (isinstance(exc, FreshRecError) and exc.retriable):
        return True
    if isinstance(exc, tuple(PASSING_TYPES)):
        return True
    if isinstance(exc, redis.ResponseError):
        return str(exc).split(" ", 1)[0].upper() in PASSING_REFUSALS
    return False


def outage_reason(exc: BaseException) -> str:
    """The metric label of a failure ``is_outage`` waits out.

    >>> outage_reason(redis.ResponseError("OOM command not allowed")), outage_reason(
    ...     redis.ConnectionError("refused")), outage_reason(redis.exceptions.OutOfMemoryError())
    ('oom', 'down', 'oom')
    """
    for kind, label in PASSING_TYPES.items():  # subclasses first: MasterDown is a ClusterDown
        if isinstance(exc, kind):
            return label
    if isinstance(exc, redis.ResponseError):
        return str(exc).split(" ", 1)[0].lower()
    return "down" if isinstance(exc, REDIS_DOWN) else "retriable"


class _Waiting:
    """One wait: the first failure's log line and the recovery's, a failed attempt counted
    by its reason (``freshrec_redis_unavailable_total``), and the wait itself on the gauge
    ``freshrec_redis_waiting`` while it lasts."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.since: float | None = None

    def failed(self, exc: BaseException) -> bool:
        m.REDIS_UNAVAILABLE.labels(outage_reason(exc)).inc()
        first = self.since is None
        if first:
            self.since = time.monotonic()
            m.REDIS_WAITING.inc()
            log.warning("%s: Redis unavailable (%s); waiting for it", self.what, exc)
        return first

    def done(self) -> None:
        if self.since is not None:
            log.info("%s: Redis is back after %.1fs", self.what, time.monotonic() - self.since)

    def end(self) -> None:
        """The wait is over, whichever way (``done``, or an error not waited out)."""
        if self.since is not None:
            m.REDIS_WAITING.dec()
            self.since = None


class StopRequested(FreshRecError):
    """The service was asked to stop while it waited for Redis (``until_redis_answers`` with
    its ``stop``) or, starting, for its Kafka broker (``topics.metadata``): nothing was done
    that needs undoing, so it stops there."""


STOP_SIGNALLED = threading.Event()
"""Set once a service process was sent its stop signal (``lifecycle.set_from_signal`` with
``whole_process``). A wait that holds the main thread inside a client library, where a signal
handler cannot run until the call returns (a broker's metadata at start: 15 s), waits on
another thread instead and ends when this is set."""


def until_redis_answers(
    op: Callable[[], T],
    what: str,
    *,
    wait_s: float = 1.0,
    while_waiting: Callable[[bool], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    stop: threading.Event | None = None,
) -> T:
    """``op()``, again every ``wait_s`` while Redis is unreachable. ``while_waiting(first)``
    runs before each wait (pause consumption, poll to keep the group) and
    ``while_waiting``'s owner learns the wait ended by ``op`` returning. ``stop`` set during
    a wait ends it with ``StopRequested`` (a service starting while Redis is down can still
    be stopped)."""
    waiting = _Waiting(what)
    try:
        while True:
            try:
                result = op()
            except Exception as exc:
                if not is_outage(exc):
                    raise
                first = waiting.failed(exc)
                if while_waiting is not None:
                    while_waiting(first)
                if stop is None:
                    sleep(wait_s)
                elif stop.wait(wait_s):
                    raise StopRequested(f"{what}: asked to stop while waiting for Redis") from exc
                continue
            waiting.done()
            return result
    finally:
        waiting.end()


async def until_redis_answers_async(
    op: Callable[[], Awaitable[T]], what: str, *, wait_s: float = 1.0
) -> T:
    """``await op()``, again every ``wait_s`` while Redis is unreachable."""
    waiting = _Waiting(what)
    try:
        while True:
            try:
                result = await op()
            except Exception as exc:
                if not is_outage(exc):
                    raise
                waiting.failed(exc)
                await asyncio.sleep(wait_s)
                continue
            waiting.done()
            return result
    finally:
        waiting.end()
