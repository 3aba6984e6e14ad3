"""The per-item, per-scope counters of one ``events.by_item`` partition. Pure: no I/O.

Scopes: 0 is global, then one per region as regions appear (up to ``max_regions``). Counts of
impressions, clicks and conversions are forward-decayed (``decay.py``), so an event touches
only its own item's row. ``applied`` remembers, per source partition of ``events``, the highest
source offset already counted: a replayed repartition batch is skipped event by event, which
makes the effect exactly-once when the state and ``applied`` are persisted together.

>>> s = ItemPartitionState(StateConfig())
>>> s.apply([(0, 5, "i1", 1, 3_600_000, "north", 0.0)])
1
>>> round(float(s.decayed_clicks(3_600_000)[0, 0]), 9)
1.0
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import orjson

from freshcore.hotscore import (
    HotEntry,
    HotList,
    HotWeights,
    Smoothing,
    hot_scores,
    price_norm,
    smoothed_rate,
    top_k_indices,
)
from streams.covisit import CoVisitCounts
from streams.decay import ForwardDecay

IMPRESSION, CLICK, CONVERSION = 0, 1, 2
EVENT_CODES = {"impression": IMPRESSION, "click": CLICK, "conversion": CONVERSION}
GLOBAL = "global"

BY_ITEM_COLUMNS = ("p", "o", "i", "c", "t", "r")
"""An ``events.by_item`` record: a JSON object of equal-length columns — source partition,
source offset, item id, event code, event time (ms), region (or null) — in source order."""


def by_item_columns(record: dict | list) -> tuple[list, ...]:
    """The columns of a decoded ``events.by_item`` record, in ``BY_ITEM_COLUMNS`` order.
    Also reads the row layout of earlier versions (a list of ``ByItemEvent``), so
    records left in the topic by an older validate stage still count after an upgrade.

    >>> by_item_columns({"p": [0], "o": [5], "i": ["i1"], "c": [1], "t": [9], "r": [None]})
    ([0], [5], ['i1'], [1], [9], [None])
    >>> by_item_columns([[0, 5, "i1", 1, 9, None, 0.0]])
    ([0], [5], ['i1'], [1], [9], [None])
    """
    if isinstance(record, dict):
        return tuple(record[c] for c in BY_ITEM_COLUMNS)
    if not record:
        return ([], [], [], [], [], [])
    return tuple(list(c) for c in list(zip(*record, strict=True))[:6])


ByItemEvent = tuple[int, int, str, int, int, str | None, float]
"""(source partition, source offset, item_id, event code, ts_ms, region, value)."""


@dataclass(frozen=True)
class StateConfig:
    decay_rate_per_hour: float = 0.95
    late_grace_ms: int = 10 * 60 * 1000
    """Events older than the partition's newest event time minus this are late and dropped."""
    max_regions: int = 32
    weights: HotWeights = field(default_factory=HotWeights)
    smoothing: Smoothing = field(default_factory=Smoothing)
    price_cap: float = 1000.0
    covisit_candidates: int = 200
    """Co-visitation neighbours counted per anchor at most (``covisit.py``)."""
    covisit_max_neighbours: int = 5_000_000
    """Co-visitation neighbours one partition holds over all its anchors at most: past it
    the longest rows are cut (``CoVisitCounts.trim``), so that memory is bounded by this,
    not by ``max_items`` × ``covisit_candidates``."""
    evict_below: float = 0.01
    """An item whose decayed impressions, clicks and conversions add up to less than this at
    the partition's event time leaves the state (and its rows and features leave Redis): it
    has stopped counting in any hot list or feature. 0 keeps idle items."""
    evict_every_ms: int = 3_600_000
    """How often (in event time) idle items are looked for."""
    max_items: int = 500_000
    """Items one partition holds at most: past it, the least active leave (down to nine
    tenths of it), whatever their age, so a flood of new ids cannot grow memory."""


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


class ItemPartitionState:
    """Counters for the items of one partition, plus hot-list and feature read-outs."""

    def __init__(self, config: StateConfig, landmark_ms: int | None = None) -> None:
        self.config = config
        self.decay = ForwardDecay(config.decay_rate_per_hour, landmark_ms or 0)
        self._landmark_set = landmark_ms is not None
        self.slots: dict[str, int] = {}
        self.item_ids: list[str] = []
        self.scopes: dict[str, int] = {GLOBAL: 0}
        self.counts = np.zeros((0, 1, 3), np.float64)  # [item, scope, kind], forward-decayed
        self.price = np.zeros(0, np.float64)
        self.watermark_ms = 0
        self.applied: dict[int, int] = {}
        self.touched: set[int] = set()
        """Slots whose rows changed since the last ``take_touched`` (the persisted state)."""
        self.features_due: set[int] = set()
        """Slots taken by ``take_touched`` whose serving features are not written yet."""
        self.new_slots: list[int] = []
        self._names = np.empty(0, dtype=object)  # item ids as an array, for tie-breaking
        self.late = 0
        self.skipped = 0
        self.covisit = CoVisitCounts(config.covisit_candidates)
        """Co-visitation counts of this partition's anchors (``covisit.py``)."""
        self.covisit_applied: dict[int, int] = {}
        """Per source partition of ``events``, the highest offset whose pairs are counted."""
        self.evicted: list[str] = []
        """Items evicted since the last flush (their Redis fields still to delete)."""
        self.evictions = {"idle": 0, "cap": 0}
        """Items evicted since ``take_evictions``, by reason."""
        self.trimmed = 0
        """Co-visitation neighbours cut past the budget since ``take_trimmed``."""
        self._swept_ms = 0
        self.persisted: dict[str, str | None] = {"applied": None, "covisit_applied": None}
        """The offsets fields of the last snapshot Redis acknowledged (or restored), as
        written: a flush reads them back first (``acked.lost_write``)."""

    # ---------------------------------------------------------------------------- growth
    def _slot(self, item_id: str) -> int:
        slot = self.slots.get(item_id)
        return self._slots([item_id])[0] if slot is None else slot

    def _slots(self, item_ids: list[str]) -> list[int]:
        """``_slot`` of each id; new ones numbered in order of first appearance."""
        get = self.slots.get
        slots = [get(i) for i in item_ids]
        if None not in slots:
            return slots
        new = list(dict.fromkeys(i for i, s in zip(item_ids, slots, strict=True) if s is None))
        first = len(self.item_ids)
        self.slots.update(zip(new, range(first, first + len(new)), strict=True))
        self.item_ids.extend(new)
        self.new_slots.extend(range(first, first + len(new)))
        if len(self.item_ids) > len(self.counts):
            grow = max(1024, len(self.counts), len(self.item_ids) - len(self.counts))
            self.counts = np.concatenate(
                [self.counts, np.zeros((grow, self.counts.shape[1], 3))], axis=0
            )
            self.price = np.concatenate([self.price, np.zeros(grow)])
        return [get(i) for i in item_ids]

    def _scope(self, region: str | None) -> int | None:
        """The scope of a region's own counts; None for none (no region, the global scope's
        own name, or past ``max_regions``): the event counts in the global scope only."""
        if region is None or region == GLOBAL:
            return None
        scope = self.scopes.get(region)
        if scope is None:
            if len(self.scopes) > self.config.max_regions:
                return None
            scope = self.scopes[region] = len(self.scopes)
            self.counts = np.concatenate([self.counts, np.zeros((len(self.counts), 1, 3))], axis=1)
        return scope

    @property
    def n_items(self) -> int:
        return len(self.item_ids)

    # ------------------------------------------------------------------------------ apply
    def apply(self, events: Iterable[ByItemEvent]) -> int:
        """Count events; returns how many counted (skips replays and late events)."""
        return self.apply_columns(*by_item_columns(list(events)))

    def apply_columns(
        self,
        parts: list[int],
        offsets: list[int],
        item_ids: list[str],
        codes: list[int],
        ts_ms: list[int],
        regions: list[str | None],
    ) -> int:
        """``apply`` for a batch given as columns (the ``events.by_item`` record's layout).

        Vectorised over the batch (one by-item message: hundreds of events) where that is
        exactly what the event-by-event rule computes: each source partition's offsets rise
        within the batch, the landmark is set and no event moves it. Otherwise, and for a
        handful of events, event by event. Both add the same weights (``math.exp``) to each
        counter in the same order, so the counters are bit-for-bit the same either way.
        """
        n = len(item_ids)

        def each() -> int:
            return self._apply_each(
                list(zip(parts, offsets, item_ids, codes, ts_ms, regions, strict=True))
            )

        if n < 16 or not self._landmark_set:
            return each()
        part_a = np.array(parts, np.int64)
        offs = np.array(offsets, np.int64)
        ts = np.array(ts_ms, np.int64)
        # per source partition, in a few passes whatever the number of partitions: offsets
        # must rise within each (else the event-by-event rule: rare), replays are skipped
        order = np.argsort(part_a, kind="stable")
        by_part, by_off = part_a[order], offs[order]
        same = by_part[1:] == by_part[:-1]
        if (same & (by_off[1:] <= by_off[:-1])).any():
            return each()
        firsts = np.flatnonzero(np.r_[True, ~same])
        sources = by_part[firsts].tolist()
        done = np.array([self.applied.get(p, -1) for p in sources], np.int64)
        skip = offs <= done[np.searchsorted(by_part[firsts], part_a)]
        lasts = by_off[np.r_[firsts[1:], n] - 1]  # each partition's highest offset
        last = {p: int(o) for p, o, d in zip(sources, lasts, done, strict=True) if o > d}
        # the watermark each event meets: the newest earlier event time among those not
        # skipped (late ones never raise it: they lie below it)
        grace = self.config.late_grace_ms
        met = np.maximum.accumulate(np.where(skip, self.watermark_ms, ts))
        before = np.empty_like(met)
        before[0] = self.watermark_ms
        np.maximum(met[:-1], self.watermark_ms, out=before[1:])
        late = ~skip & (ts < before - grace)
        newest = int(max(met[-1], self.watermark_ms))
        if newest > self.watermark_ms and self.decay.needs_renormalising(newest):
            # the landmark moves mid-batch: once in weeks of event time
            return each()
        self.applied.update(last)
        self.watermark_ms = newest
        n_skipped, n_late = int(skip.sum()), int(late.sum())
        self.skipped += n_skipped
        self.late += n_late
        counted = n - n_skipped - n_late
        if counted == 0:
            return 0
        code_a = np.array(codes, np.int64)
        if counted < n:
            keep = np.flatnonzero(~(skip | late)).tolist()
            item_ids = [item_ids[i] for i in keep]
            regions = [regions[i] for i in keep]
            ts_ms = [ts_ms[i] for i in keep]
            code_a = code_a[keep]
        # slots and scopes first: either may grow (reallocate) ``counts``
        slots = self._slots(item_ids)
        scope_of = {r: self._scope(r) for r in dict.fromkeys(regions)}
        exp, ln, landmark = math.exp, self.decay._ln, self.decay.landmark_ms
        w = np.array([exp(ln * (t - landmark)) for t in ts_ms], np.float64)  # decay.weight
        if not self.counts.flags.c_contiguous:
            self.counts = np.ascontiguousarray(self.counts)
        flat = self.counts.reshape(-1)  # a view, so the adds land in counts
        n_scopes = self.counts.shape[1]
        slot_a = np.array(slots, np.int64)
        np.add.at(flat, slot_a * (n_scopes * 3) + code_a, w)
        if len(scope_of) > 1 or next(iter(scope_of.values())):
            scope_a = np.array([scope_of[r] or 0 for r in regions], np.int64)
            regional = np.flatnonzero(scope_a)
            at = (slot_a[regional] * n_scopes + scope_a[regional]) * 3 + code_a[regional]
            np.add.at(flat, at, w[regional])
        self.touched.update(slots)
        return counted

    def _apply_each(self, events: list[ByItemEvent]) -> int:
        """``apply``, event by event: the reference the vectorised path equals."""
        counted = 0
        grace = self.config.late_grace_ms
        for src_part, src_off, item_id, code, ts, region, *_value in events:
            if src_off <= self.applied.get(src_part, -1):
                self.skipped += 1
                continue
            self.applied[src_part] = src_off
            if not self._landmark_set:
                self.decay.landmark_ms = ts
                self._landmark_set = True
            if ts < self.watermark_ms - grace:
                self.late += 1
                continue
            if ts > self.watermark_ms:
                self.watermark_ms = ts
                if self.decay.needs_renormalising(ts):
                    self.covisit.rescale(1.0 / self.decay.weight(ts - grace))
                    self.decay.renormalise(ts - grace, self.counts)
                    self.touched.update(range(self.n_items))
            slot = self._slot(item_id)
            w = self.decay.weight(ts)
            self.counts[slot, 0, code] += w
            scope = self._scope(region)
            if scope is not None:
                self.counts[slot, scope, code] += w
            self.touched.add(slot)
            counted += 1
        return counted

    def apply_pairs(
        self,
        anchors: list[str],
        neighbours: list[str],
        parts: list[int],
        offsets: list[int],
        ts_ms: list[int],
    ) -> int:
        """Count a co-visitation record's pairs (``covisit.PAIR_COLUMNS``); returns how many.

        A click's pairs travel in one record, so a pair is skipped when its source offset is
        at or below what this partition had counted before the record: a replayed record
        counts nothing twice. Late pairs (older than the watermark's grace) are dropped as
        late events are; pairs move neither the watermark nor the landmark once set."""
        before = self.covisit_applied
        keep = [
            j for j, (p, o) in enumerate(zip(parts, offsets, strict=True)) if o > before.get(p, -1)
        ]
        self.skipped += len(anchors) - len(keep)
        after = dict(before)
        for j in keep:
            after[parts[j]] = max(after.get(parts[j], -1), offsets[j])
        self.covisit_applied = after
        if not keep:
            return 0
        if not self._landmark_set:
            self.decay.landmark_ms = ts_ms[keep[0]]
            self._landmark_set = True
        floor = self.watermark_ms - self.config.late_grace_ms
        fresh = [j for j in keep if ts_ms[j] >= floor]
        self.late += len(keep) - len(fresh)
        if fresh:
            ts = [ts_ms[j] for j in fresh]
            self.covisit.add(
                [anchors[j] for j in fresh],
                [neighbours[j] for j in fresh],
                self.decay.weights(np.asarray(ts, np.int64)).tolist(),
                ts,
            )
        return len(fresh)

    def stored_clicks(self, item_id: str) -> float:
        """An item's clicks as stored (forward-decayed): what a co-visitation count over it
        is a share of (both decay alike)."""
        slot = self.slots.get(item_id)
        return float(self.counts[slot, 0, CLICK]) if slot is not None else 0.0

    def set_prices(self, prices: dict[str, float]) -> None:
        for item_id, p in prices.items():
            slot = self.slots.get(item_id)
            if slot is not None:
                self.price[slot] = p
                self.touched.add(slot)

    def take_new_items(self) -> list[str]:
        """Items first seen since the last call (their price is still to be looked up)."""
        new = [self.item_ids[i] for i in self.new_slots]
        self.new_slots.clear()
        return new

    def items_without_price(self) -> list[str]:
        n = self.n_items
        return [self.item_ids[i] for i in np.flatnonzero(self.price[:n] == 0.0)]

    # --------------------------------------------------------------------------- read-out
    def decayed(self, t_ms: int) -> np.ndarray:
        """[item, scope, kind] counts decayed to ``t_ms``."""
        return self.decay.value_at(self.counts[: self.n_items], t_ms)

    def decayed_clicks(self, t_ms: int) -> np.ndarray:
        return self.decayed(t_ms)[:, :, CLICK]

    def rates(self, decayed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Smoothed (CTR, CVR) per [item, scope]."""
        sm = self.config.smoothing
        ctr = smoothed_rate(
            decayed[..., CLICK], decayed[..., IMPRESSION], sm.ctr_prior, sm.ctr_strength
        )
        cvr = smoothed_rate(
            decayed[..., CONVERSION], decayed[..., CLICK], sm.cvr_prior, sm.cvr_strength
        )
        return ctr, cvr

    def hot_top(self, k: int) -> dict[str, tuple[list[str], list[float], list[float], list[float]]]:
        """This partition's top-K per scope at its watermark: (item ids, decayed clicks, CVR,
        normalised price), best first."""
        t = self.watermark_ms
        n = self.n_items
        dec = self.decayed(t)
        _, cvr = self.rates(dec)
        pn = price_norm(self.price[:n], self.config.price_cap)
        if len(self._names) != n:
            self._names = np.array(self.item_ids, dtype=object)
        names = self._names
        out = {}
        for scope, s in self.scopes.items():
            clicks = dec[:, s, CLICK]
            # items with activity in this scope: items never seen in events would all tie
            # on their priors, and ranking thousands of ties by name is what made hot lists
            # of a large catalogue slow
            active = np.flatnonzero(dec[:, s, :].sum(axis=1) > 0)
            scores = hot_scores(clicks[active], cvr[active, s], pn[active], self.config.weights)
            best = active[top_k_indices(scores, k, names[active])]
            out[scope] = (
                names[best].tolist(),
                clicks[best].tolist(),
                cvr[best, s].tolist(),
                pn[best].tolist(),
            )
        return out

    def hot_lists(self, k: int, partition: int, published_ms: int) -> dict[str, HotList]:
        """``hot_top`` as ``HotList`` objects."""
        return {
            scope: HotList(self.watermark_ms, list(map(HotEntry, *cols)), partition, published_ms)
            for scope, cols in self.hot_top(k).items()
        }

    def hot_payloads(self, k: int, partition: int, published_ms: int) -> dict[str, bytes]:
        """``hot_top`` as the published JSON per scope (``HotList.to_json``'s layout),
        encoded straight from the columns: no objects per entry."""
        head = {"as_of_ms": self.watermark_ms, "partition": partition, "published_ms": published_ms}
        return {
            scope: orjson.dumps({**head, "entries": list(zip(*cols, strict=True))})
            for scope, cols in self.hot_top(k).items()
        }

    def take_touched(self) -> list[int]:
        touched = sorted(self.touched)
        self.touched.clear()
        self.features_due.update(touched)
        return touched

    def begin_flush(self) -> Flush:
        """Sweep, then take everything a persist writes (``Flush``)."""
        self.sweep()
        self.trimmed += self.covisit.trim(self.config.covisit_max_neighbours)
        evicted, self.evicted = self.evicted, []
        slots, anchors = self.take_touched(), self.covisit.take_dirty()
        return Flush(slots, anchors, evicted, self.covisit.take_dropped())

    def abort_flush(self, flush: Flush) -> None:
        """A flush that was not written: everything it took is due again."""
        self.touched.update(flush.slots)
        self.covisit.dirty.update(flush.anchors)
        self.evicted = flush.evicted + self.evicted
        self.covisit.dropped.update(flush.dropped)

    def touch_all(self) -> None:
        """Every item and co-visitation anchor is due in the next flush: it rewrites the
        whole partition."""
        self.touched.update(range(self.n_items))
        self.covisit.dirty.update(self.covisit.counts)

    # ------------------------------------------------------------------------- eviction
    def take_evictions(self) -> dict[str, int]:
        out = dict(self.evictions)
        self.evictions = dict.fromkeys(out, 0)
        return out

    def take_trimmed(self) -> int:
        """Co-visitation neighbours cut past the budget since the last call."""
        out, self.trimmed = self.trimmed, 0
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
        keep = np.flatnonzero(~gone)
        renumber = np.full(len(gone), -1, np.int64)
        renumber[keep] = np.arange(len(keep))
        left = [self.item_ids[i] for i in np.flatnonzero(gone)]
        self.evicted.extend(left)
        self.item_ids = [self.item_ids[i] for i in keep]
        self.slots = dict(zip(self.item_ids, range(len(keep)), strict=True))
        self.counts = self.counts[keep]
        self.price = self.price[keep]
        self._names = np.empty(0, dtype=object)

        def moved(slots) -> list[int]:
            return [int(renumber[s]) for s in slots if renumber[s] >= 0]

        self.touched = set(moved(self.touched))
        self.features_due = set(moved(self.features_due))
        self.new_slots = moved(self.new_slots)
        # an anchor's list is a share of its own clicks: with the item gone, so is its list
        # (and lists of anchors that never had counted clicks of their own)
        self.covisit.drop([a for a in self.covisit.counts if a not in self.slots])

    def take_features_due(self) -> list[int]:
        due = sorted(self.features_due)
        self.features_due.clear()
        return due

    # --------------------------------------------------------------------------- snapshot
    _ROW = struct.Struct("<d")

    def snapshot_rows(self, slots: list[int]) -> dict[str, bytes]:
        """Per-item snapshot values for ``slots``: price then forward counts, float64."""
        return dict(zip((self.item_ids[i] for i in slots), self.snapshot_blobs(slots), strict=True))

    def snapshot_blobs(self, slots: list[int]) -> list[bytes]:
        """``snapshot_rows``' values, in the order of ``slots``."""
        return [line.tobytes() for line in self.snapshot_matrix(slots)]

    def snapshot_matrix(self, slots) -> np.ndarray:
        """``snapshot_blobs`` as one matrix: a row per slot, each row's bytes its blob."""
        idx = np.asarray(slots, np.int64)
        rows = np.empty((len(idx), 1 + self.counts.shape[1] * 3), np.float64)
        rows[:, 0] = self.price[idx]
        rows[:, 1:] = self.counts[idx].reshape(len(idx), -1)
        return rows

    def snapshot_meta(self) -> dict[str, str]:
        import json

        return {
            "landmark_ms": str(self.decay.landmark_ms),
            "watermark_ms": str(self.watermark_ms),
            "scopes": json.dumps(list(self.scopes)),
            "applied": json.dumps({str(k): v for k, v in self.applied.items()}),
            "covisit_applied": json.dumps({str(k): v for k, v in self.covisit_applied.items()}),
            "late": str(self.late),
        }

    @classmethod
    def restore(
        cls, config: StateConfig, meta: dict[str, str], rows: dict[str, bytes]
    ) -> ItemPartitionState:
        import json

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
