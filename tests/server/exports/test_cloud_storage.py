"""Cloud Storage subscriptions written to a local directory, with the official client: text and Avro files
(read back with fastavro), rollover by max_messages, max_bytes and max_duration, file names, validation of
the configuration (INVALID_ARGUMENT first), BigQuery and Bigtable refused, and a SIGKILL in the middle of
writing losing no acknowledged message."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fastavro
import pytest
from google.api_core import exceptions
from google.cloud import pubsub_v1

from hedgepub.server import LocalServer

from ..._cli import CLI, served_address

PROJECT = "projects/export-project"
TOPIC = f"{PROJECT}/topics/events"
SUBSCRIPTION = f"{PROJECT}/subscriptions/to-storage"
#: SIGKILL rounds in the durability test (a longer run: HEDGEPUB_EXPORT_KILLS=20).
KILLS = int(os.environ.get("HEDGEPUB_EXPORT_KILLS", "3"))


@pytest.fixture
def buckets(tmp_path: Path) -> Path:
    return tmp_path / "buckets"


@pytest.fixture
def server(buckets: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalServer]:
    with LocalServer(in_memory=True, buckets_dir=buckets) as local:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", local.address)
        yield local


def files(folder: Path) -> list[Path]:
    """The finished files under ``folder`` (not the partial ones), sorted by name."""
    if not folder.exists():
        return []
    return sorted(
        path for path in folder.rglob("*") if path.is_file() and ".hedgepub-partial" not in path.parts
    )


def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def publish_all(publisher: pubsub_v1.PublisherClient, payloads: list[bytes], **attributes: str) -> list[str]:
    futures = [publisher.publish(TOPIC, payload, **attributes) for payload in payloads]
    return [future.result(30) for future in futures]


def test_text_files_roll_over_by_max_messages_with_their_names(
    server: LocalServer,
    buckets: Path,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
) -> None:
    publisher.create_topic(name=TOPIC)
    created = subscriber.create_subscription(
        request={
            "name": SUBSCRIPTION,
            "topic": TOPIC,
            "cloud_storage_config": {
                "bucket": "my-bucket",
                "filename_prefix": "logs/day-",
                "filename_suffix": ".txt",
                "filename_datetime_format": "YYYY-MM-DD/hh_mm_ss",
                "max_messages": 1000,
                "text_config": {},
            },
        }
    )
    assert created.cloud_storage_config.state == pubsub_v1.types.CloudStorageConfig.State.ACTIVE
    assert created.cloud_storage_config.max_duration.seconds == 300  # the default, filled in
    publish_all(publisher, [f"line {n}".encode() for n in range(2500)])
    assert wait_until(lambda: len(files(buckets / "my-bucket")) == 2)
    written = files(buckets / "my-bucket")
    for path in written:
        name = path.relative_to(buckets / "my-bucket").as_posix()
        assert re.fullmatch(r"logs/day-\d{4}-\d\d-\d\d/\d\d_\d\d_\d\d_[0-9a-f]{32}\.txt", name), name
    lines = [line for path in written for line in path.read_bytes().splitlines()]
    assert len(lines) == 2000 and len(set(lines)) == 2000
    # Pull is not how a Cloud Storage subscription delivers.
    with pytest.raises(exceptions.FailedPrecondition, match="Cloud Storage"):
        subscriber.pull(subscription=SUBSCRIPTION, max_messages=1, timeout=5)


def test_avro_files_with_metadata_roll_over_by_max_bytes(
    server: LocalServer,
    buckets: Path,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
) -> None:
    publisher.create_topic(name=TOPIC)
    subscriber.create_subscription(
        request={
            "name": SUBSCRIPTION,
            "topic": TOPIC,
            "cloud_storage_config": {
                "bucket": "avro-bucket",
                "filename_suffix": ".avro",
                "max_bytes": 1000,
                "avro_config": {"write_metadata": True},
            },
        }
    )
    ids = publish_all(publisher, [bytes([65 + n % 26]) * 100 for n in range(30)], source="test")
    assert wait_until(lambda: len(files(buckets / "avro-bucket")) == 3)
    records: list[dict[str, Any]] = []
    for path in files(buckets / "avro-bucket"):
        with path.open("rb") as stream:
            file_records = list(fastavro.reader(stream))
        assert len(file_records) == 10  # 10 messages of 100 bytes reach max_bytes
        records.extend(file_records)
    assert sorted(record["message_id"] for record in records) == sorted(ids)
    record = records[0]
    assert record["subscription_name"] == SUBSCRIPTION
    assert record["attributes"] == {"source": "test"}
    assert record["publish_time"].year >= 2024  # a timestamp-micros, read back as a datetime
    assert len(record["data"]) == 100


@pytest.mark.quickjs
def test_a_file_is_closed_after_max_duration_and_transforms_apply(
    server: LocalServer,
    buckets: Path,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
) -> None:
    publisher.create_topic(name=TOPIC)
    upper = "function upper(message, metadata) { message.data = message.data.toUpperCase(); return message; }"
    subscriber.create_subscription(
        request={
            "name": SUBSCRIPTION,
            "topic": TOPIC,
            "cloud_storage_config": {"bucket": "slow", "max_duration": {"seconds": 60}, "text_config": {}},
            "message_transforms": [{"javascript_udf": {"code": upper, "function_name": "upper"}}],
        }
    )
    # The service allows 1 minute at least; the test shortens the stored duration to a second.
    server._core().registry.subscriptions[SUBSCRIPTION].config.cloud_storage_config.max_duration.seconds = 1
    publish_all(publisher, [b"first", b"second"])
    assert wait_until(lambda: len(files(buckets / "slow")) == 1, timeout=20)
    (path,) = files(buckets / "slow")
    assert sorted(path.read_bytes().splitlines()) == [b"FIRST", b"SECOND"]


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"bucket": "gs://b", "text_config": {}}, "without a prefix such as gs://"),
        ({"bucket": "", "text_config": {}}, "bucket is required"),
        ({"bucket": "b1b", "max_duration": {"seconds": 660}}, "between 1 minute and 10 minutes"),
        ({"bucket": "b1b", "max_duration": {"seconds": 30}}, "between 1 minute and 10 minutes"),
        ({"bucket": "b1b", "max_bytes": 10}, "max_bytes"),
        ({"bucket": "b1b", "max_messages": 999}, "max_messages"),
        ({"bucket": "b1b", "filename_suffix": "x/"}, "must not end in '/'"),
        ({"bucket": "b1b", "filename_prefix": "../up/"}, "'..'"),
        ({"bucket": "b1b", "filename_datetime_format": "YYYY%m"}, "filename_datetime_format"),
        ({"bucket": "b1b", "filename_datetime_format": "../YYYY"}, "'..'"),
        ({"bucket": "b1b", "filename_suffix": "/../x"}, "'..'"),
    ],
)
def test_cloud_storage_configs_are_checked(
    server: LocalServer,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
    config: dict[str, Any],
    reason: str,
) -> None:
    publisher.create_topic(name=TOPIC)
    with pytest.raises(exceptions.InvalidArgument, match=re.escape(reason)):
        subscriber.create_subscription(
            request={"name": SUBSCRIPTION, "topic": TOPIC, "cloud_storage_config": config}
        )


def test_bigquery_and_bigtable_are_checked_then_refused(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    publisher.create_topic(name=TOPIC)
    create = lambda **config: subscriber.create_subscription(  # noqa: E731
        request={"name": SUBSCRIPTION, "topic": TOPIC, **config}
    )
    with pytest.raises(exceptions.InvalidArgument, match=r"bigquery_config\.table"):
        create(bigquery_config={"table": "bad table"})
    with pytest.raises(exceptions.InvalidArgument, match="cannot both be true"):
        create(bigquery_config={"table": "p.d.t", "use_topic_schema": True, "use_table_schema": True})
    with pytest.raises(exceptions.MethodNotImplemented, match="BigQuery subscriptions"):
        create(bigquery_config={"table": "my-project.dataset.table"})
    with pytest.raises(exceptions.InvalidArgument, match=r"bigtable_config\.table"):
        create(bigtable_config={"table": "not/a/table"})
    with pytest.raises(exceptions.MethodNotImplemented, match="Bigtable subscriptions"):
        create(bigtable_config={"table": "projects/p/instances/inst-1/tables/t"})
    with pytest.raises(exceptions.InvalidArgument, match="one way"):
        create(
            push_config={"push_endpoint": "https://example.com/push"}, cloud_storage_config={"bucket": "b1b"}
        )


def test_without_a_buckets_dir_cloud_storage_is_refused_after_its_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with LocalServer(in_memory=True) as local:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", local.address)
        publisher = pubsub_v1.PublisherClient()
        subscriber = pubsub_v1.SubscriberClient()
        publisher.create_topic(name=TOPIC)
        create = lambda storage: subscriber.create_subscription(  # noqa: E731
            request={"name": SUBSCRIPTION, "topic": TOPIC, "cloud_storage_config": storage}
        )
        with pytest.raises(exceptions.InvalidArgument):
            create({"bucket": "gs://b"})
        with pytest.raises(exceptions.FailedPrecondition, match="--buckets-dir"):
            create({"bucket": "fine-bucket"})
        subscriber.close()


def _serve(port: int, data: Path, buckets: Path) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [
            *CLI,
            "serve",
            "--port",
            str(port),
            "--data-dir",
            str(data),
            "--buckets-dir",
            str(buckets),
            "--no-rest",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    served_address(process, timeout=30)
    return process


def _message_ids(folder: Path) -> list[str]:
    ids: list[str] = []
    for path in files(folder):
        with path.open("rb") as stream:
            ids.extend(record["message_id"] for record in fastavro.reader(stream))
    return ids


def test_sigkill_while_writing_loses_no_acknowledged_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.name != "posix":
        pytest.skip("the test kills the server with SIGKILL")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", f"127.0.0.1:{port}")
    data, buckets = tmp_path / "data", tmp_path / "buckets"
    folder = buckets / "durable"
    process = _serve(port, data, buckets)
    try:
        publisher = pubsub_v1.PublisherClient()
        subscriber = pubsub_v1.SubscriberClient()
        publisher.create_topic(name=TOPIC)
        subscriber.create_subscription(
            request={
                "name": SUBSCRIPTION,
                "topic": TOPIC,
                "cloud_storage_config": {
                    "bucket": "durable",
                    "max_messages": 1000,
                    "avro_config": {"write_metadata": True},
                },
            }
        )
        subscriber.close()
        total = 1000 * (KILLS + 2)
        # Published (and confirmed) before the first kill, so each message is either acknowledged on the
        # subscription or still in its backlog: nothing is in flight when the server dies.
        published = publish_all(publisher, [os.urandom(50) for _ in range(total)])
        publisher.stop()
        for _ in range(KILLS):
            seen = len(files(folder))
            wait_until(lambda: len(files(folder)) > seen, timeout=30)  # noqa: B023
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
            process = _serve(port, data, buckets)
        # Every message is in a finished file once the writer caught up: one acknowledged before a kill
        # and missing from the files would never be written again.
        assert wait_until(lambda: set(_message_ids(folder)) >= set(published), timeout=60), (
            f"{len(set(published) - set(_message_ids(folder)))} of {total} messages are in no file"
        )
        # A file's messages are acknowledged only after it is renamed: a kill in between writes them again,
        # whole files of 1000 (duplicates, never gaps).
        assert len(_message_ids(folder)) % 1000 == 0
        # The partial files of the killed servers were removed when the writer started again.
        assert wait_until(lambda: not list((folder / ".hedgepub-partial").glob("*")), timeout=10)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
