"""The shipped demo Whisper (tandem/demo_whisper): it loads as a real checkpoint does,
transcribes its samples to the expected text token for token as HF's generate does,
and ``tandem demo --whisper`` (with ``--say``, ``--path``) runs end to end offline."""

import json
import sys

import pytest
import torch

from tandem import LLM
from tandem.demo_whisper import PATH, WORDS, synthesize
from tandem.entrypoints.cli import DEMO_WHISPER, main

SAMPLES = json.loads((PATH / "demo_samples.json").read_text())


@pytest.fixture(scope="module")
def llm():
    return LLM(model=str(PATH), dtype="float32", device="cpu")


def test_the_checkpoint_has_what_a_real_one_has():
    from transformers import AutoTokenizer, GenerationConfig, WhisperFeatureExtractor

    tok = AutoTokenizer.from_pretrained(PATH)
    gen = GenerationConfig.from_pretrained(PATH)
    assert type(tok).__name__ == "WhisperTokenizer"
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    assert gen.decoder_start_token_id == tok.convert_tokens_to_ids("<|startoftranscript|>") == eot + 1
    assert gen.lang_to_id == {"<|en|>": eot + 2}
    assert gen.task_to_id == {"translate": eot + 3, "transcribe": eot + 4}
    assert gen.no_timestamps_token_id == tok.convert_tokens_to_ids("<|notimestamps|>")
    assert tok.convert_tokens_to_ids("<|0.00|>") == gen.no_timestamps_token_id + 1 == len(tok) - 1501
    assert WhisperFeatureExtractor.from_pretrained(PATH).feature_size == 80
    assert tok.decode(tok(" three one four", add_special_tokens=False)["input_ids"]) == " three one four"
    assert sum(p.stat().st_size for p in PATH.iterdir() if p.is_file()) < 8e6


def test_samples_transcribe_to_their_text_as_hf_generate_does(llm):
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    from tandem.audio import load_audio

    results = llm.transcribe([str(PATH / s["file"]) for s in SAMPLES], use_tqdm=False)
    hf = WhisperForConditionalGeneration.from_pretrained(PATH, dtype=torch.float32).eval()
    extractor = WhisperFeatureExtractor.from_pretrained(PATH)
    for sample, r in zip(SAMPLES, results):
        assert r.error is None and r.language == "en"
        assert r.text == sample["expected"]
        features = extractor(load_audio(PATH / sample["file"]).numpy(), sampling_rate=16000,
                             return_tensors="pt").input_features
        with torch.no_grad():
            ref = hf.generate(features, language="en", task="transcribe")[0].tolist()
        prompt = [hf.generation_config.decoder_start_token_id, hf.generation_config.lang_to_id["<|en|>"],
                  hf.generation_config.task_to_id["transcribe"], hf.generation_config.no_timestamps_token_id]
        if ref[: len(prompt)] == prompt:  # transformers 4 returns the decoder prompt too
            ref = ref[len(prompt):]
        assert r.token_ids == ref


def test_whisper_decoder_length_448_as_vllms_examples_ask(llm):
    """Whisper's real 448 decoder positions (trained on 64; TRAINING.md), so vLLM's
    ``max_model_len=448`` and ``max_tokens=200`` run as written, outputs within the
    trained 64 unchanged; an output may run on to the last position."""
    from safetensors import safe_open
    from transformers import WhisperConfig

    from tandem import SamplingParams

    assert WhisperConfig.from_pretrained(PATH).max_target_positions == 448
    with safe_open(str(PATH / "model.safetensors"), "pt") as f:
        table = f.get_tensor("model.decoder.embed_positions.weight")
    assert table.shape == (448, 64) and torch.equal(table[64:], table[63:64].expand(384, -1))
    vllm_style = LLM(model=str(PATH), dtype="float32", device="cpu", max_model_len=448)
    audio = {"audio": (synthesize("hello world", seed=1), 16000)}
    prompts = [{"prompt": "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>", "multi_modal_data": audio}]
    out = vllm_style.generate(prompts * 2, [SamplingParams(temperature=0, max_tokens=200),
                                            SamplingParams(temperature=0, max_tokens=444, ignore_eos=True)],
                              use_tqdm=False)
    assert [o.error for o in out] == [None, None]
    assert out[0].outputs[0].text.strip() == "hello world" and out[0].outputs[0].finish_reason == "stop"
    assert len(out[1].outputs[0].token_ids) == 444 and out[1].outputs[0].finish_reason == "length"
    assert out[1].outputs[0].token_ids[:3] == out[0].outputs[0].token_ids[:3]


def test_it_goes_on_from_start_of_transcript_alone_as_a_real_whisper(llm):
    """vLLM's Whisper prompt is "<|startoftranscript|>" alone: the model writes the language,
    the task, <|notimestamps|> and the transcript (TRAINING.md, "Continuing from ...")."""
    from tandem import SamplingParams

    prompts = [{"encoder_prompt": {"audio": str(PATH / s["file"])}, "decoder_prompt": {"prompt_token_ids": [384]}}
               for s in SAMPLES]
    prompts.append({"prompt": "<|startoftranscript|>",
                    "multi_modal_data": {"audio": (synthesize("seven eight nine stop go", seed=3), 16000)}})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    assert [o.outputs[0].text.strip() for o in outs] == [s["expected"] for s in SAMPLES] + ["seven eight nine stop go"]
    assert all(o.outputs[0].token_ids[:3] == [385, 387, 391] for o in outs)  # <|en|><|transcribe|><|notimestamps|>


def test_synthesized_words_transcribe(llm):
    words = "seven eight nine stop go"
    r = llm.transcribe({"audio": synthesize(words, seed=3), "sampling_rate": 16000}, use_tqdm=False)[0]
    assert r.text == words
    with pytest.raises(ValueError, match="not in the demo vocabulary: banana"):
        synthesize("one banana")


def test_demo_whisper_command(capsys):
    assert main(["demo", "--whisper", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    for s in SAMPLES:
        assert f"expected: {s['expected']}\n  output:   {s['expected']}\n" in out
    assert f"{len(SAMPLES)}/{len(SAMPLES)} right" in out


def test_demo_whisper_say_and_save(tmp_path, capsys):
    wav = tmp_path / "say.wav"
    assert main(["demo", "--whisper", "--dtype", "float32", "--say", "two zero four", "--save", str(wav)]) == 0
    assert "output:   two zero four" in capsys.readouterr().out
    assert main(["transcribe", str(DEMO_WHISPER), str(wav), "--dtype", "float32", "--no-progress"]) == 0
    assert capsys.readouterr().out == f"{wav}\ttwo zero four\n"
    assert main(["demo", "--whisper", "--say", "two banana"]) == 2
    err = capsys.readouterr().err
    assert "'banana' not in the demo Whisper's vocabulary" in err and " ".join(WORDS) in err


def test_demo_path_prints_checkpoint_directories(capsys):
    assert main(["demo", "--whisper", "--path"]) == 0
    assert capsys.readouterr().out.strip() == str(DEMO_WHISPER) == str(PATH)
    assert main(["demo", "--path"]) == 0
    path = capsys.readouterr().out.strip()
    assert LLM(model=path, dtype="float32").generate("the cat sat", use_tqdm=False)[0].outputs[0].text == "sat cat the"


def test_demo_whisper_without_the_audio_extra_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "soundfile", None)  # import soundfile raises ImportError
    assert main(["demo", "--whisper"]) == 2
    assert "pip install 'tandem-engine[audio]'" in capsys.readouterr().err
