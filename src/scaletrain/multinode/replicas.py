"""Launching fault-tolerant replica groups (parallel.replicas > 1; docs/fault_tolerance.md), on one machine or on
several (`--nnodes N --rdzv-endpoint HOST:PORT`).

One lighthouse process (multinode/lighthouse.py: the store, the per-step quorum, the membership log) and one
torchrun agent per replica group, each with its own rendezvous and `--max-restarts=N` (`scaletrain train
--restarts N`): when a group dies only its agent restarts it, the new process heals from a live group and joins at
a step boundary while the others train on. Group g's output goes to `OUT/logs/group{g}.log`. When the lighthouse
has committed the last step, groups still running (a frozen one, a restart that came too late) are stopped.

On several machines the same command runs on each. The rendezvous host runs the lighthouse on HOST:PORT and is
node 0; the other nodes' launchers take indices 1, 2, ... from the lighthouse's store in the order they reach it;
node k runs the agents of groups k*R/N .. (k+1)*R/N - 1, with gloo on the interface that routes to HOST
(GLOO_SOCKET_IFNAME, as a multi-node job's ranks get it), so a group's cross-group sums and heals go between
machines and its own ranks stay on one. --out is shared: the host writes the membership log, each group its rows
and final parameters. A node that is lost takes its groups with it: the others go on without them (a group's agent
restarts a dead group, not a dead machine). A group the lighthouse excluded (its heal failed `parallel.heal_attempts`
rounds in a row; it writes `replicas/excluded-group{g}`) has its agent stopped at once, so it is not restarted; its
process stops itself with the lighthouse's line. Torch-free: the lighthouse and the groups import torch, this launcher
does not.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from scaletrain.distributed.launch import LOG_DIR_ENV, free_port, torchrun_command
from scaletrain.distributed.rows import computed_groups
from scaletrain.errors import UserError
from scaletrain.multinode import network

GRACE_S = 10.0  # after the last step: how long groups get to save and exit before they are stopped
LIGHTHOUSE_ENV = "SCALETRAIN_LIGHTHOUSE"
REPLICA_ENV = "SCALETRAIN_REPLICA"


def launch_replicas(groups: int, argv: list[str], out: Path, restarts: int, steps: int, heartbeat_s: float,
                    ranks: int = 1, nnodes: int = 1, endpoint: str | None = None, heal_attempts: int = 3,
                    missing_rows: str = "skip") -> int:
    """Run this machine's replica groups of `scaletrain <argv>` (`ranks` processes each, one torchrun agent per
    group; all of them, or with `endpoint` this node's share of `nnodes`); the exit code for the user (0: every
    step committed)."""
    logs, rep = out / "logs", out / "replicas"
    logs.mkdir(parents=True, exist_ok=True)
    rep.mkdir(parents=True, exist_ok=True)
    host, port = network.split_endpoint(endpoint) if endpoint else ("127.0.0.1", free_port())
    here = endpoint is None or network.is_this_host(host)
    env_all = dict(os.environ)
    if endpoint is not None and "GLOO_SOCKET_IFNAME" not in env_all:  # cross-group sums and heals between machines
        from scaletrain.multinode.launcher import local_address

        env_all["GLOO_SOCKET_IFNAME"] = local_address(host).interface
    lighthouse, lh_log = None, None
    if here:
        for mark in rep.glob("excluded-group*"):  # a whole-job resume gives every group a fresh start
            mark.unlink()
        lh_log = open(logs / "lighthouse.log", "w")
        lighthouse = subprocess.Popen([sys.executable, "-m", "scaletrain.multinode.lighthouse", "--port", str(port),
                                       "--groups", str(groups), "--steps", str(steps), "--heartbeat-s",
                                       str(heartbeat_s), "--log", str(out / "membership.jsonl"), "--linger-s", "2",
                                       "--ranks", str(ranks), "--heal-attempts", str(heal_attempts),
                                       "--marks", str(rep), "--missing-rows", missing_rows],
                                      stdout=lh_log, stderr=subprocess.STDOUT, start_new_session=True)
    agents: list[subprocess.Popen] = []
    mine: list[int] = []
    try:
        mine = _my_groups(groups, nnodes, f"{host}:{port}", here) if nnodes > 1 else list(range(groups))
        if nnodes > 1:
            sys.stderr.write(f"scaletrain: host {socket.gethostname()}: replica groups {mine} of {groups}, "
                             f"lighthouse {host}:{port}" + (" (here)" if here else "") +
                             f", gloo on {env_all['GLOO_SOCKET_IFNAME']}\n")
        for g in mine:
            env = dict(env_all)
            glogs = logs / f"group{g}"
            glogs.mkdir(exist_ok=True)
            env.update({LOG_DIR_ENV: str(glogs.resolve()), REPLICA_ENV: str(g), LIGHTHOUSE_ENV: f"{host}:{port}"})
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (len(mine) * ranks))))
            f = open(logs / f"group{g}.log", "w")
            agents.append(subprocess.Popen(torchrun_command(ranks, argv, restarts=restarts), env=env, stdout=f,
                                           stderr=subprocess.STDOUT, start_new_session=True))
        # the run goes on while the lighthouse does (on another node: until its log has the last step)
        while (lighthouse.poll() is None if lighthouse is not None else _log_steps(out) < steps) and \
                any(a.poll() is None for a in agents):
            for g, agent in zip(mine, agents):  # an excluded group: its agent must not restart it
                if agent.poll() is None and (rep / f"excluded-group{g}").exists():
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(agent.pid, signal.SIGKILL)
                    agent.wait()
            time.sleep(0.1)
        deadline = time.monotonic() + GRACE_S
        final = [g for g in _final_members(out, steps, None if here else deadline) if g in mine]
        # the groups of the last step save their parameters; the others (frozen, late) are stopped
        while (lighthouse is None or lighthouse.returncode is not None) and \
                any(agents[mine.index(g)].poll() is None for g in final):
            if time.monotonic() > deadline or all((rep / f"final-group{g}.pt").exists() for g in final):
                break
            time.sleep(0.1)
    finally:
        for proc in [*agents, *([lighthouse] if lighthouse is not None else [])]:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        stop_workers(rep, mine if nnodes > 1 else None)
        if lh_log is not None:
            lh_log.close()
    return report(out, groups, steps)


def _my_groups(groups: int, nnodes: int, address: str, here: bool) -> list[int]:
    """This node's replica groups (node k: k*R/N .. (k+1)*R/N - 1). The lighthouse's host is node 0; the others are
    numbered in the order their launchers reached its store (a short-lived process of multinode/lighthouse.py asks
    it: this launcher imports no torch)."""
    node, per = 0, groups // nnodes
    if not here:
        p = subprocess.run([sys.executable, "-m", "scaletrain.multinode.lighthouse", "--claim-node", address],
                           capture_output=True, text=True)
        if p.returncode != 0 or not p.stdout.strip().isdigit():
            raise UserError(f"cannot reach the replica run's lighthouse at {address} from host "
                            f"{socket.gethostname()}: {(p.stderr.strip().splitlines() or ['no answer'])[-1]}")
        node = int(p.stdout)
    if node >= nnodes:
        raise UserError(f"all {nnodes} nodes of the replica run at {address} have joined (this would be node "
                        f"{node + 1}): a lost node's groups are not taken over by a new one; start a new run, or "
                        "resume the whole job from its checkpoint")
    return list(range(node * per, (node + 1) * per))


def _log_steps(out: Path) -> int:
    """The last committed step of the membership log (0 before the first)."""
    committed = effective_rows(read_log(out))
    return committed[-1]["step"] if committed else 0


def _final_members(out: Path, steps: int, wait_until: float | None = None) -> list[int]:
    """The members of the last committed step (on a node without the lighthouse, whose log may lag the groups'
    end by a moment: read again until it has step `steps` or `wait_until` passed)."""
    while wait_until is not None and _log_steps(out) < steps and time.monotonic() < wait_until:
        time.sleep(0.1)
    committed = effective_rows(read_log(out))
    return committed[-1]["members"] if committed else []


def stop_workers(rep: Path, groups: list[int] | None = None) -> None:
    """SIGKILL group processes still alive (a frozen one survives its agent: torchrun starts ranks in a session of
    their own); each wrote its pid to `replicas/group{g}.pid` (local rank I > 0: `group{g}.rank{I}.pid`) at start.
    `groups`: only these (a node of a multi-node run stops its own: the others' pids are another machine's)."""
    for f in rep.glob("group*.pid"):
        g = int(f.name.split(".")[0].removeprefix("group"))
        if groups is not None and g not in groups:
            continue
        with contextlib.suppress(ValueError, OSError):
            pid = int(f.read_text())
            if b"scaletrain" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
        f.unlink(missing_ok=True)


def read_log(out: Path) -> list[dict]:
    """The rows of `OUT/membership.jsonl` ([] when absent); a cut last line (a kill mid-write) is skipped."""
    path = out / "membership.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def effective_rows(rows: list[dict]) -> list[dict]:
    """The committed rounds whose steps the run's parameters went through, in order: a launch that resumed from
    the checkpoint of step N (its first row has `resumed_from`: N) recomputed the steps after N, so the committed
    rows of those steps from before the resume are dropped. Likewise a step committed again: every member of its
    earlier commit died before any other group healed from it (the lighthouse numbers a round's step from the live
    groups' completed steps), so that update is lost with them and the later commit replaces it."""
    out: list[dict] = []
    for r in rows:
        if r.get("resumed_from") is not None:
            out = [x for x in out if x["step"] <= r["resumed_from"]]
        if r["committed"]:
            out = [x for x in out if x["step"] < r["step"]]
            out.append(r)
    return out


def summarize(rows: list[dict], replicas: int, tokens_per_step: int) -> dict:
    """Failures, steps and tokens lost, heals and whole-job resumes: what the membership log says happened."""
    committed = effective_rows(rows)
    group_tokens = tokens_per_step // replicas
    return {"steps": len(committed), "rounds": len(rows), "failed_rounds": sum(not x["committed"] for x in rows),
            "drops": [{"step": x["step"], "groups": x["dropped"]} for x in rows if x["dropped"]],
            "tokens_lost": sum((replicas - computed_groups(x)) * group_tokens for x in committed),
            "group_steps_lost": sum(replicas - computed_groups(x) for x in committed),
            # parallel.missing_rows=reassign: missing groups' shares computed by live groups (their extra compute)
            "group_steps_reassigned": sum(computed_groups(x) - len(x["members"]) for x in committed),
            "tokens_reassigned": sum((computed_groups(x) - len(x["members"])) * group_tokens for x in committed),
            "heals": [{"step": x["step"], "group": int(g), **h} for x in rows if x["committed"]
                      for g, h in x["heal"].items()],
            "resumes": [x["resumed_from"] for x in rows if x.get("resumed_from") is not None],
            "excluded": [{"step": x["step"], "group": int(g), **e} for x in rows
                         for g, e in x.get("excluded", {}).items()]}


def report(out: Path, groups: int, steps: int) -> int:
    """Print the failures, steps and tokens lost and heals of the membership log; 0 if every step was committed."""
    path = out / "membership.jsonl"
    rows = read_log(out)
    committed = effective_rows(rows)
    for r in rows:
        if r.get("resumed_from") is not None:
            print(f"step {r['resumed_from']}: resumed from its checkpoint (a whole-job restart)", flush=True)
        if r.get("start_checkpoint"):
            print(f"step 0: every group started from the weights of {r.get('init_from', '?')}, written once as "
                  f"{out / r['start_checkpoint']} (the replay starts from it)", flush=True)
        if r["dropped"]:
            print(f"step {r['step']}: replica group(s) {r['dropped']} dropped; {len(r['members'])} of {groups} "
                  "groups went on" + ("; its rows reassigned to the live groups" if r.get("rows") else ""), flush=True)
        if not r["committed"]:
            print(f"step {r['step']}: round {r['round']} failed (a member died mid-step or a heal failed); retried",
                  flush=True)
        for g, e in r.get("excluded", {}).items():
            print(f"step {r['step']}: replica group {g} excluded after {e['failed_heals']} consecutive failed heals "
                  f"(last: {e['reason']}); its agent was stopped and the other groups went on", flush=True)
        for g, h in r["heal"].items():
            if r["committed"]:
                print(f"step {r['step']}: replica group {g} healed from a live group in {h['seconds']:.3f} s "
                      f"({h['bytes']:,} bytes, {h['retries']} chunk(s) resent after a bad checksum) and rejoined",
                      flush=True)
    lost = sum(groups - computed_groups(r) for r in committed)
    moved = sum(computed_groups(r) - len(r["members"]) for r in committed)
    done = committed[-1]["step"] if committed else 0
    extra = (f"; rows reassigned: {moved} group-steps computed by live groups (extra compute: "
             f"{moved / (groups * max(1, len(committed))):.1%} of the run's forward-backward work)" if moved else "")
    print(f"replica run: {done}/{steps} steps committed in {len(rows)} rounds; group-steps lost {lost} "
          f"(each is 1/{groups} of a step's batch){extra}; membership log {path}", flush=True)
    finals = list((out / "replicas").glob("final-group*.pt"))
    if done == steps and finals:
        return 0
    print(f"scaletrain: error: the replica run stopped at step {done} of {steps} (logs in {out / 'logs'})",
          file=sys.stderr)
    return 1
