"""Processes and their groups: process-group set-up from torchrun / SLURM (`process_group`), the local launcher
(`launch`), the rank grid and its groups (`mesh`), collectives with byte accounting (`comm`) and the torch-free
arithmetic of tensor-parallel grids (`grid`). This package's `__init__` imports nothing, so the torch-free parts
(`grid`, `launch`) load without torch."""
