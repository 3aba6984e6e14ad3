"""FreshRec deployed as docker-compose deploys it, on the tests' secure broker
(``secure_broker.py``): each service's command and Kafka user read from
``docker-compose.yml``, a Redis server with compose's ACL user and a password of the run's,
every process's output in a log of its own, so that a test can search all of it for secrets.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from freshcore.settings import ConnectionSettings, KafkaSecurity
from freshrec.app.stack import free_port, redis_argv, redis_binary

from .secure_broker import ROOT, SecureKafka

COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICE_COMMANDS = ("streams", "param-server", "worker")
"""The long-running FreshRec services, by their ``freshrec`` command."""
STARTED_LINES = {
    "streams": "freshrec.streams: streams app ",
    "param-server": "freshrec.param_server: parameter server on ",
    "worker": "freshrec.worker: worker ",
}
"""The line each service logs once it has connected and is about to work."""


def compose_user(command: str) -> str:
    """The Kafka user docker-compose runs ``freshrec <command>`` as (its
    ``KAFKA_SASL_USERNAME``); the first service of that command (``worker`` and
    ``worker-gpu`` agree, which ``test_compose`` checks)."""
    for service in COMPOSE["services"].values():
        if service.get("build") and " ".join(service["command"]) == command:
            return service["environment"]["KAFKA_SASL_USERNAME"]
    raise LookupError(f"docker-compose.yml runs no `freshrec {command}`")


def compose_redis_acl(password: str) -> list[str]:
    """The ``--user`` arguments compose's Redis starts with, with ``password`` for its
    ``${REDIS_PASSWORD}``: the default user off, ``freshrec`` without admin commands."""
    command = COMPOSE["services"]["redis"]["command"]
    acl = command[command.index("--user") :]
    return [re.sub(r"\$\{REDIS_PASSWORD[^}]*\}", password, a) for a in acl]


def freshrec_env(home: Path, **extra: str) -> dict[str, str]:
    """A FreshRec process's environment: this one's, less every FreshRec, Kafka and Redis
    setting, plus ``extra``."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("FRESHREC_", "KAFKA_", "REDIS_"))
    }
    env.update(
        FRESHREC_HOME=str(home),
        FRESHREC_KAFKA_PROFILE="kafka",
        FRESHREC_KAFKA_SESSION_TIMEOUT_MS="6000",
        FRESHREC_TOPIC_PREFIX="",
        FRESHREC_METRICS_PORT="0",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


CLI = (sys.executable, "-m", "freshrec.app.cli")


@dataclass
class SecureDeployment:
    """The broker, a Redis with a password, and the logs of every FreshRec process run."""

    kafka: SecureKafka
    home: Path
    redis_password: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    redis_port: int = 0
    wrong_password: str = field(default_factory=lambda: "wrong-" + secrets.token_urlsafe(12))
    """A password no user has, for the refused logins: no log may show it either."""
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def redis_url(self) -> str:
        return f"redis://freshrec:{self.redis_password}@127.0.0.1:{self.redis_port}/0"

    @property
    def secrets(self) -> list[str]:
        return [*self.kafka.passwords.values(), self.redis_password, self.wrong_password]

    def log(self, name: str) -> Path:
        return self.home / "logs" / f"{name}.log"

    def logs(self) -> dict[str, str]:
        """Every FreshRec process's output so far, by name, and the broker's."""
        found = {p.stem: p.read_text(errors="replace") for p in (self.home / "logs").glob("*")}
        return {**found, "kafka": self.kafka.logs()}

    def env(
        self, principal: str, name: str, listener: str | None = None, **extra: str
    ) -> dict[str, str]:
        """The environment of a FreshRec process called ``name`` logged in as ``principal``
        (over ``listener``, by default the clients' TLS one); ``extra`` over it."""
        security = self.kafka.security_env(principal, *([listener] if listener else []))
        return freshrec_env(self.home / name, REDIS_URL=self.redis_url, **{**security, **extra})

    def conn(self, principal: str, listener: str | None = None) -> ConnectionSettings:
        """Connection settings of a process in this test logged in as ``principal``."""
        env = self.env(principal, "test", listener)
        return ConnectionSettings.from_env(env)

    def security(self, principal: str) -> KafkaSecurity:
        return self.conn(principal).kafka_security

    def run(
        self, name: str, principal: str, *args: str, listener: str | None = None, **extra: str
    ) -> int:
        """``freshrec ARGS`` logged in as ``principal``, to its end; its output in
        ``name``'s log. Returns its exit code."""
        self.log(name).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log(name), "ab") as out:
            done = subprocess.run(
                [*CLI, *args],
                env=self.env(principal, name, listener, **extra),
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=300,
            )
        return done.returncode

    def start(self, name: str, principal: str, *args: str) -> subprocess.Popen:
        """``freshrec ARGS`` started as ``principal``; stopped by ``stop``."""
        self.log(name).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log(name), "ab") as out:
            proc = subprocess.Popen(
                [*CLI, *args],
                env=self.env(principal, name),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.procs[name] = proc
        return proc

    @contextlib.contextmanager
    def redis(self) -> Iterator[subprocess.Popen]:
        """compose's Redis (its ACL user, a password), on a free loopback port."""
        self.redis_port = free_port()
        data = self.home / "redis"
        data.mkdir(parents=True, exist_ok=True)
        argv = [*redis_argv(redis_binary(), self.redis_port, data),
                *compose_redis_acl(self.redis_password)]  # fmt: skip
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            yield proc
        finally:
            proc.terminate()
            proc.wait(10)

    def started(self, name: str) -> bool:
        """Whether service ``name`` logged its start; one that exited raises, with its log."""
        text = self.log(name).read_text(errors="replace")
        if self.procs[name].poll() is not None:
            raise AssertionError(f"`freshrec {name}` exited at start:\n{text[-3000:]}")
        return STARTED_LINES[name] in text

    def stop(self) -> dict[str, int]:
        """SIGTERM to every service, SIGKILL to one still running after 30 s; their exit
        codes."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        codes = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait(10)
        return codes
