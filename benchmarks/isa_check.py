"""The low-precision layout rows under each CPU kernel set torch can pick (issue 29: the suite must pass on any x86-64
CPU that runs torch): `scaletrain verify --matrix` on the chosen bf16/fp16 layouts of the 4-process covering set, once
per `ATEN_CPU_CAPABILITY` (torch's `default` = no vector extensions, `avx2`, and the machine's own), then per kernel
set: PASS/FAIL and the worst ratio of a measured difference to its bound (`verify.tolerances.stepwise_bound`, set
before measuring). `make isa-check` runs it; docs/verify.md ("On other CPUs") records its output.

    python benchmarks/isa_check.py [--filter EXPR] [--capabilities default,avx2,native] [--out DIR]

A capability the CPU lacks is run as what torch falls back to (it never picks kernels the CPU cannot run) and the
line says which one torch reported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

FILTER = "dtype=bf16|fp16,moe=switch"  # the chaotic case (a routing flip moves whole tokens), bf16 and fp16, tp and pp


def ratios(path: Path) -> list[tuple[str, bool, float]]:
    """(layout, passed, worst measured / bound over loss, gradient norm, parameters) for each layout of a verify
    JSON file."""
    from scaletrain.verify.tolerances import stepwise_bound

    data = json.loads(path.read_text())
    out = []
    for row in data["layouts"]:
        bound = stepwise_bound(row["dtype"], row["values"].get("compress", "none"))
        worst = max(row["loss"] / bound.loss, row["grad_norm"] / bound.grad_norm, row["params"] / bound.params)
        out.append((row["layout"], bool(row["ok"]), worst))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--filter", default=FILTER)
    p.add_argument("--capabilities", default="default,avx2,native")
    p.add_argument("--out", default="isa_check")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = False
    summary = []
    for cap in args.capabilities.split(","):
        env = dict(os.environ)
        env.pop("ATEN_CPU_CAPABILITY", None)
        if cap != "native":
            env["ATEN_CPU_CAPABILITY"] = cap
        seen = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                              env=env, capture_output=True, text=True).stdout.strip()
        js = out / f"verify_{cap}.json"
        cmd = [sys.executable, "-m", "scaletrain", "verify", "--matrix", "--world", "4", "--filter", args.filter,
               "--json", str(js)]
        print(f"== ATEN_CPU_CAPABILITY={cap} (torch reports {seen}): {' '.join(cmd[2:])}", flush=True)
        code = subprocess.run(cmd, env=env).returncode
        rows = ratios(js) if js.is_file() else []
        failed |= code != 0 or not rows
        worst = max((r for _, _, r in rows), default=float("nan"))
        passed = sum(ok for _, ok, _ in rows)
        summary.append(f"{cap:<8} torch {seen:<7} {passed} of {len(rows)} PASS  worst ratio to bound {worst:.3f}"
                       f"  (exit {code})")
        for name, ok, r in rows:
            summary.append(f"    {r:6.3f}  {'PASS' if ok else 'FAIL'}  {name}")
    print("\n" + "\n".join(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
