"""Writes of the streams app to Redis: batched, one pipeline per flush, never per event."""

from __future__ import annotations

import numpy as np
import orjson
from redis.asyncio import Redis

from freshrec.hotscore import HotList, hot_scores, price_norm
from freshrec.rediskeys import RedisKeys
from freshrec.resp import Fields, execute_async, float_text, pack, pack_pairs, pack_ragged
from streams.item_state import ItemPartitionState


class StreamsSink:
    def __init__(self, redis: Redis, keys: RedisKeys) -> None:
        self.redis = redis
        self.keys = keys

    async def prices(self, item_ids: list[str]) -> dict[str, float]:
        if not item_ids:
            return {}
        # packed by hand: redis-py's packer was most of this call with thousands of new items
        command = pack(b"HMGET", self.keys.item_price.encode(), *(i.encode() for i in item_ids))
        (values,) = await execute_async(self.redis, command, 1)
        return {i: float(v) for i, v in zip(item_ids, values, strict=True) if v is not None}

    async def persist(self, states: list[tuple[int, ItemPartitionState]]) -> None:
        """Per partition: state rows of touched items and the meta (with applied offsets) —
        all partitions in one MULTI/EXEC, so a crash leaves either all of a flush or none of
        it. The touched items' serving features follow in the next publish round. Commands
        are packed here (``freshrec/resp.py``): redis-py's asyncio packer was most of a count
        batch's time."""
        commands = []
        for partition, state in states:
            commands += self._persist_commands(partition, state)
        if commands:
            payload = b"".join([pack(b"MULTI"), *commands, pack(b"EXEC")])
            await execute_async(self.redis, payload, len(commands) + 2)

    def _persist_commands(self, partition: int, state: ItemPartitionState) -> list[bytes]:
        touched = state.take_touched()
        if not touched:
            return []
        k = self.keys
        meta = state.snapshot_meta()
        rows = state.snapshot_matrix(touched)
        return [
            # every command over many items is packed with numpy, not pair by pair (at a
            # backlog a batch touches most items)
            pack_ragged(
                b"HSET",
                k.streams_rows(partition).encode(),
                _fields(state, touched),
                rows.view(np.uint8).reshape(len(touched), -1),
            ),
            pack_pairs(
                b"HSET",
                k.streams_meta(partition).encode(),
                [f.encode() for f in meta],
                [v.encode() for v in meta.values()],
            ),
        ]

    def feature_commands(self, state: ItemPartitionState) -> list[bytes]:
        """The serving features (``item:{impressions,…,hot}``, ``item:as_of_ms``) of the
        items persisted since the last call, decayed to the partition's event time."""
        due = state.take_features_due()
        if not due:
            return []
        k = self.keys
        t = state.watermark_ms
        idx = np.asarray(due)
        dec = state.decay.value_at(state.counts[idx, 0, :], t)
        ctr, cvr = state.rates(dec)
        pn = price_norm(state.price[idx], state.config.price_cap)
        hot = hot_scores(dec[:, 1], cvr, pn, state.config.weights)
        ids = _fields(state, due)
        out = []
        for name, values in (
            ("impressions", dec[:, 0]),
            ("clicks", dec[:, 1]),
            ("conversions", dec[:, 2]),
            ("ctr", ctr),
            ("cvr", cvr),
            ("hot", hot),
        ):
            out.append(pack_ragged(b"HSET", k.item_feature[name].encode(), ids, float_text(values)))
        # the event time these counts are decayed to; items untouched since keep older ones
        as_of = np.frombuffer(b"%d" % t, np.uint8)
        out.append(
            pack_ragged(
                b"HSET",
                k.item_features_as_of.encode(),
                ids,
                np.broadcast_to(as_of, (len(idx), len(as_of))),
            )
        )
        return out

    async def restore(self, partition: int, config) -> ItemPartitionState:
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(self.keys.streams_meta(partition))
        pipe.hgetall(self.keys.streams_rows(partition))
        meta_raw, rows_raw = await pipe.execute()
        meta = {a.decode(): b.decode() for a, b in meta_raw.items()}
        rows = {a.decode(): b for a, b in rows_raw.items()}
        return ItemPartitionState.restore(config, meta, rows)

    async def publish_hot(self, payloads: dict[int, dict[str, bytes]]) -> None:
        """Partitions' hot lists (``ItemPartitionState.hot_payloads``), one round trip."""
        commands = []
        scopes = set()
        for partition, lists in payloads.items():
            for scope, payload in lists.items():
                commands.append(
                    pack(b"HSET", self.keys.hot(scope).encode(), str(partition).encode(), payload)
                )
            scopes.update(lists)
        if scopes:
            commands.append(
                pack(
                    b"SADD", self.keys.hot_scopes().encode(), *(s.encode() for s in sorted(scopes))
                )
            )
        await self.write(commands)

    async def write(self, commands: list[bytes]) -> None:
        """Packed commands (``feature_commands``), one round trip."""
        if commands:
            await execute_async(self.redis, b"".join(commands), len(commands))


def _fields(state: ItemPartitionState, slots: list[int]) -> Fields:
    return Fields([state.item_ids[i].encode() for i in slots])


async def read_hot_lists(redis: Redis, keys: RedisKeys, scope: str) -> list[HotList]:
    """Every partition's current list for ``scope``: one round trip."""
    raw = await redis.hgetall(keys.hot(scope))
    return [HotList.from_json(orjson.loads(v)) for v in raw.values()]
