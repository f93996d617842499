"""The road to the real endpoint: TLS, google-auth credentials whose token expires, IAM enforcement.

A throwaway CA signs a certificate for 127.0.0.1; the local server serves TLS with it and enforces IAM. The
publisher trusts only that CA and authenticates with real ``google.oauth2.credentials.Credentials`` whose
refresh handler issues the next token of a list that is the server's IAM tokens file. Tokens live about a
second, so they expire several times while a hedging publisher works against a server that answers some
calls slowly; a wrapping authorizer records the token every call carried and refuses it once expired.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import http.client
import itertools
import json
import os
import shutil
import signal
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import google.api_core.exceptions
import google.auth._helpers
import google.auth.exceptions
import google.oauth2.credentials
import grpc
import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from google.cloud import pubsub_v1
from google.pubsub_v1.services.publisher.transports import PublisherGrpcTransport
from google.pubsub_v1.services.subscriber.transports import SubscriberGrpcTransport
from google.pubsub_v1.types import pubsub

from hedgepub import (
    BatchSettings,
    HedgingSettings,
    PublisherClient,
    PublishError,
    RetrySettings,
    RpcError,
    StatusCode,
)
from hedgepub._wire import CLIENT_TELEMETRY_KEY, decode_client_telemetry
from hedgepub.cli import main
from hedgepub.server import IamConfig, IamEnforcer, LocalServer, ServiceError

from .._cli import CLI
from .._tls import Certificates

PROJECT = "tls-project"
TOPIC = f"projects/{PROJECT}/topics/orders"
PUBLISHER = "serviceAccount:publisher@tls-project.iam.gserviceaccount.com"
ADMIN_BINDING = {"role": "roles/pubsub.admin", "members": ["user:admin@example.com"]}
ADMIN_TOKEN = "t-admin"
#: How long an issued token is accepted by the server.
TOKEN_LIFETIME = datetime.timedelta(seconds=1.0)
#: An attempt sent just before its token expires reaches the server a little later.
IN_FLIGHT_GRACE = datetime.timedelta(seconds=0.2)


@dataclass
class TokenIssuer:
    """Hands out the tokens of the server's tokens file in order, each valid for ``TOKEN_LIFETIME``."""

    tokens: list[str]
    issued_at: dict[str, datetime.datetime] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def refresh_handler(
        self, request: Any, scopes: Sequence[str] | None = None
    ) -> tuple[str, datetime.datetime]:
        """google-auth's ``refresh_handler``: the next token and its expiry (naive UTC, as google-auth wants).

        google-auth refreshes a token ``REFRESH_THRESHOLD`` (3 min 45 s) before the expiry it is told, so
        the expiry told is that much later than the server's: the client then refreshes exactly when the
        server stops accepting the token, and the test fits in seconds instead of minutes.
        """
        with self._lock:
            if not self.tokens:
                raise google.auth.exceptions.RefreshError("the test's token list is used up")
            token = self.tokens.pop(0)
            now = google.auth._helpers.utcnow()
            self.issued_at[token] = now
        return token, now + TOKEN_LIFETIME + google.auth._helpers.REFRESH_THRESHOLD

    def accepts(self, token: str) -> bool:
        """Whether the server accepts ``token`` now: issued, and not expired (with the in-flight grace)."""
        issued = self.issued_at.get(token)
        return (
            issued is not None and google.auth._helpers.utcnow() < issued + TOKEN_LIFETIME + IN_FLIGHT_GRACE
        )


@dataclass
class Call:
    """One Publish the server received: its token, attempt number and whether the token was accepted."""

    token: str
    attempt: int
    batch_id: str
    fresh: bool


class ExpiringTokenAuthorizer:
    """The server's IAM enforcement (tokens file and policy) plus token expiry, recording every Publish.

    Every fourth Publish is answered 300 ms late, after its token was checked, so that the publisher
    hedges and the token of every attempt is seen on arrival, even one cancelled later as a loser.
    """

    def __init__(self, enforcer: IamEnforcer, issuer: TokenIssuer) -> None:
        self.enforcer = enforcer
        self.issuer = issuer
        self.publishes: list[Call] = []
        self._slow = itertools.cycle([False, False, False, True])

    async def check(self, metadata: Any, permission: str, resource: str) -> None:
        values = {key.lower(): value for key, value in metadata}
        token = str(values.get("authorization", "")).partition(" ")[2]
        fresh = token == ADMIN_TOKEN or self.issuer.accepts(token)
        if permission == "pubsub.topics.publish":
            header = values.get(CLIENT_TELEMETRY_KEY)
            attempt = decode_client_telemetry(header)[0] if header else -1
            self.publishes.append(Call(token, attempt, str(values.get("hedgepub-batch-id", "")), fresh))
        if not fresh:
            raise ServiceError(StatusCode.UNAUTHENTICATED, "Request had invalid authentication credentials.")
        await self.enforcer.check(metadata, permission, resource)
        if permission == "pubsub.topics.publish" and next(self._slow):
            await asyncio.sleep(0.3)

    async def granted(self, metadata: Any, resource: str, permissions: Sequence[str]) -> list[str]:
        return await self.enforcer.granted(metadata, resource, permissions)


@pytest.fixture
def tls_server(
    certificates: Certificates, tmp_path: Path
) -> Iterator[tuple[LocalServer, ExpiringTokenAuthorizer]]:
    tokens = [f"t-publisher-{number}" for number in range(40)]
    tokens_file = tmp_path / "tokens.json"
    tokens_file.write_text(
        json.dumps({ADMIN_TOKEN: "user:admin@example.com", **dict.fromkeys(tokens, PUBLISHER)})
    )
    policy_file = tmp_path / "policy.json"
    policy_file.write_text(
        json.dumps(
            {
                "bindings": [
                    {"role": "roles/pubsub.admin", "members": ["user:admin@example.com"]},
                    {"role": "roles/pubsub.publisher", "members": [PUBLISHER]},
                ]
            }
        )
    )
    authorizer = ExpiringTokenAuthorizer(
        IamEnforcer(IamConfig.from_files(tokens_file, policy_file)), TokenIssuer(tokens)
    )
    with LocalServer(
        in_memory=True,
        authorizer=authorizer,
        tls_cert=certificates.cert,
        tls_key=certificates.key,
    ) as server:
        _create_topic(server.address, certificates.ca.read_bytes(), ADMIN_TOKEN)
        yield server, authorizer


def test_every_attempt_and_hedge_carries_a_fresh_token_over_tls(
    tls_server: tuple[LocalServer, ExpiringTokenAuthorizer], certificates: Certificates
) -> None:
    server, authorizer = tls_server
    assert server.tls
    credentials = google.oauth2.credentials.Credentials(
        token=None, refresh_handler=authorizer.issuer.refresh_handler
    )
    publisher = PublisherClient(
        hedging_settings=HedgingSettings(hedge_delay=0.1, max_tokens=20, refill_ratio=0.2),
        batch_settings=BatchSettings(max_messages=1),
        endpoint=f"https://{server.address}",
        credentials=credentials,
        root_certificates=certificates.ca.read_bytes(),
    )
    futures = []
    started = time.monotonic()
    with publisher:
        while time.monotonic() - started < 3.5:  # three and a half token lifetimes
            futures.append(publisher.publish(TOPIC, b"order %d" % len(futures)))
            time.sleep(0.02)
        ids = [future.result(timeout=30) for future in futures]
    stats = publisher.stats()

    assert len(set(ids)) == len(futures)
    calls = authorizer.publishes
    assert calls and all(call.fresh for call in calls), [call for call in calls if not call.fresh]
    tokens_used = {call.token for call in calls}
    assert len(tokens_used) >= 3, tokens_used  # refreshed while publishing
    hedges = [call for call in calls if call.attempt >= 1]
    assert len(calls) <= stats.attempts_sent and len(calls) >= len(futures)
    assert stats.hedges_sent >= 3 and len(hedges) >= 3
    # Hedges went out under more than one token: refreshed tokens reach hedges too, not only originals.
    assert len({call.token for call in hedges}) >= 2, [(call.token, call.batch_id) for call in hedges]
    stored = server.messages(TOPIC)
    assert {message.data for message in stored} >= {b"order %d" % n for n in range(len(futures))}


def test_plain_text_cannot_reach_the_tls_port(
    tls_server: tuple[LocalServer, ExpiringTokenAuthorizer],
) -> None:
    server, _authorizer = tls_server
    credentials = google.oauth2.credentials.Credentials(token=ADMIN_TOKEN)
    retry = RetrySettings(initial_rpc_timeout=0.5, total_timeout=1.5)
    with PublisherClient(
        endpoint=f"http://{server.address}", credentials=credentials, retry_settings=retry
    ) as publisher:
        error = publisher.publish(TOPIC, b"in the clear").exception(timeout=30)
    assert isinstance(error, PublishError)
    assert server.messages(TOPIC) == []


def test_an_expired_token_that_cannot_be_refreshed_fails_at_once_with_a_clear_error(
    tls_server: tuple[LocalServer, ExpiringTokenAuthorizer], certificates: Certificates
) -> None:
    server, authorizer = tls_server
    expired = google.auth._helpers.utcnow() - datetime.timedelta(minutes=1)  # naive UTC, as google-auth wants
    # An access token alone, no refresh token or handler: google-auth cannot get a new one.
    credentials = google.oauth2.credentials.Credentials(token="t-publisher-0", expiry=expired)
    with PublisherClient(
        hedging_settings=HedgingSettings(hedge_delay=0.1),
        endpoint=f"https://{server.address}",
        credentials=credentials,
        root_certificates=certificates.ca.read_bytes(),
    ) as publisher:
        error = publisher.publish(TOPIC, b"never sent").exception(timeout=30)
        stats = publisher.stats()
    assert isinstance(error, RpcError)
    assert error.code is StatusCode.UNAUTHENTICATED
    assert "expired and could not be refreshed" in str(error)
    assert "refresh" in str(error.__cause__).lower()
    assert stats.attempts_sent == 1 and stats.messages_failed == 1  # not retried until the total timeout
    assert authorizer.publishes == []  # the request never left with a stale token


def _create_topic(address: str, root_certificates: bytes, token: str) -> None:
    credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
    with grpc.secure_channel(address, credentials) as channel:
        channel.unary_unary(
            "/google.pubsub.v1.Publisher/CreateTopic",
            request_serializer=pubsub.Topic.pb().SerializeToString,
            response_deserializer=pubsub.Topic.pb().FromString,
        )(pubsub.Topic.pb()(name=TOPIC), metadata=[("authorization", f"Bearer {token}")], timeout=10)


@pytest.mark.skipif(os.name != "posix", reason="stops the server with SIGTERM")
def test_hedgepub_serve_with_tls_cert_and_key(certificates: Certificates) -> None:
    command = [*CLI, "serve", "--in-memory"]
    command += ["--port", "0", "--tls-cert", str(certificates.cert), "--tls-key", str(certificates.key)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert process.stdout is not None
        line = process.stdout.readline().decode().strip()  # printed once the port is open
        assert line.startswith("endpoint=https://127.0.0.1:"), line
        endpoint = line.removeprefix("endpoint=")
        root = certificates.ca.read_bytes()
        _create_topic(endpoint.removeprefix("https://"), root, "t-any")
        credentials = google.oauth2.credentials.Credentials(token="t-any")
        with PublisherClient(endpoint=endpoint, credentials=credentials, root_certificates=root) as publisher:
            assert publisher.publish(TOPIC, b"over TLS").result(timeout=30)
        # REST on the same TLS port.
        https = Https(endpoint.removeprefix("https://"), certificates.ca)
        assert https.request("GET", f"/v1/projects/{PROJECT}/topics") == (200, {"topics": [{"name": TOPIC}]})
        https.connection.close()
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0


@pytest.mark.parametrize("rest", [True, False])
def test_a_key_that_is_not_the_certificates_or_is_encrypted_is_refused_clearly(
    certificates: Certificates, tmp_path: Path, rest: bool
) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    other = tmp_path / "other.key"
    other.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        serialization.load_pem_private_key(certificates.key.read_bytes(), None).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    for key_file, message in (
        (other, "tls_cert and tls_key are not a usable certificate and key: .*KEY_VALUES_MISMATCH"),
        (encrypted, "tls_key is encrypted: give an unencrypted PEM private key"),
    ):
        server = LocalServer(in_memory=True, tls_cert=certificates.cert, tls_key=key_file, rest=rest)
        with pytest.raises(ValueError, match=message):
            server.start()


def test_hedgepub_serve_needs_both_tls_files(certificates: Certificates) -> None:
    result = CliRunner().invoke(main, ["serve", "--in-memory", "--tls-cert", str(certificates.cert)])
    assert result.exit_code == 2
    assert "--tls-cert and --tls-key go together" in result.output


def test_the_toolbox_over_tls_with_a_private_ca_and_a_token(certificates: Certificates) -> None:
    iam = IamConfig({ADMIN_TOKEN: "user:admin@example.com"}, {"bindings": [ADMIN_BINDING]})
    with LocalServer(in_memory=True, iam=iam, tls_cert=certificates.cert, tls_key=certificates.key) as server:
        runner = CliRunner()
        connection = ["--endpoint", f"https://{server.address}", "--project", PROJECT, "--timeout", "5"]
        trusted = [*connection, "--root-certificates", str(certificates.ca), "--access-token", ADMIN_TOKEN]
        for command in (
            ["topics", "create", "orders"],
            ["publish", "orders", "over TLS"],
            ["topics", "list"],
        ):
            result = runner.invoke(main, [*command, *trusted])
            assert result.exit_code == 0, f"{command}: {result.output}"
        assert [message.data for message in server.messages(TOPIC)] == [b"over TLS"]
        # the system's roots do not know the throwaway CA: no connection
        untrusted = runner.invoke(main, ["topics", "list", *connection, "--access-token", ADMIN_TOKEN])
        assert untrusted.exit_code == 3, untrusted.output


def test_the_toolbox_over_tls_without_a_token_sends_no_credentials(
    certificates: Certificates, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No token: nothing is sent, as over plain text; Application Default Credentials are not looked up
    # (a lookup would fail the command: there are none here).
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/nonexistent/adc.json")
    with LocalServer(in_memory=True, tls_cert=certificates.cert, tls_key=certificates.key) as server:
        runner = CliRunner()
        options = ["--endpoint", f"https://{server.address}", "--project", PROJECT]
        options += ["--root-certificates", str(certificates.ca)]
        assert runner.invoke(main, ["topics", "create", "orders", *options]).exit_code == 0
        result = runner.invoke(main, ["publish", "orders", "anonymous", *options])
        assert result.exit_code == 0, result.output
        assert [message.data for message in server.messages(TOPIC)] == [b"anonymous"]


# ------------------------------------------------------------------- REST and gRPC on one TLS port


class Https:
    """Plain HTTPS requests (``http.client``) to a TLS server, trusting only the test CA."""

    def __init__(self, address: str, ca: Path) -> None:
        host, port = address.rsplit(":", 1)
        context = ssl.create_default_context(cafile=str(ca))
        self.connection = http.client.HTTPSConnection(host, int(port), context=context, timeout=30)

    def request(self, method: str, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
        """One request (JSON body); the status and the decoded JSON answer."""
        headers = {"authorization": f"Bearer {token}"} if token else {}
        payload = None if body is None else json.dumps(body).encode()
        self.connection.request(method, path, body=payload, headers=headers)
        response = self.connection.getresponse()
        return response.status, json.loads(response.read())


def test_the_official_client_and_plain_https_share_one_tls_port_under_iam(certificates: Certificates) -> None:
    tokens = {
        ADMIN_TOKEN: "user:admin@example.com",
        "t-publisher": PUBLISHER,
        "t-nobody": "user:nobody@x.com",
    }
    policy = {"bindings": [ADMIN_BINDING, {"role": "roles/pubsub.publisher", "members": [PUBLISHER]}]}
    iam = IamConfig(tokens, policy)
    with LocalServer(in_memory=True, iam=iam, tls_cert=certificates.cert, tls_key=certificates.key) as server:
        https = Https(server.address, certificates.ca)
        # REST over TLS meets IAM as gRPC does: no token, a token without the role, the admin's.
        topic_path = f"/v1/{TOPIC}"
        status, document = https.request("PUT", topic_path, {})
        assert (status, document["error"]["status"]) == (401, "UNAUTHENTICATED")
        status, document = https.request("PUT", topic_path, {}, token="t-nobody")
        assert (status, document["error"]["status"]) == (403, "PERMISSION_DENIED")
        assert https.request("PUT", topic_path, {}, token=ADMIN_TOKEN) == (200, {"name": TOPIC})
        subscription = f"projects/{PROJECT}/subscriptions/orders-sub"
        status, _ = https.request("PUT", f"/v1/{subscription}", {"topic": TOPIC}, token=ADMIN_TOKEN)
        assert status == 200

        # The official client, over gRPC on the same port, with the publisher's token.
        channel_credentials = grpc.composite_channel_credentials(
            grpc.ssl_channel_credentials(root_certificates=certificates.ca.read_bytes()),
            grpc.access_token_call_credentials("t-publisher"),
        )
        with grpc.secure_channel(server.address, channel_credentials) as channel:
            publisher = pubsub_v1.PublisherClient(transport=PublisherGrpcTransport(channel=channel))
            message_id = publisher.publish(TOPIC, b"over gRPC").result(timeout=30)
            publisher.stop()
            with pytest.raises(google.api_core.exceptions.PermissionDenied):  # a publisher may not pull
                pubsub_v1.SubscriberClient(transport=SubscriberGrpcTransport(channel=channel)).pull(
                    subscription=subscription, max_messages=1, timeout=30
                )
        status, published = https.request(
            "POST", f"/v1/{TOPIC}:publish", {"messages": [{"data": "b3ZlciBSRVNU"}]}, token="t-publisher"
        )
        assert status == 200 and len(published["messageIds"]) == 1

        # Pulled over REST (the admin's token), then over gRPC with the official client.
        status, pulled = https.request(
            "POST", f"/v1/{subscription}:pull", {"maxMessages": 1}, token=ADMIN_TOKEN
        )
        assert status == 200
        [first] = pulled["receivedMessages"]
        assert (first["message"]["messageId"], first["message"]["data"]) == (
            message_id,
            base64.b64encode(b"over gRPC").decode(),
        )
        ack = {"ackIds": [first["ackId"]]}
        assert https.request("POST", f"/v1/{subscription}:acknowledge", ack, token=ADMIN_TOKEN) == (200, {})
        admin_credentials = grpc.composite_channel_credentials(
            grpc.ssl_channel_credentials(root_certificates=certificates.ca.read_bytes()),
            grpc.access_token_call_credentials(ADMIN_TOKEN),
        )
        with grpc.secure_channel(server.address, admin_credentials) as channel:
            subscriber = pubsub_v1.SubscriberClient(transport=SubscriberGrpcTransport(channel=channel))
            response = subscriber.pull(subscription=subscription, max_messages=1, timeout=30)
            [second] = response.received_messages
            assert (second.message.message_id, second.message.data) == (
                published["messageIds"][0],
                b"over REST",
            )
        # The keys that verify push OIDC tokens are served on the same TLS port.
        certs_url = server.push_certs_url
        assert certs_url is not None and certs_url.startswith(f"https://{server.address}/")
        status, keys = https.request("GET", certs_url.removeprefix(f"https://{server.address}"))
        assert status == 200 and keys and all("CERTIFICATE" in pem for pem in keys.values())
        https.connection.close()


def test_curl_over_tls_reaches_rest_with_its_default_alpn(certificates: Certificates) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not on PATH")
    with LocalServer(in_memory=True, tls_cert=certificates.cert, tls_key=certificates.key) as server:
        base = f"https://{server.address}/v1/projects/{PROJECT}/topics"

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            command = [curl, "-sS", "-v", "--max-time", "30", "--cacert", str(certificates.ca), *args]
            return subprocess.run(command, capture_output=True, text=True, timeout=60)

        created = run("-X", "PUT", f"{base}/orders")
        assert created.returncode == 0, created.stderr
        assert json.loads(created.stdout) == {"name": TOPIC}
        # curl offers h2 and http/1.1; the REST front chose http/1.1.
        assert "ALPN: offers h2" in created.stderr and "server accepted http/1.1" in created.stderr
        listed = run(base)
        assert json.loads(listed.stdout) == {"topics": [{"name": TOPIC}]}
        untrusted = subprocess.run([curl, "-sS", base], capture_output=True, text=True, timeout=60)
        assert untrusted.returncode == 60, untrusted.stderr  # the system's roots do not know the test CA
