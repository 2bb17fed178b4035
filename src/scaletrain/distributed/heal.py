"""Healing a restarted replica from a live peer: its whole training state sent point to point, checksummed.

When a data-parallel replica dies and restarts, it need not reload a checkpoint: any live replica holds the same
parameters and optimizer state at the current step boundary, and sends them over the network. This is torchft's
live recovery (github.com/pytorch/torchft, `Manager` healing from a peer) and the peer-replica recovery of
Oobleck (arXiv 2309.08125). Here the state is a dict of anything `torch.save` writes with `weights_only` loading
(model and optimizer `state_dict()`, the step, RNG states as tensors).

Protocol, on one process group with the live peer as `src` and the joining rank as `dst`:
  1. the sender serialises the state once into bytes and sends the length and the SHA-256 of the whole payload;
  2. the payload goes in chunks of `chunk_bytes`; each chunk is followed by its SHA-256, the receiver checks it
     and answers ok or bad; a bad chunk is sent again, at most `retries` more times, then both sides raise
     `HealError` (the joining replica is refused: it must not join with state it cannot trust);
  3. the receiver checks the whole payload's digest again before loading it; nothing is loaded into the
     receiver's model or optimizer before every byte is verified.
Cost: one serialised copy of the state on each side (memory) and one transfer of it (time: bytes / bandwidth
plus one round trip per chunk); `benchmarks/heal_transfer.py` measures it against model size.
"""

from __future__ import annotations

import hashlib
import io
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

DIGEST = 32  # bytes of a SHA-256
Tamper = Callable[[int, int, torch.Tensor], torch.Tensor]  # (chunk index, attempt, bytes) -> bytes on the wire


class HealError(RuntimeError):
    """A heal that could not be completed with verified state (a chunk stayed corrupt after every retry)."""


@dataclass
class HealStats:
    bytes: int  # payload bytes (the serialised state)
    chunks: int
    retries: int  # chunks sent again after a failed checksum
    seconds: float  # wall time of the transfer on this side


class Link:
    """Point to point over a process group that is not registered with torch.distributed (e.g. a gloo group made
    for one quorum, distributed/quorum.py): peers are ranks of that group. Pass it as `group`."""

    def __init__(self, pg: dist.ProcessGroup):
        self.pg = pg


def _send(t: torch.Tensor, peer: int, group) -> None:
    if isinstance(group, Link):
        group.pg.send([t], peer, 0).wait()
    else:
        dist.send(t, peer, group=group)


def _recv(t: torch.Tensor, peer: int, group) -> None:
    if isinstance(group, Link):
        group.pg.recv([t], peer, 0).wait()
    else:
        dist.recv(t, peer, group=group)


def _digest(data: torch.Tensor) -> torch.Tensor:
    return torch.frombuffer(bytearray(hashlib.sha256(data.numpy().tobytes()).digest()), dtype=torch.uint8)


def serialize(state: dict) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def deserialize(payload: torch.Tensor) -> dict:
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)


def send_state(state: dict, dst: int, group: dist.ProcessGroup | Link | None = None, chunk_bytes: int = 1 << 22,
               retries: int = 2, tamper: Tamper | None = None) -> HealStats:
    """The live peer's side: send `state` to global rank `dst`. `tamper` (tests and fault drills only) changes
    a chunk after its checksum is taken, as a faulty link would."""
    t0 = time.perf_counter()
    payload = serialize(state)
    n = payload.numel()
    _send(torch.tensor([n], dtype=torch.int64), dst, group)
    _send(_digest(payload), dst, group)
    chunks, resent = 0, 0
    for index, start in enumerate(range(0, n, chunk_bytes)):
        chunk = payload[start:start + chunk_bytes].clone()
        digest = _digest(chunk)
        for attempt in range(retries + 1):
            wire = tamper(index, attempt, chunk.clone()) if tamper is not None else chunk
            _send(wire, dst, group)
            _send(digest, dst, group)
            ack = torch.zeros(1, dtype=torch.int64)
            _recv(ack, dst, group)
            if int(ack) == 1:
                break
            resent += 1
        else:
            raise HealError(f"heal to rank {dst}: chunk {index} failed its checksum {retries + 1} times; refused")
        chunks += 1
    return HealStats(n, chunks, resent, time.perf_counter() - t0)


def recv_state(src: int, group: dist.ProcessGroup | Link | None = None, chunk_bytes: int = 1 << 22,
               retries: int = 2) -> tuple[dict, HealStats]:
    """The joining rank's side: the verified state from global rank `src` (`chunk_bytes` and `retries` as the
    sender's). Raises `HealError` when a chunk stays corrupt or the whole payload does not match its digest."""
    t0 = time.perf_counter()
    size = torch.zeros(1, dtype=torch.int64)
    _recv(size, src, group)
    n = int(size)
    whole = torch.empty(DIGEST, dtype=torch.uint8)
    _recv(whole, src, group)
    payload = torch.empty(n, dtype=torch.uint8)
    chunks, resent = 0, 0
    for index, start in enumerate(range(0, n, chunk_bytes)):
        chunk = payload[start:start + chunk_bytes]
        got = torch.empty_like(chunk)
        digest = torch.empty(DIGEST, dtype=torch.uint8)
        for _attempt in range(retries + 1):
            _recv(got, src, group)
            _recv(digest, src, group)
            ok = torch.equal(_digest(got), digest)
            _send(torch.tensor([1 if ok else 0], dtype=torch.int64), src, group)
            if ok:
                chunk.copy_(got)
                break
            resent += 1
        else:
            raise HealError(f"heal from rank {src}: chunk {index} failed its checksum {retries + 1} times; refused")
        chunks += 1
    if not torch.equal(_digest(payload), whole):
        raise HealError(f"heal from rank {src}: the assembled state does not match its digest; refused")
    return deserialize(payload), HealStats(n, chunks, resent, time.perf_counter() - t0)


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    """What a joining replica needs at a step boundary: parameters, optimizer state, the step."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}


def load_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> int:
    """Load a verified state (from `recv_state`) into the joining replica; returns the step it joins at."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])
