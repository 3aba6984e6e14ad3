"""``freshrec param-server``: aggregate gradients, sparse Adagrad, persist, broadcast.

A consumer group on ``gradients``; each instance owns some partitions, and a row always
lives in one partition, so instances never touch the same row. Every gradient message is
applied as one unit, in offset order (rows clipped, non-finite rows rejected, Adagrad), so the
tables are a deterministic function of the input log. Every ``flush_interval_ms`` the touched
rows, their Adagrad accumulators and each partition's last applied offset are written to Redis
in one MULTI/EXEC; then the new rows are broadcast on ``embeddings.updates`` with the
(partition, offset) they include. On assignment a partition resumes right after its applied
offset in Redis, so after a crash nothing is lost and nothing is applied twice. While Redis is
unreachable the server pauses its partitions, keeps what it has in memory, commits nothing,
and resumes when Redis answers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import defaultdict

import numpy as np
import redis
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer

from freshrec import metrics as m
from freshrec.kafka import consumer_config, lag_statistics, producer_config
from freshrec.lifecycle import run_until_signalled
from freshrec.rediskeys import RedisKeys
from freshrec.topics import TopicNames
from param_server.adagrad import adagrad_step
from param_server.rows import encode_rows, initial_rows, row_key
from param_server.settings import ParamServerSettings
from param_server.store import applied_offsets, fetch_rows_and_accumulators
from schemas.rowbatch import KIND_GRADIENTS, KIND_UPDATES, TABLE_NAMES, CorruptBatch, RowBatch

log = logging.getLogger("freshrec.param_server")
MAX_ROWS_PER_MESSAGE = 1000
REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


class RowState:
    __slots__ = ("accum", "event_ms", "row", "version")

    def __init__(self, row: np.ndarray, accum: np.ndarray, version: int, event_ms: int) -> None:
        self.row, self.accum, self.version, self.event_ms = row, accum, version, event_ms


class ParameterServer:
    def __init__(self, settings: ParamServerSettings) -> None:
        self.settings = settings
        conn = settings.conn
        self.names = TopicNames(conn.topic_prefix)
        self.keys = RedisKeys(conn.topic_prefix)
        self.redis = redis.Redis.from_url(conn.redis_url, socket_timeout=5)
        self.w = settings.dim + 1
        self.consumer = Consumer(
            consumer_config(
                conn,
                f"{conn.topic_prefix}freshrec-param-server",
                background=True,
                **lag_statistics("param-server"),
            )
        )
        self.producer = Producer(producer_config(conn))
        self.rows: dict[tuple[int, int], RowState] = {}
        self.applied: dict[int, int] = {}
        self.dirty: dict[int, set[tuple[int, int]]] = defaultdict(set)
        self.owned: set[int] = set()
        self.update_partitions = 1
        self._last_flush = time.monotonic()
        self._paused = False

    # ------------------------------------------------------------------------ assignment
    def _on_assign(self, consumer, partitions) -> None:
        applied = self._redis_retry(lambda: applied_offsets(self.redis, self.keys))
        for tp in partitions:
            done = applied.get(tp.partition)
            self.applied[tp.partition] = -1 if done is None else done
            tp.offset = OFFSET_BEGINNING if done is None else done + 1
            self.owned.add(tp.partition)
        consumer.assign(partitions)
        m.ASSIGNED_PARTITIONS.labels("param-server").set(len(self.owned))
        log.info(
            "assigned gradients partitions %s, resuming after offsets %s",
            sorted(tp.partition for tp in partitions),
            {tp.partition: self.applied[tp.partition] for tp in partitions},
        )

    def _on_revoke(self, consumer, partitions) -> None:
        self.flush()
        for tp in partitions:
            self.owned.discard(tp.partition)
            self.applied.pop(tp.partition, None)
        self.rows.clear()  # reloaded from Redis on demand; another owner may change them
        log.info("revoked gradients partitions %s", sorted(tp.partition for tp in partitions))

    # ------------------------------------------------------------------------------ loop
    def run(self, stop: threading.Event) -> None:
        topic = self.names.gradients
        md = self.producer.list_topics(self.names.embeddings_updates, timeout=15)
        self.update_partitions = len(md.topics[self.names.embeddings_updates].partitions) or 1
        self.consumer.subscribe([topic], on_assign=self._on_assign, on_revoke=self._on_revoke)
        log.info("parameter server on %s (dim %d)", topic, self.settings.dim)
        try:
            while not stop.is_set():
                self.poll_once()
            self.flush()
        finally:
            self.producer.flush(10)
            self.consumer.close()

    def poll_once(self) -> None:
        msgs = self.consumer.consume(500, 0.02)
        decoded = []
        for msg in msgs:
            err = msg.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("consumer error: %s", err)
                continue
            batch = self._decode(msg.partition(), msg.offset(), msg.value())
            if batch is not None:
                decoded.append((msg.partition(), msg.offset(), batch))
        # one Redis round trip for every row this poll needs that is not in memory yet
        missing: dict[int, set[int]] = defaultdict(set)
        for _, _, batch in decoded:
            for i in batch.ids.tolist():
                if (batch.table, i) not in self.rows:
                    missing[batch.table].add(i)
        self._ensure_loaded_many(missing)
        for partition, offset, batch in decoded:
            self.apply_batch(partition, offset, batch)
        waiting = sum(len(d) for d in self.dirty.values())
        due = (time.monotonic() - self._last_flush) * 1000 >= self.settings.flush_interval_ms
        if waiting and (due or waiting >= self.settings.max_dirty_rows):
            self.flush()
        self.producer.poll(0)

    # ----------------------------------------------------------------------------- apply
    def apply_message(self, partition: int, offset: int, value: bytes) -> None:
        """Apply one gradient message (decode, load its rows, Adagrad)."""
        batch = self._decode(partition, offset, value)
        if batch is not None:
            self._ensure_loaded_many({batch.table: set(batch.ids.tolist())})
            self.apply_batch(partition, offset, batch)

    def _decode(self, partition: int, offset: int, value: bytes) -> RowBatch | None:
        """The message's batch, or None (already applied, corrupt or foreign: skipped, and
        a skipped offset counts as applied)."""
        if offset <= self.applied.get(partition, -1):
            m.PS_SKIPPED.labels("already_applied").inc()
            return None
        try:
            batch = RowBatch.decode(value)
        except CorruptBatch as exc:
            m.PS_SKIPPED.labels("corrupt").inc()
            log.warning("gradients %d@%d corrupt, skipped: %s", partition, offset, exc)
            self.applied[partition] = offset
            return None
        if batch.kind != KIND_GRADIENTS or batch.dim != self.w:
            m.PS_SKIPPED.labels("wrong_layout").inc()
            self.applied[partition] = offset
            return None
        return batch

    def apply_batch(self, partition: int, offset: int, batch: RowBatch) -> None:
        if offset <= self.applied.get(partition, -1):
            return
        self.applied[partition] = offset
        refs = [(batch.table, i) for i in batch.ids.tolist()]
        states = [self.rows[r] for r in refs]
        rows = np.stack([s.row for s in states])
        accum = np.stack([s.accum for s in states])
        ok = adagrad_step(rows, accum, np.asarray(batch.rows, np.float32), self.settings.adagrad)
        name = TABLE_NAMES[batch.table]
        rejected = int((~ok).sum())
        if rejected:
            m.GRADIENT_ROWS.labels(name, "rejected_non_finite").inc(rejected)
        for j in np.flatnonzero(ok).tolist():
            s = states[j]
            s.row, s.accum = rows[j], accum[j]
            s.version += 1
            s.event_ms = max(s.event_ms, int(batch.event_ms[j]))
            self.dirty[partition].add(refs[j])
        m.PS_ROWS_APPLIED.labels(name).inc(int(ok.sum()))
        m.GRADIENT_MESSAGES.labels("applied").inc()

    def _ensure_loaded_many(self, missing: dict[int, set[int]]) -> None:
        """Load rows and accumulators not in memory: one pipelined round trip for all."""
        wanted = {
            t: sorted(i for i in ids if (t, i) not in self.rows) for t, ids in missing.items()
        }
        wanted = {t: ids for t, ids in wanted.items() if ids}
        if not wanted:
            return
        found = self._redis_retry(
            lambda: fetch_rows_and_accumulators(self.redis, self.keys, wanted, self.w)
        )
        init_acc = self.settings.adagrad.initial_accumulator
        for table, ids in wanted.items():
            fresh = initial_rows(np.asarray(ids, np.int64), table, self.settings.dim)
            rows, accums = found[table]
            for j, i in enumerate(ids):
                row, version, event_ms = rows.get(i, (fresh[j], 0, 0))
                acc = accums.get(i)
                if acc is None:
                    acc = np.full(self.w, init_acc, np.float32)
                self.rows[(table, i)] = RowState(row, acc, version, event_ms)

    # ----------------------------------------------------------------------------- flush
    def flush(self) -> None:
        """Persist dirty rows with the applied offsets (one transaction), then broadcast."""
        self._last_flush = time.monotonic()
        if not any(self.dirty.values()):
            return
        started = time.perf_counter()
        dirty = {p: refs for p, refs in self.dirty.items() if refs}
        self._redis_retry(lambda: self._persist(dirty))
        persisted = time.time()
        for refs in dirty.values():
            for ref in list(refs)[:256]:
                ev = self.rows[ref].event_ms
                if ev:
                    m.FRESHNESS_LAG.labels("global_applied").observe(
                        max(persisted - ev / 1000, 0.0)
                    )
        self._broadcast(dirty)
        self.dirty.clear()
        m.PS_FLUSHES.labels("ok").inc()
        m.PS_FLUSH_SECONDS.observe(time.perf_counter() - started)

    def _persist(self, dirty: dict[int, set[tuple[int, int]]]) -> None:
        by_table: dict[int, list[int]] = defaultdict(list)
        for refs in dirty.values():
            for table, i in refs:
                by_table[table].append(i)
        pipe = self.redis.pipeline(transaction=True)
        for table, ids in by_table.items():
            states = [self.rows[(table, i)] for i in ids]
            fields = [row_key(i) for i in ids]
            name = TABLE_NAMES[table]
            pipe.hset(self.keys.embeddings(name), mapping=dict(zip(fields, encode_rows(
                np.stack([s.row for s in states]),
                np.fromiter((s.version for s in states), np.uint64, len(states)),
                np.fromiter((s.event_ms for s in states), np.int64, len(states)),
            ), strict=True)))  # fmt: skip
            accs = np.ascontiguousarray(np.stack([s.accum for s in states]), "<f4")
            pipe.hset(
                self.keys.optimizer(name),
                mapping=dict(zip(fields, (a.tobytes() for a in accs), strict=True)),
            )
        pipe.hset(self.keys.ps_applied, mapping={p: self.applied[p] for p in dirty})
        pipe.execute()

    def _broadcast(self, dirty: dict[int, set[tuple[int, int]]]) -> None:
        created = int(time.time() * 1000)
        for p, refs in dirty.items():
            by_table: dict[int, list[int]] = defaultdict(list)
            for table, i in refs:
                by_table[table].append(i)
            for table, all_ids in by_table.items():
                # chunks stay far below Kafka's default 1 MB message limit
                for lo in range(0, len(all_ids), MAX_ROWS_PER_MESSAGE):
                    ids = all_ids[lo : lo + MAX_ROWS_PER_MESSAGE]
                    states = [self.rows[(table, i)] for i in ids]
                    batch = RowBatch(
                        KIND_UPDATES, table, np.asarray(ids, np.int64),
                        np.stack([s.row for s in states]),
                        np.asarray([s.version for s in states], np.uint64),
                        np.asarray([s.event_ms for s in states], np.int64),
                        partition=p, offset=self.applied[p], created_ms=created,
                    )  # fmt: skip
                    self._produce(
                        self.names.embeddings_updates, batch.encode(),
                        p % self.update_partitions, self._record_broadcast,
                    )  # fmt: skip
        self.producer.poll(0)

    def _produce(self, topic: str, value: bytes, partition: int, cb) -> None:
        while True:
            try:
                self.producer.produce(topic, value=value, partition=partition, on_delivery=cb)
                return
            except BufferError:  # local queue full: let deliveries drain
                self.producer.poll(0.05)

    def _record_broadcast(self, err, msg) -> None:
        if err is not None:
            log.warning("update broadcast failed: %s", err)
            return
        # only a start position for new workers; the next broadcast records it again
        with contextlib.suppress(*REDIS_DOWN):
            self.redis.hset(self.keys.ps_broadcast, str(msg.partition()), msg.offset())

    # ----------------------------------------------------------------------------- redis
    def _redis_retry(self, op):
        """Run ``op``; while Redis is down, pause consumption and retry (nothing committed)."""
        warned = False
        while True:
            try:
                result = op()
            except REDIS_DOWN as exc:
                if not warned:
                    log.warning("Redis unavailable (%s): pausing until it answers", exc)
                    warned = True
                    m.PS_FLUSHES.labels("redis_down").inc()
                self._pause(True)
                time.sleep(0.5)
                self.consumer.poll(0)  # keep group membership alive
                continue
            if warned:
                log.info("Redis is back: resuming")
            self._pause(False)
            return result

    def _pause(self, pause: bool) -> None:
        if pause == self._paused:
            return
        assignment = self.consumer.assignment()
        if assignment:
            (self.consumer.pause if pause else self.consumer.resume)(assignment)
        self._paused = pause


def run_param_server(settings: ParamServerSettings) -> int:
    return run_until_signalled("param_server", ParameterServer(settings).run, settings.metrics_port)
