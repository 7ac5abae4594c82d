"""examples/from_vllm/: vLLM's offline encoder/decoder and Whisper examples, written
against tandem with only the import and the model changed, run here against the demo
checkpoints; each output is checked against tandem's native API for the same input
(and the demo Whisper's transcripts against the texts its audio was made from)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from tandem import LLM, EngineArgs, SamplingParams
from tandem.demo_whisper import PATH as WHISPER, SAMPLE_RATE, synthesize
from tandem.inputs import to_enc_dec_tuple_list, zip_enc_dec_prompts

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "from_vllm"
FULL_PROMPT_IDS = [384, 385, 387, 391]  # <|startoftranscript|><|en|><|transcribe|><|notimestamps|> on the demo
EXPECTED = {s["file"]: s["expected"] for s in json.loads((WHISPER / "demo_samples.json").read_text())}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"from_vllm_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _native_audio(words: str, seed: int) -> dict:
    return {"encoder_prompt": {"audio": synthesize(words, seed=seed), "sampling_rate": SAMPLE_RATE},
            "decoder_prompt": {"prompt_token_ids": FULL_PROMPT_IDS}}


def test_encoder_decoder_example_matches_native_prompts():
    example = _load("encoder_decoder")
    prompts, outputs = example.main()
    llm = LLM(example.MODEL, dtype="float32")
    tok = llm.get_tokenizer()
    ids = tok("a bird sang in the tree")["input_ids"]
    # The same requests in tandem's own shapes, built without the vLLM helpers.
    native = [
        "the cat sat on the mat",
        {"prompt": "the dog ran in the park"},
        {"prompt_token_ids": ids},
        {"encoder_prompt": "the cat sat on the mat", "decoder_prompt": {"prompt_token_ids": ids}},
        {"encoder_prompt": {"prompt": "the dog ran in the park"}, "decoder_prompt": "the cat sat on the mat"},
        {"encoder_prompt": {"prompt_token_ids": ids}, "decoder_prompt": {"prompt": "the dog ran in the park"}},
        {"encoder_prompt": "the sun is hot", "decoder_prompt": "the sun"},
        {"encoder_prompt": "the moon is bright", "decoder_prompt": "the moon"},
    ]
    assert prompts[2] == {"prompt_token_ids": ids}
    assert prompts[6:] == native[6:]
    expected = llm.generate(native, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert [o.error for o in outputs] == [None] * len(native)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in expected]
    assert all(o.outputs[0].token_ids for o in outputs)


def test_whisper_example_transcribes_both_prompt_forms():
    prompts, outputs = _load("whisper").main(copies=1)
    assert [o.error for o in outputs] == [None, None]
    assert [o.outputs[0].text.strip() for o in outputs] == [EXPECTED["three_one_four.wav"], EXPECTED["hello_world.wav"]]
    # vLLM's text prompt of special tokens is the demo's prompt, with no tokenizer prefix added
    assert [o.prompt_token_ids for o in outputs] == [FULL_PROMPT_IDS] * 2
    native = LLM(str(WHISPER)).generate(
        [_native_audio("three one four one five nine", 0), _native_audio("hello world", 1)],
        SamplingParams(temperature=0, max_tokens=40), use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in native]


def test_audio_language_example_matches_native_with_its_seed():
    example = _load("audio_language")
    inputs, outputs = example.main(example.parse_args(["--seed", "7"]))
    assert outputs[0].error is None
    native = LLM(str(WHISPER), seed=7).generate(
        _native_audio("three one four", 0), SamplingParams(temperature=0.2, max_tokens=40), use_tqdm=False
    )
    assert outputs[0].outputs[0].token_ids == native[0].outputs[0].token_ids
    assert outputs[0].outputs[0].text.strip() == "three one four"


@pytest.fixture(scope="module")
def whisper():
    return LLM(str(WHISPER))


def test_start_of_transcript_text_is_one_token(whisper):
    # Before: the tokenizer's prefix was added, [384, 391, 384].
    audio = synthesize("three one four")
    out = whisper.generate({"prompt": "<|startoftranscript|>", "multi_modal_data": {"audio": (audio, SAMPLE_RATE)}},
                           SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert out[0].error is None and out[0].prompt_token_ids == [384]


def test_audio_forms_refused_clearly(whisper):
    audio = (synthesize("three one four"), SAMPLE_RATE)
    bad = [
        {"prompt": "", "multi_modal_data": {"audio": [audio, audio]}},
        {"prompt": "", "multi_modal_data": {"image": audio}},
        {"encoder_prompt": {"prompt": "hi", "multi_modal_data": {"audio": audio}}, "decoder_prompt": None},
        {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": audio}}, "mm_processor_kwargs": {"x": 1}},
    ]
    outs = whisper.generate(bad, SamplingParams(max_tokens=4), use_tqdm=False)
    errors = [o.error for o in outs]
    assert "2 audio items" in errors[0]
    assert "'image'" in errors[1]
    assert "'hi'" in errors[2]
    assert "mm_processor_kwargs" in errors[3]


@pytest.mark.parametrize("kwargs, words", [
    ({"kv_cache_dtype": "fp4"}, "kv_cache_dtype='fp4'"),
    ({"max_model_len": 1000}, "max_model_len=1000 is more than the model's 448"),
    ({"max_model_len": 32}, "max_model_len=32 is less than the model's 448"),
    ({"limit_mm_per_prompt": {"audio": 2}}, "'audio': 2"),
    ({"limit_mm_per_prompt": {"image": 1}}, "'image'"),
])
def test_vllm_keywords_refused_naming_the_value(kwargs, words):
    with pytest.raises(ValueError) as e:
        LLM(str(WHISPER), **kwargs)
    assert words in str(e.value)


def test_vllm_only_keyword_refused_by_name():
    with pytest.raises(TypeError, match="'enable_prompt_embeds'"):
        LLM(str(WHISPER), enable_prompt_embeds=True)


def test_engine_args_round_trip():
    args = EngineArgs(model=str(WHISPER), max_model_len=448, max_num_seqs=3)
    d = dataclasses.asdict(args)
    assert d["max_num_seqs"] == 3 and d["kv_cache_dtype"] == "auto" and d["block_size"] == 16
    assert args.create_engine_config().max_num_seqs == 3
    llm = LLM(**d)
    assert llm.llm_engine.config.max_num_seqs == 3


def test_zip_and_tuple_list_are_inverse():
    pairs = zip_enc_dec_prompts(["a", {"prompt": "b"}], ["c", None])
    assert pairs == [{"encoder_prompt": "a", "decoder_prompt": "c"},
                     {"encoder_prompt": {"prompt": "b"}, "decoder_prompt": None}]
    assert to_enc_dec_tuple_list(pairs) == [("a", "c"), ({"prompt": "b"}, None)]
    # an empty mm_processor_kwargs (vLLM's default) is accepted by the engine; a non-empty one is kept and refused
    assert zip_enc_dec_prompts(["a"], ["b"], {"k": 1})[0]["mm_processor_kwargs"] == {"k": 1}
