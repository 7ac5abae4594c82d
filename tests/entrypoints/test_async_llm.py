"""AsyncLLM: per-step outputs to asyncio consumers from an engine thread; cancelling
and aborting free blocks; a rejected request fails alone; a dead engine loop
reaches every waiting request as an error, never a hang. Every wait is bounded."""

import asyncio

import pytest
import pytest_asyncio

from tandem import LLM, AsyncLLM, EngineDeadError, RequestOutputKind, SamplingParams

pytestmark = pytest.mark.asyncio
WAIT = 60.0  # seconds: a bound on every await, so a bug fails instead of hanging


def _prompts(n):
    return [{"prompt_token_ids": [0, 5 + i, 9 + 2 * i, 17, 2]} for i in range(n)]


@pytest_asyncio.fixture
async def engine(bart_dir):
    e = AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu")
    yield e
    await asyncio.wait_for(e.shutdown(), WAIT)


async def _collect(engine, prompt, params, rid=None):
    outs = []
    async for out in engine.generate(prompt, params, rid):
        outs.append(out)
    return outs


async def _blocks_all_free(engine):
    for _ in range(200):
        stats = engine.get_stats()
        if stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["num_requests_unfinished"] == 0:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_concurrent_streams_equal_the_offline_engine(engine, bart_dir):
    prompts = _prompts(8)
    params = SamplingParams(temperature=0.0, max_tokens=12, output_kind=RequestOutputKind.DELTA)
    results = await asyncio.wait_for(
        asyncio.gather(*(_collect(engine, p, params, f"r{i}") for i, p in enumerate(prompts))), WAIT
    )
    ref = LLM(model=str(bart_dir), dtype="float32", device="cpu").generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False
    )
    for outs, r in zip(results, ref):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert len(outs) > 1  # streamed step by step
        tokens = [t for o in outs for t in o.outputs[0].token_ids]  # deltas add up to the whole
        assert tokens == r.outputs[0].token_ids
    assert await _blocks_all_free(engine)


async def test_cancelling_a_consumer_aborts_its_request(engine):
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    seen = asyncio.Event()

    async def consume():
        async for _ in engine.generate(_prompts(1)[0], params, "long"):
            seen.set()

    task = asyncio.create_task(consume())
    other = asyncio.create_task(_collect(engine, _prompts(2)[1], SamplingParams(temperature=0.0, max_tokens=6)))
    await asyncio.wait_for(seen.wait(), WAIT)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    outs = await asyncio.wait_for(other, WAIT)
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6  # the other request is unharmed
    assert await _blocks_all_free(engine)


async def test_abort_ends_the_stream_with_an_aborted_output(engine):
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    outs = []

    async def consume():
        async for out in engine.generate(_prompts(1)[0], params, "to-abort"):
            outs.append(out)
            if len(outs) == 2:
                await engine.abort("to-abort")

    await asyncio.wait_for(consume(), WAIT)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 100
    assert await _blocks_all_free(engine)


async def test_a_rejected_request_fails_alone(engine):
    good = asyncio.create_task(_collect(engine, _prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=5)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await asyncio.wait_for(_collect(engine, {"prompt_token_ids": [0, 10_000, 2]}, None), WAIT)
    with pytest.raises(ValueError, match="already in use"):
        await asyncio.wait_for(
            asyncio.gather(
                _collect(engine, _prompts(1)[0], SamplingParams(max_tokens=50, ignore_eos=True), "same"),
                _collect(engine, _prompts(1)[0], SamplingParams(max_tokens=5), "same"),
            ),
            WAIT,
        )
    outs = await asyncio.wait_for(good, WAIT)
    assert outs[-1].finished and outs[-1].error is None


async def test_a_dead_engine_loop_is_an_error_for_every_waiting_request(bart_dir):
    engine = AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu")
    real_step = engine.engine.core.step  # what the engine thread runs each step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device failure")
        return real_step()

    engine.engine.core.step = failing_step
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    results = await asyncio.wait_for(
        asyncio.gather(*(_collect(engine, p, params) for p in _prompts(3)), return_exceptions=True), WAIT
    )
    assert all(isinstance(r, EngineDeadError) and "simulated device failure" in str(r) for r in results)
    assert engine.errored
    with pytest.raises(EngineDeadError):
        await asyncio.wait_for(_collect(engine, _prompts(1)[0], params), WAIT)
    await asyncio.wait_for(engine.shutdown(), WAIT)


async def test_seeded_samples_with_stop_strings_equal_the_offline_engine_alone_or_batched(engine, bart_dir):
    """A seeded request with n > 1 and stop strings gives the offline engine's completions
    (where a stop reaches the core before the next step), run alone and beside other
    requests. Here the frontend finds a stop string on the event loop while the engine
    thread steps on, so a completion a string ended runs a step or more in the core before
    the stop reaches it: those extra steps must draw from no stream but its own."""
    prompts = [{"prompt_token_ids": [0, 5 + i, 20 + 2 * i, 40 + i, 2]} for i in range(3)]
    cases = [SamplingParams(temperature=1.0, seed=seed, n=4, max_tokens=16, stop=stop)
             for seed in (2, 3, 5) for stop in (["sat"], ["old"], ["star", "city"])]
    offline = LLM(model=str(bart_dir), dtype="float32", device="cpu")
    ref = [[o.token_ids for o in out.outputs] for out in offline.generate([prompts[0]] * len(cases), cases,
                                                                          use_tqdm=False)]

    async def final(prompt, params, rid):
        outs = await _collect(engine, prompt, params, rid)
        return outs[-1]

    other = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=16, stop=["old"])
    cut_early = 0
    for i, (params, want) in enumerate(zip(cases, ref)):
        alone = await asyncio.wait_for(final(prompts[0], params, f"alone{i}"), WAIT)
        _, beside, _ = await asyncio.wait_for(asyncio.gather(
            final(prompts[1], other, f"other{i}"), final(prompts[0], params, f"beside{i}"),
            final(prompts[2], SamplingParams(temperature=0.8, max_tokens=9), f"plain{i}")), WAIT)
        assert [o.token_ids for o in alone.outputs] == want
        assert [o.token_ids for o in beside.outputs] == want
        # Not degenerate: a completion a string ended while a sibling went on.
        lengths = [len(t) for t in want]
        cut_early += any(isinstance(o.stop_reason, str) and len(o.token_ids) < max(lengths) for o in alone.outputs)
    assert cut_early >= 3
    assert await _blocks_all_free(engine)
