"""hedgepub.server._pubsub."""
