"""The reference arms of ``freshrec replay``, computed in-process on the same steps as the
live pipeline. Pure.

- ``Pop``: the items most interacted with so far.
- ``RecentPop``: the items most interacted with in the last ``window`` interactions.
- ``BPR``: matrix factorisation by Bayesian personalised ranking, trained on the training
  part for some epochs, then one pass per step.
- ``ItemKNN``: item-to-item co-occurrence over the user's last items, popularity-damped.
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

import itertools
import warnings
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


def _best(scores: np.ndarray, k: int, exclude: set[str], names: list[str]) -> list[str]:
    """The ``k`` names of highest score, none in ``exclude`` (ties: the lower index first)."""
    n = len(scores)
    take = min(n, k + len(exclude))
    near = np.argpartition(-scores, take - 1)[:take] if take < n else np.arange(n)
    order = near[np.argsort(-scores[near], kind="stable")]
    return _top(order.tolist(), names, k, exclude)


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


class _Factorisation:
    """User rows A and item rows B of ``factors`` columns, grown as ids appear, new rows from
    N(0, 0.1²); ``_first_call`` is True once, for the replay's training part."""

    def __init__(self, factors: int, lr: float, l2: float, seed: int) -> None:
        self.factors, self.lr, self.l2 = factors, lr, l2
        self.rng = np.random.default_rng(seed)
        self.users, self.items = _Vocab(), _Vocab()
        self.A = np.zeros((0, factors))
        self.B = np.zeros((0, factors))
        self._started = False

    def _first_call(self) -> bool:
        first, self._started = not self._started, True
        return first

    def _grow(self, table: np.ndarray, size: int) -> np.ndarray:
        if size <= len(table):
            return table
        extra = max(size - len(table), len(table) // 2, 64)
        return np.vstack([table, self.rng.normal(0.0, 0.1, (extra, self.factors))])


class ISGD(_Factorisation):
    name = "isgd"

    def __init__(
        self,
        factors: int = 10,
        lr: float = 0.05,
        l2: float = 0.01,
        passes: int = 1,
        seed: int = 1,
    ) -> None:
        super().__init__(factors, lr, l2, seed)
        self.passes = passes

    def learn(self, users: Sequence[str], items: Sequence[str]) -> None:
        """One step per interaction; the first call (the replay's training part) is walked
        ``passes`` times, the stream's steps once each."""
        for _ in range(self.passes if self._first_call() else 1):
            self._pass(users, items)

    def _pass(self, users: Sequence[str], items: Sequence[str]) -> None:
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
        return _best(-np.abs(1.0 - self.B[:n] @ a), k, exclude, self.items.names)


class BPR(_Factorisation):
    """Matrix factorisation by Bayesian personalised ranking (Rendle et al., UAI 2009): for a
    consumed item i and an item j drawn uniformly from those seen, x = A_u·(B_i − B_j) +
    b_i − b_j is pushed up by SGD on ln σ(x) with L2 ``l2``, in mini-batches of 256. The
    first call of ``learn`` (the replay's training part) runs ``epochs`` passes over it in
    random order; each later call (a step of the stream) one pass over its interactions. The
    list: the items of highest A_u·B_i + b_i (an unknown user: the highest biases).

    >>> m = BPR(factors=4, epochs=30, seed=0)
    >>> m.learn(["a", "a", "b", "b", "c"] * 4, ["x", "y", "x", "y", "x"] * 4)
    >>> m.recommend("c", 1, exclude={"x"})
    ['y']
    """

    name = "bpr"

    def __init__(
        self,
        factors: int = 32,
        lr: float = 0.05,
        l2: float = 0.001,
        epochs: int = 10,
        seed: int = 1,
    ) -> None:
        super().__init__(factors, lr, l2, seed)
        self.epochs = epochs
        self.bias = np.zeros(0)

    def learn(self, users: Sequence[str], items: Sequence[str]) -> None:
        u = np.fromiter((self.users(x) for x in users), np.int64, len(users))
        i = np.fromiter((self.items(x) for x in items), np.int64, len(items))
        self.A = self._grow(self.A, len(self.users))
        self.B = self._grow(self.B, len(self.items))
        self.bias = np.concatenate([self.bias, np.zeros(len(self.B) - len(self.bias))])
        for _ in range(self.epochs if self._first_call() else 1):
            order = self.rng.permutation(len(u))
            for lo in range(0, len(order), 256):
                batch = order[lo : lo + 256]
                self._step(u[batch], i[batch], self.rng.integers(0, len(self.items), len(batch)))

    def _step(self, u: np.ndarray, i: np.ndarray, j: np.ndarray) -> None:
        a, bi, bj = self.A[u], self.B[i], self.B[j]
        x = np.einsum("nf,nf->n", a, bi - bj) + self.bias[i] - self.bias[j]
        g = 1.0 / (1.0 + np.exp(np.clip(x, -30, 30)))  # d ln σ(x) / dx
        lr, l2 = self.lr, self.l2
        np.add.at(self.A, u, lr * (g[:, None] * (bi - bj) - l2 * a))
        np.add.at(self.B, i, lr * (g[:, None] * a - l2 * bi))
        np.add.at(self.B, j, lr * (-g[:, None] * a - l2 * bj))
        np.add.at(self.bias, i, lr * (g - l2 * self.bias[i]))
        np.add.at(self.bias, j, lr * (-g - l2 * self.bias[j]))

    def recommend(self, user: str, k: int, exclude: set[str]) -> list[str]:
        return self.recommend_many([user], k, [exclude])[0]

    def recommend_many(
        self, users: Sequence[str], k: int, excludes: Sequence[set[str]]
    ) -> list[list[str]]:
        n = len(self.items)
        if not n:
            return [[] for _ in users]
        rows = np.zeros((len(users), self.factors))
        for q, user in enumerate(users):
            u = self.users.index.get(user)
            if u is not None:
                rows[q] = self.A[u]
        scores = rows @ self.B[:n].T + self.bias[:n]
        return [_best(scores[q], k, excludes[q], self.items.names) for q in range(len(users))]


class ItemKNN:
    """Item-to-item co-occurrence (Sarwar et al. 2001; Linden et al. 2003; Deshpande & Karypis
    2004): c(a, b) counts the users who consumed both a and b within ``window`` of each other
    (the user's last ``window`` distinct items when b came); n(a) the users who consumed a. A
    user's candidate b scores Σ_a w(a)·c(a, b) / (n(a)^(1−α)·n(b)^α) over the user's last
    ``window`` items a, w(a) = ``recency``^(a's position, newest 0): α 0.5 is cosine, α 0
    the conditional probability P(b | a), a larger α damps popular items further. Candidates
    the neighbours do not fill are the most popular items.

    >>> knn = ItemKNN(window=10, alpha=0.5)
    >>> knn.learn(["a", "a", "b", "b", "c"], ["x", "y", "x", "y", "x"])
    >>> knn.recommend("c", 2, exclude={"x"})
    ['y']
    >>> knn.learn(["d"], ["z"]); knn.recommend("c", 2, exclude={"x"})
    ['y', 'z']
    """

    name = "item_knn"

    def __init__(self, window: int = 50, alpha: float = 0.5, recency: float = 1.0) -> None:
        self.window, self.alpha, self.recency = window, alpha, recency
        self.items = _Vocab()
        self.recent: dict[str, deque[int]] = {}
        self.had: dict[str, set[int]] = {}
        self.counts = np.zeros(0, np.float64)  # n(a): users who consumed a
        self._rows: list[np.ndarray] = []  # pairs not yet in the matrix
        self._cols: list[np.ndarray] = []
        self._matrix = None  # torch CSR c(a, b), symmetric

    def learn(self, users: Sequence[str], items: Sequence[str]) -> None:
        rows, cols = [], []
        for user, item in zip(users, items, strict=True):
            i = self.items(item)
            if i >= len(self.counts):
                self.counts = np.concatenate([self.counts, np.zeros(max(64, i + 1), np.float64)])
            had = self.had.setdefault(user, set())
            window = self.recent.setdefault(user, deque(maxlen=self.window))
            if i in had:  # consumed again: newest in the window, no new pair, no new user
                if i in window:
                    window.remove(i)
                window.appendleft(i)
                continue
            had.add(i)
            self.counts[i] += 1
            if window:
                rows.append(np.full(len(window), i, np.int64))
                cols.append(np.fromiter(window, np.int64, len(window)))
            window.appendleft(i)
        if rows:
            a, b = np.concatenate(rows), np.concatenate(cols)
            self._rows += [a, b]
            self._cols += [b, a]
            self._matrix = None

    def _c(self):
        import torch

        n = len(self.items)
        if self._matrix is None or self._matrix.shape[0] != n:
            index = [torch.zeros(0, dtype=torch.int64)] * 2
            values = torch.zeros(0, dtype=torch.float64)
            if self._matrix is not None:  # the counts so far, grown to the vocabulary
                old = self._matrix.to_sparse_coo().coalesce()
                index, values = list(old.indices()), old.values()
            if self._rows:
                new = torch.from_numpy(
                    np.stack([np.concatenate(self._rows), np.concatenate(self._cols)])
                )
                index = [torch.cat([index[0], new[0]]), torch.cat([index[1], new[1]])]
                values = torch.cat([values, torch.ones(new.shape[1], dtype=torch.float64)])
                self._rows, self._cols = [], []
            coo = torch.sparse_coo_tensor(
                torch.stack(index), values, (n, n), check_invariants=False
            ).coalesce()
            with warnings.catch_warnings():  # "sparse CSR support is in beta"
                warnings.simplefilter("ignore", UserWarning)
                self._matrix = coo.to_sparse_csr()
        return self._matrix

    def recommend(self, user: str, k: int, exclude: set[str]) -> list[str]:
        return self.recommend_many([user], k, [exclude])[0]

    def recommend_many(
        self, users: Sequence[str], k: int, excludes: Sequence[set[str]]
    ) -> list[list[str]]:
        """Lists for several users at once (one sparse product)."""
        import torch

        n = len(self.items)
        if not n:
            return [[] for _ in users]
        counts = np.maximum(self.counts[:n], 1.0)
        # float64: the popularity tie-break below (1e-9) is below a float32 score's precision
        # (7e-9 at 0.1), where equal scores would fall to the vocabulary's order instead
        weights = np.zeros((n, len(users)), np.float64)
        for q, user in enumerate(users):
            window = self.recent.get(user)
            if window:
                anchors = np.fromiter(window, np.int64, len(window))
                w = self.recency ** np.arange(len(anchors), dtype=np.float64)
                weights[anchors, q] = w / counts[anchors] ** (1.0 - self.alpha)
        scores = torch.sparse.mm(self._c(), torch.from_numpy(weights)).numpy()
        scores /= (counts**self.alpha)[:, None]
        # ties and empty rows: popular items first
        scores += 1e-9 * (counts / counts.max())[:, None]
        return [_best(scores[:, q], k, excludes[q], self.items.names) for q in range(len(users))]


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

        >>> BASELINES["recent_pop"].candidates(1000)[0]
        ('window=10', {'window': 10})
        """
        return [(settings_label(s), s) for s in self.grid(n)]


def settings_label(settings: dict[str, Any]) -> str:
    """``{"lr": 0.05, "factors": 10}`` → ``factors=10,lr=0.05``; ``{}`` → ``-``."""
    return ",".join(f"{k}={v}" for k, v in sorted(settings.items())) or "-"


class Baseline(Protocol):
    name: str

    def learn(self, users: Sequence[str], items: Sequence[str]) -> None: ...

    def recommend(self, user: str, k: int, exclude: set[str]) -> list[str]: ...


def _grid(**axes: Sequence[Any]) -> list[dict[str, Any]]:
    """Every combination of the axes' values.

    >>> _grid(a=(1, 2), b=(0,))
    [{'a': 1, 'b': 0}, {'a': 2, 'b': 0}]
    """
    names = list(axes)
    return [dict(zip(names, values, strict=True)) for values in itertools.product(*axes.values())]


def _windows(n: int) -> list[dict[str, Any]]:
    return [
        {"window": w} for w in sorted({max(10, int(n * f)) for f in (0.01, 0.02, 0.05, 0.1, 0.2)})
    ]


BASELINES: dict[str, BaselineSpec] = {
    spec.name: spec
    for spec in (
        BaselineSpec(Pop),
        BaselineSpec(RecentPop, _windows),
        BaselineSpec(
            ISGD,
            lambda n: _grid(factors=(10, 50), lr=(0.01, 0.05, 0.1), l2=(0.01, 0.1), passes=(1, 3)),
        ),
        BaselineSpec(
            BPR,
            lambda n: _grid(factors=(32, 64), lr=(0.02, 0.05), l2=(0.0001, 0.001), epochs=(10, 30)),
        ),
        BaselineSpec(
            ItemKNN, lambda n: _grid(window=(10, 50), alpha=(0.0, 0.5, 0.8), recency=(1.0, 0.9))
        ),
    )
}
"""The baselines ``freshrec replay --baselines`` may name. A new one is a class with ``name``,
``learn`` and ``recommend`` and a line here; ``tests/test_registries.py`` then checks it."""
