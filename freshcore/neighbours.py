"""Co-visitation, the parts every side shares. Pure.

- ``UserWindows``: which earlier clicks a click pairs with (the streams app's validate stage
  counts the pairs live; ``freshrec train --log`` counts them alike for the ranking feature).
- The neighbour lists in Redis: written by the streams app's count stage, read by the
  worker's ``covisit`` recall channel. One hash per ``events.by_item`` partition
  (``RedisKeys.covisit``), field = anchor item id, value = JSON ``[[neighbour, …], [P(b | a),
  …]]``, best first.
- ``recency_weighted``: a user's score of an item from those lists, Σ 0.9^age · P(b | a) over
  the user's last ``ANCHORS`` clicks a (newest first, age 0): the channel's ranking of its
  candidates and the ranking models' ``covisit`` feature.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence

import orjson

PAIR_WINDOW = 10
"""A user's last distinct clicked items a click pairs with (``FRESHREC_COVISIT_WINDOW``)."""
PAIR_WINDOW_MS = 24 * 3_600_000
"""Only items clicked less than this long before pair (``FRESHREC_COVISIT_WINDOW_MS``)."""
MAX_PAIRS = 10
"""Pairs one click makes at most (``FRESHREC_COVISIT_MAX_PAIRS``)."""
ANCHORS = 10
"""A user's last clicks that score co-visited items."""
ANCHOR_DECAY = 0.9
"""Weight of the anchor clicked ``age`` clicks ago (newest 0): 0.9^age."""


def recency_weighted(
    anchors: Sequence[str], lists: Mapping[str, Iterable[tuple[str, float]]]
) -> dict[str, float]:
    """Each neighbour's Σ 0.9^age · P(b | a) over ``anchors[:ANCHORS]`` (newest first); the
    anchors themselves are left out.

    >>> recency_weighted(["a", "b"], {"a": [("x", 0.5), ("b", 1.0)], "b": [("x", 1.0)]})
    {'x': 1.4}
    """
    mine = list(anchors[:ANCHORS])
    return decayed_sum(mine, lists, ANCHOR_DECAY, set(mine))


def decayed_sum(
    anchors: Sequence[str],
    lists: Mapping[str, Iterable[tuple[str, float]]],
    decay: float,
    excluded: set[str],
) -> dict[str, float]:
    """Each listed item's Σ decay^age · weight over ``anchors`` (newest first, age 0) and
    their ``lists``, the items in ``excluded`` left out: how co-visitation and the
    sequential rules both score a user's candidates.

    >>> decayed_sum(["a", "b"], {"a": [("x", 1.0)], "b": [("x", 1.0), ("y", 2.0)]}, 0.5, {"y"})
    {'x': 1.5}
    """
    scores: dict[str, float] = {}
    for age, a in enumerate(anchors):
        w = decay**age
        for b, p in lists.get(a, ()):
            if b not in excluded:
                scores[b] = scores.get(b, 0.0) + w * p
    return scores


def score_of(item, anchors: Sequence, p: Callable[[object, object], float]) -> float:
    """``recency_weighted``'s score of one ``item``, from ``p(a, item)`` = P(item | a) (0 when
    ``item`` is itself one of the anchors): for counts held in memory, where looking one
    pair up beats listing every neighbour.

    >>> score_of("x", ["a", "b"], lambda a, b: {"a": 0.5, "b": 1.0}[a])
    1.4
    """
    mine = anchors[:ANCHORS]
    if item in mine:
        return 0.0
    return sum(ANCHOR_DECAY**age * p(a, item) for age, a in enumerate(mine))


def serving_list(pairs: list[tuple[str, float]]) -> bytes:
    """An anchor's published list: ``[[neighbour, …], [P(b | a), …]]``.

    >>> serving_list([("b", 0.5), ("c", 0.25)])
    b'[["b","c"],[0.5,0.25]]'
    """
    return orjson.dumps([[b for b, _ in pairs], [p for _, p in pairs]])


def read_serving_list(raw: bytes | None) -> list[tuple[str, float]]:
    """``serving_list``'s pairs (none for a missing or unreadable list)."""
    if not raw:
        return []
    try:
        names, probs = orjson.loads(raw)
        return [(str(b), float(p)) for b, p in zip(names, probs, strict=True)]
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return []


class UserWindows:
    """Each user's last distinct clicks, newest first, bounded in users (LRU)."""

    def __init__(self, users: int, window: int, window_ms: int, max_pairs: int) -> None:
        self.users, self.window, self.window_ms, self.max_pairs = (
            users,
            window,
            window_ms,
            max_pairs,
        )
        self._windows: OrderedDict[str, deque[tuple[str, int]]] = OrderedDict()

    def __contains__(self, user: str) -> bool:
        return user in self._windows

    def seed(self, user: str, clicks: Iterable[tuple[str, int]]) -> None:
        """Start ``user``'s window from clicks known elsewhere (newest first)."""
        window: deque[tuple[str, int]] = deque(maxlen=self.window)
        seen: set[str] = set()
        for item, ts in clicks:
            if item not in seen and len(window) < self.window:
                seen.add(item)
                window.append((item, ts))
        self._windows[user] = window
        self._trim()

    def pairs(self, user: str, item: str, ts: int) -> list[str]:
        """The items ``user``'s click on ``item`` at ``ts`` pairs with (newest first); the
        click then joins the window."""
        window = self._windows.get(user)
        if window is None:
            window = self._windows[user] = deque(maxlen=self.window)
            self._trim()
        else:
            self._windows.move_to_end(user)
        out = [a for a, ta in window if a != item and ta < ts and ts - ta <= self.window_ms][
            : self.max_pairs
        ]
        for j, (a, _) in enumerate(window):
            if a == item:
                del window[j]
                break
        window.appendleft((item, ts))
        return out

    def _trim(self) -> None:
        while len(self._windows) > self.users:
            self._windows.popitem(last=False)
