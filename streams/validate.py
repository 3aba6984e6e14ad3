"""The validate stage of ``freshrec streams``, on confluent-kafka batches.

faust's per-message path caps a consumer at a few thousand messages per second on two cores
(docs/benchmarks.md), and every event passes through this stage. So it runs as a
confluent-kafka batch consumer (group ``{prefix}freshrec-streams-validate``) on a thread of the
streams process: decode each event with the ``schemas/`` codec, send rejects to
``events.dlq``, drop event ids seen in the dedupe window, keep users' recent clicks in Redis,
and repartition the valid events by item onto ``events.by_item`` as one compact JSON batch per
target partition. The faust app consumes those batches (the keyed, stateful stage).

Offsets are committed after the producer has delivered everything produced before them, so
nothing is lost; a replay after a crash repartitions events again, and the count stage skips
them by source offset (exactly-once counts). Dead letters and recent clicks are at-least-once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections import defaultdict
from itertools import pairwise

import numpy as np
import redis
from confluent_kafka import Producer, TopicPartition

from freshcore import clock
from freshcore import metrics as m
from freshcore.childmetrics import send_snapshots
from freshcore.dedupe import DedupeWindow
from freshcore.kafka import background_consumer, consume_batch, produce, producer_config
from freshcore.lifecycle import die_with_parent, set_from_signal
from freshcore.outage import StopRequested, is_outage
from freshcore.partitioner import str_partitions
from freshcore.redisconn import Packed, connect, is_cluster, run_packed
from freshcore.rediskeys import RedisKeys
from freshcore.resets import count_resets
from freshcore.resp import Pipelined, pack
from freshcore.service import Service
from freshcore.settings import LOG_FORMAT, stop_grace_s
from freshcore.topics import TopicNames
from schemas.codec import dead_letter, decode_events, encode_dead_letter
from schemas.contract import Rejected
from streams.attribution import Attribution
from streams.byitem import EVENT_CODES, run_bounds, split_records
from streams.pairing import ClickPairs
from streams.settings import StreamsSettings

log = logging.getLogger("freshrec.streams")
SERVICE = "streams"
COMMIT_INTERVAL_S = 1.0


def pack_recent(keys: RedisKeys, clicks, keep: int, ttl_s: int = 0) -> list[Packed]:
    """LPUSH each user's new clicks (oldest first, so the newest ends up in front), trim,
    and (``ttl_s``) let the list expire that long after this click: each user's commands
    packed by hand (none: nothing to send)."""
    per_user: dict[str, list[bytes]] = defaultdict(list)
    for user_id, item_id, ts in clicks:
        per_user[user_id].append(b"%s|%d" % (item_id.encode(), ts))
    stop = b"%d" % (keep - 1)
    expire = b"%d" % ttl_s
    out = []
    for key, entries in ((keys.user_recent(u).encode(), e) for u, e in per_user.items()):
        payload = pack(b"LPUSH", key, *entries) + pack(b"LTRIM", key, b"0", stop)
        if ttl_s:
            out.append(Packed(key, payload + pack(b"EXPIRE", key, expire), 3))
        else:
            out.append(Packed(key, payload, 2))
    return out


class ValidateStage(Service):
    name = "validate"
    beats = False  # a thread (or child process) of the streams app, whose event loop beats

    def __init__(self, settings: StreamsSettings, by_item_partitions: int) -> None:
        self.settings = settings
        conn = settings.conn
        self.names = TopicNames(conn.topic_prefix)
        self.keys = RedisKeys(conn.topic_prefix)
        self.by_item_partitions = by_item_partitions
        self.consumer = background_consumer(conn, "freshrec-streams-validate", "streams-validate")
        self.producer = Producer(producer_config(conn))
        self.redis = connect(conn.redis_url)
        self.pairing = ClickPairs(settings.covisit)
        """Each user's last clicks, for co-visitation pairs and sequential rules
        (``pairing.py``)."""
        # recent clicks are written without waiting for the reply (read at the next write
        # or before a commit): a round trip per batch was a sixth of this stage's time. A
        # cluster's are sent to their nodes and waited for (``run_packed``).
        self.recent = None if is_cluster(self.redis) else Pipelined(self.redis)
        self.attribution = Attribution(self.redis, self.keys)
        self.dedupe: dict[int, DedupeWindow] = {}
        self._last_commit = time.monotonic()
        self._uncommitted = False
        self._done: dict[int, int] = {}
        """Per ``events`` partition, the offset after the last batch processed whole: what a
        commit writes (the consumer's position may be past a batch that failed half-way)."""

    def _on_revoke(self, consumer, partitions) -> None:
        self._commit()
        for tp in partitions:
            self.dedupe.pop(tp.partition, None)
            self._done.pop(tp.partition, None)

    def run(self, stop: threading.Event) -> None:
        """Validate batches until ``stop``; then commit what was delivered. A batch that
        fails half-way (its exception ends the stage) commits nothing: commits write the
        offsets of batches processed whole (``_done``), never the consumer's position, so
        not even the commit of a revoke while the stage closes goes past it; the batch's
        valid events are read again by the next run."""
        super().run(stop)

    def start(self) -> None:
        # a committed offset retention has deleted past resumes at the log start: counted
        self.consumer.subscribe(
            [self.names.events],
            on_assign=lambda consumer, parts: count_resets(consumer, "streams-validate", parts),
            on_revoke=self._on_revoke,
        )

    def poll_once(self) -> None:
        # fill: each batch costs a by-item message per target partition and its share of a
        # commit; returning with the first event made the batches small and the hot-list lag
        # longer (p99 484 against 395 ms, docs/benchmarks.md)
        good = consume_batch(self.consumer, self.settings.batch_max, 0.05, "events", fill=True)
        if good:
            with m.STREAMS_BATCH_SECONDS.labels("validate").time():
                self.process(good)
            m.STREAMS_BATCH_SIZE.labels("validate").observe(len(good))
            done = self._done
            for msg in good:  # only now: a batch that raised above marks nothing done
                p, after = msg.partition(), msg.offset() + 1
                if after > done.get(p, -1):
                    done[p] = after
            self._uncommitted = True
        self.producer.poll(0)
        if time.monotonic() - self._last_commit >= COMMIT_INTERVAL_S:
            self._commit()

    def close(self, clean: bool) -> None:
        try:
            if clean:
                self._commit()
        finally:
            self.consumer.close()
            if self.recent is not None:
                with contextlib.suppress(redis.RedisError):
                    self.recent.close()

    def _commit(self) -> None:
        self._last_commit = time.monotonic()
        if not self._uncommitted:
            return
        with m.STREAMS_BATCH_SECONDS.labels("validate_commit").time():
            try:
                if self.recent is not None:  # the recent clicks before these offsets are written
                    self.recent.drain()
            except redis.RedisError as exc:
                if not is_outage(exc):
                    raise
                log.warning("offsets not committed, Redis unavailable: %s", exc)
                return
            if self.producer.flush(30):  # everything before these offsets is delivered first
                log.warning("repartitioned events not delivered yet; offsets not committed")
                return
            offsets = [TopicPartition(self.names.events, p, o) for p, o in self._done.items()]
            if not offsets:
                return
            try:
                self.consumer.commit(offsets=offsets, asynchronous=False)
                self._uncommitted = False
            except Exception as exc:  # a rebalance in flight: the next commit catches up
                log.info("commit skipped: %s", exc)

    def process(self, msgs) -> None:
        """Validate, dedupe and repartition one batch, column by column: each step is a
        comprehension or a numpy pass over the batch, not a Python loop body per event."""
        now = clock.now_ms()
        events = decode_events([x.value() for x in msgs], now, self.settings.limits)
        n_read = len(events)
        if Rejected in set(map(type, events)):
            msgs, events = self._dead_letters(msgs, events, now)
        n_bad = n_read - len(events)
        parts = [x.partition() for x in msgs]
        offsets = [x.offset() for x in msgs]
        fresh = self._first_times(parts, [e.event_id for e in events])
        if False in fresh:
            keep = [i for i, f in enumerate(fresh) if f]
            events = [events[i] for i in keep]
            parts = [parts[i] for i in keep]
            offsets = [offsets[i] for i in keep]
        n_ok = len(events)
        n_dup = n_read - n_bad - n_ok
        if n_ok:
            self._route(parts, offsets, events)
            if self.pairing.on:
                self._route_pairs(parts, offsets, events)
            clicks = [(e.user_id, e.item_id, e.ts_ms) for e in events if e.event_type == "click"]
            writes = (
                pack_recent(
                    self.keys, clicks, self.settings.recent_clicks, self.settings.recent_ttl_s
                )
                if clicks
                else []
            )
            writes += self.wait_for_redis(
                lambda: self.attribution.commands(events), "experiment attribution"
            )
            if writes:
                self._send_recent(writes)
        m.STREAMS_EVENTS.labels("valid").inc(n_ok)
        m.STREAMS_EVENTS.labels("duplicate").inc(n_dup)
        m.STREAMS_EVENTS.labels("rejected").inc(n_bad)

    def _send_recent(self, entries: list[Packed]) -> None:
        """Write recent clicks, waiting out a Redis outage (the batch's offsets are not
        committed meanwhile; the writes not acknowledged before it are sent again)."""

        def send() -> None:
            if self.recent is None:
                run_packed(self.redis, entries)
            else:
                payload = b"".join(e.payload for e in entries)
                self.recent.send(payload, sum(e.replies for e in entries))

        self.wait_for_redis(send, "recent clicks")

    def _dead_letters(self, msgs, events, now: int) -> tuple[list, list]:
        """Send the batch's rejects to ``events.dlq``; the messages and events that passed."""
        kept_msgs, kept = [], []
        for msg, e in zip(msgs, events, strict=True):
            if type(e) is not Rejected:
                kept_msgs.append(msg)
                kept.append(e)
                continue
            m.DEAD_LETTERS.labels(str(e.reason)).inc()
            letter = dead_letter(
                e,
                topic=msg.topic(),
                partition=msg.partition(),
                offset=msg.offset(),
                key=msg.key(),
                value=msg.value(),
                now_ms=now,
                service=SERVICE,
                limits=self.settings.dead_letters,
            )
            self._produce(self.names.events_dlq, encode_dead_letter(letter), None)
        return kept_msgs, kept

    def _first_times(self, parts: list[int], event_ids: list[str]) -> list[bool]:
        """Which events are not replays, each against its source partition's dedupe window
        (in source order within a partition; partitions are independent)."""
        if not parts:
            return []
        p = np.array(parts, np.int64)
        order = np.argsort(p, kind="stable")
        p = p[order]
        cuts = run_bounds(p)
        ids = np.array(event_ids, object)[order].tolist()
        fresh: list[bool] = []
        for lo, hi in pairwise(cuts):
            window = self.dedupe.get(int(p[lo]))
            if window is None:
                window = self.dedupe[int(p[lo])] = DedupeWindow(self.settings.dedupe_window)
            fresh += window.first_times(ids[lo:hi])
        if len(cuts) > 2:  # back to the batch's order
            back = np.empty(len(fresh), bool)
            back[order] = fresh
            return back.tolist()
        return fresh

    def _route(self, parts: list[int], offsets: list[int], events: list) -> None:
        """One ``events.by_item`` record per target partition, as columns (``BY_ITEM_COLUMNS``)."""
        items = [e.item_id for e in events]
        q = str_partitions(items, self.by_item_partitions)
        order = np.argsort(q, kind="stable")  # stable: offsets keep rising in each record
        q = q[order]
        cuts = run_bounds(q)
        codes = EVENT_CODES
        columns = [
            np.array(parts, np.int64)[order],
            np.array(offsets, np.int64)[order],
            np.array(items, object)[order],
            np.array([codes[e.event_type] for e in events], np.int64)[order],
            np.array([e.ts_ms for e in events], np.int64)[order],
            np.array([e.region for e in events], object)[order],
        ]
        for lo, hi in pairwise(cuts):
            for value in split_records(columns, lo, hi):
                self._produce(self.names.events_by_item, value, int(q[lo]))

    def _route_pairs(self, parts: list[int], offsets: list[int], events: list) -> None:
        """Each click's pairs (co-visitation both ways, sequential rules one way) to each
        anchor's ``events.by_item`` partition (``pairing.py``): one record per partition, a
        click's pairs never split between two records (the count stage skips replays by
        record)."""
        clicks = [j for j, e in enumerate(events) if e.event_type == "click"]
        if not clicks:
            return
        missing = self.pairing.unknown(events[j].user_id for j in clicks)
        if missing:
            self._seed(missing)
        records = self.pairing.records(
            [parts[j] for j in clicks],
            [offsets[j] for j in clicks],
            [events[j] for j in clicks],
            self.by_item_partitions,
        )
        for partition, value in records:
            self._produce(self.names.events_by_item, value, partition)

    def _seed(self, users: list[str]) -> None:
        """Windows of users this stage holds none for (a restart, a rebalance, a user not
        seen for long), from their recent clicks in Redis: only clicks older than a new one
        pair with it, and a click finds its own place in the sequence, so a replayed batch
        pairs as the first run did."""

        def read() -> list:
            pipe = self.redis.pipeline(transaction=False)
            for u in users:  # all of it: the window holds distinct items, the list repeats
                pipe.lrange(self.keys.user_recent(u), 0, -1)
            return pipe.execute()

        for user, raw in zip(
            users, self.wait_for_redis(read, "co-visitation windows"), strict=True
        ):
            clicks = []
            for entry in raw:
                item, _, ts = entry.decode().rpartition("|")
                if item and ts.lstrip("-").isdigit():
                    clicks.append((item, int(ts)))
            self.pairing.seed(user, clicks)

    def _produce(self, topic: str, value: bytes, partition: int | None) -> None:
        produce(self.producer, topic, value, partition=partition)


def run_validate_process(
    settings: StreamsSettings,
    by_item_partitions: int,
    parent_pid: int,
    metrics_conn,
    log_level: int = logging.INFO,
) -> None:
    """Entry point of the validate stage as its own process (``multiprocessing``, spawn):
    the streams process's other stages then have its core and GIL to themselves. Stops on
    SIGTERM or when the parent dies (committing what it delivered); its metrics reach
    the parent's endpoint through ``metrics_conn``; a failure exits non-zero and the parent,
    watching, exits too."""
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    stop = threading.Event()
    grace_s = stop_grace_s(os.environ)
    signal.signal(signal.SIGTERM, lambda *_: set_from_signal(stop, grace_s, "the validate process"))
    # Ctrl-C reaches the whole process group: the parent stops this process in its own
    # order (SIGTERM at exit); stopping here first would read as a failed stage there
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent_pid, stop)
    sender = threading.Thread(
        target=send_snapshots, args=(metrics_conn, stop), daemon=True, name="metrics"
    )
    sender.start()
    try:
        ValidateStage(settings, by_item_partitions).run(stop)
    except StopRequested:  # asked to stop while Redis was not answering: nothing committed
        log.info("validate stage: asked to stop while waiting for Redis")
    except BaseException:
        log.exception("the validate stage failed; exiting")
        logging.shutdown()
        os._exit(1)
    stop.set()
    sender.join(5)
    log.info("validate stage stopped")
