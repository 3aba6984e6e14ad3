"""A/B experiments without a server: assignment, allocation when shares change, the file's
errors, the user-level intervals and the verdicts, and what a variant changes in serving one request."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import replace

import pytest

from freshcore.abstats import compare, ratio
from freshrec.app.abreport import render, variant_rows
from inference.serving.arms import Arm, quotas, request, steer
from inference.serving.degrade import Choice
from inference.serving.experiments import (
    BUCKETS,
    EXAMPLE,
    ExperimentError,
    allocate,
    parse,
    target_counts,
)
from schemas.records import RecommendRequest


def test_assignment_is_deterministic_and_matches_the_shares_on_100k_ids():
    exp = parse(EXAMPLE)
    table = allocate(None, [], exp)
    users = [f"u{i}" for i in range(100_000)]
    got = Counter(exp.variant_of(table, u) for u in users)
    for v in exp.variants:
        # binomial SE at 100k ids is ~0.0016 for a quarter: 0.01 is six of them
        assert abs(got[v.name] / len(users) - v.share) < 0.01, got
    again = allocate(None, [], parse(EXAMPLE))  # another process, another start
    assert all(exp.variant_of(again, u) == exp.variant_of(table, u) for u in users[:5000])
    other = allocate(None, [], replace(exp, salt="another"))
    moved = sum(
        exp.variant_of(table, u) != replace(exp, salt="another").variant_of(other, u)
        for u in users[:5000]
    )
    assert moved > 1000  # another salt reshuffles users


def test_a_share_change_moves_only_the_buckets_the_new_shares_require():
    rng = random.Random(4)
    exp = parse(EXAMPLE)
    table, names = allocate(None, [], exp), [v.name for v in exp.variants]
    for _ in range(200):
        cuts = sorted(rng.randint(0, BUCKETS) for _ in range(2))
        shares = [cuts[0] / BUCKETS, (cuts[1] - cuts[0]) / BUCKETS, 1 - cuts[1] / BUCKETS]
        variants = [replace(v, share=s) for v, s in zip(exp.variants, shares, strict=True)]
        if rng.random() < 0.3:
            variants.reverse()  # the file's order changes: the table follows names
        new_exp = replace(exp, variants=tuple(variants))
        new = allocate(table, names, new_exp)
        new_names = [v.name for v in variants]
        before = Counter(names[i] for i in table)
        after = Counter(new_names[i] for i in new)
        assert [after[n] for n in new_names] == target_counts([v.share for v in variants])
        moved = sum(names[a] != new_names[b] for a, b in zip(table, new, strict=True))
        assert moved == sum(max(0, before[n] - after[n]) for n in names)
        table, names = new, new_names


def test_a_removed_variant_gives_its_users_to_the_others_and_an_added_one_takes_from_them():
    exp = parse(EXAMPLE)
    table, names = allocate(None, [], exp), [v.name for v in exp.variants]
    two = replace(
        exp, variants=(replace(exp.variants[0], share=0.75), replace(exp.variants[1], share=0.25))
    )
    after = allocate(table, names, two)
    kept = sum(names[a] == "control" and b == 0 for a, b in zip(table, after, strict=True))
    assert kept == 500  # control kept all it had and took the removed variant's users
    assert Counter(after) == {0: 750, 1: 250}


@pytest.mark.parametrize(
    "text,where,why",
    [
        ("[experiment]\nname = 'x'\n[[variant]]\nname = 'a'\nshare = 0.5\n", ":5:", "two"),
        (EXAMPLE.replace("share = 0.25\nranking", "share = 0.3\nranking"), ":15:", "sum to 1.05"),
        (EXAMPLE.replace('ranking = "light"', 'ranking = "fast"'), ":11:", "ranking must be"),
        (EXAMPLE.replace("mmr_lambda = 0.4", "mmr_lambda = 4"), ":16:", "mmr_lambda"),
        (EXAMPLE.replace("{ hot = 50 }", "{ hott = 50 }"), ":18:", "unknown recall channel"),
        (EXAMPLE.replace('name = "light"', 'name = "control"'), ":9:", "declared twice"),
        (EXAMPLE.replace("exclude_seen = true", "exclude_seen = 1"), ":17:", "true or false"),
        (EXAMPLE.replace("share = 0.5", "share = 0.5\ncolour = 'red'"), ":7:", "unknown key"),
        (EXAMPLE.replace('name = "ranking-2026-12"', 'name = "a b"'), ":2:", "experiment name"),
        (EXAMPLE + "\n[nonsense]\n", ":", "unknown table"),
        ("[experiment\n", ":", "line 1"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_line(text, where, why):
    with pytest.raises(ExperimentError) as err:
        parse(text, "exp.toml")
    message = str(err.value)
    assert message.startswith("exp.toml") and where in message and why in message, message
    assert "\n" not in message


def test_the_user_level_interval_against_hand_computed_values():
    # four buckets of 100 impressions, 10, 12, 9, 11 clicks: R = 0.105, residuals
    # -0.5, 1.5, -1.5, 0.5, Σ² = 5, se = √(4/3 · 5) / 400
    r = ratio([10, 12, 9, 11], [100, 100, 100, 100])
    assert r.value == pytest.approx(0.105) and r.se == pytest.approx(math.sqrt(20 / 3) / 400)
    lo, hi = r.interval()
    assert lo == pytest.approx(0.105 - 1.959964 * r.se) and hi == pytest.approx(
        0.105 + 1.959964 * r.se
    )
    # unequal buckets: residuals x_b - R n_b with R = 12/60
    r = ratio([2, 10], [20, 40])
    assert r.se == pytest.approx(math.sqrt(2 * ((2 - 4) ** 2 + (10 - 8) ** 2)) / 60)
    assert math.isnan(ratio([0, 0], [0, 0]).value) and math.isnan(ratio([5], [3]).value)
    assert ratio([1, 0, 2], [5, 0, 5]).buckets == 2


def _simulate(rng, users, ctr_of, buckets=64, per_user=(5, 40)):
    """Per-bucket (clicks, impressions) of ``users`` whose CTRs vary (``ctr_of``): each user
    makes a random number of impressions, all at that user's rate."""
    clicks, imps = [0] * buckets, [0] * buckets
    for _ in range(users):
        n = rng.randint(*per_user)
        p = ctr_of(rng)
        b = rng.randrange(buckets)
        imps[b] += n
        clicks[b] += sum(rng.random() < p for _ in range(n))
    return clicks, imps


def test_users_whose_rates_differ_widen_the_interval_as_resampling_users_does():
    """Impressions of one user are not independent: with users' CTRs spread widely, the
    bucket interval is wider than the impression-level one and matches a bootstrap over
    users, and the verdict's interval covers the true difference of 0 as often as it says."""
    rng = random.Random(7)

    def ctr_of(r):
        return r.choice([0.02, 0.1, 0.5])

    covered = 0
    for _ in range(40):
        c = ratio(*_simulate(rng, 600, ctr_of))
        v = ratio(*_simulate(rng, 600, ctr_of))
        g = compare(v, c, cost=None, control_cost=None)
        covered += g.diff_ci[0] <= 0 <= g.diff_ci[1]
    assert covered >= 34  # 95% intervals: 38 of 40 expected; 34 is 2.4 sd below
    # the naive binomial se of the same counts is far smaller than the cluster se
    clicks, imps = _simulate(rng, 600, ctr_of)
    r = ratio(clicks, imps)
    naive = math.sqrt(r.value * (1 - r.value) / sum(imps))
    assert r.se > 1.5 * naive


@pytest.mark.parametrize(
    ("variant_clicks", "cost", "verdict"),
    [
        (13, 1.0, "better"),
        (10, 0.5, "not worse and cheaper"),
        (10, 0.98, "not worse, not cheaper"),  # a 2% saving is not one
        (7, 0.5, "worse"),
        (7, 1.0, "worse"),
    ],
)
def test_the_verdict(variant_clicks, cost, verdict):
    control = ratio([10 + b % 3 for b in range(64)], [100] * 64)
    variant = ratio([variant_clicks + b % 3 for b in range(64)], [100] * 64)
    assert compare(variant, control, cost=cost, control_cost=1.0).verdict == verdict


def test_a_small_or_noisy_variant_gets_no_verdict():
    control = ratio([10 + b % 3 for b in range(64)], [100] * 64)
    few = ratio([11] * 10 + [0] * 54, [100] * 10 + [0] * 54)
    assert compare(few, control, cost=0.1, control_cost=1.0).verdict == "not enough data"
    rng = random.Random(3)
    noisy = ratio([rng.choice([0, 25]) for _ in range(64)], [100] * 64)
    g = compare(noisy, control, cost=1.0, control_cost=1.0)
    assert g.verdict == "not enough data" and g.relative_ci[0] < -0.03 < 0 < g.relative_ci[1]


def test_the_report_puts_each_variant_beside_the_control():
    meta = {"variants": '["a", "b"]', "shares": "[0.5, 0.5]", "control": "a"}
    counts = {"a:cost_us": 400_000, "b:cost_us": 100_000}
    for v, clicks in (("a", 10), ("b", 10)):
        for kind, n in (("requests", 10), ("impression", 100), ("click", clicks)):
            counts[f"{v}:{kind}"] = 64 * n
            for b in range(64):
                counts[f"{v}:{kind}:{b}"] = (
                    n + (b % 3 if kind == "click" else 0) - (kind == "click")
                )
    counts["a:conversion"] = 64
    rep = variant_rows(meta, counts)
    a, b = rep["variants"]
    assert a["ctr"] == 0.1 and a["cvr"] == 0.1 and "vs_control" not in a
    assert a["serving_s_per_1k"] == pytest.approx(400_000 / 640 / 1000)
    assert b["vs_control"]["ctr_diff"] == pytest.approx(0.0)
    assert b["vs_control"]["non_inferior"] is True and b["vs_control"]["cheaper"] is True
    assert b["vs_control"]["verdict"] == "not worse and cheaper"
    text = render({"exp": rep})
    assert "10.00% [" in text and "not worse and cheaper" in text and "margin 3%" in text
    tight = variant_rows(meta, counts, margin=0.0)
    assert tight["variants"][1]["vs_control"]["non_inferior"] is False


def test_what_a_variant_changes_in_a_request():
    exp = parse(EXAMPLE)
    diverse = Arm(exp.name, exp.variant("diverse"))
    light = Arm(exp.name, exp.variant("light"))
    req = RecommendRequest("r", "u1", 10)
    assert request(req, diverse).exclude_seen is True
    assert request(replace(req, exclude_seen=False), diverse).exclude_seen is False  # it said
    assert request(req, light) is req and request(req, None) is req
    assert quotas({"hot": 100, "vector": 200}, diverse) == {"hot": 50, "vector": 200}
    assert quotas({"hot": 10}, diverse) == {"hot": 10}  # a variant only lowers a quota
    assert steer(Choice("full", "ok"), light).tier == "light"
    for kept in ("light", "cached", "hot"):
        assert steer(Choice(kept, "x"), light).tier == kept
    assert steer(Choice("full", "ok"), diverse).tier == "full"


def test_counts_that_are_not_proportions_give_no_interval_and_no_crash():
    """Attribution counts any event naming a reply, so a variant can show more clicks than
    impressions or more conversions than clicks: the report says so instead of failing."""
    from freshrec.app.abreport import render, variant_rows

    meta = {"variants": '["a", "b"]', "shares": "[0.5, 0.5]", "control": "a"}
    counts = {"a:impression": 10, "a:click": 30, "a:conversion": 50, "b:impression": 100}
    counts |= {"b:click": 10, "b:conversion": 2}
    rep = variant_rows(meta, counts)
    a, b = rep["variants"]
    assert a["ctr_ci95"] is None and a["cvr_ci95"] is None
    assert a["inconsistent"] == "30 clicks > 10 impressions; 50 conversions > 30 clicks"
    assert b["vs_control"]["verdict"] == "not enough data"
    assert "counts are not proportions: 30 clicks > 10 impressions" in render({"e": rep})


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('variant = [1, 2]\n[experiment]\nname = "e"\n', "at least two"),
        ('[experiment]\nname = "e"\nx = ' + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"),
        (
            '[experiment]\nname = "e"\n'
            + "".join(f'[[variant]]\nname = "v{n}"\nshare = 0\n' for n in range(255)),
            "at most 254",
        ),
    ],
    ids=["variants-not-tables", "deep-nesting", "255-variants"],
)
def test_a_toml_valid_file_that_is_no_experiment_is_a_one_line_error(text, why):
    from inference.serving.experiments import ExperimentError, parse

    with pytest.raises(ExperimentError, match=why):
        parse(text)


class _FlakyRedis:
    """The three calls ``sync_table`` makes, on a dict; ``down`` makes every one fail."""

    def __init__(self) -> None:
        self.hashes: dict[str, dict] = {}
        self.down = False

    def _check(self) -> None:
        import redis

        if self.down:
            raise redis.ConnectionError("Redis is down")

    def hgetall(self, key):
        self._check()
        return dict(self.hashes.get(key, {}))

    def hset(self, key, mapping):
        self._check()
        self.hashes.setdefault(key, {}).update(
            {k.encode(): v if isinstance(v, bytes) else str(v).encode() for k, v in mapping.items()}
        )

    def sadd(self, key, *values):
        self._check()


def test_a_variant_renamed_while_redis_fails_keeps_serving_the_running_experiment(tmp_path):
    """The new file and its allocation table are adopted together: until Redis takes the new
    table, every user keeps an arm of the running experiment (a KeyError inside serving
    before); once it does, the renamed variant serves."""
    import os

    from freshcore.rediskeys import RedisKeys
    from inference.serving.liveexperiment import LiveExperiment

    path = tmp_path / "exp.toml"
    two = '[experiment]\nname = "e"\n[[variant]]\nname = "{a}"\nshare = 0.5\n[[variant]]\nname = "b"\nshare = 0.5\n'
    path.write_text(two.format(a="a"))
    r = _FlakyRedis()
    live = LiveExperiment(path, r, RedisKeys("t."), 60)
    live.load()
    users = [f"u{n}" for n in range(200)]
    assert {live.arm(u).variant.name for u in users} == {"a", "b"}
    path.write_text(two.format(a="renamed"))
    os.utime(path, ns=(1, 10**18))  # a new stamp whatever the file system's clock
    r.down = True
    live.poll(now=100.0)
    assert {live.arm(u).variant.name for u in users} == {"a", "b"}
    r.down = False
    live.poll(now=200.0)
    assert {live.arm(u).variant.name for u in users} == {"renamed", "b"}
    path.write_text('variant = [1, 2]\n[experiment]\nname = "e"\n')  # TOML, not an experiment
    os.utime(path, ns=(1, 2 * 10**18))
    live.poll(now=300.0)
    assert {live.arm(u).variant.name for u in users} == {"renamed", "b"}
