"""The worker's local learning: labelled examples from a slice of events, their gradients,
the step on the cached rows at once, the steps remembered for read-your-writes and the
gradients into the outbox for the parameter server (``learning.py``, ``pending.py``,
``outbox.py``)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from freshcore import clock
from freshcore import metrics as m
from freshcore.settings import LEARNING_RATE
from inference.device import release_cached, to_host
from inference.learning.outbox import GradientOutbox
from inference.learning.pending import PendingSteps
from inference.learning.steps import (
    LabelConfig,
    LocalStep,
    TableSlice,
    counts_and_newest,
    device_local_steps,
    examples_from_events,
    gradients,
    halves,
    oldest_per_group,
)
from inference.tables.cache import EmbeddingCache
from inference.tables.recent import RecentClicks
from schemas.ids import RowIdMemo, row_ids
from schemas.rowbatch import TABLE_ITEM, TABLE_NAMES, TABLE_USER

log = logging.getLogger("freshrec.worker")


@dataclass(frozen=True)
class LearningSettings:
    dim: int = 64
    lr: float = LEARNING_RATE
    """Local step size of item rows, v ← v − lr·g (``freshcore.settings.LEARNING_RATE``)."""
    user_lr: float = LEARNING_RATE
    """Local step size of user rows. A user's row is touched only by that user's events, an
    item's by everyone's: on positive-only logs users want the larger step (0.5 for models
    trained by ``freshrec train --log``, which record it in their manifest)."""
    max_grad_norm: float = 1.0
    admission_touches: int = 1
    """A row's gradients go to the parameter server from its Nth touch on (Monolith's
    occurrence filter); before that its steps stay local and are sent on admission."""
    admission_window_s: int = 3600
    """Touch counts of rows unseen for this long are forgotten (``inference/learning/admission.py``)."""
    gradient_linger_ms: int = 100
    """Admitted gradients wait up to this long and leave summed per row, one message per
    table and partition (0: one set of messages per learnt slice). Local steps apply at
    once; only the parameter server sees them later. 100 ms, the parameter server's flush
    interval: on the embedded broker, whose every fetch costs in proportion to the record
    batches its partitions hold, 20 ms left the worker's local lag p99 at ~90 ms at 5,000
    events/s, 100 ms at ~50 (served p50 +30 ms; docs/benchmarks.md)."""
    max_pending_steps: int = 1_000_000
    """Bound of the read-your-writes pool (~316 bytes a step at 64 dimensions: ~0.3 GB).
    Steps leave the pool as broadcast updates include them; while the parameter server is
    down or far behind they pile up, and past this bound the oldest sent ones are let go
    (``PendingSteps.trim``, docs/online-learning.md): learning goes on, and a row may miss
    such a step between an update that lacks it and one that includes it."""
    labels: LabelConfig = field(default_factory=LabelConfig)


def step_on_device(cache, users, items, ex, learning: LearningSettings) -> list[LocalStep]:
    """A slice's step where the tables live: ``users`` and ``items`` are each (the distinct
    slots the slice touches, each example's position among them), host arrays copied to the
    tables' device. The rows are gathered and widened to float32 (float16 tables), the
    gradients of ``ex``'s loss taken, and each table's step applied (``device_local_steps``:
    the one copy to the host). Returns the user table's step, then the item table's."""
    us, ui, its, ii = (cache.to_device(a) for a in (*users, *items))
    user_rows, item_rows = cache.users.rows, cache.items.rows
    u = user_rows.index_select(0, us.index_select(0, ui)).float()
    v = item_rows.index_select(0, its.index_select(0, ii)).float()
    gu, gv = gradients(u, v, ex, cache.to_device)
    return device_local_steps(
        [TableSlice(user_rows, us, ui, gu), TableSlice(item_rows, its, ii, gv)],
        [learning.user_lr, learning.lr],
        learning.max_grad_norm,
    )


def step_on_host(cache, users, items, ex, learning: LearningSettings) -> list[LocalStep]:
    """``step_on_device`` for a part of a slice the device has no memory for (an example, or
    one softmax group): its rows copied to the host one at a time, which takes no device
    memory, the step taken there, and the rows written back the same way."""
    tables = ((cache.users.rows, *users), (cache.items.rows, *items))
    held = [
        torch.from_numpy(np.stack([to_host(rows[s]) for s in slots.tolist()])).float()
        for rows, slots, _ in tables
    ]
    at = [torch.from_numpy(np.asarray(index, np.int64)) for _, _, index in tables]
    u, v = held[0].index_select(0, at[0]), held[1].index_select(0, at[1])
    gu, gv = gradients(u, v, ex, lambda a: torch.from_numpy(np.ascontiguousarray(a)))
    local = device_local_steps(
        [
            TableSlice(rows, torch.arange(len(rows)), index, g)
            for rows, index, g in zip(held, at, (gu, gv), strict=True)
        ],
        [learning.user_lr, learning.lr],
        learning.max_grad_norm,
    )
    for (rows, slots, _), stepped in zip(tables, held, strict=True):
        for s, row in zip(slots.tolist(), stepped, strict=True):
            rows[s].copy_(row)
    return local


class LocalLearner:
    def __init__(
        self,
        learning: LearningSettings,
        cache: EmbeddingCache,
        pending: PendingSteps,
        outbox: GradientOutbox,
        recent: RecentClicks,
        seen: RecentClicks,
        catalogue: Callable[[], dict[str, int]],
        stats: dict[str, int],
        seed: int = 0,
    ) -> None:
        self.learning = learning
        self.cache, self.pending, self.outbox = cache, pending, outbox
        self.recent, self.seen = recent, seen
        """Each user's last clicks (the i2i channel's and the rankers' inputs) and what they
        consumed (excluded from their lists): remembered here, read by serving."""
        self.catalogue = catalogue
        """The catalogue's items (id → cache slot): the softmax loss's negatives."""
        self.stats = stats
        self.item_row_ids = RowIdMemo(200_000)  # a catalogue's items come back every slice
        self.rng = np.random.default_rng(seed)
        self.item_pool: list[str] = []
        self._catalogue_pool: list[str] = []
        self._newest_local_ms = 0  # the newest event time learnt, ms
        self._newest_local = m.FRESHNESS_EVENT_TIME.labels("local")
        self._trim_warned_at = -math.inf

    def _negatives_pool(self, events) -> list[str]:
        """Where sampled negatives come from: for the logistic loss the items of recent
        examples (popular items more often); for softmax the catalogue, uniformly."""
        if self.learning.labels.loss == "softmax":
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
        ex = examples_from_events(events, self.learning.labels, self.rng, pool)
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
        once, the steps remembered, the gradients into the outbox. A slice the device has no
        memory for is learnt in halves (``_learn_in_parts``)."""
        try:
            self._learn(ex, step_on_device)
        except torch.OutOfMemoryError:
            on_host = self._learn_in_parts(ex)
            log.warning(
                "learning: out of device memory for a slice of %d examples: learnt in parts,"
                " %d of them on the host",
                len(ex.labels),
                on_host,
            )

    def _learn_in_parts(self, ex) -> int:
        """After the device had no memory for ``ex``: its halves learnt, each the same way,
        down to parts that cannot be split (an example, a softmax group), stepped on the host
        (``step_on_host``). A slice that ran out changed no row (``device_local_steps``).
        Returns how many parts were stepped on the host."""
        m.DEVICE_OOM.labels("learning").inc()
        release_cached(self.cache.device)
        parts = halves(ex)
        if parts is None:
            self._learn(ex, step_on_host)
            return 1
        on_host = 0
        for part in parts:
            try:
                self._learn(part, step_on_device)
            except torch.OutOfMemoryError:
                on_host += self._learn_in_parts(part)
        return on_host

    def _learn(self, ex, step: Callable[..., list[LocalStep]]) -> None:
        """``learn``, the slice's step taken by ``step`` (``step_on_device`` or
        ``step_on_host``)."""
        # each table's rows grouped once: for the cache's slots and the gradients' sums
        users = np.unique(row_ids(ex.users), return_inverse=True)
        items = np.unique(self.item_row_ids(ex.items), return_inverse=True)
        user_slots = self.cache.distinct_slots(TABLE_USER, users[0])
        item_slots = self.cache.distinct_slots(TABLE_ITEM, items[0])
        learning = self.learning
        local = step(self.cache, (user_slots, users[1]), (item_slots, items[1]), ex, learning)
        now_ms = clock.now_ms()
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
        if len(self.pending) > learning.max_pending_steps:
            self._trim_pending()

    def _trim_pending(self) -> None:
        """The read-your-writes pool is at its bound (no broadcast has taken steps out of
        it for a while): let the oldest sent steps go, down to 90% of it, so that this
        happens once in many slices."""
        most = self.learning.max_pending_steps
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
