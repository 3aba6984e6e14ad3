"""What FreshRec gets from Apache Kafka and the embedded Tansu broker cannot show (it neither
compacts nor keeps anything across a restart), held on Apache Kafka: the ``items`` topic is
compacted, so a catalogue streams app started from scratch rebuilds from what compaction
left; and a broker stopped and started again on its data keeps every record and every
committed offset, so a FreshRec consumer resumes where it committed. KIP-848's consumer group
protocol is in ``test_kafka_kip848.py``. Each test skips, saying why, where Apache Kafka
does not run (no Java 17 or newer, or its jars not fetched)."""

from __future__ import annotations

import queue
import time
import uuid

import pytest
import redis as redis_lib
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ResourceType,
)

from freshcore import clock
from freshcore.kafka import admin_config, consumer_config, producer_config
from freshcore.partitioner import kafka_partition
from freshcore.rediskeys import RedisKeys
from freshcore.topics import TopicNames, catalogue_with, ensure_topics
from freshrec.app.stack import EmbeddedStack, StackError, pid_alive
from schemas.codec import encode_item
from schemas.records import Item
from streams.catalogue import CatalogueStage
from streams.settings import StreamsSettings

from .conftest import TEST_PARTITIONS, Services, wait_for
from .kafka_harness import can_run_apache_kafka, on_a_thread, on_apache_kafka
from .streams_harness import produce

CATALOGUE_GROUP = "freshrec-streams-catalogue"
"""The catalogue stage's consumer group (``streams/catalogue.py``), under the topic prefix."""
FAST_COMPACTION = {
    # a segment rolls at the first append 100 ms after it opened; only closed segments are
    # cleaned, and the broker's cleaner looks every second (the stack's log.cleaner.backoff.ms)
    "segment.ms": "100",
    "min.cleanable.dirty.ratio": "0.01",
    "min.compaction.lag.ms": "0",
}
"""Topic settings under which the cleaner compacts ``items`` within seconds, not days."""


def catalogue_stage(conn):
    """The streams app's catalogue stage on a thread; its failure is raised on exit."""
    return on_a_thread(CatalogueStage(StreamsSettings(conn), queue.SimpleQueue()), "catalogue")


def read_log(conn, topic: str, timeout_s: float = 60.0) -> list[tuple]:
    """Every record of ``topic`` from its log start to its end as it is now: (partition,
    offset, key, value), read without a group."""
    c = Consumer(consumer_config(conn, None))
    try:
        ends = {
            q: c.get_watermark_offsets(TopicPartition(topic, q), timeout=10)[1]
            for q in range(TEST_PARTITIONS)
        }
        c.assign([TopicPartition(topic, q, OFFSET_BEGINNING) for q in ends])
        left, records = {q for q, end in ends.items() if end > 0}, []
        deadline = time.monotonic() + timeout_s
        while left:
            assert time.monotonic() < deadline, f"{topic} not read to its end in {timeout_s}s"
            msg = c.poll(0.2)
            if msg is not None and not msg.error():
                records.append((msg.partition(), msg.offset(), msg.key(), msg.value()))
            # a position, not the last offset read: compaction may have removed that record
            at = c.position([TopicPartition(topic, q) for q in left])
            left -= {tp.partition for tp in at if tp.offset >= ends[tp.partition]}
        return sorted(records)
    finally:
        c.close()


def committed(conn, topic: str) -> dict[int, int]:
    """The catalogue group's committed offset of each partition of ``topic`` (-1001: none)."""
    c = Consumer(consumer_config(conn, conn.topic_prefix + CATALOGUE_GROUP))
    try:
        found = c.committed([TopicPartition(topic, q) for q in range(TEST_PARTITIONS)], timeout=15)
        return {tp.partition: tp.offset for tp in found}
    finally:
        c.close()


def ends_of(conn, topic: str) -> dict[int, int]:
    c = Consumer(consumer_config(conn, None))
    try:
        return {
            q: c.get_watermark_offsets(TopicPartition(topic, q), timeout=10)[1]
            for q in range(TEST_PARTITIONS)
        }
    finally:
        c.close()


def catalogue(conn) -> dict[str, float]:
    """The catalogue in Redis: item -> price."""
    r = redis_lib.Redis.from_url(conn.redis_url)
    return {
        k.decode(): float(v) for k, v in r.hgetall(RedisKeys(conn.topic_prefix).item_price).items()
    }


def forget_catalogue(conn) -> None:
    """The catalogue gone from Redis, as a streams app's from scratch would find it."""
    keys = RedisKeys(conn.topic_prefix)
    redis_lib.Redis.from_url(conn.redis_url).delete(
        keys.item_price,
        keys.item_category,
        keys.item_created_ms,
        keys.item_region,
        keys.new_items,
        keys.catalogue_version,
    )


def send(conn, records: list[tuple[bytes, Item | None]]) -> None:
    """Records on ``items``: (key, item), None a tombstone."""
    p = Producer(producer_config(conn))
    topic = TopicNames(conn.topic_prefix).items
    for key, item in records:
        p.produce(topic, key=key, value=None if item is None else encode_item(item))
    assert p.flush(30) == 0


def roll_segments(conn) -> None:
    """A tombstone of an item that never was on every partition of ``items``: the cleaner
    never cleans a partition's active segment, and ``segment.ms`` rolls it only at the next
    append after it."""
    p = Producer(producer_config(conn))
    for q in range(TEST_PARTITIONS):
        p.produce(TopicNames(conn.topic_prefix).items, key=b"filler", value=None, partition=q)
    assert p.flush(30) == 0


def compact_items_fast(conn) -> None:
    """The ``items`` topic, created by ``ensure_topics`` as compacted, set to compact soon."""
    admin = AdminClient(admin_config(conn))
    resource = ConfigResource(ResourceType.TOPIC, TopicNames(conn.topic_prefix).items)
    found = admin.describe_configs([resource])[resource].result(30)
    assert found["cleanup.policy"].value == "compact"
    resource = ConfigResource(
        ResourceType.TOPIC,
        resource.name,
        incremental_configs=[
            ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET)
            for k, v in FAST_COMPACTION.items()
        ],
    )
    admin.incremental_alter_configs([resource])[resource].result(30)


@on_apache_kafka
def test_a_tombstone_deletes_an_item_and_a_fresh_streams_app_rebuilds_from_the_compacted_log(conn):
    now, topic = clock.now_ms(), TopicNames(conn.topic_prefix).items
    compact_items_fast(conn)
    first, later = Item("i1", "c1", 10.0, now), Item("i1", "c1", 20.0, now)
    with catalogue_stage(conn):
        send(conn, [(b"i1", first), (b"i2", Item("i2", "c2", 5.0, now))])
        send(conn, [(b"i3", Item("i3", "c3", 7.0, now))])
        wait_for(lambda: catalogue(conn).keys() == {"i1", "i2", "i3"}, 120, what="the catalogue")
        send(conn, [(b"i1", later), (b"i3", None)])
        wait_for(
            lambda: catalogue(conn) == {"i1": 20.0, "i2": 5.0},
            120,
            what="i3 deleted by its tombstone",
        )

    def compacted() -> bool:
        roll_segments(conn)
        values = {}
        for _, _, key, value in read_log(conn, topic):
            values.setdefault(key, []).append(value)
        return values[b"i1"] == [encode_item(later)] and values[b"i3"] == [None]

    wait_for(compacted, 120, 0.5, "the cleaner to leave i1's last value and i3's tombstone")
    # from scratch: no committed offsets, no catalogue in Redis
    group = conn.topic_prefix + CATALOGUE_GROUP
    admin = AdminClient(admin_config(conn))
    admin.delete_consumer_groups([group], request_timeout=30)[group].result(30)
    forget_catalogue(conn)
    ends = ends_of(conn, topic)
    with catalogue_stage(conn):
        wait_for(lambda: committed(conn, topic) == ends, 120, what="the whole log read again")
    assert catalogue(conn) == {"i1": 20.0, "i2": 5.0}


def items_on_every_partition(tag: str, now: int) -> list[tuple[bytes, Item]]:
    """One item on each partition of ``items`` (murmur2 of its key), named ``tag``-…."""
    found: dict[int, str] = {}
    for j in range(1000):
        found.setdefault(kafka_partition(f"{tag}{j}".encode(), TEST_PARTITIONS), f"{tag}{j}")
        if len(found) == TEST_PARTITIONS:
            break
    return [(i.encode(), Item(i, "c1", 1.0, now)) for i in found.values()]


@can_run_apache_kafka
def test_a_broker_restarted_on_its_data_loses_nothing_and_a_consumer_resumes_where_it_committed(
    tmp_path,
):
    stack = EmbeddedStack(tmp_path)
    state = restarted = stack.up(detach=False, broker="kafka")
    try:
        env = state.env
        conn = Services("embedded", env["KAFKA_BOOTSTRAP_SERVERS"], env["REDIS_URL"]).conn(
            f"r{uuid.uuid4().hex[:8]}."
        )
        names, now = TopicNames(conn.topic_prefix), clock.now_ms()
        ensure_topics(
            AdminClient(admin_config(conn)),
            conn.topic_prefix,
            catalogue_with(
                dict.fromkeys(("events", "recommend.requests", "gradients"), TEST_PARTITIONS)
            ),
        )
        before_restart = items_on_every_partition("a", now)
        with catalogue_stage(conn):
            send(conn, before_restart)
            ends = ends_of(conn, names.items)
            wait_for(lambda: committed(conn, names.items) == ends, 120, what="batch a committed")
        produce(conn, raw=[(f"u{j}".encode(), f"event {j}".encode()) for j in range(50)])
        logs = {t: read_log(conn, t) for t in (names.items, names.events)}
        offsets = committed(conn, names.items)

        restarted = stack.restart_broker(detach=False)
        assert not pid_alive(state.kafka.pid) and restarted.kafka.pid != state.kafka.pid
        assert restarted.env == env  # the same address: clients reconnect on their own
        assert {t: read_log(conn, t) for t in logs} == logs  # every record, nothing more
        assert committed(conn, names.items) == offsets

        forget_catalogue(conn)
        after_restart = items_on_every_partition("b", now)
        send(conn, after_restart)
        ends = ends_of(conn, names.items)
        with catalogue_stage(conn):
            wait_for(lambda: committed(conn, names.items) == ends, 120, what="batch b committed")
        # what it had committed before the restart, it did not read again
        assert catalogue(conn).keys() == {i.item_id for _, i in after_restart}
    finally:
        stack.down()
    assert not any(pid_alive(p.pid) for p in (*state.processes, *restarted.processes))


def test_a_broker_restart_is_refused_where_the_broker_keeps_nothing(tmp_path):
    stack = EmbeddedStack(tmp_path)
    with pytest.raises(StackError, match="no embedded stack runs"):
        stack.restart_broker()
    state = stack.up(detach=False, broker="tansu")
    try:
        with pytest.raises(StackError, match="Tansu keeps nothing"):
            stack.restart_broker()
        assert stack.running() == state  # refused before anything was stopped
    finally:
        stack.down()
