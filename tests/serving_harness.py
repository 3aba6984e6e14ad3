"""A small trained world for serving tests: models on disk, rows and catalogue in Redis, and
an in-process worker on a thread."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from freshrec.kafka import gradients_partitions
from inference.breaker import BreakerConfig
from inference.client import SyncRecommendClient
from inference.settings import LearningSettings, WorkerSettings
from inference.train import TrainConfig
from inference.worker import Worker
from tools.seed import seed_world
from tools.world import World, WorldConfig

from .streams_harness import wait_for

DIM = 16
WORLD = WorldConfig(seed=5, n_users=3000, n_items=400, n_categories=8)


def train_models(directory: Path) -> dict:
    return World(WORLD).train(TrainConfig(impressions=40_000, dim=DIM), directory, lambda s: None)


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
    return SyncRecommendClient(
        conn.kafka_bootstrap_servers, topic_prefix=conn.topic_prefix, **kwargs
    )


def counter(metric, *labels) -> float:
    """An in-process metric child's value (the worker runs on a thread of the test)."""
    return metric.labels(*labels)._value.get()
