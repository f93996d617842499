"""Network faults from the Linux kernel's packet filter, in a private network namespace (needs root).

:class:`KernelNetwork` makes a network namespace of its own (its name carries a unique suffix), brings its
loopback up, runs processes in it (``ip netns exec``: a server, a measuring client) and applies faults to
the TCP packets on its loopback with iptables, in the namespace's own tables, so nothing outside it is
touched:

- :meth:`~KernelNetwork.set_loss`: packets of a server port dropped at random
  (``-m statistic --mode random --probability P -j DROP``), per direction: ``up`` (to the server),
  ``down`` (from it) or ``both``;
- :meth:`~KernelNetwork.set_syn_loss`: connection-opening packets (``--syn``) to the port dropped at random;
- :meth:`~KernelNetwork.blackhole`: every packet of one connection (by its client port) dropped, both ways,
  for a window, then let through again.

Everything it made is removed in :meth:`~KernelNetwork.close` (the processes stopped, the namespace, and
with it its rules, deleted), which a ``with`` block calls whatever happens::

    from hedgepub.testing.network.kernel import KernelNetwork, unavailable_reason

    if unavailable_reason() is None:
        with KernelNetwork() as network:
            address = network.serve()                 # hedgepub serve --in-memory --no-rest, inside
            network.set_loss(0.02, port=int(address.rsplit(":", 1)[1]))
            result = network.run([sys.executable, "-m", "hedgepub.testing.network.probe", "echo", ...])

:func:`unavailable_reason` says, in measured terms, why it cannot run here (not Linux, not root, no
``ip`` or ``iptables``, a namespace or the ``statistic`` match refused), so that tests skip with it.
A process inside the namespace can call :func:`client_ports` to find its own connections' ports.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Sequence
from typing import Literal

__all__ = [
    "LABEL_VARIABLE",
    "KernelNetwork",
    "bytes_sent_by_client_port",
    "client_ports",
    "default_label",
    "unavailable_reason",
]

Direction = Literal["both", "up", "down"]
#: The line ``hedgepub serve`` prints first, followed by its address.
READY_PREFIX = "export PUBSUB_EMULATOR_HOST="
_COMMAND_TIMEOUT = 30.0
#: The environment variable whose value starts every namespace's name unless a label is given
#: (``hedgepub`` when unset), so runs on a shared machine carry their owner's prefix.
LABEL_VARIABLE = "HEDGEPUB_NETNS_LABEL"


def default_label() -> str:
    """The start of a namespace's name when none is given: ``$HEDGEPUB_NETNS_LABEL`` or ``hedgepub``."""
    return os.environ.get(LABEL_VARIABLE) or "hedgepub"


def _run(args: Sequence[str], timeout: float = _COMMAND_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, check=False)


def _checked(args: Sequence[str]) -> str:
    completed = _run(args)
    if completed.returncode != 0:
        raise RuntimeError(
            f"{' '.join(args)} failed (exit {completed.returncode}): {completed.stderr.strip()}"
        )
    return completed.stdout


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """Why :class:`KernelNetwork` cannot work on this machine, or ``None`` when it can.

    Tried for real, once per process: a throwaway namespace is made, an iptables rule with the
    ``statistic`` match is added in it, and the namespace is deleted.
    """
    if not sys.platform.startswith("linux"):
        return f"the kernel harness needs Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return f"the kernel harness needs root (ip netns, iptables); running as uid {os.geteuid()}"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return (
                f"the kernel harness needs {tool!r}, not on PATH (Debian: apt-get install iproute2 iptables)"
            )
    name = f"{default_label()}-check-{uuid.uuid4().hex[:8]}"
    made = _run(["ip", "netns", "add", name])
    if made.returncode != 0:
        return f"ip netns add refused: {made.stderr.strip() or made.returncode}"
    try:
        rule = _run(
            ["ip", "netns", "exec", name, "iptables", "-A", "OUTPUT", "-p", "tcp", "-m", "statistic",
             "--mode", "random", "--probability", "0.5", "-j", "DROP"]
        )  # fmt: skip
        if rule.returncode != 0:
            return f"iptables -m statistic refused in a namespace: {rule.stderr.strip() or rule.returncode}"
    finally:
        _run(["ip", "netns", "delete", name])
    return None


def client_ports(server_port: int, pid: int | str = "self") -> list[int]:
    """Local ports of the established TCP connections of process ``pid`` to ``server_port``, oldest first.

    Read from ``/proc`` (the process's socket descriptors and the network namespace's TCP table), so a
    process inside a namespace finds its own connections, for :meth:`KernelNetwork.blackhole`. "Oldest"
    is by socket inode number, which grows as sockets are made.
    """
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
        try:
            with open(table, encoding="ascii") as lines:
                next(lines)
                for line in lines:
                    fields = line.split()
                    local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
                    if state == "01" and inode in inodes and int(remote.rsplit(":", 1)[1], 16) == server_port:
                        found.append((int(inode), int(local.rsplit(":", 1)[1], 16)))
        except FileNotFoundError:
            continue
    return [port for _inode, port in sorted(found)]


_SS_SOCKET = re.compile(r"^\S+\s+\S+\s+\S+:(\d+)\s+\S+:(\d+)\s*$")
_SS_BYTES = re.compile(r"\bbytes_acked:(\d+)")


def bytes_sent_by_client_port(server_port: int, listing: str | None = None) -> dict[int, int]:
    """Bytes each established connection to ``server_port`` in this network namespace has had acked,
    by client port (``ss -tin``, or its output given as ``listing``): the busiest one is the one a
    publisher's originals ride (the order of the sockets says nothing about which that is)."""
    if listing is None:
        listing = _checked(["ss", "-tinH", "state", "established", "dport", "=", f":{server_port}"])
    found: dict[int, int] = {}
    port: int | None = None
    for line in listing.splitlines():
        match = _SS_SOCKET.match(line)
        if match is not None:
            port = int(match.group(1))
            found[port] = 0
            continue
        acked = _SS_BYTES.search(line)
        if acked is not None and port is not None:
            found[port] = int(acked.group(1))
    return found


class KernelNetwork:
    """A private network namespace whose loopback loses packets as told (Linux, root).

    Args:
        label: the start of the namespace's name (default: :func:`default_label`); a unique suffix
            (process id and random hex) follows.

    Raises:
        RuntimeError: from :meth:`start`, when :func:`unavailable_reason` says why, or a command fails.
    """

    def __init__(self, label: str | None = None) -> None:
        self.name = f"{label or default_label()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._processes: list[subprocess.Popen[bytes]] = []
        self._rules: dict[str, list[str]] = {}  # what each installed rule is called -> its iptables spec
        self._timers: list[threading.Timer] = []
        self._lock = threading.Lock()
        self._started = False
        self._joined = False

    @classmethod
    def joined(cls, name: str) -> KernelNetwork:
        """The existing namespace ``name`` (made by another :class:`KernelNetwork`, which deletes it), for
        a process running inside it: its faults can be set here, and :meth:`close` removes the rules and
        processes this object made, not the namespace."""
        network = cls()
        network.name = name
        network._started = network._joined = True
        return network

    # lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> KernelNetwork:
        """Make the namespace and bring its loopback up; returns ``self``."""
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        _checked(["ip", "netns", "add", self.name])
        self._started = True
        try:
            _checked(["ip", "-n", self.name, "link", "set", "lo", "up"])
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop the processes it started (SIGTERM, then SIGKILL), and delete the namespace and its rules."""
        with self._lock:
            timers, self._timers = self._timers, []
        for timer in timers:
            timer.cancel()
        for process in self._processes:
            if process.poll() is None:
                process.terminate()
        for process in self._processes:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        self._processes.clear()
        if self._joined:
            with self._lock:
                rules, self._rules = self._rules, {}
            for spec in rules.values():
                _run(self.command(["iptables", "-D", *spec]))
            self._started = False
        if self._started:
            _run(["ip", "netns", "delete", self.name])
            self._started = False
        self._rules.clear()

    def __enter__(self) -> KernelNetwork:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # processes ----------------------------------------------------------------------------------------

    def command(self, args: Sequence[str]) -> list[str]:
        """``args`` as a command that runs inside the namespace (``ip netns exec NAME ...``)."""
        return ["ip", "netns", "exec", self.name, *args]

    def popen(self, args: Sequence[str], **options: object) -> subprocess.Popen[bytes]:
        """Start ``args`` inside the namespace; :meth:`close` stops it if it still runs."""
        # options are Popen's own keywords, passed on as given
        process = subprocess.Popen(self.command(args), **options)  # type: ignore[call-overload]
        self._processes.append(process)
        return process

    def run(self, args: Sequence[str], timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``args`` inside the namespace to its end; its output is captured as text."""
        return subprocess.run(
            self.command(args), capture_output=True, text=True, timeout=timeout, check=False
        )

    def serve(self, command: Sequence[str] | None = None, timeout: float = 60.0) -> str:
        """Start a server inside the namespace and return its address (``HOST:PORT``).

        ``command`` defaults to ``hedgepub serve --in-memory --no-rest --port 0`` (this interpreter); any
        command given must print ``export PUBSUB_EMULATOR_HOST=HOST:PORT`` as its first line, as that one
        does.

        Raises:
            RuntimeError: the first line is not that within ``timeout`` seconds (the process is stopped).
        """
        if command is None:
            command = [sys.executable, "-m", "hedgepub", "serve", "--in-memory", "--no-rest", "--port", "0"]
        process = self.popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        line: list[bytes] = []
        assert process.stdout is not None
        # process.stdout: asserted above, which a lambda's body does not see
        reader = threading.Thread(target=lambda: line.append(process.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout)
        text = line[0].decode(errors="replace").strip() if line else ""
        if not text.startswith(READY_PREFIX):
            process.kill()
            raise RuntimeError(f"{' '.join(command)} did not get ready within {timeout:g} s: {text!r}")
        return text[len(READY_PREFIX) :]

    # faults -------------------------------------------------------------------------------------------

    def _set_rule(self, key: str, spec: list[str] | None) -> None:
        with self._lock:
            old = self._rules.pop(key, None)
            if old is not None:
                _checked(self.command(["iptables", "-D", *old]))
            if spec is not None:
                _checked(self.command(["iptables", "-I", *spec]))
                self._rules[key] = spec

    def set_loss(self, probability: float, *, port: int, direction: Direction = "both") -> None:
        """Drop TCP packets to (``up``) and/or from (``down``) ``port`` with ``probability``; 0 stops it.

        A later call replaces the earlier one of the same direction. SYNs are packets too, and are dropped
        at the same rate.
        """
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"probability must be in [0, 1]; got {probability!r}")
        if direction not in ("both", "up", "down"):
            raise ValueError(f"direction must be 'both', 'up' or 'down'; got {direction!r}")
        for side, match in (("up", "--dport"), ("down", "--sport")):
            if direction in ("both", side):
                spec = None
                if probability > 0:
                    spec = ["OUTPUT", "-p", "tcp", match, str(port), *_random(probability), "-j", "DROP"]
                self._set_rule(f"loss-{side}-{port}", spec)

    def set_syn_loss(self, probability: float, *, port: int) -> None:
        """Drop connection-opening packets (SYN) to ``port`` with ``probability``; 0 stops it."""
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"probability must be in [0, 1]; got {probability!r}")
        spec = None
        if probability > 0:
            spec = ["OUTPUT", "-p", "tcp", "--syn", "--dport", str(port), *_random(probability), "-j", "DROP"]
        self._set_rule(f"syn-{port}", spec)

    def blackhole(self, client_port: int, seconds: float | None = None) -> None:
        """Drop every packet of the connection whose client side is ``client_port``, both ways.

        For ``seconds`` (then the rules go again, from a timer thread), or until :meth:`heal`.
        """
        for side, match in (("up", "--sport"), ("down", "--dport")):
            self._set_rule(
                f"hole-{side}-{client_port}", ["OUTPUT", "-p", "tcp", match, str(client_port), "-j", "DROP"]
            )
        if seconds is not None:
            timer = threading.Timer(seconds, self.heal, args=(client_port,))
            timer.daemon = True
            with self._lock:
                self._timers.append(timer)
            timer.start()

    def heal(self, client_port: int) -> None:
        """End the black hole of ``client_port`` (nothing happens if there is none)."""
        if not self._started:
            return
        for side in ("up", "down"):
            self._set_rule(f"hole-{side}-{client_port}", None)

    def busiest_client_port(self, server_port: int) -> int | None:
        """The client port of the connection to ``server_port`` inside the namespace that has sent the most
        bytes (``ss -tin``), or ``None`` when there is none: the one to black-hole to hit a publisher's
        originals."""
        listing = _checked(
            self.command(["ss", "-tinH", "state", "established", "dport", "=", f":{server_port}"])
        )
        sent = bytes_sent_by_client_port(server_port, listing)
        return max(sent, key=lambda port: sent[port]) if sent else None

    def rules(self) -> str:
        """The namespace's OUTPUT rules with their packet counters (``iptables -L OUTPUT -v -n``)."""
        return _checked(self.command(["iptables", "-L", "OUTPUT", "-v", "-n", "-x"]))


def _random(probability: float) -> list[str]:
    return ["-m", "statistic", "--mode", "random", "--probability", f"{probability:.6f}"]
