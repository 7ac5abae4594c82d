"""A request whose adapter is still being read waits without holding up the others.

The adapter's read is made slow deterministically: the read function blocks on a
``threading.Event`` for one adapter directory. The engine is stepped by hand: the base
request and a request with an adapter already in the CPU cache, submitted with the slow
one, finish while the slow read still blocks, and the slow request holds no KV block
meanwhile. Released, it equals the same request served alone (no waiting). No timing is
asserted: the event orders everything.
"""

from __future__ import annotations

import importlib
import threading

import pytest

import tandem.lora.adapter
from helpers import make_bart
from lora_adapters import make_adapter
from tandem import LLM, LoRARequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [0, 5, 17, 33, 9, 41, 2]}, {"prompt_token_ids": [0, 60, 7, 7, 12, 2]},
           {"prompt_token_ids": [0, 11, 90, 4, 2]}]
# A step never waits on the blocked read, so the steps it takes for the others to finish
# are ~max_tokens; this bound only turns a hang into a failure.
MAX_STEPS = 500
# Only reached when the read runs inside the step (the code before the loader): it then
# blocks the step until this passes and fails, where the test expects it never to block.
BLOCK_S = 60.0


ALL = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_async")
    base = make_bart(root / "base", seed=6)
    slow, other = (make_adapter(base, root / name, ALL, seed=s, std=0.2) for name, s in (("slow", 11), ("other", 12)))
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=3)
    other_lora = LoRARequest("other", 2, str(other))
    # The oracle: each request served alone, the slow adapter under its own id (so the
    # test's id must still be read); this also puts "other" in the CPU cache.
    alone = [llm.generate([p], GREEDY, lora_request=lora, use_tqdm=False)[0].outputs[0].token_ids
             for p, lora in zip(PROMPTS, [LoRARequest("slow-alone", 1, str(slow)), None, other_lora])]
    base_out = llm.generate([PROMPTS[0], PROMPTS[2]], GREEDY, use_tqdm=False)
    # The adapters change the outputs.
    assert base_out[0].outputs[0].token_ids != alone[0] and base_out[1].outputs[0].token_ids != alone[2]
    return llm, slow, other_lora, alone


def _block_reads_of(monkeypatch, folder, release: threading.Event, fail: str | None = None):
    """Make reading ``folder``'s adapter wait for ``release`` (then raise ``fail``, if given),
    wherever the engine reads adapters."""
    started = threading.Event()
    real = tandem.lora.adapter.read_adapter

    def read(path, max_rank, fits=None):
        if str(path) == str(folder):
            started.set()
            if not release.wait(BLOCK_S):
                raise RuntimeError("the slow read was never released")
            if fail is not None:
                raise tandem.lora.adapter.AdapterError(fail)
        return real(path, max_rank, fits)

    for name in ("tandem.lora.loader", "tandem.lora.manager"):
        try:
            module = importlib.import_module(name)
        except ImportError:  # the code before the loader read adapters in the manager only
            continue
        monkeypatch.setattr(module, "read_adapter", read, raising=False)
    return started


def _run_until(engine, done, finals):
    for _ in range(MAX_STEPS):
        if done():
            return
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    raise AssertionError(f"not done after {MAX_STEPS} steps; finished: {sorted(finals)}")


def _submit(engine, slow_lora, other_lora, tag):
    ids = [f"{tag}-slow", f"{tag}-base", f"{tag}-other"]
    for rid, prompt, lora in zip(ids, PROMPTS, [slow_lora, None, other_lora]):
        engine.add_request(rid, prompt, GREEDY, lora_request=lora)
    return ids


def test_a_slow_adapter_read_holds_up_no_other_request(setup, monkeypatch):
    llm, slow, other_lora, alone = setup
    engine = llm.llm_engine
    release = threading.Event()
    started = _block_reads_of(monkeypatch, slow, release)
    slow_lora = LoRARequest("slow", 3, str(slow))
    slow_id, *others = _submit(engine, slow_lora, other_lora, "wait")
    finals = {}
    try:
        _run_until(engine, lambda: all(r in finals for r in others), finals)
        assert started.is_set() and not release.is_set()
        assert slow_id not in finals and engine.has_unfinished_requests()
        stats = engine.get_stats()
        assert stats["num_requests_waiting"] == 1 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    finally:
        release.set()
    _run_until(engine, lambda: slow_id in finals, finals)
    got = [finals[r] for r in (slow_id, *others)]
    assert [o.error for o in got] == [None] * 3
    assert [o.outputs[0].token_ids for o in got] == alone


def test_a_failed_adapter_read_fails_its_request_alone(setup, monkeypatch):
    llm, slow, other_lora, alone = setup
    engine = llm.llm_engine
    release = threading.Event()
    _block_reads_of(monkeypatch, slow, release, fail="a read that fails on purpose")
    slow_lora = LoRARequest("broken", 4, str(slow))
    slow_id, *others = _submit(engine, slow_lora, other_lora, "fail")
    finals = {}
    try:
        _run_until(engine, lambda: all(r in finals for r in others), finals)
        assert slow_id not in finals
    finally:
        release.set()
    _run_until(engine, lambda: slow_id in finals, finals)
    assert finals[slow_id].error == f"LoRA adapter 'broken' ({slow}): a read that fails on purpose"
    assert [finals[r].error for r in others] == [None, None]
    assert [finals[r].outputs[0].token_ids for r in others] == alone[1:]
    assert not engine.has_unfinished_requests()
    # Nothing is remembered of the failure: the same id read again (now unblocked) serves.
    monkeypatch.undo()
    out = llm.generate(PROMPTS[:1], GREEDY, lora_request=slow_lora, use_tqdm=False)[0]
    assert out.error is None and out.outputs[0].token_ids == alone[0]


def test_pinned_adapters_are_not_evicted_while_their_requests_wait(tmp_path):
    """One CPU cache place, three adapters asked for at once: each read waits for the
    previous adapter's requests to finish (it is pinned meanwhile), none deadlocks."""
    base = make_bart(tmp_path / "base", seed=5)
    loras = [LoRARequest(f"a{i}", i, str(make_adapter(base, tmp_path / f"a{i}", ["q_proj", "fc2"], seed=30 + i)))
             for i in (1, 2, 3)]
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1)
    alone = [llm.generate(PROMPTS[:1], GREEDY, lora_request=lora, use_tqdm=False)[0].outputs[0].token_ids
             for lora in loras]
    reads = llm.llm_engine.lora_loads.loads
    outs = llm.generate(PROMPTS[:1] * 6, GREEDY, lora_request=loras + loras[::-1], use_tqdm=False)
    assert [o.error for o in outs] == [None] * 6
    assert [o.outputs[0].token_ids for o in outs] == alone + alone[::-1]
    # Each adapter read once: both of its requests run while it is pinned.
    assert llm.llm_engine.lora_loads.loads - reads == 3
