"""hedgepub.server._faults.injector."""
