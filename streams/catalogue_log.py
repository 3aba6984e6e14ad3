"""The ``items`` topic read as a changelog: what a batch of records leaves in the catalogue. Pure.

The topic is keyed by item id. A record with a value sets the item (a later one replaces
it); a record with a null value — a tombstone, Kafka's way of deleting a key — removes it.
Within a batch the last record of an item decides, as compaction would keep it. Nothing here
relies on the broker compacting: a consumer that reads the whole log reaches the same state.

>>> final_ops([("i1", "a"), ("i2", "b"), ("i1", None), ("i3", None), ("i3", "c")])
({'i2': 'b', 'i3': 'c'}, ['i1'])
>>> tombstone_item_id(b"i42")
'i42'
>>> tombstone_item_id(None)
Traceback (most recent call last):
...
schemas.contract.Rejected: empty_id: a tombstone (null value) names the item to delete by its key; this one has none
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from schemas.contract import Reason, Rejected, load_schema

T = TypeVar("T")

MAX_ITEM_ID = load_schema("item")["properties"]["item_id"]["maxLength"]


def final_ops(ops: Iterable[tuple[str, T | None]]) -> tuple[dict[str, T], list[str]]:
    """(items to set, item ids to delete) after ``ops`` in order: (item id, record) pairs,
    a None record a deletion. The two never share an id."""
    last: dict[str, T | None] = {}
    for item_id, record in ops:
        last.pop(item_id, None)  # the order of the result follows each id's last op
        last[item_id] = record
    sets = {k: v for k, v in last.items() if v is not None}
    return sets, [k for k, v in last.items() if v is None]


def tombstone_item_id(key: bytes | None) -> str:
    """The item a tombstone deletes: its key, held to the item id's contract (``Rejected``
    otherwise, with the reason a record's ``item_id`` would get)."""
    if not key:
        raise Rejected(
            Reason.EMPTY_ID,
            "a tombstone (null value) names the item to delete by its key; this one has none",
        )
    try:
        item_id = key.decode()
    except UnicodeDecodeError:
        raise Rejected(Reason.INVALID_VALUE, "a tombstone's key must be a UTF-8 item id") from None
    if len(item_id) > MAX_ITEM_ID:
        raise Rejected(
            Reason.ID_TOO_LONG,
            f"a tombstone's key is {len(item_id)} characters, at most {MAX_ITEM_ID}",
        )
    return item_id
