"""The worker's A/B experiment: the file it is declared in (``FRESHREC_EXPERIMENTS_FILE``),
reloaded when it changes, and its allocation table, shared through Redis so every worker
assigns a user alike (``inference/serving/experiments.py``).

Redis holds, per experiment, ``exp:{name}`` (the variants in table order, their shares, the
control, the salt and the allocation table) and ``exp:{name}:counts`` (per variant,
``requests`` and ``cost_us`` (serving time) counted by the workers and
``impression``/``click``/``conversion`` by the streams app, each also per analysis bucket of
the users, ``{variant}:{kind}:{bucket}``: ``freshcore.abstats``); each served request's variant,
user and items are kept under ``req:variant:{request_id}`` (``freshcore.served``) for the
streams app to attribute the events that name the request. A worker whose file's shares
differ from the stored ones writes the table anew from the stored one (``allocate``: the
fewest users move); workers reading the same file compute the same table.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path

import redis

from freshcore import clock
from freshcore import metrics as m
from freshcore.abstats import bucket_of
from freshcore.rediskeys import RedisKeys
from freshcore.served import encode
from inference.serving.arms import Arm
from inference.serving.experiments import Experiment, ExperimentError, allocate, load

log = logging.getLogger("freshrec.worker")
CHECK_EVERY_S = 2.0


def stored_layout(exp: Experiment) -> dict[str, str]:
    """What ``exp:{name}`` says besides the table: variants in table order and their shares."""
    return {
        "variants": json.dumps([v.name for v in exp.variants]),
        "shares": json.dumps([v.share for v in exp.variants]),
        "control": exp.control,
        "salt": exp.salt,
    }


def sync_table(r: redis.Redis, keys: RedisKeys, exp: Experiment) -> bytes:
    """The allocation table for ``exp``: the stored one if it was made for these variants and
    shares, else one made from it (or from nothing) with the fewest users moved, stored."""
    key = keys.experiment(exp.name)
    stored = r.hgetall(key)
    layout = stored_layout(exp)
    table = stored.get(b"table")
    if table is not None and all(stored.get(k.encode()) == v.encode() for k, v in layout.items()):
        return table
    old_names = json.loads(stored[b"variants"]) if b"variants" in stored else []
    if stored.get(b"salt", exp.salt.encode()) != exp.salt.encode():
        table, old_names = None, []  # another salt: another assignment altogether
    new = allocate(table, old_names, exp)
    r.hset(key, mapping={**layout, "table": new, "changed_ms": clock.now_ms()})
    r.sadd(keys.experiments, exp.name)
    log.info(
        "experiment %s: %s",
        exp.name,
        ", ".join(f"{v.name} {v.share:.1%}" for v in exp.variants),
    )
    return new


class LiveExperiment:
    def __init__(self, path: Path, client: redis.Redis, keys: RedisKeys, ttl_s: int) -> None:
        self.path = Path(path)
        self.redis = client
        self.keys = keys
        self.ttl_s = ttl_s
        self.experiment: Experiment | None = None
        self.table = b""
        self._stamp: tuple | None = None
        self._checked = 0.0
        self._arms: dict[str, Arm] = {}

    def load(self) -> None:
        """Read the file and the table now: a bad file is an error at start."""
        exp = load(self.path)
        self._stamp = self._file_stamp()
        self._adopt(exp, sync_table(self.redis, self.keys, exp))

    def arm(self, user_id: str) -> Arm | None:
        if self.experiment is None:
            return None
        # the table and the arms are adopted together, so the name is always among them
        return self._arms.get(self.experiment.variant_of(self.table, user_id))

    def poll(self, now: float) -> None:
        """Every couple of seconds: a changed file is parsed and its shares applied (a bad
        one is logged and the running experiment kept), and a table another worker stored is
        adopted."""
        if now - self._checked < CHECK_EVERY_S:
            return
        self._checked = now
        stamp = None
        try:
            stamp = self._file_stamp()
            candidate = self.experiment
            if stamp != self._stamp:
                candidate = load(self.path)
                if self.experiment is None or candidate != self.experiment:
                    log.info("experiments file %s changed: reloading", self.path)
            if candidate is not None:
                # the new experiment and its table are adopted together, or neither is
                self._adopt(candidate, sync_table(self.redis, self.keys, candidate))
            self._stamp = stamp
        except ExperimentError as exc:
            self._stamp = stamp  # not read again until the file changes
            log.error("experiments file not reloaded, the running experiment stays: %s", exc)
        except OSError as exc:  # the file gone or unreadable between stat and read
            log.error("experiments file %s unreadable, the running one stays: %s", self.path, exc)
        except redis.RedisError as exc:  # the file is read again next time
            log.warning("experiment table not refreshed (Redis): %s", exc)
        except Exception:  # whatever a file edit holds, serving goes on with what it has
            self._stamp = stamp
            log.exception("experiments file %s not reloaded, the running one stays", self.path)

    def record(self, replies) -> None:
        """Before the replies leave: each one's variant, user and items under its request id
        (``freshcore.served``), and per variant the requests (in total and per analysis bucket
        of their users) and their serving time. A Redis error loses these counts (logged), not
        the replies."""
        served = [r for r in replies if r.variant]
        if not served:
            return
        per: Counter = Counter()
        for r in served:
            per[(r.experiment, r.variant, "requests")] += 1
            per[(r.experiment, r.variant, f"requests:{bucket_of(r.user_id)}")] += 1
            per[(r.experiment, r.variant, "cost_us")] += round(1000 * r.timings_ms.get("cost", 0.0))
        for (e, v, field), n in per.items():
            if field == "requests":
                m.EXPERIMENT_REQUESTS.labels(e, v).inc(n)
        try:
            pipe = self.redis.pipeline(transaction=False)
            for r in served:
                value = encode(
                    f"{r.experiment}/{r.variant}", r.user_id, (i.item_id for i in r.items)
                )
                pipe.set(self.keys.request_variant(r.request_id), value, ex=self.ttl_s)
            for (e, v, field), n in per.items():
                pipe.hincrby(self.keys.experiment_counts(e), f"{v}:{field}", n)
            pipe.execute()
        except redis.RedisError as exc:
            log.warning("variants of %d replies not recorded: %s", len(served), exc)

    def _adopt(self, exp: Experiment, table: bytes) -> None:
        self.experiment, self.table = exp, table
        self._arms = {v.name: Arm(exp.name, v) for v in exp.variants}

    def _file_stamp(self) -> tuple:
        st = os.stat(self.path)
        return (st.st_mtime_ns, st.st_size)
