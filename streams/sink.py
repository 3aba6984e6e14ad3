"""Writes of the streams app to Redis: batched, one pipeline per flush, never per event."""

from __future__ import annotations

import json

import numpy as np
from redis.asyncio import Redis

from freshrec.rediskeys import RedisKeys
from streams.hotlist import HotList, hot_scores, price_norm
from streams.item_state import ItemPartitionState


class StreamsSink:
    def __init__(self, redis: Redis, keys: RedisKeys) -> None:
        self.redis = redis
        self.keys = keys

    async def prices(self, item_ids: list[str]) -> dict[str, float]:
        if not item_ids:
            return {}
        values = await self.redis.hmget(self.keys.item_price, item_ids)
        return {i: float(v) for i, v in zip(item_ids, values, strict=True) if v is not None}

    async def persist(self, states: list[tuple[int, ItemPartitionState]]) -> None:
        """Per partition: state rows of touched items, the meta (with applied offsets) and
        serving features — all partitions in one MULTI/EXEC, so a crash leaves either all of
        a flush or none of it."""
        pipe = self.redis.pipeline(transaction=True)
        queued = False
        for partition, state in states:
            queued |= self._queue_persist(pipe, partition, state)
        if queued:
            await pipe.execute()

    def _queue_persist(self, pipe, partition: int, state: ItemPartitionState) -> bool:
        touched = state.take_touched()
        if not touched:
            return False
        k = self.keys
        t = state.watermark_ms
        idx = np.asarray(touched)
        dec = state.decayed(t)[idx, 0, :]
        ctr, cvr = state.rates(dec)
        pn = price_norm(state.price[idx], state.config.price_cap)
        hot = hot_scores(dec[:, 1], cvr, pn, state.config.weights)
        ids = [state.item_ids[i] for i in touched]
        pipe.hset(k.streams_rows(partition), mapping=state.snapshot_rows(touched))
        pipe.hset(k.streams_meta(partition), mapping=state.snapshot_meta())
        for name, values in (
            ("impressions", dec[:, 0]),
            ("clicks", dec[:, 1]),
            ("conversions", dec[:, 2]),
            ("ctr", ctr),
            ("cvr", cvr),
            ("hot", hot),
        ):
            pipe.hset(
                k.item_feature[name],
                mapping=dict(zip(ids, np.round(values, 9).tolist(), strict=True)),
            )
        # the event time these counts are decayed to; items untouched since keep older ones
        pipe.hset(k.item_features_as_of, mapping=dict.fromkeys(ids, t))
        return True

    async def restore(self, partition: int, config) -> ItemPartitionState:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(self.keys.streams_meta(partition))
        pipe.hgetall(self.keys.streams_rows(partition))
        meta_raw, rows_raw = await pipe.execute()
        meta = {a.decode(): b.decode() for a, b in meta_raw.items()}
        rows = {a.decode(): b for a, b in rows_raw.items()}
        return ItemPartitionState.restore(config, meta, rows)

    async def publish_hot(self, lists_by_scope: dict[str, HotList]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for scope, hl in lists_by_scope.items():
            pipe.hset(self.keys.hot(scope), str(hl.partition), json.dumps(hl.to_json()))
        pipe.sadd(self.keys.hot_scopes(), *lists_by_scope)
        await pipe.execute()


async def read_hot_lists(redis: Redis, keys: RedisKeys, scope: str) -> list[HotList]:
    """Every partition's current list for ``scope``: one round trip."""
    raw = await redis.hgetall(keys.hot(scope))
    return [HotList.from_json(json.loads(v)) for v in raw.values()]
