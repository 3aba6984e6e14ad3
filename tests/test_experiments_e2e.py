"""An A/B experiment on the embedded stack: a worker serves each user the variant its salted
hash says, the reply names it, the light variant is ranked by the light model, the streams
app attributes impressions, clicks and conversions naming a reply to that reply's variant,
`freshrec experiments report` shows them, and a share changed in the file moves only the
users the new shares require."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from freshrec.experiments import parse
from freshrec.redisconn import connect
from freshrec.rediskeys import RedisKeys
from schemas.records import Event

from .serving_harness import client_for, running_worker, worker_settings
from .streams_harness import produce, service, service_env, wait_for

EXP = """\
[experiment]
name = "e2e"

[[variant]]
name = "control"
share = 0.5

[[variant]]
name = "light"
share = 0.5
ranking = "light"
mmr_lambda = 0.3
"""


def test_variants_are_served_counted_and_attributed_and_shares_move_few_users(
    seeded, model_dir, tmp_path
):
    conn = seeded
    path = tmp_path / "experiments.toml"
    path.write_text(EXP)
    exp = parse(EXP)
    r = connect(conn.redis_url)
    keys = RedisKeys(conn.topic_prefix)
    settings = worker_settings(conn, model_dir, experiments_file=path)
    with (
        service(conn, "streams", tmp_path / "streams.log"),
        running_worker(settings),
        client_for(conn) as client,
    ):
        table = r.hget(keys.experiment("e2e"), "table")
        users = [f"u{i}" for i in range(16)]
        replies = [client.recommend(u, 5, context={"device": "pc"}, timeout_s=20) for u in users]
        for u, reply in zip(users, replies, strict=True):
            assert reply.experiment == "e2e" and reply.variant == exp.variant_of(table, u)
            assert reply.tier == ("light" if reply.variant == "light" else "full"), reply
        served = {v: sum(x.variant == v for x in replies) for v in ("control", "light")}
        assert all(served.values()), served  # both variants among 16 users

        # feedback naming the replies: two impressions and a click each, a conversion for
        # the first; and a click naming a request nobody answered (not any variant's)
        now = int(time.time() * 1000)
        events = []
        for n, reply in enumerate(replies):
            rid, user = reply.request_id, reply.user_id
            for pos, item in enumerate(reply.items[:2]):
                e = Event(
                    f"{rid}-i{pos}", "impression", user, item.item_id, now, None, "pc", rid, pos
                )
                events.append(e)
            first = reply.items[0].item_id
            events.append(Event(f"{rid}-c", "click", user, first, now + 1, None, "pc", rid, 0))
            if n == 0:
                events.append(
                    Event(f"{rid}-v", "conversion", user, first, now + 2, None, "pc", rid, 0, 9.5)
                )
        events.append(Event("stray-c", "click", "u1", "i1", now, None, "pc", "nobody-asked", 0))
        produce(conn, events)
        want = {}
        for reply in replies:
            v = reply.variant
            for kind, n in (("requests", 1), ("impression", 2), ("click", 1)):
                want[f"{v}:{kind}"] = want.get(f"{v}:{kind}", 0) + n
        want[f"{replies[0].variant}:conversion"] = 1

        def counts():
            got = {k.decode(): int(v) for k, v in r.hgetall(keys.experiment_counts("e2e")).items()}
            return got == want or got

        wait_for(counts, 60, "the streams app to attribute the events")
        report = subprocess.run(
            [sys.executable, "-m", "freshrec.app.cli", "experiments", "report", "--json"],
            env=service_env(conn),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert report.returncode == 0, report.stderr
        rows = {v["variant"]: v for v in json.loads(report.stdout)["e2e"]["variants"]}
        for v, n in served.items():
            assert rows[v]["requests"] == n and rows[v]["impressions"] == 2 * n
            assert rows[v]["clicks"] == n and rows[v]["ctr"] == 0.5
        assert rows["light"]["vs_control"]["ctr_diff"] == 0.0

        # the control grows to 90%: 400 buckets move to it, none the other way
        path.write_text(
            EXP.replace("share = 0.5\n\n", "share = 0.9\n\n").replace(
                "share = 0.5\nranking", "share = 0.1\nranking"
            )
        )
        wait_for(
            lambda: r.hget(keys.experiment("e2e"), "table") != table,
            30,
            "the worker to apply the new shares",
        )
        new = r.hget(keys.experiment("e2e"), "table")
        moved = [b for b, (a, c) in enumerate(zip(table, new, strict=True)) if a != c]
        assert len(moved) == 400 and all(table[b] == 1 and new[b] == 0 for b in moved)
        grown = parse(path.read_text())
        mover = next(
            u
            for u in (f"u{i}" for i in range(1000))
            if exp.variant_of(table, u) == "light" and grown.variant_of(new, u) == "control"
        )
        assert client.recommend(mover, 5, timeout_s=20).variant == "control"
