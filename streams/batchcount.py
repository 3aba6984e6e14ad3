"""The count stage's event-by-event rule, vectorised over one ``events.by_item`` batch. Pure.

The rule (``ItemPartitionState._apply_each``): an event at or below its source partition's
counted offset is a replay, skipped; one older than the watermark it meets minus the grace is
late, dropped; any other counts, and the watermark is the newest event time counted so far.
Over a batch (hundreds of events) the same decisions take a few array passes whatever the
number of source partitions (``plan_batch``), as long as each source partition's offsets rise
within the batch; the weights are then added with one unbuffered add (``add_counts``), in
event order, so every counter gets the same sums as event by event, bit for bit.

>>> plan = plan_batch([0, 0, 1], [4, 5, 9], [1_000, 90_000, 2_000], {0: 4}, 0, 60_000)
>>> plan.skip.tolist(), plan.late.tolist(), plan.applied, plan.watermark_ms
([True, False, False], [False, False, True], {0: 5, 1: 9}, 90000)
>>> plan.kept, plan.skipped, plan.late_count
([1], 1, 1)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class BatchPlan(NamedTuple):
    """What the rule decides for each event of a batch, and where the partition stands after."""

    skip: np.ndarray
    """Per event: a replay (at or below its source partition's counted offset)."""
    late: np.ndarray
    """Per event: not a replay, and older than the watermark it meets minus the grace."""
    applied: dict[int, int]
    """The new highest offset of each source partition that moved."""
    watermark_ms: int
    """The partition's watermark after the batch."""

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
) -> BatchPlan | None:
    """The rule's decisions for a batch (columns of source partitions, offsets and event
    times) given the offsets counted so far (``applied``) and the watermark; None when a
    source partition's offsets do not rise within the batch (rare: the caller goes event by
    event)."""
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
    # the watermark each event meets: the newest earlier event time among those not
    # skipped (late ones never raise it: they lie below it)
    met = np.maximum.accumulate(np.where(skip, watermark_ms, ts))
    before = np.empty_like(met)
    before[0] = watermark_ms
    np.maximum(met[:-1], watermark_ms, out=before[1:])
    late = ~skip & (ts < before - grace_ms)
    return BatchPlan(skip, late, last, int(max(met[-1], watermark_ms)))


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
