"""Pure logic of online learning: labels, gradients, Adagrad, LRU, rows, read-your-writes."""

from __future__ import annotations

import random

import numpy as np
import pytest

from inference.learning import LabelConfig, aggregate, examples_from_events, logistic_gradients
from inference.lru import SlotLRU
from inference.pending import PendingSteps
from param_server.adagrad import AdagradConfig, adagrad_step, clip_rows
from param_server.rows import TABLE_ITEM, TABLE_USER, decode_row, encode_row, initial_rows
from schemas.records import Event

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
        ("i1", 1.0, 1.0), ("i2", 0.0, 1.0), ("i3", 1.0, 3.0),
    ]  # fmt: skip


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
    """The sort-and-reduceat grouping gives what ``np.add.at`` and ``np.maximum.at`` give
    (sums to float64 round-off, in the rows' dtype), on random keys with repeats."""
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
        np.testing.assert_allclose(g.sums, sums.astype(np.float32), rtol=1e-6, atol=1e-6)
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


@pytest.mark.parametrize("stepless_installs", ["recorded", "skipped"])
def test_read_your_writes_bookkeeping_is_exact_under_any_interleaving(stepless_installs):
    """Model: the global row is the sum of the deltas of applied messages. Whatever the order
    of local steps, deliveries and installs, serving = global + pending = all local steps.
    The worker calls ``on_install`` only for rows ``among`` those with steps ("skipped");
    calling it for every row ("recorded") must give the same."""
    for seed in range(200):
        rng = random.Random(seed)
        p = PendingSteps()
        row = ("user", 1)
        total = 0.0
        log: list[tuple[int, float]] = []  # (offset, delta) as the partition receives them
        serving = 0.0
        sent: list[tuple[int, float]] = []  # (token, delta) sent, not yet delivered
        tokens = iter(range(1, 10_000))
        delivered_offsets: list[int] = []
        last_install = 0
        late: list[tuple[int, int]] = []
        for _ in range(rng.randint(1, 40)):
            action = rng.random()
            if action < 0.4:
                d = rng.uniform(-1, 1)
                token = next(tokens)
                p.record(row, np.array([d]), token)
                serving += d
                total += d
                sent.append((token, d))
            elif action < 0.7 and sent:
                token, d = sent.pop(0)  # Kafka keeps order within a partition
                offset = len(log)
                log.append((offset, d))
                delivered_offsets.append(offset)
                late.append((token, offset))
            if late and rng.random() < 0.5:  # delivery reports come later, in order
                token, offset = late.pop(0)
                for _, delta in p.delivered(token, 0, offset):
                    serving -= float(delta[0])
            elif log and len(log) - 1 >= last_install:
                # the worker waits for outstanding delivery reports before it installs
                while late:
                    token, offset = late.pop(0)
                    for _, delta in p.delivered(token, 0, offset):
                        serving -= float(delta[0])
                # and installs only newer versions: installs move forward
                upto = last_install = rng.randint(last_install, len(log) - 1)
                global_row = sum(d for o, d in log if o <= upto)
                if stepless_installs == "skipped" and not p.among("user", [1]):
                    serving = global_row
                else:
                    rest = p.on_install(row, 0, upto)
                    serving = global_row + (float(rest[0]) if rest is not None else 0.0)
            assert serving == pytest.approx(total, abs=1e-9), seed


def test_steps_included_before_their_delivery_report_are_dropped_on_the_report():
    p = PendingSteps()
    p.record(("user", 1), np.array([1.0]), token=1)
    assert p.on_install(("user", 1), 0, 10).tolist() == [1.0]  # offset unknown yet: kept
    assert [d.tolist() for _, d in p.delivered(1, 0, 10)] == [[1.0]]  # it was included
    assert len(p) == 0


def test_parameter_table_applies_a_log_at_once_exactly_as_message_by_message():
    from param_server.table import ParamTable

    cfg = AdagradConfig(lr=0.1, max_norm=1.0)
    rng = np.random.default_rng(0)
    for _ in range(200):
        w, n_rows = 4, int(rng.integers(1, 30))
        one_by_one, at_once = ParamTable(w, 2), ParamTable(w, 2)  # tiny: forces growth
        start = rng.standard_normal((n_rows, w)).astype(np.float32)
        for t in (one_by_one, at_once):
            t.add(np.arange(n_rows) * 7, start, np.zeros((n_rows, w), np.float32),
                  np.zeros(n_rows, np.uint64), np.zeros(n_rows, np.int64))  # fmt: skip
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
        at_once.apply_log(*(np.concatenate(parts) for parts in zip(*messages, strict=True)),
                          seq, cfg)  # fmt: skip
        for field in ("rows", "accum", "version", "event_ms"):
            assert np.array_equal(getattr(one_by_one, field)[:n_rows],
                                  getattr(at_once, field)[:n_rows]), field  # fmt: skip
        assert np.isfinite(at_once.rows[:n_rows]).all()


def test_packed_redis_commands_equal_redis_py_packing():
    from redis.connection import PythonRespSerializer

    from freshrec.resp import pack, pack_fixed
    from param_server.rows import encode_rows, encode_rows_matrix, key_matrix, row_key

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
    from param_server.rows import updates_since_creation, version_floor

    first = int(version_floor(np.array([1_767_225_600_000]))[0])
    old_life = first + 500_000  # half a million updates within the first second
    again = int(version_floor(np.array([1_767_225_601_000]))[0])  # re-created a second later
    assert again > old_life and int(updates_since_creation(again + 3)) == 3


def test_admission_filter_forgets_rows_unseen_for_a_window():
    from inference.admission import AdmissionFilter

    f = AdmissionFilter(threshold=3, window_ms=100)
    assert [f.touch("a", t) for t in (0, 1, 2, 3)] == [False, False, True, True]
    f.touch("b", 50)
    assert f.rotate(99) == [] and f.rotate(100) == []  # a and b move to the older generation
    f.touch("a", 150)  # seen again: kept, still admitted
    assert sorted(f.rotate(200)) == ["b"] and len(f) == 1 and f.touch("a", 210)
    assert AdmissionFilter(1, 100).touch("x", 0) and len(AdmissionFilter(1, 100)) == 0
    with pytest.raises(ValueError):
        AdmissionFilter(0, 100)


def test_record_many_books_steps_as_record_does():
    deltas = np.arange(6.0).reshape(3, 2)
    one, many = PendingSteps(), PendingSteps()
    for i, d in zip([5, 6, 5], deltas, strict=True):
        one.record(("user", i), d, token=9)
    many.record_many("user", [5, 6, 5], deltas, token=9)
    assert len(one) == len(many) == 3 and one.rows() == many.rows() == 2
    assert one.delivered(9, 0, 4) == many.delivered(9, 0, 4) == []
    for i in (5, 6):
        a, b = one.on_install(("user", i), 0, 3), many.on_install(("user", i), 0, 3)
        np.testing.assert_array_equal(a, b)


def test_steps_recorded_unsent_then_assigned_in_bulk_book_as_one_by_one():
    deltas = np.arange(6.0).reshape(3, 2)
    one, many = PendingSteps(), PendingSteps()
    for i, d in zip([5, 6, 5], deltas, strict=True):
        one.record(("user", i), d, token=None)
    many.record_many("user", [5, 6, 5], deltas, token=None)
    assert not many.has_undelivered(("user", 5))  # not sent: nothing to wait for
    for i in (5, 6):
        one.assign(("user", i), 3)
    many.assign_many("user", [5, 6], 3)
    assert many.has_undelivered(("user", 5))
    assert one.delivered(3, 0, 9) == many.delivered(3, 0, 9) == []
    for i in (5, 6):
        a, b = one.on_install(("user", i), 0, 8), many.on_install(("user", i), 0, 8)
        np.testing.assert_array_equal(a, b)  # offset 9 not covered: the steps remain
    assert many.on_install(("user", 5), 0, 9) is None and len(many) == 1


def test_read_your_writes_bookkeeping_forgets_a_message_with_its_last_step():
    """Random steps on several rows (sent at once or later in bulk), deliveries, installs,
    evictions and failed sends: after every operation each message's count of open steps
    equals the steps that carry it, and a message none carries is forgotten (its rows and
    offset), so the bookkeeping neither leaks nor forgets too early."""

    def check(p: PendingSteps) -> None:
        carried: dict[int, int] = {}
        for steps in p._steps.values():
            for token, _ in steps:
                if token is not None and token >= 0:
                    carried[token] = carried.get(token, 0) + 1
        assert p._open == carried
        assert set(p._rows_of) <= set(carried) and set(p._delivered) <= set(carried)
        assert len(p) == sum(len(s) for s in p._steps.values())
        # the unsent index holds exactly the steps without a message, as the same objects
        for row, steps in p._steps.items():
            unsent = [id(s) for s in steps if s[0] is None]
            assert [id(s) for s in p._unsent.get(row, [])] == unsent, row
        assert not [row for row, steps in p._unsent.items() if not steps or row not in p._steps]

    for seed in range(100):
        rng = random.Random(seed)
        p = PendingSteps()
        tokens = iter(range(1, 10_000))
        unsent: list[int] = []
        sent: list[int] = []
        offset = 0
        for _ in range(rng.randint(1, 60)):
            action = rng.random()
            ids = rng.sample(range(6), rng.randint(1, 4))
            if action < 0.25:
                token = next(tokens)
                p.record_many("user", ids, np.ones((len(ids), 1)), token)
                sent.append(token)
            elif action < 0.4:
                p.record_many("user", ids, np.ones((len(ids), 1)), None)
                unsent += ids
            elif action < 0.45:  # held back one by one (admission), named one by one
                p.record(("user", ids[0]), np.ones(1), None)
                if rng.random() < 0.5:
                    token = next(tokens)
                    p.assign(("user", ids[0]), token)
                    sent.append(token)
                    unsent = [i for i in unsent if i != ids[0]]
                else:
                    unsent.append(ids[0])
            elif action < 0.5 and unsent:
                token = next(tokens)
                p.assign_many("user", sorted(set(unsent)), token)
                unsent.clear()
                sent.append(token)
            elif action < 0.7 and sent:
                token = sent.pop(0)
                if rng.random() < 0.1:
                    p.failed(token)
                else:
                    p.delivered(token, 0, offset)
                    offset += 1
            elif action < 0.9:
                for i in ids:
                    p.on_install(("user", i), 0, rng.randint(0, offset))
            else:
                p.forget_row(("user", ids[0]))
                unsent = [i for i in unsent if i != ids[0]]
            check(p)


def test_item_rows_that_fail_to_load_get_no_slot_and_load_on_the_retry():
    import torch

    from inference.cache import EmbeddingCache

    stored = {11: (np.full(5, 0.5, np.float32), 7, 123)}
    outage = [True]

    def fetch(table, ids):
        if outage[0]:
            outage[0] = False
            raise ConnectionError("injected outage")
        hits = [stored[i] for i in ids if i in stored]
        return (np.array([i in stored for i in ids]), np.array([h[0] for h in hits]).reshape(-1, 5),
                np.array([h[1] for h in hits], np.uint64), np.array([h[2] for h in hits]))  # fmt: skip

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
