"""New items' starting rows from their category: the rule against brute force, offline
training's items without a positive, and a live worker starting a catalogue item it holds no
learnt row for, here and in Redis."""

from __future__ import annotations

import numpy as np
import torch

from inference.models.coldstart import JITTER, UNKNOWN_CATEGORY, category_starts


def test_category_starts_against_brute_force():
    rng = np.random.default_rng(4)
    for _ in range(20):
        n, w, buckets = int(rng.integers(1, 40)), 5, 6
        rows = rng.normal(size=(n, w)).astype(np.float32)
        category = rng.integers(-1, buckets, n)
        learnt = rng.random(n) < 0.6
        jitter = rng.normal(size=(n, w)).astype(np.float32)
        got, changed = category_starts(
            torch.from_numpy(rows),
            torch.from_numpy(category),
            torch.from_numpy(learnt),
            torch.from_numpy(jitter),
            buckets,
        )
        for j in range(n):
            peers = [i for i in range(n) if learnt[i] and category[i] == category[j]]
            if learnt[j] or category[j] < 0 or not peers:
                assert not changed[j] and np.array_equal(got[j].numpy(), rows[j])
            else:
                want = rows[peers].mean(0) + JITTER * jitter[j]
                assert changed[j] and np.allclose(got[j].numpy(), want, atol=1e-5)


def test_training_starts_items_without_a_positive_from_their_category():
    from inference.training.logfeatures import TrainingLog
    from inference.training.train import start_cold_items

    # items 0,1 (drama) and 2 (comedy) clicked; 3 (drama) and 4 (comedy) never; 5 unknown
    cats = np.array(["drama", "drama", "comedy", "drama", "comedy", UNKNOWN_CATEGORY], object)
    logs = TrainingLog(
        user_ids=np.array(["u0", "u1"], object),
        item_ids=np.array([f"i{j}" for j in range(6)], object),
        item_category=cats,
        item_price=np.zeros(6),
        users=np.array([0, 1, 0, 1, 0, 1]),
        items=np.array([0, 1, 2, 3, 4, 5]),
        t_ms=np.arange(6, dtype=np.int64),
        clicked=np.array([True, True, True, False, False, False]),
        converted=np.zeros(6, bool),
        device=np.full(6, -1),
        region=np.full(6, None, object),
    )
    rows = np.random.default_rng(1).normal(size=(6, 5)).astype(np.float32)
    out, started = start_cold_items(logs, np.arange(6), rows, dim=4)
    assert started == 2
    assert np.allclose(out[3], rows[[0, 1]].mean(0), atol=0.05)  # near the dramas' mean
    assert np.allclose(out[4], rows[2], atol=0.05)
    assert np.array_equal(out[5], rows[5]) and np.array_equal(out[:3], rows[:3])


def test_a_worker_starts_a_new_catalogue_item_from_its_category_here_and_in_redis(
    seeded, model_dir
):
    """An item published to the catalogue with no row anywhere: the worker starts it at its
    category's mean learnt row and writes that start to Redis (version 1, where the parameter
    server will find it); an item of no known category keeps its id row and writes nothing."""
    from freshcore import metrics as m
    from freshcore.redisconn import connect
    from freshcore.rediskeys import RedisKeys
    from freshcore.rowstore import fetch_rows
    from schemas.ids import row_id
    from schemas.rows import TABLE_ITEM, initial_rows

    from .serving_harness import running_worker, worker_settings
    from .streams_harness import wait_for

    conn = seeded
    r = connect(conn.redis_url)
    keys = RedisKeys(conn.topic_prefix)
    cats = {k.decode(): v.decode() for k, v in r.hgetall(keys.item_category).items()}
    category = sorted(set(cats.values()))[0]
    before = m.COLD_ITEMS_STARTED._value.get()
    with running_worker(worker_settings(conn, model_dir)) as w:
        peers = [i for i, c in cats.items() if c == category]
        mean = np.mean([w.item_row(i) for i in peers], axis=0)
        pipe = r.pipeline(transaction=False)
        pipe.hset(keys.item_category, mapping={"cold-new": category, "cold-odd": "unknown"})
        pipe.hset(keys.item_price, mapping={"cold-new": 9.0, "cold-odd": 9.0})
        pipe.incr(keys.catalogue_version)
        pipe.execute()
        rec = w.recommender
        wait_for(lambda: "cold-new" in rec.slot_of, 20, "the worker to adopt the catalogue")
        row = w.item_row("cold-new")
        jitter = initial_rows(np.array([row_id("cold-new")]), TABLE_ITEM, len(row) - 1)[0]
        assert np.allclose(row, mean + JITTER * jitter, atol=1e-5)
        odd = w.item_row("cold-odd")
        assert np.allclose(
            odd, initial_rows(np.array([row_id("cold-odd")]), TABLE_ITEM, len(odd) - 1)[0]
        )
        assert m.COLD_ITEMS_STARTED._value.get() - before == 1
        found, rows, versions, _ = fetch_rows(
            r,
            keys,
            TABLE_ITEM,
            [row_id("cold-new"), row_id("cold-odd")],
            len(row),
            w.outbox.partitions,
        )
        assert found.tolist() == [True, False]
        assert np.allclose(rows[0], row) and int(versions[0]) == 1
    r.close()
