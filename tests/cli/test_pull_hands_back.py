"""``hedgepub pull`` never leaves messages leased when it fails to receive or print them.

The subscription's ack deadline is 600 s, so a message the command left leased would stay out of reach for
ten minutes: each test checks the messages are back (or acknowledged) at once.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from hedgepub.bench import AdminClient

from .._cli import CLI

PROJECT = "local-project"
TOPIC = f"projects/{PROJECT}/topics/orders"
SUBSCRIPTION = f"projects/{PROJECT}/subscriptions/audit"


@pytest.fixture
def backlog(pubsub_server, hedgepub_cli, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Three messages waiting on a subscription with a 600 s ack deadline; their IDs."""
    monkeypatch.delenv("PUBSUB_PROJECT_ID", raising=False)
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT", raising=False)
    assert hedgepub_cli("topics", "create", "orders").exit_code == 0
    created = hedgepub_cli("subscriptions", "create", "audit", "--topic", "orders", "--ack-deadline", "600")
    assert created.exit_code == 0, created.output
    published = hedgepub_cli("publish", "orders", "hello", "--count", "3")
    assert published.exit_code == 0, published.output
    return published.stdout.split()


def _pull_now(address: str) -> list[str]:
    """IDs of the messages that can be pulled right now (then handed back)."""
    with AdminClient(address, timeout=5) as admin:
        received = admin.pull(SUBSCRIPTION, 10, wait=1.0)
        if received:
            admin.modify_ack_deadline(SUBSCRIPTION, [message.ack_id for message in received], 0)
    return sorted(message.message.message_id for message in received)


def test_messages_that_could_not_be_printed_are_handed_back_at_once(pubsub_server, backlog) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody reads: the first line printed meets a closed pipe, as with `| head -0`
    try:
        completed = subprocess.run(
            [*CLI, "pull", "audit", "--ack"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert completed.returncode == 1
    assert "handed back for redelivery" in completed.stderr
    assert "Traceback" not in completed.stderr
    # not printed, so not acknowledged either: all three can be pulled again now, not in 600 s
    assert _pull_now(pubsub_server.address) == sorted(backlog)


def test_a_failed_pull_acknowledges_what_was_printed_with_ack(
    pubsub_server, backlog, hedgepub_cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first Pull answers; every Pull after it fails on the server.
    real_pull = AdminClient.pull

    def pull_then_fail_the_next(self: AdminClient, *args, **kwargs):
        received = real_pull(self, *args, **kwargs)
        pubsub_server.faults.set("Pull", "error=INTERNAL:100%")
        return received

    monkeypatch.setattr(AdminClient, "pull", pull_then_fail_the_next)
    result = hedgepub_cli("pull", "audit", "--max", "10", "--ack", "--json")
    pubsub_server.faults.set("Pull", None)
    assert result.exit_code == 1
    printed = [line for line in result.stdout.splitlines() if line]
    assert len(printed) == 3  # printed as they came, before the failing Pull
    # ... and acknowledged: nothing is waiting or leased
    assert pubsub_server.wait_until_idle(timeout=5)


def test_a_failed_pull_without_ack_leaves_nothing_unprinted_leased(
    pubsub_server, backlog, hedgepub_cli
) -> None:
    pubsub_server.faults.set("Pull", "error=UNAVAILABLE:100%")
    try:
        result = hedgepub_cli("pull", "audit", "--max", "10")
    finally:
        pubsub_server.faults.set("Pull", None)
    assert result.exit_code != 0
    assert result.stdout == ""
    assert _pull_now(pubsub_server.address) == sorted(backlog)
