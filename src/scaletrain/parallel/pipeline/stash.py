"""PipeDream's weight stashing and vertical sync on one stage (Harlap et al., arXiv 1806.03377, section 3.3).

Version k of a stage's weights is what they hold after optimizer step k (version 0: the initial weights); during
step t the parameters' own storage (`live`) holds version t - 1, the newest, which the optimizer then updates in
place into version t. `WeightStash` keeps the older versions still needed as frozen copies and points the
parameters at the right one (a storage swap, no copy) before each forward and backward:

- a forward of a minibatch whose backward runs in a later step freezes the version it reads (one copy of the
  stage's weights per version, shared by the minibatches that read it); the backward points the parameters at
  that copy, so the minibatch's gradient is the gradient of exactly the function its forward computed;
- with vertical sync the forward reads the version stage 0 read (sent with the activation), so every stage
  snapshots the newest version at the start of each step and keeps the ones a later forward can still ask for.

Autograd saved the parameters with their version counters at the forward; the in-place optimizer steps since
then bumped them although the stashed storage did not change, so the backward sets the counters back to the
forward's values (as PipeDream-2BW's `WeightVersions` does).

Every forward and backward appends a row to `log` (step, minibatch, stage, pass, version): the version log that a
single process replays (tests/pipedream_replay.py) to recompute what every stage computed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn


class WeightStash:
    """The weight versions of one pipeline stage under PipeDream (see module doc)."""

    def __init__(self, params: list[nn.Parameter], stage: int, vertical_sync: bool):
        self.params, self.stage, self.vertical_sync = params, stage, vertical_sync
        self.store: dict[int, list[torch.Tensor]] = {}  # version -> frozen copies
        self.live: list[torch.Tensor] = []
        self.newest = 0  # the version in `live` during this step
        self.current = 0  # the version the parameters point at
        self.step = 0
        self.peak_versions = 1  # most versions held at once, the live one included
        self.peak_copies = 0  # most frozen copies of the weights held at once (memory besides the live weights)
        self.peak_bytes = 0  # the bytes of those copies at their peak: the run's `mem_stash`
        self.log: list[dict] = []

    @torch.no_grad()
    def begin(self, step: int) -> None:
        """Start optimizer step `step`: the parameters hold version step - 1."""
        self.step, self.newest = step, step - 1
        self.live = [p.data for p in self.params]
        self.current = self.newest
        if self.vertical_sync and self.stage > 0:  # later forwards may ask for this version (stage 0's)
            self._freeze(self.newest)

    @torch.no_grad()
    def _freeze(self, version: int) -> list[torch.Tensor]:
        if version not in self.store:
            self.store[version] = [t.clone() for t in self.live]
            self.peak_versions = max(self.peak_versions, len(self.store) + (self.newest not in self.store))
            self.peak_copies = max(self.peak_copies, len(self.store))
            held = sum(t.untyped_storage().nbytes() for copies in self.store.values() for t in copies)
            self.peak_bytes = max(self.peak_bytes, held)
        return self.store[version]

    def _point(self, version: int) -> None:
        if version == self.newest and version not in self.store:
            bufs = self.live
        elif version in self.store:
            bufs = self.store[version]
        else:
            raise RuntimeError(f"PipeDream stage {self.stage}: weight version {version} is not kept (step {self.step},"
                               f" kept {sorted(self.store)} and {self.newest})")
        for p, b in zip(self.params, bufs):
            p.data = b
        self.current = version

    def forward(self, minibatch: int, version: int | None, later: bool) -> tuple[int, list[int]]:
        """Point the parameters at the version minibatch's forward reads: `version` (vertical sync: stage 0's) or
        the newest; `later`: its backward runs in a later step, so the version is frozen. Returns (version, the
        parameters' autograd version counters) for the backward."""
        v = self.newest if version is None else version
        if later and v == self.newest:
            self._freeze(v)
        self._point(v)
        self.log.append({"step": self.step, "minibatch": minibatch, "stage": self.stage, "pass": "forward",
                         "version": v})
        return v, [p._version for p in self.params]

    def backward(self, minibatch: int, version: int, counters: list[int]) -> None:
        """Point the parameters at the stashed `version` of minibatch's forward, with the forward's counters."""
        self._point(version)
        torch._C._autograd._unsafe_set_version_counter(tuple(self.params), tuple(counters))
        self.log.append({"step": self.step, "minibatch": minibatch, "stage": self.stage, "pass": "backward",
                         "version": self.current})

    def end(self, in_flight: set[int]) -> None:
        """Back to the live storage for the optimizer; drop the versions no minibatch in flight and (vertical sync)
        no later forward can read: after this step's update a later forward reads version step - stage or newer."""
        for p, b in zip(self.params, self.live):
            p.data = b
        self.current = self.newest
        oldest = self.step - self.stage if self.vertical_sync else self.step
        for v in [v for v in self.store if v not in in_flight and v < oldest]:
            del self.store[v]

    def write_log(self, path: Path) -> Path:
        """The version log as JSON lines (one row per forward and backward)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for row in self.log:
                f.write(json.dumps(row) + "\n")
        return path
