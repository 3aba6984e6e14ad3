"""Benchmark of serving, in one run:

1. request/reply latency p50/p99 at fixed rates through Kafka: the worker vs a raw echo
   service (``tools/echo.py``) with the same client settings; overhead = worker − echo;
2. ranking 500 candidates batched (one forward pass) vs serially (one pass per candidate),
   with the same Wide&Deep model;
3. recall with one slow channel: all channels in parallel (the worker's way) vs one after
   another; ``Recommender.serve`` in-process for batches of 1, 4 and 32;
4. dynamic batching at saturation: requests/s with ``max_batch=32`` vs ``max_batch=1``, and
   the p99 time a request's batch takes (its latency cost).

    .venv/bin/python -m tools.bench_serving [--rates 50,200,500] [--duration 10] [--items 20000]
                                            [--max-waits 0,2,5] [--device auto|cpu|cuda]
                                            [--parts ranking,recall,serve,batching,latency]
                                            [--models DIR]

``--device`` is where the worker keeps its tables and ranks (``FRESHREC_DEVICE``; auto: CUDA
when there is one): on a GPU host, ``--device cuda --parts ranking,recall,serve,batching``
gives the figures to set beside the CPU ones. ``--models DIR`` reuses models trained for the
benchmark world (trained into DIR when it holds none).

Writes artifacts/bench_serving.json. Needs nothing running (starts a private embedded stack).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from freshcore import clock
from freshcore.kafka import admin_config, consumer_config, gradients_partitions, producer_config
from freshcore.settings import ConnectionSettings
from freshcore.topics import TopicNames, ensure_topics
from freshrec.app.stack import free_port
from freshrec.app.training import ensure_models
from freshrec.client import RecommendClient, RecommendTimeout
from freshrec.progress import ProgressLine
from freshrec.sim.world import World, WorldConfig
from inference.models.features import FeatureEncoder
from inference.models.modelfile import ModelWatcher
from inference.models.ranking import score
from inference.serving.degrade import LadderConfig
from inference.serving.recall import RecallQuery
from inference.serving.recommender import Inbound
from inference.settings import LearningSettings, WorkerSettings
from inference.training.train import TrainConfig
from inference.worker import Worker
from schemas.codec import decode_reply, encode_request
from schemas.records import RecommendRequest, RequestContext
from tools.benchlib import bench_connection, device_arg, median_ms, save, service_process
from tools.seed import seed_world

DIM = 64
PARTS = ("ranking", "recall", "serve", "batching", "latency")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="50,200,500")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--items", type=int, default=20_000)
    ap.add_argument("--saturation-requests", type=int, default=3000)
    ap.add_argument(
        "--max-waits",
        default=str(WorkerSettings.max_wait_ms),
        help="dynamic-batching waits (ms) to run the latency test with, e.g. 0,2,5",
    )
    ap.add_argument(
        "--device",
        default="auto",
        help="the worker's device (FRESHREC_DEVICE): auto, cpu, cuda, cuda:1 ...",
    )
    ap.add_argument("--parts", default=",".join(PARTS), help="which measurements to run")
    ap.add_argument(
        "--models",
        type=Path,
        default=None,
        help="model directory: reused when it holds the benchmark world's models, "
        "else trained into (default: a temporary one)",
    )
    args = ap.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or set(parts) - set(PARTS):
        ap.error(f"--parts takes some of {','.join(PARTS)}")
    device = device_arg(ap, args.device)
    progress = ProgressLine()
    world = World(WorldConfig(seed=5, n_users=200_000, n_items=args.items))
    results: dict = {"items": args.items, "dim": DIM, "torch_threads": 1, "device": str(device)}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="freshrec-bench-models-") as tmp:
        models = args.models or Path(tmp)
        ensure_models(
            world, models, TrainConfig(impressions=200_000, dim=DIM, rankers=""), progress
        )
        with bench_connection("bs.") as conn:
            seed_world(conn.redis_url, conn.topic_prefix, world, models, gradients_partitions(conn))
            if "ranking" in parts:
                results["ranking"] = bench_ranking(models, device, progress)
            if "recall" in parts:
                results["recall"] = bench_recall(conn, models, device, progress)
            if "serve" in parts:
                results["serve"] = bench_serve(conn, models, world, device, progress)
            if "batching" in parts:
                results["batching"] = bench_batching(
                    conn, models, world, args.saturation_requests, device, progress
                )
            if "latency" in parts:
                rates = [float(r) for r in args.rates.split(",")]
                waits = [int(w) for w in args.max_waits.split(",")]
                results["latency"] = bench_latency(
                    conn, models, world, rates, args.duration, progress, waits, device
                )
    path = save("bench_serving", results)
    progress.done(f"results written to {path}")
    print(summary(results))


def _with_prefix(conn: ConnectionSettings, prefix: str) -> ConnectionSettings:
    """The same stack under another topic prefix (own topics and Redis keys), provisioned."""
    c2 = ConnectionSettings(conn.kafka_bootstrap_servers, conn.redis_url, prefix)
    ensure_topics(AdminClient(admin_config(c2)), prefix)
    return c2


def _worker(conn, models, device: torch.device, **overrides) -> Worker:
    s = WorkerSettings(
        conn, LearningSettings(dim=DIM), model_dir=models, worker_id="bench", device=str(device)
    )
    return Worker(replace(s, **overrides))


def _inbound(world: World, n: int, seed: int = 0) -> list[Inbound]:
    rng = np.random.default_rng(seed)
    now = clock.now_ms()
    users = world.sample_users(rng, n)
    ctx = RequestContext("pc", "north", now)
    return [
        Inbound(
            RecommendRequest(
                f"b{seed}-{j}", World.user_id(int(u)), 20, ctx, deadline_ms=now + 600_000
            ),
            "x",
            None,
            now,
        )
        for j, u in enumerate(users.tolist())
    ]


# --------------------------------------------------------------------------------- ranking
def bench_ranking(
    models: Path, device: torch.device, progress: ProgressLine, dim: int = DIM
) -> dict:
    """500 candidates of one request: one forward pass vs 500 single-row passes; and the
    worker's real unit, a whole dynamic batch (32 requests × 500 candidates) in one grouped
    pass."""
    progress.done(f"ranking on {device}: 500 candidates, batched vs serial")
    watcher = ModelWatcher(models, device, dim)
    ms = watcher.load_now()
    if ms is None:
        raise SystemExit(f"no ranking models in {models}: {watcher.last_error}")
    rng = np.random.default_rng(0)
    n, n_req = 500, 32
    enc = FeatureEncoder()

    def inputs(rows: int, users: int):
        owner = np.repeat(np.arange(users), rows // users) if users > 1 else None
        return enc.encode(
            rng.standard_normal((users if owner is not None else rows, dim + 1)).astype(np.float32)
            * 0.1,
            rng.standard_normal((rows, dim + 1)).astype(np.float32) * 0.1,
            rng.random((rows, 4)).astype(np.float32),
            rng.integers(0, 128, rows),
            enc.context(["pc"] * rows, ["north"] * rows, [clock.now_ms()] * rows),
            rng.random(rows).astype(np.float32),
            owner=owner,
        )

    x = inputs(n, 1)
    rows = [
        type(x)(
            x.user[i : i + 1],
            x.item[i : i + 1],
            x.dense[i : i + 1],
            x.sparse[i : i + 1],
            x.cross[i : i + 1],
        )
        for i in range(n)
    ]
    # fp16 on CUDA: one pass and 500 passes round differently
    atol = 1e-5 if device.type == "cpu" else 5e-3
    out: dict = {}
    for label, model in (("wide_deep", ms.full), ("light", ms.light)):
        for r in rows[:20]:  # warm (CUDA: kernels, autocast caches)
            score(model, r, device)
        batched_ms = median_ms(lambda m=model: score(m, x, device), repeats=50)
        t = time.perf_counter()
        serial = np.concatenate([score(model, r, device) for r in rows])
        serial_ms = (time.perf_counter() - t) * 1000
        batched = score(model, x, device)
        assert np.allclose(serial, batched, atol=atol), np.abs(serial - batched).max()
        out[label] = {
            "batched_ms": round(batched_ms, 3),
            "serial_ms": round(serial_ms, 2),
            "speedup": round(serial_ms / batched_ms, 1),
        }
    progress.done(f"ranking on {device}: a dynamic batch, {n_req} requests x {n} candidates")
    grouped = inputs(n * n_req, n_req)
    out["dynamic_batch"] = {
        "requests": n_req,
        "candidates": n * n_req,
        "wide_deep_ms": round(median_ms(lambda: score(ms.full, grouped, device), repeats=20), 2),
        "light_ms": round(median_ms(lambda: score(ms.light, grouped, device), repeats=20), 2),
    }
    return out


# ---------------------------------------------------------------------------------- recall
def bench_recall(conn, models: Path, device: torch.device, progress: ProgressLine) -> dict:
    """All channels for a batch of 32 with i2i made slow (30 ms): parallel vs serial; and
    the vector channel alone (exact search over the resident item table)."""
    progress.done(f"recall on {device}: parallel vs serial with one slow channel (i2i +30 ms)")
    w = _worker(conn, models, device, recall_delays_ms={"i2i": 30.0})
    w.start()
    try:
        rec = w.recommender
        runner = rec.runner
        queries = [
            RecallQuery(f"u{j}", np.asarray(w.user_row(f"u{j}")), "north") for j in range(32)
        ]
        for _ in range(3):
            runner.run(queries)
        reps = 20
        t = time.perf_counter()
        for _ in range(reps):
            result = runner.run(queries, budget_ms=1000)
        parallel = (time.perf_counter() - t) / reps * 1000
        assert not result.timed_out, result.timed_out
        t = time.perf_counter()
        for _ in range(reps):
            for name in runner.configs:
                runner._call(name, queries)
        serial = (time.perf_counter() - t) / reps * 1000
        vector = median_ms(lambda: runner._call("vector", queries), repeats=reps)
    finally:
        w.close()
    return {
        "batch": 32,
        "slow_channel": "i2i",
        "slow_ms": 30,
        "parallel_ms": round(parallel, 2),
        "serial_ms": round(serial, 2),
        "speedup": round(serial / parallel, 2),
        "vector_channel_ms": round(vector, 2),
    }


# ----------------------------------------------------------------------------------- serve
def bench_serve(
    conn, models: Path, world: World, device: torch.device, progress: ProgressLine
) -> dict:
    """``Recommender.serve`` in-process (no Kafka): median time of a batch of 1, 4 and 32
    requests of users not seen before, and its recall / rank / rerank split."""
    progress.done(f"serve in-process on {device}: batches of 1, 4 and 32")
    w = _worker(conn, models, device)
    w.start()
    out = {}
    try:
        time.sleep(2)
        w.poll_once()
        rec = w.recommender
        for size in (1, 4, 32):
            # each batch made as it is served: a request's budget runs from when it was
            # made, and batches made ahead would wait past it and be served degraded
            for i in range(5):
                rec.serve(_inbound(world, size, seed=1000 * size + i))
            total, stages = [], {"recall": [], "rank": [], "rerank": []}
            for i in range(5, 35):
                b = _inbound(world, size, seed=1000 * size + i)
                t = time.perf_counter()
                replies = rec.serve(b)
                if any(r.tier != "full" for r in replies):
                    raise RuntimeError(f"a batch of {size} was served degraded: {replies[0]}")
                total.append((time.perf_counter() - t) * 1000)
                for stage, values in stages.items():
                    values.append(replies[0].timings_ms[stage])
            out[f"batch_{size}"] = {
                "median_ms": round(float(np.median(total)), 2),
                **{f"{k}_ms": round(float(np.median(v)), 2) for k, v in stages.items()},
            }
    finally:
        w.close()
    return out


# -------------------------------------------------------------------------------- batching
def bench_batching(
    conn, models: Path, world: World, n: int, device: torch.device, progress: ProgressLine
) -> dict:
    """Preloaded requests answered by one in-process worker: throughput and batch time."""
    out = {}
    for max_batch in (32, 1):
        progress.done(f"dynamic batching: {n:,} queued requests, max_batch={max_batch}")
        prefix = f"bb{max_batch}."
        c2 = _with_prefix(conn, prefix)
        seed_world(conn.redis_url, prefix, world, models, gradients_partitions(c2))
        names = TopicNames(prefix)
        p = Producer(producer_config(c2))
        for b in _inbound(world, n, seed=max_batch):
            p.produce(
                names.recommend_requests,
                encode_request(b.request),
                key=b.request.user_id.encode(),
                headers=[
                    ("reply-to", names.recommend_replies.encode()),
                    ("correlation-id", b.request.request_id.encode()),
                ],
            )
        p.flush(30)
        w = _worker(
            c2,
            models,
            device,
            max_batch=max_batch,
            # every request ranked: the queue is not a reason to step down, nor the time
            # its requests waited in the topic (a budget runs from the request's record time)
            serving=replace(
                WorkerSettings(c2).serving,
                ladder=LadderConfig(queue_depth_limit=10**9),
                default_budget_ms=3_600_000,
            ),
        )
        w.start()
        served = 0
        first = last = None
        from freshcore import metrics as m

        base = m.REQUESTS.labels("served")._value.get()
        full = m.REPLIES.labels("full", w.recommender.mode)._value.get()
        deadline = time.monotonic() + 600
        while served < n and time.monotonic() < deadline:
            before = time.monotonic()
            w.poll_once()
            served = int(m.REQUESTS.labels("served")._value.get() - base)
            if served and first is None:
                first = before  # the poll that served the first requests started here
            last = time.monotonic()
        elapsed = (last or 0.0) - (first or 0.0)
        ranked = m.REPLIES.labels("full", w.recommender.mode)._value.get() - full
        w.close()
        if ranked < served:
            raise RuntimeError(f"{served - ranked:.0f} of {served} requests were not ranked")
        timings = _reply_timings(c2, names.recommend_replies, n)
        service = np.asarray([t["total"] - t["queue"] - t.get("topic", 0.0) for t in timings])
        out[f"max_batch_{max_batch}"] = {
            "requests": served,
            "seconds": round(elapsed, 2),
            "requests_per_s": round(served / max(elapsed, 1e-9), 1),
            "batch_time_p50_ms": round(float(np.percentile(service, 50)), 2),
            "batch_time_p99_ms": round(float(np.percentile(service, 99)), 2),
        }
    b, s = out["max_batch_32"], out["max_batch_1"]
    out["throughput_ratio"] = round(b["requests_per_s"] / max(s["requests_per_s"], 1e-9), 2)
    out["p99_cost_ms"] = round(b["batch_time_p99_ms"] - s["batch_time_p99_ms"], 2)
    return out


def _reply_timings(conn, topic: str, n: int) -> list[dict]:
    c = Consumer(consumer_config(conn, None))
    c.assign([TopicPartition(topic, p, 0) for p in range(8)])
    out: list[dict] = []
    deadline = time.monotonic() + 60
    while len(out) < n and time.monotonic() < deadline:
        for msg in c.consume(1000, 0.5):
            if not msg.error():
                out.append(decode_reply(msg.value(), clock.now_ms()).timings_ms)
    c.close()
    return out


# --------------------------------------------------------------------------------- latency
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


def summary(r: dict) -> str:
    lines = [f"device {r.get('device', 'cpu')}" + (f" ({r['gpu']})" if r.get("gpu") else "")]
    for label, v in r.get("ranking", {}).items():
        if label == "dynamic_batch":
            lines.append(
                f"ranking a dynamic batch ({v['requests']} requests, {v['candidates']} "
                f"candidates): wide&deep {v['wide_deep_ms']} ms, light {v['light_ms']} ms"
            )
            continue
        lines.append(
            f"ranking {label}: 500 candidates batched {v['batched_ms']} ms vs serial "
            f"{v['serial_ms']} ms = {v['speedup']}x"
        )
    if rc := r.get("recall"):
        lines.append(
            f"recall (i2i +30 ms): parallel {rc['parallel_ms']} ms vs serial "
            f"{rc['serial_ms']} ms = {rc['speedup']}x; vector channel alone "
            f"{rc['vector_channel_ms']} ms for {rc['batch']} requests"
        )
    for label, v in r.get("serve", {}).items():
        lines.append(
            f"serve in-process, {label}: {v['median_ms']} ms (recall {v['recall_ms']}, "
            f"rank {v['rank_ms']}, rerank {v['rerank_ms']})"
        )
    if b := r.get("batching"):
        lines.append(
            f"dynamic batching: {b['max_batch_32']['requests_per_s']} req/s (max_batch 32) vs "
            f"{b['max_batch_1']['requests_per_s']} (max_batch 1) = {b['throughput_ratio']}x; "
            f"batch time p99 {b['max_batch_32']['batch_time_p99_ms']} vs "
            f"{b['max_batch_1']['batch_time_p99_ms']} ms"
        )
    for rate, row in r.get("latency", {}).get("rates", {}).items():
        for kind, v in row.items():
            if kind.startswith("worker_max_wait_"):
                lines.append(f"{rate} req/s, {kind}: p50 {v['p50_ms']} p99 {v['p99_ms']} ms")
        e, w = row.get("echo", {}), row.get("worker", {})
        lines.append(
            f"{rate} req/s: worker p50 {w.get('p50_ms')} p99 {w.get('p99_ms')} ms "
            f"({w.get('timeouts')} timeouts) vs echo p50 {e.get('p50_ms')} p99 {e.get('p99_ms')} ms"
            f" -> overhead p99 {row.get('overhead_p99_ms')} ms"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
