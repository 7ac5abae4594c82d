"""The engine: a checkpoint loaded, requests in, one step at a time, outputs out.

``LLMEngine`` loads the model and its configs, turns prompts into requests
(input processing, the checkpoint's generation defaults, validation, the
request's strategy) and hands them to the ``EngineCore`` (scheduler, block
manager, worker), whose step returns plain per-request results. The
``OutputProcessor`` turns those into ``RequestOutput``s (detokenizing once,
incrementally) and reports stop-string hits back to the core.
``AsyncLLM`` drives the core from its engine thread and runs the output side
in its consumers instead.
"""

from __future__ import annotations

import itertools
import logging
import time
from concurrent.futures import Future

import torch

from tandem.core.attention import AttentionType
from tandem.core.block_manager import BlockManager
from tandem.core.config import EngineConfig
from tandem.core.core_outputs import RequestInfo, RequestResult
from tandem.core.engine_core import EngineCore
from tandem.core.faults import EngineDeadError, EngineHealth, describe
from tandem.core.generation_config import load_generation_defaults, merge_params, resolve_lengths
from tandem.core.inputs import EncoderDecoderInputs, InputProcessor, PromptType
from tandem.core.loader import check_model_config, load_hf_config, load_tokenizer
from tandem.core.memory import GiB
from tandem.core.output_processor import OutputProcessor
from tandem.core.outputs import RequestOutput
from tandem.core.sampling_params import SamplingParams
from tandem.core.scheduler import Scheduler, SchedulerConfig
from tandem.core.sequence import Sequence, SequenceGroup
from tandem.core.strategies.beam import BeamSearchStrategy
from tandem.core.strategies.prompt_slot import PromptSlot, PromptSlotStrategy
from tandem.core.strategies.sampling import SamplingStrategy
from tandem.core.strategies.speculative import SpeculativeStrategy, not_speculated_because
from tandem.core.structured_output.manager import StructuredOutputManager
from tandem.core.structured_output.params import StructuredOutputsParams
from tandem.core.executor import WorkerSpec, executor_class


logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self, config: EngineConfig, model_registry, backend_registry
    ) -> None:
        """The registries come from the caller (``LLM`` fills them from the plugins):
        ``model_registry.resolve(architectures)`` and ``backend_registry.select(...)``
        (``tandem.registry``; core imports nothing above it)."""
        self.config = config
        self.scheduler_config = SchedulerConfig(
            config.max_num_seqs, config.max_num_batched_tokens, config.preemption_mode
        )

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
            attn_types=frozenset(AttentionType), block_size=config.block_size, kv_cache_dtype=dtype,
            attn_features=self.model_cls.attn_features(self.hf_config),
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
            from tandem.core.speculative.draft_checkpoint import load_draft

            self.draft = load_draft(config, self.model_cls, self.hf_config, self.tokenizer, model_registry,
                                    backend_registry, num_blocks, sorted(self.eos_token_ids))
        self.scheduler = Scheduler(self.scheduler_config, self.block_manager, self.eos_token_ids, self._seq_ids,
                                   proposer=self.draft)
        self.vocab_size = self.model_cls.vocab_size(self.hf_config)
        # Nothing is imported or built for structured output until a request asks for it.
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        self.core = EngineCore(self.scheduler_config, self.block_manager, self.executor, self.scheduler,
                               config.max_consecutive_step_failures, self.structured)
        self.input_processor = InputProcessor(self.hf_config, self.model_cls, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        # One record (never interleaved with another thread's), one fact per line: a short
        # head, then indented lines; the backends passed over one per line too.
        backend_reason = self._backend_reason.replace(" | ", "\n      | ")
        logger.info(
            "engine ready: %s for %s\n  dtype and device: %s (%s) on %s\n  %s\n  %s\n  attention backend %s (%s)"
            "\n  KV pool %d blocks x %d tokens = %.1f MiB\n  swap space %d blocks = %.2f GiB, committed as used"
            "\n  executor %s, tensor_parallel_size=%d (KV sizes are per rank)",
            self.model_cls.__name__, self.architecture, str(dtype).removeprefix("torch."), config.dtype_reason,
            device, facts["linear_kernels"], facts["host_malloc"],
            self.attn_backend.name, backend_reason, num_blocks, config.block_size,
            num_blocks * block_bytes / (1 << 20), num_cpu_blocks, num_cpu_blocks * block_bytes / GiB,
            type(self.executor).__name__, config.tensor_parallel_size,
        )

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
        self.executor.shutdown()

    # -- requests ------------------------------------------------------------
    def get_default_sampling_params(self) -> SamplingParams:
        """What a request gets for every field it does not set: the checkpoint's
        generation config read as HF ``generate`` reads it (``generation_config="none"``:
        SamplingParams' own defaults)."""
        return self.generation_defaults.params

    def resolve_params(self, params: SamplingParams | None) -> SamplingParams:
        """The request's explicit fields over the defaults; raises ``ValueError`` or
        ``TypeError`` for a combination that cannot be served."""
        if params is None:
            return self.generation_defaults.params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        return merge_params(self.generation_defaults.params, params, self.generation_defaults.source)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        prompt_slot: PromptSlot | None = None,
    ) -> RequestInfo:
        """Validate and queue a request, following its outputs in this engine's
        :meth:`step`; raises ``ValueError`` naming what is wrong. Fields of ``params``
        the caller did not set come from the checkpoint's generation config
        (:meth:`get_default_sampling_params`). ``prompt_slot``: the model completes the
        decoder prompt first (Whisper's language detection)."""
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        info = self.add_core_request(request_id, prompt, params, prompt_slot=prompt_slot)
        self.output_processor.add_request(info)
        return info

    def add_core_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        prompt_slot: PromptSlot | None = None,
    ) -> RequestInfo:
        """:meth:`add_request` for a frontend that follows outputs itself (from
        :meth:`step_core`'s results, with an ``output_processor.RequestState`` built
        from the returned ``RequestInfo``)."""
        self.core.faults.check_alive()
        if request_id in self.scheduler.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = self.resolve_params(params)
        inputs = self.input_processor.process(prompt)
        if inputs.decoder_prompt_is_default and prompt_slot is None:
            default, prompt_slot = self.model_cls.default_decoder_prompt(self.hf_config, self.generation_defaults.hf)
            inputs.prompt_token_ids = list(default)
        if inputs.decoder_prompt_is_default and params.forced_bos_token_id is not None:
            # HF starts from <DEC> alone and the forced BOS processor picks the next
            # token: start there too, so lengths and beam scores count as HF's do.
            inputs.prompt_token_ids = [self.model_cls.decoder_start_token_id(self.hf_config)]
        prompt_len = len(inputs.prompt_token_ids)
        if prompt_slot is not None:
            probe = () if prompt_slot.probe is None else (prompt_slot.probe,)
            bad = [t for t in (*prompt_slot.choices, *prompt_slot.then, *probe) if not 0 <= t < self.vocab_size]
            if not prompt_slot.choices or bad:
                raise ValueError(f"prompt slot {prompt_slot}: needs choices, all in the vocabulary [0, {self.vocab_size})")
            prompt_len += 1 + len(prompt_slot.then)  # the prompt as it will be once completed
        params = resolve_lengths(params, prompt_len, self.model_cls.max_decoder_len(self.hf_config) - prompt_len)
        self._validate(inputs, params, prompt_len)
        self.executor.check_request(params)
        beams = params.use_beam_search
        # Beam search starts from one sequence; it becomes num_beams after the first step.
        seqs = [Sequence(next(self._seq_ids), inputs.prompt_token_ids, i) for i in range(1 if beams else params.n)]
        group = SequenceGroup(request_id, inputs.encoder_inputs, seqs, params, time.monotonic())
        if beams:
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
            strategy = BeamSearchStrategy(params, prompt_len, frozenset(stops))
        else:
            strategy = SamplingStrategy()
        spec = self.config.speculative
        if spec is not None and not_speculated_because(params) is None:
            strategy = SpeculativeStrategy(spec, inputs.encoder_inputs.token_ids, self.scheduler.speculation, strategy,
                                           draft=self.draft)
        if params.structured_outputs is not None:
            # Raises ImportError (no xgrammar) or ValueError (no tokenizer, no EOS) at the door;
            # the compile itself runs off the step loop and a failure is this request's error.
            strategy = self.structured.strategy(params.structured_outputs, strategy)
        group.strategy = PromptSlotStrategy(prompt_slot, strategy) if prompt_slot is not None else strategy
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
            inputs.prompt, list(inputs.prompt_token_ids), self.non_text_token_ids,
        )

    def compile_structured_outputs(self, so: StructuredOutputsParams) -> Future:
        """A future of ``so``'s compiled grammar, for a frontend that wants a bad spec
        refused before it queues the request (a server's 400): it fails with a
        ``ValueError`` (``GrammarCompileError``) naming the field and the cause. The
        compile is cached, so the request that follows reuses it. Thread-safe; raises
        ``ImportError`` naming the ``structured`` extra without xgrammar."""
        return self.structured.grammar(so)

    def max_new_tokens(self, prompt: PromptType) -> int:
        """Tokens the model's decoder positions leave after this prompt's decoder prompt;
        raises ``ValueError`` or ``TypeError`` for a prompt ``add_request`` would reject."""
        inputs = self.input_processor.process(prompt)
        return self.model_cls.max_decoder_len(self.hf_config) - len(inputs.prompt_token_ids)

    def _validate(self, inputs: EncoderDecoderInputs, params: SamplingParams, dec_len: int | None = None) -> None:
        cfg, m = self.hf_config, self.model_cls
        enc = inputs.encoder_inputs
        checks = [("decoder prompt", inputs.prompt_token_ids)]
        if enc.token_ids is not None:  # feature inputs have no vocabulary to check
            checks.insert(0, ("encoder prompt", enc.token_ids))
        for where, ids in checks:
            bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < self.vocab_size]
            if bad:
                i, t = bad[0]
                raise ValueError(
                    f"{where} token id {t} at position {i} is outside the vocabulary [0, {self.vocab_size})"
                )
        enc_len = enc.num_positions
        dec_len = len(inputs.prompt_token_ids) if dec_len is None else dec_len
        if enc_len > m.max_encoder_len(cfg):
            what = "tokens" if enc.token_ids is not None else "encoder positions"
            raise ValueError(
                f"encoder prompt has {enc_len} {what}; the model accepts at most {m.max_encoder_len(cfg)}"
            )
        if dec_len + params.max_tokens > m.max_decoder_len(cfg):  # resolve_lengths keeps this from happening
            raise ValueError(
                f"decoder prompt ({dec_len} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's {m.max_decoder_len(cfg)} decoder positions"
            )
        for name in ("bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "allowed_token_ids",
                     "logit_bias", "forced_bos_token_id", "forced_eos_token_id"):
            value = getattr(params, name)
            if value is None:
                continue
            ids = [value] if isinstance(value, int) else value
            if name == "bad_words_ids":
                ids = [t for seq in value for t in seq]
            elif name == "logit_bias":
                ids = [t for t, _ in value]
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(
                    f"SamplingParams.{name}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
                )
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(
                f"SamplingParams.logprobs={params.logprobs} exceeds the vocabulary size ({self.vocab_size})"
            )
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(
                f"SamplingParams.stop_token_ids: {bad_stop[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        width, what = (params.num_beams, "num_beams") if params.use_beam_search else (params.n, "n")
        if width > self.scheduler_config.max_num_seqs:
            raise ValueError(f"{what}={width} exceeds max_num_seqs={self.scheduler_config.max_num_seqs}")
        # A group preempted by recompute runs its encoder and every decoder token
        # again in one step, so the worst case must fit the step's token budget.
        worst = enc_len + width * (dec_len + params.max_tokens - 1)
        budget = self.scheduler_config.max_num_batched_tokens
        if worst > budget:
            raise ValueError(
                f"request may need {worst} tokens in one step (encoder {enc_len} + {what}={width} x "
                f"(decoder prompt {dec_len} + max_tokens {params.max_tokens} - 1), when recomputed "
                f"after preemption); max_num_batched_tokens={budget}"
            )

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Drop the requests and free their blocks; returns their (aborted) outputs."""
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        outs, _ = self.output_processor.process(self.core.abort(ids))
        return outs

    def abort_core_request(self, request_ids: set[str]) -> list[RequestResult]:
        """:meth:`abort_request` for a frontend that follows outputs itself."""
        return self.core.abort(request_ids)

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
        return self.process_results(self.core.step())

    def step_core(self) -> list[RequestResult]:
        """:meth:`step` for a frontend that follows outputs itself."""
        return self.core.step()

    def process_results(self, results: list[RequestResult]) -> list[RequestOutput]:
        """The outputs of a step's results; stop strings found end their sequences in
        the core now. A request whose output cannot be built fails alone."""
        outputs, stops, failed = [], {}, {}
        for res in results:
            try:
                outs, hits = self.output_processor.process([res])
            except Exception as e:  # noqa: BLE001 - detokenizing this request's output
                failed[res.request_id] = f"building its output failed: {describe(e)}"
                continue
            outputs += outs
            stops.update(hits)
        if stops:
            self.core.stop(stops)
        for rid, why in failed.items():
            self.core.fail({rid: why})
            self.output_processor.forget(rid)
            outputs.append(RequestOutput(rid, None, [], None, [], [], True, error=why))
        return outputs

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

