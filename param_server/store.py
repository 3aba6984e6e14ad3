"""Rows and optimizer state in Redis (synchronous client): the global truth's layout."""

from __future__ import annotations

import numpy as np
import redis

from freshrec.rediskeys import RedisKeys
from param_server.rows import decode_row, encode_rows, key_to_id, row_key
from schemas.rowbatch import TABLE_NAMES

Row = tuple[np.ndarray, int, int]


def fetch_rows(
    r: redis.Redis, keys: RedisKeys, table: int, ids: list[int], w: int
) -> dict[int, Row]:
    """One HMGET for many rows; absent rows are absent from the result."""
    if not ids:
        return {}
    blobs = r.hmget(keys.embeddings(TABLE_NAMES[table]), [row_key(i) for i in ids])
    return {i: decode_row(b, w) for i, b in zip(ids, blobs, strict=True) if b is not None}


def fetch_rows_and_accumulators(
    r: redis.Redis, keys: RedisKeys, wanted: dict[int, list[int]], w: int
) -> dict[int, tuple[dict[int, Row], dict[int, np.ndarray]]]:
    """Rows and Adagrad accumulators of several tables in one pipelined round trip."""
    pipe = r.pipeline(transaction=False)
    for table, ids in wanted.items():
        fields = [row_key(i) for i in ids]
        pipe.hmget(keys.embeddings(TABLE_NAMES[table]), fields)
        pipe.hmget(keys.optimizer(TABLE_NAMES[table]), fields)
    replies = pipe.execute()
    out = {}
    for n, (table, ids) in enumerate(wanted.items()):
        rows_raw, acc_raw = replies[2 * n], replies[2 * n + 1]
        rows = {i: decode_row(b, w) for i, b in zip(ids, rows_raw, strict=True) if b is not None}
        accs = {
            i: np.frombuffer(b, "<f4", w).copy()
            for i, b in zip(ids, acc_raw, strict=True)
            if b is not None
        }
        out[table] = (rows, accs)
    return out


def load_table(r: redis.Redis, keys: RedisKeys, table: int, w: int) -> dict[int, Row]:
    """Every row of a table (the worker's item table at start), scanned in chunks."""
    out: dict[int, Row] = {}
    for field, blob in r.hscan_iter(keys.embeddings(TABLE_NAMES[table]), count=5000):
        out[key_to_id(field)] = decode_row(blob, w)
    return out


def applied_offsets(r: redis.Redis, keys: RedisKeys) -> dict[int, int]:
    return {int(k): int(v) for k, v in r.hgetall(keys.ps_applied).items()}


def broadcast_offsets(r: redis.Redis, keys: RedisKeys) -> dict[int, int]:
    return {int(k): int(v) for k, v in r.hgetall(keys.ps_broadcast).items()}


def seed_rows(
    r: redis.Redis, keys: RedisKeys, table: int, ids: np.ndarray, rows: np.ndarray,
    version: int, event_ms: int, chunk: int = 5000,
) -> int:  # fmt: skip
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
