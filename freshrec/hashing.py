"""Counter-based hashing to numbers: deterministic, vectorised, no state. Pure.

>>> bool(hash_uniform(1, 2, np.array([5, 5, 6]))[0] == hash_uniform(1, 2, np.array([5]))[0])
True
"""

from __future__ import annotations

import numpy as np

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective 64-bit mixer (Steele et al.); vectorised over uint64 arrays."""
    with np.errstate(over="ignore"):
        z = (x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)) & _M64
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
        return z ^ (z >> np.uint64(31))


def hash_uniform(seed: int, stream: int, idx: np.ndarray) -> np.ndarray:
    """Uniform [0, 1) floats, a pure function of (seed, stream, idx)."""
    with np.errstate(over="ignore"):
        raw = np.asarray(idx).astype(np.int64).view(np.uint64)
        key = splitmix64(raw * np.uint64(0x100000001B3) + np.uint64(stream))
        key = splitmix64(key ^ np.uint64(seed & 0xFFFFFFFFFFFFFFFF))
    return (key >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def hash_normal(seed: int, stream: int, idx: np.ndarray, dim: int) -> np.ndarray:
    """Standard normals of shape (len(idx), dim), a pure function of (seed, stream, idx)."""
    idx = np.asarray(idx).astype(np.int64).view(np.uint64)
    cols = np.arange(dim, dtype=np.uint64)
    with np.errstate(over="ignore"):
        flat = (idx[:, None] * np.uint64(2 * dim) + cols[None, :] * np.uint64(2)).ravel()
    u1 = hash_uniform(seed, stream, flat.view(np.int64))
    u2 = hash_uniform(seed, stream, (flat + np.uint64(1)).view(np.int64))
    z = np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * np.pi * u2)
    return z.reshape(len(idx), dim)
