"""The virtual-time loop every area's tests run on."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from hedgepub._clock import AsyncioClock
from hedgepub.testing.virtual_time import VirtualTimeLoop, run_virtual, virtual_time


def test_sleeps_jump_to_exact_times_without_waiting() -> None:
    async def scenario() -> list[float]:
        loop = asyncio.get_running_loop()
        seen = []
        for delay in (0.1, 0.3, 3600.0):
            await asyncio.sleep(delay)
            seen.append(loop.time())
        return seen

    started = time.perf_counter()
    assert run_virtual(scenario()) == [0.1, 0.4, 3600.4]
    assert time.perf_counter() - started < 1.0


def test_timers_fire_in_order_and_wait_for_applies_on_virtual_time() -> None:
    async def scenario() -> tuple[list[str], float]:
        loop = asyncio.get_running_loop()
        order: list[str] = []
        loop.call_later(2.0, order.append, "b")
        loop.call_later(1.0, order.append, "a")
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.sleep(100), 2.5)
        return order, loop.time()

    assert run_virtual(scenario()) == (["a", "b"], 2.5)


def test_start_time_and_clock_agree() -> None:
    async def scenario() -> tuple[float, float]:
        clock = AsyncioClock()
        await clock.sleep(5)
        return clock.now(), asyncio.get_running_loop().time()

    assert run_virtual(scenario(), start=100.0) == (105.0, 105.0)


def test_work_from_another_thread_still_wakes_the_loop() -> None:
    async def scenario() -> str:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[str] = loop.create_future()
        threading.Thread(target=lambda: loop.call_soon_threadsafe(future.set_result, "woke")).start()
        return await future

    assert run_virtual(scenario()) == "woke"


def test_left_over_tasks_are_cancelled_at_the_end() -> None:
    cancelled = []

    async def forever() -> None:
        try:
            await asyncio.sleep(1e9)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def scenario() -> asyncio.Task[None]:
        task = asyncio.ensure_future(forever())
        await asyncio.sleep(0)
        return task

    task = run_virtual(scenario())
    assert cancelled == [True]
    assert task.cancelled()


def test_advance_moves_time_forward_and_refuses_going_back() -> None:
    loop = VirtualTimeLoop()
    try:
        loop.advance(2.5)
        assert loop.time() == 2.5
        with pytest.raises(ValueError):
            loop.advance(-1)
    finally:
        loop.close()


@pytest.fixture
def greeting() -> str:
    return "hello"


@virtual_time
async def test_decorator_runs_an_async_test_on_virtual_time_with_fixtures(greeting: str) -> None:
    await asyncio.sleep(42)
    assert asyncio.get_running_loop().time() == 42.0
    assert greeting == "hello"
