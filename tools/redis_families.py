"""What Redis holds, by key family (keys, elements and bytes), so that a growing
``used_memory`` can be traced to what grows (``tools/drill_flood.py`` samples it)."""

from __future__ import annotations

import re

from freshcore.rediskeys import RedisKeys

_KEYS = RedisKeys("")  # the drill's pipeline writes without a prefix
ID_FAMILIES = (_KEYS.user_recent(""), _KEYS.answered(""), _KEYS.request_variant(""))
"""Key families with one key per id (``freshcore/rediskeys.py``): counted together."""
TAG = re.compile(r"\{[sg]\d+\}")


def family(key: str) -> str:
    """The family of a FreshRec key: its partition's hash tag and any trailing id as ``*``.

    >>> family("emb:item:{g3}"), family("streams:{s5}:rows"), family("user:recent:u42")
    ('emb:item:{*}', 'streams:{*}:rows', 'user:recent:*')
    """
    for head in ID_FAMILIES:
        if key.startswith(head):
            return head + "*"
    return TAG.sub("{*}", key)


LENGTH = {b"hash": "HLEN", b"list": "LLEN", b"set": "SCARD", b"zset": "ZCARD"}


def redis_families(store) -> dict:
    """What Redis holds, by key family: keys, elements (fields, list entries, members) and
    bytes (``MEMORY USAGE``, exact); with ``INFO``'s split of used memory into dataset and
    overhead and its counts of keys, keys with a TTL and expired keys."""
    keys = list(store.scan_iter(count=1000))
    pipe = store.pipeline(transaction=False)
    for key in keys:
        pipe.type(key)
        pipe.memory_usage(key, samples=0)
    answers = pipe.execute()
    pipe = store.pipeline(transaction=False)
    for key, kind in zip(keys, answers[0::2], strict=True):
        # a key gone since the scan is of type none: STRLEN answers 0
        pipe.execute_command(LENGTH.get(kind, "STRLEN"), key)
    lengths = pipe.execute()
    out: dict[str, dict] = {}
    for key, size, length in zip(keys, answers[1::2], lengths, strict=True):
        f = out.setdefault(family(key.decode(errors="replace")), [0, 0, 0])
        f[0] += 1
        f[1] += length or 0
        f[2] += size or 0
    memory, stats, space = store.info("memory"), store.info("stats"), store.info("keyspace")
    db = space.get("db0", {})
    return {
        "families": {
            k: {"keys": v[0], "elements": v[1], "bytes": v[2]} for k, v in sorted(out.items())
        },
        "used_memory": memory["used_memory"],
        "dataset": memory["used_memory_dataset"],
        "overhead": memory["used_memory_overhead"],
        "keys": db.get("keys", 0),
        "keys_with_ttl": db.get("expires", 0),
        "expired_keys": stats.get("expired_keys", 0),
        **{k: v for k, v in stats.items() if "expired" in k and "field" in k},
    }
