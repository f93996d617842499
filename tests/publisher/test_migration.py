"""Moving from ``google.cloud.pubsub_v1.PublisherClient``: the same code runs against both clients.

The publishing code below is written for the official client (its constructor arguments, its futures) and
run unchanged against LocalServer with the official client and with ``hedgepub.PublisherClient``; the
only difference is the class, plus ``hedging_settings=`` for hedgepub.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import json
import threading
from pathlib import Path
from typing import Any

import google.oauth2.credentials
import pytest
from google.api_core import exceptions as api_exceptions
from google.api_core import retry as api_retry
from google.api_core import timeout as api_timeout
from google.api_core.client_options import ClientOptions
from google.cloud import pubsub_v1

import hedgepub
from hedgepub import HedgingSettings, StatusCode
from hedgepub.server import LocalServer

CLIENTS = {
    "official": (pubsub_v1.PublisherClient, {}),
    "hedgepub": (hedgepub.PublisherClient, {"hedging_settings": HedgingSettings(hedge_delay=0.5)}),
}


def publish_with_official_arguments(
    client_class: Any, address: str, topic: str, *, positional: bool = False, **extra: Any
) -> dict[str, Any]:
    """Code as written for the official client; ``extra`` is the one line a move to hedgepub adds.

    With ``positional``, ``batch_settings`` and ``publisher_options`` are passed by position, as the
    official client's signature allows."""
    batch = pubsub_v1.types.BatchSettings(max_messages=10, max_bytes=100_000, max_latency=0.05)
    options = pubsub_v1.types.PublisherOptions(
        flow_control=pubsub_v1.types.PublishFlowControl(
            message_limit=50,
            limit_exceeded_behavior=pubsub_v1.types.LimitExceededBehavior.BLOCK,
        ),
        retry=api_retry.Retry(
            initial=0.1,
            maximum=2.0,
            multiplier=2.0,
            timeout=30.0,
            predicate=api_retry.if_exception_type(
                api_exceptions.ServiceUnavailable, api_exceptions.DeadlineExceeded
            ),
        ),
        timeout=api_timeout.ConstantTimeout(10.0),
    )
    if positional:
        publisher = client_class(batch, options, client_options={"api_endpoint": address}, **extra)
    else:
        publisher = client_class(
            batch_settings=batch, publisher_options=options, client_options={"api_endpoint": address}, **extra
        )
    callbacks: list[str] = []
    callback_done = threading.Event()

    def on_done(future: Any) -> None:
        callbacks.append(future.result())
        if len(callbacks) == 25:
            callback_done.set()

    futures = []
    for number in range(25):
        future = publisher.publish(topic, f"order {number}".encode(), kind="order", number=str(number))
        future.add_done_callback(on_done)
        futures.append(future)
    message_ids = [future.result(timeout=30) for future in futures]
    assert all(future.done() for future in futures)
    assert all(future.exception() is None for future in futures)
    assert callback_done.wait(10)

    missing = publisher.publish(topic + "-missing", b"nowhere")
    error = missing.exception(timeout=30)
    with pytest.raises(Exception) as raised:
        missing.result(timeout=1)
    publisher.stop()
    return {"ids": message_ids, "callbacks": sorted(callbacks), "error": error, "raised": raised.value}


@pytest.mark.parametrize("positional", [False, True], ids=["by-name", "by-position"])
@pytest.mark.parametrize("name", sorted(CLIENTS))
def test_the_same_publishing_code_runs_against_both_clients(
    name: str, positional: bool, server: LocalServer, topic: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Through client_options only, as code aimed at a real regional endpoint would do it.
    monkeypatch.delenv("PUBSUB_EMULATOR_HOST", raising=False)
    client_class, extra = CLIENTS[name]
    if name == "official":
        # The official client speaks TLS to any api_endpoint; a plain-text local server needs its emulator
        # switch, which also makes it ignore client_options (hedgepub does the same, see below).
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server.address)
    outcome = publish_with_official_arguments(
        client_class, server.address, topic, positional=positional, **extra
    )

    # Batches in flight side by side may be stored in any order (no ordering key): compare by content.
    stored = {message.data: message for message in server.messages(topic)}
    assert sorted(stored) == sorted(f"order {number}".encode() for number in range(25))
    assert all(stored[f"order {n}".encode()].attributes["number"] == str(n) for n in range(25))
    assert outcome["ids"] == [stored[f"order {n}".encode()].message_id for n in range(25)]
    assert outcome["callbacks"] == sorted(outcome["ids"])
    assert outcome["raised"] is outcome["error"]
    # Each client reports NOT_FOUND in its own exception type.
    if name == "official":
        assert isinstance(outcome["error"], api_exceptions.NotFound)
    else:
        assert isinstance(outcome["error"], hedgepub.RpcError)
        assert outcome["error"].code is StatusCode.NOT_FOUND


def positional_parameters(function: Any) -> list[str]:
    """The names ``function`` takes by position, after ``self``."""
    parameters = inspect.signature(function).parameters.values()
    return [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD][1:]


@pytest.mark.parametrize("client_class", [hedgepub.PublisherClient, hedgepub.AsyncPublisherClient])
def test_the_positional_order_is_the_official_clients(client_class: Any) -> None:
    # Read from the installed google-cloud-pubsub: (batch_settings, publisher_options), the rest by name.
    official = positional_parameters(pubsub_v1.PublisherClient.__init__)
    assert official == ["batch_settings", "publisher_options"]
    assert positional_parameters(client_class.__init__) == official


def test_batch_settings_by_position_beside_hedging_by_name(server: LocalServer, topic: str) -> None:
    batch = pubsub_v1.types.BatchSettings(max_messages=3)
    with hedgepub.PublisherClient(batch, hedging_settings=HedgingSettings(hedge_delay=0.5)) as publisher:
        assert publisher._core.batch_settings.max_messages == 3 and publisher._core.hedging is not None
        assert publisher.publish(topic, b"x").result(timeout=30)


def test_hedgepub_0_1_positional_hedging_settings_still_work(server: LocalServer) -> None:
    # hedgepub 0.1.0 took (hedging_settings, batch_settings) first: told apart by their types.
    hedging = HedgingSettings(hedge_delay=0.5)
    with hedgepub.PublisherClient(hedging) as publisher:
        assert publisher._core.hedging == hedging
    with hedgepub.PublisherClient(hedging, hedgepub.BatchSettings(max_messages=7)) as publisher:
        assert (publisher._core.hedging, publisher._core.batch_settings.max_messages) == (hedging, 7)
    with pytest.raises(TypeError, match="given twice"):
        hedgepub.PublisherClient(hedging, hedging_settings=hedging)
    with pytest.raises(TypeError, match="pass hedgepub's own settings by name"):
        hedgepub.PublisherClient(hedgepub.BatchSettings(), hedgepub.RetrySettings())


def test_ordering_keys_through_publisher_options(server: LocalServer, topic: str) -> None:
    options = pubsub_v1.types.PublisherOptions(enable_message_ordering=True)
    with hedgepub.PublisherClient(publisher_options=options) as publisher:
        futures = [publisher.publish(topic, str(n).encode(), ordering_key="k") for n in range(5)]
        concurrent.futures.wait(futures, timeout=30)
    assert [message.data for message in server.messages(topic)] == [str(n).encode() for n in range(5)]


def test_official_arguments_become_hedgepub_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PUBSUB_EMULATOR_HOST", raising=False)
    publisher = hedgepub.PublisherClient(
        pubsub_v1.types.BatchSettings(max_bytes=5000, max_latency=0.2, max_messages=7),
        pubsub_v1.types.PublisherOptions(
            flow_control=pubsub_v1.types.PublishFlowControl(
                message_limit=9, byte_limit=900, limit_exceeded_behavior="error"
            ),
            retry=api_retry.Retry(
                initial=0.3,
                maximum=4.0,
                multiplier=3.0,
                timeout=40.0,
                predicate=api_retry.if_exception_type(api_exceptions.Aborted),
            ),
            timeout=api_timeout.ExponentialTimeout(initial=2.0, maximum=8.0, multiplier=2.0),
        ),
        client_options=ClientOptions(api_endpoint="http://127.0.0.1:1"),
    )
    try:
        core = publisher._core
        assert core.batch_settings == hedgepub.BatchSettings(max_messages=7, max_bytes=5000, max_latency=0.2)
        assert core.flow.settings == hedgepub.FlowControlSettings(
            message_limit=9, byte_limit=900, limit_exceeded_behavior=hedgepub.LimitExceededBehavior.ERROR
        )
        assert core.retry == hedgepub.RetrySettings(
            initial_retry_delay=0.3,
            max_retry_delay=4.0,
            retry_delay_multiplier=3.0,
            total_timeout=40.0,
            initial_rpc_timeout=2.0,
            max_rpc_timeout=8.0,
            rpc_timeout_multiplier=2.0,
            retryable_codes={StatusCode.ABORTED},
        )
        assert core.routes.labels[0] == "127.0.0.1:1"  # the primary endpoint's host:port
    finally:
        publisher.shutdown()


@pytest.mark.parametrize(
    ("api_endpoint", "label"),
    [("localhost", "localhost:443"), ("[::1]", "[::1]:443"), ("127.0.0.1:1", "127.0.0.1:1")],
)
def test_an_api_endpoint_without_a_port_is_tls_on_443_as_the_official_client_takes_it(
    monkeypatch: pytest.MonkeyPatch, api_endpoint: str, label: str
) -> None:
    # hedgepub's own endpoint= asks for the port of a bare host; client_options keep the official meaning.
    monkeypatch.delenv("PUBSUB_EMULATOR_HOST", raising=False)
    credentials = google.oauth2.credentials.Credentials("t")
    publisher = hedgepub.PublisherClient(
        client_options={"api_endpoint": api_endpoint}, credentials=credentials
    )
    try:
        assert publisher._core.routes.labels[0] == label
    finally:
        publisher.shutdown()


def test_retry_none_means_one_try_and_defaults_leave_hedgepub_defaults(server: LocalServer) -> None:
    with hedgepub.PublisherClient(
        publisher_options=pubsub_v1.types.PublisherOptions(retry=None)
    ) as publisher:
        assert publisher._core.retry.retryable_codes == frozenset()
    with hedgepub.PublisherClient(batch_settings=(), publisher_options=()) as publisher:
        assert publisher._core.retry == hedgepub.RetrySettings()
        assert publisher._core.batch_settings == hedgepub.BatchSettings()


@pytest.mark.parametrize(
    ("arguments", "error", "advice"),
    [
        (
            {"publisher_options": pubsub_v1.types.PublisherOptions(retry=api_retry.Retry(predicate=bool))},
            ValueError,
            "retry_settings=hedgepub.RetrySettings(retryable_codes=...)",
        ),
        (
            {
                "publisher_options": pubsub_v1.types.PublisherOptions(
                    retry=api_retry.Retry(on_error=print)  # type: ignore[arg-type]
                )
            },
            ValueError,
            "PublisherClient.stats()",
        ),
        ({"client_options": {"quota_project_id": "p"}}, ValueError, "with_quota_project"),
        ({"client_info": object()}, TypeError, "drop it"),
        ({"transport": "grpc"}, TypeError, "drop it"),
        (
            {
                "flow_control": hedgepub.FlowControlSettings(message_limit=5),
                "publisher_options": pubsub_v1.types.PublisherOptions(
                    flow_control=pubsub_v1.types.PublishFlowControl(message_limit=6)
                ),
            },
            ValueError,
            "give it once",
        ),
    ],
)
def test_arguments_that_cannot_map_are_refused_with_advice(
    arguments: dict[str, Any], error: type[Exception], advice: str, server: LocalServer
) -> None:
    with pytest.raises(error) as raised:
        hedgepub.PublisherClient(**arguments)
    assert advice in str(raised.value)


def test_per_message_retry_and_timeout_are_refused_with_advice(server: LocalServer, topic: str) -> None:
    with hedgepub.PublisherClient() as publisher:
        for name in ("retry", "timeout"):
            with pytest.raises(TypeError, match=r"retry_settings=hedgepub\.RetrySettings"):
                publisher.publish(topic, b"x", **{name: 5.0})


def test_from_service_account_file_as_in_the_official_client(server: LocalServer, tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    key_file = tmp_path / "key.json"
    key_file.write_text(
        json.dumps(
            {
                "type": "service_account",
                "project_id": "test-project",
                "private_key_id": "1",
                "private_key": pem,
                "client_email": "publisher@test-project.iam.gserviceaccount.com",
                "token_uri": "https://oauth2.example.com/token",
            }
        )
    )
    publisher = hedgepub.PublisherClient.from_service_account_json(
        str(key_file), pubsub_v1.types.BatchSettings(max_messages=5)
    )
    try:
        assert (
            publisher._core._credentials.service_account_email
            == "publisher@test-project.iam.gserviceaccount.com"
        )
        assert publisher._core.batch_settings.max_messages == 5
    finally:
        publisher.shutdown()


def test_admin_methods_point_to_the_official_client(server: LocalServer) -> None:
    with hedgepub.PublisherClient() as publisher:
        with pytest.raises(AttributeError, match=r"pubsub_v1\.PublisherClient\(\)\.create_topic"):
            publisher.create_topic(name="projects/p/topics/t")
        with pytest.raises(AttributeError, match="no attribute 'no_such_thing'"):
            publisher.no_such_thing  # noqa: B018
