"""Every Redis key FreshRec writes, in one place. The topic prefix prefixes them too.

>>> RedisKeys("t1.").hot("global")
't1.hot:global'
"""

from __future__ import annotations


class RedisKeys:
    """Key names for one deployment prefix; see docs/streams.md for each key's layout."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix
        p = prefix
        # catalogue, from the items topic: hashes, field = item_id
        self.item_price = f"{p}item:price"
        self.item_category = f"{p}item:category"
        self.item_region = f"{p}item:region"
        self.item_created_ms = f"{p}item:created_ms"
        self.new_items = f"{p}items:new"  # zset, score = created_at_ms
        # counter: bumped by every catalogue write (sets and deletions); workers reload on a move
        self.catalogue_version = f"{p}items:version"
        # serving features of items (global scope), hashes, field = item_id
        self.item_feature = {
            name: f"{p}item:{name}"
            for name in ("impressions", "clicks", "conversions", "ctr", "cvr", "hot")
        }
        self.item_features_as_of = f"{p}item:as_of_ms"  # hash: event time features hold at

    def embeddings(self, table: str) -> str:
        """Hash: field = 8-byte row id, value = float32 row + u64 version + i64 event ms."""
        return f"{self.prefix}emb:{table}"

    def optimizer(self, table: str) -> str:
        """Hash: field = 8-byte row id, value = float32 Adagrad accumulator."""
        return f"{self.prefix}opt:{table}"

    @property
    def ps_applied(self) -> str:
        """Hash: gradients partition -> last applied offset (same transaction as the rows)."""
        return f"{self.prefix}ps:applied"

    @property
    def ps_owner(self) -> str:
        """Hash: gradients partition -> token of the parameter-server instance that owns it
        (written on assignment; every transaction checks it under WATCH)."""
        return f"{self.prefix}ps:owner"

    @property
    def ps_broadcast(self) -> str:
        """Hash: embeddings.updates partition -> last offset produced after a persist."""
        return f"{self.prefix}ps:broadcast"

    def hot(self, scope: str) -> str:
        """Hash: field = by-item partition, value = that partition's HotList JSON."""
        return f"{self.prefix}hot:{scope}"

    def hot_scopes(self) -> str:
        """Set of scopes that have hot lists (global and each region)."""
        return f"{self.prefix}hot:scopes"

    def user_recent(self, user_id: str) -> str:
        """List, newest first, of ``item_id|ts_ms`` for the user's recent clicks."""
        return f"{self.prefix}user:recent:{user_id}"

    def answered(self, request_id: str) -> str:
        """String with a TTL: this request id has been answered (answer-once across workers)."""
        return f"{self.prefix}req:answered:{request_id}"

    def streams_rows(self, partition: int) -> str:
        return f"{self.prefix}streams:p{partition}:rows"

    def streams_meta(self, partition: int) -> str:
        return f"{self.prefix}streams:p{partition}:meta"
