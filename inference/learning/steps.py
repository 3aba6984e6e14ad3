"""Labels and gradients of the two-tower model, for a batch of events. Pure.

score s = u·v over full rows (the item's bias lives in its last column, the user's last
column is a constant 1). Two losses (``LabelConfig.loss``):

- ``logistic`` (logs of impressions, such as the synthetic world's): for an example
  (u, v, y, w), loss = w·BCE(σ(s), y), so ∂loss/∂u = w(σ − y)·v and ∂loss/∂v = w(σ − y)·u.
  A click is a positive; a conversion a positive of weight ``conversion_weight``; an
  impression is a negative unless the same (request, item) was clicked in the same batch. A
  batch with positives but no negatives gets up to ``sampled_negatives`` random items per
  positive from ``item_pool`` (never the positive item itself).
- ``softmax`` (positive-only logs: clicks, plays, purchases, ratings): each positive and
  ``sampled_negatives`` items drawn uniformly from ``item_pool`` form a group; loss =
  −w·log softmax(s)[positive] over the group, so each member gets w(p − y) where p is its
  softmax share — the same form as the logistic coefficient, with p in place of σ.
  Impressions are not used. On positive-only logs the logistic loss with sampled negatives
  pushed every sampled item down as hard as the positive up, and the replay's HR@10 fell
  below the popularity baselines (``docs/benchmarks.md``, the learner's table).

Either way the user's constant column gets no gradient.

>>> import numpy as np
>>> u = np.array([[1.0, 0.0, 1.0]], np.float32); v = np.array([[1.0, 0.0, 0.0]], np.float32)
>>> gu, gv = logistic_gradients(u, v, np.array([1.0]), np.array([1.0]))
>>> bool(gu[0, 0] < 0), float(gu[0, 2])
(True, 0.0)

The local step (``device_local_steps``): a row's gradients of a slice, summed, rejected whole
when not finite, clipped to ``max_norm``, then u ← u − lr·g, in torch where the tables live.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from freshcore.gradients import clip_rows_torch
from inference.device import to_host
from schemas.records import Event

LOSSES = ("logistic", "softmax")


@dataclass(frozen=True)
class Examples:
    users: list[str]
    items: list[str]
    labels: np.ndarray
    weights: np.ndarray
    event_ms: np.ndarray
    groups: np.ndarray | None = None
    """``softmax``: each example's group (its positive's index among the positives)."""

    @classmethod
    def of(cls, users, items, labels, weights, times, groups=None) -> Examples:
        """From the lists the labelling builds, as arrays of the dtypes the losses take."""
        return cls(
            users,
            items,
            np.asarray(labels, np.float32),
            np.asarray(weights, np.float32),
            np.asarray(times, np.int64),
            None if groups is None else np.asarray(groups, np.int64),
        )

    def part(self, lo: int, hi: int) -> Examples:
        """Examples ``lo`` to ``hi``; their groups numbered from 0 in order."""
        groups = None
        if self.groups is not None:
            groups = np.unique(self.groups[lo:hi], return_inverse=True)[1].astype(np.int64)
        return Examples(
            self.users[lo:hi],
            self.items[lo:hi],
            self.labels[lo:hi],
            self.weights[lo:hi],
            self.event_ms[lo:hi],
            groups,
        )


def halves(ex: Examples) -> tuple[Examples, Examples] | None:
    """``ex`` in two (a slice the device had no memory for): at its middle, or for the
    softmax loss at the start of the group nearest it (a group is one softmax); None where it
    cannot be split — one example, or one group.

    >>> ex = Examples.of(list("uuvv"), list("abcd"), [1, 0, 1, 0], [1] * 4, [0] * 4, [0, 0, 1, 1])
    >>> [(h.items, h.groups.tolist()) for h in halves(ex)]
    [(['a', 'b'], [0, 0]), (['c', 'd'], [0, 0])]
    >>> halves(ex.part(0, 2)) is None
    True
    """
    n = len(ex.labels)
    if ex.groups is None:
        cut = n // 2
    else:
        starts = np.flatnonzero(np.diff(ex.groups)) + 1  # where a group begins
        cut = int(starts[np.argmin(np.abs(starts - n // 2))]) if len(starts) else 0
    if cut <= 0:
        return None
    return ex.part(0, cut), ex.part(cut, n)


@dataclass(frozen=True)
class LabelConfig:
    conversion_weight: float = 3.0
    sampled_negatives: int = 2
    loss: str = "logistic"

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.sampled_negatives < 0:
            raise ValueError("sampled_negatives must be >= 0")


def examples_from_events(
    events: list[Event], cfg: LabelConfig, rng: np.random.Generator, item_pool: list[str]
) -> Examples:
    if cfg.loss == "softmax":
        return softmax_examples(events, cfg, rng, item_pool)
    clicked = {
        (e.request_id, e.item_id) for e in events if e.event_type == "click" and e.request_id
    }
    users, items, labels, weights, times = [], [], [], [], []
    for e in events:
        if e.event_type == "impression":
            if e.request_id and (e.request_id, e.item_id) in clicked:
                continue
            y, w = 0.0, 1.0
        elif e.event_type == "click":
            y, w = 1.0, 1.0
        else:
            y, w = 1.0, cfg.conversion_weight
        users.append(e.user_id)
        items.append(e.item_id)
        labels.append(y)
        weights.append(w)
        times.append(e.ts_ms)
    if labels and 0.0 not in labels and item_pool and cfg.sampled_negatives:
        positives = len(labels)
        picks = rng.integers(0, len(item_pool), positives * cfg.sampled_negatives)
        for j, k in enumerate(picks.tolist()):
            src = j // cfg.sampled_negatives
            if item_pool[k] == items[src]:
                continue  # never the positive item itself
            users.append(users[src])
            items.append(item_pool[k])
            labels.append(0.0)
            weights.append(1.0)
            times.append(times[src])
    return Examples.of(users, items, labels, weights, times)


def softmax_examples(
    events: list[Event], cfg: LabelConfig, rng: np.random.Generator, item_pool: list[str]
) -> Examples:
    """Each click or conversion with ``sampled_negatives`` items drawn uniformly from
    ``item_pool`` (never the positive item itself): one group per positive.

    >>> from types import SimpleNamespace as E
    >>> ex = softmax_examples([E(event_type="click", user_id="u", item_id="a", ts_ms=5)],
    ...                       LabelConfig(sampled_negatives=2, loss="softmax"),
    ...                       np.random.default_rng(0), ["a", "b", "c"])
    >>> ex.labels.tolist(), ex.groups.tolist(), "a" in ex.items[1:]
    ([1.0, 0.0, 0.0], [0, 0, 0], False)
    """
    positives = [e for e in events if e.event_type != "impression"]
    users, items, labels, weights, times, groups = [], [], [], [], [], []
    k = cfg.sampled_negatives if item_pool else 0
    picks = rng.integers(0, len(item_pool), len(positives) * k) if k else ()
    for g, e in enumerate(positives):
        w = cfg.conversion_weight if e.event_type == "conversion" else 1.0
        users.append(e.user_id)
        items.append(e.item_id)
        labels.append(1.0)
        weights.append(w)
        times.append(e.ts_ms)
        groups.append(g)
        for j in picks[g * k : (g + 1) * k] if k else ():
            if item_pool[j] == e.item_id:
                continue
            users.append(e.user_id)
            items.append(item_pool[j])
            labels.append(0.0)
            weights.append(w)
            times.append(e.ts_ms)
            groups.append(g)
    return Examples.of(users, items, labels, weights, times, groups)


def softmax_gradients(u, v, y, w, groups, n_groups: int | None = None):
    """Per-example gradients of −w·log softmax over each group (``softmax_examples``): the
    coefficient w(p − y) on v for u and on u for v, p the example's share of its group;
    torch on the rows' device, or numpy in and out. ``n_groups``: how many groups there are
    (one past the highest), known on the host from the batch that made them (``gradients``);
    without it read from ``groups``, which on a device makes the host wait for it.

    >>> u = np.array([[1.0, 1.0], [1.0, 1.0]], np.float32)
    >>> v = np.array([[2.0, 0.0], [0.0, 0.0]], np.float32)
    >>> gu, gv = softmax_gradients(u, v, np.array([1.0, 0.0]), np.array([1.0, 1.0]), np.array([0, 0]))
    >>> [round(float(x), 3) for x in gv[:, 0]]   # p = σ(2) = 0.881 for the positive
    [-0.119, 0.119]
    """
    host = isinstance(u, np.ndarray)
    if host:
        u, v, y, w, groups = (torch.from_numpy(np.asarray(a)) for a in (u, v, y, w, groups))
    s = (u * v).sum(1).clamp(-30, 30)
    n = n_groups if n_groups is not None else int(groups.max()) + 1 if len(groups) else 0
    top = torch.full((n,), -30.0, dtype=s.dtype, device=s.device)
    top = top.scatter_reduce(0, groups, s, "amax", include_self=True)
    e = torch.exp(s - top[groups])
    total = torch.zeros(n, dtype=s.dtype, device=s.device).index_add_(0, groups, e)
    p = e / total[groups]
    coef = (w * (p - y)).to(u.dtype)[:, None]
    gu = coef * v
    gv = coef * u
    gu[:, -1] = 0.0
    return (gu.numpy(), gv.numpy()) if host else (gu, gv)


def gradients(u, v, ex: Examples, to_device=lambda a: a):
    """The gradients of ``ex``'s loss (``softmax`` when it has groups, else logistic). The
    group count is read from ``ex``'s host array, never from its copy on the device."""
    if ex.groups is not None:
        n_groups = int(ex.groups.max()) + 1 if len(ex.groups) else 0
        return softmax_gradients(
            u, v, to_device(ex.labels), to_device(ex.weights), to_device(ex.groups), n_groups
        )
    return logistic_gradients(u, v, to_device(ex.labels), to_device(ex.weights))


def logistic_gradients(u, v, y, w):
    """Per-example gradients for user and item rows (same shapes as ``u`` and ``v``), in
    torch on the rows' device; numpy arrays in, numpy arrays out."""
    host = isinstance(u, np.ndarray)
    if host:
        u, v, y, w = (torch.from_numpy(np.asarray(a)) for a in (u, v, y, w))
    logits = (u * v).sum(1)
    p = torch.sigmoid(logits.clamp(-30, 30))
    coef = (w * (p - y)).to(u.dtype)[:, None]
    gu = coef * v
    gv = coef * u
    gu[:, -1] = 0.0  # the user's constant column
    return (gu.numpy(), gv.numpy()) if host else (gu, gv)


@dataclass(frozen=True)
class Grouped:
    """Rows grouped by key (``aggregate``): ``keys`` sorted and distinct; ``index`` gives,
    for each input row, its group's position in ``keys``."""

    keys: np.ndarray
    sums: np.ndarray
    counts: np.ndarray
    newest: np.ndarray
    index: np.ndarray


def aggregate(
    keys: np.ndarray,
    grads: np.ndarray,
    event_ms: np.ndarray | None = None,
    counts: np.ndarray | None = None,
) -> Grouped:
    """Per distinct key: the sum of its rows (in input order; float32 rows accumulated in
    float32, others in float64; returned in the rows' dtype), the sum of its ``counts`` (one per row by default) and its newest
    ``event_ms``. The rows are added with torch's ``index_add_`` (one pass, in input order):
    ``np.add.at`` was an eighth of the worker's event path, and a sort with ``np.add.reduceat``
    over 65 columns still 2 ms for a slice of 4,000 examples (0.5 ms this way). Float32 rows
    are summed in float32: through float64 copies the same sums took 0.88 ms instead of 0.22
    for 8,000 rows of 65 over 3,000 keys, and a row's gradient sums a few dozen terms at most,
    far inside float32's precision for a step of lr·g.

    >>> g = aggregate(np.array([5, 3, 5]), np.array([[1.0], [2.0], [4.0]]), np.array([7, 8, 9]))
    >>> g.keys.tolist(), g.sums.ravel().tolist(), g.counts.tolist(), g.newest.tolist()
    ([3, 5], [2.0, 5.0], [1, 2], [8, 9])
    >>> g.index.tolist()
    [1, 0, 1]
    """
    distinct, index = np.unique(np.asarray(keys), return_inverse=True)
    return aggregate_groups(distinct, index, grads, event_ms, counts)


def aggregate_groups(
    distinct: np.ndarray,
    index: np.ndarray,
    grads: np.ndarray,
    event_ms: np.ndarray | None = None,
    counts: np.ndarray | None = None,
) -> Grouped:
    """``aggregate`` of rows already grouped: ``distinct`` the sorted distinct keys and
    ``index`` each row's position in it (``np.unique(keys, return_inverse=True)``)."""
    grads = np.asarray(grads)
    index = np.asarray(index).reshape(-1).astype(np.int64, copy=False)
    groups = len(distinct)
    at = torch.from_numpy(index)
    single = grads.dtype == np.float32  # other dtypes are summed in float64
    sums = torch.zeros((groups, grads.shape[1]), dtype=torch.float32 if single else torch.float64)
    if len(index):
        src = np.ascontiguousarray(grads, np.float32 if single else np.float64)
        sums.index_add_(0, at, torch.from_numpy(src))
    group_counts, newest = counts_and_newest(index, groups, event_ms, counts)
    return Grouped(
        distinct, sums.numpy().astype(grads.dtype, copy=False), group_counts, newest, index
    )


def counts_and_newest(
    index: np.ndarray,
    groups: int,
    event_ms: np.ndarray | None = None,
    counts: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per group: the sum of ``counts`` (one per row by default) and the newest ``event_ms``
    of the rows ``index`` puts in it (host arrays)."""
    if counts is None:
        group_counts = np.bincount(index, minlength=groups).astype(np.int64)
    else:
        group_counts = np.bincount(index, np.asarray(counts, np.int64), minlength=groups)
        group_counts = group_counts.astype(np.int64)
    if event_ms is None or not len(index):
        return group_counts, np.zeros(groups, np.int64)
    newest = torch.zeros(groups, dtype=torch.int64).scatter_reduce_(
        0,
        torch.from_numpy(index),
        torch.from_numpy(np.asarray(event_ms, np.int64)),
        "amax",
        include_self=False,
    )
    return group_counts, newest.numpy()


def oldest_per_group(index: np.ndarray, groups: int, event_ms: np.ndarray) -> np.ndarray:
    """Per group: the oldest ``event_ms`` of the rows ``index`` puts in it (0 for a group
    with none): the event a stage's freshness is timed from.

    >>> oldest_per_group(np.array([1, 0, 1]), 2, np.array([7, 8, 5])).tolist()
    [8, 5]
    """
    if not len(index):
        return np.zeros(groups, np.int64)
    oldest = torch.zeros(groups, dtype=torch.int64).scatter_reduce_(
        0,
        torch.from_numpy(np.asarray(index, np.int64)),
        torch.from_numpy(np.asarray(event_ms, np.int64)),
        "amin",
        include_self=False,
    )
    return oldest.numpy()


@dataclass(frozen=True)
class LocalStep:
    """A slice's step on each row of one table: which rows' sums were finite (``ok``), their
    clipped sums (what the parameter server is sent) and the deltas −lr·g applied locally."""

    ok: np.ndarray
    sums: np.ndarray
    deltas: np.ndarray


@dataclass(frozen=True)
class TableSlice:
    """One table's part of a slice, on the tables' device: the table's rows, the distinct
    slots the slice touches, each example's position among them, its gradient."""

    rows: torch.Tensor
    slots: torch.Tensor
    index: torch.Tensor
    grads: torch.Tensor


def device_local_steps(
    parts: list[TableSlice], lr: float | list[float], max_norm: float
) -> list[LocalStep]:
    """The local step of a slice on every table, where the tables live: per distinct row the
    sum of its gradients, non-finite rows rejected, the rest clipped, u ← u − lr·g applied in
    place. Then one copy to the host — the clipped sums, which are the gradient batch the
    parameter server is sent — from which each table's ``LocalStep`` is read (its deltas
    computed by the same operation as on the device, so the step pool holds exactly what
    float32 rows received; float16 rows receive it rounded). ``lr`` is one step size, or
    one per part (per table).

    >>> rows = torch.zeros((3, 2))
    >>> part = TableSlice(rows, torch.tensor([2, 0]), torch.tensor([0, 1, 0]),
    ...                   torch.tensor([[1.0, 0.0], [0.0, 4.0], [2.0, 0.0]]))
    >>> (step,) = device_local_steps([part], lr=0.5, max_norm=2.0)
    >>> step.ok.tolist(), step.sums.tolist(), rows.tolist()
    ([True, True], [[2.0, 0.0], [0.0, 2.0]], [[0.0, -1.0], [0.0, 0.0], [-1.0, 0.0]])
    """
    lrs = list(lr) if isinstance(lr, list | tuple) else [lr] * len(parts)
    if not parts:
        return []
    clipped_all, ok_all, deltas = [], [], []
    for p, part_lr in zip(parts, lrs, strict=True):
        sums = torch.zeros(
            (len(p.slots), p.grads.shape[1]), dtype=p.grads.dtype, device=p.grads.device
        )
        sums.index_add_(0, p.index, p.grads)
        ok, clipped = clip_rows_torch(sums, max_norm)
        clipped_all.append(clipped)
        ok_all.append(ok)
        # rejected rows: zero, no step; a float16 table takes the step rounded to it
        deltas.append(clipped.mul(-part_lr).to(p.rows.dtype))
    sizes = [len(c) for c in clipped_all]
    packed = torch.cat(
        [
            torch.cat([c, o[:, None].to(c.dtype)], 1)
            for c, o in zip(clipped_all, ok_all, strict=True)
        ]
    )
    # every tensor made before a row changes: a device out of memory changed nothing
    for p, delta in zip(parts, deltas, strict=True):
        p.rows.index_add_(0, p.slots, delta)
    host = to_host(packed)  # the gradient batch: the slice's one copy to the host
    out = []
    for part, part_lr in zip(np.split(host, np.cumsum(sizes)[:-1]), lrs, strict=True):
        ok = part[:, -1] > 0
        sums = np.ascontiguousarray(part[ok, :-1])
        out.append(LocalStep(ok, sums, torch.from_numpy(sums).mul(-part_lr).numpy()))
    return out
