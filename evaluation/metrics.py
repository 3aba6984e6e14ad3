"""Top-k metrics of a replay, per arm and per time window. Pure.

For each evaluated interaction (user u consumed item i), the list L that u was given for the
step (``evaluation/protocol.py``), truncated at k:

- HR@k: 1 if i is in L;
- NDCG@k: 1 / log2(rank + 2) for i at 0-based rank in L, else 0 (one relevant item: the
  ideal DCG is 1);
- MRR@k: 1 / (rank + 1), else 0;

averaged over the evaluated interactions. Recall@k is per request: of the items the user
consumed new in the step, the share in L (with one such item, the request's HR@k).
Coverage: the distinct items of every list, over the catalogue's size.

>>> s = ArmScores("pop", k=2, windows=1)
>>> s.add_request(0, ["x", "y"], ["y", "z"])
>>> r = s.summary(catalogue=4)
>>> r["hr"], r["ndcg"], r["mrr"], r["recall"], r["coverage"]
(0.5, 0.3155, 0.25, 0.5, 0.5)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

METRICS = ("hr", "ndcg", "mrr", "recall")


@dataclass
class Tally:
    interactions: int = 0
    hits: int = 0
    ndcg: float = 0.0
    mrr: float = 0.0
    requests: int = 0
    recall: float = 0.0

    @property
    def hit_rate(self) -> float:
        """HR unrounded (0.0 with nothing scored): what settings are chosen on, where the four
        decimals of ``values`` would tie."""
        return self.hits / self.interactions if self.interactions else 0.0

    def values(self) -> dict[str, float | None]:
        n, r = self.interactions, self.requests
        return {
            "hr": round(self.hit_rate, 4) if n else None,
            "ndcg": round(self.ndcg / n, 4) if n else None,
            "mrr": round(self.mrr / n, 4) if n else None,
            "recall": round(self.recall / r, 4) if r else None,
        }


@dataclass
class ArmScores:
    name: str
    k: int = 10
    windows: int = 10
    total: Tally = field(default_factory=Tally)
    per_window: list[Tally] = field(default_factory=list)
    recommended: set[str] = field(default_factory=set)
    short_lists: int = 0
    """Requests answered with fewer than k items."""
    per_interaction: dict[str, list[float]] = field(default_factory=lambda: {"hr": [], "ndcg": []})
    """Each evaluated interaction's HR and NDCG, in the replay's order (the same for every arm
    of a replay): what paired comparisons between arms read."""
    users: list[str] = field(default_factory=list)
    """The user of each evaluated interaction (the unit a paired interval is clustered by)."""
    positions: list[int] = field(default_factory=list)
    """The log position of each evaluated interaction (-1: not given)."""

    def __post_init__(self) -> None:
        if self.k < 1 or self.windows < 1:
            raise ValueError("k and windows must be at least 1")
        self.per_window = [Tally() for _ in range(self.windows)]

    def add_request(
        self,
        window: int,
        recommended: list[str],
        targets: list[str],
        user: str = "",
        positions: list[int] | None = None,
    ) -> None:
        """One list and the items (new to the user) consumed in the step it was made for."""
        top = recommended[: self.k]
        if len(top) < self.k:
            self.short_lists += 1
        self.recommended.update(top)
        rank = {item: r for r, item in enumerate(top)}
        found = 0
        for cell in (self.total, self.per_window[window]):
            cell.requests += 1
        for item in targets:
            r = rank.get(item)
            for cell in (self.total, self.per_window[window]):
                cell.interactions += 1
                if r is not None:
                    cell.hits += 1
                    cell.ndcg += 1.0 / math.log2(r + 2)
                    cell.mrr += 1.0 / (r + 1)
            found += r is not None
            self.per_interaction["hr"].append(0.0 if r is None else 1.0)
            self.per_interaction["ndcg"].append(0.0 if r is None else 1.0 / math.log2(r + 2))
            self.users.append(user)
        self.positions += positions if positions is not None else [-1] * len(targets)
        share = found / len(targets) if targets else 0.0
        self.total.recall += share
        self.per_window[window].recall += share

    def summary(self, catalogue: int) -> dict:
        return {
            "arm": self.name,
            **self.total.values(),
            "coverage": round(len(self.recommended) / catalogue, 4) if catalogue else None,
            "interactions": self.total.interactions,
            "requests": self.total.requests,
            "short_lists": self.short_lists,
        }

    def window_rows(self) -> list[dict]:
        return [
            {"arm": self.name, "window": w, **t.values()} for w, t in enumerate(self.per_window)
        ]


def paired_difference(a: ArmScores, b: ArmScores, metric: str = "hr", z: float = 1.96) -> dict:
    """``a`` minus ``b`` on the same interactions: the mean difference of ``metric`` per
    interaction and its 95% interval, clustered by user (a user's interactions are not
    independent: the variance is that of the per-user sums, the cluster-robust estimate).

    >>> a, b = ArmScores("a", k=1, windows=1), ArmScores("b", k=1, windows=1)
    >>> for user, hit_a, hit_b in [("u", 1, 0), ("u", 1, 1), ("v", 0, 0), ("w", 1, 0)]:
    ...     a.add_request(0, ["x"] if hit_a else ["y"], ["x"], user)
    ...     b.add_request(0, ["x"] if hit_b else ["y"], ["x"], user)
    >>> paired_difference(a, b)  # residual sums per user 0, -0.5, 0.5: var 0.5/16 · 3/2
    {'diff': 0.5, 'low': 0.0756, 'high': 0.9244, 'interactions': 4, 'users': 3}
    """
    x, y = a.per_interaction[metric], b.per_interaction[metric]
    if len(x) != len(y) or a.users != b.users:
        raise ValueError(f"{a.name} and {b.name} were not scored on the same interactions")
    n = len(x)
    if n == 0:
        return {"diff": None, "low": None, "high": None, "interactions": 0, "users": 0}
    d = [p - q for p, q in zip(x, y, strict=True)]
    mean = sum(d) / n
    per_user: dict[str, list[float]] = {}
    for user, v in zip(a.users, d, strict=True):
        cell = per_user.setdefault(user, [0.0, 0.0])
        cell[0] += v - mean
        cell[1] += 1
    g = len(per_user)
    var = sum(s * s for s, _ in per_user.values()) / (n * n)
    if g > 1:
        var *= g / (g - 1)  # the small-sample correction of the cluster-robust estimate
    half = z * math.sqrt(var)
    return {
        "diff": round(mean, 4),
        "low": round(mean - half, 4),
        "high": round(mean + half, 4),
        "interactions": n,
        "users": g,
    }


HISTORY_BUCKETS = ((0, 0, "0"), (1, 9, "1-9"), (10, 99, "10-99"), (100, None, "100+"))
"""Users' earlier interactions, bucketed: cold start, sparse, regular and long histories."""


def by_history(scores: ArmScores, earlier) -> dict[str, dict]:
    """HR and NDCG of the interactions whose user had 0, 1-9, 10-99 or 100+ interactions
    before them (``earlier``: per log position, ``protocol.Plan.earlier``; with
    ``Plan.item_earlier``, the same by the item's earlier interactions).

    >>> s = ArmScores("a", k=1, windows=1)
    >>> s.add_request(0, ["x"], ["x", "y"], "u", positions=[0, 1])
    >>> by_history(s, [0, 12])["0"], by_history(s, [0, 12])["10-99"]["hr"]
    ({'hr': 1.0, 'ndcg': 1.0, 'interactions': 1}, 0.0)
    """
    out = {}
    hr, ndcg = scores.per_interaction["hr"], scores.per_interaction["ndcg"]
    for lo, hi, name in HISTORY_BUCKETS:
        mine = [
            j
            for j, pos in enumerate(scores.positions)
            if pos >= 0 and earlier[pos] >= lo and (hi is None or earlier[pos] <= hi)
        ]
        n = len(mine)
        out[name] = {
            "hr": round(sum(hr[j] for j in mine) / n, 4) if n else None,
            "ndcg": round(sum(ndcg[j] for j in mine) / n, 4) if n else None,
            "interactions": n,
        }
    return out
