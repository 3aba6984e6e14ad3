"""What Redis holds at the end of a fault drill, checked against the topics
(``tools/drill_faults.py``): the streams app's stored counts against the events it counted,
and the parameter server's tables against those of a second parameter server run from
scratch over a copy of the ``gradients`` topic (same rows, same versions: every message
applied exactly once)."""

from __future__ import annotations

import time

import numpy as np
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from freshcore.kafka import admin_config, consumer_config, producer_config
from freshcore.redisconn import connect
from freshcore.rediskeys import RedisKeys
from freshcore.topics import TopicNames, catalogue_with, ensure_topics
from freshrec.app.stack import free_port
from freshrec.sim.world import World
from param_server.store import applied_offsets
from schemas.rowbatch import TABLE_NAMES
from schemas.rows import decode_row
from streams.item_state import ItemPartitionState
from streams.settings import StreamsSettings
from tools.benchlib import partition_ends, service_process, wait_until
from tools.pipeline import DIM, PARTITIONS, WORLD, Pipeline
from tools.seed import seed_world

REFERENCE = "ref."
"""The topic prefix (and Redis key prefix) of the reference parameter server."""


def redis_check(pipe: Pipeline, workers: list[str]) -> dict:
    """What Redis holds, against what the topics say it should (the module's docstring)."""
    keys = RedisKeys("")
    r = connect(pipe.conn.redis_url)
    names = TopicNames("")
    admin = AdminClient(admin_config(pipe.conn))
    n_by_item = len(
        admin.list_topics(names.events_by_item, 10).topics[names.events_by_item].partitions
    )
    stored = 0.0
    config = StreamsSettings.from_env(pipe.env).state
    for q in range(n_by_item):
        meta = {k.decode(): v.decode() for k, v in r.hgetall(keys.streams_meta(q)).items()}
        rows = {k.decode(): v for k, v in r.hgetall(keys.streams_rows(q)).items()}
        state = ItemPartitionState.restore(config, meta, rows)
        stored += float(state.counts[: state.n_items, 0, :].sum())
    counted = pipe.metric("streams", "freshrec_streams_counted_events_total")
    got = stored_tables(r, keys)
    want = reference_tables(pipe)
    same_rows = set(got) == set(want)
    versions_differ = sum(1 for k in want if k in got and got[k][1] != want[k][1])
    rows_differ = sum(
        1 for k in want if k in got and not np.allclose(got[k][0], want[k][0], atol=1e-6)
    )
    return {
        "streams_counts_in_redis": round(stored, 3),
        "streams_counted": int(counted),
        "streams_rewrites": pipe.metric("streams", "freshrec_streams_state_rewrites_total"),
        "ps_rows": len(got),
        "ps_rows_as_reference": same_rows and versions_differ == 0 and rows_differ == 0,
        "ps_rows_missing_or_extra": len(set(got) ^ set(want)),
        "ps_versions_differ": versions_differ,
        "ps_values_differ": rows_differ,
        "ps_rewrites": pipe.metric("param-server", "freshrec_ps_partition_rewrites_total"),
    }


def stored_tables(r, keys: RedisKeys) -> dict[tuple[str, bytes], tuple[np.ndarray, int]]:
    """Every embedding row the parameter server wrote: (table, field) -> (row, version)."""
    out = {}
    for name in TABLE_NAMES.values():
        for shard in range(PARTITIONS):
            for k, v in r.hgetall(keys.embeddings(name, shard)).items():
                row, version, _ = decode_row(v, DIM + 1)
                out[(name, k)] = (row, version)
    return out


def reference_tables(pipe: Pipeline) -> dict:
    """The tables of a parameter server run from scratch over a copy of ``gradients``, seeded
    as the drill's were, under another topic prefix on the same Redis."""
    names, ref = TopicNames(""), TopicNames(REFERENCE)
    conn = pipe.conn.with_prefix(REFERENCE)
    ensure_topics(
        AdminClient(admin_config(conn)), REFERENCE, catalogue_with({"gradients": PARTITIONS})
    )
    seed_world(conn.redis_url, REFERENCE, World(WORLD), pipe.models, PARTITIONS)
    source = Consumer(consumer_config(pipe.conn, None))
    ends = partition_ends(pipe.conn, names.gradients)
    source.assign([TopicPartition(names.gradients, q, OFFSET_BEGINNING) for q in ends])
    sink = Producer(producer_config(conn))
    copied = {q: 0 for q in ends}
    deadline = time.monotonic() + 120
    while any(copied[q] < ends[q] for q in ends) and time.monotonic() < deadline:
        for msg in source.consume(10_000, 0.5):
            if msg.error() is None:
                sink.produce(ref.gradients, msg.value(), msg.key(), partition=msg.partition())
                copied[msg.partition()] = msg.offset() + 1
                sink.poll(0)
    source.close()
    sink.flush(60)
    keys = RedisKeys(REFERENCE)
    r = connect(conn.redis_url)
    port = free_port()
    with service_process(conn, "param-server", port, pipe.env, pipe.workdir / "ps-ref.log"):
        wait_until(
            lambda: (
                applied_offsets(r, keys, list(ends)) == {q: e - 1 for q, e in ends.items() if e}
            ),
            120,
            "the reference parameter server",
        )
    return stored_tables(r, keys)
