"""The token embedding: rows looked up by token id, held as the checkpoint holds them.

SmolLM2's GGUF stores the embedding (tied to the output head) as Q8_0 blocks. Kept as fp32
it was 108 MiB of a worker's resident memory; kept in its blocks it is 29 MiB, shared with
the native head, and a lookup dequantizes only the rows it returns. The rows are the same
bits as the fp32 copy: one fp32 product of the block's scale and each int8, exactly how the
loader dequantizes the file.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.hostmem.huge_pages import copy_array
from engine.model.gguf_file import Checkpoint

QK = 32  # elements per Q8_0 block


class TokenEmbedding:
    def __init__(
        self,
        dense: torch.Tensor | None = None,
        quants: np.ndarray | None = None,  # int8 [vocab, hidden / 32, 32]
        scales: np.ndarray | None = None,  # fp32 [vocab, hidden / 32]
    ):
        if (dense is None) == (quants is None):
            raise ValueError("an embedding is either dense or Q8_0 blocks")
        self.dense = dense
        self.quants = quants
        self.scales = scales
        if quants is not None:
            assert scales is not None
            self._quants = torch.from_numpy(quants)
            self._scales = torch.from_numpy(scales)
            self.num_rows, blocks, _ = quants.shape
            self.hidden_size = blocks * QK
        else:
            assert dense is not None
            self.num_rows, self.hidden_size = dense.shape

    @classmethod
    def from_checkpoint(
        cls, checkpoint: Checkpoint, device: torch.device, keep_blocks: bool
    ) -> TokenEmbedding:
        """Q8_0 blocks where the file has them, the device is a CPU and `keep_blocks` (the
        caller holds no other fp32 copy, e.g. a tied torch head); fp32 otherwise."""
        blocks = checkpoint.q8_0_blocks.get("embed_tokens")
        if blocks is None or device.type != "cpu" or not keep_blocks:
            return cls(dense=checkpoint.tensors["embed_tokens"].to(device))
        # On huge pages: a tied head streams all of these every step.
        quants = copy_array(blocks[..., 2:34].view(np.int8))
        raw = np.ascontiguousarray(blocks[..., 0:2])
        scales = copy_array(raw.view(np.float16)[..., 0].astype(np.float32))
        return cls(quants=quants, scales=scales)

    @property
    def quantized(self) -> bool:
        return self.quants is not None

    @property
    def nbytes(self) -> int:
        if self.dense is not None:
            return self.dense.numel() * self.dense.element_size()
        assert self.quants is not None and self.scales is not None
        return self.quants.nbytes + self.scales.nbytes

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 rows [*ids.shape, hidden] of these token ids."""
        if self.dense is not None:
            return self.dense[ids]
        ids = torch.as_tensor(ids, dtype=torch.long)
        rows = self._quants[ids].float() * self._scales[ids].unsqueeze(-1)
        return rows.reshape(*ids.shape, self.hidden_size)
