"""The local launcher: `splitserve up` and the Python API behind it.

`start_local_stack(config)` starts the coordinator and every worker as separate processes and
returns a `LocalStack` once the coordinator reports ready.
"""

from services.launcher.processes import ProcessGroup, ServiceDied, ServiceLaunch, ServiceProcess
from services.launcher.readiness import StartupCancelled, StartupTimeout
from services.launcher.stack import LocalStack, start_local_stack

__all__ = [
    "LocalStack",
    "ProcessGroup",
    "ServiceDied",
    "ServiceProcess",
    "ServiceLaunch",
    "StartupCancelled",
    "StartupTimeout",
    "start_local_stack",
]
