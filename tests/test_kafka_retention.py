"""Retention, which the embedded Tansu broker does not honour (it deletes nothing), held on
Apache Kafka: a FreshRec consumer whose offset to resume from the broker has deleted resumes
at the partition's log start offset (``auto.offset.reset=earliest``, ``freshcore/kafka.py``)
and counts the messages it skipped (``freshrec_consumer_skipped_messages_total``,
``freshcore/resets.py``): the worker and the streams app's validate stage from their groups'
committed offsets on ``events``, the parameter server from its applied offset in Redis on
``gradients``.

The records behind the offset are made old by their timestamps, a day before now, and the
topic is set to keep an hour (``retention.ms``) with segments rolled at the next append after
100 ms (``segment.ms``); the stack's broker looks for segments to delete every second
(``log.retention.check.interval.ms``). The last old records sit in the active segment, which
is never deleted, until records of now roll it. The tests skip, saying why, where the
session's broker is not the local Apache Kafka."""

from __future__ import annotations

import numpy as np
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    OffsetSpec,
    ResourceType,
)

from freshcore import clock
from freshcore import metrics as m
from freshcore.kafka import admin_config, consumer_config, partition_count, producer_config
from freshcore.partitioner import kafka_partition
from freshcore.redisconn import connect
from freshcore.rediskeys import RedisKeys
from freshcore.topics import TopicNames
from inference.clients import worker_group
from param_server.server import ParameterServer
from param_server.settings import ParamServerSettings
from param_server.store import applied_offsets
from schemas.codec import encode_event
from schemas.records import Event
from schemas.rowbatch import KIND_GRADIENTS, TABLE_USER, RowBatch
from schemas.rows import row_key
from streams.settings import StreamsSettings
from streams.validate import ValidateStage

from .conftest import TEST_PARTITIONS, wait_for
from .kafka_harness import on_a_thread, on_apache_kafka
from .test_kafka_kip848 import DIM, pump, running, started_worker

DAY_MS = 86_400_000
KEEP_AN_HOUR = {"retention.ms": str(3_600_000), "segment.ms": "100"}
"""Topic settings under which the broker deletes, within seconds, every closed segment whose
newest record is more than an hour old."""
PARTITION = 1
"""The partition the tests fill; the others stay empty (nothing committed, nothing skipped)."""
FIRST, UNREAD, AFTER = 5, 15, 4
"""Records read and committed before the consumer stops, written while it is away (old:
deleted unread), and written after the deletion (read when it comes back)."""


def keep_an_hour(conn, topic: str) -> None:
    admin = AdminClient(admin_config(conn))
    resource = ConfigResource(
        ResourceType.TOPIC,
        topic,
        incremental_configs=[
            ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET)
            for k, v in KEEP_AN_HOUR.items()
        ],
    )
    admin.incremental_alter_configs([resource])[resource].result(30)


def log_start(conn, topic: str, partition: int) -> int:
    """The partition's log start offset, the broker's answer now (ListOffsets earliest)."""
    tp = TopicPartition(topic, partition)
    admin = AdminClient(admin_config(conn))
    return admin.list_offsets({tp: OffsetSpec.earliest()}, request_timeout=30)[tp].result(30).offset


def produce_at(conn, topic: str, records: list[tuple[bytes | None, bytes]], at_ms: int) -> None:
    """``records`` (key, value) on ``PARTITION`` of ``topic``, timestamped ``at_ms``."""
    p = Producer(producer_config(conn))
    for key, value in records:
        p.produce(topic, key=key, value=value, partition=PARTITION, timestamp=at_ms)
    assert p.flush(30) == 0


def skipped(group: str, topic: str) -> float:
    return m.CONSUMER_SKIPPED.labels(group, topic)._value.get()


def committed_offset(conn, group: str, topic: str) -> int:
    c = Consumer(consumer_config(conn, group))
    try:
        (tp,) = c.committed([TopicPartition(topic, PARTITION)], timeout=15)
        return tp.offset
    finally:
        c.close()


def clicks(user: str, numbers: range) -> list[tuple[bytes, bytes]]:
    """Clicks of ``user``, valid now (the records' timestamps are set apart from them)."""
    now = clock.now_ms()
    return [
        (user.encode(), encode_event(Event(f"e{j}", "click", user, "i1", now + j))) for j in numbers
    ]


def validate_stage(conn):
    """The streams app's validate stage on a thread; its failure is raised on exit."""
    names = TopicNames(conn.topic_prefix)
    by_item = partition_count(AdminClient(admin_config(conn)), names.events_by_item)
    return on_a_thread(
        ValidateStage(StreamsSettings(conn=conn, batch_max=100), by_item), "validate"
    )


@on_apache_kafka
def test_consumers_of_events_behind_the_retained_range_resume_at_the_log_start_and_count_it(
    conn,
):
    """The worker and the streams app's validate stage, each from its group's commit."""
    topic = TopicNames(conn.topic_prefix).events
    workers = f"{conn.topic_prefix}freshrec-workers"
    validate = f"{conn.topic_prefix}freshrec-streams-validate"
    user = next(f"u{j}" for j in range(1000) if kafka_partition(f"u{j}".encode(), 4) == PARTITION)
    day_ago = clock.now_ms() - DAY_MS
    produce_at(conn, topic, clicks(user, range(FIRST)), day_ago)
    with validate_stage(conn):
        a = started_worker(conn, "a")
        try:
            assert worker_group(a.settings) == workers
            pump([a], lambda: a.stats["events"] == FIRST, 120, "worker a to learn the first events")
        finally:
            a.close()  # commits what it learnt, and leaves
        wait_for(lambda: committed_offset(conn, validate, topic) == FIRST, 120, what="validated")
    assert committed_offset(conn, workers, topic) == FIRST
    produce_at(conn, topic, clicks(user, range(FIRST, FIRST + UNREAD)), day_ago)
    keep_an_hour(conn, topic)
    start = FIRST + UNREAD
    produce_at(conn, topic, clicks(user, range(start, start + AFTER)), clock.now_ms())
    wait_for(
        lambda: log_start(conn, topic, PARTITION) == start,
        120,
        0.5,
        f"retention to delete offsets 0-{start - 1} of {topic} [{PARTITION}]",
    )
    before = {g: skipped(g, topic) for g in ("workers", "streams-validate")}
    valid = m.STREAMS_EVENTS.labels("valid")._value.get()
    with validate_stage(conn):
        b = started_worker(conn, "b")
        try:
            pump(
                [b],
                lambda: b.commits.committed.get((topic, PARTITION)) == start + AFTER,
                120,
                "worker b to learn and commit what is retained",
            )
            # from the log start: not from the end (it learnt the records there), and
            # nothing before it (they are gone)
            assert b.stats["events"] == AFTER
            assert b.assigned == 2 * TEST_PARTITIONS  # the empty partitions skipped nothing
        finally:
            b.close()
        wait_for(
            lambda: committed_offset(conn, validate, topic) == start + AFTER,
            120,
            what="the validate stage to commit what is retained",
        )
    assert m.STREAMS_EVENTS.labels("valid")._value.get() - valid == AFTER
    assert {g: skipped(g, topic) - n for g, n in before.items()} == {
        "workers": start - FIRST,
        "streams-validate": start - FIRST,
    }


def gradient_messages(n: int) -> list[tuple[None, bytes]]:
    """``n`` gradient messages on 3 user rows of ``PARTITION`` (a row's partition is its
    key's)."""
    rows = [i for i in range(200) if kafka_partition(row_key(i), TEST_PARTITIONS) == PARTITION]
    ids = np.array(rows[:3], np.int64)
    g = np.full((3, DIM + 1), 0.01, np.float32)
    versions, times = np.ones(3, np.uint64), np.full(3, clock.now_ms())
    value = RowBatch(KIND_GRADIENTS, TABLE_USER, ids, g, versions, times).encode()
    return [(None, value)] * n


@on_apache_kafka
def test_a_parameter_server_behind_the_retained_range_resumes_at_the_log_start_and_counts_it(
    conn,
):
    topic = TopicNames(conn.topic_prefix).gradients
    r, keys = connect(conn.redis_url), RedisKeys(conn.topic_prefix)

    def applied() -> int:
        return applied_offsets(r, keys, [PARTITION]).get(PARTITION, -1)

    def server() -> ParameterServer:
        return ParameterServer(ParamServerSettings(conn, dim=DIM, flush_interval_ms=20))

    day_ago = clock.now_ms() - DAY_MS
    produce_at(conn, topic, gradient_messages(FIRST), day_ago)
    with running(server()):
        wait_for(lambda: applied() == FIRST - 1, 120, what="the first messages applied")
    produce_at(conn, topic, gradient_messages(UNREAD), day_ago)
    keep_an_hour(conn, topic)
    start = FIRST + UNREAD
    produce_at(conn, topic, gradient_messages(AFTER), clock.now_ms())
    wait_for(
        lambda: log_start(conn, topic, PARTITION) == start,
        120,
        0.5,
        f"retention to delete offsets 0-{start - 1} of {topic} [{PARTITION}]",
    )
    before = skipped("param-server", topic)
    messages = m.GRADIENT_MESSAGES.labels("applied")._value.get()
    with running(server()):
        wait_for(lambda: applied() == start + AFTER - 1, 120, what="what is retained applied")
    assert m.GRADIENT_MESSAGES.labels("applied")._value.get() - messages == AFTER
    assert skipped("param-server", topic) - before == start - FIRST
