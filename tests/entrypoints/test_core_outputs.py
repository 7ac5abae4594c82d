"""The plain-data core and the frontends that follow its outputs.

- ``AsyncLLM`` detokenizes in its consumers, never on the engine thread, and a
  stop string found there ends the request in the core (its blocks freed);
  the streamed text equals the offline engine's.
- The core reports a block still held when no request is left as an error
  instead of resetting the pool."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tandem import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from tandem.core import output_processor
from tandem.core.kv.block_pool import Device

WAIT = 60.0
PROMPTS = [{"prompt_token_ids": [0, 5 + i, 9 + 2 * i, 17, 2]} for i in range(4)]


@pytest.mark.asyncio
async def test_async_llm_detokenizes_off_the_engine_thread_and_stops_in_the_core(bart_dir, monkeypatch):
    threads: set[str] = set()

    def on_thread(original):
        def add(self, *args):
            threads.add(threading.current_thread().name)
            return original(self, *args)
        return add

    # Per sequence (a slow tokenizer) or every sequence of a step at once (a fast one's).
    for cls in (output_processor.IncrementalDetokenizer, output_processor.BatchDetokenizer):
        monkeypatch.setattr(cls, "add", on_thread(cls.add))
    offline = LLM(model=str(bart_dir), dtype="float32", device="cpu")
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref = offline.generate(PROMPTS, plain, use_tqdm=False)
    # A stop string: the second word of the first completion's text.
    stop = ref[0].outputs[0].text.split()[1]
    params = plain.replace(stop=[stop], output_kind=RequestOutputKind.DELTA)
    expected = offline.generate(PROMPTS, params, use_tqdm=False)
    threads.clear()

    engine = AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu")
    try:
        async def collect(i):
            return [o async for o in engine.generate(PROMPTS[i], params, f"r{i}")]

        streams = await asyncio.wait_for(asyncio.gather(*(collect(i) for i in range(len(PROMPTS)))), WAIT)
        for outs, exp in zip(streams, expected):
            assert "".join(o.outputs[0].text for o in outs) == exp.outputs[0].text
            assert outs[-1].outputs[0].finish_reason == exp.outputs[0].finish_reason
            assert outs[-1].outputs[0].stop_reason == exp.outputs[0].stop_reason
        assert expected[0].outputs[0].stop_reason == stop
        assert threads and "tandem-engine" not in threads
        for _ in range(200):  # the stop reached the core: every block is free again
            stats = engine.get_stats()
            if stats["num_requests_unfinished"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]:
                break
            await asyncio.sleep(0.05)
        assert stats["num_requests_unfinished"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    finally:
        await asyncio.wait_for(engine.shutdown(), WAIT)


def test_a_leaked_block_is_an_error_not_a_silent_reset(bart_dir):
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu")
    engine = llm.engine
    bm = engine.block_manager
    bm.pools[Device.DEVICE].allocate(1)  # a block no request holds
    total = bm.num_total_blocks()
    with pytest.raises(RuntimeError, match="KV block accounting is broken"):
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert bm.num_free_blocks() == total - 1  # nothing was reset behind the caller's back
