"""The latency part of ``tools/bench_serving.py``: request/reply latency p50/p99 at fixed
rates through Kafka, the worker (as its own process, one per dynamic-batching wait) against
a raw echo service (``tools/echo.py``) with the same client settings."""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np

from freshcore.kafka import gradients_partitions
from freshrec.app.stack import free_port
from freshrec.client import RecommendClient, RecommendTimeout
from freshrec.sim.world import World
from inference.settings import WorkerSettings
from tools.benchlib import service_process
from tools.seed import seed_world
from tools.serving_inprocess import DIM, _with_prefix


def bench_latency(
    conn,
    models,
    world,
    rates,
    duration,
    progress,
    max_waits=(WorkerSettings.max_wait_ms,),
    device=None,
) -> dict:
    """Echo, then a worker per ``max_waits`` value (the dynamic batcher's wait); the one with
    the worker's default wait (0 ms) is ``worker``, others ``worker_max_wait_<ms>``."""
    out: dict = {"rates": {}}
    kinds = [("echo", None)] + [
        ("worker" if w == WorkerSettings.max_wait_ms else f"worker_max_wait_{w}", w)
        for w in max_waits
    ]
    for kind, wait in kinds:
        prefix = f"bl{kind.replace('_', '')}."
        c2 = _with_prefix(conn, prefix)
        if wait is not None:
            seed_world(conn.redis_url, prefix, world, models, gradients_partitions(c2))
            ctx = service_process(
                c2,
                "worker",
                free_port(),
                {
                    "FRESHREC_MODEL_DIR": str(models),
                    "FRESHREC_EMBEDDING_DIM": str(DIM),
                    "FRESHREC_MAX_WAIT_MS": str(wait),
                    "FRESHREC_DEVICE": str(device or "auto"),
                },
            )
        else:
            ctx = _echo_process(c2)
        with ctx:
            for rate in rates:
                progress.done(f"latency: {kind} at {rate:.0f} req/s for {duration:.0f}s")
                stats = asyncio.run(_paced(c2, world, rate, duration))
                out["rates"].setdefault(str(int(rate)), {})[kind] = stats
    for row in out["rates"].values():
        if "echo" in row and "worker" in row:
            row["overhead_p50_ms"] = round(row["worker"]["p50_ms"] - row["echo"]["p50_ms"], 2)
            row["overhead_p99_ms"] = round(row["worker"]["p99_ms"] - row["echo"]["p99_ms"], 2)
    return out


@contextlib.contextmanager
def _echo_process(conn):
    import os
    import subprocess
    import sys

    env = dict(
        os.environ,
        KAFKA_BOOTSTRAP_SERVERS=conn.kafka_bootstrap_servers,
        FRESHREC_TOPIC_PREFIX=conn.topic_prefix,
    )
    proc = subprocess.Popen([sys.executable, "-m", "tools.echo"], env=env)
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(15)


async def _paced(conn, world: World, rate: float, duration: float) -> dict:
    rng = np.random.default_rng(int(rate))
    async with RecommendClient(
        conn.kafka_bootstrap_servers,
        topic_prefix=conn.topic_prefix,
        timeout_s=5.0,
        keep_latencies=True,
        profile=conn.kafka_profile,
    ) as client:
        # warm up: the first request waits for the group join
        for _ in range(60):
            try:
                await client.recommend("u0", 10, timeout_s=1.0)
                break
            except RecommendTimeout:
                continue
        client.stats.latencies_ms.clear()
        tasks = set()
        start = time.monotonic()
        sent = 0
        timeouts = 0

        async def one(user: str) -> None:
            nonlocal timeouts
            try:
                await client.recommend(user, 20, context={"device": "pc", "region": "north"})
            except RecommendTimeout:
                timeouts += 1

        while time.monotonic() - start < duration:
            due = int((time.monotonic() - start) * rate) - sent
            for u in world.sample_users(rng, max(due, 0)).tolist():
                t = asyncio.create_task(one(World.user_id(int(u))))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
                sent += 1
            await asyncio.sleep(0.002)
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        lat = np.asarray(client.stats.latencies_ms)
    return {
        "sent": sent,
        "answered": len(lat),
        "timeouts": timeouts,
        "achieved_per_s": round(len(lat) / duration, 1),
        "p50_ms": round(float(np.percentile(lat, 50)), 2) if len(lat) else None,
        "p99_ms": round(float(np.percentile(lat, 99)), 2) if len(lat) else None,
    }
