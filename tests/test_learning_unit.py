"""Pure logic of online learning: labels, gradients, Adagrad, LRU, rows, read-your-writes."""

from __future__ import annotations

import random

import numpy as np
import pytest

from freshcore.gradients import clip_rows
from inference.learning.pending import PendingSteps
from inference.learning.steps import (
    LabelConfig,
    aggregate,
    examples_from_events,
    logistic_gradients,
)
from inference.tables.lru import SlotLRU
from param_server.adagrad import AdagradConfig, adagrad_step
from schemas.records import Event
from schemas.rows import TABLE_ITEM, TABLE_USER, decode_row, encode_row, initial_rows

T = 1_767_225_600_000


def ev(kind, user="u1", item="i1", req="r1"):
    return Event(f"{kind}-{user}-{item}-{req}", kind, user, item, T, request_id=req)


def test_labels_clicked_impressions_are_not_negatives_and_conversions_weigh_more():
    events = [
        ev("impression"),
        ev("click"),
        ev("impression", item="i2"),
        ev("conversion", item="i3"),
    ]
    ex = examples_from_events(
        events, LabelConfig(conversion_weight=3.0), np.random.default_rng(0), []
    )
    assert list(zip(ex.items, ex.labels.tolist(), ex.weights.tolist(), strict=True)) == [
        ("i1", 1.0, 1.0),
        ("i2", 0.0, 1.0),
        ("i3", 1.0, 3.0),
    ]


def test_a_batch_without_negatives_gets_sampled_ones():
    ex = examples_from_events(
        [ev("click")], LabelConfig(sampled_negatives=3), np.random.default_rng(0), ["i7", "i8"]
    )
    assert ex.labels.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert set(ex.items[1:]) <= {"i7", "i8"} and ex.users == ["u1"] * 4


def test_gradients_match_finite_differences():
    rng = np.random.default_rng(1)
    u, v = rng.standard_normal((1, 5)), rng.standard_normal((1, 5))
    u[0, -1] = 1.0
    y, w = np.array([1.0]), np.array([2.0])

    def loss(uu, vv):
        p = 1 / (1 + np.exp(-(uu * vv).sum()))
        return -w[0] * (y[0] * np.log(p) + (1 - y[0]) * np.log(1 - p))

    gu, gv = logistic_gradients(u.astype(np.float64), v.astype(np.float64), y, w)
    eps = 1e-6
    for j in range(4):
        d = np.zeros_like(u)
        d[0, j] = eps
        assert gu[0, j] == pytest.approx((loss(u + d, v) - loss(u - d, v)) / (2 * eps), rel=1e-5)
        assert gv[0, j] == pytest.approx((loss(u, v + d) - loss(u, v - d)) / (2 * eps), rel=1e-5)
    assert gu[0, -1] == 0.0  # the user's constant column does not learn


def test_aggregate_sums_per_row():
    g = aggregate(np.array([5, 3, 5]), np.array([[1.0], [2.0], [4.0]]))
    assert (
        g.keys.tolist() == [3, 5]
        and g.sums.ravel().tolist() == [2.0, 5.0]
        and g.counts.tolist() == [1, 2]
    )


def test_aggregate_equals_adding_row_by_row_in_input_order():
    """The grouping gives what ``np.add.at`` and ``np.maximum.at`` give, on random keys with
    repeats: float32 rows summed in float32 (each key's sum within float32 accumulation
    round-off of the float64 sum: terms · 2^-23 · Σ|g|), float64 rows in float64."""
    rng = np.random.default_rng(4)
    for n in (0, 1, 2, 7, 100, 1000):
        keys = rng.integers(-5, 20, n)
        grads = (rng.standard_normal((n, 3)) * rng.choice([1e-3, 1.0, 1e3])).astype(np.float32)
        times = rng.integers(0, 10**12, n)
        counts = rng.integers(1, 5, n)
        g = aggregate(keys, grads, times, counts)
        uniq, inverse = np.unique(keys, return_inverse=True)
        sums = np.zeros((len(uniq), 3), np.float64)
        np.add.at(sums, inverse, grads.astype(np.float64))
        total = np.zeros(len(uniq), np.int64)
        np.add.at(total, inverse, counts)
        newest = np.full(len(uniq), np.iinfo(np.int64).min, np.int64)
        np.maximum.at(newest, inverse, times)
        assert np.array_equal(g.keys, uniq) and np.array_equal(g.index, inverse.ravel())
        assert g.sums.dtype == np.float32
        magnitude = np.zeros((len(uniq), 3), np.float64)
        np.add.at(magnitude, inverse, np.abs(grads.astype(np.float64)))
        terms = np.bincount(inverse.ravel(), minlength=len(uniq))[:, None]
        assert (np.abs(g.sums - sums) <= terms * 2.0**-23 * magnitude + 1e-30).all()
        wide = aggregate(keys, grads.astype(np.float64), times, counts)
        assert wide.sums.dtype == np.float64
        np.testing.assert_allclose(wide.sums, sums, rtol=1e-12, atol=1e-12)
        assert np.array_equal(g.counts, total) and np.array_equal(g.newest, newest)


def test_adagrad_matches_its_formula_and_rejects_non_finite_rows():
    cfg = AdagradConfig(lr=0.1, eps=1e-8, max_norm=100.0)
    rows = np.ones((3, 2), np.float32)
    acc = np.zeros((3, 2), np.float32)
    g = np.array([[0.5, -0.25], [np.nan, 1.0], [np.inf, 0.0]], np.float32)
    ok = adagrad_step(rows, acc, g, cfg)
    assert ok.tolist() == [True, False, False]
    np.testing.assert_allclose(rows[0], 1 - 0.1 * g[0] / (np.abs(g[0]) + 1e-8), rtol=1e-6)
    assert rows[1:].tolist() == [[1, 1], [1, 1]] and acc[1:].tolist() == [[0, 0], [0, 0]]


def test_exploding_gradients_are_clipped_to_the_norm_bound():
    g = np.array([[3e30, 4e30], [0.3, 0.4]], np.float32)
    clipped = clip_rows(g, 1.0)
    assert np.linalg.norm(clipped, axis=1) == pytest.approx([1.0, 0.5], rel=1e-5)


def test_rows_are_deterministic_from_ids_and_round_trip():
    a = initial_rows(np.array([1, 2, 3]), TABLE_USER, 8)
    assert (a == initial_rows(np.array([1, 2, 3]), TABLE_USER, 8)).all()
    assert not (a == initial_rows(np.array([1, 2, 3]), TABLE_ITEM, 8)).all()
    assert a[:, -1].tolist() == [1.0] * 3
    assert initial_rows(np.array([1]), TABLE_ITEM, 8)[0, -1] == 0.0
    row, version, ms = decode_row(encode_row(a[0], 7, T), 9)
    assert (row == a[0]).all() and (version, ms) == (7, T)


def test_lru_evicts_the_least_recently_used():
    lru = SlotLRU(2)
    lru.admit("a"), lru.admit("b")
    lru.get("a")
    assert lru.admit("c") == (1, "b")
    assert "b" not in lru and lru.peek("a") == 0


def check_lists(p: PendingSteps) -> None:
    """The pool's structure: every held step is on exactly one list (its own row's, in the
    order taken, ending at the row's tail), every other step is free, and the count agrees."""
    reached = []
    for lists in p._tables.values():
        slots = np.flatnonzero(lists.head >= 0)
        assert (lists.tail[slots] >= 0).all() and (lists.tail[lists.head < 0] == -1).all()
        pos, steps = p._walk(lists, slots)
        assert (p._slot[steps] == slots[pos]).all()
        last = np.full(len(slots), -1)
        last[pos] = steps  # the walk goes first steps, then second ones, ...: the last wins
        assert (lists.tail[slots] == last).all() and (p._next[last] == -1).all()
        reached.append(steps)
    held = np.concatenate(reached) if reached else np.zeros(0, np.int64)
    free = p._free[: p._free_n]
    assert len(set(held.tolist())) == len(held) == len(p)
    assert not set(held.tolist()) & set(free.tolist())
    assert len(held) + len(free) == len(p._token)
    for token, steps in p._by_token.items():
        assert token > 0 and len(steps)


@pytest.mark.parametrize("stepless_installs", ["recorded", "skipped"])
def test_read_your_writes_bookkeeping_is_exact_under_any_interleaving(stepless_installs):
    """Model: one partition; the global row is the sum of the deltas of the applied messages.
    Whatever the order of local steps (a row may repeat within a record), messages carrying
    steps of several rows, failed sends, deliveries, delivery reports, installs of any subset
    of rows and evictions: serving = global + pending = all local steps of every row still
    cached; ``waiting`` names exactly the rows with a step whose report is outstanding. The
    worker installs only rows that ``holds`` steps ("skipped"); installing every row
    ("recorded") must give the same."""
    rows = 6
    for seed in range(300):
        rng = random.Random(seed)
        # tiny pools force growth; every third pool is laid out (float32) and touched at
        # construction, as the worker's is
        laid_out = {"width": 1, "touch": True} if seed % 3 == 0 else {}
        p = PendingSteps(capacity=rng.choice([1, 4, 64]), **laid_out)
        serving, total = np.zeros(rows), np.zeros(rows)
        alive = np.ones(rows, bool)  # not evicted
        log: list[list[tuple[int, float]]] = []  # per offset: the message's (row, delta)
        unsent: list[tuple[int, int, float]] = []  # (step, row, delta)
        sent: list[tuple[int, list]] = []  # produced, not acknowledged by the broker yet
        late: list[tuple[int, int]] = []  # (token, offset): the report not read yet
        open_rows: dict[int, set[int]] = {}  # token -> rows whose steps it carries
        installed = np.full(rows, -1)
        tokens = iter(range(1, 10_000))
        for _ in range(rng.randint(1, 80)):
            action = rng.random()
            live = np.flatnonzero(alive).tolist()
            if action < 0.3 and live:
                slots = [rng.choice(live) for _ in range(rng.randint(1, 5))]  # may repeat
                # multiples of 2^-10: float32 sums of them are exact, as the model's are
                deltas = np.array([rng.randint(-1024, 1024) / 1024 for _ in slots])
                steps = p.record("user", np.array(slots), deltas[:, None])
                for s, r, d in zip(steps.tolist(), slots, deltas.tolist(), strict=True):
                    serving[r] += d
                    total[r] += d
                    unsent.append((s, r, d))
            elif action < 0.42 and unsent:
                take = rng.sample(unsent, rng.randint(1, len(unsent)))
                unsent = [u for u in unsent if u not in take]
                token = next(tokens)
                p.assign(np.array([s for s, _, _ in take]), token)
                sent.append((token, [(r, d) for _, r, d in take]))
                open_rows[token] = {r for _, r, _ in take}
            elif action < 0.55 and sent:
                token, carried = sent.pop(0)  # Kafka keeps the order of one partition
                if rng.random() < 0.1:
                    p.failed(token)  # its steps stay local for good
                    open_rows.pop(token)
                else:
                    late.append((token, len(log)))
                    log.append(carried)
            elif action < 0.7 and late:
                token, offset = late.pop(0)
                assert p.delivered(token, 0, offset) == []  # nothing installed past it yet
                open_rows.pop(token)
            elif action < 0.93 and log and live:
                waiting = p.waiting("user", np.arange(rows))
                expect = set().union(*open_rows.values()) if open_rows else set()
                assert {r for r in range(rows) if waiting[r]} == expect & set(live)
                while late:  # the worker reads its outstanding reports before installing
                    token, offset = late.pop(0)
                    assert p.delivered(token, 0, offset) == []
                    open_rows.pop(token)
                chosen = np.array(sorted(rng.sample(live, rng.randint(1, len(live)))))
                upto = rng.randint(int(installed[chosen].max()), len(log) - 1)
                installed[chosen] = upto  # versions only move forward
                global_rows = np.zeros(rows)
                for offset in range(upto + 1):
                    for r, d in log[offset]:
                        global_rows[r] += d
                if stepless_installs == "skipped":
                    stepless = chosen[~p.holds("user", chosen)]
                    serving[stepless] = global_rows[stepless]
                    chosen = chosen[p.holds("user", chosen)]
                rest, kept = p.install("user", chosen, 0, upto)
                serving[chosen] = global_rows[chosen]
                if rest is not None:
                    serving[chosen[kept]] += rest[kept, 0]
                assert rest is None or not rest[~kept].any()
            elif live:
                gone = rng.choice(live)
                p.forget("user", np.array([gone]))
                alive[gone] = False
                unsent = [u for u in unsent if u[1] != gone]
                assert p.steps("user", gone).shape[0] == 0
            np.testing.assert_allclose(serving[alive], total[alive], atol=1e-9, err_msg=str(seed))
            check_lists(p)


def test_steps_included_before_their_delivery_report_are_dropped_on_the_report():
    p = PendingSteps()
    steps = p.record("user", np.array([3]), np.array([[1.0]]))
    p.assign(steps, 1)
    assert p.waiting("user", np.array([3, 4])).tolist() == [True, False]
    rest, kept = p.install("user", np.array([3]), 0, 10)  # offset unknown yet: kept
    assert rest.tolist() == [[1.0]] and kept.tolist() == [True]
    [(table, slots, deltas)] = p.delivered(1, 0, 10)  # it was included
    assert (table, slots.tolist(), deltas.tolist()) == ("user", [3], [[1.0]])
    assert len(p) == 0 and p.rows() == 0
    check_lists(p)


def test_a_slot_named_twice_in_one_record_keeps_its_steps_in_order():
    p = PendingSteps()
    steps = p.record("user", np.array([5, 6, 5, 5]), np.arange(8.0).reshape(4, 2))
    assert len(p) == 4 and p.rows() == 2
    assert p.steps("user", 5).tolist() == [[0, 1], [4, 5], [6, 7]]
    p.assign(steps[[0, 1]], 8)  # the first step of 5 and the step of 6
    p.assign(steps[[2, 3]], 9)
    p.delivered(8, 0, 20)
    p.delivered(9, 0, 21)
    rest, kept = p.install("user", np.array([5, 6]), 0, 20)
    assert kept.tolist() == [True, False] and rest[0].tolist() == [10.0, 12.0]
    assert p.steps("user", 5).tolist() == [[4, 5], [6, 7]]
    check_lists(p)


def test_unsent_steps_dropped_leave_the_rest_of_their_rows_in_order():
    p = PendingSteps()
    steps = p.record("user", np.array([5, 6, 5, 5]), np.arange(8.0).reshape(4, 2))
    p.assign(steps[[3]], 4)  # 5's last step is sent
    p.drop_unsent("user", steps[[0, 2]])  # 5's first two, unsent
    assert p.steps("user", 5).tolist() == [[6, 7]] and p.steps("user", 6).tolist() == [[2, 3]]
    assert len(p) == 2
    with pytest.raises(ValueError, match="held and unsent"):
        p.drop_unsent("user", steps[[3]])  # sent: its message carries it
    with pytest.raises(ValueError, match="held and unsent"):
        p.drop_unsent("user", steps[[0]])  # already gone
    with pytest.raises(ValueError, match="another table"):
        p.drop_unsent("item", steps[[1]])
    check_lists(p)


def test_a_failed_message_leaves_its_steps_local_and_a_forgotten_rows_report_is_ignored():
    p = PendingSteps()
    a = p.record("user", np.array([1, 2]), np.ones((2, 1)))
    p.assign(a, 1)
    p.failed(1)
    assert not p.waiting("user", np.array([1, 2])).any()  # nothing to wait for
    rest, kept = p.install("user", np.array([1]), 0, 99)  # no update can include them
    assert kept.tolist() == [True] and rest.tolist() == [[1.0]]
    b = p.record("user", np.array([3]), np.ones((1, 1)))
    p.assign(b, 2)
    p.forget("user", np.array([3]))
    c = p.record("item", np.array([3]), np.full((1, 1), 5.0))  # may reuse the freed step
    p.assign(c, 3)
    assert p.delivered(2, 0, 0) == []  # the forgotten row's report touches nothing
    assert p.waiting("item", np.array([3])).tolist() == [True]
    p.delivered(3, 1, 4)
    assert p.install("item", np.array([3]), 1, 4)[1].tolist() == [False]
    assert len(p) == 2 and p.rows() == 2  # the failed steps of rows 1 and 2
    check_lists(p)


def test_trimming_lets_the_oldest_sent_steps_go_and_keeps_the_unsent_ones():
    p = PendingSteps()
    a = p.record("user", np.array([1, 2]), np.array([[1.0], [2.0]]))
    p.assign(a, 1)
    p.delivered(1, 0, 5)
    b = p.record("user", np.array([1]), np.array([[4.0]]))
    p.assign(b, 2)  # in flight
    c = p.record("item", np.array([1]), np.array([[8.0]]))
    p.assign(c, 3)
    p.failed(3)
    p.record("user", np.array([2]), np.array([[16.0]]))  # unsent: the outbox names it
    assert p.trim(5) == 0 and len(p) == 5
    assert p.trim(3) == 2  # the two oldest sent: message 1's
    assert p.steps("user", 1).tolist() == [[4.0]] and p.steps("user", 2).tolist() == [[16.0]]
    check_lists(p)
    # an update that does not include a let-go step: the row is its global row plus the
    # steps still held, so it misses that step until an update includes it
    rest, kept = p.install("user", np.array([2]), 0, 4)
    assert rest.tolist() == [[16.0]] and kept.tolist() == [True]
    assert p.trim(0) == 2  # every sent step (message 2's in flight, 3's failed), not the unsent
    assert len(p) == 1 and p.steps("user", 2).tolist() == [[16.0]]
    assert p.delivered(2, 0, 6) == []  # a let-go step's report touches nothing
    assert p.waiting("user", np.array([1])).tolist() == [False]
    check_lists(p)
    with pytest.raises(ValueError):
        p.trim(-1)


def test_trimming_a_large_pool_lets_go_exactly_the_oldest_and_the_pool_reuses_them():
    p = PendingSteps(capacity=16)
    rng = np.random.default_rng(3)
    taken = []
    for token in range(1, 41):
        slots = rng.integers(0, 30, 25)
        steps = p.record("user", slots, np.full((25, 1), float(token)))
        p.assign(steps, token)
        taken.append(steps)
    assert p.trim(600) == 400  # the steps of the first 16 messages
    held = sorted(np.concatenate([p.steps("user", s)[:, 0] for s in range(30)]).tolist())
    assert held == sorted(float(t) for t in range(17, 41) for _ in range(25))
    check_lists(p)
    size = len(p._token)
    p.record("user", np.arange(400) % 30, np.zeros((400, 1)))  # into the released entries
    assert len(p) == 1000 and len(p._token) == size
    check_lists(p)


def test_event_offsets_wait_for_the_delivery_of_every_gradient_message_before_them():
    from inference.offsets import OffsetGate

    g = OffsetGate()
    e0, e1 = ("events", 0), ("events", 1)
    g.learnt(e0, 10)
    g.learnt(e1, 4)
    g.produced(1)
    g.produced(2)
    g.seal()  # the events up to here: messages 1 and 2
    g.learnt(e0, 20)
    g.learnt(e0, 15)  # offsets only move forward
    assert g.ready() == {}  # nothing reported
    g.produced(3)
    g.seal()
    g.seal()  # nothing learnt since: no group
    assert g.waiting() == 2
    g.reported(2)
    g.reported(3)  # the later group's message is in, an earlier one is not
    assert g.ready() == {} and g.waiting() == 2
    g.reported(1)  # a failed delivery reports too: its events are not learnt again
    assert g.ready() == {e0: 20, e1: 4} and g.waiting() == 0
    assert g.ready() == {}
    g.learnt(e0, 30)
    g.learnt(e1, 9)
    g.seal()  # no message since the last delivered one: ready at once
    g.learnt(e1, 12)
    g.forget([e1])  # revoked: neither the sealed offset nor the learnt one is committed
    g.seal()
    assert g.ready() == {e0: 30}
    with pytest.raises(ValueError):
        g.produced(3)  # tokens rise


def test_bad_input_to_the_bookkeeping_is_refused():
    p = PendingSteps()
    with pytest.raises(ValueError):
        p.record("user", np.array([1, 2]), np.ones((3, 1)))
    with pytest.raises(ValueError):
        p.record("user", np.array([-1]), np.ones((1, 1)))
    steps = p.record("user", np.array([1]), np.ones((1, 1)))
    with pytest.raises(ValueError):
        p.record("user", np.array([1]), np.ones((1, 2)))  # another width
    with pytest.raises(ValueError):
        p.assign(steps, 0)
    p.assign(steps, 4)
    with pytest.raises(ValueError):
        p.assign(steps, 5)  # already in a message
    laid_out = PendingSteps(capacity=8, width=2, touch=True)
    with pytest.raises(ValueError):
        laid_out.record("user", np.array([1]), np.ones((1, 3)))  # not the width given
    laid_out.record("user", np.array([1]), np.array([[0.1, 2.0]]))  # float64 in: float32 kept
    assert laid_out.steps("user", 1).dtype == np.float32


def test_parameter_table_applies_a_log_at_once_exactly_as_message_by_message():
    from param_server.table import ParamTable

    cfg = AdagradConfig(lr=0.1, max_norm=1.0)
    rng = np.random.default_rng(0)
    for _ in range(200):
        w, n_rows = 4, int(rng.integers(1, 30))
        one_by_one, at_once = ParamTable(w, 2), ParamTable(w, 2)  # tiny: forces growth
        start = rng.standard_normal((n_rows, w)).astype(np.float32)
        for t in (one_by_one, at_once):
            t.add(
                np.arange(n_rows) * 7,
                start,
                np.zeros((n_rows, w), np.float32),
                np.zeros(n_rows, np.uint64),
                np.zeros(n_rows, np.int64),
            )
        messages = []
        for _ in range(int(rng.integers(1, 12))):
            size = int(rng.integers(1, 10))  # rows may repeat within a message
            slots = rng.integers(0, n_rows, size)
            grads = (rng.standard_normal((size, w)) * rng.choice([0.1, 5.0])).astype(np.float32)
            if rng.random() < 0.2:
                grads[rng.integers(0, size)] = np.nan
            messages.append((slots, grads, rng.integers(1, 1000, size)))
        for slots, grads, times in messages:
            one_by_one.apply(slots, grads, times, cfg)
        seq = np.concatenate([np.full(len(s), k) for k, (s, _, _) in enumerate(messages)])
        at_once.apply_log(
            *(np.concatenate(parts) for parts in zip(*messages, strict=True)), seq, cfg
        )
        for field in ("rows", "accum", "version", "event_ms"):
            assert np.array_equal(
                getattr(one_by_one, field)[:n_rows], getattr(at_once, field)[:n_rows]
            ), field
        assert np.isfinite(at_once.rows[:n_rows]).all()


def test_packed_redis_commands_equal_redis_py_packing():
    from redis.connection import PythonRespSerializer

    from freshcore.resp import pack, pack_fixed
    from schemas.rows import encode_rows, encode_rows_matrix, key_matrix, row_key

    ids = np.array([5, -3, 2**62], np.int64)
    rows = np.arange(3 * 5, dtype=np.float32).reshape(3, 5)
    versions, times = np.array([1, 2, 3], np.uint64), np.array([10, 20, 30], np.int64)
    blobs = encode_rows(rows, versions, times)
    assert blobs == [line.tobytes() for line in encode_rows_matrix(rows, versions, times)]
    args = [x for i, b in zip(ids.tolist(), blobs, strict=True) for x in (row_key(i), b)]
    reference = b"".join(PythonRespSerializer(10**9, lambda a: a).pack(b"HSET", b"key", *args))
    fixed = pack_fixed(b"HSET", b"key", key_matrix(ids), encode_rows_matrix(rows, versions, times))
    assert fixed == reference == pack(b"HSET", b"key", *args)


def test_parameter_table_forgets_rows_not_updated_since_a_cutoff():
    from param_server.table import ParamTable

    t = ParamTable(2, capacity=2)
    ids = np.array([10, 20, 30, 40])
    rows = np.arange(8, dtype=np.float32).reshape(4, 2)
    t.add(ids, rows, rows * 2, np.array([1, 2, 3, 4], np.uint64), np.array([5, 50, 7, 70]))
    assert t.evict_older_than(40) == 2
    assert len(t) == 2 and t.lookup(np.array([10, 20, 30, 40])).tolist() == [-1, 0, -1, 1]
    assert t.rows[:2].tolist() == [[2, 3], [6, 7]] and t.accum[:2].tolist() == [[4, 6], [12, 14]]
    assert t.version[:2].tolist() == [2, 4] and t.event_ms[:2].tolist() == [50, 70]
    assert t.evict_older_than(40) == 0
    t.add(np.array([10]), rows[:1], rows[:1], np.array([9], np.uint64), np.array([99]))
    assert t.lookup(np.array([10, 40])).tolist() == [2, 1]


def test_a_row_created_again_after_expiry_is_newer_than_its_earlier_life():
    from schemas.rows import updates_since_creation, version_floor

    first = int(version_floor(np.array([1_767_225_600_000]))[0])
    old_life = first + 500_000  # half a million updates within the first second
    again = int(version_floor(np.array([1_767_225_601_000]))[0])  # re-created a second later
    assert again > old_life and int(updates_since_creation(again + 3)) == 3


def test_admission_filter_forgets_rows_unseen_for_a_window():
    from inference.learning.admission import AdmissionFilter

    f = AdmissionFilter(threshold=3, window_ms=100)
    assert [f.touch("a", t) for t in (0, 1, 2, 3)] == [False, False, True, True]
    f.touch("b", 50)
    assert f.rotate(99) == [] and f.rotate(100) == []  # a and b move to the older generation
    f.touch("a", 150)  # seen again: kept, still admitted
    assert sorted(f.rotate(200)) == ["b"] and len(f) == 1 and f.touch("a", 210)
    assert AdmissionFilter(1, 100).touch("x", 0) and len(AdmissionFilter(1, 100)) == 0
    with pytest.raises(ValueError):
        AdmissionFilter(0, 100)


def test_item_rows_that_fail_to_load_get_no_slot_and_load_on_the_retry():
    import torch

    from inference.tables.cache import EmbeddingCache

    stored = {11: (np.full(5, 0.5, np.float32), 7, 123)}
    outage = [True]

    def fetch(table, ids):
        if outage[0]:
            outage[0] = False
            raise ConnectionError("injected outage")
        hits = [stored[i] for i in ids if i in stored]
        return (
            np.array([i in stored for i in ids]),
            np.array([h[0] for h in hits]).reshape(-1, 5),
            np.array([h[1] for h in hits], np.uint64),
            np.array([h[2] for h in hits]),
        )

    cache = EmbeddingCache(4, 8, fetch, torch.device("cpu"))
    ids = np.array([11, 12, 11])
    with pytest.raises(ConnectionError):
        cache.slots(TABLE_ITEM, ids)
    assert cache.held(TABLE_ITEM, 11) is None and cache.item_ids == []
    slots = cache.slots(TABLE_ITEM, ids)
    assert slots[0] == slots[2] != slots[1] and cache.held(TABLE_ITEM, 12) == slots[1]
    rows = cache.gather(TABLE_ITEM, slots)
    assert rows[0].tolist() == [0.5] * 5 and int(cache.items.version[slots[0]]) == 7
    assert rows[1].tolist() == initial_rows(np.array([12]), TABLE_ITEM, 4)[0].tolist()
    # a broadcast row for an item not resident gets a slot without a load (version 0)
    install = cache.slots_for_install(TABLE_ITEM, [11, 13, 13])
    assert install[0] == slots[0] and install[1] == install[2] == 2
    assert int(cache.items.version[2]) == 0 and cache.item_ids == [11, 12, 13]
    many = np.arange(1000, 4000)  # past the table's first capacity: it grows
    got = cache.slots(TABLE_ITEM, many)
    assert len(set(got.tolist())) == 3000 and cache.held(TABLE_ITEM, 3999) == got[-1]
    assert cache.slots(TABLE_ITEM, np.array([12, 3999])).tolist() == [slots[1], got[-1]]


def test_items_untouched_since_a_time_leave_the_table_and_their_slots_are_reused():
    import torch

    from inference.tables.cache import EmbeddingCache

    now = [1_000]
    outage = [False]

    def fetch(table, ids):
        if outage[0]:
            raise ConnectionError("injected outage")
        return np.zeros(len(ids), bool), np.zeros((0, 5)), np.zeros(0, np.uint64), np.zeros(0)

    cache = EmbeddingCache(4, 8, fetch, torch.device("cpu"), clock=lambda: now[0])
    evicted = []
    cache.on_evict = lambda table, slots, ids: evicted.append((table, slots.tolist(), ids))
    first = cache.slots(TABLE_ITEM, np.arange(10, 16))  # six items at t = 1000
    now[0] = 5_000
    cache.slots(TABLE_ITEM, np.array([10, 11]))  # two touched again
    keep = np.zeros(3, bool)
    keep[first[2]] = True  # e.g. in the catalogue
    cache.add(TABLE_ITEM, first, np.ones((6, 5), np.float32))
    assert cache.expire_items(unseen_since_ms=4_000, keep=keep) == 3
    gone = first[3:].tolist()
    assert evicted == [(TABLE_ITEM, gone, [13, 14, 15])]
    assert [cache.held(TABLE_ITEM, i) for i in (10, 11, 12, 13, 14, 15)] == [
        *first[:3],
        None,
        None,
        None,
    ]
    assert cache.item_rows == 3 and not cache.gather(TABLE_ITEM, np.array(gone)).any()
    assert cache.expire_items(unseen_since_ms=4_000, keep=keep) == 0  # nothing twice
    # a failed load takes no free slot; the retry gets them, the table does not grow
    outage[0] = True
    with pytest.raises(ConnectionError):
        cache.slots(TABLE_ITEM, np.array([20, 21]))
    outage[0] = False
    rows_before = len(cache.items.rows)
    got = cache.slots(TABLE_ITEM, np.array([20, 21, 22, 23]))
    assert sorted(got[:3].tolist()) == sorted(gone) and got[3] == len(first)
    assert len(cache.items.rows) == rows_before and cache.item_rows == 7
    assert [cache.item_ids[s] for s in got.tolist()] == [20, 21, 22, 23]
    assert (
        cache.gather(TABLE_ITEM, got[:1])[0].tolist()
        == initial_rows(np.array([20]), TABLE_ITEM, 4)[0].tolist()
    )
    assert cache.slots(TABLE_ITEM, np.array([13])).tolist() == [len(first) + 1]  # back: anew


def test_the_item_table_holds_at_most_its_bound_the_least_recently_touched_leave():
    """A flood of unknown item ids: past ``at_most`` rows besides the catalogue's, the least
    recently touched go (to a tenth below the bound), the catalogue's never; the table's
    memory stops growing."""
    import torch

    from freshcore import metrics as m
    from inference.tables.cache import EmbeddingCache

    now = [0]

    def fetch(table, ids):
        return np.zeros(len(ids), bool), np.zeros((0, 5)), np.zeros(0, np.uint64), np.zeros(0)

    cache = EmbeddingCache(4, 8, fetch, torch.device("cpu"), clock=lambda: now[0])
    catalogue = cache.slots(TABLE_ITEM, np.arange(5))  # slots 0-4, touched first
    keep = np.zeros(5, bool)
    keep[catalogue] = True
    before = m.CACHE_ROWS_EVICTED.labels("item")._value.get()
    sizes = []
    for wave in range(20):  # 20 waves of 50 new ids, each later than the last
        now[0] = 1_000 * (wave + 1)
        cache.slots(TABLE_ITEM, np.arange(1_000 + 50 * wave, 1_050 + 50 * wave))
        cache.evict_items(100, keep=keep)
        sizes.append(len(cache.items.rows))
        assert cache.item_rows - 5 <= 100
    assert sizes[-1] == sizes[5]  # freed slots reused: the table stopped growing
    assert all(cache.held(TABLE_ITEM, i) is not None for i in range(5))  # the catalogue stays
    newest = np.arange(1_950, 2_000)
    assert all(cache.held(TABLE_ITEM, int(i)) is not None for i in newest)
    assert cache.held(TABLE_ITEM, 1_000) is None  # the oldest went
    assert m.CACHE_ROWS_EVICTED.labels("item")._value.get() - before == 1_000 - cache.item_rows + 5
    assert cache.evict_items(100, keep=keep) == 0  # under the bound: nothing


def test_the_device_local_step_equals_the_numpy_rules_the_parameter_server_applies():
    """The worker's slice arithmetic in torch (sums, rejection, clipping, −lr·g, applied in
    place) against the numpy rules of ``freshcore.gradients`` and ``aggregate``."""
    import torch

    from freshcore.gradients import clip_rows, finite_rows
    from inference.learning.steps import TableSlice, device_local_steps

    rng = np.random.default_rng(4)
    for _ in range(20):
        n, groups, w = int(rng.integers(1, 200)), int(rng.integers(1, 30)), 5
        index = rng.integers(0, groups, n)
        grads = (rng.standard_normal((n, w)) * rng.choice([0.1, 1.0, 5.0])).astype(np.float32)
        if rng.random() < 0.3:
            grads[rng.integers(0, n)] = np.nan
        slots = rng.permutation(40)[:groups]
        rows = torch.zeros((40, w))
        (step,) = device_local_steps(
            [
                TableSlice(
                    rows, torch.from_numpy(slots), torch.from_numpy(index), torch.from_numpy(grads)
                )
            ],
            lr=0.05,
            max_norm=1.0,
        )
        g = aggregate(index, grads)
        sums = np.zeros((groups, w), np.float32)
        sums[g.keys] = g.sums
        ok = finite_rows(sums)
        expected = clip_rows(sums[ok], 1.0)
        np.testing.assert_array_equal(step.ok, ok)
        np.testing.assert_allclose(step.sums, expected, rtol=1e-6, atol=1e-7)
        np.testing.assert_array_equal(step.deltas, (-0.05 * torch.from_numpy(step.sums)).numpy())
        moved = np.zeros((40, w), np.float32)
        moved[slots[ok]] = step.deltas
        np.testing.assert_array_equal(rows.numpy(), moved)  # rejected rows took no step


def test_freshness_is_timed_from_the_oldest_event_each_stage_includes():
    """The outbox, the parameter server's table and the update carry each row's oldest
    event time beside its newest; the table hands it out once per persist."""
    from inference.learning.admission import AdmissionFilter
    from inference.learning.outbox import GradientOutbox
    from param_server.table import ParamTable

    for threshold in (1, 2):  # every row admitted at once, and rows held back for admission
        box = GradientOutbox(1, AdmissionFilter(threshold, 10_000), linger_ms=0)
        ones = np.ones((2, 3), np.float32)
        ids, counts, steps = np.array([5, 9]), np.array([1, 1]), np.array([0, 1])
        box.add(0, ids, ones, counts, np.array([50, 60]), steps, 0, np.array([40, 55]))
        box.add(0, ids, ones, counts, np.array([70, 58]), steps + 2, 1, np.array([45, 20]))
        (batch,) = box.drain()
        assert batch.ids.tolist() == [5, 9]
        assert batch.newest_ms.tolist() == [70, 60] and batch.oldest_ms.tolist() == [40, 20]

    cfg = AdagradConfig(lr=0.1, max_norm=1.0)
    t = ParamTable(2)
    slots = t.add(
        np.array([1, 2, 3]),
        *(np.zeros((3, 2), np.float32),) * 2,
        np.zeros(3, np.uint64),
        np.full(3, 5, np.int64),
    )
    grads = np.ones((4, 2), np.float32)
    grads[3] = np.nan  # rejected: its oldest time is not kept
    t.apply_log(
        slots[[0, 0, 1, 1]],
        grads,
        np.array([30, 40, 50, 60]),
        np.array([0, 1, 0, 1]),
        cfg,
        np.array([20, 35, 45, 10]),
    )
    assert t.take_oldest(slots).tolist() == [20, 45, 5]  # row 3: nothing new, its newest
    assert t.take_oldest(slots).tolist() == [40, 50, 5]  # taken: back to the newest


def test_the_reply_stage_counts_each_row_once_from_the_oldest_event_no_reply_used():
    import torch

    from freshcore import metrics as m
    from inference.tables.cache import EmbeddingCache

    def fetch(table, ids):
        n = len(ids)
        return np.zeros(n, bool), np.zeros((0, 5), np.float32), np.zeros(0), np.zeros(0)

    now = [100_000]
    cache = EmbeddingCache(4, 8, fetch, torch.device("cpu"), clock=lambda: now[0])
    users = cache.slots(TABLE_USER, np.array([11, 12]))
    hist = m.FRESHNESS_LAG.labels("reply")

    def count_and_sum():
        return hist._sum.get(), sum(b.get() for b in hist._buckets)

    cache.learnt(TABLE_USER, users, np.array([97_000, 99_000]), np.array([98_000, 99_500]))
    cache.learnt(TABLE_USER, users[:1], np.array([98_500]), np.array([99_900]))
    s0, n0 = count_and_sum()
    cache.observe_reply(users[:1], np.empty(0, np.int64))
    s1, n1 = count_and_sum()
    assert n1 - n0 == 1 and abs((s1 - s0) - 3.0) < 1e-9  # from 97,000, the oldest
    cache.observe_reply(users, np.empty(0, np.int64))  # the first reply to use user 12
    s2, n2 = count_and_sum()
    assert n2 - n1 == 1 and abs((s2 - s1) - 1.0) < 1e-9
    cache.observe_reply(users, np.empty(0, np.int64))  # nothing new in either row
    assert count_and_sum()[1] == n2
    # a broadcast row: events this worker learnt itself are not counted again; events
    # newer than its own are, from the first of them
    cache.installed(TABLE_USER, users, np.array([97_000, 99_000]), np.array([99_900, 99_700]))
    cache.observe_reply(users, np.empty(0, np.int64))
    s3, n3 = count_and_sum()
    assert n3 - n2 == 1 and abs((s3 - s2) - (100_000 - 99_501) / 1000) < 1e-9


def test_an_update_batch_of_another_width_or_of_non_finite_rows_is_skipped_not_installed():
    """Every worker reads every embeddings.updates partition: one well-formed batch of another
    dimension must not crash them all, and NaN rows must not reach the table."""
    import torch

    from freshcore import metrics as m
    from inference.learning.pending import PendingSteps
    from inference.learning.updates import UpdateInstaller
    from inference.tables.cache import EmbeddingCache
    from schemas.rowbatch import KIND_UPDATES, TABLE_ITEM, RowBatch

    dim = 4
    cache = EmbeddingCache(dim, 8, lambda table, ids: {}, torch.device("cpu"))
    cache.load_items({i: (np.zeros(dim + 1, np.float32), 1, 0) for i in (11, 12, 13)})
    installer = UpdateInstaller(cache, PendingSteps(64, dim + 1), producer=None)

    def batch(rows: np.ndarray) -> bytes:
        n = len(rows)
        ids = np.array([11, 12, 13][:n], np.uint64)
        return RowBatch(
            KIND_UPDATES,
            TABLE_ITEM,
            ids,
            rows,
            np.full(n, 5, np.uint64),
            np.full(n, 1000, np.int64),
        ).encode()

    def count(outcome: str) -> float:
        return m.UPDATES_INSTALLED.labels("item", outcome)._value.get()

    wide, bad, ok = count("wrong_width"), count("non_finite"), count("installed")
    installer.on_update(batch(np.ones((3, 7), np.float32)))
    assert count("wrong_width") == wide + 3
    rows = np.ones((3, dim + 1), np.float32)
    rows[1, 2] = np.nan
    installer.on_update(batch(rows))
    assert count("non_finite") == bad + 1 and count("installed") == ok + 2
    held = cache.rows(TABLE_ITEM, cache.slots(TABLE_ITEM, np.array([11, 12, 13])))
    assert torch.isfinite(held).all()
    assert held[0].tolist() == [1.0] * (dim + 1) and held[1].tolist() == [0.0] * (dim + 1)
