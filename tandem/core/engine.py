"""The engine: a checkpoint loaded, requests in, one step at a time, outputs out.

One path for every frontend. ``RequestProcessor`` (``process_request``) does a
request's own work: input processing, the checkpoint's generation defaults,
validation; ``add_request`` gives the processed request its strategy and hands
it to the ``EngineCore`` (scheduler, block manager, executor), whose step
returns plain per-request results. The one ``OutputProcessor`` turns those into
``RequestOutput``s (detokenizing once, incrementally) and reports stop-string
hits back to the core. ``LLM`` runs all of it on its caller's thread
(``step``). ``AsyncLLM`` runs ``process_request`` on its input threads, the core
on its engine thread, and the same output processor in its output loop on the
event loop, which puts each output in its request's queue. Frontends read only
the core's published snapshots (``get_stats``, ``health``); model calls between
steps (``call_model``) go to the workers through the executor.
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import Future
from typing import Any

import torch

from tandem.core.attention import AttentionType
from tandem.core.config import EngineConfig
from tandem.core.core_outputs import RequestInfo, RequestResult
from tandem.core.engine_core import EngineCore
from tandem.core.faults import EngineDeadError, EngineHealth
from tandem.core.generation_config import load_generation_defaults
from tandem.core.inputs import PromptSlot, PromptType
from tandem.core.kv.block_manager import BlockManager
from tandem.core.loader import check_model_config, load_hf_config, load_tokenizer
from tandem.core.memory import GiB
from tandem.core.model_call import check_model_call, run_model_call
from tandem.core.output_processor import OutputProcessor
from tandem.core.outputs import RequestOutput
from tandem.core.request_processor import ProcessedRequest, RequestProcessor
from tandem.core.sampling_params import SamplingParams
from tandem.core.sched.cross_compress import CrossCompressor
from tandem.core.sched.scheduler import Scheduler
from tandem.core.kv_compress_config import FEATURE as KV_COMPRESS_FEATURE
from tandem.core.sequence import Sequence, SequenceGroup
from tandem.core.strategies.builtin import BuiltinModes
from tandem.core.strategies.modes import EngineContext, Modes, RequestContext
from tandem.core.strategies.structured.manager import StructuredOutputManager
from tandem.core.structured_params import StructuredOutputsParams
from tandem.core.executor import WorkerSpec, executor_class
from tandem.lora.request import LoRARequest


logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self, config: EngineConfig, model_registry, backend_registry, mode_registry=None
    ) -> None:
        """The registries come from the caller (``LLM`` fills them from the plugins):
        ``model_registry.resolve(architectures)``, ``backend_registry.select(...)`` and
        ``mode_registry`` (``names()``, ``load(name)``; None: tandem's own modes alone)
        (``tandem.registry``; core imports nothing above it)."""
        self.config = config
        self.scheduler_config = config.scheduler_config()
        started = time.perf_counter()

        trust = config.trust_remote_code
        self.hf_config = load_hf_config(config.model_path, trust_remote_code=trust)
        self.model_cls, self.architecture = model_registry.resolve(getattr(self.hf_config, "architectures", None))
        device, dtype = config.torch_device, config.torch_dtype
        # Before anything is built from it: sizes, head divisibility, parameters vs weights and memory.
        check_model_config(self.model_cls, self.hf_config, config.model_path, dtype, device,
                           tensor_parallel_size=config.tensor_parallel_size)
        self.tokenizer = load_tokenizer(config.tokenizer_path or config.model_path, trust_remote_code=trust)
        spec = self.model_cls.kv_cache_spec(self.hf_config)
        selection = backend_registry.select(
            config.attention_backend, device=device, dtype=dtype, head_size=spec.head_size,
            attn_types=frozenset(AttentionType), block_size=config.block_size, kv_cache_dtype=config.kv_cache_torch_dtype,
            attn_features=self.model_cls.attn_features(self.hf_config) | (
                {KV_COMPRESS_FEATURE} if config.kv_compress_config is not None else set()),
        )
        self.attn_backend, self._backend_reason = selection.backend, selection.reason
        self.generation_defaults = load_generation_defaults(config.model_path, self.hf_config, config.generation_config)
        self.non_text_token_ids = self.model_cls.non_text_token_ids(self.hf_config, self.generation_defaults.hf)
        eos = self.hf_config.eos_token_id
        if self.generation_defaults.eos_token_ids is not None:  # HF generate stops on the generation config's
            eos = list(self.generation_defaults.eos_token_ids)
        self.eos_token_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        worker_spec = WorkerSpec(config, self.hf_config, self.model_cls, self.attn_backend,
                                 tuple(sorted(self.eos_token_ids)))
        # Starts the ranks (worker processes for "mp"); sizes the KV pools across them,
        # then loads the model and allocates the pools.
        logger.info("loading %s from %s (%s on %s, attention %s)", self.architecture, config.model_path,
                    str(dtype).removeprefix("torch."), device, self.attn_backend.name)
        self.executor = executor_class(config.distributed_executor_backend)(worker_spec)
        try:
            pools = self.executor.initialize()
            facts = self.executor.describe()
        except BaseException:
            self.executor.shutdown()
            raise
        num_blocks, num_cpu_blocks, block_bytes = pools.num_blocks, pools.num_cpu_blocks, pools.block_bytes

        self.block_manager = BlockManager(config.block_size, num_blocks, num_cpu_blocks,
                                          encoder_cache_blocks=config.encoder_cache_blocks,
                                          prefix_cache_blocks=config.prefix_cache_blocks)
        self._seq_ids = itertools.count()
        # speculative_config={"model": DIR, ...}: the draft model, checked against this one.
        self.draft = None
        if config.speculative is not None and config.speculative.model is not None:
            from tandem.core.strategies.speculative.draft_checkpoint import load_draft

            self.draft = load_draft(config, self.model_cls, self.hf_config, self.tokenizer, model_registry,
                                    backend_registry, num_blocks, sorted(self.eos_token_ids))
        self.vocab_size = self.model_cls.vocab_size(self.hf_config)
        # Nothing is imported or built for structured output until a request asks for it.
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids),
                                                  timeout=config.structured_outputs_compile_timeout,
                                                  max_chars=config.structured_outputs_max_chars,
                                                  max_repeat=config.structured_outputs_max_repeat,
                                                  max_whitespace=config.structured_outputs_max_whitespace)
        # One instance of each registered mode; a request's strategy is stacked from them.
        self.modes = Modes.build(mode_registry if mode_registry is not None else BuiltinModes(), EngineContext(
            config, frozenset(self.eos_token_ids), self.vocab_size, config.block_size,
            {"structured": self.structured, "draft": self.draft}))
        compress = config.kv_compress_config
        self.lora_loads = None
        if config.enable_lora:  # adapters are read off the step, then handed to every rank
            from tandem.lora.loader import AdapterLoads

            worker = self.executor.worker  # in process: the loader thread maps adapters too
            self.lora_loads = AdapterLoads(self.executor, max_cpu_loras=config.max_cpu_loras,
                                           max_rank=config.max_lora_rank,
                                           live_ids=lambda: {g.lora_id for g in self.scheduler.groups.values()},
                                           prepare=None if worker is None else worker.lora.prepare,
                                           fits=None if worker is None else worker.lora.fits)
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager, self.eos_token_ids, self._seq_ids,
                                   modes=self.modes,
                                   cross_compress=CrossCompressor(compress, self.block_manager) if compress else None,
                                   adapter_ready=(None if self.lora_loads is None
                                                  else lambda g: self.lora_loads.ready(g.lora_request)))
        self.core = EngineCore(self.scheduler_config, self.block_manager, self.executor, self.scheduler,
                               config.max_consecutive_step_failures, self.modes, lora_loads=self.lora_loads)
        self.processor = RequestProcessor(self.hf_config, self.model_cls, self.tokenizer, self.generation_defaults,
                                          self.vocab_size, self.scheduler_config, self.executor.check_request,
                                          enable_lora=config.enable_lora,
                                          draft_model=None if self.draft is None else config.speculative.model)
        self.input_processor = self.processor.input_processor
        self.output_processor = OutputProcessor(self.tokenizer, config.stream_interval)
        # One line at INFO; the details at DEBUG ($TANDEM_LOGGING_LEVEL=DEBUG): one record
        # (never interleaved with another thread's), one fact per line, the backends passed
        # over one per line too.
        logger.info("engine ready in %.1f s: %s, %s on %s, attention %s, KV pool %d blocks (%.1f MiB%s)%s",
                    time.perf_counter() - started, self.architecture, str(dtype).removeprefix("torch."), device,
                    self.attn_backend.name, num_blocks, num_blocks * block_bytes / (1 << 20),
                    "" if config.kv_cache_dtype == "auto" else f", kv_cache_dtype={config.kv_cache_dtype}",
                    self._features_line())
        backend_reason = self._backend_reason.replace(" | ", "\n      | ")
        logger.debug(
            "engine details: %s for %s\n  dtype and device: %s (%s) on %s\n  %s\n  %s\n  attention backend %s (%s)"
            "\n  KV pool %d blocks x %d tokens = %.1f MiB%s\n  swap space %d blocks = %.2f GiB, committed as used"
            "\n  executor %s, tensor_parallel_size=%d (KV sizes are per rank)",
            self.model_cls.__name__, self.architecture, str(dtype).removeprefix("torch."), config.dtype_reason,
            device, facts["linear_kernels"], facts["host_malloc"],
            self.attn_backend.name, backend_reason, num_blocks, config.block_size,
            num_blocks * block_bytes / (1 << 20),
            "" if config.kv_cache_dtype == "auto" else
            f" in {str(config.kv_cache_torch_dtype).removeprefix('torch.')} (kv_cache_dtype={config.kv_cache_dtype})",
            num_cpu_blocks, num_cpu_blocks * block_bytes / GiB,
            type(self.executor).__name__, config.tensor_parallel_size,
        )

    def _features_line(self) -> str:
        """The optional features this engine runs with, for its start-up line (each
        counted in ``get_stats()`` and ``/metrics``); empty when none is on."""
        c, on = self.config, []
        if c.kv_compress_config is not None:
            on.append("kv_compress (cross KV compressed after its observation window)")
        if getattr(self.executor.worker, "has_lm_head_screen", False):
            on.append("LM-head int8 screen")
        if not c.structured_outputs_disable_jump_forward:
            on.append("structured-output jump-forward")
        if c.enable_lora:
            on.append(f"LoRA (max_loras={c.max_loras})")
        return "; with " + ", ".join(on) if on else ""

    @property
    def worker(self):
        """The in-process worker (None when the ranks run in worker processes)."""
        return self.executor.worker

    @property
    def model(self):
        """The model, when it runs in this process (``RuntimeError`` otherwise)."""
        return self.executor.model

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        """The device KV pool, one tensor per decoder layer in the backend's layout (in-process only)."""
        return self.executor.kv_caches

    def shutdown(self) -> None:
        """Stop the executor's workers (no-op in-process); idempotent."""
        self.modes.shutdown()
        self.structured.shutdown()
        if self.lora_loads is not None:
            self.lora_loads.shutdown()
        self.executor.shutdown()

    def get_tokenizer(self):
        """The Hugging Face tokenizer (None for a model without one)."""
        return self.tokenizer

    def get_tokenizer_group(self):
        """vLLM's ``TokenizerGroup`` over the tokenizer (``encode(prompt, ...)``)."""
        from tandem.core.tokenizer_group import TokenizerGroup

        return TokenizerGroup(self.tokenizer)

    # -- requests ------------------------------------------------------------
    def get_default_sampling_params(self) -> SamplingParams:
        """What a request gets for every field it does not set: the checkpoint's
        generation config read as HF ``generate`` reads it (``generation_config="none"``:
        SamplingParams' own defaults)."""
        return self.generation_defaults.params

    def resolve_params(self, params: SamplingParams | None) -> SamplingParams:
        """The request's explicit fields over the defaults; raises ``ValueError`` or
        ``TypeError`` for a combination that cannot be served."""
        return self.processor.resolve_params(params)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | ProcessedRequest,
        params: SamplingParams | None = None,
        *,
        prompt_slot: PromptSlot | None = None,
        queue: Any = None,
        lora_request: LoRARequest | None = None,
    ) -> RequestInfo:
        """Validate and queue a request, following its outputs in the output processor;
        raises ``ValueError`` naming what is wrong. Fields of ``params`` the caller did
        not set come from the checkpoint's generation config
        (:meth:`get_default_sampling_params`). ``prompt_slot``: the model completes the
        decoder prompt first (Whisper's language detection). ``prompt`` may be a request
        :meth:`process_request` made already (on another thread), with no ``params``,
        ``prompt_slot`` or ``lora_request`` then. ``queue``: where the request's outputs go
        instead of :meth:`step`'s list (``AsyncLLM``: its consumer's ``asyncio.Queue``).
        ``lora_request``: the LoRA adapter the request runs with (``enable_lora=True``;
        None: the base weights)."""
        self._check_new(request_id)
        if isinstance(prompt, ProcessedRequest):
            if params is not None or prompt_slot is not None or lora_request is not None:
                raise TypeError("a processed request carries its params, prompt slot and LoRA request: "
                                "give none of them again")
            req = prompt
        else:
            req = self.process_request(prompt, params, prompt_slot=prompt_slot, lora_request=lora_request)
        info = self._add_to_core(request_id, req)
        self.output_processor.add_request(info, queue)
        return info

    def process_request(
        self, prompt: PromptType, params: SamplingParams | None = None, *, prompt_slot: PromptSlot | None = None,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """A request's own work (params resolved, prompt tokenized or audio decoded,
        lengths and values checked), touching no engine state: any thread may call it
        (``AsyncLLM`` calls it off its engine thread). Raises ``ValueError`` or
        ``TypeError`` naming what is wrong."""
        return self.processor.process(prompt, params, prompt_slot, lora_request)

    def _add_to_core(self, request_id: str, req: ProcessedRequest) -> RequestInfo:
        """Queue a processed request in the core: its strategy and the pool check; on
        the thread that steps the engine."""
        inputs, params, prompt_slot, prompt_len = req.inputs, req.params, req.prompt_slot, req.prompt_len
        # Stacked from the modes that apply (tandem/core/strategies/modes.py); raises
        # ValueError for modes that exclude each other, or a mode's own refusal.
        strategy, shape = self.modes.plan(RequestContext(
            request_id, params, prompt_len, inputs.encoder_inputs.token_ids, {"prompt_slot": prompt_slot}))
        seqs = [Sequence(next(self._seq_ids), inputs.prompt_token_ids, i)
                for i in range(strategy.num_initial_seqs(params))]
        group = SequenceGroup(request_id, inputs.encoder_inputs, seqs, params, time.monotonic(),
                              lora_request=req.lora_request)
        group.strategy = strategy
        # Every sequence at full length must fit the pool, or it would preempt itself
        # forever (blocks its sequences share count once; the cross table always counts).
        slot_tokens = prompt_len - len(inputs.prompt_token_ids)
        need = group.strategy.blocks_needed_at_most(group, prompt_len + params.max_tokens, self.config.block_size)
        if need is None:
            need = self.block_manager.blocks_needed(group, extra_tokens=params.max_tokens + slot_tokens)
        usable = self.block_manager.usable_blocks
        if need > usable:
            raise ValueError(
                f"request needs up to {need} KV blocks but the pool has {usable}; "
                "raise num_kv_blocks or kv_cache_memory, or lower max_tokens"
            )
        self.core.add(group)
        return RequestInfo(
            request_id, params, inputs.encoder_prompt,
            list(inputs.encoder_prompt_token_ids if inputs.encoder_prompt_token_ids is not None
                 else inputs.encoder_inputs.token_ids or ()),
            inputs.prompt, list(inputs.prompt_token_ids), self.non_text_token_ids, shape,
        )

    def _check_new(self, request_id: str) -> None:
        self.core.faults.check_alive()
        if request_id in self.output_processor.requests or self.core.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")

    def compile_structured_outputs(self, so: StructuredOutputsParams, may_release: bool = False) -> Future:
        """A future of ``so``'s compiled grammar, for a frontend that wants a bad spec
        refused before it queues the request (a server's 400): it fails with a
        ``ValueError`` (``GrammarCompileError``) naming the field and the cause. The
        compile is cached, so the request that follows reuses it. Thread-safe; raises
        ``ImportError`` naming the ``structured`` extra without xgrammar. ``may_release``:
        the caller calls ``release_structured_outputs(so)`` when it stops waiting, which
        cancels the compile if nobody else waits for it and it has not started."""
        return self.structured.grammar(so, may_release=may_release)

    def release_structured_outputs(self, so: StructuredOutputsParams) -> None:
        self.structured.release(so)

    def max_new_tokens(self, prompt: PromptType) -> int:
        """Tokens the model's decoder positions leave after this prompt's decoder prompt;
        raises ``ValueError`` or ``TypeError`` for a prompt ``add_request`` would reject."""
        inputs = self.input_processor.process(prompt)
        return self.model_cls.max_decoder_len(self.hf_config) - len(inputs.prompt_token_ids)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Drop the requests and free their blocks; returns their (aborted) outputs
        (those of requests that have a queue go there)."""
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        return self.output_processor.process(self.core.abort(ids)).outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.core.stats.num_requests_unfinished

    def get_stats(self) -> dict[str, int]:
        """Counters as of the last step: read from a snapshot the engine publishes,
        so any thread may call this."""
        return self.core.stats.as_dict()

    # -- the step ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward pass. Returns an output for every request that
        advanced, as its ``output_kind`` asks: everything so far, only what is new,
        or (``FINAL_ONLY``) nothing until it finishes; and one with ``error`` set for
        every request that failed in it (``tandem/core/faults.py``: a request's own
        fault fails it alone, a fault of the step fails the step's requests, and
        ``max_consecutive_step_failures`` failed steps in a row make the engine dead)."""
        return self.process_outputs(self.core.step())

    def process_outputs(self, results: list[RequestResult]) -> list[RequestOutput]:
        """The outputs of the core's results (a step's, an abort's), through the one
        output processor; stop strings found end their sequences in the core now, and a
        request whose output cannot be built fails alone."""
        done = self.output_processor.process(results)
        if done.stops:
            self.core.stop(done.stops)
        if done.failed:
            self.core.fail(done.failed)  # its state is gone: the failure's result is dropped
        return done.outputs

    # -- model calls between steps ---------------------------------------------
    def call_model(self, method: str, *args: Any) -> Any:
        """Run one of the model's declared calls (``model_calls``: Whisper's
        ``alignment_attention`` and ``next_token_logits``) with ``args`` on every rank,
        between steps, through the executor (``tandem/core/model_call.py``): rank 0's
        answer. Raises ``ValueError`` (``ModelCallError``) when it fails; the engine
        serves on. On the thread that steps the engine."""
        self.core.faults.check_alive()
        check_model_call(self.model_cls, method)
        return run_model_call(self.executor, method, args)

    def health(self) -> EngineHealth:
        """The engine's health after its last step (a snapshot other threads may read);
        dead as soon as a worker process is gone, even between steps."""
        h = self.core.health()
        if h.status != "dead":
            try:
                self.executor.check_health()  # no round trip: looks at the workers' processes
            except EngineDeadError as e:
                return EngineHealth("dead", h.consecutive_step_failures, h.failed_steps, str(e))
        return h

    @property
    def faults(self):
        return self.core.faults

