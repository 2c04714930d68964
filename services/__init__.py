"""What runs in a pod or a local process: the coordinator, the router it calls, the worker,
KV transfer, the planner and the local launcher. Never imports `tools/`."""
