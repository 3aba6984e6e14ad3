"""Matrix factorisation baselines of ``freshrec replay``. Pure.

- ``ISGD``: incremental SGD matrix factorisation for positive-only feedback (Vinagre, Jorge
  and Gama, "Fast incremental matrix factorization for recommendation with positive-only
  feedback", UMAP 2014): each interaction (u, i) is a target of 1; with e = 1 − A_u·B_i,
  A_u ← A_u + η(e·B_i − λA_u) and B_i ← B_i + η(e·A_u − λB_i); new users and items start
  from N(0, 0.1²); the list is the items whose prediction is nearest 1.
- ``BPR``: matrix factorisation by Bayesian personalised ranking, trained on the training
  part for some epochs, then one pass per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from evaluation.ranking import Vocab, best


class _Factorisation:
    """User rows A and item rows B of ``factors`` columns, grown as ids appear, new rows from
    N(0, 0.1²); ``_first_call`` is True once, for the replay's training part."""

    def __init__(self, factors: int, lr: float, l2: float, seed: int) -> None:
        self.factors, self.lr, self.l2 = factors, lr, l2
        self.rng = np.random.default_rng(seed)
        self.users, self.items = Vocab(), Vocab()
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

    def learn(self, users: Sequence[str], items: Sequence[str], t_ms=None) -> None:
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
        return best(-np.abs(1.0 - self.B[:n] @ a), k, exclude, self.items.names)


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

    def learn(self, users: Sequence[str], items: Sequence[str], t_ms=None) -> None:
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
        return [best(scores[q], k, excludes[q], self.items.names) for q in range(len(users))]
