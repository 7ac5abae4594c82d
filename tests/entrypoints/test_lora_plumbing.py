"""``lora_request`` from the frontends to the worker: ``LLM.generate`` / ``transcribe`` /
``AsyncLLM.generate`` carry it on the request, the scheduler puts it on each
``ScheduledGroup`` the worker receives, and an engine without ``enable_lora`` refuses
it per request (as vLLM does). The adapter math is the worker's (tests/lora/...)."""

from __future__ import annotations

import asyncio

import pytest

from lora_adapters import make_peft_adapter
from tandem import LLM, AsyncLLM, LoRARequest, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def adapters(bart_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return [LoRARequest(f"a{i}", i, str(make_peft_adapter(bart_dir, root / f"a{i}", seed=i))) for i in (1, 2)]


def spy_on_steps(llm) -> list:
    """Every ScheduledGroup the worker is handed, in order."""
    seen = []
    executor = getattr(llm, "llm_engine", llm).executor
    real = executor.execute_model

    def execute_model(out, *args, **kwargs):
        seen.extend(out.scheduled)
        return real(out, *args, **kwargs)

    executor.execute_model = execute_model
    return seen


def test_adapter_refused_per_prompt_without_enable_lora(bart_dir, adapters):
    llm = LLM(str(bart_dir), dtype="float32", num_kv_blocks=64)
    outs = llm.generate(["hello", "hello"], PARAMS, lora_request=[adapters[0], None], use_tqdm=False)
    assert outs[0].error is not None and "'a1'" in outs[0].error and "enable_lora" in outs[0].error
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 4
    assert not llm.llm_engine.has_unfinished_requests()


def test_scheduled_groups_carry_each_requests_adapter(bart_dir, adapters):
    llm = LLM(str(bart_dir), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2)
    seen = spy_on_steps(llm)
    loras = [adapters[0], None, adapters[1], adapters[0]]
    outs = llm.generate(["one", "two", "three", "four"], PARAMS, lora_request=loras, use_tqdm=False)
    assert [o.error for o in outs] == [None] * 4
    by_request = {}
    for sg in seen:
        by_request.setdefault(sg.request_id, set()).add(sg.lora_request)
    assert [by_request[o.request_id] for o in outs] == [{r} for r in loras]


def test_one_adapter_for_every_prompt_and_beam_search(bart_dir, adapters):
    llm = LLM(str(bart_dir), dtype="float32", num_kv_blocks=64, enable_lora=True)
    seen = spy_on_steps(llm)
    llm.generate(["one", "two"], PARAMS, lora_request=adapters[1], use_tqdm=False)
    from tandem.core.sampling_params import BeamSearchParams

    llm.beam_search(["three"], BeamSearchParams(beam_width=2, max_tokens=3), use_tqdm=False,
                    lora_request=adapters[1])
    assert seen and {sg.lora_request for sg in seen} == {adapters[1]}


@pytest.mark.parametrize("value, error, words", [
    ("a1", TypeError, "lora_request must be a LoRARequest"),
    ([None, "a1"], TypeError, "lora_request[1]"),
    ([None], ValueError, "got 1 LoRA requests for 2 prompts"),
])
def test_bad_lora_argument_refused_for_the_call(bart_dir, value, error, words):
    llm = LLM(str(bart_dir), dtype="float32", num_kv_blocks=64, enable_lora=True)
    with pytest.raises(error) as e:
        llm.generate(["a", "b"], PARAMS, lora_request=value, use_tqdm=False)
    assert words in str(e.value)


def test_async_generate_carries_and_refuses(bart_dir, adapters):
    async def run(engine, lora):
        last = None
        async for out in engine.generate("hello", PARAMS, lora_request=lora):
            last = out
        return last

    async def main():
        off = AsyncLLM(str(bart_dir), dtype="float32", num_kv_blocks=64)
        try:
            with pytest.raises(ValueError, match="enable_lora"):
                await run(off, adapters[0])
            assert (await run(off, None)).error is None  # the engine serves on
        finally:
            await off.shutdown()
        on = AsyncLLM(str(bart_dir), dtype="float32", num_kv_blocks=64, enable_lora=True)
        try:
            seen = spy_on_steps(on.engine)
            assert (await run(on, adapters[1])).error is None
            assert {sg.lora_request for sg in seen} == {adapters[1]}
        finally:
            await on.shutdown()

    asyncio.run(main())


def test_draft_model_speculation_refuses_adapters(bart_dir, adapters):
    llm = LLM(str(bart_dir), dtype="float32", num_kv_blocks=64, enable_lora=True,
              speculative_config={"model": str(bart_dir), "num_speculative_tokens": 2})
    outs = llm.generate(["x", "x"], PARAMS, lora_request=[adapters[0], None], use_tqdm=False)
    assert "draft model" in outs[0].error and "'a1'" in outs[0].error
    assert outs[1].error is None


def test_equal_prompts_share_the_encoder_only_within_an_adapter(bart_dir, adapters):
    llm = LLM(str(bart_dir), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2)
    prompt = {"prompt_token_ids": [0, 11, 12, 13, 14, 15, 2]}
    outs = llm.generate([prompt] * 4, PARAMS, lora_request=[adapters[0], adapters[0], adapters[1], None],
                        use_tqdm=False)
    assert [o.error for o in outs] == [None] * 4
    stats = llm.get_stats()
    # One share (the second a1 request); a2 and the base ran their own encoder.
    assert (stats["encoder_tokens_computed"], stats["encoder_tokens_reused"]) == (3 * 7, 7)


def test_n_and_structured_output_with_an_adapter(tmp_path, adapters):
    pytest.importorskip("xgrammar")
    from helpers import make_bart_bytes
    from tandem.core.structured_params import StructuredOutputsParams

    model = make_bart_bytes(tmp_path / "bytes", seed=0)
    adapter = LoRARequest("bytes", 3, str(make_peft_adapter(model, tmp_path / "adapter", seed=3)))
    llm = LLM(str(model), dtype="float32", num_kv_blocks=128, enable_lora=True)
    seen = spy_on_steps(llm)
    choice = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"]))
    many = SamplingParams(temperature=1.0, seed=1, max_tokens=4, n=3)
    outs = llm.generate(["is it?", "go"], [choice, many], lora_request=adapter, use_tqdm=False)
    assert outs[0].error is None and outs[0].outputs[0].text in ("yes", "no")
    assert outs[1].error is None and len(outs[1].outputs) == 3
    assert {sg.lora_request for sg in seen} == {adapter}
