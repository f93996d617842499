"""Push delivery: each push subscription's messages POSTed to its endpoint, as the real service does.

A :class:`PushWorker` per push subscription leases messages from the subscription's delivery state (the
same leases, ack IDs, ordering, retry back-off and dead-letter policy as Pull) and POSTs each one with
``aiohttp``. What the real service documents, and this follows:

- **Body.** Wrapped (the default): a JSON object with ``message`` (the proto3 JSON form of the message:
  base64 ``data``, ``attributes``, ``messageId``, ``publishTime``, ``orderingKey``, plus the snake_case
  ``message_id`` and ``publish_time`` the service also sends), ``subscription`` and, with a dead-letter
  policy, ``deliveryAttempt``. Unwrapped (``no_wrapper``): the message data is the body; with
  ``write_metadata`` the attributes become headers, beside ``x-goog-pubsub-subscription-name``,
  ``x-goog-pubsub-message-id``, ``x-goog-pubsub-publish-time`` (and ``x-goog-pubsub-ordering-key``).
- **Acknowledgement.** An answer of 102, 200, 201, 202 or 204 acknowledges the message; any other status
  (a redirect too: it is not followed), a connection failure, or no answer within the subscription's
  ack deadline is a nack, which goes through the subscription's retry policy (back-off per message) and
  dead-letter policy like a Pull consumer's nack. At most :data:`MAX_RESPONSE_BODY_BYTES` of an answer's
  body are read; the connection of a longer one is closed rather than drained.
- **Push back-off.** After a failure the subscription stops delivering for a while, then tries again:
  100 ms after the first failure, doubling with each failure that follows (a failure of a request sent
  before the pause began does not double it again), at most 60 s, and back to none after a success. The
  real service documents this range (100 ms to 60 s) for its push back-off, not the exact steps.
- **Authentication.** With ``oidc_token.service_account_email`` set, each request carries
  ``Authorization: Bearer <ID token>`` for that account and ``oidc_token.audience`` (the endpoint URL
  when empty), signed with the server's own key (see :mod:`hedgepub.server._pubsub.oidc`). A token that cannot
  be made (a key file that cannot be written) fails the push like an endpoint that does not answer.
- **Delivery rate.** Concurrent requests are limited by a window (the real service's "push window",
  with slow start): it starts small, grows by one with each success up to :data:`MAX_WINDOW`, and is
  halved by each failure.

Messages stay unacknowledged in the store until the endpoint acknowledges them, so an endpoint that is
down, or a server that is killed, loses nothing: they are pushed again once it answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Sequence
from typing import Any, Protocol

import aiohttp
from google.protobuf import json_format

from hedgepub._clock import Clock
from hedgepub.server._pubsub.delivery import SubscriptionState
from hedgepub.server._pubsub.leases import Consumer
from hedgepub.server._pubsub.limits import ServiceError
from hedgepub.server._pubsub.oidc import PushTokenSigner

logger = logging.getLogger("hedgepub.server")

#: HTTP statuses that acknowledge a pushed message.
SUCCESS_STATUSES = frozenset({102, 200, 201, 202, 204})
#: Most of a push answer's body read (only its status counts); the rest is not read: the connection is
#: closed instead, so that an endpoint answering with a huge body costs no memory.
MAX_RESPONSE_BODY_BYTES = 64 * 1024
#: Push back-off after failures: first pause and largest pause, in seconds.
MIN_PUSH_BACKOFF_SECONDS = 0.1
MAX_PUSH_BACKOFF_SECONDS = 60.0
#: Concurrent requests per subscription: at first, and at most.
INITIAL_WINDOW = 4
MAX_WINDOW = 100

# Attributes that can travel as HTTP headers unchanged (a token name, a value without controls).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e]*")


class PushHost(Protocol):
    """What a worker needs from the core."""

    def push_state(self, subscription: str) -> SubscriptionState | None:
        """The subscription's delivery state while it is a deliverable push subscription, else ``None``."""

    async def lease(self, state: SubscriptionState, consumer: Consumer, max_messages: int) -> list[Any]:
        """Lease up to ``max_messages`` ready messages to ``consumer`` (``ReceivedMessage`` list)."""

    async def acknowledge(self, subscription: str, ack_ids: Sequence[str]) -> dict[str, str] | None:
        """Acknowledge (durably). What it returns (:meth:`.Consumers.acknowledge`'s failures) is not read."""

    def modify_ack_deadline(self, subscription: str, ack_ids: Sequence[str], seconds: int) -> None:
        """0: nack."""


def push_request(config: Any, received: Any) -> tuple[bytes, dict[str, str]]:
    """The body and headers of the POST that delivers ``received`` for subscription ``config``."""
    message = received.message
    push_config = config.push_config
    if push_config.HasField("no_wrapper"):
        headers: dict[str, str] = {}
        if push_config.no_wrapper.write_metadata:
            for key, value in message.attributes.items():
                # An attribute that HTTP cannot carry as a header is left out rather than failing the push.
                if _HEADER_NAME.fullmatch(key) and _HEADER_VALUE.fullmatch(value):
                    headers[key] = value
            headers["x-goog-pubsub-subscription-name"] = config.name
            headers["x-goog-pubsub-message-id"] = message.message_id
            headers["x-goog-pubsub-publish-time"] = message.publish_time.ToJsonString()
            if message.ordering_key and _HEADER_VALUE.fullmatch(message.ordering_key):
                headers["x-goog-pubsub-ordering-key"] = message.ordering_key
        return bytes(message.data), headers
    wrapped = json_format.MessageToDict(message)
    wrapped["message_id"] = message.message_id
    wrapped["publish_time"] = wrapped.get("publishTime", "")
    body: dict[str, Any] = {"message": wrapped, "subscription": config.name}
    if received.delivery_attempt:
        body["deliveryAttempt"] = received.delivery_attempt
    return json.dumps(body).encode(), {"Content-Type": "application/json"}


class PushWorker:
    """Pushes one subscription's messages to its endpoint until stopped (or it stops being push)."""

    def __init__(
        self,
        host: PushHost,
        subscription: str,
        session: aiohttp.ClientSession,
        clock: Clock,
        tokens: PushTokenSigner,
    ) -> None:
        self.host = host
        self.subscription = subscription
        self._session = session
        self._clock = clock
        self._tokens = tokens
        self.window = INITIAL_WINDOW
        self.backoff = 0.0
        self._paused_until = 0.0
        #: Counts pauses; a failure doubles the back-off only if its request was sent after the last one.
        self._epoch = 0
        self._deliveries: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self.delivered = 0
        self.failed = 0

    def start(self) -> None:
        """Start the loop on the running event loop."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Stop: no new requests; those in flight are cancelled and their messages nacked at once."""
        tasks = [task for task in (self._task, *self._deliveries) if task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._task = None

    async def _run(self) -> None:
        # One outstanding message per ordering key, as the real service pushes ordered messages.
        consumer = Consumer(1.0, max_messages=self.window, one_per_key=True)
        while True:
            try:
                if not await self._step(consumer):
                    return
            except Exception:  # not CancelledError: stop() ends the loop
                # A failing store must not end push delivery for good: say so, wait, and go on.
                logger.exception("Push delivery of %s failed; retrying in 1 s.", self.subscription)
                await self._clock.sleep(1.0)

    async def _step(self, consumer: Consumer) -> bool:
        """Lease what the window allows and start pushing it (or wait); False once it is not push."""
        state = self.host.push_state(self.subscription)
        if state is None:
            return False
        pause = self._paused_until - self._clock.now()
        if pause > 0:
            await self._clock.sleep(pause)
            return True
        consumer.ack_deadline = float(state.config.ack_deadline_seconds)
        consumer.max_messages = self.window
        room = consumer.room()
        batch = await self.host.lease(state, consumer, room) if room else []
        if not batch:
            # Woken by new messages, acks, nacks and expiries: everything that frees the window.
            await state.wait_changed()
            return True
        for received in batch:
            task = asyncio.ensure_future(self._deliver(state.config, received))
            self._deliveries.add(task)
            task.add_done_callback(self._deliveries.discard)
        return True

    async def _deliver(self, config: Any, received: Any) -> None:
        epoch = self._epoch
        ack_id = received.ack_id
        try:
            status = await self._post(config, received)
        except asyncio.CancelledError:
            self._nack(ack_id)
            raise
        if status in SUCCESS_STATUSES:
            try:
                await self.host.acknowledge(self.subscription, [ack_id])
            except ServiceError:  # the subscription went meanwhile
                return
            except Exception:  # the store failed: the message stays stored, and is pushed again later
                logger.exception("Acknowledging a pushed message of %s failed.", self.subscription)
                return
            self.delivered += 1
            self.backoff = 0.0
            self.window = min(MAX_WINDOW, self.window + 1)
            return
        self.failed += 1
        self._nack(ack_id)
        self.window = max(1, self.window // 2)
        if epoch == self._epoch:
            self._epoch += 1
            self.backoff = min(MAX_PUSH_BACKOFF_SECONDS, max(MIN_PUSH_BACKOFF_SECONDS, self.backoff * 2))
            self._paused_until = self._clock.now() + self.backoff

    async def _post(self, config: Any, received: Any) -> int | None:
        """POST one message; the HTTP status, or ``None`` if no answer came (in time)."""
        body, headers = push_request(config, received)
        endpoint = config.push_config.push_endpoint
        oidc = config.push_config.oidc_token
        if oidc.service_account_email:
            try:
                token = await self._tokens.token(oidc.service_account_email, oidc.audience or endpoint)
            except Exception:
                logger.exception("No OIDC token for a push of %s: not sent.", self.subscription)
                return None
            # An attribute sent as a header (write_metadata) does not stand in for the token.
            for name in [name for name in headers if name.lower() == "authorization"]:
                del headers[name]
            headers["Authorization"] = f"Bearer {token}"
        timeout = aiohttp.ClientTimeout(total=float(config.ack_deadline_seconds))
        try:
            async with self._session.post(
                endpoint, data=body, headers=headers, timeout=timeout, allow_redirects=False
            ) as response:
                await _discard_body(response)
                return response.status
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as error:
            logger.debug("Push to %s failed: %r", endpoint, error)
            return None

    def _nack(self, ack_id: str) -> None:
        # ServiceError: the subscription went meanwhile, and there is nothing to give back.
        with contextlib.suppress(ServiceError):
            self.host.modify_ack_deadline(self.subscription, [ack_id], 0)

    def __repr__(self) -> str:
        return (
            f"PushWorker({self.subscription!r}, window={self.window}, backoff={self.backoff:g}s, "
            f"delivered={self.delivered}, failed={self.failed})"
        )


async def _discard_body(response: aiohttp.ClientResponse) -> None:
    """Read and drop a small answer body, so the connection is kept; close the connection of a big one."""
    remaining = MAX_RESPONSE_BODY_BYTES
    while remaining > 0:
        chunk = await response.content.read(remaining)
        if not chunk:
            return
        remaining -= len(chunk)
    if not response.content.at_eof():
        response.close()


class PushDispatcher:
    """Starts and stops one :class:`PushWorker` per push subscription; owns the HTTP session.

    ``tokens`` signs the OIDC tokens of subscriptions that ask for them (default: a key in memory).
    """

    def __init__(self, host: PushHost, clock: Clock, tokens: PushTokenSigner | None = None) -> None:
        self.host = host
        self._clock = clock
        self.tokens = tokens if tokens is not None else PushTokenSigner(None)
        self.workers: dict[str, PushWorker] = {}
        self._session: aiohttp.ClientSession | None = None
        self._stopping: set[asyncio.Task[None]] = set()

    def sync(self, subscription: str) -> None:
        """Run a worker for ``subscription`` exactly while it is a push subscription (call after changes)."""
        worker = self.workers.get(subscription)
        if self.host.push_state(subscription) is None:
            if worker is not None:
                del self.workers[subscription]
                stopping = asyncio.ensure_future(worker.stop())
                self._stopping.add(stopping)
                stopping.add_done_callback(self._stopping.discard)
            return
        if worker is None:
            if self._session is None:
                connector = aiohttp.TCPConnector(limit=0, limit_per_host=MAX_WINDOW)
                self._session = aiohttp.ClientSession(connector=connector)
            worker = PushWorker(self.host, subscription, self._session, self._clock, self.tokens)
            self.workers[subscription] = worker
            worker.start()

    async def close(self) -> None:
        """Stop every worker and close the HTTP session."""
        workers, self.workers = list(self.workers.values()), {}
        for worker in workers:
            await worker.stop()
        if self._stopping:
            await asyncio.gather(*self._stopping, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
