"""Engine configuration, validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


# kv_cache_dtype: vLLM's names for an fp8 cache (core/kv/fp8.py); "auto" is the model dtype.
FP8_KV_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}

DEFAULT_KV_CACHE_GIB = 1.0
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 16384


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def option(default, help: str, *, choices: tuple | None = None, flags: tuple[str, ...] = (),
           more_values: bool = False):
    """A dataclass field that is an engine option: ``help`` is shown by ``help(LLM)`` and
    ``tandem COMMAND --help`` (another option named in backticks, `max_num_seqs`, shows as
    its flag on the command line);
    ``choices``: the values it takes (and None where that is the default), the one list that
    both the CLI and ``__post_init__`` read (``check_choice``); ``more_values``: the choices
    are only the CLI's, ``__post_init__`` checks a wider set itself; ``flags``: the CLI's
    spellings, the first shown (default: ``--name-with-dashes``)."""
    return field(default=default, metadata={"help": help, "choices": choices, "flags": flags,
                                            "more_values": more_values})


@dataclass
class EngineConfig:
    """Every engine option, declared once: its name, type, default, help and CLI choices here,
    its validation in ``__post_init__``. ``LLM`` / ``AsyncLLM`` keywords and every command's
    engine flags are generated from these fields (``tandem/core/engine_args.py``)."""

    model: str = field(metadata={"help": "local checkpoint directory or Hugging Face Hub repo id (org/name)"})
    tokenizer: str | None = option(
        None, "tokenizer directory or Hugging Face Hub repo id (default: none, the model's)"
    )
    # core/checkpoint_source.py: a repo id becomes a snapshot directory of the Hub cache.
    revision: str | None = option(
        None, "the Hub revision of a model given as a repo id: branch, tag or commit hash (default: none, main)"
    )
    tokenizer_revision: str | None = option(
        None, "the Hub revision of a `tokenizer` given as a repo id (default: none: `revision` when it is the "
        "model's repo, else main)"
    )
    download_dir: str | None = option(
        None, "where Hub repo ids are downloaded and cached (default: none, Hugging Face's cache: $HF_HUB_CACHE, "
        "else $HF_HOME/hub, else ~/.cache/huggingface/hub); HF_TOKEN is the token, HF_HUB_OFFLINE=1 serves from "
        "the cache"
    )
    # $TANDEM_AUTO_DTYPE, when set, overrides what "auto" means; with int8 "auto" is float32 (core/dtype.py).
    dtype: str | torch.dtype = option(
        "auto",
        "compute dtype; auto: the checkpoint's on GPU, on CPU bfloat16 where the CPU has it natively "
        "(avx512_bf16 / AMX), else float32; $TANDEM_AUTO_DTYPE, when set, is what auto means instead; with "
        "`quantization` int8, float32",
        choices=("auto", "float32", "bfloat16", "float16"),
        more_values=True,  # also torch dtypes and the aliases float / half
    )
    device: str = option("auto", "cpu, cuda, cuda:N or auto (cuda where there is one)")
    block_size: int = option(16, "tokens per KV-cache block")
    num_kv_blocks: int | None = option(
        None, "KV-cache blocks in the device pool; overrides `kv_cache_memory` (default: none, sized from "
        "`kv_cache_memory`)"
    )
    kv_cache_memory: float | None = option(
        None, "GiB for the device KV pool (default: none, sized from memory: what `max_num_seqs` full-length "
        f"requests need, at most {DEFAULT_KV_CACHE_GIB:g} GiB)"
    )
    kv_cache_dtype: str = option(
        "auto", "KV-cache storage: auto, the compute dtype (`dtype`); fp8 or fp8_e4m3 (float8 e4m3, unit roundoff "
        "2^-4) or fp8_e5m2 (float8 e5m2, 2^-3): one byte per element, each layer's self and cross keys and values "
        "with their own per-tensor scale, calibrated on the first write (docs/backends.md, \"fp8 KV cache\"); "
        "served by cpu_paged, torch_sdpa and triton",
        choices=("auto", *FP8_KV_DTYPES),
    )
    swap_space: float = option(1.0, "GiB of CPU memory for swapped-out KV blocks, committed only as blocks are swapped")
    # core/kv/encoder_cache.py
    encoder_cache_blocks: int | None = option(
        None, "device KV blocks that finished requests' cross-attention tables may keep, so a later request with "
        "the same encoder input skips its encoder; kept tables are evicted (least recently used first) before any "
        "request waits or is preempted for blocks; 0 turns the cache off (default: none, bounded by the pool)"
    )
    # core/kv/prefix_cache.py
    prefix_cache_blocks: int | None = option(
        None, "device KV blocks that finished requests' decoder-prompt blocks may keep (full blocks, keyed by the "
        "encoder input and the prompt up to them), so a later request with the same encoder input and decoder "
        "prompt prefix skips computing them; live requests share them too; kept blocks are evicted (least recently "
        "used first) before any request waits or is preempted for blocks; 0 turns prefix caching off (default: "
        "none, bounded by the pool)"
    )
    max_num_seqs: int = option(DEFAULT_MAX_NUM_SEQS, "sequences the scheduler runs at once")
    max_num_batched_tokens: int = option(DEFAULT_MAX_NUM_BATCHED_TOKENS, "tokens one engine step may compute")
    # core/sched/multi_step.py
    num_scheduler_steps: int = option(
        1, "decode steps the worker runs per schedule when every running request is a plain one-sequence decode "
        "(greedy or seeded, no logprobs, stop strings or logits processor callables; no request waiting, or no "
        "sequence slot free for one): the "
        "scheduler's and the output path's work per row is paid once for them all, tokens come back in runs of up "
        "to this many, and a request that stops inside a run ends there (the tokens after it are dropped); 1 "
        "schedules every step (tensor parallel needs 1)"
    )
    preemption_mode: str | None = option(
        None, "what a request preempted for memory does: recompute (drop its KV, compute it again when resumed) or "
        "swap (move its KV to the CPU pool of `swap_space`) (default: none: recompute single-sequence requests, "
        "swap those with several sequences)",
        choices=("recompute", "swap"),
    )
    attention_backend: str | None = option(
        None, "attention backend name (default: none: $TANDEM_ATTENTION_BACKEND, else the first that can serve)",
        flags=("--attention-backend", "--backend"),
    )
    seed: int = option(
        0, "the engine's sampling seed: the random stream of requests that give no seed of their own (a "
        "request's own seed is SamplingParams.seed)"
    )
    trust_remote_code: bool = option(
        False, "allow Python code shipped inside the checkpoint (transformers' auto_map) to run"
    )
    generation_config: str = option(
        "auto", "request defaults: 'auto' (the checkpoint's generation_config.json, as HF generate reads it), "
        "'none' (SamplingParams' own), a directory holding one, or a Hub repo id whose generation_config.json to "
        "read (fetched as the model is)"
    )
    # core/layers/linear_kernels.py
    cpu_gemm: str = option(
        "auto", "CPU linear layers: oneDNN pre-packed weights (auto: where they run, for float32 layers of more "
        "than 65,536 weights, smaller ones F.linear; packed: every layer, an error where they cannot) or plain "
        "F.linear (dense)",
        choices=("auto", "packed", "dense"),
    )
    # core/worker/host_malloc.py: glibc keeps freed memory for reuse instead of re-mmapping
    # every step's large tensors.
    cpu_malloc: str = option(
        "auto", "CPU host allocator: auto keeps glibc's freed memory for reuse (no per-step page faults on large "
        "tensors) unless LD_PRELOAD or MALLOC_* chose otherwise; system leaves it alone",
        choices=("auto", "system"),
    )
    # core/layers/lm_head_screen.py: greedy steps of few rows read an int8 copy of the LM head
    # and compute only the tokens that could win, exactly.
    lm_head_screen: str = option(
        "auto", "greedy decode steps of up to 8 rows take their float32 argmax from an int8 pass over the LM head "
        "plus a proven error bound, computing exactly only the tokens that could win (same tokens; auto: on CPU "
        "in float32 without quantization, at the cost of an int8 copy of the head); off computes every logit",
        choices=("auto", "off"),
    )
    # core/worker/compiled_step.py: decode steps as torch.compile'd graphs (CPU; CUDA: piecewise_backend.py).
    enforce_eager: bool = option(
        True, "run every step eager; False compiles the decode step (every row one new token, no encoder) with "
        "torch.compile (inductor; on CUDA each piece between attention calls captured as a CUDA graph), one "
        "graph per batch-size bucket (powers of two up to `compile_max_batch_size`), compiled the first time a "
        "bucket is needed; larger batches, other steps and any compile failure run eager (docs/performance.md has "
        "the measurements behind the default)"
    )
    compile_max_batch_size: int = option(
        32, "the largest decode batch (rows) a compiled graph serves when `enforce_eager` is False; larger ones "
        "run eager"
    )
    compile_cache_dir: str | None = option(
        None, "where compiled decode graphs are cached across starts (inductor's FX graph and AOTAutograd caches) "
        "(default: none: $TORCHINDUCTOR_CACHE_DIR if set, else $XDG_CACHE_HOME/tandem/inductor, "
        "$XDG_CACHE_HOME defaulting to ~/.cache)"
    )
    quantization: str | None = option(
        None, "int8: int8 weights with dynamically quantized activations (CPU; computes in float32, so `dtype` "
        "auto or float32) (default: none, the checkpoint's weights in `dtype`)",
        choices=("int8",),
    )
    # core/strategies/speculative/: vLLM's shape; a JSON object on the command line.
    speculative_config: dict | str | None = option(
        None, 'speculative decoding: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, '
        '"prompt_lookup_min": m} drafts up to k tokens per step by prompt lookup (the longest suffix of n down to m '
        'decoder tokens found in the encoder input or the decoder\'s own tokens); {"model": DIR, '
        '"num_speculative_tokens": k}: a smaller draft checkpoint with the same vocabulary proposes k tokens '
        'greedily; greedy outputs are unchanged, sampled ones keep their distribution (default: none, no speculation)'
    )
    # core/kv_compress_config.py: a JSON object on the command line.
    kv_compress: dict | str | None = option(
        None, 'cross-attention KV compression: {"keep_fraction": f, "window": w, "min_keep": m}: after a '
        "request's first w decode steps, each decoder layer and KV head keeps the fraction f (at least m, rounded "
        "up to whole blocks) of the encoder positions: those it attended to most in those steps where its "
        "attention was concentrated and static, else evenly spaced ones; the request's cross-attention blocks "
        "are re-packed into fewer, the rest freed for other requests; true: the defaults "
        '(f=0.25, w=1, m=32); outputs may differ from uncompressed ones (default: none, off)'
    )
    # core/executor/: one worker in this process, or tensor-parallel ranks in worker processes / Ray actors.
    tensor_parallel_size: int = option(
        1, "tensor-parallel ranks the model is split across (attention heads, FFN and vocabulary), one worker "
        "process each; the KV pool is split by heads, each rank holding its share",
    )
    distributed_executor_backend: str | None = option(
        None, "what runs the ranks: mp (worker processes on this machine) or ray (Ray actors, one machine or "
        "several; pip install 'tandem-engine[ray]') (default: none: in this process when "
        "`tensor_parallel_size` is 1, else mp)",
        choices=("mp", "ray"),
    )
    # core/executor/ray_executor.py: where Ray places the ranks (a placement group's strategy).
    ray_placement_strategy: str = option(
        "STRICT_PACK", "with `distributed_executor_backend` ray: how the ranks' placement group is placed: "
        "STRICT_PACK (every rank on one node), PACK (one node if they fit, else several), SPREAD / STRICT_SPREAD "
        "(across nodes, as far as possible / one rank per node)",
        choices=("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"),
    )
    # core/output_processor.py: streamed outputs (AsyncLLM, LLMEngine.step, tandem serve's SSE events).
    stream_interval: int = option(
        1, "tokens per streamed output (vLLM's): a streaming request (output kind DELTA or CUMULATIVE; a server's "
        "stream, one event per output) gets an output for its first token, then once one of its completions has "
        "this many tokens not yet shown or has ended, and always its last; 1: an output every step; larger: fewer, "
        "larger chunks, less serving cost per token, text arriving in bursts"
    )
    # core/faults.py
    max_consecutive_step_failures: int = option(
        3, "failed steps in a row (no good step between) after which the engine declares itself dead (a server's "
        "/health answers 503); each failed step fails only its own requests"
    )
    # core/strategies/structured/manager.py: compiling one request's grammar, bounded.
    structured_outputs_compile_timeout: float = option(
        30.0, "seconds a structured-output grammar may take to compile, from the request asking; a request whose "
        "compile passes it fails naming it (the compile, which cannot be interrupted, ends in a daemon thread)"
    )
    structured_outputs_max_chars: int = option(
        64 * 1024, "characters a structured-output spec (a JSON schema's text, a regex, a grammar, the choices) may "
        "have to be compiled; a longer one is refused before compiling, naming its size and this limit"
    )
    # core/strategies/structured/bounds.py: what one grammar may cost, checked before compiling.
    structured_outputs_max_repeat: int = option(
        10_000, "the largest repetition count a structured-output grammar may hold (regex and EBNF {n,m} counts, a JSON "
        "schema's minLength / maxLength / minItems / maxItems / minProperties / maxProperties), and the longest "
        "shortest text of any of its rules (nested counts multiply); a grammar over it is refused before compiling, "
        "naming the count and this limit"
    )
    structured_outputs_max_whitespace: int = option(
        8, "whitespace characters a JSON structured output may write between two of its tokens (a weak model may "
        "otherwise write whitespace until max_tokens); 0: any amount, as JSON allows"
    )
    # core/strategies/structured/jump.py; docs/structured_output.md
    structured_outputs_jump_timeout: float = option(
        0.25, "CPU seconds one jump-forward search (the text a structured output's grammar forces next) may take; "
        "a request whose search passes it fails, naming it, while the others run on"
    )
    structured_outputs_disable_jump_forward: bool = option(
        False, "decode every structured-output token with a forward pass of its own: without it, where the grammar "
        "admits exactly one continuation (a key, punctuation, the rest of an enum value) its tokens are appended at "
        "once and computed as one chunk"
    )

    # tandem/lora/: PEFT LoRA adapters picked per request (LoRARequest); docs/lora.md
    enable_lora: bool = option(
        False, "serve PEFT LoRA adapters per request (a request's lora_request): each request may name its own adapter; the "
        "base weights are shared"
    )
    max_loras: int = option(1, "LoRA adapters resident on the device at once (one step serves at most this many)")
    max_lora_rank: int = option(16, "the largest LoRA rank an adapter may have; higher ranks are refused per request")
    max_cpu_loras: int | None = option(
        None, "LoRA adapters kept loaded in CPU memory, least recently used evicted first (default: none, "
        "`max_loras`)"
    )

    def __post_init__(self) -> None:
        from tandem.core.checkpoint_source import check_revision

        for name in ("revision", "tokenizer_revision"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name}={value!r}: must be None or a branch, tag or commit hash")
            if value is not None:
                check_revision(value, name)  # it may not leave the Hub cache's refs/
        dd = self.download_dir
        if dd is not None and (not isinstance(dd, (str, Path)) or not str(dd) or Path(dd).is_file()):
            raise ValueError(f"download_dir={dd!r}: must be None or a directory (created if missing)")
        self.download_dir = None if dd is None else str(dd)
        if self.tokenizer is not None and not isinstance(self.tokenizer, (str, Path)):
            raise ValueError(f"tokenizer={self.tokenizer!r}: must be None, a local directory or a Hub repo id")
        if self.tokenizer is None and self.tokenizer_revision is not None:
            raise ValueError(
                f"tokenizer_revision={self.tokenizer_revision!r} without a tokenizer: the model's tokenizer comes "
                "at `revision`; tokenizer_revision is for a tokenizer given as a Hub repo id"
            )
        if isinstance(self.dtype, str) and self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: must be 'auto' or one of {sorted(_DTYPES)}")
        if not isinstance(self.dtype, str) and self.dtype not in _DTYPES.values():
            raise ValueError(f"dtype={self.dtype!r}: must be 'auto', float32, bfloat16 or float16")
        if not isinstance(self.device, str) or (
            self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:")
        ):
            raise ValueError(f"device={self.device!r}: must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r}: CUDA is not available on this machine")
        self.torch_device = torch.device(self.device)
        from tandem.core.dtype import auto_dtype_override, resolve_auto_dtype

        # A bad $TANDEM_AUTO_DTYPE is refused whatever dtype is asked for, so a typo
        # never goes unnoticed; a valid one changes only what "auto" means.
        auto_dtype_override()
        for f in fields(self):
            if f.metadata.get("choices") and not f.metadata["more_values"]:
                check_choice(f.name, getattr(self, f.name))
        if self.dtype != "auto":
            self.torch_dtype = _DTYPES[self.dtype] if isinstance(self.dtype, str) else self.dtype
            self.dtype_reason = "asked for"
            if self.quantization == "int8" and self.torch_dtype != torch.float32:
                raise ValueError(
                    f"dtype={self.dtype!r} with quantization='int8': int8 dynamic quantization computes in "
                    "float32; use dtype='float32' or 'auto' (which means float32 with int8), or drop quantization"
                )
        if not is_int(self.stream_interval) or self.stream_interval < 1:
            raise ValueError(f"stream_interval={self.stream_interval!r}: must be an integer >= 1 (tokens per streamed "
                             "output)")
        if not is_int(self.block_size) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size={self.block_size!r}: must be an integer in [1, 1024]")
        if self.num_kv_blocks is not None and (not is_int(self.num_kv_blocks) or self.num_kv_blocks < 1):
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks!r}: must be an integer >= 1")
        if self.kv_cache_memory is not None and (not is_real(self.kv_cache_memory) or self.kv_cache_memory <= 0):
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory!r}: must be a finite, positive number of GiB")
        if self.encoder_cache_blocks is not None and (
            not is_int(self.encoder_cache_blocks) or self.encoder_cache_blocks < 0
        ):
            raise ValueError(
                f"encoder_cache_blocks={self.encoder_cache_blocks!r}: must be None (bounded by the pool) or an "
                "integer >= 0 (0: no encoder cache)"
            )
        if self.prefix_cache_blocks is not None and (
            not is_int(self.prefix_cache_blocks) or self.prefix_cache_blocks < 0
        ):
            raise ValueError(
                f"prefix_cache_blocks={self.prefix_cache_blocks!r}: must be None (bounded by the pool) or an "
                "integer >= 0 (0: no prefix cache)"
            )
        if not is_real(self.swap_space) or self.swap_space < 0:
            raise ValueError(f"swap_space={self.swap_space!r}: must be a finite number of GiB >= 0")
        if not isinstance(self.trust_remote_code, bool):
            raise ValueError(f"trust_remote_code={self.trust_remote_code!r}: must be True or False")
        self._check_lora()
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager={self.enforce_eager!r}: must be True or False")
        if not is_int(self.compile_max_batch_size) or not 1 <= self.compile_max_batch_size <= 1024:
            raise ValueError(f"compile_max_batch_size={self.compile_max_batch_size!r}: must be an integer in [1, 1024]")
        cd = self.compile_cache_dir
        if cd is not None and (not isinstance(cd, (str, Path)) or not str(cd) or Path(cd).is_file()):
            raise ValueError(f"compile_cache_dir={cd!r}: must be None or a directory (created if missing)")
        self.compile_cache_dir = None if cd is None else str(cd)
        if not is_int(self.max_consecutive_step_failures) or self.max_consecutive_step_failures < 1:
            raise ValueError(
                f"max_consecutive_step_failures={self.max_consecutive_step_failures!r}: must be an integer >= 1"
            )
        if not is_real(self.structured_outputs_compile_timeout) or self.structured_outputs_compile_timeout <= 0:
            raise ValueError(f"structured_outputs_compile_timeout={self.structured_outputs_compile_timeout!r}: must be "
                             "a finite, positive number of seconds")
        if not is_int(self.structured_outputs_max_chars) or self.structured_outputs_max_chars < 1:
            raise ValueError(f"structured_outputs_max_chars={self.structured_outputs_max_chars!r}: must be an "
                             "integer >= 1")
        if not is_int(self.structured_outputs_max_repeat) or self.structured_outputs_max_repeat < 1:
            raise ValueError(f"structured_outputs_max_repeat={self.structured_outputs_max_repeat!r}: must be an "
                             "integer >= 1")
        if not is_int(self.structured_outputs_max_whitespace) or self.structured_outputs_max_whitespace < 0:
            raise ValueError(f"structured_outputs_max_whitespace={self.structured_outputs_max_whitespace!r}: must be "
                             "an integer >= 0 (0: any amount)")
        if not is_real(self.structured_outputs_jump_timeout) or self.structured_outputs_jump_timeout <= 0:
            raise ValueError(f"structured_outputs_jump_timeout={self.structured_outputs_jump_timeout!r}: must be a "
                             "number of seconds > 0")
        if not isinstance(self.structured_outputs_disable_jump_forward, bool):
            raise ValueError(f"structured_outputs_disable_jump_forward={self.structured_outputs_disable_jump_forward!r}: "
                             "must be True or False")
        if not is_int(self.seed) or not -(2**63) <= self.seed <= 2**64 - 1:
            raise ValueError(f"seed={self.seed!r}: must be an integer in [-2**63, 2**64 - 1], the range torch seeds take")
        self._check_parallel()
        gc = self.generation_config
        if not isinstance(gc, (str, Path)) or not str(gc):
            raise ValueError(
                f"generation_config={gc!r}: must be 'auto' (the checkpoint's), 'none', a directory "
                "holding a generation_config.json, or a Hugging Face Hub repo id"
            )
        self.generation_config = str(gc)
        from tandem.core.speculative_config import SpeculativeConfig

        self.speculative = SpeculativeConfig.parse(self.speculative_config)
        from tandem.core.kv_compress_config import KVCompressConfig

        self.kv_compress_config = KVCompressConfig.parse(self.kv_compress)
        if self.kv_cache_dtype != "auto" and self.kv_compress_config is not None:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} with kv_compress: kv_compress reads and re-packs cross "
                "K/V in the compute dtype; use kv_cache_dtype='auto' with kv_compress, or drop kv_compress"
            )
        _check_scheduler_limits(self)
        self._resolve_checkpoints()
        if self.dtype == "auto":
            self.torch_dtype, self.dtype_reason = resolve_auto_dtype(
                self.model_path, self.torch_device, self.quantization
            )
        # The KV cache tensors' dtype: the compute dtype, or an fp8 format.
        self.kv_cache_torch_dtype = FP8_KV_DTYPES.get(self.kv_cache_dtype, self.torch_dtype)

    def _check_lora(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora={self.enable_lora!r}: must be True or False")
        if not is_int(self.max_loras) or self.max_loras < 1:
            raise ValueError(f"max_loras={self.max_loras!r}: must be an integer >= 1")
        if not is_int(self.max_lora_rank) or not 1 <= self.max_lora_rank <= 1024:
            raise ValueError(f"max_lora_rank={self.max_lora_rank!r}: must be an integer in [1, 1024]")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif not is_int(self.max_cpu_loras) or self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras={self.max_cpu_loras!r}: must be None or an integer >= max_loras ({self.max_loras})"
            )

    def _check_parallel(self) -> None:
        tp = self.tensor_parallel_size
        if not is_int(tp) or tp < 1:
            raise ValueError(f"tensor_parallel_size={tp!r}: must be an integer >= 1")
        if tp > 1 and is_int(self.num_scheduler_steps) and self.num_scheduler_steps > 1:
            raise ValueError(f"num_scheduler_steps={self.num_scheduler_steps}: runs of decode steps are built for "
                             f"one rank; tensor_parallel_size={tp} needs num_scheduler_steps=1")
        backend = self.distributed_executor_backend
        if backend is None and tp > 1:
            self.distributed_executor_backend = "mp"
        if backend == "ray":
            import importlib.util

            if importlib.util.find_spec("ray") is None:
                raise ValueError(
                    "distributed_executor_backend='ray': Ray is not installed; pip install 'tandem-engine[ray]', "
                    "or use 'mp' (worker processes on this machine)"
                )
        if self.torch_device.type == "cuda" and tp > 1:
            first = self.torch_device.index or 0
            if first + tp > torch.cuda.device_count() and backend != "ray":
                raise ValueError(
                    f"tensor_parallel_size={tp} from device={self.device!r} needs GPUs {first}..{first + tp - 1} "
                    f"but this machine has {torch.cuda.device_count()}"
                )

    def _resolve_checkpoints(self) -> None:
        """``model_path`` / ``tokenizer_path``: the local directories the engine reads, a repo id's
        snapshot in the Hub cache; last, so no bad option waits for a download. ``model`` and
        ``tokenizer`` stay as given, for display (the served model name, logs)."""
        from tandem.core.checkpoint_source import resolve_checkpoint

        if isinstance(self.model, Path):
            self.model = str(self.model)
        self.model_path = resolve_checkpoint(
            self.model, "model", revision=self.revision, download_dir=self.download_dir
        )
        self.tokenizer_path = None
        if self.tokenizer is not None:
            self.tokenizer = str(self.tokenizer)
            same_repo = self.tokenizer == self.model and self.model_path != self.model
            revision = self.tokenizer_revision or (self.revision if same_repo else None)
            self.tokenizer_path = resolve_checkpoint(
                self.tokenizer, "tokenizer", revision=revision, download_dir=self.download_dir, weights=False
            )
        if self.generation_config not in ("auto", "none"):
            # a directory as it is; a repo id's snapshot (no weights), the model's revision when it is the model
            same_repo = self.generation_config == self.model and self.model_path != self.model
            self.generation_config = resolve_checkpoint(
                self.generation_config, "generation_config", revision=self.revision if same_repo else None,
                download_dir=self.download_dir, weights=False,
            )


    def scheduler_config(self) -> "SchedulerConfig":
        """The scheduler's share of these options (``SCHEDULER_OPTIONS``), as the scheduler takes it."""
        return SchedulerConfig(**{name: getattr(self, name) for name in SCHEDULER_OPTIONS})


def check_choice(name: str, value: object) -> None:
    """``ValueError`` unless ``value`` is one of engine option ``name``'s ``choices`` (or None,
    where None is its default), naming the option, the value and every allowed one."""
    f = _ENGINE_FIELDS[name]
    allowed = (*((None,) if f.default is None else ()), *f.metadata["choices"])
    if value not in allowed:
        listed = [repr(v) for v in allowed]
        if len(listed) > 3:
            raise ValueError(f"{name}={value!r}: must be one of {', '.join(listed)}")
        either = f"{', '.join(listed[:-1])} or {listed[-1]}" if len(listed) > 1 else listed[0]
        raise ValueError(f"{name}={value!r}: must be {either}")


# num_scheduler_steps' bound: a run's tokens are one output message (and its KV blocks are
# taken before it starts), so a run stays short.
MAX_SCHEDULER_STEPS = 64


def _check_scheduler_limits(c) -> None:
    """The scheduler's options, of an ``EngineConfig`` or a ``SchedulerConfig``: the one check of both."""
    if not is_int(c.max_num_seqs) or c.max_num_seqs < 1:
        raise ValueError(f"max_num_seqs={c.max_num_seqs!r}: must be an integer >= 1")
    if not is_int(c.max_num_batched_tokens) or c.max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens={c.max_num_batched_tokens!r}: must be an integer >= 1")
    if c.max_num_batched_tokens < c.max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens={c.max_num_batched_tokens} must be >= "
            f"max_num_seqs={c.max_num_seqs} so every running sequence can decode"
        )
    check_choice("preemption_mode", c.preemption_mode)
    if not is_int(c.num_scheduler_steps) or not 1 <= c.num_scheduler_steps <= MAX_SCHEDULER_STEPS:
        raise ValueError(f"num_scheduler_steps={c.num_scheduler_steps!r}: must be an integer in [1, {MAX_SCHEDULER_STEPS}]")
    if not is_int(c.max_loras) or c.max_loras < 1:
        raise ValueError(f"max_loras={c.max_loras!r}: must be an integer >= 1")


_ENGINE_FIELDS = {f.name: f for f in fields(EngineConfig)}
# The options the scheduler reads. ``SchedulerConfig`` is generated from their ``EngineConfig``
# fields (names, order, defaults, help) and checked by the same function, so it declares nothing
# of its own; ``EngineConfig.scheduler_config()`` is where an engine builds it.
SCHEDULER_OPTIONS = ("max_num_seqs", "max_num_batched_tokens", "preemption_mode", "max_loras", "num_scheduler_steps")
SchedulerConfig = make_dataclass(
    "SchedulerConfig",
    [(name, _ENGINE_FIELDS[name].type, field(default=_ENGINE_FIELDS[name].default, metadata=_ENGINE_FIELDS[name].metadata))
     for name in SCHEDULER_OPTIONS],
    namespace={"__post_init__": _check_scheduler_limits, "__module__": __name__,
               "__doc__": "The scheduler's share of ``EngineConfig`` (its fields hold the defaults and help)."},
)
