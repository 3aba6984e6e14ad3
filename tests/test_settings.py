"""Settings from the environment: defaults, and a clear error naming the variable for a value
a service cannot run with (instead of a failure deep in a request or a training step)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from freshcore.declare import Setting
from freshcore.settings import SettingsError
from inference.clients import events_consumer_config
from inference.settings import WorkerSettings
from param_server.settings import ParamServerSettings
from streams.settings import StreamsSettings

BASE = {"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1", "REDIS_URL": "redis://127.0.0.1:1"}


def test_defaults_parse_for_every_service():
    worker = WorkerSettings.from_env(BASE)
    ps = ParamServerSettings.from_env(BASE)
    assert StreamsSettings.from_env(BASE).validate_process
    assert not StreamsSettings.from_env(
        {**BASE, "FRESHREC_STREAMS_VALIDATE": "thread"}
    ).validate_process
    assert worker.learning.lr == ps.adagrad.lr == 0.05
    assert ps.adagrad.initial_accumulator == 0.0
    # one row TTL: the store's rows and the worker's item rows expire after as long
    assert worker.row_ttl_s == ps.row_ttl_s == 30 * 86_400
    ttl = {**BASE, "FRESHREC_ROW_TTL_S": "0"}
    assert (
        WorkerSettings.from_env(ttl).row_ttl_s == ParamServerSettings.from_env(ttl).row_ttl_s == 0
    )


def test_the_adagrad_initial_accumulator_is_a_setting():
    ps = ParamServerSettings.from_env({**BASE, "FRESHREC_ADAGRAD_INITIAL_ACCUMULATOR": "0.1"})
    assert ps.adagrad.initial_accumulator == 0.1


@pytest.mark.parametrize(
    ("env", "wait_ms"),
    [
        ({}, 100),  # production, the default: Apache Kafka answers when data arrives
        ({"FRESHREC_KAFKA_PROFILE": "kafka"}, 100),
        ({"FRESHREC_KAFKA_PROFILE": "tansu"}, 10),
        ({"FRESHREC_KAFKA_PROFILE": "local"}, 10),  # tansu's former name
        ({"FRESHREC_WORKER_FETCH_WAIT_MS": "25"}, 25),
        ({"FRESHREC_WORKER_FETCH_WAIT_MS": "0", "FRESHREC_KAFKA_PROFILE": "production"}, 0),
    ],
)
def test_the_workers_fetch_wait_is_its_setting_else_the_profiles(env, wait_ms):
    settings = WorkerSettings.from_env({**BASE, **env})
    cfg = events_consumer_config(settings, "g")
    assert cfg["fetch.wait.max.ms"] == wait_ms
    assert cfg["group.id"] == "g" and cfg["partition.assignment.strategy"] == "range"


def test_the_session_timeout_is_its_setting_else_the_profiles():
    tansu = {"FRESHREC_KAFKA_PROFILE": "tansu"}
    for env, session, heartbeat in (
        ({}, 45000, 3000),
        ({"FRESHREC_KAFKA_PROFILE": "kafka"}, 6000, 500),
        (tansu, 6000, 500),
        ({**tansu, "FRESHREC_KAFKA_SESSION_TIMEOUT_MS": "3000"}, 3000, 500),
        ({**tansu, "FRESHREC_KAFKA_SESSION_TIMEOUT_MS": "1500"}, 1500, 500),
        (
            {"FRESHREC_KAFKA_PROFILE": "production", "FRESHREC_KAFKA_SESSION_TIMEOUT_MS": "6000"},
            6000,
            2000,
        ),
    ):
        cfg = events_consumer_config(WorkerSettings.from_env({**BASE, **env}), "g")
        assert (cfg["session.timeout.ms"], cfg["heartbeat.interval.ms"]) == (session, heartbeat)


@pytest.mark.parametrize(
    ("settings", "name", "value", "why"),
    [
        (WorkerSettings, "FRESHREC_LOCAL_LR", "-0.1", "must be >= 0"),
        (WorkerSettings, "FRESHREC_LOCAL_LR", "nan", "not a finite number"),
        (WorkerSettings, "FRESHREC_LOCAL_LR", "fast", "not a number"),
        (WorkerSettings, "FRESHREC_MAX_GRAD_NORM", "0", "must be > 0"),
        (WorkerSettings, "FRESHREC_MMR_LAMBDA", "1.5", "must be <= 1"),
        (WorkerSettings, "FRESHREC_BREAKER_THRESHOLD", "0", "must be > 0"),
        (WorkerSettings, "FRESHREC_RECALL_DEADLINE_SCALE", "-1", "must be > 0"),
        (WorkerSettings, "FRESHREC_ANN_REFRESH_S", "inf", "not a finite number"),
        (WorkerSettings, "FRESHREC_HOT_DECAY_PER_HOUR", "1.2", "must be <= 1"),
        (WorkerSettings, "FRESHREC_WORKER_FETCH_WAIT_MS", "-1", "must be >= 0"),
        (WorkerSettings, "FRESHREC_WORKER_FETCH_WAIT_MS", "soon", "not an integer"),
        (WorkerSettings, "FRESHREC_MAX_PENDING_STEPS", "10", "must be >= 1000"),
        (WorkerSettings, "FRESHREC_ROW_TTL_S", "-1", "must be >= 0"),
        (WorkerSettings, "FRESHREC_KAFKA_SESSION_TIMEOUT_MS", "500", "must be >= 1500"),
        (WorkerSettings, "FRESHREC_RANKER", "deep", "must be one of"),
        (WorkerSettings, "FRESHREC_TIER_HEAD_SHARE", "2", "must be <= 1"),
        (ParamServerSettings, "FRESHREC_GLOBAL_LR", "-1", "must be >= 0"),
        (ParamServerSettings, "FRESHREC_GLOBAL_LR", "inf", "not a finite number"),
        (ParamServerSettings, "FRESHREC_ADAGRAD_INITIAL_ACCUMULATOR", "-0.1", "must be >= 0"),
        (StreamsSettings, "FRESHREC_PRICE_CAP", "0", "must be > 0"),
        (StreamsSettings, "FRESHREC_HOT_DECAY_PER_HOUR", "0", "must be > 0"),
        (StreamsSettings, "FRESHREC_STREAMS_VALIDATE", "fork", "must be 'process' or 'thread'"),
        (StreamsSettings, "FRESHREC_STREAMS_BATCH_MAX", "0", "must be >= 1"),
        (StreamsSettings, "FRESHREC_FEATURES_WRITE_MS", "5", "must be >= 10"),
        (StreamsSettings, "FRESHREC_STREAMS_FETCH_WAIT_MS", "-5", "must be >= 0"),
        (StreamsSettings, "FRESHREC_STREAMS_FETCH_WAIT_MS", "5ms", "not an integer"),
    ],
)
def test_a_value_a_service_cannot_run_with_is_refused_by_name(settings, name, value, why):
    with pytest.raises(SettingsError, match=f"{name}.*{why}"):
        settings.from_env({**BASE, name: value})


def test_bounds_are_inclusive_and_an_empty_value_takes_the_default():
    x = Setting("TEST_BOUNDS_X", 0.5, "A share.", kind=float, minimum=0, maximum=1)
    assert x.read({"TEST_BOUNDS_X": "0"}) == 0.0
    assert x.read({"TEST_BOUNDS_X": "1"}) == 1.0
    assert x.read({"TEST_BOUNDS_X": ""}) == 0.5
    with pytest.raises(SettingsError, match=r"TEST_BOUNDS_X=1\.5 must be <= 1"):
        x.read({"TEST_BOUNDS_X": "1.5"})


def test_a_service_started_with_a_bad_value_exits_with_the_reason():
    proc = subprocess.run(
        [sys.executable, "-m", "freshrec.app.cli", "param-server"],
        env={**BASE, "FRESHREC_GLOBAL_LR": "-1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "FRESHREC_GLOBAL_LR=-1 must be >= 0" in proc.stderr + proc.stdout


def test_the_worker_and_the_parameter_server_read_the_same_online_defaults(tmp_path):
    """Both find the models where ``freshrec train`` puts them (``FRESHREC_MODEL_DIR``, else
    the state directory's ``models``) and follow their manifest's ``online`` alike."""
    import json

    from inference.settings import WorkerSettings
    from param_server.settings import ParamServerSettings

    models = tmp_path / "models"
    models.mkdir()
    online = {"item_lr": 0.2, "user_lr": 0.4, "global_lr": 0.3, "global_user_lr": 0.6}
    (models / "manifest.json").write_text(json.dumps({"online": online}))
    for env in ({"FRESHREC_HOME": str(tmp_path)}, {"FRESHREC_MODEL_DIR": str(models)}):
        env = {**env, "FRESHREC_WORKER_ID": "w"}
        worker, ps = WorkerSettings.from_env(env), ParamServerSettings.from_env(env)
        assert (worker.learning.lr, worker.learning.user_lr) == (0.2, 0.4)
        assert (ps.adagrad.lr, ps.user_adagrad.lr) == (0.3, 0.6)
        assert worker.model_dir == models
    bare = {"FRESHREC_HOME": str(tmp_path / "elsewhere"), "FRESHREC_WORKER_ID": "w"}
    assert (
        WorkerSettings.from_env(bare).learning.lr == ParamServerSettings.from_env(bare).adagrad.lr
    )


def test_seen_items_are_excluded_unless_the_deployment_declares_repeat_consumption():
    from inference.settings import WorkerSettings

    assert WorkerSettings.from_env({"FRESHREC_WORKER_ID": "w"}).exclude_seen is True
    repeat = {"FRESHREC_WORKER_ID": "w", "FRESHREC_EXCLUDE_SEEN": "false"}
    assert WorkerSettings.from_env(repeat).exclude_seen is False


def test_the_suite_asks_apache_kafka_for_a_session_it_accepts_by_default():
    """Apache Kafka refuses sessions under ``group.min.session.timeout.ms`` (6 s by default):
    the suite, against testcontainers' broker, an external one or its own, must not ask for
    less; on Tansu, where a join takes half the session, it asks for less."""
    from .conftest import Services

    for kind in ("external", "testcontainers", "embedded"):
        s = Services(kind, "localhost:9092", "redis://localhost:6379/0", "kafka")
        assert s.session_timeout_ms >= 6000
        assert s.conn("p.").kafka_session_timeout_ms >= 6000
        assert s.conn("p.").kafka_profile == "kafka"
    tansu = Services("embedded", "b", "r", "tansu")
    assert tansu.session_timeout_ms < 6000 and tansu.conn().kafka_profile == "tansu"
