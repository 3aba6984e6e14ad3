"""Event time per source partition of ``events``, and the lateness floor it gives. Pure.

An ``events.by_item`` partition reads the events of every source partition of ``events``,
interleaved as the validate stage drained them. Live, the source partitions keep pace with
each other; in a catch-up (a replay, a restart after an outage) one may be hours of event
time ahead of another, and an event time taken from the newest event read would make the
lagging partitions' events late. So lateness is judged against the least progress of the
inputs, as Flink advances an operator's watermark by the least of its inputs' watermarks:
``SourceWatermarks`` keeps, per source partition, the newest event time read from it (its
watermark) and when, in processing time, it last delivered. The floor is the least
watermark of the source partitions that hold it, and an event more than the grace older
than the floor is late.

A source partition sends two streams, each in its own order: its events, and its clicks'
co-visitation pairs, which the validate stage writes after a batch's events (in a backlog
a batch spans hours of event time, so its pairs lag its events by as much). Each stream is
a channel with a watermark of its own: channel p for the events of source partition p,
``pairs_channel(p)`` for its pairs. A channel holds the floor:

- while it delivers (those of the record being counted, at their watermarks as they rise);
- while it is known — an events channel from the topic's partition count, given at start,
  any channel once seen — and has delivered within ``idle_ms`` of processing time (Flink's
  ``withIdleness``): at its watermark, or at −∞ (``NO_TIME``: nothing is late) while it has
  delivered nothing. A partition without traffic stops holding lateness off after
  ``idle_ms``.

Since its own channel always holds the floor, an event is late only if it is more than the
grace behind its own stream's progress too: a backlog drained in order loses nothing,
however fast and unevenly its partitions are read.

Time is passed in: event times, and processing time (``now_ms``, any clock that does not
jump; the app passes a monotonic one). Nothing here reads a clock.

>>> w = SourceWatermarks(partitions=2, idle_ms=60_000)
>>> w.holding(0, [0])        # partition 1 has delivered nothing yet: it holds the floor at −∞
({0: -4611686018427387904}, -4611686018427387904)
>>> w.delivered(0, [0], {0: 7_200_000})
>>> w.holding(30_000, [1])   # partition 1 starts from nothing; 0 still holds at its watermark
({1: -4611686018427387904}, 7200000)
>>> w.floor_ms(90_000)       # both idle: the newest watermark (nothing delivering holds it)
7200000
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

NO_TIME = -(2**62)
"""The watermark of a source partition that has delivered nothing: every event is on time
against it. Far below any event time, and a grace below it still fits in 64 bits."""


def pairs_channel(partition: int) -> int:
    """The channel of a source partition's co-visitation pairs (its events are channel
    ``partition``).

    >>> pairs_channel(0), pairs_channel(3)
    (-1, -4)
    """
    return -1 - partition


class SourceWatermarks:
    """Per channel (a source partition of ``events``'s events or pairs): its watermark and
    when it last delivered."""

    def __init__(
        self, partitions: int | None, idle_ms: int, newest_ms: Mapping[int, int] | None = None
    ) -> None:
        self.partitions = partitions
        """The partition count of ``events``; None: only the channels seen are known."""
        self.idle_ms = idle_ms
        self.newest_ms: dict[int, int] = dict(newest_ms or {})
        """Per channel, the newest event time read from it (not replays)."""
        self.delivered_ms: dict[int, int] = {}
        """Per channel, the processing time it last delivered."""
        self.since_ms: int | None = None
        """The processing time of the first batch: the partitions known but silent count
        as idle from then."""
        self.now_ms = 0
        """The latest processing time given (a call without one reuses it)."""

    def clock(self, now_ms: int | None) -> int:
        """``now_ms``, or the latest one given; the first sets ``since_ms``."""
        if now_ms is not None:
            self.now_ms = max(self.now_ms, now_ms)
        if self.since_ms is None:
            self.since_ms = self.now_ms
        return self.now_ms

    def known(self) -> set[int]:
        """The channels that exist as far as this state knows."""
        out = set(self.newest_ms) | set(self.delivered_ms)
        if self.partitions is not None:
            out.update(range(self.partitions))
        return out

    def holding(
        self, now_ms: int | None, delivering: Iterable[int]
    ) -> tuple[dict[int, int], int | None]:
        """For a record from the channels ``delivering``: each one's watermark before it
        (``NO_TIME`` for one that delivered nothing yet), and the least watermark of the
        others that hold the floor (``NO_TIME``: one of them has delivered nothing yet;
        None: none of them holds it)."""
        now = self.clock(now_ms)
        start = {p: self.newest_ms.get(p, NO_TIME) for p in dict.fromkeys(delivering)}
        since = self.since_ms
        others = [
            self.newest_ms.get(p, NO_TIME)
            for p in self.known()
            if p not in start and now - self.delivered_ms.get(p, since) < self.idle_ms
        ]
        return start, min(others, default=None)

    def floor_ms(self, now_ms: int | None = None) -> int | None:
        """The floor now, for no channel of its own (the metric): the least watermark of
        the channels holding it; with none holding it, the newest watermark, as Flink's
        watermark valve emits the greatest when all its inputs are idle (None: none known,
        nothing is late)."""
        _, others = self.holding(now_ms, ())
        if others is None:
            return max(self.newest_ms.values(), default=None)
        return others

    def delivered(
        self, now_ms: int | None, delivering: Iterable[int], newest: Mapping[int, int]
    ) -> None:
        """The channels ``delivering`` delivered at ``now_ms``; ``newest``: their watermarks
        after it (``NO_TIME`` ones are not watermarks; a watermark never falls)."""
        now = self.clock(now_ms)
        for p in delivering:
            self.delivered_ms[p] = now
        for p, t in newest.items():
            if t != NO_TIME and t > self.newest_ms.get(p, NO_TIME):
                self.newest_ms[p] = t
