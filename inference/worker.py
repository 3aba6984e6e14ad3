"""``freshrec worker``: the inference worker — online learning and serving in one loop.

One confluent-kafka consumer in one group reads ``events`` and ``recommend.requests`` (range
assignor: a worker owns the same partition numbers of both, so a user's clicks and that user's
next request meet in one process and one EmbeddingCache). A second, group-less consumer reads
every partition of ``embeddings.updates``.

Requests go before events: consumed events wait in a backlog that is learnt in short slices
between request batches; past a high-water mark the event partitions are paused (librdkafka
drops their prefetched messages and resumes after the last one handed out), so requests keep
flowing whatever the event backlog. Offsets are committed explicitly: an event's once it is
learnt, a request's once its reply is delivered.

Per batch of events: decode (invalid ones are skipped and counted; the streams app writes the
dead letters), build labelled examples, compute logistic-loss gradients for user and item
rows, clip them, apply u ← u − lr·g to the cached rows at once, and send the gradients to the
parameter server in compact binary batches (one per table and ``gradients`` partition). The
local steps are remembered (``pending.py``) until a broadcast update includes them.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import OrderedDict, defaultdict, deque
from typing import Any

import numpy as np
import redis
import torch
from confluent_kafka import (
    OFFSET_BEGINNING,
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    KafkaError,
    Message,
    Producer,
    TopicPartition,
)

from freshrec import metrics as m
from freshrec.gradients import clip_rows, finite_rows
from freshrec.kafka import (
    close_producer,
    consume_available,
    consumer_config,
    lag_statistics,
    producer_config,
    profile,
)
from freshrec.lifecycle import run_until_signalled, settle_heap
from freshrec.partitioner import row_partitions
from freshrec.rediskeys import RedisKeys
from freshrec.rowstore import broadcast_offsets, fetch_rows, load_table
from freshrec.topics import TopicNames
from inference.admission import AdmissionFilter
from inference.batching import BatchPolicy, EventSlicer, split_expired
from inference.breaker import CLOSED, HALF_OPEN
from inference.cache import EmbeddingCache, pick_device
from inference.learning import (
    aggregate,
    aggregate_groups,
    examples_from_events,
    logistic_gradients,
)
from inference.modelfile import ModelWatcher
from inference.offsets import OffsetGate, RequestOffsets
from inference.pending import PendingSteps
from inference.recall import RecallRunner
from inference.serving import IN_MEMORY_CHANNELS, Inbound, Recommender
from inference.settings import WorkerSettings
from inference.snapshot import SnapshotRefresher
from schemas.codec import (
    dead_letter,
    decode_events,
    decode_request,
    encode_dead_letter,
    encode_reply,
)
from schemas.contract import Rejected
from schemas.ids import RowIdMemo, row_id, row_ids
from schemas.records import RecommendReply
from schemas.rowbatch import (
    KIND_GRADIENTS,
    KIND_UPDATES,
    TABLE_ITEM,
    TABLE_NAMES,
    TABLE_USER,
    CorruptBatch,
    RowBatch,
)
from schemas.rows import row_key

log = logging.getLogger("freshrec.worker")
LOOP_PHASES = ("consume", "serve", "learn", "updates", "other")
"""The phases of a loop round, in order (``freshrec_worker_loop_seconds{phase}``)."""
MAX_ROWS_PER_MESSAGE = 1000
OUTBOX_MAX_ROWS = 20_000  # sent before the linger runs out past this many waiting rows


def events_consumer_config(settings: WorkerSettings, group: str) -> dict[str, Any]:
    """The config of the worker's consumer of ``events`` and ``recommend.requests``: a group
    member with the worker's fetch wait (its setting, else the Kafka profile's)."""
    fetch_wait = settings.fetch_wait_ms
    if fetch_wait is None:
        fetch_wait = profile(settings.conn).worker_fetch_wait_ms
    return consumer_config(
        settings.conn, group, **{"fetch.wait.max.ms": fetch_wait}, **lag_statistics("workers")
    )


class Worker:
    """Learning and serving on one thread; ``run`` loops ``poll_once`` until stopped."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        conn = settings.conn
        self.names = TopicNames(conn.topic_prefix)
        self.keys = RedisKeys(conn.topic_prefix)
        # Timeouts: a stopped Redis must fail calls quickly (serving degrades, learning waits)
        # instead of hanging the loop that also answers requests.
        self.redis = redis.Redis.from_url(
            conn.redis_url,
            socket_timeout=settings.redis_timeout_s,
            socket_connect_timeout=settings.redis_timeout_s,
        )
        self.dim = settings.learning.dim
        self.cache = EmbeddingCache(
            self.dim, settings.user_capacity_rows, self._fetch, pick_device(settings.device)
        )
        self.cache.on_evict = self._evicted
        # ~40 MB written now, not page by page inside the first slices
        self.pending = PendingSteps(capacity=1 << 17, width=self.cache.w, touch=True)
        self.item_row_ids = RowIdMemo(200_000)  # a catalogue's items come back every slice
        self.producer = Producer(producer_config(conn))
        self.group = f"{conn.topic_prefix}freshrec-workers"
        self.events = Consumer(events_consumer_config(settings, self.group))
        self.updates = Consumer(consumer_config(conn, None, background=True))
        self.tokens = itertools.count(1)
        self.rng = np.random.default_rng(abs(hash(settings.worker_id)) % (2**32))
        learning = settings.learning
        self.admission = AdmissionFilter(
            learning.admission_touches, learning.admission_window_s * 1000
        )
        # row -> [grad sum, count, event_ms, its unsent steps]: held back by admission
        self.unsent: dict[tuple[int, int], list] = {}
        self.deferred: list[tuple[RowBatch, np.ndarray]] = []  # update rows awaiting reports
        self.outbox: dict[int, list[tuple]] = {TABLE_USER: [], TABLE_ITEM: []}
        """Admitted gradients not sent yet: per table, (keys, sums, counts, newest, steps)
        chunks (``steps``: each row's local step in ``pending``)."""
        self._outbox_rows = 0
        self._outbox_since: float | None = None
        self.item_pool: list[str] = []
        self.grad_partitions = self._partitions(self.names.gradients)
        self.stats = defaultdict(int)
        self._loop_phases = [m.WORKER_LOOP_SECONDS.labels(phase) for phase in LOOP_PHASES]
        self._newest_local_ms = self._newest_served_ms = 0  # event times reached, ms
        self._newest_local = m.FRESHNESS_EVENT_TIME.labels("local")
        self._newest_served = m.FRESHNESS_EVENT_TIME.labels("served")
        self._last_commit = time.monotonic()
        # ---- serving
        sv = settings.serving
        self.policy = BatchPolicy(settings.max_batch, settings.max_wait_ms)
        most = settings.event_slice
        self.slicer = EventSlicer(
            settings.event_slice_ms,
            settings.event_slice_idle_ms,
            min(64, most),
            most,
            min(256, most),
        )
        self.requests: deque[Inbound] = deque()
        self.backlog: deque[Message] = deque()
        self.paused: list[TopicPartition] = []
        self.processed: dict[tuple[str, int], int] = {}
        """Offsets to commit: requests answered, events whose gradients the broker holds."""
        self.gate = OffsetGate()  # learnt events' offsets until their gradients are delivered
        self.request_offsets = RequestOffsets()  # commit no request before an earlier open one
        self._committed: dict[tuple[str, int], int] = {}
        self.answered: OrderedDict[str, None] = OrderedDict()
        self._answered_unsaved: list[str] = []
        self._events_retry_at = 0.0
        self._housekeeping_at = 0.0
        self._expired_at = time.monotonic()
        self._trim_warned_at = -math.inf
        self.assigned = 0
        self.snapshots = SnapshotRefresher(
            self.redis,
            self.keys,
            settings.hot_k,
            weights=settings.hot_weights,
            rate_per_hour=settings.hot_decay_per_hour,
        )
        self.models = ModelWatcher(settings.model_dir, self.cache.device, self.dim)
        self.recommender = Recommender(
            sv,
            self.cache,
            self.redis,
            self.keys,
            self.snapshots,
            self.models,
            lambda channels: RecallRunner(
                channels,
                sv.channels,
                settings.breaker,
                settings.recall_delays_ms,
                inline=IN_MEMORY_CHANNELS,
            ),
            settings.worker_id,
        )
        self.recent: OrderedDict[str, deque[str]] = OrderedDict()
        self.recommender.recent_clicks = lambda u: list(self.recent.get(u, ()))

    # ------------------------------------------------------------------------------ setup
    def _partitions(self, topic: str) -> int:
        md = self.producer.list_topics(topic, timeout=15)
        t = md.topics.get(topic)
        if t is None or t.error is not None:
            raise RuntimeError(f"topic {topic} is missing: run `freshrec topics create`")
        return len(t.partitions)

    def _fetch(self, table: int, ids: list[int]):
        return fetch_rows(self.redis, self.keys, table, ids, self.dim + 1)

    def start(self) -> None:
        """Load the item table, then follow the broadcast from before that load; load the
        models and the serving snapshot; join the group."""
        positions = broadcast_offsets(self.redis, self.keys)
        items = load_table(self.redis, self.keys, TABLE_ITEM, self.dim + 1)
        self.cache.load_items(items)
        if self.models.load_now() is None:
            log.warning(
                "no ranking models (%s): serving from the hot list until `freshrec train` "
                "writes them",
                self.models.last_error,
            )
        else:
            m.MODEL_INFO.labels(self.models.version).set(1)
            m.MODEL_RELOADS.labels("ok").inc()
        self.models.on_change = self._model_changed
        self.snapshots.start()
        self.recommender.adopt_snapshot()
        n = self._partitions(self.names.embeddings_updates)
        self.updates.assign(
            [
                TopicPartition(self.names.embeddings_updates, p, positions.get(p, OFFSET_BEGINNING))
                for p in range(n)
            ]
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

    def close(self) -> None:
        self.snapshots.stop()
        self.recommender.runner.close()
        self._send_outbox()
        self.producer.flush(10)
        self._save_answered()
        self._commit(sync=True)
        self.events.close()
        self.updates.close()
        self.redis.close()
        close_producer(self.producer, 10)

    # ------------------------------------------------------------------------------- loop
    def run(self, stop: threading.Event) -> None:
        self.start()
        try:
            while not stop.is_set():
                self.poll_once()
        finally:
            self.close()

    def poll_once(self) -> None:
        t0 = time.perf_counter()
        msgs = consume_available(self.events, self._consume_size(), self._poll_timeout_s())
        t1 = time.perf_counter()
        topic = self.names.events
        events = [msg for msg in msgs if msg.error() is None and msg.topic() == topic]
        if len(events) < len(msgs):  # requests and errors, one by one
            for msg in msgs:
                if not self._ok(msg) or msg.topic() == topic:
                    continue
                self.slicer.request_seen(time.monotonic())
                self._accept_request(msg)
        self.backlog.extend(events)
        # every event: a burst weighs what it holds
        stamps = [
            t for kind, t in map(Message.timestamp, events) if kind != TIMESTAMP_NOT_AVAILABLE
        ]
        if stamps:
            m.observe_many(
                m.WORKER_FETCH_LAG, np.maximum(time.time() - np.asarray(stamps) / 1000, 0)
            )
        self._serve_ready()
        t2 = time.perf_counter()
        self._learn_slice()
        linger_s = self.settings.learning.gradient_linger_ms / 1000
        if self._outbox_since is not None and time.monotonic() - self._outbox_since >= linger_s:
            self._send_outbox()
        t3 = time.perf_counter()
        for msg in self.updates.consume(1000, 0):
            if self._ok(msg):
                self.on_update(msg.value())
        self.producer.poll(0)
        if self.deferred:
            self._install_deferred()
        t4 = time.perf_counter()
        self._flow_control()
        self._save_answered()  # right away: it narrows the window for a duplicate answer
        now = time.monotonic()
        if now - self._last_commit > self.settings.commit_interval_s:
            self._commit()
            self._last_commit = now
        if now - self._housekeeping_at > 1.0:
            self._housekeeping_at = now
            self.forget_unadmitted(_now_ms())
            ttl = self.settings.row_ttl_s
            if ttl and now - self._expired_at > min(60.0, max(1.0, ttl / 10)):
                self._expired_at = now
                self.expire_items(_now_ms())
            self.models.poll()
            self.recommender.maybe_rebuild_index()
            for name, state in self.recommender.runner.breaker_states().items():
                m.BREAKER_STATE.labels(name).set(
                    0 if state == CLOSED else 1 if state == HALF_OPEN else 2
                )
        m.PENDING_STEPS.set(len(self.pending))
        m.EVENT_BACKLOG.set(len(self.backlog))
        phases = self._loop_phases
        for child, seconds in zip(
            phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, time.perf_counter() - t4), strict=True
        ):
            child.observe(seconds)

    def _consume_size(self) -> int:
        """At least ``batch_max`` messages, and enough to fill the next slice: a backlog
        refilled ``batch_max`` at a time held every slice to that size whatever its budget
        (slices of 2,000 events cost ~7.5 µs an event, of 16,000 ~5.3: the fixed costs of a
        slice, and rows named again within one, summed once)."""
        return max(self.settings.batch_max, self.slicer.size(time.monotonic()) - len(self.backlog))

    def _poll_timeout_s(self) -> float:
        if self.requests:
            d = self.policy.decide(len(self.requests), self.requests[0].enqueued_ms, _now_ms())
            return 0.0 if d.flush or self.backlog else d.wait_ms / 1000
        if self.backlog and time.monotonic() >= self._events_retry_at:
            return 0.0
        return self.settings.poll_timeout_ms / 1000

    # ---------------------------------------------------------------------------- requests
    def _accept_request(self, msg) -> None:
        self.request_offsets.accepted(msg.partition(), msg.offset())
        headers = dict(msg.headers() or [])
        reply_to = (headers.get("reply-to") or b"").decode(errors="replace") or (
            self.names.recommend_replies
        )
        corr = headers.get("correlation-id")
        now = _now_ms()
        try:
            req = decode_request(msg.value(), now)
        except Rejected as rej:
            m.REQUESTS.labels("invalid").inc()
            letter = dead_letter(
                rej,
                topic=msg.topic(),
                partition=msg.partition(),
                offset=msg.offset(),
                key=msg.key(),
                value=msg.value(),
                now_ms=now,
                service="worker",
            )
            self._produce(self.names.recommend_requests_dlq, None, encode_dead_letter(letter))
            error = RecommendReply(
                request_id=(corr or b"unknown").decode(errors="replace")[:128] or "unknown",
                user_id="unknown",
                items=(),
                tier="error",
                tier_reason=f"invalid request: {rej.reason}: {rej.detail}"[:256],
                served_at_ms=now,
                worker=self.settings.worker_id,
            )
            self._reply(reply_to, corr, error, msg.partition(), msg.offset())
            return
        self.requests.append(Inbound(req, reply_to, corr, now, msg.partition(), msg.offset()))

    def _serve_ready(self) -> None:
        while self.requests:
            d = self.policy.decide(len(self.requests), self.requests[0].enqueued_ms, _now_ms())
            if not d.flush:
                return
            take = [
                self.requests.popleft()
                for _ in range(min(len(self.requests), self.policy.max_batch))
            ]
            live, expired = split_expired(
                take, lambda b: b.deadline_ms(self.settings.serving.default_budget_ms), _now_ms()
            )
            for b in expired:
                m.REQUESTS.labels("expired").inc()
                self._done_request(b.partition, b.offset)
            live = self._drop_answered(live)
            if not live:
                continue
            m.REQUEST_BATCH_SIZE.observe(len(live))
            replies = self.recommender.serve(live, queue_depth=len(self.requests))
            for b, reply in zip(live, replies, strict=True):
                m.REQUESTS.labels("served").inc()
                self._reply(b.reply_to, b.correlation_id, reply, b.partition, b.offset)

    def _drop_answered(self, live: list[Inbound]) -> list[Inbound]:
        """The same request_id is answered once: ids answered here are remembered, and ids
        answered by any worker (before a crash or a rebalance) are looked up in Redis."""
        fresh, seen = [], set()
        for b in live:
            rid = b.request.request_id
            if rid in self.answered or rid in seen:
                m.REQUESTS.labels("duplicate").inc()
                self._done_request(b.partition, b.offset)
            else:
                seen.add(rid)
                fresh.append(b)
        if not fresh:
            return fresh
        try:
            pipe = self.redis.pipeline(transaction=False)
            for b in fresh:
                pipe.exists(self.keys.answered(b.request.request_id))
            found = pipe.execute()
        except redis.RedisError:
            return fresh  # answer: a duplicate reply is dropped by the client
        out = []
        for b, hit in zip(fresh, found, strict=True):
            if hit:
                m.REQUESTS.labels("duplicate").inc()
                self._done_request(b.partition, b.offset)
            else:
                out.append(b)
        return out

    def _reply(self, topic: str, corr, reply: RecommendReply, partition: int, offset: int) -> None:
        headers = [("correlation-id", corr)] if corr is not None else []
        rid = reply.request_id

        def delivered(err, msg) -> None:
            if err is not None:  # librdkafka gave up (message.timeout.ms, 5 min by default)
                log.warning("reply to %s lost: %s", topic, err)
                m.REQUESTS.labels("reply_failed").inc()
                # done all the same: long past its deadline, it would only expire if it were
                # read again, and an open request holds back its partition's commits
                self._done_request(partition, offset)
                return
            if reply.tier != "error":
                self._remember_answered(rid)
            self._done_request(partition, offset)

        self._produce(topic, corr, encode_reply(reply), headers=headers, on_delivery=delivered)

    def _produce(self, topic, key, value, headers=None, on_delivery=None) -> None:
        while True:
            try:
                self.producer.produce(
                    topic, value=value, key=key, headers=headers, on_delivery=on_delivery
                )
                return
            except BufferError:
                self.producer.poll(0.05)

    def _remember_answered(self, rid: str) -> None:
        self.answered[rid] = None
        if len(self.answered) > self.settings.answered_memory:
            self.answered.popitem(last=False)
        self._answered_unsaved.append(rid)

    def _save_answered(self) -> None:
        if not self._answered_unsaved:
            return
        try:
            pipe = self.redis.pipeline(transaction=False)
            for rid in self._answered_unsaved:
                pipe.set(self.keys.answered(rid), 1, ex=self.settings.answered_ttl_s)
            pipe.execute()
            self._answered_unsaved.clear()
        except redis.RedisError:
            del self._answered_unsaved[: -self.settings.answered_memory]  # retried later

    def _done_request(self, partition: int, offset: int) -> None:
        self.request_offsets.done(partition, offset)

    def _model_changed(self, models) -> None:
        m.MODEL_INFO.clear()
        m.MODEL_INFO.labels(models.version).set(1)
        m.MODEL_RELOADS.labels("ok").inc()

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
        if not self._outbox_rows:  # nothing waits in the outbox: all of it is produced
            self.gate.seal()

    def _flow_control(self) -> None:
        high = max(4 * self.settings.batch_max, 2 * self.slicer.size(time.monotonic()))
        if not self.paused and len(self.backlog) > high:
            parts = [tp for tp in self.events.assignment() if tp.topic == self.names.events]
            if parts:
                self.events.pause(parts)
                self.paused = parts
        elif self.paused and len(self.backlog) < self.settings.batch_max:
            self.events.resume(self.paused)
            self.paused = []

    def _commit(self, sync: bool = False) -> None:
        """Commit what is done: answered requests, and learnt events whose gradient messages
        the broker has acknowledged (``OffsetGate``): a crash between handing gradients to
        the producer and their delivery must not leave their events committed."""
        if self._outbox_rows:
            self._send_outbox()  # which seals what was learnt: its gradients are produced
        for key, offset in self.gate.ready().items():
            self.processed[key] = max(self.processed.get(key, 0), offset)
        requests = self.names.recommend_requests
        for partition, offset in self.request_offsets.committable().items():
            key = (requests, partition)
            self.processed[key] = max(self.processed.get(key, 0), offset)
        changed = [
            TopicPartition(t, p, o)
            for (t, p), o in self.processed.items()
            if self._committed.get((t, p)) != o
        ]
        if not changed:
            return
        try:
            self.events.commit(offsets=changed, asynchronous=not sync)
        except Exception as exc:  # e.g. during a rebalance; retried on the next round
            log.debug("commit failed: %s", exc)
            return
        for tp in changed:
            self._committed[(tp.topic, tp.partition)] = tp.offset

    def _on_assign(self, consumer, parts) -> None:
        self.assigned = len(parts)
        m.ASSIGNED_PARTITIONS.labels("worker").set(len(parts))
        self.paused = []

    def _on_revoke(self, consumer, parts) -> None:
        gone = {(tp.topic, tp.partition) for tp in parts}
        self._send_outbox()
        self.producer.flush(5)  # deliver replies and gradients (and offsets) before letting go
        self._commit(sync=True)
        self.backlog = deque(m_ for m_ in self.backlog if (m_.topic(), m_.partition()) not in gone)
        kept = deque()
        for b in self.requests:
            if (self.names.recommend_requests, b.partition) in gone:
                m.REQUESTS.labels("revoked").inc()
            else:
                kept.append(b)
        self.requests = kept
        for key in gone:
            self.processed.pop(key, None)
            self._committed.pop(key, None)
        self.gate.forget(gone)  # gradients undelivered after the flush: the next owner relearns
        self.request_offsets.forget(p for t, p in gone if t == self.names.recommend_requests)
        self.paused = []
        self.assigned = 0
        m.ASSIGNED_PARTITIONS.labels("worker").set(0)

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
        now_ms = int(time.time() * 1000)
        events = []
        for e in decode_events([msg.value() for msg in msgs], now_ms):
            if type(e) is Rejected:
                log.debug("skipping invalid event: %s", e)
            else:
                events.append(e)
        if events:
            self._learn_events(events)  # a Redis error here: the slice is retried, then counted
        invalid = len(msgs) - len(events)
        if invalid:
            m.WORKER_EVENTS.labels("invalid").inc(invalid)
            self.stats["invalid"] += invalid
        m.WORKER_EVENTS.labels("valid").inc(len(events))

    def _learn_events(self, events) -> None:
        self._remember_clicks(events)
        if not self.item_pool:
            self.item_pool = [e.item_id for e in events]
        ex = examples_from_events(events, self.settings.learning.labels, self.rng, self.item_pool)
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

    def _remember_clicks(self, events) -> None:
        """The last clicks per user (bounded), for the i2i channel of this worker."""
        for e in events:
            if e.event_type == "impression":
                continue
            q = self.recent.get(e.user_id)
            if q is None:
                q = self.recent[e.user_id] = deque(maxlen=10)
                if len(self.recent) > self.settings.recent_users:
                    self.recent.popitem(last=False)
            else:
                self.recent.move_to_end(e.user_id)
            if e.item_id in q:
                q.remove(e.item_id)
            q.appendleft(e.item_id)

    def learn(self, ex) -> None:
        # each table's rows grouped once: for the cache's slots and the gradients' sums
        users = np.unique(row_ids(ex.users), return_inverse=True)
        items = np.unique(self.item_row_ids(ex.items), return_inverse=True)
        user_slots = self.cache.distinct_slots(TABLE_USER, users[0])
        item_slots = self.cache.distinct_slots(TABLE_ITEM, items[0])
        u = self.cache.gather(TABLE_USER, user_slots[users[1]])
        v = self.cache.gather(TABLE_ITEM, item_slots[items[1]])
        gu, gv = logistic_gradients(u, v, ex.labels, ex.weights)
        outgoing: dict[tuple[int, int], list] = defaultdict(list)
        for table, (distinct, index), key_slots, grads in (
            (TABLE_USER, users, user_slots, gu),
            (TABLE_ITEM, items, item_slots, gv),
        ):
            g = aggregate_groups(distinct, index, grads, ex.event_ms)
            keys, sums, counts, newest = g.keys, g.sums, g.counts, g.newest
            ok = finite_rows(sums)
            rejected = int((~ok).sum())
            if rejected:
                m.GRADIENT_ROWS.labels(TABLE_NAMES[table], "non_finite").inc(rejected)
            keys, sums, counts, newest = keys[ok], sums[ok], counts[ok], newest[ok]
            key_slots = key_slots[ok]
            sums = clip_rows(sums, self.settings.learning.max_grad_norm)
            deltas = -self.settings.learning.lr * sums
            self.cache.add(table, key_slots, deltas)
            steps = self.pending.record(table, key_slots, deltas)
            if self.admission.threshold == 1:  # every row admitted: to the outbox
                self.outbox[table].append((keys, sums, counts, newest, steps))
                self._outbox_rows += len(keys)
                if self._outbox_since is None:
                    self._outbox_since = time.monotonic()
            else:
                self._queue(table, keys, sums, counts, newest, steps, outgoing)
        self._send(outgoing)
        if self._outbox_rows >= OUTBOX_MAX_ROWS or not self.settings.learning.gradient_linger_ms:
            self._send_outbox()
        if len(self.pending) > self.settings.learning.max_pending_steps:
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

    def _evicted(self, table: int, slots: np.ndarray, ids: list[int]) -> None:
        """Rows left the user slab or the item table: their local steps go with them (the
        pool reuses their entries). A row's gradients held back for admission stay, to be
        sent on admission, but no longer name those steps."""
        self.pending.forget(table, slots)
        for rid in ids:
            held = self.unsent.get((table, rid))
            if held is not None:
                held[3] = []

    def expire_items(self, now_ms: int) -> int:
        """Item rows that no event, broadcast update or catalogue load has touched for
        ``row_ttl_s`` leave the table, their slots reused, unless the catalogue lists them.
        The parameter server's rows expire after as long in Redis; touched again, such an
        item is loaded from Redis if its row is still there, else created from its id."""
        named = self.recommender.named.cpu().numpy()
        gone = self.cache.expire_items(now_ms - self.settings.row_ttl_s * 1000, keep=named)
        if gone:
            log.info(
                "item table: %d rows untouched for %d s let go, %d held",
                gone,
                self.settings.row_ttl_s,
                self.cache.item_rows,
            )
        return gone

    def forget_unadmitted(self, now_ms: int) -> None:
        """Rows unseen for a whole admission window are forgotten with the gradients they
        held back, and with those gradients' local steps: they will never reach the
        parameter server, and would otherwise stay in the step pool for good (the cached row
        keeps them until a broadcast of the row, if one ever comes, replaces it)."""
        gone: dict[int, list[int]] = defaultdict(list)
        for ref in self.admission.rotate(now_ms):
            held = self.unsent.pop(ref, None)
            if held is not None:
                gone[ref[0]] += held[3]
        for table, steps in gone.items():
            self.pending.drop_unsent(table, np.asarray(steps, np.int64))

    def _queue(self, table, keys, sums, counts, newest, steps, outgoing) -> None:
        now_ms = _now_ms()
        held_back = 0
        parts = row_partitions(keys, self.grad_partitions).tolist()
        for k, part, g, c, t, step in zip(
            keys.tolist(),
            parts,
            sums,
            counts.tolist(),
            newest.tolist(),
            steps.tolist(),
            strict=True,
        ):
            ref = (table, k)
            admitted = self.admission.touch(ref, now_ms)
            held = self.unsent.get(ref)
            if held is None:
                held = self.unsent[ref] = [g.copy(), c, t, [step]]
            else:
                held[0] += g
                held[1] += c
                held[2] = max(held[2], t)
                held[3].append(step)
            if admitted:
                del self.unsent[ref]
                outgoing[(table, part)].append((k, *held))
            else:
                held_back += 1
        if held_back:
            m.GRADIENT_ROWS.labels(TABLE_NAMES[table], "held_for_admission").inc(held_back)

    def _send_outbox(self) -> None:
        """The admitted gradients of the last ``gradient_linger_ms``, summed per row: one
        message per table and ``gradients`` partition (and per ``MAX_ROWS_PER_MESSAGE``); the
        rows' waiting local steps are assigned to the message that carries them."""
        created = _now_ms()
        for table, chunks in self.outbox.items():
            if not chunks:
                continue
            if len(chunks) == 1:
                keys, sums, counts, newest, steps = chunks[0]
                row_of_step = np.arange(len(keys))
            else:  # a row may be in several chunks (each chunk's keys differ): summed
                keys, sums, counts, newest, steps = (
                    np.concatenate(c) for c in zip(*chunks, strict=True)
                )
                g = aggregate(keys, sums, newest, counts)  # in the sums' float32
                keys, sums, counts, newest = g.keys, g.sums, g.counts, g.newest
                row_of_step = g.index
            chunks.clear()
            parts = row_partitions(keys, self.grad_partitions)
            order = np.argsort(parts, kind="stable")
            bounds = np.flatnonzero(np.diff(parts[order])) + 1
            # the steps of each partition's rows, grouped the same way, each row's in order
            place = np.empty(len(keys), np.int64)
            place[order] = np.arange(len(keys))
            step_place = place[row_of_step]  # each step's row's position in ``order``
            by_place = np.argsort(step_place, kind="stable")
            step_bounds = np.searchsorted(step_place[by_place], bounds)
            for group, group_steps in zip(
                np.split(order, bounds), np.split(by_place, step_bounds), strict=True
            ):
                self._emit(
                    table,
                    int(parts[group[0]]),
                    keys[group],
                    sums[group],
                    counts[group],
                    newest[group],
                    created,
                    step_place[group_steps] - place[group[0]],
                    steps[group_steps],
                )
        self._outbox_rows, self._outbox_since = 0, None
        self.gate.seal()  # what was learnt so far has its gradients produced now

    def _send(self, outgoing) -> None:
        """Rows admitted in this slice (admission threshold above 1), per table and partition."""
        created = _now_ms()
        for (table, part), rows in outgoing.items():
            step_row = [j for j, r in enumerate(rows) for _ in r[4]]
            self._emit(
                table,
                part,
                np.array([r[0] for r in rows], np.int64),
                np.stack([r[1] for r in rows]),
                np.array([r[2] for r in rows]),
                np.array([r[3] for r in rows], np.int64),
                created,
                np.array(step_row, np.int64),
                np.array([s for r in rows for s in r[4]], np.int64),
            )

    def _emit(self, table, part, ids, sums, counts, newest, created, step_row, steps) -> None:
        """Gradient messages for rows of one table and ``gradients`` partition (at most
        ``MAX_ROWS_PER_MESSAGE`` each); the rows' unsent local steps ``steps`` travel in them
        (``step_row``: the position in ``ids`` of each step's row, ascending)."""
        starts = range(0, len(ids), MAX_ROWS_PER_MESSAGE)
        step_bounds = np.searchsorted(step_row, [*starts, len(ids)]).tolist()
        for k, lo in enumerate(starts):
            take = slice(lo, lo + MAX_ROWS_PER_MESSAGE)
            token = next(self.tokens)
            self.pending.assign(steps[step_bounds[k] : step_bounds[k + 1]], token)
            self._produce_gradients(
                token,
                part,
                RowBatch(
                    KIND_GRADIENTS,
                    table,
                    ids[take],
                    sums[take].astype(np.float32, copy=False),
                    counts[take].astype(np.uint64),
                    newest[take],
                    created_ms=created,
                ),
            )

    def _produce_gradients(self, token: int, part: int, batch: RowBatch) -> None:
        value, key = batch.encode(), row_key(int(batch.ids[0]))
        name = TABLE_NAMES[batch.table]
        self.gate.produced(token)
        while True:
            try:
                self.producer.produce(
                    self.names.gradients,
                    value=value,
                    key=key,
                    partition=part,
                    on_delivery=self._delivered(token, name, len(batch.ids)),
                )
                break
            except BufferError:
                self.producer.poll(0.05)
        m.GRADIENT_ROWS.labels(name, "sent").inc(len(batch.ids))
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

    # ---------------------------------------------------------------------------- updates
    def on_update(self, value: bytes) -> None:
        try:
            batch = RowBatch.decode(value)
        except CorruptBatch as exc:
            log.warning("corrupt update batch skipped: %s", exc)
            return
        if batch.kind == KIND_UPDATES:
            self._install(batch, np.arange(len(batch.ids)))

    def _install(self, batch: RowBatch, take: np.ndarray) -> None:
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
        m.UPDATES_INSTALLED.labels(name, "not_cached").inc(int((~resident).sum()))
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
        times = batch.event_ms[take[newer]]
        self.cache.install_many(table, slots, rows, versions[newer], times)
        lag = np.maximum(time.time() - times / 1000, 0.0)  # every row installed
        m.observe_many(m.FRESHNESS_LAG.labels("served"), lag)
        self._newest_served_ms = max(self._newest_served_ms, int(times.max()))
        self._newest_served.set(self._newest_served_ms / 1000)
        m.UPDATES_INSTALLED.labels(name, "installed").inc(len(rows))

    def _install_deferred(self) -> None:
        deferred, self.deferred = self.deferred, []
        for batch, take in deferred:
            self._install(batch, take)

    # ------------------------------------------------------------------------ inspection
    def user_row(self, user_id: str) -> np.ndarray:
        slot = self.cache.slots(TABLE_USER, np.array([row_id(user_id)]))
        return self.cache.gather(TABLE_USER, slot)[0]

    def item_row(self, item_id: str) -> np.ndarray:
        slot = self.cache.slots(TABLE_ITEM, np.array([row_id(item_id)]))
        return self.cache.gather(TABLE_ITEM, slot)[0]


def _now_ms() -> int:
    return int(time.time() * 1000)


def run_worker(settings: WorkerSettings) -> int:
    return run_until_signalled("worker", Worker(settings).run, settings.metrics_port)
