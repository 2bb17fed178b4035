"""A fault-tolerant replica run started from Hugging Face weights (`scaletrain train --init-from DIR` with
parallel.replicas = 2, one process per group, fp64; docs/fault_tolerance.md, train/replica_init.py). The launcher
imports DIR's weights once and writes them as the run's start checkpoint (step 0); both groups start from it, the
membership log names it, and `scaletrain replay` starts from it. The run is compared with the plain one-process
Trainer started from the same directory (train/resume.py's own --init-from path, which reads DIR directly): every
step's loss and every final parameter, bound 1e-12. The model is a tiny random GPT-2 made here with transformers."""

import json

import pytest
import torch

from scaletrain.cli import main
from scaletrain.train import checkpoint as ckpt
from scaletrain.train.replica_replay import TOLERANCE, load_log
from tests.test_replicas import _finals, _max_diff, _train

pytestmark = pytest.mark.usefixtures("one_thread")

# --init-from: only training choices (model.seq_len is one); every other model key comes from config.json
RUN = {"model.seq_len": 32, "train.steps": 3, "train.global_batch": 4, "train.micro_batch": 2,
       "train.warmup_steps": 1, "train.eval_every": 0, "train.dtype": "fp64", "train.lr": 3e-3,
       "train.checkpoint_every": 0, "train.report": False}
REPLICAS = {"parallel.dp": 2, "parallel.replicas": 2, "parallel.heartbeat_s": 10.0}  # no drop under load: none dies


def _tiny_gpt2(directory) -> None:
    """A random transformers GPT-2 (2 layers, width 32, bytes as tokens), its norms and biases moved off 1 and 0."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_positions=64, n_embd=32, n_layer=2, n_head=4, vocab_size=256,
                                     bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(directory)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf")
    _tiny_gpt2(directory)
    return directory


def _one_process(hf_dir, out) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """The plain Trainer of the same run in one process, started from `hf_dir` by its own --init-from path."""
    from scaletrain.config import validate
    from scaletrain.config.load import load_config_keys
    from scaletrain.interop.hf_config import apply_hf_model
    from scaletrain.train.trainer import Trainer

    cfg, explicit = load_config_keys(None, [f"{k}={v}" for k, v in RUN.items()])
    apply_hf_model(cfg, explicit, hf_dir)
    trainer = Trainer(validate(cfg, 1), out, None, init_from=hf_dir)
    result = trainer.run()
    return result.losses, trainer.full_state()


def test_replica_run_from_hugging_face_weights_equals_one_process_from_them_and_its_replay(hf_dir, tmp_path, capsys):
    from scaletrain.interop.hf import read_hf_weights

    out = tmp_path / "run"
    p = _train(out, {**RUN, **REPLICAS}, "", "--init-from", str(hf_dir))
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count(f"initialised from {hf_dir}") == 1  # said once, by the launcher
    assert f"every group started from the weights of {hf_dir.resolve()}" in p.stdout
    rows = load_log(out)
    assert rows[0]["init_from"] == str(hf_dir.resolve())
    assert rows[0]["start_checkpoint"] == "replicas/init/step_00000000" and "resumed_from" not in rows[0]
    assert [(r["step"], r["members"]) for r in rows if r["committed"]] == [(1, [0, 1]), (2, [0, 1]), (3, [0, 1])]
    # the start checkpoint holds exactly the imported weights (in the run's fp64) and no optimizer state
    start = ckpt.read_tensors(out / rows[0]["start_checkpoint"])
    from scaletrain.config import load_config

    imported = read_hf_weights(hf_dir, load_config(out / "config.yaml").model)
    assert sorted(start) == sorted(imported)
    assert all(torch.equal(start[k], imported[k].to(torch.float64)) for k in imported)
    finals = _finals(out)
    assert sorted(finals) == ["final-group0", "final-group1"]
    assert _max_diff(finals["final-group0"], finals["final-group1"]) == 0.0
    # independent of the start checkpoint: one process started from DIR by the plain Trainer
    losses, ref = _one_process(hf_dir, tmp_path / "one")
    group = [json.loads(x) for x in (out / "replicas" / "group0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in group] == [1, 2, 3]
    loss_diff = max(abs(r["loss"] - losses[r["step"]]) for r in group)
    param_diff = _max_diff(ref, finals["final-group0"])
    assert loss_diff <= TOLERANCE and param_diff <= TOLERANCE
    capsys.readouterr()
    assert main(["replay", "--out", str(out), "--json"]) == 0  # from the start checkpoint the log names
    summary = json.loads(capsys.readouterr().out)
    assert summary["pass"] and summary["steps"] == 3
    print(f"one process vs replica run: losses {loss_diff:.3g}, parameters {param_diff:.3g}; replay vs run: "
          f"{max(summary['max_abs_diff'].values()):.3g}")


@pytest.mark.parametrize("extra", [{"parallel.tp": 2}, {"model.dropout": 0.1}])
def test_init_from_into_untested_replica_runs_is_refused_in_one_line(hf_dir, tmp_path, capsys, extra):
    sets = [x for k, v in {**RUN, **REPLICAS, **extra}.items() for x in ("--set", f"{k}={v}")]
    assert main(["train", "--out", str(tmp_path / "o"), "--init-from", str(hf_dir), *sets]) == 2
    err = capsys.readouterr().err
    assert "--init-from with parallel.replicas (2) needs dense groups of one process" in err
    assert f"got {2 if extra.get('parallel.tp') else 1} processes per group" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "o").exists()


def test_replay_of_a_run_whose_start_checkpoint_is_gone_is_one_line(tmp_path, capsys):
    from scaletrain.config import load_config

    out = tmp_path / "run"
    (out / "replicas").mkdir(parents=True)
    sets = [f"{k}={v}" for k, v in {**RUN, **REPLICAS, "model.n_layers": 2, "model.d_model": 32,
                                     "model.n_heads": 4}.items()]
    (out / "config.yaml").write_text(load_config(None, sets).to_yaml())
    row = {"round": 0, "step": 1, "members": [0, 1], "behind": [], "heal": {}, "dropped": [], "committed": True,
           "time": 0.0, "init_from": "/gone/hf", "start_checkpoint": "replicas/init/step_00000000"}
    (out / "membership.jsonl").write_text(json.dumps(row) + "\n")
    torch.save({"step": 1, "params": {}}, out / "replicas" / "final-group0.pt")
    assert main(["replay", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "started from the weights of /gone/hf" in err and len(err.strip().splitlines()) == 1
