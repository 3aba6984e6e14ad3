"""Vector recall on large catalogues: exact search against the IVF index, in-process.

For each catalogue size: the exact search the vector channel runs below
``FRESHREC_ANN_MIN_ITEMS`` (one fused matmul over every row, then a partial sort), and the IVF
index it switches to from there (``inference/serving/ann.py``) — its build time, its search time for a
batch of 1 and of 32 requests at several ``nprobe``, and its recall: the share of the exact
top-k (k = the vector channel's 250 candidates) that it also returns. One torch thread, as
the worker runs by default; no Kafka or Redis (the channel's I/O is nil: the rows are
resident).

The rows: the synthetic world's items (40 categories, clustered in a 16-d latent space)
mapped into the serving dimension by a fixed random projection plus noise, and the queries
its users' preference vectors mapped the same way: rows with the category structure learned
rows have, without training a two-tower model on 500k items for a benchmark.

    python -m tools.bench_ann                     # --items 100000,200000,500000,1000000
    python -m tools.bench_ann --items 50000 --nprobe auto,16,64 --reps 50
    python -m tools.bench_ann --device cuda --items 1000000,5000000,10000000

On a GPU (``--device cuda``) only the exact search is measured, with the rows resident there:
the worker builds no IVF index on a GPU, where the exact search is the fast one.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from freshrec.progress import ProgressLine
from freshrec.sim.world import World, WorldConfig
from inference.serving.ann import IVFIndex, auto_nprobe, exact_search, ivf_cells
from inference.serving.channels import DEFAULT_CHANNELS
from tools.benchlib import device_arg, save

DIM = 64


def rows_and_queries(n_items: int, n_queries: int, dim: int = DIM, seed: int = 5):
    """Item rows (n_items, dim) and query rows (n_queries, dim), float32 tensors."""
    world = World(WorldConfig(seed=seed, n_users=200_000, n_items=n_items))
    rng = np.random.default_rng(seed + 1)
    proj = rng.standard_normal((world.config.latent_dim, dim)).astype(np.float32)
    proj /= np.sqrt(world.config.latent_dim)
    items = world.item_vectors @ proj
    items += 0.1 * rng.standard_normal(items.shape, dtype=np.float32)
    users = world.sample_users(rng, n_queries)
    queries = world.user_vectors(users, world.config.start_ms).astype(np.float32) @ proj
    return torch.from_numpy(items), torch.from_numpy(queries)


BATCHES = (1, 8, 32)


def timings(search, queries: torch.Tensor, reps: int) -> dict:
    """Median ms of ``search(batch)`` for batches of 1, 8 and 32 different queries."""
    out = {}
    for size in BATCHES:
        batches = [queries[(i * size) % len(queries) :][:size] for i in range(reps + 1)]
        search(batches[0])  # warm
        times = []
        for batch in batches[1:]:
            t = time.perf_counter()
            search(batch)
            times.append((time.perf_counter() - t) * 1000)
        out[f"batch_{size}_ms"] = round(float(np.median(times)), 2)
    return out


def bench_size(
    n: int,
    nprobes: list[str],
    k: int,
    reps: int,
    progress: ProgressLine,
    device: torch.device = torch.device("cpu"),
) -> dict:
    progress.done(f"{n:,} items: rows and queries")
    rows, queries = rows_and_queries(n, 32 * reps)
    out: dict = {"items": n, "k": k}
    if device.type != "cpu":
        rows, queries = rows.to(device), queries.to(device)
        bias = torch.zeros(n, device=device)
        progress.done(f"{n:,} items: exact search on {device}")
        out["exact"] = timings(lambda b: exact_search(b, rows, bias, k), queries, reps)
        return out
    bias = torch.zeros(n)

    progress.done(f"{n:,} items: exact search")
    exact = np.concatenate(
        [exact_search(queries[i : i + 32], rows, bias, k) for i in range(0, len(queries), 32)]
    )
    out["exact"] = timings(lambda b: exact_search(b, rows, bias, k), queries, reps)

    cells = ivf_cells(n)
    progress.done(f"{n:,} items: IVF build ({cells:,} cells)")
    t = time.perf_counter()
    index = IVFIndex.build(rows, torch.ones(n, dtype=torch.bool), cells)
    out["ivf_build_s"] = round(time.perf_counter() - t, 2)
    out["cells"] = len(index.centroids)
    out["ivf"] = {}
    sizes = np.diff(index.offsets)
    for label in nprobes:
        nprobe = auto_nprobe(len(index.centroids)) if label == "auto" else int(label)
        nprobe = min(nprobe, len(index.centroids))
        progress.done(f"{n:,} items: IVF search, nprobe {nprobe} ({label})")
        found = [
            f
            for i in range(0, len(queries), 32)
            for f in index.search(queries[i : i + 32], rows, k, nprobe)
        ]
        recall = np.mean(
            [len(set(f.tolist()) & set(e.tolist())) / k for f, e in zip(found, exact, strict=True)]
        )
        probed = np.argsort(-(queries.numpy() @ index.centroids.T), axis=1)[:, :nprobe]
        out["ivf"][label] = {
            "nprobe": nprobe,
            **timings(lambda b, p=nprobe: index.search(b, rows, k, p), queries, reps),
            "recall_at_k": round(float(recall), 4),
            "rows_scanned": round(float(sizes[probed].sum(1).mean())),
        }
    return out


def summary(results: dict) -> str:
    def ms(r: dict) -> str:
        return " / ".join(str(r[f"batch_{b}_ms"]) for b in BATCHES)

    lines = [
        f"vector recall, k = {results['k']}, dim {results['dim']}, one torch thread; "
        "ms for batches of " + " / ".join(map(str, BATCHES)),
        "items | exact ms | IVF build s (cells) | nprobe: IVF ms, recall@k, rows scanned",
    ]
    for r in results["sizes"]:
        if "ivf" not in r:
            lines.append(f"{r['items']:,} | {ms(r['exact'])} | not built on {results['device']}")
            continue
        ivf = "; ".join(
            f"{p} ({v['nprobe']}): {ms(v)}, {v['recall_at_k']:.3f}, {v['rows_scanned']:,}"
            for p, v in r["ivf"].items()
        )
        lines.append(
            f"{r['items']:,} | {ms(r['exact'])} | {r['ivf_build_s']} ({r['cells']:,}) | {ivf}"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", default="100000,200000,500000,1000000")
    ap.add_argument(
        "--nprobe",
        default="auto,32,128",
        help="cells a query probes; auto: the worker's default (4%% of the cells, at least 64)",
    )
    ap.add_argument("--reps", type=int, default=20, help="timed batches per measurement")
    ap.add_argument(
        "--device",
        default="cpu",
        help="where the rows live: cpu (exact and IVF), or cuda (exact only)",
    )
    args = ap.parse_args()
    sizes = [int(x) for x in args.items.split(",")]
    nprobes = args.nprobe.split(",")
    if (
        min(sizes) < 1
        or args.reps < 1
        or not all(p == "auto" or (p.isdigit() and int(p) > 0) for p in nprobes)
    ):
        ap.error("--items and --reps take positive integers, --nprobe those or 'auto'")
    device = device_arg(ap, args.device)
    torch.set_num_threads(1)
    progress = ProgressLine()
    k = DEFAULT_CHANNELS["vector"].quota
    results: dict = {"k": k, "dim": DIM, "torch_threads": 1, "device": str(device), "sizes": []}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
    for n in sizes:
        results["sizes"].append(bench_size(n, nprobes, k, args.reps, progress, device))
    path = save("bench_ann", results)
    progress.done(f"results written to {path}")
    print(summary(results))


if __name__ == "__main__":
    main()
