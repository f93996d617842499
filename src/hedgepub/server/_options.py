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

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                "TLS needs both tls_cert (PEM certificate chain) and tls_key (its PEM private key)"
            )
        if self.iam is not None and self.authorizer is not None:
            raise ValueError("give iam= (IAM enforcement) or authorizer= (a custom one), not both")
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
