"""The names client and server share, and the x-goog-pubsub-client-telemetry codec (docs/hedging.md)."""

from __future__ import annotations

import base64

import pytest
from google.pubsub_v1.types import PubsubClientTelemetry

from hedgepub._wire import decode_client_telemetry, encode_client_telemetry


def test_the_encodings_google_s_clients_pin_are_reproduced_byte_for_byte() -> None:
    assert encode_client_telemetry(0, None) == "CgA="
    assert encode_client_telemetry(1, None) == "CgIIAQ=="
    assert decode_client_telemetry("CgA=") == (0, None)
    assert decode_client_telemetry("CgIIAQ==") == (1, None)


def test_a_start_time_goes_in_as_a_timestamp_and_comes_back() -> None:
    value = encode_client_telemetry(3, 1_767_225_600.25)
    parsed = PubsubClientTelemetry.deserialize(base64.b64decode(value))
    operation = parsed.publish_operation
    assert operation.hedged_attempt_count == 3
    assert operation.publish_start_time.timestamp() == 1_767_225_600.25  # the official type reads it too
    assert decode_client_telemetry(value) == (3, 1_767_225_600.25)


def test_every_attempt_of_a_batch_encodes_its_one_start_time_identically() -> None:
    start = 1_767_225_600.123456
    values = [encode_client_telemetry(number, start) for number in (0, 1, 2)]
    assert [decode_client_telemetry(value) for value in values] == [(0, start), (1, start), (2, start)]


@pytest.mark.parametrize(
    "value",
    [
        "",  # no publish_operation
        "not base64!",
        "CgA",  # padding missing
        base64.b64encode(b"\x0a\x05\x08").decode(),  # truncated
        base64.b64encode(b"\xff\xff\xff").decode(),  # not a message
    ],
)
def test_malformed_values_raise_value_error(value: str) -> None:
    with pytest.raises(ValueError, match="client telemetry header"):
        decode_client_telemetry(value)


def test_a_negative_attempt_count_is_refused_when_encoding() -> None:
    with pytest.raises(ValueError, match="hedged_attempt_count"):
        encode_client_telemetry(-1, None)
