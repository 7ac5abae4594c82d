#!/usr/bin/env python
"""Throughput with per-request LoRA adapters against the base model alone.

A batch of ``--batch`` (64) requests, greedy, ``--output-len`` tokens each (EOS
ignored), their adapters spread round-robin over 1, 4 and 16 adapters of rank
``--rank`` (16) on ``--targets`` (default: every linear layer of encoder and decoder,
the most work an adapter can add), against the same batch on an engine without
LoRA, and on the LoRA engine with no adapter. Rounds are interleaved (base, 1, 4,
16, ... then again) so machine load drifts over all rows alike; the table gives the
best and median output tok/s and their ratio to the base model's.

The model is a random bart-base-sized checkpoint (``benchmarks/throughput.py``'s
``--make-model base``) or ``--model DIR`` (a BART-family checkpoint). Adapters are
written as PEFT saves them (``adapter_config.json`` + ``adapter_model.safetensors``,
random A and B) into a temporary directory.

    python benchmarks/lora.py                     # bart-base-sized, 3 rounds
    python benchmarks/lora.py --make-model tiny --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import MODEL_SIZES, checkpoint_dir, cpu_flags, make_model  # noqa: E402

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


def write_adapters(model_dir: str, out: Path, n: int, rank: int, targets: list[str], seed: int) -> list[Path]:
    """``n`` PEFT LoRA adapters over the BART-family checkpoint in ``model_dir``."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    d = config["d_model"]
    shapes = {"q_proj": (d, d), "k_proj": (d, d), "v_proj": (d, d), "out_proj": (d, d)}
    modules = []
    for stack, layers, ffn in (("encoder", config["encoder_layers"], config["encoder_ffn_dim"]),
                               ("decoder", config["decoder_layers"], config["decoder_ffn_dim"])):
        for i in range(layers):
            for attn in ("self_attn",) + (("encoder_attn",) if stack == "decoder" else ()):
                modules += [(f"model.{stack}.layers.{i}.{attn}.{p}", p, shapes[p]) for p in ALL_LINEAR[:4]]
            modules += [(f"model.{stack}.layers.{i}.fc1", "fc1", (d, ffn)), (f"model.{stack}.layers.{i}.fc2", "fc2",
                                                                             (ffn, d))]
    g = torch.Generator().manual_seed(seed)
    paths = []
    for k in range(n):
        tensors = {}
        for name, kind, (n_in, n_out) in modules:
            if kind not in targets:
                continue
            # A as PEFT initialises it (kaiming-uniform-like scale); B random where PEFT's is zero.
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in**0.5
            tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * 0.01
        path = out / f"adapter{k}"
        path.mkdir(parents=True)
        save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets, "bias": "none",
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "task_type": "SEQ_2_SEQ_LM",
        }))
        paths.append(path)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a BART-family checkpoint directory (default: a random one, --make-model)")
    p.add_argument("--make-model", choices=sorted(k for k, v in MODEL_SIZES.items() if v.family == "bart"),
                   default="base")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--targets", nargs="+", default=ALL_LINEAR, choices=ALL_LINEAR)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default=None, choices=[None, "int8"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base-engine", action="store_true", help="also time an engine built without enable_lora")
    args = p.parse_args(argv)

    from tandem import LLM, LoRARequest, SamplingParams

    model_dir, tmp_model = checkpoint_dir(args.model, None, "tandem-lora-model-",
                                          lambda d: make_model(args.make_model, d, args.seed))
    work = tempfile.TemporaryDirectory(prefix="tandem-lora-adapters-")
    n_max = max(args.adapters)
    adapters = write_adapters(model_dir, Path(work.name), n_max, args.rank, args.targets, args.seed)
    loras = [LoRARequest(f"adapter{i}", i + 1, str(path)) for i, path in enumerate(adapters)]
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)
    prompts = [{"prompt_token_ids": [0, *(rng.randrange(4, vocab) for _ in range(args.input_len - 2)), 2]}
               for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    # A KV pool just large enough (the machines these run on are shared: RAM is short).
    blocks = args.batch * (2 * args.input_len + args.output_len + 16) // 16 + 64
    common = dict(model=model_dir, dtype=args.dtype, quantization=args.quantization, max_num_seqs=args.batch,
                  num_kv_blocks=blocks, swap_space=0)
    lora = LLM(**common, enable_lora=True, max_loras=n_max, max_cpu_loras=n_max, max_lora_rank=args.rank)
    # The base model: the LoRA engine's requests without an adapter run the base GEMMs alone (a
    # layer skips its LoRA path when no token of the step has an adapter); --base-engine adds an
    # engine built without enable_lora, when memory allows two models.
    cases = [("base model", lora, None)]
    if args.base_engine:
        cases.append(("engine without LoRA", LLM(**common), None))
    for n in args.adapters:
        cases.append((f"{n} adapter{'s' if n > 1 else ''}", lora, [loras[i % n] for i in range(args.batch)]))
    for _, llm, mix in cases:  # warm-up: loads every adapter into the CPU cache and the slots
        llm.generate(prompts, params, lora_request=mix, use_tqdm=False)
    rates: dict[str, list[float]] = {name: [] for name, *_ in cases}
    for _ in range(args.rounds):
        for name, llm, mix in cases:
            start = time.perf_counter()
            outs = llm.generate(prompts, params, lora_request=mix, use_tqdm=False)
            seconds = time.perf_counter() - start
            assert all(o.error is None for o in outs), [o.error for o in outs if o.error][:1]
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / seconds)
            print(f"  {name}: {rates[name][-1]:.1f} tok/s", flush=True)

    size = f"--model {args.model}" if args.model else f"random bart ({args.make_model})"
    print(f"\nLoRA throughput: {size}, {args.dtype}{', int8' if args.quantization else ''}; batch {args.batch}, "
          f"input {args.input_len}, output {args.output_len} tokens; rank {args.rank} on {','.join(args.targets)}")
    print(f"cpu flags: {cpu_flags()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"load average {os.getloadavg()[0]:.1f}; {args.rounds} interleaved rounds")
    base_best, base_med = max(rates["base model"]), statistics.median(rates["base model"])
    print(f"\n| {'case':<24} | best tok/s | median tok/s | best vs base | median vs base |")
    print(f"|{'-' * 26}|-----------:|-------------:|-------------:|---------------:|")
    for name, *_ in cases:
        best, med = max(rates[name]), statistics.median(rates[name])
        print(f"| {name:<24} | {best:10.1f} | {med:12.1f} | {best / base_best:11.0%} | {med / base_med:13.0%} |")
    work.cleanup()
    if tmp_model is not None:
        tmp_model.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
