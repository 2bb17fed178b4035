"""`scaletrain replay --out RUN` (parsed in `scaletrain.commands.replay`): replay a finished ps or locked-Hogwild run
from its version log in one process and check that it reproduces the run's final parameters bit for bit
(docs/async.md)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import yaml

from scaletrain.config import config_from_dict, validate
from scaletrain.config.run import current_config
from scaletrain.errors import CheckpointError, UserError
from scaletrain.parallel.async_dp.model import WorkerModel
from scaletrain.parallel.async_dp.replay import replay
from scaletrain.parallel.async_dp.server import ShardLayout
from scaletrain.parallel.async_dp.versions import VersionLog
from scaletrain.train.runners import rank_checkpoint as ckpt
from scaletrain.train.runners.common import find_resume


def final_params(out: Path, cfg) -> tuple[dict[str, torch.Tensor], int]:
    """The run's parameters at its newest checkpoint (gathered from the servers' shards for ps), and its step."""
    found, meta = find_resume(out, cfg)
    if found is None:
        raise CheckpointError(f"no complete checkpoint in {out / 'checkpoints'}")
    model = WorkerModel(cfg, torch.device("cpu"))
    flat = torch.empty_like(model.flat)
    if cfg.parallel.sync == "ps":
        layout = ShardLayout(model.numels, cfg.parallel.servers)
        for s in range(cfg.parallel.servers):
            shard = ckpt.load_rank(found, s)["params"]
            if shard.numel() != layout.sizes[s]:
                raise CheckpointError(f"checkpoint {found}: server {s} holds {shard.numel()} parameters, the layout "
                                      f"{layout.sizes[s]}")
            layout.scatter(shard, s, flat)
    else:
        flat.copy_(ckpt.load_rank(found, 0)["params"])
    return model.state_with(flat), int(meta["step"])


def cmd_replay(args) -> int:
    out = Path(args.out)
    if not (out / "config.yaml").is_file():
        raise UserError(f"{out} is not a scaletrain run (no config.yaml)")
    try:
        cfg = validate(config_from_dict(current_config(out)))  # config.yaml with the changes resumes recorded
    except yaml.YAMLError:
        raise UserError(f"{out / 'config.yaml'} is not valid YAML") from None
    if cfg.parallel.replicas > 1:  # a fault-tolerant replica run: its membership log (train/replica_replay.py)
        from scaletrain.train.replica_replay import cmd_replay_replicas

        return cmd_replay_replicas(out, cfg, args.json)
    if cfg.parallel.schedule == "pipedream" and cfg.parallel.pp > 1:  # its version log (train/pipedream_replay.py)
        from scaletrain.train.pipedream_replay import cmd_replay_pipedream

        return cmd_replay_pipedream(out, cfg, args.json)
    if cfg.parallel.sync not in ("ps", "hogwild"):
        raise UserError(f"{out} is a parallel.sync={cfg.parallel.sync} run; only ps, hogwild and "
                        "parallel.schedule=pipedream runs have a version log")
    log = VersionLog.load(out / "version_log.jsonl")
    params, step = final_params(out, cfg)
    expect = step if cfg.parallel.sync == "ps" else step * cfg.parallel.dp
    if len(log.updates) != expect:
        raise CheckpointError(f"{out}: the version log has {len(log.updates)} updates, the newest checkpoint "
                              f"(step {step}) {expect}")
    t0 = time.perf_counter()
    result = replay(cfg, log)
    seconds = time.perf_counter() - t0
    diff = max(float((result.params[k] - params[k]).abs().max()) for k in params)
    same = all(torch.equal(result.params[k], params[k]) for k in params)
    summary = {"run": str(out), "sync": cfg.parallel.sync, "step": step, **log.summary(),
               "max_abs_diff": diff, "bit_identical": same, "replay_s": seconds}
    if args.json:
        json.dump(summary, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(f"replayed {summary['updates']} updates ({summary['gradients']} gradients, staleness max "
              f"{summary['staleness_max']}, mean {summary['staleness_mean']:.2f}) of {out} in {seconds:.1f} s")
        print(f"largest parameter difference {diff:.3g}: " + ("PASS (bit-identical)" if same else "FAIL"))
    return 0 if same else 1
