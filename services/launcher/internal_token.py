"""Internal auth on by default under `splitserve up`: a fresh token for every run.

The children get it through a file named in the config they all read (never through argv,
which any local user can read in the process list); the file is the launcher's user's alone
(0600) and goes when the stack stops.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from shared.config.schema import DeploymentConfig

TOKEN_FILE = "internal-token"


def with_internal_token(config: DeploymentConfig, run_dir: Path) -> DeploymentConfig:
    """`config` as it is if it names a token file already; else with a new one in `run_dir`."""
    if config.internal_auth.token_file:
        return config
    path = run_dir / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    auth = config.internal_auth.model_copy(update={"token_file": str(path)})
    return config.model_copy(update={"internal_auth": auth})
