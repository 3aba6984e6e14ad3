"""``freshrec streams``: the faust app for event-time features.

Two stages (several instances split the partitions):

1. validate (``streams/validate.py``, confluent-kafka batches in a child process of this one,
   because every event passes through it, faust's per-message path is slow, and in one
   process the two stages took turns on one GIL): decodes each
   event with the ``schemas/`` codec (rejects go to ``events.dlq`` with their reason), drops
   replayed ``event_id``s inside a bounded window, keeps each user's recent clicks in Redis,
   and repartitions the valid events by item onto ``events.by_item``, one compact batch per
   target partition.
2. ``count``, a faust agent on ``events.by_item``: each partition owns a disjoint set of items
   and their forward-decayed counters (``item_state.py``). After every batch it persists the
   touched rows and the applied source offsets in one Redis transaction *before* faust
   acknowledges the batch, so a SIGKILL loses nothing and counts nothing twice. A timer
   publishes each partition's top-K hot lists to Redis, and once per features interval the
   serving features of the items persisted since (``StreamsSink.write_features``); readers
   merge the lists
   (``freshcore/hotscore.py``: ``merge_hot_lists``, or ``merge_published`` on the published
   JSON, as the workers do).

The catalogue (``items``) is written to Redis by a third stage (``streams/catalogue.py``,
confluent-kafka batches on another thread: as a faust agent it stalled counting while a large
catalogue loaded); items created within the new-item window go into a sorted set for the
new-items recall channel, and prices reach the count stage's hot scores through a queue.
``run_streams`` starts the stages beside the faust app, each taking the process down if it
fails, and faust's worker with a deadline on its stop (``streams/process.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Iterator

import faust
import numpy as np
import orjson
from confluent_kafka.admin import AdminClient
from mode.supervisors import CrashingSupervisor
from redis.asyncio import Redis

from freshcore import metrics as m
from freshcore.childmetrics import MergedRegistry
from freshcore.clock import now_ms
from freshcore.endpoints import serve_metrics
from freshcore.health import HEALTH
from freshcore.kafka import admin_config, partition_count, profile
from freshcore.lifecycle import settle_heap, stop_on_signals
from freshcore.logrepeat import hold_repeats
from freshcore.outage import StopRequested, is_outage
from freshcore.outage import until_redis_answers_async as until_redis_answers
from freshcore.redisconn import connect_async
from freshcore.rediskeys import RedisKeys
from freshcore.settings import state_dir, stop_grace_s
from freshcore.topics import TopicNames
from streams.byitem import by_item_columns
from streams.catalogue import CatalogueStage
from streams.covisit import PAIR_COLUMNS, PAIR_DISTANCE
from streams.item_state import ItemPartitionState
from streams.prices import PriceRetries
from streams.process import AIOKAFKA_LOGGERS, crash_on_error, faust_worker, start_validate_process
from streams.settings import StreamsSettings
from streams.sink import StreamsSink
from streams.transport import FetchTunedApp
from streams.validate import ValidateStage

log = logging.getLogger("freshrec.streams")
SERVICE = "streams"
LAG_SAMPLES_PER_PUBLISH = 256


@contextlib.contextmanager
def timed(stage: str, batch) -> Iterator[None]:
    m.STREAMS_BATCH_SIZE.labels(stage).observe(len(batch))
    with m.STREAMS_BATCH_SECONDS.labels(stage).time():
        yield


def _partition_count(settings: StreamsSettings, topic: str) -> int:
    return partition_count(AdminClient(admin_config(settings.conn)), topic)


class StreamsApp:
    """Builds the faust app and holds the state its agents share."""

    def __init__(self, settings: StreamsSettings) -> None:
        self.settings = settings
        conn = settings.conn
        self.names = TopicNames(conn.topic_prefix)
        self.keys = RedisKeys(conn.topic_prefix)
        self.by_item_partitions = _partition_count(settings, self.names.events_by_item)
        # each partition of events holds the lateness floor from the start (watermarks.py)
        events = _partition_count(settings, self.names.events)
        self.state_config = dataclasses.replace(settings.state, source_partitions=events)
        self.states: dict[int, ItemPartitionState] = {}
        self.restoring: dict[int, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.lag_samples: dict[int, list[int]] = defaultdict(list)
        self.dirty: set[int] = set()
        self._publish_not_before = 0.0
        self._features_not_before = 0.0
        self.persist_lock = asyncio.Lock()
        self.connecting = asyncio.Lock()
        self.price_retries = PriceRetries()
        self.price_updates: queue.SimpleQueue = queue.SimpleQueue()
        self.redis: Redis | None = None
        self.sink: StreamsSink | None = None
        self.app = self._build()

    # ------------------------------------------------------------------------------ faust
    def _build(self) -> faust.App:
        s, conn = self.settings, self.settings.conn
        p = profile(conn)
        brokers = ";".join(f"kafka://{h}" for h in conn.kafka_bootstrap_servers.split(","))
        datadir = state_dir() / "faust"
        datadir.mkdir(parents=True, exist_ok=True)  # faust creates only the last level
        app = FetchTunedApp(
            f"{conn.topic_prefix}freshrec-streams",
            broker=brokers,
            store="memory://",
            # All state lives in Redis; faust still wants a data directory for its tables.
            datadir=str(datadir / "{conf.id}"),
            autodiscover=False,
            web_enabled=False,
            topic_allow_declare=False,
            topic_disable_leader=True,
            consumer_auto_offset_reset="earliest",
            broker_session_timeout=p.session_timeout_ms / 1000,
            broker_heartbeat_interval=p.heartbeat_interval_ms / 1000,
            broker_commit_interval=1.0,
            stream_wait_empty=False,
            producer_linger=0.002,
            # An agent that raises must stop the worker, not be restarted past its batch:
            # faust would ack the batch, and counts would be lost. A restart resumes from
            # the offsets persisted in Redis instead.
            agent_supervisor=CrashingSupervisor,
            broker_credentials=conn.kafka_security.faust_credentials(),
        )
        app.fetch_wait_max_ms = s.fetch_wait_max_ms or p.background_fetch_wait_ms
        raw = {"key_serializer": "raw", "value_serializer": "raw"}
        by_item = app.topic(self.names.events_by_item, **raw)
        within = s.batch_within_ms / 1000

        @app.agent(by_item, name="count")
        async def count(stream):
            async for batch in stream.take_events(s.batch_max, within=within):
                with timed("count", batch):
                    await self._count_batch(batch)

        @app.timer(interval=s.publish_interval_ms / 1000)
        async def publish():
            await self._publish()

        @app.task
        async def connect():
            # The worker configured logging at INFO for our own state-change lines; faust,
            # mode and aiokafka narrate every step at INFO, so they only speak up on warnings.
            for name in ("faust", "mode", "aiokafka"):
                logging.getLogger(name).setLevel(logging.WARNING)
            await self._redis()

        app.on_partitions_revoked.connect(self._on_revoked)
        app.on_partitions_assigned.connect(self._on_assigned)
        return app

    async def _redis(self) -> StreamsSink:
        """The Redis sink, connected once; started while Redis is down, every stage that needs
        it waits (``until_redis_answers``) instead of crashing the app."""
        if self.sink is not None:
            return self.sink
        async with self.connecting:
            if self.sink is None:
                if self.redis is None:
                    self.redis = await connect_async(self.settings.conn.redis_url)
                r = self.redis
                # readers find an item's feature hash by the by-item partition count
                await until_redis_answers(
                    lambda: r.set(self.keys.feature_shards, self.by_item_partitions), "starting"
                )
                self.sink = StreamsSink(r, self.keys)
        return self.sink

    async def _on_revoked(self, sender, revoked, **kwargs) -> None:
        for tp in revoked:
            if tp.topic == self.names.events_by_item:
                self.states.pop(tp.partition, None)
                self.dirty.discard(tp.partition)
        m.STREAMS_PARTITIONS.set(len(self.states))

    async def _on_assigned(self, sender, assigned, **kwargs) -> None:
        owned = sorted(tp.partition for tp in assigned if tp.topic == self.names.events_by_item)
        m.ASSIGNED_PARTITIONS.labels("streams").set(len(assigned))
        log.info("assigned events.by_item partitions %s", owned)

    # ----------------------------------------------------------------------------- stages
    async def _state(self, partition: int) -> ItemPartitionState:
        state = self.states.get(partition)
        if state is not None:
            return state
        async with self.restoring[partition]:
            state = self.states.get(partition)
            if state is None:
                sink = await self._redis()
                state = await until_redis_answers(
                    lambda: sink.restore(partition, self.state_config), "restoring counts"
                )
                self.states[partition] = state
                m.STREAMS_PARTITIONS.set(len(self.states))
                log.info(
                    "partition %d: restored %d items, offsets %s",
                    partition,
                    state.n_items,
                    state.applied,
                )
        return state

    async def _count_batch(self, batch) -> None:
        sink = await self._redis()
        self._apply_prices()
        touched: set[int] = set()
        repartitioned: list[float] = []  # seconds from event time to the by_item record
        sampled: list[int] = []
        now = int(time.monotonic() * 1000)  # processing time: the source partitions' idleness
        for ev in batch:
            q = ev.message.partition
            state = await self._state(q)
            record = orjson.loads(ev.message.value)
            late_before, skipped_before = state.late, state.skipped
            if isinstance(record, dict) and PAIR_COLUMNS[0] in record:  # a click's pairs
                count_pairs(state, record, now)
                m.STREAMS_REPLAYED.inc(state.skipped - skipped_before)
                touched.add(q)
                continue
            columns = by_item_columns(record)
            m.STREAMS_COUNTED.inc(state.apply_columns(*columns, now_ms=now))
            m.STREAMS_LATE.inc(state.late - late_before)
            m.STREAMS_REPLAYED.inc(state.skipped - skipped_before)
            samples = self.lag_samples[q]
            if len(samples) < LAG_SAMPLES_PER_PUBLISH:
                taken = columns[4][: LAG_SAMPLES_PER_PUBLISH - len(samples)]
                samples.extend(taken)
                sampled.extend(taken)
                stamp = ev.message.timestamp  # seconds, set when the validate stage produced
                repartitioned.extend(stamp - ts / 1000 for ts in taken)
            touched.add(q)
        new = {q: self.states[q].take_new_items() for q in touched}
        wanted = [i for items in new.values() for i in items]
        prices = await until_redis_answers(lambda: sink.prices(wanted), "reading prices")
        for q, items in new.items():
            if items:
                self.states[q].set_prices({i: prices[i] for i in items if i in prices})
        await self._persist(sorted(touched))
        self.dirty.update(touched)
        below = min((s.late_below_ms(now) for s in self.states.values()), default=0)
        m.STREAMS_LATENESS_FLOOR.set(max(below, 0) / 1000)
        if sampled:
            counted = time.time() - np.asarray(sampled) / 1000
            m.observe_many(
                m.STREAMS_STAGE_LAG.labels("repartitioned"), np.maximum(repartitioned, 0)
            )
            m.observe_many(m.STREAMS_STAGE_LAG.labels("counted"), np.maximum(counted, 0))

    async def _refresh_prices(self, q: int, state: ItemPartitionState) -> None:
        """Fetch prices of items seen before their catalogue record, when due
        (``prices.py``: after 5 s, and twice as late each time a retry finds none)."""
        now = time.monotonic()
        if not self.price_retries.due(q, now):
            return
        missing = state.items_without_price()[:5000]
        found: dict[str, float] = {}
        if missing:
            sink = await self._redis()
            found = await sink.prices(missing)
            state.set_prices(found)
        self.price_retries.looked_up(q, now, found=bool(found or not missing))

    async def _persist(self, partitions: list[int]) -> None:
        # One flush at a time: two in flight could land out of order and leave an older
        # snapshot on top of a newer one.
        async with self.persist_lock:
            states = [(q, self.states[q]) for q in partitions if q in self.states]
            if states:
                sink = await self._redis()
                # a snapshot: written again as it is once Redis is back (the batch is not
                # acknowledged meanwhile, so nothing moves past it)
                lost = await until_redis_answers(lambda: sink.persist(states), "persisting counts")
                while lost:
                    # Redis lost a flush it had acknowledged (a failover): the partitions'
                    # whole state, written before anything past it is acknowledged
                    log.warning(
                        "partitions %s: Redis lost an acknowledged snapshot (failover?); "
                        "writing their whole state again",
                        lost,
                    )
                    m.STREAMS_REWRITES.inc(len(lost))
                    again = [(q, s) for q, s in states if q in lost]
                    lost = await until_redis_answers(
                        lambda again=again: sink.persist(again), "persisting counts"
                    )
                for _, state in states:
                    for reason, n in state.take_evictions().items():
                        m.STREAMS_EVICTED.labels(reason).inc(n)
                    m.STREAMS_COVISIT_TRIMMED.inc(state.take_trimmed())
                    m.STREAMS_SEQUEL_TRIMMED.inc(state.take_sequels_trimmed())
                held = self.states.values()
                m.STREAMS_ITEMS.set(sum(s.n_items for s in held))
                m.STREAMS_COVISIT_NEIGHBOURS.set(sum(s.covisit.entries for s in held))
                m.STREAMS_SEQUEL_SUCCESSORS.set(sum(s.sequel.entries for s in held))

    def _apply_prices(self) -> None:
        """Prices from the catalogue stage (another thread) into the partitions' states."""
        while True:
            try:
                prices = self.price_updates.get_nowait()
            except queue.Empty:
                return
            for state in self.states.values():
                known = {k: v for k, v in prices.items() if k in state.slots}
                if known:
                    state.set_prices(known)

    async def _publish(self) -> None:
        # At most half of the event loop for publishing: when a round took longer than half
        # the interval, the next waits as long as that round took, so counting is never starved.
        HEALTH.beat()  # the event loop goes round (liveness)
        if time.monotonic() < self._publish_not_before:
            return
        started = time.monotonic()
        try:
            await self._publish_round()
        except Exception as exc:  # the next round publishes what this one could not
            if not is_outage(exc):
                raise
            log.warning("hot lists not published, Redis unavailable: %s", exc)
        finally:
            took = time.monotonic() - started
            m.STREAMS_BATCH_SECONDS.labels("publish").observe(took)
            if took > self.settings.publish_interval_ms / 2000:
                self._publish_not_before = time.monotonic() + took

    async def _publish_round(self) -> None:
        sink = await self._redis()
        self._apply_prices()
        # Items first seen before their catalogue record: retry their prices (with backoff);
        # any price found changes hot scores, so the partition is persisted and republished.
        for q, state in list(self.states.items()):
            await self._refresh_prices(q, state)
            if state.touched:
                await self._persist([q])
                self.dirty.add(q)
        # every dirty partition's lists in one round trip (fewer awaits, a shorter round)
        payloads = {}
        for q in sorted(self.dirty):
            state = self.states.get(q)
            if state is not None:
                payloads[q] = state.hot_payloads(self.settings.hot_k, q, now_ms())
        self.dirty.clear()
        if payloads:
            await sink.publish_hot(payloads)
            published = time.time()
            for q, lists in payloads.items():
                lags = [published - ts / 1000 for ts in self.lag_samples.pop(q, [])]
                m.observe_many(m.HOT_LIST_LAG, np.maximum(lags, 0.0))
                for scope in lists:
                    m.HOT_LIST_PUBLISHES.labels(scope).inc()
        # then, once per features interval, the serving features of the items persisted
        # since: written here, not in each count batch's transaction, so an item counted in
        # several batches in between is written once (they are derived; restored partitions
        # rewrite them all); after the lists, which they would otherwise hold back (hot-list
        # lag p99 455 against ~400 ms in one round trip with them)
        if time.monotonic() < self._features_not_before:
            return
        self._features_not_before = time.monotonic() + self.settings.features_interval_ms / 1000
        cv = self.settings.covisit
        try:
            newest = await sink.write_features(self.states, cv.neighbours, cv.sequel_successors)
        except BaseException:  # due again, and written at the next round
            self._features_not_before = 0.0
            raise
        for stage, times in zip(("covisit", "sequel"), newest, strict=True):
            if times:
                lag = time.time() - np.asarray(times, np.float64) / 1000
                m.observe_many(m.STREAMS_STAGE_LAG.labels(stage), np.maximum(lag, 0.0))


def count_pairs(state: ItemPartitionState, record: dict, now_ms: int) -> None:
    """Count a pair record (co-visitation pairs and sequential rules: ``covisit.py``)."""
    rules = state.sequel_pairs
    pairs = (record[c] for c in PAIR_COLUMNS)
    counted = state.apply_pairs(*pairs, now_ms=now_ms, distances=record.get(PAIR_DISTANCE))
    m.STREAMS_SEQUEL_PAIRS.inc(state.sequel_pairs - rules)
    m.STREAMS_COVISIT_PAIRS.inc(counted - (state.sequel_pairs - rules))


def run_streams(settings: StreamsSettings) -> int:
    """Run one streams instance until SIGTERM/SIGINT."""
    grace_s = stop_grace_s(os.environ)
    # faust's Kafka client, with no broker answering, logs each failed fetch and metadata
    # request, ten times a second: each kind once per 30 s
    hold_repeats(map(logging.getLogger, AIOKAFKA_LOGGERS))
    metrics = MergedRegistry()
    serve_metrics(settings.metrics_port, metrics, redis_url=settings.conn.redis_url)
    # until faust's worker installs its own handlers, a stop ends the start-up as it ends a
    # worker's: waits for the broker or Redis give up (StopRequested), and the process exits
    # with 0 within the grace
    stopped = threading.Event()
    stop_on_signals(stopped, grace_s, "the streams app")
    try:
        streams = StreamsApp(settings)
    except StopRequested as exc:
        log.info("the streams app stopped before it started (%s)", exc)
        return 0
    log.info(
        "streams app %s: by-item partitions %d, fetch wait %s ms",
        streams.app.conf.id,
        streams.by_item_partitions,
        streams.app.fetch_wait_max_ms,
    )
    # The validate stage runs on confluent-kafka batches in a child process (or a thread:
    # FRESHREC_STREAMS_VALIDATE=thread), the catalogue stage on a thread of this process;
    # they stop with it (offsets not committed are replayed: the count stage skips replayed
    # events by offset, catalogue writes are idempotent).
    stop = threading.Event()
    stages = [("catalogue", CatalogueStage(settings, streams.price_updates))]
    if settings.validate_process:
        start_validate_process(settings, streams.by_item_partitions, metrics)
    else:
        stages.append(("validate", ValidateStage(settings, streams.by_item_partitions)))
    for name, stage in stages:
        threading.Thread(
            target=crash_on_error, args=(stage.run, stop, name), daemon=True, name=name
        ).start()
    worker = faust_worker(streams.app, grace_s)
    log.info("%d objects settled", settle_heap())
    if stopped.is_set():  # asked while the stages started: the validate child stops with us
        log.info("the streams app stopped before it started")
        return 0
    worker.execute_from_commandline()
    return 0
