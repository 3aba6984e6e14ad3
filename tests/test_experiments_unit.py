"""A/B experiments without a server: assignment, allocation when shares change, the file's
errors, the interval and the test, and what a variant changes in serving one request."""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import replace

import pytest

from freshrec.abstats import two_proportions, wilson
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


def test_the_interval_and_the_test_against_hand_computed_values():
    # Wilson, 30 of 100, z = 1.96: centre (0.3 + z²/200) / (1 + z²/100), half-width
    # z √(0.3·0.7/100 + z²/40000) / (1 + z²/100)
    lo, hi = wilson(30, 100)
    assert lo == pytest.approx(0.218949, abs=1e-6) and hi == pytest.approx(0.395849, abs=1e-6)
    assert wilson(0, 10)[0] == 0.0 and math.isnan(wilson(0, 0)[0])
    # pooled: p = 100/800 = 0.125, se = √(0.125·0.875·2/400) = 0.023385, z = 0.05 / se
    t = two_proportions(60, 400, 40, 400)
    assert t.z == pytest.approx(2.138090, abs=1e-6) and t.p == pytest.approx(0.032509, abs=1e-6)
    assert math.isnan(two_proportions(0, 0, 1, 10).p)


def test_the_report_puts_each_variant_beside_the_control():
    meta = {"variants": '["a", "b"]', "shares": "[0.5, 0.5]", "control": "a"}
    counts = {
        "a:requests": 40,
        "a:impression": 400,
        "a:click": 40,
        "a:conversion": 4,
        "b:requests": 40,
        "b:impression": 400,
        "b:click": 60,
    }
    rep = variant_rows(meta, counts)
    a, b = rep["variants"]
    assert a["ctr"] == 0.1 and a["cvr"] == 0.1 and "vs_control" not in a
    assert b["ctr"] == 0.15 and b["cvr"] == 0.0
    assert b["vs_control"]["ctr_diff"] == pytest.approx(0.05)
    text = render({"exp": rep})
    assert "15.00% [" in text and "+5.00% (p=0.0325)" in text and "control" in text


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
    assert b["vs_control"]["p"] is None and b["ctr_ci95"] is not None
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

    from freshrec.rediskeys import RedisKeys
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
