"""Host round trips on the worker's hot paths, counted on the CPU (``tools/hostsync.py``), so
a new one fails here without a GPU. The budget (``docs/design.md``, "Host round trips"):

- no operator that reads device values back to decide a shape or a Python value (``.item()``,
  ``nonzero``, boolean indexing, …) in a learning slice or a serving batch;
- one sanctioned copy back per learning slice (the gradient batch), at most two per serving
  batch (the candidates recall hands to the merge on a GPU, the reply);
- every ``Tensor.numpy``/``cpu``/``tolist``/``item`` call on those paths from a line named
  below, each on a tensor that lives on the host (made from a host array), not a table's.
"""

from __future__ import annotations

import numpy as np
import pytest

from freshrec.sim.world import World
from inference.worker import Worker
from tools.gpu_sync_check import examples
from tools.hostsync import counting
from tools.serving_inprocess import _inbound

from .serving_harness import WORLD, worker_settings

HOST_TENSOR_LINES = {
    # the sanctioned copy itself (``to_host``)
    "inference/device.py",
    # per-group counts and times, scattered on host tensors made from the slice's arrays
    "inference/learning/steps.py",
    # the CPU path of the vector search: a GPU's goes through to_host
    "inference/serving/ann.py",
    # the CPU paths of MMR and of the re-ranking stage (numpy views of host tensors): a
    # GPU's stay in torch
    "inference/serving/rerank.py",
    "inference/serving/rerankstage.py",
}


@pytest.fixture(params=["float32", "float16"])
def warm_worker(request, seeded, model_dir):
    """A worker whose tables and ranking weights are stored in ``request.param``: the
    float16 storage widens on the device, with no round trip of its own."""
    dtype = request.param
    w = Worker(worker_settings(seeded, model_dir, table_dtype=dtype, ranking_dtype=dtype))
    w.start()
    try:
        world = World(WORLD)
        ex = examples(world, 2000, seed=1)
        batch = _inbound(world, 16, seed=2)
        for _ in range(3):  # rows resident, catalogue and models adopted
            w.learn(ex)
            w.recommender.serve(batch)
        yield w, ex, batch
    finally:
        w.close()


def test_a_learning_slice_and_a_serving_batch_keep_their_host_round_trip_budget(warm_worker):
    w, ex, batch = warm_worker
    for name, work, copies in (
        ("learning slice", lambda: w.learn(ex), (1, 1)),
        ("serving batch", lambda: w.recommender.serve(batch), (0, 2)),
    ):
        with counting() as c:
            out = work()
        if name == "serving batch":
            assert len(out) == len(batch) and all(r.items for r in out)
        assert not c.syncs, (name, dict(c.syncs))
        assert copies[0] <= c.host_copies <= copies[1], (name, c.host_copies)
        lines = {site.rpartition(":")[0] for _, site in c.calls}
        assert lines <= HOST_TENSOR_LINES, (name, dict(c.calls))


def test_the_reranking_stage_gives_the_same_lists_in_numpy_and_in_torch(warm_worker):
    """On a CPU the stage runs in numpy (``RerankStage.on_host``); the torch path a GPU takes
    gives the same lists from the same ranking, here on the CPU."""
    w, _, batch = warm_worker
    stage = w.recommender.reranking
    assert stage.on_host
    seen = []
    rerank = stage.rerank

    def recording(*args):
        seen.append(args)
        return rerank(*args)

    stage.rerank = recording
    w.recommender.serve(batch)
    (args,) = seen
    assert sum(len(items) for items in rerank(*args).values()) > 0
    stage.on_host = False
    on_device = rerank(*args)
    stage.on_host = True
    assert on_device == rerank(*args)


def test_the_counter_sees_what_a_gpu_would_wait_for():
    """The counter is not blind: each kind of round trip it claims to see, it sees."""
    import torch

    from inference.device import to_host

    t = torch.arange(6.0)
    with counting() as c:
        t.sum().item()
        t[t > 2]
        torch.nonzero(t)
        int(t.max())
        to_host(t)
        t.tolist()
    ops = {op for op, _ in c.syncs}
    assert {"aten._local_scalar_dense.default", "aten.nonzero.default"} <= ops, ops
    assert any(site.startswith("tests/test_host_syncs.py") for _, site in c.syncs)
    assert (
        c.host_copies == 1
        and ("tolist", f"tests/test_host_syncs.py:{_line_of('t.tolist()')}") in c.calls
    )
    assert np.isfinite(float(t.sum()))


def _line_of(text: str) -> int:
    from pathlib import Path

    lines = Path(__file__).read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if line.strip() == text)
