"""The asynchronous and relaxed data-parallel runners, selected by `parallel.sync` (docs/async.md); each has the
synchronous `Trainer`'s interface and is chosen by `train/runner.py:make_trainer`.

- `ps.py`: the parameter-server job's roles and loops (coordinator, servers, workers) on gloo point-to-point
  messages (Li et al., OSDI 2014; Ho et al., NIPS 2013; BytePS, OSDI 2020); `launch.py` its supervised launch.
- `hogwild.py`: workers on one machine updating parameters in shared memory (Niu et al., arXiv 1106.5730).
- `local_sgd.py`: local SGD and DiLoCo (Lin et al., arXiv 1808.07217; Stich, arXiv 1805.09767; Douillard et al.,
  arXiv 2311.08105).
- `common.py`: what they share with the trainer (run signature, config.yaml and resumes, metrics, observers);
  `rank_checkpoint.py`: their per-rank checkpoints.

The algorithms they run (servers' shards and update rule, the staleness gate, versions, replay, the workers' model
and stragglers) are `scaletrain.parallel.async_dp`.
"""
