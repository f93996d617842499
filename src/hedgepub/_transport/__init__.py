"""hedgepub._transport.grpc."""
