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

Layers, each a subpackage, calls going down only:

- :mod:`._api`: the faces. :mod:`._api.dispatch` serves every RPC of the one table in :mod:`hedgepub._rpcs`
  (derived from the client package's protocol descriptions) by the coroutine of the same name on
  :class:`~._api.grpc.PubSubServicer`, after the permission check of :mod:`._iam`; :mod:`._api.rest`
  answers REST calls through the gRPC face (routes and transcoding in :mod:`._api.rest_routes`);
  :mod:`._api.request_log` logs each call; :mod:`._api.client_telemetry` reads any client's hedges.
- :mod:`._front`: the one public port, telling gRPC from HTTP/1.1 (:mod:`._front.front`, the ClientHello
  of TLS in :mod:`._front.client_hello`) and relaying gRPC (:mod:`._front.relaying`) on the event loop or
  in a relay process (:mod:`._front.relay`).
- :mod:`._faults`: the fault injector, an interceptor around the faces (rules, delays, counts, units),
  after the load shedder of :mod:`._api.shedding`.
- :mod:`._pubsub`: the service. :class:`~._pubsub.core.PubSubCore` is its composition root: it builds the
  parts, each given the parts it depends on, and the faces call the part that owns an RPC: topics,
  subscriptions and IAM policy RPCs to :mod:`._pubsub.catalog` (the one part that changes the registry of
  topics, subscriptions and attachments, :mod:`._pubsub.registry`; checks in :mod:`._pubsub.resources`,
  :mod:`._pubsub.limits`), Publish to :mod:`._pubsub.publishing`, pulls, leases, acks and dead letters
  to :mod:`._pubsub.consumers` (each subscription's state machine in :mod:`._pubsub.delivery`, its
  ordering keys' lines in :mod:`._pubsub.key_lines`, lease timers in :mod:`._pubsub.leases`), snapshots
  and Seek to :mod:`._pubsub.replay`, schemas to :mod:`._pubsub.schemas` (formats in
  :mod:`._pubsub.schema_formats`); IAM policies are kept by :mod:`._pubsub.policies`, push delivery is
  :mod:`._pubsub.push`. ``--dedup-hedges`` is :mod:`._pubsub.hedge_dedup`.
- :mod:`._store`: storage behind the :class:`Store` protocol (:mod:`._store.protocol`), which both stores
  subclass: in memory (:mod:`._store.memory`) or SQLite (:mod:`._store.sqlite`, its file's layout in
  :mod:`._store.sqlite_schema`, written by the group-commit thread of :mod:`._store.group_commit`), in a
  data directory (:mod:`._store.datadir`).
- :mod:`._iam`: who may call what (:data:`~._iam.iam.RPC_PERMISSIONS`, one entry per RPC of the table).

:mod:`._local` wires them together (each part gets what it needs in its constructor) and
:mod:`._local_thread` runs that on a thread of its own (:class:`LocalServer`); :mod:`._options` holds
:class:`ServerOptions`.
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
from hedgepub.server._local import AsyncLocalServer, serve
from hedgepub.server._local_thread import LocalServer
from hedgepub.server._options import ServerOptions
from hedgepub.server._pubsub.core import PubSubCore
from hedgepub.server._pubsub.limits import ServiceError
from hedgepub.server._store.datadir import DataDirError
from hedgepub.server._store.memory import MemoryStore
from hedgepub.server._store.protocol import Snapshot, Store, StoredMessage

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
