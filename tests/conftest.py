import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import make_bart  # noqa: E402


@pytest.fixture(scope="session")
def bart_dir(tmp_path_factory) -> Path:
    return make_bart(tmp_path_factory.mktemp("bart") / "ckpt", seed=0)
