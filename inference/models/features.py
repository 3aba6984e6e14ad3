"""Ranking features: what the models see for one (request, candidate) pair. Pure.

The same encoder builds training rows (``freshrec train``) and serving rows (the worker), so
the two cannot drift. Categorical values are bucketed by a stable hash (CRC-32), so an
unseen category or region needs no vocabulary update.

Dense features per pair (``DENSE``): the two-tower logit u·v (with the item's bias), the
item's log price, its smoothed CTR and CVR, log1p of its hot score, and two real-time interest
features from the user's last clicks (up to ``RECENT``): the share of them in the item's
category, and the item's similarity to them — the dot product of its row with their rows'
mean, the newest weighing most (``recent_query``) — and its co-visitation score from them
(``freshcore.neighbours.recency_weighted``: how often users who clicked those items clicked it
close by; the ``covisit`` channel's score, counted by the streams app live and by
``logfeatures.covisit_scores`` from a training log), and its sequential-rule score — what
followed those items for other users, the item just consumed weighing most
(``freshcore.sequels.successor_scores``: the ``sequel`` channel's score, counted live by the
streams app and by ``logfeatures.sequel_scores`` from a log). They let a click change the very
next ranking before any embedding has moved far; on the interaction logs of the replay, the
user's last items predicted their next one better than the user's row did (HR@10 of the
vector search 0.08 from the recent items' mean against 0.07 from the row, MovieLens 100K,
``docs/benchmarks.md``). Sparse ids: item
category, device class, hour of day, region; the wide part adds their crosses with the
category.

>>> enc = FeatureEncoder()
>>> ctx = enc.context(["pc", None], ["north", None], [1_767_225_600_000, None])
>>> ctx.shape
(2, 3)
>>> int(ctx[1, 0]) == DEVICE_UNKNOWN
True
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import numpy as np
import torch

from inference.device import to_device
from schemas.records import DEVICE_CLASSES

DENSE = (
    "uv",
    "log_price",
    "ctr",
    "cvr",
    "log_hot",
    "recent_category_share",
    "recent_similarity",
    "covisit",
    "sequel",
)
"""The dense inputs, by name, in the order ``encode`` writes them. A model remembers those it
was trained with (``dense_columns``): a model trained before one was added still reads its
own, in its order."""
RECENT = 10
RECENT_DECAY = 0.8
"""Weight of the i-th newest recent click: 0.8^i (the i2i channel's query weighs them so)."""
CATEGORY_BUCKETS = 128
REGION_BUCKETS = 16
DEVICE_UNKNOWN = len(DEVICE_CLASSES)
HOUR_UNKNOWN = 24
CROSS_BUCKETS = 1 << 16
_DEVICE_INDEX = {name: i for i, name in enumerate(DEVICE_CLASSES)}


def bucket(value: str | None, buckets: int) -> int:
    """A stable bucket in [1, buckets); 0 is 'unknown'."""
    if not value:
        return 0
    return 1 + zlib.crc32(value.encode()) % (buckets - 1)


@dataclass(frozen=True)
class RankInputs:
    """One row per (request, candidate) pair, ready for a model's ``forward``.

    Grouped form (serving): with ``owner`` set, ``user`` holds one row per request and
    ``owner[i]`` is the request of pair ``i`` (pairs of one request contiguous, requests in
    order), so the user's part of the model is computed once per request, not per candidate.
    """

    user: np.ndarray | torch.Tensor  # (n, dim + 1) float32; grouped: (requests, dim + 1)
    item: np.ndarray | torch.Tensor  # (n, dim + 1) float32
    dense: np.ndarray | torch.Tensor  # (n, len(DENSE)) float32 (tensors: on the rows' device)
    sparse: np.ndarray  # (n, 4) int64: category, device, hour, region
    cross: np.ndarray  # (n, 3) int64: category × device, × hour, × region, hashed
    owner: np.ndarray | None = None  # (n,) int64, grouped form only
    seq: torch.Tensor | None = None
    """The attention rankers' input (``inference/models/attention.py``): the user's sequence as item
    rows, (n, N, dim + 1), newest first; grouped: one per request."""
    seq_len: torch.Tensor | None = None  # (n,) or (requests,): valid positions of ``seq``

    def __len__(self) -> int:
        return len(self.dense)

    def expanded(self) -> RankInputs:
        """The same pairs with one user row (and sequence) per pair."""
        if self.owner is None:
            return self
        seq = seq_len = None
        if self.seq is not None:
            own = to_device(self.owner, self.seq.device)
            seq, seq_len = self.seq.index_select(0, own), self.seq_len.index_select(0, own)
        return RankInputs(
            _take(self.user, self.owner),  # a tensor indexed by an array: a blocking copy
            self.item,
            self.dense,
            self.sparse,
            self.cross,
            None,
            seq,
            seq_len,
        )

    def with_sequences(self, seq: torch.Tensor, seq_len: torch.Tensor) -> RankInputs:
        return replace(self, seq=seq, seq_len=seq_len)

    def with_dense(self, columns: np.ndarray) -> RankInputs:
        """The same pairs with only the dense ``columns`` (``dense_columns``), in that order."""
        dense = self.dense
        if isinstance(dense, torch.Tensor):
            return replace(self, dense=dense.index_select(1, to_device(columns, dense.device)))
        return replace(self, dense=dense[:, columns])

    def subset(self, keep: np.ndarray) -> RankInputs:
        """The pairs where ``keep`` (bool, (n,)) holds; the grouped form's per-request rows
        stay (a request may keep no pair)."""
        idx = np.flatnonzero(keep)
        if self.owner is not None:
            per_request = (self.user, _take(self.owner, idx), self.seq, self.seq_len)
        else:
            per_request = (
                _take(self.user, idx),
                None,
                _take(self.seq, idx),
                _take(self.seq_len, idx),
            )
        user, owner, seq, seq_len = per_request
        return RankInputs(
            user,
            _take(self.item, idx),
            _take(self.dense, idx),
            self.sparse[idx],
            self.cross[idx],
            owner,
            seq,
            seq_len,
        )


def _take(a, idx: np.ndarray):
    """Rows ``idx`` of an array or tensor (None stays None)."""
    if a is None:
        return None
    if isinstance(a, torch.Tensor):
        return a.index_select(0, to_device(idx, a.device))
    return a[idx]


class FeatureEncoder:
    """Turns rows, item features and context into ``RankInputs``."""

    def context(self, devices, regions, ts_ms) -> np.ndarray:
        """(n, 3) int64: device index, hour of day (UTC), region bucket."""
        out = np.empty((len(devices), 3), np.int64)
        for j, (d, r, t) in enumerate(zip(devices, regions, ts_ms, strict=True)):
            out[j, 0] = _DEVICE_INDEX.get(d, DEVICE_UNKNOWN) if d else DEVICE_UNKNOWN
            out[j, 1] = (int(t) // 3_600_000) % 24 if t else HOUR_UNKNOWN
            out[j, 2] = bucket(r, REGION_BUCKETS)
        return out

    def encode(
        self,
        user: np.ndarray,
        item: np.ndarray,
        item_dense: np.ndarray,
        item_category: np.ndarray,
        context: np.ndarray,
        recent_share: np.ndarray | None = None,
        owner: np.ndarray | None = None,
        recent_similarity: np.ndarray | None = None,
        covisit: np.ndarray | None = None,
        sequel: np.ndarray | None = None,
    ) -> RankInputs:
        """Aligned rows: ``item_dense`` is (n, 4) [price, ctr, cvr, hot]; ``item_category``
        (n,) category buckets; ``context`` (n, 3) from ``context`` repeated per pair;
        ``recent_share`` (n,) from ``recent_category_share``; ``recent_similarity`` (n,) each
        item's row against its user's ``recent_query`` (an array, or a tensor on the rows'
        device); ``covisit`` (n,) each item's
        ``freshcore.neighbours.recency_weighted`` score and ``sequel`` (n,) its
        ``freshcore.sequels.successor_scores`` score (0: none). With ``owner`` (n,), ``user``
        is one row per request and the result is in the grouped form."""
        rest = np.empty((len(item_dense), len(DENSE) - 1), np.float32)
        rest[:, 0] = np.log1p(np.maximum(item_dense[:, 0], 0.0))
        rest[:, 1] = item_dense[:, 1]
        rest[:, 2] = item_dense[:, 2]
        rest[:, 3] = np.log1p(np.maximum(item_dense[:, 3], 0.0))
        rest[:, 4] = 0.0 if recent_share is None else recent_share
        # a tensor (serving: computed where the rows are) joins on that device, not via host
        sims_on_device = isinstance(recent_similarity, torch.Tensor)
        rest[:, 5] = 0.0 if recent_similarity is None or sims_on_device else recent_similarity
        rest[:, 6] = 0.0 if covisit is None else covisit
        rest[:, 7] = 0.0 if sequel is None else sequel
        # the dot product where the rows are (a serving batch's rows stay on the tables'
        # device; training's are host arrays)
        on_device = isinstance(user, torch.Tensor)
        if not on_device:
            user = torch.from_numpy(np.ascontiguousarray(user, np.float32))
            item = torch.from_numpy(np.ascontiguousarray(item, np.float32))
        pair_user = user if owner is None else user.index_select(0, to_device(owner, user.device))
        uv = (pair_user * item).sum(1).clamp(-20, 20).to(torch.float32)
        dense = torch.cat([uv[:, None], to_device(rest, user.device)], 1)
        if sims_on_device:
            dense[:, DENSE.index("recent_similarity")] = recent_similarity.to(dense.device)
        if not on_device:
            user, item, dense = user.numpy(), item.numpy(), dense.numpy()
        sparse, cross = sparse_ids(item_category, context)
        return RankInputs(
            user,
            item,
            dense,
            sparse,
            cross,
            None if owner is None else np.asarray(owner, np.int64),
        )


def sparse_ids(item_category: np.ndarray, context: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, 4) the sparse ids — category, device, hour, region — and (n, 3) the category's
    crosses with the other three, hashed into ``CROSS_BUCKETS``.

    >>> sparse, cross = sparse_ids(np.array([2]), np.array([[1, 5, 3]]))
    >>> sparse.tolist(), cross.tolist()
    ([[2, 1, 5, 3]], [[15, 10067, 40265]])
    """
    cat = item_category.astype(np.int64)
    sparse = np.column_stack([cat, context]).astype(np.int64)
    cross = np.column_stack(
        [
            (cat * 7 + context[:, 0]) % CROSS_BUCKETS,
            (cat * 31 + context[:, 1] + 10_000) % CROSS_BUCKETS,
            (cat * 131 + context[:, 2] + 40_000) % CROSS_BUCKETS,
        ]
    ).astype(np.int64)
    return sparse, cross


def dense_columns(features) -> np.ndarray | None:
    """Where a model's dense inputs (``features``: their names, in its order) are among
    ``DENSE``; None when they are ``DENSE`` itself. A name not in ``DENSE`` (a model trained
    by a newer release) is a ``ValueError`` that names it.

    >>> dense_columns(DENSE) is None, dense_columns(("uv", "covisit")).tolist()
    (True, [0, 7])
    >>> dense_columns(["uv", "novelty"])
    Traceback (most recent call last):
    ...
    ValueError: features this release does not compute: novelty
    """
    features = tuple(features)
    if features == DENSE:
        return None
    unknown = [f for f in features if f not in DENSE]
    if unknown:
        raise ValueError(f"features this release does not compute: {', '.join(unknown)}")
    return np.array([DENSE.index(f) for f in features], np.int64)


def recent_category_share(recent_categories: list[int], item_categories: np.ndarray) -> np.ndarray:
    """For each item: the share of ``recent_categories`` (the user's last clicks, category
    buckets) equal to its category; 0 when the user has no recent clicks.

    >>> [round(x, 3) for x in recent_category_share([3, 3, 5], np.array([3, 5, 7])).tolist()]
    [0.667, 0.333, 0.0]
    """
    if not recent_categories:
        return np.zeros(len(item_categories), np.float32)
    cats, counts = np.unique(np.asarray(recent_categories[:RECENT]), return_counts=True)
    share = dict(zip(cats.tolist(), (counts / counts.sum()).tolist(), strict=True))
    return np.fromiter(
        (share.get(int(c), 0.0) for c in item_categories), np.float32, len(item_categories)
    )


def recent_weights(count: int) -> np.ndarray:
    """The weights of ``count`` recent clicks, newest first, summing to 1.

    >>> [round(float(w), 3) for w in recent_weights(2)]
    [0.556, 0.444]
    """
    w = RECENT_DECAY ** np.arange(count, dtype=np.float32)
    return w / w.sum()


def recent_similarity(recent_rows, candidate_rows, dim: int):
    """Each candidate's similarity to the user's recent clicks: its row's first ``dim``
    columns (no bias) against the weighted mean of theirs, newest first (``recent_weights``);
    zeros without recent clicks. Tensors or arrays, on their device.

    >>> r = np.array([[1.0, 0.0, 5.0], [0.0, 1.0, 5.0]], np.float32)
    >>> [round(float(x), 3) for x in recent_similarity(r, np.array([[2.0, 0.0, 9.0]], np.float32), 2)]
    [1.111]
    """
    if len(recent_rows) == 0:
        return candidate_rows[:, 0] * 0
    w = recent_weights(len(recent_rows))
    if isinstance(recent_rows, torch.Tensor):
        q = (recent_rows[:, :dim] * to_device(w, recent_rows.device)[:, None]).sum(0)
    else:
        q = (recent_rows[:, :dim] * w[:, None]).sum(0)
    return candidate_rows[:, :dim] @ q
