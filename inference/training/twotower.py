"""The two-tower embeddings of ``freshrec train``: user and item rows (``dim + 1`` columns,
the item bias last) fitted on the log, the starting tables that online learning refines —
by logistic loss over labelled impressions, or a sampled softmax over the clicks
(``TrainConfig.tower_loss``) — and their HR@k on held-out clicks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from inference.training.config import TrainConfig
from inference.training.fitting import optimiser_step, shuffled_batches
from inference.training.logfeatures import TrainingLog
from schemas.ids import row_ids
from schemas.rows import TABLE_ITEM, TABLE_USER, initial_rows

Progress = Callable[[str], None]


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
