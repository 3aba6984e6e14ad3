"""The ranking models side by side: held-out AUC and the time to rank a batch of 500
candidates, for Wide&Deep, the light and pruned tiers, the three attention rankers and the
tiered ranking by item heat, trained in one run by ``freshrec train``'s code.

    python -m tools.bench_ranking                      # `freshrec run`'s world, trained here
    python -m tools.bench_ranking --models .freshrec/models    # the models `freshrec run` serves
    python -m tools.bench_ranking --log ml-100k/u.data --format movielens --items ml-100k/u.item

AUCs are the manifest's (the held-out tenth of the synthetic log; the last tenth by time of
an interaction log, against sampled negatives). The batch: one request of 500 candidates in
the grouped form serving uses (its user row once), drawn from the catalogue, with a
50-item sequence for the attention rankers; ``tiered`` routes them by the training
split's item heat (default shares: 10% head, 30% middle) and runs one forward pass per tier.
The time is the median of ``--repeats`` passes after warm-up, on ``--device``. Results go to
``artifacts/bench_ranking.json``; docs/benchmarks.md quotes them.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from freshcore import clock
from freshrec.app.options import add_log_options
from freshrec.app.training import train_on_world
from freshrec.progress import ProgressLine
from freshrec.sim.world import World, WorldConfig
from inference.models.attention import SEQUENCE, gather_sequences, sequence_index
from inference.models.features import FeatureEncoder
from inference.models.kinds import MODEL_KINDS
from inference.models.modelfile import ModelWatcher, load_tensors, read_manifest
from inference.models.ranking import score
from inference.models.tiers import HeatSplit, route, thresholds
from inference.serving.rankstage import score_by_tiers
from inference.training.train import TrainConfig
from tools.benchlib import device_arg, median_ms, save

BATCH = 500


def train_models(args, directory: Path, progress: ProgressLine) -> dict:
    if args.log:
        from freshrec.app.options import read_log_from_args
        from inference.training.logtrain import train_from_log

        inter, items = read_log_from_args(args, args.log, progress)
        return train_from_log(inter, items, directory, progress.update)
    world = World(WorldConfig(seed=args.seed, n_users=args.users, n_items=args.items_count))
    return train_on_world(
        world, TrainConfig(impressions=args.impressions), directory, progress.update
    )


def batch_inputs(directory: Path, manifest: dict, device: torch.device, seed: int = 7):
    """One request of ``BATCH`` candidates (rows from the trained tables), its sequence,
    and each candidate's heat."""
    rng = np.random.default_rng(seed)
    tables = load_tensors(directory, manifest["files"]["two_tower"])
    users, items = tables["user_rows"].numpy(), tables["item_rows"].numpy()
    cand = rng.choice(len(items), min(BATCH, len(items)), replace=False)
    n = len(cand)
    enc = FeatureEncoder()
    ctx = enc.context(["pc"], ["north"], [clock.now_ms()])
    dense = np.column_stack(
        [rng.uniform(1, 100, n), rng.uniform(0.01, 0.3, n), rng.uniform(0, 0.2, n), rng.random(n)]
    ).astype(np.float32)
    x = enc.encode(
        users[rng.integers(len(users))][None, :],
        items[cand],
        dense,
        rng.integers(1, 128, n),
        np.repeat(ctx, n, 0),
        rng.random(n).astype(np.float32),
        owner=np.zeros(n, np.int64),
        recent_similarity=rng.standard_normal(n).astype(np.float32),
    )
    history = sequence_index([rng.choice(len(items), SEQUENCE, replace=False)], SEQUENCE)
    table = torch.from_numpy(items).to(device)
    seq = gather_sequences(lambda ix: table.index_select(0, ix), history, device)
    return x.with_sequences(*seq), cand


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--impressions", type=int, default=200_000, help="synthetic log size")
    ap.add_argument("--users", type=int, default=1_000_000)
    ap.add_argument("--items-count", type=int, default=20_000, help="synthetic catalogue size")
    ap.add_argument("--seed", type=int, default=7, help="the synthetic world's seed")
    ap.add_argument("--log", default=None, help="train on this interaction log instead")
    add_log_options(ap, items_help="with --log: the log's item file (docs/replay.md)")
    ap.add_argument("--models", type=Path, default=None, help="reuse/keep models here")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (the worker's default: 1)"
    )
    ap.add_argument("--out", type=Path, default=Path("artifacts"))
    args = ap.parse_args()
    device = device_arg(ap, args.device)
    torch.set_num_threads(args.threads)
    progress = ProgressLine()
    with tempfile.TemporaryDirectory(prefix="freshrec-ranking-") as tmp:
        directory = args.models or Path(tmp)
        started = time.monotonic()
        try:
            manifest = read_manifest(directory) if args.models else None
        except Exception:
            manifest = None
        if manifest is None:
            manifest = train_models(args, directory, progress)
        trained_s = round(time.monotonic() - started, 1)
        progress.done(f"models {manifest['version']} ({trained_s}s)")
        t = manifest["training"]
        save(
            "bench_ranking",
            {
                "source": manifest.get("source"),
                "device": str(device),
                "threads": torch.get_num_threads(),
                "training_seconds": trained_s,
                "pruned_sparsity": t.get("pruned_sparsity"),
                "impressions": t.get("impressions"),
                "models": rank_times(directory, manifest, device, args.repeats, progress),
            },
            args.out,
        )


def rank_times(directory: Path, manifest: dict, device, repeats: int, progress) -> dict:
    """Each trained model's held-out AUC and its median time over one batch; the tiered
    ranking's too where a pruned tier was trained."""
    models = ModelWatcher(directory, device, int(manifest["dim"])).load_now()
    x, cand = batch_inputs(directory, manifest, device)
    t = manifest["training"]
    rows = {}
    for kind in MODEL_KINDS:
        model = models.get(kind)
        if model is None:
            continue
        ms = round(median_ms(lambda m=model: score(m, x, device), repeats, 5), 3)
        rows[kind] = {"auc": t.get(f"auc_{kind}"), "batch_500_ms": ms}
        progress.done(f"{kind}: AUC {t.get(f'auc_{kind}')}, {ms} ms")
    if "pruned" in models.others:
        rng = np.random.default_rng(11)
        heat = rng.random(len(cand))  # the catalogue's heat ranks, uniform candidates
        tiers = route(heat + 1e-9, thresholds(heat + 1e-9, HeatSplit()))
        ms = round(median_ms(lambda: score_by_tiers(models, x, tiers, device), repeats, 5), 3)
        rows["tiered"] = {
            "auc": t.get("auc_tiered"),
            "batch_500_ms": ms,
            "test_impressions_by_tier": t.get("tiered_shares"),
        }
        progress.done(f"tiered: AUC {t.get('auc_tiered')}, {ms} ms")
    return rows


if __name__ == "__main__":
    main()
