"""Labels and logistic-loss gradients of the two-tower model, for a batch of events. Pure.

score = σ(u·v) over full rows (the item's bias lives in its last column, the user's last
column is a constant 1). For an example (u, v, y, w): loss = w·BCE(σ(u·v), y),
∂loss/∂u = w(σ − y)·v and ∂loss/∂v = w(σ − y)·u; the user's constant column gets no gradient.

Labels: a click is a positive; a conversion a positive of weight ``conversion_weight``; an
impression is a negative unless the same (request, item) was clicked in the same batch.
A batch with positives but no negatives gets up to ``sampled_negatives`` random items per
positive from ``item_pool`` (never the positive item itself).

>>> import numpy as np
>>> u = np.array([[1.0, 0.0, 1.0]], np.float32); v = np.array([[1.0, 0.0, 0.0]], np.float32)
>>> gu, gv = logistic_gradients(u, v, np.array([1.0]), np.array([1.0]))
>>> bool(gu[0, 0] < 0), float(gu[0, 2])
(True, 0.0)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schemas.records import Event


@dataclass(frozen=True)
class Examples:
    users: list[str]
    items: list[str]
    labels: np.ndarray
    weights: np.ndarray
    event_ms: np.ndarray


@dataclass(frozen=True)
class LabelConfig:
    conversion_weight: float = 3.0
    sampled_negatives: int = 2


def examples_from_events(
    events: list[Event], cfg: LabelConfig, rng: np.random.Generator, item_pool: list[str]
) -> Examples:
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
    return Examples(
        users, items, np.asarray(labels, np.float32), np.asarray(weights, np.float32),
        np.asarray(times, np.int64),
    )  # fmt: skip


def logistic_gradients(
    u: np.ndarray, v: np.ndarray, y: np.ndarray, w: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per-example gradients for user and item rows (same shapes as ``u`` and ``v``)."""
    logits = np.einsum("ij,ij->i", u, v)
    p = 1.0 / (1.0 + np.exp(-np.clip(logits, -30, 30)))
    coef = (w * (p - y)).astype(np.float32)[:, None]
    gu = coef * v
    gv = coef * u
    gu[:, -1] = 0.0  # the user's constant column
    return gu, gv


def aggregate(keys: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sum gradients per distinct key: (unique keys, summed rows, example counts)."""
    uniq, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    out = np.zeros((len(uniq), grads.shape[1]), grads.dtype)
    np.add.at(out, inverse, grads)
    return uniq, out, counts
