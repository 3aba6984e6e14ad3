"""The binary layout of gradients and embedding updates: round trip and corruption detection."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.ids import row_id
from schemas.rowbatch import (
    KIND_GRADIENTS,
    KIND_UPDATES,
    TABLE_ITEM,
    TABLE_USER,
    CorruptBatch,
    RowBatch,
)


def make_batch(n=5, dim=8, kind=KIND_UPDATES, table=TABLE_USER) -> RowBatch:
    rng = np.random.default_rng(0)
    return RowBatch(
        kind,
        table,
        rng.integers(-(2**62), 2**62, n),
        rng.standard_normal((n, dim)).astype(np.float32),
        np.arange(n, dtype=np.uint64) + 10,
        np.full(n, 1_767_225_600_000, np.int64),
        partition=3,
        offset=99,
        created_ms=1_767_225_600_123,
    )


@pytest.mark.parametrize("kind", [KIND_GRADIENTS, KIND_UPDATES])
@pytest.mark.parametrize("table", [TABLE_USER, TABLE_ITEM])
def test_round_trip_is_bit_exact(kind, table):
    b = make_batch(kind=kind, table=table)
    back = RowBatch.decode(b.encode())
    assert (back.kind, back.table, back.dim, len(back)) == (kind, table, 8, 5)
    assert (back.partition, back.offset, back.created_ms) == (3, 99, 1_767_225_600_123)
    np.testing.assert_array_equal(back.ids, b.ids)
    np.testing.assert_array_equal(back.rows, b.rows)
    np.testing.assert_array_equal(back.versions, b.versions)
    np.testing.assert_array_equal(back.event_ms, b.event_ms)
    np.testing.assert_array_equal(back.oldest_ms, b.oldest_ms)


def test_oldest_event_times_round_trip_and_a_version_1_batch_still_reads():
    import dataclasses
    import struct
    import zlib

    b = make_batch(n=3, dim=4)
    oldest = np.array([1, 2, 3], np.int64)
    back = RowBatch.decode(dataclasses.replace(b, oldest_ms=oldest).encode())
    assert back.oldest_ms.tolist() == [1, 2, 3]
    # version 1: the same header and body without the oldest times (a worker or parameter
    # server of the previous release still running during an upgrade)
    data = bytearray(b.encode()[: -(4 + 8 * 3)])  # drop the oldest times and the checksum
    struct.pack_into("<H", data, 4, 1)
    data += struct.pack("<I", zlib.crc32(bytes(data)))
    v1 = RowBatch.decode(bytes(data))
    assert v1.event_ms.tolist() == b.event_ms.tolist() == v1.oldest_ms.tolist()


def test_half_precision_rows_halve_the_rows_bytes_and_round_trip_within_float16():
    import struct

    b = make_batch(n=50, dim=64)
    full, half = b.encode(), b.encode(half=True)
    assert len(full) - len(half) == 50 * 64 * 2
    assert struct.unpack_from("<H", half, 4) == (3,) and struct.unpack_from("<H", full, 4) == (2,)
    back = RowBatch.decode(half)
    assert back.rows.dtype == np.float32
    np.testing.assert_array_equal(back.rows, b.rows.astype(np.float16).astype(np.float32))
    np.testing.assert_allclose(back.rows, b.rows, rtol=2**-11, atol=2**-24)
    np.testing.assert_array_equal(back.ids, b.ids)
    np.testing.assert_array_equal(back.oldest_ms, b.oldest_ms)
    for cut in range(0, len(half), 97):
        with pytest.raises(CorruptBatch):
            RowBatch.decode(half[:cut])


def test_rows_float16_cannot_hold_are_sent_as_float32():
    import dataclasses

    b = make_batch(n=3, dim=4)
    for value in (1e5, np.inf, np.nan):
        rows = b.rows.copy()
        rows[1, 2] = value
        wide = dataclasses.replace(b, rows=rows)
        assert not wide.fits_half()
        data = wide.encode(half=True)
        assert data == wide.encode()  # version 2, float32: nothing turned to infinity
        np.testing.assert_array_equal(RowBatch.decode(data).rows, rows)


def test_a_row_format_that_disagrees_with_the_version_is_refused():
    import struct
    import zlib

    for version, row_format in ((3, 0), (2, 1), (3, 7)):
        data = bytearray(make_batch(n=2, dim=4).encode(half=version == 3 and row_format == 0))
        struct.pack_into("<HBBHH", data, 4, version, KIND_UPDATES, TABLE_USER, 4, row_format)
        data[-4:] = struct.pack("<I", zlib.crc32(bytes(data[:-4])))
        with pytest.raises(CorruptBatch, match="row format"):
            RowBatch.decode(bytes(data))


def test_empty_batch_round_trips():
    b = make_batch(n=0)
    assert len(RowBatch.decode(b.encode())) == 0


def test_every_truncation_is_detected():
    data = make_batch(n=3, dim=4).encode()
    for cut in range(len(data)):
        with pytest.raises(CorruptBatch):
            RowBatch.decode(data[:cut])


def test_every_single_byte_flip_in_the_body_is_detected():
    data = bytearray(make_batch(n=3, dim=4).encode())
    for pos in range(len(data)):
        corrupted = bytearray(data)
        corrupted[pos] ^= 0x5A
        with pytest.raises(CorruptBatch):
            RowBatch.decode(bytes(corrupted))


def test_bad_magic_and_unknown_version_are_named():
    data = bytearray(make_batch().encode())
    with pytest.raises(CorruptBatch, match="magic"):
        RowBatch.decode(b"JUNK" + bytes(data[4:]))
    data[4] = 9
    with pytest.raises(CorruptBatch, match="version"):
        RowBatch.decode(bytes(data))


def test_row_ids_are_stable_and_signed_64_bit():
    assert row_id("u1") == row_id("u1")
    assert -(2**63) <= row_id("i123456") < 2**63
    assert len({row_id(f"u{i}") for i in range(10_000)}) == 10_000


def test_row_ids_of_a_batch_are_row_id_of_each_key():
    from schemas.ids import row_ids

    keys = ["u1", "u2", "u1", "é-ü", "", "x" * 300, "u2"]
    got = row_ids(keys)
    assert got.dtype == np.int64 and got.tolist() == [row_id(k) for k in keys]
    assert row_ids(keys[:2]).tolist() == [row_id("u1"), row_id("u2")]  # all distinct
    assert row_ids([]).tolist() == []


def test_a_row_id_memo_gives_row_id_of_each_key_across_batches_and_restarts():
    import random

    from schemas.ids import RowIdMemo

    rng = random.Random(3)
    pool = [f"i{n}" for n in range(40)] + ["é", "", "x" * 300]
    memo = RowIdMemo(size=16)  # small: batches overflow it and it starts over
    widest = 0
    for _ in range(200):
        keys = [rng.choice(pool) for _ in range(rng.randint(0, 30))]
        assert memo(keys).tolist() == [row_id(k) for k in keys]
        widest = max(widest, len(set(keys)))
        assert len(memo) <= max(16, widest)  # bounded: only a batch wider than it passes
    with pytest.raises(ValueError):
        RowIdMemo(size=0)


def test_encoding_is_the_documented_layout_whatever_the_arrays_given():
    """Byte for byte the module docstring's layout (header, the five arrays in order, crc32
    over both), also from arrays of other dtypes and from strided views."""
    import struct
    import zlib

    rng = np.random.default_rng(3)
    wide = rng.standard_normal((4, 16))  # float64, every other column taken: strided
    b = RowBatch(
        KIND_GRADIENTS,
        TABLE_ITEM,
        np.array([5, -6, 7, 8], np.int32),
        wide[:, ::2],
        [1, 2, 3, 4],
        np.arange(4) + 1_767_225_600_000,
        created_ms=12,
        oldest_ms=[9, 10, 11, 12],
    )
    header = struct.pack(
        "<4sHBBHHIiqq", b"FRRB", 2, KIND_GRADIENTS, TABLE_ITEM, 8, 0, 4, -1, -1, 12
    )
    body = (
        np.array([5, -6, 7, 8], "<i8").tobytes()
        + wide[:, ::2].astype("<f4").tobytes()
        + np.array([1, 2, 3, 4], "<u8").tobytes()
        + (np.arange(4) + 1_767_225_600_000).astype("<i8").tobytes()
        + np.array([9, 10, 11, 12], "<i8").tobytes()
    )
    assert b.encode() == header + body + struct.pack("<I", zlib.crc32(header + body))
