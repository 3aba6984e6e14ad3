"""EmbeddingCache: the item table resident on the device, hot users in an LRU slab, the
rows either lets go held in host RAM.

Items are shared by all users, so the whole item table lives on the device (CUDA when
available, else CPU) and grows as items appear; an item no event or broadcast has touched for
the row TTL leaves it (``expire_items``: the worker keeps the catalogue's), its slot reused,
and past a bound on the rows beyond the catalogue's the least recently touched leave
(``evict_items``, ``FRESHREC_MAX_ITEM_ROWS``).
Users are many: a fixed-capacity slab holds the recently used ones; a miss is fetched from
Redis in one batched round trip (``HMGET``); a row found nowhere is created from its id
(``schemas.rows.initial_rows``).

Between the two, host RAM (``inference/tables/host.py``, ``FRESHREC_HOST_USER_ROWS`` and
``FRESHREC_HOST_ITEM_ROWS``): users the slab evicts and items the size bound evicts go there
with their versions, a miss on the device is looked for there before Redis, and broadcast
rows replace held ones, so the three levels (device, host, Redis) serve the same row.

Rows are full-width (dim + 1), stored in ``dtype`` (``FRESHREC_TABLE_DTYPE``: float32, or
float16 for half the memory) and read in float32: ``rows`` gathers and widens, and every
computation on them (recall, ranking, the learning step's gradients) runs in float32; a
float16 table takes the steps and installs rounded to it. The rows' master copies, which
learning accumulates into, are the parameter server's, in float32 in Redis.
Alongside each row the cache keeps the version and newest
event time of the global row it last installed, and, for the ``reply`` freshness stage, the
oldest event the row includes that no reply has used yet.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from freshcore import metrics as m
from freshcore.clock import now_ms
from freshcore.idindex import IdIndex
from inference.device import to_device, to_host
from inference.tables.devicetable import DeviceTable
from inference.tables.host import (
    EVENT,
    LOCAL,
    UNREPLIED,
    HostRows,
    include_foreign,
    include_oldest,
)
from inference.tables.lru import SlotLRU
from inference.tables.room import make_room
from schemas.rowbatch import TABLE_NAMES
from schemas.rows import TABLE_ITEM, TABLE_USER, initial_rows, width

Fetch = Callable[[int, list[int]], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]
"""fetch(table, ids) -> (mask over ids of the rows the store has, then their rows, versions
and newest event times, in order)."""
Evicted = Callable[[int, np.ndarray, list[int]], None]
"""on_evict(table, slots, ids): rows left the device (``EmbeddingCache.on_evict``)."""


class EmbeddingCache:
    def __init__(
        self,
        dim: int,
        user_capacity: int,
        fetch: Fetch,
        device: torch.device,
        clock: Callable[[], int] = now_ms,
        host_users: int = 0,
        host_items: int = 0,
        dtype: torch.dtype = torch.float32,
        on_evict: Evicted | None = None,
    ) -> None:
        self.dim, self.w = dim, width(dim)
        self.device = device
        self.dtype = dtype
        """How the device tables store rows (float32 or float16); they are read in float32."""
        self.fetch = fetch
        self.clock = clock
        """Milliseconds now: when an item slot was last looked up (``items.seen_ms``)."""
        self.items = DeviceTable(self.w, 1024, device, dtype)
        self.item_index = IdIndex()
        self.item_ids: list[int] = []  # by slot, up to the highest slot ever taken
        self._free_items: list[int] = []  # expired slots, taken again first
        self.items_bounded = False
        """The device had no memory to grow the item table: it keeps its size (``make_room``)."""
        self.kept_items: np.ndarray | None = None  # per slot: the catalogue's (``keep_items``)
        self.users = DeviceTable(self.w, user_capacity, device, dtype)
        self.user_lru = SlotLRU(user_capacity)
        self.host = {
            TABLE_USER: HostRows(host_users, self.w),
            TABLE_ITEM: HostRows(host_items, self.w),
        }
        """The second level, per table: rows the device let go (users evicted from the slab,
        items past the size bound), as fresh as the device's."""
        self.on_evict: Evicted = on_evict or (lambda table, slots, ids: None)
        """Called with the slots whose rows were evicted and those rows' ids, once per
        lookup, before those slots take their new rows."""
        self.newest_replied_ms = 0  # the newest event time a reply has included

    # ------------------------------------------------------------------------------ slots
    def slots(self, table: int, ids: np.ndarray) -> np.ndarray:
        """Slots of ``ids`` (in order), loading misses from the store or creating them. Each
        distinct id is looked up once (a batch names the same rows many times)."""
        distinct, back = np.unique(np.asarray(ids, np.int64), return_inverse=True)
        return self.distinct_slots(table, distinct)[back]

    def distinct_slots(self, table: int, ids: np.ndarray) -> np.ndarray:
        """``slots`` of ids that are distinct already (a caller that grouped them)."""
        ids = np.asarray(ids, np.int64)
        if table == TABLE_ITEM:
            return self._item_slots(ids)
        return self._user_slots(ids)

    def _item_slots(self, ids: np.ndarray, load: bool = True) -> np.ndarray:
        """Slots of item ids (they may repeat). Ids not resident get new slots, their rows
        loaded from the store (``load``; a slot is taken only once its row is in, so a store
        failure leaves nothing half-loaded behind) or left zero at version 0 for the caller
        to install."""
        out = self.item_index.lookup(ids)
        miss = out < 0
        if load:
            m.CACHE_LOOKUPS.labels("item", "device").inc(len(ids) - int(miss.sum()))
        if miss.any():
            missing, back = np.unique(ids[miss], return_inverse=True)
            new_slots = self._next_item_slots(len(missing), out[~miss])
            self._fill(TABLE_ITEM, self.items, missing.tolist(), new_slots, store=load)
            self._register_items(missing, new_slots)
            out[miss] = new_slots[back]
        self.items.seen_ms[out] = self.clock()
        m.CACHE_ROWS.labels("item").set(self.item_rows)
        return out

    @property
    def item_rows(self) -> int:
        """Item rows held (slots taken and not expired)."""
        return len(self.item_ids) - len(self._free_items)

    def _next_item_slots(self, n: int, busy: np.ndarray) -> np.ndarray:
        """``n`` item slots to fill: expired ones first (the free list's last, left on it
        until ``_register_items`` takes them: a failed load gives nothing back), then new ones
        past the highest slot taken (zero rows, version 0), the table grown to hold them —
        or, where the device has no memory for that, rows other than the catalogue's and
        ``busy`` (the lookup's own) let go to host RAM for them (``make_room``)."""
        reuse = min(n, len(self._free_items))
        reused = self._free_items[len(self._free_items) - reuse :]
        start = len(self.item_ids)
        need = start + n - reuse
        held = len(self.items.rows)
        if need > held and (
            self.items_bounded or not self.items.grow_within_memory(need, max(need, 2 * held))
        ):
            self.items_bounded = True
            make_room(self, need - held, busy)
            return self._next_item_slots(n, busy)
        return np.concatenate(
            [np.asarray(reused, np.int64), np.arange(start, need, dtype=np.int64)]
        )

    def keep_items(self, slots: np.ndarray) -> None:
        """The catalogue's slots: rows never let go to make room (``make_room``)."""
        self.kept_items = np.zeros(len(self.item_ids), bool)
        self.kept_items[slots] = True

    def _register_items(self, ids: np.ndarray, slots: np.ndarray) -> None:
        """Hold ``ids`` at ``slots`` (from ``_next_item_slots``: reused ones, then new ones in
        order past the highest slot taken)."""
        self.item_index.insert(ids, slots)
        again = slots < len(self.item_ids)
        reused = int(again.sum())
        if reused:
            del self._free_items[len(self._free_items) - reused :]
        for slot, rid in zip(slots[again].tolist(), ids[again].tolist(), strict=True):
            self.item_ids[slot] = rid
        self.item_ids.extend(ids[~again].tolist())

    def expire_items(self, unseen_since_ms: int, keep: np.ndarray | None = None) -> int:
        """Let the item rows go that no lookup has touched since ``unseen_since_ms`` (the
        worker's events, broadcast installs and catalogue loads all look items up), except
        the slots ``keep`` marks (a bool mask over the first slots; the catalogue's). Their
        slots are reused; ``on_evict`` hears of them first. Returns how many went."""
        n = len(self.item_ids)
        stale = self.evictable(keep)
        stale &= self.items.seen_ms[:n] < unseen_since_ms
        gone = self._evict_items(np.flatnonzero(stale), to_host=False)
        m.CACHE_ROWS_EXPIRED.labels("item").inc(gone)
        return gone

    def evict_items(self, at_most: int, keep: np.ndarray | None = None) -> int:
        """Hold at most ``at_most`` item rows besides those ``keep`` marks: the least recently
        touched of the others leave (a tenth below the bound, so a flood does not evict on
        every call). Returns how many went."""
        slots = np.flatnonzero(self.evictable(keep))
        extra = len(slots) - at_most
        if extra <= 0:
            return 0
        extra = min(len(slots), extra + at_most // 10)
        oldest = np.argpartition(self.items.seen_ms[slots], extra - 1)[:extra]
        gone = self._evict_items(np.sort(slots[oldest]), to_host=True)
        m.CACHE_ROWS_EVICTED.labels("item").inc(gone)
        return gone

    def evictable(self, keep: np.ndarray | None) -> np.ndarray:
        """Per item slot: held, and not marked by ``keep``."""
        n = len(self.item_ids)
        out = np.ones(n, bool)
        if self._free_items:
            out[self._free_items] = False
        if keep is not None:
            k = min(len(keep), n)
            out[:k] &= ~np.asarray(keep[:k], bool)
        return out

    def _evict_items(self, slots: np.ndarray, to_host: bool) -> int:
        """Let the rows at ``slots`` go; past the size bound (``to_host``) they go to host
        RAM, expired ones (untouched for the TTL) go for good."""
        if not len(slots):
            return 0
        ids = [self.item_ids[s] for s in slots.tolist()]
        self.on_evict(TABLE_ITEM, slots, ids)
        if to_host:
            self._to_host(TABLE_ITEM, self.items, slots, ids)
        self.items.rows[self.to_device(slots)] = 0.0
        self.items.version[slots] = 0
        self.items.event_ms[slots] = 0
        self.items.unreplied_ms[slots] = self.items.local_ms[slots] = 0
        self._free_items.extend(slots.tolist())
        self.item_index.delete(np.asarray(ids, np.int64))
        m.CACHE_ROWS.labels("item").set(self.item_rows)
        return len(slots)

    def _user_slots(self, ids: np.ndarray) -> np.ndarray:
        out = np.empty(len(ids), np.int64)
        missing: dict[int, int] = {}
        evicted_slots: list[int] = []
        evicted_ids: list[int] = []
        hits = 0
        for j, i in enumerate(ids.tolist()):
            slot = self.user_lru.get(i)
            if slot is None:
                slot = missing.get(i)
                if slot is None:
                    slot, evicted = self.user_lru.admit(i)
                    if evicted is not None:
                        evicted_slots.append(slot)
                        evicted_ids.append(evicted)
                    missing[i] = slot
            else:
                hits += 1
            out[j] = slot
        if evicted_slots:
            at = np.asarray(evicted_slots, np.int64)
            self.on_evict(TABLE_USER, at, evicted_ids)
            self._to_host(TABLE_USER, self.users, at, evicted_ids)
        m.CACHE_LOOKUPS.labels("user", "device").inc(hits)
        if missing:
            try:
                self._fill(TABLE_USER, self.users, list(missing), list(missing.values()))
            except BaseException:  # the store failed: those slots hold nothing valid
                for i in missing:
                    self.user_lru.discard(i)
                raise
        m.CACHE_ROWS.labels("user").set(len(self.user_lru))
        return out

    def _fill(
        self,
        table: int,
        t: DeviceTable,
        ids: list[int],
        slots: np.ndarray | list[int],
        store: bool = True,
    ) -> None:
        """The misses' rows: those host RAM holds, then one batched store round trip for the
        rest (``store``; without it they are left zero at version 0 for the caller to
        install), the rest created from their ids. If the store fails, the rows taken from
        host RAM go back there."""
        name = TABLE_NAMES[table]
        at = np.asarray(slots, np.int64)
        host = self.host[table]
        in_host, h_rows, h_versions, h_times = host.take(ids)
        n_host = int(in_host.sum())
        if n_host:
            m.CACHE_LOOKUPS.labels(name, "host").inc(n_host)
            m.HOST_ROWS.labels(name).set(len(host))
        if not store:
            rows = np.zeros((len(ids), self.w), np.float32)
            versions = np.zeros(len(ids), np.uint64)
            times = np.zeros((len(ids), 3), np.int64)
        else:
            rest = np.flatnonzero(~in_host)
            try:
                found, got_rows, got_versions, got_event_ms = (
                    self.fetch(table, [ids[j] for j in rest.tolist()])
                    if len(rest)
                    else (np.zeros(0, bool), None, None, None)
                )
            except BaseException:
                if n_host:
                    back = [i for i, h in zip(ids, in_host.tolist(), strict=True) if h]
                    host.put(back, h_rows, h_versions, h_times)
                raise
            hits = int(found.sum())
            m.CACHE_LOOKUPS.labels(name, "redis").inc(hits)
            m.CACHE_LOOKUPS.labels(name, "new").inc(len(rest) - hits)
            rows = np.empty((len(ids), self.w), np.float32)
            new = rest[~found]  # found nowhere: created from their ids
            rows[new] = initial_rows(np.asarray(ids, np.int64)[new], table, self.dim)
            versions = np.zeros(len(ids), np.uint64)
            times = np.zeros((len(ids), 3), np.int64)
            got = rest[found]
            if len(got):
                rows[got], versions[got], times[got, EVENT] = got_rows, got_versions, got_event_ms
        rows[in_host], versions[in_host], times[in_host] = h_rows, h_versions, h_times
        if store or n_host:
            t.rows.index_copy_(0, self.to_device(at), self.stored(rows))
        t.set_version(at, versions)
        t.event_ms[at] = times[:, EVENT]
        t.unreplied_ms[at] = times[:, UNREPLIED]
        t.local_ms[at] = times[:, LOCAL]

    def _to_host(self, table: int, t: DeviceTable, slots: np.ndarray, ids: list[int]) -> None:
        """Rows the device lets go, to host RAM (one copy back), before their slots are
        taken again."""
        host = self.host[table]
        if not host.capacity:
            return
        times = np.stack([t.event_ms[slots], t.unreplied_ms[slots], t.local_ms[slots]], 1)
        host.put(ids, to_host(self.rows(table, slots)), t.version[slots], times)
        m.HOST_ROWS.labels(TABLE_NAMES[table]).set(len(host))

    # ---------------------------------------------------------------------------- access
    def to_device(self, a) -> torch.Tensor:
        """A host array on the tables' device (``device.to_device``)."""
        return to_device(a, self.device)

    def stored(self, rows) -> torch.Tensor:
        """Rows (a host array or a tensor) on the tables' device, in the tables' dtype."""
        return self.to_device(rows).to(self.dtype)

    def rows(self, table: int, slots) -> torch.Tensor:
        """The rows at ``slots``, on the tables' device, in float32."""
        return self.table(table).rows.index_select(0, self.to_device(slots)).float()

    def table(self, table: int) -> DeviceTable:
        return self.items if table == TABLE_ITEM else self.users

    def gather(self, table: int, slots: np.ndarray) -> np.ndarray:
        """The rows at ``slots``, on the host (for inspection and tools: the serving and
        learning paths keep them on the device, ``rows``)."""
        # index_select: 0.18 ms for 8,000 rows of 65 on this CPU, where rows[index] takes 0.47
        return to_host(self.rows(table, slots))

    def add(self, table: int, slots: np.ndarray, deltas: np.ndarray) -> None:
        t = self.table(table)
        t.rows.index_add_(0, self.to_device(slots), self.stored(deltas))

    def held(self, table: int, row_id: int) -> int | None:
        """The slot of a resident row, without loading it (None if absent)."""
        if table == TABLE_ITEM:
            slot = int(self.item_index.lookup(np.array([row_id], np.int64))[0])
            return None if slot < 0 else slot
        return self.user_lru.peek(row_id)

    def slots_for_install(self, table: int, ids: list[int]) -> np.ndarray:
        """Slots for rows about to be installed from the broadcast, -1 for a user not
        resident (users are fetched when they are used). An item not resident gets a slot
        without a store round trip (version 0, so the broadcast row installs; any newer
        version in the store reaches this worker through the broadcast too). The caller
        installs every item row it is given a new slot for."""
        if table == TABLE_ITEM:
            return self._item_slots(np.asarray(ids, np.int64), load=False)
        peek = self.user_lru.peek
        return np.fromiter((-1 if s is None else s for s in map(peek, ids)), np.int64, len(ids))

    def install(self, table: int, slot: int, row: np.ndarray, version: int, event_ms: int) -> None:
        t = self.table(table)
        t.rows[slot] = self.stored(row)
        t.set_version(slot, version)
        t.event_ms[slot] = event_ms

    def install_many(
        self,
        table: int,
        slots: np.ndarray,
        rows: np.ndarray,
        versions: np.ndarray,
        event_ms: np.ndarray,
    ) -> None:
        """``install`` for many rows (distinct slots) in one device copy."""
        t = self.table(table)
        t.rows[self.to_device(slots)] = self.stored(np.asarray(rows, np.float32))
        t.set_version(slots, versions)
        t.event_ms[slots] = event_ms

    # ------------------------------------------------------------- the reply stage
    def learnt(
        self, table: int, slots: np.ndarray, oldest_ms: np.ndarray, newest_ms: np.ndarray
    ) -> None:
        """This worker's local step put events as old as ``oldest_ms`` (as new as
        ``newest_ms``) into rows ``slots`` (distinct): remembered until a reply uses them."""
        t = self.table(table)
        include_oldest(t.unreplied_ms, slots, oldest_ms)
        t.local_ms[slots] = np.maximum(t.local_ms[slots], newest_ms)

    def installed(
        self, table: int, slots: np.ndarray, oldest_ms: np.ndarray, newest_ms: np.ndarray
    ) -> None:
        """Broadcast rows (distinct ``slots``) were installed. Events this worker learnt
        itself were counted from its local step; a row whose update holds events newer
        than any it learnt itself includes others' events, counted from the oldest of the
        update's events that is newer than its own (a lower bound of their lag)."""
        t = self.table(table)
        include_foreign(t.unreplied_ms, t.local_ms, slots, oldest_ms, newest_ms)

    def replied(self, table: int, slots: np.ndarray) -> np.ndarray:
        """A reply used rows ``slots``: the oldest event time each includes that no reply
        had used yet (for those that have one); they are used now."""
        t = self.table(table)
        slots = np.unique(np.asarray(slots, np.int64))
        times = t.unreplied_ms[slots]
        t.unreplied_ms[slots] = 0
        return times[times > 0]

    def observe_reply(self, user_slots: np.ndarray, item_slots: np.ndarray) -> None:
        """Replies went out using these rows: the ``reply`` freshness stage, the lag from
        each row's oldest event no reply had used to now."""
        now = self.clock() / 1000
        times = np.concatenate(
            [self.replied(TABLE_USER, user_slots), self.replied(TABLE_ITEM, item_slots)]
        )
        if len(times):
            m.observe_many(m.FRESHNESS_LAG.labels("reply"), np.maximum(now - times / 1000, 0.0))
            self.newest_replied_ms = max(self.newest_replied_ms, int(times.max()))
            m.FRESHNESS_EVENT_TIME.labels("reply").set(self.newest_replied_ms / 1000)

    def load_items(self, rows: dict[int, tuple[np.ndarray, int, int]]) -> None:
        """Install a whole item table (worker start)."""
        ids = sorted(rows)
        if not ids:
            return
        slots = self._item_slots(np.asarray(ids, np.int64), load=False)
        stacked = np.stack([rows[i][0] for i in ids])
        self.items.rows[self.to_device(slots)] = self.stored(stacked)
        self.items.set_version(slots, [rows[i][1] for i in ids])
        self.items.event_ms[slots] = [rows[i][2] for i in ids]
