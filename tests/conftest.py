import os
import sys
from pathlib import Path

import pytest

# Keep the tokenized-corpus cache inside the test session, and torch from oversubscribing the 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    if "SCALETRAIN_CACHE" not in os.environ:
        os.environ["SCALETRAIN_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny models: on a shared 2-core machine more threads only add
    contention. Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
