"""The one RPC table: every method of the protocol descriptions has a permission entry and a handler."""

from __future__ import annotations

import inspect

import grpc
import pytest

from hedgepub.server._api.dispatch import generic_handlers
from hedgepub.server._api.grpc import PubSubServicer
from hedgepub.server._iam.iam import RPC_PERMISSIONS
from hedgepub.server._methods import RPCS, STREAMING
from hedgepub.server._pubsub.core import PubSubCore
from hedgepub.server._store.memory import MemoryStore


class _Call(grpc.HandlerCallDetails):
    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


def test_the_table_has_every_service_of_the_protocol() -> None:
    services = {rpc.service for rpc in RPCS.values()}
    assert services == {
        "google.pubsub.v1.Publisher",
        "google.pubsub.v1.Subscriber",
        "google.pubsub.v1.SchemaService",
        "google.iam.v1.IAMPolicy",
    }
    assert set(STREAMING) == {"StreamingPull"}
    assert RPCS["Publish"].request_class.DESCRIPTOR.full_name == "google.pubsub.v1.PublishRequest"
    assert RPCS["DeleteTopic"].response_class.DESCRIPTOR.full_name == "google.protobuf.Empty"


@pytest.mark.parametrize("method", sorted(RPCS))
def test_every_method_has_a_permission_entry_and_a_handler(method: str) -> None:
    assert method in RPC_PERMISSIONS
    behavior = getattr(PubSubServicer, method)
    if method in STREAMING:
        assert inspect.isasyncgenfunction(behavior)
    else:
        assert inspect.iscoroutinefunction(behavior)
    handlers = generic_handlers(PubSubServicer(PubSubCore(MemoryStore())))
    served = [handler.service(_Call(RPCS[method].path)) for handler in handlers[:-1]]
    (handler,) = [found for found in served if found is not None]
    assert handler.request_streaming == handler.response_streaming == (method in STREAMING)


def test_no_permission_entry_without_a_method() -> None:
    assert set(RPC_PERMISSIONS) <= set(RPCS)
