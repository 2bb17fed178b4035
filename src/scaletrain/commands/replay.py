"""The `scaletrain replay` command line, torch-free so that `scaletrain --help`, `plan` and `scaling` start
without importing torch; the command itself is `train/replay_check.py` (Hogwild, arXiv 1106.5730;
parameter servers, Li et al. OSDI 2014), for replica runs `train/replica_replay.py`, and for PipeDream runs
(arXiv 1806.03377) `train/pipedream_replay.py`."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="replay an asynchronous run (ps, locked hogwild, PipeDream) from its version "
                                      "log, or a replica run (parallel.replicas) from its membership log, and compare "
                                      "with its final parameters")
    p.add_argument("--out", required=True, help="the run's output directory")
    p.add_argument("--json", action="store_true", help="machine-readable result on stdout")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from scaletrain.train.replay_check import cmd_replay

    return cmd_replay(args)
