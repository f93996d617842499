"""The Pub/Sub core: the composition root of the service, with no gRPC in sight.

All state lives on one event loop; nothing here is thread-safe. :class:`PubSubCore` builds the parts, each
with the parts it depends on (by type), and holds them; the faces call the part that owns an RPC, with raw
protobuf requests, and turn :class:`ServiceError` into status codes:

- :class:`~.catalog.Catalog`: topics, subscriptions, DeleteSchema's effect on topics, IAM policy RPCs;
  the one part that changes the :class:`~.registry.Registry` of topics, subscriptions and attachments;
- :class:`~.publishing.Publishing`: Publish and the fan-out of stored messages;
- :class:`~.consumers.Consumers`: Pull, StreamingPull, acks, deadlines, dead-letter forwarding (each
  subscription's state machine in :mod:`.delivery`);
- :class:`~.replay.Replay`: snapshots, Seek, retention; :class:`~.schemas.SchemaRegistry`: schemas;
  :class:`~.policies.IamPolicies`: the policies themselves;
- :class:`~.expiration.ExpirationWatch`, :class:`~.push.PushDispatcher`,
  :class:`~.cloud_storage.ExportDispatcher`: expiry, push delivery, Cloud Storage subscriptions.

The core itself loads what the store holds, records subscriptions' activity, and closes or clears it all.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from hedgepub._clock import DEFAULT_CLOCK, Clock
from hedgepub.server._pubsub import resources as resources
from hedgepub.server._pubsub.catalog import Catalog
from hedgepub.server._pubsub.cloud_storage import ExportDispatcher
from hedgepub.server._pubsub.consumers import Consumers
from hedgepub.server._pubsub.delivery import DEFAULT_WINDOW
from hedgepub.server._pubsub.expiration import RECORD_EVERY, ExpirationWatch
from hedgepub.server._pubsub.leases import MAX_MESSAGES_PER_RESPONSE, Consumer
from hedgepub.server._pubsub.oidc import PushTokenSigner
from hedgepub.server._pubsub.policies import IamPolicies
from hedgepub.server._pubsub.publishing import Publishing
from hedgepub.server._pubsub.push import PushDispatcher
from hedgepub.server._pubsub.registry import Background, Registry
from hedgepub.server._pubsub.replay import Replay
from hedgepub.server._pubsub.schemas import SchemaRegistry
from hedgepub.server._pubsub.transforms import Transforms
from hedgepub.server._store.protocol import Snapshot, Store, StoredMessage

logger = logging.getLogger("hedgepub.server")

Topic: Any = resources.Topic
Subscription: Any = resources.Subscription

__all__ = ["MAX_MESSAGES_PER_RESPONSE", "Consumer", "PubSubCore"]


class PubSubCore:
    """Topics, subscriptions, IAM policies and delivery, written through to a :class:`Store`: the parts
    that serve them, built and wired here (:attr:`catalog`, :attr:`publishing`, :attr:`consumers`,
    :attr:`replay`, :attr:`schemas`, :attr:`policies`, :attr:`push`, :attr:`exports`).

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
        self.wall_clock_ns = wall_clock_ns
        wall_ns = lambda: self.wall_clock_ns()  # noqa: E731 (read late: tests replace the attribute)
        #: The topics, the subscriptions' delivery states and which subscriptions each topic feeds.
        self.registry = Registry()
        self._background = Background()
        #: Subscriptions' activity to record (name -> ns since the epoch), written once per loop step.
        self._activity_due: dict[str, int] = {}
        self._activity_written: asyncio.Future[None] | None = None
        # The core is the watch's host: expiry deletes through the catalog, built below (the watch is one
        # of its dependencies), and activity is written to the store here.
        self._expiration = ExpirationWatch(clock, self)
        #: The IAM policies set on resources.
        self.policies = policies if policies is not None else IamPolicies(store)
        #: Snapshots, Seek and retention.
        self.replay = Replay(
            store,
            clock,
            wall_ns,
            self.registry,
            self._background,
            policies=self.policies,
            expiration=self._expiration,
        )
        #: Schemas and their revisions (SchemaService); topics' schema_settings name them.
        self.schemas = SchemaRegistry(store, wall_ns)
        #: Message transforms: UDFs in a sandbox of worker processes, started on first use.
        self.transforms = Transforms()
        #: Publish and the fan-out of stored messages.
        self.publishing = Publishing(
            store,
            wall_ns,
            self.registry,
            schemas=self.schemas,
            replay=self.replay,
            transforms=self.transforms,
        )
        #: Pull, StreamingPull and push leases, acks, deadlines and dead-letter forwarding.
        self.consumers = Consumers(
            store,
            clock,
            wall_ns,
            self.registry,
            self._background,
            expiration=self._expiration,
            replay=self.replay,
            publishing=self.publishing,
            may_forward=may_forward,
            transforms=self.transforms,
        )
        #: One push worker per push subscription (started and stopped as subscriptions change).
        self.push = PushDispatcher(self.consumers, clock, push_tokens)
        #: One Cloud Storage writer per Cloud Storage subscription, into ``buckets_dir`` (none without it).
        self.exports = ExportDispatcher(self.consumers, clock, buckets_dir)
        #: Topics and subscriptions (create, get, update, list, delete, detach) and IAM policy RPCs.
        self.catalog = Catalog(
            store,
            self.registry,
            self._background,
            window=window,
            schemas=self.schemas,
            replay=self.replay,
            policies=self.policies,
            consumers=self.consumers,
            expiration=self._expiration,
            push=self.push,
            exports=self.exports,
            transforms=self.transforms,
        )

    # ----------------------------------------------------------------- lifecycle
    def load(self, snapshot: Snapshot | None = None) -> None:
        """Take back what the store holds (topics, subscriptions, policies); backlogs are read lazily."""
        snapshot = snapshot if snapshot is not None else self._store.load()
        registry = self.registry
        registry.clear()
        registry.topics.update(snapshot.topics)
        self.schemas.load(snapshot.schemas)
        self.publishing.next_sequence = snapshot.next_sequence
        now_ns = self.wall_clock_ns()
        for name, config in snapshot.subscriptions.items():
            state = self.catalog.new_state(config)
            state.more = not config.detached  # its backlog, if any, is read when first needed
            registry.add_subscription(state, attach=not config.detached)
            self._expiration.watch(config, self._idle_seconds(snapshot.activity.get(name), now_ns))
        self.replay.load(snapshot.snapshots, list(registry.topics.values()))
        orphans = self.policies.load(snapshot.policies, self.catalog.iam_resource_exists)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # loaded outside a loop (some tests): push and replay start with the next change
            return
        for resource in orphans:
            self._background.spawn(self._store.delete("policies", resource))
        self.replay.start()
        for name, state in registry.subscriptions.items():
            if state.config.enable_exactly_once_delivery and not state.config.detached:
                self.consumers.restore_leases(state)
            self.catalog.sync_delivery(name)

    @staticmethod
    def _idle_seconds(active_ns: int | None, now_ns: int) -> float:
        """How long a subscription recorded active at ``active_ns`` has been inactive (at least): its last
        activity may come up to ``RECORD_EVERY`` after the record, so the clock goes on from there. A
        subscription without a record (an earlier hedgepub's data) starts its clock now."""
        if active_ns is None:
            return 0.0
        return max(0.0, (now_ns - active_ns) / 1e9 - RECORD_EVERY)

    # ------------------------------------------------------ ExpirationHost: what the watch calls
    def expire_subscription(self, name: str) -> None:
        """Expiration timer: the subscription was inactive for its ttl; the catalog deletes it."""
        self.catalog.expire_subscription(name)

    def record_activity(self, name: str) -> asyncio.Future[None]:
        """Expiration: record that ``name`` is active now; one store write per loop step for all. The
        future returned ends once the record is written (or failed to be: that is logged, not raised)."""
        due = self._activity_due
        written = self._activity_written
        if not due or written is None:
            written = self._activity_written = asyncio.get_running_loop().create_future()
            self._background.spawn(self._write_activity(written))
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
        await self._background.cancel()
        for state in self.registry.subscriptions.values():
            state.close()
        await self.consumers.attempts_recorded()
        await self._store.close()

    async def clear(self) -> None:
        """Delete every topic, subscription, policy and message."""
        await self.push.close()
        await self.exports.close()
        await self.transforms.close()
        for state in self.registry.subscriptions.values():
            state.close()
        self.registry.clear()
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
        for state in self.registry.subscriptions.values():
            if state.backlog_size() == 0:
                state.refill()  # the store may hold a backlog not read yet
            if state.backlog_size():
                return False
        return True
