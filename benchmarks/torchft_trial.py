"""Trial (issue 35): torchft's own Lighthouse and Manager (gloo, CPU) driving scaletrain's GPT as two replica groups
of one process each, against one process training the same model on the whole batch (fp64, AdamW), then with one
group killed at step 3. Prints each group's steps and its largest parameter difference from the one-process run.

torchft is not a dependency of the project (docs/fault_tolerance.md says why); install it outside the venv:

    .venv/bin/pip install --target /tmp/tft --no-deps torchft==0.2.0
    .venv/bin/pip install --target /tmp/tft opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http
    PYTHONPATH=/tmp/tft BIAS=0 .venv/bin/python benchmarks/torchft_trial.py
"""
import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def batches(step, seed=0):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 256, (4, 32), generator=g)
    y = torch.randint(0, 256, (4, 32), generator=g)
    return x, y


def model():
    from scaletrain.config import Config
    from scaletrain.model import build_gpt
    m = Config().model
    m.n_layers, m.d_model, m.n_heads, m.vocab_size, m.seq_len = 2, 32, 2, 256, 32
    m.bias = os.environ.get("BIAS", "1") == "1"
    return build_gpt(m, 0, torch.device("cpu"), torch.float64)


def loss_of(net, x, y):
    return torch.nn.functional.cross_entropy(net(x).flatten(0, 1), y.flatten())


def reference(steps):
    net = model()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    for s in range(steps):
        x, y = batches(s)
        opt.zero_grad()
        loss_of(net, x, y).backward()
        opt.step()
    return {k: v.clone() for k, v in net.state_dict().items()}


def replica(rid, lighthouse, steps, kill_at, q):
    from torchft import Manager, ProcessGroupGloo
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    net = model()
    opt_inner = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def sd():
        return {"model": net.state_dict(), "optim": opt_inner.state_dict()}

    def load(s):
        net.load_state_dict(s["model"])
        opt_inner.load_state_dict(s["optim"])

    mgr = Manager(pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=load, state_dict=sd,
                  replica_id=f"g{rid}", store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
                  lighthouse_addr=lighthouse, port=0, timeout=timedelta(seconds=10),
                  quorum_timeout=timedelta(seconds=10), connect_timeout=timedelta(seconds=10))
    ddp = DistributedDataParallel(mgr, net)
    opt = OptimizerWrapper(mgr, opt_inner)
    log = []
    while mgr.current_step() < steps:
        s = mgr.current_step()
        if kill_at is not None and rid == 1 and s == kill_at:
            os._exit(9)
        x, y = batches(s)
        opt.zero_grad()  # starts the step's quorum
        n, r = mgr.num_participants(), mgr.participating_rank()
        part = slice(r * 4 // n, (r + 1) * 4 // n) if r is not None else slice(0, 0)
        print(f"group {rid} step {s}: participants {n}, rank {r}", file=sys.stderr, flush=True)
        loss = loss_of(ddp, x[part], y[part])
        loss.backward()
        committed = opt.step()
        log.append((s, mgr.num_participants(), committed))
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"torchft_trial_state{rid}.pt")
    torch.save({k: v.clone() for k, v in net.state_dict().items()}, path)
    q.put((rid, path, log))
    mgr.shutdown(wait=False)


def main():
    from torchft._torchft import LighthouseServer
    steps = 6
    ref = reference(steps)
    for kill_at in (None, 3):
        lh = LighthouseServer(bind="[::]:0", min_replicas=2 if kill_at is None else 1, join_timeout_ms=2000)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        ps = [ctx.Process(target=replica, args=(r, lh.address(), steps, kill_at, q)) for r in range(2)]
        t = time.time()
        for p in ps:
            p.start()
        got = {}
        deadline = time.time() + 120
        while len(got) < (2 if kill_at is None else 1) and time.time() < deadline:
            try:
                rid, path, log = q.get(timeout=5)
                got[rid] = (torch.load(path, weights_only=True), log)
            except Exception:  # queue.Empty: keep waiting until the deadline
                pass
        for p in ps:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        lh.shutdown()
        print(f"kill_at={kill_at}: {time.time() - t:.1f} s; replicas finished: {sorted(got)}")
        for rid, (state, log) in got.items():
            diff = max((state[k] - ref[k]).abs().max().item() for k in ref)
            print(f"  group {rid}: steps (step, participants, committed) {log}")
            print(f"  group {rid}: max |param - one process| = {diff:.3e}")


if __name__ == "__main__":
    main()
