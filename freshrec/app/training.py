"""``freshrec train``, and the models that ``freshrec run`` trains when it has none."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from freshcore.settings import ConnectionSettings, load_environment
from freshrec.app.commands import connection
from freshrec.app.options import add_log_options, add_world_options
from freshrec.app.settings import WORLD_ITEMS
from freshrec.app.stack import external_services
from freshrec.progress import ProgressLine

log = logging.getLogger("freshrec")


def world_log(world, n: int, rng, slate: int = 10, users=None):
    """``n`` of the synthetic world's logged impressions as a ``TrainingLog``."""
    from inference.training.train import TrainingLog  # torch: only for training

    return TrainingLog(**world.logged_impressions(n, rng, slate, users))


def train_on_world(world, cfg, out_dir, progress, users=None) -> dict:
    """Train the models on ``cfg.impressions`` of the world's logged impressions (of ``users``
    only, when given: models that know those users well) with
    ``inference.training.train.train``; returns the manifest."""
    import numpy as np

    from inference.training.train import train

    rng = np.random.default_rng(cfg.seed)
    whose = "the synthetic world" if users is None else f"{len(users):,} users"
    progress(f"logging {cfg.impressions:,} impressions of {whose}")
    log = world_log(world, cfg.impressions, rng, users=users)
    return train(log, cfg, out_dir, progress, rng)


def model_dir(args_out: str | None = None) -> Path:
    from freshcore.settings import model_dir as configured

    env = load_environment()
    return Path(args_out) if args_out else configured(env)


def ensure_models(world, directory: Path, config, progress: ProgressLine) -> dict:
    """The manifest of models trained on this world with this ``TrainConfig``; trains them
    when there are none (models of another world, or trained by another configuration — an
    older release's included — are replaced)."""
    from dataclasses import asdict

    from inference.models.modelfile import ModelFileError, read_manifest

    try:
        manifest = read_manifest(directory)
        same_world = manifest.get("source") == world.source()
        same_config = manifest.get("training", {}).get("config") == asdict(config)
        if same_world and same_config:
            log.info(
                "models %s found in %s (this world, this configuration)",
                manifest["version"],
                directory,
            )
            return manifest
        why = "on another world" if not same_world else "with another training configuration"
        log.info("models in %s were trained %s: training again", directory, why)
    except ModelFileError:
        log.info("no models in %s yet: training (a minute or two, cached afterwards)", directory)
    started = time.monotonic()
    manifest = train_on_world(world, config, directory, progress.update)
    t = manifest["training"]
    progress.done(
        f"trained {manifest['version']} in {time.monotonic() - started:.0f}s: " + held_out_line(t)
    )
    return manifest


def load_starting_embeddings(conn: ConnectionSettings, directory: Path, manifest: dict) -> int:
    """Write the trained two-tower rows to Redis where no row exists yet."""
    from freshcore.kafka import gradients_partitions
    from freshcore.redisconn import connect
    from freshcore.rediskeys import RedisKeys
    from freshcore.rowstore import row_shards, seed_rows
    from inference.models.modelfile import load_tensors
    from schemas.rows import TABLE_ITEM, TABLE_USER

    tensors = load_tensors(directory, manifest["files"]["two_tower"])
    r = connect(conn.redis_url)
    keys = RedisKeys(conn.topic_prefix)
    written = 0
    try:
        shards = row_shards(r, keys, gradients_partitions(conn))
        for table, ids, rows in (
            (TABLE_ITEM, "item_ids", "item_rows"),
            (TABLE_USER, "user_ids", "user_rows"),
        ):
            written += seed_rows(
                r,
                keys,
                table,
                tensors[ids].numpy(),
                tensors[rows].numpy(),
                version=1,
                event_ms=int(manifest["created_ms"]),
                shards=shards,
            )
    finally:
        r.close()
    return written


def held_out_line(training: dict, prefix: str = "") -> str:
    """The metrics ``train`` measured on its held-out part, in one line."""
    from inference.models.kinds import MODEL_KINDS, TIERED

    hr = training.get("hr_at_10_two_tower")
    return (
        prefix
        + (f"HR@10 two-tower {hr:.3f}, " if hr is not None else "")
        + f"AUC two-tower {training['auc_two_tower']:.3f}, "
        + ", ".join(
            f"{name.replace('wide_deep', 'wide&deep').replace('_', ' ')} "
            f"{training[f'auc_{name}']:.3f}"
            for name in (*MODEL_KINDS, TIERED)
            if training.get(f"auc_{name}") is not None
        )
    )


def train_on_log(args: argparse.Namespace, directory: Path, progress: ProgressLine) -> dict:
    """``freshrec train --log``: read, report bad rows, train, print the held-out metrics."""
    from dataclasses import replace

    from freshrec.app.options import read_log_from_args
    from inference.training.logtrain import LOG_CONFIG, train_from_log

    inter, items = read_log_from_args(args, args.log, progress)
    try:
        cfg = replace(
            LOG_CONFIG,
            tower_epochs=args.tower_epochs or LOG_CONFIG.tower_epochs,
            tower_share=args.tower_share,
            **rankers_option(args),
        )
        started = time.monotonic()
        manifest = train_from_log(
            inter, items, directory, progress.update, cfg, args.negatives, args.holdout
        )
    except ValueError as exc:
        raise SystemExit(f"freshrec train: {exc}") from None
    t = manifest["training"]
    progress.done(
        f"trained {manifest['version']} in {time.monotonic() - started:.0f}s on "
        f"{t['users']:,} users and {t['items']:,} items; held out (the last "
        f"{100 * args.holdout:g}% by time): " + held_out_line(t)
    )
    return manifest


def served_rankers(rankings=()) -> str:
    """The further ranking models the services will serve (``FRESHREC_RANKER``, and an
    experiment's variants' ``rankings``): what ``freshrec run`` and ``freshrec replay``
    train; ``freshrec train`` trains all of them."""
    from inference.settings import served_ranker
    from inference.training.rankers import rankers_for

    try:
        return rankers_for(served_ranker(load_environment()), rankings)
    except ValueError as exc:
        raise SystemExit(f"freshrec: {exc}") from None


def rankers_option(args: argparse.Namespace) -> dict:
    """``--rankers`` as a ``TrainConfig`` field (absent: the default, all of them)."""
    return {} if args.rankers is None else {"rankers": args.rankers}


def add_parser(sub) -> None:
    """``freshrec train`` and its options."""
    train = sub.add_parser(
        "train",
        help="offline training: starting embeddings and both ranking models, on the "
        "synthetic world or an interaction log (--log)",
    )
    add_world_options(train, items_option=False)
    train.add_argument(
        "--log",
        default=None,
        help="train on this interaction log (CSV, TSV or JSON Lines, gzipped or not) "
        "instead of the synthetic world; see docs/replay.md",
    )
    add_log_options(
        train,
        items_help="with --log: the item file (id, category or genres, price); without: "
        "the synthetic world's item count [env FRESHREC_WORLD_ITEMS; default 100000]",
    )
    train.add_argument(
        "--negatives",
        type=int,
        default=4,
        help="with --log: negatives drawn uniformly from the catalogue per interaction, "
        "for the ranking models (default 4)",
    )
    train.add_argument(
        "--holdout",
        type=float,
        default=0.1,
        help="with --log: the last share of the log, by time, held out and reported on "
        "(default 0.1)",
    )
    _add_model_options(train)
    train.add_argument(
        "--out",
        default=None,
        help="model directory [env FRESHREC_MODEL_DIR; default .freshrec/models]",
    )
    train.add_argument(
        "--load",
        choices=("auto", "yes", "no"),
        default="auto",
        help="write the starting embeddings to Redis (auto: if a stack is set)",
    )
    train.add_argument(
        "--if-missing",
        action="store_true",
        help="do nothing when the directory already holds models of this world "
        "trained with this configuration",
    )
    train.set_defaults(func=cmd_train)


def _add_model_options(train: argparse.ArgumentParser) -> None:
    """What the models learn from and how: the impressions logged, the two-tower model's
    penalty, share of the logs and epochs, and the further ranking models."""
    train.add_argument(
        "--impressions", type=int, default=1_000_000, help="logged impressions to train on"
    )
    train.add_argument(
        "--l2",
        type=float,
        default=2.0,
        help="two-tower L2 penalty (default 2.0; see docs/serving.md)",
    )
    train.add_argument(
        "--tower-share",
        type=float,
        default=1.0,
        help="share of the training logs for the two-tower model; the ranking "
        "models learn from the rest (1.0: both from all)",
    )
    train.add_argument(
        "--tower-epochs",
        type=int,
        default=None,
        help="two-tower epochs (default 3; with --log 10)",
    )
    train.add_argument(
        "--rankers",
        default=None,
        help="the further ranking models, comma-separated, '' for none (default: "
        "pruned,attention,attention_window,attention_lowrank; docs/serving.md)",
    )


def cmd_train(args: argparse.Namespace) -> int:
    from freshrec.app.options import world_from_args
    from inference.training.train import TrainConfig

    directory = model_dir(args.out)
    progress = ProgressLine()
    if args.log:
        manifest = train_on_log(args, directory, progress)
        return _finish_train(args, directory, manifest)
    if args.items_path is not None and not str(args.items_path).isdigit():
        raise SystemExit("freshrec train: --items is a file only with --log; here a count")
    args.items = int(args.items_path or WORLD_ITEMS.read(load_environment()))
    world = world_from_args(args)
    try:
        config = TrainConfig(
            impressions=args.impressions,
            l2=args.l2,
            tower_share=args.tower_share,
            tower_epochs=args.tower_epochs or 3,
            **rankers_option(args),
        )
    except ValueError as exc:
        raise SystemExit(f"freshrec train: {exc}") from None
    if args.if_missing:
        manifest = ensure_models(world, directory, config, progress)
    else:
        manifest = train_on_world(world, config, directory, progress.update)
        t = manifest["training"]
        progress.done(
            f"trained {manifest['version']}: "
            + held_out_line(t)
            + f" ({t['impressions']:,} impressions, {t['seconds']}s)"
        )
    return _finish_train(args, directory, manifest)


def _finish_train(args: argparse.Namespace, directory: Path, manifest: dict) -> int:
    from inference.models.modelfile import read_manifest

    print(f"models: {directory / 'manifest.json'} (version {read_manifest(directory)['version']})")
    load = args.load == "yes" or (
        args.load == "auto"
        and (external_services() or "KAFKA_BOOTSTRAP_SERVERS" in load_environment())
    )
    if load:
        n = load_starting_embeddings(connection(), directory, manifest)
        print(f"starting embeddings: {n:,} rows written to Redis (existing rows kept)")
    return 0
