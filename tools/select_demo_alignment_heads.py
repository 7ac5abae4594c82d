"""Choose the demo Whisper's ``alignment_heads`` by measurement, and write them into its
``generation_config.json``.

Word timestamps (HF's ``return_token_timestamps``, tandem's ``word_timestamps``) align
text to audio with the cross-attention of a few decoder heads: the ones that follow
where in the audio the decoder is. openai found theirs by measuring which heads'
attention tracks the speech; this does the same for the demo model, whose audio is
made with each word's true span known (``tandem.demo_whisper.synthesize(plan=True)``).

For sentences of random demo words, the reference transcript is read by HF's
``WhisperForConditionalGeneration`` (teacher-forced, prompt ``<|startoftranscript|>
<|en|><|transcribe|><|notimestamps|>``, as ``tandem transcribe --word-timestamps``
decodes) with ``output_attentions``; for every non-empty set of decoder heads, the
words' times come from tandem's own alignment (``token_timestamps``: normalize,
median filter, average over the heads, DTW; a word spans the previous token's time to
its own, as ``transcribe`` does). A set's error is the mean over words of
``|start - true start| + |end - true end|``; the set with the smallest error wins.

    python tools/select_demo_alignment_heads.py            # measure and print
    python tools/select_demo_alignment_heads.py --write    # also update generation_config.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import random

import numpy as np
import torch

from tandem.demo_whisper import PATH, WORDS, synthesize
from tandem.model_zoo.whisper.alignment import token_timestamps

MEDIAN_FILTER_WIDTH = 7  # HF's default, which transcribe uses


def sentences(count: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))), seed + i) for i in range(count)]


def attentions(model, extractor, tokenizer, text: str, seed: int):
    """The cross-attention ``[layers, heads, tokens, 1500]`` of the reference transcript,
    the prompt length, the text's token ids, the clip's frames and its words' true spans."""
    audio, spans = synthesize(text, seed=seed, plan=True)
    gen = model.generation_config
    prompt = [gen.decoder_start_token_id, gen.lang_to_id["<|en|>"], gen.task_to_id["transcribe"],
              gen.no_timestamps_token_id]
    ids = tokenizer(" " + text, add_special_tokens=False)["input_ids"]
    if len(ids) != len(spans):
        raise SystemExit(f"expected one token per demo word: {text!r} -> {ids}")
    features = extractor(audio, sampling_rate=16000, return_tensors="pt").input_features
    with torch.no_grad():
        out = model(input_features=features, decoder_input_ids=torch.tensor([prompt + ids]), output_attentions=True)
    cross = torch.stack([a[0] for a in out.cross_attentions])  # [layers, heads, tokens, 1500]
    return cross, len(prompt), ids, len(audio) // 160, spans


def word_error(cross, num_prompt, ids, frames, spans, heads) -> float:
    """Mean ``|start error| + |end error|`` in seconds over the words, for the head set."""
    # The queries reading the generated tokens but the last (the text, then EOS is not read).
    weights = torch.stack([cross[layer, head, num_prompt:num_prompt + len(ids)] for layer, head in heads])
    times = token_timestamps(weights, num_prompt, len(ids) + 1, median_filter_width=MEDIAN_FILTER_WIDTH,
                             num_frames=frames)[num_prompt:]
    starts = [0.0, *times[: len(ids) - 1]]
    return float(np.mean([abs(s - a) + abs(e - b) for s, e, (a, b) in zip(starts, times[: len(ids)], spans)]))


def main() -> None:
    from transformers import AutoTokenizer, WhisperFeatureExtractor, WhisperForConditionalGeneration

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sentences", type=int, default=40)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--write", action="store_true", help="write the chosen heads into generation_config.json")
    args = ap.parse_args()

    model = WhisperForConditionalGeneration.from_pretrained(PATH, attn_implementation="eager").eval()
    extractor, tokenizer = WhisperFeatureExtractor.from_pretrained(PATH), AutoTokenizer.from_pretrained(PATH)
    samples = json.loads((PATH / "demo_samples.json").read_text())
    clips = [attentions(model, extractor, tokenizer, s["expected"], s["seed"]) for s in samples]
    clips += [attentions(model, extractor, tokenizer, text, seed) for text, seed in sentences(args.sentences,
                                                                                               args.seed)]
    cfg = model.config
    all_heads = [(layer, head) for layer in range(cfg.decoder_layers) for head in range(cfg.decoder_attention_heads)]
    scores = {}
    for size in range(1, len(all_heads) + 1):
        for heads in itertools.combinations(all_heads, size):
            scores[heads] = float(np.mean([word_error(*clip, heads) for clip in clips]))
    print(f"{len(clips)} clips; mean word error (|start| + |end|, seconds) per single head:")
    for heads in itertools.combinations(all_heads, 1):
        print(f"  layer {heads[0][0]} head {heads[0][1]}: {scores[heads]:.3f}")
    ranked = sorted(scores, key=scores.get)
    print("best head sets:")
    for heads in ranked[:5]:
        print(f"  {[list(h) for h in heads]}: {scores[heads]:.3f}")
    best = [list(h) for h in ranked[0]]
    if args.write:
        path = PATH / "generation_config.json"
        config = json.loads(path.read_text())
        config["alignment_heads"] = best
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        print(f"wrote alignment_heads={best} to {path}")


if __name__ == "__main__":
    main()
