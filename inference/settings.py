"""Settings of ``freshrec worker``, read from the environment at the edge."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from freshrec.settings import ConnectionSettings, env_float, env_int
from inference.learning import LabelConfig


@dataclass(frozen=True)
class LearningSettings:
    dim: int = 64
    lr: float = 0.05
    """Local step size u ← u − lr·g. The seeds' 0.001 moves a user's row by ~1e-4 per click:
    invisible in recommendations; 0.05 lets a handful of clicks move them (see docs)."""
    max_grad_norm: float = 1.0
    admission_touches: int = 1
    """A row's gradients go to the parameter server from its Nth touch on (Monolith's
    occurrence filter); before that its steps stay local and are sent on admission."""
    labels: LabelConfig = field(default_factory=LabelConfig)


@dataclass(frozen=True)
class WorkerSettings:
    conn: ConnectionSettings
    learning: LearningSettings = field(default_factory=LearningSettings)
    user_capacity_rows: int = 200_000
    batch_max: int = 2000
    poll_timeout_ms: int = 5
    device: str = "auto"
    worker_id: str = ""
    metrics_port: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WorkerSettings:
        learning = LearningSettings(
            dim=env_int(env, "FRESHREC_EMBEDDING_DIM", 64, minimum=1),
            lr=env_float(env, "FRESHREC_LOCAL_LR", 0.05),
            max_grad_norm=env_float(env, "FRESHREC_MAX_GRAD_NORM", 1.0),
            admission_touches=env_int(env, "FRESHREC_ADMISSION_TOUCHES", 1, minimum=1),
        )
        return cls(
            conn=ConnectionSettings.from_env(env),
            learning=learning,
            user_capacity_rows=env_int(env, "FRESHREC_USER_CACHE_ROWS", 200_000, minimum=1),
            batch_max=env_int(env, "FRESHREC_WORKER_BATCH_MAX", 2000, minimum=1),
            device=env.get("FRESHREC_DEVICE", "auto") or "auto",
            worker_id=env.get("FRESHREC_WORKER_ID") or f"{socket.gethostname()}-{os.getpid()}",
            metrics_port=env_int(env, "FRESHREC_METRICS_PORT", 0, minimum=0),
        )
