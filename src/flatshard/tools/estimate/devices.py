"""The hardware: peak FLOP/s, collective bandwidth and memory of one accelerator (or CPU core)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEVICES", "Device"]


@dataclass(frozen=True)
class Device:
    """Peak dense FLOP/s, collective bus bandwidth and memory of one accelerator."""

    name: str
    flops: dict[str, float]
    """Peak dense FLOP/s by compute dtype (``fp32`` without TF32, ``bf16``)."""
    intra_gbps: float
    """Bus bandwidth (GB/s, nccl-tests' busbw) within a node."""
    inter_gbps: float
    """Bus bandwidth (GB/s) per rank when a collective spans nodes."""
    per_node: int
    """Ranks per node."""
    memory_gib: float | None
    """Usable memory per rank; ``None``: no fit check."""
    mfu: float = 0.4
    """Default model FLOPs utilisation."""
    overlap: float = 0.9
    """Default share of the overlappable communication hidden under compute."""
    attention_speed: float = 1.0
    """Attention's counted FLOPs per second over the matmuls' (``efficiency.py``)."""
    hbm_tbps: float | None = None
    """Memory bandwidth (TB/s): below ``peak / hbm`` FLOPs per byte a matmul is memory-bound
    (``efficiency.gemm_slowdown``); ``None``: not modelled."""


# Peaks and HBM bandwidths: NVIDIA's datasheets (dense bf16: H100 SXM 989 TFLOP/s and 3.35 TB/s,
# H200 4.8 TB/s, A100 80 GB 312 TFLOP/s and 2.039 TB/s). ``mfu`` is the share
# of that peak the executed FLOPs of an eager bf16 step reach (efficiency.py); ``attention_speed``
# is flash attention's rate on PaLM's non-causal count over the matmuls' (it skips the masked
# half: 2 x, at about 3/4 of a large GEMM's rate; FlashAttention-2, Dao 2023: 50-73 % of A100
# peak, "close to the efficiency of GEMM").
DEVICES: dict[str, Device] = {
    # H100 SXM at 700 W; mfu 0.4, below the "up to 47 % MFU on H100 clusters" of Megatron-LM's
    # README (github.com/NVIDIA/Megatron-LM) for a step that is not tuned as theirs.
    "h100": Device(
        "h100", {"bf16": 989e12, "fp32": 67e12}, 360.0, 45.0, 8, 80.0, 0.4, 0.9, 1.5, 3.35
    ),
    "h200": Device(
        "h200", {"bf16": 989e12, "fp32": 67e12}, 360.0, 45.0, 8, 141.0, 0.4, 0.9, 1.5, 4.8
    ),
    # torchtitan's Grand Teton H100s (benchmarks/llama3_h100_202412_torchtitan.md): 96 GB HBM2e,
    # 500 W power limit, "peak between SXM and NVL", 400 Gb/s RDMA per GPU. mfu fitted to its
    # Table 1 eager row (Llama 3.1 8B, 8 GPUs: 5,762 tok/s), every other row a check.
    "h100-gt": Device(
        "h100-gt", {"bf16": 989e12, "fp32": 67e12}, 360.0, 45.0, 8, 89.4, 0.34, 0.9, 1.5, 2.4
    ),
    # torchtitan's A100 80 GB (docs/performance.md): mfu fitted to its Llama 3 rows (8B selective
    # op AC 2,973 tok/s, 70B full AC 331: 0.68 of peak counting the recomputation); Megatron-LM
    # sustains 0.52 of it end to end, communication and bubble included (Narayanan et al. 2021,
    # 163 TFLOP/s per GPU for the 1T model).
    "a100": Device(
        "a100", {"bf16": 312e12, "fp32": 19.5e12}, 230.0, 22.0, 8, 80.0, 0.68, 0.9, 1.5, 2.039
    ),
    # This 2-core box, one core per rank, Gloo over loopback; calibrated on the anchor GPT's
    # step (docs/performance.md), see docs/estimate.md. Gloo's threads share the cores: little
    # overlap.
    "cpu": Device("cpu", {"bf16": 3.7e11, "fp32": 1.6e11}, 0.7, 0.7, 64, None, 0.5, 0.3),
}
"""Defaults for ``--gpu``; every figure can be overridden on the command line."""
