"""Two "hosts" on one machine for multi-node tests: each a network namespace joined to the other by a veth pair,
with its own host name, its own /etc/hosts in Debian's style (its own name on 127.0.1.1, the other's on its
veth address) and its own kernel boot id (what scaletrain compares to know whether two ranks share a machine),
so the README's torchrun command and the heartbeat meet what they meet between two real machines.

Namespaces need root (or `unshare -rn`); when they cannot be made both "hosts" run on 127.0.0.1 with this
machine's host name, and `TwoHosts.reason` says why (tests print it as a notice; under CI, which runs as root, the
tests fail instead: a fallback is not the proof). Names start with `stmn-`
and carry this process's id; `close()` kills every process inside and deletes them, also after a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

NAMES = ("node-a", "node-b")


class TwoHosts:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        tag = f"{os.getpid() % 100000}"
        self.ns = [f"stmn-{tag}-a", f"stmn-{tag}-b"]
        self.veth = [f"stmn{tag}a", f"stmn{tag}b"]
        octet = 16 + os.getpid() % 200
        self.addrs = [f"10.213.{octet}.1", f"10.213.{octet}.2"]
        self.isolated = False
        self.reason = ""
        self.procs: list[subprocess.Popen] = []

    # ------------------------------------------------------------------ set-up

    def open(self) -> TwoHosts:
        if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
            self.reason = "not root, or `ip` / `unshare` missing"
            return self
        steps = [["ip", "netns", "add", self.ns[0]], ["ip", "netns", "add", self.ns[1]],
                 ["ip", "link", "add", self.veth[0], "netns", self.ns[0], "type", "veth", "peer", "name",
                  self.veth[1], "netns", self.ns[1]]]
        for i in (0, 1):
            steps += [["ip", "-n", self.ns[i], "addr", "add", f"{self.addrs[i]}/24", "dev", self.veth[i]],
                      ["ip", "-n", self.ns[i], "link", "set", self.veth[i], "up"],
                      ["ip", "-n", self.ns[i], "link", "set", "lo", "up"]]
        for cmd in steps:
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                self.reason = f"`{' '.join(cmd)}` failed: {p.stderr.strip()}"
                self.close()
                return self
        for i in (0, 1):
            other = 1 - i
            (self.tmp / f"hosts-{i}").write_text(f"127.0.0.1 localhost\n127.0.1.1 {NAMES[i]}\n"
                                                 f"{self.addrs[other]} {NAMES[other]}\n")
            (self.tmp / f"boot_id-{i}").write_text(f"00000000-0000-4000-8000-{os.getpid():08d}000{i}\n")
        probe = self._wrap(0, ["true"])
        p = subprocess.run(probe, capture_output=True, text=True)
        if p.returncode != 0:
            self.reason = f"cannot enter the namespace with its own host name and /etc/hosts: {p.stderr.strip()}"
            self.close()
            return self
        self.isolated = True
        return self

    def _wrap(self, i: int, argv: list[str]) -> list[str]:
        if not self.isolated and not self.ns:
            return argv
        inner = (f'hostname {NAMES[i]} && mount --bind {self.tmp / f"hosts-{i}"} /etc/hosts && '
                 f'mount --bind {self.tmp / f"boot_id-{i}"} /proc/sys/kernel/random/boot_id && exec "$@"')
        return ["ip", "netns", "exec", self.ns[i], "unshare", "--uts", "--mount", "sh", "-c", inner, "sh", *argv]

    # ------------------------------------------------------------------ use

    def host(self, i: int) -> str:
        """The rendezvous host as node i's command line names it."""
        return NAMES[i] if self.isolated else "127.0.0.1"

    def hostname(self, i: int) -> str | None:
        """Node i's host name as messages print it (None when both share this machine's)."""
        return NAMES[i] if self.isolated else None

    def start(self, i: int, argv: list[str], cwd: Path, name: str, env: dict | None = None) -> subprocess.Popen:
        cmd = self._wrap(i, argv) if self.isolated else argv
        out, err = open(self.tmp / f"{name}.out", "w"), open(self.tmp / f"{name}.err", "w")
        p = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=err, start_new_session=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        p.name = name  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def output(self, name: str) -> tuple[str, str]:
        return (self.tmp / f"{name}.out").read_text(), (self.tmp / f"{name}.err").read_text()

    def pids(self, i: int, proc: subprocess.Popen | None = None) -> list[int]:
        """Every process of node i (the whole "machine"); in the fallback, `proc` and its descendants."""
        if self.isolated:
            out = subprocess.run(["ip", "netns", "pids", self.ns[i]], capture_output=True, text=True).stdout
            return [int(x) for x in out.split()]
        import psutil

        if proc is None:
            return []
        try:
            root = psutil.Process(proc.pid)
            return [root.pid, *(c.pid for c in root.children(recursive=True))]
        except psutil.NoSuchProcess:
            return []

    def signal_node(self, i: int, sig: int, proc: subprocess.Popen | None = None) -> None:
        for pid in self.pids(i, proc):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, proc: subprocess.Popen, timeout: float) -> int:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            name = proc.name  # type: ignore[attr-defined]
            raise AssertionError(f"{name} did not finish within {timeout:.0f} s: {self.output(name)}") from None

    # ------------------------------------------------------------------ tear-down

    def kill_all(self) -> None:
        for i in (0, 1):
            for p in self.procs:
                self.signal_node(i, signal.SIGKILL, p)
                self.signal_node(i, signal.SIGCONT, p)
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(timeout=10)
        self.procs.clear()
        time.sleep(0.1)

    def close(self) -> None:
        self.kill_all()
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
