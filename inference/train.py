"""``freshrec train``: the daily offline training of the seeds, on a log of labelled impressions.

1. The log (``TrainingLog``): impressions of catalogue items, each clicked or not, converted or
   not, with the user's device and region where known. The synthetic world's simulator
   writes one (``tools/world.py``); so can anything else.
2. Two-tower embeddings: user and item rows (``dim + 1`` columns, the item bias last) fitted by
   logistic loss on the logs. These are the starting tables that online learning refines.
3. Wide&Deep on the logged pairs, with the trained rows and item features computed from the
   logs the way the streams app computes them live (smoothed CTR/CVR, hot score).
4. The light model, distilled from Wide&Deep (its logits as soft targets, plus the labels).

Everything is written as versioned safetensors with checksums and a manifest
(``inference/modelfile.py``). AUCs on a held-out tenth are recorded in the manifest; another
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

from freshrec.hotscore import HotWeights, Smoothing, hot_scores, price_norm, smoothed_rate
from inference.features import (
    CATEGORY_BUCKETS,
    DENSE,
    RECENT,
    RECENT_DECAY,
    FeatureEncoder,
    RankInputs,
    bucket,
)
from inference.modelfile import save_model, save_tensors, write_manifest
from inference.ranking import LightRanker, WideDeep, as_tensors
from schemas.ids import row_ids
from schemas.records import DEVICE_CLASSES
from schemas.rows import TABLE_ITEM, TABLE_USER, initial_rows

log = logging.getLogger("freshrec.train")
Progress = Callable[[str], None]


@dataclass(frozen=True)
class TrainConfig:
    impressions: int = 1_000_000
    dim: int = 64
    tower_epochs: int = 3
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
    the catalogue (positive-only logs, ``freshrec train --log``; ``inference/learning.py``
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

    def __post_init__(self) -> None:
        if min(self.impressions, self.dim, self.tower_epochs, self.rank_epochs, self.batch) < 1:
            raise ValueError("impressions, dim, epochs and batch must be at least 1")
        if not self.l2 >= 0:
            raise ValueError(f"l2 must be >= 0, got {self.l2}")
        if not 0 < self.tower_share <= 1:
            raise ValueError(f"tower_share must be in (0, 1], got {self.tower_share}")
        if self.tower_loss not in TOWER_LOSSES:
            raise ValueError(f"tower_loss must be one of {TOWER_LOSSES}, got {self.tower_loss!r}")


TOWER_LOSSES = ("logistic", "softmax", "softmax+logistic")


@dataclass
class TrainingLog:
    """Labelled impressions of catalogue items: what offline training learns from, whoever
    wrote it. Users and items are numbered (``users[j]`` indexes ``user_ids``, ``items[j]``
    indexes ``item_ids``); per impression its event time, whether it was clicked and
    converted, and the user's device class (index into ``DEVICE_CLASSES``, -1 unknown) and
    region (None unknown)."""

    user_ids: np.ndarray
    """Distinct user ids (str)."""
    item_ids: np.ndarray
    """The catalogue's item ids (str), in catalogue order."""
    item_category: np.ndarray
    """Per item: its category name (str, or None when unknown)."""
    item_price: np.ndarray
    """Per item: its price (0 when unknown)."""
    users: np.ndarray
    items: np.ndarray
    t_ms: np.ndarray
    clicked: np.ndarray
    converted: np.ndarray
    device: np.ndarray
    region: np.ndarray
    source: str = ""
    """What the log came from (recorded in the manifest; models are reused for the same
    source and configuration)."""
    sampled: np.ndarray | None = None
    """Per row: a negative drawn by the trainer, not a logged impression (positive-only logs,
    ``inference/logtrain.py``). Such rows count as no impression in the item features, as
    nothing counts them live."""

    def __len__(self) -> int:
        return len(self.users)


def item_features(log: TrainingLog, idx: np.ndarray) -> np.ndarray:
    """(n_items, 4) [price, ctr, cvr, hot] from the impressions at ``idx`` (the training split:
    the held-out labels must not leak into features), as the streams app computes them live."""
    n = len(log.item_ids)
    if log.sampled is not None:  # positive-only: no impression logged, none counted live
        idx = idx[~log.sampled[idx]]
        imp = np.zeros(n)
    else:
        imp = np.bincount(log.items[idx], minlength=n).astype(np.float64)
    items = log.items[idx]
    clk = np.bincount(items, weights=log.clicked[idx], minlength=n)
    conv = np.bincount(items, weights=log.converted[idx], minlength=n)
    s = Smoothing()
    ctr = smoothed_rate(clk, imp, s.ctr_prior, s.ctr_strength)
    cvr = smoothed_rate(conv, clk, s.cvr_prior, s.cvr_strength)
    price = np.asarray(log.item_price, np.float64)
    hot = hot_scores(clk, cvr, price_norm(price), HotWeights())
    return np.column_stack([price, ctr, cvr, hot]).astype(np.float32)


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve by ranks (ties averaged)."""
    labels = labels.astype(bool)
    pos, neg = int(labels.sum()), int((~labels).sum())
    if pos == 0 or neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg = first + (counts - 1) / 2.0 + 1
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def _step(opt, loss, step: int, progress: Progress, what: str, steps: int) -> int:
    """One optimiser step; the progress line every 20."""
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    if step % 20 == 0:
        progress(f"{what}, step {step}/{steps}, loss {loss.item():.4f}")
    return step


def _batches(n: int, size: int, rng: np.random.Generator):
    order = rng.permutation(n)
    for lo in range(0, n, size):
        yield order[lo : lo + size]


def train_two_tower(
    logs: TrainingLog, cfg: TrainConfig, train_idx: np.ndarray, progress: Progress
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(user numbers, user rows, item rows) for the users the log names and every catalogue
    item: rows start from the deterministic initialisation."""
    init = None
    if cfg.tower_loss.startswith("softmax"):
        trained = _train_two_tower_softmax(logs, cfg, train_idx, progress)
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
        for b in _batches(len(train_idx), cfg.batch, rng):
            idx = torch.from_numpy(train_idx[b])
            u, v = u_emb[up[idx]], v_emb[it[idx]]
            logit = (u * v[:, :d]).sum(1) + v[:, d]
            loss = nn.functional.binary_cross_entropy_with_logits(logit, y[idx], weight=w[idx])
            loss = loss + cfg.l2 * ((u * u).sum(1).mean() + (v * v).sum(1).mean())
            step = _step(
                opt, loss, step, progress, f"two-tower: epoch {epoch + 1}/{cfg.tower_epochs}", steps
            )
    users = np.concatenate([u_emb.detach().numpy(), np.ones((len(uniq_users), 1), np.float32)], 1)
    return uniq_users, users, v_emb.detach().numpy()


def _train_two_tower_softmax(
    logs: TrainingLog, cfg: TrainConfig, train_idx: np.ndarray, progress: Progress
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
    for epoch in range(cfg.tower_epochs):
        for b in _batches(len(positives), batch, rng):
            idx = torch.from_numpy(positives[b])
            u, pos = u_emb[up[idx]], it[idx]
            neg = torch.from_numpy(rng.integers(0, n_items, cfg.softmax_negatives))
            cand = torch.cat([pos, neg])
            v = v_emb[cand]
            logits = u @ v[:, :d].T + v[:, d]
            loss = nn.functional.cross_entropy(logits, torch.arange(len(b)))
            loss = loss + cfg.softmax_l2 * ((u * u).sum(1).mean() + (v * v).sum(1).mean())
            step = _step(
                opt, loss, step, progress, f"two-tower: epoch {epoch + 1}/{cfg.tower_epochs}", steps
            )
    users = np.concatenate([u_emb.detach().numpy(), np.ones((len(uniq_users), 1), np.float32)], 1)
    return uniq_users, users, v_emb.detach().numpy()


def recent_context(logs: TrainingLog, cats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per impression, the real-time features' inputs as serving sees them: the share of the
    user's previous ``RECENT`` clicks (in time order, in the logs) in the impressed item's
    category, and those clicked items, newest first ((n, RECENT) item numbers, -1 padding;
    a re-clicked item counts once, where it was clicked last, as the worker keeps them)."""
    order = np.lexsort((logs.t_ms, logs.users))
    shares = np.zeros(len(order), np.float32)
    recent_items = np.full((len(order), RECENT), -1, np.int64)
    item_cat = cats[logs.items]
    last_user = -1
    recent: list[int] = []
    slate_t = -1
    pending: list[int] = []
    for j in order.tolist():
        u = int(logs.users[j])
        if u != last_user:
            last_user, recent, pending, slate_t = u, [], [], -1
        t = int(logs.t_ms[j])
        if t != slate_t:  # clicks of one slate are known after it, not during it
            merged = pending[::-1] + recent
            recent = list(dict.fromkeys(merged))[:RECENT]
            pending, slate_t = [], t
        if recent:
            c = item_cat[j]
            shares[j] = sum(1 for r in recent if cats[r] == c) / len(recent)
            recent_items[j, : len(recent)] = recent
        if logs.clicked[j]:
            pending.append(int(logs.items[j]))
    return shares, recent_items


def recent_similarities(
    recent_items: np.ndarray, items: np.ndarray, item_rows: np.ndarray, dim: int
) -> np.ndarray:
    """``features.recent_similarity`` of each (impressed item, recent items) row, in chunks."""
    out = np.zeros(len(items), np.float32)
    decay = RECENT_DECAY ** np.arange(recent_items.shape[1], dtype=np.float32)
    for lo in range(0, len(items), 50_000):
        idx = recent_items[lo : lo + 50_000]
        valid = idx >= 0
        w = np.where(valid, decay, 0.0)
        total = w.sum(1, keepdims=True)
        w = np.divide(w, total, out=np.zeros_like(w), where=total > 0)
        q = np.einsum("nr,nrd->nd", w, item_rows[np.maximum(idx, 0), :dim])
        out[lo : lo + 50_000] = (q * item_rows[items[lo : lo + 50_000], :dim]).sum(1)
    return out


def rank_inputs(
    logs: TrainingLog, idx: np.ndarray, user_rows, user_pos, item_rows, feats, recent
) -> RankInputs:
    shares, recent_items = recent
    enc = FeatureEncoder()
    items = logs.items[idx]
    device = logs.device[idx]
    ctx = enc.context(
        [DEVICE_CLASSES[d] if d >= 0 else None for d in device.tolist()],
        logs.region[idx].tolist(),
        logs.t_ms[idx].tolist(),
    )
    cats = category_buckets(logs)[items]
    sims = recent_similarities(recent_items[idx], items, item_rows, item_rows.shape[1] - 1)
    return enc.encode(
        user_rows[user_pos[idx]],
        item_rows[items],
        feats[items],
        cats,
        ctx,
        shares[idx],
        recent_similarity=sims,
    )


def category_buckets(logs: TrainingLog) -> np.ndarray:
    """Per catalogue item, its category's bucket (as serving computes it from the catalogue)."""
    names = {c: bucket(c, CATEGORY_BUCKETS) for c in set(logs.item_category.tolist())}
    return np.array([names[c] for c in logs.item_category.tolist()], np.int64)


def _loss(logit, y, w, soft=None):
    loss = nn.functional.binary_cross_entropy_with_logits(logit, y, weight=w)
    if soft is not None:
        loss = 0.5 * loss + 0.5 * nn.functional.mse_loss(logit, soft)
    return loss


def _from_numpy(a: np.ndarray | None) -> torch.Tensor | None:
    return None if a is None else torch.from_numpy(a)


def _fit(model, data, valid, cfg, rng, progress, label) -> dict:
    """Adam on shuffled mini-batches, epoch after epoch, until the loss on ``valid`` has not
    improved for ``cfg.rank_patience`` epochs (``cfg.rank_epochs`` at most); the weights of the
    best epoch are kept. ``data`` and ``valid`` are (the model's input tensors, targets,
    weights, soft targets or None). Returns the epochs run, the best epoch and its validation
    loss."""
    if cfg.rank_epochs < 1:
        raise ValueError(f"rank_epochs must be at least 1, got {cfg.rank_epochs}")
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    tensors, y, w, soft = data[0], *map(_from_numpy, data[1:])
    v_tensors, v_y, v_w, v_soft = valid[0], *map(_from_numpy, valid[1:])
    per_epoch = -(-len(y) // cfg.batch)
    best, best_epoch, best_state = float("inf"), 0, None
    step = epoch = 0
    for epoch in range(1, cfg.rank_epochs + 1):
        model.train()
        what = f"{label}: epoch {epoch} (at most {cfg.rank_epochs})"
        for b in _batches(len(y), cfg.batch, rng):
            bt = torch.from_numpy(b)
            logit = model(*(t[bt] for t in tensors))
            loss = _loss(logit, y[bt], w[bt], None if soft is None else soft[bt])
            step = _step(opt, loss, step, progress, what, cfg.rank_epochs * per_epoch)
        model.eval()
        with torch.inference_mode():
            v_loss = float(_loss(model(*v_tensors), v_y, v_w, v_soft))
        progress(f"{what}: validation loss {v_loss:.4f} (best {min(best, v_loss):.4f})")
        if v_loss < best:
            best, best_epoch = v_loss, epoch
            best_state = {k: t.detach().clone() for k, t in model.state_dict().items()}
        elif epoch - best_epoch >= cfg.rank_patience:
            break
    model.load_state_dict(best_state)
    model.eval()
    return {"epochs": epoch, "best_epoch": best_epoch, "validation_loss": round(best, 5)}


@torch.inference_mode()
def _logits(model, inputs: RankInputs) -> np.ndarray:
    return model(*as_tensors(inputs, torch.device("cpu"))).numpy()


ONLINE_SOFTMAX = {
    "loss": "softmax",
    "user_lr": 0.5,
    "item_lr": 0.05,
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


def random_split(n: int, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """(train, valid, test): a tenth held out for the reported metrics, a tenth to stop on."""
    split = rng.random(n)
    return (
        np.flatnonzero(split >= 0.2),
        np.flatnonzero(split < 0.1),
        np.flatnonzero((split >= 0.1) & (split < 0.2)),
    )


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
    uniq_users, user_rows, item_rows = train_two_tower(logs, cfg, tower_idx, progress)
    user_pos = np.searchsorted(uniq_users, logs.users)
    feats = item_features(logs, train_idx)
    tower_scores = np.einsum(
        "ij,ij->i", user_rows[user_pos[test_idx]], item_rows[logs.items[test_idx]]
    )
    recent = recent_context(logs, category_buckets(logs))
    args = (user_rows, user_pos, item_rows, feats, recent)
    x_train = rank_inputs(logs, rank_idx, *args)
    x_valid = rank_inputs(logs, valid_idx, *args)
    x_test = rank_inputs(logs, test_idx, *args)
    y = logs.clicked.astype(np.float32)
    w = np.where(logs.converted, cfg.conversion_weight, 1.0).astype(np.float32)
    t_train, t_valid = (as_tensors(x, torch.device("cpu")) for x in (x_train, x_valid))
    torch.manual_seed(cfg.seed)
    full = WideDeep(cfg.dim)
    fits = {
        "wide_deep": _fit(
            full,
            (t_train, y[rank_idx], w[rank_idx], None),
            (t_valid, y[valid_idx], w[valid_idx], None),
            cfg,
            rng,
            progress,
            "wide&deep",
        )
    }
    light = LightRanker(cfg.dim)
    fits["light"] = _fit(
        light,
        (t_train, y[rank_idx], w[rank_idx], _logits(full, x_train)),
        (t_valid, y[valid_idx], w[valid_idx], _logits(full, x_valid)),
        cfg,
        rng,
        progress,
        "light",
    )
    metrics = {
        "hr_at_10_two_tower": top_k_hits(logs, test_idx, tower_idx, user_pos, user_rows, item_rows),
        "auc_two_tower": auc(y[test_idx], tower_scores),
        "auc_wide_deep": auc(y[test_idx], _logits(full, x_test)),
        "auc_light": auc(y[test_idx], _logits(light, x_test)),
        "impressions": int(n),
        "tower_impressions": len(tower_idx),
        "ranking_impressions": len(rank_idx),
        "click_rate": float(y.mean()),
        "users": len(uniq_users),
        "items": len(logs.item_ids),
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
        "created_ms": int(time.time() * 1000),
        "source": logs.source,
        "files": files,
        **({"online": ONLINE_SOFTMAX} if cfg.tower_loss == "softmax" else {}),
        "training": {**metrics, "config": asdict(cfg)},
    }
    write_manifest(out_dir, manifest)
    return manifest
