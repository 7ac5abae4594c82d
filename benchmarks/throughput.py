"""Offline throughput: tandem against HuggingFace transformers (and CTranslate2).

Every engine gets the same checkpoint and the same requests in one run, and the
script prints output tokens per second for each, with the ratio to HF.

Models: BART (``--make-model tiny|base``) and T5 (``--make-model t5-base|flan-t5-base``),
or any local checkpoint of either family (``--model``).

Workloads (request token ids are random, seeded ids from the vocabulary with
the special ids left out, wrapped as ``[bos] + ids + [eos]``, or ``ids + [eos]``
for a model without bos (T5); the encoder lengths below count those tokens):

  summarization        64 requests, encoder length uniform in [64, 512], 64 new tokens
  translation         256 requests, encoder length uniform in [10, 60],  48 new tokens
  summarization-beam4  16 requests, as summarization, beam search with 4 beams
  latency               8 requests, encoder length uniform in [20, 40],  64 new tokens,
                       served one at a time, each timed alone: ms per token, p50 and p99

Output lengths are fixed: every request generates exactly its number of new
tokens (tandem ``min_tokens == max_tokens``, HF ``min_new_tokens ==
max_new_tokens``, CTranslate2 ``min_decoding_length == max_decoding_length``),
so EOS never ends a request early and all engines do the same amount of
decoding. Decoding is greedy. The decoder prompt is the model's default,
``[decoder_start_token_id, bos_token_id]`` for BART and ``[decoder_start_token_id]``
(the pad token) for T5 (tandem's defaults; given explicitly to the other
engines). Only new tokens are counted.

Processes: each engine runs in a long-lived process of its own
(benchmarks/engine_procs.py), started with OMP_NUM_THREADS / MKL_NUM_THREADS at
``--threads`` and holding every setting it is swept over, loaded once and kept
across rounds; this process only orchestrates, asking one engine at a time to
run the workload and waiting after each until that engine's process has gone
idle (CTranslate2's OpenMP threads spin for 200 ms after a call), so no engine
is timed while another's threads run and no two engines' thread pools share a
process. The time is taken inside the engine's process, around the engine's
call alone. ``--in-process`` runs every engine in this process instead (the old
way: an engine timed after CTranslate2 there ran up to 1.6x slower). An engine
that fails to load or dies gets a FAILED row with its error; the others go on.

Timing: every engine is loaded first, each setting runs one small warm-up
request batch, then ``time.perf_counter`` is taken around the single call (or,
for HF, the loop of batched ``generate`` calls) that serves all requests of a
workload; the latency workload times each request alone and reports, per round,
the p50 and p99 over requests of milliseconds per generated token. ``--repeat N``
(default 3) runs N interleaved rounds, engines taking turns, so that a slow minute
on a shared machine lands on all of them; every figure is reported as the best
and the median of the rounds. Loading time is reported separately in the JSON
output, not in tokens/s.

Every round serves the same requests, so tandem runs with its encoder cache and
prefix cache off (``encoder_cache_blocks=0``, ``prefix_cache_blocks=0``): with
them on, rounds after the first would skip every encoder run (the cache keeps
finished requests' cross-attention tables), which HF and CTranslate2 compute
each time. Before 2026-11-27 (22:50) the caches were on, and tandem's later rounds
on the translation and beam-4 workloads measured decoding without encoders.

Each engine at its best setting: in round 1 every engine runs every setting it
is swept over (engines still taking turns) and keeps its fastest for the later
rounds (benchmarks/rounds.py); the table prints the kept setting, and a line per
swept engine gives round 1's figure for each setting. HF is swept over batch
sizes (``--batch-sizes``, default 16,32,64,128, each capped at the workload's
request count; ``--hf-batch-size`` pins one), CTranslate2 over ``max_batch_size``
(the same list; ``--ct2-batch-size`` pins one) times thread layouts
(``intra_threads x inter_threads``: N x 1, N/2 x 2 when N >= 4, and 1 x N for N
threads; ``--ct2-threads`` pins or lists them), tandem over ``--max-num-seqs``
when given a comma list. torch's thread count is process-wide, so tandem and HF
run at ``--threads`` (default: torch's); run again with another ``--threads`` to
compare. The latency workload batches nothing: HF and CTranslate2 run at batch 1
and only the thread layouts are swept.

Roofline: the table's "model GFLOP/s" divides the FLOPs the model itself needs
for the workload (the dense matmuls of encoder, decoder, cross-attention K/V
and LM head plus the attention score and value products, counted from the
config and the request lengths: no padding, no recomputation) by each engine's
seconds, so every engine is charged the same work. "of mm peak" divides that by
what ``torch.mm`` reaches on a large matmul on this machine in the same run
(best of 5 before the engines load and 5 after they finish): an engine near 100% is
bound by matmul throughput and can only get faster by doing less arithmetic
or by faster arithmetic (int8, native bf16).

HF is run the way one would serve it offline: requests sorted by encoder
length (longest first), cut into batches of the swept batch size, right-padded
with ``pad_token_id`` and an attention mask. Sorting minimises padding, which
favours HF; ``--hf-no-sort`` keeps the request order instead. CTranslate2 gets
all requests in one ``translate_batch`` call with the swept ``max_batch_size``
(it sorts by length itself; with inter_threads > 1 it runs that many batches at
once). "vs ct2" divides each engine's speed by CTranslate2's at the same
precision (``*-int8`` rows by ct2-int8's, the others by ct2's): tokens/s for the
throughput workloads, 1 / p50 ms per token for latency; above 1 is faster.

The "same as HF" column counts requests whose generated tokens equal HF's
exactly. It is a sanity check, not a parity test: batched padded float32 (and
any bfloat16) arithmetic can flip near-tied argmaxes of a random model.

Examples (from the repository root):

  # quick check, tiny random model, 8 requests per workload
  python benchmarks/throughput.py --num-prompts 8

  # bart-base-sized random model, full workloads, bfloat16
  python benchmarks/throughput.py --make-model base --dtype bfloat16

  # any local BART checkpoint, only the summarization workload, HF and tandem
  python benchmarks/throughput.py --model /path/to/bart --workload summarization \\
      --engines tandem,hf --json results.json

  # batch-1 latency and 256 short translations against CTranslate2 at its best
  # batch size and thread layout, fp32 and int8, best and median of 3 rounds
  python benchmarks/throughput.py --make-model base --workload latency,translation \
      --engines tandem,tandem-int8,hf,ct2,ct2-int8

  # flan-t5-base-sized random model, all five engines
  python benchmarks/throughput.py --make-model flan-t5-base \\
      --engines tandem,tandem-int8,hf,ct2,ct2-int8

No weights are downloaded: without ``--model`` a random
``BartForConditionalGeneration`` or ``T5ForConditionalGeneration`` is built
with transformers (seeded) and saved with ``save_pretrained`` to a temporary
directory (or ``--save-model DIR``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rounds  # noqa: E402  (the sweep, interleaved rounds and percentiles)

REPO_ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("tandem", "tandem-int8", "tandem-noscreen", "hf", "ct2", "ct2-int8")


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    min_encoder_len: int  # including bos and eos
    max_encoder_len: int
    new_tokens: int
    num_beams: int = 1  # > 1: beam search, the best beam returned
    one_at_a_time: bool = False  # latency: each request served alone, timed alone


WORKLOADS = {
    "summarization": Workload("summarization", 64, 64, 512, 64),
    "translation": Workload("translation", 256, 10, 60, 48),
    # The summarization shape with beam search (bart-large-cnn decodes with 4 beams).
    "summarization-beam4": Workload("summarization-beam4", 16, 64, 512, 64, num_beams=4),
    # Batch 1: one request at a time, each timed alone (ms per token, p50 / p99).
    "latency": Workload("latency", 8, 20, 40, 64, one_at_a_time=True),
}

@dataclass(frozen=True)
class ModelSize:
    """A random checkpoint built with --make-model: its family and config fields."""

    family: str  # "bart" or "t5"
    config: dict
    tied: bool = True  # False: a head of its own, saved as the real checkpoint ships it


MODEL_SIZES = {
    "tiny": ModelSize("bart", dict(
        d_model=128, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=512, decoder_ffn_dim=512, vocab_size=1024,
        max_position_embeddings=1024,
    )),
    "base": ModelSize("bart", dict(
        d_model=768, encoder_layers=6, decoder_layers=6,
        encoder_attention_heads=12, decoder_attention_heads=12,
        encoder_ffn_dim=3072, decoder_ffn_dim=3072, vocab_size=50265,
        max_position_embeddings=1024,
    )),
    # t5-base (v1.0): ReLU FFN, head tied to the embeddings (scaled by d_model**-0.5).
    "t5-base": ModelSize("t5", dict(
        d_model=768, d_kv=64, num_heads=12, d_ff=3072, num_layers=12, num_decoder_layers=12,
        vocab_size=32128, relative_attention_num_buckets=32, relative_attention_max_distance=128,
        feed_forward_proj="relu",
    )),
    # flan-t5-base (v1.1): gated-GELU FFN, a head of its own.
    "flan-t5-base": ModelSize("t5", dict(
        d_model=768, d_kv=64, num_heads=12, d_ff=2048, num_layers=12, num_decoder_layers=12,
        vocab_size=32128, relative_attention_num_buckets=32, relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
    ), tied=False),
}


@dataclass
class Requests:
    """One workload's requests; ``encoder_ids[i]`` already holds bos/eos."""

    workload: Workload
    encoder_ids: list[list[int]]
    decoder_prompt: list[int]  # [decoder_start, bos] (T5: [decoder_start]), identical for all


@dataclass
class Result:
    workload: str
    engine: str
    requests: int
    output_tokens: int
    seconds: float
    load_seconds: float
    tokens_per_s: float = 0.0  # from the median run
    best_tokens_per_s: float = 0.0  # from the fastest run
    setting: str = ""  # the kept setting of the sweep (batch size, threads, max_num_seqs)
    sweep: dict[str, float] = field(default_factory=dict)  # setting -> first-round seconds (latency: p50 ms/token)
    runs: list[float] = field(default_factory=list)  # seconds of every timed run of the kept setting
    spread: float = 0.0  # (slowest - fastest) / median run
    model_gflops: float = 0.0  # the workload's model FLOPs / median seconds (see model_flops)
    # latency workload: per round, the p50 and p99 over requests of ms per token
    p50_ms: list[float] = field(default_factory=list)
    p99_ms: list[float] = field(default_factory=list)
    ratio_vs_hf: float | None = None
    ratio_vs_ct2: float | None = None  # speed over the CTranslate2 row of the same precision (median)
    ratio_vs_ct2_best: float | None = None  # the same from the best figures
    same_as_hf: int | None = None
    pid: int = 0  # the process the engine ran in
    error: str = ""  # the engine failed (to load, or in a run): why; no figures then
    # per-request generated ids, original request order; not written to JSON
    outputs: list[list[int]] = field(default_factory=list, repr=False)


# --------------------------------------------------------------------------
# Checkpoint and requests
# --------------------------------------------------------------------------


def make_model(size: str, out_dir: str, seed: int) -> str:
    """Build a seeded random BART or T5 checkpoint of ``MODEL_SIZES[size]`` and save it."""
    from transformers import BartConfig, BartForConditionalGeneration, T5Config, T5ForConditionalGeneration

    spec = MODEL_SIZES[size]
    if spec.family == "bart":
        model_cls = BartForConditionalGeneration
        config = BartConfig(**spec.config, forced_eos_token_id=None, forced_bos_token_id=None)
    else:
        model_cls = T5ForConditionalGeneration
        config = T5Config(**spec.config, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.save_pretrained(out_dir)
    if not spec.tied:
        _untie_head(Path(out_dir), config, seed)
    return out_dir


def _untie_head(path: Path, config, seed: int) -> None:
    """Give a saved T5 checkpoint a head of its own, as flan-t5 ships one.

    transformers 5 builds T5 tied always; flan-t5's files say
    ``tie_word_embeddings: false`` and carry ``lm_head.weight``, which HF then
    loads untied (and unscaled). The head is drawn as HF initialises an untied
    T5 head (std 1)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(seed + 1)
    weights["lm_head.weight"] = torch.randn(config.vocab_size, config.d_model, generator=gen)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    cfg.pop("scale_decoder_outputs", None)  # transformers 5's own field; the real checkpoints lack it
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def load_config(model_dir: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


@dataclass(frozen=True)
class Shape:
    """The sizes model_flops and the environment line need, for BART and T5 alike."""

    d_model: int
    attn_dim: int  # heads x head size (BART: d_model; T5: num_heads * d_kv)
    heads: int
    encoder_layers: int
    decoder_layers: int
    ffn_dim: int  # the encoder's and the decoder's (T5 shares one)
    decoder_ffn_dim: int
    ffn_matrices: int  # 2 (in, out) or 3 (gated: two in, one out)
    vocab_size: int


def model_shape(config) -> Shape:
    if config.model_type in ("t5", "mt5"):
        return Shape(config.d_model, config.num_heads * config.d_kv, config.num_heads,
                     config.num_layers, config.num_decoder_layers, config.d_ff, config.d_ff,
                     3 if config.is_gated_act else 2, config.vocab_size)
    return Shape(config.d_model, config.d_model, config.encoder_attention_heads,
                 config.encoder_layers, config.decoder_layers, config.encoder_ffn_dim,
                 config.decoder_ffn_dim, 2, config.vocab_size)


def special_ids(config) -> set[int]:
    ids = set()
    for name in ("bos_token_id", "eos_token_id", "pad_token_id",
                 "decoder_start_token_id", "unk_token_id", "mask_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def scaled_count(workload: Workload, args) -> int:
    if args.num_prompts is not None:
        return args.num_prompts
    return max(1, round(workload.num_requests * args.num_requests_scale))


def make_requests(workload: Workload, config, num_requests: int, seed: int) -> Requests:
    rng = random.Random(f"{seed}-{workload.name}")
    excluded = special_ids(config)
    vocab = [i for i in range(config.vocab_size) if i not in excluded]
    positions = getattr(config, "max_position_embeddings", None)  # T5: none, its positions are relative
    max_len = workload.max_encoder_len if positions is None else min(workload.max_encoder_len, positions)
    # T5 has no bos: its encoder input ends in eos only, its decoder starts from pad alone.
    bos = [config.bos_token_id] if getattr(config, "bos_token_id", None) is not None else []
    encoder_ids = []
    for _ in range(num_requests):
        length = rng.randint(workload.min_encoder_len, max_len)
        body = [rng.choice(vocab) for _ in range(length - 1 - len(bos))]
        encoder_ids.append(bos + body + [config.eos_token_id])
    decoder_prompt = [config.decoder_start_token_id] + bos
    return Requests(workload, encoder_ids, decoder_prompt)


def warmup_requests(requests: Requests) -> Requests:
    """Two short requests with the workload's shape, to warm kernels/caches."""
    w = requests.workload
    small = Workload(w.name + "-warmup", 2, w.min_encoder_len, w.min_encoder_len, 4, w.num_beams)
    eos = requests.encoder_ids[0][-1]
    ids = [r[: w.min_encoder_len - 1] + [eos] for r in requests.encoder_ids[:2]]
    return Requests(small, ids, requests.decoder_prompt)


# --------------------------------------------------------------------------
# Engines. Each runner: __init__ loads, run(requests) -> list of generated ids.
# --------------------------------------------------------------------------


class TandemRunner:
    name = "tandem"
    quantization = None
    lm_head_screen = None  # None: the engine's default

    def __init__(self, model_dir: str, args, max_num_seqs: int | None = None):
        from tandem import LLM, SamplingParams

        self._sampling_params = SamplingParams
        extra = {
            key: getattr(args, key)
            for key in ("block_size", "num_kv_blocks",
                        "max_num_batched_tokens", "kv_cache_memory", "swap_space",
                        "attention_backend", "cpu_gemm", "cpu_malloc", "compile_cache_dir", "data_parallel_size")
            if getattr(args, key, None) is not None
        }
        # Every round repeats the same requests: with the caches on, rounds after the
        # first would skip the encoder runs the other engines compute (module docstring).
        extra.setdefault("encoder_cache_blocks", 0)
        extra.setdefault("prefix_cache_blocks", 0)
        if getattr(args, "compiled", False):
            extra["enforce_eager"] = False  # the compiled decode step (docs/performance.md)
        if max_num_seqs is not None:
            extra["max_num_seqs"] = max_num_seqs
        if self.quantization:
            extra["quantization"] = self.quantization
        if self.lm_head_screen:
            extra["lm_head_screen"] = self.lm_head_screen
        self.llm = LLM(model=model_dir, dtype=args.dtype, device=args.device,
                       seed=args.seed, **extra)
        # auto picks per model (T5's relative position bias passes over backends without it)
        self.attention_backend = self.llm.llm_engine.attn_backend.name

    def run(self, requests: Requests) -> list[list[int]]:
        n, beams = requests.workload.new_tokens, requests.workload.num_beams
        params = self._sampling_params(temperature=0.0, max_tokens=n, min_tokens=n, num_beams=beams)
        prompts = [{"prompt_token_ids": ids} for ids in requests.encoder_ids]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outs]


class TandemNoScreenRunner(TandemRunner):
    """tandem with ``lm_head_screen="off"``: every greedy step computes the whole float32
    LM head (what the screen saves, docs/performance.md "A screened LM head")."""

    name = "tandem-noscreen"
    lm_head_screen = "off"


class TandemInt8Runner(TandemRunner):
    """tandem with ``quantization="int8"`` (int8 weights, dynamic activations)."""

    name = "tandem-int8"
    quantization = "int8"


class HFRunner:
    name = "hf"

    def __init__(self, model_dir: str, args):
        from transformers import AutoModelForSeq2SeqLM

        self.device = torch.device(args.device)
        self.model = AutoModelForSeq2SeqLM.from_pretrained(
            model_dir, dtype=getattr(torch, args.dtype)).to(self.device).eval()
        self.sort = not args.hf_no_sort
        self.pad_id = self.model.config.pad_token_id

    def _generation_config(self, new_tokens: int, num_beams: int = 1):
        # Built explicitly so a real checkpoint's generation_config.json
        # (beams, no_repeat_ngram_size, forced bos/eos, min_length...) cannot
        # change what HF does relative to the other engines.
        from transformers import GenerationConfig

        c = self.model.config
        return GenerationConfig(
            max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False, num_beams=num_beams,
            bos_token_id=getattr(c, "bos_token_id", None), eos_token_id=c.eos_token_id,
            pad_token_id=c.pad_token_id,
            decoder_start_token_id=c.decoder_start_token_id,
            forced_bos_token_id=None, forced_eos_token_id=None,
        )

    def run(self, requests: Requests, batch_size: int = 16) -> list[list[int]]:
        gen_config = self._generation_config(requests.workload.new_tokens, requests.workload.num_beams)
        order = list(range(len(requests.encoder_ids)))
        if self.sort:
            order.sort(key=lambda i: len(requests.encoder_ids[i]), reverse=True)
        prompt_len = len(requests.decoder_prompt)
        outputs: list[list[int] | None] = [None] * len(order)
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                batch = order[start:start + batch_size]
                seqs = [requests.encoder_ids[i] for i in batch]
                width = max(map(len, seqs))
                input_ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
                attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
                for row, ids in enumerate(seqs):
                    input_ids[row, : len(ids)] = torch.tensor(ids)
                    attention_mask[row, : len(ids)] = 1
                decoder_input_ids = torch.tensor([requests.decoder_prompt] * len(seqs))
                sequences = self.model.generate(
                    input_ids=input_ids.to(self.device),
                    attention_mask=attention_mask.to(self.device),
                    decoder_input_ids=decoder_input_ids.to(self.device),
                    generation_config=gen_config,
                )
                # min == max new tokens: every row has exactly that many new
                # tokens, so no trailing padding needs stripping.
                for row, i in enumerate(batch):
                    outputs[i] = sequences[row, prompt_len:].tolist()
        return outputs  # type: ignore[return-value]


class CT2Runner:
    """CTranslate2, fed token strings from a synthetic id<->string vocabulary.

    The converter normally needs the checkpoint's tokenizer; the benchmark
    works in token ids, so a stand-in tokenizer maps id ``i`` to a unique
    string and the results are mapped back to ids.
    """

    name = "ct2"
    compute_type = None

    def __init__(self, model_dir: str, args):
        import ctranslate2

        compute_type = self.compute_type or args.ct2_compute_type or args.dtype
        supported = ctranslate2.get_supported_compute_types(args.device)
        if compute_type not in supported:
            raise RuntimeError(
                f"CTranslate2 has no compute type {compute_type!r} on "
                f"{args.device} (supported: {', '.join(sorted(supported))}); "
                "pick one with --ct2-compute-type")
        config = load_config(model_dir)
        self.tokens = _ct2_vocabulary(config)
        self.token_to_id = {t: i for i, t in enumerate(self.tokens)}
        self._tmp = tempfile.TemporaryDirectory(prefix="tandem-bench-ct2-")
        converter = _ct2_converter_cls()(model_dir, tokens=self.tokens, config=config)
        converter.convert(self._tmp.name, force=True)
        self.compute_type, self.device = compute_type, args.device
        self._translators: dict[tuple[int, int], object] = {}

    def translator(self, layout: tuple[int, int]):
        """The model loaded with ``layout`` = (intra_threads, inter_threads); one copy
        of the weights per layout, loaded on first use."""
        if layout not in self._translators:
            import ctranslate2

            self._translators[layout] = ctranslate2.Translator(
                self._tmp.name, device=self.device, compute_type=self.compute_type,
                intra_threads=layout[0], inter_threads=layout[1])
        return self._translators[layout]

    def run(self, requests: Requests, batch_size: int = 16,
            layout: tuple[int, int] | None = None) -> list[list[int]]:
        """``batch_size``: max_batch_size (0: all requests in one batch); with
        inter_threads > 1 CTranslate2 runs that many batches at once."""
        n = requests.workload.new_tokens
        tok = self.tokens
        source = [[tok[i] for i in ids] for ids in requests.encoder_ids]
        # CTranslate2 starts from decoder_start itself; the rest of the
        # decoder prompt is the target prefix.
        prefix_ids = requests.decoder_prompt[1:]
        prefix = [[tok[i] for i in prefix_ids]] * len(source) if prefix_ids else None
        # max/min_decoding_length count the target prefix.
        length = n + len(prefix_ids)
        translator = self.translator(layout or (torch.get_num_threads(), 1))
        results = translator.translate_batch(
            source, target_prefix=prefix, max_batch_size=batch_size,
            beam_size=requests.workload.num_beams, max_decoding_length=length, min_decoding_length=length,
            max_input_length=0, return_end_token=True)
        outputs = []
        for result in results:
            hyp = result.hypotheses[0]
            outputs.append([self.token_to_id[t] for t in hyp[len(prefix_ids):]])
        return outputs


def _ct2_vocabulary(config) -> list[str]:
    names = {getattr(config, "bos_token_id", None): "<s>", config.pad_token_id: "<pad>",
             config.eos_token_id: "</s>"}
    names.pop(None, None)  # T5 has no bos
    unk = getattr(config, "unk_token_id", None)
    if unk is None:
        unk = next(i for i in range(config.vocab_size) if i not in names)
    names.setdefault(unk, "<unk>")
    return [names.get(i, f"tok{i}") for i in range(config.vocab_size)]


def _ct2_converter_cls():
    from ctranslate2.converters import TransformersConverter

    class _Tokenizer:
        def __init__(self, tokens, config):
            self._tokens = tokens
            bos = getattr(config, "bos_token_id", None)  # T5 has none; its loader reads pad instead
            self.bos_token = None if bos is None else tokens[bos]
            self.eos_token = tokens[config.eos_token_id]
            self.pad_token = tokens[config.pad_token_id]
            self.unk_token = "<unk>"

        def get_vocab(self):
            return {t: i for i, t in enumerate(self._tokens)}

        def convert_ids_to_tokens(self, i):
            return self._tokens[i]

    class Converter(TransformersConverter):
        def __init__(self, model_dir, tokens, config):
            super().__init__(model_dir)
            self._tokenizer = _Tokenizer(tokens, config)

        def load_tokenizer(self, tokenizer_class, model_name_or_path, **kwargs):
            return self._tokenizer

        def load_model(self, model_class, model_name_or_path, **kwargs):
            model = super().load_model(model_class, model_name_or_path, **kwargs)
            # transformers 5 dropped BART's always-False normalize_before,
            # which the converter still reads.
            if model.config.model_type == "bart" and not hasattr(model.config, "normalize_before"):
                model.config.normalize_before = False
            # transformers 5 reports every T5 as tied and keeps whether the head is
            # scaled in scale_decoder_outputs; the converter scales the decoder output
            # when tie_word_embeddings is set, which would scale flan-t5's own head.
            scaled = getattr(model.config, "scale_decoder_outputs", None)
            if model.config.model_type in ("t5", "mt5") and scaled is not None:
                model.config.tie_word_embeddings = bool(scaled)
            return model

    return Converter


class CT2Int8Runner(CT2Runner):
    """CTranslate2 with ``compute_type="int8"``."""

    name = "ct2-int8"
    compute_type = "int8"


RUNNERS = {"tandem": TandemRunner, "tandem-int8": TandemInt8Runner, "tandem-noscreen": TandemNoScreenRunner,
           "hf": HFRunner, "ct2": CT2Runner, "ct2-int8": CT2Int8Runner}


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------


def model_flops(config, requests: Requests) -> float:
    """FLOPs a BART- or T5-shaped model needs for this workload, counted from the config
    and the request lengths (2 per multiply-add): encoder layers over the encoder
    tokens, cross-attention K/V once per request, and every decoder position
    (the decoder prompt and each new token but the last) through the decoder
    layers, the LM head once per new token, and attention's QK^T and PV products
    at their true lengths (the matmul part equals torch.profiler's FLOP count
    of HF ``generate`` on one unpadded request). Padding, recomputation and beams other than the first are not
    counted: it is the work any engine must do, not what one does. T5's relative
    position bias is an addition per score, left out like the softmax."""
    s = model_shape(config)
    d, a, v = s.d_model, s.attn_dim, s.vocab_size
    enc_ffn, dec_ffn = s.ffn_matrices * s.ffn_dim, s.ffn_matrices * s.decoder_ffn_dim
    le, ld = s.encoder_layers, s.decoder_layers
    w = requests.workload
    total = 0.0
    for ids in requests.encoder_ids:
        n = len(ids)
        total += le * (n * 2 * d * (4 * a + enc_ffn) + 4 * n * n * a)  # projections, FFN, attention
        total += ld * n * 2 * d * 2 * a  # cross-attention K and V of the encoder output
        positions = len(requests.decoder_prompt) + w.new_tokens - 1
        for t in range(1, positions + 1):
            # self q/k/v/out + cross q/out + FFN, then attention over t self and n cross positions
            total += ld * (2 * d * (6 * a + dec_ffn) + 4 * a * (t + n))
        total += w.new_tokens * 2 * d * v  # LM head, once per token chosen
    return total


def mm_peak_gflops(dtype: torch.dtype, device: str, size: int = 2048, tries: int = 5) -> float:
    """Best of ``tries`` ``torch.mm`` of two ``size x size`` matrices, in GFLOP/s."""
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(tries):
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        torch.mm(a, b)
        if device != "cpu":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


class EngineHost:
    """One engine with every setting it is swept over (tandem: an LLM per
    ``--max-num-seqs`` value; CTranslate2 loads a copy per thread layout on first
    use), loaded once: what each engine's own process holds (benchmarks/engine_procs.py).
    ``timed`` runs a workload and times it here, so that only the engine's own work is
    on the clock."""

    def __init__(self, engine: str, model_dir: str, args):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # as main() does, in this process too
        if args.threads:
            torch.set_num_threads(args.threads)
        if engine.startswith("tandem"):
            self.loaded = {("default" if n is None else f"max_num_seqs {n}"):
                           RUNNERS[engine](model_dir, args, max_num_seqs=n)
                           for n in args.max_num_seqs or [None]}
        else:
            self.loaded = {"": RUNNERS[engine](model_dir, args)}

    def info(self) -> dict:
        first = next(iter(self.loaded.values()))
        return {"labels": list(self.loaded), "pid": os.getpid(), "torch_threads": torch.get_num_threads(),
                "attention_backend": getattr(first, "attention_backend", None)}

    def timed(self, runner: str, kwargs: dict, requests: Requests):
        """(outputs, seconds): the whole workload's seconds, or for the latency
        workload each request's seconds (served one at a time)."""
        run = self.loaded[runner].run
        gc.collect()
        if requests.workload.one_at_a_time:
            return one_at_a_time(lambda single: run(single, **kwargs), requests)
        start = time.perf_counter()
        out = run(requests, **kwargs)
        return out, time.perf_counter() - start

    def profile(self, runner: str, requests: Requests, engine: str, rows: int) -> None:
        profile_run(self.loaded[runner], requests, engine, rows)


def load_engines(engines: list[str], model_dir: str, args) -> tuple[dict, dict[str, str]]:
    """engine -> (handle, load seconds, info) for the engines that loaded, each an
    EngineHost in a process of its own (here with ``--in-process``), loaded one after
    the other; and engine -> error for those that failed to load."""
    import engine_procs

    loaded, failed = {}, {}
    for engine in engines:
        threads = args.threads or torch.get_num_threads()
        try:
            handle = engine_procs.start(engine, "throughput:EngineHost", engine, model_dir, args,
                                        in_process=args.in_process, env=engine_procs.thread_env(threads))
            info = handle.call("info")
        except engine_procs.EngineFailed as exc:
            print(f"note: {engine} failed to load: {exc}", flush=True)
            failed[engine] = str(exc)
            continue
        loaded[engine] = (handle, handle.load_seconds, info)
        print(f"{engine}: loaded in {handle.load_seconds:.1f} s, pid {info['pid']}, "
              f"torch threads {info['torch_threads']}", flush=True)
    return loaded, failed


def one_at_a_time(run, requests: Requests) -> tuple[list[list[int]], list[float]]:
    """Serve the requests one by one with ``run``, each timed alone:
    (outputs, seconds per request)."""
    outputs, seconds = [], []
    for ids in requests.encoder_ids:
        single = Requests(requests.workload, [ids], requests.decoder_prompt)
        start = time.perf_counter()
        outputs += run(single)
        seconds.append(time.perf_counter() - start)
    return outputs, seconds


def latency_figures(outputs: list[list[int]], seconds: list[float]) -> tuple[float, float]:
    """(p50, p99) over requests of each request's milliseconds per generated token."""
    per_token = [1000 * s / max(len(o), 1) for o, s in zip(outputs, seconds)]
    return rounds.percentile(per_token, 50), rounds.percentile(per_token, 99)


def engine_variants(engines: dict, requests: Requests, args) -> list[rounds.Variant]:
    """Every setting each engine is tried at on this workload (see rounds.sweep_rounds):
    tandem per ``--max-num-seqs`` value, HF per batch size, CTranslate2 per batch size
    and thread layout. The latency workload batches nothing (batch 1). A variant's
    ``run()`` asks the engine's process for ``EngineHost.timed``."""
    n = len(requests.encoder_ids)
    latency = requests.workload.one_at_a_time
    variants = []
    for engine, (handle, _, info) in engines.items():
        def variant(label, runner, kwargs, handle=handle, engine=engine):
            return rounds.Variant(engine, label, lambda: handle.call("timed", runner, kwargs, requests))

        for runner in info["labels"]:
            if engine.startswith("tandem"):
                variants.append(variant(runner, runner, {}))
            elif engine == "hf":
                sizes = [1] if latency else rounds.batch_candidates(args.hf_batch_sizes, n)
                for b in sizes:
                    variants.append(variant(f"batch {b}", runner, {"batch_size": b}))
            else:
                sizes = [1] if latency else (
                    [args.ct2_batch_size] if args.ct2_batch_size is not None
                    else rounds.batch_candidates(args.batch_sizes, n))
                for layout in args.ct2_layouts:
                    for b in sizes:
                        label = f"batch {b or 'all'}, {layout[0]}x{layout[1]} threads"
                        variants.append(variant(label, runner, {"batch_size": b, "layout": layout}))
    return variants


def run_benchmarks(engines: dict, workloads: list[Requests], config, args,
                   failed: dict[str, str] | None = None) -> list[Result]:
    """Per workload: warm every setting up, then ``args.repeat`` interleaved rounds
    (rounds.sweep_rounds: round 1 tries every setting, later rounds each engine's
    fastest); each engine's figures are the best and the median of its kept setting.
    An engine whose process fails (``failed``: engine -> error, filled here too) gets
    a failed row in every workload from then on; the others carry on."""
    import engine_procs

    failed = {} if failed is None else failed
    results = []
    for requests in workloads:
        flops = model_flops(config, requests)
        latency = requests.workload.one_at_a_time
        variants = engine_variants(engines, requests, args)
        for v in engine_variants(engines, warmup_requests(requests), args):  # each setting warmed up
            if v.engine not in failed:
                try:
                    v.run()
                except engine_procs.EngineFailed as exc:
                    print(f"note: {v.engine} failed: {exc}", flush=True)
                    failed[v.engine] = str(exc)

        last_p99 = [0.0]  # for the progress line

        def measure(v: rounds.Variant):
            if v.engine in failed:
                return math.inf, None
            try:
                out, seconds = v.run()
            except engine_procs.EngineFailed as exc:
                print(f"note: {v.engine} failed: {exc}", flush=True)
                failed[v.engine] = str(exc)
                return math.inf, None
            if latency:
                p50, p99 = latency_figures(out, seconds)
                last_p99[0] = p99
                return p50, (out, sum(seconds), p50, p99)
            return seconds, (out, seconds, None, None)

        def progress(v: rounds.Variant, value: float, round_: int):
            if v.engine in failed:
                return
            figure = f"p50 {value:8.2f} p99 {last_p99[0]:8.2f} ms/token" if latency else \
                f"{requests.workload.new_tokens * len(requests.encoder_ids) / value:10.1f} tok/s"
            print(f"  {v.engine:<11} {requests.workload.name:<19} {figure}  "
                  f"[{v.label}] (round {round_}/{args.repeat})", flush=True)

        chosen = rounds.sweep_rounds(variants, args.repeat, measure, progress) if variants else {}
        for engine in [e for e in dict.fromkeys([*engines, *failed]) if e in failed]:
            results.append(Result(workload=requests.workload.name, engine=engine,
                                  requests=len(requests.encoder_ids), output_tokens=0, seconds=math.nan,
                                  load_seconds=engines[engine][1] if engine in engines else math.nan,
                                  error=failed[engine]))
        for engine, c in chosen.items():
            if engine in failed:
                continue
            out = c.payloads[0][0]
            runs = [p[1] for p in c.payloads]
            expected = requests.workload.new_tokens
            short = [i for i, o in enumerate(out) if len(o) != expected]
            if short:
                print(f"warning: {engine}/{requests.workload.name}: {len(short)} "
                      f"requests did not generate exactly {expected} tokens "
                      f"(first: request {short[0]}, {len(out[short[0]])} tokens)",
                      file=sys.stderr)
            seconds = statistics.median(runs)
            tokens = sum(len(o) for o in out)
            handle, load_seconds, info = engines[engine]
            results.append(Result(
                workload=requests.workload.name, engine=engine,
                requests=len(out), output_tokens=tokens, seconds=seconds,
                load_seconds=load_seconds, tokens_per_s=tokens / seconds,
                best_tokens_per_s=tokens / min(runs), setting=c.label, sweep=c.sweep,
                runs=runs, spread=(max(runs) - min(runs)) / seconds,
                model_gflops=flops / seconds / 1e9,
                p50_ms=[p[2] for p in c.payloads] if latency else [],
                p99_ms=[p[3] for p in c.payloads] if latency else [],
                pid=info["pid"], outputs=out))
            if args.profile and engine in args.profile:
                runner = c.label if c.label in info["labels"] else info["labels"][0]
                try:
                    handle.call("profile", runner, requests, engine, args.profile_rows)
                except engine_procs.EngineFailed as exc:
                    print(f"note: profiling {engine} failed: {exc}", flush=True)
    return results


def profile_run(runner, requests: Requests, engine: str, rows: int) -> None:
    """Run the workload again under torch.profiler (after the timed run, so the
    timing above carries no profiler overhead) and print the op breakdown:
    self CPU time per op, as a share of the whole run."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        runner.run(requests)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    print(f"\nprofile: {engine} / {requests.workload.name}, self CPU time by op "
          f"(total {total / 1e6:.2f} s, profiled run)")
    print(f"  {'op':<44} {'share':>7} {'seconds':>8} {'calls':>8}")
    for e in events[:rows]:
        print(f"  {e.key[:44]:<44} {100 * e.self_cpu_time_total / total:6.1f}% "
              f"{e.self_cpu_time_total / 1e6:8.2f} {e.count:8d}")
    print(flush=True)


def compare_with_hf(results: list[Result]) -> None:
    """Ratios to HF and to CTranslate2 of the same precision (tandem-int8 and any
    *-int8 row against ct2-int8, the rest against ct2), as speed: above 1 is faster.
    The latency workload compares p50 ms per token."""
    def speed(r: Result, best: bool) -> float:
        if r.p50_ms:
            return 1 / (min(r.p50_ms) if best else statistics.median(r.p50_ms))
        return r.best_tokens_per_s if best else r.tokens_per_s

    results = [r for r in results if not r.error]
    by_key = {(r.workload, r.engine): r for r in results}
    for r in results:
        ref = by_key.get((r.workload, "hf"))
        if ref is not None:
            r.ratio_vs_hf = speed(r, False) / speed(ref, False)
            r.same_as_hf = sum(a == b for a, b in zip(r.outputs, ref.outputs))
        ct2 = by_key.get((r.workload, "ct2-int8" if r.engine.endswith("int8") else "ct2"))
        if ct2 is not None and not r.engine.startswith("ct2"):
            r.ratio_vs_ct2 = speed(r, False) / speed(ct2, False)
            r.ratio_vs_ct2_best = speed(r, True) / speed(ct2, True)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_table(results: list[Result], mm_peak: float) -> str:
    """The throughput workloads: tokens/s best and median, the kept setting."""
    header = ("workload", "engine", "setting", "requests", "output tokens", "rounds", "spread",
              "tok/s best", "tok/s median", "model GFLOP/s", "of mm peak", "vs HF",
              "vs ct2 best", "vs ct2 median", "same as HF")
    rows = [header]
    for r in results:
        if r.error:
            if not WORKLOADS[r.workload].one_at_a_time:
                rows.append(_failed_row(r, len(header)))
            continue
        if r.p50_ms:
            continue
        rows.append((
            r.workload, r.engine, r.setting, str(r.requests), str(r.output_tokens), str(len(r.runs)),
            "-" if len(r.runs) < 2 else f"{100 * r.spread:.0f}%",
            f"{r.best_tokens_per_s:.1f}", f"{r.tokens_per_s:.1f}", f"{r.model_gflops:.1f}",
            f"{100 * r.model_gflops / mm_peak:.0f}%", _ratio(r.ratio_vs_hf),
            _ratio(r.ratio_vs_ct2_best), _ratio(r.ratio_vs_ct2),
            "-" if r.same_as_hf is None else f"{r.same_as_hf}/{r.requests}",
        ))
    return _layout(rows, left=3)


def format_latency_table(results: list[Result]) -> str:
    """The latency workload: ms per token, p50 and p99 over requests, each the best
    and the median over rounds; ratios are speed (CTranslate2's ms / the engine's)."""
    header = ("workload", "engine", "setting", "requests", "new tokens", "rounds",
              "p50 ms/tok best", "p50 median", "p99 ms/tok best", "p99 median",
              "vs HF", "vs ct2 best", "vs ct2 median", "same as HF")
    rows = [header]
    for r in results:
        if r.error:
            if WORKLOADS[r.workload].one_at_a_time:
                rows.append(_failed_row(r, len(header)))
            continue
        if not r.p50_ms:
            continue
        rows.append((
            r.workload, r.engine, r.setting, str(r.requests), str(r.output_tokens // max(r.requests, 1)),
            str(len(r.p50_ms)), f"{min(r.p50_ms):.2f}", f"{statistics.median(r.p50_ms):.2f}",
            f"{min(r.p99_ms):.2f}", f"{statistics.median(r.p99_ms):.2f}", _ratio(r.ratio_vs_hf),
            _ratio(r.ratio_vs_ct2_best), _ratio(r.ratio_vs_ct2),
            "-" if r.same_as_hf is None else f"{r.same_as_hf}/{r.requests}",
        ))
    return _layout(rows, left=3)


def _failed_row(r: Result, width: int) -> tuple:
    """An engine that failed: its error in the setting column (first line, cut), no figures."""
    error = r.error.splitlines()[0] if r.error else "failed"
    return (r.workload, r.engine, "FAILED: " + (error if len(error) <= 90 else error[:87] + "..."),
            str(r.requests)) + ("-",) * (width - 4)


def format_sweeps(results: list[Result]) -> str:
    """Each swept engine's first-round figure per setting, the kept one marked."""
    lines = []
    for r in results:
        if r.error or len(r.sweep) < 2:
            continue
        unit = "p50 ms/tok" if r.p50_ms else "tok/s"
        cells = []
        for label, value in r.sweep.items():
            figure = value if r.p50_ms else r.output_tokens / value
            cells.append(f"{label}: {figure:.1f}{' *' if label == r.setting else ''}")
        lines.append(f"  {r.workload} / {r.engine} ({unit}, round 1): " + "; ".join(cells))
    return "\n".join(lines)


def _layout(rows: list[tuple], left: int) -> str:
    if len(rows) == 1:
        return ""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [c.ljust(w) if i < left else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def environment(args, config, model_dir: str) -> dict:
    import transformers

    shape = model_shape(config)
    env = {
        "model": model_dir if args.model else f"random {MODEL_SIZES[args.make_model].family} ({args.make_model})",
        "d_model": shape.d_model,
        "layers": [shape.encoder_layers, shape.decoder_layers],
        "heads": shape.heads,
        "vocab_size": shape.vocab_size,
        "dtype": args.dtype,
        "device": args.device,
        "torch_threads": torch.get_num_threads(),
        "repeat": args.repeat,
        "hf_batch_sizes": args.hf_batch_sizes,
        "ct2_batch_sizes": "all" if args.ct2_batch_size == 0 else (
            [args.ct2_batch_size] if args.ct2_batch_size else args.batch_sizes),
        "ct2_threads": ",".join(f"{a}x{b}" for a, b in args.ct2_layouts),
        "hf_sorted": not args.hf_no_sort,
        "seed": args.seed,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_flags": cpu_flags(),
        "cpu_count": os.cpu_count(),
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "load_avg": "/".join(f"{x:.2f}" for x in os.getloadavg()),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        **isa_overrides(),
        "mm_peak_gflops": round(mm_peak_gflops(getattr(torch, args.dtype), args.device), 1),
    }
    try:  # its version without importing it here (its OpenMP pool belongs in its own process)
        from importlib.metadata import version
        env["ctranslate2"] = version("ctranslate2")
    except ImportError:
        pass
    env["engine_processes"] = not args.in_process
    return env


def isa_overrides() -> dict:
    """The environment variables that make torch, oneDNN or CTranslate2 use a
    narrower instruction set than the CPU has (to emulate an AVX2-only machine)."""
    names = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "CT2_FORCE_CPU_ISA")
    return {name: os.environ[name] for name in names if os.environ.get(name)}


def cpu_flags() -> str:
    """The SIMD features that decide CPU kernel speed (comma list), or 'unknown'."""
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "neon", "asimd")
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return ",".join(x for x in wanted if x in have) or "none of " + "/".join(wanted)
    except OSError:
        pass
    return "unknown"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("checkpoint")
    src.add_argument("--model", help="local BART or T5 checkpoint directory")
    src.add_argument("--make-model", choices=sorted(MODEL_SIZES), default="tiny",
                     help="size of the random checkpoint built when --model is "
                          "not given (default: tiny)")
    src.add_argument("--save-model", metavar="DIR",
                     help="save the random checkpoint here instead of a temp dir")

    run = p.add_argument_group("run")
    run.add_argument("--workload", default="all",
                     help=f"comma list from {','.join(WORKLOADS)}, or all (default: all)")
    run.add_argument("--engines", default="tandem,hf",
                     help=f"comma list from {','.join(ENGINES)} (default: tandem,hf)")
    run.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    run.add_argument("--device", default="cpu")
    run.add_argument("--threads", type=int,
                     help="torch.set_num_threads (and CTranslate2 intra_threads)")
    run.add_argument("--seed", type=int, default=0)
    size = run.add_mutually_exclusive_group()
    size.add_argument("--num-prompts", type=int,
                      help="requests per workload, overriding the default counts")
    size.add_argument("--num-requests-scale", type=float, default=1.0,
                      help="multiply each workload's request count (default: 1)")
    run.add_argument("--repeat", type=int, default=3,
                     help="timed rounds per workload, engines taking turns; round 1 also sweeps "
                          "the settings; the tables report each engine's best and median (default: 3)")
    run.add_argument("--in-process", action="store_true",
                     help="load and run every engine in this one process (the old way: an engine "
                          "timed after CTranslate2 runs slower, see docs/performance.md) instead of "
                          "each in a process of its own")
    run.add_argument("--json", metavar="PATH", help="also write results as JSON")
    run.add_argument("--profile", type=lambda v: v.split(","), default=[], metavar="ENGINES",
                     help="after each timed run of these engines (e.g. tandem or tandem,hf), run the "
                          "workload again under torch.profiler and print the op breakdown")
    run.add_argument("--profile-rows", type=int, default=20, help="ops listed by --profile")

    hf = p.add_argument_group("HF / CTranslate2 (each at its best setting: see the sweep)")
    hf.add_argument("--batch-sizes", default="16,32,64,128",
                    help="batch sizes HF and CTranslate2 (max_batch_size) are each tried at in the "
                         "first round, each engine keeping its fastest (default: 16,32,64,128; "
                         "sizes above a workload's request count are capped to it)")
    hf.add_argument("--hf-batch-size", type=int,
                    help="pin HF's batch size (requests per generate call) instead of sweeping")
    hf.add_argument("--hf-no-sort", action="store_true",
                    help="batch HF requests in request order instead of by length")
    hf.add_argument("--ct2-batch-size", type=int,
                    help="pin CTranslate2's max_batch_size instead of sweeping (0: all requests at once)")
    hf.add_argument("--ct2-threads", metavar="INTRAxINTER,...",
                    help="CTranslate2 thread layouts to sweep, intra_threads x inter_threads (default: "
                         "N x 1, N/2 x 2 when N >= 4, and 1 x N for N torch threads; one item pins it)")
    hf.add_argument("--ct2-compute-type",
                    help="CTranslate2 compute type (default: --dtype)")

    td = p.add_argument_group("tandem (passed to LLM only when given)")
    td.add_argument("--block-size", type=int)
    td.add_argument("--num-kv-blocks", type=int)
    td.add_argument("--max-num-seqs",
                    help="comma list: one tandem engine per value, swept like the batch sizes")
    td.add_argument("--max-num-batched-tokens", type=int)
    td.add_argument("--kv-cache-memory", type=float, help="GiB")
    td.add_argument("--swap-space", type=float,
                    help="GiB for swapped-out KV blocks (0 on a machine short of RAM)")
    td.add_argument("--attention-backend")
    td.add_argument("--compiled", action="store_true",
                    help="tandem's compiled decode step (enforce_eager=False); warm-up compiles it")
    td.add_argument("--compile-cache-dir", help="where the compiled step's artifacts are cached")
    td.add_argument("--data-parallel-size", type=int,
                    help="engine replicas sharing the threads (LLM's data_parallel_size; docs/distributed.md)")
    td.add_argument("--cpu-gemm", choices=("auto", "packed", "dense"))
    td.add_argument("--cpu-malloc", choices=("auto", "system"),
                    help="process-wide: with auto, HF and CTranslate2 in this process run with it too")

    args = p.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown:
        p.error(f"unknown engine(s) {', '.join(unknown)}; choose from {', '.join(ENGINES)}")
    args.workloads = list(WORKLOADS) if args.workload == "all" else list(dict.fromkeys(
        w.strip() for w in args.workload.split(",") if w.strip()))
    bad = [w for w in args.workloads if w not in WORKLOADS]
    if bad or not args.workloads:
        p.error(f"--workload: unknown {', '.join(bad) or repr(args.workload)}; "
                f"choose from {', '.join(WORKLOADS)} or all")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    if args.num_prompts is not None and args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if args.hf_batch_size is not None and args.hf_batch_size < 1:
        p.error(f"--hf-batch-size must be >= 1, got {args.hf_batch_size}")
    if args.ct2_batch_size is not None and args.ct2_batch_size < 0:
        p.error(f"--ct2-batch-size must be >= 0, got {args.ct2_batch_size}")
    try:
        args.batch_sizes = rounds.parse_int_list(args.batch_sizes, "--batch-sizes")
        args.max_num_seqs = (rounds.parse_int_list(args.max_num_seqs, "--max-num-seqs")
                             if args.max_num_seqs else None)
        args.ct2_layouts = (rounds.parse_thread_layouts(args.ct2_threads) if args.ct2_threads
                            else rounds.thread_layouts(args.threads or torch.get_num_threads()))
    except ValueError as exc:
        p.error(str(exc))
    args.hf_batch_sizes = [args.hf_batch_size] if args.hf_batch_size else args.batch_sizes
    return args



def build_random(size: str, model_dir: str, seed: int) -> None:
    print(f"building random {MODEL_SIZES[size].family} ({size}) in {model_dir}", flush=True)
    make_model(size, model_dir, seed)


def checkpoint_dir(model: str | None, save_model: str | None, prefix: str, build) -> tuple[str, object]:
    """The checkpoint a benchmark runs: ``model`` as given, else one that ``build(dir)``
    makes in ``save_model`` (kept) or in a temporary directory; the second value is that
    directory's handle (``cleanup()`` it at the end), None when nothing was made there."""
    if model:
        return model, None
    tmp = None if save_model else tempfile.TemporaryDirectory(prefix=prefix)
    model_dir = save_model or tmp.name
    build(model_dir)
    return model_dir, tmp

def available_engines(engines: list[str]) -> list[str]:
    """Drop engines whose package is not installed, with a note. The package is only
    found, not imported: the engines' libraries (and their thread pools) load in the
    engines' own processes (a broken install shows there, as a failed row)."""
    import importlib.util

    needs = {"tandem": "tandem", "hf": "transformers", "ct2": "ctranslate2"}
    if any(e.startswith("tandem") for e in engines) and importlib.util.find_spec("tandem") is None:
        # Run from a checkout without `pip install -e .`: import the tree's tandem.
        sys.path.insert(0, str(REPO_ROOT))
    kept = []
    for engine in engines:
        module = needs[engine.split("-")[0]]
        if importlib.util.find_spec(module) is None:
            print(f"note: skipping {engine}: {module} is not installed")
            continue
        kept.append(engine)
    return kept


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)

    model_dir, tmp = checkpoint_dir(args.model, args.save_model, "tandem-bench-model-",
                                    lambda d: build_random(args.make_model, d, args.seed))

    config = load_config(model_dir)
    names = args.workloads
    workloads = [make_requests(WORKLOADS[n], config, scaled_count(WORKLOADS[n], args), args.seed)
                 for n in names]

    env = environment(args, config, model_dir)
    print("  ".join(f"{k}={v}" for k, v in env.items()), flush=True)
    if args.device == "cpu" and env["load_avg_1min"] > 0.5:
        print(f"warning: 1-minute load average is {env['load_avg_1min']}: other "
              "processes are using the CPU, so figures will be noisy; with as "
              "many torch threads as busy cores, OpenMP waits can slow small "
              "models by 10x or more (try --threads 1 to check)", file=sys.stderr)

    engines, failed = load_engines(available_engines(args.engines), model_dir, args)
    for engine, (_, _, info) in engines.items():
        if info.get("attention_backend"):
            env[f"{engine}_attention_backend"] = info["attention_backend"]
            print(f"{engine}: attention backend {info['attention_backend']}", flush=True)
    try:
        results = run_benchmarks(engines, workloads, config, args, failed)
    finally:
        for handle, _, _ in engines.values():
            handle.close()
    del engines
    gc.collect()

    # Again after the engines: a peak taken during a noisy minute would flatter them.
    env["mm_peak_gflops"] = max(env["mm_peak_gflops"],
                                round(mm_peak_gflops(getattr(torch, args.dtype), args.device), 1))
    compare_with_hf(results)
    print(f"\nmm peak (best torch.mm 2048^3, before and after the engines): {env['mm_peak_gflops']} GFLOP/s")
    print(f"cpu_flags={env['cpu_flags']}  cpu_capability={env['cpu_capability']}  "
          + "".join(f"{k}={v}  " for k, v in isa_overrides().items())
          + f"threads={env['torch_threads']}  dtype={args.dtype}  rounds={args.repeat}  "
          f"load={env['load_avg']} -> {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("engines ran in this process, one after another (--in-process)" if args.in_process else
          "engines ran in separate processes, one engine at a time: "
          + ", ".join(f"{e} pid {p}" for e, p in dict.fromkeys((r.engine, r.pid) for r in results if r.pid)))
    for table in (format_table(results, env["mm_peak_gflops"]), format_latency_table(results),
                  format_sweeps(results)):
        if table:
            print(table)

    if args.json:
        payload = {
            "environment": env,
            "workloads": [asdict(w.workload) | {"num_requests": len(w.encoder_ids)}
                          for w in workloads],
            "results": [{k: v for k, v in asdict(r).items() if k != "outputs"}
                        for r in results],
        }
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"\nwrote {args.json}")

    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    # Run as the module `throughput`, not `__main__`: the classes pickled to and from
    # the engines' processes (engine_procs) must be importable there by that name.
    import throughput

    sys.exit(throughput.main())
