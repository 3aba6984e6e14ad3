"""The device check's checks (``tools/device_check.py``): the worker's in-process device paths,
driven through ``tools/devicerig.py`` without a broker or Redis, each returning its figures
and raising ``AssertionError`` where the device does what the worker must not.

- ``tables``: an item table and a user slab per storage precision: bytes a row (the tensors';
  on CUDA the allocator's growth too) and a lookup of new items;
- ``learning``: a slice of each loss (logistic, sampled softmax) in each precision: its time,
  and its one copy back (``docs/design.md``, "Host round trips");
- ``ranking``: a batch ranked by every served model and by the light tier, in each
  precision, and re-ranked: its time, its one copy back (the reply: the rig has no recall),
  every request served by its model (a model error is served from the hot list and looks
  served: it fails here);
- ``reranking``: the torch path a GPU takes and the numpy path a CPU takes give the same
  lists;
- ``round_trips``: ``tools/hostsync.py``'s count over a slice of each loss and a batch of
  several rankers: nothing the budget does not name;
- ``out_of_memory``: a fake allocator failure in a learning slice, in re-ranking, in the item
  table's growth and in ranking, each survived and counted; on CUDA, a real one too (the
  process's share of the device cut down to what it holds, then given back).

On CUDA the learning and ranking checks run under ``torch.cuda.set_sync_debug_mode("error")``
(``inference.device.to_host`` is the one copy allowed), so a sync the counter missed fails
there; times are taken with a synchronise before and after (the check's own, not the
worker's).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

import inference.serving.rerankstage as rerankstage
from freshcore import metrics as m
from inference.device import HOST_COPIES, device_memory, on_accelerator
from inference.models.kinds import served_rankers
from inference.serving.rankstage import model_failures
from schemas.ids import row_ids
from schemas.rows import TABLE_ITEM, TABLE_USER
from tools.devicerig import DeviceRig, RigConfig
from tools.hostsync import STAND_IN, counting

PRECISIONS = ("float32", "float16")
LOSSES = ("logistic", "softmax")


@dataclass(frozen=True)
class Scale:
    """How big the check's tables, slices and batches are."""

    dim: int
    users: int
    items: int
    requests: int
    candidates: int
    slice: int
    repeats: int


SCALES = {
    "small": Scale(dim=8, users=300, items=2000, requests=8, candidates=100, slice=400, repeats=2),
    "full": Scale(
        dim=64, users=50_000, items=200_000, requests=64, candidates=500, slice=4000, repeats=5
    ),
}
SMALL = SCALES["small"]


class Context:
    """What every check is given: the device and the scale, and how to time and to hold the
    work on that device."""

    def __init__(self, device: torch.device, scale: Scale) -> None:
        self.device, self.scale = device, scale
        self.cuda = device.type == "cuda"

    def rig(self, scale: Scale | None = None, host_rows: int = 0, device=None, **cfg) -> DeviceRig:
        """A rig of ``scale`` (the check's) on ``device`` (the check's), ``cfg`` the rest of
        its ``RigConfig``."""
        s = scale or self.scale
        size = {"dim": s.dim, "users": s.users, "items": s.items}
        batch = {"requests": s.requests, "candidates": s.candidates}
        config = RigConfig(**size, **batch, **cfg)
        return DeviceRig(device or self.device, config, host_rows=host_rows)

    @property
    def counted_device(self) -> torch.device:
        """Where the counter runs: the device, or on a plain CPU (no device to wait for) the
        CPU standing in for one."""
        return self.device if on_accelerator(self.device) else STAND_IN

    @contextlib.contextmanager
    def no_sync(self):
        """On CUDA: any copy back or sync but ``to_host`` raises inside."""
        if not self.cuda:
            yield
            return
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)

    def copies(self, work: Callable[[], object]) -> tuple[object, int]:
        """``work``'s result and its copies back, under ``no_sync``."""
        before = HOST_COPIES["count"]
        with self.no_sync():
            out = work()
        return out, HOST_COPIES["count"] - before

    def median_ms(self, work: Callable[[], object]) -> float:
        times = []
        for _ in range(self.scale.repeats):
            if self.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            work()
            if self.cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1000)
        return round(float(np.median(times)), 3)


def tables(ctx: Context) -> dict:
    return {dtype: _table(ctx, dtype) for dtype in PRECISIONS}


def _table(ctx: Context, dtype: str) -> dict:
    before = device_memory(ctx.device).get("allocated")
    rig = ctx.rig(table_dtype=dtype)
    after = device_memory(ctx.device).get("allocated")
    rows = rig.cache.items.rows
    fresh = iter(range(10**9))

    def lookup():
        names = [f"new{next(fresh)}" for _ in range(ctx.scale.slice)]
        rig.cache.slots(TABLE_ITEM, row_ids(names))

    return {
        "item_rows": int(rig.cache.item_rows),
        "bytes_per_row": rows.element_size() * rows.shape[1],
        "allocated_bytes": None if before is None else after - before,
        "lookup_new_items_ms": ctx.median_ms(lookup),
    }


def learning(ctx: Context) -> dict:
    out = {}
    for loss in LOSSES:
        for dtype in PRECISIONS:
            rig = ctx.rig(table_dtype=dtype, loss=loss)
            ex = rig.examples(ctx.scale.slice)
            rig.learner.learn(ex)  # the rows resident
            _, copies = ctx.copies(lambda rig=rig, ex=ex: rig.learner.learn(ex))
            assert copies == 1, f"{loss} {dtype}: {copies} copies back a slice, the budget is 1"
            out[f"{loss}/{dtype}"] = {
                "examples": len(ex.labels),
                "slice_ms": ctx.median_ms(lambda rig=rig, ex=ex: rig.learner.learn(ex)),
                "host_copies": copies,
            }
    return out


def ranking(ctx: Context) -> dict:
    out = {}
    for dtype in PRECISIONS:
        rig = ctx.rig(table_dtype=dtype, ranking_dtype=dtype)
        b = rig.batch()
        for kind in (*served_rankers(), "light"):
            out[f"{kind}/{dtype}"] = _ranked(ctx, rig, b, kind)
    return out


def _ranked(ctx: Context, rig: DeviceRig, b, kind: str) -> dict:
    """``b`` ranked by ``kind`` and re-ranked: its figures, once the model has run once."""
    rig.serve(b, kind)  # a model's first batch
    (choices, lists), copies = ctx.copies(lambda: rig.serve(b, kind))
    failed = model_failures(c.reason for c in choices)
    assert not failed, f"{kind}: served from the hot list: {failed[0]}"
    assert copies <= 1, f"{kind}: {copies} copies back a batch, the budget is 1"
    assert all(lists.get(j) for j in range(len(b.reqs))), f"{kind}: a request got no list"
    return {
        "requests": len(b.reqs),
        "candidates": int(sum(len(c) for c in b.merged)),
        "batch_ms": ctx.median_ms(lambda: rig.serve(b, kind)),
        "host_copies": copies,
    }


def reranking(ctx: Context) -> dict:
    rig = ctx.rig()
    b = rig.batch()
    stage = rig.reranking
    was = stage.on_host
    try:
        stage.on_host = False
        _, in_torch = rig.serve(b, "wide_deep")
        stage.on_host = True
        _, in_numpy = rig.serve(b, "wide_deep")
    finally:
        stage.on_host = was
    assert in_torch == in_numpy, "the torch and numpy re-ranking paths gave other lists"
    return {"requests": len(in_torch), "items": sum(len(v) for v in in_torch.values())}


def round_trips(ctx: Context) -> dict:
    """The counter's findings (small tables: the counter makes every operator slow)."""
    out = {}
    work = {}
    for loss in LOSSES:
        rig = ctx.rig(SMALL, loss=loss, device=ctx.counted_device)
        ex = rig.examples(SMALL.slice)
        rig.learner.learn(ex)
        work[f"{loss} slice"] = lambda rig=rig, ex=ex: rig.learner.learn(ex)
    rig = ctx.rig(SMALL, device=ctx.counted_device)
    b = rig.batch()
    for kind in ("wide_deep", "tiered", "light"):
        rig.serve(b, kind)
        work[f"{kind} batch"] = lambda kind=kind: rig.serve(b, kind)
    for name, run in work.items():
        with counting() as c:
            run()
        syncs = [f"{what} at {site}" for (what, site) in c.syncs]
        assert not syncs, f"{name}: {syncs}"
        out[name] = {"host_copies": c.host_copies, "allowed": sum(c.allowed.values())}
    return out


def _oom(path: str) -> float:
    return m.DEVICE_OOM.labels(path)._value.get()


def out_of_memory(ctx: Context) -> dict:
    out = {"learning": _fake_oom_learning(ctx), "rerank": _fake_oom_rerank(ctx)}
    out["table"] = _fake_oom_table(ctx)
    out["ranking"] = _fake_oom_ranking(ctx)
    if ctx.cuda:
        out["real_cuda"] = _real_oom(ctx)
    return out


def _fake_oom_learning(ctx: Context) -> dict:
    rig = ctx.rig(SMALL, device=ctx.counted_device)
    ex = rig.examples(16)
    rig.cache.slots(TABLE_USER, row_ids(ex.users))
    before = _oom("learning")
    with counting(free_device_bytes=0):  # nothing new fits: every example on the host
        rig.learner.learn(ex)
    refused = _oom("learning") - before
    assert refused == 2 * len(ex.labels) - 1, f"learning: {refused} refusals counted"
    return {"examples": len(ex.labels), "refusals": refused}


def _fake_oom_rerank(ctx: Context) -> dict:
    rig = ctx.rig(SMALL, device=ctx.counted_device)
    rig.reranking.on_host = False
    b = rig.batch()
    _, lists = rig.serve(b, "wide_deep")
    real = rerankstage.mmr_batch

    def refused(relevance, *args, **kwargs):
        if isinstance(relevance, torch.Tensor):
            raise torch.OutOfMemoryError("out of memory (the device check's fake failure)")
        return real(relevance, *args, **kwargs)

    before = _oom("rerank")
    rerankstage.mmr_batch = refused
    try:
        _, on_host = rig.serve(b, "wide_deep")
    finally:
        rerankstage.mmr_batch = real
    assert _oom("rerank") == before + 1 and on_host == lists, "re-ranking on the host differed"
    return {"requests": len(on_host)}


def _fake_oom_table(ctx: Context) -> dict:
    # a catalogue of 600 in a table of 1,024: 424 rows outside it, to make room with
    rig = ctx.rig(replace(SMALL, items=600), host_rows=10_000, device=ctx.counted_device)
    cache = rig.cache
    held = len(cache.items.rows)
    cache.slots(TABLE_ITEM, row_ids([f"x{n}" for n in range(held - cache.item_rows)]))
    before = _oom("table")
    with counting(free_device_bytes=held * cache.w * 4 // 2):  # no bigger table fits
        cache.slots(TABLE_ITEM, row_ids([f"y{n}" for n in range(100)]))
    kept = bool((cache.item_index.lookup(rig.catalogue.row_ids) >= 0).all())
    assert cache.items_bounded and len(cache.items.rows) == held and kept, "table not bounded"
    return {"rows": held, "refusals": _oom("table") - before, "in_host_ram": len(cache.host[1])}


def _fake_oom_ranking(ctx: Context) -> dict:
    rig = ctx.rig(SMALL, device=ctx.counted_device)
    b = rig.batch()
    rig.serve(b, "wide_deep")
    with counting(free_device_bytes=0):  # not even one request fits: each served hot
        choices, _ = rig.serve(b, "wide_deep")
    failed = model_failures(c.reason for c in choices)
    assert len(failed) == len(b.reqs), f"ranking: {len(failed)} of {len(b.reqs)} served hot"
    return {"requests": len(b.reqs), "served_hot": len(failed)}


def _real_oom(ctx: Context) -> dict:
    """CUDA's own allocator refusing: the process's share of the device cut to what it holds
    and a little more, a slice and a batch far larger than that, then the share given back."""
    rig = ctx.rig(table_dtype="float32")
    ex, b = rig.examples(ctx.scale.slice * 50), rig.batch(ctx.scale.requests * 4)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(ctx.device).total_memory
    reserved = torch.cuda.memory_reserved(ctx.device)
    before = {p: _oom(p) for p in ("learning", "ranking")}
    torch.cuda.set_per_process_memory_fraction(min(1.0, (reserved + 64 * 2**20) / total))
    try:
        rig.learner.learn(ex)
        choices, _ = rig.serve(b, "wide_deep")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    return {
        "refusals": {p: _oom(p) - n for p, n in before.items()},
        "served_hot": len(model_failures(c.reason for c in choices)),
    }


CHECKS: dict[str, Callable[[Context], dict]] = {
    "tables": tables,
    "learning": learning,
    "ranking": ranking,
    "reranking": reranking,
    "round_trips": round_trips,
    "out_of_memory": out_of_memory,
}
"""Every check, in the order the device check runs them."""
