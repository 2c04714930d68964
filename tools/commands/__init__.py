"""The `splitserve` subcommands, one module each: the arguments they take and what they run."""
