"""train.precision=fp8 on one process: the FP8 linear computes what the recipes define, which layers convert, what
validate() refuses, and where the run says which layers ran in FP8.

The numerics are checked against a reference written here from the recipes' definition (Micikevicius et al., arXiv
2209.05433; torchao's tensorwise and rowwise recipes): amax = max |t| (of the whole tensor, or of each row along the
GEMM's reduction dimension), scale = fp8_max / amax (rowwise: rounded down to a power of 2), q = cast(t * scale)
saturated to the format, and the GEMM multiplies q / scale in fp32 — for the output (x, W in e4m3) and both gradients
(dy in e5m2 for tensorwise, e4m3 for rowwise). Each layer is called three times with inputs 1x, 64x and 1/64x the
first, so a scale that is not recomputed from the current amax (a stale scale: saturation at 64x, lost precision at
1/64x) fails the check; `test_a_stale_scale_fails_the_recipe_check` injects that bug and sees it fail.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from harness import TINY, make_config

from scaletrain.config import load_config, validate
from scaletrain.errors import ConfigError, UserError

pytestmark = pytest.mark.usefixtures("one_thread")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# --------------------------------------------------------------------------- the reference, from the definition


def _quantized(t: torch.Tensor, fmt: torch.dtype, reduce_dim: int | None, pow2: bool) -> torch.Tensor:
    """t scaled by fp8_max / amax (of the whole tensor, or along `reduce_dim`), cast to `fmt`, divided back (fp32)."""
    a = t.abs().amax() if reduce_dim is None else t.abs().amax(dim=reduce_dim, keepdim=True)
    scale = (torch.finfo(fmt).max / a.double().clamp(min=1e-12)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = (t.float() * scale).clamp(-torch.finfo(fmt).max, torch.finfo(fmt).max).to(fmt)
    return q.float() / scale


def reference_linear(x, w, dy, recipe: str):
    """(y, dx, dW) of y = x Wᵀ with the recipe's three float8 GEMMs; x (N, K), W (O, K), dy (N, O)."""
    rowwise = recipe == "rowwise"
    go = E4M3 if rowwise else E5M2

    def q(t, fmt, dim):  # dim: the GEMM's reduction dimension of t
        return _quantized(t, fmt, dim if rowwise else None, rowwise)

    y = (q(x, E4M3, 1) @ q(w, E4M3, 1).t()).to(x.dtype)  # output: reduces over K
    dx = (q(dy, go, 1) @ q(w, E4M3, 0)).to(dy.dtype)  # grad_input: reduces over O
    dw = (q(dy, go, 0).t() @ q(x, E4M3, 0)).to(dy.dtype)  # grad_weight: reduces over N
    return y, dx, dw


def _fp8_layer(recipe: str, dtype: torch.dtype, seed: int = 0):
    from scaletrain.memory.fp8 import Fp8Gemm, convert_linear, recipe_config

    torch.manual_seed(seed)
    plain = torch.nn.Linear(48, 80, bias=True).to(dtype)
    return plain, convert_linear(copy.deepcopy(plain), Fp8Gemm(recipe_config(recipe, emulate=True)))


def _check_against_reference(layer, dtype, recipe):
    torch.manual_seed(1)
    base_x, base_dy = torch.randn(6, 8, 48), torch.randn(6, 8, 80)
    for factor in (1.0, 64.0, 1 / 64):  # a scale must follow the current amax, call after call
        x = (base_x * factor).to(dtype).requires_grad_()
        dy = (base_dy * factor).to(dtype)
        layer.zero_grad()
        y = layer(x)
        y.backward(dy)
        ry, rdx, rdw = reference_linear(x.detach().flatten(0, 1), layer.weight.detach(), dy.flatten(0, 1), recipe)
        for got, want in ((y, ry.view_as(y) + layer.bias.to(y.dtype)), (x.grad, rdx.view_as(x)),
                          (layer.weight.grad, rdw.to(layer.weight.dtype))):
            assert _rel(got, want) < BOUND, (factor, _rel(got, want))


BOUND = 1e-5
"""Relative L2 difference allowed between the layer and the reference, set before measuring: the same float8 operands
multiplied in fp32 may be summed in another order by another kernel and then rounded to the output dtype (measured
here: 0, bit for bit, over 5 seeds, both recipes, fp32 and bf16). A wrong scale or format is float8 rounding, 1e-2."""


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_is_the_recipe_definition_for_output_and_both_gradients(recipe, dtype):
    plain, layer = _fp8_layer(recipe, dtype)
    _check_against_reference(layer, dtype, recipe)
    # and it really quantizes: the output differs from the high-precision layer by float8 rounding, no more
    x = torch.randn(64, 48).to(dtype)
    with torch.no_grad():
        err = _rel(layer(x), plain(x))
    assert 1e-3 < err < 0.1, err


def test_a_stale_scale_fails_the_recipe_check(monkeypatch):
    """The bug the check exists for: the scale computed once and never updated (delayed scaling never refreshed)."""
    from scaletrain.memory import fp8

    f8 = fp8.torchao_float8()
    first: dict = {}
    to_scale = f8.float8_utils.amax_to_scale

    def stale(amax, dtype, pow2=False):
        key = (tuple(amax.shape), dtype)
        first.setdefault(key, to_scale(amax, dtype, pow2))
        return first[key]

    monkeypatch.setattr(f8.float8_utils, "amax_to_scale", stale)
    _, layer = _fp8_layer("tensorwise", torch.float32)
    with pytest.raises(AssertionError):
        _check_against_reference(layer, torch.float32, "tensorwise")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_is_torchao_float8_linear_bit_for_bit(recipe):
    """Our layer is torchao's casts and GEMMs: its outputs and gradients are those of torchao's own Float8Linear."""
    from scaletrain.memory.fp8 import recipe_config, torchao_float8

    plain, ours = _fp8_layer(recipe, torch.bfloat16)
    theirs = torchao_float8().convert_to_float8_training(copy.deepcopy(plain), config=recipe_config(recipe, True))
    x = torch.randn(64, 48, dtype=torch.bfloat16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb)
    dy = torch.randn_like(ya)
    ya.backward(dy)
    yb.backward(dy)
    assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad)
    assert torch.equal(ours.weight.grad, theirs.weight.grad) and torch.equal(ours.bias.grad, theirs.bias.grad)


# --------------------------------------------------------------------------- which layers convert


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_the_rule_names_exactly_the_blocks_linear_layers_and_the_pass_converts_them(mlp):
    from scaletrain.distributed.comm import CommStats
    from scaletrain.distributed.mesh import Mesh, ParallelDims
    from scaletrain.memory.fp8 import Fp8Linear
    from scaletrain.memory.fp8_layers import candidate_names
    from scaletrain.model import build_gpt
    from scaletrain.parallel.parallelize import build_engine

    cfg = make_config({**TINY, "train.dtype": "fp32", "train.precision": "fp8", "model.mlp": mlp,
                       "train.fp8_layers": "blocks.*,!blocks.0.attn.*"})
    plain = build_gpt(cfg.model, 0)
    linears = [n for n, m in plain.named_modules() if isinstance(m, torch.nn.Linear)]
    assert sorted(candidate_names(cfg.model)) == sorted(n for n in linears if n != "lm_head")
    engine = build_engine(cfg, Mesh.build(ParallelDims.from_config(cfg.parallel)), torch.device("cpu"),
                          torch.float32, CommStats())
    fp8 = {n for n, m in engine.module.named_modules() if isinstance(m, Fp8Linear)}
    assert fp8 == set(candidate_names(cfg.model)) - {"blocks.0.attn.qkv", "blocks.0.attn.proj"}
    assert engine.fp8.layers == sorted(fp8, key=linears.index) and engine.fp8.model_layers == len(fp8)
    assert type(engine.module.lm_head) is torch.nn.Linear and type(engine.module.wte) is torch.nn.Embedding


def _errors(**sets) -> str:
    try:
        validate(load_config(None, [f"{k}={v}" for k, v in sets.items()]))
    except ConfigError as e:
        return str(e)
    return ""


FP8 = {"train.precision": "fp8"}


@pytest.mark.parametrize("sets, message", [
    ({**FP8, "train.dtype": "fp16"}, "train.precision=fp8 with train.dtype=fp16 is not available: fp16 needs loss"),
    ({**FP8, "train.dtype": "fp64"}, "train.precision=fp8 with train.dtype=fp64 is not available"),
    ({**FP8, "train.fp8_recipe": "delayed"}, "train.fp8_recipe must be tensorwise or rowwise, got 'delayed'"),
    ({**FP8, "train.fp8_gemm": "fast"}, "train.fp8_gemm must be auto, emulate or hardware, got 'fast'"),
    ({**FP8, "train.fp8_layers": "blocks.*.attn.qvk"}, "pattern 'blocks.*.attn.qvk' matches no linear layer"),
    ({**FP8, "train.fp8_layers": "lm_head"}, "pattern 'lm_head' matches no linear layer of the blocks"),
    ({**FP8, "train.fp8_layers": "blocks.*,!blocks.*"}, "selects no layer"),
    ({**FP8, "train.fp8_layers": "blocks.*,,"}, "must be a comma list of name patterns"),
    ({**FP8, "model.moe.experts": 4}, "train.precision=fp8 with model.moe.experts=4 is not available"),
    ({**FP8, "parallel.tp": 4, "parallel.tp_mode": "2d"}, "train.precision=fp8 with parallel.tp_mode=2d"),
    ({**FP8, "model.reversible": "true"}, "train.precision=fp8 with model.reversible=true"),
    ({**FP8, "parallel.zero": 3, "parallel.offload": "nvme"}, "train.precision=fp8 with parallel.offload=nvme"),
    ({"train.fp8_recipe": "rowwise"}, "train.fp8_recipe=rowwise has no effect without train.precision=fp8"),
])
def test_validate_refuses_what_fp8_does_not_make_work(sets, message):
    assert message in _errors(**sets)


def test_validate_accepts_the_fp8_settings_it_makes_work():
    for sets in ({**FP8}, {**FP8, "train.dtype": "bf16", "train.fp8_recipe": "rowwise"},
                 {**FP8, "train.fp8_layers": "!blocks.0.*", "train.fp8_gemm": "emulate"},
                 {**FP8, "parallel.dp": 2, "parallel.zero": 3}, {**FP8, "parallel.tp": 2, "model.n_kv_heads": 2},
                 {**FP8, "parallel.tp": 2, "model.n_kv_heads": 1}):  # kv heads copied: parallel/fp8.sum_copies
        assert _errors(**sets) == "", sets


def test_filter_patterns_and_the_description():
    from scaletrain.memory.fp8_layers import describe, fp8_layer_names

    cfg = load_config(None, ["train.precision=fp8", "model.n_layers=3", "train.fp8_layers=blocks.*.mlp.*"])
    names = fp8_layer_names(cfg.model, cfg.train)
    assert names == [f"blocks.{i}.mlp.{k}" for i in range(3) for k in ("fc", "proj")]
    assert describe(names, cfg.model) == "6 linear layers, blocks 0-2: mlp.fc, mlp.proj"
    cfg.train.fp8_layers = "blocks.*,!blocks.2.*,!blocks.0.attn.qkv"
    assert describe(fp8_layer_names(cfg.model, cfg.train), cfg.model).startswith("7 linear layers: blocks.0.attn.proj")
    cfg.train.precision = "autocast-bf16"
    assert fp8_layer_names(cfg.model, cfg.train) == []


# --------------------------------------------------------------------------- devices


class _Cuda:
    def __init__(self, capability, name):
        self.capability, self.name = capability, name

    def get_device_capability(self, device=None):
        return self.capability

    def get_device_name(self, device=None):
        return self.name


@pytest.mark.parametrize("capability, name, setting, emulate", [
    ((9, 0), "NVIDIA H100 80GB HBM3", "auto", False),
    ((8, 9), "NVIDIA L4", "hardware", False),
    ((8, 0), "NVIDIA A100-SXM4-80GB", "emulate", True),
    ((8, 0), "NVIDIA A100-SXM4-80GB", "auto", "A100-SXM4-80GB (compute capability 8.0) has no FP8 tensor cores"),
    ((7, 0), "Tesla V100", "hardware", "set train.fp8_gemm=emulate to run FP8 emulated"),
])
def test_a_gpu_without_fp8_is_refused_unless_emulation_is_asked_for(monkeypatch, capability, name, setting, emulate):
    from scaletrain.memory import fp8

    cuda = _Cuda(capability, name)
    for attr in ("get_device_capability", "get_device_name"):
        monkeypatch.setattr(fp8.torch.cuda, attr, getattr(cuda, attr))
    gpu = torch.device("cuda", 0)
    if isinstance(emulate, bool):
        assert fp8.emulated(setting, gpu) is emulate
    else:
        with pytest.raises(UserError) as e:
            fp8.emulated(setting, gpu)
        assert emulate in str(e.value) and "\n" not in str(e.value)
    assert fp8.emulated("auto", torch.device("cpu")) is True
    with pytest.raises(UserError, match="this run is on the CPU"):
        fp8.emulated("hardware", torch.device("cpu"))


def test_fp8_tensor_cores_need_dimensions_divisible_by_16():
    from scaletrain.parallel.fp8 import _check_shape

    _check_shape("blocks.0.mlp.fc", torch.nn.Linear(64, 256), 8 * 128)
    with pytest.raises(UserError, match="blocks.0.attn.qkv's weight is 72 x 24"):
        _check_shape("blocks.0.attn.qkv", torch.nn.Linear(24, 72), 8 * 128)


# --------------------------------------------------------------------------- what the run says


def test_a_run_says_which_layers_ran_in_fp8(tmp_path, capsys):
    """metrics.jsonl (fp8_layers), run_info.json, the report and `plan --config` name the FP8 layers; the
    CLI refuses the FP8 tensor cores on the CPU in one line, exit 2, before writing anything."""
    from scaletrain.cli import main

    sets = [f"{k}={v}" for k, v in {**TINY, "train.dtype": "fp32", "train.precision": "fp8", "train.steps": 2,
                                     "train.global_batch": 4, "train.fp8_layers": "blocks.*,!blocks.1.mlp.*"}.items()]
    argv = [x for s in sets for x in ("--set", s)]
    bad = tmp_path / "bad"
    assert main(["train", *argv, "--set", "train.fp8_gemm=hardware", "--out", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.fp8_gemm=hardware needs a GPU with FP8 tensor cores" in err, err
    assert not bad.exists()
    out = tmp_path / "run"
    assert main(["train", *argv, "--out", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["fp8_layers"] for r in rows] == [6, 6]
    info = json.loads((out / "run_info.json").read_text())["sessions"][-1]
    assert info["fp8"] == {"recipe": "tensorwise", "gemm": "emulated", "layers": [
        "blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc", "blocks.0.mlp.proj", "blocks.1.attn.qkv",
        "blocks.1.attn.proj"]}
    assert "6 linear layers: blocks.0.attn.qkv" in (out / "report.html").read_text()
    capsys.readouterr()
    assert main(["plan", "--config", str(out / "config.yaml"), "--gpu", "h100-80gb"]) == 0
    assert "FP8 (tensorwise, train.fp8_gemm=auto): 6 linear layers: blocks.0.attn.qkv" in capsys.readouterr().out
    assert math.isfinite(rows[-1]["loss"])


# --------------------------------------------------------------------------- training


TRACK = {**TINY, "train.dtype": "fp32", "train.steps": 40, "train.lr": 3e-3, "train.warmup_steps": 5,
         "train.eval_every": 40, "train.eval_batches": 2}


def test_fp8_training_tracks_autocast_bf16():
    """A short CI version of the 300-step claim (benchmarks/RESULTS.md, FP8 section): over 40 steps of a tiny GPT,
    the FP8 run's loss stays within 1% of autocast-bf16's at every step and the final validation losses are within
    0.02 (bounds set before measuring), while both runs learn (the loss falls by more than 1 nat). Measured: 1.7e-4
    at worst per step, validation 3.43762 vs 3.43759, the loss fell by 1.92."""
    from scaletrain.train.trainer import Trainer

    runs = {}
    for precision in ("autocast-bf16", "fp8"):
        result = Trainer(make_config({**TRACK, "train.precision": precision})).run()
        runs[precision] = result
    bf16, fp8 = runs["autocast-bf16"], runs["fp8"]
    worst = max(abs(fp8.losses[s] - bf16.losses[s]) / bf16.losses[s] for s in bf16.losses)
    assert worst <= 0.01, worst
    assert abs(fp8.val_losses[40] - bf16.val_losses[40]) <= 0.02, (fp8.val_losses, bf16.val_losses)
    assert fp8.losses[1] - fp8.losses[40] > 1.0, fp8.losses


def test_compiled_fp8_blocks_equal_eager_in_one_graph(monkeypatch):
    """train.compile with FP8 layers: the blocks compile to one graph without a break (the casts, scales and the
    float8 tensor subclass are traced; nothing in the FP8 layers changes between calls) and, captured with aot_eager
    as tests/test_compile.py does, compute exactly what eager blocks compute. (Inductor's own kernels fuse the bf16
    casts around the layers differently: measured 1.5e-5 relative on the loss over 3 steps, outside CI.)"""
    from torch._dynamo.utils import counters

    from scaletrain.parallel.compile import BACKEND_ENV
    from scaletrain.train.trainer import Trainer

    monkeypatch.setenv(BACKEND_ENV, "aot_eager")
    runs = []
    torch._dynamo.reset()
    counters.clear()
    for compiled in (False, True):
        t = Trainer(make_config({**TINY, "train.dtype": "fp32", "train.precision": "fp8", "train.steps": 2,
                                 "train.compile": compiled}))
        runs.append((t.run().losses, t.full_state()))
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])


def test_docs_list_the_exclusions_the_code_applies():
    from pathlib import Path

    from scaletrain.memory.fp8_layers import EXCLUDED

    doc = Path(__file__).parent.parent / "docs" / "precision.md"
    table = doc.read_text().split("<!-- fp8-excluded:begin -->\n")[1].split("<!-- fp8-excluded:end -->")[0]
    rows = [line.split(" | ") for line in table.strip().splitlines()[2:]]
    assert {r[0].lstrip("| "): r[1].rstrip(" |") for r in rows} == EXCLUDED
