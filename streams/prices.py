"""When the count stage looks the prices of its items up again. Pure: time is passed in.

An item whose events arrive before its catalogue record (or whose record another instance's
catalogue stage took) has no price; its partition asks Redis again 5 s later and, while none
is found, twice as late each time up to 5 min: events for items that have no catalogue record
cost a few round trips an hour, not one every 5 s.

>>> r = PriceRetries()
>>> r.due(0, 100.0), r.looked_up(0, 100.0, found=False), r.due(0, 104.0), r.due(0, 105.0)
(True, None, False, True)
>>> r.looked_up(0, 105.0, found=False), r.at[0]
(None, 115.0)
"""

from __future__ import annotations

from collections import defaultdict

PRICE_RETRY_S = 5.0
PRICE_RETRY_MAX_S = 300.0


class PriceRetries:
    """Per by-item partition, when its items without a price are looked up next (monotonic
    seconds)."""

    def __init__(self) -> None:
        self.at: dict[int, float] = defaultdict(float)
        self.wait: dict[int, float] = defaultdict(lambda: PRICE_RETRY_S / 2)

    def due(self, partition: int, now_s: float) -> bool:
        return now_s >= self.at[partition]

    def looked_up(self, partition: int, now_s: float, found: bool) -> None:
        """The partition looked up (``found``: some price was found, or none was missing)."""
        wait = PRICE_RETRY_S if found else min(2 * self.wait[partition], PRICE_RETRY_MAX_S)
        self.wait[partition] = wait
        self.at[partition] = now_s + wait
