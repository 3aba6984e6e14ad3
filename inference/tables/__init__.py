"""The worker's tables: the embedding cache (items resident, users in an LRU slab, misses from
Redis) and each user's recent clicks."""
