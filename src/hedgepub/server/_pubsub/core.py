"""The Pub/Sub core: the coordinator the services call, with no gRPC in sight.

All state lives on one event loop; nothing here is thread-safe. The service layer calls these methods
with raw protobuf requests and turns :class:`ServiceError` into status codes.

The core checks requests (:mod:`._resources`), writes through to the :class:`Store`, and drives each
subscription's delivery state machine (:mod:`._delivery`). A published message is appended to every
subscription attached to its topic ("fan-out") only after the store has made it durable.

Dead-letter forwarding happens in the background (nobody needs to pull), as the real service does: the
copy is stored before the ack on the source subscription, so a crash in between duplicates it and never
loses it, and a forwarding that fails puts it back up for delivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from google.iam.v1 import policy_pb2

from hedgepub._clock import DEFAULT_CLOCK, Clock
from hedgepub._status import StatusCode
from hedgepub.server._pubsub import limits as limits
from hedgepub.server._pubsub import resources as resources
from hedgepub.server._pubsub.delivery import (
    DEFAULT_WINDOW,
    MAX_MESSAGES_PER_RESPONSE,
    Consumer,
    Leasing,
    Pending,
    SubscriptionState,
    dead_letter_copy,
)
from hedgepub.server._pubsub.expiration import RECORD_EVERY, ExpirationWatch
from hedgepub.server._pubsub.limits import ServiceError, invalid, not_found
from hedgepub.server._pubsub.oidc import PushTokenSigner
from hedgepub.server._pubsub.push import PushDispatcher
from hedgepub.server._pubsub.replay import Replay
from hedgepub.server._pubsub.schemas import SchemaRegistry
from hedgepub.server._store.memory import Snapshot, Store, StoredMessage

logger = logging.getLogger("hedgepub.server")

Topic: Any = resources.Topic
Subscription: Any = resources.Subscription
Policy: Any = policy_pb2.Policy

__all__ = ["MAX_MESSAGES_PER_RESPONSE", "Consumer", "PubSubCore"]


class PubSubCore:
    """Topics, subscriptions, IAM policies and delivery, written through to a :class:`Store`.

    ``clock`` drives leases and waits. ``wall_clock_ns`` is the calendar time in nanoseconds since the
    epoch, which ``publish_time`` and message retention are about; replace it (it is a plain attribute)
    to test retention without waiting for it. ``window`` is how many ready messages each subscription
    holds in memory; the rest of its backlog is read from the store in pages as it drains.
    ``push_tokens`` signs push requests' OIDC tokens (default: a key made in memory when first needed).
    """

    def __init__(
        self,
        store: Store,
        clock: Clock = DEFAULT_CLOCK,
        wall_clock_ns: Callable[[], int] = time.time_ns,
        *,
        window: int = DEFAULT_WINDOW,
        push_tokens: PushTokenSigner | None = None,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1; got {window}")
        self._store = store
        self._window = window
        self._clock = clock
        self.wall_clock_ns = wall_clock_ns
        self._topics: dict[str, Any] = {}
        self._subscriptions: dict[str, SubscriptionState] = {}
        self._attached: dict[str, dict[str, SubscriptionState]] = {}
        self._policies: dict[str, Any] = {}
        self._next_sequence = 1
        self._leasing = Leasing(clock, self._dead_letter, self._discard, self._attempted)
        #: Delivery attempts to record, per subscription (sequence -> count), and the writes under way.
        self._attempts_due: dict[str, dict[int, int]] = {}
        self._attempts_writes: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[Any]] = set()
        self._expiration = ExpirationWatch(clock, self._expire_subscription, self._record_activity)
        #: Subscriptions' activity to record (name -> ns since the epoch), written once per loop step.
        self._activity_due: dict[str, int] = {}
        #: Snapshots, Seek and retention.
        self.replay = Replay(
            store,
            clock,
            lambda: self.wall_clock_ns(),
            self._subscription,
            lambda: list(self._subscriptions.values()),
            self._topic,
            self._spawn,
            forgotten=self._drop_policy,
        )
        #: Whether the service may forward from a subscription to a dead-letter topic (IAM enforcement sets
        #: it: the topic must grant its forwarding identity publishing); ``None`` allows every forwarding.
        self.may_forward: Callable[[str, str], bool] | None = None
        self._refused_forwarding: set[tuple[str, str]] = set()
        #: Schemas and their revisions (SchemaService); topics' schema_settings name them.
        self.schemas = SchemaRegistry(store, lambda: self.wall_clock_ns())
        #: One push worker per push subscription (started and stopped as subscriptions change).
        self.push = PushDispatcher(self, clock, push_tokens)

    # ----------------------------------------------------------------- lifecycle
    def load(self, snapshot: Snapshot | None = None) -> None:
        """Take back what the store holds (topics, subscriptions, policies); backlogs are read lazily."""
        snapshot = snapshot if snapshot is not None else self._store.load()
        self._topics = dict(snapshot.topics)
        self._policies = dict(snapshot.policies)
        self.schemas.load(snapshot.schemas)
        self._next_sequence = snapshot.next_sequence
        self._subscriptions = {}
        self._attached = {}
        now_ns = self.wall_clock_ns()
        for name, config in snapshot.subscriptions.items():
            state = self._new_state(config)
            state.more = not config.detached  # its backlog, if any, is read when first needed
            self._subscriptions[name] = state
            self._expiration.watch(config, self._idle_seconds(snapshot.activity.get(name), now_ns))
            if not config.detached and config.topic in self._topics:
                self._attached.setdefault(config.topic, {})[name] = state
        self.replay.load(snapshot.snapshots, list(self._topics.values()))
        # A policy is deleted just after its resource: a crash in between leaves it behind, and a resource
        # later created under that name must not find it.
        orphans = [resource for resource in self._policies if not self._iam_resource_exists(resource)]
        for resource in orphans:
            del self._policies[resource]
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # loaded outside a loop (some tests): push and replay start with the next change
            return
        for resource in orphans:
            self._spawn(self._store.delete("policies", resource))
        self.replay.start()
        for name, state in self._subscriptions.items():
            if state.config.enable_exactly_once_delivery and not state.config.detached:
                self._restore_leases(state)
            self.push.sync(name)

    @staticmethod
    def _idle_seconds(active_ns: int | None, now_ns: int) -> float:
        """How long a subscription recorded active at ``active_ns`` has been inactive (at least): its last
        activity may come up to ``RECORD_EVERY`` after the record, so the clock goes on from there. A
        subscription without a record (an earlier hedgepub's data) starts its clock now."""
        if active_ns is None:
            return 0.0
        return max(0.0, (now_ns - active_ns) / 1e9 - RECORD_EVERY)

    def _record_activity(self, name: str) -> None:
        """Expiration: record that ``name`` is active now; one store write per loop step for all."""
        due = self._activity_due
        if not due:
            self._spawn(self._write_activity())
        due[name] = self.wall_clock_ns()

    async def _write_activity(self) -> None:
        due, self._activity_due = self._activity_due, {}
        try:
            await self._store.put_activity(list(due.items()))
        except Exception:  # the clock then goes on from an older record: a restart may expire it sooner
            logger.exception("Recording the activity of %d subscriptions failed.", len(due))

    def _new_state(self, config: Any) -> SubscriptionState:
        """Delivery state of a subscription that has nothing in memory and nothing in the store yet."""
        state = SubscriptionState(
            config, self._leasing, self._store.pending, self._window, self._store.attempts
        )
        state.more = False
        return state

    async def close(self) -> None:
        """Stop push delivery, timers and background work, and close the store."""
        await self.push.close()
        self._leasing.close()
        self._expiration.close()
        self.replay.close()
        if self._activity_due:  # before its task, which may not have started, is cancelled below
            await self._write_activity()
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for state in self._subscriptions.values():
            state.close()
        await self.attempts_recorded()
        await self._store.close()

    async def clear(self) -> None:
        """Delete every topic, subscription, policy and message."""
        await self.push.close()
        for state in self._subscriptions.values():
            state.close()
        self._topics.clear()
        self._subscriptions.clear()
        self._attached.clear()
        self._policies.clear()
        self.schemas.clear()
        self._leasing.clear()
        self._expiration.close()
        self.replay.clear()
        await self._store.clear()

    def messages(self, topic: str) -> list[StoredMessage]:
        """Every message stored on ``topic``, in publish order."""
        return [StoredMessage.from_pb(topic, message) for _, message in self._store.messages(topic)]

    def is_idle(self) -> bool:
        """No message is waiting or leased on any subscription."""
        for state in self._subscriptions.values():
            if state.backlog_size() == 0:
                state.refill()  # the store may hold a backlog not read yet
            if state.backlog_size():
                return False
        return True

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ----------------------------------------------------------------- topics
    def _topic(self, name: str) -> Any:
        return resources.existing(self._topics, limits.check_topic_name(name))

    async def create_topic(self, request: Any) -> Any:
        """CreateTopic: the request is a ``Topic``."""
        name = limits.check_topic_name(request.name)
        if name in self._topics:
            raise limits.already_exists(name)
        resources.check_topic_fields(request)
        if request.HasField("schema_settings"):
            self.schemas.check_settings(request.schema_settings)
        topic = resources.copy_with(request, state=0)
        await self._store.put("topics", name, topic)
        if name in self._topics:  # created concurrently while we waited for the store
            raise limits.already_exists(name)
        self._topics[name] = topic
        await self.replay.topic_changed(topic)
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
        updated = resources.masked_update("Topic", current, update, paths, resources.TOPIC_UPDATABLE)
        resources.check_topic_fields(updated)
        if updated.HasField("schema_settings") and updated.schema_settings != current.schema_settings:
            self.schemas.check_settings(updated.schema_settings)
        await self._store.put("topics", updated.name, updated)
        self._topics[updated.name] = updated
        await self.replay.topic_changed(updated)
        return updated

    def list_topics(self, project: str, page_size: int, page_token: str) -> tuple[list[Any], str]:
        """ListTopics: one page of the project's topics, sorted by name."""
        page, token = resources.project_page(project, "topics", self._topics, page_size, page_token)
        return [self._topics[name] for name in page], token

    def list_topic_subscriptions(self, topic: str, page_size: int, page_token: str) -> tuple[list[str], str]:
        """ListTopicSubscriptions: names of the subscriptions attached to ``topic``."""
        self._topic(topic)
        return resources.page(sorted(self._attached.get(topic, {})), page_size, page_token)

    async def delete_topic(self, name: str) -> None:
        """DeleteTopic: subscriptions stay, pointing at ``_deleted-topic_``."""
        self._topic(name)
        await self._store.delete("topics", name)
        self._topics.pop(name, None)
        await self.replay.topic_deleted(name)
        await self._drop_policy(name)
        for state in self._attached.pop(name, {}).values():
            config = resources.copy_with(state.config, topic=limits.DELETED_TOPIC)
            await self._store.put("subscriptions", config.name, config)
            state.config = config

    async def detach_subscription(self, name: str) -> None:
        """DetachSubscription: the subscription stays but receives and delivers nothing more."""
        state = self._subscription(name)
        config = resources.copy_with(state.config, detached=True)
        await self._store.put("subscriptions", name, config)
        state.config = config
        self._attached.get(config.topic, {}).pop(name, None)
        dropped = [pending.sequence for pending in state.drain()]
        if dropped:
            await self._store.ack(name, dropped)
        # And what is still only in the store, a page at a time.
        state.more = False
        after = state.cursor
        while page := self._store.pending(name, after, MAX_MESSAGES_PER_RESPONSE):
            after = page[-1][0]
            await self._store.ack(name, [sequence for sequence, _ in page])
        state.notify()
        self.push.sync(name)

    # ----------------------------------------------------------------- publish
    async def publish(self, topic_name: str, messages: Any, request_bytes: int) -> list[str]:
        """Publish: validate, number, make durable, fan out; return the message IDs."""
        if topic_name not in self._topics:
            self._topic(topic_name)  # raises INVALID_ARGUMENT or NOT_FOUND
        resources.check_publish(messages, request_bytes)
        topic = self._topics[topic_name]
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
        holders = [state.name for state in targets] + self.replay.holders_for(topic_name)
        await self._store.append(topic_name, records, holders)
        for state in targets:
            if not state.deleted:
                refused = state.add(records)
                if refused:
                    await self._store.ack(state.name, refused)
        return ids

    async def delete_schema(self, name: str) -> None:
        """DeleteSchema: topics that named it keep validating against nothing (``_deleted-schema_``)."""
        await self.schemas.delete(name)
        await self._drop_policy(name)
        for topic in list(self._topics.values()):
            if topic.HasField("schema_settings") and topic.schema_settings.schema == name:
                updated = resources.copy_with(topic)
                updated.schema_settings.schema = limits.DELETED_SCHEMA
                await self._store.put("topics", updated.name, updated)
                self._topics[updated.name] = updated

    # ----------------------------------------------------------------- subscriptions
    def _subscription(self, name: str) -> SubscriptionState:
        return resources.existing(self._subscriptions, limits.check_subscription_name(name))

    async def create_subscription(self, request: Any) -> Any:
        """CreateSubscription: the request is a ``Subscription``."""
        name = limits.check_subscription_name(request.name)
        if not request.topic:
            raise invalid("The topic of a subscription must be given.")
        self._topic(request.topic)
        if name in self._subscriptions:
            raise limits.already_exists(name)
        config = resources.copy_with(request, detached=False, state=0)
        config.ClearField("topic_message_retention_duration")  # output only: shown from the topic
        resources.check_subscription_fields(config)
        await self._store.put("subscriptions", name, config)
        if name in self._subscriptions:
            raise limits.already_exists(name)
        if config.topic not in self._topics:
            await self._store.delete("subscriptions", name)
            raise not_found(config.topic)
        state = self._new_state(config)
        self._subscriptions[name] = state
        self._attached.setdefault(config.topic, {})[name] = state
        self._expiration.watch(config)
        await self.replay.subscription_changed(config)
        self.push.sync(name)
        return self._shown(config)

    def get_subscription(self, name: str) -> Any:
        """GetSubscription."""
        return self._shown(self._subscription(name).config)

    def _shown(self, config: Any) -> Any:
        """A subscription as the service shows it: with its topic's retention in the output-only
        ``topic_message_retention_duration`` (a copy then; otherwise the stored object itself)."""
        topic = self._topics.get(config.topic)
        if topic is None or not topic.HasField("message_retention_duration"):
            return config
        shown = resources.copy_with(config)
        shown.topic_message_retention_duration.CopyFrom(topic.message_retention_duration)
        return shown

    async def update_subscription(self, update: Any, paths: Sequence[str]) -> Any:
        """UpdateSubscription with a field mask."""
        state = self._subscription(update.name)
        config = resources.masked_update(
            "Subscription", state.config, update, paths, resources.SUBSCRIPTION_UPDATABLE
        )
        resources.check_subscription_fields(config, state.config)
        await self._store.put("subscriptions", config.name, config)
        state.config = config
        self._expiration.watch(config)  # an update is activity, and may change the ttl
        await self.replay.subscription_changed(config)
        self.push.sync(config.name)  # push_config may have switched it between push and pull
        return self._shown(config)

    async def modify_push_config(self, name: str, push_config: Any) -> None:
        """ModifyPushConfig: an endpoint makes it a push subscription; an empty config makes it pull."""
        state = self._subscription(name)
        config = resources.copy_with(state.config)
        config.push_config.CopyFrom(push_config)
        resources.check_subscription_fields(config, state.config)
        await self._store.put("subscriptions", name, config)
        state.config = config
        self.push.sync(name)

    def list_subscriptions(self, project: str, page_size: int, page_token: str) -> tuple[list[Any], str]:
        """ListSubscriptions: one page of the project's subscriptions, sorted by name."""
        page, token = resources.project_page(
            project, "subscriptions", self._subscriptions, page_size, page_token
        )
        return [self._shown(self._subscriptions[name].config) for name in page], token

    async def delete_subscription(self, name: str) -> None:
        """DeleteSubscription: its backlog goes with it."""
        state = self._subscription(name)
        await self._store.delete("subscriptions", name)
        await self.replay.subscription_deleted(name)
        await self._drop_policy(name)
        if self._subscriptions.get(name) is state:
            del self._subscriptions[name]
            self._attached.get(state.config.topic, {}).pop(name, None)
            self._expiration.forget(name)
            state.drain()
            state.close()
            self.push.sync(name)

    async def seek(self, subscription: str, publish_ns: int | None, snapshot: str | None) -> None:
        """Seek to a time (ns since the epoch) or to a snapshot (see :mod:`._replay`); it is activity."""
        self._expiration.touch(subscription)
        await self.replay.seek(subscription, publish_ns, snapshot)

    def _expire_subscription(self, name: str) -> None:
        """Expiration timer: delete a subscription that was inactive for its ttl."""
        self._spawn(self._delete_expired(name))

    async def _delete_expired(self, name: str) -> None:
        with contextlib.suppress(ServiceError):  # deleted meanwhile
            await self.delete_subscription(name)

    # ----------------------------------------------------------------- delivery
    def _deliverable(self, name: str) -> SubscriptionState:
        """A subscription Pull and StreamingPull may take from: attached, and not push."""
        state = self._subscription(name)
        if state.config.detached:
            raise ServiceError(
                StatusCode.FAILED_PRECONDITION,
                f"The subscription is detached from its topic (subscription={name}).",
            )
        if state.config.push_config.push_endpoint:
            raise ServiceError(
                StatusCode.FAILED_PRECONDITION,
                "This method is not supported for push subscriptions with a defined push configuration.",
            )
        return state

    def push_state(self, subscription: str) -> SubscriptionState | None:
        """The delivery state of a live, attached push subscription (``None`` for anything else)."""
        state = self._subscriptions.get(subscription)
        if state is None or state.deleted or state.config.detached:
            return None
        return state if state.config.push_config.push_endpoint else None

    def lease(self, state: SubscriptionState, consumer: Consumer, max_messages: int) -> list[Any]:
        """Lease ready messages for a push worker (as :meth:`pull` does for a caller)."""
        return self._take(state, consumer, max_messages)

    def _take(self, state: SubscriptionState, consumer: Consumer, max_messages: int) -> list[Any]:
        """Lease up to ``max_messages`` ready messages to ``consumer``; drop those past retention."""
        if not state.ready and not state.more:
            return []
        config = state.config
        retention = limits.seconds(config.message_retention_duration) or limits.DEFAULT_RETENTION_SECONDS
        oldest_kept = self.wall_clock_ns() / 1e9 - retention
        out, expired = state.take(consumer, max_messages, oldest_kept)
        if expired:
            self._spawn(self._store.ack(state.name, expired))
        return out

    def _discard(self, state: SubscriptionState, sequences: list[int]) -> None:
        # Read from the store but never to be delivered (a filter refused them before a crash let the
        # publish-time acknowledgement happen): acknowledged now, in the background.
        self._spawn(self._store.ack(state.name, sequences))

    def _attempted(self, state: SubscriptionState, pending: Pending) -> None:
        """A delivery under a dead-letter policy ended unacknowledged: record its count in the store.

        Collected and written by one task per loop step, so a lease timer or a modack that ends many
        leases at once costs one store write per subscription (and the store groups those in a commit).
        """
        due = self._attempts_due
        if not due:
            task = asyncio.ensure_future(self._write_attempts())
            self._attempts_writes.add(task)
            task.add_done_callback(self._attempts_writes.discard)
        due.setdefault(state.name, {})[pending.sequence] = pending.attempts

    async def _write_attempts(self) -> None:
        due, self._attempts_due = self._attempts_due, {}
        for name, counts in due.items():
            try:
                await self._store.record_attempts(name, sorted(counts.items()))
            except Exception:  # best effort, as the service counts: the messages themselves are safe
                logger.exception("Recording delivery attempts of %s failed.", name)

    async def attempts_recorded(self) -> None:
        """Wait until the delivery attempts of every nack so far are in the store (ModifyAckDeadline
        answers only then, so a nack it acknowledged is counted after a crash)."""
        if self._attempts_writes:
            await asyncio.wait(list(self._attempts_writes))

    def _dead_letter(self, state: SubscriptionState, pending: Pending, topic: str) -> None:
        self._spawn(self._forward_dead_letter(state, pending, topic))

    async def _forward_dead_letter(self, state: SubscriptionState, pending: Pending, topic: str) -> None:
        """Publish a copy to the dead-letter topic, then acknowledge the message on its subscription.

        Runs in the background. Whatever goes wrong (a missing dead-letter topic, a failing store), the
        message goes back to the front of ``ready`` rather than being dropped; the next nack or deadline
        tries again.
        """
        forwarded = False
        try:
            if topic in self._topics and not self._forwarding_refused(state.name, topic):
                # (the real service keeps the message when the topic is missing, or may not be published to)
                # Not through publish(): the copy is the service's own, and the attributes it gains may take
                # a message that was at the 100-attribute limit past it; that must not drop the message.
                await self._append(topic, [dead_letter_copy(state.name, pending)])
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
            state.forwarded(pending, forwarded)

    def _forwarding_refused(self, subscription: str, topic: str) -> bool:
        if self.may_forward is None or self.may_forward(subscription, topic):
            self._refused_forwarding.discard((subscription, topic))
            return False
        if (subscription, topic) not in self._refused_forwarding:  # once, not at every nack
            self._refused_forwarding.add((subscription, topic))
            logger.warning(
                "Not forwarding from %s to the dead-letter topic %s: the topic does not grant its forwarding "
                "identity pubsub.topics.publish; messages stay for redelivery.",
                subscription,
                topic,
            )
        return True

    def open_consumer(
        self, subscription: str, ack_deadline: float, max_messages: int = 0, max_bytes: int = 0
    ) -> Consumer:
        """Check a subscription can deliver, and make a consumer (flow-control window) for it."""
        self._deliverable(subscription)
        self._expiration.stream_opened(subscription)
        return Consumer(ack_deadline, max_messages, max_bytes)

    async def pull(self, subscription: str, max_messages: int, wait_seconds: float) -> list[Any]:
        """Pull: lease up to ``max_messages``, waiting up to ``wait_seconds`` for the first one."""
        if max_messages <= 0:
            raise invalid(f"Invalid max_messages given: {max_messages}. It must be positive.")
        state = self._deliverable(subscription)
        self._expiration.touch(subscription)
        consumer = Consumer(float(state.config.ack_deadline_seconds))
        taken = self._take(state, consumer, min(max_messages, MAX_MESSAGES_PER_RESPONSE))
        if taken or wait_seconds <= 0:
            await self._record_leases(state, taken)
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
        await self._record_leases(state, taken)
        return taken

    async def next_batch(self, subscription: str, consumer: Consumer) -> list[Any]:
        """StreamingPull: wait until messages can be sent to ``consumer``; [] once it is closed, or at
        once when it owes its client :attr:`~Consumer.confirmations` (set them, then :meth:`wake`)."""
        while not consumer.closed:
            state = self._deliverable(subscription)
            taken = self._take(state, consumer, MAX_MESSAGES_PER_RESPONSE)
            if taken:
                await self._record_leases(state, taken)
                return taken
            if consumer.confirmations is not None:
                return []
            await state.wait_changed()
        return []

    def wake(self, subscription: str) -> None:
        """Wake the streams waiting in :meth:`next_batch` on ``subscription`` (one owes confirmations)."""
        state = self._subscriptions.get(subscription)
        if state is not None:
            state.notify()

    # Exactly-once leases outlive a restart: recorded before the messages are handed out, forgotten on
    # acknowledgement, rewritten on a modack (in the background), and restored by load().
    def _lease_rows(self, state: SubscriptionState, ack_ids: Iterable[str]) -> list[tuple[int, str, int]]:
        now_ns, now = self.wall_clock_ns(), self._clock.now()
        rows = []
        for ack_id in ack_ids:
            lease = state.leases.get(ack_id)
            if lease is not None:
                rows.append((lease.pending.sequence, ack_id, now_ns + round((lease.deadline - now) * 1e9)))
        return rows

    async def _record_leases(self, state: SubscriptionState, taken: list[Any]) -> None:
        if taken and state.config.enable_exactly_once_delivery:
            rows = self._lease_rows(state, [received.ack_id for received in taken])
            await self._store.put_leases(state.name, rows)

    def _modified(self, state: SubscriptionState, ack_ids: Sequence[str], before: dict[str, int]) -> None:
        """After a modack on an exactly-once subscription: record new deadlines, forget ended leases."""
        ended = [sequence for ack_id, sequence in before.items() if ack_id not in state.leases]
        if ended:
            self._spawn(self._store.drop_leases(state.name, ended))
        rows = self._lease_rows(state, ack_ids)
        if rows:
            self._spawn(self._store.put_leases(state.name, rows))

    def _restore_leases(self, state: SubscriptionState) -> None:
        """load(): leases of an exactly-once subscription recorded before a restart hold again."""
        now_ns = self.wall_clock_ns()
        stale = []
        counted = state.config.HasField("dead_letter_policy")
        for sequence, ack_id, deadline_ns in self._store.leases(state.name):
            page = self._store.pending(state.name, sequence - 1, 1)
            if deadline_ns <= now_ns or not page or page[0][0] != sequence:
                stale.append(sequence)
            else:
                # The restored lease is one more delivery than those that ended unacknowledged.
                ended = self._store.attempts(state.name, sequence - 1, sequence) if counted else {}
                state.restore_lease(
                    sequence, page[0][1], ack_id, (deadline_ns - now_ns) / 1e9, ended.get(sequence, 0) + 1
                )
        if stale:
            self._spawn(self._store.drop_leases(state.name, stale))

    def close_consumer(self, subscription: str, consumer: Consumer) -> None:
        """The stream ended; its leases keep their deadlines and run out as the real service's do."""
        if not consumer.closed:
            self._expiration.stream_closed(subscription)
        consumer.closed = True
        state = self._subscriptions.get(subscription)
        if state is not None:
            state.notify()

    async def acknowledge(
        self, subscription: str, ack_ids: Sequence[str], *, report: bool = True
    ) -> dict[str, str] | None:
        """Acknowledge. Unknown or expired ack IDs are ignored, as the real service does, unless the
        subscription has exactly-once delivery: then each one fails (once the others are acknowledged)
        with the per-ack-ID details of :func:`~._limits.ack_id_failures`. ``report=False`` (StreamingPull,
        which answers them with a confirmation on the stream) returns those failures instead (ack ID ->
        failure, empty when all succeeded); without exactly-once delivery it returns ``None``.
        """
        state = self._subscription(subscription)
        self._expiration.touch(subscription)
        failures = self._check_ack_ids(state, ack_ids)
        done = state.acknowledge(ack_ids)
        if done:
            await self.replay.acknowledged(state.config, done)
            await self._store.ack(subscription, done)
            if state.config.enable_exactly_once_delivery:
                await self._store.drop_leases(subscription, done)
        if failures and report:
            raise limits.ack_id_failures(failures)
        return failures if state.config.enable_exactly_once_delivery else None

    def modify_ack_deadline(self, subscription: str, ack_ids: Sequence[str], seconds: int) -> None:
        """ModifyAckDeadline: 0 is a nack; otherwise the lease runs ``seconds`` from now. With exactly-once
        delivery, ack IDs without a valid lease fail as in :meth:`acknowledge`."""
        state = self._subscription(subscription)
        self._expiration.touch(subscription)
        limits.check_ack_deadline(seconds, allow_zero=True, field="ack_deadline_seconds")
        failures = self._check_ack_ids(state, ack_ids)
        before = self._leased(state, ack_ids)
        state.modify(ack_ids, seconds)
        if before:
            self._modified(state, ack_ids, before)
        if failures:
            raise limits.ack_id_failures(failures)

    def modify_each(
        self, subscription: str, ack_ids: Sequence[str], seconds: Sequence[int]
    ) -> dict[str, str] | None:
        """StreamingPull's paired modify_deadline_ack_ids / modify_deadline_seconds. Returns the failures
        of ack IDs under exactly-once delivery (``None`` without it), as :meth:`acknowledge` with
        ``report=False`` does."""
        state = self._subscription(subscription)
        if len(ack_ids) != len(seconds):
            raise invalid(
                "modify_deadline_seconds and modify_deadline_ack_ids must have the same length "
                f"(got {len(seconds)} and {len(ack_ids)})."
            )
        failures = self._check_ack_ids(state, ack_ids)
        for value in seconds:
            limits.check_ack_deadline(value, allow_zero=True, field="modify_deadline_seconds")
        before = self._leased(state, ack_ids)
        for ack_id, value in zip(ack_ids, seconds, strict=True):
            state.modify((ack_id,), value)
        if before:
            self._modified(state, ack_ids, before)
        return failures if state.config.enable_exactly_once_delivery else None

    @staticmethod
    def _leased(state: SubscriptionState, ack_ids: Sequence[str]) -> dict[str, int]:
        """Of an exactly-once subscription: the sequences leased under ``ack_ids`` (else nothing)."""
        if not state.config.enable_exactly_once_delivery:
            return {}
        leases = state.leases
        return {ack_id: leases[ack_id].pending.sequence for ack_id in ack_ids if ack_id in leases}

    @staticmethod
    def _check_ack_ids(state: SubscriptionState, ack_ids: Sequence[str]) -> dict[str, str]:
        """Refuse an empty list; return the ack IDs that fail under exactly-once delivery (none without it).

        Without exactly-once a malformed ack ID fails the whole request; with it, it is one more failed
        ack ID, as is one that is unknown, expired or superseded by a later delivery of its message.
        """
        if not ack_ids:
            raise invalid("No ack IDs were given; at least one ack ID is required.")
        exactly_once = state.config.enable_exactly_once_delivery
        failures: dict[str, str] = {}
        for ack_id in ack_ids:
            prefix, _, number = ack_id.partition("-")
            if len(prefix) != 8 or not number.isdigit():
                if not exactly_once:
                    raise invalid(f"You have passed an invalid ack ID to the service (ack_id={ack_id}).")
                failures[ack_id] = limits.PERMANENT_FAILURE_INVALID_ACK_ID
            elif exactly_once and ack_id not in state.leases:
                failures[ack_id] = limits.PERMANENT_FAILURE_INVALID_ACK_ID
        return failures

    # ----------------------------------------------------------------- IAM
    def check_iam_resource(self, resource: str) -> None:
        """The resource of an IAM call must exist: a topic, subscription, snapshot or schema (not a
        revision, which carries no policy of its own); NOT_FOUND or INVALID_ARGUMENT otherwise."""
        if "/subscriptions/" in resource:
            self._subscription(resource)
        elif "/topics/" in resource:
            self._topic(resource)
        elif "/snapshots/" in resource:
            self.replay.get_snapshot(resource)
        elif "/schemas/" in resource:
            self.schemas.revision(limits.check_name(resource, "schemas"))
        else:
            raise invalid(
                f"Invalid resource name given (name={resource}); IAM policies are kept on topics, "
                "subscriptions, snapshots and schemas."
            )

    def _iam_resource_exists(self, resource: str) -> bool:
        try:
            self.check_iam_resource(resource)
        except ServiceError:
            return False
        return True

    def get_policy(self, resource: str) -> Any:
        """GetIamPolicy: the stored policy, or an empty one."""
        self.check_iam_resource(resource)
        policy = self._policies.get(resource)
        if policy is None:
            policy = Policy(version=1, etag=b"\x00\x00\x00\x00\x00\x00\x00\x00")
        return policy

    async def set_policy(self, resource: str, policy: Any) -> Any:
        """SetIamPolicy: replace the policy; a stale etag is refused with ABORTED."""
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

    async def _drop_policy(self, resource: str) -> None:
        """A deleted resource's policy goes with it: one re-created under its name starts with none."""
        self._policies.pop(resource, None)
        await self._store.delete("policies", resource)

    def stored_policy(self, resource: str) -> Any | None:
        """The policy set on a topic, subscription, snapshot or schema, or ``None`` (no checks: for IAM
        enforcement)."""
        return self._policies.get(resource)

    def topic_of_subscription(self, name: str) -> str | None:
        """The topic an existing, attached subscription receives from; ``None`` otherwise."""
        state = self._subscriptions.get(name)
        if state is None or state.config.topic not in self._topics:
            return None
        return state.config.topic
