"""The ``tandem`` command: ``generate``, ``plugins``, ``demo``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEMO_MODEL = Path(__file__).resolve().parent.parent / "demo_model"


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", dest="attention_backend", default=None, help="attention backend name")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Encoder/decoder inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate for each prompt and print the outputs")
    gen.add_argument("--model", required=True, help="local HF checkpoint directory")
    _engine_args(gen)
    _sampling_args(gen)
    gen.add_argument("--json", action="store_true", help="one JSON object per line")
    gen.add_argument("prompts", nargs="+", help="encoder prompts; '-' reads one per line from stdin")

    plugins = sub.add_parser("plugins", help="list loaded plugins and what each registered")
    plugins.add_argument("--json", action="store_true")

    demo = sub.add_parser("demo", help="run the shipped word-reversal model on a few sentences")
    _engine_args(demo)
    demo.add_argument("sentences", nargs="*", help="sentences to reverse (default: built-in examples)")
    return parser


def _llm(args, model: str):
    from tandem import LLM

    return LLM(model=model, dtype=args.dtype, device=args.device, attention_backend=args.attention_backend)


def _read_prompts(items: list[str]) -> list[str]:
    prompts = []
    for item in items:
        if item == "-":
            prompts.extend(line.rstrip("\n") for line in sys.stdin if line.strip())
        else:
            prompts.append(item)
    return prompts


def cmd_generate(args) -> int:
    from tandem import SamplingParams

    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_tokens=args.max_tokens
    )
    prompts = _read_prompts(args.prompts)
    outs = _llm(args, args.model).generate(prompts, params, use_tqdm=False)
    failed = 0
    for prompt, out in zip(prompts, outs):
        if args.json:
            record = {"prompt": prompt, "error": out.error}
            if out.error is None:
                c = out.outputs[0]
                record.update(text=c.text, token_ids=c.token_ids, finish_reason=c.finish_reason)
            print(json.dumps(record))
        elif out.error is not None:
            print(f"{prompt}\t[error] {out.error}")
        else:
            print(f"{prompt}\t{out.outputs[0].text}")
        failed += out.error is not None
    return 1 if failed else 0


def cmd_plugins(args) -> int:
    from tandem.registry import plugin_manager

    plugins = plugin_manager().plugins
    if args.json:
        print(json.dumps([vars(p) for p in plugins.values()], indent=2))
        return 0
    for info in plugins.values():
        print(f"{info.name}  ({info.value}, from {info.distribution or 'unknown distribution'})")
        if info.models:
            print(f"    models:   {', '.join(info.models)}")
        if info.backends:
            print(f"    backends: {', '.join(info.backends)}")
    if not plugins:
        print("no plugins loaded")
    return 0


def cmd_demo(args) -> int:
    from tandem import SamplingParams

    examples = json.loads((DEMO_MODEL / "demo_sentences.json").read_text())
    if args.sentences:
        examples = [{"input": s, "expected": " ".join(reversed(s.split()))} for s in args.sentences]
    llm = _llm(args, str(DEMO_MODEL))
    outs = llm.generate([e["input"] for e in examples], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    print("tandem demo: a tiny BART trained to reverse the words of a sentence\n")
    right = 0
    for e, out in zip(examples, outs):
        got = out.error if out.error is not None else out.outputs[0].text
        ok = out.error is None and got == e["expected"]
        right += ok
        print(f"  input:  {e['input']}\n  output: {got}\n  {'right' if ok else 'WRONG, expected: ' + e['expected']}\n")
    print(f"{right}/{len(examples)} right")
    return 0 if right == len(examples) else 1


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    handlers = {"generate": cmd_generate, "plugins": cmd_plugins, "demo": cmd_demo}
    try:
        return handlers[args.command](args)
    except (ValueError, RuntimeError) as e:
        print(f"tandem {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
