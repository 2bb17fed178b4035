"""Accelerator catalog and cluster descriptions for the planner.

A `GPU` holds the few numbers the cost model needs: peak dense 16-bit (and FP8) matmul FLOP/s and the fractions
large GEMMs and the flash-attention kernel reach, memory, memory bandwidth, GPUs per node (on the fast fabric),
intra-node (NVLink) and inter-node (InfiniBand) bandwidth per GPU and a per-step latency for each, and the host
link used by offload. Every catalog entry names its source
(vendor datasheets). Bandwidths are unidirectional bytes/s per GPU; latencies are the alpha of the
alpha-beta model, in seconds per ring step (our assumption, not a datasheet value: NCCL's per-step
latencies are a few microseconds inside a node and around ten across InfiniBand).

A cluster can also come from a YAML file (`--cluster FILE`) with the same field names:

    gpu:
      name: my-gpu
      peak_flops: 312e12
      memory_bytes: 80e9
      hbm_bandwidth: 2.0e12
      gpus_per_node: 8
      intra_bw: 300e9
      inter_bw: 25e9
    gpus: 64          # optional; --gpus overrides it
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from scaletrain.errors import UserError
from scaletrain.guards import MAX_GPUS, load_yaml, non_finite_values, read_input, short, shown

GiB = 1 << 30


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float
    """Peak dense bf16/fp16 tensor-core FLOP/s (no sparsity)."""
    memory_bytes: float
    hbm_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    gpus_per_node: int
    """GPUs that share the fast intra-node fabric (NVLink / NVSwitch / Infinity Fabric): 8 in an HGX / DGX / MI300X
    node, 72 in a GB200 NVL72 rack."""
    intra_bw: float
    """Intra-node (NVLink/NVSwitch) bandwidth per GPU, one direction, bytes/s."""
    inter_bw: float
    """Inter-node (InfiniBand NIC share) bandwidth per GPU, one direction, bytes/s."""
    intra_latency: float = 3e-6
    inter_latency: float = 10e-6
    host_bw: float = 25e9
    """Host <-> device link (PCIe) per GPU, one direction, bytes/s: offload transfers."""
    gemm_efficiency: float = 0.80
    """Fraction of peak that large bf16 GEMMs reach (cuBLAS); the planner's main calibration constant."""
    source: str = ""
    fp8_flops: float = 0.0
    """Peak dense FP8 tensor-core FLOP/s (no sparsity); 0: no FP8 tensor cores (`--dtype fp8` is refused)."""
    fp8_gemm_efficiency: float = 0.0
    """Fraction of `fp8_flops` large FP8 GEMMs reach."""
    flash_efficiency: float = 0.0
    """Fraction of `peak_flops` the fused (flash) attention kernel reaches on the work it executes, forward and
    backward; 0: the GEMM efficiency (no measurement to go by)."""


# Sources: NVIDIA datasheets (V100, A100, H100 SXM / PCIe / NVL, H200, HGX/DGX B200, GB200 NVL72) and DGX system
# white papers for NVLink and per-node InfiniBand; AMD's MI300X data sheet. Memory in bytes as nvidia-smi reports it
# where known. Efficiencies: large bf16 GEMMs at 0.80 of peak on A100/V100 and 0.70 on H100 (the constants the
# Megatron-LM validation was run with, docs/planner-validation.md); the other GPUs scaled from H100 by the ratio of
# their Maximum Achievable Matmul FLOPS (MAMF: best-shape GEMM, mean of 100 iterations; S. Bekman, ml-engineering,
# compute/accelerator/README.md: A100 SXM 86.9%, H100 SXM 80.3% (H200 the same), B200 77.6%, GB200 72.9%, MI300X
# 51.4% of bf16 peak; FP8 H100 70.9%, H200 73.4%, B200 76.3%, GB200 72.3% of FP8 peak). The flash-attention kernel:
# FlashAttention-2 reaches 50-73% of peak on A100 (Dao, arXiv 2307.08691; we take 0.50 for forward and backward) and
# 35% on H100 (Shah et al., FlashAttention-3, arXiv 2407.08608); the Hopper value is assumed for newer GPUs.
_H100_GEMM = 0.70


def _mamf(ratio_to_h100: float) -> float:
    return round(_H100_GEMM * ratio_to_h100, 3)


CATALOG: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU(
            "v100-32gb", peak_flops=125e12, memory_bytes=32 * GiB, hbm_bandwidth=900e9, gpus_per_node=8,
            intra_bw=150e9, inter_bw=6.25e9, host_bw=12e9, gemm_efficiency=0.75,
            source="NVIDIA V100 datasheet: 125 TFLOPS fp16 tensor, 32 GB HBM2 900 GB/s, NVLink 300 GB/s "
            "(both directions); DGX-1: 4x100 Gb/s EDR IB per 8 GPUs; PCIe 3.0 x16; no FP8",
        ),
        GPU(
            "a100-40gb", peak_flops=312e12, memory_bytes=40 * GiB, hbm_bandwidth=1555e9, gpus_per_node=8,
            intra_bw=300e9, inter_bw=25e9, host_bw=25e9, flash_efficiency=0.50,
            source="NVIDIA A100 datasheet: 312 TFLOPS bf16 dense, 40 GB HBM2 1,555 GB/s, NVLink 600 GB/s "
            "(both directions); DGX A100: 8x200 Gb/s HDR IB per node; PCIe 4.0 x16; no FP8",
        ),
        GPU(
            "a100-80gb", peak_flops=312e12, memory_bytes=80 * GiB, hbm_bandwidth=2039e9, gpus_per_node=8,
            intra_bw=300e9, inter_bw=25e9, host_bw=25e9, flash_efficiency=0.50,
            source="NVIDIA A100 80GB SXM datasheet: 312 TFLOPS bf16 dense, 80 GB HBM2e 2,039 GB/s, NVLink "
            "600 GB/s (both directions); DGX A100 / Selene: 8x200 Gb/s HDR IB per node; PCIe 4.0 x16; no FP8",
        ),
        GPU(
            "h100-80gb", peak_flops=989e12, memory_bytes=81559 * (1 << 20), hbm_bandwidth=3350e9,
            gpus_per_node=8, intra_bw=450e9, inter_bw=50e9, host_bw=50e9, gemm_efficiency=_H100_GEMM,
            fp8_flops=1979e12, fp8_gemm_efficiency=_mamf(70.9 / 80.3), flash_efficiency=0.35,
            source="NVIDIA H100 SXM datasheet: 989 TFLOPS bf16 dense (1,979 with sparsity), 1,979 TFLOPS FP8 dense, "
            "80 GB HBM3 3.35 TB/s, NVLink 900 GB/s (both directions), 700 W; DGX H100: 8x400 Gb/s NDR IB; PCIe 5.0 "
            "x16",
        ),
        GPU(
            "h100-pcie", peak_flops=756e12, memory_bytes=80e9, hbm_bandwidth=2000e9, gpus_per_node=8,
            intra_bw=64e9, inter_bw=50e9, host_bw=64e9, gemm_efficiency=_H100_GEMM,
            fp8_flops=1513e12, fp8_gemm_efficiency=_mamf(70.9 / 80.3), flash_efficiency=0.35,
            source="NVIDIA H100 PCIe datasheet: 1,513 TFLOPS bf16 with sparsity (756 dense), 3,026 FP8 with sparsity "
            "(1,513 dense), 80 GB HBM2e 2 TB/s, 350 W; GPUs talk over PCIe 5.0 x16 (64 GB/s each way; NVLink bridges "
            "join pairs only and are not modelled); one 400 Gb/s NIC per GPU assumed",
        ),
        GPU(
            "h100-nvl", peak_flops=835e12, memory_bytes=94e9, hbm_bandwidth=3900e9, gpus_per_node=8,
            intra_bw=64e9, inter_bw=50e9, host_bw=64e9, gemm_efficiency=_H100_GEMM,
            fp8_flops=1670e12, fp8_gemm_efficiency=_mamf(70.9 / 80.3), flash_efficiency=0.35,
            source="NVIDIA H100 NVL datasheet: 1,671 TFLOPS bf16 with sparsity (835 dense), 3,341 FP8 with sparsity "
            "(1,670 dense), 94 GB HBM3 3.9 TB/s, 350-400 W, PCIe 5.0 x16 (NVLink bridges join pairs only and are not "
            "modelled); one 400 Gb/s NIC per GPU assumed",
        ),
        GPU(
            "h100-96gb", peak_flops=912e12, memory_bytes=96e9, hbm_bandwidth=2400e9, gpus_per_node=8,
            intra_bw=450e9, inter_bw=50e9, host_bw=64e9, gemm_efficiency=_H100_GEMM,
            fp8_flops=1824e12, fp8_gemm_efficiency=_mamf(70.9 / 80.3), flash_efficiency=0.35,
            source="H100 SXM with 96 GB HBM2e at its 500 W default power limit (Meta's Grand Teton, the torchtitan "
            "benchmarks: pytorch/torchtitan docs/performance.md: 96 GB HBM2e, 2.4 TB/s, NVLink between the 8 GPUs of "
            "a host, 400 Gb/s RDMA per GPU; its peak 'is between SXM and NVL, and we don't know its exact value'): "
            "the midpoint of H100 NVL's 835 and SXM's 989 TFLOPS bf16 dense, FP8 twice that",
        ),
        GPU(
            "h200", peak_flops=989e12, memory_bytes=141e9, hbm_bandwidth=4800e9, gpus_per_node=8,
            intra_bw=450e9, inter_bw=50e9, host_bw=50e9, gemm_efficiency=_H100_GEMM,
            fp8_flops=1979e12, fp8_gemm_efficiency=_mamf(73.4 / 80.3), flash_efficiency=0.35,
            source="NVIDIA H200 SXM datasheet: 989 TFLOPS bf16 dense, 1,979 FP8 dense, 141 GB HBM3e 4.8 TB/s, NVLink "
            "900 GB/s, 700 W; HGX H200 with 400 Gb/s NDR per GPU; PCIe 5.0 x16",
        ),
        GPU(
            "b200", peak_flops=2250e12, memory_bytes=180e9, hbm_bandwidth=8000e9, gpus_per_node=8,
            intra_bw=900e9, inter_bw=50e9, host_bw=50e9, gemm_efficiency=_mamf(77.6 / 80.3),
            fp8_flops=4500e12, fp8_gemm_efficiency=_mamf(76.3 / 80.3), flash_efficiency=0.35,
            source="NVIDIA HGX/DGX B200: 36 PFLOPS bf16 and 72 PFLOPS FP8 with sparsity per 8 GPUs (2.25 / 4.5 PFLOPS "
            "dense per GPU), 1,440 GB HBM3e per 8 GPUs, 8 TB/s per GPU, NVLink 5 1.8 TB/s (both directions), "
            "ConnectX-7 400 Gb/s per GPU, 1,000 W",
        ),
        GPU(
            "gb200", peak_flops=2500e12, memory_bytes=186e9, hbm_bandwidth=8000e9, gpus_per_node=72,
            intra_bw=900e9, inter_bw=50e9, host_bw=450e9, gemm_efficiency=_mamf(72.9 / 80.3),
            fp8_flops=5000e12, fp8_gemm_efficiency=_mamf(72.3 / 80.3), flash_efficiency=0.35,
            source="NVIDIA GB200 NVL72: 360 PFLOPS bf16 and 720 PFLOPS FP8 with sparsity per 72 GPUs (2.5 / 5 PFLOPS "
            "dense per GPU), 13.4 TB HBM3e per 72 GPUs (186 GB each) at 8 TB/s, NVLink 5 1.8 TB/s (both directions) "
            "among all 72 GPUs of a rack, NVLink-C2C to the Grace CPU 900 GB/s (both directions), 400 Gb/s NIC per "
            "GPU between racks",
        ),
        GPU(
            "mi300x", peak_flops=1307e12, memory_bytes=192e9, hbm_bandwidth=5300e9, gpus_per_node=8,
            intra_bw=448e9, inter_bw=50e9, host_bw=64e9, gemm_efficiency=_mamf(51.4 / 80.3),
            fp8_flops=2615e12, fp8_gemm_efficiency=_mamf(51.4 / 80.3 * 70.9 / 80.3), flash_efficiency=0.35,
            source="AMD Instinct MI300X data sheet: 1,307.4 TFLOPS bf16 dense, 2,614.9 FP8 dense, 192 GB HBM3 "
            "5.3 TB/s, 750 W; an 8-GPU platform with 7 Infinity Fabric links per GPU at 64 GB/s each way (448 GB/s), "
            "8x400 Gb/s per node; FP8 GEMM efficiency assumed to fall from bf16 as on H100 (no MAMF published)",
        ),
    )
}
ALIASES = {"v100": "v100-32gb", "a100": "a100-80gb", "h100": "h100-80gb", "h100-sxm": "h100-80gb",
           "h100-sxm-80gb": "h100-80gb", "h100-pcie-80gb": "h100-pcie", "h100-nvl-94gb": "h100-nvl",
           "h100-hbm2e": "h100-96gb", "h200-141gb": "h200", "b200-180gb": "b200", "gb200-nvl72": "gb200",
           "mi300x-192gb": "mi300x"}


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    n_gpus: int

    @property
    def n_nodes(self) -> int:
        return -(-self.n_gpus // self.gpu.gpus_per_node)

    def to_dict(self) -> dict:
        return {"gpu": dataclasses.asdict(self.gpu), "gpus": self.n_gpus, "nodes": self.n_nodes}


def get_gpu(name: str) -> GPU:
    key = name.lower()
    key = ALIASES.get(key, key)
    if key not in CATALOG:
        raise UserError(f"unknown GPU {name!r} (known: {', '.join(CATALOG)})")
    return CATALOG[key]


_FLOAT_FIELDS = {f.name for f in dataclasses.fields(GPU)} - {"name", "source", "gpus_per_node"}


def gpu_from_dict(data: dict, where: str) -> GPU:
    """A GPU from a mapping: either `base: a100-80gb` plus overrides, or every required field."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: 'gpu' must be a mapping, got {short(data)}")
    data = dict(data)
    base = data.pop("base", None)
    fields = dataclasses.asdict(get_gpu(str(base))) if base else {}
    known = {f.name for f in dataclasses.fields(GPU)}
    for key, value in data.items():
        if key not in known:
            raise UserError(f"{where}: unknown gpu field {key!r} (known: {', '.join(sorted(known))})")
        if key in _FLOAT_FIELDS:
            try:
                value = float(value)
            except (TypeError, ValueError, OverflowError):
                raise UserError(f"{where}: gpu.{key} must be a number, got {short(value)}") from None
            if not math.isfinite(value):
                raise UserError(f"{where}: gpu.{key} must be finite, got {value}")
            if value <= 0:
                raise UserError(f"{where}: gpu.{key} must be positive, got {value}")
        elif key == "gpus_per_node":
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_GPUS:
                raise UserError(f"{where}: gpu.gpus_per_node must be an integer in [1, {MAX_GPUS:,}], got "
                                f"{short(value)}")
        fields[key] = value
    fields.setdefault("name", "custom")
    missing = [f.name for f in dataclasses.fields(GPU)
               if f.name not in fields and f.default is dataclasses.MISSING]
    if missing:
        raise UserError(f"{where}: gpu is missing {', '.join(missing)} (or give base: <catalog name>)")
    return GPU(**fields)


def load_cluster(path: str | Path) -> tuple[GPU, int | None]:
    """Read a cluster YAML file: (gpu, gpus or None)."""
    p = Path(path)  # guards.py: FIFOs, link loops, non-UTF-8, duplicate keys, alias bombs, NaN and infinity
    data = load_yaml(read_input(p, "--cluster", "cluster file"), f"cluster file {shown(p)}")
    if not isinstance(data, dict) or "gpu" not in data:
        raise UserError(f"cluster file {shown(p)} must be a mapping with a 'gpu' section")
    bad = non_finite_values(data)
    if bad:
        raise UserError(f"cluster file {shown(p)}: {', '.join(bad)}: numbers must be finite, integers within 64 bits")
    gpus = data.get("gpus")
    if gpus is not None and (not isinstance(gpus, int) or isinstance(gpus, bool) or gpus <= 0 or gpus > MAX_GPUS):
        raise UserError(f"cluster file {shown(p)}: gpus must be an integer in [1, {MAX_GPUS:,}], got {short(gpus)}")
    return gpu_from_dict(data["gpu"], str(p)), gpus
