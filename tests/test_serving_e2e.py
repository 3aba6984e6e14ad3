"""Serving over the real broker and Redis: request/reply with the client, duplicates and late
replies, invalid and expired requests, clicks that move recommendations, a slow recall channel
and its breaker, Redis stopped mid-traffic, a hot model reload, and a worker crash."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import redis as redis_lib
from confluent_kafka import Producer

from freshcore import clock
from freshcore import metrics as m
from freshcore.kafka import partition_count, producer_config
from freshcore.rediskeys import RedisKeys
from freshcore.topics import TopicNames
from freshrec.app.stack import free_port
from freshrec.client import RecommendTimeout
from freshrec.sim.world import World
from inference.models.modelfile import read_manifest, write_manifest
from inference.serving.breaker import BreakerConfig
from inference.serving.degrade import LadderConfig
from inference.serving.rerank import space_categories
from inference.serving.settings import ServingSettings
from schemas.codec import encode_request
from schemas.records import Event, RecommendRequest
from schemas.rows import TABLE_ITEM

from .serving_harness import (
    DIM,
    WORLD,
    client_for,
    counter,
    running_worker,
    seed_redis,
    worker_settings,
)
from .streams_harness import (
    HeldProducer,
    dead_letters,
    private_redis,
    produce,
    service,
    stop,
    wait_for,
)


@pytest.mark.tansu
def test_request_reply_through_the_broker(seeded, model_dir):
    conn = seeded
    with running_worker(worker_settings(conn, model_dir)) as w, client_for(conn) as client:
        # u0 is the world's most active user: it has a trained starting row
        reply = client.recommend(
            "u0",
            10,
            context={"device": "pc", "region": "north"},
            exclude=["i0", "i1"],
            timeout_s=10,
        )
        assert reply.request_id.startswith(client.client.client_id)
        assert reply.user_id == "u0" and len(reply.items) == 10
        assert reply.tier == "full" and not reply.degraded
        assert reply.model_version == read_manifest(model_dir)["version"]
        assert {"topic", "queue", "recall", "rank", "rerank", "total"} <= set(reply.timings_ms)
        ids = [i.item_id for i in reply.items]
        assert len(set(ids)) == 10 and not {"i0", "i1"} & set(ids)
        assert all(i.channels for i in reply.items)
        # category spacing: the reply is its own spaced order (no avoidable neighbours)
        cats = World(WORLD).item_category[[World.index_of(i) for i in ids]].tolist()
        assert space_categories(cats, 2) == list(range(10))
        assert reply.user_embedding_version >= 1  # the trained starting row, not a random one
        # low-end devices get the light model by design
        low = client.recommend("u2", 5, context={"device": "low_end"}, timeout_s=10)
        assert low.tier == "light" and "low_end" in low.tier_reason
        # the same request id is answered once: the second send gets no reply
        req = RecommendRequest(request_id=f"dup-{uuid.uuid4().hex}", user_id="u3", k=3)
        client._call(client.client.send(req, 10), 15)
        before = counter(m.REQUESTS, "duplicate")
        with pytest.raises(RecommendTimeout):
            client._call(client.client.send(req, 1.5), 10)
        assert counter(m.REQUESTS, "duplicate") == before + 1
        # a reply that arrives after its call gave up is dropped and counted as late
        with pytest.raises(RecommendTimeout):
            client.recommend("u4", 5, timeout_s=0.001, deadline_ms=clock.now_ms() + 10_000)
        wait_for(lambda: client.stats.late == 1, 10, "the late reply")
        # a reply nobody asked for is dropped and counted as unknown
        p = Producer(producer_config(conn))
        p.produce(client.client.reply_topic, b"{}", headers=[("correlation-id", b"nobody")])
        p.flush(10)
        wait_for(lambda: client.stats.unknown >= 1, 10, "the unknown reply")
        assert client.stats.duplicate == 0
    assert w.stats["invalid"] == 0


def test_invalid_request_gets_an_error_reply_and_a_dead_letter(seeded, model_dir):
    conn = seeded
    names = TopicNames(conn.topic_prefix)
    with running_worker(worker_settings(conn, model_dir)), client_for(conn) as client:
        corr = uuid.uuid4().hex
        bad = json.dumps({"schema_version": 1, "request_id": "r1", "user_id": "u1", "k": 0})
        fut = client._call(_expect(client.client, corr), 5)
        _send_raw(conn, client.client, corr, bad.encode(), b"u1")
        reply = fut.result(20)
        assert reply.tier == "error" and "k" in reply.tier_reason
        letters = dead_letters(conn, names.recommend_requests_dlq, 1)
        assert len(letters) == 1
        (letter,) = letters
        assert letter.source_topic == names.recommend_requests
        assert letter.reason == "invalid_value" and letter.service == "worker"


def test_a_request_that_waited_in_the_topic_past_its_budget_is_answered_by_a_cheap_tier(
    seeded, model_dir
):
    """The serving budget counts from when the request was produced (its record timestamp),
    not from when the worker read it: a request that waited in the topic longer than the
    budget is answered — the client still waits: its own deadline is far — by the cache or
    the hot list, without recall or ranking, and the wait shows as the reply's ``topic``
    stage. Only a deadline the client set drops a request unanswered."""
    conn = seeded
    settings = worker_settings(conn, model_dir, serving=ServingSettings(default_budget_ms=1_000))
    with running_worker(settings), client_for(conn) as client:
        fresh = client.recommend("u7", 5, timeout_s=10)  # warm: the group has joined
        assert fresh.timings_ms["topic"] < 1_000
        corr = uuid.uuid4().hex
        now = clock.now_ms()
        request = RecommendRequest("late-1", "u8", 5, deadline_ms=now + 60_000)
        fut = client._call(_expect(client.client, corr), 5)
        # produced 5 s ago, as if it had waited in a backlog
        _send_raw(conn, client.client, corr, encode_request(request), b"u8", timestamp=now - 5_000)
        reply = fut.result(20)
        assert reply.tier in ("cached", "hot") and "budget" in reply.tier_reason, reply
        assert len(reply.items) == 5
        assert reply.timings_ms["topic"] >= 5_000 and reply.timings_ms["recall"] < 50


def _send_raw(conn, client, corr: str, value: bytes, key: bytes, producer=None, **kwargs) -> None:
    """A request record as a client sends it (reply headers), with a correlation id of our
    choosing; ``kwargs`` to ``produce`` (a timestamp)."""
    p = producer or Producer(producer_config(conn))
    p.produce(
        TopicNames(conn.topic_prefix).recommend_requests,
        value,
        key=key,
        headers=[("reply-to", client.reply_topic.encode()), ("correlation-id", corr.encode())],
        **kwargs,
    )
    assert p.flush(10) == 0


async def _expect(client, corr):
    """A future for a reply with a correlation id of our choosing (raw requests)."""
    import asyncio

    fut = asyncio.get_running_loop().create_future()
    client._pending[corr] = (fut, time.monotonic())
    return _Bridge(fut)


class _Bridge:
    def __init__(self, fut) -> None:
        self.fut = fut

    def result(self, timeout: float):
        wait_for(self.fut.done, timeout, what="a reply")
        return self.fut.result()


def test_no_request_is_committed_while_an_earlier_one_of_its_partition_is_unanswered(
    conn, model_dir
):
    """Requests finish out of order (replies to different topics, an expired one done at
    once): a commit past one whose reply is still in flight would lose it to a crash."""
    from confluent_kafka import TopicPartition

    from inference.clients import WorkerClients
    from inference.worker import Worker

    names = TopicNames(conn.topic_prefix)
    settings = worker_settings(conn, model_dir)
    clients = WorkerClients.connect(settings)
    # the first reply sits in the producer, the second is delivered
    clients.producer = held = HeldProducer(
        clients.producer, lambda topic: topic == names.recommend_replies and not held.held
    )
    real = held.real
    w = Worker(settings, clients)
    w.start()
    p = Producer(producer_config(conn))
    for _ in range(2):  # invalid requests: answered at once with an error reply
        p.produce(names.recommend_requests, key=b"same-partition", value=b"{}")
    assert p.flush(10) == 0
    invalid = m.REQUESTS.labels("invalid")
    before, deadline = invalid._value.get(), time.monotonic() + 30
    while invalid._value.get() - before < 2 or not held.held:
        assert time.monotonic() < deadline, "the requests were not read"
        w.poll_once()
    assert real.flush(10) == 0  # the second reply is delivered
    w.commit(sync=True)
    parts = [
        TopicPartition(names.recommend_requests, q)
        for q in range(partition_count(w.producer, names.recommend_requests))
    ]

    def committed() -> list[int]:
        return [tp.offset for tp in w.events.committed(parts, timeout=10) if tp.offset >= 0]

    assert committed() in ([], [0])  # nothing past the first request: its reply is in flight
    held.release()
    w.commit(sync=True)
    assert committed() == [2]
    w.close()


def test_an_expired_request_is_not_worked_on(seeded, model_dir):
    conn = seeded
    with running_worker(worker_settings(conn, model_dir)), client_for(conn) as client:
        client.recommend("u1", 5, timeout_s=10)  # warm: the group has joined
        before = counter(m.REQUESTS, "expired")
        with pytest.raises(RecommendTimeout):
            client.recommend("u5", 5, timeout_s=2, deadline_ms=clock.now_ms() - 1)
        assert counter(m.REQUESTS, "expired") == before + 1


def _category_share(reply, world: World, category: int) -> float:
    items = [World.index_of(i.item_id) for i in reply.items]
    return float(np.mean(world.item_category[items] == category))


DAY_MS = 1_793_577_600_000  # 2026-11-02 00:00 UTC
HOURS = (0, 6, 12, 18)


def test_a_users_clicks_move_their_next_recommendations_within_a_second(seeded, model_dir):
    """Twelve clicks on the category least present in a user's recommendations raise its share
    in the next reply, within a second (no parameter server: the worker's own recent clicks
    and local steps), whatever the hour of the request: asked at four hours of the day (the
    ranker sees the hour), the share rises at each."""
    conn = seeded
    world = World(WORLD)
    user = "u77"

    def ask(hour: int):
        context = {"device": "pc", "ts_ms": DAY_MS + hour * 3_600_000}
        return client.recommend(user, 20, context=context, timeout_s=10)

    with running_worker(worker_settings(conn, model_dir)) as w, client_for(conn) as client:
        before = {h: ask(h) for h in HOURS}
        # the category least present in this user's recommendations
        counts = sum(
            np.bincount(
                world.item_category[[World.index_of(i.item_id) for i in reply.items]],
                minlength=WORLD.n_categories,
            )
            for reply in before.values()
        )
        target = int(np.argmin(counts))
        clicked = world.category_items[target][:12]
        now = clock.now_ms()
        learnt = w.stats["events"]  # before producing: the worker may learn them at once
        produce(
            conn,
            [
                Event(
                    f"mv-{user}-{i}-{j}", "click", user, World.item_id(int(i)), now + j, None, "pc"
                )
                for j, i in enumerate(clicked)
            ],
        )
        wait_for(lambda: w.stats["events"] >= learnt + len(clicked), 30, "the clicks learnt")
        after = {h: ask(h) for h in HOURS}
        shares = {
            h: (_category_share(before[h], world, target), _category_share(after[h], world, target))
            for h in HOURS
        }
        assert all(a > b for b, a in shares.values()), shares
        assert all(reply.user_embedding_version is not None for reply in after.values())


def test_a_slow_channel_is_dropped_its_breaker_opens_and_closes_after_recovery(seeded, model_dir):
    conn = seeded
    # a cool-down longer than a request takes here, so that the breaker is still open when
    # the request after it opened comes
    breaker = BreakerConfig(window=20, min_calls=5, threshold=0.1, cooldown_ms=3000)
    settings = worker_settings(conn, model_dir, breaker=breaker)
    with running_worker(settings) as w, client_for(conn) as client:
        client.recommend("u1", 5, timeout_s=10)
        runner = w.recommender.runner
        runner.delays_ms["vector"] = 300  # the vector channel's deadline is 40 ms
        timed_out_before = counter(m.RECALL_CALLS, "vector", "timeout")
        for j in range(6):
            reply = client.recommend(f"u{10 + j}", 5, timeout_s=5, deadline_ms=clock.now_ms() + 250)
            assert reply.items, "the other channels still fill the reply"
            assert ("vector" in reply.tier_reason and reply.degraded) or j > 0
        assert counter(m.RECALL_CALLS, "vector", "timeout") >= timed_out_before + 4
        assert runner.breaker_states()["vector"] == "open"
        skipped = counter(m.RECALL_CALLS, "vector", "breaker_open")
        reply = client.recommend("u30", 5, timeout_s=5)
        assert counter(m.RECALL_CALLS, "vector", "breaker_open") == skipped + 1  # not called
        assert reply.items
        runner.delays_ms.pop("vector")  # recovered
        wait_for(lambda: runner.breaker_states()["vector"] == "half_open", 10, "the cool-down")

        def closed() -> bool:  # the probe goes through and closes it
            client.recommend("u40", 5, timeout_s=5)
            return runner.breaker_states()["vector"] == "closed"

        wait_for(closed, 20, "the breaker to close")
        reply = client.recommend("u50", 5, timeout_s=5)
        assert not reply.degraded and any("vector" in i.channels for i in reply.items)


def test_redis_stopped_mid_traffic_replies_continue_degraded_then_recover(conn, model_dir):
    with private_redis(conn) as (private, rproc):
        seed_redis(private, model_dir)
        with running_worker(worker_settings(private, model_dir)), client_for(conn) as client:
            assert not client.recommend("u1", 5, timeout_s=10).degraded
            os.kill(rproc.pid, signal.SIGSTOP)
            degraded = []
            for j in range(8):  # users new to the worker: their rows would come from Redis
                r = client.recommend(f"u{200 + j}", 5, timeout_s=5)
                assert r.items
                degraded.append(r.degraded)
            assert all(degraded[2:]), degraded
            assert "redis" in r.tier_reason
            os.kill(rproc.pid, signal.SIGCONT)

            def recovered():
                return not client.recommend("u300", 5, timeout_s=5).degraded

            wait_for(recovered, 20, "normal replies after Redis returns")


def test_hot_model_reload_changes_the_version_without_losing_requests(seeded, model_dir, tmp_path):
    conn = seeded
    mine = tmp_path / "models"
    shutil.copytree(model_dir, mine)
    with running_worker(worker_settings(conn, mine)), client_for(conn) as client:
        first = client.recommend("u1", 5, timeout_s=10).model_version
        manifest = read_manifest(mine)
        manifest["version"] = "reloaded-" + uuid.uuid4().hex[:6]
        versions = []
        for j in range(60):
            if j == 10:
                write_manifest(mine, manifest)
            versions.append(client.recommend(f"u{j}", 5, timeout_s=5).model_version)
            time.sleep(0.03)
        assert versions[0] == first and versions[-1] == manifest["version"]
        assert client.stats.timeouts == 0 and client.stats.replied >= 61


def test_a_corrupt_model_file_is_refused_and_the_old_models_keep_serving(
    seeded, model_dir, tmp_path
):
    conn = seeded
    mine = tmp_path / "models"
    shutil.copytree(model_dir, mine)
    with running_worker(worker_settings(conn, mine)) as w, client_for(conn) as client:
        good = client.recommend("u1", 5, timeout_s=10).model_version
        manifest = read_manifest(mine)
        target = mine / manifest["files"]["wide_deep"]["file"]
        target.write_bytes(target.read_bytes()[:-7] + b"garbage")
        manifest["version"] = "corrupt"
        write_manifest(mine, manifest)
        wait_for(lambda: w.models.last_error is not None, 10, "the refused load")
        assert "checksum" in w.models.last_error
        assert client.recommend("u2", 5, timeout_s=5).model_version == good


def test_a_request_is_answered_after_a_worker_crash_and_only_once(seeded, model_dir, tmp_path):
    """Worker A answers a request and dies before committing it (its commits are a minute
    apart here): worker B reads the request again and must not answer it twice (the id is
    in Redis); a request sent while no worker runs is answered by B."""
    from freshrec.promtext import scrape_port_now, total

    conn = seeded
    env = {"FRESHREC_EMBEDDING_DIM": "16", "FRESHREC_MODEL_DIR": str(model_dir)}
    answered = redis_lib.Redis.from_url(conn.redis_url)
    keys = RedisKeys(conn.topic_prefix)
    with client_for(conn) as client:
        slow_commits = {**env, "FRESHREC_COMMIT_INTERVAL_S": "60"}
        with service(conn, "worker", tmp_path / "a.log", **slow_commits) as a:
            first = client.recommend("u1", 5, timeout_s=40)  # includes the group join
            rid = first.request_id
            wait_for(lambda: bool(answered.exists(keys.answered(rid))), 10, "A to record it")
            stop(a, signal.SIGKILL)
        # a request sent while no worker runs is answered by the next one
        fut = client._call(_send_later(client, "u2"), 5)
        port = free_port()
        with service(conn, "worker", tmp_path / "b.log", FRESHREC_METRICS_PORT=str(port), **env):
            second = fut.result(60)

            def duplicates() -> float:
                got = scrape_port_now(port)
                return total(got, "freshrec_requests_total", outcome="duplicate") if got else 0

            wait_for(lambda: duplicates() >= 1, 30, "B to read the first request again")
        assert first.items and second.items and second.request_id != first.request_id
        assert client.stats.duplicate == 0  # the first request was not answered again


@pytest.mark.parametrize("sent", ["before the worker starts", "while it learns"])
def test_a_backlog_of_events_does_not_hold_back_a_request(seeded, model_dir, monkeypatch, sent):
    """A request behind a backlog of events is answered while the backlog is learnt: sent
    before the worker starts, the broker may hand it over before or after the events; sent
    while the worker learns, it is fetched behind the events the client has prefetched, which
    the worker drops every ``prefetch_purge_ms`` while its consumes come back full
    (``PrefetchPurge``), counting each such pause."""
    from dataclasses import replace

    from inference.intake import RequestIntake
    from tools.benchlib import produce_values, synthetic_records

    conn = seeded
    names = TopicNames(conn.topic_prefix)
    n = 60_000  # a minute of a busy shard's events, waiting before the worker starts
    produce_values(conn, names.events, synthetic_records(World(WORLD), 3, n))
    learnt = m.WORKER_EVENTS.labels("valid")
    before = learnt._value.get()
    prefetch_pauses = m.WORKER_EVENT_PAUSES.labels("prefetch")
    pauses_before = prefetch_pauses._value.get()
    # the events learnt when the worker produces the reply, read on its own thread: read when
    # the client receives it, the count also held what was learnt during the reply's trip and
    # the client's fetch wait (38,164 and 59,670 on loaded CI machines)
    at_reply: list[float] = []
    produce_reply = RequestIntake._reply

    def _reply(self, topic, corr, reply, *args, **kwargs):
        if reply.request_id == "backlog-1":
            at_reply.append(learnt._value.get())
        return produce_reply(self, topic, corr, reply, *args, **kwargs)

    monkeypatch.setattr(RequestIntake, "_reply", _reply)
    # and when the worker read it: a late reply says whether the read or the serving was late
    at_read: list[float] = []
    sent_at: list[float] = []  # and when it was delivered to the broker, sent while learning
    accept = RequestIntake.accept

    def _accept(self, msg):
        at_read.append(learnt._value.get())
        return accept(self, msg)

    monkeypatch.setattr(RequestIntake, "accept", _accept)
    with client_for(conn) as client:
        corr = uuid.uuid4().hex
        fut = client._call(_expect(client.client, corr), 5)
        request = RecommendRequest("backlog-1", "u3", 5)
        # connected now: a producer made when the request is due spent the backlog's
        # learning (~0.4 s here) on its metadata and connection
        producer = Producer(producer_config(conn))
        producer.list_topics(timeout=10)
        if sent == "before the worker starts":
            _send_raw(conn, client.client, corr, encode_request(request), b"u3", producer)
        settings = worker_settings(conn, model_dir)
        # what is tested is the wait behind the backlog, not the recall deadlines: those of
        # the in-memory channels (20 ms) were once missed on a loaded CI machine (recall took
        # 31 ms where it takes 3-6 here), and the reply came back degraded
        sv = settings.serving
        relaxed = {k: replace(c, deadline_ms=10 * c.deadline_ms) for k, c in sv.channels.items()}
        # pauses every 100 ms (1 s by default): this machine learns the 60,000 in ~0.4 s
        purge = 100.0
        settings = replace(settings, serving=replace(sv, channels=relaxed), prefetch_purge_ms=purge)
        with running_worker(settings):
            if sent == "while it learns":
                wait_for(lambda: learnt._value.get() > before, 60, "the worker to learn")
                _send_raw(conn, client.client, corr, encode_request(request), b"u3", producer)
                sent_at.append(learnt._value.get())
            reply = fut.result(60)
            wait_for(lambda: learnt._value.get() - before >= n, 120, "the backlog learnt")
    assert reply.items and not reply.degraded, reply.tier_reason
    # answered while the backlog was being learnt, not after it, against all 60,000 for a
    # worker that learns before it serves (or reads its requests behind prefetched events)
    assert len(at_reply) == 1, at_reply
    # (for one sent while learning: counted from when it was sent, since how much was learnt
    # before it went out is the test's own latency, up to ~19,000 here). Answered before
    # three quarters of what was left then: with the pauses, 15 recorded runs on 2 cores
    # answered after 8% to 50% of it (2 of 38 runs over half); with them off
    # (``prefetch_purge_ms`` 0) after 87% to 95%
    start = before if sent == "before the worker starts" else sent_at[0]
    late = (at_reply[0] - before, "read at", at_read[0] - before, "sent at", start - before)
    assert at_reply[0] - start < 0.75 * (n - (start - before)), late
    if sent == "while it learns":  # read behind prefetched events: only a pause lets it by
        assert prefetch_pauses._value.get() > pauses_before, late


def test_live_events_stamped_long_ago_are_not_paused_for(seeded, model_dir):
    """Live traffic the worker keeps up with is never paused to drop prefetched events,
    whatever its records' Kafka timestamps: here a minute back, as from a producer that
    stamps records with their events' own times. (Paused while events looked old, this
    worker paused 23 times in this test.)"""
    from dataclasses import replace

    from tools.benchlib import synthetic_records

    conn = seeded
    names = TopicNames(conn.topic_prefix)
    records = synthetic_records(World(WORLD), 4, 3_000)
    learnt = m.WORKER_EVENTS.labels("valid")
    pauses = m.WORKER_EVENT_PAUSES.labels("prefetch")
    producer = Producer(producer_config(conn))
    producer.list_topics(timeout=10)  # connected before the traffic starts
    settings = replace(worker_settings(conn, model_dir), prefetch_purge_ms=100.0)
    with running_worker(settings):
        before, pauses_before = learnt._value.get(), pauses._value.get()
        stamp_ms = clock.now_ms() - 60_000
        start = time.monotonic()
        # 1,000 events/s for three seconds, paced: a consume comes back full (2,000 events
        # waiting) only if the worker stalls for two seconds
        for i in range(0, len(records), 30):
            while time.monotonic() - start < i / 1_000:
                producer.poll(0.002)
            for key, value in records[i : i + 30]:
                producer.produce(names.events, value, key, timestamp=stamp_ms)
            producer.poll(0)
        assert producer.flush(30) == 0
        wait_for(lambda: learnt._value.get() - before >= len(records), 60, "the events learnt")
    assert pauses._value.get() == pauses_before


async def _send_later(client, user):
    import asyncio

    task = asyncio.ensure_future(client.client.recommend(user, 5, timeout_s=55))
    return _Bridge(task)


def test_kafkajs_asks_for_recommendations_with_the_documented_protocol(seeded, model_dir):
    from .test_interop_kafkajs import INTEROP, _bin, ensure_kafkajs

    ensure_kafkajs()
    conn = seeded
    names = TopicNames(conn.topic_prefix)
    with running_worker(worker_settings(conn, model_dir)):
        out = subprocess.run(
            [
                _bin("node"),
                "request_reply.js",
                conn.kafka_bootstrap_servers,
                names.recommend_requests,
                names.recommend_replies,
                "u0",
                "7",
            ],
            cwd=INTEROP,
            capture_output=True,
            text=True,
            timeout=90,
        )
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout.strip().splitlines()[-1])
    assert reply["user_id"] == "u0" and len(reply["items"]) == 7 and reply["tier"] == "full"
    assert reply["request_id"].startswith("js-")


def test_large_catalogues_use_the_ivf_index_for_vector_recall(seeded, model_dir):
    from dataclasses import replace

    conn = seeded
    base = worker_settings(conn, model_dir)
    # the index is the CPU's: a worker on a GPU searches exactly
    settings = replace(
        base, device="cpu", serving=replace(base.serving, ann_min_items=100, ann_nprobe=4)
    )
    with running_worker(settings) as w, client_for(conn) as client:
        wait_for(lambda: w.recommender.ann is not None, 20, "the background index build")
        from freshcore import metrics as m

        assert m.ANN_INDEX_ITEMS._value.get() == len(w.recommender.ann.order) > 0
        reply = client.recommend("u0", 10, context={"device": "pc"}, timeout_s=10)
        assert reply.tier == "full" and not reply.degraded and len(reply.items) == 10
        # the vector channel now answers from the index: the scanned cells' items, best first
        from inference.serving.recall import RecallQuery

        rec = w.recommender
        query = RecallQuery("u0", np.asarray(w.user_row("u0")), None)
        found = rec.runner.channels["vector"].recall([query], 20)[0]
        assert 0 < len(found) <= 20 and all(rec.name_of_slot[s] for s in found)
        scores = w.cache.gather(TABLE_ITEM, found) @ query.user_row
        assert np.all(np.diff(scores) <= 1e-5)  # re-scored with the current rows, in order


def test_bench_serving_ranks_on_the_chosen_device_and_summarises_the_parts_it_ran(
    model_dir, tmp_path
):
    import sys

    import torch

    from freshrec.progress import ProgressLine
    from tools.bench_serving import summary
    from tools.serving_inprocess import bench_ranking

    # asserts batched == serial
    r = bench_ranking(model_dir, torch.device("cpu"), ProgressLine(), dim=DIM)
    assert set(r) == {"wide_deep", "light", "dynamic_batch"}
    assert r["dynamic_batch"]["candidates"] == 32 * 500
    text = summary({"device": "cpu", "ranking": r})
    assert "ranking wide_deep: 500 candidates" in text and "32 requests, 16000 candidates" in text
    assert "recall" not in text and "req/s" not in text  # parts not run are not reported
    bad = subprocess.run(
        [sys.executable, "-m", "tools.bench_serving", "--parts", "ranking,bogus"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--parts takes some of ranking,recall" in bad.stderr
    if not torch.cuda.is_available():
        bad = subprocess.run(
            [sys.executable, "-m", "tools.bench_serving", "--device", "cuda"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert bad.returncode == 2 and "--device cuda:" in bad.stderr
        # the GPU checks script says there is nothing to check, rather than failing somewhere
        checks = subprocess.run(
            ["bash", str(Path(__file__).parents[1] / "tools" / "gpu_checks.sh"), str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHON": sys.executable},
        )
        assert checks.returncode == 2 and "no CUDA device" in checks.stderr


def test_an_item_deleted_from_the_catalogue_is_served_by_no_tier(seeded, model_dir):
    """A tombstone on ``items`` removes the item from the catalogue in Redis (the streams
    app: tests/test_streams_e2e.py); here the catalogue stage's writes are replayed, and the
    worker must stop serving the item from every source that can still name it: the IVF
    index built before the deletion, u0's cached reply, and the hot list."""
    from dataclasses import replace

    import redis as redis_lib

    from freshcore.rediskeys import RedisKeys
    from inference.serving.recall import RecallQuery
    from streams.catalogue import queue_deletions

    conn = seeded
    base = worker_settings(conn, model_dir)
    settings = replace(
        base, device="cpu", serving=replace(base.serving, ann_min_items=100, ann_nprobe=4)
    )
    ctx = {"device": "pc", "region": "north"}
    with running_worker(settings) as w, client_for(conn) as client:
        rec = w.recommender
        wait_for(lambda: rec.ann is not None, 20, "the background index build")
        first = client.recommend("u0", 10, context=ctx, timeout_s=10)  # cached for u0 now
        assert first.tier == "full" and len(first.items) == 10
        query = RecallQuery("u0", np.asarray(w.user_row("u0")), None)
        vector = rec.runner.channels["vector"].recall([query], 20)[0]
        gone = list(
            dict.fromkeys(
                [rec.name_of_slot[s] for s in vector[:5]]
                + [i.item_id for i in first.items[:5]]
                + rec.snap.hot["global"][:3]
            )
        )
        gone_slots = [rec.slot_of[g] for g in gone]
        assert np.isin(gone_slots, rec.ann.order).any()  # the index holds some of them
        r = redis_lib.Redis.from_url(conn.redis_url)
        keys = RedisKeys(conn.topic_prefix)
        pipe = r.pipeline(transaction=False)
        queue_deletions(pipe, keys, gone)
        pipe.incr(keys.catalogue_version)
        pipe.execute()
        # the refresher reloads the catalogue; the worker adopts it with its next batch
        wait_for(
            lambda: not set(gone) & set(rec.snapshots.snapshot.catalogue.index),
            10,
            "the catalogue reload",
        )
        served = lambda reply: {i.item_id for i in reply.items}  # noqa: E731
        # the cached tier: u0's last full reply, less the deleted items (five of its ten, at
        # least)
        rec.ranking.full_failed_until = time.monotonic() + 60
        cached = client.recommend("u0", 10, context=ctx, timeout_s=10)
        assert cached.tier == "cached" and cached.items
        assert served(cached) == served(first) - set(gone)
        assert not set(gone) & set(rec.slot_of)  # adopted with that batch
        rec.ranking.full_failed_until = 0.0
        # the full tier, its vector channel answering from the old index
        again = client.recommend("u0", 10, context=ctx, timeout_s=10)
        assert again.tier == "full" and len(again.items) == 10
        assert not served(again) & set(gone)
        assert not set(rec.runner.channels["vector"].recall([query], 20)[0].tolist()) & set(
            gone_slots
        )
        assert np.isin(gone_slots, rec.ann.order).any()  # the same index: nothing rebuilt it
        # the hot tier
        hot = rec.hot_replies.items(
            rec.snap, RecommendRequest(request_id="h", user_id="u0", k=50), rec._listed
        )
        listed = [n for n in rec.snap.hot["global"] if n not in set(gone)]
        assert [name for name, *_ in hot] == listed[:50]
        assert len(listed) <= len(rec.snap.hot["global"]) - 3  # the list still names them


def test_the_catalogue_reloads_when_the_streams_app_writes_it_not_only_when_it_grows(
    redis_client, prefix
):
    from freshcore.rediskeys import RedisKeys
    from inference.serving.snapshot import SnapshotRefresher
    from schemas.records import Item
    from streams.catalogue import queue_catalogue, queue_deletions

    keys = RedisKeys(prefix)
    now = clock.now_ms()

    def write(sets=(), deletes=(), bump=True):  # what the catalogue stage does with a batch
        pipe = redis_client.pipeline(transaction=False)
        if sets:
            queue_catalogue(pipe, keys, [Item(i, c, 1.0, now) for i, c in sets], now)
        if deletes:
            queue_deletions(pipe, keys, list(deletes))
        if bump:
            pipe.incr(keys.catalogue_version)
        pipe.execute()

    write(sets=[("a", "c1"), ("b", "c2")])
    refresher = SnapshotRefresher(redis_client, keys, catalogue_refresh_s=3600)
    refresher.refresh_once()
    assert refresher.snapshot.catalogue.names == ["a", "b"]
    write(sets=[("c", "c3")], deletes=["a"])  # one out, one in: the size stays 2
    refresher.refresh_once()
    cat = refresher.snapshot.catalogue
    assert cat.names == ["b", "c"] and cat.category_names == ["c2", "c3"]
    write(sets=[("b", "c9")], bump=False)  # a write that skips the counter waits for the hour
    refresher.refresh_once()
    assert refresher.snapshot.catalogue.category_names == ["c2", "c3"]


def test_a_user_the_worker_knows_nothing_of_gets_the_hot_list_where_the_ladder_says_so(
    seeded, model_dir
):
    """FRESHREC_COLD_HISTORY: a user with fewer known interactions than it is served the hot
    list, by design and saying why; once the worker has learnt their clicks, the full tier."""
    conn = seeded
    serving = ServingSettings(default_budget_ms=10_000, ladder=LadderConfig(cold_history=2))
    with (
        running_worker(worker_settings(conn, model_dir, serving=serving)) as w,
        client_for(conn) as client,
    ):
        user = f"newcomer-{uuid.uuid4().hex[:8]}"
        cold = client.recommend(user, 5, timeout_s=10)
        assert cold.tier == "hot" and cold.tier_reason == "history 0 < 2: the hot list", cold
        assert len(cold.items) == 5
        learnt = w.stats["events"]
        now = clock.now_ms()
        items = [World.item_id(i) for i in (3, 4)]
        produce(
            conn, [Event(f"{user}-{j}", "click", user, i, now + j) for j, i in enumerate(items)]
        )
        wait_for(lambda: w.stats["events"] >= learnt + 2, 30, "the clicks learnt")
        warm = client.recommend(user, 5, timeout_s=10)
        assert warm.tier == "full", warm
