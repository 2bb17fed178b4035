"""The algorithms of asynchronous and relaxed data parallelism, selected by `parallel.sync` (docs/async.md); the
runners that execute them (their loops, launch and per-rank checkpoints) are `scaletrain.train.runners`.

- `server.py`: a parameter server's shard of whole tensors and its update rule (Li et al., OSDI 2014; BytePS,
  OSDI 2020); `gate.py`: the staleness bound of BSP / SSP / ASP (Ho et al., NIPS 2013).
- `model.py`: a worker's model in one flat buffer and the data of a ticket; `straggler.py`: straggler injection.
- `versions.py`: the version log of the asynchronous modes; `replay.py`: the single-process replay that proves
  what a ps or locked-Hogwild run (Niu et al., arXiv 1106.5730) applied.

`bsp` is the synchronous trainer (`scaletrain.train.trainer`).
"""
