"""The worker's device paths where a GPU differs from a CPU, tested on the CPU: ranking time
as the device spends it (CUDA events, here a fake device's), so the ladder sees the real
cost and not the launch's; and out-of-memory survived in a learning slice, in re-ranking and
in the item table's growth, each with a fake allocator failure raising what CUDA's raises
(``torch.OutOfMemoryError``: ``tools/hostsync.py``'s ``free_device_bytes``, or the one call
that allocates made to fail), and counted in ``freshrec_device_oom_total``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import inference.learning.learner as learner
import inference.serving.rerankstage as rerankstage
from freshcore import metrics as m
from inference.serving.devicetime import BatchTotal, DeviceClock
from inference.tables.devicetable import DeviceTable
from schemas.ids import row_ids
from schemas.rows import TABLE_ITEM, TABLE_USER
from tools.devicerig import DeviceRig, RigConfig
from tools.hostsync import STAND_IN, counting

CPU = torch.device("cpu")
SMALL = RigConfig(dim=8, users=200, items=500, requests=4, candidates=60)


class FakeDevice:
    """Timing events of a device that spends ``step_ms`` between one event recorded and the
    next, and has passed them only once ``done`` (a queued kernel the host does not wait
    for): ``events`` stands in for ``torch.cuda.Event``."""

    def __init__(self, step_ms: float) -> None:
        self.step_ms, self.now_ms, self.done = step_ms, 0.0, False

    def events(self, enable_timing: bool = True) -> FakeEvent:
        assert enable_timing
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, device: FakeDevice) -> None:
        self.device, self.at_ms = device, None

    def record(self) -> None:
        self.device.now_ms += self.device.step_ms
        self.at_ms = self.device.now_ms

    def query(self) -> bool:
        return self.device.done

    def elapsed_time(self, end: FakeEvent) -> float:
        return end.at_ms - self.at_ms


def test_a_span_is_handed_on_once_the_device_has_passed_it_with_the_device_time():
    device = FakeDevice(step_ms=5000.0)
    clock = DeviceClock(CPU, events=device.events)
    got: list[float] = []
    t0 = time.monotonic()
    host_ms = clock.stop(clock.start(), got.append)
    assert host_ms <= (time.monotonic() - t0) * 1000 + 1  # the host's time, at once
    assert got == [] and clock.collect() == 0  # queued, not waited for
    device.done = True
    assert clock.collect() == 1 and got == [5000.0]  # the device's, the longer
    assert clock.collect() == 0


def test_a_batch_total_is_handed_on_once_every_part_is_in():
    got: list[float] = []
    total = BatchTotal(got.append)
    a, b = total.part(), total.part()
    a(1.0)
    b(2.0)
    assert got == []  # more parts may come until it is closed
    total.close()
    assert got == [3.0]
    empty = BatchTotal(got.append)
    empty.close()
    assert got == [3.0]  # nothing ranked: no cost


def test_the_ladder_sees_the_ranking_time_the_device_spent_not_the_launch():
    """A forward pass queued on a device returns at once; the full tier's cost the ladder
    reads is the events' time, once the device has passed them, not the host's."""
    rig = DeviceRig(CPU, SMALL)
    device = FakeDevice(step_ms=10_000.0)
    rig.ranking.clock = DeviceClock(CPU, events=device.events)
    choices, _ = rig.serve(rig.batch(), "wide_deep")
    assert {c.tier for c in choices} == {"full"}
    assert rig.ranking.full_cost_ms is None  # queued: the device has not passed it yet
    device.done = True
    rig.ranking.collect_costs()
    # the batch's span holds the model's: four events, three steps of the device
    assert rig.ranking.full_cost_ms == 30_000.0
    assert rig.ranking.light_cost_ms is None
    rig.serve(rig.batch(), "light")
    rig.ranking.collect_costs()
    assert rig.ranking.light_cost_ms == 30_000.0


def oom_count(path: str) -> float:
    return m.DEVICE_OOM.labels(path)._value.get()


def rows_of(rig: DeviceRig, ex) -> list[np.ndarray]:
    """The rows of ``ex``'s users and items, by id (two caches may hold them at other slots)."""
    c = rig.cache
    return [
        c.gather(table, c.slots(table, row_ids(sorted(set(ids)))))
        for table, ids in ((TABLE_USER, ex.users), (TABLE_ITEM, ex.items))
    ]


@pytest.mark.parametrize("loss", ["logistic", "softmax"])
def test_a_slice_the_device_has_no_memory_for_is_learnt_in_halves(loss, monkeypatch):
    """A slice past what the device holds is split at its middle (a softmax slice at a
    group's start) and each half learnt alone, as a worker that had been given the halves
    would have learnt them."""
    cfg = RigConfig(dim=8, users=200, items=500, loss=loss)
    rig, twin = DeviceRig(STAND_IN, cfg), DeviceRig(STAND_IN, cfg)
    ex = rig.examples(200)
    real = learner.step_on_device
    sizes: list[int] = []

    def at_most_60(cache, users, items, ex, learning):
        sizes.append(len(ex.labels))
        if len(ex.labels) > 60:  # the gather of the slice's rows: what CUDA refuses first
            raise torch.OutOfMemoryError("CUDA out of memory (a fake allocator's failure)")
        return real(cache, users, items, ex, learning)

    monkeypatch.setattr(learner, "step_on_device", at_most_60)
    before = oom_count("learning")
    rig.learner.learn(ex)
    learnt = [n for n in sizes if n <= 60]
    assert sum(learnt) == len(ex.labels) and oom_count("learning") == before + 3
    monkeypatch.setattr(learner, "step_on_device", real)
    lo = 0
    for n in learnt:  # the same parts, in order, given to a worker with room for them
        twin.learner.learn(ex.part(lo, lo + n))
        lo += n
    for got, want in zip(rows_of(rig, ex), rows_of(twin, ex), strict=True):
        np.testing.assert_array_equal(got, want)
    assert len(rig.learner.pending) == len(twin.learner.pending)
    if loss == "softmax":  # no group was split: each part starts a group
        assert all(n % (1 + cfg.sampled_negatives) == 0 for n in learnt)


def test_a_slice_the_device_has_no_memory_for_at_all_is_stepped_on_the_host():
    """With no device memory left, a slice is split down to single examples and each is
    stepped on the host, its rows copied there and back: the rows a device step of each
    example would have given."""
    cfg = RigConfig(dim=8, users=50, items=100)
    rig, twin = DeviceRig(STAND_IN, cfg), DeviceRig(STAND_IN, cfg)
    ex = rig.examples(12)
    for r in (rig, twin):  # the slice's rows resident: a lookup allocates nothing
        r.cache.slots(TABLE_USER, row_ids(ex.users))
    before = oom_count("learning")
    with counting(free_device_bytes=0):
        rig.learner.learn(ex)
    # every part refused on the device: the slice, the 10 parts it was split into on the
    # way down, and the 12 single examples, each then stepped on the host
    assert oom_count("learning") == before + 23
    for j in range(len(ex.labels)):
        twin.learner.learn(ex.part(j, j + 1))
    for got, want in zip(rows_of(rig, ex), rows_of(twin, ex), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_re_ranking_the_device_has_no_memory_for_is_done_on_the_host(monkeypatch):
    """MMR's working tensors refused on the device: the batch is re-ranked on the host, to
    the same lists."""
    rig = DeviceRig(STAND_IN, RigConfig(dim=8, users=200, items=500, requests=6, candidates=80))
    assert not rig.reranking.on_host
    b = rig.batch()
    _, lists = rig.serve(b, "wide_deep")
    real = rerankstage.mmr_batch

    def refused_on_the_device(relevance, *args, **kwargs):
        if isinstance(relevance, torch.Tensor):
            raise torch.OutOfMemoryError("CUDA out of memory (a fake allocator's failure)")
        return real(relevance, *args, **kwargs)

    monkeypatch.setattr(rerankstage, "mmr_batch", refused_on_the_device)
    before = oom_count("rerank")
    _, on_host = rig.serve(b, "wide_deep")
    assert oom_count("rerank") == before + 1
    assert on_host == lists and sum(len(v) for v in lists.values()) > 0


def test_an_item_table_the_device_cannot_grow_keeps_its_size_and_its_catalogue():
    """The item table's growth refused: it keeps its size, the catalogue's rows and the
    lookup's own stay, the least recently touched others go to host RAM, and those looked up
    again come back from there as they were."""
    rig = DeviceRig(STAND_IN, RigConfig(dim=8, users=50, items=600), host_rows=10_000)
    cache = rig.cache
    ticks = iter(range(1, 1_000_000))
    cache.clock = lambda: next(ticks)  # each lookup later than the one before
    held = len(cache.items.rows)
    others = row_ids([f"x{n}" for n in range(held - cache.item_rows)])
    cache.slots(TABLE_ITEM, others)  # the table full: catalogue items and others
    assert cache.item_rows == held and not cache.items_bounded
    rows_before = cache.gather(TABLE_ITEM, cache.item_index.lookup(others))
    cache.slots(TABLE_ITEM, others[-50:])  # touched last: the ones to stay
    before = oom_count("table")
    new = row_ids([f"y{n}" for n in range(100)])
    # a bigger table refused (wanted and needed), the lookup's few rows allowed
    with counting(free_device_bytes=held * cache.w * 4 // 2):
        slots = cache.slots(TABLE_ITEM, np.concatenate([others[:10], new]))
    assert oom_count("table") == before + 2 and cache.items_bounded
    assert len(cache.items.rows) == held and len(set(slots.tolist())) == 110
    assert (cache.item_index.lookup(rig.catalogue.row_ids) >= 0).all()
    assert (cache.item_index.lookup(others[:10]) >= 0).all()  # the lookup's own
    assert (cache.item_index.lookup(others[-50:]) >= 0).all()  # the most recent
    gone = np.flatnonzero(cache.item_index.lookup(others) < 0)
    assert 100 <= len(gone) <= 100 + len(others) // 10 and len(cache.host[TABLE_ITEM]) == len(gone)
    back = cache.gather(TABLE_ITEM, cache.slots(TABLE_ITEM, others[gone[:5]]))
    np.testing.assert_array_equal(back, rows_before[gone[:5]])
    assert len(cache.items.rows) == held  # bounded from then on: no growth tried again
    assert oom_count("table") == before + 2


def test_an_item_table_full_of_the_catalogue_and_the_lookup_says_so(monkeypatch):
    """Where only the catalogue and the lookup's own rows are held, nothing can make room:
    the lookup fails with the device's error (the worker cannot hold its catalogue)."""
    rig = DeviceRig(STAND_IN, RigConfig(dim=8, users=50, items=1024))
    assert len(rig.cache.items.rows) == 1024 == rig.cache.item_rows

    def refused(self, capacity):
        raise torch.OutOfMemoryError("CUDA out of memory (a fake allocator's failure)")

    monkeypatch.setattr(DeviceTable, "grow", refused)
    with pytest.raises(torch.OutOfMemoryError, match="only 0 of them may make room"):
        rig.cache.slots(TABLE_ITEM, row_ids(["z"]))
