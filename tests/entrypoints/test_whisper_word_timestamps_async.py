"""Word timestamps through ``AsyncLLM`` and the server: the alignment recompute runs
on the engine thread between steps (``AsyncLLM.call_model``), and the words
and token timestamps equal ``LLM.transcribe``'s (themselves equal to HF's:
``test_whisper_word_timestamps.py``); requests with and without word timestamps
run together; a recompute that fails fails its own request only.

The demo checkpoint (a real Whisper tokenizer, trained on tone speech, so the
words are real words) with ``alignment_heads`` added. Every wait is bounded."""

import asyncio
import io
import json
import shutil
import threading

import numpy as np
import pytest

from tandem import LLM, AsyncLLM

WAIT = 120.0  # seconds: a bound on every await, so a bug fails instead of hanging
HEADS = [[1, 0], [1, 1], [0, 2]]  # of the demo's 2-layer, 4-head decoder
SR = 16000


def _clips():
    from tandem.demo_whisper import synthesize

    gap = np.zeros(SR * 10, np.float32)  # a long-form input: phrases apart, over two windows
    long = np.concatenate([synthesize("one two three", seed=3), gap, synthesize("hello world yes", seed=4), gap,
                           synthesize("stop go up down", seed=5), gap, synthesize("four five", seed=6)])
    assert len(long) > 32 * SR
    return {"short": synthesize("three one four hello world", seed=1), "other": synthesize("yes no stop go", seed=2),
            "long": long.astype(np.float32)}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tandem.demo_whisper import PATH

    path = tmp_path_factory.mktemp("whisper_wts_async") / "demo"
    shutil.copytree(PATH, path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["alignment_heads"] = HEADS
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


@pytest.fixture(scope="module")
def clips():
    return _clips()


@pytest.fixture(scope="module")
def reference(ckpt, clips):
    """``LLM.transcribe``'s results, with and without word timestamps."""
    llm = LLM(model=str(ckpt), dtype="float32", device="cpu")
    items = [{"audio": clips[k], "sampling_rate": SR} for k in clips]
    out = {}
    for words in (True, False):
        for k, r in zip(clips, llm.transcribe(items, language="en", timestamps=True, word_timestamps=words,
                                              use_tqdm=False)):
            assert r.error is None
            out[k, words] = r
    assert all(out[k, True].words for k in clips)  # words found on every clip
    del llm
    return out


@pytest.fixture(scope="module")
def engine(ckpt):
    e = AsyncLLM(model=str(ckpt), dtype="float32", device="cpu")
    yield e
    asyncio.run(e.shutdown(timeout=WAIT))


async def _transcribe(engine, clip, rid, **options):
    from tandem.entrypoints.transcribe import transcribe_async

    waveform = engine.engine.model_cls.load_transcription_audio(clip, SR)
    last = None
    async for item in transcribe_async(engine, waveform, rid, language="en", timestamps=True, **options):
        last = item
    return last


def _same(ours, ref):
    assert ours.text == ref.text and ours.token_ids == ref.token_ids and ours.windows == ref.windows
    assert ours.words == ref.words
    assert ours.segments == ref.segments  # token_timestamps and words per segment included


@pytest.mark.asyncio
async def test_model_calls_run_on_the_engine_thread_and_fail_alone(engine, monkeypatch):
    import torch

    from tandem.core.model_call import ModelCallError

    threads = []
    run = engine.engine.executor.collective_rpc

    def spy(method, args=()):
        if method == "call_model":
            threads.append(threading.current_thread().name)
        return run(method, args)

    monkeypatch.setattr(engine.engine.executor, "collective_rpc", spy)
    prompt = [384, 385, 387]  # sot, en, transcribe
    audio = torch.zeros(480000)  # one padded 30 s window
    logits = await asyncio.wait_for(asyncio.wrap_future(engine.call_model("next_token_logits", audio, prompt)), WAIT)
    # Through the executor, on the engine thread: the model's own answer, one row of logits.
    assert threads == ["tandem-engine"]
    assert tuple(logits.shape) == (engine.engine.vocab_size,)
    with pytest.raises(ModelCallError, match=r"model call 'next_token_logits' failed: "):
        await asyncio.wait_for(asyncio.wrap_future(engine.call_model("next_token_logits", audio, [10**9])), WAIT)
    with pytest.raises(ValueError, match=r"model call 'forward': WhisperForConditionalGeneration declares "
                                         r"'alignment_attention', 'next_token_logits'"):
        engine.engine.call_model("forward")
    assert engine.health().status == "ok"


@pytest.mark.asyncio
async def test_queued_model_calls_take_turns_with_steps(engine, clips, monkeypatch):
    """Calls queued together run one per pass of the engine loop: while a request is
    decoding, a step runs between any two of them (the loop is held one call at a time)."""
    from tandem import RequestOutputKind, SamplingParams

    log = []
    step = engine.engine.core.step

    def logged_step():
        log.append("step")
        return step()

    def logged_call(method, tag):
        log.append(tag)

    monkeypatch.setattr(engine.engine.core, "step", logged_step)
    monkeypatch.setattr(engine.engine, "call_model", logged_call)
    prompt = {"encoder_prompt": {"audio": clips["short"], "sampling_rate": SR},
              "decoder_prompt": {"prompt_token_ids": [384, 385, 387, 391]}}  # sot, en, transcribe, notimestamps
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    outs, calls = [], []
    async for out in engine.generate(prompt, params, "turns"):
        outs.append(out)
        if len(outs) == 2:  # decoding: queue three calls at once
            calls = [engine.call_model("next_token_logits", f"call{i}") for i in range(3)]
    await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(c) for c in calls)), WAIT)
    assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 40
    at = [log.index(f"call{i}") for i in range(3)]
    assert at == sorted(at) and all(b - a >= 2 for a, b in zip(at, at[1:])), log  # a step between each


@pytest.mark.asyncio
async def test_async_words_equal_llm_transcribe_with_plain_requests_alongside(engine, clips, reference):
    """Word-timestamp and plain requests at once (short and long-form): every one
    served, each equal to ``LLM.transcribe`` with the same options."""
    jobs = [(k, words) for k in clips for words in (True, False)]
    results = await asyncio.wait_for(asyncio.gather(
        *(_transcribe(engine, clips[k], f"{k}-{words}", word_timestamps=words) for k, words in jobs)), WAIT)
    for (k, words), r in zip(jobs, results):
        _same(r, reference[k, words])
    assert results[jobs.index(("long", True))].windows >= 2


@pytest.mark.asyncio
async def test_a_failing_recompute_fails_its_request_only(engine, clips, reference, monkeypatch):
    """A head index out of range (past the config check) makes the recompute raise on
    the engine thread: that request gets the error, the others their transcripts."""
    import tandem.model_zoo.whisper.transcription as wt

    real, calls = wt.alignment_heads, []

    def first_one_bad(gen, cfg):
        calls.append(1)
        return [(0, 9)] if len(calls) == 1 else real(gen, cfg)  # the decoder has 4 heads

    monkeypatch.setattr(wt, "alignment_heads", first_one_bad)
    # gather starts its tasks in order: the first builds its session (bad heads) first.
    results = await asyncio.wait_for(asyncio.gather(
        _transcribe(engine, clips["short"], "bad", word_timestamps=True),
        _transcribe(engine, clips["other"], "good-words", word_timestamps=True),
        _transcribe(engine, clips["long"], "good-plain"),
        return_exceptions=True), WAIT)
    assert isinstance(results[0], ValueError) and "IndexError" in str(results[0])
    _same(results[1], reference["other", True])
    _same(results[2], reference["long", False])
    assert engine.health().status == "ok"


def _wav(clip) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, clip, SR, format="WAV", subtype="FLOAT")  # float: the samples arrive unchanged
    return buf.getvalue()


@pytest.mark.asyncio
async def test_server_returns_openai_words(engine, clips, reference):
    import httpx

    from tandem.entrypoints.openai.api_server import build_app

    app = build_app(engine, served_model_name="m")

    async def post(client, clip, **data):
        return await client.post("/v1/audio/transcriptions", files={"file": ("a.wav", _wav(clip), "audio/wav")},
                                 data={"language": "en", **data})

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=WAIT) as c:
        words, both, plain = await asyncio.wait_for(asyncio.gather(
            post(c, clips["long"], response_format="verbose_json", **{"timestamp_granularities[]": "word"}),
            post(c, clips["short"], response_format="verbose_json",
                 **{"timestamp_granularities[]": ["word", "segment"]}),
            post(c, clips["other"], response_format="verbose_json")), WAIT)
        for r in (words, both, plain):
            assert r.status_code == 200, r.text
        ref = reference["long", True]
        assert words.json()["words"] == ref.words and words.json()["text"] == ref.text
        assert "segments" not in words.json()  # OpenAI: only the granularities asked for
        body, ref = both.json(), reference["short", True]
        assert body["words"] == ref.words
        assert [s["tokens"] for s in body["segments"]] == [s["token_ids"] for s in ref.segments]
        assert "words" not in plain.json()
        assert plain.json()["segments"][0]["tokens"] == reference["other", False].segments[0]["token_ids"]
        for fields in ({"response_format": "json"}, {"response_format": "verbose_json", "stream": "true"}):
            bad = await post(c, clips["short"], **{"timestamp_granularities[]": "word"}, **fields)
            assert bad.status_code == 400 and "verbose_json" in bad.json()["error"]["message"]
        bad = await post(c, clips["short"], response_format="verbose_json", **{"timestamp_granularities[]": "char"})
        assert bad.status_code == 400 and "'char'" in bad.json()["error"]["message"]
