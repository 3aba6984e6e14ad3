"""The worker's local learning: labelled examples from a slice of events, their gradients,
the step on the cached rows at once, the steps remembered for read-your-writes and the
gradients into the outbox for the parameter server (``learning.py``, ``pending.py``,
``outbox.py``)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np

from freshrec import metrics as m
from inference.cache import EmbeddingCache
from inference.learning import (
    TableSlice,
    counts_and_newest,
    device_local_steps,
    examples_from_events,
    gradients,
    oldest_per_group,
)
from inference.outbox import GradientOutbox
from inference.pending import PendingSteps
from inference.recent import RecentClicks
from inference.settings import WorkerSettings
from schemas.ids import RowIdMemo, row_ids
from schemas.rowbatch import TABLE_ITEM, TABLE_NAMES, TABLE_USER

log = logging.getLogger("freshrec.worker")


class LocalLearner:
    def __init__(
        self,
        settings: WorkerSettings,
        cache: EmbeddingCache,
        pending: PendingSteps,
        outbox: GradientOutbox,
        send_outbox: Callable[[], None],
        catalogue: Callable[[], dict[str, int]],
        stats: dict[str, int],
    ) -> None:
        self.settings = settings
        self.cache, self.pending, self.outbox = cache, pending, outbox
        self.send_outbox = send_outbox
        self.catalogue = catalogue
        """The catalogue's items (id → cache slot): the softmax loss's negatives."""
        self.stats = stats
        self.recent = RecentClicks(settings.recent_users)
        self.seen = RecentClicks(settings.seen_users, settings.seen_per_user)
        self.item_row_ids = RowIdMemo(200_000)  # a catalogue's items come back every slice
        self.rng = np.random.default_rng(abs(hash(settings.worker_id)) % (2**32))
        self.item_pool: list[str] = []
        self._catalogue_pool: list[str] = []
        self._newest_local_ms = 0  # the newest event time learnt, ms
        self._newest_local = m.FRESHNESS_EVENT_TIME.labels("local")
        self._trim_warned_at = -math.inf

    def _now_ms(self) -> int:
        return int(time.time() * 1000)

    def _negatives_pool(self, events) -> list[str]:
        """Where sampled negatives come from: for the logistic loss the items of recent
        examples (popular items more often); for softmax the catalogue, uniformly."""
        if self.settings.learning.labels.loss == "softmax":
            catalogue = self.catalogue()
            if len(catalogue) != len(self._catalogue_pool):
                self._catalogue_pool = list(catalogue)
            if self._catalogue_pool:
                return self._catalogue_pool
        if not self.item_pool:
            self.item_pool = [e.item_id for e in events]
        return self.item_pool

    def learn_events(self, events) -> None:
        self.recent.remember(events)
        self.seen.remember(events)
        pool = self._negatives_pool(events)
        ex = examples_from_events(events, self.settings.learning.labels, self.rng, pool)
        if len(ex.labels) == 0:
            return
        self.learn(ex)
        m.WORKER_EXAMPLES.labels("positive").inc(int(ex.labels.sum()))
        m.WORKER_EXAMPLES.labels("negative").inc(int((ex.labels == 0).sum()))
        self.item_pool = (self.item_pool + ex.items)[-10_000:]
        done = time.time()
        # every example: capped per slice, a burst learnt late would weigh as much as a slice
        lag = np.maximum(done - ex.event_ms / 1000, 0.0)
        m.observe_many(m.FRESHNESS_LAG.labels("local"), lag)
        self._newest_local_ms = max(self._newest_local_ms, int(ex.event_ms.max()))
        self._newest_local.set(self._newest_local_ms / 1000)

    def learn(self, ex) -> None:
        """The local step for a batch of labelled examples, where the tables live (on a GPU
        the one host copy is the gradient batch): gradients, the step on the cached rows at
        once, the steps remembered, the gradients into the outbox."""
        # each table's rows grouped once: for the cache's slots and the gradients' sums
        users = np.unique(row_ids(ex.users), return_inverse=True)
        items = np.unique(self.item_row_ids(ex.items), return_inverse=True)
        user_slots = self.cache.distinct_slots(TABLE_USER, users[0])
        item_slots = self.cache.distinct_slots(TABLE_ITEM, items[0])
        to_device = self.cache.to_device
        us, ui = to_device(user_slots), to_device(users[1])
        its, ii = to_device(item_slots), to_device(items[1])
        user_rows, item_rows = self.cache.users.rows, self.cache.items.rows
        u = user_rows.index_select(0, us.index_select(0, ui))
        v = item_rows.index_select(0, its.index_select(0, ii))
        gu, gv = gradients(u, v, ex, to_device)
        learning = self.settings.learning
        local = device_local_steps(
            [TableSlice(user_rows, us, ui, gu), TableSlice(item_rows, its, ii, gv)],
            [learning.user_lr, learning.lr],
            learning.max_grad_norm,
        )
        now_ms = self._now_ms()
        for table, (distinct, index), key_slots, step in (
            (TABLE_USER, users, user_slots, local[0]),
            (TABLE_ITEM, items, item_slots, local[1]),
        ):
            rejected = int((~step.ok).sum())
            if rejected:
                m.GRADIENT_ROWS.labels(TABLE_NAMES[table], "non_finite").inc(rejected)
            counts, newest = counts_and_newest(index, len(distinct), ex.event_ms)
            oldest = oldest_per_group(index, len(distinct), ex.event_ms)
            steps = self.pending.record(table, key_slots[step.ok], step.deltas)
            held_back = self.outbox.add(
                table,
                distinct[step.ok],
                step.sums,
                counts[step.ok],
                newest[step.ok],
                steps,
                now_ms,
                oldest[step.ok],
            )
            self.cache.learnt(table, key_slots[step.ok], oldest[step.ok], newest[step.ok])
            if held_back:
                m.GRADIENT_ROWS.labels(TABLE_NAMES[table], "held_for_admission").inc(held_back)
        if self.outbox.due(now_ms):
            self.send_outbox()
        if len(self.pending) > learning.max_pending_steps:
            self._trim_pending()

    def _trim_pending(self) -> None:
        """The read-your-writes pool is at its bound (no broadcast has taken steps out of
        it for a while): let the oldest sent steps go, down to 90% of it, so that this
        happens once in many slices."""
        most = self.settings.learning.max_pending_steps
        held = len(self.pending)
        let_go = self.pending.trim(most * 9 // 10)
        m.PENDING_STEPS_LET_GO.inc(let_go)
        self.stats["pending_let_go"] += let_go
        now = time.monotonic()
        if now - self._trim_warned_at > 60:
            self._trim_warned_at = now
            log.warning(
                "read-your-writes pool at its bound (%d local steps, FRESHREC_MAX_PENDING_STEPS"
                " %d): let the oldest %d go; is the parameter server running and broadcasting?",
                held,
                most,
                let_go,
            )
