"""``freshrec train``: the daily offline training of the seeds, on a log of labelled impressions.

1. The log (``TrainingLog``): impressions of catalogue items, each clicked or not, converted or
   not, with the user's device and region where known. The synthetic world's simulator
   writes one (``freshrec/sim/world.py``); so can anything else.
2. Two-tower embeddings: user and item rows (``dim + 1`` columns, the item bias last) fitted by
   logistic loss on the logs. These are the starting tables that online learning refines.
3. Wide&Deep on the logged pairs, with the trained rows and item features computed from the
   logs the way the streams app computes them live (smoothed CTR/CVR, hot score).
4. The light model, distilled from Wide&Deep (its logits as soft targets, plus the labels).

Everything is written as versioned safetensors with checksums and a manifest
(``inference/models/modelfile.py``). AUCs on a held-out tenth are recorded in the manifest; another
tenth decides when each ranking model stops training (its best epoch is kept).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

from freshcore import clock
from freshcore.settings import LEARNING_RATE
from inference.models.attention import SEQUENCE
from inference.models.coldstart import category_starts, known_category
from inference.models.features import CATEGORY_BUCKETS, DENSE
from inference.models.modelfile import save_model, save_tensors, write_manifest
from inference.models.ranking import LightRanker, WideDeep, as_tensors, half_copy
from inference.models.tiers import HEAD, MIDDLE, TAIL, HeatSplit, route, thresholds
from inference.training.fitting import (
    auc,
    fit_ranker,
    optimiser_step,
    predict,
    shuffled_batches,
)
from inference.training.logfeatures import (
    TrainingLog,
    category_buckets,
    covisit_scores,
    item_features,
    rank_inputs,
    recent_context,
)
from inference.training.rankers import RANKERS, Split, parse_rankers, train_rankers
from schemas.ids import row_ids
from schemas.rows import TABLE_ITEM, TABLE_USER, initial_rows

log = logging.getLogger("freshrec.train")
Progress = Callable[[str], None]


@dataclass(frozen=True)
class TrainConfig:
    impressions: int = 1_000_000
    dim: int = 64
    tower_epochs: int = 3
    tower_patience: int = 0
    """0: the two-tower trains ``tower_epochs`` epochs. Above 0 (the softmax two-tower):
    ``tower_epochs`` is a maximum; after each epoch the rows' HR@10 on the validation rows
    (``top_k_hits``) is measured, training stops once it has not improved for this many
    epochs, and the best epoch's rows are kept — the number of passes chosen on the training
    part, never on what a replay scores."""
    rank_epochs: int = 40
    """At most; each ranking model stops earlier once its validation loss has not improved for
    ``rank_patience`` epochs, and keeps its best epoch. (A fixed two epochs left the models
    undertrained: 36 Adam steps on the tests' 40k impressions, where the light model's held-out
    AUC was 0.43, and the recent-click feature weighed a quarter of what the logs support.)"""
    rank_patience: int = 3
    batch: int = 2048
    seed: int = 11
    conversion_weight: float = 3.0
    tower_lr: float = 0.1
    l2: float = 2.0
    """Per-example L2 on the rows a batch touches: most items are seen a few times in the logs,
    and weaker penalties let their rows memorise those labels (train AUC 0.99, test 0.58)."""
    tower_share: float = 1.0
    """Share of the training logs the two-tower model learns from; the ranking models learn
    from the rest (from all of them at 1.0). Below 1.0 the rankers see the tower's scores on
    impressions it did not fit, as serving does."""
    tower_loss: str = "logistic"
    """``logistic`` over labelled impressions (the synthetic world's logs), or ``softmax``
    over the clicked items of a batch and ``softmax_negatives`` items drawn uniformly from
    the catalogue (positive-only logs, ``freshrec train --log``; ``inference/learning/steps.py``
    says why), or ``softmax+logistic``: softmax first, then ``finetune_epochs`` of the
    logistic loss over every impression from those rows (impressions not clicked are
    negatives: what online learning on impressions learns)."""
    finetune_epochs: int = 2
    finetune_lr: float = 0.02
    """Adagrad's step size for the logistic fine-tune of ``softmax+logistic``."""
    softmax_negatives: int = 50
    softmax_l2: float = 1e-4
    softmax_lr: float = 0.01
    """Adam's step size for the softmax two-tower."""
    features: str = ",".join(DENSE)
    """The ranking models' dense inputs: models trained with others are trained again."""
    rankers: str = ",".join(RANKERS)
    """The further ranking models (``inference/training/rankers.py``): the pruned tier and the
    attention rankers; Wide&Deep and the light model always train."""
    prune_keep: float = 0.5
    """The share of each hidden layer's units the pruned model keeps."""
    sequence: int = SEQUENCE
    """Items of a user's history the attention rankers read."""
    cold_item_start: bool = True
    """Catalogue items with no positive interaction in the two-tower's part start from their
    category's mean learnt row (``inference/models/coldstart.py``) instead of a row that
    only sampled negatives moved."""

    def __post_init__(self) -> None:
        if min(self.impressions, self.dim, self.tower_epochs, self.rank_epochs, self.batch) < 1:
            raise ValueError("impressions, dim, epochs and batch must be at least 1")
        if not self.l2 >= 0:
            raise ValueError(f"l2 must be >= 0, got {self.l2}")
        if not 0 < self.tower_share <= 1:
            raise ValueError(f"tower_share must be in (0, 1], got {self.tower_share}")
        if self.tower_loss not in TOWER_LOSSES:
            raise ValueError(f"tower_loss must be one of {TOWER_LOSSES}, got {self.tower_loss!r}")
        parse_rankers(self.rankers)
        if not 0 < self.prune_keep < 1:
            raise ValueError(f"prune_keep must be in (0, 1), got {self.prune_keep}")
        if self.sequence < 1:
            raise ValueError(f"sequence must be at least 1, got {self.sequence}")
        if self.tower_patience < 0:
            raise ValueError(f"tower_patience must be at least 0, got {self.tower_patience}")


TOWER_LOSSES = ("logistic", "softmax", "softmax+logistic")


def train_two_tower(
    logs: TrainingLog,
    cfg: TrainConfig,
    train_idx: np.ndarray,
    progress: Progress,
    valid_idx: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(user numbers, user rows, item rows) for the users the log names and every catalogue
    item: rows start from the deterministic initialisation. ``valid_idx``: the rows that
    choose the softmax two-tower's epochs (``TrainConfig.tower_patience``)."""
    init = None
    if cfg.tower_loss.startswith("softmax"):
        trained = _train_two_tower_softmax(logs, cfg, train_idx, progress, valid_idx)
        if cfg.tower_loss == "softmax":
            return trained
        init = (trained[1][:, : cfg.dim], trained[2])
        cfg = replace(  # from trained rows: the softmax's light penalty, not the heavy one
            cfg, tower_epochs=cfg.finetune_epochs, tower_lr=cfg.finetune_lr, l2=cfg.softmax_l2
        )
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    uniq_users, user_pos = np.unique(logs.users, return_inverse=True)
    user_ids = row_ids(logs.user_ids[uniq_users].tolist())
    item_ids = row_ids(logs.item_ids.tolist())
    d = cfg.dim
    if init is None:
        init = (initial_rows(user_ids, TABLE_USER, d)[:, :d], initial_rows(item_ids, TABLE_ITEM, d))
    u_emb = nn.Parameter(torch.from_numpy(np.ascontiguousarray(init[0], np.float32).copy()))
    v_emb = nn.Parameter(torch.from_numpy(np.ascontiguousarray(init[1], np.float32).copy()))
    opt = torch.optim.Adagrad([u_emb, v_emb], lr=cfg.tower_lr)
    y = torch.from_numpy(logs.clicked.astype(np.float32))
    w = torch.from_numpy(np.where(logs.converted, cfg.conversion_weight, 1.0).astype(np.float32))
    up, it = torch.from_numpy(user_pos), torch.from_numpy(logs.items)
    steps = cfg.tower_epochs * -(-len(train_idx) // cfg.batch)
    step = 0
    for epoch in range(cfg.tower_epochs):
        for b in shuffled_batches(len(train_idx), cfg.batch, rng):
            idx = torch.from_numpy(train_idx[b])
            u, v = u_emb[up[idx]], v_emb[it[idx]]
            logit = (u * v[:, :d]).sum(1) + v[:, d]
            loss = nn.functional.binary_cross_entropy_with_logits(logit, y[idx], weight=w[idx])
            loss = loss + cfg.l2 * ((u * u).sum(1).mean() + (v * v).sum(1).mean())
            step = optimiser_step(
                opt, loss, step, progress, f"two-tower: epoch {epoch + 1}/{cfg.tower_epochs}", steps
            )
    users = np.concatenate([u_emb.detach().numpy(), np.ones((len(uniq_users), 1), np.float32)], 1)
    return uniq_users, users, v_emb.detach().numpy()


def _train_two_tower_softmax(
    logs: TrainingLog,
    cfg: TrainConfig,
    train_idx: np.ndarray,
    progress: Progress,
    valid_idx: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The clicked rows of ``train_idx``, in batches: each user's row against every clicked
    item of the batch (the others' are its negatives, popular items more often) and
    ``softmax_negatives`` items drawn uniformly from the catalogue, cross-entropy on its own
    item; Adam. Scores carry the item's bias (its last column), which learns popularity."""
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    uniq_users, user_pos = np.unique(logs.users, return_inverse=True)
    user_ids = row_ids(logs.user_ids[uniq_users].tolist())
    item_ids = row_ids(logs.item_ids.tolist())
    d, n_items = cfg.dim, len(item_ids)
    u_emb = nn.Parameter(torch.from_numpy(initial_rows(user_ids, TABLE_USER, d)[:, :d] * 0.1))
    v_emb = nn.Parameter(torch.from_numpy(initial_rows(item_ids, TABLE_ITEM, d) * 0.1))
    opt = torch.optim.Adam([u_emb, v_emb], lr=cfg.softmax_lr)
    positives = train_idx[logs.clicked[train_idx]]
    up, it = torch.from_numpy(user_pos), torch.from_numpy(logs.items)
    batch = min(cfg.batch, 512)
    steps = cfg.tower_epochs * -(-len(positives) // batch)
    step = 0
    ones = np.ones((len(uniq_users), 1), np.float32)

    def rows() -> tuple[np.ndarray, np.ndarray]:
        return np.concatenate([u_emb.detach().numpy(), ones], 1), v_emb.detach().numpy().copy()

    stopping = cfg.tower_patience > 0 and valid_idx is not None and len(valid_idx) > 0
    best: tuple[float, int, tuple[np.ndarray, np.ndarray]] | None = None
    for epoch in range(cfg.tower_epochs):
        for b in shuffled_batches(len(positives), batch, rng):
            idx = torch.from_numpy(positives[b])
            u, pos = u_emb[up[idx]], it[idx]
            neg = torch.from_numpy(rng.integers(0, n_items, cfg.softmax_negatives))
            cand = torch.cat([pos, neg])
            v = v_emb[cand]
            logits = u @ v[:, :d].T + v[:, d]
            loss = nn.functional.cross_entropy(logits, torch.arange(len(b)))
            loss = loss + cfg.softmax_l2 * ((u * u).sum(1).mean() + (v * v).sum(1).mean())
            step = optimiser_step(
                opt, loss, step, progress, f"two-tower: epoch {epoch + 1}/{cfg.tower_epochs}", steps
            )
        if not stopping:
            continue
        now = rows()
        hr = top_k_hits(logs, valid_idx, train_idx, user_pos, *now, sample=5000)
        if hr is None:
            stopping = False
            continue
        progress(f"two-tower: epoch {epoch + 1}, validation HR@10 {hr:.4f}")
        if best is None or hr > best[0]:
            best = (hr, epoch, now)
        elif epoch - best[1] >= cfg.tower_patience:
            break
    users, items = rows() if best is None else best[2]
    return uniq_users, users, items


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


def top_k_hits(
    logs: TrainingLog,
    test_idx: np.ndarray,
    train_idx: np.ndarray,
    user_pos: np.ndarray,
    user_rows: np.ndarray,
    item_rows: np.ndarray,
    k: int = 10,
    sample: int = 2000,
) -> float | None:
    """HR@k of the two-tower on the held-out clicks: each user's k best items by u·v (bias
    included) among those they did not click in training. At most ``sample`` clicks."""
    clicks = test_idx[logs.clicked[test_idx]]
    if logs.sampled is not None:
        clicks = clicks[~logs.sampled[clicks]]
    if len(clicks) == 0:
        return None
    clicks = clicks[:sample]
    seen: dict[int, set[int]] = {}
    for j in train_idx[logs.clicked[train_idx]].tolist():
        seen.setdefault(int(logs.users[j]), set()).add(int(logs.items[j]))
    scores = user_rows[user_pos[clicks]] @ item_rows.T
    hits = 0
    for row, j in enumerate(clicks.tolist()):
        s = scores[row]
        for i in seen.get(int(logs.users[j]), ()):
            s[i] = -np.inf
        top = np.argpartition(-s, min(k, len(s) - 1))[:k]
        hits += int(logs.items[j]) in set(top.tolist())
    return round(hits / len(clicks), 4)


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
    n = len(logs.users)
    train_idx, valid_idx, test_idx = random_split(n, rng) if split is None else split
    tower_idx, rank_idx = train_idx, train_idx
    if cfg.tower_share < 1:
        cut = rng.random(len(train_idx)) < cfg.tower_share
        tower_idx, rank_idx = train_idx[cut], train_idx[~cut]
    uniq_users, user_rows, item_rows = train_two_tower(logs, cfg, tower_idx, progress, valid_idx)
    cold_started = 0
    if cfg.cold_item_start:
        item_rows, cold_started = start_cold_items(logs, tower_idx, item_rows, cfg.dim)
    user_pos = np.searchsorted(uniq_users, logs.users)
    feats = item_features(logs, train_idx)
    tower_scores = np.einsum(
        "ij,ij->i", user_rows[user_pos[test_idx]], item_rows[logs.items[test_idx]]
    )
    shares, recent_items = recent_context(logs, category_buckets(logs), cfg.sequence)
    progress("co-visitation of the log's clicks")
    recent = (shares, recent_items, covisit_scores(logs, recent_items))
    args = (user_rows, user_pos, item_rows, feats, recent)
    x_train = rank_inputs(logs, rank_idx, *args)
    x_valid = rank_inputs(logs, valid_idx, *args)
    x_test = rank_inputs(logs, test_idx, *args)
    y = logs.clicked.astype(np.float32)
    w = np.where(logs.converted, cfg.conversion_weight, 1.0).astype(np.float32)
    t_train, t_valid, t_test = (
        as_tensors(x, torch.device("cpu")) for x in (x_train, x_valid, x_test)
    )
    torch.manual_seed(cfg.seed)
    full = WideDeep(cfg.dim)
    fits = {
        "wide_deep": fit_ranker(
            full,
            (t_train, y[rank_idx], w[rank_idx], None),
            (t_valid, y[valid_idx], w[valid_idx], None),
            cfg,
            rng,
            progress,
            "wide&deep",
        )
    }
    full_logits = [predict(full, t) for t in (t_train, t_valid, t_test)]
    light = LightRanker(cfg.dim)
    fits["light"] = fit_ranker(
        light,
        (t_train, y[rank_idx], w[rank_idx], full_logits[0]),
        (t_valid, y[valid_idx], w[valid_idx], full_logits[1]),
        cfg,
        rng,
        progress,
        "light",
    )
    parts = tuple(
        Split(t, y[i], w[i], recent[1][i, : cfg.sequence], logits)
        for t, i, logits in zip(
            (t_train, t_valid, t_test), (rank_idx, valid_idx, test_idx), full_logits, strict=True
        )
    )
    light_test = predict(light, t_test)
    more = train_rankers(parse_rankers(cfg.rankers), full, parts, item_rows, cfg, rng, progress)
    for name, got in more.items():
        fits[name] = got["fit"]
    metrics = {
        "hr_at_10_two_tower": top_k_hits(logs, test_idx, tower_idx, user_pos, user_rows, item_rows),
        "auc_two_tower": auc(y[test_idx], tower_scores),
        "auc_wide_deep": auc(y[test_idx], full_logits[2]),
        "auc_light": auc(y[test_idx], light_test),
        # the same models with their weights held in float16 (FRESHREC_RANKING_DTYPE)
        "auc_wide_deep_float16": auc(y[test_idx], predict(half_copy(full), t_test)),
        "auc_light_float16": auc(y[test_idx], predict(half_copy(light), t_test)),
        **{f"auc_{name}": got["auc"] for name, got in more.items()},
        **(
            tiered_auc(logs, test_idx, feats, y, (full_logits[2], more["pruned"], light_test))
            if "pruned" in more
            else {}
        ),
        "impressions": int(n),
        "tower_impressions": len(tower_idx),
        "ranking_impressions": len(rank_idx),
        "click_rate": float(y.mean()),
        "users": len(uniq_users),
        "items": len(logs.item_ids),
        "cold_items_started": cold_started,
        "ranking_fits": fits,
        "seconds": round(time.monotonic() - started, 1),
    }
    version = (
        time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        + "-"
        + hashlib.sha256(json.dumps(metrics, sort_keys=True).encode()).hexdigest()[:6]
    )
    user_ids = row_ids(logs.user_ids[uniq_users].tolist())
    item_ids = row_ids(logs.item_ids.tolist())
    files = {
        "wide_deep": save_model(out_dir, full, version, cfg.dim),
        "light": save_model(out_dir, light, version, cfg.dim),
        **{name: save_model(out_dir, got["model"], version, cfg.dim) for name, got in more.items()},
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
        "files": files,
        **({"online": ONLINE_SOFTMAX} if cfg.tower_loss == "softmax" else {}),
        "training": {**metrics, "config": asdict(cfg)},
    }
    write_manifest(out_dir, manifest)
    return manifest
