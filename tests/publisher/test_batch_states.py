"""A batch's states guard themselves: one table of transitions, an illegal move raises and changes nothing.

The publisher moves a batch through ``OPEN -> SEALED -> [QUEUED ->] SENDING -> DONE`` (failing it from any
state before its end); :meth:`Batch.move` is the one way its state changes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hedgepub import BatchSettings, PublisherClient
from hedgepub._publisher.batch import Batch, BatchState, IllegalTransition
from hedgepub.testing.scripted import ScriptedCall, ScriptedTransport

TOPIC = "projects/p/topics/states"


def new_batch() -> Batch:
    return Batch(TOPIC, "", "b-0", sync_futures=False)


def test_a_batch_goes_its_two_ways_to_the_end() -> None:
    for path in (
        [BatchState.SEALED, BatchState.SENDING, BatchState.DONE],
        [BatchState.SEALED, BatchState.QUEUED, BatchState.QUEUED, BatchState.SENDING, BatchState.DONE],
    ):
        batch = new_batch()
        for state in path:
            batch.move(state)
        assert batch.state is BatchState.DONE


@pytest.mark.parametrize(
    ("path", "illegal"),
    [
        ([], BatchState.SENDING),  # an open batch is sealed before it is sent
        ([], BatchState.OPEN),
        ([BatchState.SEALED], BatchState.SEALED),  # sealed twice: queued for the loop twice
        ([BatchState.SEALED, BatchState.SENDING], BatchState.QUEUED),
        ([BatchState.SEALED, BatchState.SENDING], BatchState.SENDING),  # sent twice
        ([BatchState.SEALED, BatchState.DONE], BatchState.DONE),  # resolved twice
        ([BatchState.SEALED, BatchState.DONE], BatchState.SENDING),
    ],
)
def test_an_illegal_move_raises_and_leaves_the_state_as_it_was(
    path: list[BatchState], illegal: BatchState
) -> None:
    batch = new_batch()
    for state in path:
        batch.move(state)
    before = batch.state
    with pytest.raises(IllegalTransition, match=f"from {before.value} to {illegal.value}"):
        batch.move(illegal)
    assert batch.state is before


@given(st.lists(st.sampled_from(list(BatchState)), max_size=12))
def test_whatever_is_tried_a_batch_is_never_reopened_sent_twice_or_revived(moves: list[BatchState]) -> None:
    batch = new_batch()
    visited = [batch.state]
    for state in moves:
        before = batch.state
        try:
            batch.move(state)
        except IllegalTransition:
            assert batch.state is before
            continue
        visited.append(state)
    assert visited.count(BatchState.OPEN) == 1
    assert visited.count(BatchState.SENDING) <= 1
    assert visited.count(BatchState.DONE) <= 1
    if BatchState.DONE in visited:
        assert visited[-1] is BatchState.DONE


def pending_text(future: concurrent.futures.Future[str]) -> str:
    """What a pending future's timeout says of its batch."""
    try:
        future.result(timeout=0.001)
    except TimeoutError as error:
        return str(error)
    return "resolved"


def wait_for_text(future: concurrent.futures.Future[str], words: str) -> str:
    deadline = time.monotonic() + 30
    text = pending_text(future)
    while words not in text and time.monotonic() < deadline:
        text = pending_text(future)
    return text


def test_a_keyed_batch_waits_queued_behind_its_key_then_is_sent_in_order() -> None:
    released = threading.Event()
    transport = ScriptedTransport()

    async def held(call: ScriptedCall) -> list[str]:
        await asyncio.get_running_loop().run_in_executor(None, released.wait)
        return transport.next_ids(len(call.request.messages))

    transport.script.append(held)
    publisher = PublisherClient(
        transport=transport,
        batch_settings=BatchSettings(max_messages=1),
        enable_message_ordering=True,
    )
    try:
        first = publisher.publish(TOPIC, b"first", ordering_key="k")
        second = publisher.publish(TOPIC, b"second", ordering_key="k")
        assert "being sent" in wait_for_text(first, "being sent")
        assert "queued behind" in wait_for_text(second, "queued behind")
        released.set()
        assert int(first.result(timeout=30)) < int(second.result(timeout=30))
        assert [call.request.messages[0].data for call in transport.calls] == [b"first", b"second"]
    finally:
        released.set()
        publisher.shutdown()


def test_batch_states_hash_as_the_objects_they_are() -> None:
    # Batch.move looks states up in TRANSITIONS on every move: hashed in C, equal only to themselves.
    assert all(hash(state) == object.__hash__(state) for state in BatchState)
    assert {state: state.value for state in BatchState}[BatchState.SENDING] == "sending"
    assert BatchState("done") is BatchState.DONE and BatchState.DONE != "done"
