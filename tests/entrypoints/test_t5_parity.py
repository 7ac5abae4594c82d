"""T5 in tandem's model zoo equals HF ``generate`` token for token in float32, greedy,
batched with mixed lengths and under preemption, for tiny random checkpoints shaped like
t5-small (v1.0: ReLU FFN, tied head scaled by ``d_model**-0.5``) and flan-t5-base
(v1.1: gated-GELU FFN, a head of its own, ``tie_word_embeddings: false``); the same
through the triton backend's kernels; and a T5 model is refused by a backend that does
not declare ``relative_position_bias``.

transformers 5 builds T5 tied always; the untied checkpoint is written as the real
flan-t5 ones are: its config says ``tie_word_embeddings: false`` and it carries an
``lm_head.weight`` of its own, which HF then loads untied.

Random layer-norm weights (T5's are all ones at init) keep the outputs varied. Where HF's
top two logits come within ``NEAR_TIE`` of each other, float32 summation order may pick
either: tokens are compared up to that step only, and few prompts may stop early so.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from helpers import _hf_model, assert_preempted, hf_generate
from tandem import LLM, SamplingParams
from tandem.registry import BackendUnavailableError

VOCAB = 96
PAD, EOS = 0, 1  # T5's ids: decoding starts from <pad>
NEAR_TIE = 1e-4  # log-probability gap below which greedy may go either way in float32

SHAPES = {
    # t5-small: d_model 512, d_kv 64, 8 heads, d_ff 2048, 6 + 6 layers, 32 buckets up to 128
    "t5-small": dict(d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2, num_decoder_layers=2,
                     relative_attention_num_buckets=32, relative_attention_max_distance=128,
                     feed_forward_proj="relu"),
    # flan-t5-base: d_model 768, d_kv 64, 12 heads, d_ff 2048 gated-gelu, 12 + 12 layers, untied.
    # Fewer buckets and a short max distance here, so the prompts reach the clipped bucket.
    # (Stacks of different depths cannot be compared: transformers 5.24's generate sizes its
    # decoder cache by num_layers and fails when num_decoder_layers is larger.)
    "flan-t5-base": dict(d_model=32, d_kv=16, num_heads=3, d_ff=48, num_layers=2, num_decoder_layers=2,
                         relative_attention_num_buckets=16, relative_attention_max_distance=24,
                         feed_forward_proj="gated-gelu"),
}
TIED = {"t5-small": True, "flan-t5-base": False}


def make_t5(shape: str, path: Path, seed: int = 0) -> Path:
    from safetensors.torch import load_file, save_file
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = T5Config(vocab_size=VOCAB, dropout_rate=0.0, pad_token_id=PAD, eos_token_id=EOS,
                      decoder_start_token_id=PAD, **SHAPES[shape])
    model = T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if name == "shared.weight" else 1.0)
    model.save_pretrained(path)
    if not TIED[shape]:
        weights = load_file(path / "model.safetensors")
        weights["lm_head.weight"] = torch.randn(VOCAB, config.d_model, generator=torch.Generator().manual_seed(seed))
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
        cfg = json.loads((path / "config.json").read_text())
        cfg["tie_word_embeddings"] = False
        cfg.pop("scale_decoder_outputs", None)  # transformers 5's own field; the real checkpoints lack it
        (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module", params=list(SHAPES))
def t5(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, make_t5(request.param, tmp_path_factory.mktemp(request.param))


def _prompts(seed: int, n: int) -> list:
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        enc = {"prompt_token_ids": [rng.randrange(2, VOCAB) for _ in range(rng.choice([1, 2, 5, 13, 30, 70]))] + [EOS]}
        if i % 2:
            dec = [PAD, *(rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 6)))]
            prompts.append({"encoder_prompt": enc, "decoder_prompt": {"prompt_token_ids": dec}})
        else:
            prompts.append(enc)  # the default decoder prompt: <pad> alone
    return prompts


def _hf_reference(path: Path, encoder_ids, decoder_ids, max_new: int, min_new: int = 0) -> tuple[list[int], int]:
    """HF's tokens, and how many of them are clear of a near tie (compare those)."""
    tokens, logprobs = hf_generate(_hf_model(path), encoder_ids, decoder_ids, max_new, min_new)
    top2 = logprobs.topk(2, dim=-1).values
    near = ((top2[:, 0] - top2[:, 1]) < NEAR_TIE).nonzero().flatten().tolist()
    return tokens, near[0] if near else len(tokens)


def _assert_equal_hf(path: Path, outs, max_new: int, min_new: int = 0) -> None:
    cut = 0
    for o in outs:
        assert o.error is None, o.error
        ref, clear = _hf_reference(path, o.encoder_prompt_token_ids, o.prompt_token_ids, max_new, min_new)
        got = o.outputs[0].token_ids
        if clear == len(ref):
            assert got == ref, (o.encoder_prompt_token_ids, o.prompt_token_ids)
        else:
            cut += 1
            assert got[:clear] == ref[:clear], (o.encoder_prompt_token_ids, o.prompt_token_ids, clear)
    assert cut <= len(outs) // 4, f"{cut} of {len(outs)} prompts hit a near tie: pick another seed"


def test_greedy_batched_mixed_lengths_equal_hf(t5):
    shape, path = t5
    llm = LLM(model=str(path), dtype="float32", device="cpu", block_size=4)
    # torch_sdpa, the one CPU backend that declares the bias; cpu_paged, which ranks above it on
    # CPU, is passed over with the reason in the start line.
    assert llm.llm_engine.attn_backend.name == "torch_sdpa"
    assert "cpu_paged (priority" in llm.llm_engine._backend_reason
    assert "attention feature relative_position_bias is not served" in llm.llm_engine._backend_reason
    prompts = _prompts(0, 16)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, num_beams=1, max_tokens=24), use_tqdm=False)
    for prompt, o in zip(prompts, outs):
        if "decoder_prompt" not in prompt:
            assert o.prompt_token_ids == [PAD]  # HF's start: decoder_start_token_id (pad) alone
    _assert_equal_hf(path, outs, 24)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) >= 12  # varied, so the comparison says something


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_equal_to_hf(t5, mode):
    shape, path = t5
    prompts = _prompts(3, 10)
    params = SamplingParams(temperature=0.0, num_beams=1, max_tokens=30, min_tokens=30)
    llm = LLM(model=str(path), dtype="float32", device="cpu", block_size=4, num_kv_blocks=50, preemption_mode=mode)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_preempted(llm, mode)
    _assert_equal_hf(path, outs, 30, 30)


def test_greedy_through_triton_equals_hf(t5):
    """The triton backend's kernels (Triton's interpreter on CPU) with the bias in the
    encoder, prefills and decodes; a small batch: interpreted kernels are slow."""
    pytest.importorskip("triton")
    from tandem.backends.triton import backend as triton_backend

    if torch.cuda.is_available() or not triton_backend._interpreting():
        pytest.skip("runs the kernels in Triton's interpreter (CPU, TRITON_INTERPRET=1)")
    shape, path = t5
    llm = LLM(model=str(path), dtype="float32", device="cpu", block_size=4, attention_backend="triton")
    assert llm.llm_engine.attn_backend.name == "triton"
    prompts = _prompts(7, 3)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, num_beams=1, max_tokens=10), use_tqdm=False)
    _assert_equal_hf(path, outs, 10)


def test_a_backend_without_the_bias_is_refused_by_name(t5):
    shape, path = t5
    for name in ("flash_attn", "cpu_paged"):
        with pytest.raises(BackendUnavailableError, match=rf"attention_backend='{name}' cannot serve this model: "
                           r".*attention feature relative_position_bias is not served"):
            LLM(model=str(path), dtype="float32", device="cpu", attention_backend=name)


def test_the_head_follows_the_checkpoint(t5):
    """v1.0: no lm_head of its own, decoder output scaled; v1.1: its own head, unscaled."""
    shape, path = t5
    model = LLM(model=str(path), dtype="float32", device="cpu").llm_engine.model
    assert model.scale_output is TIED[shape]
    assert hasattr(model, "lm_head") is not TIED[shape]
    if not TIED[shape]:
        from safetensors.torch import load_file

        assert torch.equal(model.lm_head.weight, load_file(path / "model.safetensors")["lm_head.weight"])


def test_log_probabilities_equal_hfs(t5):
    """Greedy tokens cannot see the tied head's ``d_model**-0.5`` (a uniform scale keeps the
    argmax): the log-probabilities can. Every vocabulary entry of every step, to 1e-4."""
    shape, path = t5
    llm = LLM(model=str(path), dtype="float32", device="cpu", block_size=4)
    prompts = _prompts(5, 4)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, logprobs=VOCAB), use_tqdm=False)
    for o in outs:
        tokens, want = hf_generate(_hf_model(path), o.encoder_prompt_token_ids, o.prompt_token_ids, 8)
        assert o.outputs[0].token_ids == tokens
        got = torch.tensor([[step[t] for t in range(VOCAB)] for step in o.outputs[0].logprobs])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("field,value,message", [
    ("relative_attention_num_buckets", 2, r"relative_attention_num_buckets=2 must be at least 4"),
    ("d_kv", 0, r"d_kv=0 must be a positive integer"),
    ("relative_attention_max_distance", 16, r"relative_attention_max_distance=16 must exceed "
                                            r"relative_attention_num_buckets // 2 = 16"),
])
def test_a_config_t5_cannot_run_names_the_field(tmp_path, field, value, message):
    path = make_t5("t5-small", tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg[field] = value
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        LLM(model=str(path), dtype="float32", device="cpu")
