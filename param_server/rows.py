"""Embedding rows: layout, deterministic initialisation, and their Redis encoding. Pure.

A row of a ``dim``-dimensional model has ``dim + 1`` float32 columns. Item rows keep their
bias in the last column; user rows keep a constant 1 there, so score = σ(u·v) over the full
rows equals σ(u[:dim]·v[:dim] + b_item), and one table layout serves both.

A row found nowhere is created from its id alone: N(0, init_std) from a counter-based hash,
so every worker and parameter server creates the same row without talking to each other.

>>> import numpy as np
>>> r = initial_rows(np.array([42]), TABLE_USER, dim=4)
>>> r.shape, float(r[0, -1])
((1, 5), 1.0)
>>> bool((initial_rows(np.array([42]), TABLE_USER, dim=4) == r).all())
True
"""

from __future__ import annotations

import struct

import numpy as np

from freshrec.hashing import hash_normal
from schemas.rowbatch import TABLE_ITEM, TABLE_USER

INIT_SEED = 0x5EED
_KEY = struct.Struct("<q")

__all__ = ["TABLE_ITEM", "TABLE_USER"]


def width(dim: int) -> int:
    return dim + 1


def initial_rows(ids: np.ndarray, table: int, dim: int, init_std: float = 0.1) -> np.ndarray:
    rows = np.empty((len(ids), dim + 1), np.float32)
    rows[:, :dim] = hash_normal(INIT_SEED, 100 + table, np.asarray(ids, np.int64), dim) * init_std
    rows[:, dim] = 1.0 if table == TABLE_USER else 0.0
    return rows


def row_key(row_id: int) -> bytes:
    """The Redis hash field and Kafka partitioning key of a row: 8 bytes, little-endian."""
    return _KEY.pack(row_id)


def key_to_id(key: bytes) -> int:
    return _KEY.unpack(key)[0]


def encode_row(row: np.ndarray, version: int, event_ms: int) -> bytes:
    """float32 columns, then u64 version and i64 newest event time."""
    return np.ascontiguousarray(row, "<f4").tobytes() + struct.pack("<Qq", version, event_ms)


def encode_rows(rows: np.ndarray, versions: np.ndarray, event_ms: np.ndarray) -> list[bytes]:
    """``encode_row`` for many rows at once (one structured array, then one slice per row)."""
    n, w = rows.shape
    packed = np.empty(n, np.dtype([("row", "<f4", (w,)), ("version", "<u8"), ("event_ms", "<i8")]))
    packed["row"], packed["version"], packed["event_ms"] = rows, versions, event_ms
    raw = packed.tobytes()
    size = packed.dtype.itemsize
    return [raw[k * size : (k + 1) * size] for k in range(n)]


def decode_row(blob: bytes, w: int) -> tuple[np.ndarray, int, int]:
    if len(blob) != 4 * w + 16:
        raise ValueError(f"row blob of {len(blob)} bytes does not fit width {w}")
    row = np.frombuffer(blob, "<f4", w).copy()
    version, event_ms = struct.unpack_from("<Qq", blob, 4 * w)
    return row, version, event_ms
