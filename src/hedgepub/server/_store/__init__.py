"""The server's storage: the :class:`~hedgepub.server._store.protocol.Store` protocol and its two stores."""
