"""`make image` for the container test, started as soon as the test is collected.

A cold build (debootstrap base, wheel downloads, buildah, the archive) takes minutes, mostly
waiting on the Debian mirror, PyPI and the disk. Started in the background when the whole
suite is collected, it overlaps the other tests instead of adding its minutes after them; the
test waits for it. Run alone, the test builds in the foreground as before.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "image" / "build.sh"
TOOLS = ("buildah", "debootstrap", "runc", "skopeo", "umoci")
TEST_FILE = "test_container_image.py"


def tool(name: str) -> str | None:
    # debootstrap and runc live in /usr/sbin, which a non-root PATH often lacks.
    found = shutil.which(name) or f"/usr/sbin/{name}"
    return found if os.access(found, os.X_OK) else None


def why_no_containers() -> str | None:
    if sys.platform != "linux":
        return f"container images are built and run on Linux only (this is {sys.platform})"
    missing = [t for t in TOOLS if tool(t) is None]
    if missing:
        return (
            f"container tools missing: {' '.join(missing)} "
            "(`make container-tools` installs them with apt as root)"
        )
    if os.geteuid() != 0:
        return "debootstrap and runc need root here (no rootless container set-up): run as root"
    return None


class BackgroundBuild:
    """image/build.sh running while other tests run; its output goes to a file."""

    def __init__(self) -> None:
        self.log = tempfile.NamedTemporaryFile(
            prefix="splitserve-image-", suffix=".log", delete=False
        )
        self.process = subprocess.Popen(
            [str(BUILD)],
            cwd=REPO,
            env={**os.environ, "PYTHON": sys.executable},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            # Below the tests in CPU priority: the build waits on the network and disk
            # mostly, and the timing-sensitive tests should not wait on it.
            preexec_fn=lambda: os.nice(10),
        )

    def wait(self, timeout: float) -> tuple[int, str]:
        code = self.process.wait(timeout=timeout)
        return code, Path(self.log.name).read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
