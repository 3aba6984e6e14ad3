"""Write a trained world into Redis without the streams app: the catalogue hashes, a global
hot list (the world's most popular items) and the trained starting rows. For benchmarks and
tests that exercise the worker alone; in `freshrec run` the streams app writes the first two
from the topics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from freshcore import clock
from freshcore.hotscore import HotEntry, HotList
from freshcore.redisconn import connect
from freshcore.rediskeys import RedisKeys
from freshcore.rowstore import row_shards, seed_rows
from freshrec.sim.traffic import catalogue
from freshrec.sim.world import World
from inference.models.modelfile import load_tensors, read_manifest
from schemas.rows import TABLE_ITEM, TABLE_USER


def seed_world(
    redis_url: str, prefix: str, world: World, model_dir: Path, partitions: int, hot: int = 50
) -> None:
    """The world's catalogue, a hot list and the trained rows, laid out for ``partitions``
    gradients partitions (the topic's count)."""
    r = connect(redis_url)
    k = RedisKeys(prefix)
    try:
        shards = row_shards(r, k, partitions)
        items = list(catalogue(world))
        pipe = r.pipeline(transaction=False)
        pipe.hset(k.item_category, mapping={i.item_id: i.category for i in items})
        pipe.hset(k.item_price, mapping={i.item_id: i.price for i in items})
        regional = {i.item_id: i.region for i in items if i.region}
        if regional:
            pipe.hset(k.item_region, mapping=regional)
        popular = world.sample_popular_items(np.random.default_rng(1), 20 * hot)
        top = list(dict.fromkeys(World.item_id(int(i)) for i in popular))[:hot]
        now = clock.now_ms()
        entries = [HotEntry(i, float(hot - n), 0.05, 0.5) for n, i in enumerate(top)]
        pipe.hset(k.hot("global"), "0", json.dumps(HotList(now, entries, 0, now).to_json()))
        pipe.sadd(k.hot_scopes(), "global")
        pipe.execute()
        manifest = read_manifest(model_dir)
        t = load_tensors(model_dir, manifest["files"]["two_tower"])
        seed_rows(r, k, TABLE_ITEM, t["item_ids"].numpy(), t["item_rows"].numpy(), 1, 1, shards)
        seed_rows(r, k, TABLE_USER, t["user_ids"].numpy(), t["user_rows"].numpy(), 1, 1, shards)
    finally:
        r.close()
