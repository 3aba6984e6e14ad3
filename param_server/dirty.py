"""The rows a parameter server applied since its last flush: what the next transaction writes.
Pure.

Kept per ``gradients`` partition and table (a partition's rows, optimizer state and applied
offset go to Redis together, under its hash tag), as the slot arrays each apply added: a row
applied by several messages is named several times, and written once (``snapshot``). The
accumulator apart from the sender: the server's persister sends what ``snapshot`` copies.

>>> import numpy as np
>>> from param_server.table import ParamTable
>>> table = ParamTable(w=2)
>>> slots = table.add(np.array([7, 9, 11]), np.ones((3, 2), np.float32),
...                   np.zeros((3, 2), np.float32), np.ones(3, np.uint64), np.full(3, 5))
>>> dirty = DirtyRows()
>>> dirty.add_by_partition(0, slots, np.array([2, 3, 2]))
>>> dirty.add(2, 0, slots[:1])  # applied again
>>> dirty.rows, sorted(dirty.partitions)
(4, [2, 3])
>>> snapshot, oldest = dirty.snapshot({0: table})
>>> snapshot[2][0][0].tolist(), snapshot[3][0][0].tolist()  # the rows' ids, once each
([7, 11], [9])
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from param_server.table import ParamTable

Snapshot = dict[int, dict[int, tuple[np.ndarray, ...]]]
"""partition -> table -> (ids, rows, accumulators, versions, event times), copies."""


class DirtyRows:
    """Slots applied since the last flush, per ``gradients`` partition and table."""

    def __init__(self) -> None:
        self.partitions: dict[int, dict[int, list[np.ndarray]]] = {}
        """partition -> table -> slots applied since the last flush (arrays, may repeat)."""
        self.rows = 0
        """Slots added since the last flush (a row applied twice counts twice)."""

    def add(self, partition: int, table: int, slots: np.ndarray) -> None:
        self.partitions.setdefault(partition, {}).setdefault(table, []).append(slots)
        self.rows += len(slots)

    def add_by_partition(self, table: int, slots: np.ndarray, partition_of: np.ndarray) -> None:
        """``add`` each of ``slots`` under its own partition (``partition_of``, per slot)."""
        for p in np.unique(partition_of).tolist():
            self.add(p, table, slots[partition_of == p])

    def snapshot(self, tables: dict[int, ParamTable]) -> tuple[Snapshot, dict]:
        """A copy of every dirty row (``Snapshot``) and, per partition and table, the oldest
        event time each row's new gradients hold (``ParamTable.take_oldest``, which starts
        that again). The dirty rows stay until ``clear``."""
        snapshot: Snapshot = {}
        oldest: dict[int, dict[int, np.ndarray]] = {}
        for p, by_table in self.partitions.items():
            for t, parts in by_table.items():
                slots, tab = np.unique(np.concatenate(parts)), tables[t]
                rows = (
                    tab.ids[slots],
                    tab.rows[slots],
                    tab.accum[slots],
                    tab.version[slots],
                    tab.event_ms[slots],
                )
                snapshot.setdefault(p, {})[t] = rows
                oldest.setdefault(p, {})[t] = tab.take_oldest(slots)
        return snapshot, oldest

    def clear(self) -> None:
        self.partitions.clear()
        self.rows = 0
