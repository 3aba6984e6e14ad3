"""Feedback on served recommendations: impressions, clicks and conversions that name a
reply's ``request_id``, counted by the tier that served it. Pure.

The worker remembers the tier of its recent replies (a bounded window, oldest forgotten
first) and, as it reads events, counts each event that names a request by that request's
tier: ``unknown`` when the reply is not in its window (served by another worker, or too long
ago). An event without a ``request_id`` is not feedback on a recommendation and is not
counted. CTR is clicks over impressions, CVR conversions over clicks.

>>> f = Feedback(capacity=2)
>>> f.served("r1", "full"); f.served("r2", "hot")
>>> sorted(f.count([("impression", "r1"), ("click", "r1"), ("impression", "r9"),
...                 ("click", None), ("impression", "r2")]).items())
[(('click', 'full'), 1), (('impression', 'full'), 1), (('impression', 'hot'), 1), (('impression', 'unknown'), 1)]
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

KINDS = ("impression", "click", "conversion")
UNKNOWN = "unknown"


class Feedback:
    def __init__(self, capacity: int = 100_000) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._tiers: OrderedDict[str, str] = OrderedDict()

    def served(self, request_id: str, tier: str) -> None:
        """A reply to ``request_id`` went out from ``tier``."""
        tiers = self._tiers
        tiers[request_id] = tier
        tiers.move_to_end(request_id)
        if len(tiers) > self.capacity:
            tiers.popitem(last=False)

    def count(self, events: Iterable[tuple[str, str | None]]) -> Counter:
        """(event type, request id) pairs → how many of each (type, tier); types other than
        impressions, clicks and conversions, and events naming no request, are left out."""
        out: Counter = Counter()
        get = self._tiers.get
        for kind, request_id in events:
            if request_id and kind in KINDS:
                out[(kind, get(request_id, UNKNOWN))] += 1
        return out

    def __len__(self) -> int:
        return len(self._tiers)
