"""Stable 64-bit row ids for string ids, the same in every process and language.

Embedding tables are keyed by int64. ``row_id("u42")`` is the first 8 bytes of BLAKE2b-64 of
the UTF-8 id read as a signed little-endian integer: deterministic across processes (unlike
Python's ``hash``), collision probability ~n²/2⁶⁵.

>>> row_id("u42") == row_id("u42"), row_id("u42") != row_id("u43")
(True, True)
"""

from __future__ import annotations

import hashlib


def row_id(key: str) -> int:
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)
