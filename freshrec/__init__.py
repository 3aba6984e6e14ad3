"""FreshRec: recommendations served over Kafka from embeddings that learn online.

The public face, for code that asks for recommendations::

    from freshrec import RecommendClient, SyncRecommendClient, FreshRecError

    async with RecommendClient("127.0.0.1:9092") as client:
        reply = await client.recommend("u42", k=10)

Every error FreshRec raises on purpose derives from ``FreshRecError`` (``retriable`` says
whether the same call may succeed later). The client is imported on first use, so
``import freshrec`` stays light.

This package is the product on top: the public face and the client, the ``freshrec``
command and the embedded stack (``freshrec.app``), the simulator ``freshrec run`` drives
(``freshrec.sim``). It stands on the services (``streams/``, ``inference/``,
``param_server/``), the replay's ``evaluation/``, the kernel they share (``freshcore/``) and
the wire contracts (``schemas/``); none of them imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from schemas.errors import FreshRecError, RetriableError

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
