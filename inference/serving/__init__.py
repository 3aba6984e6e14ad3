"""Serving a batch of requests: recall channels with deadlines and breakers, the merge, the
ladder, the ranking stage, MMR, the hot-list tier, the experiment's arms and the Redis snapshot."""
