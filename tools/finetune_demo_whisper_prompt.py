"""Teach the demo Whisper (tandem/demo_whisper) to go on from ``<|startoftranscript|>`` alone.

The demo was trained with its prompt given: it predicts ``<|en|>`` after
``<|startoftranscript|>`` (language detection) but nothing was asked of it after ``<|en|>``,
so from vLLM's Whisper prompt, ``"<|startoftranscript|>"`` alone, it wrote ``<|en|>`` over
and over and no text. A real Whisper goes on with the task, ``<|notimestamps|>`` and the
transcript. This continues training the shipped checkpoint on the training script's data
(``make_example(..., predict_prompt=True)``: the task and ``<|notimestamps|>`` or the first
timestamp are predicted too) on the whole 30 s window, its weight matrices only, and writes
its weights back. Run
after tools/train_demo_whisper.py (which calls it), from the repository root:

    python tools/finetune_demo_whisper_prompt.py             # tandem/demo_whisper in place
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_demo_whisper import (  # noqa: E402
    DEFAULT_OUT, DEMO_SAMPLES, WINDOW_SAMPLES, evaluate, features, greedy, make_example, pad_batch,
    sample_sentence, special_ids,
)


def finetune(folder: Path, steps: int = 120, batch: int = 4, lr: float = 3e-4, seed: int = 4321,
             threads: int = 1, log_every: int = 20) -> dict:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import WhisperForConditionalGeneration, WhisperTokenizer

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tok = WhisperTokenizer.from_pretrained(folder)
    ids = special_ids(tok)
    model = WhisperForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    rng = random.Random(seed)
    demo = set(DEMO_SAMPLES.values())
    # Only the weight matrices move: the layer norms, biases and positions stay as trained, which
    # tests that redraw the matrices at random (a random Whisper with the demo's tokenizer) rely on.
    trained = [q for name, q in model.named_parameters() if q.dim() == 2 and "embed_positions" not in name]
    for name, q in model.named_parameters():
        q.requires_grad_(q.dim() == 2 and "embed_positions" not in name)
    opt = torch.optim.AdamW(trained, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    t0, running = time.time(), 0.0
    for step in range(steps):
        model.train()
        waves, dec, labs = [], [], []
        while len(waves) < batch:
            s = sample_sentence(rng)
            if s in demo:
                continue
            a, d, lab, _ = make_example(rng, s, 2 * 10 ** 9 + rng.randrange(10 ** 9), tok, ids, predict_prompt=True)
            waves.append(a)
            dec.append(d)
            labs.append(lab)
        dec_t, lab_t = pad_batch(dec, labs, ids["endoftext"])
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / 10)
        loss = model(input_features=features(waves, WINDOW_SAMPLES), decoder_input_ids=dec_t, labels=lab_t).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        running += loss.item()
        if (step + 1) % log_every == 0:
            print(f"step {step + 1}/{steps} loss {running / log_every:.4f} elapsed {time.time() - t0:.0f}s", flush=True)
            running = 0.0
    model.eval()
    weights = load_file(folder / "model.safetensors")
    state = model.state_dict()
    save_file({k: state[k].detach().contiguous() for k in weights}, folder / "model.safetensors",
              metadata={"format": "pt"})
    return {"steps": steps, "batch": batch, "lr": lr, "seed": seed, "seconds": time.time() - t0}


def from_start_of_transcript(folder: Path, items) -> float:
    """Exact match of greedy transcripts from ``<|startoftranscript|>`` alone (special tokens dropped)."""
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperTokenizer
    from tandem.demo_whisper import synthesize

    tok = WhisperTokenizer.from_pretrained(folder)
    ids = special_ids(tok)
    model = WhisperForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    feats = features([synthesize(s, seed=seed) for s, seed in items], WINDOW_SAMPLES)
    outs = greedy(model, feats, [ids["startoftranscript"]], ids["endoftext"], max_new=24)
    return sum(tok.decode(o, skip_special_tokens=True).strip() == s for (s, _), o in zip(items, outs)) / len(items)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--eval", type=int, default=50, help="held-out sentences checked after (0: none)")
    args = p.parse_args(argv)
    print(finetune(args.out, steps=args.steps), flush=True)
    if args.eval:
        import torch
        from transformers import WhisperForConditionalGeneration, WhisperTokenizer

        hrng = random.Random(98765)
        items = []
        while len(items) < args.eval:
            s = sample_sentence(hrng)
            if len(s.split()) >= 2 and s not in DEMO_SAMPLES.values():
                items.append((s, hrng.randrange(10 ** 6)))
        model = WhisperForConditionalGeneration.from_pretrained(args.out, dtype=torch.float32).eval()
        acc, misses = evaluate(model, WhisperTokenizer.from_pretrained(args.out), items)
        print(f"held-out exact match, full prompt: {acc:.2%}; from <|startoftranscript|> alone: "
              f"{from_start_of_transcript(args.out, items):.2%}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
