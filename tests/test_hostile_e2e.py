"""One bad record costs one dead letter, never an outage: single hostile messages against the
real worker, streams app and client on the embedded broker and Redis, and the delivery
failures that must never commit work past what is done.

Each finding has its test here, written to fail on the behaviour the finding describes
(checked by putting the old behaviour back for the reply-to pattern, the reply retry and the
revoke's purge)."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid

import pytest
import redis as redis_lib
from confluent_kafka import Producer, TopicPartition

from freshcore import clock
from freshcore import metrics as m
from freshcore.kafka import consumer_config, producer_config
from freshcore.rediskeys import RedisKeys
from freshcore.topics import TopicNames
from freshrec.client import RecommendTimeout
from inference.clients import WorkerClients
from schemas.codec import encode_request
from schemas.records import RecommendRequest

from .serving_harness import client_for, counter, running_worker, worker_settings
from .streams_harness import HeldProducer, dead_letters, item_feature, wait_for


def send_request(conn, value: bytes, headers, key: bytes = b"u1") -> None:
    p = Producer(producer_config(conn))
    p.produce(
        TopicNames(conn.topic_prefix).recommend_requests, value=value, key=key, headers=headers
    )
    assert p.flush(10) == 0


def request(rid: str = "hostile", user: str = "u1") -> bytes:
    return encode_request(RecommendRequest(rid, user, 5))


def committed_requests(conn, w) -> int:
    names = TopicNames(conn.topic_prefix)
    parts = [TopicPartition(names.recommend_requests, q) for q in range(4)]
    return sum(max(tp.offset, 0) for tp in w.events.committed(parts, timeout=10))


def topic_values(conn, topic: str, timeout_s: float = 3.0) -> list[bytes]:
    """Everything on ``topic`` so far (a fresh group from the beginning; a missing topic is
    empty)."""
    from confluent_kafka import Consumer

    c = Consumer(consumer_config(conn, f"{conn.topic_prefix}reader-{uuid.uuid4().hex[:6]}"))
    c.subscribe([topic])
    out, deadline = [], time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            msg = c.poll(0.2)
            if msg is not None and not msg.error():
                out.append(msg.value())
    finally:
        c.close()
    return out


def test_reply_to_headers_that_name_no_reply_topic_are_dead_letters_and_the_worker_goes_on(
    seeded, model_dir
):
    """A ``reply-to`` of 600 characters once made ``produce`` raise and crash every worker
    that took the partition; one naming ``events`` made the worker write replies there."""
    conn = seeded
    names = TopicNames(conn.topic_prefix)
    hostile = [
        [("reply-to", b"x" * 600), ("correlation-id", b"c-long")],
        [("reply-to", names.events.encode()), ("correlation-id", b"c-events")],
        [("reply-to", names.gradients.encode()), ("correlation-id", b"c-grad")],
        [("reply-to", b"\xff\xfe"), ("correlation-id", b"c-utf")],
        [
            ("reply-to", names.recommend_replies.encode()),
            ("reply-to", b"elsewhere"),
            ("correlation-id", b"c-twice"),
        ],
    ]
    with running_worker(worker_settings(conn, model_dir)) as w, client_for(conn) as client:
        invalid = counter(m.REQUESTS, "invalid")
        for j, headers in enumerate(hostile):
            send_request(conn, request(f"h{j}"), headers)
        wait_for(lambda: counter(m.REQUESTS, "invalid") >= invalid + len(hostile), 30, "the reads")
        letters = dead_letters(conn, names.recommend_requests_dlq, len(hostile))
        assert sorted(d.reason for d in letters) == sorted(
            ["reply_to_not_allowed"] * 4 + ["duplicate_header"]
        )
        wait_for(lambda: committed_requests(conn, w) >= len(hostile), 20, "the commits")
        assert client.recommend("u2", 5, timeout_s=10).items  # alive and serving
    events = topic_values(conn, names.events)
    assert not any(b"hostile" in v or b'"request_id"' in v for v in events)


def test_a_correlation_id_nobody_can_read_is_a_dead_letter_not_a_reply(seeded, model_dir):
    """A non-UTF-8 or empty correlation id was copied onto the shared reply topic, where it
    killed every ``RecommendClient``'s reader."""
    conn = seeded
    names = TopicNames(conn.topic_prefix)
    with running_worker(worker_settings(conn, model_dir)), client_for(conn) as client:
        client.recommend("u1", 5, timeout_s=10)
        for corr in (b"\xff\xfe\xfd", b"", b"x" * 500, b"ctl\x00char"):
            send_request(conn, request(f"c{len(corr)}"), [("correlation-id", corr)])
        letters = dead_letters(conn, names.recommend_requests_dlq, 4)
        assert [d.reason for d in letters] == ["invalid_correlation_id"] * 4
        reply = client.recommend("u3", 5, timeout_s=10)  # the client's reader is alive
        assert reply.items and client.stats.malformed == 0


def test_the_client_drops_and_counts_replies_it_cannot_read_and_keeps_reading(seeded, model_dir):
    conn = seeded
    names = TopicNames(conn.topic_prefix)
    with running_worker(worker_settings(conn, model_dir)), client_for(conn) as client:
        client.recommend("u1", 5, timeout_s=10)  # the reader is at the end of the topic
        p = Producer(producer_config(conn))
        junk = [
            (b"not json", [("correlation-id", b"\xff")]),
            (b"{}", [("correlation-id", b"a"), ("correlation-id", b"b")]),
            (b"\x00" * 10, [("correlation-id", None)]),
        ]
        for value, headers in junk:
            p.produce(names.recommend_replies, value=value, headers=headers)
        assert p.flush(10) == 0
        wait_for(lambda: client.stats.malformed + client.stats.unknown >= 3, 10, "the junk read")
        assert client.recommend("u4", 5, timeout_s=10).items


def test_a_request_of_any_size_gets_a_bounded_dead_letter(seeded, model_dir):
    """A value over ~750 KB made a dead letter larger than the broker takes; producing it
    raised and crashed the worker."""
    conn = seeded
    names = TopicNames(conn.topic_prefix)
    huge = b'{"x": "' + b"a" * 900_000 + b'"}'
    with running_worker(worker_settings(conn, model_dir)) as w, client_for(conn) as client:
        send_request(conn, huge, [("correlation-id", b"big")])
        (letter,) = dead_letters(conn, names.recommend_requests_dlq, 1)
        assert letter.reason == "oversize_payload" and letter.value_truncated
        assert letter.value_bytes == len(huge)
        assert letter.value_sha256 == hashlib.sha256(huge).hexdigest()
        wait_for(lambda: committed_requests(conn, w) >= 1, 20, "the commit")
        assert client.recommend("u2", 5, timeout_s=10).items


def _holding_replies(settings):
    """The worker's clients with its replies held (``held.holding``, on at first)."""
    names = TopicNames(settings.conn.topic_prefix)
    clients = WorkerClients.connect(settings)
    clients.producer = held = HeldProducer(
        clients.producer, lambda topic: topic == names.recommend_replies and held.holding
    )
    held.holding = True
    return clients, held


def test_a_reply_librdkafka_gives_up_on_is_produced_again_and_its_request_waits(seeded, model_dir):
    """A failed reply was marked done and never retried: the request was committed and
    nobody got an answer."""
    conn = seeded
    settings = worker_settings(conn, model_dir)
    clients, held = _holding_replies(settings)
    with running_worker(settings, clients=clients) as w, client_for(conn) as client:
        fut = client._call(_recommend(client, "u5"), 5)
        wait_for(lambda: len(held.held) == 1, 20, "the reply to be produced")
        retried = counter(m.PRODUCE_RETRIES, "reply")
        assert held.fail() == 1  # librdkafka gives up on it
        wait_for(lambda: len(held.held) == 1, 20, "the reply produced again")  # and held
        assert counter(m.PRODUCE_RETRIES, "reply") == retried + 1
        assert committed_requests(conn, w) == 0  # nothing delivered: the request waits
        held.holding = False
        held.release()
        reply = fut.result(20)  # delivered
        assert reply.items
        wait_for(lambda: committed_requests(conn, w) >= 1, 20, "the commit after delivery")


def test_a_duplicate_read_while_the_first_reply_is_on_its_way_is_not_answered(seeded, model_dir):
    """An id counted as answered only once its reply's delivery was acknowledged: the same
    request read in between (on a loaded machine) was answered a second time."""
    conn = seeded
    settings = worker_settings(conn, model_dir)
    clients, held = _holding_replies(settings)
    req = RecommendRequest(f"dup-{uuid.uuid4().hex}", "u3", 3)
    with running_worker(settings, clients=clients), client_for(conn) as client:
        first = client._call(_send(client, req, 30), 5)
        wait_for(lambda: len(held.held) == 1, 20, "the first reply to be produced")
        before = counter(m.REQUESTS, "duplicate")
        second = client._call(_send(client, req, 3), 5)
        wait_for(lambda: counter(m.REQUESTS, "duplicate") == before + 1, 20, "the duplicate")
        assert len(held.held) == 1  # no second reply produced
        held.holding = False
        held.release()
        assert first.result(20).items
        with pytest.raises(RecommendTimeout):
            second.result(20)


async def _send(client, req: RecommendRequest, timeout_s: float):
    from .test_serving_e2e import _Bridge

    return _Bridge(asyncio.ensure_future(client.client.send(req, timeout_s)))


async def _recommend(client, user):
    from .test_serving_e2e import _Bridge

    return _Bridge(asyncio.ensure_future(client.client.recommend(user, 5, timeout_s=30)))


def test_a_transaction_with_a_failed_command_is_not_taken_for_persisted(conn):
    """EXEC runs every queued command even when one fails; the parameter server took its
    reply for success, so offsets could move ahead of rows."""
    import numpy as np

    from freshcore.redisconn import TransactionFailed
    from param_server.store import (
        claim_partitions,
        pack_persist,
        persist_fenced,
    )
    from schemas.rowbatch import TABLE_USER

    r = redis_lib.Redis.from_url(conn.redis_url)
    keys = RedisKeys(conn.topic_prefix)
    r.set(keys.embeddings("user", 0), "a string: HSET on it fails inside EXEC")
    ids = np.array([1, 2], np.int64)
    rows = np.ones((2, 5), np.float32)
    tables = {0: {TABLE_USER: (ids, rows, rows, np.ones(2, np.uint64), np.ones(2, np.int64))}}
    units = pack_persist(keys, tables, {0: 7})
    owners = {0: "this-instance"}
    claim_partitions(r, keys, owners)
    with pytest.raises(TransactionFailed, match="WRONGTYPE"):
        persist_fenced(r, keys, units, owners)
    r.delete(keys.embeddings("user", 0))
    assert persist_fenced(r, keys, units, owners)  # sent again, succeeds
    assert r.get(keys.ps_applied(0)) == b"7"


def test_a_gradient_message_that_fails_delivery_is_produced_again_and_holds_its_events(conn):
    """A gradient message that failed delivery was reported and its events committed: a
    broker outage longer than the delivery timeout lost learning silently."""
    from .streams_harness import produce
    from .test_learning_e2e import clicks, learner, pump

    w = learner(conn, held=True)
    held = w.producer
    produce(conn, clicks("gf-u", "gf-i", 5))
    pump([w], lambda: len(held.held) == 2 and not w.backlog, what="the gradients to leave")
    retried = counter(m.GRADIENT_MESSAGES, "retried")
    assert held.fail() == 2  # librdkafka gives up on both
    w.commit(sync=True)
    names = TopicNames(conn.topic_prefix)
    parts = [TopicPartition(names.events, p) for p in range(4)]

    def committed() -> int:
        return sum(max(tp.offset, 0) for tp in w.events.committed(parts, timeout=10))

    assert committed() == 0 and counter(m.GRADIENT_MESSAGES, "retried") == retried + 2
    w.sender.retry_due(time.monotonic() + 60)  # the retry's wait over: produced again
    assert len(held.held) == 2
    held.release()  # the broker takes them this time
    w.commit(sync=True)
    assert committed() == 5
    w.close()


def test_a_rebalance_takes_back_undelivered_gradients_instead_of_applying_them_twice(conn):
    """On a revoke the worker waited 5 s and forgot its pending offsets: gradients delivered
    later were applied twice (the next owner learns the same events). Now what the broker
    does not have is purged, its local steps withdrawn, and its events not committed."""
    import numpy as np

    from inference.settings import LearningSettings, WorkerSettings
    from schemas.ids import row_id
    from schemas.rowbatch import TABLE_USER

    from .streams_harness import produce
    from .test_learning_e2e import DIM, clicks, pump, started

    settings = WorkerSettings(
        conn, LearningSettings(dim=DIM), user_capacity_rows=1000, revoke_flush_s=0.5
    )
    w = started(settings, held=True)
    held = w.producer
    before = w.user_row("rb-u").copy()
    produce(conn, clicks("rb-u", "rb-i", 4))
    pump([w], lambda: len(held.held) == 2 and not w.backlog, what="the gradients to leave")
    assert not np.allclose(w.user_row("rb-u"), before)  # the local step is in the row
    withdrawn = counter(m.GRADIENT_MESSAGES, "withdrawn")
    w._on_revoke(w.events, w.events.assignment())
    assert counter(m.GRADIENT_MESSAGES, "withdrawn") == withdrawn + 2 and not held.held
    np.testing.assert_allclose(w.user_row("rb-u"), before, atol=1e-6)  # step withdrawn
    slot = w.cache.held(TABLE_USER, row_id("rb-u"))
    assert len(w.pending.steps(TABLE_USER, slot)) == 0
    names = TopicNames(conn.topic_prefix)
    parts = [TopicPartition(names.events, p) for p in range(4)]
    assert sum(max(tp.offset, 0) for tp in w.events.committed(parts, timeout=10)) == 0
    w.close()


def test_an_event_or_item_of_any_size_gets_a_bounded_dead_letter_from_the_streams_app(
    conn, tmp_path
):
    """The streams app's validate and catalogue stages wrote unbounded dead letters; one over
    the broker's limit crashed them, and the validate stage's clean-up then committed past
    the batch: its valid events were never counted."""
    from schemas.records import Event

    from .streams_harness import produce, service

    names = TopicNames(conn.topic_prefix)
    huge = b'{"event_id": "' + b"e" * 900_000 + b'"}'
    now = clock.now_ms()
    good = [Event(f"hg{j}", "click", "u1", "i7", now - 1000 + j, "north", "pc") for j in range(6)]
    p = Producer(producer_config(conn))
    p.produce(names.items, value=huge, key=b"i1")
    assert p.flush(10) == 0
    produce(conn, good[:3], raw=[(b"u1", huge)])
    produce(conn, good[3:])
    r = redis_lib.Redis.from_url(conn.redis_url)
    keys = RedisKeys(conn.topic_prefix)

    def clicks() -> float:
        got = item_feature(r, keys, "clicks", "i7")
        return float(got) if got is not None else 0.0

    with service(conn, "streams", tmp_path / "streams.log"):
        letters = dead_letters(conn, names.events_dlq, 2)
        assert sorted(d.source_topic for d in letters) == sorted([names.events, names.items])
        assert all(d.value_truncated and d.value_bytes == len(huge) for d in letters)
        wait_for(lambda: abs(clicks() - 6) < 1e-3, 60, "the six valid clicks counted")
