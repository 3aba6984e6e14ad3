"""A small trained world for serving tests: models on disk, rows and catalogue in Redis, and
an in-process worker on a thread."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import redis as redis_lib

from freshrec.rediskeys import RedisKeys
from inference.breaker import BreakerConfig
from inference.modelfile import load_tensors, read_manifest
from inference.settings import LearningSettings, WorkerSettings
from inference.train import TrainConfig, train
from inference.worker import Worker
from param_server.rows import TABLE_ITEM, TABLE_USER
from param_server.store import seed_rows
from streams.hotlist import HotEntry, HotList
from tools.traffic import catalogue
from tools.world import World, WorldConfig

DIM = 16
WORLD = WorldConfig(seed=5, n_users=3000, n_items=400, n_categories=8)


def train_models(directory: Path) -> dict:
    return train(World(WORLD), TrainConfig(impressions=40_000, dim=DIM), directory, lambda s: None)


def seed_redis(conn, model_dir: Path, redis_url: str | None = None) -> None:
    """What `freshrec run` does before the services start: the catalogue (normally written by
    the streams app from the items topic) and the trained starting rows."""
    r = redis_lib.Redis.from_url(redis_url or conn.redis_url)
    k = RedisKeys(conn.topic_prefix)
    items = list(catalogue(World(WORLD)))
    r.hset(k.item_category, mapping={i.item_id: i.category for i in items})
    r.hset(k.item_price, mapping={i.item_id: i.price for i in items})
    regional = {i.item_id: i.region for i in items if i.region}
    if regional:
        r.hset(k.item_region, mapping=regional)
    world = World(WORLD)
    popular = [
        World.item_id(int(i)) for i in world.sample_popular_items(np.random.default_rng(1), 400)
    ]
    hot = list(dict.fromkeys(popular))[:50]
    now = int(time.time() * 1000)
    hl = HotList(now, [HotEntry(i, 50.0 - n, 0.05, 0.5) for n, i in enumerate(hot)], 0, now)
    r.hset(k.hot("global"), "0", json.dumps(hl.to_json()))
    r.sadd(k.hot_scopes(), "global")
    manifest = read_manifest(model_dir)
    t = load_tensors(model_dir, manifest["files"]["two_tower"])
    seed_rows(r, k, TABLE_ITEM, t["item_ids"].numpy(), t["item_rows"].numpy(), 1, 1)
    seed_rows(r, k, TABLE_USER, t["user_ids"].numpy(), t["user_rows"].numpy(), 1, 1)
    r.close()


def worker_settings(conn, model_dir: Path, **overrides) -> WorkerSettings:
    s = WorkerSettings(
        conn, LearningSettings(dim=DIM), user_capacity_rows=5000, model_dir=model_dir,
        breaker=BreakerConfig(window=20, min_calls=5, threshold=0.1, cooldown_ms=500),
        worker_id="test-worker",
    )  # fmt: skip
    return replace(s, **overrides)


@contextlib.contextmanager
def running_worker(settings: WorkerSettings, join_timeout_s: float = 30) -> Iterator[Worker]:
    w = Worker(settings)
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            w.run(stop)
        except BaseException as exc:  # surfaced in the test thread
            errors.append(exc)

    t = threading.Thread(target=loop, daemon=True, name="worker")
    t.start()
    deadline = time.monotonic() + join_timeout_s
    while w.assigned == 0:
        if errors:
            raise errors[0]
        assert time.monotonic() < deadline, "the worker did not join its group"
        time.sleep(0.05)
    try:
        yield w
    finally:
        stop.set()
        t.join(30)
        if errors:
            raise errors[0]
