"""Data parallelism and ZeRO 1/2/3 (+ offload) equal the single-process run; memory and volume follow ZeRO.

Tolerances: fp64 runs; the parallel runs sum gradients in another order (bucket all-reduce, reduce-scatter
shards), measured parameter differences after 4 AdamW steps are ~2e-15, so rtol 1e-10 / atol 1e-12 has
margin while any real error (a missing or doubled gradient, a wrong shard) is O(1e-3) or larger.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn as nn
from harness import TINY, assert_same_run, make_config, run_ranks, train_parallel_many, train_reference

RTOL, ATOL = 1e-10, 1e-12


@pytest.fixture(scope="module")
def reference():
    return train_reference({})


@pytest.mark.parametrize("dp", [2, 4])
def test_dp_and_zero_match_single_process(reference, dp):
    """zero 0..3 x (no accumulation, accumulation of 2 micro-batches)."""
    configs = [{"parallel.dp": dp, "parallel.zero": z, "train.micro_batch": mb}
               for z in (0, 1, 2, 3) for mb in (8 // dp, 4 // dp)]
    results = train_parallel_many(configs, dp)
    for cfg, par in zip(configs, results):
        try:
            assert_same_run(reference, par, RTOL, ATOL)
        except AssertionError as e:
            raise AssertionError(f"{cfg}: {e}") from None


def test_offload_matches_single_process(reference):
    configs = [{"parallel.dp": 2, "parallel.zero": z, "parallel.offload": off}
               for z, off in ((1, "optimizer"), (2, "optimizer"), (3, "optimizer"), (3, "params"))]
    for cfg, par in zip(configs, train_parallel_many(configs, 2)):
        assert_same_run(reference, par, RTOL, ATOL), cfg


def test_uneven_sizes_are_padded_and_change_nothing():
    """Parameter and bucket sizes not divisible by dp=4 (tiny buckets force many padded ones)."""
    odd = {"model.d_model": 33, "model.n_heads": 3, "model.seq_len": 30, "model.vocab_size": 257,
           "parallel.bucket_mb": 0.002}
    from scaletrain.model import build_gpt, count_params

    assert count_params(build_gpt(make_config({**TINY, **odd}).model, 0)) % 4 != 0
    ref = train_reference(odd)
    configs = [{**odd, "parallel.dp": 4, "parallel.zero": z} for z in (0, 1, 2, 3)]
    for cfg, par in zip(configs, train_parallel_many(configs, 4)):
        assert_same_run(ref, par, RTOL, ATOL), cfg


def _memory_and_volume(rank, world):
    from scaletrain.distributed.process_group import DistEnv
    from scaletrain.train.trainer import Trainer

    out = {}
    for zero in (0, 1, 2, 3):
        cfg = make_config({**TINY, "model.d_model": 64, "model.seq_len": 32, "train.dtype": "fp32",
                           "train.steps": 2, "train.micro_batch": 4, "parallel.dp": world, "parallel.zero": zero})
        t = Trainer(cfg, None, DistEnv(rank, world, 0, "test"))
        out[zero] = (t.n_params, t.run().last_row)
    return out


@pytest.fixture(scope="module")
def zero_rows():
    return run_ranks(_memory_and_volume, 2, timeout=180)[0]


def test_memory_follows_zero_formulas(zero_rows):
    """fp32 AdamW, N = 2: dp 16Ψ, ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N, ZeRO-3 16Ψ/N (by category)."""
    n = 2
    for zero, (params, grads, optim) in {0: (4, 4, 8), 1: (4, 4, 8 / n), 2: (4, 4 / n, 8 / n),
                                         3: (4 / n, 4 / n, 8 / n)}.items():
        psi, row = zero_rows[zero]
        for key, per_param in (("mem_params", params), ("mem_grads", grads), ("mem_optim", optim)):
            expect = per_param * psi
            # within 2 %: padding to a multiple of N and AdamW's 4-byte step counters
            assert abs(row[key] - expect) <= 0.02 * expect, (zero, key, row[key], expect)


def test_communication_volume_zero12_equal_dp_and_zero3_is_1_5x(zero_rows):
    """ZeRO paper section 7: ZeRO-1/2 move the bytes of plain DP (RS + AG = AR), ZeRO-3 1.5x."""
    vols = {}
    for zero in (0, 1, 2, 3):
        psi, row = zero_rows[zero]
        vols[zero] = sum(v for k, v in row.items() if k.startswith("comm_"))
        if zero == 0:
            assert row["comm_all_reduce_bytes"] == 2 * (2 - 1) / 2 * 4 * psi
    for zero, factor in ((1, 1.0), (2, 1.0), (3, 1.5)):
        assert abs(vols[zero] / vols[0] - factor) < 0.01, (zero, vols)


# ------------------------------------------------------------------------- kill and resume


def _launch(out, steps, zero):
    argv = [sys.executable, "-m", "scaletrain", "train", "--nproc", "2", "--out", str(out)]
    sets = {**TINY, "parallel.dp": 2, "parallel.zero": zero, "train.steps": steps,
            "train.checkpoint_every": 2, "train.dtype": "fp32"}
    for k, v in sets.items():
        argv += ["--set", f"{k}={v}"]
    return argv


def _final_state(out):
    """Every tensor of the newest checkpoint (parameters, ZeRO's optimizer state, random streams), by name."""
    from scaletrain.train import checkpoint as ckpt

    return ckpt.read_tensors(ckpt.latest(out / "checkpoints"), "")


def test_kill_and_resume_is_exact_under_zero(tmp_path):
    """ZeRO-3 (sharded parameters, gradients and optimizer state: the most a resume has to put back). ZeRO-2's
    resume is exact in tests/test_checkpoint_reshard.py (source dp4-zero2); what a kill adds (orphaned ranks, a
    half-written checkpoint) does not depend on the stage, so one launch pair is spent on it, not two."""
    zero = 3
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ref, run = tmp_path / "ref", tmp_path / "run"
    subprocess.run(_launch(ref, 8, zero), check=True, env=env, capture_output=True, timeout=240)
    proc = subprocess.Popen(_launch(run, 8, zero), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 180
    while not (run / "checkpoints" / "step_00000004" / "COMPLETE").exists():
        assert time.time() < deadline and proc.poll() is None, "no checkpoint appeared"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and torchrun; the ranks have sessions of their own
    proc.wait()
    kept = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert "step_00000008" not in kept, "finished before the kill"
    # orphaned ranks trained on to the end within a second, before the fix; now a rank whose torchrun died writes
    # nothing more: at most the checkpoint whose commit was already under way when the kill landed completes
    time.sleep(2.0)
    after = sorted(p.name for p in (run / "checkpoints").iterdir() if not p.name.endswith(".tmp"))
    newest = max(int(name.split("_")[1]) for name in kept if not name.endswith(".tmp"))  # a .tmp: one under way
    assert all(int(name.split("_")[1]) <= newest + 2 for name in after), f"the ranks trained on: {kept} -> {after}"
    resumed = subprocess.run(_launch(run, 8, zero), env=env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    rows = lambda d: [__import__("json").loads(x)["loss"] for x in (d / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    assert rows(run) == rows(ref) and len(rows(ref)) == 8
    a, b = _final_state(ref), _final_state(run)
    assert a.keys() == b.keys() and any(k.startswith("optim/") for k in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name


# ------------------------------------------------------------------------- the public API on a user's model


class UserNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(13, 13), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(13, 3)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def _user_model(rank, world, mode):
    import scaletrain.parallel as stp

    torch.manual_seed(0)
    model = UserNet().double()
    data = torch.Generator().manual_seed(1)
    if mode == "dp":
        decay = [p for p in model.parameters() if p.ndim >= 2]
        rest = [p for p in model.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        opt = stp.data_parallel(model, torch.optim.AdamW(groups, lr=1e-2), bucket_mb=0.0005)
    else:
        opt = stp.zero(model, stage=int(mode), lr=1e-2, weight_decay=0.1, bucket_mb=0.0005)
    for _ in range(3):
        x = torch.randn(8, 7, generator=data, dtype=torch.float64)
        y = torch.randn(8, 3, generator=data, dtype=torch.float64)
        opt.begin_micro(0, 1)
        loss = nn.functional.mse_loss(model(x[rank::world]), y[rank::world])
        loss.backward()
        opt.finish_backward()
        opt.clip_grad_norm(0.5)
        opt.step()
        opt.zero_grad()
    state = opt.gather_params(model.state_dict()) if hasattr(opt, "gather_params") else model.state_dict()
    return {k: v.clone() for k, v in state.items()}


def _user_models(rank, world):
    return [_user_model(rank, world, mode) for mode in ("dp", "1", "2", "3")]


def test_public_api_on_a_users_module():
    torch.manual_seed(0)
    model = UserNet().double()
    # ZeRO's convention (documented): weight decay on matrices, not on biases and norm gains
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    data = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, 7, generator=data, dtype=torch.float64)
        y = torch.randn(8, 3, generator=data, dtype=torch.float64)
        # rank r's mean loss over its half, averaged over ranks = the mean over the interleaved halves
        loss = 0.5 * sum(nn.functional.mse_loss(model(x[r::2]), y[r::2]) for r in range(2))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    expect = model.state_dict()
    for mode, got in zip(("dp", "1", "2", "3"), run_ranks(_user_models, 2, timeout=180)[0]):
        for k in expect:
            torch.testing.assert_close(got[k], expect[k], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, k=k, mode=mode: f"{mode} {k}: {m}")


@pytest.mark.parametrize("name, extra", [
    ("adafactor", {"optim.relative_step": True}),
    ("adafactor", {"optim.use_beta1": True, "optim.relative_step": False, "train.lr": 1e-2}),
    ("sm3", {"optim.momentum": 0.5, "train.lr": 0.05}),
])
def test_adafactor_and_sm3_under_zero_match_single_process(name, extra):
    """Factored statistics combined over flat shards (parallel/zero_factored.py), odd sizes, tiny buckets.

    model.bias=false: the attention key bias has an exactly-zero true gradient (softmax is invariant to it),
    and SM3 (eps 0) / Adafactor (eps1 1e-30) normalise its rounding noise into a full-size step, so its value
    depends on summation order in any implementation; without it the runs agree to ~2e-16.
    """
    ov = {"optim.name": name, "model.bias": False, "model.d_model": 33, "model.n_heads": 3,
          "parallel.bucket_mb": 0.002, **extra}
    ref = train_reference(ov)
    configs = [{**ov, "parallel.dp": 2, "parallel.zero": z} for z in (1, 2, 3)]
    for cfg, par in zip(configs, train_parallel_many(configs, 2)):
        assert_same_run(ref, par, RTOL, ATOL), cfg


def test_every_engine_optimizer_implements_the_protocol():
    """The replicated, ZeRO, ZeRO-Infinity and expert-parallel optimizers each define every member of
    `EngineOptimizer` that has no default (the trainer, the executor and the checkpoint code call them unprobed)."""
    from scaletrain.parallel.data_parallel import ReplicatedOptimizer
    from scaletrain.parallel.engine import EngineOptimizer
    from scaletrain.parallel.experts import ExpertParallelOptimizer
    from scaletrain.parallel.zero import ZeroOptimizer
    from scaletrain.parallel.zero_nvme import NvmeZeroOptimizer

    required = ("begin_micro", "finish_backward", "unscale_", "local_grad_sq", "scale_grads_", "clip_grad_norm",
                "step", "zero_grad", "memory_tensors")
    for cls in (ReplicatedOptimizer, ZeroOptimizer, NvmeZeroOptimizer, ExpertParallelOptimizer):
        assert EngineOptimizer in cls.__mro__, cls  # subclasses the protocol: its defaults apply
        missing = [m for m in required if getattr(cls, m) is getattr(EngineOptimizer, m)]
        assert not missing, (cls.__name__, missing)


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_gradients_of_interleaved_weight_passes_are_summed_in_fp32_not_in_fp16(stage):
    """ZB-V's order: a weight-gradient pass of micro-batch 1 can come before its bucket was reduced for micro-batch 0
    (the bucket's other parameters belong to the other chunk). Each gradient (40000, finite in fp16) must reach the
    fp32 accumulator on its own: added in the fp16 .grad first, 40000 + 40000 overflows to inf."""
    from scaletrain.parallel.zero import ZeroOptimizer

    torch.manual_seed(0)
    model = nn.Linear(4, 1).half()
    opt = ZeroOptimizer(model, stage, None, lr=1e-3)
    opt.begin_step()
    x = torch.ones(1, 4, dtype=torch.float16)
    losses = [(model(x) * 40000.0).sum() for _ in range(2)]
    passes = [(0, model.weight), (1, model.weight), (0, model.bias), (1, model.bias)]
    for i, (mb, p) in enumerate(passes):  # the executor: begin_micro before every weight pass
        opt.begin_micro(i, len(passes))
        torch.autograd.backward(losses[mb], inputs=[p], retain_graph=True)
    opt.finish_backward()
    got = torch.cat([g.shard_grad for g in opt.groups])
    assert got.dtype == torch.float32
    assert got.tolist() == [80000.0] * 5, got  # weight (4) and bias (1)
