"""Topic provisioning: idempotent, complete, and refusing partition mismatches."""

from __future__ import annotations

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from freshcore.kafka import admin_config
from freshcore.topics import (
    CATALOGUE,
    TopicMismatchError,
    TopicNames,
    catalogue_with,
    ensure_topics,
    partitions_from_env,
)

from .conftest import wait_for


def test_create_is_idempotent_and_creates_the_whole_catalogue(services, prefix):
    admin = AdminClient(admin_config(services.conn(prefix)))
    first = ensure_topics(admin, prefix)
    assert sorted(first.created) == sorted(prefix + s.name for s in CATALOGUE)
    second = ensure_topics(admin, prefix)
    assert second.created == ()
    assert len(second.existing) == len(CATALOGUE)
    topics = admin.list_topics(timeout=10).topics
    for spec in CATALOGUE:
        assert len(topics[prefix + spec.name].partitions) == spec.partitions


def test_a_partition_mismatch_is_refused_and_nothing_is_created(services, prefix):
    admin = AdminClient(admin_config(services.conn(prefix)))
    names = TopicNames(prefix)
    admin.create_topics([NewTopic(names.events, num_partitions=3)])[names.events].result()
    # a topic that exists already: Apache Kafka's metadata shows a new one a moment later
    wait_for(lambda: names.events in admin.list_topics(timeout=10).topics, what="the topic")
    with pytest.raises(TopicMismatchError, match="events has 3 partitions, the catalogue says 8"):
        ensure_topics(admin, prefix)
    assert names.recommend_requests not in admin.list_topics(timeout=10).topics


def test_a_mismatch_made_while_provisioning_is_refused_too(services, prefix, monkeypatch):
    """Another creator made the topic, with another count, after the catalogue's was read:
    the broker says it exists, and its partitions are checked once it is visible."""
    import freshcore.topics as topics

    admin = AdminClient(admin_config(services.conn(prefix)))
    names = TopicNames(prefix)
    seen = topics.metadata(admin, 10)
    admin.create_topics([NewTopic(names.events, num_partitions=3)])[names.events].result()
    asked = []

    def first_the_old_metadata(client, timeout_s, topic=None):
        asked.append(topic)
        return seen if len(asked) == 1 else real(client, timeout_s, topic)

    real = topics.metadata
    monkeypatch.setattr(topics, "metadata", first_the_old_metadata)
    with pytest.raises(TopicMismatchError, match="events has 3 partitions, the catalogue says 8"):
        ensure_topics(admin, prefix)


def test_co_partitioned_topics_cannot_be_overridden_apart():
    with pytest.raises(ValueError, match="same partition count"):
        catalogue_with({"events": 4})
    specs = {
        s.name: s.partitions
        for s in catalogue_with(partitions_from_env({"FRESHREC_PARTITIONS": "2"}))
    }
    assert specs["events"] == specs["recommend.requests"] == 2


def test_consume_available_returns_with_the_first_message_and_what_queued_behind_it(conn):
    import threading
    import time

    from confluent_kafka import Consumer, Producer, TopicPartition

    from freshcore.kafka import consume_available, consumer_config, producer_config
    from freshcore.topics import TopicNames

    topic = TopicNames(conn.topic_prefix).events
    c = Consumer(consumer_config(conn, None))
    c.assign([TopicPartition(topic, q, 0) for q in range(4)])
    p = Producer(producer_config(conn))
    try:
        assert consume_available(c, 10, 0.2) == []  # nothing: back after the timeout, empty
        timer = threading.Timer(0.2, lambda: (p.produce(topic, b"one", partition=0), p.flush(5)))
        timer.start()
        got: list = []
        reader = threading.Thread(target=lambda: got.extend(consume_available(c, 10, 120.0)))
        reader.start()
        # librdkafka's consume(10, 120) would hold the one message for the whole 120 s: the
        # read must come back with it long before
        reader.join(15)
        assert not reader.is_alive(), "consume_available held a message for its whole timeout"
        assert [m.value() for m in got] == [b"one"]
        for i in range(5):
            p.produce(topic, b"%d" % i, partition=1)
        p.flush(5)
        seen: list[bytes] = []
        deadline = time.monotonic() + 15
        while len(seen) < 5 and time.monotonic() < deadline:
            batch = consume_available(c, 3, 1.0)
            assert len(batch) <= 3
            seen += [m.value() for m in batch]
        assert seen == [b"0", b"1", b"2", b"3", b"4"]
    finally:
        c.close()
