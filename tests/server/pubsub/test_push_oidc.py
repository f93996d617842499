"""Push requests carry an OIDC token when ``push_config.oidc_token`` asks for one, and an endpoint verifies
it with google-auth against the keys the server publishes on its REST port, as it would Google's."""

from __future__ import annotations

import json
import stat
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from google.api_core import exceptions
from google.auth import jwt as google_jwt
from google.auth.transport import requests as google_requests
from google.cloud import pubsub_v1
from google.oauth2 import id_token

from hedgepub.server import DataDirError, LocalServer
from hedgepub.server._pubsub.oidc import JWKS_PATH, REFRESH_MARGIN_SECONDS, PushTokenSigner, unique_id
from hedgepub.server._store.datadir import PUSH_KEY_FILE

PROJECT = "projects/oidc-project"
TOPIC = f"{PROJECT}/topics/events"
SUBSCRIPTION = f"{PROJECT}/subscriptions/events-push"
ACCOUNT = "pusher@oidc-project.iam.gserviceaccount.com"
AUDIENCE = "https://hooks.example.com/pubsub"


def _bearer(headers: Mapping[str, str]) -> str:
    (value,) = [value for name, value in headers.items() if name.lower() == "authorization"]
    scheme, _, token = value.partition(" ")
    assert scheme == "Bearer"
    return token


def _verifying(certs_url: str, audience: str) -> Callable[[dict[str, str]], int | None]:
    """An endpoint's check: the bearer token must verify for ``audience`` against ``certs_url``."""
    transport = google_requests.Request()

    def check(headers: dict[str, str]) -> int | None:
        try:
            id_token.verify_token(_bearer(headers), transport, audience=audience, certs_url=certs_url)
        except Exception:  # no token, a bad signature, another audience, expired: all refused
            return 401
        return None

    return check


def _subscribe(subscriber: pubsub_v1.SubscriberClient, push_config: dict[str, Any]) -> None:
    subscriber.create_subscription(request={"name": SUBSCRIPTION, "topic": TOPIC, "push_config": push_config})


def test_each_push_carries_a_token_that_verifies_against_the_servers_keys(
    server: LocalServer,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
    push_endpoint: Any,
) -> None:
    certs_url = server.push_certs_url
    assert certs_url is not None
    push_endpoint.check = _verifying(certs_url, AUDIENCE)
    publisher.create_topic(name=TOPIC)
    _subscribe(
        subscriber,
        {
            "push_endpoint": push_endpoint.url,
            "oidc_token": {"service_account_email": ACCOUNT, "audience": AUDIENCE},
        },
    )
    for i in range(3):
        publisher.publish(TOPIC, f"event {i}".encode()).result(timeout=30)
    assert push_endpoint.wait_for(lambda requests: len(requests) >= 3)
    # The endpoint answered 200 only to a token it verified: every message was acknowledged.
    assert server.wait_until_idle(timeout=10)
    assert {request.status for request in push_endpoint.requests} == {200}

    token = _bearer(push_endpoint.requests[0].headers)
    transport = google_requests.Request()
    claims = id_token.verify_token(token, transport, audience=AUDIENCE, certs_url=certs_url)
    assert claims["aud"] == AUDIENCE
    assert claims["email"] == ACCOUNT
    assert claims["email_verified"] is True
    assert claims["iss"] == "https://accounts.google.com"
    assert claims["sub"] == claims["azp"] == unique_id(ACCOUNT)
    assert len(claims["sub"]) == 21 and claims["sub"].isdigit()
    assert claims["exp"] - claims["iat"] == 3600
    assert abs(claims["iat"] - time.time()) < 60
    header = google_jwt.decode_header(token)
    assert header["alg"] == "RS256" and header["typ"] == "JWT"
    certificates = json.loads(urllib.request.urlopen(certs_url, timeout=10).read())
    assert list(certificates) == [header["kid"]]
    assert certificates[header["kid"]].startswith("-----BEGIN CERTIFICATE-----")

    # The JSON Web Key Set beside it verifies the same token (google-auth reads it with PyJWT).
    jwks_url = f"http://{server.address}{JWKS_PATH}"
    assert id_token.verify_token(token, transport, audience=AUDIENCE, certs_url=jwks_url)["email"] == ACCOUNT
    key_set = json.loads(urllib.request.urlopen(jwks_url, timeout=10).read())
    assert [(key["kid"], key["kty"], key["alg"], key["use"]) for key in key_set["keys"]] == [
        (header["kid"], "RSA", "RS256", "sig")
    ]
    # The audience is checked for real: the same token does not pass for another one.
    with pytest.raises(ValueError, match="audience"):
        id_token.verify_token(token, transport, audience="https://elsewhere.example.com", certs_url=certs_url)


def test_the_audience_defaults_to_the_endpoint_url_and_an_attribute_cannot_replace_the_token(
    server: LocalServer,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
    push_endpoint: Any,
) -> None:
    certs_url = server.push_certs_url
    assert certs_url is not None
    push_endpoint.check = _verifying(certs_url, push_endpoint.url)
    publisher.create_topic(name=TOPIC)
    _subscribe(
        subscriber,
        {
            "push_endpoint": push_endpoint.url,
            "oidc_token": {"service_account_email": ACCOUNT},
            "no_wrapper": {"write_metadata": True},
        },
    )
    publisher.publish(TOPIC, b"raw", authorization="Bearer forged").result(timeout=30)
    assert push_endpoint.wait_for(lambda requests: len(requests) >= 1)
    assert server.wait_until_idle(timeout=10)
    request = push_endpoint.requests[0]
    assert request.status == 200 and request.body == b"raw"
    claims = id_token.verify_token(
        _bearer(request.headers), google_requests.Request(), audience=push_endpoint.url, certs_url=certs_url
    )
    assert claims["aud"] == push_endpoint.url and claims["email"] == ACCOUNT


def test_without_a_service_account_no_token_is_sent(
    server: LocalServer,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
    push_endpoint: Any,
) -> None:
    publisher.create_topic(name=TOPIC)
    _subscribe(subscriber, {"push_endpoint": push_endpoint.url})
    publisher.publish(TOPIC, b"plain").result(timeout=30)
    assert push_endpoint.wait_for(lambda requests: len(requests) >= 1)
    assert not [name for name in push_endpoint.requests[0].headers if name.lower() == "authorization"]


def test_a_malformed_service_account_or_an_audience_alone_is_invalid(
    pubsub_server: LocalServer,
    publisher: pubsub_v1.PublisherClient,
    subscriber: pubsub_v1.SubscriberClient,
) -> None:
    publisher.create_topic(name=TOPIC)
    endpoint = "http://127.0.0.1:9/push"
    for bad in ("not-an-email", "two@@example.com", "pusher@localhost", "white space@example.com"):
        with pytest.raises(exceptions.InvalidArgument, match="service_account_email"):
            _subscribe(subscriber, {"push_endpoint": endpoint, "oidc_token": {"service_account_email": bad}})
    with pytest.raises(exceptions.InvalidArgument, match="audience"):
        _subscribe(subscriber, {"push_endpoint": endpoint, "oidc_token": {"audience": AUDIENCE}})

    _subscribe(subscriber, {})  # pull, to be switched
    with pytest.raises(exceptions.InvalidArgument, match="service_account_email"):
        subscriber.modify_push_config(
            subscription=SUBSCRIPTION,
            push_config={"push_endpoint": endpoint, "oidc_token": {"service_account_email": "nobody"}},
        )
    with pytest.raises(exceptions.InvalidArgument, match="service_account_email"):
        subscriber.update_subscription(
            request={
                "subscription": {
                    "name": SUBSCRIPTION,
                    "push_config": {"push_endpoint": endpoint, "oidc_token": {"service_account_email": "x@"}},
                },
                "update_mask": {"paths": ["push_config"]},
            }
        )
    assert not subscriber.get_subscription(subscription=SUBSCRIPTION).push_config.push_endpoint
    subscriber.modify_push_config(
        subscription=SUBSCRIPTION,
        push_config={"push_endpoint": endpoint, "oidc_token": {"service_account_email": ACCOUNT}},
    )
    stored = subscriber.get_subscription(subscription=SUBSCRIPTION).push_config.oidc_token
    assert (stored.service_account_email, stored.audience) == (ACCOUNT, "")


def test_the_key_is_kept_in_the_data_directory_across_restarts(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    push_endpoint: Any,
) -> None:
    data_dir = tmp_path / "data"
    with LocalServer(data_dir=data_dir) as first:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", first.address)
        publisher, subscriber = pubsub_v1.PublisherClient(), pubsub_v1.SubscriberClient()
        try:
            publisher.create_topic(name=TOPIC)
            _subscribe(
                subscriber,
                {"push_endpoint": push_endpoint.url, "oidc_token": {"service_account_email": ACCOUNT}},
            )
            publisher.publish(TOPIC, b"before the restart").result(timeout=30)
            assert push_endpoint.wait_for(lambda requests: len(requests) >= 1)
            assert first.wait_until_idle(timeout=10)
        finally:
            publisher.stop()
            subscriber.close()
    token = _bearer(push_endpoint.requests[0].headers)
    key_file = data_dir / PUSH_KEY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600

    with LocalServer(data_dir=data_dir) as second:
        certs_url = second.push_certs_url
        assert certs_url is not None
        claims = id_token.verify_token(
            token, google_requests.Request(), audience=push_endpoint.url, certs_url=certs_url
        )
        assert claims["email"] == ACCOUNT

    key_file.write_text("not a key\n")
    with pytest.raises(DataDirError, match="push signing key"):
        LocalServer(data_dir=data_dir).start()


async def test_a_token_is_reused_until_it_nearly_expires_then_signed_anew() -> None:
    calendar = [1_800_000_000.0]
    signer = PushTokenSigner(None, now=lambda: calendar[0])
    first = await signer.token(ACCOUNT, AUDIENCE)
    assert await signer.token(ACCOUNT, AUDIENCE) == first
    assert await signer.token(ACCOUNT, "https://other.example.com") != first
    calendar[0] += 3600 - REFRESH_MARGIN_SECONDS - 1
    assert await signer.token(ACCOUNT, AUDIENCE) == first
    calendar[0] += 2
    renewed = await signer.token(ACCOUNT, AUDIENCE)
    assert renewed != first
    certificates = await signer.certificates()
    claims = google_jwt.decode(renewed, certs=certificates, verify=False)
    assert claims["iat"] == int(calendar[0]) and claims["exp"] == int(calendar[0]) + 3600
