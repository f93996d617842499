"""Real TCP for the network fault tests: an echo server (which can stop reading), client helpers."""

from __future__ import annotations

import socket
import threading


class EchoServer:
    """A threaded TCP echo server on an ephemeral port of 127.0.0.1 (a thread per connection)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.reading = threading.Event()  # connections echo only once this is set
        self.reading.set()
        self.received = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self._sockets.append(connection)
            threading.Thread(target=self._echo, args=(connection,), daemon=True).start()

    def _echo(self, connection: socket.socket) -> None:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                self.reading.wait()
                data = connection.recv(65_536)
                if not data:
                    break
                with self._lock:
                    self.received += len(data)
                connection.sendall(data)
        except OSError:
            pass
        finally:
            connection.close()

    def close(self) -> None:
        self.listener.close()
        self.reading.set()
        with self._lock:
            for connection in self._sockets:
                connection.close()


def connect(address: str, timeout: float = 30.0) -> socket.socket:
    """A client socket to ``HOST:PORT`` (no Nagle delay, so each send is its own segment)."""
    host, _, port = address.rpartition(":")
    client = socket.create_connection((host, int(port)), timeout=timeout)
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client


def receive_exactly(client: socket.socket, size: int) -> bytes:
    """``size`` bytes from ``client`` (raises ``ConnectionError`` if it ends first)."""
    chunks = []
    while size:
        chunk = client.recv(min(size, 65_536))
        if not chunk:
            raise ConnectionError("the connection ended early")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)
