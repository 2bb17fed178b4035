"""Accelerator catalog and cluster descriptions for the planner.

A `GPU` holds the few numbers the cost model needs: peak dense 16-bit matmul FLOP/s, memory, memory
bandwidth, GPUs per node, intra-node (NVLink) and inter-node (InfiniBand) bandwidth per GPU and a
per-step latency for each, and the host link used by offload. Every catalog entry names its source
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


# Sources: NVIDIA datasheets (V100, A100, H100, H200, HGX/DGX B200) and DGX system architecture white
# papers for NVLink and per-node InfiniBand. Memory in bytes as nvidia-smi reports it where known.
CATALOG: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU(
            "v100-32gb", peak_flops=125e12, memory_bytes=32 * GiB, hbm_bandwidth=900e9, gpus_per_node=8,
            intra_bw=150e9, inter_bw=6.25e9, host_bw=12e9, gemm_efficiency=0.75,
            source="NVIDIA V100 datasheet: 125 TFLOPS fp16 tensor, 32 GB HBM2 900 GB/s, NVLink 300 GB/s "
            "(both directions); DGX-1: 4x100 Gb/s EDR IB per 8 GPUs; PCIe 3.0 x16",
        ),
        GPU(
            "a100-40gb", peak_flops=312e12, memory_bytes=40 * GiB, hbm_bandwidth=1555e9, gpus_per_node=8,
            intra_bw=300e9, inter_bw=25e9, host_bw=25e9,
            source="NVIDIA A100 datasheet: 312 TFLOPS bf16 dense, 40 GB HBM2 1,555 GB/s, NVLink 600 GB/s "
            "(both directions); DGX A100: 8x200 Gb/s HDR IB per node; PCIe 4.0 x16",
        ),
        GPU(
            "a100-80gb", peak_flops=312e12, memory_bytes=80 * GiB, hbm_bandwidth=2039e9, gpus_per_node=8,
            intra_bw=300e9, inter_bw=25e9, host_bw=25e9,
            source="NVIDIA A100 80GB SXM datasheet: 312 TFLOPS bf16 dense, 80 GB HBM2e 2,039 GB/s, NVLink "
            "600 GB/s (both directions); DGX A100 / Selene: 8x200 Gb/s HDR IB per node; PCIe 4.0 x16",
        ),
        GPU(
            "h100-80gb", peak_flops=989e12, memory_bytes=81559 * (1 << 20), hbm_bandwidth=3350e9,
            gpus_per_node=8, intra_bw=450e9, inter_bw=50e9, host_bw=50e9, gemm_efficiency=0.70,
            source="NVIDIA H100 SXM datasheet: 989 TFLOPS bf16 dense (1,979 with sparsity), 80 GB HBM3 "
            "3.35 TB/s, NVLink 900 GB/s (both directions); DGX H100: 8x400 Gb/s NDR IB; PCIe 5.0 x16",
        ),
        GPU(
            "h200", peak_flops=989e12, memory_bytes=141e9, hbm_bandwidth=4800e9, gpus_per_node=8,
            intra_bw=450e9, inter_bw=50e9, host_bw=50e9, gemm_efficiency=0.70,
            source="NVIDIA H200 SXM datasheet: 989 TFLOPS bf16 dense, 141 GB HBM3e 4.8 TB/s, NVLink "
            "900 GB/s; HGX H200 with 400 Gb/s NDR per GPU; PCIe 5.0 x16",
        ),
        GPU(
            "b200", peak_flops=2250e12, memory_bytes=180e9, hbm_bandwidth=8000e9, gpus_per_node=8,
            intra_bw=900e9, inter_bw=50e9, host_bw=50e9, gemm_efficiency=0.70,
            source="NVIDIA HGX/DGX B200: 36 PFLOPS bf16 with sparsity per 8 GPUs (2.25 PFLOPS dense per "
            "GPU), 1,440 GB HBM3e per 8 GPUs, 8 TB/s per GPU, NVLink 5 1.8 TB/s (both directions), "
            "ConnectX-7 400 Gb/s per GPU",
        ),
    )
}
ALIASES = {"v100": "v100-32gb", "a100": "a100-80gb", "h100": "h100-80gb", "h100-sxm": "h100-80gb",
           "h200-141gb": "h200", "b200-180gb": "b200"}


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
