"""mBART-50, NLLB-200 (M2M100) and Pegasus in tandem's model zoo equal HF ``generate``
token for token in float32: greedy over many prompts batched with mixed lengths, each
checkpoint's own generation config (beam search for mBART-50 and Pegasus), the target
language as a forced BOS (per request) or in the decoder prompt, and under preemption.

The checkpoints are tiny and random but shaped like the real ones (pre-LN, final layer
norms, ``scale_embedding``, the activation and special ids of mbart-large-50-many-to-many,
nllb-200-distilled-600M and pegasus-xsum, their generation configs with the lengths
shrunk). As in ``test_bart_parity``, wide random weights give logits whose top two are far
apart, so tokens are compared exactly; each test also checks the outputs are varied.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from helpers import TINY_DIMS, assert_bfloat16_agrees, generate_preempted_and_ample, hf_greedy, hf_search
from tandem import LLM, SamplingParams

VOCAB = 96
LANGS = (90, 91, 92, 93)  # language codes at the top of the vocabulary, as in mBART-50 / NLLB
# Beam scores to 1e-4 (see test_beam_search: float32 sums in another order than HF's).
SCORE_REL, SCORE_ABS = 1e-4, 1e-4


def _shape(family: str) -> dict:
    """Special ids, config fields and generation config of the real checkpoint, shrunk."""
    dims = {k: v for k, v in TINY_DIMS.items() if k != "forced_eos_token_id"}
    if family == "mbart50":  # facebook/mbart-large-50-many-to-many-mmt
        ids = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
        config = dict(dims, **ids, activation_function="gelu", scale_embedding=True, forced_eos_token_id=2)
        gen = dict(ids, num_beams=5, early_stopping=True, forced_eos_token_id=2, max_length=40)
    elif family == "nllb":  # facebook/nllb-200-distilled-600M
        ids = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
        config = dict(dims, **ids, activation_function="relu", scale_embedding=True)
        gen = dict(ids, max_length=40)
    else:  # google/pegasus-xsum
        ids = dict(pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
        config = dict(dims, **ids, activation_function="relu", scale_embedding=True, forced_eos_token_id=1)
        gen = dict(ids, num_beams=8, length_penalty=0.6, forced_eos_token_id=1, max_length=40)
    return dict(config=config, gen=gen, eos=ids["eos_token_id"], start=ids["decoder_start_token_id"],
                pad=ids["pad_token_id"])


# Chosen for varied lengths, some stopped early, with healthy margins between the top two
# tokens (Pegasus stops early on its own: it gets less, or its 8 beams end on the first token).
EOS_BOOST = {"mbart50": 3.5, "nllb": 1.0, "pegasus": -0.3}


def make_family(family: str, path: Path, seed: int = 0, weight_std: float | None = None) -> Path:
    """``weight_std``: every matrix at that std instead (no </s> tuning), activations O(1) for
    a bfloat16 test (helpers.make_bart's note)."""
    from transformers import (GenerationConfig, M2M100Config, M2M100ForConditionalGeneration, MBartConfig,
                              MBartForConditionalGeneration, PegasusConfig, PegasusForConditionalGeneration)

    config_cls, model_cls = {
        "mbart50": (MBartConfig, MBartForConditionalGeneration),
        "nllb": (M2M100Config, M2M100ForConditionalGeneration),
        "pegasus": (PegasusConfig, PegasusForConditionalGeneration),
    }[family]
    shape = _shape(family)
    torch.manual_seed(seed)
    model = model_cls(config_cls(vocab_size=VOCAB, **shape["config"])).eval()
    # Wide weights give varied outputs (helpers.make_bart). The token embedding gets less, as in
    # test_marian_plugin, and least where it is scaled by sqrt(d_model) with no layernorm after
    # it (NLLB, Pegasus): else the current token dominates and greedy decoding repeats it.
    emb_std = 0.3 if family == "mbart50" else 0.1
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed_positions" not in name:
                p.normal_(0.0, weight_std or (emb_std if name == "model.shared.weight" else 1.0))
        if weight_std is not None:
            model.save_pretrained(path)
            return Path(path)
        # Set how likely </s> is, so that some sequences stop and others run to the limit,
        # through the decoder's final layer norm (NLLB has no final_logits_bias): its logit
        # moves by ``eos_boost`` times the logits' spread (~ emb_std * sqrt(d_model)).
        eos_boost = EOS_BOOST[family]
        e = model.model.shared.weight[shape["eos"]]
        model.model.decoder.layer_norm.bias += eos_boost * emb_std * e.numel() ** 0.5 * e / e.dot(e)
    model.generation_config = GenerationConfig(**shape["gen"])
    model.save_pretrained(path)
    return Path(path)


FAMILIES = ("mbart50", "nllb", "pegasus")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, make_family(request.param, tmp_path_factory.mktemp(request.param) / "ckpt")


def _encoder(rng: random.Random, family: str, n: int) -> list[int]:
    """Source ids as the tokenizers lay them out: mBART-50 / NLLB ``[src_lang] ... </s>``,
    Pegasus ``... </s>``."""
    eos = _shape(family)["eos"]
    body = [rng.randrange(3, LANGS[0]) for _ in range(n)]
    return body + [eos] if family == "pegasus" else [rng.choice(LANGS), *body, eos]


def _prompts(family: str, seed: int, n: int) -> list:
    rng = random.Random(seed)
    start = _shape(family)["start"]
    prompts = []
    for i in range(n):
        enc = {"prompt_token_ids": _encoder(rng, family, rng.choice([1, 2, 5, 13, 30, 70, 110]))}
        if i % 3 == 0:
            prompts.append(enc)  # the default decoder prompt: [decoder_start]
        elif i % 3 == 1:
            dec = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 4))]
            prompts.append({"encoder_prompt": enc, "decoder_prompt": {"prompt_token_ids": dec}})
        else:
            dec = [start, rng.choice(LANGS), *(rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 2)))]
            prompts.append({"encoder_prompt": enc, "decoder_prompt": {"prompt_token_ids": dec}})
    return prompts


def _assert_varied(outs, min_distinct: int, max_tokens: int) -> None:
    # A degenerate model (every prompt the same answer, none stopping) would make the test weak.
    # (mBART-50's and Pegasus's forced </s> ends every sequence on </s>: count lengths instead.)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) >= min_distinct
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert min(lengths) < max_tokens and max_tokens in lengths


def test_greedy_batched_mixed_lengths_equal_hf(family):
    name, path = family
    llm = LLM(model=str(path), dtype="float32", device="cpu", block_size=4)
    prompts = _prompts(name, 0, 18)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, num_beams=1, max_tokens=20), use_tqdm=False)
    start = _shape(name)["start"]
    for prompt, o in zip(prompts, outs):
        assert o.error is None, o.error
        if "decoder_prompt" not in prompt:
            assert o.prompt_token_ids == [start]  # HF's start: decoder_start alone, no <s>
        assert o.prompt_token_ids[0] == start
        ref = hf_greedy(path, o.encoder_prompt_token_ids, o.prompt_token_ids, 20)
        assert o.outputs[0].token_ids == ref, (o.encoder_prompt_token_ids, o.prompt_token_ids)
    _assert_varied(outs, 12, 20)


def test_the_checkpoints_generation_config_equals_hf(family):
    """No SamplingParams: the generation config decides (mBART-50: 5 beams, early stopping,
    forced </s>; Pegasus: 8 beams, length_penalty 0.6; NLLB: greedy), as in HF generate."""
    name, path = family
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    defaults = llm.get_default_sampling_params()
    assert defaults.num_beams == _shape(name)["gen"].get("num_beams", 1)
    rng = random.Random(1)
    sources = [_encoder(rng, name, rng.choice([2, 9, 30, 60])) for _ in range(8)]
    outs = llm.generate([{"prompt_token_ids": s} for s in sources], use_tqdm=False)
    for source, o in zip(sources, outs):
        assert o.error is None, o.error
        (tokens, score), = hf_search(path, source, None)  # HF's own start and generation config
        assert o.outputs[0].token_ids == tokens
        if score is not None:
            assert o.outputs[0].cumulative_logprob == pytest.approx(score, rel=SCORE_REL, abs=SCORE_ABS)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) >= 5


@pytest.mark.parametrize("beams", [1, 4])
def test_target_language_as_forced_bos_equals_hf(family, beams):
    """The per-request target language: ``SamplingParams(forced_bos_token_id=lang)`` with no
    decoder prompt is HF ``generate(forced_bos_token_id=lang)``; the language then counts as
    the first generated token. A decoder prompt ``[decoder_start, lang]`` is HF with those
    ``decoder_input_ids``."""
    name, path = family
    if name == "pegasus":
        pytest.skip("Pegasus is monolingual: no target language")
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    start = _shape(name)["start"]
    rng = random.Random(2 + beams)
    sources = [_encoder(rng, name, rng.choice([3, 11, 40])) for _ in range(6)]
    langs = [LANGS[i % len(LANGS)] for i in range(len(sources))]
    params = [SamplingParams(num_beams=beams, max_tokens=16, forced_bos_token_id=lang) for lang in langs]
    forced = llm.generate([{"prompt_token_ids": s} for s in sources], params, use_tqdm=False)
    prompted = llm.generate(
        [{"encoder_prompt": {"prompt_token_ids": s}, "decoder_prompt": {"prompt_token_ids": [start, lang]}}
         for s, lang in zip(sources, langs)],
        SamplingParams(num_beams=beams, max_tokens=15), use_tqdm=False,
    )
    for source, lang, f, p in zip(sources, langs, forced, prompted):
        assert f.error is None and p.error is None, (f.error, p.error)
        assert f.prompt_token_ids == [start] and f.outputs[0].token_ids[0] == lang
        (ref, _), = hf_search(path, source, None, num_beams=beams, max_new_tokens=16, forced_bos_token_id=lang)
        assert f.outputs[0].token_ids == ref
        assert p.prompt_token_ids == [start, lang]
        (ref, _), = hf_search(path, source, [start, lang], num_beams=beams, max_new_tokens=15)
        assert p.outputs[0].token_ids == ref
    assert len({tuple(o.outputs[0].token_ids) for o in forced}) >= 4


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_identical(family, mode):
    name, path = family
    prompts = _prompts(name, 3, 12)
    params = SamplingParams(temperature=0.0, num_beams=1, max_tokens=30, min_tokens=30)
    outs, ref = generate_preempted_and_ample(path, prompts, params, mode)
    for o, r in zip(outs, ref):
        assert o.error is None, o.error
        assert o.outputs[0].token_ids == r.outputs[0].token_ids and len(r.outputs[0].token_ids) == 30
    for r in ref[:4]:  # and the unpreempted run is HF's answer
        assert r.outputs[0].token_ids == hf_greedy(path, r.encoder_prompt_token_ids, r.prompt_token_ids, 30, 30)


def test_nllb_pad_tokens_take_hfs_padding_position(tmp_path):
    """M2M100 numbers positions from ``pad_token_id + 1`` and gives a ``<pad>`` the zero row:
    prompts that end in ``<pad>`` (encoder and decoder) equal HF's, which they would not if
    the pad were numbered as any other token."""
    path = make_family("nllb", tmp_path / "ckpt", seed=1)
    llm = LLM(model=str(path), dtype="float32", device="cpu")
    rng = random.Random(4)
    pad, start = _shape("nllb")["pad"], _shape("nllb")["start"]
    prompts = [
        {"encoder_prompt": {"prompt_token_ids": [*_encoder(rng, "nllb", rng.randint(2, 20)), pad]},
         "decoder_prompt": {"prompt_token_ids": [start, rng.choice(LANGS), rng.randrange(3, VOCAB), pad]}}
        for _ in range(6)
    ]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, num_beams=1, max_tokens=10), use_tqdm=False)
    for o in outs:
        assert o.outputs[0].token_ids == hf_greedy(path, o.encoder_prompt_token_ids, o.prompt_token_ids, 10)


def test_position_tables_are_hfs_bit_for_bit(tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    for name in ("nllb", "pegasus"):
        path = make_family(name, tmp_path / name)
        ours = LLM(model=str(path), dtype="float32", device="cpu").engine.model.model
        theirs = AutoModelForSeq2SeqLM.from_pretrained(path, dtype=torch.float32).model
        for stack in ("encoder", "decoder"):
            hf = getattr(theirs, stack).embed_positions
            hf_table = hf.weights if name == "nllb" else hf.weight
            assert torch.equal(getattr(ours, stack).embed_positions.weight, hf_table), (name, stack)


@pytest.mark.parametrize("num_rows,dim,padding_idx", [(130, 32, 1), (1026, 1024, 1), (66, 33, 1), (20, 4, 0), (9, 6, None)])
def test_fairseq_table_equals_hfs_get_embedding(num_rows, dim, padding_idx):
    from transformers.models.m2m_100.modeling_m2m_100 import M2M100SinusoidalPositionalEmbedding as HF

    from tandem.model_zoo.positions import fairseq_sinusoidal_table

    assert torch.equal(fairseq_sinusoidal_table(num_rows, dim, padding_idx), HF.get_embedding(num_rows, dim, padding_idx))


@pytest.mark.parametrize("family_name, field, value, match", [
    ("nllb", "pad_token_id", None, r"pad_token_id=None must be a token id in \[0, 96\)"),
    ("nllb", "pad_token_id", 500, r"pad_token_id=500 must be a token id"),
    ("nllb", "d_model", 2, r"d_model=2 is too small for M2M100's sinusoidal positions"),
    ("pegasus", "activation_function", "gelu_fancy", r"activation_function='gelu_fancy' is not one of"),
])
def test_unsupported_config_values_are_named(tmp_path, family_name, field, value, match):
    import json

    path = make_family(family_name, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config[field] = value
    if field == "d_model":
        config.update(encoder_attention_heads=1, decoder_attention_heads=1)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        LLM(model=str(path), dtype="float32", device="cpu")


def test_bfloat16_agrees_with_the_float64_oracle(family, tmp_path):
    """test_sampling's bfloat16 method and bound (helpers.assert_bfloat16_agrees), on a
    checkpoint of the family's shape whose activations stay O(1) (matrices of std
    ``d_model**-0.5``, as test_sampling's BART). Measured worst log-probability errors:
    0.02 to 0.03, of the bound's 0.1."""
    name, _ = family
    path = make_family(name, tmp_path / "ckpt", weight_std=TINY_DIMS["d_model"] ** -0.5)
    pad = _shape(name)["pad"] if name == "nllb" else None  # test_nllb_pad_tokens_take_hfs_padding_position
    worst = assert_bfloat16_agrees(path, _prompts(name, 9, 8), stop_after=pad)
    print(f"{name}: worst bfloat16 log-probability error {worst:.4f}")
