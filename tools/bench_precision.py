"""float32 against float16 storage (``FRESHREC_TABLE_DTYPE``, ``FRESHREC_RANKING_DTYPE``), in
one run on one device: what the worker's tables and ranking weights cost and what they score.

For each dtype:

- **tables**: an item table of ``--items`` rows and a user slab of ``--users`` rows of
  dim 64 (+1) in an ``EmbeddingCache`` as the worker holds them; bytes a row (the tensors'
  size; on CUDA also the allocator's growth);
- **vector recall**: the exact search of 32 queries for their 200 best items over the whole
  item table (median ms), and the share of the float32 table's top 200 the float16 table
  finds;
- **learning slice**: the learner's step on the device (``learner.step_on_device``: gather,
  widen, logistic gradients, the step, the one copy back) for a slice of 4,096 examples
  drawn over both tables (median ms);
- **ranking**: Wide&Deep and the light model trained on a small synthetic world by
  ``freshrec train``'s code: held-out AUC with the weights as trained and rounded to float16
  (the manifest's), the weights' bytes, and the median time to score one request of 500
  candidates (``ranking.score``, weights widened per pass when held in float16).

Results go to ``artifacts/bench_precision.json``; a Markdown table is printed.

    python -m tools.bench_precision                    # 1M items, 200k users, on auto
    python -m tools.bench_precision --device cuda --out artifacts/gpu
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch

from freshrec.app.training import train_on_world
from freshrec.progress import ProgressLine
from freshrec.sim.world import World, WorldConfig
from inference.device import STORAGE_DTYPES
from inference.learning.learner import LearningSettings, step_on_device
from inference.learning.steps import Examples
from inference.models.modelfile import load_model, read_manifest
from inference.models.ranking import score
from inference.serving.ann import exact_search
from inference.tables.cache import EmbeddingCache
from inference.training.train import TrainConfig
from schemas.rows import TABLE_ITEM
from tools.bench_ranking import batch_inputs
from tools.benchlib import device_arg, median_ms, save

DIM = 64
QUERIES, TOP, SLICE = 32, 200, 4096


def tables(items: int, users: int, dtype: torch.dtype, device: torch.device, seed: int = 1):
    """A cache holding ``items`` item rows and ``users`` user rows (random, the same for every
    dtype), and the allocator's growth on CUDA (None on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
    cache = EmbeddingCache(DIM, users, lambda t, ids: None, device, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    slots = cache.slots_for_install(TABLE_ITEM, list(range(items)))
    for lo in range(0, items, 1 << 18):  # a block at a time: no second copy of the table
        block = torch.randn(min(1 << 18, items - lo), cache.w, generator=g) * 0.1
        cache.items.rows[cache.to_device(slots[lo : lo + len(block)])] = cache.stored(block)
    user_rows = torch.randn(users, cache.w, generator=g) * 0.1
    cache.users.rows.copy_(cache.stored(user_rows))
    grown = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        grown = torch.cuda.memory_allocated(device) - before
    return cache, grown


def vector_recall(cache: EmbeddingCache, items: int, repeats: int):
    g = torch.Generator().manual_seed(2)
    q = cache.to_device(torch.randn(QUERIES, cache.w, generator=g) * 0.1)
    rows = cache.items.rows[:items]
    bias = torch.zeros(items, device=cache.device)
    found = exact_search(q, rows, bias, TOP)
    return median_ms(lambda: exact_search(q, rows, bias, TOP), repeats), found


def learning_slice(cache: EmbeddingCache, items: int, users: int, repeats: int) -> float:
    """The median time of the learner's step on the device (``learner.step_on_device``) for
    a slice of ``SLICE`` examples drawn over both tables, each row once."""
    rng = np.random.default_rng(3)
    us = cache.to_device(rng.choice(users, SLICE, replace=False))
    its = cache.to_device(rng.choice(items, SLICE, replace=False))
    at = cache.to_device(np.arange(SLICE))
    labels = (rng.random(SLICE) < 0.3).astype(np.float32)
    ex = Examples([], [], labels, np.ones(SLICE, np.float32), np.zeros(SLICE, np.int64))
    learning = LearningSettings(dim=DIM, lr=0.01, user_lr=0.01)
    return median_ms(lambda: step_on_device(cache, (us, at), (its, at), ex, learning), repeats)


def ranking(directory: Path, device: torch.device, repeats: int) -> dict:
    manifest = read_manifest(directory)
    x, _ = batch_inputs(directory, manifest, device)
    out = {}
    for kind in ("wide_deep", "light"):
        for name in STORAGE_DTYPES:
            model = load_model(directory, manifest, kind, device, name)
            suffix = "" if name == "float32" else f"_{name}"
            out[f"{kind}_{name}"] = {
                "auc": round(float(manifest["training"][f"auc_{kind}{suffix}"]), 4),
                "weight_bytes": sum(p.nbytes for p in model.parameters()),
                "batch_500_ms": round(median_ms(lambda m=model: score(m, x, device), repeats), 3),
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=1_000_000, help="item rows in the table")
    ap.add_argument("--users", type=int, default=200_000, help="user rows in the slab")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    ap.add_argument("--out", type=Path, default=Path("artifacts"))
    args = ap.parse_args()
    device = device_arg(ap, args.device)
    torch.set_num_threads(1)  # the worker's default
    progress = ProgressLine()
    results: dict = {
        "device": str(device),
        "items": args.items,
        "users": args.users,
        "dim": DIM,
        "tables": {},
    }
    reference = None
    for name, dtype in STORAGE_DTYPES.items():
        progress.update(f"{name}: filling {args.items:,} item and {args.users:,} user rows")
        cache, grown = tables(args.items, args.users, dtype, device)
        table_bytes = cache.items.rows[: args.items].nbytes + cache.users.rows.nbytes
        progress.update(f"{name}: vector recall")
        recall_ms, found = vector_recall(cache, args.items, args.repeats)
        if reference is None:
            reference = found
        same = np.mean(
            [len(np.intersect1d(a, b)) / TOP for a, b in zip(found, reference, strict=True)]
        )
        progress.update(f"{name}: learning slices")
        results["tables"][name] = {
            "bytes_per_row": round(table_bytes / (args.items + args.users), 1),
            "allocator_growth_bytes": grown,
            "vector_recall_32_ms": round(recall_ms, 2),
            "top200_shared_with_float32": round(float(same), 4),
            "learning_slice_ms": round(learning_slice(cache, args.items, args.users, 20), 2),
        }
        del cache
    with tempfile.TemporaryDirectory(prefix="freshrec-precision-") as tmp:
        world = World(WorldConfig(seed=7, n_users=50_000, n_items=5_000))
        train_on_world(
            world, TrainConfig(impressions=100_000, dim=DIM, rankers=""), Path(tmp), progress.update
        )
        progress.update("ranking batches")
        results["ranking"] = ranking(Path(tmp), device, args.repeats * 5)
    path = save("bench_precision", results, args.out)
    progress.done(f"results written to {path}")
    print(table(results))


def table(r: dict) -> str:
    rows = [
        f"| tables ({r['items']:,} items + {r['users']:,} users, dim {r['dim']}, {r['device']}) "
        "| bytes a row | vector recall, 32 queries (ms) | top 200 shared with float32 "
        "| learning slice of 4,096 (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, t in r["tables"].items():
        rows.append(
            f"| {name} | {t['bytes_per_row']} | {t['vector_recall_32_ms']} "
            f"| {t['top200_shared_with_float32']:.2%} | {t['learning_slice_ms']} |"
        )
    rows += [
        "",
        "| ranking weights | held-out AUC | weight bytes | 500 candidates (ms) |",
        "|---|---:|---:|---:|",
    ]
    for name, k in r["ranking"].items():
        rows.append(f"| {name} | {k['auc']} | {k['weight_bytes']:,} | {k['batch_500_ms']} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
