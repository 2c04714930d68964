"""Build and load the native decode-step library on the machine at hand.

The library is compiled for this CPU (`-march=native`), so the cached build is keyed by the
source, the compiler and the CPU's model and flags: a checkout moved to another machine builds
again instead of loading code for instructions its CPU lacks. A machine without a C compiler
gets no library and a reason, and the engine keeps its torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "decode_step.c"
# Everything the build reads: a changed header must rebuild too.
SOURCES = (SOURCE, SOURCE.parent / "linear_a8.h")
_FLAG_SETS = (
    ["-O3", "-march=native", "-mtune=native"],
    ["-O3"],  # a compiler that does not know this CPU still gets a (scalar) library
)


@dataclass(frozen=True)
class NativeBuild:
    library: ctypes.CDLL | None
    path: Path | None
    reason: str  # why there is no library, or how it was built

    @property
    def available(self) -> bool:
        return self.library is not None


def cpu_signature() -> str:
    """What the compiled code depends on: CPU model and instruction-set flags."""
    model, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
            if model and flags:
                break
    except OSError:
        pass
    return f"{platform.machine()}|{model}|{flags}"


def source_digest() -> str:
    """The native kernels' source, hashed: what a timing of them is only valid for."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()[:16]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "splitserve" / "native"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30
        ).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return cc


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    from kernels.native.abi import declare

    declare(lib)
    return lib


def load(directory: Path | None = None) -> NativeBuild:
    """The library for this machine: from the cache, or compiled now (a few seconds)."""
    if os.environ.get("SPLITSERVE_NATIVE", "1") == "0":
        return NativeBuild(None, None, "disabled by SPLITSERVE_NATIVE=0")
    cc = _compiler()
    if cc is None:
        return NativeBuild(None, None, "no C compiler (cc/gcc/clang) on PATH")
    source = b"".join(p.read_bytes() for p in SOURCES)
    directory = directory or cache_dir()
    errors: list[str] = []
    # SPLITSERVE_NATIVE_CFLAGS builds one given flag set instead (e.g. "-O3 -mavx2 -mfma
    # -mf16c" runs the AVX2 path on an AVX-512 machine: how the other paths are tested here).
    forced = os.environ.get("SPLITSERVE_NATIVE_CFLAGS")
    for flags in [forced.split()] if forced else _FLAG_SETS:
        key = hashlib.sha256(
            b"\0".join(
                [
                    source,
                    " ".join(flags).encode(),
                    _compiler_version(cc).encode(),
                    cpu_signature().encode(),
                ]
            )
        ).hexdigest()[:16]
        path = directory / f"decode_step-{key}.so"
        if not path.is_file():
            error = _compile(cc, flags, path)
            if error:
                errors.append(error)
                continue
        try:
            return NativeBuild(_declare(ctypes.CDLL(str(path))), path, f"{cc} {' '.join(flags)}")
        except OSError as exc:
            errors.append(f"cannot load {path}: {exc}")
    return NativeBuild(None, None, "; ".join(errors))


def _compile(cc: str, flags: list[str], path: Path) -> str | None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: a concurrent process never loads a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    cmd = [cc, *flags, "-fPIC", "-shared", "-o", tmp, str(SOURCE), "-lm", "-lpthread"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as exc:
        os.unlink(tmp)
        return f"{' '.join(cmd)}: {exc}"
    if done.returncode != 0:
        os.unlink(tmp)
        return f"{' '.join(flags)}: {done.stderr.strip()[-400:]}"
    os.replace(tmp, path)
    return None


if __name__ == "__main__":  # `python -m kernels.native.build`: the install step warms the cache
    build = load()
    print(f"native decode step: {build.path or 'unavailable'} ({build.reason})")
