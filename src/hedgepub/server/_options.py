"""The local server's options, in one place: what :class:`~hedgepub.server.LocalServer` builds from its
arguments and ``hedgepub serve`` from its flags, and what :class:`~hedgepub.server.AsyncLocalServer`
starts from.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from hedgepub._clock import DEFAULT_CLOCK, Clock
from hedgepub.server._faults.injector import FaultInjector
from hedgepub.server._front.front import RELAYS
from hedgepub.server._iam.iam import Authorizer, IamConfig
from hedgepub.server._pubsub.delivery import DEFAULT_WINDOW


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerOptions:
    """How to set up a local server: ``ServerOptions(in_memory=True, rest=False)``.

    Keyword arguments, checked here: TLS needs both files, ``iam`` and ``authorizer`` exclude each other.
    ``data_dir`` or ``in_memory=True`` is needed to start (:class:`~hedgepub.server.LocalServer` adds a
    temporary directory when neither is given).
    """

    #: The address to listen on.
    host: str = "127.0.0.1"
    #: The port to listen on (0: an ephemeral one, read back from the server's ``port`` once started).
    port: int = 0
    #: The directory that holds the SQLite database (created, locked and checked when the server starts).
    data_dir: str | os.PathLike[str] | None = None
    #: Keep nothing on disk.
    in_memory: bool = False
    #: The :class:`~hedgepub.server.FaultInjector` installed as the server's interceptor (a new, empty one
    #: when not given).
    faults: FaultInjector | None = None
    #: Turns IAM enforcement on (tokens and the project policy); default: off, every call allowed.
    iam: IamConfig | None = None
    #: Any other :class:`~hedgepub.server.Authorizer`, instead of ``iam``.
    authorizer: Authorizer | None = None
    #: The clock of leases, deadlines and the hedge window (a virtual one in tests).
    clock: Clock = DEFAULT_CLOCK
    #: Keep the messages published while their topic has no subscription (the real service drops them;
    #: :class:`~hedgepub.server.LocalServer` keeps them so that ``messages(topic)`` shows them).
    keep_unsubscribed: bool = False
    #: Ready messages held in memory per subscription.
    window: int = DEFAULT_WINDOW
    #: Store the attempts of one hedged batch (same ``hedgepub-batch-id``) once and answer later ones with
    #: the first one's message IDs (``hedgepub serve --dedup-hedges``; the real service does not do this).
    dedup_hedges: bool = False
    #: A PEM certificate chain file: with ``tls_key``, the port speaks TLS instead of plain text.
    tls_cert: str | os.PathLike[str] | None = None
    #: The PEM private key file of ``tls_cert``.
    tls_key: str | os.PathLike[str] | None = None
    #: Serve REST/JSON (HTTP/1.1) on the same port as gRPC, as Google's emulator does (over TLS too, told
    #: apart by the protocols the client offers in its TLS handshake); ``False`` serves gRPC alone, and so
    #: does a server on Windows.
    rest: bool = True
    #: How the one-port front (``rest=True``) relays gRPC connections to the gRPC face: ``"process"``, by a
    #: small relay process that moves the bytes in the kernel (Linux; elsewhere, or when it cannot start,
    #: the event loop does), or ``"loop"``, on the server's event loop (``hedgepub serve --relay``).
    relay: str = "process"
    #: The CPU the relay process keeps to: ``None``, the last one the server may use; a CPU number; or
    #: ``"any"``, left to the scheduler (``hedgepub serve --relay-cpu``). Kept to one CPU, the scheduler
    #: settles the server's busy thread on another: with REST on, gRPC ran at 0.94-0.95x of its
    #: messages/s with REST off, against 0.88-0.90x with the relay left free, on 2 cores
    #: (``benchmarks/rest_front.py``). A CPU it cannot keep to is said on stderr and left free.
    relay_cpu: int | str | None = None
    #: A directory standing for Cloud Storage: a Cloud Storage subscription of bucket ``B`` writes its files
    #: in ``buckets_dir/B`` (created when missing). Without it, Cloud Storage subscriptions are refused
    #: (``hedgepub serve --buckets-dir``).
    buckets_dir: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                "TLS needs both tls_cert (PEM certificate chain) and tls_key (its PEM private key)"
            )
        if self.iam is not None and self.authorizer is not None:
            raise ValueError("give iam= (IAM enforcement) or authorizer= (a custom one), not both")
        if self.relay not in RELAYS:
            raise ValueError(f"relay must be one of {', '.join(RELAYS)}; got {self.relay!r}")
        cpu = self.relay_cpu
        if not (
            cpu is None or cpu == "any" or (isinstance(cpu, int) and not isinstance(cpu, bool) and cpu >= 0)
        ):
            raise ValueError(f"relay_cpu must be None, a CPU number or 'any'; got {cpu!r}")
        if self.iam is not None and not isinstance(self.iam, IamConfig):
            raise TypeError(f"iam must be an IamConfig or None; got {type(self.iam).__name__}")


def with_settings(options: ServerOptions | None, settings: dict[str, Any]) -> ServerOptions:
    """``options`` (default: :class:`ServerOptions`' defaults) with the fields named in ``settings``
    replaced: how :class:`AsyncLocalServer` and ``serve()`` also take the options as keywords. An unknown
    name is a TypeError naming it."""
    unknown = sorted(set(settings) - {field.name for field in dataclasses.fields(ServerOptions)})
    if unknown:
        raise TypeError(f"unknown server option(s): {', '.join(unknown)}")
    return dataclasses.replace(options or ServerOptions(), **settings)
