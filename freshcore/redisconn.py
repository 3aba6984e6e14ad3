"""Connections to a Redis server or a Redis Cluster, and packed commands sent to the node
that owns their keys.

``REDIS_URL`` names a single server (``redis://``, ``rediss://``) or any node of a cluster:
``redis+cluster://`` (``rediss+cluster://``) says so, and a plain URL whose server answers
``cluster_enabled:1`` is taken for a cluster too. Every service, tool and ``freshrec run``
connects through ``connect``/``connect_async``; what they get answers redis-py's commands
either way (redis-py's cluster client routes them and follows ``MOVED``/``ASK``).

Commands packed with numpy (``freshcore/resp.py``) bypass redis-py's routing, so they travel
as ``Packed`` entries: the key that routes them, the packed bytes (commands on keys of that
key's slot only — a cluster refuses a transaction across slots) and how many replies they
get. ``run_packed`` sends them all on one connection to a single server; on a cluster it
groups them by node, sends each node its share in one write, reads the replies, and sends
the entries of a node that answered ``MOVED``/``ASK``/``TRYAGAIN``, failed or went away again
after reloading the slot map (a resharding, a replica promoted). An entry may then reach Redis
twice: entries must be idempotent (FreshRec's are snapshots and reads) or tolerate a repeat.

>>> parse_url("redis+cluster://h:7000"), parse_url("rediss://h:6380/0")
(('redis://h:7000', True), ('rediss://h:6380/0', None))
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.asyncio.cluster
from redis.cluster import RedisCluster
from redis.crc import key_slot

from freshcore.resp import exchange_async, execute
from schemas.errors import RetriableError

log = logging.getLogger("freshrec.redis")

_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
ROUTING_ERRORS = (
    redis.exceptions.MovedError,
    redis.exceptions.AskError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
)
"""What sends a node's entries again after reloading the slot map."""
ATTEMPTS = 6
"""Rounds of ``run_packed``: the last routing error is raised after them (about 3 s)."""


class Packed(NamedTuple):
    """Packed commands on keys of one slot, routed by ``key``, with their reply count."""

    key: bytes
    payload: bytes
    replies: int


def parse_url(url: str) -> tuple[str, bool | None]:
    """The URL redis-py reads, and True where the scheme says cluster (None: ask the server)."""
    parts = urlsplit(url)
    plain = _SCHEMES.get(parts.scheme)
    if plain is None:
        return url, None
    return _cluster_url(urlunsplit((plain, *parts[1:]))), True


def _cluster_url(plain: str) -> str:
    """A cluster client takes no database number; ``/0`` is dropped, another one refused."""
    parts = urlsplit(plain)
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"a Redis Cluster has only database 0, not {parts.path[1:]!r}")
    return urlunsplit((parts.scheme, parts.netloc, "", parts.query, parts.fragment))


class TransactionFailed(RetriableError, redis.exceptions.RedisError):
    """A command inside ``EXEC`` failed (out of memory at ``maxmemory``, a key of the wrong
    type): Redis ran the others, so what should change together may disagree until the same
    transaction — a snapshot, idempotent — is sent again and succeeds. Retriable: the
    services wait it out like an outage, and commit nothing past it meanwhile."""


def check_exec(reply, what: str = "the transaction") -> list:
    """``EXEC``'s reply, or ``TransactionFailed`` when any command inside it failed (Redis
    returns their errors in the reply's list instead of failing the ``EXEC``).

    >>> check_exec([1, b"OK"])
    [1, b'OK']
    >>> check_exec([1, redis.ResponseError("OOM command not allowed")], "counts")
    Traceback (most recent call last):
    ...
    freshcore.redisconn.TransactionFailed: 1 of 2 commands of counts failed: OOM command not allowed
    """
    failed = [r for r in reply or () if isinstance(r, Exception)]
    if failed:
        raise TransactionFailed(
            f"{len(failed)} of {len(reply)} commands of {what} failed: {failed[0]}"
        )
    return reply


def redacted(url: str) -> str:
    """``url`` fit for a log line or an error: the password replaced by ``***``.

    >>> redacted("redis://:s3cret@db:6379/0"), redacted("rediss://app:s3cret@db/0")
    ('redis://:***@db:6379/0', 'rediss://app:***@db/0')
    >>> redacted("redis://db:6379"), redacted("not a url")
    ('redis://db:6379', 'not a url')
    """
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return "<a Redis URL that does not parse>"
    if not password:
        return url
    user, _, host = parts.netloc.rpartition("@")
    name = user.partition(":")[0]
    return urlunsplit((parts.scheme, f"{name}:***@{host}", *parts[2:]))


def is_cluster(client) -> bool:
    return isinstance(client, (RedisCluster, redis.asyncio.cluster.RedisCluster))


def connect(url: str, *, wait_s: float = 30.0, **kwargs) -> redis.Redis | RedisCluster:
    """A client for ``url``: a cluster client where the scheme says so or the server runs in
    cluster mode, else a plain one. A cluster client reads the slot map when made, so it is
    made again (for up to ``wait_s``) while no node answers."""
    plain, cluster = parse_url(url)
    if cluster is None:
        client = redis.Redis.from_url(plain, **kwargs)
        cluster = _cluster_enabled(client.info, url)
        if not cluster:
            return client
        client.close()
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return RedisCluster.from_url(_cluster_url(plain), **kwargs)
        except (redis.exceptions.RedisClusterException, redis.exceptions.ConnectionError) as exc:
            if time.monotonic() >= deadline:
                raise redis.exceptions.ConnectionError(
                    f"no node of the Redis Cluster at {redacted(url)} answered within "
                    f"{wait_s:.0f} s: {exc}"
                ) from exc
            log.warning(
                "Redis Cluster at %s not reachable yet (%s); trying again", redacted(url), exc
            )
            time.sleep(1.0)


async def connect_async(url: str, **kwargs):
    """``connect`` for ``redis.asyncio`` (the cluster client reads its slot map lazily)."""
    plain, cluster = parse_url(url)
    if cluster is None:
        client = redis.asyncio.Redis.from_url(plain, **kwargs)
        try:
            info = await client.info("cluster")
            cluster = bool(info.get("cluster_enabled"))
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            _undetected(url, exc)
            cluster = False
        except redis.exceptions.ResponseError:
            cluster = False
        if not cluster:
            return client
        await client.aclose()
    return redis.asyncio.cluster.RedisCluster.from_url(_cluster_url(plain), **kwargs)


def _cluster_enabled(info, url: str) -> bool:
    try:
        return bool(info("cluster").get("cluster_enabled"))
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        _undetected(url, exc)
    except redis.exceptions.ResponseError:  # INFO not allowed (ACL): not a cluster we know of
        pass
    return False


def _undetected(url: str, exc: Exception) -> None:
    log.warning(
        "Redis at %s did not answer (%s): taken for a single server; name a cluster with "
        "redis+cluster://",
        redacted(url),
        exc,
    )


def _split(replies: list, entries: Sequence[Packed]) -> list[list]:
    out, at = [], 0
    for e in entries:
        out.append(replies[at : at + e.replies])
        at += e.replies
    return out


def run_packed(client, entries: Sequence[Packed]) -> list[list]:
    """Send ``entries`` and return each one's replies, in order (see the module's docs).
    An error reply raises (``redis.ResponseError``), as ``resp.execute`` does."""
    if not entries:
        return []
    if not is_cluster(client):
        payload = b"".join(e.payload for e in entries)
        return _split(execute(client, payload, sum(e.replies for e in entries)), entries)
    rounds = _Rounds(entries)
    for attempt in range(ATTEMPTS):
        for target, job in rounds.jobs(client.get_node_from_key, client.get_node):
            try:
                if target is None:
                    raise redis.exceptions.ConnectionError(f"no node {job.asking} in the slot map")
                conn = client.get_redis_connection(target)
                rounds.done(job, execute(conn, job.payload, job.replies))
            except ROUTING_ERRORS as exc:
                rounds.fail(job, exc)
        if rounds.complete():
            return rounds.out
        if rounds.asking:  # a slot in migration: its keys are asked of the importing node
            log.info("Redis Cluster: %r; asking the importing node", rounds.error)
            if any(client.get_node(host, port) is None for host, port in rounds.asking):
                _reload_slots(client, rounds.error, attempt)
            continue
        _reload_slots(client, rounds.error, attempt)
    raise rounds.error


@dataclass
class _Job:
    """Entries for one node (``asking``: the node an ``ASK`` named), packed to send."""

    idx: list[int]
    part: list[Packed]
    asking: tuple[str, int] | None
    payload: bytes
    replies: int
    extra: list[int]


class _Rounds:
    """``run_packed``'s rounds on a cluster: the replies so far, and in each round the
    entries that failed, the last error and the slots an ``ASK`` sent elsewhere."""

    def __init__(self, entries: Sequence[Packed]) -> None:
        self.entries = entries
        self.out: list = [None] * len(entries)
        self.todo = list(range(len(entries)))
        self.asked: dict[int, tuple[str, int]] = {}
        self.failed: list[int] = []
        self.error: Exception | None = None
        self.ask: dict[int, tuple[str, int]] = {}

    def jobs(self, node_of, node_at):
        """(the node to send to, or None if the slot map lacks it; the job) for this round."""
        self.failed, self.error, self.ask = [], None, {}
        for (node, asking), idx in _route(node_of, self.entries, self.todo, self.asked):
            part = [self.entries[i] for i in idx]
            payload, replies, extra = _payload(part, asking)
            yield (
                (node if not asking else node_at(*asking)),
                _Job(idx, part, asking, payload, replies, extra),
            )

    def done(self, job: _Job, replies: list) -> None:
        got = _drop_asking(replies, job.extra)
        for i, r in zip(job.idx, _split(got, job.part), strict=True):
            self.out[i] = r

    def fail(self, job: _Job, exc: Exception) -> None:
        self.failed += job.idx
        self.error = exc
        if isinstance(exc, redis.exceptions.AskError):
            self.ask[exc.slot_id] = exc.node_addr

    def complete(self) -> bool:
        """True when every entry has its replies; else the next round takes the failed."""
        if not self.failed:
            return True
        self.todo, self.asked = self.failed, self.ask
        return False

    @property
    def asking(self) -> list[tuple[str, int]]:
        return list(self.ask.values())


def _route(node_of, entries: Sequence[Packed], todo: list[int], asked: dict) -> list:
    """``todo``'s entries grouped by where they go: ((node, None), positions), or for a slot
    an ``ASK`` sent elsewhere ((None, (host, port)), positions), sent with ``ASKING``."""
    groups: dict = defaultdict(list)
    nodes: dict = {}
    for i in todo:
        slot = key_slot(entries[i].key)
        if slot in asked:
            groups[(None, asked[slot])].append(i)
            continue
        node = node_of(entries[i].key)
        nodes.setdefault(node.name, node)
        groups[(node.name, None)].append(i)
    return [((nodes.get(name), asking), idx) for (name, asking), idx in groups.items()]


def _payload(part: list[Packed], asking) -> tuple[bytes, int, list[int]]:
    """The bytes to send for ``part``, their reply count, and where the ``ASKING`` replies
    fall (before each command, once before a transaction: the flag lasts through ``MULTI``)."""
    replies = sum(e.replies for e in part)
    if not asking:
        return b"".join(e.payload for e in part), replies, []
    chunks, extra, at = [], [], 0
    for e in part:
        commands = [e.payload] if e.payload.startswith(_MULTI) else split_commands(e.payload)
        for c in commands:
            chunks += [_ASKING, c]
            extra.append(at)
            at += 1 + (e.replies if len(commands) == 1 else 1)
    return b"".join(chunks), replies + len(extra), extra


def _drop_asking(replies: list, extra: list[int]) -> list:
    if not extra:
        return replies
    skip = set(extra)
    return [r for n, r in enumerate(replies) if n not in skip]


_MULTI = b"*1\r\n$5\r\nMULTI\r\n"
_ASKING = b"*1\r\n$6\r\nASKING\r\n"


def split_commands(payload: bytes) -> list[bytes]:
    """Packed commands (RESP arrays of bulk strings) one by one.

    >>> split_commands(b"*1\\r\\n$4\\r\\nPING\\r\\n*2\\r\\n$3\\r\\nGET\\r\\n$1\\r\\nk\\r\\n")
    [b'*1\\r\\n$4\\r\\nPING\\r\\n', b'*2\\r\\n$3\\r\\nGET\\r\\n$1\\r\\nk\\r\\n']
    """
    out, at = [], 0
    while at < len(payload):
        start = at
        end = payload.index(b"\r\n", at)
        n, at = int(payload[at + 1 : end]), end + 2
        for _ in range(n):
            end = payload.index(b"\r\n", at)
            at = end + 2 + int(payload[at + 1 : end]) + 2
        out.append(payload[start:at])
    return out


def _reload_slots(client, error: Exception | None, attempt: int) -> None:
    log.info("Redis Cluster: %r; reloading the slot map", error)
    time.sleep(0.05 * 2**attempt)
    try:
        client.nodes_manager.initialize()
    except (redis.exceptions.RedisClusterException, redis.exceptions.ConnectionError) as exc:
        log.warning("Redis Cluster slot map not reloaded: %s", exc)


def node_client(client, key: bytes | str):
    """The plain client of the node that owns ``key`` (``client`` itself if not a cluster):
    for a transaction that needs a reply before it goes on (``WATCH``, check, ``EXEC``)."""
    if not is_cluster(client):
        return client
    return client.get_redis_connection(client.get_node_from_key(key))


def reload_slots(client, error: Exception | None = None, attempt: int = 0) -> None:
    """Read a cluster's slot map again after ``error`` (``MOVED``/``ASK`` outside
    ``run_packed``), first waiting longer with each ``attempt``."""
    if is_cluster(client):
        _reload_slots(client, error, attempt)


async def run_packed_async(client, entries: Sequence[Packed]) -> list[list]:
    """``run_packed`` for a ``redis.asyncio`` client."""
    from freshcore.resp import execute_async

    if not entries:
        return []
    if not is_cluster(client):
        payload = b"".join(e.payload for e in entries)
        replies = await execute_async(client, payload, sum(e.replies for e in entries))
        return _split(replies, entries)
    import asyncio

    await client.initialize()
    manager = client.nodes_manager
    rounds = _Rounds(entries)
    for attempt in range(ATTEMPTS):
        node_of = lambda key: manager.get_node_from_slot(key_slot(key))  # noqa: E731
        for target, job in rounds.jobs(node_of, client.get_node):
            try:
                if target is None:
                    raise redis.exceptions.ConnectionError(f"no node {job.asking} in the slot map")
                rounds.done(job, await _node_execute(target, job.payload, job.replies))
            except ROUTING_ERRORS as exc:
                rounds.fail(job, exc)
        if rounds.complete():
            return rounds.out
        if rounds.asking:
            log.info("Redis Cluster: %r; asking the importing node", rounds.error)
            continue
        log.info("Redis Cluster: %r; reloading the slot map", rounds.error)
        await asyncio.sleep(0.05 * 2**attempt)
        try:
            await manager.initialize()
        except (redis.exceptions.RedisClusterException, redis.exceptions.ConnectionError) as exc:
            log.warning("Redis Cluster slot map not reloaded: %s", exc)
    raise rounds.error


async def _node_execute(node, payload: bytes, replies: int) -> list:
    conn = node.acquire_connection()
    try:
        return await exchange_async(conn, payload, replies)
    finally:
        node.release(conn)
