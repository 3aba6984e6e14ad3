"""The prequential protocol of ``freshrec replay``: which interactions train, which are
asked about, and in what steps. Pure.

A log in event-time order is cut at ``train_share``: the part before trains the starting models
(``freshrec train --log``), the part after is replayed. The replay goes in steps of ``step``
consecutive interactions. In each step, every user with an interaction to evaluate asks for
k recommendations once, with the state learnt from everything before the step; each of the
step's interactions is then scored against that user's list; then the step's interactions
are learnt (produced to ``events``, and learnt by the in-process baselines). An interaction
is evaluated when its item is new to the user (nothing they consumed before, in the log's
training part or earlier in the replay, can be asked for: the lists exclude it) and it falls
in the ``sample``.

Steps trade fidelity for speed: within a step, a user's later interactions are not yet known
when their list is made. Every arm and baseline sees exactly the same steps.

>>> users = np.array(["a", "a", "b", "a", "b", "a"], object)
>>> items = np.array(["x", "y", "x", "y", "z", "z"], object)
>>> p = plan(users, items, train_share=0.5, step=2)
>>> p.train_end, [s.users for s in p.steps]   # a's y at 3 is a repeat: not asked about
(3, [['b'], ['a']])
>>> [(s.requests, s.evaluated) for s in p.steps], p.repeats
([(1, 1), (1, 1)], 1)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from schemas.hashing import hash_uniform


@dataclass
class Step:
    index: int
    start: int
    """Position in the log of the step's first interaction."""
    end: int
    users: list[str] = field(default_factory=list)
    """Users asked for recommendations, in the order of their first interaction here."""
    targets: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    """Per asked user: (position in the log, item) of each interaction evaluated."""

    @property
    def requests(self) -> int:
        return len(self.users)

    @property
    def evaluated(self) -> int:
        return sum(len(t) for t in self.targets.values())


@dataclass
class Plan:
    train_end: int
    """Interactions before this position train; the rest are replayed."""
    steps: list[Step]
    consumed_before: dict[str, set[str]]
    """Per user, the items of the training part."""
    repeats: int
    """Replayed interactions not evaluated because the user had consumed the item."""
    unsampled: int
    earlier: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Per position in the log, how many interactions its user had before it."""
    item_earlier: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """Per position in the log, how many interactions its item had before it (0: the item
    is new to the log there — a cold start on the item's side)."""

    @property
    def evaluated(self) -> int:
        return sum(s.evaluated for s in self.steps)


def plan(
    users: np.ndarray,
    items: np.ndarray,
    *,
    train_share: float = 0.8,
    step: int = 100,
    sample: float = 1.0,
    seed: int = 1,
) -> Plan:
    """The replay's steps over aligned arrays of user and item ids (event-time order)."""
    if not 0.0 <= train_share < 1.0:
        raise ValueError(f"train_share must be in [0, 1), got {train_share}")
    if step < 1:
        raise ValueError(f"step must be at least 1, got {step}")
    if not 0.0 < sample <= 1.0:
        raise ValueError(f"sample must be in (0, 1], got {sample}")
    n = len(users)
    train_end = int(n * train_share)
    consumed: dict[str, set[str]] = {}
    for u, i in zip(users[:train_end].tolist(), items[:train_end].tolist(), strict=True):
        consumed.setdefault(u, set()).add(i)
    consumed_before = {u: set(s) for u, s in consumed.items()}
    draw = hash_uniform(seed, 1, np.arange(n, dtype=np.int64))
    steps: list[Step] = []
    repeats = unsampled = 0
    for k, start in enumerate(range(train_end, n, step)):
        s = Step(k, start, min(start + step, n))
        for pos in range(s.start, s.end):
            u, i = users[pos], items[pos]
            seen = consumed.setdefault(u, set())
            if i in seen:
                repeats += 1
            elif draw[pos] >= sample:
                unsampled += 1
            else:
                if u not in s.targets:
                    s.users.append(u)
                    s.targets[u] = []
                s.targets[u].append((pos, i))
            seen.add(i)
        steps.append(s)
    return Plan(
        train_end, steps, consumed_before, repeats, unsampled, _earlier(users), _earlier(items)
    )


def _earlier(keys: np.ndarray) -> np.ndarray:
    """Per position, how many times its key occurred before it.

    >>> _earlier(np.array(["a", "b", "a", "a"])).tolist()
    [0, 0, 1, 2]
    """
    out = np.zeros(len(keys), np.int64)
    counts: dict[str, int] = {}
    for pos, key in enumerate(keys.tolist()):
        out[pos] = counts.get(key, 0)
        counts[key] = out[pos] + 1
    return out


def validation_cut(
    users: np.ndarray, items: np.ndarray, train_end: int, step: int = 100, share: float = 0.9
) -> tuple[int, Plan]:
    """The validation replay inside a training part of ``train_end`` interactions: its
    first ``share`` trains, the rest is replayed and scored, and nothing at or after
    ``train_end`` (the scored part) is read. Returns the cut's length and its plan.

    >>> users = np.array(["a", "b", "a", "b", "a", "b"], object)
    >>> items = np.array(["x", "y", "y", "x", "z", "z"], object)
    >>> n, inner = validation_cut(users, items, train_end=4, step=10, share=0.5)
    >>> n, inner.train_end, [t for s in inner.steps for t in s.targets.values()]
    (4, 2, [[(2, 'y')], [(3, 'x')]])
    """
    inner = plan(users[:train_end], items[:train_end], train_share=share, step=step)
    return train_end, inner


def windows(t_ms: np.ndarray, start: int, count: int) -> np.ndarray:
    """Window index of each position from ``start`` on: ``count`` windows of equal event
    time over the replayed part (positions before ``start`` get -1).

    >>> windows(np.array([0, 10, 20, 30, 40]), start=1, count=3).tolist()
    [-1, 0, 1, 2, 2]
    """
    out = np.full(len(t_ms), -1, np.int64)
    if start >= len(t_ms):
        return out
    lo, hi = int(t_ms[start]), int(t_ms[-1])
    span = max(hi - lo, 1)
    out[start:] = np.minimum((t_ms[start:] - lo) * count // span, count - 1)
    return out
