"""Above the product: the `splitserve` command line, benchmarks, the profiler and the tuner.

Nothing under `services/`, `engine/`, `shared/` or `kernels/` imports this package.
"""
