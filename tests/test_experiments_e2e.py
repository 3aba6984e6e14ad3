"""An A/B experiment on the embedded stack: a worker serves each user the variant its salted
hash says, the reply names it, the light variant is ranked by the light model, the streams
app attributes impressions, clicks and conversions naming a reply to that reply's variant,
`freshrec experiments report` shows them, and a share changed in the file moves only the
users the new shares require."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from freshcore import clock
from freshcore.abstats import bucket_of
from freshcore.redisconn import connect
from freshcore.rediskeys import RedisKeys
from inference.serving.experiments import parse
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
        now = clock.now_ms()
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
        # clicks naming a real reply with another user, or an item it did not list: neither
        # counts (attribution follows what the reply was)
        rid0, first0 = replies[0].request_id, replies[0].items[0].item_id
        events.append(Event("forged-u", "click", "someone", first0, now, None, "pc", rid0, 0))
        events.append(Event("forged-i", "click", replies[0].user_id, "nope", now, None, "pc", rid0))
        produce(conn, events)
        want = {}

        def add(v, user, kind, n):
            for field in (f"{v}:{kind}", f"{v}:{kind}:{bucket_of(user)}"):
                want[field] = want.get(field, 0) + n

        for reply in replies:
            for kind, n in (("requests", 1), ("impression", 2), ("click", 1)):
                add(reply.variant, reply.user_id, kind, n)
        add(replies[0].variant, replies[0].user_id, "conversion", 1)

        def counts():
            got = {k.decode(): int(v) for k, v in r.hgetall(keys.experiment_counts("e2e")).items()}
            spent = {k: got.pop(k, 0) for k in ("control:cost_us", "light:cost_us")}
            return (got == want and all(spent.values())) or (got, spent)

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
        assert rows["light"]["vs_control"]["verdict"] == "not enough data"  # 16 users
        assert all(rows[v]["serving_s_per_1k"] > 0 for v in served)

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


RANKERS_EXP = """\
[experiment]
name = "rankers"

[[variant]]
name = "attention"
share = 0.25
ranking = "attention"

[[variant]]
name = "window"
share = 0.25
ranking = "attention_window"

[[variant]]
name = "lowrank"
share = 0.25
ranking = "attention_lowrank"

[[variant]]
name = "tiered"
share = 0.25
ranking = "tiered"
head_share = 0.3
mid_share = 0.3
"""


def test_variants_rank_with_the_attention_models_and_the_heat_tiers(seeded, model_dir, tmp_path):
    """Each variant's replies are ranked by its model (the reply's ``ranker``), the tiered
    variant's candidates by all three tier models, and the attention rankers read the user's
    sequence from the clicks the worker has read."""
    from freshcore import metrics as m
    from inference.models.attention import SEQUENCE
    from inference.serving.recall import RecallResult
    from schemas.records import RecommendRequest

    from .serving_harness import counter

    conn = seeded
    path = tmp_path / "experiments.toml"
    path.write_text(RANKERS_EXP)
    exp = parse(RANKERS_EXP)
    kinds = {v.name: v.ranking for v in exp.variants}
    tier_models = ("wide_deep", "pruned", "light")
    before = {k: counter(m.RANKED_CANDIDATES, k) for k in (*tier_models, *kinds.values())}
    settings = worker_settings(conn, model_dir, experiments_file=path)
    r = connect(conn.redis_url)
    keys = RedisKeys(conn.topic_prefix)
    # item heat as the streams app publishes it: item iN is N hot (400 items)
    r.hset(keys.item_feature("hot", 0), mapping={f"i{n}": float(n) for n in range(400)})
    r.set(keys.feature_shards, 1)
    with running_worker(settings) as w, client_for(conn) as client:
        table = r.hget(keys.experiment("rankers"), "table")
        users = [f"u{i}" for i in range(24)]
        for u in users:
            reply = client.recommend(u, 5, context={"device": "pc"}, timeout_s=20)
            variant = exp.variant_of(table, u)
            assert (reply.variant, reply.tier, reply.ranker) == (variant, "full", kinds[variant])
            assert len(reply.items) == 5, reply
        after = {k: counter(m.RANKED_CANDIDATES, k) for k in before}
        grew = {k for k in before if after[k] > before[k]}
        assert grew == set(before) - {"tiered"}, (before, after)

        # a user's clicks become their sequence, newest first
        user = users[0]
        clicked = ["i3", "i7", "i11"]
        now = clock.now_ms()
        produce(
            conn,
            [
                Event(f"seq-{n}", "click", user, item, now + n, None, "pc")
                for n, item in enumerate(clicked)
            ],
        )
        wait_for(lambda: w.seen.get(user)[:3] == clicked[::-1], 30, "the worker to read the clicks")
        rec = w.recommender
        slots = torch.tensor([rec.slot_of[x] for x in clicked[::-1]])

        def sequence_is_the_clicked_rows():
            # the worker applies broadcast rows while this runs: a row changed between
            # the sequence's gather and this read is read again, not compared stale
            batch = rec.rank_batch(
                [RecommendRequest("x", user)], None, [], [None], RecallResult([{}])
            )
            seq, lens = rec.ranking._sequences(batch, [0], SEQUENCE)
            assert int(lens[0]) >= 3
            return torch.equal(seq[0, :3], rec.cache.items.rows.index_select(0, slots))

        wait_for(sequence_is_the_clicked_rows, 30, "the sequence to be the clicked items' rows")
