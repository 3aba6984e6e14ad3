"""The hot score, its decay, and the published hot lists: one definition for every service. Pure.

hot = w_click · decayed clicks + w_cvr · smoothed conversion rate + w_price · normalised price
(the seeds' 0.6 / 0.3 / 0.1), with click counts decayed by ``rate_per_hour`` (0.95) per hour of
event time. The streams app computes it per item and publishes, per partition and scope, its
top-K with the score's components and the event time they hold at (``HotList``); the worker
merges the partitions' lists: every entry's clicks decayed to one time T (the newest
``as_of_ms``), the score recomputed, the top K taken. Each partition owns a disjoint set of
items, so the global top-K is inside the union of the partitions' top-Ks and the merge is
exact. Offline training computes the same score from its logs.

>>> w = HotWeights()
>>> a = HotList(as_of_ms=0, entries=[HotEntry("i1", 10.0, 0.5, 0.2)])
>>> b = HotList(as_of_ms=0, entries=[HotEntry("i2", 20.0, 0.0, 0.0)])
>>> [e.item_id for e, _ in merge_hot_lists([a, b], k=2, weights=w, rate_per_hour=0.95)]
['i2', 'i1']
>>> merge_published([a.to_json(), b.to_json()], k=1, weights=w, rate_per_hour=0.95)
['i2']
>>> round(decay_factor(0.5, 2 * HOUR_MS), 12)
0.25
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from freshcore.declare import declared

HOUR_MS = 3_600_000


def decay_ln_per_ms(rate_per_hour: float, time_scale: float = 1.0) -> float:
    """−ln(rate) per millisecond of event time: a count decays by exp(−this · Δt_ms).
    ``time_scale``: how many milliseconds of the world one of event time stands for (a
    replay's events run that many times faster than they happened), so the rate stays per
    hour of the world's time; the product is never raised to a power, so no scale underflows.

    >>> decay_ln_per_ms(0.5) * HOUR_MS == decay_ln_per_ms(0.5, 3600.0) * 1000
    True
    """
    if not 0.0 < rate_per_hour <= 1.0:
        raise ValueError(f"decay rate must be in (0, 1], got {rate_per_hour}")
    if not time_scale > 0:
        raise ValueError(f"time scale must be > 0, got {time_scale}")
    return -math.log(rate_per_hour) * time_scale / HOUR_MS


def decay_factor(rate_per_hour: float, dt_ms, time_scale: float = 1.0):
    """How much a decayed count shrinks over ``dt_ms`` of event time: rate^(Δt / 1 h)."""
    ln = decay_ln_per_ms(rate_per_hour, time_scale)
    factor = np.exp(-ln * np.asarray(dt_ms, np.float64))
    return float(factor) if factor.ndim == 0 else factor


@dataclass(frozen=True)
class HotWeights:
    """The seeds' weights: 0.6 clicks, 0.3 conversion rate, 0.1 price."""

    click: float = declared(
        "FRESHREC_HOT_WEIGHT_CLICK", 0.6, "The hot score's weight of an item's decayed clicks."
    )
    cvr: float = declared(
        "FRESHREC_HOT_WEIGHT_CVR", 0.3, "The hot score's weight of an item's conversion rate."
    )
    price: float = declared(
        "FRESHREC_HOT_WEIGHT_PRICE", 0.1, "The hot score's weight of an item's (capped) price."
    )


@dataclass(frozen=True)
class Smoothing:
    """Bayesian smoothing of rates from decayed counts: (x + m·prior) / (n + m)."""

    ctr_prior: float = 0.05
    ctr_strength: float = 20.0
    cvr_prior: float = 0.05
    cvr_strength: float = 10.0


PRIOR_CTR = Smoothing.ctr_prior
PRIOR_CVR = Smoothing.cvr_prior
"""An item no event has touched yet: its CTR and CVR features are the smoothing priors."""


def smoothed_rate(hits, trials, prior: float, strength: float):
    return (hits + strength * prior) / (trials + strength)


def price_norm(price, cap: float = 1000.0):
    """log1p(price) / log1p(cap), clipped to [0, 1]: a price can never outweigh w_price."""
    return np.clip(np.log1p(np.maximum(price, 0.0)) / math.log1p(cap), 0.0, 1.0)


def hot_scores(clicks, cvr, pnorm, w: HotWeights):
    """The hot score of items from their decayed clicks, CVR and normalised price."""
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
    """One partition's top-K for one scope (global or a region), as published to Redis."""

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


def _merge(
    as_of: list[int],
    columns: list[np.ndarray],
    k: int,
    weights: HotWeights,
    rate_per_hour: float,
    names: np.ndarray,
    at_ms: int | None,
    time_scale: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """The top ``k`` rows (indices into the concatenated lists, best first) and their scores:
    each list's ``[clicks, cvr, price_norm]`` rows with clicks decayed from its ``as_of`` to
    ``at_ms`` (default the newest ``as_of``)."""
    if not columns:
        return np.empty(0, np.int64), np.empty(0)
    t = max(as_of) if at_ms is None else at_ms
    shrink = decay_factor(rate_per_hour, t - np.asarray(as_of, np.float64), time_scale)
    a = np.concatenate(columns)
    clicks = a[:, 0] * np.repeat(shrink, [len(c) for c in columns])
    score = hot_scores(clicks, a[:, 1], a[:, 2], weights)
    top = top_k_indices(score, k, names)
    return top, score[top]


def merge_hot_lists(
    lists: list[HotList],
    k: int,
    weights: HotWeights,
    rate_per_hour: float,
    at_ms: int | None = None,
    time_scale: float = 1.0,
) -> list[tuple[HotEntry, float]]:
    """The top-K over all partitions at ``at_ms`` (default: the newest ``as_of_ms``), with
    each entry's score."""
    entries = [e for h in lists for e in h.entries]
    kept = [h for h in lists if h.entries]
    columns = [np.array([[e.clicks, e.cvr, e.price_norm] for e in h.entries]) for h in kept]
    names = np.array([e.item_id for e in entries], object)
    top, scores = _merge(
        [h.as_of_ms for h in kept], columns, k, weights, rate_per_hour, names, at_ms, time_scale
    )
    return [(entries[j], float(s)) for j, s in zip(top.tolist(), scores.tolist(), strict=True)]


def merge_published(
    lists: list[dict], k: int, weights: HotWeights, rate_per_hour: float, time_scale: float = 1.0
) -> list[str]:
    """``merge_hot_lists`` on the published JSON (``HotList.to_json``), without building an
    object per entry: the ids of the top K."""
    as_of, columns, ids = [], [], []
    for h in lists:
        entries = h["entries"]
        if not entries:
            continue
        as_of.append(int(h["as_of_ms"]))
        columns.append(np.asarray([e[1:] for e in entries], np.float64))
        ids.extend(e[0] for e in entries)
    names = np.asarray(ids, object)
    top, _ = _merge(as_of, columns, k, weights, rate_per_hour, names, None, time_scale)
    return names[top].tolist()
