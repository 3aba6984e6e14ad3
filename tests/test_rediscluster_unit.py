"""The key layout a Redis Cluster needs, without a server: what must be atomic in one slot,
the load spread over slots, URLs that say cluster, the stack's slot split."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from redis.crc import key_slot

from freshcore.partitioner import row_partitions
from freshcore.redisconn import parse_url
from freshcore.rediskeys import RedisKeys
from freshcore.resp import pack
from freshcore.rowstore import shard_ids
from freshrec.app.stack import slot_ranges
from param_server.store import pack_persist
from schemas.rows import TABLE_ITEM, TABLE_USER
from streams.validate import pack_recent


def commands(payload: bytes) -> list[list[bytes]]:
    """Parse packed RESP commands (arrays of bulk strings) back into argument lists."""
    out, at = [], 0
    while at < len(payload):
        assert payload[at : at + 1] == b"*", payload[at : at + 20]
        end = payload.index(b"\r\n", at)
        n, at = int(payload[at + 1 : end]), end + 2
        args = []
        for _ in range(n):
            end = payload.index(b"\r\n", at)
            size = int(payload[at + 1 : end])
            args.append(payload[end + 2 : end + 2 + size])
            at = end + 2 + size + 2
        out.append(args)
    return out


def test_the_resp_parser_reads_what_pack_writes():
    assert commands(pack(b"SET", b"k", b"v") + pack(b"GET", b"k")) == [
        [b"SET", b"k", b"v"],
        [b"GET", b"k"],
    ]


def _tables(partition: int, n: int, w: int = 3) -> dict[int, tuple[np.ndarray, ...]]:
    ids = np.arange(n, dtype=np.int64) * 7 + partition
    rows = np.ones((n, w), np.float32)
    return {
        t: (ids, rows, rows, np.ones(n, np.uint64), np.ones(n, np.int64))
        for t in (TABLE_USER, TABLE_ITEM)
    }


@pytest.mark.parametrize("ttl_ms,expiry", [(0, None), (60_000, "HSETEX"), (60_000, "HPEXPIRE")])
def test_every_key_of_a_parameter_server_transaction_is_in_its_partitions_slot(ttl_ms, expiry):
    keys = RedisKeys("t1.")
    units = pack_persist(
        keys,
        {p: _tables(p, 5) for p in range(8)},
        {p: 100 + p for p in range(8)},
        ttl_ms=ttl_ms,
        expiry=expiry,
    )
    assert [u.partition for u in units] == list(range(8))
    for unit in units:
        cmds = commands(unit.commands)
        assert len(cmds) == unit.count
        slots = {key_slot(c[1]) for c in cmds}
        assert slots == {key_slot(keys.ps_owner(unit.partition).encode())}, cmds[0][:2]
        assert cmds[-1] == [
            b"SET",
            keys.ps_applied(unit.partition).encode(),
            b"%d" % (100 + unit.partition),
        ]


def test_partitions_rows_spread_over_slots_and_a_partitions_keys_share_one():
    keys = RedisKeys("t1.")
    per_partition = []
    for p in range(16):
        family = {
            key_slot(k.encode())
            for k in (
                keys.embeddings("user", p),
                keys.embeddings("item", p),
                keys.optimizer("user", p),
                keys.ps_applied(p),
                keys.ps_owner(p),
            )
        }
        assert len(family) == 1
        per_partition.append(family.pop())
    assert len(set(per_partition)) == 16  # every partition its own slot
    # three masters with slot_ranges(3): no master is left without partitions
    owners = [
        next(i for i, (lo, hi) in enumerate(slot_ranges(3)) if lo <= s <= hi) for s in per_partition
    ]
    assert set(owners) == {0, 1, 2}
    streams = {key_slot(keys.streams_rows(4).encode()), key_slot(keys.streams_meta(4).encode())}
    assert len(streams) == 1


def test_a_reader_finds_a_rows_shard_from_its_id_as_the_writers_route_it():
    ids = np.array([3, -9, 2**40, 7, 3], np.int64)
    groups = shard_ids(ids, 4)
    routed = row_partitions(ids, 4)
    seen = np.zeros(len(ids), bool)
    for shard, pos in groups:
        assert (routed[pos] == shard).all()
        seen[pos] = True
    assert seen.all() and len({s for s, _ in groups}) == len(groups)
    assert shard_ids(np.zeros(0, np.int64), 4) == []


def test_recent_clicks_are_packed_one_entry_per_user_key():
    keys = RedisKeys()
    entries = pack_recent(keys, [("u1", "i1", 5), ("u2", "i2", 6), ("u1", "i3", 7)], keep=10)
    assert [e.key for e in entries] == [b"user:recent:u1", b"user:recent:u2"]
    for e in entries:
        assert {c[1] for c in commands(e.payload)} == {e.key} and e.replies == 2


def test_cluster_urls():
    assert parse_url("redis://h:1/0") == ("redis://h:1/0", None)
    assert parse_url("rediss+cluster://:pw@h:7000") == ("rediss://:pw@h:7000", True)
    with pytest.raises(ValueError, match="only database 0"):
        parse_url("redis+cluster://h:7000/3")


def test_the_stacks_slot_ranges_cover_every_slot_once():
    for n in (2, 3, 7, 64):
        ranges = slot_ranges(n)
        assert ranges[0][0] == 0 and ranges[-1][1] == 16383
        assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(ranges))


def test_recent_clicks_expire_with_the_users_rows():
    keys = RedisKeys()
    (entry,) = pack_recent(keys, [("u1", "i1", 5)], keep=10, ttl_s=86_400)
    assert entry.replies == 3
    assert [c[0] for c in commands(entry.payload)] == [b"LPUSH", b"LTRIM", b"EXPIRE"]
    assert commands(entry.payload)[-1] == [b"EXPIRE", b"user:recent:u1", b"86400"]
