"""Stats as plain data: ``dataclasses.asdict``, ``to_dict()`` for JSON, and a repr a person can read."""

from __future__ import annotations

import dataclasses
import json

from hedgepub import (
    BatchSettings,
    ConnectionStats,
    EndpointStats,
    HedgingSettings,
    PublisherClient,
    PublisherStats,
)
from hedgepub.server import LocalServer


def _hedging_stats(server: LocalServer, topic: str) -> PublisherStats:
    """Stats of a hedging publisher that published to ``topic`` (every mapping and tuple filled)."""
    hedging = HedgingSettings(hedge_delay=4.0, max_tokens=4)
    with PublisherClient(BatchSettings(max_messages=1), hedging_settings=hedging) as publisher:
        for future in [publisher.publish(topic, b"x") for _ in range(3)]:
            future.result(timeout=10)
        return publisher.stats()


def test_asdict_and_to_dict_give_the_same_plain_data_and_json_takes_it(
    server: LocalServer, topic: str
) -> None:
    stats = _hedging_stats(server, topic)
    assert topic in stats.tokens_by_topic and stats.endpoints[server.address].connections

    plain = dataclasses.asdict(stats)  # raised "cannot pickle 'mappingproxy' object"
    assert plain["messages_published"] == 3
    assert plain["tokens_by_topic"] == {topic: stats.tokens_by_topic[topic]}
    assert plain["endpoints"][server.address]["wins"] == 3

    as_json = stats.to_dict()
    assert json.loads(json.dumps(as_json)) == as_json  # only JSON's own types, nothing lost on the way
    assert as_json["endpoints"][server.address]["connections"] == [
        dataclasses.asdict(c) for c in stats.endpoints[server.address].connections
    ]
    assert {**as_json, "endpoints": None} == {**plain, "endpoints": None}


def test_every_stats_class_has_to_dict() -> None:
    connection = ConnectionStats(attempts_sent=2, state="silent")
    assert connection.to_dict() == {
        "attempts_sent": 2,
        "attempts_in_flight": 0,
        "state": "silent",
        "replacements": 0,
    }
    endpoint = EndpointStats(wins=1, last_error="UNAVAILABLE", connections=(connection,))
    assert endpoint.to_dict()["connections"] == [connection.to_dict()]
    assert json.loads(json.dumps(PublisherStats().to_dict())) == PublisherStats().to_dict()


def test_repr_puts_each_field_on_a_line_of_its_own(server: LocalServer, topic: str) -> None:
    stats = _hedging_stats(server, topic)
    text = repr(stats)
    lines = text.splitlines()
    assert lines[0] == "PublisherStats("
    assert lines[-1] == ")"
    assert "    messages_published=3," in lines
    assert f"        {topic!r}: {stats.tokens_by_topic[topic]!r}," in lines
    assert f"        {server.address!r}: EndpointStats(" in lines
    assert max(len(line) for line in lines) <= 120
    # Every field is named once, and the repr still reads back as the same values.
    for field in dataclasses.fields(PublisherStats):
        assert sum(line.startswith(f"    {field.name}=") for line in lines) == 1
    namespace = {
        "PublisherStats": PublisherStats,
        "EndpointStats": EndpointStats,
        "ConnectionStats": ConnectionStats,
    }
    assert eval(text, namespace) == stats


def test_an_empty_snapshot_repr_stays_short() -> None:
    text = repr(PublisherStats())
    assert "tokens_by_topic={}," in text and "endpoints={}," in text
    assert (
        repr(ConnectionStats())
        == "ConnectionStats(attempts_sent=0, attempts_in_flight=0, state='warm', replacements=0)"
    )
