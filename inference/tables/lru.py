"""Slot allocation for a fixed-capacity slab with least-recently-used eviction. Pure.

>>> lru = SlotLRU(2)
>>> lru.admit("a"), lru.admit("b"), lru.get("a"), lru.admit("c")
((0, None), (1, None), 0, (1, 'b'))
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class SlotLRU:
    """Maps keys to slots 0..capacity-1; admitting into a full slab evicts the LRU key."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._slots: OrderedDict[Hashable, int] = OrderedDict()
        self._free: list[int] = []
        self._next = 0

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slots

    def get(self, key: Hashable) -> int | None:
        """The key's slot, marking it most recently used; None if absent."""
        slot = self._slots.get(key)
        if slot is not None:
            self._slots.move_to_end(key)
        return slot

    def peek(self, key: Hashable) -> int | None:
        return self._slots.get(key)

    def admit(self, key: Hashable) -> tuple[int, Hashable | None]:
        """A slot for a new key, and the key it evicted (None if a free slot was used)."""
        if key in self._slots:
            return self.get(key), None
        if self._free:
            slot, evicted = self._free.pop(), None
        elif self._next < self.capacity:
            slot, evicted = self._next, None
            self._next += 1
        else:
            evicted, slot = self._slots.popitem(last=False)
        self._slots[key] = slot
        return slot, evicted

    def discard(self, key: Hashable) -> None:
        """Forget a key (its row could not be loaded); its slot is reused next."""
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._free.append(slot)
