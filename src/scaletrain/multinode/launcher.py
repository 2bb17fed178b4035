"""`scaletrain train --nnodes N --rdzv-endpoint HOST:PORT`: torchrun on this node with what a multi-node job needs.

The same command runs on every node. It starts `python -m torch.distributed.run` with the c10d rendezvous
and fills in the flags a user otherwise learns the hard way (docs/multinode.md):

- `--local-addr`: this node's address on the interface that routes to the rendezvous host (what the other
  nodes must use to reach it; torchrun's default is the host name, which Debian resolves to 127.0.1.1);
- `--rdzv-conf is_host=1` on the rendezvous host itself (torch recognises it by resolving its host name,
  which fails when the endpoint is given as an address or the name resolves to loopback);
- `--max-restarts` from `--restarts`: after a failure every node's workers start again and resume from the
  newest complete checkpoint; a node that died can be replaced by starting the same command on a new one
  (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each rendezvous round its own worker store, without which a
  node joining a later round waits forever for that round's MASTER_ADDR).

torchrun's own output goes to `OUT/logs/launcher-<host>.log`; rank 0 (on whichever node it lands) prints the
progress and summary; a failure is one line on every node that is still alive, from the ranks' error
records (exit 2 for bad input such as a non-shared `--out`) or torchrun's summary (a rank killed by a
signal).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from scaletrain.errors import UserError
from scaletrain.guards import MAX_GPUS, bounded_int
from scaletrain.multinode import network


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `train` options for several machines and for restarts."""
    g = p.add_argument_group("several machines and restarts (docs/multinode.md)")
    g.add_argument("--nnodes", type=bounded_int(1, MAX_GPUS), default=1,
                   help="machines in the job: run the same command on each of them")
    g.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="rendezvous: one of the nodes (the same HOST on all) and a free port, e.g. node1:29400")
    g.add_argument("--restarts", type=bounded_int(0, 10_000), default=0, metavar="N",
                   help="start the workers again up to N times after a failure; each restart resumes from the newest "
                        "complete checkpoint (torchrun's --max-restarts)")


def check_arguments(args: argparse.Namespace) -> None:
    if args.nnodes < 1:
        raise UserError(f"--nnodes must be >= 1, got {args.nnodes}")
    if args.restarts < 0:
        raise UserError(f"--restarts must be >= 0, got {args.restarts}")
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise UserError(f"--nnodes {args.nnodes} needs --rdzv-endpoint HOST:PORT (one of the nodes, the same on all)")
    if args.rdzv_endpoint:
        network.split_endpoint(args.rdzv_endpoint)


def local_address(host: str) -> network.NetChoice:
    """The address the other nodes reach this one at: GLOO_SOCKET_IFNAME's, else the source address of the
    route to the rendezvous host; on the rendezvous host itself (the route is loopback) its only non-loopback
    interface, or the one holding the default route."""
    choice = network.from_variable("GLOO_SOCKET_IFNAME")
    if choice is not None and choice.address:
        return choice
    choice = network.route_to(host)
    if not network.is_loopback(choice.address):
        return choice
    table = network.interfaces()
    candidates = {name: [a for a in addrs if not network.is_loopback(a)] for name, addrs in table.items()}
    candidates = {n: a for n, a in candidates.items() if a}
    default = network.source_address("192.0.2.1")  # TEST-NET-1: a routing-table lookup, no packet is sent
    if default and not network.is_loopback(default):
        name = network.interface_of(default, table) or "?"
        return network.NetChoice(name, default, f"{host} is this host; the default route's interface")
    if len(candidates) == 1:
        name, addrs = next(iter(candidates.items()))
        return network.NetChoice(name, addrs[0], f"{host} is this host; its only other interface")
    raise UserError(f"{host} resolves to a loopback address on this host ({socket.gethostname()}) and its interfaces "
                    f"({', '.join(sorted(candidates)) or 'none'}) leave the choice open: set GLOO_SOCKET_IFNAME "
                    "(NCCL_SOCKET_IFNAME on GPUs) to the interface the other nodes reach")


RDZV_CONF_ENV = "PET_RDZV_CONF"
"""torchrun's variable for `--rdzv-conf` (e.g. `join_timeout=900,keep_alive_interval=2`): every node's agent reads
it; on the rendezvous host the launcher adds its settings after `is_host=1` (theirs win where both set a key)."""


def torchrun_nodes_command(nnodes: int, nproc: int, endpoint: str, argv: list[str],
                           restarts: int = 0) -> tuple[list[str], network.NetChoice, bool]:
    """(torchrun command line for this node, the address it publishes, whether it hosts the rendezvous)."""
    host, port = network.split_endpoint(endpoint)
    here = network.is_this_host(host)
    choice = local_address(host)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint={host}:{port}", f"--local-addr={choice.address}",
           f"--max-restarts={restarts}", "--monitor-interval=0.2"]
    if here and host != "localhost" and not network.is_loopback(host):
        # (a loopback endpoint: every agent is on this machine; torch decides). A --rdzv-conf on the command line
        # replaces torchrun's PET_RDZV_CONF, so the user's settings there (timeouts, keep-alive) follow is_host=1
        user = os.environ.get(RDZV_CONF_ENV, "").strip().strip(",")
        cmd += ["--rdzv-conf", ",".join(x for x in ("is_host=1", user) if x)]
    return [*cmd, "-m", "scaletrain", *argv], choice, here


def launch_nodes(nnodes: int, nproc: int, endpoint: str, argv: list[str], out_dir: Path, restarts: int = 0) -> int:
    """Run this node's part of a multi-node job; returns the exit code for the user."""
    from scaletrain.distributed.launch import LOG_DIR_ENV, report_failure, run_torchrun

    cmd, choice, here = torchrun_nodes_command(nnodes, nproc, endpoint, argv, restarts)
    logs = out_dir / "logs"
    try:
        logs.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out_dir} cannot be created on host {socket.gethostname()}: "
                        f"{e.strerror or e.__class__.__name__}") from None
    launcher_log = logs / f"launcher-{socket.gethostname()}.log"
    env = dict(os.environ)
    env[LOG_DIR_ENV] = str(logs.resolve())
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # a fresh worker store for every rendezvous round (rank 0's worker hosts it): with torchrun's shared store a
    # node that joins a later round (a replacement after a failure) waits forever for the MASTER_ADDR of that
    # round, which only a new rank-0 agent would publish (torch 2.13)
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    role = "rendezvous host" if here else "joins"
    sys.stderr.write(f"scaletrain: host {socket.gethostname()}: {nproc} ranks of {nnodes * nproc}, {role} "
                     f"{endpoint}, reachable at {choice.address} ({choice.interface}: {choice.reason})\n")
    rc = run_torchrun(cmd, env, launcher_log)
    return 0 if rc == 0 else report_failure(logs, rc, launcher_log)
