"""The out-of-tree ``tandem-marian`` package: installed with pip, found through its entry
point, and equal to HF ``MarianMTModel.generate`` token for token in float32."""

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import TINY_DIMS, hf_generate, installed_example
from tandem import LLM, SamplingParams
from tandem.plugins import default_model_registry, plugin_manager, reset_registries

VOCAB, PAD, EOS = 96, 95, 0  # OPUS-MT layout: </s>=0, <pad>=last id, decoder start = pad


@pytest.fixture(scope="module")
def marian_installed(tmp_path_factory):
    with installed_example("tandem-marian", "tandem_marian", tmp_path_factory.mktemp("pkg"), ()):
        yield


@pytest.fixture(scope="module")
def marian_dir(tmp_path_factory) -> Path:
    """A tiny random OPUS-MT-shaped checkpoint (no tokenizer: prompts are token ids)."""
    from transformers import MarianConfig, MarianMTModel

    path = tmp_path_factory.mktemp("marian") / "ckpt"
    torch.manual_seed(2)
    config = MarianConfig(
        **{k: v for k, v in TINY_DIMS.items() if k != "forced_eos_token_id"},
        vocab_size=VOCAB,
        activation_function="swish",
        scale_embedding=True,
        pad_token_id=PAD,
        decoder_start_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=EOS,  # as OPUS-MT configs have it; generation must not use it
        forced_eos_token_id=None,  # tandem does not force EOS at max_length
    )
    model = MarianMTModel(config).eval()
    # Wide weights give varied outputs (see helpers.make_bart). The shared embedding gets less:
    # Marian scales it by sqrt(d_model) and has no layernorm after it, so at std 1 the current
    # token dominates and greedy decoding repeats it from the second step on. The bias on </s>
    # makes some sequences stop.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed_positions" not in name:  # positions are fixed, not saved
                p.normal_(0.0, 0.6 if name == "model.shared.weight" else 1.0)
        model.final_logits_bias.normal_(0.0, 1.0)
        model.final_logits_bias[0, EOS] += 8.0
    # OPUS-MT checkpoints ship this generation config; HF generate then never emits <pad>.
    model.generation_config.bad_words_ids = [[PAD]]
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_marian(marian_dir):
    from transformers import MarianMTModel

    return MarianMTModel.from_pretrained(marian_dir, dtype=torch.float32).eval()


def _prompts(seed: int, n: int) -> list:
    rng = random.Random(seed)
    ids = lambda k: [rng.randrange(1, PAD) for _ in range(k)]  # noqa: E731
    prompts = []
    for i in range(n):
        enc = {"prompt_token_ids": [*ids(rng.choice([1, 3, 9, 25, 60, 110])), EOS]}
        if i % 3 == 0:
            prompts.append(enc)  # default decoder prompt: [<pad>]
        elif i % 3 == 1:
            prompts.append({"encoder_prompt": enc, "decoder_prompt": {"prompt_token_ids": ids(rng.randint(1, 4))}})
        else:
            prompts.append({"encoder_prompt": enc, "decoder_prompt": {"prompt_token_ids": [PAD, *ids(2)]}})
    return prompts


def test_plugin_is_discovered_through_its_entry_point(marian_installed):
    info = plugin_manager().plugins["tandem-marian"]
    assert info.models == ["MarianMTModel"] and info.backends == []
    assert info.value == "tandem_marian.plugin" and info.distribution == "tandem-marian"
    cls, arch = default_model_registry().resolve(["MarianMTModel"])
    assert arch == "MarianMTModel" and cls.__module__ == "tandem_marian.marian"


def test_cli_lists_the_plugin(marian_installed):
    out = subprocess.run(
        [sys.executable, "-m", "tandem.entrypoints.cli", "plugins"], capture_output=True, text=True, check=True
    ).stdout
    assert "tandem-marian  (tandem_marian.plugin, from tandem-marian)" in out
    assert "MarianMTModel" in out


def test_allow_list_can_leave_the_plugin_out(marian_installed, monkeypatch):
    monkeypatch.setenv("TANDEM_PLUGINS", "tandem-models,tandem-torch-sdpa")
    reset_registries()
    try:
        assert "tandem-marian" not in plugin_manager().plugins
        with pytest.raises(ValueError, match="'MarianMTModel'.* not supported"):
            default_model_registry().resolve(["MarianMTModel"])
    finally:
        monkeypatch.delenv("TANDEM_PLUGINS")
        reset_registries()


def test_generation_matches_hf_marian(marian_installed, marian_dir, hf_marian):
    llm = LLM(model=str(marian_dir), dtype="float32", device="cpu", block_size=4)
    prompts = _prompts(0, 12)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, logprobs=3), use_tqdm=False)
    assert len(outs) == len(prompts)
    for prompt, o in zip(prompts, outs):
        assert o.error is None, o.error
        assert o.prompt_token_ids[0] == PAD
        if "decoder_prompt" not in prompt:
            assert o.prompt_token_ids == [PAD]  # Marian has no <BOS> after the start token
        ref, ref_logprobs = hf_generate(hf_marian, o.encoder_prompt_token_ids, o.prompt_token_ids, 16)
        assert o.outputs[0].token_ids == ref, (o.encoder_prompt_token_ids, o.prompt_token_ids)
        assert PAD not in o.outputs[0].token_ids
        # Every step's distribution too, not only its argmax: repeated tokens would hide a drift.
        # The wide random weights give logits of large magnitude, so float32 reductions in another
        # order (packed attention vs HF's padded batch of one) differ by ~1e-4 in log-probability.
        for step, top in enumerate(o.outputs[0].logprobs):
            for token, logprob in top.items():
                assert logprob == pytest.approx(ref_logprobs[step, token].item(), abs=1e-3), (step, token)
    # Varied outputs, some stopped at </s>: a degenerate model would make this test weak.
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 8
    assert {o.outputs[0].finish_reason for o in outs} == {"stop", "length"}


def test_position_table_is_hfs_bit_for_bit(marian_installed, marian_dir, hf_marian):
    llm = LLM(model=str(marian_dir), dtype="float32", device="cpu")
    ours, theirs = llm.engine.model.model, hf_marian.model
    for stack in ("encoder", "decoder"):
        assert torch.equal(getattr(ours, stack).embed_positions.weight, getattr(theirs, stack).embed_positions.weight)


@pytest.mark.parametrize("num_positions,dim", [(128, 32), (64, 33), (512, 512), (5, 1)])
def test_sinusoidal_table_equals_hfs_create_weight(num_positions, dim):
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    from tandem.model_zoo.bart import sinusoidal_table

    hf = MarianSinusoidalPositionalEmbedding(num_positions, dim)
    assert torch.equal(sinusoidal_table(num_positions, dim), hf.create_weight())
