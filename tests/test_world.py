"""The synthetic world: deterministic, plausibly distributed, and small in memory at scale."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np

from freshrec.sim.pacing import Pacer
from freshrec.sim.traffic import EventSynthesizer, catalogue
from freshrec.sim.world import World, WorldConfig, zipf_rank

SMALL = WorldConfig(seed=11, n_users=20_000, n_items=5_000)


def test_same_seed_gives_the_same_world_and_the_same_events():
    a, b = World(SMALL), World(SMALL)
    np.testing.assert_array_equal(a.item_vectors, b.item_vectors)
    users = np.arange(100)
    np.testing.assert_array_equal(a.user_vectors(users, 0), b.user_vectors(users, 0))
    ea = EventSynthesizer(a, seed=5).batch(50, SMALL.start_ms)
    eb = EventSynthesizer(b, seed=5).batch(50, SMALL.start_ms)
    assert ea == eb
    assert list(catalogue(a))[:10] == list(catalogue(b))[:10]


def test_another_seed_gives_another_world():
    other = World(WorldConfig(seed=12, n_users=20_000, n_items=5_000))
    assert not np.allclose(World(SMALL).item_vectors, other.item_vectors)


def test_user_attributes_do_not_depend_on_which_users_are_asked_together():
    w = World(SMALL)
    alone = w.user_vectors(np.array([1234]), 0)
    together = w.user_vectors(np.array([5, 1234, 99]), 0)[1:2]
    np.testing.assert_allclose(alone, together)


def test_zipf_ranks_are_skewed_towards_the_head():
    rng = np.random.default_rng(0)
    ranks = zipf_rank(rng.random(200_000), 10_000, 1.05)
    counts = np.bincount(ranks, minlength=10_000)
    assert ranks.min() >= 0 and ranks.max() < 10_000
    assert counts[0] > 5 * counts[100] > 0
    assert counts[:100].sum() > counts[5000:].sum()


def test_clicks_follow_the_ground_truth_preferences():
    w = World(SMALL)
    t = SMALL.start_ms
    users = w.sample_users(np.random.default_rng(1), 5000)
    own = w.sample_category_items(np.random.default_rng(2), w.user_main_category(users, t))
    rand = np.random.default_rng(3).integers(0, SMALL.n_items, 5000)
    p_own = w.click_probability(users, own, t).mean()
    p_rand = w.click_probability(users, rand, t).mean()
    assert p_own > 2 * p_rand
    assert 0.005 < p_rand < 0.2


def test_synthetic_traffic_has_plausible_ctr_and_conversions():
    w = World(SMALL)
    events = EventSynthesizer(w, seed=9).batch(3000, SMALL.start_ms)
    kinds = {
        k: sum(e.event_type == k for e in events) for k in ("impression", "click", "conversion")
    }
    assert kinds["impression"] == 30_000
    ctr = kinds["click"] / kinds["impression"]
    assert 0.02 < ctr < 0.4
    assert 0 < kinds["conversion"] < kinds["click"]
    assert all(e.region in SMALL.regions and e.device for e in events)


def test_interest_drift_changes_main_categories_of_the_configured_fraction():
    cfg = WorldConfig(seed=11, n_users=20_000, n_items=5_000, drift_at_ms=1000, drift_fraction=0.5)
    w = World(cfg)
    users = np.arange(10_000)
    before, after = w.user_main_category(users, 999), w.user_main_category(users, 1000)
    changed = (before != after).mean()
    assert 0.45 < changed < 0.55
    # drifts() names exactly the users whose main interest moved
    assert np.array_equal(w.drifts(users), before != after)
    assert not World(replace(cfg, drift_at_ms=None)).drifts(users).any()


def test_world_scales_to_a_million_items_and_ten_million_users_in_bounded_memory():
    code = """
import json, resource, numpy as np
from freshrec.sim.world import World, WorldConfig
from freshrec.sim.traffic import EventSynthesizer
w = World(WorldConfig(seed=1, n_users=10_000_000, n_items=1_000_000))
events = EventSynthesizer(w, seed=1).batch(2000, w.config.start_ms)
users = w.sample_users(np.random.default_rng(0), 1_000_000)
try:  # this process's peak (Linux keeps ru_maxrss across exec: it would count the parent's)
    with open("/proc/self/status") as f:
        peak_kb = next(int(x.split()[1]) for x in f if x.startswith("VmHWM:"))
except OSError:
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"rss_mb": peak_kb / 1024,
                  "max_user": int(users.max()), "events": len(events)}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    report = json.loads(out.stdout)
    assert report["events"] >= 20_000
    assert report["max_user"] < 10_000_000
    assert report["rss_mb"] < 1500, report


def test_pacer_keeps_a_steady_rate_and_caps_catch_up():
    p = Pacer(rate_per_s=1000, start_s=0.0, max_backlog_s=0.5)
    assert p.to_send(0.1, 0) == 100
    assert p.to_send(0.1, 100) == 0
    assert p.to_send(10.0, 100) == 501


def test_prepared_events_are_stamped_with_the_time_they_are_sent():
    from freshrec.sim.produce import prepare_events
    from schemas.codec import decode_event

    world = World(WorldConfig(seed=2, n_users=1000, n_items=200))
    records = prepare_events(world, 300, seed=1)
    assert len(records) == 300 and len({k + h for k, h, _ in records}) > 1
    stamp = 1_800_000_000_123
    events = [decode_event(h + str(stamp).encode() + t, stamp) for _, h, t in records]
    assert {e.ts_ms for e in events} == {stamp}
    assert len({e.event_id for e in events}) == 300  # ids intact and distinct
    assert all(k == e.user_id.encode() for (k, _, _), e in zip(records, events, strict=True))
