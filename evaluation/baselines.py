"""The reference arms of ``freshrec replay``, computed in-process on the same steps as the
live pipeline. Pure.

- ``Pop``: the items most interacted with so far.
- ``RecentPop``: the items most interacted with in the last ``window`` interactions.
- ``ISGD``: incremental SGD matrix factorisation for positive-only feedback (Vinagre, Jorge
  and Gama, "Fast incremental matrix factorization for recommendation with positive-only
  feedback", UMAP 2014): each interaction (u, i) is a target of 1; with e = 1 − A_u·B_i,
  A_u ← A_u + η(e·B_i − λA_u) and B_i ← B_i + η(e·A_u − λB_i); new users and items start
  from N(0, 0.1²); the list is the items whose prediction is nearest 1.

Each recommends only items it has seen, never an item in ``exclude`` (what the user already
consumed), and learns a step's interactions in their order through ``learn``.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class _Vocab:
    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.names: list[str] = []

    def __call__(self, key: str) -> int:
        j = self.index.get(key)
        if j is None:
            j = self.index[key] = len(self.names)
            self.names.append(key)
        return j

    def __len__(self) -> int:
        return len(self.names)


def _top(order: Sequence[int], names: list[str], k: int, exclude: set[str]) -> list[str]:
    out = []
    for j in order:
        name = names[j]
        if name not in exclude:
            out.append(name)
            if len(out) == k:
                break
    return out


class Pop:
    name = "pop"

    def __init__(self) -> None:
        self.items = _Vocab()
        self.counts = np.zeros(0, np.int64)
        self._order: np.ndarray | None = None

    def learn(self, users: Sequence[str], items: Sequence[str]) -> None:
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
        return _top(self._ranked().tolist(), self.items.names, k, exclude)


class RecentPop(Pop):
    name = "recent_pop"

    def __init__(self, window: int = 1000) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        super().__init__()
        self.window = window
        self._recent: deque[int] = deque()

    def learn(self, users: Sequence[str], items: Sequence[str]) -> None:
        super().learn(users, items)
        for i in items:
            self._recent.append(self.items.index[i])
            if len(self._recent) > self.window:
                self.counts[self._recent.popleft()] -= 1


class ISGD:
    name = "isgd"

    def __init__(
        self, factors: int = 10, lr: float = 0.05, l2: float = 0.01, seed: int = 1
    ) -> None:
        self.factors, self.lr, self.l2 = factors, lr, l2
        self.rng = np.random.default_rng(seed)
        self.users, self.items = _Vocab(), _Vocab()
        self.A = np.zeros((0, factors))
        self.B = np.zeros((0, factors))

    def _grow(self, table: np.ndarray, size: int) -> np.ndarray:
        if size <= len(table):
            return table
        extra = max(size - len(table), len(table) // 2, 64)
        return np.vstack([table, self.rng.normal(0.0, 0.1, (extra, self.factors))])

    def learn(self, users: Sequence[str], items: Sequence[str]) -> None:
        for u_id, i_id in zip(users, items, strict=True):
            u, i = self.users(u_id), self.items(i_id)
            self.A = self._grow(self.A, u + 1)
            self.B = self._grow(self.B, i + 1)
            a, b = self.A[u].copy(), self.B[i].copy()
            err = 1.0 - float(a @ b)
            self.A[u] = a + self.lr * (err * b - self.l2 * a)
            self.B[i] = b + self.lr * (err * a - self.l2 * b)

    def recommend(self, user: str, k: int, exclude: set[str]) -> list[str]:
        n = len(self.items)
        if not n:
            return []
        u = self.users.index.get(user)
        # an unknown user: a row like the ones new users start from
        a = self.rng.normal(0.0, 0.1, self.factors) if u is None else self.A[u]
        distance = np.abs(1.0 - self.B[:n] @ a)
        take = min(n, k + len(exclude))
        near = np.argpartition(distance, take - 1)[:take] if take < n else np.arange(n)
        order = near[np.argsort(distance[near], kind="stable")]
        return _top(order.tolist(), self.items.names, k, exclude)


@dataclass(frozen=True)
class BaselineSpec:
    """A replay baseline: its class and the settings ``freshrec replay`` searches for it on
    the training part (``evaluation.prequential.tune``), given that part's length."""

    cls: Callable[..., Baseline]
    grid: Callable[[int], list[dict[str, Any]]] = lambda n: [{}]

    @property
    def name(self) -> str:
        return self.cls.name

    def candidates(self, n: int) -> list[tuple[str, dict[str, Any]]]:
        """Each setting of the grid with its label (``window=500``; ``-`` for none).

        >>> BASELINES["isgd"].candidates(1000)[0]
        ('lr=0.01', {'lr': 0.01})
        """
        return [(settings_label(s), s) for s in self.grid(n)]


def settings_label(settings: dict[str, Any]) -> str:
    """``{"lr": 0.05, "factors": 10}`` → ``factors=10,lr=0.05``; ``{}`` → ``-``."""
    return ",".join(f"{k}={v}" for k, v in sorted(settings.items())) or "-"


class Baseline(Protocol):
    name: str

    def learn(self, users: Sequence[str], items: Sequence[str]) -> None: ...

    def recommend(self, user: str, k: int, exclude: set[str]) -> list[str]: ...


def _windows(n: int) -> list[dict[str, Any]]:
    return [
        {"window": w} for w in sorted({max(10, int(n * f)) for f in (0.01, 0.02, 0.05, 0.1, 0.2)})
    ]


BASELINES: dict[str, BaselineSpec] = {
    spec.name: spec
    for spec in (
        BaselineSpec(Pop),
        BaselineSpec(RecentPop, _windows),
        BaselineSpec(ISGD, lambda n: [{"lr": lr} for lr in (0.01, 0.02, 0.05, 0.1)]),
    )
}
"""The baselines ``freshrec replay --baselines`` may name. A new one is a class with ``name``,
``learn`` and ``recommend`` and a line here; ``tests/test_registries.py`` then checks it."""
