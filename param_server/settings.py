"""Settings of ``freshrec param-server``, read from the environment at the edge."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from freshrec.settings import ConnectionSettings, RowSettings, env_float, env_int
from param_server.adagrad import AdagradConfig


@dataclass(frozen=True)
class ParamServerSettings:
    conn: ConnectionSettings
    dim: int = 64
    adagrad: AdagradConfig = field(default_factory=AdagradConfig)
    flush_interval_ms: int = 100
    """How often applied rows are persisted (one Redis transaction) and broadcast."""
    max_dirty_rows: int = 50_000
    """Flush early when this many rows wait."""
    metrics_port: int = 0
    row_ttl_s: int = 30 * 86_400
    """Rows not updated for this long leave the server's memory, and Redis drops them (hash
    field expiry, Redis 7.4+ / Valkey 9+); 0 keeps every row forever."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ParamServerSettings:
        rows = RowSettings.from_env(env)
        return cls(
            conn=ConnectionSettings.from_env(env),
            dim=rows.dim,
            adagrad=AdagradConfig(
                lr=env_float(env, "FRESHREC_GLOBAL_LR", 0.05, minimum=0),
                max_norm=rows.max_grad_norm,
                initial_accumulator=env_float(
                    env, "FRESHREC_ADAGRAD_INITIAL_ACCUMULATOR", 0.0, minimum=0
                ),
            ),
            flush_interval_ms=env_int(env, "FRESHREC_FLUSH_INTERVAL_MS", 100, minimum=1),
            max_dirty_rows=env_int(env, "FRESHREC_MAX_DIRTY_ROWS", 50_000, minimum=1),
            metrics_port=env_int(env, "FRESHREC_METRICS_PORT", 0, minimum=0),
            row_ttl_s=rows.row_ttl_s,
        )
