"""Fixtures shared by several test directories: polling for a condition, a real HTTP push endpoint, a
throwaway CA and server certificate for TLS."""

from __future__ import annotations

import datetime
import ipaddress
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@pytest.fixture
def wait_for() -> Callable[..., bool]:
    """Poll a condition until it holds (or 10 s pass); only where a real client's threads do the work."""
    return _wait_for


@dataclass(frozen=True)
class PushRequest:
    """One POST the endpoint received."""

    path: str
    headers: dict[str, str]
    body: bytes
    at: float  # time.monotonic() when it arrived
    status: int  # what the endpoint answered


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        """A client that drops its keep-alive connection (a killed server does) is no error here."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class PushEndpoint:
    """An HTTP/1.1 server on an ephemeral port of 127.0.0.1 that records every POST.

    It answers ``status`` (settable at any time: 200 to acknowledge, 500 to refuse), each answer after
    the next of ``delays`` (seconds; none once they are used up). ``check``, when set, is called with
    each request's headers first, and a status it returns is answered instead (an endpoint that checks
    authentication answers 401 or 403).
    """

    def __init__(self) -> None:
        self.status = 200
        self.check: Callable[[dict[str, str]], int | None] | None = None
        self.delays: list[float] = []
        self.requests: list[PushRequest] = []
        self._changed = threading.Condition()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a real endpoint

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                check = endpoint.check
                refused = check(dict(self.headers.items())) if check is not None else None
                status = endpoint.status if refused is None else refused
                with endpoint._changed:
                    delay = endpoint.delays.pop(0) if endpoint.delays else 0.0
                    endpoint.requests.append(
                        PushRequest(self.path, dict(self.headers.items()), body, time.monotonic(), status)
                    )
                    endpoint._changed.notify_all()
                if delay:
                    time.sleep(delay)  # an endpoint that is slow to answer
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: object) -> None:
                """Quiet."""

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="push-endpoint", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        """The endpoint's URL (path ``/push``)."""
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/push"

    def wait_for(self, condition: Callable[[list[PushRequest]], bool], timeout: float = 30.0) -> bool:
        """Wait until ``condition(requests so far)`` holds; False after ``timeout`` seconds."""
        end = time.monotonic() + timeout
        with self._changed:
            while not condition(self.requests):
                remaining = end - time.monotonic()
                if remaining <= 0:
                    return False
                self._changed.wait(remaining)
            return True

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def push_endpoint() -> Iterator[PushEndpoint]:
    """A running :class:`PushEndpoint`, closed after the test."""
    endpoint = PushEndpoint()
    yield endpoint
    endpoint.close()


@dataclass
class Certificates:
    """A throwaway CA and a server certificate it signed for 127.0.0.1 and localhost, as PEM files."""

    ca: Path
    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


@pytest.fixture(scope="session")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Certificates:
    """A throwaway CA and a server certificate for 127.0.0.1 and localhost it signed (``cryptography``)."""
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
