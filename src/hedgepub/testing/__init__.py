"""Test helpers shipped with hedgepub.

- :mod:`hedgepub.testing.plugin`: the pytest plugin (entry point ``hedgepub``) with the ``pubsub_server``
  fixture, a local server per test.
- :mod:`hedgepub.testing.scripted`: :class:`~hedgepub.testing.scripted.ScriptedTransport`, a transport
  that answers Publish calls from a script, for publisher tests without a server.
- :mod:`hedgepub.testing.virtual_time`: an asyncio loop on virtual time, so that seconds of hedge delays
  and back-off run in milliseconds.
- :mod:`hedgepub.testing.network`: network faults with real TCP: :class:`FaultRelay` (also importable from
  here), a userspace relay that reproduces packet loss, a black-holed connection and a lost SYN.

Nothing in the library imports this package.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ConnectionInfo", "FaultRelay"]


def __getattr__(name: str) -> Any:
    # loaded on first use: the pytest plugin imports this package at every pytest start
    if name in __all__:
        from hedgepub.testing.network import relay

        return getattr(relay, name)
    raise AttributeError(f"module 'hedgepub.testing' has no attribute {name!r}")
