"""Popularity baselines of ``freshrec replay``. Pure.

- ``Pop``: the items most interacted with so far.
- ``RecentPop``: the items most interacted with in the last ``window`` interactions.

>>> p = Pop()
>>> p.learn(["a", "b", "c"], ["x", "y", "y"])
>>> p.recommend("a", 2, exclude={"x"})
['y']
>>> r = RecentPop(window=2)
>>> r.learn(["a", "b", "c"], ["x", "x", "y"])
>>> r.recommend("d", 2, exclude=set())
['x', 'y']
>>> r.learn(["a", "b"], ["z", "z"]); r.recommend("d", 2, exclude=set())
['z']
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from evaluation.ranking import Vocab, top


class Pop:
    name = "pop"

    def __init__(self) -> None:
        self.items = Vocab()
        self.counts = np.zeros(0, np.int64)
        self._order: np.ndarray | None = None

    def learn(self, users: Sequence[str], items: Sequence[str], t_ms=None) -> None:
        idx = [self.items(i) for i in items]
        if len(self.items) > len(self.counts):
            self.counts = np.concatenate(
                [self.counts, np.zeros(len(self.items) - len(self.counts), np.int64)]
            )
        np.add.at(self.counts, idx, 1)
        self._order = None

    def _ranked(self) -> np.ndarray:
        if self._order is None:
            live = np.flatnonzero(self.counts > 0)
            # most first; ties: the item seen first
            self._order = live[np.argsort(-self.counts[live], kind="stable")]
        return self._order

    def recommend(self, user: str, k: int, exclude: set[str]) -> list[str]:
        return top(self._ranked().tolist(), self.items.names, k, exclude)


class RecentPop(Pop):
    name = "recent_pop"

    def __init__(self, window: int = 1000) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        super().__init__()
        self.window = window
        self._recent: deque[int] = deque()

    def learn(self, users: Sequence[str], items: Sequence[str], t_ms=None) -> None:
        super().learn(users, items)
        for i in items:
            self._recent.append(self.items.index[i])
            if len(self._recent) > self.window:
                self.counts[self._recent.popleft()] -= 1
