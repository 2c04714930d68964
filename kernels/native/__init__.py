"""Native CPU kernels: C sources built on the machine that runs them (see `build`)."""
