"""Whisper on one long file: sequential long-form against VAD-batched, tandem and faster-whisper.

One synthetic file of ``--minutes`` (default 10) of speech islands (5-25 s of
syllables Silero VAD hears as speech: ``speechlike_audio`` of tests/helpers.py)
between 0.5-4 s silences, 16 kHz; one seeded random checkpoint
(``benchmarks/whisper.py``'s, ``--size base`` by default), converted through
CTranslate2 for faster-whisper. Greedy, ``language="en"``, every decode at most
``--new-tokens`` tokens (default 32) with EOS suppressed (so each window decodes
exactly that many where the engine allows), no fallback, no no-speech skip,
no conditioning on previous text. Rows:

  tandem sequential      ``llm.transcribe(file, max_tokens=T, min_tokens=T)``: HF's
                         long-form, window after window (timestamps on, as HF
                         decodes over 30 s), each seeking to its last segment's end.
  tandem vad-batched     ``llm.transcribe(file, vad_filter=True, ...)``: Silero VAD,
                         chunks of <= 30 s, all decoded at once, no timestamps.
  fw sequential          faster-whisper ``WhisperModel.transcribe(file,
                         vad_filter=False, max_new_tokens=T, suppress_tokens=[...,
                         EOS])``: its sequential long-form, timestamps on.
  fw batched             ``BatchedInferencePipeline.transcribe(file, batch_size=B,
                         without_timestamps=True, ...)``: its VAD (its own copy of
                         Silero) and chunks, ``B`` at a time.

Each row's wall time is one call on the whole file (audio decoding is not on
the clock: every engine gets the samples), after a warm-up call on a 40 s file.
"windows" is the decodes the row ran (tandem: ``Transcription.windows``;
faster-whisper sequential: the windows its segments came from, so a window with
no segment is not counted; batched: its chunks), "tokens" the tokens they
produced. The VAD's own time is printed apart (Silero on the file, one thread).

  python benchmarks/whisper_long.py --size base --minutes 10
  python benchmarks/whisper_long.py --size tiny --minutes 2 --engines tandem   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # speechlike_audio
sys.path.insert(0, str(HERE.parent))
import throughput  # noqa: E402
import whisper as wb  # noqa: E402

SR = 16000


def long_file(minutes: float, seed: int) -> np.ndarray:
    from helpers import speechlike_audio

    rng = np.random.default_rng(seed)
    parts, total, k = [np.zeros(int(rng.uniform(0.5, 2) * SR), np.float32)], 0.0, 0
    while total < minutes * 60:
        speech = rng.uniform(5, 25)
        parts.append(speechlike_audio(speech, seed=seed * 1000 + k, f0=float(rng.uniform(100, 220))))
        parts.append(np.zeros(int(rng.uniform(0.5, 4) * SR), np.float32))
        total += speech + len(parts[-1]) / SR
        k += 1
    return np.concatenate(parts)[: int(minutes * 60 * SR)]


def suppressed(model_dir: str) -> list[int]:
    from transformers import GenerationConfig

    g = GenerationConfig.from_pretrained(model_dir)
    return sorted(set(g.suppress_tokens or []) | {g.eos_token_id})


def run_tandem(model_dir, audio, warm, args) -> list[dict]:
    from tandem import LLM

    llm = LLM(model=model_dir, dtype=args.dtype, device="cpu", seed=args.seed)
    common = dict(language="en", use_tqdm=False, temperature=0.0, max_tokens=args.new_tokens,
                  min_tokens=args.new_tokens)
    rows = []
    for name, extra in (("tandem sequential", {}), ("tandem vad-batched", {"vad_filter": True})):
        if name.split()[-1] not in args.modes:
            continue
        llm.transcribe(warm, sampling_rate=SR, **common, **extra)
        t = time.perf_counter()
        r = llm.transcribe(audio, sampling_rate=SR, **common, **extra)[0]
        seconds = time.perf_counter() - t
        assert r.error is None, r.error
        rows.append(dict(engine=name, seconds=seconds, windows=r.windows, tokens=len(r.token_ids)))
    return rows


def run_fw(model_dir, audio, warm, args) -> list[dict]:
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    out = tempfile.mkdtemp(prefix="tandem-bench-fw-")
    wb.ct2_convert(model_dir, out)
    for name in ("tokenizer.json", "preprocessor_config.json"):
        if (Path(model_dir) / name).exists():
            (Path(out) / name).write_bytes((Path(model_dir) / name).read_bytes())
    compute = "float32" if args.dtype == "float32" else args.dtype
    model = WhisperModel(out, device="cpu", compute_type=compute, cpu_threads=torch.get_num_threads())
    common = dict(language="en", beam_size=1, temperature=0.0, max_new_tokens=args.new_tokens,
                  suppress_tokens=suppressed(model_dir), compression_ratio_threshold=None, log_prob_threshold=None,
                  no_speech_threshold=None, condition_on_previous_text=False)
    rows = []
    if "sequential" in args.modes:
        def sequential(x):
            segments, _ = model.transcribe(x, vad_filter=False, without_timestamps=False, **common)
            return list(segments)

        sequential(warm)
        t = time.perf_counter()
        segs = sequential(audio)
        rows.append(dict(engine="fw sequential", seconds=time.perf_counter() - t, windows=len({s.seek for s in segs}),
                         tokens=sum(len(s.tokens) for s in segs)))
    if "vad-batched" in args.modes:
        pipe = BatchedInferencePipeline(model)

        def batched(x):
            segments, info = pipe.transcribe(x, batch_size=args.fw_batch_size, without_timestamps=True, **common)
            return list(segments)

        batched(warm)
        t = time.perf_counter()
        segs = batched(audio)
        rows.append(dict(engine=f"fw batched (B={args.fw_batch_size})", seconds=time.perf_counter() - t,
                         windows=len(segs), tokens=sum(len(s.tokens) for s in segs)))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a local Whisper checkpoint (default: a random one of --size)")
    p.add_argument("--size", choices=sorted(wb.MODEL_SIZES), default="base")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--engines", default="tandem,fw", help="comma-separated: tandem, fw (faster-whisper)")
    p.add_argument("--modes", default="sequential,vad-batched")
    p.add_argument("--fw-batch-size", type=int, default=16)
    p.add_argument("--threads", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    args.modes = args.modes.split(",")
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    tmp = None
    model_dir = args.model
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="tandem-bench-whisper-long-")
        model_dir = wb.make_model(args.size, tmp.name, args.seed)
    audio = long_file(args.minutes, args.seed)
    warm = long_file(40 / 60, args.seed + 1)
    from tandem.entrypoints.vad import SileroVad, VadOptions

    t = time.perf_counter()
    regions = SileroVad()(audio, VadOptions())
    vad_seconds = time.perf_counter() - t
    speech = sum(e - s for s, e in regions) / SR
    env = {"cpu_flags": throughput.cpu_flags(), "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
           "load_avg_1min": round(os.getloadavg()[0], 2), "size": args.size if args.model is None else args.model,
           "dtype": args.dtype, "audio_seconds": len(audio) / SR, "new_tokens": args.new_tokens}
    print("  ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    print(f"silero VAD (tandem's): {len(regions)} regions, {speech:.0f} s of speech, {vad_seconds:.2f} s", flush=True)
    rows = []
    engines = args.engines.split(",")
    if "tandem" in engines:
        rows += run_tandem(model_dir, audio, warm, args)
    if "fw" in engines:
        try:
            rows += run_fw(model_dir, audio, warm, args)
        except ImportError as e:
            print(f"note: skipping faster-whisper: {e}")
    base = rows[0]["seconds"] if rows else None
    print(f"\n{'engine':<24}{'wall s':>9}{'audio-s/s':>11}{'windows':>9}{'tokens':>8}{'vs first':>10}")
    for r in rows:
        r["audio_s_per_s"] = env["audio_seconds"] / r["seconds"]
        print(f"{r['engine']:<24}{r['seconds']:>9.1f}{r['audio_s_per_s']:>11.1f}{r['windows']:>9}{r['tokens']:>8}"
              f"{base / r['seconds']:>9.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": env, "vad_seconds": vad_seconds, "rows": rows},
                                              indent=2) + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
