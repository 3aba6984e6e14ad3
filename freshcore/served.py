"""What a worker keeps of a reply served under an A/B variant, for the streams app to
attribute the events that name it (``req:variant:{request_id}``). Pure.

The value is the ``{experiment}/{variant}`` tag, a newline, then 4-byte hashes of the user and
of each listed item: an event counts for the variant only when its user is the reply's user
and its item one of the reply's items (a client can put any request id in an event; an
attacker or a bug must not be able to move a variant's CTR with ids of replies it did not
get). 4 bytes an id keep a record near 60 bytes; a stray match is one in 4·10⁹ per id.
A value without a newline (a worker of an earlier release) is a bare tag, trusted as it is.

>>> v = encode("exp/b", "u1", ["i1", "i2"])
>>> r = decode(v)
>>> r.tag, r.matches("u1", "i2"), r.matches("u2", "i2"), r.matches("u1", "i9")
('exp/b', True, False, False)
>>> decode(b"exp/a").matches("anyone", "anything")
True
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass


def id_hash(value: str) -> bytes:
    return hashlib.blake2b(value.encode(), digest_size=4).digest()


def encode(tag: str, user_id: str, item_ids: Iterable[str]) -> bytes:
    return tag.encode() + b"\n" + id_hash(user_id) + b"".join(id_hash(i) for i in item_ids)


@dataclass(frozen=True)
class Served:
    tag: str
    user: bytes | None
    """The user's hash; None for a bare tag."""
    items: frozenset[bytes]

    def matches(self, user_id: str, item_id: str) -> bool:
        if self.user is None:
            return True
        return id_hash(user_id) == self.user and id_hash(item_id) in self.items


def decode(value: bytes) -> Served | None:
    """The record, or None when it is not one (a malformed value counts as no record).

    >>> decode(b"exp/a\\n12") is None
    True
    """
    tag, sep, rest = value.partition(b"\n")
    try:
        text = tag.decode()
    except UnicodeDecodeError:
        return None
    if "/" not in text:
        return None
    if not sep:
        return Served(text, None, frozenset())
    if len(rest) < 4 or len(rest) % 4:
        return None
    return Served(text, rest[:4], frozenset(rest[i : i + 4] for i in range(4, len(rest), 4)))
