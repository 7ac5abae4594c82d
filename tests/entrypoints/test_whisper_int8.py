"""``quantization="int8"`` on Whisper, as on BART: every linear layer of the
encoder and the decoder and the LM head run int8 (the two convolutions stay
float32), and on the shipped demo checkpoint (trained, so its margins are a
real model's) int8 transcribes HF's float32 greedy tokens and scores each of
them within a small distance of the float32 engine."""

import json

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.core.layers import LinearBase, VocabParallelEmbedding
from tandem.core.layers.linear_kernels import Int8DynamicKernel, int8_unsupported
from tandem.demo_whisper import PATH

pytestmark = pytest.mark.skipif(bool(int8_unsupported(torch.device("cpu"))), reason="no int8 dynamic quantization")

SAMPLES = json.loads((PATH / "demo_samples.json").read_text())


@pytest.fixture(scope="module")
def engines():
    # 2048 blocks of 16: every forced request's 1500-position cross table at once (94 blocks each).
    return {q: LLM(model=str(PATH), dtype="float32", device="cpu", quantization=q, num_kv_blocks=2048)
            for q in (None, "int8")}


def test_every_linear_layer_and_the_lm_head_are_int8(engines):
    model = engines["int8"].llm_engine.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    encoder = [m for m in model.model.encoder.modules() if isinstance(m, LinearBase)]
    # 2 encoder layers x (qkv, out, fc1, fc2) and 2 decoder layers x (qkv, out, q, kv, out, fc1, fc2)
    assert len(encoder) == 8 and len(linears) == 8 + 14
    assert all(isinstance(m.kernel, Int8DynamicKernel) for m in linears)
    (embed,) = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding)]
    assert isinstance(embed.logits_kernel, Int8DynamicKernel)
    assert embed.weight.numel() > 0  # the float table stays for lookups
    assert model.model.encoder.conv1.weight.dtype == torch.float32
    assert engines["int8"].llm_engine.worker.linear_kernels == "linear layers: 23 x int8"


def _lp(x):
    return getattr(x, "logprob", x)


def test_int8_transcribes_hf_s_greedy_tokens_and_tracks_float32(engines):
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    from tandem.audio import load_audio

    hf = WhisperForConditionalGeneration.from_pretrained(PATH, dtype=torch.float32).eval()
    extractor = WhisperFeatureExtractor.from_pretrained(PATH)
    g = hf.generation_config
    prompt = [g.decoder_start_token_id, g.lang_to_id["<|en|>"], g.task_to_id["transcribe"], g.no_timestamps_token_id]
    audios = [load_audio(PATH / s["file"]).numpy() for s in SAMPLES]
    results = engines["int8"].transcribe([{"audio": a, "sampling_rate": 16000} for a in audios], use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    worst = 0.0
    for sample, audio, r in zip(SAMPLES, audios, results):
        features = extractor(audio, sampling_rate=16000, return_tensors="pt").input_features
        with torch.no_grad():
            ref = hf.generate(features, language="en", task="transcribe")[0].tolist()
        if ref[: len(prompt)] == prompt:  # transformers 4 returns the decoder prompt too
            ref = ref[len(prompt):]
        assert r.error is None and r.text == sample["expected"]
        assert r.token_ids == [t for t in ref if t != g.eos_token_id]
        # Teacher-forced along HF's path (EOS included): each step scored by both engines.
        ids = prompt + ref
        forced = [{"encoder_prompt": {"audio": audio, "sampling_rate": 16000},
                   "decoder_prompt": {"prompt_token_ids": ids[:i]}} for i in range(len(prompt), len(ids))]
        fp32, int8 = (engines[q].generate(forced, params, use_tqdm=False) for q in (None, "int8"))
        for tok, a, b in zip(ids[len(prompt):], fp32, int8):
            assert b.outputs[0].token_ids == [tok]
            worst = max(worst, abs(_lp(b.outputs[0].logprobs[0][tok]) - _lp(a.outputs[0].logprobs[0][tok])))
    # Each int8 layer perturbs its output by ~1-2% RMS (tests/core/test_linear_kernels.py);
    # through 2 + 2 layers and the int8 head a confident token's logprob moves by
    # thousandths (observed worst over these 10 steps: 0.006 nats). Bar: 0.05, ~8x;
    # a wrong scale or a dropped bias moves logprobs by whole nats.
    assert worst < 0.05, worst
    assert worst > 0.0  # int8 really ran: float32 and int8 differ somewhere
