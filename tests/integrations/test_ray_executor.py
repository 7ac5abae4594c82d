"""``distributed_executor_backend="ray"``: two tensor-parallel ranks as Ray actors
(a placement group of two CPU bundles, gloo between them) generate what one rank
in this process generates, token for token; a rank's actor killed mid-service
makes the engine raise ``EngineDeadError`` naming that rank, within seconds, and
frees what the ranks held."""

import re
import time

import pytest

pytest.importorskip("ray")

from tandem import LLM, EngineDeadError, SamplingParams  # noqa: E402

ENGINE = dict(dtype="float32", device="cpu", attention_backend="torch_sdpa")
PROMPTS = ["the rain in spain falls", "red blue green small big old", "a cat sat on the mat",
           {"encoder_prompt": "king queen bird fish", "decoder_prompt": "the sun"}]


@pytest.fixture(scope="module")
def tp2(ray_local, bart_dir):
    llm = LLM(str(bart_dir), tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    yield llm
    llm.engine.shutdown()


def test_ray_tp2_equals_tp1(tp2, bart_dir):
    # The tiny checkpoint's wide random weights (tests/helpers.py) leave logit gaps far
    # above float32's summation-order differences (partial sums all-reduced across the
    # ranks), so the tokens must agree exactly.
    ref = LLM(str(bart_dir), **ENGINE)
    greedy = SamplingParams(temperature=0.0, max_tokens=10)
    beams = SamplingParams(num_beams=3, n=2, max_tokens=8)
    for params in (greedy, beams):
        want = ref.generate(PROMPTS, params, use_tqdm=False)
        got = tp2.generate(PROMPTS, params, use_tqdm=False)
        for g, w in zip(got, want):
            assert g.error is None
            assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]
    executor = tp2.engine.executor
    assert type(executor).__name__ == "RayExecutor" and len(executor.pids) == 2
    import os

    assert os.getpid() not in executor.pids  # the ranks run in the actors, not here


def test_a_rank_raising_outside_a_step_names_it_and_the_engine_serves_on(tp2):
    """A call the ranks fail (not a step: their collectives stay in step) raises the
    rank's own exception, naming the rank; the engine is not dead."""
    with pytest.raises(AttributeError, match="no_such_method") as info:
        tp2.engine.executor.collective_rpc("no_such_method")
    # Both ranks raise it; whichever answer arrives first is reported.
    assert any(re.search(r"tensor-parallel rank [01] in no_such_method", note) for note in info.value.__notes__)
    out = tp2.generate(["the rain in spain"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert out[0].error is None and len(out[0].outputs[0].token_ids) == 4


def test_killed_rank_is_engine_dead_naming_it(tp2, ray_local):
    """Rank 1's actor killed, then a step at once: rank 0 waits in a collective for a
    peer that is gone, and the driver, watching the ranks' sentinels, raises within
    seconds naming rank 1 (never a hang, never rank 0's echo of it)."""
    ray = ray_local
    executor = tp2.engine.executor
    ray.kill(executor._actors[1], no_restart=True)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="tensor-parallel rank 1") as info:
        tp2.generate(["the rain in spain"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert time.monotonic() - started < 20
    assert f"pid {executor.pids[1]}" in str(info.value) and "died" in str(info.value)
    with pytest.raises(EngineDeadError, match="tensor-parallel rank 1"):
        executor.check_health()
    # The other rank is stopped and the placement group removed: both CPUs are free again.
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2


def test_placement_that_cannot_be_met_is_a_clear_error(ray_local, bart_dir, monkeypatch):
    """Four ranks on a two-CPU cluster: start-up fails naming the bundles and the
    cluster's resources (after the placement timeout) and leaves nothing placed."""
    import tandem.core.executor.ray_executor as ray_executor

    monkeypatch.setattr(ray_executor, "PLACEMENT_TIMEOUT_S", 1.0)
    with pytest.raises(RuntimeError, match=r"needs 4 bundles of \{'CPU': 1.0\} placed STRICT_PACK"):
        LLM(str(bart_dir), tensor_parallel_size=4, distributed_executor_backend="ray", **ENGINE)
    deadline = time.monotonic() + 20
    while ray_local.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_local.available_resources().get("CPU", 0) == 2


def test_placement_strategy_is_checked(bart_dir):
    from tandem.core.config import EngineConfig

    with pytest.raises(ValueError, match=r"ray_placement_strategy='TIGHT': must be one of 'STRICT_PACK'"):
        EngineConfig(model=str(bart_dir), distributed_executor_backend="ray", ray_placement_strategy="TIGHT")


DRIVER = """
import sys, time
import ray
ray.init(address=sys.argv[2], log_to_driver=False)
from tandem import LLM
llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="ray", dtype="float32", device="cpu",
          attention_backend="torch_sdpa")
print(" ".join(map(str, llm.engine.executor.pids)), flush=True)
if sys.argv[3] == "wait":
    time.sleep(600)
"""


@pytest.mark.parametrize("how", ["exit", "SIGKILL"])
def test_no_rank_outlives_its_driver(ray_local, bart_dir, how):
    """A driver on the cluster that reaches the end of its script without shutting its
    engine down (the executor's finalizer stops the ranks at interpreter exit), or is
    killed outright (nothing of its own runs: Ray ends the actors it owns): no rank
    process is left and their CPUs are free again."""
    import os
    import signal
    import subprocess
    import sys

    address = ray_local.get_runtime_context().gcs_address
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(bart_dir), address, "exit" if how == "exit" else "wait"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()  # the ranks' pids, once the engine is up
        assert line.strip(), f"the driver exited ({proc.poll()}) before its engine was up"
        pids = [int(p) for p in line.split()]
        assert all(_alive(p) for p in pids) and os.getpid() not in pids
        if how != "exit":
            proc.send_signal(getattr(signal, how))
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == (0 if how == "exit" else -signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "a rank outlived its driver by 30 s"
    while ray_local.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_local.available_resources().get("CPU", 0) == 2


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
