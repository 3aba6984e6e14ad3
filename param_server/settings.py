"""Settings of ``freshrec param-server``, read from the environment at the edge."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from freshcore.declare import Setting, declared, declared_as, read_settings
from freshcore.settings import (
    LEARNING_RATE,
    METRICS_PORT,
    ROW_TTL_S,
    ConnectionSettings,
    RowSettings,
    online_defaults,
)
from param_server.adagrad import AdagradConfig
from schemas.rows import TABLE_USER

GLOBAL_LR = Setting(
    "FRESHREC_GLOBAL_LR",
    LEARNING_RATE,
    "The parameter server's Adagrad step size for item rows (and user rows, unless "
    "`FRESHREC_GLOBAL_USER_LR` says otherwise).",
    kind=float,
    minimum=0,
    shown="the models' manifest, else 0.05",
)
GLOBAL_USER_LR = Setting(
    "FRESHREC_GLOBAL_USER_LR",
    None,
    "The Adagrad step size for user rows.",
    kind=float,
    minimum=0,
    optional=True,
    shown="the models' manifest, else `FRESHREC_GLOBAL_LR`",
)
ADAGRAD_INITIAL_ACCUMULATOR = Setting(
    "FRESHREC_ADAGRAD_INITIAL_ACCUMULATOR",
    AdagradConfig.initial_accumulator,
    "What Adagrad's squared-gradient sums start from (1 keeps a trained row's first steps small).",
    kind=float,
    minimum=0,
    shown="the models' manifest, else 0",
)


@dataclass(frozen=True)
class ParamServerSettings:
    conn: ConnectionSettings = field(default_factory=ConnectionSettings)
    dim: int = RowSettings.dim
    adagrad: AdagradConfig = field(default_factory=AdagradConfig)
    """Item rows' Adagrad; user rows' too unless ``user_adagrad`` is set."""
    user_adagrad: AdagradConfig | None = None
    flush_interval_ms: int = declared(
        "FRESHREC_FLUSH_INTERVAL_MS",
        100,
        "How often the parameter server persists applied rows (one Redis transaction) and "
        "broadcasts them.",
        minimum=1,
    )
    max_dirty_rows: int = declared(
        "FRESHREC_MAX_DIRTY_ROWS",
        50_000,
        "The parameter server flushes early when this many applied rows wait.",
        minimum=1,
    )
    metrics_port: int = declared_as(METRICS_PORT)
    row_ttl_s: int = declared_as(ROW_TTL_S)
    """Rows not updated for this long leave the server's memory, and Redis drops them (hash
    field expiry, Redis 7.4+ / Valkey 9+); 0 keeps every row forever."""
    updates_half: bool = declared(
        "FRESHREC_UPDATES_FP16",
        False,
        "Broadcast rows on `embeddings.updates` as float16: half the bytes (every worker must "
        "read row-batch layout version 3).",
    )

    def adagrad_for(self, table: int) -> AdagradConfig:
        if table == TABLE_USER and self.user_adagrad is not None:
            return self.user_adagrad
        return self.adagrad

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ParamServerSettings:
        rows = RowSettings.from_env(env)
        online = online_defaults(env)
        adagrad = AdagradConfig(
            lr=GLOBAL_LR.read(env, float(online.get("global_lr", LEARNING_RATE))),
            max_norm=rows.max_grad_norm,
            initial_accumulator=ADAGRAD_INITIAL_ACCUMULATOR.read(
                env, float(online.get("adagrad_initial_accumulator", 0.0))
            ),
        )
        user_lr = GLOBAL_USER_LR.read(env, online.get("global_user_lr"))
        return read_settings(
            cls,
            env,
            conn=ConnectionSettings.from_env(env),
            dim=rows.dim,
            adagrad=adagrad,
            user_adagrad=None if user_lr is None else replace(adagrad, lr=float(user_lr)),
            row_ttl_s=rows.row_ttl_s,
        )
