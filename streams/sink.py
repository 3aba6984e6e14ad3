"""Writes of the streams app to Redis: batched, one pipeline per flush, never per event."""

from __future__ import annotations

import numpy as np
import orjson
from redis.asyncio import Redis

from freshcore.hotscore import HotList, hot_scores, price_norm
from freshcore.neighbours import serving_list
from freshcore.redisconn import Packed, check_exec, run_packed_async
from freshcore.rediskeys import RedisKeys
from freshcore.resp import Fields, float_text, pack, pack_pairs, pack_ragged
from streams.acked import lost_write
from streams.item_state import Flush, ItemPartitionState

FEATURES = ("impressions", "clicks", "conversions", "ctr", "cvr", "hot")
"""The serving features written per item (``item:{name}:{sN}``)."""


class StreamsSink:
    def __init__(self, redis: Redis, keys: RedisKeys) -> None:
        self.redis = redis
        self.keys = keys

    async def prices(self, item_ids: list[str]) -> dict[str, float]:
        if not item_ids:
            return {}
        # packed by hand: redis-py's packer was most of this call with thousands of new items
        key = self.keys.item_price.encode()
        command = pack(b"HMGET", key, *(i.encode() for i in item_ids))
        ((values,),) = await run_packed_async(self.redis, [Packed(key, command, 1)])
        return {i: float(v) for i, v in zip(item_ids, values, strict=True) if v is not None}

    async def persist(self, states: list[tuple[int, ItemPartitionState]]) -> list[int]:
        """Per partition: state rows of touched items, the pair counts of the anchors counted
        since, the removal of evicted items (their rows, features, co-visitation and
        sequential-rule lists) and the meta (with applied offsets) in one
        MULTI/EXEC (the keys share the partition's hash tag), so a crash leaves each
        partition with all of a flush or none of it; all partitions in one round trip (one
        per node of a cluster). The touched items' serving features follow in the next
        publish round. A write that fails gives back all it took, so the retry writes it
        whole. Commands are packed here (``freshcore/resp.py``): redis-py's asyncio packer
        was most of a count batch's time.

        Each transaction first reads back the offsets Redis held: when they are behind the
        last snapshot it acknowledged (``acked.lost_write``: a failover lost
        an acknowledged write), the partition's every row is due again and its number is
        returned, for the caller to write it whole before it acknowledges anything."""
        entries = []
        flushes = []
        written = []
        try:
            for partition, state in states:
                flush = state.begin_flush()
                flushes.append((state, flush))
                commands = self._persist_commands(partition, state, flush)
                if commands:
                    key = self.keys.streams_meta(partition).encode()
                    check = pack(b"HMGET", key, *(f.encode() for f in state.persisted))
                    payload = b"".join([pack(b"MULTI"), check, *commands, pack(b"EXEC")])
                    entries.append(Packed(key, payload, len(commands) + 3))
                    written.append((partition, state, state.snapshot_meta()))
            results = await run_packed_async(self.redis, entries)
            for replies in results:
                # a command that failed inside EXEC (OOM at maxmemory, a key of the wrong
                # type) is an error in its list: raised, so the batch is neither acknowledged
                # nor its offsets taken as persisted, and the snapshot is written again
                check_exec(replies[-1], "persisting counts")
        except BaseException:
            for state, flush in flushes:
                state.abort_flush(flush)
            raise
        lost = []
        for (partition, state, meta), replies in zip(written, results, strict=True):
            held = [v.decode() if v is not None else None for v in replies[-1][0]]
            if lost_write(state.persisted, dict(zip(state.persisted, held, strict=True))):
                state.touch_all()
                lost.append(partition)
            state.persisted = {f: meta[f] for f in state.persisted}
        return lost

    def _persist_commands(
        self, partition: int, state: ItemPartitionState, flush: Flush
    ) -> list[bytes]:
        touched, anchors, evicted, dropped, sequels, sequels_dropped = flush
        if not (touched or anchors or evicted or dropped or sequels or sequels_dropped):
            return []
        k = self.keys
        meta = state.snapshot_meta()
        commands = []
        # removals first: an id evicted and seen again since is written back after them
        if evicted:
            ids = [i.encode() for i in evicted]
            for key in [k.streams_rows(partition), *self._feature_keys(partition)]:
                commands.append(pack(b"HDEL", key.encode(), *ids))
        commands += self._pair_drops(partition, dropped, sequels_dropped)
        if touched:
            rows = state.snapshot_matrix(touched)
            # every command over many items is packed with numpy, not pair by pair (at a
            # backlog a batch touches most items)
            commands.append(
                pack_ragged(
                    b"HSET",
                    k.streams_rows(partition).encode(),
                    _fields(state, touched),
                    rows.view(np.uint8).reshape(len(touched), -1),
                )
            )
        # the pair counts of the anchors changed (co-visitation and sequential rules: a
        # click's pairs count together), with the same offsets
        for key, changed, counts in (
            (k.streams_covisit(partition), anchors, state.covisit),
            (k.streams_sequel(partition), sequels, state.sequel),
        ):
            if changed:
                blobs = [counts.blob(a) for a in changed]
                commands.append(
                    pack_pairs(b"HSET", key.encode(), [a.encode() for a in changed], blobs)
                )
        commands.append(
            pack_pairs(
                b"HSET",
                k.streams_meta(partition).encode(),
                [f.encode() for f in meta],
                [v.encode() for v in meta.values()],
            )
        )
        return commands

    def _pair_drops(self, partition: int, dropped: list[str], sequels: list[str]) -> list[bytes]:
        """The removal of dropped anchors' co-visitation counts and list (``dropped``) and
        of their sequential-rule counts and list (``sequels``)."""
        k = self.keys
        out = []
        for gone, keys in (
            (dropped, (k.streams_covisit(partition), k.covisit(partition))),
            (sequels, (k.streams_sequel(partition), k.sequel(partition))),
        ):
            if gone:
                ids = [a.encode() for a in gone]
                out += [pack(b"HDEL", key.encode(), *ids) for key in keys]
        return out

    def _feature_keys(self, partition: int) -> list[str]:
        """Every hash holding a serving feature of the partition's items."""
        k = self.keys
        return [k.item_feature(n, partition) for n in FEATURES] + [k.item_features_as_of(partition)]

    def covisit_commands(
        self, partition: int, state: ItemPartitionState, anchors: list[str], neighbours: int
    ) -> tuple[list[Packed], list[int]]:
        """The serving lists of ``anchors`` (``covisit:{sN}``; those counted since the last
        round: ``CoVisitCounts.take_published``), and each one's newest pair's event time
        (how fresh the list is)."""
        if not anchors:
            return [], []
        key = self.keys.covisit(partition).encode()
        lists = [
            serving_list(state.covisit.top(a, neighbours, state.stored_clicks(a))) for a in anchors
        ]
        command = pack_pairs(b"HSET", key, [a.encode() for a in anchors], lists)
        newest = [state.covisit.newest_ms.get(a, 0) for a in anchors]
        return [Packed(key, command, 1)], newest

    def sequel_commands(
        self, partition: int, state: ItemPartitionState, anchors: list[str], successors: int
    ) -> tuple[list[Packed], list[int]]:
        """The successor lists of ``anchors`` (``sequel:{sN}``: each one's best
        ``successors`` by r(a → b), with their shares r(a → b) / Σ r(a → ·) of all its
        counted successors), and each one's newest rule's event time."""
        if not anchors:
            return [], []
        key = self.keys.sequel(partition).encode()
        rules = state.sequel
        lists = [serving_list(rules.top(a, successors, rules.total(a))) for a in anchors]
        command = pack_pairs(b"HSET", key, [a.encode() for a in anchors], lists)
        return [Packed(key, command, 1)], [rules.newest_ms.get(a, 0) for a in anchors]

    def feature_commands(
        self, partition: int, state: ItemPartitionState, due: list[int]
    ) -> list[Packed]:
        """The serving features (``item:{impressions,…,hot}:{sN}``, ``item:as_of_ms:{sN}``)
        of the items in slots ``due`` (those persisted since the last round:
        ``ItemPartitionState.take_features_due``), decayed to the partition's event time."""
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
        columns = (dec[:, 0], dec[:, 1], dec[:, 2], ctr, cvr, hot)
        for name, values in zip(FEATURES, columns, strict=True):
            key = k.item_feature(name, partition).encode()
            out.append(Packed(key, pack_ragged(b"HSET", key, ids, float_text(values)), 1))
        # the event time these counts are decayed to; items untouched since keep older ones
        as_of = np.frombuffer(b"%d" % t, np.uint8)
        key = k.item_features_as_of(partition).encode()
        values = np.broadcast_to(as_of, (len(idx), len(as_of)))
        out.append(Packed(key, pack_ragged(b"HSET", key, ids, values), 1))
        return out

    async def write_features(
        self, states: dict[int, ItemPartitionState], neighbours: int, successors: int = 50
    ) -> tuple[list[int], list[int]]:
        """Every partition's serving features of the items persisted since the last call
        (``feature_commands``), the neighbour lists of the anchors counted since
        (``covisit_commands``) and their successor lists (``sequel_commands``), in one round
        trip; returns the newest pair's event time of each neighbour list written, and of
        each successor list. Not written, everything taken is due again (by id: a sweep may
        renumber meanwhile)."""
        commands: list[Packed] = []
        newest: tuple[list[int], list[int]] = ([], [])
        taken = []
        for q, state in states.items():
            due, anchors = state.take_features_due(), state.covisit.take_published()
            sequels = state.sequel.take_published()
            taken.append((state, [state.item_ids[i] for i in due], anchors, sequels))
            commands += self.feature_commands(q, state, due)
            for lists, times, into in (
                (*self.covisit_commands(q, state, anchors, neighbours), newest[0]),
                (*self.sequel_commands(q, state, sequels, successors), newest[1]),
            ):
                commands += lists
                into += times
        try:
            if commands:
                await self.write(commands)
        except BaseException:  # due again
            for state, ids, anchors, sequels in taken:
                state.features_due.update(state.slots[i] for i in ids if i in state.slots)
                state.covisit.published.update(a for a in anchors if a in state.covisit.counts)
                state.sequel.published.update(a for a in sequels if a in state.sequel.counts)
            raise
        return newest

    async def restore(self, partition: int, config) -> ItemPartitionState:
        meta_key = self.keys.streams_meta(partition).encode()
        read = b"".join(
            [
                pack(b"MULTI"),
                pack(b"HGETALL", meta_key),
                pack(b"HGETALL", self.keys.streams_rows(partition).encode()),
                pack(b"HGETALL", self.keys.streams_covisit(partition).encode()),
                pack(b"HGETALL", self.keys.streams_sequel(partition).encode()),
                pack(b"EXEC"),
            ]
        )
        ((*_, (meta_raw, rows_raw, covisit_raw, sequel_raw)),) = await run_packed_async(
            self.redis, [Packed(meta_key, read, 6)]
        )
        meta = {a.decode(): b.decode() for a, b in _pairs(meta_raw)}
        rows = {a.decode(): b for a, b in _pairs(rows_raw)}
        state = ItemPartitionState.restore(config, meta, rows)
        state.covisit.restore({a.decode(): b for a, b in _pairs(covisit_raw)})
        state.sequel.restore({a.decode(): b for a, b in _pairs(sequel_raw)})
        return state

    async def publish_hot(self, payloads: dict[int, dict[str, bytes]]) -> None:
        """Partitions' hot lists (``ItemPartitionState.hot_payloads``), one round trip."""
        commands = []
        scopes = set()
        for partition, lists in payloads.items():
            for scope, payload in lists.items():
                key = self.keys.hot(scope).encode()
                commands.append(Packed(key, pack(b"HSET", key, b"%d" % partition, payload), 1))
            scopes.update(lists)
        if scopes:
            key = self.keys.hot_scopes().encode()
            command = pack(b"SADD", key, *(s.encode() for s in sorted(scopes)))
            commands.append(Packed(key, command, 1))
        await self.write(commands)

    async def write(self, commands: list[Packed]) -> None:
        """Packed commands (``feature_commands``), one round trip (one per node)."""
        await run_packed_async(self.redis, commands)


def _pairs(reply) -> list[tuple]:
    """An ``HGETALL`` reply as pairs: flat (field, value, …) in RESP2, a map in RESP3.

    >>> _pairs([b"a", b"1", b"b", b"2"]), _pairs({b"a": b"1"})
    ([(b'a', b'1'), (b'b', b'2')], [(b'a', b'1')])
    """
    if isinstance(reply, dict):
        return list(reply.items())
    return list(zip(reply[::2], reply[1::2], strict=True))


def _fields(state: ItemPartitionState, slots: list[int]) -> Fields:
    return Fields([state.item_ids[i].encode() for i in slots])


async def read_hot_lists(redis: Redis, keys: RedisKeys, scope: str) -> list[HotList]:
    """Every partition's current list for ``scope``: one round trip."""
    raw = await redis.hgetall(keys.hot(scope))
    return [HotList.from_json(orjson.loads(v)) for v in raw.values()]
