"""The reference arms of ``freshrec replay`` and their registry: computed in-process on the
same steps as the live pipeline, each with the settings the replay searches on the training
part. Pure.

The baselines (each in its own module): ``Pop`` and ``RecentPop`` (``popularity.py``),
``ISGD`` and ``BPR`` (``factorisation.py``), ``ItemKNN``, ``SequentialRules`` and ``STAN``
(``neighbours.py``). Each recommends only items it has seen, never an item in ``exclude``
(what the user already consumed), and learns a step's interactions in their order through
``learn(users, items, t_ms)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from evaluation.factorisation import BPR, ISGD
from evaluation.neighbours import STAN, ItemKNN, SequentialRules
from evaluation.popularity import Pop, RecentPop

DAY_MS = 86_400_000.0

__all__ = [
    "BASELINES",
    "BPR",
    "ISGD",
    "STAN",
    "Baseline",
    "BaselineSpec",
    "ItemKNN",
    "Pop",
    "RecentPop",
    "SequentialRules",
]


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

    def learn(self, users: Sequence[str], items: Sequence[str], t_ms=None) -> None: ...

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
        BaselineSpec(SequentialRules, lambda n: _grid(steps=(1, 3, 10))),
        BaselineSpec(
            STAN,
            lambda n: _grid(session=(5, 20), l1=(2.0, 10.0), l2=(None, 7 * DAY_MS), l3=(None, 5.0)),
        ),
    )
}
"""The baselines ``freshrec replay --baselines`` may name. A new one is a class with ``name``,
``learn`` and ``recommend`` and a line here; ``tests/test_registries.py`` then checks it."""
