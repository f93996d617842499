"""The Pub/Sub core: the coordinator the faces call, with no gRPC in sight.

All state lives on one event loop; nothing here is thread-safe. The faces call these methods with raw
protobuf requests and turn :class:`ServiceError` into status codes.

The core keeps the topics and subscriptions (checks in :mod:`.resources`), writes through to the
:class:`Store`, and hands the rest to its parts, each built here with what it needs:
:class:`~.publishing.Publishing` (Publish, fan-out), :class:`~.consumers.Consumers` (pull, leases, acks,
dead-letter forwarding; each subscription's state machine in :mod:`.delivery`),
:class:`~.policies.IamPolicies`, :class:`~.replay.Replay` (snapshots, Seek, retention),
:class:`~.schemas.SchemaRegistry`, :class:`~.expiration.ExpirationWatch` and
:class:`~.push.PushDispatcher`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from hedgepub._clock import DEFAULT_CLOCK, Clock
from hedgepub.server._pubsub import limits as limits
from hedgepub.server._pubsub import resources as resources
from hedgepub.server._pubsub.cloud_storage import ExportDispatcher
from hedgepub.server._pubsub.consumers import Consumers
from hedgepub.server._pubsub.delivery import DEFAULT_WINDOW, SubscriptionState
from hedgepub.server._pubsub.expiration import RECORD_EVERY, ExpirationWatch
from hedgepub.server._pubsub.leases import MAX_MESSAGES_PER_RESPONSE, Consumer
from hedgepub.server._pubsub.limits import ServiceError, invalid, not_found
from hedgepub.server._pubsub.oidc import PushTokenSigner
from hedgepub.server._pubsub.policies import IamPolicies
from hedgepub.server._pubsub.publishing import Publishing
from hedgepub.server._pubsub.push import PushDispatcher
from hedgepub.server._pubsub.replay import Replay
from hedgepub.server._pubsub.schemas import SchemaRegistry
from hedgepub.server._pubsub.transforms import Transforms
from hedgepub.server._store.protocol import Snapshot, Store, StoredMessage

logger = logging.getLogger("hedgepub.server")

Topic: Any = resources.Topic
Subscription: Any = resources.Subscription

__all__ = ["MAX_MESSAGES_PER_RESPONSE", "Consumer", "PubSubCore"]


class PubSubCore:
    """Topics, subscriptions, IAM policies and delivery, written through to a :class:`Store`.

    ``clock`` drives leases and waits. ``wall_clock_ns`` is the calendar time in nanoseconds since the
    epoch, which ``publish_time`` and message retention are about; replace it (it is a plain attribute)
    to test retention without waiting for it. ``window`` is how many ready messages each subscription
    holds in memory; the rest of its backlog is read from the store in pages as it drains.
    ``push_tokens`` signs push requests' OIDC tokens (default: a key made in memory when first needed).
    ``buckets_dir`` stands for Cloud Storage: Cloud Storage subscriptions write their files under it
    (without it they are refused).
    ``policies`` holds the IAM policies (default: a new table on ``store``; IAM enforcement reads the
    one it is given). ``may_forward(subscription, topic)`` says whether the service may forward to a
    dead-letter topic (IAM enforcement: the topic must grant its forwarding identity publishing);
    ``None`` allows every forwarding.
    """

    def __init__(
        self,
        store: Store,
        clock: Clock = DEFAULT_CLOCK,
        wall_clock_ns: Callable[[], int] = time.time_ns,
        *,
        window: int = DEFAULT_WINDOW,
        push_tokens: PushTokenSigner | None = None,
        buckets_dir: str | os.PathLike[str] | None = None,
        policies: IamPolicies | None = None,
        may_forward: Callable[[str, str], bool] | None = None,
    ) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1; got {window}")
        self._store = store
        self._window = window
        self._clock = clock
        self.wall_clock_ns = wall_clock_ns
        # The tables are changed in place, never replaced: the parts below hold them.
        self._topics: dict[str, Any] = {}
        self._subscriptions: dict[str, SubscriptionState] = {}
        self._attached: dict[str, dict[str, SubscriptionState]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        #: The IAM policies set on resources.
        self.policies = policies if policies is not None else IamPolicies(store)
        self._expiration = ExpirationWatch(clock, self._expire_subscription, self._record_activity)
        #: Subscriptions' activity to record (name -> ns since the epoch), written once per loop step.
        self._activity_due: dict[str, int] = {}
        self._activity_written: asyncio.Future[None] | None = None
        wall_ns = lambda: self.wall_clock_ns()  # noqa: E731 (read late: tests replace the attribute)
        #: Snapshots, Seek and retention.
        self.replay = Replay(
            store,
            clock,
            wall_ns,
            self._subscription,
            lambda: list(self._subscriptions.values()),
            self._topic,
            self._spawn,
            forgotten=self.policies.drop,
        )
        #: Schemas and their revisions (SchemaService); topics' schema_settings name them.
        self.schemas = SchemaRegistry(store, wall_ns)
        #: Message transforms: UDFs in a sandbox of worker processes, started on first use.
        self.transforms = Transforms()
        #: Publish and the fan-out of stored messages.
        self.publishing = Publishing(
            store,
            wall_ns,
            self._topics,
            self._attached,
            schemas=self.schemas,
            replay=self.replay,
            transforms=self.transforms,
        )
        #: Pull, StreamingPull and push leases, acks, deadlines and dead-letter forwarding.
        self.consumers = Consumers(
            store,
            clock,
            wall_ns,
            self._subscriptions,
            self._topics,
            expiration=self._expiration,
            replay=self.replay,
            append=self.publishing.append,
            spawn=self._spawn,
            may_forward=may_forward,
            transforms=self.transforms,
        )
        #: One push worker per push subscription (started and stopped as subscriptions change).
        self.push = PushDispatcher(self.consumers, clock, push_tokens)
        #: One Cloud Storage writer per Cloud Storage subscription, into ``buckets_dir`` (none without it).
        self.exports = ExportDispatcher(self.consumers, clock, buckets_dir)

    # ----------------------------------------------------------------- lifecycle
    def load(self, snapshot: Snapshot | None = None) -> None:
        """Take back what the store holds (topics, subscriptions, policies); backlogs are read lazily."""
        snapshot = snapshot if snapshot is not None else self._store.load()
        self._topics.clear()
        self._topics.update(snapshot.topics)
        self.schemas.load(snapshot.schemas)
        self.publishing.next_sequence = snapshot.next_sequence
        self._subscriptions.clear()
        self._attached.clear()
        now_ns = self.wall_clock_ns()
        for name, config in snapshot.subscriptions.items():
            state = self._new_state(config)
            state.more = not config.detached  # its backlog, if any, is read when first needed
            self._subscriptions[name] = state
            self._expiration.watch(config, self._idle_seconds(snapshot.activity.get(name), now_ns))
            if not config.detached and config.topic in self._topics:
                self._attached.setdefault(config.topic, {})[name] = state
        self.replay.load(snapshot.snapshots, list(self._topics.values()))
        orphans = self.policies.load(snapshot.policies, self._iam_resource_exists)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # loaded outside a loop (some tests): push and replay start with the next change
            return
        for resource in orphans:
            self._spawn(self._store.delete("policies", resource))
        self.replay.start()
        for name, state in self._subscriptions.items():
            if state.config.enable_exactly_once_delivery and not state.config.detached:
                self.consumers.restore_leases(state)
            self._sync_delivery(name)

    def _sync_delivery(self, name: str) -> None:
        """Start or stop the push worker and Cloud Storage writer of ``name`` after it changed."""
        self.push.sync(name)
        self.exports.sync(name)

    @staticmethod
    def _idle_seconds(active_ns: int | None, now_ns: int) -> float:
        """How long a subscription recorded active at ``active_ns`` has been inactive (at least): its last
        activity may come up to ``RECORD_EVERY`` after the record, so the clock goes on from there. A
        subscription without a record (an earlier hedgepub's data) starts its clock now."""
        if active_ns is None:
            return 0.0
        return max(0.0, (now_ns - active_ns) / 1e9 - RECORD_EVERY)

    def _record_activity(self, name: str) -> asyncio.Future[None]:
        """Expiration: record that ``name`` is active now; one store write per loop step for all. The
        future returned ends once the record is written (or failed to be: that is logged, not raised)."""
        due = self._activity_due
        written = self._activity_written
        if not due or written is None:
            written = self._activity_written = asyncio.get_running_loop().create_future()
            self._spawn(self._write_activity(written))
        due[name] = self.wall_clock_ns()
        return asyncio.shield(written)

    async def _write_activity(self, written: asyncio.Future[None]) -> None:
        due, self._activity_due = self._activity_due, {}
        try:
            await self._store.put_activity(list(due.items()))
        except Exception:  # the clock then goes on from an older record: a restart may expire it sooner
            logger.exception("Recording the activity of %d subscriptions failed.", len(due))
        finally:
            if not written.done():
                written.set_result(None)

    def _new_state(self, config: Any) -> SubscriptionState:
        """Delivery state of a subscription that has nothing in memory and nothing in the store yet."""
        state = SubscriptionState(
            config, self.consumers.leasing, self._store.pending, self._window, self._store.attempts
        )
        state.more = False
        return state

    async def close(self) -> None:
        """Stop push delivery, timers and background work, and close the store."""
        await self.push.close()
        await self.exports.close()
        await self.transforms.close()
        self.consumers.leasing.close()
        self._expiration.close()
        self.replay.close()
        written = self._activity_written
        if self._activity_due and written is not None:  # before its task, which may not have started,
            await self._write_activity(written)  # is cancelled below
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
        await self.exports.close()
        await self.transforms.close()
        for state in self._subscriptions.values():
            state.close()
        self._topics.clear()
        self._subscriptions.clear()
        self._attached.clear()
        self.policies.clear()
        self.schemas.clear()
        self.consumers.leasing.clear()
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
        await self.transforms.validate(request.message_transforms)
        topic = resources.copy_with(request, state=resources.topic_state(request))
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
        updated.state = resources.topic_state(updated)
        if updated.HasField("schema_settings") and updated.schema_settings != current.schema_settings:
            self.schemas.check_settings(updated.schema_settings)
        if updated.message_transforms != current.message_transforms:
            await self.transforms.validate(updated.message_transforms)
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
        await self.transforms.forget(name)
        await self.replay.topic_deleted(name)
        await self.policies.drop(name)
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
        self._sync_delivery(name)

    # ----------------------------------------------------------------- publish (see _publishing)
    async def publish(
        self, topic_name: str, messages: Any, request_bytes: int, request: Any = None
    ) -> list[str]:
        """Publish: validate, number, make durable, fan out; return the message IDs (``request``: the
        ``PublishRequest`` holding ``messages``, which the store may keep as it is)."""
        return await self.publishing.publish(topic_name, messages, request_bytes, request)

    async def delete_schema(self, name: str) -> None:
        """DeleteSchema: topics that named it keep validating against nothing (``_deleted-schema_``)."""
        await self.schemas.delete(name)
        await self.policies.drop(name)
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
        resources.check_subscription_fields(config, buckets=self.exports.buckets_dir is not None)
        self._check_dead_letter_topic(config)
        await self.transforms.validate(config.message_transforms)
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
        self._sync_delivery(name)
        return self._shown(config)

    def _check_dead_letter_topic(self, config: Any) -> None:
        """A dead-letter topic must exist when it is set: ``DeadLetterPolicy.dead_letter_topic``'s reference
        says "The operation will fail if the topic does not exist" (NOT_FOUND, naming it). Checked on create
        and on an update whose mask names the policy; a topic deleted later only stops forwarding."""
        if config.HasField("dead_letter_policy"):
            topic = config.dead_letter_policy.dead_letter_topic
            if topic and topic not in self._topics:
                raise not_found(topic)

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
        resources.check_subscription_fields(
            config, state.config, buckets=self.exports.buckets_dir is not None
        )
        if any(path.split(".", 1)[0] == "dead_letter_policy" for path in paths):
            self._check_dead_letter_topic(config)
        if config.message_transforms != state.config.message_transforms:
            await self.transforms.validate(config.message_transforms)
        await self._store.put("subscriptions", config.name, config)
        state.config = config
        self._expiration.watch(config)  # an update is activity, and may change the ttl
        await self.replay.subscription_changed(config)
        self._sync_delivery(config.name)  # push_config may have switched it between push and pull
        return self._shown(config)

    async def modify_push_config(self, name: str, push_config: Any) -> None:
        """ModifyPushConfig: an endpoint makes it a push subscription; an empty config makes it pull."""
        state = self._subscription(name)
        config = resources.copy_with(state.config)
        config.push_config.CopyFrom(push_config)
        resources.check_subscription_fields(
            config, state.config, buckets=self.exports.buckets_dir is not None
        )
        await self._store.put("subscriptions", name, config)
        state.config = config
        self._sync_delivery(name)

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
        await self.policies.drop(name)
        await self.transforms.forget(name)
        if self._subscriptions.get(name) is state:
            del self._subscriptions[name]
            self._attached.get(state.config.topic, {}).pop(name, None)
            self._expiration.forget(name)
            state.drain()
            state.close()
            self._sync_delivery(name)

    async def seek(self, subscription: str, publish_ns: int | None, snapshot: str | None) -> None:
        """Seek to a time (ns since the epoch) or to a snapshot (see :mod:`.replay`); it is activity."""
        recorded = self._expiration.touch(subscription)
        await self.replay.seek(subscription, publish_ns, snapshot)
        if recorded is not None:
            await recorded

    def _expire_subscription(self, name: str) -> None:
        """Expiration timer: delete a subscription that was inactive for its ttl."""
        self._spawn(self._delete_expired(name))

    async def _delete_expired(self, name: str) -> None:
        with contextlib.suppress(ServiceError):  # deleted meanwhile
            await self.delete_subscription(name)

    # ----------------------------------------------------------------- consumers (see _consumers)
    def open_consumer(
        self, subscription: str, ack_deadline: float, max_messages: int = 0, max_bytes: int = 0
    ) -> Consumer:
        """Check a subscription can deliver, and make a consumer (flow-control window) for it."""
        return self.consumers.open_consumer(subscription, ack_deadline, max_messages, max_bytes)

    def close_consumer(self, subscription: str, consumer: Consumer) -> None:
        """The stream ended; its leases keep their deadlines and run out as the real service's do."""
        self.consumers.close_consumer(subscription, consumer)

    async def pull(self, subscription: str, max_messages: int, wait_seconds: float) -> list[Any]:
        """Pull: lease up to ``max_messages``, waiting up to ``wait_seconds`` for the first one."""
        return await self.consumers.pull(subscription, max_messages, wait_seconds)

    async def next_batch(self, subscription: str, consumer: Consumer) -> list[Any]:
        """StreamingPull: the next messages for ``consumer`` (see :meth:`.Consumers.next_batch`)."""
        return await self.consumers.next_batch(subscription, consumer)

    def wake(self, subscription: str) -> None:
        """Wake the streams waiting in :meth:`next_batch` on ``subscription`` (one owes confirmations)."""
        self.consumers.wake(subscription)

    async def acknowledge(
        self, subscription: str, ack_ids: Sequence[str], *, report: bool = True
    ) -> dict[str, str] | None:
        """Acknowledge (see :meth:`.Consumers.acknowledge`)."""
        return await self.consumers.acknowledge(subscription, ack_ids, report=report)

    def modify_ack_deadline(self, subscription: str, ack_ids: Sequence[str], seconds: int) -> None:
        """ModifyAckDeadline: 0 is a nack (see :meth:`.Consumers.modify_ack_deadline`)."""
        self.consumers.modify_ack_deadline(subscription, ack_ids, seconds)

    def modify_each(
        self, subscription: str, ack_ids: Sequence[str], seconds: Sequence[int]
    ) -> dict[str, str] | None:
        """StreamingPull's paired modacks (see :meth:`.Consumers.modify_each`)."""
        return self.consumers.modify_each(subscription, ack_ids, seconds)

    async def attempts_recorded(self) -> None:
        """Wait until the delivery attempts of every nack so far are in the store."""
        await self.consumers.attempts_recorded()

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
        return self.policies.get(resource)

    async def set_policy(self, resource: str, policy: Any) -> Any:
        """SetIamPolicy: replace the policy; a stale etag is refused with ABORTED."""
        self.check_iam_resource(resource)
        return await self.policies.set(resource, policy)

    def stored_policy(self, resource: str) -> Any | None:
        """The policy set on a topic, subscription, snapshot or schema, or ``None`` (no checks)."""
        return self.policies.stored(resource)

    def topic_of_subscription(self, name: str) -> str | None:
        """The topic an existing, attached subscription receives from; ``None`` otherwise."""
        state = self._subscriptions.get(name)
        if state is None or state.config.topic not in self._topics:
            return None
        topic: str = state.config.topic
        return topic
