"""The per-item, per-scope counters of one ``events.by_item`` partition. Pure: no I/O.

Scopes: 0 is global, then one per region as regions appear (up to ``max_regions``). Counts of
impressions, clicks and conversions are forward-decayed (``decay.py``), so an event touches
only its own item's row; the counters and what is read out of them (hot lists, rates,
snapshot rows) are ``itemcounts.py``'s, and this module adds the rules of the log that decide
what counts (a batch at a time: ``batchcount.py``), co-visitation pairs and sequential rules
(``covisit.py``), what a flush takes,
eviction, and the snapshot's offsets and restore. ``applied`` remembers, per source partition
of ``events``, the highest source offset already counted: a replayed repartition batch is
skipped event by event, which makes the effect exactly-once when the state and ``applied``
are persisted together. Lateness is judged against the source partitions' watermarks
(``sources``: ``watermarks.py``), so a catch-up that drains them unevenly loses nothing;
processing time, which their idleness goes by, is passed in (``now_ms``).

>>> s = ItemPartitionState(StateConfig())
>>> s.apply([(0, 5, "i1", 1, 3_600_000, "north", 0.0)])
1
>>> round(float(s.decayed_clicks(3_600_000)[0, 0]), 9)
1.0
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from streams.batchcount import add_counts, floors, plan_batch
from streams.byitem import CLICK, CONVERSION, IMPRESSION, ByItemEvent, by_item_columns
from streams.covisit import CoVisitCounts
from streams.itemcounts import ItemCounts, StateConfig, renumbered
from streams.watermarks import NO_TIME, SourceWatermarks, pairs_channel

__all__ = [  # the event codes index the counters, so a reader of the state finds them here
    "CLICK",
    "CONVERSION",
    "IMPRESSION",
    "Flush",
    "ItemPartitionState",
    "StateConfig",
    "by_item_columns",
]


class Flush(NamedTuple):
    """What one persist writes (``ItemPartitionState.begin_flush``): given back whole by
    ``abort_flush`` when the write fails, so a retry writes all of it again."""

    slots: list[int]
    """Items whose rows changed."""
    anchors: list[str]
    """Anchors whose co-visitation counts changed."""
    evicted: list[str]
    """Items evicted: their rows and serving features leave Redis."""
    dropped: list[str]
    """Anchors dropped: their co-visitation counts and serving lists leave Redis."""
    sequels: list[str]
    """Anchors whose sequential-rule counts changed."""
    sequels_dropped: list[str]
    """Anchors dropped: their sequential-rule counts and serving lists leave Redis."""


class ItemPartitionState(ItemCounts):
    """Counters for the items of one partition, plus hot-list and feature read-outs
    (``ItemCounts``), kept by the rules of the log."""

    def __init__(self, config: StateConfig, landmark_ms: int | None = None) -> None:
        super().__init__(config, landmark_ms)
        self._landmark_set = landmark_ms is not None
        self.applied: dict[int, int] = {}
        self.features_due: set[int] = set()
        """Slots taken by ``take_touched`` whose serving features are not written yet."""
        self.late = 0
        self.skipped = 0
        self.sources = SourceWatermarks(config.source_partitions, config.watermark_idle_ms)
        """Per source partition of ``events``, its events' and its pairs' watermarks: what
        lateness is judged by."""
        self.covisit = CoVisitCounts(config.covisit_candidates)
        """Co-visitation counts of this partition's anchors (``covisit.py``)."""
        self.sequel = CoVisitCounts(config.sequel_candidates)
        """Sequential-rule counts r(a → b) of this partition's anchors (``covisit.py``)."""
        self.covisit_applied: dict[int, int] = {}
        """Per source partition of ``events``, the highest offset whose pairs (co-visitation
        and sequential rules: a click's travel in one record) are counted."""
        self.sequel_pairs = 0
        """Sequential-rule pairs counted (a running total: the metric takes differences)."""
        self.evicted: list[str] = []
        """Items evicted since the last flush (their Redis fields still to delete)."""
        self.evictions = {"idle": 0, "cap": 0}
        """Items evicted since ``take_evictions``, by reason."""
        self.trimmed = {"covisit": 0, "sequel": 0}
        """Neighbours and successors cut past their budgets since ``take_trimmed``."""
        self._swept_ms = 0
        self.persisted: dict[str, str | None] = {"applied": None, "covisit_applied": None}
        """The offsets fields of the last snapshot Redis acknowledged (or restored), as
        written: a flush reads them back first (``acked.lost_write``)."""

    # ------------------------------------------------------------------------------ apply
    def apply(self, events: Iterable[ByItemEvent], now_ms: int | None = None) -> int:
        """Count events; returns how many counted (skips replays and late events).
        ``now_ms``: processing time (source partitions' idleness); None: as last given."""
        return self.apply_columns(*by_item_columns(list(events)), now_ms=now_ms)

    def apply_columns(
        self,
        parts: list[int],
        offsets: list[int],
        item_ids: list[str],
        codes: list[int],
        ts_ms: list[int],
        regions: list[str | None],
        now_ms: int | None = None,
    ) -> int:
        """``apply`` for a batch given as columns (the ``events.by_item`` record's layout).

        Vectorised over the batch (one by-item message: hundreds of events) where that is
        exactly what the event-by-event rule computes: each source partition's offsets rise
        within the batch, the landmark is set and no event moves it. Otherwise, and for a
        handful of events, event by event. Both add the same weights (``math.exp``) to each
        counter in the same order, so the counters are bit-for-bit the same either way.
        """
        n = len(item_ids)
        plan = None
        if n >= 16 and self._landmark_set:
            grace = self.config.late_grace_ms
            holding = self.sources.holding(now_ms, parts)
            plan = plan_batch(
                parts, offsets, ts_ms, self.applied, self.watermark_ms, grace, holding
            )
        newest = self.watermark_ms if plan is None else plan.watermark_ms
        if plan is None or (newest > self.watermark_ms and self.decay.needs_renormalising(newest)):
            # offsets that do not rise, or the landmark moves mid-batch (once in weeks of
            # event time): event by event
            return self._apply_each(
                list(zip(parts, offsets, item_ids, codes, ts_ms, regions, strict=True)), now_ms
            )
        self.applied.update(plan.applied)
        self.watermark_ms = newest
        self.sources.delivered(now_ms, plan.source_ms, plan.source_ms)
        n_skipped, n_late = plan.skipped, plan.late_count
        self.skipped += n_skipped
        self.late += n_late
        counted = n - n_skipped - n_late
        if counted == 0:
            return 0
        code_a = np.array(codes, np.int64)
        if counted < n:
            keep = plan.kept
            item_ids = [item_ids[i] for i in keep]
            regions = [regions[i] for i in keep]
            ts_ms = [ts_ms[i] for i in keep]
            code_a = code_a[keep]
        self._add_counted(item_ids, code_a, ts_ms, regions)
        return counted

    def _add_counted(
        self, item_ids: list[str], codes: np.ndarray, ts_ms: list[int], regions: list[str | None]
    ) -> None:
        """Add events that count (none replayed or late, the landmark set and staying) to
        their items' counters, global and regional."""
        # slots and scopes first: either may grow (reallocate) ``counts``
        slots = self._slots(item_ids)
        scope_of = {r: self._scope(r) for r in dict.fromkeys(regions)}
        exp, ln, landmark = math.exp, self.decay._ln, self.decay.landmark_ms
        w = np.array([exp(ln * (t - landmark)) for t in ts_ms], np.float64)  # decay.weight
        if not self.counts.flags.c_contiguous:
            self.counts = np.ascontiguousarray(self.counts)
        scopes = None
        if len(scope_of) > 1 or next(iter(scope_of.values())):
            scopes = np.array([scope_of[r] or 0 for r in regions], np.int64)
        add_counts(self.counts, np.array(slots, np.int64), codes, w, scopes)
        self.touched.update(slots)

    def _apply_each(self, events: list[ByItemEvent], now_ms: int | None = None) -> int:
        """``apply``, event by event: the reference the vectorised path equals. An event is
        late when older, by more than the grace, than the floor: the least watermark of the
        batch's source partitions (each rising as its events pass) and of the others that
        hold it (``SourceWatermarks.holding``)."""
        counted = 0
        grace = self.config.late_grace_ms
        held, others = self.sources.holding(now_ms, [e[0] for e in events])
        floor = _least(held, others)
        for src_part, src_off, item_id, code, ts, region, *_value in events:
            if src_off <= self.applied.get(src_part, -1):
                self.skipped += 1
                continue
            self.applied[src_part] = src_off
            if not self._landmark_set:
                self.decay.landmark_ms = ts
                self._landmark_set = True
            if ts < floor - grace:
                self.late += 1
                continue
            if ts > held[src_part]:
                was, held[src_part] = held[src_part], ts
                if was <= floor:  # it was the least: the floor may rise
                    floor = _least(held, others)
            if ts > self.watermark_ms:
                self.watermark_ms = ts
                if self.decay.needs_renormalising(ts):
                    landmark = self.decay.landmark_for(ts, grace)
                    self.covisit.rescale(self.decay.shrink_to(landmark))
                    self.sequel.rescale(self.decay.shrink_to(landmark))
                    self.decay.renormalise(landmark, self.counts)
                    self.touched.update(range(self.n_items))
            slot = self._slot(item_id)
            w = self.decay.weight(ts)
            self.counts[slot, 0, code] += w
            scope = self._scope(region)
            if scope is not None:
                self.counts[slot, scope, code] += w
            self.touched.add(slot)
            counted += 1
        self.sources.delivered(now_ms, held, held)
        return counted

    def apply_pairs(
        self,
        anchors: list[str],
        neighbours: list[str],
        parts: list[int],
        offsets: list[int],
        ts_ms: list[int],
        now_ms: int | None = None,
        distances: list[int] | None = None,
    ) -> int:
        """Count a pair record's pairs (``covisit.PAIR_COLUMNS``; ``distances``: its
        ``PAIR_DISTANCE`` column, None for co-visitation pairs only); returns how many.

        A click's pairs travel in one record, so a pair is skipped when its source offset is
        at or below what this partition had counted before the record: a replayed record
        counts nothing twice. Late pairs are dropped as late events are, by the same rule
        (``batchcount.floors``), on a channel of their own (``watermarks.pairs_channel``):
        a source partition's pairs come in click order, but after the events of their
        validate batch, which in a backlog run hours ahead of them. Pairs move neither the
        partition's newest event time nor the landmark once set."""
        before = self.covisit_applied
        skip = [o <= before.get(p, -1) for p, o in zip(parts, offsets, strict=True)]
        keep = [j for j, skipped in enumerate(skip) if not skipped]
        self.skipped += len(anchors) - len(keep)
        after = dict(before)
        for j in keep:
            after[parts[j]] = max(after.get(parts[j], -1), offsets[j])
        self.covisit_applied = after
        if not parts:
            return 0
        channels = [pairs_channel(p) for p in parts]
        holding = self.sources.holding(now_ms, channels)
        floor, source_ms = floors(channels, ts_ms, skip, holding)
        self.sources.delivered(now_ms, source_ms, source_ms)
        if not keep:
            return 0
        if not self._landmark_set:
            self.decay.landmark_ms = ts_ms[keep[0]]
            self._landmark_set = True
        grace = self.config.late_grace_ms
        fresh = [j for j in keep if ts_ms[j] >= floor[j] - grace]
        self.late += len(keep) - len(fresh)
        if fresh:
            self._add_pairs(fresh, anchors, neighbours, ts_ms, distances)
        return len(fresh)

    def _add_pairs(self, fresh: list[int], anchors, neighbours, ts_ms, distances) -> None:
        """Add the pairs ``fresh`` (by index: none replayed or late) to their counts, each
        weighted by its event time's decay: co-visitation pairs (distance 0) as they are,
        a sequential rule at distance d by 1/d. Gathered with numpy: a record holds a few
        thousand pairs at a backlog."""
        at = np.asarray(fresh, np.int64)
        times = np.asarray(ts_ms, np.int64)[at]
        w = self.decay.weights(times)
        if distances is None:
            groups = [(self.covisit, at, w, times)]
        else:
            d = np.asarray(distances, np.int64)[at]
            rule = d != 0
            co = ~rule
            groups = [
                (self.covisit, at[co], w[co], times[co]),
                (self.sequel, at[rule], w[rule] / d[rule], times[rule]),
            ]
            self.sequel_pairs += int(rule.sum())
        a, b = np.asarray(anchors, object), np.asarray(neighbours, object)
        for counts, where, weights, when in groups:
            if len(where):
                counts.add(a[where].tolist(), b[where].tolist(), weights.tolist(), when.tolist())

    def late_below_ms(self, now_ms: int | None = None) -> int:
        """The event time below which an event is late now unless its own source partition
        holds the floor lower (the metric): the floor minus the grace; far below any event
        time while nothing is late."""
        floor = self.sources.floor_ms(now_ms)
        return (NO_TIME if floor is None else floor) - self.config.late_grace_ms

    # ------------------------------------------------------------------------------ flush
    def take_touched(self) -> list[int]:
        touched = sorted(self.touched)
        self.touched.clear()
        self.features_due.update(touched)
        return touched

    def begin_flush(self) -> Flush:
        """Sweep, then take everything a persist writes (``Flush``)."""
        self.sweep()
        self.trimmed["covisit"] += self.covisit.trim(self.config.covisit_max_neighbours)
        self.trimmed["sequel"] += self.sequel.trim(self.config.sequel_max_successors)
        evicted, self.evicted = self.evicted, []
        slots, anchors = self.take_touched(), self.covisit.take_dirty()
        dropped = self.covisit.take_dropped()
        return Flush(
            slots, anchors, evicted, dropped, self.sequel.take_dirty(), self.sequel.take_dropped()
        )

    def abort_flush(self, flush: Flush) -> None:
        """A flush that was not written: everything it took is due again."""
        self.touched.update(flush.slots)
        self.covisit.dirty.update(flush.anchors)
        self.evicted = flush.evicted + self.evicted
        self.covisit.dropped.update(flush.dropped)
        self.sequel.dirty.update(flush.sequels)
        self.sequel.dropped.update(flush.sequels_dropped)

    def touch_all(self) -> None:
        """Every item, co-visitation and sequential-rule anchor is due in the next flush: it
        rewrites the whole partition."""
        self.touched.update(range(self.n_items))
        self.covisit.dirty.update(self.covisit.counts)
        self.sequel.dirty.update(self.sequel.counts)

    # ------------------------------------------------------------------------- eviction
    def take_evictions(self) -> dict[str, int]:
        out = dict(self.evictions)
        self.evictions = dict.fromkeys(out, 0)
        return out

    def take_trimmed(self) -> int:
        """Co-visitation neighbours cut past the budget since the last call."""
        out, self.trimmed["covisit"] = self.trimmed["covisit"], 0
        return out

    def take_sequels_trimmed(self) -> int:
        """Sequential-rule successors cut past the budget since the last call."""
        out, self.trimmed["sequel"] = self.trimmed["sequel"], 0
        return out

    def sweep(self) -> int:
        """Evict idle items (decayed total below ``evict_below``; once per ``evict_every_ms``
        of event time) and, past ``max_items``, the least active down to nine tenths of it.
        An evicted item's next event starts it from zero, which is what its counts had
        decayed to. Returns how many left."""
        c = self.config
        n = self.n_items
        due = c.evict_below > 0 and self.watermark_ms - self._swept_ms >= c.evict_every_ms
        if n == 0 or not (due or n > c.max_items):
            return 0
        activity = self.decay.value_at(self.counts[:n, 0, :].sum(axis=1), self.watermark_ms)
        gone = np.zeros(n, bool)
        if due:
            self._swept_ms = self.watermark_ms
            gone = activity < c.evict_below
            self.evictions["idle"] += int(gone.sum())
        over = n - int(gone.sum()) - c.max_items
        if over > 0:
            extra = over + c.max_items // 10
            order = np.argsort(np.where(gone, -np.inf, activity), kind="stable")
            cut = order[int(gone.sum()) : int(gone.sum()) + extra]
            gone[cut] = True
            self.evictions["cap"] += len(cut)
        if gone.any():
            self._evict(gone)
        return int(gone.sum())

    def _evict(self, gone: np.ndarray) -> None:
        self.evicted.extend(self.item_ids[i] for i in np.flatnonzero(gone))
        renumber = self._compact(gone)
        self.features_due = set(renumbered(renumber, self.features_due))
        # an anchor's list is a share of its own clicks: with the item gone, so is its list
        # (and lists of anchors that never had counted clicks of their own); its successors
        # leave with it, or rows of idle anchors would pile up for ever
        self.covisit.drop([a for a in self.covisit.counts if a not in self.slots])
        self.sequel.drop([a for a in self.sequel.counts if a not in self.slots])

    def take_features_due(self) -> list[int]:
        due = sorted(self.features_due)
        self.features_due.clear()
        return due

    # --------------------------------------------------------------------------- snapshot
    def snapshot_meta(self) -> dict[str, str]:
        return {
            "landmark_ms": str(self.decay.landmark_ms),
            "watermark_ms": str(self.watermark_ms),
            "scopes": json.dumps(list(self.scopes)),
            "applied": json.dumps({str(k): v for k, v in self.applied.items()}),
            "covisit_applied": json.dumps({str(k): v for k, v in self.covisit_applied.items()}),
            "late": str(self.late),
            "source_watermarks": json.dumps({str(k): v for k, v in self.sources.newest_ms.items()}),
        }

    @classmethod
    def restore(
        cls, config: StateConfig, meta: dict[str, str], rows: dict[str, bytes]
    ) -> ItemPartitionState:
        if not meta:
            return cls(config)
        state = cls(config, landmark_ms=int(meta["landmark_ms"]))
        state.watermark_ms = int(meta["watermark_ms"])
        for region in json.loads(meta["scopes"])[1:]:
            state._scope(region)
        state.applied = {int(k): int(v) for k, v in json.loads(meta["applied"]).items()}
        covisit_applied = json.loads(meta.get("covisit_applied", "{}"))
        state.covisit_applied = {int(k): int(v) for k, v in covisit_applied.items()}
        state.late = int(meta.get("late", 0))
        # a snapshot from before the source partitions' watermarks restores with none known:
        # until each delivers or goes idle, nothing is late
        source_watermarks = json.loads(meta.get("source_watermarks", "{}"))
        state.sources.newest_ms = {int(k): int(v) for k, v in source_watermarks.items()}
        state.persisted = {f: meta.get(f) for f in state.persisted}
        n_scopes = len(state.scopes)
        for slot, blob in zip(state._slots(list(rows)), rows.values(), strict=True):
            row = np.frombuffer(blob, np.float64)
            state.price[slot] = row[0]
            k = min(n_scopes, (len(row) - 1) // 3)
            state.counts[slot, :k] = row[1 : 1 + 3 * k].reshape(k, 3)
        state.touched.clear()
        state.new_slots.clear()
        # features are written after the state they come from: a crash in between leaves
        # them behind, so a restored partition writes all of its items' features once
        state.features_due = set(range(state.n_items))
        return state


def _least(held: dict[int, int], others: int | None) -> int:
    """The floor: the least of the batch's source partitions' watermarks (``held``) and of
    the others holding it."""
    levels = [*held.values(), *(() if others is None else (others,))]
    return min(levels, default=NO_TIME)
