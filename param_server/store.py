"""Rows and optimizer state in Redis (synchronous client): the global truth's layout."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import redis

from freshrec.rediskeys import RedisKeys
from freshrec.resp import execute, pack, pack_fixed, pooled_connection
from schemas.rowbatch import TABLE_NAMES
from schemas.rows import (
    decode_rows,
    encode_rows_matrix,
    key_matrix,
)

Row = tuple[np.ndarray, int, int]


@dataclass
class StoredRows:
    """What Redis holds for some ids of one table: rows where ``found``, accumulators where
    ``has_accum`` (both compacted to the found ones, in id order)."""

    found: np.ndarray
    rows: np.ndarray
    versions: np.ndarray
    event_ms: np.ndarray
    has_accum: np.ndarray
    accum: np.ndarray


def fetch_rows_and_accumulators(
    r: redis.Redis, keys: RedisKeys, wanted: dict[int, np.ndarray], w: int
) -> dict[int, StoredRows]:
    """Rows and Adagrad accumulators of several tables in one round trip (HMGETs packed
    with numpy, decoded in one pass)."""
    payload = []
    for table, ids in wanted.items():
        fields = key_matrix(np.asarray(ids, np.int64))
        name = TABLE_NAMES[table]
        payload.append(pack_fixed(b"HMGET", keys.embeddings(name).encode(), fields))
        payload.append(pack_fixed(b"HMGET", keys.optimizer(name).encode(), fields))
    replies = execute(r, b"".join(payload), len(payload))
    out = {}
    for n, table in enumerate(wanted):
        found, rows, versions, event_ms = decode_rows(replies[2 * n], w)
        acc_raw = replies[2 * n + 1]
        has_accum = np.fromiter((b is not None for b in acc_raw), bool, len(acc_raw))
        accum = np.frombuffer(b"".join(b for b in acc_raw if b is not None), "<f4")
        out[table] = StoredRows(found, rows, versions, event_ms, has_accum, accum.reshape(-1, w))
    return out


HSETEX = "HSETEX"
"""Fields written with their time-to-live in one command (Redis 8.0+, Valkey 9.0+)."""
HPEXPIRE = "HPEXPIRE"
"""Fields written, then given their time-to-live (Redis 7.4+)."""


def pack_persist(
    keys: RedisKeys,
    tables: dict[int, tuple[np.ndarray, ...]],
    applied: dict[int, int],
    ttl_ms: int = 0,
    expiry: str | None = HSETEX,
) -> tuple[bytes, int]:
    """One MULTI/EXEC, packed, and the number of replies it gets: for each table (ids, rows,
    accumulators, versions, event times) the rows and accumulators — with ``ttl_ms`` and an
    ``expiry`` command (``HSETEX`` or ``HPEXPIRE``, see ``field_expiry``), each field expires
    that long after this write — and the applied offset of each partition. A snapshot, to
    send (again, if a connection broke) whenever: see ``persist_fenced``."""
    commands = [pack(b"MULTI")]
    for table, (ids, rows, accum, versions, event_ms) in tables.items():
        name = TABLE_NAMES[table]
        fields = key_matrix(ids)
        blobs = encode_rows_matrix(rows, versions, event_ms)
        accs = np.ascontiguousarray(accum, "<f4").view(np.uint8).reshape(len(ids), -1)
        for key, values in ((keys.embeddings(name), blobs), (keys.optimizer(name), accs)):
            if ttl_ms <= 0 or expiry is None:
                commands.append(pack_fixed(b"HSET", key.encode(), fields, values))
            elif expiry == HSETEX:  # one command: half the hash lookups of HSET + HPEXPIRE
                prefix = (b"PX", b"%d" % ttl_ms, b"FIELDS", b"%d" % len(ids))
                commands.append(pack_fixed(b"HSETEX", key.encode(), fields, values, prefix))
            else:
                commands.append(pack_fixed(b"HSET", key.encode(), fields, values))
                prefix = (b"%d" % ttl_ms, b"FIELDS", b"%d" % len(ids))
                commands.append(pack_fixed(b"HPEXPIRE", key.encode(), fields, prefix=prefix))
    flat = [b"%d" % x for p, o in applied.items() for x in (p, o)]
    commands.append(pack(b"HSET", keys.ps_applied.encode(), *flat))
    commands.append(pack(b"EXEC"))
    return b"".join(commands), len(commands)


class TransactionFailed(redis.exceptions.RedisError):
    """A command inside ``EXEC`` failed (out of memory, a key of the wrong type): Redis ran
    the others, so rows, accumulators and offsets may disagree until the same transaction —
    a snapshot, idempotent — is sent again and succeeds."""


def claim_partitions(r: redis.Redis, keys: RedisKeys, owners: dict[int, str]) -> None:
    """Record this instance's token as the owner of each partition: from now on an older
    owner's transaction over them fails (``persist_fenced``)."""
    if owners:
        r.hset(keys.ps_owner, mapping={str(p): token for p, token in owners.items()})


def persist_fenced(
    r: redis.Redis,
    keys: RedisKeys,
    payload: bytes,
    replies: int,
    owners: dict[int, str],
    attempts: int = 20,
) -> bool:
    """Run a ``pack_persist`` transaction only while every partition in ``owners`` is still
    owned by its token: ``WATCH`` the owner hash, check it, then ``MULTI``/``EXEC`` on the same
    connection. A claim in between (another instance's assignment) aborts the ``EXEC``, and
    the check runs again. Returns False, having written nothing, if a partition has another
    owner: a fenced-off instance (it lost the partition while stalled) cannot overwrite what
    the new owner computes."""
    parts = sorted(owners)
    check = pack(b"WATCH", keys.ps_owner.encode()) + pack(
        b"HMGET", keys.ps_owner.encode(), *(b"%d" % p for p in parts)
    )
    with pooled_connection(r) as conn:
        for _ in range(attempts):
            conn.send_packed_command([check])
            conn.read_response()  # WATCH: OK
            current = conn.read_response()
            if [c.decode() if c is not None else None for c in current] != [
                owners[p] for p in parts
            ]:
                conn.send_packed_command([pack(b"UNWATCH")])
                conn.read_response()
                return False
            conn.send_packed_command([payload])
            out = [conn.read_response() for _ in range(replies)]
            if out[-1] is not None:  # EXEC ran; None: a watched key changed, check again
                failed = [r for r in out[-1] if isinstance(r, Exception)]
                if failed:  # EXEC ran every command, and some failed: not all is written
                    raise TransactionFailed(
                        f"{len(failed)} of {len(out[-1])} commands of the transaction failed: "
                        f"{failed[0]}"
                    )
                return True
        raise redis.WatchError(f"{keys.ps_owner} kept changing over {attempts} attempts")


def field_expiry(r: redis.Redis, keys: RedisKeys) -> str | None:
    """How this server expires hash fields: ``HSETEX`` (Redis 8.0+, Valkey 9.0+),
    ``HPEXPIRE`` (Redis 7.4) or ``None`` (older: fields never expire)."""
    probe = keys.ps_applied + ":probe"
    try:
        r.execute_command("HSETEX", probe, "PX", 1000, "FIELDS", 1, "x", "1")
        return HSETEX
    except redis.ResponseError:
        pass
    try:
        r.execute_command("HPEXPIRE", probe, 1000, "FIELDS", 1, "x")
        return HPEXPIRE
    except redis.ResponseError:
        return None


def applied_offsets(r: redis.Redis, keys: RedisKeys) -> dict[int, int]:
    return {int(k): int(v) for k, v in r.hgetall(keys.ps_applied).items()}
