"""One worker process: the prefill and/or decode role over one engine, behind one gRPC server.

`server` is the process; `prefill` and `decode` are the two roles' services (they never
import each other); `runtime`, `registration` and `arrivals` are what both roles share.
"""
