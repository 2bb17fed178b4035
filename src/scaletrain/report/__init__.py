"""scaletrain.report: what a run, a plan or a sweep looks like.

`page` (the shared HTML page style, plotly.js inlined), `run_data` + `run_page` (the run report,
OUT/report.html), `plan_page` (`plan --html`), `scaling_page` (sweeps and `scaling fit --html`), `runinfo`
(run_info.json, memory_ranks.json), `observers` (the trainer's hooks: TensorBoard via `tensorboard`, profiler
traces via `profile`, the report refresh), `plots` (PNG loss and expert-load curves), `command`
(`scaletrain report run | timeline`). See docs/report.md.
"""
