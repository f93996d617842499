"""hedgepub._publisher.client."""
