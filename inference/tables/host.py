"""HostRows: the embedding cache's second level, rows in host memory. Pure (NumPy).

The worker's tables are three levels deep: the device (``EmbeddingCache``: every catalogue
item, the users used most recently), host RAM (this: the rows the device let go, least
recently used out first) and Redis (every row). A row the device evicts comes here with what
the device knew of it (version, newest event, the oldest event no reply has used, the newest
it learnt itself); a lookup the device misses takes it back from here before asking Redis;
a broadcast update for a row held here replaces it when newer, so a row here is as fresh as
one on the device. Rows live on one level at a time (taken rows leave).

>>> h = HostRows(2, 3)
>>> h.put([7, 8, 9], np.arange(9, dtype=np.float32).reshape(3, 3), np.array([1, 2, 3], np.uint64),
...       np.zeros((3, 3), np.int64))
1
>>> found, rows, versions, _ = h.take([7, 9, 5])
>>> found.tolist(), rows.tolist(), versions.tolist(), len(h)
([False, True, False], [[6.0, 7.0, 8.0]], [3], 1)
"""

from __future__ import annotations

import numpy as np

from inference.tables.lru import SlotLRU

EVENT, UNREPLIED, LOCAL = range(3)
"""Columns of ``HostRows.times``: the newest event the row includes, the oldest no reply has
used yet (0: none), the newest this worker learnt into it itself."""


class HostRows:
    """At most ``capacity`` rows of ``width`` floats by id, least recently put or refreshed
    out first; 0 holds nothing. Arrays grow as rows arrive (doubling, up to the capacity), so
    memory follows use."""

    def __init__(self, capacity: int, width: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._lru = SlotLRU(capacity) if capacity else None
        self.rows = np.zeros((0, width), np.float32)
        self.version = np.zeros(0, np.uint64)
        self.times = np.zeros((0, 3), np.int64)

    def __len__(self) -> int:
        return len(self._lru) if self._lru is not None else 0

    def __contains__(self, row_id: int) -> bool:
        return self._lru is not None and row_id in self._lru

    @property
    def nbytes(self) -> int:
        """Bytes the arrays take (the id map is Python objects besides)."""
        return self.rows.nbytes + self.version.nbytes + self.times.nbytes

    def put(self, ids: list[int], rows: np.ndarray, versions: np.ndarray, times: np.ndarray) -> int:
        """Hold these rows (distinct ids; ``times`` columns ``EVENT``, ``UNREPLIED``,
        ``LOCAL``). Returns how many rows did not stay: held ones that left to make room, and
        any of these beyond the capacity."""
        if self._lru is None or not ids:
            return 0
        evicted = max(0, len(ids) - self.capacity)
        if evicted:  # only the last ones can stay
            ids, rows = ids[-self.capacity :], rows[-self.capacity :]
            versions, times = versions[-self.capacity :], times[-self.capacity :]
        slots = np.empty(len(ids), np.int64)
        for j, row_id in enumerate(ids):
            slots[j], gone = self._lru.admit(row_id)
            evicted += gone is not None
        self._grow(int(slots.max()) + 1)
        self.rows[slots] = rows
        self.version[slots] = versions
        self.times[slots] = times
        return evicted

    def take(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The rows held of ``ids``: a mask over ``ids``, then their rows, versions and times in
        order. They leave this level (the caller puts them on the device)."""
        found = np.zeros(len(ids), bool)
        if self._lru is None or not len(self._lru):
            return found, self.rows[:0], self.version[:0], self.times[:0]
        slots = []
        for j, row_id in enumerate(ids):
            slot = self._lru.peek(row_id)
            if slot is not None:
                found[j] = True
                slots.append(slot)
                self._lru.discard(row_id)
        at = np.asarray(slots, np.int64)
        return found, self.rows[at], self.version[at], self.times[at]

    def refresh(
        self,
        ids: list[int],
        rows: np.ndarray,
        versions: np.ndarray,
        event_ms: np.ndarray,
        oldest_ms: np.ndarray,
    ) -> np.ndarray:
        """Broadcast rows: each held one of an older version is replaced (as
        ``EmbeddingCache.installed`` counts it for the ``reply`` stage). Returns the mask over
        ``ids`` of rows replaced."""
        done = np.zeros(len(ids), bool)
        if self._lru is None or not len(self._lru):
            return done
        slots = np.fromiter(
            (-1 if (s := self._lru.peek(i)) is None else s for i in ids), np.int64, len(ids)
        )
        held = slots >= 0
        done[held] = versions[held] > self.version[slots[held]]
        if not done.any():
            return done
        at = slots[done]
        self.rows[at] = rows[done]
        self.version[at] = versions[done]
        self.times[at, EVENT] = event_ms[done]
        include_foreign(
            self.times[:, UNREPLIED], self.times[:, LOCAL], at, oldest_ms[done], event_ms[done]
        )
        return done

    def _grow(self, need: int) -> None:
        if need <= len(self.rows):
            return
        n = min(self.capacity, max(need, 2 * len(self.rows), 1024))
        extra = n - len(self.rows)
        self.rows = np.concatenate([self.rows, np.zeros((extra, self.rows.shape[1]), np.float32)])
        self.version = np.concatenate([self.version, np.zeros(extra, np.uint64)])
        self.times = np.concatenate([self.times, np.zeros((extra, 3), np.int64)])


def include_foreign(
    unreplied: np.ndarray,
    local: np.ndarray,
    slots: np.ndarray,
    oldest_ms: np.ndarray,
    newest_ms: np.ndarray,
) -> None:
    """Broadcast rows were installed at ``slots``: events the worker learnt itself were
    counted from its local step (``local``, the newest it learnt); a row whose update holds
    events newer than that includes others' events, counted from the oldest of the update's
    events newer than its own (a lower bound of their lag)."""
    own = local[slots]
    foreign = newest_ms > own
    if foreign.any():
        since = np.maximum(oldest_ms[foreign], own[foreign] + 1)
        include_oldest(unreplied, slots[foreign], since)


def include_oldest(unreplied: np.ndarray, slots: np.ndarray, oldest_ms: np.ndarray) -> None:
    """Rows ``slots`` now include events from ``oldest_ms`` on: the oldest not yet replied.

    >>> u = np.array([0, 50, 0]); include_oldest(u, np.array([0, 1]), np.array([70, 60]))
    >>> u.tolist()
    [70, 50, 0]
    """
    held = unreplied[slots]
    unreplied[slots] = np.where(held > 0, np.minimum(held, oldest_ms), oldest_ms)
