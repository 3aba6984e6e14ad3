"""Settings of ``freshrec param-server``, read from the environment at the edge."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from freshcore.settings import (
    LEARNING_RATE,
    ConnectionSettings,
    RowSettings,
    env_bool,
    env_float,
    env_int,
    online_defaults,
)
from param_server.adagrad import AdagradConfig
from schemas.rows import TABLE_USER


@dataclass(frozen=True)
class ParamServerSettings:
    conn: ConnectionSettings
    dim: int = 64
    adagrad: AdagradConfig = field(default_factory=AdagradConfig)
    """Item rows' Adagrad; user rows' too unless ``user_adagrad`` is set."""
    user_adagrad: AdagradConfig | None = None
    flush_interval_ms: int = 100
    """How often applied rows are persisted (one Redis transaction) and broadcast."""
    max_dirty_rows: int = 50_000
    """Flush early when this many rows wait."""
    metrics_port: int = 0
    row_ttl_s: int = 30 * 86_400
    """Rows not updated for this long leave the server's memory, and Redis drops them (hash
    field expiry, Redis 7.4+ / Valkey 9+); 0 keeps every row forever."""
    updates_half: bool = False
    """Broadcast rows on ``embeddings.updates`` as float16 (``FRESHREC_UPDATES_FP16``: half
    the bytes of the rows; every worker must read layout version 3)."""

    def adagrad_for(self, table: int) -> AdagradConfig:
        if table == TABLE_USER and self.user_adagrad is not None:
            return self.user_adagrad
        return self.adagrad

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ParamServerSettings:
        rows = RowSettings.from_env(env)
        online = online_defaults(env)
        adagrad = AdagradConfig(
            lr=env_float(
                env, "FRESHREC_GLOBAL_LR", float(online.get("global_lr", LEARNING_RATE)), minimum=0
            ),
            max_norm=rows.max_grad_norm,
            initial_accumulator=env_float(
                env,
                "FRESHREC_ADAGRAD_INITIAL_ACCUMULATOR",
                float(online.get("adagrad_initial_accumulator", 0.0)),
                minimum=0,
            ),
        )
        user_lr = env.get("FRESHREC_GLOBAL_USER_LR") or online.get("global_user_lr")
        return cls(
            conn=ConnectionSettings.from_env(env),
            dim=rows.dim,
            adagrad=adagrad,
            user_adagrad=replace(
                adagrad, lr=env_float(env, "FRESHREC_GLOBAL_USER_LR", float(user_lr), minimum=0)
            )
            if user_lr
            else None,
            flush_interval_ms=env_int(env, "FRESHREC_FLUSH_INTERVAL_MS", 100, minimum=1),
            max_dirty_rows=env_int(env, "FRESHREC_MAX_DIRTY_ROWS", 50_000, minimum=1),
            metrics_port=env_int(env, "FRESHREC_METRICS_PORT", 0, minimum=0),
            row_ttl_s=rows.row_ttl_s,
            updates_half=env_bool(env, "FRESHREC_UPDATES_FP16", False),
        )
