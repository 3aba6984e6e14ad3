"""The ``events.by_item`` record: the validate stage's repartition of valid events by item,
which the count stage reads. Pure.

One record per target partition and batch: a JSON object of equal-length columns, in source
order, each event named by its source partition and offset on ``events`` (so the count stage
skips what it counted before) and its kind given as a small code (``EVENT_CODES``); ``by_item_columns`` reads one.
``split_records`` writes rows of columns as records, each under the broker's size limit.
"""

from __future__ import annotations

import numpy as np
import orjson

IMPRESSION, CLICK, CONVERSION = 0, 1, 2
EVENT_CODES = {"impression": IMPRESSION, "click": CLICK, "conversion": CONVERSION}
"""An event type's code in the record (``c``), and its counter's index in the item state."""

BY_ITEM_COLUMNS = ("p", "o", "i", "c", "t", "r")
"""An ``events.by_item`` record: a JSON object of equal-length columns — source partition,
source offset, item id, event code, event time (ms), region (or null) — in source order."""

ByItemEvent = tuple[int, int, str, int, int, str | None, float]
"""(source partition, source offset, item_id, event code, ts_ms, region, value)."""


def by_item_columns(record: dict | list) -> tuple[list, ...]:
    """The columns of a decoded ``events.by_item`` record, in ``BY_ITEM_COLUMNS`` order.
    Also reads the row layout of earlier versions (a list of ``ByItemEvent``), so
    records left in the topic by an older validate stage still count after an upgrade.

    >>> by_item_columns({"p": [0], "o": [5], "i": ["i1"], "c": [1], "t": [9], "r": [None]})
    ([0], [5], ['i1'], [1], [9], [None])
    >>> by_item_columns([[0, 5, "i1", 1, 9, None, 0.0]])
    ([0], [5], ['i1'], [1], [9], [None])
    """
    if isinstance(record, dict):
        return tuple(record[c] for c in BY_ITEM_COLUMNS)
    if not record:
        return ([], [], [], [], [], [])
    return tuple(list(c) for c in list(zip(*record, strict=True))[:6])


MAX_RECORD_BYTES = 512 * 1024
"""An ``events.by_item`` record is split below this: Kafka refuses messages over its
``message.max.bytes`` (1 MB by default), and 5,000 valid events naming one item id of 64
emoji make a 2 MB record."""


def split_records(
    columns: list, lo: int, hi: int, names=BY_ITEM_COLUMNS, starts: np.ndarray | None = None
) -> list[bytes]:
    """Rows ``lo:hi`` of ``columns`` as ``events.by_item`` records, in order, each under
    ``MAX_RECORD_BYTES`` where it can be: halved at the group start nearest the middle
    (``starts``: where a group of rows that must stay in one record begins — a click's
    pairs; every row by default), a single group kept whole.

    >>> split_records([np.array([1, 2]), np.array(["a", "b"], object)], 0, 2, ("x", "y"))
    [b'{"x":[1,2],"y":["a","b"]}']
    """
    record = orjson.dumps(dict(zip(names, (c[lo:hi].tolist() for c in columns), strict=True)))
    if len(record) <= MAX_RECORD_BYTES or hi - lo == 1:
        return [record]
    if starts is None:
        mid = (lo + hi) // 2
    else:
        inside = starts[(starts > lo) & (starts < hi)]
        if not len(inside):
            return [record]
        mid = int(inside[np.argmin(np.abs(inside - (lo + hi) // 2))])
    return split_records(columns, lo, mid, names, starts) + split_records(
        columns, mid, hi, names, starts
    )


def run_bounds(keys: np.ndarray) -> list[int]:
    """Where the runs of equal values of sorted ``keys`` start, and its length.

    >>> run_bounds(np.array([3, 3, 5, 7, 7]))
    [0, 2, 3, 5]
    """
    return [0, *(np.flatnonzero(keys[1:] != keys[:-1]) + 1).tolist(), len(keys)]
