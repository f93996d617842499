"""Network faults with real TCP, for tests and benchmarks (docs/network.md).

- :mod:`hedgepub.testing.network.relay`: :class:`~hedgepub.testing.network.relay.FaultRelay`, a userspace
  TCP relay in front of any server that reproduces what packet loss, a black-holed connection and a lost
  SYN do to a connection; no root needed.
"""

from hedgepub.testing.network.relay import ConnectionInfo, FaultRelay

__all__ = ["ConnectionInfo", "FaultRelay"]
