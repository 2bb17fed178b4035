"""`scaletrain demo` end to end, as `make demo` runs it, with `--steps 8` instead of 400 and a smaller model through
the demo's own `--set` (the demo's code path is the same: configs/demo.yaml with overrides, one process, then the
proofs, which train their own small model whatever the demo's): the GPT trains on the embedded corpus and writes its
outputs; the summary names the parameters, the loss at the first and last step, the throughput, the outputs and the
memory measured beside the planner's prediction (equal, category by category); then both proofs (data parallel 2 x
ZeRO-3, tensor parallel 2 with sequence parallelism) run on 2 processes and PASS. The preset's own size (6 layers,
d_model 192) is checked by loading configs/demo.yaml without overrides (its ~2-3 minute run is `make demo`)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

STEPS = 8
SMALL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=2"]  # the test's model: ~35x less work per step


def test_demo_trains_summarises_and_proves_both_layouts(tmp_path):
    out = tmp_path / "demo"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sets = [a for x in SMALL for a in ("--set", x)]
    p = subprocess.run([sys.executable, "-m", "scaletrain", "demo", "--steps", str(STEPS), *sets, "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    text = p.stdout
    assert p.returncode == 0, text + p.stderr
    assert text.startswith(f"scaletrain demo: 2-layer GPT (d_model 64) on the embedded corpus (Python standard "
                           f"library sources), {STEPS} steps -> {out}")

    # the summary
    params = int(re.search(r"^parameters\s+([\d,]+)$", text, re.M).group(1).replace(",", ""))
    from scaletrain.config import load_config
    from scaletrain.plan import predict_run

    cfg = load_config(out / "config.yaml", [])
    d, n, v = cfg.model.d_model, cfg.model.n_layers, cfg.model.vocab_size
    assert params == v * d + cfg.model.seq_len * d + n * (12 * d * d + 13 * d) + 2 * d  # GPT-2 blocks, tied head
    first, last = (float(x) for x in re.search(r"^loss\s+([\d.]+) \(step 1\) -> ([\d.]+) \(step 8\)$", text,
                                               re.M).groups())
    assert abs(first - math.log(256)) < 0.5 and last < first  # starts near uniform over bytes, and learns
    assert re.search(rf"^throughput\s+[\d,]+ tokens/s over {STEPS} steps", text, re.M)
    assert f"outputs         {out}/metrics.jsonl, {out}/checkpoints/, loss curve {out}/loss.png" in text
    memory = re.search(r"^memory MiB/rank (.*)$", text, re.M).group(1)
    pairs = re.findall(r"(\w+) ([\d.]+) \(plan ([\d.]+)\)", memory)
    assert [c for c, _, _ in pairs] == ["params", "grads", "optim", "activations"]
    assert all(measured == planned for _, measured, planned in pairs), memory
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4, 6, 8]
    assert all(r[f"mem_{c}"] == r[f"plan_mem_{c}"] for r in rows[:1] for c, _, _ in pairs)
    assert predict_run(cfg)["plan_mem_params"] == rows[0]["mem_params"]
    for f in ("loss.png", "report.html", "config.yaml", ".scaletrain-run"):
        assert (out / f).is_file(), f
    assert sorted(x.name for x in (out / "checkpoints").iterdir()) == ["step_00000004", "step_00000008"]

    # both proofs: 3 steps side by side, then PASS
    proofs = text.split("\n== ")[1:]
    assert [x.splitlines()[0] for x in proofs] == ["data parallel 2 x ZeRO-3", "tensor parallel 2 + sequence parallel"]
    for proof in proofs:
        steps = re.findall(r"^\s+(\d) +(\d+\.\d{12}) +(\d+\.\d{12}) +(\S+)$", proof, re.M)
        assert [int(s) for s, _, _, _ in steps] == [1, 2, 3], proof
        assert all(abs(float(a) - float(b)) <= 1e-9 * float(a) for _, a, b, _ in steps), proof
        assert proof.rstrip().endswith("PASS (rtol 1e-09, atol 1e-11)"), proof


def test_demo_preset_is_the_documented_six_layer_gpt_of_400_steps():
    """configs/demo.yaml as `make demo` loads it (no overrides): the size the README and the demo's banner name."""
    from importlib import resources

    from scaletrain.config import load_config, validate

    with resources.as_file(resources.files("scaletrain").joinpath("configs/demo.yaml")) as path:
        cfg = validate(load_config(path, []), 1)
    assert (cfg.model.n_layers, cfg.model.d_model, cfg.model.n_heads, cfg.model.seq_len) == (6, 192, 6, 128)
    assert (cfg.train.steps, cfg.train.warmup_steps, cfg.train.eval_every, cfg.train.checkpoint_every) == (400, 40, 100,
                                                                                                           200)
