"""The closed loop's behaviour model and CTR accounting (no broker: what a reply turns into)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from freshcore import clock
from freshcore.settings import ConnectionSettings
from freshrec.sim.closedloop import ClosedLoop, LoopStats
from freshrec.sim.world import World, WorldConfig
from schemas.codec import decode_event
from tools.bench_freshness import arm_env, choose_cohort
from tools.freshness_report import table
from tools.rows_quality import top_k_ctr, true_scores

WORLD = World(WorldConfig(seed=3, n_users=5_000, n_items=1_000))
CONN = ConnectionSettings("127.0.0.1:1", "redis://127.0.0.1:1", "t.")


class Recorder:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, bytes]] = []

    def produce(self, topic, key, value) -> None:
        self.sent.append((topic, key, value))

    def poll(self, timeout) -> int:
        return 0


def reply(request_id: str, items: list[int], tier: str = "full"):
    return SimpleNamespace(
        request_id=request_id,
        items=[SimpleNamespace(item_id=World.item_id(i)) for i in items],
        tier=tier,
    )


def test_a_reply_becomes_impressions_clicks_and_ctr_windows_per_group():
    world = WORLD.with_drift(0, 0.5)  # drifted already: half of the users moved
    users = np.arange(200)
    drifted, steady = int(users[world.drifts(users)][0]), int(users[~world.drifts(users)][0])
    loop = ClosedLoop(CONN, world, 10.0, users=np.array([drifted, steady]), window_s=5.0)
    producer = Recorder()
    items = list(range(10))
    for n, user in enumerate([drifted, steady, steady]):
        loop._behave(producer, user, World.user_id(user), "north", "pc", reply(f"r{n}", items))
    events = [decode_event(v, clock.now_ms()) for _, _, v in producer.sent]
    impressions = [e for e in events if e.event_type == "impression"]
    clicks = [e for e in events if e.event_type == "click"]
    assert len(impressions) == 30 and [e.position for e in impressions[:10]] == items
    assert all(t == "t.events" for t, _, _ in producer.sent)
    assert loop.stats.impressions == 30 and loop.stats.clicks == len(clicks)
    cells = loop.stats.windows.cells
    assert set(cells) == {(0, "drifted"), (0, "steady")}
    assert cells[(0, "drifted")][0] == 10 and cells[(0, "steady")][0] == 20
    assert sum(c for _, c in cells.values()) == len(clicks)
    assert loop.stats.by_tier == {"full": [30, len(clicks)]}


def test_ctr_is_kept_per_serving_tier():
    loop = ClosedLoop(CONN, WORLD, 10.0)
    loop._behave(Recorder(), 7, "u7", "north", "pc", reply("a", [1, 2, 3, 4], tier="full"))
    loop._behave(Recorder(), 8, "u8", "north", "low_end", reply("b", [5, 6], tier="light"))
    assert {t: i for t, (i, _) in loop.stats.by_tier.items()} == {"full": 4, "light": 2}
    loop.stats.by_tier = {"full": [10, 3], "light": [4, 1], "hot": [0, 0]}
    assert loop.stats.tier_ctr() == {"full": 0.3, "light": 0.25}
    assert "CTR by tier: full 30.0%, light 25.0%" in loop.stats.final()
    loop.stats.modes.update(["promo", "promo", "daily"])
    assert "modes: promo 2, daily 1; tiers:" in loop.stats.final()


def test_no_drift_puts_every_user_in_the_steady_group():
    loop = ClosedLoop(CONN, WORLD, 10.0)
    loop._behave(Recorder(), 7, "u7", "north", "pc", reply("r", [1, 2, 3]))
    assert set(loop.stats.windows.cells) == {(0, "steady")}


def test_bad_cohorts_and_fractions_are_refused():
    with pytest.raises(ValueError, match="at least one user"):
        ClosedLoop(CONN, WORLD, 10.0, users=np.array([], np.int64))
    with pytest.raises(ValueError, match="drift_fraction"):
        ClosedLoop(CONN, WORLD, 10.0, drift_fraction=1.5)


def test_the_cohort_is_distinct_active_users_and_the_table_has_a_row_per_window():
    cohort = choose_cohort(WORLD, 50, seed=1)
    assert len(cohort) == 50 == len(set(cohort.tolist()))
    assert np.array_equal(cohort, choose_cohort(WORLD, 50, seed=1))
    curve = [{"from_s": 0.0, "ctr": 0.1}, {"from_s": 10.0, "ctr": 0.2}]
    text = table({"online": {"curve": curve}, "frozen": {"curve": curve[:1]}}, 10.0)
    assert text.splitlines()[0] == "| window (s) | online | frozen |"
    assert text.splitlines()[2] == "| 0–10 | 10.0% | 10.0% |"
    assert text.splitlines()[3] == "| 10–20 | 20.0% |  |"


def test_arms_are_named_or_a_learning_rate():
    frozen = arm_env("frozen")
    assert set(frozen.values()) == {"0"} and len(frozen) == 4  # users' and items', both sides
    assert arm_env("online") == {}
    assert arm_env("global=0.1") == {"FRESHREC_GLOBAL_LR": "0.1"}
    for bad in ("fast", "lr=-1", "lr=nan", "lr=x", "local=", "local=0.1+speed=2"):
        with pytest.raises(ValueError):
            arm_env(bad)


def test_through_a_drift_online_learning_costs_no_ctr_against_the_frozen_arm(tmp_path):
    """The benchmark's whole path, small and seeded: trains models on the cohort's logs,
    runs a learning and a frozen arm on private stacks (real broker and Redis) through an
    interest drift, and writes its figures. After the drift, the drifted users' CTR with online
    learning is not below the frozen arm's by more than two standard errors of the gap. The
    gap measured here: 3.1 and 2.9 points at 24 s after the drift (2026-12-01, ~2,900
    impressions an arm, a standard error of ~0.9 points), 0.8 and 0.9 in two runs of
    2026-12-02; at 48 s (a standard error of ~0.6 points) 0.89 in a fresh-clone run of
    2026-12-03 (6601d5a, 7.21% against 6.32%) and −0.27 in another (b6a3093, 7.03% against
    7.30%). The frozen arm is not blind to the drift (co-visitation and hot lists learn from
    the stream in both arms), so at this size the sign of the gap is not settled by one run
    and asserting it failed CI on correct code; online learning's gain over frozen is shown
    with intervals by the replays (docs/benchmarks.md) and the full-size bench_freshness runs."""
    env = {k: v for k, v in os.environ.items() if k not in ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL")}
    drift_s = 12.0
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.bench_freshness",
            "--arms",
            "online,frozen",
            "--cohort",
            "40",
            "--rate",
            "20",
            "--before",
            str(drift_s),
            "--after",
            "48",
            "--window",
            "6",
            "--items",
            "2000",
            "--users",
            "10000",
            "--train-impressions",
            "40000",
            "--seed",
            "5",
            "--models",
            str(tmp_path / "models"),
            "--out",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "bench_freshness.json").read_text())
    online, frozen = result["arms"]["online"], result["arms"]["frozen"]
    assert online["replied"] > 400 and online["timeouts"] < 20
    assert [c["from_s"] for c in online["curve"]] == [6.0 * w for w in range(10)]
    assert set(online["ctr_by_tier"]) <= {"full", "light", "cached", "hot"}
    assert online["groups"]["drifted"]["curve"] and online["groups"]["steady"]["curve"]
    assert (tmp_path / "bench_freshness-logs" / "online" / "worker.log").exists()
    assert (tmp_path / "bench_freshness_drift.png").exists()
    assert (tmp_path / "models" / "manifest.json").exists()
    rows = online["rows"]  # what the rows alone know, at the start and at the end
    for when in ("start", "end"):
        assert 0 < rows[when]["rows_top10_ctr"] <= rows[when]["ideal_top10_ctr"] < 1
    assert rows["end"]["shown_items"] >= 10
    assert 0 < rows["end"]["rows_top10_shown_ctr"] <= rows["end"]["ideal_top10_shown_ctr"] < 1
    assert set(result["recovery"]) == {"online", "frozen"}

    def after(arm: dict) -> tuple[float, int]:
        cells = [c for c in arm["groups"]["drifted"]["curve"] if c["from_s"] >= drift_s]
        n = sum(c["impressions"] for c in cells)
        return sum(c["clicks"] for c in cells) / n, n

    (p_on, n_on), (p_off, n_off) = after(online), after(frozen)
    se = math.sqrt(p_on * (1 - p_on) / n_on + p_off * (1 - p_off) / n_off)
    assert n_on > 1000 and n_off > 1000, (n_on, n_off)
    assert p_on > p_off - 2 * se, (p_on, p_off, se)  # online learning does not cost CTR


def test_top_k_ctr_of_the_true_scores_is_the_best_any_scores_reach():
    users = np.array([3, 17, 256, 4000])
    t_ms = WORLD.config.start_ms
    truth = true_scores(WORLD, users, t_ms, chunk=3)  # chunks of 3 and 1
    assert truth.shape == (4, 1_000)
    direct = WORLD.click_probability(np.repeat(users, 1_000), np.tile(np.arange(1_000), 4), t_ms)
    assert np.allclose(truth.ravel(), direct, atol=1e-6)
    best = top_k_ctr(WORLD, users, truth, t_ms, k=10)
    assert best == pytest.approx(np.sort(truth, axis=1)[:, -10:].mean(), abs=1e-6)
    noise = np.random.default_rng(0).random((4, 1_000))
    assert top_k_ctr(WORLD, users, noise, t_ms, k=10) < best
    assert top_k_ctr(WORLD, users, -truth, t_ms, k=10) < top_k_ctr(WORLD, users, noise, t_ms, k=10)


def test_intra_list_diversity_and_repeat_share_are_the_shares_they_say():
    """Diversity: the share of a list's item pairs from different categories (mean over
    lists); repeat: the share of a list's items its user's previous list held."""
    st = LoopStats()
    st.diverse(np.array([1, 1, 2, 3]))  # 12 ordered pairs, 2 of them alike
    st.diverse(np.array([4, 4]))  # all alike
    st.diverse(np.array([5]))  # one item: no pairs, not counted
    assert st.intra_list_diversity == (10 / 12 + 0.0) / 2
    st.consecutive(7, [1, 2, 3, 4])
    st.consecutive(7, [3, 4, 5, 6])
    st.consecutive(8, [1, 2])
    assert st.repeat_share == 2 / 4
