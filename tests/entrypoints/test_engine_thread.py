"""Nothing heavy on ``AsyncLLM``'s engine thread (issue 37): a request's prompt is
tokenized (its audio decoded, its values checked) on the input threads, and the
engine thread only queues the result; a text prompt far longer than the model
takes is refused from a bounded prefix, never tokenized whole (offline too, as
that request's ``error``); and client requests take turns for admission, so a
request of many prompts does not hold a later one behind all of them.

Where the work ran is read from instrumentation (the thread each tokenizer call
ran on, the order requests reached the scheduler), never from timings. Every wait
is bounded."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest

from tandem import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from tandem.entrypoints.openai.api_server import build_app

WAIT = 60.0  # seconds: a bound on every wait, so a bug fails instead of hanging
# 3.6 MB of ordinary words: 720,000 tokens for a model of 128 positions (under the
# server's 4 MiB body limit, as the probe's 3.4 MB prompt was).
BIG = "the rain in spain falls mainly on plain " * 90_000


class _TokenizerSpy:
    """The engine's tokenizer, recording the thread and the length of every text it encodes."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer, self.calls = tokenizer, []

    def __call__(self, text, *args, **kwargs):
        self.calls.append((threading.current_thread().name, len(text)))
        return self._tokenizer(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def _spy(engine) -> _TokenizerSpy:
    """Spy on the tokenizer that turns prompts into token ids (not the detokenizer)."""
    spy = _TokenizerSpy(engine.input_processor.tokenizer)
    engine.input_processor.tokenizer = spy
    return spy


async def _until(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_a_huge_prompt_is_refused_off_the_engine_thread_while_a_stream_runs(bart_dir, monkeypatch):
    engine = AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu")
    spy = _spy(engine.engine)
    step = engine.engine.core.step

    def slow_step():  # the stream is still generating when the big prompt arrives, however fast the machine
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(engine.engine.core, "step", slow_step)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    try:
        stream = engine.generate("the rain in spain", params, "running")
        outs = [await asyncio.wait_for(stream.__anext__(), WAIT)]
        with pytest.raises(ValueError) as info:
            await asyncio.wait_for(engine.generate(BIG, SamplingParams(max_tokens=5), "big").__anext__(), WAIT)
        message = str(info.value)
        assert f"{len(BIG)} characters" in message and "the model accepts at most 128" in message, message

        async def rest():
            return [o async for o in stream]

        outs += await asyncio.wait_for(rest(), WAIT)
    finally:
        await asyncio.wait_for(engine.shutdown(), WAIT)
    assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 40  # the stream went on
    ref = LLM(model=str(bart_dir), dtype="float32", device="cpu").generate(
        "the rain in spain", SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert [t for o in outs for t in o.outputs[0].token_ids] == ref[0].outputs[0].token_ids
    threads = {name for name, _ in spy.calls}
    assert threads and "tandem-engine" not in threads, spy.calls  # no prompt was tokenized on the engine thread
    assert all(n < len(BIG) // 100 for _, n in spy.calls), spy.calls  # and the big one never whole


def test_offline_long_text_is_refused_from_a_prefix_and_other_prompts_are_unchanged(bart_dir):
    from transformers import AutoTokenizer

    oracle = AutoTokenizer.from_pretrained(str(bart_dir))
    llm = LLM(model=str(bart_dir), dtype="float32", device="cpu")
    spy = _spy(llm.engine)
    # An unknown word is one <unk>: prompts of few tokens and thousands of characters,
    # longer than the prefix the refusal reads (16 x (128 + 64) characters).
    word = "x" * 40
    normal, fits, over = "the rain in spain falls", " ".join([word] * 126), " ".join([word] * 127)
    assert len(fits) > 16 * (128 + 64)
    prompts = [normal, fits, over, BIG, {"encoder_prompt": normal, "decoder_prompt": BIG}]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert outs[0].error is None and outs[0].encoder_prompt_token_ids == oracle(normal)["input_ids"]
    # 126 words + <s> + </s>: exactly the 128 positions, served although over the prefix's length.
    assert outs[1].error is None, outs[1].error
    assert outs[1].encoder_prompt_token_ids == oracle(fits)["input_ids"] and len(outs[1].encoder_prompt_token_ids) == 128
    assert outs[2].error == "encoder prompt has 129 tokens; the model accepts at most 128"  # counted whole
    assert outs[3].error.startswith(f"encoder prompt has more than 128 tokens: {len(BIG)} characters, of which the "
                                    "first "), outs[3].error
    assert outs[3].error.endswith("; the model accepts at most 128")
    assert outs[4].error.startswith(f"decoder prompt has more than 128 tokens: {len(BIG)} characters"), outs[4].error
    assert outs[4].error.endswith("the model has 128 decoder positions")
    assert all(n < len(BIG) // 100 for _, n in spy.calls), spy.calls  # BIG was never tokenized whole


def _hold_engine_thread(engine: AsyncLLM) -> threading.Event:
    """Park the engine thread between two steps until the returned event is set."""
    gate, inside = threading.Event(), threading.Event()

    def hold(method, *args):
        inside.set()
        gate.wait(WAIT)

    engine.engine.call_model = hold  # what the engine thread runs for a model call
    engine.call_model("hold")
    assert inside.wait(WAIT), "the engine thread never ran the call"
    return gate


@pytest.mark.asyncio
async def test_a_later_request_is_admitted_before_an_earlier_requests_backlog(bart_dir):
    # One sequence runs at a time, so admission order is the order requests are served in.
    engine = AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu", max_num_seqs=1)
    admitted = []  # encoder prompts, in the order they reached the scheduler
    add = engine.engine.core.add

    def record(group):
        admitted.append(list(group.encoder_inputs.token_ids))
        return add(group)

    engine.engine.core.add = record
    app = build_app(engine, served_model_name="m")
    many, one = [0, 17, 5, 9, 2], [0, 9, 9, 9, 2]
    body = {"max_tokens": 2, "temperature": 0}
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=WAIT) as c:
            gate = _hold_engine_thread(engine)
            try:
                first = asyncio.create_task(
                    c.post("/v1/completions", json={**body, "prompt": [{"prompt_token_ids": many}] * 20}))
                # All 20 are at the engine thread's door before the later request is sent.
                await _until(lambda: engine._commands.qsize() >= 20, "the first request's 20 prompts")
                later = asyncio.create_task(c.post("/v1/completions", json={**body, "prompt": {"prompt_token_ids": one}}))
                await _until(lambda: engine._commands.qsize() >= 21, "the later request")
            finally:
                gate.set()
            r_first, r_later = await asyncio.wait_for(asyncio.gather(first, later), WAIT)
    finally:
        await asyncio.wait_for(engine.shutdown(), WAIT)
    assert r_first.status_code == 200 and len(r_first.json()["choices"]) == 20, r_first.text[:300]
    assert r_later.status_code == 200, r_later.text[:300]
    assert len(admitted) == 21 and admitted.count(many) == 20
    # The first request had the first turn; the later one the next, before the other 19.
    assert admitted.index(one) == 1, [("one" if a == one else "many") for a in admitted]


@pytest.mark.asyncio
async def test_a_request_aborted_before_it_reaches_the_scheduler_ends_aborted(bart_dir):
    engine = AsyncLLM(model=str(bart_dir), dtype="float32", device="cpu", max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=3)
    prompt = {"prompt_token_ids": [0, 17, 5, 9, 2]}

    async def collect(rid):
        return [o async for o in engine.generate(prompt, params, rid)]

    try:
        gate = _hold_engine_thread(engine)
        try:
            tasks = [asyncio.create_task(collect(f"r{i}")) for i in range(3)]
            await _until(lambda: engine._commands.qsize() >= 3, "the three requests")
            await engine.abort("r2")  # queued behind them: the engine thread takes it as held
        finally:
            gate.set()
        results = await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
        deadline = time.monotonic() + WAIT
        while engine.get_stats()["num_requests_unfinished"]:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        stats = engine.get_stats()
    finally:
        await asyncio.wait_for(engine.shutdown(), WAIT)
    assert [r[-1].outputs[0].finish_reason for r in results] == ["length", "length", "abort"]
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_round_robin_gives_each_group_a_turn_in_order_of_arrival():
    from tandem.entrypoints.input_pool import RoundRobin

    rr = RoundRobin()
    for i in range(4):
        rr.push("many", f"m{i}")
    rr.push("one", "o0")
    order = [rr.pop(), rr.pop()]
    rr.push("late", "l0")  # a new group waits for the groups already waiting, not for their backlogs
    rr.push("one", "o1")
    while len(rr):
        order.append(rr.pop())
    assert order == ["m0", "o0", "m1", "l0", "o1", "m2", "m3"]
    with pytest.raises(IndexError):
        rr.pop()


@pytest.mark.asyncio
async def test_a_request_waiting_for_its_grammar_does_not_hold_plain_requests_back(tmp_path):
    """With one sequence at a time, a structured request whose grammar is still compiling
    must not take the only place in the scheduler's queue: a plain request sent after it
    is served while the compile is held, and the structured one is served once it ends."""
    pytest.importorskip("xgrammar")
    from helpers import make_bart_bytes
    from tandem import StructuredOutputsParams

    engine = AsyncLLM(model=str(make_bart_bytes(tmp_path / "ckpt", seed=0)), dtype="float32", device="cpu",
                      max_num_seqs=1)
    manager = engine.engine.structured
    backend = manager.backend
    release, compiling = threading.Event(), threading.Event()
    real_compile = backend.compile

    def held_compile(so):
        compiling.set()
        release.wait(WAIT)
        return real_compile(so)

    backend.compile = held_compile
    params = SamplingParams(temperature=0.0, max_tokens=4)
    so_params = SamplingParams(temperature=0.0, max_tokens=4,
                               structured_outputs=StructuredOutputsParams(regex="[0-9]{1,4}"))

    async def last(prompt, p):
        out = None
        async for out in engine.generate(prompt, p):
            pass
        return out

    try:
        structured = asyncio.create_task(last("a cat sat", so_params))
        await _until(compiling.is_set, "the grammar's compile to start")
        try:
            plain = await asyncio.wait_for(last("the rain in spain", params), WAIT)
            assert not structured.done()  # still waiting for its grammar
        finally:
            release.set()
        held = await asyncio.wait_for(structured, WAIT)
    finally:
        release.set()
        await asyncio.wait_for(engine.shutdown(), WAIT)
    assert plain.error is None and plain.outputs[0].finish_reason == "length"
    assert held.error is None
    assert re.fullmatch("[0-9]{1,4}", held.outputs[0].text), held.outputs[0].text
