"""Topic and subscription fields checked as the real service checks them, both ways: what it refuses is
refused (INVALID_ARGUMENT, naming the field), and what it takes is taken, with its defaults filled in."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf import field_mask_pb2
from google.pubsub_v1.types import pubsub as types

from ..._pb import ExpirationPolicy, RetryPolicy, Subscription, Topic, UpdateSubscriptionRequest
from ..conftest import duration

PROJECT = "projects/test-project"
TOPIC = f"{PROJECT}/topics/validated"
SUBSCRIPTION = f"{PROJECT}/subscriptions/validated-sub"
DAY = 24 * 3600

INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def topic(raw: Any) -> Any:
    raw.call("CreateTopic", Topic(name=TOPIC))
    return raw


def subscription(**fields: Any) -> Any:
    return Subscription(name=SUBSCRIPTION, topic=TOPIC, **fields)


# ---------------------------------------------------------------- retention
@pytest.mark.parametrize("seconds", [600, 8 * DAY, 31 * DAY])
def test_subscription_retention_takes_10_minutes_to_31_days(topic: Any, seconds: int) -> None:
    created = topic.call("CreateSubscription", subscription(message_retention_duration=duration(seconds)))
    assert created.message_retention_duration.seconds == seconds


@pytest.mark.parametrize("seconds", [599, 31 * DAY + 1, 0.5])
def test_subscription_retention_out_of_range_is_refused(topic: Any, seconds: float) -> None:
    error = topic.error("CreateSubscription", subscription(message_retention_duration=duration(seconds)))
    assert error.code() == INVALID
    assert "between 10 minutes and 31 days" in error.details()


@pytest.mark.parametrize(
    ("seconds", "accepted"), [(600, True), (31 * DAY, True), (599, False), (32 * DAY, False)]
)
def test_topic_retention_range(raw: Any, seconds: int, accepted: bool) -> None:
    request = Topic(name=TOPIC, message_retention_duration=duration(seconds))
    if accepted:
        assert raw.call("CreateTopic", request).message_retention_duration.seconds == seconds
    else:
        assert raw.error("CreateTopic", request).code() == INVALID


def test_retention_is_checked_on_update_too(topic: Any) -> None:
    topic.call("CreateSubscription", subscription())
    update = UpdateSubscriptionRequest(
        subscription=subscription(message_retention_duration=duration(32 * DAY)),
        update_mask=field_mask_pb2.FieldMask(paths=["message_retention_duration"]),
    )
    assert topic.error("UpdateSubscription", update).code() == INVALID


# ---------------------------------------------------------------- retry policy
def test_a_retry_policy_gets_the_default_backoffs(topic: Any) -> None:
    created = topic.call("CreateSubscription", subscription(retry_policy=RetryPolicy()))
    assert created.retry_policy.minimum_backoff.seconds == 10
    assert created.retry_policy.maximum_backoff.seconds == 600


@pytest.mark.parametrize(("minimum", "maximum"), [(0, 0), (0, 600), (600, 600), (1.5, 2)])
def test_retry_backoffs_of_0_to_600_seconds_are_accepted(topic: Any, minimum: float, maximum: float) -> None:
    policy = RetryPolicy(minimum_backoff=duration(minimum), maximum_backoff=duration(maximum))
    created = topic.call("CreateSubscription", subscription(retry_policy=policy))
    assert created.retry_policy.minimum_backoff == duration(minimum)


@pytest.mark.parametrize(
    ("minimum", "maximum", "words"),
    [
        (601, 601, "minimum_backoff given: 601s"),
        (10, 601, "maximum_backoff given: 601s"),
        (-1, 10, "minimum_backoff given: -1s"),
        (20, 10, "must not be greater than maximum_backoff"),
    ],
)
def test_retry_backoffs_out_of_range_are_refused(topic: Any, minimum: int, maximum: int, words: str) -> None:
    policy = RetryPolicy(minimum_backoff=duration(minimum), maximum_backoff=duration(maximum))
    error = topic.error("CreateSubscription", subscription(retry_policy=policy))
    assert error.code() == INVALID
    assert words in error.details()


def test_a_minimum_backoff_alone_over_the_default_maximum_is_refused(topic: Any) -> None:
    policy = RetryPolicy(minimum_backoff=duration(601))
    assert topic.error("CreateSubscription", subscription(retry_policy=policy)).code() == INVALID


# ---------------------------------------------------------------- expiration policy
def test_no_expiration_policy_means_the_31_day_default(topic: Any) -> None:
    created = topic.call("CreateSubscription", subscription())
    assert created.HasField("expiration_policy")
    assert created.expiration_policy.ttl.seconds == 31 * DAY


def test_an_expiration_policy_without_ttl_means_never(topic: Any) -> None:
    created = topic.call("CreateSubscription", subscription(expiration_policy=ExpirationPolicy()))
    assert created.HasField("expiration_policy")
    assert not created.expiration_policy.HasField("ttl")


@pytest.mark.parametrize(
    ("seconds", "accepted"), [(DAY, True), (365 * DAY, True), (12 * 3600, False), (0, False)]
)
def test_an_expiration_ttl_is_at_least_a_day(topic: Any, seconds: int, accepted: bool) -> None:
    policy = ExpirationPolicy(ttl=duration(seconds))
    if accepted:
        assert (
            topic.call("CreateSubscription", subscription(expiration_policy=policy)).expiration_policy
            == policy
        )
    else:
        error = topic.error("CreateSubscription", subscription(expiration_policy=policy))
        assert error.code() == INVALID
        assert "expiration_policy.ttl" in error.details()


# ---------------------------------------------------------------- labels
GOOD_LABELS = [
    {"team": "a"},
    {"a": ""},
    {"k" * 63: "v" * 63},
    {"é-t_1": "ü-9"},
    {f"k{i}": "" for i in range(64)},
]
BAD_LABELS = [
    {"Team": "a"},
    {"1team": "a"},
    {"": "a"},
    {"k" * 64: "v"},
    {"team": "A"},
    {"team": "v" * 64},
    {"te am": "a"},
    {"team": "a.b"},
    {f"k{i}": "" for i in range(65)},
]


@pytest.mark.parametrize("labels", GOOD_LABELS)
def test_labels_the_real_service_takes(raw: Any, labels: dict[str, str]) -> None:
    assert dict(raw.call("CreateTopic", Topic(name=TOPIC, labels=labels)).labels) == labels
    assert dict(raw.call("CreateSubscription", subscription(labels=labels)).labels) == labels


@pytest.mark.parametrize("labels", BAD_LABELS)
def test_labels_the_real_service_refuses(topic: Any, labels: dict[str, str]) -> None:
    for method, request in (
        ("CreateTopic", Topic(name=f"{PROJECT}/topics/other", labels=labels)),
        ("CreateSubscription", subscription(labels=labels)),
    ):
        error = topic.error(method, request)
        assert error.code() == INVALID, method
        assert "label" in error.details()


# ---------------------------------------------------------------- ingestion settings
Ingestion: Any = types.IngestionDataSourceSettings.pb()


def test_complete_ingestion_settings_are_accepted(raw: Any) -> None:
    settings = Ingestion(
        aws_kinesis=Ingestion.AwsKinesis(
            stream_arn="arn:s", consumer_arn="arn:c", aws_role_arn="arn:r", gcp_service_account="sa@p.iam"
        )
    )
    created = raw.call("CreateTopic", Topic(name=TOPIC, ingestion_data_source_settings=settings))
    assert created.ingestion_data_source_settings.aws_kinesis.stream_arn == "arn:s"
    storage = Ingestion(cloud_storage=Ingestion.CloudStorage(bucket="b", text_format={}))
    raw.call("CreateTopic", Topic(name=f"{TOPIC}-2", ingestion_data_source_settings=storage))


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        (Ingestion(aws_kinesis=Ingestion.AwsKinesis(stream_arn="arn:s")), "aws_kinesis.consumer_arn"),
        (Ingestion(cloud_storage=Ingestion.CloudStorage(text_format={})), "cloud_storage.bucket"),
        (Ingestion(cloud_storage=Ingestion.CloudStorage(bucket="b")), "input format"),
        (Ingestion(aws_msk=Ingestion.AwsMsk(cluster_arn="c", topic="t")), "aws_msk.aws_role_arn"),
        (Ingestion(confluent_cloud=Ingestion.ConfluentCloud()), "confluent_cloud.bootstrap_server"),
        (
            Ingestion(azure_event_hubs=Ingestion.AzureEventHubs(resource_group="g")),
            "azure_event_hubs.namespace",
        ),
    ],
)
def test_incomplete_ingestion_settings_are_refused(raw: Any, settings: Any, words: str) -> None:
    error = raw.error("CreateTopic", Topic(name=TOPIC, ingestion_data_source_settings=settings))
    assert error.code() == INVALID
    assert words in error.details()


# ---------------------------------------------------------------- filters
def test_a_filter_that_does_not_parse_is_refused_saying_where(topic: Any) -> None:
    error = topic.error(
        "CreateSubscription", subscription(filter="attributes:a AND attributes:b OR attributes:c")
    )
    assert error.code() == INVALID
    assert "position 31" in error.details()


def test_a_filter_cannot_be_updated(topic: Any) -> None:
    created = topic.call("CreateSubscription", subscription(filter="attributes:a"))
    assert created.filter == "attributes:a"
    update = UpdateSubscriptionRequest(
        subscription=subscription(filter="attributes:b"),
        update_mask=field_mask_pb2.FieldMask(paths=["filter"]),
    )
    assert topic.error("UpdateSubscription", update).code() == INVALID
