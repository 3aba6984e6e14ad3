"""Event time that survives a catch-up (``streams/watermarks.py``): lateness is judged against
the least progress of the source partitions of ``events``, not against the newest event of
one of them, so a backlog drained at speed and unevenly loses nothing within the grace."""

from __future__ import annotations

import numpy as np
import pytest

from streams.decay import HOUR_MS
from streams.item_state import CLICK, ItemPartitionState, StateConfig
from streams.watermarks import NO_TIME, SourceWatermarks, pairs_channel

T0 = 1_767_225_600_000
GRACE_MS = 10 * 60_000
IDLE_MS = 60_000


def state(partitions: int | None = 2) -> ItemPartitionState:
    return ItemPartitionState(
        StateConfig(late_grace_ms=GRACE_MS, watermark_idle_ms=IDLE_MS, source_partitions=partitions)
    )


def backlog(part: int, first_offset: int, t_from: int, hours: int, every_ms: int = 10_000):
    """A source partition's events in order, one every ``every_ms`` over ``hours``."""
    n = hours * HOUR_MS // every_ms
    return [
        (part, first_offset + j, f"i{j % 37}", CLICK, t_from + j * every_ms, None, 0.0)
        for j in range(n)
    ]


def drain(s: ItemPartitionState, events: list, batch: int, now_ms: int, step_ms: int = 50) -> int:
    """Count ``events`` in batches of ``batch``, processing time advancing ``step_ms`` a
    batch (a backlog read far faster than real time); returns the processing time after."""
    for lo in range(0, len(events), batch):
        s.apply(events[lo : lo + batch], now_ms)
        now_ms += step_ms
    return now_ms


@pytest.mark.parametrize("batch", [5, 300])  # the event-by-event path and the vectorised one
def test_two_partitions_drained_unevenly_lose_nothing_within_the_grace(batch):
    """Partition 0's whole backlog (three hours of event time) is read first, then partition
    1's: partition 1's events are hours behind the newest event read, yet none is late,
    and the counts are those of the same events read in event-time order."""
    s = state()
    first, second = backlog(0, 0, T0, 3), backlog(1, 0, T0, 3)
    now = drain(s, first, batch, 0)
    drain(s, second, batch, now)
    assert s.late == 0
    in_order = state()
    interleaved = sorted(first + second, key=lambda e: (e[4], e[0]))
    in_order.apply(interleaved, 0)
    assert in_order.late == 0
    t = T0 + 3 * HOUR_MS
    for item, slot in s.slots.items():
        assert s.decayed_clicks(t)[slot, 0] == pytest.approx(
            in_order.decayed_clicks(t)[in_order.slots[item], 0], rel=1e-12
        )
    assert s.sources.newest_ms == {0: first[-1][4], 1: second[-1][4]}
    assert s.watermark_ms == max(first[-1][4], second[-1][4])


def test_events_hours_out_of_order_within_one_partition_are_still_late():
    """Lateness still holds within a source partition: the same two backlogs read as one
    partition (the second after the first, hours back in event time) make the second
    almost all late, as the newest event of one partition made them before."""
    s = state(partitions=None)
    first, second = backlog(0, 0, T0, 3), backlog(0, 10**6, T0, 3)
    drain(s, first + second, 300, 0)
    assert s.late > 0.9 * len(second)


def test_an_event_older_than_every_partitions_progress_minus_the_grace_is_still_dropped():
    s = state()
    now = drain(s, backlog(0, 0, T0, 3), 300, 0)
    now = drain(s, backlog(1, 0, T0, 2), 300, now)  # partition 1 is an hour behind
    end0, end1 = s.sources.newest_ms[0], s.sources.newest_ms[1]
    late = s.late
    # on partition 0, two hours behind its own progress but within the grace of partition 1's
    assert s.apply([(0, 10**6, "a", CLICK, end1 - GRACE_MS + 1000, None, 0.0)], now) == 1
    # older than both partitions' progress minus the grace: late
    assert s.apply([(0, 10**6 + 1, "a", CLICK, end1 - GRACE_MS - 1000, None, 0.0)], now) == 0
    assert s.apply([(1, 10**6, "a", CLICK, end1 - GRACE_MS - 1000, None, 0.0)], now) == 0
    assert s.late == late + 2
    assert s.sources.newest_ms == {0: end0, 1: end1}  # neither moved a watermark
    assert s.late_below_ms(now) == end1 - GRACE_MS


def test_a_partition_that_has_delivered_nothing_holds_the_floor_until_it_is_idle():
    s = state(partitions=2)
    s.apply([(0, 0, "a", CLICK, T0 + HOUR_MS, None, 0.0)], 0)
    # partition 1 has delivered nothing: it holds the floor at −∞, nothing is late
    assert s.apply([(0, 1, "a", CLICK, T0, None, 0.0)], IDLE_MS - 1) == 1
    assert s.late_below_ms(IDLE_MS - 1) == NO_TIME - GRACE_MS
    # idle for IDLE_MS of processing time: it holds nothing back any more
    assert s.apply([(0, 2, "a", CLICK, T0, None, 0.0)], IDLE_MS) == 0
    assert s.late == 1
    # it delivers: its own backlog, from nothing, is on time against its own progress ...
    assert s.apply([(1, 0, "b", CLICK, T0 - HOUR_MS, None, 0.0)], IDLE_MS + 1) == 1
    # ... and, until idle again, it holds partition 0's floor at its watermark
    assert s.apply([(0, 3, "a", CLICK, T0 - HOUR_MS + 1000, None, 0.0)], IDLE_MS + 2) == 1
    assert s.apply([(0, 4, "a", CLICK, T0 - 2 * HOUR_MS, None, 0.0)], IDLE_MS + 3) == 0
    assert s.late_below_ms(IDLE_MS + 3) == T0 - HOUR_MS - GRACE_MS
    assert s.late_below_ms(3 * IDLE_MS) == T0 + HOUR_MS - GRACE_MS  # both idle: the newest


def test_partitions_seen_hold_the_floor_when_the_partition_count_is_unknown():
    s = state(partitions=None)
    s.apply([(0, 0, "a", CLICK, T0 + HOUR_MS, None, 0.0)], 0)
    assert s.apply([(0, 1, "a", CLICK, T0, None, 0.0)], 1) == 0  # only partition 0 is known
    s.apply([(1, 0, "b", CLICK, T0, None, 0.0)], 2)
    assert s.apply([(0, 2, "a", CLICK, T0 + 1000, None, 0.0)], 3) == 1  # 1 holds it at T0


def test_co_visitation_pairs_are_judged_by_the_same_rule_on_channels_of_their_own():
    s = state()
    now = drain(s, backlog(0, 0, T0, 3), 300, 0)
    now = drain(s, backlog(1, 0, T0, 1), 300, now)
    end0, end1 = s.sources.newest_ms[0], s.sources.newest_ms[1]
    newest = s.watermark_ms
    # pairs of the lagging partition, hours behind the newest event: counted
    assert s.apply_pairs(["i1"], ["i2"], [1], [10**6], [end1], now) == 1
    assert s.apply_pairs(["i1"], ["i3"], [0], [10**6], [end0], now) == 1
    # older than every channel's progress minus the grace: late
    assert s.apply_pairs(["i1"], ["i4"], [0], [10**6 + 1], [end1 - GRACE_MS - 1], now) == 0
    assert s.late == 1
    # pairs move their own channel's watermark, not the events' nor the newest event time
    pairs = {p: s.sources.newest_ms[pairs_channel(p)] for p in (0, 1)}
    assert pairs == {0: end0, 1: end1}
    assert s.sources.newest_ms[1] == end1 and s.watermark_ms == newest


def test_a_batchs_pairs_after_its_events_hours_ahead_of_them_are_not_late():
    """The validate stage writes a batch's pairs after its events: in a backlog one batch
    spans hours of event time, so the pairs of its first clicks come after events of the
    same source partition hours newer. On a channel of their own they are on time."""
    s = state(partitions=1)
    events = backlog(0, 0, T0, 3)
    s.apply(events, 0)
    clicks = events[::10]
    n = len(clicks)
    offsets, times = [e[1] for e in clicks], [e[4] for e in clicks]
    assert s.apply_pairs(["i1"] * n, ["i2"] * n, [0] * n, offsets, times, 1) == n
    assert s.late == 0


def test_pairs_from_a_partition_that_delivered_no_event_here_hold_their_own_floor():
    """A click's event goes to its item's partition, the pair (a → b) to a's: a partition
    may get a source partition's pairs before any of its events. The pairs hold the floor
    at their own progress, so a lagging partition's pairs are not late either."""
    s = state()
    now = drain(s, backlog(0, 0, T0, 3), 300, 0)
    now += 10 * IDLE_MS  # partition 0 idle, partition 1 never seen: nothing holds the floor
    assert s.late_below_ms(now) == s.sources.newest_ms[0] - GRACE_MS
    times = [T0 + j * 60_000 for j in range(60)]  # partition 1's first hour, in order
    n = len(times)
    assert s.apply_pairs(["i1"] * n, ["i2"] * n, [1] * n, list(range(n)), times, now) == n
    assert s.late == 0


def test_the_source_watermarks_survive_a_restart_from_the_snapshot():
    s = state()
    now = drain(s, backlog(0, 0, T0, 3), 300, 0)
    drain(s, backlog(1, 0, T0, 1), 300, now)
    rows = s.snapshot_rows(list(range(s.n_items)))
    back = ItemPartitionState.restore(s.config, s.snapshot_meta(), rows)
    assert back.sources.newest_ms == s.sources.newest_ms
    assert back.watermark_ms == s.watermark_ms and back.applied == s.applied
    end1 = s.sources.newest_ms[1]
    # after the restart both partitions hold the floor at their progress, as before it
    assert back.apply([(0, 10**6, "a", CLICK, end1 - GRACE_MS + 1, None, 0.0)], 0) == 1
    assert back.apply([(0, 10**6 + 1, "a", CLICK, end1 - GRACE_MS - 1, None, 0.0)], 1) == 0
    # a snapshot written before the watermarks were kept restores with none known: nothing
    # is late until each source partition delivers or goes idle
    meta = {k: v for k, v in s.snapshot_meta().items() if k != "source_watermarks"}
    old = ItemPartitionState.restore(s.config, meta, rows)
    assert old.sources.newest_ms == {} and old.watermark_ms == s.watermark_ms
    assert old.apply([(0, 10**6, "a", CLICK, T0, None, 0.0)], 0) == 1
    assert old.apply([(0, 10**6 + 1, "a", CLICK, T0 - 2 * HOUR_MS, None, 0.0)], 1) == 1
    # partition 1 idle: partition 0's own progress judges it
    assert old.apply([(0, 10**6 + 2, "a", CLICK, T0 - 2 * HOUR_MS, None, 0.0)], IDLE_MS) == 0


def test_the_floor_is_the_least_watermark_of_the_partitions_holding_it():
    w = SourceWatermarks(partitions=3, idle_ms=IDLE_MS, newest_ms={0: 500, 1: 300, 2: 900})
    assert w.holding(0, [1]) == ({1: 300}, 500)
    assert w.floor_ms(0) == 300
    w.delivered(IDLE_MS // 2, [2], {2: 1000})
    assert w.floor_ms(IDLE_MS) == 1000  # 0 and 1 idle since the first call, 2 not
    assert w.floor_ms(2 * IDLE_MS) == 1000  # all idle: the newest (Flink's rule likewise)
    w.delivered(2 * IDLE_MS, [1], {1: 200})  # a watermark never falls
    assert w.newest_ms[1] == 300 and w.floor_ms(2 * IDLE_MS) == 300


def test_the_floor_is_computed_in_processing_time_passed_in_not_read():
    """A call without processing time reuses the last one given: time does not pass."""
    w = SourceWatermarks(partitions=2, idle_ms=IDLE_MS, newest_ms={0: 100, 1: 50})
    w.holding(10 * IDLE_MS, [0])
    assert w.floor_ms() == 50 and w.now_ms == 10 * IDLE_MS
    assert np.int64(NO_TIME) - GRACE_MS < 0  # a grace below −∞ still fits in 64 bits
