"""What the proxy reads of a Publish request (topic, message count, an ordering key), and what it leaves to
the service: requests that do not parse, or have no topic or no message."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hedgepub._transport.grpc import PublishRequestPb
from hedgepub.proxy._forwarder import publish_head


def request(topic: str, messages: list[tuple[bytes, str, dict[str, str]]]) -> bytes:
    built = PublishRequestPb(topic=topic)
    for data, key, attributes in messages:
        built.messages.add(data=data, ordering_key=key, attributes=attributes)
    return bytes(built.SerializeToString())


messages = st.lists(
    st.tuples(
        st.binary(max_size=300),
        st.sampled_from(["", "", "", "k", "ключ", "k" * 200]),
        st.dictionaries(st.text(min_size=1, max_size=5), st.text(max_size=5), max_size=2),
    ),
    min_size=1,
    max_size=40,
)


@given(topic=st.text(min_size=1, max_size=300), messages=messages)
def test_the_head_is_what_a_full_parse_reads(
    topic: str, messages: list[tuple[bytes, str, dict[str, str]]]
) -> None:
    keys = [key for _, key, _ in messages if key]
    assert publish_head(request(topic, messages)) == (topic, keys[0] if keys else "", len(messages))


@pytest.mark.parametrize(
    "wire",
    [b"\xff\xff\xff", b"\x0a\x05ab", request("", [(b"x", "", {})]), request("projects/p/topics/t", [])],
    ids=["garbage", "truncated", "no topic", "no messages"],
)
def test_requests_the_service_must_answer_itself_have_no_head(wire: bytes) -> None:
    assert publish_head(wire) is None
