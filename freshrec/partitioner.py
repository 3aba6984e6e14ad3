"""Kafka's murmur2 partitioner, the Java client's and kafkajs's placement of keys.

FreshRec's own producers let librdkafka do this (``partitioner=murmur2_random``); this copy
routes records to an explicit partition (the streams app's repartition batches) and lets tests
check where keys landed.

>>> kafka_partition(b"u42", 8) == kafka_partition(b"u42", 8)
True
>>> import numpy as np, struct
>>> ids = np.array([1, -7, 2**62])
>>> row_partitions(ids, 8).tolist() == [kafka_partition(struct.pack("<q", i), 8) for i in ids.tolist()]
True
"""

import numpy as np

_M = np.uint32(0x5BD1E995)


def murmur2(data: bytes) -> int:
    m, r = 0x5BD1E995, 24
    h = (0x9747B28C ^ len(data)) & 0xFFFFFFFF
    n4 = len(data) // 4
    for i in range(n4):
        k = int.from_bytes(data[4 * i : 4 * i + 4], "little")
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    tail = data[4 * n4 :]
    if len(tail) == 3:
        h ^= tail[2] << 16
    if len(tail) >= 2:
        h ^= tail[1] << 8
    if len(tail) >= 1:
        h ^= tail[0]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h


def kafka_partition(key: bytes, partitions: int) -> int:
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def key_partitions(keys: list[bytes], partitions: int) -> np.ndarray:
    """``kafka_partition`` of each key, murmur2 computed in numpy for all keys of one length
    at a time (the streams app routes tens of thousands of new item ids a second).

    >>> keys = [b"", b"a", b"ab", b"abc", b"abcd", b"i12345", b"i7", b"i12346"]
    >>> key_partitions(keys, 7).tolist() == [kafka_partition(k, 7) for k in keys]
    True
    """
    out = np.empty(len(keys), np.int64)
    by_len: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        by_len.setdefault(len(k), []).append(i)
    for n, idx in by_len.items():
        raw = np.frombuffer(b"".join([keys[i] for i in idx]), np.uint8).reshape(len(idx), n)
        h = np.full(len(idx), (0x9747B28C ^ n) & 0xFFFFFFFF, np.uint32)
        n4 = n // 4
        words = np.ascontiguousarray(raw[:, : 4 * n4]).view("<u4").reshape(len(idx), n4)
        tail = raw[:, 4 * n4 :].astype(np.uint32)
        with np.errstate(over="ignore"):
            for i in range(n4):
                k = words[:, i] * _M
                k ^= k >> np.uint32(24)
                k *= _M
                h *= _M
                h ^= k
            if n % 4 == 3:
                h ^= tail[:, 2] << np.uint32(16)
            if n % 4 >= 2:
                h ^= tail[:, 1] << np.uint32(8)
            if n % 4 >= 1:
                h ^= tail[:, 0]
                h *= _M
            h ^= h >> np.uint32(13)
            h *= _M
            h ^= h >> np.uint32(15)
        out[idx] = ((h & np.uint32(0x7FFFFFFF)) % np.uint32(partitions)).astype(np.int64)
    return out


def row_partitions(ids: np.ndarray, partitions: int) -> np.ndarray:
    """``kafka_partition`` of many 8-byte little-endian row keys (``row_key``) at once:
    murmur2 over two 32-bit words in uint32 numpy arithmetic (it wraps like the ``&``)."""
    words = np.ascontiguousarray(ids, "<i8").view("<u4").reshape(-1, 2)
    h = np.full(len(words), (0x9747B28C ^ 8) & 0xFFFFFFFF, np.uint32)
    with np.errstate(over="ignore"):
        for i in (0, 1):
            k = words[:, i] * _M
            k ^= k >> np.uint32(24)
            k *= _M
            h *= _M
            h ^= k
        h ^= h >> np.uint32(13)
        h *= _M
        h ^= h >> np.uint32(15)
    return ((h & np.uint32(0x7FFFFFFF)) % np.uint32(partitions)).astype(np.int64)
