"""Which event offsets a worker may commit: those whose gradients the broker holds. Pure.

A worker learns a slice of events, and their gradients leave later: summed in the outbox for
up to ``FRESHREC_GRADIENT_LINGER_MS``, then handed to the producer, then acknowledged by the
broker. Committing an event's offset before its gradients are acknowledged would lose them to
a crash in between (the next owner of the partition starts after the committed offset, and
the producer's queue died with the process). So offsets wait here:

- ``learnt(key, offset)``: events of ``key`` (topic, partition) up to ``offset`` are learnt;
  their gradients are in the outbox or already produced;
- ``produced(token)`` / ``reported(token)``: a gradient message left, and the broker took it
  (a failed delivery is produced again, ``gradients.py``, and reported only once it is in).
  Tokens rise with every message;
- ``withdraw(token)``: the message was taken back before the broker had it (a rebalance):
  the events behind it are not this worker's to commit;
- ``seal()``: everything learnt so far has its gradients produced (the outbox was just
  sent): the learnt offsets wait for the messages produced up to now;
- ``ready()``: the offsets of every sealed group whose messages have all been reported.

Gradients held back by admission (threshold above 1) are not messages yet: their events
commit without them, as the touch counts themselves live in memory only.

>>> g = OffsetGate()
>>> g.learnt(("events", 0), 10); g.produced(1); g.seal()
>>> g.ready()
{}
>>> g.reported(1); g.ready()
{('events', 0): 10}
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable


class OffsetGate:
    def __init__(self) -> None:
        self._learnt: dict[Hashable, int] = {}
        self._sealed: deque[tuple[int, dict[Hashable, int]]] = deque()
        self._open: set[int] = set()  # produced, not reported
        self._last = 0  # the last token produced

    def learnt(self, key: Hashable, offset: int) -> None:
        self._learnt[key] = max(self._learnt.get(key, offset), offset)

    def produced(self, token: int) -> None:
        if token <= self._last:
            raise ValueError(f"tokens rise: {token} after {self._last}")
        self._open.add(token)
        self._last = token

    def reported(self, token: int) -> None:
        self._open.discard(token)

    def withdraw(self, token: int) -> None:
        """Message ``token`` will never be delivered: every sealed group that waits for it
        (those sealed after it was produced) is dropped, never to be committed.

        >>> g = OffsetGate()
        >>> g.learnt("p", 5); g.produced(1); g.seal(); g.learnt("p", 9); g.produced(2); g.seal()
        >>> g.reported(1); g.withdraw(2); g.ready()
        {'p': 5}
        """
        self._open.discard(token)
        self._sealed = deque((last, offsets) for last, offsets in self._sealed if last < token)

    def seal(self) -> None:
        if self._learnt:
            self._sealed.append((self._last, self._learnt))
            self._learnt = {}

    def ready(self) -> dict[Hashable, int]:
        oldest_open = min(self._open, default=math.inf)
        out: dict[Hashable, int] = {}
        while self._sealed and self._sealed[0][0] < oldest_open:
            for key, offset in self._sealed.popleft()[1].items():
                out[key] = max(out.get(key, offset), offset)
        return out

    def waiting(self) -> int:
        """Sealed groups whose messages are not all reported yet."""
        return len(self._sealed)

    def forget(self, keys: Iterable[Hashable]) -> None:
        """Partitions no longer this worker's: their offsets are not its to commit."""
        gone = set(keys)
        for offsets in (self._learnt, *(o for _, o in self._sealed)):
            for key in gone & offsets.keys():
                del offsets[key]


class RequestOffsets:
    """Per partition of ``recommend.requests``: the offset below which every request is done
    (answered and the reply delivered, or dropped as expired, duplicate or failed). Pure.

    Requests finish out of order: a batch's replies go to different reply topics, an
    expired request is done at once while an earlier one's reply is in flight. Committing
    past a request still in flight would lose it to a crash: the partition's next owner
    would start after it. So the committable offset is the lowest one still open, or, with
    none open, one past the last done.

    >>> r = RequestOffsets()
    >>> r.accepted(0, 3); r.accepted(0, 4); r.done(0, 4)
    >>> r.committable()
    {0: 3}
    >>> r.done(0, 3); r.committable()
    {0: 5}
    """

    def __init__(self) -> None:
        self._open: dict[int, set[int]] = {}
        self._next: dict[int, int] = {}

    def accepted(self, partition: int, offset: int) -> None:
        self._open.setdefault(partition, set()).add(offset)

    def done(self, partition: int, offset: int) -> None:
        """A request that was never ``accepted`` (its partition forgotten) is ignored."""
        open_ = self._open.get(partition)
        if open_ is None or offset not in open_:
            return
        open_.discard(offset)
        self._next[partition] = max(self._next.get(partition, 0), offset + 1)

    def committable(self) -> dict[int, int]:
        out = {}
        for partition, open_ in self._open.items():
            if open_:
                out[partition] = min(open_)
            elif partition in self._next:
                out[partition] = self._next[partition]
        return out

    def forget(self, partitions: Iterable[int]) -> None:
        for partition in partitions:
            self._open.pop(partition, None)
            self._next.pop(partition, None)
