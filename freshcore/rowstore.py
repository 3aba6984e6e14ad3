"""Embedding rows in Redis, as the parameter server writes them and every worker and tool
reads them: per table one hash for each ``gradients`` partition (field = the row's 8-byte
key, value = ``schemas.rows``'s encoding; a row's partition is the murmur2 of its id), and the
broadcast offsets a worker starts following ``embeddings.updates`` from."""

from __future__ import annotations

import logging

import numpy as np
import redis

from freshcore import clock
from freshcore.partitioner import FEW, row_partitions
from freshcore.redisconn import Packed, run_packed
from freshcore.rediskeys import RedisKeys
from freshcore.resp import pack_fixed
from schemas.errors import FreshRecError
from schemas.rowbatch import TABLE_ITEM, TABLE_NAMES
from schemas.rows import decode_row, decode_rows, encode_rows, key_matrix, key_to_id, row_key

Row = tuple[np.ndarray, int, int]
log = logging.getLogger("freshrec.rows")


class LayoutMismatch(FreshRecError, RuntimeError):
    """Redis holds rows laid out for another number of ``gradients`` partitions."""


def row_shards(r: redis.Redis, keys: RedisKeys, partitions: int) -> int:
    """The number of ``gradients`` partitions the rows are laid out by: recorded by the first
    writer or reader that knows it (``partitions``, the topic's count) and checked by every
    later one. Repartitioning ``gradients`` needs the rows moved (or dropped) first."""
    if partitions < 1:
        raise ValueError(f"partitions must be at least 1, not {partitions}")
    r.set(keys.rows_layout, partitions, nx=True)
    stored = int(r.get(keys.rows_layout) or partitions)
    if stored != partitions:
        raise LayoutMismatch(
            f"Redis holds rows laid out for {stored} gradients partitions and the gradients "
            f"topic has {partitions}: recreate the topic with {stored}, or delete the rows "
            f"({keys.prefix}emb:*, {keys.prefix}opt:*, {keys.prefix}ps:*, {keys.rows_layout})"
        )
    return stored


def shard_ids(ids: np.ndarray, shards: int) -> list[tuple[int, np.ndarray]]:
    """(shard, positions in ``ids``) of each shard that has some of ``ids``.

    >>> [(s, p.tolist()) for s, p in shard_ids(np.array([5, 6, 5]), 1)]
    [(0, [0, 1, 2])]
    >>> few = np.array([1, 2, 3, 1, 4]) * 1000003  # shards 1, 2, 0, 1, 0 of 3
    >>> many = np.concatenate([few, few])
    >>> [(s, p.tolist()) for s, p in shard_ids(few, 3)] == [
    ...     (s, p[p < 5].tolist()) for s, p in shard_ids(many, 3) if (p < 5).any()]
    True
    """
    ids = np.asarray(ids, np.int64)
    if shards == 1:
        return [(0, np.arange(len(ids)))] if len(ids) else []
    parts = row_partitions(ids, shards)
    if len(ids) <= FEW:  # a few ids: grouped in Python, cheaper than numpy's sort and split
        groups: dict[int, list[int]] = {}
        for j, part in enumerate(parts.tolist()):
            groups.setdefault(part, []).append(j)
        return [(part, np.asarray(pos, np.int64)) for part, pos in sorted(groups.items())]
    order = np.argsort(parts, kind="stable")
    cuts = np.flatnonzero(np.diff(parts[order])) + 1
    return [(int(parts[pos[0]]), pos) for pos in np.split(order, cuts) if len(pos)]


def fetch_blobs(
    r: redis.Redis, keys: RedisKeys, names: list[str], ids: np.ndarray, shards: int
) -> list[list]:
    """For each key family in ``names`` (``keys.embeddings``/``keys.optimizer`` of a table:
    a function of the shard), the stored value of each of ``ids`` (None where absent), in
    ``ids``' order: one HMGET per shard and family, all sent at once."""
    ids = np.asarray(ids, np.int64)
    groups = shard_ids(ids, shards)
    fields = key_matrix(ids)
    entries = [
        Packed(key, pack_fixed(b"HMGET", key, fields[pos]), 1)
        for shard, pos in groups
        for key in (name(shard).encode() for name in names)
    ]
    replies = run_packed(r, entries)
    out = []
    for k in range(len(names)):
        if len(groups) == 1:
            out.append(replies[k][0])
            continue
        blobs = np.empty(len(ids), object)
        for g, (_, pos) in enumerate(groups):
            blobs[pos] = replies[g * len(names) + k][0]
        out.append(blobs.tolist())
    return out


def fetch_rows(
    r: redis.Redis, keys: RedisKeys, table: int, ids: list[int], w: int, shards: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Many rows in one round trip (an HMGET per shard, packed with numpy): a mask over
    ``ids`` of the rows Redis has, then those rows, their versions and newest event times,
    in order."""
    if not len(ids):
        return decode_rows([], w)
    name = TABLE_NAMES[table]
    (blobs,) = fetch_blobs(r, keys, [lambda s: keys.embeddings(name, s)], ids, shards)
    return decode_rows(blobs, w)


def load_table(r: redis.Redis, keys: RedisKeys, table: int, w: int, shards: int) -> dict[int, Row]:
    """Every row of a table (the worker's item table at start), scanned in chunks."""
    out: dict[int, Row] = {}
    for shard in range(shards):
        key = keys.embeddings(TABLE_NAMES[table], shard)
        for field, blob in r.hscan_iter(key, count=5000):
            out[key_to_id(field)] = decode_row(blob, w)
    return out


def broadcast_offsets(r: redis.Redis, keys: RedisKeys) -> dict[int, int]:
    return {int(k): int(v) for k, v in r.hgetall(keys.ps_broadcast).items()}


def seed_rows(
    r: redis.Redis,
    keys: RedisKeys,
    table: int,
    ids: np.ndarray,
    rows: np.ndarray,
    version: int,
    event_ms: int,
    shards: int,
    chunk: int = 5000,
) -> int:
    """Write starting rows (offline training) where no row exists yet (HSETNX), so a reload
    never moves a row that online learning has already refined back in time. Returns how
    many rows were written."""
    name = TABLE_NAMES[table]
    shard = row_partitions(np.asarray(ids, np.int64), shards) if shards > 1 else None
    versions = np.full(len(ids), version, np.uint64)
    times = np.full(len(ids), event_ms, np.int64)
    written = 0
    for lo in range(0, len(ids), chunk):
        blobs = encode_rows(
            rows[lo : lo + chunk], versions[lo : lo + chunk], times[lo : lo + chunk]
        )
        pipe = r.pipeline(transaction=False)
        part = [0] * len(blobs) if shard is None else shard[lo : lo + chunk].tolist()
        for rid, s, blob in zip(ids[lo : lo + chunk].tolist(), part, blobs, strict=True):
            pipe.hsetnx(keys.embeddings(name, s), row_key(rid), blob)
        written += sum(pipe.execute())
    return written


def seed_starts(
    r: redis.Redis, keys: RedisKeys, shards: int, ids: np.ndarray, rows: np.ndarray
) -> int:
    """Starting rows of new catalogue items (``inference/models/coldstart.py``) where no row
    exists yet, at version 1 as offline training's. A Redis error leaves them with the worker
    alone (logged; the parameter server then starts those rows from their ids, and its
    broadcast replaces them). Returns how many were written."""
    try:
        written = seed_rows(r, keys, TABLE_ITEM, ids, rows, 1, clock.now_ms(), shards)
    except redis.RedisError as exc:
        log.warning("starting rows of %d new items not written to Redis: %s", len(ids), exc)
        return 0
    log.info("%d new catalogue items started from their categories' rows", written)
    return written
