"""Building a serving draft head: the head file's weights plus the target's shared matrices."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.model.llama import LlamaModel
from engine.speculative.head_file import read_head
from engine.speculative.head_model import DraftHead
from engine.speculative.head_proposer import HeadDraftProposer


@torch.inference_mode()
def target_head_rows(target: LlamaModel, vocab_ids: torch.Tensor) -> torch.Tensor:
    """The decode path's output rows for `vocab_ids` [N, H], in fp32, read back through the
    head itself (logits of the identity): whatever the path's format (fp32, int4 groups,
    the native step's Q8_0 blocks), the head drafts with the very rows the target scores with."""
    hidden = target.config.hidden_size
    columns = target.logits(torch.eye(hidden, device=target.device), decode=True).float()
    return columns[:, vocab_ids].T.contiguous().cpu()


def attach(head: DraftHead, target: LlamaModel, vocab_ids: torch.Tensor) -> DraftHead:
    head.attach_target(target.embed_tokens, target_head_rows(target, vocab_ids))
    return head


def load_head_proposer(
    path: str | Path, fingerprint: str, vocab_size: int, target: LlamaModel
) -> HeadDraftProposer:
    """A head file made ready for `target`; DraftLoadError when it does not fit."""
    file = read_head(path, fingerprint, vocab_size)
    head = attach(file.build_head(), target, file.vocab_ids)
    return HeadDraftProposer(head, file.vocab_ids, vocab_size, version=file.version)
