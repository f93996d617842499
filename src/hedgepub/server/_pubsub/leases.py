"""Leases: the consumers that take messages, the leases they hold, and the one timer of every lease's
deadline (:class:`Leasing`), shared by all subscriptions.

Delivering a message leases it under a fresh ack ID until a deadline. Deadlines are kept in one heap for
all subscriptions and expired by a timer on the injected clock, so a lease runs out even when nobody
pulls; what happens then is the subscription's business (:mod:`.delivery`). With a retry policy, a
message whose lease ended unacknowledged waits :func:`retry_delay` before it is ready again.
"""

from __future__ import annotations

import heapq
import itertools
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

from hedgepub._clock import Clock, TimerHandle
from hedgepub.server._pubsub.limits import seconds

__all__ = [
    "MAX_MESSAGES_PER_RESPONSE",
    "Consumer",
    "Lease",
    "LeaseHolder",
    "Leasing",
    "Pending",
    "retry_delay",
    "well_formed_ack_id",
]

#: Largest batch handed out at once (one Pull response or one StreamingPull response).
MAX_MESSAGES_PER_RESPONSE = 1000


class Consumer:
    """Who receives a delivery: a Pull call or a StreamingPull stream, with its flow-control window."""

    __slots__ = (
        "ack_deadline",
        "closed",
        "confirmations",
        "group",
        "max_bytes",
        "max_messages",
        "one_per_key",
        "outstanding_bytes",
        "outstanding_messages",
    )

    def __init__(
        self,
        ack_deadline: float,
        max_messages: int = 0,
        max_bytes: int = 0,
        *,
        group: object | None = None,
        one_per_key: bool = False,
    ) -> None:
        self.ack_deadline = ack_deadline
        self.max_messages = max_messages  # 0: no limit
        self.max_bytes = max_bytes  # 0: no limit
        self.outstanding_messages = 0
        self.outstanding_bytes = 0
        self.closed = False
        #: Who the messages of an ordering key stay with while some are outstanding (ordered
        #: subscriptions): the consumer itself (a stream, a push worker), or a token its subscription's
        #: unary Pull calls share, so that the next Pull goes on with a key where the last one left it.
        self.group: object = self if group is None else group
        #: At most one outstanding message per ordering key (push delivery, as the real service does);
        #: otherwise several, in order, up to the flow-control limits.
        self.one_per_key = one_per_key
        #: What a stream owes its client besides messages (exactly-once confirmations of its acks and
        #: modacks, kept by the service layer); ``None`` when nothing.
        self.confirmations: Any = None

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


class LeaseHolder(Protocol):
    """What a lease belongs to (a subscription's delivery state, :class:`.delivery.SubscriptionState`):
    all the deadline timer needs of it. The subscription imports this module, never the reverse."""

    def nack(self, lease: Lease[Any]) -> None:
        """Take back ``lease``, whose deadline passed, for delivery again."""

    def notify(self) -> None:
        """Wake whoever waits for the subscription's ready messages."""


#: The holder type of a :class:`Lease` and a :class:`Leasing`; a :class:`LeaseOwner` is called with it.
H = TypeVar("H", bound=LeaseHolder)


class Lease(Generic[H]):
    """A delivered, unacknowledged message: who holds it and until when."""

    # __weakref__: the deadline heap refers to leases weakly, so that an ended lease (and its message)
    # is freed when its subscription drops it, not when its old deadline passes.
    __slots__ = ("__weakref__", "ack_id", "active", "consumer", "deadline", "entry", "pending", "state")

    def __init__(self, ack_id: str, pending: Pending, consumer: Consumer, deadline: float, state: H) -> None:
        self.ack_id = ack_id
        self.state = state
        self.pending = pending
        self.consumer = consumer
        self.deadline = deadline
        self.active = True
        self.entry = -1  # serial of its current entry in the deadline heap; older entries are stale


def well_formed_ack_id(ack_id: str) -> bool:
    """Whether ``ack_id`` has the form of the ack IDs :meth:`Leasing.new_ack_id` makes, of this process or
    another: eight characters, then two numbers each after a ``-`` (or one: the form of earlier
    versions, which named no subscription)."""
    prefix, _, rest = ack_id.partition("-")
    numbers = rest.split("-")
    return len(prefix) == 8 and len(numbers) <= 2 and all(number.isdigit() for number in numbers)


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


#: Reads a page of a subscription's backlog from the store: (subscription, after sequence, limit).
PageSource = Callable[[str, int, int, int], Sequence[tuple[int, Any]]]
#: Reads the recorded delivery attempts of a page: (subscription, after sequence, through sequence).
AttemptsSource = Callable[[str, int, int], Mapping[int, int]]

#: The holder type a :class:`LeaseOwner` is called with (contravariant, as it is only taken).
H_contra = TypeVar("H_contra", bound=LeaseHolder, contravariant=True)


class LeaseOwner(Protocol[H_contra]):
    """The part leases call into when a lease ends in something the subscription cannot settle alone
    (store writes, forwarding): the consumers (:class:`.consumers.Consumers`). The seam keeps this module
    and the subscription's state free of the store."""

    def dead_letter(self, state: H_contra, pending: Pending, topic: str) -> None:
        """``pending`` used up its delivery attempts on ``state``: forward it to ``topic``."""

    def discard(self, state: H_contra, sequences: list[int]) -> None:
        """Messages read from the store that must be acknowledged without delivery (filtered out)."""

    def attempted(self, state: H_contra, pending: Pending) -> None:
        """A delivery under a dead-letter policy ended unacknowledged (nack or deadline); ``pending``
        carries its count of deliveries so far."""

    def withdrawn(self, state: H_contra, sequences: list[int]) -> None:
        """The service took these leases back to keep an ordering key in order (a redelivery of an
        earlier message of the key): exactly-once subscriptions forget their recorded leases."""


def _current(entry: tuple[float, int, weakref.ReferenceType[Lease[H]]]) -> Lease[H] | None:
    """The lease of a deadline-heap entry while the entry is its current one and it lasts, else ``None``."""
    lease = entry[2]()
    if lease is None or not lease.active or lease.entry != entry[1]:
        return None
    return lease


class Leasing(Generic[H]):
    """What every subscription shares: the clock, ack IDs, the lease-deadline heap and its timer, and the
    owner a subscription (of type ``H``) calls into when a lease ends in a store write or a forwarding."""

    def __init__(self, clock: Clock, owner: LeaseOwner[H]) -> None:
        self.clock = clock
        #: Called by the subscriptions sharing this leasing (see :class:`LeaseOwner`).
        self.owner = owner
        # A per-process prefix keeps ack IDs handed out before a restart from matching new leases; the
        # holder's serial in the middle tells the ack IDs of one subscription from another's.
        self._ack_prefix = os.urandom(4).hex()
        self._ack_counter = itertools.count(1)
        self._serials = itertools.count(1)
        #: (deadline, entry serial, the lease, weakly: its subscription's ``leases`` holds it while it
        #: lasts; a lease acknowledged with a deadline 10 minutes away must not keep its message that long).
        self._deadlines: list[tuple[float, int, weakref.ReferenceType[Lease[H]]]] = []
        self._heap_counter = itertools.count()
        self._timer: TimerHandle | None = None
        self._timer_at = float("inf")
        #: Leases not yet ended, across subscriptions; the heap is compacted when most entries are stale.
        self.live = 0

    def new_serial(self) -> int:
        """A number for a new holder (a subscription, each time one is created), put in its ack IDs."""
        return next(self._serials)

    def new_ack_id(self, serial: int) -> str:
        """A fresh ack ID of the holder numbered ``serial``: ``<prefix>-<serial>-<n>``, unique in this
        process and unlike any of an earlier process."""
        return f"{self._ack_prefix}-{serial}-{next(self._ack_counter)}"

    def holder_of(self, ack_id: str) -> int | None:
        """The serial of the holder an ack ID of this process was made for; ``None`` for one of another
        process, and for one that is malformed (see :func:`well_formed_ack_id`)."""
        prefix, _, rest = ack_id.partition("-")
        serial, _, number = rest.partition("-")
        if prefix != self._ack_prefix or not serial.isdigit() or not number.isdigit():
            return None
        return int(serial)

    def watch(self, lease: Lease[H]) -> None:
        """Expire ``lease`` at its current deadline unless it ends or changes before."""
        heap = self._deadlines
        lease.entry = serial = next(self._heap_counter)
        heapq.heappush(heap, (lease.deadline, serial, weakref.ref(lease)))
        # An acknowledged lease, or a deadline a ModifyAckDeadline replaced, leaves a stale entry until its
        # old deadline passes; a modack loop would grow the heap without bound. Rebuilding it once stale
        # entries outnumber live leases keeps it within twice the live leases, at O(1) amortized cost.
        if len(heap) > 2 * self.live + 1024:
            self._deadlines = [entry for entry in heap if _current(entry) is not None]
            heapq.heapify(self._deadlines)

    def heap_size(self) -> int:
        """Entries in the lease-deadline heap, stale ones included (for tests of its compaction)."""
        return len(self._deadlines)

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
        touched: set[H] = set()
        while heap and heap[0][0] <= now:
            lease = _current(heapq.heappop(heap))
            if lease is None:
                continue
            lease.state.nack(lease)
            touched.add(lease.state)
        for state in touched:
            state.notify()
        # Drop stale heap entries at the top so the next timer is not set for nothing.
        while heap and _current(heap[0]) is None:
            heapq.heappop(heap)
        if heap:
            self.schedule(heap[0][0])

    def clear(self) -> None:
        """Forget every deadline (everything was deleted)."""
        self._deadlines.clear()
        self.live = 0

    def close(self) -> None:
        """Stop the timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
