"""FreshRec: recommendations served over Kafka from embeddings that learn online.

The public face, for code that asks for recommendations::

    from freshrec import RecommendClient, SyncRecommendClient, FreshRecError

    async with RecommendClient("127.0.0.1:9092") as client:
        reply = await client.recommend("u42", k=10)

Every error FreshRec raises on purpose derives from ``FreshRecError`` (``retriable`` says
whether the same call may succeed later). The client is imported on first use, so
``import freshrec.settings`` in a service stays light.

This package also holds what every service shares (the kernel): settings, the Kafka client
profile, the topic catalogue, Redis connections, metrics; ``freshrec.app`` is the command line
and the embedded stack. The services live beside it in ``streams/``, ``inference/`` and
``param_server/``; wire contracts in ``schemas/``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from freshrec.errors import FreshRecError, RetriableError

if TYPE_CHECKING:
    from freshrec.client import (
        ClientStats,
        RecommendClient,
        RecommendError,
        RecommendTimeout,
        SyncRecommendClient,
    )

__version__ = "0.1.0"
__all__ = [
    "ClientStats",
    "FreshRecError",
    "RecommendClient",
    "RecommendError",
    "RecommendTimeout",
    "RetriableError",
    "SyncRecommendClient",
]
_CLIENT = {
    "ClientStats",
    "RecommendClient",
    "RecommendError",
    "RecommendTimeout",
    "SyncRecommendClient",
}


def __getattr__(name: str):
    if name in _CLIENT:
        from freshrec import client

        return getattr(client, name)
    raise AttributeError(f"module 'freshrec' has no attribute {name!r}")
