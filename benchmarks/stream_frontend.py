"""The event loop's CPU per streamed token, without the engine (issue 53).

What ``tandem serve``'s event loop does for every token of every stream, alone:
``AsyncLLM``'s output loop (the output processor, detokenizing), ``generate()``, the
server's pumps and SSE chunks (``completions.first_outputs`` / ``stream_completion``),
each chunk framed by h11 into a buffer (no socket, no ASGI middleware). No engine
thread runs: fake core results, one random token per request per step, go through
``AsyncLLM._process_outputs`` as the engine thread's ``_deliver`` hands them over.
Prints the process's CPU time per token (user + system, every thread), which a
loaded machine disturbs far less than wall time.

  python benchmarks/stream_frontend.py MODEL --streams 256 --tokens 64
  python benchmarks/stream_frontend.py MODEL --stream-interval 4 --gc frozen

``--gc``: ``as-is`` (the collector as a program finds it), ``frozen`` (``gc.freeze()``
after start-up, as ``tandem serve`` does) or ``off``. MODEL: a checkpoint directory;
with a tokenizer its streams detokenize (``benchmarks/host_overhead.py --save-model``
writes the tiny BART, without one).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import cpu_flags  # noqa: E402


async def run(model: str, streams: int, tokens: int, interval: int, gc_mode: str, seed: int) -> float:
    """CPU microseconds per token of one run."""
    import h11

    from tandem import AsyncLLM
    from tandem.core.core_outputs import CompletionDelta, RequestResult
    from tandem.entrypoints.openai.completions import first_outputs, stream_completion
    from tandem.entrypoints.openai.metrics import ServerMetrics
    from tandem.entrypoints.openai.protocol import CompletionRequest
    from tandem.entrypoints.openai.shutdown import DrainCut

    # stream_interval only when asked for: the script runs against code older than the option too.
    engine = AsyncLLM(model=model, dtype="float32", device="cpu", start=False, max_num_seqs=max(256, 2 * streams),
                      **({"stream_interval": interval} if interval != 1 else {}))
    engine._thread = types.SimpleNamespace(is_alive=lambda: True)  # no engine thread: the results come from here
    metrics = ServerMetrics(engine)
    vocab, rng = engine.engine.vocab_size, random.Random(seed)
    req = CompletionRequest.model_validate({"prompt": [0, 5, 6, 2], "max_tokens": tokens, "stream": True,
                                            "temperature": 0, "ignore_eos": True})
    params = req.sampling_params(None)
    cut = DrainCut()

    async def client(k: int) -> None:
        rid = f"r{k}"
        first = await first_outputs(engine, [{"prompt_token_ids": [0, 5 + k % 50, 6, 2]}], params, [rid], cut)
        conn = h11.Connection(h11.SERVER)
        conn.receive_data(b"POST / HTTP/1.1\r\nhost: x\r\n\r\n")
        conn.next_event()
        conn.next_event()
        sink = bytearray(conn.send(h11.Response(status_code=200, headers=[("content-type", "text/event-stream"),
                                                                          ("transfer-encoding", "chunked")])))
        async for chunk in stream_completion(engine, metrics, req, params, first, [rid], rid, 0, "m", cut):
            sink += conn.send(h11.Data(data=chunk if isinstance(chunk, bytes) else chunk.encode()))

    tasks = [asyncio.create_task(client(k)) for k in range(streams)]
    while len(engine._streams) < streams or engine._held:  # as the engine thread takes requests in
        await asyncio.sleep(0.01)
        engine._take_commands()
        engine._feed()
        for t in tasks:
            if t.done():
                t.result()  # a client that failed says why
    if gc_mode == "frozen":
        gc.collect()
        gc.freeze()
    elif gc_mode == "off":
        gc.disable()
    cpu = time.process_time()
    for step in range(tokens):
        last = step == tokens - 1
        engine._process_outputs([RequestResult(f"r{k}", [CompletionDelta(0, [rng.randrange(4, vocab)], None, None,
                                                                          "length" if last else None)], last)
                                 for k in range(streams)])
        for _ in range(4):  # every consumer takes its output before the next step
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    cpu = time.process_time() - cpu
    gc.enable()
    gc.unfreeze()
    engine._inputs.shutdown(RuntimeError("done"))
    return 1e6 * cpu / (streams * tokens)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--gc", choices=("as-is", "frozen", "off"), default="frozen")
    p.add_argument("--repeat", type=int, default=3, help="runs, each in this process (default 3)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    import os

    import torch

    us = [asyncio.run(run(args.model, args.streams, args.tokens, args.stream_interval, args.gc, args.seed + i))
          for i in range(args.repeat)]
    print(f"cpu_flags={cpu_flags()}  cpu_capability={torch.backends.cpu.get_cpu_capability()}  "
          f"load_avg={'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{args.model}: {args.streams} streams x {args.tokens} tokens, stream_interval {args.stream_interval}, "
          f"gc {args.gc}: CPU us per token best {min(us):.1f} median {statistics.median(us):.1f} "
          f"({', '.join(f'{x:.1f}' for x in us)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
