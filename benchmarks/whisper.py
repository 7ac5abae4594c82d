"""Whisper throughput: tandem against HuggingFace transformers (and CTranslate2).

Every engine gets the same checkpoint and the same clips in one run, and the
script prints audio seconds transcribed per wall-clock second for each, with
the ratio to HF.

Workload: ``--num-clips`` clips (default 16) of 30 s of synthetic, seeded
speech-like audio at 16 kHz (voiced "syllables": a few harmonics of a gliding
pitch under a syllable-rate envelope, plus a hum and noise; nothing is
downloaded). Every clip decodes exactly ``--new-tokens`` tokens (default 64,128:
a row per count; 128 is realistic speech, which runs 100-150 tokens per 30 s)
after the prompt ``<|startoftranscript|> <|en|> <|transcribe|>
<|notimestamps|>``, greedy:

  tandem   ``llm.transcribe(clips, language="en", max_tokens=T, min_tokens=T,
           temperature=0.0)``, one call for all clips (its log-mel runs inside
           the engine, so it is on the clock).
  hf       ``WhisperFeatureExtractor`` on each batch of ``--hf-batch-size``
           clips (default 16) and ``WhisperForConditionalGeneration.generate(
           input_features, language="en", task="transcribe",
           max_new_tokens=T, min_new_tokens=T)``; feature extraction is on the
           clock.
  ct2      CTranslate2's ``ctranslate2.models.Whisper`` (the engine under
           faster-whisper) on a conversion of the same checkpoint, fed the
           same batches: features from faster-whisper's ``FeatureExtractor``
           per clip (``WhisperFeatureExtractor`` when faster-whisper is not
           installed), on the clock, then ``generate(features, prompts,
           beam_size=1, max_length=2 * T)`` (CTranslate2 decodes at most
           ``max_length // 2`` tokens after the prompt, as openai-whisper's
           ``sample_len = n_text_ctx // 2``) with EOS added to
           ``suppress_tokens`` (it has no minimum length), so it too decodes
           exactly T tokens (T <= 224). One row per compute type of
           ``--ct2-compute-types`` (default: ``--dtype`` and int8); a type the
           CPU build lacks (bfloat16 on CPU) is skipped with a note.

Each row's engine runs in a long-lived process of its own
(benchmarks/engine_procs.py: loaded once, thread settings in its environment
before any library loads, timed inside that process, one engine at a time, the
next started only once the last one's threads have gone idle), as
benchmarks/throughput.py does; ``--in-process`` runs them all in this process.
A row whose engine fails to load or dies is a FAILED row with its error.

All three apply the checkpoint's ``suppress_tokens`` and suppress
``begin_suppress_tokens`` at the first position (CTranslate2 through
``suppress_blank``, from the converted config). Throughput is audio seconds
(30 per clip) / wall seconds around the call(s) that serve all clips, after
loading every engine and a warm-up on two other clips (``--repeats R``: R
interleaved rounds, each running every token count on every engine in turn;
the best and the median reported, every run in the JSON). A tandem row's "best
peer" is the fastest other engine at the same token count (for tandem: among
the ``--dtype`` rows; for tandem int8: among all, HF having no int8). The
"same as HF" column counts clips whose tokens equal HF's: a sanity check, not a
parity test (int8 and bfloat16 change argmaxes).

tandem's encoder share: the same clips are run again with ``max_tokens=1``
(the encoder, the decoder prompt and one token per clip), once in each round,
and ``encoder share = t(1 token) / t(full)`` is printed per token count (with
``--repeats`` > 1 also from the fastest run of each): the part of tandem's time
that is encoder work (plus log-mel and one decoder step), the rest being the
``T - 1`` further decoder steps.

Examples (from the repository root):

  # quick check: random whisper-tiny-sized model, 4 clips
  python benchmarks/whisper.py --size tiny --num-clips 4

  # random whisper-base-sized model, bfloat16, all engines
  python benchmarks/whisper.py --size base --num-clips 8 --new-tokens 32 \\
      --dtype bfloat16 --engines tandem,hf,ct2

Without ``--model`` a seeded random ``WhisperForConditionalGeneration`` is built
(``--size tiny``: d_model 384, 4+4 layers, 6 heads, FFN 1536; ``base``: d_model
512, 6+6 layers, 8 heads, FFN 2048; both vocab 51865 with multilingual
Whisper's special-token layout, 80 mel bins, 448 decoder positions) and saved
with ``save_pretrained`` (plus a generation_config.json with ``lang_to_id``,
``task_to_id``, ``no_timestamps_token_id`` and ``suppress_tokens``, and a
``WhisperTokenizer`` of the same layout built offline by
``tandem.demo_whisper.tokenizer``, so a ``--save-model`` checkpoint decodes
text in ``tandem transcribe``, ``LLM.transcribe`` and ``tandem serve``) to a
temporary directory (or ``--save-model DIR``). The CTranslate2 converter gets
a stand-in tokenizer naming each id.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # noqa: E402  (cpu_flags, available-engine import logic)

REPO_ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("tandem", "hf", "ct2")
SAMPLING_RATE = 16000
CLIP_SECONDS = 30.0

# Random Whisper checkpoints (--size). Shared: vocab 51865, 80 mel bins,
# 1500 encoder positions, 448 decoder positions.
MODEL_SIZES = {
    "tiny": dict(d_model=384, encoder_layers=4, decoder_layers=4,
                 encoder_attention_heads=6, decoder_attention_heads=6,
                 encoder_ffn_dim=1536, decoder_ffn_dim=1536),
    "base": dict(d_model=512, encoder_layers=6, decoder_layers=6,
                 encoder_attention_heads=8, decoder_attention_heads=8,
                 encoder_ffn_dim=2048, decoder_ffn_dim=2048),
}
VOCAB_SIZE = 51865


def special_ids() -> dict:
    """Multilingual Whisper's (v1/v2) layout of a 51865-token vocabulary: text ids
    below 50257, then <|endoftext|>, <|startoftranscript|>, 99 languages, the task
    and control tokens, <|notimestamps|> = 50363 and 1501 timestamp tokens up to the
    end of the vocabulary."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    eot = 50257
    langs = list(LANGUAGES)[:99]
    first_lang = eot + 2
    after = first_lang + len(langs)
    return dict(
        eot=eot, sot=eot + 1,
        lang_to_id={f"<|{code}|>": first_lang + i for i, code in enumerate(langs)},
        translate=after, transcribe=after + 1, startoflm=after + 2,
        startofprev=after + 3, nospeech=after + 4, notimestamps=after + 5,
    )


@dataclass
class Result:
    engine: str
    clips: int
    tokens_per_clip: int
    seconds: float
    load_seconds: float
    audio_seconds: float
    all_seconds: list[float] = field(default_factory=list)  # every timed run; seconds = median
    audio_s_per_s: float = 0.0  # from the median run
    best_audio_s_per_s: float = 0.0  # from the fastest run
    ratio_vs_hf: float | None = None
    best_peer: str = ""  # tandem rows: the fastest other engine (see compare)
    ratio_vs_peer_best: float | None = None
    ratio_vs_peer: float | None = None
    same_as_hf: int | None = None
    note: str = ""
    pid: int = 0  # the process the engine ran in
    error: str = ""  # the engine failed (to load, or in a run): why; no figures then
    outputs: list[list[int]] = field(default_factory=list, repr=False)


# --------------------------------------------------------------------------
# Checkpoint and audio
# --------------------------------------------------------------------------


def make_model(size: str, out_dir: str, seed: int) -> str:
    """Build a seeded random WhisperForConditionalGeneration and save it, with a
    multilingual generation config, a feature-extractor config and a tokenizer."""
    from transformers import (GenerationConfig, WhisperConfig, WhisperFeatureExtractor,
                              WhisperForConditionalGeneration)

    from tandem.demo_whisper.tokenizer import build_whisper_tokenizer, save_whisper_tokenizer

    ids = special_ids()
    config = WhisperConfig(
        **MODEL_SIZES[size], vocab_size=VOCAB_SIZE, num_mel_bins=80,
        max_source_positions=1500, max_target_positions=448,
        pad_token_id=ids["eot"], bos_token_id=ids["eot"], eos_token_id=ids["eot"],
        decoder_start_token_id=ids["sot"], dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, suppress_tokens=None, begin_suppress_tokens=None,
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).eval()
    model.save_pretrained(out_dir)
    # Like the real checkpoints: ~90 suppressed ids (punctuation-like text ids,
    # here seeded random ones) plus the task/control tokens.
    rng = random.Random(f"{seed}-suppress")
    suppress = sorted(rng.sample(range(1, ids["eot"]), 83)) + [
        ids["translate"], ids["transcribe"], ids["startoflm"], ids["startofprev"], ids["nospeech"]]
    GenerationConfig(
        decoder_start_token_id=ids["sot"], eos_token_id=ids["eot"], pad_token_id=ids["eot"],
        bos_token_id=ids["eot"], max_length=448, is_multilingual=True,
        lang_to_id=ids["lang_to_id"],
        task_to_id={"translate": ids["translate"], "transcribe": ids["transcribe"]},
        no_timestamps_token_id=ids["notimestamps"], prev_sot_token_id=ids["startofprev"],
        suppress_tokens=suppress, begin_suppress_tokens=[220, ids["eot"]],
        forced_decoder_ids=None,
    ).save_pretrained(out_dir)
    WhisperFeatureExtractor(feature_size=80).save_pretrained(out_dir)
    save_whisper_tokenizer(build_whisper_tokenizer([], languages=[c.strip("<|>") for c in ids["lang_to_id"]],
                                                   text_vocab_size=ids["eot"]), out_dir)
    return out_dir


def synth_speech(seconds: float, seed: int, sr: int = SAMPLING_RATE) -> np.ndarray:
    """Float32 speech-like audio: "syllables" of 3-5 harmonics of a gliding pitch
    (80-260 Hz) under a raised-sine envelope at 2-6 syllables/s with short pauses,
    a band of sines at formant-like frequencies, a faint hum and noise. Seeded."""
    rng = np.random.default_rng(seed)
    n = int(seconds * sr)
    t = np.arange(n) / sr
    x = np.zeros(n)
    pos = 0
    while pos < n:
        length = int(sr * rng.uniform(0.15, 0.5))
        seg = np.arange(min(length, n - pos)) / sr
        f0 = rng.uniform(80, 260) * (1 + rng.uniform(-0.15, 0.15) * seg / max(seg[-1], 1e-3))
        phase = 2 * np.pi * np.cumsum(f0) / sr
        voiced = sum(rng.uniform(0.2, 1.0) / k * np.sin(k * phase) for k in range(1, rng.integers(3, 6) + 1))
        formants = sum(rng.uniform(0.02, 0.1) * np.sin(2 * np.pi * rng.uniform(300, 3000) * seg + rng.uniform(0, 6.3))
                       for _ in range(2))
        env = np.sin(np.pi * np.arange(len(seg)) / max(len(seg), 1)) ** 2
        x[pos:pos + len(seg)] = rng.uniform(0.05, 0.3) * env * (voiced + formants)
        pos += len(seg) + int(sr * rng.choice([0.0, 0.05, 0.3], p=[0.5, 0.35, 0.15]))
    x += 0.01 * np.sin(2 * np.pi * 50 * t) + 0.005 * rng.standard_normal(n)
    return x.astype(np.float32)


def make_clips(num: int, seed: int) -> list[np.ndarray]:
    return [synth_speech(CLIP_SECONDS, seed=seed * 100_003 + i) for i in range(num)]


def prompt_ids(model_dir: str) -> list[int]:
    """<|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|> from the
    checkpoint's generation config."""
    from transformers import GenerationConfig

    g = GenerationConfig.from_pretrained(model_dir)
    return [g.decoder_start_token_id, g.lang_to_id["<|en|>"], g.task_to_id["transcribe"],
            g.no_timestamps_token_id]


# --------------------------------------------------------------------------
# Engines. Each runner: __init__ loads, run(clips, new_tokens) -> list of ids.
# --------------------------------------------------------------------------


class TandemRunner:
    name = "tandem"

    def __init__(self, model_dir: str, args, quantization: str | None = None):
        from tandem import LLM

        extra = {key: getattr(args, key) for key in ("max_num_seqs", "max_num_batched_tokens",
                                                     "kv_cache_memory", "attention_backend")
                 if getattr(args, key) is not None}
        # int8 computes in float32 (tandem refuses int8 with a 16-bit dtype).
        dtype = "float32" if quantization else args.dtype
        # encoder_cache_blocks=0: a repeat (or the 1-token run of the encoder share) on the
        # same clips must compute their encoder again, as HF and CTranslate2 do.
        self.llm = LLM(model=model_dir, dtype=dtype, device=args.device, seed=args.seed,
                       quantization=quantization, encoder_cache_blocks=0, **extra)
        if quantization:
            self.name = f"tandem {quantization}"

    def run(self, clips, new_tokens: int) -> list[list[int]]:
        inputs = [{"audio": c, "sampling_rate": SAMPLING_RATE} for c in clips]
        outs = self.llm.transcribe(inputs, language="en", use_tqdm=False, temperature=0.0,
                                   max_tokens=new_tokens, min_tokens=new_tokens)
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RuntimeError(f"tandem: {len(errors)} clips failed, first: {errors[0]}")
        return [list(o.token_ids) for o in outs]


class HFRunner:
    name = "hf"

    def __init__(self, model_dir: str, args):
        from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

        self.device = torch.device(args.device)
        self.dtype = getattr(torch, args.dtype)
        self.model = WhisperForConditionalGeneration.from_pretrained(
            model_dir, dtype=self.dtype).to(self.device).eval()
        self.features = WhisperFeatureExtractor(feature_size=self.model.config.num_mel_bins)
        self.batch_size = args.hf_batch_size
        self.prompt_len = len(prompt_ids(model_dir))

    def run(self, clips, new_tokens: int) -> list[list[int]]:
        outputs = []
        with torch.inference_mode():
            for start in range(0, len(clips), self.batch_size):
                batch = clips[start:start + self.batch_size]
                feats = self.features(batch, sampling_rate=SAMPLING_RATE, return_tensors="pt").input_features
                seqs = self.model.generate(
                    feats.to(self.device, self.dtype), language="en", task="transcribe",
                    max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, num_beams=1)
                for row in seqs.tolist():
                    # generate returns the new tokens (older transformers: the
                    # decoder prompt too): keep the last new_tokens.
                    outputs.append(row[-new_tokens:] if len(row) >= new_tokens else row)
        return outputs


class CT2Runner:
    """CTranslate2's Whisper, converted from the same checkpoint with a stand-in
    tokenizer (one name per id, Whisper's names for the special ids)."""

    name = "ct2"

    def __init__(self, model_dir: str, args, compute_type: str, converted_dir: str):
        import ctranslate2

        self.model = ctranslate2.models.Whisper(
            converted_dir, device=args.device, compute_type=compute_type,
            inter_threads=1, intra_threads=torch.get_num_threads())
        self.name = f"ct2 {compute_type}"
        self.prompt = prompt_ids(model_dir)
        self.batch_size = args.hf_batch_size
        from transformers import GenerationConfig

        g = GenerationConfig.from_pretrained(model_dir)
        # CTranslate2's Whisper has no minimum length: suppress EOS to decode
        # exactly max_length tokens, as min_tokens / min_new_tokens do.
        self.suppress = sorted(set(g.suppress_tokens or []) | {g.eos_token_id})
        n_mels = load_config(model_dir).num_mel_bins
        try:
            from faster_whisper.feature_extractor import FeatureExtractor

            fe = FeatureExtractor(feature_size=n_mels)
            self.features_from = "faster_whisper.FeatureExtractor"
            self._features = lambda batch: np.stack([fe(c)[:, :3000] for c in batch])
        except ImportError:
            from transformers import WhisperFeatureExtractor

            hf_fe = WhisperFeatureExtractor(feature_size=n_mels)
            self.features_from = "transformers.WhisperFeatureExtractor"
            self._features = lambda batch: hf_fe(batch, sampling_rate=SAMPLING_RATE,
                                                 return_tensors="np").input_features

    def run(self, clips, new_tokens: int) -> list[list[int]]:
        import ctranslate2

        outputs = []
        for start in range(0, len(clips), self.batch_size):
            batch = clips[start:start + self.batch_size]
            feats = ctranslate2.StorageView.from_array(
                np.ascontiguousarray(self._features(batch), dtype=np.float32))
            # max_length: CTranslate2 decodes max_length // 2 new tokens at
            # most (checked: 2 * T gives exactly T with EOS suppressed).
            results = self.model.generate(
                feats, [self.prompt] * len(batch), beam_size=1,
                max_length=2 * new_tokens, suppress_tokens=self.suppress,
                suppress_blank=True)
            outputs += [list(r.sequences_ids[0]) for r in results]
        return outputs


def ct2_vocabulary(model_dir: str) -> list[str]:
    """A name per id: Whisper's names for the special ids of the generation config
    (CTranslate2 finds <|startoftranscript|>, <|endoftext|>, <|notimestamps|>... by
    name), <|t.tt|> for the timestamp ids after <|notimestamps|>, tok<i> otherwise."""
    from transformers import GenerationConfig

    config = load_config(model_dir)
    g = GenerationConfig.from_pretrained(model_dir)
    names = {g.eos_token_id: "<|endoftext|>", g.decoder_start_token_id: "<|startoftranscript|>"}
    names.update({i: tok for tok, i in (g.lang_to_id or {}).items()})
    names.update({i: f"<|{task}|>" for task, i in (g.task_to_id or {}).items()})
    nts = g.no_timestamps_token_id
    if nts is not None:
        names[nts] = "<|notimestamps|>"
        for offset, name in ((1, "<|nospeech|>"), (2, "<|startofprev|>"), (3, "<|startoflm|>")):
            names.setdefault(nts - offset, name)
        for i in range(nts + 1, config.vocab_size):
            names.setdefault(i, "<|%.2f|>" % ((i - nts - 1) * 0.02))
    return [names.get(i, f"tok{i}") for i in range(config.vocab_size)]


def ct2_convert(model_dir: str, out_dir: str) -> None:
    from ctranslate2.converters import TransformersConverter

    tokens = ct2_vocabulary(model_dir)

    class _Tokenizer:
        def get_vocab(self):
            return {t: i for i, t in enumerate(tokens)}

        def convert_ids_to_tokens(self, i):
            return tokens[i]

    class Converter(TransformersConverter):
        def load_tokenizer(self, tokenizer_class, model_name_or_path, **kwargs):
            return _Tokenizer()

    Converter(model_dir).convert(out_dir, force=True)


def load_config(model_dir: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------


class WhisperHost:
    """One row's engine (tandem, tandem int8, hf, ct2 <type>), loaded once: what each
    row's own process holds (benchmarks/engine_procs.py). The clips are sent once
    (``keep``) and ``timed`` times the engine's call here, off the pipe."""

    def __init__(self, engine: str, model_dir: str, args, option: str | None = None,
                 converted_dir: str | None = None):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # as main() does, in this process too
        hf_logging.set_verbosity_error()
        if args.threads:
            torch.set_num_threads(args.threads)
        if engine == "tandem":
            self.runner = TandemRunner(model_dir, args, quantization=option)
        elif engine == "hf":
            self.runner = HFRunner(model_dir, args)
        else:
            self.runner = CT2Runner(model_dir, args, option, converted_dir)
        self.clips: dict[str, list] = {}

    def info(self) -> dict:
        return {"name": self.runner.name, "pid": os.getpid(),
                "features_from": getattr(self.runner, "features_from", None)}

    def keep(self, key: str, clips) -> None:
        self.clips[key] = clips

    def timed(self, key: str, new_tokens: int):
        gc.collect()
        start = time.perf_counter()
        out = self.runner.run(self.clips[key], new_tokens)
        return out, time.perf_counter() - start

    def stats(self) -> dict:
        return self.runner.llm.get_stats()


def load_runners(model_dir, args, engines: list[str]) -> tuple[list[tuple[object, float, dict]], dict, object]:
    """Every row's engine loaded at once, each in a process of its own (here with
    ``--in-process``), so the rounds can interleave them: (handle, load seconds, info)
    per row, row name -> error for rows that failed to load, and the CTranslate2
    conversion's directory (cleanup() it). A CTranslate2 compute type the build lacks
    is skipped with a note."""
    import engine_procs

    rows: list[tuple[str, str, str | None, str | None]] = []  # (name, engine, option, converted dir)
    converted, failed, convert_seconds = None, {}, 0.0
    for engine in engines:
        if engine == "tandem":
            rows += [("tandem" if q is None else f"tandem {q}", engine, q, None)
                     for q in ((None, "int8") if args.tandem_int8 else (None,))]
        elif engine == "hf":
            rows.append(("hf", engine, None, None))
        else:
            try:  # the conversion and the compute-type check only; the model loads in its process
                import ctranslate2

                supported = ctranslate2.get_supported_compute_types(args.device)
                for t in args.ct2_compute_types:
                    if t not in supported:
                        print(f"note: skipping ct2 {t}: CTranslate2 {ctranslate2.__version__} has no {t} "
                              f"on {args.device} (supported: {', '.join(sorted(supported))})")
                wanted = [t for t in args.ct2_compute_types if t in supported]
                if not wanted:
                    continue
                converted = tempfile.TemporaryDirectory(prefix="tandem-bench-ct2-whisper-")
                start = time.perf_counter()
                ct2_convert(model_dir, converted.name)
                convert_seconds = time.perf_counter() - start
                rows += [(f"ct2 {t}", engine, t, converted.name) for t in wanted]
            except Exception as exc:  # CTranslate2 failing should not hide the others
                failed["ct2"] = f"{type(exc).__name__}: {exc}"
                print(f"note: ct2 failed: {failed['ct2']}")
    runners = []
    for name, engine, option, converted_dir in rows:
        try:
            handle = engine_procs.start(name, "whisper:WhisperHost", engine, model_dir, args, option,
                                        converted_dir, in_process=args.in_process,
                                        env=engine_procs.thread_env(args.threads or torch.get_num_threads()))
            info = handle.call("info")
        except engine_procs.EngineFailed as exc:
            print(f"note: {name} failed to load: {exc}", flush=True)
            failed[name] = str(exc)
            continue
        extra = convert_seconds if engine == "ct2" else 0.0
        runners.append((handle, handle.load_seconds + extra, info))
        print(f"{name}: loaded in {handle.load_seconds + extra:.1f} s, pid {info['pid']}", flush=True)
    return runners, failed, converted


def run_rounds(runners, clips, warmup, args, failed: dict[str, str] | None = None) -> tuple[list[Result], dict]:
    """``--repeats`` rounds; in each, every token count of ``--new-tokens`` and, for
    each, every engine in turn (then tandem's 1-token run), so that a slow spell on a
    shared machine lands on all of them. Each row reports the best and the median.
    A row whose engine fails (``failed``: name -> error, filled here too) is a FAILED row."""
    import engine_procs

    failed = {} if failed is None else failed

    def call(handle, name, method, *a):
        if name in failed:
            return None
        try:
            return handle.call(method, *a)
        except engine_procs.EngineFailed as exc:
            print(f"note: {name} failed: {exc}", flush=True)
            failed[name] = str(exc)
            return None

    for handle, _, info in runners:
        call(handle, info["name"], "keep", "clips", clips)
        call(handle, info["name"], "keep", "warmup", warmup)
        call(handle, info["name"], "timed", "warmup", min(4, max(args.new_tokens)))
    times: dict[tuple[str, int], list[float]] = {}
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    one_times, one_out = [], []
    tandem = next((h for h, _, info in runners if info["name"] == "tandem"), None)
    for round_ in range(1, args.repeats + 1):
        for n in args.new_tokens:
            for handle, _, info in runners:
                name = info["name"]
                got = call(handle, name, "timed", "clips", n)
                if got is None:
                    continue
                out, seconds = got
                times.setdefault((name, n), []).append(seconds)
                outputs.setdefault((name, n), out)
                print(f"  {name:<12} {n:4d} tokens/clip {seconds:8.2f} s  "
                      f"{CLIP_SECONDS * len(clips) / seconds:8.2f} audio s/s  "
                      f"(round {round_}/{args.repeats}, pid {info['pid']})", flush=True)
        if tandem is not None:
            got = call(tandem, "tandem", "timed", "clips", 1)
            if got is not None:
                one_out, seconds = got
                one_times.append(seconds)
    load = {info["name"]: s for _, s, info in runners}
    results = [make_result(name, clips, n, times[(name, n)], outputs[(name, n)], load[name])
               for n in args.new_tokens for name in load if name not in failed]
    results += [Result(engine=name, clips=len(clips), tokens_per_clip=n, seconds=float("nan"),
                       load_seconds=load.get(name, float("nan")), audio_seconds=CLIP_SECONDS * len(clips),
                       error=error)
                for n in args.new_tokens for name, error in failed.items()]
    features = {info["name"]: info["features_from"] for _, _, info in runners if info["features_from"]}
    pids = {info["name"]: info["pid"] for _, _, info in runners}
    for r in results:
        r.pid = pids.get(r.engine, 0)
        if r.engine in features:
            r.note = f"features: {features[r.engine]}"
    shares = {}
    if tandem is not None and "tandem" not in failed:
        make_result("tandem 1-tok", clips, 1, one_times, one_out, load["tandem"])
        for n in args.new_tokens:
            full = times[("tandem", n)]
            shares[n] = {"seconds_full": statistics.median(full),
                         "seconds_1_token": statistics.median(one_times),
                         "encoder_share": statistics.median(one_times) / statistics.median(full),
                         "seconds_full_all": full, "seconds_1_token_all": one_times,
                         "encoder_share_fastest": min(one_times) / min(full)}
        stats = call(tandem, "tandem", "stats")
        if stats is not None:
            shares["stats"] = stats
    return results, shares


def make_result(name, clips, new_tokens, times, outputs, load_seconds) -> Result:
    seconds = statistics.median(times)
    short = [i for i, out in enumerate(outputs) if len(out) != new_tokens]
    if short:
        print(f"warning: {name}: {len(short)} clips did not decode exactly {new_tokens} tokens "
              f"(first: clip {short[0]}, {len(outputs[short[0]])} tokens)", file=sys.stderr)
    audio = CLIP_SECONDS * len(clips)
    return Result(engine=name, clips=len(clips), tokens_per_clip=new_tokens, seconds=seconds,
                  load_seconds=load_seconds, audio_seconds=audio, audio_s_per_s=audio / seconds,
                  best_audio_s_per_s=audio / min(times), all_seconds=times, outputs=outputs)


def compare(results: list[Result]) -> None:
    """Ratios per token count: to HF (median), and for tandem rows to the best peer
    (the fastest non-tandem row: any peer for tandem int8, where HF has no int8;
    only peers at ``--dtype`` for tandem), from the best and from the median figures."""
    for n in {r.tokens_per_clip for r in results}:
        rows = [r for r in results if r.tokens_per_clip == n and not r.error]
        hf = next((r for r in rows if r.engine == "hf"), None)
        peers = [r for r in rows if not r.engine.startswith("tandem")]
        for r in rows:
            if hf is not None:
                r.ratio_vs_hf = r.audio_s_per_s / hf.audio_s_per_s
                r.same_as_hf = sum(a == b for a, b in zip(r.outputs, hf.outputs))
            if not r.engine.startswith("tandem"):
                continue
            same = peers if r.engine.endswith("int8") else [p for p in peers if not p.engine.endswith("int8")]
            if same:
                best = max(same, key=lambda p: p.best_audio_s_per_s)
                median = max(same, key=lambda p: p.audio_s_per_s)
                r.best_peer = f"{best.engine}" if best is median else f"{best.engine} / {median.engine}"
                r.ratio_vs_peer_best = r.best_audio_s_per_s / best.best_audio_s_per_s
                r.ratio_vs_peer = r.audio_s_per_s / median.audio_s_per_s


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_table(results: list[Result]) -> str:
    header = ("engine", "clips", "tokens/clip", "rounds", "s best", "s median", "audio s/s best",
              "audio s/s median", "vs HF", "best peer", "vs peer best", "vs peer median", "same as HF")
    rows = [header]
    for r in sorted(results, key=lambda r: r.tokens_per_clip):
        if r.error:
            error = r.error.splitlines()[0]
            error = error if len(error) <= 90 else error[:87] + "..."
            rows.append((r.engine, str(r.clips), str(r.tokens_per_clip), "FAILED: " + error)
                        + ("-",) * (len(header) - 4))
            continue
        rows.append((
            r.engine, str(r.clips), str(r.tokens_per_clip), str(len(r.all_seconds)),
            f"{min(r.all_seconds):.2f}", f"{r.seconds:.2f}", f"{r.best_audio_s_per_s:.2f}",
            f"{r.audio_s_per_s:.2f}", _ratio(r.ratio_vs_hf), r.best_peer or "-",
            _ratio(r.ratio_vs_peer_best), _ratio(r.ratio_vs_peer),
            "-" if r.same_as_hf is None else f"{r.same_as_hf}/{r.clips}",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for n, row in enumerate(rows):
        cells = [c.ljust(w) if i < 1 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def environment(args, config, model_dir: str) -> dict:
    import transformers

    env = {
        "model": model_dir if args.model else f"random whisper ({args.size})",
        "d_model": config.d_model,
        "layers": [config.encoder_layers, config.decoder_layers],
        "heads": config.encoder_attention_heads,
        "vocab_size": config.vocab_size,
        "num_mel_bins": config.num_mel_bins,
        "clips": args.num_clips,
        "clip_seconds": CLIP_SECONDS,
        "new_tokens": args.new_tokens,
        "load_avg": "/".join(f"{x:.2f}" for x in os.getloadavg()),
        "dtype": args.dtype,
        "device": args.device,
        "torch_threads": torch.get_num_threads(),
        "hf_batch_size": args.hf_batch_size,
        "repeats": args.repeats,
        "seed": args.seed,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_flags": throughput.cpu_flags(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "load_avg_1min": round(os.getloadavg()[0], 2),
    }
    from importlib.metadata import version

    for module in ("ctranslate2", "faster_whisper"):
        try:  # not imported here: the engines' libraries load in their own processes
            env[module] = version(module.replace("_", "-"))
        except ImportError:
            pass
    env["engine_processes"] = not args.in_process
    return env


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("checkpoint")
    src.add_argument("--model", help="local Whisper checkpoint directory (with generation_config.json)")
    src.add_argument("--size", choices=sorted(MODEL_SIZES), default="tiny",
                     help="size of the random checkpoint built when --model is not given (default: tiny)")
    src.add_argument("--save-model", metavar="DIR",
                     help="save the random checkpoint (with its tokenizer) here instead of a temp dir")

    run = p.add_argument_group("run")
    run.add_argument("--num-clips", type=int, default=16, help="30 s clips (default: 16)")
    run.add_argument("--new-tokens", default="64,128",
                     help="tokens decoded per clip, exactly; a comma list gives a row per count "
                          "(default: 64,128: 128 is realistic speech, 100-150 tokens per 30 s)")
    run.add_argument("--engines", default="tandem,hf,ct2",
                     help=f"comma list from {','.join(ENGINES)} (default: all; ct2 is skipped "
                          "with a note when ctranslate2 is not installed)")
    run.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    run.add_argument("--device", default="cpu")
    run.add_argument("--threads", type=int, help="torch.set_num_threads (and CTranslate2 intra_threads)")
    run.add_argument("--repeats", type=int, default=1,
                     help="interleaved rounds (engines taking turns); the best and the median "
                          "are reported (default: 1)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--in-process", action="store_true",
                     help="load and run every engine in this one process (the old way) instead of "
                          "each in a process of its own")
    run.add_argument("--json", metavar="PATH", help="also write results as JSON")

    hf = p.add_argument_group("HF / CTranslate2")
    hf.add_argument("--hf-batch-size", type=int, default=16,
                    help="clips per HF generate call and per CTranslate2 generate call (default: 16)")
    hf.add_argument("--ct2-compute-types",
                    help="comma list of CTranslate2 compute types (default: --dtype,int8); "
                         "types the build lacks are skipped with a note")

    td = p.add_argument_group("tandem (passed to LLM only when given)")
    td.add_argument("--max-num-seqs", type=int)
    td.add_argument("--max-num-batched-tokens", type=int)
    td.add_argument("--kv-cache-memory", type=float, help="GiB")
    td.add_argument("--attention-backend")
    td.add_argument("--tandem-int8", action="store_true",
                    help="also a 'tandem int8' row: quantization='int8' (float32 around it)")
    import whisper_long_form

    whisper_long_form.add_arguments(p).add_argument(
        "--long-form", type=float, metavar="SECONDS", default=0.0,
        help="after the clips, one file of SECONDS (speech islands between silences), decoded "
             "sequentially and VAD-batched: tandem against faster-whisper")

    args = p.parse_args(argv)
    whisper_long_form.finish_arguments(args, p.error)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown:
        p.error(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    try:
        args.new_tokens = throughput.rounds.parse_int_list(args.new_tokens, "--new-tokens")
    except ValueError as exc:
        p.error(str(exc))
    if args.num_clips < 1 or args.repeats < 1:
        p.error("--num-clips and --repeats must be >= 1")
    if max(args.new_tokens) > 224:
        p.error("--new-tokens: at most 224 (CTranslate2 decodes max_length // 2 <= 448 // 2 tokens)")
    types = args.ct2_compute_types or f"{args.dtype},int8"
    args.ct2_compute_types = list(dict.fromkeys(t.strip() for t in types.split(",") if t.strip()))
    return args


def available_engines(engines: list[str]) -> list[str]:
    """Drop engines whose package is not installed, with a note (found, not imported:
    a broken install shows in the engine's own process, as a FAILED row)."""
    import importlib.util

    needs = {"tandem": "tandem", "hf": "transformers", "ct2": "ctranslate2"}
    if "tandem" in engines and importlib.util.find_spec("tandem") is None:
        sys.path.insert(0, str(REPO_ROOT))
    kept = []
    for engine in engines:
        if importlib.util.find_spec(needs[engine]) is None:
            print(f"note: skipping {engine}: {needs[engine]} is not installed")
            continue
        kept.append(engine)
    return kept


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()  # generate's per-call notes about the prompt
    if args.threads:
        torch.set_num_threads(args.threads)

    def build(model_dir: str) -> None:
        print(f"building random Whisper ({args.size}) in {model_dir}", flush=True)
        make_model(args.size, model_dir, args.seed)

    model_dir, tmp = throughput.checkpoint_dir(args.model, args.save_model, "tandem-bench-whisper-", build)

    config = load_config(model_dir)
    clips = make_clips(args.num_clips, args.seed)
    warmup = make_clips(2, args.seed + 1_000)  # other clips: no encoder reuse

    env = environment(args, config, model_dir)
    print("  ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    if args.device == "cpu" and env["load_avg_1min"] > 0.5:
        print(f"warning: 1-minute load average is {env['load_avg_1min']}: other processes are "
              "using the CPU, so figures will be noisy", file=sys.stderr)

    runners, failed, converted = load_runners(model_dir, args, available_engines(args.engines))
    try:
        results, shares = run_rounds(runners, clips, warmup, args, failed)
    finally:
        for handle, _, _ in runners:
            handle.close()
    notes = [f"{name} failed: {error}" for name, error in failed.items()]
    del runners
    gc.collect()
    if converted is not None:
        converted.cleanup()

    compare(results)
    print()
    print(f"cpu_flags={env['cpu_flags']}  cpu_capability={env['cpu_capability']}  "
          + "".join(f"{k}={v}  " for k, v in throughput.isa_overrides().items())
          + f"threads={env['torch_threads']}  dtype={args.dtype}  clips={args.num_clips} x 30 s  "
          f"tokens/clip={','.join(map(str, args.new_tokens))}  rounds={args.repeats}  "
          f"load={env['load_avg']} -> {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("engines ran in this process, one after another (--in-process)" if args.in_process else
          "engines ran in separate processes, one engine at a time: "
          + ", ".join(f"{r.engine} pid {r.pid}" for r in results if r.pid and r.tokens_per_clip == args.new_tokens[0]))
    print(format_table(results))
    for note in dict.fromkeys(f"{r.engine}: {r.note}" for r in results if r.note):
        print(note)
    for n in args.new_tokens:
        share = shares.get(n)
        if share is None:
            continue
        print(f"tandem encoder share at {n} tokens: t(1 token) = {share['seconds_1_token']:.2f} s, "
              f"t({n} tokens) = {share['seconds_full']:.2f} s, "
              f"share = {100 * share['encoder_share']:.1f}%"
              + (f" (fastest runs: {min(share['seconds_1_token_all']):.2f} / "
                 f"{min(share['seconds_full_all']):.2f} s = {100 * share['encoder_share_fastest']:.1f}%)"
                 if args.repeats > 1 else ""))
    if "stats" in shares:
        s = shares["stats"]
        print(f"tandem stats: encoder_tokens_computed={s.get('encoder_tokens_computed')} "
              f"encoder_tokens_reused={s.get('encoder_tokens_reused')}")

    long_form = []
    if args.long_form > 0:
        import whisper_long_form

        print(f"\nlong-form: one {args.long_form:.0f} s file, {' and '.join(args.long_form_modes)}, "
              f"{args.long_form_max_tokens} tokens a window", flush=True)
        args.seconds = args.long_form
        long_form = whisper_long_form.run_long_form(model_dir, args)
        print(whisper_long_form.format_table(long_form))

    if args.json:
        payload = {
            "environment": env,
            "results": [{k: v for k, v in asdict(r).items() if k != "outputs"} for r in results],
            "tandem_encoder_share": {str(k): v for k, v in shares.items()},
            "notes": notes,
            "long_form": [asdict(r) for r in long_form],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\nwrote {args.json}")

    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    # Run as the module `whisper`, not `__main__`: the engines' processes (engine_procs)
    # build whisper.WhisperHost by that name.
    import whisper

    sys.exit(whisper.main())
