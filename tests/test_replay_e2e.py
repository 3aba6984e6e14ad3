"""``freshrec train --log`` and ``freshrec replay`` on a small generated log: every live arm
through the embedded stack, beside the in-process baselines, and the files it writes."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from evaluation.baselines import BASELINES as SPECS
from freshrec.app.cli import main

CLUSTERS, PER_CLUSTER, USERS = 6, 12, 48


def write_log(path, n: int = 2400, seed: int = 3) -> None:
    """Users keep to one cluster of items until three quarters of the way, then move to the
    next cluster (a drift the replayed part holds); popular items within each cluster."""
    rng = np.random.default_rng(seed)
    rows = ["user,item,timestamp,kind"]
    for j in range(n):
        u = int(rng.integers(USERS))
        cluster = (u + (j >= 3 * n // 4)) % CLUSTERS
        item = cluster * PER_CLUSTER + min(int(rng.geometric(0.3)) - 1, PER_CLUSTER - 1)
        kind = "buy" if rng.random() < 0.1 else "play"
        rows.append(f"user{u},item{item},{1_600_000_000 + 60 * j},{kind}")
    path.write_text("\n".join(rows) + "\n")


LOG_ARGS = ["--user-col", "user", "--item-col", "item", "--time-col", "timestamp"]
TYPE_ARGS = ["--type-col", "kind", "--types", "play=click,buy=conversion"]


def test_train_on_a_log_writes_models_and_their_online_settings(tmp_path, capsys):
    log = tmp_path / "log.csv"
    write_log(log)
    out = tmp_path / "models"
    train = ["train", "--log", str(log), *LOG_ARGS, *TYPE_ARGS]
    rc = main(
        [*train, "--out", str(out), "--load", "no", "--tower-epochs", "2", "--rankers", "pruned"]
    )
    assert rc == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"].startswith("log:")
    assert manifest["online"]["loss"] == "softmax"
    t = manifest["training"]
    assert t["users"] == USERS and t["config"]["tower_loss"] == "softmax"
    printed = capsys.readouterr()
    assert "read 2,400 interactions (48 users, 72 items)" in printed.err + printed.out
    assert "held out (the last 10% by time): HR@10 two-tower" in printed.err + printed.out


def test_train_on_a_log_that_cannot_be_used_is_a_one_line_error(tmp_path, capsys):
    log = tmp_path / "log.csv"
    log.write_text("user,item,timestamp\n,,\n")
    assert main(["train", "--log", str(log), *LOG_ARGS, "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"freshrec: error: {log}: no usable interaction; 1 bad rows: line 2: empty user id"
    ]


@pytest.mark.timeout(600)
def test_replay_runs_every_arm_live_and_the_baselines_on_the_same_interactions(tmp_path, capsys):
    log = tmp_path / "log.csv"
    write_log(log)
    out = tmp_path / "replay"
    replay = ["replay", str(log), *LOG_ARGS, *TYPE_ARGS, "--out", str(out), "--step", "60"]
    rc = main([*replay, "--speed", "1e9", "--tower-epochs", "2", "--windows", "4"])
    assert rc == 0
    table = capsys.readouterr().out
    assert table.startswith("broker: ")  # the first line names the broker
    report = json.loads((out / "replay.json").read_text())
    assert report["broker"] in ("Tansu", "Apache Kafka 4.4.0")
    rows = {r["arm"]: r for r in report["arms"]}
    baselines = list(SPECS)
    assert list(rows) == ["frozen", "local", "full", *baselines]
    evaluated = report["evaluated"]
    assert evaluated > 0 and all(r["interactions"] == evaluated for r in rows.values())
    for arm in ("frozen", "local", "full"):
        d = report["details"][arm]
        assert d["answered"] == d["requests"] > 0 and d["timeouts"] == d["errors"] == 0, d
        assert d["events_read_before_the_replay"] == 0, d  # the training part not learnt twice
        assert d["items_listed_before_they_existed"] == 0, d
        assert d["events"] == report["interactions"] - report["train_end"], d
        bare = d["without_exclude"]  # FRESHREC_EXCLUDE_SEEN's default: nothing read comes back
        assert bare["lists"] > 0 and bare["consumed_in_replay_share"] == 0.0, bare
        # better than lists drawn at random from what each user had not consumed
        assert rows[arm]["hr"] > 10 / (CLUSTERS * PER_CLUSTER), rows[arm]
    assert report["details"]["recent_pop"]["chosen_on_the_training_part"].startswith("window=")
    with (out / "replay.csv").open() as f:
        assert [r["arm"] for r in csv.DictReader(f)] == list(rows)
    with (out / "replay_windows.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(rows) * 4
    assert (out / "replay_hr.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    knn = report["details"]["item_knn"]
    assert knn["chosen_on_the_training_part"].startswith("alpha=")
    # every setting searched, with its score on the training part; the chosen one the best
    grid = dict(SPECS["item_knn"].candidates(report["train_end"]))
    assert set(knn["validation_hr"]) == set(grid)
    assert knn["validation_hr"][knn["chosen_on_the_training_part"]] == max(
        knn["validation_hr"].values()
    )
    # each live arm against each baseline and against frozen, on the same interactions
    paired = {(r["arm"], r["against"]): r for r in report["paired"]}
    assert set(paired) == {
        *((a, b) for a in ("frozen", "local", "full") for b in baselines),
        ("local", "frozen"),
        ("full", "frozen"),
    }
    for r in paired.values():
        assert r["interactions"] == evaluated and r["hr_low"] <= r["hr"] <= r["hr_high"]
        assert r["hr"] == pytest.approx(rows[r["arm"]]["hr"] - rows[r["against"]]["hr"], abs=2e-4)
    for whose in ("by_history", "by_item_history"):
        history = report[whose]
        assert set(history) == set(rows)
        for name, buckets in history.items():  # every scored interaction in one bucket
            assert sum(b["interactions"] for b in buckets.values()) == evaluated, (whose, name)
    assert "HR@10" in table and "recent_pop" in table and "HR@10 diff (95% CI)" in table
    assert "HR@10 by earlier interactions" in table
    assert "HR@10 by the item's earlier interactions" in table


def write_growing_log(path, n: int = 1800, seed: int = 5) -> None:
    """A log whose catalogue grows: every 60 interactions a new item is published and most
    clicks go to the newest few (a news feed)."""
    rng = np.random.default_rng(seed)
    rows = ["user,item,timestamp"]
    for j in range(n):
        newest = j // 60
        age = min(int(rng.geometric(0.5)) - 1, newest)
        rows.append(f"user{int(rng.integers(40))},story{newest - age},{1_600_000_000 + 60 * j}")
    path.write_text("\n".join(rows) + "\n")


@pytest.mark.timeout(600)
def test_a_catalogue_listed_as_it_appears_is_unknown_to_every_arm_before_its_first_click(
    tmp_path,
):
    """--catalogue as-it-appears: each item goes to ``items`` just before its first
    interaction, training part included, so no live arm lists one before it exists; the
    replay counts any that did."""
    log = tmp_path / "news.csv"
    write_growing_log(log)
    out = tmp_path / "replay"
    args = ["replay", str(log), *LOG_ARGS, "--out", str(out), "--step", "60", "--windows", "2"]
    live = ["--catalogue", "as-it-appears", "--arms", "full,full-without-new"]
    live += ["--baselines", "recent_pop"]
    rc = main([*args, *live, "--speed", "1e9", "--tower-epochs", "2"])
    assert rc == 0
    report = json.loads((out / "replay.json").read_text())
    assert report["settings"]["catalogue"] == "as-it-appears"
    d = report["details"]["full"]
    assert d["answered"] == d["requests"] > 0 and d["items_listed_before_they_existed"] == 0, d
    rows = {r["arm"]: r for r in report["arms"]}
    assert rows["full"]["hr"] > 0 and rows["recent_pop"]["hr"] > 0
    # each hit counted for every channel that found its item: each channel's own HR
    assert max(d["hr_by_channel"].values()) > 0 and sum(d["hr_by_channel"].values()) >= (
        rows["full"]["hr"] - 1e-4
    )
    ablated = report["details"]["full-without-new"]
    assert "new" not in ablated["channel_share_of_listed_items"], ablated
    assert any(r["arm"] == "full" and r["against"] == "full-without-new" for r in report["paired"])


@pytest.mark.timeout(600)
def test_replay_tunes_a_live_setting_on_a_validation_cut_and_says_where_it_came_from(tmp_path):
    """--tune: each candidate runs the live arm on the training part's last tenth (models
    trained on the rest); the scored part is replayed once, with the best, and replay.json
    says which setting was used and where it came from."""
    log = tmp_path / "log.csv"
    write_log(log)
    out = tmp_path / "replay"
    rc = main(
        [
            "replay",
            str(log),
            *LOG_ARGS,
            *TYPE_ARGS,
            "--out",
            str(out),
            "--step",
            "60",
            "--speed",
            "1e9",
            "--tower-epochs",
            "2",
            "--arms",
            "full",
            "--baselines",
            "",
            "--tune",
            "FRESHREC_MMR_LAMBDA=0.5,1.0",
        ]
    )
    assert rc == 0
    report = json.loads((out / "replay.json").read_text())
    d = report["details"]["full"]
    hr = d["validation_hr"]
    assert set(hr) == {"FRESHREC_MMR_LAMBDA=0.5", "FRESHREC_MMR_LAMBDA=1.0"}
    best = max(hr, key=hr.get)
    assert f"FRESHREC_MMR_LAMBDA={d['settings']['FRESHREC_MMR_LAMBDA']}" == best
    assert d["settings_from"].startswith("--tune: the best HR@k on a validation replay")
    # the validation replay's models were trained on the cut's first 90% alone
    validation = json.loads((out / "validation" / "models" / "manifest.json").read_text())
    scored = json.loads((out / "models" / "manifest.json").read_text())
    assert validation["training"]["impressions"] < scored["training"]["impressions"]
