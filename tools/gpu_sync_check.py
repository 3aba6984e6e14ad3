"""On a GPU: a learning slice and a serving batch copy back to the host only what must leave.

The worker keeps its tables on the device and does a slice's arithmetic (gather, logistic
gradient, sums, clipping, the local step) and a batch's ranking and MMR there; the copies back
are ``inference.device.to_host``: the gradient batch, the candidates recall hands to the merge,
the reply. Under ``torch.cuda.set_sync_debug_mode("error")`` every other device→host copy, and
every other operation that makes the host wait for the device, raises — so a learning slice
and a serving batch that complete show that none was made. Prints the copies each made, and
fails (exit 1) where they pass the budget (``docs/design.md``: one a slice, three a batch) or
where a reply was served from the hot list because its model failed: ``RankingStage.rank``
catches a model's error, and its replies look served.

    python -m tools.gpu_sync_check            # needs CUDA; exits 2 without it
    python -m tools.gpu_sync_check --device cpu   # the same path on the CPU: copies counted,
                                                  # no sync check (a CPU has none to make)

A private embedded stack (or ``KAFKA_BOOTSTRAP_SERVERS``/``REDIS_URL``) holds a small
synthetic world; the worker is warmed up first (rows loaded, models and catalogue adopted):
a cold row's first load from Redis is a host→device copy outside the measured path.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from freshcore import clock
from freshcore.kafka import gradients_partitions
from freshrec.app.training import train_on_world
from freshrec.sim.world import World, WorldConfig
from inference.device import HOST_COPIES
from inference.learning.steps import Examples
from inference.serving.rankstage import model_failures
from inference.settings import LearningSettings, WorkerSettings
from inference.training.train import TrainConfig
from inference.worker import Worker
from tools.benchlib import bench_connection
from tools.seed import seed_world
from tools.serving_inprocess import _inbound

DIM = 32
BUDGET = {"learning_slice": 1, "serving_batch": 3}
"""The most copies back each may make (``docs/design.md``, "Host round trips")."""
WORLD = WorldConfig(seed=5, n_users=5000, n_items=2000, n_categories=12)


def examples(world: World, n: int, seed: int) -> Examples:
    rng = np.random.default_rng(seed)
    users = [World.user_id(int(u)) for u in world.sample_users(rng, n)]
    items = [World.item_id(int(i)) for i in world.sample_popular_items(rng, n)]
    now = clock.now_ms()
    return Examples(
        users,
        items,
        (rng.random(n) < 0.3).astype(np.float32),
        np.ones(n, np.float32),
        np.full(n, now, np.int64),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    device = ap.parse_args(argv).device
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("gpu_sync_check: torch sees no CUDA device; nothing to check", file=sys.stderr)
        return 2
    world = World(WORLD)
    with tempfile.TemporaryDirectory() as tmp, bench_connection("gpucheck.") as conn:
        models = Path(tmp) / "models"
        train_on_world(world, TrainConfig(impressions=40_000, dim=DIM), models, lambda s: None)
        seed_world(conn.redis_url, conn.topic_prefix, world, models, gradients_partitions(conn))
        w = Worker(WorkerSettings(conn, LearningSettings(dim=DIM), model_dir=models, device=device))
        w.start()
        try:
            ex = examples(world, 4000, seed=1)
            batch = _inbound(world, 32, seed=2)
            for _ in range(3):  # warm: rows resident, catalogue and models adopted
                w.learn(ex)
                w.recommender.serve(batch)
            out = {"device": torch.cuda.get_device_name(0) if cuda else "cpu"}
            if cuda:
                torch.cuda.synchronize()
            for name, work in (
                ("learning_slice", lambda: w.learn(ex)),
                ("serving_batch", lambda: w.recommender.serve(batch)),
            ):
                before = HOST_COPIES["count"]
                if cuda:
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    replies = work()
                finally:
                    if cuda:
                        torch.cuda.set_sync_debug_mode(0)
                out[name] = {"host_copies": HOST_COPIES["count"] - before}
                if cuda:
                    out[name]["other_syncs"] = 0  # any would have raised
                if replies is not None:
                    out[name]["model_failures"] = model_failures(r.tier_reason for r in replies)
        finally:
            w.close()
    print(json.dumps(out, indent=2))
    failed = failures(out)
    for line in failed:
        print(f"gpu_sync_check: {line}", file=sys.stderr)
    return 1 if failed else 0


def failures(out: dict) -> list[str]:
    """What in ``out`` fails the check: copies past the budget, replies a model failed.

    >>> failures({"learning_slice": {"host_copies": 1}, "serving_batch": {"host_copies": 4}})
    ['serving_batch: 4 copies back, the budget is 3']
    >>> failures({"serving_batch": {"host_copies": 3, "model_failures": ["light model error"]}})
    ['serving_batch: served from the hot list: light model error']
    """
    found = []
    for name, most in BUDGET.items():
        got = out.get(name, {})
        if got.get("host_copies", 0) > most:
            found.append(f"{name}: {got['host_copies']} copies back, the budget is {most}")
        if got.get("model_failures"):
            found.append(f"{name}: served from the hot list: " + "; ".join(got["model_failures"]))
    return found


if __name__ == "__main__":
    sys.exit(main())
