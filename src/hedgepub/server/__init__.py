"""A local Pub/Sub-compatible server: ``google.pubsub.v1`` over gRPC and REST on one port, pure Python,
durable on SQLite.

Start it from Python::

    from hedgepub.server import LocalServer

    with LocalServer(in_memory=True) as server:   # ephemeral port on 127.0.0.1, own thread + loop
        os.environ["PUBSUB_EMULATOR_HOST"] = server.address
        ...
        server.messages("projects/p/topics/events")  # what was published, as StoredMessage
        server.faults.set("Publish", "latency=50ms")

On an event loop you already run (the ``hedgepub serve`` command does this)::

    options = ServerOptions(host=host, port=port, data_dir=..., faults=...)   # the one list of options
    await serve(options, on_started=print_address, stop=event)
    # or
    async with AsyncLocalServer(options) as server: ...

IAM enforcement is off unless asked for: ``LocalServer(iam=IamConfig(tokens, policy))`` (or
``IamConfig.from_files(tokens_file, policy_file)``); callers then send ``authorization: Bearer <token>``.

The options (store, faults, IAM, TLS, REST, ...) are :class:`ServerOptions`, which ``LocalServer`` builds
from its arguments and ``hedgepub serve`` from its flags (:mod:`._options`).

Layers: :mod:`._services` (thin gRPC handlers) -> :mod:`._core` (the coordinator; checks in
:mod:`._resources`, each subscription's state machine in :mod:`._delivery`) ->
:mod:`._store` / :mod:`._sqlite` (storage). :mod:`._faults` wraps the services as an interceptor
(rules and their text in :mod:`._fault_rules`, delays in :mod:`._fault_delays`, counts in
:mod:`._fault_counts`; the method table in :mod:`._methods`; the request log in :mod:`._request_log`).
:mod:`._rest` answers REST calls through the gRPC face, behind :mod:`._front`, which owns the public port.
"""

# First: without the `server` extra, say which extra to install rather than which module is missing
# (so the imports below come after a statement).
# ruff: noqa: E402
from hedgepub._extras import require

require("server", "hedgepub.server (the local server)")

# isort: split
from hedgepub.server._faults.delays import LatencyMix, StallWindows
from hedgepub.server._faults.injector import FaultInjector
from hedgepub.server._faults.rules import FaultRule
from hedgepub.server._iam.iam import AllowAll, Authorizer, IamConfig, IamConfigError, IamEnforcer
from hedgepub.server._local import AsyncLocalServer, LocalServer, serve
from hedgepub.server._options import ServerOptions
from hedgepub.server._pubsub.core import PubSubCore
from hedgepub.server._pubsub.limits import ServiceError
from hedgepub.server._store.datadir import DataDirError
from hedgepub.server._store.memory import MemoryStore, Snapshot, Store, StoredMessage

__all__ = [
    "AllowAll",
    "AsyncLocalServer",
    "Authorizer",
    "DataDirError",
    "FaultInjector",
    "FaultRule",
    "IamConfig",
    "IamConfigError",
    "IamEnforcer",
    "LatencyMix",
    "LocalServer",
    "MemoryStore",
    "PubSubCore",
    "ServerOptions",
    "ServiceError",
    "Snapshot",
    "StallWindows",
    "Store",
    "StoredMessage",
    "serve",
]
