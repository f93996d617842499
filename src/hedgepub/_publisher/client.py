"""The publisher clients: :class:`AsyncPublisherClient` and its synchronous facade :class:`PublisherClient`.

Both have :func:`~hedgepub._publisher.builder.build_core` build one
:class:`~hedgepub._publisher.core._PublisherCore` (batching, ordering keys, flow control and hedging; its
hot path is described there) from their settings. ``AsyncPublisherClient`` uses it on
the caller's loop; ``PublisherClient`` runs it on a private event-loop thread
(:class:`~hedgepub._publisher.loop_thread._LoopThread`) and is safe to call from any thread. A sync client is
flushed at exit if never shut down, and made safe in a child process after ``os.fork()`` (the hook is
registered when this module is imported).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, ClassVar

from hedgepub._clock import DEFAULT_CLOCK, Clock
from hedgepub._exceptions import PublishError
from hedgepub._publisher.builder import build_core
from hedgepub._publisher.closing import ClientState
from hedgepub._publisher.futures import ManyResult
from hedgepub._publisher.loop_thread import _LoopThread, forget_open_runners
from hedgepub._publisher.migration import refuse_official_keywords, translate
from hedgepub._publisher.stats import PublisherStats
from hedgepub._settings import BatchSettings, FlowControlSettings, HedgingSettings, RetrySettings
from hedgepub._transport.grpc import Transport

_LOGGER = logging.getLogger("hedgepub")

#: The longest a :class:`PublisherClient` that was never shut down keeps flushing once the interpreter
#: exits (or once the client is garbage-collected): its implicit ``shutdown`` gets the smaller of this and
#: the retry settings' total timeout. Long enough for transient errors to be retried, short enough that a
#: dead endpoint does not hold a finished program for the default ten-minute total timeout.
IMPLICIT_SHUTDOWN_TIMEOUT = 30.0
# While the client's endpoint cannot be reached (its latest attempts failed to connect), the implicit
# shutdown waits at most loop_thread.UNREACHABLE_EXIT_TIMEOUT instead: a few reconnections' worth, rather
# than half a minute of a finished program waiting on messages that will most likely fail anyway (they
# fail with ShutdownTimeoutError, and a WARNING says so at exit).


def topic_path(project: str, topic: str) -> str:
    """The full name of ``topic`` in ``project``: ``projects/{project}/topics/{topic}``."""
    return f"projects/{project}/topics/{topic}"


_DEFAULT_BATCH = BatchSettings()
_DEFAULT_RETRY = RetrySettings()
_DEFAULT_FLOW = FlowControlSettings()
#: The official PublisherClient's admin methods, which hedgepub's clients leave to it.
_OFFICIAL_ADMIN_METHODS = frozenset(
    {
        "create_topic",
        "delete_topic",
        "detach_subscription",
        "get_iam_policy",
        "get_topic",
        "list_topic_snapshots",
        "list_topic_subscriptions",
        "list_topics",
        "set_iam_policy",
        "test_iam_permissions",
        "update_topic",
    }
)
#: What each constructor argument is when not given, so that official arguments can fill it (or clash).
_FACADE_DEFAULTS: dict[str, Any] = {
    "hedging_settings": None,
    "batch_settings": _DEFAULT_BATCH,
    "retry_settings": _DEFAULT_RETRY,
    "flow_control": _DEFAULT_FLOW,
    "enable_message_ordering": False,
    "endpoint": None,
    "credentials": None,
    "enable_open_telemetry": False,
    "tracer_provider": None,
}


class _ClientFacade:
    """What both clients share: building the core from the settings, and the calls that need no loop."""

    #: Whether the core hands out ``concurrent.futures`` (sync client) or asyncio futures.
    _sync_futures: ClassVar[bool]
    # Each client's own publish method; _bind_publish may replace it on an instance.
    publish: Callable[..., Any]

    def __init__(
        self,
        batch_settings: BatchSettings | Any = _DEFAULT_BATCH,
        publisher_options: Any = None,
        *,
        hedging_settings: HedgingSettings | None = None,
        retry_settings: RetrySettings = _DEFAULT_RETRY,
        flow_control: FlowControlSettings = _DEFAULT_FLOW,
        enable_message_ordering: bool = False,
        endpoint: str | None = None,
        credentials: Any = None,
        hedge_endpoints: Sequence[str] | None = None,
        channel_pool_size: int | None = None,
        idempotency_attribute: bool | str = False,
        client_options: Any = None,
        root_certificates: bytes | None = None,
        enable_open_telemetry: bool = False,
        tracer_provider: Any = None,
        meter_provider: Any = None,
        transport: Transport | Sequence[Transport] | None = None,
        hedge_transports: Sequence[Transport | Sequence[Transport]] | None = None,
        clock: Clock = DEFAULT_CLOCK,
        **official_keywords: Any,
    ) -> None:
        # The positional order is the official client's: (batch_settings, publisher_options), the rest by
        # name. hedgepub 0.1.0 took (hedging_settings, batch_settings) first; those are told by their type.
        if isinstance(batch_settings, HedgingSettings):
            if hedging_settings is not None:
                raise TypeError("hedging_settings given twice (by position and by name): pass it once")
            hedging_settings, batch_settings = batch_settings, _DEFAULT_BATCH
            if isinstance(publisher_options, BatchSettings):
                batch_settings, publisher_options = publisher_options, None
        arguments = {
            "hedging_settings": hedging_settings,
            "batch_settings": batch_settings,
            "retry_settings": retry_settings,
            "flow_control": flow_control,
            "enable_message_ordering": enable_message_ordering,
            "endpoint": endpoint,
            "credentials": credentials,
            "enable_open_telemetry": enable_open_telemetry,
            "tracer_provider": tracer_provider,
        }
        if official_keywords:
            refuse_official_keywords(official_keywords)
        if isinstance(transport, str) or type(transport).__name__ == "PublisherGrpcTransport":
            raise TypeError(
                f"transport={transport!r} is the official client's GAPIC transport, which hedgepub does not "
                "use: "
                "drop it (hedgepub always speaks gRPC), or pass endpoint= / credentials="
            )
        if (
            publisher_options is not None
            or client_options is not None
            or type(batch_settings) is not BatchSettings
        ):
            arguments = translate(
                {**arguments, "_defaults": _FACADE_DEFAULTS}, publisher_options, client_options
            )
        #: What the core was built from (a forked child builds a fresh one from it).
        self._core_arguments = dict(
            **arguments,
            transport=transport,
            clock=clock,
            sync_futures=self._sync_futures,
            hedge_endpoints=hedge_endpoints,
            hedge_transports=hedge_transports,
            channel_pool_size=channel_pool_size,
            idempotency_attribute=idempotency_attribute,
            root_certificates=root_certificates,
            meter_provider=meter_provider,
        )
        self._core = build_core(**self._core_arguments)
        self._bind_publish()
        self._start()

    def _bind_publish(self) -> None:
        """With OpenTelemetry on, make ``publish`` the core's traced one; without it, the sync client's
        ``publish`` is the core's own function
        (:meth:`~hedgepub._publisher.core._PublisherCore.sync_publish`), called without a method of the
        client in between."""
        telemetry = self._core.telemetry
        if self._sync_futures:
            #: The core's publish function (it refers to the core, not to the client).
            self._publish_function = self._core.sync_publish()
        if telemetry is None:
            if self._sync_futures:
                self.publish = self._publish_function
        else:
            # Traced publishing replaces publish on this instance only: an untraced client runs the
            # plain method, with not even a check for telemetry on its hot path.
            plain = type(self).publish.__get__(self)
            self.publish = (
                telemetry.traced_sync_publish(plain)
                if self._sync_futures
                else telemetry.traced_async_publish(plain)
            )

    def _start(self) -> None:
        """Run once the core exists (the sync client starts its loop thread here)."""

    topic_path = staticmethod(topic_path)

    @classmethod
    def from_service_account_file(
        cls, filename: str, batch_settings: Any = _DEFAULT_BATCH, **kwargs: Any
    ) -> Any:
        """A client authenticated as the service account whose JSON key is ``filename`` (the official
        client's constructor of the same name; ``from_service_account_json`` is the same)."""
        from google.oauth2 import service_account

        from hedgepub._transport.grpc import SCOPES

        kwargs["credentials"] = service_account.Credentials.from_service_account_file(filename, scopes=SCOPES)
        return cls(batch_settings=batch_settings, **kwargs)

    from_service_account_json = from_service_account_file

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the client lacks: say where the official client's other methods went.
        if name in _OFFICIAL_ADMIN_METHODS:
            raise AttributeError(
                f"{type(self).__name__} publishes only; {name}() is an admin call of the official client: "
                f"use google.cloud.pubsub_v1.PublisherClient().{name}(...) for it"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def resume_publish(self, topic: str, ordering_key: str) -> None:
        """Resume publishing on ``ordering_key`` after a failure paused it."""
        self._core.resume(topic, ordering_key)

    def stats(self) -> PublisherStats:
        """A snapshot of the publisher's counters and batch latency percentiles."""
        return self._core.stats()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(state={self._core.state.value}, hedging={self._core.hedging!r})"


class AsyncPublisherClient(_ClientFacade):
    """Publish to Pub/Sub from asyncio, with optional hedging of slow publishes.

    ``message_id = await publisher.publish(topic, b"data", **attributes)`` waits for the batch that
    carries the message; run many publishes concurrently (tasks, ``asyncio.gather``) to batch them.
    The client binds to the event loop it is first used on. See :class:`PublisherClient` for the
    arguments.
    """

    _sync_futures = False
    #: Whether :meth:`_use_plain` has run (on the loop the client is bound to).
    _plain_checked = False

    def publish(
        self, topic: str, data: bytes, ordering_key: str = "", **attributes: Any
    ) -> Coroutine[Any, Any, str]:
        """Publish one message; ``await`` the result for its message ID, once its batch is published.

        Called on the client's event loop, the message goes into its batch at once, and what comes back
        is the message's future (an ``asyncio.Future`` that is a coroutine too): ``await`` it, hand many
        to ``asyncio.gather`` (which takes futures as they are: no task per message), or to
        ``asyncio.create_task`` or a ``TaskGroup``. Called with no loop running (as in
        ``asyncio.run(publisher.publish(...))``), or with flow control on (which may have to wait for
        room), it is a coroutine that publishes when it runs. Either way the errors below are raised
        where the result is awaited.

        Raises:
            TypeError: ``data`` is not bytes, or an attribute value is not text.
            ValueError: an ordering key without message ordering, or a message too large for a request.
            RuntimeError: the publisher has been shut down, or is used from a second event loop.
            FlowControlLimitError: flow control is set to ERROR and a limit would be passed.
            PublishError: the publish failed (RpcError, PublishTimeoutError, OrderingKeyPausedError, ...).
        """
        return self._publish_any(topic, data, ordering_key, attributes)

    def _publish_any(self, topic: str, data: bytes, ordering_key: str, attributes: dict[str, Any]) -> Any:
        """:meth:`publish` for any message; on first use on a loop, make ``publish`` the core's plain
        function (:meth:`~hedgepub._publisher.core._PublisherCore.plain_publish`) where it may be."""
        core = self._core
        if not core.flow.enabled:
            loop = asyncio._get_running_loop()  # None, not an error, outside a loop
            if loop is not None:
                try:
                    if core._loop is not loop or not self._plain_checked:
                        core.bind_running_loop()
                        self._use_plain(loop)
                    message, size, framed = core.prepare(topic, data, ordering_key, attributes)
                    future = core.add(topic, data, ordering_key, message, size, framed)
                except Exception as error:  # raised where it is awaited, as from a coroutine
                    return _raising(error)
                return future
        return self._publish_when_run(topic, data, ordering_key, attributes)

    def _use_plain(self, loop: asyncio.AbstractEventLoop) -> None:
        """Once bound to ``loop``: ``publish`` becomes the core's plain function, which puts a message of
        data alone into its batch in one call, if the core is plain (no flow control, no idempotency
        keys), untraced, and ``loop`` an asyncio ``BaseEventLoop`` (whose thread it checks)."""
        self._plain_checked = True
        core = self._core
        if core.plain and core.telemetry is None and isinstance(loop, asyncio.BaseEventLoop):
            self.publish = core.plain_publish(self._publish_any, loop)  # type: ignore[method-assign]  # on this instance only

    async def _publish_when_run(
        self, topic: str, data: bytes, ordering_key: str, attributes: dict[str, Any]
    ) -> str:
        """:meth:`publish` as a coroutine: no loop was running, or flow control may have to wait."""
        core = self._core
        core.bind_running_loop()
        message, size, framed = core.prepare(topic, data, ordering_key, attributes)
        if core.flow.enabled:
            await core.flow.acquire_async(size, core.flush_soon)
            future = core.add_admitted(topic, data, ordering_key, message, size, framed)
        else:
            future = core.add(topic, data, ordering_key, message, size, framed)
        message_id: str = await future
        return message_id

    async def publish_many(self, topic: str, messages: Iterable[Any], ordering_key: str = "") -> list[str]:
        """Publish many messages at once; return their message IDs, in order, once all are published.

        See :meth:`PublisherClient.publish_many` for the messages it takes and what it raises; here the
        call waits for the outcome, and raises :class:`~hedgepub.PublishManyError` if any message failed.
        """
        core = self._core
        loop = core.bind_running_loop()
        if core.state is not ClientState.OPEN:
            raise RuntimeError(core.refusal)
        many = core.prepare_many(topic, messages, ordering_key)
        result = ManyResult(loop.create_future(), len(many.payloads))
        if core.bulk_ok() and not many.keyed:
            core.add_many(topic, many, result)
        elif core.telemetry is not None:  # a span per message: publish() each
            elements = many.one_by_one()
            outcomes = await asyncio.gather(
                *(self.publish(topic, data, key, **attributes) for data, key, attributes in elements),
                return_exceptions=True,
            )
            for index, outcome in enumerate(outcomes):
                if isinstance(outcome, BaseException):
                    result.failed(index, 1, outcome)
                else:
                    result.resolved(index, (outcome,))
        else:
            elements = many.one_by_one()
            for index, (data, key, attributes) in enumerate(elements):
                try:
                    message, size, framed = core.prepare(topic, data, key, attributes)
                    if core.flow.enabled:
                        await core.flow.acquire_async(size, core.flush_soon)
                        future = core.add_admitted(topic, data, key, message, size, framed)
                    else:
                        future = core.add(topic, data, key, message, size, framed)
                except Exception as refused:  # shut down, or refused by flow control: so are the rest
                    result.failed(index, len(elements) - index, refused)
                    break
                future.add_done_callback(result.one_done(index))
        return await result.future

    async def shutdown(self, timeout: float | None = None) -> None:
        """Stop accepting messages, publish every pending batch and wait for every message.

        With ``timeout`` (seconds), messages still unpublished when it runs out fail with
        :class:`~hedgepub.ShutdownTimeoutError` and their attempts are cancelled. Calling it again waits
        for the first call.
        """
        core = self._core
        if core._loop is None:
            core.bind_running_loop()
        await core.shutdown(timeout)

    async def __aenter__(self) -> AsyncPublisherClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()


async def _raising(error: Exception) -> str:
    """A coroutine that raises ``error`` (what :meth:`AsyncPublisherClient.publish` returns for a message
    it refused, so that the error is raised where the result is awaited)."""
    raise error


class _Keepalive:
    """The token a :class:`PublisherClient`'s finalizer watches (see ``PublisherClient._start``)."""

    __slots__ = ("__weakref__",)


class PublisherClient(_ClientFacade):
    """Publish to Pub/Sub from any thread, with optional hedging of slow publishes.

    ``publisher.publish(topic, b"data", **attributes)`` returns a :class:`concurrent.futures.Future`
    whose result is the message ID. The client runs its asyncio core on a private event-loop thread;
    it is thread-safe. Leave the ``with`` block or call :meth:`shutdown` to flush and wait. A client that
    is never shut down is still flushed, with ``shutdown(timeout=min(total_timeout, 30 s))`` (see
    :data:`IMPLICIT_SHUTDOWN_TIMEOUT`), or at most 5 s while its endpoint cannot be reached: when the
    interpreter exits normally, or in the background once the client is garbage-collected, which a pending
    publish prevents (``PublisherClient().publish(topic, b"x").result()`` returns the ID). ``os._exit``
    and fatal signals skip that.

    Only ``batch_settings`` and ``publisher_options`` may be passed by position, in that order, as in the
    official client; every other argument is passed by name.

    Args:
        batch_settings: when a batch is sent (count, bytes, latency).
        hedging_settings: hedge slow batches per these settings; ``None`` (default) turns hedging off.
        retry_settings: retry codes, back-off, per-attempt and total timeouts.
        flow_control: limits on outstanding messages and what to do at the limit.
        enable_message_ordering: deliver messages with the same ordering key in order; with hedging on,
            batches with an ordering key are never hedged (unkeyed ones are).
        endpoint: ``"host:port"`` to connect to; see :mod:`hedgepub._transport.grpc` for TLS or plain text.
            Default: ``PUBSUB_EMULATOR_HOST`` if set, else Google Cloud Pub/Sub. A host without a port
            (``"localhost"``) is a ``ValueError``, except Google's own (``*.googleapis.com``: TLS on 443).
        credentials: google-auth credentials for a TLS endpoint; default Application Default Credentials.
        hedge_endpoints: other endpoints of the same service (``"europe-west1-pubsub.googleapis.com"``)
            that hedges go to, in turn, instead of the primary; originals and retries stay on the
            primary, and every endpoint shares the credentials and the token bucket. Needs
            ``hedging_settings``. An unreachable one fails only the hedges sent there. See
            :mod:`hedgepub._publisher.routes`.
        channel_pool_size: how many connections (each its own TCP connection) each endpoint gets, a
            whole number from 1 to 16; default 2. Originals take them in turn, a hedge or a retry one
            that none of its batch's running attempts uses, and a connection that goes silent is left
            within about a second and replaced (docs/hedging.md, rules 23-26). 1 is a single connection.
        idempotency_attribute: ``True`` stamps every message with a unique key in the attribute
            ``hedgepub-idempotency-key`` (a name picks another attribute), the same on every hedged or
            retried copy, so that consumers can drop copies with :class:`hedgepub.dedup.Deduplicator`.
            A value the caller sets for that attribute is kept. Off by default.
        transport, hedge_transports: ready-made transports instead of gRPC channels (tests); a sequence
            of transports in their place is a pool of that many connections.
        publisher_options: the official client's ``google.cloud.pubsub_v1.types.PublisherOptions``
            (ordering, flow control, retry, timeout, OpenTelemetry), translated to the settings above.
        client_options: the official client's ``client_options`` (``api_endpoint``, ``credentials_file``).
        root_certificates: PEM certificates to trust for a TLS endpoint instead of the system's (a private
            CA, or ``hedgepub serve --tls-cert``).
        enable_open_telemetry: emit OpenTelemetry spans (compatible with the official client's) and metrics
            through the OpenTelemetry API; see :mod:`hedgepub._publisher.telemetry`. Off by default.
        tracer_provider, meter_provider: where the spans and metrics go with ``enable_open_telemetry``;
            default: the global providers.

    ``batch_settings`` also takes the official ``types.BatchSettings``, so that code written for
    ``google.cloud.pubsub_v1.PublisherClient`` runs unchanged; see :mod:`.migration` for what
    maps and what is refused.
    """

    _sync_futures = True

    def _start(self) -> None:
        retry = self._core.retry
        self._runner = _LoopThread(self._core, min(retry.total_timeout, IMPLICIT_SHUTDOWN_TIMEOUT))
        # What the finalizer watches instead of the client itself: held by the client, by its publish
        # function (so that `PublisherClient().publish(...)` keeps it for the call) and by every pending
        # batch (core._new_batch), so that a client nobody references is shut down only once none of its
        # publishes is pending. Neither the runner nor the core holds it (the core only weakly), and the
        # publish function is in the client's own dict, so a dropped client with nothing pending is still
        # finalized at once, without waiting for the cycle collector.
        keepalive = self._keepalive = _Keepalive()
        self._core.keepalive = weakref.ref(keepalive)
        self._publish_function.keepalive = keepalive  # type: ignore[attr-defined]  # set on the function
        # Dropped without shutdown(): flush in the background. The runner holds no reference back to the
        # client, so the finalizer does not keep the client alive.
        self._finalizer = weakref.finalize(keepalive, self._runner.release)
        self._finalizer.atexit = False  # at exit, _flush_at_exit flushes every open client at once
        _SYNC_CLIENTS.add(self)

    def _after_fork_in_child(self) -> None:
        """This process was just forked from the one that made the client (see :data:`FORK_REFUSAL`).

        The loop thread did not survive the fork. If the client never connected (its gRPC channel opens
        on the first publish), the child gets a fresh core and loop thread and publishes on its own;
        otherwise the client refuses to publish, at once, with :data:`FORK_REFUSAL`. Either way the
        futures inherited from the parent fail at once, and nothing waits for the lost thread, neither
        ``shutdown()`` nor the flush at exit.
        """
        self._finalizer.detach()
        self._runner.abandon()
        core = self._core
        error = _inherited_error()
        reusable = core.state is ClientState.OPEN and not core.routes.connected
        core.abandon_after_fork(error, FORK_REFUSAL if core.state is ClientState.OPEN else core.refusal)
        if reusable:
            self._core = build_core(**self._core_arguments)
            self._bind_publish()  # spans and metrics of the child's own core
            self._start()

    def publish(
        self, topic: str, data: bytes, ordering_key: str = "", **attributes: Any
    ) -> concurrent.futures.Future[str]:
        """Publish one message; the future's result is its message ID.

        Raises at once (the future carries publish failures):
            TypeError: ``data`` is not bytes, or an attribute value is not text.
            ValueError: an ordering key without message ordering, or a message too large for a request.
            RuntimeError: the publisher has been shut down.
            FlowControlLimitError: flow control is set to ERROR and a limit would be passed.
        """
        # An untraced client calls the core's function directly (see _bind_publish): this method runs for
        # a traced one, or when called through the class.
        return self._publish_function(topic, data, ordering_key, **attributes)

    def publish_many(
        self, topic: str, messages: Iterable[Any], ordering_key: str = ""
    ) -> concurrent.futures.Future[list[str]]:
        """Publish many messages at once; one future whose result is their message IDs, in order.

        Each message is ``bytes`` (data alone), a ``(data, attributes)`` tuple (``attributes`` a mapping of
        text to text), or an object with ``data`` and optionally ``attributes`` and ``ordering_key``, such
        as ``google.pubsub_v1.types.PubsubMessage``; ``ordering_key`` applies to every message that has no
        key of its own. The messages go into batches as :meth:`publish` would put them, in order, with the
        same batch settings, hedging, retries, flow control and ordering keys; without flow control,
        OpenTelemetry or ordering keys they go in as runs, as many at once as fit each batch, with no
        future per message.

        The future resolves once every message has its outcome: the list of message IDs, or
        :class:`~hedgepub.PublishManyError` if any failed, which gives each message's ID (``None`` where it
        failed) and each failed message's error.

        Raises at once, having published nothing:
            TypeError: ``messages`` is not a sequence of messages, or ``messages[i]`` is not one (bytes, a
                tuple, an object with ``data``), or has data that is not bytes or an attribute that is not
                text; the error names ``i``.
            ValueError: ``messages[i]`` has an ordering key without message ordering, or is too large.
            RuntimeError: the publisher has been shut down.

        If the publisher is shut down (or flow control set to ``ERROR`` refuses a message) part way
        through, the messages not in a batch yet fail in the future with that error.
        """
        core = self._core
        if core.state is not ClientState.OPEN:
            raise RuntimeError(core.refusal)
        many = core.prepare_many(topic, messages, ordering_key)
        result = ManyResult(concurrent.futures.Future(), len(many.payloads))
        if core.bulk_ok() and not many.keyed:
            core.add_many(topic, many, result)
            return result.future
        publish = self.publish
        elements = many.one_by_one()
        for index, (data, key, attributes) in enumerate(elements):
            try:
                future = publish(topic, data, key, **attributes)
            except Exception as refused:  # shut down, or refused by flow control: so are the rest
                result.failed(index, len(elements) - index, refused)
                break
            future.add_done_callback(result.one_done(index))
        return result.future

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop accepting messages, publish every pending batch, wait for every message, stop the thread.

        With ``timeout`` (seconds), messages still unpublished when it runs out fail with
        :class:`~hedgepub.ShutdownTimeoutError` and their attempts are cancelled. No future is left
        pending. Safe to call more than once.
        """
        if threading.get_ident() == self._core._loop_thread:
            raise RuntimeError("shutdown() cannot be called from a publish future's callback")
        try:
            self._runner.close(timeout)
        finally:
            self._finalizer.detach()

    def stop(self) -> None:
        """:meth:`shutdown` under the official client's name: flush, wait for every message, stop."""
        self.shutdown()

    def __enter__(self) -> PublisherClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


#: Every sync client alive, for _after_fork_in_child.
_SYNC_CLIENTS: weakref.WeakSet[PublisherClient] = weakref.WeakSet()

#: Why a forked child may not publish with a client whose gRPC channel was open at the fork.
FORK_REFUSAL = (
    "this PublisherClient had connected (published) before os.fork(): gRPC cannot go on in a child "
    "forked while a channel was open, and a new client made in this child would hang or crash in gRPC "
    "as well (GRPC_ENABLE_FORK_SUPPORT does not cover the asyncio channels hedgepub uses). Publish from a "
    "process that is no such fork: start workers with multiprocessing's 'spawn' or 'forkserver' method "
    "(multiprocessing.get_context('spawn')), or fork before the first publish (create the client before "
    "the fork, publish only after it: gunicorn --preload and prefork pools forked at start work that "
    "way), or shut every client down before forking (a client made in the child then works)"
)


def _inherited_error() -> PublishError:
    """What a future inherited from the parent fails with in a forked child."""
    return PublishError(
        f"published before os.fork() in process {os.getppid()}, which sends it; this copy of the "
        "future, in the child, cannot learn the outcome"
    )


def _after_fork_in_child() -> None:
    """Registered with ``os.register_at_fork``: make every sync client safe in the new child process."""
    runners = forget_open_runners()
    clients = list(_SYNC_CLIENTS)
    owned = {id(client._runner) for client in clients}
    for client in clients:
        try:
            client._after_fork_in_child()
        except Exception:  # one client's trouble must not break the others, nor the fork
            _LOGGER.exception("hedgepub: making a publisher safe after os.fork() failed")
    for runner in runners:
        if id(runner) in owned:
            continue
        # A client dropped while publishes were pending (they keep its core running): no client is left
        # to abandon them, so fail the inherited futures here.
        try:
            runner.abandon()
            runner.core.abandon_after_fork(_inherited_error(), FORK_REFUSAL)
        except Exception:
            _LOGGER.exception("hedgepub: making a dropped publisher safe after os.fork() failed")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
