"""Bad bytes on the gRPC wire: garbage request bodies, unknown methods, oversized requests."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hedgepub.server._methods import METHODS

from ._common import (
    CASES,
    FUZZ_TOPIC,
    PB,
    Client,
    check_answer,
    examples,
)

# Bytes that are not a valid protobuf message (truncated varints and lengths, invalid UTF-8 in a
# string field, a wrong wire type, an end-group tag), then random bytes.
_GARBAGE = st.one_of(
    st.sampled_from(
        [
            b"\x0a",
            b"\x0a\x05abc",
            b"\x0a\x02\xff\xfe",
            b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
            b"\x0c",
            b"\x0a\xff\xff\xff\xff\x0f",
            b"\xff" * 16,
            b"\x12\x03\x0a\x01\xff",
        ]
    ),
    st.binary(max_size=200),
)


@examples(200)
@given(method=st.sampled_from(sorted(METHODS)), body=_GARBAGE)
def test_garbage_bodies(client: Client, method: str, body: bytes) -> None:
    CASES["garbage bytes"] += 1
    code, details, _ = client.raw(method, body)
    check_answer(client, method, code, details)


@pytest.mark.parametrize(
    "path",
    [
        "/google.pubsub.v1.Publisher/NoSuchMethod",
        "/google.pubsub.v1.NoSuchService/Publish",
        "/google.pubsub.v2.Publisher/Publish",
        "/nonsense",
    ],
)
def test_unknown_methods_are_unimplemented(client: Client, path: str) -> None:
    CASES["unknown method"] += 1
    code, details, _ = client.raw(path, b"")
    assert code == grpc.StatusCode.UNIMPLEMENTED
    assert details


def test_oversized_requests(client: Client) -> None:
    """Over the service's 10 MB limit: INVALID_ARGUMENT; over the gRPC frame limit: RESOURCE_EXHAUSTED."""
    CASES["oversized"] += 3
    exactly = PB["PublishRequest"](topic=FUZZ_TOPIC, messages=[PB["PubsubMessage"](data=b"x" * 9_999_900)])
    assert exactly.ByteSize() <= 10_000_000
    code, details, _ = client.call("Publish", exactly)
    check_answer(client, "Publish", code, details)
    assert code == grpc.StatusCode.OK, details
    over = PB["PublishRequest"](topic=FUZZ_TOPIC, messages=[PB["PubsubMessage"](data=b"x" * 10_000_001)])
    code, details, _ = client.call("Publish", over)
    check_answer(client, "Publish", code, details)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    huge = PB["PublishRequest"](topic=FUZZ_TOPIC, messages=[PB["PubsubMessage"](data=b"x" * 21_000_000)])
    code, details, _ = client.call("Publish", huge)
    check_answer(client, "Publish", code, details)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
