"""Replay: retention, snapshots and Seek, as references and timestamps on the store (never copies).

Every message is stored once; what keeps it alive is a reference from a *holder* (see
:mod:`hedgepub.server._store.protocol`). Besides subscriptions, replay uses three kinds of holder:

- ``{subscription}#acked``: with ``retain_acked_messages``, the messages the subscription acknowledged,
  kept for its ``message_retention_duration`` so that a Seek can make them unacknowledged again;
- ``{topic}#retained``: with a topic's ``message_retention_duration``, every message published to the
  topic, so that a Seek can replay them on any of its subscriptions, even those created later;
- a snapshot (``projects/{project}/snapshots/{id}``): the subscription's unacknowledged messages when the
  snapshot was taken, and every message published to the topic after it, until the snapshot expires.

Seek to a time ``T``: the subscription's retained messages (its backlog, its acknowledged ones kept with
``retain_acked_messages``, its topic's retained ones) published at or after ``T`` become unacknowledged,
and those published before ``T`` acknowledged. Seek to a snapshot: exactly the snapshot's messages become
unacknowledged. Either way the subscription's in-memory state is read again from the store, so messages
under lease are delivered again (their ack IDs no longer count).

Timers run on the injected clock, times on the core's wall clock: a snapshot is deleted when it expires
(7 days after the publish time of the oldest message it was taken with, or after its creation if there was
none; one that would expire within the hour is refused), and every ``PRUNE_INTERVAL_SECONDS`` references
past their retention are dropped, and with them the messages nothing else keeps.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from google.pubsub_v1.types import pubsub as pubsub_types

from hedgepub._clock import Clock, TimerHandle
from hedgepub._status import StatusCode
from hedgepub.server._pubsub import limits as limits
from hedgepub.server._pubsub import resources as resources
from hedgepub.server._pubsub.expiration import ExpirationWatch
from hedgepub.server._pubsub.limits import ServiceError, invalid
from hedgepub.server._pubsub.policies import IamPolicies
from hedgepub.server._pubsub.registry import Background, Registry
from hedgepub.server._store.protocol import Store

Snapshot: Any = pubsub_types.Snapshot.pb()

#: A snapshot lives 7 days less the age of the oldest unacknowledged message it captures.
SNAPSHOT_LIFETIME_SECONDS = 7 * 24 * 3600
#: A snapshot that would expire sooner than this is refused (FAILED_PRECONDITION), as by the real service.
MIN_SNAPSHOT_LIFETIME_SECONDS = 3600
#: How often references past their retention are dropped.
PRUNE_INTERVAL_SECONDS = 600.0
SNAPSHOT_UPDATABLE = frozenset({"labels", "expire_time"})


def acked_holder(subscription: str) -> str:
    """The holder of a subscription's retained acknowledged messages."""
    return f"{subscription}#acked"


def retained_holder(topic: str) -> str:
    """The holder of a topic's retained messages."""
    return f"{topic}#retained"


def _ns(stamp: Any) -> int:
    return stamp.seconds * 1_000_000_000 + stamp.nanos


def _retention_ns(resource: Any) -> int | None:
    if not resource.HasField("message_retention_duration"):
        return None
    return round(limits.seconds(resource.message_retention_duration) * 1e9)


class Replay:
    """Snapshots, Seek and retention for one core.

    It looks topics and subscriptions up in ``registry``; ``wall_ns()`` is the calendar time in ns; a
    snapshot that goes (deleted or expired) takes its IAM policy in ``policies`` with it; a Seek is
    activity for ``expiration``.
    """

    def __init__(
        self,
        store: Store,
        clock: Clock,
        wall_ns: Callable[[], int],
        registry: Registry,
        background: Background,
        *,
        policies: IamPolicies,
        expiration: ExpirationWatch,
    ) -> None:
        self._store = store
        self._clock = clock
        self._wall_ns = wall_ns
        self._registry = registry
        self._background = background
        self._policies = policies
        self._expiration = expiration
        self._snapshots: dict[str, Any] = {}
        self._expiry: dict[str, TimerHandle] = {}
        self._retained_topics: dict[str, int] = {}
        self._prune_timer: TimerHandle | None = None

    # ------------------------------------------------------------- lifecycle
    def load(self, snapshots: dict[str, Any], topics: Sequence[Any]) -> None:
        """Take back stored snapshots and topics' retention (:meth:`start` arms the timers)."""
        for snapshot in snapshots.values():
            self._snapshots[snapshot.name] = snapshot
        for topic in topics:
            retention = _retention_ns(topic)
            if retention is not None:
                self._retained_topics[topic.name] = retention

    def start(self) -> None:
        """Arm the snapshots' expiry and the retention timer (on the running loop; idempotent)."""
        if self._prune_timer is not None:
            return
        for snapshot in self._snapshots.values():
            self._arm_expiry(snapshot)
        self._prune_timer = self._clock.call_later(PRUNE_INTERVAL_SECONDS, self._prune_tick)

    def close(self) -> None:
        """Stop every timer."""
        for timer in self._expiry.values():
            timer.cancel()
        self._expiry.clear()
        if self._prune_timer is not None:
            self._prune_timer.cancel()
            self._prune_timer = None

    def clear(self) -> None:
        """Everything was deleted."""
        for timer in self._expiry.values():
            timer.cancel()
        self._expiry.clear()
        self._snapshots.clear()
        self._retained_topics.clear()

    def holders_for(self, topic: str) -> list[str]:
        """Besides the attached subscriptions, who must reference a message published to ``topic``."""
        holders = [name for name, snapshot in self._snapshots.items() if snapshot.topic == topic]
        if topic in self._retained_topics:
            holders.append(retained_holder(topic))
        return holders

    # ------------------------------------------------------------- resources changing
    async def topic_changed(self, topic: Any) -> None:
        """A topic was created or updated: keep its messages for its retention, or stop keeping them."""
        self.start()
        retention = _retention_ns(topic)
        if retention is None:
            if self._retained_topics.pop(topic.name, None) is not None:
                await self._store.release(retained_holder(topic.name))
            return
        self._retained_topics[topic.name] = retention
        await self._store.register(retained_holder(topic.name))

    async def topic_deleted(self, name: str) -> None:
        """A topic is gone; its retained messages go (snapshots of it keep theirs until they expire)."""
        self._retained_topics.pop(name, None)
        await self._store.release(retained_holder(name))

    async def subscription_changed(self, config: Any) -> None:
        """A subscription was created or updated: keep its acknowledged messages, or stop keeping them."""
        self.start()
        if config.retain_acked_messages:
            await self._store.register(acked_holder(config.name))
        else:
            await self._store.release(acked_holder(config.name))

    async def subscription_deleted(self, name: str) -> None:
        """A subscription is gone, and its retained acknowledged messages with it."""
        await self._store.release(acked_holder(name))

    async def acknowledged(self, config: Any, sequences: list[int]) -> None:
        """Called before the store drops acknowledged references: retain them if the subscription says so."""
        if config.retain_acked_messages and sequences:
            await self._store.reference(acked_holder(config.name), sequences)

    # ------------------------------------------------------------- snapshots
    def _existing(self, name: str) -> Any:
        limits.check_name(name, "snapshots")
        snapshot = self._snapshots.get(name)
        if snapshot is None:
            raise limits.not_found(name)
        return snapshot

    async def create_snapshot(self, name: str, subscription: str, labels: Any) -> Any:
        """CreateSnapshot: capture the subscription's unacknowledged messages and what is published next."""
        state = self._registry.subscription(subscription)
        config = state.config
        if not name:  # the real service names it when the request does not
            project = subscription.split("/")[1]
            name = f"projects/{project}/snapshots/snapshot-{os.urandom(8).hex()}"
        limits.check_name(name, "snapshots")
        limits.check_labels(labels)
        if name in self._snapshots:
            raise limits.already_exists(name)
        if config.topic == limits.DELETED_TOPIC or config.detached:
            raise ServiceError(
                StatusCode.FAILED_PRECONDITION,
                f"The subscription's topic has been deleted or the subscription detached (subscription="
                f"{subscription}); a snapshot cannot be taken.",
            )
        now = self._wall_ns()
        oldest = self._store.pending(config.name, 0, 1)
        start = _ns(oldest[0][1].publish_time) if oldest else now
        expire = start + SNAPSHOT_LIFETIME_SECONDS * 1_000_000_000
        if expire - now < MIN_SNAPSHOT_LIFETIME_SECONDS * 1_000_000_000:
            raise ServiceError(
                StatusCode.FAILED_PRECONDITION,
                "The operation could not be completed because the requested source subscription's backlog "
                "is too old: the snapshot would expire in less than 1 hour.",
            )
        snapshot = Snapshot(name=name, topic=config.topic, labels=dict(labels))
        snapshot.expire_time.FromNanoseconds(expire)
        # From here on publishes reference it too; the store writes the snapshot and the subscription's
        # backlog as it is at the commit in one transaction, so a crash leaves all of it or none.
        self._snapshots[name] = snapshot
        try:
            await self._store.put_snapshot(name, snapshot, config.name)
        except BaseException:
            self._snapshots.pop(name, None)
            raise
        self._arm_expiry(snapshot)
        return snapshot

    def get_snapshot(self, name: str) -> Any:
        """GetSnapshot."""
        return self._existing(name)

    def list_snapshots(self, project: str, page_size: int, page_token: str) -> tuple[list[Any], str]:
        """ListSnapshots: one page of the project's snapshots, sorted by name."""
        page, token = resources.project_page(project, "snapshots", self._snapshots, page_size, page_token)
        return [self._snapshots[name] for name in page], token

    def list_topic_snapshots(self, topic: str, page_size: int, page_token: str) -> tuple[list[str], str]:
        """ListTopicSnapshots: names of the snapshots of ``topic``."""
        self._registry.topic(topic)
        names = sorted(name for name, snapshot in self._snapshots.items() if snapshot.topic == topic)
        return resources.page(names, page_size, page_token)

    async def update_snapshot(self, update: Any, paths: Sequence[str]) -> Any:
        """UpdateSnapshot: labels and expire time (which must be in the future)."""
        current = self._existing(update.name)
        updated = resources.masked_update("Snapshot", current, update, paths, SNAPSHOT_UPDATABLE)
        limits.check_labels(updated.labels)
        if _ns(updated.expire_time) <= self._wall_ns():
            raise invalid("Invalid expire_time given: the expire time of a snapshot must be in the future.")
        await self._store.put("snapshots", updated.name, updated)
        self._snapshots[updated.name] = updated
        self._arm_expiry(updated)
        return updated

    async def delete_snapshot(self, name: str) -> None:
        """DeleteSnapshot: its references go, and the messages only it kept."""
        self._existing(name)
        await self._forget(name)

    async def _forget(self, name: str) -> None:
        if self._snapshots.pop(name, None) is None:
            return
        timer = self._expiry.pop(name, None)
        if timer is not None:
            timer.cancel()
        await self._store.delete("snapshots", name)
        await self._policies.drop(name)

    def _arm_expiry(self, snapshot: Any) -> None:
        name = snapshot.name
        previous = self._expiry.pop(name, None)
        if previous is not None:
            previous.cancel()
        delay = (_ns(snapshot.expire_time) - self._wall_ns()) / 1e9
        self._expiry[name] = self._clock.call_later(
            max(0.0, delay), lambda: self._background.spawn(self._forget(name))
        )

    # ------------------------------------------------------------- seek
    async def seek(self, subscription: str, publish_ns: int | None, snapshot: str | None) -> None:
        """Seek to a time (ns since the epoch) or to a snapshot; see the module's docstring. It is
        activity: answered once that is recorded."""
        recorded = self._expiration.touch(subscription)
        await self._seek(subscription, publish_ns, snapshot)
        if recorded is not None:
            await recorded

    async def _seek(self, subscription: str, publish_ns: int | None, snapshot: str | None) -> None:
        state = self._registry.subscription(subscription)
        config = state.config
        if config.detached:
            raise ServiceError(
                StatusCode.FAILED_PRECONDITION,
                f"The subscription is detached from its topic (subscription={subscription}).",
            )
        store = self._store
        name = config.name
        acked = acked_holder(name)
        current = set(store.referenced(name))
        if snapshot is not None:
            taken = self._existing(snapshot)
            if taken.topic != config.topic:
                raise ServiceError(
                    StatusCode.FAILED_PRECONDITION,
                    f"The snapshot {snapshot} was taken of another topic ({taken.topic}) than the "
                    f"subscription's ({config.topic}).",
                )
            wanted = set(store.referenced(snapshot))
        else:
            assert publish_ns is not None
            threshold = store.first_sequence_at(publish_ns)
            wanted = set()
            if threshold is not None:
                wanted.update(sequence for sequence in current if sequence >= threshold)
                wanted.update(store.referenced(acked, threshold))
                if config.topic in self._retained_topics:
                    wanted.update(store.referenced(retained_holder(config.topic), threshold))
        to_ack = sorted(current - wanted)
        to_unack = sorted(wanted - current)
        # Reference before dropping, so that no message is unreferenced (deleted) in between.
        if to_ack and config.retain_acked_messages:
            await store.reference(acked, to_ack)
        if to_unack:
            await store.reference(name, to_unack)
            await store.ack(acked, to_unack)
        if to_ack:
            await store.ack(name, to_ack)
        if config.enable_exactly_once_delivery:  # the leases end here, so their records go too
            await store.drop_leases(name, [sequence for sequence, _, _ in store.leases(name)])
        state.reset()

    # ------------------------------------------------------------- retention
    def _prune_tick(self) -> None:
        self._prune_timer = self._clock.call_later(PRUNE_INTERVAL_SECONDS, self._prune_tick)
        self._background.spawn(self.prune())

    async def prune(self) -> None:
        """Drop references past their retention: subscriptions' backlogs and retained acknowledged
        messages (the subscription's retention), topics' retained messages (the topic's)."""
        now = self._wall_ns()
        # Most subscriptions share a retention: search the store once per distinct cut-off.
        thresholds: dict[int, int | None] = {}
        for state in self._registry.states():
            config = state.config
            retention = _retention_ns(config) or limits.DEFAULT_RETENTION_SECONDS * 1_000_000_000
            await self._drop_before(config.name, now - retention, thresholds)
            await self._drop_before(acked_holder(config.name), now - retention, thresholds)
        for topic, retention in list(self._retained_topics.items()):
            await self._drop_before(retained_holder(topic), now - retention, thresholds)

    async def _drop_before(self, holder: str, oldest_kept_ns: int, thresholds: dict[int, int | None]) -> None:
        store = self._store
        if oldest_kept_ns not in thresholds:
            thresholds[oldest_kept_ns] = store.first_sequence_at(oldest_kept_ns)
        threshold = thresholds[oldest_kept_ns]
        expired = store.referenced(holder) if threshold is None else store.referenced(holder, 0, threshold)
        if expired:
            await store.ack(holder, expired)
