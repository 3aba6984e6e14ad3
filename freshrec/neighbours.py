"""The co-visitation neighbour lists in Redis: written by the streams app's count stage,
read by the worker's ``covisit`` recall channel. One hash per ``events.by_item`` partition
(``RedisKeys.covisit``), field = anchor item id, value = JSON ``[[neighbour, …], [P(b | a),
…]]``, best first. Pure.
"""

from __future__ import annotations

import orjson


def serving_list(pairs: list[tuple[str, float]]) -> bytes:
    """An anchor's published list: ``[[neighbour, …], [P(b | a), …]]``.

    >>> serving_list([("b", 0.5), ("c", 0.25)])
    b'[["b","c"],[0.5,0.25]]'
    """
    return orjson.dumps([[b for b, _ in pairs], [p for _, p in pairs]])


def read_serving_list(raw: bytes | None) -> list[tuple[str, float]]:
    """``serving_list``'s pairs (none for a missing or unreadable list)."""
    if not raw:
        return []
    try:
        names, probs = orjson.loads(raw)
        return [(str(b), float(p)) for b, p in zip(names, probs, strict=True)]
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return []
