"""The neighbourhood baselines of ``freshrec replay``: what a production team writes first,
each learning incrementally and recommending between any two steps. Pure.

- ``ItemKNN``: item-to-item co-occurrence over the user's last items, popularity-damped
  (Sarwar et al. 2001; Linden et al. 2003; Deshpande & Karypis 2004).
- ``SequentialRules``: what followed the user's last item in other users' sequences,
  weighted by how closely (Ludewig & Jannach, "Evaluation of session-based recommendation
  algorithms", UMUAI 2018).
- ``STAN``: other users whose recent items overlap the user's, weighted by position and
  recency (Garg et al., "Sequence and Time Aware Neighborhood for Session-based
  Recommendations", SIGIR 2019; with the time decays off it is V-SKNN's vector neighbours).

Each fills its list with the most popular items (users who consumed them), which also break
equal scores (``ranking.ranked``). ``tests/test_baselines_bruteforce.py`` checks each against
an implementation written from the specification alone, with recommend and learn
interleaved.

>>> knn = ItemKNN(window=10, alpha=0.5)
>>> knn.learn(["a", "a", "b", "b", "c"], ["x", "y", "x", "y", "x"])
>>> knn.recommend("c", 2, exclude={"x"})
['y']
>>> knn.learn(["d", "d"], ["z", "w"]); knn.recommend("c", 2, exclude={"x"})
['y', 'z']
>>> sr = SequentialRules(steps=2)
>>> sr.learn(["a", "a", "a", "b", "b"], ["x", "y", "z", "x", "z"])
>>> sr.recommend("c", 3, exclude=set())  # no history: the most popular, x and z first seen
['x', 'z', 'y']
>>> sr.learn(["d"], ["x"]); sr.recommend("d", 2, exclude={"x"})  # x → z 1 + 1/2, x → y 1
['z', 'y']
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from evaluation.ranking import Vocab, grown, ranked


class _Users:
    """Per-user state the neighbourhood methods share: items consumed, the newest distinct
    ones first, and the item popularity n(b) (users who consumed b)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.items = Vocab()
        self.had: dict[str, set[int]] = {}
        self.recent: dict[str, deque[int]] = {}
        self.n = np.zeros(0, np.float64)

    def see(self, user: str, item: str) -> tuple[int, bool, list[int]]:
        """Record (user, item): its index, whether it is new to the user, and the user's
        window before it (newest first)."""
        i = self.items(item)
        self.n = grown(self.n, i + 1)
        had = self.had.setdefault(user, set())
        window = self.recent.setdefault(user, deque(maxlen=self.window))
        before = list(window)
        new = i not in had
        if new:
            had.add(i)
            self.n[i] += 1
        elif i in window:
            window.remove(i)
        window.appendleft(i)
        return i, new, before


class ItemKNN:
    """c(a, b) counts the users who consumed both a and b within ``window`` of each other
    (b among the user's last ``window`` distinct items when a came, or the other way); n(a)
    the users who consumed a. A user's candidate b scores Σ_a w(a)·c(a, b) /
    (n(a)^(1−α)·n(b)^α) over the user's last ``window`` distinct items a, w(a) =
    ``recency``^(a's position, newest 0): α 0.5 is cosine, α 0 the conditional probability
    P(b | a), a larger α damps popular items further.

    The counts live in a sparse matrix, merged now and then, and one small matrix for each
    step learnt since; a user's scores gather the rows of their window's items from each
    (the cost follows those rows, not the catalogue).
    """

    name = "item_knn"

    def __init__(self, window: int = 50, alpha: float = 0.5, recency: float = 1.0) -> None:
        self.window, self.alpha, self.recency = window, alpha, recency
        self.users = _Users(window)
        self._base: _Rows | None = None  # the merged counts
        self._steps: list[_Rows] = []  # each step's pairs (both ways) not merged yet
        self._pending: list[np.ndarray] = []  # pairs learnt since the last step's matrix

    def learn(self, users: Sequence[str], items: Sequence[str], t_ms=None) -> None:
        for user, item in zip(users, items, strict=True):
            i, new, before = self.users.see(user, item)
            if new and before:
                b = np.fromiter(before, np.int64, len(before))
                one_way = np.stack([np.full(len(b), i, np.int64), b])
                self._pending += [one_way, one_way[::-1]]

    def _counts(self) -> list[_Rows]:
        """The count matrices whose sum is c: the merged one and one per step since."""
        if self._pending:
            pairs = np.concatenate(self._pending, axis=1)
            self._steps.append(_Rows.of(pairs, np.ones(pairs.shape[1])))
            self._pending = []
        base = 0 if self._base is None else self._base.nnz
        recent = sum(m.nnz for m in self._steps)
        if len(self._steps) >= 16 or recent * 4 >= max(base, 400_000):
            self._merge()
        return ([] if self._base is None else [self._base]) + self._steps

    def _merge(self) -> None:
        parts = ([] if self._base is None else [self._base]) + self._steps
        self._base = _Rows.merged(parts) if parts else None
        self._steps = []

    def matrix(self) -> np.ndarray:
        """Every count learnt so far, c(a, b), as a dense matrix (for tests: small logs)."""
        self._counts()
        self._merge()
        n = len(self.users.items)
        dense = np.zeros((n, n))
        if self._base is not None:
            rows = np.repeat(self._base.keys, np.diff(self._base.starts))
            dense[rows, self._base.cols] = self._base.values
        return dense

    def recommend(self, user: str, k: int, exclude: set[str]) -> list[str]:
        return self.recommend_many([user], k, [exclude])[0]

    def recommend_many(
        self, users: Sequence[str], k: int, excludes: Sequence[set[str]]
    ) -> list[list[str]]:
        """Lists for several users at once."""
        names = self.users.items.names
        n = len(names)
        if not n:
            return [[] for _ in users]
        pop = self.users.n[:n]
        counts = np.maximum(pop, 1.0)
        damp = counts**self.alpha
        matrices = self._counts()
        out = []
        for user, exclude in zip(users, excludes, strict=True):
            scores = np.zeros(n)
            window = self.users.recent.get(user)
            if window:
                anchors = np.fromiter(window, np.int64, len(window))
                w = self.recency ** np.arange(len(anchors), dtype=np.float64)
                w /= counts[anchors] ** (1.0 - self.alpha)
                for matrix in matrices:
                    scores += matrix.gather(anchors, w, n)
                scores /= damp
            out.append(ranked(scores, pop, names, k, exclude))
        return out


class _Rows:
    """A sparse matrix of the rows some pairs name: ``keys`` the row ids (sorted), row
    ``keys[r]``'s columns ``cols[starts[r]:starts[r + 1]]`` with their ``values``. Pure
    numpy: a row is read by slicing, so gathering a few rows costs what they hold.

    >>> m = _Rows.of(np.array([[2, 0, 2], [1, 1, 1]]), np.ones(3))
    >>> m.keys.tolist(), m.cols.tolist(), m.values.tolist()
    ([0, 2], [1, 1], [1.0, 2.0])
    >>> m.gather(np.array([2, 5]), np.array([0.5, 9.0]), 3).tolist()
    [0.0, 1.0, 0.0]
    """

    def __init__(self, keys, starts, cols, values) -> None:
        self.keys, self.starts, self.cols, self.values = keys, starts, cols, values

    @property
    def nnz(self) -> int:
        return len(self.cols)

    @classmethod
    def of(cls, pairs: np.ndarray, values: np.ndarray) -> _Rows:
        """The sum of ``values`` at each (row, column) of ``pairs`` (2 × m)."""
        rows, cols = pairs
        width = int(max(rows.max(initial=0), cols.max(initial=0))) + 1
        flat, inverse = np.unique(rows * width + cols, return_inverse=True)
        summed = np.bincount(inverse, weights=values, minlength=len(flat))
        rows, cols = flat // width, flat % width
        keys, starts = np.unique(rows, return_index=True)
        return cls(keys, np.append(starts, len(rows)), cols, summed)

    @classmethod
    def merged(cls, parts: list[_Rows]) -> _Rows:
        rows = np.concatenate([np.repeat(m.keys, np.diff(m.starts)) for m in parts])
        cols = np.concatenate([m.cols for m in parts])
        return cls.of(np.stack([rows, cols]), np.concatenate([m.values for m in parts]))

    def gather(self, rows: np.ndarray, weights: np.ndarray, n: int) -> np.ndarray:
        """Σ_r weights[r] · row ``rows[r]``, as a dense vector of ``n`` (absent rows: 0)."""
        at = np.searchsorted(self.keys, rows)
        found = (at < len(self.keys)) & (self.keys[np.minimum(at, len(self.keys) - 1)] == rows)
        at, weights = at[found], weights[found]
        if not len(at):
            return np.zeros(n)
        lo, hi = self.starts[at], self.starts[at + 1]
        lens = hi - lo
        first = np.repeat(lo - np.cumsum(lens) + lens, lens)
        picked = first + np.arange(lens.sum())
        return np.bincount(
            self.cols[picked], weights=self.values[picked] * np.repeat(weights, lens), minlength=n
        )


class SequentialRules:
    """Rules a → b for every b that followed a within ``steps`` places of one user's
    sequence, r(a → b) += 1/d at distance d (a consecutive repeat adds nothing); a user's
    candidates are the rules of their last item."""

    name = "sr"

    def __init__(self, steps: int = 10) -> None:
        if steps < 1:
            raise ValueError(f"steps must be at least 1, got {steps}")
        self.steps = steps
        self.users = _Users(1)
        self.history: dict[str, deque[int]] = {}
        self.rules: dict[int, dict[int, float]] = {}

    def learn(self, users: Sequence[str], items: Sequence[str], t_ms=None) -> None:
        for user, item in zip(users, items, strict=True):
            i, _, _ = self.users.see(user, item)
            hist = self.history.setdefault(user, deque(maxlen=self.steps))
            if hist and hist[-1] == i:
                continue
            for d in range(1, len(hist) + 1):
                row = self.rules.setdefault(hist[-d], {})
                row[i] = row.get(i, 0.0) + 1.0 / d
            hist.append(i)

    def recommend(self, user: str, k: int, exclude: set[str]) -> list[str]:
        names = self.users.items.names
        scores = np.zeros(len(names), np.float64)
        hist = self.history.get(user)
        if hist:
            row = self.rules.get(hist[-1], {})
            if row:
                scores[np.fromiter(row, np.int64, len(row))] = np.fromiter(
                    row.values(), np.float64, len(row)
                )
        return ranked(scores, self.users.n, names, k, exclude)


class STAN:
    """A user's neighbours are other users whose last ``window`` distinct items share some of
    the user's last ``session`` items; of those, the ``sample`` most recently active are
    scored — sim(v) = w2(v)·Σ w1(j) over the shared items j, w1(j) = exp(−rank/``l1``)
    (rank 0: the user's newest item), w2(v) = exp(−(now − v's last time)/``l2``) — and the
    ``neighbours`` most similar vote for their items, item b of neighbour v with
    sim(v)·exp(−|pos(b) − pos(s*)|/``l3``), s* the shared item newest for the user. An
    ``l`` of None turns its decay off (``l2`` and ``l3`` None: V-SKNN with exponential
    position weights). Times in milliseconds (``learn``'s ``t_ms``; without them the n-th
    interaction learnt is at n seconds)."""

    name = "stan"

    def __init__(
        self,
        session: int = 10,
        window: int = 50,
        neighbours: int = 100,
        sample: int = 1000,
        l1: float | None = 2.0,
        l2: float | None = None,
        l3: float | None = 5.0,
    ) -> None:
        self.session, self.neighbours, self.sample = session, neighbours, sample
        self.l1, self.l2, self.l3 = l1, l2, l3
        self.users = _Users(window)
        self.ids = Vocab()  # users, in the order first seen
        self.last_t = np.zeros(0, np.float64)
        self.holders: dict[int, dict[int, None]] = {}  # item -> users whose window holds it
        self.learnt = 0
        self.now = 0.0

    def learn(self, users: Sequence[str], items: Sequence[str], t_ms=None) -> None:
        for pos, (user, item) in enumerate(zip(users, items, strict=True)):
            t = float(t_ms[pos]) if t_ms is not None else (self.learnt + pos) * 1000.0
            u = self.ids(user)
            self.last_t = grown(self.last_t, u + 1)
            window = self.users.recent.get(user)
            before = set(window) if window else set()
            i, _, _ = self.users.see(user, item)
            after = self.users.recent[user]
            for gone in before - set(after):
                self.holders[gone].pop(u, None)
            self.holders.setdefault(i, {})[u] = None
            self.last_t[u] = t
            self.now = t
        self.learnt += len(users)

    def _similar(self, u: int | None, session: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The neighbours of the user (index ``u``) with ``session``, and their sims."""
        w1 = _decay(np.arange(len(session), dtype=np.float64), self.l1)
        owners, weights = [], []
        for j, w in zip(session, w1.tolist(), strict=True):
            holders = self.holders.get(j)
            if holders:
                owners.append(np.fromiter(holders, np.int64, len(holders)))
                weights.append(np.full(len(holders), w))
        if not owners:
            return np.zeros(0, np.int64), np.zeros(0)
        who, w = np.concatenate(owners), np.concatenate(weights)
        keep = who != u if u is not None else np.ones(len(who), bool)
        who, w = who[keep], w[keep]
        candidates = np.unique(who)
        if len(candidates) > self.sample:  # the most recently active; then first seen
            order = np.lexsort((candidates, -self.last_t[candidates]))
            candidates = candidates[order[: self.sample]]
        sims = np.zeros(len(self.last_t))
        chosen = np.isin(who, candidates)
        np.add.at(sims, who[chosen], w[chosen])
        sims = sims[candidates] * _decay(self.now - self.last_t[candidates], self.l2)
        order = np.lexsort((candidates, -self.last_t[candidates], -sims))[: self.neighbours]
        return candidates[order], sims[order]

    def recommend(self, user: str, k: int, exclude: set[str]) -> list[str]:
        names = self.users.items.names
        scores = np.zeros(len(names), np.float64)
        window = self.users.recent.get(user)
        if window:
            session = list(window)[: self.session]
            rank = {j: r for r, j in enumerate(session)}
            neighbours, sims = self._similar(self.ids.index.get(user), session)
            for v, sim in zip(neighbours.tolist(), sims.tolist(), strict=True):
                seq = list(self.users.recent[self.ids.names[v]])
                shared = min((rank[j], q) for q, j in enumerate(seq) if j in rank)[1]
                dist = np.abs(np.arange(len(seq), dtype=np.float64) - shared)
                scores[np.asarray(seq, np.int64)] += sim * _decay(dist, self.l3)
        return ranked(scores, self.users.n, names, k, exclude)


def _decay(x: np.ndarray, scale: float | None) -> np.ndarray:
    """exp(−x/scale), or ones where the decay is off (``scale`` None)."""
    if scale is None:
        return np.ones(len(x))
    return np.exp(-np.asarray(x, np.float64) / scale)
