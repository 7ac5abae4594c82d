#!/usr/bin/env python
"""Train the tiny demo encoder/decoder checkpoint shipped with tandem.

Task: reverse the order of the words of a short lowercase English sentence,

    "the cat sat on the mat"  ->  "mat the on sat cat the"

so anybody can check an answer at a glance (see ``reverse_words``).

The model is a small ``transformers.BartForConditionalGeneration`` saved in
standard Hugging Face format (config.json, model.safetensors, generation_config.json,
tokenizer.json, tokenizer_config.json, special_tokens_map.json) together with a
word-level tokenizer built with the ``tokenizers`` library:

    <s>=0 (bos)   <pad>=1   </s>=2 (eos, decoder_start)   <unk>=3   words = 4..

Encoder input:   <s> w_1 ... w_n </s>
Labels:          <s> w_n ... w_1 </s>
Decoder input:   </s> <s> w_n ... w_1      (labels shifted right by HF with decoder_start=2)

so greedy generation from the decoder prompt [[2, 0]] (decoder_start, bos) yields
``w_n ... w_1 </s>``.

Usage (from the repository root):

    python tools/train_demo.py                 # writes tandem/demo_model/
    python tools/train_demo.py --out DIR --steps 2000 --seed 1234
    python tools/train_demo.py --draft --out DIR   # a smaller draft for speculative decoding

``--draft`` trains a smaller model on the same task and vocabulary (d_model 64
and ffn 256, against the target's 128 and 512; 2 layers each side, 4 heads,
2000 steps; each unless given): a draft for ``speculative_config={"model": DIR,
...}`` with the shipped demo model as the target (``benchmarks/speculative.py
--draft DIR``). It reached 100% held-out exact match in 641 s on a loaded
2-core machine. A one-layer decoder (``--decoder-layers 1``) would cost less
per proposed token but did not learn the reversal in 2000 steps (0%).

Runs on CPU in a few minutes (torch.set_num_threads(2) by default). Nothing is
downloaded.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "tandem" / "demo_model"

SPECIAL_TOKENS = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
BOS_ID, PAD_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
DECODER_START_ID = EOS_ID

MIN_WORDS, MAX_WORDS = 3, 8
# --draft: a smaller model of the same task and vocabulary (each field unless given).
DRAFT_PRESET = {"d_model": 64, "layers": 2, "heads": 4, "ffn": 256, "steps": 2000}
# Held-out exact match a trained model must reach (a draft only proposes: less will do).
MIN_ACCURACY, MIN_DRAFT_ACCURACY = 0.95, 0.5
MAX_NEW_TOKENS = 12

# A few hundred common lowercase English words (letters only, no duplicates).
# Order matters: word i gets token id 4 + i.
WORDS = """
the a an this that these those my your his her its our their some every no
one two three four five six seven eight nine ten
i you he she it we they me him us them who what where when why how
cat dog bird fish horse cow pig sheep mouse rabbit fox bear lion tiger duck
frog snake bee ant owl wolf goat hen deer monkey
man woman boy girl child baby friend mother father sister brother king queen
teacher doctor farmer student driver cook
house home room door window table chair bed mat floor wall roof garden yard
street road city town village farm school shop market park bridge river lake
sea hill mountain forest tree flower grass field sky sun moon star cloud rain
snow wind fire water stone rock sand
book pen paper letter box bag cup plate bowl spoon knife bottle key clock
lamp ball toy hat coat shoe shirt dress ring map phone car bus train boat
ship bike plane
bread cake apple milk tea coffee egg cheese rice soup meat fruit juice honey
day night morning evening week year time
is was are were be has had have do did will can
sat ran saw ate made took gave found went came said told knew felt kept left
put got sang drew wrote read played walked jumped looked opened closed lost
won liked loved helped asked wanted needed watched cooked painted fixed
cleaned carried pushed pulled caught threw built bought sold sent brought
sit run see eat make take give find go come say tell know feel keep play
walk jump look open close help like love want need watch cook paint fix
clean carry push pull catch throw build buy sell send bring
big small little old new young good bad hot cold warm cool long short tall
happy sad red blue green yellow black white brown pink round soft hard fast
slow quiet loud clean dark bright sweet
on in at to from with by for of under over near behind above below into
onto up down out off around through across
and but or so because then
very too also not just now here there today soon again always never often
""".split()
WORDS = list(dict.fromkeys(WORDS))  # stable de-duplication

# Fixed demo sentences for `tandem demo` (all words are in WORDS).
DEMO_SENTENCES = [
    "the cat sat on the mat",
    "my dog ate the red apple",
    "she read a very long book",
    "we walked to the park today",
    "the old man sold his blue car",
]


def reverse_words(sentence: str) -> str:
    """Reference answer: the words of ``sentence`` in reverse order, space-joined."""
    return " ".join(reversed(sentence.split()))


# ---------------------------------------------------------------------------
# data


def vocabulary() -> dict[str, int]:
    assert all(w.isalpha() and w.islower() for w in WORDS), "words must be lowercase letters"
    vocab = dict(SPECIAL_TOKENS)
    for w in WORDS:
        vocab[w] = len(vocab)
    return vocab


def sample_sentence(rng: random.Random) -> str:
    n = rng.randint(MIN_WORDS, MAX_WORDS)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def heldout_sentences(seed: int, n: int, exclude: set[str]) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        s = sample_sentence(rng)
        if s in seen or s in exclude:
            continue
        seen.add(s)
        out.append(s)
    return out


# ---------------------------------------------------------------------------
# tokenizer


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = vocabulary()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", BOS_ID), ("</s>", EOS_ID)],
    )
    # WordPiece decoder: joins tokens with single spaces (no "##" word pieces exist here).
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(list(SPECIAL_TOKENS))  # keeps ids 0..3, marks them special

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=64,
        clean_up_tokenization_spaces=False,
    )
    # sanity checks
    assert [fast.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert (fast.bos_token_id, fast.pad_token_id, fast.eos_token_id, fast.unk_token_id) == (0, 1, 2, 3)
    probe = "the cat sat on the mat"
    ids = fast(probe)["input_ids"]
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID and len(ids) == 8, ids
    assert fast.decode(ids, skip_special_tokens=True) == probe, fast.decode(ids, skip_special_tokens=True)
    assert fast("zebra cat")["input_ids"] == [BOS_ID, UNK_ID, vocab["cat"], EOS_ID]
    return fast


def encode_batch(sentences: list[str], vocab: dict[str, int], reverse: bool):
    """Return a right-padded LongTensor of <s> w.. </s> (words reversed if ``reverse``)."""
    import torch

    rows = []
    for s in sentences:
        ids = [vocab[w] for w in s.split()]
        if reverse:
            ids.reverse()
        rows.append([BOS_ID] + ids + [EOS_ID])
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r)
    return out


# ---------------------------------------------------------------------------
# model / training


def build_model(args, vocab_size: int):
    from transformers import BartConfig, BartForConditionalGeneration, GenerationConfig

    config = BartConfig(
        vocab_size=vocab_size,
        max_position_embeddings=64,
        d_model=args.d_model,
        encoder_layers=args.layers,
        decoder_layers=args.decoder_layers or args.layers,
        encoder_attention_heads=args.heads,
        decoder_attention_heads=args.heads,
        encoder_ffn_dim=args.ffn,
        decoder_ffn_dim=args.ffn,
        dropout=0.1,
        attention_dropout=0.0,
        activation_dropout=0.0,
        activation_function="gelu",
        scale_embedding=False,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        decoder_start_token_id=DECODER_START_ID,
        forced_eos_token_id=None,
        tie_word_embeddings=True,
    )
    model = BartForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        decoder_start_token_id=DECODER_START_ID,
        forced_bos_token_id=None,
        forced_eos_token_id=None,
        num_beams=1,
        do_sample=False,
        max_new_tokens=MAX_NEW_TOKENS,
    )
    return model


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def greedy_generate(model, sentences: list[str], vocab, batch_size: int = 100) -> list[list[int]]:
    """HF greedy generate from decoder prompt [[2, 0]]; returns generated ids after the prompt."""
    import torch

    model.eval()
    outs: list[list[int]] = []
    with torch.no_grad():
        for i in range(0, len(sentences), batch_size):
            chunk = sentences[i : i + batch_size]
            input_ids = encode_batch(chunk, vocab, reverse=False)
            attention_mask = (input_ids != PAD_ID).long()
            prompt = torch.tensor([[DECODER_START_ID, BOS_ID]] * len(chunk))
            gen = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                decoder_input_ids=prompt,
                num_beams=1,
                do_sample=False,
                max_new_tokens=MAX_NEW_TOKENS,
            )
            for row in gen[:, 2:].tolist():
                outs.append(row)
    return outs


def evaluate(model, tokenizer, sentences, vocab):
    """Exact match: generated ids must be the reversed words followed by </s>."""
    gens = greedy_generate(model, sentences, vocab)
    correct = 0
    examples = []
    for s, g in zip(sentences, gens):
        # cut at first eos; require that eos was produced
        if EOS_ID in g:
            ended = True
            g = g[: g.index(EOS_ID)]
        else:
            ended = False
        text = tokenizer.decode(g, skip_special_tokens=True)
        ok = ended and text == reverse_words(s)
        correct += ok
        examples.append((s, text, ok))
    return correct / len(sentences), examples


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (default: tandem/demo_model)")
    p.add_argument("--seed", type=int, default=1234, help="training seed")
    p.add_argument("--heldout-seed", type=int, default=98765, help="seed for the held-out evaluation set")
    p.add_argument("--heldout-size", type=int, default=500)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--decoder-layers", type=int, default=None, help="decoder layers (default: --layers)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--draft", action="store_true",
                   help=f"train a smaller draft model for speculative decoding: {DRAFT_PRESET} unless given; "
                        "needs --out (the shipped demo model is never overwritten by a draft)")
    args = p.parse_args(argv)
    if args.draft:
        if args.out.resolve() == DEFAULT_OUT.resolve():
            p.error("--draft needs --out DIR: the shipped demo model is the draft's target, not its output")
        defaults = p.parse_args([])
        for name, value in DRAFT_PRESET.items():
            if getattr(args, name) == getattr(defaults, name):
                setattr(args, name, value)

    import torch
    import transformers

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    vocab = vocabulary()
    tokenizer = build_tokenizer()
    for s in DEMO_SENTENCES:
        assert all(w in vocab for w in s.split()), f"demo sentence has out-of-vocabulary words: {s!r}"
        assert MIN_WORDS <= len(s.split()) <= MAX_WORDS

    # Held-out set (different seed); excluded from training along with the demo sentences.
    heldout = heldout_sentences(args.heldout_seed, args.heldout_size, exclude=set(DEMO_SENTENCES))
    excluded = set(heldout) | set(DEMO_SENTENCES)

    model = build_model(args, vocab_size=len(vocab))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"vocab: {len(vocab)} tokens ({len(WORDS)} words + 4 specials); model: {n_params:,} parameters", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    rng = random.Random(args.seed)
    train_seen: set[str] = set()
    skipped = 0
    t0 = time.time()
    model.train()
    running = 0.0
    for step in range(args.steps):
        batch = []
        while len(batch) < args.batch_size:
            s = sample_sentence(rng)
            if s in excluded:
                skipped += 1
                continue
            batch.append(s)
        train_seen.update(batch)
        input_ids = encode_batch(batch, vocab, reverse=False)
        labels = encode_batch(batch, vocab, reverse=True)
        attention_mask = (input_ids != PAD_ID).long()
        labels = labels.masked_fill(labels == PAD_ID, -100)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += loss.item()
        if (step + 1) % args.log_every == 0 or step == 0:
            n = 1 if step == 0 else args.log_every
            print(
                f"step {step + 1:5d}/{args.steps}  loss {running / n:.4f}  lr {opt.param_groups[0]['lr']:.2e}  "
                f"elapsed {time.time() - t0:6.1f}s",
                flush=True,
            )
            running = 0.0
    train_time = time.time() - t0

    overlap = train_seen & set(heldout)
    assert not overlap, f"held-out sentences leaked into training: {sorted(overlap)[:5]}"
    print(
        f"training done in {train_time:.1f}s; {len(train_seen):,} distinct training sentences, "
        f"0 overlap with {len(heldout)} held-out sentences ({skipped} sampled duplicates skipped)",
        flush=True,
    )

    t1 = time.time()
    acc, examples = evaluate(model, tokenizer, heldout, vocab)
    eval_time = time.time() - t1
    print(f"held-out exact match (greedy, decoder prompt [[2, 0]]): {acc:.2%} ({eval_time:.1f}s)", flush=True)
    for s, out, ok in [e for e in examples if not e[2]][:10]:
        print(f"  MISS  {s!r} -> {out!r} (want {reverse_words(s)!r})")
    demo_acc, demo_examples = evaluate(model, tokenizer, DEMO_SENTENCES, vocab)
    for s, out, ok in demo_examples:
        print(f"  demo  {s!r} -> {out!r}  {'ok' if ok else 'WRONG'}")

    # ---- save
    out_dir: Path = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # transformers 5 no longer writes special_tokens_map.json and records the class as
    # "TokenizersBackend"; write the classic files so transformers 4.x loads them too.
    tok_cfg_path = out_dir / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    special_map = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    with open(out_dir / "demo_sentences.json", "w") as f:
        json.dump(
            [{"input": s, "expected": reverse_words(s)} for s in DEMO_SENTENCES], f, indent=2
        )
        f.write("\n")

    # reload check: the saved artifact gives the same answers
    from transformers import AutoTokenizer, BartForConditionalGeneration

    reloaded = BartForConditionalGeneration.from_pretrained(out_dir)
    retok = AutoTokenizer.from_pretrained(out_dir)
    assert retok.decode(retok("the cat sat")["input_ids"], skip_special_tokens=True) == "the cat sat"
    assert (retok.bos_token_id, retok.pad_token_id, retok.eos_token_id, retok.unk_token_id) == (0, 1, 2, 3)
    re_acc, _ = evaluate(reloaded, retok, DEMO_SENTENCES, vocab)
    assert re_acc == demo_acc, (re_acc, demo_acc)

    files = sorted(p for p in out_dir.iterdir() if p.is_file() and p.name != "TRAINING.md")
    total_bytes = sum(p.stat().st_size for p in files)

    try:
        cmd_out = os.path.relpath(out_dir.resolve(), REPO_ROOT)
    except ValueError:
        cmd_out = str(out_dir)
    command = "python tools/train_demo.py" + (" --draft" if args.draft else "") + ("" if out_dir.resolve() == DEFAULT_OUT.resolve() else f" --out {cmd_out}")
    defaults = p.parse_args([])
    for name in ("seed", "heldout_seed", "heldout_size", "steps", "batch_size", "lr", "warmup",
                 "d_model", "layers", "decoder_layers", "heads", "ffn", "threads"):
        if getattr(args, name) != getattr(defaults, name):
            command += f" --{name.replace('_', '-')} {getattr(args, name)}"

    demo_lines = "\n".join(
        f"| `{s}` | `{reverse_words(s)}` | `{out}` |" for s, out, ok in demo_examples
    )
    md = f"""# tandem demo {"draft " if args.draft else ""}model

A tiny `BartForConditionalGeneration` trained from scratch by `tools/train_demo.py`
to **reverse the order of the words** of a short lowercase English sentence:

    the cat sat on the mat  ->  mat the on sat cat the

Nothing was downloaded: the vocabulary is the word list in `tools/train_demo.py`,
and the training data is random word sequences sampled on the fly.

## How it was made

Command (from the repository root):

    {command}

| setting | value |
|---|---|
| training seed (`random.seed`, `torch.manual_seed`) | {args.seed} |
| steps | {args.steps} |
| batch size | {args.batch_size} sentences |
| optimizer | AdamW (betas 0.9/0.98, weight decay 0.01), peak lr {args.lr}, {args.warmup} warmup steps, cosine decay to 5% |
| gradient clipping | 1.0 |
| sentences | {MIN_WORDS}-{MAX_WORDS} words drawn uniformly from the vocabulary |
| distinct training sentences | {len(train_seen):,} |
| torch threads | {args.threads} |
| training time | {train_time:.0f} s on CPU ({platform.processor() or platform.machine()}) |
| torch / transformers | {torch.__version__} / {transformers.__version__} |

Model: BART, d_model {args.d_model}, {args.layers} encoder + {args.decoder_layers or args.layers} decoder layers,
{args.heads} heads, ffn {args.ffn}, max_position_embeddings 64, dropout 0.1 (training),
tied input/output embeddings, {n_params:,} parameters, float32 safetensors.
Files in this folder total {total_bytes / 1e6:.2f} MB.

## Tokenizer and sequence format

Word-level (`tokenizers` WordLevel model, Whitespace pre-tokenizer, WordPiece decoder so
`decode(ids, skip_special_tokens=True)` returns space-joined words), {len(vocab)} tokens:

| token | id |
|---|---|
| `<s>` (bos) | 0 |
| `<pad>` | 1 |
| `</s>` (eos, decoder_start_token_id) | 2 |
| `<unk>` | 3 |
| words | 4..{len(vocab) - 1} |

- encoder input: `<s> w1 ... wn </s>` (the tokenizer's post-processor adds `<s>`/`</s>`)
- labels: `<s> wn ... w1 </s>`; decoder input is labels shifted right with decoder_start 2
- generation: decoder prompt `[[2, 0]]` (decoder_start, bos), greedy; the model emits
  `wn ... w1` and then `</s>`. `forced_bos_token_id` and `forced_eos_token_id` are unset.

## Held-out evaluation

{len(heldout)} sentences sampled with seed {args.heldout_seed} (distinct from the training
seed), excluded from training and checked disjoint from every training sentence.
HF `generate(input_ids, attention_mask, decoder_input_ids=[[2, 0]], num_beams=1,
do_sample=False, max_new_tokens={MAX_NEW_TOKENS})`; exact match = generated words equal
`reverse_words(sentence)` and generation ended with `</s>`.

**Held-out exact match: {acc:.1%}** ({round(acc * len(heldout))}/{len(heldout)})

## Demo sentences

Used by `tandem demo`; listed in `DEMO_SENTENCES` in `tools/train_demo.py` and in
`demo_sentences.json` here. Reference answer: `reverse_words()` in the same script.

| input | expected | model output |
|---|---|---|
{demo_lines}
"""
    (out_dir / "TRAINING.md").write_text(md)

    print(f"saved to {out_dir}:")
    for pth in sorted(out_dir.iterdir()):
        print(f"  {pth.name:28s} {pth.stat().st_size:>10,d} bytes")
    print(f"total {sum(q.stat().st_size for q in out_dir.iterdir() if q.is_file()) / 1e6:.2f} MB")
    return 0 if acc >= (MIN_DRAFT_ACCURACY if args.draft else MIN_ACCURACY) else 1


if __name__ == "__main__":
    sys.exit(main())
