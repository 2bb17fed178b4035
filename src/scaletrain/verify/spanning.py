"""`scaletrain verify` inside a torchrun / SLURM job: the parallel side spans every node of the job.

Every rank trains the layout under supervision (pre-flight, heartbeat, flight recorder, as `train` does);
rank 0 gathers the final parameters, the process group is closed, and rank 0 alone runs the
single-process reference of the same model, data and seed and prints the comparison. The other ranks exit
as soon as the parallel part is done.
"""

from __future__ import annotations

import sys

from scaletrain.config import Config, validate
from scaletrain.distributed.process_group import DistEnv


def verify_in_job(cfg: Config, args, env: DistEnv) -> int:
    from scaletrain.distributed import process_group as distributed
    from scaletrain.distributed.launch import WorkerContext
    from scaletrain.multinode.job import supervise
    from scaletrain.verify.run import layout_words, reference_config, report, run

    validate(cfg, env.world_size)
    ref_cfg = reference_config(cfg)
    with WorkerContext(env.rank):
        device = distributed.pick_device(cfg.train.device, env.local_rank)
        try:
            with supervise(cfg, None, env, device) as job:
                hosts = sorted(set(job.hosts), key=job.hosts.index)
                if env.rank == 0:
                    print(f"verify: {layout_words(cfg)} ({env.world_size} processes on "
                          f"{len(hosts)} host{'s' if len(hosts) > 1 else ''}: {', '.join(hosts)}) against 1 process, "
                          f"{cfg.train.steps} steps, {cfg.train.dtype}")
                    sys.stdout.flush()
                losses, state = run(cfg, env)
        except BaseException:
            distributed.shutdown(clean=False)
            raise
        distributed.shutdown()
    if env.rank != 0:
        return 0
    ref_losses, ref_state = run(ref_cfg)
    return report(ref_losses, ref_state, losses, state, args.rtol, args.atol)
