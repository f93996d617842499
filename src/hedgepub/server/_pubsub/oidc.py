"""OIDC tokens for push requests: what the real service sends when ``push_config.oidc_token`` is set.

With ``oidc_token.service_account_email`` set, the real service sends each push request with
``Authorization: Bearer <JWT>``: an OpenID Connect ID token, signed RS256 by Google, whose claims are
``aud`` (``oidc_token.audience``, or the push endpoint URL when that is empty), ``email`` (the service
account), ``email_verified`` (true), ``sub`` and ``azp`` (the service account's numeric unique ID),
``iss`` (``https://accounts.google.com``), ``iat`` and ``exp`` (one hour later); its header names the
signing key (``kid``).

This server cannot sign as Google, so it signs the same claims with an RSA key of its own and publishes
the public key on its REST port in the two forms Google publishes its own keys in, so that an endpoint
verifies the token exactly as it verifies Google's, only with another certificates URL:

- :data:`CERTS_PATH` (``/oauth2/v1/certs``): ``{kid: PEM X.509 certificate}``, the form
  ``google.oauth2.id_token.verify_token(token, request, audience, certs_url=...)`` reads;
- :data:`JWKS_PATH` (``/oauth2/v3/certs``): a JSON Web Key Set, for JWT libraries that read one.

The key is made once per data directory (:data:`~hedgepub.server._store.datadir.PUSH_KEY_FILE`, mode 0600)
and kept, so that a token signed before a restart still verifies against the keys served after it; an
in-memory server keeps it in memory. It is made when first needed (the first push with a token, or the
first request for the keys), not at every start: making an RSA key takes a noticeable moment.

The service account's unique ID is not known here: ``sub`` and ``azp`` carry a 21-digit number derived
from the email (the same for the same email, as a real ID is). The signing itself is ``google-auth``'s
(``google.auth.crypt``, ``google.auth.jwt``); the key and certificate are made with ``cryptography``.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import hashlib
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID
from google.auth import crypt, jwt

from hedgepub.server._store.datadir import DataDirError

#: The ``iss`` claim the real service's tokens carry.
ISSUER = "https://accounts.google.com"
#: How long a token is valid (``exp - iat``), as the real service's.
TOKEN_LIFETIME_SECONDS = 3600
#: A token is signed again once less than this is left of it (it is reused until then).
REFRESH_MARGIN_SECONDS = 300
#: Where the REST port serves the public keys: ``{kid: PEM certificate}``, and a JSON Web Key Set.
CERTS_PATH = "/oauth2/v1/certs"
JWKS_PATH = "/oauth2/v3/certs"
#: Size of the RSA key.
KEY_BITS = 2048

# What is taken for an email address: one "@", something on each side, a dot in the domain, no spaces.
_EMAIL = re.compile(r"[^@\s]+@[^@\s.]+(\.[^@\s.]+)+")


def valid_service_account_email(email: str) -> bool:
    """Whether ``email`` has the form of an email address (whether such an account exists is not known)."""
    return _EMAIL.fullmatch(email) is not None


def unique_id(email: str) -> str:
    """The ``sub`` and ``azp`` of the tokens for ``email``: 21 digits, stable, as a service account's ID."""
    digest = int.from_bytes(hashlib.sha256(email.encode()).digest()[:16], "big")
    return f"1{digest % 10**20:020d}"


def _b64url_uint(value: int) -> str:
    """An unsigned integer as JWK writes it (RFC 7518, 6.3.1): big-endian bytes, unpadded base64url."""
    raw = value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big")
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


@dataclass(frozen=True)
class SigningKey:
    """The private key, its ``kid``, a signer for it, and its public forms."""

    private_key: rsa.RSAPrivateKey
    key_id: str
    signer: crypt.Signer
    certificate_pem: str

    @classmethod
    def from_private_key(cls, private_key: rsa.RSAPrivateKey) -> SigningKey:
        """Derive the ``kid`` (SHA-1 of the public key, 40 hex digits as Google's), signer and certificate."""
        public_der = private_key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        key_id = hashlib.sha1(public_der).hexdigest()
        pem = private_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        signer = crypt.RSASigner.from_string(pem, key_id=key_id)
        return cls(private_key, key_id, signer, _self_signed_certificate(private_key, key_id))

    def jwk(self) -> dict[str, str]:
        """The public key as a JSON Web Key (RFC 7517), as Google lists its own."""
        numbers = self.private_key.public_key().public_numbers()
        return {
            "kty": "RSA",
            "alg": "RS256",
            "use": "sig",
            "kid": self.key_id,
            "n": _b64url_uint(numbers.n),
            "e": _b64url_uint(numbers.e),
        }


def _self_signed_certificate(private_key: rsa.RSAPrivateKey, key_id: str) -> str:
    """A self-signed X.509 certificate of the public key (Google's certificates URL serves such ones).

    Verifiers read only its public key; it is made anew at each start, valid from a day before to ten
    years after, so that a verifier that does check the dates accepts it.
    """
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"hedgepub push tokens {key_id[:16]}")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private_key.public_key())
        .serial_number(int(key_id, 16) >> 1)  # positive, and at most 159 bits as RFC 5280 allows
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(private_key, hashes.SHA256())
    )
    return certificate.public_bytes(serialization.Encoding.PEM).decode("ascii")


class PushTokenSigner:
    """Signs the push requests' ID tokens with the server's key, and serves its public forms.

    ``key_file``: where the key is kept (``None``: in memory only). ``now``: the calendar time in
    seconds since the epoch, which ``iat`` and ``exp`` are about (the endpoint checks them against its
    own clock, so this is the real one unless a test says otherwise).
    """

    def __init__(self, key_file: Path | None, now: Callable[[], float] = time.time) -> None:
        self.key_file = key_file
        self._now = now
        self._key: SigningKey | None = None
        self._making: asyncio.Future[SigningKey] | None = None
        #: Tokens signed, by (email, audience): the token and its ``exp``.
        self._tokens: dict[tuple[str, str], tuple[str, int]] = {}

    def load(self) -> None:
        """Read the key file if there is one (a server start calls this: a bad file fails the start).

        Raises :class:`~hedgepub.server.DataDirError` when the file cannot be read or holds no RSA key.
        """
        if self.key_file is None or self._key is not None or not self.key_file.exists():
            return
        try:
            data = self.key_file.read_bytes()
        except OSError as error:
            raise DataDirError(
                f"push signing key {self.key_file} cannot be read: {error.strerror or error}"
            ) from None
        try:
            private_key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as error:
            raise DataDirError(f"push signing key {self.key_file} holds no usable key: {error}") from None
        if not isinstance(private_key, rsa.RSAPrivateKey):
            raise DataDirError(f"push signing key {self.key_file} is not an RSA key")
        self._key = SigningKey.from_private_key(private_key)

    async def key(self) -> SigningKey:
        """The signing key: the loaded one, else one made now (off the event loop) and kept."""
        if self._key is not None:
            return self._key
        if self._making is None:
            # One making for all who ask meanwhile; a failure (a key file that cannot be written) is
            # raised to each of them, and the next call tries again.
            self._making = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(None, self._make))
        making = self._making
        try:
            key = await asyncio.shield(making)
        finally:
            if making.done():
                self._making = None
        self._key = key
        return key

    def _make(self) -> SigningKey:
        private_key = rsa.generate_private_key(public_exponent=65537, key_size=KEY_BITS)
        if self.key_file is not None:
            pem = private_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
            _write_private(self.key_file, pem)
        return SigningKey.from_private_key(private_key)

    async def token(self, email: str, audience: str) -> str:
        """The ID token for a push as ``email`` to ``audience``; reused until it is nearly expired."""
        now = int(self._now())
        cached = self._tokens.get((email, audience))
        if cached is not None and cached[1] - now > REFRESH_MARGIN_SECONDS:
            return cached[0]
        key = await self.key()
        account_id = unique_id(email)
        claims: dict[str, Any] = {
            "aud": audience,
            "azp": account_id,
            "email": email,
            "email_verified": True,
            "exp": now + TOKEN_LIFETIME_SECONDS,
            "iat": now,
            "iss": ISSUER,
            "sub": account_id,
        }
        token = jwt.encode(key.signer, claims).decode("ascii")
        # Forget expired ones first: the cache holds one token per (email, audience) in use.
        self._tokens = {pair: entry for pair, entry in self._tokens.items() if entry[1] > now}
        self._tokens[(email, audience)] = (token, claims["exp"])
        return token

    async def certificates(self) -> dict[str, str]:
        """``{kid: PEM certificate}``, the form of Google's ``/oauth2/v1/certs``."""
        key = await self.key()
        return {key.key_id: key.certificate_pem}

    async def key_set(self) -> dict[str, list[dict[str, str]]]:
        """A JSON Web Key Set, the form of Google's ``/oauth2/v3/certs``."""
        key = await self.key()
        return {"keys": [key.jwk()]}

    def pages(self) -> dict[str, Callable[[], Awaitable[Any]]]:
        """The REST port's GET paths that publish the keys, and what answers each (a JSON document)."""
        return {CERTS_PATH: self.certificates, JWKS_PATH: self.key_set}


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` readable by the owner only, whole or not at all (a crash leaves no half key)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(descriptor, data)
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise DataDirError(f"push signing key {path} cannot be written: {error.strerror or error}") from None
