"""Local launch of a parameter-server job: one process per rank, supervised, so that a worker may die.

torchrun's agent stops every process of a job as soon as one exits; a parameter server that tolerates the loss
of a worker (`parallel.ps_tolerate_loss`) needs a launcher that does not. `scaletrain train --nproc N` with
`parallel.sync=ps` therefore starts its N ranks itself, with the environment torchrun would give them (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and the rendezvous store hosted here (TORCHELASTIC_USE_AGENT_STORE,
as torchrun's agent hosts it), and watches them:

- a rank that fails with an error report (`OUT/logs/rankN.error.json`, written by `launch.WorkerContext`) stops
  the job and is reported like any launch failure (exit 2 for bad input, 1 otherwise);
- a worker that dies without one (a signal, a crash) is named: "worker 1 (rank 2) died (killed by SIGKILL)".
  With ps_tolerate_loss its death is written to the store, where the coordinator reads it and hands its work to
  the other workers; otherwise the other ranks are stopped and the launcher exits 1.
- a server's death always stops the job (it holds a shard of the only copy of the parameters).

`OUT/logs/ranks.json` lists each rank's role and process id.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from scaletrain.config import Config
from scaletrain.distributed.launch import LOG_DIR_ENV, free_port, report_failure, stop_signals
from scaletrain.train.runners.ps import DEAD_KEY


def role(rank: int, servers: int) -> str:
    return f"server {rank}" if rank < servers else f"worker {rank - servers}"


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def launch_ps(nproc: int, argv: list[str], out_dir: Path, cfg: Config) -> int:
    """Run `scaletrain <argv>` on `nproc` supervised local ranks; returns the exit code for the user."""
    import torch.distributed as dist

    p = cfg.parallel
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    for old in logs.glob("rank*.error.json"):
        old.unlink()
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=p.timeout_s))
    base = dict(os.environ)
    base.update({LOG_DIR_ENV: str(logs.resolve()), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                 "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "TORCHELASTIC_USE_AGENT_STORE": "True"})
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    procs: list[subprocess.Popen] = []
    with open(logs / "launcher.log", "a") as launcher_log, stop_signals():  # SIGTERM/SIGHUP: every rank stopped
        try:
            for rank in range(nproc):
                env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
                procs.append(subprocess.Popen([sys.executable, "-m", "scaletrain", *argv], env=env,
                                              stderr=launcher_log))
            (logs / "ranks.json").write_text(json.dumps(
                {str(r): {"role": role(r, p.servers), "pid": q.pid} for r, q in enumerate(procs)}, indent=1))
            return _supervise(procs, cfg, store, logs)
        except KeyboardInterrupt:
            _stop(procs)
            raise
        finally:
            _stop(procs)


def _supervise(procs: list[subprocess.Popen], cfg: Config, store, logs: Path) -> int:
    servers, tolerate = cfg.parallel.servers, cfg.parallel.ps_tolerate_loss
    done: dict[int, int] = {}
    tolerated: set[int] = set()
    while len(done) < len(procs):
        failed = []
        for rank, q in enumerate(procs):
            if rank in done or q.poll() is None:
                continue
            done[rank] = q.returncode
            if q.returncode != 0:
                failed.append(rank)
        for rank in failed:
            code = done[rank]
            crashed = not (logs / f"rank{rank}.error.json").exists()
            if rank >= servers and tolerate and crashed:
                store.set(DEAD_KEY.format(rank=rank), describe_exit(code))
                tolerated.add(rank)
                sys.stderr.write(f"scaletrain: {role(rank, servers)} (rank {rank}) died ({describe_exit(code)}); "
                                 "the job continues without it (parallel.ps_tolerate_loss)\n")
                continue
            time.sleep(0.3)  # let simultaneous exits land, then name the cause
            for r, q in enumerate(procs):
                if r not in done and q.poll() is not None:
                    done[r] = q.returncode
            killed = [r for r, c in sorted(done.items()) if c < 0 and r not in tolerated]
            _stop(procs)
            if killed or crashed:
                cause = killed[0] if killed else rank
                sys.stderr.write(f"scaletrain: error: {role(cause, servers)} (rank {cause}) died "
                                 f"({describe_exit(done[cause])}); the job was stopped\n")
                return 1
            return report_failure(logs, code)
        time.sleep(0.1)
    return 0


def _stop(procs: list[subprocess.Popen]) -> None:
    alive = [q for q in procs if q.poll() is None]
    for q in alive:
        q.terminate()
    deadline = time.monotonic() + 10
    for q in alive:
        try:
            q.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            q.kill()
            q.wait()
