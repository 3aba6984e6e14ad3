"""The ranking features of a training log, computed as serving computes them live: item
features as the streams app counts them, and each impression's real-time context (the
user's previous clicks, in time order) as the worker keeps it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from freshcore.hotscore import HotWeights, Smoothing, hot_scores, price_norm, smoothed_rate
from freshcore.neighbours import (
    ANCHORS,
    MAX_PAIRS,
    PAIR_WINDOW,
    PAIR_WINDOW_MS,
    UserWindows,
    score_of,
)
from freshcore.sequels import SEQUEL_STEPS, UserSequences, successor_score_of
from inference.models.features import (
    CATEGORY_BUCKETS,
    RECENT,
    RECENT_DECAY,
    FeatureEncoder,
    RankInputs,
    bucket,
)
from schemas.records import DEVICE_CLASSES


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
    ``inference/training/logtrain.py``). Such rows count as no impression in the item features, as
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


def recent_context(
    logs: TrainingLog, cats: np.ndarray, length: int = RECENT
) -> tuple[np.ndarray, np.ndarray]:
    """Per impression, the real-time features' inputs as serving sees them: the share of the
    user's previous ``RECENT`` clicks (in time order, in the logs) in the impressed item's
    category, and the user's previous ``length`` clicked items, newest first ((n, length)
    item numbers, int32, -1 padding; a re-clicked item counts once, where it was clicked
    last, as the worker keeps them). The attention rankers read ``length`` = ``SEQUENCE``;
    the recent-click features the first ``RECENT``."""
    order = np.lexsort((logs.t_ms, logs.users))
    shares = np.zeros(len(order), np.float32)
    recent_items = np.full((len(order), max(length, RECENT)), -1, np.int32)
    item_cat = cats[logs.items]
    width = recent_items.shape[1]
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
            recent = list(dict.fromkeys(merged))[:width]
            pending, slate_t = [], t
        if recent:
            c = item_cat[j]
            newest = recent[:RECENT]
            shares[j] = sum(1 for r in newest if cats[r] == c) / len(newest)
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


def covisit_scores(logs: TrainingLog, recent_items: np.ndarray) -> np.ndarray:
    """Per impression, the ``covisit`` feature as the worker computes it live: the
    co-visitation counts of the clicks before it (in time order; the clicks of one slate are
    counted after it), paired as the streams app pairs them (``UserWindows`` with its
    defaults; both ways), P(b | a) = c(a, b) / n(a) with n(a) a's clicks, scored by
    ``freshcore.neighbours.score_of`` over the user's newest ``ANCHORS`` earlier clicks
    (``recent_items``, from ``recent_context``). Live counts decay and keep each anchor's best
    50: the feature is the same quantity, counted without those bounds."""
    out = np.zeros(len(logs.users), np.float32)
    pairs: dict[int, dict[int, float]] = {}
    n = np.zeros(len(logs.item_ids), np.float64)
    windows = UserWindows(len(logs.user_ids) + 1, PAIR_WINDOW, PAIR_WINDOW_MS, MAX_PAIRS)

    def p(a: int, b: int) -> float:  # P(b | a) from the clicks counted so far
        row = pairs.get(a)
        return row.get(b, 0.0) / n[a] if row else 0.0

    for slate, clicks in _slates(logs):
        for j in slate:
            anchors = [a for a in recent_items[j, :ANCHORS].tolist() if a >= 0]
            out[j] = score_of(int(logs.items[j]), anchors, p)
        for j in clicks:
            b, t = int(logs.items[j]), int(logs.t_ms[j])
            n[b] += 1
            for a in windows.pairs(int(logs.users[j]), b, t):
                row_a, row_b = pairs.setdefault(a, {}), pairs.setdefault(b, {})
                row_a[b] = row_a.get(b, 0.0) + 1.0
                row_b[a] = row_b.get(a, 0.0) + 1.0
    return out


def sequel_scores(logs: TrainingLog, recent_items: np.ndarray) -> np.ndarray:
    """Per impression, the ``sequel`` feature as the worker computes it live: the sequential
    rules of the clicks before it (in time order; the clicks of one slate are counted after
    it), made as the streams app makes them (``UserSequences`` with its defaults: r(a → b)
    += 1/d), each successor's share r(a → b) / Σ r(a → ·), scored by
    ``freshcore.sequels.successor_score_of`` over the user's earlier clicks
    (``recent_items``, newest first). Live counts decay and keep each anchor's best 50: the
    feature is the same quantity, counted without those bounds."""
    out = np.zeros(len(logs.users), np.float32)
    rules: dict[int, dict[int, float]] = {}
    totals = np.zeros(len(logs.item_ids), np.float64)
    sequences = UserSequences(len(logs.user_ids) + 1, SEQUEL_STEPS)

    def share(a: int, b: int) -> float:  # r(a → b) / Σ r(a → ·) from the clicks so far
        row = rules.get(a)
        return row.get(b, 0.0) / totals[a] if row else 0.0

    for slate, clicks in _slates(logs):
        for j in slate:
            recent = [a for a in recent_items[j, :ANCHORS].tolist() if a >= 0]
            out[j] = successor_score_of(int(logs.items[j]), recent, share)
        for j in clicks:
            b, t = int(logs.items[j]), int(logs.t_ms[j])
            for a, d in sequences.follows(int(logs.users[j]), b, t):
                row = rules.setdefault(a, {})
                row[b] = row.get(b, 0.0) + 1.0 / d
                totals[a] += 1.0 / d
    return out


def _slates(logs: TrainingLog) -> Iterator[tuple[list[int], list[int]]]:
    """The log's rows in time order, a slate (the rows of one time) at a time: each slate's
    rows and those of them that are logged clicks (a sampled negative is none)."""
    order = np.argsort(logs.t_ms, kind="stable")
    times = logs.t_ms[order]
    starts = [*np.flatnonzero(np.r_[True, times[1:] != times[:-1]]).tolist(), len(order)]
    clicks = logs.clicked.astype(bool)
    if logs.sampled is not None:
        clicks = clicks & ~logs.sampled
    for lo, hi in itertools.pairwise(starts):
        slate = order[lo:hi].tolist()
        yield slate, [j for j in slate if clicks[j]]


def rank_inputs(
    logs: TrainingLog, idx: np.ndarray, user_rows, user_pos, item_rows, feats, recent
) -> RankInputs:
    """``recent``: ``recent_context``'s shares and items, ``covisit_scores`` and
    ``sequel_scores``."""
    shares, recent_items, covisit, sequel = recent
    enc = FeatureEncoder()
    items = logs.items[idx]
    device = logs.device[idx]
    ctx = enc.context(
        [DEVICE_CLASSES[d] if d >= 0 else None for d in device.tolist()],
        logs.region[idx].tolist(),
        logs.t_ms[idx].tolist(),
    )
    cats = category_buckets(logs)[items]
    newest = recent_items[idx, :RECENT]
    sims = recent_similarities(newest, items, item_rows, item_rows.shape[1] - 1)
    return enc.encode(
        user_rows[user_pos[idx]],
        item_rows[items],
        feats[items],
        cats,
        ctx,
        shares[idx],
        recent_similarity=sims,
        covisit=covisit[idx],
        sequel=sequel[idx],
    )


def category_buckets(logs: TrainingLog) -> np.ndarray:
    """Per catalogue item, its category's bucket (as serving computes it from the catalogue)."""
    names = {c: bucket(c, CATEGORY_BUCKETS) for c in set(logs.item_category.tolist())}
    return np.array([names[c] for c in logs.item_category.tolist()], np.int64)
