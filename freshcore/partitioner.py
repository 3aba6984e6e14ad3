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

FEW = 8
"""Up to this many keys are hashed one by one in Python: numpy's fixed cost per operation
(a few dozen of them) is more than a per-key loop's there (~35 against ~2 µs for one row
key). A serving batch of one asks for one user row and a few anchors."""


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
    """``kafka_partition`` of each key, murmur2 in numpy over the whole list at once (the
    streams app routes every event by its item id; hashing beats looking ids up in a large
    dict, which misses the cache). Keys are laid out as rows of a zero-padded byte matrix;
    each 4-byte word or tail byte is mixed in where the key is long enough.

    >>> keys = [b"", b"a", b"ab", b"abc", b"abcd", b"i12345", b"i7", b"a" + bytes(1), bytes(5)]
    >>> key_partitions(keys, 7).tolist() == [kafka_partition(k, 7) for k in keys]
    True
    """
    if len(keys) <= FEW:
        return np.fromiter((kafka_partition(k, partitions) for k in keys), np.int64, len(keys))
    # "S" storage keeps every byte (trailing NULs included); ``lens`` says where keys end
    padded, lens = _padded(keys, "S")
    return _murmur2_rows(padded.view(np.uint8).reshape(len(keys), -1), lens, partitions)


def str_partitions(keys: list[str], partitions: int) -> np.ndarray:
    """``key_partitions`` of the UTF-8 encodings of ``keys``; ASCII keys go into the byte
    matrix without an ``encode`` each.

    >>> keys = ["i1", "i12345", "", "é", "ü-ü", "abcdefghi"]
    >>> str_partitions(keys, 5).tolist() == [kafka_partition(k.encode(), 5) for k in keys]
    True
    """
    if len(keys) <= FEW:
        return key_partitions([k.encode() for k in keys], partitions)
    padded, lens = _padded(keys, "U")
    points = padded.view(np.uint32).reshape(len(keys), -1)
    if points.max() >= 128:  # not ASCII: characters and bytes differ
        return key_partitions([k.encode() for k in keys], partitions)
    return _murmur2_rows(points.astype(np.uint8), lens, partitions)


def _padded(keys: list, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """``keys`` as a numpy array of ``kind`` ("S" bytes, "U" code points) zero-padded to a
    width that is a multiple of 4, and each key's length."""
    lens = np.fromiter(map(len, keys), np.int64, len(keys))
    width = max(4, -(-int(lens.max()) // 4) * 4)
    return np.array(keys, dtype=f"{kind}{width}"), lens


def _murmur2_rows(raw: np.ndarray, lens: np.ndarray, partitions: int) -> np.ndarray:
    """Kafka's partition of each row of ``raw`` (uint8, width a multiple of 4, zero-padded),
    the first ``lens[i]`` bytes of row i being its key."""
    width = raw.shape[1]
    words = raw.view("<u4")
    n4 = lens // 4
    rem = lens % 4
    h = ((0x9747B28C ^ lens) & 0xFFFFFFFF).astype(np.uint32)
    with np.errstate(over="ignore"):
        for i in range(width // 4):
            k = words[:, i] * _M
            k ^= k >> np.uint32(24)
            k *= _M
            np.copyto(h, (h * _M) ^ k, where=n4 > i)
        at = np.minimum(4 * n4[:, None] + np.arange(3), width - 1)
        tail = np.take_along_axis(raw, at, axis=1).astype(np.uint32)
        tail[rem < 3, 2] = 0
        tail[rem < 2, 1] = 0
        h ^= (tail[:, 2] << np.uint32(16)) | (tail[:, 1] << np.uint32(8))
        np.copyto(h, (h ^ tail[:, 0]) * _M, where=rem >= 1)
        h ^= h >> np.uint32(13)
        h *= _M
        h ^= h >> np.uint32(15)
    return ((h & np.uint32(0x7FFFFFFF)) % np.uint32(partitions)).astype(np.int64)


def row_partitions(ids: np.ndarray, partitions: int) -> np.ndarray:
    """``kafka_partition`` of many 8-byte little-endian row keys (``row_key``) at once:
    murmur2 over two 32-bit words in uint32 numpy arithmetic (it wraps like the ``&``).

    >>> ids = np.array([0, 1, -1, 2**62, 123456789] * 2)
    >>> keys = [int(i).to_bytes(8, "little", signed=True) for i in ids]  # ``row_key``
    >>> row_partitions(ids, 7).tolist() == [kafka_partition(k, 7) for k in keys]
    True
    >>> row_partitions(ids[:3], 7).tolist() == row_partitions(ids, 7)[:3].tolist()
    True
    """
    if len(ids) <= FEW:
        keys = np.ascontiguousarray(ids, "<i8")
        return np.fromiter(
            (kafka_partition(k.tobytes(), partitions) for k in keys), np.int64, len(keys)
        )
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
