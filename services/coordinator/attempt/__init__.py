"""Running a request: the one retry loop (fallback, migration, drain) over attempts, each on
one (prefill, decode) pair through gRPC."""
