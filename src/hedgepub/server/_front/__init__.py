"""hedgepub.server._front.front."""
