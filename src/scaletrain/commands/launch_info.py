"""`scaletrain launch-info`: what this node will use in a multi-node job, before anything is started.

On its own it prints this host's view: its name and what that resolves to (Debian's 127.0.1.1 trap), the
rendezvous endpoint and whether this host is it, the interface and address gloo / NCCL will use (and
why), what `--out` is (exists, writable, which filesystem - a network filesystem can be shared, a local
one cannot), and the exact torchrun line for this node. Under torchrun (one rank per process, on every
node) it runs the real start-up checks of `scaletrain train` - shared `--out` marker, versions, config
hashes, interface choice - and rank 0 prints one row per rank; a problem is one line and exit 2.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from scaletrain.errors import UserError
from scaletrain.guards import MAX_GPUS, bounded_int
from scaletrain.multinode import network

NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
                       "fuse.glusterfs", "fuse.sshfs", "fuse.juicefs", "fuse.s3fs", "fuse.gcsfuse", "wekafs", "panfs",
                       "9p", "virtiofs", "afs", "orangefs", "pvfs2", "fuse.ceph-fuse", "fuse.lustre")


def add_parser(sub) -> None:
    p = sub.add_parser("launch-info", help="what this node will use in a multi-node job (network, --out, torchrun "
                                           "line); under torchrun: the start-up checks of every rank")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="the rendezvous endpoint (default: MASTER_ADDR:MASTER_PORT when set)")
    p.add_argument("--out", default=None, help="the run's output folder, to check it")
    p.add_argument("--nnodes", type=bounded_int(1, MAX_GPUS), default=2, help="nodes, for the printed torchrun line")
    p.add_argument("--nproc", type=bounded_int(1, MAX_GPUS), default=1,
                   help="processes per node, for the printed torchrun line")
    p.add_argument("--config", default=None, help="YAML config (under torchrun: compared between ranks)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    p.set_defaults(func=cmd_launch_info)


def filesystem(path: Path) -> tuple[str, str]:
    """(filesystem type, mount point) of `path`'s nearest existing ancestor."""
    import psutil

    p = path.resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    best = ("?", "/")
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (str(p) == mp or str(p).startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best[1]):
            best = (part.fstype, mp)
    return best


def out_report(out: Path) -> str:
    fstype, mount = filesystem(out)
    where = "exists" if out.is_dir() else ("is a file" if out.exists() else "does not exist yet")
    writable = os.access(out if out.exists() else _existing_parent(out), os.W_OK)
    kind = ("a network filesystem: can be shared by all nodes" if fstype in NETWORK_FILESYSTEMS or fstype.startswith(
        "fuse.") else "a local filesystem: other nodes cannot see it unless it is mounted there too")
    return (f"{out.resolve()}: {where}, {'writable' if writable else 'NOT writable'}, {fstype} at {mount} ({kind}); "
            "every rank checks it at start-up")


def _literal_loopback(host: str) -> bool:
    return host == "localhost" or network.is_loopback(host)


def _existing_parent(p: Path) -> Path:
    p = p.resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def cmd_launch_info(args) -> int:
    from scaletrain.distributed.process_group import detect_env

    env = detect_env()
    if env is not None and env.world_size > 1:
        return _in_job(args, env)
    endpoint = args.rdzv_endpoint or (f"{os.environ['MASTER_ADDR']}:{os.environ.get('MASTER_PORT', '29500')}"
                                      if "MASTER_ADDR" in os.environ else None)
    name, addrs = network.hostname_report()
    rows = [("host", f"{name} resolves to {', '.join(addrs) or 'nothing'}"
             + (" (loopback only: torchrun's default --local-addr would not reach this host from another node)"
                if addrs and all(network.is_loopback(a) for a in addrs) else ""))]
    table = network.interfaces()
    rows.append(("interfaces", "; ".join(f"{n} {' '.join(a)}" for n, a in sorted(table.items()))))
    if endpoint:
        from scaletrain.multinode.launcher import torchrun_nodes_command

        host, port = network.split_endpoint(endpoint)
        here = network.is_this_host(host)
        rows.append(("rendezvous", f"{host}:{port} = {', '.join(network.resolve(host)) or 'unresolvable'} "
                     f"({'this host: it runs the rendezvous store' if here else 'another host'})"))
        from scaletrain.multinode.launcher import local_address

        for var in network.SOCKET_VARS:
            chosen = network.from_variable(var)
            how = chosen or network.route_to(host)
            if chosen is None and network.is_loopback(how.address) and not _literal_loopback(host):
                how = local_address(host)
            rows.append((var.split("_")[0].lower(), f"{how.interface} {how.address} ({how.reason})"
                         + ("" if chosen else f"; set {var} to override")))
        argv = ["train", "--config", "run.yaml", "--out", str(args.out or "/shared/runs/r1")]
        cmd, choice, _ = torchrun_nodes_command(args.nnodes, args.nproc, endpoint, argv)
        line = " ".join(["torchrun", *cmd[3:]])
        rows.append(("torchrun", line))
        rows.append(("or", f"scaletrain train --nnodes {args.nnodes} --nproc {args.nproc} --rdzv-endpoint {endpoint} "
                           f"--config run.yaml --out {args.out or '/shared/runs/r1'}   (same flags, filled in)"))
    else:
        rows.append(("rendezvous", "none given (--rdzv-endpoint HOST:PORT): the network choice depends on it"))
    if args.out:
        rows.append(("--out", out_report(Path(args.out))))
    width = max(len(k) for k, _ in rows)
    print(f"launch-info for host {socket.gethostname()}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    return 0


def _in_job(args, env) -> int:
    """Every rank: the start-up checks of a real run (without building a model); rank 0 prints them."""
    from scaletrain.config import load_config, validate
    from scaletrain.distributed import process_group as distributed
    from scaletrain.multinode.job import supervise

    cfg = validate(load_config(args.config, args.set))
    device = distributed.pick_device(cfg.train.device, env.local_rank)
    out = Path(args.out) if args.out else None
    try:
        with supervise(cfg, out, env, device) as job:
            facts = list(job.facts)
    except UserError:
        distributed.shutdown(clean=False)
        raise
    distributed.shutdown()
    if env.rank != 0:
        return 0
    print(f"launch-info: {env.world_size} ranks on {len({f.host for f in facts})} hosts; start-up checks passed"
          + (f"; --out {out} is shared" if out is not None else ""))
    print(f"{'rank':>4} {'host':<16} {'local':>5} {'interface':<12} {'address':<16} {'torch':<14} {'scaletrain':<10} "
          "network choice")
    for f in facts:
        print(f"{f.rank:>4} {f.host:<16} {f.local_rank:>5} {f.interface or '-':<12} {f.address or '-':<16} "
              f"{f.torch:<14} {f.scaletrain:<10} {f.net_reason}")
    sys.stdout.flush()
    return 0
