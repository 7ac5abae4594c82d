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
