"""The ``events.by_item`` record: the validate stage's repartition of valid events by item,
which the count stage reads. Pure.

One record per target partition and batch: a JSON object of equal-length columns, in source
order, each event named by its source partition and offset on ``events`` (so the count stage
skips what it counted before) and its kind given as a small code (``EVENT_CODES``); ``by_item_columns`` reads one.
"""

from __future__ import annotations

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
