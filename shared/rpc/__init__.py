"""Internal gRPC: channels, the shared-token and mutual-TLS authentication every service
checks, and the event loop every service runs."""
