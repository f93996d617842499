"""A pool of connections to one endpoint: attempts spread over them, hedges escape a held or dead one.

Every attempt on one HTTP/2 connection shares its fate: a lost TCP segment holds every stream of the
connection until it is retransmitted (200 ms at least on Linux), and a connection whose peer or path died
takes every call into a black hole until keepalive notices. So each endpoint gets
``channel_pool_size`` connections, each its own gRPC channel with its own subchannel pool
(``grpc.use_local_subchannel_pool``), hence its own TCP connection, and:

- **One home** (docs/hedging.md, rule 23): originals go on the first connection that is warm and connected
  (measured: spreading them over the pool cost throughput, docs/publisher.md), so the others carry hedges
  and retries.
- **Escaping** (rule 24): a hedge goes on a connection that none of its batch's running attempts uses;
  the retry of a failed original avoids those and the one its failed try used.
- **Warm** (rule 25): each connection is connected at once and reconnected whenever it drops
  (:meth:`GrpcTransport.keep_connected`, every :data:`KEEP_WARM` seconds); an attempt goes to a ready
  connection while there is one, so none waits for a set-up while another is warm; while none is ready
  (the first publish, every connection's SYN in flight), it waits for the first that gets ready
  (:meth:`ConnectionPool.choose`) rather than queue on one whose SYN may have been lost (1 s).
- **Silence** (rule 26): a connection on which nothing came back for :data:`SILENCE_AFTER` while an attempt
  was outstanding, or whose attempt lost to an attempt of the same batch on another connection with
  nothing back since it was sent, turns *silent*: it takes no new attempt while another connection is
  warm, and it is probed (a tiny RPC, :data:`PROBE_METHOD`) at once. Any answer (of an attempt or a probe)
  makes it warm again. A probe without an answer within :data:`PROBE_TIMEOUT` replaces the connection: a
  new channel, then the old one closed, which cancels the attempts stuck on it (their batches retry on
  another connection, rule 1). A replacement that stays silent too is replaced again after a doubling
  pause (up to :data:`MAX_REPLACEMENT_PAUSE`).

The pool runs on the publisher's loop; its counters are read from any thread for ``stats()``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

from hedgepub._clock import Clock, TimerHandle

if TYPE_CHECKING:
    from hedgepub._publisher.stats import ConnectionStats
    from hedgepub._transport.grpc import Transport

_LOGGER = logging.getLogger("hedgepub")

#: Connections per endpoint unless ``channel_pool_size`` says otherwise (measured: docs/publisher.md).
DEFAULT_POOL_SIZE = 2
#: The most connections per endpoint ``channel_pool_size`` accepts.
MAX_POOL_SIZE = 16
#: Seconds an attempt may be outstanding on a connection with nothing coming back on it before the
#: connection turns silent.
SILENCE_AFTER = 1.0
#: Seconds a probe of a silent connection waits for its answer before the connection is replaced.
PROBE_TIMEOUT = 1.0
#: Seconds between probes when one fails at once (a connection refused), and the first replacement pause.
PROBE_PAUSE = 0.5
#: Seconds between two rounds of keeping the connections warm (connecting the ones that dropped or idled).
KEEP_WARM = 1.0
#: The longest an attempt waits for one of the pool's connections to get ready when none is (then it goes
#: on the connection :meth:`ConnectionPool.pick` names, where gRPC waits for the connection itself).
CONNECT_WAIT = 10.0
#: The longest pause between two replacements of a connection that stays silent.
MAX_REPLACEMENT_PAUSE = 30.0


class ConnectionState(str, enum.Enum):
    """What a pool's connection is doing."""

    #: Answering (or not yet asked): takes attempts.
    WARM = "warm"
    #: Nothing came back in time: takes no new attempt while another connection is warm; probed.
    SILENT = "silent"


class Lease:
    """One attempt on one connection of a pool: handed out by :meth:`ConnectionPool.start`."""

    __slots__ = ("generation", "member", "sent_at", "transport")

    def __init__(self, member: int, generation: int, sent_at: float, transport: Transport) -> None:
        self.member = member
        self.generation = generation
        self.sent_at = sent_at
        self.transport = transport


class _Member:
    """One connection of a pool (its transport is replaced when it stays silent)."""

    __slots__ = (
        "attempts_sent",
        "generation",
        "in_flight",
        "index",
        "last_answer",
        "next_replacement",
        "probe_task",
        "replacement_pause",
        "replacements",
        "silent_since",
        "state",
        "transport",
    )

    def __init__(self, index: int, transport: Transport) -> None:
        self.index = index
        self.transport = transport
        self.generation = 0
        self.state = ConnectionState.WARM
        #: the outstanding attempts, oldest first (a dict keeps insertion order; removal is O(1))
        self.in_flight: dict[Lease, None] = {}
        self.last_answer = -math.inf
        self.silent_since: float | None = None
        self.attempts_sent = 0
        self.replacements = 0
        self.replacement_pause = PROBE_PAUSE
        self.next_replacement = -math.inf
        self.probe_task: asyncio.Task[None] | None = None


class ConnectionPool:
    """The connections of one endpoint, made by ``connect`` (or given ready-made, in tests).

    ``connect(key)`` opens one new connection; ``key`` is unique per connection ever made by this pool,
    and goes into the channel's arguments so that no two share a TCP connection. Call :meth:`open` on the
    loop that will use the connections.
    """

    def __init__(
        self,
        connect: Callable[[int], Transport] | None = None,
        size: int = 1,
        *,
        ready: Sequence[Transport] = (),
        clock: Clock | None = None,
        description: str = "",
    ) -> None:
        if connect is None and not ready:
            raise ValueError("a ConnectionPool needs a connect function or ready-made transports")
        from hedgepub._clock import DEFAULT_CLOCK

        self._connect = connect
        self._ready = tuple(ready)
        self.size = len(self._ready) if self._ready else size
        self._clock = clock or DEFAULT_CLOCK
        self.description = description
        self._members: list[_Member] = []
        self._keys = 0
        self._check: TimerHandle | None = None
        self._upkeep: TimerHandle | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = False

    @property
    def opened(self) -> bool:
        """Whether the connections have been opened (or handed over) yet."""
        return bool(self._members)

    def open(self) -> None:
        """Open every connection (once) and keep each connected; raises what ``connect`` raises."""
        if self._members:
            return
        self._closed = False
        transports = list(self._ready) or [self._new_transport() for _ in range(self.size)]
        self._members = [_Member(index, transport) for index, transport in enumerate(transports)]
        self._keep_warm()

    def _keep_warm(self) -> None:
        """Connect every connection that is not (rule 25), now and every :data:`KEEP_WARM` seconds while a
        transport has a connection to keep (a scripted one has none, and leaves a virtual clock alone)."""
        self._upkeep = None
        if self._closed:
            return
        kept = [member.transport.keep_connected() for member in self._members]
        if any(kept):
            self._upkeep = self._clock.call_later(KEEP_WARM, self._keep_warm)

    def _new_transport(self) -> Transport:
        assert self._connect is not None
        key, self._keys = self._keys, self._keys + 1
        return self._connect(key)

    # Routing ---------------------------------------------------------------------------------------------

    def pick(self, avoid: Collection[int] = ()) -> int:
        """The connection for the next attempt: the first, in the pool's order, that is warm, connected and
        not in ``avoid`` (rules 23 and 24).

        Failing that, in this order: warm but still connecting, silent, then (only when every connection
        is in ``avoid``) the same classes among those avoided.
        """
        members = self._members
        if len(members) == 1:
            return 0
        best, best_rank = 0, 99
        for member in members:
            rank = 0 if member.state is ConnectionState.WARM else 2
            # last seen not ready: look again (a connection made since then takes the attempt)
            if (
                rank == 0
                and not member.transport.ready
                and not (member.transport.keep_connected() and member.transport.ready)
            ):
                rank = 1
            if avoid and member.index in avoid:
                rank += 3
            if rank == 0:
                return member.index
            if rank < best_rank:
                best, best_rank = member.index, rank
        return best

    def pick_ready(self, avoid: Collection[int] = ()) -> int | None:
        """:meth:`pick` when the connection it names is warm and ready (so :meth:`choose` would not wait),
        else ``None``: the sender's way to the usual case without a coroutine per attempt."""
        chosen = self.pick(avoid)
        member = self._members[chosen]
        if member.state is ConnectionState.WARM and member.transport.ready:
            return chosen
        return None

    async def choose(self, avoid: Collection[int] = (), timeout: float = CONNECT_WAIT) -> int:
        """:meth:`pick`, but while no warm connection outside ``avoid`` is ready, first wait (at most
        ``timeout``) for the first of them to get ready (rule 25): with two connections opening at once,
        an attempt rides whichever finishes its handshake first, not the first one whose SYN was lost."""
        ready = self.pick_ready(avoid)
        if ready is not None:
            return ready
        chosen = self.pick(avoid)
        candidates = [
            candidate
            for candidate in self._members
            if candidate.state is ConnectionState.WARM and candidate.index not in avoid
        ]
        if len(candidates) < 2:  # nothing to choose between: gRPC waits on the one there is
            return chosen
        waits = [asyncio.ensure_future(candidate.transport.wait_ready(timeout)) for candidate in candidates]
        try:
            pending = set(waits)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(not task.cancelled() and task.exception() is None and task.result() for task in done):
                    break
        finally:
            for task in waits:
                task.cancel()
        return self.pick(avoid)

    def start(self, member_index: int) -> Lease:
        """An attempt goes out on connection ``member_index`` now."""
        member = self._members[member_index]
        lease = Lease(member_index, member.generation, self._clock.now(), member.transport)
        member.in_flight[lease] = None
        member.attempts_sent += 1
        if self._check is None and member.state is ConnectionState.WARM:
            self._check = self._clock.call_later(SILENCE_AFTER, self._check_silence)
        return lease

    def ended(self, lease: Lease, answered: bool = False) -> None:
        """The attempt of ``lease`` is over, however it ended; ``answered``: with an answer from the other
        end, as :meth:`answered` says (one call for both, once per attempt)."""
        member = self._members[lease.member] if lease.member < len(self._members) else None
        if member is not None and member.generation == lease.generation:
            member.in_flight.pop(lease, None)
            if answered:
                self._heard_from(member, self._clock.now())

    def answered(self, lease: Lease) -> None:
        """The attempt of ``lease`` got an answer from the other end (message IDs or a status it sent)."""
        member = self._members[lease.member] if lease.member < len(self._members) else None
        if member is not None and member.generation == lease.generation:
            self._heard_from(member, self._clock.now())

    def lost(self, lease: Lease, winner_member: int | None) -> None:
        """The attempt of ``lease`` was cancelled because an attempt of its batch on connection
        ``winner_member`` won: a connection that gave nothing back since that attempt went out turns
        silent (rule 26)."""
        if winner_member is None or winner_member == lease.member or lease.member >= len(self._members):
            return
        member = self._members[lease.member]
        if (
            member.generation == lease.generation
            and member.state is ConnectionState.WARM
            and member.last_answer < lease.sent_at
        ):
            self._silence(member, self._clock.now(), "an attempt on it lost to one on another connection")

    def transport(self, member_index: int) -> Transport:
        """Connection ``member_index``'s transport now."""
        return self._members[member_index].transport

    def connected(self, member_index: int) -> bool | None:
        """Whether connection ``member_index`` is connected now (None: cannot tell)."""
        return self._members[member_index].transport.connected()

    # Silence, probes and replacement ---------------------------------------------------------------------

    def _heard_from(self, member: _Member, now: float) -> None:
        member.last_answer = now
        if member.state is ConnectionState.SILENT:
            self._warm(member, now)

    def _warm(self, member: _Member, now: float) -> None:
        silent_for = 0.0 if member.silent_since is None else now - member.silent_since
        member.state, member.silent_since = ConnectionState.WARM, None
        member.replacement_pause, member.next_replacement = PROBE_PAUSE, -math.inf
        _LOGGER.debug(
            "hedgepub: connection %d to %s answers again after %.3f s",
            member.index,
            self.description,
            silent_for,
        )
        if member.in_flight and self._check is None:
            self._check = self._clock.call_later(SILENCE_AFTER, self._check_silence)

    def _silence(self, member: _Member, now: float, why: str) -> None:
        member.state, member.silent_since = ConnectionState.SILENT, now
        _LOGGER.debug("hedgepub: connection %d to %s is silent (%s)", member.index, self.description, why)
        if member.probe_task is None or member.probe_task.done():
            member.probe_task = asyncio.ensure_future(self._probe(member))

    def _check_silence(self) -> None:
        """The check timer: silence every warm connection with an attempt out for SILENCE_AFTER and nothing
        back since, then arm again for the next moment one could turn silent."""
        self._check = None
        if self._closed:
            return
        now = self._clock.now()
        due = math.inf
        for member in self._members:
            if member.state is not ConnectionState.WARM:
                continue
            for lease in member.in_flight:
                if lease.sent_at > member.last_answer:  # the oldest attempt nothing came back since
                    if now - lease.sent_at >= SILENCE_AFTER:
                        self._silence(member, now, f"nothing back for {now - lease.sent_at:.3f} s")
                    else:
                        due = min(due, lease.sent_at + SILENCE_AFTER)
                    break
            else:
                if member.in_flight:
                    due = min(due, now + SILENCE_AFTER)
        if due < math.inf:
            self._check = self._clock.call_later(max(0.0, due - now), self._check_silence)

    async def _probe(self, member: _Member) -> None:
        """Probe a silent connection until it answers, replacing it while it does not."""
        clock = self._clock
        while not self._closed and member.state is ConnectionState.SILENT:
            transport, generation = member.transport, member.generation
            started = clock.now()
            try:
                answered = await transport.probe(PROBE_TIMEOUT)
            except asyncio.CancelledError:
                raise
            except Exception:  # a probe that breaks says nothing came back
                answered = False
            if self._closed or member.state is not ConnectionState.SILENT:
                return
            now = clock.now()
            if answered and member.generation == generation:
                self._heard_from(member, now)
                return
            if self._connect is not None and now >= member.next_replacement:
                self._replace(member, now)
            elif now - started < PROBE_PAUSE:
                await clock.sleep(PROBE_PAUSE - (now - started))

    def _replace(self, member: _Member, now: float) -> None:
        old = member.transport
        try:
            member.transport = self._new_transport()
        except Exception:
            _LOGGER.warning("hedgepub: cannot open a connection to %s", self.description, exc_info=True)
            member.next_replacement = now + member.replacement_pause
            return
        member.generation += 1
        member.replacements += 1
        member.in_flight.clear()  # the old attempts' leases no longer count; closing cancels them
        member.last_answer = -math.inf
        member.next_replacement = now + member.replacement_pause
        member.replacement_pause = min(member.replacement_pause * 2, MAX_REPLACEMENT_PAUSE)
        if member.transport.keep_connected() and self._upkeep is None:
            self._upkeep = self._clock.call_later(KEEP_WARM, self._keep_warm)
        _LOGGER.warning(
            "hedgepub: connection %d to %s gave no answer for %.1f s; replaced by a new connection (the "
            "attempts on the old one are retried)",
            member.index,
            self.description,
            now - (member.silent_since or now),
        )
        task = asyncio.ensure_future(old.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    # What it exposes -------------------------------------------------------------------------------------

    def snapshot(self) -> tuple[ConnectionStats, ...]:
        """Each connection's counters and state, now."""
        from hedgepub._publisher.stats import ConnectionStats

        return tuple(
            ConnectionStats(
                attempts_sent=member.attempts_sent,
                attempts_in_flight=len(member.in_flight),
                state=member.state.value,
                replacements=member.replacements,
            )
            for member in list(self._members)
        )

    async def close(self) -> None:
        """Close every connection; attempts still running are cancelled."""
        self._closed = True
        for timer in (self._check, self._upkeep):
            if timer is not None:
                timer.cancel()
        self._check = self._upkeep = None
        members, self._members = self._members, []
        for member in members:
            if member.probe_task is not None:
                member.probe_task.cancel()
        for member in members:
            await member.transport.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def __repr__(self) -> str:
        states = ", ".join(member.state.value for member in self._members) or "not opened"
        return f"ConnectionPool({self.description or 'ready-made'}, size={self.size}: {states})"


def check_channel_pool_size(value: object) -> int:
    """Validate ``channel_pool_size``: a whole number from 1 to :data:`MAX_POOL_SIZE`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"channel_pool_size must be a whole number (int); got {type(value).__name__} {value!r}"
        )
    if not 1 <= value <= MAX_POOL_SIZE:
        raise ValueError(f"channel_pool_size must be in [1, {MAX_POOL_SIZE}]; got {value!r}")
    return value
