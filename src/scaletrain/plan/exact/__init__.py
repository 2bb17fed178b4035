"""Predictions of our own runs: exact bytes from the engine's module on the meta device (`run_memory`), and the
step time composed from a profile of the run's pieces on this machine (`probe`, `run_time`, `run_comm`,
`run_calibrate`). Imports the analytic half (`scaletrain.plan.analytic`), never the reverse."""
