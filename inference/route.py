"""Where a request's reply goes, read from its headers — or why it goes nowhere. Pure.

A request names its reply topic in ``reply-to`` and its ``correlation-id``; both are a
stranger's bytes. The reply topic must match the deployment's pattern (default: the shared
``recommend.replies`` and a client's own ``recommend.replies.<id>``, under the topic prefix):
a request must not make a worker write to any other topic, internal ones included. A
correlation id is copied onto the reply, where every client on a shared topic decodes it, so
it must be UTF-8 text of at most 200 bytes without control characters. A header given twice
with different values is ambiguous. Any of these is a ``Rejected`` with a stable reason: a
dead letter, and no reply (there is no safe place to send one).

>>> allowed = reply_topic_pattern("")
>>> route([(b"reply-to", b"recommend.replies"), ("correlation-id", b"c1")], allowed, "recommend.replies")
Route(reply_to='recommend.replies', correlation_id=b'c1')
>>> route([], allowed, "recommend.replies")
Route(reply_to='recommend.replies', correlation_id=None)
>>> route([("reply-to", b"gradients")], allowed, "recommend.replies")
Traceback (most recent call last):
...
schemas.contract.Rejected: reply_to_not_allowed: reply-to 'gradients' does not match the allowed reply topics
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from schemas.contract import Reason, Rejected

MAX_CORRELATION_ID_BYTES = 200
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def reply_topic_pattern(prefix: str, pattern: str | None = None) -> re.Pattern[str]:
    """The reply topics a worker may write to: ``pattern`` (a regular expression the whole
    topic name must match), by default the shared reply topic and clients' own ones."""
    if pattern is None:
        pattern = (
            re.escape(f"{prefix}recommend.replies") + r"(\.[A-Za-z0-9_-][A-Za-z0-9._-]{0,199})?"
        )
    return re.compile(pattern)


@dataclass(frozen=True)
class Route:
    reply_to: str
    correlation_id: bytes | None


def _one(headers, name: str) -> bytes | None:
    values = {
        v for k, v in headers if (k.decode(errors="replace") if isinstance(k, bytes) else k) == name
    }
    if len(values) > 1:
        raise Rejected(Reason.DUPLICATE_HEADER, f"{name} given {len(values)} different values")
    return next(iter(values), None)


def route(headers, allowed: re.Pattern[str], default_reply_to: str) -> Route:
    """The reply topic and correlation id of a request with these ``headers`` (a list of
    (name, value) pairs as a Kafka client hands them, or None), or ``Rejected``."""
    headers = list(headers or ())
    raw_reply = _one(headers, "reply-to")
    if not raw_reply:
        reply_to = default_reply_to
    else:
        try:
            reply_to = raw_reply.decode()
        except UnicodeDecodeError:
            raise Rejected(Reason.REPLY_TO_NOT_ALLOWED, "reply-to is not UTF-8") from None
        if not allowed.fullmatch(reply_to):
            raise Rejected(
                Reason.REPLY_TO_NOT_ALLOWED,
                f"reply-to {reply_to[:100]!r} does not match the allowed reply topics",
            )
    corr = _one(headers, "correlation-id")
    if corr is not None:
        if not corr or len(corr) > MAX_CORRELATION_ID_BYTES:
            raise Rejected(
                Reason.INVALID_CORRELATION_ID,
                f"correlation-id of {len(corr)} bytes (1 to {MAX_CORRELATION_ID_BYTES})",
            )
        try:
            text = corr.decode()
        except UnicodeDecodeError:
            raise Rejected(Reason.INVALID_CORRELATION_ID, "correlation-id is not UTF-8") from None
        if _CONTROL.search(text):
            raise Rejected(Reason.INVALID_CORRELATION_ID, "correlation-id has control characters")
    return Route(reply_to, corr)
