"""A bounded window of recently seen event ids: a replay inside the window counts once. Pure.

>>> w = DedupeWindow(capacity=2)
>>> w.first_time("a"), w.first_time("a"), w.first_time("b"), w.first_time("c"), w.first_time("a")
(True, False, True, True, True)
"""

from __future__ import annotations

from collections import OrderedDict


class DedupeWindow:
    """The last ``capacity`` distinct ids, oldest evicted first."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("dedupe capacity must be >= 1")
        self.capacity = capacity
        self._seen: OrderedDict[str, None] = OrderedDict()

    def first_time(self, event_id: str) -> bool:
        """True, and remember it, unless ``event_id`` is in the window."""
        seen = self._seen
        if event_id in seen:
            return False
        seen[event_id] = None
        if len(seen) > self.capacity:
            seen.popitem(last=False)
        return True

    def first_times(self, event_ids: list[str]) -> list[bool]:
        """``first_time`` of each id in turn (a repeat inside the list is a duplicate too);
        the oldest are evicted once, after the list, so the window briefly holds up to
        ``capacity + len(event_ids)`` ids: it forgets nothing sooner than ``first_time``."""
        seen = self._seen
        fresh = []
        for event_id in event_ids:
            if event_id in seen:
                fresh.append(False)
            else:
                seen[event_id] = None
                fresh.append(True)
        for _ in range(len(seen) - self.capacity):
            seen.popitem(last=False)
        return fresh

    def forget(self, event_ids) -> None:
        """Take ids out of the window: their events were not processed after all (a failed
        attempt to be retried), so the retry is a first time.

        >>> w = DedupeWindow(capacity=4)
        >>> w.first_time("a"); w.forget(["a"]); w.first_time("a")
        True
        True
        """
        for event_id in event_ids:
            self._seen.pop(event_id, None)

    def __len__(self) -> int:
        return len(self._seen)
