"""The certificates of the TLS tests, and those docs/rest.md tells users to make, pass strict verification
(``VERIFY_X509_STRICT``, Python 3.13's default): it refuses a certificate without an Authority Key
Identifier. Checked here on any version by setting the flag."""

from __future__ import annotations

import re
import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path

import pytest

from ._tls import make_certificates

ROOT = Path(__file__).resolve().parent.parent


def _handshake_strictly(ca: Path, cert: Path, key: Path) -> str:
    """A TLS handshake on 127.0.0.1 with ``cert``, verified against ``ca`` strictly; its TLS version."""
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(cert, key)
    client_context = ssl.create_default_context(cafile=str(ca))
    client_context.verify_flags |= ssl.VERIFY_X509_STRICT
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def serve() -> None:
            connection, _ = listener.accept()
            try:
                with server_context.wrap_socket(connection, server_side=True) as tls:
                    tls.recv(1)
            except (OSError, ssl.SSLError):
                pass  # the client refused the certificate: its error is the one to see

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        with (
            socket.create_connection(listener.getsockname()) as raw,
            client_context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            tls.send(b"x")
            version = tls.version() or ""
        server.join(timeout=30)
    return version


def test_the_test_certificates_pass_strict_verification(tmp_path: Path) -> None:
    # Without the key identifiers: "certificate verify failed: Missing Authority Key Identifier".
    made = make_certificates(tmp_path)
    assert _handshake_strictly(made.ca, made.cert, made.key).startswith("TLS")


def test_the_documented_openssl_recipe_passes_strict_verification(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    page = (ROOT / "docs" / "rest.md").read_text(encoding="utf-8")
    [block] = [
        b for b in re.findall(r"```bash[^\n]*\n(.*?)```", page, flags=re.S) if "openssl req -x509" in b
    ]
    for line in filter(None, block.splitlines()):
        subprocess.run(["bash", "-c", line], cwd=tmp_path, check=True, capture_output=True, timeout=60)
    assert _handshake_strictly(tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server.key")
