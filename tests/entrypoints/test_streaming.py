"""Per-step outputs from ``LLMEngine.step()``: cumulative, delta and final-only requests."""

import pytest

from tandem import LLM, SamplingParams
from tandem.core.sampling_params import RequestOutputKind as Kind

PROMPTS = ["the rain in spain falls", "red sun over the sea", {"prompt_token_ids": [0, 7, 8, 9, 2]}]


@pytest.fixture(scope="module")
def llm(bart_dir):
    return LLM(model=str(bart_dir), dtype="float32", device="cpu")


def _stream(llm, kind, **kw):
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, output_kind=kind, logprobs=1, **kw)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"{kind.name}-{i}", p, params)
    seen = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen.setdefault(out.request_id, []).append(out)
    return [seen[f"{kind.name}-{i}"] for i in range(len(PROMPTS))]


def test_each_kind_streams_what_it_promises(llm):
    final = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1),
                         use_tqdm=False)
    for ref, steps in zip(final, _stream(llm, Kind.CUMULATIVE)):
        c = ref.outputs[0]
        assert len(steps) == 10 and [s.finished for s in steps] == [False] * 9 + [True]
        for k, s in enumerate(steps, start=1):
            assert s.outputs[0].token_ids == c.token_ids[:k] and len(s.outputs[0].logprobs) == k
        assert steps[-1].outputs[0].text == c.text and steps[-1].outputs[0].finish_reason == "length"
    for ref, steps in zip(final, _stream(llm, Kind.DELTA)):
        c = ref.outputs[0]
        assert all(len(s.outputs[0].token_ids) == 1 for s in steps)
        assert [t for s in steps for t in s.outputs[0].token_ids] == c.token_ids
        assert "".join(s.outputs[0].text for s in steps) == c.text
        assert [lp for s in steps for lp in s.outputs[0].logprobs] == c.logprobs
    for ref, steps in zip(final, _stream(llm, Kind.FINAL_ONLY)):
        assert len(steps) == 1 and steps[0].finished and steps[0].outputs[0].token_ids == ref.outputs[0].token_ids


def test_stop_strings_are_found_across_token_boundaries_while_streaming(llm):
    full = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    text = full[0].outputs[0].text
    words = text.split()
    assert len(words) >= 4
    # A stop string spanning two tokens: the end of one word, the space, the start of the next.
    stop = words[1][-1] + " " + words[2][:1]
    cut = text.index(stop)
    steps = _stream(llm, Kind.DELTA, stop=[stop])[0]
    assert "".join(s.outputs[0].text for s in steps) == text[:cut]
    last = steps[-1].outputs[0]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert llm.engine.block_manager.num_free_blocks() == llm.engine.block_manager.num_total_blocks()


def test_generate_returns_final_outputs_whatever_kind_is_asked(llm):
    for kind in Kind:
        out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_kind=kind),
                           use_tqdm=False)[0]
        assert out.finished and len(out.outputs[0].token_ids) == 6


def test_stream_interval_outputs_every_nth_token_and_the_same_stream(bart_dir, llm):
    """``stream_interval=3``: an output for the first token, every 3 more and the last
    (tokens 1, 4, 7, 10 of 10); DELTA outputs join to the every-step stream's text,
    tokens and logprobs, CUMULATIVE ones end the same, FINAL_ONLY is unchanged."""
    fewer = LLM(model=str(bart_dir), dtype="float32", device="cpu", stream_interval=3)
    for ref, steps in zip(_stream(llm, Kind.DELTA), _stream(fewer, Kind.DELTA)):
        assert [len(s.outputs[0].token_ids) for s in steps] == [1, 3, 3, 3]
        assert [s.finished for s in steps] == [False] * 3 + [True]
        assert "".join(s.outputs[0].text for s in steps) == "".join(s.outputs[0].text for s in ref)
        for field in ("token_ids", "logprobs"):
            assert sum((getattr(s.outputs[0], field) for s in steps), []) == sum(
                (getattr(s.outputs[0], field) for s in ref), [])
    for ref, steps in zip(_stream(llm, Kind.CUMULATIVE), _stream(fewer, Kind.CUMULATIVE)):
        assert [len(s.outputs[0].token_ids) for s in steps] == [1, 4, 7, 10]
        assert steps[-1].outputs[0] == ref[-1].outputs[0]
    for ref, steps in zip(_stream(llm, Kind.FINAL_ONLY), _stream(fewer, Kind.FINAL_ONLY)):
        assert len(steps) == 1 and steps[0].outputs[0] == ref[0].outputs[0]
