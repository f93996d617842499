"""A userspace TCP relay that does to its connections what packet loss does to a TCP connection.

:class:`FaultRelay` listens on a local port and relays every connection it accepts to an upstream server
(``hedgepub serve``, a :class:`~hedgepub.server.LocalServer`, an echo server, anything speaking TCP), one
upstream connection per accepted one. Between the two it models, per connection and per direction, what
the kernel shows an application when packets are lost, without root and on any operating system:

- **Packet loss.** Each segment of ``segment_size`` bytes read in a direction is lost with probability
  ``loss``. A lost segment is delivered after a retransmission timeout: 200 ms (Linux's minimum), and
  each time its retransmission is lost again (same probability) the timeout doubles, as TCP's back-off
  does (200, then 400 more, then 800 more ...). TCP delivers in order, so every byte behind the lost
  segment in that direction waits too: on one HTTP/2 connection, every stream.
- **A black-holed connection.** :meth:`FaultRelay.blackhole` makes chosen connections deliver nothing,
  in either direction, for a window, and refuse nothing either (no FIN, no RST: the peer's bytes are
  read and held, as a dead path swallows them). When the window ends, bytes move again at the next
  instant TCP's back-off would have retransmitted them (0.2, 0.6, 1.4, 3.0, 6.2 s ... after they were
  first held), so a 5 s window costs about 6.2 s, as it does with the kernel.
- **A slow connection set-up.** With probability ``syn_delay_probability``, a new connection moves no
  byte for ``syn_delay`` seconds (1 s: the initial retransmission timeout a lost SYN costs). The client's
  ``connect`` succeeds at once (the relay's kernel answers it), but nothing it sends is answered before
  then, so a gRPC channel is not ready before then either.

Memory is bounded: each direction holds at most ``max_buffer`` bytes (the relay stops reading that side
when full, so TCP's flow control pushes back on the sender), and at most ``max_connections`` connections
are relayed at once (one more is reset as soon as it is accepted).

It runs on an asyncio loop of its own in a background thread, so it works the same from synchronous code
and from asyncio, and its timing does not depend on how busy the caller's loop is::

    with LocalServer(in_memory=True) as server, FaultRelay(upstream=server.address, loss=0.02) as relay:
        publisher = PublisherClient(endpoint=relay.address)
        ...
        relay.blackhole(5.0, connections="newest")

    async with FaultRelay(upstream=server.address) as relay:   # the same, from a coroutine
        ...

What it does not model: the bandwidth and latency of a path (it adds none), loss of pure ACKs (which
cost an application nothing it can see), and fast retransmit (a loss followed by enough later segments
to be noticed in one round trip, on bulk transfers). docs/network.md compares its latency distribution
with the kernel's (:mod:`hedgepub.testing.network.kernel`) at the same loss.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import math
import random
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["ConnectionInfo", "FaultRelay"]

#: The retransmission timeout a first loss costs (Linux's minimum RTO).
RTO = 0.2
#: The longest single retransmission timeout (Linux's ``TCP_RTO_MAX``).
RTO_MAX = 120.0
#: Bytes of one segment (an Ethernet path's MSS): each is lost or not on its own.
SEGMENT_SIZE = 1448
#: Bytes read from a socket at once.
_READ_SIZE = 65_536

Direction = Literal["both", "up", "down"]
#: Which connections :meth:`FaultRelay.blackhole` affects: every live one, the newest, or one by index.
Selector = Literal["all", "newest"] | int


@dataclass(frozen=True)
class ConnectionInfo:
    """A snapshot of one relayed connection (:attr:`FaultRelay.connections`).

    ``up`` is the direction from the client to the upstream server, ``down`` the way back.
    """

    #: The connection's number, counted from 0 in the order the relay accepted them.
    index: int
    #: The client's address as the relay saw it, ``(host, port)``: the port tells connections apart.
    client: tuple[str, int]
    #: The relay's own address on its upstream connection (``None`` until that connection is made).
    upstream_local: tuple[str, int] | None
    #: When it was accepted, on the relay's monotonic clock (seconds).
    opened_at: float
    bytes_up: int = 0
    bytes_down: int = 0
    #: Retransmission-like pauses applied so far, per direction.
    losses_up: int = 0
    losses_down: int = 0
    #: Bytes read and not yet delivered now, per direction (at most ``max_buffer`` each).
    held_up: int = 0
    held_down: int = 0
    #: Whether its set-up was delayed (``syn_delay``).
    syn_delayed: bool = False
    #: End of its current black-hole window on the relay's clock (``None``: none set).
    blackholed_until: float | None = None
    #: Whether both its sides are closed.
    closed: bool = False


def _parse_address(address: str, what: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65_535:
        raise ValueError(f"{what} must be HOST:PORT (e.g. 127.0.0.1:8085); got {address!r}")
    return host.strip("[]"), int(port)


def _probability(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{what} must be a probability in [0, 1]; got {value!r}")
    return float(value)


def _retransmission_delay(rng: random.Random, loss: float) -> float:
    """How long a lost segment waits: one RTO, doubled each time its retransmission is lost too."""
    timeout = RTO
    delay = timeout
    while rng.random() < loss and delay < 3_600.0:
        timeout = min(timeout * 2, RTO_MAX)
        delay += timeout
    return delay


def _next_retransmission(held_at: float, until: float) -> float:
    """The first instant at or after ``until`` when TCP's back-off resends a segment held at ``held_at``."""
    instant = held_at
    timeout = RTO
    while instant < until:
        instant += timeout
        timeout = min(timeout * 2, RTO_MAX)
    return instant


class _Pipe:
    """One direction of one connection: a reader filling a bounded queue, a writer emptying it in order."""

    def __init__(self, relay: FaultRelay, connection: _Connection, name: str) -> None:
        self.relay = relay
        self.connection = connection
        self.name = name  # "up" or "down"
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.queued = 0
        self.ready_at = 0.0  # when the last queued chunk may go (in-order delivery)
        self.eof = False
        self.grew = asyncio.Event()  # the reader queued bytes, or saw the end
        self.shrank = asyncio.Event()  # the writer took bytes
        self.bytes = 0
        self.losses = 0

    def loss(self) -> float:
        return self.relay._loss_up if self.name == "up" else self.relay._loss_down

    async def read_from(self, reader: asyncio.StreamReader) -> None:
        loop = asyncio.get_running_loop()
        rng = self.relay._rng
        try:
            while True:
                while self.queued >= self.relay.max_buffer:  # full: stop reading, TCP pushes back
                    self.shrank.clear()
                    await self.shrank.wait()
                data = await reader.read(min(_READ_SIZE, self.relay.max_buffer - self.queued))
                if not data:
                    break
                now = loop.time()
                ready = max(now, self.connection.set_up_at)
                loss = self.loss()
                if loss > 0.0:
                    held = 0.0
                    for _segment in range(math.ceil(len(data) / self.relay.segment_size)):
                        if rng.random() < loss:
                            held = max(held, _retransmission_delay(rng, loss))
                    if held:
                        self.losses += 1
                        ready = max(ready, now + held)
                self.ready_at = max(self.ready_at, ready)
                self.queue.append((self.ready_at, data))
                self.queued += len(data)
                self.grew.set()
        except (ConnectionError, OSError):
            pass
        finally:
            self.eof = True
            self.grew.set()

    async def write_to(self, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self.queue:
                    if self.eof:
                        break
                    self.grew.clear()
                    await self.grew.wait()
                    continue
                ready, data = self.queue[0]
                now = loop.time()
                if ready > now:
                    await asyncio.sleep(ready - now)
                    continue
                until = self.connection.blackholed_until
                if until is not None and now < until:
                    # swallowed by the dead path: it goes at TCP's next retransmission after the window
                    retry = _next_retransmission(ready, until)
                    self.queue[0] = (retry, data)
                    self.ready_at = max(self.ready_at, retry)
                    await asyncio.sleep(retry - now)
                    continue
                self.queue.popleft()
                self.queued -= len(data)
                self.bytes += len(data)
                self.shrank.set()
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()  # pass the half-close on
        except (ConnectionError, OSError):
            self.connection.abort()


class _Connection:
    def __init__(self, relay: FaultRelay, index: int, client: tuple[str, int], opened_at: float) -> None:
        self.relay = relay
        self.index = index
        self.client = client
        self.opened_at = opened_at
        self.set_up_at = opened_at
        self.syn_delayed = False
        self.upstream_local: tuple[str, int] | None = None
        self.blackholed_until: float | None = None
        self.up = _Pipe(relay, self, "up")
        self.down = _Pipe(relay, self, "down")
        self.writers: list[asyncio.StreamWriter] = []
        self.closed = False

    def info(self) -> ConnectionInfo:
        return ConnectionInfo(
            index=self.index,
            client=self.client,
            upstream_local=self.upstream_local,
            opened_at=self.opened_at,
            bytes_up=self.up.bytes,
            bytes_down=self.down.bytes,
            losses_up=self.up.losses,
            losses_down=self.down.losses,
            held_up=self.up.queued,
            held_down=self.down.queued,
            syn_delayed=self.syn_delayed,
            blackholed_until=self.blackholed_until,
            closed=self.closed,
        )

    def abort(self) -> None:
        for writer in self.writers:
            transport = writer.transport
            if not transport.is_closing():
                transport.abort()


class FaultRelay:
    """A TCP relay in front of ``upstream`` that injects what packet loss does to a connection.

    See the module documentation for the model. Use it as a context manager (``with`` or ``async with``),
    or call :meth:`start` and :meth:`close`.

    Args:
        upstream: ``HOST:PORT`` of the server every connection is relayed to.
        listen: ``HOST:PORT`` to listen on; port 0 picks a free one (:attr:`address` says which).
        loss: probability that a segment is lost, in both directions (:meth:`set_loss` sets one).
        syn_delay_probability: probability that a new connection's set-up is delayed.
        syn_delay: how long a delayed set-up takes, in seconds (1 s: a lost SYN).
        max_connections: connections relayed at once; one more is reset when accepted.
        max_buffer: bytes held per direction of a connection before the relay stops reading it.
        segment_size: bytes per segment, each lost or not on its own.
        seed: seeds the random draws, so a run can be repeated (``None``: not seeded).

    Raises:
        ValueError: an address that is not ``HOST:PORT``, a probability outside [0, 1], a negative delay or
            a limit below 1.
    """

    def __init__(
        self,
        upstream: str,
        listen: str = "127.0.0.1:0",
        *,
        loss: float = 0.0,
        syn_delay_probability: float = 0.0,
        syn_delay: float = 1.0,
        max_connections: int = 256,
        max_buffer: int = 4 * 1024 * 1024,
        segment_size: int = SEGMENT_SIZE,
        seed: int | None = None,
    ) -> None:
        self._upstream = _parse_address(upstream, "upstream")
        self._listen = _parse_address(listen, "listen")
        self._loss_up = self._loss_down = _probability(loss, "loss")
        self.syn_delay_probability = _probability(syn_delay_probability, "syn_delay_probability")
        if not (isinstance(syn_delay, (int, float)) and math.isfinite(syn_delay) and syn_delay >= 0):
            raise ValueError(f"syn_delay must be a finite number of seconds >= 0; got {syn_delay!r}")
        self.syn_delay = float(syn_delay)
        for what, value in (
            ("max_connections", max_connections),
            ("max_buffer", max_buffer),
            ("segment_size", segment_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{what} must be a whole number >= 1; got {value!r}")
        self.max_connections = max_connections
        self.max_buffer = max_buffer
        self.segment_size = segment_size
        self._rng = random.Random(seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._live: dict[int, _Connection] = {}
        self._accepted = 0
        self._refused = 0
        self._lock = threading.Lock()
        self._address: tuple[str, int] | None = None
        self._stopped: asyncio.Event | None = None

    # lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> FaultRelay:
        """Start listening (in a background thread); returns ``self``. Raises ``OSError`` if it cannot."""
        if self._thread is not None:
            raise RuntimeError("the relay is already started")
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(started,), name="FaultRelay", daemon=True)
        self._thread.start()
        started.result()
        return self

    def close(self) -> None:
        """Stop listening and close every connection (both sides). Safe to call twice."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if thread.is_alive() and self._stopped is not None:
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(self._stopped.set)
        thread.join()
        self._thread = None

    def __enter__(self) -> FaultRelay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> FaultRelay:
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)

    def _run(self, started: concurrent.futures.Future[None]) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve(started))
        finally:
            loop.close()

    async def _serve(self, started: concurrent.futures.Future[None]) -> None:
        self._stopped = asyncio.Event()
        try:
            server = await asyncio.start_server(self._handle, self._listen[0], self._listen[1])
        except BaseException as error:
            started.set_exception(error)
            return
        self._server = server
        self._address = server.sockets[0].getsockname()[:2]
        started.set_result(None)
        try:
            await self._stopped.wait()
        finally:
            server.close()
            for connection in list(self._live.values()):
                connection.abort()
            await server.wait_closed()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.sleep(0.01)  # the aborted transports' connection_lost callbacks run

    # what it shows ------------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """``HOST:PORT`` clients connect to (the port the system picked when ``listen`` had port 0)."""
        if self._address is None:
            raise RuntimeError("the relay is not started")
        return f"{self._address[0]}:{self._address[1]}"

    @property
    def connections(self) -> list[ConnectionInfo]:
        """The connections being relayed now, oldest first (snapshots: read the property again to update)."""
        with self._lock:
            return [connection.info() for connection in self._live.values()]

    @property
    def accepted(self) -> int:
        """Connections accepted so far (refused ones included)."""
        return self._accepted

    @property
    def refused(self) -> int:
        """Connections reset at once because ``max_connections`` were being relayed."""
        return self._refused

    @property
    def loss(self) -> tuple[float, float]:
        """The loss probabilities in force: ``(up, down)``."""
        return self._loss_up, self._loss_down

    # faults -------------------------------------------------------------------------------------------

    def set_loss(self, probability: float, direction: Direction = "both") -> None:
        """Set the segment loss probability of ``direction`` (``up``: client to server) from now on.

        Applies to live connections too; bytes already held keep their pause.
        """
        value = _probability(probability, "probability")
        if direction not in ("both", "up", "down"):
            raise ValueError(f"direction must be 'both', 'up' or 'down'; got {direction!r}")
        if direction in ("both", "up"):
            self._loss_up = value
        if direction in ("both", "down"):
            self._loss_down = value

    def blackhole(self, seconds: float, connections: Selector = "all") -> list[ConnectionInfo]:
        """Black-hole live connections for ``seconds`` from now: nothing delivered, nothing refused.

        ``connections`` is ``"all"``, ``"newest"`` (the last accepted of those still open) or an index
        (:attr:`ConnectionInfo.index`). A later call replaces the window. ``seconds`` 0 ends a window (bytes
        held still wait for their retransmission instant). Returns the connections it applies to; an empty
        list when none matches.
        """
        if not (isinstance(seconds, (int, float)) and not isinstance(seconds, bool) and seconds >= 0):
            raise ValueError(f"seconds must be a number >= 0; got {seconds!r}")
        if connections not in ("all", "newest") and (
            isinstance(connections, bool) or not isinstance(connections, int)
        ):
            raise ValueError(f"connections must be 'all', 'newest' or an index; got {connections!r}")
        loop = self._loop
        if loop is None or self._thread is None:
            raise RuntimeError("the relay is not started")

        def apply() -> list[ConnectionInfo]:
            live = [connection for connection in self._live.values() if not connection.closed]
            if connections == "newest":
                chosen = live[-1:]
            elif connections == "all":
                chosen = live
            else:
                chosen = [connection for connection in live if connection.index == connections]
            until = loop.time() + seconds
            for connection in chosen:
                connection.blackholed_until = until if seconds > 0 else None
            return [connection.info() for connection in chosen]

        return asyncio.run_coroutine_threadsafe(_call(apply), loop).result()

    def now(self) -> float:
        """The relay's clock (seconds, monotonic), which :class:`ConnectionInfo` times are on."""
        if self._loop is None:
            raise RuntimeError("the relay is not started")
        return self._loop.time()

    # relaying -----------------------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        peer = writer.get_extra_info("peername") or ("?", 0)
        with self._lock:
            index = self._accepted
            self._accepted += 1
            full = len(self._live) >= self.max_connections
            if full:
                self._refused += 1
        if full:
            _reset(writer)
            return
        connection = _Connection(self, index, (str(peer[0]), int(peer[1])), loop.time())
        connection.writers.append(writer)
        if self.syn_delay_probability > 0 and self._rng.random() < self.syn_delay_probability:
            connection.syn_delayed = True
            connection.set_up_at = connection.opened_at + self.syn_delay
        with self._lock:
            self._live[index] = connection
        try:
            await self._relay(connection, reader, writer)
        except asyncio.CancelledError:
            pass  # the relay is closing (asyncio's stream callback would report the cancellation)
        finally:
            connection.closed = True
            connection.abort()
            with self._lock:
                self._live.pop(index, None)

    async def _relay(
        self, connection: _Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        loop = asyncio.get_running_loop()
        if connection.set_up_at > loop.time():
            await asyncio.sleep(connection.set_up_at - loop.time())
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            _reset(writer)  # upstream refuses: so does the relay
            return
        connection.writers.append(up_writer)
        sockname = up_writer.get_extra_info("sockname")
        if sockname:
            connection.upstream_local = (str(sockname[0]), int(sockname[1]))
        tasks = [
            asyncio.create_task(connection.up.read_from(reader)),
            asyncio.create_task(connection.up.write_to(up_writer)),
            asyncio.create_task(connection.down.read_from(up_reader)),
            asyncio.create_task(connection.down.write_to(writer)),
        ]
        try:
            # over once both directions have delivered everything and seen their end, or one side broke
            await asyncio.gather(tasks[1], tasks[3])
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for side in (writer, up_writer):
                side.close()


async def _call(function: Any) -> Any:
    return function()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (RST), as a refusing host does."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
