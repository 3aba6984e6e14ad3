"""The streams app against the real broker and Redis: exact hot lists, features, dead letters,
duplicates, and SIGKILL + restart (two instances: tests/test_cluster_e2e.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import random
import signal
import threading
import time

import pytest
import redis as redis_lib

from freshcore import clock
from freshcore.hotscore import HotWeights, merge_hot_lists
from freshcore.redisconn import connect, connect_async
from freshcore.rediskeys import RedisKeys
from freshcore.topics import TopicNames
from schemas.records import Event, Item
from streams.sink import read_hot_lists

from .streams_harness import (
    all_features,
    brute_force,
    close,
    dead_letters,
    item_feature,
    matches_covisit,
    matches_sequel,
    private_redis,
    produce,
    service,
    stop,
    top_k,
    wait_for,
)

K = 5
SETTINGS = {"FRESHREC_HOT_K": str(K), "FRESHREC_HOT_PUBLISH_MS": "100"}
REGIONS = ["north", "south", "east"]


def world_events(seed: int, n: int, t0: int, id_prefix: str) -> list[Event]:
    """Events on 30 items whose popularity differs enough that ranks are unambiguous."""
    rng = random.Random(seed)
    out = []
    for j in range(n):
        item = f"i{min(int(rng.expovariate(0.15)), 29)}"
        kind = rng.choices(["impression", "click", "conversion"], [0.7, 0.25, 0.05])[0]
        out.append(
            Event(
                f"{id_prefix}{j}",
                kind,
                f"u{rng.randint(0, 40)}",
                item,
                t0 + rng.randint(0, 120_000),
                rng.choice(REGIONS),
                "pc",
            )
        )
    return out


def catalogue() -> list[Item]:
    return [Item(f"i{i}", f"c{i % 3}", float(5 + 13 * i), 1_700_000_000_000) for i in range(30)]


def merged(conn, scope: str, k: int = K):
    async def read():
        client = await connect_async(conn.redis_url)
        try:
            return await read_hot_lists(client, RedisKeys(conn.topic_prefix), scope)
        finally:
            await client.aclose()

    lists = asyncio.run(read())
    return lists, merge_hot_lists(lists, k, HotWeights(), 0.95)


def matches_brute_force(conn, events, prices) -> bool | str:
    """True when Redis holds exactly what a brute-force pass over ``events`` gives."""
    r = connect(conn.redis_url)
    keys = RedisKeys(conn.topic_prefix)
    at = max(e.ts_ms for e in events)
    feats = {n: all_features(r, keys, n) for n in keys.FEATURES}
    if len(feats["clicks"]) != len({e.item_id for e in events}):
        return f"{len(feats['clicks'])} items have features"
    # each item's features are decayed to the event time recorded beside them
    as_of = {k.decode(): int(v) for k, v in all_features(r, keys, "as_of").items()}
    for item in {e.item_id for e in events}:
        mine = [e for e in events if e.item_id == item and e.ts_ms <= as_of.get(item, 0)]
        if not mine:
            return f"{item}: no features yet"
        want = brute_force(mine, prices, as_of[item])["global"][item]
        for n, w in zip(
            ("impressions", "clicks", "conversions", "ctr", "cvr", "hot"), want, strict=True
        ):
            got = float(feats[n].get(item.encode(), -1))
            if not math.isclose(got, w, rel_tol=1e-6, abs_tol=1e-6):
                return f"{item}.{n}: {got} != {w}"
    expect = brute_force(events, prices, at)
    for scope in ["global", *REGIONS]:
        lists, top = merged(conn, scope)
        if not lists or max(h.as_of_ms for h in lists) != at:
            return f"{scope}: lists not yet at {at}"
        got_ids = [e.item_id for e, _ in top]
        want = top_k(expect[scope], K)
        if got_ids != want:
            return f"{scope}: {got_ids} != {want}; got {[(e, s) for e, s in top]} want {[(i, expect[scope][i]) for i in want]}"
        for (_entry, score), item in zip(top, want, strict=True):
            if not close(score, expect[scope][item][5]):
                return f"{scope}/{item}: score {score} != {expect[scope][item][5]}"
    return True


@pytest.mark.parametrize("validate", ["process", "thread"])
def test_hot_lists_features_and_recent_clicks_match_brute_force(conn, tmp_path, validate):
    t0 = clock.now_ms() - 300_000
    events = world_events(1, 3000, t0, "a")
    prices = {i.item_id: i.price for i in catalogue()}
    produce(conn, items=catalogue())
    log = tmp_path / "streams.log"
    with service(conn, "streams", log, **SETTINGS, FRESHREC_STREAMS_VALIDATE=validate):
        produce(conn, events)
        wait_for(lambda: matches_brute_force(conn, events, prices), 90, "exact hot lists")
        r = redis_lib.Redis.from_url(conn.redis_url)
        keys = RedisKeys(conn.topic_prefix)
        for user in ("u1", "u7"):
            clicks = [e for e in events if e.user_id == user and e.event_type == "click"]
            recent = [x.decode() for x in r.lrange(keys.user_recent(user), 0, -1)]
            want = [f"{e.item_id}|{e.ts_ms}" for e in reversed(clicks)][:50]
            assert recent == want
        assert r.hlen(keys.item_price) == 30
    assert ("validate stage: process" in log.read_text()) == (validate == "process")


def test_poison_events_go_to_the_dlq_with_reasons_and_duplicates_count_once(conn, tmp_path):
    now = clock.now_ms()
    good = [Event(f"g{j}", "click", "u1", "i1", now - 1000 + j, "north", "pc") for j in range(20)]
    poison = [
        (b"u1", b"{not json", "malformed_json"),
        (
            b"u1",
            b'{"schema_version":1,"event_id":"x","event_type":"hover","user_id":"u1","item_id":"i1","ts_ms":%d}'
            % now,
            "unknown_event_type",
        ),
        (
            b"u1",
            b'{"schema_version":1,"event_id":"x","event_type":"click","user_id":"u1","ts_ms":%d}'
            % now,
            "missing_field",
        ),
        (
            b"u1",
            b'{"schema_version":1,"event_id":"x","event_type":"click","user_id":"u1","item_id":"i1","ts_ms":%d,"value":NaN}'
            % now,
            "non_finite_number",
        ),
        (
            b"u1",
            b'{"schema_version":1,"event_id":"x","event_type":"click","user_id":"","item_id":"i1","ts_ms":%d}'
            % now,
            "empty_id",
        ),
        (
            b"u1",
            b'{"schema_version":1,"event_id":"x","event_type":"click","user_id":"u1","item_id":"i1","ts_ms":5}',
            "timestamp_too_old",
        ),
        (
            b"u1",
            b'{"schema_version":1,"event_id":"x","event_type":"click","user_id":"u1","item_id":"i1","ts_ms":%d}'
            % (now + 86_400_000),
            "timestamp_in_future",
        ),
    ]
    with service(conn, "streams", tmp_path / "streams.log", **SETTINGS):
        produce(conn, good[:10], raw=[(k, v) for k, v, _ in poison])
        produce(conn, good[10:] + good[:5])  # five replays of the same event ids
        r = redis_lib.Redis.from_url(conn.redis_url)
        keys = RedisKeys(conn.topic_prefix)
        wait_for(
            lambda: (
                item_feature(r, keys, "clicks", "i1") is not None
                and abs(float(item_feature(r, keys, "clicks", "i1")) - 20) < 1e-3
            ),
            60,
            "20 clicks on i1",
        )
        letters = dead_letters(conn, TopicNames(conn.topic_prefix).events_dlq, len(poison))
        assert [d.reason for d in letters] == [reason for _, _, reason in poison]
        assert [base64.b64decode(d.value_b64) for d in letters] == [v for _, v, _ in poison]
        assert all(d.source_topic == TopicNames(conn.topic_prefix).events for d in letters)
        time.sleep(0.5)  # give a wrong double count the chance to show
        assert float(item_feature(r, keys, "clicks", "i1")) == pytest.approx(20, abs=1e-3)


def test_sigkill_and_restart_continue_the_counts_without_double_counting(any_conn, tmp_path):
    conn = any_conn
    t0 = clock.now_ms() - 300_000
    first, second = world_events(3, 2000, t0, "c"), world_events(4, 2000, t0 + 130_000, "d")
    prices = {i.item_id: i.price for i in catalogue()}
    produce(conn, items=catalogue())
    with service(conn, "streams", tmp_path / "s1.log", **SETTINGS) as proc:
        produce(conn, first)
        wait_for(lambda: matches_brute_force(conn, first, prices), 90, "first half counted")
        wait_for(lambda: matches_covisit(conn, first), 30, "first half's neighbour lists")
        wait_for(lambda: matches_sequel(conn, first), 30, "first half's successor lists")
        stop(proc, signal.SIGKILL)
    produce(conn, second)
    with service(conn, "streams", tmp_path / "s2.log", **SETTINGS):
        wait_for(
            lambda: matches_brute_force(conn, first + second, prices),
            90,
            "both halves counted once",
        )
        # co-visitation counts and sequential rules too: each click's pairs once, whatever was
        # replayed, and the second half's clicks follow the first's from sequences seeded
        # from the users' recent clicks
        wait_for(lambda: matches_covisit(conn, first + second), 30, "neighbour lists, once")
        wait_for(lambda: matches_sequel(conn, first + second), 30, "successor lists, once")
    assert "restored" in (tmp_path / "s2.log").read_text()
    meta = connect(conn.redis_url).hgetall(RedisKeys(conn.topic_prefix).streams_meta(0))
    assert json.loads(meta[b"applied"])


def _validate_pid(log_path) -> int:
    text = log_path.read_text()
    marker = "validate stage: process "
    assert marker in text, text[-2000:]
    return int(text.rsplit(marker, 1)[1].split()[0])


def _gone(pid: int) -> bool:
    """Exited (a zombie counts: its parent is dead and nothing may reap it here)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_validate_process_reports_through_the_parent_and_dies_with_it(conn, tmp_path):
    """The validate stage runs in a child process: its counters appear on the parent's
    /metrics; a SIGKILLed parent takes it down (else it would stay in the consumer group);
    a dead child takes the parent down with a non-zero exit (as a failed stage thread did)."""
    from freshrec.app.stack import free_port
    from freshrec.promtext import scrape, total

    t0 = clock.now_ms() - 300_000
    events = world_events(5, 500, t0, "v")
    produce(conn, items=catalogue())
    port = free_port()
    settings = {**SETTINGS, "FRESHREC_METRICS_PORT": str(port)}
    url = f"http://127.0.0.1:{port}/metrics"

    def counted_by_both():
        try:
            text = scrape(url)
        except OSError as exc:
            return str(exc)
        valid = total(text, "freshrec_streams_events_total", outcome="valid")
        counted = total(text, "freshrec_streams_counted_events_total")
        return (valid == counted == len(events)) or f"valid {valid}, counted {counted}"

    with service(conn, "streams", tmp_path / "p1.log", **settings) as proc:
        produce(conn, events)
        wait_for(counted_by_both, 90, "the child's and the parent's counters on one endpoint")
        only = scrape(url + "?name[]=freshrec_streams_events_total")
        assert total(only, "freshrec_streams_events_total", outcome="valid") == len(events)
        assert "freshrec_streams_counted_events_total" not in only
        child = _validate_pid(tmp_path / "p1.log")
        assert not _gone(child)
        stop(proc, signal.SIGKILL)
        wait_for(
            lambda: _gone(child) or f"validate process {child} still running",
            10,
            "the validate process to follow its parent",
        )

    with service(conn, "streams", tmp_path / "p2.log", **SETTINGS) as proc:
        wait_for(
            lambda: "validate stage: process" in (tmp_path / "p2.log").read_text(),
            60,
            "the second instance's validate process",
        )
        os.kill(_validate_pid(tmp_path / "p2.log"), signal.SIGKILL)
        assert proc.wait(30) == 1
    assert "the validate process exited with code -9" in (tmp_path / "p2.log").read_text()


def test_pipelined_writes_land_in_order_and_an_error_reply_raises_on_drain(redis_client):
    """``freshcore.resp.Pipelined`` (the validate stage's recent clicks) against the real
    server: a send does not wait for its replies, a later send reads those that arrived, a
    drain reads them all, and an error reply raises without losing the writes around it."""
    from freshcore.resp import Pipelined, pack

    key = f"pipelined:{time.time_ns()}"
    writer = Pipelined(redis_client)
    writer.send(pack(b"RPUSH", key.encode(), b"a") + pack(b"RPUSH", key.encode(), b"b"), 2)
    assert writer.pending == 2
    wait_for(lambda: writer.conn.can_read(timeout=0), 10, "the two replies")
    writer.send(pack(b"RPUSH", key.encode(), b"c"), 1)  # reads them, not waiting for its own
    assert writer.pending == 1
    writer.drain()
    assert writer.pending == 0
    assert redis_client.lrange(key, 0, -1) == [b"a", b"b", b"c"]
    # an error reply (a list command on a string key) between two good writes
    redis_client.set(key + ":s", "x")
    writer.send(
        pack(b"RPUSH", key.encode(), b"d")
        + pack(b"LPUSH", (key + ":s").encode(), b"y")
        + pack(b"RPUSH", key.encode(), b"e"),
        3,
    )
    with pytest.raises(redis_lib.ResponseError, match="WRONGTYPE"):
        writer.drain()
    assert writer.pending == 0
    writer.send(pack(b"RPUSH", key.encode(), b"f"), 1)
    writer.close()
    assert redis_client.lrange(key, 0, -1) == [b"a", b"b", b"c", b"d", b"e", b"f"]
    redis_client.delete(key, key + ":s")


def test_pipelined_sends_do_not_wait_for_a_busy_redis(conn):
    """With the server frozen (SIGSTOP: what a long transaction of another client looks like
    to this one) sends return at once and the replies wait; a drain after it resumes reads
    them all and every write is there."""
    from freshcore.resp import Pipelined, pack

    with private_redis(conn) as (pconn, rproc):
        client = redis_lib.Redis.from_url(pconn.redis_url)
        writer = Pipelined(client)
        writer.send(pack(b"PING"), 1)
        writer.drain()  # connected
        os.kill(rproc.pid, signal.SIGSTOP)
        try:
            sender = threading.Thread(
                target=lambda: [
                    writer.send(pack(b"RPUSH", b"frozen", b"%d" % j), 1) for j in range(50)
                ]
            )
            sender.start()
            sender.join(10)  # sends that waited for replies would wait for SIGCONT
            assert not sender.is_alive(), "the sends waited for the frozen server"
            assert writer.pending == 50
        finally:
            os.kill(rproc.pid, signal.SIGCONT)
        writer.drain()
        assert client.llen(b"frozen") == 50
        writer.close()


def test_a_tombstone_on_items_deletes_the_item_and_one_without_a_key_is_a_dead_letter(conn):
    """A keyless record is refused by a broker that compacts ``items`` (Apache Kafka: the
    whole batch it is in, ``INVALID_RECORD``), so it is produced on its own; where a broker
    takes it (Tansu ignores compaction), the catalogue stage makes it a dead letter."""
    import queue
    import threading

    from confluent_kafka import KafkaError, Producer

    from freshcore.kafka import producer_config
    from schemas.codec import encode_item
    from streams.catalogue import CatalogueStage
    from streams.settings import StreamsSettings

    names, keys = TopicNames(conn.topic_prefix), RedisKeys(conn.topic_prefix)
    r = redis_lib.Redis.from_url(conn.redis_url)
    now = clock.now_ms()
    produce(conn, items=[Item(f"i{j}", "c1", 10.0 + j, now) for j in range(4)])  # all new
    p = Producer(producer_config(conn))
    p.produce(names.items, key=b"i1", value=None)  # deleted
    p.produce(names.items, key=b"i2", value=None)  # deleted, then set again: the last decides
    p.produce(names.items, key=b"i2", value=encode_item(Item("i2", "c2", 99.0, now)))
    p.produce(names.items, key=b"i9", value=None)  # never set: nothing to delete, no error
    assert p.flush(15) == 0
    keyless: list = []
    p.produce(names.items, value=None, on_delivery=lambda err, msg: keyless.append(err))
    assert p.flush(15) == 0  # no key: no item to delete
    refused = keyless[0] is not None
    assert not refused or keyless[0].code() == KafkaError.INVALID_RECORD, keyless
    stage = CatalogueStage(StreamsSettings(conn), queue.SimpleQueue())
    stop = threading.Event()
    t = threading.Thread(target=stage.run, args=(stop,), daemon=True)
    t.start()
    try:
        wait_for(
            lambda: r.hget(keys.item_category, "i2") == b"c2" and r.hlen(keys.item_category) == 3,
            60,
            "the catalogue after the tombstones",
        )
        for key in (keys.item_price, keys.item_category, keys.item_created_ms):
            assert sorted(x.decode() for x in r.hkeys(key)) == ["i0", "i2", "i3"]
        assert r.zscore(keys.new_items, "i1") is None and r.zscore(keys.new_items, "i0")
        assert float(r.hget(keys.item_price, "i2")) == 99.0
        assert int(r.get(keys.catalogue_version)) >= 1  # what tells the workers to reload
        if not refused:
            letters = dead_letters(conn, names.events_dlq, 1)
            assert [(d.reason, d.source_topic) for d in letters] == [("empty_id", names.items)]
    finally:
        stop.set()
        t.join(15)


async def test_a_command_that_fails_inside_exec_fails_the_persist_instead_of_passing(any_conn):
    """Redis runs the rest of a transaction when one command in it fails (a key of the wrong
    type here; OOM at maxmemory alike) and reports it inside EXEC's reply: the sink raises a
    retriable error, so the batch is not acknowledged as persisted, and the same snapshot
    goes through once the key is writable: the failed write gave back all it took (the
    touched rows were once taken for good, and a retry wrote the offsets without them)."""
    from freshcore.redisconn import TransactionFailed
    from streams.item_state import ItemPartitionState, StateConfig
    from streams.sink import StreamsSink

    keys = RedisKeys(any_conn.topic_prefix)
    client = await connect_async(any_conn.redis_url)
    try:
        state = ItemPartitionState(StateConfig())
        state.apply([(0, 5, "i1", 1, 3_600_000, "north", 0.0)])
        await client.set(keys.streams_rows(0), "not a hash")  # HSET on it fails in EXEC
        sink = StreamsSink(client, keys)
        with pytest.raises(TransactionFailed, match="WRONGTYPE") as info:
            await sink.persist([(0, state)])
        assert info.value.retriable
        await client.delete(keys.streams_rows(0))
        await sink.persist([(0, state)])  # the retry, as until_redis_answers makes it
        again = await sink.restore(0, StateConfig())
        assert again.applied == {0: 5} and again.n_items == 1
        assert again.snapshot_rows([0]) == state.snapshot_rows([0])
    finally:
        await client.aclose()


async def test_a_snapshot_redis_acknowledged_and_lost_is_written_whole_again(any_conn):
    """A failover can lose a write its master acknowledged (replication is asynchronous):
    Redis goes back to the snapshot before it, and the next flush would write only the rows
    touched since — with newer offsets, so a restore would miss the lost flush's counts. The
    flush reads the offsets back inside its transaction, finds them behind, and the
    partition is written whole: a restore then equals the live state. Simulated here by
    putting the keys back as they were (DUMP/RESTORE) after a flush."""
    from streams.item_state import CLICK, ItemPartitionState, StateConfig
    from streams.sink import StreamsSink

    keys = RedisKeys(any_conn.topic_prefix)
    client = await connect_async(any_conn.redis_url)
    partition_keys = [
        keys.streams_meta(0),
        keys.streams_rows(0),
        keys.streams_covisit(0),
        keys.streams_sequel(0),
    ]
    t0 = 1_767_225_600_000
    try:
        sink = StreamsSink(client, keys)
        state = ItemPartitionState(StateConfig())
        state.apply([(0, 1, "a", CLICK, t0, None, 0), (0, 2, "b", CLICK, t0, None, 0)])
        state.apply_pairs(["a", "a"], ["b", "b"], [0, 0], [2, 2], [t0, t0], None, [0, 1])
        assert await sink.persist([(0, state)]) == []
        before = {k: await client.dump(k) for k in partition_keys}
        state.apply([(0, 3, "a", CLICK, t0 + 1000, None, 0)])  # flush 2: "a" only
        state.apply_pairs(["a", "b"], ["c", "c"], [0, 0], [3, 3], [t0 + 1000] * 2, None, [0, 1])
        assert await sink.persist([(0, state)]) == []
        for k, blob in before.items():  # the failover: flush 2 is gone
            await client.restore(k, 0, blob, replace=True)
        state.apply([(0, 4, "b", CLICK, t0 + 2000, None, 0)])  # flush 3: "b" only
        lost = await sink.persist([(0, state)])
        assert lost == [0]
        assert len(state.touched) == state.n_items  # the whole partition is due
        stale = await sink.restore(0, StateConfig())
        assert stale.snapshot_rows([stale.slots["a"]]) != state.snapshot_rows([state.slots["a"]])
        assert await sink.persist([(0, state)]) == []  # what the app does before acking
        back = await sink.restore(0, StateConfig())
        assert back.applied == state.applied == {0: 4}
        assert back.covisit_applied == state.covisit_applied
        assert back.snapshot_rows(list(range(back.n_items))) == state.snapshot_rows(
            list(range(state.n_items))
        )
        assert back.covisit.counts == state.covisit.counts
        assert back.sequel.counts == state.sequel.counts and set(back.sequel.counts) == {"a", "b"}
    finally:
        await client.aclose()


async def test_an_evicted_item_leaves_redis_with_the_flush_that_evicts_it(any_conn):
    """Eviction is persisted like counting: the item's state row, serving features,
    co-visitation and successor lists leave in the flush's transaction, and a restored
    partition holds exactly the items the live one does."""
    from streams.decay import HOUR_MS
    from streams.item_state import CLICK, ItemPartitionState, StateConfig
    from streams.sink import StreamsSink

    keys = RedisKeys(any_conn.topic_prefix)
    client = await connect_async(any_conn.redis_url)
    config = StateConfig(evict_below=0.01)
    t0 = 1_767_225_600_000
    try:
        sink = StreamsSink(client, keys)
        state = ItemPartitionState(config)
        state.apply([(0, 1, "old", CLICK, t0, None, 0), (0, 2, "busy", CLICK, t0, None, 0)])
        state.apply_pairs(["old"] * 2, ["busy"] * 2, [0] * 2, [2] * 2, [t0] * 2, None, [0, 1])
        await sink.persist([(0, state)])
        anchors = state.covisit.take_published()
        await sink.write(
            sink.feature_commands(0, state, state.take_features_due())
            + sink.covisit_commands(0, state, anchors, 10)[0]
            + sink.sequel_commands(0, state, state.sequel.take_published(), 10)[0]
        )
        assert await client.hexists(keys.item_feature("clicks", 0), "old")
        assert await client.hexists(keys.covisit(0), "old")
        assert await client.hexists(keys.sequel(0), "old")
        state.apply([(0, 3, "busy", CLICK, t0 + 100 * HOUR_MS, None, 0)])
        await sink.persist([(0, state)])
        assert state.item_ids == ["busy"]
        for key in (
            keys.streams_rows(0), keys.streams_covisit(0), keys.covisit(0),
            keys.streams_sequel(0), keys.sequel(0),
            keys.item_feature("clicks", 0), keys.item_feature("hot", 0),
            keys.item_features_as_of(0),
        ):  # fmt: skip
            assert not await client.hexists(key, "old"), key
        back = await sink.restore(0, config)
        assert back.item_ids == ["busy"] and back.applied == {0: 3}
        assert back.snapshot_rows([0]) == state.snapshot_rows([0])
    finally:
        await client.aclose()


def test_a_users_recent_clicks_expire_after_the_row_ttl(any_conn):
    """user:recent:* lists left Redis never: one per user ever seen. They expire like the
    user's row (FRESHREC_ROW_TTL_S after the last click)."""
    from freshcore.redisconn import run_packed
    from streams.validate import pack_recent

    keys = RedisKeys(any_conn.topic_prefix)
    r = connect(any_conn.redis_url)
    try:
        run_packed(r, pack_recent(keys, [("u1", "i1", 5), ("u1", "i2", 6)], keep=10, ttl_s=3600))
        assert r.lrange(keys.user_recent("u1"), 0, -1) == [b"i2|6", b"i1|5"]
        assert 3500 < r.ttl(keys.user_recent("u1")) <= 3600
    finally:
        r.close()


def test_a_validate_batch_that_fails_half_way_commits_nothing_past_the_last_whole_one(conn):
    """The second batch raises inside ``process``: the stage ends, and what its group has
    committed — its periodic commits and the commit of the revoke while it closes — is the
    first batch's end, never the consumer's position past the failed one, which the next run
    reads again."""
    from confluent_kafka import Consumer, Producer, TopicPartition

    from freshcore.kafka import consumer_config, partition_count, producer_config
    from streams.settings import StreamsSettings
    from streams.validate import ValidateStage

    events = world_events(3, 600, clock.now_ms() - 60_000, "half")
    produce(conn, events)
    names = TopicNames(conn.topic_prefix)
    client = Producer(producer_config(conn))
    counts = {t: partition_count(client, t) for t in (names.events, names.events_by_item)}
    stage = ValidateStage(StreamsSettings(conn=conn, batch_max=100), counts[names.events_by_item])
    whole: dict[int, int] = {}
    calls = [0]
    process = stage.process

    def failing(msgs) -> None:
        calls[0] += 1
        if calls[0] == 2:
            process(msgs[: len(msgs) // 2])  # half of it written, then the failure
            raise RuntimeError("injected failure half-way through a batch")
        process(msgs)
        for msg in msgs:
            whole[msg.partition()] = max(whole.get(msg.partition(), 0), msg.offset() + 1)

    stage.process = failing
    with pytest.raises(RuntimeError, match="injected"):
        stage.run(threading.Event())
    assert calls[0] == 2 and whole
    group = consumer_config(conn, f"{conn.topic_prefix}freshrec-streams-validate")
    reader = Consumer(group)
    try:
        parts = [TopicPartition(names.events, p) for p in range(counts[names.events])]
        committed = {tp.partition: tp.offset for tp in reader.committed(parts, timeout=10)}
    finally:
        reader.close()
    for p, offset in committed.items():
        assert offset <= whole.get(p, 0) or (offset < 0 and p not in whole), (p, offset, whole)
    assert sum(max(o, 0) for o in committed.values()) < len(events)
