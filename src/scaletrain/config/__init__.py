"""The run configuration: schema (typed dataclasses), loading (YAML and `--set`), and the one `validate()`.

Every field has a docstring (the string literal under it); `scaletrain config show` prints the resolved tree.
`validate()` is the one place where user input is checked: every violated constraint raises `ConfigError` whose
message names the values, before any process starts or any output is touched. The checks of each feature live beside
it (its `rules.py`, registered with `config/rules.py`); config/ imports nothing of the engine.
"""

from scaletrain.config.load import config_from_dict, flatten, load_config, set_value
from scaletrain.config.schema import (
    DTYPES,
    SCHEDULES,
    Config,
    DataConfig,
    MemoryConfig,
    MixSource,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)
from scaletrain.config.validate import validate
from scaletrain.errors import ConfigError

__all__ = ["DTYPES", "SCHEDULES", "Config", "ConfigError", "DataConfig", "MemoryConfig", "MixSource", "ModelConfig",
           "MoEConfig", "OptimConfig", "ParallelConfig", "TrainConfig", "config_from_dict", "flatten", "load_config",
           "set_value", "validate"]
