"""How a replica's KV blocks are named and announced: chained block hashes and the
stored/evicted events a worker publishes. What the router knows of a cache; torch-free."""
