"""A request made ready for the engine core, with no engine state touched.

``RequestProcessor.process`` does all of a request's own work: its sampling
params over the checkpoint's defaults, its prompt tokenized or its audio
decoded (``InputProcessor``), the decoder prompt completed, lengths resolved
and every check that needs only the model's config. It reads nothing that the
engine thread changes, so ``AsyncLLM`` runs it on its input threads and the
engine thread only queues the result (``LLMEngine.add_processed_request``):
a multi-megabyte prompt or a long audio file never stalls the other requests'
steps. ``LLM`` runs it on the caller's thread, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable

from tandem.core.generation_config import GenerationDefaults, merge_params, resolve_lengths
from tandem.core.inputs import EncoderDecoderInputs, InputProcessor, PromptSlot
from tandem.core.sampling_params import SamplingParams
from tandem.core.sched.scheduler import SchedulerConfig
from tandem.lora.request import LoRARequest, check_lora_request


# Distinct resolved params kept for sharing (then the table starts over).
_INTERNED_PARAMS = 4096


@dataclass
class ProcessedRequest:
    """What ``LLMEngine.add_processed_request`` queues: plain data, checked."""

    inputs: EncoderDecoderInputs
    params: SamplingParams  # resolved: the defaults merged, max_tokens concrete
    prompt_slot: PromptSlot | None
    prompt_len: int  # the decoder prompt as it will be once the slot is completed
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base weights)


class RequestProcessor:
    def __init__(self, hf_config, model_cls: type, tokenizer, generation_defaults: GenerationDefaults,
                 vocab_size: int, scheduler_config: SchedulerConfig,
                 check_request: Callable[[SamplingParams], None], *, enable_lora: bool = False,
                 draft_model: str | None = None) -> None:
        self.hf_config, self.model_cls = hf_config, model_cls
        self.enable_lora, self.draft_model = enable_lora, draft_model
        self.generation_defaults = generation_defaults
        self.vocab_size, self.scheduler_config = vocab_size, scheduler_config
        self.check_request = check_request  # the executor's: params that cannot reach its workers
        self.input_processor = InputProcessor(hf_config, model_cls, tokenizer)
        # Resolved params by value: requests asking for the same thing share one object
        # (see _interned).
        self._params: dict[tuple, SamplingParams] = {}
        self._last_merge: tuple[SamplingParams, SamplingParams] | None = None  # (request's, merged)
        # (merged params, decoder prompt length, their resolved, interned and checked params)
        self._last_resolved: tuple[SamplingParams, int, SamplingParams] | None = None

    def _interned(self, params: SamplingParams) -> SamplingParams:
        """One object for equal resolved params. Merging the checkpoint's defaults and
        resolving lengths makes a new object per request; the worker groups rows by
        params object (one ban, one penalty pass per group, not per request), so equal
        values must be one object. Params are frozen, so sharing is safe; the explicit
        fields are part of the key because beam-search checks read them. An unhashable
        field value (a user's object) leaves the request its own params."""
        key = (params, params.explicit_fields)
        try:
            hit = self._params.get(key)
        except TypeError:
            return params
        if hit is None:
            if len(self._params) >= _INTERNED_PARAMS:
                self._params.clear()
            hit = self._params[key] = params
        return hit

    def resolve_params(self, params: SamplingParams | None) -> SamplingParams:
        if params is None:
            return self.generation_defaults.params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        # One params object for many prompts (LLM.generate's): merged and checked once,
        # not once per prompt (a generation config's 90 suppress_tokens are checked on
        # every merge). Params are frozen, so the same object merges to the same result;
        # the pair is read and written as one tuple, so threads may share it.
        last = self._last_merge
        if last is not None and last[0] is params:
            return last[1]
        merged = merge_params(self.generation_defaults.params, params, self.generation_defaults.source)
        self._last_merge = (params, merged)
        return merged

    def process(self, prompt: Any, params: SamplingParams | None = None,
                prompt_slot: PromptSlot | None = None, lora_request: LoRARequest | None = None) -> ProcessedRequest:
        """Raises ``ValueError`` or ``TypeError`` naming what is wrong. Thread-safe."""
        cfg, m = self.hf_config, self.model_cls
        check_lora_request(lora_request, enable_lora=self.enable_lora, draft_model=self.draft_model)
        params = self.resolve_params(params)
        inputs = self.input_processor.process(prompt)
        if inputs.decoder_prompt_is_default and prompt_slot is None:
            default, prompt_slot = self._default_prompt
            if prompt_slot is not None:  # a slot of its own per request (Whisper's)
                default, prompt_slot = m.default_decoder_prompt(cfg, self.generation_defaults.hf)
            inputs.prompt_token_ids = list(default)
        if inputs.decoder_prompt_is_default and params.forced_bos_token_id is not None:
            # HF starts from <DEC> alone and the forced BOS processor picks the next
            # token: start there too, so lengths and beam scores count as HF's do.
            inputs.prompt_token_ids = [m.decoder_start_token_id(cfg)]
        prompt_len = len(inputs.prompt_token_ids)
        if prompt_slot is not None:
            probe = () if prompt_slot.probe is None else (prompt_slot.probe,)
            bad = [t for t in (*prompt_slot.choices, *prompt_slot.then, *probe) if not 0 <= t < self.vocab_size]
            if not prompt_slot.choices or bad:
                raise ValueError(f"prompt slot {prompt_slot}: needs choices, all in the vocabulary [0, {self.vocab_size})")
            prompt_len += 1 + len(prompt_slot.then)  # the prompt as it will be once completed
        last = self._last_resolved
        if last is not None and last[0] is params and last[1] == prompt_len:
            # The params of the previous request at this decoder length (LLM.generate's one
            # object for every prompt): resolved, interned and checked then; only what
            # reads this request's inputs is checked again.
            params = last[2]
            self.validate(inputs, params, prompt_len, check_params=False)
        else:
            merged = params
            params = self._interned(resolve_lengths(params, prompt_len, self._max_decoder_len - prompt_len))
            self.validate(inputs, params, prompt_len)
            self.check_request(params)
            self._last_resolved = (merged, prompt_len, params)  # one tuple: threads may share it
        _ = inputs.encoder_inputs.cache_key  # hashing audio features: here, not on the engine thread
        return ProcessedRequest(inputs, params, prompt_slot, prompt_len, lora_request)

    # The model's limits and default decoder prompt: read from its config once, not per
    # request (a transformers config attribute costs three Python calls).
    @cached_property
    def _max_encoder_len(self) -> int:
        return self.model_cls.max_encoder_len(self.hf_config)

    @cached_property
    def _max_decoder_len(self) -> int:
        return self.model_cls.max_decoder_len(self.hf_config)

    @cached_property
    def _default_prompt(self) -> tuple[tuple[int, ...], PromptSlot | None]:
        default, slot = self.model_cls.default_decoder_prompt(self.hf_config, self.generation_defaults.hf)
        return tuple(default), slot

    def validate(self, inputs: EncoderDecoderInputs, params: SamplingParams, dec_len: int | None = None,
                 check_params: bool = True) -> None:
        """``ValueError`` for inputs the model cannot take; ``check_params``: the params'
        own token ids too (False: these params passed already)."""
        max_enc, max_dec = self._max_encoder_len, self._max_decoder_len
        enc = inputs.encoder_inputs
        enc_len = enc.num_positions
        dec_len = len(inputs.prompt_token_ids) if dec_len is None else dec_len
        # Lengths first: a prompt of millions of ids is refused before its ids are scanned.
        if enc_len > max_enc:
            what = "tokens" if enc.token_ids is not None else "encoder positions"
            raise ValueError(
                f"encoder prompt has {enc_len} {what}; the model accepts at most {max_enc}"
            )
        if dec_len + params.max_tokens > max_dec:  # resolve_lengths keeps this from happening
            raise ValueError(
                f"decoder prompt ({dec_len} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's {max_dec} decoder positions"
            )
        checks = [("decoder prompt", inputs.prompt_token_ids)]
        if enc.token_ids is not None:  # feature inputs have no vocabulary to check
            checks.insert(0, ("encoder prompt", enc.token_ids))
        for where, ids in checks:
            if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):  # in C; the position only on a miss
                i, t = next((i, t) for i, t in enumerate(ids) if not 0 <= t < self.vocab_size)
                raise ValueError(
                    f"{where} token id {t} at position {i} is outside the vocabulary [0, {self.vocab_size})"
                )
        if check_params:
            self._check_params(params)
        check_step_budget(self.scheduler_config, enc_len, dec_len, params)

    def _check_params(self, params: SamplingParams) -> None:
        """The params' token ids within the vocabulary (read nothing of a request's inputs)."""
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


def check_step_budget(scheduler_config: SchedulerConfig, enc_len: int, dec_len: int, params: SamplingParams) -> None:
    """``ValueError`` unless a request of these lengths can always be scheduled: its sequences
    within ``max_num_seqs`` and its worst step within ``max_num_batched_tokens`` (the engine's
    admission check; tests/core/test_scheduler.py's simulations call it too)."""
    width, what = (params.num_beams, "num_beams") if params.use_beam_search else (params.n, "n")
    if width > scheduler_config.max_num_seqs:
        raise ValueError(f"{what}={width} exceeds max_num_seqs={scheduler_config.max_num_seqs}")
    # A group preempted by recompute runs its encoder and every decoder token
    # again in one step, so the worst case must fit the step's token budget.
    worst = enc_len + width * (dec_len + params.max_tokens - 1)
    budget = scheduler_config.max_num_batched_tokens
    if worst > budget:
        raise ValueError(
            f"request may need {worst} tokens in one step (encoder {enc_len} + {what}={width} x "
            f"(decoder prompt {dec_len} + max_tokens {params.max_tokens} - 1), when recomputed "
            f"after preemption); max_num_batched_tokens={budget}"
        )
