"""Delivery: one subscription's state machine (ready, leased, ordering, dead-letter).

All of it runs on one event loop and is driven by an injected clock; nothing here touches gRPC or writes
to the store. The core (:mod:`.core`, :mod:`.consumers`) writes to the store and calls in here; a
subscription reads its backlog from the store only through the page source it is given.

- A subscription holds a bounded window of its backlog in memory (``window`` ready messages, those
  waiting behind their ordering key included) and reads the rest in pages as the window drains, so its
  memory follows the window and its leases, not the backlog (see :class:`SubscriptionState`).
- A response holds at most :data:`MAX_MESSAGES_PER_RESPONSE` messages and :data:`MAX_RESPONSE_BYTES`
  (under the official clients' 4 MiB); a single larger message goes alone.

- Each subscription has a ``ready`` queue. Delivering a message leases it under a fresh ack ID until a
  deadline; acknowledging drops it, a modify-deadline of 0 (nack) or the deadline passing puts it back
  at the front of ``ready``. Deadlines are kept in one heap for all subscriptions
  (:class:`~.leases.Leasing`) and expired by a timer on the clock, so a lease runs out even when nobody
  pulls.
- With message ordering, each ordering key's messages form a line (:class:`~.key_lines.KeyLine`, in
  :mod:`.key_lines` with the steps on lines): several of them may
  be outstanding at once, always delivered in order, within a response and across responses, and all to
  one consumer (a stream, or the subscription's unary Pull calls together) while any is outstanding, so
  a client never holds two of a key on two streams. A push consumer holds one per key at a time. When a
  delivery of a key's message ends unacknowledged (nack, deadline), the later outstanding messages of
  the key are taken back with it (their leases end; no attempt is counted for them) and are delivered
  again after it, as the real service redelivers "message 3 as well" when message 2 comes again; while
  the message backs off, or is forwarded to the dead-letter topic, the key delivers nothing. Forwarding
  to a dead-letter topic is the documented exception: the later messages keep their leases.
- With a retry policy, a message whose lease ended unacknowledged (nack or deadline) waits
  :func:`~.leases.retry_delay` before it is ready again ("backing off"); without one it is ready at once.
- With a dead-letter policy, ``delivery_attempt`` is counted. When a message that has been delivered
  ``max_delivery_attempts`` times is nacked or its deadline passes, it is handed to the dead-letter hook
  (the core forwards it in the background) and is neither ready nor leased until that finishes. Every
  delivery that ends unacknowledged goes to the attempts hook, which the core records in the store, and a
  page read from the store takes its messages' recorded counts back: the count survives a restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from google.pubsub_v1.types import pubsub as pubsub_types

from hedgepub._clock import TimerHandle
from hedgepub.server._pubsub.filters import compile_filter
from hedgepub.server._pubsub.key_lines import (
    KeyLine,
    end_in_line,
    pop,
    requeue,
    settle,
    take_back_after,
)
from hedgepub.server._pubsub.leases import (
    AttemptsSource,
    Consumer,
    Lease,
    Leasing,
    PageSource,
    Pending,
    retry_delay,
)
from hedgepub.server._store.batch import Batch

PubsubMessage: Any = pubsub_types.PubsubMessage.pb()
ReceivedMessage: Any = pubsub_types.ReceivedMessage.pb()

#: Largest Pull or StreamingPull response, in bytes: the official clients refuse responses over 4 MiB on
#: the plain channel they open for ``PUBSUB_EMULATOR_HOST``. Each message is counted with its ack ID and
#: an upper bound of its framing (``FRAMING_BYTES``); the 64 KiB left over cover the response's other
#: fields with room to spare. A single message larger than this still goes, alone in its response.
MAX_RESPONSE_BYTES = 4 * 1024 * 1024 - 64 * 1024
#: Field tags and length prefixes around one message in a response (ReceivedMessage, its message field and
#: delivery_attempt): 1 + 3 + 1 + 1 + 1 + 3 + 6 bytes at most for a message under 2 MiB; 16 rounds it up.
FRAMING_BYTES = 16
#: Default number of ready messages a subscription keeps in memory; the rest stays in the store.
DEFAULT_WINDOW = 500
#: And their bytes at most (serialized size): a window of 500 messages of 10 MB would be 5 GB. A message
#: larger than this still enters an empty window alone.
DEFAULT_WINDOW_BYTES = 32 * 1024 * 1024
#: Seconds before a message a subscription's transforms failed on is tried again, when the subscription
#: has no retry policy of its own.
FAILED_TRANSFORM_RETRY_SECONDS = 1.0

logger = logging.getLogger("hedgepub.server")


class SubscriptionState:
    """Live delivery state of one subscription: a bounded window of its backlog, and its leases.

    Only up to ``window`` ready messages (those waiting behind their ordering key included), and no more
    than ``window_bytes`` of them (one message at least), are held in memory; the rest of the backlog
    stays in the store and is read in pages (``pages``) as the window empties. ``cursor`` is the highest
    sequence read so far: every message of the backlog at or below it is in memory (ready, waiting, leased
    or being forwarded), and ``more`` says whether the store may hold some above it. Newly published
    messages join the window directly while it has room and nothing is left in the store before them.

    ``ready`` holds what anyone may take next, in order: messages without an ordering key (all of them
    without message ordering) and the :class:`KeyLine` of each key nobody holds. A key's line that a
    consumer group holds, with more to give it, is queued in that group's ``held_lines`` instead.
    """

    def __init__(
        self,
        config: Any,
        leasing: Leasing[SubscriptionState],
        pages: PageSource | None = None,
        window: int = DEFAULT_WINDOW,
        attempts: AttemptsSource | None = None,
        window_bytes: int = DEFAULT_WINDOW_BYTES,
    ) -> None:
        self.config = config
        #: The subscription's filter (it cannot be updated): messages it refuses never enter the backlog.
        self.matches = compile_filter(config.filter)
        self.leasing = leasing
        #: Put in the subscription's ack IDs: an ack ID of another subscription (or of an earlier one of
        #: the same name) is told apart from an unknown or expired one of this one.
        self.serial = leasing.new_serial()
        self._pages = pages
        self._attempts = attempts
        self.window = window
        self.window_bytes = window_bytes
        #: Messages counted by held() (ready, or waiting in their key's line), and their serialized bytes.
        self.held_count = 0
        self.held_bytes = 0
        self.ready: deque[Pending | KeyLine] = deque()
        self.leases: dict[str, Lease[SubscriptionState]] = {}
        #: ordering key -> its line (ordered subscriptions), while the key has messages in memory.
        self.lines: dict[str, KeyLine] = {}
        #: consumer group -> the lines it holds and may take more of (a dict as an ordered set).
        self.held_lines: dict[object, dict[KeyLine, None]] = {}
        #: The group of the subscription's unary Pull calls (see :attr:`Consumer.group`).
        self.pull_group = object()
        self._waiters: set[asyncio.Future[None]] = set()
        #: messages on their way to the dead-letter topic: neither ready nor leased, not yet acknowledged.
        self.forwarding: set[Pending] = set()
        #: messages waiting out their retry back-off, each with the timer that makes it ready again.
        self.backing_off: dict[Pending, TimerHandle] = {}
        self.deleted = False
        self.cursor = 0
        self.more = pages is not None
        #: sequences leased before a restart (exactly-once) and restored as leases: a refill skips them.
        self.restored: set[int] = set()

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
        except TimeoutError:
            return False
        finally:
            self._waiters.discard(waiter)
        return True

    def held(self) -> int:
        """Messages of the window in memory: ready, or waiting in their ordering key's line."""
        return self.held_count

    def _full(self) -> bool:
        """Whether the window holds as many messages, or as many bytes, as it may."""
        held = self.held_count
        return held >= self.window or (held > 0 and self.held_bytes >= self.window_bytes)

    def _line_of(self, pending: Pending) -> KeyLine | None:
        """The line of ``pending``'s ordering key, on an ordered subscription (``None`` otherwise)."""
        if not self.ordered:
            return None
        key = pending.message.ordering_key
        return self.lines.get(key) if key else None

    def _place(self, pending: Pending) -> None:
        self.held_count += 1
        self.held_bytes += pending.size
        if self.ordered:
            key = pending.message.ordering_key
            if key:
                line = self.lines.get(key)
                if line is None:
                    line = self.lines[key] = KeyLine(key)
                line.waiting.append(pending)
                settle(self, line)
                return
        self.ready.append(pending)

    def add(self, batch: Batch) -> list[int]:
        """A newly published batch, already durable: into the window if it fits, else left in the store.

        Returns the sequences the filter refused: the caller acknowledges those in the store, since to the
        subscription they are acknowledged at publish time, as the real service does, and never delivered.
        Messages are stamped (:meth:`Batch.stamped`) only if some enter the window.
        """
        refused: list[int] = []
        if self.config.filter:
            matches = self.matches
            kept = []
            for sequence, message in zip(range(batch.first, batch.end), batch.messages, strict=True):
                if matches(message.attributes):
                    kept.append(sequence)
                else:
                    refused.append(sequence)
            sequences: Sequence[int] = kept
        else:
            sequences = range(batch.first, batch.end)
        if not self.more and sequences:
            cursor = self.cursor
            messages = batch.stamped()
            first = batch.first
            for sequence in sequences:
                if sequence <= cursor:
                    continue  # already read from the store by a refill
                if self._full():
                    self.more = True
                    break
                self._place(Pending(sequence, messages[sequence - first]))
                cursor = sequence
            self.cursor = cursor
        if sequences:
            self.notify()
        return refused

    def refill(self) -> bool:
        """Read the next page of the backlog from the store into the window; whether anything came."""
        room = self.window - self.held_count
        if not self.more or self._full() or self._pages is None:
            return False
        byte_room = max(1, self.window_bytes - self.held_bytes)
        page = self._pages(self.name, self.cursor, room, byte_room)
        # Counts recorded before a restart (or before a Seek dropped what memory held), on a subscription
        # that counts: one more read per page, over the references the page just came from.
        counts: Mapping[int, int] = {}
        if page and self._attempts is not None and self.config.HasField("dead_letter_policy"):
            counts = self._attempts(self.name, self.cursor, page[-1][0])
        refused: list[int] = []
        filtered = bool(self.config.filter)
        restored = self.restored
        for sequence, message in page:
            self.cursor = sequence
            if restored and sequence in restored:
                restored.discard(sequence)  # already in memory, under its restored lease
                continue
            if filtered and not self.matches(message.attributes):
                refused.append(sequence)
            else:
                pending = Pending(sequence, message)
                if counts:
                    pending.attempts = counts.get(sequence, 0)
                self._place(pending)
        if refused:
            self.leasing.owner.discard(self, refused)
        # A page cut short by its bytes leaves more behind, as one cut short by its count may.
        self.more = len(page) >= room or sum(message.ByteSize() for _, message in page) >= byte_room
        return bool(page)

    def backlog_size(self) -> int:
        """Messages in memory not yet acknowledged: ready, leased, backing off, waiting in their key's
        line, or being forwarded. Messages still only in the store (``more``) are not counted.
        """
        return self.held_count + len(self.leases) + len(self.forwarding) + len(self.backing_off)

    # ------------------------------------------------------------- leasing
    def _next(self, group: object) -> Pending | KeyLine | None:
        """What ``group`` takes next, left where it is: first a line it holds and may take more of, then
        the front of ``ready`` (refilled from the store when empty)."""
        held = self.held_lines.get(group) if self.held_lines else None
        if held:
            return next(iter(held))
        ready = self.ready
        while not ready:
            if not self.refill():
                return None
            held = self.held_lines.get(group) if self.held_lines else None
            if held:  # the page brought more of a key this group holds
                return next(iter(held))
        return ready[0]

    def take(self, consumer: Consumer, max_messages: int, oldest_kept: float) -> tuple[list[Any], list[int]]:
        """Lease up to ``max_messages`` ready messages to ``consumer``, within one response's size.

        Returns the ``ReceivedMessage`` list and the sequences to acknowledge in the store without
        delivering them: those past retention (published before ``oldest_kept``, in seconds since the
        epoch). The messages are as stored: the caller applies the subscription's transforms to them
        (see :meth:`transform_failed`, :meth:`give_back`).
        """
        group = consumer.group
        if self._next(group) is None:
            return [], []
        leasing = self.leasing
        counted = self.config.HasField("dead_letter_policy")
        deadline = leasing.clock.now() + consumer.ack_deadline
        out: list[Any] = []
        expired: list[int] = []
        total_bytes = 0
        limit = min(max_messages, consumer.room())
        while len(out) < limit:
            item = self._next(group)
            if item is None:
                break
            line = item if type(item) is KeyLine else None
            # mypy does not narrow on type(item) is KeyLine: a line's next, else the Pending itself
            pending: Pending = item.waiting[0] if line is not None else item  # type: ignore[union-attr,assignment]
            if pending.message.publish_time.seconds < oldest_kept:
                pop(self, item)
                expired.append(pending.sequence)
                if line is not None:
                    settle(self, line)
                continue
            size = pending.size
            ack_id = leasing.new_ack_id(self.serial)
            size += len(ack_id) + FRAMING_BYTES
            if out and total_bytes + size > MAX_RESPONSE_BYTES:
                break
            pop(self, item)
            pending.attempts += 1
            lease = Lease(ack_id, pending, consumer, deadline, self)
            self.leases[ack_id] = lease
            leasing.live += 1
            consumer.outstanding_messages += 1
            consumer.outstanding_bytes += pending.size
            total_bytes += size
            leasing.watch(lease)
            if line is not None:
                line.leased.append(lease)
                line.outstanding += 1
                line.holder = group
                line.more = not consumer.one_per_key
                settle(self, line)
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

    def restore_lease(
        self, sequence: int, message: Any, ack_id: str, remaining: float, attempts: int = 1
    ) -> None:
        """Exactly-once, after a restart: a lease granted before it, still valid for ``remaining`` seconds,
        holds again under the same ack ID (so it can be acknowledged, and is not delivered meanwhile).
        ``attempts``: the deliveries of the message so far, this lease's included. On an ordered
        subscription the lease holds its key: the key's later messages wait until it ends."""
        leasing = self.leasing
        pending = Pending(sequence, message)
        pending.attempts = attempts
        consumer = Consumer(remaining, one_per_key=True)
        consumer.closed = True  # nobody is receiving through it; it only carries the flow counters
        consumer.outstanding_messages = 1
        consumer.outstanding_bytes = pending.size
        lease = Lease(ack_id, pending, consumer, leasing.clock.now() + remaining, self)
        self.leases[ack_id] = lease
        leasing.live += 1
        leasing.watch(lease)
        leasing.schedule(lease.deadline)
        self.restored.add(sequence)
        key = message.ordering_key if self.ordered else ""
        if key:
            line = self.lines.get(key)
            if line is None:
                line = self.lines[key] = KeyLine(key)
            line.leased = deque(sorted((*line.leased, lease), key=lambda held: held.pending.sequence))
            line.outstanding += 1
            line.holder = consumer.group
            line.more = False

    def release_flow(self, lease: Lease[SubscriptionState]) -> None:
        """A lease ended: it is no longer live, nor counted against its consumer's flow control."""
        lease.active = False
        self.leasing.live -= 1
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
            self.release_flow(lease)
            done.append(lease.pending.sequence)
            line = self._line_of(lease.pending)
            if line is not None:
                end_in_line(line)
                settle(self, line)
        if done:
            self.notify()
        return done

    def nack(self, lease: Lease[SubscriptionState], default_delay: float = 0.0) -> None:
        """A lease ended unacknowledged (nack or deadline): redeliver, or dead-letter if attempts ran out.

        On an ordered subscription the key's later outstanding messages are taken back too and delivered
        again after it, unless it goes to the dead-letter topic. ``default_delay``: the back-off when the
        subscription has no retry policy."""
        del self.leases[lease.ack_id]
        self.release_flow(lease)
        pending = lease.pending
        line = self._line_of(pending)
        if line is not None:
            end_in_line(line)
        if self._dead_lettered(pending, line):
            return
        after = take_back_after(self, line, pending.sequence) if line is not None else []
        delay = retry_delay(self.retry_policy, pending.attempts) or default_delay
        if delay > 0:
            # The message itself comes back when its back-off ends; its key's later ones wait for it.
            self.backing_off[pending] = self.leasing.clock.call_later(delay, lambda: self._retry(pending))
            if line is not None:
                line.blocked += 1
                requeue(self, line, None, after)
        else:
            requeue(self, line, pending, after)
        if line is not None:
            settle(self, line, front=True)

    def _dead_lettered(self, pending: Pending, line: KeyLine | None) -> bool:
        """An unacknowledged delivery attempt ended: with a dead-letter policy, record the attempt and, once
        the policy's attempts are spent, forward the message to the dead-letter topic (True)."""
        policy = self.dead_letter_policy
        if policy is None:
            return False
        self.leasing.owner.attempted(self, pending)
        if pending.attempts < policy.max_delivery_attempts:
            return False
        self.forwarding.add(pending)
        if line is not None:
            line.blocked += 1
            settle(self, line)
        self.leasing.owner.dead_letter(self, pending, policy.dead_letter_topic)
        return True

    def transform_failed(self, lease: Lease[SubscriptionState], failure: Exception) -> None:
        """The subscription's transforms failed on a leased message before it was handed out: the delivery
        attempt ends unacknowledged, as a nack (dead letter once the policy's attempts are spent; on an
        ordered subscription the key's later messages come back after it), waiting out the retry policy's
        back-off, :data:`FAILED_TRANSFORM_RETRY_SECONDS` without one (a UDF that always fails does not
        spin)."""
        logger.warning(
            "Message %s of %s not delivered (attempt %d): %s",
            lease.pending.message.message_id,
            self.name,
            lease.pending.attempts,
            failure,
        )
        self.nack(lease, FAILED_TRANSFORM_RETRY_SECONDS)
        self.notify()

    def give_back(self, leases: Sequence[Lease[SubscriptionState]]) -> None:
        """Leases made but not handed out (the tail of a response: their transforms did not run, or it
        would be too large): ended counting no attempt, their messages back at the front in order."""
        for lease in reversed(leases):
            if self.leases.pop(lease.ack_id, None) is None:
                continue
            self.release_flow(lease)
            pending = lease.pending
            pending.attempts -= 1
            line = self._line_of(pending)
            if line is not None:
                end_in_line(line)
                after = take_back_after(self, line, pending.sequence)
                requeue(self, line, pending, after)
                settle(self, line, front=True)
            else:
                requeue(self, None, pending, [])
        self.notify()

    def _retry(self, pending: Pending) -> None:
        """Timer: ``pending``'s back-off is over; it is ready again (unless it was dropped meanwhile)."""
        if self.backing_off.pop(pending, None) is None or self.deleted:
            return
        line = self._line_of(pending)
        requeue(self, line, pending, [])
        if line is not None:
            line.blocked -= 1
            settle(self, line, front=True)
        self.notify()

    def modify(self, ack_ids: Iterable[str], seconds: int) -> None:
        """ModifyAckDeadline: 0 is a nack; otherwise the lease runs ``seconds`` from now."""
        leasing = self.leasing
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
        """The dead-letter forwarding of ``pending`` ended: gone for good if ``ok``, else ready again
        (with, on an ordered subscription, the key's later outstanding messages taken back after it)."""
        self.forwarding.discard(pending)
        if self.deleted:
            return
        line = self._line_of(pending)
        if ok:
            if line is not None:
                line.blocked -= 1
                settle(self, line)
        else:
            after = take_back_after(self, line, pending.sequence) if line is not None else []
            requeue(self, line, pending, after)
            if line is not None:
                line.blocked -= 1
                settle(self, line, front=True)
        self.notify()

    def drain(self) -> list[Pending]:
        """Drop every message the subscription holds (detach, delete); returns those dropped."""
        dropped = [item for item in self.ready if type(item) is not KeyLine]
        for line in self.lines.values():
            dropped.extend(line.waiting)
        for lease in self.leases.values():
            self.release_flow(lease)
            dropped.append(lease.pending)
        for pending, timer in self.backing_off.items():
            timer.cancel()
            dropped.append(pending)
        self.backing_off.clear()
        self.ready.clear()
        self.leases.clear()
        self.lines.clear()
        self.held_lines.clear()
        self.held_count = 0
        self.held_bytes = 0
        return dropped  # type: ignore[return-value]  # KeyLines were left out: Pendings only

    def reset(self) -> None:
        """A Seek rewrote the backlog in the store: drop what memory holds (leases included, so their ack
        IDs stop counting) and read the backlog again from its start."""
        self.drain()
        self.restored.clear()
        self.cursor = 0
        self.more = self._pages is not None
        self.notify()

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
