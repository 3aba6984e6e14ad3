"""Redis commands over many fixed-width fields, packed with numpy.

An embedding row is a fixed number of bytes and its hash field is its 8-byte id, so an
``HSET`` or ``HMGET`` over tens of thousands of rows has a fixed layout per entry. redis-py
packs each argument in Python (about 3 µs per row and field pair, most of a parameter
server's flush); here the whole command is one ``uint8`` matrix filled column block by column
block. ``pack`` is the plain RESP encoding of a short command; the packing functions are pure,
``execute`` sends packed commands on one pooled connection and reads their replies.

>>> pack(b"HGET", b"k", b"f")
b'*3\\r\\n$4\\r\\nHGET\\r\\n$1\\r\\nk\\r\\n$1\\r\\nf\\r\\n'
>>> import numpy as np
>>> f = np.frombuffer(b"ab", np.uint8).reshape(2, 1)
>>> v = np.frombuffer(b"xyzw", np.uint8).reshape(2, 2)
>>> pack_fixed(b"HSET", b"k", f, v) == pack(b"HSET", b"k", b"a", b"xy", b"b", b"zw")
True
>>> pack_fixed(b"HMGET", b"k", f) == pack(b"HMGET", b"k", b"a", b"b")
True
>>> pack_pairs(b"HSET", b"k", [b"a", b"b"], [b"xy", b"zw"]) == pack_fixed(b"HSET", b"k", f, v)
True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import redis

_CRLF = np.frombuffer(b"\r\n", np.uint8)


def pack(*args: bytes) -> bytes:
    """One command in RESP: an array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def pack_pairs(command: bytes, key: bytes, fields: list[bytes], values: list[bytes]) -> bytes:
    """``command key f1 v1 f2 v2 ...`` for fields and values of any length."""
    if len(fields) != len(values):
        raise ValueError(f"{len(fields)} fields but {len(values)} values")
    return pack(command, key, *(x for pair in zip(fields, values, strict=True) for x in pair))


def pack_fixed(
    command: bytes, key: bytes, fields: np.ndarray, values: np.ndarray | None = None,
    prefix: tuple[bytes, ...] = (),
) -> bytes:  # fmt: skip
    """``command key [prefix...] f1 [v1] f2 [v2] ...`` with ``fields`` (n, a) and ``values``
    (n, b) as ``uint8`` matrices: every field is ``a`` bytes, every value ``b``.

    >>> f = np.frombuffer(b"ab", np.uint8).reshape(2, 1)
    >>> pack_fixed(b"HPEXPIRE", b"k", f, prefix=(b"500", b"FIELDS", b"2")) == pack(
    ...     b"HPEXPIRE", b"k", b"500", b"FIELDS", b"2", b"a", b"b")
    True
    """
    blocks = [fields] if values is None else [fields, values]
    n = len(fields)
    parts: list[np.ndarray] = []
    for block in blocks:
        block = np.ascontiguousarray(block, np.uint8)
        if block.ndim != 2 or len(block) != n:
            raise ValueError(f"expected ({n}, width) uint8, got {block.shape}")
        header = np.frombuffer(b"$%d\r\n" % block.shape[1], np.uint8)
        parts += [header, block, _CRLF]
    width = sum(p.shape[-1] for p in parts)
    out = np.empty((n, width), np.uint8)
    col = 0
    for p in parts:
        out[:, col : col + p.shape[-1]] = p
        col += p.shape[-1]
    head = b"*%d\r\n" % (2 + len(prefix) + n * len(blocks))
    head += b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in (command, key, *prefix))
    return head + out.tobytes()


def execute(client: redis.Redis, payload: bytes, replies: int) -> list:
    """Send already packed commands on one pooled connection and read ``replies`` replies.
    An error reply raises (``redis.ResponseError``); the connection is then dropped, so no
    unread reply is left for its next user. Connection errors and timeouts raise as with any
    redis-py call."""
    with pooled_connection(client) as conn:
        conn.send_packed_command([payload])
        return [conn.read_response() for _ in range(replies)]


@contextlib.contextmanager
def pooled_connection(client: redis.Redis) -> Iterator:
    """A connection of ``client``'s pool for several packed round trips; dropped (not
    returned for reuse) if anything raises, so no unread reply is left for its next user."""
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        yield conn
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


class Pipelined:
    """Packed commands sent on one connection without waiting for their replies: each
    ``send`` first reads the replies of the one before (by then they have usually arrived),
    so a loop that writes once per batch never stands still for a round trip. ``drain`` reads
    what is outstanding; call it before anything that depends on the writes having happened
    (committing the offsets of their input). An error reply raises there (the other replies
    read first); a connection error raises too, and the connection is dropped."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self.conn = None
        self.pending = 0

    def send(self, payload: bytes, replies: int) -> None:
        self.drain()
        if self.conn is None:
            self.conn = self.client.connection_pool.get_connection()
        try:
            self.conn.send_packed_command([payload])
        except BaseException:
            self._drop()
            raise
        self.pending = replies

    def drain(self) -> None:
        if not self.pending:
            return
        error = None
        try:
            for _ in range(self.pending):
                try:
                    self.conn.read_response()
                except redis.ResponseError as exc:
                    error = error or exc
        except BaseException:
            self._drop()
            raise
        finally:
            self.pending = 0
        if error is not None:
            raise error

    def close(self) -> None:
        try:
            self.drain()
        finally:
            if self.conn is not None:
                self.client.connection_pool.release(self.conn)
                self.conn = None

    def _drop(self) -> None:
        self.pending = 0
        if self.conn is not None:
            self.conn.disconnect()
            self.client.connection_pool.release(self.conn)
            self.conn = None


async def execute_async(client, payload: bytes, replies: int) -> list:
    """``execute`` for a ``redis.asyncio`` client."""
    pool = client.connection_pool
    conn = await pool.get_connection()
    try:
        await conn.send_packed_command([payload])
        return [await conn.read_response() for _ in range(replies)]
    except BaseException:
        await conn.disconnect()
        raise
    finally:
        await pool.release(conn)
