"""hedgepub.server._api."""
