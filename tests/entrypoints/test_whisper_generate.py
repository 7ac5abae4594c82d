"""Whisper through ``generate()`` as HF's ``WhisperForConditionalGeneration.generate``: the
default decoder prompt HF builds from the generation config (task token included where the
config asks for one), and output text decoded as HF's tokenizer decodes it (timestamp
tokens left out of the text, kept in ``token_ids``)."""

import copy

import pytest
import torch

from helpers import WHISPER_IDS as I
from helpers import make_whisper, synth_audio
from tandem import LLM, SamplingParams
from tandem.demo_whisper import PATH as DEMO, synthesize


def _features(hf, clip):
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(feature_size=hf.config.num_mel_bins)
    return extractor(clip, sampling_rate=16000, return_tensors="pt").input_features


def _hf_prompt_and_tokens(hf, clip):
    """HF's own default prompt (its ``_retrieve_init_tokens``, what ``generate`` starts
    from) and the tokens its ``generate`` returns after it, without the final EOS."""
    features = _features(hf, clip)
    gen = copy.deepcopy(hf.generation_config)
    gen.return_timestamps = False  # what generate() sets before building the prompt, for short audio
    with torch.no_grad():
        init = hf._retrieve_init_tokens(features, batch_size=1, generation_config=gen, config=hf.config,
                                        num_segment_frames=3000, kwargs={})[0].tolist()
        out = hf.generate(features)[0].tolist()
    if out[: len(init)] == init:  # transformers 4 returns the decoder prompt too
        out = out[len(init):]
    return init, [t for t in out if t != gen.eos_token_id]


# Generation configs as checkpoints ship them: openai's force <|transcribe|> after the
# detected language; newer ones name the language and/or task.
CONFIGS = {
    "forced-task": dict(forced_decoder_ids=[[1, None], [2, I["transcribe"]]]),
    "forced-language": dict(forced_decoder_ids=[[1, I["de"]], [2, I["translate"]], [3, I["notimestamps"]]]),
    "language": dict(language="fr"),
    "task": dict(task="translate"),
    "none": dict(),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from transformers import GenerationConfig

    out = {}
    for name, fields in CONFIGS.items():
        path = make_whisper(tmp_path_factory.mktemp(f"whisper_{name}") / "ckpt", seed=5)
        gen = GenerationConfig.from_pretrained(path)
        for key, value in fields.items():  # (GenerationConfig.update skips fields it does not have)
            setattr(gen, key, value)
        gen.save_pretrained(path)
        out[name] = path
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_default_prompt_is_hf_generates(checkpoints, name):
    from transformers import WhisperForConditionalGeneration

    path = checkpoints[name]
    hf = WhisperForConditionalGeneration.from_pretrained(path).eval()
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    clip = synth_audio(6.0, seed=31)
    init, ref = _hf_prompt_and_tokens(hf, clip)
    out = llm.generate({"audio": clip, "sampling_rate": 16000}, SamplingParams(temperature=0.0), use_tqdm=False)[0]
    assert out.error is None
    assert out.prompt_token_ids == init
    # What each config asks for is in the prompt (the oracle itself is checked).
    assert {"forced-task": init[2] == I["transcribe"], "forced-language": init[1:3] == [I["de"], I["translate"]],
            "language": init[1:3] == [I["fr"], I["transcribe"]], "task": init[2] == I["translate"],
            "none": len(init) == 3}[name], init
    assert [t for t in out.outputs[0].token_ids if t != I["eos"]] == ref


def test_a_bad_forced_decoder_ids_is_named():
    from transformers import GenerationConfig

    from tandem.model_zoo.whisper.prompts import WhisperPrompts

    gen = GenerationConfig(decoder_start_token_id=I["sot"], eos_token_id=I["eos"], lang_to_id={"<|en|>": I["en"]},
                           task_to_id={"transcribe": I["transcribe"]}, no_timestamps_token_id=I["notimestamps"],
                           is_multilingual=True, forced_decoder_ids=[[1, None], [3, I["transcribe"]]])
    with pytest.raises(ValueError, match=rf"forced_decoder_ids=\[\[1, None\], \[3, {I['transcribe']}\]\].*positions must run 1, 2"):
        WhisperPrompts.from_generation_config(gen, None).default_prompt(gen, None)


@pytest.fixture(scope="module")
def demo():
    from transformers import AutoTokenizer, WhisperForConditionalGeneration

    return (LLM(model=str(DEMO), dtype="float32", device="cpu"), AutoTokenizer.from_pretrained(DEMO),
            WhisperForConditionalGeneration.from_pretrained(DEMO).eval())


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_timestamp_tokens_stay_in_token_ids_and_out_of_the_text(demo, skip_special_tokens):
    from transformers.generation.utils import GenerationMixin

    llm, tok, hf = demo
    clip = synthesize("three one four", seed=0)
    gen = hf.generation_config
    # A timestamped transcript begun (its first timestamp, the first word's onset, given): the demo
    # model ends the segment with a timestamp, as HF's generate shows.
    prompt = [gen.decoder_start_token_id, gen.lang_to_id["<|en|>"], gen.task_to_id["transcribe"],
              tok.convert_tokens_to_ids("<|0.14|>")]
    params = SamplingParams(temperature=0.0, skip_special_tokens=skip_special_tokens)
    outs = llm.generate({"encoder_prompt": {"audio": clip, "sampling_rate": 16000},
                         "decoder_prompt": {"prompt_token_ids": prompt}}, params, use_tqdm=False)
    ids = outs[0].outputs[0].token_ids
    with torch.no_grad():  # HF's greedy search from that prompt, with the checkpoint's suppress settings
        ref = GenerationMixin.generate(hf, input_features=_features(hf, clip), decoder_input_ids=torch.tensor([prompt]),
                                       do_sample=False, num_beams=1)[0, len(prompt):].tolist()
    assert ids == ref
    assert any(t > gen.no_timestamps_token_id for t in ids), ids  # a timestamp token is there to leave out
    expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "<|0." not in expected and "three one four" in expected  # the oracle drops it too
    assert outs[0].outputs[0].text == expected


def test_the_demos_default_prompt_asks_for_the_transcript(demo):
    """The demo ships openai's forced_decoder_ids: generate() gives its transcript as
    transcribe() does, with HF's prompt."""
    llm, tok, hf = demo
    clip = synthesize("three one four", seed=0)
    init, ref = _hf_prompt_and_tokens(hf, clip)
    out = llm.generate({"audio": clip, "sampling_rate": 16000}, use_tqdm=False)[0]
    assert out.prompt_token_ids == init == [384, 385, 387, 391]  # <|startoftranscript|><|en|><|transcribe|>...
    assert [t for t in out.outputs[0].token_ids if t != hf.generation_config.eos_token_id] == ref
    assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True) == " three one four"
