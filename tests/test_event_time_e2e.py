"""Event time that survives a catch-up, against the real broker and Redis: a backlog on two
`events` partitions, three hours of event time each, drained at speed and unevenly (the
whole of partition 0's before any of partition 1's), loses nothing, and an event older than
every partition's progress minus the grace is still dropped."""

from __future__ import annotations

import json
import random
import time

from confluent_kafka import Producer

from freshcore import clock
from freshcore.kafka import producer_config
from freshcore.redisconn import connect
from freshcore.rediskeys import RedisKeys
from freshcore.topics import TopicNames
from freshrec.app.stack.ports import free_port
from freshrec.promtext import scrape, total
from schemas.codec import encode_event
from schemas.records import Event

from .streams_harness import HOUR_MS, produce, service, wait_for
from .test_streams_e2e import REGIONS, SETTINGS, catalogue, matches_brute_force

PER_PARTITION = 3000
IDLE_MS = 1000
"""The test's FRESHREC_WATERMARK_IDLE_MS: partitions 2 and 3 of events never deliver, and
stop holding the lateness floor at −∞ a second after counting starts."""


def backlog(seed: int, start_ms: int, end_ms: int, id_prefix: str) -> list[Event]:
    """``PER_PARTITION`` events in event-time order from ``start_ms`` to ``end_ms``, on 30
    items whose popularity differs enough that ranks are unambiguous."""
    rng = random.Random(seed)
    step = (end_ms - start_ms) / (PER_PARTITION - 1)
    out = []
    for j in range(PER_PARTITION):
        kind = rng.choices(["impression", "click", "conversion"], [0.7, 0.25, 0.05])[0]
        item = f"i{min(int(rng.expovariate(0.15)), 29)}"
        user = f"u{rng.randint(0, 40)}"
        ts = start_ms + round(j * step)
        out.append(Event(f"{id_prefix}{j}", kind, user, item, ts, rng.choice(REGIONS), "pc"))
    return out


def produce_to(conn, partition: int, events: list[Event]) -> None:
    """``events`` onto one partition of ``events``, in order."""
    p = Producer(producer_config(conn))
    topic = TopicNames(conn.topic_prefix).events
    for e in events:
        p.produce(topic, key=e.user_id.encode(), value=encode_event(e), partition=partition)
    assert p.flush(15) == 0


def flow(url: str) -> dict[str, float]:
    """Events validated, counted and dropped as late, from the instance's ``/metrics``."""
    samples = scrape(url)
    return {
        "valid": total(samples, "freshrec_streams_events_total", outcome="valid"),
        "counted": total(samples, "freshrec_streams_counted_events_total"),
        "late": total(samples, "freshrec_streams_late_events_total"),
    }


def processed(url: str, n: int):
    """True once ``n`` events are validated and each counted or dropped as late."""
    try:
        f = flow(url)
    except OSError as exc:
        return str(exc)
    return (f["valid"] == n and f["counted"] + f["late"] == n) or str(f)


def persisted_meta(conn) -> list[dict[str, str]]:
    """Each ``events.by_item`` partition's persisted state meta (those with one)."""
    r = connect(conn.redis_url)
    keys = RedisKeys(conn.topic_prefix)
    try:
        metas = [r.hgetall(keys.streams_meta(q)) for q in range(int(r.get(keys.feature_shards)))]
    finally:
        r.close()
    return [{k.decode(): v.decode() for k, v in m.items()} for m in metas if m]


def test_a_backlog_on_two_partitions_drained_unevenly_loses_no_event(conn, tmp_path):
    end = clock.now_ms() - 60_000
    start = end - 3 * HOUR_MS
    first = backlog(21, start, end, "p0-")
    second = backlog(22, start, end, "p1-")
    prices = {i.item_id: i.price for i in catalogue()}
    produce(conn, items=catalogue())
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    settings = {
        **SETTINGS,
        "FRESHREC_METRICS_PORT": str(port),
        "FRESHREC_WATERMARK_IDLE_MS": str(IDLE_MS),
    }
    with service(conn, "streams", tmp_path / "streams.log", **settings):
        # partition 0's whole backlog first: three hours of event time read in a moment
        produce_to(conn, 0, first)
        wait_for(lambda: processed(url, len(first)), 90, "partition 0's backlog")
        drained_at = time.monotonic()
        # then partition 1's, hours behind the newest event the count stage has read
        produce_to(conn, 1, second)
        wait_for(lambda: processed(url, 2 * PER_PARTITION), 60, "partition 1's backlog")
        assert flow(url) == {"valid": 2 * PER_PARTITION, "counted": 2 * PER_PARTITION, "late": 0}
        wait_for(lambda: matches_brute_force(conn, first + second, prices), 60, "exact hot lists")
        metas = persisted_meta(conn)
        assert metas and all(int(m["late"]) == 0 for m in metas)  # co-visitation pairs too
        for m in metas:  # each count partition knows both source partitions' progress
            assert {"0", "1"} <= set(json.loads(m["source_watermarks"])), m
        # an event older than every partition's progress minus the grace is still late, once
        # the partitions that never delivered (2 and 3) have been idle long enough to stop
        # holding the floor: processing time passing is what is tested here
        time.sleep(max(0.0, drained_at + 2 * IDLE_MS / 1000 - time.monotonic()))
        produce_to(conn, 0, [Event("too-late", "click", "late-user", "i0", start, "north", "pc")])
        wait_for(lambda: processed(url, 2 * PER_PARTITION + 1), 60, "the late event")
        assert flow(url)["late"] == 1
