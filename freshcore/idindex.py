"""A map from int64 row ids to slots, looked up and filled a whole array at a time. Pure.

The parameter server and the worker look up tens of thousands of row ids per batch; a Python
dict costs ~0.4 µs an id there (boxed ints, one call each: 18.8 ms for 40k ids among 300k,
against 4.3 ms here). This is an open-addressing table (linear probing, Fibonacci hashing of
the id's bits, load ≤ 1/2) whose every operation is a few numpy passes over the batch: one
pass per probe step, and with load ≤ 1/2 almost every id is settled in the first two.

Ids are inserted once (``insert`` refuses ids already held). ``delete`` leaves a tombstone
in an id's bucket (probes go on past it; inserts take only empty buckets), so it costs what
a lookup of the deleted ids costs; tombstones count towards the load until the next growth
or ``rebuild`` clears them.

>>> ix = IdIndex()
>>> ix.insert(np.array([7, -3, 2**62]), np.array([0, 1, 2]))
>>> ix.lookup(np.array([2**62, 8, 7])).tolist()
[2, -1, 0]
>>> ix.delete(np.array([7]))
>>> ix.lookup(np.array([7, -3])).tolist(), len(ix)
([-1, 1], 2)
"""

from __future__ import annotations

import numpy as np

_FIB = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio: spreads any id over the top bits
EMPTY, HELD, DELETED = 0, 1, 2  # a bucket's state; DELETED: a tombstone


class IdIndex:
    def __init__(self, capacity: int = 1024) -> None:
        self._alloc(max(16, 1 << int(np.ceil(np.log2(max(2 * capacity, 2))))))
        self.size = 0

    def _alloc(self, buckets: int) -> None:
        self.bits = buckets.bit_length() - 1
        self.mask = buckets - 1
        self.keys = np.zeros(buckets, np.int64)
        self.vals = np.zeros(buckets, np.int64)
        self.state = np.zeros(buckets, np.int8)  # EMPTY, HELD or DELETED
        self.deleted = 0  # tombstones
        self._claim = np.zeros(buckets, np.int64)  # scratch: which id won a bucket

    def __len__(self) -> int:
        return self.size

    def _home(self, ids: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            h = ids.view(np.uint64) * _FIB
        return (h >> np.uint64(64 - self.bits)).astype(np.int64)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The slot of each id, -1 where it is not held."""
        ids = np.ascontiguousarray(ids, np.int64)
        out = np.full(len(ids), -1, np.int64)
        found = self._buckets(ids)
        hit = found >= 0
        out[hit] = self.vals[found[hit]]
        return out

    def _buckets(self, ids: np.ndarray) -> np.ndarray:
        """The bucket that holds each id, -1 where it is not held."""
        out = np.full(len(ids), -1, np.int64)
        if not self.size or not len(ids):
            return out
        pos = self._home(ids)
        todo = np.arange(len(ids))
        while len(todo):
            p = pos[todo]
            state = self.state[p]
            hit = (state == HELD) & (self.keys[p] == ids[todo])
            out[todo[hit]] = p[hit]
            go_on = (state != EMPTY) & ~hit  # an empty bucket ends the probe: not held
            todo = todo[go_on]
            pos[todo] = (p[go_on] + 1) & self.mask
        return out

    def delete(self, ids: np.ndarray) -> None:
        """Stop holding ``ids`` (those not held are ignored)."""
        at = self._buckets(np.ascontiguousarray(ids, np.int64))
        at = np.unique(at[at >= 0])
        self.state[at] = DELETED
        self.size -= len(at)
        self.deleted += len(at)

    def insert(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Hold ``ids`` (distinct, none held yet) at ``slots``. An id repeated or already
        held raises ``ValueError`` and leaves the index as it was."""
        ids = np.ascontiguousarray(ids, np.int64)
        slots = np.asarray(slots, np.int64)
        if len(ids) != len(slots):
            raise ValueError(f"{len(ids)} ids for {len(slots)} slots")
        if not len(ids):
            return
        if 2 * (self.size + self.deleted + len(ids)) > len(self.keys):
            self._grow(self.size + len(ids))
        self._place(ids, slots)

    def _place(self, ids: np.ndarray, slots: np.ndarray) -> None:
        pos = self._home(ids)
        todo = np.arange(len(ids))
        taken = []
        while len(todo):
            p = pos[todo]
            state = self.state[p]
            used = state != EMPTY
            # of the ids arriving at one free bucket, one takes it; the rest probe on
            free_p, free_todo = p[~used], todo[~used]
            self._claim[free_p] = free_todo
            won = self._claim[free_p] == free_todo
            # a probe checks every bucket of its id's chain, so it meets the id if it is held
            # or placed by this call, except the bucket it lost: check the winner there
            lost_to = self._claim[free_p[~won]]
            if ((state == HELD) & (self.keys[p] == ids[todo])).any() or (
                ids[lost_to] == ids[free_todo[~won]]
            ).any():
                # nothing displaces entries: freeing this call's buckets restores the index
                for buckets in taken:
                    self.state[buckets] = EMPTY
                raise ValueError("ids must be distinct and not held yet")
            buckets, takers = free_p[won], free_todo[won]
            self.keys[buckets] = ids[takers]
            self.vals[buckets] = slots[takers]
            self.state[buckets] = HELD
            taken.append(buckets)
            placed = np.zeros(len(ids), bool)
            placed[takers] = True
            left = ~placed[todo]
            todo = todo[left]
            pos[todo] = (p[left] + 1) & self.mask
        self.size += len(ids)

    def _grow(self, needed: int) -> None:
        """Re-place the held ids in a table for ``needed`` (tombstones are left behind)."""
        held = self.state == HELD
        keys, vals = self.keys[held], self.vals[held]
        buckets = len(self.keys)
        while 2 * needed > buckets:
            buckets *= 2
        self._alloc(buckets)
        self.size = 0
        self._place(keys, vals)

    def rebuild(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Forget everything, then hold ``ids`` at ``slots``."""
        self.clear()
        self.insert(ids, slots)

    def clear(self) -> None:
        self.state[:] = EMPTY
        self.size = self.deleted = 0
