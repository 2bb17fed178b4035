"""Which kernel `scaled_dot_product_attention` really runs for this run's attention, recorded once.

torch picks the SDPA backend per call from the device, dtype, shapes, dropout and what the build supports: on CUDA
FlashAttention-2 (Dao, arXiv 2307.08691), the memory-efficient kernel (Rabe & Staats, arXiv 2112.05682), cuDNN, or
the math fallback (softmax(QKᵀ/√d)V op by op, which stores the s×s scores); on CPU a flash-style kernel or the
math one. The choice is made below autograd, so `probe_sdpa` runs one call with the run's per-rank shapes, dtype
and dropout under a dispatch mode and names the attention op that reached the kernels: no guessing from
capability tables. With layout-independent dropout (`model.dropout_impl=global`, dropout > 0) the model computes
attention explicitly in training and SDPA does not run: the record says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

# substrings of aten attention ops -> backend name
KERNELS = (("flash", "flash"), ("efficient", "mem-efficient"), ("cudnn", "cudnn"), ("overrideable", "overrideable"))


@dataclass(frozen=True)
class AttentionRecord:
    backend: str  # flash | mem-efficient | cudnn | overrideable | math | explicit
    op: str  # the aten op that ran ("" for math and explicit)
    device: str
    dtype: str
    shape: tuple[int, int, int, int]  # (batch, heads on this rank, tokens, head size) of the probe
    dropout: float

    def line(self) -> str:
        where = f"{self.op}, " if self.op else ""
        b, h, t, d = self.shape
        how = ("explicit softmax(QKᵀ/√d)V (layout-independent dropout masks)" if self.backend == "explicit"
               else f"scaled_dot_product_attention -> {self.backend}")
        return f"attention: {how} ({where}{self.dtype} on {self.device}, {h} heads x {t} tokens x {d})"

    def to_dict(self) -> dict:
        return asdict(self)


class _AttentionOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket.__name__)
        if "attention" in name:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def backend_of(ops: list[str]) -> tuple[str, str]:
    """(backend, op) from the attention ops a call dispatched; no fused op means the math fallback ran."""
    for op in ops:
        for key, backend in KERNELS:
            if key in op:
                return backend, op
    return "math", ""


def probe_sdpa(device: torch.device, dtype: torch.dtype, heads: int, seq_len: int, head_dim: int,
               dropout: float = 0.0, explicit: bool = False, kv_heads: int = 0) -> AttentionRecord:
    """Run one causal SDPA call (batch 1, inputs requiring grad, as in training) and record its kernel; `kv_heads`
    fewer than `heads` (grouped-query attention) calls it with enable_gqa, as the model does."""
    shape = (1, heads, seq_len, head_dim)
    name = str(dtype).removeprefix("torch.")
    if explicit:
        return AttentionRecord("explicit", "", str(device), name, shape, dropout)
    q = torch.zeros(shape, device=device, dtype=dtype, requires_grad=True)  # values do not steer the choice
    kv = q if not kv_heads or kv_heads == heads else \
        torch.zeros((1, kv_heads, seq_len, head_dim), device=device, dtype=dtype, requires_grad=True)
    rec = _AttentionOps()
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad(), rec:  # dropout draws leave no trace
        F.scaled_dot_product_attention(q, kv, kv, is_causal=True, dropout_p=dropout, enable_gqa=kv is not q)
    backend, op = backend_of(rec.ops)
    return AttentionRecord(backend, op, str(device), name, shape, dropout)


def probe_run(cfg, device: torch.device, param_dtype: torch.dtype) -> AttentionRecord:
    """The record for a run config: per-rank heads (and key/value heads) under tensor parallelism, the autocast
    dtype if any."""
    from scaletrain.config.sizes import kv_heads
    from scaletrain.device.dtypes import autocast_dtype

    m, tp = cfg.model, cfg.parallel.tp
    dtype = autocast_dtype(cfg) or param_dtype
    explicit = m.dropout > 0 and m.dropout_impl == "global"
    dropout = m.dropout if m.dropout_impl == "torch" else 0.0
    p = cfg.parallel
    kv = kv_heads(m) // min(tp, kv_heads(m))  # a key/value head copied on tp / kv ranks when tp is larger
    heads, tokens = m.n_heads // tp, m.seq_len
    if p.cp > 1 and p.cp_mode == "ulysses":  # after its all-to-all a rank attends all tokens of 1/cp of the heads
        heads, kv = heads // p.cp, max(1, kv // p.cp)
    elif p.cp > 1:  # ring attention: blocks of a rank's chunks, with the flash kernel's op (explicit with dropout)
        tokens //= p.cp
    return probe_sdpa(device, dtype, heads, tokens, m.d_model // m.n_heads, dropout, explicit, kv)
