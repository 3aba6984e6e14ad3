"""Hot scores, top-K selection and the merge of per-partition hot lists. Pure.

hot = w_click · decayed clicks + w_cvr · smoothed conversion rate + w_price · normalised price.
Each streams partition owns a disjoint set of items and publishes its own top-K with the
score's components and the event time they hold at (``as_of_ms``). A reader merges the lists of
all partitions: it brings every entry's decayed clicks to one time T (the newest ``as_of``),
recomputes the score and takes the top K. The global top-K is always inside the union of the
partitions' top-Ks, so the merge is exact.

>>> w = HotWeights()
>>> a = HotList(as_of_ms=0, entries=[HotEntry("i1", 10.0, 0.5, 0.2)])
>>> b = HotList(as_of_ms=0, entries=[HotEntry("i2", 20.0, 0.0, 0.0)])
>>> [e.item_id for e, _ in merge_hot_lists([a, b], k=2, weights=w, rate_per_hour=0.95)]
['i2', 'i1']
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from streams.decay import HOUR_MS


@dataclass(frozen=True)
class HotWeights:
    """The seeds' weights: 0.6 clicks, 0.3 conversion rate, 0.1 price."""

    click: float = 0.6
    cvr: float = 0.3
    price: float = 0.1


@dataclass(frozen=True)
class Smoothing:
    """Bayesian smoothing of rates from decayed counts: (x + m·prior) / (n + m)."""

    ctr_prior: float = 0.05
    ctr_strength: float = 20.0
    cvr_prior: float = 0.05
    cvr_strength: float = 10.0


def smoothed_rate(hits, trials, prior: float, strength: float):
    return (hits + strength * prior) / (trials + strength)


def price_norm(price, cap: float = 1000.0):
    """log1p(price) / log1p(cap), clipped to [0, 1]: a price can never outweigh w_price."""
    return np.clip(np.log1p(np.maximum(price, 0.0)) / math.log1p(cap), 0.0, 1.0)


def hot_scores(clicks, cvr, pnorm, w: HotWeights):
    return w.click * clicks + w.cvr * cvr + w.price * pnorm


def top_k_indices(scores: np.ndarray, k: int, names: np.ndarray | None = None) -> np.ndarray:
    """Indices of the k largest scores, best first; ties broken by ``names`` (else index)."""
    n = len(scores)
    if n == 0 or k <= 0:
        return np.empty(0, np.int64)
    if k < n:
        kth = scores[np.argpartition(-scores, k - 1)[k - 1]]
        part = np.flatnonzero(scores >= kth)  # every element tied with the k-th competes
    else:
        part = np.arange(n)
    tiebreak = names[part].astype(str) if names is not None else part
    order = np.lexsort((tiebreak, -scores[part]))
    return part[order][:k]


@dataclass(frozen=True)
class HotEntry:
    item_id: str
    clicks: float
    """Decayed clicks at the list's ``as_of_ms``."""
    cvr: float
    price_norm: float


@dataclass(frozen=True)
class HotList:
    """One partition's top-K for one scope (global or a region)."""

    as_of_ms: int
    entries: list[HotEntry] = field(default_factory=list)
    partition: int = 0
    published_ms: int = 0

    def to_json(self) -> dict:
        return {
            "as_of_ms": self.as_of_ms,
            "partition": self.partition,
            "published_ms": self.published_ms,
            "entries": [[e.item_id, e.clicks, e.cvr, e.price_norm] for e in self.entries],
        }

    @classmethod
    def from_json(cls, obj: dict) -> HotList:
        return cls(
            as_of_ms=int(obj["as_of_ms"]),
            entries=[
                HotEntry(str(i), float(c), float(v), float(p)) for i, c, v, p in obj["entries"]
            ],
            partition=int(obj.get("partition", 0)),
            published_ms=int(obj.get("published_ms", 0)),
        )


def merge_hot_lists(
    lists: list[HotList],
    k: int,
    weights: HotWeights,
    rate_per_hour: float,
    at_ms: int | None = None,
) -> list[tuple[HotEntry, float]]:
    """The top-K over all partitions at ``at_ms`` (default: the newest ``as_of_ms``)."""
    if not lists:
        return []
    t = max(h.as_of_ms for h in lists) if at_ms is None else at_ms
    ln = -math.log(rate_per_hour) / HOUR_MS
    scored: list[tuple[float, str, HotEntry]] = []
    for h in lists:
        shrink = math.exp(-ln * (t - h.as_of_ms))
        for e in h.entries:
            s = (
                weights.click * e.clicks * shrink
                + weights.cvr * e.cvr
                + weights.price * e.price_norm
            )
            scored.append((s, e.item_id, e))
    scored.sort(key=lambda x: (-x[0], x[1]))
    return [(e, s) for s, _, e in scored[:k]]
