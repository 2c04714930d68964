"""Published peak figures of the accelerators and links an analytic profile can be derived for.

Dense (no 2:4 sparsity) 16-bit tensor-core throughput, HBM/GDDR bandwidth and capacity per
GPU, each from the vendor's datasheet named beside it. Peaks, not what an engine reaches:
`analytic.Efficiency` says how much of each a serving engine is taken to get.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuDatasheet:
    key: str
    name: str
    bf16_tflops: float  # dense
    memory_gb_s: float
    memory_gb: float
    # GPU-to-GPU link inside a node (tensor parallel all-reduce, same-node KV push), per
    # direction: half the datasheet's bidirectional figure.
    nvlink_gb_s: float
    source: str

    @property
    def flops_per_ms(self) -> float:
        return self.bf16_tflops * 1e9

    @property
    def bytes_per_ms(self) -> float:
        return self.memory_gb_s * 1e6


GPUS: dict[str, GpuDatasheet] = {
    g.key: g
    for g in (
        # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): BF16 312 TFLOPS (624 with
        # sparsity), 2,039 GB/s HBM2e, NVLink 600 GB/s bidirectional.
        GpuDatasheet(
            "a100",
            "NVIDIA A100-SXM4-80GB",
            312.0,
            2039.0,
            80.0,
            300.0,
            "NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf)",
        ),
        # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): BF16 1,979 TFLOPS with sparsity
        # (989.5 dense), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s bidirectional.
        GpuDatasheet(
            "h100",
            "NVIDIA H100 80GB HBM3",
            989.5,
            3350.0,
            80.0,
            450.0,
            "NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column)",
        ),
        # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): BF16 1,979 TFLOPS with sparsity
        # (989.5 dense; the same GH100 compute as H100), 141 GB HBM3e at 4.8 TB/s, NVLink
        # 900 GB/s bidirectional.
        GpuDatasheet(
            "h200",
            "NVIDIA H200",
            989.5,
            4800.0,
            141.0,
            450.0,
            "NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column)",
        ),
        # NVIDIA HGX B200 (1,000 W configuration): BF16 2.25 PFLOPS dense (4.5 sparse) per
        # GPU, 8 TB/s HBM3e; the DGX B200 datasheet's 1,440 GB over 8 GPUs is 180 GB each;
        # NVLink 5 1.8 TB/s bidirectional. (NVIDIA DGX B200 datasheet; per-GPU dense table in
        # glennklockwood.com/garden/processors/B200 from NVIDIA's Blackwell technical brief.)
        GpuDatasheet(
            "b200",
            "NVIDIA B200",
            2250.0,
            8000.0,
            180.0,
            900.0,
            "NVIDIA DGX B200 datasheet; Blackwell technical brief (HGX B200, 1,000 W)",
        ),
        # NVIDIA L40S datasheet: BF16 362.05 TFLOPS (733 with sparsity), 48 GB GDDR6 at
        # 864 GB/s; no NVLink: PCIe Gen4 x16, 64 GB/s bidirectional.
        GpuDatasheet(
            "l40s",
            "NVIDIA L40S",
            362.05,
            864.0,
            48.0,
            32.0,
            "NVIDIA L40S datasheet",
        ),
    )
}


@dataclass(frozen=True)
class LinkDatasheet:
    key: str
    gb_s: float  # per direction
    latency_ms: float  # a push's fixed cost: handshake and descriptor exchange
    source: str


# What a KV push between a prefill and a decode replica crosses. The fixed cost is the
# project's own: the transfer control plane's round trips (a gRPC handshake and completion),
# taken as the shm backend's measured latency in the shipped profile (0.7 ms), rounded up.
LINKS: dict[str, LinkDatasheet] = {
    link.key: link
    for link in (
        # Same node: the GPUs' NVLink (per-GPU figure from the GPU's datasheet).
        LinkDatasheet("nvlink", 0.0, 1.0, "the GPU's NVLink figure (GPUS[...].nvlink_gb_s)"),
        # Across nodes: one NDR InfiniBand port per GPU, 400 Gb/s = 50 GB/s (NVIDIA
        # ConnectX-7 datasheet), as DGX H100/H200/B200 nodes have.
        LinkDatasheet("ib400", 50.0, 1.0, "NVIDIA ConnectX-7 datasheet: 400 Gb/s NDR per port"),
        # Across nodes on Ethernet: 100 Gb/s = 12.5 GB/s.
        LinkDatasheet("eth100", 12.5, 1.0, "IEEE 802.3 100GBASE: 100 Gb/s"),
    )
}


def link_gb_s(link: LinkDatasheet, gpu: GpuDatasheet, tp: int) -> float:
    """Per replica: NVLink is per GPU and a TP replica's shards move in parallel; one NIC per
    GPU likewise."""
    per_gpu = gpu.nvlink_gb_s if link.key == "nvlink" else link.gb_s
    return per_gpu * tp


def gpu_key_for_name(name: str) -> str | None:
    """A GPU's table key from a device name as torch reports it ('NVIDIA H200' -> 'h200')."""
    lowered = name.lower()
    for key in GPUS:
        if key in lowered.replace("-", " ").split() or key in lowered:
            return key
    return None


@dataclass(frozen=True)
class GpuPrice:
    usd_per_gpu_hour: float
    source: str


_SPHERON = "spheron.network/blog/nvidia-h200-vs-b200-vs-gb200"
# On-demand list prices per GPU-hour, for cost per million tokens; `--gpu-hour-usd` overrides.
GPU_HOUR_PRICES: dict[str, GpuPrice] = {
    "h200": GpuPrice(
        4.54,
        "Spheron on-demand H200 SXM, 17 March 2026 (" + _SPHERON + ")",
    ),
    "b200": GpuPrice(
        6.03,
        "Spheron on-demand B200 SXM, 17 March 2026 (" + _SPHERON + ")",
    ),
}
