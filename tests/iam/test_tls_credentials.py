"""The road to the real endpoint: TLS, google-auth credentials whose token expires, IAM enforcement.

A throwaway CA signs a certificate for 127.0.0.1; the local server serves TLS with it and enforces IAM. The
publisher trusts only that CA and authenticates with real ``google.oauth2.credentials.Credentials`` whose
refresh handler issues the next token of a list that is the server's IAM tokens file. Tokens live about a
second, so they expire several times while a hedging publisher works against a server that answers some
calls slowly; a wrapping authorizer records the token every call carried and refuses it once expired.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import itertools
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import google.auth._helpers
import google.auth.exceptions
import google.oauth2.credentials
import grpc
import pytest
from click.testing import CliRunner
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
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
from hedgepub.cli import main
from hedgepub.server import IamConfig, IamEnforcer, LocalServer, ServiceError

from .._cli import CLI

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
class Certificates:
    """A throwaway CA and a server certificate it signed for 127.0.0.1 and localhost, as PEM files."""

    ca: Path
    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    directory = tmp_path_factory.mktemp("tls")
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("hedgepub test CA"))
        .issuer_name(_name("hedgepub test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca_cert.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = Certificates(ca=directory / "ca.pem", cert=directory / "server.pem", key=directory / "server.key")
    paths.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths.cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    paths.key.write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return paths


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
            attempt = int(values.get("hedgepub-attempt", "-1"))
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
    started = time.monotonic()
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
    assert time.monotonic() - started < 5  # not retried until the total timeout
    assert stats.attempts_sent == 1 and stats.messages_failed == 1
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
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0


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
