"""Long-form Whisper: one long file decoded window after window, tandem against
faster-whisper's sequential ``WhisperModel.transcribe``.

Both engines get the same checkpoint (faster-whisper a CTranslate2 conversion of
it, with the checkpoint's tokenizer.json) and the same synthetic, seeded
speech-like file (``whisper.synth_speech``; nothing is downloaded), and decode
it as a user who wants HF's plain algorithm would:

  tandem    ``llm.transcribe(file, language="en", timestamps=True, temperature=0.0,
            max_tokens=T)``: HF's sequential long-form (timestamps on, each
            window seeks to the last complete segment), windows of one file
            one after another.
  fw        ``WhisperModel(dir, compute_type=C).transcribe(file, language="en",
            beam_size=1, temperature=0.0, max_new_tokens=T, vad_filter=False,
            condition_on_previous_text=False)`` with the fallback and
            no-speech thresholds off, the segments generator consumed; one row
            per compute type of ``--fw-compute-types`` (default float32,int8).

Without fallbacks, both do one greedy decode per window; ``T`` (default 224,
faster-whisper's own ``max_length // 2``) caps the tokens per window for
both. A random checkpoint's text is noise and its timestamps fall where they
fall, so the two engines' seek decisions (hence windows and tokens) can differ:
the table prints windows and tokens per engine next to the wall-clock time, and
``tokens/s`` makes the comparison per unit of decoding work.

Rows are functions in ``RUNNERS`` (name -> runner); a VAD-batched tandem row or
faster-whisper's ``BatchedInferencePipeline`` is one more entry.

  python benchmarks/whisper_long_form.py --size base --seconds 600
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import whisper as clips_bench  # noqa: E402  (checkpoint, audio and CTranslate2 conversion)

SAMPLING_RATE = clips_bench.SAMPLING_RATE


@dataclass
class LongFormResult:
    engine: str
    seconds: float
    audio_seconds: float
    windows: int | None  # decodes (None: the engine does not say)
    segments: int
    tokens: int
    note: str = ""

    @property
    def audio_s_per_s(self) -> float:
        return self.audio_seconds / self.seconds


def tandem_sequential(model_dir: str, converted: str, audio, args, quantization: str | None = None) -> LongFormResult:
    from tandem import LLM

    llm = LLM(model=model_dir, dtype="float32" if quantization else args.dtype, device=args.device,
              seed=args.seed, quantization=quantization)
    warm = clips_bench.synth_speech(35.0, seed=args.seed + 7)  # two windows, other audio
    llm.transcribe({"audio": warm, "sampling_rate": SAMPLING_RATE}, language="en", use_tqdm=False,
                   temperature=0.0, max_tokens=8)
    start = time.perf_counter()
    (r,) = llm.transcribe({"audio": audio, "sampling_rate": SAMPLING_RATE}, language="en", timestamps=True,
                          use_tqdm=False, temperature=0.0, max_tokens=args.long_form_max_tokens)
    seconds = time.perf_counter() - start
    if r.error:
        raise RuntimeError(f"tandem: {r.error}")
    name = "tandem" + (f" {quantization}" if quantization else "")
    result = LongFormResult(name, seconds, len(audio) / SAMPLING_RATE, r.windows, len(r.segments or []),
                            len(r.token_ids), f"dtype {'float32' if quantization else args.dtype}")
    del llm
    gc.collect()
    return result


def fw_sequential(model_dir: str, converted: str, audio, args, compute_type: str) -> LongFormResult:
    from faster_whisper import WhisperModel

    model = WhisperModel(converted, device=args.device, compute_type=compute_type,
                         cpu_threads=torch.get_num_threads())
    options = dict(language="en", beam_size=1, temperature=0.0, compression_ratio_threshold=None,
                   log_prob_threshold=None, no_speech_threshold=None, condition_on_previous_text=False,
                   vad_filter=False, max_new_tokens=args.long_form_max_tokens)
    warm = clips_bench.synth_speech(35.0, seed=args.seed + 7)
    list(model.transcribe(warm, **{**options, "max_new_tokens": 8})[0])
    start = time.perf_counter()
    segments, _ = model.transcribe(audio, **options)
    segments = list(segments)  # the generator decodes as it is consumed
    seconds = time.perf_counter() - start
    # Segments of one window share its seek; every window without a segment is missed here.
    windows = len({s.seek for s in segments})
    del model
    gc.collect()
    return LongFormResult(f"fw {compute_type}", seconds, len(audio) / SAMPLING_RATE, windows, len(segments),
                          sum(len(s.tokens) for s in segments), "windows: those with segments")


RUNNERS = {
    "tandem": lambda m, c, a, args: [tandem_sequential(m, c, a, args)]
    + ([tandem_sequential(m, c, a, args, "int8")] if args.tandem_int8 else []),
    "fw": lambda m, c, a, args: [fw_sequential(m, c, a, args, t) for t in args.fw_compute_types],
}


def convert_for_faster_whisper(model_dir: str, out_dir: str) -> None:
    """CTranslate2 conversion plus the files faster-whisper reads beside it (without
    tokenizer.json it would fetch openai/whisper-tiny's from the Hub)."""
    clips_bench.ct2_convert(model_dir, out_dir)
    for name in ("tokenizer.json", "preprocessor_config.json"):
        if (Path(model_dir) / name).exists():
            shutil.copy(Path(model_dir) / name, Path(out_dir) / name)


def run_long_form(model_dir: str, args) -> list[LongFormResult]:
    audio = clips_bench.synth_speech(args.seconds, seed=args.seed + 31)
    engines = [e for e in args.long_form_engines if e in RUNNERS]
    results: list[LongFormResult] = []
    with tempfile.TemporaryDirectory(prefix="tandem-bench-fw-") as converted:
        if any(e != "tandem" for e in engines):
            convert_for_faster_whisper(model_dir, converted)
        for engine in engines:
            for r in RUNNERS[engine](model_dir, converted, audio, args):
                print(f"  {r.engine:<12} {r.seconds:8.2f} s  {r.audio_s_per_s:8.2f} audio s/s  "
                      f"{r.windows} windows, {r.tokens} tokens", flush=True)
                results.append(r)
    return results


def format_table(results: list[LongFormResult]) -> str:
    rows = [("engine", "seconds", "audio s/s", "windows", "segments", "tokens", "tokens/s", "ratio vs best fw")]
    fw = [r.audio_s_per_s for r in results if r.engine.startswith("fw")]
    for r in results:
        rows.append((r.engine, f"{r.seconds:.2f}", f"{r.audio_s_per_s:.2f}", str(r.windows), str(r.segments),
                     str(r.tokens), f"{r.tokens / r.seconds:.1f}",
                     f"{r.audio_s_per_s / max(fw):.2f}x" if fw else "-"))
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
    g.add_argument("--fw-compute-types", default="float32,int8",
                   help="faster-whisper compute types, one row each (default: float32,int8)")
    g.add_argument("--long-form-max-tokens", type=int, default=224,
                   help="tokens per window at most, both engines (default: 224, faster-whisper's)")
    return g


def finish_arguments(args) -> None:
    args.long_form_engines = [e.strip() for e in args.long_form_engines.split(",") if e.strip()]
    args.fw_compute_types = [t.strip() for t in args.fw_compute_types.split(",") if t.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local Whisper checkpoint directory (with tokenizer.json)")
    p.add_argument("--size", choices=sorted(clips_bench.MODEL_SIZES), default="base")
    p.add_argument("--seconds", type=float, default=600.0, help="length of the file (default: 600)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tandem-int8", action="store_true", help="also a 'tandem int8' row")
    add_arguments(p)
    args = p.parse_args(argv)
    finish_arguments(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="tandem-bench-whisper-") as tmp:
        model_dir = args.model or clips_bench.make_model(args.size, tmp, args.seed)
        print(f"cpu_flags={clips_bench.throughput.cpu_flags()}  "
              f"cpu_capability={torch.backends.cpu.get_cpu_capability()}  threads={torch.get_num_threads()}  "
              f"cpu_count={os.cpu_count()}  load_avg_1min={os.getloadavg()[0]:.2f}  file={args.seconds:.0f} s",
              flush=True)
        results = run_long_form(model_dir, args)
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
