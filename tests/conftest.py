import os
import sys
from pathlib import Path

import torch

# Without a GPU the triton backend's kernels run in Triton's interpreter, which
# must be switched on before they are defined (on first use of the backend).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import make_bart  # noqa: E402


@pytest.fixture(scope="session")
def bart_dir(tmp_path_factory) -> Path:
    return make_bart(tmp_path_factory.mktemp("bart") / "ckpt", seed=0)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items):
    """Marks ``slow`` the cases for which a test module's ``slow_case(name)`` is true (``name``:
    the test's name with its id): cases of a fixture's params, or of one combination of
    several parametrizations, which ``pytest.param(..., marks=...)`` cannot single out. The
    default run keeps a cheaper case of the same behaviour."""
    for item in items:
        slow_case = getattr(getattr(item, "module", None), "slow_case", None)
        if slow_case is not None and slow_case(item.name):
            item.add_marker(pytest.mark.slow)
