"""One table's gradient messages of a poll, laid end to end for ``ParamTable.apply_log``.
Pure.

The parameter server applies all the messages of one poll together, table by table: their
entries in log order, each row located in the table's slab or named missing (``locate``), the
missing rows loaded from Redis in one round trip for every table, then the whole log applied
at once with exactly the result of applying the messages one by one (``apply``). A row lives
in one ``gradients`` partition, so each applied row is attributed to the partition whose
messages update it: its update carries that partition's offset.

>>> import numpy as np
>>> from param_server.adagrad import AdagradConfig
>>> from param_server.table import ParamTable
>>> from schemas.rowbatch import KIND_GRADIENTS, RowBatch
>>> def grads(ids, ms):
...     n = len(ids)
...     return RowBatch(KIND_GRADIENTS, 0, np.array(ids), np.ones((n, 2), np.float32),
...                     np.ones(n, np.uint64), np.full(n, ms))
>>> table = ParamTable(w=2)
>>> log = GradientLog.locate(table, [(0, 3, grads([7, 9], 5)), (1, 3, grads([9], 6))])
>>> [a.tolist() for a in log.missing]  # not held: the ids, and the time that creates each
[[7, 9], [5, 5]]
>>> ids, _ = log.missing
>>> zeros = np.zeros((2, 2), np.float32)
>>> loaded = table.add(ids, zeros, zeros, np.zeros(2, np.uint64), np.zeros(2, np.int64))
>>> done = log.apply(table, AdagradConfig(), loaded)
>>> done.slots.tolist(), done.partitions.tolist(), done.pairs, table.version[:2].tolist()
([0, 1], [3, 3], 3, [1, 2])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from param_server.adagrad import AdagradConfig
from param_server.table import ParamTable

if TYPE_CHECKING:
    from schemas.rowbatch import RowBatch

Entry = tuple[int, int, "RowBatch"]
"""(the message's place in the poll, its ``gradients`` partition, its batch)."""


class LogApplied(NamedTuple):
    """What ``GradientLog.apply`` did."""

    slots: np.ndarray
    """Distinct slots applied at least once, ascending."""
    partitions: np.ndarray
    """The ``gradients`` partition of each of ``slots``."""
    pairs: int
    """(message, row) pairs applied."""
    rejected: int
    """(message, row) pairs rejected as non-finite."""


@dataclass
class GradientLog:
    """The entries of one table's messages (``Entry``, in log order), located in the table."""

    entries: list[Entry]
    event_ms: np.ndarray
    """Each entry's newest event time."""
    oldest_ms: np.ndarray
    """Each entry's oldest event time."""
    distinct: np.ndarray
    """The distinct row ids, ascending."""
    first: np.ndarray
    """The first entry of each distinct id."""
    inverse: np.ndarray
    """Each entry's index in ``distinct``."""
    at: np.ndarray
    """The slot of each distinct id, -1 where the table does not hold it."""

    @classmethod
    def locate(cls, table: ParamTable, entries: list[Entry]) -> GradientLog:
        """The entries of ``entries`` laid end to end, their rows looked up in ``table``."""
        ids = np.concatenate([np.asarray(b.ids, np.int64) for _, _, b in entries])
        event_ms = np.concatenate([np.asarray(b.event_ms, np.int64) for _, _, b in entries])
        oldest = np.concatenate([np.asarray(b.oldest_ms, np.int64) for _, _, b in entries])
        distinct, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
        return cls(entries, event_ms, oldest, distinct, first, inverse, table.lookup(distinct))

    @property
    def held(self) -> np.ndarray:
        """Whether the table held each distinct id when the log was located."""
        return self.at >= 0

    @property
    def missing(self) -> tuple[np.ndarray, np.ndarray]:
        """The distinct ids the table does not hold, and the event time of the entry that
        would create each: a row Redis lacks is created by the first of them (log order)."""
        absent = ~self.held
        return self.distinct[absent], self.event_ms[self.first[absent]]

    def apply(
        self, table: ParamTable, cfg: AdagradConfig, loaded: np.ndarray | None = None
    ) -> LogApplied:
        """Apply the log to ``table`` (``loaded``: the slots the missing rows were given, in
        ``missing``'s order) and record each applied row's partition in it."""
        at = self.at.copy()
        if loaded is not None:
            at[~self.held] = loaded
        slots = at[self.inverse]
        grads = np.concatenate([b.rows for _, _, b in self.entries])
        sizes = [len(b) for _, _, b in self.entries]
        message = np.repeat([seq for seq, _, _ in self.entries], sizes)
        part = np.repeat([p for _, p, _ in self.entries], sizes)
        applied, pairs, rejected = table.apply_log(
            slots, grads, self.event_ms, message, cfg, self.oldest_ms
        )
        # a row lives in one partition: the update carries that partition's offset
        held, first = np.unique(slots, return_index=True)
        owner = part[first][np.searchsorted(held, applied)]  # applied ⊆ held, both sorted
        table.partition[applied] = owner
        return LogApplied(applied, owner, pairs, rejected)
