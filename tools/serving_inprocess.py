"""The in-process parts of ``tools/bench_serving.py``: ranking 500 candidates batched
against serially, recall with one slow channel in parallel against one after another,
``Recommender.serve`` for batches of 1, 4 and 32, and dynamic batching at saturation, each
with a worker (or its models) in this process."""

from __future__ import annotations

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
from freshrec.progress import ProgressLine
from freshrec.sim.world import World
from inference.models.features import FeatureEncoder
from inference.models.modelfile import ModelWatcher
from inference.models.ranking import score
from inference.serving.batch import Inbound
from inference.serving.degrade import LadderConfig
from inference.serving.recall import RecallQuery
from inference.settings import LearningSettings, WorkerSettings
from inference.worker import Worker
from schemas.codec import decode_reply, encode_request
from schemas.records import RecommendRequest, RequestContext
from tools.benchlib import median_ms
from tools.seed import seed_world

DIM = 64
"""The embedding width of the benchmark's models and worker."""


def _with_prefix(conn: ConnectionSettings, prefix: str) -> ConnectionSettings:
    """The same stack under another topic prefix (own topics and Redis keys), provisioned."""
    c2 = conn.with_prefix(prefix)
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
    x = _random_inputs(enc, rng, dim, n, 1)
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
        out[label] = _batched_vs_serial(model, x, rows, device, atol)
    progress.done(f"ranking on {device}: a dynamic batch, {n_req} requests x {n} candidates")
    grouped = _random_inputs(enc, rng, dim, n * n_req, n_req)
    out["dynamic_batch"] = {
        "requests": n_req,
        "candidates": n * n_req,
        "wide_deep_ms": round(median_ms(lambda: score(ms.full, grouped, device), repeats=20), 2),
        "light_ms": round(median_ms(lambda: score(ms.light, grouped, device), repeats=20), 2),
    }
    return out


def _random_inputs(enc: FeatureEncoder, rng, dim: int, rows: int, users: int):
    """Ranking inputs of ``rows`` candidates with random rows and features, for one user or
    (``users`` > 1) in the grouped form, each user's candidates together."""
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


def _batched_vs_serial(model, x, rows: list, device: torch.device, atol: float) -> dict:
    """``model`` over ``x`` in one pass (the median of 50) and over its ``rows`` one by one;
    both must score alike."""
    for r in rows[:20]:  # warm (CUDA: kernels, autocast caches)
        score(model, r, device)
    batched_ms = median_ms(lambda: score(model, x, device), repeats=50)
    t = time.perf_counter()
    serial = np.concatenate([score(model, r, device) for r in rows])
    serial_ms = (time.perf_counter() - t) * 1000
    batched = score(model, x, device)
    assert np.allclose(serial, batched, atol=atol), np.abs(serial - batched).max()
    return {
        "batched_ms": round(batched_ms, 3),
        "serial_ms": round(serial_ms, 2),
        "speedup": round(serial_ms / batched_ms, 1),
    }


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
        out[f"max_batch_{max_batch}"] = _saturation(conn, models, world, n, device, max_batch)
    b, s = out["max_batch_32"], out["max_batch_1"]
    out["throughput_ratio"] = round(b["requests_per_s"] / max(s["requests_per_s"], 1e-9), 2)
    out["p99_cost_ms"] = round(b["batch_time_p99_ms"] - s["batch_time_p99_ms"], 2)
    return out


def _saturation(conn, models: Path, world: World, n: int, device, max_batch: int) -> dict:
    """``n`` requests queued on topics of their own, answered by a worker batching up to
    ``max_batch``: its throughput and the p50 and p99 time of a request's batch."""
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
    served, elapsed, ranked = _serve_queue(w, n)
    w.close()
    if ranked < served:
        raise RuntimeError(f"{served - ranked:.0f} of {served} requests were not ranked")
    timings = _reply_timings(c2, names.recommend_replies, n)
    service = np.asarray([t["total"] - t["queue"] - t.get("topic", 0.0) for t in timings])
    return {
        "requests": served,
        "seconds": round(elapsed, 2),
        "requests_per_s": round(served / max(elapsed, 1e-9), 1),
        "batch_time_p50_ms": round(float(np.percentile(service, 50)), 2),
        "batch_time_p99_ms": round(float(np.percentile(service, 99)), 2),
    }


def _serve_queue(w: Worker, n: int) -> tuple[int, float, float]:
    """Poll the started worker ``w`` until it has served ``n`` requests (or ten minutes
    have passed): how many it served, the seconds from the poll that served the first to
    the last, and how many of its replies were ranked in full."""
    from freshcore import metrics as m

    served = 0
    first = last = None
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
    return served, elapsed, ranked


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
