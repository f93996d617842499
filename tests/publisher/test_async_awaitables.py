"""What ``AsyncPublisherClient.publish`` hands back: on the client's loop, the message's future, which is a
coroutine too (so ``gather`` takes it with no task, and ``create_task``, ``TaskGroup`` and ``asyncio.run``
take it as they took the coroutine); errors are raised where it is awaited. Scripted transport, virtual
time; one run against a real server."""

from __future__ import annotations

import asyncio
import threading

import pytest

from hedgepub import (
    AsyncPublisherClient,
    BatchSettings,
    FlowControlSettings,
    LimitExceededBehavior,
)
from hedgepub.server import LocalServer
from hedgepub.testing.scripted import ScriptedTransport
from hedgepub.testing.virtual_time import run_virtual, virtual_time

TOPIC = "projects/test-project/topics/topic"


def client(transport: ScriptedTransport, **settings: object) -> AsyncPublisherClient:
    return AsyncPublisherClient(transport=transport, **settings)  # type: ignore[arg-type]


def sent(transport: ScriptedTransport) -> list[bytes]:
    return [message.data for call in transport.calls for message in call.request.messages]


@virtual_time
async def test_on_the_loop_publish_is_a_future_that_gather_takes_as_it_is() -> None:
    transport = ScriptedTransport()
    async with client(transport, batch_settings=BatchSettings(max_messages=3, max_latency=10)) as publisher:
        pending = [publisher.publish(TOPIC, b"m%d" % i) for i in range(7)]
        assert all(asyncio.isfuture(one) and asyncio.iscoroutine(one) for one in pending)
        # Two batches filled at the call, before anything was awaited.
        assert [one.done() for one in pending] == [False] * 7
        ids = await asyncio.gather(*pending)
    assert ids == [str(i) for i in range(7)]
    assert sent(transport) == [b"m%d" % i for i in range(7)]
    assert [len(call.request.messages) for call in transport.calls] == [3, 3, 1]


@virtual_time
async def test_a_message_is_published_whether_or_not_it_is_awaited() -> None:
    transport = ScriptedTransport()
    publisher = client(transport)
    await publisher.publish(TOPIC, b"first")  # binds the client to this loop
    publisher.publish(TOPIC, b"never awaited")
    await publisher.shutdown()
    assert sent(transport) == [b"first", b"never awaited"]
    assert publisher.stats().messages_published == 2


@virtual_time
async def test_create_task_and_task_group_take_it_as_a_coroutine() -> None:
    transport = ScriptedTransport()
    async with client(transport) as publisher:
        task = asyncio.create_task(publisher.publish(TOPIC, b"task"))
        async with asyncio.TaskGroup() as group:
            grouped = [group.create_task(publisher.publish(TOPIC, b"group %d" % i)) for i in range(3)]
        assert await task == "0"
        assert [one.result() for one in grouped] == ["1", "2", "3"]


@virtual_time
async def test_a_task_cancelled_while_it_waits_is_cancelled_and_the_message_still_goes() -> None:
    transport = ScriptedTransport(default=ScriptedTransport().ok(delay=1.0))
    async with client(transport) as publisher:
        task = asyncio.create_task(publisher.publish(TOPIC, b"x"))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()
        assert await publisher.publish(TOPIC, b"after") == "1"
    assert sent(transport) == [b"x", b"after"]


@virtual_time
async def test_errors_are_raised_where_the_result_is_awaited() -> None:
    transport = ScriptedTransport()
    publisher = client(transport)
    not_bytes = publisher.publish(TOPIC, "text")  # type: ignore[arg-type]
    keyed = publisher.publish(TOPIC, b"x", ordering_key="k")  # ordering is off
    bad_attribute = publisher.publish(TOPIC, b"x", origin=3)
    with pytest.raises(TypeError, match="data must be bytes"):
        await not_bytes
    with pytest.raises(ValueError, match="message ordering is not enabled"):
        await keyed
    with pytest.raises(TypeError):
        await bad_attribute
    assert await publisher.publish(TOPIC, b"fine") == "0"
    await publisher.shutdown()
    after = publisher.publish(TOPIC, b"late")
    with pytest.raises(RuntimeError, match="after shutdown"):
        await after
    assert sent(transport) == [b"fine"]


def test_made_with_no_loop_running_it_is_a_coroutine_that_publishes_when_run() -> None:
    transport = ScriptedTransport()
    publisher = client(transport)
    pending = publisher.publish(TOPIC, b"later")
    assert not asyncio.isfuture(pending)
    assert transport.calls == []

    async def scenario() -> str:
        message_id = await pending
        await publisher.shutdown()
        return message_id

    assert run_virtual(scenario()) == "0"
    assert sent(transport) == [b"later"]


@virtual_time
async def test_from_another_thread_it_is_a_coroutine_and_fails_on_its_own_loop() -> None:
    transport = ScriptedTransport()
    async with client(transport) as publisher:
        await publisher.publish(TOPIC, b"here")
        made: list[object] = []
        thread = threading.Thread(target=lambda: made.append(publisher.publish(TOPIC, b"elsewhere")))
        thread.start()
        thread.join()
        (pending,) = made
        assert asyncio.iscoroutine(pending) and not asyncio.isfuture(pending)

        async def on_a_second_loop() -> str:
            return await pending  # type: ignore[no-any-return, misc]

        with pytest.raises(RuntimeError, match="event loop it started on"):
            await asyncio.to_thread(run_virtual, on_a_second_loop())
    assert sent(transport) == [b"here"]


@virtual_time
async def test_with_flow_control_it_is_a_coroutine_that_waits_for_room() -> None:
    transport = ScriptedTransport(default=ScriptedTransport().ok(delay=0.5))
    flow = FlowControlSettings(message_limit=1, limit_exceeded_behavior=LimitExceededBehavior.BLOCK)
    async with client(transport, flow_control=flow) as publisher:
        first = publisher.publish(TOPIC, b"1")
        second = publisher.publish(TOPIC, b"2")
        assert asyncio.iscoroutine(first) and not asyncio.isfuture(first)
        assert await asyncio.gather(first, second) == ["0", "1"]
        # The second waited for the first's room: the first batch, sealed at once when the second had to
        # wait, answered at 0.5; the second went after its 10 ms latency and answered 0.5 s later.
        assert asyncio.get_running_loop().time() == pytest.approx(0.5 + 0.01 + 0.5)
    assert [len(call.request.messages) for call in transport.calls] == [1, 1]


def test_against_a_real_server_gather_and_tasks(server: LocalServer, topic: str) -> None:
    async def scenario() -> tuple[list[str], str]:
        async with AsyncPublisherClient(batch_settings=BatchSettings(max_messages=50)) as publisher:
            ids = await asyncio.gather(*(publisher.publish(topic, b"%d" % i) for i in range(120)))
            task_id = await asyncio.create_task(publisher.publish(topic, b"task"))
        return list(ids), task_id

    ids, task_id = asyncio.run(scenario())
    stored = {message.message_id: message.data for message in server.messages(topic)}
    assert stored == {**{ids[i]: b"%d" % i for i in range(120)}, task_id: b"task"}
