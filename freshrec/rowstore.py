"""Embedding rows in Redis, as the parameter server writes them and every worker and tool
reads them: one hash per table (field = the row's 8-byte key, value = ``schemas.rows``'s
encoding), and the broadcast offsets a worker starts following ``embeddings.updates`` from."""

from __future__ import annotations

import numpy as np
import redis

from freshrec.rediskeys import RedisKeys
from freshrec.resp import execute, pack_fixed
from schemas.rowbatch import TABLE_NAMES
from schemas.rows import decode_row, decode_rows, encode_rows, key_matrix, key_to_id, row_key

Row = tuple[np.ndarray, int, int]


def fetch_rows(
    r: redis.Redis, keys: RedisKeys, table: int, ids: list[int], w: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One HMGET for many rows (packed with numpy): a mask over ``ids`` of the rows Redis has,
    then those rows, their versions and newest event times, in order."""
    if not ids:
        return decode_rows([], w)
    key = keys.embeddings(TABLE_NAMES[table]).encode()
    fields = key_matrix(np.asarray(ids, np.int64))
    (blobs,) = execute(r, pack_fixed(b"HMGET", key, fields), 1)
    return decode_rows(blobs, w)


def load_table(r: redis.Redis, keys: RedisKeys, table: int, w: int) -> dict[int, Row]:
    """Every row of a table (the worker's item table at start), scanned in chunks."""
    out: dict[int, Row] = {}
    for field, blob in r.hscan_iter(keys.embeddings(TABLE_NAMES[table]), count=5000):
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
    chunk: int = 5000,
) -> int:
    """Write starting rows (offline training) where no row exists yet (HSETNX), so a reload
    never moves a row that online learning has already refined back in time. Returns how
    many rows were written."""
    key = keys.embeddings(TABLE_NAMES[table])
    versions = np.full(len(ids), version, np.uint64)
    times = np.full(len(ids), event_ms, np.int64)
    written = 0
    for lo in range(0, len(ids), chunk):
        blobs = encode_rows(
            rows[lo : lo + chunk], versions[lo : lo + chunk], times[lo : lo + chunk]
        )
        pipe = r.pipeline(transaction=False)
        for rid, blob in zip(ids[lo : lo + chunk].tolist(), blobs, strict=True):
            pipe.hsetnx(key, row_key(rid), blob)
        written += sum(pipe.execute())
    return written
