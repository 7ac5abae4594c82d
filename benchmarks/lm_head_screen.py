"""The LM-head screen against the float32 head, per row count (``lm_head_screen``).

For each row count, the greedy token of every row three ways, in interleaved
rounds on the same hidden states:

* ``fp32``: the oneDNN-packed float32 head (packed for 128 rows, as the engine
  packs it at the default ``max_num_seqs``) and the chunked argmax, what a greedy
  step does without the screen;
* ``screen``: the int8 pass, its bound and the exact candidates
  (``tandem/core/layers/lm_head_screen.py``, ``tandem/core/worker/greedy_screen.py``);
* ``int8 head``: the int8 head alone (``quantization="int8"``'s), for scale.

The hidden states are real: the decoder's last hidden states of a checkpoint's
greedy steps (``--model``, default a random bart-base-sized BART built here), so
the candidate counts are the ones that checkpoint's steps give. Every token is
checked against the float32 argmax. Prints ms per call (best / median over the
rounds) and the mean candidates per row.

    python benchmarks/lm_head_screen.py --rounds 15
    python benchmarks/lm_head_screen.py --model tandem/demo_model --rows 1,4,8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import throughput  # noqa: E402


def hidden_states(model_dir: str, rows: int, threads: int) -> tuple[torch.Tensor, object]:
    """``rows`` decoder hidden states from greedy steps of ``model_dir``, and its LM head layer."""
    from tandem import LLM, SamplingParams
    from tandem.core.layers import VocabParallelEmbedding

    llm = LLM(model=model_dir, dtype="float32", seed=0, max_num_seqs=rows, lm_head_screen="off")
    torch.set_num_threads(threads)
    model = llm.llm_engine.worker.model
    captured = []
    head = None
    for m in model.modules():
        # The last vocabulary-sized table (the LM head, tied or not; packed or, if small, F.linear).
        if isinstance(m, VocabParallelEmbedding) and m.weight.shape[0] == model.config.vocab_size:
            head = m
    original = head.head_logits

    def keep(h, bias):
        captured.append(h.detach().clone())
        return original(h, bias)

    head.head_logits = keep
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": [0] + torch.randint(4, vocab, (24,), generator=g).tolist() + [2]}
               for _ in range(rows)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    head.head_logits = original
    h = torch.cat([c for c in captured if c.shape[0] == rows][-1:])
    return h, head


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint directory (default: a random bart-base-sized BART)")
    p.add_argument("--rows", default="1,2,4,8,16", help="comma list of row counts")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    torch.set_num_threads(args.threads)
    model_dir = args.model
    if model_dir is None:
        import tempfile

        model_dir = throughput.make_model("base", tempfile.mkdtemp(prefix="tandem-screen-"), 0)
    from tandem.core.layers.linear_kernels import Int8DynamicKernel
    from tandem.core.layers.lm_head_screen import ScreenedHead
    from tandem.core.worker.greedy_screen import StepScreen
    from tandem.core.worker.reductions import argmax_rows

    results = {}
    setups = {}
    for rows in rows_list:
        h, head = hidden_states(model_dir, rows, args.threads)
        setups[rows] = (h, head, ScreenedHead(head.weight), Int8DynamicKernel(head.weight, None))
    for rows, (h, head, screened, int8) in setups.items():
        want = argmax_rows(head.head_logits(h, None)).tolist()

        # Default arguments bind this row count's tensors (the closures outlive the loop).
        def fp32(h=h, head=head):
            return argmax_rows(head.head_logits(h, None))

        def screen(h=h, head=head, screened=screened, rows=rows):
            s = StepScreen(max_rows=rows)
            return s.tokens(s.offer(head, screened, h, None)), s

        def int8_head(h=h, head=head, int8=int8):
            return int8(head, h, None, None)

        tokens, s = screen()
        assert tokens is not None and tokens.tolist() == want, f"{rows} rows: screened tokens differ from the float32 argmax"
        results[rows] = {"fp32": [], "screen": [], "int8 head": [],
                         "cands": sum(s.candidates) / max(1, len(s.candidates)), "full": s.rows_full}
        setups[rows] = (fp32, screen, int8_head)
    for _ in range(args.rounds):  # interleaved: every row count and variant in each round
        for rows, fns in setups.items():
            for name, fn in zip(("fp32", "screen", "int8 head"), fns):
                t = time.perf_counter()
                out = fn()
                results[rows][name].append((time.perf_counter() - t) * 1e3)
                if name == "screen" and out[0] is None:
                    raise RuntimeError(f"{rows} rows: the screen did not serve the timed call")
    print(f"cpu_flags={throughput.cpu_flags()}  cpu_capability={torch.backends.cpu.get_cpu_capability()}  "
          f"torch={torch.__version__}  threads={args.threads} rounds={args.rounds} load={os.getloadavg()[0]:.2f} model={model_dir}")
    print(f"{'rows':>4}  {'fp32 head+argmax ms':>20}  {'screen ms':>16}  {'int8 head ms':>16}  "
          f"{'fp32/screen (median)':>20}  {'cands/row':>9}  {'full rows':>9}")
    for rows, r in results.items():
        def bm(xs):
            return f"{min(xs):.2f} / {statistics.median(xs):.2f}"
        print(f"{rows:>4}  {bm(r['fp32']):>20}  {bm(r['screen']):>16}  {bm(r['int8 head']):>16}  "
              f"{statistics.median(r['fp32']) / statistics.median(r['screen']):>20.2f}  {r['cands']:>9.1f}  "
              f"{r['full']:>9}")


if __name__ == "__main__":
    main()
