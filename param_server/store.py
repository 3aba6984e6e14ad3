"""Rows and optimizer state in Redis (synchronous client): the global truth's layout."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import redis

from freshcore.redisconn import (
    ATTEMPTS,
    check_exec,
    is_cluster,
    node_client,
    reload_slots,
)
from freshcore.rediskeys import RedisKeys
from freshcore.resp import pack, pack_fixed, pooled_connection
from freshcore.rowstore import fetch_blobs
from schemas.rowbatch import TABLE_NAMES
from schemas.rows import (
    decode_rows,
    encode_rows_matrix,
    initial_rows,
    key_matrix,
    version_floor,
)

Row = tuple[np.ndarray, int, int]
log = logging.getLogger("freshrec.param_server")


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

    def completed(
        self, ids: np.ndarray, table: int, dim: int, created_ms: np.ndarray, initial_accum: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Rows, accumulators, versions and event times of every one of ``ids`` (the ids
        these were fetched for): what Redis holds, and for a row it does not have its
        deterministic initial row, at ``version_floor`` of the event time that creates it
        (``created_ms``, per id), with accumulators at ``initial_accum`` where none is held."""
        n, w = len(ids), dim + 1
        rows = np.empty((n, w), np.float32)
        versions = np.zeros(n, np.uint64)
        event_ms = np.zeros(n, np.int64)
        rows[self.found], versions[self.found], event_ms[self.found] = (
            self.rows,
            self.versions,
            self.event_ms,
        )
        if not self.found.all():
            absent = ~self.found
            rows[absent] = initial_rows(ids[absent], table, dim)
            versions[absent] = version_floor(created_ms[absent])
        accum = np.full((n, w), initial_accum, np.float32)
        accum[self.has_accum] = self.accum
        return rows, accum, versions, event_ms


def fetch_rows_and_accumulators(
    r: redis.Redis, keys: RedisKeys, wanted: dict[int, np.ndarray], w: int, shards: int
) -> dict[int, StoredRows]:
    """Rows and Adagrad accumulators of several tables in one round trip (HMGETs per shard
    packed with numpy, decoded in one pass)."""
    out = {}
    for table, ids in wanted.items():
        name = TABLE_NAMES[table]
        families = [lambda s, n=name: keys.embeddings(n, s), lambda s, n=name: keys.optimizer(n, s)]
        blobs, acc_raw = fetch_blobs(r, keys, families, ids, shards)
        found, rows, versions, event_ms = decode_rows(blobs, w)
        has_accum = np.fromiter((b is not None for b in acc_raw), bool, len(acc_raw))
        accum = np.frombuffer(b"".join(b for b in acc_raw if b is not None), "<f4")
        out[table] = StoredRows(found, rows, versions, event_ms, has_accum, accum.reshape(-1, w))
    return out


HSETEX = "HSETEX"
"""Fields written with their time-to-live in one command (Redis 8.0+, Valkey 9.0+)."""
HPEXPIRE = "HPEXPIRE"
"""Fields written, then given their time-to-live (Redis 7.4+)."""


@dataclass(frozen=True)
class PersistUnit:
    """The commands of one ``gradients`` partition's transaction (without MULTI/EXEC): its
    rows and accumulators and its applied offset, all under the partition's hash tag."""

    partition: int
    commands: bytes
    count: int


def pack_persist(
    keys: RedisKeys,
    tables: dict[int, dict[int, tuple[np.ndarray, ...]]],
    applied: dict[int, int],
    ttl_ms: int = 0,
    expiry: str | None = HSETEX,
) -> list[PersistUnit]:
    """Per partition (``tables``: partition -> table -> ids, rows, accumulators, versions,
    event times) its commands, packed: the rows and accumulators — with ``ttl_ms`` and an
    ``expiry`` command (``HSETEX`` or ``HPEXPIRE``, see ``field_expiry``), each field expires
    that long after this write — and the partition's applied offset. A snapshot, to send
    (again, if a connection broke) whenever: see ``persist_fenced``."""
    units = []
    for partition, offset in applied.items():
        commands = []
        for table, (ids, rows, accum, versions, event_ms) in tables.get(partition, {}).items():
            name = TABLE_NAMES[table]
            fields = key_matrix(ids)
            blobs = encode_rows_matrix(rows, versions, event_ms)
            accs = np.ascontiguousarray(accum, "<f4").view(np.uint8).reshape(len(ids), -1)
            for key, values in (
                (keys.embeddings(name, partition), blobs),
                (keys.optimizer(name, partition), accs),
            ):
                if ttl_ms <= 0 or expiry is None:
                    commands.append(pack_fixed(b"HSET", key.encode(), fields, values))
                elif expiry == HSETEX:  # one command: half the hash lookups of HSET + HPEXPIRE
                    prefix = (b"PX", b"%d" % ttl_ms, b"FIELDS", b"%d" % len(ids))
                    commands.append(pack_fixed(b"HSETEX", key.encode(), fields, values, prefix))
                else:
                    commands.append(pack_fixed(b"HSET", key.encode(), fields, values))
                    prefix = (b"%d" % ttl_ms, b"FIELDS", b"%d" % len(ids))
                    commands.append(pack_fixed(b"HPEXPIRE", key.encode(), fields, prefix=prefix))
        commands.append(pack(b"SET", keys.ps_applied(partition).encode(), b"%d" % offset))
        units.append(PersistUnit(partition, b"".join(commands), len(commands)))
    return units


def claim_partitions(r: redis.Redis, keys: RedisKeys, owners: dict[int, str]) -> None:
    """Record this instance's token as the owner of each partition: from now on an older
    owner's transaction over them fails (``persist_fenced``)."""
    if owners:
        pipe = r.pipeline(transaction=False)
        for p, token in owners.items():
            pipe.set(keys.ps_owner(p), token)
        pipe.execute()


@dataclass(frozen=True)
class Fenced:
    """What ``persist_fenced`` did: ``owned`` (true: written; false: another instance owns a
    partition, nothing written) — the value's truth — and ``behind``, the partitions whose
    applied offset Redis held before the write was older than ``acked`` said: Redis lost a
    transaction it had acknowledged (a failover), so rows written only by it are stale."""

    owned: bool
    behind: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return self.owned


def persist_fenced(
    r: redis.Redis,
    keys: RedisKeys,
    units: list[PersistUnit],
    owners: dict[int, str],
    attempts: int = 20,
    acked: dict[int, int] | None = None,
) -> Fenced:
    """Run ``pack_persist``'s units only while every partition in ``owners`` is still owned
    by its token: ``WATCH`` the owner keys, check them, then ``MULTI``/``EXEC`` on the same
    connection. A claim in between (another instance's assignment) aborts the ``EXEC``, and
    the check runs again. Returns False, having written nothing more, if a partition has
    another owner: a fenced-off instance (it lost the partition while stalled) cannot
    overwrite what the new owner computes. A single server runs all units in one
    transaction; a cluster runs one per partition (one hash slot each) on the node that owns
    it, so a crash there may leave some partitions written and not others — each with its
    own applied offset, which is all a restart needs.

    With ``acked`` (partition -> the applied offset of the last transaction Redis
    acknowledged), the check also reads the applied offsets and reports those behind
    (``Fenced.behind``)."""
    groups = [units] if not is_cluster(r) else [[u] for u in units]
    behind: list[int] = []
    for group in groups:
        for attempt in range(ATTEMPTS):
            try:
                lagging = _fenced_transaction(r, keys, group, owners, attempts, acked or {})
                if lagging is None:  # another owner: nothing written
                    return Fenced(False)
                behind.extend(lagging)
                break
            except (redis.exceptions.MovedError, redis.exceptions.AskError) as exc:
                if not is_cluster(r) or attempt == ATTEMPTS - 1:
                    raise
                reload_slots(r, exc, attempt)  # resharded: MOVED, or ASK until the move ends
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
                # a master that died: its replica may hold the slots by the caller's retry,
                # which must then find it (the slot map is not reloaded by itself here)
                reload_slots(r, exc)
                raise
    return Fenced(True, tuple(sorted(behind)))


def _fenced_transaction(
    r: redis.Redis,
    keys: RedisKeys,
    units: list[PersistUnit],
    owners: dict[int, str],
    attempts: int,
    acked: dict[int, int],
) -> list[int] | None:
    """None: another owner; else written, and the partitions found behind ``acked``."""
    parts = [u.partition for u in units]
    owner_keys = [keys.ps_owner(p).encode() for p in parts]
    applied_keys = [keys.ps_applied(p).encode() for p in parts]
    check = pack(b"WATCH", *owner_keys) + pack(b"MGET", *owner_keys, *applied_keys)
    payload = b"".join([pack(b"MULTI"), *(u.commands for u in units), pack(b"EXEC")])
    replies = 2 + sum(u.count for u in units)
    with pooled_connection(node_client(r, owner_keys[0])) as conn:
        for _ in range(attempts):
            conn.send_packed_command([check])
            conn.read_response()  # WATCH: OK
            current = conn.read_response()
            held = current[len(parts) :]
            if [c.decode() if c is not None else None for c in current[: len(parts)]] != [
                owners.get(p) for p in parts
            ]:
                conn.send_packed_command([pack(b"UNWATCH")])
                conn.read_response()
                return None
            behind = [
                p
                for p, h in zip(parts, held, strict=True)
                if p in acked and (-1 if h is None else int(h)) < acked[p]
            ]
            conn.send_packed_command([payload])
            out = [conn.read_response() for _ in range(replies)]
            if out[-1] is not None:  # EXEC ran; None: a watched key changed, check again
                check_exec(out[-1])  # EXEC ran every command: did any fail?
                return behind
        raise redis.WatchError(f"the owners of partitions {parts} kept changing")


def field_expiry(r: redis.Redis, keys: RedisKeys) -> str | None:
    """How this server expires hash fields: ``HSETEX`` (Redis 8.0+, Valkey 9.0+),
    ``HPEXPIRE`` (Redis 7.4) or ``None`` (older: fields never expire)."""
    probe = f"{keys.prefix}ps:probe"
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


def applied_offsets(r: redis.Redis, keys: RedisKeys, partitions: list[int]) -> dict[int, int]:
    """The last applied offset of each of ``partitions`` that has one."""
    pipe = r.pipeline(transaction=False)
    for p in partitions:
        pipe.get(keys.ps_applied(p))
    return {p: int(v) for p, v in zip(partitions, pipe.execute(), strict=True) if v is not None}
