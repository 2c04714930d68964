"""`splitserve bench ...`: each benchmark measures ours beside the peer or the physical limit
from the same run, and writes JSON (and figures with --plot)."""
