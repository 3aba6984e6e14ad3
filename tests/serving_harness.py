"""A small trained world for serving tests: models on disk, rows and catalogue in Redis, and
an in-process worker on a thread."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from freshcore.kafka import gradients_partitions
from freshrec.app.training import train_on_world
from freshrec.client import SyncRecommendClient
from freshrec.sim.world import World, WorldConfig
from inference.serving.breaker import BreakerConfig
from inference.serving.settings import ServingSettings
from inference.settings import LearningSettings, WorkerSettings
from inference.training.train import TrainConfig
from inference.worker import Worker
from tools.seed import seed_world

from .streams_harness import wait_for

DIM = 16
WORLD = WorldConfig(seed=5, n_users=3000, n_items=400, n_categories=8)


def train_models(directory: Path) -> dict:
    return train_on_world(
        World(WORLD), TrainConfig(impressions=40_000, dim=DIM), directory, lambda s: None
    )


def seed_redis(conn, model_dir: Path, redis_url: str | None = None) -> None:
    """What `freshrec run` does before the services start (the catalogue and a hot list are
    normally written by the streams app)."""
    seed_world(
        redis_url or conn.redis_url,
        conn.topic_prefix,
        World(WORLD),
        model_dir,
        gradients_partitions(conn),
    )


def worker_settings(conn, model_dir: Path, **overrides) -> WorkerSettings:
    s = WorkerSettings(
        conn,
        LearningSettings(dim=DIM),
        user_capacity_rows=5000,
        model_dir=model_dir,
        breaker=BreakerConfig(window=20, min_calls=5, threshold=0.1, cooldown_ms=500),
        worker_id="test-worker",
        # the tests are about what is served, not how fast: a 250 ms budget from the
        # request's record timestamp lets a loaded CI machine step a reply down a tier
        serving=ServingSettings(default_budget_ms=10_000),
    )
    return replace(s, **overrides)


@contextlib.contextmanager
def running_worker(
    settings: WorkerSettings, join_timeout_s: float = 30, clients=None
) -> Iterator[Worker]:
    """A worker running on a thread (``clients``: its connections, e.g. with a producer that
    holds or fails messages; default the real ones)."""
    w = Worker(settings, clients)
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            w.run(stop)
        except BaseException as exc:  # surfaced in the test thread
            errors.append(exc)

    t = threading.Thread(target=loop, daemon=True, name="worker")
    t.start()

    def joined() -> bool:
        if errors:
            raise errors[0]
        return w.assigned > 0

    wait_for(joined, join_timeout_s, what="the worker to join its group")
    try:
        yield w
    finally:
        stop.set()
        t.join(30)
        if errors:
            raise errors[0]


def client_for(conn, **kwargs) -> SyncRecommendClient:
    kwargs.setdefault("profile", conn.kafka_profile)
    return SyncRecommendClient(
        conn.kafka_bootstrap_servers, topic_prefix=conn.topic_prefix, **kwargs
    )


def counter(metric, *labels) -> float:
    """An in-process metric child's value (the worker runs on a thread of the test)."""
    return metric.labels(*labels)._value.get()


class _NoRecentInRedis:
    """A Redis double for channel conformance: no recent clicks for anyone, and the
    co-visitation and successor lists given (the e2e tests run the channels against a real
    Redis)."""

    def __init__(self, lists: dict | None = None, successors: dict | None = None) -> None:
        self.lists = lists or {}
        self.successors = successors or {}

    def pipeline(self, transaction: bool = False):
        calls: list[str] = []
        double = self

        class Pipe:
            def lrange(self, key, start, stop):
                calls.append(("lrange", key))

            def hget(self, key, field):
                lists = double.successors if "sequel:" in key else double.lists
                calls.append(("hget", lists.get(field)))

            def execute(self):
                return [[] if kind == "lrange" else value for kind, value in calls]

        return Pipe()


def serving_state(items: int = 60, catalogue: int = 40, dim: int = 8):
    """A worker's serving state over ``items`` item rows of which the first ``catalogue`` are
    in the catalogue (4 categories), hot, regional and new lists of catalogue items, and two
    queries: a user with recent clicks and one without. For registry conformance tests."""
    import numpy as np
    import torch

    from freshcore.rediskeys import RedisKeys
    from inference.serving.channels import NEW_ITEMS, ServingState, category_members
    from inference.serving.recall import RecallQuery
    from inference.tables.cache import EmbeddingCache
    from schemas.ids import row_id
    from schemas.rows import TABLE_ITEM

    rng = np.random.default_rng(0)
    cache = EmbeddingCache(dim, 16, lambda table, ids: {}, torch.device("cpu"))
    names = [f"i{k}" for k in range(items)]
    ids = [row_id(x) for x in names]
    cache.load_items({i: (rng.standard_normal(dim + 1).astype(np.float32), 1, 0) for i in ids})
    slots = cache.slots(TABLE_ITEM, np.asarray(ids[:catalogue], np.int64))
    n = len(cache.item_ids)
    named = torch.zeros(n, dtype=torch.bool)
    named[torch.from_numpy(slots)] = True
    categories = np.arange(catalogue) % 4
    slot_category = np.full(n, -1, np.int64)
    slot_category[slots] = categories
    recent = {"u1": names[:3]}
    from freshcore.neighbours import serving_list

    # co-visitation lists of u1's clicks: catalogue items, an uncatalogued one, u1's own
    lists = {
        names[0]: serving_list([(names[5], 0.5), (names[catalogue + 1], 0.4), (names[1], 0.3)]),
        names[1]: serving_list([(names[5], 0.2), (names[6], 0.1)]),
    }
    # and their successor lists: i7 follows i0 and i1, i1 (u1's own) follows i0
    successors = {
        names[0]: serving_list([(names[7], 0.6), (names[5], 0.3), (names[1], 0.1)]),
        names[1]: serving_list([(names[7], 0.5), (names[8], 0.5)]),
        names[2]: serving_list([(names[9], 0.8), (names[catalogue + 2], 0.2)]),
    }
    redis_double = _NoRecentInRedis(lists, successors)
    state = ServingState(cache, redis_double, RedisKeys("t."), lambda u: recent.get(u, []))
    state.item_shards = 4
    state.slot_of = dict(zip(names[:catalogue], slots.tolist(), strict=True))
    state.named, state.named_count = named, catalogue
    state.unnamed_bias = torch.zeros(n).masked_fill(~named, float("-inf"))
    state.slot_category = slot_category
    state.category_slots = category_members(categories, slots)
    state.lists = {
        "global": slots[:15],
        "north": slots[5:12],
        NEW_ITEMS: slots[-5:],
    }
    queries = [
        RecallQuery(u, rng.standard_normal(dim + 1).astype(np.float32), "north")
        for u in ("u1", "u2")
    ]
    return state, queries
