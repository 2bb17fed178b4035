"""Test-only entry point: `python tests/fault_worker.py <scaletrain argv>` under torchrun, with a fault injected.

FAULT_DROP_SEND=k: on global rank 0 the k-th activation send of training (counted over pipeline message
batches, evaluation excluded) is silently dropped - a mismatched pipeline send/recv pair: rank 1 waits for
a message that never comes, then rank 0 waits for a gradient rank 1 cannot send. Nothing here ships in
scaletrain; tests/test_multinode.py checks the flight recorder names both ranks and the operation.
"""

import os
import sys

import torch
import torch.distributed as dist

from scaletrain.cli import main
from scaletrain.parallel.pipeline import executor
from scaletrain.parallel.pipeline.schedules import Op


def drop_send(k: int) -> None:
    original = executor.PipelineExecutor._communicate
    seen = {"sends": 0}

    def communicate(self, step, st):
        if dist.get_rank() == 0 and torch.is_grad_enabled():
            kept = []
            for a in step:
                if a.op is Op.SEND_ACT:
                    seen["sends"] += 1
                    if seen["sends"] == k:
                        continue  # the fault: this message is never posted
                kept.append(a)
            step = kept
        return original(self, step, st)

    executor.PipelineExecutor._communicate = communicate


if __name__ == "__main__":
    if os.environ.get("FAULT_DROP_SEND"):
        drop_send(int(os.environ["FAULT_DROP_SEND"]))
    raise SystemExit(main(sys.argv[1:]))
