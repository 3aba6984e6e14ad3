"""The wall clock in the units the wire formats use. Pure apart from reading the clock."""

from __future__ import annotations

import time


def now_ms() -> int:
    """Milliseconds since the Unix epoch (event and request times are in these)."""
    return int(time.time() * 1000)
