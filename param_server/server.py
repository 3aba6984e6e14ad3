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

A message is decoded, or skipped with its reason, at the edge (``intake.py``). Rows are held
in dense per-table slabs (``table.py``); a poll's messages are laid end to end per table and
applied with vectorised operations (``gradlog.py``); the rows applied since the last flush
are kept apart (``dirty.py``) until the persister thread sends their snapshot
(``persister.py``), packed by numpy (``store.py``, ``freshcore/resp.py``); the update
broadcast and the start positions it gives new workers are in ``broadcast.py``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import defaultdict

import numpy as np
from confluent_kafka import OFFSET_BEGINNING, Producer

from freshcore import clock
from freshcore import metrics as m
from freshcore.kafka import (
    background_consumer,
    close_producer,
    consume_batch,
    partition_count,
    producer_config,
    take_assignment,
)
from freshcore.lifecycle import run_until_signalled, settle_heap
from freshcore.outage import until_redis_answers
from freshcore.redisconn import connect
from freshcore.rediskeys import RedisKeys
from freshcore.resets import count_resets
from freshcore.rowstore import row_shards
from freshcore.service import Service
from freshcore.topics import TopicNames
from param_server.broadcast import UpdateBroadcast, record_delivery, save_positions
from param_server.dirty import DirtyRows
from param_server.gradlog import Entry, GradientLog
from param_server.intake import decode_gradients
from param_server.persister import Persister, observe_freshness
from param_server.settings import ParamServerSettings
from param_server.store import (
    applied_offsets,
    claim_partitions,
    fetch_rows_and_accumulators,
    field_expiry,
    pack_persist,
    persist_fenced,
)
from param_server.table import ParamTable
from schemas.errors import FreshRecError
from schemas.rowbatch import TABLE_NAMES, RowBatch

log = logging.getLogger("freshrec.param_server")
EVICT_EVERY_S = 60.0


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
        self.broadcast = UpdateBroadcast(
            self.producer,
            self.names.embeddings_updates,
            settings.updates_half,
            self._record_broadcast,
        )
        self.tables = {t: ParamTable(self.w) for t in TABLE_NAMES}
        self.applied: dict[int, int] = {}
        self.acked: dict[int, int] = {}
        """partition -> the applied offset of the last transaction Redis acknowledged (or
        the one read at assignment): a persist finds Redis behind it after a failover."""
        self.dirty = DirtyRows()
        self.owned: set[int] = set()
        self.shards = 1
        """``gradients`` partitions: a row's partition (its hash tag in Redis) by its id."""
        self._last_flush = time.monotonic()
        self._newest_applied_ms = 0  # the newest event time persisted so far
        self._evicted_at = time.monotonic()
        self._paused = False
        self._field_expiry: str | None = None
        """HSETEX or HPEXPIRE where this Redis expires hash fields (probed at start)."""
        self._broadcast_positions: dict[int, int] = {}  # delivered, not yet recorded
        # ``store.persist_fenced`` as this module names it (a test slows it down here)
        self._persister = Persister(self.redis, self.keys, persist_fenced)
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
        # an applied offset retention has deleted past resumes at the log start: counted
        resume_at = {(tp.topic, tp.partition): tp.offset for tp in partitions}
        count_resets(consumer, "param-server", partitions, resume_at)
        take_assignment(consumer, partitions, self.settings.conn)
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
        # under an incremental protocol a revoke may leave partitions that are still owned
        m.ASSIGNED_PARTITIONS.labels("param-server").set(len(self.owned))
        for table in self.tables.values():  # reloaded from Redis on demand; another owner
            table.clear()  # may change them meanwhile
        log.info("revoked gradients partitions %s", sorted(tp.partition for tp in partitions))

    # ------------------------------------------------------------------------------ loop
    def start(self) -> None:
        topic = self.names.gradients
        self.broadcast.start()
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
            partition, offset = msg.partition(), msg.offset()
            applied = self.applied.get(partition, -1)
            batch = decode_gradients(partition, offset, msg.value(), applied, self.w, self.shards)
            if batch is not False:
                decoded.append((partition, offset, batch))
        self.apply_messages(decoded)
        self._finish_persist(wait=False)  # broadcast as soon as Redis has the rows
        due = (time.monotonic() - self._last_flush) * 1000 >= self.settings.flush_interval_ms
        if self.dirty.rows and (due or self.dirty.rows >= self.settings.max_dirty_rows):
            self.flush()
        self.producer.poll(0)
        self._save_broadcast_positions()

    # ----------------------------------------------------------------------------- apply
    def apply_messages(self, decoded: list[tuple[int, int, RowBatch | bool]]) -> None:
        """Apply decoded gradient messages (in log order per partition; ``True`` for one that
        is skipped but counts as applied), all of one poll together: one Redis round trip
        loads the rows not held, then each table applies its messages with
        ``ParamTable.apply_log`` — the result of applying them one by one."""
        advanced, per_table = self._in_turn(decoded)
        if not per_table:
            self.applied.update(advanced)
            return
        logs = {t: GradientLog.locate(self.tables[t], items) for t, items in per_table.items()}
        rebalances = self._rebalances
        loaded = self._ensure_loaded_many({t: g.missing for t, g in logs.items()})
        if self._rebalances != rebalances:
            # Redis was down and the retry's poll served a rebalance: the tables were cleared
            # and partitions may have moved (their offsets re-read from Redis). Apply again
            # what this instance still owns; the new owners apply the rest.
            self.apply_messages([d for d in decoded if d[0] in self.owned])
            return
        for t, gradients in logs.items():
            self._apply_log(t, gradients, loaded.get(t))
        self.applied.update(advanced)

    def _in_turn(
        self, decoded: list[tuple[int, int, RowBatch | bool]]
    ) -> tuple[dict[int, int], dict[int, list[Entry]]]:
        """The offset each partition advances to, and per table the messages to apply (those
        past the partition's applied offset, in log order; skipped ones only advance it)."""
        per_table: dict[int, list[Entry]] = defaultdict(list)
        # offsets advance once their rows are applied: a flush served meanwhile (a revoke
        # while the load below waits for Redis) persists only what the tables hold
        advanced: dict[int, int] = {}
        for seq, (partition, offset, batch) in enumerate(decoded):
            if offset <= advanced.get(partition, self.applied.get(partition, -1)):
                continue
            advanced[partition] = offset
            if batch is not True:
                per_table[batch.table].append((seq, partition, batch))
        return advanced, per_table

    def _apply_log(self, t: int, gradients: GradientLog, loaded: np.ndarray | None) -> None:
        """Apply one table's log (``loaded``: the slots its missing rows were loaded into)."""
        name = TABLE_NAMES[t]
        done = gradients.apply(self.tables[t], self.settings.adagrad_for(t), loaded)
        self.dirty.add_by_partition(t, done.slots, done.partitions)
        if done.rejected:
            m.GRADIENT_ROWS.labels(name, "rejected_non_finite").inc(done.rejected)
        m.PS_ROWS_APPLIED.labels(name).inc(done.pairs)
        m.GRADIENT_MESSAGES.labels("applied").inc(len(gradients.entries))

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
        init_acc, dim = self.settings.adagrad.initial_accumulator, self.settings.dim
        return {
            t: self.tables[t].add(ids, *found[t].completed(ids, t, dim, created[t], init_acc))
            for t, ids in wanted.items()
        }

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
        if self.dirty.rows:
            self._start_persist()
        if sync:
            self._finish_persist()
            self._maybe_evict()  # nothing unpersisted, nothing in flight

    @property
    def unpersisted_rows(self) -> int:
        """Rows applied that Redis may not have yet (dirty, or in the transaction in flight)."""
        return self.dirty.rows + self._persister.rows

    @property
    def dirty_rows(self) -> int:
        """Rows applied since the last flush (``DirtyRows.rows``)."""
        return self.dirty.rows

    def _start_persist(self) -> None:
        snapshot, oldest = self.dirty.snapshot(self.tables)
        offsets = {p: self.applied[p] for p in snapshot}
        owners = {p: self.owner[p] for p in snapshot}
        units = pack_persist(
            self.keys,
            snapshot,
            offsets,
            ttl_ms=self.settings.row_ttl_s * 1000,
            expiry=self._field_expiry,
        )
        self._persister.send(units, snapshot, offsets, owners, self.dirty.rows, oldest, self.acked)
        self.dirty.clear()

    def _finish_persist(self, wait: bool = True) -> None:
        """Once the transaction in flight is in Redis (sent again while Redis is down: it is
        a snapshot, so sending it twice writes the same), broadcast its rows."""
        finished = self._persister.finish(wait, self._redis_retry)
        if finished is None:
            return
        done, owned = finished
        if not owned:
            self._fence_off(done.owners)
        self.acked.update({p: o for p, o in done.offsets.items() if p in self.owned})
        self._rewrite_lost(owned.behind)
        self._newest_applied_ms = observe_freshness(done, self._newest_applied_ms)
        self.broadcast.send(done.snapshot, done.offsets, done.oldest)
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
                    self.dirty.add(p, t, slots)

    def _fence_off(self, owners: dict[int, str]) -> None:
        """Another instance claimed one of these partitions: drop everything unpersisted,
        write nothing more, and stop (``run`` re-raises; a restart resumes from Redis)."""
        self.fenced = True
        self.dirty.clear()
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

    def _record_broadcast(self, err, msg) -> None:
        """A delivery report of the update broadcast (``broadcast.record_delivery``)."""
        record_delivery(self._broadcast_positions, err, msg)

    def _save_broadcast_positions(self) -> None:
        """Where a starting worker may begin to follow the broadcast, in one write per loop
        round (``broadcast.save_positions``: while Redis is down or refusing, the positions
        wait for the next round, merged with newer ones)."""
        self._broadcast_positions = save_positions(self.redis, self.keys, self._broadcast_positions)

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
