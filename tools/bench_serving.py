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

Parts 2 to 4 run in this process (``tools/serving_inprocess.py``); part 1, through Kafka, is
``tools/serving_latency.py``.

Writes artifacts/bench_serving.json. Needs nothing running (starts a private embedded stack).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from freshcore.kafka import gradients_partitions
from freshrec.app.training import ensure_models
from freshrec.progress import ProgressLine
from freshrec.sim.world import World, WorldConfig
from inference.settings import WorkerSettings
from inference.training.train import TrainConfig
from tools.benchlib import bench_connection, device_arg, save
from tools.seed import seed_world
from tools.serving_inprocess import DIM, bench_batching, bench_ranking, bench_recall, bench_serve
from tools.serving_latency import bench_latency

PARTS = ("ranking", "recall", "serve", "batching", "latency")


def main() -> None:
    ap = parser()
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


def parser() -> argparse.ArgumentParser:
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
    return ap


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
