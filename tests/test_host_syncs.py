"""Host round trips on the worker's hot paths, counted on the CPU standing in for a device
(``cpu:0``: ``inference/device.py``, ``tools/hostsync.py``), so a new one fails here without a
GPU. The budget (``docs/design.md``, "Host round trips"):

- nothing in a learning slice (logistic or softmax) or a serving batch (every ranker, the
  light tier, float32 and float16) makes the host wait for the device — no value read back,
  no copy back, no blocking copy to the device, no host tensor handed to a device op — but
  the sanctioned copies back (``inference.device.to_host``: the lines
  ``tools.hostsync.ALLOWED`` names, with their reasons);
- those are one a slice (the gradient batch) and three a batch (the candidates the vector
  and i2i searches hand to the merge, the reply);
- on the stand-in the worker takes every path a GPU takes (torch re-ranking, the device
  top-k, autocast), and a reply a model error or the device's memory sent to the hot list
  fails the test rather than passing as served.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from freshcore import clock
from freshrec.sim.world import World
from inference.device import to_device, to_host
from inference.learning.steps import Examples
from inference.models.kinds import served_rankers
from inference.serving.rankstage import model_failures
from inference.worker import Worker
from schemas.records import Event, RequestContext
from tools.devicerig import DeviceRig, RigConfig
from tools.hostsync import ALLOWED, STAND_IN, counting
from tools.serving_inprocess import _inbound

from .serving_harness import WORLD, worker_settings

HERE = "tests/test_host_syncs.py"


def world_examples(world: World, n: int, seed: int, loss: str) -> Examples:
    """A slice of ``n`` labelled examples of the world's users and popular items: 30%
    positives (logistic), or groups of a positive and four negatives (softmax)."""
    rng = np.random.default_rng(seed)
    users = [World.user_id(int(u)) for u in world.sample_users(rng, n)]
    items = [World.item_id(int(i)) for i in world.sample_popular_items(rng, n)]
    groups = np.arange(n) // 5 if loss == "softmax" else None
    if loss == "softmax":
        users = [users[g * 5] for g in groups]
        labels = (np.arange(n) % 5 == 0).astype(np.float32)
    else:
        labels = (rng.random(n) < 0.3).astype(np.float32)
    return Examples.of(users, items, labels, np.ones(n), np.full(n, clock.now_ms()), groups)


def clicks(world: World, users: list[str], seed: int) -> list[Event]:
    """Three clicks of each user on popular items: the recent clicks i2i searches from."""
    rng = np.random.default_rng(seed)
    now = clock.now_ms()
    items = world.sample_popular_items(rng, 3 * len(users))
    return [
        Event(f"c{seed}-{n}", "click", user, World.item_id(int(item)), now)
        for n, (user, item) in enumerate(zip(np.repeat(users, 3), items.tolist(), strict=True))
    ]


@pytest.fixture(params=["float32", "float16"])
def warm_worker(request, seeded, model_dir):
    """A worker on the stand-in whose tables and ranking weights are stored in
    ``request.param`` (float16 widens on the device, with no round trip of its own), its
    batch's users with recent clicks."""
    dtype = request.param
    s = worker_settings(seeded, model_dir, device="cpu:0", table_dtype=dtype, ranking_dtype=dtype)
    # the counter slows every operator down: a channel that missed its deadline (and, a few
    # misses on, was shut by its breaker) would leave its copy back uncounted
    slow = {k: replace(c, deadline_ms=c.deadline_ms * 100) for k, c in s.serving.channels.items()}
    w = Worker(replace(s, serving=replace(s.serving, channels=slow)))
    w.start()
    try:
        world = World(WORLD)
        batch = _inbound(world, 16, seed=2)
        w.learner.learn_events(clicks(world, [b.request.user_id for b in batch], seed=3))
        slices = {loss: world_examples(world, 2000, 1, loss) for loss in ("logistic", "softmax")}
        for _ in range(3):  # rows resident, catalogue and models adopted
            w.learn(slices["logistic"])
            w.recommender.serve(batch)
        yield w, slices, batch
    finally:
        w.close()


def low_end(batch):
    """The same requests from low-end devices: the light tier's."""
    ctx = RequestContext("low_end", "north", clock.now_ms())
    return [replace(b, request=replace(b.request, context=ctx)) for b in batch]


def test_a_learning_slice_and_a_serving_batch_keep_their_host_round_trip_budget(warm_worker):
    w, slices, batch = warm_worker
    assert not w.recommender.reranking.on_host  # the stand-in takes a GPU's paths
    work = [(f"{loss} slice", lambda ex=ex: w.learn(ex), 1) for loss, ex in slices.items()]
    settings = w.recommender.settings
    for kind in served_rankers():
        w.recommender.use(replace(settings, ranker=kind), "daily")
        work.append((f"{kind} batch", lambda: w.recommender.serve(batch), 3))
    work.append(("light batch", lambda: w.recommender.serve(low_end(batch)), 3))
    for name, run, copies in work:
        run()  # a model's first batch on the stand-in
        with counting() as c:
            out = run()
        assert not c.syncs, (name, dict(c.syncs))
        assert c.host_copies == copies, (name, c.host_copies, dict(c.allowed))
        if out is not None:  # a serving batch: every request served by its model
            assert len(out) == len(batch) and all(r.items for r in out), name
            assert not model_failures(r.tier_reason for r in out), name
            assert {r.tier for r in out} == {"light" if name == "light batch" else "full"}


def test_the_reranking_stage_gives_the_same_lists_in_numpy_and_in_torch(warm_worker):
    """On a GPU the stage runs in torch, on a CPU in numpy (``RerankStage.on_host``): the
    same lists from the same ranking."""
    w, _, batch = warm_worker
    stage = w.recommender.reranking
    seen = []
    rerank = stage.rerank

    def recording(*args):
        seen.append(args)
        return rerank(*args)

    stage.rerank = recording
    w.recommender.serve(batch)
    (args,) = seen
    on_device = rerank(*args)
    assert sum(len(items) for items in on_device.values()) > 0
    stage.on_host = True
    try:
        assert rerank(*args) == on_device
    finally:
        stage.on_host = False


def _line_of(text: str) -> str:
    """``HERE:N``, N the line of this file whose text is ``text``."""
    lines = Path(__file__).read_text().splitlines()
    return f"{HERE}:{next(n for n, line in enumerate(lines, 1) if line.strip() == text)}"


PLANTS = [
    ("reads back: aten._local_scalar_dense.default", "t.sum().item()"),
    ("reads back: aten._local_scalar_dense.default", "int(t.max())"),
    ("reads back: aten.nonzero.default", "torch.nonzero(t)"),
    ("reads back: aten.index.Tensor", "t[t > 2]"),
    ("reads back: aten.bincount.default", "torch.bincount(t.long())"),
    ("copy back: Tensor.cpu", "t.cpu()"),
    ("copy back: Tensor.numpy", "t.numpy()"),
    ("copy back: Tensor.tolist", "t.tolist()"),
    ("copy back: Tensor.to", 't.to("cpu")'),
    ("copy back: aten.copy_.default", "host.copy_(t)"),
    ("blocking copy to the device: aten._to_copy.default", "host.to(t.device)"),
    ("blocking copy to the device: aten.copy_.default", "t.copy_(host)"),
    ("blocking copy to the device: torch.tensor", "torch.tensor([1.0], device=t.device)"),
    ("host tensor into a device op: aten.add.Tensor", "t + host"),
]
PLANT_LINE = 'eval(code, {"torch": torch}, {"t": t, "host": host})  # the planted line'


@pytest.mark.parametrize(("kind", "code"), PLANTS, ids=[code for _, code in PLANTS])
def test_the_counter_catches_each_kind_of_round_trip_at_its_line(kind, code):
    t = torch.arange(6.0)  # made before the count: the device's, as a table is
    with counting() as c:
        host = torch.from_numpy(np.zeros(6, np.float32))
        eval(code, {"torch": torch}, {"t": t, "host": host})  # the planted line
    assert dict(c.syncs) == {(kind, _line_of(PLANT_LINE)): 1}


def test_the_sanctioned_and_the_harmless_are_not_round_trips():
    """A non-blocking copy to the device, ``to_host`` (named in ``ALLOWED``) and host
    tensors' own reads are not counted as round trips."""
    with counting() as c:
        t = to_device(np.arange(6.0), STAND_IN)
        host = torch.from_numpy(np.arange(6.0))
        (t * 2).sum(0)
        to_host(t)
        host.sum().item(), host.numpy(), host.tolist()
    assert not c.syncs and c.host_copies == 1
    ((what, site),) = c.allowed
    assert what == "copy back: Tensor.numpy" and site.startswith("inference/device.py:")
    assert all(reason for reason in ALLOWED.values())
    assert {m for m, _ in c.calls} == {"item", "numpy", "tolist"}


PLANTED_SYNCS = {  # what is planted → (the planted line, the kind the counter must name)
    ".item()": (lambda t: t.sum().item(), "reads back"),
    ".cpu()": (lambda t: t.cpu(), "copy back"),
    "int(tensor)": (lambda t: int(t.sum()), "reads back"),
    "a blocking copy": (
        lambda t: torch.from_numpy(np.ones(2, np.float32)).to(t.device),
        "blocking copy to the device",
    ),
}


@pytest.mark.parametrize("plant", PLANTED_SYNCS)
@pytest.mark.parametrize("where", ["learning slice", "ranking batch"])
def test_a_round_trip_planted_in_a_slice_or_a_ranking_batch_breaks_the_budget(
    plant, where, monkeypatch
):
    """The counter on the device paths themselves: each kind the budget forbids, added to
    a slice's gradients or a ranking batch's forward pass, is found at its line."""
    import inference.learning.learner as learner
    import inference.models.ranking as ranking

    rig = DeviceRig(STAND_IN, RigConfig(dim=8, users=200, items=500, requests=4, candidates=60))
    ex, b = rig.examples(200), rig.batch()
    slice_ = where == "learning slice"
    module, name = (learner, "gradients") if slice_ else (ranking, "widened_call")
    real = getattr(module, name)

    sync, kind = PLANTED_SYNCS[plant]

    def planted(*args, **kwargs):
        out = real(*args, **kwargs)
        sync(out[0] if isinstance(out, tuple) else out)
        return out

    monkeypatch.setattr(module, name, planted)
    with counting() as c:
        rig.learner.learn(ex) if slice_ else rig.serve(b, "wide_deep")
    line = f"{HERE}:{sync.__code__.co_firstlineno}"
    assert {site for _, site in c.syncs} == {line}, dict(c.syncs)
    assert all(what.startswith(kind) for what, _ in c.syncs), dict(c.syncs)


def test_the_i2i_search_finds_the_same_slots_with_one_copy_back_on_a_device():
    """``search_within_categories`` pads the rows' scores into one top-k on a device (one
    copy back for all the queries): the same slots as one search a query on a CPU."""
    from inference.serving.searches import category_members, search_within_categories

    rng = np.random.default_rng(0)
    items = torch.from_numpy(rng.normal(size=(300, 9)).astype(np.float32))
    members = category_members(rng.integers(0, 6, 300), np.arange(300))
    queries = torch.from_numpy(rng.normal(size=(5, 9)).astype(np.float32))
    allowed = [np.array([0]), np.array([1, 2]), np.array([-1]), np.array([5, 0, 3]), np.array([4])]
    on_cpu = search_within_categories(items, queries, allowed, members, 20)
    with counting() as c:
        on_device = search_within_categories(items, queries, allowed, members, 20)
    assert not c.syncs and c.host_copies == 1
    assert [a.tolist() for a in on_device] == [a.tolist() for a in on_cpu]
    assert [len(a) for a in on_cpu][2] == 0 and all(len(a) == 20 for a in on_cpu[:2])


def test_every_allowed_line_is_a_line_of_its_file():
    """A line ``ALLOWED`` names that its file no longer holds allows nothing: the budget
    would name a copy that is not made, and miss the one that replaced it."""
    for path, text in ALLOWED:
        lines = {
            line.strip() for line in (Path(__file__).parents[1] / path).read_text().splitlines()
        }
        assert text in lines, (path, text)


def test_mmr_with_a_lambda_per_request_copies_nothing_blocking_to_the_device():
    """The per-request λ goes to the device without making the host wait (it was a
    ``torch.tensor(..., device=...)``, a blocking copy a batch)."""
    from inference.serving.rerank import mmr_batch

    rng = np.random.default_rng(0)
    rel = torch.from_numpy(rng.random((3, 12)))  # made before the count: the device's
    vecs = torch.from_numpy(rng.normal(size=(3, 12, 4)).astype(np.float32))
    with counting() as c:
        picks = mmr_batch(rel, vecs, 5, [0.5, 0.7, 0.9], engine="torch")
    assert not c.syncs, dict(c.syncs)
    assert picks.shape == (3, 5)
    assert (
        to_host(picks).tolist() == mmr_batch(rel.numpy(), vecs.numpy(), 5, [0.5, 0.7, 0.9]).tolist()
    )
