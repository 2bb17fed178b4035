"""`scaletrain plan` end to end: JSON schema, PNG, --params, --config, and bad input -> exit 2."""

from __future__ import annotations

import json

import pytest

from scaletrain.cli import main

BASE = ["plan", "--model", "gpt3-175b", "--gpus", "1024", "--global-batch", "1536"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_schema_follows_the_issue(capsys, tmp_path):
    png = tmp_path / "mem.png"
    code, out, _ = run(capsys, *BASE, "--json", "--top", "3", "--png", str(png))
    assert code == 0
    doc = json.loads(out)
    assert doc["model"]["params"] == 174_604_259_328
    assert doc["cluster"]["gpus"] == 1024
    assert len(doc["candidates"]) == 3
    c = doc["candidates"][0]
    assert set(c["layout"]) == {"dp", "tp", "pp", "ep", "zero", "micro_batch", "recompute", "schedule",
                                "virtual_stages", "sequence_parallel", "offload", "tp_mode", "tp_depth", "cp",
                                "cp_mode", "partition", "reshard_after_forward"}
    assert set(c["memory_bytes"]) == {"params", "grads", "optimizer", "activations", "buffers", "total"}
    for key in ("fits", "step_time_s", "tokens_per_s", "model_tflops_per_gpu", "hardware_tflops_per_gpu",
                "mfu", "bubble_fraction", "comm_bytes_per_step", "blocks_per_stage"):
        assert key in c
    times = [x["step_time_s"] for x in doc["candidates"] if x["fits"]]
    assert times == sorted(times)  # best first
    assert png.stat().st_size > 1000


def test_fixed_layout_and_table(capsys):
    code, out, _ = run(capsys, *BASE, "--layout", "dp=16,tp=8,pp=8,zero=1,recompute=full", "--top", "2")
    assert code == 0 and "dp16 tp8 pp8 z1" in out
    flat = " ".join(out.split())
    assert "faster than the runner-up" in flat or "take the same time" in flat


def test_params_mode_reproduces_zero_figure1(capsys):
    code, out, _ = run(capsys, "plan", "--params", "7.5e9", "--gpus", "64", "--json")
    assert code == 0
    by_stage = {c["layout"]["zero"]: c["memory_bytes"]["total"] / 1e9 for c in json.loads(out)["candidates"]}
    # arXiv 1910.02054 Fig. 1 (the paper prints 16.64 as 16.6 and 1.875 as 1.9)
    assert [by_stage[z] for z in range(4)] == pytest.approx([120, 31.4, 16.6, 1.9], rel=5e-3, abs=0.03)


def test_params_mode_orders_best_first_and_honours_the_layout(capsys):
    """--params: layouts that fit first, by data-parallel traffic (ZeRO 0-2: 2Ψ, ZeRO-3: 3Ψ), then memory;
    --layout fixes dp/tp/pp/zero (tp·pp split Ψ), and keys that need a model are refused."""
    code, out, _ = run(capsys, "plan", "--params", "7.5e9", "--gpus", "64", "--json")
    cands = json.loads(out)["candidates"]
    assert [c["layout"]["zero"] for c in cands] == [2, 1, 3, 0]  # ZeRO-0 (120 GB) does not fit 80 GB
    assert [c["fits"] for c in cands] == [True, True, True, False]
    comm = [c["comm_bytes_per_step"]["dp"] for c in cands]
    assert comm[0] == comm[1] == int(63 / 64 * 7.5e9 * 4) and comm[2] == int(63 / 64 * 7.5e9 * 6)
    code, out, _ = run(capsys, "plan", "--params", "7.5e9", "--gpus", "64", "--layout", "tp=8,zero=1", "--json")
    (only,) = json.loads(out)["candidates"]
    assert only["layout"] == {"dp": 8, "tp": 8, "pp": 1, "ep": 1, "zero": 1}
    assert only["memory_bytes"]["optimizer"] == 12 * 7.5e9 / 8 / 8 and only["memory_bytes"]["params"] == 2 * 7.5e9 / 8
    code, out, _ = run(capsys, "plan", "--params", "7.5e9", "--gpus", "64", "--layout", "zero=3,dp=64")
    rows = [line for line in out.splitlines() if line.startswith("│")]
    assert code == 0 and "best first" in out and len(rows) == 1 and rows[0].split("│")[2].strip() == "3"  # ZeRO-3 only
    for layout, msg in (("recompute=full", "--layout recompute needs a model"),
                        ("dp=16,tp=2", "does not match --gpus (64)"), ("tp=3", "does not divide --gpus (64)")):
        code, _, err = run(capsys, "plan", "--params", "7.5e9", "--gpus", "64", "--layout", layout)
        assert code == 2 and msg in err and err.count("\n") == 1


@pytest.mark.parametrize("optimizer,first_moment,k", [("adamw", False, 12), ("adafactor", False, 4),
                                                      ("sm3", True, 8)])
def test_optimizer_choice_sets_the_optimizer_state(capsys, optimizer, first_moment, k):
    """K per parameter under bf16: AdamW 12 (master, m, v); Adafactor / SM3 the fp32 master (+ a first
    moment), plus their factored statistics (rows + columns: about 2/d_model of the parameters)."""
    extra = ["--first-moment"] if first_moment else []
    code, out, _ = run(capsys, "plan", "--params", "1e9", "--gpus", "8", "--json", "--optimizer", optimizer, *extra)
    zero1 = next(c for c in json.loads(out)["candidates"] if c["layout"]["zero"] == 1)
    assert code == 0 and zero1["memory_bytes"]["optimizer"] == k * 1e9 / 8
    code, out, _ = run(capsys, *BASE, "--json", "--optimizer", optimizer, *extra, "--top", "1",
                       "--layout", "dp=16,tp=8,pp=8,zero=1,mb=1,recompute=full")
    doc = json.loads(out)
    per_param = doc["training"]["optimizer_bytes_per_param"]
    assert k <= per_param < k + (0 if optimizer == "adamw" else 4 * 3 / 12288) + 1e-12
    stage_params = doc["candidates"][0]["memory_bytes"]["params"] / 2  # bf16, not sharded at ZeRO-1
    assert doc["candidates"][0]["memory_bytes"]["optimizer"] >= k * stage_params / 16


def test_zero3_style_per_tensor_is_slower_across_nodes(capsys):
    argv = ["plan", "--model", "gpt3-175b", "--gpus", "1536", "--global-batch", "1536", "--json", "--top", "1",
            "--layout", "dp=1536,tp=1,pp=1,zero=3,mb=1,recompute=full"]
    times = []
    for extra in ([], ["--zero3-style", "per-tensor"], ["--zero3-style", "per-tensor", "--zero3-bw", "20"]):
        code, out, _ = run(capsys, *argv, *extra)
        assert code == 0
        times.append(json.loads(out)["candidates"][0]["step_time_s"])
    assert times[0] < times[1] < times[2]


def test_config_mode_predicts_the_run(capsys, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: {n_layers: 2, d_model: 64, n_heads: 4, seq_len: 32}\n"
                   "train: {global_batch: 4, micro_batch: 2}\n")
    code, out, _ = run(capsys, "plan", "--config", str(cfg), "--gpu", "a100-80gb", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["run_prediction"]["plan_mem_params"] == doc["model"]["params"] * 4


def test_config_mode_calibrates_this_machine_for_the_runs_step_time(capsys, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: {n_layers: 2, d_model: 32, n_heads: 4, seq_len: 32}\n"
                   "train: {global_batch: 4, micro_batch: 2}\n")
    code, out, _ = run(capsys, "plan", "--config", str(cfg), "--calibrate", "--json")
    assert code == 0
    doc = json.loads(out)
    (cand,) = doc["candidates"]
    assert doc["cluster"]["gpu"]["name"].startswith("calibrated-")
    assert cand["step_time_s"] == doc["run_step_time_s"] > 0
    parts = cand["time_breakdown_s"]
    assert parts["compute"] > 0 and parts["optimizer"] > 0 and parts["dp_comm"] == 0  # one process
    assert sum(parts.values()) == pytest.approx(cand["step_time_s"])


CONFIG_LAYOUTS = [  # --set overrides of a run config -> the layout fields the plan must show
    (["parallel.tp=2", "parallel.sequence_parallel=true", "train.dtype=bf16"],
     {"tp": 2, "sequence_parallel": True, "dp": 1, "pp": 1, "zero": 0}),
    (["parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2", "model.n_layers=4"],
     {"pp": 2, "schedule": "interleaved", "virtual_stages": 2, "micro_batch": 2}),
    (["parallel.dp=2", "parallel.zero=3", "parallel.offload=params", "train.dtype=fp16"],
     {"dp": 2, "zero": 3, "offload": "params"}),
    (["parallel.dp=2", "parallel.zero=1", "memory.recompute=every:2", "model.n_layers=4"],
     {"dp": 2, "zero": 1, "recompute": "every:2"}),
    (["memory.recompute=selective", "model.dropout=0.1"], {"recompute": "selective"}),
    (["parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "parallel.zero=1", "memory.recompute=full"],
     {"tp": 2, "pp": 2, "dp": 2, "zero": 1, "recompute": "full", "sequence_parallel": False}),
]


@pytest.mark.parametrize("overrides,layout", CONFIG_LAYOUTS, ids=lambda x: ",".join(x) if isinstance(x, list) else "")
def test_config_mode_describes_the_layout_the_trainer_runs(capsys, tmp_path, overrides, layout):
    from scaletrain.config import load_config
    from scaletrain.plan.exact.run_memory import predict_run

    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: {n_layers: 2, d_model: 64, n_heads: 4, seq_len: 32}\n"
                   "train: {global_batch: 8, micro_batch: 2}\n")
    argv = ["plan", "--config", str(cfg), "--gpu", "a100-80gb", "--json"]
    for o in overrides:
        argv += ["--set", o]
    code, out, _ = run(capsys, *argv)
    assert code == 0
    doc = json.loads(out)
    (cand,) = doc["candidates"]
    for key, value in layout.items():
        assert cand["layout"][key] == value, key
    run_cfg = load_config(cfg, overrides)
    assert cand["layout"]["dp"] * cand["layout"]["tp"] * cand["layout"]["pp"] == run_cfg.world_size
    pred = predict_run(run_cfg)
    assert doc["run_prediction"] == pred
    for key, name in (("params", "plan_mem_params"), ("grads", "plan_mem_grads"), ("optimizer", "plan_mem_optim"),
                      ("activations", "plan_mem_activations")):
        assert cand["memory_bytes"][key] == pred[name], key


@pytest.mark.parametrize("argv,message", [
    (["plan", "--model", "gpt3-175b", "--gpu", "tpu9", "--gpus", "8", "--global-batch", "8"], "unknown GPU 'tpu9'"),
    (["plan", "--model", "gpt7", "--gpus", "8", "--global-batch", "8"], "unknown model 'gpt7'"),
    (BASE + ["--layout", "dp=2,tp=8,pp=8"], "does not match --gpus (1024)"),
    (BASE + ["--layout", "tp=5"], "does not divide --gpus"),
    (["plan", "--model", "gpt3-175b", "--gpus", "960", "--global-batch", "1920", "--layout", "tp=5,pp=1"],
     "heads (96) is not divisible by tp (5)"),
    (["plan", "--model", "gpt3-175b", "--gpus", "640", "--global-batch", "1280", "--layout",
      "pp=5,tp=8,partition=uniform"], "layers (96) is not divisible by pp (5) x virtual_stages (1) = 5"),
    (["plan", "--layers", "4", "--hidden", "100", "--heads", "3", "--vocab", "10", "--seq-len", "8",
      "--gpus", "1", "--global-batch", "1"], "hidden size (100) is not divisible by heads (3)"),
    (BASE + ["--layout", "recompute=sometimes"], "recompute must be none, full, every:k, nth:k"),
    (BASE + ["--layout", "recompute=ops:softmax"], "op kind softmax is not one of matmul, attention"),
    (["plan", "--model", "gpt2", "--global-batch", "8"], "--gpus is required"),
    (BASE + ["--zero3-bw", "0"], "--zero3-bw must be a positive bandwidth in GB/s, got 0.0"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_catalog_model_and_its_dimensions_with_equal_flags_predict_the_same(capsys):
    """megatron-1.7b keeps dropout masks (Korthikanti's 34sbh); the same dims predict the same with --dropout, and
    the plan prints that assumption either way."""
    lay = ["--gpus", "64", "--global-batch", "512", "--top", "3", "--layout", "tp=1,pp=1"]
    dims = ["--layers", "24", "--hidden", "2304", "--heads", "24", "--vocab", "51200", "--seq-len", "2048"]
    _, cat, _ = run(capsys, "plan", "--model", "megatron-1.7b", *lay, "--json")
    _, same, _ = run(capsys, "plan", *dims, "--dropout", *lay, "--json")
    _, other, _ = run(capsys, "plan", *dims, *lay, "--json")
    assert json.loads(cat)["candidates"] == json.loads(same)["candidates"] != json.loads(other)["candidates"]
    _, text, _ = run(capsys, "plan", "--model", "megatron-1.7b", *lay)
    assert "--vocab 51200 --seq-len 2048 --ffn 9216 --mlp gelu --kv-heads 24 --position learned " \
           "--tie-embeddings --bias --dropout" in " ".join(text.split())
    _, text, _ = run(capsys, "plan", *dims, *lay)
    assert "--no-dropout" in " ".join(text.split())


def test_every_catalog_entry_is_rebuilt_by_the_flags_the_plan_prints():
    """No hidden attribute: the printed flags, given as custom dimensions, give the same ModelSpec (name aside)."""
    from scaletrain.cli import build_parser
    from scaletrain.commands.plan import _model, model_flags
    from scaletrain.plan import catalog

    def spec(m):
        return {**m.to_dict(), "name": "", "source": "", "n_kv_heads": m.kv_heads}

    for name, m in catalog.MODELS.items():
        args = build_parser().parse_args(["plan", *model_flags(m).split()])
        assert spec(_model(args)) == spec(m), name
        over = build_parser().parse_args(["plan", "--model", name, "--no-dropout", "--position", "rope"])
        assert (_model(over).dropout, _model(over).position) == (False, "rope")  # flags override an entry
