"""The embedding cache's three levels: device, host RAM (``inference/tables/host.py``), Redis
(a fetch function here). Pure: no services."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from freshcore import metrics as m
from inference.tables.cache import EmbeddingCache
from inference.tables.host import EVENT, LOCAL, UNREPLIED, HostRows
from schemas.rows import TABLE_ITEM, TABLE_USER, initial_rows

DIM = 4
W = DIM + 1


class Store:
    """Redis's rows: id -> (row, version, event ms); records every fetch; fails on demand."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[np.ndarray, int, int]] = {}
        self.fetched: list[list[int]] = []
        self.fail = False

    def __call__(self, table: int, ids: list[int]):
        if self.fail:
            raise ConnectionError("injected outage")
        self.fetched.append(list(ids))
        hits = [self.rows[i] for i in ids if i in self.rows]
        return (
            np.array([i in self.rows for i in ids], bool),
            np.array([h[0] for h in hits], np.float32).reshape(-1, W),
            np.array([h[1] for h in hits], np.uint64),
            np.array([h[2] for h in hits], np.int64),
        )


def lookups(table: str, tier: str) -> float:
    return m.CACHE_LOOKUPS.labels(table, tier)._value.get()


def counts(table: str) -> dict[str, float]:
    return {t: lookups(table, t) for t in ("device", "host", "redis", "new")}


def delta(before: dict[str, float], table: str) -> dict[str, int]:
    return {t: int(v - before[t]) for t, v in counts(table).items()}


# ------------------------------------------------------------------------------ HostRows
def test_host_rows_hold_the_most_recently_put_and_take_removes_them():
    h = HostRows(3, W)
    rows = np.arange(5 * W, dtype=np.float32).reshape(5, W)
    times = np.arange(15, dtype=np.int64).reshape(5, 3)
    assert h.put([1, 2, 3], rows[:3], np.array([1, 2, 3], np.uint64), times[:3]) == 0
    assert h.put([4, 5], rows[3:], np.array([4, 5], np.uint64), times[3:]) == 2  # 1, 2 left
    assert len(h) == 3 and 1 not in h and 2 not in h
    found, got, versions, got_times = h.take([5, 1, 3])
    assert found.tolist() == [True, False, True]
    assert got.tolist() == [rows[4].tolist(), rows[2].tolist()]
    assert versions.tolist() == [5, 3] and got_times.tolist() == [
        times[4].tolist(),
        times[2].tolist(),
    ]
    assert len(h) == 1 and 5 not in h and 4 in h  # taken rows leave
    assert h.nbytes <= 1024 * (W * 4 + 8 + 24)  # grown to what was used, not to a million


def test_host_rows_of_capacity_zero_hold_nothing():
    h = HostRows(0, W)
    assert h.put([1], np.zeros((1, W), np.float32), np.ones(1, np.uint64), np.zeros((1, 3))) == 0
    assert len(h) == 0 and not h.take([1])[0].any()
    with pytest.raises(ValueError):
        HostRows(-1, W)


def test_a_broadcast_replaces_a_held_row_only_when_newer_and_counts_its_events_unreplied():
    h = HostRows(4, W)
    h.put(
        [1, 2],
        np.zeros((2, W), np.float32),
        np.array([5, 5], np.uint64),
        np.array([[100, 0, 100], [100, 90, 100]], np.int64),  # event, unreplied, local
    )
    done = h.refresh(
        [1, 2, 3],
        np.ones((3, W), np.float32),
        np.array([6, 4, 9], np.uint64),  # newer, older, not held
        np.array([200, 200, 200], np.int64),
        np.array([150, 150, 150], np.int64),
    )
    assert done.tolist() == [True, False, False]
    found, rows, versions, times = h.take([1, 2])
    assert found.all()
    assert rows[0].tolist() == [1.0] * W and rows[1].tolist() == [0.0] * W
    assert versions.tolist() == [6, 5]
    # row 1: others' events from 150 on (newer than its own, 100) are unreplied now
    assert times[0, EVENT] == 200 and times[0, UNREPLIED] == 150 and times[0, LOCAL] == 100
    assert times[1].tolist() == [100, 90, 100]


# ------------------------------------------------------------------------------ users
def test_users_the_slab_evicts_come_back_from_host_ram_as_they_left_without_a_store_trip():
    store = Store()
    store.rows[3] = (np.full(W, 0.25, np.float32), 9, 900)
    cache = EmbeddingCache(DIM, 2, store, torch.device("cpu"), host_users=10)
    first = cache.slots(TABLE_USER, np.array([1, 2]))
    cache.add(TABLE_USER, first[:1], np.full((1, W), 0.5, np.float32))  # learnt locally
    cache.users.version[first[0]] = 4
    cache.learnt(TABLE_USER, first[:1], np.array([40]), np.array([50]))
    learnt_row = cache.gather(TABLE_USER, first[:1])[0].copy()
    before = counts("user")
    store.fetched.clear()
    cache.slots(TABLE_USER, np.array([3]))  # evicts user 1, the least recently used
    assert cache.held(TABLE_USER, 1) is None and 1 in cache.host[TABLE_USER]
    back = cache.slots(TABLE_USER, np.array([1]))  # evicts user 2
    assert store.fetched == [[3]]  # user 1 came from host RAM
    assert cache.gather(TABLE_USER, back)[0].tolist() == learnt_row.tolist()
    assert int(cache.users.version[back[0]]) == 4
    assert cache.users.unreplied_ms[back[0]] == 40 and cache.users.local_ms[back[0]] == 50
    assert delta(before, "user") == {"device": 0, "host": 1, "redis": 1, "new": 0}
    assert 1 not in cache.host[TABLE_USER] and 2 in cache.host[TABLE_USER]


def test_without_host_ram_an_evicted_user_is_fetched_from_the_store_again():
    store = Store()
    cache = EmbeddingCache(DIM, 1, store, torch.device("cpu"), host_users=0)
    cache.slots(TABLE_USER, np.array([1]))
    cache.slots(TABLE_USER, np.array([2]))
    cache.slots(TABLE_USER, np.array([1]))
    assert store.fetched == [[1], [2], [1]]


def test_a_store_failure_puts_the_rows_taken_from_host_ram_back():
    store = Store()
    cache = EmbeddingCache(DIM, 2, store, torch.device("cpu"), host_users=10)
    cache.slots(TABLE_USER, np.array([1, 2]))
    cache.slots(TABLE_USER, np.array([3, 4]))  # 1 and 2 to host RAM
    store.fail = True
    with pytest.raises(ConnectionError):
        cache.slots(TABLE_USER, np.array([1, 5]))  # 1 from host, 5 needs the store
    assert 1 in cache.host[TABLE_USER] and cache.held(TABLE_USER, 1) is None
    store.fail = False
    store.fetched.clear()
    cache.slots(TABLE_USER, np.array([1, 5]))
    assert store.fetched == [[5]]


def test_broadcast_rows_for_users_in_host_ram_keep_them_fresh():
    store = Store()
    cache = EmbeddingCache(DIM, 1, store, torch.device("cpu"), host_users=10)
    cache.slots(TABLE_USER, np.array([1]))
    cache.slots(TABLE_USER, np.array([2]))  # 1 to host RAM at version 0
    assert cache.slots_for_install(TABLE_USER, [1]).tolist() == [-1]
    fresh = np.full((1, W), 2.0, np.float32)
    kept = cache.host[TABLE_USER].refresh(
        [1], fresh, np.array([3], np.uint64), np.array([500]), np.array([400])
    )
    assert kept.tolist() == [True]
    back = cache.slots(TABLE_USER, np.array([1]))
    assert cache.gather(TABLE_USER, back)[0].tolist() == [2.0] * W
    assert int(cache.users.version[back[0]]) == 3 and cache.users.event_ms[back[0]] == 500


# ------------------------------------------------------------------------------ items
def test_items_past_the_size_bound_go_to_host_ram_expired_ones_do_not():
    store = Store()
    now = [1_000]
    cache = EmbeddingCache(DIM, 4, store, torch.device("cpu"), clock=lambda: now[0], host_items=100)
    slots = cache.slots(TABLE_ITEM, np.arange(10, 20))  # ten items, all new
    cache.add(TABLE_ITEM, slots, np.full((10, W), 1.0, np.float32))
    cache.items.version[slots] = 7
    now[0] = 2_000
    cache.slots(TABLE_ITEM, np.arange(15, 20))  # the last five touched again
    assert cache.evict_items(5) == 5  # the bound: 10..14 to host RAM (a tenth below: 0 here)
    assert all(i in cache.host[TABLE_ITEM] for i in range(10, 15))
    store.fetched.clear()
    before = counts("item")
    back = cache.slots(TABLE_ITEM, np.array([10, 11]))
    assert store.fetched == [] and delta(before, "item")["host"] == 2
    expected = initial_rows(np.array([10]), TABLE_ITEM, DIM)[0] + 1.0
    assert np.allclose(cache.gather(TABLE_ITEM, back[:1])[0], expected)
    assert int(cache.items.version[back[0]]) == 7
    # a broadcast for an item in host RAM gets its slot with the held row and version, so an
    # older broadcast row is seen as stale by the installer
    install = cache.slots_for_install(TABLE_ITEM, [12])
    assert int(cache.items.version[install[0]]) == 7 and 12 not in cache.host[TABLE_ITEM]
    # rows untouched for the TTL leave for good
    now[0] = 10_000
    gone = cache.expire_items(unseen_since_ms=9_000)
    assert gone > 0 and len(cache.host[TABLE_ITEM]) == 2  # 13, 14 still; none added


def test_the_installer_sends_broadcast_rows_for_users_in_host_ram_there():
    from inference.learning.pending import PendingSteps
    from inference.learning.updates import UpdateInstaller
    from schemas.rowbatch import KIND_UPDATES, RowBatch

    store = Store()
    cache = EmbeddingCache(DIM, 1, store, torch.device("cpu"), host_users=10)
    cache.slots(TABLE_USER, np.array([1]))
    cache.slots(TABLE_USER, np.array([2]))  # 1 in host RAM, 2 on the device
    installer = UpdateInstaller(cache, PendingSteps(64, W), producer=None)

    def count(outcome: str) -> float:
        return m.UPDATES_INSTALLED.labels("user", outcome)._value.get()

    before = {o: count(o) for o in ("host", "installed", "not_cached")}
    installer.on_update(
        RowBatch(
            KIND_UPDATES,
            TABLE_USER,
            np.array([1, 2, 3], np.uint64),
            np.full((3, W), 3.0, np.float32),
            np.full(3, 5, np.uint64),
            np.full(3, 1000, np.int64),
        ).encode()
    )
    assert {o: count(o) - v for o, v in before.items()} == {
        "host": 1,
        "installed": 1,
        "not_cached": 1,
    }
    back = cache.slots(TABLE_USER, np.array([1]))
    assert cache.gather(TABLE_USER, back)[0].tolist() == [3.0] * W
    assert int(cache.users.version[back[0]]) == 5


def test_the_item_tables_newest_version_follows_every_install_without_a_scan():
    """A reply's ``item_table_version`` is ``items.newest``: the highest version installed
    by any path (a store load, a broadcast, a whole table), kept when rows leave."""
    rows = {7: (np.ones(DIM + 1, np.float32), 3, 0), 8: (np.ones(DIM + 1, np.float32), 5, 0)}
    cache = EmbeddingCache(
        DIM, 2, lambda t, ids: (np.zeros(len(ids), bool), None, None, None), torch.device("cpu")
    )
    assert cache.items.newest == 0
    cache.load_items(rows)
    assert cache.items.newest == 5
    (slot,) = cache.slots_for_install(TABLE_ITEM, [9])
    cache.install(TABLE_ITEM, int(slot), np.zeros(DIM + 1, np.float32), 11, 0)
    assert cache.items.newest == 11
    cache.install_many(TABLE_ITEM, np.array([slot]), np.zeros((1, DIM + 1)), np.array([4]), [0])
    assert cache.items.newest == 11 == max(11, int(cache.items.version.max()))
    cache.evict_items(0)
    assert cache.items.newest == 11
