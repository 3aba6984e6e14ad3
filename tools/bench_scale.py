"""Benchmark of cost against size: how a worker, the parameter server and Redis grow with the
catalogue and the user table.

For each (items, users) point — by default 10k/100k, 100k/1M and 1M/10M — on a Redis of its
own (the embedded stack's, a cluster with ``--redis-cluster N``, or ``REDIS_URL``'s under a
prefix of its own):

- rows: every item's and user's row written to Redis (random, ``dim`` + 1 floats, laid out
  by gradients partition as the parameter server lays them out) and the catalogue;
  **Redis memory per row** is the growth of ``used_memory`` (summed over a cluster's
  masters) over the rows written;
- a worker in this process: **worker memory** is the growth of this process's resident set
  from before the worker is made to after it has loaded the item table and the catalogue
  (and built the IVF index, at and above ``FRESHREC_ANN_MIN_ITEMS``); **vector recall** the
  median time of the vector channel for a batch of 32 users; **request p99** the 99th
  percentile of the worker's own request time (queue to reply) over requests sent through
  Kafka ten at a time;
- a parameter server as its own process: **rows/s** applied and persisted over gradient
  messages for rows drawn from the whole tables (each loaded from Redis first);
- the cache's levels: batches of 32 user ids drawn with Zipf weights (exponent
  ``--zipf``) looked up through a cache with a device slab of a hundredth of the users and
  host RAM for none, a tenth or all of them (``FRESHREC_USER_CACHE_ROWS``,
  ``FRESHREC_HOST_USER_ROWS``), ``--lookups`` batches to warm it and as many measured: the
  **hit rate of each level** (device, host RAM, Redis, new), the **Redis round trips** a
  batch made, and the mean and p99 **lookup time** of a batch.

The ranking models are trained once on a small world: their features are hashed, so they
serve any catalogue. Results go to ``artifacts/bench_scale.json`` and a plot to
``artifacts/bench_scale.png``; a Markdown table is printed.

    python -m tools.bench_scale                      # three points, ~15 min on 2 cores
    python -m tools.bench_scale --points 10000:100000 --requests 100   # one quick point
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from freshcore import clock
from freshcore import metrics as m
from freshcore.kafka import admin_config, gradients_partitions, producer_config
from freshcore.partitioner import row_partitions
from freshcore.redisconn import Packed, connect, is_cluster, run_packed
from freshcore.rediskeys import RedisKeys
from freshcore.resp import pack_fixed
from freshcore.rowstore import row_shards
from freshcore.topics import TopicNames, ensure_topics
from freshrec.app.stack import free_port
from freshrec.app.training import ensure_models
from freshrec.client import RecommendClient
from freshrec.progress import ProgressLine
from freshrec.promtext import scrape_port, total
from freshrec.sim.traffic import catalogue
from freshrec.sim.world import World, WorldConfig
from inference.serving.recall import RecallQuery
from inference.settings import LearningSettings, WorkerSettings
from inference.tables.cache import EmbeddingCache
from inference.training.train import TrainConfig
from inference.worker import Worker
from schemas.ids import row_ids
from schemas.records import RecommendRequest
from schemas.rowbatch import KIND_GRADIENTS, TABLE_NAMES, RowBatch
from schemas.rows import TABLE_ITEM, TABLE_USER, encode_rows_matrix, key_matrix, width
from tools import scale_report
from tools.benchlib import bench_connection, save, service_process, wait_until

DIM = 64
CHUNK = 50_000
DEFAULT_POINTS = "10000:100000,100000:1000000,1000000:10000000"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default=DEFAULT_POINTS, help="items:users,… (default: %(default)s)")
    ap.add_argument("--requests", type=int, default=300, help="requests per point")
    ap.add_argument(
        "--gradient-rows", type=int, default=200_000, help="rows in the parameter server's run"
    )
    ap.add_argument("--redis-cluster", type=int, default=0, metavar="N", help="an N-master cluster")
    ap.add_argument(
        "--lookups", type=int, default=3000, help="user lookup batches per cache configuration"
    )
    ap.add_argument("--zipf", type=float, default=1.0, help="exponent of the users' Zipf weights")
    ap.add_argument("--out", type=Path, default=Path("artifacts"))
    args = ap.parse_args()
    points = [tuple(int(x) for x in p.split(":")) for p in args.points.split(",")]
    for items, users in points:
        if items < 1000 or users < 1000:
            ap.error(f"a point needs at least 1,000 items and users, not {items}:{users}")
    progress = ProgressLine()
    torch.set_num_threads(1)
    results: dict = {"dim": DIM, "redis_cluster": args.redis_cluster, "points": []}
    with tempfile.TemporaryDirectory(prefix="freshrec-scale-models-") as tmp:
        models = Path(tmp)
        small = World(WorldConfig(seed=5, n_users=20_000, n_items=10_000))
        ensure_models(small, models, TrainConfig(impressions=50_000, dim=DIM, rankers=""), progress)
        with bench_connection("sc.", redis_cluster=args.redis_cluster) as base:
            for n, (items, users) in enumerate(points):
                conn = base.with_prefix(f"sc{n}.")
                ensure_topics(AdminClient(admin_config(conn)), conn.topic_prefix)
                point = measure(conn, items, users, models, args, progress)
                results["points"].append(point)
                progress.done(scale_report.line(point))
                drop_keys(conn)
    path = save("bench_scale", results, args.out)
    png = scale_report.plot(results, args.out / "bench_scale.png")
    progress.done(f"results written to {path}, plot to {png}")
    print(scale_report.table(results))


# ------------------------------------------------------------------------------------ point
def measure(conn, items: int, users: int, models: Path, args, progress: ProgressLine) -> dict:
    r = connect(conn.redis_url)
    keys = RedisKeys(conn.topic_prefix)
    shards = row_shards(r, keys, gradients_partitions(conn))
    world = World(WorldConfig(seed=5, n_users=1000, n_items=items))
    point: dict = {"items": items, "users": users}

    before = redis_memory(r)
    t = time.perf_counter()
    item_ids = row_ids([World.item_id(i) for i in range(items)])
    write_rows(r, keys, TABLE_ITEM, item_ids, shards, progress, "item rows")
    user_ids = write_users(r, keys, users, shards, progress)
    point["rows_written_per_s"] = round((items + users) / (time.perf_counter() - t))
    point["redis_bytes_per_row"] = round((redis_memory(r) - before) / (items + users), 1)
    write_catalogue(r, keys, world, progress)

    progress.done(f"{items:,} items / {users:,} users: the worker")
    point.update(worker_figures(conn, models, world, users, args, progress))
    point["param_server_rows_per_s"] = param_server_rate(
        conn, user_ids, item_ids, args.gradient_rows, progress
    )
    r.close()
    return point


def write_rows(r, keys, table: int, ids: np.ndarray, shards: int, progress, what: str) -> None:
    """Random rows for ``ids``, one packed HSET per shard and chunk, as the parameter server
    lays them out."""
    rng = np.random.default_rng(len(ids))
    name = TABLE_NAMES[table]
    for lo in range(0, len(ids), CHUNK):
        chunk = ids[lo : lo + CHUNK]
        rows = (rng.standard_normal((len(chunk), width(DIM))) * 0.1).astype(np.float32)
        blobs = encode_rows_matrix(rows, np.ones(len(chunk), np.uint64), np.ones(len(chunk)))
        part = row_partitions(chunk, shards)
        entries = []
        for s in np.unique(part).tolist():
            at = part == s
            key = keys.embeddings(name, s).encode()
            entries.append(
                Packed(key, pack_fixed(b"HSET", key, key_matrix(chunk[at]), blobs[at]), 1)
            )
        run_packed(r, entries)
        progress.update(f"{what}: {min(lo + CHUNK, len(ids)):,}/{len(ids):,}")


def write_users(r, keys, users: int, shards: int, progress) -> np.ndarray:
    out = []
    for lo in range(0, users, 1_000_000):
        ids = row_ids([World.user_id(u) for u in range(lo, min(lo + 1_000_000, users))])
        write_rows(r, keys, TABLE_USER, ids, shards, progress, f"user rows from {lo:,}")
        out.append(ids)
    return np.concatenate(out)


def write_catalogue(r, keys, world: World, progress) -> None:
    records = list(catalogue(world))
    for lo in range(0, len(records), 100_000):
        part = records[lo : lo + 100_000]
        pipe = r.pipeline(transaction=False)
        pipe.hset(keys.item_category, mapping={i.item_id: i.category for i in part})
        pipe.hset(keys.item_price, mapping={i.item_id: i.price for i in part})
        pipe.hset(keys.item_created_ms, mapping={i.item_id: i.created_at_ms for i in part})
        pipe.execute()
        progress.update(f"catalogue: {lo + len(part):,}/{len(records):,}")
    r.incr(keys.catalogue_version)


def redis_memory(r) -> int:
    if is_cluster(r):
        return sum(
            r.get_redis_connection(n).info("memory")["used_memory"] for n in r.get_primaries()
        )
    return int(r.info("memory")["used_memory"])


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for row in f:
            if row.startswith("VmRSS:"):
                return int(row.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


# ----------------------------------------------------------------------------------- worker
def worker_figures(conn, models: Path, world: World, users: int, args, progress):
    n_requests = args.requests
    gc.collect()
    rss0 = rss_bytes()
    settings = WorkerSettings(
        conn, LearningSettings(dim=DIM), model_dir=models, device="cpu", worker_id="scale"
    )
    w = Worker(settings)
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            w.run(stop)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=loop, daemon=True, name="worker")
    started = time.perf_counter()
    thread.start()
    try:
        rec = wait_until(
            lambda: w.assigned > 0 and w.recommender, 300, "the worker to join", errors
        )
        if rec.state.named_count >= settings.serving.ann_min_items:
            wait_until(lambda: rec.ann is not None, 600, "the IVF index", errors)
        ready_s = time.perf_counter() - started
        gc.collect()
        rss = rss_bytes() - rss0
        rng = np.random.default_rng(3)
        picks = rng.integers(0, users, 32)
        queries = [
            RecallQuery(f"u{u}", np.asarray(w.user_row(World.user_id(int(u)))), None) for u in picks
        ]
        vector = rec.runner.channels["vector"]
        for _ in range(3):
            vector.recall(queries, 200)
        times = []
        for _ in range(20):
            t = time.perf_counter()
            vector.recall(queries, 200)
            times.append((time.perf_counter() - t) * 1000)
        progress.update(f"requests: 0/{n_requests}")
        totals = asyncio.run(_requests(conn, users, n_requests, progress))
        levels = cache_levels(w.cache.fetch, users, args.lookups, args.zipf, progress)
    finally:
        stop.set()
        thread.join(60)
    if errors:
        raise errors[0]
    return {
        "cache_levels": levels,
        "worker_ready_s": round(ready_s, 1),
        "worker_rss_mb": round(rss / 2**20, 1),
        "vector_recall_ms": round(float(np.median(times)), 2),
        "vector_index": "ivf" if rec.ann is not None else "exact",
        "request_p50_ms": round(float(np.percentile(totals, 50)), 1),
        "request_p99_ms": round(float(np.percentile(totals, 99)), 1),
    }


async def _requests(conn, users: int, n: int, progress) -> list[float]:
    """Worker-side request time (queue to reply) of ``n`` requests sent ten at a time."""
    rng = np.random.default_rng(9)
    out: list[float] = []
    async with RecommendClient(
        conn.kafka_bootstrap_servers, topic_prefix=conn.topic_prefix, profile=conn.kafka_profile
    ) as c:
        while len(out) < n:
            wave = [
                RecommendRequest(f"sc-{len(out)}-{j}", World.user_id(int(u)), 20)
                for j, u in enumerate(rng.integers(0, users, 10))
            ]
            replies = await asyncio.gather(*(c.send(req, 60) for req in wave))
            out += [float(rep.timings_ms["total"]) for rep in replies]
            progress.update(f"requests: {len(out)}/{n}")
    return out[:n]


# ------------------------------------------------------------------------------ cache levels
HOST_SHARES = (0.0, 0.1, 1.0)
"""Host RAM's size in each configuration, as a share of the users (the device: a hundredth)."""


def cache_levels(fetch, users: int, batches: int, zipf: float, progress) -> dict:
    """Hit rates per level and lookup times of Zipf-drawn user batches through a cache whose
    device slab holds a hundredth of the users, with host RAM for none, a tenth or all of
    them: ``batches`` batches to warm it, then as many more measured."""
    rng = np.random.default_rng(17)
    weights = 1.0 / np.arange(1, users + 1) ** zipf
    order = rng.permutation(users)  # popularity unrelated to the id
    draws = order[rng.choice(users, size=(2 * batches, 32), p=weights / weights.sum())]
    ids = [row_ids([World.user_id(int(u)) for u in batch]) for batch in draws]
    device_rows = max(users // 100, 32)
    out: dict = {"device_rows": device_rows, "zipf": zipf, "batches": batches, "configs": []}
    trips = [0]

    def counted(table: int, batch_ids: list[int]):
        trips[0] += 1
        return fetch(table, batch_ids)

    for share in HOST_SHARES:
        host_rows = int(users * share)
        cache = EmbeddingCache(DIM, device_rows, counted, torch.device("cpu"), host_users=host_rows)
        for batch in ids[:batches]:
            cache.slots(TABLE_USER, batch)
        trips[0] = 0
        before = {t: total_lookups(t) for t in LEVELS}
        times = []
        for n, batch in enumerate(ids[batches:]):
            t = time.perf_counter()
            cache.slots(TABLE_USER, batch)
            times.append((time.perf_counter() - t) * 1000)
            if n % 200 == 0:
                progress.update(f"cache levels, host RAM {host_rows:,}: {n}/{batches} batches")
        got = {t: total_lookups(t) - before[t] for t in LEVELS}
        n_ids = sum(got.values())
        out["configs"].append(
            {
                "host_rows": host_rows,
                **{f"{t}_share": round(got[t] / n_ids, 4) for t in LEVELS},
                "redis_trips_per_batch": round(trips[0] / batches, 4),
                "lookup_mean_ms": round(float(np.mean(times)), 3),
                "lookup_p99_ms": round(float(np.percentile(times, 99)), 3),
            }
        )
    return out


LEVELS = ("device", "host", "redis", "new")


def total_lookups(tier: str) -> float:
    return m.CACHE_LOOKUPS.labels("user", tier)._value.get()


# ------------------------------------------------------------------------- parameter server
def param_server_rate(conn, user_ids, item_ids, rows: int, progress) -> int:
    """Rows/s one parameter-server process applies and persists, over messages of 1,000
    distinct rows drawn from the whole tables (nine users to one item)."""
    rng = np.random.default_rng(11)
    n_items = min(rows // 10, len(item_ids))
    picks = {
        TABLE_USER: rng.choice(user_ids, min(rows - n_items, len(user_ids)), replace=False),
        TABLE_ITEM: rng.choice(item_ids, n_items, replace=False),
    }
    partitions = gradients_partitions(conn)
    topic = TopicNames(conn.topic_prefix).gradients
    p = Producer(producer_config(conn))
    now = clock.now_ms()
    sent = 0
    for table, ids in picks.items():
        part = row_partitions(ids, partitions)
        for s in range(partitions):
            mine = ids[part == s]
            for lo in range(0, len(mine), 1000):
                chunk = mine[lo : lo + 1000]
                grads = (rng.standard_normal((len(chunk), width(DIM))) * 0.01).astype(np.float32)
                batch = RowBatch(
                    KIND_GRADIENTS,
                    table,
                    chunk,
                    grads,
                    np.ones(len(chunk), np.uint64),
                    np.full(len(chunk), now),
                )
                p.produce(topic, batch.encode(), partition=s)
                p.poll(0)
                sent += len(chunk)
    p.flush(60)
    port = free_port()
    env = {"FRESHREC_EMBEDDING_DIM": str(DIM)}
    with service_process(conn, "param-server", port, env):
        first, scrapes = None, 0
        deadline = time.monotonic() + 900
        while True:
            done = total(scrape_port(port), "freshrec_ps_rows_applied_total")
            if done > 0 and first is None:
                first = (time.perf_counter(), done)
            scrapes += first is not None
            progress.update(f"parameter server: {done:,.0f}/{sent:,} rows")
            if done >= sent:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the parameter server applied {done:,.0f} of {sent:,} rows")
            time.sleep(0.05)
        took = time.perf_counter() - first[0]
    if scrapes < 10:  # timed from the first rows seen applied: too short a run to time
        raise SystemExit(f"{sent:,} gradient rows went too fast to time: raise --gradient-rows")
    return round((sent - first[1]) / took)


def drop_keys(conn) -> None:
    r = connect(conn.redis_url)
    with contextlib.closing(r):
        doomed = list(r.scan_iter(match=f"{conn.topic_prefix}*", count=1000))
        for k in doomed:
            r.unlink(k)


if __name__ == "__main__":
    main()
