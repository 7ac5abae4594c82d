"""The seams transcription runs through: ``LLM.session()`` (the public request API that
``transcribe`` drives), the model-class interface frontends ask, and one generation
config for ``generate(audio)`` and ``transcribe``."""

import json
import shutil
import threading

import pytest

from helpers import WHISPER_IDS as I
from helpers import hf_greedy, make_whisper, synth_audio
from tandem import LLM, SamplingParams
from tandem.core.transcription import TranscriptionContext, supports_transcription

PROMPTS = [{"prompt_token_ids": [0, 5 + i, 20 + 2 * i, 40 + i, 2]} for i in range(5)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def llm(bart_dir):
    return LLM(model=str(bart_dir), dtype="float32", device="cpu")


def _all_free(llm) -> bool:
    stats = llm.get_stats()
    return stats["kv_blocks_free"] == stats["kv_blocks_total"] and not llm.engine.has_unfinished_requests()


def test_session_steps_requests_to_hf_s_tokens(llm, bart_dir):
    outs = {}
    with llm.session() as s:
        ids = [s.add_request(p, GREEDY) for p in PROMPTS[:3]]
        assert len(set(ids)) == 3
        with pytest.raises(ValueError, match="vocabulary"):
            s.add_request({"prompt_token_ids": [0, 10**6, 2]}, GREEDY)  # refused: nothing queued
        n = 0
        while s.has_unfinished_requests():
            for out in s.step():
                outs[out.request_id] = out
                if out.finished and n < 2:  # a finished request decides the next, as transcribe does
                    n += 1
                    ids.append(s.add_request(PROMPTS[2 + n], GREEDY))
    assert sorted(outs) == sorted(ids) and len(ids) == 5
    for out in outs.values():
        assert out.finished and out.error is None
        ref = hf_greedy(bart_dir, out.encoder_prompt_token_ids, out.prompt_token_ids, 6)
        assert out.outputs[0].token_ids == ref
    assert _all_free(llm)


def test_session_aborts_its_requests_when_the_block_raises(llm):
    with pytest.raises(KeyError):
        with llm.session() as s:
            s.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
            s.step()
            assert llm.engine.has_unfinished_requests()
            raise KeyError("caller's bug")
    assert _all_free(llm)
    with pytest.raises(RuntimeError, match="session has ended"):
        s.add_request(PROMPTS[0], GREEDY)
    # Leaving early without an error aborts too: the engine is as it was.
    with llm.session() as s:
        s.add_request(PROMPTS[1], GREEDY)
    assert _all_free(llm)
    assert llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].error is None


def test_session_is_exclusive_and_not_reentrant(llm):
    done = threading.Event()

    def other():
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
        done.set()

    with llm.session() as s:
        with pytest.raises(RuntimeError, match=r"LLM.session\(\) inside an LLM.session\(\) block"):
            with llm.session():
                pass
        with pytest.raises(RuntimeError, match=r"generate\(\) inside an LLM.session\(\) block"):
            llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
        t = threading.Thread(target=other)
        t.start()
        s.add_request(PROMPTS[1], GREEDY)
        while s.has_unfinished_requests():
            s.step()
        # generate() on another thread waits for the session: the lock is held until the block ends.
        assert not done.wait(0.5)
    t.join(timeout=120)
    assert done.is_set() and _all_free(llm)


def test_frontends_ask_the_model_class(llm):
    from tandem.model_zoo.whisper import WhisperForConditionalGeneration

    assert supports_transcription(WhisperForConditionalGeneration)
    assert not supports_transcription(llm.engine.model_cls)
    with pytest.raises(ValueError, match="BartForConditionalGeneration takes no audio.*supports it"):
        llm.transcribe(synth_audio(1.0), sampling_rate=16000)
    out = llm.generate({"audio": synth_audio(1.0), "sampling_rate": 16000}, use_tqdm=False)[0]
    assert "takes no audio encoder prompt" in out.error


def _other_generation_config(ckpt, where):
    """The checkpoint's generation config with one language (German) and the task ids swapped."""
    where.mkdir()
    raw = json.loads((ckpt / "generation_config.json").read_text())
    raw.update(lang_to_id={"<|de|>": I["de"]}, task_to_id={"translate": I["transcribe"], "transcribe": I["translate"]})
    (where / "generation_config.json").write_text(json.dumps(raw))
    return where


def test_generate_and_transcribe_share_the_engine_s_generation_config(tmp_path):
    from test_whisper import _hf_greedy

    ckpt = make_whisper(tmp_path / "ckpt", seed=4)
    other = _other_generation_config(ckpt, tmp_path / "gen")
    llm = LLM(model=str(ckpt), dtype="float32", device="cpu", generation_config=str(other))
    ctx = TranscriptionContext.from_engine(llm.engine)
    assert llm.engine.model_cls.transcription_languages(ctx) == ("de",)
    clips = [synth_audio(s, seed=40 + i) for i, s in enumerate((2.0, 6.5, 11.0))]
    res = llm.transcribe(clips, sampling_rate=16000, use_tqdm=False)
    for clip, r in zip(clips, res):
        out = llm.generate({"audio": clip, "sampling_rate": 16000}, use_tqdm=False)[0]
        # generate's default prompt and transcribe's both come from the given config: one language to
        # detect (German), and its task id (the checkpoint's file says otherwise).
        assert out.prompt_token_ids == [I["sot"], I["de"], I["notimestamps"]]
        assert r.error is None and r.language == "de"
        ref = _hf_greedy(ckpt, clip, [I["sot"], I["de"], I["translate"], I["notimestamps"]])
        assert r.token_ids == (ref[:-1] if ref[-1:] == [I["eos"]] else ref)  # a transcript has no </s>
    with pytest.raises(ValueError, match="language='en' is not one of this checkpoint's languages: de"):
        llm.transcribe(clips[0], sampling_rate=16000, language="en")
    # No generation config at all: transcribe says where Whisper's special tokens should come from.
    bare = LLM(model=str(ckpt), dtype="float32", device="cpu", generation_config="none")
    with pytest.raises(ValueError, match="generation_config='none'"):
        bare.transcribe(clips[0], sampling_rate=16000)
    shutil.rmtree(other)
