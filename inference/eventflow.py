"""When the worker's event partitions are paused and resumed: the thin I/O around
``inference.batching.PrefetchPurge`` and the backlog's high-water mark, with a counter of
each pause by reason (docs/serving.md, "Inside the worker")."""

from __future__ import annotations

from confluent_kafka import TopicPartition

from freshcore import metrics as m
from inference.batching import PrefetchPurge


class EventFlow:
    """Pauses ``topic``'s assigned partitions on ``consumer`` when the worker's own backlog
    passes its high mark (``backlog``) or while its consumes come back full, every
    ``purge_every_s`` (``prefetch``: drops the client's prefetched events so a request behind
    them is fetched); resumes them once the backlog is under ``batch_max`` and a prefetch
    pause has lasted its hold. ``freshrec_worker_event_pauses_total{reason}`` counts the
    pauses: steady ``prefetch`` pauses say events arrive faster than the worker learns them
    (or a backlog is being worked off)."""

    def __init__(self, consumer, topic: str, batch_max: int, purge_every_s: float) -> None:
        self.consumer = consumer
        self.topic = topic
        self.batch_max = batch_max
        self.purge = PrefetchPurge(purge_every_s)
        self.paused: list[TopicPartition] = []
        self._pauses = {r: m.WORKER_EVENT_PAUSES.labels(r) for r in ("backlog", "prefetch")}

    def adjust(self, backlog: int, slice_size: int, full: bool, now: float) -> None:
        """After a loop round: ``backlog`` events held, the next slice ``slice_size``, this
        round's consume ``full`` (it got all it asked for: more may wait), at ``now``
        (monotonic seconds)."""
        if self.paused:
            if backlog < self.batch_max and self.purge.may_resume(now):
                self.consumer.resume(self.paused)
                self.paused = []
                self.purge.resumed(now)
            return
        high = max(4 * self.batch_max, 2 * slice_size)
        if self.purge.due(full, now) or backlog > high:
            parts = [tp for tp in self.consumer.assignment() if tp.topic == self.topic]
            if parts:
                self.consumer.pause(parts)
                self.paused = parts
                self._pauses["backlog" if backlog > high else "prefetch"].inc()

    def forget(self, gone: set[tuple[str, int]] | None = None) -> None:
        """The partitions ``gone`` (topic, partition; None: every one) were revoked: those
        this paused are not assigned any more (assigned again, a partition starts unpaused).
        The rest stay paused and are resumed as before: under an incremental protocol
        (KIP-848) a member keeps them through the rebalance, paused."""
        if gone is None:
            self.paused = []
        else:
            self.paused = [tp for tp in self.paused if (tp.topic, tp.partition) not in gone]
