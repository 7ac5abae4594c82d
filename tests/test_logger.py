"""tandem's stderr log handler follows ``sys.stderr`` as it is at each record."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import SUBPROCESS_TIMEOUT

SCRIPT = """
import io, sys
import tandem
from tandem.logger import logger
swapped = io.StringIO()
sys.stderr = swapped          # a host (or pytest's capture) swaps stderr...
logger.info("into the swap")
sys.stderr = sys.__stderr__
swapped_text = swapped.getvalue()
swapped.close()               # ...and closes the old stream
logger.info("after the swap")
print(repr(swapped_text))
"""


def test_the_handler_writes_to_the_current_stderr_never_a_closed_one():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
                         env={**os.environ, "TANDEM_LOGGING_LEVEL": "INFO"})
    assert res.returncode == 0, res.stderr
    assert "into the swap" in res.stdout  # the record went to the stderr of its moment
    assert "after the swap" in res.stderr
    assert "Logging error" not in res.stderr and "closed file" not in res.stderr
