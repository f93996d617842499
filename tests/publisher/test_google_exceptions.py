"""Code that catches google.api_core.exceptions catches hedgepub's errors as it catches the official
client's: the same `except` clauses run against both clients, publishing to one local server that answers
NOT_FOUND (no topic), PERMISSION_DENIED (IAM enforced, a caller without a role), DEADLINE_EXCEEDED (a
Publish slower than the timeout) and other statuses (injected)."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator

import google.oauth2.credentials
import grpc
import pytest
from google.api_core import exceptions
from google.cloud import pubsub_v1
from google.pubsub_v1.services.publisher import PublisherClient as GapicPublisherClient

import hedgepub
from hedgepub import PublisherClient, PublishTimeoutError, RetrySettings, RpcError, StatusCode
from hedgepub._exceptions import GOOGLE_CLASS_BY_CODE
from hedgepub.admin import AdminClient
from hedgepub.server import IamConfig, LocalServer

PROJECT = "projects/except-project"
TOPIC = f"{PROJECT}/topics/orders"
ADMIN_TOKEN, NOBODY_TOKEN = "t-admin", "t-nobody"

Caught = tuple[str, object, str]


def caught_as(publish: Callable[[], object]) -> Caught:
    """What an application's error handling, written for the official client, makes of ``publish()``."""
    try:
        publish()
    except exceptions.NotFound as error:
        return "NotFound", error.grpc_status_code, error.message
    except exceptions.PermissionDenied as error:
        return "PermissionDenied", error.grpc_status_code, error.message
    except exceptions.DeadlineExceeded as error:
        return "DeadlineExceeded", error.grpc_status_code, "(the client's own words)"
    except exceptions.InvalidArgument as error:
        return "InvalidArgument", error.grpc_status_code, error.message
    except exceptions.ClientError as error:
        return "ClientError", error.grpc_status_code, error.message
    except exceptions.GoogleAPICallError as error:
        return "GoogleAPICallError", error.grpc_status_code, error.message
    return "published", None, ""


@pytest.fixture
def official(server: LocalServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[pubsub_v1.PublisherClient]:
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server.address)
    client = pubsub_v1.PublisherClient()
    yield client
    client.stop()
    client.transport.close()


def _official_publish(client: pubsub_v1.PublisherClient, **options: object) -> Callable[[], object]:
    return lambda: client.publish(TOPIC, b"payload", retry=None, **options).result(timeout=30)


def _hedgepub_publish(**options: object) -> Callable[[], object]:
    def publish() -> object:
        with PublisherClient(**options) as client:  # type: ignore[arg-type]
            return client.publish(TOPIC, b"payload").result(timeout=30)

    return publish


def test_a_missing_topic_is_caught_as_not_found_from_both(server: LocalServer, official) -> None:
    from_official = caught_as(_official_publish(official))
    assert from_official[:2] == ("NotFound", grpc.StatusCode.NOT_FOUND)
    assert caught_as(_hedgepub_publish()) == from_official


@pytest.mark.parametrize(
    ("code", "clause"),
    [
        ("INVALID_ARGUMENT", "InvalidArgument"),
        ("FAILED_PRECONDITION", "ClientError"),
        ("UNIMPLEMENTED", "GoogleAPICallError"),
    ],
)
def test_other_statuses_are_caught_by_the_same_clauses(server: LocalServer, official, code, clause) -> None:
    with AdminClient(server.address) as admin:
        admin.create_topic(TOPIC)
    server.faults.set("Publish", f"error={code}:100%")
    from_official = caught_as(_official_publish(official))
    assert from_official[:2] == (clause, getattr(grpc.StatusCode, code))
    assert caught_as(_hedgepub_publish()) == from_official


def test_a_publish_past_its_timeout_is_deadline_exceeded_from_both(server: LocalServer, official) -> None:
    with AdminClient(server.address) as admin:
        admin.create_topic(TOPIC)
    server.faults.set("Publish", "latency=100%:3s")
    from_official = caught_as(_official_publish(official, timeout=0.5))
    assert from_official[:2] == ("DeadlineExceeded", grpc.StatusCode.DEADLINE_EXCEEDED)
    retry = RetrySettings(initial_rpc_timeout=0.5, total_timeout=0.5)
    assert caught_as(_hedgepub_publish(retry_settings=retry)) == from_official


@pytest.fixture
def iam_server() -> Iterator[LocalServer]:
    tokens = {ADMIN_TOKEN: "user:admin@example.com", NOBODY_TOKEN: "user:nobody@example.com"}
    policy = {"bindings": [{"role": "roles/pubsub.admin", "members": ["user:admin@example.com"]}]}
    with LocalServer(in_memory=True, iam=IamConfig(tokens, policy)) as server:
        with AdminClient(f"http://{server.address}", access_token=ADMIN_TOKEN) as admin:
            admin.create_topic(TOPIC)
        yield server


def test_a_caller_without_the_role_is_caught_as_permission_denied_from_both(
    iam_server: LocalServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", iam_server.address)
    official = pubsub_v1.PublisherClient()
    try:
        # The official client sends a token as call metadata on the emulator's plain-text channel: through
        # its generated Publish method, which takes metadata (the batching publish() does not).
        from_official = caught_as(
            lambda: GapicPublisherClient.publish(
                official,
                request={"topic": TOPIC, "messages": [{"data": b"payload"}]},
                metadata=[("authorization", f"Bearer {NOBODY_TOKEN}")],
                retry=None,
            )
        )
    finally:
        official.stop()
        official.transport.close()
    assert from_official[:2] == ("PermissionDenied", grpc.StatusCode.PERMISSION_DENIED)
    nobody = google.oauth2.credentials.Credentials(NOBODY_TOKEN)
    from_hedgepub = caught_as(_hedgepub_publish(endpoint=f"http://{iam_server.address}", credentials=nobody))
    assert from_hedgepub == from_official


def test_every_status_has_google_s_class_and_hedgepub_s() -> None:
    for code in StatusCode:
        if code is StatusCode.OK:
            continue
        error = RpcError(code, "why")
        google_class = exceptions.exception_class_for_grpc_status(getattr(grpc.StatusCode, code.name))
        assert GOOGLE_CLASS_BY_CODE[code] is google_class
        assert isinstance(error, google_class)
        assert isinstance(error, hedgepub.RpcError) and isinstance(error, hedgepub.PublishError)
        # hedgepub's attributes as before, Google's beside them
        assert (error.code, error.details, str(error)) == (code, "why", f"{code.name}: why")
        assert (error.message, error.grpc_status_code) == ("why", getattr(grpc.StatusCode, code.name))
        copy = pickle.loads(pickle.dumps(error))
        assert (type(copy), copy.code, copy.message) == (type(error), code, "why")


def test_a_publish_timeout_is_deadline_exceeded_and_keeps_its_last_error() -> None:
    last = RpcError(StatusCode.UNAVAILABLE, "connection refused")
    error = PublishTimeoutError("no attempt succeeded within the total timeout of 1 s", last)
    assert isinstance(error, exceptions.DeadlineExceeded) and isinstance(error, hedgepub.PublishError)
    assert error.code is StatusCode.DEADLINE_EXCEEDED
    assert error.grpc_status_code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert str(error) == (
        "no attempt succeeded within the total timeout of 1 s; last error: UNAVAILABLE: connection refused"
    )
    assert error.last_error is last
