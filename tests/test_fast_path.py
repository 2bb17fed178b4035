"""The GPU fast path, unit by unit on CPU: precision and compile settings, host synchronisations per step, the
optimizer kernels, the SDPA backend record, step timing and CUDA memory fields (with fakes for what needs CUDA),
and the trainer against a plain torch loop in fp64."""

import math

import pytest
import torch
import torch.nn.functional as F
from harness import TINY, make_config

from scaletrain.config import load_config, validate
from scaletrain.data import BatchLoader, load_tokens
from scaletrain.device.attention import backend_of, probe_run, probe_sdpa
from scaletrain.device.cuda_memory import cuda_memory_fields, planned_total
from scaletrain.device.kernels import adamw_kernel
from scaletrain.device.sync import HostSyncs
from scaletrain.device.timing import StepTimer
from scaletrain.errors import ConfigError
from scaletrain.model import build_gpt
from scaletrain.train.schedule import lr_at
from scaletrain.train.trainer import Trainer, TrainingDiverged

pytestmark = pytest.mark.usefixtures("one_thread")

# ----------------------------------------------------------------------------- settings


@pytest.mark.parametrize("sets, words", [
    (["train.precision=autocast-fp8"], ["train.precision", "autocast-fp8"]),
    (["train.precision=autocast-bf16", "train.dtype=bf16"], ["autocast-bf16", "train.dtype=bf16"]),
    (["train.precision=autocast-bf16", "model.moe.experts=4"], ["autocast-bf16", "model.moe.experts=4"]),
    (["train.compile=true", "parallel.tp=2"], ["train.compile=true", "parallel.tp=2"]),
    (["train.compile=true", "parallel.pp=2", "parallel.schedule=zb-h1", "train.micro_batch=2"],
     ["train.compile=true", "parallel.schedule=zb-h1"]),
    (["train.compile=true", "model.moe.experts=4"], ["model.moe.experts=4"]),
    (["train.compile=true", "model.dropout=0.1"], ["model.dropout=0.1"]),
    (["train.compile=true", "memory.compress=int8"], ["memory.compress=int8"]),
    (["train.compile=true", "memory.offload_activations=true"], ["memory.offload_activations=True"]),
    (["train.precision=autocast-bf16", "model.reversible=true"], ["autocast-bf16", "model.reversible=True"]),
    (["train.precision=autocast-bf16", "memory.contiguous=true"], ["autocast-bf16", "memory.contiguous=True"]),
    (["train.compile=true", "model.reversible=true"], ["train.compile=true", "model.reversible=True"]),
    (["train.compile=true", "memory.contiguous=true"], ["train.compile=true", "memory.contiguous=True"]),
    (["train.precision=autocast-bf16", "parallel.tp=4", "parallel.tp_mode=2d"], ["autocast-bf16", "tp_mode=2d"]),
], ids=["precision value", "autocast needs fp32", "autocast moe", "compile tp", "compile zb-h1", "compile moe",
        "compile dropout", "compile compress", "compile offload", "autocast reversible", "autocast contiguous",
        "compile reversible", "compile contiguous", "autocast tp_mode"])
def test_refused_settings_name_their_values(sets, words):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, sets))
    assert "\n" not in str(e.value)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_cli_refusal_is_one_line_and_exit_2(capsys):
    from scaletrain.cli import main

    code = main(["config", "show", "--set", "train.precision=autocast-bf16", "--set", "train.dtype=fp16"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "train.dtype=fp16" in err, err


def test_existing_configs_mean_the_same():
    """The defaults: parameters and compute in train.dtype (fp32), no compile; bf16 keeps its fp32 masters."""
    cfg = validate(load_config(None, []))
    assert (cfg.train.precision, cfg.train.compile, cfg.train.dtype) == ("dtype", False, "fp32")
    t = Trainer(make_config({**TINY, "train.dtype": "bf16", "train.steps": 1}))
    assert next(t.model.parameters()).dtype == torch.bfloat16 and t.engine.optimizer.masters is not None
    assert not hasattr(t.model.forward, "_st_autocast")


def test_autocast_keeps_fp32_state_and_computes_matmuls_in_bf16():
    t = Trainer(make_config({**TINY, "train.dtype": "fp32", "train.precision": "autocast-bf16", "train.steps": 1}))
    seen = {}
    t.model.blocks[0].attn.qkv.register_forward_hook(lambda m, i, o: seen.setdefault("qkv", o.dtype) and None)
    t.model.blocks[0].ln1.register_forward_hook(lambda m, i, o: seen.setdefault("ln1", o.dtype) and None)
    row = t.train_step(1)
    assert seen == {"qkv": torch.bfloat16, "ln1": torch.float32}
    opt = t.engine.optimizer
    assert opt.masters is None and all(p.dtype == torch.float32 for p in t.model.parameters())
    assert all(g.dtype == torch.float32 for g in opt.reducer.grad_tensors())
    assert isinstance(row["loss"], float) and isinstance(row["grad_norm"], float)



@pytest.mark.parametrize("overrides", [
    {"train.precision": "autocast-bf16", "train.dtype": "fp32"},
    {"train.dtype": "fp16"},  # the skip flags: the loss's and the gradients' as one device tensor
    {"train.on_nan": "skip"},
], ids=["autocast-bf16", "fp16", "on_nan=skip"])
def test_nvme_offload_equals_in_memory_zero3_bit_for_bit(overrides):
    """ZeRO-Infinity streams the same AdamW pieces as in-memory ZeRO-3, and reports its overflow flag the same way."""
    base = {**TINY, **overrides, "train.steps": 3, "parallel.zero": 3}
    runs = []
    for extra in ({}, {"parallel.offload": "nvme"}):
        t = Trainer(make_config({**base, **extra}))
        runs.append((t.run().losses, t.full_state()))
    (memory, memory_state), (nvme, nvme_state) = runs
    assert memory == nvme and len(memory) == 3
    for name, value in memory_state.items():
        assert torch.equal(value, nvme_state[name]), name

# ----------------------------------------------------------------------------- the trainer against plain torch


def _plain_torch_run(cfg):
    """A hand-written loop with torch's own AdamW (single-tensor) and clip_grad_norm_: losses and parameters."""
    t, o, m = cfg.train, cfg.optim, cfg.model
    torch.manual_seed(0)
    model = build_gpt(m, t.seed, "cpu", torch.float64)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=t.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)
    loader = BatchLoader(load_tokens(cfg.data.source, cfg.data.cache_dir), m.seq_len, t.global_batch, t.seed)
    losses = {}
    for step in range(1, t.steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, t)
        x, y = loader.global_batch_at(step)
        total = 0.0
        for xm, ym in zip(x.split(t.micro_batch), y.split(t.micro_batch)):
            loss = F.cross_entropy(model(xm).flatten(0, 1), ym.flatten(), reduction="sum") / cfg.tokens_per_step
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        opt.zero_grad()
        losses[step] = total
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def test_trainer_equals_a_plain_torch_loop_in_fp64():
    """Same losses and parameters as torch's single-tensor AdamW and clip_grad_norm_ (the trainer: foreach AdamW,
    clipping by a device-side coefficient). Tolerance 1e-12: fp64 with the summation orders of the kernels; the
    clip threshold 0.3 (norms 1.3-2.7) makes clipping act on every step."""
    cfg = make_config({**TINY, "train.grad_clip": 0.3, "train.steps": 4})
    trainer = Trainer(cfg)
    losses = trainer.run().losses
    ref_losses, ref_params = _plain_torch_run(cfg)
    for s in ref_losses:
        assert abs(losses[s] - ref_losses[s]) <= 1e-12 * ref_losses[s], (s, losses[s], ref_losses[s])
    state = trainer.full_state()
    for n, p in ref_params.items():
        torch.testing.assert_close(state[n], p, rtol=1e-12, atol=1e-12, msg=n)


# ----------------------------------------------------------------------------- host synchronisations


def _count_syncs(overrides: dict) -> tuple[dict, list]:
    cfg = make_config({**TINY, "train.dtype": "fp32", "train.steps": 6, "train.log_every": 3, **overrides})
    t = Trainer(cfg)
    t.train_step(1)  # the first step measures memory (reads byte counts once): outside the count
    t.step = 1
    steps = {}
    with HostSyncs(label=lambda: t.step) as syncs:
        syncs.exclude(v for s in _opt_states(t) for k, v in s.items() if k == "step")  # host tensors (not fused)
        t.run()
    for e in syncs.events:
        steps.setdefault(e.label, []).append(e)
    return steps, syncs.events


def _opt_states(t):
    opt = t.engine.optimizer
    inner = getattr(opt, "opt", None)
    return list(inner.state.values()) if inner is not None else []


@pytest.mark.parametrize("overrides", [{}, {"train.precision": "autocast-bf16"},
                                       {"parallel.zero": 2, "train.micro_batch": 4}],
                         ids=["fp32", "autocast-bf16", "zero2"])
def test_a_step_reads_nothing_from_the_device_until_its_log_line(overrides):
    """Steps 2-6 with train.log_every=3: steps 2, 4 and 5 read no tensor value; steps 3 and 6 (logged) read once,
    the stacked loss and gradient norm of the steps since the last read (docs/gpu.md)."""
    by_step, events = _count_syncs(overrides)
    where = {s: [(e.what, e.where) for e in ev] for s, ev in by_step.items()}
    assert set(by_step) == {3, 6}, where
    assert all(len(ev) == 1 and ev[0].what == "tolist" for ev in by_step.values()), where


def test_the_sync_count_catches_a_read_inside_the_step():
    """The counter is not blind: the old per-step `loss.item()` shows up on every step."""
    cfg = make_config({**TINY, "train.dtype": "fp32", "train.steps": 3})
    t = Trainer(cfg)
    t.train_step(1)
    t.step = 1
    forward_backward = t.engine.forward_backward

    def reading(micro, scale):
        total = forward_backward(micro, scale)
        total.item()  # the regression: a read inside the step
        return total

    t.engine.forward_backward = reading
    with HostSyncs(label=lambda: t.step) as syncs:
        syncs.exclude(v for s in _opt_states(t) for k, v in s.items() if k == "step")
        t.run()
    assert {e.label for e in syncs.events if e.what == "_local_scalar_dense"} == {2, 3}


def test_nan_under_on_nan_stop_is_found_at_the_read_and_names_its_step():
    cfg = make_config({**TINY, "train.dtype": "fp32", "train.steps": 6, "train.log_every": 3})
    t = Trainer(cfg)
    t.model.blocks[0].ln1.register_forward_hook(lambda m, i, o: o * math.nan if t.step == 2 else o)
    with pytest.raises(TrainingDiverged, match=r"loss is nan at step 2 \(seen on rank 0\)"):
        t.run()
    assert t.step == 3  # found with the log line of step 3, before any checkpoint could hold the NaN


# ----------------------------------------------------------------------------- kernels, attention, timing, memory


def test_adamw_is_fused_on_cuda_and_foreach_elsewhere():
    assert adamw_kernel([torch.empty(1, device="meta")]) == {"foreach": True}
    assert adamw_kernel([torch.empty(1)]) == {"foreach": True}

    class FakeCuda:
        device = torch.device("cuda", 1)

    assert adamw_kernel([FakeCuda(), FakeCuda()]) == {"fused": True}
    assert adamw_kernel([FakeCuda(), torch.empty(1)]) == {"foreach": True}  # ZeRO-Offload: host masters
    for zero in (0, 2):
        t = Trainer(make_config({**TINY, "parallel.zero": zero, "train.steps": 1}))
        assert t.engine.optimizer.opt.defaults["foreach"] is True


def test_sdpa_backend_record_names_the_kernel_that_ran():
    cpu = torch.device("cpu")
    assert probe_sdpa(cpu, torch.float32, 4, 32, 8).backend == "flash"  # CPU's flash-style kernel
    assert probe_sdpa(cpu, torch.float32, 4, 32, 8, dropout=0.1).backend == "math"  # no fused CPU dropout
    cfg = make_config({**TINY, "model.dropout": 0.1})
    assert probe_run(cfg, cpu, torch.float64).backend == "explicit"  # layout-independent masks: no SDPA
    rec = probe_run(make_config({**TINY, "parallel.tp": 2, "train.precision": "autocast-bf16",
                                 "train.dtype": "fp32"}), cpu, torch.float32)
    assert (rec.dtype, rec.shape) == ("bfloat16", (1, 2, 32, 8)) and "flash" in rec.line()
    assert backend_of(["_scaled_dot_product_flash_attention"]) == ("flash", "_scaled_dot_product_flash_attention")
    assert backend_of(["_scaled_dot_product_efficient_attention"])[0] == "mem-efficient"
    assert backend_of(["_scaled_dot_product_cudnn_attention"])[0] == "cudnn"
    assert backend_of([]) == ("math", "")


class _FakeEvent:
    clock = 0.0

    def __init__(self, enable_timing=False):
        self.t, self.synced = None, False

    def record(self):
        self.t = _FakeEvent.clock

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, end):
        assert end.synced, "elapsed_time before the end event completed"
        return (end.t - self.t) * 1000.0


class _FakeCuda:
    Event = _FakeEvent

    def max_memory_allocated(self, device):
        return 3 << 30

    def max_memory_reserved(self, device):
        return 4 << 30


def test_step_timer_uses_cuda_events_and_waits_only_when_read():
    timer = StepTimer(torch.device("cuda", 0), cuda=_FakeCuda())
    mark = timer.begin()
    _FakeEvent.clock = 0.25
    pending = timer.end(mark)
    assert not pending.end.synced  # nothing waited for at the end of the step
    assert pending.seconds() == 0.25 and pending.end.synced


def test_cuda_memory_fields_beside_the_plan(monkeypatch):
    cuda = torch.device("cuda", 0)
    assert cuda_memory_fields(torch.device("cpu")) == {}
    assert cuda_memory_fields(cuda, _FakeCuda()) == {"mem_cuda_max_allocated": 3 << 30,
                                                      "mem_cuda_max_reserved": 4 << 30}
    plan = {"plan_mem_params": 1, "plan_mem_grads": 2, "plan_mem_optim": 3, "plan_mem_activations": 4}
    assert planned_total(plan) == {"plan_mem_total": 10} and planned_total({"plan_mem_params": 1}) == {}
    # the trainer logs them with its categories and the planner's prediction (a fake CUDA allocator on CPU)
    import scaletrain.train.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "cuda_memory_fields", lambda device: cuda_memory_fields(cuda, _FakeCuda()))
    t = Trainer(make_config({**TINY, "train.steps": 1}))
    t.train_step(1)
    row = t.memory()
    assert row["mem_cuda_max_allocated"] == 3 << 30 and row["mem_cuda_max_reserved"] == 4 << 30
    assert row["plan_mem_total"] == sum(row[f"plan_mem_{c}"] for c in ("params", "grads", "optim", "activations"))


def test_batches_for_a_cuda_device_are_staged_in_one_pinned_buffer(monkeypatch):
    """One page-locked copy of a rank's inputs and targets per step when the device is CUDA, none on a CPU (a fake
    pin_memory: this torch has no CUDA)."""
    from scaletrain.data.loader import staged

    pins = []

    def fake_pin(t):
        pins.append(t.shape)
        return t.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t: False)
    loader = BatchLoader(load_tokens("builtin"), 16, 8, 0)
    x, y = loader.global_batch_at(3)
    gx, gy = staged(x[:4], y[:4], torch.device("cuda", 1))
    assert pins == [(2, 4, 16)] and torch.equal(gx, x[:4]) and torch.equal(gy, y[:4])
    assert gx.untyped_storage().data_ptr() == gy.untyped_storage().data_ptr()  # one buffer
    assert staged(x, y, torch.device("cpu")) == (x, y) and len(pins) == 1
