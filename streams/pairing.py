"""The pairs a validate batch's clicks make, as ``events.by_item`` records: co-visitation
(``covisit.py``) and sequential rules (``freshcore/sequels.py``). Pure: no I/O (the windows
of users it holds none for are seeded by the caller, from their recent clicks in Redis).

A click's co-visitation pairs travel both ways, (a, b) and (b, a); its sequential rules one
way, a → b for each item a it follows, at its distance d (``PAIR_DISTANCE``; 0 for a
co-visitation pair). Each pair goes to its anchor's partition, one record per partition
(``PAIR_COLUMNS`` and the distance), in click order, a click's pairs never split between two
records: the count stage skips a replayed click's pairs by its source offset.

>>> pairs = ClickPairs(CoVisitConfig(window=5, max_pairs=5, sequel_steps=2))
>>> pairs.pairs("u", "a", 1_000), pairs.pairs("u", "b", 2_000)
([], [('b', 'a', 0), ('a', 'b', 0), ('a', 'b', 1)])
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import pairwise

import numpy as np

from freshcore.partitioner import str_partitions
from freshcore.sequels import UserSequences
from streams.byitem import run_bounds, split_records
from streams.covisit import PAIR_COLUMNS, PAIR_DISTANCE, CoVisitConfig, UserWindows

RECORD_COLUMNS = (*PAIR_COLUMNS, PAIR_DISTANCE)
"""A pair record's columns: anchor, neighbour, source partition, source offset, event time,
distance."""


class ClickPairs:
    """Per user, the windows a click pairs against: its last distinct clicks (co-visitation)
    and the last items of its sequence (sequential rules); either off by its setting."""

    def __init__(self, config: CoVisitConfig) -> None:
        cv = config
        self.windows = (
            UserWindows(cv.users, cv.window, cv.window_ms, cv.max_pairs) if cv.max_pairs else None
        )
        self.sequences = UserSequences(cv.users, cv.sequel_steps) if cv.sequel_steps else None

    @property
    def on(self) -> bool:
        """Whether clicks make any pairs."""
        return self.windows is not None or self.sequences is not None

    def unknown(self, users: Iterable[str]) -> list[str]:
        """The ``users`` (distinct, in order) a window of theirs is missing for."""
        w, s = self.windows, self.sequences
        return list(
            dict.fromkeys(
                u for u in users if (w is not None and u not in w) or (s is not None and u not in s)
            )
        )

    def seed(self, user: str, clicks: list[tuple[str, int]]) -> None:
        """Start ``user``'s missing windows from their recent clicks (item, time), newest
        first."""
        if self.windows is not None and user not in self.windows:
            self.windows.seed(user, clicks)
        if self.sequences is not None and user not in self.sequences:
            self.sequences.seed(user, clicks)

    def pairs(self, user: str, item: str, ts: int) -> list[tuple[str, str, int]]:
        """The pairs (anchor, neighbour, distance) of ``user``'s click on ``item`` at ``ts``;
        the click then joins the user's windows."""
        out = []
        if self.windows is not None:
            for a in self.windows.pairs(user, item, ts):
                out += [(item, a, 0), (a, item, 0)]
        if self.sequences is not None:
            out += [(a, item, d) for a, d in self.sequences.follows(user, item, ts)]
        return out

    def records(
        self, parts: list[int], offsets: list[int], clicks: list, partitions: int
    ) -> list[tuple[int, bytes]]:
        """The pair records of ``clicks`` (events, in order; ``parts`` and ``offsets`` their
        source partitions and offsets) for ``partitions`` by-item partitions: (partition,
        record), in order."""
        cols: tuple[list, ...] = ([], [], [], [], [], [])
        for e, p, o in zip(clicks, parts, offsets, strict=True):
            for a, b, d in self.pairs(e.user_id, e.item_id, e.ts_ms):
                for col, v in zip(cols, (a, b, p, o, e.ts_ms, d), strict=True):
                    col.append(v)
        if not cols[0]:
            return []
        q = str_partitions(cols[0], partitions)
        order = np.argsort(q, kind="stable")  # a click's pairs stay together, in order
        q = q[order]
        columns = [np.array(c, object if k < 2 else np.int64)[order] for k, c in enumerate(cols)]
        src = columns[2] * (1 << 40) + columns[3]  # one value per click
        starts = np.flatnonzero(np.r_[True, src[1:] != src[:-1]])
        return [
            (int(q[lo]), value)
            for lo, hi in pairwise(run_bounds(q))
            for value in split_records(columns, lo, hi, RECORD_COLUMNS, starts)
        ]
