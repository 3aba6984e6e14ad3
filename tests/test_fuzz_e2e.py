"""Any bytes, any headers, any size: a property-based fuzz of the public topics against a real
worker and a real streams app on the embedded broker and Redis.

Hypothesis generates batches of records for ``recommend.requests``, ``events`` and ``items``:
well-formed ones, JSON with fields dropped or retyped, arbitrary bytes, empty and null
values, values up to 300 KB, and headers that are missing, duplicated, huge, not UTF-8, null
or name internal topics. After each batch every service is alive, a normal request is
answered, and every generated record is accounted for:

- requests: each was served, or rejected (a dead letter, and an error reply when its headers
  allowed one), or dropped and counted (expired, a duplicate request id) — the worker's
  counters add up to the records sent, the dead letters on the topic to the rejected ones;
- events: the streams app counted the valid ones once and dead-lettered the rest, and the
  worker learnt every valid one;
- items: valid ones are in the catalogue, the rest dead letters.

Each example costs seconds of a live stack, so this runs a few fixed cases (the findings that
once crashed a service) and two derandomised ones; the breadth — hundreds of fresh-seeded
cases per input per run, valid-but-extreme values included — is ``tests/test_fuzz_inputs.py``,
in-process against the same decoders.
"""

from __future__ import annotations

import contextlib
import json
import random
import uuid

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from freshcore import clock
from freshcore import metrics as m
from freshcore.kafka import close_producer, consumer_config, producer_config
from freshcore.topics import TopicNames
from freshrec.app.stack import free_port
from freshrec.promtext import scrape_port_now, total

from .serving_harness import client_for, counter, running_worker, worker_settings
from .streams_harness import service, wait_for

NOW_MS = clock.now_ms()
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=0, max_size=40)
HEADER_NAMES = st.sampled_from(["reply-to", "correlation-id", "x-other", "REPLY-TO", ""])
HEADER_VALUES = st.one_of(
    st.none(),
    st.binary(max_size=40),
    st.binary(min_size=300, max_size=700),
    st.text(alphabet="abc.-_", min_size=520, max_size=700).map(str.encode),  # past 512: refused
    st.sampled_from([b"events", b"gradients", b"recommend.replies", b"\xff\xfe", b""]),
    TEXT.map(str.encode),
)


def _request_doc(rid: str) -> dict:
    return {"schema_version": 1, "request_id": rid, "user_id": f"u{rid[-2:]}", "k": 5}


def _event_doc(eid: str) -> dict:
    return {
        "schema_version": 1,
        "event_id": eid,
        "event_type": "click",
        "user_id": f"u{eid[-2:]}",
        "item_id": "i3",
        "ts_ms": NOW_MS,
    }


def _item_doc(iid: str) -> dict:
    return {
        "schema_version": 1,
        "item_id": iid,
        "category": "c1",
        "price": 9.5,
        "created_at_ms": NOW_MS,
    }


@st.composite
def json_value(draw, make) -> bytes | None:
    """A record value: well-formed, broken in one field, not JSON at all, null, or huge."""
    doc = make(f"fz-{uuid.uuid4().hex[:10]}")
    kind = draw(st.sampled_from(["valid", "valid", "dropped", "retyped", "bytes", "null", "huge"]))
    if kind == "dropped":
        doc.pop(draw(st.sampled_from(sorted(doc))))
    elif kind == "retyped":
        doc[draw(st.sampled_from(sorted(doc)))] = draw(
            st.one_of(st.none(), st.integers(), TEXT, st.lists(st.integers(), max_size=3))
        )
    elif kind == "bytes":
        return draw(st.binary(max_size=200))
    elif kind == "null":
        return None
    elif kind == "huge":
        doc["pad"] = "p" * draw(st.integers(20_000, 300_000))
    return json.dumps(doc).encode()


def records(make):
    return st.tuples(
        json_value(make),
        st.one_of(st.none(), st.binary(max_size=600)),
        st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=4),
    )


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory, services, model_dir):
    """One worker (in this process: its counters are readable) and one streams app (its
    own process, metrics on a port) on a prefix of their own, for every example."""
    from freshcore.topics import catalogue_with, ensure_topics

    from .serving_harness import seed_redis

    prefix = f"fz{uuid.uuid4().hex[:8]}."
    conn = services.conn(prefix)
    from confluent_kafka.admin import AdminClient

    from freshcore.kafka import admin_config

    ensure_topics(
        AdminClient(admin_config(conn)),
        prefix,
        catalogue_with({n: 4 for n in ("events", "recommend.requests", "gradients")}),
    )
    seed_redis(conn, model_dir)
    port = free_port()
    log = tmp_path_factory.mktemp("fuzz") / "streams.log"
    names = TopicNames(prefix)
    letters = TopicCounter(conn, [names.recommend_requests_dlq, names.events_dlq])
    try:
        with (
            private_random(AIOKAFKA_RANDOM),
            service(conn, "streams", log, FRESHREC_METRICS_PORT=str(port)) as streams,
            running_worker(worker_settings(conn, model_dir)),
            client_for(conn) as client,
        ):
            yield conn, letters, streams, port, client
    finally:
        letters.close()


AIOKAFKA_RANDOM = (
    "aiokafka.client",
    "aiokafka.conn",
    "aiokafka.consumer.fetcher",
    "aiokafka.partitioner",
)
"""Modules that shuffle with the ``random`` module's global state on the worker's thread."""


@contextlib.contextmanager
def private_random(modules):
    """Give library modules a ``random.Random`` of their own while the in-process worker
    runs: its Kafka client shuffles nodes and partitions on every fetch, from its own
    thread, and Hypothesis takes any change to the global state during a draw for a
    strategy using ``random`` (a deprecation warning now, an error to come)."""
    import importlib

    with pytest.MonkeyPatch.context() as mp:
        for name in modules:
            mp.setattr(importlib.import_module(name), "random", random.Random())
        yield


class TopicCounter:
    """Counts the messages of some topics as they arrive (a group-less reader of every
    partition from the beginning, on a thread), by topic, with their reasons."""

    def __init__(self, conn, topics: list[str]) -> None:
        import threading

        from schemas.codec import decode_dead_letter

        self.counts = dict.fromkeys(topics, 0)
        self.reasons: dict[str, list[str]] = {t: [] for t in topics}
        self.consumer = Consumer(consumer_config(conn, None))
        parts = []
        for t in topics:
            meta = self.consumer.list_topics(t, timeout=10).topics[t]
            parts += [TopicPartition(t, q, 0) for q in meta.partitions]
        self.consumer.assign(parts)
        self._stop = threading.Event()
        self._decode = decode_dead_letter

        def read() -> None:
            while not self._stop.is_set():
                for msg in self.consumer.consume(500, 0.2):
                    if msg.error() is None:
                        self.counts[msg.topic()] += 1
                        letter = self._decode(msg.value(), clock.now_ms())
                        self.reasons[msg.topic()].append(letter.reason)

        self.thread = threading.Thread(target=read, daemon=True, name="dlq-counter")
        self.thread.start()

    def close(self) -> None:
        self._stop.set()
        self.thread.join(10)
        self.consumer.close()


@settings(
    max_examples=2,
    deadline=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@example(  # the findings that once crashed a service, always among the examples
    requests=[
        (json.dumps(_request_doc("fz-long-reply-to")).encode(), b"u1", [("reply-to", b"r" * 600)]),
        (json.dumps(_request_doc("fz-internal-01")).encode(), b"u1", [("reply-to", b"events")]),
        (json.dumps(_request_doc("fz-bad-corr-01")).encode(), b"u1", [("correlation-id", b"\xff")]),
        (json.dumps(_request_doc("fz-empty-corr1")).encode(), b"u1", [("correlation-id", b"")]),
        (b"x" * 900_000, b"u1", [("correlation-id", b"c")]),
    ],
    events=[
        (b"e" * 900_000, b"u1", []),
        (json.dumps(_event_doc("fz-ok-01")).encode(), b"u1", []),
    ],
    items=[(b"i" * 900_000, b"i1", []), (None, b"\xff", [])],
)
@given(
    requests=st.lists(records(_request_doc), min_size=5, max_size=20),
    events=st.lists(records(_event_doc), min_size=5, max_size=20),
    items=st.lists(records(_item_doc), min_size=2, max_size=8),
)
def test_every_record_is_answered_dead_lettered_or_counted_and_nothing_dies(
    fuzzed, requests, events, items
):
    conn, letters, streams, port, client = fuzzed
    names = TopicNames(conn.topic_prefix)
    served, invalid, expired, duplicate = (
        counter(m.REQUESTS, o) for o in ("served", "invalid", "expired", "duplicate")
    )
    dead_before = letters.counts[names.recommend_requests_dlq]
    events_dead_before = letters.counts[names.events_dlq]
    before = scrape_port_now(port)
    learnt_before = counter(m.WORKER_EVENTS, "valid")
    p = Producer(producer_config(conn, **{"message.max.bytes": 2_000_000}))
    item_ends: dict[int, int] = {}

    def item_delivered(err, msg) -> None:
        if err is not None and msg.key() is None and err.code() == KafkaError.INVALID_RECORD:
            return  # refused by a broker that compacts items (Apache Kafka; Tansu takes it)
        assert err is None, err
        item_ends[msg.partition()] = max(item_ends.get(msg.partition(), 0), msg.offset() + 1)

    for topic, batch in (
        (names.recommend_requests, requests),
        (names.events, events),
        (names.items, items),
    ):
        for value, key, headers in batch:
            report = item_delivered if topic == names.items else None
            alone = topic == names.items and key is None  # a refused batch takes all it holds
            if alone:
                p.flush(30)
            p.produce(topic, value=value, key=key, headers=headers or None, on_delivery=report)
            if alone:
                p.flush(30)
    assert close_producer(p, 30) == 0

    def requests_read() -> bool:
        got = sum(
            counter(m.REQUESTS, o) - b
            for o, b in zip(
                ("served", "invalid", "expired", "duplicate"),
                (served, invalid, expired, duplicate),
                strict=True,
            )
        )
        return got == len(requests) or got

    wait_for(requests_read, 60, "every request read and classified")
    assert streams.poll() is None, "the streams app died"

    # every rejected request has its dead letter (and none other was written)
    def a_letter_per_rejection():
        got = letters.counts[names.recommend_requests_dlq] - dead_before
        want = counter(m.REQUESTS, "invalid") - invalid
        return got == want or (got, want)

    wait_for(a_letter_per_rejection, 30, "a dead letter per rejected request")

    def events_settled():
        now = scrape_port_now(port)
        seen = sum(
            total(now, "freshrec_streams_events_total", outcome=o)
            - total(before, "freshrec_streams_events_total", outcome=o)
            for o in ("valid", "duplicate", "rejected")
        )
        return seen == len(events) or seen

    wait_for(events_settled, 60, "every event validated")
    now = scrape_port_now(port)
    valid = total(now, "freshrec_streams_events_total", outcome="valid") - total(
        before, "freshrec_streams_events_total", outcome="valid"
    )
    rejected = total(now, "freshrec_streams_events_total", outcome="rejected") - total(
        before, "freshrec_streams_events_total", outcome="rejected"
    )
    wait_for(
        lambda: counter(m.WORKER_EVENTS, "valid") - learnt_before >= valid,
        60,
        "the valid events learnt",
    )
    wait_for(
        lambda: letters.counts[names.events_dlq] - events_dead_before >= rejected,
        30,
        "a dead letter per rejected event or item",
    )
    # every item record is through the catalogue stage: it commits a batch only once the
    # batch's items are in Redis and its dead letters delivered
    group = Consumer(consumer_config(conn, f"{conn.topic_prefix}freshrec-streams-catalogue"))

    def items_committed():
        parts = [TopicPartition(names.items, q) for q in item_ends]
        got = {tp.partition: tp.offset for tp in group.committed(parts, timeout=10)}
        return all(got[q] >= end for q, end in item_ends.items()) or got

    try:
        wait_for(items_committed, 60, "every item record committed by the catalogue stage")
    finally:
        group.close()
    # alive: a normal request is answered
    assert client.recommend("u1", 5, timeout_s=20).items
    assert streams.poll() is None
