"""A measuring client and an echo server, as commands, for runs inside a network namespace.

``python -m hedgepub.testing.network.probe echo-server`` listens on 127.0.0.1 (port 0: any free one),
prints ``listening HOST:PORT`` and echoes every connection until stopped.

``python -m hedgepub.testing.network.probe echo --target HOST:PORT --count N --interval S --size B``
makes one connection and times ``N`` round trips of ``B`` bytes, one every ``S`` seconds (an echo that
has not come back delays the next), and prints ``{"latencies_ms": [...]}``.

The same round trips through a :class:`~hedgepub.testing.network.relay.FaultRelay` and through the kernel
harness (:mod:`hedgepub.testing.network.kernel`) are what docs/network.md compares.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from collections.abc import Sequence


def _echo(connection: socket.socket) -> None:
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with connection:
        try:
            while data := connection.recv(65_536):
                connection.sendall(data)
        except OSError:
            pass


def serve_echo(host: str = "127.0.0.1", port: int = 0) -> None:
    """Echo every connection until the process is stopped; prints ``listening HOST:PORT`` first."""
    listener = socket.create_server((host, port))
    print(f"listening {host}:{listener.getsockname()[1]}", flush=True)
    while True:
        connection, _ = listener.accept()
        threading.Thread(target=_echo, args=(connection,), daemon=True).start()


def echo_round_trips(target: str, count: int, interval: float, size: int) -> list[float]:
    """Milliseconds of ``count`` round trips of ``size`` bytes on one connection to ``target``."""
    host, _, port = target.rpartition(":")
    payload = b"e" * size
    latencies = []
    with socket.create_connection((host, int(port)), timeout=120) as client:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        next_at = time.monotonic()
        for _ in range(count):
            pause = next_at - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            started = time.monotonic()
            client.sendall(payload)
            left = size
            while left:
                chunk = client.recv(left)
                if not chunk:
                    raise ConnectionError("the echo server closed the connection")
                left -= len(chunk)
            latencies.append((time.monotonic() - started) * 1000.0)
            next_at += interval
    return latencies


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module documentation)."""
    parser = argparse.ArgumentParser(prog="python -m hedgepub.testing.network.probe")
    commands = parser.add_subparsers(dest="command", required=True)
    server = commands.add_parser("echo-server", help="echo every connection")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=0)
    client = commands.add_parser("echo", help="time round trips on one connection")
    client.add_argument("--target", required=True)
    client.add_argument("--count", type=int, default=1000)
    client.add_argument("--interval", type=float, default=0.01)
    client.add_argument("--size", type=int, default=100)
    arguments = parser.parse_args(argv)
    if arguments.command == "echo-server":
        serve_echo(arguments.host, arguments.port)
        return 0
    latencies = echo_round_trips(arguments.target, arguments.count, arguments.interval, arguments.size)
    json.dump({"latencies_ms": [round(value, 3) for value in latencies]}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
