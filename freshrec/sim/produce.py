"""Produce the synthetic world to Kafka: the catalogue, and events at a steady rate."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from confluent_kafka import KafkaException, Producer

from freshcore import clock
from freshcore.kafka import produce, producer_config
from freshcore.settings import ConnectionSettings
from freshcore.topics import TopicNames, metadata
from freshrec.progress import ProgressLine
from freshrec.sim.pacing import Pacer
from freshrec.sim.traffic import EventSynthesizer, catalogue
from freshrec.sim.world import World
from schemas.codec import encode_event, encode_item

log = logging.getLogger(__name__)


@dataclass
class DeliveryCounter:
    delivered: int = 0
    failed: int = 0
    last_error: str | None = None

    def __call__(self, err, _msg) -> None:
        if err is None:
            self.delivered += 1
        else:
            self.failed += 1
            self.last_error = str(err)


@dataclass(frozen=True)
class ProduceStats:
    produced: int
    delivered: int
    failed: int
    elapsed_s: float

    @property
    def rate_per_s(self) -> float:
        return self.delivered / self.elapsed_s if self.elapsed_s > 0 else 0.0


def _flush(producer: Producer, counter: DeliveryCounter, produced: int, timeout_s: float) -> None:
    remaining = producer.flush(timeout_s)
    if remaining:
        raise KafkaException(f"{remaining} messages undelivered after {timeout_s}s")
    if counter.failed:
        raise KafkaException(
            f"{counter.failed} of {produced} messages failed: {counter.last_error}"
        )


def _finish(producer, counter, sent, start, progress, label) -> ProduceStats:
    """Deliver what is queued (or raise), report, and sum up a steady-rate run."""
    _flush(producer, counter, sent, 30)
    elapsed = time.monotonic() - start
    if progress:
        progress.done(
            f"{label}: {sent:,} produced and delivered in {elapsed:.1f}s "
            f"({counter.delivered / max(elapsed, 1e-9):,.0f}/s)"
        )
    return ProduceStats(sent, counter.delivered, counter.failed, elapsed)


def produce_items(
    conn: ConnectionSettings, world: World, progress: ProgressLine | None = None
) -> ProduceStats:
    """Load the whole catalogue onto ``items`` (key = item_id)."""
    topic = TopicNames(conn.topic_prefix).items
    producer = Producer(producer_config(conn, **{"linger.ms": 20}))
    counter = DeliveryCounter()
    start = time.monotonic()
    n = world.config.n_items
    for i, item in enumerate(catalogue(world), 1):
        produce(producer, topic, encode_item(item), item.item_id.encode(), on_delivery=counter)
        if i % 5000 == 0:
            producer.poll(0)
            if progress:
                progress.update(f"items: {i:,}/{n:,} ({100 * i // n}%)")
    _flush(producer, counter, n, 60)
    elapsed = time.monotonic() - start
    if progress:
        progress.done(f"items: {n:,} loaded in {elapsed:.1f}s")
    return ProduceStats(n, counter.delivered, counter.failed, elapsed)


def prepare_events(world: World, n: int, seed: int = 0) -> list[tuple[bytes, bytes, bytes]]:
    """``n`` synthetic events encoded ahead of time as (key, head, tail): the value is
    ``head + ts_ms + tail``, so ``produce_prepared`` stamps each with its send time for the
    cost of a concatenation (generating and encoding 5,000 events/s takes a quarter of this
    machine; a benchmark should measure the system, not its load generator)."""
    synth = EventSynthesizer(world, seed=seed)
    stamp_ms = clock.now_ms()
    marker = b'"ts_ms":' + str(stamp_ms).encode()
    out: list[tuple[bytes, bytes, bytes]] = []
    while len(out) < n:
        for e in synth.batch(100, stamp_ms):
            value = encode_event(e)
            at = value.index(marker) + 8
            out.append((e.user_id.encode(), value[:at], value[at + len(marker) - 8 :]))
    return out[:n]


def events_producer(conn: ConnectionSettings, linger_ms: int | None = None) -> Producer:
    """A producer for ``events`` with its metadata fetched (else its first second waits for
    it). Reuse it across a ramp and a measured phase: on the embedded broker a new idempotent
    producer's first messages on a topic that another producer wrote wait ~0.5 s
    (docs/operations.md), which a lag measurement would count."""
    topic = TopicNames(conn.topic_prefix).events
    overrides = {} if linger_ms is None else {"linger.ms": linger_ms}
    producer = Producer(producer_config(conn, **overrides))
    metadata(producer, 10, topic)
    return producer


def produce_prepared(
    conn: ConnectionSettings,
    records: list[tuple[bytes, bytes, bytes]],
    *,
    rate_per_s: float,
    progress: ProgressLine | None = None,
    label: str = "events",
    linger_ms: int | None = None,
    producer: Producer | None = None,
) -> ProduceStats:
    """Send ``prepare_events`` records at a steady rate, each stamped with the time it is
    handed to the producer: ``producer`` (from ``events_producer``, to continue one producer
    session across phases) or a new one."""
    topic = TopicNames(conn.topic_prefix).events
    producer = producer or events_producer(conn, linger_ms)
    counter = DeliveryCounter()
    start = time.monotonic()
    pacer = Pacer(rate_per_s, start)
    sent, n = 0, len(records)
    while sent < n:
        now = time.monotonic()
        want = min(pacer.to_send(now, sent), n - sent)
        if want:
            stamp = str(clock.now_ms()).encode()
            for key, head, tail in records[sent : sent + want]:
                produce(producer, topic, head + stamp + tail, key, on_delivery=counter)
            sent += want
        producer.poll(0)
        if progress and want:
            progress.update(
                f"{label}: {sent:,}/{n:,} produced "
                f"({counter.delivered / max(now - start, 1e-9):,.0f}/s)"
            )
        time.sleep(0.01)
    return _finish(producer, counter, sent, start, progress, label)


def produce_events(
    conn: ConnectionSettings,
    world: World,
    *,
    rate_per_s: float,
    duration_s: float | None,
    stop: threading.Event | None = None,
    progress: ProgressLine | None = None,
    seed: int = 0,
    suffix: Callable[[], str] | None = None,
    label: str = "events",
) -> ProduceStats:
    """Produce synthetic events at a steady rate until ``duration_s`` or ``stop`` is set."""
    topic = TopicNames(conn.topic_prefix).events
    producer = events_producer(conn)
    counter = DeliveryCounter()
    synth = EventSynthesizer(world, seed=seed)
    slates_per_tick = max(1, int(rate_per_s / 100 / (synth.slate_size + 1)))
    stop = stop or threading.Event()
    start = time.monotonic()
    pacer = Pacer(rate_per_s, start)
    buffered: deque[tuple[bytes, bytes]] = deque()
    sent = 0
    while not stop.is_set():
        now = time.monotonic()
        if duration_s is not None and now - start >= duration_s:
            break
        want = pacer.to_send(now, sent)
        while len(buffered) < want:
            now_ms = clock.now_ms()
            for e in synth.batch(slates_per_tick, now_ms):
                buffered.append((e.user_id.encode(), encode_event(e)))
        for _ in range(want):
            key, value = buffered.popleft()
            produce(producer, topic, value, key, on_delivery=counter)
        sent += want
        producer.poll(0)
        if progress:
            elapsed = max(now - start, 1e-9)
            extra = suffix() if suffix else ""
            progress.update(
                f"{label}: {sent:,} produced ({counter.delivered / elapsed:,.0f}/s)"
                + (f" | {extra}" if extra else "")
            )
        stop.wait(0.01)
    return _finish(producer, counter, sent, start, progress, label)
