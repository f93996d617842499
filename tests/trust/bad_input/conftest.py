"""Malformed and boundary requests to every RPC, through raw gRPC, against one SQLite-backed server
(one for the whole package, whose files split the surfaces: the Publisher, Subscriber and IAM services,
the gRPC wire, REST; the state check runs last).

Hypothesis draws the requests: resource names (random text, IDs of 2/3/255/256 characters, the reserved
``goog`` prefix, bad characters, wrong project or collection forms), message counts (0, 1000, 1001),
attributes (100/101 of them, keys of 256/257 bytes, values of 1024/1025 bytes), ack IDs (garbage, empty,
well-formed but unknown), deadlines (-1, 0, 9, 10, 600, 601), page tokens and sizes, field masks, IAM
policies, and plain garbage bytes as the request body of every method. For every case:

- the answer is OK or a status code the service documents for that method, with a non-empty message;
  never UNKNOWN or INTERNAL (which would mean an unhandled error inside the server);
- the server keeps serving: a known-good request succeeds after each case;
- at the end the stored state is consistent (lists agree with gets, every subscription's topic exists
  or is ``_deleted-topic_``), survives a restart of the server on the same SQLite file, and a
  publish-and-pull round trip works.

The number of cases each test ran is printed at the end (``pytest -s``). Settings (environment):
``HEDGEPUB_TRUST_EXAMPLES`` multiplies every test's ``max_examples`` (default 1; the long run uses 10);
``HEDGEPUB_TRUST_DEBUG=1`` prints every answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hedgepub.server import LocalServer

from ._common import (
    FUZZ_SUBSCRIPTION,
    FUZZ_TOPIC,
    GOOD_SUBSCRIPTION,
    GOOD_TOPIC,
    PB,
    Client,
)


@pytest.fixture(scope="package")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SQLite directory of the package's server (kept for the restart check)."""
    return tmp_path_factory.mktemp("bad-input")


@pytest.fixture(scope="package")
def server(data_dir: Path) -> Iterator[LocalServer]:
    """One SQLite-backed server for the whole package, with the known-good and fuzz targets created."""
    with LocalServer(data_dir=data_dir) as local:
        client = Client(local.address)
        for topic in (GOOD_TOPIC, FUZZ_TOPIC):
            client.ok("CreateTopic", PB["Topic"](name=topic), PB["Topic"])
        client.ok(
            "CreateSubscription",
            PB["Subscription"](name=GOOD_SUBSCRIPTION, topic=GOOD_TOPIC),
            PB["Subscription"],
        )
        client.ok(
            "CreateSubscription",
            PB["Subscription"](name=FUZZ_SUBSCRIPTION, topic=FUZZ_TOPIC),
            PB["Subscription"],
        )
        client.close()
        yield local


@pytest.fixture(scope="package")
def client(server: LocalServer) -> Iterator[Client]:
    """A raw gRPC client of the package's server."""
    raw = Client(server.address)
    yield raw
    raw.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The state check runs after every other test of the package, on what they left behind."""
    last = [item for item in items if item.name == "test_state_is_consistent_and_survives_a_restart"]
    items[:] = [item for item in items if item not in last] + last
