"""The neighbourhood baselines against reference implementations written from their
specification alone (``tests/bruteforce_baselines.py``), with recommend and learn interleaved
the way the replay uses them: a step's lists are made, then the step is learnt, then the next
step's lists, on logs with repeats, new items arriving and users coming back."""

from __future__ import annotations

import random

import numpy as np
import pytest

from evaluation.baselines import BASELINES
from evaluation.neighbours import STAN, ItemKNN, SequentialRules
from evaluation.prequential import run
from evaluation.protocol import plan
from tests.bruteforce_baselines import BruteItemKNN, BruteSequentialRules, BruteSTAN

HOUR_MS = 3_600_000

PAIRS = [
    (lambda: ItemKNN(window=3, alpha=0.5, recency=0.9), lambda: BruteItemKNN(3, 0.5, 0.9)),
    (lambda: ItemKNN(window=10, alpha=0.0, recency=1.0), lambda: BruteItemKNN(10, 0.0, 1.0)),
    (lambda: ItemKNN(window=2, alpha=0.8, recency=0.5), lambda: BruteItemKNN(2, 0.8, 0.5)),
    (lambda: SequentialRules(steps=1), lambda: BruteSequentialRules(1)),
    (lambda: SequentialRules(steps=3), lambda: BruteSequentialRules(3)),
    (
        lambda: STAN(session=3, window=4, neighbours=3, sample=5, l1=2.0, l2=HOUR_MS, l3=2.0),
        lambda: BruteSTAN(3, 4, 3, 5, 2.0, HOUR_MS, 2.0),
    ),
    (
        lambda: STAN(session=5, window=6, neighbours=50, sample=100, l1=None, l2=None, l3=None),
        lambda: BruteSTAN(5, 6, 50, 100, None, None, None),
    ),
    (
        lambda: STAN(session=2, window=3, neighbours=2, sample=3, l1=1.0, l2=None, l3=5.0),
        lambda: BruteSTAN(2, 3, 2, 3, 1.0, None, 5.0),
    ),
]
IDS = ["knn-w3", "knn-w10-a0", "knn-w2-a08", "sr-1", "sr-3", "stan", "vsknn", "stan-small"]


def _log(rng: random.Random, n: int, users: int, items: int) -> tuple[list, list, list]:
    """A log with popular and rare items, items that first appear late, returning users
    and repeated consumption; times non-decreasing, with gaps of seconds to hours."""
    us, its, ts, t = [], [], [], 0
    for pos in range(n):
        catalogue = max(2, int(items * (0.3 + 0.7 * pos / n)))  # the catalogue grows
        item = min(int(rng.paretovariate(1.2)) - 1, catalogue - 1)
        if rng.random() < 0.4:
            item = rng.randrange(catalogue)
        us.append(f"u{rng.randrange(users)}")
        its.append(f"i{item}")
        t += rng.choice((0, 1000, 60_000, HOUR_MS))
        ts.append(t)
    return us, its, ts


def _keys(brute, user: str, listed: list[str]) -> list[float]:
    """The oracle's ranking key of each listed item: its score plus the popularity share."""
    scores = brute.scores(user)
    top = max((brute.n(b) for b in scores), default=1) or 1
    return [scores[b] + 1e-9 * brute.n(b) / top for b in listed]


def _same_ranking(model, brute, user: str, k: int, exclude: set[str]) -> None:
    got, want = model.recommend(user, k, exclude), brute.recommend(user, k, exclude)
    assert len(got) == len(want) == len(set(got)), (got, want)
    assert not set(got) & exclude
    # equal keys may differ in their last bits by summation order: compare keys, position by
    # position, so a list that differs only inside a tie passes and any other difference fails
    np.testing.assert_allclose(
        _keys(brute, user, got), _keys(brute, user, want), rtol=1e-12, atol=1e-18
    )


@pytest.mark.parametrize("make,make_brute", PAIRS, ids=IDS)
@pytest.mark.parametrize("seed", range(6))
def test_a_baseline_ranks_as_its_specification_with_recommend_and_learn_interleaved(
    make, make_brute, seed
):
    rng = random.Random(seed)
    us, its, ts = _log(rng, 240, users=12, items=30)
    model, brute = make(), make_brute()
    consumed: dict[str, set[str]] = {}
    pos = 0
    while pos < len(us):
        # a step: lists for some users (known, unknown, with and without exclusions) ...
        for user in rng.sample(sorted(set(us[:pos]) | {"new-user"}), k=min(4, 1 + pos // 40)):
            exclude = set(consumed.get(user, set())) if rng.random() < 0.7 else set()
            _same_ranking(model, brute, user, rng.choice((1, 3, 10, 50)), exclude)
        # ... then the step's interactions learnt
        size = rng.choice((1, 2, 5, 17))
        step = slice(pos, pos + size)
        model.learn(us[step], its[step], ts[step])
        brute.learn(us[step], its[step], ts[step])
        for u, i in zip(us[step], its[step], strict=True):
            consumed.setdefault(u, set()).add(i)
        pos += size


@pytest.mark.parametrize(
    "make,make_brute", [PAIRS[0], PAIRS[4], PAIRS[5]], ids=[IDS[0], IDS[4], IDS[5]]
)
def test_the_replay_protocol_scores_a_baseline_as_it_scores_its_specification(make, make_brute):
    """``prequential.run``, as ``freshrec replay`` calls it, gives the same hits to the
    baseline and to its reference: their lists agree step after step."""
    us, its, ts = _log(random.Random(7), 400, users=15, items=40)
    users, items = np.array(us, object), np.array(its, object)
    p = plan(users, items, train_share=0.3, step=7)
    mine = run(make(), p, users, items, np.array(ts), k=5, windows=1)
    ref = run(make_brute(), p, users, items, np.array(ts), k=5, windows=1, name="ref")
    assert mine.total.interactions == ref.total.interactions > 100
    assert mine.total.hits == ref.total.hits


def test_item_knn_keeps_its_counts_across_steps():
    """The counts learnt before a step are still there after a later step adds other pairs:
    v, who consumed x, gets y (met x twice) before z (more popular, never met x)."""
    knn = ItemKNN(window=10, alpha=0.0)
    knn.learn(["u1", "u1", "u2", "u2", "p", "q", "r"], ["x", "y", "x", "y", "z", "z", "z"])
    knn.learn(["v"], ["x"])
    assert knn.recommend("v", 1, {"x"}) == ["y"]
    knn.learn(["u3", "u3"], ["a", "b"])  # a step that adds another pair
    assert knn.recommend("v", 1, {"x"}) == ["y"]


def test_equal_scores_go_to_the_more_popular_item_then_to_the_one_seen_first():
    sr = SequentialRules(steps=1)
    # a → b and a → c once each; c is consumed by two users, b by one; d and e never follow a
    sr.learn(["u", "u", "v", "v", "w", "x", "x"], ["a", "b", "a", "c", "c", "d", "e"])
    sr.learn(["y"], ["a"])
    assert sr.recommend("y", 4, {"a"}) == ["c", "b", "d", "e"]


@pytest.mark.parametrize("name", list(BASELINES))
def test_no_baseline_lists_an_item_before_its_first_interaction(name):
    """Every registered baseline, at its first setting, through the replay's protocol on a
    log whose catalogue grows: each list holds only items of interactions already learnt."""
    us, its, ts = _log(random.Random(11), 300, users=10, items=60)
    users, items = np.array(us, object), np.array(its, object)
    first: dict[str, int] = {}
    for pos, item in enumerate(its):
        first.setdefault(item, pos)
    spec = BASELINES[name]
    p = plan(users, items, train_share=0.2, step=10)
    model = spec.cls(**spec.candidates(p.train_end)[0][1])
    early: list[str] = []

    class Watched:
        """The baseline, with what it lists checked against what it has learnt."""

        name = "watched"
        learnt = 0

        def learn(self, u, i, t_ms=None):
            model.learn(u, i, t_ms)
            self.learnt += len(u)

        def recommend(self, user, k, exclude):
            listed = model.recommend(user, k, exclude)
            early.extend(x for x in listed if first[x] >= self.learnt)
            return listed

    scores = run(Watched(), p, users, items, np.array(ts), k=10, windows=1)
    assert scores.total.interactions > 0
    assert sum(first[i] >= p.train_end for i in set(its)) > 10  # items did keep arriving
    assert not early, early[:5]
