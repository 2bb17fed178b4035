"""scaletrain: plan, train and prove parallel training of large neural networks.

Plan: predict memory, time and communication for any layout before launch.
Train: one trainer for data / tensor / pipeline / expert parallelism and ZeRO on torch.distributed.
Prove: every layout is checked against the single-process run of the same model, data and seed.
"""

# validate()'s rules live beside their features and register themselves with scaletrain.config.rules when their
# module is imported: importing them here registers every rule whenever any scaletrain module is imported. All are
# torch-free (tests/test_cli_startup.py); a new feature's rules.py gets a line here.
from scaletrain.config import ignored as _ignored_rules  # noqa: E402, F401
from scaletrain.data import rules as _data_rules  # noqa: E402, F401
from scaletrain.memory import rules as _memory_rules  # noqa: E402, F401
from scaletrain.model import rules as _model_rules  # noqa: E402, F401
from scaletrain.multinode import rules as _multinode_rules  # noqa: E402, F401
from scaletrain.optim import rules as _optim_rules  # noqa: E402, F401
from scaletrain.parallel import rules as _parallel_rules  # noqa: E402, F401
from scaletrain.parallel.async_dp import rules as _async_rules  # noqa: E402, F401
from scaletrain.parallel.context import rules as _context_rules  # noqa: E402, F401
from scaletrain.parallel.pipeline import rules as _pipeline_rules  # noqa: E402, F401
from scaletrain.report import rules as _report_rules  # noqa: E402, F401
from scaletrain.train import rules as _train_rules  # noqa: E402, F401
from scaletrain.version import __version__  # noqa: F401
