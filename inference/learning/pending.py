"""Read-your-writes bookkeeping: the worker's local steps that the global row lacks. Pure.

A worker applies u ← u − lr·g to its cached row at once and sends g to the parameter server in
a gradient message. A row always maps to one ``gradients`` partition, and the parameter server
applies that partition's messages in offset order; every broadcast update says "these rows
include everything of partition p up to offset o". So, for each row, the worker keeps its
local steps (the deltas −lr·g) with the gradient message that carries them, and:

- on a broadcast update for the row from (p, o): the steps whose message was delivered at
  an offset ≤ o are included, and dropped; the serving row becomes the update's row plus the
  steps that remain;
- on a delivery report (p, o) for a message: if the row's last installed update already
  covers o, the step was included before the worker learnt its offset: it is dropped too, and
  removed from the serving row.

Exact: a step is in the serving row either through the global row or as a pending delta,
never both, never neither — unless the pool reached its bound and ``trim`` let the step go
(then an update that lacks it installs the row without it, until one that includes it). The worker also waits for the delivery reports of a row's
messages before it installs an update of that row (``waiting``): the parameter server can
only have applied a message the broker had acknowledged, so the report decides, and the
second rule above is then a safety net, not a path the worker takes.

Layout: a row is a slot of the cache's table (a small integer), and every operation takes a
whole array of them, with no Python per row or per step. Steps live in one pool of arrays
(delta, message, offset, ...); each row's steps form a linked list through the pool
(``head``/``tail`` per slot, ``next`` per step), appended to in order. An operation on many
rows walks their lists together, one numpy pass per step of the longest list. A message is a
token (a positive int) named when the message is produced; until then the step is unsent
(token 0). The delivery report writes the message's offset onto its steps.

>>> import numpy as np
>>> p = PendingSteps()
>>> steps = p.record("user", np.array([1]), np.array([[0.5]]))  # slot 1, unsent
>>> p.assign(steps, token=7)
>>> p.delivered(7, partition=0, offset=41)
[]
>>> rest, kept = p.install("user", np.array([1]), partition=0, offset=40)  # not yet included
>>> rest.tolist(), kept.tolist()
([[0.5]], [True])
>>> rest, kept = p.install("user", np.array([1]), partition=0, offset=41)  # now it is
>>> kept.tolist(), len(p)
([False], 0)
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

UNSENT = 0
"""The token of a step whose message has not been produced yet."""
FAILED = -1
"""The token of a step whose message was not delivered: local for good (or until ``trim``)."""
_UNKNOWN = -1  # the offset of a step whose delivery report has not arrived
_POOL = ("_delta", "_token", "_part", "_off", "_next", "_slot", "_table", "_seq")
"""The pool's arrays, one entry per step; a free entry holds nothing: ``record`` writes it."""


class _Lists:
    """Per slot of one table: its first and last step, and the last update installed."""

    def __init__(self, capacity: int) -> None:
        self.head = np.full(capacity, -1, np.int64)
        self.tail = np.full(capacity, -1, np.int64)
        self.inst_part = np.full(capacity, -1, np.int64)
        self.inst_off = np.full(capacity, -1, np.int64)

    def fit(self, slots: np.ndarray) -> None:
        need = int(slots.max()) + 1 if len(slots) else 0
        have = len(self.head)
        if need > have:
            for name in ("head", "tail", "inst_part", "inst_off"):
                setattr(self, name, _grown(getattr(self, name), max(need, 2 * have), -1))


class PendingSteps:
    """Local steps per (table, slot) that the installed global rows do not include."""

    def __init__(self, capacity: int = 1024, width: int = 0, touch: bool = False) -> None:
        """``capacity`` steps before the pool first grows. ``width`` (the deltas' width)
        fixes the pool's layout now, float32, instead of at the first ``record`` (float32
        or more, as the deltas come). ``touch`` writes the whole pool once here: a page's
        first write costs a fault, and a worker that starts with an empty pool otherwise
        pays them inside its first slices (~0.4 µs an event until the pool is full)."""
        self._tables: dict[Hashable, _Lists] = {}
        self._codes: dict[Hashable, int] = {}  # table -> its code in ``_table``
        self._names: list[Hashable] = []
        self._w = width  # width of a delta; 0: set by the first record
        self._alloc_pool(max(1, capacity))
        if touch:
            for name in _POOL:
                getattr(self, name).fill(0)
        self._count = 0
        self._taken = 0  # steps recorded so far: each step's ``_seq``, its age
        # token -> its steps (pool indices), from ``assign`` to the delivery report
        self._by_token: dict[int, np.ndarray] = {}

    def _alloc_pool(self, capacity: int) -> None:
        for name in _POOL:  # a free entry is written in full when it is taken
            shape = (capacity, self._w) if name == "_delta" else (capacity,)
            setattr(self, name, np.empty(shape, np.float32 if name == "_delta" else np.int64))
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # a stack: top at the end
        self._free_n = capacity

    def __len__(self) -> int:
        """Steps held."""
        return self._count

    def rows(self) -> int:
        """Rows with steps."""
        return sum(int(np.count_nonzero(t.head >= 0)) for t in self._tables.values())

    # ------------------------------------------------------------------------ recording
    def record(self, table: Hashable, slots: np.ndarray, deltas: np.ndarray) -> np.ndarray:
        """A local step on each row ``(table, slot)``, unsent; returns the steps' indices
        (``assign`` names their message). A slot may repeat: its steps append in order."""
        slots = np.asarray(slots, np.int64)
        deltas = np.asarray(deltas)
        if deltas.ndim != 2 or len(deltas) != len(slots):
            raise ValueError(f"{len(slots)} slots for deltas of shape {deltas.shape}")
        if len(slots) and slots.min() < 0:
            raise ValueError("slots must be >= 0")
        if self._w == 0 and len(slots):  # the deltas' width and precision (float32 or more)
            self._w = deltas.shape[1]
            dtype = np.result_type(deltas.dtype, np.float32)
            self._delta = np.zeros((len(self._delta), self._w), dtype)
        elif len(slots) and deltas.shape[1] != self._w:
            raise ValueError(f"deltas of width {deltas.shape[1]}, the steps held have {self._w}")
        idx = self._take(len(slots))
        lists = self._lists(table)
        lists.fit(slots)
        self._delta[idx] = deltas
        self._token[idx] = UNSENT
        self._part[idx] = -1
        self._off[idx] = _UNKNOWN
        self._next[idx] = -1
        self._slot[idx] = slots
        self._table[idx] = self._codes[table]
        self._seq[idx] = np.arange(self._taken, self._taken + len(slots))
        self._taken += len(slots)
        order = np.argsort(slots, kind="stable")
        ordered = slots[order]
        first = np.ones(len(slots), bool)
        first[1:] = ordered[1:] != ordered[:-1]
        if first.all():
            self._append(lists, slots, idx)
        else:  # a slot named twice: its k-th step joins in the k-th round, so order holds
            at = np.arange(len(slots))
            ranks = np.empty(len(slots), np.int64)
            ranks[order] = at - np.maximum.accumulate(np.where(first, at, 0))
            for r in range(int(ranks.max()) + 1):
                sel = ranks == r
                self._append(lists, slots[sel], idx[sel])
        self._count += len(slots)
        return idx

    def _append(self, lists: _Lists, slots: np.ndarray, idx: np.ndarray) -> None:
        """Append step ``idx[j]`` to the list of ``slots[j]`` (distinct slots)."""
        tails = lists.tail[slots]
        empty = tails < 0
        lists.head[slots[empty]] = idx[empty]
        self._next[tails[~empty]] = idx[~empty]
        lists.tail[slots] = idx

    def assign(self, steps: np.ndarray, token: int) -> None:
        """Steps ``steps`` (unsent) travel in message ``token`` (> 0)."""
        steps = np.asarray(steps, np.int64)
        if token <= 0:
            raise ValueError(f"a message token is > 0, not {token}")
        if not len(steps):
            return
        if (self._token[steps] != UNSENT).any():
            raise ValueError(f"message {token}: a step given is not an unsent step")
        self._token[steps] = token
        self._by_token[token] = steps

    # -------------------------------------------------------------------- delivery reports
    def delivered(
        self, token: int, partition: int, offset: int
    ) -> list[tuple[Hashable, np.ndarray, np.ndarray]]:
        """Record where message ``token`` landed; returns, per table, the slots and deltas
        of steps that an installed update already included: subtract them from the serving
        rows (none when the worker waits for its reports before installing)."""
        steps = self._by_token.pop(token, None)
        if steps is None:
            return []
        steps = steps[self._token[steps] == token]  # a forgotten row's steps are gone
        self._part[steps] = partition
        self._off[steps] = offset
        out = []
        for code in np.unique(self._table[steps]).tolist():
            name = self._names[code]
            lists = self._tables[name]
            mine = steps[self._table[steps] == code]
            slots = self._slot[mine]
            covered = (lists.inst_part[slots] == partition) & (lists.inst_off[slots] >= offset)
            if covered.any():
                gone = mine[covered]
                out.append((name, self._slot[gone], self._delta[gone].copy()))
                self._drop(lists, gone)
        return out

    def failed(self, token: int) -> None:
        """The message was not delivered: its steps stay local for good (the global row
        will never include them)."""
        steps = self._by_token.pop(token, None)
        if steps is not None:
            self._token[steps[self._token[steps] == token]] = FAILED

    def withdrawn(self, token: int) -> list[tuple[Hashable, np.ndarray, np.ndarray]]:
        """Message ``token`` was taken back before the broker had it (purged from the
        producer on a rebalance: the partition's next owner learns its events again). Its
        steps leave the pool; returns, per table, their slots and deltas, to subtract from
        the serving rows, which then hold none of it, as the global rows will not either.

        >>> p = PendingSteps()
        >>> p.assign(p.record("user", np.array([3]), np.array([[0.25]])), token=9)
        >>> [(t, s.tolist(), d.tolist()) for t, s, d in p.withdrawn(9)], len(p)
        ([('user', [3], [[0.25]])], 0)
        """
        steps = self._by_token.pop(token, None)
        if steps is None:
            return []
        steps = steps[self._token[steps] == token]
        out = []
        for code in np.unique(self._table[steps]).tolist():
            name = self._names[code]
            mine = steps[self._table[steps] == code]
            out.append((name, self._slot[mine].copy(), self._delta[mine].copy()))
            self._drop(self._tables[name], mine)
        return out

    # ------------------------------------------------------------------------- installing
    def holds(self, table: Hashable, slots: np.ndarray) -> np.ndarray:
        """Per slot: does the row have local steps? A row without steps needs no
        bookkeeping on install: a step recorded later travels in a message produced later,
        at an offset the update cannot cover."""
        slots = np.asarray(slots, np.int64)
        lists = self._tables.get(table)
        out = np.zeros(len(slots), bool)
        if lists is None:
            return out
        inside = (slots >= 0) & (slots < len(lists.head))
        out[inside] = lists.head[slots[inside]] >= 0
        return out

    def waiting(self, table: Hashable, slots: np.ndarray) -> np.ndarray:
        """Per slot: does the row have a step in a message whose offset is not known yet?"""
        slots = np.asarray(slots, np.int64)
        out = np.zeros(len(slots), bool)
        held = np.flatnonzero(self.holds(table, slots))
        if len(held):
            pos, steps = self._walk(self._tables[table], slots[held])
            open_ = (self._token[steps] > 0) & (self._off[steps] == _UNKNOWN)
            out[held[pos[open_]]] = True
        return out

    def install(
        self, table: Hashable, slots: np.ndarray, partition: int, offset: int
    ) -> tuple[np.ndarray | None, np.ndarray]:
        """Global updates of rows ``slots`` (distinct) covering (partition, offset) were
        installed: drop the steps they include. Returns the sums of the steps that remain
        (a row per slot, None if no row keeps any) and, per slot, whether any remains."""
        slots = np.asarray(slots, np.int64)
        kept_rows = np.zeros(len(slots), bool)
        if not len(slots):
            return None, kept_rows
        lists = self._lists(table)
        lists.fit(slots)
        lists.inst_part[slots] = partition
        lists.inst_off[slots] = offset
        pos, steps = self._walk(lists, slots)
        if not len(steps):
            return None, kept_rows
        off = self._off[steps]
        included = (off != _UNKNOWN) & (off <= offset) & (self._part[steps] == partition)
        if included.any():
            self._relink(lists, slots, pos, steps, ~included)
            pos, steps = pos[~included], steps[~included]
        if not len(steps):
            return None, kept_rows
        kept_rows[pos] = True
        order = np.argsort(pos, kind="stable")  # each row's steps in the order they were taken
        ordered = pos[order]
        starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
        rest = np.zeros((len(slots), self._w), np.float64)
        taken = self._delta[steps[order]].astype(np.float64)
        rest[ordered[starts]] = np.add.reduceat(taken, starts, axis=0)
        return rest, kept_rows

    def forget(self, table: Hashable, slots: np.ndarray) -> None:
        """The cache let rows ``slots`` go (evicted): their bookkeeping goes with them."""
        lists = self._tables.get(table)
        slots = np.asarray(slots, np.int64)
        if lists is None or not len(slots):
            return
        slots = slots[slots < len(lists.head)]
        _, steps = self._walk(lists, slots)
        lists.head[slots] = lists.tail[slots] = -1
        lists.inst_part[slots] = lists.inst_off[slots] = -1
        self._release(steps)

    def drop_unsent(self, table: Hashable, steps: np.ndarray) -> None:
        """Let unsent steps ``steps`` of ``table`` go: their gradients will never be sent
        (the worker's admission filter forgot their rows)."""
        steps = np.unique(np.asarray(steps, np.int64))
        if not len(steps):
            return
        if (self._token[steps] != UNSENT).any() or (self._slot[steps] < 0).any():
            raise ValueError("only steps held and unsent can be dropped")
        code = self._codes.get(table)
        if code is None or (self._table[steps] != code).any():
            raise ValueError(f"steps of another table than {table!r}")
        self._drop(self._tables[table], steps)

    def trim(self, most: int) -> int:
        """Hold at most ``most`` steps, if sent ones allow: let the oldest steps already in a
        message go (delivered, in flight or failed; unsent ones are named by the outbox and
        stay). Their deltas stay in the serving rows, but the bookkeeping no longer knows
        them: a later install of such a row is its global row plus the steps still held, so
        a let-go step the update does not include yet is missing from the row until an
        update that includes it (the parameter server applies in offset order and catches
        up). The worker's bound for a parameter server down or far behind, where otherwise
        every step would stay. Returns the number of steps let go."""
        if most < 0:
            raise ValueError(f"most must be >= 0, not {most}")
        excess = self._count - most
        if excess <= 0:
            return 0
        held = np.ones(len(self._token), bool)
        held[self._free[: self._free_n]] = False
        candidates = np.flatnonzero(held & (self._token != UNSENT))
        if len(candidates) > excess:
            oldest = np.argpartition(self._seq[candidates], excess - 1)[:excess]
            candidates = candidates[oldest]
        for code in np.unique(self._table[candidates]).tolist():
            self._drop(self._tables[self._names[code]], candidates[self._table[candidates] == code])
        return len(candidates)

    def steps(self, table: Hashable, slot: int) -> np.ndarray:
        """The deltas of one row's steps, in the order they were taken (for inspection)."""
        lists = self._tables.get(table)
        if lists is None or not 0 <= slot < len(lists.head):
            return np.zeros((0, self._w))
        _, steps = self._walk(lists, np.array([slot]))
        return self._delta[steps].copy()

    # ---------------------------------------------------------------------------- plumbing
    def _lists(self, table: Hashable) -> _Lists:
        lists = self._tables.get(table)
        if lists is None:
            lists = self._tables[table] = _Lists(1024)
            self._codes[table] = len(self._names)
            self._names.append(table)
        return lists

    def _walk(self, lists: _Lists, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The steps of rows ``slots`` (distinct) as (position in ``slots``, step) pairs:
        first every row's first step, then every second step, and so on."""
        cur = lists.head[slots]
        pos = np.flatnonzero(cur >= 0)
        cur = cur[pos]
        positions, steps = [], []
        while len(cur):
            positions.append(pos)
            steps.append(cur)
            cur = self._next[cur]
            more = cur >= 0
            pos, cur = pos[more], cur[more]
        if not steps:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(positions), np.concatenate(steps)

    def _relink(
        self,
        lists: _Lists,
        slots: np.ndarray,
        pos: np.ndarray,
        steps: np.ndarray,
        keep: np.ndarray,
    ) -> None:
        """Rebuild the lists of ``slots`` from their walked steps, keeping ``keep``."""
        self._release(steps[~keep])
        pos, steps = pos[keep], steps[keep]
        lists.head[slots] = lists.tail[slots] = -1
        if not len(steps):
            return
        order = np.argsort(pos, kind="stable")
        pos, steps = pos[order], steps[order]
        first = np.r_[True, pos[1:] != pos[:-1]]
        last = np.r_[pos[1:] != pos[:-1], True]
        self._next[steps[:-1]] = steps[1:]
        self._next[steps[last]] = -1
        lists.head[slots[pos[first]]] = steps[first]
        lists.tail[slots[pos[last]]] = steps[last]

    def _drop(self, lists: _Lists, gone: np.ndarray) -> None:
        """Remove steps ``gone`` from their rows' lists."""
        slots = np.unique(self._slot[gone])
        pos, steps = self._walk(lists, slots)
        self._relink(lists, slots, pos, steps, ~np.isin(steps, gone))

    def _release(self, steps: np.ndarray) -> None:
        if not len(steps):
            return
        self._token[steps] = UNSENT
        self._slot[steps] = -1
        self._next[steps] = -1
        n = self._free_n
        self._free[n : n + len(steps)] = steps
        self._free_n = n + len(steps)
        self._count -= len(steps)

    def _take(self, n: int) -> np.ndarray:
        if self._free_n < n:
            self._grow(max(2 * len(self._token), len(self._token) + n))
        top = self._free_n
        self._free_n = top - n
        return self._free[top - n : top][::-1].copy()

    def _grow(self, capacity: int) -> None:
        old = len(self._token)
        extra = capacity - old
        for name in _POOL:  # a free entry is written in full when it is taken: left as is
            setattr(self, name, _grown(getattr(self, name), capacity))
        n = self._free_n
        free = _grown(self._free[:n], capacity)  # room for every step to be free at once
        free[n : n + extra] = np.arange(capacity - 1, old - 1, -1)
        self._free, self._free_n = free, n + extra


def _grown(held: np.ndarray, rows: int, fill: int | None = None) -> np.ndarray:
    """``held`` at the front of a new array of ``rows`` rows, the rest ``fill`` or, without
    one, untouched memory: np.concatenate (or np.full) writes every new byte, ~15x slower
    than leaving it for a large pool on this machine, whose first touch of a page is dear."""
    shape = (rows, *held.shape[1:])
    out = np.empty(shape, held.dtype) if fill is None else np.full(shape, fill, held.dtype)
    out[: len(held)] = held
    return out
