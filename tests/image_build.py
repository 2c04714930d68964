"""`make image` for the container test, started as soon as the test is collected, and the
archive unpacked into the runtime bundle runc runs.

A cold build (debootstrap base, wheel downloads, buildah, the archive) takes minutes, mostly
waiting on the Debian mirror, PyPI and the disk; after a source change it still takes about
185 CPU-seconds, and unpacking the archive another 58. Started in the background when the
whole suite is collected (`python -m tests.image_build`: build, then unpack), both overlap the
other tests instead of adding their minutes after them; the test waits for them. Run alone,
the test builds and unpacks in the foreground as before.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "image" / "build.sh"
ARCHIVE = REPO / "build" / "splitserve-image.oci.tar"
UNPACK_TIMEOUT_S = 900
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
        # At the tests' own CPU priority: at nice 10 it barely ran beside two test workers,
        # and the image test, last, waited 290 s for it after every other test had finished.
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.image_build"],
            cwd=REPO,
            env={**os.environ, "PYTHON": sys.executable},
            stdout=self.log,
            stderr=subprocess.STDOUT,
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


def chart_image() -> str:
    """The image the chart runs by default: repository, and tag defaulting to appVersion."""
    chart = REPO / "helm" / "splitserve"
    values = yaml.safe_load((chart / "values.yaml").read_text())["image"]
    app_version = yaml.safe_load((chart / "Chart.yaml").read_text())["appVersion"]
    return f"{values['repository']}:{values['tag'] or app_version}"


def image_cache() -> Path:
    """image/build.sh's cache folder."""
    explicit = os.environ.get("SPLITSERVE_IMAGE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "splitserve" / "image"


def unpack_bundle(archive: Path) -> Path:
    """The image unpacked into an OCI runtime bundle (rootfs + the config.json umoci derives
    from the image). Unpacked once per archive and kept (beside the build caches): runc runs
    the root filesystem read-only, as the chart does, so it stays as unpacked — unpacking and
    deleting 2 GB costs minutes on a busy disk. Raises RuntimeError if umoci fails."""
    with tarfile.open(archive) as tar:
        index = json.load(tar.extractfile("index.json"))
    digest = index["manifests"][0]["digest"].partition(":")[2][:16]
    bundles = image_cache() / "bundles"
    path = bundles / digest
    if (path / "config.json").is_file():
        return path
    shutil.rmtree(bundles, ignore_errors=True)  # the bundle of an older archive
    work = bundles / f".unpack-{os.getpid()}"
    layout = work / "layout"
    layout.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        tar.extractall(layout, filter="tar")
    cmd = ["umoci", "unpack", "--image", f"{layout}:{chart_image()}", str(work / "bundle")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=UNPACK_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()[-2000:]}")
    (work / "bundle").rename(path)
    shutil.rmtree(work)
    return path


def main() -> int:
    """The background job: image/build.sh, then the archive unpacked into its bundle."""
    code = subprocess.run([str(BUILD)], cwd=REPO).returncode
    if code != 0:
        return code
    try:
        print(f"unpacked into {unpack_bundle(ARCHIVE)}", flush=True)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        # The test unpacks again in the foreground and fails there with umoci's reason.
        print(f"unpacking failed: {exc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
