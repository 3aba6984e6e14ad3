"""The sender behind the gradient outbox: batches to the ``gradients`` topic, delivery reports
back into the read-your-writes pool and the offset gate.

Each ``GradientBatch`` (``outbox.py``) becomes one message, a compact ``RowBatch`` keyed by
its first row and produced to its partition. The message gets a token: its local steps are
assigned to it (``PendingSteps.assign``), and the offset gate (``offsets.py``) counts it as
produced. Its delivery report settles both: the steps learn the offset the message landed at
(an update that includes it then drops them), and the gate may release the events behind it.
"""

from __future__ import annotations

import itertools
import logging

import numpy as np

from freshrec import metrics as m
from freshrec.kafka import produce
from inference.cache import EmbeddingCache
from inference.offsets import OffsetGate
from inference.outbox import GradientBatch
from inference.pending import PendingSteps
from schemas.rowbatch import KIND_GRADIENTS, TABLE_NAMES, RowBatch
from schemas.rows import row_key

log = logging.getLogger("freshrec.worker")


class GradientSender:
    def __init__(
        self,
        producer,
        topic: str,
        pending: PendingSteps,
        gate: OffsetGate,
        cache: EmbeddingCache,
    ) -> None:
        self.producer = producer
        self.topic = topic
        self.pending = pending
        self.gate = gate
        self.cache = cache
        self.tokens = itertools.count(1)

    def send(self, batches: list[GradientBatch], created_ms: int) -> None:
        for b in batches:
            token = next(self.tokens)
            self.pending.assign(b.steps, token)
            message = RowBatch(
                KIND_GRADIENTS,
                b.table,
                b.ids,
                b.sums.astype(np.float32, copy=False),
                b.counts.astype(np.uint64),
                b.newest_ms,
                created_ms=created_ms,
            )
            name = TABLE_NAMES[b.table]
            self.gate.produced(token)
            produce(
                self.producer,
                self.topic,
                message.encode(),
                row_key(int(b.ids[0])),
                partition=b.partition,
                on_delivery=self._delivered(token, name, len(b.ids)),
            )
            m.GRADIENT_ROWS.labels(name, "sent").inc(len(b.ids))
            m.GRADIENT_MESSAGES.labels("sent").inc()

    def _delivered(self, token: int, table_name: str, rows: int):
        def callback(err, msg) -> None:
            self.gate.reported(token)
            if err is not None:
                log.warning("gradient message lost (%d %s rows): %s", rows, table_name, err)
                m.GRADIENT_MESSAGES.labels("lost").inc()
                m.GRADIENT_ROWS.labels(table_name, "lost").inc(rows)
                self.pending.failed(token)
                return
            for table, slots, deltas in self.pending.delivered(
                token, msg.partition(), msg.offset()
            ):
                self.cache.add(table, slots, (-deltas).astype(np.float32))

        return callback
