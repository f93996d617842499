"""The kernel harness: a namespace, iptables loss, SYN loss and a black-holed flow, on real TCP (root).

Skipped, with the measured reason, where it cannot run (not Linux, not root, no ip or iptables). Times
are only checked from below.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time

import pytest

from hedgepub.testing.network.kernel import KernelNetwork, client_ports, default_label, unavailable_reason

REASON = unavailable_reason()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=str(REASON))
LABEL = f"{default_label()}-test"
PROBE = [sys.executable, "-m", "hedgepub.testing.network.probe"]


def echo_server(network: KernelNetwork) -> tuple[str, int]:
    process = network.popen([*PROBE, "echo-server"], stdout=subprocess.PIPE)
    assert process.stdout is not None
    address = process.stdout.readline().decode().split()[1]
    return address, int(address.rsplit(":", 1)[1])


def dropped(network: KernelNetwork) -> int:
    """Packets the namespace's DROP rules have dropped so far."""
    return sum(int(line.split()[0]) for line in network.rules().splitlines() if " DROP " in line)


def wait_until(condition, timeout: float = 30.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout:g} s")
        time.sleep(0.01)
    return value


@needs_kernel
def test_loss_drops_packets_and_costs_retransmission_timeouts() -> None:
    with KernelNetwork(LABEL) as network:
        address, port = echo_server(network)
        network.set_loss(0.03, port=port)
        completed = network.run(
            [*PROBE, "echo", "--target", address, "--count", "400", "--interval", "0"], 300
        )
        latencies = json.loads(completed.stdout)["latencies_ms"]
        assert len(latencies) == 400
        assert dropped(network) > 0
        assert max(latencies) >= 200.0  # a lost segment waits for the minimum retransmission timeout
        network.set_loss(0.0, port=port)
        assert dropped(network) == 0  # no rule left


@needs_kernel
def test_loss_per_direction_matches_only_its_side() -> None:
    with KernelNetwork(LABEL) as network:
        _address, port = echo_server(network)
        network.set_loss(0.5, port=port, direction="down")
        rules = network.rules()
        assert f"spt:{port}" in rules and f"dpt:{port}" not in rules


@needs_kernel
def test_a_lost_syn_costs_the_initial_retransmission_timeout() -> None:
    with KernelNetwork(LABEL) as network:
        address, port = echo_server(network)
        network.set_syn_loss(1.0, port=port)
        started = time.monotonic()
        client = network.popen([*PROBE, "echo", "--target", address, "--count", "1"], stdout=subprocess.PIPE)
        wait_until(lambda: dropped(network) >= 1)  # the first SYN is gone
        network.set_syn_loss(0.0, port=port)
        output, _ = client.communicate(timeout=60)
        assert client.returncode == 0
        assert json.loads(output)["latencies_ms"]
        assert time.monotonic() - started >= 1.0  # the SYN was sent again after 1 s


@needs_kernel
def test_a_black_holed_flow_stalls_only_its_connection() -> None:
    with KernelNetwork(LABEL) as network:
        address, port = echo_server(network)
        client = network.popen(
            [*PROBE, "echo", "--target", address, "--count", "30", "--interval", "0.05"],
            stdout=subprocess.PIPE,
        )
        [client_port] = wait_until(lambda: client_ports(port, client.pid))
        network.blackhole(client_port, seconds=1.0)
        output, _ = client.communicate(timeout=120)
        latencies = json.loads(output)["latencies_ms"]
        assert len(latencies) == 30  # every round trip came back once the window was over
        assert max(latencies) >= 1000.0
        assert f"spt:{client_port}" not in network.rules()  # the timer took the rules away


@needs_kernel
def test_a_publish_under_loss_inside_the_namespace() -> None:
    script = textwrap.dedent(
        """
        import sys
        from hedgepub import BatchSettings, PublisherClient
        from hedgepub.admin import AdminClient
        address, topic = sys.argv[1], "projects/kernel/topics/lossy"
        with AdminClient(address) as admin:
            admin.wait_ready(30)
            admin.create_topic(topic)
        with PublisherClient(endpoint=address, batch_settings=BatchSettings(max_messages=1)) as publisher:
            ids = [publisher.publish(topic, b"%d" % n).result(timeout=120) for n in range(50)]
        print(len(set(ids)))
        """
    )
    with KernelNetwork(LABEL) as network:
        address = network.serve()
        port = int(address.rsplit(":", 1)[1])
        network.set_loss(0.05, port=port)
        completed = network.run([sys.executable, "-c", script, address], timeout=300)
        assert completed.returncode == 0, completed.stderr
        assert completed.stdout.strip() == "50"
        assert dropped(network) > 0


@needs_kernel
def test_close_removes_the_namespace() -> None:
    network = KernelNetwork(LABEL).start()
    name = network.name
    assert re.fullmatch(re.escape(LABEL) + r"-\d+-[0-9a-f]{8}", name)
    echo_server(network)
    network.close()
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    network.close()  # twice is fine


@pytest.mark.skipif(REASON is None, reason="the kernel harness works here")
def test_start_says_why_it_cannot_run() -> None:
    with pytest.raises(RuntimeError, match=re.escape(str(REASON))):
        KernelNetwork().start()
