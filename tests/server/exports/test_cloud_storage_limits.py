"""Cloud Storage subscriptions under hostile conditions: a full disk (a real 1 MiB tmpfs) that the writer
survives and resumes after, names and bucket names refused as Cloud Storage refuses them, the memory of
an open file bounded by the subscription's window, and subscriptions of two projects with one ID kept
apart."""

from __future__ import annotations

import logging
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from google.api_core import exceptions
from google.cloud import pubsub_v1

from hedgepub.server import LocalServer
from hedgepub.server._pubsub import cloud_storage
from hedgepub.server._pubsub.cloud_storage import PARTIAL_FOLDER

from .test_cloud_storage import files, publish_all, wait_until

PROJECT = "projects/export-project"
TOPIC = f"{PROJECT}/topics/events"
SUBSCRIPTION = f"{PROJECT}/subscriptions/to-storage"


def partial_files(bucket: Path) -> list[Path]:
    folder = bucket / PARTIAL_FOLDER
    return sorted(folder.iterdir()) if folder.is_dir() else []


def lines(bucket: Path) -> list[bytes]:
    return [line for path in files(bucket) for line in path.read_bytes().splitlines()]


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real file system of 1 MiB (tmpfs), mounted for the test: root only."""
    if os.geteuid() != 0:
        pytest.skip("mounting a 1 MiB tmpfs to fill needs root")
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_full_disk_drops_the_file_and_the_export_resumes_once_there_is_room(
    tmpfs: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="hedgepub.server")
    ballast = tmpfs / "ballast"
    with LocalServer(in_memory=True, buckets_dir=tmpfs) as server:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server.address)
        publisher = pubsub_v1.PublisherClient()
        subscriber = pubsub_v1.SubscriberClient()
        publisher.create_topic(name=TOPIC)
        subscriber.create_subscription(
            request={
                "name": SUBSCRIPTION,
                "topic": TOPIC,
                "cloud_storage_config": {"bucket": "full", "max_bytes": 150_000, "text_config": {}},
            }
        )
        # Leave less room than one file needs: 3 messages of 50 KB fill one.
        ballast.write_bytes(b"\0" * (1024 * 1024 - 80 * 1024))
        payloads = [bytes([65 + n]) * 50_000 for n in range(6)]
        publish_all(publisher, payloads)
        writer = server._core().exports.writers[SUBSCRIPTION]
        assert wait_until(lambda: writer.failures >= 3), writer
        # Each failed attempt dropped its file: nothing half written stays, in the bucket or aside.
        assert files(tmpfs / "full") == []
        assert wait_until(lambda: partial_files(tmpfs / "full") == [])
        ballast.unlink()  # room again
        assert wait_until(lambda: writer.written == 6), writer
        # Every message once, in two whole files, and the writer goes on with what comes next.
        assert sorted(lines(tmpfs / "full")) == [payload for payload in payloads]
        publish_all(publisher, [b"z" * 50_000] * 3)
        assert wait_until(lambda: writer.written == 9), writer
        assert len(files(tmpfs / "full")) == 3 and partial_files(tmpfs / "full") == []
        subscriber.close()
    failed = [record for record in caplog.records if "failed:" in record.getMessage()]
    # The first failure is logged (with the disk's answer), the rest of the run counted, the recovery said.
    assert len(failed) == 1 and "No space left on device" in failed[0].getMessage()
    assert failed[0].exc_info is None
    assert any("resumed after" in record.getMessage() for record in caplog.records)


@pytest.fixture
def buckets(tmp_path: Path) -> Path:
    return tmp_path / "buckets"


@pytest.fixture
def server(buckets: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalServer]:
    with LocalServer(in_memory=True, buckets_dir=buckets, window=10) as local:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", local.address)
        yield local


@pytest.mark.parametrize(
    ("bucket", "reason"),
    [
        ("goog-bucket", "cannot begin with 'goog'"),
        ("my-google-bucket", "'google'"),
        ("my-g00gle-bucket", "'google'"),
        ("192.168.5.4", "IP address"),
        ("a" * 64, "3 to 63"),
        ("x." + "a" * 64, "each dot-separated part 63 at most"),
        (".".join(["a" * 55] * 4), "up to 222"),
        ("a..b", "3 to 63"),
        ("Upper", "lowercase"),
        ("-dash", "starting and ending with a letter or digit"),
    ],
)
def test_bucket_names_cloud_storage_refuses_are_refused(
    server: LocalServer,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
    bucket: str,
    reason: str,
) -> None:
    publisher.create_topic(name=TOPIC)
    with pytest.raises(exceptions.InvalidArgument, match=re.escape(reason)):
        subscriber.create_subscription(
            request={"name": SUBSCRIPTION, "topic": TOPIC, "cloud_storage_config": {"bucket": bucket}}
        )


def test_bucket_names_cloud_storage_takes_are_taken(
    server: LocalServer, publisher: pubsub_v1.PublisherClient, subscriber: pubsub_v1.SubscriberClient
) -> None:
    publisher.create_topic(name=TOPIC)
    for number, bucket in enumerate(["abc", "my_bucket-1", "example.com", ".".join(["a" * 63] * 3), "1.2.3"]):
        subscriber.create_subscription(
            request={
                "name": f"{SUBSCRIPTION}-{number}",
                "topic": TOPIC,
                "cloud_storage_config": {"bucket": bucket},
            }
        )


@pytest.mark.parametrize(
    ("storage", "reason"),
    [
        ({"filename_prefix": "p/" * 400, "filename_suffix": "s" * 200}, "over Cloud Storage's 1024 bytes"),
        ({"filename_prefix": "é/" * 330}, "1043 bytes"),  # bytes of UTF-8 (990 here), not characters
        ({"filename_datetime_format": "YYYY/" * 200}, "over Cloud Storage's 1024 bytes"),
        ({"filename_prefix": "a" * 230}, "over the 255 bytes a file system allows"),
        ({"filename_prefix": "logs/", "filename_suffix": "x" * 210}, "over the 255 bytes"),
        ({"filename_prefix": ".well-known/acme-challenge/x"}, "cannot begin with .well-known/acme-"),
    ],
)
def test_file_names_over_the_limits_are_refused_at_create_and_update(
    server: LocalServer,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
    storage: dict[str, Any],
    reason: str,
) -> None:
    publisher.create_topic(name=TOPIC)
    with pytest.raises(exceptions.InvalidArgument, match=re.escape(reason)):
        subscriber.create_subscription(
            request={
                "name": SUBSCRIPTION,
                "topic": TOPIC,
                "cloud_storage_config": {"bucket": "b1b", **storage},
            }
        )
    subscriber.create_subscription(
        request={"name": SUBSCRIPTION, "topic": TOPIC, "cloud_storage_config": {"bucket": "b1b"}}
    )
    with pytest.raises(exceptions.InvalidArgument, match=re.escape(reason)):
        subscriber.update_subscription(
            request={
                "subscription": {
                    "name": SUBSCRIPTION,
                    "cloud_storage_config": {"bucket": "b1b", **storage},
                },
                "update_mask": {"paths": ["cloud_storage_config"]},
            }
        )


def _shorten_files(server: LocalServer, subscription: str) -> None:
    """Close files after 1 s (the service allows 1 minute at least: the test shortens what it stored).
    A writer already waiting for a file's end wakes at its next message."""
    server._core().registry.subscriptions[subscription].config.cloud_storage_config.max_duration.seconds = 1


def test_the_longest_names_allowed_are_written(
    server: LocalServer,
    buckets: Path,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
) -> None:
    publisher.create_topic(name=TOPIC)
    longest_id = f"{PROJECT}/subscriptions/s{'x' * 254}"  # a subscription ID of 255 characters
    prefix = ("p" * 200 + "/") * 4  # 804 bytes of folders
    suffix = "s" * (1024 - len(prefix) - len("YYYY-MM-DDThh:mm:ssZ") - 33)  # a file name of 220 bytes
    subscriber.create_subscription(
        request={
            "name": longest_id,
            "topic": TOPIC,
            "cloud_storage_config": {"bucket": "long", "filename_prefix": prefix, "filename_suffix": suffix},
        }
    )
    _shorten_files(server, longest_id)
    publish_all(publisher, [b"one", b"two"])
    assert wait_until(lambda: len(files(buckets / "long")) == 1)
    (path,) = files(buckets / "long")
    name = path.relative_to(buckets / "long").as_posix()
    assert len(name.encode()) == 1024 and name.startswith(prefix) and name.endswith(suffix)
    assert sorted(path.read_bytes().splitlines()) == [b"one", b"two"]


def test_an_open_file_holds_its_messages_on_disk_not_in_memory(
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
            "cloud_storage_config": {"bucket": "big", "max_bytes": 10 * 1024**3, "text_config": {}},
        }
    )
    size = 200_000
    payloads = [bytes([65 + n % 26]) * size for n in range(60)]  # 12 MB, in one open file
    publish_all(publisher, payloads)
    state = server._core().registry.subscriptions[SUBSCRIPTION]

    def on_disk() -> int:
        return sum(path.stat().st_size for path in partial_files(buckets / "big"))

    assert wait_until(lambda: on_disk() >= 60 * (size + 1)), on_disk()
    # What the subscription holds in memory: its window of 10 ready messages and the leases of what it is
    # writing, not the 60 messages of the open file.
    held = state.held_bytes + sum(lease.pending.size for lease in state.leases.values())
    assert held <= 10 * (size + 100), held
    assert files(buckets / "big") == []
    _shorten_files(server, SUBSCRIPTION)
    publish_all(publisher, [b"last"])
    assert wait_until(lambda: len(files(buckets / "big")) == 1)
    assert sorted(lines(buckets / "big")) == sorted([*payloads, b"last"])
    assert partial_files(buckets / "big") == []


def test_subscriptions_of_two_projects_with_one_id_keep_their_files_apart(
    server: LocalServer,
    buckets: Path,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
) -> None:
    alpha, beta = "projects/alpha/subscriptions/export", "projects/beta/subscriptions/export"
    storage = {"bucket": "shared", "text_config": {}}
    for project in ("alpha", "beta"):
        publisher.create_topic(name=f"projects/{project}/topics/events")
    subscriber.create_subscription(
        request={"name": alpha, "topic": "projects/alpha/topics/events", "cloud_storage_config": storage}
    )
    publisher.publish("projects/alpha/topics/events", b"alpha's").result(30)
    assert wait_until(lambda: len(partial_files(buckets / "shared")) == 1)
    (alpha_open,) = partial_files(buckets / "shared")
    # Creating beta, whose writer clears what a killed server left of its own files, leaves alpha's alone.
    subscriber.create_subscription(
        request={"name": beta, "topic": "projects/beta/topics/events", "cloud_storage_config": storage}
    )
    publisher.publish("projects/beta/topics/events", b"beta's").result(30)
    assert wait_until(lambda: len(partial_files(buckets / "shared")) == 2)
    assert alpha_open.exists()
    for project, subscription in (("alpha", alpha), ("beta", beta)):
        _shorten_files(server, subscription)
        publisher.publish(f"projects/{project}/topics/events", b"more").result(30)
    assert wait_until(lambda: len(files(buckets / "shared")) == 2)
    written = sorted(sorted(path.read_bytes().splitlines()) for path in files(buckets / "shared"))
    assert written == [[b"alpha's", b"more"], [b"beta's", b"more"]]


def test_a_file_closes_at_max_file_messages_whatever_max_messages_says(
    server: LocalServer,
    buckets: Path,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cloud_storage, "MAX_FILE_MESSAGES", 5)  # 1,000,000: too many to publish here
    publisher.create_topic(name=TOPIC)
    subscriber.create_subscription(
        request={
            "name": SUBSCRIPTION,
            "topic": TOPIC,
            "cloud_storage_config": {"bucket": "many", "max_messages": 1_000_000_000, "text_config": {}},
        }
    )
    publish_all(publisher, [b"m%d" % number for number in range(10)])
    assert wait_until(lambda: len(files(buckets / "many")) == 2)
    assert [len(path.read_bytes().splitlines()) for path in files(buckets / "many")] == [5, 5]
    assert sorted(lines(buckets / "many")) == sorted(b"m%d" % number for number in range(10))
