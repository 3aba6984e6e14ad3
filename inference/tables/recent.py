"""Each user's last clicked items, newest first, bounded per user and in users. Pure.

The worker sees every event of its users' partitions, so a click is remembered here before any
other service has seen it: the i2i channel and the recent-category feature read it, and with
a larger bound per user, what a request's ``exclude_seen`` leaves out (``with_seen``).

>>> from types import SimpleNamespace as E
>>> r = RecentClicks(users=2, per_user=2)
>>> r.remember([E(user_id="a", item_id="x", event_type="click"),
...             E(user_id="a", item_id="y", event_type="conversion"),
...             E(user_id="a", item_id="z", event_type="impression"),
...             E(user_id="a", item_id="x", event_type="click")])
>>> r.get("a"), r.get("nobody")
(['x', 'y'], [])
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from inference.tables.shown import with_held
from schemas.records import RecommendRequest


class RecentClicks:
    def __init__(self, users: int, per_user: int = 10) -> None:
        self.users = users
        self.per_user = per_user
        self._by_user: OrderedDict[str, deque[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_user)

    def remember(self, events) -> None:
        """Clicks and conversions of ``events`` (anything with ``user_id``, ``item_id`` and
        ``event_type``), in order; impressions are not clicks."""
        by_user = self._by_user
        for e in events:
            if e.event_type == "impression":
                continue
            q = by_user.get(e.user_id)
            if q is None:
                q = by_user[e.user_id] = deque(maxlen=self.per_user)
                if len(by_user) > self.users:
                    by_user.popitem(last=False)
            else:
                by_user.move_to_end(e.user_id)
            if e.item_id in q:
                q.remove(e.item_id)
            q.appendleft(e.item_id)

    def get(self, user_id: str) -> list[str]:
        return list(self._by_user.get(user_id, ()))


def with_seen(
    request: RecommendRequest, seen: Callable[[str], list[str]], default: bool
) -> RecommendRequest:
    """``request`` with the user's consumed items added to its ``exclude`` when it asks for
    that (``exclude_seen``; absent: ``default``).

    >>> r = RecommendRequest("r1", "a", exclude=("x",), exclude_seen=True)
    >>> with_seen(r, lambda u: ["y", "x"], default=False).exclude
    ('x', 'y')
    >>> with_seen(RecommendRequest("r2", "a"), lambda u: ["y"], default=False).exclude
    ()
    """
    wanted = default if request.exclude_seen is None else request.exclude_seen
    if not wanted:
        return request
    return with_held(request, seen(request.user_id))
