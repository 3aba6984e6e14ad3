"""Embedding rows: layout, deterministic initialisation, and their Redis encoding. Pure.

A row of a ``dim``-dimensional model has ``dim + 1`` float32 columns. Item rows keep their
bias in the last column; user rows keep a constant 1 there, so score = σ(u·v) over the full
rows equals σ(u[:dim]·v[:dim] + b_item), and one table layout serves both.

A row found nowhere is created from its id alone: uniform with mean 0 and standard deviation
``init_std`` from a counter-based hash, so every worker and parameter server creates the
same row without talking to each other (and cheaply: a parameter server creates tens of
thousands of rows a second when new users arrive).

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

from schemas.hashing import hash_uniform_rows
from schemas.rowbatch import TABLE_ITEM, TABLE_USER

INIT_SEED = 0x5EED
_KEY = struct.Struct("<q")

__all__ = ["TABLE_ITEM", "TABLE_USER"]


def width(dim: int) -> int:
    return dim + 1


def initial_rows(ids: np.ndarray, table: int, dim: int, init_std: float = 0.1) -> np.ndarray:
    rows = np.empty((len(ids), dim + 1), np.float32)
    u = hash_uniform_rows(INIT_SEED, 100 + table, np.asarray(ids, np.int64), dim)
    half_width = np.float32(init_std * 3**0.5)  # uniform on [-a, a] has std a / sqrt(3)
    rows[:, :dim] = (u - np.float32(0.5)) * (2 * half_width)
    rows[:, dim] = 1.0 if table == TABLE_USER else 0.0
    return rows


VERSION_UPDATE_BITS = 20


def version_floor(event_ms: np.ndarray) -> np.ndarray:
    """The version a row starts from when the parameter server creates it (new, or expired
    and back): the creating gradient's event time in seconds, shifted left by 20 bits. A row
    re-created after expiry is therefore newer than anything its earlier life reached (unless
    that life saw 2^20 updates per second), so workers holding the old row install the new
    one; the low 20 bits count updates since creation.

    >>> int(version_floor(np.array([1_000_999]))[0]) == 1000 << VERSION_UPDATE_BITS
    True
    >>> int(updates_since_creation(version_floor(np.array([5_000]))[0] + 3))
    3
    """
    seconds = np.maximum(np.asarray(event_ms, np.int64), 0) // 1000
    return seconds.astype(np.uint64) << np.uint64(VERSION_UPDATE_BITS)


def updates_since_creation(version):
    """The update count in a version (mod 2^20); seeded rows (version 1) count from 0."""
    return np.asarray(version, np.uint64) & np.uint64((1 << VERSION_UPDATE_BITS) - 1)


def row_key(row_id: int) -> bytes:
    """The Redis hash field and Kafka partitioning key of a row: 8 bytes, little-endian."""
    return _KEY.pack(row_id)


def key_to_id(key: bytes) -> int:
    return _KEY.unpack(key)[0]


def encode_row(row: np.ndarray, version: int, event_ms: int) -> bytes:
    """float32 columns, then u64 version and i64 newest event time."""
    return np.ascontiguousarray(row, "<f4").tobytes() + struct.pack("<Qq", version, event_ms)


def _blob_dtype(w: int) -> np.dtype:
    return np.dtype([("row", "<f4", (w,)), ("version", "<u8"), ("event_ms", "<i8")])


def encode_rows_matrix(rows: np.ndarray, versions: np.ndarray, event_ms: np.ndarray) -> np.ndarray:
    """``encode_row`` for many rows at once: (n, 4·w + 16) ``uint8``, one blob per line."""
    n, w = rows.shape
    packed = np.empty(n, _blob_dtype(w))
    packed["row"], packed["version"], packed["event_ms"] = rows, versions, event_ms
    return packed.view(np.uint8).reshape(n, -1)


def encode_rows(rows: np.ndarray, versions: np.ndarray, event_ms: np.ndarray) -> list[bytes]:
    """``encode_row`` for many rows at once (one structured array, then one slice per row)."""
    return [line.tobytes() for line in encode_rows_matrix(rows, versions, event_ms)]


def key_matrix(ids: np.ndarray) -> np.ndarray:
    """``row_key`` for many ids: (n, 8) ``uint8``."""
    return np.ascontiguousarray(ids, "<i8").view(np.uint8).reshape(len(ids), 8)


def decode_rows(blobs: list[bytes | None], w: int):
    """``decode_row`` for many blobs, ``None`` for absent ones: (found mask, rows, versions,
    newest event times) for the found ones, in order."""
    found = np.fromiter((b is not None for b in blobs), bool, len(blobs))
    present = [b for b in blobs if b is not None]
    size = 4 * w + 16
    if any(len(b) != size for b in present):
        bad = next(len(b) for b in present if len(b) != size)
        raise ValueError(f"row blob of {bad} bytes does not fit width {w}")
    packed = np.frombuffer(b"".join(present), _blob_dtype(w))
    return (
        found,
        packed["row"].copy(),
        packed["version"].astype(np.uint64),
        packed["event_ms"].astype(np.int64),
    )


def decode_row(blob: bytes, w: int) -> tuple[np.ndarray, int, int]:
    if len(blob) != 4 * w + 16:
        raise ValueError(f"row blob of {len(blob)} bytes does not fit width {w}")
    row = np.frombuffer(blob, "<f4", w).copy()
    version, event_ms = struct.unpack_from("<Qq", blob, 4 * w)
    return row, version, event_ms
