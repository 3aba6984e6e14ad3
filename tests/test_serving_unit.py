"""Pure serving policies: batching decision, circuit breaker, MMR and category spacing,
channel merging with quotas. (The serving loop that uses them is the serving issue's.)"""

from __future__ import annotations

import numpy as np
import pytest

from inference.batching import BatchPolicy, Decision, split_expired
from inference.breaker import CLOSED, HALF_OPEN, OPEN, BreakerConfig, CircuitBreaker
from inference.merge import merge_channels
from inference.rerank import mmr, space_categories


def test_batching_flushes_on_size_or_on_the_oldest_requests_wait():
    p = BatchPolicy(max_batch=3, max_wait_ms=10)
    assert p.decide(0, None, 0) == Decision(False, 10)
    assert p.decide(1, 0, 4) == Decision(False, 6)
    assert p.decide(1, 0, 10).flush
    assert p.decide(3, 0, 0).flush
    assert BatchPolicy(max_batch=1, max_wait_ms=50).decide(1, 0, 0).flush
    with pytest.raises(ValueError):
        BatchPolicy(max_batch=0)


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
