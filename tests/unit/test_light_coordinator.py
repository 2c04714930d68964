"""The coordinator process loads no torch, model, engine or worker code (checked at run time).

Each check runs in a fresh interpreter: this test process has long imported torch itself. The
static rules (tests/unit/test_import_contract.py) say the same of the code; these catch what
the static graph cannot see, such as a third-party package that pulls torch in.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.unit.import_graph import ROOT
from tools import cli

FORBIDDEN = (
    "torch",
    "numpy",
    "llguidance",
    "kernels",
    "engine",
    "services.worker",
    "services.kvtransfer",
    "tools.inprocess",
    "tools.bench",
)


def _loaded_after(code: str) -> list[str]:
    """The forbidden modules in sys.modules after a fresh interpreter runs `code`."""
    probe = textwrap.dedent(
        f"""
        import json, sys
        {code}
        banned = {FORBIDDEN!r}
        print(json.dumps(sorted(
            m for m in sys.modules if any(m == b or m.startswith(b + ".") for b in banned)
        )))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("module", ["services.coordinator.api.app", "services.coordinator.main"])
def test_importing_the_coordinator_loads_no_engine_side_module(module):
    assert _loaded_after(f"import {module}") == []


def test_the_serve_coordinator_command_loads_no_engine_side_module():
    # What `splitserve serve coordinator` imports before it serves: the CLI and the coordinator.
    code = (
        "from tools import cli; "
        "cli.build_parser(['serve', 'coordinator', '--config', 'x.yaml']); "
        "import services.coordinator.main"
    )
    assert _loaded_after(code) == []


def test_the_command_table_names_every_command_the_modules_define():
    parser = cli.build_parser(["--help"])  # every module's commands
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    assert set(sub.choices) == set(cli.COMMANDS)
    for command in cli.COMMANDS:
        alone = cli.build_parser([command])
        (only,) = [a for a in alone._actions if a.dest == "command"]
        assert command in only.choices
