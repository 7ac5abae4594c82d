#!/usr/bin/env python
"""Train the tiny demo Whisper checkpoint shipped with tandem (``tandem/demo_whisper``).

Task: transcribe "tone speech". Each word of a 20-word vocabulary (the digits
``zero`` .. ``nine`` and ten short words) is a pair of sine tones, like a
telephone's DTMF keys, held for 0.15-0.3 s; a sentence is 1-8 words with gaps,
some leading silence and light noise (``synthesize``). The model hears it as a
real Whisper does: 16 kHz audio, the 30 s window, 80-bin log-mel features,
1500 encoder positions.

The checkpoint is a standard Hugging Face ``WhisperForConditionalGeneration``
(config.json, model.safetensors, generation_config.json, preprocessor_config.json)
with a ``WhisperTokenizer`` built here (``build_tokenizer``): a byte-level BPE over
the vocabulary's words, then Whisper's special tokens in Whisper's order
(``<|endoftext|>``, ``<|startoftranscript|>``, ``<|en|>``, ``<|translate|>``,
``<|transcribe|>``, ``<|startoflm|>``, ``<|startofprev|>``, ``<|nospeech|>``,
``<|notimestamps|>``) and the 1501 timestamp tokens ``<|0.00|>`` .. ``<|30.00|>``.

Training sequences, as Whisper's:

    <|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|> " three one four" <|endoftext|>
    <|startoftranscript|> <|en|> <|transcribe|> <|0.32|> " three one four" <|1.58|> <|endoftext|>
    <|startofprev|> " five" <|startoftranscript|> <|en|> <|transcribe|> ...

(a quarter with timestamps: one segment from the first word's onset to the last
word's end; some with ``<|translate|>``, whose English target is the same text).
An auxiliary head on the encoder, dropped when saving, is trained to name the
word sounding at each encoder position.

Training runs in two phases to fit a shared CPU: first on the first 3 s of the
30 s window (the encoder's fixed sinusoidal positions cut to 150; every sentence
fits in it), then on the whole window, which is what inference sees.

Usage (from the repository root):

    python tools/train_demo_whisper.py             # writes tandem/demo_whisper/
    python tools/train_demo_whisper.py --out DIR --seed 1234

Nothing is downloaded. torch.set_num_threads(1) by default.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tandem" / "demo_whisper"
sys.path.insert(0, str(REPO_ROOT))

from tandem.demo_whisper.tokenizer import build_whisper_tokenizer, save_whisper_tokenizer  # noqa: E402
from tandem.demo_whisper.tones import SAMPLE_RATE, TONES, WORDS, synthesize, write_wav  # noqa: E402
from train_demo import lr_at  # noqa: E402  (the text demo's schedule: linear warm-up, cosine to 5%)

WINDOW_SAMPLES = 30 * SAMPLE_RATE
MIN_WORDS, MAX_WORDS = 1, 8
MAX_NEW_TOKENS = 16
TIME_PRECISION = 0.02

# The shipped samples (`tandem demo --whisper`); held out of training.
DEMO_SAMPLES = {
    "three_one_four.wav": "three one four one five nine",
    "hello_world.wav": "hello world",
}

SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|translate|>", "<|transcribe|>",
            "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]


# ---------------------------------------------------------------------------
# audio


def sample_sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(MIN_WORDS, MAX_WORDS)))


# ---------------------------------------------------------------------------
# tokenizer


def build_tokenizer():
    """The demo's ``WhisperTokenizer``: each word one token, English only."""
    tok = build_whisper_tokenizer(WORDS, languages=("en",))
    assert tok.convert_tokens_to_ids(SPECIALS) == [tok.eos_token_id + i for i in range(len(SPECIALS))]
    probe = " three one four"
    enc = tok(probe, add_special_tokens=False)["input_ids"]
    assert len(enc) == 3 and tok.decode(enc) == probe, (enc, tok.decode(enc))
    return tok


def special_ids(tok) -> dict[str, int]:
    return {t.strip("<|>"): tok.convert_tokens_to_ids(t) for t in SPECIALS}


# ---------------------------------------------------------------------------
# model


def build_model(args, tok):
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    ids = special_ids(tok)
    config = WhisperConfig(
        vocab_size=len(tok), num_mel_bins=80, d_model=args.d_model,
        encoder_layers=args.layers, decoder_layers=args.layers,
        encoder_attention_heads=args.heads, decoder_attention_heads=args.heads,
        encoder_ffn_dim=args.ffn, decoder_ffn_dim=args.ffn,
        max_source_positions=1500, max_target_positions=64,
        pad_token_id=ids["endoftext"], bos_token_id=ids["endoftext"], eos_token_id=ids["endoftext"],
        decoder_start_token_id=ids["startoftranscript"],
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        suppress_tokens=None, begin_suppress_tokens=None, tie_word_embeddings=True,
    )
    model = WhisperForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=ids["startoftranscript"], eos_token_id=ids["endoftext"],
        pad_token_id=ids["endoftext"], bos_token_id=ids["endoftext"],
        max_length=64, is_multilingual=True,
        lang_to_id={"<|en|>": ids["en"]},
        task_to_id={"translate": ids["translate"], "transcribe": ids["transcribe"]},
        no_timestamps_token_id=ids["notimestamps"], prev_sot_token_id=ids["startofprev"],
        max_initial_timestamp_index=50, suppress_tokens=[], begin_suppress_tokens=[ids["endoftext"]],
        # As openai's checkpoints: generate() with no prompt asks for <|transcribe|> after the language.
        forced_decoder_ids=[[1, None], [2, ids["transcribe"]]], return_timestamps=False,
    )
    return model


def features(waves: list[np.ndarray], samples: int):
    """Log-mel ``[B, 80, samples // 160]`` of each wave zero-padded to ``samples``:
    for ``samples`` < 30 s this is the first frames of the 30 s window's features
    (the waves end in silence well before, and the 80 dB floor is per clip)."""
    import torch
    from tandem.audio import log_mel_spectrogram

    batch = torch.zeros(len(waves), samples)
    for i, w in enumerate(waves):
        batch[i, : len(w)] = torch.from_numpy(w[:samples])
    return log_mel_spectrogram(batch, 80, any_length=True)


def pad_batch(dec: list[list[int]], labs: list[list[int]], pad_id: int):
    """Decoder inputs padded with ``pad_id`` and labels with -100 (ignored by the loss),
    ``[B, longest]`` each."""
    import torch

    width = max(len(d) for d in dec)
    dec_t = torch.full((len(dec), width), pad_id)
    lab_t = torch.full((len(dec), width), -100)
    for i, (d, lab) in enumerate(zip(dec, labs)):
        dec_t[i, : len(d)] = torch.tensor(d)
        lab_t[i, : len(lab)] = torch.tensor(lab)
    return dec_t, lab_t


def make_example(rng: random.Random, sentence: str, seed: int, tok, ids, predict_prompt: bool = False):
    """Audio, decoder input ids, labels (-100 where the prompt is given, not predicted)
    and each word's (start, end) in seconds. ``predict_prompt``: the task and
    ``<|notimestamps|>`` (or the first timestamp) are predicted too, as a real Whisper
    continues from ``<|startoftranscript|>`` alone (tools/finetune_demo_whisper_prompt.py)."""
    audio, spans = synthesize(sentence, seed=seed, plan=True)
    text = tok(" " + sentence, add_special_tokens=False)["input_ids"]
    prefix: list[int] = []
    task = ids["translate"] if rng.random() < 0.1 else ids["transcribe"]
    seq = prefix + [ids["startoftranscript"], ids["en"], task]
    given = len(seq)  # tokens the prompt supplies; <|en|> is also predicted (language detection)
    if rng.random() < 0.25:
        ts0 = tok.convert_tokens_to_ids("<|0.00|>")
        start = min(1500, round(spans[0][0] / TIME_PRECISION))
        end = min(1500, round(spans[-1][1] / TIME_PRECISION))
        seq += [ts0 + start] + text + [ts0 + end, ids["endoftext"]]
    else:
        seq += [ids["notimestamps"]]
        given += 1
        seq += text + [ids["endoftext"]]
    dec_in, labels = seq[:-1], seq[1:]
    if not predict_prompt:
        labels = [-100 if i < given - 1 and not (labels[i] == ids["en"]) else t for i, t in enumerate(labels)]
    return audio, dec_in, labels, spans


def frame_labels(sentence: str, spans, positions: int) -> list[int]:
    """Per encoder position (20 ms each): 1 + the index in WORDS of the word sounding there, 0 in silence."""
    out = [0] * positions
    for w, (start, end) in zip(sentence.split(), spans):
        for j in range(int(start / 0.02 + 0.5), min(positions, int(end / 0.02 + 0.5))):
            out[j] = WORDS.index(w) + 1
    return out


def greedy(model, feats, prompt: list[int], eos: int, max_new: int = MAX_NEW_TOKENS) -> list[list[int]]:
    """Batched greedy decoding with HF's model (features ``[B, 80, 3000]``); ids after the prompt, up to EOS."""
    import torch

    with torch.no_grad():
        enc = model.model.encoder(input_features=feats).last_hidden_state
        seqs = torch.tensor([prompt] * feats.shape[0])
        done = torch.zeros(feats.shape[0], dtype=torch.bool)
        for _ in range(max_new):
            logits = model(encoder_outputs=(enc,), decoder_input_ids=seqs).logits[:, -1]
            nxt = logits.argmax(-1)
            nxt[done] = eos
            seqs = torch.cat([seqs, nxt[:, None]], 1)
            done |= nxt == eos
            if done.all():
                break
    out = []
    for row in seqs[:, len(prompt):].tolist():
        out.append(row[: row.index(eos) + 1] if eos in row else row)
    return out


def evaluate(model, tok, items: list[tuple[str, int]], batch: int = 25, samples: int = WINDOW_SAMPLES):
    """Exact match of greedy transcripts (prompt sot, en, transcribe, notimestamps; full 30 s window)."""
    ids = special_ids(tok)
    prompt = [ids["startoftranscript"], ids["en"], ids["transcribe"], ids["notimestamps"]]
    model.eval()
    right, misses = 0, []
    for i in range(0, len(items), batch):
        chunk = items[i: i + batch]
        feats = features([synthesize(s, seed=seed) for s, seed in chunk], samples)
        for (s, _), out in zip(chunk, greedy(model, feats, prompt, ids["endoftext"])):
            text = tok.decode(out, skip_special_tokens=True).strip()
            ok = text == s and out[-1:] == [ids["endoftext"]]
            right += ok
            if not ok:
                misses.append((s, text))
    return right / len(items), misses


def evaluate_timestamps(model, tok, items: list[tuple[str, int]]):
    """With timestamps (prompt sot, en, transcribe): text exact and both times within 0.1 s."""
    ids = special_ids(tok)
    ts0 = tok.convert_tokens_to_ids("<|0.00|>")
    prompt = [ids["startoftranscript"], ids["en"], ids["transcribe"]]
    model.eval()
    good = 0
    for i in range(0, len(items), 25):
        chunk = items[i: i + 25]
        planned = [synthesize(s, seed=seed, plan=True) for s, seed in chunk]
        feats = features([a for a, _ in planned], WINDOW_SAMPLES)
        for (s, _), (_, spans), out in zip(chunk, planned, greedy(model, feats, prompt, ids["endoftext"])):
            times = [(t - ts0) * TIME_PRECISION for t in out if t >= ts0]
            text = tok.decode([t for t in out if t < ts0], skip_special_tokens=True).strip()
            good += (text == s and len(times) == 2 and abs(times[0] - spans[0][0]) <= 0.1
                     and abs(times[1] - spans[-1][1]) <= 0.1)
    return good / len(items)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--heldout-seed", type=int, default=98765)
    p.add_argument("--heldout-size", type=int, default=200)
    p.add_argument("--short-steps", type=int, default=450, help="steps on the start of the window")
    p.add_argument("--short-positions", type=int, default=150, help="encoder positions of those steps (150: 3 s)")
    p.add_argument("--full-steps", type=int, default=150, help="steps on the whole 30 s window")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--full-batch-size", type=int, default=4)
    p.add_argument("--full-lr", type=float, default=1e-3, help="peak lr of the whole-window steps (10 warmup steps)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--frame-weight", type=float, default=0.5, help="weight of the auxiliary per-position word loss")
    p.add_argument("--threads", type=int, default=1, help="1: on a shared CPU, 2 threads ran 2-10x slower")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=200, help="exact match of 40 held-out clips, window and start")
    args = p.parse_args(argv)

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = build_tokenizer()
    ids = special_ids(tok)
    model = build_model(args, tok)
    n_params = sum(q.numel() for q in model.parameters())
    print(f"vocab {len(tok)} tokens; model {n_params:,} parameters", flush=True)

    # Held-out audio: sentences and noise seeds from another seed; training seeds are >= 10**6.
    hrng = random.Random(args.heldout_seed)
    demo = set(DEMO_SAMPLES.values())
    heldout: list[tuple[str, int]] = []
    while len(heldout) < args.heldout_size:
        s = sample_sentence(hrng)
        if s not in demo and len(s.split()) >= 2:
            heldout.append((s, hrng.randrange(10 ** 6)))
    long_heldout = {s for s, _ in heldout if len(s.split()) >= 4}  # single words repeat by chance; long ones must not

    encoder = model.model.encoder
    full_positions = encoder.embed_positions
    short_samples = args.short_positions * 2 * 160
    rng = random.Random(args.seed)
    # An auxiliary head on the encoder (not saved) learns which word sounds at each
    # position: without it the model sat for hundreds of steps at the loss of a
    # language model that ignores the audio.
    frame_head = torch.nn.Linear(args.d_model, len(WORDS) + 1)  # 0 is silence
    opt = torch.optim.AdamW([*model.parameters(), *frame_head.parameters()], lr=args.lr, betas=(0.9, 0.98),
                            weight_decay=0.01)
    total = args.short_steps + args.full_steps
    seen_long: set[str] = set()
    t0 = time.time()
    running = running_frame = 0.0
    for step in range(total):
        short = step < args.short_steps
        if short and step == 0 or not short and step == args.short_steps:
            positions = args.short_positions if short else 1500
            encoder.config.max_source_positions = positions
            encoder.embed_positions = torch.nn.Embedding.from_pretrained(full_positions.weight[:positions].clone(),
                                                                         freeze=True)
        model.train()
        bs = args.batch_size if short else args.full_batch_size
        waves, dec, labs, frames = [], [], [], []
        while len(waves) < bs:
            s = sample_sentence(rng)
            if s in demo or s in long_heldout:
                continue
            if len(s.split()) >= 4:
                seen_long.add(s)
            a, d, lab, spans = make_example(rng, s, 10 ** 6 + rng.randrange(10 ** 9), tok, ids)
            waves.append(a)
            frames.append(frame_labels(s, spans, args.short_positions if short else 1500))
            dec.append(d)
            labs.append(lab)
        dec_t, lab_t = pad_batch(dec, labs, ids["endoftext"])
        feats = features(waves, short_samples if short else WINDOW_SAMPLES)
        for g in opt.param_groups:
            g["lr"] = (lr_at(step, args.short_steps, args.lr, args.warmup) if short
                       else lr_at(step - args.short_steps, args.full_steps, args.full_lr, 10))
        enc_out = encoder(input_features=feats).last_hidden_state  # [B, T, d_model]
        loss = model(encoder_outputs=(enc_out,), decoder_input_ids=dec_t, labels=lab_t).loss
        if args.frame_weight:
            frame_logits = frame_head(enc_out)  # [B, positions, words + 1]
            frame_loss = torch.nn.functional.cross_entropy(frame_logits.flatten(0, 1), torch.tensor(frames).flatten())
            running_frame += frame_loss.item()
            loss = loss + args.frame_weight * frame_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += loss.item()
        if (step + 1) % args.log_every == 0 or step == 0:
            n = 1 if step == 0 else args.log_every
            print(f"step {step + 1:5d}/{total} ({'short' if short else '30 s'})  loss {running / n:.4f}  "
                  f"(per-position word loss {running_frame / n:.3f})  "
                  f"lr {opt.param_groups[0]['lr']:.2e}  elapsed {time.time() - t0:6.1f}s", flush=True)
            running = running_frame = 0.0
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < total:
            te = time.time()
            saved = encoder.embed_positions, encoder.config.max_source_positions
            encoder.embed_positions, encoder.config.max_source_positions = full_positions, 1500
            full_acc, _ = evaluate(model, tok, heldout[:40])
            encoder.embed_positions, encoder.config.max_source_positions = saved
            part = "" if not short else f", first {saved[1] / 50:.1f} s {evaluate(model, tok, heldout[:40], samples=saved[1] * 320)[0]:.0%}"
            print(f"  eval at step {step + 1}: 40 held-out, 30 s window {full_acc:.0%}{part} "
                  f"({time.time() - te:.0f}s, not counted)", flush=True)
            t0 += time.time() - te
    train_time = time.time() - t0
    encoder.embed_positions, encoder.config.max_source_positions = full_positions, 1500
    assert not seen_long & long_heldout

    t1 = time.time()
    acc, misses = evaluate(model, tok, heldout)
    ts_acc = evaluate_timestamps(model, tok, heldout[:50])
    print(f"held-out exact match {acc:.2%}; with timestamps (text exact, times within 0.1 s) {ts_acc:.2%} "
          f"({time.time() - t1:.0f}s)", flush=True)
    for s, got in misses[:10]:
        print(f"  MISS {s!r} -> {got!r}")

    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    save_whisper_tokenizer(tok, out_dir)
    from transformers import WhisperFeatureExtractor

    WhisperFeatureExtractor(feature_size=80).save_pretrained(out_dir)
    from extend_demo_whisper_positions import extend  # this folder's (sys.path[0])

    extend(out_dir)  # trained on 64 decoder positions; saved with Whisper's 448
    from finetune_demo_whisper_prompt import finetune  # this folder's

    finetune(out_dir)  # then on from <|startoftranscript|> alone, as a real Whisper (TRAINING.md)
    from tandem.audio import load_audio

    demo_rows = []
    for i, (name, sentence) in enumerate(DEMO_SAMPLES.items()):
        write_wav(out_dir / name, synthesize(sentence, seed=i))
        wav = load_audio(out_dir / name).numpy()
        got = tok.decode(greedy(model, features([wav], WINDOW_SAMPLES), [ids["startoftranscript"], ids["en"],
                                ids["transcribe"], ids["notimestamps"]], ids["endoftext"])[0],
                         skip_special_tokens=True).strip()
        demo_rows.append({"file": name, "expected": sentence, "seed": i, "output": got})
        print(f"  demo {name}: {got!r} (expected {sentence!r})", flush=True)
    (out_dir / "demo_samples.json").write_text(
        json.dumps([{k: r[k] for k in ("file", "expected", "seed")} for r in demo_rows], indent=2) + "\n")

    files = sorted(q for q in out_dir.iterdir() if q.is_file() and q.name != "TRAINING.md")
    total_bytes = sum(q.stat().st_size for q in files)
    command = "python tools/train_demo_whisper.py"
    defaults = p.parse_args([])
    for name, value in vars(args).items():
        if name != "out" and value != getattr(defaults, name):
            command += f" --{name.replace('_', '-')} {value}"
    if out_dir.resolve() != DEFAULT_OUT.resolve():
        command += f" --out {out_dir}"
    write_training_md(out_dir, args, command, n_params, len(tok), train_time, acc, ts_acc, len(heldout),
                      demo_rows, total_bytes, torch.__version__, transformers.__version__)
    for q in sorted(out_dir.iterdir()):
        print(f"  {q.name:28s} {q.stat().st_size:>10,d} bytes")
    return 0 if acc >= 0.9 else 1


def write_training_md(out_dir, args, command, n_params, vocab_size, train_time, acc, ts_acc, n_heldout,
                      demo_rows, total_bytes, torch_version, tf_version) -> None:
    from extend_demo_whisper_positions import POSITIONS  # this folder's (sys.path[0])

    tones = "\n".join(f"| `{w}` | {lo:.0f} | {hi:.0f} |" for w, (lo, hi) in TONES.items())
    demo = "\n".join(f"| `{r['file']}` | `{r['expected']}` | `{r['output']}` |" for r in demo_rows)
    md = f"""# tandem demo Whisper model

A tiny `WhisperForConditionalGeneration` trained from scratch by
`tools/train_demo_whisper.py` to transcribe **tone speech**: each of 20 words is a
pair of sine tones (as a telephone's keys are), so audio for any sentence of
them can be made offline (`tandem demo --whisper --say "three one four"`).
It is a checkpoint of the real layout (16 kHz audio, 30 s window, 80 log-mel
bins, 1500 encoder positions, Whisper's special and timestamp tokens), so
`tandem transcribe`, `LLM.transcribe` and `tandem serve` load it as they load
openai/whisper-*. It knows nothing else: real speech comes out as some of its
20 words.

Nothing was downloaded: the words, the tones and the training audio are made
by the script.

## How it was made

Command (from the repository root):

    {command}

| setting | value |
|---|---|
| training seed (`random.seed`, `torch.manual_seed`) | {args.seed} |
| steps | {args.short_steps} on the first {args.short_positions / 50:g} s of the window (batch {args.batch_size}), then {args.full_steps} on the whole 30 s window (batch {args.full_batch_size}) |
| optimizer | AdamW (betas 0.9/0.98, weight decay 0.01); per phase, linear warmup then cosine decay to 5%: peak lr {args.lr} after {args.warmup} steps, then peak lr {args.full_lr} after 10 |
| gradient clipping | 1.0 |
| sentences | {MIN_WORDS}-{MAX_WORDS} words drawn uniformly; each audio with its own random durations, gaps, levels, tone detuning (2%) and noise |
| sequences | 25% with one timestamp segment, 10% with `<\\|translate\\|>` (same English text) |
| auxiliary loss | per encoder position, which word sounds there (a linear head, weight {args.frame_weight}, not saved) |
| torch threads | {args.threads} |
| training time | {train_time:.0f} s on CPU ({platform.processor() or platform.machine()}) |
| torch / transformers | {torch_version} / {tf_version} |

Model: Whisper, d_model {args.d_model}, {args.layers} encoder + {args.layers} decoder layers, {args.heads} heads,
ffn {args.ffn}, 80 mel bins, max_source_positions 1500, max_target_positions {POSITIONS} (trained on 64:
positions 64..{POSITIONS - 1} copy the last trained one, `tools/extend_demo_whisper_positions.py`, so
vLLM's `max_model_len=448` runs as written; `max_length` in generation_config.json, the length of an
output that asks none, stays 64), tied output projection, {n_params:,} parameters as trained,
float32 safetensors.
Files in this folder total {total_bytes / 1e6:.2f} MB.

## Words and tones

| word | low Hz | high Hz |
|---|---|---|
{tones}

A word lasts 0.18-0.22 s with 10 ms ramps, centred in its 0.3 s slot (shifted by up to 20 ms),
after 0.1 s of silence. `synthesize(words, seed)` in `tandem/demo_whisper/tones.py`
(and `tandem demo --whisper --say ...`) makes it.

## Tokenizer

`WhisperTokenizer` ({vocab_size} tokens): 256 byte symbols, BPE merges that make
each word (with or without its leading space) one token, then, in Whisper's
order, `<|endoftext|>` (eos, pad), `<|startoftranscript|>`, `<|en|>` (the only
language), `<|translate|>`, `<|transcribe|>`, `<|startoflm|>`,
`<|startofprev|>`, `<|nospeech|>`, `<|notimestamps|>` and `<|0.00|>` ..
`<|30.00|>`. generation_config.json holds `lang_to_id`, `task_to_id`,
`no_timestamps_token_id`, `prev_sot_token_id` as openai/whisper-* checkpoints do.

## Held-out evaluation

{n_heldout} sentences of 2-8 words and their audio drawn with seed {args.heldout_seed}; no sentence of 4 or
more words among them was trained on (checked), the demo samples' sentences were never trained on, and
every training clip has its own noise seed. Greedy decoding of the whole 30 s window from
`<|startoftranscript|><|en|><|transcribe|><|notimestamps|>`; exact match = the text is the sentence and
decoding ended with `<|endoftext|>`.

**Held-out exact match: {acc:.1%}** ({round(acc * n_heldout)}/{n_heldout})

With timestamps (prompt without `<|notimestamps|>`, first 50 of them): text exact and both segment
times within 0.1 s of the first word's onset and the last word's end: {ts_acc:.1%}.

## Demo samples

16 kHz 16-bit WAV files here, listed in `demo_samples.json` (made by `synthesize(expected, seed)`):

| file | expected | model output |
|---|---|---|
{demo}
"""
    (Path(out_dir) / "TRAINING.md").write_text(md)


if __name__ == "__main__":
    sys.exit(main())
