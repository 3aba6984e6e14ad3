"""Pure logic of the streams app: forward decay, hot scores, top-K merge, dedupe, item state."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from freshcore.dedupe import DedupeWindow
from freshcore.hotscore import (
    HotEntry,
    HotList,
    HotWeights,
    Smoothing,
    merge_hot_lists,
    merge_published,
    price_norm,
    top_k_indices,
)
from freshcore.partitioner import kafka_partition, key_partitions
from streams.decay import HOUR_MS, ForwardDecay
from streams.item_state import CLICK, CONVERSION, IMPRESSION, ItemPartitionState, StateConfig

T0 = 1_767_225_600_000


def naive(events: list[float], t: float, rate: float) -> float:
    return sum(rate ** ((t - e) / HOUR_MS) for e in events)


def test_forward_decay_matches_naive_decay_out_of_order():
    rng = random.Random(1)
    d = ForwardDecay(0.95, landmark_ms=T0)
    times = [T0 + rng.randint(0, 48 * HOUR_MS) for _ in range(500)]
    rng.shuffle(times)  # order does not matter
    stored = sum(d.weight(t) for t in times)
    for t in (max(times), max(times) + 5 * HOUR_MS, max(times) + 1000 * HOUR_MS):
        exact = naive(times, t, 0.95)
        assert abs(d.value_at(stored, t) - exact) / exact < 1e-9


def test_landmark_renormalisation_keeps_values_and_bounds_growth():
    d = ForwardDecay(0.95, landmark_ms=T0, renormalise_above=1e6)
    counts = np.zeros(3)
    times, t = [], T0
    for step in range(4000):
        t = T0 + step * HOUR_MS // 4  # 1000 hours: g would reach ~1e22 without moving L
        if d.needs_renormalising(t):
            d.renormalise(t, counts)
        counts[step % 3] += d.weight(t)
        times.append(t)
        assert d.weight(t) <= 1e6 * 1.02
    assert d.landmark_ms > T0
    for k in range(3):
        exact = naive(times[k::3], t, 0.95)
        assert abs(d.value_at(counts[k], t) - exact) / exact < 1e-9


def test_decay_rate_is_validated():
    with pytest.raises(ValueError):
        ForwardDecay(1.5)


@pytest.mark.parametrize(
    ("weights", "winner"),
    [
        (HotWeights(1.0, 0.0, 0.0), "clicky"),
        (HotWeights(0.0, 1.0, 0.0), "converting"),
        (HotWeights(0.0, 0.0, 1.0), "pricey"),
    ],
)
def test_each_weight_of_the_hot_formula_moves_the_ranking(weights, winner):
    lists = [
        HotList(
            T0,
            [
                HotEntry("clicky", 10, 0.05, 0.1),
                HotEntry("converting", 1, 0.9, 0.1),
                HotEntry("pricey", 1, 0.05, 0.9),
            ],
        )
    ]
    (best, score), *_ = merge_hot_lists(lists, 3, weights, 0.95)
    assert best.item_id == winner
    e = best
    assert score == pytest.approx(
        weights.click * e.clicks + weights.cvr * e.cvr + weights.price * e.price_norm
    )


def test_price_normalisation_cannot_drown_the_other_terms():
    assert price_norm(np.array([0.0, 1e9]), cap=1000).tolist() == [0.0, 1.0]


def test_top_k_breaks_ties_by_name_and_keeps_all_ties_in_play():
    scores = np.array([1.0, 3.0, 3.0, 2.0, 3.0])
    names = np.array(["e", "d", "c", "b", "a"], dtype=object)
    assert top_k_indices(scores, 2, names).tolist() == [4, 2]
    assert top_k_indices(scores, 10).tolist() == [1, 2, 4, 3, 0]


def test_merged_partition_lists_equal_the_top_k_over_all_items():
    rng = np.random.default_rng(3)
    w = HotWeights()
    n, parts, k = 600, 4, 25
    clicks, cvr, pn = rng.gamma(2, 5, n), rng.random(n), rng.random(n)
    ids = np.array([f"i{i}" for i in range(n)], dtype=object)
    owner = rng.integers(0, parts, n)
    lists = []
    for p in range(parts):
        mine = np.flatnonzero(owner == p)
        s = w.click * clicks[mine] + w.cvr * cvr[mine] + w.price * pn[mine]
        best = mine[top_k_indices(s, k, ids[mine])]
        lists.append(HotList(T0, [HotEntry(ids[i], clicks[i], cvr[i], pn[i]) for i in best], p))
    merged = [e.item_id for e, _ in merge_hot_lists(lists, k, w, 0.95)]
    brute = top_k_indices(w.click * clicks + w.cvr * cvr + w.price * pn, k, ids)
    assert merged == [ids[i] for i in brute]


def test_merge_brings_lists_of_different_ages_to_one_time():
    old = HotList(T0, [HotEntry("a", 10.0, 0, 0)])
    new = HotList(T0 + HOUR_MS, [HotEntry("b", 9.6, 0, 0)])
    (first, _s1), (second, s2) = merge_hot_lists([old, new], 2, HotWeights(1, 0, 0), 0.95)
    assert (first.item_id, second.item_id) == ("b", "a")
    assert s2 == pytest.approx(9.5)


def test_the_worker_merge_of_published_json_equals_the_merge_of_hot_lists():
    """The worker merges the published JSON (``merge_published``); the streams app's tests and
    tools merge ``HotList`` objects: both must give the same top-K in the same order."""
    rng = np.random.default_rng(5)
    for _ in range(20):
        lists = [
            HotList(
                T0 + int(rng.integers(0, 5 * HOUR_MS)),
                [
                    HotEntry(
                        f"i{p}-{j}",
                        float(rng.gamma(2, 5)),
                        float(rng.random()),
                        float(rng.random()),
                    )
                    for j in range(int(rng.integers(0, 30)))
                ],
                p,
            )
            for p in range(4)
        ]
        w = HotWeights(*rng.random(3))
        k = int(rng.integers(1, 60))
        objects = [e.item_id for e, _ in merge_hot_lists(lists, k, w, 0.9)]
        published = merge_published([h.to_json() for h in lists], k, w, 0.9)
        assert objects == published


def test_dedupe_window_is_bounded_and_forgets_the_oldest():
    w = DedupeWindow(3)
    assert [w.first_time(x) for x in "abcab"] == [True, True, True, False, False]
    w.first_time("d")
    assert len(w) == 3 and w.first_time("a")


def test_dedupe_window_batch_form_is_first_time_in_turn():
    """Each id against the window and the ids before it in the list; the oldest are
    evicted after the list (the window never forgets sooner than ``first_time``)."""
    rng = random.Random(4)
    window, model = DedupeWindow(50), []
    for _ in range(60):
        ids = [f"e{rng.randrange(150)}" for _ in range(rng.randrange(1, 40))]
        want = []
        for i in ids:
            want.append(i not in model)
            model += [i] if want[-1] else []
        model = model[-50:]
        assert window.first_times(ids) == want
        assert len(window) == len(model)


def test_vectorised_murmur2_places_keys_of_every_length_as_kafka_does():
    rng = random.Random(5)
    keys = [bytes(rng.randrange(256) for _ in range(rng.randrange(40))) for _ in range(3000)]
    assert key_partitions(keys, 13).tolist() == [kafka_partition(k, 13) for k in keys]


def make_state(**over) -> ItemPartitionState:
    return ItemPartitionState(StateConfig(**over))


def test_item_state_counts_decay_and_per_region_scopes():
    s = make_state()
    s.apply(
        [
            (0, 0, "i1", IMPRESSION, T0, "north", 0),
            (0, 1, "i1", CLICK, T0, "north", 0),
            (0, 2, "i1", CLICK, T0 + HOUR_MS, "south", 0),
            (0, 3, "i2", CONVERSION, T0 + HOUR_MS, None, 5),
        ]
    )
    dec = s.decayed(T0 + HOUR_MS)
    i1 = s.slots["i1"]
    assert dec[i1, 0, CLICK] == pytest.approx(0.95 + 1.0)
    assert dec[i1, s.scopes["north"], CLICK] == pytest.approx(0.95)
    assert dec[i1, s.scopes["south"], CLICK] == pytest.approx(1.0)
    assert dec[s.slots["i2"], 0, CONVERSION] == pytest.approx(1.0)


def test_item_state_skips_replayed_source_offsets_exactly():
    s = make_state()
    batch = [(1, o, "i1", CLICK, T0, None, 0) for o in range(10)]
    assert s.apply(batch) == 10
    assert s.apply([*batch[5:], (1, 10, "i1", CLICK, T0, None, 0)]) == 1
    assert s.skipped == 5
    assert s.decayed(T0)[0, 0, CLICK] == pytest.approx(11)


def test_a_region_named_like_the_global_scope_counts_once():
    s = make_state()
    s.apply([(0, 0, "i1", CLICK, T0, "global", 0)])
    assert list(s.scopes) == ["global"] and s.decayed(T0)[0, 0, CLICK] == pytest.approx(1.0)


def test_late_events_beyond_grace_are_counted_and_dropped():
    s = make_state(late_grace_ms=60_000)
    s.apply(
        [
            (0, 0, "i1", CLICK, T0 + 120_000, None, 0),
            (0, 1, "i1", CLICK, T0 + 70_000, None, 0),
            (0, 2, "i1", CLICK, T0, None, 0),
        ]
    )
    assert s.late == 1
    assert s.decayed(T0 + 120_000)[0, 0, CLICK] == pytest.approx(1 + 0.95 ** (50_000 / HOUR_MS))


def test_item_state_snapshot_round_trip_is_exact():
    s = make_state()
    rng = random.Random(2)
    s.apply(
        [
            (
                rng.randint(0, 3),
                o,
                f"i{rng.randint(0, 50)}",
                rng.randint(0, 2),
                T0 + o * 1000,
                rng.choice(["north", "south", None]),
                0,
            )
            for o in range(2000)
        ]
    )
    s.set_prices({"i1": 9.5})
    back = ItemPartitionState.restore(
        s.config, s.snapshot_meta(), s.snapshot_rows(list(range(s.n_items)))
    )
    assert back.applied == s.applied and back.watermark_ms == s.watermark_ms
    for item, slot in s.slots.items():
        np.testing.assert_array_equal(back.counts[back.slots[item]], s.counts[slot])
    assert back.price[back.slots["i1"]] == 9.5
    a = s.hot_lists(10, 0, 0)["global"].entries
    b = back.hot_lists(10, 0, 0)["global"].entries
    assert a == b


def test_ctr_and_cvr_are_smoothed_towards_priors():
    s = make_state()
    s.apply([(0, 0, "i1", CLICK, T0, None, 0)])
    ctr, cvr = s.rates(s.decayed(T0))
    sm = Smoothing()
    assert ctr[0, 0] == pytest.approx((1 + sm.ctr_strength * sm.ctr_prior) / sm.ctr_strength)
    assert 0 < cvr[0, 0] < 1 and math.isfinite(cvr[0, 0])


def _families(text: str):
    """Metric families parsed from exposition text (what a registry's collect yields)."""
    from prometheus_client.parser import text_string_to_metric_families

    return list(text_string_to_metric_families(text))


def test_child_metrics_merge_sums_counters_and_histograms_and_keeps_parent_gauges():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.exposition import generate_latest

    from freshcore.childmetrics import MergedRegistry, merge_families, snapshot

    def registry():
        reg = CollectorRegistry()
        c = Counter("freshrec_t_events_total", "e", ["outcome"], registry=reg)
        h = Histogram("freshrec_t_seconds", "s", ["stage"], buckets=(0.1, 1.0), registry=reg)
        g = Gauge("freshrec_t_lag", "l", ["group"], registry=reg)
        return reg, c, h, g

    parent, pc, ph, pg = registry()
    child, cc, ch, cg = registry()
    pc.labels("valid").inc(3)
    cc.labels("valid").inc(4)
    cc.labels("rejected").inc(1)
    ph.labels("count").observe(0.5)
    ch.labels("validate").observe(0.05)
    ch.labels("validate").observe(2.0)
    pg.labels("a").set(7)
    cg.labels("a").set(100)  # the parent's own gauge wins
    cg.labels("b").set(5)  # a gauge only the child has is shown
    Counter("other_total", "not ours", registry=child).inc()

    merged = MergedRegistry(parent)
    merged.children["validate"] = snapshot(child)
    assert all(f.name.startswith("freshrec_") for f in merged.children["validate"])
    text = generate_latest(merged).decode()
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in _families(text)
        for s in f.samples
    }
    assert got[("freshrec_t_events_total", (("outcome", "valid"),))] == 7
    assert got[("freshrec_t_events_total", (("outcome", "rejected"),))] == 1
    assert got[("freshrec_t_seconds_count", (("stage", "validate"),))] == 2
    assert got[("freshrec_t_seconds_bucket", (("le", "0.1"), ("stage", "validate")))] == 1
    assert got[("freshrec_t_seconds_sum", (("stage", "count"),))] == 0.5
    assert got[("freshrec_t_lag", (("group", "a"),))] == 7
    assert got[("freshrec_t_lag", (("group", "b"),))] == 5
    assert "other_total" not in text
    # /metrics?name[]=… (prometheus_client asks the registry for a restricted one)
    only = generate_latest(merged.restricted_registry(["freshrec_t_events_total"])).decode()
    assert 'freshrec_t_events_total{outcome="valid"} 7.0' in only
    assert "freshrec_t_seconds" not in only and "freshrec_t_lag" not in only
    # each label set's histogram samples stay together (the text format requires it)
    stages = [
        s.labels["stage"]
        for f in merge_families(parent.collect(), [snapshot(child)])
        if f.name == "freshrec_t_seconds"
        for s in f.samples
    ]
    assert stages == sorted(stages, key=stages.index)  # no label set interleaved with another
    assert len(set(stages)) == 2
    # a counter's _created is the earlier of the two, not a sum
    created = [
        s.value
        for f in merge_families(parent.collect(), [snapshot(child)])
        for s in f.samples
        if s.name == "freshrec_t_events_created" and s.labels["outcome"] == "valid"
    ]
    assert len(created) == 1 and created[0] < 2e9


def test_features_are_due_once_persisted_and_all_of_them_after_a_restore():
    """The serving features follow the persisted state: an item becomes due when its row is
    taken for persisting, once however many batches touched it; a restored partition has
    every item due (a crash may have come between the transaction and the features)."""
    s = make_state()
    s.apply([(0, o, f"i{o % 3}", 1, T0 + o, None, 0) for o in range(6)])
    assert s.take_features_due() == []  # counted, not persisted yet
    persisted = s.take_touched()
    s.apply([(0, 6, "i0", 1, T0 + 6, None, 0)])
    persisted += s.take_touched()
    assert sorted(persisted) == [0, 0, 1, 2]
    assert s.take_features_due() == [0, 1, 2]
    assert s.take_features_due() == []
    back = ItemPartitionState.restore(
        s.config, s.snapshot_meta(), s.snapshot_rows(list(range(s.n_items)))
    )
    assert back.take_features_due() == [0, 1, 2] and back.take_touched() == []


def test_ragged_packing_equals_redis_py_packing_for_ids_of_any_length():
    from redis.connection import PythonRespSerializer

    from freshcore.resp import Fields, pack_ragged

    rng = random.Random(5)
    ids = [
        f"i{rng.randint(0, 10 ** rng.randint(0, 12))}".encode() + b"\xc3\xa9" * rng.randint(0, 2)
        for _ in range(300)
    ]
    values = np.frombuffer(bytes(rng.randrange(256) for _ in range(300 * 7)), np.uint8)
    values = values.reshape(300, 7)
    # the same pairs, grouped by field length (stable): a hash does not tell the orders apart
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    args = [x for i in order for x in (ids[i], values[i].tobytes())]
    reference = b"".join(PythonRespSerializer(10**9, lambda a: a).pack(b"HSET", b"key", *args))
    assert pack_ragged(b"HSET", b"key", Fields(ids), values) == reference
    assert (
        pack_ragged(b"HSET", b"key", Fields([]), values[:0]) == b"*2\r\n$4\r\nHSET\r\n$3\r\nkey\r\n"
    )
    with pytest.raises(ValueError, match="expected"):
        pack_ragged(b"HSET", b"key", Fields(ids[:2]), values)


def test_fixed_width_float_text_reads_back_within_float64_precision():
    from freshcore.resp import FLOAT_TEXT_WIDTH, float_text

    rng = np.random.default_rng(3)
    x = rng.standard_normal(20_000) * 10.0 ** rng.integers(-290, 290, 20_000)
    edges = [
        0.0,
        -0.0,
        1e-301,
        1.0,
        10.0,
        1e-3,
        0.1,
        9.999999999999999,
        0.9999999999999999,
        999999999999999.9,
        123456.789,
        5e-300,
        9.9e299,
    ]
    x = np.concatenate([x, edges, np.negative(edges)])
    text = float_text(x)
    assert text.shape == (len(x), FLOAT_TEXT_WIDTH)
    back = np.array([float(bytes(row)) for row in text])
    tiny = np.abs(x) < 1e-300
    assert (back[tiny] == 0).all()
    rel = np.abs(back - x)[~tiny] / np.abs(x[~tiny])
    assert rel.max() < 1e-14
    assert float(bytes(float_text([123456.789])[0])) == 123456.789
    with pytest.raises(ValueError, match="finite"):
        float_text([1.0, np.inf])
    with pytest.raises(ValueError, match="finite"):
        float_text([np.nan])


def _state_fields(s: ItemPartitionState):
    return (
        s.item_ids,
        s.slots,
        dict(s.scopes),
        s.applied,
        s.watermark_ms,
        s.late,
        s.skipped,
        s.touched,
        s.new_slots,
        s.decay.landmark_ms,
        s.counts[: s.n_items].tobytes(),
        s.sources.newest_ms,
        s.sources.delivered_ms,
    )


@pytest.mark.parametrize("seed", range(12))
def test_vectorised_apply_is_bit_for_bit_the_event_by_event_rule(seed):
    """Batches with replays (whole and partial), late events, out-of-order times, source
    partitions that lag, one that never delivers and goes idle, new items, new regions past
    ``max_regions``, falling offsets and a landmark move: ``apply`` leaves exactly the state
    ``_apply_each`` leaves."""
    rng = random.Random(seed)
    config = dict(late_grace_ms=60_000, max_regions=3, source_partitions=5, watermark_idle_ms=9000)
    fast, slow = make_state(**config), make_state(**config)
    offsets = dict.fromkeys(range(4), 0)
    lag = dict.fromkeys(range(4), 0)  # how far behind in event time each source partition reads
    t = T0
    now = 0  # processing time
    log: list = []
    each = fast._apply_each
    fallbacks = []
    fast._apply_each = lambda events, now_ms: fallbacks.append(len(events)) or each(events, now_ms)
    for _ in range(40):
        batch = []
        now += rng.choice([0, 100, 3000, 20_000])
        if rng.random() < 0.2:
            lag[rng.randrange(4)] = rng.choice([0, 0, 1800_000])
        for _ in range(rng.choice([1, 5, 40, 300])):
            part = rng.randrange(4)
            offsets[part] += rng.choice([1, 1, 2])
            t += (
                rng.choice([0, 1000, 30_000])
                if rng.random() < 0.97
                else -rng.choice([50_000, 90_000])
            )
            batch.append(
                (
                    part,
                    offsets[part],
                    f"i{rng.randrange(200)}",
                    rng.randrange(3),
                    t - lag[part],
                    rng.choice([None, "global", "north", "south", "east", "west", "up"]),
                    0.0,
                )
            )
        roll = rng.random()
        if roll < 0.15 and log:
            batch = rng.choice(log)  # a replayed message
        elif roll < 0.25 and log:
            batch = rng.choice(log)[len(batch) // 2 :] + batch  # a partly replayed one
        elif roll < 0.3:
            batch = batch[::-1]  # offsets fall: the event-by-event path
        elif roll < 0.33:
            t += 40 * 24 * HOUR_MS  # g grows past the renormalisation bound
            batch.append((0, offsets[0] + 1, "i1", CLICK, t, "north", 0.0))
            offsets[0] += 1
        log.append(batch)
        assert fast.apply(batch, now) == slow._apply_each(list(batch), now)
        assert _state_fields(fast) == _state_fields(slow)
    assert fast.n_items > 50 and fast.late > 0 and fast.skipped > 0 and len(fast.scopes) == 4
    big = sum(len(b) >= 16 for b in log)
    assert big - sum(n >= 16 for n in fallbacks) >= big // 2  # most took the vectorised path


def test_the_last_record_of_an_item_in_a_batch_decides_set_or_delete():
    from streams.catalogue_log import final_ops

    sets, deleted = final_ops(
        [("i1", "v1"), ("i2", "v2"), ("i1", None), ("i3", None), ("i3", "v3"), ("i2", "v2b")]
    )
    assert sets == {"i3": "v3", "i2": "v2b"} and deleted == ["i1"]
    assert final_ops([]) == ({}, [])


def test_a_tombstone_needs_an_item_id_as_its_key():
    from schemas.contract import Reason, Rejected
    from streams.catalogue_log import MAX_ITEM_ID, tombstone_item_id

    assert tombstone_item_id("i-ü".encode()) == "i-ü"
    assert tombstone_item_id(b"x" * MAX_ITEM_ID) == "x" * MAX_ITEM_ID
    for key, reason in [
        (None, Reason.EMPTY_ID),
        (b"", Reason.EMPTY_ID),
        (b"\xff\xfe", Reason.INVALID_VALUE),
        (b"x" * (MAX_ITEM_ID + 1), Reason.ID_TOO_LONG),
    ]:
        with pytest.raises(Rejected) as exc:
            tombstone_item_id(key)
        assert exc.value.reason == reason


def test_a_batch_of_valid_events_never_makes_a_record_the_broker_refuses():
    """5,000 valid events naming one item id of 64 emoji made one 2 MB events.by_item
    record: the broker refused it and the stage crash-looped on the same batch. Records are
    split under MAX_RECORD_BYTES, in order, and together hold every event."""
    import orjson

    from schemas.records import Event
    from streams.byitem import MAX_RECORD_BYTES
    from streams.item_state import by_item_columns
    from streams.validate import ValidateStage

    item = "\N{GRINNING FACE}" * 64
    events = [Event(f"e{n}", "click", f"u{n}", item, 1_767_225_600_000 + n) for n in range(5000)]
    produced: list[tuple[bytes, int]] = []
    stage = object.__new__(ValidateStage)  # _route alone: no broker, no Redis
    stage.by_item_partitions = 4
    stage.names = type("Names", (), {"events_by_item": "t.events.by_item"})()
    stage._produce = lambda topic, value, partition: produced.append((value, partition))
    stage._route([0] * 5000, list(range(5000)), events)
    assert len(produced) > 1 and all(len(v) <= MAX_RECORD_BYTES for v, _ in produced)
    assert len({p for _, p in produced}) == 1
    offsets = [o for v, _ in produced for o in by_item_columns(orjson.loads(v))[1]]
    assert offsets == list(range(5000))


def test_co_visitation_pairs_equal_brute_force_and_a_replayed_record_counts_once():
    """The validate stage's windows give the pairs a brute-force pass gives (a window
    seeded from the user's recent clicks gives the same later pairs), and the count stage
    counts a record's pairs once however often it arrives."""
    import random

    from schemas.records import Event
    from streams.covisit import UserWindows
    from streams.item_state import ItemPartitionState, StateConfig
    from tests.streams_harness import brute_force_covisit

    rng = random.Random(5)
    events = [
        Event(f"e{j}", "click", f"u{rng.randint(0, 5)}", f"i{rng.randint(0, 12)}", 1_000 + j * 7)
        for j in range(400)
    ]
    windows = UserWindows(users=100, window=20, window_ms=86_400_000, max_pairs=20)
    state = ItemPartitionState(StateConfig())
    for j, e in enumerate(events):
        state.apply([(0, j, e.item_id, 1, e.ts_ms, None, 0.0)])
        near = windows.pairs(e.user_id, e.item_id, e.ts_ms)
        anchors = [x for a in near for x in (e.item_id, a)]
        neighbours = [y for a in near for y in (a, e.item_id)]
        record = (
            anchors,
            neighbours,
            [0] * len(anchors),
            [j] * len(anchors),
            [e.ts_ms] * len(anchors),
        )
        state.apply_pairs(*record)
        assert state.apply_pairs(*record) == 0  # the same record again: nothing
    want = brute_force_covisit(events, window=20, max_pairs=20)
    for a, neighbours in want.items():
        got = dict(state.covisit.top(a, 100, state.stored_clicks(a)))
        assert got.keys() == neighbours.keys()
        assert all(math.isclose(got[b], p, rel_tol=1e-9) for b, p in neighbours.items())
    # a window rebuilt from the recent clicks (newest first) pairs the next click alike
    fresh = UserWindows(users=100, window=20, window_ms=86_400_000, max_pairs=20)
    mine = [(e.item_id, e.ts_ms) for e in reversed(events) if e.user_id == "u1"]
    fresh.seed("u1", mine)
    assert fresh.pairs("u1", "i3", 10**6) == windows.pairs("u1", "i3", 10**6)


def test_sequential_rules_equal_brute_force_across_partitions_and_count_once():
    """The validate stage's pairs of an interleaved log (six users' clicks, repeats and
    re-visits among them) routed to their anchors' partitions and counted there give each
    anchor the successors and shares a brute-force pass gives, and the co-visitation counts
    riding in the same records are unchanged; a record counts once however often it
    arrives."""
    import orjson

    from freshcore.partitioner import str_partitions
    from schemas.records import Event
    from streams.covisit import PAIR_COLUMNS, PAIR_DISTANCE, CoVisitConfig
    from streams.pairing import ClickPairs
    from tests.streams_harness import brute_force_covisit, brute_force_sequel

    rng = random.Random(11)
    events = [
        Event(f"e{j}", "click", f"u{rng.randint(0, 5)}", f"i{rng.randint(0, 9)}", T0 + j * 7)
        for j in range(600)
    ]
    pairs = ClickPairs(CoVisitConfig(window=20, max_pairs=20, sequel_steps=4))
    states = [ItemPartitionState(StateConfig()) for _ in range(3)]
    for j, e in enumerate(events):
        states[int(str_partitions([e.item_id], 3)[0])].apply(
            [(0, j, e.item_id, 1, e.ts_ms, None, 0.0)]
        )
        for q, value in pairs.records([0], [j], [e], 3):
            record = orjson.loads(value)
            columns = [record[c] for c in PAIR_COLUMNS]
            assert set(str_partitions(record["ca"], 3).tolist()) == {q}  # the anchor's
            states[q].apply_pairs(*columns, distances=record[PAIR_DISTANCE])
            assert states[q].apply_pairs(*columns, distances=record[PAIR_DISTANCE]) == 0

    def state_of(a: str) -> ItemPartitionState:
        return states[int(str_partitions([a], 3)[0])]

    want = brute_force_sequel(events, steps=4)
    assert sum(len(s.sequel.counts) for s in states) == len(want) == 10
    for a, successors in want.items():
        rules = state_of(a).sequel
        got = dict(rules.top(a, 100, rules.total(a)))
        assert got.keys() == successors.keys()
        assert all(math.isclose(got[b], p, rel_tol=1e-9) for b, p in successors.items())
    for a, neighbours in brute_force_covisit(events, window=20, max_pairs=20).items():
        got = dict(state_of(a).covisit.top(a, 100, state_of(a).stored_clicks(a)))
        assert got.keys() == neighbours.keys()
        assert all(math.isclose(got[b], p, rel_tol=1e-9) for b, p in neighbours.items())
    assert sum(s.sequel_pairs for s in states) > 1000


def test_a_sequence_seeded_from_recent_clicks_follows_as_the_lost_one_did():
    """After a restart the validate stage seeds a user's sequence from their recent clicks
    (newest first, repeats included): the next click follows what it would have; and when
    the batch being replayed already wrote its clicks there (a crash between the write and
    the commit), each replayed click follows only what came before it, as the first run."""
    from freshcore.sequels import UserSequences

    rng = random.Random(3)
    clicks = [(f"i{rng.randint(0, 6)}", T0 + j) for j in range(40)]
    live = UserSequences(users=10, steps=5)
    first = [live.follows("u", item, ts) for item, ts in clicks]
    newest_first = clicks[::-1]
    seeded = UserSequences(users=10, steps=5)
    seeded.seed("u", newest_first)
    assert seeded.follows("u", "i9", T0 + 99) == live.follows("u", "i9", T0 + 99)
    replayed = UserSequences(users=10, steps=5)
    replayed.seed("u", newest_first)  # the clicks from 30 on are the batch replayed
    assert [replayed.follows("u", item, ts) for item, ts in clicks[30:]] == first[30:]
    # the least recently active user leaves (its seed with it)
    bounded = UserSequences(users=1, steps=5)
    bounded.seed("u", newest_first)
    bounded.follows("v", "i1", T0)
    assert "u" not in bounded and bounded.follows("u", "i1", T0 + 1) == []


def test_co_visitation_memory_is_bounded_and_pruning_is_deterministic():
    from streams.covisit import CoVisitCounts

    counts = [CoVisitCounts(candidates=8) for _ in range(2)]
    for c in counts:
        for j in range(200):
            c.add(["a"], [f"b{j % 37}"], [1.0 + (j % 5)])
        c.add(["z"], ["b0"], [1.0])
    assert len(counts[0].counts["a"]) <= 8
    assert counts[0].counts == counts[1].counts
    # what the gauge of neighbours held reads: every entry, through adds and prunes
    assert counts[0].entries == len(counts[0].counts["a"]) + 1
    blob = counts[0].blob("a")
    again = CoVisitCounts(candidates=8)
    again.restore({"a": blob})
    again.restore({"a": blob})  # restored twice: counted once
    assert again.counts == {"a": counts[0].counts["a"]} and again.published == {"a"}
    assert again.entries == len(again.counts["a"])
    again.rescale(0.5)
    assert again.counts["a"] == {b: v / 2 for b, v in counts[0].counts["a"].items()}
    counts[0].drop(["a", "nobody"])
    assert counts[0].entries == 1


# ------------------------------------------------------------------------------ eviction
def test_an_idle_item_leaves_the_state_and_comes_back_from_zero():
    """An item whose decayed counts fell below evict_below leaves at the next sweep (its
    Redis fields with the next flush); the others keep their counts under new slots, and the
    idle item's next event counts from zero, as its decayed counts had nearly reached."""
    s = make_state(evict_below=0.01)
    s.apply([(0, 1, "old", CLICK, T0, None, 0), (0, 2, "busy", CLICK, T0, None, 0)])
    s.apply([(0, o, "busy", CLICK, T0 + 100 * HOUR_MS, None, 0) for o in range(3, 8)])
    s.set_prices({"busy": 10.0})
    before = float(s.decayed_clicks(s.watermark_ms)[s.slots["busy"], 0])
    assert s.sweep() == 1  # 0.95^100 ≈ 0.006 of a click left of "old"
    assert s.item_ids == ["busy"] and s.slots == {"busy": 0}
    assert float(s.decayed_clicks(s.watermark_ms)[0, 0]) == before and s.price[0] == 10.0
    flush = s.begin_flush()
    assert flush.evicted == ["old"] and flush.slots == [0]
    assert s.take_evictions() == {"idle": 1, "cap": 0}
    assert s.sweep() == 0  # not due again within the hour
    s.apply([(0, 8, "old", CLICK, T0 + 100 * HOUR_MS, None, 0)])
    assert float(s.decayed_clicks(s.watermark_ms)[s.slots["old"], 0]) == pytest.approx(1.0)


def test_past_the_cap_the_least_active_items_leave_whatever_their_age():
    s = make_state(evict_below=0.0, max_items=10)
    s.apply([(0, o, f"i{o:02d}", CLICK, T0, None, 0) for o in range(20) for _ in range(o % 5 + 1)])
    s.take_touched()
    s.apply([(0, 100, "i00", CLICK, T0, None, 0)])  # touched since: leaves all the same
    activity = dict(zip(s.item_ids, s.decayed_clicks(T0)[:, 0], strict=True))
    assert s.sweep() == 11  # to nine tenths of the cap
    kept = set(s.item_ids)
    assert len(kept) == 9 and min(activity[i] for i in kept) >= max(
        activity[i] for i in activity if i not in kept
    )
    assert s.touched <= set(range(9)) and s.take_evictions()["cap"] == 11
    assert sorted(s.slots.values()) == list(range(9))


def test_an_evicted_anchor_takes_its_co_visitation_counts_with_it():
    s = make_state(evict_below=0.01)
    s.apply([(0, 1, "a", CLICK, T0, None, 0), (0, 2, "b", CLICK, T0 + 100 * HOUR_MS, None, 0)])
    s.apply_pairs(
        ["a", "b", "ghost"], ["b", "a", "b"], [0, 0, 0], [3, 3, 3], [T0 + 100 * HOUR_MS] * 3
    )
    flush = s.begin_flush()
    assert s.item_ids == ["b"] and set(s.covisit.counts) == {"b"}
    # "a" was counted and evicted; "ghost" never had counted clicks of its own
    assert flush.evicted == ["a"] and flush.dropped == ["a", "ghost"]


def test_past_the_neighbour_budget_the_longest_rows_lose_their_weakest_pairs():
    """A partition's co-visitation neighbours over all anchors stay within
    covisit_max_neighbours: each flush past it cuts the longest rows to one quota, keeping
    each row's strongest pairs, and writes the cut rows again."""
    s = make_state(covisit_max_neighbours=10)
    s.apply([(0, o, a, CLICK, T0, None, 0) for o, a in enumerate(["a", "b", "c"])])
    # a is clicked with eight others (n1 strongest), b with three, c with one
    names = [f"n{j}" for j in range(1, 9)]
    s.apply_pairs(["a"] * 8, names, [0] * 8, list(range(10, 18)), [T0] * 8)
    s.apply_pairs(["a"] * 3, ["n1", "n2", "n3"], [0] * 3, [20, 21, 22], [T0] * 3)
    s.apply_pairs(["b"] * 3 + ["c"], ["x", "y", "z", "w"], [0] * 4, [30, 31, 32, 33], [T0] * 4)
    assert s.covisit.entries == 12
    flush = s.begin_flush()
    # to nine tenths of 10: a quota of 5 a row makes 5 + 3 + 1 = 9; 6 would make 10
    assert s.covisit.entries == 9 and s.take_trimmed() == 3
    assert set(s.covisit.counts["a"]) == {"n1", "n2", "n3", "n4", "n5"}
    assert set(s.covisit.counts["c"]) == {"w"} and "a" in flush.anchors
    assert s.begin_flush().anchors == [] and s.take_trimmed() == 0  # within budget: as is


def test_a_flush_that_failed_is_given_back_whole():
    s = make_state(evict_below=0.01)
    s.apply([(0, 1, "a", CLICK, T0, None, 0), (0, 2, "b", CLICK, T0 + 100 * HOUR_MS, None, 0)])
    s.apply_pairs(["b"], ["c"], [0], [3], [T0 + 100 * HOUR_MS])
    s.covisit.drop(["zz"])  # nothing to drop: no-op
    first = s.begin_flush()
    assert first.evicted == ["a"] and first.anchors == ["b"] and first.slots == [0]
    s.abort_flush(first)
    assert s.begin_flush() == first
