"""`make image` on a machine without the container tools, as a user who cannot install them:
one clear line naming every missing tool and how to get it, and a failing exit status — while
`make test`'s prerequisite only notes that the image test will skip."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = ("buildah", "debootstrap", "runc", "skopeo", "umoci")


def _as_unprivileged_user(cmd: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return cmd
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without util-linux's setpriv to drop to an unprivileged user")
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", *cmd]


def _run_without_tools(cmd: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    nowhere = tmp_path / "no-tools"
    nowhere.mkdir()
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "CONTAINER_TOOLS_PATH": str(nowhere),  # where image/tools.sh looks: finds none
    }
    return subprocess.run(
        _as_unprivileged_user(cmd), cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )


def test_make_image_without_tools_names_them_and_fails(tmp_path):
    done = _run_without_tools(["make", "--no-print-directory", "-s", "image"], tmp_path)
    assert done.returncode != 0
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("make image:")]
    for tool in TOOLS:
        assert tool in line
    assert f"apt-get install {' '.join(TOOLS)}" in line
    assert not (tmp_path / ".cache").exists()  # stopped before building anything


def test_make_test_prerequisite_only_notes_the_skip(tmp_path):
    done = _run_without_tools(["image/tools.sh", "--or-skip"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "container image test will skip" in done.stdout
    assert "buildah" in done.stdout
