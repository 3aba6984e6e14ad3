"""What a live arm's topics get from the log: its items as catalogue records on ``items``, its
interactions as events on ``events`` (clicks; conversions stay conversions)."""

from __future__ import annotations

from freshrec.app.replay.data import ReplayData


def produce_catalogue(producer, topic: str, data: ReplayData, names, created_ms: int) -> None:
    from freshcore.kafka import produce
    from schemas.codec import encode_item
    from schemas.records import Item

    for item_id in names:
        item = Item(
            item_id,
            data.category.get(item_id, "unknown"),
            float(data.price.get(item_id, 0.0)),
            created_ms,
        )
        produce(producer, topic, encode_item(item), item_id.encode())


def log_event(data: ReplayData, pos: int, event_id: str, t_ms: int):
    """Log position ``pos`` as an ``Event`` stamped ``t_ms``."""
    from schemas.records import Event

    kind = "conversion" if data.types[pos] == "conversion" else "click"
    return Event(event_id, kind, str(data.users[pos]), str(data.items[pos]), t_ms)
