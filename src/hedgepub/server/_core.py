"""The Pub/Sub core: topics, subscriptions and message delivery, with no gRPC in sight.

All state lives on one event loop; nothing here is thread-safe. The service layer calls these methods
with raw protobuf requests and turns :class:`ServiceError` into status codes.

Delivery model (at-least-once, as the real service):

- A published message is appended to every subscription attached to its topic ("fan-out"), after the
  store has made it durable.
- Each subscription has a ``ready`` queue. Delivering a message leases it under a fresh ack ID until a
  deadline; acknowledging drops it, a modify-deadline of 0 (nack) or the deadline passing puts it back
  at the front of ``ready``. Deadlines are kept in a heap and expired by a timer on the clock, so a
  lease runs out even when nobody pulls.
- With message ordering, only the oldest unacknowledged message of each ordering key is ever ready or
  leased; the next one of that key becomes ready when it is acknowledged.
- With a dead-letter policy, ``delivery_attempt`` is counted. When a message that has been delivered
  ``max_delivery_attempts`` times is nacked or its deadline passes, it is forwarded to the dead-letter
  topic in the background (nobody needs to pull), as the real service does: the copy is stored before
  the ack on the source subscription, so a crash in between duplicates it and never loses it, and a
  forwarding that fails puts it back up for delivery.
"""

from __future__ import annotations

import asyncio
import base64
import heapq
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from google.iam.v1 import policy_pb2
from google.protobuf import duration_pb2, field_mask_pb2
from google.pubsub_v1.types import pubsub as pubsub_types

from hedgepub._clock import DEFAULT_CLOCK, Clock, TimerHandle
from hedgepub._status import StatusCode
from hedgepub.server import _limits as limits
from hedgepub.server._limits import ServiceError, invalid, not_found
from hedgepub.server._schemas import SchemaRegistry
from hedgepub.server._store import Snapshot, Store, StoredMessage

logger = logging.getLogger("hedgepub.server")

Topic: Any = pubsub_types.Topic.pb()
Subscription: Any = pubsub_types.Subscription.pb()
PubsubMessage: Any = pubsub_types.PubsubMessage.pb()
ReceivedMessage: Any = pubsub_types.ReceivedMessage.pb()
Policy: Any = policy_pb2.Policy

_TOPIC_UPDATABLE = frozenset(
    {
        "labels",
        "message_storage_policy",
        "kms_key_name",
        "schema_settings",
        "message_retention_duration",
        "ingestion_data_source_settings",
        "message_transforms",
    }
)
_SUBSCRIPTION_UPDATABLE = frozenset(
    {
        "push_config",
        "bigquery_config",
        "cloud_storage_config",
        "ack_deadline_seconds",
        "retain_acked_messages",
        "message_retention_duration",
        "labels",
        "expiration_policy",
        "dead_letter_policy",
        "retry_policy",
        "enable_exactly_once_delivery",
        "message_transforms",
    }
)
#: Largest batch handed out at once (one Pull response or one StreamingPull response).
MAX_MESSAGES_PER_RESPONSE = 1000
_MAX_BYTES_PER_RESPONSE = 10_000_000


def _seconds(duration: Any) -> float:
    return duration.seconds + duration.nanos / 1e9


class Consumer:
    """Who receives a delivery: a Pull call or a StreamingPull stream, with its flow-control window."""

    __slots__ = (
        "ack_deadline",
        "closed",
        "max_bytes",
        "max_messages",
        "outstanding_bytes",
        "outstanding_messages",
    )

    def __init__(self, ack_deadline: float, max_messages: int = 0, max_bytes: int = 0) -> None:
        self.ack_deadline = ack_deadline
        self.max_messages = max_messages  # 0: no limit
        self.max_bytes = max_bytes  # 0: no limit
        self.outstanding_messages = 0
        self.outstanding_bytes = 0
        self.closed = False

    def room(self) -> int:
        """How many more messages this consumer may hold now (a large number when unlimited)."""
        if self.max_bytes and self.outstanding_bytes >= self.max_bytes:
            return 0
        if self.max_messages:
            return max(0, self.max_messages - self.outstanding_messages)
        return MAX_MESSAGES_PER_RESPONSE


class _Pending:
    """One message waiting on one subscription."""

    __slots__ = ("attempts", "message", "sequence", "size")

    def __init__(self, sequence: int, message: Any) -> None:
        self.sequence = sequence
        self.message = message
        self.attempts = 0
        self.size = message.ByteSize()


class _Lease:
    """A delivered, unacknowledged message: who holds it and until when."""

    __slots__ = ("ack_id", "active", "consumer", "deadline", "pending", "state")

    def __init__(
        self, ack_id: str, pending: _Pending, consumer: Consumer, deadline: float, state: _SubscriptionState
    ) -> None:
        self.ack_id = ack_id
        self.state = state
        self.pending = pending
        self.consumer = consumer
        self.deadline = deadline
        self.active = True


class _SubscriptionState:
    """Live delivery state of one subscription."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.ready: deque[_Pending] = deque()
        self.leases: dict[str, _Lease] = {}
        #: ordering key -> messages of that key waiting behind the one ready or leased.
        self.key_backlog: dict[str, deque[_Pending]] = {}
        self._waiters: set[asyncio.Future[None]] = set()
        #: messages on their way to the dead-letter topic: neither ready nor leased, not yet acknowledged.
        self.forwarding: set[_Pending] = set()
        self.deleted = False

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def ordered(self) -> bool:
        return self.config.enable_message_ordering

    @property
    def dead_letter_policy(self) -> Any | None:
        config = self.config
        return config.dead_letter_policy if config.HasField("dead_letter_policy") else None

    def notify(self) -> None:
        """Wake every consumer waiting on this subscription (they re-check what they can take)."""
        waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def wait_changed(self, timeout: float | None = None) -> bool:
        """Wait for the next :meth:`notify`; False if ``timeout`` seconds passed first.

        The waiter is registered before this coroutine first yields, so a caller that found nothing to
        take and then awaits this cannot miss a notify in between. (``wait_for(event.wait(), t)`` could:
        before Python 3.12 it runs ``event.wait()`` in a new task, one loop step later, and a message
        arriving in that step left a Pull asleep for its whole wait.)
        """
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            return False
        finally:
            self._waiters.discard(waiter)
        return True

    def add(self, records: Sequence[tuple[int, Any]]) -> None:
        """Append newly published (or reloaded) messages."""
        if self.ordered:
            backlog = self.key_backlog
            for sequence, message in records:
                pending = _Pending(sequence, message)
                key = message.ordering_key
                if not key:
                    self.ready.append(pending)
                elif key in backlog:
                    backlog[key].append(pending)
                else:
                    backlog[key] = deque()
                    self.ready.append(pending)
        else:
            self.ready.extend(_Pending(sequence, message) for sequence, message in records)
        self.notify()

    def finished(self, pending: _Pending) -> None:
        """A message left the subscription for good: release the next one of its ordering key."""
        if not self.ordered:
            return
        key = pending.message.ordering_key
        if not key:
            return
        waiting = self.key_backlog.get(key)
        if waiting is None:
            return
        if waiting:
            self.ready.append(waiting.popleft())
        else:
            del self.key_backlog[key]

    def backlog_size(self) -> int:
        waiting = sum(len(queue) for queue in self.key_backlog.values())
        return len(self.ready) + len(self.leases) + len(self.forwarding) + waiting


_Found = TypeVar("_Found")


def _existing(table: dict[str, _Found], name: str) -> _Found:
    """The topic or subscription called ``name`` (already checked), or NOT_FOUND."""
    found = table.get(name)
    if found is None:
        raise not_found(name)
    return found


def _check_retention(resource: Any, maximum: float, maximum_words: str) -> None:
    """A topic's or subscription's message_retention_duration: between 10 minutes and ``maximum``."""
    seconds = _seconds(resource.message_retention_duration)
    if not limits.MIN_RETENTION_SECONDS <= seconds <= maximum:
        raise invalid(
            f"Invalid message_retention_duration given: {seconds:g}s. It must be between 10 minutes and "
            f"{maximum_words}."
        )


def _page(names: list[str], page_size: int, page_token: str) -> tuple[list[str], str]:
    """One page of sorted ``names`` and the token of the next (empty when there is none)."""
    if page_size < 0:
        raise invalid(f"Invalid page_size given: {page_size}. It must not be negative.")
    size = min(page_size or limits.DEFAULT_PAGE_SIZE, limits.MAX_PAGE_SIZE)
    start = 0
    if page_token:
        try:
            after = base64.urlsafe_b64decode(page_token.encode("ascii")).decode("utf-8")
        except (ValueError, UnicodeError):
            raise invalid(f"Invalid page token given (page_token={page_token}).") from None
        if not after.startswith("after:"):
            raise invalid(f"Invalid page token given (page_token={page_token}).")
        after = after[len("after:") :]
        start = next((i for i, name in enumerate(names) if name > after), len(names))
    page = names[start : start + size]
    if start + size < len(names):
        token = base64.urlsafe_b64encode(f"after:{page[-1]}".encode()).decode("ascii")
        return page, token
    return page, ""


class PubSubCore:
    """Topics, subscriptions, IAM policies and delivery, written through to a :class:`Store`.

    ``clock`` drives leases and waits. ``wall_clock_ns`` is the calendar time in nanoseconds since the
    epoch, which ``publish_time`` and message retention are about; replace it (it is a plain attribute)
    to test retention without waiting for it.
    """

    def __init__(
        self, store: Store, clock: Clock = DEFAULT_CLOCK, wall_clock_ns: Callable[[], int] = time.time_ns
    ) -> None:
        self._store = store
        self._clock = clock
        self.wall_clock_ns = wall_clock_ns
        self._topics: dict[str, Any] = {}
        self._subscriptions: dict[str, _SubscriptionState] = {}
        self._attached: dict[str, dict[str, _SubscriptionState]] = {}
        self._policies: dict[str, Any] = {}
        self._next_sequence = 1
        # A per-process prefix keeps ack IDs handed out before a restart from matching new leases.
        self._ack_prefix = os.urandom(4).hex()
        self._ack_counter = itertools.count(1)
        self._deadlines: list[tuple[float, int, _Lease]] = []
        self._heap_counter = itertools.count()
        self._timer: TimerHandle | None = None
        self._timer_at = float("inf")
        self._background: set[asyncio.Task[Any]] = set()
        #: Schemas and their revisions (SchemaService); topics' schema_settings name them.
        self.schemas = SchemaRegistry(store, lambda: self.wall_clock_ns())

    # ----------------------------------------------------------------- lifecycle
    def load(self, snapshot: Snapshot | None = None) -> None:
        """Take back what the store holds (topics, subscriptions, policies, unacked messages)."""
        snapshot = snapshot if snapshot is not None else self._store.load()
        self._topics = dict(snapshot.topics)
        self._policies = dict(snapshot.policies)
        self.schemas.load(snapshot.schemas)
        self._next_sequence = snapshot.next_sequence
        self._subscriptions = {}
        self._attached = {}
        for name, config in snapshot.subscriptions.items():
            state = _SubscriptionState(config)
            self._subscriptions[name] = state
            if not config.detached and config.topic in self._topics:
                self._attached.setdefault(config.topic, {})[name] = state
            pending = snapshot.pending.get(name)
            if pending and not config.detached:
                state.add(pending)

    async def close(self) -> None:
        """Stop timers and background work, and close the store."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for state in self._subscriptions.values():
            state.deleted = True
            state.notify()
        await self._store.close()

    async def clear(self) -> None:
        """Delete every topic, subscription, policy and message."""
        for state in self._subscriptions.values():
            state.deleted = True
            state.notify()
        self._topics.clear()
        self._subscriptions.clear()
        self._attached.clear()
        self._policies.clear()
        self.schemas.clear()
        self._deadlines.clear()
        await self._store.clear()

    def messages(self, topic: str) -> list[StoredMessage]:
        """Every message stored on ``topic``, in publish order."""
        return [StoredMessage.from_pb(topic, message) for _, message in self._store.messages(topic)]

    def is_idle(self) -> bool:
        """No message is waiting or leased on any subscription."""
        return all(state.backlog_size() == 0 for state in self._subscriptions.values())

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ----------------------------------------------------------------- topics
    def _topic(self, name: str) -> Any:
        return _existing(self._topics, limits.check_topic_name(name))

    @staticmethod
    def _check_topic_fields(topic: Any) -> None:
        if topic.HasField("message_retention_duration"):
            _check_retention(topic, limits.MAX_TOPIC_RETENTION_SECONDS, "31 days")

    async def create_topic(self, request: Any) -> Any:
        """CreateTopic: the request is a ``Topic``."""
        name = limits.check_topic_name(request.name)
        if name in self._topics:
            raise limits.already_exists(name)
        self._check_topic_fields(request)
        if request.HasField("schema_settings"):
            self.schemas.check_settings(request.schema_settings)
        topic = Topic()
        topic.CopyFrom(request)
        topic.state = 0
        await self._store.put("topics", name, topic)
        if name in self._topics:  # created concurrently while we waited for the store
            raise limits.already_exists(name)
        self._topics[name] = topic
        # No subscription re-attaches to a re-created topic: the real service points the subscriptions
        # of a deleted topic at _deleted-topic_ for good.
        self._attached.setdefault(name, {})
        return topic

    def get_topic(self, name: str) -> Any:
        """GetTopic."""
        return self._topic(name)

    async def update_topic(self, update: Any, paths: Sequence[str]) -> Any:
        """UpdateTopic with a field mask."""
        current = self._topic(update.name)
        updated = _masked_update("Topic", current, update, paths, _TOPIC_UPDATABLE)
        self._check_topic_fields(updated)
        if updated.HasField("schema_settings") and updated.schema_settings != current.schema_settings:
            self.schemas.check_settings(updated.schema_settings)
        await self._store.put("topics", updated.name, updated)
        self._topics[updated.name] = updated
        return updated

    def list_topics(self, project: str, page_size: int, page_token: str) -> tuple[list[Any], str]:
        """ListTopics: one page of the project's topics, sorted by name."""
        page, token = _project_page(project, "topics", self._topics, page_size, page_token)
        return [self._topics[name] for name in page], token

    def list_topic_subscriptions(self, topic: str, page_size: int, page_token: str) -> tuple[list[str], str]:
        """ListTopicSubscriptions: names of the subscriptions attached to ``topic``."""
        self._topic(topic)
        return _page(sorted(self._attached.get(topic, {})), page_size, page_token)

    async def delete_topic(self, name: str) -> None:
        """DeleteTopic: subscriptions stay, pointing at ``_deleted-topic_``."""
        self._topic(name)
        await self._store.delete("topics", name)
        self._topics.pop(name, None)
        self._policies.pop(name, None)
        await self._store.delete("policies", name)
        for state in self._attached.pop(name, {}).values():
            config = Subscription()
            config.CopyFrom(state.config)
            config.topic = limits.DELETED_TOPIC
            await self._store.put("subscriptions", config.name, config)
            state.config = config

    async def detach_subscription(self, name: str) -> None:
        """DetachSubscription: the subscription stays but receives and delivers nothing more."""
        state = self._subscription(name)
        config = Subscription()
        config.CopyFrom(state.config)
        config.detached = True
        await self._store.put("subscriptions", name, config)
        state.config = config
        self._attached.get(config.topic, {}).pop(name, None)
        dropped = [pending.sequence for pending in self._drain(state)]
        if dropped:
            await self._store.ack(name, dropped)
        state.notify()

    def _drain(self, state: _SubscriptionState) -> list[_Pending]:
        dropped = list(state.ready)
        for lease in state.leases.values():
            lease.active = False
            self._release_flow(lease)
            dropped.append(lease.pending)
        for waiting in state.key_backlog.values():
            dropped.extend(waiting)
        state.ready.clear()
        state.leases.clear()
        state.key_backlog.clear()
        return dropped

    # ----------------------------------------------------------------- publish
    async def publish(self, topic_name: str, messages: Any, request_bytes: int) -> list[str]:
        """Publish: validate, number, make durable, fan out; return the message IDs."""
        topic = self._topics.get(topic_name)
        if topic is None:
            self._topic(topic_name)  # raises INVALID_ARGUMENT or NOT_FOUND
        count = len(messages)
        if count == 0:
            raise invalid("The request contains no messages; a Publish request must contain at least one.")
        if count > limits.MAX_MESSAGES_PER_PUBLISH:
            raise limits.too_large("message_count", count, limits.MAX_MESSAGES_PER_PUBLISH)
        if request_bytes > limits.MAX_PUBLISH_REQUEST_BYTES:
            raise limits.too_large("request_size", request_bytes, limits.MAX_PUBLISH_REQUEST_BYTES)
        for message in messages:
            _check_message(message)
        if topic.HasField("schema_settings"):
            await self.schemas.stamp_messages(topic_name, topic.schema_settings, messages)
        return await self._append(topic_name, messages)

    async def _append(self, topic_name: str, messages: Any) -> list[str]:
        """Number, make durable and fan out messages already accepted (no request limits apply)."""
        count = len(messages)
        now_ns = self.wall_clock_ns()
        seconds, nanos = divmod(now_ns, 1_000_000_000)
        sequence = self._next_sequence
        self._next_sequence = sequence + count
        records = []
        ids = []
        for message in messages:
            message_id = str(sequence)
            message.message_id = message_id
            stamp = message.publish_time
            stamp.seconds = seconds
            stamp.nanos = nanos
            records.append((sequence, message))
            ids.append(message_id)
            sequence += 1
        attached = self._attached.get(topic_name)
        targets = list(attached.values()) if attached else []
        await self._store.append(topic_name, records, [state.name for state in targets])
        for state in targets:
            if not state.deleted:
                state.add(records)
        return ids

    async def delete_schema(self, name: str) -> None:
        """DeleteSchema: topics that named it keep validating against nothing (``_deleted-schema_``)."""
        await self.schemas.delete(name)
        for topic in list(self._topics.values()):
            if topic.HasField("schema_settings") and topic.schema_settings.schema == name:
                updated = Topic()
                updated.CopyFrom(topic)
                updated.schema_settings.schema = limits.DELETED_SCHEMA
                await self._store.put("topics", updated.name, updated)
                self._topics[updated.name] = updated

    # ----------------------------------------------------------------- subscriptions
    def _subscription(self, name: str) -> _SubscriptionState:
        return _existing(self._subscriptions, limits.check_subscription_name(name))

    def _check_subscription_fields(self, config: Any) -> None:
        if config.ack_deadline_seconds == 0:
            config.ack_deadline_seconds = limits.DEFAULT_ACK_DEADLINE_SECONDS
        limits.check_ack_deadline(config.ack_deadline_seconds, allow_zero=False)
        if config.HasField("message_retention_duration"):
            _check_retention(config, limits.MAX_SUBSCRIPTION_RETENTION_SECONDS, "7 days")
        else:
            config.message_retention_duration.CopyFrom(
                duration_pb2.Duration(seconds=limits.DEFAULT_RETENTION_SECONDS)
            )
        if config.push_config.push_endpoint:
            raise ServiceError(
                StatusCode.UNIMPLEMENTED, "Push subscriptions are not supported by this server."
            )
        for kind in ("bigquery_config", "cloud_storage_config", "bigtable_config"):
            if config.HasField(kind) and getattr(config, kind).ByteSize():
                raise ServiceError(
                    StatusCode.UNIMPLEMENTED, f"{kind} subscriptions are not supported by this server."
                )
        if config.filter:
            raise ServiceError(
                StatusCode.UNIMPLEMENTED, "Subscription filters are not supported by this server."
            )
        if config.enable_exactly_once_delivery:
            raise ServiceError(
                StatusCode.UNIMPLEMENTED, "Exactly-once delivery is not supported by this server."
            )
        if config.HasField("dead_letter_policy") and config.dead_letter_policy.dead_letter_topic:
            policy = config.dead_letter_policy
            limits.check_topic_name(policy.dead_letter_topic)
            if policy.max_delivery_attempts == 0:
                policy.max_delivery_attempts = limits.DEFAULT_MAX_DELIVERY_ATTEMPTS
            if (
                not limits.MIN_MAX_DELIVERY_ATTEMPTS
                <= policy.max_delivery_attempts
                <= limits.MAX_MAX_DELIVERY_ATTEMPTS
            ):
                raise invalid(
                    f"Invalid max_delivery_attempts given: {policy.max_delivery_attempts}. It must be "
                    f"between {limits.MIN_MAX_DELIVERY_ATTEMPTS} and {limits.MAX_MAX_DELIVERY_ATTEMPTS}."
                )
        elif config.HasField("dead_letter_policy"):
            config.ClearField("dead_letter_policy")

    async def create_subscription(self, request: Any) -> Any:
        """CreateSubscription: the request is a ``Subscription``."""
        name = limits.check_subscription_name(request.name)
        if not request.topic:
            raise invalid("The topic of a subscription must be given.")
        self._topic(request.topic)
        if name in self._subscriptions:
            raise limits.already_exists(name)
        config = Subscription()
        config.CopyFrom(request)
        config.detached = False
        config.state = 0
        self._check_subscription_fields(config)
        await self._store.put("subscriptions", name, config)
        if name in self._subscriptions:
            raise limits.already_exists(name)
        if config.topic not in self._topics:
            await self._store.delete("subscriptions", name)
            raise not_found(config.topic)
        state = _SubscriptionState(config)
        self._subscriptions[name] = state
        self._attached.setdefault(config.topic, {})[name] = state
        return config

    def get_subscription(self, name: str) -> Any:
        """GetSubscription."""
        return self._subscription(name).config

    async def update_subscription(self, update: Any, paths: Sequence[str]) -> Any:
        """UpdateSubscription with a field mask."""
        state = self._subscription(update.name)
        config = _masked_update("Subscription", state.config, update, paths, _SUBSCRIPTION_UPDATABLE)
        self._check_subscription_fields(config)
        await self._store.put("subscriptions", config.name, config)
        state.config = config
        return config

    def list_subscriptions(self, project: str, page_size: int, page_token: str) -> tuple[list[Any], str]:
        """ListSubscriptions: one page of the project's subscriptions, sorted by name."""
        page, token = _project_page(project, "subscriptions", self._subscriptions, page_size, page_token)
        return [self._subscriptions[name].config for name in page], token

    async def delete_subscription(self, name: str) -> None:
        """DeleteSubscription: its backlog goes with it."""
        state = self._subscription(name)
        await self._store.delete("subscriptions", name)
        await self._store.delete("policies", name)
        self._policies.pop(name, None)
        if self._subscriptions.get(name) is state:
            del self._subscriptions[name]
            self._attached.get(state.config.topic, {}).pop(name, None)
            self._drain(state)
            state.deleted = True
            state.notify()

    # ----------------------------------------------------------------- delivery
    def _deliverable(self, name: str) -> _SubscriptionState:
        state = self._subscription(name)
        if state.config.detached:
            raise ServiceError(
                StatusCode.FAILED_PRECONDITION,
                f"The subscription is detached from its topic (subscription={name}).",
            )
        return state

    def _take(self, state: _SubscriptionState, consumer: Consumer, max_messages: int) -> list[Any]:
        """Lease up to ``max_messages`` ready messages to ``consumer``."""
        ready = state.ready
        if not ready:
            return []
        config = state.config
        counted = config.HasField("dead_letter_policy")
        retention = _seconds(config.message_retention_duration) or limits.DEFAULT_RETENTION_SECONDS
        oldest_kept = self.wall_clock_ns() / 1e9 - retention
        now = self._clock.now()
        deadline = now + consumer.ack_deadline
        out: list[Any] = []
        expired: list[int] = []
        total_bytes = 0
        limit = min(max_messages, consumer.room())
        while ready and len(out) < limit and total_bytes < _MAX_BYTES_PER_RESPONSE:
            pending = ready.popleft()
            if pending.message.publish_time.seconds < oldest_kept:
                expired.append(pending.sequence)
                state.finished(pending)
                continue
            pending.attempts += 1
            ack_id = f"{self._ack_prefix}-{next(self._ack_counter)}"
            lease = _Lease(ack_id, pending, consumer, deadline, state)
            state.leases[ack_id] = lease
            consumer.outstanding_messages += 1
            consumer.outstanding_bytes += pending.size
            total_bytes += pending.size
            heapq.heappush(self._deadlines, (deadline, next(self._heap_counter), lease))
            out.append(
                ReceivedMessage(
                    ack_id=ack_id,
                    message=pending.message,
                    delivery_attempt=pending.attempts if counted else 0,
                )
            )
            if consumer.max_bytes and consumer.outstanding_bytes >= consumer.max_bytes:
                break
        if out:
            self._schedule(deadline)
        if expired:
            self._spawn(self._store.ack(state.name, expired))
        return out

    async def _forward_dead_letter(self, state: _SubscriptionState, pending: _Pending, topic: str) -> None:
        """Publish a copy to the dead-letter topic, then acknowledge the message on its subscription.

        Runs in the background. Whatever goes wrong (a missing dead-letter topic, a failing store), the
        message goes back to the front of ``ready`` rather than being dropped; the next nack or deadline
        tries again.
        """
        forwarded = False
        try:
            if topic in self._topics:  # the real service keeps the message when the topic is missing
                # Not through publish(): the copy is the service's own, and the attributes it gains may take
                # a message that was at the 100-attribute limit past it; that must not drop the message.
                await self._append(topic, [_dead_letter_copy(state.name, pending)])
                await self._store.ack(state.name, [pending.sequence])
                forwarded = True
        except Exception:
            logger.exception(
                "Forwarding message %s of %s to the dead-letter topic %s failed; it stays for redelivery.",
                pending.message.message_id,
                state.name,
                topic,
            )
        finally:
            state.forwarding.discard(pending)
        if state.deleted:
            return
        if forwarded:
            state.finished(pending)
        else:
            state.ready.appendleft(pending)
        state.notify()

    def _release_flow(self, lease: _Lease) -> None:
        consumer = lease.consumer
        consumer.outstanding_messages -= 1
        consumer.outstanding_bytes -= lease.pending.size

    def _nack(self, state: _SubscriptionState, lease: _Lease) -> None:
        """A lease ended unacknowledged (nack or deadline): redeliver, or dead-letter if attempts ran out."""
        lease.active = False
        del state.leases[lease.ack_id]
        self._release_flow(lease)
        pending = lease.pending
        policy = state.dead_letter_policy
        if policy is not None and pending.attempts >= policy.max_delivery_attempts:
            state.forwarding.add(pending)
            self._spawn(self._forward_dead_letter(state, pending, policy.dead_letter_topic))
        else:
            state.ready.appendleft(pending)

    def _schedule(self, deadline: float) -> None:
        if deadline >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = deadline
        # A hair late, so that every lease due at ``deadline`` has passed when the timer runs.
        self._timer = self._clock.call_later(deadline - self._clock.now() + 0.001, self._expire)

    def _expire(self) -> None:
        """Timer: put every lease whose deadline has passed back up for delivery."""
        self._timer = None
        self._timer_at = float("inf")
        now = self._clock.now()
        heap = self._deadlines
        touched: set[_SubscriptionState] = set()
        while heap and heap[0][0] <= now:
            deadline, _, lease = heapq.heappop(heap)
            if not lease.active or lease.deadline != deadline:
                continue
            self._nack(lease.state, lease)
            touched.add(lease.state)
        for state in touched:
            state.notify()
        # Drop stale heap entries at the top so the next timer is not set for nothing.
        while heap and (not heap[0][2].active or heap[0][2].deadline != heap[0][0]):
            heapq.heappop(heap)
        if heap:
            self._schedule(heap[0][0])

    def open_consumer(
        self, subscription: str, ack_deadline: float, max_messages: int = 0, max_bytes: int = 0
    ) -> Consumer:
        """Check a subscription can deliver, and make a consumer (flow-control window) for it."""
        self._deliverable(subscription)
        return Consumer(ack_deadline, max_messages, max_bytes)

    async def pull(self, subscription: str, max_messages: int, wait_seconds: float) -> list[Any]:
        """Pull: lease up to ``max_messages``, waiting up to ``wait_seconds`` for the first one."""
        if max_messages <= 0:
            raise invalid(f"Invalid max_messages given: {max_messages}. It must be positive.")
        state = self._deliverable(subscription)
        consumer = Consumer(float(state.config.ack_deadline_seconds))
        taken = self._take(state, consumer, min(max_messages, MAX_MESSAGES_PER_RESPONSE))
        if taken or wait_seconds <= 0:
            return taken
        end = self._clock.now() + wait_seconds
        while not taken:
            remaining = end - self._clock.now()
            if remaining <= 0:
                break
            if not await state.wait_changed(remaining):
                break
            state = self._deliverable(subscription)
            taken = self._take(state, consumer, min(max_messages, MAX_MESSAGES_PER_RESPONSE))
        return taken

    async def next_batch(self, subscription: str, consumer: Consumer) -> list[Any]:
        """StreamingPull: wait until messages can be sent to ``consumer``; [] once it is closed."""
        while not consumer.closed:
            state = self._deliverable(subscription)
            taken = self._take(state, consumer, MAX_MESSAGES_PER_RESPONSE)
            if taken:
                return taken
            await state.wait_changed()
        return []

    def close_consumer(self, subscription: str, consumer: Consumer) -> None:
        """The stream ended; its leases keep their deadlines and run out as the real service's do."""
        consumer.closed = True
        state = self._subscriptions.get(subscription)
        if state is not None:
            state.notify()

    async def acknowledge(self, subscription: str, ack_ids: Sequence[str]) -> None:
        """Acknowledge: unknown or expired ack IDs are ignored, as the real service does."""
        state = self._subscription(subscription)
        self._check_ack_ids(ack_ids)
        done: list[int] = []
        leases = state.leases
        for ack_id in ack_ids:
            lease = leases.pop(ack_id, None)
            if lease is None:
                continue
            lease.active = False
            self._release_flow(lease)
            done.append(lease.pending.sequence)
            state.finished(lease.pending)
        if done:
            state.notify()
            await self._store.ack(subscription, done)

    def modify_ack_deadline(self, subscription: str, ack_ids: Sequence[str], seconds: int) -> None:
        """ModifyAckDeadline: 0 is a nack; otherwise the lease runs ``seconds`` from now."""
        state = self._subscription(subscription)
        limits.check_ack_deadline(seconds, allow_zero=True, field="ack_deadline_seconds")
        self._check_ack_ids(ack_ids)
        self._modify(state, ack_ids, seconds)

    def modify_each(self, subscription: str, ack_ids: Sequence[str], seconds: Sequence[int]) -> None:
        """StreamingPull's paired modify_deadline_ack_ids / modify_deadline_seconds."""
        state = self._subscription(subscription)
        if len(ack_ids) != len(seconds):
            raise invalid(
                "modify_deadline_seconds and modify_deadline_ack_ids must have the same length "
                f"(got {len(seconds)} and {len(ack_ids)})."
            )
        self._check_ack_ids(ack_ids)
        for value in seconds:
            limits.check_ack_deadline(value, allow_zero=True, field="modify_deadline_seconds")
        for ack_id, value in zip(ack_ids, seconds, strict=True):
            self._modify(state, (ack_id,), value)

    def _modify(self, state: _SubscriptionState, ack_ids: Iterable[str], seconds: int) -> None:
        now = self._clock.now()
        nacked = False
        for ack_id in ack_ids:
            lease = state.leases.get(ack_id)
            if lease is None:
                continue
            if seconds == 0:
                self._nack(state, lease)
                nacked = True
            else:
                lease.deadline = now + seconds
                heapq.heappush(self._deadlines, (lease.deadline, next(self._heap_counter), lease))
                self._schedule(lease.deadline)
        if nacked:
            state.notify()

    def _check_ack_ids(self, ack_ids: Sequence[str]) -> None:
        if not ack_ids:
            raise invalid("No ack IDs were given; at least one ack ID is required.")
        for ack_id in ack_ids:
            prefix, _, number = ack_id.partition("-")
            if len(prefix) != 8 or not number.isdigit():
                raise invalid(f"You have passed an invalid ack ID to the service (ack_id={ack_id}).")

    # ----------------------------------------------------------------- IAM
    def _iam_resource(self, resource: str) -> None:
        if "/subscriptions/" in resource:
            self._subscription(resource)
        elif "/topics/" in resource:
            self._topic(resource)
        else:
            raise invalid(
                f"Invalid resource name given (name={resource}); IAM policies are kept on topics and "
                "subscriptions."
            )

    def get_policy(self, resource: str) -> Any:
        """GetIamPolicy: the stored policy, or an empty one."""
        self._iam_resource(resource)
        policy = self._policies.get(resource)
        if policy is None:
            policy = Policy(version=1, etag=b"\x00\x00\x00\x00\x00\x00\x00\x00")
        return policy

    async def set_policy(self, resource: str, policy: Any) -> Any:
        """SetIamPolicy: replace the policy; a stale etag is refused with ABORTED."""
        self._iam_resource(resource)
        current = self.get_policy(resource)
        if policy.etag and policy.etag != current.etag:
            raise ServiceError(
                StatusCode.ABORTED,
                "There were concurrent policy changes. Please retry the whole read-modify-write with "
                "exponential backoff.",
            )
        stored = Policy()
        stored.CopyFrom(policy)
        stored.etag = os.urandom(8)
        if stored.version == 0:
            stored.version = 1
        await self._store.put("policies", resource, stored)
        self._policies[resource] = stored
        return stored

    def check_iam_resource(self, resource: str) -> None:
        """TestIamPermissions needs an existing topic or subscription."""
        self._iam_resource(resource)

    def stored_policy(self, resource: str) -> Any | None:
        """The policy set on a topic or subscription, or ``None`` (no checks: for IAM enforcement)."""
        return self._policies.get(resource)

    def topic_of_subscription(self, name: str) -> str | None:
        """The topic an existing, attached subscription receives from; ``None`` otherwise."""
        state = self._subscriptions.get(name)
        if state is None or state.config.topic not in self._topics:
            return None
        return state.config.topic


def _dead_letter_copy(subscription: str, pending: _Pending) -> Any:
    """The message as forwarded to a dead-letter topic, with the attributes the real service adds."""
    message = pending.message
    copy = PubsubMessage()
    copy.data = message.data
    copy.attributes.update(message.attributes)
    copy.ordering_key = message.ordering_key
    project, _, subscription_id = subscription.split("/", 3)[1:]
    copy.attributes["CloudPubSubDeadLetterSourceDeliveryCount"] = str(pending.attempts)
    copy.attributes["CloudPubSubDeadLetterSourceSubscription"] = subscription_id
    copy.attributes["CloudPubSubDeadLetterSourceSubscriptionProject"] = project
    copy.attributes["CloudPubSubDeadLetterSourceTopicPublishTime"] = message.publish_time.ToJsonString()
    return copy


def _check_message(message: Any) -> None:
    data_size = len(message.data)
    attributes = message.attributes
    if not data_size and not attributes:
        raise invalid(
            "One or more messages in the publish request is empty. Each message must contain either "
            "non-empty data, or at least one attribute."
        )
    if data_size > limits.MAX_MESSAGE_DATA_BYTES:
        raise limits.too_large("message_size", data_size, limits.MAX_MESSAGE_DATA_BYTES)
    if attributes:
        if len(attributes) > limits.MAX_ATTRIBUTES:
            raise limits.too_large("attributes_count", len(attributes), limits.MAX_ATTRIBUTES)
        for key, value in attributes.items():
            key_size = len(key.encode())
            if key_size > limits.MAX_ATTRIBUTE_KEY_BYTES:
                raise limits.too_large("attribute_key_size", key_size, limits.MAX_ATTRIBUTE_KEY_BYTES)
            if not key_size:
                raise invalid("Attribute keys must not be empty.")
            value_size = len(value.encode())
            if value_size > limits.MAX_ATTRIBUTE_VALUE_BYTES:
                raise limits.too_large("attribute_value_size", value_size, limits.MAX_ATTRIBUTE_VALUE_BYTES)
            if key.startswith("goog"):
                raise invalid(f"Attribute keys must not start with 'goog' (key={key}).")
    key = message.ordering_key
    if key:
        key_size = len(key.encode())
        if key_size > limits.MAX_ORDERING_KEY_BYTES:
            raise limits.too_large("ordering_key_size", key_size, limits.MAX_ORDERING_KEY_BYTES)


def _project_page(
    project: str, collection: str, names: Iterable[str], page_size: int, page_token: str
) -> tuple[list[str], str]:
    """One page of the sorted names of ``project``'s topics or subscriptions (``collection``)."""
    limits.check_project(project)
    prefix = f"{project}/{collection}/"
    return _page(sorted(name for name in names if name.startswith(prefix)), page_size, page_token)


def _masked_update(
    kind: str, current: Any, update: Any, paths: Sequence[str], updatable: frozenset[str]
) -> Any:
    """A copy of ``current`` (a Topic or Subscription) with the fields of ``update`` named by the mask.

    The mask is checked in the real service's words: not empty, and naming only updatable fields.
    """
    request = f"Update{kind}Request"
    if not paths:
        raise invalid(f"The update_mask in the {request} must be set, and not empty.")
    for path in paths:
        if path.split(".", 1)[0] not in updatable:
            raise invalid(
                f"Invalid update_mask provided in the {request}: '{path}' is not a known {kind} field, or "
                "it cannot be updated. Note that field paths must be of the form 'push_config' rather than "
                "of the form 'pushConfig'."
            )
    updated = type(current)()
    updated.CopyFrom(current)
    _apply_mask(update, updated, paths)
    return updated


def _apply_mask(source: Any, destination: Any, paths: Sequence[str]) -> None:
    """Copy the masked fields from ``source`` to ``destination`` (a field absent in source is cleared)."""
    mask = field_mask_pb2.FieldMask(paths=list(paths))
    try:
        mask.MergeMessage(source, destination, replace_message_field=True, replace_repeated_field=True)
    except (ValueError, KeyError) as error:
        raise invalid(f"Invalid update_mask given: {error}") from None
