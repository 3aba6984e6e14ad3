"""Admission of rows to the parameter server, with expiry. Pure.

Monolith's occurrence filter: a row's gradients are only sent once it has been touched
``threshold`` times; before that its steps stay local. Counts live in two generations that
rotate every ``window_ms``: a row unseen for a whole window is forgotten — its count starts
over and its held gradients are dropped — so memory is bounded by the rows touched within two
windows, not by every row ever seen. With ``threshold`` 1 every row is admitted at once and
nothing is kept.

>>> f = AdmissionFilter(threshold=2, window_ms=1_000)
>>> f.touch("a", 0), f.touch("a", 10)
(False, True)
>>> f.touch("b", 20)
False
>>> f.rotate(1_000)  # nothing forgotten yet: a and b are in the previous generation
[]
>>> sorted(f.rotate(2_000))  # unseen for a whole window
['a', 'b']
>>> f.touch("b", 2_010)  # starts over
False
"""

from __future__ import annotations

from collections.abc import Hashable


class AdmissionFilter:
    def __init__(self, threshold: int, window_ms: int) -> None:
        if threshold < 1 or window_ms <= 0:
            raise ValueError("threshold must be >= 1 and window_ms > 0")
        self.threshold = threshold
        self.window_ms = window_ms
        self.current: dict[Hashable, int] = {}
        self.previous: dict[Hashable, int] = {}
        self.rotated_ms: int | None = None

    def __len__(self) -> int:
        return len(self.current) + len(self.previous)

    def touch(self, ref: Hashable, now_ms: int) -> bool:
        """Count one touch; True once the row is admitted (and on every touch after)."""
        if self.threshold == 1:
            return True
        if self.rotated_ms is None:
            self.rotated_ms = now_ms
        count = self.current.get(ref)
        if count is None:
            count = self.previous.pop(ref, 0)
        count = min(count + 1, self.threshold)
        self.current[ref] = count
        return count >= self.threshold

    def rotate(self, now_ms: int) -> list[Hashable]:
        """Start a new generation when a window has passed; returns the rows forgotten
        (untouched for a whole window), whose held gradients the caller drops."""
        if self.rotated_ms is None:
            self.rotated_ms = now_ms
            return []
        if now_ms - self.rotated_ms < self.window_ms:
            return []
        forgotten = list(self.previous)
        self.previous, self.current = self.current, {}
        self.rotated_ms = now_ms
        return forgotten
