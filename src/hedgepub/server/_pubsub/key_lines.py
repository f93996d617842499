"""The ordering keys of an ordered subscription: each key's line of messages, and the steps that queue a
line for delivery, take a message from it, end its leases and put messages back in it.

A :class:`KeyLine` holds one key's messages in publish order; the functions here work on the lines of one
:class:`~.delivery.SubscriptionState` (its ``ready`` queue, ``lines`` and ``held_lines``), which calls
them as it leases, acknowledges and redelivers. What the lines guarantee (in order, one consumer group
at a time, later messages taken back with a redelivered one) is told in :mod:`.delivery`.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from hedgepub.server._pubsub.leases import Lease, Pending

if TYPE_CHECKING:
    from hedgepub.server._pubsub.delivery import SubscriptionState


class KeyLine:
    """The messages of one ordering key on an ordered subscription, in publish order.

    ``leased`` are delivered and outstanding (stale entries, whose leases ended, are dropped from its left
    lazily), ``waiting`` are in memory and not delivered: every leased message comes before every waiting
    one. ``holder`` is the consumer group the key's messages go to while ``outstanding`` > 0; ``blocked``
    counts its messages backing off or being forwarded to the dead-letter topic (the key delivers nothing
    meanwhile). ``in_ready`` / ``in_held``: where the line is queued for delivery, if anywhere.
    """

    __slots__ = (
        "blocked",
        "holder",
        "in_held",
        "in_ready",
        "key",
        "leased",
        "more",
        "outstanding",
        "waiting",
    )

    def __init__(self, key: str) -> None:
        self.key = key
        self.waiting: deque[Pending] = deque()
        self.leased: deque[Lease[SubscriptionState]] = deque()
        self.outstanding = 0
        self.holder: object | None = None
        #: Whether the holder may take more of the key while some are outstanding (not a push consumer).
        self.more = True
        self.blocked = 0
        self.in_ready = False
        self.in_held: object | None = None

    def __repr__(self) -> str:
        return (
            f"<KeyLine {self.key!r} waiting={len(self.waiting)} outstanding={self.outstanding} "
            f"blocked={self.blocked}>"
        )


def settle(state: SubscriptionState, line: KeyLine, front: bool = False) -> None:
    """Queue ``line`` where its state says it belongs: in ``ready`` (at its front with ``front``, for a
    redelivery) when nobody holds it and it has a message to give, in its holder's ``held_lines`` when
    the holder may take more of it, else nowhere (and forgotten once it has nothing left at all). A
    line in ``ready`` stays there until taken."""
    if line.in_ready:
        return
    deliverable = bool(line.waiting) and not line.blocked
    if line.outstanding == 0:
        line.holder = None
        if line.in_held is not None:
            unhold(state, line)
        if deliverable:
            if front:
                state.ready.appendleft(line)
            else:
                state.ready.append(line)
            line.in_ready = True
        elif not line.waiting and not line.blocked:
            del state.lines[line.key]
        return
    wanted = deliverable and line.more
    if wanted and line.in_held is None:
        holder = line.holder
        queued = state.held_lines.get(holder)
        if queued is None:
            queued = state.held_lines[holder] = {}
        queued[line] = None
        line.in_held = holder
    elif not wanted and line.in_held is not None:
        unhold(state, line)


def unhold(state: SubscriptionState, line: KeyLine) -> None:
    queued = state.held_lines[line.in_held]
    del queued[line]
    if not queued:
        del state.held_lines[line.in_held]
    line.in_held = None


def pop(state: SubscriptionState, item: Pending | KeyLine) -> Pending:
    """Take ``item`` (what the state's consumer group takes next) out of the window: the message itself,
    or its line's next."""
    if type(item) is KeyLine:
        if item.in_ready:
            state.ready.popleft()
            item.in_ready = False
        elif item.in_held is not None:
            unhold(state, item)
        pending = item.waiting.popleft()
    else:
        state.ready.popleft()
        pending = item  # type: ignore[assignment]  # not a KeyLine: a Pending
    state.held_count -= 1
    state.held_bytes -= pending.size
    return pending


def end_in_line(line: KeyLine) -> None:
    """One of ``line``'s leases ended (already released): count it, drop stale entries on the left."""
    line.outstanding -= 1
    leased = line.leased
    while leased and not leased[0].active:
        leased.popleft()


def take_back_after(state: SubscriptionState, line: KeyLine, sequence: int) -> list[Pending]:
    """End the outstanding leases of ``line`` after ``sequence`` (a redelivery of an earlier message of
    the key comes first); their messages, in order, to be delivered again. Their deliveries were not
    the client's to end, so they count no attempt (the service's count is 1 + nacks and deadlines)."""
    leased = line.leased
    back: list[Pending] = []
    while leased and leased[-1].pending.sequence > sequence:
        lease = leased.pop()
        if not lease.active:
            continue
        del state.leases[lease.ack_id]
        state.release_flow(lease)
        line.outstanding -= 1
        lease.pending.attempts -= 1
        back.append(lease.pending)
    while leased and not leased[0].active:
        leased.popleft()
    back.reverse()
    if back:
        state.leasing.owner.withdrawn(state, [pending.sequence for pending in back])
    return back


def requeue(
    state: SubscriptionState, line: KeyLine | None, first: Pending | None, after: list[Pending]
) -> None:
    """Back to the front of the window, in order: ``first`` (unless ``None``), then ``after``."""
    returning = [first, *after] if first is not None else after
    for pending in returning:
        state.held_count += 1
        state.held_bytes += pending.size
    if line is None:
        state.ready.extendleft(reversed(returning))
        return
    waiting = line.waiting
    if not waiting or not returning or returning[-1].sequence < waiting[0].sequence:
        waiting.extendleft(reversed(returning))
    else:
        # Leases restored after a restart (exactly-once) can be of later messages than some read
        # since; merged by sequence, the key stays in order.
        line.waiting = deque(sorted((*returning, *waiting), key=lambda pending: pending.sequence))
