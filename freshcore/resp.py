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
from collections import deque
from collections.abc import Iterator

import numpy as np
import redis

_CRLF = np.frombuffer(b"\r\n", np.uint8)


def pack(*args: bytes) -> bytes:
    """One command in RESP: an array of bulk strings."""
    return _head(len(args), *args)


def _head(n_args: int, *first: bytes) -> bytes:
    """A command's array header for ``n_args`` arguments and its ``first`` ones, packed."""
    return b"*%d\r\n" % n_args + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in first)


def pack_pairs(command: bytes, key: bytes, fields: list[bytes], values: list[bytes]) -> bytes:
    """``command key f1 v1 f2 v2 ...`` for fields and values of any length."""
    if len(fields) != len(values):
        raise ValueError(f"{len(fields)} fields but {len(values)} values")
    return pack(command, key, *(x for pair in zip(fields, values, strict=True) for x in pair))


def pack_fixed(
    command: bytes,
    key: bytes,
    fields: np.ndarray,
    values: np.ndarray | None = None,
    prefix: tuple[bytes, ...] = (),
) -> bytes:
    """``command key [prefix...] f1 [v1] f2 [v2] ...`` with ``fields`` (n, a) and ``values``
    (n, b) as ``uint8`` matrices: every field is ``a`` bytes, every value ``b``.

    >>> f = np.frombuffer(b"ab", np.uint8).reshape(2, 1)
    >>> pack_fixed(b"HPEXPIRE", b"k", f, prefix=(b"500", b"FIELDS", b"2")) == pack(
    ...     b"HPEXPIRE", b"k", b"500", b"FIELDS", b"2", b"a", b"b")
    True
    """
    blocks = [fields] if values is None else [fields, values]
    head = _head(2 + len(prefix) + len(fields) * len(blocks), command, key, *prefix)
    return head + _fixed_body(blocks).tobytes()


def _fixed_body(blocks: list[np.ndarray]) -> np.ndarray:
    """One row per entry: each block's bulk string (header, bytes, CRLF) side by side."""
    n = len(blocks[0])
    parts: list[np.ndarray] = []
    for block in blocks:
        block = np.asarray(block, np.uint8)
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
    return out


class Fields:
    """Distinct hash fields of any length (item ids), grouped by length once for several
    ``pack_ragged`` commands over the same fields: within a group every field has one width,
    so each group packs as fixed-width columns (``pack_fixed``'s layout).

    >>> f = Fields([b"bcd", b"a", b"efg"])
    >>> [(m.tobytes(), rows.tolist()) for m, rows in f.groups]
    [(b'a', [1]), (b'bcdefg', [0, 2])]
    """

    def __init__(self, fields: list[bytes]) -> None:
        self.n = len(fields)
        lengths = np.fromiter(map(len, fields), np.int64, self.n)
        order = np.argsort(lengths, kind="stable")
        cuts = np.flatnonzero(np.diff(lengths[order])) + 1
        self.groups: list[tuple[np.ndarray, np.ndarray]] = []
        for rows in np.split(order, cuts) if self.n else []:
            width = int(lengths[rows[0]])
            flat = b"".join([fields[i] for i in rows.tolist()])
            self.groups.append((np.frombuffer(flat, np.uint8).reshape(len(rows), width), rows))

    def __len__(self) -> int:
        return self.n


def pack_ragged(command: bytes, key: bytes, fields: Fields, values: np.ndarray) -> bytes:
    """``command key f1 v1 f2 v2 ...`` with distinct fields of any length and every value
    ``values``' width (an (n, b) ``uint8`` matrix, row i for field i): ``pack_pairs``' command
    with the pairs grouped by field length, which a hash does not tell apart, built with
    numpy column blocks instead of formatting each pair in Python.

    >>> v = np.frombuffer(b"xyzw", np.uint8).reshape(2, 2)
    >>> pack_ragged(b"HSET", b"k", Fields([b"bcd", b"a"]), v) == pack_pairs(
    ...     b"HSET", b"k", [b"a", b"bcd"], [b"zw", b"xy"])
    True
    """
    n = len(fields)
    values = np.asarray(values, np.uint8)
    if values.ndim != 2 or len(values) != n:
        raise ValueError(f"expected ({n}, width) uint8 values, got {values.shape}")
    return _head(2 + 2 * n, command, key) + b"".join(
        _fixed_body([ids, values[rows]]).tobytes() for ids, rows in fields.groups
    )


FLOAT_TEXT_WIDTH = 22
_DIGITS5 = np.frombuffer(b"".join(b"%05d" % i for i in range(100_000)), np.uint8).reshape(
    100_000, 5
)


def float_text(values) -> np.ndarray:
    """Floats as fixed-width text, ``[+-]d.ddddddddddddddE[+-]ddd`` (15 significant digits,
    what a float64 holds; 22 bytes each), one row per value: what any client's float parser
    reads (Python ``float``, Java ``Double.parseDouble``, JS ``parseFloat``, Go
    ``strconv.ParseFloat``), made in numpy so that a whole column goes into ``pack_ragged``
    without a Python call per value. Magnitudes below 1e-300 are written as zero; values must
    be finite and below 1e300 in magnitude.

    >>> [bytes(r).decode() for r in float_text([0.0, 1.0, -2.5e-7, 123456.789])]
    ['+0.00000000000000e+000', '+1.00000000000000e+000', '-2.50000000000000e-007', '+1.23456789000000e+005']
    """
    v = np.asarray(values, np.float64).ravel()
    a = np.abs(v)
    if not (a < 1e300).all():
        raise ValueError("float_text takes finite values below 1e300 in magnitude")
    zero = a < 1e-300
    a = np.where(zero, 1.0, a)
    e = np.floor(np.log10(a)).astype(np.int64)
    m = np.rint(a / np.power(10.0, e) * 1e14).astype(np.int64)
    # log10 can land one off near powers of ten, and rounding can carry to 10.000…
    fix = (m < 10**14) | (m >= 10**15)
    if fix.any():
        e[fix] += np.where(m[fix] < 10**14, -1, 1)
        m[fix] = np.rint(a[fix] / np.power(10.0, e[fix]) * 1e14).astype(np.int64)
        over = m >= 10**15  # 9.99999999999999995 rounds up to 10
        m[over] //= 10
        e[over] += 1
    m[zero] = 0
    e[zero] = 0
    out = np.empty((len(v), FLOAT_TEXT_WIDTH), np.uint8)
    hi, rest = np.divmod(m, 10**10)  # 15 digits: 5 + 5 + 5, each from a table
    mid, lo = np.divmod(rest, 10**5)
    first = _DIGITS5[hi]
    out[:, 0] = np.where(v < 0, ord("-"), ord("+"))
    out[:, 1] = first[:, 0]
    out[:, 2] = ord(".")
    out[:, 3:7] = first[:, 1:]
    out[:, 7:12] = _DIGITS5[mid]
    out[:, 12:17] = _DIGITS5[lo]
    out[:, 17] = ord("e")
    out[:, 18] = np.where(e < 0, ord("-"), ord("+"))
    out[:, 19:22] = _DIGITS5[np.abs(e)][:, 2:]
    return out


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
    """Packed commands sent on one connection without waiting for their replies. Each
    ``send`` reads the replies that have already arrived (never waiting, unless more than
    ``max_pending`` are outstanding), so a loop that writes once per batch does not stand
    still while Redis works through someone else's long transaction. ``drain`` reads all that
    is outstanding; call it before anything that depends on the writes having happened
    (committing the offsets of their input). An error reply raises there or at the ``send``
    that reads it (the other replies read first). A connection error raises too; the
    payloads whose replies had not all arrived are kept, and sent again on a new connection
    by the next ``send`` or ``drain`` (at least once: one that Redis had applied is applied
    twice)."""

    def __init__(self, client: redis.Redis, max_pending: int = 100_000) -> None:
        self.client = client
        self.max_pending = max_pending
        self.conn = None
        self.pending = 0
        self._unacked: deque[list] = deque()  # [payload, replies, replies still to read]
        self._broken = False

    def send(self, payload: bytes, replies: int) -> None:
        if self._broken:
            self._resend()
        self._read(wait=self.pending > self.max_pending)
        if self.conn is None:
            self.conn = self.client.connection_pool.get_connection()
        try:
            self.conn.send_packed_command([payload])
        except BaseException:
            self._drop()
            raise
        self.pending += replies
        if replies:
            self._unacked.append([payload, replies, replies])

    def drain(self) -> None:
        if self._broken:
            self._resend()
        self._read(wait=True)

    def _resend(self) -> None:
        self.conn = self.client.connection_pool.get_connection()
        try:
            for entry in self._unacked:
                self.conn.send_packed_command([entry[0]])
                entry[2] = entry[1]
        except BaseException:
            self._drop()
            raise
        self.pending = sum(e[1] for e in self._unacked)
        self._broken = False

    def _read(self, wait: bool) -> None:
        error = None
        try:
            while self.pending and (wait or self.conn.can_read(timeout=0)):
                self.pending -= 1
                try:
                    self.conn.read_response()
                except redis.ResponseError as exc:
                    error = error or exc
                head = self._unacked[0]
                head[2] -= 1
                if head[2] == 0:
                    self._unacked.popleft()
        except BaseException:
            self._drop()
            raise
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
        self._broken = bool(self._unacked)
        if self.conn is not None:
            self.conn.disconnect()
            self.client.connection_pool.release(self.conn)
            self.conn = None


async def execute_async(client, payload: bytes, replies: int) -> list:
    """``execute`` for a ``redis.asyncio`` client."""
    pool = client.connection_pool
    conn = await pool.get_connection()
    try:
        return await exchange_async(conn, payload, replies)
    finally:
        await pool.release(conn)


async def exchange_async(conn, payload: bytes, replies: int) -> list:
    """Send packed commands on an asyncio connection and read ``replies`` replies; the
    connection is dropped if anything raises, so no unread reply is left on it."""
    try:
        await conn.send_packed_command([payload])
        return [await conn.read_response() for _ in range(replies)]
    except BaseException:
        await conn.disconnect()
        raise
