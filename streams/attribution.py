"""Events attributed to A/B experiment variants (the validate stage): an impression, click or
conversion whose ``request_id`` names a reply counts for the variant that reply was served
under, which the worker recorded under ``req:variant:{request_id}`` before the reply left
(``inference/serving/liveexperiment.py``). The counts go to ``exp:{name}:counts`` and
``freshrec_experiment_events_total``. While no experiment has run (``experiments`` is empty,
checked every few seconds) nothing is looked up.

Counting is at least once: a batch's counts are written before its offsets are committed, so
a crash in between counts that batch again (the dedupe window drops replays of the same
event ids within a run)."""

from __future__ import annotations

import time
from collections import Counter

from freshrec import metrics as m
from freshrec.redisconn import Packed, run_packed
from freshrec.rediskeys import RedisKeys
from freshrec.resp import pack

CHECK_EVERY_S = 5.0
UNATTRIBUTED = "unattributed"


def tally(events, variant_of: dict[str, str | None]) -> Counter:
    """(experiment, variant, event_type) -> events, for events whose request has a variant;
    those naming a request without one count as ("", "unattributed", type).

    >>> from schemas.records import Event
    >>> es = [Event("e1", "click", "u", "i", 1, request_id="r1"),
    ...       Event("e2", "impression", "u", "i", 1, request_id="r2"),
    ...       Event("e3", "impression", "u", "i", 1)]
    >>> sorted(tally(es, {"r1": "exp/b", "r2": None}).items())
    [(('', 'unattributed', 'impression'), 1), (('exp', 'b', 'click'), 1)]
    """
    out: Counter = Counter()
    for e in events:
        if e.request_id is None:
            continue
        tag = variant_of.get(e.request_id)
        if tag:
            exp, _, variant = tag.partition("/")
            out[(exp, variant, e.event_type)] += 1
        else:
            out[("", UNATTRIBUTED, e.event_type)] += 1
    return out


def count_commands(keys: RedisKeys, counts: Counter) -> list[Packed]:
    """HINCRBY of each (experiment, variant, type) on the experiment's counts hash."""
    out = []
    for (exp, variant, kind), n in counts.items():
        if exp:
            key = keys.experiment_counts(exp).encode()
            field = f"{variant}:{kind}".encode()
            out.append(Packed(key, pack(b"HINCRBY", key, field, b"%d" % n), 1))
    return out


class Attribution:
    def __init__(self, client, keys: RedisKeys) -> None:
        self.redis = client
        self.keys = keys
        self._active = False
        self._checked = -CHECK_EVERY_S

    def commands(self, events) -> list[Packed]:
        """The batch's count commands (looked up in one round trip; one per node of a
        cluster). Redis errors raise: the caller waits them out with its other writes."""
        now = time.monotonic()
        if now - self._checked >= CHECK_EVERY_S:
            self._active = bool(self.redis.scard(self.keys.experiments))
            self._checked = now
        if not self._active:
            return []
        rids = list(dict.fromkeys(e.request_id for e in events if e.request_id is not None))
        if not rids:
            return []
        keys = [self.keys.request_variant(r).encode() for r in rids]
        replies = run_packed(self.redis, [Packed(k, pack(b"GET", k), 1) for k in keys])
        variant_of = {
            r: (v[0].decode() if v[0] is not None else None)
            for r, v in zip(rids, replies, strict=True)
        }
        counts = tally(events, variant_of)
        for (exp, variant, kind), n in counts.items():
            m.EXPERIMENT_EVENTS.labels(exp, variant, kind).inc(n)
        return count_commands(self.keys, counts)
