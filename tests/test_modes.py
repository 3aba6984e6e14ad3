"""Serving modes (``inference/serving/modes.py``): each mode's settings reach the worker's
serving, a control record switches every worker under traffic, and no record can stop one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from freshcore import metrics as m
from freshcore.settings import SettingsError
from inference.serving.livemode import LiveMode
from inference.serving.modes import MODES, ModeError, load_modes
from inference.settings import WorkerSettings
from schemas.codec import encode_control
from schemas.records import ControlRecord

from .serving_harness import client_for, counter, running_worker, worker_settings
from .streams_harness import wait_for


def test_each_shipped_mode_sets_what_it_documents():
    """daily is the settings as configured; promo degrades earlier and batches more;
    acquisition weighs diversity, recalls more new items and holds shown items back."""
    s = WorkerSettings.from_env({"FRESHREC_MMR_LAMBDA": "0.8"})
    daily, promo, acq = (s.modes[n] for n in ("daily", "promo", "acquisition"))
    assert daily.serving == s.serving and (daily.max_batch, daily.max_wait_ms) == (32, 0)
    assert promo.serving.ladder.queue_depth_limit == 32 < daily.serving.ladder.queue_depth_limit
    assert promo.serving.default_budget_ms == 150 and promo.serving.candidates == 200
    assert all(
        promo.serving.channels[c].deadline_ms == daily.serving.channels[c].deadline_ms / 2
        for c in daily.serving.channels
    )
    assert (promo.max_batch, promo.max_wait_ms) == (64, 2)
    assert promo.serving.mmr_lambda == 0.8  # what a mode does not set stays as configured
    assert acq.serving.mmr_lambda == 0.4 and acq.serving.category_gap == 3
    assert acq.serving.hold_shown_s == 300
    assert acq.serving.channels["new"].quota == 120 > daily.serving.channels["new"].quota
    assert s.mode == "daily"


def test_a_modes_file_changes_and_adds_modes_and_bad_ones_stop_the_start(tmp_path):
    path = tmp_path / "modes.toml"
    path.write_text('[promo]\nFRESHREC_MAX_BATCH = 128\n\n[night]\nFRESHREC_RANKER = "pruned"\n')
    modes = load_modes(path)
    assert modes["promo"] == {"FRESHREC_MAX_BATCH": "128"}  # replaced whole
    assert modes["night"] == {"FRESHREC_RANKER": "pruned"} and modes["daily"] == {}
    s = WorkerSettings.from_env({"FRESHREC_MODES_FILE": str(path), "FRESHREC_MODE": "night"})
    assert s.mode == "night" and s.modes["night"].serving.ranker == "pruned"
    for text, words in (
        ("[promo]\nFRESHREC_EMBEDDING_DIM = 8\n", "not a setting a mode may change"),
        ("promo = 3\n", "not a table"),
        ("[promo]\nFRESHREC_MAX_BATCH = [1]\n", "a number or text"),
        ("[promo\n", "modes file"),
    ):
        path.write_text(text)
        with pytest.raises(ModeError, match=words):
            load_modes(path)
    path.write_text('[promo]\nFRESHREC_MMR_LAMBDA = "lots"\n')
    with pytest.raises(SettingsError, match="mode promo: FRESHREC_MMR_LAMBDA"):
        WorkerSettings.from_env({"FRESHREC_MODES_FILE": str(path)})
    with pytest.raises(SettingsError, match="FRESHREC_MODE='rush'"):
        WorkerSettings.from_env({"FRESHREC_MODE": "rush"})


def test_the_live_mode_adopts_the_newest_known_record_and_skips_anything_else():
    applied: list[str] = []
    live = LiveMode(dict.fromkeys(MODES), "daily", lambda name, _: applied.append(name))

    def record(mode: str, at_ms: int) -> bytes:
        return encode_control(ControlRecord(mode, at_ms, "test"))

    invalid, unknown = counter(m.MODE_RECORDS, "invalid"), counter(m.MODE_RECORDS, "unknown_mode")
    for raw in (None, b"", b"\xff" * 10, b"[]", b'{"mode": 5, "at_ms": 1}', b"{" * 5000):
        live.on_record(raw)
    assert counter(m.MODE_RECORDS, "invalid") == invalid + 6
    live.on_record(record("promo", 10))
    live.on_record(record("rush", 20))  # not a mode here: promo stays
    assert counter(m.MODE_RECORDS, "unknown_mode") == unknown + 1
    live.on_record(record("daily", 5))  # older than the one adopted: a replayed topic
    live.on_record(record("promo", 30))
    assert applied == ["daily", "promo"] and live.current == "promo"
    assert m.MODE_INFO.labels("promo")._value.get() == 1
    assert m.MODE_INFO.labels("daily")._value.get() == 0


@pytest.mark.timeout(240)
def test_a_control_record_switches_every_worker_under_traffic_and_replies_name_the_mode(
    seeded, model_dir
):
    """Two workers serve a steady trickle of requests; `set_mode` (what `freshrec mode set`
    does) moves both to promo, and a worker that starts after the switch starts in it. Each
    adopts the mode's batching and ladder, and every reply names the mode it was served in."""
    from freshrec.app.modes import latest_control, set_mode

    conn = seeded
    modes = WorkerSettings.from_env({}).modes
    first = replace(worker_settings(conn, model_dir), modes=modes, worker_id="mode-a")
    with running_worker(first) as a, client_for(conn) as client:
        assert client.recommend("u1", 5, timeout_s=20).mode == "daily"
        assert set_mode(conn, "promo", by="test")
        wait_for(lambda: a.mode.current == "promo", 30, "worker a in promo")
        assert (
            a.intake.policy.max_batch == 64 and a.recommender.ladder.config.queue_depth_limit == 32
        )
        second = replace(first, worker_id="mode-b")
        with running_worker(second) as b:
            wait_for(lambda: b.mode.current == "promo", 30, "worker b in promo")
            served = {client.recommend(f"u{j}", 5, timeout_s=20).mode for j in range(20)}
            assert served == {"promo"}
            assert set_mode(conn, "acquisition", by="test")
            wait_for(lambda: a.mode.current == b.mode.current == "acquisition", 30, "both switched")
            assert b.recommender.shown.hold_ms == 300_000 and b.intake.policy.max_batch == 32
            served = {client.recommend(f"u{j}", 5, timeout_s=20).mode for j in range(20)}
            assert served == {"acquisition"}
            # a record no worker knows, and bytes that are no record: both keep serving
            unknown, invalid = (counter(m.MODE_RECORDS, k) for k in ("unknown_mode", "invalid"))
            assert set_mode(conn, "rush", by="test")
            client_producer_garbage(conn)
            wait_for(
                lambda: (
                    counter(m.MODE_RECORDS, "unknown_mode") >= unknown + 2
                    and counter(m.MODE_RECORDS, "invalid") >= invalid + 2
                ),
                30,
                "both workers to read both records",
            )
            assert client.recommend("u3", 5, timeout_s=20).mode == "acquisition"
    newest = latest_control(conn)
    assert newest is not None and newest.mode == "rush" and newest.by == "test"


def client_producer_garbage(conn) -> None:
    from confluent_kafka import Producer

    from freshcore.kafka import producer_config
    from freshcore.topics import TopicNames

    producer = Producer(producer_config(conn))
    producer.produce(TopicNames(conn.topic_prefix).control, b"\x00not a record", key=b"mode")
    assert producer.flush(10) == 0
