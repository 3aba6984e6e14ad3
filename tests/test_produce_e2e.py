"""Generated events through the real broker: produced, consumed, decoded, keyed by user."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer

from freshcore import clock
from freshcore.kafka import consumer_config
from freshcore.partitioner import kafka_partition
from freshcore.topics import TopicNames
from freshrec.sim.produce import produce_events, produce_items
from freshrec.sim.world import World, WorldConfig
from schemas.codec import decode_event, decode_item


def consume_all(conn, topic: str, expected: int, timeout_s: float = 30.0) -> list:
    consumer = Consumer(consumer_config(conn, f"{conn.topic_prefix}reader-{topic}"))
    consumer.subscribe([topic])
    out: list = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < expected and time.monotonic() < deadline:
            for msg in consumer.consume(1000, 0.2):
                if not msg.error():
                    out.append(msg)
    finally:
        consumer.close()
    return out


@pytest.mark.tansu
def test_generated_events_round_trip_through_the_broker_with_the_codecs(conn):
    world = World(WorldConfig(seed=4, n_users=5000, n_items=300))
    items = produce_items(conn, world)
    assert items.delivered == 300
    stats = produce_events(conn, world, rate_per_s=5000, duration_s=1.0, seed=4)
    assert stats.failed == 0 and stats.delivered == stats.produced > 3000

    names = TopicNames(conn.topic_prefix)
    now = clock.now_ms()
    item_msgs = consume_all(conn, names.items, 300)
    assert {decode_item(m.value(), now).item_id for m in item_msgs} == {f"i{i}" for i in range(300)}

    msgs = consume_all(conn, names.events, stats.delivered)
    assert len(msgs) == stats.delivered
    events = [decode_event(m.value(), now) for m in msgs]
    assert len({e.event_id for e in events}) == len(events)
    for m, e in zip(msgs, events, strict=True):
        assert m.key() == e.user_id.encode()
        assert m.partition() == kafka_partition(m.key(), 4), "not murmur2 partitioned"
    assert {e.event_type for e in events} == {"impression", "click", "conversion"}
