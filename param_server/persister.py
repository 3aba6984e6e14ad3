"""The parameter server's transaction in flight: sent by a thread of its own while the next
messages are applied.

A transaction is a snapshot (``dirty.DirtyRows.snapshot``, packed by ``store.pack_persist``),
so sending it again after a broken connection writes the same thing. One is in flight at a
time: the server finishes it (broadcasts its rows) as soon as Redis has answered, and always
before the next one starts, so Redis never holds an older snapshot over a newer one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from freshcore import metrics as m
from freshcore.outage import is_outage
from freshcore.rediskeys import RedisKeys
from param_server.dirty import Snapshot
from param_server.store import Fenced, PersistUnit

Transaction = Callable[..., Fenced]
"""``store.persist_fenced``'s signature: (redis, keys, units, owners, acked=...)."""


@dataclass
class InFlight:
    """A transaction handed to the persister thread, and what to broadcast once it is in."""

    future: Future
    units: list[PersistUnit]
    snapshot: Snapshot
    """partition -> table -> (ids, rows, accumulators, versions, event times), copies."""
    offsets: dict[int, int]
    owners: dict[int, str]
    rows: int
    started: float
    oldest: dict[int, dict[int, np.ndarray]]
    """partition -> table -> the oldest event time each snapshot row's new gradients hold."""
    acked: dict[int, int]
    """``ParameterServer.acked`` when it was sent: Redis behind it lost a transaction."""


class Persister:
    """Sends one transaction at a time on the ``ps-persist`` thread."""

    def __init__(self, redis, keys: RedisKeys, transaction: Transaction) -> None:
        self.redis = redis
        self.keys = keys
        self.transaction = transaction
        """``store.persist_fenced`` (a test may pass one that is slow, or fails)."""
        self.inflight: InFlight | None = None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="ps-persist")

    @property
    def rows(self) -> int:
        """Rows of the transaction in flight (0: none)."""
        return self.inflight.rows if self.inflight else 0

    def send(
        self,
        units: list[PersistUnit],
        snapshot: Snapshot,
        offsets: dict[int, int],
        owners: dict[int, str],
        rows: int,
        oldest: dict[int, dict[int, np.ndarray]],
        acked: dict[int, int],
    ) -> None:
        """Start the transaction of ``units`` (the packed ``snapshot``); the one before must
        be finished."""
        acked = dict(acked)
        future = self._thread.submit(
            self.transaction, self.redis, self.keys, units, owners, acked=acked
        )
        self.inflight = InFlight(
            future, units, snapshot, offsets, owners, rows, time.perf_counter(), oldest, acked
        )

    def finish(
        self, wait: bool, retry: Callable[[Callable[[], object]], object]
    ) -> tuple[InFlight, Fenced] | None:
        """The transaction in flight and its outcome once Redis has answered it; None if
        there is none, or (``wait`` false) it is still under way. While Redis is down it is
        sent again through ``retry`` (the server's, which pauses consumption and serves
        rebalance callbacks: a revoke's flush may finish it meanwhile, and then this gives
        None too)."""
        done = self.inflight
        if done is None or (not wait and not done.future.done()):
            return None
        try:
            owned = done.future.result()
        except Exception as exc:
            if not is_outage(exc):
                raise
            owned = retry(
                lambda: (
                    self.inflight is not done
                    or self.transaction(
                        self.redis, self.keys, done.units, done.owners, acked=done.acked
                    )
                )
            )
            if self.inflight is not done:  # finished (and broadcast) inside the retry
                return None
        self.inflight = None
        return done, owned

    def shutdown(self, wait: bool = True) -> None:
        self._thread.shutdown(wait=wait)


def observe_freshness(done: InFlight, newest_ms: int) -> int:
    """The freshness of a transaction Redis now holds: each row's lag from the oldest event
    its new gradients hold, and the newest event time persisted so far (returned, from
    ``newest_ms`` before it)."""
    persisted_ms = time.time() * 1000
    times = np.concatenate(
        [rows[4] for tables in done.snapshot.values() for rows in tables.values()]
    )
    times = times[times > 0]
    oldest = np.concatenate([o for tables in done.oldest.values() for o in tables.values()])
    oldest = oldest[oldest > 0]  # each row from the oldest event its new gradients hold
    m.observe_many(
        m.FRESHNESS_LAG.labels("global_applied"),
        np.maximum(persisted_ms - oldest, 0.0) / 1000,
    )
    if len(times):
        newest_ms = max(newest_ms, int(times.max()))
        m.FRESHNESS_EVENT_TIME.labels("global_applied").set(newest_ms / 1000)
    return newest_ms
