"""Items a user was just shown, held back from that user's next lists for a while, so that a
refresh shows something new (seed A: a user pulling again should not get the same list).
Pure: the caller gives the time.

>>> s = ShownItems(hold_ms=1000, users=2)
>>> s.shown("u", ["a", "b"], now_ms=0); s.shown("u", ["c"], now_ms=600)
>>> s.held("u", now_ms=900), s.held("u", now_ms=1200), s.held("v", now_ms=0)
(['a', 'b', 'c'], ['c'], [])
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import replace

from schemas.records import RecommendRequest


class ShownItems:
    def __init__(self, hold_ms: int, users: int, per_user: int = 200) -> None:
        """``hold_ms``: how long an item shown to a user is held back from them (0: never);
        the most recently served ``users`` users are remembered, each with at most
        ``per_user`` items (the oldest leave first): memory stays bounded whoever asks."""
        if hold_ms < 0 or users < 1 or per_user < 1:
            raise ValueError("hold_ms must be >= 0, users and per_user >= 1")
        self.hold_ms = hold_ms
        self.users = users
        self.per_user = per_user
        self._lists: OrderedDict[str, deque[tuple[int, str]]] = OrderedDict()

    def hold_for(self, hold_ms: int) -> None:
        """Hold shown items back for ``hold_ms`` from now on (a serving mode's); what was
        shown is remembered across the change."""
        if hold_ms < 0:
            raise ValueError("hold_ms must be >= 0")
        self.hold_ms = hold_ms

    def shown(self, user_id: str, items: Sequence[str], now_ms: int) -> None:
        if not self.hold_ms or not items:
            return
        q = self._lists.pop(user_id, None)
        if q is None:
            q = deque(maxlen=self.per_user)
        q.extend((now_ms, i) for i in items)
        self._lists[user_id] = q
        while len(self._lists) > self.users:
            self._lists.popitem(last=False)

    def held(self, user_id: str, now_ms: int) -> list[str]:
        """The items shown to the user within the hold, oldest first, each once."""
        q = self._lists.get(user_id)
        if not q:
            return []
        while q and now_ms - q[0][0] >= self.hold_ms:
            q.popleft()
        return list(dict.fromkeys(i for _, i in q))


def with_held(request: RecommendRequest, held: list[str]) -> RecommendRequest:
    """``request`` with the held-back items added to its ``exclude``.

    >>> with_held(RecommendRequest("r", "u", exclude=("x",)), ["y", "x"]).exclude
    ('x', 'y')
    """
    if not held:
        return request
    return replace(request, exclude=tuple(dict.fromkeys((*request.exclude, *held))))
