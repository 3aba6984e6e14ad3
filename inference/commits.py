"""What the worker commits, and when.

Two kinds of offsets share the worker's group consumer: learnt events, committed once the
broker holds the gradients learnt from them (``OffsetGate``: a crash between producing
gradients and their delivery must not leave their events committed), and requests, committed
once answered, never past an earlier request of their partition that is still open
(``RequestOffsets``). A commit round gathers both and commits what moved.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from confluent_kafka import TopicPartition

from inference.offsets import OffsetGate, RequestOffsets

log = logging.getLogger("freshrec.worker")


class OffsetCommitter:
    def __init__(
        self,
        consumer,
        events_topic: str,
        requests_topic: str,
        gate: OffsetGate,
        requests: RequestOffsets,
    ) -> None:
        self.consumer = consumer
        self.events_topic = events_topic
        self.requests_topic = requests_topic
        self.gate = gate
        self.requests = requests
        self.processed: dict[tuple[str, int], int] = {}
        """Offsets to commit: requests answered, events whose gradients the broker holds."""
        self.committed: dict[tuple[str, int], int] = {}

    def commit(self, sync: bool = False) -> None:
        """Commit what is done (the caller has produced what waits in the outbox first)."""
        for key, offset in self.gate.ready().items():
            self.processed[key] = max(self.processed.get(key, 0), offset)
        for partition, offset in self.requests.committable().items():
            key = (self.requests_topic, partition)
            self.processed[key] = max(self.processed.get(key, 0), offset)
        changed = [
            TopicPartition(t, p, o)
            for (t, p), o in self.processed.items()
            if self.committed.get((t, p)) != o
        ]
        if not changed:
            return
        try:
            self.consumer.commit(offsets=changed, asynchronous=not sync)
        except Exception as exc:  # e.g. during a rebalance; retried on the next round
            log.debug("commit failed: %s", exc)
            return
        for tp in changed:
            self.committed[(tp.topic, tp.partition)] = tp.offset

    def forget(self, gone: Iterable[tuple[str, int]]) -> None:
        """Partitions revoked: their offsets are the next owner's. Events learnt whose
        gradients are still undelivered are relearnt there."""
        gone = set(gone)
        for key in gone:
            self.processed.pop(key, None)
            self.committed.pop(key, None)
        self.gate.forget(gone)
