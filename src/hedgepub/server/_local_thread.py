"""The server on its own thread and event loop: :class:`LocalServer`, for tests and notebooks (it runs an
:class:`~hedgepub.server._local.AsyncLocalServer` there).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from hedgepub._service_thread import ServiceThread
from hedgepub.server._api.client_telemetry import HedgeTelemetry
from hedgepub.server._faults.injector import FaultInjector
from hedgepub.server._iam.iam import Authorizer, IamConfig
from hedgepub.server._local import AsyncLocalServer
from hedgepub.server._options import ServerOptions
from hedgepub.server._pubsub.core import PubSubCore
from hedgepub.server._pubsub.delivery import DEFAULT_WINDOW
from hedgepub.server._pubsub.hedge_dedup import HedgeBatchWindow
from hedgepub.server._store.protocol import StoredMessage

__all__ = ["LocalServer"]


class LocalServer:
    """The Pub/Sub server in this process, on its own thread and event loop; for tests and notebooks.

    ``with LocalServer() as server:`` starts it on an ephemeral port of 127.0.0.1; ``server.address``
    goes in ``PUBSUB_EMULATOR_HOST``. With neither ``data_dir`` nor ``in_memory`` it keeps SQLite in a
    temporary directory that is removed when it stops. The arguments are those of
    :class:`~hedgepub.server.ServerOptions`, where each is described: ``iam=IamConfig(...)`` enforces IAM;
    ``tls_cert`` and ``tls_key`` (PEM files) make it serve TLS (gRPC and REST); ``rest=False`` turns the
    REST face off. Unlike there, messages published while a topic has no subscription are kept, so that
    :meth:`messages` shows them; ``keep_unsubscribed=False`` drops them, as the real service does (for
    long runs, where they would only fill memory or disk).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        data_dir: str | os.PathLike[str] | None = None,
        in_memory: bool = False,
        faults: FaultInjector | None = None,
        *,
        iam: IamConfig | None = None,
        authorizer: Authorizer | None = None,
        keep_unsubscribed: bool = True,
        window: int = DEFAULT_WINDOW,
        dedup_hedges: bool = False,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        rest: bool = True,
        relay: str = "process",
        relay_cpu: int | str | None = None,
        buckets_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self._temporary: str | None = None
        self._server = AsyncLocalServer(
            ServerOptions(
                host=host,
                port=port,
                data_dir=data_dir,
                in_memory=in_memory,
                faults=faults,
                iam=iam,
                authorizer=authorizer,
                keep_unsubscribed=keep_unsubscribed,
                window=window,
                dedup_hedges=dedup_hedges,
                tls_cert=tls_cert,
                tls_key=tls_key,
                rest=rest,
                relay=relay,
                relay_cpu=relay_cpu,
                buckets_dir=buckets_dir,
            )
        )
        self._runner = ServiceThread("hedgepub-server", self._server.start, self._server.stop)

    @property
    def address(self) -> str:
        """``host:port`` of the running server."""
        return self._server.address

    @property
    def host(self) -> str:
        """The host the server listens on."""
        return self._server.host

    @property
    def tls(self) -> bool:
        """Whether the server speaks TLS (clients use ``endpoint="https://" + address``)."""
        return self._server.tls

    @property
    def port(self) -> int:
        """The port the server listens on (0 until started)."""
        return self._server.port

    @property
    def push_certs_url(self) -> str | None:
        """The URL of the keys that verify push requests' OIDC tokens (see :class:`AsyncLocalServer`)."""
        return self._server.push_certs_url

    @property
    def hedge_dedup(self) -> HedgeBatchWindow | None:
        """With ``dedup_hedges=True``, the window of committed hedged batches and its counts."""
        return self._server.hedge_dedup

    @property
    def hedge_telemetry(self) -> HedgeTelemetry:
        """Publish calls as Google's client-telemetry header describes them: ``.counts`` holds the
        publishes, those with the header, the hedges among them and the malformed headers ignored."""
        return self._server.hedge_telemetry

    @property
    def faults(self) -> FaultInjector:
        """The server's :class:`~hedgepub.server.FaultInjector`; change its rules at any time."""
        return self._server.faults

    @property
    def data_dir(self) -> str | None:
        """Where SQLite lives (``None`` in memory)."""
        data_dir = self._server.data_dir
        return None if data_dir is None else str(data_dir)

    @property
    def running(self) -> bool:
        """Whether the server thread is serving."""
        return self._runner.running

    def start(self) -> LocalServer:
        """Start serving on a new thread; returns once the port is open (raises if it cannot open)."""
        if self._runner.started:
            raise RuntimeError("this LocalServer has already been started")
        if not self._server.options.in_memory and self._server.data_dir is None:
            self._temporary = tempfile.mkdtemp(prefix="hedgepub-server-")
            self._server.data_dir = self._temporary
        try:
            self._runner.start()
        except BaseException:
            self._cleanup()
            raise
        return self

    def stop(self, grace: float | None = None) -> None:
        """Stop serving (calls in flight get ``grace`` seconds) and wait for the thread to end."""
        try:
            self._runner.stop(grace)
        finally:
            self._cleanup()

    def _cleanup(self) -> None:
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None

    def _call(self, coroutine_function: Callable[[], Any], timeout: float | None = None) -> Any:
        if not self.running:
            raise RuntimeError("the server is not running")
        return self._runner.call(coroutine_function, timeout)

    def _core(self) -> PubSubCore:
        core = self._server.core
        if core is None:
            raise RuntimeError("the server is not running")
        return core

    def messages(self, topic: str) -> list[StoredMessage]:
        """Every message still stored on ``topic`` (full name), in publish order.

        That is every message published while the topic had no subscription (unless
        ``keep_unsubscribed=False``), and those some subscription has not acknowledged yet.
        """

        async def read() -> list[StoredMessage]:
            return self._core().messages(topic)

        return self._call(read)

    def clear(self) -> None:
        """Delete every topic, subscription, IAM policy and message."""

        async def clear() -> None:
            await self._core().clear()

        self._call(clear)

    def wait_until_idle(self, timeout: float = 10.0) -> bool:
        """Wait until no message is waiting or leased on any subscription; False if ``timeout`` passed."""

        async def wait() -> bool:
            core = self._core()
            loop = asyncio.get_running_loop()
            end = loop.time() + timeout
            while not core.is_idle():
                if loop.time() >= end:
                    return False
                await asyncio.sleep(0.01)
            return True

        return bool(self._call(wait))

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop(0)

    def __repr__(self) -> str:
        store = "in memory" if self._server.options.in_memory else f"data_dir={self.data_dir!r}"
        state = f"serving on {self.address}" if self.running else "stopped"
        return f"<LocalServer {state}, {store}>"
