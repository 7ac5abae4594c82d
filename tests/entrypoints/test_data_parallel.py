"""``LLM(data_parallel_size=N)``: engine replicas in processes of their own
(tandem/entrypoints/replicas.py), checked against the one-engine ``LLM`` and HF.

Every test here starts replica processes (each loads torch and the checkpoint: seconds),
so they share two LLMs built once per module where they can."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from helpers import hf_greedy, process_alive
from tandem import LLM, SamplingParams


def _prompts(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": [0] + torch.randint(4, 90, (int(torch.randint(3, 12, (1,), generator=g)),),
                                                     generator=g).tolist() + [2]} for _ in range(n)]


@pytest.fixture(scope="module")
def single(bart_dir):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu")
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def replicated(bart_dir):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", data_parallel_size=2)
    yield llm
    llm.shutdown()


def test_greedy_outputs_equal_one_engine_and_hf(bart_dir, single, replicated):
    prompts = _prompts(9)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    one = single.generate(prompts, params, use_tqdm=False)
    two = replicated.generate(prompts, params, use_tqdm=False)
    assert replicated.data_parallel_size == 2
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    # The independent oracle: HF generate, prompt by prompt.
    for out in two:
        assert out.error is None, out.error
        assert out.outputs[0].token_ids == hf_greedy(bart_dir, out.encoder_prompt_token_ids, out.prompt_token_ids, 8, 0)


@pytest.mark.slow  # starts engines of its own (or waits out a call): in CI's bf16 stage
def test_replicas_are_topped_up_as_their_requests_finish(bart_dir, single):
    # Two requests at a time each (max_num_seqs=2): the first four are dealt out, the rest
    # wait in the parent and go to whichever replica has room.
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", data_parallel_size=2, max_num_seqs=2)
    try:
        prompts = _prompts(11, seed=7)
        params = [SamplingParams(temperature=0.0, max_tokens=1 + 3 * (i % 4)) for i in range(11)]
        two = llm.generate(prompts, params, use_tqdm=False)
        one = single.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
        assert [o.outputs[0].finish_reason for o in two] == [o.outputs[0].finish_reason for o in one]
        assert llm.get_stats()["num_requests_finished"] == 11
    finally:
        llm.shutdown()


def test_params_that_cannot_leave_the_process_are_served_by_its_engine(single, replicated):
    # A user logits processor defined here (a closure) does not pickle: its requests stay with
    # replica 0 (this process's engine); the others are dealt out as usual.
    banned = 63

    def ban(token_ids, logits):
        logits[banned] = float("-inf")
        return logits

    prompts = _prompts(6, seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=6, logits_processors=[ban]) if i % 3 == 1
              else SamplingParams(temperature=0.0, max_tokens=6) for i in range(6)]
    two = replicated.generate(prompts, params, use_tqdm=False)
    one = single.generate(prompts, params, use_tqdm=False)
    assert [o.error for o in two] == [None] * 6
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    assert all(banned not in two[i].outputs[0].token_ids for i in (1, 4))


def test_options_that_cannot_reach_a_replica_are_refused_naming_them(bart_dir):
    import threading

    from tandem.entrypoints.replicas import ReplicaPool

    with pytest.raises(ValueError, match="'lock' cannot be sent to a replica's process"):
        ReplicaPool(str(bart_dir), {"dtype": "float32", "lock": threading.Lock()}, 2, 1, 0)


def test_a_bad_prompt_is_answered_in_its_place(replicated):
    prompts = _prompts(5, seed=1)
    prompts[3] = {"prompt_token_ids": [0, 10**9, 2]}  # an id past the vocabulary: refused
    outs = replicated.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert [o.error is not None for o in outs] == [False, False, False, True, False]
    assert "1000000000" in outs[3].error
    assert all(len(o.outputs[0].token_ids) == 4 for i, o in enumerate(outs) if i != 3)


def test_seeded_sampling_equals_one_engine(single, replicated):
    # A request's own seed fixes its draws whatever else runs beside it, so which replica
    # serves it does not matter.
    prompts = _prompts(6, seed=2)
    params = [SamplingParams(temperature=1.0, top_k=20, max_tokens=8, seed=100 + i) for i in range(6)]
    one = single.generate(prompts, params, use_tqdm=False)
    two = replicated.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]


def test_stats_are_summed_over_replicas(replicated):
    before = replicated.get_stats()["num_requests_finished"]
    replicated.generate(_prompts(7, seed=3), SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    stats = replicated.get_stats()
    assert stats["num_requests_finished"] == before + 7
    assert stats["kv_blocks_total"] == 2 * replicated.llm_engine.get_stats()["kv_blocks_total"]


@pytest.mark.slow  # starts engines of its own (or waits out a call): in CI's bf16 stage
def test_stats_read_during_a_call_from_another_thread(single, replicated):
    import threading

    prompts = _prompts(8, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=30, min_tokens=30)
    before = replicated.get_stats()["num_requests_finished"]
    result = {}
    call = threading.Thread(target=lambda: result.update(outs=replicated.generate(prompts, params, use_tqdm=False)))
    call.start()
    seen = []
    while call.is_alive():  # the replicas' connections are the call's alone: this must not read them
        seen.append(replicated.get_stats()["num_requests_finished"])
    call.join()
    assert seen == sorted(seen) and before <= seen[0] and seen[-1] <= before + 8
    ref = single.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in result["outs"]] == [o.outputs[0].token_ids for o in ref]
    assert replicated.get_stats()["num_requests_finished"] == before + 8


def test_a_failed_call_aborts_every_share_and_the_next_call_is_served(replicated, monkeypatch):
    engine = replicated.llm_engine
    real_step, calls = engine.step, [0]

    def failing_step():
        calls[0] += 1
        if calls[0] == 2:
            raise KeyboardInterrupt  # what Ctrl-C does mid-call
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        replicated.generate(_prompts(6, seed=4), SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    monkeypatch.setattr(engine, "step", real_step)
    assert not engine.has_unfinished_requests()
    prompts = _prompts(4, seed=5)
    outs = replicated.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert [o.error for o in outs] == [None] * 4 and all(len(o.outputs[0].token_ids) == 3 for o in outs)
    assert replicated.get_stats()["num_requests_unfinished"] == 0


def test_a_request_its_engine_never_answers_is_not_waited_for(replicated, monkeypatch):
    # An engine fault that ends a request without an output (a dropped output, here) must
    # not leave the call waiting: the request gets an error output, the others theirs.
    engine, real_step, dropped = replicated.llm_engine, replicated.llm_engine.step, []

    def step():
        outs = real_step()
        if not dropped and outs:
            dropped.append(outs[0].request_id)
            return outs[1:]
        return outs

    monkeypatch.setattr(engine, "step", step)
    outs = replicated.generate(_prompts(6, seed=10), SamplingParams(temperature=0.0, max_tokens=3, min_tokens=3),
                              use_tqdm=False)
    errors = [o for o in outs if o.error is not None]
    assert [o.request_id for o in errors] == dropped and "without an output" in errors[0].error
    assert all(len(o.outputs[0].token_ids) == 3 for o in outs if o.error is None)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_a_bad_size_is_refused_naming_it(bart_dir, bad):
    with pytest.raises(ValueError, match=f"data_parallel_size={bad!r}"):
        LLM(model=str(bart_dir), dtype="float32", device="cpu", data_parallel_size=bad)


def test_a_replica_that_fails_to_build_raises_at_construction(bart_dir, tmp_path):
    # Replica 0 builds first: a bad option fails there, before any process starts.
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(model=str(bart_dir), dtype="float32", device="cpu", data_parallel_size=2, max_num_seqs=0)


@pytest.mark.slow  # starts engines of its own (or waits out a call): in CI's bf16 stage
@pytest.mark.parametrize("when", ["before the call", "during the call"])
def test_a_dead_replica_answers_its_prompts_with_an_error_and_the_rest_are_served(bart_dir, monkeypatch, when):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", data_parallel_size=3)
    try:
        victim = llm._pool.replicas[0]

        def kill():
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait(10)

        if when == "before the call":
            kill()
        else:  # while replica 0 (this process's engine) takes its second step
            engine, real_step, calls = llm.llm_engine, llm.llm_engine.step, [0]

            def step():
                calls[0] += 1
                if calls[0] == 2:
                    kill()
                return real_step()

            monkeypatch.setattr(engine, "step", step)
        prompts = _prompts(9, seed=6)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40), use_tqdm=False)
        monkeypatch.undo()
        # Prompt i went to replica i mod 3: replica 1's (1, 4, 7) name its death, the rest are served.
        for i, o in enumerate(outs):
            if i % 3 == 1:
                assert o.error is not None and "engine replica 1" in o.error and "SIGKILL" in o.error, o.error
            else:
                assert o.error is None and len(o.outputs[0].token_ids) == 40
        assert llm.data_parallel_size == 2
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        assert all(o.error is None for o in outs)
    finally:
        llm.shutdown()
    assert not process_alive(llm._pool.replicas[1].proc.pid)


CHILD = textwrap.dedent("""
    import sys, time
    from tandem import LLM, SamplingParams

    # No `if __name__ == "__main__"` guard: replicas start fresh interpreters, not this script.
    llm = LLM(model=sys.argv[1], dtype="float32", device="cpu", data_parallel_size=2)
    outs = llm.generate([{"prompt_token_ids": [0, 5, 6, 2]}] * 2, SamplingParams(max_tokens=2), use_tqdm=False)
    assert all(o.error is None for o in outs)
    print(*[r.proc.pid for r in llm._pool.replicas], flush=True)
    time.sleep(600)
""")


@pytest.mark.slow  # starts engines of its own (or waits out a call): in CI's bf16 stage
def test_no_replica_outlives_a_killed_parent(bart_dir, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, str(script), str(bart_dir)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = child.stdout.readline()
        if not line:
            pytest.fail(f"the child failed: {child.wait(60)} {child.stderr.read()[-3000:]}")
        pids = [int(p) for p in line.split()]
        assert len(pids) == 1 and process_alive(pids[0])
        child.kill()  # SIGKILL: the parent runs no clean-up at all
        child.wait(30)
        deadline = time.monotonic() + 10
        while process_alive(pids[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not process_alive(pids[0])
    finally:
        if child.poll() is None:
            child.kill()
