"""Pure serving policies: batching decision, circuit breaker, MMR and category spacing,
channel merging with quotas."""

from __future__ import annotations

import sys
from collections import Counter

import numpy as np
import pytest
import torch
from confluent_kafka import TopicPartition

from freshcore import metrics as m
from inference.batching import BatchPolicy, Decision, EventSlicer, split_expired
from inference.eventflow import EventFlow
from inference.serving.breaker import CLOSED, HALF_OPEN, OPEN, BreakerConfig, CircuitBreaker
from inference.serving.merge import merge_channels
from inference.serving.rerank import mmr, mmr_batch, space_categories


def test_batching_flushes_on_size_or_on_the_oldest_requests_wait():
    p = BatchPolicy(max_batch=3, max_wait_ms=10)
    assert p.decide(0, None, 0) == Decision(False, 10)
    assert p.decide(1, 0, 4) == Decision(False, 6)
    assert p.decide(1, 0, 10).flush
    assert p.decide(3, 0, 0).flush
    assert BatchPolicy(max_batch=1, max_wait_ms=50).decide(1, 0, 0).flush
    with pytest.raises(ValueError):
        BatchPolicy(max_batch=0)


def test_event_slices_grow_until_a_slice_fills_its_time_budget():
    s = EventSlicer(budget_ms=10, least=64, most=4096, start=256)
    s.request_seen(now=0.0)  # requests are flowing: the 10 ms budget

    def modelled_ms(n: int) -> float:  # a slice's cost: 1 ms of fixed work plus 8 µs an event
        return 1.0 + 0.008 * n

    assert s.size(now=0.0) == 256
    for _ in range(30):
        n = s.size(now=0.0)
        s.observe(n, modelled_ms(n) / 1000)
    # the fixed point: as many events as fit in the budget, (10 - 1) / 0.008 = 1,125
    assert 1080 <= s.size(now=0.0) <= 1125 and modelled_ms(s.size(now=0.0)) <= 10.0
    for _ in range(30):  # the events got dearer (cold rows): the slices shrink to the budget
        n = s.size(now=0.0)
        s.observe(n, (1.0 + 0.08 * n) / 1000)
    assert 100 <= s.size(now=0.0) <= 113
    s.observe(0, 0.5)  # nothing learnt: no estimate from it
    s.observe(10, 0.0)
    assert 100 <= s.size(now=0.0) <= 113


def test_event_slices_take_the_idle_budget_only_while_no_request_arrives():
    s = EventSlicer(budget_ms=10, idle_budget_ms=40, least=64, most=16384, start=256, quiet_s=1.0)
    s.observe(1000, 0.008)  # 8 µs an event
    assert s.size(now=100.0) == 5000  # no request ever: 40 ms
    s.request_seen(now=100.0)
    assert s.size(now=100.0) == s.size(now=101.0) == 1250  # within a second of one: 10 ms
    assert s.size(now=101.01) == 5000  # quiet again


def test_event_slices_stay_within_their_bounds():
    s = EventSlicer(budget_ms=10, least=64, most=500, start=256)
    s.observe(100, 0.000001)  # nearly free events: capped at most
    assert s.size(now=0.0) == 500
    s = EventSlicer(budget_ms=10, least=64, most=500, start=256)
    s.observe(100, 1.0)  # 10 ms an event: never fewer than least
    assert s.size(now=0.0) == 64
    bad_ones = (
        dict(budget_ms=0),
        dict(idle_budget_ms=0),
        dict(least=0),
        dict(start=5000),
        dict(least=300),
    )
    for bad in bad_ones:
        with pytest.raises(ValueError):
            EventSlicer(**{"least": 64, "most": 4096, "start": 256, **bad})


def test_expired_requests_are_split_off_before_work():
    live, expired = split_expired([("a", 5), ("b", None), ("c", 20)], lambda r: r[1], now_ms=10)
    assert [r[0] for r in live] == ["b", "c"] and [r[0] for r in expired] == ["a"]


def breaker() -> CircuitBreaker:
    return CircuitBreaker(
        BreakerConfig(window=10, min_calls=5, threshold=0.1, cooldown_ms=100, probes=1)
    )


def test_breaker_stays_closed_below_min_calls_and_threshold():
    b = breaker()
    for _ in range(4):
        b.record(False, 0)
    assert b.state(0) == CLOSED  # too few calls to judge
    b = breaker()
    for ok in [True] * 9 + [False]:
        b.record(ok, 0)
    assert b.state(0) == CLOSED and b.failure_rate() == pytest.approx(0.1)


def test_breaker_opens_above_threshold_refuses_then_probes_after_cooldown():
    b = breaker()
    for ok in [True] * 4 + [False] * 2:
        b.record(ok, 0)
    assert b.state(0) == OPEN and not b.allow(50)
    assert b.state(100) == HALF_OPEN
    assert b.allow(100) and not b.allow(100)  # one probe at a time
    b.record(False, 101)
    assert b.state(101) == OPEN and not b.allow(150)
    assert b.allow(201)
    b.record(True, 202)
    assert b.state(202) == CLOSED and b.failure_rate() == 0.0


def test_mmr_with_lambda_one_is_pure_relevance_and_lower_lambda_diversifies():
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((50, 8))
    rel = rng.random(50)
    assert mmr(rel, vecs, 10, lam=1.0) == list(np.argsort(-rel)[:10])
    near_dupes = np.vstack([vecs[:1]] * 5 + [vecs[1:2]])
    picked = mmr(np.array([1.0, 0.99, 0.98, 0.97, 0.96, 0.5]), near_dupes, 2, lam=0.5)
    assert picked == [0, 5]
    assert mmr(rel, vecs, 0) == [] and len(mmr(rel, vecs, 100)) == 50
    with pytest.raises(ValueError):
        mmr(rel, vecs, 3, lam=1.5)


def test_mmr_does_not_mutate_its_inputs():
    rel, vecs = np.array([0.3, 0.2, 0.1]), np.eye(3)
    rel0, vecs0 = rel.copy(), vecs.copy()
    mmr(rel, vecs, 3, 0.5)
    assert (rel == rel0).all() and (vecs == vecs0).all()


@pytest.mark.parametrize("engine", ["numpy", "torch"])
def test_batched_mmr_picks_what_mmr_picks_per_request(engine):
    rng = np.random.default_rng(7)
    for _ in range(200):
        b, p, k, lam = rng.integers(1, 8), rng.integers(1, 60), rng.integers(0, 25), rng.random()
        rel = rng.random((b, p))
        vecs = rng.standard_normal((b, p, 8)).astype(np.float32)
        lens = rng.integers(0, p + 1, b)  # shorter requests are padded with -inf
        for j in range(b):
            rel[j, lens[j] :] = -np.inf
        got = mmr_batch(rel, vecs, k, lam, engine)
        assert got.shape == (b, min(k, p))
        for j in range(b):
            picked = [x for x in got[j].tolist() if x >= 0]
            assert picked == mmr(rel[j, : lens[j]], vecs[j, : lens[j]], k, lam)
    with pytest.raises(ValueError):
        mmr_batch(np.zeros((1, 3)), np.zeros((1, 3, 2)), 2, lam=-0.1)


@pytest.mark.parametrize("engine", ["numpy", "torch"])
def test_batched_mmr_with_a_lambda_per_request_picks_what_mmr_picks_with_each(engine):
    rng = np.random.default_rng(8)
    for _ in range(100):
        b, p, k = rng.integers(1, 8), rng.integers(1, 40), rng.integers(0, 15)
        lams = rng.random(b).round(2).tolist()
        rel = rng.random((b, p))
        vecs = rng.standard_normal((b, p, 8)).astype(np.float32)
        got = mmr_batch(rel, vecs, k, lams, engine)
        for j in range(b):
            assert [x for x in got[j].tolist() if x >= 0] == mmr(rel[j], vecs[j], k, lams[j])
    with pytest.raises(ValueError):
        mmr_batch(np.zeros((2, 3)), np.zeros((2, 3, 2)), 2, lam=[0.5])
    with pytest.raises(ValueError):
        mmr_batch(np.zeros((1, 3)), np.zeros((1, 3, 2)), 2, lam=[1.5])


def test_batched_mmr_on_a_cpu_runs_in_numpy_and_gives_back_what_it_was_given():
    """Torch inputs on a CPU take the numpy steps (``auto``) and get a tensor back, with the
    picks the torch steps make; an unknown engine is refused."""
    rng = np.random.default_rng(9)
    rel = torch.from_numpy(rng.random((4, 30)))
    rel[1, 20:] = -torch.inf
    vecs = torch.from_numpy(rng.standard_normal((4, 30, 8)).astype(np.float32))
    got = mmr_batch(rel, vecs, 12, [0.2, 0.5, 0.7, 1.0])
    assert isinstance(got, torch.Tensor) and got.dtype == torch.int64
    assert torch.equal(got, mmr_batch(rel, vecs, 12, [0.2, 0.5, 0.7, 1.0], "torch"))
    with pytest.raises(ValueError, match="engine"):
        mmr_batch(rel, vecs, 2, 0.5, "cupy")


def test_category_spacing_keeps_a_gap_where_possible():
    order = space_categories(["a", "a", "a", "b", "b", "c"], min_gap=2)
    cats = [["a", "a", "a", "b", "b", "c"][i] for i in order]
    assert sorted(order) == list(range(6))
    assert all(cats[i] != cats[i + 1] for i in range(4))  # only the tail may repeat
    assert space_categories(["a", "a"], min_gap=3) == [0, 1]  # impossible: rank order


def test_merge_respects_quotas_dedupes_and_fills_the_budget():
    results = {"vector": [f"v{i}" for i in range(10)], "hot": ["v0", "h1", "h2"], "new": []}
    merged = merge_channels(results, {"vector": 3, "hot": 2, "new": 2}, budget=6)
    items = [i for i, _ in merged]
    assert items[:3] == ["v0", "v1", "v2"]
    assert dict(merged)["v0"] == ("vector", "hot")
    assert "h1" in items and "h2" in items
    assert len(items) == len(set(items)) == 6
    assert merge_channels(results, {}, budget=4, exclude=frozenset({"v0"}))[0][0] == "v1"


def test_quotas_past_the_budget_are_its_shares_and_every_channel_keeps_one():
    """With the default quotas (650) and a budget of 200, the first channel's 250 took the whole
    budget and no other channel reached ranking; scaled, each keeps its share."""
    from inference.serving.channels import DEFAULT_CHANNELS
    from inference.serving.merge import fitted_quotas

    quotas = {c: cfg.quota for c, cfg in DEFAULT_CHANNELS.items()}
    results = {c: [f"{c}{i}" for i in range(300)] for c in quotas}
    for budget in (200, 500, 37):
        merged = merge_channels(results, quotas, budget)
        by_channel = Counter(channels[0] for _, channels in merged)
        fitted = fitted_quotas(quotas, budget, results)
        assert sum(fitted.values()) == len(merged) == budget
        assert dict(by_channel) == {c: q for c, q in fitted.items() if q}
        for c, q in quotas.items():  # within one of its exact share
            assert abs(fitted[c] - q * budget / sum(quotas.values())) < 1
    assert fitted_quotas(quotas, 10_000, results) == quotas  # room for all: unchanged
    ran = {"vector": range(9), "new": range(1)}  # hot did not run; new found one
    assert fitted_quotas({"vector": 5, "hot": 5, "new": 5}, 4, ran) == {"vector": 3, "new": 1}


# ------------------------------------------------------------------ degradation ladder
def test_ladder_full_when_everything_fits():
    from inference.serving.degrade import Ladder, Situation

    assert Ladder().choose(Situation("pc", budget_ms=500)).tier == "full"


def test_ladder_falls_to_cached_then_light_then_hot():
    from inference.serving.degrade import Ladder, LadderConfig, Situation

    ladder = Ladder(LadderConfig(queue_depth_limit=10, full_cost_ms=40, light_cost_ms=10))
    deep = dict(device="pc", budget_ms=500, queue_depth=11)
    assert ladder.choose(Situation(**deep, cached=True)).tier == "cached"
    assert ladder.choose(Situation(**deep)).tier == "light"
    assert ladder.choose(Situation(**deep, light_ok=False)).tier == "hot"
    tight = ladder.choose(Situation("pc", budget_ms=30))  # < 40 ms × 1.5 safety
    assert tight.tier == "light" and "budget" in tight.reason
    assert ladder.choose(Situation("pc", budget_ms=5)).tier == "hot"
    # a measured cost replaces the assumed one
    assert ladder.choose(Situation("pc", budget_ms=30, full_cost_ms=10)).tier == "full"
    broken = ladder.choose(Situation("pc", budget_ms=500, full_ok=False))
    assert broken.tier == "light" and "unavailable" in broken.reason
    assert ladder.choose(Situation("low_end", budget_ms=500)).tier == "light"
    assert ladder.choose(Situation("low_end", budget_ms=500, cached=True)).tier == "light"


# ------------------------------------------------------------------------- result cache
def test_result_cache_ttl_version_and_capacity():
    from inference.serving.resultcache import ResultCache

    c = ResultCache(capacity=2, ttl_ms=100)
    c.put("a", 1, ["x"], now_ms=0)
    assert c.get("a", 1, 99) == ["x"] and c.peek_valid("a", 1, 99)
    assert c.get("a", 1, 100) is None  # expired, and forgotten
    c.put("a", 1, ["x"], 0)
    assert c.get("a", 2, 1) is None and len(c) == 0  # the user's embedding moved
    c.put("a", 1, ["x"], 0)
    c.put("b", 1, ["y"], 0)
    c.get("a", 1, 1)  # a is now the most recent
    c.put("c", 1, ["z"], 0)
    assert c.get("b", 1, 1) is None and c.get("a", 1, 1) == ["x"]
    with pytest.raises(ValueError):
        ResultCache(capacity=0)


# ----------------------------------------------------------------------------- features
def test_recent_category_share_and_encoding():
    from inference.models.features import DENSE, FeatureEncoder, recent_category_share

    shares = recent_category_share([3, 3, 5, 3], np.array([3, 5, 9]))
    np.testing.assert_allclose(shares, [0.75, 0.25, 0.0])
    assert recent_category_share([], np.array([1, 2])).tolist() == [0.0, 0.0]
    enc = FeatureEncoder()
    ctx = enc.context(["high_end", "bogus"], ["north", ""], [3_600_000 * 5, 0])
    assert ctx[0, 0] == 0 and ctx[1, 0] == 3 and ctx[0, 1] == 5 and ctx[1, 1] == 24
    assert ctx[1, 2] == 0 and 0 < ctx[0, 2] < 16
    u = np.ones((2, 5), np.float32)
    v = np.full((2, 5), 0.5, np.float32)
    x = enc.encode(
        u, v, np.array([[10.0, 0.1, 0.2, 3.0]] * 2, np.float32), np.array([4, 7]), ctx, shares[:2]
    )
    assert x.dense.shape == (2, len(DENSE)) and x.dense[0, 0] == pytest.approx(2.5)
    assert x.dense[0, 5] == pytest.approx(0.75) and x.sparse.shape == (2, 4)
    assert (x.cross >= 0).all() and len(set(x.cross[0])) == 3


# ----------------------------------------------------------------------- models, files
def test_models_score_a_batch_in_one_pass_and_round_trip_through_files(tmp_path):
    import torch

    from inference.models.features import FeatureEncoder
    from inference.models.modelfile import (
        ModelFileError,
        ModelWatcher,
        load_model,
        read_manifest,
        save_model,
        write_manifest,
    )
    from inference.models.ranking import LightRanker, WideDeep, score

    rng = np.random.default_rng(0)
    enc = FeatureEncoder()
    n = 50
    x = enc.encode(
        rng.standard_normal((n, 9)).astype(np.float32),
        rng.standard_normal((n, 9)).astype(np.float32),
        rng.random((n, 4)).astype(np.float32),
        rng.integers(0, 128, n),
        enc.context(["pc"] * n, ["north"] * n, [0] * n),
    )
    cpu = torch.device("cpu")
    full, light = WideDeep(8), LightRanker(8)
    batched = score(full, x, cpu)
    assert batched.shape == (n,) and ((batched > 0) & (batched < 1)).all()
    one = score(full, type(x)(x.user[:1], x.item[:1], x.dense[:1], x.sparse[:1], x.cross[:1]), cpu)
    assert one[0] == pytest.approx(batched[0], rel=1e-5)
    files = {
        "wide_deep": save_model(tmp_path, full, "v1", 8),
        "light": save_model(tmp_path, light, "v1", 8),
    }
    write_manifest(tmp_path, {"version": "v1", "dim": 8, "files": files})
    loaded = load_model(tmp_path, read_manifest(tmp_path), "wide_deep", cpu)
    np.testing.assert_allclose(score(loaded, x, cpu), batched, rtol=1e-6)
    watcher = ModelWatcher(tmp_path, cpu, dim=8)
    assert watcher.load_now().version == "v1"
    assert ModelWatcher(tmp_path, cpu, dim=16).load_now() is None  # wrong dimension: refused
    path = tmp_path / files["light"]["file"]
    path.write_bytes(path.read_bytes()[:-1] + b"\0")
    with pytest.raises(ModelFileError, match="checksum"):
        load_model(tmp_path, read_manifest(tmp_path), "light", cpu)
    with pytest.raises(ModelFileError, match="freshrec train"):
        read_manifest(tmp_path / "nowhere")


def test_a_worker_serves_models_trained_before_the_sequel_feature_and_says_so(tmp_path, caplog):
    """An older release's model directory (its files name no features; its manifest's
    training configuration lists the eight before ``sequel``): the worker loads it, scores
    with the models' own eight columns, and logs that ``freshrec train`` would add the new
    one; a directory that says nothing of its features is refused with the reason."""
    import json
    import logging

    import torch

    from inference.models.features import DENSE, FeatureEncoder
    from inference.models.modelfile import ModelWatcher, save_tensors, write_manifest
    from inference.models.ranking import LightRanker, WideDeep, score

    older = DENSE[: DENSE.index("sequel")]
    cpu = torch.device("cpu")
    models = {"wide_deep": WideDeep(8, features=older), "light": LightRanker(8, features=older)}
    files = {
        kind: save_tensors(tmp_path, f"{kind}-v0.safetensors", m.state_dict(), {"kind": kind})
        for kind, m in models.items()
    }
    config = {"features": ",".join(older)}
    write_manifest(
        tmp_path, {"version": "v0", "dim": 8, "files": files, "training": {"config": config}}
    )
    with caplog.at_level(logging.WARNING, "freshrec.models"):
        loaded = ModelWatcher(tmp_path, cpu, dim=8).load_now()
    assert loaded is not None and loaded.full.features == older
    assert "trained without the ranking features sequel" in caplog.text
    enc, n = FeatureEncoder(), 6
    rng = np.random.default_rng(1)
    x = enc.encode(
        rng.standard_normal((n, 9)).astype(np.float32),
        rng.standard_normal((n, 9)).astype(np.float32),
        rng.random((n, 4)).astype(np.float32),
        rng.integers(0, 128, n),
        enc.context(["pc"] * n, ["north"] * n, [0] * n),
        sequel=np.ones(n, np.float32),
    )
    assert score(loaded.full, x, cpu).shape == (n,)
    (tmp_path / "manifest.json").write_text(json.dumps({"version": "v0", "dim": 8, "files": files}))
    watcher = ModelWatcher(tmp_path, cpu, dim=8)
    assert watcher.load_now() is None
    assert "does not say which ranking features it was trained with" in watcher.last_error


# --------------------------------------------------------------------------- training
def test_auc_matches_the_pairwise_definition():
    from inference.training.train import auc

    rng = np.random.default_rng(3)
    y = rng.random(200) < 0.3
    s = np.round(rng.random(200), 1)  # ties
    pos, neg = s[y], s[~y]
    pairwise = (
        (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    ) / (len(pos) * len(neg))
    assert auc(y, s) == pytest.approx(pairwise)


def test_recent_features_in_training_only_see_earlier_slates():
    from inference.training.logfeatures import recent_context
    from inference.training.train import TrainingLog

    # one user, two slates: clicks in slate 1 (t=1) inform slate 2 (t=2), not slate 1 itself
    logs = TrainingLog(
        user_ids=np.array(["u0"], object),
        item_ids=np.array(["i0", "i1"], object),
        item_category=np.array(["a", "b"], object),
        item_price=np.zeros(2),
        users=np.array([0, 0, 0, 0]),
        items=np.array([0, 1, 0, 1]),
        t_ms=np.array([1, 1, 2, 2]),
        clicked=np.array([True, False, False, False]),
        converted=np.zeros(4, bool),
        device=np.full(4, -1),
        region=np.full(4, None, object),
    )
    cats = np.array([7, 8])
    shares, recent = recent_context(logs, cats)
    assert shares.tolist() == [0.0, 0.0, 1.0, 0.0]
    # the click on i0 at t=1 is the recent item of both rows of slate 2, and of no row before
    assert recent[:, 0].tolist() == [-1, -1, 0, 0] and (recent[:, 1:] == -1).all()


def test_recent_similarity_in_training_matches_serving():
    from inference.models.features import recent_similarity
    from inference.training.logfeatures import recent_similarities

    rng = np.random.default_rng(4)
    rows = rng.standard_normal((6, 5)).astype(np.float32)
    recent = np.array([[3, 1, -1], [-1, -1, -1]])
    got = recent_similarities(recent, np.array([2, 4]), rows, dim=4)
    want = recent_similarity(rows[[3, 1]], rows[[2]], 4)[0]
    assert got[0] == pytest.approx(float(want), rel=1e-5) and got[1] == 0.0


def _random_log(seed: int, n_users: int, n_items: int, n: int, minutes: int):
    """A log of ``n`` random interactions in slates (several rows share a minute), 60%
    clicked and a fifth of them sampled (shown, not asked for)."""
    from inference.training.logfeatures import TrainingLog

    rng = np.random.default_rng(seed)
    users = rng.integers(0, n_users, n)
    t_ms = np.sort(rng.integers(0, minutes, n)) * 60_000
    return TrainingLog(
        user_ids=np.array([f"u{k}" for k in range(n_users)], object),
        item_ids=np.array([f"i{k}" for k in range(n_items)], object),
        item_category=np.full(n_items, None, object),
        item_price=np.zeros(n_items),
        users=users,
        items=rng.integers(0, n_items, n),
        t_ms=t_ms,
        clicked=rng.random(n) < 0.6,
        converted=np.zeros(n, bool),
        device=np.full(n, -1),
        region=np.full(n, None, object),
        sampled=rng.random(n) < 0.2,
    )


def test_covisit_feature_in_training_is_what_the_live_counts_give_serving():
    """``covisit_scores`` of a log against the live path: the streams app's ``UserWindows``
    and ``CoVisitCounts`` fed the clicks of the slates before each one (undecayed), its
    P(b | a) lists, and the channel's ``recency_weighted`` over the user's last clicks."""
    from freshcore.neighbours import UserWindows, recency_weighted
    from inference.training.logfeatures import covisit_scores, recent_context
    from streams.covisit import CoVisitConfig, CoVisitCounts

    logs = _random_log(seed=8, n_users=12, n_items=9, n=600, minutes=40)
    users, t, n = logs.users, logs.t_ms, len(logs.users)
    _, recent = recent_context(logs, np.zeros(len(logs.item_ids), np.int64))
    got = covisit_scores(logs, recent)

    cfg = CoVisitConfig()
    windows = UserWindows(100, cfg.window, cfg.window_ms, cfg.max_pairs)
    live, clicks = CoVisitCounts(candidates=1000), dict.fromkeys(logs.item_ids.tolist(), 0.0)
    want = np.zeros(n, np.float32)
    for time_ms in np.unique(t).tolist():
        slate = np.flatnonzero(t == time_ms).tolist()
        for j in slate:
            anchors = [logs.item_ids[a] for a in recent[j] if a >= 0]
            lists = {a: live.top(a, cfg.neighbours, clicks[a]) for a in anchors}
            want[j] = recency_weighted(anchors, lists).get(logs.item_ids[logs.items[j]], 0.0)
        for j in slate:
            if logs.clicked[j] and not logs.sampled[j]:
                b = logs.item_ids[logs.items[j]]
                clicks[b] += 1
                earlier = windows.pairs(logs.user_ids[users[j]], b, time_ms)
                live.add(
                    earlier + [b] * len(earlier),
                    [b] * len(earlier) + earlier,
                    [1.0] * (2 * len(earlier)),
                )
    assert (want > 0).sum() > 50  # the log pairs items: the comparison is not of zeros
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_sequel_feature_in_training_is_what_the_live_counts_give_serving():
    """``sequel_scores`` of a log against the live path: the streams app's ``UserSequences``
    and ``CoVisitCounts`` fed the clicks of the slates before each one (undecayed, each rule
    1/d), its published successor lists (the best 50, their shares of the anchor's rules),
    and the channel's ``successor_scores`` over the user's last clicks."""
    from freshcore.sequels import UserSequences, successor_scores
    from inference.training.logfeatures import recent_context, sequel_scores
    from streams.covisit import CoVisitConfig, CoVisitCounts

    logs = _random_log(seed=9, n_users=10, n_items=12, n=700, minutes=60)
    users, t, n = logs.users, logs.t_ms, len(logs.users)
    _, recent = recent_context(logs, np.zeros(len(logs.item_ids), np.int64))
    got = sequel_scores(logs, recent)

    cfg = CoVisitConfig()
    sequences, live = UserSequences(100, cfg.sequel_steps), CoVisitCounts(candidates=1000)
    want = np.zeros(n, np.float32)
    for time_ms in np.unique(t).tolist():
        slate = np.flatnonzero(t == time_ms).tolist()
        for j in slate:
            mine = [logs.item_ids[a] for a in recent[j] if a >= 0]
            lists = {a: live.top(a, cfg.sequel_successors, live.total(a)) for a in mine}
            want[j] = successor_scores(mine, lists).get(logs.item_ids[logs.items[j]], 0.0)
        for j in slate:
            if logs.clicked[j] and not logs.sampled[j]:
                b = logs.item_ids[logs.items[j]]
                follows = sequences.follows(logs.user_ids[users[j]], b, time_ms)
                live.add([a for a, _ in follows], [b] * len(follows), [1 / d for _, d in follows])
    assert (want > 0).sum() > 50  # the log has rules: the comparison is not of zeros
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_a_ranking_input_carries_the_sequel_channels_scores_beside_covisit():
    """The serving path's dense inputs: each candidate's ``covisit`` and ``sequel`` columns
    are the scores their channels gave it (0 where a channel found it not, and for every
    candidate when the channel missed its deadline)."""
    from inference.models.features import DENSE, FeatureEncoder
    from inference.serving.rankstage import channel_scores

    merged = [
        type("C", (), {"slots": np.array([4, 7, 9])})(),
        type("C", (), {"slots": np.array([2])})(),
    ]
    b = type("B", (), {"merged": merged})()
    sequel = channel_scores([{7: 0.5, 9: 0.25}, {3: 1.0}], b, [0, 1], [3, 1], 4)
    assert sequel.tolist() == [0.0, 0.5, 0.25, 0.0]
    assert channel_scores(None, b, [0, 1], [3, 1], 4).tolist() == [0.0] * 4
    enc = FeatureEncoder()
    x = enc.encode(
        np.ones((4, 5), np.float32),
        np.ones((4, 5), np.float32),
        np.zeros((4, 4), np.float32),
        np.zeros(4, np.int64),
        enc.context(["pc"] * 4, [None] * 4, [0] * 4),
        covisit=np.array([0.1, 0.0, 0.0, 0.0], np.float32),
        sequel=sequel,
    )
    assert x.dense[:, DENSE.index("sequel")].tolist() == sequel.tolist()
    assert x.dense[:, DENSE.index("covisit")].tolist() == pytest.approx([0.1, 0, 0, 0])


# ------------------------------------------------------------------------------ recall
class Fn:
    """A recall channel made of a function (the runner's contract: ``recall`` and ``inline``)."""

    def __init__(self, fn, inline: bool = False) -> None:
        self.recall, self.inline = fn, inline


def test_recall_runner_drops_late_channels_and_opens_their_breaker():
    import threading

    from freshcore import metrics as m
    from inference.serving.channels import parse_delays
    from inference.serving.recall import ChannelConfig, RecallQuery, RecallRunner

    released = threading.Event()
    finished = []

    def fast(queries, n):
        return [["a", "b"][:n] for _ in queries]

    def slow(queries, n):  # returns once the test lets it: long after its 20 ms deadline
        released.wait(10)
        finished.append(True)
        return [["c"] for _ in queries]

    def broken(queries, n):
        raise RuntimeError("boom")

    runner = RecallRunner(
        {"vector": Fn(fast), "i2i": Fn(slow), "hot": Fn(broken)},
        {"vector": ChannelConfig(2, 50), "i2i": ChannelConfig(5, 20), "hot": ChannelConfig(5, 50)},
        BreakerConfig(window=10, min_calls=2, threshold=0.1, cooldown_ms=60_000),
    )
    q = [RecallQuery("u1", np.zeros(3, np.float32), None)]
    first = runner.run(q)
    assert first.per_query == [{"vector": ["a", "b"]}]
    assert first.timed_out == ["i2i"] and first.failed == ["hot"]
    assert not finished  # it returned without waiting for the slow channel
    runner.run(q)
    assert runner.breaker_states() == {"vector": "closed", "i2i": "open", "hot": "open"}
    released.set()
    calls = m.RECALL_CALLS.labels("i2i", "breaker_open")._value.get()
    third = runner.run(q)
    assert sorted(third.skipped) == ["hot", "i2i"]
    assert m.RECALL_CALLS.labels("i2i", "breaker_open")._value.get() == calls + 1  # skipped
    runner.close()
    assert parse_delays("i2i=300, hot=5") == {"i2i": 300.0, "hot": 5.0}
    with pytest.raises(ValueError):
        parse_delays("nope=1")


def test_inline_channels_run_in_the_caller_and_still_meet_their_deadline():
    """Deadlines on a clock the channels move (no sleeping): an inline channel is held to the
    time its own call took."""
    import threading

    from inference.serving.recall import ChannelConfig, RecallQuery, RecallRunner

    seen = {}
    clock = [0.0]
    inline_done = threading.Event()

    def where(name, pause=0.0, after_inline=False):
        def channel(queries, n):
            seen[name] = threading.current_thread().name
            if after_inline:  # a pooled channel that is slow once the inline ones are done
                assert inline_done.wait(10)
            clock[0] += pause
            if name in ("hot", "new"):
                inline_done.set()
            return [[name] for _ in queries]

        return channel

    def runner(channels, configs, **kw):
        inline_done.clear()
        return RecallRunner(channels, configs, clock=lambda: clock[0], **kw)

    r = runner(
        {
            "vector": Fn(where("vector")),
            "hot": Fn(where("hot"), inline=True),
            "new": Fn(where("new", pause=0.05), inline=True),
        },
        {
            "vector": ChannelConfig(2, 500),
            "hot": ChannelConfig(2, 500),
            "new": ChannelConfig(2, 20),
        },
    )
    result = r.run([RecallQuery("u1", np.zeros(3, np.float32), None)])
    me = threading.current_thread().name
    assert seen["hot"] == me and seen["new"] == me and seen["vector"] != me
    assert result.per_query == [{"vector": ["vector"], "hot": ["hot"]}]
    assert result.timed_out == ["new"]  # returned after its 20 ms deadline: dropped, counted
    r.close()
    # an injected delay sends an inline channel to the pool, where its deadline can be enforced
    delayed = runner(
        {"hot": Fn(where("hot"), inline=True)},
        {"hot": ChannelConfig(2, 500)},
        delays_ms={"hot": 1.0},
    )
    assert delayed.inline == set()
    delayed.close()
    # an inline channel that returned in time is kept however long a pooled one then takes:
    # its deadline is measured to when it returned, not to when the runner looked at it
    slow_pool = runner(
        {
            "vector": Fn(where("vector", pause=0.08, after_inline=True)),
            "hot": Fn(where("hot"), inline=True),
        },
        {"vector": ChannelConfig(2, 500), "hot": ChannelConfig(2, 20)},
    )
    result = slow_pool.run([RecallQuery("u1", np.zeros(3, np.float32), None)])
    assert result.timed_out == [] and result.per_query == [{"vector": ["vector"], "hot": ["hot"]}]
    slow_pool.close()
    # each inline channel is held to its own time, not to the time the ones before it took:
    # 60 + 30 ms in a row, the second with an 80 ms deadline, keeps both; 90 ms would not
    for pause, kept in ((0.03, True), (0.09, False)):
        in_a_row = runner(
            {
                "hot": Fn(where("hot", pause=0.06), inline=True),
                "new": Fn(where("new", pause=pause), inline=True),
            },
            {"hot": ChannelConfig(2, 500), "new": ChannelConfig(2, 80)},
        )
        result = in_a_row.run([RecallQuery("u1", np.zeros(3, np.float32), None)])
        assert (result.timed_out == []) is kept
        assert ("new" in result.per_query[0]) is kept and "hot" in result.per_query[0]
        in_a_row.close()


def test_top_k_rows_matches_torch_topk():
    import torch

    from inference.serving.ann import top_k_rows

    rng = np.random.default_rng(3)
    scores = torch.as_tensor(rng.standard_normal((7, 300)).astype(np.float32))
    scores[:, ::5] = float("-inf")
    for k in (1, 25, 240, 300):
        expected = torch.topk(scores, k, dim=1)
        got = top_k_rows(scores, k)
        assert got.shape == (7, k)
        finite = torch.isfinite(expected.values).numpy()
        assert (got[finite] == expected.indices.numpy()[finite]).all()


def test_grouped_wide_deep_equals_the_per_pair_forward():
    import torch

    from inference.models.features import FeatureEncoder
    from inference.models.ranking import WideDeep, score

    torch.manual_seed(0)
    model = WideDeep(16).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    rng = np.random.default_rng(1)
    enc = FeatureEncoder()
    for lens in ([5], [3, 9, 1], [4, 4, 7, 2, 11]):
        b, owner = len(lens), np.repeat(np.arange(len(lens)), lens)
        n = len(owner)
        users = rng.standard_normal((b, 17)).astype(np.float32)
        items = rng.standard_normal((n, 17)).astype(np.float32)
        ctx = enc.context(
            ["pc", "low_end", "high_end", None, "pc"][:b],
            ["north", None, "south", "east", "west"][:b],
            [1_767_225_600_000 + j * 3_600_000 for j in range(b)],
        )
        args = (
            items,
            rng.random((n, 4)).astype(np.float32),
            rng.integers(0, 128, n),
            ctx[owner],
            rng.random(n).astype(np.float32),
        )
        grouped = enc.encode(users, *args, owner=owner)
        per_pair = enc.encode(users[owner], *args)
        cpu = torch.device("cpu")
        np.testing.assert_allclose(
            score(model, grouped, cpu), score(model, per_pair, cpu), rtol=1e-5, atol=1e-6
        )


def test_lru_discard_frees_the_slot_for_reuse():
    from inference.tables.lru import SlotLRU

    lru = SlotLRU(2)
    assert lru.admit("a") == (0, None)
    lru.discard("a")
    assert "a" not in lru and lru.admit("b") == (0, None) and lru.admit("c") == (1, None)


def test_vectorised_slot_merge_selects_like_the_reference():
    from inference.serving.merge import found_by, merge_channels, merge_slot_arrays

    rng = np.random.default_rng(4)
    for _ in range(200):
        results = {
            c: rng.choice(60, size=rng.integers(0, 30), replace=False)
            for c in ("vector", "i2i", "hot", "new")
        }
        quotas = {c: int(rng.integers(0, 15)) for c in results}
        budget = int(rng.integers(1, 50))
        exclude = rng.choice(60, size=5, replace=False)
        ref = merge_channels(
            {c: [str(x) for x in a] for c, a in results.items()},
            quotas,
            budget,
            frozenset(str(x) for x in exclude),
        )
        got = merge_slot_arrays(results, quotas, budget, exclude)
        assert [str(x) for x in got] == [item for item, _ in ref]
        # the same channels per item (their order is not part of the contract)
        assert [set(c) for c in found_by(got, results)] == [set(ch) for _, ch in ref]


def test_ivf_index_finds_most_of_the_exact_top_k_and_scores_with_fresh_rows():
    import torch

    from inference.serving.ann import IVFIndex

    g = torch.Generator().manual_seed(1)
    centres = torch.randn(40, 16, generator=g)
    rows = centres[torch.randint(0, 40, (5000,), generator=g)] + 0.3 * torch.randn(
        5000, 16, generator=g
    )
    eligible = torch.ones(5000, dtype=torch.bool)
    eligible[:10] = False  # e.g. items without a catalogue entry
    index = IVFIndex.build(rows, eligible, cells=64, seed=0)
    queries = torch.randn(20, 16, generator=g)
    found = index.search(queries, rows, k=20, nprobe=16)
    scores = (queries @ rows.T).masked_fill(~eligible, float("-inf"))
    exact = torch.topk(scores, 20, dim=1).indices.numpy()
    recall = np.mean([len(set(f) & set(e)) / 20 for f, e in zip(found, exact, strict=True)])
    assert recall >= 0.9, recall
    assert not any(set(f) & set(range(10)) for f in found)  # never an ineligible slot
    # the index's copy of the rows chooses 2k candidates, the current rows rank them: a row
    # among the candidates that moved after the build is ranked by where it is now
    target = int(found[0][-1])  # 20th of the top 20
    fresh = rows.clone()
    fresh[target] = queries[0] * 100
    assert int(index.search(queries[:1], fresh, k=20, nprobe=16)[0][0]) == target
    # slots added after the build are searched through ``extra``, always with current rows
    grown = torch.cat([rows, queries[:1] * 100])
    hit = index.search(queries[:1], grown, k=1, nprobe=1, extra=torch.tensor([5000]))
    assert int(hit[0][0]) == 5000


def test_ivf_search_of_a_batch_is_the_exact_top_k_of_each_querys_probed_cells():
    """Reference: per query, every item of its ``nprobe`` nearest cells scored one by one;
    the batched search (cells shared between queries scored once) returns the same list,
    and a query's result does not depend on the batch it came in."""
    import torch

    from inference.serving.ann import IVFIndex

    g = torch.Generator().manual_seed(3)
    rows = torch.randn(3000, 8, generator=g) * torch.rand(3000, 1, generator=g)
    eligible = torch.rand(3000, generator=g) > 0.1
    index = IVFIndex.build(rows, eligible, cells=40, seed=0)
    queries = torch.randn(12, 8, generator=g)
    k, nprobe = 15, 5
    got = index.search(queries, rows, k, nprobe)
    cell_of = np.empty(3000, np.int64)
    for c in range(len(index.centroids)):
        cell_of[index.order[index.offsets[c] : index.offsets[c + 1]]] = c
    for j, q in enumerate(queries.numpy()):
        near = np.argsort(-(index.centroids @ q))[:nprobe]
        members = np.flatnonzero(eligible.numpy() & np.isin(cell_of, near))
        want = members[np.argsort(-(rows.numpy()[members] @ q))[:k]]
        assert got[j].tolist() == want.tolist()
        assert index.search(queries[j : j + 1], rows, k, nprobe)[0].tolist() == want.tolist()


def test_ivf_index_has_no_empty_cells_so_every_probe_finds_items():
    """k-means can leave a centroid without rows (inner-product assignment did, for 12-16 of
    32 cells, on rows of uneven norms); a query near such a centroid would probe only empty
    cells and recall nothing."""
    import torch

    from inference.serving.ann import IVFIndex

    g = torch.Generator().manual_seed(0)
    rows = torch.randn(2000, 8, generator=g) * torch.rand(2000, 1, generator=g) ** 3
    index = IVFIndex.build(rows, torch.ones(2000, dtype=torch.bool), cells=32, seed=0)
    assert (np.diff(index.offsets) > 0).all() and len(index.offsets) == len(index.centroids) + 1
    assert sorted(index.order.tolist()) == list(range(2000))  # every row in exactly one cell
    centroids = torch.from_numpy(index.centroids)
    queries = torch.cat([centroids * 10, -centroids * 10])
    found = index.search(queries, rows, k=10, nprobe=1)
    assert all(len(f) == 10 for f in found)


def test_i2i_search_within_categories_equals_a_masked_search_of_the_whole_table():
    """The i2i channel scores only the members of the clicked categories; its picks are
    those of scoring every item and masking the others out (ties aside)."""
    import torch

    from inference.serving.channels import category_members, search_within_categories

    rng = np.random.default_rng(11)
    for _ in range(50):
        n_items, n_cats, n = (
            int(rng.integers(1, 400)),
            int(rng.integers(1, 9)),
            int(rng.integers(0, 60)),
        )
        items = torch.from_numpy(rng.standard_normal((n_items, 5)).astype(np.float32))
        slot_cat = rng.integers(-1, n_cats, n_items)  # -1: unknown category
        in_catalogue = rng.random(n_items) < 0.9
        slots = np.flatnonzero(in_catalogue)
        members = category_members(slot_cat[slots], slots)
        queries = rng.standard_normal((6, 5)).astype(np.float32)
        allowed = [rng.integers(-1, n_cats, int(rng.integers(1, 4))) for _ in range(6)]
        found = search_within_categories(items, queries, allowed, members, n)
        scores_all = (torch.from_numpy(queries) @ items.T).numpy()
        for row in range(6):
            ok = in_catalogue & np.isin(slot_cat, allowed[row][allowed[row] >= 0])
            expect = np.flatnonzero(ok)[np.argsort(-scores_all[row][ok], kind="stable")][:n]
            got = found[row]
            assert len(got) == len(expect)
            assert set(got.tolist()) == set(expect.tolist())
            assert np.all(np.diff(scores_all[row][got]) <= 1e-6)  # best first


def test_bench_ann_measures_exact_and_ivf_search_on_a_small_catalogue():
    import torch

    from freshrec.progress import ProgressLine
    from tools.bench_ann import bench_size, summary

    torch.manual_seed(0)
    r = bench_size(4000, ["auto", "200"], k=50, reps=2, progress=ProgressLine())
    assert set(r["exact"]) == {"batch_1_ms", "batch_8_ms", "batch_32_ms"}
    assert r["ivf"]["auto"]["nprobe"] == 64  # 4% of 126 cells, at least 64
    # probing every cell scans the whole catalogue, so it finds exactly what exact search does
    assert r["ivf"]["200"]["nprobe"] == r["cells"] and r["ivf"]["200"]["rows_scanned"] == 4000
    assert r["ivf"]["200"]["recall_at_k"] == 1.0
    assert 0 < r["ivf"]["auto"]["recall_at_k"] < 1.0
    text = summary({"k": 50, "dim": 64, "sizes": [r]})
    assert "4,000 |" in text and "auto (64)" in text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_the_index_build_thread_lowers_its_own_priority_only():
    import os
    import threading

    from freshcore.lifecycle import lower_thread_priority

    seen = {}

    def build() -> None:
        lower_thread_priority(10)
        seen["build"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = os.getpriority(os.PRIO_PROCESS, 0)
    thread = threading.Thread(target=build)
    thread.start()
    thread.join()
    assert seen["build"] >= 10  # a thread can only lower its own priority
    assert os.getpriority(os.PRIO_PROCESS, 0) == before


def test_a_requests_offset_is_committable_only_once_every_earlier_request_is_done():
    from inference.offsets import RequestOffsets

    r = RequestOffsets()
    assert r.committable() == {}
    for offset in (7, 8, 9):
        r.accepted(0, offset)
    r.accepted(1, 2)
    r.done(0, 9)  # expired at once, say: 7 and 8 are still in flight
    r.done(0, 8)
    assert r.committable() == {0: 7, 1: 2}
    r.done(0, 7)
    r.done(0, 7)  # a second report changes nothing
    r.done(0, 3)  # nor one never accepted
    assert r.committable() == {0: 10, 1: 2}
    r.accepted(0, 10)
    assert r.committable()[0] == 10
    r.forget([1])  # revoked: not this worker's to commit
    r.done(1, 2)
    assert r.committable() == {0: 10}


def test_a_sixth_recall_channel_is_one_class_and_one_line(monkeypatch):
    """The example of docs/serving.md ("Adding a recall channel"): registered in CHANNELS,
    settings know it, the worker's runner builds it and serves from it."""
    from inference.serving import channels as ch
    from inference.serving.recall import ChannelConfig, RecallQuery, RecallRunner
    from inference.settings import WorkerSettings

    class RegionalFreshChannel(ch.RecallChannel):
        """Global hot items that are not on the request region's hot list."""

        name = "regional_fresh"
        default = ChannelConfig(quota=30, deadline_ms=20.0)
        inline = True

        def recall(self, queries, n):
            lists = self.state.lists
            hot = lists.get("global", ch.NONE)
            out = []
            for q in queries:
                seen = lists.get(q.region, ch.NONE) if q.region else ch.NONE
                out.append(hot[~np.isin(hot, seen)][:n])
            return out

    monkeypatch.setitem(ch.CHANNELS, RegionalFreshChannel.name, RegionalFreshChannel)
    settings = WorkerSettings.from_env(
        {"FRESHREC_RECALL_CHANNELS": "hot,regional_fresh", "FRESHREC_WORKER_ID": "w"}
    )
    configs = settings.serving.channels
    assert configs["regional_fresh"] == RegionalFreshChannel.default
    state = ch.ServingState(cache=None, redis=None, keys=None, recent_clicks=lambda u: [])
    state.lists = {"global": np.array([5, 6, 7, 8]), "north": np.array([6, 8])}
    runner = RecallRunner(ch.make_channels(configs, state), configs)
    try:
        (found,) = runner.run([RecallQuery("u1", np.zeros(3, np.float32), "north")]).per_query
    finally:
        runner.close()
    assert found["regional_fresh"].tolist() == [5, 7]
    assert found["hot"].tolist() == [5, 6, 7, 8]


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ([("reply-to", b"x" * 600)], "reply_to_not_allowed"),
        ([("reply-to", b"t.events")], "reply_to_not_allowed"),
        ([("reply-to", b"t.recommend.replies.a/b")], "reply_to_not_allowed"),
        ([("reply-to", b"\xff")], "reply_to_not_allowed"),
        ([("correlation-id", b"")], "invalid_correlation_id"),
        ([("correlation-id", b"\xc3")], "invalid_correlation_id"),
        ([("correlation-id", b"a\nb")], "invalid_correlation_id"),
        ([("correlation-id", b"c" * 201)], "invalid_correlation_id"),
        ([("correlation-id", b"a"), ("correlation-id", b"b")], "duplicate_header"),
    ],
)
def test_a_request_whose_headers_give_no_safe_reply_is_rejected(headers, reason):
    from inference.route import reply_topic_pattern, route
    from schemas.contract import Rejected

    with pytest.raises(Rejected) as info:
        route(headers, reply_topic_pattern("t."), "t.recommend.replies")
    assert info.value.reason == reason


def test_the_reply_topics_a_request_may_name():
    from inference.route import reply_topic_pattern, route

    allowed = reply_topic_pattern("t.")
    ok = [b"t.recommend.replies", b"t.recommend.replies.freshrec-client-1a2b", None, b""]
    for reply_to in ok:
        got = route(
            [("reply-to", reply_to), ("correlation-id", b"c")], allowed, "t.recommend.replies"
        )
        assert got.reply_to.startswith("t.recommend.replies") and got.correlation_id == b"c"
    same_twice = [("correlation-id", b"c"), ("correlation-id", b"c")]
    assert route(same_twice, allowed, "d").correlation_id == b"c"
    custom = reply_topic_pattern("t.", r"t\.answers\.[a-z]+")
    assert route([("reply-to", b"t.answers.x")], custom, "d").reply_to == "t.answers.x"


def test_what_a_channel_read_reaches_ranking_only_if_it_met_its_deadline():
    """A channel returns what it read on the way (``Recalled``); the runner passes it on only
    for channels that answered in time, so a timed-out i2i cannot change the ranker's inputs."""
    import threading

    from inference.serving.recall import ChannelConfig, Recalled, RecallQuery, RecallRunner

    release = threading.Event()

    class Reads:
        inline = False

        def __init__(self, wait: bool) -> None:
            self.wait = wait

        def recall(self, queries, n):
            if self.wait:
                release.wait(10)  # held until the runner has given up on it
            return Recalled([np.arange(2)] * len(queries), {q.user_id: ["i1"] for q in queries})

    q = [RecallQuery("u1", np.zeros(3, np.float32), None)]
    runner = RecallRunner({"fast": Reads(False)}, {"fast": ChannelConfig(5, 5_000.0)})
    try:
        result = runner.run(q)
    finally:
        runner.close()
    assert result.recent == {"u1": ["i1"]} and result.per_query[0]["fast"].tolist() == [0, 1]
    runner = RecallRunner({"slow": Reads(True)}, {"slow": ChannelConfig(5, 1.0)})
    try:
        result = runner.run(q)
    finally:
        release.set()
        runner.close()
    assert result.timed_out == ["slow"] and result.recent == {} and result.per_query == [{}]


def test_the_covisit_channel_sums_its_anchors_neighbours_newest_first():
    """u1 clicked i0 (newest), i1, i2: i5 is a neighbour of i0 (0.5) and of i1 (0.2), so it
    scores 0.5 + 0.9·0.2; i6 only i1's (0.9·0.1); i1 is u1's own click and an item outside
    the catalogue never comes back; u2, with no clicks, gets nothing."""
    from inference.serving.channels import CHANNELS, Recalled
    from tests.serving_harness import serving_state

    state, queries = serving_state()
    channel = CHANNELS["covisit"](state)
    got = channel.recall(queries, 10)
    assert isinstance(got, Recalled)
    slot = state.slot_of
    assert got.slots[0].tolist() == [slot["i5"], slot["i6"]]
    assert got.slots[1].tolist() == []


def test_the_sequel_channel_scores_what_followed_the_users_last_items():
    """u1 clicked i0 (newest), i1, i2: i7 followed i0 (share 0.6) and i1 (0.5), so it scores
    0.6 + 0.5·0.5; i5 0.3 (i0's); i8 0.5·0.5 (i1's) and i9 0.25·0.8 (i2's); i1 is u1's own
    click and an item outside the catalogue never comes back; every successor's score goes
    to ranking; u2, with no clicks, gets nothing."""
    from inference.serving.channels import CHANNELS, Recalled
    from tests.serving_harness import serving_state

    state, queries = serving_state()
    got = CHANNELS["sequel"](state).recall(queries, 3)
    assert isinstance(got, Recalled)
    slot = state.slot_of
    assert got.slots[0].tolist() == [slot["i7"], slot["i5"], slot["i8"]]
    want = {"i7": 0.85, "i5": 0.3, "i8": 0.25, "i9": 0.2}
    assert got.scores[0] == pytest.approx({slot[b]: v for b, v in want.items()})
    assert got.slots[1].tolist() == [] and got.scores[1] == {}


def test_the_neighbour_channels_read_a_batchs_recent_clicks_once():
    """The i2i, co-visitation and sequel channels need the recent clicks of the users the
    worker holds none for: one Redis read a batch serves them all (from their threads), a
    new batch reads again."""
    import concurrent.futures as cf

    from inference.serving.channels import CHANNELS
    from tests.serving_harness import serving_state

    state, queries = serving_state()
    reads = []
    pipeline = state.redis.pipeline

    def counting(transaction=False):
        pipe = pipeline(transaction)
        lrange = pipe.lrange

        def counted(key, start, stop):
            reads.append(key)
            return lrange(key, start, stop)

        pipe.lrange = counted
        return pipe

    state.redis.pipeline = counting
    readers = [CHANNELS[name](state) for name in ("i2i", "covisit", "sequel")]
    with cf.ThreadPoolExecutor(3) as pool:
        first = [pool.submit(c.recall, queries, 10) for c in readers]
        got = [f.result() for f in first]
    assert reads == ["t.user:recent:u2"]  # u1's clicks are the worker's own
    assert got[0].recent == got[1].recent == got[2].recent == {}
    again = list(queries)  # the next batch: read again
    for channel in readers:
        channel.recall(again, 10)
    assert len(reads) == 2


def test_the_serving_budget_runs_from_when_the_request_was_produced():
    from confluent_kafka import TIMESTAMP_CREATE_TIME, TIMESTAMP_NOT_AVAILABLE

    from inference.intake import produced_ms
    from inference.serving.batch import Inbound
    from schemas.records import RecommendRequest

    class Msg:
        def __init__(self, kind, ts):
            self._ts = (kind, ts)

        def timestamp(self):
            return self._ts

    assert produced_ms(Msg(TIMESTAMP_CREATE_TIME, 9_000), now=10_000) == 9_000
    assert produced_ms(Msg(TIMESTAMP_CREATE_TIME, 11_000), now=10_000) == 10_000  # clock ahead
    assert produced_ms(Msg(TIMESTAMP_NOT_AVAILABLE, -1), now=10_000) == 10_000
    far = Inbound(RecommendRequest("r", "u", 5, deadline_ms=60_000), "t", None, 9_000)
    assert far.deadline_ms(250) == 9_250  # the budget, not the client's patience
    near = Inbound(RecommendRequest("r", "u", 5, deadline_ms=9_100), "t", None, 9_000)
    assert near.deadline_ms(250) == 9_100
    none = Inbound(RecommendRequest("r", "u", 5), "t", None, 9_000)
    assert none.deadline_ms(250) == 9_250


class _Consumer:
    """What ``EventFlow`` asks of a consumer: its assignment, pause and resume."""

    def __init__(self, parts):
        self.parts, self.calls = parts, []

    def assignment(self):
        return self.parts

    def pause(self, parts):
        self.calls.append(("pause", [tp.partition for tp in parts]))

    def resume(self, parts):
        self.calls.append(("resume", [tp.partition for tp in parts]))


def test_event_partitions_pause_past_the_backlog_mark_or_to_drop_a_full_queues_prefetch():
    parts = [
        TopicPartition("events", 0),
        TopicPartition("requests", 0),
        TopicPartition("events", 1),
    ]
    consumer = _Consumer(parts)
    flow = EventFlow(consumer, "events", batch_max=100, purge_every_s=1.0)
    count = {r: m.WORKER_EVENT_PAUSES.labels(r) for r in ("backlog", "prefetch")}
    before = {r: c._value.get() for r, c in count.items()}

    def counted():
        return {r: c._value.get() - before[r] for r, c in count.items()}

    flow.adjust(backlog=400, slice_size=100, full=False, now=0.0)  # at the mark: no pause
    assert consumer.calls == []
    flow.adjust(backlog=401, slice_size=100, full=False, now=0.1)  # past it: events only
    assert consumer.calls == [("pause", [0, 1])] and counted() == {"backlog": 1, "prefetch": 0}
    flow.adjust(backlog=150, slice_size=100, full=False, now=0.2)  # not yet worked down
    flow.adjust(backlog=99, slice_size=100, full=False, now=0.3)
    assert consumer.calls[1:] == [("resume", [0, 1])]
    # consumes that drain the client's queue (live traffic the worker keeps up with, whatever
    # its record timestamps say), however many rounds: never paused for the prefetch
    for i in range(20):
        flow.adjust(backlog=10, slice_size=100, full=False, now=1.0 + i)
    assert len(consumer.calls) == 2
    # consumes that come back full (events wait in the client's queue): paused a second
    # after they began, held 20 ms
    flow.adjust(backlog=10, slice_size=100, full=True, now=30.0)
    flow.adjust(backlog=10, slice_size=100, full=True, now=31.0)
    assert consumer.calls[2:] == [("pause", [0, 1])] and counted() == {"backlog": 1, "prefetch": 1}
    flow.adjust(backlog=0, slice_size=100, full=False, now=31.01)  # within the hold
    assert len(consumer.calls) == 3
    flow.adjust(backlog=0, slice_size=100, full=False, now=31.03)
    assert consumer.calls[3:] == [("resume", [0, 1])]
    # the queue the pause emptied fills again: a consume short of full just after the resume
    # does not end the run, and the next pause comes a second after the last
    flow.adjust(backlog=0, slice_size=100, full=False, now=31.1)
    flow.adjust(backlog=0, slice_size=100, full=True, now=32.0)
    assert consumer.calls[4:] == [("pause", [0, 1])] and counted()["prefetch"] == 2
    flow.adjust(backlog=0, slice_size=100, full=False, now=32.1)
    assert consumer.calls[5:] == [("resume", [0, 1])]
    # a rebalance: what was paused is no longer assigned, nothing to resume
    flow.adjust(backlog=500, slice_size=100, full=False, now=40.0)
    flow.forget()
    flow.adjust(backlog=0, slice_size=100, full=False, now=41.0)
    assert consumer.calls[6:] == [("pause", [0, 1])]
