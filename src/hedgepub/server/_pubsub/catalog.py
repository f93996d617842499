"""The catalog: the RPCs that create, change, list and delete topics and subscriptions, and the IAM
policies on resources.

It is the one part that changes the :class:`~.registry.Registry`; the checks of a resource's fields are
in :mod:`.resources`, the service's limits and messages in :mod:`.limits`. Changing a subscription tells
the parts that deliver it (push, Cloud Storage, replay, expiration).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from hedgepub.server._pubsub import limits as limits
from hedgepub.server._pubsub import resources as resources
from hedgepub.server._pubsub.cloud_storage import ExportDispatcher
from hedgepub.server._pubsub.consumers import Consumers
from hedgepub.server._pubsub.delivery import SubscriptionState
from hedgepub.server._pubsub.expiration import ExpirationWatch
from hedgepub.server._pubsub.leases import MAX_MESSAGES_PER_RESPONSE
from hedgepub.server._pubsub.limits import ServiceError, invalid, not_found
from hedgepub.server._pubsub.policies import IamPolicies
from hedgepub.server._pubsub.push import PushDispatcher
from hedgepub.server._pubsub.registry import Background, Registry
from hedgepub.server._pubsub.replay import Replay
from hedgepub.server._pubsub.schemas import SchemaRegistry
from hedgepub.server._pubsub.transforms import Transforms
from hedgepub.server._store.protocol import Store


class Catalog:
    """Topics and subscriptions (PublisherService's and SubscriberService's admin RPCs), DeleteSchema's
    effect on topics, and the IAM policy RPCs (which need the resource to exist)."""

    def __init__(
        self,
        store: Store,
        registry: Registry,
        background: Background,
        *,
        window: int,
        schemas: SchemaRegistry,
        replay: Replay,
        policies: IamPolicies,
        consumers: Consumers,
        expiration: ExpirationWatch,
        push: PushDispatcher,
        exports: ExportDispatcher,
        transforms: Transforms,
    ) -> None:
        self._store = store
        self._registry = registry
        self._background = background
        self._window = window
        self._schemas = schemas
        self._replay = replay
        self._policies = policies
        self._consumers = consumers
        self._expiration = expiration
        self._push = push
        self._exports = exports
        self._transforms = transforms

    def new_state(self, config: Any) -> SubscriptionState:
        """Delivery state of a subscription that has nothing in memory and nothing in the store yet."""
        state = SubscriptionState(
            config, self._consumers.leasing, self._store.pending, self._window, self._store.attempts
        )
        state.more = False
        return state

    def sync_delivery(self, name: str) -> None:
        """Start or stop the push worker and Cloud Storage writer of ``name`` after it changed."""
        self._push.sync(name)
        self._exports.sync(name)

    # ----------------------------------------------------------------- topics
    async def create_topic(self, request: Any) -> Any:
        """CreateTopic: the request is a ``Topic``."""
        registry = self._registry
        name = limits.check_topic_name(request.name)
        if name in registry.topics:
            raise limits.already_exists(name)
        resources.check_topic_fields(request)
        if request.HasField("schema_settings"):
            self._schemas.check_settings(request.schema_settings)
        await self._transforms.validate(request.message_transforms)
        topic = resources.copy_with(request, state=resources.topic_state(request))
        await self._store.put("topics", name, topic)
        if name in registry.topics:  # created concurrently while we waited for the store
            raise limits.already_exists(name)
        # No subscription re-attaches to a re-created topic: the real service points the subscriptions
        # of a deleted topic at _deleted-topic_ for good.
        registry.add_topic(topic)
        await self._replay.topic_changed(topic)
        return topic

    def get_topic(self, name: str) -> Any:
        """GetTopic."""
        return self._registry.topic(name)

    async def update_topic(self, update: Any, paths: Sequence[str]) -> Any:
        """UpdateTopic with a field mask."""
        current = self._registry.topic(update.name)
        updated = resources.masked_update("Topic", current, update, paths, resources.TOPIC_UPDATABLE)
        resources.check_topic_fields(updated)
        updated.state = resources.topic_state(updated)
        if updated.HasField("schema_settings") and updated.schema_settings != current.schema_settings:
            self._schemas.check_settings(updated.schema_settings)
        if updated.message_transforms != current.message_transforms:
            await self._transforms.validate(updated.message_transforms)
        await self._store.put("topics", updated.name, updated)
        self._registry.add_topic(updated)
        await self._replay.topic_changed(updated)
        return updated

    def list_topics(self, project: str, page_size: int, page_token: str) -> tuple[list[Any], str]:
        """ListTopics: one page of the project's topics, sorted by name."""
        topics = self._registry.topics
        page, token = resources.project_page(project, "topics", topics, page_size, page_token)
        return [topics[name] for name in page], token

    def list_topic_subscriptions(self, topic: str, page_size: int, page_token: str) -> tuple[list[str], str]:
        """ListTopicSubscriptions: names of the subscriptions attached to ``topic``."""
        self._registry.topic(topic)
        return resources.page(sorted(self._registry.attached.get(topic, {})), page_size, page_token)

    async def delete_topic(self, name: str) -> None:
        """DeleteTopic: subscriptions stay, pointing at ``_deleted-topic_``."""
        self._registry.topic(name)
        await self._store.delete("topics", name)
        attached = self._registry.remove_topic(name)
        await self._transforms.forget(name)
        await self._replay.topic_deleted(name)
        await self._policies.drop(name)
        for state in attached:
            config = resources.copy_with(state.config, topic=limits.DELETED_TOPIC)
            await self._store.put("subscriptions", config.name, config)
            state.config = config

    async def delete_schema(self, name: str) -> None:
        """DeleteSchema: topics that named it keep validating against nothing (``_deleted-schema_``)."""
        await self._schemas.delete(name)
        await self._policies.drop(name)
        for topic in list(self._registry.topics.values()):
            if topic.HasField("schema_settings") and topic.schema_settings.schema == name:
                updated = resources.copy_with(topic)
                updated.schema_settings.schema = limits.DELETED_SCHEMA
                await self._store.put("topics", updated.name, updated)
                self._registry.add_topic(updated)

    # ----------------------------------------------------------------- subscriptions
    async def create_subscription(self, request: Any) -> Any:
        """CreateSubscription: the request is a ``Subscription``."""
        registry = self._registry
        name = limits.check_subscription_name(request.name)
        if not request.topic:
            raise invalid("The topic of a subscription must be given.")
        registry.topic(request.topic)
        if name in registry.subscriptions:
            raise limits.already_exists(name)
        config = resources.copy_with(request, detached=False, state=0)
        config.ClearField("topic_message_retention_duration")  # output only: shown from the topic
        resources.check_subscription_fields(config, buckets=self._exports.buckets_dir is not None)
        self._check_dead_letter_topic(config)
        await self._transforms.validate(config.message_transforms)
        await self._store.put("subscriptions", name, config)
        if name in registry.subscriptions:
            raise limits.already_exists(name)
        if config.topic not in registry.topics:
            await self._store.delete("subscriptions", name)
            raise not_found(config.topic)
        state = self.new_state(config)
        registry.add_subscription(state)
        self._expiration.watch(config)
        await self._replay.subscription_changed(config)
        self.sync_delivery(name)
        return self._shown(config)

    def _check_dead_letter_topic(self, config: Any) -> None:
        """A dead-letter topic must exist when it is set: ``DeadLetterPolicy.dead_letter_topic``'s reference
        says "The operation will fail if the topic does not exist" (NOT_FOUND, naming it). Checked on create
        and on an update whose mask names the policy; a topic deleted later only stops forwarding."""
        if config.HasField("dead_letter_policy"):
            topic = config.dead_letter_policy.dead_letter_topic
            if topic and topic not in self._registry.topics:
                raise not_found(topic)

    def get_subscription(self, name: str) -> Any:
        """GetSubscription."""
        return self._shown(self._registry.subscription(name).config)

    def _shown(self, config: Any) -> Any:
        """A subscription as the service shows it: with its topic's retention in the output-only
        ``topic_message_retention_duration`` (a copy then; otherwise the stored object itself)."""
        topic = self._registry.topics.get(config.topic)
        if topic is None or not topic.HasField("message_retention_duration"):
            return config
        shown = resources.copy_with(config)
        shown.topic_message_retention_duration.CopyFrom(topic.message_retention_duration)
        return shown

    async def update_subscription(self, update: Any, paths: Sequence[str]) -> Any:
        """UpdateSubscription with a field mask."""
        state = self._registry.subscription(update.name)
        config = resources.masked_update(
            "Subscription", state.config, update, paths, resources.SUBSCRIPTION_UPDATABLE
        )
        resources.check_subscription_fields(
            config, state.config, buckets=self._exports.buckets_dir is not None
        )
        if any(path.split(".", 1)[0] == "dead_letter_policy" for path in paths):
            self._check_dead_letter_topic(config)
        if config.message_transforms != state.config.message_transforms:
            await self._transforms.validate(config.message_transforms)
        await self._store.put("subscriptions", config.name, config)
        state.config = config
        self._expiration.watch(config)  # an update is activity, and may change the ttl
        await self._replay.subscription_changed(config)
        self.sync_delivery(config.name)  # push_config may have switched it between push and pull
        return self._shown(config)

    async def modify_push_config(self, name: str, push_config: Any) -> None:
        """ModifyPushConfig: an endpoint makes it a push subscription; an empty config makes it pull."""
        state = self._registry.subscription(name)
        config = resources.copy_with(state.config)
        config.push_config.CopyFrom(push_config)
        resources.check_subscription_fields(
            config, state.config, buckets=self._exports.buckets_dir is not None
        )
        await self._store.put("subscriptions", name, config)
        state.config = config
        self.sync_delivery(name)

    def list_subscriptions(self, project: str, page_size: int, page_token: str) -> tuple[list[Any], str]:
        """ListSubscriptions: one page of the project's subscriptions, sorted by name."""
        subscriptions = self._registry.subscriptions
        page, token = resources.project_page(project, "subscriptions", subscriptions, page_size, page_token)
        return [self._shown(subscriptions[name].config) for name in page], token

    async def detach_subscription(self, name: str) -> None:
        """DetachSubscription: the subscription stays but receives and delivers nothing more."""
        state = self._registry.subscription(name)
        config = resources.copy_with(state.config, detached=True)
        await self._store.put("subscriptions", name, config)
        state.config = config
        self._registry.detach(state)
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
        self.sync_delivery(name)

    async def delete_subscription(self, name: str) -> None:
        """DeleteSubscription: its backlog goes with it."""
        state = self._registry.subscription(name)
        await self._store.delete("subscriptions", name)
        await self._replay.subscription_deleted(name)
        await self._policies.drop(name)
        await self._transforms.forget(name)
        if self._registry.remove_subscription(state):
            self._expiration.forget(name)
            state.drain()
            state.close()
            self.sync_delivery(name)

    def expire_subscription(self, name: str) -> None:
        """Expiration timer: delete a subscription that was inactive for its ttl."""
        self._background.spawn(self._delete_expired(name))

    async def _delete_expired(self, name: str) -> None:
        with contextlib.suppress(ServiceError):  # deleted meanwhile
            await self.delete_subscription(name)

    # ----------------------------------------------------------------- IAM
    def check_iam_resource(self, resource: str) -> None:
        """The resource of an IAM call must exist: a topic, subscription, snapshot or schema (not a
        revision, which carries no policy of its own); NOT_FOUND or INVALID_ARGUMENT otherwise."""
        if "/subscriptions/" in resource:
            self._registry.subscription(resource)
        elif "/topics/" in resource:
            self._registry.topic(resource)
        elif "/snapshots/" in resource:
            self._replay.get_snapshot(resource)
        elif "/schemas/" in resource:
            self._schemas.revision(limits.check_name(resource, "schemas"))
        else:
            raise invalid(
                f"Invalid resource name given (name={resource}); IAM policies are kept on topics, "
                "subscriptions, snapshots and schemas."
            )

    def iam_resource_exists(self, resource: str) -> bool:
        """Whether ``resource`` is one an IAM policy may be kept on, and exists."""
        try:
            self.check_iam_resource(resource)
        except ServiceError:
            return False
        return True

    def get_policy(self, resource: str) -> Any:
        """GetIamPolicy: the stored policy, or an empty one."""
        self.check_iam_resource(resource)
        return self._policies.get(resource)

    async def set_policy(self, resource: str, policy: Any) -> Any:
        """SetIamPolicy: replace the policy; a stale etag is refused with ABORTED."""
        self.check_iam_resource(resource)
        return await self._policies.set(resource, policy)
