"""Child services of ``freshrec run``: started with the run's settings, stopped with it."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from freshrec.app.stack.processes import die_with_parent
from schemas.errors import FreshRecError

log = logging.getLogger("freshrec.run")


class ServiceDied(FreshRecError, RuntimeError):
    """A child service of the run exited; the message carries its last log lines."""


@dataclass
class ServiceGroup:
    """``freshrec <command>`` children; ``stop_all`` sends SIGTERM, then SIGKILL after a grace."""

    env: Mapping[str, str]
    log_dir: Path
    children: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    failure: Exception | None = None

    def start(self, name: str, *args: str, **extra_env: str) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = dict(self.env)
        env.update(extra_env)
        env["PYTHONUNBUFFERED"] = "1"
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "freshrec.app.cli", *args],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
        self.children.append((name, proc))
        log.info("started %s (pid %d), log %s", name, proc.pid, log_path)
        return proc

    def check(self) -> None:
        """Raise if a child died: a run with a dead service is not a run."""
        for name, proc in self.children:
            if proc.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-5:]
                raise ServiceDied(
                    f"{name} exited with code {proc.returncode}; last log lines:\n"
                    + "\n".join(tail)
                )

    def stop_all(self, grace_s: float = 10.0) -> None:
        for _, proc in self.children:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name, proc in self.children:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs: killing it", name, grace_s)
                proc.kill()
                proc.wait(5)
        self.children.clear()


def child_env(conn_env: Mapping[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(conn_env)
    return env
