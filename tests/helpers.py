"""Tiny random checkpoints made with transformers, offline."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# Seconds a test waits for a child process (a fresh interpreter that imports torch and
# builds an engine, a server becoming healthy): seconds alone, minutes on a 2-core machine
# other work shares. The bound only turns a hang into a failure, so it is generous.
SUBPROCESS_TIMEOUT = 600.0

WORDS = (
    "the rain in spain falls mainly on plain a cat sat mat dog ran fast over hill "
    "red blue green small big old new time day night sun moon star sea river tree "
    "house road city king queen bird fish stone fire water wind light dark cold warm"
).split()


def make_tokenizer(vocab_size: int):
    """A word-level tokenizer with BART's special ids: <s>=0 <pad>=1 </s>=2 <unk>=3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    i = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"w{i}", len(vocab))
        i += 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


# Multi-character tokens of the byte-level test tokenizer, as BPE merges, so grammars
# see tokens that span several grammar symbols ('{"', '":', 'true', ' "').
BYTE_MERGES = (("{", '"'), ('"', ":"), ("t", "r"), ("u", "e"), ("tr", "ue"), ("Ġ", '"'), ("a", "t"), ("c", "at"),
               ("1", "2"), ("\"", ","))


def make_byte_tokenizer():
    """A byte-level BPE tokenizer as BART's (every byte a token, ``BYTE_MERGES`` on top)
    with BART's special ids: <s>=0 <pad>=1 </s>=2 <unk>=3; 256 + 4 + len(BYTE_MERGES) ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<s>", "<pad>", "</s>", "<unk>"])}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for a, b in BYTE_MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, list(BYTE_MERGES)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def make_bart_bytes(path: Path, seed: int = 0, head_padding: int = 8, **overrides) -> Path:
    """A tiny random BART with the byte-level tokenizer (text of any characters), its
    LM head ``head_padding`` ids wider than the tokenizer's vocabulary."""
    tok = make_byte_tokenizer()
    make_bart(path, seed=seed, with_tokenizer=False, vocab_size=len(tok.get_vocab()) + head_padding, **overrides)
    tok.save_pretrained(path)
    return Path(path)


# Dimensions of every tiny test checkpoint (BART and its relatives), dropout off.
TINY_DIMS = dict(
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=128,
    forced_eos_token_id=None,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
)


def make_bart(path: Path, seed: int = 0, with_tokenizer: bool = True, weight_std: float = 1.0,
              logits_bias_std: float = 1.0, **overrides) -> Path:
    from transformers import BartConfig, BartForConditionalGeneration

    kwargs = dict(TINY_DIMS, vocab_size=96)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    config = BartConfig(**kwargs)
    model = BartForConditionalGeneration(config).eval()
    # The default init (std 0.02) makes every prompt decode to the same token;
    # wide weights give varied outputs that depend on the input. Wide weights also
    # make activations of ~1e2, where bfloat16 keeps no fractional digits at all: a
    # bfloat16 test wants ``weight_std`` near 1/sqrt(d_model), which keeps them O(1).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, weight_std)
        if logits_bias_std:  # 0: the all-zero final_logits_bias BART checkpoints ship
            model.final_logits_bias.normal_(0.0, logits_bias_std)
        else:
            model.final_logits_bias.zero_()
    model.save_pretrained(path)
    if with_tokenizer:
        make_tokenizer(config.vocab_size).save_pretrained(path)
    return Path(path)


def hf_generate(model, encoder_ids: list[int], decoder_ids: list[int], max_new: int, min_new: int = 0):
    """HF greedy ``generate`` on one prompt: the new tokens (EOS included when it
    stopped there) and each step's log-softmax ``[steps, vocab]`` of the scores
    after HF's logits processors."""
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([encoder_ids]),
            attention_mask=torch.ones(1, len(encoder_ids), dtype=torch.long),
            decoder_input_ids=torch.tensor([decoder_ids]),
            max_new_tokens=max_new,
            min_new_tokens=min_new,
            do_sample=False,
            num_beams=1,
            output_scores=True,
            return_dict_in_generate=True,
        )
    logprobs = torch.log_softmax(torch.cat(out.scores).float(), dim=-1)
    return out.sequences[0, len(decoder_ids) :].tolist(), logprobs


def hf_greedy(model_dir: Path, encoder_ids: list[int], decoder_ids: list[int], max_new: int, min_new: int = 0):
    """The new tokens of HF generate for the checkpoint in ``model_dir``."""
    return hf_generate(_hf_model(model_dir), encoder_ids, decoder_ids, max_new, min_new)[0]


_cache: dict = {}


def _hf_model(model_dir: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForSeq2SeqLM

    key = (str(model_dir), dtype)
    if key not in _cache:
        _cache[key] = AutoModelForSeq2SeqLM.from_pretrained(model_dir, dtype=dtype).eval()
    return _cache[key]


def assert_preempted(llm, mode: str) -> None:
    """The run preempted; in swap mode blocks went out and every one came back."""
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["swapped_out_blocks"] > 0 and stats["swapped_in_blocks"] == stats["swapped_out_blocks"]


def generate_preempted_and_ample(model_dir: Path, prompts, params, mode: str, num_kv_blocks: int = 60):
    """The same greedy batch through a KV pool of ``num_kv_blocks`` blocks of 4 (asserted
    to preempt in ``mode`` and to end with every block free) and through an ample one
    (asserted not to preempt): both outputs."""
    from tandem import LLM

    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=num_kv_blocks,
              preemption_mode=mode)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_preempted(llm, mode)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks() == bm.num_total_blocks()
    ample = LLM(model=str(model_dir), dtype="float32", device="cpu", block_size=4)
    ref = ample.generate(prompts, params, use_tqdm=False)
    assert ample.get_stats()["num_preemptions"] == 0
    return outs, ref


def hf_search(model_dir: Path, encoder_ids: list[int], decoder_ids: list[int] | None,
              dtype: torch.dtype = torch.float32, **kwargs):
    """HF ``generate`` on one prompt with ``kwargs`` (beam or greedy), the model in
    ``dtype``: per returned sequence, its new tokens (after ``decoder_ids``, or after
    HF's own start token) and its score (beam search) or None."""
    model = _hf_model(model_dir, dtype)
    extra = {} if decoder_ids is None else {"decoder_input_ids": torch.tensor([decoder_ids])}
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([encoder_ids]),
            attention_mask=torch.ones(1, len(encoder_ids), dtype=torch.long),
            output_scores=True,
            return_dict_in_generate=True,
            **extra,
            **kwargs,
        )
    start = 1 if decoder_ids is None else len(decoder_ids)
    seqs, results = out.sequences, []
    for i in range(seqs.shape[0]):
        if getattr(out, "beam_indices", None) is not None:
            n = int((out.beam_indices[i] >= 0).sum())  # generated length (rows are padded)
        else:
            n = seqs.shape[1] - start
        score = None if getattr(out, "sequences_scores", None) is None else float(out.sequences_scores[i])
        results.append((seqs[i, start : start + n].tolist(), score))
    return results


# T5-family shapes, shrunk from the real configs (sizes in each comment). Stacks of different
# depths cannot be compared: transformers 5.24's generate sizes its decoder cache by
# num_layers and fails when num_decoder_layers is larger.
T5_PAD, T5_EOS = 0, 1  # T5's ids: decoding starts from <pad>
T5_SHAPES = {
    # t5-small: d_model 512, d_kv 64, 8 heads, d_ff 2048 ReLU, 6 + 6 layers, 32 buckets up to 128, tied
    "t5-small": dict(d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2, num_decoder_layers=2,
                     relative_attention_num_buckets=32, relative_attention_max_distance=128,
                     feed_forward_proj="relu", vocab_size=96),
    # flan-t5-base: d_model 768, d_kv 64, 12 heads, d_ff 2048 gated-gelu, 12 + 12 layers, untied.
    # Fewer buckets and a short max distance here, so the prompts reach the clipped bucket.
    "flan-t5-base": dict(d_model=32, d_kv=16, num_heads=3, d_ff=48, num_layers=2, num_decoder_layers=2,
                         relative_attention_num_buckets=16, relative_attention_max_distance=24,
                         feed_forward_proj="gated-gelu", vocab_size=96),
    # mt5-small (MT5Config, MT5ForConditionalGeneration): d_model 512, d_kv 64, 6 heads (inner 384, not
    # d_model), d_ff 1024 gated-gelu, 8 + 8 layers, untied, 250112 tokens (here 640: larger than
    # the others, most of it never in a prompt, as most of mT5's vocabulary is not in any one text)
    "mt5-small": dict(d_model=32, d_kv=8, num_heads=3, d_ff=40, num_layers=2, num_decoder_layers=2,
                      relative_attention_num_buckets=32, relative_attention_max_distance=128,
                      feed_forward_proj="gated-gelu", vocab_size=640),
    # google/ul2 (T5ForConditionalGeneration): d_model 4096, d_kv 256, 16 heads, d_ff 16384
    # gated-silu (SwiGLU), 32 + 32 layers, untied
    "ul2": dict(d_model=32, d_kv=16, num_heads=2, d_ff=64, num_layers=2, num_decoder_layers=2,
                relative_attention_num_buckets=32, relative_attention_max_distance=128,
                feed_forward_proj="gated-silu", vocab_size=96),
}
T5_TIED = {"t5-small": True, "flan-t5-base": False, "mt5-small": False, "ul2": False}


def make_t5(shape: str, path: Path, seed: int = 0, calm: bool = False, **overrides) -> Path:
    """A tiny random T5-family checkpoint shaped like ``T5_SHAPES[shape]``.

    Wide weights (std 1, the embeddings 0.5, the layer norms random too, where T5 initialises
    them to ones) keep the outputs varied. ``calm``: transformers' own initialisation, which
    keeps activations and logits O(1) (a bfloat16 test); it folds the ``1/sqrt(d_kv)`` T5's
    attention leaves out into ``q`` (std ``(d_model * d_kv)**-0.5``), as trained checkpoints
    learn to, where a uniform std would leave the scores ``sqrt(d_kv)`` times too large.

    transformers 5 builds T5 and mT5 tied always; an untied checkpoint is written as the real
    flan-t5 / mt5 / ul2 ones are: ``tie_word_embeddings: false`` in its config and an
    ``lm_head.weight`` of its own, which HF then loads untied."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import MT5Config, MT5ForConditionalGeneration, T5Config, T5ForConditionalGeneration

    config_cls, model_cls = (MT5Config, MT5ForConditionalGeneration) if shape.startswith("mt5") else (
        T5Config, T5ForConditionalGeneration)
    dims = {**T5_SHAPES[shape], **overrides}
    torch.manual_seed(seed)
    config = config_cls(dropout_rate=0.0, pad_token_id=T5_PAD, eos_token_id=T5_EOS, decoder_start_token_id=T5_PAD,
                        **dims)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not calm:
                p.normal_(0.0, 0.5 if name == "shared.weight" else 1.0)
    model.save_pretrained(path)
    if not T5_TIED[shape]:
        weights = load_file(path / "model.safetensors")
        head = torch.randn(config.vocab_size, config.d_model, generator=torch.Generator().manual_seed(seed))
        weights["lm_head.weight"] = head * config.d_model**-0.5 if calm else head  # calm: O(1) logits
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
        cfg = json.loads((path / "config.json").read_text())
        cfg["tie_word_embeddings"] = False
        cfg.pop("scale_decoder_outputs", None)  # transformers 5's own field; the real checkpoints lack it
        (path / "config.json").write_text(json.dumps(cfg))
    return Path(path)


# Special ids of the tiny Whisper checkpoints, at the top of the vocabulary as in a real
# one; <|notimestamps|> is the last id, so no id is a timestamp token.
WHISPER_IDS = dict(eos=3, sot=120, en=121, de=122, fr=123, translate=124, transcribe=125, prev=126, notimestamps=127)


# A layout with Whisper's 1501 timestamp tokens after <|notimestamps|>, as in a real vocabulary.
WHISPER_TS_IDS = dict(eos=3, sot=150, en=151, de=152, fr=153, translate=154, transcribe=155, prev=156,
                      notimestamps=157)
WHISPER_TS_VOCAB = 157 + 1 + 1501


def make_whisper(path: Path, num_mel_bins: int = 80, seed: int = 0, weight_std: float = 0.5,
                 timestamps: bool = False) -> Path:
    """A tiny random Whisper checkpoint with a multilingual generation config
    (no tokenizer: prompts are audio plus token ids). ``timestamps``: the vocabulary
    holds timestamp tokens (``WHISPER_TS_IDS``); else none (``WHISPER_IDS``)."""
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    ids = WHISPER_TS_IDS if timestamps else WHISPER_IDS
    torch.manual_seed(seed)
    config = WhisperConfig(
        vocab_size=WHISPER_TS_VOCAB if timestamps else 128, num_mel_bins=num_mel_bins, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=1500, max_target_positions=64, pad_token_id=ids["eos"], bos_token_id=ids["eos"],
        eos_token_id=ids["eos"], decoder_start_token_id=ids["sot"], dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, suppress_tokens=None, begin_suppress_tokens=None,
    )
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed_positions" not in name:
                p.normal_(0.0, weight_std)
    model.save_pretrained(path)
    GenerationConfig(
        decoder_start_token_id=ids["sot"], eos_token_id=ids["eos"], pad_token_id=ids["eos"],
        bos_token_id=ids["eos"], max_length=64, is_multilingual=True,
        lang_to_id={"<|en|>": ids["en"], "<|de|>": ids["de"], "<|fr|>": ids["fr"]},
        task_to_id={"translate": ids["translate"], "transcribe": ids["transcribe"]},
        no_timestamps_token_id=ids["notimestamps"], prev_sot_token_id=ids["prev"],
        suppress_tokens=[5, 7, 11], begin_suppress_tokens=[ids["eos"], 20],
        forced_decoder_ids=None, max_initial_timestamp_index=50,
    ).save_pretrained(path)
    return Path(path)


def synth_audio(seconds: float, seed: int = 0, sr: int = 16000):
    """Float32 speech-like test audio: a few sines with a slow envelope, plus noise."""
    import numpy as np

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    x = sum(rng.uniform(0.05, 0.3) * np.sin(2 * np.pi * rng.uniform(80, 3000) * t) for _ in range(4))
    x *= 0.5 + 0.5 * np.sin(2 * np.pi * rng.uniform(0.2, 2) * t)
    x += 0.01 * rng.standard_normal(t.shape)
    return x.astype(np.float32)


@contextmanager
def installed_example(name: str, module: str, work_dir: Path, config_types: tuple[str, ...] = ()):
    """pip-install ``examples/<name>`` (a plugin package) for the block, then uninstall it;
    the plugin registries and the package's modules (and the transformers config
    types it registers) are forgotten on both sides, so every test sees the truth.

    Where the user has installed the package already (the README suggests
    ``pip install ./examples/tandem-marian``), the block uses that install and leaves it
    in place: uninstalling it would change the user's environment behind their back."""
    import importlib
    import importlib.metadata
    import shutil
    import subprocess
    import sys

    from tandem.plugins import reset_registries

    def pip(*args: str) -> None:
        subprocess.run([sys.executable, "-m", "pip", *args], check=True)

    def forget() -> None:
        from transformers import CONFIG_MAPPING

        reset_registries()
        importlib.invalidate_caches()
        for config_type in config_types:
            getattr(CONFIG_MAPPING, "_extra_content", {}).pop(config_type, None)
        for loaded in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
            del sys.modules[loaded]

    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        forget()
        try:
            yield
        finally:
            forget()
        return
    # Build from a copy so setuptools' build/ and *.egg-info never land in the source tree.
    src = work_dir / name
    shutil.copytree(EXAMPLES / name, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    pip("install", "--no-deps", "--no-build-isolation", "-q", str(src))
    forget()
    try:
        yield
    finally:
        pip("uninstall", "-y", "-q", name)
        forget()


def hub_cache(src: Path, cache: Path, repo_id: str, refs: tuple[str, ...] = ("main",), files=None) -> Path:
    """Put checkpoint directory ``src`` into a Hugging Face Hub cache at ``cache`` as
    huggingface_hub lays a download out: ``models--ORG--NAME/blobs/<sha256>`` holds each file
    once, ``snapshots/<commit>/<file>`` is a relative symlink to its blob, and each of
    ``refs/<ref>`` holds the commit hash (the content's, so two checkpoints get two commits).
    ``files``: only these of ``src`` (a partial download). Returns the snapshot directory."""
    import hashlib
    import os

    names = sorted(p.name for p in Path(src).iterdir() if p.is_file() and (files is None or p.name in files))
    digest = hashlib.sha1()
    for name in names:
        digest.update(name.encode() + (Path(src) / name).read_bytes())
    commit = digest.hexdigest()  # 40 hex digits, as a git commit hash
    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name in names:
        data = (Path(src) / name).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


# The bfloat16 bound, for every model built of O(1) activations: bfloat16 rounds
# at u = 2^-9 = 2e-3 relative; ~6 roundings of O(1) activations per layer over 2 + 2 layers
# is 24u = 0.05 on O(1) logits at worst, and a log-softmax at most doubles it: 0.1.
BF16_LOGPROB_TOL = 0.1


def hf_logprobs_float64(model_dir: Path, encoder_ids: list[int], decoder_ids: list[int]) -> torch.Tensor:
    """log_softmax of HF's next-token logits at every decoder position ``[len, vocab]``, in
    float64, so that the oracle carries no rounding of its own."""
    model = _hf_model(model_dir, torch.float64)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([encoder_ids]), decoder_input_ids=torch.tensor([decoder_ids])).logits[0]
    return torch.log_softmax(logits, -1)


def assert_bfloat16_agrees(model_dir: Path, prompts, max_tokens: int = 12, tol: float = BF16_LOGPROB_TOL,
                           stop_after: int | None = None) -> float:
    """test_sampling's bfloat16 check on ``model_dir`` (the generation config set aside, so the
    log-probabilities are the model's own): sampled bfloat16 tokens' log-probabilities within
    ``tol`` of the float64 oracle; greedy bfloat16 tokens equal to float32's wherever the
    oracle's top two are further apart than ``2 * tol`` (after the first step that is not,
    the sequences may part). ``stop_after``: a token after which the oracle's one forward pass
    no longer numbers positions as decoding does (M2M100's <pad>, whose position HF's full
    forward skips and its generate counts): each sequence is compared up to it, it included.
    Returns the largest log-probability error seen."""
    from tandem import LLM, SamplingParams

    bf = LLM(model=str(model_dir), dtype="bfloat16", device="cpu", generation_config="none")
    assert bf.engine.kv_caches[0].dtype == torch.bfloat16
    sampled = bf.generate(prompts, SamplingParams(temperature=1.0, seed=3, max_tokens=max_tokens, logprobs=0),
                          use_tqdm=False)
    worst = 0.0
    for o in sampled:
        assert o.error is None, o.error
        c = o.outputs[0]
        ref = hf_logprobs_float64(model_dir, o.encoder_prompt_token_ids, o.prompt_token_ids + c.token_ids)
        start = len(o.prompt_token_ids) - 1
        for j, t in enumerate(_upto(c.token_ids, stop_after)):
            err = abs(c.logprobs[j][t] - float(ref[start + j, t]))
            worst = max(worst, err)
            assert err <= tol, (o.encoder_prompt_token_ids, j, t, err)
    greedy = SamplingParams(temperature=0.0, num_beams=1, max_tokens=max_tokens)
    f32 = LLM(model=str(model_dir), dtype="float32", device="cpu", generation_config="none")
    compared = 0
    for a, b in zip(f32.generate(prompts, greedy, use_tqdm=False), bf.generate(prompts, greedy, use_tqdm=False)):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        ref = hf_logprobs_float64(model_dir, a.encoder_prompt_token_ids, a.prompt_token_ids + ta)
        start = len(a.prompt_token_ids) - 1
        for j in range(min(len(_upto(ta, stop_after)), len(tb))):
            top2 = ref[start + j].topk(2).values
            if float(top2[0] - top2[1]) <= 2 * tol:
                break
            assert tb[j] == ta[j], (a.encoder_prompt_token_ids, j)
            compared += 1
    assert compared >= len(prompts)  # the check is not vacuous
    return worst


def _upto(tokens: list[int], stop_after: int | None) -> list[int]:
    return tokens[: tokens.index(stop_after) + 1] if stop_after in tokens else tokens


def speechlike_audio(seconds: float, seed: int = 0, sr: int = 16000, f0: float = 130.0):
    """Float32 audio Silero VAD hears as speech (~95% of its frames above 0.5): syllables
    of a voiced source (40 harmonics of a falling pitch) shaped by one of six vowels'
    three formants, each after a 50 ms high-passed noise burst (a consonant), with
    60 ms pauses. Seeded; ``seconds`` long."""
    import numpy as np

    vowels = [(730, 1090, 2440), (270, 2290, 3010), (300, 870, 2240), (530, 1840, 2480), (640, 1190, 2390),
              (490, 1350, 1690)]
    rng = np.random.default_rng(seed)
    parts, total = [], 0
    while total < seconds * sr:
        n = int(0.15 * sr)
        t = np.arange(n) / sr
        phase = np.cumsum(2 * np.pi * f0 * (1 + 0.15 * (rng.random() - 0.5) - 0.1 * t / 0.15) / sr)
        source = sum(np.sin(k * phase) / k for k in range(1, 40))
        f = np.fft.rfftfreq(n, 1 / sr)
        envelope = sum(1 / (1 + ((f - F) / (60 + 0.05 * F)) ** 2) for F in vowels[rng.integers(len(vowels))])
        vowel = np.fft.irfft(np.fft.rfft(source) * envelope, n) * np.hanning(n)
        m = int(0.05 * sr)
        burst = np.fft.irfft(np.fft.rfft(rng.standard_normal(m)) * (np.fft.rfftfreq(m, 1 / sr) > 3000), m)
        burst *= np.hanning(m)
        parts += [0.3 * burst / np.abs(burst).max(), vowel / np.abs(vowel).max(), np.zeros(int(0.06 * sr))]
        total += m + n + int(0.06 * sr)
    return (0.3 * np.concatenate(parts)[: int(seconds * sr)]).astype(np.float32)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has exited); Linux's /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def count_audio_reads(monkeypatch) -> list:
    """Record the frames of every ``soundfile`` read from now on (a list the caller
    checks): empty means no audio was decoded."""
    import soundfile as sf

    reads: list = []
    original = sf.SoundFile.read

    def counting_read(self, frames=-1, *args, **kwargs):
        out = original(self, frames, *args, **kwargs)
        reads.append(len(out))
        return out

    monkeypatch.setattr(sf.SoundFile, "read", counting_read)
    return reads


async def final_output(engine, prompt, params, request_id=None):
    """The last output ``AsyncLLM.generate`` yields for one request (the finished one)."""
    last = None
    async for out in engine.generate(prompt, params, request_id):
        last = out
    return last


# Compiled decode-step tests (test_compiled_step.py, test_piecewise_step.py, the GPU
# CUDA-graph test): prompts of 3-5 tokens, and greedy requests of exactly n tokens each,
# so the decode batch shrinks as the shortest finish.
def step_prompts(n: int) -> list[dict]:
    return [{"prompt_token_ids": [5 + i, 9, 11 + 2 * i, 7, 13, 6 + i][: 3 + i % 3]} for i in range(n)]


def exact_length_greedy(lengths) -> list:
    from tandem import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n) for n in lengths]


def first_tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def count_flash_calls(monkeypatch) -> list[bool]:
    """Each encoder attention call that reaches cpu_flash from now on appends whether its
    bf16 flash op served it (False: SDPA did)."""
    from tandem.backends.cpu_flash import encoder

    calls, real = [], encoder.attend

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(encoder, "attend", counting)
    return calls
