"""``hedgepub bench``'s network scenarios end to end: packet loss, a dead connection and a lost SYN on real
TCP, through the userspace relay everywhere and the kernel's packet filter where root.

Times are only checked from below (a fault held a publish at least this long), never from above.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from hedgepub.bench import RESULT_KEYS
from hedgepub.testing.network.kernel import default_label, unavailable_reason

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PUBLISHERS = ["unhedged", "same_connection", "other_connection"]
REASON = unavailable_reason()


def run_scenario(hedgepub_cli, out, scenario: str, *options: str) -> dict:  # type: ignore[no-untyped-def]
    result = hedgepub_cli(
        "bench", "--scenario", scenario, "--messages", "200", "--rate", "100", "--out", str(out), *options
    )
    assert result.exit_code == 0, result.output
    document = json.loads((out / "results.json").read_text())
    assert document["config"]["scenario"] == scenario
    assert list(document["results"]) == PUBLISHERS
    for name, entry in document["results"].items():
        assert list(entry) == list(RESULT_KEYS)
        assert (entry["published"], entry["failed"]) == (200, 0), name
    assert (out / f"{scenario}.png").read_bytes().startswith(PNG_SIGNATURE)
    document["output"] = result.output
    return document


def test_packet_loss_through_the_relay(hedgepub_cli, tmp_path) -> None:
    document = run_scenario(
        hedgepub_cli, tmp_path, "packet-loss", "--network", "relay", "--loss", "0.05", "--warmup", "100"
    )
    assert "userspace relay" in document["output"] and "5% packet loss" in document["output"]
    network = document["config"]["network"]
    assert (network["harness"], network["why"]) == ("relay", "asked for")
    # every publisher's path lost segments; the defaults of the scenario were used where none was given
    assert all(network["losses"][name] > 0 for name in PUBLISHERS), network
    config = document["config"]
    assert (config["message_size"], config["arrivals"], config["hedge_delays"]) == (1024, "fixed", [0.1])
    # a hedge on the same connection waits in the same hole: it wins only where the original lost time
    # elsewhere (a scheduling stall of this machine), a small share of the hedges sent at most
    same = document["results"]["same_connection"]
    assert same["hedges_won"] <= max(1, same["hedges_sent"] // 10), same
    assert document["results"]["other_connection"]["hedges_sent"] > 0


def test_a_dead_connection_through_the_relay(hedgepub_cli, tmp_path) -> None:
    document = run_scenario(
        hedgepub_cli,
        tmp_path,
        "dead-connection",
        "--network",
        "relay",
        "--blackhole",
        "1.5",
        "--warmup",
        "100",
    )
    network = document["config"]["network"]
    assert set(network["blackholed_client_port"]) == set(PUBLISHERS)
    results = document["results"]
    # on one connection some publish waited in the hole; with two, hedges escaped it and won
    assert results["unhedged"]["max_ms"] >= 1000.0
    assert results["other_connection"]["hedges_won"] > 0


def test_a_lost_syn_through_the_relay(hedgepub_cli, tmp_path) -> None:
    document = run_scenario(hedgepub_cli, tmp_path, "lost-syn", "--network", "relay", "--syn-loss", "1")
    network = document["config"]["network"]
    assert all(network["syn_delayed"][name] >= 1 for name in PUBLISHERS), network
    assert document["config"]["warmup"] == 0  # the first publishes need the connections
    # every set-up took the initial retransmission timeout: the first publish waited for it
    assert document["results"]["unhedged"]["max_ms"] >= 1000.0


@pytest.mark.skipif(REASON is not None, reason=str(REASON))
def test_packet_loss_from_the_kernel_in_a_namespace_of_its_own(hedgepub_cli, tmp_path) -> None:
    document = run_scenario(hedgepub_cli, tmp_path, "packet-loss", "--loss", "0.05", "--warmup", "100")
    assert "kernel's packet filter" in document["output"]
    network = document["config"]["network"]
    assert network["harness"] == "kernel" and "why" not in network
    assert network["packets_dropped"] > 0
    # the namespace it made is gone
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert f"{default_label()}-bench-{os.getpid()}-" not in names


@pytest.mark.skipif(REASON is None, reason="the kernel harness works here")
def test_asking_for_the_kernel_where_it_cannot_run_says_why(hedgepub_cli, tmp_path) -> None:
    result = hedgepub_cli("bench", "--scenario", "packet-loss", "--network", "kernel", "--out", str(tmp_path))
    assert result.exit_code == 2
    assert str(REASON) in result.output.replace("\n", " ")


def test_bad_network_options_are_usage_errors(hedgepub_cli, tmp_path) -> None:
    for args, message in [
        (("--scenario", "packet-loss", "--hedge-delay", "0.1,auto"), "one fixed hedge delay"),
        (("--scenario", "dead-connection", "--topic", "t", "--yes"), "needs the bench's own servers"),
        (("--scenario", "packet-loss", "--loss", "0"), "--loss"),
        (("--scenario", "dead-connection", "--blackhole", "-1"), "--blackhole"),
        (("--scenario", "lost-syn", "--network", "ethernet"), "--network"),
    ]:
        result = hedgepub_cli("bench", *args, "--out", str(tmp_path))
        assert result.exit_code == 2, (args, result.output)
        assert message in result.output, (args, result.output)
    assert list(tmp_path.iterdir()) == []
