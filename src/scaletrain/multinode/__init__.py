"""Running one job over many machines: network choice, start-up checks, failure detection, hang reports.

- `network`: which interface and address gloo/NCCL use (the one that routes to the rendezvous endpoint,
  unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise), and what torchrun needs on a host whose
  name resolves to loopback (`--local-addr`, `--rdzv-conf is_host=1`).
- `preflight`: before any model is built, every rank proves it sees the same `--out` and runs the same
  torch, scaletrain and config; a mismatch is one line naming the ranks and hosts (exit 2).
- `heartbeat`: every rank bumps a counter in the job's TCP store; a rank whose counter stops (killed,
  SIGSTOP, dead machine) is noticed within `parallel.heartbeat_s` and every rank stops naming it.
- `flight`: a ring buffer of each rank's last collectives and point-to-point messages (step, group,
  peer, shape); on a timeout the ranks' buffers are gathered and matched, naming the collective or the
  send/recv pair that did not match.
- `job`: the worker-side supervisor that ties them together around one run.
- `launcher` / `command`: `scaletrain train --nnodes` (torchrun with the right flags on this node) and
  `scaletrain launch-info`.

See docs/multinode.md.
"""
