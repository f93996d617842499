"""Running the server: :class:`AsyncLocalServer` on the caller's event loop and :func:`serve` for the
command line (:class:`~hedgepub.server._local_thread.LocalServer` runs it on its own thread).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import socket
import sqlite3
import ssl
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from hedgepub.server._api.client_telemetry import HedgeTelemetry
from hedgepub.server._api.dispatch import generic_handlers
from hedgepub.server._api.grpc import PubSubServicer
from hedgepub.server._api.rest import RestGateway, http_protocol_factory
from hedgepub.server._api.shedding import LoadShedder
from hedgepub.server._faults.injector import FaultInjector
from hedgepub.server._front.front import OnePortFront
from hedgepub.server._iam.iam import IamEnforcer
from hedgepub.server._options import ServerOptions, with_settings
from hedgepub.server._pubsub.core import PubSubCore
from hedgepub.server._pubsub.hedge_dedup import HedgeBatchWindow
from hedgepub.server._pubsub.oidc import CERTS_PATH, PushTokenSigner
from hedgepub.server._pubsub.policies import IamPolicies
from hedgepub.server._store.datadir import (
    DataDirError,
    DataDirLock,
    database_path,
    open_data_dir,
    push_key_path,
)
from hedgepub.server._store.memory import MemoryStore
from hedgepub.server._store.protocol import Store

#: gRPC message size limits, above the service's own 10 MB limits so that those checks answer.
MAX_GRPC_MESSAGE_BYTES = 20 * 1024 * 1024
#: Calls the gRPC face holds waiting for the event loop to take them up. gRPC's default (1,000, refused
#: beyond as CANCELLED, which Google's emulator never answers) turned away thousands of concurrent calls;
#: calls wait instead, and past the shedder's bound (_api/shedding.py) are refused UNAVAILABLE.
MAX_PENDING_CALLS = 100_000
#: Options of the gRPC face (and of the REST gateway's channel to it).
GRPC_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
)

#: The least time REST connections get to finish when the server stops (see stop()).
HTTP_SHUTDOWN_MINIMUM_SECONDS = 0.01

#: Where the gRPC face listens when the one-port front owns the public port: loopback, ephemeral.
PRIVATE_HOST = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class _PrivateAddress:
    """Where the gRPC face listens behind the front: a Linux abstract unix socket (no TCP stack on the
    private hop, no port, no file to clean up), else an ephemeral port of loopback TCP."""

    #: The address in grpc's form (``unix-abstract:NAME``, ``127.0.0.1:PORT``).
    grpc_address: str
    family: int
    #: The address in the socket module's form.
    socket_address: Any

    @classmethod
    def choose(cls) -> _PrivateAddress:
        if sys.platform == "linux":
            name = f"hedgepub-{os.getpid()}-{secrets.token_hex(8)}"
            return cls(f"unix-abstract:{name}", socket.AF_UNIX, "\0" + name)
        return cls(f"{PRIVATE_HOST}:0", socket.AF_INET, (PRIVATE_HOST, 0))

    def bound(self, port: int) -> _PrivateAddress:
        """This address once grpc has bound it (``port``: the one grpc chose, for TCP)."""
        if self.family != socket.AF_INET:
            return self
        return _PrivateAddress(f"{PRIVATE_HOST}:{port}", self.family, (PRIVATE_HOST, port))


def open_store(
    data_dir: str | os.PathLike[str] | None, in_memory: bool, *, keep_unsubscribed: bool = False
) -> Store:
    """The store for a server: in memory, or SQLite in ``data_dir``."""
    if in_memory:
        return MemoryStore(keep_unsubscribed=keep_unsubscribed)
    if data_dir is None:
        raise ValueError("data_dir is required unless in_memory=True")
    from hedgepub.server._store.sqlite import SqliteStore

    try:
        return SqliteStore(database_path(data_dir), keep_unsubscribed=keep_unsubscribed)
    except sqlite3.Error as error:
        raise DataDirError(f"database file {database_path(data_dir)} cannot be opened: {error}") from None


def _add_port(server: grpc.aio.Server, where: str, credentials: grpc.ServerCredentials | None) -> int:
    """Have ``server`` listen on ``where`` (TLS with ``credentials``); the port bound. RuntimeError if not."""
    if credentials is not None:
        port = server.add_secure_port(where, credentials)
    else:
        port = server.add_insecure_port(where)
    if port == 0:  # how older grpc releases said it; newer ones raise RuntimeError
        raise RuntimeError(f"Failed to bind to address {where}")
    return port


def _cannot_listen(where: str) -> OSError:
    return OSError(f"cannot listen on {where} (in use, or not an address of this machine)")


class AsyncLocalServer:
    """The Pub/Sub server on the running event loop, set up by its :class:`ServerOptions`.

    ``AsyncLocalServer(ServerOptions(in_memory=True))``, or the same options as keywords
    (``AsyncLocalServer(in_memory=True)``; with ``options`` too, they override its fields); ``data_dir`` or
    ``in_memory=True`` is required
    (:class:`LocalServer` adds the temporary-directory default). The options' ``faults`` is the
    server's :attr:`faults` (a new, empty :class:`~hedgepub.server.FaultInjector` when not given); with
    ``dedup_hedges`` its :attr:`hedge_dedup` window stores each hedged batch once; :attr:`rest` says
    whether REST is served (not on Windows).
    """

    def __init__(self, options: ServerOptions | None = None, **settings: Any) -> None:
        options = with_settings(options, settings)
        #: What the server was set up with.
        self.options = options
        self.host = options.host
        #: Where SQLite lives: the options' ``data_dir``, or the temporary directory :class:`LocalServer`
        #: sets before starting.
        self.data_dir = options.data_dir
        self.faults = options.faults if options.faults is not None else FaultInjector()
        #: Counts the gRPC calls in progress; refuses (UNAVAILABLE) those past its limit.
        self.shedder = LoadShedder()
        # The front works on the loop's reader callbacks, which Windows' default (proactor) loop lacks.
        self.rest = options.rest and sys.platform != "win32"
        #: With ``dedup_hedges=True``: the window that stores each hedged batch once (else ``None``).
        self.hedge_dedup: HedgeBatchWindow | None = (
            HedgeBatchWindow(clock=options.clock) if options.dedup_hedges else None
        )
        #: Counts the Publish calls, those that carry Google's client-telemetry header and the hedges.
        self.hedge_telemetry = HedgeTelemetry()
        self._server: grpc.aio.Server | None = None
        self._front: OnePortFront | None = None
        self._gateway: RestGateway | None = None
        self._http: Any = None
        self.core: PubSubCore | None = None
        self._data_dir_lock: DataDirLock | None = None
        self.port = 0

    @property
    def address(self) -> str:
        """``host:port`` to give clients (``PUBSUB_EMULATOR_HOST``, or ``https://`` + it under TLS)."""
        return f"{self.host}:{self.port}"

    @property
    def tls(self) -> bool:
        """Whether the server speaks TLS (``tls_cert`` and ``tls_key`` given) rather than plain text."""
        return self.options.tls_cert is not None

    @property
    def push_certs_url(self) -> str | None:
        """Where the keys that verify push requests' OIDC tokens are served (``{kid: PEM certificate}``;
        ``/oauth2/v3/certs`` beside it is the JSON Web Key Set); ``None`` without the REST face."""
        if not self.rest:
            return None
        return f"{'https' if self.tls else 'http'}://{self.address}{CERTS_PATH}"

    def _server_credentials(self) -> grpc.ServerCredentials:
        tls_cert, tls_key = self.options.tls_cert, self.options.tls_key
        assert tls_cert is not None and tls_key is not None
        try:
            chain = Path(tls_cert).read_bytes()
            key = Path(tls_key).read_bytes()
        except OSError as error:
            raise OSError(f"cannot read the TLS certificate or key: {error}") from error
        checks = (("tls_cert", tls_cert, chain, b"CERTIFICATE"), ("tls_key", tls_key, key, b"PRIVATE KEY"))
        for what, path, data, marker in checks:
            if b"-----BEGIN" not in data or marker not in data:
                raise ValueError(f"{what} ({os.fspath(path)}) holds no PEM {marker.decode()}")
        return grpc.ssl_server_credentials([(key, chain)])

    def _tls_context(self) -> ssl.SSLContext:
        """The TLS context REST connections are served with: the server's certificate and key, ALPN
        ``http/1.1`` (the one protocol aiohttp serves). Made with REST off too: it checks that the key
        is the certificate's and is not encrypted, which grpc would only report as a port it cannot bind."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.set_alpn_protocols(["http/1.1"])

        def no_password() -> bytes:
            # Without this, OpenSSL would ask for the password of an encrypted key on the terminal.
            raise ValueError("tls_key is encrypted: give an unencrypted PEM private key")

        try:
            context.load_cert_chain(self.options.tls_cert or "", self.options.tls_key, password=no_password)
        except ssl.SSLError as error:
            raise ValueError(f"tls_cert and tls_key are not a usable certificate and key: {error}") from None
        return context

    async def start(self) -> None:
        """Lock and check the data directory, open the store, load what it holds, and start serving.

        A data directory another server uses, or one that cannot be written, or a database that cannot be
        opened or fails SQLite's quick check raises :class:`~hedgepub.server.DataDirError` (one line).
        """
        credentials = self._server_credentials() if self.tls else None  # bad files fail before any work
        tls_context = self._tls_context() if self.tls else None
        front = None
        if self.rest:
            # The public port first: when it is taken, nothing else has been opened yet.
            front = OnePortFront(tls_context, relay=self.options.relay, relay_cpu=self.options.relay_cpu)
            try:
                await front.bind(self.host, self.options.port)
            except OSError as error:
                raise _cannot_listen(f"{self.host}:{self.options.port}") from error
        try:
            if not self.options.in_memory and self.data_dir is not None:
                self._data_dir_lock = open_data_dir(self.data_dir)
            await self._start(credentials, front)
        except BaseException:
            self._release_data_dir()
            if front is not None:
                await front.stop()
            raise

    def _release_data_dir(self) -> None:
        lock, self._data_dir_lock = self._data_dir_lock, None
        if lock is not None:
            lock.release()

    async def _start(self, credentials: grpc.ServerCredentials | None, front: OnePortFront | None) -> None:
        options = self.options
        # The push tokens' key: kept in the data directory, so that tokens verify across restarts.
        # (No data_dir and not in memory: open_store refuses it just below.)
        key_file = None if options.in_memory or self.data_dir is None else push_key_path(self.data_dir)
        tokens = PushTokenSigner(key_file)
        tokens.load()  # a key file that cannot be read fails the start, before the store is opened
        store = open_store(self.data_dir, options.in_memory, keep_unsubscribed=options.keep_unsubscribed)
        # IAM enforcement reads the policies the core keeps, and tells it where dead letters may go.
        policies = IamPolicies(store)
        authorizer = options.authorizer
        may_forward = None
        if options.iam is not None:
            enforcer = IamEnforcer(options.iam, policies.stored)
            authorizer, may_forward = enforcer, enforcer.may_forward
        core = PubSubCore(
            store,
            clock=options.clock,
            window=options.window,
            push_tokens=tokens,
            buckets_dir=options.buckets_dir,
            policies=policies,
            may_forward=may_forward,
        )
        loop = asyncio.get_running_loop()
        try:
            # Loading a large SQLite backlog can take a moment; keep the loop free meanwhile.
            snapshot = await loop.run_in_executor(None, store.load)
            core.load(snapshot)
        except (sqlite3.Error, DecodeError) as error:
            await core.close()
            raise DataDirError(
                f"database file {database_path(self.data_dir or '')} cannot be loaded: {error}"
            ) from None
        # The shedder first: a call it refuses meets no injected fault and runs no handler.
        server = grpc.aio.server(interceptors=[self.shedder, self.faults], options=GRPC_OPTIONS)
        server.add_generic_rpc_handlers(
            generic_handlers(PubSubServicer(core, authorizer, self.hedge_dedup, self.hedge_telemetry))
        )
        # With REST on, gRPC listens privately and the front owns the public port (see _front/front.py).
        private = _PrivateAddress.choose()
        where = f"{self.host}:{self.options.port}" if front is None else private.grpc_address
        # Under TLS the relayed connections are still encrypted, so the private face speaks TLS too; the
        # REST gateway, which runs in this process, calls another private face in plain text (nothing
        # crosses a network there; it sees what a TLS client may see), with no certificate to verify.
        plain: _PrivateAddress | None = None
        try:
            port = _add_port(server, where, credentials)
            if front is not None and credentials is not None:
                plain = _PrivateAddress.choose()
                plain = plain.bound(_add_port(server, plain.grpc_address, None))
        except RuntimeError as error:
            # The one place grpc's report becomes the OSError callers expect of a socket that cannot listen.
            await core.close()
            raise _cannot_listen(where) from error
        await server.start()
        if front is not None:
            private = private.bound(port)
            gateway = RestGateway((plain or private).grpc_address, GRPC_OPTIONS, authorizer, core.transforms)
            http = http_protocol_factory(gateway, tokens.pages())
            await front.serve(private.family, private.socket_address, http)
            self._front, self._gateway, self._http = front, gateway, http
            port = front.port
        self.core = core
        self._server = server
        self.port = port

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving (letting calls in flight finish for ``grace`` seconds), then close the store."""
        server, core, front, gateway, http = self._server, self.core, self._front, self._gateway, self._http
        self._server = self._front = self._gateway = self._http = None
        if front is not None:
            front.close()  # no new connections while the calls in flight finish

        async def stop_rest() -> None:
            # REST calls in flight finish first: they go through the gateway's channel to the gRPC face.
            if http is not None:
                # Never 0: aiohttp takes a timeout of 0 for none, and would wait for ever for a client's
                # idle keep-alive connection (a requests.Session, say) to send another request.
                await http.shutdown(max(grace or 0.0, HTTP_SHUTDOWN_MINIMUM_SECONDS))
            if gateway is not None:
                await gateway.close()

        async def stop_grpc() -> None:
            if server is not None:
                await server.stop(grace)

        await asyncio.gather(stop_rest(), stop_grpc())
        if front is not None:
            await front.stop()
        if core is not None:
            await core.close()
        self._release_data_dir()

    async def wait_for_termination(self) -> None:
        """Wait until the server stops."""
        if self._server is not None:
            await self._server.wait_for_termination()

    async def __aenter__(self) -> AsyncLocalServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop(0)

    def __repr__(self) -> str:
        where = "in memory" if self.options.in_memory else f"data_dir={str(self.data_dir)!r}"
        state = f"serving on {self.address}" if self._server is not None else "stopped"
        return f"<AsyncLocalServer {state}{' over TLS' if self.tls else ''}, {where}>"


async def serve(
    options: ServerOptions | None = None,
    *,
    on_started: Callable[[AsyncLocalServer], object] | None = None,
    stop: asyncio.Event | None = None,
    grace: float = 1.0,
    **settings: Any,
) -> None:
    """Run the server set up by ``options`` (or by :class:`ServerOptions`' fields given as keywords, which
    override those of ``options``) until ``stop`` is set or the task is cancelled, then shut it down
    cleanly.

    ``on_started(server)`` runs once the port is open (to print ``PUBSUB_EMULATOR_HOST=...``).
    """
    server = AsyncLocalServer(options, **settings)
    await server.start()
    try:
        if on_started is not None:
            on_started(server)
        if stop is None:
            await server.wait_for_termination()
        else:
            await stop.wait()
    finally:
        await asyncio.shield(server.stop(grace))
