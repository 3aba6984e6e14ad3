"""Cached results for the degradation ladder: per user and context, with a TTL, invalid as
soon as the user's embedding version changes (a click moved them). Pure: time passed in.

>>> c = ResultCache(capacity=2, ttl_ms=1000)
>>> c.put(("u1", "pc", "north"), version=3, items=["a"], now_ms=0)
>>> c.get(("u1", "pc", "north"), version=3, now_ms=10)
['a']
>>> c.get(("u1", "pc", "north"), version=4, now_ms=10) is None  # the user learnt since
True
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any


class ResultCache:
    def __init__(self, capacity: int = 100_000, ttl_ms: int = 3_600_000) -> None:
        if capacity < 1 or ttl_ms <= 0:
            raise ValueError("capacity and ttl_ms must be positive")
        self.capacity = capacity
        self.ttl_ms = ttl_ms
        self._entries: OrderedDict[Hashable, tuple[int, int, Any]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: Hashable, version: int, items: Any, now_ms: int) -> None:
        self._entries[key] = (version, now_ms + self.ttl_ms, items)
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, key: Hashable, version: int, now_ms: int) -> Any | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        held_version, expires, items = entry
        if held_version != version or now_ms >= expires:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return items

    def peek_valid(self, key: Hashable, version: int, now_ms: int) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry[0] == version and now_ms < entry[1]
