"""The rows a parameter server holds for one table: dense slabs, one slot per row id. Pure.

Rows, Adagrad accumulators, versions and newest event times live in four arrays that grow by
doubling; an ``IdIndex`` maps row ids to slots, a whole batch of ids at a time. A gradient message is applied with a handful of
vectorised operations (gather, Adagrad, scatter) whatever its size, instead of per-row Python
objects. Gradients of one row repeated within a message are summed first, so the message is
still applied as one unit and each row's version rises by one per message that touches it.

>>> import numpy as np
>>> from param_server.adagrad import AdagradConfig
>>> t = ParamTable(w=2)
>>> slots = t.add(np.array([7, 9]), np.zeros((2, 2), np.float32), np.zeros((2, 2), np.float32),
...               np.zeros(2, np.uint64), np.zeros(2, np.int64))
>>> t.lookup(np.array([9, 8])).tolist()
[1, -1]
>>> g = np.array([[3.0, 4.0], [0.0, np.nan]], np.float32)
>>> ok = t.apply(slots, g, np.array([5, 6]), AdagradConfig(lr=0.1, max_norm=1.0))
>>> ok.tolist(), t.version[:2].tolist(), t.event_ms[:2].tolist()
([True, False], [1, 0], [5, 0])
"""

from __future__ import annotations

import numpy as np

from freshcore.idindex import IdIndex
from param_server.adagrad import AdagradConfig, adagrad_step


class ParamTable:
    def __init__(self, w: int, capacity: int = 1024) -> None:
        self.w = w
        self.size = 0
        self.index = IdIndex(capacity)
        self.ids = np.zeros(capacity, np.int64)
        self.rows = np.zeros((capacity, w), np.float32)
        self.accum = np.zeros((capacity, w), np.float32)
        self.version = np.zeros(capacity, np.uint64)
        self.event_ms = np.zeros(capacity, np.int64)
        self.oldest_ms = np.zeros(capacity, np.int64)
        """The oldest event time among the gradients applied since the row was last taken
        for persisting (``take_oldest``); 0: none."""
        self.partition = np.full(capacity, -1, np.int32)
        """The ``gradients`` partition whose messages update the row (set by the server when
        it applies one; -1: none applied since the row was loaded)."""

    def __len__(self) -> int:
        return self.size

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id, -1 where the row is not held."""
        return self.index.lookup(ids)

    def add(
        self,
        ids: np.ndarray,
        rows: np.ndarray,
        accum: np.ndarray,
        versions: np.ndarray,
        event_ms: np.ndarray,
    ) -> np.ndarray:
        """Hold new rows (ids not held yet, distinct); returns their slots."""
        n = len(ids)
        self._reserve(self.size + n)
        slots = np.arange(self.size, self.size + n, dtype=np.int64)
        self.ids[slots] = ids
        self.rows[slots] = rows
        self.accum[slots] = accum
        self.version[slots] = versions
        self.event_ms[slots] = event_ms
        self.oldest_ms[slots] = 0
        self.partition[slots] = -1
        self.index.insert(ids, slots)
        self.size += n
        return slots

    def apply(
        self, slots: np.ndarray, grads: np.ndarray, event_ms: np.ndarray, cfg: AdagradConfig
    ) -> np.ndarray:
        """One gradient message: sum repeated rows, clip, reject non-finite rows, Adagrad;
        applied rows get version + 1 and the newest event time. Returns, per distinct slot in
        ascending order, whether it was applied (``np.unique(slots)`` gives the slots)."""
        uniq, inverse = np.unique(slots, return_inverse=True)
        if len(uniq) == len(slots):
            order = np.argsort(slots, kind="stable")
            g = np.asarray(grads, np.float32)[order]
            newest = np.asarray(event_ms, np.int64)[order]
        else:
            g = np.zeros((len(uniq), grads.shape[1]), np.float64)
            np.add.at(g, inverse, np.asarray(grads, np.float64))
            g = g.astype(np.float32)
            newest = np.full(len(uniq), np.iinfo(np.int64).min, np.int64)
            np.maximum.at(newest, inverse, np.asarray(event_ms, np.int64))
        rows, accum = self.rows[uniq], self.accum[uniq]
        ok = adagrad_step(rows, accum, g, cfg)
        done = uniq[ok]
        self.rows[done] = rows[ok]
        self.accum[done] = accum[ok]
        self.version[done] += np.uint64(1)
        self.event_ms[done] = np.maximum(self.event_ms[done], newest[ok])
        return ok

    def apply_log(
        self,
        slots: np.ndarray,
        grads: np.ndarray,
        event_ms: np.ndarray,
        message: np.ndarray,
        cfg: AdagradConfig,
        oldest_ms: np.ndarray | None = None,
    ) -> tuple[np.ndarray, int, int]:
        """Several gradient messages at once, with exactly the result of ``apply`` on each in
        turn: ``message`` numbers the entries' messages in log order. A row's updates do not
        depend on other rows, so the k-th message touching each row is applied to all those
        rows together, in rounds k = 0, 1, ... (one round for rows that only one message
        touches). ``oldest_ms`` (by default ``event_ms``) is each entry's oldest event time,
        kept per row until ``take_oldest``. Returns (distinct slots applied at least once,
        (message, row) pairs applied, pairs rejected as non-finite)."""
        oldest_ms = event_ms if oldest_ms is None else oldest_ms
        s, g, newest, oldest = _summed_per_message(slots, grads, event_ms, message, oldest_ms)
        by_round, bounds = _rounds(s)
        s, g, newest, oldest = s[by_round], g[by_round], newest[by_round], oldest[by_round]
        applied, pairs, rejected = [], 0, 0
        for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            done, dropped = self._apply_round(s[lo:hi], g[lo:hi], newest[lo:hi], oldest[lo:hi], cfg)
            applied.append(done)
            pairs += len(done)
            rejected += dropped
        done = np.unique(np.concatenate(applied)) if applied else np.empty(0, np.int64)
        return done, pairs, rejected

    def _apply_round(
        self,
        slots: np.ndarray,
        grads: np.ndarray,
        newest: np.ndarray,
        oldest: np.ndarray,
        cfg: AdagradConfig,
    ) -> tuple[np.ndarray, int]:
        """One round of ``apply_log``: distinct ``slots``, one gradient each. Returns the
        slots applied and how many were rejected as non-finite."""
        rows, accum = self.rows[slots], self.accum[slots]
        ok = adagrad_step(rows, accum, grads, cfg)
        if ok.all():
            done = slots
            self.rows[done], self.accum[done] = rows, accum
            self.event_ms[done] = np.maximum(self.event_ms[done], newest)
            self._keep_oldest(done, oldest)
            rejected = 0
        else:
            done = slots[ok]
            self.rows[done] = rows[ok]
            self.accum[done] = accum[ok]
            self.event_ms[done] = np.maximum(self.event_ms[done], newest[ok])
            self._keep_oldest(done, oldest[ok])
            rejected = int((~ok).sum())
        self.version[done] += np.uint64(1)
        return done, rejected

    def _keep_oldest(self, slots: np.ndarray, oldest: np.ndarray) -> None:
        held = self.oldest_ms[slots]
        self.oldest_ms[slots] = np.where(held > 0, np.minimum(held, oldest), oldest)

    def take_oldest(self, slots: np.ndarray) -> np.ndarray:
        """The oldest event time applied to each of ``slots`` since the last take (its newest
        event time where none is known), and start again: what a persist and its broadcast
        include, for freshness timed from the oldest event."""
        held = self.oldest_ms[slots]
        self.oldest_ms[slots] = 0
        return np.where(held > 0, held, self.event_ms[slots])

    def evict_older_than(self, cutoff_ms: int) -> int:
        """Forget rows whose newest event time is before ``cutoff_ms`` (they are in Redis,
        and reloaded if touched again); returns how many. Call with nothing unpersisted."""
        n = self.size
        keep = self.event_ms[:n] >= cutoff_ms
        gone = n - int(keep.sum())
        if gone == 0:
            return 0
        for name in ("ids", "rows", "accum", "version", "event_ms", "oldest_ms", "partition"):
            arr = getattr(self, name)
            arr[: n - gone] = arr[:n][keep]
        self.size = n - gone
        self.index.rebuild(self.ids[: self.size], np.arange(self.size))
        return gone

    def slots_of(self, partition: int) -> np.ndarray:
        """The slots of the rows ``partition``'s messages updated since they were loaded."""
        return np.flatnonzero(self.partition[: self.size] == partition)

    def clear(self) -> None:
        self.size = 0
        self.index.clear()

    def _reserve(self, needed: int) -> None:
        capacity = len(self.ids)
        if needed <= capacity:
            return
        while capacity < needed:
            capacity *= 2
        for name in ("ids", "rows", "accum", "version", "event_ms", "oldest_ms", "partition"):
            old = getattr(self, name)
            new = np.zeros((capacity, *old.shape[1:]), old.dtype)
            new[: self.size] = old[: self.size]
            setattr(self, name, new)


def _summed_per_message(
    slots: np.ndarray,
    grads: np.ndarray,
    event_ms: np.ndarray,
    message: np.ndarray,
    oldest_ms: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A log's entries by row, then log order, one per (message, row): where one message
    repeats a row its gradients are summed as ``ParamTable.apply`` sums them, with the newest
    and the oldest of their event times. Returns (slots, gradients, newest, oldest).

    >>> s, g, newest, oldest = _summed_per_message(
    ...     np.array([4, 2, 4]), np.ones((3, 1), np.float32), np.array([7, 8, 9]),
    ...     np.array([0, 0, 0]), np.array([7, 8, 9]))
    >>> s.tolist(), g[:, 0].tolist(), newest.tolist(), oldest.tolist()
    ([2, 4], [1.0, 2.0], [8, 9], [8, 7])
    """
    slots = np.asarray(slots, np.int64)
    message = np.asarray(message, np.int64)
    order = np.lexsort((message, slots))  # by row, then log order
    s, msg = slots[order], message[order]
    head = np.ones(len(s), bool)
    head[1:] = (s[1:] != s[:-1]) | (msg[1:] != msg[:-1])
    if head.all():
        g = np.asarray(grads, np.float32)[order]
        newest = np.asarray(event_ms, np.int64)[order]
        oldest = np.asarray(oldest_ms, np.int64)[order]
        return s, g, newest, oldest
    # one message repeats a row: sum its gradients as ``apply`` does
    group = np.cumsum(head) - 1
    g = np.zeros((int(head.sum()), grads.shape[1]), np.float64)
    np.add.at(g, group, np.asarray(grads, np.float64)[order])
    g = g.astype(np.float32)
    newest = np.full(len(g), np.iinfo(np.int64).min, np.int64)
    np.maximum.at(newest, group, np.asarray(event_ms, np.int64)[order])
    oldest = np.full(len(g), np.iinfo(np.int64).max, np.int64)
    np.minimum.at(oldest, group, np.asarray(oldest_ms, np.int64)[order])
    return s[head], g, newest, oldest


def _rounds(slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Entries sorted by row (``slots`` ascending, a row's entries in log order) regrouped
    by round: the k-th entry of every row is in round k. Returns the order that lays the
    rounds end to end (rows ascending within each) and the bounds of each round in it.

    >>> order, bounds = _rounds(np.array([2, 4, 4, 4, 5]))
    >>> order.tolist(), bounds.tolist()
    ([0, 1, 4, 2, 3], [0, 3, 4, 5])
    """
    first = np.ones(len(slots), bool)
    first[1:] = slots[1:] != slots[:-1]
    position = np.arange(len(slots))
    rank = position - np.maximum.accumulate(np.where(first, position, 0))
    by_round = np.argsort(rank, kind="stable")
    bounds = np.searchsorted(rank[by_round], np.arange(int(rank.max(initial=-1)) + 2))
    return by_round, bounds
