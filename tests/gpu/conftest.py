"""The GPU plan's tests (``-m gpu``) run the conformance check of tests/backends
(``layouts.py``) at production shapes, so that directory is importable here too."""

import sys
from pathlib import Path

BACKENDS_TESTS = str(Path(__file__).resolve().parents[1] / "backends")
if BACKENDS_TESTS not in sys.path:
    sys.path.append(BACKENDS_TESTS)
