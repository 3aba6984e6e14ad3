"""KIP-848's consumer group protocol as a supported option (``FRESHREC_KAFKA_GROUP_PROTOCOL
=consumer``), held on Apache Kafka: the broker assigns the partitions range-wise, so a worker
still gets the same partition numbers of ``events`` and ``recommend.requests``; the protocol
hands partitions over one by one, and the worker and the parameter server, whose rebalance
callbacks are then given only the partitions added or taken away, keep what they hold; a
member that leaves has its partitions taken over and read by those that stay. The tests on a
broker skip, saying why, where the session's broker is not the local Apache Kafka."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
from confluent_kafka import Consumer, ConsumerGroupType, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from freshcore import clock
from freshcore.kafka import admin_config, consumer_config, producer_config
from freshcore.partitioner import kafka_partition
from freshcore.redisconn import connect
from freshcore.rediskeys import RedisKeys
from freshcore.settings import ConnectionSettings, SettingsError
from freshcore.topics import TopicNames
from inference.clients import WorkerClients, worker_group
from inference.eventflow import EventFlow
from inference.settings import LearningSettings, WorkerSettings
from inference.worker import Worker
from param_server.server import ParameterServer
from param_server.settings import ParamServerSettings
from param_server.store import applied_offsets
from schemas.records import Event
from schemas.rowbatch import KIND_GRADIENTS, TABLE_USER, RowBatch
from schemas.rows import row_key

from .conftest import TEST_PARTITIONS, wait_for
from .kafka_harness import on_apache_kafka
from .streams_harness import produce

DIM = 8
CLASSIC_ONLY = {"session.timeout.ms", "heartbeat.interval.ms", "partition.assignment.strategy"}
"""What librdkafka refuses from a member of a group on the consumer protocol."""


def on_consumer_protocol(conn: ConnectionSettings) -> ConnectionSettings:
    return replace(conn, kafka_group_protocol="consumer")


def test_the_consumer_protocol_leaves_the_session_and_the_assignor_to_the_broker():
    conn = ConnectionSettings("127.0.0.1:9", "redis://r", kafka_session_timeout_ms=3000)
    classic = consumer_config(conn, "g")
    assert classic["session.timeout.ms"] == 3000 and "group.protocol" not in classic
    cfg = consumer_config(on_consumer_protocol(conn), "g")
    assert (cfg["group.protocol"], cfg["group.remote.assignor"]) == ("consumer", "range")
    assert not CLASSIC_ONLY & cfg.keys()
    Consumer(cfg).close()  # librdkafka takes it, and would refuse each of those
    for name in sorted(CLASSIC_ONLY):
        with pytest.raises(KafkaException, match=r"is not supported for `group\.protocol=consumer"):
            Consumer({**cfg, name: classic[name]})
    assert consumer_config(on_consumer_protocol(conn), None)["group.id"] == "freshrec-unjoined"
    env = {"FRESHREC_KAFKA_GROUP_PROTOCOL": "consumer"}
    assert ConnectionSettings.from_env(env).kafka_group_protocol == "consumer"
    with pytest.raises(SettingsError, match="classic, consumer"):
        ConnectionSettings.from_env({"FRESHREC_KAFKA_GROUP_PROTOCOL": "cooperative"})


class PausingConsumer:
    """What ``EventFlow`` asks of a consumer, recorded."""

    def __init__(self, parts: list[TopicPartition]) -> None:
        self.parts, self.calls = parts, []

    def assignment(self) -> list[TopicPartition]:
        return self.parts

    def pause(self, parts) -> None:
        self.calls.append(("pause", sorted(tp.partition for tp in parts)))

    def resume(self, parts) -> None:
        self.calls.append(("resume", sorted(tp.partition for tp in parts)))


def test_a_revoke_of_some_partitions_keeps_the_pauses_of_the_others():
    """Under an incremental protocol a member keeps its other partitions through a
    rebalance, paused as they were: forgetting them would leave them paused for good."""
    consumer = PausingConsumer([TopicPartition("events", q) for q in range(3)])
    flow = EventFlow(consumer, "events", batch_max=100, purge_every_s=1.0)
    flow.adjust(backlog=401, slice_size=100, full=False, now=0.0)
    assert consumer.calls == [("pause", [0, 1, 2])]
    flow.forget({("events", 1)})
    flow.adjust(backlog=0, slice_size=100, full=False, now=1.0)
    assert consumer.calls[1:] == [("resume", [0, 2])]


def pump(workers: list[Worker], until, timeout_s: float, what: str) -> None:
    """Rounds of each worker's loop until ``until()``, within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        for w in workers:
            w.poll_once()


def owned(w: Worker) -> set[tuple[str, int]]:
    return {(tp.topic, tp.partition) for tp in w.events.assignment()}


def started_worker(conn: ConnectionSettings, name: str) -> Worker:
    s = WorkerSettings(conn, LearningSettings(dim=DIM), user_capacity_rows=1000, worker_id=name)
    w = Worker(s, WorkerClients.connect(s))
    w.start()
    return w


def group_type(conn: ConnectionSettings, group: str) -> ConsumerGroupType:
    admin = AdminClient(admin_config(conn))
    return admin.describe_consumer_groups([group], request_timeout=30)[group].result(30).type


@on_apache_kafka
def test_workers_on_the_consumer_protocol_split_co_partitioned_and_take_over_a_leavers(conn):
    conn = on_consumer_protocol(conn)
    names = TopicNames(conn.topic_prefix)
    a, b = started_worker(conn, "a"), started_worker(conn, "b")
    open_ = [a, b]
    try:

        def split() -> bool:
            mine, theirs = owned(a), owned(b)
            return bool(mine and theirs) and len(mine | theirs) == 2 * TEST_PARTITIONS

        pump([a, b], split, 120, "both workers to hold partitions")
        for w in (a, b):
            events = {q for t, q in owned(w) if t == names.events}
            assert events == {q for t, q in owned(w) if t == names.recommend_requests}
            assert w.assigned == len(owned(w))  # counted through incremental hand-overs
        assert not owned(a) & owned(b)
        assert group_type(conn, worker_group(a.settings)) == ConsumerGroupType.CONSUMER
        left = {q for t, q in owned(a) if t == names.events}
        open_.remove(a)
        a.close()  # leaves the group
        pump([b], lambda: len(owned(b)) == 2 * TEST_PARTITIONS, 120, "b to take over a's")
        assert b.assigned == 2 * TEST_PARTITIONS
        user = next(f"u{j}" for j in range(1000) if kafka_partition(f"u{j}".encode(), 4) in left)
        before, t0 = b.stats["events"], clock.now_ms()
        produce(conn, [Event(f"e{j}", "click", user, "i1", t0 + j) for j in range(3)])
        pump([b], lambda: b.stats["events"] >= before + 3, 120, "b to learn from a's partition")
    finally:
        for w in open_:
            w.close()


def gradient_messages(n: int) -> list[tuple[int, bytes]]:
    """``n`` gradient messages round the partitions of ``gradients``, each on 3 rows of its
    partition."""
    rng = np.random.default_rng(3)
    rows = {q: [i for i in range(200) if kafka_partition(row_key(i), 4) == q] for q in range(4)}
    out = []
    for j in range(n):
        q = j % TEST_PARTITIONS
        ids = np.array(rows[q][:3], np.int64)
        g = rng.standard_normal((3, DIM + 1)).astype(np.float32)
        times = np.full(3, clock.now_ms())
        batch = RowBatch(KIND_GRADIENTS, TABLE_USER, ids, g, np.ones(3, np.uint64), times)
        out.append((q, batch.encode()))
    return out


@contextlib.contextmanager
def running(server: ParameterServer) -> Iterator[threading.Event]:
    """``server`` on a thread until the event it yields is set (or the block ends)."""
    stop = threading.Event()
    t = threading.Thread(target=server.run, args=(stop,), daemon=True, name="param-server")
    t.start()
    try:
        yield stop
    finally:
        stop.set()
        t.join(30)


def holds(server: ParameterServer) -> set[int]:
    """The partitions ``server`` owns. Asked from this thread, not of its consumer: a call
    into a consumer while its own thread serves a rebalance waits for that thread (for 20 to
    40 s here); that it reads them all shows in what it applies."""
    try:
        return set(server.owned)
    except RuntimeError:  # changed by a rebalance while copied: none this time
        return set()


@on_apache_kafka
def test_parameter_servers_on_the_consumer_protocol_take_over_a_leavers_partitions(conn):
    conn = on_consumer_protocol(conn)
    a, b = (ParameterServer(ParamServerSettings(conn, dim=DIM, flush_interval_ms=20)) for _ in "ab")
    with running(a) as stop_a, running(b):
        wait_for(
            lambda: holds(a) and holds(b) and len(holds(a) | holds(b)) == TEST_PARTITIONS,
            120,
            what="both parameter servers to own partitions",
        )
        stop_a.set()  # leaves the group
        wait_for(lambda: holds(b) == set(range(TEST_PARTITIONS)), 120, what="b to take over")
        messages = gradient_messages(40)
        p = Producer(producer_config(conn))
        for q, value in messages:
            p.produce(TopicNames(conn.topic_prefix).gradients, value=value, partition=q)
        assert p.flush(30) == 0
        r, keys = connect(conn.redis_url), RedisKeys(conn.topic_prefix)

        def applied() -> int:
            return sum(o + 1 for o in applied_offsets(r, keys, list(range(4))).values())

        wait_for(lambda: applied() == len(messages), 120, what="b to apply every partition")
