"""Long-form Whisper: one long file, tandem against faster-whisper, decoded window
after window (sequential) and VAD-batched.

The file: ``--seconds`` (default 600) of speech islands, each 5-25 s of syllables
Silero VAD hears as speech (``speechlike_audio`` of tests/helpers.py, a pitch per
island) between 0.5-4 s silences, 16 kHz, seeded; nothing is downloaded. The
VAD rows cut it where the silences are; the sequential rows decode it all,
silences included, as they decode any file. The checkpoint: ``--model`` or a
seeded random one of ``--size`` (``benchmarks/whisper.py``'s, ``base`` by
default); faster-whisper gets a CTranslate2 conversion of it with its
tokenizer.json and preprocessor_config.json copied beside it (without them it
would fetch openai/whisper-tiny's from the Hub).

Every row decodes greedily, ``language="en"``, at most ``T`` tokens a window
(``--long-form-max-tokens``, default 224, faster-whisper's own
``max_length // 2``), with EOS suppressed so that every window decodes exactly
``T`` tokens in every engine (``--allow-eos``: windows end where the random
checkpoint's EOS falls, so tokens per window differ between engines); no
temperature fallback, no no-speech skip, no conditioning on previous text.
Without fallbacks, every engine does one greedy decode per window. Rows:

  tandem sequential [int8]   ``llm.transcribe(file, language="en", timestamps=True,
                             temperature=0.0, max_tokens=T, min_tokens=T)``: HF's
                             sequential long-form, windows of the file one after
                             another, each seeking to its last complete segment.
                             ``LLM(dtype=--dtype)``; with ``--tandem-int8`` also
                             ``quantization="int8"`` (every linear layer and the
                             LM head int8, float32 around them).
  tandem vad-batched [int8]  ``llm.transcribe(file, vad_filter=True, ...)``, no
                             timestamps: Silero VAD (tandem's), speech chunks of
                             <= 30 s, all decoded at once on the engine's scheduler.
  fw sequential C            ``WhisperModel(dir, compute_type=C).transcribe(file,
                             language="en", beam_size=1, temperature=0.0,
                             max_new_tokens=T, suppress_tokens=[..., EOS],
                             vad_filter=False, condition_on_previous_text=False)``
                             with ``compression_ratio_threshold``,
                             ``log_prob_threshold`` and ``no_speech_threshold`` None,
                             timestamps on, the segments generator consumed.
  fw batched C (B=N)         ``BatchedInferencePipeline(model).transcribe(file,
                             batch_size=N, without_timestamps=True, ...)`` (same
                             options): its VAD (its own copy of Silero) and chunks,
                             ``N`` at a time (``--fw-batch-size``, default 16).

One row per mode of ``--long-form-modes`` (sequential,vad-batched) for each
engine of ``--long-form-engines`` (tandem,fw), tandem in ``--dtype`` (and int8),
faster-whisper once per ``--fw-compute-types`` (default float32,int8). Rows are
functions in ``RUNNERS`` (engine name -> runner returning its rows).

Each row's wall time is one call on the whole file, after a warm-up call with
the same options (at most 8 tokens a window) on a 40 s file of other islands;
audio decoding is not on the clock (every engine gets the samples). "windows"
is the decodes the row ran (tandem: ``Transcription.windows``; fw sequential:
the windows its segments came from, so a window without a segment is not
counted; fw batched: its chunks). "tokens kept" is the text tokens the row
returned as its engine reports them (tandem's ``token_ids``, the fw segments'
``tokens``: timestamps and other special tokens out, and tandem's sequential
rows keep a window's tokens up to its last complete segment), so it is not the
work done; "decoded" is, windows x T (EOS suppressed; "-" with
``--allow-eos``), and ``tokens/s`` is decoded tokens a second (kept ones with
``--allow-eos``), the comparison per unit of decoding work: a random
checkpoint's timestamps fall where they fall, so the engines' seek decisions
(hence windows) can differ. The VAD's own time is printed apart (tandem's Silero on
the whole file, one thread); it is inside the vad-batched rows' wall time too.

  python benchmarks/whisper_long_form.py --size base --seconds 600 --tandem-int8
  python benchmarks/whisper_long_form.py --size tiny --seconds 60 --long-form-max-tokens 32   # quick
  python benchmarks/whisper.py --size base --long-form 600   # after the 30 s clips, one run
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # helpers.speechlike_audio
import whisper as clips_bench  # noqa: E402  (checkpoint and CTranslate2 conversion)

SAMPLING_RATE = clips_bench.SAMPLING_RATE
MODES = ("sequential", "vad-batched")
WARM_SECONDS = 40.0
WARM_TOKENS = 8


@dataclass
class LongFormResult:
    engine: str
    seconds: float
    audio_seconds: float
    windows: int | None  # decodes (None: the engine does not say)
    segments: int
    tokens: int  # the text tokens the row returned (kept), as the engine reports them
    decoded: int | None = None  # tokens decoded: windows * T with EOS suppressed (None: EOS allowed)
    note: str = ""

    @property
    def audio_s_per_s(self) -> float:
        return self.audio_seconds / self.seconds

    @property
    def tokens_per_s(self) -> float:
        """Decoded tokens a second (kept tokens when EOS was allowed: decodes unknown)."""
        return (self.tokens if self.decoded is None else self.decoded) / self.seconds


def islands_file(seconds: float, seed: int) -> np.ndarray:
    """``seconds`` of 16 kHz audio: speech-like islands of 5-25 s (Silero hears them as
    speech) between silences of 0.5-4 s, starting with 0.5-2 s of silence. Seeded."""
    from helpers import speechlike_audio

    sr = SAMPLING_RATE
    rng = np.random.default_rng(seed)
    parts, k = [np.zeros(int(rng.uniform(0.5, 2) * sr), np.float32)], 0
    total = len(parts[0]) / sr
    while total < seconds:
        speech = rng.uniform(5, 25)
        parts.append(speechlike_audio(speech, seed=seed * 1000 + k, sr=sr, f0=float(rng.uniform(100, 220))))
        parts.append(np.zeros(int(rng.uniform(0.5, 4) * sr), np.float32))
        total += speech + len(parts[-1]) / sr
        k += 1
    return np.concatenate(parts)[: int(seconds * sr)]


def suppressed_tokens(model_dir: str) -> list[int]:
    """The checkpoint's suppress_tokens plus EOS (faster-whisper's ``suppress_tokens``)."""
    from transformers import GenerationConfig

    g = GenerationConfig.from_pretrained(model_dir)
    return sorted(set(g.suppress_tokens or []) | {g.eos_token_id})


def decoded(windows: int | None, args) -> int | None:
    """Tokens decoded: with EOS suppressed every window decodes exactly T."""
    return None if args.allow_eos or windows is None else windows * args.long_form_max_tokens


def run_tandem(model_dir: str, converted: str, audio, warm, args) -> list[LongFormResult]:
    from tandem import LLM

    results = []
    for quantization in [None] + (["int8"] if args.tandem_int8 else []):
        dtype = "float32" if quantization else args.dtype
        llm = LLM(model=model_dir, dtype=dtype, device=args.device, seed=args.seed, quantization=quantization)
        for mode in args.long_form_modes:
            options = dict(language="en", use_tqdm=False, temperature=0.0)
            options.update(dict(timestamps=True) if mode == "sequential" else dict(vad_filter=True))

            def call(x, tokens):
                (r,) = llm.transcribe({"audio": x, "sampling_rate": SAMPLING_RATE}, max_tokens=tokens,
                                      **({} if args.allow_eos else {"min_tokens": tokens}), **options)
                if r.error:
                    raise RuntimeError(f"tandem {mode}: {r.error}")
                return r

            call(warm, min(WARM_TOKENS, args.long_form_max_tokens))
            start = time.perf_counter()
            r = call(audio, args.long_form_max_tokens)
            seconds = time.perf_counter() - start
            name = f"tandem {mode}" + (f" {quantization}" if quantization else "")
            results.append(LongFormResult(name, seconds, len(audio) / SAMPLING_RATE, r.windows,
                                          len(r.segments or []), len(r.token_ids), decoded(r.windows, args),
                                          f"dtype {dtype}"))
            print_row(results[-1])
        del llm
        gc.collect()
    return results


def run_fw(model_dir: str, converted: str, audio, warm, args) -> list[LongFormResult]:
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    options = dict(language="en", beam_size=1, temperature=0.0, compression_ratio_threshold=None,
                   log_prob_threshold=None, no_speech_threshold=None, condition_on_previous_text=False)
    if not args.allow_eos:
        options["suppress_tokens"] = suppressed_tokens(model_dir)
    results = []
    for compute_type in args.fw_compute_types:
        model = WhisperModel(converted, device=args.device, compute_type=compute_type,
                             cpu_threads=torch.get_num_threads())
        for mode in args.long_form_modes:
            if mode == "sequential":
                def call(x, tokens):
                    segments, _ = model.transcribe(x, vad_filter=False, without_timestamps=False,
                                                   max_new_tokens=tokens, **options)
                    return list(segments)  # the generator decodes as it is consumed

                name, note = f"fw sequential {compute_type}", "windows: those with segments"
            else:
                pipe = BatchedInferencePipeline(model)

                def call(x, tokens):
                    segments, _ = pipe.transcribe(x, batch_size=args.fw_batch_size, without_timestamps=True,
                                                  max_new_tokens=tokens, **options)
                    return list(segments)

                name, note = f"fw batched {compute_type} (B={args.fw_batch_size})", "windows: its chunks"
            call(warm, min(WARM_TOKENS, args.long_form_max_tokens))
            start = time.perf_counter()
            segments = call(audio, args.long_form_max_tokens)
            seconds = time.perf_counter() - start
            # sequential: segments of one window share its seek; batched: one segment a chunk
            windows = len({s.seek for s in segments}) if mode == "sequential" else len(segments)
            results.append(LongFormResult(name, seconds, len(audio) / SAMPLING_RATE, windows, len(segments),
                                          sum(len(s.tokens) for s in segments), decoded(windows, args), note))
            print_row(results[-1])
        del model
        gc.collect()
    return results


RUNNERS = {"tandem": run_tandem, "fw": run_fw}


def convert_for_faster_whisper(model_dir: str, out_dir: str) -> None:
    """CTranslate2 conversion plus the files faster-whisper reads beside it (without
    tokenizer.json it would fetch openai/whisper-tiny's from the Hub)."""
    clips_bench.ct2_convert(model_dir, out_dir)
    for name in ("tokenizer.json", "preprocessor_config.json"):
        if (Path(model_dir) / name).exists():
            shutil.copy(Path(model_dir) / name, Path(out_dir) / name)


def time_vad(audio) -> str:
    """Tandem's Silero VAD on the whole file, timed alone (one thread)."""
    try:
        from tandem.entrypoints.vad import SileroVad, VadOptions

        vad = SileroVad()
        start = time.perf_counter()
        regions = vad(audio, VadOptions())
        seconds = time.perf_counter() - start
    except ImportError as e:
        return f"silero VAD: not timed ({e})"
    speech = sum(e - s for s, e in regions) / SAMPLING_RATE
    return (f"silero VAD (tandem's, alone): {len(regions)} regions, {speech:.0f} s of speech in "
            f"{len(audio) / SAMPLING_RATE:.0f} s, {seconds:.2f} s")


def print_row(r: LongFormResult) -> None:
    print(f"  {r.engine:<28} {r.seconds:8.2f} s  {r.audio_s_per_s:8.2f} audio s/s  "
          f"{r.windows} windows, {r.tokens} tokens kept", flush=True)


def run_long_form(model_dir: str, args) -> list[LongFormResult]:
    audio = islands_file(args.seconds, args.seed + 31)
    warm = islands_file(WARM_SECONDS, args.seed + 7)
    engines = [e for e in args.long_form_engines if e in RUNNERS]
    if "vad-batched" in args.long_form_modes:
        print(time_vad(audio), flush=True)
    results: list[LongFormResult] = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-fw-") as converted:
        if "fw" in engines:
            convert_for_faster_whisper(model_dir, converted)
        for engine in engines:
            results += RUNNERS[engine](model_dir, converted, audio, warm, args)
    return results


def format_table(results: list[LongFormResult]) -> str:
    rows = [("row", "wall s", "audio s/s", "windows", "segments", "tokens kept", "decoded", "tokens/s",
             "vs first")]
    for r in results:
        rows.append((r.engine, f"{r.seconds:.2f}", f"{r.audio_s_per_s:.2f}", str(r.windows), str(r.segments),
                     str(r.tokens), "-" if r.decoded is None else str(r.decoded), f"{r.tokens_per_s:.1f}",
                     f"{results[0].seconds / r.seconds:.2f}x"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser):
    """The long-form options (also on ``benchmarks/whisper.py``, with ``--long-form SECONDS``);
    returns their argument group."""
    g = p.add_argument_group("long-form (benchmarks/whisper_long_form.py)")
    g.add_argument("--long-form-engines", default="tandem,fw",
                   help=f"comma list from {','.join(RUNNERS)} (default: all)")
    g.add_argument("--long-form-modes", default=",".join(MODES),
                   help=f"comma list from {','.join(MODES)} (default: both)")
    g.add_argument("--fw-compute-types", default="float32,int8",
                   help="faster-whisper compute types, rows for each (default: float32,int8)")
    g.add_argument("--fw-batch-size", type=int, default=16,
                   help="chunks per BatchedInferencePipeline batch (default: 16)")
    g.add_argument("--long-form-max-tokens", type=int, default=224,
                   help="tokens per window, every row (default: 224, faster-whisper's)")
    g.add_argument("--allow-eos", action="store_true",
                   help="let windows end at EOS (default: EOS suppressed, every window decodes exactly "
                        "--long-form-max-tokens)")
    return g


def finish_arguments(args, error=None) -> None:
    args.long_form_engines = [e.strip() for e in args.long_form_engines.split(",") if e.strip()]
    args.long_form_modes = [m.strip() for m in args.long_form_modes.split(",") if m.strip()]
    args.fw_compute_types = [t.strip() for t in args.fw_compute_types.split(",") if t.strip()]
    bad = [f"--long-form-engines {e!r}" for e in args.long_form_engines if e not in RUNNERS]
    bad += [f"--long-form-modes {m!r}" for m in args.long_form_modes if m not in MODES]
    if args.long_form_max_tokens < 1 or args.fw_batch_size < 1:
        bad.append("--long-form-max-tokens and --fw-batch-size must be >= 1")
    if bad:
        msg = "bad long-form option(s): " + "; ".join(bad)
        if error is None:
            raise SystemExit(msg)
        error(msg)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local Whisper checkpoint directory (with tokenizer.json)")
    p.add_argument("--size", choices=sorted(clips_bench.MODEL_SIZES), default="base")
    p.add_argument("--seconds", type=float, default=600.0, help="length of the file (default: 600)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tandem-int8", action="store_true", help="also 'tandem ... int8' rows")
    add_arguments(p)
    args = p.parse_args(argv)
    finish_arguments(args, p.error)
    if args.seconds <= 0:
        p.error(f"--seconds must be > 0, not {args.seconds}")
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    with tempfile.TemporaryDirectory(prefix="tandem-bench-whisper-") as tmp:
        model_dir = args.model or clips_bench.make_model(args.size, tmp, args.seed)
        print(f"cpu_flags={clips_bench.throughput.cpu_flags()}  "
              f"cpu_capability={torch.backends.cpu.get_cpu_capability()}  threads={torch.get_num_threads()}  "
              f"cpu_count={os.cpu_count()}  load_avg_1min={os.getloadavg()[0]:.2f}  "
              f"size={args.model or args.size}  dtype={args.dtype}  file={args.seconds:.0f} s  "
              f"max_tokens={args.long_form_max_tokens}  eos={'allowed' if args.allow_eos else 'suppressed'}",
              flush=True)
        results = run_long_form(model_dir, args)
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
