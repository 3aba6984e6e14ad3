"""``freshrec worker``: the online-learning side of the inference worker.

One confluent-kafka consumer in one group reads ``events`` (range assignor: a worker owns the
same partition numbers of every co-partitioned topic, so the serving side added later meets a
user's clicks in the same process). A second, group-less consumer reads every partition of
``embeddings.updates``.

Per batch of events: decode (invalid ones are skipped and counted; the streams app writes the
dead letters), build labelled examples, compute logistic-loss gradients for user and item
rows, clip them, apply u ← u − lr·g to the cached rows at once, and send the gradients to the
parameter server in compact binary batches (one per table and ``gradients`` partition). The
local steps are remembered (``pending.py``) until a broadcast update includes them.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import defaultdict

import numpy as np
import redis
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition

from freshrec import metrics as m
from freshrec.kafka import consumer_config, producer_config
from freshrec.lifecycle import run_until_signalled
from freshrec.partitioner import kafka_partition
from freshrec.rediskeys import RedisKeys
from freshrec.topics import TopicNames
from inference.cache import EmbeddingCache, pick_device
from inference.learning import aggregate, examples_from_events, logistic_gradients
from inference.pending import PendingSteps
from inference.settings import WorkerSettings
from param_server.adagrad import clip_rows, finite_rows
from param_server.rows import row_key
from param_server.store import broadcast_offsets, fetch_rows, load_table
from schemas.codec import decode_event
from schemas.contract import Rejected
from schemas.ids import row_id
from schemas.rowbatch import (
    KIND_GRADIENTS,
    KIND_UPDATES,
    TABLE_ITEM,
    TABLE_NAMES,
    TABLE_USER,
    CorruptBatch,
    RowBatch,
)

log = logging.getLogger("freshrec.worker")
LAG_SAMPLES = 256
MAX_ROWS_PER_MESSAGE = 1000


class OnlineLearner:
    """The worker's learning loop; the serving issue adds the request side to the same loop."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        conn = settings.conn
        self.names = TopicNames(conn.topic_prefix)
        self.keys = RedisKeys(conn.topic_prefix)
        self.redis = redis.Redis.from_url(conn.redis_url)
        self.dim = settings.learning.dim
        self.cache = EmbeddingCache(
            self.dim, settings.user_capacity_rows, self._fetch, pick_device(settings.device)
        )
        self.cache.on_evict = lambda table, rid: self.pending.forget_row((table, rid))
        self.pending = PendingSteps()
        self.producer = Producer(producer_config(conn))
        self.events = Consumer(consumer_config(conn, f"{conn.topic_prefix}freshrec-workers"))
        self.updates = Consumer(consumer_config(conn, None))
        self.tokens = itertools.count(1)
        self.rng = np.random.default_rng(abs(hash(settings.worker_id)) % (2**32))
        self.touches: dict[tuple[int, int], int] = defaultdict(int)
        self.unsent: dict[tuple[int, int], list] = {}  # row -> [grad sum, count, event_ms]
        self.item_pool: list[str] = []
        self.grad_partitions = self._partitions(self.names.gradients)
        self._partition_cache: dict[int, int] = {}
        self.stats = defaultdict(int)
        self._last_commit = time.monotonic()

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
        """Load the item table, then follow the broadcast from before that load."""
        positions = broadcast_offsets(self.redis, self.keys)
        items = load_table(self.redis, self.keys, TABLE_ITEM, self.dim + 1)
        self.cache.load_items(items)
        n = self._partitions(self.names.embeddings_updates)
        self.updates.assign(
            [
                TopicPartition(self.names.embeddings_updates, p, positions.get(p, OFFSET_BEGINNING))
                for p in range(n)
            ]
        )
        self.events.subscribe(
            [self.names.events],
            on_assign=lambda c, parts: m.ASSIGNED_PARTITIONS.labels("worker").set(len(parts)),
        )
        log.info(
            "worker %s: %d item rows from Redis, device %s, broadcast from %s",
            self.settings.worker_id, len(items), self.cache.device, positions or "the beginning",
        )  # fmt: skip

    def close(self) -> None:
        self.producer.flush(10)
        self.events.close()
        self.updates.close()
        self.redis.close()

    # ------------------------------------------------------------------------------- loop
    def run(self, stop: threading.Event) -> None:
        self.start()
        try:
            while not stop.is_set():
                self.poll_once()
        finally:
            self.close()

    def poll_once(self) -> None:
        msgs = self.events.consume(self.settings.batch_max, self.settings.poll_timeout_ms / 1000)
        good = [msg for msg in msgs if self._ok(msg)]
        if good:
            self.on_events(good)
        ups = self.updates.consume(1000, 0)
        for msg in ups:
            if self._ok(msg):
                self.on_update(msg.value())
        self.producer.poll(0)
        now = time.monotonic()
        if now - self._last_commit > 1.0 and good:
            self.events.commit(asynchronous=True)
            self._last_commit = now
        m.PENDING_STEPS.set(len(self.pending))

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
        for msg in msgs:
            try:
                events.append(decode_event(msg.value(), now_ms))
            except Rejected as rej:
                m.WORKER_EVENTS.labels("invalid").inc()
                self.stats["invalid"] += 1
                log.debug("skipping invalid event: %s", rej)
        m.WORKER_EVENTS.labels("valid").inc(len(events))
        if not events:
            return
        if not self.item_pool:
            self.item_pool = [e.item_id for e in events]
        ex = examples_from_events(events, self.settings.learning.labels, self.rng, self.item_pool)
        if len(ex.labels) == 0:
            return
        m.WORKER_EXAMPLES.labels("positive").inc(int(ex.labels.sum()))
        m.WORKER_EXAMPLES.labels("negative").inc(int((ex.labels == 0).sum()))
        self.item_pool = (self.item_pool + ex.items)[-10_000:]
        self.learn(ex)
        done = time.time()
        for ts in ex.event_ms[:LAG_SAMPLES].tolist():
            m.FRESHNESS_LAG.labels("local").observe(max(done - ts / 1000, 0.0))

    def learn(self, ex) -> None:
        user_ids = np.fromiter((row_id(u) for u in ex.users), np.int64, len(ex.users))
        item_ids = np.fromiter((row_id(i) for i in ex.items), np.int64, len(ex.items))
        u_slots = self.cache.slots(TABLE_USER, user_ids)
        i_slots = self.cache.slots(TABLE_ITEM, item_ids)
        u = self.cache.gather(TABLE_USER, u_slots)
        v = self.cache.gather(TABLE_ITEM, i_slots)
        gu, gv = logistic_gradients(u, v, ex.labels, ex.weights)
        outgoing: dict[tuple[int, int], list] = defaultdict(list)
        for table, ids, slots, grads in (
            (TABLE_USER, user_ids, u_slots, gu),
            (TABLE_ITEM, item_ids, i_slots, gv),
        ):
            keys, sums, counts = aggregate(ids, grads)
            newest = np.zeros(len(keys), np.int64)
            np.maximum.at(newest, np.searchsorted(keys, ids), ex.event_ms)
            ok = finite_rows(sums)
            rejected = int((~ok).sum())
            if rejected:
                m.GRADIENT_ROWS.labels(TABLE_NAMES[table], "non_finite").inc(rejected)
            keys, sums, counts, newest = keys[ok], sums[ok], counts[ok], newest[ok]
            sums = clip_rows(sums, self.settings.learning.max_grad_norm)
            deltas = -self.settings.learning.lr * sums
            slot_of = dict(zip(ids.tolist(), slots.tolist(), strict=True))
            key_slots = np.fromiter((slot_of[k] for k in keys.tolist()), np.int64, len(keys))
            self.cache.add(table, key_slots, deltas)
            self._queue(table, keys, sums, counts, newest, deltas, outgoing)
        self._send(outgoing)

    def _queue(self, table, keys, sums, counts, newest, deltas, outgoing) -> None:
        threshold = self.settings.learning.admission_touches
        for k, g, c, t, d in zip(
            keys.tolist(), sums, counts.tolist(), newest.tolist(), deltas, strict=True
        ):
            ref = (table, k)
            self.pending.record(ref, d, None)
            self.touches[ref] += 1
            held = self.unsent.get(ref)
            if held is None:
                held = self.unsent[ref] = [g.copy(), c, t]
            else:
                held[0] += g
                held[1] += c
                held[2] = max(held[2], t)
            if self.touches[ref] >= threshold:
                del self.unsent[ref]
                part = self._partition_of(k)
                outgoing[(table, part)].append((k, *held))
            else:
                m.GRADIENT_ROWS.labels(TABLE_NAMES[table], "held_for_admission").inc()

    def _partition_of(self, row: int) -> int:
        """The ``gradients`` partition of a row (murmur2 in Python: cached per row)."""
        part = self._partition_cache.get(row)
        if part is None:
            if len(self._partition_cache) > 1_000_000:
                self._partition_cache.clear()
            part = self._partition_cache[row] = kafka_partition(row_key(row), self.grad_partitions)
        return part

    def _send(self, outgoing) -> None:
        created = int(time.time() * 1000)
        for (table, part), all_rows in outgoing.items():
            for lo in range(0, len(all_rows), MAX_ROWS_PER_MESSAGE):
                self._send_one(table, part, all_rows[lo : lo + MAX_ROWS_PER_MESSAGE], created)

    def _send_one(self, table: int, part: int, rows: list, created: int) -> None:
        token = next(self.tokens)
        ids = np.array([r[0] for r in rows], np.int64)
        batch = RowBatch(
            KIND_GRADIENTS, table, ids, np.stack([r[1] for r in rows]).astype(np.float32),
            np.array([r[2] for r in rows], np.uint64), np.array([r[3] for r in rows], np.int64),
            created_ms=created,
        )  # fmt: skip
        for k in ids.tolist():
            self.pending.assign((table, k), token)
        while True:
            try:
                self.producer.produce(
                    self.names.gradients, value=batch.encode(), key=row_key(int(ids[0])),
                    partition=part, on_delivery=self._delivered(token),
                )  # fmt: skip
                break
            except BufferError:
                self.producer.poll(0.05)
        m.GRADIENT_ROWS.labels(TABLE_NAMES[table], "sent").inc(len(ids))
        m.GRADIENT_MESSAGES.labels("sent").inc()

    def _delivered(self, token: int):
        def callback(err, msg) -> None:
            if err is not None:
                log.warning("gradient message lost: %s", err)
                self.pending.failed(token)
                return
            for (tbl, rid), delta in self.pending.delivered(token, msg.partition(), msg.offset()):
                slot = self.cache.held(tbl, rid)
                if slot is not None:
                    self.cache.add(tbl, np.array([slot]), -delta[None, :])

        return callback

    # ---------------------------------------------------------------------------- updates
    def on_update(self, value: bytes) -> None:
        try:
            batch = RowBatch.decode(value)
        except CorruptBatch as exc:
            log.warning("corrupt update batch skipped: %s", exc)
            return
        if batch.kind != KIND_UPDATES:
            return
        name = TABLE_NAMES[batch.table]
        if any(self.pending.has_undelivered((batch.table, rid)) for rid in batch.ids.tolist()):
            # the update may include a message whose delivery report has not been read yet
            self.producer.flush(1.0)
        now = time.time()
        installed = 0
        for j, rid in enumerate(batch.ids.tolist()):
            slot = self.cache.held(batch.table, rid)
            if slot is None:
                if batch.table != TABLE_ITEM:
                    m.UPDATES_INSTALLED.labels(name, "not_cached").inc()
                    continue
                slot = int(self.cache.slots(TABLE_ITEM, np.array([rid]))[0])
            version = int(batch.versions[j])
            if version <= int(self.cache.table(batch.table).version[slot]):
                m.UPDATES_INSTALLED.labels(name, "stale").inc()
                continue
            row = batch.rows[j].copy()
            rest = self.pending.on_install((batch.table, rid), batch.partition, batch.offset)
            if rest is not None:
                row += rest
            self.cache.install(batch.table, slot, row, version, int(batch.event_ms[j]))
            installed += 1
            if installed <= LAG_SAMPLES:
                m.FRESHNESS_LAG.labels("served").observe(max(now - batch.event_ms[j] / 1000, 0.0))
        m.UPDATES_INSTALLED.labels(name, "installed").inc(installed)

    # ------------------------------------------------------------------------ inspection
    def user_row(self, user_id: str) -> np.ndarray:
        slot = self.cache.slots(TABLE_USER, np.array([row_id(user_id)]))
        return self.cache.gather(TABLE_USER, slot)[0]

    def item_row(self, item_id: str) -> np.ndarray:
        slot = self.cache.slots(TABLE_ITEM, np.array([row_id(item_id)]))
        return self.cache.gather(TABLE_ITEM, slot)[0]


def run_worker(settings: WorkerSettings) -> int:
    return run_until_signalled("worker", OnlineLearner(settings).run, settings.metrics_port)
