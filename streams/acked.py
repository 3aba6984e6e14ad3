"""Whether Redis lost a write it acknowledged. Pure.

The count stage writes only what changed since its last flush, with its input offsets in the
same transaction. After a failover (a replica promoted before it received the master's last
writes: replication is asynchronous) Redis may be a flush behind what it acknowledged; the
next flush would put newer offsets over rows that miss the lost flush's counts. Each flush
reads the offsets fields back first; ``lost_write`` compares them with the last ones Redis
acknowledged.

>>> acked = {"applied": '{"0": 9}', "covisit_applied": "{}"}
>>> lost_write(acked, {"applied": '{"0": 9}', "covisit_applied": "{}"})
False
>>> lost_write(acked, {"applied": '{"0": 4}', "covisit_applied": "{}"})
True
>>> lost_write(acked, {"applied": None, "covisit_applied": None})
True
>>> lost_write(acked, {"applied": '{"0": 12}', "covisit_applied": "{}"})  # another writer
False
"""

from __future__ import annotations

import json
from collections.abc import Mapping


def _offsets(raw: str | None) -> dict[str, int]:
    return json.loads(raw) if raw else {}


def lost_write(acked: Mapping[str, str | None], found: Mapping[str, str | None]) -> bool:
    """True when some offset in ``found`` (each field's JSON ``{partition: offset}`` as Redis
    holds it) is below the one ``acked`` says Redis acknowledged, and none is above it
    (offsets ahead mean another instance wrote since: not a loss)."""
    lost = False
    for name, mine in acked.items():
        if mine == found.get(name):
            continue
        ours, theirs = _offsets(mine), _offsets(found.get(name))
        if any(theirs.get(q, -1) > o for q, o in ours.items()):
            return False
        lost = lost or any(theirs.get(q, -1) < o for q, o in ours.items())
    return lost
