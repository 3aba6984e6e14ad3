"""Events attributed to A/B experiment variants (the validate stage): an impression, click or
conversion whose ``request_id`` names a reply counts for the variant that reply was served
under, which the worker recorded under ``req:variant:{request_id}`` before the reply left
(``inference/serving/liveexperiment.py``), when the event's user and item are the reply's
(``freshcore.served``). The counts go to ``exp:{name}:counts``, in total and per analysis
bucket of the user (``freshcore.abstats``), and ``freshrec_experiment_events_total``. While no experiment has run (``experiments`` is empty,
checked every few seconds) nothing is looked up.

Counting is at least once: a batch's counts are written before its offsets are committed, so
a crash in between counts that batch again (the dedupe window drops replays of the same
event ids within a run)."""

from __future__ import annotations

import time
from collections import Counter

from freshcore import metrics as m
from freshcore.abstats import bucket_of
from freshcore.redisconn import Packed, run_packed
from freshcore.rediskeys import RedisKeys
from freshcore.resp import pack
from freshcore.served import Served, decode

CHECK_EVERY_S = 5.0
UNATTRIBUTED = "unattributed"
MISMATCHED = "mismatched"


def tally(events, served_of: dict[str, Served | None]) -> Counter:
    """(experiment, variant, event_type, bucket) -> events, for events whose request was
    served under a variant to the event's user with the event's item (bucket: the user's
    analysis bucket, ``freshcore.abstats.bucket_of``). Events naming a request without a record
    count as ("", "unattributed", type, -1); those whose user or item is not the reply's, as
    ("", "mismatched", type, -1).

    >>> from schemas.records import Event
    >>> from freshcore.served import decode, encode
    >>> es = [Event("e1", "click", "u", "i", 1, request_id="r1"),
    ...       Event("e2", "impression", "u", "i", 1, request_id="r2"),
    ...       Event("e3", "click", "v", "i", 1, request_id="r1"),
    ...       Event("e4", "impression", "u", "i", 1)]
    >>> t = tally(es, {"r1": decode(encode("exp/b", "u", ["i"])), "r2": None})
    >>> sorted((k[:3], n) for k, n in t.items())
    [(('', 'mismatched', 'click'), 1), (('', 'unattributed', 'impression'), 1), (('exp', 'b', 'click'), 1)]
    """
    out: Counter = Counter()
    for e in events:
        if e.request_id is None:
            continue
        served = served_of.get(e.request_id)
        if served is None:
            out[("", UNATTRIBUTED, e.event_type, -1)] += 1
        elif not served.matches(e.user_id, e.item_id):
            out[("", MISMATCHED, e.event_type, -1)] += 1
        else:
            exp, _, variant = served.tag.partition("/")
            out[(exp, variant, e.event_type, bucket_of(e.user_id))] += 1
    return out


def count_commands(keys: RedisKeys, counts: Counter) -> list[Packed]:
    """HINCRBY of each (experiment, variant, type) on the experiment's counts hash: the total
    and the user's analysis bucket's."""
    totals: Counter = Counter()
    fields: Counter = Counter()
    for (exp, variant, kind, bucket), n in counts.items():
        if exp:
            totals[(exp, f"{variant}:{kind}")] += n
            fields[(exp, f"{variant}:{kind}:{bucket}")] += n
    out = []
    for (exp, field), n in (totals + fields).items():
        key = keys.experiment_counts(exp).encode()
        out.append(Packed(key, pack(b"HINCRBY", key, field.encode(), b"%d" % n), 1))
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
        served_of = {
            r: (decode(v[0]) if v[0] is not None else None)
            for r, v in zip(rids, replies, strict=True)
        }
        counts = tally(events, served_of)
        for (exp, variant, kind, _), n in counts.items():
            m.EXPERIMENT_EVENTS.labels(exp, variant, kind).inc(n)
        return count_commands(self.keys, counts)
