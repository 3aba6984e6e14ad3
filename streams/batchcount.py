"""The count stage's event-by-event rule, vectorised over one ``events.by_item`` batch. Pure.

The rule (``ItemPartitionState._apply_each``): an event at or below its source partition's
counted offset is a replay, skipped; one older than the floor it meets minus the grace is
late, dropped; any other counts. The floor is the least watermark — the newest event time
read from a source partition of ``events`` — of the source partitions that hold it
(``watermarks.py``): those of the batch, each at its watermark as it rises event by event,
and the others ``SourceWatermarks.holding`` names, at a level fixed for the batch. Over a
batch (hundreds of events) the same decisions take a few array passes (one row per source
partition of the batch), as long as each source partition's offsets rise within the batch;
the weights are then added with one unbuffered add (``add_counts``), in event order, so
every counter gets the same sums as event by event, bit for bit.

Source 1 lags source 0 by hours of event time; its event at 10 s is late only because it is
also more than the grace (60 s) behind source 1's own progress (80 s):

>>> plan = plan_batch(
...     [0, 0, 1, 1], [4, 5, 9, 10], [1_000, 9_010_000, 10_000, 85_000], {0: 4}, 9_000_000,
...     60_000, ({0: 9_000_000, 1: 80_000}, None))
>>> plan.skip.tolist(), plan.late.tolist()
([True, False, False, False], [False, False, True, False])
>>> plan.applied, plan.watermark_ms, plan.source_ms
({0: 5, 1: 10}, 9010000, {0: 9010000, 1: 85000})
>>> plan.kept, plan.skipped, plan.late_count
([1, 3], 1, 1)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from streams.watermarks import NO_TIME


class BatchPlan(NamedTuple):
    """What the rule decides for each event of a batch, and where the partition stands after."""

    skip: np.ndarray
    """Per event: a replay (at or below its source partition's counted offset)."""
    late: np.ndarray
    """Per event: not a replay, and older than the floor it meets minus the grace."""
    applied: dict[int, int]
    """The new highest offset of each source partition that moved."""
    watermark_ms: int
    """The partition's watermark after the batch: the newest event time counted."""
    source_ms: dict[int, int]
    """Each source partition of the batch's watermark after it (``NO_TIME``: none yet)."""

    @property
    def skipped(self) -> int:
        return int(self.skip.sum())

    @property
    def late_count(self) -> int:
        return int(self.late.sum())

    @property
    def kept(self) -> list[int]:
        """The events that count, by index."""
        return np.flatnonzero(~(self.skip | self.late)).tolist()


def plan_batch(
    parts: list[int],
    offsets: list[int],
    ts_ms: list[int],
    applied: dict[int, int],
    watermark_ms: int,
    grace_ms: int,
    holding: tuple[dict[int, int], int | None],
) -> BatchPlan | None:
    """The rule's decisions for a batch (columns of source partitions, offsets and event
    times) given the offsets counted so far (``applied``), the watermark and what holds the
    floor (``SourceWatermarks.holding``'s answer for the batch's source partitions: their
    watermarks, and the least of the others holding it); None when a source partition's
    offsets do not rise within the batch (rare: the caller goes event by event)."""
    n = len(parts)
    part_a = np.array(parts, np.int64)
    offs = np.array(offsets, np.int64)
    ts = np.array(ts_ms, np.int64)
    # per source partition, in a few passes whatever the number of partitions: offsets
    # must rise within each (else the event-by-event rule: rare), replays are skipped
    order = np.argsort(part_a, kind="stable")
    by_part, by_off = part_a[order], offs[order]
    same = by_part[1:] == by_part[:-1]
    if (same & (by_off[1:] <= by_off[:-1])).any():
        return None
    firsts = np.flatnonzero(np.r_[True, ~same])
    sources = by_part[firsts].tolist()
    done = np.array([applied.get(p, -1) for p in sources], np.int64)
    skip = offs <= done[np.searchsorted(by_part[firsts], part_a)]
    lasts = by_off[np.r_[firsts[1:], n] - 1]  # each partition's highest offset
    last = {p: int(o) for p, o, d in zip(sources, lasts, done, strict=True) if o > d}
    floor, source_ms = _floors(part_a, ts, skip, sources, holding)
    late = ~skip & (ts < floor - grace_ms)
    kept = ts[~(skip | late)]
    newest = max(watermark_ms, int(kept.max())) if len(kept) else watermark_ms
    return BatchPlan(skip, late, last, newest, source_ms)


def floors(
    parts: list[int],
    ts_ms: list[int],
    skip: list[bool],
    holding: tuple[dict[int, int], int | None],
) -> tuple[np.ndarray, dict[int, int]]:
    """The floor each of a record's entries meets (in order; ``skip``: replays, which move
    no watermark) and each source partition's watermark after the record: the rule
    ``plan_batch`` applies, for a record whose offsets need not rise (co-visitation pairs).

    >>> floor, after = floors([1, 1], [5_000, 9_000], [False, False], ({1: 4_000}, 7_000))
    >>> floor.tolist(), after
    ([4000, 5000], {1: 9000})
    """
    part_a = np.array(parts, np.int64)
    sources = np.unique(part_a).tolist()
    return _floors(part_a, np.array(ts_ms, np.int64), np.array(skip, bool), sources, holding)


def _floors(
    part_a: np.ndarray,
    ts: np.ndarray,
    skip: np.ndarray,
    sources: list[int],
    holding: tuple[dict[int, int], int | None],
) -> tuple[np.ndarray, dict[int, int]]:
    """The floor each event meets, and each source partition's watermark after the batch:
    one row per source partition of the batch, its watermark before each event (the newest
    earlier event time of it not skipped; late ones never raise it: they lie below it)."""
    start, others = holding
    before = np.array([start[p] for p in sources], np.int64)
    mine = np.where(part_a == np.array(sources, np.int64)[:, None], ts, NO_TIME)
    mine[:, skip] = NO_TIME
    np.maximum.accumulate(mine, axis=1, out=mine)
    met = np.empty_like(mine)
    met[:, 0] = before
    np.maximum(mine[:, :-1], before[:, None], out=met[:, 1:])
    floor = met.min(axis=0)
    if others is not None:
        np.minimum(floor, others, out=floor)
    after = np.maximum(mine[:, -1], before).tolist()
    return floor, dict(zip(sources, after, strict=True))


def add_counts(
    counts: np.ndarray,
    slots: np.ndarray,
    codes: np.ndarray,
    weights: np.ndarray,
    scopes: np.ndarray | None = None,
) -> None:
    """Add each event's weight to ``counts`` ([item, scope, kind], C-contiguous: the adds go
    through a flat view) at its item's global counter and, where ``scopes`` gives it one
    (non-zero), at its scope's, in event order.

    >>> counts = np.zeros((2, 2, 3))
    >>> add_counts(counts, np.array([1, 1]), np.array([0, 2]), np.array([0.5, 2.0]),
    ...            np.array([0, 1]))
    >>> counts[1].tolist()
    [[0.5, 0.0, 2.0], [0.0, 0.0, 2.0]]
    """
    flat = counts.reshape(-1)  # a view, so the adds land in counts
    n_scopes = counts.shape[1]
    np.add.at(flat, slots * (n_scopes * 3) + codes, weights)
    if scopes is not None:
        regional = np.flatnonzero(scopes)
        at = (slots[regional] * n_scopes + scopes[regional]) * 3 + codes[regional]
        np.add.at(flat, at, weights[regional])
