"""The forward-decayed counters of one partition's items, per scope, and what is read out of
them: hot lists, smoothed rates, snapshot rows. Pure: no I/O.

One row per item (its slot, numbered in order of first appearance, renumbered when items
leave), one column per scope: 0 is global, then one per region as regions appear (up to
``max_regions``); per scope the impressions, clicks and conversions (``byitem.py``'s codes),
forward-decayed (``decay.py``) from the partition's landmark. The rules that decide what
counts — replays, lateness, the watermarks — are ``item_state.py``'s, which builds on this.

>>> c = ItemCounts(StateConfig(), landmark_ms=0)
>>> slots = c._slots(["i1", "i2", "i1"])
>>> slots, c._scope("north"), c._scope("global"), list(c.scopes)
([0, 1, 0], 1, None, ['global', 'north'])
>>> c.counts[0, 0, CLICK] += 2.0
>>> c.hot_top(1)["global"][0]
['i1']
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
from streams.byitem import CLICK, CONVERSION, IMPRESSION
from streams.decay import ForwardDecay

GLOBAL = "global"


@dataclass(frozen=True)
class StateConfig:
    decay_rate_per_hour: float = 0.95
    time_scale: float = 1.0
    """Milliseconds of the world one of event time stands for: the decay stays per hour of
    the world's time in a replay whose events run faster (``FRESHREC_EVENT_TIME_SCALE``)."""
    late_grace_ms: int = 10 * 60 * 1000
    """Events older than the lateness floor minus this are late and dropped: the floor is
    the least watermark of the source partitions of ``events`` (``watermarks.py``)."""
    watermark_idle_ms: int = 60_000
    """A source partition that has delivered nothing to the partition for this long
    (processing time) stops holding its lateness floor back (Flink's ``withIdleness``)."""
    source_partitions: int | None = None
    """The partition count of ``events`` (the app reads it from the broker at start): each
    of them holds the floor until idle, at −∞ while it has delivered nothing; None: only
    the source partitions seen are known."""
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
    sequel_candidates: int = 200
    """Sequential-rule successors counted per anchor at most (the weakest quarter dropped
    when full, as co-visitation neighbours are)."""
    sequel_max_successors: int = 2_500_000
    """Sequential-rule successors one partition holds over all its anchors at most (a rule is
    one count a pair, a co-visitation pair two: half their budget)."""
    evict_below: float = 0.01
    """An item whose decayed impressions, clicks and conversions add up to less than this at
    the partition's event time leaves the state (and its rows and features leave Redis): it
    has stopped counting in any hot list or feature. 0 keeps idle items."""
    evict_every_ms: int = 3_600_000
    """How often (in event time) idle items are looked for."""
    max_items: int = 500_000
    """Items one partition holds at most: past it, the least active leave (down to nine
    tenths of it), whatever their age, so a flood of new ids cannot grow memory."""


class ItemCounts:
    """The counters of a partition's items at its watermark, and their read-outs."""

    def __init__(self, config: StateConfig, landmark_ms: int | None = None) -> None:
        self.config = config
        self.decay = ForwardDecay(
            config.decay_rate_per_hour, landmark_ms or 0, time_scale=config.time_scale
        )
        self.slots: dict[str, int] = {}
        self.item_ids: list[str] = []
        self.scopes: dict[str, int] = {GLOBAL: 0}
        self.counts = np.zeros((0, 1, 3), np.float64)  # [item, scope, kind], forward-decayed
        self.price = np.zeros(0, np.float64)
        self.watermark_ms = 0
        """The newest event time counted: the partition's "now" in event time, which its
        read-outs are decayed to and eviction goes by (lateness goes by the source
        partitions' floor: ``watermarks.py``)."""
        self.touched: set[int] = set()
        """Slots whose rows changed since the last ``take_touched`` (the persisted state)."""
        self.new_slots: list[int] = []
        self._names = np.empty(0, dtype=object)  # item ids as an array, for tie-breaking

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

    # ---------------------------------------------------------------------------- prices
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

    # --------------------------------------------------------------------------- snapshot
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

    def _compact(self, gone: np.ndarray) -> np.ndarray:
        """Drop the items ``gone`` marks, renumbering the rest in order; returns each old
        slot's new one (-1: gone)."""
        keep = np.flatnonzero(~gone)
        renumber = np.full(len(gone), -1, np.int64)
        renumber[keep] = np.arange(len(keep))
        self.item_ids = [self.item_ids[i] for i in keep]
        self.slots = dict(zip(self.item_ids, range(len(keep)), strict=True))
        self.counts = self.counts[keep]
        self.price = self.price[keep]
        self._names = np.empty(0, dtype=object)
        self.touched = set(renumbered(renumber, self.touched))
        self.new_slots = renumbered(renumber, self.new_slots)
        return renumber


def renumbered(renumber: np.ndarray, slots) -> list[int]:
    """The new numbers of ``slots`` that are left after a ``_compact``."""
    return [int(renumber[s]) for s in slots if renumber[s] >= 0]
