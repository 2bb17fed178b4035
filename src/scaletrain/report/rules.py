"""validate()'s rules for what a run writes besides its metrics: profiler traces of chosen steps
(train.profile_steps, report/profile.py) and TensorBoard events (train.tensorboard, report/tensorboard.py).

Registered with `scaletrain.config.rules` when imported (scaletrain/__init__.py imports it); torch-free.
"""

from __future__ import annotations

import importlib.util

from scaletrain.config.parse import parse_steps
from scaletrain.config.rules import rule
from scaletrain.config.schema import Config
from scaletrain.errors import ConfigError


def tensorboard_available() -> bool:
    """The tensorboard package is installed (`pip install 'scaletrain[tb]'`); found without importing it."""
    return importlib.util.find_spec("tensorboard") is not None


@rule("combinations")
def outputs(cfg: Config, world_size: int | None) -> list[str]:
    """train.profile_steps syntax and range; train.tensorboard needs the tensorboard package."""
    t = cfg.train
    errors = []
    try:
        window = parse_steps(t.profile_steps)
    except ConfigError as e:
        errors.append(str(e))
    else:
        if window is not None and window[0] > t.steps:
            errors.append(f"train.profile_steps ({t.profile_steps}) starts after the last step (train.steps = "
                          f"{t.steps}): nothing would be profiled")
    if t.tensorboard and not tensorboard_available():
        errors.append("train.tensorboard=true needs the tensorboard package: pip install 'scaletrain[tb]'")
    return errors
