"""Co-visitation: items consumed close together by the same user (Davidson et al., "The
YouTube Video Recommendation System", RecSys 2010; Linden et al. 2003), counted as the stream
arrives. Pure: no I/O.

Two halves, one per stage of the streams app:

- ``UserWindows`` (the validate stage, which sees each user's events in order): per user the
  last ``window`` distinct clicked items. A click on b pairs it with each earlier item a of the
  window clicked less than ``window_ms`` before (at most ``max_pairs``, newest first), and the
  pair travels both ways — (a → b) and (b → a) — to the anchor's ``events.by_item``
  partition. Only items clicked strictly earlier pair, so a window seeded from the user's
  recent clicks in Redis (after a restart) gives the pairs the lost window would have given.
- ``CoVisitCounts`` (the count stage, per by-item partition): for each anchor of the
  partition, c(a, b), forward-decayed like the item counts (one landmark: a count and its
  pairs decay alike), bounded to ``candidates`` neighbours per anchor (the weakest quarter
  leaves when it fills). The serving list of an anchor is its ``neighbours`` best b by
  c(a, b) / n(a), n(a) the anchor's own decayed clicks: P(b | a), the conditional
  probability; the replay's item-kNN baseline chose no popularity damping (α 0) on both
  public logs (docs/benchmarks.md). Decay lets stale pairs fade; ratios need no decay.

The sequential rules (``freshcore/sequels.py``) travel and count alike: a click's directed
pairs a → b, b following a at distance d of the user's sequence, ride in its pair record
(``PAIR_DISTANCE``: d, 0 for a co-visitation pair) and are counted, weighted 1/d, in a
``CoVisitCounts`` of their own per partition, with its own bounds; an anchor's serving list
is then its best successors by r(a → b) / Σ r(a → ·) (``top`` over ``total``).

>>> w = UserWindows(users=10, window=3, window_ms=60_000, max_pairs=5)
>>> w.pairs("u", "a", 1_000), w.pairs("u", "b", 2_000), w.pairs("u", "c", 3_000)
([], ['a'], ['b', 'a'])
>>> c = CoVisitCounts(candidates=4)
>>> c.add(["a", "a", "b"], ["b", "c", "a"], [1.0, 1.0, 2.0])
>>> c.top("a", 2, n=2.0), c.top("b", 5, n=1.0)
([('b', 0.5), ('c', 0.5)], [('a', 2.0)])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import orjson

from freshcore.neighbours import MAX_PAIRS, PAIR_WINDOW, PAIR_WINDOW_MS, UserWindows
from freshcore.sequels import SEQUEL_STEPS

__all__ = ["PAIR_COLUMNS", "PAIR_DISTANCE", "CoVisitConfig", "CoVisitCounts", "UserWindows"]

PAIR_COLUMNS = ("ca", "cn", "cp", "co", "ct")
"""A co-visitation record on ``events.by_item``: anchors, neighbours, the source partition
and offset of the click that made each pair, and its event time (ms)."""
PAIR_DISTANCE = "cd"
"""The pair record's column of kinds: 0 for a co-visitation pair, d ≥ 1 for a sequential
rule a → b at distance d (weight 1/d). A record without it, written by a validate stage
from before the rules, holds co-visitation pairs only."""


@dataclass(frozen=True)
class CoVisitConfig:
    window: int = PAIR_WINDOW
    """A user's last distinct clicked items a click pairs with."""
    window_ms: int = PAIR_WINDOW_MS
    """Only items clicked less than this long before pair."""
    max_pairs: int = MAX_PAIRS
    """Pairs one click makes at most (a user with a long history pays no more)."""
    users: int = 100_000
    """Users whose windows the validate stage keeps in memory (least recently active leave)."""
    candidates: int = 200
    """Neighbours counted per anchor at most."""
    neighbours: int = 50
    """Neighbours published per anchor for serving."""
    sequel_steps: int = SEQUEL_STEPS
    """A click follows the user's last this many items of their sequence (0: no sequential
    rules); the windows of the same ``users`` are kept."""
    sequel_successors: int = 50
    """Successors published per anchor for serving."""


class CoVisitCounts:
    """Forward-decayed pair counts of one partition's anchors (weights passed in)."""

    def __init__(self, candidates: int) -> None:
        self.candidates = candidates
        self.counts: dict[str, dict[str, float]] = {}
        self.dirty: set[str] = set()
        """Anchors changed since their state was last persisted."""
        self.published: set[str] = set()
        """Anchors changed since their serving list was last published."""
        self.newest_ms: dict[str, int] = {}
        """Per anchor, the newest event time among its pairs (freshness of its list)."""
        self.dropped: set[str] = set()
        """Anchors dropped since their state was last persisted (``drop``)."""
        self.entries = 0
        """Neighbours held over all anchors (what this state's memory grows with: at most
        anchors × ``candidates``)."""

    def __len__(self) -> int:
        return len(self.counts)

    def add(
        self,
        anchors: Sequence[str],
        neighbours: Sequence[str],
        weights: Sequence[float],
        ts_ms: Sequence[int] | None = None,
    ) -> None:
        counts, cap = self.counts, self.candidates
        for a, b, w in zip(anchors, neighbours, weights, strict=True):
            row = counts.get(a)
            if row is None:
                row = counts[a] = {}
            held = row.get(b)
            if held is None:
                row[b] = w
                self.entries += 1
                if len(row) > cap:
                    self._prune(row)
            else:
                row[b] = held + w
        self.dirty.update(anchors)
        self.published.update(anchors)
        if ts_ms is not None:
            newest = self.newest_ms
            for a, t in zip(anchors, ts_ms, strict=True):
                if t > newest.get(a, 0):
                    newest[a] = int(t)

    def _prune(self, row: dict[str, float]) -> None:
        """The weakest quarter leaves."""
        self._keep_strongest(row, self.candidates * 3 // 4)

    def _keep_strongest(self, row: dict[str, float], n: int) -> None:
        """Keep a row's ``n`` strongest neighbours (ties: by name, so every replay cuts
        alike)."""
        keep = sorted(row.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
        self.entries -= len(row) - len(keep)
        row.clear()
        row.update(keep)

    def trim(self, budget: int) -> int:
        """Past ``budget`` neighbours over all anchors, cut the longest rows to one quota, the
        largest that brings the total to nine tenths of the budget (not below one a row),
        each keeping its strongest (``_keep_strongest``). The anchors clicked with
        the most others lose their weakest pairs first; a quiet anchor keeps its few.
        Returns how many neighbours left.

        >>> c = CoVisitCounts(candidates=200)
        >>> c.add(["a"] * 5 + ["b"] * 2, ["x", "y", "z", "v", "w", "x", "y"], [5, 4, 3, 2, 1, 1, 1])
        >>> c.trim(4), sorted(c.counts["a"]), sorted(c.counts["b"]), c.entries
        (5, ['x'], ['x'], 2)
        >>> c.trim(4)
        0
        """
        if self.entries <= budget:
            return 0
        target = max(1, budget * 9 // 10)
        lengths = np.fromiter((len(r) for r in self.counts.values()), np.int64, len(self.counts))
        lo, hi = 1, int(lengths.max())  # the largest quota whose total is within the target
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if int(np.minimum(lengths, mid).sum()) <= target:
                lo = mid
            else:
                hi = mid - 1
        before = self.entries
        for anchor, row in self.counts.items():
            if len(row) > lo:
                self._keep_strongest(row, lo)
                self.dirty.add(anchor)
                self.published.add(anchor)
        return before - self.entries

    def rescale(self, factor: float) -> None:
        """The landmark moved: every stored count scaled as the item counts are."""
        for row in self.counts.values():
            for b in row:
                row[b] *= factor
        self.dirty.update(self.counts)

    def total(self, anchor: str) -> float:
        """The sum of an anchor's counts: what a sequential rule's share is of.

        >>> c = CoVisitCounts(candidates=4)
        >>> c.add(["a", "a"], ["b", "c"], [1.0, 0.5])
        >>> c.top("a", 1, c.total("a"))
        [('b', 0.6666666666666666)]
        """
        return sum(self.counts.get(anchor, {}).values())

    def top(self, anchor: str, m: int, n: float) -> list[tuple[str, float]]:
        """The ``m`` best neighbours of ``anchor`` by c(a, b) / n (n: its stored clicks)."""
        row = self.counts.get(anchor)
        if not row or n <= 0:
            return []
        best = sorted(row.items(), key=lambda kv: (-kv[1], kv[0]))[:m]
        return [(b, c / n) for b, c in best]

    def drop(self, anchors: Sequence[str]) -> None:
        """Forget anchors (their item left the partition's state)."""
        for a in anchors:
            row = self.counts.pop(a, None)
            if row is not None:
                self.entries -= len(row)
                self.dropped.add(a)
            self.newest_ms.pop(a, None)
            self.dirty.discard(a)
            self.published.discard(a)

    # ---------------------------------------------------------------------- persistence
    def take_dropped(self) -> list[str]:
        out = sorted(self.dropped)
        self.dropped.clear()
        return out

    def take_dirty(self) -> list[str]:
        out = sorted(self.dirty)
        self.dirty.clear()
        return out

    def take_published(self) -> list[str]:
        out = sorted(self.published)
        self.published.clear()
        return out

    def blob(self, anchor: str) -> bytes:
        row = self.counts.get(anchor, {})
        return orjson.dumps([list(row), list(row.values()), self.newest_ms.get(anchor, 0)])

    def restore(self, rows: dict[str, bytes]) -> None:
        for anchor, raw in rows.items():
            names, values, newest = orjson.loads(raw)
            self.entries -= len(self.counts.get(anchor, ()))
            self.counts[anchor] = dict(zip(names, values, strict=True))
            self.entries += len(self.counts[anchor])
            self.newest_ms[anchor] = int(newest)
        self.dirty.clear()
        self.published = set(self.counts)  # lists are written after the state: again
