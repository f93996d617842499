"""Network faults with real TCP, for tests and benchmarks (docs/network.md).

- :mod:`hedgepub.testing.network.relay`: :class:`~hedgepub.testing.network.relay.FaultRelay`, a userspace
  TCP relay in front of any server that reproduces what packet loss, a black-holed connection and a lost
  SYN do to a connection; no root needed.
- :mod:`hedgepub.testing.network.kernel`: :class:`~hedgepub.testing.network.kernel.KernelNetwork`, the same
  faults from the Linux kernel's packet filter in a private network namespace (root).
- :mod:`hedgepub.testing.network.probe`: an echo server and a round-trip timer, as commands, for runs
  inside a namespace.
"""

from hedgepub.testing.network.relay import ConnectionInfo, FaultRelay

__all__ = ["ConnectionInfo", "FaultRelay"]
