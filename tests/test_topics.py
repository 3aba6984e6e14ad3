"""Topic provisioning: idempotent, complete, and refusing partition mismatches."""

from __future__ import annotations

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from freshrec.kafka import admin_config
from freshrec.topics import (
    CATALOGUE,
    TopicMismatchError,
    TopicNames,
    catalogue_with,
    ensure_topics,
    partitions_from_env,
)


def test_create_is_idempotent_and_creates_the_whole_catalogue(services, prefix):
    admin = AdminClient(admin_config(services.conn(prefix)))
    first = ensure_topics(admin, prefix)
    assert sorted(first.created) == sorted(prefix + s.name for s in CATALOGUE)
    second = ensure_topics(admin, prefix)
    assert second.created == ()
    assert len(second.existing) == len(CATALOGUE)
    topics = admin.list_topics(timeout=10).topics
    for spec in CATALOGUE:
        assert len(topics[prefix + spec.name].partitions) == spec.partitions


def test_a_partition_mismatch_is_refused_and_nothing_is_created(services, prefix):
    admin = AdminClient(admin_config(services.conn(prefix)))
    names = TopicNames(prefix)
    admin.create_topics([NewTopic(names.events, num_partitions=3)])[names.events].result()
    with pytest.raises(TopicMismatchError, match="events has 3 partitions, the catalogue says 8"):
        ensure_topics(admin, prefix)
    assert names.recommend_requests not in admin.list_topics(timeout=10).topics


def test_co_partitioned_topics_cannot_be_overridden_apart():
    with pytest.raises(ValueError, match="same partition count"):
        catalogue_with({"events": 4})
    specs = {
        s.name: s.partitions
        for s in catalogue_with(partitions_from_env({"FRESHREC_PARTITIONS": "2"}))
    }
    assert specs["events"] == specs["recommend.requests"] == 2
