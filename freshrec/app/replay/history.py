"""The training part of the log to a live arm's topics before its worker starts
(``send_history``), and the wait until the streams app has counted it."""

from __future__ import annotations

import time

from freshrec.app.replay.data import ReplayData, stamp
from freshrec.app.replay.feed import log_event, produce_catalogue

COUNTED = (
    "freshrec_streams_counted_events_total",
    "freshrec_streams_late_events_total",
    "freshrec_streams_replayed_events_total",
)
"""The streams app's counters that, summed, say how many events it has read."""


def send_history(conn, data: ReplayData, wall0: int, streams_port: int, group, progress, name):
    """The catalogue, then the training part's interactions on ``events`` before the worker
    starts: the streams app counts them (hot lists, item features, users' recent clicks: what
    it would hold had it run through that part), and the workers' group is committed past
    them, so the worker does not learn again what its starting rows were trained on."""
    from freshcore.topics import TopicNames

    names = TopicNames(conn.topic_prefix)
    ends = _produce_training_part(conn, names, data, wall0, progress, name)
    _commit_workers_past(conn, names.events, ends)
    _await_counted(streams_port, data.plan.train_end, group, progress, name)


def _produce_training_part(conn, names, data: ReplayData, wall0: int, progress, name):
    """The catalogue and the training part produced and delivered; returns the last offset
    delivered per ``events`` partition."""
    from confluent_kafka import Producer

    from freshcore.kafka import produce, producer_config
    from schemas.codec import encode_event

    producer = Producer(producer_config(conn, **{"linger.ms": 20}))
    if not data.as_it_appears:
        produce_catalogue(producer, names.items, data, data.catalogue, wall0 - 30 * 86_400_000)
    listed: set[str] = set()
    ends: dict[int, int] = {}

    def delivered(err, msg) -> None:
        if err is None:
            ends[msg.partition()] = max(ends.get(msg.partition(), -1), msg.offset())

    n = data.plan.train_end
    for pos in range(n):
        event = log_event(data, pos, f"history-{pos}", stamp(data, wall0, pos))
        if data.as_it_appears and event.item_id not in listed:  # listed as it first appears
            listed.add(event.item_id)
            produce_catalogue(producer, names.items, data, [event.item_id], event.ts_ms)
        produce(
            producer,
            names.events,
            encode_event(event),
            event.user_id.encode(),
            on_delivery=delivered,
        )
        if pos % 5000 == 0:
            producer.poll(0)
            progress(f"{name}: the training part to the streams app, {pos:,}/{n:,}")
    if producer.flush(60):
        raise TimeoutError(f"{name}: the training part was not delivered within 60 s")
    return ends


def _commit_workers_past(conn, topic: str, ends: dict[int, int]) -> None:
    """Commit the workers' group past the last offsets delivered on ``topic``."""
    from confluent_kafka import Consumer, TopicPartition

    from freshcore.kafka import consumer_config

    committer = Consumer(consumer_config(conn, f"{conn.topic_prefix}freshrec-workers"))
    try:
        committer.commit(
            offsets=[TopicPartition(topic, p, o + 1) for p, o in sorted(ends.items())],
            asynchronous=False,
        )
    finally:
        committer.close()


def _await_counted(streams_port: int, n: int, group, progress, name) -> None:
    """Wait until the streams app has read the ``n`` events (a dead service raises)."""

    def counted() -> float:
        from freshrec.promtext import scrape_port, total

        samples = scrape_port(streams_port)
        return sum(total(samples, m) for m in COUNTED)

    deadline = time.monotonic() + max(120.0, n / 500)
    while (done := counted()) < n:
        group.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: the streams app counted {done:,.0f} of {n:,} events")
        progress(f"{name}: the streams app counted {done:,.0f} of the training part's {n:,}")
        time.sleep(0.5)
