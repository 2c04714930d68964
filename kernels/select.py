"""Which attention kernel a device gets: Triton kernels on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import logging

import torch

from kernels.attention_kernel import AttentionKernel
from kernels.torch_attention import TorchPagedAttention

_log = logging.getLogger(__name__)


def attention_kernel_for(device: str | torch.device) -> AttentionKernel:
    device = torch.device(device)
    if device.type != "cuda":
        return TorchPagedAttention()
    try:
        # Imported only here: on a CPU host (or a CUDA host without Triton) nothing pulls it in.
        from kernels.triton_attention import TritonPagedAttention
    except ImportError as exc:
        _log.warning("Triton is unavailable (%s); CUDA attention falls back to torch", exc)
        return TorchPagedAttention()
    return TritonPagedAttention()
