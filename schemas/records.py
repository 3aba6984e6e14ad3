"""Typed, frozen records of the public topics; each mirrors a schema file of this folder.

``tests/test_schemas.py`` keeps the two in step: field names, which are required, and types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

SCHEMA_VERSION = 1

EventType = Literal["impression", "click", "conversion"]
DeviceClass = Literal["high_end", "pc", "low_end"]
Tier = Literal["full", "cached", "light", "hot", "error"]

EVENT_TYPES: tuple[str, ...] = ("impression", "click", "conversion")
DEVICE_CLASSES: tuple[str, ...] = ("high_end", "pc", "low_end")


@dataclass(frozen=True, slots=True)
class Event:
    """A user's behaviour on an item (``events``, key = user_id); ``event.schema.json``."""

    event_id: str
    """Unique per event; replays with the same id are counted once."""
    event_type: EventType
    user_id: str
    item_id: str
    ts_ms: int
    """Event time in ms since the epoch; drives decay and freshness lag."""
    region: str | None = None
    device: DeviceClass | None = None
    request_id: str | None = None
    """The request whose reply showed the item, linking impressions, clicks and conversions."""
    position: int | None = None
    value: float | None = None
    schema_version: int = SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class Item:
    """A catalogue entry (``items``, key = item_id); ``item.schema.json``."""

    item_id: str
    category: str
    price: float
    created_at_ms: int
    region: str | None = None
    """Where it is sold; None means everywhere."""
    title: str | None = None
    schema_version: int = SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class RequestContext:
    """Where and on what the request was made; each field optional."""

    device: DeviceClass | None = None
    region: str | None = None
    ts_ms: int | None = None


@dataclass(frozen=True, slots=True)
class RecommendRequest:
    """A recommendation request (``recommend.requests``, key = user_id); ``request.schema.json``.

    Transport headers (not in the body): ``reply-to`` and ``correlation-id``.
    """

    request_id: str
    user_id: str
    k: int = 20
    context: RequestContext | None = None
    exclude: tuple[str, ...] = ()
    deadline_ms: int | None = None
    """Absolute deadline in ms since the epoch; None means the worker's default budget."""
    exclude_seen: bool | None = None
    """Leave out what the user consumed in the events the worker saw; None: its default."""
    schema_version: int = SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class ReplyItem:
    item_id: str
    score: float
    channels: tuple[str, ...]
    """The recall channels that found it (vector, i2i, hot, new, region)."""


@dataclass(frozen=True, slots=True)
class RecommendReply:
    """The answer (``reply-to`` topic, header correlation-id); ``reply.schema.json``."""

    request_id: str
    user_id: str
    items: tuple[ReplyItem, ...]
    tier: Tier
    tier_reason: str
    served_at_ms: int
    degraded: bool = False
    model_version: str | None = None
    user_embedding_version: int | None = None
    user_embedding_age_ms: int | None = None
    item_table_version: int | None = None
    timings_ms: dict[str, float] = field(default_factory=dict)
    worker: str | None = None
    experiment: str | None = None
    variant: str | None = None
    ranker: str | None = None
    mode: str | None = None
    """The serving mode the worker served in (daily, promo, acquisition, …)."""
    schema_version: int = SCHEMA_VERSION


@dataclass(frozen=True, slots=True)
class ControlRecord:
    """The serving mode every worker serves in (``control``, key ``mode``);
    ``control.schema.json``."""

    mode: str
    at_ms: int
    """When it was written (ms since the epoch)."""
    by: str = ""
    """Who wrote it (free text: the CLI writes user@host)."""
    schema_version: int = SCHEMA_VERSION


DEAD_LETTER_VERSION = 2
"""Version 2 bounds the original bytes (``value_bytes``, ``value_sha256``, ``value_truncated``)."""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A rejected record with its reason and origin (``events.dlq``,
    ``recommend.requests.dlq``); ``deadletter.schema.json``."""

    reason: str
    detail: str
    source_topic: str
    source_partition: int
    source_offset: int
    value_b64: str
    """The value's bytes, base64: its first ``max_value_bytes`` when it was longer."""
    value_bytes: int
    """The value's full length."""
    value_sha256: str
    """SHA-256 of the full value, hex."""
    value_truncated: bool
    failed_at_ms: int
    value_null: bool | None = None
    """True when the record's value was null (a tombstone)."""
    key_b64: str | None = None
    key_bytes: int | None = None
    service: str | None = None
    schema_version: int = DEAD_LETTER_VERSION
