"""Load the model a replica serves, in the format(s) its config asks for.

`auto` (the default) takes the formats that passed the quality gate for this model and lets
`engine/model/formats.py` measure which is fastest on this machine for each path; a fixed
format is served as asked, if its gate report allows it.
"""

from __future__ import annotations

import logging
import os

import torch

from engine.model.formats import FormatChoice, choose
from engine.model.heap import release_freed_memory
from engine.model.llama import NATIVE_FORMATS, LlamaModel
from engine.model.loader import read_checkpoint
from engine.quality.report import model_fingerprint
from engine.quality.require import eligible_formats, require_gate
from shared.modelfile.default import default_model_path

log = logging.getLogger(__name__)


def load_serving_model(
    path: str | os.PathLike | None,
    weights: str,
    device: str = "cpu",
    threads: int | None = None,
    kv_dtype: torch.dtype = torch.float32,
) -> tuple[LlamaModel, FormatChoice | None]:
    """`kv_dtype`: the pool the model will read (`auto` times each format over it)."""
    model_path = str(path) if path is not None else default_model_path()
    checkpoint = read_checkpoint(model_path)
    if weights != "auto":
        require_gate(weights, model=path)
        model = LlamaModel(checkpoint, weights=weights, device=device)  # type: ignore[arg-type]
        del checkpoint  # its fp32 tensors are garbage now that the model holds its formats
        release_freed_memory()
        return model, None
    eligible, refused = eligible_formats(path)
    if device != "cpu" or not checkpoint.config.is_plain_llama:
        # The native step is CPU-only and Llama-only: other families time torch formats only.
        eligible = [w for w in eligible if w not in NATIVE_FORMATS]
    choice = choose(checkpoint, eligible, model_fingerprint(model_path), threads, kv_dtype)
    log.info("weights auto: %s", choice.describe())
    for fmt, why in refused.items():
        log.info("weights auto: %s not eligible: %s", fmt, why)
    model = LlamaModel(
        checkpoint, weights=choice.prefill, decode_weights=choice.decode, device=device
    )
    del checkpoint
    release_freed_memory()
    return model, choice
