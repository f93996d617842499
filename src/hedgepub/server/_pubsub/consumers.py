"""Consumers of subscriptions: Pull, StreamingPull and push leases, acknowledgements, deadlines, the
delivery attempts of dead-letter policies and the forwarding to dead-letter topics.

:class:`Consumers` works on the subscriptions' delivery states (:mod:`.delivery`) that the core keeps; it
owns the :class:`~.delivery.Leasing` timers. Dead-letter forwarding happens in the background (nobody
needs to pull), as the real service does: the copy is stored before the ack on the source subscription,
so a crash in between duplicates it and never loses it, and a forwarding that fails puts it back up for
delivery.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from hedgepub._clock import Clock
from hedgepub._status import StatusCode
from hedgepub.server._pubsub import limits as limits
from hedgepub.server._pubsub import resources as resources
from hedgepub.server._pubsub.delivery import (
    FRAMING_BYTES,
    MAX_RESPONSE_BYTES,
    ReceivedMessage,
    SubscriptionState,
    dead_letter_copy,
)
from hedgepub.server._pubsub.expiration import ExpirationWatch
from hedgepub.server._pubsub.leases import (
    MAX_MESSAGES_PER_RESPONSE,
    Consumer,
    Leasing,
    Pending,
    well_formed_ack_id,
)
from hedgepub.server._pubsub.limits import ServiceError, invalid
from hedgepub.server._pubsub.publishing import Publishing
from hedgepub.server._pubsub.registry import Background, Registry
from hedgepub.server._pubsub.replay import Replay
from hedgepub.server._pubsub.transforms import NotRun, TransformFailed, Transforms
from hedgepub.server._store.protocol import Store

logger = logging.getLogger("hedgepub.server")

__all__ = ["Consumers"]


class Consumers:
    """Leases, acknowledgements and dead-letter forwarding on the core's subscriptions.

    It looks subscriptions and topics up in ``registry`` (changed by the catalog); ``publishing`` stores
    the dead-letter copies, as messages already accepted; ``background`` runs the work nobody awaits (the
    core ends it on close); ``may_forward(subscription, topic)`` says whether the service may
    forward to a dead-letter topic (IAM enforcement; ``None`` allows every forwarding). It is also the host
    of the push workers (:class:`~.push.PushHost`).
    """

    def __init__(
        self,
        store: Store,
        clock: Clock,
        wall_clock_ns: Callable[[], int],
        registry: Registry,
        background: Background,
        *,
        expiration: ExpirationWatch,
        replay: Replay,
        publishing: Publishing,
        may_forward: Callable[[str, str], bool] | None = None,
        transforms: Transforms | None = None,
    ) -> None:
        self._store = store
        self._transforms = transforms if transforms is not None else Transforms()
        self._clock = clock
        self._wall_clock_ns = wall_clock_ns
        self._registry = registry
        self._subscriptions: Mapping[str, SubscriptionState] = registry.subscriptions
        self._expiration = expiration
        self._replay = replay
        self._publishing = publishing
        self._spawn = background.spawn
        self._may_forward = may_forward
        self._refused_forwarding: set[tuple[str, str]] = set()
        #: The lease timers of every subscription.
        self.leasing: Leasing[SubscriptionState] = Leasing(clock, self)
        #: Delivery attempts to record, per subscription (sequence -> count), and the writes under way.
        self._attempts_due: dict[str, dict[int, int]] = {}
        self._attempts_writes: set[asyncio.Task[None]] = set()

    def _subscription(self, name: str) -> SubscriptionState:
        return self._registry.subscription(name)

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
        if state.config.HasField("cloud_storage_config"):
            raise ServiceError(
                StatusCode.FAILED_PRECONDITION,
                "This method is not supported for Cloud Storage subscriptions: their messages are written "
                "to files.",
            )
        return state

    def export_state(self, subscription: str) -> SubscriptionState | None:
        """The delivery state of a live, attached Cloud Storage subscription (``None`` for anything else)."""
        state = self._subscriptions.get(subscription)
        if state is None or state.deleted or state.config.detached:
            return None
        return state if state.config.HasField("cloud_storage_config") else None

    def push_state(self, subscription: str) -> SubscriptionState | None:
        """The delivery state of a live, attached push subscription (``None`` for anything else)."""
        state = self._subscriptions.get(subscription)
        if state is None or state.deleted or state.config.detached:
            return None
        return state if state.config.push_config.push_endpoint else None

    async def lease(self, state: SubscriptionState, consumer: Consumer, max_messages: int) -> list[Any]:
        """Lease ready messages for a push worker (as :meth:`pull` does for a caller)."""
        return await self._take(state, consumer, max_messages)

    async def _take(self, state: SubscriptionState, consumer: Consumer, max_messages: int) -> list[Any]:
        """Lease up to ``max_messages`` ready messages to ``consumer``, transformed by the subscription's
        transforms; drop those past retention."""
        if not state.ready and not state.more and not state.held_lines:
            return []
        config = state.config
        retention = limits.seconds(config.message_retention_duration) or limits.DEFAULT_RETENTION_SECONDS
        oldest_kept = self._wall_clock_ns() / 1e9 - retention
        while True:
            out, expired = state.take(consumer, max_messages, oldest_kept)
            if expired:
                self._spawn(self._store.ack(state.name, expired))
            if not out or not config.message_transforms or all(t.disabled for t in config.message_transforms):
                return out
            out, gave_back = await self._transformed(state, config, out)
            if out or not gave_back:
                return out
            # Nothing to hand out, but messages went back ready (their worker stopped on an earlier one):
            # take them again now rather than wait for a change that already happened.

    async def _transformed(
        self, state: SubscriptionState, config: Any, out: list[Any]
    ) -> tuple[list[Any], bool]:
        """The leased messages ``out`` after the subscription's transforms. One they fail on is a delivery
        attempt that ended unacknowledged (:meth:`~.SubscriptionState.transform_failed`), one they filter
        out is acknowledged; those not run (the request's CPU budget spent, a worker stopped) and those
        past the response's size go back uncounted (:meth:`~.SubscriptionState.give_back`). Returns the
        messages to hand out, and whether any went back."""
        results = await self._transforms.apply(
            state.name, config.message_transforms, [r.message for r in out]
        )
        kept: list[Any] = []
        back: list[Any] = []
        filtered: list[int] = []
        total = 0
        for received, result in zip(out, results, strict=True):
            lease = state.leases.get(received.ack_id)
            if lease is None:
                continue  # ended meanwhile: its deadline passed, or an earlier message of its key came back
            if back or isinstance(result, NotRun):
                back.append(lease)
            elif isinstance(result, TransformFailed):
                state.transform_failed(lease, result)
            elif result is None:  # filtered out: acknowledged, as a subscription's filter does
                filtered.extend(state.acknowledge([received.ack_id]))
            else:
                size = result.ByteSize() + len(received.ack_id) + FRAMING_BYTES
                if kept and total + size > MAX_RESPONSE_BYTES:
                    back.append(lease)
                    continue
                total += size
                kept.append(
                    ReceivedMessage(
                        ack_id=received.ack_id, message=result, delivery_attempt=received.delivery_attempt
                    )
                )
        if back:
            state.give_back(back)
        if filtered:
            self._spawn(self._store.ack(state.name, filtered))
        return [received for received in kept if received.ack_id in state.leases], bool(back)

    # ------------------------------------------------ LeaseOwner: what the subscriptions' leases call
    def discard(self, state: SubscriptionState, sequences: list[int]) -> None:
        """Acknowledge, in the background, messages read from the store but never to be delivered (a
        filter refused them before a crash let the publish-time acknowledgement happen)."""
        self._spawn(self._store.ack(state.name, sequences))

    def withdrawn(self, state: SubscriptionState, sequences: list[int]) -> None:
        """Leases ended to keep an ordering key in order: an exactly-once subscription forgets their
        records, so that a restart does not restore them ahead of the earlier message redelivered."""
        if state.config.enable_exactly_once_delivery:
            self._spawn(self._store.drop_leases(state.name, sequences))

    def attempted(self, state: SubscriptionState, pending: Pending) -> None:
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

    def dead_letter(self, state: SubscriptionState, pending: Pending, topic: str) -> None:
        """``pending`` used up its delivery attempts: forward it to ``topic`` in the background."""
        self._spawn(self._forward_dead_letter(state, pending, topic))

    async def _forward_dead_letter(self, state: SubscriptionState, pending: Pending, topic: str) -> None:
        """Publish a copy to the dead-letter topic, then acknowledge the message on its subscription.

        Runs in the background. Whatever goes wrong (a missing dead-letter topic, a failing store), the
        message goes back to the front of ``ready`` rather than being dropped; the next nack or deadline
        tries again.
        """
        forwarded = False
        try:
            if topic in self._registry.topics and not self._forwarding_refused(state.name, topic):
                # (the real service keeps the message when the topic is missing, or may not be published to)
                # Not through publish(): the copy is the service's own, and the attributes it gains may take
                # a message that was at the 100-attribute limit past it; that must not drop the message.
                await self._publishing.append(topic, [dead_letter_copy(state.name, pending)])
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
        if self._may_forward is None or self._may_forward(subscription, topic):
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
        # The activity is recorded before the answer (see expiration.py); awaited at the end, so that the
        # write overlaps the wait for messages.
        recorded = self._expiration.touch(subscription)
        consumer = Consumer(float(state.config.ack_deadline_seconds), group=state.pull_group)
        taken = await self._take(state, consumer, min(max_messages, MAX_MESSAGES_PER_RESPONSE))
        if taken or wait_seconds <= 0:
            await self._record_leases(state, taken)
            if recorded is not None:
                await recorded
            return taken
        end = self._clock.now() + wait_seconds
        while not taken:
            remaining = end - self._clock.now()
            if remaining <= 0:
                break
            if not await state.wait_changed(remaining):
                break
            state = self._deliverable(subscription)
            taken = await self._take(state, consumer, min(max_messages, MAX_MESSAGES_PER_RESPONSE))
        await self._record_leases(state, taken)
        if recorded is not None:
            await recorded
        return taken

    async def next_batch(self, subscription: str, consumer: Consumer) -> list[Any]:
        """StreamingPull: wait until messages can be sent to ``consumer``; [] once it is closed, or at
        once when it owes its client :attr:`~Consumer.confirmations` (set them, then :meth:`wake`)."""
        while not consumer.closed:
            state = self._deliverable(subscription)
            taken = await self._take(state, consumer, MAX_MESSAGES_PER_RESPONSE)
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
        now_ns, now = self._wall_clock_ns(), self._clock.now()
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

    def restore_leases(self, state: SubscriptionState) -> None:
        """load(): leases of an exactly-once subscription recorded before a restart hold again."""
        now_ns = self._wall_clock_ns()
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
        with the per-ack-ID details of :func:`~.limits.ack_id_failures`. ``report=False`` (StreamingPull,
        which answers them with a confirmation on the stream) returns those failures instead (ack ID ->
        failure, empty when all succeeded); without exactly-once delivery it returns ``None``.
        """
        state = self._subscription(subscription)
        recorded = self._expiration.touch(subscription)
        failures = self._check_ack_ids(state, ack_ids)
        done = state.acknowledge(ack_ids)
        if done:
            await self._replay.acknowledged(state.config, done)
            await self._store.ack(subscription, done)
            if state.config.enable_exactly_once_delivery:
                await self._store.drop_leases(subscription, done)
        if recorded is not None:
            await recorded
        if failures and report:
            raise limits.ack_id_failures(failures)
        return failures if state.config.enable_exactly_once_delivery else None

    async def acknowledge_released(self, state: SubscriptionState, sequences: Sequence[int]) -> None:
        """Acknowledge in the store messages ``state`` already let go of in memory (a Cloud Storage
        subscription's file, now durable). NOT_FOUND when that subscription is gone (or is another one of
        the same name now)."""
        subscription = state.name
        if self._subscriptions.get(subscription) is not state or state.deleted:
            raise limits.not_found(subscription)
        recorded = self._expiration.touch(subscription)
        await self._replay.acknowledged(state.config, list(sequences))
        await self._store.ack(subscription, sequences)
        if recorded is not None:
            await recorded

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

    def _check_ack_ids(self, state: SubscriptionState, ack_ids: Sequence[str]) -> dict[str, str]:
        """Refuse an empty list; return the ack IDs that fail under exactly-once delivery (none without it).

        Without exactly-once a malformed ack ID fails the whole request, and so does one made for another
        subscription (the real service's INVALID_ARGUMENT "You have passed a subscription that does not
        belong to the given ack ID"); with it, each is one more failed ack ID, as is one that is unknown,
        expired or superseded by a later delivery of its message.
        """
        if not ack_ids:
            raise invalid("No ack IDs were given; at least one ack ID is required.")
        exactly_once = state.config.enable_exactly_once_delivery
        failures: dict[str, str] = {}
        leases = state.leases
        holder_of = self.leasing.holder_of
        for ack_id in ack_ids:
            if ack_id in leases:
                continue
            if not well_formed_ack_id(ack_id):
                if not exactly_once:
                    raise invalid(f"You have passed an invalid ack ID to the service (ack_id={ack_id}).")
                failures[ack_id] = limits.PERMANENT_FAILURE_INVALID_ACK_ID
                continue
            holder = holder_of(ack_id)
            if holder is not None and holder != state.serial and not exactly_once:
                raise invalid(
                    "You have passed a subscription that does not belong to the given ack ID "
                    f"(resource={state.name})."
                )
            if exactly_once:
                failures[ack_id] = limits.PERMANENT_FAILURE_INVALID_ACK_ID
        return failures
