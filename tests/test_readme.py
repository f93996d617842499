"""The README's Python examples run as written, against the local server.

Each ```python block of README.md runs in a fresh namespace, with ``PUBSUB_EMULATOR_HOST`` pointing at a
local server on which the examples' topic ``projects/my-project/topics/my-topic`` exists. Blocks that
start their own server (most do) simply ignore it.
"""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest
from google.pubsub_v1.types import pubsub

from hedgepub.server import LocalServer

README = Path(__file__).resolve().parent.parent / "README.md"
EXAMPLE_TOPIC = "projects/my-project/topics/my-topic"


def _python_blocks() -> list[tuple[int, str]]:
    text = README.read_text(encoding="utf-8")
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        line = text.count("\n", 0, match.start()) + 2
        blocks.append((line, match.group(1)))
    return blocks


BLOCKS = _python_blocks()


def test_the_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 5


@pytest.fixture
def example_server(monkeypatch: pytest.MonkeyPatch):
    with LocalServer(in_memory=True) as server:
        with grpc.insecure_channel(server.address) as channel:
            create_topic = channel.unary_unary(
                "/google.pubsub.v1.Publisher/CreateTopic",
                request_serializer=pubsub.Topic.pb().SerializeToString,
                response_deserializer=pubsub.Topic.pb().FromString,
            )
            create_topic(pubsub.Topic.pb()(name=EXAMPLE_TOPIC), timeout=10)
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", server.address)
        yield server


@pytest.mark.parametrize(("line", "code"), BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_example_runs(line: int, code: str, example_server: LocalServer, monkeypatch) -> None:
    # Examples may set PUBSUB_EMULATOR_HOST themselves; monkeypatch restores it afterwards.
    monkeypatch.setenv("PUBSUB_EMULATOR_HOST", example_server.address)
    namespace: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(code, f"README.md:{line}", "exec"), namespace)
