"""The test-facing face of the server: LocalServer's lifecycle and helpers."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
from pathlib import Path

import pytest
from google.cloud import pubsub_v1

from hedgepub.server import AsyncLocalServer, FaultInjector, LocalServer, ServerOptions, serve


def test_temporary_data_dir_is_removed_on_exit() -> None:
    with LocalServer() as server:
        data_dir = server.data_dir
        assert data_dir is not None and Path(data_dir).is_dir()
        assert "serving on 127.0.0.1:" in repr(server)
    assert not Path(data_dir).exists()
    assert "stopped" in repr(server)


def test_an_occupied_port_is_an_os_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
            LocalServer(port=port, in_memory=True).start()


@pytest.mark.parametrize("rest", [False, True], ids=["grpc-alone", "one-port-front"])
async def test_an_address_that_cannot_be_bound_is_an_os_error_naming_it_with_the_report_as_cause(
    rest: bool,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = AsyncLocalServer(ServerOptions(port=port, in_memory=True, rest=rest))
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port} ") as raised:
            await server.start()
    # The binder's own words stay in the traceback: grpc's when it binds the port, asyncio's for the front.
    assert isinstance(raised.value.__cause__, OSError if rest else RuntimeError)
    assert server.core is None and "stopped" in repr(server)


def test_faults_are_always_present(pubsub_server: LocalServer) -> None:
    assert isinstance(pubsub_server.faults, FaultInjector)


def test_clear_and_wait_until_idle(pubsub_server: LocalServer) -> None:
    assert os.environ["PUBSUB_EMULATOR_HOST"] == pubsub_server.address
    publisher = pubsub_v1.PublisherClient()
    subscriber = pubsub_v1.SubscriberClient()
    try:
        topic, subscription = "projects/p/topics/idle", "projects/p/subscriptions/idle"
        publisher.create_topic(name=topic)
        subscriber.create_subscription(name=subscription, topic=topic)
        publisher.publish(topic, b"x").result()
        assert pubsub_server.wait_until_idle(timeout=0.05) is False
        received = subscriber.pull(subscription=subscription, max_messages=1).received_messages
        subscriber.acknowledge(subscription=subscription, ack_ids=[received[0].ack_id])
        assert pubsub_server.wait_until_idle(timeout=5)
        pubsub_server.clear()
        assert pubsub_server.messages(topic) == []
        assert list(publisher.list_topics(project="projects/p")) == []
    finally:
        publisher.stop()
        subscriber.close()


def test_helpers_refuse_a_stopped_server() -> None:
    server = LocalServer(in_memory=True)
    with pytest.raises(RuntimeError, match="not running"):
        server.messages("projects/p/topics/any")
    server.stop()  # stopping a server never started is harmless


def test_tls_needs_both_files_whoever_builds_the_options() -> None:
    with pytest.raises(ValueError, match="TLS needs both"):
        ServerOptions(tls_cert="cert.pem")
    with pytest.raises(ValueError, match="TLS needs both"):
        LocalServer(in_memory=True, tls_key="key.pem")


async def test_the_async_server_and_serve_also_take_the_options_as_keywords() -> None:
    async with AsyncLocalServer(in_memory=True, port=0, rest=False) as server:
        assert server.options == ServerOptions(in_memory=True, port=0, rest=False)
        assert server.rest is False
    # Keywords override the fields of options given too.
    base = ServerOptions(in_memory=True, port=0)
    assert AsyncLocalServer(base, rest=False).options == dataclasses.replace(base, rest=False)
    with pytest.raises(TypeError, match=r"unknown server option\(s\): colour"):
        AsyncLocalServer(in_memory=True, colour="blue")
    # serve() too: it runs until stopped, having started with what the keywords said.
    started: list[AsyncLocalServer] = []
    stop = asyncio.Event()
    running = asyncio.ensure_future(
        serve(
            in_memory=True,
            port=0,
            stop=stop,
            grace=0,
            on_started=lambda server: (started.append(server), stop.set()),
        )
    )
    await asyncio.wait_for(running, timeout=30)
    [server] = started
    assert server.options.in_memory and server.options.port == 0
