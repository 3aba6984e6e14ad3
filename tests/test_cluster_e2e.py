"""FreshRec on a Redis Cluster of the embedded server binary: the stack forms and stops it,
packed reads and writes follow a slot that moves under them (``ASK`` while it migrates,
``MOVED`` after), and two of each service serve and learn on it under load. The parameter server's
and the streams app's exactly-once and takeover tests run on the cluster too (``any_conn``
in test_learning_e2e.py and test_streams_e2e.py)."""

from __future__ import annotations

import contextlib
import uuid

import numpy as np
import pytest
import redis as redis_lib
from confluent_kafka import OFFSET_BEGINNING
from redis.crc import key_slot

from freshcore import clock
from freshcore.kafka import admin_config, consumer_config, producer_config
from freshcore.partitioner import row_partitions
from freshcore.redisconn import Packed, connect, is_cluster, run_packed
from freshcore.rediskeys import RedisKeys
from freshcore.resp import pack
from freshcore.rowstore import fetch_rows, row_shards
from freshcore.topics import TopicNames, catalogue_with, ensure_topics
from freshrec.app.stack import EmbeddedStack, StackError, pid_alive
from param_server.store import (
    applied_offsets,
    claim_partitions,
    pack_persist,
    persist_fenced,
)
from schemas.rows import TABLE_USER, decode_row

from .conftest import TEST_PARTITIONS
from .serving_harness import DIM, client_for, seed_redis
from .streams_harness import produce, service, stop, wait_for

W = 5


def test_stack_up_forms_a_cluster_status_lists_it_and_down_stops_every_node(tmp_path):
    stack = EmbeddedStack(tmp_path / "stack")
    state = stack.up(detach=False, redis_cluster=2)
    try:
        assert state.cluster and len(state.processes) == 3
        assert state.env["REDIS_URL"] == f"redis+cluster://127.0.0.1:{state.redis.port}"
        for node in (state.redis, *state.redis_nodes):
            info = redis_lib.Redis(port=node.port).execute_command("CLUSTER", "INFO").decode()
            assert "cluster_state:ok" in info and "cluster_known_nodes:2" in info
        assert "redis1" in stack.status()
        assert stack.up(redis_cluster=2) == state  # running: the same stack
        with pytest.raises(StackError, match="2-master Redis Cluster, not a single Redis"):
            stack.up()
        r = connect(state.env["REDIS_URL"])
        assert is_cluster(r) and r.ping()
    finally:
        stopped = stack.down()
    assert len(stopped) == 3
    assert not any(pid_alive(p.pid) for p in state.processes)


def test_a_plain_url_of_a_cluster_node_is_detected_and_a_one_master_cluster_refused(
    cluster_services, tmp_path
):
    plain = cluster_services.redis_url.replace("redis+cluster://", "redis://") + "/0"
    assert is_cluster(connect(plain))
    with pytest.raises(StackError, match="2 to 64"):
        EmbeddedStack(tmp_path).up(redis_cluster=1)


def _node_of(r, slot: int):
    return r.nodes_manager.get_node_from_slot(slot)


def _node_id(node) -> str:
    return (
        redis_lib.Redis(host=node.host, port=node.port).execute_command("CLUSTER", "MYID").decode()
    )


def test_packed_reads_and_writes_follow_a_slot_that_moves_under_them(
    cluster_services, prefix, caplog
):
    """Rows of one gradients partition are written and read through a client whose slot map
    goes stale: while the slot migrates (its keys already moved) the source answers ``ASK``,
    and after the move ``MOVED``; both are followed, nothing is lost or written twice."""
    r = connect(cluster_services.redis_url)
    keys = RedisKeys(prefix)
    shards = row_shards(r, keys, 4)
    ids = np.arange(40, dtype=np.int64)
    rows = np.arange(40 * W, dtype=np.float32).reshape(40, W)

    part = row_partitions(ids, shards)
    p = int(part[0])
    mine = ids[part == p]
    table = {
        p: {
            TABLE_USER: (
                mine,
                rows[part == p],
                rows[part == p],
                np.ones(len(mine), np.uint64),
                np.ones(len(mine), np.int64),
            )
        }
    }
    owners = {p: "owner-1"}
    claim_partitions(r, keys, owners)
    assert persist_fenced(r, keys, pack_persist(keys, table, {p: 10}), owners)

    slot = key_slot(keys.ps_owner(p).encode())
    source = _node_of(r, slot)
    target = next(n for n in r.get_primaries() if n.name != source.name)
    src = redis_lib.Redis(host=source.host, port=source.port)
    dst = redis_lib.Redis(host=target.host, port=target.port)
    src_id, dst_id = _node_id(source), _node_id(target)
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    moving = src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
    assert len(moving) >= 4  # emb, opt, applied, owner of partition p
    src.execute_command("MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", *moving)

    # migrating: the keys are on the target, the source answers ASK to this stale client
    caplog.set_level("INFO", logger="freshrec.redis")
    found, got, _, _ = fetch_rows(r, keys, TABLE_USER, mine.tolist(), W, shards)
    assert found.all() and np.array_equal(got, rows[part == p])
    ((reply,),) = run_packed(
        r, [Packed(keys.ps_applied(p).encode(), pack(b"GET", keys.ps_applied(p).encode()), 1)]
    )
    assert reply == b"10"
    assert "AskError" in caplog.text and "asking the importing node" in caplog.text
    caplog.clear()

    for node in r.get_primaries():
        redis_lib.Redis(host=node.host, port=node.port).execute_command(
            "CLUSTER", "SETSLOT", slot, "NODE", dst_id
        )
    # moved: the client's map still names the source, which answers MOVED
    table[p][TABLE_USER][1][:] += 1
    assert persist_fenced(r, keys, pack_persist(keys, table, {p: 11}), owners)
    assert applied_offsets(r, keys, [p]) == {p: 11}
    found, got, _, _ = fetch_rows(r, keys, TABLE_USER, mine.tolist(), W, shards)
    assert found.all() and np.array_equal(got, rows[part == p] + 1)
    assert "MovedError" in caplog.text
    assert src.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    assert dst.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == len(moving)


def _all_tables(conn, shards: int) -> dict[tuple[int, bytes], tuple[np.ndarray, int]]:
    r = connect(conn.redis_url)
    keys = RedisKeys(conn.topic_prefix)
    out = {}
    for name in ("user", "item"):
        for shard in range(shards):
            for k, v in r.hgetall(keys.embeddings(name, shard)).items():
                row, version, _ = decode_row(v, DIM + 1)
                out[(name, k)] = (row, version)
    return out


def _applied(conn) -> dict[int, int]:
    r = connect(conn.redis_url)
    return applied_offsets(r, RedisKeys(conn.topic_prefix), list(range(TEST_PARTITIONS)))


@pytest.mark.timeout(600)  # six services, a three-master cluster and the load on two cores
def test_two_workers_parameter_servers_and_streams_apps_under_load_on_a_cluster(
    cluster_conn, model_dir, tmp_path, prefix
):
    """Two of each service on a three-master cluster with steady events and requests: every
    request answered once, every event counted exactly once by the streams apps and learnt
    at least once by the workers, and the parameter servers' tables equal to one
    uninterrupted instance's over the same gradient log (copied to a fresh deployment)."""
    from freshrec.app.stack import free_port
    from freshrec.promtext import scrape_port_now, total

    from .test_streams_e2e import SETTINGS, catalogue, matches_brute_force, merged, world_events

    conn = cluster_conn
    seed_redis(conn, model_dir)
    env = {
        "FRESHREC_EMBEDDING_DIM": str(DIM),
        "FRESHREC_MODEL_DIR": str(model_dir),
        "FRESHREC_FLUSH_INTERVAL_MS": "50",
        # six services on two cores: a 250 ms budget lets the ladder step a reply down to the
        # light tier, and this test is about what the cluster holds, not about latency
        "FRESHREC_REQUEST_BUDGET_MS": "5000",
        **SETTINGS,
    }
    produce(conn, items=catalogue())
    ports = {name: free_port() for name in ("w0", "w1")}
    with contextlib.ExitStack() as stack:
        procs = {}
        for name, command in [
            ("s0", "streams"),
            ("s1", "streams"),
            ("p0", "param-server"),
            ("p1", "param-server"),
            ("w0", "worker"),
            ("w1", "worker"),
        ]:
            extra = {"FRESHREC_METRICS_PORT": str(ports[name])} if name in ports else {}
            procs[name] = stack.enter_context(
                service(conn, command, tmp_path / f"{name}.log", **env, **extra)
            )

        def assigned(name: str, marker: str) -> bool:
            text = (tmp_path / f"{name}.log").read_text()
            return marker in text and f"{marker} []" not in text.rsplit(marker, 1)[-1][:3]

        for a, b, marker in [
            ("s0", "s1", "assigned events.by_item partitions"),
            ("p0", "p1", "assigned gradients partitions"),
        ]:
            wait_for(
                lambda a=a, b=b, marker=marker: assigned(a, marker) and assigned(b, marker),
                90,
                f"{a}, {b} to share partitions",
            )

        def learnt() -> float:
            got = [scrape_port_now(p) for p in ports.values()]
            return sum(total(g, "freshrec_worker_events_total", outcome="valid") for g in got if g)

        t0 = clock.now_ms() - 300_000
        events = world_events(7, 3000, t0, "load")
        prices = {i.item_id: i.price for i in catalogue()}
        with client_for(conn) as client:
            replies = []
            for n in range(10):  # steady: a tenth of the events, then requests, ten times
                produce(conn, events[n * 300 : (n + 1) * 300])
                users = [f"u{n * 10 + j}" for j in range(10)]
                replies += client._call(_ask_all(client.client, users), 90)
            assert len(replies) == 100 and all(r.items for r in replies)
            # ranked by the full model; the users with trained rows got them from the cluster
            assert all(r.tier == "full" for r in replies)
            assert sum((r.user_embedding_version or 0) >= 1 for r in replies) >= 10
            assert len({r.request_id for r in replies}) == 100
            wait_for(lambda: learnt() >= len(events), 90, "both workers to learn every event")
            # two instances' lists, one per by-item partition, merge into the exact top-k
            wait_for(lambda: matches_brute_force(conn, events, prices), 90, "exact counts")
            lists, _ = merged(conn, "global")
            assert len({h.partition for h in lists}) > 1
            assert client.stats.duplicate == 0 and client.stats.unknown == 0
        served = {
            n: total(scrape_port_now(p) or {}, "freshrec_requests_total", outcome="served")
            for n, p in ports.items()
        }
        assert sum(served.values()) == 100 and all(served.values()), served
        for name in ("w0", "w1"):  # workers stop first: every gradient is produced
            stop(procs[name])
        log = _GradientLog(conn)
        wait_for(lambda: log.complete(_applied(conn)), 90, "the gradient log applied")

    # the same log, in the same partitions, for one uninterrupted parameter server
    replay = cluster_conn.with_prefix(f"re{prefix}")
    from confluent_kafka.admin import AdminClient

    ensure_topics(
        AdminClient(admin_config(replay)),
        replay.topic_prefix,
        catalogue_with({n: TEST_PARTITIONS for n in ("events", "recommend.requests", "gradients")}),
    )
    seed_redis(replay, model_dir)  # the same starting rows
    log.copy_to(replay)
    with service(replay, "param-server", tmp_path / "replay.log", **env):
        wait_for(lambda: _applied(replay) == _applied(conn), 90, "the replay applied")
    got, want = _all_tables(conn, TEST_PARTITIONS), _all_tables(replay, TEST_PARTITIONS)
    assert got.keys() == want.keys() and len(got) > 100
    for k, (row, version) in want.items():
        np.testing.assert_allclose(got[k][0], row, rtol=1e-6, atol=1e-7)
        assert got[k][1] == version


async def _ask_all(client, users: list[str]) -> list:
    """The users' requests in flight together (two workers answer them)."""
    import asyncio

    return list(await asyncio.gather(*(client.send(_request(u), 60) for u in users)))


def _request(user: str):
    from schemas.records import RecommendRequest

    return RecommendRequest(request_id=f"load-{uuid.uuid4().hex}", user_id=user, k=5)


class _GradientLog:
    """Every message of a deployment's ``gradients`` topic, per partition in offset order."""

    def __init__(self, conn) -> None:
        from confluent_kafka import Consumer, TopicPartition

        self.topic = TopicNames(conn.topic_prefix).gradients
        self.consumer = Consumer(consumer_config(conn, None))
        self.consumer.assign(
            [TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in range(TEST_PARTITIONS)]
        )
        self.messages: dict[int, list[bytes]] = {p: [] for p in range(TEST_PARTITIONS)}

    def complete(self, applied: dict[int, int]) -> bool:
        """Read on; True once a poll finds nothing new and each partition's last offset
        read is the one its parameter server applied last."""
        got = self.consumer.consume(1000, 0.5)
        for msg in got:
            if msg.error() is None:
                assert msg.offset() == len(self.messages[msg.partition()])
                self.messages[msg.partition()].append(msg.value())
        if got:
            return False
        return all(applied.get(p, -1) == len(m) - 1 for p, m in self.messages.items())

    def copy_to(self, conn) -> None:
        from confluent_kafka import Producer

        self.consumer.close()
        p = Producer(producer_config(conn))
        topic = TopicNames(conn.topic_prefix).gradients
        for partition, values in self.messages.items():
            for v in values:
                p.produce(topic, v, partition=partition)
        assert p.flush(30) == 0


def test_serving_features_are_read_from_the_hash_of_each_items_partition(any_conn):
    """What the streams app writes per ``events.by_item`` partition, a worker reads back for
    any items at once (the high_end devices' realtime features), on a single server and a
    cluster."""
    from freshcore.partitioner import str_partitions
    from inference.serving.snapshot import read_features

    r = connect(any_conn.redis_url)
    keys = RedisKeys(any_conn.topic_prefix)
    items = [f"i{n}" for n in range(40)]
    part = str_partitions(items, 4).tolist()
    assert len(set(part)) == 4
    for item, p in zip(items, part, strict=True):
        for name, value in (("ctr", 0.1), ("cvr", 0.2), ("hot", 3.0)):
            r.hset(keys.item_feature(name, p), item, value + int(item[1:]))
    got = read_features(r, keys, [*items, "unknown"], 4)
    assert set(got) == set(items)
    assert all(got[i] == [0.1 + int(i[1:]), 0.2 + int(i[1:]), 3.0 + int(i[1:])] for i in items)
    assert read_features(r, keys, items, 0) == {}  # no layout recorded yet: no features
