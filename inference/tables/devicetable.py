"""A table of the embedding cache (``cache.py``): its rows on the device, and per slot on the
host the version of the global row it last installed, the newest event time it includes,
when it was last looked up, and the event times the ``reply`` freshness stage follows.
"""

from __future__ import annotations

import numpy as np
import torch

from freshcore import metrics as m
from inference.device import release_cached


class DeviceTable:
    """One table's rows on the device (``capacity`` slots of ``w`` columns, in ``dtype``),
    and per slot on the host: the version and event times of the row it holds."""

    def __init__(self, w: int, capacity: int, device: torch.device, dtype: torch.dtype) -> None:
        self.rows = torch.zeros((capacity, w), dtype=dtype, device=device)
        self.version = np.zeros(capacity, np.uint64)
        self.event_ms = np.zeros(capacity, np.int64)
        self.seen_ms = np.zeros(capacity, np.int64)  # last looked up (items: for expiry)
        self.unreplied_ms = np.zeros(capacity, np.int64)
        """The oldest event time the row includes that no reply has used yet (0: none)."""
        self.local_ms = np.zeros(capacity, np.int64)
        """The newest event time this worker learnt into the row itself."""
        self.newest = 0
        """The highest version any row of the table has been given (``set_version``): a
        reply's ``item_table_version``, read once a batch without a scan of the table."""

    def set_version(self, slots, versions) -> None:
        """The versions of the rows at ``slots`` (``newest`` follows)."""
        self.version[slots] = versions
        if np.size(versions):
            self.newest = max(self.newest, int(np.max(versions)))

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` slots (the new ones zero, at version 0); never shrinks."""
        extra = capacity - len(self.rows)
        if extra <= 0:
            return
        pad = torch.zeros(
            (extra, self.rows.shape[1]), dtype=self.rows.dtype, device=self.rows.device
        )
        self.rows = torch.cat([self.rows, pad])
        self.version = np.concatenate([self.version, np.zeros(extra, np.uint64)])
        self.event_ms = np.concatenate([self.event_ms, np.zeros(extra, np.int64)])
        self.seen_ms = np.concatenate([self.seen_ms, np.zeros(extra, np.int64)])
        self.unreplied_ms = np.concatenate([self.unreplied_ms, np.zeros(extra, np.int64)])
        self.local_ms = np.concatenate([self.local_ms, np.zeros(extra, np.int64)])

    def grow_within_memory(self, need: int, wanted: int) -> bool:
        """``grow`` to ``wanted`` slots, else to ``need`` where the device has no memory for
        that many; False where it has none for ``need`` either. A refused growth changes
        nothing (the old rows are kept until the new ones are made) and is counted."""
        for capacity in dict.fromkeys((wanted, need)):
            try:
                self.grow(capacity)
                return True
            except torch.OutOfMemoryError:
                m.DEVICE_OOM.labels("table").inc()
                release_cached(self.rows.device)
        return False
