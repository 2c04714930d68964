"""The draft file: what it holds, where it lives, and refusing files that do not fit the target.

Contents (one `torch.save` dict, read back with `weights_only=True` so a file can never run
code): format name and version, the DraftConfig, the state dict (stored in bf16: half the
bytes, and the draft's guesses barely move; it runs in fp32), the draft vocabulary (target ids),
the target tokenizer's fingerprint and vocabulary size, and training statistics.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.speculative.draft_model import DraftConfig, DraftModel

FORMAT_NAME = "splitserve-draft"
FORMAT_VERSION = 1
_REQUIRED = ("format", "version", "config", "state_dict", "vocab_ids", "target_fingerprint")
BUNDLED_DRAFTS = Path(__file__).parent / "drafts"
CACHE_DIR = Path("~/.cache/splitserve/drafts")


class DraftLoadError(ValueError):
    """A draft file is missing, corrupt, or was trained for another tokenizer/vocabulary."""


@dataclass
class DraftFile:
    config: DraftConfig
    state_dict: dict[str, torch.Tensor]
    vocab_ids: torch.Tensor  # [draft vocab] target ids, draft id i <-> target id vocab_ids[i]
    target_fingerprint: str
    target_vocab_size: int
    stats: dict

    def build_model(self) -> DraftModel:
        model = DraftModel(self.config)
        model.load_state_dict({k: v.float() for k, v in self.state_dict.items()})
        model.eval().requires_grad_(False)
        return model


def save_draft(
    path: str | Path,
    model: DraftModel,
    vocab_ids: torch.Tensor,
    target_fingerprint: str,
    target_vocab_size: int,
    stats: dict,
) -> Path:
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "config": model.config.to_dict(),
        "state_dict": {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()},
        "vocab_ids": vocab_ids.to(torch.int32),
        "target_fingerprint": target_fingerprint,
        "target_vocab_size": int(target_vocab_size),
        "stats": stats,
    }
    return save_payload(path, payload)


def save_payload(path: Path, payload: dict) -> Path:
    # Write then rename: a crash mid-save must not leave a truncated file the pool would load
    # (and a pool hot-swapping to this path never reads half a file).
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def load_payload(path: Path, format_name: str, what: str) -> dict:
    """The dict saved at `path` if it is a `format_name` file; DraftLoadError otherwise."""
    if not path.is_file():
        raise DraftLoadError(
            f"{path}: {what} file does not exist (train one: splitserve draft train)"
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a bad file; all mean "corrupt"
        raise DraftLoadError(f"{path}: not a readable {what} file ({type(exc).__name__})") from None
    if not isinstance(payload, dict) or payload.get("format") != format_name:
        raise DraftLoadError(f"{path}: not a splitserve {what} file")
    return payload


def read_draft(path: str | Path) -> DraftFile:
    path = Path(path).expanduser()
    payload = load_payload(path, FORMAT_NAME, "draft")
    if payload.get("version") != FORMAT_VERSION:
        raise DraftLoadError(
            f"{path}: draft format version {payload.get('version')!r}, this build reads "
            f"version {FORMAT_VERSION}; retrain it with splitserve draft train"
        )
    missing = [k for k in _REQUIRED if k not in payload]
    if missing:
        raise DraftLoadError(f"{path}: draft file lacks {', '.join(missing)}")
    try:
        config = DraftConfig.from_dict(payload["config"])
        vocab_ids = payload["vocab_ids"].long()
        result = DraftFile(
            config=config,
            state_dict=payload["state_dict"],
            vocab_ids=vocab_ids,
            target_fingerprint=str(payload["target_fingerprint"]),
            target_vocab_size=int(payload.get("target_vocab_size", -1)),
            stats=dict(payload.get("stats") or {}),
        )
        if vocab_ids.shape != (config.vocab_size,):
            raise ValueError("vocabulary map does not match the config")
        result.build_model()  # shape-checks every tensor now, not at the first proposal
    except (TypeError, ValueError, KeyError, RuntimeError, AttributeError) as exc:
        raise DraftLoadError(f"{path}: corrupt draft file ({exc})") from None
    return result


def check_compatible(draft: DraftFile, path: str | Path, fingerprint: str, vocab_size: int) -> None:
    check_vocabulary(
        path,
        draft.target_fingerprint,
        draft.target_vocab_size,
        draft.vocab_ids,
        fingerprint,
        vocab_size,
    )


def check_vocabulary(
    path: str | Path,
    trained_fingerprint: str,
    trained_vocab_size: int,
    vocab_ids: torch.Tensor,
    fingerprint: str,
    vocab_size: int,
) -> None:
    """A draft (model or head) fits a target only with the tokenizer it was trained for."""
    if trained_fingerprint != fingerprint or trained_vocab_size != vocab_size:
        raise DraftLoadError(
            f"{path}: the draft was trained for tokenizer {trained_fingerprint[:16]} "
            f"(vocab {trained_vocab_size}) but the target has tokenizer {fingerprint[:16]} "
            f"(vocab {vocab_size})"
        )
    if int(vocab_ids.max()) >= vocab_size:
        raise DraftLoadError(f"{path}: draft vocabulary has ids beyond the target's {vocab_size}")


def _model_stem(model_path: str | Path) -> str:
    path = Path(model_path)
    return path.name if path.is_dir() else path.stem


def trained_draft_path(model_path: str | Path) -> Path:
    """Where `splitserve draft train` writes the draft for a model: beside the model as
    `<model stem>.draft.pt` (for a HF folder: beside the folder), or, when that folder is not
    writable (a system-wide site-packages), `~/.cache/splitserve/drafts/<stem>.draft.pt`."""
    path = Path(model_path).expanduser().resolve()
    folder = path.parent
    name = f"{_model_stem(path)}.draft.pt"
    if os.access(folder, os.W_OK):
        return folder / name
    return CACHE_DIR.expanduser() / name


def draft_path_for(model_path: str | Path) -> Path:
    """The draft file the decode pool loads for `model_path`. One rule: the trained location
    (`trained_draft_path`) if a file is there, else the draft shipped with splitserve for the
    bundled model (engine/speculative/drafts/<stem>.draft.pt) if there is one, else the trained
    location (which then does not exist; loading it says so)."""
    trained = trained_draft_path(model_path)
    if trained.is_file():
        return trained
    bundled = BUNDLED_DRAFTS / trained.name
    return bundled if bundled.is_file() else trained
