"""What every replay baseline shares: the vocabulary of items in the order they were first
seen, and the one ranking rule — score, then popularity, then first seen — with the user's
consumed items left out. Pure.

>>> v = Vocab()
>>> [v(x) for x in ("b", "a", "b")], v.names
([0, 1, 0], ['b', 'a'])
>>> ranked(np.array([0.0, 0.5, 0.0]), np.array([3.0, 1.0, 5.0]), v.names + ["c"], 2, {"a"})
['c', 'b']
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TIE_BREAK = 1e-9
"""Popularity's weight beside a score: small beside what a neighbour or a rule gives, and
above float64's rounding of scores up to 1e3 (ulp 1.1e-13), so equal scores go to the more
popular item and an item nothing names is ranked by popularity alone."""


class Vocab:
    """Ids numbered in the order they are first seen."""

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


def top(order: Sequence[int], names: list[str], k: int, exclude: set[str]) -> list[str]:
    """The first ``k`` names of ``order`` not in ``exclude``."""
    out = []
    for j in order:
        name = names[j]
        if name not in exclude:
            out.append(name)
            if len(out) == k:
                break
    return out


def best(scores: np.ndarray, k: int, exclude: set[str], names: list[str]) -> list[str]:
    """The ``k`` names of highest score, none in ``exclude`` (ties: the lower index first)."""
    n = len(scores)
    take = min(n, k + len(exclude))
    if take < n:  # every item scoring at least the take-th best, in index order: ties kept
        kth = np.partition(scores, n - take)[n - take]
        near = np.flatnonzero(scores >= kth)
    else:
        near = np.arange(n)
    order = near[np.argsort(-scores[near], kind="stable")]
    return top(order.tolist(), names, k, exclude)


def ranked(
    scores: np.ndarray, popularity: np.ndarray, names: list[str], k: int, exclude: set[str]
) -> list[str]:
    """``best`` of ``scores`` with ``TIE_BREAK`` × popularity share added (float64): equal
    scores, zeros included, go to the more popular item, then to the one seen first."""
    if not len(names):
        return []
    pop = np.asarray(popularity[: len(names)], np.float64)
    top_pop = pop.max()
    total = np.asarray(scores[: len(names)], np.float64)
    if top_pop > 0:
        total = total + TIE_BREAK * (pop / top_pop)
    return best(total, k, exclude, names)


def grown(array: np.ndarray, size: int) -> np.ndarray:
    """``array`` with zeros appended to at least ``size`` entries (amortised doubling)."""
    if size <= len(array):
        return array
    extra = max(size - len(array), len(array), 64)
    return np.concatenate([array, np.zeros(extra, array.dtype)])
