"""The gRPC face of the server: thin handlers for ``google.pubsub.v1`` and ``google.iam.v1``.

:class:`PubSubServicer` has one coroutine per RPC of the table in :mod:`hedgepub.server._methods`, named
as the method; each calls the part of the core that owns the RPC (:mod:`hedgepub.server._pubsub.core`
builds them). :mod:`.dispatch` serves them: it parses each request, asks
:meth:`PubSubServicer.authorize` for the RPC's permission and turns a
:class:`~hedgepub.server._pubsub.limits.ServiceError` into a status code.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc
import grpc.aio
from google.iam.v1 import iam_policy_pb2
from google.protobuf import empty_pb2
from google.pubsub_v1.types import pubsub as pubsub_types
from google.pubsub_v1.types import schema as schema_types

from hedgepub.server._api.client_telemetry import HedgeTelemetry, telemetry_batch_key
from hedgepub.server._api.dispatch import MALFORMED
from hedgepub.server._api.request_log import call_peer
from hedgepub.server._iam import iam as _iam
from hedgepub.server._pubsub.core import PubSubCore
from hedgepub.server._pubsub.hedge_dedup import BATCH_ID_METADATA, HedgeBatchWindow
from hedgepub.server._pubsub.limits import ServiceError, check_ack_deadline, invalid
from hedgepub.server._pubsub.resources import page

logger = logging.getLogger("hedgepub.server")

#: How long a Pull without ``return_immediately`` waits for a first message before answering empty.
PULL_WAIT_SECONDS = 5.0

_pb = pubsub_types
_schema = schema_types
_Empty = empty_pb2.Empty


def _metadata_value(metadata: Any, key: str) -> str | None:
    for name, value in metadata or ():
        if name == key:
            return value if isinstance(value, str) else None
    return None


def _field(request: Any, path: str) -> str:
    value = request
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _masks(paths: Iterable[str], field: str) -> bool:
    """Whether an update mask's ``paths`` name ``field`` or a field inside it."""
    return any(path == field or path.startswith(f"{field}.") for path in paths)


class PubSubServicer:
    """Every implemented RPC, as coroutines taking ``(request, context)``."""

    def __init__(
        self,
        core: PubSubCore,
        authorizer: _iam.Authorizer | None = None,
        hedge_window: HedgeBatchWindow | None = None,
        hedge_telemetry: HedgeTelemetry | None = None,
    ) -> None:
        self.core = core
        # The parts that own the RPCs (the core is their composition root).
        self.registry = core.registry
        self.catalog = core.catalog
        self.publishing = core.publishing
        self.consumers = core.consumers
        self.replay = core.replay
        self.schemas = core.schemas
        self.authorizer: _iam.Authorizer = authorizer or _iam.AllowAll()
        self._enforcing = not isinstance(self.authorizer, _iam.AllowAll)
        #: ``--dedup-hedges``: attempts of one hedged batch are stored once (off: None).
        self.hedge_window = hedge_window
        #: Reads and counts each Publish call's x-goog-pubsub-client-telemetry header.
        self.hedge_telemetry = hedge_telemetry if hedge_telemetry is not None else HedgeTelemetry()

    async def authorize(self, method: str, request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """The one place an RPC's permission is checked (no-op unless an enforcing authorizer is set)."""
        if not self._enforcing:
            return
        metadata = tuple(context.invocation_metadata() or ())
        # Who the caller is comes first: nothing is looked up for a caller without a known token.
        authenticate = getattr(self.authorizer, "authenticate", None)
        if authenticate is not None:
            authenticate(metadata)
        for check in _iam.RPC_PERMISSIONS.get(method, ()):
            if check.when_masked and not _masks(request.update_mask.paths, check.when_masked):
                continue
            resource = _field(request, check.field)
            if check.optional and not resource:
                continue
            permission = check.permission
            if check.on_topic:
                # Checked on the subscription's topic; an unknown subscription leaves the project's policy.
                resource = self.registry.topic_of_subscription(resource) or resource
            if method.endswith("IamPolicy"):
                permission = _iam.resource_permission(resource, permission)
            await self.authorizer.check(metadata, permission, resource)

    # ------------------------------------------------------------ Publisher
    async def CreateTopic(self, request: Any, context: Any) -> Any:
        return await self.catalog.create_topic(request)

    async def GetTopic(self, request: Any, context: Any) -> Any:
        return self.catalog.get_topic(request.topic)

    async def UpdateTopic(self, request: Any, context: Any) -> Any:
        return await self.catalog.update_topic(request.topic, list(request.update_mask.paths))

    async def ListTopics(self, request: Any, context: Any) -> Any:
        return _paged(_pb.ListTopicsResponse, "topics", self.catalog.list_topics, request.project, request)

    async def ListTopicSubscriptions(self, request: Any, context: Any) -> Any:
        lister = self.catalog.list_topic_subscriptions
        return _paged(_pb.ListTopicSubscriptionsResponse, "subscriptions", lister, request.topic, request)

    async def DeleteTopic(self, request: Any, context: Any) -> Any:
        await self.catalog.delete_topic(request.topic)
        return _Empty()

    async def DetachSubscription(self, request: Any, context: Any) -> Any:
        await self.catalog.detach_subscription(request.subscription)
        return _pb.DetachSubscriptionResponse.pb()()

    async def Publish(self, request: Any, context: Any) -> Any:
        size = request.ByteSize()
        metadata = context.invocation_metadata()
        attempt = self.hedge_telemetry.read(metadata, lambda: call_peer(context))
        window = self.hedge_window
        if window is not None:
            # hedgepub's own batch id first; any client's x-goog-pubsub-client-telemetry otherwise.
            batch_id = _metadata_value(metadata, BATCH_ID_METADATA)
            if not batch_id and attempt is not None:
                batch_id = telemetry_batch_key(attempt, request.messages)
            if batch_id:
                ids = await window.publish_once(
                    request.topic,
                    batch_id,
                    (len(request.messages), size),
                    lambda: self.publishing.publish(request.topic, request.messages, size, request),
                )
                return _PublishResponse(message_ids=ids)
        ids = await self.publishing.publish(request.topic, request.messages, size, request)
        return _PublishResponse(message_ids=ids)

    # ------------------------------------------------------------ Subscriber
    async def CreateSubscription(self, request: Any, context: Any) -> Any:
        if request.HasField("dead_letter_policy"):
            self._check_dead_letter_topic(request.name, request.dead_letter_policy)
        return await self.catalog.create_subscription(request)

    def _check_dead_letter_topic(self, subscription: str, policy: Any) -> None:
        """While enforcing: the service must be allowed to publish to the dead-letter topic it would use.

        A topic that is malformed or does not exist is the catalog's to answer (INVALID_ARGUMENT,
        NOT_FOUND)."""
        if isinstance(self.authorizer, _iam.IamEnforcer) and policy.dead_letter_topic:
            try:
                self.catalog.get_topic(policy.dead_letter_topic)
            except ServiceError:
                return
            self.authorizer.check_dead_letter_topic(subscription, policy.dead_letter_topic)

    async def GetSubscription(self, request: Any, context: Any) -> Any:
        return self.catalog.get_subscription(request.subscription)

    async def UpdateSubscription(self, request: Any, context: Any) -> Any:
        if "dead_letter_policy" in request.update_mask.paths:
            self._check_dead_letter_topic(request.subscription.name, request.subscription.dead_letter_policy)
        return await self.catalog.update_subscription(request.subscription, list(request.update_mask.paths))

    async def ListSubscriptions(self, request: Any, context: Any) -> Any:
        lister = self.catalog.list_subscriptions
        return _paged(_pb.ListSubscriptionsResponse, "subscriptions", lister, request.project, request)

    async def DeleteSubscription(self, request: Any, context: Any) -> Any:
        await self.catalog.delete_subscription(request.subscription)
        return _Empty()

    # Replay: snapshots and Seek (see hedgepub.server._pubsub.replay).
    async def CreateSnapshot(self, request: Any, context: Any) -> Any:
        return await self.replay.create_snapshot(request.name, request.subscription, request.labels)

    async def GetSnapshot(self, request: Any, context: Any) -> Any:
        return self.replay.get_snapshot(request.snapshot)

    async def ListSnapshots(self, request: Any, context: Any) -> Any:
        lister = self.replay.list_snapshots
        return _paged(_pb.ListSnapshotsResponse, "snapshots", lister, request.project, request)

    async def ListTopicSnapshots(self, request: Any, context: Any) -> Any:
        lister = self.replay.list_topic_snapshots
        return _paged(_pb.ListTopicSnapshotsResponse, "snapshots", lister, request.topic, request)

    async def UpdateSnapshot(self, request: Any, context: Any) -> Any:
        return await self.replay.update_snapshot(request.snapshot, list(request.update_mask.paths))

    async def DeleteSnapshot(self, request: Any, context: Any) -> Any:
        await self.replay.delete_snapshot(request.snapshot)
        return _Empty()

    async def Seek(self, request: Any, context: Any) -> Any:
        target = request.WhichOneof("target")
        if target is None:
            raise invalid("A Seek request must give either a time or a snapshot.")
        if target == "time":
            await self.replay.seek(request.subscription, request.time.ToNanoseconds(), None)
        else:  # an empty snapshot name is still a snapshot target: refused as an invalid name
            await self.replay.seek(request.subscription, None, request.snapshot)
        return _pb.SeekResponse.pb()()

    async def ModifyPushConfig(self, request: Any, context: Any) -> Any:
        await self.catalog.modify_push_config(request.subscription, request.push_config)
        return _Empty()

    async def Pull(self, request: Any, context: Any) -> Any:
        wait = 0.0
        if not request.return_immediately:
            wait = PULL_WAIT_SECONDS
            remaining = context.time_remaining()
            if remaining is not None:
                # Answer (empty) a little before the caller's deadline rather than let it expire.
                wait = max(0.0, min(wait, remaining - 0.1))
        received = await self.consumers.pull(request.subscription, request.max_messages, wait)
        return _pb.PullResponse.pb()(received_messages=received)

    async def Acknowledge(self, request: Any, context: Any) -> Any:
        await self.consumers.acknowledge(request.subscription, request.ack_ids)
        return _Empty()

    async def ModifyAckDeadline(self, request: Any, context: Any) -> Any:
        self.consumers.modify_ack_deadline(
            request.subscription, request.ack_ids, request.ack_deadline_seconds
        )
        if request.ack_deadline_seconds == 0:  # a nack: answered once its delivery count is stored
            await self.consumers.attempts_recorded()
        return _Empty()

    async def StreamingPull(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        """Bidirectional: a reader task applies acks, modacks and deadline changes; we send messages and,
        under exactly-once delivery, the confirmations of those acks and modacks (:class:`_Confirmations`)."""
        consumers, catalog = self.consumers, self.catalog
        first = await _next_request(requests)
        if first is None:
            return
        # The caller's token first, then the request, as for the unary RPCs.
        await self.authorize("StreamingPull", first, context)
        subscription = first.subscription
        if not subscription:
            raise invalid("The first StreamingPullRequest must name a subscription.")
        deadline = check_ack_deadline(
            first.stream_ack_deadline_seconds, allow_zero=False, field="stream_ack_deadline_seconds"
        )
        if first.max_outstanding_messages < 0 or first.max_outstanding_bytes < 0:
            raise invalid("max_outstanding_messages and max_outstanding_bytes must not be negative.")
        consumer = consumers.open_consumer(
            subscription, float(deadline), first.max_outstanding_messages, first.max_outstanding_bytes
        )
        failure: list[Exception] = []

        def confirm(acknowledged: bool, ack_ids: Any, failures: dict[str, str] | None) -> None:
            """Exactly-once delivery (failures is None without it): owe the client a confirmation."""
            if failures is None:
                return
            if consumer.confirmations is None:
                consumer.confirmations = _Confirmations()
            consumer.confirmations.add(acknowledged, ack_ids, failures)
            consumers.wake(subscription)

        async def acknowledge(ack_ids: Any) -> None:
            confirm(True, ack_ids, await consumers.acknowledge(subscription, ack_ids, report=False))

        def apply(request: Any) -> None:
            if request.stream_ack_deadline_seconds:
                consumer.ack_deadline = float(
                    check_ack_deadline(
                        request.stream_ack_deadline_seconds,
                        allow_zero=False,
                        field="stream_ack_deadline_seconds",
                    )
                )
            if request.modify_deadline_ack_ids or request.modify_deadline_seconds:
                ack_ids = request.modify_deadline_ack_ids
                confirm(
                    False,
                    ack_ids,
                    consumers.modify_each(subscription, ack_ids, request.modify_deadline_seconds),
                )

        async def read() -> None:
            try:
                apply(first)
                if first.ack_ids:
                    await acknowledge(first.ack_ids)
                while True:
                    request = await _next_request(requests)
                    if request is None:
                        break
                    apply(request)
                    if request.ack_ids:
                        await acknowledge(request.ack_ids)
            except (asyncio.CancelledError, grpc.RpcError):
                pass
            except Exception as error:  # e.g. an ack the store could not write: end the stream with it
                failure.append(error)
            finally:
                consumers.close_consumer(subscription, consumer)

        reader = asyncio.ensure_future(read())
        try:
            while True:
                batch = await consumers.next_batch(subscription, consumer)
                if failure:
                    raise failure[0]
                owed, consumer.confirmations = consumer.confirmations, None
                if not batch and owed is None:
                    break
                # Read per response: an UpdateSubscription can turn exactly-once delivery on or off.
                config = catalog.get_subscription(subscription)
                properties = _SubscriptionProperties(
                    message_ordering_enabled=config.enable_message_ordering,
                    exactly_once_delivery_enabled=config.enable_exactly_once_delivery,
                )
                response = _StreamingPullResponse(received_messages=batch, subscription_properties=properties)
                if owed is not None:  # with the messages ready now, if any, as the real service may
                    owed.fill(response)
                yield response
        finally:
            consumers.close_consumer(subscription, consumer)
            reader.cancel()

    # ------------------------------------------------------------ SchemaService
    async def CreateSchema(self, request: Any, context: Any) -> Any:
        return await self.schemas.create(request.parent, request.schema_id, request.schema)

    async def GetSchema(self, request: Any, context: Any) -> Any:
        return self.schemas.get(request.name, request.view)

    async def ListSchemas(self, request: Any, context: Any) -> Any:
        schemas = self.schemas
        names, token = page(schemas.names(request.parent), request.page_size, request.page_token)
        listed = schemas.listed(names, request.view)
        return _schema.ListSchemasResponse.pb()(schemas=listed, next_page_token=token)

    async def ListSchemaRevisions(self, request: Any, context: Any) -> Any:
        revisions = self.schemas.revisions(request.name, request.view)
        # Paged in creation order: a revision's create time (unique within its schema) is its page key.
        by_time = {_revision_key(revision): revision for revision in revisions}
        keys, token = page(list(by_time), request.page_size, request.page_token)
        shown = [by_time[key] for key in keys]
        return _schema.ListSchemaRevisionsResponse.pb()(schemas=shown, next_page_token=token)

    async def CommitSchema(self, request: Any, context: Any) -> Any:
        return await self.schemas.commit(request.name, request.schema)

    async def RollbackSchema(self, request: Any, context: Any) -> Any:
        return await self.schemas.rollback(request.name, request.revision_id)

    async def DeleteSchemaRevision(self, request: Any, context: Any) -> Any:
        return await self.schemas.delete_revision(request.name, request.revision_id)

    async def DeleteSchema(self, request: Any, context: Any) -> Any:
        await self.catalog.delete_schema(request.name)
        return _Empty()

    async def ValidateSchema(self, request: Any, context: Any) -> Any:
        await self.schemas.validate_schema(request.parent, request.schema)
        return _schema.ValidateSchemaResponse.pb()()

    async def ValidateMessage(self, request: Any, context: Any) -> Any:
        await self.schemas.validate_message(request)
        return _schema.ValidateMessageResponse.pb()()

    # ------------------------------------------------------------ IAMPolicy
    async def GetIamPolicy(self, request: Any, context: Any) -> Any:
        return self.catalog.get_policy(request.resource)

    async def SetIamPolicy(self, request: Any, context: Any) -> Any:
        self.catalog.check_iam_resource(request.resource)  # NOT_FOUND first, as for GetIamPolicy
        _iam.check_policy(request.policy)  # enforcing or not, as the real service checks
        return await self.catalog.set_policy(request.resource, request.policy)

    async def TestIamPermissions(self, request: Any, context: Any) -> Any:
        metadata = tuple(context.invocation_metadata() or ())
        if not self._enforcing:
            self.catalog.check_iam_resource(request.resource)
            _iam.check_testable(request.resource, request.permissions)
            granted = await self.authorizer.granted(metadata, request.resource, list(request.permissions))
            return iam_policy_pb2.TestIamPermissionsResponse(permissions=granted)
        # Enforcing: the caller's token (already checked by authorize) and what it holds come before any
        # lookup. A caller holding nothing on the resource gets the same empty answer whether it exists or
        # not, so TestIamPermissions cannot tell it which topics exist; one holding something (who could
        # GetTopic anyway, or reads the resource's own policy) learns NOT_FOUND as before.
        _iam.check_testable(request.resource, request.permissions)
        applicable = _iam.testable_permissions(request.resource)
        holds_any = await self.authorizer.granted(metadata, request.resource, sorted(applicable))
        if not holds_any:
            return iam_policy_pb2.TestIamPermissionsResponse(permissions=[])
        self.catalog.check_iam_resource(request.resource)
        granted = await self.authorizer.granted(metadata, request.resource, list(request.permissions))
        return iam_policy_pb2.TestIamPermissionsResponse(permissions=granted)


_PublishResponse: Any = _pb.PublishResponse.pb()
_StreamingPullResponse: Any = _pb.StreamingPullResponse.pb()
_SubscriptionProperties: Any = _pb.StreamingPullResponse.SubscriptionProperties.pb()


class _Confirmations:
    """The exactly-once confirmations a StreamingPull stream owes its client: the ack IDs of the acks and
    of the modacks it sent since its last response, each processed or invalid.

    The real service sets ``acknowledge_confirmation`` / ``modify_ack_deadline_confirmation`` only on
    subscriptions with exactly-once delivery. Every failure the core reports is permanent (an ack ID that
    is malformed, unknown, or whose lease ended: expired, nacked or superseded), hence ``invalid_ack_ids``;
    a store that cannot write ends the stream rather than failing ack IDs temporarily, and the core has no
    order of acks to enforce, so ``temporary_failed_ack_ids`` and ``unordered_ack_ids`` stay empty.
    """

    __slots__ = ("acknowledged", "modified")

    def __init__(self) -> None:
        self.acknowledged: Any = None
        self.modified: Any = None

    def add(self, acknowledged: bool, ack_ids: Iterable[str], failures: dict[str, str]) -> None:
        """Record the outcome of one request's acks (``acknowledged``) or modacks."""
        if acknowledged:
            if self.acknowledged is None:
                self.acknowledged = _AcknowledgeConfirmation()
            confirmation = self.acknowledged
        else:
            if self.modified is None:
                self.modified = _ModifyAckDeadlineConfirmation()
            confirmation = self.modified
        for ack_id in ack_ids:
            (confirmation.invalid_ack_ids if ack_id in failures else confirmation.ack_ids).append(ack_id)

    def fill(self, response: Any) -> None:
        """Set the confirmations owed on a ``StreamingPullResponse``."""
        if self.acknowledged is not None:
            response.acknowledge_confirmation.CopyFrom(self.acknowledged)
        if self.modified is not None:
            response.modify_ack_deadline_confirmation.CopyFrom(self.modified)


_AcknowledgeConfirmation: Any = _pb.StreamingPullResponse.AcknowledgeConfirmation.pb()
_ModifyAckDeadlineConfirmation: Any = _pb.StreamingPullResponse.ModifyAckDeadlineConfirmation.pb()


def _revision_key(revision: Any) -> str:
    stamp = revision.revision_create_time
    return f"{stamp.seconds:012d}.{stamp.nanos:09d}"


def _paged(
    response_type: Any,
    field: str,
    lister: Callable[[str, int, str], tuple[list[Any], str]],
    scope: str,
    request: Any,
) -> Any:
    """A List RPC's answer: one page of what ``lister`` finds in ``scope`` and the next page's token."""
    items, token = lister(scope, request.page_size, request.page_token)
    return response_type.pb()(**{field: items, "next_page_token": token})


async def _next_request(requests: AsyncIterator[Any]) -> Any:
    try:
        request = await requests.__anext__()
    except StopAsyncIteration:
        return None
    if request is MALFORMED:
        raise invalid("The request could not be parsed as a StreamingPullRequest.")
    return request
