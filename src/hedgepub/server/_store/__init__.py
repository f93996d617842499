"""hedgepub.server._store.memory."""
