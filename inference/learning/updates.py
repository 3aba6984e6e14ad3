"""Broadcast updates into the worker's cache, each row with the local steps it lacks.

The parameter servers broadcast the rows they applied on ``embeddings.updates`` (every worker
reads every partition). A row newer than the cache's is installed as the update's row plus the
local steps the update does not include yet (``pending.py``): read-your-writes. A row with a
step in a message whose delivery report has not been read yet is deferred to a later round
(the parameter server only applies acknowledged messages, so the report decides).
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from freshcore import metrics as m
from inference.learning.pending import PendingSteps
from inference.tables.cache import EmbeddingCache
from schemas.rowbatch import KIND_UPDATES, TABLE_NAMES, CorruptBatch, RowBatch

log = logging.getLogger("freshrec.worker")


class UpdateInstaller:
    def __init__(self, cache: EmbeddingCache, pending: PendingSteps, producer) -> None:
        self.cache = cache
        self.pending = pending
        self.producer = producer
        self.deferred: list[tuple[RowBatch, np.ndarray]] = []
        """Update rows awaiting delivery reports of their local steps."""
        self.newest_served_ms = 0
        """The newest event time an installed row includes (the ``served`` stage's reach)."""
        self._newest_served = m.FRESHNESS_EVENT_TIME.labels("served")
        self._warned_at = -math.inf

    def on_update(self, value: bytes) -> None:
        try:
            batch = RowBatch.decode(value)
        except CorruptBatch as exc:
            log.warning("corrupt update batch skipped: %s", exc)
            return
        if batch.kind != KIND_UPDATES:
            return
        name = TABLE_NAMES[batch.table]
        if batch.rows.ndim != 2 or batch.rows.shape[1] != self.cache.w:
            # another deployment's dimension (or a stray producer): every row is unusable
            m.UPDATES_INSTALLED.labels(name, "wrong_width").inc(len(batch.ids))
            self._warn(
                f"update batch of {batch.rows.shape} rows skipped: this worker's rows are {self.cache.w} wide"
            )
            return
        finite = np.isfinite(batch.rows).all(axis=1)
        if not finite.all():
            m.UPDATES_INSTALLED.labels(name, "non_finite").inc(int((~finite).sum()))
            self._warn(f"{int((~finite).sum())} non-finite rows of an update batch skipped")
        self.install(batch, np.flatnonzero(finite))

    def _warn(self, message: str) -> None:
        """A warning at most once a minute: a stray producer must not flood the log."""
        now = time.monotonic()
        if now - self._warned_at >= 60:
            self._warned_at = now
            log.warning(message)

    def install(self, batch: RowBatch, take: np.ndarray) -> None:
        """Install rows ``take`` of an update batch that are newer than the cache's, each with
        the local steps the update does not include added (``pending``): a vectorised step
        for the whole batch."""
        table, name = batch.table, TABLE_NAMES[batch.table]
        slots = self.cache.slots_for_install(table, batch.ids[take].tolist())
        resident = slots >= 0
        waiting = np.zeros(len(take), bool)
        waiting[resident] = self.pending.waiting(table, slots[resident])
        if waiting.any():
            # the update may include a message whose delivery report is not read yet (the
            # parameter server only applies acknowledged messages): serve the reports that
            # are in, and leave the rest of those rows for a later round, not to block here
            self.producer.poll(0)
            waiting[waiting] = self.pending.waiting(table, slots[waiting])
        if waiting.any():
            self.deferred.append((batch, take[waiting]))
            m.UPDATES_INSTALLED.labels(name, "deferred").inc(int(waiting.sum()))
            take, slots, resident = take[~waiting], slots[~waiting], resident[~waiting]
        away = np.flatnonzero(~resident)
        if len(away):  # rows host RAM holds are kept as fresh as the device's
            sel = take[away]
            kept = self.cache.host[table].refresh(
                batch.ids[sel].tolist(),
                batch.rows[sel],
                batch.versions[sel],
                batch.event_ms[sel],
                batch.oldest_ms[sel],
            )
            m.UPDATES_INSTALLED.labels(name, "host").inc(int(kept.sum()))
            m.UPDATES_INSTALLED.labels(name, "not_cached").inc(len(away) - int(kept.sum()))
        versions = batch.versions[take]
        held_versions = self.cache.table(table).version
        newer = resident & (versions > held_versions[np.where(resident, slots, 0)])
        m.UPDATES_INSTALLED.labels(name, "stale").inc(int((resident & ~newer).sum()))
        if not newer.any():
            return
        slots, rows = slots[newer], batch.rows[take[newer]]
        rest, kept = self.pending.install(table, slots, batch.partition, batch.offset)
        if rest is not None:
            rows[kept] += rest[kept]
        times, oldest = batch.event_ms[take[newer]], batch.oldest_ms[take[newer]]
        self.cache.install_many(table, slots, rows, versions[newer], times)
        self.cache.installed(table, slots, oldest, times)
        lag = np.maximum(time.time() - oldest / 1000, 0.0)  # every row, from its oldest event
        m.observe_many(m.FRESHNESS_LAG.labels("served"), lag)
        self.newest_served_ms = max(self.newest_served_ms, int(times.max()))
        self._newest_served.set(self.newest_served_ms / 1000)
        m.UPDATES_INSTALLED.labels(name, "installed").inc(len(rows))

    def install_deferred(self) -> None:
        deferred, self.deferred = self.deferred, []
        for batch, take in deferred:
            self.install(batch, take)
