"""``freshrec train``: the daily offline training of the seeds, on a log of labelled impressions.

1. The log (``TrainingLog``): impressions of catalogue items, each clicked or not, converted or
   not, with the user's device and region where known. The synthetic world's simulator
   writes one (``freshrec/sim/world.py``); so can anything else.
2. Two-tower embeddings (``twotower.py``): user and item rows (``dim + 1`` columns, the item
   bias last) fitted on the logs. These are the starting tables that online learning refines.
3. Wide&Deep on the logged pairs, with the trained rows and item features computed from the
   logs the way the streams app computes them live (smoothed CTR/CVR, hot score).
4. The light model, distilled from Wide&Deep (its logits as soft targets, plus the labels).

Everything is written as versioned safetensors with checksums and a manifest
(``inference/models/modelfile.py``). AUCs on a held-out tenth are recorded in the manifest; another
tenth decides when each ranking model stops training (its best epoch is kept). What a
training is told is a ``TrainConfig`` (``config.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from freshcore import clock
from freshcore.settings import LEARNING_RATE
from inference.models.coldstart import category_starts, known_category
from inference.models.features import CATEGORY_BUCKETS, DENSE
from inference.models.modelfile import save_model, save_tensors, write_manifest
from inference.models.ranking import LightRanker, WideDeep, as_tensors, half_copy
from inference.models.tiers import HEAD, MIDDLE, TAIL, HeatSplit, route, thresholds
from inference.training.config import TrainConfig
from inference.training.fitting import auc, fit_ranker, predict
from inference.training.logfeatures import (
    TrainingLog,
    category_buckets,
    covisit_scores,
    item_features,
    rank_inputs,
    recent_context,
    sequel_scores,
)
from inference.training.rankers import Split, parse_rankers, train_rankers
from inference.training.twotower import top_k_hits, train_two_tower
from schemas.ids import row_ids
from schemas.rows import TABLE_ITEM, initial_rows

log = logging.getLogger("freshrec.train")
Progress = Callable[[str], None]


ONLINE_SOFTMAX = {
    "loss": "softmax",
    "user_lr": 0.5,
    "item_lr": LEARNING_RATE,
    "sampled_negatives": 10,
    "global_user_lr": 0.5,
    "adagrad_initial_accumulator": 1.0,
}
"""Online learning that suits rows trained by the softmax two-tower (the manifest's
``online``, which the worker and the parameter server follow unless their settings say
otherwise). Users step ten times further than items: a user's row is moved by that user's
events alone. The parameter server's Adagrad starts its accumulators at 1, so that a row's
first steps are lr·g, as the worker's, instead of lr·sign(g) — a sampled negative's tiny
gradient otherwise moved its row as far as a clicked item's. Chosen by the replay on
MovieLens 100K and Last.fm (``docs/benchmarks.md``, the learner's table)."""


def tiered_auc(logs, test_idx, feats, y, tier_models) -> dict:
    """The pruned model's sparsity, and the held-out AUC of ranking by item heat
    (``inference/models/tiers.py``, default shares): each impression scored by its item's tier's
    model, the heat the training split's. ``tier_models``: Wide&Deep's test logits, the
    pruned model's entry of ``train_rankers``, the light model's test logits."""
    full, pruned, light = tier_models
    cut = thresholds(feats[:, 3], HeatSplit())
    tiers = route(feats[logs.items[test_idx], 3], cut)
    mixed = np.select([tiers == HEAD, tiers == MIDDLE], [full, pruned["test_logits"]], light)
    return {
        "pruned_sparsity": pruned["sparsity"],
        "auc_tiered": auc(y[test_idx], mixed),
        "tiered_shares": [round(float((tiers == t).mean()), 4) for t in (HEAD, MIDDLE, TAIL)],
    }


def random_split(n: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """(train, valid, test): a tenth held out for the reported metrics, a tenth to stop on."""
    split = rng.random(n)
    return (
        np.flatnonzero(split >= 0.2),
        np.flatnonzero(split < 0.1),
        np.flatnonzero((split >= 0.1) & (split < 0.2)),
    )


def start_cold_items(
    logs: TrainingLog, idx: np.ndarray, item_rows: np.ndarray, dim: int
) -> tuple[np.ndarray, int]:
    """The item rows with those of items no interaction of ``idx`` clicked started from their
    category's mean row (``category_starts``; items of no known category keep theirs), and
    how many were."""
    positive = np.zeros(len(logs.item_ids), bool)
    positive[logs.items[idx][logs.clicked[idx]]] = True
    category = category_buckets(logs)
    known = np.array([known_category(c) for c in logs.item_category.tolist()], bool)
    category[~known] = -1
    jitter = initial_rows(row_ids(logs.item_ids.tolist()), TABLE_ITEM, dim)
    rows, changed = category_starts(
        torch.from_numpy(item_rows),
        torch.from_numpy(category),
        torch.from_numpy(positive),
        torch.from_numpy(jitter),
        CATEGORY_BUCKETS,
    )
    return rows.numpy(), int(changed.sum())


class Rows(NamedTuple):
    """Which rows of the log each part of the training reads."""

    train: np.ndarray
    valid: np.ndarray
    """The rows that decide when each ranking model stops (and the softmax two-tower's epochs)."""
    test: np.ndarray
    """The rows the reported metrics are measured on."""
    tower: np.ndarray
    """The training rows the two-tower model learns from."""
    rank: np.ndarray
    """The training rows the ranking models learn from (all of them at ``tower_share`` 1)."""

    def ranking(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rows the ranking models learn from, stop on and are tested on."""
        return self.rank, self.valid, self.test


def split_rows(
    n: int,
    cfg: TrainConfig,
    rng: np.random.Generator,
    split: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> Rows:
    """The parts of a log of ``n`` rows: ``split``'s (train, valid, test), else drawn by
    ``rng``; the training rows shared between the two-tower and the rankers by
    ``cfg.tower_share``."""
    train_idx, valid_idx, test_idx = random_split(n, rng) if split is None else split
    tower_idx, rank_idx = train_idx, train_idx
    if cfg.tower_share < 1:
        cut = rng.random(len(train_idx)) < cfg.tower_share
        tower_idx, rank_idx = train_idx[cut], train_idx[~cut]
    return Rows(train_idx, valid_idx, test_idx, tower_idx, rank_idx)


def train(
    logs: TrainingLog,
    cfg: TrainConfig,
    out_dir: Path,
    progress: Progress,
    rng: np.random.Generator | None = None,
    split: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> dict:
    """Train everything on ``logs`` and write the files and manifest; returns the manifest.
    ``split``: the (train, valid, test) rows (default: drawn at random by ``rng``, seeded by
    ``cfg.seed``); valid decides when the ranking models stop, test is reported."""
    started = time.monotonic()
    rng = np.random.default_rng(cfg.seed) if rng is None else rng
    rows = split_rows(len(logs.users), cfg, rng, split)
    uniq_users, user_rows, item_rows = train_two_tower(logs, cfg, rows.tower, progress, rows.valid)
    cold_started = 0
    if cfg.cold_item_start:
        item_rows, cold_started = start_cold_items(logs, rows.tower, item_rows, cfg.dim)
    user_pos = np.searchsorted(uniq_users, logs.users)
    feats = item_features(logs, rows.train)
    args = (user_rows, user_pos, item_rows, feats)
    tensors, recent_items = ranking_inputs(logs, cfg, rows, args, progress)
    y = logs.clicked.astype(np.float32)
    w = np.where(logs.converted, cfg.conversion_weight, 1.0).astype(np.float32)
    full, light, fits, full_logits = fit_main_rankers(tensors, y, w, rows, cfg, rng, progress)
    light_test = predict(light, tensors[2])
    parts = tuple(
        Split(t, y[i], w[i], recent_items[i, : cfg.sequence], logits)
        for t, i, logits in zip(tensors, rows.ranking(), full_logits, strict=True)
    )
    more = train_rankers(parse_rankers(cfg.rankers), full, parts, item_rows, cfg, rng, progress)
    fits.update({name: got["fit"] for name, got in more.items()})
    test_logits = {"wide_deep": full_logits[2], "light": light_test}
    test_users, test_items = user_rows[user_pos[rows.test]], item_rows[logs.items[rows.test]]
    y_test = y[rows.test]
    metrics = {
        "hr_at_10_two_tower": top_k_hits(
            logs, rows.test, rows.tower, user_pos, user_rows, item_rows
        ),
        "auc_two_tower": auc(y_test, np.einsum("ij,ij->i", test_users, test_items)),
        **ranking_aucs(y_test, tensors[2], {"wide_deep": full, "light": light}, test_logits, more),
        **(
            tiered_auc(logs, rows.test, feats, y, (full_logits[2], more["pruned"], light_test))
            if "pruned" in more
            else {}
        ),
        "impressions": len(logs.users),
        "tower_impressions": len(rows.tower),
        "ranking_impressions": len(rows.rank),
        "click_rate": float(y.mean()),
        "users": len(uniq_users),
        "items": len(logs.item_ids),
        "cold_items_started": cold_started,
        "ranking_fits": fits,
        "seconds": round(time.monotonic() - started, 1),
    }
    models = {"wide_deep": full, "light": light, **{n: got["model"] for n, got in more.items()}}
    two_tower = (row_ids(logs.user_ids[uniq_users].tolist()), user_rows, item_rows)
    return write_models(out_dir, logs, cfg, metrics, models, two_tower)


def ranking_aucs(y_test, test_inputs, models: dict, test_logits: dict, more: dict) -> dict:
    """The held-out AUC of Wide&Deep and the light model (``models``, their ``test_logits``),
    and of each as it serves with its weights held in float16 (``FRESHREC_RANKING_DTYPE``),
    then of the further rankers (``train_rankers``'s ``more``)."""
    out = {f"auc_{kind}": auc(y_test, test_logits[kind]) for kind in models}
    for kind, model in models.items():
        out[f"auc_{kind}_float16"] = auc(y_test, predict(half_copy(model), test_inputs))
    return {**out, **{f"auc_{name}": got["auc"] for name, got in more.items()}}


def ranking_inputs(logs: TrainingLog, cfg: TrainConfig, rows: Rows, args: tuple, progress):
    """The ranking models' inputs on the ranking, valid and test rows, and each impression's
    recent items (newest first). ``args``: the user rows, each impression's user's position
    among them, the item rows and the items' features; the recent context (the category
    share, the items, their co-visitation and sequential-rule scores) is computed here."""
    shares, recent_items = recent_context(logs, category_buckets(logs), cfg.sequence)
    progress("co-visitation and sequential rules of the log's clicks")
    neighbours = covisit_scores(logs, recent_items), sequel_scores(logs, recent_items)
    recent = (shares, recent_items, *neighbours)
    tensors = tuple(
        as_tensors(rank_inputs(logs, idx, *args, recent), torch.device("cpu"))
        for idx in rows.ranking()
    )
    return tensors, recent_items


def fit_main_rankers(tensors, y, w, rows: Rows, cfg: TrainConfig, rng, progress: Progress):
    """Wide&Deep on the ranking rows, then the light model distilled from it (its logits as
    soft targets, with the labels). ``tensors``: the ranking, valid and test rows' inputs.
    Returns both models, their fits and Wide&Deep's logits on each of the three parts."""
    train_t, valid_t, _ = tensors
    rank_idx, valid_idx = rows.rank, rows.valid
    torch.manual_seed(cfg.seed)
    full = WideDeep(cfg.dim)
    fits = {
        "wide_deep": fit_ranker(
            full,
            (train_t, y[rank_idx], w[rank_idx], None),
            (valid_t, y[valid_idx], w[valid_idx], None),
            cfg,
            rng,
            progress,
            "wide&deep",
        )
    }
    full_logits = [predict(full, t) for t in tensors]
    light = LightRanker(cfg.dim)
    fits["light"] = fit_ranker(
        light,
        (train_t, y[rank_idx], w[rank_idx], full_logits[0]),
        (valid_t, y[valid_idx], w[valid_idx], full_logits[1]),
        cfg,
        rng,
        progress,
        "light",
    )
    return full, light, fits, full_logits


def write_models(
    out_dir: Path,
    logs: TrainingLog,
    cfg: TrainConfig,
    metrics: dict,
    models: dict[str, nn.Module],
    two_tower: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> dict:
    """Write the ranking ``models`` and the two-tower rows (user ids, user rows, item rows)
    under a version named by the time and the metrics, then the manifest; returns it."""
    version = (
        time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        + "-"
        + hashlib.sha256(json.dumps(metrics, sort_keys=True).encode()).hexdigest()[:6]
    )
    user_ids, user_rows, item_rows = two_tower
    item_ids = row_ids(logs.item_ids.tolist())
    files = {
        **{name: save_model(out_dir, model, version, cfg.dim) for name, model in models.items()},
        "two_tower": save_tensors(
            out_dir,
            f"two_tower-{version}.safetensors",
            {
                "user_ids": torch.from_numpy(user_ids),
                "user_rows": torch.from_numpy(user_rows),
                "item_ids": torch.from_numpy(item_ids),
                "item_rows": torch.from_numpy(item_rows),
            },
            {"kind": "two_tower", "version": version, "dim": cfg.dim},
        ),
    }
    manifest = {
        "version": version,
        "dim": cfg.dim,
        "created_ms": clock.now_ms(),
        "source": logs.source,
        "features": list(DENSE),
        "files": files,
        **({"online": ONLINE_SOFTMAX} if cfg.tower_loss == "softmax" else {}),
        "training": {**metrics, "config": asdict(cfg)},
    }
    write_manifest(out_dir, manifest)
    return manifest
