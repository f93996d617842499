"""The one-port front's relay process: gRPC connections relayed in the kernel, off the server's interpreter.

The server's Python thread is what limits its throughput, so relaying gRPC's bytes on it (as
the front's event-loop relay does) takes from every call. On Linux the front instead
hands each gRPC connection's socket, once told apart from HTTP/1.1, to this process (``SCM_RIGHTS``
over a private socket pair). Here one thread waits on every relayed socket with ``epoll`` and moves
what arrives with ``splice(2)`` through a pipe per direction, so the bytes never enter user space.

One thread for all, not a thread per direction blocked in ``splice``: on a busy machine what a relay
costs is mostly its wake-ups, and one thread wakes once for whatever became ready since it last
looked (a request one way, the answer to an earlier one the other, several connections), where
blocked threads wake once each and then contend for the GIL. Measured side by side
(``benchmarks/rest_front.py``), it halved the relay's voluntary context switches per call.

The process keeps to one CPU (the last it may use, or the one ``ServerOptions.relay_cpu`` names,
``hedgepub serve --relay-cpu``; ``any`` leaves it to the scheduler). Left free, it ran mostly on the
server's busy Python thread's CPU (60-73% of samples on 2 cores), since a wake-up tends to bring it next
to whoever woke it, and each chunk it moved there took that thread off the CPU, the thread that bounds
the server's throughput. Kept to one CPU, the scheduler settles that thread on another (99% of samples):
0.94-0.98x of gRPC alone's messages/s instead of 0.83-0.90x in the same runs
(``benchmarks/rest_front.py``, README "REST front cost").

The process runs this file alone (``python -I -S relay.py FD [CPU]``, standard library only, no
package import), so it starts in tens of milliseconds and holds a few MiB. It lives as long as its
control socket: when the server closes it, or dies, the process exits and the kernel closes what it
relayed (whose gRPC side the server has closed by then anyway).

Control messages, one per connection (``SOCK_SEQPACKET``): the client socket as the one descriptor, and as
data the gRPC face's abstract unix name and the name to bind the relayed connection to, NUL-separated.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import socket
import sys

#: Bytes a relayed direction may hold in its pipe (and move per splice call).
PIPE_BYTES = 256 * 1024
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
_NONBLOCK = getattr(os, "SPLICE_F_NONBLOCK", 2)
#: Largest control message: two socket names (at most 108 bytes each) and a separator.
_CONTROL_BYTES = 512
_READABLE = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
_ENDED = select.EPOLLHUP | select.EPOLLERR


class _Direction:
    """One direction of a relayed connection: bytes from ``source`` to ``sink`` through a pipe."""

    __slots__ = ("pending", "read_end", "sink", "source", "write_end")

    def __init__(self, source: int, sink: int) -> None:
        self.source = source
        self.sink = sink
        self.read_end, self.write_end = os.pipe()
        with contextlib.suppress(OSError):  # a smaller pipe works too, only with more calls
            fcntl.fcntl(self.write_end, _F_SETPIPE_SZ, PIPE_BYTES)
        #: Bytes in the pipe that the sink has not taken yet.
        self.pending = 0

    def close(self) -> None:
        os.close(self.read_end)
        os.close(self.write_end)


class _Socket:
    """A relayed socket: the direction it feeds, the direction that feeds it, and what epoll watches."""

    __slots__ = ("connection", "fd", "fed_by", "feeds", "mask")

    def __init__(
        self, connection: tuple[socket.socket, socket.socket], feeds: _Direction, fed_by: _Direction
    ) -> None:
        self.connection = connection
        self.fd = feeds.source
        self.feeds = feeds
        self.fed_by = fed_by
        self.mask = select.EPOLLIN


class Relay:
    """Every connection the control socket hands over, relayed by one thread around ``epoll``."""

    def __init__(self, control: socket.socket) -> None:
        self._control = control
        self._poll = select.epoll()
        self._poll.register(control.fileno(), select.EPOLLIN)
        self._sockets: dict[int, _Socket] = {}

    def run(self) -> None:
        """Relay until the control socket closes."""
        control = self._control.fileno()
        sockets = self._sockets
        while True:
            take = False
            for fd, events in self._poll.poll():
                if fd == control:
                    # Taken after this round's events: a descriptor closed during it may be reused by
                    # the new connection, which must not get the old one's events.
                    take = True
                    continue
                relayed = sockets.get(fd)
                if relayed is None:
                    continue  # closed by an earlier event of this same round
                try:
                    if events & select.EPOLLOUT and relayed.fed_by.pending:
                        self._flush(relayed.fed_by)
                    if events & _READABLE:
                        direction = relayed.feeds
                        if direction.pending:
                            # Not watched for reading while its sink is full; but epoll reports a hang-up
                            # or an error whatever it watches, and goes on until the socket closes.
                            if events & _ENDED:
                                self._close(relayed)
                            continue
                        moved = os.splice(fd, direction.write_end, PIPE_BYTES, flags=_NONBLOCK)
                        if moved == 0:
                            # HTTP/2 does not half-close: either side's end ends both.
                            self._close(relayed)
                            continue
                        direction.pending = moved
                        self._flush(direction)
                except BlockingIOError:
                    pass
                except OSError:
                    self._close(relayed)  # a reset connection ends the relay like a closed one
            if take and not self._take():
                return

    def _flush(self, direction: _Direction) -> None:
        """Move the pipe's bytes to the sink; while it cannot take them all, watch it, not the source."""
        with contextlib.suppress(BlockingIOError):
            while direction.pending:
                direction.pending -= os.splice(
                    direction.read_end, direction.sink, direction.pending, flags=_NONBLOCK
                )
        blocked = bool(direction.pending)
        source, sink = self._sockets[direction.source], self._sockets[direction.sink]
        self._watch(source, (source.mask & ~select.EPOLLIN) if blocked else source.mask | select.EPOLLIN)
        self._watch(sink, sink.mask | select.EPOLLOUT if blocked else sink.mask & ~select.EPOLLOUT)

    def _watch(self, relayed: _Socket, mask: int) -> None:
        if mask != relayed.mask:  # the steady state changes nothing: no system call
            relayed.mask = mask
            self._poll.modify(relayed.fd, mask)

    def _take(self) -> bool:
        """Take one connection from the control socket; False once it has closed."""
        try:
            data, descriptors, _, _ = socket.recv_fds(self._control, _CONTROL_BYTES, 1)
        except OSError:
            return False
        if not data:
            return False  # the server closed the control socket, or died
        if not descriptors:
            return True
        client = socket.socket(fileno=descriptors[0])
        target, _, name = data.decode("utf-8", "replace").partition("\0")
        try:
            upstream, forward, backward = _reach(client, target, name)
        except OSError as error:
            # This one connection is closed; the others go on.
            print(f"hedgepub relay: cannot relay a connection: {error}", file=sys.stderr, flush=True)
            client.close()
            return True
        connection = (client, upstream)
        for sock, feeds, fed_by in ((client, forward, backward), (upstream, backward, forward)):
            sock.setblocking(False)
            self._sockets[sock.fileno()] = _Socket(connection, feeds, fed_by)
            self._poll.register(sock.fileno(), select.EPOLLIN)
        return True

    def _close(self, relayed: _Socket) -> None:
        relayed.feeds.close()
        relayed.fed_by.close()
        for sock in relayed.connection:
            del self._sockets[sock.fileno()]
            sock.close()  # closing a descriptor also takes it out of the epoll set


def _reach(client: socket.socket, target: str, name: str) -> tuple[socket.socket, _Direction, _Direction]:
    """Connect to the gRPC face at the abstract name ``target`` (bound to ``name``) for ``client``: the
    socket, and the direction each way. OSError, with nothing left open, when the face cannot be reached
    or descriptors run out (a relayed connection takes six: two sockets, two pipes)."""
    with contextlib.ExitStack() as undo:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        undo.callback(upstream.close)
        if name:
            upstream.bind("\0" + name)
        upstream.connect("\0" + target)
        forward = _Direction(client.fileno(), upstream.fileno())
        undo.callback(forward.close)
        backward = _Direction(upstream.fileno(), client.fileno())
        undo.pop_all()
    return upstream, forward, backward


def keep_to_one_cpu(setting: str | None) -> int | None:
    """Keep this process to one CPU as ``setting`` says (a number, ``any`` for none, empty or None for the
    last one allowed); return it, or None
    when it is left free (``any``, a single allowed CPU, or a setting that cannot be followed, which is
    said on stderr: the relay works anyway)."""
    if setting == "any" or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        allowed = os.sched_getaffinity(0)
        cpu = int(setting) if setting else max(allowed)
        if not setting and len(allowed) < 2:
            return None
        os.sched_setaffinity(0, {cpu})
    except (ValueError, OSError) as error:
        print(
            f"hedgepub relay: not keeping to one CPU (relay_cpu={setting!r}): {error}",
            file=sys.stderr,
            flush=True,
        )
        return None
    return cpu


def raise_descriptor_limit() -> int:
    """Let this process open as many descriptors as its hard limit allows (each relayed connection takes
    six: two sockets, two pipes), where the soft limit is often 1,024; return the soft limit now."""
    try:
        import resource  # not on every platform; the relay runs on Linux only, but say so plainly
    except ImportError:
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):  # a limit that cannot be raised is kept
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft


def main(argv: list[str]) -> int:
    """Entry point: ``relay.py CONTROL_FD [CPU]`` (CPU: a number, or ``any``; none: the last allowed)."""
    # Ctrl-C on a terminal reaches the whole process group; this process ends when the server closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_to_one_cpu(argv[2] if len(argv) > 2 else None)
    raise_descriptor_limit()
    Relay(socket.socket(fileno=int(argv[1]))).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
