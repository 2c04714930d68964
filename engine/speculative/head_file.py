"""The draft-head file: the head's own weights only, bound to the target it was trained on.

One `torch.save` dict read back with `weights_only=True` (a file can never run code): format
name and version, the layer's DraftConfig, the state dict in bf16 (fc, layer, norm; the shared
embedding and output rows are the target's and are not stored), the head vocabulary as target
ids, the target tokenizer's fingerprint and vocabulary size, a version string (what stats and
/metrics report after a hot swap) and training statistics.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.speculative.draft_file import (
    DraftLoadError,
    check_vocabulary,
    load_payload,
    save_payload,
    trained_draft_path,
)
from engine.speculative.draft_model import DraftConfig
from engine.speculative.head_model import DraftHead

FORMAT_NAME = "splitserve-draft-head"
FORMAT_VERSION = 1


@dataclass
class HeadFile:
    config: DraftConfig
    state_dict: dict[str, torch.Tensor]
    vocab_ids: torch.Tensor
    target_fingerprint: str
    target_vocab_size: int
    version: str
    stats: dict

    def build_head(self) -> DraftHead:
        head = DraftHead(self.config)
        head.load_state_dict({k: v.float() for k, v in self.state_dict.items()})
        return head.eval().requires_grad_(False)


def head_version(state_dict: dict[str, torch.Tensor]) -> str:
    """A short content hash: two files with the same weights report the same version."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        digest.update(name.encode())
        digest.update(state_dict[name].to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:12]


def save_head(
    path: str | Path,
    head: DraftHead,
    vocab_ids: torch.Tensor,
    target_fingerprint: str,
    target_vocab_size: int,
    stats: dict,
) -> Path:
    state = {k: v.detach().to(torch.bfloat16) for k, v in head.state_dict().items()}
    payload = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "config": head.config.to_dict(),
        "state_dict": state,
        "vocab_ids": vocab_ids.to(torch.int32),
        "target_fingerprint": target_fingerprint,
        "target_vocab_size": int(target_vocab_size),
        "head_version": head_version(state),
        "stats": stats,
    }
    return save_payload(Path(path).expanduser(), payload)


def is_head_file(path: str | Path) -> bool:
    try:
        payload = torch.load(Path(path).expanduser(), map_location="cpu", weights_only=True)
    except Exception:  # unreadable files are read_draft's to report
        return False
    return isinstance(payload, dict) and payload.get("format") == FORMAT_NAME


def read_head(path: str | Path, fingerprint: str, vocab_size: int) -> HeadFile:
    """The head at `path`, checked against the target; DraftLoadError says why not."""
    path = Path(path).expanduser()
    payload = load_payload(path, FORMAT_NAME, "draft head")
    if payload.get("version") != FORMAT_VERSION:
        raise DraftLoadError(f"{path}: draft head format {payload.get('version')!r} unknown")
    try:
        head = HeadFile(
            config=DraftConfig.from_dict(payload["config"]),
            state_dict=payload["state_dict"],
            vocab_ids=payload["vocab_ids"].long(),
            target_fingerprint=str(payload["target_fingerprint"]),
            target_vocab_size=int(payload["target_vocab_size"]),
            version=str(payload["head_version"]),
            stats=dict(payload.get("stats") or {}),
        )
        if head.vocab_ids.shape != (head.config.vocab_size,):
            raise ValueError("vocabulary map does not match the config")
        head.build_head()  # shape-checks every tensor now, not at the first proposal
    except (TypeError, ValueError, KeyError, RuntimeError, AttributeError) as exc:
        raise DraftLoadError(f"{path}: corrupt draft head ({exc})") from None
    check_vocabulary(
        path,
        head.target_fingerprint,
        head.target_vocab_size,
        head.vocab_ids,
        fingerprint,
        vocab_size,
    )
    return head


def trained_head_path(model_path: str | Path) -> Path:
    """Where `splitserve draft train --from-log` writes a model's head: `<stem>.head.pt`
    where the draft would go (beside the model, or the user cache when that is read-only)."""
    draft = trained_draft_path(model_path)
    return draft.with_name(draft.name.removesuffix(".draft.pt") + ".head.pt")
