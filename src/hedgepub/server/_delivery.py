"""Delivery: one subscription's state machine (ready, leased, ordering, dead-letter) and the lease timer.

All of it runs on one event loop and is driven by an injected clock; nothing here touches gRPC or the
store. The core (:mod:`._core`) writes to the store and calls in here.

- Each subscription has a ``ready`` queue. Delivering a message leases it under a fresh ack ID until a
  deadline; acknowledging drops it, a modify-deadline of 0 (nack) or the deadline passing puts it back
  at the front of ``ready``. Deadlines are kept in one heap for all subscriptions (:class:`Leasing`) and
  expired by a timer on the clock, so a lease runs out even when nobody pulls.
- With message ordering, only the oldest unacknowledged message of each ordering key is ever ready or
  leased; the next one of that key becomes ready when it is acknowledged.
- With a retry policy, a message whose lease ended unacknowledged (nack or deadline) waits
  :func:`retry_delay` before it is ready again ("backing off"); without one it is ready at once.
- With a dead-letter policy, ``delivery_attempt`` is counted. When a message that has been delivered
  ``max_delivery_attempts`` times is nacked or its deadline passes, it is handed to the dead-letter hook
  (the core forwards it in the background) and is neither ready nor leased until that finishes.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import os
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from google.pubsub_v1.types import pubsub as pubsub_types

from hedgepub._clock import Clock, TimerHandle
from hedgepub.server._filters import compile_filter
from hedgepub.server._limits import seconds

PubsubMessage: Any = pubsub_types.PubsubMessage.pb()
ReceivedMessage: Any = pubsub_types.ReceivedMessage.pb()

#: Largest batch handed out at once (one Pull response or one StreamingPull response).
MAX_MESSAGES_PER_RESPONSE = 1000
_MAX_BYTES_PER_RESPONSE = 10_000_000


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


class Pending:
    """One message waiting on one subscription."""

    __slots__ = ("attempts", "message", "sequence", "size")

    def __init__(self, sequence: int, message: Any) -> None:
        self.sequence = sequence
        self.message = message
        self.attempts = 0
        self.size = message.ByteSize()


class Lease:
    """A delivered, unacknowledged message: who holds it and until when."""

    __slots__ = ("ack_id", "active", "consumer", "deadline", "pending", "state")

    def __init__(
        self, ack_id: str, pending: Pending, consumer: Consumer, deadline: float, state: SubscriptionState
    ) -> None:
        self.ack_id = ack_id
        self.state = state
        self.pending = pending
        self.consumer = consumer
        self.deadline = deadline
        self.active = True


#: Back-off doubles per attempt; past this exponent it is at the maximum for any policy the service takes
#: (600 s over a minimum of 1 ns needs 2**40), and the float stays finite.
_MAX_BACKOFF_DOUBLINGS = 64


def retry_delay(policy: Any | None, attempts: int) -> float:
    """Seconds a message waits before it is delivered again, after its ``attempts``-th delivery ended
    unacknowledged: ``min(maximum_backoff, minimum_backoff * 2**(attempts - 1))``; 0 without a policy.

    Exponential from the minimum, doubling per delivery and capped at the maximum: the first retry waits
    the minimum, as the real service's documentation of the policy says, and a message that keeps
    failing settles at the maximum.
    """
    if policy is None:
        return 0.0
    minimum = seconds(policy.minimum_backoff)
    maximum = seconds(policy.maximum_backoff)
    doublings = min(max(attempts - 1, 0), _MAX_BACKOFF_DOUBLINGS)
    return min(maximum, minimum * 2.0**doublings)


#: Called when a message used up its delivery attempts: (subscription state, message, dead-letter topic).
DeadLetterHook = Callable[["SubscriptionState", Pending, str], None]


class Leasing:
    """What every subscription shares: the clock, ack IDs, the lease-deadline heap and its timer."""

    def __init__(self, clock: Clock, dead_letter: DeadLetterHook) -> None:
        self.clock = clock
        self.dead_letter = dead_letter
        # A per-process prefix keeps ack IDs handed out before a restart from matching new leases.
        self._ack_prefix = os.urandom(4).hex()
        self._ack_counter = itertools.count(1)
        self._deadlines: list[tuple[float, int, Lease]] = []
        self._heap_counter = itertools.count()
        self._timer: TimerHandle | None = None
        self._timer_at = float("inf")

    def new_ack_id(self) -> str:
        """A fresh ack ID, unique in this process and unlike any of an earlier process."""
        return f"{self._ack_prefix}-{next(self._ack_counter)}"

    def watch(self, lease: Lease) -> None:
        """Expire ``lease`` at its current deadline unless it ends or changes before."""
        heapq.heappush(self._deadlines, (lease.deadline, next(self._heap_counter), lease))

    def schedule(self, deadline: float) -> None:
        """Make sure the timer runs no later than ``deadline``."""
        if deadline >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = deadline
        # A hair late, so that every lease due at ``deadline`` has passed when the timer runs.
        self._timer = self.clock.call_later(deadline - self.clock.now() + 0.001, self._expire)

    def _expire(self) -> None:
        """Timer: put every lease whose deadline has passed back up for delivery."""
        self._timer = None
        self._timer_at = float("inf")
        now = self.clock.now()
        heap = self._deadlines
        touched: set[SubscriptionState] = set()
        while heap and heap[0][0] <= now:
            deadline, _, lease = heapq.heappop(heap)
            if not lease.active or lease.deadline != deadline:
                continue
            lease.state.nack(lease)
            touched.add(lease.state)
        for state in touched:
            state.notify()
        # Drop stale heap entries at the top so the next timer is not set for nothing.
        while heap and (not heap[0][2].active or heap[0][2].deadline != heap[0][0]):
            heapq.heappop(heap)
        if heap:
            self.schedule(heap[0][0])

    def clear(self) -> None:
        """Forget every deadline (everything was deleted)."""
        self._deadlines.clear()

    def close(self) -> None:
        """Stop the timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class SubscriptionState:
    """Live delivery state of one subscription."""

    def __init__(self, config: Any, leasing: Leasing) -> None:
        self.config = config
        #: The subscription's filter (it cannot be updated): messages it refuses never enter the backlog.
        self.matches = compile_filter(config.filter)
        self._leasing = leasing
        self.ready: deque[Pending] = deque()
        self.leases: dict[str, Lease] = {}
        #: ordering key -> messages of that key waiting behind the one ready or leased.
        self.key_backlog: dict[str, deque[Pending]] = {}
        self._waiters: set[asyncio.Future[None]] = set()
        #: messages on their way to the dead-letter topic: neither ready nor leased, not yet acknowledged.
        self.forwarding: set[Pending] = set()
        #: messages waiting out their retry back-off, each with the timer that makes it ready again.
        self.backing_off: dict[Pending, TimerHandle] = {}
        self.deleted = False

    @property
    def name(self) -> str:
        """The subscription's full name."""
        return self.config.name

    @property
    def ordered(self) -> bool:
        """Whether message ordering is on."""
        return self.config.enable_message_ordering

    @property
    def retry_policy(self) -> Any | None:
        """The retry policy, or ``None`` (redeliver at once)."""
        config = self.config
        return config.retry_policy if config.HasField("retry_policy") else None

    @property
    def dead_letter_policy(self) -> Any | None:
        """The dead-letter policy, or ``None``."""
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

    def add(self, records: Sequence[tuple[int, Any]]) -> list[int]:
        """Append newly published (or reloaded) messages; return the sequences the filter refused.

        The caller acknowledges those in the store: to the subscription they are acknowledged at publish
        time, as the real service does, and never delivered.
        """
        refused: list[int] = []
        if self.config.filter:
            matches = self.matches
            kept = []
            for record in records:
                if matches(record[1].attributes):
                    kept.append(record)
                else:
                    refused.append(record[0])
            records = kept
        if self.ordered:
            backlog = self.key_backlog
            for sequence, message in records:
                pending = Pending(sequence, message)
                key = message.ordering_key
                if not key:
                    self.ready.append(pending)
                elif key in backlog:
                    backlog[key].append(pending)
                else:
                    backlog[key] = deque()
                    self.ready.append(pending)
        else:
            self.ready.extend(Pending(sequence, message) for sequence, message in records)
        if records:
            self.notify()
        return refused

    def finished(self, pending: Pending) -> None:
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
        """Messages not yet acknowledged: ready, leased, backing off, waiting behind their key, or being
        forwarded."""
        waiting = sum(len(queue) for queue in self.key_backlog.values())
        return len(self.ready) + len(self.leases) + len(self.forwarding) + len(self.backing_off) + waiting

    # ------------------------------------------------------------- leasing
    def take(self, consumer: Consumer, max_messages: int, oldest_kept: float) -> tuple[list[Any], list[int]]:
        """Lease up to ``max_messages`` ready messages to ``consumer``.

        Returns the ``ReceivedMessage`` list and the sequences found past retention (published before
        ``oldest_kept``, in seconds since the epoch), which the caller acknowledges in the store.
        """
        ready = self.ready
        if not ready:
            return [], []
        leasing = self._leasing
        counted = self.config.HasField("dead_letter_policy")
        deadline = leasing.clock.now() + consumer.ack_deadline
        out: list[Any] = []
        expired: list[int] = []
        total_bytes = 0
        limit = min(max_messages, consumer.room())
        while ready and len(out) < limit and total_bytes < _MAX_BYTES_PER_RESPONSE:
            pending = ready.popleft()
            if pending.message.publish_time.seconds < oldest_kept:
                expired.append(pending.sequence)
                self.finished(pending)
                continue
            pending.attempts += 1
            ack_id = leasing.new_ack_id()
            lease = Lease(ack_id, pending, consumer, deadline, self)
            self.leases[ack_id] = lease
            consumer.outstanding_messages += 1
            consumer.outstanding_bytes += pending.size
            total_bytes += pending.size
            leasing.watch(lease)
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
            leasing.schedule(deadline)
        return out, expired

    def _release_flow(self, lease: Lease) -> None:
        lease.active = False
        consumer = lease.consumer
        consumer.outstanding_messages -= 1
        consumer.outstanding_bytes -= lease.pending.size

    def acknowledge(self, ack_ids: Iterable[str]) -> list[int]:
        """End the leases of ``ack_ids`` (unknown ones are ignored); the sequences acknowledged."""
        done: list[int] = []
        leases = self.leases
        for ack_id in ack_ids:
            lease = leases.pop(ack_id, None)
            if lease is None:
                continue
            self._release_flow(lease)
            done.append(lease.pending.sequence)
            self.finished(lease.pending)
        if done:
            self.notify()
        return done

    def nack(self, lease: Lease) -> None:
        """A lease ended unacknowledged (nack or deadline): redeliver, or dead-letter if attempts ran out."""
        del self.leases[lease.ack_id]
        self._release_flow(lease)
        pending = lease.pending
        policy = self.dead_letter_policy
        if policy is not None and pending.attempts >= policy.max_delivery_attempts:
            self.forwarding.add(pending)
            self._leasing.dead_letter(self, pending, policy.dead_letter_topic)
            return
        delay = retry_delay(self.retry_policy, pending.attempts)
        if delay > 0:
            self.backing_off[pending] = self._leasing.clock.call_later(delay, lambda: self._retry(pending))
        else:
            self.ready.appendleft(pending)

    def _retry(self, pending: Pending) -> None:
        """Timer: ``pending``'s back-off is over; it is ready again (unless it was dropped meanwhile)."""
        if self.backing_off.pop(pending, None) is None or self.deleted:
            return
        self.ready.appendleft(pending)
        self.notify()

    def modify(self, ack_ids: Iterable[str], seconds: int) -> None:
        """ModifyAckDeadline: 0 is a nack; otherwise the lease runs ``seconds`` from now."""
        leasing = self._leasing
        now = leasing.clock.now()
        nacked = False
        for ack_id in ack_ids:
            lease = self.leases.get(ack_id)
            if lease is None:
                continue
            if seconds == 0:
                self.nack(lease)
                nacked = True
            else:
                lease.deadline = now + seconds
                leasing.watch(lease)
                leasing.schedule(lease.deadline)
        if nacked:
            self.notify()

    def forwarded(self, pending: Pending, ok: bool) -> None:
        """The dead-letter forwarding of ``pending`` ended: gone for good if ``ok``, else ready again."""
        self.forwarding.discard(pending)
        if self.deleted:
            return
        if ok:
            self.finished(pending)
        else:
            self.ready.appendleft(pending)
        self.notify()

    def drain(self) -> list[Pending]:
        """Drop every message the subscription holds (detach, delete); returns those dropped."""
        dropped = list(self.ready)
        for lease in self.leases.values():
            self._release_flow(lease)
            dropped.append(lease.pending)
        for waiting in self.key_backlog.values():
            dropped.extend(waiting)
        for pending, timer in self.backing_off.items():
            timer.cancel()
            dropped.append(pending)
        self.backing_off.clear()
        self.ready.clear()
        self.leases.clear()
        self.key_backlog.clear()
        return dropped

    def close(self) -> None:
        """The subscription is gone (or the server stops): wake its consumers for good."""
        self.deleted = True
        for timer in self.backing_off.values():
            timer.cancel()
        self.notify()


def dead_letter_copy(subscription: str, pending: Pending) -> Any:
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
