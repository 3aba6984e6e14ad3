"""``freshrec param-server``: aggregate gradients, sparse Adagrad, persist, broadcast.

A consumer group on ``gradients``; each instance owns some partitions, and a row always
lives in one partition, so instances never touch the same row. Every gradient message is
applied as one unit, in offset order (rows clipped, non-finite rows rejected, Adagrad), so the
tables are a deterministic function of the input log. Every ``flush_interval_ms`` the touched
rows, their Adagrad accumulators and each partition's last applied offset are written to Redis
in one MULTI/EXEC (on a Redis Cluster one per partition, whose keys share its hash tag); then the new rows are broadcast on ``embeddings.updates`` with the
(partition, offset) they include. The transaction is a snapshot sent by a persister thread
while the next messages are applied; its rows are broadcast once Redis has answered, and
the next transaction starts only after that. On assignment a partition resumes right after its applied
offset in Redis, so after a crash nothing is lost and nothing is applied twice. While Redis is
unreachable the server pauses its partitions, keeps what it has in memory, commits nothing,
and resumes when Redis answers.

Rows are held in dense per-table slabs (``table.py``), applied a message at a time with
vectorised operations, and persisted with commands packed by numpy (``freshcore/resp.py``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from confluent_kafka import OFFSET_BEGINNING, Producer

from freshcore import clock
from freshcore import metrics as m
from freshcore.kafka import (
    background_consumer,
    close_producer,
    consume_batch,
    partition_count,
    produce,
    producer_config,
)
from freshcore.lifecycle import run_until_signalled, settle_heap
from freshcore.outage import is_outage, until_redis_answers
from freshcore.partitioner import row_partitions
from freshcore.redisconn import connect
from freshcore.rediskeys import RedisKeys
from freshcore.rowstore import row_shards
from freshcore.service import Service
from freshcore.topics import TopicNames
from param_server.settings import ParamServerSettings
from param_server.store import (
    PersistUnit,
    applied_offsets,
    claim_partitions,
    fetch_rows_and_accumulators,
    field_expiry,
    pack_persist,
    persist_fenced,
)
from param_server.table import ParamTable
from schemas.errors import FreshRecError
from schemas.rowbatch import KIND_GRADIENTS, KIND_UPDATES, TABLE_NAMES, CorruptBatch, RowBatch
from schemas.rows import initial_rows, version_floor

log = logging.getLogger("freshrec.param_server")
MAX_ROWS_PER_MESSAGE = 1000
EVICT_EVERY_S = 60.0


@dataclass
class _Persist:
    """A transaction handed to the persister thread, and what to broadcast once it is in."""

    future: Future
    units: list[PersistUnit]
    snapshot: dict[int, dict[int, tuple[np.ndarray, ...]]]
    """partition -> table -> (ids, rows, accumulators, versions, event times), copies."""
    offsets: dict[int, int]
    owners: dict[int, str]
    rows: int
    started: float
    oldest: dict[int, dict[int, np.ndarray]]
    """partition -> table -> the oldest event time each snapshot row's new gradients hold."""
    acked: dict[int, int]
    """``ParamServer.acked`` when it was sent: Redis behind it lost a transaction."""


class FencedOff(FreshRecError, RuntimeError):
    """Another instance owns a partition this one still held (it was assigned elsewhere while
    this one stalled): nothing was written; the process must stop and restart from Redis."""


class ParameterServer(Service):
    name = "parameter server"

    def __init__(self, settings: ParamServerSettings) -> None:
        self.settings = settings
        conn = settings.conn
        self.names = TopicNames(conn.topic_prefix)
        self.keys = RedisKeys(conn.topic_prefix)
        self.redis = connect(conn.redis_url, socket_timeout=5)
        self.w = settings.dim + 1
        self.consumer = background_consumer(conn, "freshrec-param-server", "param-server")
        self.producer = Producer(producer_config(conn))
        self.tables = {t: ParamTable(self.w) for t in TABLE_NAMES}
        self.applied: dict[int, int] = {}
        self.acked: dict[int, int] = {}
        """partition -> the applied offset of the last transaction Redis acknowledged (or
        the one read at assignment): a persist finds Redis behind it after a failover."""
        self.dirty: dict[int, dict[int, list[np.ndarray]]] = {}
        """partition -> table -> slots applied since the last flush (arrays, may repeat)."""
        self.dirty_rows = 0
        self.owned: set[int] = set()
        self.update_partitions = 1
        self.shards = 1
        """``gradients`` partitions: a row's partition (its hash tag in Redis) by its id."""
        self._last_flush = time.monotonic()
        self._newest_applied_ms = 0  # the newest event time persisted so far
        self._evicted_at = time.monotonic()
        self._paused = False
        self._field_expiry: str | None = None
        """HSETEX or HPEXPIRE where this Redis expires hash fields (probed at start)."""
        self._broadcast_positions: dict[int, int] = {}  # delivered, not yet recorded
        self._persister = ThreadPoolExecutor(1, thread_name_prefix="ps-persist")
        self._inflight: _Persist | None = None
        self.instance = uuid.uuid4().hex[:12]
        self._claims = 0
        self.owner: dict[int, str] = {}
        """partition -> the token this instance claimed it with (``ps:owner`` in Redis)."""
        self._rebalances = 0
        """Rebalance callbacks served so far (one may come inside a Redis retry's poll)."""
        self.fenced = False

    # ------------------------------------------------------------------------ assignment
    def _on_assign(self, consumer, partitions) -> None:
        # claimed before the offsets are read: a former owner's transaction after this fails
        self._rebalances += 1
        self._claims += 1
        token = f"{self.instance}-{self._claims}"
        claims = {tp.partition: token for tp in partitions}
        self._redis_retry(lambda: claim_partitions(self.redis, self.keys, claims))
        self.owner.update(claims)
        assigned = [tp.partition for tp in partitions]
        applied = self._redis_retry(lambda: applied_offsets(self.redis, self.keys, assigned))
        for tp in partitions:
            done = applied.get(tp.partition)
            self.applied[tp.partition] = -1 if done is None else done
            if done is not None:
                self.acked[tp.partition] = done
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
        self._rebalances += 1
        self.flush(sync=True)  # in Redis before the next owner reads it
        for tp in partitions:
            self.owned.discard(tp.partition)
            self.applied.pop(tp.partition, None)
            self.acked.pop(tp.partition, None)
            self.owner.pop(tp.partition, None)
        for table in self.tables.values():  # reloaded from Redis on demand; another owner
            table.clear()  # may change them meanwhile
        log.info("revoked gradients partitions %s", sorted(tp.partition for tp in partitions))

    # ------------------------------------------------------------------------------ loop
    def start(self) -> None:
        topic = self.names.gradients
        self.update_partitions = partition_count(self.producer, self.names.embeddings_updates)
        gradients = partition_count(self.producer, topic)
        self.shards = self._redis_retry(lambda: row_shards(self.redis, self.keys, gradients))
        if self.settings.row_ttl_s > 0:
            self._field_expiry = self._redis_retry(lambda: field_expiry(self.redis, self.keys))
            if self._field_expiry is None:
                log.warning(
                    "this Redis has no hash field expiry (Redis < 7.4, Valkey < 9): rows in "
                    "Redis will not expire; they still leave this server's memory"
                )
        self.consumer.subscribe([topic], on_assign=self._on_assign, on_revoke=self._on_revoke)
        log.info(
            "parameter server on %s (dim %d), %d objects settled",
            topic,
            self.settings.dim,
            settle_heap(),
        )

    def close(self, clean: bool) -> None:
        try:
            if clean:
                self.flush(sync=True)
        finally:
            try:
                self.consumer.close()  # its revoke flushes (and waits for) what is left
            finally:
                self._persister.shutdown(wait=True)
                close_producer(self.producer, 10)  # its delivery reports give the positions
                self._save_broadcast_positions()

    def poll_once(self) -> None:
        decoded = []
        for msg in consume_batch(self.consumer, 500, 0.02, "gradients"):
            batch = self._decode(msg.partition(), msg.offset(), msg.value())
            if batch is not False:
                decoded.append((msg.partition(), msg.offset(), batch))
        self.apply_messages(decoded)
        self._finish_persist(wait=False)  # broadcast as soon as Redis has the rows
        due = (time.monotonic() - self._last_flush) * 1000 >= self.settings.flush_interval_ms
        if self.dirty_rows and (due or self.dirty_rows >= self.settings.max_dirty_rows):
            self.flush()
        self.producer.poll(0)
        self._save_broadcast_positions()

    # ----------------------------------------------------------------------------- apply
    def _decode(self, partition: int, offset: int, value: bytes) -> RowBatch | bool:
        """The message's batch; ``False`` if it was applied before (skipped); ``True`` if it
        is corrupt or foreign: skipped, and its offset counts as applied in its turn."""
        if offset <= self.applied.get(partition, -1):
            m.PS_SKIPPED.labels("already_applied").inc()
            return False
        try:
            batch = RowBatch.decode(value)
        except CorruptBatch as exc:
            m.PS_SKIPPED.labels("corrupt").inc()
            log.warning("gradients %d@%d corrupt, skipped: %s", partition, offset, exc)
            return True
        if batch.kind != KIND_GRADIENTS or batch.dim != self.w:
            m.PS_SKIPPED.labels("wrong_layout").inc()
            return True
        if self.shards > 1 and len(batch.ids):
            routed = row_partitions(np.asarray(batch.ids, np.int64), self.shards)
            if (routed != partition).any():  # its rows live under another partition's tag
                m.PS_SKIPPED.labels("misrouted").inc()
                log.warning(
                    "gradients %d@%d has rows of other partitions (keyed by row id, murmur2), "
                    "skipped",
                    partition,
                    offset,
                )
                return True
        return batch

    def apply_messages(self, decoded: list[tuple[int, int, RowBatch | bool]]) -> None:
        """Apply decoded gradient messages (in log order per partition; ``True`` for one that
        is skipped but counts as applied), all of one poll together: one Redis round trip loads the rows not held, then each table applies its
        messages with ``ParamTable.apply_log`` — the result of applying them one by one."""
        per_table: dict[int, list[tuple[int, int, RowBatch]]] = defaultdict(list)
        # offsets advance once their rows are applied: a flush served meanwhile (a revoke
        # while the load below waits for Redis) persists only what the tables hold
        advanced: dict[int, int] = {}
        for seq, (partition, offset, batch) in enumerate(decoded):
            if offset <= advanced.get(partition, self.applied.get(partition, -1)):
                continue
            advanced[partition] = offset
            if batch is not True:
                per_table[batch.table].append((seq, partition, batch))
        if not per_table:
            self.applied.update(advanced)
            return
        log_of: dict[int, tuple[np.ndarray, ...]] = {}
        missing: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for t, items in per_table.items():
            ids = np.concatenate([np.asarray(b.ids, np.int64) for _, _, b in items])
            event_ms = np.concatenate([np.asarray(b.event_ms, np.int64) for _, _, b in items])
            oldest = np.concatenate([np.asarray(b.oldest_ms, np.int64) for _, _, b in items])
            distinct, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
            at = self.tables[t].lookup(distinct)
            held = at >= 0
            # a row Redis lacks is created by the first of these entries (log order)
            missing[t] = (distinct[~held], event_ms[first[~held]])
            log_of[t] = (at, held, inverse, event_ms, oldest)
        rebalances = self._rebalances
        loaded = self._ensure_loaded_many(missing)
        if self._rebalances != rebalances:
            # Redis was down and the retry's poll served a rebalance: the tables were cleared
            # and partitions may have moved (their offsets re-read from Redis). Apply again
            # what this instance still owns; the new owners apply the rest.
            self.apply_messages([d for d in decoded if d[0] in self.owned])
            return
        for t, items in per_table.items():
            table, name = self.tables[t], TABLE_NAMES[t]
            at, held, inverse, event_ms, oldest = log_of[t]
            if t in loaded:
                at[~held] = loaded[t]
            slots = at[inverse]
            grads = np.concatenate([b.rows for _, _, b in items])
            sizes = [len(b) for _, _, b in items]
            message = np.repeat([seq for seq, _, _ in items], sizes)
            part = np.repeat([p for _, p, _ in items], sizes)
            applied, pairs, rejected = table.apply_log(
                slots, grads, event_ms, message, self.settings.adagrad_for(t), oldest
            )
            # a row lives in one partition: the update carries that partition's offset
            held, first = np.unique(slots, return_index=True)
            owner = part[first][np.searchsorted(held, applied)]  # applied ⊆ held, both sorted
            table.partition[applied] = owner
            for p in np.unique(owner).tolist():
                self.dirty.setdefault(p, {}).setdefault(t, []).append(applied[owner == p])
            self.dirty_rows += len(applied)
            if rejected:
                m.GRADIENT_ROWS.labels(name, "rejected_non_finite").inc(rejected)
            m.PS_ROWS_APPLIED.labels(name).inc(pairs)
            m.GRADIENT_MESSAGES.labels("applied").inc(len(items))
        self.applied.update(advanced)

    def _ensure_loaded_many(
        self, missing: dict[int, tuple[np.ndarray, np.ndarray]]
    ) -> dict[int, np.ndarray]:
        """Load rows and accumulators not held (per table: distinct ids, and the event time
        of the gradient that would create each): one round trip. A row Redis does not have
        starts from its deterministic initial row, at ``version_floor`` of that time.
        Returns the new slots of each table's ids, in their order."""
        created = {t: first for t, (ids, first) in missing.items() if len(ids)}
        wanted = {t: ids for t, (ids, _) in missing.items() if len(ids)}
        if not wanted:
            return {}
        found = self._redis_retry(
            lambda: fetch_rows_and_accumulators(self.redis, self.keys, wanted, self.w, self.shards)
        )
        init_acc = self.settings.adagrad.initial_accumulator
        slots: dict[int, np.ndarray] = {}
        for table, ids in wanted.items():
            got = found[table]
            n = len(ids)
            rows = np.empty((n, self.w), np.float32)
            versions = np.zeros(n, np.uint64)
            event_ms = np.zeros(n, np.int64)
            rows[got.found], versions[got.found], event_ms[got.found] = (
                got.rows,
                got.versions,
                got.event_ms,
            )
            if not got.found.all():
                absent = ~got.found
                rows[absent] = initial_rows(ids[absent], table, self.settings.dim)
                versions[absent] = version_floor(created[table][absent])
            accum = np.full((n, self.w), init_acc, np.float32)
            accum[got.has_accum] = got.accum
            slots[table] = self.tables[table].add(ids, rows, accum, versions, event_ms)
        return slots

    # ----------------------------------------------------------------------------- flush
    def flush(self, sync: bool = False) -> None:
        """Persist the dirty rows with the applied offsets (one transaction), then broadcast
        them. Pipelined: the transaction is a snapshot sent by the persister thread while
        this one applies the next messages; it is finished (broadcast) as soon as Redis
        answers, and always before the next one starts. ``sync`` waits for it here."""
        self._last_flush = time.monotonic()
        if self.fenced:
            return
        self._finish_persist()
        sync = sync or self._evict_due()
        if self.dirty_rows:
            self._start_persist()
        if sync:
            self._finish_persist()
            self._maybe_evict()  # nothing unpersisted, nothing in flight

    @property
    def unpersisted_rows(self) -> int:
        """Rows applied that Redis may not have yet (dirty, or in the transaction in flight)."""
        return self.dirty_rows + (self._inflight.rows if self._inflight else 0)

    def _start_persist(self) -> None:
        snapshot: dict[int, dict[int, tuple[np.ndarray, ...]]] = {}
        oldest: dict[int, dict[int, np.ndarray]] = {}
        for p, tables in self.dirty.items():
            for t, parts in tables.items():
                slots, tab = np.unique(np.concatenate(parts)), self.tables[t]
                rows = (
                    tab.ids[slots],
                    tab.rows[slots],
                    tab.accum[slots],
                    tab.version[slots],
                    tab.event_ms[slots],
                )
                snapshot.setdefault(p, {})[t] = rows
                oldest.setdefault(p, {})[t] = tab.take_oldest(slots)
        offsets = {p: self.applied[p] for p in self.dirty}
        owners = {p: self.owner[p] for p in self.dirty}
        units = pack_persist(
            self.keys,
            snapshot,
            offsets,
            ttl_ms=self.settings.row_ttl_s * 1000,
            expiry=self._field_expiry,
        )
        self._inflight = _Persist(
            self._persister.submit(
                persist_fenced, self.redis, self.keys, units, owners, acked=dict(self.acked)
            ),
            units,
            snapshot,
            offsets,
            owners,
            self.dirty_rows,
            time.perf_counter(),
            oldest,
            dict(self.acked),
        )
        self.dirty.clear()
        self.dirty_rows = 0

    def _finish_persist(self, wait: bool = True) -> None:
        """Once the transaction in flight is in Redis (sent again while Redis is down: it is
        a snapshot, so sending it twice writes the same), broadcast its rows."""
        done = self._inflight
        if done is None or (not wait and not done.future.done()):
            return
        try:
            owned = done.future.result()
        except Exception as exc:
            if not is_outage(exc):
                raise
            # the retry serves rebalance callbacks: a revoke's flush may finish this one
            owned = self._redis_retry(
                lambda: (
                    self._inflight is not done
                    or persist_fenced(
                        self.redis, self.keys, done.units, done.owners, acked=done.acked
                    )
                )
            )
            if self._inflight is not done:  # finished (and broadcast) inside the retry
                return
        self._inflight = None
        if not owned:
            self._fence_off(done.owners)
        self.acked.update({p: o for p, o in done.offsets.items() if p in self.owned})
        self._rewrite_lost(owned.behind)
        persisted_ms = time.time() * 1000
        times = np.concatenate(
            [rows[4] for tables in done.snapshot.values() for rows in tables.values()]
        )
        times = times[times > 0]
        oldest = np.concatenate([o for tables in done.oldest.values() for o in tables.values()])
        oldest = oldest[oldest > 0]  # each row from the oldest event its new gradients hold
        m.observe_many(
            m.FRESHNESS_LAG.labels("global_applied"),
            np.maximum(persisted_ms - oldest, 0.0) / 1000,
        )
        if len(times):
            self._newest_applied_ms = max(self._newest_applied_ms, int(times.max()))
            m.FRESHNESS_EVENT_TIME.labels("global_applied").set(self._newest_applied_ms / 1000)
        self._broadcast(done.snapshot, done.offsets, done.oldest)
        m.PS_FLUSHES.labels("ok").inc()
        m.PS_FLUSH_SECONDS.observe(time.perf_counter() - done.started)

    def _rewrite_lost(self, partitions: tuple[int, ...]) -> None:
        """Redis lost an acknowledged transaction of these partitions (a failover): every
        row their messages updated since it was loaded goes with the next flush."""
        if not partitions:
            return
        log.warning(
            "gradients partitions %s: Redis lost an acknowledged transaction (failover?); "
            "writing their rows again",
            list(partitions),
        )
        for p in set(partitions) & self.owned:
            m.PS_REWRITES.inc()
            for t, table in self.tables.items():
                slots = table.slots_of(p)
                if len(slots):
                    self.dirty.setdefault(p, {}).setdefault(t, []).append(slots)
                    self.dirty_rows += len(slots)

    def _fence_off(self, owners: dict[int, str]) -> None:
        """Another instance claimed one of these partitions: drop everything unpersisted,
        write nothing more, and stop (``run`` re-raises; a restart resumes from Redis)."""
        self.fenced = True
        self.dirty.clear()
        self.dirty_rows = 0
        for table in self.tables.values():
            table.clear()
        m.PS_FLUSHES.labels("fenced_off").inc()
        raise FencedOff(
            f"gradients partitions {sorted(owners)} are owned by another parameter-server "
            "instance (claimed while this one stalled): nothing written; stopping"
        )

    def _evict_due(self) -> bool:
        return self.settings.row_ttl_s > 0 and time.monotonic() - self._evicted_at >= EVICT_EVERY_S

    def _maybe_evict(self) -> None:
        """Rows not updated for ``row_ttl_s`` leave memory (checked once a minute, by a
        synchronous flush: nothing is unpersisted then)."""
        if not self._evict_due() or self.unpersisted_rows:
            return
        self._evicted_at = time.monotonic()
        ttl = self.settings.row_ttl_s
        cutoff = clock.now_ms() - ttl * 1000
        for t, table in self.tables.items():
            gone = table.evict_older_than(cutoff)
            if gone:
                m.PS_ROWS_EVICTED.labels(TABLE_NAMES[t]).inc(gone)
                log.info("%d %s rows not updated for %d s left memory", gone, TABLE_NAMES[t], ttl)

    def _broadcast(
        self,
        snapshot: dict[int, dict[int, tuple[np.ndarray, ...]]],
        offsets: dict[int, int],
        oldest: dict[int, dict[int, np.ndarray]],
    ) -> None:
        created = clock.now_ms()
        for p, tables in snapshot.items():
            for t, (ids, rows, _, versions, event_ms) in tables.items():
                # chunks stay far below Kafka's default 1 MB message limit
                for lo in range(0, len(ids), MAX_ROWS_PER_MESSAGE):
                    chunk = slice(lo, lo + MAX_ROWS_PER_MESSAGE)
                    batch = RowBatch(
                        KIND_UPDATES,
                        t,
                        ids[chunk],
                        rows[chunk],
                        versions[chunk],
                        event_ms[chunk],
                        partition=p,
                        offset=offsets[p],
                        created_ms=created,
                        oldest_ms=oldest[p][t][chunk],
                    )
                    self._produce(
                        self.names.embeddings_updates,
                        batch.encode(half=self.settings.updates_half),
                        p % self.update_partitions,
                        self._record_broadcast,
                    )
        self.producer.poll(0)

    def _produce(self, topic: str, value: bytes, partition: int, cb) -> None:
        produce(self.producer, topic, value, partition=partition, on_delivery=cb)

    def _record_broadcast(self, err, msg) -> None:
        if err is not None:
            # the rows are persisted; workers see them at their next update, or load them
            # from Redis when they start
            log.warning("update broadcast failed: %s", err)
            m.PS_BROADCASTS.labels("failed").inc()
            return
        m.PS_BROADCASTS.labels("delivered").inc()
        p = msg.partition()
        self._broadcast_positions[p] = max(self._broadcast_positions.get(p, -1), msg.offset())

    def _save_broadcast_positions(self) -> None:
        """Where a starting worker may begin to follow the broadcast: the offset of an update
        already delivered (so persisted), per partition, in one write per loop round. Only
        a start position: one written late or lost makes a new worker replay more updates,
        which it installs only where they are newer."""
        if not self._broadcast_positions:
            return
        positions, self._broadcast_positions = self._broadcast_positions, {}
        try:
            self.redis.hset(self.keys.ps_broadcast, mapping=positions)
        except Exception as exc:  # down, or refusing (at maxmemory): the next round writes them
            if not is_outage(exc):
                raise
            for p, offset in positions.items():
                mine = self._broadcast_positions.get(p, -1)
                self._broadcast_positions[p] = max(mine, offset)

    # ----------------------------------------------------------------------------- redis
    def _redis_retry(self, op):
        """Run ``op``; while Redis is down, pause consumption and retry (nothing committed)."""

        def waiting(first: bool) -> None:
            if first:
                m.PS_FLUSHES.labels("redis_down").inc()
            self._pause(True)
            self.consumer.poll(0)  # keep group membership alive

        result = until_redis_answers(
            op, self.name, wait_s=0.5, while_waiting=waiting, stop=self._stop
        )
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
    try:
        return run_until_signalled(
            "param_server",
            ParameterServer(settings).run,
            settings.metrics_port,
            settings.conn.redis_url,
        )
    except FencedOff as exc:
        log.error("%s", exc)
        return 3
