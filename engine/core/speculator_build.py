"""Building the engine's speculator, loading the trained draft when the method wants one.

A draft that cannot be used (module absent, file missing, corrupt, or built for another
tokenizer) never stops the replica: it starts with model-free speculation and says why in its
log and in `spec_stats()["draft_unavailable"]`.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from engine.core.config import EngineConfig
from engine.core.speculator import Speculator
from engine.model.llama import LlamaModel
from engine.speculative.proposer import DraftProposer

log = logging.getLogger(__name__)


def build_speculator(
    config: EngineConfig,
    max_model_len: int,
    model_path: str | None,
    tokenizer_fingerprint: str,
    vocab_size: int,
    draft: DraftProposer | None = None,
    target: LlamaModel | None = None,
) -> Speculator:
    """``draft`` injects a ready proposer (tests, benchmarks) instead of loading one;
    ``target`` lends a draft head its embedding and output rows."""
    reason = None
    if draft is None and config.speculative_method in ("draft", "adaptive"):
        draft, reason = _load_draft(config, model_path, tokenizer_fingerprint, vocab_size, target)
        if reason is not None:
            log.warning("speculative decoding without a draft model (n-gram only): %s", reason)
    trees = target is not None and target.verifies_trees
    speculator = Speculator(config, max_model_len, draft, reason, trees)
    speculator.stats.draft_version = getattr(draft, "version", None)
    return speculator


def _load_draft(
    config: EngineConfig,
    model_path: str | None,
    fingerprint: str,
    vocab_size: int,
    target: LlamaModel | None,
) -> tuple[DraftProposer | None, str | None]:
    if importlib.util.find_spec("engine.speculative.draft_proposer") is None:
        return None, "the draft-model module (engine.speculative.draft_proposer) is not installed"
    from engine.speculative.draft_file import draft_path_for

    if config.draft_path is not None:
        path = Path(config.draft_path)
    else:
        if model_path is None:
            from shared.modelfile.default import default_model_path

            model_path = default_model_path()
        path = Path(draft_path_for(model_path))
    return load_draft_file(config, str(path), fingerprint, vocab_size, target, model_path)


def load_draft_file(
    config: EngineConfig,
    file: str,
    fingerprint: str,
    vocab_size: int,
    target: LlamaModel | None,
    model_path: str | None = None,
) -> tuple[DraftProposer | None, str | None]:
    """The draft (model or head) at `file` for this target, or None and why not."""
    from engine.speculative.draft_file import DraftLoadError
    from engine.speculative.draft_proposer import load_draft_proposer
    from engine.speculative.head_file import is_head_file
    from engine.speculative.head_load import load_head_proposer

    path = Path(file)
    if not path.is_file():
        return None, f"no draft file at {path} (train one with `splitserve draft train`)"
    if not fingerprint and model_path is not None and model_path.endswith(".gguf"):
        # An engine built without a tokenizer (workers leave text to the coordinator): the
        # draft is checked against the tokenizer stored in the model file itself.
        from shared.tokenizer import Tokenizer

        fingerprint = Tokenizer.from_gguf(model_path).fingerprint
    if is_head_file(path):
        if target is None:
            return None, f"{path}: a draft head needs the target model it reads"
        try:
            proposer = load_head_proposer(path, fingerprint, vocab_size, target)
            proposer.min_chain_confidence = config.draft_min_confidence
            proposer.tree_width = config.draft_tree_width
            proposer.tree_min_confidence = config.draft_tree_min_confidence
            return proposer, None
        except DraftLoadError as exc:
            return None, str(exc)
    try:
        proposer = load_draft_proposer(
            path, fingerprint, vocab_size, device=config.device, num_threads=config.num_threads
        )
    except DraftLoadError as exc:
        return None, str(exc)
    return proposer, None
