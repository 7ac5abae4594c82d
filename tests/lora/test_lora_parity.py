"""Outputs with an adapter equal PEFT's merged model token for token, float32: HF
``generate`` on ``PeftModel.from_pretrained(...).merge_and_unload()`` (BART, T5, Whisper; greedy and
beam search), and tandem on that merged model saved as a checkpoint (Whisper). A batch that mixes
adapters and the base equals each prompt run alone."""

from __future__ import annotations

import random

import pytest

from helpers import hf_search, make_bart, make_t5, make_whisper, synth_audio
from lora_adapters import make_adapter, merged_checkpoint
from tandem import LLM, LoRARequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
BART_ALL = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
T5_ALL = ["q", "k", "v", "o", "wi_0", "wi_1", "wo"]


def _token_prompts(seed: int, n: int, vocab: int = 96, lo: int = 4):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(lo, vocab) for _ in range(rng.randint(3, 20))]} for _ in range(n)]


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_bart")
    base = make_bart(root / "base", seed=3)
    adapters = {
        "all": make_adapter(base, root / "all", BART_ALL, seed=1),
        "qv": make_adapter(base, root / "qv", ["q_proj", "v_proj"], seed=2, r=2, alpha=16),
        "ffn_rs": make_adapter(base, root / "ffn_rs", ["fc1", "fc2", "out_proj"], seed=3, r=8, alpha=4,
                               use_rslora=True),
    }
    return base, adapters, root


def _hf_tokens(model_dir, out, **kwargs):
    (tokens, _), = hf_search(model_dir, out.encoder_prompt_token_ids, out.prompt_token_ids, do_sample=False,
                             max_new_tokens=12, **kwargs)
    return tokens


def test_bart_greedy_and_beams_equal_hf_peft_merged(bart):
    base, adapters, root = bart
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8)
    prompts = _token_prompts(0, 4)
    for i, (name, path) in enumerate(adapters.items(), start=1):
        merged = merged_checkpoint(base, path, root / f"merged_{name}")
        lora = LoRARequest(name, i, str(path))
        outs = llm.generate(prompts, GREEDY, lora_request=lora, use_tqdm=False)
        base_outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert any(o.outputs[0].token_ids != b.outputs[0].token_ids for o, b in zip(outs, base_outs)), name
        for o in outs:
            assert o.error is None, o.error
            assert o.outputs[0].token_ids == _hf_tokens(merged, o, num_beams=1), name
    merged = root / "merged_all"
    lora = LoRARequest("all", 1, str(adapters["all"]))
    beam = SamplingParams(num_beams=3, max_tokens=8)
    for o in llm.generate(prompts[:2], beam, lora_request=lora, use_tqdm=False):
        assert o.error is None, o.error
        (ref, _), = hf_search(merged, o.encoder_prompt_token_ids, o.prompt_token_ids, do_sample=False, num_beams=3,
                              max_new_tokens=8)
        assert o.outputs[0].token_ids == ref


def test_a_batch_mixing_three_adapters_and_the_base_equals_each_run_alone(bart):
    base, adapters, _ = bart
    loras = [LoRARequest(name, i, str(p)) for i, (name, p) in enumerate(adapters.items(), start=1)]
    prompts = _token_prompts(1, 12)
    mix = [loras[i % 4] if i % 4 < 3 else None for i in range(len(prompts))]
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8)
    together = llm.generate(prompts, GREEDY, lora_request=mix, use_tqdm=False)
    alone_llm = LLM(str(base), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8)
    changed = 0
    for p, lora, o in zip(prompts, mix, together):
        alone = alone_llm.generate([p], GREEDY, lora_request=lora, use_tqdm=False)[0]
        assert o.error is None and o.outputs[0].token_ids == alone.outputs[0].token_ids
        if lora is not None:
            plain = alone_llm.generate([p], GREEDY, use_tqdm=False)[0]
            changed += plain.outputs[0].token_ids != o.outputs[0].token_ids
    assert changed >= 5  # of the 9 adapter requests: the adapters are applied, not ignored


@pytest.mark.parametrize("shape, targets", [
    pytest.param("t5-small", ["q", "k", "v", "o", "wi", "wo"], marks=pytest.mark.slow),  # ReLU FFN: wi unfused
    ("flan-t5-base", T5_ALL),  # gated FFN: wi_0 / wi_1 fused into one layer's two shards
])
def test_t5_greedy_and_beams_equal_hf_peft_merged(shape, targets, tmp_path):
    base = make_t5(shape, tmp_path / "base", seed=2)
    adapter = make_adapter(base, tmp_path / "a", targets, seed=4, std=0.2)
    merged = merged_checkpoint(base, adapter, tmp_path / "merged")
    llm = LLM(str(base), dtype="float32", enable_lora=True)
    prompts = _token_prompts(2, 4, lo=2)
    outs = llm.generate(prompts, GREEDY, lora_request=LoRARequest("t5", 1, str(adapter)), use_tqdm=False)
    base_outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert any(o.outputs[0].token_ids != b.outputs[0].token_ids for o, b in zip(outs, base_outs))
    for o in outs:
        assert o.error is None, o.error
        assert o.outputs[0].token_ids == _hf_tokens(merged, o, num_beams=1)
    beam = SamplingParams(num_beams=3, max_tokens=8)
    for o in llm.generate(prompts[:2], beam, lora_request=LoRARequest("t5", 1, str(adapter)), use_tqdm=False):
        assert o.error is None, o.error
        (ref, _), = hf_search(merged, o.encoder_prompt_token_ids, o.prompt_token_ids, do_sample=False, num_beams=3,
                              max_new_tokens=8)
        assert o.outputs[0].token_ids == ref


def _hf_whisper(merged, clip, decoder, **kwargs):
    """HF's generate on the PEFT-merged Whisper from explicit decoder ids, with the
    checkpoint's suppress settings (tests/entrypoints/test_whisper.py's oracle)."""
    import torch
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration
    from transformers.generation.utils import GenerationMixin

    model = WhisperForConditionalGeneration.from_pretrained(merged).eval()
    features = WhisperFeatureExtractor(feature_size=model.config.num_mel_bins)(
        clip, sampling_rate=16000, return_tensors="pt").input_features
    with torch.no_grad():
        out = GenerationMixin.generate(model, input_features=features, decoder_input_ids=torch.tensor([decoder]),
                                       do_sample=False, **kwargs)
    return out[0, len(decoder):].tolist()


@pytest.mark.slow  # three engines over 1500-position audio encoders: ~25 s on 2 loaded cores
def test_whisper_with_an_adapter_equals_hf_peft_merged_greedy_and_beams(tmp_path):
    base = make_whisper(tmp_path / "base", seed=5)
    adapter = make_adapter(base, tmp_path / "a", BART_ALL, seed=6, std=0.2)
    merged = merged_checkpoint(base, adapter, tmp_path / "merged")
    prompts = [{"encoder_prompt": {"audio": synth_audio(2.0, seed=s), "sampling_rate": 16000},
                "decoder_prompt": {"prompt_token_ids": [120, 121, 125, 127]}} for s in range(3)]
    lora = LoRARequest("w", 1, str(adapter))
    got = LLM(str(base), dtype="float32", enable_lora=True).generate(prompts, GREEDY, lora_request=lora,
                                                                     use_tqdm=False)
    want = LLM(str(merged), dtype="float32").generate(prompts, GREEDY, use_tqdm=False)
    plain = LLM(str(base), dtype="float32").generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].token_ids for o in got] != [o.outputs[0].token_ids for o in plain]
    # And against HF + PEFT's merged model itself, greedy and beam search.
    decoder = [120, 121, 125, 127]
    clips = [p["encoder_prompt"]["audio"] for p in prompts]
    for clip, o in zip(clips, got):
        ref = _hf_whisper(merged, clip, decoder, num_beams=1, max_new_tokens=12)
        assert o.outputs[0].token_ids == ref[: len(o.outputs[0].token_ids)] and len(o.outputs[0].token_ids) == len(ref)
    beam = SamplingParams(num_beams=3, max_tokens=8)
    beams = LLM(str(base), dtype="float32", enable_lora=True).generate(prompts[:2], beam, lora_request=lora,
                                                                       use_tqdm=False)
    for clip, o in zip(clips, beams):
        assert o.error is None, o.error
        assert o.outputs[0].token_ids == _hf_whisper(merged, clip, decoder, num_beams=3, max_new_tokens=8)
