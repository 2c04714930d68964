"""The worker process: the prefill and/or decode role services behind one gRPC server.

Above `services.prefill`, `services.decode` and `services.worker` (the runtime they share), so
those never import it and the role packages never import each other.
"""
