"""``freshrec worker``: the inference worker — online learning and serving in one loop.

One confluent-kafka consumer in one group reads ``events`` and ``recommend.requests`` (range
assignor: a worker owns the same partition numbers of both, so a user's clicks and that user's
next request meet in one process and one EmbeddingCache). A second, group-less consumer reads
every partition of ``embeddings.updates``.

A round of the loop (``poll_once``), in its phases (``freshrec_worker_loop_seconds{phase}``):

1. consume: requests go to the intake (``intake.py``), events to a backlog;
2. serve: every batch of requests the batching policy says is ready;
3. learn: one slice of the backlog (``batching.EventSlicer`` sizes it to a time budget):
   decode, drop event ids already seen in the partition's window, label, gradients, the
   local step on the cached rows at once (``learner.py``, ``learning.py``), the steps
   remembered (``pending.py``), the gradients into the outbox (``outbox.py``), which leaves
   for the parameter server when its linger runs out (``gradients.py``);
4. updates: broadcast rows installed with the local steps they lack (``updates.py``);
5. other: flow control (``eventflow.py``: past a high-water mark, and every second while
   consumes come back full, the event partitions pause, so requests keep flowing whatever
   the event backlog), offset commits (``commits.py``), housekeeping.

Requests go before events. Offsets are committed explicitly: an event's once the broker holds
its gradients, a request's once its reply is delivered.

The worker's connections (``WorkerClients``) are built at the edge and passed in, so a test
about its logic can hand it doubles; the real-broker tests pass the real ones. Its parts are
built in dependency order by ``inference/assembly.py``, each given what it needs then: none
calls back into the worker, and a serving mode switches each part through its own ``use``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import numpy as np
import redis
import torch
from confluent_kafka import (
    OFFSET_BEGINNING,
    TIMESTAMP_NOT_AVAILABLE,
    KafkaError,
    Message,
    TopicPartition,
)

from freshcore import metrics as m
from freshcore.clock import now_ms
from freshcore.dedupe import DedupeWindow
from freshcore.kafka import close_producer, consume_available, partition_count
from freshcore.lifecycle import run_until_signalled, settle_heap
from freshcore.resets import count_resets
from freshcore.rowstore import broadcast_offsets, load_table, row_shards
from freshcore.service import Service
from inference.assembly import build_parts
from inference.batching import EventSlicer
from inference.clients import WorkerClients
from inference.device import device_memory
from inference.eventflow import EventFlow
from inference.serving.breaker import CLOSED, HALF_OPEN
from inference.settings import WorkerSettings
from inference.tables.bounds import evict_items, expire_items
from schemas.codec import decode_events
from schemas.contract import Rejected
from schemas.ids import row_id
from schemas.rowbatch import TABLE_ITEM, TABLE_USER

log = logging.getLogger("freshrec.worker")
LOOP_PHASES = ("consume", "serve", "learn", "updates", "other")
"""The phases of a loop round, in order (``freshrec_worker_loop_seconds{phase}``)."""


class Worker(Service):
    name = "worker"
    """Learning and serving on one thread; ``run`` loops ``poll_once`` until stopped."""

    def __init__(self, settings: WorkerSettings, clients: WorkerClients | None = None) -> None:
        """The worker over ``clients`` (connected from ``settings`` where none are given),
        its parts built in dependency order (``inference/assembly.py``)."""
        self.settings = settings
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        clients = clients or WorkerClients.connect(settings)
        self.redis, self.producer = clients.redis, clients.producer
        self.events, self.updates = clients.events, clients.updates
        parts = build_parts(settings, clients)
        self.names, self.keys, self.stats = parts.names, parts.keys, parts.stats
        self.pending, self.gate, self.outbox = parts.pending, parts.gate, parts.outbox
        self.cache, self.sender, self.installer = parts.cache, parts.sender, parts.installer
        self.recent, self.seen = parts.recent, parts.seen
        self.snapshots, self.models = parts.snapshots, parts.models
        self.experiment, self.recommender = parts.experiment, parts.recommender
        self.learner, self.intake = parts.learner, parts.intake
        self.mode, self.commits = parts.mode, parts.commits
        self.dim = settings.learning.dim
        # the loop's own: the event backlog, its slices and flow control, its timers
        self.dedupe: dict[int, DedupeWindow] = {}  # per events partition
        self._loop_phases = [m.WORKER_LOOP_SECONDS.labels(phase) for phase in LOOP_PHASES]
        self._last_commit = time.monotonic()
        most = settings.event_slice
        self.slicer = EventSlicer(
            settings.event_slice_ms,
            settings.event_slice_idle_ms,
            min(64, most),
            most,
            min(256, most),
        )
        self.backlog: deque[Message] = deque()
        self.flow = EventFlow(
            self.events, self.names.events, settings.batch_max, settings.prefetch_purge_ms / 1000
        )
        self._events_retry_at = 0.0
        self._housekeeping_at = 0.0
        self._expired_at = time.monotonic()
        self.assigned = 0

    # ------------------------------------------------------------------------------ setup
    def _start_reads(self) -> tuple:  # the broadcast's positions before the table it follows
        shards = row_shards(self.redis, self.keys, self.outbox.partitions)
        positions = broadcast_offsets(self.redis, self.keys)
        return positions, load_table(self.redis, self.keys, TABLE_ITEM, self.dim + 1, shards)

    def start(self) -> None:
        """Load the item table, then follow the broadcast from before that load; load the
        models and the serving snapshot; join the group."""
        if self.experiment:
            self.experiment.load()  # a bad file stops the worker here, with the line at fault
        positions, items = self.wait_for_redis(self._start_reads, "starting")
        self.cache.load_items(items)
        if self.models.load_now() is None:  # a set loaded is counted (``count_models``)
            log.warning(
                "no ranking models (%s): serving from the hot list until `freshrec train` "
                "writes them",
                self.models.last_error,
            )
        self.snapshots.start()
        self.recommender.adopt_snapshot()
        n = partition_count(self.producer, self.names.embeddings_updates)
        self.updates.assign(
            [
                TopicPartition(self.names.embeddings_updates, p, positions.get(p, OFFSET_BEGINNING))
                for p in range(n)
            ]
            + self.mode.partitions(self.producer, self.names.control)
        )
        self.events.subscribe(
            [self.names.events, self.names.recommend_requests],
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_revoke,
        )
        del items
        log.info(
            "worker %s: %d item rows, device %s, broadcast from %s, %d objects settled",
            self.settings.worker_id,
            len(self.cache.item_ids),
            self.cache.device,
            positions or "the beginning",
            settle_heap(),
        )

    def close(self, clean: bool = True) -> None:
        """Stop, deliver and commit what is done (every commit waits for its work, clean or
        not: the offset gates decide), then release the connections."""
        self.snapshots.stop()
        self.recommender.runner.close()
        self.send_outbox()
        self.producer.flush(10)
        self.intake.save_answered()
        self.commit(sync=True)
        self.events.close()
        self.updates.close()
        self.redis.close()
        close_producer(self.producer, 10)

    # ------------------------------------------------------------------------------- loop
    def poll_once(self) -> None:
        t0 = time.perf_counter()
        size = self._consume_size()
        msgs = consume_available(self.events, size, self._poll_timeout_s())
        t1 = time.perf_counter()
        topic = self.names.events
        events = [msg for msg in msgs if msg.error() is None and msg.topic() == topic]
        if len(events) < len(msgs):  # requests and errors, one by one
            for msg in msgs:
                if not self._ok(msg) or msg.topic() == topic:
                    continue
                self.slicer.request_seen(time.monotonic())
                self.intake.accept(msg)
        self.backlog.extend(events)
        # every event: a burst weighs what it holds
        stamps = [t for k, t in map(Message.timestamp, events) if k != TIMESTAMP_NOT_AVAILABLE]
        if stamps:
            m.observe_many(
                m.WORKER_FETCH_LAG, np.maximum(time.time() - np.asarray(stamps) / 1000, 0)
            )
        self.intake.serve_ready()
        self.intake.retry_failed()
        self.sender.retry_due(time.monotonic())
        t2 = time.perf_counter()
        self._learn_slice()
        self._send_if_due()
        t3 = time.perf_counter()
        for msg in self.updates.consume(1000, 0):
            if not self._ok(msg):
                continue
            if msg.topic() == self.names.control:
                self.mode.on_record(msg.value())
            else:
                self.installer.on_update(msg.value())
        self.producer.poll(0)
        if self.installer.deferred:
            self.installer.install_deferred()
        t4 = time.perf_counter()
        now = time.monotonic()
        self.flow.adjust(len(self.backlog), self.slicer.size(now), len(msgs) >= size, now)
        self.intake.save_answered()  # right away: it narrows the window for a duplicate answer
        if now - self._last_commit > self.settings.commit_interval_s:
            self.commit()
            self._last_commit = now
        if now - self._housekeeping_at > 1.0:
            self._housekeeping_at = now
            self._housekeeping(now)
        m.PENDING_STEPS.set(len(self.pending))
        m.EVENT_BACKLOG.set(len(self.backlog))
        phases = self._loop_phases
        for child, seconds in zip(
            phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, time.perf_counter() - t4), strict=True
        ):
            child.observe(seconds)

    def _housekeeping(self, now: float) -> None:
        self.forget_unadmitted(now_ms())
        ttl = self.settings.row_ttl_s
        if ttl and now - self._expired_at > min(60.0, max(1.0, ttl / 10)):
            self._expired_at = now
            self.expire_items(now_ms())
        if self.cache.item_rows > self.settings.max_item_rows:
            self.evict_items()
        self.models.poll()
        for kind, value in device_memory(self.cache.device).items():
            m.DEVICE_MEMORY.labels(kind).set(value)
        if self.experiment:
            self.experiment.poll(now)
        self.recommender.adopt_snapshot()  # also when idle: the catalogue gauge stays true
        self.recommender.maybe_rebuild_index()
        for name, state in self.recommender.runner.breaker_states().items():
            m.BREAKER_STATE.labels(name).set(
                0 if state == CLOSED else 1 if state == HALF_OPEN else 2
            )

    def _consume_size(self) -> int:
        """At least ``batch_max`` messages, and enough to fill the next slice: a backlog
        refilled ``batch_max`` at a time held every slice to that size whatever its budget
        (slices of 2,000 events cost ~7.5 µs an event, of 16,000 ~5.3: the fixed costs of a
        slice, and rows named again within one, summed once)."""
        return max(self.settings.batch_max, self.slicer.size(time.monotonic()) - len(self.backlog))

    def _poll_timeout_s(self) -> float:
        wait_ms = self.intake.wait_ms()
        if wait_ms is not None:
            return 0.0 if self.backlog else wait_ms / 1000
        if self.backlog and time.monotonic() >= self._events_retry_at:
            return 0.0
        return self.settings.poll_timeout_ms / 1000

    # ------------------------------------------------------------------ events, offsets
    def _learn_slice(self) -> None:
        if not self.backlog or time.monotonic() < self._events_retry_at:
            return
        n = min(len(self.backlog), self.slicer.size(time.monotonic()))
        if n == len(self.backlog):
            chunk = list(self.backlog)
            self.backlog.clear()
        else:
            chunk = [self.backlog.popleft() for _ in range(n)]
        started = time.perf_counter()
        try:
            self.on_events(chunk)
            self.slicer.observe(n, time.perf_counter() - started)
        except redis.RedisError as exc:
            # rows could not be loaded: keep the events, serve on, try again shortly
            log.warning("learning paused, Redis unavailable: %s", exc)
            self.backlog.extendleft(reversed(chunk))
            self._events_retry_at = time.monotonic() + 1.0
            return
        topic = self.names.events
        for partition, msg in {msg.partition(): msg for msg in chunk}.items():  # its last
            self.gate.learnt((topic, partition), msg.offset() + 1)
        if not self.outbox.rows:  # nothing waits in the outbox: all of it is produced
            self.gate.seal()

    def _send_if_due(self) -> None:
        """The one place that asks the outbox whether it is due (its linger ran out, or its
        rows passed their bound) and sends it then."""
        if self.outbox.due(now_ms()):
            self.send_outbox()

    def send_outbox(self) -> None:
        """Everything the outbox holds leaves now; what was learnt so far then has its
        gradients produced (the gate is sealed)."""
        if self.outbox.rows:
            self.sender.send(self.outbox.drain(), now_ms())
        self.gate.seal()

    def commit(self, sync: bool = False) -> None:
        """Commit what is done: answered requests, and learnt events whose gradient messages
        the broker has acknowledged (``OffsetGate``)."""
        if self.outbox.rows:
            self.send_outbox()  # which seals what was learnt: its gradients are produced
        self.commits.commit(sync)

    def _on_assign(self, consumer, parts) -> None:
        """Partitions added: under the classic protocol the whole assignment (a revoke of
        everything came first), under KIP-848's only the new ones, beside those kept. Those
        whose committed offset retention has deleted resume at their log start, counted."""
        count_resets(consumer, "workers", parts)
        self.assigned += len(parts)
        m.ASSIGNED_PARTITIONS.labels("worker").set(self.assigned)

    def _on_revoke(self, consumer, parts) -> None:
        """Before the partitions go: deliver what was produced for them and commit it. What
        the broker still does not have after ``revoke_flush_s`` is taken back (purged from
        the producer's queue, gradients withdrawn from the rows): the next owner answers
        those requests and learns those events again, and nothing is applied twice. Only a
        message in flight to the broker then (sent, not acknowledged) cannot be taken back;
        ``freshrec_gradient_messages_total{side="unsettled_at_revoke"}`` counts them."""
        gone = {(tp.topic, tp.partition) for tp in parts}
        self.send_outbox()
        self.producer.flush(self.settings.revoke_flush_s)
        if len(self.producer):
            self.producer.purge(in_queue=True, in_flight=False)
            self.producer.poll(0)  # the purged messages' reports: steps withdrawn
            self.producer.flush(self.settings.revoke_flush_s)
            left = len(self.producer)
            if left:
                log.warning("revoke: %d messages still unacknowledged by the broker", left)
                m.GRADIENT_MESSAGES.labels("unsettled_at_revoke").inc(left)
        self.sender.withdraw_retries()
        self.commit(sync=True)
        self.backlog = deque(m_ for m_ in self.backlog if (m_.topic(), m_.partition()) not in gone)
        self.intake.revoke(p for t, p in gone if t == self.names.recommend_requests)
        self.commits.forget(gone)  # gradients undelivered after the flush: the next owner relearns
        for t, p in gone:
            if t == self.names.events:
                self.dedupe.pop(p, None)
        self.flow.forget(gone)
        self.assigned = max(0, self.assigned - len(gone))
        m.ASSIGNED_PARTITIONS.labels("worker").set(self.assigned)

    @staticmethod
    def _ok(msg) -> bool:
        err = msg.error()
        if err is None:
            return True
        if err.code() != KafkaError._PARTITION_EOF:
            log.warning("consumer error: %s", err)
        return False

    # ----------------------------------------------------------------------------- events
    def on_events(self, msgs) -> None:
        now = now_ms()
        events, partitions = [], []
        replays = 0
        for msg, e in zip(msgs, decode_events([msg.value() for msg in msgs], now), strict=True):
            if type(e) is Rejected:
                log.debug("skipping invalid event: %s", e)
            elif self._first_time(msg.partition(), e.event_id):
                events.append(e)
                partitions.append(msg.partition())
            else:
                replays += 1
        if events:
            try:
                self._learn_events(events)
            except redis.RedisError:  # the slice is retried, then counted: not a duplicate
                for partition, e in zip(partitions, events, strict=True):
                    self.dedupe[partition].forget([e.event_id])
                raise
        feedback = self.intake.feedback.count((e.event_type, e.request_id) for e in events)
        for (kind, tier), n in feedback.items():
            m.FEEDBACK.labels(kind, tier).inc(n)
        invalid = len(msgs) - len(events) - replays
        if invalid:
            m.WORKER_EVENTS.labels("invalid").inc(invalid)
            self.stats["invalid"] += invalid
        if replays:
            m.WORKER_EVENTS.labels("duplicate").inc(replays)
            self.stats["duplicates"] += replays
        m.WORKER_EVENTS.labels("valid").inc(len(events))
        self.stats["events"] += len(events)

    def _first_time(self, partition: int, event_id: str) -> bool:
        """An event id not seen in this partition's window (``FRESHREC_DEDUPE_WINDOW`` ids):
        a redelivered or duplicated event is learnt once. The window starts empty when the
        partition is assigned, so what a previous owner learnt after its last commit is
        learnt again (at least once)."""
        window = self.dedupe.get(partition)
        if window is None:
            window = self.dedupe[partition] = DedupeWindow(self.settings.dedupe_window)
        return window.first_time(event_id)

    def _learn_events(self, events) -> None:
        self.learner.learn_events(events)
        self._send_if_due()

    def learn(self, ex) -> None:
        """The local step for a batch of labelled examples (``LocalLearner.learn``)."""
        self.learner.learn(ex)
        self._send_if_due()

    def expire_items(self, now_ms: int) -> int:
        """``inference/tables/bounds.py``'s ``expire_items`` on this worker's item table."""
        return expire_items(self.cache, self._catalogue_slots(), self.settings.row_ttl_s, now_ms)

    def evict_items(self) -> int:
        """``inference/tables/bounds.py``'s ``evict_items`` on this worker's item table."""
        return evict_items(self.cache, self._catalogue_slots(), self.settings.max_item_rows)

    def _catalogue_slots(self) -> np.ndarray:
        """Per item slot, whether the catalogue lists it (such rows never leave)."""
        return self.recommender.named.cpu().numpy()

    def forget_unadmitted(self, now_ms: int) -> None:
        """Rows unseen for a whole admission window are forgotten with the gradients they
        held back, and with those gradients' local steps: they will never reach the
        parameter server, and would otherwise stay in the step pool for good (the cached row
        keeps them until a broadcast of the row, if one ever comes, replaces it)."""
        for table, steps in self.outbox.forget_unadmitted(now_ms).items():
            self.pending.drop_unsent(table, steps)

    # ------------------------------------------------------------------------ inspection
    def user_row(self, user_id: str) -> np.ndarray:
        slot = self.cache.slots(TABLE_USER, np.array([row_id(user_id)]))
        return self.cache.gather(TABLE_USER, slot)[0]

    def item_row(self, item_id: str) -> np.ndarray:
        slot = self.cache.slots(TABLE_ITEM, np.array([row_id(item_id)]))
        return self.cache.gather(TABLE_ITEM, slot)[0]


def run_worker(settings: WorkerSettings) -> int:
    def work(stop: threading.Event) -> None:
        Worker(settings, WorkerClients.connect(settings)).run(stop)

    return run_until_signalled("worker", work, settings.metrics_port, settings.conn.redis_url)
