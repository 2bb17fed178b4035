"""The memory savers wired into config, engine and trainer: optim.name, memory.compress, metrics fields.

Tolerances: relu-mask is lossless (bit-identical); bf16 / int8 saved activations keep the training loss
within 5e-3 of the uncompressed fp32 run at every step of a 6-step run (measured: 1.4e-4 bf16,
1.0e-4 int8; docs/memory.md has a 40-step comparison).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from scaletrain.cli import main
from scaletrain.config import load_config, validate
from scaletrain.device.accounting import TensorPeak
from scaletrain.distributed.comm import CommStats
from scaletrain.distributed.mesh import Mesh, ParallelDims
from scaletrain.errors import ConfigError
from scaletrain.memory.compress import apply_compress_pass
from scaletrain.optim import state_bytes
from scaletrain.parallel.data_parallel import ReplicatedOptimizer
from scaletrain.parallel.engine import Engine
from scaletrain.train.trainer import Trainer

TINY = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.seq_len=32", "train.steps=6",
        "train.global_batch=4", "train.micro_batch=2", "train.eval_every=0", "train.warmup_steps=2",
        "train.lr=3e-3", "train.checkpoint_every=0"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.py


def train_cli(tmp_path, name: str, *sets: str) -> list[dict]:
    out = tmp_path / name
    argv = ["train", *(a for s in (*TINY, *sets) for a in ("--set", s)), "--out", str(out)]
    assert main(argv) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def expected_sum_of_dims_state(model: nn.Module, full_size: bool = False) -> int:
    """Adafactor / SM3 state from the shapes alone: n + m per n x m matrix, n per vector (fp32), plus
    a full-size buffer per parameter when a first moment is kept."""
    n = 0
    for p in model.parameters():  # distinct parameters: the tied embedding once
        n += sum(p.shape) if p.dim() == 2 else p.numel()
        n += p.numel() if full_size else 0
    return 4 * n


@pytest.mark.parametrize("name, sets, full_size", [
    ("adafactor", [], False),
    ("adafactor", ["optim.use_beta1=true"], True),
    ("sm3", [], False),
    ("sm3", ["optim.momentum=0.9"], True),
])
def test_memory_efficient_optimizers_train_from_the_cli_and_report_their_state(tmp_path, name, sets, full_size):
    rows = train_cli(tmp_path, name, f"optim.name={name}", *sets)
    cfg = validate(load_config(None, [*TINY, f"optim.name={name}", *sets]))
    model = Trainer(cfg).model
    assert rows[0]["mem_optim"] == expected_sum_of_dims_state(model, full_size)
    assert rows[-1]["loss"] < rows[0]["loss"]  # it learns


def test_mem_optim_is_the_optimizer_state_bytes_and_adamw_is_unchanged():
    for name in ("adamw", "adafactor", "sm3"):
        t = Trainer(validate(load_config(None, [*TINY, f"optim.name={name}"])))
        t.run(stop_after=1)
        assert t.memory()["mem_optim"] == state_bytes(t.engine.optimizer.opt)
        assert type(t.engine.optimizer.opt).__name__.lower() == name
    adam = 2 * 4 * sum(p.numel() for p in t.model.parameters())
    t = Trainer(validate(load_config(None, TINY)))
    t.run(stop_after=1)
    assert adam <= t.memory()["mem_optim"] <= adam + 4 * 64  # plus AdamW's step scalars


def test_optimizer_and_compression_config_errors_name_the_values():
    with pytest.raises(ConfigError, match="optim.name must be adamw, adafactor, sm3 or sgd, got 'lion'"):
        validate(load_config(None, ["optim.name=lion"]))
    validate(load_config(None, ["optim.name=sm3", "parallel.zero=1", "parallel.dp=2"]))  # runs under ZeRO
    validate(load_config(None, ["optim.name=sm3", "parallel.tp=2"]))  # and under tp (tests/test_compose.py)
    with pytest.raises(ConfigError, match="memory.compress mode fp4"):
        validate(load_config(None, ["memory.compress=fp4"]))
    with pytest.raises(ConfigError, match="one of bf16 and int8"):
        validate(load_config(None, ["memory.compress=bf16,int8"]))


def test_reduced_precision_compression_tracks_the_loss_and_logs_its_ratio(tmp_path):
    ref = train_cli(tmp_path, "none")
    # int8 in training: one fp32 scale per block of int8_block = 8 entries (d_model 32, 4 heads): 32/(8+4) per slot
    for mode, tol, lo, hi in (("bf16", 5e-3, 1.8, 2.0), ("int8", 5e-3, 2.2, 32 / 12)):
        rows = train_cli(tmp_path, mode, f"memory.compress={mode}")
        for a, b in zip(rows, ref):
            assert abs(a["loss"] - b["loss"]) <= tol, (mode, a["step"], a["loss"], b["loss"])
        first = rows[0]
        assert lo < first["compress_ratio"] < hi and lo < first[f"compress_ratio_{mode}"] <= hi
        # the activation counter sees the compressed size: exactly what compression removed is gone
        removed = first["compress_bytes_before"] - first["compress_bytes_after"]
        assert ref[0]["mem_activations"] - first["mem_activations"] == removed > 0


class ReluLM(nn.Module):
    """A small language model with ReLU MLPs (our GPT uses GELU, which relu-mask does not apply to)."""

    def __init__(self, vocab: int = 64, d: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.net = nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d), nn.LeakyReLU(0.1),
                                 nn.Linear(d, d), nn.ReLU6())
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(self.emb(idx)))


def relu_engine(compress: str) -> tuple[Engine, dict]:
    cfg = validate(load_config(None, [f"memory.compress={compress}"]))
    torch.manual_seed(0)
    engine = Engine(ReluLM().double())
    if compress != "none":
        apply_compress_pass(engine, cfg.memory.compress, cfg.model)
    params = list(engine.module.parameters())
    engine.optimizer = ReplicatedOptimizer.from_config(params, cfg.optim, cfg.parallel, cfg.train.lr,
                                                       Mesh.build(ParallelDims()), CommStats())
    g = torch.Generator().manual_seed(1)
    micro = [(torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g))
             for _ in range(2)]
    loss = engine.forward_backward(micro, 1.0)
    return engine, {"loss": loss, **{n: p.grad.clone() for n, p in engine.module.named_parameters()}}


def test_relu_mask_through_the_engine_is_bit_identical_and_counted():
    plain, ref = relu_engine("none")
    masked, got = relu_engine("relu-mask")
    assert sum(type(m).__name__ == "MaskedActivation" for m in masked.module.modules()) == 3
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    report = masked.memory_reports[0]()
    # one bit per entry for each of the 3 activations (ReLU output is still kept by the next Linear)
    masks = (4 * 16 * 128 + 4 * 16 * 32 + 4 * 16 * 32) // 8
    freed = 2 * 4 * 16 * 32 * 8  # LeakyReLU and ReLU6 inputs, which only they kept
    assert report["compress_bytes_after"] - report["compress_bytes_before"] == masks - freed
    assert masked.activation_bytes - plain.activation_bytes == masks - freed


def test_tensor_peak_counts_new_storages_once_until_they_are_freed():
    a = torch.randn(1000)  # existed before: never counted
    with TensorPeak() as peak:
        b = a * 2  # new: 4000 bytes
        view = b[10:]  # a view: same storage
        b.add_(1)  # in place: same storage
        c = torch.cat([b, view])  # new: 7960 bytes
        assert peak.live == 4000 + 7960
        del c
        assert peak.live == 4000
        a.mul_(3)
    assert peak.peak == 4000 + 7960
    del b, view
    assert peak.live == 0
