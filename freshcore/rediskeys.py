"""Every Redis key FreshRec writes, in one place. The topic prefix prefixes them too.

What must change together sits in one hash slot of a Redis Cluster: the rows of ``gradients``
partition N, their optimizer state, N's applied offset and owner carry the hash tag ``{gN}``
(a row's partition is the murmur2 of its id, the routing its writers use, so a reader finds a
row's key from its id alone); the streams app's state of ``events.by_item`` partition N carries
``{sN}``. Every other key stands alone. The same layout serves a single server.

>>> RedisKeys("t1.").hot("global")
't1.hot:global'
>>> k = RedisKeys("t1.")
>>> k.embeddings("item", 3), k.optimizer("item", 3), k.ps_applied(3), k.ps_owner(3)
('t1.emb:item:{g3}', 't1.opt:item:{g3}', 't1.ps:applied:{g3}', 't1.ps:owner:{g3}')
>>> k.streams_rows(5), k.streams_meta(5)
('t1.streams:{s5}:rows', 't1.streams:{s5}:meta')
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
        # the number of events.by_item partitions the serving features are laid out by
        self.feature_shards = f"{p}item:shards"

    FEATURES = ("impressions", "clicks", "conversions", "ctr", "cvr", "hot")

    def item_feature(self, name: str, shard: int) -> str:
        """Hash of the items of ``events.by_item`` partition ``shard`` (an item's partition
        is the murmur2 of its id): field = item id, value = the serving feature ``name``.

        >>> RedisKeys("t1.").item_feature("ctr", 2)
        't1.item:ctr:{s2}'
        """
        return f"{self.prefix}item:{name}:{{s{shard}}}"

    def item_features_as_of(self, shard: int) -> str:
        """Hash: item id -> the event time its features are decayed to."""
        return f"{self.prefix}item:as_of_ms:{{s{shard}}}"

    def embeddings(self, table: str, shard: int) -> str:
        """Hash of the rows of ``gradients`` partition ``shard``: field = 8-byte row id,
        value = float32 row + u64 version + i64 event ms."""
        return f"{self.prefix}emb:{table}:{{g{shard}}}"

    def optimizer(self, table: str, shard: int) -> str:
        """Hash: field = 8-byte row id, value = float32 Adagrad accumulator."""
        return f"{self.prefix}opt:{table}:{{g{shard}}}"

    def ps_applied(self, shard: int) -> str:
        """String: the partition's last applied offset (same transaction as its rows)."""
        return f"{self.prefix}ps:applied:{{g{shard}}}"

    def ps_owner(self, shard: int) -> str:
        """String: token of the parameter-server instance that owns the partition (written
        on assignment; every transaction checks it under WATCH)."""
        return f"{self.prefix}ps:owner:{{g{shard}}}"

    @property
    def rows_layout(self) -> str:
        """String: the number of ``gradients`` partitions the rows are laid out by (the
        first writer records it; see ``freshcore.rowstore.row_shards``)."""
        return f"{self.prefix}rows:shards"

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

    @property
    def experiments(self) -> str:
        """Set of the names of the A/B experiments workers have run."""
        return f"{self.prefix}experiments"

    def experiment(self, name: str) -> str:
        """Hash: an experiment's variants (JSON, table order), shares, control, salt and
        allocation table (``inference/serving/experiments.py``)."""
        return f"{self.prefix}exp:{name}"

    def experiment_counts(self, name: str) -> str:
        """Hash: ``{variant}:{requests|impression|click|conversion}`` -> count."""
        return f"{self.prefix}exp:{name}:counts"

    def request_variant(self, request_id: str) -> str:
        """String with a TTL: ``{experiment}/{variant}`` of the reply to this request id."""
        return f"{self.prefix}req:variant:{request_id}"

    def streams_rows(self, partition: int) -> str:
        return f"{self.prefix}streams:{{s{partition}}}:rows"

    def streams_meta(self, partition: int) -> str:
        return f"{self.prefix}streams:{{s{partition}}}:meta"

    def streams_covisit(self, partition: int) -> str:
        """Hash: anchor item id -> its co-visitation counts (the count stage's state)."""
        return f"{self.prefix}streams:{{s{partition}}}:covisit"

    def covisit(self, shard: int) -> str:
        """Hash of the anchors of ``events.by_item`` partition ``shard``: field = item id,
        value = its neighbour list (``freshcore/neighbours.py``), for the covisit channel.

        >>> RedisKeys("t1.").covisit(2)
        't1.covisit:{s2}'
        """
        return f"{self.prefix}covisit:{{s{shard}}}"

    def streams_sequel(self, partition: int) -> str:
        """Hash: anchor item id -> its sequential-rule counts (the count stage's state)."""
        return f"{self.prefix}streams:{{s{partition}}}:sequel"

    def sequel(self, shard: int) -> str:
        """Hash of the anchors of ``events.by_item`` partition ``shard``: field = item id,
        value = its successor list (``freshcore/sequels.py``), for the sequel channel.

        >>> RedisKeys("t1.").sequel(2)
        't1.sequel:{s2}'
        """
        return f"{self.prefix}sequel:{{s{shard}}}"
