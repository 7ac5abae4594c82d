"""Fault injection: no single request, and no single failed step, stops the engine.

Faults come from a backend that raises in ``forward`` at chosen steps
(``faulty_backend.py``), a worker-side ``MemoryError`` in the sampler, a beam
update and an output build that raise for one request. Under ``LLM``,
``AsyncLLM`` and the server, the requests the fault reaches end with ``error``
(the server: a 500 JSON error) and the others equal a clean run's outputs; the
engine serves afterwards, and only ``max_consecutive_step_failures`` failed
steps in a row make it dead. Every wait is bounded.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from faulty_backend import FaultyBackend
from helpers import final_output
from tandem import LLM, AsyncLLM, EngineDeadError, SamplingParams
from tandem.core.output_processor import RequestState
from tandem.core.strategies.beam import BeamSearchStrategy
from tandem.entrypoints.openai.api_server import build_app
from tandem.plugins import default_backend_registry

WAIT = 60.0
PROMPTS = [{"prompt_token_ids": [0, 5 + i, 9 + 2 * i, 17, 2]} for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def faulty_registered():
    default_backend_registry().register_backend(FaultyBackend.name, FaultyBackend, override=True)
    FaultyBackend.reset()
    yield
    FaultyBackend.reset()


def _llm(bart_dir, **kw):
    return LLM(model=str(bart_dir), dtype="float32", device="cpu", attention_backend="faulty_sdpa", **kw)


@pytest.fixture(scope="module")
def clean(bart_dir):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu")
    beams = SamplingParams(num_beams=2, max_tokens=6, temperature=0.0)
    return {
        "greedy": [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)],
        "beams": [o.outputs[0].token_ids for o in llm.generate(PROMPTS, beams, use_tqdm=False)],
    }


def _all_blocks_free(llm) -> bool:
    s = llm.get_stats()
    return s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_requests_unfinished"] == 0


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(bart_dir, clean):
    llm = _llm(bart_dir, max_num_seqs=2)  # two requests a step: the rest wait for later steps
    FaultyBackend.reset(fail_steps={2})
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    failed = [i for i, o in enumerate(outs) if o.error is not None]
    assert failed == [0, 1]  # the two decoding in step 2
    for i in failed:
        assert "InjectedFault: injected fault at step 2" in outs[i].error
        # one output per requested one, as vLLM's loops read outputs[0] (docs/from_vllm.md)
        [c] = outs[i].outputs
        assert (c.finish_reason, c.error) == ("error", outs[i].error)
    for i, o in enumerate(outs):
        if i not in failed:
            assert o.outputs[0].token_ids == clean["greedy"][i]
    assert _all_blocks_free(llm)
    h = llm.engine.health()
    assert (h.status, h.failed_steps, h.consecutive_step_failures) == ("ok", 1, 0)
    # It serves on, the failed prompts included.
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == clean["greedy"]


def test_consecutive_failed_steps_make_the_engine_dead(bart_dir):
    llm = _llm(bart_dir, max_consecutive_step_failures=2)
    FaultyBackend.reset(fail_steps={1})
    outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert all("injected fault" in o.error for o in outs)
    h = llm.engine.health()
    assert (h.status, h.consecutive_step_failures) == ("degraded", 1)  # no good step since
    FaultyBackend.reset(fail_always=True)
    with pytest.raises(EngineDeadError, match="injected fault"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.health().status == "dead"
    FaultyBackend.reset()
    with pytest.raises(EngineDeadError):  # refused at once, whatever the backend does now
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)


def test_a_worker_memory_error_fails_the_step_alone(bart_dir, clean, monkeypatch):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", max_num_seqs=3)
    sampler = llm.engine.worker.sampler
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise MemoryError("worker out of memory")
        return type(sampler).__call__(sampler, *args, **kwargs)

    monkeypatch.setattr(llm.engine.worker, "sampler", flaky)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    failed = [i for i, o in enumerate(outs) if o.error is not None]
    assert failed == [0, 1, 2]
    assert all("MemoryError: worker out of memory" in outs[i].error for i in failed)
    assert [o.outputs[0].token_ids for o in outs[3:]] == clean["greedy"][3:]
    assert _all_blocks_free(llm)


def test_one_requests_beam_update_fault_fails_it_alone(bart_dir, clean, monkeypatch):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu")
    # The per-request part of beam search's update (after the search step stacked over
    # the step's beam requests: BeamSearchStrategy.update_all).
    original = BeamSearchStrategy._place

    def raising_for_three_beams(ops, group, running, beams):
        if group.sampling_params.num_beams == 3:
            raise ArithmeticError("this request's beams")
        return original(ops, group, running, beams)

    monkeypatch.setattr(BeamSearchStrategy, "_place", staticmethod(raising_for_three_beams))
    beams = SamplingParams(num_beams=2, max_tokens=6, temperature=0.0)
    bad = SamplingParams(num_beams=3, max_tokens=6, temperature=0.0)
    params = [beams, GREEDY, bad, beams, GREEDY, beams]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert "ArithmeticError: this request's beams" in outs[2].error
    for i, (o, p) in enumerate(zip(outs, params)):
        if i != 2:
            assert o.error is None
            assert o.outputs[0].token_ids == clean["beams" if p is beams else "greedy"][i]
    assert _all_blocks_free(llm)


def test_a_fault_in_the_beams_stacked_take_over_fails_the_requests_in_it(bart_dir, clean, monkeypatch):
    """The block work of a step's moved beams is one call for the step's beam requests
    (``Scheduler.take_over``): a fault there fails the requests whose beams moved, the
    pool is checked, and the other requests and the engine go on."""
    from tandem.core.kv.block_manager import BlockManager

    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu")
    original, calls = BlockManager.take_over, []

    def raising_on_the_third_call(self, pairs):
        calls.append({s.seq_id for s, _ in pairs})
        if len(calls) == 3:
            raise ArithmeticError("injected in take_over")
        return original(self, pairs)

    monkeypatch.setattr(BlockManager, "take_over", raising_on_the_third_call)
    beams = SamplingParams(num_beams=2, max_tokens=6, temperature=0.0)
    params = [beams, GREEDY, beams, GREEDY]
    outs = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    assert len(calls) >= 3
    failed = [i for i, o in enumerate(outs) if o.error is not None]
    assert failed and set(failed) <= {0, 2}
    assert all("ArithmeticError: injected in take_over" in outs[i].error for i in failed)
    for i, o in enumerate(outs):
        if i not in failed:
            assert o.outputs[0].token_ids == clean["beams" if params[i] is beams else "greedy"][i]
    assert _all_blocks_free(llm)
    monkeypatch.undo()
    again = llm.generate(PROMPTS[:1], beams, use_tqdm=False)[0]  # the engine serves on
    assert again.error is None and again.outputs[0].token_ids == clean["beams"][0]


def test_one_requests_output_fault_fails_it_alone(bart_dir, clean, monkeypatch):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu")
    original = RequestState.apply  # the output processor's first look at a step's result

    def raising_for_request_1(self, result):
        # Tokens so far, with the result's: a FINAL_ONLY request's come in one result at its end.
        seen = len(self.completions[0].token_ids) + sum(len(d.new_token_ids) for d in result.completions)
        if self.info.request_id.endswith("1") and seen >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a broken tokenizer")
        return original(self, result)

    monkeypatch.setattr(RequestState, "apply", raising_for_request_1)
    outs = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    assert "building its output failed: UnicodeDecodeError" in outs[1].error
    assert [(c.text, c.finish_reason, c.error) for c in outs[1].outputs] == [("", "error", outs[1].error)]
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [clean["greedy"][0], clean["greedy"][2]]
    assert _all_blocks_free(llm)


# -- AsyncLLM and the server -------------------------------------------------------------
@pytest.mark.asyncio
async def test_async_llm_serves_on_after_a_failed_step(bart_dir, clean):
    engine = AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu", attention_backend="faulty_sdpa",
                      max_num_seqs=2)
    try:
        FaultyBackend.reset(fail_steps={2})
        outs = await asyncio.wait_for(
            asyncio.gather(*(final_output(engine, p, GREEDY, f"r{i}") for i, p in enumerate(PROMPTS))), WAIT)
        failed = [i for i, o in enumerate(outs) if o.error is not None]
        assert 0 < len(failed) <= 2
        assert all("injected fault" in outs[i].error for i in failed)
        for i, o in enumerate(outs):
            if i not in failed:
                assert o.outputs[0].token_ids == clean["greedy"][i]
        assert engine.health().status == "ok"
        again = await asyncio.wait_for(final_output(engine, PROMPTS[0], GREEDY, "after"), WAIT)
        assert again.outputs[0].token_ids == clean["greedy"][0]
        FaultyBackend.reset(fail_always=True)  # max_consecutive_step_failures=3: the third failed step kills
        for k in range(2):
            out = await asyncio.wait_for(final_output(engine, PROMPTS[0], GREEDY, f"fails-{k}"), WAIT)
            assert "injected fault" in out.error and engine.health().status == "degraded"
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(final_output(engine, PROMPTS[0], GREEDY, "dies"), WAIT)
        assert engine.health().status == "dead"
    finally:
        FaultyBackend.reset()
        await asyncio.wait_for(engine.shutdown(), WAIT)


@pytest.mark.asyncio
async def test_async_llm_a_raising_logits_processor_fails_only_its_request(bart_dir, clean):
    def broken(output_ids, logits):
        if len(output_ids) == 3:
            raise ValueError("bad state")
        return logits

    bad = GREEDY.replace(logits_processors=[broken])
    engine = AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu")
    try:
        params = [bad if i == 2 else GREEDY for i in range(len(PROMPTS))]
        outs = await asyncio.wait_for(
            asyncio.gather(*(final_output(engine, p, sp, f"r{i}") for i, (p, sp) in enumerate(zip(PROMPTS, params)))), WAIT)
        assert "logits processor 'broken' raised ValueError: bad state" in outs[2].error
        assert [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 2] == \
            [t for i, t in enumerate(clean["greedy"]) if i != 2]
        assert engine.health().status == "ok"  # a request's own fault is no step failure
        again = await asyncio.wait_for(final_output(engine, PROMPTS[2], GREEDY, "after"), WAIT)
        assert again.outputs[0].token_ids == clean["greedy"][2]
        s = engine.get_stats()
        assert s["kv_blocks_free"] == s["kv_blocks_total"]
    finally:
        await asyncio.wait_for(engine.shutdown(), WAIT)


@pytest.mark.asyncio
async def test_server_answers_500_for_the_failed_step_and_serves_on(bart_dir, clean):
    engine = AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu", attention_backend="faulty_sdpa",
                      max_num_seqs=2)
    app = build_app(engine, served_model_name="m")
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=WAIT) as client:
            FaultyBackend.reset(fail_steps={2})
            body = lambda i, stream=False: {  # noqa: E731
                "prompt": PROMPTS[i], "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": stream}
            rs = await asyncio.gather(*(client.post("/v1/completions", json=body(i)) for i in range(4)))
            codes = [r.status_code for r in rs]
            assert 500 in codes and 200 in codes
            for i, r in enumerate(rs):
                if r.status_code == 500:
                    err = r.json()["error"]
                    assert err["type"] == "server_error" and "injected fault" in err["message"]
                else:  # served in full (its text may be empty: special tokens under ignore_eos)
                    assert r.json()["choices"][0]["finish_reason"] == "length", r.text
                    assert r.json()["usage"]["completion_tokens"] == 8, r.text
            h = await client.get("/health")
            assert h.status_code == 200
            # A stream whose step fails ends with an error event, in JSON.
            FaultyBackend.reset(fail_steps={3})
            r = await client.post("/v1/completions", json=body(0, stream=True))
            assert r.status_code == 200 and '"server_error"' in r.text and "injected fault" in r.text
            h = await client.get("/health")
            assert h.status_code == 200 and h.json()["status"] == "degraded"
            FaultyBackend.reset()
            ok = await client.post("/v1/completions", json=body(1))
            assert ok.status_code == 200
            assert (await client.get("/health")).text == "ok"
            FaultyBackend.reset(fail_always=True)
            codes = [(await client.post("/v1/completions", json=body(2))).status_code for _ in range(4)]
            assert codes == [500, 500, 503, 503]  # the third failed step in a row kills the engine
            h = await client.get("/health")
            for _ in range(100):  # the loop publishes its death right after the last step
                if h.status_code == 503:
                    break
                await asyncio.sleep(0.05)
                h = await client.get("/health")
            assert h.status_code == 503 and "dead" in h.json()["error"]["message"]
    finally:
        FaultyBackend.reset()
        await asyncio.wait_for(engine.shutdown(), WAIT)


def test_a_torn_swap_fails_the_swapped_requests_too(bart_dir, clean, monkeypatch):
    """A swap-out that raises part of the way fails the step's requests and the
    swapped-out ones (their CPU copies may be torn); the rest finish as in a clean run."""
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=20,
              preemption_mode="swap", max_num_seqs=4)  # 3 swap-outs in a clean run
    worker = llm.engine.worker
    original = type(worker)._swap
    calls = {"n": 0}

    def tearing(self, mapping, to_cpu):
        calls["n"] += 1
        if to_cpu and calls["n"] == 1:
            raise OSError("swap device gone")
        return original(self, mapping, to_cpu)

    monkeypatch.setattr(type(worker), "_swap", tearing)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    failed = [i for i, o in enumerate(outs) if o.error is not None]
    assert failed and len(failed) < len(PROMPTS)
    assert all("KVTransferError: swapping KV blocks failed: OSError: swap device gone" in outs[i].error for i in failed)
    assert llm.get_stats()["swapped_out_blocks"] > 0  # later swaps went through
    ref = LLM(model=str(bart_dir), dtype="float32", device="cpu").generate(PROMPTS, params, use_tqdm=False)
    for i, o in enumerate(outs):
        if i not in failed:
            assert [c.token_ids for c in o.outputs] == [c.token_ids for c in ref[i].outputs]
    assert _all_blocks_free(llm)
