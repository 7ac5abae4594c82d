"""No worker process outlives its driver: a driver that exits without shutting its
engine down, and one killed by SIGTERM (which runs no clean-up of its own), leave no
rank behind."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import process_alive

CHILD = textwrap.dedent("""
    import sys, time
    from tandem import LLM, SamplingParams

    if __name__ == "__main__":
        # Exit: two ranks, which leave their process group on the way out. SIGTERM: the
        # workers notice their parent is gone, however many there are: one is enough.
        ranks = 2 if sys.argv[2] == "exit" else 1
        llm = LLM(model=sys.argv[1], dtype="float32", device="cpu", tensor_parallel_size=ranks,
                  distributed_executor_backend="mp")
        out = llm.generate({"prompt_token_ids": [0, 5, 6, 2]}, SamplingParams(max_tokens=2), use_tqdm=False)[0]
        assert out.error is None
        print(*llm.llm_engine.executor.pids, flush=True)
        if sys.argv[2] == "wait":
            time.sleep(600)
        # "exit": the interpreter exits with the engine still up
""")


# Slow (spawns drivers and their ranks): out of the default run,
# in CI's bfloat16 stage (pyproject's `slow`).
pytestmark = pytest.mark.slow


def _gone_within(pids, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(process_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("how", ["exit", "sigterm"])
def test_no_rank_outlives_the_driver(bart_dir, tmp_path, how):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, str(script), str(bart_dir), "wait" if how == "sigterm" else "exit"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = child.stdout.readline()
        if not line:
            pytest.fail(f"the child failed: {child.wait(60)} {child.stderr.read()[-3000:]}")
        pids = [int(p) for p in line.split()]
        assert len(pids) == (2 if how == "exit" else 1) and all(process_alive(p) or how == "exit" for p in pids)
        if how == "sigterm":
            child.send_signal(signal.SIGTERM)
        code = child.wait(60)
        assert code == (-signal.SIGTERM if how == "sigterm" else 0), child.stderr.read()[-3000:]
        assert _gone_within(pids, 10), [p for p in pids if process_alive(p)]
    finally:
        if child.poll() is None:
            child.kill()
